"""scripts/exercise.py: exercises cut from the real code (docs/course.md): a student copy of the repository with
chosen functions' bodies blanked, and the tests that pin each one.

What it does
  list              the numbered exercises: the function, its file, its lesson, the tests that check it
  make DIR [N ...]  a student copy of the repository in DIR (its tracked files: `git ls-files`) with the bodies
                    of exercises N (default: all) replaced by a TODO naming the equation and
                    `raise NotImplementedError`; the signature, the docstring and the body's comment lines (they
                    state the equation) are kept. The blanks are cut from the real code here, with `ast`, so no
                    solution is kept twice.
  check N [N ...] [--dir DIR]
                    runs the tests that pin those functions (one `python -m pytest` in DIR, default this
                    repository: the real code) and prints PASS or FAIL per test; exit 0 only when all pass.
                    A failure says what the exercise checks (its equation) and why the test failed: the case,
                    its inputs, the equation, expected and got (tests/test_advantages.py's `expect`), or the
                    line of the student's code that raised, or the test's lines up to the check that failed. A
                    file of the copy that does not parse, or fails on import, is named with its line.
  The copy has no .venv: it runs with the python that runs this script (keep the repository's environment
  active; `make` prints how).
  An exercise is one row of EXERCISES: add a row (and, where no test pins the function by hand-computed
  numbers, such a test); tests/test_course.py checks that every check fails on its blank and passes on the
  real code.

Reads   the repository (its tracked files, the stage scripts, the tests)
Writes  DIR (make); nothing else (check runs pytest in DIR, without its cache)
Exit    2 with one line "error: ..." for an unknown exercise, a DIR that is not empty (make) or missing
        (check); check: 1 when a test fails.

Usage:  python scripts/exercise.py list
        python scripts/exercise.py make ~/course 3 4        (then, in ~/course, write the two bodies)
        python scripts/exercise.py check 3 4 --dir ~/course (or, inside the copy: python scripts/exercise.py check 3)
"""

from __future__ import annotations

import argparse
import ast
import io
import os
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
import tokenize
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

LESSONS = {
    1: "the EMPA state, the hinge distance and IDR",
    2: "returns and the three estimators",
    3: "the token mask and the clipped update",
    4: "reading a run",
    5: "CARE's rubric reward",
    6: "evaluation with paired intervals",
    7: "the credit playground",
}


@dataclass(frozen=True)
class Exercise:
    number: int
    file: str  # relative to the repository
    function: str  # qualified: "hinge_distance", "Sample.scored"
    lesson: int
    equation: str  # what the TODO names
    tests: tuple[str, ...]  # pytest node ids that pin it


ADV, ENV, ROLL = "tests/test_advantages.py", "tests/test_env.py", "tests/test_rollout.py"
EXERCISES = [
    Exercise(
        1,
        "03_rollout.py",
        "initial_deficit",
        1,
        "EMPA's initial deficit P0 from the nine items: C = -2(C1 + C2 + 1.5 C3), A = -2(A1 + 2 A2 + 1.5 A3), "
        "P = -2(P1 + 2 P2 + 1.5 P3)",
        (f"{ENV}::test_initial_deficit_ranges",),
    ),
    Exercise(
        2,
        "03_rollout.py",
        "levels_to_v",
        1,
        "the progress vector v_t from the judge's MDEP-PR levels: v_t,a = the progress level's points (0, +1, +3) + "
        "the negative level's (0, -2, -4 on C; 0, -2, -5 on A and P)",
        (f"{ENV}::test_levels_to_v_reference_example",),
    ),
    Exercise(
        3,
        "03_rollout.py",
        "hinge_distance",
        1,
        "the hinge distance d(P) = sqrt( sum_a w_a max(0, -eps - P_a)^2 )",
        (f"{ENV}::test_hinge_distance",),
    ),
    Exercise(
        4,
        "03_rollout.py",
        "incremental_distance_rewards",
        1,
        "the incremental distance reward r_t = d(P_{t-1}) - d(P_t), with the weights and eps given",
        (
            f"{ADV}::test_idr_reference_worked_example",
            f"{ADV}::test_idr_weights_eps_and_overshoot",
            f"{ROLL}::test_care_weights_the_distance_and_uniform_is_mica",
        ),
    ),
    Exercise(
        5,
        "03_rollout.py",
        "episode_status",
        1,
        "EMPA's episode end rules: none before min_turns; success when E_total >= ||P0||; collapse; stagnation (the "
        "module's docstring)",
        (f"{ENV}::test_episode_rules",),
    ),
    Exercise(
        6,
        "04_mica_train.py",
        "turn_rewards",
        1,
        "the training reward r_t: the weighted parts, the cut-off penalty, a failed turn filled with the mean",
        (f"{ADV}::test_turn_rewards_weights_penalises_and_fills",),
    ),
    Exercise(
        7,
        "04_mica_train.py",
        "discounted_returns",
        2,
        "the discounted return G_t = r_t + gamma G_{t+1}",
        (f"{ADV}::test_discounted_returns",),
    ),
    Exercise(
        8,
        "04_mica_train.py",
        "turn_level_advantages",
        2,
        "MICA's turn-level advantage A_turn[k][t] = (G[k][t] - mean_t) / (std_t + 1e-6) over the dialogues that "
        "reached turn t (the population std)",
        (f"{ADV}::test_turn_level_advantages_compare_the_dialogues_that_reached_each_turn",),
    ),
    Exercise(
        9,
        "04_mica_train.py",
        "group_level_advantages",
        2,
        "MICA's group-level advantage A_group[k][t] = (r[k][t] - mean) / (std + 1e-6) over all the group's rewards "
        "(the population std)",
        (f"{ADV}::test_group_level_advantages_pool_every_reward",),
    ),
    Exercise(
        10,
        "04_mica_train.py",
        "mica_advantages",
        2,
        "MICA's mix A = alpha A_turn + (1 - alpha) A_group, per scenario group, and its terms A_turn and A_group",
        (
            f"{ADV}::test_mica_unequal_lengths_single_reacher_zero_variance",
            f"{ADV}::test_mica_alpha_extremes",
            f"{ADV}::test_mica_degenerate_groups",
        ),
    ),
    Exercise(
        11,
        "04_mica_train.py",
        "grpo_advantages",
        2,
        "GRPO's advantage: A[k][t] = (R_k - mean) / (std + 1e-6) on every turn, R_k = sum_t r[k][t], over the "
        "scenario group (the sample std)",
        (f"{ADV}::test_grpo_outcome_on_every_turn",),
    ),
    Exercise(
        12,
        "04_mica_train.py",
        "reinforce_pp_advantages",
        2,
        "REINFORCE++'s advantage: the returns G_t whitened over every turn of the batch (the sample std)",
        (f"{ADV}::test_reinforce_pp_whitens_over_the_batch",),
    ),
    Exercise(
        13,
        "04_mica_train.py",
        "Sample.scored",
        3,
        "the token mask: the [start, end) span of every reply that has an advantage (A not None)",
        (f"{ADV}::test_the_token_mask_holds_the_replies_with_an_advantage",),
    ),
    Exercise(
        14,
        "04_mica_train.py",
        "clipped_surrogate",
        3,
        "the clipped surrogate max(-ratio A, -clip(ratio, 1 - clip_low, 1 + clip_high) A) per token, and whether "
        "the clipped term was the larger (the clip chose the loss)",
        (f"{ADV}::test_clipped_surrogate_and_kl",),
    ),
    Exercise(
        15,
        "04_mica_train.py",
        "k3_kl",
        3,
        "the k3 estimate of KL(pi || ref) per token: exp(ref - logp) - (ref - logp) - 1",
        (f"{ADV}::test_clipped_surrogate_and_kl", f"{ADV}::test_k3_kl_averages_to_the_kl_under_the_policy"),
    ),
    Exercise(
        16,
        "01_rubric_sft.py",
        "rubric_score",
        5,
        "CARE's rubric score S(y) = sum_d w_d (1/|C_d|) sum_{c in C_d} s(y, c)",
        ("tests/test_rubric.py::test_care_score_hand_computed", f"{ROLL}::test_care_reward_turn_by_turn"),
    ),
    Exercise(
        17,
        "05_eval.py",
        "t_interval",
        6,
        "the paired t interval: mean +- t_{0.975, n-1} sd / sqrt(n)",
        (
            "tests/test_teaching.py::test_t_interval_on_hand_computed_numbers",
            "tests/test_eval.py::test_a_verdict_needs_three_scenarios_and_a_spread",
        ),
    ),
]
BY_NUMBER = {e.number: e for e in EXERCISES}


class ExerciseError(Exception):
    """A problem the user can fix, reported as one line "error: ..." and exit code 2."""


class Parser(argparse.ArgumentParser):
    def error(self, message):
        raise ExerciseError(message)


def main(argv=None) -> int:
    try:
        args = parse_args(argv)
        if args.command == "list":
            print("\n".join(list_lines()))
            return 0
        if args.command == "make":
            return make(Path(args.dir), pick(args.numbers or [e.number for e in EXERCISES]))
        return check(pick(args.numbers), Path(args.dir))
    except ExerciseError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def pick(numbers) -> list[Exercise]:
    for n in numbers:
        if n not in BY_NUMBER:
            raise ExerciseError(f"no exercise {n}: they are 1-{len(EXERCISES)} (python scripts/exercise.py list)")
    return [BY_NUMBER[n] for n in sorted(set(numbers))]


def list_lines() -> list[str]:
    out = []
    for lesson, title in LESSONS.items():
        out.append(f"lesson {lesson}: {title}")
        mine = [e for e in EXERCISES if e.lesson == lesson]
        if not mine:
            out.append("     (no exercise: read and run)")
        for e in mine:
            out.append(f"  {e.number:2d}. {e.function} ({e.file}): {e.equation}")
            out.extend(f"        {t}" for t in e.tests)
    return out


# ---------------------------------------------------------------------------------------------
# make: the cut
# ---------------------------------------------------------------------------------------------
def find_function(tree: ast.Module, qualname: str, file: str) -> ast.FunctionDef:
    """The def of "name" or "Class.name" at the top of a module."""
    scope, node = tree.body, None
    for part in qualname.split("."):
        node = next((n for n in scope if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name == part), None)
        if node is None:
            raise ExerciseError(f"{file}: no function {qualname} (has it been renamed? scripts/exercise.py's table)")
        scope = node.body
    if not isinstance(node, ast.FunctionDef):
        raise ExerciseError(f"{file}: {qualname} is not a function")
    return node


def header_end(lines: list[str], node: ast.FunctionDef) -> int:
    """The line (1-based) of the colon that ends the def's signature."""
    source = io.StringIO("".join(lines[node.lineno - 1 :]))
    depth = 0
    for tok in tokenize.generate_tokens(source.readline):
        if tok.type == tokenize.OP and tok.string in "([{":
            depth += 1
        elif tok.type == tokenize.OP and tok.string in ")]}":
            depth -= 1
        elif tok.type == tokenize.OP and tok.string == ":" and depth == 0:
            return node.lineno + tok.end[0] - 1
    raise ExerciseError(f"no end of the signature of {node.name}")


def blank(text: str, exercises: list[Exercise], file: str) -> str:
    """The module's text with each exercise's body replaced: the def line(s), the docstring and the body's
    comment lines kept, then a TODO naming the equation and `raise NotImplementedError`."""
    lines = text.splitlines(keepends=True)
    tree = ast.parse(text)
    cuts = []
    for e in exercises:
        node = find_function(tree, e.function, file)
        first, header = node.body[0], header_end(lines, node)
        if first.lineno <= header:
            raise ExerciseError(f"{file}: {e.function} is written on its def line; it cannot be cut")
        docstring = isinstance(first, ast.Expr) and isinstance(getattr(first.value, "value", None), str)
        keep_to = first.end_lineno if docstring else header  # the def line(s) and the docstring stay
        indent = " " * first.col_offset
        # the body's comment lines stay (they state the equation), at the body's indentation
        body = lines[keep_to : node.end_lineno]
        kept = [indent + ln.strip() + "\n" for ln in body if ln.strip().startswith("#")]
        todo = textwrap.wrap(f"TODO exercise {e.number} (lesson {e.lesson}): {e.equation}", 116 - len(indent))
        todo.append(f"the tests that pin it: python scripts/exercise.py check {e.number}")
        todo = [f"{indent}# {line}\n" for line in todo]
        todo.append(f'{indent}raise NotImplementedError("exercise {e.number}: {e.function}")\n')
        cuts.append((keep_to, node.end_lineno, kept + todo))
    for start, end, new in sorted(cuts, reverse=True):
        lines[start:end] = new
    out = "".join(lines)
    ast.parse(out)  # the copy must still be Python
    return out


def tracked_files(root: Path) -> list[str]:
    try:
        p = subprocess.run(["git", "ls-files", "-z"], cwd=root, capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        raise ExerciseError(f"{root} is not a git checkout: make copies its tracked files (git ls-files)") from None
    return [f for f in p.stdout.split("\0") if f]


def make(out: Path, exercises: list[Exercise]) -> int:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ExerciseError(f"{out} is not an empty folder: make writes a fresh copy")
    files = tracked_files(ROOT)
    blanked = {}
    for file in sorted({e.file for e in exercises}):
        text = (ROOT / file).read_text(encoding="utf-8")
        blanked[file] = blank(text, [e for e in exercises if e.file == file], file)
    out.mkdir(parents=True, exist_ok=True)
    copied = 0
    for f in files:
        src, dst = ROOT / f, out / f
        if not src.exists() and not src.is_symlink():
            continue  # deleted in the working tree
        dst.parent.mkdir(parents=True, exist_ok=True)
        if f in blanked:
            dst.write_text(blanked[f], encoding="utf-8")
        else:
            shutil.copy2(src, dst, follow_symlinks=False)
        copied += 1
    print(
        f"{out}: a copy of the repository's {copied} tracked files with exercise{'s' * (len(exercises) > 1)} "
        f"{', '.join(str(e.number) for e in exercises)} blanked (python scripts/exercise.py list names them)"
    )
    print(f"write each body, then: cd {out} && python scripts/exercise.py check N")
    activate = Path(sys.prefix) / "bin" / "activate"
    if activate.is_file():  # the copy has no .venv: the checks run with this one
        print(f"(the copy has no .venv: keep this repository's environment active there, source {activate})")
    return 0


# ---------------------------------------------------------------------------------------------
# check: the tests that pin them, one pytest run, and what each failure teaches
# ---------------------------------------------------------------------------------------------
@dataclass
class Outcome:
    """One test's result: why it failed (one line; "" when it passed) and the lines that explain it."""

    why: str
    detail: list[str]


def node_id(case: ET.Element, where: Path) -> str:
    """A junit testcase's pytest node id: classname "tests.test_env[.Class]" and name -> file::[Class::]name."""
    parts = case.get("classname", "").split(".")
    for i in range(len(parts), 0, -1):
        if (where / ("/".join(parts[:i]) + ".py")).is_file():
            return "::".join(["/".join(parts[:i]) + ".py", *parts[i:], case.get("name", "")])
    return ".".join(parts) + "::" + case.get("name", "")


def test_lines(where: Path, file: str, line: int, most=10) -> list[str]:
    """The lines of a test from its def (or its last `most` lines) to `line`: the case's inputs and the comments
    that work it out by hand."""
    lines = (where / file).read_text(encoding="utf-8").splitlines()[:line]
    start = max((i for i, x in enumerate(lines) if x.startswith("def ")), default=0)
    return lines[max(start, line - most) : line]


def failure(message: str, text: str, where: Path) -> Outcome:
    """A failed test as the student reads it, from its error message and pytest's short traceback (--tb=short).
    A test that names its case (tests/test_advantages.py's `expect`) gives the case, its inputs, the equation,
    expected and got. Otherwise the error's own lines, and where it came from: the line of the student's code
    that raised it, or the test's lines up to the check that failed (its inputs, worked out in comments)."""
    errors = [re.sub(r"^E {0,3}", "", line) for line in text.splitlines() if line.startswith("E ")]
    errors = [line for line in errors if line.strip()] or message.splitlines() or ["failed"]
    first = re.sub(r"^AssertionError: (?=case: )", "", errors[0])
    if first.startswith("case: "):
        return Outcome(first, errors[1:24])
    frames = re.findall(r"^(\S+?):(\d+): in (\S+)\n((?: {4}.*\n?)*)", text, re.M)
    detail = errors[1:24]
    code = [f for f in frames if Path(f[0]).parts[:1] != ("tests",)]
    if code:
        file, line, function, source = code[-1]
        source_lines = [x.strip() for x in source.splitlines() if x.strip() and set(x.strip()) != {"^"}]
        detail += [f"raised at {file} line {line}, in {function}", *[f"    {x}" for x in source_lines[-2:]]]
    elif frames and (where / frames[-1][0]).is_file():
        file, line, function, _ = frames[-1]
        detail.append(f"the check that failed, {file} line {line}, in {function}:")
        detail += [f"    {x}" for x in test_lines(where, file, int(line))]
    return Outcome(first[:200], detail)


def run_tests(where: Path, ids: list[str]) -> tuple[dict[str, Outcome], str]:
    """{node id: its Outcome} for every test pytest ran, and pytest's last line."""
    with tempfile.TemporaryDirectory() as tmp:
        xml = Path(tmp) / "report.xml"
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--tb=short", f"--junitxml={xml}"]
        p = subprocess.run([*cmd, *ids], cwd=where, capture_output=True, text=True, env=env)
        if "No module named pytest" in p.stderr:
            raise ExerciseError(
                f"{sys.executable} has no pytest: check with the repository's environment active (the copy has "
                "no .venv of its own): source /path/to/the/repository/.venv/bin/activate"
            )
        last = (p.stdout.strip().splitlines() or [f"pytest exited {p.returncode}"])[-1]
        results = {}
        if xml.exists():
            for case in ET.parse(xml).getroot().iter("testcase"):
                bad = [c for c in case if c.tag in ("failure", "error", "skipped")]
                outcome = Outcome("", [])
                if bad:
                    message = (bad[0].get("message") or bad[0].tag).strip()
                    first = (message.splitlines() or [bad[0].tag])[0][:200]
                    if bad[0].tag == "failure":
                        outcome = failure(message, bad[0].text or "", where)
                    elif bad[0].tag == "error":
                        first = re.sub(r'^failed on setup with "?', "", first).strip()
                        outcome = Outcome(f"error while setting the test up: {first}", [])
                    else:
                        outcome = Outcome(f"skipped: {first}", [])
                key = node_id(case, where)
                if key not in results or not results[key].why:
                    results[key] = outcome  # a teardown error after a pass still fails it
    return results, last


def syntax_problem(where: Path, file: str) -> list[str]:
    """Where the copy's file does not parse, as lines for the student; [] when it parses."""
    try:
        compile((where / file).read_text(encoding="utf-8"), file, "exec")
    except SyntaxError as e:
        out = [f"{file} line {e.lineno}: {type(e).__name__}: {e.msg}"]
        if e.text:
            out.append("    " + e.text.strip())
        return out
    return []


def import_problem(where: Path, file: str) -> list[str]:
    """Why importing the copy's file fails (the error, and the line of a file of the copy it came from), as lines
    for the student; [] when it imports."""
    module = file.removesuffix(".py").replace("/", ".")
    code = f"import importlib; importlib.import_module({module!r})"
    p = subprocess.run([sys.executable, "-c", code], cwd=where, capture_output=True, text=True)
    if p.returncode == 0:
        return []
    lines = p.stderr.strip().splitlines() or [f"python exited {p.returncode}"]
    here = where.resolve()
    frames = []
    for f, n in re.findall(r'File "([^"]+)", line (\d+)', p.stderr):
        if Path(f).resolve().is_relative_to(here):
            frames.append(f"{Path(f).resolve().relative_to(here).as_posix()} line {n}")
    at = f" at {frames[-1]}" if frames else ""
    return [f"importing {file} fails{at}: {lines[-1]}"]


def check(exercises: list[Exercise], where: Path) -> int:
    if not (where / "tests").is_dir():
        raise ExerciseError(f"--dir {where}: no tests/ folder there (a copy made by `make`, or the repository)")
    # a file that does not parse fails every test that imports it: say where, before the tests run
    problems = {f: syntax_problem(where, f) for f in sorted({e.file for e in exercises})}
    for file, lines in problems.items():
        if lines:
            print(f"error: {file} does not parse, so no test that imports it can run; fix this line first:")
            for line in lines:
                print(f"    {line}")
    ids = list(dict.fromkeys(t for e in exercises for t in e.tests))
    results, last = run_tests(where, ids)
    all_pass = True
    for e in exercises:
        print(f"exercise {e.number}: {e.function} ({e.file}, lesson {e.lesson})")
        mine = {}
        for t in e.tests:
            ran = {k: v for k, v in results.items() if k == t or k.startswith(t + "[")}
            mine.update(ran or {t: Outcome(f"not run ({last})", [])})
        passed = sum(not v.why for v in mine.values())
        if passed < len(mine):
            print(f"    what it checks: {e.equation}")
            stuck = any(v.why.startswith(("not run", "error")) for v in mine.values())
            if stuck and not problems[e.file]:
                problems[e.file] = import_problem(where, e.file)  # an error at import: say where
                for line in problems[e.file]:
                    print(f"    {line}")
        for k, outcome in mine.items():
            print(f"PASS {k}" if not outcome.why else f"FAIL {k}: {outcome.why}")
            for line in outcome.detail:
                print(f"    {line}")
        print(f"exercise {e.number}: {passed} of {len(mine)} tests pass")
        all_pass = all_pass and passed == len(mine)
    return 0 if all_pass else 1


def parse_args(argv=None):
    p = Parser(description="Exercises cut from the real code: list them, make a student copy, check one.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=Parser)
    sub.add_parser("list", help="the numbered exercises, by lesson, with their tests")
    m = sub.add_parser("make", help="a student copy in DIR with those exercises blanked (default: all)")
    m.add_argument("dir", help="an empty or new folder")
    m.add_argument("numbers", nargs="*", type=int, help="exercise numbers (default: all)")
    c = sub.add_parser("check", help="run the tests that pin those exercises, PASS / FAIL per test")
    c.add_argument("numbers", nargs="+", type=int, help="exercise numbers")
    c.add_argument("--dir", default=str(ROOT), help="the copy to test (default: this repository, the real code)")
    return p.parse_args(argv)


if __name__ == "__main__":
    sys.exit(main())

"""The course (docs/course.md): scripts/worked_example.py's table pinned to the last digit and its numbers checked by
hand; scripts/exercise.py's exercises, each check failing on its blank and passing on the real code; every command
of the page run as a user types it (the tiny model in place of SmolLM2, quick flags added), printing what the page
shows, its fork exercise done in a copy, every file and function it says to read found, its exercises those of
`scripts/exercise.py list`."""

import ast
import importlib.util
import math
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

import common
from conftest import ROOT, run_script

# python scripts/worked_example.py, to the last digit (docs/course.md shows the same)
WORKED_EXAMPLE = """\
04_mica_train.py --preset cpu, K = 4 dialogues of one scenario: --reward idr, gamma 0.85, --cut-off-penalty 0.5
(0.866 off a cut-off reply), --max-new-tokens 48, --min-turns 2, --max-turns 3
scenario: P0 = (-4, -6, -2) from EMPA's items C1 1, C2 1, A1 1, A2 1, P1 1; ||P0|| = 7.483, d(P0) = 5.916
columns: v_t the judge's progress vector, d(P_t) the hinge distance after the turn, r_t the training reward,
G_t the return, A_turn and A_group MICA's two terms, A(alpha) MICA's advantage, GRPO's and REINFORCE++'s
(RF++) advantage, and how many of the reply's tokens the loss counts

dialogue k = 0, steady progress: timeout after 3 turns
P_t: (-4, -6, -2) -> (-3, -3, -2) -> (-2, -2, -1) -> (1, -1, -1)
 t          v_t d(P_t)    r_t    G_t A_turn A_group   A(0) A(0.4)   A(1)   GRPO   RF++  tokens scored
 1    (1, 3, 0)  3.000 +2.916 +5.286 +0.782  +1.057 +1.057 +0.947 +0.782 +0.705 +1.448  12 of 12
 2    (1, 1, 1)  1.414 +1.586 +2.788 +1.004  +0.249 +0.249 +0.551 +1.004 +0.705 +0.403  15 of 15
 3    (3, 1, 0)  0.000 +1.414 +1.414 +0.728  +0.145 +0.145 +0.378 +0.728 +0.705 -0.172  10 of 10

dialogue k = 1, large progress on every axis: success after 2 turns
P_t: (-4, -6, -2) -> (-1, -3, 1) -> (2, 0, 4)
 t          v_t d(P_t)    r_t    G_t A_turn A_group   A(0) A(0.4)   A(1)   GRPO   RF++  tokens scored
 1    (3, 3, 3)  2.000 +3.916 +5.616 +0.891  +1.664 +1.664 +1.355 +0.891 +0.705 +1.586  20 of 20
 2    (3, 3, 3)  0.000 +2.000 +2.000 +0.205  +0.501 +0.501 +0.382 +0.205 +0.705 +0.073  18 of 18

dialogue k = 2, the judge fails on turn 2: timeout after 3 turns
P_t: (-4, -6, -2) -> (-4, -5, -2) -> (-4, -5, -2) -> (-3, -4, -2)
 t          v_t d(P_t)    r_t    G_t A_turn A_group   A(0) A(0.4)   A(1)   GRPO   RF++  tokens scored
 1    (0, 1, 0)  5.099 +0.817 +2.722 -0.065  -0.218 -0.218 -0.157 -0.065 +0.007 +0.375  9 of 9
 2 judge failed  5.099 +1.087 +2.241 +0.449  -0.054 -0.054 +0.147 +0.449 +0.007 +0.174  0 of 11 (judge failed)
 3    (1, 1, 0)  3.742 +1.357 +1.357 +0.687  +0.110 +0.110 +0.341 +0.687 +0.007 -0.196  14 of 14

dialogue k = 3, reply 1 runs to the token cap: timeout after 3 turns
P_t: (-4, -6, -2) -> (-6, -6, -2) -> (-5, -5, -1) -> (-5, -7, -1)
 t          v_t d(P_t)    r_t    G_t A_turn A_group   A(0) A(0.4)   A(1)   GRPO   RF++  tokens scored
 1   (-2, 0, 0)  7.141 -2.091 -1.952 -1.609  -1.984 -1.984 -1.834 -1.609 -1.417 -1.581  48 of 48 (cut off)
 2    (1, 1, 1)  5.657 +1.485 +0.163 -1.658  +0.188 +0.188 -0.551 -1.658 -1.417 -0.695  16 of 16
 3   (0, -2, 0)  7.211 -1.554 -1.554 -1.414  -1.658 -1.658 -1.560 -1.414 -1.417 -1.414  13 of 13

- k = 1 ended at turn 2 (success: E_total 9.621 >= ||P0|| 7.483), so A_turn at turn 3 compares only the 3 dialogues
  that reached it (k = 0, 2, 3: G_3 = 1.414, 1.357, -1.554; mean 0.406, population std 1.386); A_group pools all 11
  rewards of the group.
- k = 2, turn 2: the judge failed (v None, the state stays), so r_2 is the mean of the dialogue's valid rewards,
  (0.817 + 1.357) / 2 = 1.087; it counts in G and in the group's statistics, but its 11 tokens are out of the loss
  (A None in the Sample, 0 in the mask).
- k = 3, turn 1: the reply hit the cap (48 tokens, cut off), so r_1 = IDR -1.225 - 0.866 (--cut-off-penalty 0.5 x
  sqrt(3), the IDR of a turn gaining one point on every axis) = -2.091; its tokens are scored.
- alpha 1 gives A = A_turn, alpha 0 gives A = A_group; GRPO gives each dialogue one A on every turn, from its summed
  reward; REINFORCE++ whitens G over the batch (here this group's 11 turns) with no groups.
"""


def test_worked_example_prints_the_pinned_table():
    p = run_script("scripts/worked_example.py", timeout=300)
    assert p.returncode == 0, p.stderr
    assert p.stdout == WORKED_EXAMPLE


def load(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_worked_example_numbers_by_hand():
    x = load("worked_example").worked_example()
    trajs, r, G, failed = x["trajs"], x["rewards"], x["G"], x["failed"]
    # the dialogue of large steps ends at turn 2: E_total = 2 * 36 / ||P0|| >= ||P0|| = sqrt(56); it has no turn 3
    assert [tr.T for tr in trajs] == [3, 2, 3, 3] and [tr.outcome for tr in trajs][:2] == ["timeout", "success"]
    assert len(r[1]) == len(G[1]) == len(x["A_turn"][1]) == 2
    # IDR by hand: d(P0) = sqrt(9 + 25 + 1), d(P1) of k = 0 = sqrt(4 + 4 + 1) = 3
    assert r[0][0] == pytest.approx(math.sqrt(35) - 3)
    # the cut-off reply: IDR d(P0) - d((-6, -6, -2)) = sqrt(35) - sqrt(51), less 0.5 sqrt(3)
    assert trajs[3].cut_off == [True, False, False]
    assert r[3][0] == pytest.approx(math.sqrt(35) - math.sqrt(51) - 0.5 * math.sqrt(3))
    # the failed turn: the state stays, its reward is the mean of the dialogue's other rewards
    assert failed[2] == [False, True, False] and trajs[2].states[2] == trajs[2].states[1]
    assert r[2][1] == pytest.approx((r[2][0] + r[2][2]) / 2)
    # G_t = r_t + 0.85 G_{t+1}
    assert G[3] == pytest.approx([r[3][0] + 0.85 * (r[3][1] + 0.85 * r[3][2]), r[3][1] + 0.85 * r[3][2], r[3][2]])
    # A_turn at turn 3 compares k = 0, 2, 3 only (population std); at turn 1 all four
    for t, reached in ((2, [0, 2, 3]), (0, [0, 1, 2, 3])):
        mean, std = common.mean_std([G[k][t] for k in reached], ddof=0)
        assert [x["A_turn"][k][t] for k in reached] == pytest.approx(
            [(G[k][t] - mean) / std for k in reached], abs=1e-5
        )
    # A_group over all 11 rewards; alpha 1 gives A_turn, alpha 0 A_group, 0.4 the mix
    flat = [v for rk in r for v in rk]
    mean, std = common.mean_std(flat, ddof=0)
    assert x["A_group"][3][2] == pytest.approx((r[3][2] - mean) / std, abs=1e-5)
    assert x["mica"][1.0] == x["A_turn"] and x["mica"][0.0] == x["A_group"]
    for k in range(4):
        mix = [0.4 * a + 0.6 * b for a, b in zip(x["A_turn"][k], x["A_group"][k])]
        assert x["mica"][0.4][k] == pytest.approx(mix)
    # GRPO: one A per dialogue from its summed reward (sample std); REINFORCE++: G whitened over all 11 turns
    R = [sum(rk) for rk in r]
    mean, std = common.mean_std(R, ddof=1)
    for k in range(4):
        assert x["grpo"][k] == pytest.approx([(R[k] - mean) / std] * trajs[k].T, abs=1e-5)
    mean, std = common.mean_std([g for Gk in G for g in Gk], ddof=1)
    assert x["reinforce_pp"][0] == pytest.approx([(g - mean) / std for g in G[0]], abs=1e-5)
    # the loss counts every token of every reply but the failed turn's 11
    assert x["scored"][2] == [9, 0, 14] and x["scored"][3] == [48, 16, 13]
    assert sum(map(sum, x["scored"])) == sum(s.n_tokens() for s in x["samples"]) == 12 + 15 + 10 + 20 + 18 + 9 + 14 + 77


# ---------------------------------------------------------------------------------------------
# scripts/exercise.py
# ---------------------------------------------------------------------------------------------
def exercise(*args, cwd=None):
    return subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "exercise.py"), *map(str, args)],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=600,
    )


def checked(stdout) -> dict[int, list[tuple[str, str]]]:
    """check's output -> {exercise: [(PASS or FAIL, the rest of the line)]}."""
    out, n = {}, None
    for line in stdout.splitlines():
        if line.startswith("exercise ") and not line.endswith("pass"):
            n = int(line.split()[1].rstrip(":"))
            out[n] = []
        elif line.startswith(("PASS ", "FAIL ")):
            out[n].append((line[:4], line[5:]))
    return out


def test_exercise_list_make_and_check_refuse_bad_input_with_one_line(tmp_path):
    p = exercise("list")
    assert p.returncode == 0
    listed = [line.split()[1] for line in p.stdout.splitlines() if line[:5].strip().rstrip(".").isdigit()]
    # the fourteen, at least: the hinge distance, IDR, the end rules, G_t, the three terms of MICA, GRPO,
    # REINFORCE++, the clipped surrogate, k3 KL, the token mask, CARE's S(y), the paired t interval
    for name in (
        "hinge_distance incremental_distance_rewards episode_status discounted_returns turn_level_advantages "
        "group_level_advantages mica_advantages grpo_advantages reinforce_pp_advantages clipped_surrogate k3_kl "
        "Sample.scored rubric_score t_interval"
    ).split():
        assert name in listed, name
    assert len(listed) >= 14 and "tests/test_env.py::test_hinge_distance" in p.stdout
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    for args, message in [
        (("make", tmp_path / "full", 3), f"error: {tmp_path / 'full'} is not an empty folder"),
        (("make", tmp_path / "new", 3, 99), "error: no exercise 99: they are 1-"),
        (("check", 0), "error: no exercise 0: they are 1-"),
        (("check", 3, "--dir", tmp_path / "full"), "error: --dir"),
        (("check", "three"), "error: argument numbers: invalid int value"),
    ]:
        p = exercise(*args)
        assert p.returncode == 2 and p.stdout == "" and p.stderr.startswith(message), (args, p.stderr)
        assert len(p.stderr.strip().splitlines()) == 1
    assert sorted(x.name for x in (tmp_path / "full").iterdir()) == ["x"] and not (tmp_path / "new").exists()


@pytest.mark.skipif(not (ROOT / ".git").exists(), reason="make copies the tracked files: needs a git checkout")
def test_every_exercise_fails_on_its_blank_and_passes_on_the_real_code(tmp_path):
    table = load("exercise").EXERCISES
    numbers = [e.number for e in table]
    # the real code: every check passes (one pytest run), every node id named runs
    p = exercise("check", *numbers)
    assert p.returncode == 0, p.stdout + p.stderr
    real = checked(p.stdout)
    for e in table:
        assert len(real[e.number]) >= len(e.tests) and all(s == "PASS" for s, _ in real[e.number]), real[e.number]
    # a copy with every exercise blanked: it imports, and every check fails
    p = exercise("make", tmp_path / "all")
    assert p.returncode == 0, p.stderr
    stages = "01_rubric_sft", "02_rubric_pref_rl", "03_rollout", "04_mica_train", "05_eval"
    imports = f"import importlib; [importlib.import_module(m) for m in {stages!r}]"
    p = subprocess.run([sys.executable, "-c", imports], cwd=tmp_path / "all", capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    p = exercise("check", *numbers, "--dir", tmp_path / "all")
    assert p.returncode == 1
    blanked = checked(p.stdout)
    # each test fails, and where it failed on its own exercise's blank the message says so; a test that reached
    # another blank first (the clipped surrogate's test of k3 KL) is run again on a copy with that exercise alone
    # blanked
    alone = set()
    for e in table:
        assert len(blanked[e.number]) == len(real[e.number]) and all(s == "FAIL" for s, _ in blanked[e.number])
        if not all(f"NotImplementedError: exercise {e.number}: {e.function}" in why for _, why in blanked[e.number]):
            alone.add(e.number)
    assert len(alone) <= 3, alone  # each costs a pytest run: keep the tests of an exercise on its own function
    for n in sorted(alone):
        assert exercise("make", tmp_path / f"only{n}", n).returncode == 0
        p = exercise("check", n, "--dir", tmp_path / f"only{n}")
        assert p.returncode == 1
        for status, why in checked(p.stdout)[n]:
            assert status == "FAIL" and f"NotImplementedError: exercise {n}: " in why, why


# ---------------------------------------------------------------------------------------------
# docs/course.md: every command runs as the page gives it, every name it says to read exists, its exercises
# are scripts/exercise.py's
# ---------------------------------------------------------------------------------------------
COURSE = ROOT / "docs" / "course.md"
# the scripts that load a model: here they get the tiny model and these flags after the page's (argparse: the
# last of a flag given twice wins); the playground gets fewer seeds, steps and dialogues, and its own --out
MODEL_SCRIPTS = ("01_rubric_sft.py", "02_rubric_pref_rl.py", "03_rollout.py", "04_mica_train.py", "05_eval.py")
QUICK = {
    "01_rubric_sft.py": ["--steps", "2", "--eval-every", "2", "--eval-limit", "2", "--max-new-tokens", "12"],
    "02_rubric_pref_rl.py": ["--max-new-tokens", "12", "--report-limit", "2"],
    "03_rollout.py": ["--max-new-tokens", "6"],
    "04_mica_train.py": ["--max-new-tokens", "6"],
    "05_eval.py": ["--max-new-tokens", "6"],
    "experiments/credit.py": [
        *("--seeds", "2", "--steps", "6", "--eval-every", "3", "--eval-k", "1", "--final-eval-k", "1"),
        *("--beam-width", "4", "--survivor-groups", "3"),
    ],
}
# what each command prints, at least: (a piece of the command, lines both the page and the output hold); the
# first piece found in a command is its entry
EXPECT = [
    ("env.hinge_distance", ["[5.916, 3.0, 0.0] [2.916, 3.0]"]),
    ("python 03_rollout.py", ["trajectories in", "| success ", "judge failed on 0/"]),
    ("python scripts/worked_example.py", WORKED_EXAMPLE.splitlines()[8:11]),
    ("python scripts/exercise.py check", ["exercise 13: 1 of 1 tests pass", "exercise 15: 2 of 2 tests pass"]),
    ("python 04_mica_train.py", ["trainable parameters", "step    2 | reward_mean", "--adapters takes it)"]),
    ("python scripts/view_run.py", ["/rollouts.html"]),
    ("metrics.jsonl", ['{"step": 2, "reward_mean": ', '"clip_frac": ']),
    ("python 01_rubric_sft.py", ["eval_parse_valid", "(02_rubric_pref_rl.py --adapter takes it)"]),
    ("python 02_rubric_pref_rl.py", ["| preference-recovery accuracy |", "frozen rubric generator: "]),
    ("python 05_eval.py", ["vs base on 3 scenarios, 6 dialogues paired by scenario, k and seed", "  IDR return "]),
    ("--survivors", ["## The survivor question (table delayed", "| all |"]),
    ("--table delayed", ["| MICA (alpha=1) |", "| myopic greedy (argmax r_t, knows the table) |"]),
    ("python experiments/credit.py", ["| MICA (alpha=0) |", "| search ceiling (beam"]),
]
FORK_EXPECT = ["| RLOO |"]
GROUPS = {"1": [1], "2": [2], "3": [3], "4+6": [4, 6], "5": [5], "7": [7]}  # 6 evaluates 4's adapter


def lessons() -> dict[int, str]:
    """{n: the text of "## Lesson n" up to the next "## "}."""
    out = {}
    for part in re.split(r"^## ", COURSE.read_text(encoding="utf-8"), flags=re.M):
        m = re.match(r"Lesson (\d+)", part)
        if m:
            out[int(m.group(1))] = part
    return out


def commands(text: str) -> list[str]:
    """The lines of the text's ```bash blocks (a line ending in a backslash joined to the next), comments
    dropped."""
    out = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = re.sub(r"(^|\s+)#\s.*$", "", line).strip()
            if line:
                out.append(line)
    return out


def python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, re.S)


def linked_copy(where: Path) -> Path:
    """A folder that reads as the repository: a link to each of its top-level entries but runs/, so what the
    page's commands write under runs/ lands here."""
    where.mkdir()
    for entry in ROOT.iterdir():
        skip = entry.name in ("runs", ".git", ".venv", "__pycache__") or entry.name.startswith((".pytest", ".ruff"))
        if not skip:
            (where / entry.name).symlink_to(entry)
    return where


def shell(tmp_path: Path) -> dict:
    """The environment the page's commands run in: `python` is this interpreter, offline."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "python").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    (bin_dir / "python").chmod(0o755)
    return dict(
        os.environ,
        PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
    )


def run_command(line: str, cwd: Path, env: dict, tiny_model: str, n: int) -> subprocess.CompletedProcess:
    """One command of the page as a user types it, with the tiny model and the quick flags added."""
    extra = []
    for script, flags in QUICK.items():
        if f"python {script}" in line:
            model = ["--model", tiny_model] if script in MODEL_SCRIPTS else ["--out", f"runs/credit-test{n}"]
            extra = [*model, *flags]
    return subprocess.run(
        ["bash", "-c", line + "".join(" " + shlex.quote(x) for x in extra)],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def check_output(line: str, p: subprocess.CompletedProcess, page: str, expect=None):
    assert p.returncode == 0, (line, p.stdout[-2000:], p.stderr[-3000:])
    keys = expect or next((keys for piece, keys in EXPECT if piece in line), None)
    assert keys, f"{line}: no entry in EXPECT says what it prints"
    for key in keys:
        assert key in page, f"the page does not show {key!r} for {line}"
        assert key in p.stdout, (line, key, p.stdout[-3000:])


def forked(copy: Path, fork_text: str) -> Path:
    """The fork exercise done in a copy: the page's first python block replaces 04's one-line ADVANTAGES, its
    second replaces experiments/credit.py's estimator_list."""
    trainer_block, credit_block = python_blocks(fork_text)
    (copy / "04_mica_train.py").unlink()
    text = (ROOT / "04_mica_train.py").read_text(encoding="utf-8")
    (line,) = [x for x in text.splitlines(keepends=True) if x.startswith("ADVANTAGES = {")]
    (copy / "04_mica_train.py").write_text(text.replace(line, trainer_block), encoding="utf-8")
    (copy / "experiments").unlink()
    (copy / "experiments").mkdir()
    for f in (ROOT / "experiments").iterdir():
        if f.suffix == ".py" and f.name != "credit.py":
            (copy / "experiments" / f.name).symlink_to(f)
    lines = (ROOT / "experiments" / "credit.py").read_text(encoding="utf-8").splitlines(keepends=True)
    node = next(n for n in ast.parse("".join(lines)).body if getattr(n, "name", None) == "estimator_list")
    lines[node.lineno - 1 : node.end_lineno] = [credit_block]
    (copy / "experiments" / "credit.py").write_text("".join(lines), encoding="utf-8")
    return copy


@pytest.mark.parametrize("group", list(GROUPS))
def test_every_command_of_the_course_runs_and_prints_what_the_page_shows(group, tiny_model, tmp_path):
    page, env, by_lesson = COURSE.read_text(encoding="utf-8"), shell(tmp_path), lessons()
    assert sorted(by_lesson) == sorted(n for ns in GROUPS.values() for n in ns)
    copy = linked_copy(tmp_path / "repo")
    ran = 0
    for lesson in GROUPS[group]:
        text, _, fork_text = by_lesson[lesson].partition("### The fork exercise")
        for line in commands(text):
            ran += 1
            check_output(line, run_command(line, copy, env, tiny_model, ran), page)
        if fork_text:
            fork = forked(linked_copy(tmp_path / "fork"), fork_text)
            for line in commands(fork_text):
                ran += 1
                check_output(line, run_command(line, fork, env, tiny_model, ran), page, FORK_EXPECT)
    assert ran > 0


def test_the_course_shows_the_worked_example_as_it_prints():
    assert WORKED_EXAMPLE in COURSE.read_text(encoding="utf-8")


def test_every_file_and_function_the_course_says_to_read_exists():
    for n, text in lessons().items():
        read = re.search(r"\*\*Read\.\*\*(.*?)\n\n", text, re.S)
        assert read, f"lesson {n} has no **Read.** paragraph"
        file, names = None, 0
        for token in re.findall(r"`([^`]+)`", read.group(1)):
            if token.endswith(".py"):
                file = ROOT / token
                assert file.is_file(), f"lesson {n}: no file {token}"
                source = file.read_text(encoding="utf-8")
                continue
            assert file is not None, f"lesson {n}: {token} before any file"
            for part in token.split("."):
                pattern = rf"^\s*(def|class)\s+{re.escape(part)}\b|^{re.escape(part)}\s*=|^{re.escape(part)}\s*:"
                assert re.search(pattern, source, re.M), f"lesson {n}: no {token} in {file.name}"
            names += 1
        assert names >= 2, f"lesson {n} names fewer than 2 functions to read"


def test_the_lessons_name_the_exercises_of_scripts_exercise_list():
    p = exercise("list")
    assert p.returncode == 0
    listed, lesson = {}, None
    for line in p.stdout.splitlines():
        if m := re.match(r"lesson (\d+):", line):
            lesson = int(m.group(1))
            listed[lesson] = set()
        elif m := re.match(r"\s+(\d+)\. ", line):
            listed[lesson].add(int(m.group(1)))
    text = COURSE.read_text(encoding="utf-8")
    for n, body in lessons().items():
        said = re.search(r"\*\*Exercises: ([^*]+?)\.?\*\*", body)
        assert said, f"lesson {n} names no exercises"
        numbers = set() if said.group(1) == "none" else {int(x) for x in said.group(1).split(",")}
        assert numbers == listed[n], (n, numbers, listed[n])
        # the overview table's column: "1-6", "16", "none" or "the fork exercise"
        (cell,) = re.findall(rf"^\| {n} \|.*\| ([^|]+) \|$", text, re.M)
        ranges = [tuple(map(int, r.split("-"))) for r in re.findall(r"\d+(?:-\d+)?", cell)]
        table = {x for r in ranges for x in range(r[0], r[-1] + 1)}
        assert table == listed[n], (n, cell, listed[n])
    assert set(listed) == set(lessons())

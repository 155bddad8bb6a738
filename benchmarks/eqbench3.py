"""benchmarks/eqbench3.py: EQ-Bench 3 (the rubric benchmark), run by 05_eval.py --suite eqbench3.

What it is
  EQ-Bench 3 (github.com/EQ-bench/eqbench3) plays each scenario's fixed user turns to the tested model (role-play,
  message drafting, analysis of a transcript), then an LLM judge scores the transcript on criteria, 0-20 each.
  Its leaderboard's main number, a pairwise Elo, is not computed here (docs/evaluation.md says how to get it).
What this file holds
  add_args, check_args, read, units           05's flags and checks, the tasks it samples, its (task, iteration)s
  protocol        the official files of --eqbench3-dir, read at run time and checked: the tasks, the three master
                  templates, the debrief, the two judge prompts and criteria lists, the output format's reasoning
                  line (core/benchmark.py, found with `ast`)
  read_tasks      data/scenario_prompts.txt as the official parser reads it; the kind from the official id sets
  wrap, sections, render, transcript, judge_prompt   the texts as sent: the user turn, the reply's sections and
                  their rendering, the judge's transcript and prompt
  api_text, json_object, read_scores          the harness client's cut of a reply, the judge's answer read
  task_score, rubric_score                    a task's mean, the score
  official_cases  the official protocol on a batch of (task, iteration) units (respond: the tested model's replies)
  cases           05's entry: official_cases with --eqbench3-dir, else this project's variant or offline proxy
  summary, column, cell, notes                05's summary, table column, cell and results.md lines
  load, proxy_scores, parse_criteria          the variant without --eqbench3-dir

Score (official)
  s_ti = the mean of task t's allowed criterion scores in iteration i (role-play, drafting, no-role-play: those
         of STANDARD_ALLOWED the judge gave; analysis: those of rubric_scoring_criteria_analysis.txt; a criterion
         overall_eq would count 3 times)
  EQ-Bench 3 rubric score = 5 * round(mean over every scored (t, i) of s_ti, 2)            0-100
Official protocol (--eqbench3-dir PATH, a checkout of github.com/EQ-bench/eqbench3; its texts read from PATH)
  The tasks are the scenarios of data/scenario_prompts.txt with a `####### Prompt<N>` turn (45 at 3c21bcc:
  scenario 409's `####### 1` is not a turn marker, so it has none); kinds by id: analysis 401-420, drafting
  201-209, no role-play 8, 10, 12, 14, the rest role-play. Each user turn is the task's master template with
  the turn in {scenario_prompt} (no role-play: the turn as it is); every turn is played, the tested model
  sampling at temperature 0.7, min_p 0.1, up to 12,000 new tokens. Then, except for analysis, the debrief
  (debrief_prompt.txt) at temperature 0.5, no min_p. A task is judged when one of its scenario replies has
  at least 100 characters (stripped). The judge prompt is rubric_scoring_prompt[_analysis].txt with
  {transcript} ("User:" / "Assistant:" blocks joined by "---"; role-play and drafting replies re-rendered
  from their three parsed sections, a missing one empty), {debrief} and {output_format} (the reasoning line,
  then each criterion as 0-20, indented JSON), every "*" and "#" removed; the judge answers at temperature 0,
  up to 8,000 tokens. Its answer is read leniently (the last of several ```json blocks, the first balanced
  object, newlines and stray quotes inside strings repaired; a string value gives its first number, as in
  "15/20"); an answer with no number fails the task. Scored tasks give the score above; --iterations N
  plays every task N times.
Where the official code is broken, ambiguous or depends on an API, and what this file does
  1. The harness calls an endpoint (no top_p: 1); here the tested model runs in process (transformers'
     generate: temperature, then min_p; top_p 1, top_k off; every other setting the model's own
     generation_config, as an endpoint serving it applies), the messages rendered by its chat template with
     no system prompt (the harness sends none). A reply gets 12,000 tokens, fewer with --eqbench3-tokens, or
     the room left under --max-context; the column then says "reply budget lowered to N tokens". A turn with
     no room left fails the task ("context limit"), as an endpoint's refusal does there; 05's cell counts
     them ("N failed (M at the context limit)").
  2. A reply is the decoded text cut as the harness's client cuts it (after a closing </think> or
     </reasoning> when both tags are there) and stripped of surrounding whitespace (the harness keeps what
     the endpoint sent). An api: judge's answer gets the same cut, then the strip the harness applies; an
     hf: or self judge's answer this project's strip_thinking.
  3. ALLOW_INCOMPLETE_RESPONSES is True in the official code: the guard checks only that a scenario reply
     has 100 characters; the debrief must exist (here it always does), empty or not. A task that fails the
     guard is not judged: failed, "no reply of 100 characters".
  4. One judge call per task (--judge-retries unused): an unparsable answer fails the task, as it ends the
     official task in error; the endpoint's own failures are retried (--api-retries; the harness: 3 tries).
     --eqbench3-judge-tokens lowers its 8,000 tokens (a slow judge, a test): the column then says so.
  5. The official run hard-codes truncate_for_rubric=False: no character limit on the judged text.
  6. The allowed criteria for role-play and drafting are a set written in the official code, not a file:
     STANDARD_ALLOWED here. Iterations are pooled: one mean over every scored (task, iteration) pair.
  7. A missing file, an empty template, a missing placeholder, or a template str.format cannot fill (braces
     of its own; {debrief} in the analysis judge prompt) stops the harness at run time or fails those tasks;
     here it is one error naming the file (exit 2) before any model is loaded.
  8. scenario_prompts.txt is read line by line as the harness reads it (UTF-8: a byte-order mark would hide
     the first header there too; a later scenario with an id seen before replaces its prompts in place).
This project's variant (no --eqbench3-dir; not comparable with EQ-Bench 3)
  - load reads scenario_prompts.txt tolerantly (`####### 1` counts; kinds: ids 401-420 or an "analysis"
    category, a "draft" category); the raw turns are sent; replies are capped at --max-new-tokens, and later
    turns that do not fit --max-context are not played (the task judged on those before; 05's cell: "N ended
    at the context limit"); no debrief.
  - An LLM judge gets this project's prompt (data/prompts.json "eqbench3_judge") and six criteria per kind:
    score = 5 * the mean over tasks of the mean of the task's criterion scores.
  - Offline (the embed judge) it is a PROXY: per axis clip(10 + 5 (progress - negative), 0, 20), each criterion
    the mean of its stand-in axis over the replies; analysis tasks are not scored (nothing offline can judge
    them).
A support module: it imports common.py and its package (benchmarks.checkout), never a stage; 05 hands it
the model, the judge and the flags.
"""

from __future__ import annotations

import ast
import functools
import json
import re
import statistics
from dataclasses import dataclass
from pathlib import Path

import backends
import benchmarks
import common
import options
import runs
import sampling

HERE = Path(__file__).resolve().parents[1]
TEXTS = json.loads((HERE / "data" / "prompts.json").read_text(encoding="utf-8"))
TEXTS["eqbench3_judge"] = "\n".join(TEXTS["eqbench3_judge"])
ROLEPLAY_CRITERIA, ANALYSIS_CRITERIA = (tuple(TEXTS["eqbench3_criteria"][k]) for k in ("roleplay", "analysis"))
PROXY = "EQ-Bench 3 (offline proxy, not comparable with EQ-Bench 3)"  # the embed judge's levels as the criteria
VARIANT = "EQ-Bench 3 (this project's judge prompt, not comparable with EQ-Bench 3)"  # an LLM judge, no dir
AXES = ("C", "A", "P")  # the embed judge's axes (the proxy's stand-ins)
# the official protocol's facts (utils/constants.py, core/benchmark.py, core/conversation.py at 3c21bcc)
OFFICIAL_TASKS = 45  # the tasks its parser keeps from its scenario_prompts.txt
NO_ROLEPLAY_IDS = frozenset({"8", "10", "12", "14"})
DRAFTING_IDS = frozenset(str(i) for i in range(201, 210))
ANALYSIS_IDS = frozenset(str(i) for i in range(401, 421))
STANDARD_ALLOWED = frozenset(
    {
        "demonstrated_empathy",
        "pragmatic_ei",
        "depth_of_insight",
        "social_dexterity",
        "emotional_reasoning",
        "message_tailoring",
        "theory_of_mind",
        "subtext_identification",
        "intellectual_grounding",
        "correctness",
    }
)
WEIGHTS = {"overall_eq": 3}  # a criterion counted more than once in a task's mean
REPLY_TOKENS, TEMPERATURE, MIN_P = 12_000, 0.7, 0.1  # each scenario turn
DEBRIEF_TEMPERATURE = 0.5  # the debrief: no min_p, the same token budget
JUDGE_TOKENS, JUDGE_TEMPERATURE = 8_000, 0.0
MIN_REPLY_CHARS = 100  # the guard: some scenario reply this long (stripped), or not judged
AT_LIMIT = "context limit"  # an official task failed so: a turn with no room left under --max-context
REASONING_KEY = "chain_of_thought_reasoning"
FILES = {
    "prompts": "scenario_prompts.txt",
    "roleplay": "scenario_master_prompt.txt",
    "drafting": "scenario_master_prompt_message_drafting.txt",
    "analysis": "scenario_master_prompt_analysis.txt",
    "debrief": "debrief_prompt.txt",
    "criteria": "rubric_scoring_criteria.txt",
    "criteria_analysis": "rubric_scoring_criteria_analysis.txt",
    "judge": "rubric_scoring_prompt.txt",
    "judge_analysis": "rubric_scoring_prompt_analysis.txt",
}  # under data/
# a reply's sections (the master templates' headings): (key, heading as re-rendered, heading as matched, what
# ends it), in the order re-rendered
SECTIONS = {
    "roleplay": (
        ("thinking_feeling", "I'm thinking & feeling", r"I['\u2019]m thinking & feeling", "#"),
        ("their_thinking_feeling", "They're thinking & feeling", r"They['\u2019]re thinking & feeling", "#"),
        ("response", "My response", "My response", "--"),
    ),
    "drafting": (
        ("perspective_taking", "Perspective-taking", "Perspective[- ]taking", "#"),
        ("draft_brainstorming", "Draft brainstorming", "Draft brainstorming", "#"),
        ("draft", "Draft", "Draft", "--"),
    ),
}


# ---------------------------------------------------------------------------------------------
# 05's flags, its loader, and its entry
# ---------------------------------------------------------------------------------------------
@dataclass
class Options:
    """05's options for EQ-Bench 3's official protocol."""

    eqbench3_dir: str | None = options.option(
        None,
        "EQ-Bench 3 by its official protocol: a checkout of github.com/EQ-bench/eqbench3, its data/ texts read from "
        "there; --judge an LLM (unset: this project's variant, or offline a proxy, neither comparable with EQ-Bench 3)",
    )
    iterations: int = options.option(
        1,
        "EQ-Bench 3 with --eqbench3-dir: plays of every task (the official --iterations)",
        type=options.number(int, low=1),
    )
    eqbench3_tokens: int = options.option(
        REPLY_TOKENS,
        "EQ-Bench 3 with --eqbench3-dir: a reply's token budget (lowering it is said in the column)",
        type=options.number(int, low=1, high=REPLY_TOKENS),
    )
    eqbench3_judge_tokens: int = options.option(
        JUDGE_TOKENS,
        "EQ-Bench 3 with --eqbench3-dir: the judge's token budget (lowering it is said in the column)",
        type=options.number(int, low=1, high=JUDGE_TOKENS),
    )


def check_args(args, default_file: str):
    c = common.check
    c(
        not args.eqbench3_dir or args.eqbench3 == default_file,
        "--eqbench3 is the variant's file: with --eqbench3-dir the tasks are PATH/data/scenario_prompts.txt",
    )
    c(
        args.eqbench3_dir
        or (args.iterations, args.eqbench3_tokens, args.eqbench3_judge_tokens) == (1, REPLY_TOKENS, JUDGE_TOKENS),
        "--iterations, --eqbench3-tokens and --eqbench3-judge-tokens are the official protocol's: pass --eqbench3-dir",
    )
    c(
        not args.eqbench3_dir or "eqbench3" not in args.suites or args.judge != "embed",
        "--eqbench3-dir: EQ-Bench 3's judge is an LLM: pass --judge api:<model> (or hf:<model>, self); the offline "
        "embed judge cannot score its rubric",
    )


def read(args) -> tuple[list[dict], str]:
    """The tasks 05 samples (--max-cases) and what it prints about them."""
    if not args.eqbench3_dir:
        tasks, stats = load(args.eqbench3)
        return tasks, (
            f"eqbench3: read {stats['scenarios']} scenarios and {stats['prompts']} prompts from "
            f"{args.eqbench3} ({stats['ignored_lines']} lines outside prompts, {stats['empty_scenarios']} "
            f"scenarios without prompts and {stats['duplicates']} duplicate ids skipped)"
        )
    P = protocol(args.eqbench3_dir)
    kinds = {k: sum(t["kind"] == k for t in P.tasks) for k in ("roleplay", "drafting", "no_roleplay", "analysis")}
    return P.tasks, (
        f"eqbench3: official protocol, {len(P.tasks)} tasks read from {P.folder} at {P.commit} ("
        + ", ".join(f"{n} {k}" for k, n in kinds.items())
        + f"), {args.iterations} iteration(s)"
    )


def units(tasks: list[dict], args) -> list[dict]:
    """The units 05 batches: with --eqbench3-dir every task once per iteration (case "<id>#<iteration>")."""
    if not args.eqbench3_dir:
        return tasks
    return [{**t, "case": f"{t['id']}#{i}", "iteration": i} for i in range(1, args.iterations + 1) for t in tasks]


def cases(model, tok, tasks, judge, user, args) -> tuple[list[dict], list[dict]]:
    """05's EQ-Bench 3 suite on a batch: the official protocol with --eqbench3-dir, else the variant."""
    if args.eqbench3_dir:
        return official_cases(model, tok, tasks, judge, args)
    return variant_cases(model, tok, tasks, judge, args)


# ---------------------------------------------------------------------------------------------
# The official files, read at run time
# ---------------------------------------------------------------------------------------------
@dataclass
class Protocol:
    folder: Path
    commit: str  # the checkout's commit, or why there is none
    tasks: list  # {id, kind, prompts} in file order
    masters: dict  # kind -> master template (roleplay, drafting, analysis)
    debrief: str
    judges: dict  # "standard" / "analysis" -> the judge prompt template
    criteria: dict  # "standard" / "analysis" -> the criteria asked for
    formats: dict  # "standard" / "analysis" -> {output_format}

    def label(self) -> str:
        return f"official protocol, files at {self.commit}"


@functools.lru_cache(maxsize=4)
def protocol(path: str) -> Protocol:
    """PATH's official files, each checked as the harness uses it; one UserError naming a file that is missing
    or unusable."""
    folder = Path(path)
    common.check(folder.is_dir(), f"--eqbench3-dir {path}: no such folder (a checkout of github.com/EQ-bench/eqbench3)")
    files = {k: folder / "data" / name for k, name in FILES.items()}
    files["code"] = folder / "core" / "benchmark.py"
    for f in files.values():
        common.check(
            f.is_file(),
            f"--eqbench3-dir {path}: no {f.relative_to(folder)} there (the official layout: "
            "data/*.txt, core/benchmark.py)",
        )
    text = {k: read_text(f) for k, f in files.items() if k not in ("prompts", "code")}
    for k in ("roleplay", "drafting", "analysis"):
        fill(text[k], files[k], scenario_prompt="x")
    common.check(text["debrief"].strip(), f"{files['debrief']}: empty")
    criteria = {"standard": criteria_list(text["criteria"]), "analysis": criteria_list(text["criteria_analysis"])}
    for kind, k in (("standard", "criteria"), ("analysis", "criteria_analysis")):
        common.check(criteria[kind], f"{files[k]}: no criteria (one name a line)")
    reasoning = reasoning_lines(files["code"])
    formats = {kind: output_format(reasoning[kind], criteria[kind]) for kind in criteria}
    fill(text["judge"], files["judge"], transcript="x", debrief="x", output_format="x")
    fill(text["judge_analysis"], files["judge_analysis"], transcript="x", output_format="x")
    tasks = read_tasks(files["prompts"])
    common.check(tasks, f"{files['prompts']}: no scenario with a '####### Prompt<N>' turn")
    return Protocol(
        folder=folder,
        commit=git_commit(folder),
        tasks=tasks,
        masters={k: text[k] for k in ("roleplay", "drafting", "analysis")},
        debrief=text["debrief"],
        judges={"standard": text["judge"], "analysis": text["judge_analysis"]},
        criteria=criteria,
        formats=formats,
    )


def read_text(path: Path) -> str:
    try:
        with open(path, encoding="utf-8") as f:  # universal newlines, as the harness opens its files
            return f.read()
    except UnicodeDecodeError as e:
        raise common.UserError(f"{path}: not UTF-8 ({e.reason} at byte {e.start})") from None


def fill(template: str, path: Path, **fields):
    """The template filled as the harness fills it; one UserError when it is empty or str.format cannot fill it
    with exactly these fields (each must be there)."""
    common.check(template.strip(), f"{path}: empty")
    missing = [k for k in fields if "{" + k + "}" not in template]
    common.check(not missing, f"{path}: no {', '.join('{' + k + '}' for k in missing)} placeholder")
    try:
        return template.format(**fields)
    except (KeyError, IndexError, ValueError) as e:
        raise common.UserError(
            f"{path}: str.format cannot fill it ({type(e).__name__}: {e}); its only "
            f"placeholders must be {', '.join('{' + k + '}' for k in fields)}"
        ) from None


def criteria_list(text: str) -> list[str]:
    # one criterion a line; blank lines and lines starting with "#" skipped
    return [x.strip() for x in text.splitlines() if x.strip() and not x.strip().startswith("#")]


def reasoning_lines(path: Path) -> dict:
    """The output format's first entry per kind: core/benchmark.py's output_format_dict_std / _anl literals."""
    try:
        tree = ast.parse(read_text(path))
    except SyntaxError as e:
        raise common.UserError(f"{path}: not Python that this file can read ({e})") from None
    found = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict) and len(node.targets) == 1:
            name = getattr(node.targets[0], "id", "")
            pairs = {
                getattr(k, "value", None): getattr(v, "value", None) for k, v in zip(node.value.keys, node.value.values)
            }
            if name in ("output_format_dict_std", "output_format_dict_anl") and isinstance(
                pairs.get(REASONING_KEY), str
            ):
                found["standard" if name.endswith("std") else "analysis"] = pairs[REASONING_KEY]
    common.check(
        len(found) == 2,
        f"{path}: no output_format_dict_std and output_format_dict_anl with a "
        f"'{REASONING_KEY}' string (the official rubric output format)",
    )
    return found


def output_format(reasoning: str, criteria: list[str]) -> str:
    # {"chain_of_thought_reasoning": <its description>, <criterion>: 0-20, ...} as indented JSON
    shape = {REASONING_KEY: reasoning, **{c: 0 for c in criteria}}
    return json.dumps(shape, indent=2).replace(": 0", ": 0-20")


def git_commit(folder: Path) -> str:
    """The checkout's commit, 12 characters, "+ local changes" when a file the protocol reads differs from it (the
    leaderboard files and pages the harness keeps beside them may be absent); benchmarks.checkout's rule."""
    found = benchmarks.checkout(folder, [f"data/{name}" for name in FILES.values()] + ["core/benchmark.py"])
    if found is None:
        return "no commit (not a git checkout)"
    return found[0][:12] + (" + local changes" if found[1] else "")


def kind_of(sid: str) -> str:
    # the official id sets decide (analysis first, as the harness checks it first)
    if sid in ANALYSIS_IDS:
        return "analysis"
    if sid in DRAFTING_IDS:
        return "drafting"
    return "no_roleplay" if sid in NO_ROLEPLAY_IDS else "roleplay"


def read_tasks(path: Path) -> list[dict]:
    """scenario_prompts.txt as the harness's parse_scenario_prompts reads it: a line (stripped) starting with 8
    "#" opens a scenario, its id the first word after them; one starting with 7 "#", spaces and `Prompt<N>`
    opens a turn; other lines belong to the open turn (kept as written, the turn then stripped), or are
    skipped when no turn is open. A scenario with no non-empty turn is dropped."""
    scenarios, sid, turns, lines = {}, None, [], None

    def close_turn():
        text = "\n".join(lines or []).strip()
        if text:
            turns.append(text)

    try:
        with open(path, encoding="utf-8") as f:  # universal newlines, no byte-order mark dropped
            raw_lines = list(f)
    except UnicodeDecodeError as e:
        raise common.UserError(f"{path}: not UTF-8 ({e.reason} at byte {e.start})") from None
    for raw in raw_lines:
        line = raw.strip()
        head = re.match(r"########\s*(\S+)", line)
        if head:
            close_turn()
            if sid and turns:
                scenarios[sid] = turns  # an id seen before: its prompts replaced in place
            sid, turns, lines = head.group(1), [], None
        elif re.match(r"#######\s*Prompt(\d+)", line):
            if sid is not None:  # a turn marker before any scenario is skipped
                close_turn()
                lines = []
        elif sid and lines is not None:
            lines.append(raw.rstrip("\n\r"))
    close_turn()
    if sid and turns:
        scenarios[sid] = turns
    return [{"id": k, "kind": kind_of(k), "prompts": v} for k, v in scenarios.items()]


# ---------------------------------------------------------------------------------------------
# The texts as sent, the judge's answer read, the score
# ---------------------------------------------------------------------------------------------
def wrap(P: Protocol, task: dict, prompt: str) -> str:
    """The user turn as sent: the kind's master template around it (no role-play: the turn itself)."""
    if task["kind"] == "no_roleplay":
        return prompt
    return P.masters["roleplay" if task["kind"] == "roleplay" else task["kind"]].format(scenario_prompt=prompt)


def sections(kind: str, reply: str) -> dict:
    """A role-play or drafting reply's three sections ("" where missing): after its heading line up to the next
    "#" (the last section: up to "--"), case-insensitive, stripped."""
    out = {}
    for key, _, pattern, end in SECTIONS[kind]:
        m = re.search(rf"#\s*{pattern}\s*\n(.*?)(?={end}|\Z)", reply, flags=re.I | re.S)
        out[key] = m.group(1).strip() if m else ""
    return out


def render(kind: str, reply: str) -> str:
    """A reply as the judge reads it: role-play and drafting re-rendered from their sections, else as it is."""
    if kind not in SECTIONS:
        return reply
    parts = sections(kind, reply)
    lines = []
    for i, (key, title, _, _) in enumerate(SECTIONS[kind]):
        lines += [("\n" if i else "") + f"# {title}", parts[key]]
    return "\n".join(lines + ["\n--"])


def transcript(task: dict, messages: list[dict]) -> str:
    # "User:\n<turn as sent>\n" and "Assistant:\n<rendered reply>\n" blocks, joined by "---\n"
    return "---\n".join(
        f"User:\n{m['content']}\n" if m["role"] == "user" else f"Assistant:\n{render(task['kind'], m['content'])}\n"
        for m in messages
    )


def judge_prompt(P: Protocol, task: dict, messages: list[dict], debrief: str | None) -> str:
    """The judge prompt as sent: the kind's template filled, then every "*" and "#" removed."""
    kind = "analysis" if task["kind"] == "analysis" else "standard"
    fields = {"transcript": transcript(task, messages), "output_format": P.formats[kind]}
    if kind == "standard":
        fields["debrief"] = debrief or ""
    return P.judges[kind].format(**fields).replace("*", "").replace("#", "")


def api_text(text: str) -> str:
    """The harness's client's cut: the text after the first </think> when both <think> and </think> are in it,
    then likewise after </reasoning>."""
    for tag in ("think", "reasoning"):
        if f"<{tag}>" in text and f"</{tag}>" in text:
            text = text[text.find(f"</{tag}>") + len(f"</{tag}>") :].strip()
    return text


def json_object(text: str) -> dict:
    """The judge's JSON object as the official parser finds it (raises ValueError when there is none): after the
    last "```json" when there are several, fence lines dropped, the first balanced {...} outside strings; when
    that is not JSON, newlines inside its strings escaped and a quote inside a string that is not followed by
    , } ] or : (after spaces) escaped, then parsed again."""
    if text.count("```json") > 1:
        text = text[text.rfind("```json") + len("```json") :]
    text = "\n".join(x for x in text.splitlines() if not x.lstrip().startswith("```")).strip()
    span = balanced(text)
    if span is None:
        raise ValueError("no balanced JSON object")
    try:
        return json.loads(span)
    except ValueError:
        return json.loads(repair(span))


def balanced(text: str) -> str | None:
    # the first {...} whose braces balance, braces inside JSON strings not counted (strings tracked from the start)
    depth, start, quoted, escaped = 0, None, False, False
    for i, ch in enumerate(text):
        if quoted:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                quoted = False
        elif ch == '"':
            quoted = True
        elif ch == "{":
            start = i if depth == 0 else start
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0 and start is not None:
                return text[start : i + 1]
    return None


def repair(span: str) -> str:
    """The official second try: inside strings a raw newline becomes \\n, and a quote not followed (after spaces)
    by , } ] : or the end is escaped (kept inside the string)."""
    out, quoted, escaped = [], False, False
    for ch in span:  # 1. newlines inside strings
        if quoted and not escaped and ch in "\r\n":
            ch = "\\n"
        elif quoted:
            quoted = escaped or ch != '"'
            escaped = not escaped and ch == "\\"
        else:
            quoted = ch == '"'
        out.append(ch)
    fixed, out, quoted, escaped = "".join(out), [], False, False
    for i, ch in enumerate(fixed):  # 2. stray quotes inside strings
        if quoted and not escaped and ch == '"':
            rest = fixed[i + 1 :].lstrip()
            if rest and rest[0] not in ",}]:":
                out.append("\\")
            else:
                quoted = False
        elif quoted:
            escaped = not escaped and ch == "\\"
        else:
            quoted = ch == '"'
        out.append(ch)
    return "".join(out)


def read_scores(text: str | None) -> dict | None:
    """{criterion: score} from the judge's answer, read as the official parser reads it: a number as it is, a
    string its first number ("15/20": 15; the reasoning key's string skipped); None when there is no JSON
    object or no number in it."""
    try:
        obj = json_object(text or "")
    except (ValueError, RecursionError):
        return None
    scores = {}
    for key, value in obj.items():
        if isinstance(value, (int, float)):
            scores[key] = float(value)
        elif key != REASONING_KEY:
            m = re.search(r"\b(\d+(\.\d+)?)\b", str(value))
            if m:
                scores[key] = float(m.group(1))
    return scores or None


def task_score(scores: dict, kind: str, P: Protocol) -> float | None:
    """s_ti: the mean of the task's allowed criterion scores (overall_eq 3 times); None when none is allowed."""
    allowed = set(P.criteria["analysis"]) if kind == "analysis" else STANDARD_ALLOWED
    counted = [v for k, v in scores.items() if k in allowed for _ in range(WEIGHTS.get(k, 1))]
    return statistics.mean(counted) if counted else None


def rubric_score(task_scores: list[float]) -> dict:
    # EQ-Bench 3 rubric score = 5 * round(mean over every scored (task, iteration) of s_ti, 2)
    mean = round(statistics.mean(task_scores), 2)
    return {"score": mean * 5, "rubric": mean, "scored": len(task_scores)}


# ---------------------------------------------------------------------------------------------
# The official protocol on a batch
# ---------------------------------------------------------------------------------------------
def official_cases(model, tok, units: list[dict], judge, args) -> tuple[list[dict], list[dict]]:
    """The harness's run on a batch of (task, iteration) units, every task's turn i in one generate call:
    the scenario turns, the debrief, the guard, one judge call each -> (cases with every text as sent and
    received, transcripts)."""
    P = protocol(args.eqbench3_dir)
    runs = [{"messages": [], "budget": None, "cut_off": 0, "failed": None, "debrief": None} for _ in units]
    # 1. every turn played: the master template around it, the reply at temperature 0.7, min_p 0.1
    for i in range(max(len(u["prompts"]) for u in units)):
        live = [j for j, u in enumerate(units) if i < len(u["prompts"]) and not runs[j]["failed"]]
        asks = {
            j: runs[j]["messages"] + [{"role": "user", "content": wrap(P, units[j], units[j]["prompts"][i])}]
            for j in live
        }
        for j, text in respond(model, tok, asks, runs, args, TEMPERATURE, MIN_P, f"turn {i + 1}").items():
            runs[j]["messages"] = asks[j] + [{"role": "assistant", "content": text}]
    # 2. the debrief (not for analysis): temperature 0.5, no min_p
    asks = {
        j: runs[j]["messages"] + [{"role": "user", "content": P.debrief}]
        for j, u in enumerate(units)
        if u["kind"] != "analysis" and not runs[j]["failed"]
    }
    for j, text in respond(model, tok, asks, runs, args, DEBRIEF_TEMPERATURE, None, "the debrief").items():
        runs[j]["debrief"] = text
    # 3. the guard, then the judge: its prompt, one call at temperature 0, its answer read
    for r in runs:
        long_enough = any(len(m["content"].strip()) >= MIN_REPLY_CHARS for m in r["messages"][1::2])
        if not r["failed"] and not long_enough:
            r["failed"] = f"no reply of {MIN_REPLY_CHARS} characters (not judged, as the official guard)"
    judged = [j for j, r in enumerate(runs) if not r["failed"]]
    prompts = {j: judge_prompt(P, units[j], runs[j]["messages"], runs[j]["debrief"]) for j in judged}
    answers = {}

    def parse(i, text):  # the answer kept as received (the harness's cut and strip), then read
        answers[judged[i]] = None if text is None else (api_text(text) if judge.backend.kind == "api" else text).strip()
        return read_scores(answers[judged[i]])

    read = backends.ask_json(
        judge.backend,
        [[{"role": "user", "content": prompts[j]}] for j in judged],
        parse,
        0,
        who="eqbench3 judge",
        noun="tasks",
        max_tokens=args.eqbench3_judge_tokens,
        temperature=JUDGE_TEMPERATURE,
    )
    out, transcripts = [], []
    for j, u in enumerate(units):
        r = runs[j]
        scores = read[judged.index(j)] if j in judged else None
        s_ti = task_score(scores, u["kind"], P) if scores else None
        if not r["failed"]:
            r["failed"] = (
                "judge call failed"
                if answers.get(j) is None
                else "judge answer has no score"
                if not scores
                else None
                if s_ti is not None
                else "no allowed criterion scored"
            )
        case = {
            "case": u["case"],
            "task": u["id"],
            "iteration": u["iteration"],
            "kind": u["kind"],
            "protocol": P.label(),
            "judge": args.judge,
            "turns": len(u["prompts"]),
            "replies": len(r["messages"]) // 2,
            "reply_budget": r["budget"],
            "cut_off": r["cut_off"],
            "messages": r["messages"],
            "debrief_prompt": P.debrief if u["kind"] != "analysis" else None,
            "debrief": r["debrief"],
            "judge_prompt": prompts.get(j),
            "judge_answer": answers.get(j),
            "judge_scores": scores,
            "judge_budget": args.eqbench3_judge_tokens,
            "failed": r["failed"],
        }
        if s_ti is not None:
            case.update(rubric=s_ti, score=5 * s_ti)
        out.append(case)
        transcripts.append(
            {
                "case": u["case"],
                "messages": r["messages"]
                + (
                    [{"role": "user", "content": P.debrief}, {"role": "assistant", "content": r["debrief"]}]
                    if r["debrief"] is not None
                    else []
                ),
            }
        )
    return out, transcripts


def respond(model, tok, asks: dict, runs: list, args, temperature: float, min_p, what: str) -> dict:
    """{unit: the tested model's reply to its messages}: up to --eqbench3-tokens new tokens, or the room left
    under --max-context (none: the unit fails), replies of one budget generated together."""
    budgets = {}
    for j, messages in asks.items():
        ids = common.render_ids(tok, messages)
        budget = min(args.eqbench3_tokens, args.max_context - len(ids))
        if budget <= 0:
            runs[j]["failed"] = f"{AT_LIMIT} ({what} does not fit --max-context {args.max_context})"
            continue
        budgets.setdefault(budget, []).append((j, ids))
    out = {}
    for budget, rows in sorted(budgets.items()):
        # an endpoint's sampling: the temperature and min_p the harness sends, the rest the model's own settings
        replies = sampling.generate_batch(
            model, tok, [ids for _, ids in rows], budget, temperature, 1.0, min_p, model_settings=True
        )
        for (j, _), reply in zip(rows, replies):
            out[j] = api_text(tok.decode(reply.ids, skip_special_tokens=True)).strip()
            runs[j]["budget"] = min(budget, runs[j]["budget"] or budget)
            runs[j]["cut_off"] += not reply.ended
    return out


# ---------------------------------------------------------------------------------------------
# 05's summary, table column and cell, results.md lines
# ---------------------------------------------------------------------------------------------
def summary(cases: list[dict], t_interval) -> dict:
    """05's EQ-Bench 3 summary of a model's cases (failed ones included: they are counted, not scored)."""
    ok = [c for c in cases if not c.get("failed")]
    official = [c for c in cases if str(c.get("protocol", "")).startswith("official")]
    if official:
        s = {
            "n": len(ok),
            "protocol": official[0]["protocol"],
            "judge": official[0]["judge"],
            "tasks": len({c["task"] for c in official}),
            "iterations": len({c["iteration"] for c in official}),
            "budget": min((c["reply_budget"] for c in official if c.get("reply_budget")), default=None),
            "judge_budget": min(c.get("judge_budget", JUDGE_TOKENS) for c in official),
        }
        s["context_limit"] = sum(str(c.get("failed") or "").startswith(AT_LIMIT) for c in official)  # failed so
        if ok:
            s.update(rubric_score([c["rubric"] for c in ok]))
    else:
        scored = [c for c in ok if "score" in c]  # offline, analysis tasks are kept but not scored
        s = {"n": len(scored), "unscored": len(ok) - len(scored), "proxy": any(c.get("proxy") for c in cases)}
        s["context_limit"] = sum(bool(c.get("context_limit")) for c in scored)  # judged on the turns that fit
        if scored:
            s["score"] = t_interval([c["score"] for c in scored])
    scored = [c for c in ok if "score" in c]
    if scored:
        s["by_kind"] = {
            k: statistics.mean(c["score"] for c in scored if c["kind"] == k)
            for k in sorted({c["kind"] for c in scored})
        }
    return s


def column(summaries: dict, official_dir=None) -> str:
    """05's EQ-Bench 3 column header: what produced the score, so that it cannot be taken for another (with
    --eqbench3-dir the official label even before any case finished)."""
    by = [s["eqbench3"] for s in summaries.values() if "eqbench3" in s]
    official = [s for s in by if "protocol" in s]
    if official_dir and not official:
        return "EQ-Bench 3 rubric score (official protocol, no task finished)"
    if official:
        tasks = max(s["tasks"] for s in official)
        budget = min((s["budget"] for s in official if s["budget"]), default=REPLY_TOKENS)
        judge_budget = min(s.get("judge_budget", JUDGE_TOKENS) for s in official)
        notes = (
            ([f"partial: {tasks} of {OFFICIAL_TASKS} tasks"] if tasks < OFFICIAL_TASKS else [])
            + ([f"reply budget lowered to {budget} tokens"] if budget < REPLY_TOKENS else [])
            + ([f"judge budget lowered to {judge_budget} tokens"] if judge_budget < JUDGE_TOKENS else [])
        )
        return f"EQ-Bench 3 rubric score (official protocol, judge {official[0]['judge']}, {tasks} tasks)" + "".join(
            f"; {x}" for x in notes
        )
    return PROXY if any(s.get("proxy") for s in by) else VARIANT


def cell(s: dict, fmt) -> str:
    """05's EQ-Bench 3 cell for one model, with how many tasks reached the context limit (official: failed so;
    the variant: judged on the turns that fit)."""
    failed, limit = f"; {s['failed']} failed" if s.get("failed") else "", s["context_limit"]
    if "protocol" in s:
        runs = f", {s['iterations']} iterations" if s["iterations"] > 1 else ""
        failed += f" ({limit} at the context limit)" if limit else ""
        return (f"{s['score']:.2f} (n={s['n']} scored{runs})" if s["n"] else "-") + failed
    unscored = f"; {s['unscored']} analysis not scored (needs an LLM judge)" if s.get("unscored") else ""
    ended = f"; {limit} ended at the context limit" if limit else ""
    return (fmt(s["score"], s["n"]) if s["n"] else "-") + failed + ended + unscored


def notes(summaries: dict, official_dir=None) -> list[str]:
    """results.md's lines under the table on how the EQ-Bench 3 column was produced."""
    head = column(summaries, official_dir)
    if head == PROXY:
        return [f"{PROXY}: MDEP-PR levels stand in for the criteria; analysis needs an LLM judge."]
    if head == VARIANT:
        return [f"{VARIANT}: this project's judge prompt and six criteria per kind, raw turns, no debrief."]
    s = next((by["eqbench3"] for by in summaries.values() if "protocol" in by.get("eqbench3", {})), None)
    if s is None:
        return ["EQ-Bench 3: official protocol; no task finished, so nothing is scored yet (--resume continues)."]
    return [
        f"EQ-Bench 3: {s['protocol']}; score = 5 x round(mean over the scored (task, iteration) pairs of the "
        "task's allowed criterion mean, 2); failed tasks are not scored. The pairwise Elo (the leaderboard's "
        "main number) is not computed here: docs/evaluation.md says how to get it with the official harness."
    ]


# ---------------------------------------------------------------------------------------------
# This project's variant (no --eqbench3-dir): its judge prompt, or offline the proxy
# ---------------------------------------------------------------------------------------------
def variant_cases(model, tok, tasks, judge, args) -> tuple[list[dict], list[dict]]:
    """This project's variant (not comparable with EQ-Bench 3). Offline (no LLM judge) role-play and drafting get
    the proxy scores and analysis tasks are not played: nothing offline can judge an analysis (reported as such)."""
    llm = getattr(judge, "backend", None) is not None  # an LLM judge (hf:, api:, self), not the embed judge
    # 1. play each task's fixed user turns; every task of the batch answers its turn i in one generate call
    unscored = [not llm and t["kind"] == "analysis" for t in tasks]
    convs, cut = [[] for _ in tasks], list(unscored)  # cut: no further turns are played
    for i in range(max(len(t["prompts"]) for t in tasks)):
        live, ctx = [], []
        for j, t in enumerate(tasks):
            ids = (
                common.render_ids(tok, convs[j] + [{"role": "user", "content": t["prompts"][i]}])
                if i < len(t["prompts"]) and not cut[j]
                else None
            )
            if ids is not None and len(ids) + args.max_new_tokens > args.max_context:
                cut[j], ids = True, None  # later turns do not fit: judged on what was played
            if ids is not None:
                live.append(j)
                ctx.append(ids)
        replies = (
            sampling.generate_batch(
                model, tok, ctx, args.max_new_tokens, args.temperature, args.top_p, model_settings=True
            )
            if live
            else []
        )
        for j, reply in zip(live, replies):
            convs[j] += [
                {"role": "user", "content": tasks[j]["prompts"][i]},
                {"role": "assistant", "content": tok.decode(reply.ids, skip_special_tokens=True).strip()},
            ]
    # 2. the judge scores the task's criteria 0-20
    criteria = [ANALYSIS_CRITERIA if t["kind"] == "analysis" else ROLEPLAY_CRITERIA for t in tasks]
    if llm:
        prompts = [
            [
                {
                    "role": "user",
                    "content": TEXTS["eqbench3_judge"].format(
                        kind=t["kind"],
                        transcript="\n\n".join(f"[{m['role']}]\n{m['content']}" for m in c),
                        criteria="\n".join(f"- {x}" for x in cr),
                        shape=json.dumps({x: 0 for x in cr}),
                    ),
                }
            ]
            for t, c, cr in zip(tasks, convs, criteria)
        ]
        scores = backends.ask_json(
            judge.backend,
            prompts,
            lambda i, text: parse_criteria(text, criteria[i]),
            args.judge_retries,
            who="eqbench3 judge",
            noun="cases",
        )
    else:
        scores = proxy_scores(convs, criteria, judge)
    # 3. score = 5 * the mean of the task's criterion scores
    cases, transcripts = [], []
    for t, c, s, skip in zip(tasks, convs, scores, unscored):
        s = s if c else None
        case = {
            "case": t["id"],
            "kind": t["kind"],
            "category": t["category"],
            "replies": len(c) // 2,
            "context_limit": not skip and len(c) // 2 < len(t["prompts"]),
            "failed": None if s or skip else "judge failed" if c else "no turn fits in --max-context",
            "proxy": not llm,
        }
        if s:
            case.update(criteria=s, score=5 * sum(s.values()) / len(s))
        if skip:
            case["unscored"] = "not scored (needs an LLM judge)"
        cases.append(case)
        transcripts.append({"case": t["id"], "messages": c})
    return cases, transcripts


def proxy_scores(convs, criteria, judge) -> list[dict | None]:
    """The offline proxy (not EQ-Bench): the MDEP-PR levels of every reply -> per axis clip(10 + 5 (progress -
    negative), 0, 20) -> each criterion the mean of its stand-in axis over the replies. A reply that is not
    language (the judge's fluency check: gibberish, keyword salad) scores as an empty one: negative 1 everywhere."""
    fluency_min, cases, owner = getattr(judge, "th", {}).get("fluency", 0.0), [], []
    for j, c in enumerate(convs):
        for i in range(1, len(c), 2):
            cases.append(
                {"scenario": {"id": str(j), "persona": "", "situation": ""}, "history": c[:i], "reply": c[i]["content"]}
            )
            owner.append(j)
    per_axis = [{a: [] for a in AXES} for _ in convs]
    for j, v in zip(owner, judge.judge(cases) if cases else []):
        if v is not None:
            not_language = v["features"].get("fluency", 1.0) < fluency_min
            for a in AXES:
                progress, negative = (0, 1) if not_language else v["levels"][a]
                per_axis[j][a].append(max(0.0, min(20.0, 10.0 + 5.0 * (progress - negative))))
    axis = TEXTS["eqbench3_proxy_axis"]  # the criterion's stand-in axis; None: no reply judged
    return [
        {x: statistics.mean(per_axis[j][axis[x]]) for x in cr} if all(per_axis[j].values()) else None
        for j, cr in enumerate(criteria)
    ]


def load(path) -> tuple[list[dict], dict]:
    """scenario_prompts.txt -> tasks {id, category, title, kind, prompts, _where} and counts. Headers are 8 '#'
    then `id | category | title` (spacing, extra or missing fields tolerated); turn markers are 7 '#' then
    `Prompt<N>` or `<N>`. Lines outside a prompt and scenarios without prompts are counted, skipped."""
    tasks, stats, cur, prompt = [], {"ignored_lines": 0, "empty_scenarios": 0, "duplicates": 0}, None, None
    for lineno, line in runs.text_lines(path):
        head = re.match(r"^\s*#{8}(?!#)\s*(.*)$", line)
        turn = re.match(r"^\s*#{7}(?!#)\s*(?:prompt\s*)?(\d+)\s*:?\s*$", line, re.I)
        if head:
            parts = [x.strip() for x in head.group(1).split("|")]
            category = parts[1] if len(parts) > 2 else ""
            sid = parts[0] or f"line{lineno}"
            kind = (
                "analysis"
                if (sid.isdigit() and 401 <= int(sid) <= 420) or "analys" in category.lower()
                else "drafting"
                if "draft" in category.lower()
                else "roleplay"
            )
            title = " | ".join(parts[2:]) if len(parts) > 2 else (parts[1] if len(parts) == 2 else "")
            cur = {
                "id": sid,
                "category": category,
                "title": title,
                "kind": kind,
                "prompts": [],
                "_where": f"{path}:{lineno}",
            }
            tasks.append(cur)
            prompt = None
        elif turn and cur is not None:
            prompt = []
            cur["prompts"].append(prompt)
        elif prompt is not None:
            prompt.append(line)
        elif line.strip():
            stats["ignored_lines"] += 1  # comments, notes before a scenario's first prompt
    kept, seen = [], set()
    for t in tasks:
        t["prompts"] = [p for p in ("\n".join(lines).strip() for lines in t["prompts"]) if p]
        if not t["prompts"]:
            stats["empty_scenarios"] += 1
        elif t["id"] in seen:
            stats["duplicates"] += 1  # the first scenario with an id wins
        else:
            seen.add(t["id"])
            kept.append(t)
    common.check(
        kept,
        f"{path}: no scenarios with prompts (expected '######## <id> | <category> | <title>' "
        f"headers and '####### Prompt1' turn markers)",
    )
    stats.update(scenarios=len(kept), prompts=sum(len(t["prompts"]) for t in kept))
    return kept, stats


def parse_criteria(text, criteria) -> dict | None:
    """{criterion: 0-20} for every criterion, or None."""
    obj, out = backends.first_json(text)[0], {}
    if obj is None:
        return None
    for c in criteria:
        x = obj.get(c)
        x = float(x) if isinstance(x, str) and re.fullmatch(r"\s*\d+(\.\d+)?\s*", x) else x
        if not isinstance(x, (int, float)) or isinstance(x, bool) or not 0 <= x <= 20:
            return None
        out[c] = float(x)
    return out

"""benchmarks/sage.py: SAGE (Sentient Agent as a Judge, SentientBench), run by 05_eval.py --suite sage.

What it is
  SAGE's simulator plays a person from a profile (player, scene, main_cha: the personality type 负面型 /
  被动型 / 回避型, cha_group: traits, task, first_talk?) whose emotion (0-100) moves with every reply of the
  tested model; the Sentient score is the mean final emotion over the profiles.
What this file holds
  sentient_score  the score and the success / failure counts (05's summary and `--score` both call it)
  protocol        the official files of --sage-dir, read at run time: the simulator's two prompts, its talk
                  goal, emotion bands and history roles (simulator_response.py), the tested model's system
                  prompt (npc_response.py), found by `ast` in the functions that use them
  official_cases  the official protocol (test_npc.py's loop) on a batch of profiles
  cases           05's entry: official_cases with --sage-dir, else this project's variant on 03's rollout
  load            the profiles 05 evaluates (with --sage-dir: its profile file, the official files checked)
  main            `python benchmarks/sage.py --score FILE...`: the score of official *_result.jsonl files

Official protocol (--sage-dir PATH: a checkout of github.com/Tencent/digitalhuman or of its SAGE folder)
  e_0 = 40; the user opens with first_talk (a profile without one: the simulator's opening reply, as
  player_reply writes it with no history). Then per turn t = 1..10: the tested model replies (the official
  system prompt, then the dialogue); for t < 10 the simulator (--user, one LLM) analyses that reply (prompt 1:
  Content / TargetCompletion / Activity / Analyse / Change, the history as JSON with the file's roles, 你 / NPC)
      change_t = clip(first integer after "Change:", -10, 10),   e_t = min(100, e_{t-1} + change_t)
  and answers from the analysis and its band (prompt 2: S >= 100, A >= 70, B >= 40, C >= 10, F < 10). The
  dialogue ends when that answer holds 再见 or 拜拜, when e_t >= 100 or e_t < 10, or after the 10th reply,
  which is never scored: 10 replies, at most 9 updates.
  Sentient score = (1/N) sum_i e_i over all N profiles; success: e_i >= 100; failure: e_i < 10.

Where the official code is broken or silent, and what this file does (docs/evaluation.md, "SAGE")
  1. player_init reads a `topic` key the profiles lack; topic enters no prompt: kept in the transcript
     when a profile has one, else left out.
  2. planning_reply fills {{target}} with target_prompt, then indexes target_prompt[player_data["target"]],
     a key that does not exist (evidently a dict of talk goals once; every published result says "eq"):
     {{target}} is target_prompt, as the line that runs does.
  3. The official loop asks again, without end, until an answer parses: here at most REASKS more times,
     counted in the case (`reasks`). A case whose simulator never answered ends there with its emotion
     as it stands; it stays in the mean, counted and listed (`unanswered`), never dropped.
  4. The official parse is kept: "：" read as ":", "*" dropped, the integer after the LAST "Change:"; an
     answer without "Change:" is read whole, as the split does (counted: `unlabelled_changes`). No lower
     clip (none there; e cannot fall below 0, since a dialogue ends below 10 and a change is >= -10).
  5. Sampling: the official calls set none, so an endpoint's defaults: temperature 1, top-p 1 (the OpenAI
     API's), for the tested model and the simulator alike; a reply gets REPLY_TOKENS new tokens (the
     longest published reply, GPT-4.1's, is 1,992 characters), or what room is left under --max-context,
     and a dialogue with no room left ends (`ended`: context limit), scored at its emotion as it stands, like
     one the protocol ended; 05's cell says how many did. --max-new-tokens and --judge are not used;
     --sage-turns is the number of replies (10, the official).
This project's variant (no --sage-dir; "this project's variant, not the official protocol")
  - It runs on 03's rollout with this project's prompts (data/prompts.json "sage_judge", "sage_first_message"):
    --judge states the change (JSON), --user speaks; offline the change comes from the embed judge's levels
    (03's emotion_change: English cues only). No goodbye rule; 10 updates; failed cases leave the mean; a
    dialogue that reaches --max-context ends there (03's outcome context_limit), counted in 05's cell.
  - Without first_talk the user opens with what an LLM user writes from the profile (offline: a fixed line),
    never with the scene.
A support module: it imports common.py and its package (benchmarks.checkout), never a stage; 05 hands it
03's environment (env).
"""

from __future__ import annotations

import argparse
import ast
import functools
import json
import math
import re
import sys
from dataclasses import dataclass, field
from decimal import ROUND_HALF_UP, Decimal
from pathlib import Path

if __package__ in (None, ""):  # run as `python benchmarks/sage.py`: the repository root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import backends  # noqa: E402
import benchmarks  # noqa: E402
import common  # noqa: E402
import options  # noqa: E402
import runs
import sampling  # noqa: E402

HERE = Path(__file__).resolve().parents[1]
TEXTS = json.loads((HERE / "data" / "prompts.json").read_text(encoding="utf-8"))
TEXTS.update({k: "\n".join(TEXTS[k]) for k in ("sage_judge", "sage_first_message")})
SAMPLE_PROFILES = HERE / "data" / "eval" / "sage_profiles.jsonl"
START = 40  # the user's emotion before the first reply (SAGE's simulator starts at 40)
AXES = ("C", "A", "P")  # 03's axes: SAGE's simulator gives no levels on them (v_t = 0)
VARIANT = "this project's variant, not the official protocol"
PROMPT_FILES = ("simulator_response.py", "npc_response.py")  # what the official protocol reads
# the official protocol's facts (test_npc.py, simulator_response.py)
CHANGE_MAX, SUCCESS_AT, FAILURE_BELOW = 10, 100, 10  # |change| <= 10; e >= 100 success, e < 10 failure
GOODBYES = ("再见", "拜拜")  # in the simulator's answer: the dialogue ends
REASKS = 5  # re-asks of an unparsable simulator answer (the official loop has no bound)
AT_LIMIT = "context limit"  # how a dialogue with no room left for a reply ended (the variant: 03's context_limit)
REPLY_TOKENS = 2048  # the tested model's reply budget (the official call sets none)
SIM_TOKENS = 2048  # the simulator's answer budget (four or five sections)
TEMPERATURE, TOP_P = 1.0, 1.0  # an endpoint's defaults: the official calls set no sampling (the rest: the model's own)
# the output sections the official parse reads (planning_reply; player_reply's "Response:")
SECTIONS = {
    "content": ("Content:", "TargetCompletion:\n"),
    "TargetCompletion": ("TargetCompletion:", "Activity:\n"),
    "activity": ("Activity:", "Analyse:\n"),
    "analyse": ("Analyse:", "Change:\n"),
}


# ---------------------------------------------------------------------------------------------
# The score: 05's summary and the --score command
# ---------------------------------------------------------------------------------------------
def sentient_score(finals: list[float]) -> dict:
    # Sentient = (1/N) sum_i e_i over all N profiles; successes #{e_i >= 100}; failures #{e_i < 10}
    total, successes, failures = 0.0, 0, 0
    for e in finals:
        total += e
        successes += e >= SUCCESS_AT
        failures += e < FAILURE_BELOW
    return {"score": total / len(finals), "successes": successes, "failures": failures, "profiles": len(finals)}


def summary(cases: list[dict]) -> dict:
    """05's SAGE summary of the cases it keeps (the official protocol keeps every profile): the score, the
    counts, the unanswered cases listed, the dialogues that ended at the context limit (scored as they stood,
    like those the protocol ended), and the protocol that produced them."""
    s = sentient_score([c["final_emotion"] for c in cases])
    s.update(
        unanswered=[c["case"] for c in cases if c.get("unanswered")],
        context_limit=sum(c.get("ended") == AT_LIMIT or c.get("outcome") == "context_limit" for c in cases),
        protocol=" / ".join(sorted({c.get("protocol", VARIANT) for c in cases})),
    )
    return s


def cells(s: dict, sentient: str) -> list[str]:
    """05's two table cells: the Sentient score (with the unanswered cases and those that ended at the context
    limit) and success / failure."""
    n, shown = len(s["unanswered"]), ", ".join(s["unanswered"][:3]) + (", ..." if len(s["unanswered"]) > 3 else "")
    note = f"; {n} unanswered, at their last emotion ({shown})" if n else ""
    note += f"; {s['context_limit']} ended at the context limit" if s["context_limit"] else ""
    return [sentient + note, f"{s['successes']} / {s['failures']}"]


def column(summaries: dict, official_dir=None) -> str:
    """05's Sentient column header: which protocol, and which simulator, produced it (with --sage-dir the
    official label even before any profile finished)."""
    protocols = sorted({by["sage"]["protocol"] for by in summaries.values() if by.get("sage", {}).get("n")})
    none = "official protocol, no profile finished" if official_dir else VARIANT
    return f"SAGE Sentient ({' / '.join(protocols) or none})"


# ---------------------------------------------------------------------------------------------
# The official files, read at run time
# ---------------------------------------------------------------------------------------------
@dataclass
class Protocol:
    folder: Path  # the SAGE folder
    commit: str  # the checkout's commit, or why there is none
    analysis: str  # planning_reply's template: the emotion analysis
    reply: str  # player_reply's template: the simulator's answer
    target: str  # target_prompt: the talk goal
    bands: dict  # emo_count: band -> lowest emotion, highest first
    roles: dict  # planning_reply's and player_reply's `mapping`: user / assistant -> JSON role
    feeling: list  # player_reply's {{planning}}: ("text", s) and ("field", key) parts, in order
    open_feeling: str  # player_reply's {{planning}} with no analysis (the opening)
    open_history: str  # player_reply's {{dialog_history}} with no history (the opening)
    system: str  # npc_response.py's role_system: the tested model's system prompt

    def label(self, simulator: str) -> str:
        return f"official protocol, {self.commit}, simulator {simulator}"


def sage_folder(path) -> Path:
    """--sage-dir: the repository (its SAGE folder) or the SAGE folder itself."""
    for folder in (Path(path), Path(path) / "SAGE"):
        if (folder / "simulator_response.py").is_file():
            return folder
    raise common.UserError(
        f"--sage-dir {path}: no simulator_response.py there or in its SAGE folder (expected a "
        "checkout of github.com/Tencent/digitalhuman or of its SAGE folder)"
    )


@functools.cache
def protocol(path: str) -> Protocol:
    """The official prompts and constants of --sage-dir, each found by `ast` where the official code uses it;
    one UserError naming the file when one is missing or does not ask for the sections the parse reads."""
    folder = sage_folder(path)
    sim, npc = folder / "simulator_response.py", folder / "npc_response.py"
    common.check(npc.is_file(), f"{npc}: no such file (SAGE's tested-model prompt)")
    tree, npc_tree = parse_file(sim), parse_file(npc)
    plan, play = function(tree, "planning_reply", sim), function(tree, "player_reply", sim)
    p = Protocol(
        folder=folder,
        commit=git_commit(folder),
        analysis=constant(plan, "template", str, sim),
        reply=constant(play, "template", str, sim),
        target=constant(tree, "target_prompt", str, sim),
        bands=constant(tree, "emo_count", dict, sim),
        roles=constant(plan, "mapping", dict, sim),
        feeling=feeling_parts(play, sim),
        open_feeling=opening_constant(play, "planning", sim),
        open_history=opening_constant(play, "{{dialog_history}}", sim),
        system=constant(function(npc_tree, "call_npc", npc), "role_system", str, npc),
    )
    common.check(
        constant(play, "mapping", dict, sim) == p.roles,
        f"{sim}: planning_reply and player_reply map the history's roles differently",
    )
    for name, text, needs in (
        (
            "planning_reply",
            p.analysis,
            ["{{target}}", "{{simulator_role}}", "{{simulator_scene}}", "{{emotion}}", "{{dialog_history}}", "Change:"],
        ),
        (
            "player_reply",
            p.reply,
            [
                "{{target}}",
                "{{emotion}}",
                "{{player_type}}",
                "{{player_topic}}",
                "{{dialog_history}}",
                "{{new_history}}",
                "{{planning}}",
                "Response:",
            ],
        ),
    ):
        missing = [x for x in needs if x not in text]
        common.check(not missing, f"{sim}: {name}'s template has no {', '.join(missing)}")
    common.check(set(p.roles) == {"user", "assistant"} and p.bands, f"{sim}: mapping or emo_count not as expected")
    return p


def parse_file(path: Path) -> ast.Module:
    try:
        return ast.parse(path.read_text(encoding="utf-8"), str(path))
    except (SyntaxError, UnicodeDecodeError) as e:
        raise common.UserError(f"{path}: not Python that this file can read ({type(e).__name__}: {e})") from None


def function(tree, name: str, path: Path) -> ast.FunctionDef:
    found = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == name]
    common.check(found, f"{path}: no function {name}() (the official SAGE layout has one)")
    return found[0]


def constant(node, name: str, kind: type, path: Path):
    """The literal first assigned to `name` inside `node` (a string, or a dict such as emo_count)."""
    for n in ast.walk(node):
        if isinstance(n, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in n.targets):
            try:
                value = ast.literal_eval(n.value)
            except ValueError:
                continue
            if isinstance(value, kind):
                return value
    where = f"{node.name}()" if isinstance(node, ast.FunctionDef) else "the module"
    raise common.UserError(f"{path}: no {kind.__name__} constant `{name}` in {where}")


def replace_calls(node, placeholder: str) -> list[ast.expr]:
    """The second arguments of every `.replace(placeholder, x)` inside node."""
    return [
        n.args[1]
        for n in ast.walk(node)
        if isinstance(n, ast.Call)
        and getattr(n.func, "attr", "") == "replace"
        and len(n.args) == 2
        and isinstance(n.args[0], ast.Constant)
        and n.args[0].value == placeholder
    ]


def feeling_parts(play, path: Path) -> list[tuple[str, str]]:
    """player_reply's {{planning}} text after an analysis: the sum of string constants and planning[...] fields."""

    def parts(e):
        if isinstance(e, ast.BinOp) and isinstance(e.op, ast.Add):
            return parts(e.left) + parts(e.right)
        if isinstance(e, ast.Constant) and isinstance(e.value, str):
            return [("text", e.value)]
        if isinstance(e, ast.Subscript) and isinstance(e.slice, ast.Constant):
            return [("field", e.slice.value)]
        raise common.UserError(
            f"{path}:{e.lineno}: player_reply's {{{{planning}}}} text is not strings and planning[...] fields"
        )

    sums = [e for e in replace_calls(play, "{{planning}}") if isinstance(e, ast.BinOp)]
    common.check(sums, f"{path}: player_reply never fills {{{{planning}}}} from the analysis")
    found = parts(sums[0])
    common.check(
        {k for kind, k in found if kind == "field"} <= set(SECTIONS),
        f"{path}: player_reply's {{{{planning}}}} reads fields other than {', '.join(SECTIONS)}",
    )
    return found


def opening_constant(play, what: str, path: Path) -> str:
    """player_reply's texts for the opening, with no analysis and no history: planning['analyse'] = "...",
    and .replace("{{dialog_history}}", "...")."""
    if what == "planning":
        for n in ast.walk(play):
            target = n.targets[0] if isinstance(n, ast.Assign) else None
            if (
                isinstance(target, ast.Subscript)
                and getattr(target.value, "id", "") == "planning"
                and isinstance(n.value, ast.Constant)
                and isinstance(n.value.value, str)
            ):
                return n.value.value
    texts = [e.value for e in replace_calls(play, what) if isinstance(e, ast.Constant) and isinstance(e.value, str)]
    common.check(texts, f"{path}: player_reply has no opening text for {what} (a reply with no history)")
    return texts[0]


def git_commit(folder: Path) -> str:
    """The checkout's commit, 12 characters, "+ local changes" when the two prompt files differ from it;
    benchmarks.checkout's rule, the SAGE folder also right below the repository's top (Tencent/digitalhuman's
    layout): a copy that no repository there tracks is "not a git checkout"."""
    found = benchmarks.checkout(folder, PROMPT_FILES, outer=True)
    if found is None:
        return f"{folder} (not a git checkout)"
    return found[0][:12] + (" + local changes" if found[1] else "")


# ---------------------------------------------------------------------------------------------
# The official protocol: the prompts as sent, the parses, the loop
# ---------------------------------------------------------------------------------------------
def band(emotion: int, bands: dict) -> str:
    # the first band (highest first) whose lower bound e reaches; below FAILURE_BELOW: Emotion-F
    if emotion < FAILURE_BELOW:
        return "Emotion-F"
    for name, low in bands.items():
        if emotion >= low:
            return name
    return "Emotion-F"


def history_json(messages: list[dict], roles: dict) -> str:
    """The dialogue as the simulator reads it: JSON, roles renamed (user / assistant -> 你 / NPC), indent 2."""
    return json.dumps(
        [{"role": roles[m["role"]], "content": m["content"]} for m in messages], ensure_ascii=False, indent=2
    )


def analysis_prompt(P: Protocol, d: Dialogue) -> str:
    """Prompt 1, filled in the official order: the emotion (a number), persona, scene, goal, the history."""
    prompt = P.analysis.replace("{{emotion}}", str(d.emotion)).replace("{{simulator_role}}", d.profile["player"])
    prompt = prompt.replace("{{simulator_scene}}", d.profile["scene"]).replace("{{target}}", P.target)
    return prompt.replace("{{dialog_history}}", history_json(d.history, P.roles))


def reply_prompt(P: Protocol, d: Dialogue, analysis: dict | None) -> str:
    """Prompt 2, filled in the official order: the feeling (the analysis), goal, band, persona, scene, then the
    history before the last exchange and the last exchange. No analysis and no history: the opening."""
    feeling = "".join(x if kind == "text" else analysis[x] for kind, x in P.feeling) if analysis else P.open_feeling
    prompt = P.reply.replace("{{planning}}", feeling).replace("{{target}}", P.target).replace("{{emotion}}", d.state)
    prompt = prompt.replace("{{player_type}}", d.profile["player"]).replace("{{player_topic}}", d.profile["scene"])
    if not d.history:
        return prompt.replace("{{dialog_history}}", P.open_history).replace("{{new_history}}", "")
    return prompt.replace("{{dialog_history}}", history_json(d.history[:-2], P.roles)).replace(
        "{{new_history}}", history_json(d.history[-2:], P.roles)
    )


def section(text: str, start: str, end: str) -> str:
    return text.split(start)[-1].split(end)[0].strip("\n").strip("[").strip("]")


def read_analysis(text: str | None) -> dict | None:
    """Prompt 1's answer as the official parse reads it: "：" as ":", "*" dropped, each section up to the next
    label; change = the first integer after the last "Change:" (the whole answer when there is none), clipped
    to [-10, 10]. None when there is no integer: the simulator is asked again."""
    if text is None:
        return None
    t = text.replace("：", ":").replace("*", "")
    m = re.search(r"[+-]?\d+", t.split("Change:")[-1])
    if m is None:
        return None
    out = {key: section(t, start, end) for key, (start, end) in SECTIONS.items()}
    out["change"] = max(-CHANGE_MAX, min(CHANGE_MAX, int(m.group())))
    out["labelled"] = "Change:" in t
    return out


def read_reply(text: str | None) -> dict | None:
    """Prompt 2's answer as the official parse reads it: the reply after the last "Response:" (the whole answer
    when there is none), brackets and quotes stripped, and the thinking before it. None: no answer."""
    if text is None:
        return None
    thinking = text.split("Response:")[0].split("Thinking:\n")[-1].strip("\n").strip("[").strip("]")
    return {
        "thinking": thinking,
        "content": text.split("Response:")[-1].strip("\n").strip("[").strip("]").strip("“").strip("”"),
    }


def ask(backend, prompts: list[str], read) -> tuple[list, list[int]]:
    """Each prompt sent as one user message, and sent again while read(answer) is None, at most REASKS more
    times -> (the read answers, None where none was read; the re-asks per prompt). When nothing was read and
    the endpoint itself failed, one UserError (05 saves the finished cases and stops)."""
    answers, reasks, todo = [None] * len(prompts), [0] * len(prompts), list(range(len(prompts)))
    failed_before = getattr(backend, "failures", 0)
    for attempt in range(REASKS + 1):
        texts = backend.chat(
            [[{"role": "user", "content": prompts[i]}] for i in todo], max_tokens=SIM_TOKENS, temperature=TEMPERATURE
        )
        for i, text in zip(todo, texts):
            answers[i] = read(text)
        todo = [i for i in todo if answers[i] is None]
        if not todo or attempt == REASKS:
            break
        for i in todo:
            reasks[i] += 1
    if prompts and all(a is None for a in answers) and getattr(backend, "failures", 0) > failed_before:
        raise common.UserError(
            f"sage simulator {backend.spec}: no usable answer for any of {len(prompts)} "
            "dialogues; the endpoint failed after its retries (is it up?)"
        )
    return answers, reasks


@dataclass
class Dialogue:
    profile: dict
    emotion: int = START
    state: str = ""
    history: list = field(default_factory=list)  # the official record: user turns carry emotion-point, planning
    emotions: list = field(default_factory=lambda: [START])
    changes: list = field(default_factory=list)
    reasks: int = 0
    unlabelled: int = 0
    cut_off: int = 0
    ended: str | None = None
    unanswered: str | None = None

    def stop(self, why: str, unanswered=False):
        self.ended = why
        self.unanswered = why if unanswered else None


def official_cases(model, tok, profiles: list[dict], user, args) -> tuple[list[dict], list[dict]]:
    """test_npc.py's loop on a batch of profiles, the dialogues in step: replies of the tested model batched,
    the simulator's prompts sent together. -> (cases, transcripts in the official *_result.jsonl format)."""
    P, backend = protocol(args.sage_dir), user.backend
    dialogues = [Dialogue(p, state=band(START, P.bands)) for p in profiles]
    # 1. the opening: first_talk, or the simulator's answer with no analysis and no history
    for d in dialogues:
        if (d.profile.get("first_talk") or "").strip():
            d.history.append({"role": "user", "content": d.profile["first_talk"], "emotion-point": START})
    speak(P, backend, [d for d in dialogues if not d.history], None)
    for turn in range(1, args.sage_turns + 1):
        # 2. the tested model's reply (the 10th is never scored)
        npc_replies(model, tok, [d for d in dialogues if d.ended is None], P.system, args.max_context)
        live = [d for d in dialogues if d.ended is None]
        if turn == args.sage_turns or not live:
            break
        # 3. the simulator analyses the reply: change_t = clip(Change, -10, 10), e_t = min(100, e_{t-1} + change_t)
        analyses, reasks = ask(backend, [analysis_prompt(P, d) for d in live], read_analysis)
        for d, a, r in zip(live, analyses, reasks):
            d.reasks += r
            if a is None:
                d.stop(f"simulator never answered (analysis of reply {turn})", unanswered=True)
                continue
            d.emotion = min(SUCCESS_AT, d.emotion + a["change"])
            d.state = band(d.emotion, P.bands)
            d.emotions.append(d.emotion)
            d.changes.append(a["change"])
            d.unlabelled += not a["labelled"]
        # 4. ... then answers from the analysis and its band; a goodbye, e >= 100 or e < 10 ends the dialogue
        live = [(d, a) for d, a in zip(live, analyses) if a is not None]
        speak(P, backend, [d for d, _ in live], [a for _, a in live])
        for d, _ in live:
            said = d.history[-1]["content"] if d.ended is None else ""
            if any(word in said for word in GOODBYES):
                d.stop("goodbye")
            elif d.ended is None and (d.emotion >= SUCCESS_AT or d.emotion < FAILURE_BELOW):
                d.stop(f"emotion {'>= 100' if d.emotion >= SUCCESS_AT else '< 10'}")
    label = P.label(args.user)
    cases, transcripts = [], []
    for d in dialogues:
        replies = sum(m["role"] == "assistant" for m in d.history)
        cases.append(
            {
                "case": d.profile["id"],
                "protocol": label,
                "opening": "first_talk" if d.profile.get("first_talk", "").strip() else "simulator",
                "ended": d.ended or f"{replies} replies",
                "replies": replies,
                "updates": len(d.changes),
                "final_emotion": d.emotion,
                "emotions": d.emotions,
                "changes": d.changes,
                "reasks": d.reasks,
                "unlabelled_changes": d.unlabelled,
                "cut_off": d.cut_off,
                "unanswered": d.unanswered,
                "failed": None,
            }
        )
        topic = {"topic": d.profile["topic"]} if "topic" in d.profile else {}
        transcripts.append(
            {
                "case": d.profile["id"],
                "id": d.profile["id"],
                "emo_point": d.emotion,
                "emo_state": d.state,
                "player": d.profile["player"],
                "scene": d.profile["scene"],
                "character": d.profile["main_cha"],
                **topic,
                "task": d.profile["task"],
                "history": d.history,
            }
        )
    return cases, transcripts


def speak(P: Protocol, backend, dialogues: list[Dialogue], analyses: list[dict] | None):
    """The simulator's answer (prompt 2) appended to each dialogue, with its thinking, emotion and analysis."""
    if not dialogues:
        return
    answers, reasks = ask(
        backend, [reply_prompt(P, d, a) for d, a in zip(dialogues, analyses or [None] * len(dialogues))], read_reply
    )
    for i, (d, answer) in enumerate(zip(dialogues, answers)):
        d.reasks += reasks[i]
        if answer is None:
            d.stop(f"simulator never answered ({'opening' if analyses is None else 'answer'})", unanswered=True)
            continue
        planning = (
            {"analyse": P.open_feeling}
            if analyses is None
            else {k: v for k, v in analyses[i].items() if k != "labelled"}
        )
        d.history.append(
            {
                "role": "user",
                "content": answer["content"],
                "thinking": answer["thinking"],
                "emotion-point": d.emotion,
                "planning": planning,
            }
        )


def npc_replies(model, tok, dialogues: list[Dialogue], system: str, max_context: int):
    """The tested model's reply to each dialogue: the official system prompt, then the dialogue; REPLY_TOKENS
    new tokens, or the room left under max_context (none left: the dialogue ends), sampled at TEMPERATURE."""
    contexts = [
        common.render_ids(
            tok,
            [{"role": "system", "content": system}] + [{"role": m["role"], "content": m["content"]} for m in d.history],
        )
        for d in dialogues
    ]
    budgets = [min(REPLY_TOKENS, max_context - len(ids)) for ids in contexts]
    for budget in sorted(set(budgets)):
        rows = [i for i, b in enumerate(budgets) if b == budget]
        if budget <= 0:
            for i in rows:
                dialogues[i].stop(AT_LIMIT)
            continue
        # an endpoint's defaults: the model's own generation_config (model_settings=True)
        out = sampling.generate_batch(
            model, tok, [contexts[i] for i in rows], budget, TEMPERATURE, TOP_P, model_settings=True
        )
        for i, reply in zip(rows, out):
            text = common.strip_thinking(tok.decode(reply.ids, skip_special_tokens=True))
            dialogues[i].history.append({"role": "assistant", "content": text})
            dialogues[i].cut_off += not reply.ended


# ---------------------------------------------------------------------------------------------
# 05's entry points, and this project's variant on 03's rollout
# ---------------------------------------------------------------------------------------------
def load(args) -> list[dict]:
    """The profiles 05 evaluates. With --sage-dir the official files are read and checked first, the simulator
    must be an LLM (--user), and --sage-profiles left at its default means the checkout's
    profile/simulator_profile_withfirsttalk.jsonl (test_npc.py's)."""
    if not args.sage_dir:
        return load_profiles(args.sage_profiles)
    P = protocol(args.sage_dir)
    common.check(
        args.user != "scripted",
        "--sage-dir: SAGE's simulator is an LLM: pass --user api:<model>, "
        "hf:<model> or self (it plays the simulator; --judge is not used by this suite)",
    )
    default = Path(args.sage_profiles).resolve() == SAMPLE_PROFILES.resolve()
    return load_profiles(
        P.folder / "profile" / "simulator_profile_withfirsttalk.jsonl" if default else args.sage_profiles
    )


def cases(model, tok, profiles, judge, user, args, env) -> tuple[list[dict], list[dict]]:
    """05's SAGE suite on a batch of profiles: the official protocol with --sage-dir, else this project's
    variant: 03's rollout by SAGE's rules, one dialogue per profile, e_0 = START (40), at most --sage-turns,
    ending at e >= 100 or e < 10. The change is the LLM judge's (SageJudge), or offline the embed judge's
    levels: change_t = clip(2.5 * sum_axis v_t,axis, -10, 10) (03's emotion_change)."""
    if args.sage_dir:
        return official_cases(model, tok, profiles, user, args)
    sage_args = argparse.Namespace(
        **{**vars(args), "k": 1, "max_turns": args.sage_turns, "emotion_start": float(START), "emotion_ends": True}
    )
    if getattr(judge, "backend", None) is not None:  # an LLM judge: SAGE's simulator states the change
        judge = SageJudge(judge.backend, args.judge_retries)
    elif any(p["language"] == "zh" for p in profiles):
        common.warn(
            "sage: Chinese profiles with the offline judge, whose cues are English: their emotion changes "
            "mean little (an LLM judge reads both)"
        )
    written = openings(profiles, user, args)
    out, transcripts = [], []
    for tr in env.rollout(
        model, tok, [scenario(p, written.get(p["id"])) for p in profiles], judge, user, sage_args, desc="sage turns"
    ):
        changes = [e1 - e0 for e0, e1, v in zip(tr.emotions, tr.emotions[1:], tr.vs) if v is not None]
        failed = "user failed" if tr.outcome == "user_failed" else "judge failed on every turn" if not changes else None
        out.append(
            {
                "case": tr.scenario["id"],
                "protocol": VARIANT,
                "opening": tr.scenario["opening_from"],
                "outcome": tr.outcome,
                "turns": tr.T,
                "judged_turns": len(changes),
                "final_emotion": tr.emotions[-1],
                "emotions": tr.emotions,
                "changes": changes,
                "failed": failed,
            }
        )
        transcripts.append({"case": tr.scenario["id"], **env.trajectory_record(tr, sage_args)})
    return out, transcripts


def scenario(p: dict, written: str | None = None) -> dict:
    """A profile as 03's rollout and users see a scenario; p0 = 0 (the user's state is its emotion). The user
    opens with first_talk, else what an LLM user wrote (openings), else a short fixed line: never with the
    scene, the simulator's private background."""
    offline = TEXTS["sage_offline_opening"][p["language"]]
    opening, source = (
        (p["first_talk"], "first_talk")
        if (p.get("first_talk") or "").strip()
        else (written, "user model")
        if written
        else (offline, "offline line")
    )
    return {
        "id": p["id"],
        "persona": p["player"],
        "situation": f"{p['scene']} {p['task']}",
        "profile": p,
        "opening": opening,
        "opening_from": source,
        "p0": [0.0, 0.0, 0.0],
        "user_lines": TEXTS["sage_zh_lines"] if p["language"] == "zh" else TEXTS["scripted_user_lines"],
    }


def openings(profiles, user, args) -> dict:
    """{id: the first message} of the profiles without first_talk, written by the LLM user (any user with a
    chat backend) from the profile (main_cha: its personality type, cha_group: its traits); asked again
    (--judge-retries) when empty or reciting the scene. Missing where there is no LLM user or no usable answer."""
    backend, need = getattr(user, "backend", None), [p for p in profiles if not (p.get("first_talk") or "").strip()]
    if backend is None or not need:
        return {}
    prompts = [
        [
            {
                "role": "user",
                "content": TEXTS["sage_first_message"].format(
                    type=p["main_cha"],
                    traits=p["cha_group"] if isinstance(p["cha_group"], str) else ", ".join(p["cha_group"]),
                    player=p["player"],
                    scene=p["scene"],
                    task=p["task"],
                ),
            }
        ]
        for p in need
    ]
    scenes = [p["scene"].strip()[:120] for p in need]  # an answer that recites the scene is not usable
    written = backends.ask_json(
        backend,
        prompts,
        lambda i, t: t.strip() if t and t.strip() and not (scenes[i] and scenes[i] in t) else None,
        args.judge_retries,
        who="sage user",
        noun="openings",
        max_tokens=120,
        temperature=0.7,
    )
    if None in written:
        common.warn(f"sage: {written.count(None)} of {len(need)} first messages unusable: the offline line instead")
    return {p["id"]: w for p, w in zip(need, written) if w}


class SageJudge:
    """The variant's judge of 03's rollout: an LLM reads the reply and states the change of the user's emotion
    (JSON, parsed, asked again when malformed: api: only). It gives no EMPA levels (v_t = 0)."""

    def __init__(self, backend, retries: int):
        self.backend, self.retries = backend, retries

    def judge(self, cases: list[dict]) -> list[dict | None]:
        prompts = [
            [
                {
                    "role": "user",
                    "content": TEXTS["sage_judge"].format(
                        player=c["scenario"]["persona"],
                        scene=c["scenario"]["profile"]["scene"],
                        task=c["scenario"]["profile"]["task"],
                        emotion=c["emotion"],
                        history="\n".join(
                            common.transcript_lines(c["history"], user="You") + [f"Supporter: {c['reply']}"]
                        ),
                    ),
                }
            ]
            for c in cases
        ]
        changes = backends.ask_json(
            self.backend, prompts, lambda i, text: parse_change(text), self.retries, who="sage judge", noun="cases"
        )
        return [
            None if ch is None else {"levels": {a: (0, 0) for a in AXES}, "features": {}, "change": ch}
            for ch in changes
        ]


def load_profiles(path) -> list[dict]:
    recs = runs.read_jsonl(
        path,
        {"id": (str, int), "player": str, "scene": str, "main_cha": str, "cha_group": (str, list), "task": str},
        {"first_talk": str},
        unique=("id",),
    )
    for r in recs:  # the language, from the text (the profiles do not state it)
        r["id"], r["language"] = str(r["id"]), "zh" if re.search(r"[\u4e00-\u9fff]", r["player"] + r["scene"]) else "en"
    return recs


def parse_change(text) -> float | None:
    """The variant judge's emotion change (JSON "change"), clipped to [-10, 10], or None."""
    obj = backends.first_json(text)[0]
    x = obj.get("change") if obj else None
    if x is None:
        m = re.search(r'"?change"?\s*[:=]\s*([+-]?\d+(?:\.\d+)?)', text or "")
        x = float(m.group(1)) if m else None
    if not isinstance(x, (int, float)) or isinstance(x, bool) or not math.isfinite(x):
        return None
    return max(-10.0, min(10.0, float(x)))


def main(argv=None):
    p = options.ArgumentParser(
        description="The Sentient score of SAGE's result files (*_result.jsonl: one dialogue "
        "a line, its final emotion in emo_point): the mean over all lines, the successes "
        "(>= 100) and the failures (< 10), as 05 scores its SAGE cases."
    )
    p.add_argument("--score", nargs="+", required=True, metavar="FILE", help="official *_result.jsonl files")
    for path in p.parse_args(argv).score:
        recs = runs.read_jsonl(path, {"emo_point": (int, float)})
        s = sentient_score([r["emo_point"] for r in recs])
        tenth = Decimal(repr(s["score"])).quantize(Decimal("0.1"), ROUND_HALF_UP)  # the README's: halves up
        print(
            f"{path}: score {s['score']:.2f} (README rounding: {tenth}) over {s['profiles']} profiles, "
            f"success {s['successes']}, failure {s['failures']}"
        )


if __name__ == "__main__":
    common.run_main(main)

"""benchmarks/sage.py's official SAGE protocol on a miniature checkout written for this project
(tests/fixtures/sage: SAGE/simulator_response.py, npc_response.py, profile/, dataset/ in the official layout,
its own prompt texts): the files read at run time, the prompts as sent, the Change parse, the loop's rules
(10 replies, 9 updates, goodbye, the emotion ends, re-asks), the score over all profiles, the --score command,
and 05_eval.py --sage-dir end to end on the tiny model with the simulator on a loopback server."""

import argparse
import importlib.util
import json
import re
import shutil
import subprocess
import sys

import pytest

import common
import sampling
from benchmarks import sage
from conftest import ROOT, LoopbackServer, ok, run_script

ev = importlib.import_module("05_eval")
FIX = ROOT / "tests" / "fixtures" / "sage"
PROFILES = FIX / "SAGE" / "profile" / "simulator_profile_withfirsttalk.jsonl"
RESULT = FIX / "SAGE" / "dataset" / "fake-sim_based_simulator" / "model-x_result.jsonl"
GOAL = "GOAL: open up about what troubles you and feel heard."


class Simulator:
    """A scripted simulator backend (ChatBackend's chat API): per persona name, the emotion analyses and the
    answers in order, the last one repeating; None is no answer. Every prompt sent is kept."""

    spec, failures = "fake", 0

    def __init__(self, analyses: dict, answers: dict):
        self.analyses, self.answers, self.sent = analyses, answers, []

    def chat(self, conversations, max_tokens=256, temperature=0.0):
        out = []
        for conv in conversations:
            text = conv[0]["content"]
            self.sent.append(text)
            name = re.search(r"Name: (\w+)", text).group(1)
            queue = (self.analyses if text.startswith("ANALYSER") else self.answers)[name]
            out.append(queue.pop(0) if len(queue) > 1 else queue[0])
        return out


def run_official(monkeypatch, sim, ids=("p-neg",), turns=10):
    """official_cases on the fixture's profiles `ids`, the tested model replying "reply 1", "reply 2", ..."""

    def npc(model, tok, dialogues, system, max_context):
        assert system == "You are a kind listener. Reply warmly."  # npc_response.py's, read at run time
        for d in dialogues:
            n = sum(m["role"] == "assistant" for m in d.history) + 1
            d.history.append({"role": "assistant", "content": f"reply {n}"})

    monkeypatch.setattr(sage, "npc_replies", npc)
    profiles = [p for p in sage.load_profiles(PROFILES) if p["id"] in ids]
    args = argparse.Namespace(sage_dir=str(FIX), sage_turns=turns, max_context=8192, user="api:fake")
    return sage.official_cases(None, None, profiles, type("U", (), {"backend": sim})(), args)


def test_the_official_files_are_read_at_run_time_from_either_layout(tmp_path):
    whole, folder = sage.protocol(str(FIX)), sage.protocol(str(FIX / "SAGE"))
    assert whole.analysis == folder.analysis and whole.folder == folder.folder == FIX / "SAGE"
    assert whole.target == GOAL and whole.roles == {"user": "Me", "assistant": "Helper"}
    assert whole.bands == {"Emotion-S": 100, "Emotion-A": 70, "Emotion-B": 40, "Emotion-C": 10}
    assert whole.feeling == [
        ("text", "[facts] "),
        ("field", "TargetCompletion"),
        ("text", " [mood] "),
        ("field", "activity"),
        ("field", "analyse"),
    ]
    assert (whole.open_feeling, whole.open_history) == ("Open with a short line.", "(nothing yet: you speak first)")
    assert whole.system == "You are a kind listener. Reply warmly."
    # a copy outside any git checkout says so; a broken copy stops with one line naming the file
    shutil.copytree(FIX / "SAGE", tmp_path / "SAGE")
    assert sage.protocol(str(tmp_path)).commit == f"{tmp_path / 'SAGE'} (not a git checkout)"
    sim = tmp_path / "SAGE" / "simulator_response.py"
    sim.write_text(sim.read_text(encoding="utf-8").replace('Change:"""', '"""'), encoding="utf-8")
    with pytest.raises(common.UserError, match=rf"{re.escape(str(sim))}: planning_reply's template has no Change:"):
        sage.protocol(str(tmp_path / "SAGE"))
    (tmp_path / "SAGE" / "npc_response.py").unlink()
    sage.protocol.cache_clear()  # read once per run: a changed checkout is read again here
    with pytest.raises(common.UserError, match=r"npc_response.py: no such file"):
        sage.protocol(str(tmp_path))
    with pytest.raises(common.UserError, match=r"--sage-dir /no/such: no simulator_response.py"):
        sage.protocol("/no/such")


def test_a_git_checkout_is_labelled_with_its_commit(tmp_path):
    shutil.copytree(FIX / "SAGE", tmp_path / "SAGE")
    git = ["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t"]
    for cmd in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "x"]):
        subprocess.run(git + cmd, check=True)
    head = subprocess.run(git + ["rev-parse", "--short=12", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert sage.protocol(str(tmp_path)).label("api:sim") == f"official protocol, {head}, simulator api:sim"
    (tmp_path / "SAGE" / "npc_response.py").write_text("changed", encoding="utf-8")
    assert sage.git_commit(tmp_path / "SAGE") == f"{head} + local changes"


def test_a_copy_inside_another_git_project_does_not_take_its_commit(tmp_path):
    git = ["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t"]
    (tmp_path / "notes.txt").write_text("someone else's project", encoding="utf-8")
    for cmd in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "x"]):
        subprocess.run(git + cmd, check=True)
    shutil.copytree(FIX / "SAGE", tmp_path / "SAGE")  # dropped in, not tracked by that project
    assert sage.git_commit(tmp_path / "SAGE") == f"{tmp_path / 'SAGE'} (not a git checkout)"


def test_the_prompts_as_sent_for_a_known_state():
    P = sage.protocol(str(FIX))
    ana = [p for p in sage.load_profiles(PROFILES) if p["id"] == "p-neg"][0]
    d = sage.Dialogue(
        ana,
        emotion=45,
        state="Emotion-B",
        history=[
            {"role": "user", "content": "My sister owes me money and now she ghosts me.", "emotion-point": 40},
            {"role": "assistant", "content": "That sounds hard."},
            {"role": "user", "content": "Yes.", "emotion-point": 45},
            {"role": "assistant", "content": 'Tell me "more".'},
        ],
    )
    first_two = (
        '[\n  {\n    "role": "Me",\n    "content": "My sister owes me money and now she ghosts me."\n  },\n'
        '  {\n    "role": "Helper",\n    "content": "That sounds hard."\n  }\n]'
    )
    last_two = (
        '[\n  {\n    "role": "Me",\n    "content": "Yes."\n  },\n'
        '  {\n    "role": "Helper",\n    "content": "Tell me \\"more\\"."\n  }\n]'
    )
    persona = "Name: Ana, 30, a nurse on night shifts; blunt, tired."
    scene = "Ana's sister borrowed money and stopped answering."
    assert sage.analysis_prompt(P, d) == (
        f"ANALYSER. Goal: {GOAL}\nPersona: {persona}\nScene: {scene}\nEmotion now: 45\nDialogue:\n"
        f"{first_two[:-2]},\n{last_two[2:]}\nAnswer in sections Content: TargetCompletion: Activity: Analyse: Change:"
    )
    analysis = {
        "content": "c",
        "TargetCompletion": "partly",
        "activity": "annoyed",
        "analyse": " but calmer",
        "change": 5,
    }
    assert sage.reply_prompt(P, d, analysis) == (
        f"ACTOR. Goal: {GOAL}\nBand: Emotion-B\nPersona: {persona}\nScene: {scene}\nEarlier:\n{first_two}\n"
        f"Latest:\n{last_two}\nFeeling:\n[facts] partly [mood] annoyed but calmer\n"
        "Answer in sections Thinking: Origin: Change: Response:"
    )
    # the opening of a profile without first_talk: no analysis, no history
    cy = sage.Dialogue([p for p in sage.load_profiles(PROFILES) if p["id"] == "p-avo"][0], state="Emotion-B")
    assert sage.reply_prompt(P, cy, None) == (
        f"ACTOR. Goal: {GOAL}\nBand: Emotion-B\nPersona: Name: Cy, 45, a shop owner.\n"
        "Scene: Cy's shop may close next month.\nEarlier:\n(nothing yet: you speak first)\nLatest:\n\n"
        "Feeling:\nOpen with a short line.\nAnswer in sections Thinking: Origin: Change: Response:"
    )


def test_the_change_parse_and_clip():
    full = "Content:\n[kind]\nTargetCompletion:\npartly\nActivity:\nthinks\nAnalyse:\nok\nChange:\n[+4]"
    a = sage.read_analysis(full)
    assert a == {
        "content": "kind",
        "TargetCompletion": "partly",
        "activity": "thinks",
        "analyse": "ok",
        "change": 4,
        "labelled": True,
    }
    assert sage.read_analysis("Change: -25")["change"] == -10 and sage.read_analysis("Change: 99")["change"] == 10
    assert sage.read_analysis("**Change：** 7")["change"] == 7  # "*" dropped, the full-width colon read
    assert sage.read_analysis("Change: 2 then Change: -3 (and 8)")["change"] == -3  # after the last "Change:"
    loose = sage.read_analysis("I feel 6 times better")  # no label: the whole answer, counted
    assert (loose["change"], loose["labelled"]) == (6, False)
    assert sage.read_analysis("Change: a lot") is None and sage.read_analysis(None) is None
    r = sage.read_reply("Thinking:\nhmm\nOrigin:\nx\nResponse:\n[“fine, thanks”]")
    assert r == {"thinking": "hmm\nOrigin:\nx", "content": "fine, thanks"}
    assert sage.read_reply("just text") == {"thinking": "just text", "content": "just text"}
    assert sage.read_reply(None) is None
    assert [sage.band(e, sage.protocol(str(FIX)).bands) for e in (100, 70, 69, 40, 10, 9, 0)] == [
        "Emotion-S",
        "Emotion-A",
        "Emotion-B",
        "Emotion-B",
        "Emotion-C",
        "Emotion-F",
        "Emotion-F",
    ]


def test_ten_replies_nine_updates_and_the_tenth_never_scored(monkeypatch):
    sim = Simulator({"Ana": ["Change: +1"]}, {"Ana": ["Response: go on"]})
    (case,), (tr,) = run_official(monkeypatch, sim)
    assert (case["replies"], case["updates"], case["ended"]) == (10, 9, "10 replies")
    assert case["emotions"] == list(range(40, 50)) and case["final_emotion"] == 49 and case["failed"] is None
    assert sum(s.startswith("ANALYSER") for s in sim.sent) == 9 and "reply 10" not in " ".join(sim.sent)
    assert tr["history"][-1] == {"role": "assistant", "content": "reply 10"} and tr["emo_point"] == 49
    assert tr["history"][0] == {
        "role": "user",
        "content": "My sister owes me money and now she ghosts me.",
        "emotion-point": 40,
    }
    assert tr["history"][2]["emotion-point"] == 41 and tr["history"][2]["planning"]["change"] == 1
    assert (tr["character"], tr["emo_state"]) == ("负面型", "Emotion-B") and "topic" not in tr


@pytest.mark.parametrize(
    "changes, answers, want",
    [
        (["Change: 3"], ["Response: ok", "Response: thanks, 拜拜"], (2, 2, [40, 43, 46], "goodbye")),
        (
            ["Change: +7"],
            ["Response: ok"],
            (9, 9, [40, 47, 54, 61, 68, 75, 82, 89, 96, 100], "emotion >= 100"),
        ),  # capped
        (["Change: -10"], ["Response: ok"], (4, 4, [40, 30, 20, 10, 0], "emotion < 10")),
    ],
)
def test_the_dialogue_ends_on_goodbye_or_the_emotion(monkeypatch, changes, answers, want):
    (case,), (tr,) = run_official(monkeypatch, Simulator({"Ana": changes}, {"Ana": answers}))
    assert (case["replies"], case["updates"], case["emotions"], case["ended"]) == want
    assert tr["history"][-1]["role"] == "user"  # it ends on the simulator's answer, as test_npc.py's does


def test_reasks_are_counted_and_a_silent_simulator_is_reported_not_dropped(monkeypatch):
    sim = Simulator(
        {"Ana": ["no number", "Change: 3", "Change: 3"], "Bo": [None], "Cy": ["Change: 1"]},
        {"Ana": ["Response: ok"], "Bo": ["Response: ok"], "Cy": [None]},
    )
    cases, _ = run_official(monkeypatch, sim, ids=("p-neg", "p-pas", "p-avo"), turns=3)
    by = {c["case"]: c for c in cases}
    assert by["p-neg"]["reasks"] == 1 and by["p-neg"]["emotions"] == [40, 43, 46] and not by["p-neg"]["unanswered"]
    assert by["p-pas"]["reasks"] == sage.REASKS and by["p-pas"]["final_emotion"] == 40
    assert by["p-pas"]["unanswered"] == "simulator never answered (analysis of reply 1)" and by["p-pas"]["replies"] == 1
    assert by["p-avo"]["unanswered"] == "simulator never answered (opening)" and by["p-avo"]["replies"] == 0
    assert by["p-avo"]["opening"] == "simulator" and by["p-neg"]["opening"] == "first_talk"
    # the score: every profile, the silent ones at their last emotion: (46 + 40 + 40) / 3
    s = sage.summary(cases)
    assert s["score"] == pytest.approx(42.0) and (s["successes"], s["failures"]) == (0, 0)
    assert s["unanswered"] == ["p-neg", "p-pas", "p-avo"][1:] and s["profiles"] == 3
    summary = ev.summarize([{**c, "model": "base", "suite": "sage"} for c in cases], "sage")
    assert summary["n"] == 3 and summary["failed"] == 0 and summary["sentient"][0] == pytest.approx(42.0)
    table = ev.results_table({"base": {"sage": summary}}, ["sage"])
    assert "| SAGE Sentient (official protocol, " in table and "simulator api:fake) |" in table
    assert "; 2 unanswered, at their last emotion (p-pas, p-avo) | 0 / 0 |" in table
    # with --sage-dir, before any profile finished (a run stopped at its first batch): still the official label
    none = ev.results_table({}, ["sage"], argparse.Namespace(sage_dir="SAGE", eqbench3_dir=None))
    assert "| SAGE Sentient (official protocol, no profile finished) |" in none
    assert "this project's variant" in ev.results_table({}, ["sage"])


def test_a_dialogue_at_the_context_limit_is_scored_as_it_stood_and_counted_in_the_cell(monkeypatch):
    # official: no room left for p-pas's 3rd reply (npc_replies stops it so): it ends at its emotion then, like
    # a dialogue the protocol ended, stays in the score, and the cell says so
    def npc(model, tok, dialogues, system, max_context):
        for d in dialogues:
            n = sum(m["role"] == "assistant" for m in d.history) + 1
            if d.profile["id"] == "p-pas" and n == 3:
                d.stop(sage.AT_LIMIT)
            else:
                d.history.append({"role": "assistant", "content": f"reply {n}"})

    monkeypatch.setattr(sage, "npc_replies", npc)
    sim = Simulator({"Ana": ["Change: +1"], "Bo": ["Change: +1"]}, {"Ana": ["Response: ok"], "Bo": ["Response: ok"]})
    profiles = [p for p in sage.load_profiles(PROFILES) if p["id"] in ("p-neg", "p-pas")]
    args = argparse.Namespace(sage_dir=str(FIX), sage_turns=5, max_context=8192, user="api:fake")
    cases, _ = sage.official_cases(None, None, profiles, type("U", (), {"backend": sim})(), args)
    by = {c["case"]: c for c in cases}
    assert (by["p-neg"]["ended"], by["p-neg"]["replies"], by["p-neg"]["final_emotion"]) == ("5 replies", 5, 44)
    assert (by["p-pas"]["ended"], by["p-pas"]["replies"], by["p-pas"]["final_emotion"]) == ("context limit", 2, 42)
    summary = ev.summarize([{**c, "model": "base", "suite": "sage"} for c in cases], "sage")
    assert (summary["n"], summary["context_limit"], summary["sentient"][0]) == (2, 1, 43.0)
    # 43 ± t_{0.975, 1} x sd(44, 42) / sqrt(2) = 12.706 x sqrt(2) / sqrt(2)
    cell = "| 43.00 ± 12.71 (n=2); 1 ended at the context limit | 0 / 0 |"
    assert cell in ev.results_table({"base": {"sage": summary}}, ["sage"])
    # the variant: 03's outcome context_limit, counted among the kept cases only (a failed one is out)
    variant = [
        {"case": "a", "outcome": "context_limit", "final_emotion": 50.0, "failed": None},
        {"case": "b", "outcome": "timeout", "final_emotion": 30.0, "failed": None},
        {"case": "c", "outcome": "context_limit", "final_emotion": 40.0, "failed": "judge failed on every turn"},
    ]
    summary = ev.summarize([{**c, "model": "base", "suite": "sage"} for c in variant], "sage")
    assert (summary["n"], summary["failed"], summary["context_limit"]) == (2, 1, 1)
    cell = f"| 40.00 ± {12.706 * 10:.2f} (n=2); 1 failed; 1 ended at the context limit | 0 / 0 |"
    assert cell in ev.results_table({"base": {"sage": summary}}, ["sage"])


def test_the_tested_model_gets_the_system_prompt_and_the_room_left(monkeypatch, tiny):
    model, tok = tiny
    seen = []

    def generate(model, tok, contexts, budget, temperature, top_p, model_settings):
        assert model_settings  # the official protocol: an endpoint's defaults, the model's own settings
        seen.append(([tok.decode(c) for c in contexts], budget, temperature, top_p))
        return [sampling.Reply(tok("fine", add_special_tokens=False)["input_ids"], budget > 5, None)] * len(contexts)

    monkeypatch.setattr(sage.sampling, "generate_batch", generate)
    short = sage.Dialogue({"id": "a"}, history=[{"role": "user", "content": "hi", "emotion-point": 40}])
    long = sage.Dialogue({"id": "b"}, history=[{"role": "user", "content": "word " * 300, "emotion-point": 40}])
    n_short = len(common.render_ids(tok, [{"role": "system", "content": "SYS"}, {"role": "user", "content": "hi"}]))
    sage.npc_replies(model, tok, [short, long], "SYS", max_context=n_short + 3000)
    assert len(seen) == 1 and seen[0][1:] == (sage.REPLY_TOKENS, 1.0, 1.0)  # both fit: one call, 2048 tokens
    assert seen[0][0][0].startswith("<|im_start|>system\nSYS<|im_end|>\n<|im_start|>user\nhi")
    seen.clear()
    short = sage.Dialogue({"id": "a"}, history=short.history[:1])
    long = sage.Dialogue({"id": "b"}, history=long.history[:1])
    sage.npc_replies(model, tok, [short, long], "SYS", max_context=n_short + 4)
    assert [s[1] for s in seen] == [4] and long.ended == "context limit" and short.cut_off == 1
    assert short.history[-1] == {"role": "assistant", "content": "fine"}


def test_the_score_over_all_profiles_and_the_score_command():
    assert sage.sentient_score([100, 0, 55, 100, 7, 40]) == {
        "score": pytest.approx(302 / 6),
        "successes": 2,
        "failures": 2,
        "profiles": 6,
    }
    assert sage.sentient_score([99.9, 10])["successes"] == 0 and sage.sentient_score([9.99])["failures"] == 1
    p = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "sage.py"), "--score", str(RESULT)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr
    assert p.stdout == f"{RESULT}: score 50.33 (README rounding: 50.3) over 6 profiles, success 2, failure 2\n"
    q = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "sage.py"), "--score", str(PROFILES)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert q.returncode == 2 and q.stderr == f"error: {PROFILES}:1: missing field 'emo_point'\n"


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--sage-dir", "/no/such"], "--sage-dir /no/such: no simulator_response.py there or in its SAGE folder"),
        (["--sage-dir", str(FIX)], "--sage-dir: SAGE's simulator is an LLM: pass --user api:<model>"),
    ],
)
def test_bad_sage_dirs_exit_2_with_one_message(tmp_path, capsys, flags, message):
    with pytest.raises(SystemExit) as e:
        common.run_main(ev.main, ["--suite", "sage", *flags, "--out-dir", str(tmp_path / "runs")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and message in err and err.count("\n") == 1 and not (tmp_path / "runs").exists()


def test_eval_sage_dir_on_the_tiny_model_with_a_loopback_simulator(tiny_model, tmp_path):
    def respond(index, body):  # the simulator: analyses gain 5, answers say little
        if body["messages"][0]["content"].startswith("ANALYSER"):
            return ok("Content:\nx\nTargetCompletion:\nx\nActivity:\nx\nAnalyse:\nx\nChange:\n+5")
        return ok("Thinking:\nshort\nResponse:\nmm, okay")

    # --judge names a model that does not exist: with --sage-dir the suite never builds a judge
    flags = [
        "--model",
        tiny_model,
        "--suite",
        "sage",
        "--sage-dir",
        FIX,
        "--user",
        "api:sim",
        "--judge",
        "hf:/no/model",
        "--sage-turns",
        "3",
        "--max-context",
        "300",
        "--batch-size",
        "2",
        "--no-progress",
    ]
    with LoopbackServer(respond) as server:
        p = run_script("05_eval.py", *flags, "--api-base", server.base, "--out-dir", tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    run = next(tmp_path.iterdir())
    cases = [json.loads(x) for x in (run / "cases.jsonl").read_text(encoding="utf-8").splitlines()]
    assert sorted(c["case"] for c in cases) == ["p-avo", "p-neg", "p-pas"]  # the checkout's own profiles
    for c in cases:
        assert c["protocol"].startswith("official protocol, ") and c["protocol"].endswith(", simulator api:sim")
        assert c["updates"] == len(c["changes"]) == c["replies"] - (c["ended"] != "context limit") <= 2
        assert not c["unanswered"] and c["reasks"] == 0
        assert c["emotions"] == [40 + 5 * k for k in range(c["updates"] + 1)]
    assert {c["case"]: c["opening"] for c in cases}["p-avo"] == "simulator"
    transcripts = [json.loads(x) for x in (run / "transcripts.jsonl").read_text(encoding="utf-8").splitlines()]
    assert {t["id"] for t in transcripts} == {"p-avo", "p-neg", "p-pas"} and all("emo_point" in t for t in transcripts)
    asked = [r["body"]["messages"][0]["content"] for r in server.requests]
    assert any('"role": "Helper"' in a for a in asked) and all(a.startswith(("ANALYSER", "ACTOR")) for a in asked)
    table = (run / "results.md").read_text(encoding="utf-8")
    assert "| SAGE Sentient (official protocol, " in table and "simulator api:sim) | SAGE success / failure |" in table
    assert "(n=3)" in table and "SAGE Sentient (official protocol" in p.stdout
    at_limit = sum(c["ended"] == "context limit" for c in cases)  # --max-context 300: some may reach it
    assert ("ended at the context limit" in table) == (at_limit > 0)
    assert at_limit == 0 or f"; {at_limit} ended at the context limit |" in table


def test_the_prompts_sent_are_what_the_checkouts_own_functions_build(monkeypatch):
    """The fixture's planning_reply and player_reply run with a stub call_llm: sage.py, which reads their texts
    by `ast` and never runs them, sends the same prompts for the same state (mid-dialogue and the opening)."""
    spec = importlib.util.spec_from_file_location("fixture_sim", FIX / "SAGE" / "simulator_response.py")
    official = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(official)
    built = []

    def call_llm(prompt):
        built.append(prompt)
        return "Change: 1"

    monkeypatch.setattr(official, "call_llm", call_llm, raising=False)
    P, bo = sage.protocol(str(FIX)), [p for p in sage.load_profiles(PROFILES) if p["id"] == "p-pas"][0]
    history = [
        {"role": "user", "content": "hey. nothing much.", "emotion-point": 40},
        {"role": "assistant", "content": "School stuff? 说说看"},
        {"role": "user", "content": "a group project", "emotion-point": 37},
        {"role": "assistant", "content": "Left out?"},
    ]
    player = {
        "emo_point": 37,
        "emo_state": "Emotion-C",
        "player": bo["player"],
        "scene": bo["scene"],
        "history": history,
    }
    analysis = {"content": "x", "TargetCompletion": "yes", "activity": "relieved", "analyse": ", a bit", "change": 1}
    official.planning_reply(player)
    official.player_reply(player, dict(analysis))
    official.player_reply({**player, "emo_state": "Emotion-B", "history": []}, {})
    d = sage.Dialogue(bo, emotion=37, state="Emotion-C", history=history)
    assert built == [
        sage.analysis_prompt(P, d),
        sage.reply_prompt(P, d, analysis),
        sage.reply_prompt(P, sage.Dialogue(bo, state="Emotion-B"), None),
    ]
    assert "说说看" in built[0] and "{{" not in "".join(built)

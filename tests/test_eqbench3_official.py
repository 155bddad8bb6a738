"""benchmarks/eqbench3.py's official EQ-Bench 3 rubric protocol on a miniature checkout written for this project
(tests/fixtures/eqbench3: data/*.txt and core/benchmark.py in the official layout, its own wording): the tasks
and kinds as the official parser gives them (a `####### 1` scenario skipped), the master template per kind, the
transcript and judge prompt for a known reply, the lenient parse, the 100-character guard, the arithmetic by
hand (iterations pooled), the labels, the sampling settings of each call, one-line errors, and 05_eval.py
--eqbench3-dir end to end on the tiny model with the judge on a loopback server, every step kept in cases.jsonl."""

import dataclasses
import importlib
import json
import types

import pytest

import common
import sampling
from benchmarks import eqbench3
from conftest import ROOT, LoopbackServer, ok, run_script

ev = importlib.import_module("05_eval")
FIX = ROOT / "tests" / "fixtures" / "eqbench3"
TASK1_TURN1 = (
    "Your colleague Dana keeps taking things from your desk and denies it.\nToday your stapler is on her desk again."
)


@pytest.fixture
def P():
    return eqbench3.protocol(str(FIX))


def task(P, sid):
    return next(t for t in P.tasks if t["id"] == sid)


def test_the_tasks_and_kinds_are_the_official_parsers(P, tmp_path):
    assert [(t["id"], t["kind"], len(t["prompts"])) for t in P.tasks] == [
        ("1", "roleplay", 2),
        ("8", "no_roleplay", 1),
        ("201", "drafting", 1),
        ("402", "analysis", 1),
    ]  # no 409
    assert task(P, "1")["prompts"] == [TASK1_TURN1, 'Dana laughs: "Relax, it\'s just a stapler."']
    assert task(P, "8")["prompts"] == [
        "My friend is late for the third time this month and I am fed up. What should I say?"
    ]  # the note before its first turn is not in it
    assert P.criteria == {
        "standard": ["demonstrated_empathy", "pragmatic_ei", "warmth", "depth_of_insight"],
        "analysis": ["theory_of_mind", "correctness"],
    }
    assert P.commit == "no commit (not a git checkout)"  # a folder inside this repository: not its checkout
    # a repeated id replaces the first one's prompts in its place; a byte-order mark hides the first header
    f = tmp_path / "p.txt"
    f.write_text(
        "######## 5 | a\n####### Prompt1\nold\n######## 6 | b\n####### Prompt1\nsix\n"
        "######## 5 | c\n####### Prompt1\nnew\n####### Prompt2\n\n",
        encoding="utf-8",
    )
    assert [(t["id"], t["prompts"]) for t in eqbench3.read_tasks(f)] == [("5", ["new"]), ("6", ["six"])]
    f.write_text(
        "\ufeff######## 5 | a\n####### Prompt1\nlost\n######## 6 | b\n####### Prompt1\nkept\n", encoding="utf-8"
    )
    assert [t["id"] for t in eqbench3.read_tasks(f)] == ["6"]
    assert eqbench3.kind_of("14") == "no_roleplay" and eqbench3.kind_of("209") == "drafting"
    assert eqbench3.kind_of("420") == "analysis" and eqbench3.kind_of("7") == "roleplay"


def test_a_git_checkout_is_labelled_with_its_commit(tmp_path):
    import shutil
    import subprocess

    shutil.copytree(FIX, tmp_path / "eqb")
    (tmp_path / "eqb" / "data" / "scenario_notes.txt").write_text("notes")  # the official data/ has more files
    git = ["git", "-C", str(tmp_path / "eqb"), "-c", "user.name=t", "-c", "user.email=t@t"]
    for cmd in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "x"]):
        subprocess.run(git + cmd, check=True)
    head = subprocess.run(git + ["rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert eqbench3.git_commit(tmp_path / "eqb") == head[:12] and len(head) == 40
    (tmp_path / "eqb" / "data" / "scenario_notes.txt").unlink()  # a file the protocol does not read: no change
    assert eqbench3.git_commit(tmp_path / "eqb") == head[:12]
    (tmp_path / "eqb" / "data" / "debrief_prompt.txt").write_text("changed")
    assert eqbench3.git_commit(tmp_path / "eqb") == head[:12] + " + local changes"
    label = eqbench3.protocol(str(tmp_path / "eqb")).label()
    assert label == f"official protocol, files at {head[:12]} + local changes"


def test_each_kind_gets_its_master_template_and_no_roleplay_none(P):
    rp = eqbench3.wrap(P, task(P, "1"), "TURN")
    assert rp.startswith("TURN\n\n--\n\nAnswer in these three parts:\n\n# I'm thinking & feeling\n")
    assert rp.endswith("# My response\n\n<what you say (100 words)>\n\n--\n")
    assert "# Perspective-taking" in eqbench3.wrap(P, task(P, "201"), "TURN")
    assert eqbench3.wrap(P, task(P, "402"), "TURN").startswith("[TRANSCRIPT]\n\nTURN\n\n[/TRANSCRIPT]\n\nAnalyse")
    assert eqbench3.wrap(P, task(P, "8"), "TURN") == "TURN"


def test_the_judge_prompt_for_a_known_reply_with_a_missing_section(P):
    t = task(P, "1")
    reply = "# I’m thinking & feeling\nShe *knows* it's mine.\n# My response\nCan I have it back?\n--\nbye"
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": reply}]
    assert eqbench3.sections("roleplay", reply) == {
        "thinking_feeling": "She *knows* it's mine.",
        "their_thinking_feeling": "",
        "response": "Can I have it back?",
    }
    assert eqbench3.transcript(t, messages) == (
        "User:\nHi\n---\nAssistant:\n# I'm thinking & feeling\nShe *knows* it's mine.\n\n# They're thinking & "
        "feeling\n\n\n# My response\nCan I have it back?\n\n--\n"
    )
    want = (
        "Score the assistant's emotional intelligence in this role-play, each criterion 0-20.\n\n"
        "[TRANSCRIPT START]\n\n"
        "User:\nHi\n---\nAssistant:\n I'm thinking & feeling\nShe knows it's mine.\n\n They're thinking & "
        "feeling\n\n\n My response\nCan I have it back?\n\n--\n\n\n---\n\nUser:\nDebrief, please.\n\n---\n\n"
        "Assistant:\nI missed a lot.\n\n[TRANSCRIPT END]\n\n Notes\n- Be critical.\n\n"
        "Reply with JSON in this format:\n\n"
        '{\n  "chain_of_thought_reasoning": "your reasons first, briefly",\n  "demonstrated_empathy": 0-20,\n'
        '  "pragmatic_ei": 0-20,\n  "warmth": 0-20,\n  "depth_of_insight": 0-20\n}\n'
    )
    assert eqbench3.judge_prompt(P, t, messages, "I missed **a lot**.") == want
    # analysis: the reply as it is (no sections), no debrief, "*" and "#" gone from the template too
    got = eqbench3.judge_prompt(
        P, task(P, "402"), [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "# A *deep* read"}], None
    )
    assert got.startswith(
        "[ANALYSIS]\n\nUser:\nQ\n---\nAssistant:\n A deep read\n\n\n[/ANALYSIS]\n\nScore the analysis"
    )
    assert '"chain_of_thought_reasoning": "your reasons for the analysis scores",\n  "theory_of_mind": 0-20' in got
    # drafting: a reply with no headings at all renders as three empty sections
    assert eqbench3.render("drafting", "just a message") == (
        "# Perspective-taking\n\n\n# Draft brainstorming\n\n\n# Draft\n\n\n--"
    )


@pytest.mark.parametrize(
    "answer, want",
    [
        (
            '{"chain_of_thought_reasoning": "x 3", "demonstrated_empathy": "15/20", "pragmatic_ei": 12}',
            {"demonstrated_empathy": 15.0, "pragmatic_ei": 12.0},
        ),
        ('```json\n{"a": 1}\n```\nthen\n```json\n{"warmth": "about 7.5 of 20"}\n```', {"warmth": 7.5}),
        ('{"chain_of_thought_reasoning": "one\ntwo", "correctness": 11}', {"correctness": 11.0}),
        ('{"chain_of_thought_reasoning": "she said "no" to it", "theory_of_mind": 9}', {"theory_of_mind": 9.0}),
        ('prose first {"depth_of_insight": 14} and {"depth_of_insight": 2}', {"depth_of_insight": 14.0}),
        ('{"x": "none"}', None),
        ("{}", None),
        ("no JSON here", None),
        ('{"a": 1', None),
        (None, None),
    ],
)
def test_the_judges_answer_is_read_leniently(answer, want):
    assert eqbench3.read_scores(answer) == want


def test_the_arithmetic_by_hand_with_iterations_pooled(P):
    # s_ti = the mean of the allowed criteria: warmth is asked but not allowed; analysis: its file's criteria
    assert (
        eqbench3.task_score(
            {"demonstrated_empathy": 14.0, "pragmatic_ei": 10.0, "warmth": 20.0, "depth_of_insight": 12.0},
            "roleplay",
            P,
        )
        == 12.0
    )
    assert (
        eqbench3.task_score({"theory_of_mind": 15.0, "correctness": 10.0, "depth_of_insight": 20.0}, "analysis", P)
        == 12.5
    )
    assert eqbench3.task_score({"warmth": 20.0}, "drafting", P) is None  # nothing allowed: not scored
    weighted = dataclasses.replace(P, criteria={**P.criteria, "analysis": ["overall_eq", "correctness"]})
    assert eqbench3.task_score({"overall_eq": 20.0, "correctness": 10.0}, "analysis", weighted) == 17.5  # 70 / 4
    # iteration 1: 12 and 12.5; iteration 2: 13.5 (the other failed): pooled (12 + 12.5 + 13.5) / 3 = 12.666..
    # -> 12.67 -> x 5 = 63.35, not the per-iteration mean (12.25 + 13.5) / 2 = 12.875 -> 64.38
    assert eqbench3.rubric_score([12.0, 12.5, 13.5]) == {"score": pytest.approx(63.35), "rubric": 12.67, "scored": 3}
    cases = [
        {
            "case": f"{t}#{i}",
            "task": t,
            "iteration": i,
            "kind": "roleplay",
            "protocol": "official protocol, x",
            "judge": "api:j",
            "reply_budget": 12000,
            "failed": None,
            "rubric": r,
            "score": 5 * r,
        }
        for t, i, r in (("1", 1, 12.0), ("2", 1, 12.5), ("1", 2, 13.5))
    ]
    cases.append({**cases[0], "case": "2#2", "iteration": 2, "failed": "judge answer has no score"})
    s = {"n": 3, "failed": 1, **eqbench3.summary(cases, ev.t_interval)}
    assert (s["score"], s["tasks"], s["iterations"]) == (pytest.approx(63.35), 2, 2)
    assert eqbench3.cell(s, ev.fmt) == "63.35 (n=3 scored, 2 iterations); 1 failed"


def test_the_column_says_what_produced_the_score():
    def official(tasks, budget, judge_budget=8000):
        return {
            "m": {
                "eqbench3": {
                    "protocol": "official protocol, x",
                    "judge": "api:j",
                    "tasks": tasks,
                    "budget": budget,
                    "judge_budget": judge_budget,
                }
            }
        }

    assert eqbench3.column(official(45, 12000)) == "EQ-Bench 3 rubric score (official protocol, judge api:j, 45 tasks)"
    assert eqbench3.column(official(4, 300)) == (
        "EQ-Bench 3 rubric score (official protocol, judge api:j, 4 tasks); "
        "partial: 4 of 45 tasks; reply budget lowered to 300 tokens"
    )
    assert eqbench3.column(official(45, 12000, 64)).endswith("45 tasks); judge budget lowered to 64 tokens")
    assert eqbench3.column({"m": {"eqbench3": {"proxy": True}}}) == (
        "EQ-Bench 3 (offline proxy, not comparable with EQ-Bench 3)"
    )
    assert "not comparable with EQ-Bench 3" in eqbench3.column({"m": {"eqbench3": {"proxy": False}}})
    assert eqbench3.column({}, "path/to/eqbench3") == "EQ-Bench 3 rubric score (official protocol, no task finished)"


class Judge:
    """A judge backend (ChatBackend's chat API) answering from a list in order, the last one repeating."""

    kind, spec, failures = "api", "api:j", 0

    def __init__(self, answers):
        self.answers, self.sent = list(answers), []

    def chat(self, conversations, max_tokens=256, temperature=0.0):
        self.sent += [(c, max_tokens, temperature) for c in conversations]
        return [self.answers.pop(0) if len(self.answers) > 1 else self.answers[0] for _ in conversations]


def test_every_call_its_settings_and_the_100_character_guard(monkeypatch, tiny, P):
    model, tok = tiny
    calls = []
    long_reply = "x" * 99 + "."  # 100 characters: judged; the drafting task gets 99 (plus spaces)

    def generate(model, tok, contexts, budget, temperature, top_p, min_p, model_settings):
        assert model_settings  # an endpoint's sampling: the model's own settings beside the harness's
        calls.append((len(contexts), budget, temperature, top_p, min_p))
        texts = [
            long_reply
            if "Declining" not in tok.decode(c) and "ski trip" not in tok.decode(c)
            else "  " + "y" * 99 + "  "
            for c in contexts
        ]
        return [
            sampling.Reply(tok(f"<think>hidden</think>{x}", add_special_tokens=False)["input_ids"], True, None)
            for x in texts
        ]

    monkeypatch.setattr(eqbench3.sampling, "generate_batch", generate)
    judge = Judge(['<think>a</think>{"demonstrated_empathy": "16/20", "theory_of_mind": 8, "correctness": 10}'])
    units = eqbench3.units(P.tasks, types.SimpleNamespace(eqbench3_dir=str(FIX), iterations=1))
    args = types.SimpleNamespace(
        eqbench3_dir=str(FIX),
        eqbench3_tokens=50,
        max_context=4096,
        judge="api:j",
        eqbench3_judge_tokens=eqbench3.JUDGE_TOKENS,
    )
    cases, transcripts = eqbench3.official_cases(model, tok, units, types.SimpleNamespace(backend=judge), args)
    # turn 1 of 4 tasks, turn 2 of task 1, then 3 debriefs (not for analysis): each call's settings
    assert calls == [(4, 50, 0.7, 1.0, 0.1), (1, 50, 0.7, 1.0, 0.1), (3, 50, 0.5, 1.0, None)]
    by = {c["task"]: c for c in cases}
    assert by["201"]["failed"].startswith("no reply of 100 characters") and by["201"]["judge_prompt"] is None
    assert [m["content"] for m in by["1"]["messages"][1::2]] == [long_reply, long_reply]  # <think> cut
    assert by["1"]["debrief"] == long_reply and by["402"]["debrief"] is None and len(judge.sent) == 3
    assert [(m, t) for _, m, t in judge.sent] == [(8000, 0.0)] * 3
    assert [c[0]["content"] for c, _, _ in judge.sent] == [by[t]["judge_prompt"] for t in ("1", "8", "402")]
    assert by["1"]["judge_answer"] == '{"demonstrated_empathy": "16/20", "theory_of_mind": 8, "correctness": 10}'
    # standard: demonstrated_empathy, theory_of_mind, correctness are all allowed: (16 + 8 + 10) / 3; analysis: 9
    assert by["1"]["rubric"] == pytest.approx(34 / 3) and by["402"]["rubric"] == 9.0
    assert by["1"]["messages"][0]["content"] == eqbench3.wrap(P, task(P, "1"), TASK1_TURN1)
    assert transcripts[0]["messages"][-2:] == [
        {"role": "user", "content": P.debrief},
        {"role": "assistant", "content": long_reply},
    ]


def test_a_turn_with_no_room_left_fails_its_task(monkeypatch, tiny, P):
    model, tok = tiny
    monkeypatch.setattr(
        eqbench3.sampling, "generate_batch", lambda *a, **k: [sampling.Reply([], True, None)] * len(a[2])
    )
    args = types.SimpleNamespace(
        eqbench3_dir=str(FIX),
        eqbench3_tokens=50,
        max_context=60,
        judge="api:j",
        eqbench3_judge_tokens=eqbench3.JUDGE_TOKENS,
    )
    units = eqbench3.units([task(P, "8"), task(P, "1")], types.SimpleNamespace(eqbench3_dir=str(FIX), iterations=1))
    cases, _ = eqbench3.official_cases(model, tok, units, types.SimpleNamespace(backend=Judge(["{}"])), args)
    assert cases[1]["failed"].startswith("context limit (turn 1 does not fit --max-context 60)")
    room = 60 - len(common.render_ids(tok, [{"role": "user", "content": task(P, "8")["prompts"][0]}]))
    assert 0 < room < 50 and cases[0]["reply_budget"] == room and cases[0]["replies"] == 1  # its turn fit, shorter
    assert cases[0]["failed"] == "context limit (the debrief does not fit --max-context 60)"
    # the cell counts them among the failed, one more failed otherwise: 3 failed, 2 at the context limit
    cases.append({**cases[0], "case": "8#2", "iteration": 2, "failed": "judge answer has no score"})
    s = {"n": 0, "failed": 3, **eqbench3.summary(cases, ev.t_interval)}
    assert s["context_limit"] == 2 and eqbench3.cell(s, ev.fmt) == "-; 3 failed (2 at the context limit)"


def test_the_variants_cell_counts_the_tasks_that_reached_the_context_limit(monkeypatch, tiny):
    # without --eqbench3-dir a turn that does not fit is not played: the task is judged on the turns before it
    model, tok = tiny
    monkeypatch.setattr(
        eqbench3.sampling,
        "generate_batch",
        lambda *a, **k: [sampling.Reply(tok("ok")["input_ids"], True, None)] * len(a[2]),
    )
    tasks = [
        {"id": str(i), "kind": "roleplay", "category": "", "prompts": ["Hi.", second]}
        for i, second in enumerate(("How are you?", "word " * 300, "Thanks."))
    ]
    args = types.SimpleNamespace(max_new_tokens=8, max_context=200, temperature=1.0, top_p=1.0, judge_retries=0)
    answers = [json.dumps({c: 10 + 2 * i for c in eqbench3.ROLEPLAY_CRITERIA}) for i in range(3)]
    cases, _ = eqbench3.variant_cases(model, tok, tasks, types.SimpleNamespace(backend=Judge(answers)), args)
    assert [(c["replies"], c["context_limit"], c["failed"]) for c in cases] == [
        (2, False, None),
        (1, True, None),
        (2, False, None),
    ]
    assert [c["score"] for c in cases] == [50.0, 60.0, 70.0]  # 5 x the criterion mean; every task scored
    s = {"n": 3, "failed": 0, **eqbench3.summary(cases, ev.t_interval)}
    assert (
        s["context_limit"] == 1 and eqbench3.cell(s, ev.fmt) == ev.fmt(s["score"], 3) + "; 1 ended at the context limit"
    )
    assert ev.fmt(s["score"], 3) == f"60.00 ± {4.303 * 10 / 3**0.5:.2f} (n=3)"  # sd 10 over 3 tasks


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--eqbench3-dir", "{fix}", "--judge", "embed"], "--eqbench3-dir: EQ-Bench 3's judge is an LLM"),
        (["--eqbench3-dir", "{tmp}", "--judge", "api:j"], "data/debrief_prompt.txt there (the official layout"),
        (["--iterations", "2"], "--iterations, --eqbench3-tokens and --eqbench3-judge-tokens are the official"),
        (["--eqbench3-dir", "{bad}", "--judge", "api:j"], "rubric_scoring_prompt_analysis.txt: no {output_format}"),
    ],
)
def test_bad_eqbench3_dirs_exit_2_with_one_message(tmp_path, capsys, flags, message):
    import shutil

    shutil.copytree(FIX, tmp_path / "bad")
    (tmp_path / "bad" / "data" / "rubric_scoring_prompt_analysis.txt").write_text("{transcript} only")
    shutil.copytree(FIX, tmp_path / "partial")
    (tmp_path / "partial" / "data" / "debrief_prompt.txt").unlink()
    flags = [f.format(fix=FIX, tmp=tmp_path / "partial", bad=tmp_path / "bad") for f in flags]
    with pytest.raises(SystemExit) as e:
        common.run_main(ev.main, ["--suite", "eqbench3", *flags, "--out-dir", str(tmp_path / "runs")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and message in err and err.count("\n") == 1 and not (tmp_path / "runs").exists()


def test_eval_eqbench3_dir_end_to_end_keeps_every_step(tiny_model, tmp_path):
    answer = (
        '{"chain_of_thought_reasoning": "fine", "demonstrated_empathy": "15/20", "pragmatic_ei": 10, '
        '"warmth": 2, "depth_of_insight": 14, "theory_of_mind": 16, "correctness": 12}'
    )
    flags = [
        "--model",
        tiny_model,
        "--suite",
        "eqbench3",
        "--eqbench3-dir",
        FIX,
        "--judge",
        "api:judge",
        "--iterations",
        "2",
        "--eqbench3-tokens",
        "60",
        "--batch-size",
        "8",
        "--no-progress",
    ]
    with LoopbackServer(plan=[ok(answer)]) as server:
        p = run_script("05_eval.py", *flags, "--api-base", server.base, "--out-dir", tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    run = next(tmp_path.iterdir())
    cases = [json.loads(x) for x in (run / "cases.jsonl").read_text(encoding="utf-8").splitlines()]
    assert sorted(c["case"] for c in cases) == ["1#1", "1#2", "201#1", "201#2", "402#1", "402#2", "8#1", "8#2"]
    P = eqbench3.protocol(str(FIX))
    sent = [r["body"]["messages"][0]["content"] for r in server.requests]
    for c in cases:  # a reader rebuilds each step from the record
        t = task(P, c["task"])
        assert [m["content"] for m in c["messages"][::2]] == [eqbench3.wrap(P, t, x) for x in t["prompts"]]
        assert c["debrief_prompt"] == (None if t["kind"] == "analysis" else P.debrief)
        long_enough = any(len(m["content"].strip()) >= 100 for m in c["messages"][1::2])
        assert (c["failed"] is None) == long_enough, c["failed"]
        if long_enough:
            assert c["judge_prompt"] == eqbench3.judge_prompt(P, t, c["messages"], c["debrief"])
            assert c["judge_prompt"] in sent
            assert c["judge_answer"] == answer and c["judge_scores"] == eqbench3.read_scores(answer)
            assert c["rubric"] == (14.0 if t["kind"] == "analysis" else 13.4)  # (16+12)/2; (15+10+14+16+12)/5
    scored = [c["rubric"] for c in cases if not c["failed"]]
    assert len(sent) == len(scored) and scored, "the tiny model wrote no reply of 100 characters"
    table = (run / "results.md").read_text(encoding="utf-8")
    head = (
        "EQ-Bench 3 rubric score (official protocol, judge api:judge, 4 tasks); partial: 4 of 45 tasks; "
        "reply budget lowered to 60 tokens"
    )
    assert f"| model | {head} |" in table and head in p.stdout
    assert "pairwise Elo (the leaderboard's main number) is not computed here" in table
    failed = f"; {len(cases) - len(scored)} failed" if len(scored) < len(cases) else ""
    assert (
        f"| base | {5 * round(sum(scored) / len(scored), 2):.2f} (n={len(scored)} scored, 2 iterations){failed} |"
        in table
    )
    res = json.loads((run / "results.json").read_text(encoding="utf-8"))
    assert res["columns"][1] == head and res["summary"]["base"]["eqbench3"]["tasks"] == 4
    # a judge endpoint that never answers: the run stops (exit 2, --resume named), and what it wrote still says
    # which protocol it ran, not the variant's label
    with LoopbackServer(plan=[dict(status=500, body={"error": "down"})]) as server:
        p = run_script(
            "05_eval.py", *flags, "--api-base", server.base, "--api-retries", "1", "--out-dir", tmp_path / "down"
        )
    assert p.returncode == 2 and "--resume" in p.stderr, p.stderr[-2000:]
    table = (next((tmp_path / "down").iterdir()) / "results.md").read_text(encoding="utf-8")
    assert "EQ-Bench 3 rubric score (official protocol, no task finished)" in table
    assert "not comparable" not in table and "no task finished, so nothing is scored yet" in table

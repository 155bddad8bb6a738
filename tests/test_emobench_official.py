"""benchmarks/emobench.py's official mode (05 --emobench-dir): the prompts as sent, the parser, the exact letter
match, the report per language and category, the generation settings, and 05 end to end on the tiny model. The
checkout is tests/fixtures/emobench/: the official layout with texts written for these tests."""

import importlib
import json
import shutil
import subprocess
from pathlib import Path

import pytest

import common
import sampling
from benchmarks import emobench
from conftest import ROOT, run_script

ev = importlib.import_module("05_eval")
FIX = ROOT / "tests" / "fixtures" / "emobench"

# the fixture's texts, put together by hand as the official code does: system = sys + the layout of utils.py
# ("\n{statement}```json\n{{\n{conditions}}}\n```\n") filled with response.yaml's base and the task's keys
SYS_EN = (
    "You will read a short story and answer questions about one person in it.\n"
    "Think about how that person sees the situation.\n"
)
EU_EN_SYSTEM = (
    SYS_EN + "\nPick exactly one letter per question. Reply with JSON only:\n```json\n{\n"
    '"answer_q1": "<letter for Q1>",\n"answer_q2": "<letter for Q2>"\n}\n```\n'
)
EU_EN_1_USER = (
    "Story: Mia's cake sank in the oven, but her little brother ate a slice and asked for another.\n\n"
    "Q1. Which feeling would Mia end up with?\nA) Shame\nB) Joy\nC) Anger\n\n"
    "Q2. What makes Mia feel that way?\n"
    "A) The cake sank\nB) Her brother was hungry\nC) Her brother liked the cake anyway\n"
)
EA_ZH_SYSTEM = (
    "你将读到一个小故事，并回答关于其中一个人的问题。\n请从这个人的角度思考。\n"
    '\n每个问题只选一个字母。 只用JSON回复：\n```json\n{\n"answer": "<字母>"\n}\n```\n'
)
EA_ZH_1_USER = (
    "故事：小王第二次没通过驾照考试，下一次考试在一个月后。\n\n哪一种Action对小王最有帮助？\n"
    "A) 放弃学车\nB) 针对出错的部分多练几次\nC) 怪考官\n"
)


def items(model="SmolLM2-135M-Instruct"):
    return {it["case"]: it for kind in ("EU", "EA") for it in emobench.load_official(str(FIX), kind, model)}


def test_the_prompts_as_sent_for_known_items():
    got = items()
    assert len(got) == 8
    assert got["EU-en-1"]["messages"] == [
        {"role": "system", "content": EU_EN_SYSTEM},
        {"role": "user", "content": EU_EN_1_USER},
    ]
    # EA: the question type as the file gives it, in English inside the Chinese question (as the official code)
    assert got["EA-zh-1"]["messages"] == [
        {"role": "system", "content": EA_ZH_SYSTEM},
        {"role": "user", "content": EA_ZH_1_USER},
    ]
    # a Qwen (the last part of the model's path names it) gets "/no_think" before the system prompt
    qwen = items("models/Qwen2.5-7B-Instruct")["EU-en-1"]["messages"]
    assert qwen[0]["content"] == "/no_think\n\n" + EU_EN_SYSTEM and qwen[1]["content"] == EU_EN_1_USER
    assert items("Qwen/SmolLM-x")["EU-en-1"]["messages"][0]["content"] == EU_EN_SYSTEM
    assert got["EU-en-1"]["protocol"] == f"official protocol ({FIX}, not a git checkout)"


def test_the_rendered_prompt_is_the_chat_template_with_its_generation_prompt(tiny_model):
    tok = common.load_tokenizer(tiny_model)
    ids = emobench.official_ids(tok, items()["EU-en-1"]["messages"])
    assert tok.decode(ids) == (
        f"<|im_start|>system\n{EU_EN_SYSTEM}<|im_end|>\n"
        f"<|im_start|>user\n{EU_EN_1_USER}<|im_end|>\n<|im_start|>assistant\n"
    )


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_the_label_names_the_checkouts_commit(tmp_path):
    root = tmp_path / "EmoBench"
    shutil.copytree(FIX, root)

    def git(*argv):
        return subprocess.run(
            ["git", "-C", str(root), "-c", "user.name=t", "-c", "user.email=t@t", *argv],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()

    git("init", "-q")
    git("add", "-A")
    git("commit", "-q", "-m", "fixture")
    sha = git("rev-parse", "HEAD")
    assert emobench.protocol_label(root) == f"official protocol ({root} at commit {sha})"
    (root / "src" / "configs" / "prompts.yaml").write_text("sys: {}\n", encoding="utf-8")
    assert emobench.protocol_label(root) == f"official protocol ({root} at commit {sha} with local changes)"


def test_the_parser():
    assert emobench.parse_answer('{"answer": "B"}') == {"answer": "B"}
    assert emobench.parse_answer('  {"answer_q1": "A", "answer_q2": "C"}\n') == {"answer_q1": "A", "answer_q2": "C"}
    # a fenced block is found inside prose; the first one counts
    assert emobench.parse_answer('Sure.\n```json\n{"answer": "C"}\n```\nHope it helps.') == {"answer": "C"}
    assert emobench.parse_answer('```json {"answer": "A"} ``` and ```json {"answer": "B"} ```') == {"answer": "A"}
    for bad in (
        '```json\n{"answer": "A"}',  # the fence never closes (cut off at 50 tokens)
        '{"answer": "A"} because ...',  # not a fence: the whole reply must be JSON
        "A",
        '"A"',
        "[1, 2]",
        "",
        '```\n{"answer": "A"}\n```',
    ):
        assert emobench.parse_answer(bad) is None, bad


def test_exact_letter_match_both_for_eu_and_unparseable_counted_wrong():
    it = items()
    eu, ea = it["EU-en-1"], it["EA-en-1"]  # gold: EU B (Joy) and C (the cause), EA B
    replies = {
        '{"answer_q1": "B", "answer_q2": "C"}': (1, 1, 1),
        '{"answer_q1": "B", "answer_q2": "A"}': (1, 0, 0),  # the emotion alone is not enough
        '{"answer_q1": "A", "answer_q2": "C"}': (0, 1, 0),
        '{"answer_q1": "b", "answer_q2": "c"}': (0, 0, 0),  # exact: lower case is wrong
        '{"answer_q1": "B) Joy", "answer_q2": "C"}': (0, 1, 0),
        '{"answer_q2": "C"}': (0, 1, 0),  # a missing answer is ""
        "B and C": (0, 0, 0),
    }
    got = emobench.official_cases([eu] * len(replies), list(replies))
    assert [(c["emotion_correct"], c["cause_correct"], c["correct"]) for c in got] == list(replies.values())
    assert [c["parsed"] for c in got] == [True] * 6 + [False]
    assert got[0]["label"] == ["B", "C"] and got[-1]["answer"] == ["", ""] and got[0]["category"] == "complex_emotions"
    ea_got = emobench.official_cases([ea] * 4, ['{"answer": "B"}', '{"answer": "B "}', '{"answer": 2}', "B"])
    assert [c["correct"] for c in ea_got] == [1, 0, 0, 0] and [c["parsed"] for c in ea_got] == [True] * 3 + [False]
    assert ea_got[0]["label"] == "B" and ea_got[0]["category"] == "Personal-Self"


def fixture_cases():
    """The fixture's 8 items answered: EU-en-1 right, EU-en-2 the cause wrong, EU-zh-1 unparseable, EU-zh-2
    right; EA-en-1 right, EA-en-2 wrong, EA-zh-1 and EA-zh-2 right."""
    it = items()
    replies = {
        "EU-en-1": '{"answer_q1": "B", "answer_q2": "C"}',
        "EU-en-2": '{"answer_q1": "A", "answer_q2": "A"}',
        "EU-zh-1": "开心",
        "EU-zh-2": '```json\n{"answer_q1": "A", "answer_q2": "B"}\n```',
        "EA-en-1": '{"answer": "B"}',
        "EA-en-2": '{"answer": "B"}',
        "EA-zh-1": '{"answer": "B"}',
        "EA-zh-2": '{"answer": "A"}',
    }
    return emobench.official_cases([it[c] for c in replies], list(replies.values()))


def test_the_report_per_language_and_category(tmp_path):
    s = ev.summarize(fixture_cases(), "emobench")
    assert s["n"] == 8 and s["protocol"] == f"official protocol ({FIX}, not a git checkout)"
    assert s["EU en"]["accuracy"][0] == 50.0 and s["EU en"]["n"] == 2 and s["EU en"]["unparseable"] == 0
    assert s["EU en"]["by_category"] == {"complex_emotions": 100.0, "emotional_cues": 0.0}
    assert s["EU zh"]["accuracy"][0] == 50.0 and s["EU zh"]["unparseable"] == 1
    assert s["EU zh"]["by_category"] == {"complex_emotions": 0.0, "perspective_taking": 100.0}
    assert s["EA en"]["accuracy"][0] == 50.0 and s["EA zh"]["accuracy"][0] == 100.0
    assert s["EA zh"]["accuracy"][1] == 0.0  # two right of two: no spread
    assert s["EA en"]["by_category"] == {"Personal-Self": 100.0, "Social-Others": 0.0}
    table = ev.results_table({"base": {"emobench": s}}, ["emobench"])
    head, _, row = table.splitlines()[:3]
    assert head == "| model | EmoBench EU en % | EmoBench EU zh % | EmoBench EA en % | EmoBench EA zh % |"
    assert "| base | 50.00 ± " in row and "(n=2); 1 unparseable (counted wrong) | " in row
    assert row.endswith("| 100.00 ± 0.00 (n=2) |")
    assert table.splitlines()[-1] == f"EmoBench: official protocol ({FIX}, not a git checkout)"
    assert emobench.report_lines("base", s)[1] == (
        "base, EmoBench EU zh accuracy % by category: complex_emotions 0.0, "
        "perspective_taking 100.0; 1 of 2 replies unparseable"
    )


def test_run_generates_at_the_official_temperature_and_budget(tiny_model, monkeypatch):
    tok = common.load_tokenizer(tiny_model)
    batch = list(items().values())
    asked = {}

    def fake_generate(model, tokenizer, contexts, max_new_tokens, temperature=0.0, top_p=1.0, model_settings=False):
        asked.update(contexts=contexts, settings=(max_new_tokens, temperature, top_p, model_settings))
        texts = ['{"answer_q1": "B", "answer_q2": "C"}'] + ["no idea"] * (len(contexts) - 1)
        return [
            sampling.Reply(tok(t, add_special_tokens=False)["input_ids"] + [tok.eos_token_id], True, None)
            for t in texts
        ]

    monkeypatch.setattr(sampling, "generate_batch", fake_generate)
    cases, transcripts = emobench.run(None, tok, batch, batch_size=3)
    assert asked["settings"] == (50, 0.6, 1.0, True)  # the official HF path: the model's own generation_config
    assert asked["contexts"] == [emobench.official_ids(tok, it["messages"]) for it in batch]
    assert [c["correct"] for c in cases] == [1] + [0] * 7 and sum(not c["parsed"] for c in cases) == 7
    assert transcripts[0] == {
        "case": "EU-en-1",
        "messages": batch[0]["messages"],
        "reply": '{"answer_q1": "B", "answer_q2": "C"}',
    }


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--emobench-dir", "/no/such/EmoBench"], "--emobench-dir /no/such/EmoBench: no src/configs there"),
        (
            ["--emobench-dir", str(FIX), "--emobench-eu", "x.jsonl"],
            "--emobench-eu / --emobench-ea are the log-likelihood",
        ),
    ],
)
def test_bad_emobench_flags_exit_2(tmp_path, capsys, flags, message):
    with pytest.raises(SystemExit) as e:
        common.run_main(ev.main, ["--suite", "emobench", *flags, "--out-dir", str(tmp_path / "runs")])
    assert e.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


def test_05_runs_the_official_protocol_on_the_tiny_model(tiny_model, tmp_path):
    p = run_script(
        "05_eval.py",
        "--model",
        tiny_model,
        "--suite",
        "emobench",
        "--emobench-dir",
        FIX,
        "--batch-size",
        "3",
        "--no-progress",
        "--out-dir",
        tmp_path,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    run = next(Path(tmp_path).iterdir())
    label = f"EmoBench: official protocol ({FIX}, not a git checkout)"
    assert label in p.stdout and label in (run / "results.md").read_text(encoding="utf-8")
    recs = [json.loads(x) for x in (run / "cases.jsonl").read_text(encoding="utf-8").splitlines()]
    assert sorted(r["case"] for r in recs) == sorted(items())
    # the random tiny model writes no JSON: every reply unparseable, every item wrong, each counted
    assert all(not r["parsed"] and r["correct"] == 0 for r in recs)
    res = json.loads((run / "results.json").read_text(encoding="utf-8"))
    s = res["summary"]["base"]["emobench"]
    assert res["columns"][1:] == ["EmoBench EU en %", "EmoBench EU zh %", "EmoBench EA en %", "EmoBench EA zh %"]
    for g in ("EU en", "EU zh", "EA en", "EA zh"):
        assert (s[g]["n"], s[g]["unparseable"], s[g]["accuracy"][0]) == (2, 2, 0.0), g
    sent = [json.loads(x) for x in (run / "transcripts.jsonl").read_text(encoding="utf-8").splitlines()]
    assert {t["case"]: t["messages"] for t in sent}["EU-en-1"][1]["content"] == EU_EN_1_USER

"""scripts/view_run.py: the HTML page of a run's dialogues, on a hand-built rollouts.jsonl and on a real 04 run."""

import json
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

from conftest import run_script, write_jsonl

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "view_run.py"
VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "track", "wbr"}
EVIL = "I tried <script>alert(1)</script> & \"quotes\" & 'apostrophes'\nand a second line"


def view(*args):
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True, timeout=60)


def turn(t, user, reply, v, state, distance, reward, emotion, advantage, cut_off=False, **extra):
    return {
        "t": t,
        "user": user,
        "assistant": reply,
        "v": v,
        "levels": None if v is None else {"C": [1, 0]},
        "state": state,
        "distance": distance,
        "dE": 0.5,
        "reward": reward,
        "cut_off": cut_off,
        "judge_failed": v is None,
        "emotion": emotion,
        "reply_tokens": 12,
        "judge_features": {"kind": "ok"},
        "advantage": advantage,
        "reward_parts": {"idr": None if v is None else reward},
        **extra,
    }


def rubric(c, a, p):
    return {
        "weights": {"cognitive": c, "affective": a, "proactive": p},
        "criteria": {"cognitive": ["names the worry"], "affective": ["validates"], "proactive": ["asks"]},
    }


def dialogue(step, sid, k, turns):
    return {
        "scenario_id": sid,
        "k": k,
        "p0": [-3.0, -2.0, -1.0],
        "outcome": "timeout",
        "turns": turns,
        "final_distance": turns[-1]["distance"],
        "initial_distance": 3.7417,
        "E_total": 1.0,
        "final_emotion": turns[-1]["emotion"],
        "return": round(sum(t["reward"] for t in turns), 4),
        "step": step,
    }


def records():
    """2 steps x 2 dialogues: a judge-failed turn, a cut-off turn, rubrics, and the estimator's terms A_turn and
    A_group on some turns."""
    return [
        dialogue(
            1,
            "s-a",
            0,
            [
                turn(
                    1,
                    f"s-a k0 t1: {EVIL}",
                    'reply <b>one</b> & "so"\nline two',
                    [1.0, 0.0, 0.0],
                    [-2.0, -2.0, -1.0],
                    3.0,
                    0.7417,
                    35.0,
                    0.8123,
                    rubric=rubric(0.5, 0.3, 0.2),
                    terms={"A_turn": 1.2345, "A_group": 0.5432},
                ),
                turn(
                    2,
                    "s-a k0 t2: and then?",
                    "a reply that ran out of tokens",
                    [0.0, 1.0, 0.0],
                    [-2.0, -1.0, -1.0],
                    2.4495,
                    0.5505,
                    45.0,
                    -0.3219,
                    cut_off=True,
                    rubric=rubric(0.2, 0.6, 0.2),
                ),
            ],
        ),
        dialogue(
            1,
            "s-a",
            1,
            [turn(1, f"s-a k1 t1: {EVIL}", "k1's reply", None, [-3.0, -2.0, -1.0], 3.7417, 0.1111, 30.0, -0.25)],
        ),
        dialogue(
            2,
            "s-b",
            0,
            [
                turn(
                    1,
                    "s-b k0 t1: a plain message",
                    "a plain reply",
                    [1.0, 1.0, 1.0],
                    [-2.0, -1.0, 0.0],
                    2.2361,
                    1.5056,
                    72.5,
                    0.9876,
                    rubric=rubric(0.1, 0.1, 0.8),
                    terms={"A_turn": -0.75, "A_group": 0.125},
                )
            ],
        ),
        dialogue(
            2,
            "s-b",
            1,
            [
                turn(
                    1,
                    's-b k1 t1: "quoted" & <i>tagged</i>',
                    "another reply",
                    [0.0, 0.0, 0.0],
                    [-3.0, -2.0, -1.0],
                    3.7417,
                    -0.5,
                    20.0,
                    -0.9876,
                )
            ],
        ),
    ]


class Page(HTMLParser):
    """The page's text per turn (keyed by step, scenario, k, t), its tags, its <select> options."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.stack, self.text, self.turns, self.options = [], [], {}, []
        self.dialogue, self.turn, self.svgs, self.tags = None, None, 0, []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        self.tags.append((tag, a))
        self.svgs += tag == "svg"
        if "data-scenario" in a:
            self.dialogue = (a["data-step"], a["data-scenario"], a["data-k"])
        if tag == "li" and "data-t" in a:
            self.turn = (*self.dialogue, a["data-t"])
            self.turns[self.turn] = []
        if tag == "option":
            self.options.append(a["value"])
        if tag not in VOID:
            self.stack.append((tag, self.turn if tag == "li" and "data-t" in a else None))

    def handle_startendtag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))

    def handle_endtag(self, tag):
        opened, key = self.stack.pop()
        assert opened == tag, f"</{tag}> closes <{opened}>"
        if key is not None:
            self.turn = None

    def handle_data(self, data):
        self.text.append(data)
        if self.turn is not None:
            self.turns[self.turn].append(data)


def parse(path):
    page = Page()
    page.feed(Path(path).read_text(encoding="utf-8"))
    page.close()
    assert page.stack == [], page.stack
    return page


def fmt(x):
    return f"{x:.3f}"


def test_the_page_shows_every_turn_escaped_marked_and_numbered(tmp_path):
    run = tmp_path / "mica-test"
    run.mkdir()
    recs = records()
    write_jsonl(run / "rollouts.jsonl", recs)
    p = view(run)
    assert p.returncode == 0, p.stderr
    out = run / "rollouts.html"
    assert p.stdout.strip() == str(out) and p.stderr == ""
    assert sorted(x.name for x in run.iterdir()) == ["rollouts.html", "rollouts.jsonl"]  # no temporary file left
    source = out.read_text(encoding="utf-8")
    assert "<script>alert" not in source and "<b>one</b>" not in source
    assert "http://" not in source.replace('xmlns="http://www.w3.org/2000/svg"', "") and "https://" not in source
    page = parse(out)
    text = "".join(page.text)
    assert "mica-test" in text and "2 steps, 4 dialogues" in text
    for step in (1, 2):  # the header: per step the mean return and the share of cut-off turns
        rs = [r for r in recs if r["step"] == step]
        turns = [t for r in rs for t in r["turns"]]
        assert fmt(sum(r["return"] for r in rs) / len(rs)) in text
        assert fmt(sum(t["cut_off"] for t in turns) / len(turns)) in text
    assert page.options == ["step-1", "step-2"]
    assert ("option", {"value": "step-2", "selected": None}) in page.tags  # the last step is shown first
    assert [a for tag, a in page.tags if tag == "section" and "data-step" in a] == [
        {"class": "step", "id": "step-1", "data-step": "step-1", "hidden": None},
        {"class": "step", "id": "step-2", "data-step": "step-2"},
    ]
    assert page.svgs >= len(recs) + 2  # per dialogue its charts, and the rubric section's two
    assert len(page.turns) == sum(len(r["turns"]) for r in recs)
    for r in recs:
        for t in r["turns"]:
            got = "".join(page.turns[(f"step-{r['step']}", r["scenario_id"], str(r["k"]), str(t["t"]))])
            assert t["user"] in got and t["assistant"] in got
            for key in ("distance", "reward", "advantage", "emotion"):
                assert fmt(t[key]) in got, (key, t[key], got)
            terms = t.get("terms", {})
            for key in ("A_turn", "A_group"):  # the estimator's terms, on some turns only
                assert (f"{key} " in got) == (key in terms) and (key not in terms or f"{key} {fmt(terms[key])}" in got)
            for x in t["state"]:
                assert fmt(x) in got
            assert ("cut off" in got) == t["cut_off"]
            assert ("judge failed" in got) == t["judge_failed"]
            if "rubric" in t:
                assert "rubric w (C, A, P) (" + ", ".join(fmt(w) for w in t["rubric"]["weights"].values()) in got
    # the rubric section: the mean weights by turn and by the emotion band before the reply
    # (turn 1: --emotion-start, 30 without args.json -> C; s-a turn 2: 35 -> C; s-b turn 1: C)
    assert "Mean rubric weights by turn" in text and "Mean rubric weights by the user's emotion band" in text
    assert all(fmt(x) in text for x in ((0.5 + 0.1) / 2, (0.3 + 0.1) / 2, (0.2 + 0.8) / 2))  # turn 1
    assert all(fmt(x) in text for x in ((0.5 + 0.2 + 0.1) / 3, (0.3 + 0.6 + 0.1) / 3, (0.2 + 0.2 + 0.8) / 3))
    # args.json's --emotion-start moves turn 1 into band B
    (run / "args.json").write_text(json.dumps({"emotion_start": 50.0}))
    assert view(run).returncode == 0
    assert "B (40 &lt;= e &lt; 70)" in out.read_text(encoding="utf-8")


def test_a_run_without_steps_is_one_step_and_out_writes_elsewhere(tmp_path):
    run = tmp_path / "rollout-run"
    run.mkdir()
    recs = [{k: v for k, v in r.items() if k != "step"} for r in records()]
    write_jsonl(run / "rollouts.jsonl", recs)
    p = view(run, "--out", tmp_path / "page.html")
    assert p.returncode == 0, p.stderr
    page = parse(tmp_path / "page.html")
    assert page.options == ["step-none"] and "1 step, 4 dialogues" in "".join(page.text)
    assert not (run / "rollouts.html").exists()


def test_a_step_written_again_by_a_resumed_run_is_shown_as_last_written(tmp_path):
    a1, b1, a2, b2 = records()
    again = [json.loads(json.dumps(r).replace("s-b k", "rerun s-b k")) for r in (a2, b2)]
    write_jsonl(tmp_path / "rollouts.jsonl", [a1, b1, a2, b2] + again + [a1, b1])  # after step 2: step 1 again
    assert view(tmp_path).returncode == 0
    page = parse(tmp_path / "rollouts.html")
    text = "".join(page.text)
    assert "2 steps, 4 dialogues" in text and "4 dialogues of re-run steps left out" in text
    assert text.count("s-b k0 t1: a plain") == text.count("rerun s-b k0 t1: a plain") == 1
    assert sorted(k for k in page.turns if k[0] == "step-2") == [
        ("step-2", "s-b", "0", "1"),
        ("step-2", "s-b", "1", "1"),
    ]


def test_a_missing_folder_a_missing_file_and_a_bad_line_exit_2_with_one_line(tmp_path):
    p = view(tmp_path / "nope")
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and p.stderr.startswith("error: ")
    assert str(tmp_path / "nope") in p.stderr and "Traceback" not in p.stderr
    p = view(tmp_path)
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and "rollouts.jsonl: no such file" in p.stderr
    good = json.dumps(records()[0])
    (tmp_path / "rollouts.jsonl").write_text(good + "\n" + good + "\n" + good[:40] + "\n", encoding="utf-8")
    p = view(tmp_path)
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and "Traceback" not in p.stderr
    assert f"error: {tmp_path / 'rollouts.jsonl'}:3: not JSON" in p.stderr
    assert list(tmp_path.glob("*.html")) == [] and list(tmp_path.glob(".*")) == []


def test_on_a_real_training_run(tiny_model, tmp_path):
    p = run_script(
        "04_mica_train.py",
        "--model",
        tiny_model,
        "--steps",
        "1",
        "--scenarios-per-step",
        "2",
        "--k",
        "2",
        "--max-turns",
        "2",
        "--max-new-tokens",
        "6",
        "--no-progress",
        "--out-dir",
        tmp_path,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    (run,) = [x for x in tmp_path.iterdir() if x.is_dir()]
    recs = [json.loads(line) for line in (run / "rollouts.jsonl").read_text(encoding="utf-8").splitlines()]
    q = view(run)
    assert q.returncode == 0, q.stderr
    page = parse(run / "rollouts.html")
    dialogues = [(a["data-step"], a["data-scenario"], a["data-k"]) for tag, a in page.tags if "data-scenario" in a]
    assert sorted(dialogues) == sorted((f"step-{r['step']}", r["scenario_id"], str(r["k"])) for r in recs)
    assert len(page.turns) == sum(len(r["turns"]) for r in recs) and page.svgs >= len(recs)
    for r in recs:
        for t in r["turns"]:
            got = "".join(page.turns[(f"step-{r['step']}", r["scenario_id"], str(r["k"]), str(t["t"]))])
            assert t["user"] in got and fmt(t["reward"]) in got and fmt(t["advantage"]) in got


def test_an_eval_run_shows_its_empa_dialogues_a_section_per_model_with_naturalness(tmp_path):
    """05's run folder has transcripts.jsonl, not rollouts.jsonl: its EMPA dialogues, one section per model
    (its other suites left out), each reply's naturalness among its numbers."""
    base = dialogue(
        None,
        "s-a",
        0,
        [
            turn(
                1, "hello", "base reply", [1.0, 0.0, 0.0], [-2.0, -2.0, -1.0], 3.0, 0.74, 35.0, 0.0, naturalness=-2.3456
            )
        ],
    )
    adapted = dialogue(
        None,
        "s-a",
        0,
        [
            turn(
                1,
                "hello",
                "adapter reply",
                [0.0, 0.0, 0.0],
                [-3.0, -2.0, -1.0],
                3.7417,
                0.0,
                30.0,
                0.0,
                naturalness=-5.4321,
            )
        ],
    )
    other = dialogue(None, "p1", 0, [turn(1, "x", "sage reply", None, [0, 0, 0], 1.0, 0.0, 40.0, 0.0)])
    rows = [
        {"model": "base", "suite": "empa", "case": "s-a#0", **base},
        {"model": "runs/mica-1/adapter", "suite": "empa", "case": "s-a#0", **adapted},
        {"model": "base", "suite": "sage", "case": "p1", **other},
    ]
    for r in rows:
        r.pop("step")
    write_jsonl(tmp_path / "transcripts.jsonl", rows)
    p = view(tmp_path)
    assert p.returncode == 0, p.stderr
    page = (tmp_path / "rollouts.html").read_text(encoding="utf-8")
    assert "Model base" in page and "Model runs/mica-1/adapter" in page and "/transcripts.jsonl" in page
    assert "<b>naturalness</b> -2.346" in page and "<b>naturalness</b> -5.432" in page
    assert "base reply" in page and "adapter reply" in page and "sage reply" not in page

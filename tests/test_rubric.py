"""CARE's rubric: the one parser, the generator's SFT (01) and teacher labelling, as a user runs them."""
import importlib
import json
from pathlib import Path

import pytest

from conftest import run_script, write_jsonl

sft = importlib.import_module("01_rubric_sft")
GOOD = {"weights": {"cognitive": 0.3, "affective": 0.5, "proactive": 0.2},
        "criteria": {"cognitive": ["Names the missed deadline"], "affective": ["Validates the shame", "Warm"],
                     "proactive": ["Suggests one email to the manager"]}}


def lines(path):
    return [json.loads(x) for x in Path(path).read_text().splitlines()]


@pytest.mark.parametrize("text", [
    json.dumps(GOOD),
    "Here is the rubric:\n```json\n" + json.dumps(GOOD, indent=2) + "\n```\nHope it helps {not json}.",
    "Sure! " + json.dumps(GOOD) + " That's all.",
    json.dumps({**GOOD, "weights": {"cognitive": 3, "affective": 5, "proactive": 2}}).replace("3,", "0.301,")
    .replace("5,", "0.5,").replace("2}", "0.2}"),          # sums to 1.001: within tolerance, renormalised
])
def test_parse_rubric_accepts_valid_fenced_and_wrapped(text):
    rubric, why = sft.parse_rubric(text)
    assert why is None and rubric["criteria"]["affective"] == ["Validates the shame", "Warm"]
    assert abs(sum(rubric["weights"].values()) - 1) < 1e-12
    assert sft.dominant(rubric) == "affective"


@pytest.mark.parametrize("x, reason", [
    ("no rubric here", "no JSON object found"),
    (json.dumps(GOOD)[:60], "unbalanced or truncated JSON"),
    ("{'weights': 1}", "bad JSON"),
    ([1, 2], "rubric must be a JSON object, got list"),
    ({"criteria": GOOD["criteria"]}, "missing 'weights' object"),
    ({"weights": GOOD["weights"]}, "missing 'criteria' object"),
    ({**GOOD, "weights": {"cognitive": 0.5, "affective": 0.5}}, "weights: missing dimension 'proactive'"),
    ({**GOOD, "weights": {"cognitive": -0.2, "affective": 0.7, "proactive": 0.5}}, "weights.cognitive is negative"),
    ({**GOOD, "weights": {"cognitive": "0.3", "affective": 0.5, "proactive": 0.2}}, "weights.cognitive must be a number"),
    ({**GOOD, "weights": {"cognitive": 0.5, "affective": 0.5, "proactive": 0.5}}, "weights sum to 1.500, not 1"),
    ({**GOOD, "weights": {**GOOD["weights"], "humour": 0.0}}, "weights: unknown dimension 'humour'"),
    ({**GOOD, "criteria": {**GOOD["criteria"], "proactive": []}}, "criteria.proactive must be a list of 1-4"),
    ({**GOOD, "criteria": {**GOOD["criteria"], "proactive": ["a"] * 5}}, "criteria.proactive must be a list of 1-4"),
    ({**GOOD, "criteria": {**GOOD["criteria"], "cognitive": ["ok", 3]}}, "criteria.cognitive must hold non-empty"),
])
def test_parse_rubric_names_the_reason(x, reason):
    rubric, why = sft.parse_rubric(x)
    assert rubric is None and why.startswith(reason), why


def test_encode_masks_the_prompt_and_ends_with_the_turn_end(tiny_model):
    import common

    tok = common.load_tokenizer(tiny_model)
    rec = {"messages": [{"role": "user", "content": "I missed the deadline and I feel awful."}], "rubric": GOOD}
    ex = sft.encode(tok, rec, max_len=4096)
    n_prompt = len(ex["prompt_ids"])
    assert ex["labels"][:n_prompt] == [-100] * n_prompt and ex["ids"][:n_prompt] == ex["prompt_ids"]
    target = tok.decode(ex["ids"][n_prompt:])
    assert target.startswith(sft.rubric_text(GOOD)) and "<|im_end|>" in target
    assert sft.parse_rubric(target)[0]["weights"] == pytest.approx(GOOD["weights"])
    n_target = len(ex["ids"]) - n_prompt
    cap = 2 * n_target + 2
    short = sft.encode(tok, rec, max_len=cap)              # the prompt loses its start, the target stays
    assert len(short["ids"]) == cap and short["labels"][-n_target:] == ex["labels"][-n_target:]
    with pytest.raises(common.UserError, match="more than half of --max-len"):
        sft.encode(tok, rec, max_len=n_target)


def test_length_grouped_batches_cover_everything_once():
    import random

    lengths = [5, 50, 7, 48, 6, 49, 8, 51, 47, 46]
    batches = sft.length_grouped_batches(lengths, 2, random.Random(0))
    assert sorted(i for b in batches for i in b) == list(range(10))
    pad = sum(max(lengths[i] for i in b) * len(b) - sum(lengths[i] for i in b) for b in batches)
    assert pad == 5                                         # neighbours by length: 1 token per batch


def test_sft_script_trains_evaluates_and_saves(tiny_model, tmp_path):
    p = run_script("01_rubric_sft.py", "--model", tiny_model, "--steps", "3", "--batch-size", "4",
                   "--micro-batch-size", "2", "--eval-every", "2", "--eval-limit", "3", "--max-new-tokens", "12",
                   "--lr", "5e-3", "--out-dir", tmp_path, "--no-progress")
    assert p.returncode == 0, p.stderr[-3000:]
    run = next(Path(tmp_path).iterdir())
    m = lines(run / "metrics.jsonl")
    evals = [x for x in m if "eval_parse_valid" in x]
    assert [x["step"] for x in evals] == [0, 2, 3]
    assert all(0 <= x["eval_parse_valid"] <= 1 and 0 <= x["eval_dominant_acc"] <= 1 for x in evals)
    losses = [x["loss"] for x in m if "loss" in x]
    assert len(losses) == 3 and all(x > 0 for x in losses) and losses[-1] < losses[0]
    assert len(lines(run / "eval_samples.jsonl")) == 3 * 3
    assert (run / "adapter" / "adapter_config.json").exists()


def test_teacher_labels_dialogues_and_drops_invalid(tmp_path, fault_server):
    server = fault_server(rate=0.0, user_answer="```json\n" + json.dumps(GOOD) + "\n```")
    dialogs = write_jsonl(tmp_path / "d.jsonl", [
        {"id": "a", "messages": [{"role": "user", "content": "My boss yelled at me."},
                                 {"role": "assistant", "content": "That sounds upsetting."},
                                 {"role": "user", "content": "What should I do tomorrow?"}]},
        {"id": "b", "dialog": [{"speaker": "seeker", "content": "I feel lost."},
                               {"speaker": "seeker", "content": "Since the move."},
                               {"speaker": "supporter", "content": "Moving is hard."}]}])
    out = tmp_path / "sup.jsonl"
    p = run_script("01_rubric_sft.py", "--teacher", "api:teacher", "--label", dialogs, "--label-out", out,
                   "--api-base", server.base, "--api-backoff", "0.01")
    assert p.returncode == 0, p.stderr[-3000:]
    recs = lines(out)
    assert [r["id"] for r in recs] == ["a-t1", "a-t2", "b-t1"]
    assert recs[2]["messages"] == [{"role": "user", "content": "I feel lost. Since the move."}]
    assert all(r["messages"][-1]["role"] == "user" and r["rubric"]["weights"]["affective"] == 0.5 for r in recs)
    assert "labelled 3/3 turns" in p.stdout
    # a teacher that never writes a valid rubric: everything dropped, with the count, nothing invalid written
    bad = fault_server(rate=0.0, user_answer='{"weights": {"cognitive": 1}}')
    out2 = tmp_path / "sup2.jsonl"
    p = run_script("01_rubric_sft.py", "--teacher", "api:teacher", "--label", dialogs, "--label-out", out2,
                   "--api-base", bad.base, "--teacher-retries", "1")
    assert p.returncode == 0 and "labelled 0/3 turns" in p.stdout and "dropped 3" in p.stdout
    assert bad.requests == 3 * 2 and (not out2.exists() or out2.read_text() == "")


@pytest.mark.parametrize("record, message", [
    ({"messages": [{"role": "user", "content": "hi"}], "rubric": {**GOOD, "weights": {"cognitive": 1}}},
     "d.jsonl:1: field 'rubric': weights: missing dimension 'affective'"),
    ({"messages": [{"role": "assistant", "content": "hi"}], "rubric": GOOD}, "d.jsonl:1: messages must end with a user"),
    ({"messages": [{"role": "user", "content": "  "}], "rubric": GOOD}, "d.jsonl:1: empty dialogue"),
    ({"messages": "hi", "rubric": GOOD}, "d.jsonl:1: field 'messages' must be list"),
])
def test_bad_supervision_exits_2(tmp_path, record, message):
    data = write_jsonl(tmp_path / "d.jsonl", [record])
    p = run_script("01_rubric_sft.py", "--train", data, "--out-dir", tmp_path / "runs")
    assert p.returncode == 2 and message in p.stderr and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert not (tmp_path / "runs").exists()

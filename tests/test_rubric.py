"""CARE's rubric: the one parser, the generator's SFT (01) and teacher labelling (scripts/label_rubrics.py),
as a user runs them."""

import importlib
import json
from pathlib import Path

import pytest

from conftest import run_script, write_jsonl

sft = importlib.import_module("01_rubric_sft")
GOOD = {
    "weights": {"cognitive": 0.3, "affective": 0.5, "proactive": 0.2},
    "criteria": {
        "cognitive": ["Names the missed deadline"],
        "affective": ["Validates the shame", "Warm"],
        "proactive": ["Suggests one email to the manager"],
    },
}


def lines(path):
    return [json.loads(x) for x in Path(path).read_text().splitlines()]


@pytest.mark.parametrize(
    "text",
    [
        json.dumps(GOOD),
        "Here is the rubric:\n```json\n" + json.dumps(GOOD, indent=2) + "\n```\nHope it helps {not json}.",
        "Sure! " + json.dumps(GOOD) + " That's all.",
        json.dumps({**GOOD, "weights": {"cognitive": 3, "affective": 5, "proactive": 2}})
        .replace("3,", "0.301,")
        .replace("5,", "0.5,")
        .replace("2}", "0.2}"),  # sums to 1.001: within tolerance, renormalised
    ],
)
def test_parse_rubric_accepts_valid_fenced_and_wrapped(text):
    rubric, why = sft.parse_rubric(text)
    assert why is None and rubric["criteria"]["affective"] == ["Validates the shame", "Warm"]
    assert abs(sum(rubric["weights"].values()) - 1) < 1e-12
    assert sft.dominant(rubric) == "affective"


def test_generate_rubrics_greedy_decodes_each_distinct_prompt_once(tiny_model, monkeypatch):
    """Greedy: repeated contexts get the rubric of their first copy, decoded once; sampled: every row."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(tiny_model)
    a = [{"role": "user", "content": "I failed the exam again."}]
    b = [{"role": "user", "content": "My sister stopped calling me and I do not know why."}]
    rows = []
    real = sft.sampling.generate_batch
    monkeypatch.setattr(
        sft.sampling, "generate_batch", lambda m, t, prompts, *a: rows.append(len(prompts)) or real(m, t, prompts, *a)
    )
    out = sft.generate_rubrics(model, tok, [a, b, a, a], 8, 0.0, batch_size=8)
    assert rows == [2] and out[0] == out[2] == out[3] and out[0][1] != out[1][1]
    alone = sft.generate_rubrics(model, tok, [a, b], 8, 0.0, batch_size=8)
    assert [o[2] for o in alone] == [out[0][2], out[1][2]]  # the same tokens as decoded in a batch
    rows.clear()
    sampled = sft.generate_rubrics(model, tok, [a, b, a, a], 8, 1.0, batch_size=8)
    assert rows == [4] and all(len(o[2]) > 0 for o in sampled)


@pytest.mark.parametrize(
    "x, reason",
    [
        ("no rubric here", "no JSON object found"),
        (json.dumps(GOOD)[:60], "unbalanced or truncated JSON"),
        (json.dumps(GOOD)[:-1], "unbalanced or truncated JSON"),  # not "missing 'weights'" (inner object)
        ("{'weights': 1}", "bad JSON"),
        ([1, 2], "rubric must be a JSON object, got list"),
        ({"criteria": GOOD["criteria"]}, "missing 'weights' object"),
        ({"weights": GOOD["weights"]}, "missing 'criteria' object"),
        ({**GOOD, "weights": {"cognitive": 0.5, "affective": 0.5}}, "weights: missing dimension 'proactive'"),
        ({**GOOD, "weights": {"cognitive": -0.2, "affective": 0.7, "proactive": 0.5}}, "weights.cognitive is negative"),
        (
            {**GOOD, "weights": {"cognitive": "0.3", "affective": 0.5, "proactive": 0.2}},
            "weights.cognitive must be a number",
        ),
        ({**GOOD, "weights": {"cognitive": 0.5, "affective": 0.5, "proactive": 0.5}}, "weights sum to 1.500, not 1"),
        ({**GOOD, "weights": {**GOOD["weights"], "humour": 0.0}}, "weights: unknown dimension 'humour'"),
        ({**GOOD, "criteria": {**GOOD["criteria"], "proactive": []}}, "criteria.proactive must be a list of 1-4"),
        (
            {**GOOD, "criteria": {**GOOD["criteria"], "proactive": ["a"] * 5}},
            "criteria.proactive must be a list of 1-4",
        ),
        ({**GOOD, "criteria": {**GOOD["criteria"], "cognitive": ["ok", 3]}}, "criteria.cognitive must hold non-empty"),
    ],
)
def test_parse_rubric_names_the_reason(x, reason):
    rubric, why = sft.parse_rubric(x)
    assert rubric is None and why.startswith(reason), why


def test_encode_masks_the_prompt_and_ends_with_the_turn_end(tiny_model, capsys):
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
    short = sft.encode(tok, rec, max_len=cap)  # the prompt loses its start, the target stays
    assert len(short["ids"]) == cap and short["labels"][-n_target:] == ex["labels"][-n_target:]
    assert f"the prompt of {n_prompt} tokens is cut to its last {cap - n_target}" in capsys.readouterr().err
    with pytest.raises(common.UserError, match="more than half of --max-len"):
        sft.encode(tok, rec, max_len=n_target)


def test_sft_loss_runs_the_head_on_the_rubric_end_only_and_matches_the_full_loss(tiny_model):
    """sft_loss keeps the last k logits only; loss and gradient equal cross-entropy over all B x L logits."""
    import torch
    from transformers import AutoModelForCausalLM

    import common

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    tok = common.load_tokenizer(tiny_model)
    long_ctx = [
        {"role": "user", "content": "I missed the deadline."},
        {"role": "assistant", "content": "Ouch."},
        {"role": "user", "content": "My manager saw it and said nothing, which is worse somehow."},
    ]
    batch = [
        sft.encode(tok, {"messages": long_ctx, "rubric": GOOD}, 4096),
        sft.encode(tok, {"messages": long_ctx[:1], "rubric": GOOD}, 4096),
    ]
    assert len(batch[0]["prompt_ids"]) > len(batch[1]["prompt_ids"]) + 10  # rows of different lengths
    calls = []
    model.register_forward_hook(lambda m, a, kw, out: calls.append(out.logits.shape[1]), with_kwargs=True)
    loss, N = sft.sft_loss(model, batch, tok.pad_token_id, "cpu")
    grad = torch.autograd.grad(loss, model.lm_head.weight)[0]

    L = max(len(b["ids"]) for b in batch)
    ids = torch.tensor([b["ids"] + [tok.pad_token_id] * (L - len(b["ids"])) for b in batch])
    labels = torch.tensor([b["labels"] + [-100] * (L - len(b["labels"])) for b in batch])
    attn = (torch.arange(L)[None] < torch.tensor([len(b["ids"]) for b in batch])[:, None]).long()
    logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1]
    ref = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))
    ref_grad = torch.autograd.grad(ref, model.lm_head.weight)[0]
    assert N == sum(x != -100 for b in batch for x in b["labels"][1:])
    assert calls[0] == L - len(batch[1]["prompt_ids"]) + 1 < L  # the head ran on k < L positions
    assert loss.item() == pytest.approx(ref.item(), rel=1e-5)
    assert torch.allclose(grad, ref_grad, rtol=1e-4, atol=1e-7)


def test_length_grouped_batches_cover_everything_once():
    import random

    lengths = [5, 50, 7, 48, 6, 49, 8, 51, 47, 46]
    batches = sft.length_grouped_batches(lengths, 2, random.Random(0))
    assert sorted(i for b in batches for i in b) == list(range(10))
    pad = sum(max(lengths[i] for i in b) * len(b) - sum(lengths[i] for i in b) for b in batches)
    assert pad == 5  # neighbours by length: 1 token per batch


def test_sft_script_trains_evaluates_and_saves(tiny_model, tmp_path):
    p = run_script(
        "01_rubric_sft.py",
        "--model",
        tiny_model,
        "--steps",
        "3",
        "--batch-size",
        "4",
        "--micro-batch-size",
        "2",
        "--eval-every",
        "2",
        "--eval-limit",
        "3",
        "--max-new-tokens",
        "12",
        "--lr",
        "5e-3",
        "--out-dir",
        tmp_path,
        "--no-progress",
    )
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
    dialogs = write_jsonl(
        tmp_path / "d.jsonl",
        [
            {
                "id": "a",
                "messages": [
                    {"role": "user", "content": "My boss yelled at me."},
                    {"role": "assistant", "content": "That sounds upsetting."},
                    {"role": "user", "content": "What should I do tomorrow?"},
                ],
            },
            {
                "id": "b",
                "dialog": [
                    {"speaker": "seeker", "content": "I feel lost."},
                    {"speaker": "seeker", "content": "Since the move."},
                    {"speaker": "supporter", "content": "Moving is hard."},
                ],
            },
        ],
    )
    out = tmp_path / "sup.jsonl"
    p = run_script(
        "scripts/label_rubrics.py",
        "--teacher",
        "api:teacher",
        "--label",
        dialogs,
        "--label-out",
        out,
        "--api-base",
        server.base,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    recs = lines(out)
    assert [r["id"] for r in recs] == ["a-t1", "a-t2", "b-t1"]
    assert recs[2]["messages"] == [{"role": "user", "content": "I feel lost. Since the move."}]
    assert all(r["messages"][-1]["role"] == "user" and r["rubric"]["weights"]["affective"] == 0.5 for r in recs)
    assert "labelled 3/3 turns" in p.stdout
    # a teacher that never writes a valid rubric: everything dropped, with the count, nothing invalid written
    bad = fault_server(rate=0.0, user_answer='{"weights": {"cognitive": 1}}')
    out2 = tmp_path / "sup2.jsonl"
    p = run_script(
        "scripts/label_rubrics.py",
        "--teacher",
        "api:teacher",
        "--label",
        dialogs,
        "--label-out",
        out2,
        "--api-base",
        bad.base,
        "--teacher-retries",
        "1",
    )
    assert p.returncode == 0 and "labelled 0/3 turns" in p.stdout and "dropped 3" in p.stdout
    assert bad.requests == 3 * 2 and (not out2.exists() or out2.read_text() == "")


def test_parse_scores():
    assert sft.parse_scores('Sure: {"scores": [10, 5, 0]}', 3) == [1.0, 0.5, 0.0]
    assert sft.parse_scores('{"scores": [10, 5]}', 3) is None
    assert sft.parse_scores('{"scores": [11, 5, 0]}', 3) is None
    assert sft.parse_scores('{"score": [1, 2, 3]}', 3) is None and sft.parse_scores(None, 1) is None


@pytest.mark.parametrize(
    "record, message",
    [
        (
            {"messages": [{"role": "user", "content": "hi"}], "rubric": {**GOOD, "weights": {"cognitive": 1}}},
            "d.jsonl:1: field 'rubric': weights: missing dimension 'affective'",
        ),
        (
            {"messages": [{"role": "assistant", "content": "hi"}], "rubric": GOOD},
            "d.jsonl:1: messages must end with a user",
        ),
        ({"messages": [{"role": "user", "content": "  "}], "rubric": GOOD}, "d.jsonl:1: empty dialogue"),
        ({"messages": "hi", "rubric": GOOD}, "d.jsonl:1: field 'messages' must be list"),
    ],
)
def test_bad_supervision_exits_2(tmp_path, record, message):
    data = write_jsonl(tmp_path / "d.jsonl", [record])
    p = run_script("01_rubric_sft.py", "--train", data, "--out-dir", tmp_path / "runs")
    assert p.returncode == 2 and message in p.stderr and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert not (tmp_path / "runs").exists()


# ---------------------------------------------------------------------------------------------
# 02: preference RL of the generator
# ---------------------------------------------------------------------------------------------
pref = importlib.import_module("02_rubric_pref_rl")


def test_care_score_hand_computed():
    from test_advantages import expect

    equation = "S(y) = sum_d w_d (1/|C_d|) sum_{c in C_d} s(y, c), d = cognitive, affective, proactive"
    rubric = {"weights": {"cognitive": 0.40, "affective": 0.35, "proactive": 0.25}}  # CARE's conflict case
    s = {"cognitive": [0.5, 0.7], "affective": [0.9], "proactive": [0.2, 0.4, 0.6]}
    # S = 0.40 * 0.6 + 0.35 * 0.9 + 0.25 * 0.4 = 0.24 + 0.315 + 0.1 = 0.655
    case = "CARE's conflict case: means 0.6, 0.9, 0.4 weighted 0.40, 0.35, 0.25"
    expect(pref.sft.rubric_score(rubric, s), 0.655, case, f"weights {rubric['weights']}, scores {s}", equation)
    # lesson 5's question 1: weights (0.5, 0.3, 0.2), means 0.6, 0.6, 0.5: 0.3 + 0.18 + 0.1 = 0.58
    rubric = {"weights": {"cognitive": 0.5, "affective": 0.3, "proactive": 0.2}}
    s = {"cognitive": [0.8, 0.4], "affective": [0.6], "proactive": [0.0, 1.0, 0.5]}
    case = "unequal weights and criteria counts: each dimension's mean, then its weight"
    expect(pref.sft.rubric_score(rubric, s), 0.58, case, f"weights {rubric['weights']}, scores {s}", equation)


def test_preference_reward_terms_and_ablations():
    import math

    r = pref.preference_reward(0.62, 0.57, True, margin_coef=0.5, margin_tau=0.05)
    assert r == pytest.approx({"r_rec": 1.0, "r_margin": 0.5 * math.tanh(1.0), "r_fmt": 0.0})
    r = pref.preference_reward(0.50, 0.60, True, 0.5, 0.05)
    assert r["r_rec"] == 0.0 and r["r_margin"] == pytest.approx(-0.5 * math.tanh(2.0))
    assert pref.preference_reward(0.5, 0.6, False, 0.5, 0.05) == {"r_rec": 0.0, "r_margin": 0.0, "r_fmt": -1.0}
    assert pref.preference_reward(0.5, 0.6, False, 0.5, 0.05, use_format=False)["r_fmt"] == 0.0
    assert pref.preference_reward(0.7, 0.6, True, 0.5, 0.05, use_margin=False)["r_margin"] == 0.0
    # the lowest valid reward (-lambda) is still above an invalid rubric's (-1) for lambda < 1
    worst_valid = sum(pref.preference_reward(0.0, 1.0, True, 0.5, 0.05).values())
    assert worst_valid > sum(pref.preference_reward(0, 0, False, 0.5, 0.05).values())


def test_group_advantages():
    A = pref.group_advantages([1.0, 0.0, 0.0, -1.0])
    # mean 0, sample std sqrt(2/3) = 0.8165
    assert A == pytest.approx([1.224744, 0.0, 0.0, -1.224744], abs=1e-5)
    assert pref.group_advantages([0.3, 0.3, 0.3]) == [0.0, 0.0, 0.0]
    assert pref.group_advantages([0.3]) == [0.0]


def test_judge_rubrics_with_a_fake_judge():
    class Fake:  # scores a reply 1 on a criterion when they share the word "feel", else 0
        def score(self, items):
            return [[float("feel" in it["reply"] and "feel" in c) for c in it["criteria"]] for it in items]

    pair = {
        "context": [{"role": "user", "content": "x"}],
        "chosen_text": "You feel hurt.",
        "rejected_text": "Call them tomorrow.",
    }
    rb = {
        "weights": {"cognitive": 0.2, "affective": 0.5, "proactive": 0.3},
        "criteria": {"cognitive": ["a"], "affective": ["names how they feel", "b"], "proactive": ["c"]},
    }
    out = pref.judge_rubrics(Fake(), [pair, pair], [rb, None])
    assert out[1] is None
    assert out[0]["S_chosen"] == pytest.approx(0.5 * 0.5) and out[0]["S_rejected"] == 0.0


def test_pref_rl_script_runs_and_reports(tiny_model, tmp_path):
    p = run_script(
        "02_rubric_pref_rl.py",
        "--model",
        tiny_model,
        "--steps",
        "2",
        "--contexts-per-step",
        "2",
        "--g",
        "2",
        "--max-new-tokens",
        "12",
        "--report-limit",
        "3",
        "--save-every",
        "1",
        "--out-dir",
        tmp_path,
        "--no-progress",
    )
    assert p.returncode == 0, p.stderr[-3000:]
    assert "no --adapter" in p.stderr
    run = next(Path(tmp_path).iterdir())
    m = lines(run / "metrics.jsonl")
    assert [x["step"] for x in m] == [1, 2]
    for key in ("reward_mean", "recovery_rate", "parse_valid", "judge_failures", "degenerate_groups", "loss"):
        assert key in m[0]
    for step in m:  # the rubric tokens as sampled against the update's pi_old: rounding only, in fp32
        assert step["token_passes"] > 0 and 0 <= step["sampler_gap_mean"] <= step["sampler_gap_max"] < 1e-4
    assert len(lines(run / "rollouts.jsonl")) == 2 * 2 * 2
    rep = json.loads((run / "report.json").read_text())
    assert set(rep) == {"before", "after"} and 0 <= rep["after"]["recovery_acc"] <= 1
    assert "preference-recovery accuracy" in (run / "report.md").read_text()
    assert (run / "weights_by_turn.png").stat().st_size > 0 and (run / "weights_by_emotion.png").exists()
    assert (run / "adapter" / "adapter_config.json").exists()


def test_bad_preference_pair_names_the_line(tmp_path):
    data = write_jsonl(
        tmp_path / "p.jsonl",
        [
            {"prompt": [{"role": "user", "content": "hi"}], "chosen": "a", "rejected": "b"},
            {
                "prompt": [{"role": "user", "content": "hi"}],
                "chosen": [{"role": "user", "content": "a"}],
                "rejected": "b",
            },
        ],
    )
    p = run_script("02_rubric_pref_rl.py", "--train", data, "--out-dir", tmp_path / "runs")
    assert p.returncode == 2 and "p.jsonl:2: field 'chosen' must be" in p.stderr, p.stderr[-2000:]


def test_pref_rl_report_only(tiny_model, tmp_path):
    p = run_script(
        "02_rubric_pref_rl.py",
        "--model",
        tiny_model,
        "--report-only",
        "--report-limit",
        "2",
        "--max-new-tokens",
        "10",
        "--out-dir",
        tmp_path,
        "--no-progress",
    )
    assert p.returncode == 0, p.stderr[-3000:]
    run = next(Path(tmp_path).iterdir())
    rep = json.loads((run / "report.json").read_text())
    assert rep["before"] == rep["after"] and rep["before"]["weight_turns"] == 2
    assert not (run / "adapter").exists() and not (run / "metrics.jsonl").exists()

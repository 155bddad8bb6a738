"""experiments/benchmark.py runs end to end (--quick, tiny model) and writes its table."""

import json

import pytest

from conftest import run_script


def test_benchmark_quick_writes_the_table(tiny_model, tmp_path):
    p = run_script(
        "experiments/benchmark.py",
        "--model",
        tiny_model,
        "--quick",
        "--out-dir",
        tmp_path,
        env_extra={"OMP_NUM_THREADS": "1"},
    )
    assert p.returncode == 0, p.stderr[-3000:]
    md = (tmp_path / "benchmark.md").read_text()
    for figure in ("1. rollout", "2. update", "3. peer", "4. memory", "QLoRA estimate", "torch 2.", "Command:"):
        assert figure in md, figure
    rows = json.loads((tmp_path / "benchmark.json").read_text())["rows"]
    assert [r["figure"][:2] for r in rows] == ["1.", "2.", "3.", "4."]
    assert rows[0]["ratio"] > 0 and rows[1]["ratio"] > 0
    assert "NOT equal work" not in rows[0]["note"]  # both loops generated the same tokens
    assert rows[2]["ratio"] is None or rows[2]["ratio"] > 0  # None: trl not installed, said so


# ---------------------------------------------------------------------------------------------
# The memory estimate from the shapes (figure 4's tables, docs/scale.md)
# ---------------------------------------------------------------------------------------------
def bench():
    import importlib

    return importlib.import_module("experiments.benchmark")


def peak(name, act=2, **kw):
    b = bench()
    return b.estimate_peaks(b.memory_estimate(b.model_shapes(b.SHAPES[name]), act=act, **kw))


def test_estimate_at_the_one_gpu_budget():
    """Qwen2.5-7B at 16 x 4 dialogues of 4096 tokens, micro-batch 2: about 22 GB with a served judge in
    bf16, and about twice that (the issue's ~40 GB) with the fp32 activations and KV cache from before."""
    p, p0 = peak("Qwen2.5-7B-Instruct"), peak("Qwen2.5-7B-Instruct", act=4)
    assert round(p["always"], 2) == 6.19 and round(p["rollout"], 2) == 15.96
    assert round(p["peak_api"], 1) == 22.2 and round(p0["peak_api"], 1) == 40.3
    # --judge self: one generate call over all 64 judge prompts; 8 prompts a call cost far less
    assert round(p["peak_self"], 1) == 70.4 and round(peak("Qwen2.5-7B-Instruct", judge_rows=8)["peak_self"], 1) == 27.4
    # Qwen3-8B's KV cache is 2.6x the 7B's per token (8 KV heads, 36 layers)
    assert round(peak("Qwen3-8B")["peak_api"], 1) == 46.0
    # halving the live dialogues halves the KV term
    assert abs(peak("Qwen2.5-7B-Instruct", live=32)["rollout"] * 2 - p["rollout"]) < 1e-9


def test_param_counts_match_the_model(tiny_model):
    """param_counts from the config = the tiny model's own linear and embedding parameters."""
    import json
    from pathlib import Path

    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    b = bench()
    s = b.model_shapes(json.loads((Path(tiny_model) / "config.json").read_text()))
    names = list(b.linear_shapes(s))
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    n_linear, n_lora, n_emb = b.param_counts(s, r=4)
    assert n_linear == sum(m.weight.numel() for n, m in model.named_modules() if n.split(".")[-1] in names)
    assert n_emb == model.get_input_embeddings().weight.numel()  # tied head: counted once
    peft_model = get_peft_model(model, LoraConfig(r=4, target_modules=names, task_type="CAUSAL_LM"))
    assert n_lora == sum(p.numel() for n, p in peft_model.named_parameters() if "lora_" in n)


def test_layer_saved_bytes_match_autograd(tiny_model):
    """What one bf16 decoder layer with fp32 LoRA on its 7 linear layers saves for backward (torch's
    saved-tensor hooks, parameters left out) = layer_saved_bytes on the CPU (no bitsandbytes, no mask)."""
    import json
    from pathlib import Path

    import torch
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM

    import common

    b = bench()
    cfg = json.loads((Path(tiny_model) / "config.json").read_text())
    s = b.model_shapes(cfg)
    model = prepare_model_for_kbit_training(
        AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.bfloat16), use_gradient_checkpointing=False
    )
    model = common.cast_for_kbit_training(
        get_peft_model(model, LoraConfig(r=4, target_modules=list(b.linear_shapes(s)), task_type="CAUSAL_LM"))
    )
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            saved[ptr] = max(saved.get(ptr, 0), t.untyped_storage().nbytes())
        return t

    decoder = model.get_base_model().model
    B, T = 2, 48
    x = decoder.embed_tokens(torch.randint(0, s["V"], (B, T))).detach().requires_grad_(True)
    pos = torch.arange(T)[None].expand(B, T)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        decoder.layers[0](x, attention_mask=None, position_ids=pos, position_embeddings=decoder.rotary_emb(x, pos))
    assert sum(saved.values()) == B * T * b.layer_saved_bytes(s, r=4, act=2, bnb=False, repeat_kv=False)


# ---------------------------------------------------------------------------------------------
# The time estimate from the shapes: seconds a step on an H100 and an H200 (docs/scale.md)
# ---------------------------------------------------------------------------------------------
TOY = dict(  # one layer: h 64, i 128, 2 query heads and 1 KV head of 32 (q 64, kv 32), V 100, tied head
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=32,
    vocab_size=100,
    tie_word_embeddings=True,
)


def test_time_estimate_arithmetic_by_hand(monkeypatch):
    """prefill_work, decode_work, train_work and step_phases on a one-layer toy, every number by hand.
    Toy: the linear layers hold q 64x64 + k 64x32 + v 64x32 + o 64x64 + gate, up, down 3 x 64x128 = 36864
    weights; L x q = 64, so attention costs 4 x 64 = 256 FLOPs a (query, key) pair; the head V x h = 6400;
    the KV cache 2 x L x kv x 2 = 128 bytes a token."""
    import argparse

    b = bench()
    s = b.model_shapes(TOY)
    assert b.param_counts(s, 0)[0] == 36864 and b.kv_bytes(s) == 128

    def w(rows):  # a pass over the weights: 1000 bytes, whatever the rows
        return 1000

    # decode: 2 rows after 10 tokens, 3 new; (query, key) pairs 2 x (3 x 10 + 3 x 2 / 2) = 66
    #   FLOPs 2 x (1000 + 6400) x 2 x 3 + 256 x 66 = 88800 + 16896;  bytes 3 x 1000 + 66 x 128 = 3000 + 8448
    assert b.decode_work(s, 1000, w, [2], 10, 3) == (105696, 11448)
    # the same rows in two calls of one: the weights read by each call, 3 x 2 x 1000 + 8448
    assert b.decode_work(s, 1000, w, [1, 1], 10, 3)[1] == 14448
    # prefill: 2 rows of 5 new tokens on 14 cached; pairs 2 x (5 x 14 + 25 / 2) = 165
    #   FLOPs 2 x 1000 x 2 x 5 + 256 x 165 = 20000 + 42240;  bytes 1000 + 2 x (14 + 5) x 128 = 1000 + 4864
    assert b.prefill_work(s, 1000, w, [2], 5, 14) == (62240, 5864)
    # the update: one micro-batch of 2 dialogues of 23 tokens, 8 scored; 1000 frozen weights, 10 LoRA
    #   forward   matmuls 2 x 1010 x 46 = 92920, attention 256 x 2 x 23^2 / 2 = 135424, head 2 x 6400 x 16 = 204800
    #   recompute 92920 + 135424 (the head's chunks are not recomputed: 16 scored < 2^27 / 100)
    #   backward  dX of the frozen 2 x 1000 x 46 = 92000, LoRA dX and dW 4 x 10 x 46 = 1840, attention 2 x 135424,
    #             head 204800: 569488
    #   1230976 FLOPs; bytes: 3 passes (forward, recompute, backward) x 1000
    assert b.train_work(s, 1000, 10, w, [2], 23, 8) == (1230976, 3000)
    assert b.train_work(s, 1000, 10, w, [2], 23, 8, grad=False) == (433144, 1000)
    # a frozen weight costs 6 FLOPs a token (forward, recompute, dX), a LoRA weight 8 (+ its dW)
    assert b.train_work(s, 2000, 10, w, [2], 23, 8)[0] - 1230976 == 6 * 1000 * 46
    assert b.train_work(s, 1000, 20, w, [2], 23, 8)[0] - 1230976 == 8 * 10 * 46
    # weight bytes: NF4 36864 x (0.5 + 1/64 + 4/16384) = 19017, head 2 x 6400, LoRA 4 x 10; above 4 rows the
    # dequantised bf16 copy is written and read: + 36864 x 4
    assert b.weight_bytes(s, 10, 4, four_bit=True, adapter=True) == 19017 + 12800 + 40
    assert b.weight_bytes(s, 10, 5, four_bit=True, adapter=False) == 19017 + 147456 + 12800
    assert b.weight_bytes(s, 10, 5, four_bit=False, adapter=True) == 73728 + 12800 + 40
    assert b.phase_seconds(2e12, 1e12, (1e12, 1e12)) == 2 and b.phase_seconds(1e12, 3e12, (1e12, 1e12)) == 3
    # turns: the middle of 8..15 is 12; 4096 tokens hold 1 + (4096 - 107 - 256) // (256 + 128) = 10
    turns = dict(min_turns=8, max_turns=15, max_new_tokens=256)
    assert b.assumed_turns(argparse.Namespace(**turns, max_context=4096)) == 10
    assert b.assumed_turns(argparse.Namespace(**turns, max_context=100_000)) == 12

    # A whole step: openings of 10 tokens, user messages of 5, judge prompts of the dialogue + 20, the user's
    # system prompt 15, the judge's answers 3 tokens and the user's 2; 1 scenario x K=2, 2 turns of 4-token replies,
    # bf16 weights and no LoRA (r 0): a pass over the weights is 36864 x 2 + 12800 = 86528 bytes
    for name, value in dict(
        OPENING_TOKENS=10,
        USER_MESSAGE_TOKENS=5,
        JUDGE_PROMPT_TOKENS=20,
        USER_SYSTEM_TOKENS=15,
        JUDGE_MAX_TOKENS=3,
        USER_MAX_TOKENS=2,
    ).items():
        monkeypatch.setattr(b, name, value)
    args = argparse.Namespace(
        scenarios_per_step=1,
        k=2,
        min_turns=2,
        max_turns=2,
        max_new_tokens=4,
        max_context=1000,
        micro_batch_size=2,
        minibatch_size=1,
        update_epochs=1,
        judge="self",
        user="self",
        judge_concurrency=1,
        user_concurrency=None,
        api_concurrency=8,
        lora_targets="q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj",
        load_in_4bit="off",
        kl_coef=0.0,
        gradient_checkpointing=True,
    )
    monkeypatch.setattr(b.common, "LORA_R", 0)  # no adapter in the hand count
    phases, z = b.step_phases(s, args)
    work = {p: (f, nb) for _, p, f, nb, _ in phases}
    assert z["T"] == 2 and z["tokens"] == 23 and z["scored"] == 16  # contexts 10, then 10 + 4 + 5 = 19; 19 + 4
    # policy prefill: turn 1, the opening once (1 row x 10, pairs 50): 2 x 36864 x 10 + 256 x 50 = 750080 FLOPs,
    #   86528 + 10 x 128 bytes; turn 2, 2 rows x 5 new on 14 cached (pairs 165): 737280 + 42240, 86528 + 2 x 19 x 128
    assert work["policy prefill"] == (750080 + 779520, 87808 + 91392)
    # policy decode, 2 rows x 4 tokens: turn 1 after 10 (pairs 2 x (40 + 6) = 92), turn 2 after 19 (pairs 164)
    #   FLOPs 2 x (36864 + 6400) x 8 = 692224 a turn + 256 x (92 + 164);  bytes 4 x 86528 a turn + 128 x (92 + 164)
    assert work["policy decode"] == (2 * 692224 + 256 * 256, 2 * 346112 + 128 * 256)
    # judge decode, 2 calls of 1 row (--judge-concurrency 1), 3 tokens after prompts of 34 and 43:
    #   pairs 2 x (3 x 34 + 3) = 210 and 2 x (3 x 43 + 3) = 264; each turn 2 x 3 weight passes
    assert work["judge decode"] == (2 * 519168 + 256 * 474, 2 * 6 * 86528 + 128 * 474)
    # the user: after turn 1 only, one call of 2 rows (--api-concurrency 8), 2 tokens after 10 + 4 + 15 = 29
    #   pairs 2 x (2 x 29 + 1) = 118
    assert work["user decode"] == (2 * 43264 * 2 * 2 + 256 * 118, 2 * 86528 + 128 * 118)
    # old log-probs: minibatches of 1, the second needs them: 1 dialogue, no gradient:
    #   2 x 36864 x 23 + 256 x 23^2 / 2 + 2 x 6400 x 8 = 1695744 + 67712 + 102400, one weight pass
    assert work["old log-probs"] == (1865856, 86528)
    # forward + backward: 2 micro-batches of 1: 6 x 36864 x 46 + 4 x 135424 + 2 x 204800, 3 passes each
    assert work["forward + backward"] == (6 * 36864 * 46 + 4 * 135424 + 2 * 204800, 6 * 86528)
    assert "reference log-probs" not in work  # --kl-coef 0 and no KL logged on this step
    assert z["forwards"] == {"policy": 2 * 4, "judge": 2 * 2 * 3, "user": 1 * 1 * 2}
    assert [g for g, *_ in phases].count("update") == 2


def test_estimate_prints_seconds_a_step_on_both_gpus_beside_the_memory():
    """`benchmark.py --estimate`: each model's memory table, then its time table for 04's gpu preset with the
    seconds a step on an H100 and an H200 and the phases that dominate (the self judge's and user's decoding)."""
    import re

    p = run_script("experiments/benchmark.py", "--estimate", "--estimate-models", "Qwen2.5-7B-Instruct")
    assert p.returncode == 0, p.stderr[-3000:]
    out = p.stdout
    memory, time_ = out.index("**peak, --judge self**"), out.index("#### Time of one step: Qwen2.5-7B-Instruct")
    assert memory < time_  # beside the memory table, after it
    assert "| phase | work | TFLOP | GB moved | s, H100 | s, H200 | share, H100 / H200 | bound by |" in out
    m = re.search(r"\*\*([\d.]+) s a step on an H100, ([\d.]+) s on an H200\*\*; dominant: (.*)\.", out)
    assert m and (float(m[1]), float(m[2])) == (315, 235), out[time_:]
    assert m[3].startswith("rollout: judge decode (48% / 45%), rollout: user decode (26% / 24%)")
    assert "T = 10 turns" in out and "27,200 decode forwards" in out
    rows = {r.split(" | ")[0][2:]: r for r in out[time_:].splitlines() if r.startswith(("| rollout:", "| update:"))}
    assert set(rows) == {
        f"{g}: {p}"
        for g, p in [
            ("rollout", "policy prefill"),
            ("rollout", "policy decode"),
            ("rollout", "judge prefill"),
            ("rollout", "judge decode"),
            ("rollout", "user prefill"),
            ("rollout", "user decode"),
            ("update", "old log-probs"),
            ("update", "forward + backward"),
        ]
    }
    assert rows["rollout: judge decode"].endswith("| memory |") and rows["update: forward + backward"].endswith(
        "| compute |"
    )


def test_for_run_prints_the_measured_seconds_beside_the_estimate(tmp_path, trainer, capsys):
    """--for-run RUN_DIR: the estimate at the run's flags (its args.json) beside the seconds of its
    metrics.jsonl, step 1 and step 2, labelled with --measured-on; a phase a run did not log says so."""
    import json as json_
    import re

    import common
    import runs

    b = bench()
    args = trainer.parse_args(["--model", common.PACKAGED_SMOLLM2, "--preset", "gpu", "--max-turns", "3"])
    run = tmp_path / "gpu-check-1"
    run.mkdir()
    (run / "args.json").write_text(json_.dumps(runs.public_args(args), default=str))
    steps = [
        {"step": 1, "step_seconds": 30.0, "turns_mean": 3.0, "token_passes": 3000},
        {"step": 2, "step_seconds": 12.5, "rollout_seconds": 10.0, "reward_seconds": 0.02, "update_seconds": 2.5},
    ]
    (run / "metrics.jsonl").write_text("".join(json_.dumps(m) + "\n" for m in steps))
    b.main(["--estimate", "--for-run", str(run), "--measured-on", "NVIDIA H200"])
    out = capsys.readouterr().out
    assert "(measured on NVIDIA H200)" in out
    phases, _ = b.step_phases(b.model_shapes(b.SHAPES[common.PACKAGED_SMOLLM2]), args)
    step = {g: sum(v) for g, v in b.seconds_by_gpu(phases).items()}
    assert re.search(r"^\| rollout \(policy, judge, user\) \| [\d.e-]+ \| [\d.e-]+ \| not logged \| 10 \|$", out, re.M)
    assert f"| step | {step['H100']:.3g} | {step['H200']:.3g} | 30 | 12.5 |" in out
    assert re.search(r"^\| update \| [\d.e-]+ \| [\d.e-]+ \| not logged \| 2.5 \|$", out, re.M)
    assert "ms measured" in out  # the rollout's seconds over its decode forwards
    (run / "args.json").unlink()
    with pytest.raises(common.UserError, match="--for-run .*: not a run folder"):
        b.main(["--for-run", str(run)])

"""experiments/benchmark.py: what the rollout and the update cost, each measured against a reference.

Four figures, each a ratio of two timings taken side by side in this one process: the same model,
scenarios, seeds and token budgets on both sides, one untimed warm-up run of each side first.
  1. rollout  03's batched turn loop (every live dialogue answered in one generate call per turn)
              vs the same dialogues one at a time, in assistant turns per second. Equal work: no
              dialogue ends early (--min-turns = --max-turns) and every reply is exactly
              --max-new-tokens tokens (min_new_tokens: end-of-turn suppressed). Both loops are 03's
              rollout (the sequential one with K = 1), so both keep each dialogue's KV cache between
              turns; only the batched one can prefill a scenario's K identical openings once.
              Goal >= 4x at 16 live dialogues (--scenarios x --k).
  2. update   one 04 optimisation step (ppo_update: log-probs, clipped surrogate, backward, gradient
              clipping, AdamW) on the rollout's trajectories vs the bare forward + backward of the same
              tokens in the same micro-batches (the model's own forward with labels: the compute that
              cannot be avoided), timed alternately (ours, reference, ours, ...). Goal <= 1.3x.
  3. peer     a single-turn GRPO step of 04 (a one-turn rollout, IDR rewards from the same judge, GRPO
              advantages, the update) vs TRL's GRPOTrainer with the same model, LoRA, prompts, group
              size, completion length (forced, as in 1), micro-batch and judge reward; one optimisation
              step each, timed without setup. Goal <= 1.0x. Skipped, with the reason, without trl.
  4. memory   peak RSS of the demo run (`make demo`: 04 with its defaults; the first --memory-steps
              steps, in a subprocess), and the per-component memory estimate for QLoRA training of
              Qwen2.5-7B-Instruct on one GPU (the formulas are in docs/scale.md).
Prints a markdown table (figure, ours, reference, ratio, goal, met?) with the machine, versions, date
and command, and writes it to <out>/benchmark.md and <out>/benchmark.json.

CPU, the packaged SmolLM2 (roughly 15-20 minutes on 2 idle cores):  python experiments/benchmark.py
Smoke run on a tiny model (seconds):  python experiments/benchmark.py --model PATH --quick
The base weights are loaded unquantised on both sides (--load-in-4bit off), so that TRL and 04 run
the same model.
"""
from __future__ import annotations

import argparse
import copy
import datetime
import importlib
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import common  # noqa: E402

trainer = importlib.import_module("04_mica_train")   # the update, advantages and rewards
env = trainer.env                                      # 03_rollout: scenarios, judge, user, rollout


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default=common.PACKAGED_SMOLLM2,
                   help="policy model (hub id, folder, alias or the packaged SmolLM2), as in 04_mica_train.py")
    p.add_argument("--scenarios", type=int, default=4, help="scenarios of the rollout and update figures")
    p.add_argument("--k", type=int, default=4, help="dialogues per scenario (live dialogues = scenarios x k)")
    p.add_argument("--max-turns", type=int, default=3, help="assistant turns per dialogue (every dialogue runs all)")
    p.add_argument("--max-new-tokens", type=int, default=48, help="tokens of every reply (forced, both sides)")
    p.add_argument("--peer-prompts", type=int, default=4, help="prompts of the single-turn GRPO step")
    p.add_argument("--peer-k", type=int, default=4, help="GRPO group size (TRL's num_generations)")
    p.add_argument("--repeats", type=int, default=3,
                   help="timed repeats of the update (alternating with the reference) and peer steps after "
                        "the warm-up (the median counts)")
    p.add_argument("--memory-steps", type=int, default=2, help="steps of the demo run measured for peak RSS")
    p.add_argument("--no-trl", action="store_true", help="skip the TRL comparison (figure 3)")
    p.add_argument("--no-memory", action="store_true", help="skip the demo run (figure 4's peak RSS)")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: 2 scenarios x 2, 2 turns of 8 tokens, 1 repeat, a 1-step demo run")
    p.add_argument("--seed", type=int, default=0, help="seed of the scenario choice and of sampling")
    p.add_argument("--out-dir", default=str(ROOT / "runs" / "benchmark"), help="benchmark.md and .json go here")
    a = p.parse_args(argv)
    if a.quick:
        a.scenarios, a.k, a.max_turns, a.max_new_tokens = 2, 2, 2, 8
        a.peer_prompts, a.peer_k, a.repeats, a.memory_steps = 2, 2, 1, 1
    common.check(a.scenarios >= 1 and a.k >= 2 and a.peer_prompts >= 1 and a.peer_k >= 2,
                 "--scenarios and --peer-prompts must be >= 1, --k and --peer-k >= 2")
    common.check(a.repeats >= 1 and a.max_turns >= 1 and a.max_new_tokens >= 1, "--repeats, --max-turns, "
                 "--max-new-tokens must be >= 1")
    return a


def policy_args(a, k, max_turns, extra=()):
    """04's own flags (its defaults for everything not named here), parsed as the script parses them."""
    flags = ["--model", a.model, "--k", k, "--max-turns", max_turns, "--min-turns", max_turns,
             "--max-new-tokens", a.max_new_tokens, "--seed", a.seed, "--load-in-4bit", "off", "--no-progress", *extra]
    return trainer.parse_args([str(x) for x in flags])


def clock() -> float:
    if torch.cuda.is_available():
        torch.cuda.synchronize()            # GPU work queued so far counts in the timing
    return time.perf_counter()


def timed(fn, repeats: int) -> tuple[float, object]:
    """Run fn once untimed (warm-up), then `repeats` times; the median seconds and the last result."""
    fn()
    times, out = [], None
    for _ in range(repeats):
        t0 = clock()
        out = fn()
        times.append(clock() - t0)
    return statistics.median(times), out


def timed_pair(fn_a, fn_b, repeats: int) -> tuple[float, float]:
    """Median seconds of fn_a and fn_b, run alternately (a b a b ...) after one warm-up of each, so
    that load from elsewhere on the machine falls on both sides alike."""
    fn_a(), fn_b()
    times_a, times_b = [], []
    for _ in range(repeats):
        for fn, times in ((fn_a, times_a), (fn_b, times_b)):
            t0 = clock()
            fn()
            times.append(clock() - t0)
    return statistics.median(times_a), statistics.median(times_b)


class SameK:
    """The scripted user picks its lines by (scenario, k, turn): a dialogue rolled out alone keeps
    the k it has in the batch, so both loops hear the same kind of lines."""

    def __init__(self, user, k):
        self.user, self.k = user, k

    def reply(self, items):
        return self.user.reply([{**it, "k": self.k} for it in items])


# ---------------------------------------------------------------------------------------------
# 1. Rollout: batched turn loop vs one dialogue at a time
# ---------------------------------------------------------------------------------------------
def rollout_one_at_a_time(model, tok, scenarios, judge, user, args):
    one = copy.copy(args)
    one.k = 1
    trajs = []
    for s in scenarios:
        for k in range(args.k):
            trajs += env.rollout(model, tok, [s], judge, SameK(user, k), one)
    return trajs


def bench_rollout(a, model, tok, scenarios, judge, user, args):
    work = lambda trajs: (sum(tr.T for tr in trajs), sum(e - s for tr in trajs for s, e in tr.spans))  # noqa: E731
    warm = copy.copy(args)
    warm.max_turns, warm.min_turns, warm.k = 1, 1, 2
    env.rollout(model, tok, scenarios[:1], judge, user, warm)                      # warm-up, both loops
    rollout_one_at_a_time(model, tok, scenarios[:1], judge, user, warm)
    torch.manual_seed(a.seed)
    t0 = clock()
    batched = env.rollout(model, tok, scenarios, judge, user, args)
    t_batched = clock() - t0
    torch.manual_seed(a.seed)
    t0 = clock()
    alone = rollout_one_at_a_time(model, tok, scenarios, judge, user, args)
    t_alone = clock() - t0
    (turns, tokens), (turns_ref, tokens_ref) = work(batched), work(alone)
    ours, ref = turns / t_batched, turns_ref / t_alone
    row = {"figure": f"1. rollout: assistant turns/s, {len(scenarios) * args.k} live dialogues",
           "ours": f"{ours:.3g} turns/s (batched, {t_batched:.1f} s)",
           "reference": f"{ref:.3g} turns/s (one at a time, {t_alone:.1f} s)",
           "ratio": ours / ref, "goal": ">= 4x", "met": ours / ref >= 4,
           "note": f"{turns} turns / {tokens} reply tokens vs {turns_ref} / {tokens_ref}"
                   + ("" if (turns, tokens) == (turns_ref, tokens_ref) else " (NOT equal work)")}
    return row, batched


# ---------------------------------------------------------------------------------------------
# 2. Update: one 04 optimisation step vs the bare forward + backward of the same tokens
# ---------------------------------------------------------------------------------------------
def micro_batches(trajs, args):
    order = sorted(range(len(trajs)), key=lambda i: len(trajs[i].ids))   # as ppo_update groups them
    return [[trajs[i] for i in order[j:j + args.micro_batch_size]]
            for j in range(0, len(order), args.micro_batch_size)]


def bare_forward_backward(model, tok, trajs, args):
    """The model's own forward with labels on the scored tokens, and backward: nothing else."""
    device = next(model.parameters()).device
    model.train()
    for micro in micro_batches(trajs, args):
        ids, attn, mask = trainer.pref.collate(trainer.as_samples(micro), tok.pad_token_id, device)
        labels = ids.masked_fill(mask == 0, -100)
        model(input_ids=ids, attention_mask=attn, labels=labels).loss.backward()
    model.zero_grad(set_to_none=True)


def bench_update(a, model, tok, trajs, args):
    groups = {}
    for tr in trajs:
        groups.setdefault(tr.scenario["id"], []).append(tr)
    flat = [tr for g in groups.values() for tr in g]
    advs = [A for g in groups.values()
            for A in trainer.mica_advantages([trainer.turn_rewards(tr, args) for tr in g], args.alpha, args.gamma)]
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=args.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    t_ours, t_ref = timed_pair(lambda: trainer.pref.ppo_update(model, tok, opt, sched, trainer.as_samples(flat, advs), args),
                               lambda: bare_forward_backward(model, tok, flat, args), a.repeats)
    cells = [(len(m) * max(len(tr.ids) for tr in m), sum(len(tr.ids) for tr in m)) for m in micro_batches(flat, args)]
    padding = 1 - sum(real for _, real in cells) / sum(all_ for all_, _ in cells)
    scored = sum(trainer.pref.n_scored(s) for s in trainer.as_samples(flat))
    return {"figure": f"2. update: one 04 step vs bare forward + backward ({len(flat)} trajectories)",
            "ours": f"{t_ours:.3g} s", "reference": f"{t_ref:.3g} s", "ratio": t_ours / t_ref,
            "goal": "<= 1.3x", "met": t_ours / t_ref <= 1.3,
            "note": f"{scored} scored tokens, micro-batch {args.micro_batch_size}, padding {padding:.1%} "
                    f"of the micro-batch cells (length-sorted)"}


# ---------------------------------------------------------------------------------------------
# 3. Peer: a single-turn GRPO step of 04 vs TRL's GRPOTrainer
# ---------------------------------------------------------------------------------------------
def ours_grpo_step(model, tok, prompts, judge, user, args, opt, sched):
    # 1. rollout (one turn)  2. IDR rewards  3. GRPO advantages  4. the update
    trajs = env.rollout(model, tok, prompts, judge, user, args)
    groups = [[tr for tr in trajs if tr.scenario is s] for s in prompts]
    rewards = [[trainer.turn_rewards(tr, args) for tr in g] for g in groups]
    advs = [A for r in rewards for A in trainer.grpo_advantages(r)]
    return trainer.pref.ppo_update(model, tok, opt, sched, trainer.as_samples([tr for g in groups for tr in g], advs), args)


def trl_grpo_seconds(a, prompts, judge, args, out_dir) -> tuple[float | None, str]:
    """Median seconds of one GRPOTrainer optimisation step (after one warm-up step), or None and why."""
    try:
        from datasets import Dataset
        from peft import LoraConfig
        from transformers import AutoModelForCausalLM, TrainerCallback
        from trl import GRPOConfig, GRPOTrainer
    except ImportError as e:
        return None, f"not installed (no module {e.name}): pip install trl==1.16.0"

    class StepTimer(TrainerCallback):       # on_step_begin .. on_step_end spans generation + update
        times = []

        def on_step_begin(self, *args, **kw):
            self.t0 = clock()

        def on_step_end(self, *args, **kw):
            self.times.append(clock() - self.t0)

    by_id = {s["id"]: s for s in prompts}

    def judge_reward(prompts, completions, scenario_id, **_):
        # the same judge and reward as 04's single turn: IDR r = d(P0) - d(P0 + v)
        cases = [{"scenario": by_id[i], "history": p, "reply": c[0]["content"].strip()}
                 for p, c, i in zip(prompts, completions, scenario_id)]
        rewards = []
        for case, verdict in zip(cases, judge.judge(cases)):
            P0 = case["scenario"]["p0"]
            v = env.levels_to_v(verdict["levels"]) if verdict else [0.0, 0.0, 0.0]
            P1 = [p + x for p, x in zip(P0, v)]
            rewards.append(env.incremental_distance_rewards([P0, P1], args.idr_weights, args.eps)[0])
        return rewards

    path = common.resolve_model(a.model)
    cuda = torch.cuda.is_available()
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.bfloat16 if cuda else torch.float32,
        attn_implementation="sdpa")                                # as common.load_policy picks
    data = Dataset.from_list([{"prompt": [{"role": "system", "content": args.system_prompt},
                                          {"role": "user", "content": s["opening"]}], "scenario_id": s["id"]}
                              for s in prompts])
    n = len(prompts) * args.k
    config = GRPOConfig(
        output_dir=str(out_dir / "trl"), per_device_train_batch_size=args.micro_batch_size,
        gradient_accumulation_steps=n // args.micro_batch_size, num_generations=args.k,
        max_completion_length=args.max_new_tokens, generation_kwargs={"min_new_tokens": args.max_new_tokens},
        temperature=args.temperature, top_p=args.top_p, max_steps=1 + a.repeats, learning_rate=args.lr,
        weight_decay=args.weight_decay, lr_scheduler_type="constant", warmup_steps=0,
        max_grad_norm=args.max_grad_norm, beta=0.0, epsilon=args.clip_low, epsilon_high=args.clip_high,
        num_iterations=1, loss_type="dapo", scale_rewards="group", gradient_checkpointing=args.gradient_checkpointing,
        bf16=cuda, use_cpu=not cuda, shuffle_dataset=False, seed=a.seed, report_to="none", logging_steps=10_000,
        save_strategy="no", disable_tqdm=True, dataloader_num_workers=0)
    lora = LoraConfig(r=args.lora_r, lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout,
                      target_modules=args.lora_targets.split(","), task_type="CAUSAL_LM")
    timer = StepTimer()
    trl_trainer = GRPOTrainer(model=model, reward_funcs=judge_reward, args=config, train_dataset=data,
                              processing_class=common.load_tokenizer(path), peft_config=lora, callbacks=[timer])
    trl_trainer.train()
    times = timer.times[1:]                                      # step 1 is the warm-up
    return statistics.median(times), f"GRPOTrainer, trl {importlib.import_module('trl').__version__}"


def bench_peer(a, model, tok, scenarios, judge, user, out_dir):
    args = policy_args(a, a.peer_k, 1, ["--advantage", "grpo"])
    prompts = scenarios[: a.peer_prompts]
    if len(prompts) * args.k % args.micro_batch_size:
        args.micro_batch_size = 1            # TRL needs the completions to split into equal micro-batches
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=args.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    torch.manual_seed(a.seed)
    t_ours, _ = timed(lambda: ours_grpo_step(model, tok, prompts, judge, user, args, opt, sched), a.repeats)
    row = {"figure": f"3. peer: single-turn GRPO step, {len(prompts)} prompts x {args.k}, {args.max_new_tokens} tokens",
           "ours": f"{t_ours:.3g} s", "goal": "<= 1.0x"}
    t_trl, what = (None, "skipped (--no-trl)") if a.no_trl else trl_grpo_seconds(a, prompts, judge, args, out_dir)
    if t_trl is None:
        return {**row, "reference": f"n/a: {what}", "ratio": None, "met": None, "note": what}
    return {**row, "reference": f"{t_trl:.3g} s", "ratio": t_ours / t_trl, "met": t_ours / t_trl <= 1.0,
            "note": f"{what}; micro-batch {args.micro_batch_size}, beta 0, one epoch, dapo token-mean loss"}


# ---------------------------------------------------------------------------------------------
# 4. Memory: peak RSS of the demo run, and the QLoRA estimate for Qwen2.5-7B-Instruct
# ---------------------------------------------------------------------------------------------
def bench_memory(a, out_dir):
    cmd = [sys.executable, str(ROOT / "04_mica_train.py"), "--model", a.model, "--steps", str(a.memory_steps),
           "--out-dir", str(out_dir / "demo"), "--run-name", "demo", "--no-progress", "--save-every", "1000"]
    if a.quick:
        cmd += ["--scenarios-per-step", "2", "--k", "2", "--max-turns", "2", "--max-new-tokens", "8"]
    t0 = time.time()
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    common.check(p.returncode == 0, f"the demo run failed: {' '.join(cmd)}\n{p.stderr[-2000:]}")
    run = max((out_dir / "demo").glob("demo-*"), key=lambda d: d.stat().st_mtime)
    peak = max(json.loads(x)["peak_rss_gb"] for x in (run / "metrics.jsonl").read_text().splitlines())
    return {"figure": f"4. memory: peak RSS of the demo run (first {a.memory_steps} steps of `make demo`)",
            "ours": f"{peak:.2f} GB", "reference": "-", "ratio": None, "goal": "report", "met": None,
            "note": f"{' '.join(cmd[1:])} ({time.time() - t0:.0f} s)"}


def qlora_estimate(r=16, micro_tokens=8192, scored_tokens=7680, kv_tokens=64 * 4096, prefill_tokens=8192):
    """Memory of QLoRA training of Qwen2.5-7B-Instruct on one GPU, per component, in GB (1e9 bytes).

    Shapes from its config: hidden h 3584, intermediate i 18944, 28 layers, 28 query / 4 KV heads of
    dim 128 (kv_dim 512), vocabulary V 152064, embeddings and LM head untied. Defaults: a micro-batch of
    2 dialogues of 4096 tokens, 7680 of them scored (15 turns x 256), and a rollout of 64 live
    dialogues of 4096 tokens, where one generate call prefills at most 8192 tokens: the KV cache is
    kept between turns, so that is the first turn's 16 distinct openings of 512 tokens, or a later
    turn's 64 new user messages of 128 (without it, the last turn would prefill all 64 x 4096)."""
    h, i, L, kv, V = 3584, 18944, 28, 4 * 128, 152064
    linear = {"q_proj": (h, h), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (h, h),
              "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}       # (in, out)
    n_linear = L * sum(fi * fo for fi, fo in linear.values())                  # 6.53e9, quantised
    n_lora = L * sum(r * (fi + fo) for fi, fo in linear.values())              # A: r x in, B: out x r
    nf4 = 0.5 + 1 / 64 + 4 / (64 * 256)       # 4 bits + 8-bit absmax per 64 + fp32 per 256 absmax
    chunk = min(scored_tokens, common.LOGIT_CHUNK // V)   # common.token_logprobs computes the LM head in chunks of rows
    # (component, formula, bytes, when it is held: always, in the update, in the rollout)
    rows = [
        ("base weights, NF4 linear layers", f"{n_linear / 1e9:.2f}e9 x {nf4:.4f} bytes", n_linear * nf4, "always"),
        ("base weights, bf16 embeddings + LM head", "2 x V x h x 2 bytes", 2 * V * h * 2, "always"),
        ("LoRA weights + gradients (fp32)", f"{n_lora / 1e6:.1f}e6 x (4 + 4) bytes", n_lora * 8, "always"),
        ("AdamW moments m, v (fp32; the fp32 LoRA weights are their own master copy)",
         f"{n_lora / 1e6:.1f}e6 x 8 bytes", n_lora * 8, "always"),
        ("activations, gradient checkpointing: one bf16 hidden state per layer boundary",
         f"{micro_tokens} tokens x L x h x 2 bytes", micro_tokens * L * h * 2, "update"),
        ("activations: the one layer recomputed in backward", f"{micro_tokens} tokens x (12h + 4 kv_dim + 4i) x 2 bytes",
         micro_tokens * (12 * h + 4 * kv + 4 * i) * 2, "update"),
        (f"log-probs: one chunk of fp32 logits + their gradient + bf16 logits (all {scored_tokens} scored "
         f"tokens at once: {scored_tokens * V * 10 / 1e9:.1f} GB)", f"{chunk} rows x V x (4 + 4 + 2) bytes",
         chunk * V * 10, "update"),
        ("KV cache of the rollout (bf16)", f"{kv_tokens} tokens x 2 x L x kv_dim x 2 bytes",
         kv_tokens * 2 * L * kv * 2, "rollout"),
        ("rollout prefill: one layer's MLP intermediates (gate, up, product) for the tokens one generate "
         "call prefills", f"{prefill_tokens} tokens x 3i x 2 bytes", prefill_tokens * 3 * i * 2, "rollout"),
    ]
    return rows, n_lora


# ---------------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------------
def table(rows) -> str:
    fmt = lambda r: "-" if r is None else f"{r:.2f}x"  # noqa: E731
    met = lambda m: "n/a" if m is None else ("yes" if m else "no")  # noqa: E731
    lines = ["| figure | ours | reference | ratio | goal | met? |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['figure']} | {r['ours']} | {r['reference']} | {fmt(r['ratio'])} | {r['goal']} | {met(r['met'])} |"
              for r in rows]
    return "\n".join(lines)


def machine() -> str:
    versions = {m: importlib.import_module(m).__version__ for m in ("torch", "transformers", "peft")}
    try:
        versions["trl"] = importlib.import_module("trl").__version__
    except ImportError:
        versions["trl"] = "not installed"
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else \
        f"CPU, {os.cpu_count()} cores ({platform.processor() or platform.machine()}), {torch.get_num_threads()} torch threads"
    return (f"{datetime.datetime.now():%Y-%m-%d %H:%M} | {device} | Python {platform.python_version()} | "
            + " | ".join(f"{k} {v}" for k, v in versions.items()))


def main(argv=None):
    a = parse_args(argv)
    out_dir = Path(a.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    command = "python " + " ".join([str(Path(sys.argv[0]).relative_to(ROOT) if Path(sys.argv[0]).is_absolute()
                                        and ROOT in Path(sys.argv[0]).parents else sys.argv[0])] + sys.argv[1:])
    t_start = time.time()
    args = policy_args(a, a.k, a.max_turns, ["--scenarios-per-step", a.scenarios])
    common.set_seed(a.seed)
    model, tok = common.load_policy(args, trainable=True)
    model.get_base_model().generation_config.min_new_tokens = a.max_new_tokens   # equal work, see 1.
    judge, user = env.make_judge(args), env.make_user(args)
    scenarios = random.Random(a.seed).sample(env.load_scenarios(args.scenarios), max(a.scenarios, a.peer_prompts))
    rows = []
    print("1. rollout ...", flush=True)
    row, trajs = bench_rollout(a, model, tok, scenarios[: a.scenarios], judge, user, args)
    rows.append(row)
    print("2. update ...", flush=True)
    rows.append(bench_update(a, model, tok, trajs, args))
    print("3. peer ...", flush=True)
    rows.append(bench_peer(a, model, tok, scenarios, judge, user, out_dir))
    if not a.no_memory:
        print("4. memory ...", flush=True)
        del model, trajs
        rows.append(bench_memory(a, out_dir))
    est, n_lora = qlora_estimate(r=16)
    phase = {w: sum(b for _, _, b, when in est if when == w) / 1e9 for w in ("always", "update", "rollout")}
    text = (f"# Benchmark\n\n{machine()}\n\nCommand: `{command}` ({time.time() - t_start:.0f} s); model "
            f"{a.model}\n\n{table(rows)}\n\n" + "\n".join(f"- {r['figure'].split(':')[0]}: {r['note']}" for r in rows)
            + f"\n\n## QLoRA estimate: Qwen2.5-7B-Instruct, LoRA r=16 on all 7 linear layers ({n_lora:,} "
              f"parameters), one GPU\n\n| component | formula | GB | held |\n|---|---|---|---|\n"
            + "\n".join(f"| {name} | {formula} | {b / 1e9:.2f} | {when} |" for name, formula, b, when in est)
            + f"\n| peak: always + max(update, rollout) | {phase['always']:.1f} + max({phase['update']:.1f}, "
              f"{phase['rollout']:.1f}) | {phase['always'] + max(phase['update'], phase['rollout']):.1f} | |\n")
    print("\n" + text)
    (out_dir / "benchmark.md").write_text(text)
    (out_dir / "benchmark.json").write_text(json.dumps(
        {"machine": machine(), "command": command, "model": a.model, "rows": rows,
         "qlora_estimate_gb": {name: b / 1e9 for name, _, b, _ in est}}, indent=2, default=str))
    print(f"written: {out_dir / 'benchmark.md'}, {out_dir / 'benchmark.json'}")


if __name__ == "__main__":
    common.run_main(main)

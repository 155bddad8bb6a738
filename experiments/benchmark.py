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
  2. update   one 04 optimisation step (policy_update: log-probs, clipped surrogate, backward, gradient
              clipping, AdamW) on the rollout's trajectories vs the bare forward + backward of the same
              tokens in the same micro-batches (the model's own forward with labels: the compute that
              cannot be avoided), timed alternately (ours, reference, ours, ...). Goal <= 1.3x.
  3. peer     a single-turn GRPO step of 04 (a one-turn rollout, IDR rewards from the same judge, GRPO
              advantages, the update) vs TRL's GRPOTrainer with the same model, LoRA, prompts, group
              size, completion length (forced, as in 1), micro-batch and judge reward; one optimisation
              step each, timed without setup. Goal <= 1.0x. Skipped, with the reason, without trl.
  4. memory   peak RSS of the demo run (`make demo`: 04 with its defaults; the first --memory-steps
              steps, in a subprocess), and the per-component estimate from the shapes of QLoRA training
              on one GPU for SmolLM2-135M, Qwen2.5-7B and Qwen3-8B (memory_estimate; docs/scale.md):
              bf16 activations and KV cache next to the fp32 ones from before common.cast_for_kbit_training;
              beside it, the seconds of one step of 04's gpu preset per phase on an H100 and an H200 at
              their datasheet peaks (step_phases, time_table).
  5. engine   a step's rollout with --judge self --user self (the policy, the judge, the user) sampled by a
              vLLM server (engine.py, started for each of --engine-dtypes with --engine-python: the policy's
              fresh LoRA pushed, the judge and the user its base) vs by generate (the same model in the same
              dtype), same scenarios and seed, each after a one-turn warm-up; the two samplers draw different
              tokens, so each side's tokens are counted by role. Reported, no goal. Not in the default set.
Prints a markdown table (figure, ours, reference, ratio, goal, met?) with the machine, versions, date
and command, and writes it to <out>/benchmark.md and <out>/benchmark.json.

CPU, the packaged SmolLM2 (roughly 15-20 minutes on 2 idle cores):  python experiments/benchmark.py
Smoke run on a tiny model (seconds):  python experiments/benchmark.py --model PATH --quick
Only the update figure:  python experiments/benchmark.py --figures 2 --no-trl
The engine against generate, fp32 and bf16 (make engine first):  python experiments/benchmark.py --figures 5
Only the estimates (nothing loaded):  python experiments/benchmark.py --estimate [--est-live 32 ...]
A run's seconds per phase beside the estimate at its flags:  python experiments/benchmark.py --for-run RUN_DIR
The base weights are loaded unquantised on both sides (--load-in-4bit off), so that TRL and 04 run
the same model.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import importlib
import json
import math
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from accelerate import Accelerator

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import common  # noqa: E402
import options  # noqa: E402
import sampling  # noqa: E402

trainer = importlib.import_module("04_mica_train")  # the update, advantages and rewards
env = trainer.env  # 03_rollout: scenarios, judge, user, rollout


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument(
        "--model",
        default=common.PACKAGED_SMOLLM2,
        help="policy model (hub id, folder, alias or the packaged SmolLM2), as in 04_mica_train.py",
    )
    p.add_argument("--scenarios", type=int, default=4, help="scenarios of the rollout and update figures")
    p.add_argument("--k", type=int, default=4, help="dialogues per scenario (live dialogues = scenarios x k)")
    p.add_argument("--max-turns", type=int, default=3, help="assistant turns per dialogue (every dialogue runs all)")
    p.add_argument("--max-new-tokens", type=int, default=48, help="tokens of every reply (forced, both sides)")
    p.add_argument("--peer-prompts", type=int, default=4, help="prompts of the single-turn GRPO step")
    p.add_argument("--peer-k", type=int, default=4, help="GRPO group size (TRL's num_generations)")
    p.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="timed repeats of the update (alternating with the reference) and peer steps after "
        "the warm-up (the median counts)",
    )
    p.add_argument("--memory-steps", type=int, default=2, help="steps of the demo run measured for peak RSS")
    p.add_argument("--no-trl", action="store_true", help="skip the TRL comparison (figure 3)")
    p.add_argument("--no-memory", action="store_true", help="skip the demo run (figure 4's peak RSS)")
    p.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: 2 scenarios x 2, 2 turns of 8 tokens, 1 repeat, a 1-step demo run",
    )
    p.add_argument(
        "--seed",
        type=options.number(int, low=0, high=2**32 - 1),
        default=0,
        help="seed of the scenario choice and of sampling",
    )
    p.add_argument("--out-dir", default=str(ROOT / "runs" / "benchmark"), help="benchmark.md and .json go here")
    p.add_argument(
        "--figures",
        default="1,2,3,4",
        help="which figures to run, e.g. 2 (the update: its rollout then runs untimed); 5, the engine against "
        "generate, needs .venv-engine (make engine)",
    )
    p.add_argument(
        "--engine-python",
        default=str(ROOT / ".venv-engine" / "bin" / "python"),
        help="figure 5: the engine's Python (make engine), which starts engine.py's server for each --engine-dtypes",
    )
    p.add_argument("--engine-dtypes", default="float32,bfloat16", help="figure 5: the dtypes, both sides alike")
    # Memory estimate: from the shapes, nothing loaded (figure 4's tables; docs/scale.md)
    g = p.add_argument_group(
        "estimates from the shapes: memory at the --est-* budget (the one-GPU budget by default), and the "
        "seconds of a step of 04's gpu preset on an H100 and an H200"
    )
    g.add_argument("--estimate", action="store_true", help="print only the estimates and exit")
    g.add_argument(
        "--estimate-models",
        default=",".join(SHAPES),
        help=f"comma-separated: {', '.join(SHAPES)}, or folders with a config.json",
    )
    g.add_argument("--est-live", type=int, default=64, help="live dialogues of the rollout (scenarios x K)")
    g.add_argument("--est-context", type=int, default=4096, help="tokens of a dialogue at its longest")
    g.add_argument("--est-turns", type=int, default=15, help="assistant turns of a dialogue")
    g.add_argument("--est-reply", type=int, default=256, help="tokens of a reply")
    g.add_argument("--est-micro", type=int, default=2, help="dialogues per micro-batch of the update")
    g.add_argument(
        "--est-judge-rows",
        type=int,
        default=None,
        help="prompts per generate call of --judge self (default: all live dialogues in one call)",
    )
    g.add_argument(
        "--measured-gb",
        type=float,
        default=None,
        help="a measured peak (torch.cuda.max_memory_allocated, GB) to print against each estimate",
    )
    g.add_argument(
        "--for-run",
        default=None,
        metavar="RUN_DIR",
        help="print only the time estimate at the flags of this 04 run (its args.json) beside the seconds "
        "its metrics.jsonl logged per phase, and exit",
    )
    g.add_argument(
        "--measured-on", default=None, help="with --for-run: the device that run ran on (labels the measured columns)"
    )
    a = p.parse_args(argv)
    if a.quick:
        a.scenarios, a.k, a.max_turns, a.max_new_tokens = 2, 2, 2, 8
        a.peer_prompts, a.peer_k, a.repeats, a.memory_steps = 2, 2, 1, 1
    common.check(
        a.scenarios >= 1 and a.k >= 2 and a.peer_prompts >= 1 and a.peer_k >= 2,
        "--scenarios and --peer-prompts must be >= 1, --k and --peer-k >= 2",
    )
    common.check(
        a.repeats >= 1 and a.max_turns >= 1 and a.max_new_tokens >= 1,
        "--repeats, --max-turns, --max-new-tokens must be >= 1",
    )
    return a


def policy_args(a, k, max_turns, extra=()):
    """04's own flags (its defaults for everything not named here), parsed as the script parses them."""
    flags = [
        "--model",
        a.model,
        "--k",
        k,
        "--max-turns",
        max_turns,
        "--min-turns",
        max_turns,
        "--max-new-tokens",
        a.max_new_tokens,
        "--seed",
        a.seed,
        "--load-in-4bit",
        "off",
        "--no-progress",
        "--judge",
        "embed",
        "--user",
        "scripted",
        "--preset",
        "cpu",
        *extra,
    ]  # the same work on any device
    return trainer.parse_args([str(x) for x in flags])


def clock() -> float:
    if torch.cuda.is_available():
        torch.cuda.synchronize()  # GPU work queued so far counts in the timing
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
    fn_a()
    fn_b()
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
    def work(trajs):  # (turns, reply tokens)
        return sum(tr.T for tr in trajs), sum(e - s for tr in trajs for s, e in tr.spans)

    warm = copy.copy(args)
    warm.max_turns, warm.min_turns, warm.k = 1, 1, 2
    env.rollout(model, tok, scenarios[:1], judge, user, warm)  # warm-up, both loops
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
    row = {
        "figure": f"1. rollout: assistant turns/s, {len(scenarios) * args.k} live dialogues",
        "ours": f"{ours:.3g} turns/s (batched, {t_batched:.1f} s)",
        "reference": f"{ref:.3g} turns/s (one at a time, {t_alone:.1f} s)",
        "ratio": ours / ref,
        "goal": ">= 4x",
        "met": ours / ref >= 4,
        "note": f"{turns} turns / {tokens} reply tokens vs {turns_ref} / {tokens_ref}"
        + ("" if (turns, tokens) == (turns_ref, tokens_ref) else " (NOT equal work)"),
    }
    return row, batched


# ---------------------------------------------------------------------------------------------
# 5. Engine: a step's rollout (the policy, the judge, the user) sampled by vLLM vs by generate
# ---------------------------------------------------------------------------------------------
def start_engine(a, dtype: str, log: Path):
    """engine.py's server for --model in `dtype` on a free port, as `make serve` starts it -> (process, client)."""
    import socket

    import engine

    with socket.create_server(("127.0.0.1", 0)) as sock:  # a free port
        port = sock.getsockname()[1]
    argv = [a.engine_python, str(ROOT / "engine.py"), "--model", a.model, "--port", str(port), "--dtype", dtype]
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    client = engine.Engine(f"http://127.0.0.1:{port}", a.model)
    try:
        return proc, client.connect(wait=600)  # waits for the engine to load
    except common.UserError:
        raise common.UserError(f"the engine did not start in 600 s or exited: see {log}") from None


def engine_tokens(client) -> float:
    """vLLM's own count of the tokens it generated so far (its Prometheus metrics)."""
    import re

    text = client.http.get("/metrics").text
    return sum(float(x) for x in re.findall(r"^vllm:generation_tokens_total\{[^}]*\} ([0-9.e+]+)$", text, re.M))


OTHERS_MAX_CORES = 0.1  # another process's CPU use during a side beyond which figure 5 calls no ratio


def busy_ticks(pids=None) -> int:
    """CPU time in clock ticks: the whole machine's busy time (pids None: /proc/stat, all but idle and iowait), or the
    user + system time of these processes (/proc/<pid>/stat), each with its threads; a process gone counts 0."""
    if pids is None:
        cpu = [int(x) for x in open("/proc/stat").readline().split()[1:]]
        return sum(cpu) - cpu[3] - cpu[4]
    total = 0
    for pid in pids:
        try:
            fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime
    return total


def session_pids(session: int) -> list[int]:
    """The processes of a session (the engine's server and the engine core it starts)."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if int(open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()[3]) == session:
                    pids.append(int(entry))
            except OSError:
                continue
    return pids


class LoadMeter:
    """Around a timed side: the load average before and after, and the cores that processes other than this one and
    the engine's kept busy meanwhile (the machine's busy ticks less ours, over the wall time)."""

    def __init__(self, engine_session: int):
        self.session = engine_session

    def __enter__(self):
        self.load_before, self.t0 = os.getloadavg()[0], time.perf_counter()
        self.ours0 = busy_ticks([os.getpid()]) + busy_ticks(session_pids(self.session))
        self.all0 = busy_ticks()
        return self

    def __exit__(self, *exc):
        wall = time.perf_counter() - self.t0
        ours = busy_ticks([os.getpid()]) + busy_ticks(session_pids(self.session)) - self.ours0
        self.others = max(0.0, (busy_ticks() - self.all0 - ours) / os.sysconf("SC_CLK_TCK") / max(wall, 1e-9))
        self.load_after = os.getloadavg()[0]

    def note(self) -> str:
        return f"load {self.load_before:.2f} -> {self.load_after:.2f}, other processes {self.others:.2f} cores"


def bench_engine(a, scenarios, out_dir) -> list[dict]:
    """For each dtype: 03's rollout with --judge self --user self, once by generate (the policy with its LoRA, the
    judge and the user the same model's base) and once by the engine (the LoRA pushed; the judge and the user its
    base), from the same scenarios and seed, each after an untimed one-turn warm-up. The sides sample different
    tokens (different samplers), so each side's tokens are counted, by role. Each side records the machine's load
    before and after it and the cores other processes used meanwhile; above OTHERS_MAX_CORES no ratio is called
    (a figure taken beside other jobs measures the contention: generate loses far more to it than the server)."""
    import signal

    rows = []
    for dtype in [d.strip() for d in a.engine_dtypes.split(",") if d.strip()]:
        common.check(os.path.exists(a.engine_python), f"--engine-python {a.engine_python}: missing (make engine)")
        args = policy_args(a, a.k, a.max_turns, ["--scenarios-per-step", a.scenarios, "--judge", "self"])
        args.user = "self"
        torch.manual_seed(a.seed)
        model, tok = common.load_policy(args, trainable=True)
        model.to(getattr(torch, dtype))
        proc, client = start_engine(a, dtype, out_dir / f"engine-{dtype}.log")
        try:
            client.push(model, out_dir / "engine-adapter")
            sides = {}
            for side, server in (("generate", None), ("engine", client)):
                judge, user = env.make_judge(args, (model, tok), server), env.make_user(args, (model, tok), server)
                counted = {"local": 0}
                batch = sampling.generate_batch

                def counting(*x, **k):
                    replies = batch(*x, **k)
                    counted["local"] += sum(len(r.ids) for r in replies)
                    return replies

                sampling.generate_batch = counting  # the judge's and the user's tokens when generate answers
                try:
                    warm = copy.copy(args)
                    warm.max_turns = warm.min_turns = 1
                    env.rollout(model, tok, scenarios[:1], judge, user, warm, engine=server)
                    counted["local"], before = 0, engine_tokens(client)
                    torch.manual_seed(a.seed)
                    with LoadMeter(proc.pid) as load:
                        t0 = clock()
                        trajs = env.rollout(model, tok, scenarios, judge, user, args, engine=server)
                        seconds = clock() - t0
                finally:
                    sampling.generate_batch = batch
                policy = sum(e - s for tr in trajs for s, e in tr.spans)
                others = counted["local"] if server is None else engine_tokens(client) - before - policy
                sides[side] = (seconds, policy, others, load)
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(120)
        (t_gen, p_gen, o_gen, l_gen), (t_eng, p_eng, o_eng, l_eng) = sides["generate"], sides["engine"]
        idle = max(l_gen.others, l_eng.others) <= OTHERS_MAX_CORES
        rows.append(
            {
                "figure": f"5. engine, {dtype}: a step's rollout, seconds ({len(scenarios) * args.k} dialogues, "
                f"{args.max_turns} turns, judge and user self)",
                "ours": f"{t_eng:.1f} s (vLLM: {p_eng} policy + {o_eng:.0f} judge/user tokens)",
                "reference": f"{t_gen:.1f} s (generate: {p_gen} policy + {o_gen} judge/user tokens)",
                "ratio": t_eng / t_gen if idle else None,
                "goal": "reported",
                "met": None,
                "note": f"{dtype}: tokens/s all roles, engine {(p_eng + o_eng) / t_eng:.1f} vs generate "
                f"{(p_gen + o_gen) / t_gen:.1f}; the policy through the pushed LoRA; generate's side: "
                f"{l_gen.note()}; the engine's side: {l_eng.note()}"
                + ("" if idle else f"; NO RATIO: other processes used more than {OTHERS_MAX_CORES} cores"),
            }
        )
        del model
    return rows


# ---------------------------------------------------------------------------------------------
# 2. Update: one 04 optimisation step vs the bare forward + backward of the same tokens
# ---------------------------------------------------------------------------------------------
def micro_batches(trajs, args):
    """The micro-batches policy_update forms: minibatches of whole scenarios in order, each sorted by length."""
    samples, out = trainer.as_samples(trajs), []
    for j in range(0, len(trajs), args.minibatch_size):
        mb = list(range(j, min(j + args.minibatch_size, len(trajs))))
        out += [[trajs[i] for i in micro] for micro in trainer.micro_batches(samples, mb, args.micro_batch_size)]
    return out


def bare_forward_backward(model, tok, trajs, args):
    """The model's own forward with labels on the scored tokens, and backward: nothing else."""
    device = next(model.parameters()).device
    model.train()
    for micro in micro_batches(trajs, args):
        ids, attn, mask = trainer.collate(trainer.as_samples(micro), tok.pad_token_id, device)
        labels = ids.masked_fill(mask == 0, -100)
        model(input_ids=ids, attention_mask=attn, labels=labels).loss.backward()
    model.zero_grad(set_to_none=True)


def bench_update(a, model, tok, trajs, args):
    groups = {}
    for tr in trajs:
        groups.setdefault(tr.scenario["id"], []).append(tr)
    flat = [tr for g in groups.values() for tr in g]
    rewards = [[step_rewards(tr, args) for tr in g] for g in groups.values()]
    advs = [A for group in trainer.ADVANTAGES["mica"](rewards, None, args)[0] for A in group]
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=trainer.WEIGHT_DECAY)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    t_ours, t_ref = timed_pair(
        lambda: trainer.policy_update(model, tok, opt, sched, trainer.as_samples(flat, advs), args, Accelerator()),
        lambda: bare_forward_backward(model, tok, flat, args),
        a.repeats,
    )
    cells = [(len(m) * max(len(tr.ids) for tr in m), sum(len(tr.ids) for tr in m)) for m in micro_batches(flat, args)]
    padding = 1 - sum(real for _, real in cells) / sum(all_ for all_, _ in cells)
    scored = sum(s.n_tokens() for s in trainer.as_samples(flat))
    return {
        "figure": f"2. update: one 04 step vs bare forward + backward ({len(flat)} trajectories)",
        "ours": f"{t_ours:.3g} s",
        "reference": f"{t_ref:.3g} s",
        "ratio": t_ours / t_ref,
        "goal": "<= 1.3x",
        "met": t_ours / t_ref <= 1.3,
        "note": f"{scored} scored tokens, micro-batch {args.micro_batch_size}, padding {padding:.1%} "
        f"of the micro-batch cells (length-sorted within a minibatch)",
    }


# ---------------------------------------------------------------------------------------------
# 3. Peer: a single-turn GRPO step of 04 vs TRL's GRPOTrainer
# ---------------------------------------------------------------------------------------------
def step_rewards(tr, args) -> list[float]:
    """04's training reward per turn of one dialogue: its --reward parts by name, then turn_rewards."""
    return trainer.turn_rewards(trainer.reward_parts([tr], args, None)[0][0], tr, args)[0]


def ours_grpo_step(model, tok, prompts, judge, user, args, opt, sched):
    # 1. rollout (one turn)  2. IDR rewards  3. GRPO advantages  4. the update
    trajs = env.rollout(model, tok, prompts, judge, user, args)
    groups = [[tr for tr in trajs if tr.scenario is s] for s in prompts]
    rewards = [[step_rewards(tr, args) for tr in g] for g in groups]
    advs = [A for group in trainer.ADVANTAGES["grpo"](rewards, None, args)[0] for A in group]
    return trainer.policy_update(
        model, tok, opt, sched, trainer.as_samples([tr for g in groups for tr in g], advs), args, Accelerator()
    )


def trl_grpo_seconds(a, prompts, judge, args, out_dir) -> tuple[float | None, str]:
    """Median seconds of one GRPOTrainer optimisation step (after one warm-up step), or None and why."""
    try:
        from datasets import Dataset
        from peft import LoraConfig
        from transformers import AutoModelForCausalLM, TrainerCallback
        from trl import GRPOConfig, GRPOTrainer
    except ImportError as e:
        return None, f"not installed (no module {e.name}): pip install trl==1.16.0"

    class StepTimer(TrainerCallback):  # on_step_begin .. on_step_end spans generation + update
        times = []

        def on_step_begin(self, *args, **kw):
            self.t0 = clock()

        def on_step_end(self, *args, **kw):
            self.times.append(clock() - self.t0)

    by_id = {s["id"]: s for s in prompts}

    def judge_reward(prompts, completions, scenario_id, **_):
        # the same judge and reward as 04's single turn: IDR r = d(P0) - d(P0 + v)
        cases = [
            {"scenario": by_id[i], "history": p, "reply": c[0]["content"].strip()}
            for p, c, i in zip(prompts, completions, scenario_id)
        ]
        rewards = []
        for case, verdict in zip(cases, judge.judge(cases)):
            P0 = case["scenario"]["p0"]
            v = env.levels_to_v(verdict["levels"]) if verdict else [0.0, 0.0, 0.0]
            P1 = [p + x for p, x in zip(P0, v)]
            rewards.append(env.incremental_distance_rewards([P0, P1], args.idr_weights, env.EPS)[0])
        return rewards

    path = common.resolve_model(a.model)
    cuda = torch.cuda.is_available()
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.bfloat16 if cuda else torch.float32, attn_implementation="sdpa"
    )  # as common.load_policy picks
    data = Dataset.from_list(
        [
            {
                "prompt": [
                    {"role": "system", "content": trainer.env.PROMPTS["policy_system"]},
                    {"role": "user", "content": s["opening"]},
                ],
                "scenario_id": s["id"],
            }
            for s in prompts
        ]
    )
    n = len(prompts) * args.k
    config = GRPOConfig(
        output_dir=str(out_dir / "trl"),
        per_device_train_batch_size=args.micro_batch_size,
        gradient_accumulation_steps=n // args.micro_batch_size,
        num_generations=args.k,
        max_completion_length=args.max_new_tokens,
        generation_kwargs={"min_new_tokens": args.max_new_tokens},
        temperature=args.temperature,
        top_p=args.top_p,
        max_steps=1 + a.repeats,
        learning_rate=args.lr,
        weight_decay=trainer.WEIGHT_DECAY,
        lr_scheduler_type="constant",
        warmup_steps=0,
        max_grad_norm=trainer.MAX_GRAD_NORM,
        beta=0.0,
        epsilon=trainer.CLIP_LOW,
        epsilon_high=trainer.CLIP_HIGH,
        num_iterations=1,
        loss_type="dapo",
        scale_rewards="group",
        gradient_checkpointing=args.gradient_checkpointing,
        bf16=cuda,
        use_cpu=not cuda,
        shuffle_dataset=False,
        seed=a.seed,
        report_to="none",
        logging_steps=10_000,
        save_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    lora = LoraConfig(
        r=common.LORA_R,
        lora_alpha=common.LORA_ALPHA,
        lora_dropout=0.0,  # as common.load_policy
        target_modules=args.lora_targets.split(","),
        task_type="CAUSAL_LM",
    )
    timer = StepTimer()
    trl_trainer = GRPOTrainer(
        model=model,
        reward_funcs=judge_reward,
        args=config,
        train_dataset=data,
        processing_class=common.load_tokenizer(path),
        peft_config=lora,
        callbacks=[timer],
    )
    trl_trainer.train()
    times = timer.times[1:]  # step 1 is the warm-up
    return statistics.median(times), f"GRPOTrainer, trl {importlib.import_module('trl').__version__}"


def bench_peer(a, model, tok, scenarios, judge, user, out_dir):
    args = policy_args(a, a.peer_k, 1, ["--advantage", "grpo"])
    prompts = scenarios[: a.peer_prompts]
    if len(prompts) * args.k % args.micro_batch_size:
        args.micro_batch_size = 1  # TRL needs the completions to split into equal micro-batches
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=trainer.WEIGHT_DECAY)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    torch.manual_seed(a.seed)
    t_ours, _ = timed(lambda: ours_grpo_step(model, tok, prompts, judge, user, args, opt, sched), a.repeats)
    row = {
        "figure": f"3. peer: single-turn GRPO step, {len(prompts)} prompts x {args.k}, {args.max_new_tokens} tokens",
        "ours": f"{t_ours:.3g} s",
        "goal": "<= 1.0x",
    }
    t_trl, what = (None, "skipped (--no-trl)") if a.no_trl else trl_grpo_seconds(a, prompts, judge, args, out_dir)
    if t_trl is None:
        return {**row, "reference": f"n/a: {what}", "ratio": None, "met": None, "note": what}
    return {
        **row,
        "reference": f"{t_trl:.3g} s",
        "ratio": t_ours / t_trl,
        "met": t_ours / t_trl <= 1.0,
        "note": f"{what}; micro-batch {args.micro_batch_size}, beta 0, one epoch, dapo token-mean loss",
    }


# ---------------------------------------------------------------------------------------------
# 4. Memory: peak RSS of the demo run, and the QLoRA estimate for Qwen2.5-7B-Instruct
# ---------------------------------------------------------------------------------------------
def bench_memory(a, out_dir):
    cmd = [
        sys.executable,
        str(ROOT / "04_mica_train.py"),
        "--model",
        a.model,
        "--steps",
        str(a.memory_steps),
        "--out-dir",
        str(out_dir / "demo"),
        "--run-name",
        "demo",
        "--no-progress",
        "--save-every",
        "1000",
    ]
    if a.quick:
        cmd += ["--scenarios-per-step", "2", "--k", "2", "--max-turns", "2", "--max-new-tokens", "8"]
    t0 = time.time()
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    common.check(p.returncode == 0, f"the demo run failed: {' '.join(cmd)}\n{p.stderr[-2000:]}")
    run = max((out_dir / "demo").glob("demo-*"), key=lambda d: d.stat().st_mtime)
    peak = max(json.loads(x)["peak_rss_gb"] for x in (run / "metrics.jsonl").read_text().splitlines())
    return {
        "figure": f"4. memory: peak RSS of the demo run (first {a.memory_steps} steps of `make demo`)",
        "ours": f"{peak:.2f} GB",
        "reference": "-",
        "ratio": None,
        "goal": "report",
        "met": None,
        "note": f"{' '.join(cmd[1:])} ({time.time() - t0:.0f} s)",
    }


# Shapes from each model's config.json (the hub ids Qwen/Qwen2.5-7B-Instruct and Qwen/Qwen3-8B; SmolLM2: the
# packaged one, common.resolve_model('SmolLM2-135M-Instruct')/config.json). Any other model: --estimate-models PATH.
SHAPES = {
    "SmolLM2-135M-Instruct": dict(
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        vocab_size=49152,
        tie_word_embeddings=True,
    ),
    "Qwen2.5-7B-Instruct": dict(
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        vocab_size=152064,
        tie_word_embeddings=False,
    ),
    "Qwen3-8B": dict(
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
        tie_word_embeddings=False,
    ),
}
JUDGE_PROMPT_TOKENS = 400  # what 03's JUDGE_PROMPT adds around the dialogue (instructions, persona, situation)
USER_MESSAGE_TOKENS = 128  # 03's LLM user answers in at most 120 tokens: what a later turn prefills per dialogue
NF4_BYTES = 0.5 + 1 / 64 + 4 / (64 * 256)  # a 4-bit weight: 4 bits + 8-bit absmax per 64 + fp32 per 256 absmax


def model_shapes(cfg: dict) -> dict:
    """The sizes the estimate needs, from a config.json's fields: hidden h, intermediate i, layers L,
    query heads nh of dim hd (q = nh x hd), KV width kv = KV heads x hd, vocabulary V, tied head or not."""
    h, nh = cfg["hidden_size"], cfg["num_attention_heads"]
    hd = cfg.get("head_dim") or h // nh
    return dict(
        h=h,
        i=cfg["intermediate_size"],
        L=cfg["num_hidden_layers"],
        nh=nh,
        hd=hd,
        q=nh * hd,
        kv=cfg.get("num_key_value_heads", nh) * hd,
        V=cfg["vocab_size"],
        tied=bool(cfg.get("tie_word_embeddings", False)),
    )


def linear_shapes(s: dict) -> dict:
    """(in, out) of the 7 linear layers of one decoder layer: what NF4 quantises and LoRA adapts."""
    h, i, q, kv = s["h"], s["i"], s["q"], s["kv"]
    return {
        "q_proj": (h, q),
        "k_proj": (h, kv),
        "v_proj": (h, kv),
        "o_proj": (q, h),
        "gate_proj": (h, i),
        "up_proj": (h, i),
        "down_proj": (i, h),
    }


def param_counts(s: dict, r: int) -> tuple[int, int, int]:
    """Parameters of the linear layers (quantised), of LoRA r on all of them (A: r x in, B: out x r),
    and of the embeddings plus an untied LM head (norms and biases, under 0.1%, are left out)."""
    linear = linear_shapes(s).values()
    return (
        s["L"] * sum(fi * fo for fi, fo in linear),
        s["L"] * sum(r * (fi + fo) for fi, fo in linear),
        (1 if s["tied"] else 2) * s["V"] * s["h"],
    )


def layer_saved_bytes(s: dict, r: int, act: int = 2, bnb: bool = True, repeat_kv: bool = True) -> int:
    """Bytes per token that one decoder layer (LoRA r on its 7 linear layers, frozen base) keeps for its
    backward pass: the layer that gradient checkpointing recomputes. Counted from what autograd saves
    (tests/test_benchmark.py checks the count against torch's saved tensors on the CPU, bnb=False):
      - each RMSNorm: its input in fp32 and the rsqrt, 4h + 4, twice;
      - each LoRA layer: its input cast to fp32 (peft casts it to the LoRA weights' dtype; q, k and v
        each make their own copy) and the r-wide output of A: 4 x (5h + q + i) + 7 x 4r. In fp32
        (act 4) the cast is a no-op, so q, k, v share one input: 4 x (2h + q + i);
      - rotary cos and sin, 2 hd x act; attention (sdpa's flash / memory-efficient kernels): q, k, v and
        the output, act x (2q + 2 kv), k and v repeated to q's width when a padding mask turns GQA off
        (repeat_kv), and the fp32 logsumexp per head, 4 nh;
      - the MLP: gate, silu(gate) and up, 3i x act;
      - bitsandbytes' 4-bit matmul keeps each distinct input (attention, o, MLP, down) in bf16:
        act x (2h + q + i) (bnb; in fp32 these are the LoRA copies already counted)."""
    h, i, q, kv, hd, nh = s["h"], s["i"], s["q"], s["kv"], s["hd"], s["nh"]
    norms = 2 * (4 * h + 4)
    lora = 4 * (5 * h + q + i) if act == 2 else 4 * (2 * h + q + i)
    attention = 2 * hd * act + act * (2 * q + 2 * (q if repeat_kv else kv)) + 4 * nh
    mlp = 3 * i * act
    base_inputs = act * (2 * h + q + i) if bnb and act == 2 else 0
    return norms + lora + 7 * 4 * r + attention + mlp + base_inputs


def memory_estimate(
    s: dict,
    r: int = 16,
    act: int = 2,
    live: int = 64,
    context: int = 4096,
    turns: int = 15,
    reply: int = 256,
    micro: int = 2,
    judge_rows: int | None = None,
) -> list[tuple]:
    """QLoRA training on one GPU, per component: (component, formula, bytes, phase). act: bytes of an
    activation, 2 now (bf16: common.cast_for_kbit_training), 4 before it (prepare_model_for_kbit_training
    left embeddings, head and norms in fp32, so the residual stream, activations and KV cache were fp32).
    A micro-batch is `micro` dialogues of `context` tokens, turns x reply of each scored; the rollout holds
    `live` dialogues' KV cache of `context` tokens; a later turn prefills a user message per dialogue.
    With --judge self / --user self the base model judges while that cache is held: one generate call
    of judge_rows prompts (None: all live dialogues at once) of the dialogue plus JUDGE_PROMPT_TOKENS.
    phase: always, update, rollout, self (the self judge's call)."""
    h, i, L, kv, V = s["h"], s["i"], s["L"], s["kv"], s["V"]
    n_linear, n_lora, n_emb = param_counts(s, r)
    nf4 = NF4_BYTES
    tokens, scored = micro * context, micro * min(turns * reply, context)
    chunk = min(scored, sampling.LOGIT_CHUNK // V)  # sampling.token_logprobs runs the LM head in chunks of rows
    per_kv = 2 * L * kv * act  # K and V of every layer, per token
    prefill = live * USER_MESSAGE_TOKENS
    rows = judge_rows or live
    judge_tokens = rows * (context + JUDGE_PROMPT_TOKENS)
    a = "bf16" if act == 2 else "fp32"
    return [
        ("base weights, NF4 linear layers", f"{n_linear / 1e9:.3g}e9 x {nf4:.4f} bytes", n_linear * nf4, "always"),
        (
            f"base weights, embeddings{'' if s['tied'] else ' + LM head'} ({a})",
            f"{n_emb / 1e6:.4g}e6 x {act} bytes",
            n_emb * act,
            "always",
        ),
        ("LoRA weights + gradients (fp32)", f"{n_lora / 1e6:.3g}e6 x (4 + 4) bytes", n_lora * 8, "always"),
        (
            "AdamW moments m, v (fp32; the fp32 LoRA weights are their own master copy)",
            f"{n_lora / 1e6:.3g}e6 x 8 bytes",
            n_lora * 8,
            "always",
        ),
        (
            f"update: one {a} hidden state per layer boundary (gradient checkpointing)",
            f"{tokens} tokens x L x h x {act}",
            tokens * L * h * act,
            "update",
        ),
        (
            "update: the layer recomputed in backward (layer_saved_bytes)",
            f"{tokens} tokens x {layer_saved_bytes(s, r, act)} bytes",
            tokens * layer_saved_bytes(s, r, act),
            "update",
        ),
        (
            f"update: one chunk of logits, {a} + fp32 + its fp32 gradient (all {scored} scored at once: "
            f"{scored * V * (act + 8) / 1e9:.2g} GB)",
            f"{chunk} rows x V x ({act} + 4 + 4)",
            chunk * V * (act + 8),
            "update",
        ),
        (
            f"rollout: KV cache ({a}), {live} dialogues",
            f"{live} x {context} tokens x {per_kv / 1e3:.4g} KB",
            live * context * per_kv,
            "rollout",
        ),
        (
            "rollout: one layer's MLP intermediates (gate, up, product) for a turn's prefill",
            f"{prefill} tokens x 3i x {act}",
            prefill * 3 * i * act,
            "rollout",
        ),
        (
            "--judge self: the policy's KV cache, held while the base judges",
            "as the rollout's",
            live * context * per_kv,
            "self",
        ),
        (
            f"--judge self: KV cache of one judge call, {rows} prompts",
            f"{judge_tokens} tokens x {per_kv / 1e3:.4g} KB",
            judge_tokens * per_kv,
            "self",
        ),
        (
            "--judge self: one layer's MLP intermediates for that call's prefill",
            f"{judge_tokens} tokens x 3i x {act}",
            judge_tokens * 3 * i * act,
            "self",
        ),
    ]


def estimate_peaks(rows) -> dict:
    """GB per phase, and the peaks: a served judge (api:) and --judge self (the base judges in the rollout)."""
    gb = {w: sum(b for _, _, b, when in rows if when == w) / 1e9 for w in ("always", "update", "rollout", "self")}
    return {
        **gb,
        "peak_api": gb["always"] + max(gb["update"], gb["rollout"]),
        "peak_self": gb["always"] + max(gb["update"], gb["rollout"], gb["self"]),
    }


def budget(a) -> dict:
    """memory_estimate's run settings from the --est-* flags."""
    return dict(
        r=16,
        live=a.est_live,
        context=a.est_context,
        turns=a.est_turns,
        reply=a.est_reply,
        micro=a.est_micro,
        judge_rows=a.est_judge_rows,
    )


def estimate_table(name: str, cfg: dict, a) -> str:
    """The markdown table of one model's estimate, bf16 (now) next to fp32 (before the cast)."""
    s = model_shapes(cfg)
    now, before = memory_estimate(s, act=2, **budget(a)), memory_estimate(s, act=4, **budget(a))
    n_lora = param_counts(s, 16)[1]
    lines = [
        f"### {name}: h {s['h']}, i {s['i']}, L {s['L']}, {s['nh']} query / {s['kv'] // s['hd']} KV heads of "
        f"{s['hd']}, V {s['V']}{', tied head' if s['tied'] else ''}; LoRA r=16 on all 7 linear layers "
        f"({n_lora / 1e6:.1f} M parameters); {a.est_live} live dialogues of {a.est_context} tokens, "
        f"{a.est_turns} turns x {a.est_reply} tokens, micro-batch {a.est_micro}",
        "",
        "| component | formula (bf16) | GB, bf16 (now) | GB, fp32 (before) | held |",
        "|---|---|---|---|---|",
    ]
    lines += [
        f"| {c} | {f} | {b / 1e9:.2f} | {b0 / 1e9:.2f} | {w} |" for (c, f, b, w), (_, _, b0, _) in zip(now, before)
    ]
    p, p0 = estimate_peaks(now), estimate_peaks(before)
    lines += [
        f"| **peak, served judge (api:)**: always + max(update, rollout) | {p['always']:.1f} + "
        f"max({p['update']:.1f}, {p['rollout']:.1f}) | **{p['peak_api']:.1f}** | {p0['peak_api']:.1f} | |",
        f"| **peak, --judge self**: always + max(update, rollout, self) | {p['always']:.1f} + "
        f"max({p['update']:.1f}, {p['rollout']:.1f}, {p['self']:.1f}) | **{p['peak_self']:.1f}** | "
        f"{p0['peak_self']:.1f} | |",
    ]
    return "\n".join(lines)


def estimate_report(a) -> str:
    """The estimate tables of --estimate-models (names in SHAPES, or folders with a config.json), and,
    with --measured-gb, the measured peak against each model's estimate."""
    out = []
    for name in [m.strip() for m in a.estimate_models.split(",") if m.strip()]:
        cfg = model_config(name, "--estimate-models")
        out.append(estimate_table(name, cfg, a))
        if a.measured_gb is not None:
            p = estimate_peaks(memory_estimate(model_shapes(cfg), **budget(a)))
            out.append(
                f"measured peak {a.measured_gb:.2f} GB (torch.cuda.max_memory_allocated) vs the estimate "
                f"{p['peak_self']:.2f} GB with --judge self ({a.measured_gb / p['peak_self']:.2f}x), "
                f"{p['peak_api']:.2f} GB with a served judge"
            )
        preset = trainer.parse_args(["--model", name, "--preset", "gpu"])  # 04's gpu preset, as a GPU runs it
        out.append(
            time_table(name, cfg, preset, f"04's gpu preset (`python 04_mica_train.py --model {name}` on a GPU)")
        )
        out.append(time_table(name, cfg, engine_args(name), "04's gpu preset with `--engine` (vLLM)") + ENGINE_NOTE)
    return "\n\n".join(out)


def engine_args(name: str):
    """04's gpu preset with --engine, as the estimate counts it: the learner's weights in bf16 (--load-in-4bit auto
    is off with an engine), and the engine batching every live dialogue's judge and user request at once
    (continuous batching), where generate answers them in calls of --judge/--user-concurrency rows."""
    args = trainer.parse_args(["--model", name, "--preset", "gpu", "--engine", "http://engine:8000"])
    args.load_in_4bit = "off"
    args.judge_concurrency = args.user_concurrency = args.scenarios_per_step * args.k
    return args


ENGINE_NOTE = (
    "\n\nWith `--engine` the same tokens are decoded at the same datasheet peaks, so the roofline shows only what "
    "changes in the work: bf16 weights read instead of 4-bit ones dequantised, and the judge's and the user's "
    "requests of all live dialogues decoded as one batch. What an engine gains beyond that, its kernels, its "
    "paged KV cache and no Python between decode steps (where `generate` loses most against its roofline), is "
    "not in an estimate of this kind: the first lent GPU measures it (`scripts/gpu_check.sh`, step 4)."
)


def preset_step_seconds(name: str) -> dict[str, float]:
    """Seconds of one step of 04's gpu preset for a model of SHAPES, on each of GPUS (time_table's totals)."""
    args = trainer.parse_args(["--model", name, "--preset", "gpu"])
    return {g: sum(v) for g, v in seconds_by_gpu(step_phases(model_shapes(SHAPES[name]), args)[0]).items()}


def model_config(name: str, flag: str) -> dict:
    """A model's config fields: SHAPES[name], a folder's config.json, or SHAPES by a hub id's name
    (Qwen/Qwen2.5-7B-Instruct); else one line naming `flag`."""
    path = Path(name) / "config.json"
    if name in SHAPES or not path.exists() and name.rsplit("/", 1)[-1] in SHAPES:
        return SHAPES[name.rsplit("/", 1)[-1]]
    common.check(
        path.exists(),
        f"{flag}: {name} is neither one of {', '.join(SHAPES)} (or its hub id) nor a folder with a config.json",
    )
    return json.loads(path.read_text())


# ---------------------------------------------------------------------------------------------
# Time: the seconds of one 04 step from the shapes and 04's flags (docs/scale.md), nothing loaded
# ---------------------------------------------------------------------------------------------
# Datasheet peaks of the SXM boards: (HBM bandwidth, bytes/s; dense bf16 Tensor Core FLOP/s). NVIDIA's datasheets
# give bf16 "with sparsity", 1,979 TFLOPS on both; dense is half. The H200 is the H100's chip with more, faster HBM.
GPUS = {
    "H100": (3.35e12, 989e12),  # NVIDIA H100 Tensor Core GPU datasheet, H100 SXM: 80 GB HBM3 at 3.35 TB/s
    "H200": (4.8e12, 989e12),  # NVIDIA H200 Tensor Core GPU datasheet, H200 SXM: 141 GB HBM3e at 4.8 TB/s
}
# Prompt sizes in tokens, counted with the packaged SmolLM2's tokenizer and chat template over the 24 scenarios of
# data/scenarios_train.jsonl (JUDGE_PROMPT_TOKENS, above, counted so: 389-411)
OPENING_TOKENS = 107  # the policy's system prompt and a scenario's opening: a dialogue's first context (99-119)
USER_SYSTEM_TOKENS = 205  # 03's USER_PROMPT with a persona, situation and band: the LLM user's system prompt (194-216)
JUDGE_MAX_TOKENS, USER_MAX_TOKENS = 200, 120  # max_tokens of 03's LLMJudge.judge and LLMUser.reply


def kv_bytes(s: dict) -> int:
    """Bytes of one token's KV cache in bf16: K and V of every layer."""
    return 2 * s["L"] * s["kv"] * 2


def weight_bytes(s: dict, n_lora: int, rows: int, four_bit: bool, adapter: bool) -> float:
    """Bytes that one forward moves to use the weights, its matmuls `rows` rows (tokens) tall. 4-bit:
    bitsandbytes 0.50.2 (requirements.txt) multiplies up to 4 rows with its fused kernel, which reads the NF4
    bytes only; for more rows its dispatch (_gemm_4bit_use_custom_cuda) picks per shape and GPU, and on an H100
    or H200 it dequantises each of a 7B's weights at 64 rows, and its q, o and down projections at 8: the
    weight written out in bf16 and read back by F.linear, NF4 + 2 + 2 bytes a weight. Counted so for every
    weight above 4 rows (at 8 rows, up to twice the bytes that dispatch moves). Without 4-bit: 2 bytes (bf16).
    Plus the LM head in bf16 and, with the adapter on, the fp32 LoRA weights."""
    n_linear = param_counts(s, 0)[0]
    base = (NF4_BYTES if rows <= 4 else NF4_BYTES + 2 + 2) if four_bit else 2
    return n_linear * base + 2 * s["V"] * s["h"] + (4 * n_lora if adapter else 0)


def prefill_work(s: dict, n_params: int, w, calls: list[int], prompt: float, past: float) -> tuple[float, float]:
    """(FLOPs, bytes) of prefilling `prompt` new tokens in every row on top of `past` cached ones, in generate
    calls of calls[j] rows.
      FLOPs = 2 x n_params x rows x prompt                     every new token through the matmuls
            + 4 x L x q x rows x (prompt x past + prompt^2 / 2)  attention: Q K^T and A V, 2 x 2 x q FLOPs a
                                                               (query, key) pair a layer; causal among the new
      bytes = sum over calls of w(rows x prompt)               one pass over the weights a call
            + rows x (past + prompt) x kv_bytes                the cache read and written once
    (the LM head runs on the last position only: left out)."""
    rows = sum(calls)
    pairs = rows * (prompt * past + prompt**2 / 2)
    flops = 2 * n_params * rows * prompt + 4 * s["L"] * s["q"] * pairs
    return flops, sum(w(c * prompt) for c in calls) + rows * (past + prompt) * kv_bytes(s)


def decode_work(s: dict, n_params: int, w, calls: list[int], context: float, new: int) -> tuple[float, float]:
    """(FLOPs, bytes) of sampling `new` tokens in every row after `context` tokens, in generate calls of
    calls[j] rows: each token one forward of all the rows of its call (the first from the prefill's last
    position, counted here), the j-th new token attending context + j keys.
      FLOPs = 2 x (n_params + V x h) x rows x new               the matmuls and the LM head
            + 4 x L x q x rows x (new x context + new (new - 1) / 2)   attention
      bytes = new x sum over calls of w(rows of the call)      batched: one read of the weights serves a call's rows
            + rows x (new x context + new (new - 1) / 2) x kv_bytes    every row's cache, read every step"""
    rows = sum(calls)
    pairs = rows * (new * context + new * (new - 1) / 2)
    flops = 2 * (n_params + s["V"] * s["h"]) * rows * new + 4 * s["L"] * s["q"] * pairs
    return flops, new * sum(w(c) for c in calls) + pairs * kv_bytes(s)


def train_work(s, n_linear, n_lora, w, micros: list[int], tokens, scored, adapter=True, grad=True, checkpointing=True):
    """(FLOPs, bytes) of the update's passes over micro-batches of micros[j] dialogues, each `tokens` long with
    `scored` of them scored (sampling.token_logprobs runs the LM head on those only).
      forward  = 2 x (n_linear [+ n_lora, adapter on]) x tokens      the matmuls
               + 4 x L x q x tokens^2 / 2                             causal attention, a dialogue
               + 2 x V x h x scored                                   the LM head
    grad=False (old and reference log-probs): the forward. grad=True adds
      recompute  gradient checkpointing: the decoder's forward again in backward (and the LM head's, which
                 token_logprobs checkpoints in chunks when a micro-batch scores more than LOGIT_CHUNK / V tokens)
      backward   the base is frozen, so each of its matmuls computes only its input's gradient dX = dY W^T: the
                 forward's FLOPs once more (bitsandbytes' MatMul4Bit.backward computes no weight gradient);
                 LoRA's A and B get dX and dW, 2 x their forward; attention's backward, 2 x its forward
    so a frozen weight costs 2 + 2 + 2 = 6 FLOPs a token (forward, recompute, dX), attention 4 x its forward.
      bytes      one pass over the weights (w at the micro-batch's tokens) a forward, recompute and backward
    (activations' traffic left out: these passes are bound by compute)."""
    n, d = sum(micros) * tokens, sum(micros)  # tokens, dialogues
    mat = 2 * (n_linear + (n_lora if adapter else 0)) * n
    att = 4 * s["L"] * s["q"] * d * tokens**2 / 2
    head = 2 * s["V"] * s["h"] * d * scored
    passes = [w(m * tokens) for m in micros]
    if not grad:
        return mat + att + head, sum(passes)
    head_again = any(m * scored > sampling.LOGIT_CHUNK // s["V"] for m in micros)
    recompute = (mat + att + (head if head_again else 0)) if checkpointing else 0
    backward = 2 * n_linear * n + 2 * 2 * n_lora * n + 2 * att + head
    return mat + att + head + recompute + backward, (3 if checkpointing else 2) * sum(passes)


def assumed_turns(args) -> int:
    """The turns every dialogue runs in the estimate: the middle of --min-turns..--max-turns (rounded up), or
    fewer where --max-context holds fewer at full replies: turn t starts from c_t = OPENING_TOKENS + (t - 1) x
    (reply + USER_MESSAGE_TOKENS) tokens and needs room for a whole reply, c_t + reply <= --max-context."""
    reply = args.max_new_tokens
    middle = math.ceil((min(args.min_turns, args.max_turns) + args.max_turns) / 2)
    fit = 1 + max(0, (args.max_context - OPENING_TOKENS - reply) // (reply + USER_MESSAGE_TOKENS))
    return min(middle, fit)


def batches(n: int, size: int) -> list[int]:
    """n rows in groups of at most `size`: [size, size, ..., the rest]."""
    return [min(size, n - j) for j in range(0, n, size)]


def step_phases(s: dict, args, log_kl: bool = False) -> tuple[list[tuple], dict]:
    """The work of one step of 04 at its flags `args` (04's parse_args, or a run's args.json), one process:
    [(group, phase, FLOPs, bytes, note)], group rollout or update (the rewards add nothing: the judge's
    verdicts come with the rollout; CARE's and Kardia's calls are not estimated), and the sizes assumed. Every
    dialogue runs T = assumed_turns turns, every reply --max-new-tokens long, every user message
    USER_MESSAGE_TOKENS; a batch decodes until its longest answer ends, so the judge and the user are counted
    at their caps (JUDGE_MAX_TOKENS, USER_MAX_TOKENS) too. log_kl: the step also logs the KL to the base."""
    S, K, R, U = args.scenarios_per_step, args.k, args.max_new_tokens, USER_MESSAGE_TOKENS
    B, T = S * K, assumed_turns(args)
    four_bit = args.load_in_4bit != "off"  # auto: 4-bit with CUDA, the machine the estimate is for
    n_linear = param_counts(s, 0)[0]
    targets = set(args.lora_targets.split(","))
    n_lora = s["L"] * sum(common.LORA_R * (fi + fo) for m, (fi, fo) in linear_shapes(s).items() if m in targets)

    def w_policy(rows):  # the policy's forward: the adapter on
        return weight_bytes(s, n_lora, rows, four_bit, adapter=True)

    def w_base(rows):  # --judge self, --user self and the reference: the frozen base, the adapter off
        return weight_bytes(s, n_lora, rows, four_bit, adapter=False)

    def context(t):  # tokens before reply t: the opening, then (reply + user message) a turn
        return OPENING_TOKENS + (t - 1) * (R + U)

    work = {}  # phase -> [FLOPs, bytes], summed over the turns

    def add(phase, fb):
        work.setdefault(phase, [0.0, 0.0])
        work[phase][0] += fb[0]
        work[phase][1] += fb[1]

    rows = {
        "judge": args.judge_concurrency or args.api_concurrency,
        "user": args.user_concurrency or args.api_concurrency,
    }
    for t in range(1, T + 1):
        # 1. the policy: turn 1 prefills each scenario's opening once (its K rows share it), a later turn the
        # user's new message on top of the kept cache; then R tokens for all B dialogues in one call
        if t == 1:
            add("policy prefill", prefill_work(s, n_linear + n_lora, w_policy, [S], OPENING_TOKENS, 0))
        else:
            add("policy prefill", prefill_work(s, n_linear + n_lora, w_policy, [B], U, context(t) - U))
        add("policy decode", decode_work(s, n_linear + n_lora, w_policy, [B], context(t), R))
        # 2. --judge self: every dialogue's whole transcript (no cache kept), calls of --judge-concurrency rows
        if args.judge == "self":
            prompt = context(t) + R + JUDGE_PROMPT_TOKENS
            add("judge prefill", prefill_work(s, n_linear, w_base, batches(B, rows["judge"]), prompt, 0))
            add("judge decode", decode_work(s, n_linear, w_base, batches(B, rows["judge"]), prompt, JUDGE_MAX_TOKENS))
        # 3. --user self: after every turn but the last, the same, in calls of --user-concurrency rows
        if args.user == "self" and t < T:
            prompt = context(t) + R + USER_SYSTEM_TOKENS
            add("user prefill", prefill_work(s, n_linear, w_base, batches(B, rows["user"]), prompt, 0))
            add("user decode", decode_work(s, n_linear, w_base, batches(B, rows["user"]), prompt, USER_MAX_TOKENS))
    # 4. the update: minibatches of --minibatch-size dialogues (whole scenarios), micro-batches of
    # --micro-batch-size; each dialogue its whole context(T) + R tokens, T x R scored
    tokens, scored = context(T) + R, T * R
    minibatches = batches(B, args.minibatch_size)
    micros = [m for mb in minibatches for m in batches(mb, args.micro_batch_size)]
    old_from = 1 if args.update_epochs == 1 else 0  # the first minibatch of one epoch needs no old log-probs
    old = [m for mb in minibatches[old_from:] for m in batches(mb, args.micro_batch_size)]
    if old:
        add("old log-probs", train_work(s, n_linear, n_lora, w_policy, old, tokens, scored, grad=False))
    if args.kl_coef > 0 or log_kl:
        ref = train_work(s, n_linear, n_lora, w_base, micros, tokens, scored, adapter=False, grad=False)
        add("reference log-probs", ref)
    fb = train_work(s, n_linear, n_lora, w_policy, micros, tokens, scored, checkpointing=args.gradient_checkpointing)
    add("forward + backward", [x * args.update_epochs for x in fb])
    notes = {
        "policy prefill": f"turn 1: {S} openings of {OPENING_TOKENS}; then {B} x {U} new tokens a turn",
        "policy decode": f"{B} rows x {T} turns x {R} tokens, one call a turn",
        "judge prefill": f"{B} prompts of dialogue + {JUDGE_PROMPT_TOKENS} a turn, {rows['judge']} a call",
        "judge decode": f"{JUDGE_MAX_TOKENS} tokens x {len(batches(B, rows['judge']))} calls a turn",
        "user prefill": f"{B} prompts of dialogue + {USER_SYSTEM_TOKENS} a turn but the last, {rows['user']} a call",
        "user decode": f"{USER_MAX_TOKENS} tokens x {len(batches(B, rows['user']))} calls a turn",
        "old log-probs": f"{sum(old)} dialogues, no gradient",
        "reference log-probs": f"{B} dialogues, adapter off",
        "forward + backward": f"{B} dialogues of {tokens} tokens, {scored} scored; {len(micros)} micro-batches"
        + (", checkpointed" if args.gradient_checkpointing else ""),
    }
    group = {"old log-probs": "update", "reference log-probs": "update", "forward + backward": "update"}
    phases = [(group.get(p, "rollout"), p, f, b, notes[p]) for p, (f, b) in work.items()]
    forwards = {  # decode forwards: one a token of a generate call
        "policy": T * R,
        "judge": T * len(batches(B, rows["judge"])) * JUDGE_MAX_TOKENS if args.judge == "self" else 0,
        "user": (T - 1) * len(batches(B, rows["user"])) * USER_MAX_TOKENS if args.user == "self" else 0,
    }
    sizes = dict(T=T, B=B, tokens=tokens, scored=B * scored, four_bit=four_bit, n_lora=n_lora, forwards=forwards)
    return phases, sizes


def phase_seconds(flops: float, nbytes: float, gpu: tuple[float, float]) -> float:
    """Seconds at a GPU's datasheet peaks (bandwidth, FLOP/s): the larger of the memory time and the compute
    time (a roofline: no efficiency factor, no kernel-launch or Python overhead)."""
    bandwidth, peak = gpu
    return max(nbytes / bandwidth, flops / peak)


def num(x: float) -> str:
    """3 significant digits, or whole numbers with thousands separators from 100 on."""
    return f"{x:,.0f}" if x >= 100 else f"{x:.3g}"


def seconds_by_gpu(phases) -> dict[str, list[float]]:
    """Each phase's seconds on each of GPUS."""
    return {g: [phase_seconds(f, b, GPUS[g]) for _, _, f, b, _ in phases] for g in GPUS}


def group_seconds(phases, secs: list[float]) -> dict[str, float]:
    """Seconds of the rollout and of the update (the phases' groups; the rewards need none: the judge's verdicts
    come with the rollout)."""
    return {g: sum(x for p, x in zip(phases, secs) if p[0] == g) for g in ("rollout", "update")}


def time_assumptions(args, z: dict) -> list[str]:
    """What the estimate assumes and leaves out, in a few lines."""
    left = [
        f"--{who} {spec} (not the policy's base: not estimated)"
        for who, spec in (("judge", args.judge), ("user", args.user))
        if spec != "self"
    ]
    return [
        f"- every dialogue runs T = {z['T']} turns (the middle of --min-turns "
        f"{min(args.min_turns, args.max_turns)} .. --max-turns {args.max_turns}, or what --max-context "
        f"{args.max_context} holds at full replies), replies of "
        f"{args.max_new_tokens} tokens, user messages of {USER_MESSAGE_TOKENS}; the judge and the user answer "
        f"at their caps ({JUDGE_MAX_TOKENS} and {USER_MAX_TOKENS} tokens: a batch decodes until its longest "
        f"answer ends)" + (f"; left out: {', '.join(left)}" if left else ""),
        "- "
        + (
            "4-bit base: above 4 rows a matmul, every weight counted dequantised to bf16 and read back (NF4 + 4 "
            "bytes a weight): bitsandbytes' path on an H100 or H200 at 64 rows; at 8 it multiplies some shapes "
            "with its fused kernel instead, reading the NF4 bytes only (docs/scale.md)"
            if z["four_bit"]
            else "bf16 base weights"
        )
        + "; no efficiency factor, no kernel-launch, Python or CPU time (tokenising, the judge's JSON): a real "
        "step takes longer, most where the step is many small decode steps",
        "- peaks: NVIDIA H100 and H200 Tensor Core GPU datasheets, SXM: 3.35 and 4.8 TB/s, 989 TFLOP/s dense bf16 "
        "(1,979 with sparsity) on both",
    ]


def decode_line(z: dict, rollout_h100: float, measured: list | None = None) -> str:
    """How many decode forwards the rollout is, and what each costs: the estimate's on an H100, and, given the
    measured rollout seconds of a run's steps, the measured (median); the difference is what a forward costs
    beyond its bytes and FLOPs (kernel launches, Python), which the estimate leaves out."""
    f = z["forwards"]
    n = sum(f.values())
    text = (
        f"The rollout is {n:,} decode forwards a step (policy {f['policy']:,}, judge {f['judge']:,}, user "
        f"{f['user']:,}); the rollout's seconds over them: {1e3 * rollout_h100 / n:.3g} ms each by the estimate "
        "on an H100"
    )
    values = [x for x in measured or [] if x is not None]
    if values:
        text += f", {1e3 * statistics.median(values) / n:.3g} ms measured"
    return text + f"; every millisecond a forward costs beyond that adds {n / 1e3:.3g} s a step."


def time_table(name: str, cfg: dict, args, what: str) -> str:
    """One step's seconds on an H100 and an H200, per phase (step_phases at 04's flags `args`), the phases that
    dominate, what a step logging the KL adds, and the assumptions: markdown."""
    s = model_shapes(cfg)
    phases, z = step_phases(s, args)
    secs = seconds_by_gpu(phases)
    total = {g: sum(v) for g, v in secs.items()}
    share = {g: [x / total[g] for x in secs[g]] for g in GPUS}
    lines = [
        f"#### Time of one step: {name}, {what}, at the datasheet peaks",
        "",
        "| phase | work | TFLOP | GB moved | s, H100 | s, H200 | share, H100 / H200 | bound by |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for j, (group, phase, f, b, note) in enumerate(phases):
        bound = " / ".join(dict.fromkeys("memory" if b / bw > f / peak else "compute" for bw, peak in GPUS.values()))
        lines.append(
            f"| {group}: {phase} | {note} | {num(f / 1e12)} | {num(b / 1e9)} | {secs['H100'][j]:.3g} | "
            f"{secs['H200'][j]:.3g} | {share['H100'][j]:.0%} / {share['H200'][j]:.0%} | {bound} |"
        )
    groups = {g: group_seconds(phases, secs[g]) for g in GPUS}
    lines.append(
        f"| **step** | rollout {groups['H100']['rollout']:.3g} / {groups['H200']['rollout']:.3g} s, update "
        f"{groups['H100']['update']:.3g} / {groups['H200']['update']:.3g} s | "
        f"{num(sum(p[2] for p in phases) / 1e12)} | {num(sum(p[3] for p in phases) / 1e9)} | "
        f"**{total['H100']:.3g}** | **{total['H200']:.3g}** | | |"
    )
    dominant, covered = [], 0.0
    for j in sorted(range(len(phases)), key=lambda j: -secs["H100"][j]):  # the largest, to two thirds of the step
        if covered >= 2 / 3:
            break
        dominant.append(f"{phases[j][0]}: {phases[j][1]} ({share['H100'][j]:.0%} / {share['H200'][j]:.0%})")
        covered += share["H100"][j]
    lines += [
        "",
        f"**{total['H100']:.3g} s a step on an H100, {total['H200']:.3g} s on an H200**; dominant: "
        f"{', '.join(dominant)}.",
    ]
    lines.append(decode_line(z, groups["H100"]["rollout"]))
    if args.kl_coef == 0 and args.log_kl_every > 0:
        kl = seconds_by_gpu(step_phases(s, args, log_kl=True)[0])
        lines.append(
            f"Every {args.log_kl_every}th step also runs the reference forward to log the KL (--log-kl-every): "
            f"+{sum(kl['H100']) - total['H100']:.3g} s on an H100, +{sum(kl['H200']) - total['H200']:.3g} s on an H200."
        )
    return "\n".join(lines + time_assumptions(args, z))


def run_report(a) -> str:
    """--for-run RUN_DIR: the time estimate at that 04 run's own flags (its args.json) next to the seconds
    its metrics.jsonl logged, per phase: step 1 (warm-up included) and the median of the later steps."""
    run = Path(a.for_run)
    common.check((run / "args.json").exists(), f"--for-run {run}: not a run folder (no args.json)")
    saved = json.loads((run / "args.json").read_text())
    common.check("minibatch_size" in saved, f"--for-run {run}: not a run of 04_mica_train.py (its args.json)")
    common.check((run / "metrics.jsonl").exists(), f"--for-run {run}: no metrics.jsonl (no step finished)")
    args = argparse.Namespace(**saved)
    metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    common.check(metrics, f"--for-run {run}: metrics.jsonl is empty (no step finished)")
    phases, z = step_phases(model_shapes(model_config(args.model, f"--for-run {run}: --model")), args)
    secs = seconds_by_gpu(phases)
    est = {g: {**group_seconds(phases, secs[g]), "step": sum(secs[g])} for g in GPUS}
    device = a.measured_on or "a device not named (--measured-on)"
    later = metrics[1:]

    def measured(rows, key):
        values = [m[key] for m in rows if m.get(key) is not None]
        return f"{statistics.median(values):.3g}" if values else "not logged" if rows else "-"

    other_rewards = [r for r in args.reward_weights if r not in ("idr", "rlver")]
    reward_est = "not estimated" if other_rewards else "0"
    lines = [
        f"#### Seconds a step: the estimate at {run.name}'s flags, and the run (measured on {device})",
        "",
        f"| phase | estimate, H100 | estimate, H200 | measured, step 1 (with warm-up) | measured, "
        f"{'steps 2-' + str(len(metrics)) + ', median' if len(metrics) > 2 else 'step 2'} |",
        "|---|---|---|---|---|",
    ]
    rows = [
        ("rollout (policy, judge, user)", "rollout", "rollout_seconds"),
        (
            "rewards" + (f" ({', '.join(other_rewards)})" if other_rewards else " (idr, rlver: none beyond the judge)"),
            None,
            "reward_seconds",
        ),
        ("update", "update", "update_seconds"),
        ("step", "step", "step_seconds"),
    ]
    for label, key, field in rows:
        e = [f"{est[g][key]:.3g}" if key else reward_est for g in GPUS]
        lines.append(f"| {label} | {e[0]} | {e[1]} | {measured(metrics[:1], field)} | {measured(later, field)} |")
    lines += [
        "",
        f"The estimate assumes {z['T']} turns a dialogue and {z['scored']} scored tokens a step; the run had "
        + ", ".join(
            f"{m.get('turns_mean', float('nan')):.3g} turns and {m.get('token_passes', '?')} tokens (step {m['step']})"
            for m in metrics[:4]
        )
        + (" ..." if len(metrics) > 4 else "")
        + ". The estimate is for an H100 and an H200 at their peaks: seconds measured on another device (a CPU) "
        "are not comparable with it.",
        decode_line(z, est["H100"]["rollout"], [m.get("rollout_seconds") for m in (later or metrics)]),
    ]
    return "\n".join(lines + time_assumptions(args, z))


# ---------------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------------
def table(rows) -> str:
    def fmt(r):
        return "-" if r is None else f"{r:.2f}x"

    def met(m):
        return "n/a" if m is None else ("yes" if m else "no")

    lines = ["| figure | ours | reference | ratio | goal | met? |", "|---|---|---|---|---|---|"]
    lines += [
        f"| {r['figure']} | {r['ours']} | {r['reference']} | {fmt(r['ratio'])} | {r['goal']} | {met(r['met'])} |"
        for r in rows
    ]
    return "\n".join(lines)


def machine() -> str:
    versions = {m: importlib.import_module(m).__version__ for m in ("torch", "transformers", "peft")}
    try:
        versions["trl"] = importlib.import_module("trl").__version__
    except ImportError:
        versions["trl"] = "not installed"
    device = (
        torch.cuda.get_device_name(0)
        if torch.cuda.is_available()
        else f"CPU, {os.cpu_count()} cores ({platform.processor() or platform.machine()}), "
        f"{torch.get_num_threads()} torch threads"
    )
    return f"{datetime.datetime.now():%Y-%m-%d %H:%M} | {device} | Python {platform.python_version()} | " + " | ".join(
        f"{k} {v}" for k, v in versions.items()
    )


def main(argv=None):
    a = parse_args(argv)
    if a.for_run:  # the shapes and the run's files only: no model loaded
        print(run_report(a))
        return
    if a.estimate:
        print(estimate_report(a))
        return
    out_dir = Path(a.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    command = "python " + " ".join(
        [
            str(
                Path(sys.argv[0]).relative_to(ROOT)
                if Path(sys.argv[0]).is_absolute() and ROOT in Path(sys.argv[0]).parents
                else sys.argv[0]
            )
        ]
        + sys.argv[1:]
    )
    t_start = time.time()
    figures = {f.strip() for f in a.figures.split(",")}
    args = policy_args(a, a.k, a.max_turns, ["--scenarios-per-step", a.scenarios])
    from transformers import set_seed

    set_seed(a.seed)
    model, tok = common.load_policy(args, trainable=True)
    model.get_base_model().generation_config.min_new_tokens = a.max_new_tokens  # equal work, see 1.
    judge, user = env.make_judge(args), env.make_user(args)
    scenarios = random.Random(a.seed).sample(env.load_scenarios(args.scenarios), max(a.scenarios, a.peer_prompts))
    rows = []
    if "1" in figures:
        print("1. rollout ...", flush=True)
        row, trajs = bench_rollout(a, model, tok, scenarios[: a.scenarios], judge, user, args)
        rows.append(row)
    elif "2" in figures:
        trajs = env.rollout(model, tok, scenarios[: a.scenarios], judge, user, args)  # figure 2's input, untimed
    if "2" in figures:
        print("2. update ...", flush=True)
        rows.append(bench_update(a, model, tok, trajs, args))
    if "3" in figures:
        print("3. peer ...", flush=True)
        rows.append(bench_peer(a, model, tok, scenarios, judge, user, out_dir))
    if "5" in figures:
        print("5. engine ...", flush=True)
        rows += bench_engine(a, scenarios[: a.scenarios], out_dir)
    if "4" in figures and not a.no_memory:
        print("4. memory ...", flush=True)
        del model
        rows.append(bench_memory(a, out_dir))
    text = (
        f"# Benchmark\n\n{machine()}\n\nCommand: `{command}` ({time.time() - t_start:.0f} s); model "
        f"{a.model}\n\n{table(rows)}\n\n"
        + "\n".join(f"- {r['figure'].split(':')[0]}: {r['note']}" for r in rows)
        + "\n\n## QLoRA estimate from the shapes, one GPU: memory, and seconds a step "
        "(experiments/benchmark.py --estimate)\n\n" + estimate_report(a) + "\n"
    )
    print("\n" + text)
    (out_dir / "benchmark.md").write_text(text)
    (out_dir / "benchmark.json").write_text(
        json.dumps(
            {
                "machine": machine(),
                "command": command,
                "model": a.model,
                "rows": rows,
                "qlora_estimate_gb": {
                    name: estimate_peaks(memory_estimate(model_shapes(SHAPES[name]), **budget(a))) for name in SHAPES
                },
                "gpu_preset_step_seconds": {name: preset_step_seconds(name) for name in SHAPES},
            },
            indent=2,
            default=str,
        )
    )
    print(f"written: {out_dir / 'benchmark.md'}, {out_dir / 'benchmark.json'}")


if __name__ == "__main__":
    common.run_main(main)

"""05_eval.py: evaluate the base model and trained adapters side by side (EMPA, EQ-Bench 3, SAGE, EmoBench).

What it does
  Loads the base model once, evaluates it, then switches to each --adapters folder (peft) and evaluates it the
  same way, with the same seeds. Suites (--suite, comma-separated; each in full: docs/evaluation.md):
    empa      03's rollout on held-out scenarios by the benchmark's rules: outcomes, the EPM index, and each
              adapter against the base, paired dialogue by dialogue (the IDR return d(P0) - d(P_T), the collapse
              and cut-off shares, naturalness under the base), a 95% t interval over scenarios and a verdict each
    eqbench3, sage, emobench   benchmarks/<name>.py, each with its official protocol given its checkout
              (--eqbench3-dir, --sage-dir, --emobench-dir), else this project's variant (not comparable)
  Each batch of --batch-size cases is appended to cases.jsonl when done: --resume RUN reruns only the rest.

Imports 03_rollout: the environment (scenarios, the batched rollout, judges, users, the EMPA state); and the
        support modules benchmarks/ (the external benchmarks) and plots.py (the pictures).
Reads   --scenarios and each suite's files or official checkout (its flags; the defaults are small samples
        written for this project: pass the public files for results; formats: docs/evaluation.md).
Writes  runs/<name>-<time>/: args.json, cases.jsonl, transcripts.jsonl, results.json, results.md (the table
        and the comparison), distance_per_turn.png, emotion_per_turn.png; with --adapters and EMPA also
        comparison.png and trajectories.png (one held-out case, every model; the base's and the first
        adapter's dialogues of it are printed side by side).

Equations (docs/reference.md sections 3, 4, 6; r0 = ||P0||, rho_max = sqrt(12), alpha_s = 1.5, beta = 1.2)
  EPM-Index  = 0.4 Outcome + 0.2 Efficiency + 0.4 Stability, each the mean of three indices, per case:
  Outcome    RDI = (||P0|| - ||P_T||) / ||P0||  -> (RDI + 1)/2 * 100;   E_total = sum_t v_t . v*  ->
             max(0, E_total)/(beta r0) * 100;   S_net = sum_t sum_axis v_t,axis -> max(0, S_net)/(alpha_s r0) * 100
  Efficiency rho = E_total / T -> max(0, rho)/rho_max * 100;   S_proj = (1/T) sum_t v_t . u_t ->
             max(0, S_proj)/rho_max * 100;   tau = sum_t ||v_t|| / ||P0 - P_T|| -> (3 - tau)/2 * 100
  Stability  R_pos = the share of turns with dE_t > 0 -> R_pos * 100;   Align = (1/T) sum_t dE_t/||v_t|| (0 when
             v_t = 0) -> (Align + 1)/2 * 100;   R_pen = (1/T) sum_t sum_axis |negative level| -> (3 - R_pen)/3 * 100
  EQ-Bench 3, SAGE, EmoBench: their scores are in their files' docstrings (benchmarks/)
  95% CI     mean +- t_{0.975, n-1} * sd / sqrt(n) over n independent units: scenarios (EMPA: a scenario's
             dialogues averaged first), tasks, profiles, items; none below 2 units

Where each part lives
  here          Args; the EPM equations (epm_*), naturalness, t_interval; the loop (load, evaluate, save); the paired
                comparison (compare_with_base); the results' files
  03            the environment and the rollout;  benchmarks/  EQ-Bench 3, SAGE, EmoBench;  plots.py  the pictures

Choices and departures (numbered as in docs/evaluation.md, where each is in full)
  1. S_proj's u_t = v* (S_PROJ; "step": -P_{t-1}/||P_{t-1}||); R_pen counts levels (R_PEN; "points").
  2. tau undefined (P_T = P0): its index is 0; no index is clamped.  3. Judge-failed turns are left out; a
     case with no judged turn, or whose user failed, is excluded and counted.  4-6. SAGE, EQ-Bench 3 (without
     --eqbench3-dir not comparable with it; offline a PROXY) and EmoBench: their departures in benchmarks/.

CPU:  python 05_eval.py --adapters runs/mica-20261130-120000/adapter      (SmolLM2, embed judge, scripted user)
      make demo: after 04's 4 steps, --suite empa on 4 held-out scenarios x K=4 with the training rules
GPU:  python 05_eval.py --model Qwen2.5-7B-Instruct --adapters runs/mica-A/adapter runs/grpo-B/adapter \\
          --judge api:Qwen2.5-72B-Instruct --user api:Qwen2.5-72B-Instruct --api-base http://localhost:8000/v1 \\
          --eqbench3-dir path/to/eqbench3 --emobench-dir path/to/EmoBench --max-new-tokens 512 --max-context 32768
"""

from __future__ import annotations

import functools
import importlib
import json
import math
import os
import random
import statistics
import sys
import zlib
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

import backends
import common
import engine
import options
import plots
import runs
import sampling
from benchmarks import emobench, eqbench3, sage

env = importlib.import_module("03_rollout")  # the environment: scenarios, judges, users, the rollout
HERE = Path(__file__).resolve().parent
SUITES = ("empa", "eqbench3", "sage", "emobench")
RHO_MAX, ALPHA_S, BETA = math.sqrt(12), 1.5, 1.2
# two readings the EMPA paper leaves open (docs/evaluation.md, choice 1); epm_index also takes the others
R_PEN = "levels"  # R_pen counts a turn's negative levels ("points": their points, NEGATIVE_POINTS)
S_PROJ = "goal"  # S_proj's direction u_t: the goal v* = -P0/||P0|| ("step": -P_{t-1}/||P_{t-1}||)
EPM_KEYS = (
    "EPM",
    "Outcome",
    "Efficiency",
    "Stability",
    "RDI_idx",
    "E_total_idx",
    "S_net_idx",
    "rho_idx",
    "S_proj_idx",
    "tau_idx",
    "R_pos_idx",
    "Align_idx",
    "R_pen_idx",
    "turns",
    "final_distance",
)  # summarised per case
# the base-versus-adapter measures of the EMPA suite: (key, label, is higher better)
PAIRED = (
    ("idr_return", "IDR return", True),
    ("collapse", "collapse share", False),
    ("cut_off", "cut-off share", False),
    ("naturalness", "naturalness", True),
)
DATA = HERE / "data" / "eval"


@dataclass
class Args:
    """05_eval.py's own: the suites, the adapters, the sample of cases, the suites' files."""

    suite: str = options.option(",".join(SUITES), "comma-separated suites: " + ", ".join(SUITES))
    adapters: list = options.option([], "peft adapter folders, evaluated after the base model", nargs="*", type=str)
    max_cases: int = options.option(
        0,
        "at most this many cases per suite and file, sampled by --seed and stratified by language and category "
        "(EMPA, EQ-Bench: by kind; EMPA: scenarios, K dialogues each); 0 = all",
        type=options.number(int, low=0),
    )
    batch_size: int = options.option(
        8,
        "cases generated together (EmoBench log-likelihood: options scored together after their shared prompt); "
        "saved after each batch",
        type=options.number(int, low=1),
    )
    eqbench3: str = options.option(
        str(DATA / "eqbench3_sample.txt"),
        "EQ-Bench 3 scenario_prompts.txt (the default: a 4-scenario sample written for this project)",
    )
    sage_profiles: str = options.option(str(DATA / "sage_profiles.jsonl"), "SAGE profiles JSONL")
    emobench_eu: str = options.option(str(DATA / "emobench_eu.jsonl"), f"EmoBench EU JSONL, {emobench.LOGLIK}")
    emobench_ea: str = options.option(str(DATA / "emobench_ea.jsonl"), f"EmoBench EA JSONL, {emobench.LOGLIK}")
    emobench_dir: str | None = options.option(
        None,
        "a checkout of github.com/Sahandfer/EmoBench: EmoBench by its official protocol, its texts and "
        "data/EU.jsonl, EA.jsonl read from there (without it: --emobench-eu/-ea)",
    )
    sage_dir: str | None = options.option(
        None,
        "SAGE by its official protocol: a checkout of Tencent/digitalhuman or of its SAGE folder, prompts read "
        "from it, --user the simulator (unset: this project's variant)",
    )
    sage_turns: int = options.option(
        10, "SAGE: turns (with --sage-dir: replies; the last is never scored)", type=options.number(int, low=1)
    )
    resume: str | None = options.option(None, "a run folder of this script: finish its unfinished cases")


# ---------------------------------------------------------------------------------------------
# The equations: EPM metrics (EMPA), one function per index group, the index; the t interval
# ---------------------------------------------------------------------------------------------
def epm_outcome(P0, vs) -> dict:
    r0 = env.norm(P0)
    v_star = [-x / r0 for x in P0]
    # P_T = P0 + sum_t v_t
    P_T = list(P0)
    for v in vs:
        P_T = [P_T[i] + v[i] for i in range(3)]
    # RDI = (||P0|| - ||P_T||) / ||P0||   -> (RDI + 1)/2 * 100
    RDI = (r0 - env.norm(P_T)) / r0
    # E_total = sum_t v_t . v*            -> max(0, E_total)/(beta r0) * 100
    E_total = sum(sum(v[i] * v_star[i] for i in range(3)) for v in vs)
    # S_net = sum_t sum_axis v_t,axis     -> max(0, S_net)/(alpha_s r0) * 100
    S_net = sum(sum(v) for v in vs)
    return {
        "RDI": RDI,
        "E_total": E_total,
        "S_net": S_net,
        "RDI_idx": (RDI + 1) / 2 * 100,
        "E_total_idx": max(0.0, E_total) / (BETA * r0) * 100,
        "S_net_idx": max(0.0, S_net) / (ALPHA_S * r0) * 100,
    }


def epm_efficiency(P0, vs, s_proj="goal") -> dict:
    T, r0 = len(vs), env.norm(P0)
    v_star = [-x / r0 for x in P0]
    # rho = E_total / T                   -> max(0, rho)/rho_max * 100
    rho = sum(sum(v[i] * v_star[i] for i in range(3)) for v in vs) / T
    # S_proj = (1/T) sum_t v_t . u_t,  u_t = v* ("goal") or -P_{t-1}/||P_{t-1}|| ("step", 0 at the origin)
    S, P_prev = 0.0, list(P0)
    for v in vs:
        n = env.norm(P_prev)
        u = v_star if s_proj == "goal" else ([-x / n for x in P_prev] if n > 0 else [0.0, 0.0, 0.0])
        S += sum(v[i] * u[i] for i in range(3))
        P_prev = [P_prev[i] + v[i] for i in range(3)]
    # tau = sum_t ||v_t|| / ||P0 - P_T||  -> (3 - tau)/2 * 100; undefined when P_T = P0: index 0
    net = env.norm([P_prev[i] - P0[i] for i in range(3)])
    tau = sum(env.norm(v) for v in vs) / net if net > 1e-12 else None
    return {
        "rho": rho,
        "S_proj": S / T,
        "tau": tau,
        "rho_idx": max(0.0, rho) / RHO_MAX * 100,
        "S_proj_idx": max(0.0, S / T) / RHO_MAX * 100,
        "tau_idx": (3 - tau) / 2 * 100 if tau is not None else 0.0,
    }


def epm_stability(P0, vs, levels, r_pen="levels") -> dict:
    T, r0 = len(vs), env.norm(P0)
    v_star = [-x / r0 for x in P0]
    pos, align, pen = 0, 0.0, 0.0
    for v, lv in zip(vs, levels):
        dE = sum(v[i] * v_star[i] for i in range(3))
        # R_pos = (1/T) #{t : dE_t > 0}                    -> R_pos * 100
        pos += dE > 0
        # Align = (1/T) sum_t dE_t / ||v_t|| (0 if v_t = 0) -> (Align + 1)/2 * 100
        align += dE / env.norm(v) if env.norm(v) > 0 else 0.0
        # R_pen = (1/T) sum_t sum_axis |negative level|     -> (3 - R_pen)/3 * 100  (or its points)
        pen += sum(lv[a][1] if r_pen == "levels" else -env.NEGATIVE_POINTS[a][lv[a][1]] for a in env.AXES)
    return {
        "R_pos": pos / T,
        "Align": align / T,
        "R_pen": pen / T,
        "R_pos_idx": pos / T * 100,
        "Align_idx": (align / T + 1) / 2 * 100,
        "R_pen_idx": (3 - pen / T) / 3 * 100,
    }


def epm_index(P0, vs, levels, r_pen="levels", s_proj="goal") -> dict:
    """Every EPM metric of one case; vs and levels hold the judged turns only (at least one)."""
    m = {**epm_outcome(P0, vs), **epm_efficiency(P0, vs, s_proj), **epm_stability(P0, vs, levels, r_pen)}
    # each group is the mean of its three indices; EPM = 0.4 Outcome + 0.2 Efficiency + 0.4 Stability
    m["Outcome"] = (m["RDI_idx"] + m["E_total_idx"] + m["S_net_idx"]) / 3
    m["Efficiency"] = (m["rho_idx"] + m["S_proj_idx"] + m["tau_idx"]) / 3
    m["Stability"] = (m["R_pos_idx"] + m["Align_idx"] + m["R_pen_idx"]) / 3
    m["EPM"] = 0.4 * m["Outcome"] + 0.2 * m["Efficiency"] + 0.4 * m["Stability"]
    return m


# Student's t, for the 95% intervals: its density, its distribution function, its quantile
def t_density(x: float, df: int) -> float:
    # f(x) = Gamma((df + 1) / 2) / (sqrt(df pi) Gamma(df / 2)) (1 + x^2 / df)^(-(df + 1) / 2)
    log_c = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)
    return math.exp(log_c - (df + 1) / 2 * math.log1p(x * x / df))


def t_cdf(x: float, df: int, n: int = 4000) -> float:
    # F(x) = 1/2 + integral_0^x f(u) du, by Simpson's rule on n (even) intervals; F(-x) = 1 - F(x)
    if x < 0:
        return 1.0 - t_cdf(-x, df, n)
    h = x / n
    total = t_density(0.0, df) + t_density(x, df)
    for i in range(1, n):
        total += (4 if i % 2 else 2) * t_density(i * h, df)
    return 0.5 + total * h / 3


@functools.cache
def t_quantile(p: float, df: int) -> float:
    """t_{p, df}, Student's t quantile at any df >= 1 (p > 0.5): t_cdf inverted by bisection, to 1e-9. Exact up
    to the integration's error (Simpson, 4000 intervals: below 1e-8 at df 1-1000), at the interval's own df
    (a short table read at its nearest df below would give 2.086, df 20's, for 23)."""
    if df < 1:
        raise ValueError(f"t_quantile: df must be >= 1, got {df}")
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < p:
        hi *= 2
    while hi - lo > 1e-9:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if t_cdf(mid, df) < p else (lo, mid)
    return (lo + hi) / 2


@torch.no_grad()
def naturalness(model, tok, trajs, batch_size: int) -> list[list[float | None]]:
    """Each reply's mean per-token log-likelihood under the frozen base model (the adapter off), in its own
    dialogue's context: what the replies have become, beside the reward (None for an empty reply)."""
    # nat_t = (1/|y_t|) sum_{i in y_t} log pi_base(y_i | the dialogue before token i)
    out = []
    with common.adapters_off(model):
        for j in range(0, len(trajs), batch_size):
            part = trajs[j : j + batch_size]
            ids, attn, mask = sampling.right_pad(
                [tr.ids for tr in part], tok.pad_token_id, [tr.spans for tr in part], next(model.parameters()).device
            )
            sizes = [end - start for tr in part for start, end in tr.spans]
            logp = iter(sampling.token_logprobs(model, ids, attn, mask).split(sizes))
            for tr in part:
                nat = []
                for _ in tr.spans:
                    y = next(logp)
                    nat.append(float(y.mean()) if len(y) else None)
                out.append(nat)
    return out


def t_interval(xs) -> tuple[float, float | None]:
    # mean +- t_{0.975, n-1} * sd / sqrt(n) over n independent units (sd with ddof = 1); none below 2 units
    if len(xs) < 2:
        return sum(xs) / len(xs), None
    mean, sd = common.mean_std(xs, ddof=1)
    return mean, t_quantile(0.975, len(xs) - 1) * sd / math.sqrt(len(xs))


# ---------------------------------------------------------------------------------------------
# The main loop
# ---------------------------------------------------------------------------------------------
@dataclass
class Run:
    """What the evaluation works with, made once by load."""

    args: object
    dir: Path  # the run folder, new or resumed
    data: dict  # each suite's units of work, checked and sampled (--max-cases)
    model: torch.nn.Module  # the base, then a PeftModel holding the adapters switched to
    tokenizer: object
    judge: object | None  # 03's judge (EMPA, EQ-Bench 3, this project's SAGE), else None
    user: object | None  # 03's simulated user (EMPA, SAGE), else None
    server: engine.Engine | None  # --engine: the server that samples the replies
    done: set  # the (model, suite, case) already finished in the run folder


def load(args) -> Run:
    """Steps 1-3: the inputs checked, the base model, the judge and the user, the run folder."""
    # 1. read and check every input before anything is created
    data = load_suite_data(args)
    common.check_model_args(args)
    from transformers import set_seed

    set_seed(args.seed)  # after the input checks (importing transformers takes seconds), before LoRA's draws
    # 2. the base model, loaded once, then the judge and the user (self: that base, or the engine's with --engine)
    server = engine.connect(args)  # --engine: up and serving --model, or one line before any model loads
    model, tok = common.load_policy(args, trainable=False)
    judged = set(args.suites) - ({"sage"} if args.sage_dir else set())  # official SAGE: --user is its simulator
    judge = env.make_judge(args, (model, tok), server) if {"empa", "eqbench3", "sage"} & judged else None
    user = env.make_user(args, (model, tok), server) if {"empa", "sage"} & set(args.suites) else None
    # 3. the run folder (new, or the one to resume: its finished batches are skipped)
    run_dir = runs.open_run(args, ("cases.jsonl", "transcripts.jsonl"))
    done = {k for k, r in last_records(run_dir).items() if not r.get("failed")}
    if args.resume:
        print(f"resume {run_dir}: {len(done)} cases finished; batches of finished cases are skipped")
    print(f"run folder {run_dir} | models: {', '.join(['base'] + args.adapters)} | device {common.pick_device()}")
    return Run(args, run_dir, data, model, tok, judge, user, server, done)


def evaluate(run: Run):
    """Steps 4-5: the base, then each adapter, on every suite."""
    args = run.args
    for label, adapter in [("base", None)] + [(a, a) for a in args.adapters]:
        # 4. switch to this model's adapter (peft keeps the base weights, one adapter active)
        if adapter is not None:
            run.model = switch_adapter(run.model, adapter, f"a{args.adapters.index(adapter)}")
        if run.server is not None:  # the engine samples this model's replies: the base, or the adapter loaded
            run.server.use(adapter, f"a{args.adapters.index(adapter)}" if adapter else None)  # named per run
        for suite in args.suites:
            evaluate_suite(run, label, suite)


def evaluate_suite(run: Run, label: str, suite: str):
    """Step 5: one model's unfinished batches of one suite, each appended to the run folder when done."""
    args = run.args
    # 5. the suite's batches with an unfinished case; each batch is saved as soon as it is done. A resumed run
    # reruns such a batch whole: the same batches, seeds and batch-mates as a run never stopped
    units = run.data[suite]
    batches = [units[j : j + args.batch_size] for j in range(0, len(units), args.batch_size)]
    todo = [
        batch
        for batch in batches
        if not all((label, suite, c) in run.done for u in batch for c in case_ids(suite, u, args.k))
    ]
    bar = tqdm(
        total=len(units),
        initial=len(units) - sum(map(len, todo)),
        desc=f"{label} {suite}",
        disable=not args.progress,
    )
    for batch in todo:
        # the same seed per batch for every model: paired comparisons
        torch.manual_seed(zlib.crc32(f"{args.seed}|{suite}|{case_ids(suite, batch[0], 1)[0]}".encode()))
        cases, transcripts = run_suite(suite, run.model, run.tokenizer, batch, run.judge, run.user, args, run.server)
        tag = {"model": label, "suite": suite}
        runs.append_jsonl(run.dir / "transcripts.jsonl", [{**tag, **t} for t in transcripts])
        runs.append_jsonl(run.dir / "cases.jsonl", [{**tag, **c} for c in cases])
        bar.update(len(batch))
    bar.close()


def save(run: Run):
    """Step 6: the results' files, and what they say printed."""
    # 6. aggregate: results.json, results.md, plots; print the table and the comparison
    print(
        f"\n{write_results(run.dir, run.args)}\n\nwritten to {run.dir} (results.md, results.json, cases.jsonl, plots)"
    )


def main(argv=None):
    args = parse_args(argv)
    run = load(args)
    try:
        evaluate(run)
    except common.UserError as e:
        # the judge's endpoint went down, say: keep what was finished, then stop with the one message
        write_results(run.dir, args)
        raise common.UserError(f"{e}; the finished cases are saved: continue with --resume {run.dir}") from None
    finally:
        if run.server is not None:
            run.server.close()  # this run's adapter unloaded from the engine: a next run starts from a clean server
    save(run)


def compare_with_base(records: list[dict], adapters: list[str]) -> tuple[list[str], dict]:
    """EMPA, each adapter against the base, paired by case (the same scenario, k and seed): per measure the
    means, the difference, its 95% t interval over scenarios, and a verdict. A case failed in either is out."""
    by = {(r["model"], r["case"]): r for r in records if r["suite"] == "empa" and not r.get("failed")}
    lines, out = [], {}
    for a in adapters:
        paired = sorted(c for m, c in by if m == "base" and (a, c) in by)
        if len(paired) < 2:
            lines.append(f"held out: {a} vs base: {len(paired)} dialogue(s) paired, fewer than 2: no comparison")
            continue
        lines.append(
            f"held out: {a} vs base on {len({c.split('#')[0] for c in paired})} scenarios, {len(paired)} "
            f"dialogues paired by scenario, k and seed"
        )
        for key, label, higher in PAIRED:
            both = [c for c in paired if by["base", c].get(key) is not None and by[a, c].get(key) is not None]
            scenarios = sorted({c.split("#")[0] for c in both})
            if not both:  # a measure the records lack (a run from before it existed)
                continue
            b, t = [by["base", c][key] for c in both], [by[a, c][key] for c in both]

            def per_scenario(value):  # a scenario's K dialogues averaged first: the scenarios are the units
                return [statistics.mean(value(c) for c in both if c.split("#")[0] == s) for s in scenarios]

            diffs = per_scenario(lambda c: by[a, c][key] - by["base", c][key])  # the paired difference
            diff, half = t_interval(diffs)
            flat = min(diffs) == max(diffs)  # no spread: every scenario's difference is the same
            lo, hi = (diff - half, diff + half) if half is not None and not flat else (diff, diff)
            # a verdict needs a spread to stand on: 3+ scenarios whose differences are not all equal
            verdict = (
                f"too few scenarios to tell ({len(scenarios)})"
                if len(scenarios) < 3
                else f"no spread over {len(scenarios)} scenarios: every scenario's difference is {diff:+.3f}"
                if flat
                else "ahead beyond the spread"
                if (lo > 0 if higher else hi < 0)
                else "behind beyond the spread"
                if (hi < 0 if higher else lo > 0)
                else "not separated"
            )
            lines.append(
                f"  {label:14s} base {statistics.mean(b):+.3f}, adapter {statistics.mean(t):+.3f} "
                f"(means over {len(both)} dialogues); adapter - base {diff:+.3f}, 95% t CI over "
                f"{len(scenarios)} scenarios [{lo:+.3f}, {hi:+.3f}]: {verdict}"
            )
            out.setdefault(a, {})[key] = {
                "base": statistics.mean(b),
                "adapter": statistics.mean(t),
                "diff": diff,
                "ci": [lo, hi],
                "base_ci": t_interval(per_scenario(lambda c: by["base", c][key])),
                "adapter_ci": t_interval(per_scenario(lambda c: by[a, c][key])),
                "scenarios": len(scenarios),
                "dialogues": len(both),
                "verdict": verdict,
            }
    return lines, out


# ---------------------------------------------------------------------------------------------
# --- supporting pieces ---: the suites, loaders, judge answers, results and plots, CLI
# ---------------------------------------------------------------------------------------------
def case_ids(suite, unit, k) -> list[str]:
    """The cases one unit of work yields: an EMPA scenario gives K dialogues, anything else one case."""
    return [f"{unit['id']}#{i}" for i in range(k)] if suite == "empa" else [unit.get("case", unit.get("id"))]


def run_suite(suite, model, tok, batch, judge, user, args, server=None) -> tuple[list[dict], list[dict]]:
    """One batch of a suite -> (cases, transcripts): EMPA here (its replies sampled by the engine with --engine),
    the others from benchmarks/ (SAGE on 03's environment, handed to it)."""
    if suite == "empa":
        return empa_cases(model, tok, batch, judge, user, args, server)
    if suite == "eqbench3":
        return eqbench3.cases(model, tok, batch, judge, user, args)
    if suite == "sage":
        return sage.cases(model, tok, batch, judge, user, args, env)
    return emobench.run(model, tok, batch, args.batch_size)


def empa_cases(model, tok, scenarios, judge, user, args, server=None) -> tuple[list[dict], list[dict]]:
    """03's rollout by the benchmark's rules; one case per (scenario, k)."""
    cases, transcripts = [], []
    trajs = env.rollout(model, tok, scenarios, judge, user, args, desc="empa turns", engine=server)
    for tr, nat in zip(trajs, naturalness(model, tok, trajs, args.batch_size)):
        rec = env.trajectory_record(tr, args)
        for turn, x in zip(rec["turns"], nat):
            turn["naturalness"] = x
        scored = [x for x in nat if x is not None]
        judged = [(v, lv) for v, lv in zip(tr.vs, tr.levels) if v is not None]
        case = {
            "case": f"{tr.scenario['id']}#{tr.k}",
            "outcome": tr.outcome,
            "turns": tr.T,
            "judged_turns": len(judged),
            "final_distance": rec["final_distance"],
            "distances": [rec["initial_distance"]] + [t["distance"] for t in rec["turns"]],
            # the paired measures: the pure IDR's sum d(P0) - d(P_T), a collapse, the share of cut-off replies
            "idr_return": rec["initial_distance"] - rec["final_distance"],
            "collapse": float(tr.outcome == "failure"),
            "cut_off": sum(tr.cut_off) / max(1, tr.T),
            # and the replies' mean naturalness (their per-token log-likelihood under the base)
            "naturalness": statistics.mean(scored) if scored else None,
            "failed": (
                "judge failed on every turn" if not judged else "user failed" if tr.outcome == "user_failed" else None
            ),
        }
        if judged:
            case.update(epm_index(tr.scenario["p0"], [v for v, _ in judged], [lv for _, lv in judged], R_PEN, S_PROJ))
        cases.append(case)
        transcripts.append({"case": case["case"], **rec})
    return cases, transcripts


def switch_adapter(model, path, name: str):
    """The peft adapter folder `path` onto the model (the base, or a PeftModel holding others) as `name`, made
    the active one for inference; the base weights are shared, not copied."""
    from peft import PeftModel

    try:
        if isinstance(model, PeftModel):
            model.load_adapter(path, adapter_name=name, is_trainable=False)
        else:
            model = PeftModel.from_pretrained(model, path, adapter_name=name, is_trainable=False)
    except (RuntimeError, ValueError, KeyError, OSError) as e:
        raise common.UserError(
            f"--adapters {path}: cannot be loaded onto {model.__class__.__name__} "
            f"({type(e).__name__}: {str(e).splitlines()[0][:200]})"
        ) from None
    model.set_adapter(name)
    return model.eval()


# results: the last record of every (model, suite, case), summaries, the table, plots
def read_lines(path: Path) -> list[dict]:
    """The records of a JSONL file this script appends to (lines end at "\\n" only: a U+2028 that json.dumps
    leaves inside a string is text, not a line end); none when it does not exist yet."""
    return [json.loads(x) for x in path.read_text(encoding="utf-8").split("\n") if x.strip()] if path.exists() else []


def last_records(run_dir: Path) -> dict:
    """The last record of every (model, suite, case) in cases.jsonl."""
    return {(r["model"], r["suite"], r["case"]): r for r in read_lines(run_dir / "cases.jsonl")}


def summarize(cases: list[dict], suite: str) -> dict:
    """Means and 95% t intervals over the suite's independent units (EMPA: per scenario first)."""
    ok = [c for c in cases if not c.get("failed")]
    s = {"n": len(ok), "failed": len(cases) - len(ok)}
    if suite == "eqbench3":  # its label holds even when every case failed
        return {**s, **eqbench3.summary(cases, t_interval)}
    if not ok:
        return s
    if suite == "empa":  # a scenario's K dialogues are one unit
        scenarios = {}
        for c in ok:
            scenarios.setdefault(c["case"].split("#")[0], []).append(c)

        def over_scenarios(value):
            return t_interval([statistics.mean(value(c) for c in cs) for cs in scenarios.values()])

        s.update({key: over_scenarios(lambda c: c[key]) for key in EPM_KEYS}, units=len(scenarios))
        s["success"] = over_scenarios(lambda c: float(c["outcome"] == "success"))
        s["outcomes"] = {o: sum(c["outcome"] == o for c in ok) for o in sorted({c["outcome"] for c in ok})}
    elif suite == "sage":
        s.update(sage.summary(ok), sentient=t_interval([c["final_emotion"] for c in ok]))  # official: ok = all
    else:
        s.update(emobench.summarize(ok, t_interval))
    return s


def fmt(mean_half, n=None) -> str:
    return (
        f"{mean_half[0]:.2f}"
        + (f" ± {mean_half[1]:.2f}" if mean_half[1] is not None else "")
        + (f" (n={n})" if n is not None else "")
    )


def results_table(summary: dict, suites, args=None) -> str:
    """The results.md table; args: the run's flags (an official protocol's column says so before any case ends)."""
    official = {b: getattr(args, f"{b}_dir", None) for b in ("eqbench3", "sage")}
    emo = emobench.group_order(g for by in summary.values() for g in by.get("emobench", {}))  # "EU en", ...
    cols = {
        "empa": ["EMPA EPM-Index", "EMPA success %"],
        "eqbench3": [eqbench3.column(summary, official["eqbench3"])],
        "sage": [sage.column(summary, official["sage"]), "SAGE success / failure"],
        "emobench": [f"EmoBench {g} %" for g in emo],
    }
    head = [c for s in suites for c in cols[s]]
    lines = ["| model | " + " | ".join(head) + " |", "|---" * (len(head) + 1) + "|"]
    for model, by_suite in summary.items():
        cells = []
        for suite in suites:
            s = by_suite.get(suite, {"n": 0, "failed": 0})
            failed, miss = f"; {s['failed']} failed" if s["failed"] else "", ["-"] * len(cols[suite])
            if suite == "empa" and s["n"]:
                units = f" ({s['units']} scenarios, {s['n']} dialogues)"  # the interval is over scenarios
                cells += [fmt(s["EPM"]) + units + failed, f"{100 * s['success'][0]:.2f}"]
            elif suite == "empa":  # no case finished (every one failed): the failures, no measure
                cells += [f"- ({s['failed']} failed)", "-"]
            elif suite == "eqbench3":
                cells += [eqbench3.cell(s, fmt)]
            elif suite == "sage":
                cells += sage.cells(s, fmt(s["sentient"], s["n"]) + failed) if s["n"] else miss
            else:
                cells += emobench.cells(s, emo, fmt)
        lines.append(f"| {model} | " + " | ".join(cells) + " |")
    protocols = sorted({by["emobench"]["protocol"] for by in summary.values() if "protocol" in by.get("emobench", {})})
    lines += ["", *[f"EmoBench: {p}" for p in protocols]] if protocols else []  # which protocol scored it
    return "\n".join(lines)


def write_results(run_dir: Path, args) -> str:
    records = list(last_records(run_dir).values())
    models = ["base"] + list(args.adapters) + sorted({r["model"] for r in records} - {"base", *args.adapters})
    summary = {
        m: {s: summarize([r for r in records if r["model"] == m and r["suite"] == s], s) for s in args.suites}
        for m in models
        if any(r["model"] == m for r in records)
    }
    table = results_table(summary, args.suites, args)
    compared, comparison = compare_with_base(records, args.adapters)
    weights = "4-bit NF4" if common.use_4bit(args) else "bf16" if common.pick_device().type == "cuda" else "fp32"
    md = [
        "# Evaluation",
        "",
        f"command: `python 05_eval.py {' '.join(sys.argv[1:])}`",
        "",
        f"base weights: {weights} (--load-in-4bit {args.load_in_4bit})",
        "",
        table,
        "",
        "mean ± 95% t interval over independent units (EMPA: scenarios, their K dialogues averaged first; "
        "EQ-Bench 3: tasks; SAGE: profiles; EmoBench: items); n = cases kept (for EMPA, its scenarios and their "
        "dialogues); failed cases are excluded and counted.",
    ]
    md += ["", *eqbench3.notes(summary, args.eqbench3_dir)] if "eqbench3" in args.suites else []
    rows = [(m, by["empa"]) for m, by in summary.items() if by.get("empa", {}).get("n")]
    if rows:
        md += [
            "",
            "EMPA details (means over scenarios; the indices are scaled to 0-100, and RDI, tau and R_pen "
            "can fall below 0, E_total rise above 100)",
            "",
            "| model | outcomes | " + " | ".join(k.replace("_idx", "") for k in EPM_KEYS[1:]) + " |",
            "|---" * (len(EPM_KEYS) + 1) + "|",
        ]
        md += [
            f"| {m} | {json.dumps(e['outcomes'])} | " + " | ".join(f"{e[k][0]:.2f}" for k in EPM_KEYS[1:]) + " |"
            for m, e in rows
        ]
        md += [
            "",
            f"EMPA-style, not the EMPA benchmark: MICA's public end rules ({args.max_turns} turns, none "
            f"before turn {args.min_turns}, collapse window {args.collapse_window}, the regression sum over all "
            f"8 dE, values rounded to 2 decimals first); this project's scenarios "
            f"({Path(args.scenarios).name}), judge prompt (judge {args.judge}) and K = {args.k} dialogues per "
            f"scenario (the benchmark plays one: --k 1). R_pen counts negative {R_PEN} per turn; tau's "
            "index is 0 where P_T = P0.",
        ]
    md += ["", "```", *compared, "```"] if compared else []

    def line(d, p):  # {name: value} as "name value, ..." at p decimals
        return ", ".join(f"{k} {v:.{p}f}" for k, v in d.items())

    for m, by in summary.items():
        q = by.get("eqbench3", {})
        md += ["", f"{m}, EQ-Bench 3 by task kind: {line(q['by_kind'], 2)}"] if q.get("by_kind") else []
        md += [x for r in emobench.report_lines(m, by.get("emobench", {})) for x in ("", r)]
    runs.atomic_write(run_dir / "results.md", "\n".join(md) + "\n")
    runs.atomic_write(
        run_dir / "results.json",
        json.dumps(
            {
                "args": runs.public_args(args),
                "columns": table.split("\n")[0].strip("| ").split(" | "),
                "summary": summary,
                "comparison": comparison,
                "cases": records,
            },
            indent=1,
            ensure_ascii=False,
            default=str,
        ),
    )
    for suite, key, ylabel, name in (
        ("empa", "distances", "hinge distance d(P_t)", "distance_per_turn.png"),
        ("sage", "emotions", "user emotion e_t", "emotion_per_turn.png"),
    ):
        series = {}
        for m in models:
            kept = [r[key] for r in records if r["model"] == m and r["suite"] == suite and not r.get("failed")]
            if kept:
                series[m] = kept
        if series:
            plots.series(series, ylabel, run_dir / name)
    if comparison:  # the comparison as a picture, and one held-out case of each model
        plots.comparison(comparison, PAIRED, run_dir / "comparison.png")
        dialogues = {
            (t["model"], t["case"]): t for t in read_lines(run_dir / "transcripts.jsonl") if t["suite"] == "empa"
        }
        case = next(c for m, c in dialogues if m == "base" and all((a, c) in dialogues for a in comparison))
        plots.trajectories(
            {m: dialogues[m, case] for m in ["base", *comparison]}, env.AXES, run_dir / "trajectories.png"
        )
        compared += [
            "",
            f"one held-out dialogue, {case} (the same scenario, k and seed), the distance after each turn:",
        ]
        compared += side_by_side(dialogues["base", case], dialogues[next(iter(comparison)), case])
    return table + ("\n\n" + "\n".join(compared) if compared else "")


def side_by_side(left: dict, right: dict, width=58) -> list[str]:
    """Two dialogues of one case, the base's and an adapter's, turn by turn in two columns."""
    import itertools
    import textwrap

    def column(rec, t) -> list[str]:
        if t >= len(rec["turns"]):
            return []
        tu = rec["turns"][t]
        nat = f", naturalness {tu['naturalness']:.2f}" if tu.get("naturalness") is not None else ""
        text = f"user: {tu['user']}\nreply: {tu['assistant']}\nd(P_{tu['t']}) = {tu['distance']}{nat}"
        return [w for line in text.split("\n") for w in textwrap.wrap(line, width) or [""]]

    title = f"base, d(P_0) = {left['initial_distance']}"
    out = [f"{title:<{width}} | adapter, d(P_0) = {right['initial_distance']}"]
    for t in range(max(len(left["turns"]), len(right["turns"]))):
        out.append(f"{'-- turn ' + str(t + 1):<{width}} | -- turn {t + 1}")
        rows = itertools.zip_longest(column(left, t), column(right, t), fillvalue="")
        out += [f"{a:<{width}} | {b}" for a, b in rows]
    return out


def parse_args(argv=None):
    p = options.options_parser(
        __doc__.split("\n")[0],
        [
            ("05_eval.py", Args),
            ("EQ-Bench 3, official protocol", eqbench3.Options),
            ("environment (03; the EMPA suite)", env.EnvOptions),
            ("model", options.ModelOptions),
            ("LLM endpoints (api: backends)", backends.EndpointOptions),
            ("inference engine (engine.py; the EMPA suite)", engine.EngineOptions),
            ("run", runs.RunOptions),
        ],
    )
    # EMPA's benchmark rules, room for 45 turns (capped at the model's window); the base in bf16 on CUDA (fp32 on
    # a CPU) unless 4-bit is asked for
    p.set_defaults(max_turns=45, min_turns=12, collapse_window=5, max_context=8192, load_in_4bit="off")
    p.set_defaults(scenarios=str(HERE / "data" / "scenarios_test.jsonl"), k=1, run_name="eval")
    args = options.parse_options(p, argv)
    env.check_env_args(args)
    c = common.check
    args.suites = [s.strip() for s in args.suite.split(",") if s.strip()]
    bad = [s for s in args.suites if s not in SUITES]
    c(args.suites and not bad, f"--suite: unknown suite(s) {bad or args.suite!r}; choose from {', '.join(SUITES)}")
    c(
        args.adapter is None,
        "--adapter is for training; 05_eval.py takes --adapters A B ... (the base is always evaluated)",
    )
    for a in args.adapters:
        c(os.path.exists(os.path.join(a, "adapter_config.json")), f"--adapters {a}: no adapter_config.json there")
    c(len(set(args.adapters)) == len(args.adapters) and "base" not in args.adapters, "--adapters: each folder once")
    c(
        not args.engine or args.suites == ["empa"],
        "--engine samples the EMPA suite's replies (the base's and each adapter's); the other suites sample by their "
        "own protocols: run them without --engine",
    )
    eqbench3.check_args(args, p.get_default("eqbench3"))
    c(
        not args.emobench_dir or all(getattr(args, f) == p.get_default(f) for f in ("emobench_eu", "emobench_ea")),
        "--emobench-eu / --emobench-ea are the log-likelihood mode's: "
        "--emobench-dir reads PATH/data/EU.jsonl, EA.jsonl",
    )
    return args


def load_suite_data(args) -> dict:
    """Every input the chosen suites need, checked (errors name file:line and field), sampled (--max-cases)."""
    data = {}
    if "empa" in args.suites:
        data["empa"] = sample_cases(env.load_scenarios(args.scenarios), args, "empa", lambda s: (s.get("kind", ""),))
    if "eqbench3" in args.suites:
        tasks, said = eqbench3.read(args)
        print(said)
        data["eqbench3"] = eqbench3.units(sample_cases(tasks, args, "eqbench3", lambda t: (t["kind"],)), args)
    if "sage" in args.suites:
        data["sage"] = sample_cases(sage.load(args), args, "sage", lambda p: (p["language"],))
    if "emobench" in args.suites:
        data["emobench"] = [
            it
            for kind in ("EU", "EA")
            for it in sample_cases(
                emobench.load_official(args.emobench_dir, kind, args.model)
                if args.emobench_dir
                else emobench.load(getattr(args, f"emobench_{kind.lower()}"), kind),
                args,
                f"emobench {kind}",
                lambda it: (it["language"], it.get("coarse_category", it.get("category"))),
            )
        ]
    return data


def sample_cases(units: list, args, name: str, strata) -> list:
    """--max-cases n of the units, stratified: strata(unit) -> (language, category, ...); each level shares out
    its quota by largest remainder, quota_g = floor(n |g| / |all|) and the leftover to the largest fractions
    (ties drawn by --seed); within a stratum a seeded draw. Kept in file order."""
    n, rng = args.max_cases, random.Random(f"{args.seed}|{name}")
    if not n or n >= len(units):
        return units

    def take(index: list[int], quota: int, level: int) -> list[int]:
        if level == len(strata(units[index[0]])):
            return rng.sample(index, quota)
        groups = {}
        for i in index:
            groups.setdefault(strata(units[i])[level], []).append(i)
        exact = {g: quota * len(m) / len(index) for g, m in groups.items()}
        share = {g: math.floor(x) for g, x in exact.items()}
        # the leftover, one each to the groups with the largest fractions (equal fractions: a seeded order)
        for g in sorted(groups, key=lambda g: (share[g] - exact[g], rng.random()))[: quota - sum(share.values())]:
            share[g] += 1
        return [i for g, m in groups.items() for i in take(m, share[g], level + 1)]

    picked = [units[i] for i in sorted(take(list(range(len(units))), n, 0))]

    def label(u):  # the stratum's name, e.g. "en/Sadness"
        return "/".join(map(str, strata(u)))

    have, taken = Counter(map(label, units)), Counter(map(label, picked))  # units per stratum
    print(
        f"{name}: --max-cases {n} of {len(units)}, stratified (seed {args.seed}): "
        + ", ".join(f"{k} {taken[k]}/{have[k]}" for k in have)
    )
    return picked


if __name__ == "__main__":
    common.run_main(main)

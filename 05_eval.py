"""05_eval.py: evaluate the base model and trained adapters side by side (EMPA, EQ-Bench 3, SAGE, EmoBench).

What it does
  Loads the base model once, evaluates it, then switches to each --adapters folder (peft) and evaluates it
  the same way, with the same seeds. Suites (--suite, comma-separated; details: docs/evaluation.md):
    empa      03's rollout on held-out scenarios, by the benchmark's rules (45 turns, no end before turn 12,
              collapse window 5, --max-context 8192 capped at the window): outcomes, the EPM sub-metrics and
              index, and each adapter against the base, paired dialogue by dialogue (same scenario, k, seed):
              the IDR return d(P0) - d(P_T), the collapse share and the cut-off share, with a 95% t interval
              over scenarios (a scenario's K dialogues are not independent) and a verdict line each.
    eqbench3  scenario_prompts.txt: each scenario's fixed user turns played to the model, then the judge
              scores the task's criteria 0-20 (role-play and drafting; analysis: ids 401-420); replies are
              capped at --max-new-tokens (48 by default: raise it for real results).
    sage      SAGE / RLVER profiles on 03's rollout: emotion from 40, at most +-10 a turn, 10 turns.
    emobench  EmoBench EU (emotion and cause) and EA (best response or action), multiple choice.
  Each batch of --batch-size cases is appended to cases.jsonl when it is done, so --resume RUN skips the
  finished batches after a kill and reruns the rest whole (the same seeds and batch-mates as a run never
  stopped); --max-cases N samples N cases per suite and file (EMPA: N scenarios, K dialogues each),
  stratified by language and category, by --seed.

Imports 03_rollout: the environment (scenarios, the batched rollout, judges, users, the EMPA state).
Reads   --scenarios, --eqbench3 (a scenario_prompts.txt; a 4-scenario sample ships), --sage-profiles (JSONL:
        id, player, scene, main_cha, cha_group, task, first_talk?), --emobench-eu / -ea (JSONL with EmoBench's
        fields); UTF-8, a byte-order mark or CRLF is fine. The defaults of the last four are small samples
        written for this project (4 scenarios, 4 profiles, 6 + 6 items): pass the public files for results.
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
  EQ-Bench 3 score = 5 * the mean over tasks of (the mean of the task's criterion scores, each 0-20)
  SAGE       e_0 = 40, e_t = min(100, max(0, e_{t-1} + clip(change_t, -10, 10))); ends at e >= 100 (success),
             e < 10 (failure) or after --sage-turns; Sentient score = the mean final emotion
  EmoBench   accuracy; an EU item is correct only when the emotion and the cause are both right
  95% CI     mean +- t_{0.975, n-1} * sd / sqrt(n) over n independent units: scenarios (EMPA: a scenario's
             dialogues averaged first), tasks, profiles, items; none below 2 units

Choices and departures (numbered as in docs/evaluation.md, where each is in full)
  1. S_proj's u_t = v* (--s-proj step: -P_{t-1}/||P_{t-1}||); R_pen counts levels (--r-pen points).
  2. tau undefined (P_T = P0): its index is 0; no index is clamped.  3. Judge-failed turns are left out; a
     case with no judged turn, or whose user failed, is excluded and counted.  4. SAGE runs on 03's rollout;
     offline its emotion change comes from the levels (English only); without first_talk the user opens with
     what an LLM user writes from the profile (offline: a line naming main_cha), never the scene.
  5. EQ-Bench 3 offline is a PROXY of the embed judge's levels; analysis tasks are not scored.
  6. EmoBench scores each option by its mean log-probability as the answer, each prompt computed once.

CPU:  python 05_eval.py --adapters runs/mica-20261130-120000/adapter      (SmolLM2, embed judge, scripted user)
      make demo: after 04's 4 steps, --suite empa on 4 held-out scenarios x K=4 with the training rules
GPU:  python 05_eval.py --model Qwen2.5-7B-Instruct --adapters runs/mica-A/adapter runs/grpo-B/adapter \\
          --judge api:Qwen2.5-72B-Instruct --user api:Qwen2.5-72B-Instruct --api-base http://localhost:8000/v1 \\
          --eqbench3 path/to/scenario_prompts.txt --emobench-eu EU.jsonl --emobench-ea EA.jsonl --max-new-tokens 512
"""
from __future__ import annotations

import argparse
import copy
import importlib
import json
import math
import os
import random
import re
import statistics
import sys
import zlib
from collections import Counter
from pathlib import Path

import torch
from tqdm import tqdm

import common

env = importlib.import_module("03_rollout")   # the environment: scenarios, judges, users, the rollout
HERE = Path(__file__).resolve().parent
SUITES = ("empa", "eqbench3", "sage", "emobench")
RHO_MAX, ALPHA_S, BETA = math.sqrt(12), 1.5, 1.2
EPM_KEYS = ("EPM", "Outcome", "Efficiency", "Stability", "RDI_idx", "E_total_idx", "S_net_idx", "rho_idx", "S_proj_idx",
            "tau_idx", "R_pos_idx", "Align_idx", "R_pen_idx", "turns", "final_distance")    # summarised per case
# the base-versus-adapter measures of the EMPA suite: (key, label, is higher better)
PAIRED = (("idr_return", "IDR return", True), ("collapse", "collapse share", False),
          ("cut_off", "cut-off share", False))
EQ_PROXY = "EQ-Bench 3 (offline proxy)"   # the column when the embed judge's levels stood in for the criteria
# EmoBench's question templates ("en", "zh"), EQ-Bench 3's criteria (roleplay / analysis) and the axis that stands
# in for each in the offline proxy, the judges' and SAGE's prompts (lists of lines), SAGE's offline opening
TEXTS = json.loads((HERE / "data" / "prompts.json").read_text(encoding="utf-8"))
TEXTS.update({k: "\n".join(TEXTS[k]) for k in ("eqbench3_judge", "sage_judge", "sage_first_message")})
ROLEPLAY_CRITERIA, ANALYSIS_CRITERIA = (tuple(TEXTS["eqbench3_criteria"][k]) for k in ("roleplay", "analysis"))


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
    return {"RDI": RDI, "E_total": E_total, "S_net": S_net, "RDI_idx": (RDI + 1) / 2 * 100,
            "E_total_idx": max(0.0, E_total) / (BETA * r0) * 100, "S_net_idx": max(0.0, S_net) / (ALPHA_S * r0) * 100}


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
    return {"rho": rho, "S_proj": S / T, "tau": tau, "rho_idx": max(0.0, rho) / RHO_MAX * 100,
            "S_proj_idx": max(0.0, S / T) / RHO_MAX * 100, "tau_idx": (3 - tau) / 2 * 100 if tau is not None else 0.0}


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
    return {"R_pos": pos / T, "Align": align / T, "R_pen": pen / T, "R_pos_idx": pos / T * 100,
            "Align_idx": (align / T + 1) / 2 * 100, "R_pen_idx": (3 - pen / T) / 3 * 100}


def epm_index(P0, vs, levels, r_pen="levels", s_proj="goal") -> dict:
    """Every EPM metric of one case; vs and levels hold the judged turns only (at least one)."""
    m = {**epm_outcome(P0, vs), **epm_efficiency(P0, vs, s_proj), **epm_stability(P0, vs, levels, r_pen)}
    # each group is the mean of its three indices; EPM = 0.4 Outcome + 0.2 Efficiency + 0.4 Stability
    m["Outcome"] = (m["RDI_idx"] + m["E_total_idx"] + m["S_net_idx"]) / 3
    m["Efficiency"] = (m["rho_idx"] + m["S_proj_idx"] + m["tau_idx"]) / 3
    m["Stability"] = (m["R_pos_idx"] + m["Align_idx"] + m["R_pen_idx"]) / 3
    m["EPM"] = 0.4 * m["Outcome"] + 0.2 * m["Efficiency"] + 0.4 * m["Stability"]
    return m


# Student's t: the 0.975 quantile by degrees of freedom (a 95% two-sided interval); between rows the smaller
# df is used (a little wide, never narrow)
T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
        12: 2.179, 15: 2.131, 20: 2.086, 30: 2.042, 60: 2.000, 120: 1.980}


def t_interval(xs) -> tuple[float, float | None]:
    # mean +- t_{0.975, n-1} * sd / sqrt(n) over n independent units (sd with ddof = 1); none below 2 units
    if len(xs) < 2:
        return sum(xs) / len(xs), None
    mean, sd = common.mean_std(xs, ddof=1)
    return mean, T975[max(df for df in T975 if df <= len(xs) - 1)] * sd / math.sqrt(len(xs))


# ---------------------------------------------------------------------------------------------
# The main loop
# ---------------------------------------------------------------------------------------------
def main(argv=None):
    args = parse_args(argv)
    common.set_seed(args.seed)
    # 1. read and check every input before anything is created
    data = load_suite_data(args)
    common.check_model_args(args)
    # 2. the run folder (new, or the one to resume: its finished batches are skipped)
    run_dir = common.open_run(args, ("cases.jsonl", "transcripts.jsonl"))
    done = {k for k, r in last_records(run_dir).items() if not r.get("failed")}
    if args.resume:
        print(f"resume {run_dir}: {len(done)} cases finished; batches of finished cases are skipped")
    # 3. the base model, loaded once, then the judge and the user (self: that base)
    model, tok = common.load_policy(args, trainable=False)
    judge = env.make_judge(args, (model, tok)) if {"empa", "eqbench3", "sage"} & set(args.suites) else None
    user = env.make_user(args, (model, tok)) if {"empa", "sage"} & set(args.suites) else None
    print(f"run folder {run_dir} | models: {', '.join(['base'] + args.adapters)} | device {common.pick_device()}")
    try:
        for label, adapter in [("base", None)] + [(a, a) for a in args.adapters]:
            # 4. switch to this model's adapter (peft keeps the base weights, one adapter active)
            if adapter is not None:
                model = switch_adapter(model, adapter, f"a{args.adapters.index(adapter)}")
            for suite in args.suites:
                # 5. the suite's batches with an unfinished case; each batch is saved as soon as it is done. A
                # resumed run reruns such a batch whole: the same batches, seeds and batch-mates as a run
                # never stopped
                units = data[suite]
                batches = [units[j:j + args.batch_size] for j in range(0, len(units), args.batch_size)]
                todo = [batch for batch in batches
                        if not all((label, suite, c) in done for u in batch for c in case_ids(suite, u, args.k))]
                bar = tqdm(total=len(units), initial=len(units) - sum(map(len, todo)), desc=f"{label} {suite}",
                           disable=not args.progress)
                for batch in todo:
                    # the same seed per batch for every model: paired comparisons
                    torch.manual_seed(zlib.crc32(f"{args.seed}|{suite}|{case_ids(suite, batch[0], 1)[0]}".encode()))
                    cases, transcripts = run_suite(suite, model, tok, batch, judge, user, args)
                    tag = {"model": label, "suite": suite}
                    common.append_jsonl(run_dir / "transcripts.jsonl", [{**tag, **t} for t in transcripts])
                    common.append_jsonl(run_dir / "cases.jsonl", [{**tag, **c} for c in cases])
                    bar.update(len(batch))
                bar.close()
    except common.UserError as e:
        # the judge's endpoint went down, say: keep what was finished, then stop with the one message
        write_results(run_dir, args)
        raise common.UserError(f"{e}; the finished cases are saved: continue with --resume {run_dir}") from None
    # 6. aggregate: results.json, results.md, plots; print the table and the comparison
    print(f"\n{write_results(run_dir, args)}\n\nwritten to {run_dir} (results.md, results.json, cases.jsonl, plots)")


def compare_with_base(records: list[dict], adapters: list[str]) -> tuple[list[str], dict]:
    """EMPA, each adapter against the base, paired by case (the same scenario, k and seed): per measure the
    means, the difference, its 95% t interval over scenarios, and a verdict. A case failed in either is out."""
    by = {(r["model"], r["case"]): r for r in records if r["suite"] == "empa" and not r.get("failed")}
    lines, out = [], {}
    for a in adapters:
        both = sorted(c for m, c in by if m == "base" and (a, c) in by)
        scenarios = sorted({c.split("#")[0] for c in both})
        if len(both) < 2:
            lines.append(f"held out: {a} vs base: {len(both)} dialogue(s) paired, fewer than 2: no comparison")
            continue
        lines.append(f"held out: {a} vs base on {len(scenarios)} scenarios, {len(both)} dialogues paired by "
                     f"scenario, k and seed")
        for key, label, higher in PAIRED:
            b, t = [by["base", c][key] for c in both], [by[a, c][key] for c in both]

            def over_scenarios(value):     # a scenario's K dialogues averaged first: the scenarios are the units
                return t_interval([statistics.mean(value(c) for c in both if c.split("#")[0] == s) for s in scenarios])

            diff, half = over_scenarios(lambda c: by[a, c][key] - by["base", c][key])      # the paired difference
            lo, hi = (diff - half, diff + half) if half is not None else (diff, diff)
            verdict = ("not separated (fewer than 2 scenarios)" if half is None else
                       "ahead beyond the spread" if (lo > 0 if higher else hi < 0) else
                       "behind beyond the spread" if (hi < 0 if higher else lo > 0) else "not separated")
            lines.append(f"  {label:14s} base {statistics.mean(b):+.3f}, adapter {statistics.mean(t):+.3f} "
                         f"(means over {len(both)} dialogues); adapter - base {diff:+.3f}, 95% t CI over "
                         f"{len(scenarios)} scenarios [{lo:+.3f}, {hi:+.3f}]: {verdict}")
            out.setdefault(a, {})[key] = {
                "base": statistics.mean(b), "adapter": statistics.mean(t), "diff": diff, "ci": [lo, hi],
                "base_ci": over_scenarios(lambda c: by["base", c][key]),
                "adapter_ci": over_scenarios(lambda c: by[a, c][key]),
                "scenarios": len(scenarios), "dialogues": len(both), "verdict": verdict}
    return lines, out


# ---------------------------------------------------------------------------------------------
# --- supporting pieces ---: the suites, loaders, judge answers, results and plots, CLI
# ---------------------------------------------------------------------------------------------
def case_ids(suite, unit, k) -> list[str]:
    """The cases one unit of work yields: an EMPA scenario gives K dialogues, anything else one case."""
    return [f"{unit['id']}#{i}" for i in range(k)] if suite == "empa" else [unit.get("case", unit.get("id"))]


def run_suite(suite, model, tok, batch, judge, user, args) -> tuple[list[dict], list[dict]]:
    if suite != "emobench":
        return {"empa": empa_cases, "eqbench3": eqbench3_cases, "sage": sage_cases}[suite](
            model, tok, batch, judge, user, args)
    choose = lambda qs: [max(range(len(s)), key=s.__getitem__)  # noqa: E731  the best mean log-probability
                         for s in option_logliks(model, tok, qs, args.batch_size)]
    return [c for kind in ("EU", "EA") for c in emobench_cases(
        [it for it in batch if it["case"].startswith(kind + "-")], kind, choose)], []


def empa_cases(model, tok, scenarios, judge, user, args) -> tuple[list[dict], list[dict]]:
    """03's rollout by the benchmark's rules; one case per (scenario, k)."""
    cases, transcripts = [], []
    for tr in env.rollout(model, tok, scenarios, judge, user, args, desc="empa turns"):
        rec = env.trajectory_record(tr, args)
        judged = [(v, lv) for v, lv in zip(tr.vs, tr.levels) if v is not None]
        case = {"case": f"{tr.scenario['id']}#{tr.k}", "outcome": tr.outcome, "turns": tr.T,
                "judged_turns": len(judged), "final_distance": rec["final_distance"],
                "distances": [rec["initial_distance"]] + [t["distance"] for t in rec["turns"]],
                # the paired measures: the pure IDR's sum d(P0) - d(P_T), a collapse, the share of cut-off replies
                "idr_return": rec["initial_distance"] - rec["final_distance"],
                "collapse": float(tr.outcome == "failure"),
                "cut_off": sum(tr.truncated) / max(1, tr.T),
                "failed": ("judge failed on every turn" if not judged else
                           "user failed" if tr.outcome == "user_failed" else None)}
        if judged:
            case.update(epm_index(tr.scenario["p0"], [v for v, _ in judged], [lv for _, lv in judged],
                                  args.r_pen, args.s_proj))
        cases.append(case)
        transcripts.append({"case": case["case"], **rec})
    return cases, transcripts


def eqbench3_cases(model, tok, tasks, judge, user, args) -> tuple[list[dict], list[dict]]:
    """The user is unused (the turns are fixed). Offline (no LLM judge) role-play and drafting get the proxy
    scores and analysis tasks are not played: nothing offline can judge an analysis (reported as such)."""
    llm = isinstance(judge, env.LLMJudge)
    # 1. play each task's fixed user turns; every task of the batch answers its turn i in one generate call
    unscored = [not llm and t["kind"] == "analysis" for t in tasks]
    convs, cut = [[] for _ in tasks], list(unscored)       # cut: no further turns are played
    for i in range(max(len(t["prompts"]) for t in tasks)):
        live, ctx = [], []
        for j, t in enumerate(tasks):
            ids = common.render_ids(tok, convs[j] + [{"role": "user", "content": t["prompts"][i]}]) \
                if i < len(t["prompts"]) and not cut[j] else None
            if ids is not None and len(ids) + args.max_new_tokens > args.max_context:
                cut[j], ids = True, None             # later turns do not fit: judged on what was played
            if ids is not None:
                live.append(j), ctx.append(ids)
        replies = (common.generate_batch(model, tok, ctx, args.max_new_tokens, args.temperature, args.top_p)
                   if live else [])
        for j, (reply_ids, _) in zip(live, replies):
            convs[j] += [{"role": "user", "content": tasks[j]["prompts"][i]},
                         {"role": "assistant", "content": tok.decode(reply_ids, skip_special_tokens=True).strip()}]
    # 2. the judge scores the task's criteria 0-20
    criteria = [ANALYSIS_CRITERIA if t["kind"] == "analysis" else ROLEPLAY_CRITERIA for t in tasks]
    if llm:
        prompts = [[{"role": "user", "content": TEXTS["eqbench3_judge"].format(
            kind=t["kind"], transcript="\n\n".join(f"[{m['role']}]\n{m['content']}" for m in c),
            criteria="\n".join(f"- {x}" for x in cr), shape=json.dumps({x: 0 for x in cr}))}]
            for t, c, cr in zip(tasks, convs, criteria)]
        scores = common.ask_json(judge.backend, prompts, lambda i, text: parse_criteria(text, criteria[i]),
                                 args.judge_retries, who="eqbench3 judge", noun="cases")
    else:
        scores = eqbench3_proxy_scores(convs, criteria, judge)
    # 3. score = 5 * the mean of the task's criterion scores
    cases, transcripts = [], []
    for t, c, s, skip in zip(tasks, convs, scores, unscored):
        s = s if c else None
        case = {"case": t["id"], "kind": t["kind"], "category": t["category"], "replies": len(c) // 2,
                "context_limit": not skip and len(c) // 2 < len(t["prompts"]),
                "failed": None if s or skip else "judge failed" if c else "no turn fits in --max-context"}
        if s:
            case.update(criteria=s, score=5 * sum(s.values()) / len(s), proxy=not llm)
        if skip:
            case["unscored"] = "not scored (needs an LLM judge)"
        cases.append(case)
        transcripts.append({"case": t["id"], "messages": c})
    return cases, transcripts


def eqbench3_proxy_scores(convs, criteria, judge) -> list[dict | None]:
    """The offline proxy (not EQ-Bench): the MDEP-PR levels of every reply -> per axis clip(10 + 5 (progress -
    negative), 0, 20) -> each criterion the mean of its stand-in axis over the replies. A reply that is not
    language (the judge's fluency check: gibberish, keyword salad) scores as an empty one: negative 1 everywhere."""
    fluency_min, cases, owner = getattr(judge, "th", {}).get("fluency", 0.0), [], []
    for j, c in enumerate(convs):
        for i in range(1, len(c), 2):
            cases.append({"scenario": {"id": str(j), "persona": "", "situation": ""}, "history": c[:i],
                          "reply": c[i]["content"]})
            owner.append(j)
    per_axis = [{a: [] for a in env.AXES} for _ in convs]
    for j, v in zip(owner, judge.judge(cases) if cases else []):
        if v is not None:
            not_language = v["features"].get("fluency", 1.0) < fluency_min
            for a in env.AXES:
                progress, negative = (0, 1) if not_language else v["levels"][a]
                per_axis[j][a].append(max(0.0, min(20.0, 10.0 + 5.0 * (progress - negative))))
    axis = TEXTS["eqbench3_proxy_axis"]      # the criterion's stand-in axis; None: no reply judged
    return [{x: statistics.mean(per_axis[j][axis[x]]) for x in cr} if all(per_axis[j].values()) else None
            for j, cr in enumerate(criteria)]


def sage_scenario(p: dict, written: str | None = None) -> dict:
    """A profile as 03's rollout and users see a scenario; p0 = 0 (the user's state is its emotion). The user
    opens with first_talk, else what an LLM user wrote (sage_openings), else a short line naming main_cha:
    never with the scene, the simulator's private background."""
    offline = TEXTS["sage_offline_opening"][p["language"]].format(name=p["main_cha"].strip())
    opening, source = ((p["first_talk"], "first_talk") if (p.get("first_talk") or "").strip() else
                       (written, "user model") if written else (offline, "offline line"))
    return {"id": p["id"], "persona": p["player"], "situation": f"{p['scene']} {p['task']}", "profile": p,
            "opening": opening, "opening_from": source, "p0": [0.0, 0.0, 0.0],
            "user_lines": TEXTS["sage_zh_lines"] if p["language"] == "zh" else env.DEFAULT_USER_LINES}


def sage_openings(profiles, user, args) -> dict:
    """{id: the first message} of the profiles without first_talk, written by the LLM user (any user with a
    chat backend) from the profile, as SAGE's simulator does; asked again (--judge-retries) when empty or
    reciting the scene. Missing where there is no LLM user or no usable answer (sage_scenario's line)."""
    backend, need = getattr(user, "backend", None), [p for p in profiles if not (p.get("first_talk") or "").strip()]
    if backend is None or not need:
        return {}
    prompts = [[{"role": "user", "content": TEXTS["sage_first_message"].format(
        name=p["main_cha"], player=p["player"], scene=p["scene"], task=p["task"])}] for p in need]
    scenes = [p["scene"].strip()[:120] for p in need]         # an answer that recites the scene is not usable
    written = common.ask_json(backend, prompts, lambda i, t: t.strip() if t and t.strip() and not (
        scenes[i] and scenes[i] in t) else None, args.judge_retries, who="sage user", noun="openings",
        max_tokens=120, temperature=0.7)
    if None in written:
        common.warn(f"sage: {written.count(None)} of {len(need)} first messages unusable: the offline line instead")
    return {p["id"]: w for p, w in zip(need, written) if w}


class SageJudge:
    """SAGE's simulator as the judge of 03's rollout: an LLM reads the reply and states the change of its
    emotion (JSON, parsed, asked again when malformed: api: only). It gives no EMPA levels (v_t = 0)."""

    def __init__(self, backend, retries: int):
        self.backend, self.retries = backend, retries

    def judge(self, cases: list[dict]) -> list[dict | None]:
        prompts = [[{"role": "user", "content": TEXTS["sage_judge"].format(
            player=c["scenario"]["persona"], scene=c["scenario"]["profile"]["scene"],
            task=c["scenario"]["profile"]["task"], emotion=c["emotion"],
            history="\n".join(common.transcript_lines(c["history"], user="You") + [f"Supporter: {c['reply']}"]))}]
            for c in cases]
        changes = common.ask_json(self.backend, prompts, lambda i, text: parse_change(text), self.retries,
                                  who="sage judge", noun="cases")
        return [None if ch is None else {"levels": {a: (0, 0) for a in env.AXES}, "features": {}, "change": ch}
                for ch in changes]


def sage_cases(model, tok, profiles, judge, user, args) -> tuple[list[dict], list[dict]]:
    """03's rollout by SAGE's rules: one dialogue per profile, e_0 = --sage-start, at most --sage-turns, ending
    at e >= 100 or e < 10. The change is the LLM judge's (SageJudge), or offline the embed judge's levels:
    change_t = clip(2.5 * sum_axis v_t,axis, -10, 10) (03's emotion_change)."""
    sage_args = argparse.Namespace(**{**vars(args), "k": 1, "max_turns": args.sage_turns,
                                      "emotion_start": args.sage_start, "emotion_ends": True})
    if isinstance(judge, env.LLMJudge):
        judge = SageJudge(judge.backend, args.judge_retries)
    elif any(p["language"] == "zh" for p in profiles):
        common.warn("sage: Chinese profiles with the offline judge, whose cues are English: their emotion changes "
                    "mean little (an LLM judge reads both)")
    written = sage_openings(profiles, user, args)
    cases, transcripts = [], []
    for tr in env.rollout(model, tok, [sage_scenario(p, written.get(p["id"])) for p in profiles], judge, user,
                          sage_args, desc="sage turns"):
        changes = [e1 - e0 for e0, e1, v in zip(tr.emotions, tr.emotions[1:], tr.vs) if v is not None]
        failed = "user failed" if tr.outcome == "user_failed" else "judge failed on every turn" if not changes else None
        cases.append({"case": tr.scenario["id"], "opening": tr.scenario["opening_from"], "outcome": tr.outcome,
                      "turns": tr.T, "judged_turns": len(changes), "final_emotion": tr.emotions[-1],
                      "emotions": tr.emotions, "changes": changes, "failed": failed})
        transcripts.append({"case": tr.scenario["id"], **env.trajectory_record(tr, sage_args)})
    return cases, transcripts


def mcq_prompt(item, question, options, emotion=None) -> str:
    T = TEXTS["emobench"]["zh" if item["language"].lower().startswith(("zh", "ch")) else "en"]
    lettered = "\n".join(f"{chr(65 + i)}. {o}" for i, o in enumerate(options))
    qtype = item.get("question type", "").strip().lower()
    text = T[question].format(scenario=item["scenario"], subject=item["subject"], emotion=emotion or T["this"],
                              qtype=T["qtypes"].get(qtype, qtype))           # EA's type in the prompt's language
    return text + T["choices"].format(choices=lettered) + T["loglik"]


def emobench_cases(items, kind, choose) -> list[dict]:
    """choose(questions) -> the chosen option index per {prompt, options} question. EU asks the emotion, then
    the cause naming the chosen emotion; it is correct only when both are right."""
    head = lambda it: {"case": it["case"], "task": kind, "language": it["language"], "failed": None,  # noqa: E731
                       "category": it["category"] if kind == "EA" else it["coarse_category"]}
    if kind == "EA":
        picks = choose([{"prompt": mcq_prompt(it, "EA", it["choices"]), "options": it["choices"]} for it in items])
        return [{**head(it), "pred": it["choices"][p], "answered": True,
                 "correct": int(it["choices"][p] == it["label"])} for it, p in zip(items, picks)]
    named = [it["emotion_choices"][p] for it, p in zip(items, choose(
        [{"prompt": mcq_prompt(it, "emotion", it["emotion_choices"]), "options": it["emotion_choices"]}
         for it in items]))]
    cause = choose([{"prompt": mcq_prompt(it, "cause", it["cause_choices"], e), "options": it["cause_choices"]}
                    for it, e in zip(items, named)])
    out = []
    for it, e, c in zip(items, named, cause):
        emotion_ok, cause_ok = e == it["emotion_label"], it["cause_choices"][c] == it["cause_label"]
        out.append({**head(it), "pred": [e, it["cause_choices"][c]], "answered": True,
                    "emotion_correct": int(emotion_ok), "cause_correct": int(cause_ok),
                    "correct": int(emotion_ok and cause_ok)})
    return out


@torch.no_grad()
def option_logliks(model, tokenizer, questions: list[dict], batch_size: int) -> list[list[float]]:
    """Multiple choice, {prompt, options} -> score(option) = (1/|o|) sum_j log pi(o_j | prompt, o_<j): the option
    as the assistant's answer to the prompt as a user message. Each prompt is computed once: its forward pass
    gives log pi(o_1 | prompt) and a KV cache, and its options run on copies of that cache, at most batch_size
    at a time (right-padded): n options cost |prompt| + sum |o| tokens instead of n |prompt| + sum |o|."""
    device, out = next(model.parameters()).device, []
    for q in questions:
        prompt = common.render_ids(tokenizer, [{"role": "user", "content": q["prompt"]}])
        P, scores = len(prompt), []
        head = model(input_ids=torch.tensor([prompt], device=device), use_cache=True, logits_to_keep=1)
        first = head.logits[0, -1].float().log_softmax(-1)                 # log pi(. | prompt): scores o_1
        opts = [tokenizer(o, add_special_tokens=False)["input_ids"] for o in q["options"]]
        for start in range(0, len(opts), batch_size):
            ids, attn, _ = common.right_pad(opts[start:start + batch_size], tokenizer.pad_token_id, device=device)
            B, L = ids.shape
            cache = copy.deepcopy(head.past_key_values)
            cache.batch_select_indices(torch.zeros(B, dtype=torch.long, device=device))   # the prompt, B times
            logits = model(input_ids=ids, attention_mask=torch.cat([attn.new_ones(B, P), attn], 1),
                           position_ids=torch.arange(P, P + L, device=device).expand(B, L),
                           past_key_values=cache, use_cache=True).logits      # [B, L, V]: position j predicts o_{j+1}
            # sum_j log pi(o_j | prompt, o_<j): o_1 from the prompt's last position, o_j (j >= 2) from o_{j-1}'s
            rest = logits[:, :-1].float().log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)    # [B, L-1]
            scores += ((first[ids[:, 0]] + (rest * attn[:, 1:]).sum(1)) / attn.sum(1)).tolist()
        out.append(scores)
    return out


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
        raise common.UserError(f"--adapters {path}: cannot be loaded onto {model.__class__.__name__} "
                               f"({type(e).__name__}: {str(e).splitlines()[0][:200]})") from None
    model.set_adapter(name)
    return model.eval()


# loaders: EQ-Bench 3 text, SAGE profiles, EmoBench EU / EA
def load_eqbench3(path) -> tuple[list[dict], dict]:
    """scenario_prompts.txt -> tasks {id, category, title, kind, prompts, _where} and counts. Headers are 8 '#'
    then `id | category | title` (spacing, extra or missing fields tolerated); turn markers are 7 '#' then
    `Prompt<N>` or `<N>`. Lines outside a prompt and scenarios without prompts are counted, skipped."""
    tasks, stats, cur, prompt = [], {"ignored_lines": 0, "empty_scenarios": 0, "duplicates": 0}, None, None
    for lineno, line in common.text_lines(path):
        head = re.match(r"^\s*#{8}(?!#)\s*(.*)$", line)
        turn = re.match(r"^\s*#{7}(?!#)\s*(?:prompt\s*)?(\d+)\s*:?\s*$", line, re.I)
        if head:
            parts = [x.strip() for x in head.group(1).split("|")]
            category = parts[1] if len(parts) > 2 else ""
            sid = parts[0] or f"line{lineno}"
            kind = ("analysis" if (sid.isdigit() and 401 <= int(sid) <= 420) or "analys" in category.lower()
                    else "drafting" if "draft" in category.lower() else "roleplay")
            title = " | ".join(parts[2:]) if len(parts) > 2 else (parts[1] if len(parts) == 2 else "")
            tasks.append(cur := {"id": sid, "category": category, "title": title, "kind": kind, "prompts": [],
                                 "_where": f"{path}:{lineno}"})
            prompt = None
        elif turn and cur is not None:
            cur["prompts"].append(prompt := [])
        elif prompt is not None:
            prompt.append(line)
        elif line.strip():
            stats["ignored_lines"] += 1            # comments, notes before a scenario's first prompt
    kept, seen = [], set()
    for t in tasks:
        t["prompts"] = [p for p in ("\n".join(lines).strip() for lines in t["prompts"]) if p]
        if not t["prompts"]:
            stats["empty_scenarios"] += 1
        elif t["id"] in seen:
            stats["duplicates"] += 1               # the first scenario with an id wins
        else:
            seen.add(t["id"])
            kept.append(t)
    common.check(kept, f"{path}: no scenarios with prompts (expected '######## <id> | <category> | <title>' "
                       f"headers and '####### Prompt1' turn markers)")
    stats.update(scenarios=len(kept), prompts=sum(len(t["prompts"]) for t in kept))
    return kept, stats


def load_sage_profiles(path) -> list[dict]:
    recs = common.read_jsonl(path, {"id": (str, int), "player": str, "scene": str, "main_cha": str,
                                    "cha_group": (str, list), "task": str}, {"first_talk": str}, unique=("id",))
    for r in recs:       # the language, from the text (the profiles do not state it)
        r["id"], r["language"] = str(r["id"]), "zh" if re.search(r"[\u4e00-\u9fff]", r["player"] + r["scene"]) else "en"
    return recs


EMOBENCH_FIELDS = {  # the public files' fields (EA's "question type" with its space)
    "EU": {"qid": (str, int), "language": str, "coarse_category": str, "finegrained_category": str, "scenario": str,
           "subject": str, "emotion_choices": list, "emotion_label": str, "cause_choices": list, "cause_label": str},
    "EA": {"qid": (str, int), "language": str, "category": str, "question type": str, "scenario": str,
           "subject": str, "choices": list, "label": str}}


def load_emobench(path: str, kind: str) -> list[dict]:
    recs = common.read_jsonl(path, EMOBENCH_FIELDS[kind], unique=("language", "qid"))
    for r in recs:
        for choices, label in ([("emotion_choices", "emotion_label"), ("cause_choices", "cause_label")]
                               if kind == "EU" else [("choices", "label")]):
            ok = len(r[choices]) >= 2 and all(isinstance(c, str) and c.strip() for c in r[choices])
            common.check(ok, f"{r['_where']}: field '{choices}' must be a list of 2+ non-empty strings")
            common.check(r[label] in r[choices], f"{r['_where']}: field '{label}' is not one of '{choices}'")
        r["case"] = f"{kind}-{r['language']}-{r['qid']}"
    return recs


# LLM judge answers: JSON out of free text
def parse_criteria(text, criteria) -> dict | None:
    """{criterion: 0-20} for every criterion, or None."""
    obj, out = common.first_json(text)[0], {}
    if obj is None:
        return None
    for c in criteria:
        x = obj.get(c)
        x = float(x) if isinstance(x, str) and re.fullmatch(r"\s*\d+(\.\d+)?\s*", x) else x
        if not isinstance(x, (int, float)) or isinstance(x, bool) or not 0 <= x <= 20:
            return None
        out[c] = float(x)
    return out


def parse_change(text) -> float | None:
    """The SAGE simulator's emotion change, clipped to [-10, 10], or None."""
    obj = common.first_json(text)[0]
    x = obj.get("change") if obj else None
    if x is None:
        m = re.search(r'"?change"?\s*[:=]\s*([+-]?\d+(?:\.\d+)?)', text or "")
        x = float(m.group(1)) if m else None
    if not isinstance(x, (int, float)) or isinstance(x, bool) or not math.isfinite(x):
        return None
    return max(-10.0, min(10.0, float(x)))


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
    if not ok:
        return s
    if suite == "empa":                                    # a scenario's K dialogues are one unit
        scenarios = {}
        for c in ok:
            scenarios.setdefault(c["case"].split("#")[0], []).append(c)

        def over_scenarios(value):
            return t_interval([statistics.mean(value(c) for c in cs) for cs in scenarios.values()])

        s.update({key: over_scenarios(lambda c: c[key]) for key in EPM_KEYS}, units=len(scenarios))
        s["success"] = over_scenarios(lambda c: float(c["outcome"] == "success"))
        s["outcomes"] = {o: sum(c["outcome"] == o for c in ok) for o in sorted({c["outcome"] for c in ok})}
    elif suite == "eqbench3":
        scored = [c for c in ok if "score" in c]      # offline, analysis tasks are kept but not scored
        s.update(n=len(scored), unscored=len(ok) - len(scored), proxy=any(c.get("proxy") for c in scored))
        if scored:
            s["score"] = t_interval([c["score"] for c in scored])
            s["by_kind"] = {k: statistics.mean(c["score"] for c in scored if c["kind"] == k)
                            for k in sorted({c["kind"] for c in scored})}
    elif suite == "sage":
        s.update(sentient=t_interval([c["final_emotion"] for c in ok]),
                 successes=sum(c["final_emotion"] >= 100 for c in ok),
                 failures=sum(c["final_emotion"] < 10 for c in ok))
    else:
        for task in ("EU", "EA"):
            xs = [c for c in ok if c["task"] == task]
            if xs:
                s[task], s[task + "_n"] = t_interval([100.0 * c["correct"] for c in xs]), len(xs)
                for by in ("category", "language"):
                    s[f"{task}_by_{by}"] = {v: 100.0 * statistics.mean(c["correct"] for c in xs if c[by] == v)
                                            for v in sorted({c[by] for c in xs})}
    return s


def fmt(mean_half, n=None) -> str:
    return (f"{mean_half[0]:.2f}" + (f" ± {mean_half[1]:.2f}" if mean_half[1] is not None else "")
            + (f" (n={n})" if n is not None else ""))


def results_table(summary: dict, suites) -> str:
    proxy = any(by.get("eqbench3", {}).get("proxy") for by in summary.values())
    cols = {"empa": ["EMPA EPM-Index", "EMPA success %"], "eqbench3": [EQ_PROXY if proxy else "EQ-Bench 3"],
            "sage": ["SAGE Sentient", "SAGE success / failure"], "emobench": ["EmoBench EU %", "EmoBench EA %"]}
    head = [c for s in suites for c in cols[s]]
    lines = ["| model | " + " | ".join(head) + " |", "|---" * (len(head) + 1) + "|"]
    for model, by_suite in summary.items():
        cells = []
        for suite in suites:
            s = by_suite.get(suite, {"n": 0, "failed": 0})
            failed, miss = f"; {s['failed']} failed" if s["failed"] else "", ["-"] * len(cols[suite])
            if suite == "empa":
                units = f" ({s['units']} scenarios, {s['n']} dialogues)"        # the interval is over scenarios
                cells += [fmt(s["EPM"]) + units + failed, f"{100 * s['success'][0]:.2f}"] if s["n"] else miss
            elif suite == "eqbench3":
                unscored = f"; {s['unscored']} analysis not scored (needs an LLM judge)" if s.get("unscored") else ""
                cells += [(fmt(s["score"], s["n"]) if s["n"] else "-") + failed + unscored]
            elif suite == "sage":
                cells += ([fmt(s["sentient"], s["n"]) + failed, f"{s['successes']} / {s['failures']}"]
                          if s["n"] else miss)
            else:
                cells += [fmt(s[t], s[t + "_n"]) if t in s else "-" for t in ("EU", "EA")]
        lines.append(f"| {model} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_results(run_dir: Path, args) -> str:
    records = list(last_records(run_dir).values())
    models = ["base"] + list(args.adapters) + sorted({r["model"] for r in records} - {"base", *args.adapters})
    summary = {m: {s: summarize([r for r in records if r["model"] == m and r["suite"] == s], s) for s in args.suites}
               for m in models if any(r["model"] == m for r in records)}
    table = results_table(summary, args.suites)
    compared, comparison = compare_with_base(records, args.adapters)
    md = ["# Evaluation", "", f"command: `python 05_eval.py {' '.join(sys.argv[1:])}`", "", table, "",
          "mean ± 95% t interval over independent units (EMPA: scenarios, their K dialogues averaged first; "
          "EQ-Bench 3: tasks; SAGE: profiles; EmoBench: items); n = cases kept (for EMPA, its scenarios and their "
          "dialogues); failed cases are excluded and counted."]
    if EQ_PROXY in table:
        md += ["", f"{EQ_PROXY}: MDEP-PR levels stand in for the criteria (not EQ-Bench); analysis needs an LLM judge."]
    rows = [(m, by["empa"]) for m, by in summary.items() if by.get("empa", {}).get("n")]
    if rows:
        md += ["", "EMPA details (means over scenarios; the indices are scaled to 0-100, and RDI, tau and R_pen "
                   "can fall below 0, E_total rise above 100)", "",
               "| model | outcomes | " + " | ".join(k.replace("_idx", "") for k in EPM_KEYS[1:]) + " |",
               "|---" * (len(EPM_KEYS) + 1) + "|"]
        md += [f"| {m} | {json.dumps(e['outcomes'])} | " + " | ".join(f"{e[k][0]:.2f}" for k in EPM_KEYS[1:]) + " |"
               for m, e in rows]
    md += ["", "```", *compared, "```"] if compared else []
    for m, by in summary.items():
        q, b = by.get("eqbench3", {}), by.get("emobench", {})
        line = lambda d, p: ", ".join(f"{k} {v:.{p}f}" for k, v in d.items())  # noqa: E731
        md += ["", f"{m}, EQ-Bench 3 by task kind: {line(q['by_kind'], 2)}"] if q.get("n") else []
        for t in (t for t in ("EU", "EA") if t in b):
            md += ["", f"{m}, EmoBench {t} accuracy % by category: {line(b[t + '_by_category'], 1)}; by language: "
                       f"{line(b[t + '_by_language'], 1)}"]
    common.atomic_write(run_dir / "results.md", "\n".join(md) + "\n")
    common.atomic_write(run_dir / "results.json", json.dumps(
        {"args": common.public_args(args), "columns": table.split("\n")[0].strip("| ").split(" | "),
         "summary": summary, "comparison": comparison, "cases": records}, indent=1, ensure_ascii=False, default=str))
    for suite, key, ylabel, name in (("empa", "distances", "hinge distance d(P_t)", "distance_per_turn.png"),
                                     ("sage", "emotions", "user emotion e_t", "emotion_per_turn.png")):
        series = {m: runs for m in models
                  if (runs := [r[key] for r in records if r["model"] == m and r["suite"] == suite
                               and not r.get("failed")])}
        if series:
            plot_series(series, ylabel, run_dir / name)
    if comparison:                 # the comparison as a picture, and one held-out case of each model
        draw_comparison(comparison, run_dir / "comparison.png")
        dialogues = {(t["model"], t["case"]): t for t in read_lines(run_dir / "transcripts.jsonl")
                     if t["suite"] == "empa"}
        case = next(c for m, c in dialogues if m == "base" and all((a, c) in dialogues for a in comparison))
        draw_trajectories({m: dialogues[m, case] for m in ["base", *comparison]}, run_dir / "trajectories.png")
        compared += ["", f"one held-out dialogue, {case} (the same scenario, k and seed), "
                         "the distance after each turn:"]
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
        text = f"user: {tu['user']}\nreply: {tu['assistant']}\nd(P_{tu['t']}) = {tu['distance']}"
        return [w for line in text.split("\n") for w in textwrap.wrap(line, width) or [""]]

    title = f"base, d(P_0) = {left['initial_distance']}"
    out = [f"{title:<{width}} | adapter, d(P_0) = {right['initial_distance']}"]
    for t in range(max(len(left["turns"]), len(right["turns"]))):
        out.append(f"{'-- turn ' + str(t + 1):<{width}} | -- turn {t + 1}")
        rows = itertools.zip_longest(column(left, t), column(right, t), fillvalue="")
        out += [f"{a:<{width}} | {b}" for a, b in rows]
    return out


def draw_comparison(comparison: dict, path: Path):
    """comparison.png: per measure, the base and each adapter, their means with the 95% t interval over
    scenarios (written to a temporary file, then renamed)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    adapters = list(comparison)
    fig, axes = plt.subplots(1, len(PAIRED), figsize=(4.2 * len(PAIRED), 3.4), squeeze=False)
    for ax, (key, label, higher) in zip(axes[0], PAIRED):
        first = comparison[adapters[0]][key]
        points = [("base", first["base_ci"])] + [(Path(a).parent.name or a, comparison[a][key]["adapter_ci"])
                                                 for a in adapters]
        for x, (name, (mean, half)) in enumerate(points):
            ax.errorbar([x], [mean], yerr=[[half or 0.0], [half or 0.0]], fmt="o", capsize=5)
        ax.set_xticks(range(len(points)), [name for name, _ in points], fontsize=7, rotation=15)
        ax.set_title(f"{label} ({'higher' if higher else 'lower'} is better)", fontsize=9)
        ax.tick_params(labelsize=7)
    fig.suptitle(f"held out: mean and 95% t interval over {first['scenarios']} scenarios "
                 f"({first['dialogues']} dialogues a model)", fontsize=9)
    fig.tight_layout()
    common.save_figure(fig, path)


def draw_trajectories(dialogues: dict, path: Path):
    """trajectories.png: one held-out case of each model, the state C, A, P after each turn (0: P0)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(dialogues), figsize=(4 * len(dialogues), 3.2), squeeze=False, sharey=True)
    for ax, (model, rec) in zip(axes[0], dialogues.items()):
        states = [rec["p0"]] + [tu["state"] for tu in rec["turns"]]
        for i, axis in enumerate(env.AXES):
            ax.plot(range(len(states)), [P[i] for P in states], marker="o", markersize=3, label=axis)
        ax.axhline(0, color="0.6", linewidth=0.6)
        ax.set_title(f"{'base' if model == 'base' else Path(model).parent.name}: {rec['outcome']}", fontsize=8)
        ax.set_xlabel("turn", fontsize=8), ax.tick_params(labelsize=7)
    axes[0][0].set_ylabel("state P_t (the goal: every axis >= -eps)", fontsize=8), axes[0][0].legend(fontsize=7)
    fig.suptitle(f"one held-out case, {rec['scenario_id']}#{rec['k']}, each model (the same seed)", fontsize=9)
    fig.tight_layout()
    common.save_figure(fig, path)


def plot_series(series: dict, ylabel: str, path: Path, xlabel: str = "turn (0 = before the first reply)"):
    """series: {model: [one list of values by turn per case]} -> per turn the mean and a +-1 sd band over the
    cases still going, one line per model (a PNG at path). experiments/credit.py draws its seeds' learning
    curves with it (its x axis: the evaluation step)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for label, runs in series.items():
        rows = [[r[t] for r in runs if len(r) > t] for t in range(max(len(r) for r in runs))]
        means = [sum(v) / len(v) for v in rows]
        sds = [common.mean_std(v)[1] if len(v) > 1 else 0.0 for v in rows]
        ax.plot(range(len(rows)), means, label=f"{label} (n={len(runs)})")
        ax.fill_between(range(len(rows)), [m - s for m, s in zip(means, sds)], [m + s for m, s in zip(means, sds)],
                        alpha=0.2)
    ax.set_xlabel(xlabel), ax.set_ylabel(ylabel)
    ax.set_title(f"{ylabel}: mean and ±1 sd over those still going"), ax.legend(fontsize=8)
    ax.xaxis.get_major_locator().set_params(integer=True)
    fig.tight_layout()
    common.save_figure(fig, path)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    common.add_model_args(p)
    env.add_env_args(p, scenarios_default=str(HERE / "data" / "scenarios_test.jsonl"), k_default=1)
    # EMPA's benchmark rules; room for 45 turns (capped at the model's window)
    p.set_defaults(max_turns=45, min_turns=12, collapse_window=5, max_context=8192)
    g = p.add_argument_group("evaluation")
    g.add_argument("--suite", default=",".join(SUITES), help="comma-separated suites: " + ", ".join(SUITES))
    g.add_argument("--adapters", nargs="*", default=[], help="peft adapter folders, evaluated after the base model")
    g.add_argument("--max-cases", type=int, default=0, help="at most this many cases per suite and file, sampled "
                   "by --seed and stratified by language and category (EMPA, EQ-Bench: by kind; EMPA: scenarios, K "
                   "dialogues each); 0 = all")
    g.add_argument("--batch-size", type=int, default=8, help="cases generated together (EmoBench: options scored "
                   "together after their shared prompt); saved after each batch")
    g.add_argument("--r-pen", choices=["levels", "points"], default="levels", help="EPM R_pen counts negative "
                   "levels or points")
    g.add_argument("--s-proj", choices=["goal", "step"], default="goal",
                   help="EPM S_proj direction u_t: goal v* = -P0/||P0||, or step -P_{t-1}/||P_{t-1}||")
    for flag, name, what in (("--eqbench3", "eqbench3_sample.txt", "EQ-Bench 3 scenario_prompts.txt (the default: a "
                              "4-scenario sample written for this project)"),
                             ("--sage-profiles", "sage_profiles.jsonl", "SAGE profiles JSONL"),
                             ("--emobench-eu", "emobench_eu.jsonl", "EmoBench EU JSONL"),
                             ("--emobench-ea", "emobench_ea.jsonl", "EmoBench EA JSONL")):
        g.add_argument(flag, default=str(HERE / "data" / "eval" / name), help=what)
    g.add_argument("--sage-turns", type=int, default=10, help="SAGE: turns before the episode stops")
    g.add_argument("--sage-start", type=float, default=40.0, help="SAGE: the user's starting emotion (0-100)")
    common.add_run_args(p, "eval", resume="a run folder of this script: finish its unfinished cases")
    args = p.parse_args(argv)
    env.check_env_args(args)
    c = common.check
    args.suites = [s.strip() for s in args.suite.split(",") if s.strip()]
    bad = [s for s in args.suites if s not in SUITES]
    c(args.suites and not bad, f"--suite: unknown suite(s) {bad or args.suite!r}; choose from {', '.join(SUITES)}")
    c(args.adapter is None,
      "--adapter is for training; 05_eval.py takes --adapters A B ... (the base is always evaluated)")
    for a in args.adapters:
        c(os.path.exists(os.path.join(a, "adapter_config.json")), f"--adapters {a}: no adapter_config.json there")
    c(len(set(args.adapters)) == len(args.adapters) and "base" not in args.adapters, "--adapters: each folder once")
    c(args.max_cases >= 0, f"--max-cases must be >= 0, got {args.max_cases}")
    c(args.batch_size >= 1, f"--batch-size must be >= 1, got {args.batch_size}")
    c(args.sage_turns >= 1, f"--sage-turns must be >= 1, got {args.sage_turns}")
    c(0 <= args.sage_start <= 100, f"--sage-start must be in [0, 100], got {args.sage_start}")
    return args


def load_suite_data(args) -> dict:
    """Every input the chosen suites need, checked (errors name file:line and field), sampled (--max-cases)."""
    data = {}
    if "empa" in args.suites:
        data["empa"] = sample_cases(env.load_scenarios(args.scenarios), args, "empa", lambda s: (s.get("kind", ""),))
    if "eqbench3" in args.suites:
        tasks, stats = load_eqbench3(args.eqbench3)
        print(f"eqbench3: read {stats['scenarios']} scenarios and {stats['prompts']} prompts from {args.eqbench3} "
              f"({stats['ignored_lines']} lines outside prompts, {stats['empty_scenarios']} scenarios without prompts "
              f"and {stats['duplicates']} duplicate ids skipped)")
        data["eqbench3"] = sample_cases(tasks, args, "eqbench3", lambda t: (t["kind"],))
    if "sage" in args.suites:
        data["sage"] = sample_cases(load_sage_profiles(args.sage_profiles), args, "sage", lambda p: (p["language"],))
    if "emobench" in args.suites:
        data["emobench"] = [it for kind in ("EU", "EA") for it in sample_cases(
            load_emobench(getattr(args, f"emobench_{kind.lower()}"), kind), args, f"emobench {kind}",
            lambda it: (it["language"], it.get("coarse_category", it.get("category"))))]
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
    label = lambda u: "/".join(map(str, strata(u)))  # noqa: E731
    have, taken = Counter(map(label, units)), Counter(map(label, picked))      # units per stratum
    print(f"{name}: --max-cases {n} of {len(units)}, stratified (seed {args.seed}): "
          + ", ".join(f"{k} {taken[k]}/{have[k]}" for k in have))
    return picked


if __name__ == "__main__":
    common.run_main(main)

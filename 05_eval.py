"""05_eval.py: evaluate the base model and trained adapters side by side (EMPA, EQ-Bench 3, SAGE, EmoBench).

What it does
  Loads the base model once, evaluates it, then switches to each --adapters folder (peft) and evaluates
  it the same way, with the same seeds. Suites (--suite, comma-separated; details: docs/evaluation.md):
    empa      03's rollout on the held-out scenarios, the benchmark's rules (45 turns, no end before turn 12,
              collapse window 5, --max-context 8192 capped at the window): outcomes, EPM sub-metrics and index.
    eqbench3  scenario_prompts.txt: each scenario's fixed user turns played to the model, the judge scores
              the task's six criteria 0-20 (role-play and drafting, or analysis: ids 401-420).
    sage      SAGE / RLVER profiles on 03's rollout: emotion from 40, at most +-10 a turn, 10 turns.
    emobench  EmoBench EU (emotion and cause) and EA (best response or action), multiple choice.
  Every finished case is appended to cases.jsonl at once, so --resume RUN skips it after a kill;
  --max-cases N samples N cases per suite and file, stratified by language and category, by --seed.

Reads   --scenarios, --eqbench3 (a scenario_prompts.txt; a 4-scenario sample ships), --sage-profiles
        (JSONL: id, player, scene, main_cha, cha_group, task, first_talk?), --emobench-eu/-ea (JSONL with
        EmoBench's fields, or a hub dataset owner/name[:config[:split]]); UTF-8, a BOM or CRLF is fine.
Writes  runs/<name>-<time>/: args.json, cases.jsonl, transcripts.jsonl, results.json, results.md (the
        table), distance_per_turn.png, emotion_per_turn.png, and with --rubrics-from (04's rollouts.jsonl
        of a --reward care run) rubric_by_turn / rubric_by_emotion (.png and .json).

Equations (docs/reference.md sections 3, 4, 6; r0 = ||P0||, rho_max = sqrt(12), alpha_s = 1.5, beta = 1.2)
  EPM-Index  = 0.4 Outcome + 0.2 Efficiency + 0.4 Stability, each the mean of three indices, per case,
               then averaged over cases:
  Outcome    RDI = (||P0|| - ||P_T||) / ||P0||  -> (RDI + 1)/2 * 100;   E_total = sum_t v_t . v*  ->
             max(0, E_total)/(beta r0) * 100;   S_net = sum_t sum_axis v_t,axis -> max(0, S_net)/(alpha_s r0) * 100
  Efficiency rho = E_total / T -> max(0, rho)/rho_max * 100;   S_proj = (1/T) sum_t v_t . u_t ->
             max(0, S_proj)/rho_max * 100;   tau = sum_t ||v_t|| / ||P0 - P_T|| -> (3 - tau)/2 * 100
  Stability  R_pos = share of turns with dE_t > 0 -> R_pos * 100;   Align = (1/T) sum_t dE_t/||v_t||
             (0 when v_t = 0) -> (Align + 1)/2 * 100;   R_pen = (1/T) sum_t sum_axis |negative level| ->
             (3 - R_pen)/3 * 100
  EQ-Bench 3 score = 5 * mean over tasks of (mean of the task's criterion scores, each 0-20)
  SAGE       e_0 = 40, e_t = min(100, max(0, e_{t-1} + clip(change_t, -10, 10))); ends at e >= 100
             (success), e < 10 (failure) or after --sage-turns; Sentient score = mean final emotion
  EmoBench   accuracy; an EU item is correct only when the emotion and the cause are both right
  95% CI     mean +- 1.96 * sd / sqrt(n) over cases (sample sd), shown when n >= 2

Choices and departures (numbered as in docs/evaluation.md, where each is in full)
  1. S_proj's u_t = v* (--s-proj step: -P_{t-1}/||P_{t-1}||); R_pen counts levels (--r-pen points).
  2. tau undefined (P_T = P0): its index is 0; no index is clamped.  3. Judge-failed turns are left out;
     a case with no judged turn, or whose user failed, is excluded and counted.  4. SAGE runs on 03's
     rollout; offline its emotion change comes from the levels (English only); without first_talk the
     user opens with what an LLM user writes from the profile (offline: a line naming main_cha), never
     the scene.  5. EQ-Bench 3 offline is a PROXY of the embed judge's levels; analysis tasks are not
     scored.  6. EmoBench scores options by mean log-probability, each prompt computed once.

CPU:  python 05_eval.py --adapters runs/mica-20261130-120000/adapter      (SmolLM2, embed judge, scripted user)
GPU:  python 05_eval.py --model Qwen2.5-7B-Instruct --adapters runs/mica-A/adapter runs/grpo-B/adapter \\
          --judge api:Qwen2.5-72B-Instruct --user api:Qwen2.5-72B-Instruct --api-base http://localhost:8000/v1 \\
          --eqbench3 path/to/scenario_prompts.txt --emobench-eu EU.jsonl --emobench-ea EA.jsonl --max-new-tokens 512
"""
from __future__ import annotations

import argparse
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

pref = importlib.import_module("02_rubric_pref_rl")  # the rubric weight tables and plots (04's rubrics)
env = importlib.import_module("03_rollout")          # the environment: scenarios, judges, users, rollout
HERE = Path(__file__).resolve().parent
SUITES = ("empa", "eqbench3", "sage", "emobench")
RHO_MAX, ALPHA_S, BETA = math.sqrt(12), 1.5, 1.2
EPM_KEYS = ("EPM", "Outcome", "Efficiency", "Stability", "RDI_idx", "E_total_idx", "S_net_idx", "rho_idx", "S_proj_idx",
            "tau_idx", "R_pos_idx", "Align_idx", "R_pen_idx", "turns", "final_distance")    # summarised per case
EQ_PROXY = "EQ-Bench 3 (offline proxy)"   # the column when the embed judge's levels stood in for the criteria
# EmoBench's question templates ("en", "zh"), EQ-Bench 3's criteria (roleplay / analysis) and the axis that
# stands in for each in the offline proxy, the judges' and SAGE's prompts (lists of lines), the offline
# SAGE opening and the scripted user's lines for Chinese SAGE profiles
TEXTS = json.loads((HERE / "data" / "eval" / "prompts.json").read_text(encoding="utf-8-sig"))
TEXTS.update({k: "\n".join(TEXTS[k]) for k in ("eqbench3_judge", "sage_judge", "sage_first_message")})
ROLEPLAY_CRITERIA, ANALYSIS_CRITERIA = (tuple(TEXTS["eqbench3_criteria"][k]) for k in ("roleplay", "analysis"))
CRITERION_AXIS = TEXTS["eqbench3_proxy_axis"]


# ---------------------------------------------------------------------------------------------
# The equations: EPM metrics (EMPA), one function per index group, then the index
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
    E_total = 0.0
    for v in vs:
        E_total += sum(v[i] * v_star[i] for i in range(3))
    # S_net = sum_t sum_axis v_t,axis     -> max(0, S_net)/(alpha_s r0) * 100
    S_net = 0.0
    for v in vs:
        S_net += sum(v)
    return {"RDI": RDI, "E_total": E_total, "S_net": S_net, "RDI_idx": (RDI + 1) / 2 * 100,
            "E_total_idx": max(0.0, E_total) / (BETA * r0) * 100, "S_net_idx": max(0.0, S_net) / (ALPHA_S * r0) * 100}


def epm_efficiency(P0, vs, s_proj="goal") -> dict:
    T, r0 = len(vs), env.norm(P0)
    v_star = [-x / r0 for x in P0]
    # rho = E_total / T                   -> max(0, rho)/rho_max * 100
    E_total = 0.0
    for v in vs:
        E_total += sum(v[i] * v_star[i] for i in range(3))
    rho = E_total / T
    # S_proj = (1/T) sum_t v_t . u_t,  u_t = v* ("goal") or -P_{t-1}/||P_{t-1}|| ("step", 0 at the origin)
    S, P_prev = 0.0, list(P0)
    for v in vs:
        n = env.norm(P_prev)
        u = v_star if s_proj == "goal" else ([-x / n for x in P_prev] if n > 0 else [0.0, 0.0, 0.0])
        S += sum(v[i] * u[i] for i in range(3))
        P_prev = [P_prev[i] + v[i] for i in range(3)]
    S_proj = S / T
    # tau = sum_t ||v_t|| / ||P0 - P_T||  -> (3 - tau)/2 * 100; undefined when P_T = P0: index 0
    path = sum(env.norm(v) for v in vs)
    net = env.norm([P_prev[i] - P0[i] for i in range(3)])
    tau = path / net if net > 1e-12 else None
    return {"rho": rho, "S_proj": S_proj, "tau": tau, "rho_idx": max(0.0, rho) / RHO_MAX * 100,
            "S_proj_idx": max(0.0, S_proj) / RHO_MAX * 100, "tau_idx": (3 - tau) / 2 * 100 if tau is not None else 0.0}


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
        for a in env.AXES:
            neg = lv[a][1]
            pen += neg if r_pen == "levels" else -env.NEGATIVE_POINTS[a][neg]
    R_pos, Align, R_pen = pos / T, align / T, pen / T
    return {"R_pos": R_pos, "Align": Align, "R_pen": R_pen, "R_pos_idx": R_pos * 100,
            "Align_idx": (Align + 1) / 2 * 100, "R_pen_idx": (3 - R_pen) / 3 * 100}


def epm_index(P0, vs, levels, r_pen="levels", s_proj="goal") -> dict:
    """Every EPM metric of one case; vs and levels hold the judged turns only (at least one)."""
    m = {**epm_outcome(P0, vs), **epm_efficiency(P0, vs, s_proj), **epm_stability(P0, vs, levels, r_pen)}
    # each group is the mean of its three indices; EPM = 0.4 Outcome + 0.2 Efficiency + 0.4 Stability
    m["Outcome"] = (m["RDI_idx"] + m["E_total_idx"] + m["S_net_idx"]) / 3
    m["Efficiency"] = (m["rho_idx"] + m["S_proj_idx"] + m["tau_idx"]) / 3
    m["Stability"] = (m["R_pos_idx"] + m["Align_idx"] + m["R_pen_idx"]) / 3
    m["EPM"] = 0.4 * m["Outcome"] + 0.2 * m["Efficiency"] + 0.4 * m["Stability"]
    return m


def mean_ci(xs) -> tuple[float, float | None]:
    # mean +- 1.96 * sd / sqrt(n), sd with ddof = 1; no interval below 2 cases
    n = len(xs)
    if n < 2:
        return sum(xs) / n, None
    mean, sd = common.mean_std(xs, ddof=1)
    return mean, 1.96 * sd / math.sqrt(n)


# ---------------------------------------------------------------------------------------------
# The main loop
# ---------------------------------------------------------------------------------------------
def main(argv=None):
    args = parse_args(argv)
    common.set_seed(args.seed)
    # 1. read and validate every input before anything is created
    data = load_suite_data(args)
    common.check_model_args(args)       # --model, --adapter, an hf: judge / user, bitsandbytes for 4-bit
    # 2. the run folder (new, or the one to resume: its finished cases are skipped)
    run_dir = common.open_run(args, ("cases.jsonl", "transcripts.jsonl"))
    done = {k for k, r in last_records(run_dir).items() if not r.get("failed")}
    if args.resume:
        print(f"resume {run_dir}: {len(done)} finished cases are skipped")
    # 3. the base model, loaded once, then judge and user (for the suites that need them; self: that base)
    model, tok = common.load_policy(args, trainable=False)
    judge = env.make_judge(args, (model, tok)) if {"empa", "eqbench3", "sage"} & set(args.suites) else None
    user = env.make_user(args, (model, tok)) if {"empa", "sage"} & set(args.suites) else None
    window = getattr(model.config, "max_position_embeddings", None)
    if window and args.max_context > window:
        print(f"--max-context {args.max_context} is above the model's window: using {window}")
        args.max_context = window
    print(f"run folder {run_dir} | models: {', '.join(['base'] + args.adapters)} | device {common.pick_device()}")
    try:
        for label, adapter in [("base", None)] + [(a, a) for a in args.adapters]:
            # 4. switch to this model's adapter (peft keeps the base weights, one adapter active)
            if adapter is not None:
                model = common.switch_adapter(model, adapter, f"a{args.adapters.index(adapter)}")
            for suite in args.suites:
                # 5. the suite's unfinished cases, in batches; each batch is saved as soon as it is done
                units = data[suite]
                todo = [u for u in units if not all((label, suite, c) in done for c in case_ids(suite, u, args.k))]
                bar = tqdm(total=len(units), initial=len(units) - len(todo), desc=f"{label} {suite}",
                           disable=not args.progress)
                for start in range(0, len(todo), args.batch_size):
                    batch = todo[start:start + args.batch_size]
                    # same seed per batch for every model: paired comparisons
                    torch.manual_seed(zlib.crc32(f"{args.seed}|{suite}|{case_ids(suite, batch[0], 1)[0]}".encode()))
                    cases, transcripts = run_suite(suite, model, tok, batch, judge, user, args)
                    tag = {"model": label, "suite": suite}
                    common.append_jsonl(run_dir / "transcripts.jsonl", [{**tag, **t} for t in transcripts])
                    common.append_jsonl(run_dir / "cases.jsonl", [{**tag, **c} for c in cases])
                    bar.update(len(batch))
                bar.close()
    except common.UserError as e:
        # e.g. the judge's endpoint went down: keep what was finished, then stop with the one message
        write_results(run_dir, args)
        raise common.UserError(f"{e}; the finished cases are saved: continue with --resume {run_dir}") from None
    # 6. aggregate: results.json, results.md, plots; print the table
    table = write_results(run_dir, args)
    print(f"\n{table}\n\nwritten to {run_dir} (results.md, results.json, cases.jsonl, plots)")


# ---------------------------------------------------------------------------------------------
# --- supporting pieces ---: the suites, loaders, judge answers, results and plots, CLI
# ---------------------------------------------------------------------------------------------
def case_ids(suite, unit, k) -> list[str]:
    """The cases one unit of work yields: an EMPA scenario gives K dialogues, anything else one case."""
    return [f"{unit['id']}#{i}" for i in range(k)] if suite == "empa" else [unit.get("case", unit.get("id"))]


def run_suite(suite, model, tok, batch, judge, user, args) -> tuple[list[dict], list[dict]]:
    if suite != "emobench":
        return {"empa": empa_cases, "eqbench3": eqbench3_cases, "sage": sage_cases}[suite](model, tok, batch, judge, user, args)
    return [c for kind in ("EU", "EA") for c in emobench_cases([it for it in batch if it["case"].startswith(kind + "-")],
                                                               kind, lambda qs: answer_mcq(model, tok, qs, args), args.mcq)], []


# the suites: each evaluates a batch of cases and returns their records
def empa_cases(model, tok, scenarios, judge, user, args) -> tuple[list[dict], list[dict]]:
    """03's rollout with the benchmark rules; one case per (scenario, k)."""
    trajs = env.rollout(model, tok, scenarios, judge, user, args, desc="empa turns")
    cases, transcripts = [], []
    for tr in trajs:
        rec = env.trajectory_record(tr, args)
        judged = [(v, lv) for v, lv in zip(tr.vs, tr.levels) if v is not None]
        case = {"case": f"{tr.scenario['id']}#{tr.k}", "outcome": tr.outcome, "turns": tr.T,
                "judged_turns": len(judged), "final_distance": rec["final_distance"],
                "distances": [rec["initial_distance"]] + [t["distance"] for t in rec["turns"]],
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
        live = [j for j, t in enumerate(tasks) if i < len(t["prompts"]) and not cut[j]]
        ctx = []
        for j in list(live):
            ids = common.render_ids(tok, convs[j] + [{"role": "user", "content": tasks[j]["prompts"][i]}])
            if len(ids) + args.max_new_tokens > args.max_context:
                cut[j] = True                         # later turns do not fit: judged on what was played
                live.remove(j)
            else:
                ctx.append(ids)
        replies = common.generate_batch(model, tok, ctx, args.max_new_tokens, args.temperature, args.top_p) if live else []
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
    # 3. score = 5 * mean of the task's criterion scores
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
    """Offline proxy (not EQ-Bench): MDEP-PR levels of every reply -> per axis clip(10 + 5 (progress -
    negative), 0, 20) -> each criterion the mean of its axis over the replies. A reply that is not language
    (the judge's fluency check: gibberish, keyword salad) scores as an empty one: negative 1 on every axis."""
    fluency_min = getattr(judge, "th", {}).get("fluency", 0.0)
    cases, owner = [], []
    for j, c in enumerate(convs):
        for i in range(1, len(c), 2):
            cases.append({"scenario": {"id": str(j), "persona": "", "situation": ""}, "history": c[:i],
                          "reply": c[i]["content"]})
            owner.append(j)
    verdicts = judge.judge(cases) if cases else []
    per_axis = [{a: [] for a in env.AXES} for _ in convs]
    for j, v in zip(owner, verdicts):
        if v is not None:
            not_language = v["features"].get("fluency", 1.0) < fluency_min
            for a in env.AXES:
                progress, negative = (0, 1) if not_language else v["levels"][a]
                per_axis[j][a].append(max(0.0, min(20.0, 10.0 + 5.0 * (progress - negative))))
    # each criterion: the mean over the replies of its stand-in axis (None: no reply judged)
    return [{x: statistics.mean(per_axis[j][CRITERION_AXIS[x]]) for x in cr} if all(per_axis[j].values()) else None
            for j, cr in enumerate(criteria)]


def sage_scenario(p: dict, written: str | None = None) -> dict:
    """A profile as 03's rollout and users see a scenario; p0 = 0 (the user's state is its emotion). The user
    opens with first_talk, else what an LLM user wrote (sage_openings), else a short line naming main_cha:
    never with the scene, the simulator's private background."""
    zh = p["language"] == "zh"                        # set by load_sage_profiles
    offline = TEXTS["sage_offline_opening"][p["language"]].format(name=p["main_cha"].strip())
    opening, source = ((p["first_talk"], "first_talk") if (p.get("first_talk") or "").strip() else
                       (written, "user model") if written else (offline, "offline line"))
    return {"id": p["id"], "persona": p["player"], "situation": f"{p['scene']} {p['task']}", "profile": p,
            "opening": opening, "opening_from": source, "p0": [0.0, 0.0, 0.0],
            "user_lines": TEXTS["sage_zh_lines"] if zh else env.DEFAULT_USER_LINES}


def sage_openings(profiles, user, args) -> dict:
    """{id: the first message} of the profiles without first_talk, written by the LLM user (any user with
    a chat backend) from the profile, as SAGE's simulator does; re-asked (--judge-retries) when empty or
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
    emotion (JSON, parsed, asked again when malformed). It gives no EMPA levels (v_t = 0)."""

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
    """03's rollout with SAGE's rules: one dialogue per profile, e_0 = --sage-start, at most --sage-turns,
    ending at e >= 100 or e < 10. The change is the LLM judge's (SageJudge), or offline derived from the
    embed judge's levels: change_t = clip(2.5 * sum_axis v_t,axis, -10, 10) (03's emotion_change)."""
    sage_args = argparse.Namespace(**{**vars(args), "k": 1, "max_turns": args.sage_turns,
                                      "emotion_start": args.sage_start, "emotion_ends": True})
    if isinstance(judge, env.LLMJudge):
        judge = SageJudge(judge.backend, args.judge_retries)
    written = sage_openings(profiles, user, args)
    trajs = env.rollout(model, tok, [sage_scenario(p, written.get(p["id"])) for p in profiles], judge, user, sage_args,
                        desc="sage turns")
    cases, transcripts = [], []
    for tr in trajs:
        changes = [e1 - e0 for e0, e1, v in zip(tr.emotions, tr.emotions[1:], tr.vs) if v is not None]
        failed = "user failed" if tr.outcome == "user_failed" else "judge failed on every turn" if not changes else None
        cases.append({"case": tr.scenario["id"], "opening": tr.scenario["opening_from"], "outcome": tr.outcome,
                      "turns": tr.T, "judged_turns": len(changes), "final_emotion": tr.emotions[-1],
                      "emotions": tr.emotions, "changes": changes, "failed": failed})
        transcripts.append({"case": tr.scenario["id"], **env.trajectory_record(tr, sage_args)})
    return cases, transcripts


def mcq_prompt(item, question, options, mode, emotion=None) -> str:
    T = TEXTS["emobench"]["zh" if item["language"].lower().startswith(("zh", "ch")) else "en"]
    lettered = "\n".join(f"{chr(65 + i)}. {o}" for i, o in enumerate(options))
    qtype = item.get("question type", "").strip().lower()
    text = T[question].format(scenario=item["scenario"], subject=item["subject"], emotion=emotion or T["this"],
                              qtype=T["qtypes"].get(qtype, qtype))           # EA's type in the prompt's language
    return text + T["choices"].format(choices=lettered) + T[mode]


def emobench_cases(items, kind, choose, mode="loglik") -> list[dict]:
    """choose(questions) -> the chosen option index (or None) per {prompt, options} question. EU asks the
    emotion, then the cause naming the chosen emotion; it is correct only when both are right."""
    head = lambda it: {"case": it["case"], "task": kind, "language": it["language"], "failed": None,  # noqa: E731
                       "category": it["category"] if kind == "EA" else it["coarse_category"]}
    if not items:
        return []
    if kind == "EA":
        picks = choose([{"prompt": mcq_prompt(it, "EA", it["choices"], mode), "options": it["choices"]} for it in items])
        return [{**head(it), "pred": None if p is None else it["choices"][p], "answered": p is not None,
                 "correct": int(p is not None and it["choices"][p] == it["label"])} for it, p in zip(items, picks)]
    emo = choose([{"prompt": mcq_prompt(it, "emotion", it["emotion_choices"], mode), "options": it["emotion_choices"]}
                  for it in items])
    named = [None if p is None else it["emotion_choices"][p] for it, p in zip(items, emo)]
    cause = choose([{"prompt": mcq_prompt(it, "cause", it["cause_choices"], mode, e), "options": it["cause_choices"]}
                    for it, e in zip(items, named)])
    out = []
    for it, e, c in zip(items, named, cause):
        emotion_ok = e == it["emotion_label"]
        cause_ok = c is not None and it["cause_choices"][c] == it["cause_label"]
        out.append({**head(it), "pred": [e, None if c is None else it["cause_choices"][c]],
                    "answered": e is not None and c is not None, "emotion_correct": int(emotion_ok),
                    "cause_correct": int(cause_ok), "correct": int(emotion_ok and cause_ok)})
    return out


def parse_choice(text: str, options: list[str]) -> int | None:
    """A generated answer -> option index: a leading letter, else the option's text, else a lone letter."""
    text, letters = text.strip(), "".join(chr(65 + i) for i in range(len(options)))
    m = re.match(rf"^\(?([{letters}])(?:[).:\s]|$)", text)
    if m:
        return ord(m.group(1)) - 65
    hits = [i for i, o in enumerate(options) if o.strip().lower() in text.lower()]
    if len(hits) == 1:
        return hits[0]
    m = re.search(rf"\b([{letters}])\b", text)
    return ord(m.group(1)) - 65 if m else None


@torch.no_grad()
def answer_mcq(model, tok, questions, args) -> list[int | None]:
    """loglik: the option with the highest mean log-probability (common.option_logliks); generate: greedy, letter parsed."""
    if args.mcq == "loglik":
        return [max(range(len(s)), key=s.__getitem__) for s in common.option_logliks(model, tok, questions, args.batch_size)]
    ctx = [common.render_ids(tok, [{"role": "user", "content": q["prompt"]}]) for q in questions]
    replies = common.generate_batch(model, tok, ctx, 16, 0.0)
    return [parse_choice(tok.decode(ids, skip_special_tokens=True), q["options"])
            for (ids, _), q in zip(replies, questions)]


# loaders: EQ-Bench 3 text, SAGE profiles, EmoBench EU / EA
def load_eqbench3(path) -> tuple[list[dict], dict]:
    """scenario_prompts.txt -> tasks {id, category, title, kind, prompts, _where} and counts. Headers are
    8 '#' then `id | category | title` (spacing, extra or missing fields tolerated); turn markers are 7 '#'
    then `Prompt<N>` or `<N>`. Lines outside a prompt and scenarios without prompts are counted, skipped."""
    tasks, stats, cur, prompt = [], {"ignored_lines": 0, "empty_scenarios": 0, "duplicates": 0}, None, None
    for lineno, line in common.text_lines(path):
        head = re.match(r"^\s*#{8}(?!#)\s*(.*)$", line)
        turn = re.match(r"^\s*#{7}(?!#)\s*(?:prompt\s*)?(\d+)\s*:?\s*$", line, re.I)
        if head:
            parts = [x.strip() for x in head.group(1).split("|")]
            category = parts[1] if len(parts) > 2 else ""
            title = " | ".join(parts[2:]) if len(parts) > 2 else (parts[1] if len(parts) == 2 else "")
            sid = parts[0] or f"line{lineno}"
            kind = ("analysis" if (sid.isdigit() and 401 <= int(sid) <= 420) or "analys" in category.lower()
                    else "drafting" if "draft" in category.lower() else "roleplay")
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


def load_emobench(spec: str, kind: str) -> list[dict]:
    path = common.hub_dataset_file(spec, f"--emobench-{kind.lower()}")
    recs = common.read_jsonl(path, EMOBENCH_FIELDS[kind], unique=("language", "qid"))
    pairs = [("emotion_choices", "emotion_label"), ("cause_choices", "cause_label")] if kind == "EU" \
        else [("choices", "label")]
    for r in recs:
        for choices, label in pairs:
            ok = len(r[choices]) >= 2 and all(isinstance(c, str) and c.strip() for c in r[choices])
            common.check(ok, f"{r['_where']}: field '{choices}' must be a list of 2+ non-empty strings")
            common.check(r[label] in r[choices], f"{r['_where']}: field '{label}' is not one of '{choices}'")
        r["case"] = f"{kind}-{r['language']}-{r['qid']}"
    return recs


# LLM judge answers: JSON out of free text
def parse_criteria(text, criteria) -> dict | None:
    """{criterion: 0-20} for every criterion, or None."""
    obj = common.extract_json(text)
    if obj is None:
        return None
    out = {}
    for c in criteria:
        x = obj.get(c)
        if isinstance(x, str) and re.fullmatch(r"\s*\d+(\.\d+)?\s*", x):
            x = float(x)
        if not isinstance(x, (int, float)) or isinstance(x, bool) or not 0 <= x <= 20:
            return None
        out[c] = float(x)
    return out


def parse_change(text) -> float | None:
    """The SAGE simulator's emotion change, clipped to [-10, 10], or None."""
    obj = common.extract_json(text)
    x = obj.get("change") if obj else None
    if x is None:
        m = re.search(r'"?change"?\s*[:=]\s*([+-]?\d+(?:\.\d+)?)', text or "")
        x = float(m.group(1)) if m else None
    if not isinstance(x, (int, float)) or isinstance(x, bool) or not math.isfinite(x):
        return None
    return max(-10.0, min(10.0, float(x)))


# results: the last record of every (model, suite, case), summaries, the table, plots
def last_records(run_dir: Path) -> dict:
    return {(r["model"], r["suite"], r["case"]): r for r in common.read_records(run_dir / "cases.jsonl")}


def summarize(cases: list[dict], suite: str) -> dict:
    ok = [c for c in cases if not c.get("failed")]
    s = {"n": len(ok), "failed": len(cases) - len(ok)}
    if not ok:
        return s
    if suite == "empa":
        for key in EPM_KEYS:
            s[key] = mean_ci([c[key] for c in ok])
        s["success"] = mean_ci([float(c["outcome"] == "success") for c in ok])
        s["outcomes"] = {o: sum(c["outcome"] == o for c in ok) for o in sorted({c["outcome"] for c in ok})}
    elif suite == "eqbench3":
        scored = [c for c in ok if "score" in c]      # offline, analysis tasks are kept but not scored
        s.update(n=len(scored), unscored=len(ok) - len(scored), proxy=any(c.get("proxy") for c in scored))
        if scored:
            s["score"] = mean_ci([c["score"] for c in scored])
            s["by_kind"] = {k: statistics.mean(c["score"] for c in scored if c["kind"] == k)
                            for k in sorted({c["kind"] for c in scored})}
    elif suite == "sage":
        s.update(sentient=mean_ci([c["final_emotion"] for c in ok]), successes=sum(c["final_emotion"] >= 100 for c in ok),
                 failures=sum(c["final_emotion"] < 10 for c in ok))
    else:
        s["unanswered"] = sum(not c["answered"] for c in ok)
        for task in ("EU", "EA"):
            xs = [c for c in ok if c["task"] == task]
            if xs:
                s[task], s[task + "_n"] = mean_ci([100.0 * c["correct"] for c in xs]), len(xs)
                for by in ("category", "language"):
                    s[f"{task}_by_{by}"] = {v: 100.0 * statistics.mean(c["correct"] for c in xs if c[by] == v)
                                            for v in sorted({c[by] for c in xs})}
    return s


def fmt(mci, n=None) -> str:
    return f"{mci[0]:.2f}" + (f" ± {mci[1]:.2f}" if mci[1] is not None else "") + (f" (n={n})" if n is not None else "")


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
            miss = ["-"] * len(cols[suite])
            failed = f"; {s['failed']} failed" if s["failed"] else ""
            if suite == "empa":
                cells += [fmt(s["EPM"], s["n"]) + failed, fmt((100 * s["success"][0], None))] if s["n"] else miss
            elif suite == "eqbench3":
                unscored = f"; {s['unscored']} analysis not scored (needs an LLM judge)" if s.get("unscored") else ""
                cells += [(fmt(s["score"], s["n"]) if s["n"] else "-") + failed + unscored]
            elif suite == "sage":
                cells += [fmt(s["sentient"], s["n"]) + failed, f"{s['successes']} / {s['failures']}"] if s["n"] else miss
            else:
                cells += [fmt(s[t], s[t + "_n"]) if t in s else "-" for t in ("EU", "EA")]
        lines.append(f"| {model} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_rubrics(records: list[dict], run_dir: Path, label: str) -> list[str]:
    """Mean rubric weights (C, A, P) by turn index and by the user's emotion band (SAGE's), from 04's
    rollouts.jsonl (turns carry `rubric` {"weights": {dimension: w}} and `emotion`), with 02's tables
    and plot. Returns the files written."""
    bands = [(0, "F < 10"), (10, "C >= 10"), (40, "B >= 40"), (70, "A >= 70"), (100, "S >= 100")]
    by_turn, by_emotion = [], []
    for rec in records:
        for tu in rec.get("turns", []):
            w = (tu.get("rubric") or {}).get("weights")
            if isinstance(w, dict) and set(pref.DIMS) <= set(w):
                by_turn.append((tu["t"], w))
                if tu.get("emotion") is not None:
                    by_emotion.append(([name for low, name in bands if tu["emotion"] >= low][-1], w))
    written = []
    for name, rows, xlabel in (("rubric_by_turn", by_turn, "turn"), ("rubric_by_emotion", by_emotion, "user emotion band")):
        if rows:
            table = pref.mean_weights_by(rows)
            if name == "rubric_by_emotion":
                table = {b: table[b] for _, b in bands if b in table}
            common._atomic_write_text(run_dir / f"{name}.json", json.dumps(table, indent=1))
            pref.plot_weights({label: table}, xlabel, run_dir / f"{name}.png")
            written += [f"{name}.png", f"{name}.json"]
    return written


def write_results(run_dir: Path, args) -> str:
    records = list(last_records(run_dir).values())
    models = ["base"] + list(args.adapters) + sorted({r["model"] for r in records} - {"base", *args.adapters})
    summary = {m: {s: summarize([r for r in records if r["model"] == m and r["suite"] == s], s) for s in args.suites}
               for m in models if any(r["model"] == m for r in records)}
    table = results_table(summary, args.suites)
    md = ["# Evaluation", "", f"command: `python 05_eval.py {' '.join(sys.argv[1:])}`", "", table, "",
          "mean ± 95% CI (1.96 sd / sqrt n) over cases; n = cases kept; failed cases are excluded and counted."]
    if EQ_PROXY in table:
        md += ["", f"{EQ_PROXY}: MDEP-PR levels stand in for the criteria (not EQ-Bench); analysis needs an LLM judge."]
    rows = [(m, by["empa"]) for m, by in summary.items() if by.get("empa", {}).get("n")]
    if rows:
        md += ["", "EMPA details (means over cases; the indices are 0-100 scaled)", "",
               "| model | outcomes | " + " | ".join(k.replace("_idx", "") for k in EPM_KEYS[1:]) + " |",
               "|---" * (len(EPM_KEYS) + 1) + "|"]
        md += [f"| {m} | {json.dumps(e['outcomes'])} | " + " | ".join(f"{e[k][0]:.2f}" for k in EPM_KEYS[1:]) + " |"
               for m, e in rows]
    line = lambda d, p: ", ".join(f"{k} {v:.{p}f}" for k, v in d.items())  # noqa: E731
    for m, by in summary.items():
        q, b = by.get("eqbench3", {}), by.get("emobench", {})
        md += ["", f"{m}, EQ-Bench 3 by task kind: {line(q['by_kind'], 2)}"] if q.get("n") else []
        if b.get("unanswered"):
            md += ["", f"{m}, EmoBench: {b['unanswered']} items without a parsable answer (counted wrong)"]
        for t in (t for t in ("EU", "EA") if t in b):
            md += ["", f"{m}, EmoBench {t} accuracy % by category: {line(b[t + '_by_category'], 1)}; "
                       f"by language: {line(b[t + '_by_language'], 1)}"]
    common._atomic_write_text(run_dir / "results.md", "\n".join(md) + "\n")
    common._atomic_write_text(run_dir / "results.json", json.dumps(
        {"args": common.public_args(args), "columns": table.split("\n")[0].strip("| ").split(" | "),
         "summary": summary, "cases": records}, indent=1, ensure_ascii=False, default=str))
    # plots: distance per turn (EMPA), emotion per turn (SAGE), rubric weights when the rollouts carry them
    for suite, key, ylabel, name in (("empa", "distances", "hinge distance d(P_t)", "distance_per_turn.png"),
                                     ("sage", "emotions", "user emotion e_t", "emotion_per_turn.png")):
        series = {m: runs for m in models if (runs := [r[key] for r in records if r["model"] == m and r["suite"] == suite
                                                       and not r.get("failed")])}
        if series:
            common.plot_series(series, "turn (0 = before the first reply)", ylabel, run_dir / name)
    for path in args.rubrics_from:    # 04's rollouts.jsonl: its CARE rubrics by turn and by user emotion
        print(f"rubric plots of {path}: " + ", ".join(plot_rubrics(common.read_records(Path(path)), run_dir, Path(path).parent.name)))
    return table


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
                   "by --seed and stratified by language and category (EMPA, EQ-Bench: by kind); 0 = all")
    g.add_argument("--batch-size", type=int, default=8, help="cases generated together (EmoBench: options scored "
                   "together after their shared prompt); saved after each batch")
    g.add_argument("--r-pen", choices=["levels", "points"], default="levels", help="EPM R_pen counts negative levels or points")
    g.add_argument("--s-proj", choices=["goal", "step"], default="goal",
                   help="EPM S_proj direction u_t: goal v* = -P0/||P0||, or step -P_{t-1}/||P_{t-1}||")
    for flag, name, what in (("--eqbench3", "eqbench3_sample.txt", "EQ-Bench 3 scenario_prompts.txt (the default is "
                              "a 4-scenario sample written for this project)"),
                             ("--sage-profiles", "sage_profiles.jsonl", "SAGE profiles JSONL"),
                             ("--emobench-eu", "emobench_eu.jsonl", "EmoBench EU: JSONL or hub dataset owner/name[:config[:split]]"),
                             ("--emobench-ea", "emobench_ea.jsonl", "EmoBench EA: JSONL or hub dataset owner/name[:config[:split]]")):
        g.add_argument(flag, default=str(HERE / "data" / "eval" / name), help=what)
    g.add_argument("--sage-turns", type=int, default=10, help="SAGE: turns before the episode stops")
    g.add_argument("--sage-start", type=float, default=40.0, help="SAGE: the user's starting emotion (0-100)")
    g.add_argument("--rubrics-from", nargs="*", default=[],
                   help="04 rollouts.jsonl files (--reward care runs): plot their rubric weights by turn and emotion")
    g.add_argument("--mcq", choices=["loglik", "generate"], default="loglik",
                   help="EmoBench: mean log-prob of each option, or a greedy answer with the letter parsed")
    common.add_run_args(p, "eval", resume="a run folder of this script: finish its unfinished cases", progress=False)
    args = p.parse_args(argv)
    env.check_env_args(args)
    c = common.check
    args.suites = [s.strip() for s in args.suite.split(",") if s.strip()]
    bad = [s for s in args.suites if s not in SUITES]
    c(args.suites and not bad, f"--suite: unknown suite(s) {bad or args.suite!r}; choose from {', '.join(SUITES)}")
    c(args.adapter is None, "--adapter is for training; 05_eval.py takes --adapters A B ... (the base is always evaluated)")
    for a in args.adapters:
        c(os.path.exists(os.path.join(a, "adapter_config.json")), f"--adapters {a}: no adapter_config.json there")
    c(len(set(args.adapters)) == len(args.adapters) and "base" not in args.adapters, "--adapters: each folder once")
    c(args.max_cases >= 0, f"--max-cases must be >= 0, got {args.max_cases}")
    c(args.batch_size >= 1, f"--batch-size must be >= 1, got {args.batch_size}")
    c(args.sage_turns >= 1, f"--sage-turns must be >= 1, got {args.sage_turns}")
    c(0 <= args.sage_start <= 100, f"--sage-start must be in [0, 100], got {args.sage_start}")
    return args


def load_suite_data(args) -> dict:
    """Every input the chosen suites need, validated (errors name file:line and field), sampled (--max-cases)."""
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
    """--max-cases n of the units, stratified: strata(unit) -> (language, category, ...); each level
    shares out its quota by largest remainder, quota_g = floor(n |g| / |all|) and the leftover to the
    largest fractions (ties drawn by --seed); within a stratum a seeded draw. Kept in file order."""
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

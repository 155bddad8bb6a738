"""05_eval.py: evaluate the base model and trained adapters side by side (EMPA, EQ-Bench 3, SAGE, EmoBench).

What it does
  Loads the base model once, evaluates it, then switches to each --adapters folder (peft) and evaluates
  it the same way, with the same seeds. Suites (--suite, comma-separated; each also runs alone):
    empa      03_rollout's environment on the held-out scenarios with the benchmark's rules (45 turns,
              no success or failure before turn 12, collapse window 5; --max-context 8192, capped at the
              model's window, so that 45 turns fit): outcome, turns, final distance, every EPM sub-metric
              and the EPM-Index per case and overall.
    eqbench3  the public scenario_prompts.txt format: each scenario's fixed user turns are played to the
              model, the judge scores the task's six criteria 0-20 (role-play and drafting: the role-play
              set; analysis, ids 401-420 or an "analysis" category: the analysis set).
    sage      SAGE / RLVER profiles: a simulated user whose emotion starts at 40 and moves by at most
              +-10 per turn for up to 10 turns; Sentient score, successes (>= 100), failures (< 10).
    emobench  EmoBench EU (emotion and cause) and EA (best response or action), multiple choice.
  Every finished case is appended to cases.jsonl at once, so --resume RUN skips it after a kill.

Reads   --scenarios (data/scenarios_test.jsonl), --eqbench3 (a scenario_prompts.txt; the project ships a
        4-scenario sample in that format written for it), --sage-profiles (JSONL: id, player, scene,
        main_cha, cha_group, task, optional first_talk; Chinese or English), --emobench-eu/--emobench-ea
        (JSONL with EmoBench's field names, or a hub dataset owner/name[:config[:split]], exported once
        to the cache as JSONL); the model, --adapters, the judge and user backends (03_rollout flags).
Writes  runs/<name>-<time>/: args.json (key redacted), cases.jsonl (one line per finished case: model,
        suite, case, every number), transcripts.jsonl (the dialogues, EMPA's per-turn records),
        results.json (summaries and every per-case number), results.md (the table), PNG plots:
        distance_per_turn.png, emotion_per_turn.png, and rubric_by_turn.png / rubric_by_emotion.png
        when the transcripts' turns carry a `rubric` field (none of this project's rollouts do yet).

Equations (REFERENCE.md sections 3, 4, 6; r0 = ||P0||, rho_max = sqrt(12), alpha_s = 1.5, beta = 1.2)
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

Choices and departures (say which, as REFERENCE.md asks)
  1. S_proj uses u_t = v* (the fixed goal direction) by default, so S_proj = rho; --s-proj step uses
     u_t = -P_{t-1}/||P_{t-1}|| (0 at the origin). R_pen counts negative levels (--r-pen points: points).
  2. tau is undefined when P_T = P0 (no net displacement): its index is then 0 and tau is saved as null.
     No index is clamped otherwise (RDI, tau and R_pen indices can go below 0, E_total's above 100).
  3. A turn the judge failed on is left out of the EPM metrics (the state did not move). A case with no
     judged turn, or whose simulated user or judge failed, is marked failed and excluded; counts are
     reported. An endpoint that is down altogether stops the run with one message after saving.
  4. SAGE: one simulator both feels and speaks in SAGE; here --judge gives the emotion change and --user
     speaks. Offline (embed judge) the change is derived from the MDEP-PR levels the judge gives the
     reply: change = clip(2.5 * sum_axis v_t,axis, -10, 10) (A+1 alone: +2.5; level 1 on every axis:
     +7.5; off topic, C-1 A-1: -10). The embed judge reads English only: on Chinese profiles it finds
     no progress, so its offline numbers there mean nothing. With an LLM judge the change is asked for
     (JSON, parsed, retried). There is no goodbye detection; a profile without first_talk opens with its
     scene. The scripted user answers Chinese profiles with short Chinese lines.
  5. EQ-Bench 3 with the offline embed judge is a PROXY, not the benchmark: every reply gets MDEP-PR
     levels, each axis scores clip(10 + 5 * (progress - negative), 0, 20), and each criterion takes the
     mean over replies of the axis in CRITERION_AXIS. It measures on-topic supportive moves, not insight.
     The real scores need an LLM judge (--judge api:...), which is asked for all criteria as JSON.
     No pairwise Elo, only the rubric score; no system prompt (the prompts carry their own
     instructions); a scenario's later turns are dropped when they pass --max-context.
  6. EmoBench log-likelihood (--mcq loglik, default): each option is scored by the mean log-probability of
     its tokens as the assistant's answer to the question (length-normalised), the argmax is chosen. The
     cause question names the emotion the model chose. --mcq generate: greedy answer, letter parsed.

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
import re
import statistics
import sys
import zlib
from pathlib import Path

import torch
from tqdm import tqdm

import common

env = importlib.import_module("03_rollout")       # environment, judges, users, batched generation
trainer = importlib.import_module("04_mica_train")  # token_logprobs (EmoBench option scoring)
HERE = Path(__file__).resolve().parent
SUITES = ("empa", "eqbench3", "sage", "emobench")
RHO_MAX, ALPHA_S, BETA = math.sqrt(12), 1.5, 1.2
ROLEPLAY_CRITERIA = ("demonstrated_empathy", "pragmatic_ei", "depth_of_insight", "social_dexterity",
                     "emotional_reasoning", "message_tailoring")
ANALYSIS_CRITERIA = ("depth_of_insight", "emotional_reasoning", "theory_of_mind", "subtext_identification",
                     "intellectual_grounding", "correctness")
# the offline proxy only: which MDEP-PR axis stands in for each EQ-Bench criterion
CRITERION_AXIS = {"demonstrated_empathy": "A", "pragmatic_ei": "P", "depth_of_insight": "C",
                  "social_dexterity": "A", "emotional_reasoning": "C", "message_tailoring": "C",
                  "theory_of_mind": "C", "subtext_identification": "C", "intellectual_grounding": "P",
                  "correctness": "C"}
SAGE_ZH_LINES = {"better": ["嗯，你这么说我心里好受一点了。", "对，就是这种感觉。我还想多说一点。"],
                 "stuck": ["我知道，可我还是不知道该怎么办。", "也许吧，但心里还是很堵。"],
                 "worse": ["你好像没在听我说什么。", "这些话谁都会说，算了。"]}


# ---------------------------------------------------------------------------------------------
# EPM metrics (EMPA): one function per index group, then the index
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
    mean = sum(xs) / n
    if n < 2:
        return mean, None
    sd = math.sqrt(sum((x - mean) ** 2 for x in xs) / (n - 1))
    return mean, 1.96 * sd / math.sqrt(n)


# ---------------------------------------------------------------------------------------------
# Loaders: EQ-Bench 3 text, SAGE profiles, EmoBench EU / EA
# ---------------------------------------------------------------------------------------------
def load_eqbench3(path) -> tuple[list[dict], dict]:
    """scenario_prompts.txt -> tasks {id, category, title, kind, prompts, _where} and counts. Headers are
    8 '#' then `id | category | title` (spacing, extra or missing fields tolerated); turn markers are 7 '#'
    then `Prompt<N>` or `<N>`. Lines outside a prompt and scenarios without prompts are counted, skipped."""
    common.check(os.path.isfile(path), f"{path}: no such file")
    tasks, stats, cur, prompt = [], {"ignored_lines": 0, "empty_scenarios": 0, "duplicates": 0}, None, None
    with open(path, "rb") as f:
        raw = f.read().split(b"\n")
    for lineno, b in enumerate(raw, 1):
        try:
            line = b.decode("utf-8").rstrip("\r")
        except UnicodeDecodeError as e:
            raise common.UserError(f"{path}:{lineno}: not UTF-8 text (byte {e.start + 1})") from None
        head = re.match(r"^\s*#{8}(?!#)\s*(.*)$", line)
        turn = re.match(r"^\s*#{7}(?!#)\s*(?:prompt\s*)?(\d+)\s*:?\s*$", line, re.I)
        if head:
            parts = [x.strip() for x in head.group(1).split("|")]
            category = parts[1] if len(parts) > 2 else ""
            title = " | ".join(parts[2:]) if len(parts) > 2 else (parts[1] if len(parts) == 2 else "")
            sid = parts[0] or f"line{lineno}"
            kind = ("analysis" if (sid.isdigit() and 401 <= int(sid) <= 420) or "analys" in category.lower()
                    else "drafting" if "draft" in category.lower() else "roleplay")
            cur = {"id": sid, "category": category, "title": title, "kind": kind, "prompts": [],
                   "_where": f"{path}:{lineno}"}
            tasks.append(cur)
            prompt = None
        elif turn and cur is not None:
            prompt = []
            cur["prompts"].append(prompt)
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
                                    "cha_group": (str, list), "task": str})
    for r in recs:
        ft = r.get("first_talk")
        common.check(ft is None or isinstance(ft, str), f"{r['_where']}: field 'first_talk' must be str")
        r["id"] = str(r["id"])
    ids = [r["id"] for r in recs]
    common.check(len(set(ids)) == len(ids), f"{path}: duplicate profile ids")
    return recs


EMOBENCH_FIELDS = {
    "EU": {"qid": (str, int), "language": str, "coarse_category": str, "finegrained_category": str,
           "scenario": str, "subject": str, "emotion_choices": list, "emotion_label": str,
           "cause_choices": list, "cause_label": str},
    "EA": {"qid": (str, int), "language": str, "category": str, "question type": str, "scenario": str,
           "subject": str, "choices": list, "label": str}}


def emobench_file(spec: str, kind: str) -> str:
    """A path as is; a hub dataset `owner/name[:config[:split]]` is exported once to the cache as JSONL
    (validation errors then name that file and line)."""
    if os.path.exists(spec):
        return spec
    name, _, rest = spec.partition(":")
    config, _, split = rest.partition(":")
    common.check("/" in name, f"--emobench-{kind.lower()} {spec}: no such file, and not a hub dataset "
                              f"name (owner/name[:config[:split]])")
    target = common.cache_dir() / "emobench" / (re.sub(r"[^\w.-]", "_", spec) + ".jsonl")
    if not target.exists():
        try:
            import datasets

            ds = datasets.load_dataset(name, config or None, split=split or "train")
        except Exception as e:  # offline, unknown name, wrong config: all "cannot get it here"
            raise common.UserError(f"--emobench-{kind.lower()} {spec}: not a file, and the hub dataset "
                                   f"could not be loaded ({type(e).__name__})") from None
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_suffix(f".tmp-{os.getpid()}")
        tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in ds), encoding="utf-8")
        os.replace(tmp, target)
    return str(target)


def load_emobench(spec: str, kind: str) -> list[dict]:
    path = emobench_file(spec, kind)
    recs = common.read_jsonl(path, EMOBENCH_FIELDS[kind])
    pairs = [("emotion_choices", "emotion_label"), ("cause_choices", "cause_label")] if kind == "EU" \
        else [("choices", "label")]
    for r in recs:
        for choices, label in pairs:
            ok = len(r[choices]) >= 2 and all(isinstance(c, str) and c.strip() for c in r[choices])
            common.check(ok, f"{r['_where']}: field '{choices}' must be a list of 2+ non-empty strings")
            common.check(r[label] in r[choices], f"{r['_where']}: field '{label}' is not one of '{choices}'")
        r["case"] = f"{kind}-{r['language']}-{r['qid']}"
    ids = [r["case"] for r in recs]
    common.check(len(set(ids)) == len(ids), f"{path}: duplicate (language, qid) pairs")
    return recs


# ---------------------------------------------------------------------------------------------
# LLM judge answers: JSON out of free text, retried; a dead endpoint stops the run
# ---------------------------------------------------------------------------------------------
def parse_json_object(text: str | None) -> dict | None:
    m = re.search(r"\{.*\}", text or "", re.S)     # prose or a code fence around it is fine
    try:
        obj = json.loads(m.group(0)) if m else None
    except json.JSONDecodeError:
        return None
    return obj if isinstance(obj, dict) else None


def parse_criteria(text, criteria) -> dict | None:
    """{criterion: 0-20} for every criterion, or None."""
    obj = parse_json_object(text)
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
    obj = parse_json_object(text)
    x = obj.get("change") if obj else None
    if x is None:
        m = re.search(r'"?change"?\s*[:=]\s*([+-]?\d+(?:\.\d+)?)', text or "")
        x = float(m.group(1)) if m else None
    if not isinstance(x, (int, float)) or isinstance(x, bool) or not math.isfinite(x):
        return None
    return max(-10.0, min(10.0, float(x)))


# ---------------------------------------------------------------------------------------------
# The suites: each evaluates a batch of cases and returns their records
# ---------------------------------------------------------------------------------------------
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


def eqbench3_cases(model, tok, tasks, judge, args) -> tuple[list[dict], list[dict]]:
    # 1. play each task's fixed user turns; every task of the batch answers its turn i in one generate call
    convs, cut = [[] for _ in tasks], [False] * len(tasks)
    for i in range(max(len(t["prompts"]) for t in tasks)):
        live = [j for j, t in enumerate(tasks) if i < len(t["prompts"]) and not cut[j]]
        ctx = []
        for j in list(live):
            ids = env.render_ids(tok, convs[j] + [{"role": "user", "content": tasks[j]["prompts"][i]}])
            if len(ids) + args.max_new_tokens > args.max_context:
                cut[j] = True                         # later turns do not fit: judged on what was played
                live.remove(j)
            else:
                ctx.append(ids)
        replies = env.generate_replies(model, tok, ctx, args) if live else []
        for j, (reply_ids, _) in zip(live, replies):
            convs[j] += [{"role": "user", "content": tasks[j]["prompts"][i]},
                         {"role": "assistant", "content": tok.decode(reply_ids, skip_special_tokens=True).strip()}]
    # 2. the judge scores the task's criteria 0-20
    criteria = [ANALYSIS_CRITERIA if t["kind"] == "analysis" else ROLEPLAY_CRITERIA for t in tasks]
    if isinstance(judge, env.LLMJudge):
        prompts = [[{"role": "user", "content": EQ_JUDGE_PROMPT.format(
            kind=t["kind"], transcript="\n\n".join(f"[{m['role']}]\n{m['content']}" for m in c),
            criteria="\n".join(f"- {x}" for x in cr), shape=json.dumps({x: 0 for x in cr}))}]
            for t, c, cr in zip(tasks, convs, criteria)]
        scores = common.ask_json(judge.backend, prompts, lambda i, text: parse_criteria(text, criteria[i]),
                                 args.judge_retries, who="eqbench3 judge", noun="cases")
    else:
        scores = eqbench3_proxy_scores(convs, criteria, judge)
    # 3. score = 5 * mean of the task's criterion scores
    cases, transcripts = [], []
    for t, c, s in zip(tasks, convs, scores):
        s = s if c else None
        case = {"case": t["id"], "kind": t["kind"], "category": t["category"], "replies": len(c) // 2,
                "context_limit": len(c) // 2 < len(t["prompts"]),
                "failed": None if s else "judge failed" if c else "no turn fits in --max-context"}
        if s:
            case.update(criteria=s, score=5 * sum(s.values()) / len(s))
        cases.append(case)
        transcripts.append({"case": t["id"], "messages": c})
    return cases, transcripts


EQ_JUDGE_PROMPT = """You are an expert judge of emotional intelligence. Below is an EQ-Bench 3 task ({kind}):
the user's turns and the respondent's answers.

{transcript}

Score the respondent's answers on each criterion from 0 (absent) to 20 (exceptional):
{criteria}

Answer with JSON only, exactly this shape: {shape}"""


def eqbench3_proxy_scores(convs, criteria, judge) -> list[dict | None]:
    """Offline proxy (not EQ-Bench): MDEP-PR levels of every reply -> per axis
    clip(10 + 5 (progress - negative), 0, 20) -> each criterion the mean of its axis over the replies."""
    cases, owner = [], []
    for j, c in enumerate(convs):
        for i in range(1, len(c), 2):
            cases.append({"scenario": {"id": str(j), "persona": "", "situation": ""}, "history": c[:i],
                          "reply": c[i]["content"]})
            owner.append(j)
    verdicts = judge.judge(cases)
    per_axis = [{a: [] for a in env.AXES} for _ in convs]
    for j, v in zip(owner, verdicts):
        if v is not None:
            for a in env.AXES:
                progress, negative = v["levels"][a]
                per_axis[j][a].append(max(0.0, min(20.0, 10.0 + 5.0 * (progress - negative))))
    out = []
    for j, cr in enumerate(criteria):
        ok = all(per_axis[j][a] for a in env.AXES)
        out.append({x: sum(per_axis[j][CRITERION_AXIS[x]]) / len(per_axis[j][CRITERION_AXIS[x]]) for x in cr}
                   if ok else None)
    return out


SAGE_PROMPT = """You are simulating a person in an emotional-support conversation (SAGE protocol).
Who you are: {player}
The situation: {scene}
What you secretly want from the conversation: {task}
Your current emotion: {emotion:.0f} out of 100 (0 = desperate, 100 = fully supported).

The conversation so far (the last line is the supporter's reply):
{history}

As this person, analyse how the supporter's last reply makes you feel, then decide the change of your
emotion: an integer from -10 (much worse) to +10 (much better).
Answer with JSON only: {{"analysis": "<one or two sentences>", "change": 0}}"""


def sage_scenario(p: dict) -> dict:
    """A profile as 03's users see a scenario (persona, situation, opening, scripted lines)."""
    zh = bool(re.search(r"[\u4e00-\u9fff]", p["player"] + p["scene"]))
    return {"id": p["id"], "persona": p["player"], "situation": f"{p['scene']} {p['task']}", "profile": p,
            "opening": (p.get("first_talk") or p["scene"])[:1000],
            "user_lines": SAGE_ZH_LINES if zh else env.DEFAULT_USER_LINES}


def emotion_changes(dialogs, judge, args) -> list[float | None]:
    """change_t per live dialogue: asked of an LLM judge, or derived from the offline judge's levels."""
    if isinstance(judge, env.LLMJudge):
        prompts = [[{"role": "user", "content": SAGE_PROMPT.format(
            player=d["scenario"]["persona"], scene=d["scenario"]["profile"]["scene"],
            task=d["scenario"]["profile"]["task"], emotion=d["emotions"][-1],
            history="\n".join(f"{'You' if m['role'] == 'user' else 'Supporter'}: {m['content']}"
                              for m in d["messages"] if m["role"] != "system"))}] for d in dialogs]
        return common.ask_json(judge.backend, prompts, lambda i, text: parse_change(text), args.judge_retries,
                               who="sage judge", noun="cases")
    verdicts = judge.judge([{"scenario": d["scenario"], "history": d["messages"][:-1],
                             "reply": d["messages"][-1]["content"]} for d in dialogs])
    out = []
    for v in verdicts:
        # change_t = clip(2.5 * sum_axis v_t,axis, -10, 10)   (03_rollout.emotion_change, from the levels)
        out.append(None if v is None else env.emotion_change(v["levels"]))
    return out


def sage_cases(model, tok, profiles, judge, user, args) -> tuple[list[dict], list[dict]]:
    ds = []
    for p in profiles:
        s = sage_scenario(p)
        ds.append({"scenario": s, "emotions": [args.sage_start], "changes": [], "outcome": None,
                   "messages": [{"role": "system", "content": args.system_prompt},
                                {"role": "user", "content": s["opening"]}]})
    for t in range(1, args.sage_turns + 1):
        live, ctx = [], []
        for d in (d for d in ds if d["outcome"] is None):
            ids = env.render_ids(tok, d["messages"])
            if len(ids) + args.max_new_tokens > args.max_context:
                d["outcome"] = "context_limit"
            else:
                live.append(d), ctx.append(ids)
        if not live:
            break
        # 1. the policy answers every live dialogue in one batched call
        for d, (reply_ids, _) in zip(live, env.generate_replies(model, tok, ctx, args)):
            text = tok.decode(reply_ids, skip_special_tokens=True).strip()
            d["messages"].append({"role": "assistant", "content": text})
        # 2. the simulated user's emotion: e_t = min(100, max(0, e_{t-1} + change_t))
        for d, change in zip(live, emotion_changes(live, judge, args)):
            if change is None:
                d["outcome"] = "judge_failed"
                continue
            e = min(100.0, max(0.0, d["emotions"][-1] + change))
            d["changes"].append(change), d["emotions"].append(e)
            # 3. the episode ends at 100 (success), below 10 (failure) or after the last turn
            d["outcome"] = ("success" if e >= 100 else "failure" if e < 10 else
                            "timeout" if t == args.sage_turns else None)
        # 4. the user answers the dialogues that go on
        going = [d for d in live if d["outcome"] is None]
        asks = []
        for d in going:
            c = d["changes"][-1]
            trend = "better" if c > 0 else "worse" if c < 0 else "stuck"
            asks.append({"scenario": d["scenario"], "k": 0, "history": d["messages"], "trend": trend,
                         "band": f"your emotion is {d['emotions'][-1]:.0f} out of 100 and {trend}"})
        for d, answer in zip(going, user.reply(asks) if going else []):
            if answer is None:
                d["outcome"] = "user_failed"
            else:
                d["messages"].append({"role": "user", "content": answer[: args.max_message_chars]})
    cases, transcripts = [], []
    for d in ds:
        failed = d["outcome"] in ("judge_failed", "user_failed") or not d["changes"]
        cases.append({"case": d["scenario"]["id"], "outcome": d["outcome"], "turns": len(d["changes"]),
                      "final_emotion": d["emotions"][-1], "emotions": d["emotions"], "changes": d["changes"],
                      "failed": d["outcome"] if failed else None})
        turns = [{"t": i + 1, "emotion": d["emotions"][i + 1], "change": c} for i, c in enumerate(d["changes"])]
        transcripts.append({"case": d["scenario"]["id"], "messages": d["messages"], "turns": turns})
    return cases, transcripts


EMO_TEMPLATES = {  # {scenario}, {subject}, {emotion}, {qtype}, {choices}
    "en": {"emotion": "Scenario: {scenario}\nQuestion: What emotion(s) would {subject} ultimately feel in this "
                      "situation?",
           "cause": "Scenario: {scenario}\nQuestion: Why would {subject} feel {emotion} in this situation?",
           "EA": "Scenario: {scenario}\nQuestion: In this scenario, what is the most effective {qtype} for {subject}?",
           "choices": "\nChoices:\n{choices}\n", "loglik": "Answer with the text of one choice.",
           "generate": "Answer with the letter of one choice only.", "this": "this way"},
    "zh": {"emotion": "场景：{scenario}\n问题：在这种情况下，{subject}最终会有什么情绪？",
           "cause": "场景：{scenario}\n问题：为什么{subject}在这种情况下会感到{emotion}？",
           "EA": "场景：{scenario}\n问题：在这种情况下，对{subject}来说最有效的{qtype}是什么？",
           "choices": "\n选项：\n{choices}\n", "loglik": "请回答其中一个选项的内容。",
           "generate": "只回答一个选项的字母。", "this": "这样"}}


def mcq_prompt(item, question, options, mode, emotion=None) -> str:
    T = EMO_TEMPLATES["zh" if item["language"].lower().startswith(("zh", "ch")) else "en"]
    lettered = "\n".join(f"{chr(65 + i)}. {o}" for i, o in enumerate(options))
    text = T[question].format(scenario=item["scenario"], subject=item["subject"], emotion=emotion or T["this"],
                              qtype=item.get("question type", "").lower())
    return text + T["choices"].format(choices=lettered) + T[mode]


def emobench_cases(items, kind, choose, mode="loglik") -> list[dict]:
    """choose(questions) -> the chosen option index (or None) per {prompt, options} question. EU asks the
    emotion, then the cause naming the chosen emotion; it is correct only when both are right."""
    if kind == "EA":
        picks = choose([{"prompt": mcq_prompt(it, "EA", it["choices"], mode), "options": it["choices"]}
                        for it in items])
        return [{"case": it["case"], "task": "EA", "language": it["language"], "category": it["category"],
                 "pred": None if p is None else it["choices"][p], "answered": p is not None,
                 "correct": int(p is not None and it["choices"][p] == it["label"]), "failed": None}
                for it, p in zip(items, picks)]
    emo = choose([{"prompt": mcq_prompt(it, "emotion", it["emotion_choices"], mode), "options": it["emotion_choices"]}
                  for it in items])
    named = [None if p is None else it["emotion_choices"][p] for it, p in zip(items, emo)]
    cause = choose([{"prompt": mcq_prompt(it, "cause", it["cause_choices"], mode, e), "options": it["cause_choices"]}
                    for it, e in zip(items, named)])
    out = []
    for it, e, c in zip(items, named, cause):
        emotion_ok = e == it["emotion_label"]
        cause_ok = c is not None and it["cause_choices"][c] == it["cause_label"]
        out.append({"case": it["case"], "task": "EU", "language": it["language"], "category": it["coarse_category"],
                    "pred": [e, None if c is None else it["cause_choices"][c]],
                    "answered": e is not None and c is not None,
                    "emotion_correct": int(emotion_ok), "cause_correct": int(cause_ok),
                    "correct": int(emotion_ok and cause_ok), "failed": None})
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
def option_logliks(model, tok, questions, batch_size) -> list[list[float]]:
    """score(option) = (1/|o|) sum_j log pi(o_j | prompt, o_<j): the option as the assistant's answer to the
    question (length-normalised mean log-probability of its tokens), for every option of every question."""
    rows = []
    for qi, q in enumerate(questions):
        prompt_ids = env.render_ids(tok, [{"role": "user", "content": q["prompt"]}])
        for oi, o in enumerate(q["options"]):
            rows.append((qi, oi, prompt_ids, tok(o, add_special_tokens=False)["input_ids"]))
    scores = [[0.0] * len(q["options"]) for q in questions]
    device = next(model.parameters()).device
    for start in range(0, len(rows), batch_size):
        part = rows[start:start + batch_size]
        L = max(len(p) + len(o) for _, _, p, o in part)
        ids = torch.full((len(part), L), tok.pad_token_id, dtype=torch.long)
        attn, mask = torch.zeros_like(ids), torch.zeros_like(ids)
        for b, (_, _, p, o) in enumerate(part):      # right-padded; mask marks the option's tokens
            ids[b, :len(p) + len(o)] = torch.tensor(p + o)
            attn[b, :len(p) + len(o)] = 1
            mask[b, len(p):len(p) + len(o)] = 1
        lp = trainer.token_logprobs(model, ids.to(device), attn.to(device), mask.to(device))
        for (qi, oi, _, o), x in zip(part, lp.split([len(o) for _, _, _, o in part])):
            scores[qi][oi] = x.mean().item()
    return scores


@torch.no_grad()
def answer_mcq(model, tok, questions, args) -> list[int | None]:
    """loglik: the option with the highest mean log-probability; generate: a greedy answer, letter parsed."""
    if args.mcq == "loglik":
        return [max(range(len(s)), key=s.__getitem__) for s in option_logliks(model, tok, questions, args.batch_size)]
    greedy = argparse.Namespace(**{**vars(args), "temperature": 0.0, "max_new_tokens": 16})
    ctx = [env.render_ids(tok, [{"role": "user", "content": q["prompt"]}]) for q in questions]
    replies = env.generate_replies(model, tok, ctx, greedy)
    return [parse_choice(tok.decode(ids, skip_special_tokens=True), q["options"])
            for (ids, _), q in zip(replies, questions)]


# ---------------------------------------------------------------------------------------------
# Results: the last record of every (model, suite, case), summaries, the table, plots
# ---------------------------------------------------------------------------------------------
def read_records(path: Path) -> list[dict]:
    """This script's append-only JSONL; a line cut by a kill mid-write is skipped with a warning."""
    out = []
    if path.exists():
        for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                print(f"warning: {path}:{lineno}: an unfinished line (killed mid-write?), skipped", file=sys.stderr)
    return out


def last_records(run_dir: Path) -> dict:
    return {(r["model"], r["suite"], r["case"]): r for r in read_records(run_dir / "cases.jsonl")}


def summarize(cases: list[dict], suite: str) -> dict:
    ok = [c for c in cases if not c.get("failed")]
    s = {"n": len(ok), "failed": len(cases) - len(ok)}
    if not ok:
        return s
    if suite == "empa":
        for key in ("EPM", "Outcome", "Efficiency", "Stability", "RDI_idx", "E_total_idx", "S_net_idx", "rho_idx",
                    "S_proj_idx", "tau_idx", "R_pos_idx", "Align_idx", "R_pen_idx", "final_distance", "turns"):
            s[key] = mean_ci([c[key] for c in ok])
        s["success"] = mean_ci([float(c["outcome"] == "success") for c in ok])
        s["outcomes"] = {o: sum(c["outcome"] == o for c in ok) for o in sorted({c["outcome"] for c in ok})}
    elif suite == "eqbench3":
        s["score"] = mean_ci([c["score"] for c in ok])
        s["by_kind"] = {k: statistics.mean(c["score"] for c in ok if c["kind"] == k)
                        for k in sorted({c["kind"] for c in ok})}
    elif suite == "sage":
        s["sentient"] = mean_ci([c["final_emotion"] for c in ok])
        s["successes"] = sum(c["final_emotion"] >= 100 for c in ok)
        s["failures"] = sum(c["final_emotion"] < 10 for c in ok)
    else:
        s["unanswered"] = sum(not c["answered"] for c in ok)
        for task in ("EU", "EA"):
            xs = [c for c in ok if c["task"] == task]
            if xs:
                s[task] = mean_ci([100.0 * c["correct"] for c in xs])
                s[task + "_n"] = len(xs)
                for by in ("category", "language"):
                    s[f"{task}_by_{by}"] = {v: 100.0 * statistics.mean(c["correct"] for c in xs if c[by] == v)
                                            for v in sorted({c[by] for c in xs})}
    return s


def fmt(mci, n=None) -> str:
    mean, half = mci
    return f"{mean:.2f}" + (f" ± {half:.2f}" if half is not None else "") + (f" (n={n})" if n is not None else "")


def results_table(summary: dict, suites) -> str:
    cols = {"empa": ["EMPA EPM-Index", "EMPA success %"], "eqbench3": ["EQ-Bench 3"],
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
                cells += [fmt(s["score"], s["n"]) + failed] if s["n"] else miss
            elif suite == "sage":
                cells += ([fmt(s["sentient"], s["n"]) + failed, f"{s['successes']} / {s['failures']}"]
                          if s["n"] else miss)
            else:
                cells += [fmt(s[t], s[t + "_n"]) if t in s else "-" for t in ("EU", "EA")]
        lines.append(f"| {model} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_per_turn(series: dict, ylabel: str, path: Path):
    """series: {model: [one list of values by turn per case]} -> mean per turn and a +-1 sd band."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for model, runs in series.items():
        xs, means, sds = [], [], []
        for t in range(max(len(r) for r in runs)):
            vals = [r[t] for r in runs if len(r) > t]          # the cases still going at turn t
            xs.append(t), means.append(statistics.mean(vals))
            sds.append(statistics.stdev(vals) if len(vals) > 1 else 0.0)
        ax.plot(xs, means, label=f"{model} (n={len(runs)})")
        ax.fill_between(xs, [m - s for m, s in zip(means, sds)], [m + s for m, s in zip(means, sds)], alpha=0.2)
    ax.set_xlabel("turn (0 = before the first reply)"), ax.set_ylabel(ylabel)
    ax.set_title(f"{ylabel}: mean and ±1 sd over the cases still going")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.legend(fontsize=8), fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_rubrics(transcripts: list[dict], run_dir: Path) -> list[str]:
    """Mean rubric weights (C, A, P) by turn index and by user emotion (SAGE's bands), when turns carry
    `rubric` ({"weights": [w_C, w_A, w_P]} or the list itself). Returns the files written."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [(tu["t"], tu.get("emotion"), tu["rubric"].get("weights") if isinstance(tu["rubric"], dict) else tu["rubric"])
            for tr in transcripts for tu in tr.get("turns", []) if tu.get("rubric") is not None]
    rows = [(t, e, w) for t, e, w in rows if isinstance(w, list) and len(w) == 3]

    bands = [(0, "F < 10"), (10, "C >= 10"), (40, "B >= 40"), (70, "A >= 70"), (100, "S >= 100")]  # SAGE's
    by_turn, by_emotion = {}, {}
    for t, e, w in rows:
        by_turn.setdefault(t, []).append(w)
        if e is not None:
            by_emotion.setdefault([name for low, name in bands if e >= low][-1], []).append(w)
    written = []
    for name, groups, keys, xlabel in (
            ("rubric_by_turn.png", by_turn, sorted(by_turn), "turn"),
            ("rubric_by_emotion.png", by_emotion, [b for _, b in bands if b in by_emotion], "user emotion band")):
        if not groups:
            continue
        fig, ax = plt.subplots(figsize=(7, 4))
        for a, axis in enumerate(env.AXES):
            means = [sum(w[a] for w in groups[k]) / len(groups[k]) for k in keys]
            ax.plot([str(k) for k in keys], means, marker="o", label=axis)
        ax.set_xlabel(xlabel), ax.set_ylabel("mean rubric weight"), ax.legend(), fig.tight_layout()
        fig.savefig(run_dir / name, dpi=120)
        plt.close(fig)
        written.append(name)
    return written


def write_results(run_dir: Path, args) -> str:
    records = list(last_records(run_dir).values())
    models = ["base"] + list(args.adapters)
    models += sorted({r["model"] for r in records} - set(models))
    summary = {m: {s: summarize([r for r in records if r["model"] == m and r["suite"] == s], s) for s in args.suites}
               for m in models if any(r["model"] == m for r in records)}
    table = results_table(summary, args.suites)
    md = ["# Evaluation", "", f"command: `python 05_eval.py {' '.join(sys.argv[1:])}`", "", table, "",
          "mean ± 95% CI (1.96 sd / sqrt n) over cases; n = cases kept; failed cases are excluded and counted."]
    epm = ("Outcome", "Efficiency", "Stability", "RDI_idx", "E_total_idx", "S_net_idx", "rho_idx", "S_proj_idx",
           "tau_idx", "R_pos_idx", "Align_idx", "R_pen_idx", "turns", "final_distance")
    rows = [(m, by["empa"]) for m, by in summary.items() if by.get("empa", {}).get("n")]
    if rows:
        md += ["", "EMPA details (means over cases; the indices are 0-100 scaled)", "",
               "| model | outcomes | " + " | ".join(k.replace("_idx", "") for k in epm) + " |",
               "|---" * (len(epm) + 2) + "|"]
        md += [f"| {m} | {json.dumps(e['outcomes'])} | " + " | ".join(f"{e[k][0]:.2f}" for k in epm) + " |"
               for m, e in rows]
    for m, by in summary.items():
        q, b = by.get("eqbench3", {}), by.get("emobench", {})
        if q.get("n"):
            md += ["", f"{m}, EQ-Bench 3 by task kind: " + ", ".join(f"{k} {v:.2f}" for k, v in q["by_kind"].items())]
        if b.get("unanswered"):
            md += ["", f"{m}, EmoBench: {b['unanswered']} items without a parsable answer (counted wrong)"]
        for t in (t for t in ("EU", "EA") if t in b):
            md += ["", f"{m}, EmoBench {t} accuracy % by category: " + ", ".join(
                f"{k} {v:.1f}" for k, v in b[t + "_by_category"].items()) + "; by language: " + ", ".join(
                f"{k} {v:.1f}" for k, v in b[t + "_by_language"].items())]
    common._atomic_write_text(run_dir / "results.md", "\n".join(md) + "\n")
    common._atomic_write_text(run_dir / "results.json", json.dumps(
        {"args": common.public_args(args), "summary": summary, "cases": records},
        indent=1, ensure_ascii=False, default=str))
    # plots: distance per turn (EMPA), emotion per turn (SAGE), rubric weights when the rollouts carry them
    for suite, key, ylabel, name in (("empa", "distances", "hinge distance d(P_t)", "distance_per_turn.png"),
                                     ("sage", "emotions", "user emotion e_t", "emotion_per_turn.png")):
        series = {m: [r[key] for r in records if r["model"] == m and r["suite"] == suite and not r.get("failed")]
                  for m in models}
        series = {m: runs for m, runs in series.items() if runs}
        if series:
            plot_per_turn(series, ylabel, run_dir / name)
    if not plot_rubrics(read_records(run_dir / "transcripts.jsonl"), run_dir):
        print("rubric plots skipped: no turn in the transcripts carries a `rubric` field")
    return table


# ---------------------------------------------------------------------------------------------
# Config and main loop
# ---------------------------------------------------------------------------------------------
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
    g.add_argument("--max-cases", type=int, default=0, help="at most this many cases per suite and file (0 = all)")
    g.add_argument("--batch-size", type=int, default=8,
                   help="cases generated together (EmoBench: options scored together); saved after each batch")
    g.add_argument("--r-pen", choices=["levels", "points"], default="levels",
                   help="EPM R_pen counts negative levels or their points")
    g.add_argument("--s-proj", choices=["goal", "step"], default="goal",
                   help="EPM S_proj direction u_t: goal v* = -P0/||P0||, or step -P_{t-1}/||P_{t-1}||")
    g.add_argument("--eqbench3", default=str(HERE / "data" / "eval" / "eqbench3_sample.txt"),
                   help="EQ-Bench 3 scenario_prompts.txt (the default is a 4-scenario sample written for this project)")
    g.add_argument("--sage-profiles", default=str(HERE / "data" / "eval" / "sage_profiles.jsonl"),
                   help="SAGE profiles JSONL")
    g.add_argument("--sage-turns", type=int, default=10, help="SAGE: turns before the episode stops")
    g.add_argument("--sage-start", type=float, default=40.0, help="SAGE: the user's starting emotion (0-100)")
    g.add_argument("--emobench-eu", default=str(HERE / "data" / "eval" / "emobench_eu.jsonl"),
                   help="EmoBench EU: JSONL path or hub dataset owner/name[:config[:split]]")
    g.add_argument("--emobench-ea", default=str(HERE / "data" / "eval" / "emobench_ea.jsonl"),
                   help="EmoBench EA: JSONL path or hub dataset owner/name[:config[:split]]")
    g.add_argument("--mcq", choices=["loglik", "generate"], default="loglik",
                   help="EmoBench: mean log-prob of each option, or a greedy answer with the letter parsed")
    g = p.add_argument_group("run")
    g.add_argument("--seed", type=int, default=0, help="random seed (sampling and the scripted user)")
    g.add_argument("--out-dir", default="runs", help="each run writes into its own folder under this")
    g.add_argument("--run-name", default="eval", help="prefix of the run folder")
    g.add_argument("--resume", default=None, help="a run folder of this script: finish its unfinished cases")
    args = p.parse_args(argv)
    env.check_env_args(args)
    c = common.check
    args.suites = [s.strip() for s in args.suite.split(",") if s.strip()]
    bad = [s for s in args.suites if s not in SUITES]
    c(args.suites and not bad, f"--suite: unknown suite(s) {bad or args.suite!r}; choose from {', '.join(SUITES)}")
    c(args.adapter is None, "--adapter is for training; 05_eval.py takes --adapters A B ... "
                            "(the base is always evaluated)")
    for a in args.adapters:
        c(os.path.exists(os.path.join(a, "adapter_config.json")), f"--adapters {a}: no adapter_config.json there")
    c(len(set(args.adapters)) == len(args.adapters) and "base" not in args.adapters, "--adapters: each folder once")
    c(args.max_cases >= 0, f"--max-cases must be >= 0, got {args.max_cases}")
    c(args.batch_size >= 1, f"--batch-size must be >= 1, got {args.batch_size}")
    c(args.sage_turns >= 1, f"--sage-turns must be >= 1, got {args.sage_turns}")
    c(0 <= args.sage_start <= 100, f"--sage-start must be in [0, 100], got {args.sage_start}")
    return args


def load_suite_data(args) -> dict:
    """Every input the chosen suites need, validated (errors name file:line and field)."""
    cap = (lambda xs: xs[: args.max_cases]) if args.max_cases else (lambda xs: xs)  # noqa: E731
    data = {}
    if "empa" in args.suites:
        data["empa"] = cap(env.load_scenarios(args.scenarios))
    if "eqbench3" in args.suites:
        tasks, stats = load_eqbench3(args.eqbench3)
        print(f"eqbench3: read {stats['scenarios']} scenarios and {stats['prompts']} prompts from {args.eqbench3} "
              f"({stats['ignored_lines']} lines outside prompts, {stats['empty_scenarios']} scenarios without prompts "
              f"and {stats['duplicates']} duplicate ids skipped)")
        data["eqbench3"] = cap(tasks)
    if "sage" in args.suites:
        data["sage"] = cap(load_sage_profiles(args.sage_profiles))
    if "emobench" in args.suites:
        data["emobench"] = cap(load_emobench(args.emobench_eu, "EU")) + cap(load_emobench(args.emobench_ea, "EA"))
    return data


def open_run_dir(args) -> Path:
    if not args.resume:
        run_dir = common.make_run_dir(args.out_dir, args.run_name)
        common.save_args(run_dir, args)
        return run_dir
    run_dir = Path(args.resume)
    common.check((run_dir / "args.json").exists(), f"--resume {run_dir}: not a run folder (no args.json)")
    saved, now = json.loads((run_dir / "args.json").read_text()), common.public_args(args)
    for k, v in now.items():
        same = json.dumps(saved.get(k), default=str) == json.dumps(v, default=str)
        if k not in ("resume", "out_dir", "run_name") and not same:
            print(f"warning: --resume with {k} = {v!r}; the run started with {saved.get(k)!r}", file=sys.stderr)
    for name in ("cases.jsonl", "transcripts.jsonl"):   # a line cut by a kill: start the next one on its own
        f = run_dir / name
        if f.exists() and f.stat().st_size and not f.read_bytes().endswith(b"\n"):
            with open(f, "a", encoding="utf-8") as fh:
                fh.write("\n")
    return run_dir


def main(argv=None):
    args = parse_args(argv)
    common.set_seed(args.seed)
    # 1. read and validate every input before anything is created
    data = load_suite_data(args)
    for name in [args.model] + [spec[3:] for spec in (args.judge, args.user) if spec.startswith("hf:")]:
        common.resolve_model(name)
    # 2. the run folder (new, or the one to resume: its finished cases are skipped)
    run_dir = open_run_dir(args)
    done = {k for k, r in last_records(run_dir).items() if not r.get("failed")}
    if args.resume:
        print(f"resume {run_dir}: {len(done)} finished cases are skipped")
    # 3. judge and user (only for the suites that need them), then the base model, loaded once
    judge = env.make_judge(args) if {"empa", "eqbench3", "sage"} & set(args.suites) else None
    user = env.make_user(args) if {"empa", "sage"} & set(args.suites) else None
    model, tok = common.load_policy(args, trainable=False)
    window = getattr(model.config, "max_position_embeddings", None)
    if window and args.max_context > window:
        print(f"--max-context {args.max_context} is above the model's window: using {window}")
        args.max_context = window
    print(f"run folder {run_dir} | models: {', '.join(['base'] + args.adapters)} | device {common.pick_device()}")
    try:
        for label, adapter in [("base", None)] + [(a, a) for a in args.adapters]:
            # 4. switch to this model's adapter (peft keeps the base weights, one adapter active)
            if adapter is not None:
                model = load_adapter(model, adapter, f"a{args.adapters.index(adapter)}")
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


def case_ids(suite, unit, k) -> list[str]:
    """The cases one unit of work yields: an EMPA scenario gives K dialogues, anything else one case."""
    if suite == "empa":
        return [f"{unit['id']}#{i}" for i in range(k)]
    return [unit["case"] if suite == "emobench" else unit["id"]]


def run_suite(suite, model, tok, batch, judge, user, args) -> tuple[list[dict], list[dict]]:
    if suite == "empa":
        return empa_cases(model, tok, batch, judge, user, args)
    if suite == "eqbench3":
        return eqbench3_cases(model, tok, batch, judge, args)
    if suite == "sage":
        return sage_cases(model, tok, batch, judge, user, args)
    cases = []
    for kind in ("EU", "EA"):
        items = [it for it in batch if it["case"].startswith(kind + "-")]
        if items:
            cases += emobench_cases(items, kind, lambda qs: answer_mcq(model, tok, qs, args), args.mcq)
    return cases, []


def load_adapter(model, path, name):
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


if __name__ == "__main__":
    common.run_main(main)

"""benchmarks/eqbench3.py: EQ-Bench 3 (the rubric benchmark), run by 05_eval.py --suite eqbench3.

What it is
  EQ-Bench 3 plays each scenario's fixed user turns (role-play, message drafting, analysis) to the tested
  model, then an LLM judge scores the transcript on the task's criteria, 0-20 each.
What this file holds
  load           scenario_prompts.txt (the public format) -> tasks {id, category, title, kind, prompts}
  cases          the protocol: every task of a batch answers its turn i in one generate call, then the judge
  proxy_scores   offline (no LLM judge): the embed judge's MDEP-PR levels stand in for the criteria
  parse_criteria the judge's JSON answer -> {criterion: 0-20}

Score
  EQ-Bench 3 score = 5 * the mean over tasks of (the mean of the task's criterion scores, each 0-20)

This project's choices (docs/evaluation.md)
  - The judge prompt (data/prompts.json "eqbench3_judge") and the six criteria per kind are this project's;
    replies are capped at --max-new-tokens, and later turns that do not fit --max-context are not played.
  - Offline it is a PROXY, not EQ-Bench: per axis clip(10 + 5 (progress - negative), 0, 20), each criterion
    the mean of its stand-in axis over the replies; analysis tasks are not scored (nothing offline can judge
    them).
A support module: it imports common.py, never a stage; 05 hands it the model, the judge and the flags.
"""
from __future__ import annotations

import json
import re
import statistics
from pathlib import Path

import common

HERE = Path(__file__).resolve().parents[1]
TEXTS = json.loads((HERE / "data" / "prompts.json").read_text(encoding="utf-8"))
TEXTS["eqbench3_judge"] = "\n".join(TEXTS["eqbench3_judge"])
ROLEPLAY_CRITERIA, ANALYSIS_CRITERIA = (tuple(TEXTS["eqbench3_criteria"][k]) for k in ("roleplay", "analysis"))
PROXY = "EQ-Bench 3 (offline proxy)"   # the column when the embed judge's levels stood in for the criteria
AXES = ("C", "A", "P")                 # the embed judge's axes (the proxy's stand-ins)


def cases(model, tok, tasks, judge, user, args) -> tuple[list[dict], list[dict]]:
    """The user is unused (the turns are fixed). Offline (no LLM judge) role-play and drafting get the proxy
    scores and analysis tasks are not played: nothing offline can judge an analysis (reported as such)."""
    llm = getattr(judge, "backend", None) is not None     # an LLM judge (hf:, api:, self), not the embed judge
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
                live.append(j)
                ctx.append(ids)
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
        scores = proxy_scores(convs, criteria, judge)
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


def proxy_scores(convs, criteria, judge) -> list[dict | None]:
    """The offline proxy (not EQ-Bench): the MDEP-PR levels of every reply -> per axis clip(10 + 5 (progress -
    negative), 0, 20) -> each criterion the mean of its stand-in axis over the replies. A reply that is not
    language (the judge's fluency check: gibberish, keyword salad) scores as an empty one: negative 1 everywhere."""
    fluency_min, cases, owner = getattr(judge, "th", {}).get("fluency", 0.0), [], []
    for j, c in enumerate(convs):
        for i in range(1, len(c), 2):
            cases.append({"scenario": {"id": str(j), "persona": "", "situation": ""}, "history": c[:i],
                          "reply": c[i]["content"]})
            owner.append(j)
    per_axis = [{a: [] for a in AXES} for _ in convs]
    for j, v in zip(owner, judge.judge(cases) if cases else []):
        if v is not None:
            not_language = v["features"].get("fluency", 1.0) < fluency_min
            for a in AXES:
                progress, negative = (0, 1) if not_language else v["levels"][a]
                per_axis[j][a].append(max(0.0, min(20.0, 10.0 + 5.0 * (progress - negative))))
    axis = TEXTS["eqbench3_proxy_axis"]      # the criterion's stand-in axis; None: no reply judged
    return [{x: statistics.mean(per_axis[j][axis[x]]) for x in cr} if all(per_axis[j].values()) else None
            for j, cr in enumerate(criteria)]


def load(path) -> tuple[list[dict], dict]:
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

"""benchmarks/sage.py: SAGE (SentientBench), run by 05_eval.py --suite sage.

What it is
  SAGE's simulator plays a person from a profile (player, scene, main_cha, cha_group, task, first_talk?)
  whose emotion (0-100) moves with every reply of the tested model; the Sentient score is the mean final
  emotion.
What this file holds
  load_profiles  the profiles JSONL (the public fields; the language read from the text)
  cases          the protocol on 03's rollout (05 hands it 03's environment): one dialogue per profile
  scenario       a profile as 03's rollout sees a scenario; openings: the LLM user's first messages
  SageJudge      the LLM judge as SAGE's simulator: it states the emotion's change; parse_change reads it

Score
  e_0 = 40, e_t = min(100, max(0, e_{t-1} + clip(change_t, -10, 10))); ends at e >= 100 (success), e < 10
  (failure) or after --sage-turns; Sentient score = the mean final emotion

This project's choices (docs/evaluation.md)
  - It runs on 03's rollout with this project's prompts (data/prompts.json "sage_judge", "sage_first_message");
    offline the change comes from the embed judge's levels (03's emotion_change: English cues only).
  - Without first_talk the user opens with what an LLM user writes from the profile (offline: a line naming
    main_cha), never with the scene.
A support module: it imports common.py, never a stage; 05 hands it 03's environment (env).
"""
from __future__ import annotations

import argparse
import json
import math
import re
from pathlib import Path

import common

HERE = Path(__file__).resolve().parents[1]
TEXTS = json.loads((HERE / "data" / "prompts.json").read_text(encoding="utf-8"))
TEXTS.update({k: "\n".join(TEXTS[k]) for k in ("sage_judge", "sage_first_message")})
START = 40.0                 # the user's emotion before the first reply (SAGE's simulator starts at 40)
AXES = ("C", "A", "P")       # 03's axes: SAGE's simulator gives no levels on them (v_t = 0)


def cases(model, tok, profiles, judge, user, args, env) -> tuple[list[dict], list[dict]]:
    """03's rollout by SAGE's rules: one dialogue per profile, e_0 = START (40), at most --sage-turns, ending
    at e >= 100 or e < 10. The change is the LLM judge's (SageJudge), or offline the embed judge's levels:
    change_t = clip(2.5 * sum_axis v_t,axis, -10, 10) (03's emotion_change)."""
    sage_args = argparse.Namespace(**{**vars(args), "k": 1, "max_turns": args.sage_turns,
                                      "emotion_start": START, "emotion_ends": True})
    if getattr(judge, "backend", None) is not None:     # an LLM judge: SAGE's simulator states the change
        judge = SageJudge(judge.backend, args.judge_retries)
    elif any(p["language"] == "zh" for p in profiles):
        common.warn("sage: Chinese profiles with the offline judge, whose cues are English: their emotion changes "
                    "mean little (an LLM judge reads both)")
    written = openings(profiles, user, args)
    cases, transcripts = [], []
    for tr in env.rollout(model, tok, [scenario(p, written.get(p["id"])) for p in profiles], judge, user,
                          sage_args, desc="sage turns"):
        changes = [e1 - e0 for e0, e1, v in zip(tr.emotions, tr.emotions[1:], tr.vs) if v is not None]
        failed = "user failed" if tr.outcome == "user_failed" else "judge failed on every turn" if not changes else None
        cases.append({"case": tr.scenario["id"], "opening": tr.scenario["opening_from"], "outcome": tr.outcome,
                      "turns": tr.T, "judged_turns": len(changes), "final_emotion": tr.emotions[-1],
                      "emotions": tr.emotions, "changes": changes, "failed": failed})
        transcripts.append({"case": tr.scenario["id"], **env.trajectory_record(tr, sage_args)})
    return cases, transcripts


def scenario(p: dict, written: str | None = None) -> dict:
    """A profile as 03's rollout and users see a scenario; p0 = 0 (the user's state is its emotion). The user
    opens with first_talk, else what an LLM user wrote (openings), else a short line naming main_cha:
    never with the scene, the simulator's private background."""
    offline = TEXTS["sage_offline_opening"][p["language"]].format(name=p["main_cha"].strip())
    opening, source = ((p["first_talk"], "first_talk") if (p.get("first_talk") or "").strip() else
                       (written, "user model") if written else (offline, "offline line"))
    return {"id": p["id"], "persona": p["player"], "situation": f"{p['scene']} {p['task']}", "profile": p,
            "opening": opening, "opening_from": source, "p0": [0.0, 0.0, 0.0],
            "user_lines": TEXTS["sage_zh_lines"] if p["language"] == "zh" else TEXTS["scripted_user_lines"]}


def openings(profiles, user, args) -> dict:
    """{id: the first message} of the profiles without first_talk, written by the LLM user (any user with a
    chat backend) from the profile, as SAGE's simulator does; asked again (--judge-retries) when empty or
    reciting the scene. Missing where there is no LLM user or no usable answer (scenario's line)."""
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
        return [None if ch is None else {"levels": {a: (0, 0) for a in AXES}, "features": {}, "change": ch}
                for ch in changes]


def load_profiles(path) -> list[dict]:
    recs = common.read_jsonl(path, {"id": (str, int), "player": str, "scene": str, "main_cha": str,
                                    "cha_group": (str, list), "task": str}, {"first_talk": str}, unique=("id",))
    for r in recs:       # the language, from the text (the profiles do not state it)
        r["id"], r["language"] = str(r["id"]), "zh" if re.search(r"[\u4e00-\u9fff]", r["player"] + r["scene"]) else "en"
    return recs


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

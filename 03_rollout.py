"""03_rollout.py: the EMPA-style support environment and batched multi-turn rollouts.

What it does
  A policy model talks to a simulated user about a scenario. After every reply a judge turns (persona,
  history, reply) into a progress vector v_t on three support axes, the user's hidden state moves, and the
  user answers. K dialogues per scenario; every live dialogue is answered in one batched generate call per
  turn that keeps each dialogue's KV cache, so only the new tokens (the user's message) are prefilled.
  04 and 05 import this environment; run alone, it samples a few dialogues and prints them.

Reads   scenarios JSONL (data/scenarios_{train,test}.jsonl: id, persona, situation, opening, the 9 EMPA
        ratings `items` or p0 = [C, A, P], optional user_lines); data/judge_prototypes.json (offline.py's embed judge).
Writes  <run>/rollouts.jsonl: every turn's messages, P_t, v_t, levels, distance, IDR reward, the user's
        emotion e_t and flags (cut_off, judge_failed); <run>/args.json.

Equations (EMPA; docs/reference.md sections 1-4)
  initial deficit   C = -2(C1 + C2 + 1.5 C3),  A = -2(A1 + 2 A2 + 1.5 A3),  P = -2(P1 + 2 P2 + 1.5 P3)
  judge (MDEP-PR)   per axis a progress level in {0,1,2} worth {0,+1,+3} and a negative level in {0,1,2}
                    worth {0,-2,-4} on C and {0,-2,-5} on A and P;  v_t,a = progress + negative points
  state             P_t = P_{t-1} + v_t   (not clipped: it can overshoot the origin)
  distance          d(P) = sqrt( sum_a w_a * max(0, -eps - P_a)^2 ),  w = (1,1,1), eps = 1
  reward (IDR)      r_t = d(P_{t-1}) - d(P_t)     (written to the JSONL; 04 computes its own rewards)
  direction         v* = -P0/||P0||,  dE_t = v_t . v*,  E_total = sum_t dE_t
  success           t >= min_turns and E_total >= ||P0||
  failure           t >= min_turns and (the last `collapse window` dE all < 0  or  (the sample std of the
                    last 5 ||P_t|| < 0.5 and >= 6 of the last 8 dE < 0 and the sum of all 8 < -1));  max_turns: timeout
                    (dE_t, ||P_t|| and E_total rounded to 2 decimals before these checks, as MICA's public code)
  user emotion      e_0 = --emotion-start, e_t = min(100, max(0, e_{t-1} + clip(2.5 sum_a v_t,a, -10, 10)))
                    (SAGE / RLVER's scale; the mapping from the levels is ours, unless the judge states the
                    change, as 05's SAGE simulator does); with --emotion-ends the episode ends at e >= 100
                    (success) or e < 10 (failure) instead of by the rules above, from the first turn on
  --kardia-format   the policy is asked for <understanding>, <reasoning>, <emotion>, <response> sections;
                    only the response reaches the user and the judge (Kardia-R1); a reply without the four
                    sections reaches them whole, its tags removed

Judges and users: --judge embed | self | hf: | api: and --user scripted | self | hf: | api:, the offline stand-ins
  (offline.py) or an LLM with its prompt here (LLMJudge, LLMUser); self is the policy's own frozen base. What each
  is and is not, and what a failed turn does: docs/environment.md.

Where each part lives
  here          EnvOptions; the equations (initial_deficit to emotion_status); the Trajectory and its state;
                the batched rollout (rollout, policy_turn, user_turn, TurnCache); the LLM judge and user; main
                (load, sample_dialogues, save)
  sampling.py   the sampler and the scorer (one module: what is sampled is what 04's loss scores)
  offline.py    the offline judge (embed) and the scripted user;  backends.py  hf:, api:, self;  engine.py  --engine

Departures from EMPA, one line each; the reasons: docs/reference.md, "Known departures at a glance" (item)
  1. the shipped scenarios start at ||P0|| 17.5-25.3, not 17.5-41 (9)
  2. the training defaults are short (3 turns, no end before turn 2, collapse window 3); EMPA's rules are flags (4)
  3. a local LLM judge decodes greedily and is not asked again; an api: judge is, --judge-retries times (13)
  4. the user's emotion change is derived from the judge's levels offline (10)
  Not a departure, a rule: tokens in, tokens out (training sees the very ids sampled; a <think> part is cut only
  from what the user and the judge see).

CPU:  python 03_rollout.py                     (SmolLM2-135M-Instruct, embed judge, scripted user)
GPU:  python 03_rollout.py --model Qwen2.5-7B-Instruct --judge api:Qwen2.5-72B-Instruct \\
          --user api:Qwen2.5-72B-Instruct --api-base http://localhost:8000/v1 --max-turns 15
"""

from __future__ import annotations

import json
import math
import os
import re
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

import backends
import common
import offline
import options
import runs
import sampling

HERE = Path(__file__).resolve().parent
AXES = ("C", "A", "P")
# EMPA's initial-deficit items: (axis, multiplier m); each adds -2 * m * level (level 0-3)
DEFICIT_ITEMS = {
    "C1": ("C", 1.0),
    "C2": ("C", 1.0),
    "C3": ("C", 1.5),
    "A1": ("A", 1.0),
    "A2": ("A", 2.0),
    "A3": ("A", 1.5),
    "P1": ("P", 1.0),
    "P2": ("P", 2.0),
    "P3": ("P", 1.5),
}
PROGRESS_POINTS = (0.0, 1.0, 3.0)  # progress level 0, 1, 2
NEGATIVE_POINTS = {"C": (0.0, -2.0, -4.0), "A": (0.0, -2.0, -5.0), "P": (0.0, -2.0, -5.0)}
# the LLM judge's and user's prompts, what the user is told of the trend, the scripted user's lines when a
# scenario brings none, the policy's system prompt and Kardia-R1's format request (data/prompts.json)
PROMPTS = json.loads((HERE / "data" / "prompts.json").read_text(encoding="utf-8"))
JUDGE_PROMPT, USER_PROMPT = ("\n".join(PROMPTS[k]) for k in ("mdep_judge", "user"))
TREND_TEXT, DEFAULT_USER_LINES = PROMPTS["trend"], PROMPTS["scripted_user_lines"]
MAX_MESSAGE_CHARS = 2000  # a simulated-user message is cut to this (an LLM user can run on)
EPS = 1.0  # the hinge distance's tolerance eps (EMPA: 1 high, 2 medium, 3 low empathy thresholds; MICA trains at 1)
# each dialogue's KV cache kept between turns, so only its new tokens are prefilled (False: the whole context
# again every turn, slower: the check that the cache changes nothing, tests/test_rollout.py)
KV_REUSE = True


# ---------------------------------------------------------------------------------------------
# The options: the environment's (04 and 05 take them too), then this script's own
# ---------------------------------------------------------------------------------------------
count, at_least_0 = options.number(int, low=1), options.number(low=0)  # checking types: a bad value exits 2


@dataclass
class EnvOptions:
    """The environment: scenarios, K, the episode rules, the judge and the user, sampling (03, 04, 05)."""

    scenarios: str = options.option(str(HERE / "data" / "scenarios_train.jsonl"), "scenarios JSONL")
    k: int = options.option(4, "dialogues per scenario (K)", type=count)
    max_turns: int = options.option(3, "assistant turns before a timeout (EMPA: 45)", type=count)
    min_turns: int = options.option(
        2, "no success or failure before this turn (EMPA: 12; --emotion-ends ignores it)", type=count
    )
    collapse_window: int = options.option(3, "failure when the last N dE are all < 0 (EMPA: 5)", type=count)
    judge: str = options.option(
        "embed",
        "embed | self | hf:<model-or-path> | api:<model>: the EMPA judge, and in 04 also the criteria judge of "
        "--reward care and kardia (embed: a MiniLM cosine there)",
    )
    judge_retries: int = options.option(
        2,
        "re-asks of an api: judge on malformed JSON (a local judge at temperature 0 is not re-asked: it would "
        "answer the same)",
        type=options.number(int, low=0),
    )
    user: str = options.option("scripted", "scripted | self | hf:<model-or-path> | api:<model>")
    judge_concurrency: int | None = options.option(
        None, "the judge's own --api-concurrency (match what its server batches, e.g. vLLM --max-num-seqs)", type=count
    )
    user_concurrency: int | None = options.option(None, "the simulated user's own --api-concurrency", type=count)
    emotion_start: float = options.option(
        30.0,
        "the simulated user's emotion e_0 (0-100; RLVER trains from 30, SAGE evaluates from 40)",
        type=options.number(low=0, high=100),
    )
    emotion_ends: bool = options.option(
        False, "end dialogues by RLVER's rule (emotion >= 100 success, < 10 failure) instead of EMPA's"
    )
    kardia_format: bool = options.option(
        False,
        "Kardia-R1's format: the policy writes <understanding>, <reasoning>, <emotion>, <response>; only the "
        "response reaches the others (a reply without the four sections: all of it, the tags removed)",
    )
    max_new_tokens: int | None = options.option(
        None, "token cap of a reply (48; 192 with --kardia-format, room for the four sections)", type=count
    )
    temperature: float = options.option(1.0, "sampling temperature (0 = greedy)", type=at_least_0)
    top_p: float = options.option(
        1.0,
        "nucleus sampling top-p (04's loss scores the whole distribution: keep 1 for training)",
        type=options.number(above=0, high=1),
    )
    max_context: int = options.option(
        2048, "stop a dialogue (outcome context_limit) before its context passes this many tokens", type=count
    )


@dataclass
class Args:
    """03_rollout.py's own: how many scenarios to sample and whether to print them."""

    num_scenarios: int = options.option(2, "how many scenarios (0 = all)", type=options.number(int, low=0))
    quiet: bool = options.option(False, "do not print transcripts")


# ---------------------------------------------------------------------------------------------
# The equations: the EMPA state, distance, reward, episode rules, the user's emotion
# ---------------------------------------------------------------------------------------------
def initial_deficit(items: dict) -> list[float]:
    # P0_axis = sum over the axis' items of -2 * m * level
    P0 = {"C": 0.0, "A": 0.0, "P": 0.0}
    for name, (axis, m) in DEFICIT_ITEMS.items():
        P0[axis] += -2.0 * m * items[name]
    return [P0["C"], P0["A"], P0["P"]]


def norm(x) -> float:
    return math.sqrt(sum(float(a) ** 2 for a in x))


def hinge_distance(P, weights=(1.0, 1.0, 1.0), eps=1.0) -> float:
    # d(P) = sqrt( sum_axis w_axis * max(0, -eps - P_axis)^2 )
    total = 0.0
    for w_a, P_a in zip(weights, P):
        total += w_a * max(0.0, -eps - P_a) ** 2
    return math.sqrt(total)


def incremental_distance_rewards(states, weights=(1.0, 1.0, 1.0), eps=1.0) -> list[float]:
    """states = [P0, P1, ..., PT] of one trajectory -> [r_1, ..., r_T]. weights: one (w_C, w_A, w_P) for
    every turn, or a list of T of them (04's idr+care weights turn t's distance by its rubric)."""
    per_turn = len(weights) == len(states) - 1 and all(isinstance(w, (list, tuple)) for w in weights)
    # r_t = d(P_{t-1}) - d(P_t)
    r = []
    for t in range(1, len(states)):
        w = weights[t - 1] if per_turn else weights
        r.append(hinge_distance(states[t - 1], w, eps) - hinge_distance(states[t], w, eps))
    return r


def episode_status(P0, dEs, states, t, args) -> str | None:
    """'success', 'failure' or None (go on) after turn t (1-based), by the EMPA rules above, on the values
    rounded to 2 decimals as MICA's public code compares them (epj/scoring.py reads its rounded trajectory)."""
    if t < args.min_turns:
        return None
    # E_total rounded, ||P0|| not (the threshold is the scenario's own, not a judged value): the two differ by at
    # most 0.005, and rounding ||P0|| too could flip a borderline success of a pinned run
    if round(sum(dEs), 2) >= norm(P0):  # E_total >= ||P0||
        return "success"
    dE2 = [round(dE, 2) for dE in dEs]
    w = args.collapse_window
    if len(dE2) >= w and all(dE < 0 for dE in dE2[-w:]):
        return "failure"  # collapsed
    if len(dE2) >= 8:  # 8 turns: states holds P_0 .. P_8, 9 of them
        stagnant = common.mean_std([round(norm(P), 2) for P in states[-5:]], ddof=1)[1] < 0.5
        regressing = sum(dE < 0 for dE in dE2[-8:]) >= 6 and sum(dE2[-8:]) < -1
        if stagnant and regressing:
            return "failure"
    return None


def levels_to_v(levels: dict) -> list[float]:
    # v_t,axis = progress points[level] + negative points[axis][level]
    return [PROGRESS_POINTS[levels[a][0]] + NEGATIVE_POINTS[a][levels[a][1]] for a in AXES]


def emotion_change(levels: dict) -> float:
    """The simulated user's emotion change (SAGE / RLVER, docs/reference.md section 4) from the judged
    levels; our mapping, not the papers' (their simulator states it): A+1 alone is +2.5, level 1 on every
    axis +7.5, an off-topic reply (C-1, A-1) -10."""
    # change_t = clip(2.5 * sum_axis v_t,axis, -10, 10)
    return max(-10.0, min(10.0, 2.5 * sum(levels_to_v(levels))))


def emotion_status(e: float) -> str | None:
    # RLVER / SAGE: the episode ends at e >= 100 (success) or e < 10 (failure)
    return "success" if e >= 100 else "failure" if e < 10 else None


@dataclass
class Trajectory:
    scenario: dict
    k: int
    ids: list[int]  # the policy's whole context, token ids
    messages: list[dict]  # the same dialogue as text
    spans: list[tuple[int, int]] = field(default_factory=list)  # [start, end) of each reply's ids
    states: list[list[float]] = field(default_factory=list)  # P_0 .. P_T
    vs: list[list[float] | None] = field(default_factory=list)  # v_1 .. v_T (None: the judge failed)
    levels: list[dict | None] = field(default_factory=list)
    features: list[dict] = field(default_factory=list)
    dEs: list[float] = field(default_factory=list)
    cut_off: list[bool] = field(default_factory=list)
    sampler_logprobs: list[list[float]] = field(default_factory=list)  # each reply token's, as it was sampled
    emotions: list[float] = field(default_factory=list)  # e_0 .. e_T, the user's emotion (0-100)
    shown: list[str] = field(default_factory=list)  # what the user and the judge saw of each reply
    formatted: list[bool] = field(default_factory=list)  # --kardia-format: the reply had the 4 sections
    extra: dict = field(default_factory=dict)  # per-turn lists a trainer adds (04: CARE's rubrics)
    outcome: str | None = None  # success | failure | timeout | context_limit | user_failed

    @property
    def T(self) -> int:
        return len(self.spans)

    @property
    def judge_failed(self) -> list[bool]:
        return [v is None for v in self.vs]

    def seen_history(self) -> list[dict]:
        """The dialogue as the user and the judges saw it: each reply's shown part (01's graders read it too)."""
        shown = iter(self.shown)
        return [{"role": "assistant", "content": next(shown)} if m["role"] == "assistant" else m for m in self.messages]


def advance_state(tr: Trajectory, verdict: dict | None):
    """Turn t's judgement moves the hidden state: P_t = P_{t-1} + v_t, dE_t = v_t . v*, and the user's
    emotion e_t. A failed judgement (None) leaves both where they were and flags the turn."""
    P_prev = tr.states[-1]
    if verdict is None:
        tr.vs.append(None)
        tr.levels.append(None)
        tr.features.append({})
        tr.states.append(list(P_prev))
        tr.dEs.append(0.0)
        tr.emotions.append(tr.emotions[-1])
        return
    v = levels_to_v(verdict["levels"])
    r0 = norm(tr.scenario["p0"])  # 0 for 05's SAGE profiles: no EMPA deficit
    v_star = [-x / r0 if r0 > 0 else 0.0 for x in tr.scenario["p0"]]  # v* = -P0 / ||P0||
    tr.vs.append(v)
    tr.levels.append(verdict["levels"])
    tr.features.append(verdict["features"])
    tr.states.append([P_prev[i] + v[i] for i in range(3)])  # P_t = P_{t-1} + v_t
    tr.dEs.append(sum(v[i] * v_star[i] for i in range(3)))  # dE_t = v_t . v*
    # e_t = min(100, max(0, e_{t-1} + change_t)); the judge's own change when it states one (05's SAGE)
    change = verdict["change"] if verdict.get("change") is not None else emotion_change(verdict["levels"])
    tr.emotions.append(min(100.0, max(0.0, tr.emotions[-1] + change)))


# ---------------------------------------------------------------------------------------------
# The main loop: a batched multi-turn rollout (tokens in, tokens out)
# ---------------------------------------------------------------------------------------------
def rollout(
    model, tokenizer, scenarios: list[dict], judge, user, args, desc="rollout", engine=None
) -> list[Trajectory]:
    """K trajectories per scenario, every dialogue advanced together, one turn at a time. The policy samples with
    generate and the KV cache of the last turn (TurnCache), or with an engine (engine.py: --engine) its server."""
    trajs = []
    for s in scenarios:
        msgs, ids = opening_ids(tokenizer, s, args)
        trajs += [
            Trajectory(
                scenario=s,
                k=k,
                ids=list(ids),
                messages=[dict(m) for m in msgs],
                states=[list(s["p0"])],
                emotions=[args.emotion_start],
            )
            for k in range(args.k)
        ]
    for tr in trajs[:: args.k]:  # the first turn's requests fit the window, or one line before any is sent
        common.check(
            judge_and_user_fit(tokenizer, tr, judge, user, args),
            f"scenario {tr.scenario['id']}: the judge's or the user's first request does not fit --max-context "
            f"{args.max_context} (their prompts hold the dialogue and their instructions): raise --max-context (and "
            "the engine's --max-model-len with it)",
        )
    was_training = model.training
    model.eval()
    new_sampler = TurnCache if engine is None else engine.turns
    kv, row_of = new_sampler(), {}  # the last turn's KV cache (or the engine's rows) and which dialogue each row is
    for t in tqdm(range(1, args.max_turns + 1), desc=desc, leave=False, disable=not args.progress):
        live = [tr for tr in trajs if tr.outcome is None]
        if not live:
            break
        # 1. the policy answers every live dialogue in one batched call (prefilling only what is new)
        if not KV_REUSE:
            kv = new_sampler()
        kv.keep_rows([row_of[id(tr)] for tr in live] if row_of else [])
        row_of = {id(tr): b for b, tr in enumerate(live)}
        cases = policy_turn(model, tokenizer, live, args, kv)
        # 2. the judge: v_t at the EMPA levels; P_t = P_{t-1} + v_t; the user's emotion e_t
        for tr, verdict in zip(live, judge.judge(cases)):
            advance_state(tr, verdict)
            # 3. does the episode end? (EMPA's rules, or with --emotion-ends RLVER's on the emotion)
            tr.outcome = (
                emotion_status(tr.emotions[-1])
                if args.emotion_ends
                else episode_status(tr.scenario["p0"], tr.dEs, tr.states, t, args)
            )
            if tr.outcome is None and t == args.max_turns:
                tr.outcome = "timeout"
        # 4. the simulated user answers the dialogues that go on (those whose next turn fits the window)
        user_turn(tokenizer, [tr for tr in live if tr.outcome is None], user, args, judge)
    model.train(was_training)
    return trajs


def policy_turn(model, tokenizer, live: list[Trajectory], args, kv) -> list[dict]:
    """Sample every live dialogue's reply; append its ids and text; return the judge's cases."""
    cases = []
    for tr, reply in zip(live, kv.generate(model, tokenizer, [tr.ids for tr in live], args)):
        text = tokenizer.decode(reply.ids, skip_special_tokens=True).strip()
        tr.spans.append((len(tr.ids), len(tr.ids) + len(reply.ids)))
        tr.ids.extend(reply.ids)
        tr.cut_off.append(not reply.ended)
        tr.sampler_logprobs.append(reply.logprobs)
        seen = common.strip_thinking(text)  # a thinking model's <think> part reaches no one
        shown, ok = kardia_response(seen) if args.kardia_format else (seen, True)
        tr.shown.append(shown)
        tr.formatted.append(ok)
        cases.append(
            {"scenario": tr.scenario, "history": tr.seen_history(), "reply": shown, "emotion": tr.emotions[-1]}
        )
        tr.messages.append({"role": "assistant", "content": text})
    return cases


def user_turn(tokenizer, going: list[Trajectory], user, args, judge=None):
    """The simulated user's next message in each dialogue that goes on, told the trend and the band; a dialogue
    whose next turn would not fit --max-context (the policy's, the judge's or the user's request) ends here."""
    asks = []
    for tr in going:
        # better / stuck / worse: the last change of the user's state, dE_t (EMPA) or e_t - e_{t-1}
        x = tr.emotions[-1] - tr.emotions[-2] if args.emotion_ends else tr.dEs[-1]
        trend = "better" if x > 0.5 else "worse" if x < -0.5 else "stuck"
        band = (
            f"your emotion is {tr.emotions[-1]:.0f} out of 100 (0 = desperate, 100 = fully supported)"
            if args.emotion_ends
            else state_band(hinge_distance(tr.states[-1], eps=EPS), hinge_distance(tr.states[0], eps=EPS))
        )
        asks.append(
            {
                "scenario": tr.scenario,
                "k": tr.k,
                "history": tr.seen_history(),
                "trend": trend,
                "band": f"{band}; {TREND_TEXT[trend]}",
            }
        )
    for tr, answer in zip(going, user.reply(asks) if going else []):
        if answer is None:
            tr.outcome = "user_failed"
            continue
        if len(answer) > MAX_MESSAGE_CHARS:
            common.warn(
                f"a simulated-user message of {len(answer):,} characters was cut to "
                f"{MAX_MESSAGE_CHARS} (scenario {tr.scenario['id']})"
            )
            answer = answer[:MAX_MESSAGE_CHARS]
        tr.messages.append({"role": "user", "content": answer})
        end = None if tr.cut_off[-1] else tokenizer.decode(tr.ids[-1:])  # the end-of-turn token it sampled
        extra = next_user_ids(tokenizer, tr.messages, tr.messages[-2]["content"], end)
        if len(tr.ids) + len(extra) + args.max_new_tokens > args.max_context or not judge_and_user_fit(
            tokenizer, tr, judge, user, args
        ):
            tr.outcome = "context_limit"
            tr.messages.pop()
            continue
        tr.ids.extend(extra)


def judge_and_user_fit(tokenizer, tr: Trajectory, judge, user, args) -> bool:
    """The window rule (docs/scale.md): every request of a dialogue's next turn fits --max-context, the policy's
    (checked beside this), the judge's of the next reply and the user's after it, each prompt with its answer."""
    need = [role.request_tokens(tokenizer, tr, args) for role in (judge, user) if hasattr(role, "request_tokens")]
    return max(need, default=0) <= args.max_context


def trajectory_record(tr: Trajectory, args, rewards: list[float] | None = None, **extra) -> dict:
    """One JSONL record: every turn's messages, state, v_t, levels, distance, reward and flags."""
    d = [hinge_distance(P, eps=EPS) for P in tr.states]
    # default reward written here: IDR r_t = d(P_{t-1}) - d(P_t); the trainer passes its own
    rewards = rewards if rewards is not None else incremental_distance_rewards(tr.states, eps=EPS)
    replies = [i for i, m in enumerate(tr.messages) if m["role"] == "assistant"]
    turns = [
        {
            "t": t + 1,
            "user": tr.messages[i - 1]["content"],
            "assistant": tr.messages[i]["content"],
            "v": tr.vs[t],
            "levels": tr.levels[t],
            "state": tr.states[t + 1],
            "distance": round(d[t + 1], 4),
            "dE": round(tr.dEs[t], 4),
            "reward": rewards[t],
            "cut_off": tr.cut_off[t],
            "judge_failed": tr.vs[t] is None,
            "emotion": tr.emotions[t + 1],
            **({"shown": tr.shown[t], "formatted": tr.formatted[t]} if args.kardia_format else {}),
            "reply_tokens": tr.spans[t][1] - tr.spans[t][0],
            "judge_features": tr.features[t],
        }
        for t, i in enumerate(replies[: tr.T])
    ]
    return {
        "scenario_id": tr.scenario["id"],
        "k": tr.k,
        "p0": tr.scenario["p0"],
        "outcome": tr.outcome,
        "turns": turns,
        "final_distance": round(d[-1], 4),
        "initial_distance": round(d[0], 4),
        "E_total": round(sum(tr.dEs), 4),
        "final_emotion": tr.emotions[-1],
        "return": round(sum(rewards), 4),
        **extra,
    }


# ---------------------------------------------------------------------------------------------
# The entry point: parse, load, sample, save
# ---------------------------------------------------------------------------------------------
@dataclass
class Run:
    """What the rollout works with, made once by load."""

    args: object
    dir: Path  # the run folder
    scenarios: list[dict]
    model: torch.nn.Module  # the policy, frozen
    tokenizer: object
    judge: object
    user: object


def load(args) -> Run:
    """The scenarios (checked first), the policy, the judge and the user, then the run folder."""
    scenarios = load_scenarios(args.scenarios)[: args.num_scenarios or None]  # inputs checked before anything
    common.check_model_args(args)
    from transformers import set_seed

    set_seed(args.seed)  # after the input checks (importing transformers takes seconds), before LoRA's draws
    model, tokenizer = common.load_policy(args, trainable=False)
    judge, user = make_judge(args, (model, tokenizer)), make_user(args, (model, tokenizer))
    run_dir = runs.open_run(args)  # after every model loaded: a bad one leaves no folder
    return Run(args, run_dir, scenarios, model, tokenizer, judge, user)


def sample_dialogues(run: Run) -> list[dict]:
    """K dialogues per scenario, as rollouts.jsonl's records."""
    trajectories = rollout(run.model, run.tokenizer, run.scenarios, run.judge, run.user, run.args)
    return [trajectory_record(tr, run.args) for tr in trajectories]


def save(run: Run, records: list[dict], t0: float):
    """rollouts.jsonl, the transcripts printed (unless --quiet), then the totals (seconds since t0)."""
    runs.append_jsonl(run.dir / "rollouts.jsonl", records)
    for rec in records if not run.args.quiet else []:
        print(
            f"\n=== {rec['scenario_id']} k={rec['k']}  P0={rec['p0']}  outcome={rec['outcome']}  "
            f"d: {rec['initial_distance']} -> {rec['final_distance']}  return={rec['return']:.3f}"
        )
        for tu in rec["turns"]:
            flags = " [cut off]" * tu["cut_off"] + " [judge failed]" * tu["judge_failed"]
            print(f"  user:      {tu['user']}\n  assistant: {tu['assistant']}{flags}")
            print(f"             v={tu['v']}  P={tu['state']}  d={tu['distance']}  r={tu['reward']:.3f}")
    n, judged = len(records), [t["judge_failed"] for r in records for t in r["turns"]]
    print(
        f"\n{n} trajectories in {time.time() - t0:.1f}s | mean return {sum(r['return'] for r in records) / n:.3f} "
        f"| success {sum(r['outcome'] == 'success' for r in records)}/{n} | mean final distance "
        f"{sum(r['final_distance'] for r in records) / n:.3f} | written to {run.dir / 'rollouts.jsonl'}"
    )
    print(
        f"judge failed on {sum(judged)}/{len(judged)} turns | user failed in "
        f"{sum(r['outcome'] == 'user_failed' for r in records)} dialogues"
        + "".join(f" | {k} {v}" for k, v in backends.api_counts(run.judge, run.user).items())
    )


def main(argv=None):
    args = parse_args(argv)
    run = load(args)
    t0 = time.time()
    records = sample_dialogues(run)
    save(run, records, t0)


# ---------------------------------------------------------------------------------------------
# --- supporting pieces ---: scenarios, judges, users, tokens and the KV cache, CLI
# ---------------------------------------------------------------------------------------------
def load_scenarios(path) -> list[dict]:
    """Read and check scenarios; each gets p0 (from `items` unless given) and default user lines."""
    recs = runs.read_jsonl(path, {"id": str, "persona": str, "situation": str, "opening": str}, unique=("id",))
    for r in recs:
        w = r["_where"]
        common.check(r["opening"].strip(), f"{w}: field 'opening' is empty")
        if "p0" in r:
            common.check(
                isinstance(r["p0"], list)
                and len(r["p0"]) == 3
                and all(type(x) in (int, float) and x <= 0 for x in r["p0"]),
                f"{w}: field 'p0' must be a list of 3 numbers <= 0 (C, A, P)",
            )
            r["p0"] = [float(x) for x in r["p0"]]
        else:
            common.check(isinstance(r.get("items"), dict), f"{w}: needs field 'items' (9 ratings) or 'p0'")
            for name in DEFICIT_ITEMS:
                v = r["items"].get(name)
                common.check(type(v) is int and 0 <= v <= 3, f"{w}: field 'items.{name}' must be an integer 0-3")
            r["p0"] = initial_deficit(r["items"])
        common.check(norm(r["p0"]) > 0, f"{w}: the initial deficit is zero: nothing to support")
        common.check(
            isinstance(r.get("profile", {}), dict),
            f"{w}: field 'profile' must be an object (e.g. MBTI, about, situation, emotion)",
        )
        lines = r.get("user_lines", {})
        common.check(isinstance(lines, dict), f"{w}: field 'user_lines' must be an object")
        for trend in ("better", "stuck", "worse"):
            got = lines.get(trend, [])
            common.check(
                isinstance(got, list) and all(isinstance(s, str) and s.strip() for s in got),
                f"{w}: field 'user_lines.{trend}' must be a list of non-empty strings",
            )
        r["user_lines"] = {t: lines.get(t) or DEFAULT_USER_LINES[t] for t in ("better", "stuck", "worse")}
    return recs


# the LLM judge: cases {scenario, history, reply} -> {"levels": {axis: (progress 0-2, negative 0-2)},
# "features"} or None (failed); offline.EmbedJudge answers the same way
def parse_judge_json(text: str | None) -> dict | None:
    """The judge's JSON (perhaps in prose or a code fence) -> levels, or None if it is not valid."""
    obj, levels = backends.first_json(text)[0] or {}, {}
    for a in AXES:
        lv = obj.get(a) if isinstance(obj.get(a), dict) else {}
        p, n = lv.get("progress"), lv.get("negative")
        if not (type(p) is int and type(n) is int and 0 <= p <= 2 and 0 <= n <= 2):
            return None
        levels[a] = (p, n)
    return levels


JUDGE_MAX_TOKENS, USER_MAX_TOKENS = 200, 120  # the LLM judge's answer, the LLM user's message
REQUEST_SLACK = 16  # tokens: a reply's text re-tokenised inside another prompt, the user's band and trend


def seed_of(seed: int, item: dict) -> int:
    """An LLM judge's or user's request seed: the step's seed, the scenario, the dialogue k and the turn."""
    key = f"{seed}|{item['scenario'].get('id')}|{item.get('k', 0)}|{len(item['history'])}"
    return zlib.crc32(key.encode())


class LLMJudge:
    def __init__(self, backend: backends.ChatBackend, retries: int = 2, seed: int = 0):
        self.backend, self.retries = backend, retries
        self.seed = seed  # the step's seed (04 sets it each step), sent with each request to an endpoint

    def prompt(self, case: dict) -> list[dict]:
        history = common.transcript_lines(case["history"]) + [f"Supporter: {case['reply']}"]
        scenario = case["scenario"]
        content = JUDGE_PROMPT.format(
            persona=scenario["persona"], situation=scenario["situation"], history="\n".join(history)
        )
        return [{"role": "user", "content": content}]

    def judge(self, cases: list[dict]) -> list[dict | None]:
        prompts = [self.prompt(c) for c in cases]
        seeds = [seed_of(self.seed, c) for c in cases]
        # malformed output: asked again (api: only), then that turn is given up (None: judge_failed)
        levels = backends.ask_json(
            self.backend,
            prompts,
            lambda i, text: parse_judge_json(text),
            self.retries,
            max_tokens=JUDGE_MAX_TOKENS,
            seeds=seeds,
        )
        return [None if lv is None else {"levels": lv, "features": {}} for lv in levels]

    def request_tokens(self, tokenizer, tr: Trajectory, args) -> int:
        """The largest request this judge sends for tr's next reply: its prompt with a reply of --max-new-tokens
        tokens, and its answer. Counted for `self` only (the policy's tokenizer, the policy's window); another
        model's window is its own (0)."""
        if not self.backend.spec.startswith("self"):
            return 0
        case = {"scenario": tr.scenario, "history": tr.seen_history(), "reply": ""}
        prompt = common.render_ids(tokenizer, self.prompt(case))
        return len(prompt) + args.max_new_tokens + REQUEST_SLACK + JUDGE_MAX_TOKENS


# the LLM user: items {scenario, k, history, trend, band} -> the user's next message, or None (failed);
# offline.ScriptedUser answers the same way
class LLMUser:
    def __init__(self, backend: backends.ChatBackend, seed: int = 0):
        self.backend = backend
        # every user carries the step's seed (04 sets it each step, as for offline.ScriptedUser); a local LLM
        # user's draws come from torch's generator, which 04 seeds from the same step seed; an endpoint's (an
        # api: user, or the engine) from the seed each request carries (seed_of)
        self.seed = seed

    def conversation(self, item: dict) -> list[dict]:
        scenario = item["scenario"]
        system = USER_PROMPT.format(persona=scenario["persona"], situation=scenario["situation"], band=item["band"])
        # the roles swap: the supporter's words are the "user" turns of the role-playing model
        return [{"role": "system", "content": system}] + [
            {"role": "assistant" if m["role"] == "user" else "user", "content": m["content"]}
            for m in item["history"]
            if m["role"] != "system"
        ]

    def reply(self, items: list[dict]) -> list[str | None]:
        # an empty answer is a failed turn (not asked again: the dialogue ends as user_failed)
        return backends.ask_json(
            self.backend,
            [self.conversation(it) for it in items],
            lambda i, a: a.strip() if a and a.strip() else None,
            0,
            who="user",
            noun="dialogues",
            max_tokens=USER_MAX_TOKENS,
            temperature=0.7,
            seeds=[seed_of(self.seed, it) for it in items],
        )

    def request_tokens(self, tokenizer, tr: Trajectory, args) -> int:
        """The largest request this user sends after tr's next reply: the dialogue with a reply of
        --max-new-tokens tokens, the longest band, and its message. For `self` only, as LLMJudge's."""
        if not self.backend.spec.startswith("self"):
            return 0
        history = tr.seen_history() + [{"role": "assistant", "content": ""}]
        band = max([state_band(1, 1), state_band(0.5, 1), state_band(0, 1)], key=len)
        band += "; " + max(TREND_TEXT.values(), key=len)
        conversation = self.conversation({"scenario": tr.scenario, "history": history, "band": band})
        return len(common.render_ids(tokenizer, conversation)) + args.max_new_tokens + REQUEST_SLACK + USER_MAX_TOKENS


def state_band(d: float, d0: float) -> str:
    """What an LLM user is told of the hidden state: a band (the trend is added), not the numbers."""
    left = d / d0 if d0 > 0 else 0.0
    return (
        "you still feel very low and unsupported"
        if left > 0.75
        else "you feel somewhat better but not there yet"
        if left > 0.35
        else "you feel much better"
    )


def make_judge(args, policy=None, engine=None):
    """--judge's judge; policy: the (model, tokenizer) whose frozen base is --judge self, or with an engine
    (engine.py) the engine's base model."""
    if args.judge == "embed":
        return offline.EmbedJudge(HERE / "data" / "judge_prototypes.json", device=str(common.pick_device()))
    backend = backends.make_chat_backend(args.judge, args, args.judge_concurrency, policy, engine)
    return LLMJudge(backend, args.judge_retries, args.seed)


def make_user(args, policy=None, engine=None):
    """--user's simulated user; policy and engine: as for make_judge, for --user self."""
    if args.user == "scripted":
        return offline.ScriptedUser(args.seed)
    return LLMUser(backends.make_chat_backend(args.user, args, args.user_concurrency, policy, engine), args.seed)


# tokens in, tokens out: the opening, Kardia-R1's sections, what the user and the judge see, the KV cache


def kardia_response(text: str) -> tuple[str, bool]:
    """Kardia-R1's structured reply -> (the <response> part, True) when the four sections come in order
    with a non-empty response; otherwise (the text with any of the tags removed, False)."""
    m = re.fullmatch(
        r"\s*<understanding>.*?</understanding>\s*<reasoning>.*?</reasoning>\s*<emotion>.*?</emotion>"
        r"\s*<response>(.*?)</response>\s*",
        text,
        re.S,
    )
    if m and m.group(1).strip():
        return m.group(1).strip(), True
    return re.sub(r"</?(understanding|reasoning|emotion|response)>", " ", text).strip(), False


def opening_ids(tokenizer, s: dict, args) -> tuple[list[dict], list[int]]:
    """The first context: the system prompt and the scenario's opening. An opening too long for
    --max-context is cut (its end kept, where the person's request usually is), with a warning."""
    system = PROMPTS["policy_system"] + (PROMPTS["kardia_system"] if args.kardia_format else "")
    msgs = [{"role": "system", "content": system}, {"role": "user", "content": s["opening"]}]
    ids = common.render_ids(tokenizer, msgs)
    over = len(ids) + args.max_new_tokens - args.max_context
    if over > 0:
        opening = tokenizer(s["opening"], add_special_tokens=False)["input_ids"]
        keep = len(opening) - over - 8  # a few tokens of slack: re-tokenising can merge
        common.check(
            keep > 0,
            f"scenario {s['id']}: the system prompt alone leaves no room under --max-context {args.max_context}",
        )
        msgs[1]["content"] = tokenizer.decode(opening[-keep:], skip_special_tokens=True)
        ids = common.render_ids(tokenizer, msgs)
        common.warn(
            f"scenario {s['id']} ({s.get('_where', '?')}): opening of {len(opening):,} tokens cut to "
            f"its last {keep:,} to fit --max-context {args.max_context}"
        )
    return msgs, ids


def next_user_ids(tokenizer, messages: list[dict], reply_text: str, end: str | None) -> list[int]:
    """The token ids after a sampled reply: the template's close of the reply less what was sampled (`end`,
    the end-of-turn token the reply ended with, which may be any of the generation config's, not only the
    tokenizer's eos_token; None when the reply was cut off), the new user message and the generation
    prompt; messages ends with [reply, user]. Earlier turns must render as before. The reply is found
    verbatim or, where the template drops the thinking of earlier replies (Qwen3), without it; what only the
    generation prompt holds (Qwen3's empty <think></think>) stays in the context as it was sampled: tokens in,
    tokens out."""
    head, text = common.chat_text(tokenizer, messages[:-2]), common.chat_text(tokenizer, messages)
    start, i, rendered = len(os.path.commonprefix([head, text])), -1, reply_text
    if text.startswith(common.chat_text(tokenizer, messages[:-2], generation_prompt=False)):
        for rendered in dict.fromkeys([reply_text, common.strip_thinking(reply_text)]):  # as the template wrote it
            i = text.find(rendered, start)
            if i >= 0:
                break
    common.check(
        i >= 0,
        "the model's chat template does not keep earlier turns and the assistant reply "
        "verbatim; the token-in/token-out rollout needs one that does",
    )
    after = text[i + len(rendered) :]
    if end and end in after:
        after = after[after.index(end) + len(end) :]
    return tokenizer(after, add_special_tokens=False)["input_ids"]


class TurnCache:
    """The KV cache a batched generate call leaves behind, kept for the dialogues' next turn.

    Row b holds its dialogue's tokens so far, left-padded, then the sampled reply and whatever the batch
    generated after this row's end of turn (junk, masked out): `seq` and `mask` say which columns are real.
    The next turn appends each row's new tokens (the user's message) after a hole of padding; positions come
    from the mask's running count, so a row sees exactly its own tokens at their own positions, as a fresh
    prefill would, and only the new tokens are prefilled. The first turn prefills identical openings once."""

    def __init__(self):
        self.cache = self.seq = self.mask = None

    def keep_rows(self, rows: list[int]):
        """Narrow to these rows of the last call, in this order (the dialogues that go on)."""
        if self.cache is not None:
            index = torch.tensor(rows, device=self.seq.device)
            self.cache.batch_select_indices(index)
            self.seq, self.mask = self.seq[index], self.mask[index]

    def generate(self, model, tokenizer, contexts: list[list[int]], args) -> list[sampling.Reply]:
        """One reply per context (contexts[b] extends row b's real tokens); the cache is kept for the next."""
        pad, device = tokenizer.pad_token_id, next(model.parameters()).device
        if self.cache is None:
            input_ids, attn = sampling.left_pad(contexts, pad, device)
            cache = sampling.prefill_distinct(model, input_ids, attn)
        else:
            new = []
            for b, c in enumerate(contexts):
                real = self.seq[b][self.mask[b].bool()].tolist()
                assert c[: len(real)] == real, "TurnCache: a context does not extend its cached row"
                new.append(c[len(real) :])
            tail, tail_mask = sampling.left_pad(new, pad, device)
            input_ids, attn = torch.cat([self.seq, tail], 1), torch.cat([self.mask, tail_mask], 1)
            cache = self.cache  # every column but the last of self.seq
        replies, out = sampling.generate(
            model, tokenizer, input_ids, attn, args.max_new_tokens, args.temperature, args.top_p, cache
        )
        n_new = out.sequences.shape[1] - input_ids.shape[1]
        reply_mask = torch.tensor(
            [[1] * len(r.ids) + [0] * (n_new - len(r.ids)) for r in replies], dtype=attn.dtype, device=device
        ).reshape(len(replies), n_new)
        self.cache, self.seq, self.mask = out.past_key_values, out.sequences, torch.cat([attn, reply_mask], 1)
        return replies


def check_env_args(args):
    """What argparse's types cannot see: the reply cap's default, the judge and user specs, the context's room."""
    if args.max_new_tokens is None:
        args.max_new_tokens = 192 if args.kardia_format else 48
    for flag, offline_spec in (("judge", "embed"), ("user", "scripted")):
        spec = getattr(args, flag)
        common.check(
            spec in (offline_spec, "self") or (spec.startswith(("hf:", "api:")) and spec.partition(":")[2]),
            f"--{flag} must be {offline_spec}, self, hf:<model> or api:<model>, got '{spec}'",
        )
    common.check(
        args.max_context > args.max_new_tokens,
        f"--max-context must be larger than --max-new-tokens, got {args.max_context}",
    )


def parse_args(argv=None):
    p = options.options_parser(
        __doc__.split("\n")[0],
        [
            ("03_rollout.py", Args),
            ("environment", EnvOptions),
            ("model", options.ModelOptions),
            ("LLM endpoints (api: backends)", backends.EndpointOptions),
            ("run", runs.RunOptions),
        ],
    )
    p.set_defaults(scenarios=str(HERE / "data" / "scenarios_test.jsonl"), k=2, run_name="rollout")
    args = options.parse_options(p, argv)
    check_env_args(args)
    return args


if __name__ == "__main__":
    common.run_main(main)

"""experiments/credit.py: a credit-assignment playground where MICA, GRPO, REINFORCE++ and RLOO meet on equal terms.

What it shows
  How the three advantage estimators of 04_mica_train.py (MICA at several alphas, GRPO, REINFORCE++), and
  RLOO, the estimator the course's fork adds (docs/training.md, "Adding an estimator or a reward"; here the
  playground's own rloo_advantages, with the same numbers), compare when everything else is held fixed and
  exact: the same environment, the same tiny policy, the same plain policy-gradient update, the same seeds,
  20+ seeds in minutes on a CPU. The environment is 03_rollout's EMPA state dynamics, imported and not
  copied: a scenario's deficit P0, P_t = P_{t-1} + v_t
  with v_t = levels_to_v(levels) (03's advance_state), dE_t = v_t . v*, the IDR reward
  r_t = d(P_{t-1}) - d(P_t) (03's incremental_distance_rewards) and EMPA's success / collapse / timeout
  rules (03's episode_status). Only the judge is replaced: instead of a model reading a reply, a fixed
  table maps one of seven support moves to MDEP-PR levels. Two tables (--table):
  short    (judge_move, the default) delays of one turn: a concrete step pays only once the user feels
           understood, validation wears out, some moves help now and cost on the next turn. A myopic
           greedy policy comes close to the ceiling here.
  delayed  (judge_delayed) delays of three turns: nothing on P moves until a question that hurts now
           (-A1) has opened the hard topic, and it pays from the third turn after; reassurance and
           changing the subject help now and cost three turns later. A myopic greedy policy never asks
           the question, piles up the penalties and collapses: credit must reach back over turns.
What it cannot show
  Anything about language. It is a model of the environment's dynamics and of credit assignment: a
  tabular softmax over 7 moves and 36 coarse observations, whose moves have the effects the table says.
  A real judge is noisy, a real policy has millions of parameters and writes text, and a real user
  does not follow a table; which estimator wins here says which one assigns credit better under these
  rules, not which one trains the better supporter.

Reads   data/scenarios_train.jsonl (training) and data/scenarios_test.jsonl (held-out), via 03's load_scenarios.
Writes  <out>/credit.md (the table, as printed), <out>/credit.png (held-out return by step, mean and
        ±1 sd band over seeds, one line per estimator), <out>/credit.jsonl (one line per seed and estimator);
        with --survivors only <out>/survivors.md (the survivor question's tables, as printed); with --tune
        only <out>/tuned.md (the tuning table, the tuned table and the paired comparisons, as printed),
        <out>/tuned.jsonl (one line per run, tuning and fresh) and <out>/tuned.png (the fresh seeds'
        curves). <out> defaults to runs/credit or runs/credit-delayed under the current folder.

Equations (03 and 04 compute every one of them; this file adds the judge table, the policy and the update)
  state, reward     P_t = P_{t-1} + v_t,  dE_t = v_t . v*,  r_t = d(P_{t-1}) - d(P_t)           (03)
  advantages        MICA A = alpha A_turn + (1 - alpha) A_group;  GRPO A = (R_k - mean) / std;
                    REINFORCE++ A = (G - mean) / std over the batch                                (04)
                    RLOO A[k][t] = R_k - b_k, b_k = the mean of the other K - 1 outcomes R_j, on every
                    turn, not divided by a std                      (the course's fork; rloo_advantages)
  policy            pi(a | o) = softmax(theta[o])_a,  o = observe(P, P0, memory)   (36 x 7 logits, from 0;
                    observe_delayed under the delayed table, also 36 values)
  update            theta[o_t] += lr * (1/N) sum_{k,t} A[k][t] (onehot(a_t) - pi(. | o_t))   (N: turns in
                    the batch, as 04's loss averages over tokens; the gradient of log softmax)
  held-out return   the IDR return sum_t r_t = d(P0) - d(P_T) per dialogue, mean over --final-eval-k
                    dialogues per test scenario sampled from the policy (--eval-k for the curves); success:
                    EMPA's rule within --max-turns
  threshold         --threshold-frac of the way from the untrained (uniform) policy's held-out return to the
                    search ceiling (the best return a beam search over move sequences finds per test scenario)
  myopic greedy     a yardstick row: the policy that knows the table and takes argmax_a r_t every turn; how
                    close it comes to the ceiling says how much this environment asks of credit beyond one turn
  95% CI            mean ± t_{0.975, n-1} sd / sqrt(n) over the n seeds (05_eval.t_interval)

The move table and the training defaults were fixed from the reasoning in judge_move's comments, and
checked only against the uniform policy and the search ceiling (is success reachable in 15 turns? is
it rare by chance?), before any estimator was run; none was changed after (only the evaluation budget
and the myopic greedy row were added).

The delayed table (issue 49) was written to make the myopic greedy row fall far below the ceiling, on the
same dynamics, policy class, update and training defaults, and checked only against the three yardsticks
(uniform, myopic greedy, search ceiling) before any estimator ran on it. One change was made while only
the yardsticks had run: reflect was C1 A1 in every state at first, and the ceiling (beam 128) then could
not reach success within 15 turns on the 3 test scenarios with A deficits of 17-19 (A moved too slowly);
reflect became C1 A2 once the topic is open. The beam's default became 128 for this table (32 dropped
the opening question on 4 of 8 test scenarios; 64 on 3). Its yardsticks at these rules: uniform 1.06,
myopic greedy -6.79 (success 0: it collapses on 6 of the 8 test scenarios, times out on 2), search
ceiling 20.51 (= the mean d(P0), success 1.00). The rules were committed before any estimator ran and are
not changed after.

Each estimator at its own step size (--tune; issue 57, protocol committed before it ran)
  The one-lr table (every estimator at --lr 1.0) compares step sizes as much as credit: GRPO, REINFORCE++ and
  MICA divide by a std, RLOO does not, so at one shared lr RLOO takes larger steps; and at lr 1 the delayed
  table's best curves are still rising at step 300. --tune compares each estimator at its own best lr, chosen
  before the reported runs:
  estimators   MICA at each of --alphas (0, 0.4, 1), GRPO, REINFORCE++, RLOO (--estimators); the yardsticks
               (uniform, myopic greedy, search ceiling) have no lr and are printed as in the one-lr table
  lr grid      --lr-grid, fixed in advance: 10^(i/2) for i = -2 .. 4, i.e. 0.1, 0.316, 1, 3.16, 10, 31.6, 100.
               Edge rule, fixed in advance: where an estimator's best lr is the grid's largest (smallest), the
               next half-decade beyond it is run for that estimator on the same tuning seeds, and again, at
               most --extend-edges (2) times a side; a best still at the edge after that is reported as such
  tuning       every (estimator, lr) trained from each of --tune-seeds (1000-1003) with the training defaults
               (300 steps, ...), each scored by its final IDR return on the 24 training scenarios
               (--final-eval-k dialogues each, its own seeded random numbers; no curves): the held-out test
               scenarios are not looked at while tuning
  selection    the lr with the largest mean score over the tuning seeds (choose_lr; ties: the smaller lr)
  reported     each estimator at its chosen lr, trained from each of --fresh-seeds (100-123, disjoint from the
               tuning seeds and from the one-lr table's 0-23), measured on the held-out test scenarios as in
               the one-lr table: mean ± sd [95% t interval] over the fresh seeds, and the paired differences
               of COMPARISONS over the fresh seeds (mean ± sd [t interval], and on how many seeds > 0)
  decides    fixed in advance: turn-level credit "pays where payoff is delayed" only if, on the delayed table,
               MICA alpha 1 - GRPO and MICA alpha 1 - RLOO are above 0 and MICA alpha 0 - MICA alpha 1 below
               0 (paired t intervals over the fresh seeds); RLOO against GRPO is the RLOO - GRPO interval
  Budget: a table is 6 x 7 x 4 tuning + 6 x 24 fresh = 312 runs of 300 steps (and 4 per edge extension);
  docs/results.md has the minutes they took on one core, and the results.
  python experiments/credit.py --tune [--table delayed]      (--quick: 60 steps, tuning seeds 1000-1001,
                                                              fresh seeds 100-102, a look, not a result)

Gradient quality and learning speed on a ladder (--gradient-quality, --speed; issue 62, protocol committed before
it ran; docs/results.md has the ladder, its commands, what was cut and the results)
  gradient quality  at fixed policies chosen before measuring (SNAPSHOT_RUN: the uniform policy, and theta after
               10, 20, 40 steps of GRPO at lr 10 from seed 0 on the rung's settings): the true gradient of the
               expected IDR return over the training scenarios by Monte Carlo (true_gradient: --gq-true 1000
               dialogues a scenario, the score-function form with the true return-to-go; its split-half noise
               printed), then --gq-draws 200 independent training batches (4 scenarios x K), each estimator's
               step direction from the same batch (policy_gradient_direction, pg_update's), and
               quality_measures: cosine to the true gradient (per draw), SNR and the cosine of the block mean
               (bias; per block of 20 draws), each mean ± sd [t interval at the actual df]
  learning speed    --steps 50, the held-out return every 2 steps (8 dialogues per test scenario a point), the
               normalised AUC (uniform 0, search ceiling 1; normalised_auc) and the steps to 0.9 of the
               ceiling (steps_to_frac; never: 52); each estimator's lr chosen on the area under its curve on
               the training scenarios (curve_score; --tune-eval-k 2 dialogues per training scenario a point)
               over the tuning seeds 2000-2002 and the grid 1, 3.16, 10, 31.6, 100, 316 with --tune's edge rule
               (at most 2 half-decades beyond an edge that wins); a power check printed from the tuning seeds
               before the fresh seeds run (power_check); then the fresh seeds 200-223 on the test scenarios,
               paired AUC differences with t intervals at 23 df
  the ladder   one factor at a time from the delayed table (delay 3, K 4, no judge noise, EMPA's ends):
               --judge-noise 0.5, 1, 2 (sds of the per-turn reward at the uniform policy, reward_spread; the
               estimators see the noisy rewards, the state and the held-out return do not), --delay 1, 5, 8,
               --k 8, --early-horizon 8 (each training dialogue times out at a turn drawn from 8-15)
  a fork       --advantage module:function adds an estimator with 04's ADVANTAGES signature to any mode
               (04's imported_estimator; dialogues: the playground's 03 Trajectories, no tokens)
  python experiments/credit.py --table delayed --speed --gradient-quality [--judge-noise X | --delay D | --k 8 |
                               --early-horizon 8] [--advantage module:function] [--quick: a look, not a result]

The stopping rung (--close --turn-cost 1; issue 67 item 2; docs/ladder/protocol-stop.md, committed before any
estimator ran on it)
  rules        the policy gets an eighth move, close, that ends the dialogue as a user leaving would (r_t = 0, P does
               not move, whatever was due later never lands); EMPA's success no longer ends a dialogue (the policy
               decides when to stop), collapse and the horizon still do; every turn of talk costs c (--turn-cost):
               r_t = d(P_{t-1}) - d(P_t) - c, the return d(P_0) - d(P_T) - c x (turns talked). Once d(P) is 0 every
               further turn costs c and gains nothing, so the optimum stops inside the horizon
  measures     --gradient-quality adds the bias table (the cosine of the mean direction with a jackknife interval
               over the blocks; the close share of the mean direction against the true gradient's: RFC #7244's
               hidden bonus on "one more turn" is a share below the truth); --speed adds where the trained policies
               stop against where the search's best stops (search_best), with paired differences
  --protocol-67  the comparisons the new protocol adds (set by --close): every estimator against GRPO and MICA
               (alpha=1), and MICA (alpha=1) - REINFORCE++; the bias table on any rung

CPU (docs/results.md has the minutes each took on one core):  python experiments/credit.py
Quick look (3 seeds, 60 steps):     python experiments/credit.py --quick
The second table:                   python experiments/credit.py --table delayed [--quick]
The survivor question:              python experiments/credit.py --survivors [--table delayed] [--quick]
  MICA's A_turn at turn t compares only the dialogues that reached t: the mean A_turn, A_group and A by how
  (success, failure, timeout) and when dialogues ended, as MICA sees them, with the ended dialogues kept in
  the later comparisons at G = 0, and had every dialogue gone on; at the uniform policy and during MICA's
  training; then every estimator trained with and without early ends (--no-early-end), paired by seed.
"""

import argparse
import copy
import importlib
import json
import math
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import common  # noqa: E402
import plots  # noqa: E402

env = importlib.import_module("03_rollout")  # the EMPA state, IDR, episode rules, scenarios
trainer = importlib.import_module("04_mica_train")  # the advantage estimators
evaluation = importlib.import_module("05_eval")  # the t interval over independent units

AXES = env.AXES  # ("C", "A", "P")
MOVES = ("validate", "clarify", "reflect", "suggest", "affirm", "lecture", "change_subject")
CLOSE = "close"  # --close: the policy's eighth move, it ends the dialogue (the stopping rung, issue 67 item 2)
ALL_MOVES = (*MOVES, CLOSE)  # a move's index in the policy's logits (close is 7, after the seven support moves)


def moves(args) -> tuple:
    """The moves the policy chooses among: the seven support moves, and close with --close."""
    return ALL_MOVES if getattr(args, "close", False) else MOVES


def initial_theta(args) -> list[list[float]]:
    """The uniform policy's logits: N_OBS x (7 moves, or 8 with --close), all 0."""
    return [[0.0] * len(moves(args)) for _ in range(N_OBS)]


# ---------------------------------------------------------------------------------------------
# The playground's judge: a support move -> MDEP-PR levels (progress 0-2, negative 0-2) per axis
# ---------------------------------------------------------------------------------------------
@dataclass
class Memory:
    """What the simulated user remembers of the dialogue, beyond its state P."""

    validated: int = 0  # validations so far
    last: list = field(default_factory=list)  # the moves so far
    debt: dict = field(default_factory=dict)  # negative levels the last move left for this turn
    opened: int | None = None  # --table delayed: the turn whose question opened the hard topic
    due: dict = field(default_factory=dict)  # --table delayed: {turn: negative levels that land then}
    delay: int = 3  # --table delayed: turns from the opening question to its payoff (--delay; DELAY by default)


def remaining(P_a: float, eps: float = 1.0) -> float:
    # the axis' hinge deficit, as in 03's d(P): max(0, -eps - P_a)
    return max(0.0, -eps - P_a)


def feels_understood(P, P0) -> bool:
    """The user feels understood when C and A each have at most half of their initial deficit left."""
    return all(remaining(P[i]) <= 0.5 * remaining(P0[i]) for i in (0, 1))


def judge_move(move: str, mem: Memory, P, P0) -> tuple[dict, dict]:
    """(move, the user's memory, P_{t-1}, P0) -> (levels {axis: (progress, negative)} for this turn,
    negative levels it leaves for the next turn). "A2" is progress level 2 on A (+3), "-C1" negative
    level 1 on C (-2); see 03's PROGRESS_POINTS and NEGATIVE_POINTS.

    move            before the user feels understood       after                 why (the credit it asks for)
    validate        A2 (1st-3rd), A1 (4th-5th), -A1 (6th on: formulaic)           helps now, wears out
    clarify         C2; C1 -A1 when the last two moves were questions too         understanding; an interrogation
    reflect         C1 A1                                  C1 A2                 steady; lands deeper with trust
    suggest         -A1 ("you're not listening")           P2                    pays only once understood
    affirm          A1 now, -C1 next turn (brushed off)    A1 P1                 premature reassurance costs later
    lecture         P1 -C1                                 P1 -C1                information nobody asked for
    change_subject  A1 now, -C1 -A1 next turn              the same              relief now, the problem comes back
    every move      progress on an axis already at or past 0 counts 0 (nothing left to fix there); a debt
                    from the last turn adds its negative levels (the larger level on each axis)."""
    understood = feels_understood(P, P0)
    progress, negative, debt = {a: 0 for a in AXES}, dict.fromkeys(AXES, 0), {}
    if move == "validate":
        if mem.validated < 3:
            progress["A"] = 2
        elif mem.validated < 5:
            progress["A"] = 1
        else:
            negative["A"] = 1
    elif move == "clarify":
        if mem.last[-2:] == ["clarify", "clarify"]:
            progress["C"], negative["A"] = 1, 1
        else:
            progress["C"] = 2
    elif move == "reflect":
        progress["C"], progress["A"] = 1, (2 if understood else 1)
    elif move == "suggest":
        if understood:
            progress["P"] = 2
        else:
            negative["A"] = 1
    elif move == "affirm":
        progress["A"] = 1
        if understood:
            progress["P"] = 1
        else:
            debt = {"C": 1}
    elif move == "lecture":
        progress["P"], negative["C"] = 1, 1
    elif move == "change_subject":
        progress["A"], debt = 1, {"C": 1, "A": 1}
    else:
        raise ValueError(f"unknown move {move!r}; moves: {MOVES}")
    for i, a in enumerate(AXES):
        if P[i] >= 0:
            progress[a] = 0  # nothing left to fix on this axis
        negative[a] = max(negative[a], mem.debt.get(a, 0))  # last turn's move costs now
    return {a: (progress[a], negative[a]) for a in AXES}, debt


def observe(P, P0, mem: Memory) -> int:
    """The policy's coarse view, one of 3 x 2 x 3 x 2 = 36: the axis with the largest remaining deficit,
    whether the user feels understood, validations so far (0-2, 3-4, 5+), the last two moves questions."""
    deficits = [remaining(x) for x in P]
    axis = deficits.index(max(deficits))
    understood = int(feels_understood(P, P0))
    validated = 0 if mem.validated < 3 else 1 if mem.validated < 5 else 2
    asked = int(mem.last[-2:] == ["clarify", "clarify"])
    return ((axis * 2 + understood) * 3 + validated) * 2 + asked


N_OBS = 36


# ---------------------------------------------------------------------------------------------
# The second table (--table delayed): payoffs that only an earlier sacrifice unlocks, penalties that land
# three turns after a tempting move
# ---------------------------------------------------------------------------------------------
DELAY = 3  # turns from the opening question to its payoff, and from a tempting move to its penalty (--delay)


def topic(mem: Memory) -> int:
    """The hard topic at the turn about to be judged: 0 closed (never asked about), 1 opened 1-2 turns ago
    (the user is still taking it in), 2 open (DELAY or more turns since the question that opened it)."""
    if mem.opened is None:
        return 0
    return 1 if len(mem.last) + 1 - mem.opened < mem.delay else 2


def judge_delayed(move: str, mem: Memory, P, P0) -> tuple[dict, dict]:
    """The delayed-payoff table: (move, the user's memory, P_{t-1}, P0) -> (levels {axis: (progress,
    negative)} for this turn, {turns ahead: negative levels} the move leaves for a later turn). Levels as in
    judge_move ("A2" progress level 2 on A, +3; "-A1" negative level 1 on A, -2). The user has a problem
    they avoid: nothing on P moves until a question has opened it, and the question hurts before it pays.

    move            topic closed                  opened 1-2 turns ago    open (3+ turns since)   why
    validate        A2 (1st-3rd), A1 (4th on)     the same                the same                steady, wears down
    clarify         -A1 now, opens the topic      C2                      C2                      the sacrifice
    reflect         C1 A1                         C1 A1                   C1 A2                   deeper once open
    suggest         -A1                           -A1 (not ready)         P2                      pays once open
    affirm          C1 A2 now, -A2 -P1 three turns later, whatever the topic                     hollow reassurance
    lecture         -C1                           -C1                     P1 -C1                  unasked advice
    change_subject  A1 now, -C1 -A1 three turns later, whatever the topic                        the problem returns
    every move      progress on an axis already at or past 0 counts 0; negative levels due this turn (from a
                    move three turns back) add to the move's own (the larger level on each axis; several due
                    on one turn: the larger level on each axis).
    The myopic greedy policy takes affirm (C1 A2, the largest immediate gain) and never asks the question
    (its immediate reward is negative): P never moves and the penalties pile up."""
    state = topic(mem)
    progress, negative, later = {a: 0 for a in AXES}, dict.fromkeys(AXES, 0), {}
    if move == "validate":
        progress["A"] = 2 if mem.validated < 3 else 1
    elif move == "clarify":
        if state == 0:
            negative["A"] = 1
        else:
            progress["C"] = 2
    elif move == "reflect":
        progress["C"], progress["A"] = 1, (2 if state == 2 else 1)
    elif move == "suggest":
        if state == 2:
            progress["P"] = 2
        else:
            negative["A"] = 1
    elif move == "affirm":
        progress["C"], progress["A"], later = 1, 2, {mem.delay: {"A": 2, "P": 1}}
    elif move == "lecture":
        negative["C"] = 1
        if state == 2:
            progress["P"] = 1
    elif move == "change_subject":
        progress["A"], later = 1, {mem.delay: {"C": 1, "A": 1}}
    else:
        raise ValueError(f"unknown move {move!r}; moves: {MOVES}")
    due = mem.due.get(len(mem.last) + 1, {})
    for i, a in enumerate(AXES):
        if P[i] >= 0:
            progress[a] = 0  # nothing left to fix on this axis
        negative[a] = max(negative[a], due.get(a, 0))  # a move DELAY turns back costs now
    return {a: (progress[a], negative[a]) for a in AXES}, later


def observe_delayed(P, P0, mem: Memory) -> int:
    """The policy's coarse view under the delayed table, one of 3 x 3 x 2 x 2 = 36: the axis with the largest
    remaining deficit, the topic (closed, opened 1-2 turns ago, open), validations so far (0-2, 3+), whether
    a penalty is still to land."""
    deficits = [remaining(x) for x in P]
    axis = deficits.index(max(deficits))
    validated = int(mem.validated >= 3)
    pending = int(any(turn > len(mem.last) for turn in mem.due))
    return ((axis * 3 + topic(mem)) * 2 + validated) * 2 + pending


# --table NAME -> (the judge, the policy's observation); both observations take one of N_OBS values
TABLES = {"short": (judge_move, observe), "delayed": (judge_delayed, observe_delayed)}


# ---------------------------------------------------------------------------------------------
# One dialogue on 03's dynamics
# ---------------------------------------------------------------------------------------------
def new_episode(scenario: dict, delay: int = DELAY):
    tr = env.Trajectory(scenario=scenario, k=0, ids=[], messages=[], states=[list(scenario["p0"])], emotions=[30.0])
    tr.extra["moves"], tr.extra["obs"] = [], []
    return tr, Memory(delay=delay)


def step(
    tr, mem: Memory, move: str, args, o: int | None = None, early_end: bool = True, horizon: int | None = None
) -> None:
    """Turn t: the move is judged, 03's advance_state moves P (P_t = P_{t-1} + levels_to_v(levels),
    dE_t = v_t . v*), 03's episode_status ends it (success, failure), or the horizon does (timeout).
    o: the observation the move was chosen on (computed here when not given). early_end False: EMPA's
    rules end nothing before --max-turns; the first turn and outcome they would have ended it with are
    kept in tr.extra["end"] (the survivor analysis). horizon: a timeout at this turn instead of --max-turns
    (--early-horizon's length rule).
    --close (the stopping rung): the move "close" ends the dialogue at this turn, outcome "closed", as a user
    leaving would: the judge is not asked, P does not move (v_t = 0, so r_t = 0 and dE_t = 0), and what was due on
    this turn or later never lands; and EMPA's success no longer ends a dialogue (the user does not leave because
    she feels better: the policy decides when to stop; the turn EMPA would have ended it at stays in
    tr.extra["end"]); EMPA's failure (collapse) and the horizon still end it."""
    judge, look = TABLES[args.table]
    tr.extra["obs"].append(look(tr.states[-1], tr.scenario["p0"], mem) if o is None else o)
    if move == CLOSE:
        env.advance_state(tr, {"levels": {a: (0, 0) for a in AXES}, "features": {"move": move}})
        mem.last.append(move)
        tr.extra["moves"].append(move)
        tr.outcome = "closed"
        return
    levels, later = judge(move, mem, tr.states[-1], tr.scenario["p0"])
    env.advance_state(tr, {"levels": levels, "features": {"move": move}})
    t = len(tr.states) - 1
    mem.validated += move == "validate"
    mem.last.append(move)
    if args.table == "short":
        mem.debt = later  # judge_move's debt lands on the next turn
    else:
        if move == "clarify" and mem.opened is None:
            mem.opened = t
        for ahead, negative in later.items():  # judge_delayed's penalties land `ahead` turns from now
            slot = mem.due.setdefault(t + ahead, {})
            for a, level in negative.items():
                slot[a] = max(slot.get(a, 0), level)
    tr.extra["moves"].append(move)
    tr.outcome = env.episode_status(tr.scenario["p0"], tr.dEs, tr.states, t, args)
    if tr.outcome is not None and "end" not in tr.extra:
        tr.extra["end"] = (t, tr.outcome)
    if not early_end or (tr.outcome == "success" and getattr(args, "close", False)):
        tr.outcome = None
    if tr.outcome is None and t == (horizon or args.max_turns):
        tr.outcome = "timeout"


def policy(theta, o: int) -> list[float]:
    # pi(a | o) = exp(theta[o][a] - max) / sum_b exp(theta[o][b] - max)
    m = max(theta[o])
    e = [math.exp(x - m) for x in theta[o]]
    z = sum(e)
    return [x / z for x in e]


def rollout(theta, scenario: dict, rng: random.Random, args, early_end: bool = True, horizon: int | None = None):
    """One dialogue sampled from pi; returns the Trajectory with its IDR rewards in extra["rewards"].
    early_end False: it runs to --max-turns whatever EMPA's rules say (see step). horizon: a timeout at this
    turn (--early-horizon)."""
    tr, mem = new_episode(scenario, getattr(args, "delay", DELAY))
    while tr.outcome is None:
        o = TABLES[args.table][1](tr.states[-1], scenario["p0"], mem)
        # a ~ pi(. | o): the first move whose cumulative probability passes u ~ U(0, 1)
        u, a, cum = rng.random(), 0, 0.0
        for a, p_a in enumerate(policy(theta, o)):
            cum += p_a
            if u < cum:
                break
        step(tr, mem, ALL_MOVES[a], args, o, early_end, horizon)
    tr.extra["rewards"] = turn_rewards(tr, args)
    return tr


def turn_rewards(tr, args) -> list[float]:
    """The per-turn rewards: 03's IDR, r_t = d(P_{t-1}) - d(P_t); with --turn-cost c, minus c on every turn of talk
    (every move but close): r_t = d(P_{t-1}) - d(P_t) - c [a_t != close]. The return is then
    d(P_0) - d(P_T) - c x (the turns talked)."""
    r = env.incremental_distance_rewards(tr.states)
    c = getattr(args, "turn_cost", 0.0)
    if not c:
        return r
    return [r_t - (c if move != CLOSE else 0.0) for r_t, move in zip(r, tr.extra["moves"])]


def talked(tr) -> int:
    """The turns of talk in a dialogue: its moves but close (a dialogue closed at turn t talked t - 1 turns)."""
    return sum(move != CLOSE for move in tr.extra["moves"])


# ---------------------------------------------------------------------------------------------
# The main loop: train one estimator from one seed (rollouts, 04's advantages, a policy-gradient step)
# ---------------------------------------------------------------------------------------------
def rloo_advantages(rewards) -> list:
    """RLOO (REINFORCE leave-one-out), the estimator the course's fork adds to 04 (docs/training.md, "Adding an
    estimator or a reward"): each dialogue's outcome against the mean outcome of its scenario's other K - 1
    dialogues, the same on every turn and not divided by a std. It is not in 04's ADVANTAGES; this is the
    playground's own, with the fork's numbers: rewards [[[1, 0], [0]]] -> A [[[1, 1], [-1]]]."""
    A = []
    for group in rewards:
        # R_k = sum_t r[k][t];  b_k = (1 / (K - 1)) sum_{j != k} R_j;  A[k][t] = R_k - b_k on every turn
        R = [sum(r) for r in group]
        K = len(R)
        A_group = []
        for k in range(K):
            b_k = sum(R[j] for j in range(K) if j != k) / (K - 1)
            A_group.append([R[k] - b_k] * len(group[k]))
        A.append(A_group)
    return A


def advantages(estimator: dict, batch_rewards, gamma, dialogues=None) -> list:
    """batch_rewards[s][k][t] -> A[s][k][t] with 04's own estimator, by its name in 04's ADVANTAGES (RLOO, not
    one of them: the playground's rloo_advantages), or a fork's (--advantage module:function, kind "import":
    04's imported_estimator finds it). Every estimator is called as 04 calls it, fn(rewards, dialogues, args)
    -> (A, terms), with args holding alpha and gamma only; dialogues[s][k]: the playground's 03 Trajectories
    (states P_0..P_T, levels, dE_t, scenario, extra["moves"] and ["obs"]; no tokens), None where the caller
    has none. The rewards are those the estimators see (with --judge-noise, the noisy ones)."""
    if estimator["kind"] == "rloo":
        return rloo_advantages(batch_rewards)
    # idr_weights: 03's defaults, which a fork's estimator that scores states reads (field_estimators' turn_credit)
    args = argparse.Namespace(alpha=estimator.get("alpha"), gamma=gamma, idr_weights=(1.0, 1.0, 1.0))
    if estimator["kind"] == "import":
        return trainer.imported_estimator(estimator["spec"])(batch_rewards, dialogues, args)[0]
    return trainer.ADVANTAGES[estimator["kind"]](batch_rewards, dialogues, args)[0]


def pg_update(theta, groups, advs, lr: float) -> None:
    """theta += lr * policy_gradient_direction(theta, groups, advs)."""
    grad = policy_gradient_direction(theta, groups, advs)
    for o in range(N_OBS):
        for b in range(len(theta[o])):
            theta[o][b] += lr * grad[o][b]


def policy_gradient_direction(theta, groups, advs) -> list[list[float]]:
    """g[o][b] = (1/N) sum_{k,t: o_t = o} A[k][t] (1[a_t = b] - pi(b | o_t)), N the turns in the batch: the
    direction pg_update steps along (the gradient of log softmax, averaged over turns as 04's loss averages
    over tokens)."""
    N = sum(len(tr.extra["moves"]) for group in groups for tr in group)
    grad = [[0.0] * len(theta[0]) for _ in range(N_OBS)]
    for group, group_adv in zip(groups, advs):
        for tr, A in zip(group, group_adv):
            for t, (o, move) in enumerate(zip(tr.extra["obs"], tr.extra["moves"])):
                pi = policy(theta, o)
                a = ALL_MOVES.index(move)
                for b in range(len(pi)):
                    # d log pi(a | o) / d theta[o][b] = 1[a = b] - pi(b | o)
                    grad[o][b] += A[t] * ((a == b) - pi[b])
    return [[x / N for x in row] for row in grad]


def noisy_rewards(rewards, sigma: float, rng: random.Random) -> list:
    """The per-turn rewards a noisy judge reports: r~[s][k][t] = r[s][k][t] + sigma z, z ~ N(0, 1) drawn from
    rng, one per turn (--judge-noise; sigma in reward units). The state P moves by the table as before: the
    noise is in what the learner is told, not in what happened. sigma 0: the rewards, rng untouched."""
    if sigma == 0:
        return rewards
    return [[[r_t + sigma * rng.gauss(0.0, 1.0) for r_t in r] for r in group] for group in rewards]


def training_batch(theta, train_set: list[dict], rng: random.Random, side: random.Random, args):
    """One step's rollouts, K for each of --scenarios-per-step training scenarios drawn by rng, and the rewards
    the estimators see. side: the length rule's and the judge noise's random numbers, kept apart from rng, so
    that with neither set the rollouts are those of every earlier version of this file. --early-horizon L:
    each training dialogue times out at a turn drawn uniformly from L .. --max-turns (EMPA's ends still apply)."""
    groups = []
    for s in rng.sample(train_set, args.scenarios_per_step):
        group = []
        for _ in range(args.k):
            horizon = side.randint(args.early_horizon, args.max_turns) if args.early_horizon else None
            group.append(rollout(theta, s, rng, args, not args.no_early_end, horizon))
        groups.append(group)
    rewards = noisy_rewards([[tr.extra["rewards"] for tr in g] for g in groups], args.noise_sd, side)
    return groups, rewards


def evaluate(theta, test: list[dict], rng: random.Random, args) -> dict:
    trajs = [rollout(theta, s, rng, args) for s in test for _ in range(args.eval_k)]
    out = {
        "return": sum(sum(tr.extra["rewards"]) for tr in trajs) / len(trajs),
        "success": sum(succeeded(tr, args) for tr in trajs) / len(trajs),
    }
    if getattr(args, "close", False):  # where the policy stops: the turns talked, and the share it closed itself
        out["turns"] = sum(talked(tr) for tr in trajs) / len(trajs)
        out["closed"] = sum(tr.outcome == "closed" for tr in trajs) / len(trajs)
    return out


def train(
    estimator: dict,
    seed: int,
    train_set: list[dict],
    test: list[dict],
    args,
    watch=None,
    curves: bool = True,
    snapshots: dict | None = None,
) -> dict:
    """Same seed, same first batch, same evaluation dialogues' random numbers for every estimator.
    The step size: estimator["lr"] where it has one (--tune), else --lr. test: the scenarios the curves and
    the final return are measured on (--tune's tuning runs pass the training scenarios, curves False: only
    the final return). args.no_early_end: the training dialogues run to --max-turns (the held-out ones keep
    EMPA's ends). watch(groups): called with each step's rollouts (the survivor analysis looks at their credit).
    snapshots {step: None}: filled with a copy of theta before that step's update (--gradient-quality)."""
    lr = estimator.get("lr", args.lr)
    rng = random.Random(seed)
    side = random.Random(1_000_033 * seed + 17)  # the length rule's and the judge noise's random numbers
    theta = initial_theta(args)  # the uniform policy
    curve = []
    for step_i in range(args.steps + 1):
        # 1. evaluate on the held-out scenarios every --eval-every steps (its own seeded random numbers)
        if curves and (step_i % args.eval_every == 0 or step_i == args.steps):
            curve.append(evaluate(theta, test, random.Random(1_000_003 * seed + step_i), args)["return"])
        if snapshots is not None and step_i in snapshots:
            snapshots[step_i] = copy.deepcopy(theta)
        if step_i == args.steps:
            break
        # 2. K rollouts for each of --scenarios-per-step training scenarios (and the rewards the judge reports)
        groups, rewards = training_batch(theta, train_set, rng, side, args)
        if watch is not None:
            watch(groups)
        # 3. per-turn IDR rewards -> the estimator's advantages (04's functions)
        advs = advantages(estimator, rewards, args.gamma, groups)
        # 4. one plain policy-gradient step on the logits
        pg_update(theta, groups, advs, lr)
    final = evaluate(
        theta, test, random.Random(7_919 * seed + 1), argparse.Namespace(**{**vars(args), "eval_k": args.final_eval_k})
    )
    row = {
        "estimator": estimator["name"],
        "seed": seed,
        "lr": lr,
        "curve": curve,
        "steps_done": args.steps,
        "final_return": final["return"],
        "final_success": final["success"],
    }
    if "turns" in final:  # --close: where the trained policy stops on the scored-on scenarios
        row["final_turns"], row["final_closed"] = final["turns"], final["closed"]
    return row


# ---------------------------------------------------------------------------------------------
# The survivor question (--survivors): MICA's A_turn at turn t compares only the dialogues that reached t
# ---------------------------------------------------------------------------------------------
CELLS = ("dialogues", "turns", "A_turn", "A_group", "A", "lone")


def credit_by(rewards, labels, alpha: float, gamma: float, upto=None, into=None) -> dict:
    """rewards[s][k][t] (a batch as MICA sees it), labels[s][k] (the outcome, the length, ...) -> {label:
    sums}: dialogues, turns, and over those turns the sums of 04's A_turn, A_group and A = alpha A_turn +
    (1 - alpha) A_group, and "lone", the turns no other dialogue of the group reached (A_turn is 0 there).
    upto[s][k]: count only dialogue k's first upto[s][k] turns. into: add to these sums."""
    A, terms = trainer.ADVANTAGES["mica"](rewards, None, argparse.Namespace(alpha=alpha, gamma=gamma))
    out = {} if into is None else into
    for s, group in enumerate(rewards):
        for k, r in enumerate(group):
            n = len(r) if upto is None else upto[s][k]
            c = out.setdefault(labels[s][k], dict.fromkeys(CELLS, 0.0))
            c["dialogues"] += 1
            c["turns"] += n
            c["A_turn"] += sum(terms["A_turn"][s][k][:n])
            c["A_group"] += sum(terms["A_group"][s][k][:n])
            c["A"] += sum(A[s][k][:n])
            c["lone"] += sum(sum(len(other) > t for other in group) == 1 for t in range(n))
    return out


def length_bin(n: int, args) -> str:
    """Turns reached -> one of four bins: thirds of [--min-turns, --max-turns - 1], and --max-turns itself."""
    if n >= args.max_turns:
        return f"{args.max_turns}"
    lo, span = args.min_turns, max(1, args.max_turns - args.min_turns)
    edges = [lo + round(i * span / 3) for i in range(4)]  # 4, 8, 11, 15 at the defaults: 4-7, 8-10, 11-14
    for a, b in zip(edges, edges[1:]):
        if n < b:
            return f"{a}-{b - 1}" if b - 1 > a else f"{a}"
    return f"{edges[-2]}-{args.max_turns - 1}"


def ended(tr, args) -> tuple[int, str]:
    """(the turn EMPA's rules ended the dialogue at, or would have, and how: success, failure, timeout)."""
    return tr.extra.get("end", (args.max_turns, "timeout"))


def survivor_batch(groups, args, into: dict) -> None:
    """One batch of dialogues run to --max-turns (early_end False) -> into[view][label] sums (credit_by) for
    the three views of the same turns (each dialogue's turns up to its end):
      ends     as MICA sees them: each dialogue cut at its end, A_turn at t over those that reached t
      kept     cut at its end, but kept in the comparison at every later turn with G = 0 (rewards 0 after
               the end): the comparison over all K, the survivor question's counterfactual
      on       had every dialogue gone on to --max-turns (the same turns, the comparisons over all K, the
               returns including what came after the end)
    labels: "outcome" (success / failure / timeout) and "length" (turns reached)."""
    full = [[tr.extra["rewards"] for tr in g] for g in groups]
    upto = [[ended(tr, args)[0] for tr in g] for g in groups]
    cut = [[r[:n] for r, n in zip(g, ns)] for g, ns in zip(full, upto)]
    kept = [[r + [0.0] * (args.max_turns - len(r)) for r in g] for g in cut]
    for key, labels in (
        ("outcome", [[ended(tr, args)[1] for tr in g] for g in groups]),
        ("length", [[length_bin(n, args) for n in ns] for ns in upto]),
    ):
        for view, rewards in (("ends", cut), ("kept", kept), ("on", full)):
            credit_by(rewards, labels, args.survivor_alpha, args.gamma, upto, into.setdefault((key, view), {}))


def survivors(train_set: list[dict], test: list[dict], args) -> str:
    """The survivor analysis: (1) at the uniform policy, --survivor-groups groups of K per seed; (2) during
    MICA's training (alpha --survivor-alpha); (3) learning with and without early ends. Every figure is a
    mean over seeds, with the t interval over seeds."""
    uniform_theta = initial_theta(args)
    at_rest, learning = [], []  # per seed: {(key, view): {label: sums}}
    for seed in range(args.seeds):
        rng, sums = random.Random(seed), {}
        for _ in range(args.survivor_groups):
            s = rng.choice(train_set)
            survivor_batch([[rollout(uniform_theta, s, rng, args, early_end=False) for _ in range(args.k)]], args, sums)
        at_rest.append(sums)
    # (2) during learning: MICA's own training batches (they end early as usual; "on" is not observable)
    mica = {"name": f"MICA (alpha={args.survivor_alpha:g})", "kind": "mica", "alpha": args.survivor_alpha}
    for seed in range(args.seeds):
        sums = {}

        def watch(groups, _sums=sums):
            upto = [[ended(tr, args)[0] for tr in g] for g in groups]
            labels = {
                "outcome": [[ended(tr, args)[1] for tr in g] for g in groups],
                "length": [[length_bin(n, args) for n in ns] for ns in upto],
            }
            rewards = [[tr.extra["rewards"] for tr in g] for g in groups]
            kept = [[r + [0.0] * (args.max_turns - len(r)) for r in g] for g in rewards]
            for key in labels:
                for view, rs in (("ends", rewards), ("kept", kept)):
                    credit_by(rs, labels[key], args.survivor_alpha, args.gamma, upto, _sums.setdefault((key, view), {}))

        train(mica, seed, train_set, test, args, watch)
        learning.append(sums)
    lines = [
        f"## The survivor question (table {args.table}; {args.seeds} seeds; MICA's A at alpha {args.survivor_alpha:g}, "
        f"gamma {args.gamma})",
        "",
    ]
    for title, per_seed, views in (
        (
            f"At the uniform policy ({args.survivor_groups} groups of K={args.k} per seed, train scenarios)",
            at_rest,
            ("ends", "kept", "on"),
        ),
        (
            f"During MICA's training (alpha {args.survivor_alpha:g}, every training batch of {args.steps} steps)",
            learning,
            ("ends", "kept"),
        ),
    ):
        lines += [f"### {title}", ""]
        lines += survivor_table(per_seed, "outcome", views, args)
        lines += survivor_table(per_seed, "length", views, args)
    # (3) learning with and without early ends (the training dialogues only; the held-out ones keep EMPA's ends)
    estimators = estimator_list(args)
    no_end = argparse.Namespace(**{**vars(args), "no_early_end": True})
    final = {}
    for seed in range(args.seeds):
        for e in estimators:
            for variant, a in (("ends", args), ("no ends", no_end)):
                final[(e["name"], variant, seed)] = train(e, seed, train_set, test, a)["final_return"]
    seeds = range(args.seeds)
    base = estimators[0]["name"]
    lines += [
        f"### Learning with and without early ends ({args.steps} steps; held-out return under EMPA's ends)",
        "",
        f"| estimator | trained with EMPA's ends | trained without early ends | without - with (paired) | "
        f"that change - {base}'s change (paired) |",
        "|---|---|---|---|---|",
    ]
    for e in estimators:
        n = e["name"]
        change = [final[(n, "no ends", s)] - final[(n, "ends", s)] for s in seeds]
        base_change = [final[(base, "no ends", s)] - final[(base, "ends", s)] for s in seeds]
        lines.append(
            f"| {n} | {ci_cell([final[(n, 'ends', s)] for s in seeds])} | "
            f"{ci_cell([final[(n, 'no ends', s)] for s in seeds])} | {ci_cell(change)} | "
            f"{'—' if n == base else ci_cell([c - b for c, b in zip(change, base_change)])} |"
        )
    lines += [
        "",
        f"mean ± sd [95% CI: t_{{0.975, n-1}} sd / sqrt(n)] over {args.seeds} seeds (0-{args.seeds - 1}); "
        f"{args.max_turns} turns (min {args.min_turns}, collapse window {args.collapse_window}). Views: ends = as "
        "MICA sees them (each dialogue cut at its end, A_turn at t over the dialogues that reached t); kept = "
        "cut at its end but kept in every later turn's comparison with G = 0; on = had every dialogue gone on "
        "to --max-turns. Per-turn cells: the mean over a label's turns (up to each dialogue's end); per "
        "dialogue: the sum over its turns; lone: the share of its turns no other dialogue reached (A_turn = 0).",
        "",
    ]
    return "\n".join(lines)


def survivor_table(per_seed: list[dict], key: str, views, args) -> list[str]:
    """Rows by label (outcome or length): the share of dialogues, the mean length, and per view the mean
    A_turn per turn and per dialogue; then A_group and A per turn as MICA sees them, and the lone share."""
    labels = {lab for sums in per_seed for lab in sums[(key, "ends")]} - {"all"}
    if key == "outcome":
        labels = [lab for lab in ("success", "failure", "timeout") if lab in labels]
    else:
        labels = sorted(labels, key=lambda b: int(b.split("-")[0]))
    for sums in per_seed:  # every dialogue together: A_turn's sum over them is 0 by construction
        for v in views:
            cells = sums[(key, v)].values()
            sums[(key, v)]["all"] = {c: sum(x[c] for x in cells if x is not None) for c in CELLS}
    head = [key, "seeds", "share of dialogues", "turns"]
    head += [f"A_turn per turn ({v})" for v in views] + [f"A_turn per dialogue ({v})" for v in views]
    head += ["A_group per turn", "A per turn", "lone turns"]
    lines = [f"By {key}:", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for lab in [*labels, "all"]:
        have = [sums for sums in per_seed if lab in sums[(key, "ends")]]
        ends = [sums[(key, "ends")][lab] for sums in have]
        total = [sums[(key, "ends")]["all"]["dialogues"] for sums in have]
        cells = [
            str(lab),
            str(len(have)),
            ci_cell([c["dialogues"] / n for c, n in zip(ends, total)], 4),
            ci_cell([c["turns"] / c["dialogues"] for c in ends], 1),
        ]
        for per in ("turns", "dialogues"):
            for v in views:
                cs = [sums[(key, v)][lab] for sums in have]
                cells.append(ci_cell([c["A_turn"] / max(c[per], 1) for c in cs]))
        cells.append(ci_cell([c["A_group"] / max(c["turns"], 1) for c in ends]))
        cells.append(ci_cell([c["A"] / max(c["turns"], 1) for c in ends]))
        cells.append(ci_cell([c["lone"] / max(c["turns"], 1) for c in ends], 4))
        lines.append("| " + " | ".join(cells) + " |")
    return lines + [""]


# ---------------------------------------------------------------------------------------------
# Gradient quality at fixed policies (--gradient-quality; issue 62, point 1): each estimator's step direction
# from one batch against the true policy gradient, no step size involved
# ---------------------------------------------------------------------------------------------
# the policies it is measured at, fixed before anything was measured: the uniform one, and snapshots of one
# training run on the rung's own settings: GRPO at lr 10 from seed 0, theta before steps 0 (uniform), 10, 20, 40
SNAPSHOT_RUN = {"name": "GRPO", "kind": "grpo", "lr": 10.0, "seed": 0, "steps": (0, 10, 20, 40)}


def score_function_gradient(dialogues, theta) -> list[list[float]]:
    """grad J(theta) estimated from M dialogues sampled from pi_theta (the score-function form with the true,
    undiscounted return-to-go; the states and rewards are the table's, never the noisy judge's):
      J(theta) = E_tau [ sum_t r_t ]
      grad J ~= (1/M) sum_i sum_t G_t^i (onehot(a_t^i) - pi(. | o_t^i)),   G_t^i = sum_{j >= t} r_j^i
    The dialogues' scenarios are drawn as the expectation weighs them (here: the same number of dialogues for
    every training scenario, so J averages the scenarios equally)."""
    g = [[0.0] * len(theta[0]) for _ in range(N_OBS)]
    for tr in dialogues:
        r = tr.extra["rewards"]
        for t, (o, move) in enumerate(zip(tr.extra["obs"], tr.extra["moves"])):
            G_t = sum(r[t:])  # the return-to-go: what came after the move, not before it
            pi = policy(theta, o)
            a = ALL_MOVES.index(move)
            for b in range(len(pi)):
                g[o][b] += G_t * ((a == b) - pi[b])
    M = len(dialogues)
    return [[x / M for x in row] for row in g]


def flat(g) -> list[float]:
    return [x for row in g for x in row]


def dot(u, v) -> float:
    return sum(a * b for a, b in zip(u, v))


def cosine(u, v) -> float:
    # cos(u, v) = u . v / (||u|| ||v||); 0 where either is 0
    nu, nv = math.sqrt(dot(u, u)), math.sqrt(dot(v, v))
    return dot(u, v) / (nu * nv) if nu > 0 and nv > 0 else 0.0


def true_gradient(theta, train_set: list[dict], rng: random.Random, args) -> tuple[list[float], float]:
    """grad J at theta by Monte Carlo: --gq-true dialogues from pi_theta on each training scenario (the rung's
    length rule applies: it is part of what is being optimised), score_function_gradient over all of them.
    -> (the gradient, flattened; its split-half noise ||g_1 - g_2|| / ||g_1 + g_2||, g_1 and g_2 the estimates
    from the even and odd dialogues of each scenario: about the relative error of the full estimate)."""
    halves = ([], [])
    for s in train_set:
        for i in range(args.gq_true):
            horizon = rng.randint(args.early_horizon, args.max_turns) if args.early_horizon else None
            halves[i % 2].append(rollout(theta, s, rng, args, not args.no_early_end, horizon))
    g1, g2 = (flat(score_function_gradient(h, theta)) for h in halves)
    full = [(a + b) / 2 for a, b in zip(g1, g2)]
    diff, total = [a - b for a, b in zip(g1, g2)], [a + b for a, b in zip(g1, g2)]
    return full, math.sqrt(dot(diff, diff) / dot(total, total))


def quality_measures(draws: list[list[float]], g_true: list[float], blocks: int) -> dict:
    """One estimator's D direction estimates g_i (one training batch each, independent) against the true gradient
    g*, u = g* / ||g*||. -> {measure: (per-unit values, the unit)}:
      cosine   cos(g_i, g*) per draw (unit: the draw, D of them)
      snr      per block b of n = D / blocks draws: SNR_b = (||gbar_b||^2 - tr S_b / n) / tr S_b, gbar_b the block's
               mean, tr S_b = (1/(n-1)) sum_i ||g_i - gbar_b||^2: the squared length of the mean estimate (made
               unbiased) over the total variance of one draw, E||E g||^2 / E||g - E g||^2 (unit: the block)
      bias     per block: cos(gbar_b, g*), the cosine of the mean of n estimates with the true gradient; an
               estimator whose expectation points along g* gives 1 as n grows, so what stays below 1 is bias
               in direction (at n = 20 part of the shortfall is still noise; the cosine of the mean of all D
               draws is printed beside it) (unit: the block)"""
    D = len(draws)
    n = D // blocks
    out = {"cosine": [cosine(g, g_true) for g in draws], "snr": [], "bias": []}
    for b in range(blocks):
        block = draws[b * n : (b + 1) * n]
        mean = [sum(col) / n for col in zip(*block)]
        trS = sum(dot([x - m for x, m in zip(g, mean)], [x - m for x, m in zip(g, mean)]) for g in block) / (n - 1)
        out["snr"].append((dot(mean, mean) - trS / n) / trS if trS > 0 else 0.0)
        out["bias"].append(cosine(mean, g_true))
    mean_all = [sum(col) / D for col in zip(*draws)]
    out["bias_all"] = cosine(mean_all, g_true)
    return out


def gradient_quality(estimators: list[dict], train_set: list[dict], test: list[dict], args) -> tuple[str, list]:
    """At each policy of SNAPSHOT_RUN: the true gradient (true_gradient), then --gq-draws independent training
    batches (training_batch: --scenarios-per-step scenarios x K dialogues, the rung's noise and length rule),
    each estimator's direction (policy_gradient_direction, the one pg_update steps along) from the same batch
    (paired), and quality_measures. -> (the markdown table, one row per (policy, estimator) for the jsonl)."""
    snap = dict.fromkeys(SNAPSHOT_RUN["steps"])
    run_args = argparse.Namespace(**{**vars(args), "steps": max(SNAPSHOT_RUN["steps"])})
    train(SNAPSHOT_RUN, SNAPSHOT_RUN["seed"], train_set, test, run_args, curves=False, snapshots=snap)
    lines = [
        "| policy | estimator | cosine to the true gradient (per draw) | SNR (per block) | cosine of the block "
        "mean (bias) | cosine of the mean of all draws |",
        "|---|---|---|---|---|---|",
    ]
    rows, notes, bias_lines = [], [], []
    for step_i, theta in snap.items():
        g_true, noise = true_gradient(theta, train_set, random.Random(4_242 + step_i), args)
        notes.append(f"step {step_i}: ||g*|| {math.sqrt(dot(g_true, g_true)):.3f}, split-half noise {noise:.3f}")
        rng, side = random.Random(777 + step_i), random.Random(778 + step_i)
        draws = {e["name"]: [] for e in estimators}
        for _ in range(args.gq_draws):
            groups, rewards = training_batch(theta, train_set, rng, side, args)
            for e in estimators:
                A = advantages(e, rewards, args.gamma, groups)
                draws[e["name"]].append(flat(policy_gradient_direction(theta, groups, A)))
        label = "uniform" if step_i == 0 else f"{SNAPSHOT_RUN['name']} lr {SNAPSHOT_RUN['lr']:g}, step {step_i}"
        for e in estimators:
            m = quality_measures(draws[e["name"]], g_true, args.gq_blocks)
            lines.append(
                f"| {label} | {e['name']} | {t_cell(m['cosine'], 3)} | {t_cell(m['snr'], 3)} | "
                f"{t_cell(m['bias'], 3)} | {m['bias_all']:.3f} |"
            )
            rows.append(
                {"policy_step": step_i, "estimator": e["name"], **m, "true_norm": math.sqrt(dot(g_true, g_true))}
            )
            if args.protocol_67:  # the bias table (docs/ladder/protocol-stop.md)
                jk = jackknife_measures(draws[e["name"]], g_true, args.gq_blocks, len(theta[0]) if args.close else None)
                rows[-1].update(jk)
                cells = [f"{jk['bias_all']:.3f}", t_cell(jk["bias_all_jk"], 3)]
                if args.close:
                    cells += [f"{jk['close_true']:+.3f}", f"{jk['close_all']:+.3f}", t_cell(jk["close_gap_jk"], 3)]
                bias_lines.append(f"| {label} | {e['name']} | " + " | ".join(cells) + " |")
    n = args.gq_draws // args.gq_blocks
    note = (
        f"\nmean ± sd [95% t interval, t_{{0.975, units-1}} exact] over the independent units: {args.gq_draws} draws "
        f"(cosine) or {args.gq_blocks} blocks of {n} draws (SNR, bias); a draw is one training batch of "
        f"{args.scenarios_per_step} training scenarios x K={args.k} dialogues; every estimator sees the same draws. "
        f"True gradient: {args.gq_true} dialogues per training scenario ({args.gq_true * len(train_set)} in all), "
        f"the score-function estimate with the true return-to-go; its norm and split-half noise "
        f"(||g1 - g2|| / ||g1 + g2||): {'; '.join(notes)}. Policies: uniform, and {SNAPSHOT_RUN['name']} at lr "
        f"{SNAPSHOT_RUN['lr']:g} from seed {SNAPSHOT_RUN['seed']} after "
        f"{', '.join(map(str, SNAPSHOT_RUN['steps'][1:]))} steps on this rung's settings.\n"
    )
    if bias_lines:
        note += "\n" + bias_table(bias_lines, args)
    return "\n".join(lines) + "\n" + note, rows


def close_share(g: list[float], n_moves: int) -> float:
    """How much of a direction pushes toward closing: sum_o g[o][close] / ||g|| (close the last of each row of
    n_moves logits; 0 for a zero vector). Each row of a softmax's score sums to 0, so g[o][close] > 0 moves
    probability to close at o from the other moves; the sum over the observations, over the length, is that push
    in the unit direction: scale-free, like the cosines."""
    norm = math.sqrt(dot(g, g))
    return sum(g[o * n_moves + n_moves - 1] for o in range(N_OBS)) / norm if norm > 0 else 0.0


def jackknife_measures(draws: list[list[float]], g_true: list[float], blocks: int, n_moves: int | None = None) -> dict:
    """The bias of one estimator's mean direction, with an interval: the delete-one-block jackknife over the
    blocks of draws (the block the unit, blocks - 1 df). For a statistic theta of the mean of the draws,
    theta_all = theta(mean of all D draws), theta_-b = theta(mean of the draws outside block b), and the
    pseudo-values p_b = B theta_all - (B - 1) theta_-b, whose mean is the jackknife's (bias-corrected) estimate
    and whose sd / sqrt(B) its standard error; the interval is t_cell's over the B pseudo-values.
      bias_all      cos(mean of all draws, g*) (the gradient-quality table's last column); bias_all_jk its
                    pseudo-values
    With n_moves (--close, close the last logit of each observation's row):
      close_true    close_share(g*): how much the true gradient pushes toward closing
      close_all     close_share(mean of all draws); close_gap_jk: the pseudo-values of close_share(mean) -
                    close_share(g*) (below 0: the estimator pushes toward one more turn more than the true
                    gradient does, RFC #7244's hidden bonus; above 0: a tax). g* is held fixed: its own noise is
                    the split-half noise printed under the table."""
    D, B = len(draws), blocks
    n = D // B
    used = draws[: n * B]
    total = [sum(col) for col in zip(*used)]

    def mean_without(b):
        block = used[b * n : (b + 1) * n]
        return [(t - sum(col)) / (n * (B - 1)) for t, col in zip(total, zip(*block))]

    mean_all = [t / (n * B) for t in total]
    stats = {"bias_all": lambda g: cosine(g, g_true)}
    if n_moves:
        true_share = close_share(g_true, n_moves)

        def close_gap(g):
            return close_share(g, n_moves) - true_share

        stats["close_gap"] = close_gap
    out = {}
    rest = [mean_without(b) for b in range(B)]
    for name, f in stats.items():
        whole = f(mean_all)
        out[f"{name}_jk"] = [B * whole - (B - 1) * f(r) for r in rest]
        if name == "bias_all":
            out["bias_all"] = whole
    if n_moves:
        out["close_true"], out["close_all"] = true_share, close_share(mean_all, n_moves)
    return out


def bias_table(lines: list[str], args) -> str:
    """The bias table --protocol-67 adds under the gradient-quality table (with --close, the close decision's)."""
    head = "| policy | estimator | cosine of the mean of all draws | "
    head += "its jackknife (bias-corrected) mean ± sd [t interval] |"
    rule = "|---|---|---|---|"
    if args.close:
        head += " close share, true gradient | close share, mean of all draws | close share: mean - true, jackknife |"
        rule += "---|---|---|"
    B = args.gq_blocks
    note = (
        f"\nBias in direction, with an interval: the delete-one-block jackknife over the {B} blocks of "
        f"{args.gq_draws // B} draws (pseudo-values B theta_all - (B - 1) theta_-b; mean ± sd [95% t interval at "
        f"{B - 1} df, t_{{0.975, {B - 1}}} exact]; jackknife_measures). The true gradient's own noise (split-half, "
        "above) lowers every cosine alike and is not in the interval."
    )
    if args.close:
        note += (
            " Close share: sum over the observations of the direction's close logit over its length (close_share); "
            "the true gradient's beside each estimator's mean direction, and their difference (below 0: the "
            "estimator pushes toward one more turn more than the true gradient does, RFC #7244's hidden bonus; "
            "above 0: a tax)."
        )
    return "\n".join([head, rule, *lines]) + "\n" + note + "\n"


# ---------------------------------------------------------------------------------------------
# Learning speed (--speed; issue 62, points 2 and 3): the area under the held-out curve over a short budget,
# each estimator at the lr that maximises that speed on tuning seeds (the protocol is in the docstring)
# ---------------------------------------------------------------------------------------------
def t_cell(xs: list[float], digits: int = 2) -> str:
    """mean ± sd [lo, hi], the 95% interval mean ± t_{0.975, n-1} sd / sqrt(n) over n independent units, t at
    the actual df (05's t_quantile)."""
    if len(xs) < 2:
        return f"{xs[0]:.{digits}f}"
    mean, sd = common.mean_std(xs, ddof=1)
    h = evaluation.t_quantile(0.975, len(xs) - 1) * sd / math.sqrt(len(xs))
    return f"{mean:.{digits}f} ± {sd:.{digits}f} [{mean - h:.{digits}f}, {mean + h:.{digits}f}]"


def normalised_auc(curve: list[float], uniform: float, ceiling: float) -> float:
    """The area under the held-out curve, uniform 0, ceiling 1, per step of the budget:
      y_i = (R_i - U) / (C - U) at the evaluated steps 0, e, 2e, .. S;  AUC = (1 / S) sum_i e (y_i + y_{i+1}) / 2
    (the trapezoid rule; the curve's points evenly spaced, so AUC is the mean of the trapezoids' heights).
    A policy at the ceiling from step 0 gives 1; one that never moves from uniform gives about 0."""
    y = [(R - uniform) / (ceiling - uniform) for R in curve]
    return sum((y[i] + y[i + 1]) / 2 for i in range(len(y) - 1)) / (len(y) - 1)


def steps_to_frac(curve: list[float], uniform: float, ceiling: float, frac: float, every: int) -> int | None:
    """The first evaluated step whose held-out return reaches uniform + frac (ceiling - uniform) (None: never)."""
    for i, R in enumerate(curve):
        if R >= uniform + frac * (ceiling - uniform):
            return i * every
    return None


def curve_score(row: dict) -> float:
    """The tuning score of a --speed run: the mean of the trapezoids under its raw curve on the training
    scenarios (normalised_auc without the normalisation, which does not change the argmax over lr)."""
    return normalised_auc(row["curve"], 0.0, 1.0)


SPEED_COMPARISONS = (
    ("MICA (alpha=1)", "GRPO"),
    ("MICA (alpha=1)", "RLOO"),
    ("MICA (alpha=0)", "MICA (alpha=1)"),
    ("MICA (alpha=0.4)", "MICA (alpha=1)"),
    ("REINFORCE++", "GRPO"),
    ("RLOO", "GRPO"),
)


def speed_comparisons(estimators: list[dict], args) -> list[tuple[str, str]]:
    """The paired comparisons --speed prints (a - b): SPEED_COMPARISONS and each --advantage estimator - GRPO;
    with --protocol-67 (docs/ladder/protocol-stop.md) also MICA (alpha=0.4) - GRPO, MICA (alpha=1) - REINFORCE++
    and each --advantage estimator - MICA (alpha=1): every estimator against GRPO and against MICA (alpha=1).
    One whose rows are not run is left out by the caller."""
    imports = [e["name"] for e in estimators if e["kind"] == "import"]
    pairs = [*SPEED_COMPARISONS, *((name, "GRPO") for name in imports)]
    if args.protocol_67:
        pairs += [
            ("MICA (alpha=0.4)", "GRPO"),
            ("MICA (alpha=1)", "REINFORCE++"),
            *((name, "MICA (alpha=1)") for name in imports),
        ]
    return pairs


def power_check(tune_rows: list[dict], chosen: dict, estimators: list[dict], span: float, args) -> str:
    """Written before the fresh seeds run: for each comparison, the sd of its paired difference in tuning score
    over the tuning seeds at the chosen lrs (divided by span = C - U: in AUC units, approximately: the tuning
    scores are on the training scenarios), and the smallest difference the fresh seeds can separate from 0,
    t_{0.975, n-1} sd_d / sqrt(n), n the fresh seeds."""
    n = len(args.fresh_seeds)
    if n < 2:  # one fresh seed (a rerun of a committed rung and seed): no interval to size
        return "Power check: one fresh seed, no interval (a rerun of one seed, not a result)\n"
    t = evaluation.t_quantile(0.975, n - 1)
    score = {}
    for r in tune_rows:
        if r["lr"] == chosen.get(r["estimator"]):
            score.setdefault(r["estimator"], {})[r["seed"]] = r["score"] / span
    names = {e["name"] for e in estimators}
    parts = []
    for a, b in speed_comparisons(estimators, args):
        if a in names and b in names:
            d = [score[a][s] - score[b][s] for s in args.tune_seeds]
            sd = common.mean_std(d, ddof=1)[1] if len(d) > 1 else float("nan")
            parts.append(f"{a} - {b}: sd_d {sd:.3f} -> {t * sd / math.sqrt(n):.3f}")
    return (
        f"Power check (before the fresh seeds): smallest separable AUC difference = t(0.975, {n - 1}) = {t:.4f} x "
        f"sd_d / sqrt({n}), sd_d from the {len(args.tune_seeds)} tuning seeds at the chosen lrs (training "
        f"scenarios' scores / (C - U)): " + "; ".join(parts) + "\n"
    )


def speed(
    estimators: list[dict], train_set: list[dict], test: list[dict], uniform, ceiling, args, optimum=None
) -> tuple:
    """The learning-speed protocol: tune each estimator's lr on curve_score (tuning seeds, training scenarios,
    the edge rule), write the power check, run the fresh seeds on the test scenarios, and tabulate normalised
    AUC, steps to --speed-frac of the ceiling and the final return, with paired comparisons of AUC. optimum
    (--close): the search's [(fewest, most) turns talked at its best return] per test scenario, for the table of
    where the trained policies stop (stop_table). -> (the markdown text, the rows)."""
    chosen, tune_rows, at_edge = tune(estimators, train_set, args, score=curve_score)
    span = ceiling - uniform
    power = power_check(tune_rows, chosen, estimators, span, args)
    print(power, flush=True)
    tuned = [{**e, "lr": chosen[e["name"]]} for e in estimators]
    rows = run_jobs([(e, seed, train_set, test, args, True) for seed in args.fresh_seeds for e in tuned], args)
    for r in rows:
        r["phase"] = "fresh"
        r["auc"] = normalised_auc(r["curve"], uniform, ceiling)
        r["steps_to"] = steps_to_frac(r["curve"], uniform, ceiling, args.speed_frac, args.eval_every)
    lines = [
        f"| estimator | lr (chosen on speed) | normalised AUC | steps to {args.speed_frac:g} of the ceiling | reached "
        "| final held-out return |",
        "|---|---|---|---|---|---|",
    ]
    for e in tuned:
        rs = sorted((r for r in rows if r["estimator"] == e["name"]), key=lambda r: r["seed"])
        hit = [r["steps_to"] for r in rs]
        lines.append(
            f"| {e['name']} | {lr_text(e['lr'])} | {t_cell([r['auc'] for r in rs], 3)} | "
            f"{t_cell([args.steps + args.eval_every if h is None else h for h in hit], 1)} | "
            f"{sum(h is not None for h in hit)}/{len(rs)} | "
            f"{t_cell([r['final_return'] for r in rs])} |"
        )
    by = {}
    for r in rows:
        by.setdefault(r["estimator"], {})[r["seed"]] = r["auc"]
    comp = ["| comparison (paired over the fresh seeds) | AUC difference | seeds where > 0 |", "|---|---|---|"]
    for a, b in speed_comparisons(estimators, args):
        if a in by and b in by:
            d = [by[a][s] - by[b][s] for s in sorted(by[a])]
            comp.append(f"| {a} - {b} | {t_cell(d, 3)} | {sum(x > 0 for x in d)}/{len(d)} |")
    seeds = args.fresh_seeds
    note = (
        f"\nmean ± sd [95% t interval, t at {len(seeds) - 1} df, exact] over {len(seeds)} fresh seeds "
        f"({seeds[0]}-{seeds[-1]}), the seed the unit; normalised AUC: the held-out return every {args.eval_every} "
        f"steps over {args.steps} steps ({args.eval_k} dialogues per test scenario a point), uniform "
        f"{uniform:.2f} = 0, search ceiling {ceiling:.2f} = 1 (normalised_auc); a seed that never reaches "
        f"{args.speed_frac:g} of the way counts as {args.steps + args.eval_every} steps (the budget's next "
        f"evaluation); {rung_text(args)}\n"
    )
    text = (
        f"### Tuning on speed (training scenarios, tuning seeds)\n\n"
        f"{tuning_table(tune_rows, estimators, chosen, at_edge, len(train_set), args, what='speed')}\n"
        f"{power}\n### Learning speed (held-out test scenarios, fresh seeds)\n\n"
        + "\n".join(lines)
        + "\n\n"
        + "\n".join(comp)
        + "\n"
        + note
    )
    if optimum is not None:
        text += "\n" + stop_table(rows, tuned, optimum, args)
    return text, tune_rows + rows


def stop_table(rows: list[dict], estimators: list[dict], optimum: list[tuple[int, int]], args) -> str:
    """--close: where the trained policies stop against where the optimum stops. Per estimator over the fresh
    seeds: the turns talked by its final policy (the mean over its --final-eval-k dialogues per test scenario),
    the share of them it closed itself, that mean - the optimum's (the search's fewest turns talked at its best
    return, averaged over the test scenarios; the most such turns beside it), and paired differences of turns
    talked (speed_comparisons' pairs)."""
    lo = sum(a for a, _ in optimum) / len(optimum)
    hi = sum(b for _, b in optimum) / len(optimum)
    lines = [
        "| estimator | turns talked at the end | share closed by the policy | turns talked - the optimum's "
        "| final held-out return |",
        "|---|---|---|---|---|",
    ]
    by = {}
    for e in estimators:
        rs = sorted((r for r in rows if r["estimator"] == e["name"]), key=lambda r: r["seed"])
        by[e["name"]] = {r["seed"]: r["final_turns"] for r in rs}
        lines.append(
            f"| {e['name']} | {t_cell([r['final_turns'] for r in rs])} | {t_cell([r['final_closed'] for r in rs])} "
            f"| {t_cell([r['final_turns'] - lo for r in rs])} | {t_cell([r['final_return'] for r in rs])} |"
        )
    comp = [
        "| comparison (paired over the fresh seeds) | difference of turns talked | seeds where > 0 |",
        "|---|---|---|",
    ]
    for a, b in speed_comparisons(estimators, args):
        if a in by and b in by:
            d = [by[a][s] - by[b][s] for s in sorted(by[a])]
            comp.append(f"| {a} - {b} | {t_cell(d)} | {sum(x > 0 for x in d)}/{len(d)} |")
    per = ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in optimum)
    note = (
        f"\nThe optimum (the beam search's best return on each test scenario, beam {args.beam_width}: a lower bound) "
        f"stops after {lo:.2f} turns talked on average (fewest at its best return; {hi:.2f} the most that tie), per "
        f"test scenario {per}; the trained policies' turns over {args.final_eval_k} held-out dialogues per test "
        f"scenario at the end of training; mean ± sd [95% t interval at {len(args.fresh_seeds) - 1} df] over the "
        "fresh seeds (the optimum a constant)\n"
    )
    return (
        "### Where the policies stop (held-out test scenarios, fresh seeds)\n\n"
        + "\n".join(lines)
        + "\n\n"
        + ("\n".join(comp) + "\n" + note)
    )


def rung_text(args) -> str:
    """The rung's settings, as the tables' notes name them."""
    lengths = f"horizon drawn from {args.early_horizon}-{args.max_turns}" if args.early_horizon else "EMPA ends only"
    if args.close:
        lengths = "the policy closes (EMPA's success does not end a dialogue; collapse and the horizon do)" + (
            f", horizon drawn from {args.early_horizon}-{args.max_turns}" if args.early_horizon else ""
        )
    cost = f", turn cost {args.turn_cost:g}" if args.turn_cost else ""
    return (
        f"table {args.table}, delay {args.delay}, judge noise {args.judge_noise:g} sd of the per-turn reward "
        f"({args.noise_sd:.3f} in reward units), K={args.k}, {lengths}{cost}, "
        f"{args.scenarios_per_step} training scenarios a step, gamma {args.gamma}"
    )


def reward_spread(train_set: list[dict], args) -> float:
    """The spread the judge noise is measured in: the sd of the per-turn IDR reward r_t over every turn of 50
    dialogues of the uniform policy on each training scenario (its own random numbers, seed 424242; the rung's
    delay and length rule)."""
    rng = random.Random(424242)
    theta = initial_theta(args)
    r = [x for s in train_set for _ in range(50) for x in rollout(theta, s, rng, args).extra["rewards"]]
    return common.mean_std(r, ddof=1)[1]


# ---------------------------------------------------------------------------------------------
# --- supporting pieces: the two yardsticks (search ceiling, myopic greedy), the table, the CLI ---
# ---------------------------------------------------------------------------------------------
def branch(tr, mem: Memory, move: str, args):
    """A copy of the dialogue so far, advanced by one more move (the original is left as it was)."""
    child = env.Trajectory(
        scenario=tr.scenario, k=0, ids=[], messages=[], states=[list(P) for P in tr.states], emotions=list(tr.emotions)
    )
    child.dEs, child.vs, child.levels = list(tr.dEs), list(tr.vs), list(tr.levels)
    child.extra = {"moves": list(tr.extra["moves"]), "obs": list(tr.extra["obs"])}
    if "end" in tr.extra:  # --close: EMPA's success, kept while the dialogue goes on
        child.extra["end"] = tr.extra["end"]
    cmem = copy.deepcopy(mem)
    step(child, cmem, move, args)
    return child, cmem


def memory_key(mem: Memory, args) -> tuple:
    """What of the user's memory the rest of the dialogue depends on. Short table: the validations up to 5,
    the last two moves, the debt. Delayed table: the validations up to 3, the turns since the opening
    question (up to DELAY; -1: not asked), the penalties still to land (turns ahead, levels)."""
    if args.table == "short":
        return min(mem.validated, 5), tuple(mem.last[-2:]), tuple(sorted(mem.debt.items()))
    t = len(mem.last)
    since = -1 if mem.opened is None else min(t - mem.opened, mem.delay)
    pending = tuple(sorted((turn - t, tuple(sorted(lv.items()))) for turn, lv in mem.due.items() if turn > t))
    return min(mem.validated, 3), since, pending


def search_ceiling(scenario: dict, args) -> tuple[float, bool]:
    """The best IDR return (and whether that dialogue succeeds) a beam search over move sequences finds on
    the same dynamics: a lower bound on the optimum, and the ceiling the threshold is measured against."""
    return search_best(scenario, args)[:2]


def search_best(scenario: dict, args) -> tuple[float, bool, tuple[int, int]]:
    """search_ceiling's beam search -> (the best return it finds, whether a dialogue with that return succeeds,
    (the fewest, the most) turns talked by the dialogues it finished within 1e-9 of that return). With --close the
    moves include close and the return is turn_rewards' (the turn cost subtracted): the turns talked are where
    the (beam's) optimum stops, a range where stopping a turn earlier or later ties."""
    beam, best = [new_episode(scenario, getattr(args, "delay", DELAY))], (-math.inf, False)
    cost, finished = getattr(args, "turn_cost", 0.0), []
    while beam:
        children = []
        for tr, mem in beam:
            for move in moves(args):
                child, cmem = branch(tr, mem, move, args)
                ret = env.hinge_distance(scenario["p0"]) - env.hinge_distance(child.states[-1])
                if cost:
                    ret -= cost * talked(child)  # d(P_0) - d(P_T) - c x turns talked
                if child.outcome is not None:
                    best = max(best, (ret, succeeded(child, args)))
                    finished.append((ret, talked(child)))
                else:
                    children.append((ret, child, cmem))
        # keep the --beam-width best unfinished dialogues (distinct states and memories)
        children.sort(key=lambda c: -c[0])
        seen, beam = set(), []
        for _, child, cmem in children:
            key = (tuple(child.states[-1]), round(sum(child.dEs), 6), *memory_key(cmem, args))
            if key not in seen and len(beam) < args.beam_width:
                seen.add(key)
                beam.append((child, cmem))
    turns = [n for ret, n in finished if ret >= best[0] - 1e-9]
    return best[0], best[1], (min(turns), max(turns))


def succeeded(tr, args) -> bool:
    """EMPA's success: the outcome; with --close (where success does not end a dialogue) whether EMPA's rule held
    at some turn of it (tr.extra["end"], the first end EMPA's rules gave)."""
    if getattr(args, "close", False):
        return tr.extra.get("end", (0, None))[1] == "success"
    return tr.outcome == "success"


def myopic_greedy(scenario: dict, args) -> tuple[float, bool]:
    """The IDR return and success of the deterministic policy that knows the table and takes, every turn,
    the move with the largest immediate reward r_t (ties: the first in MOVES): how far credit for the
    next turn alone goes in this environment."""
    tr, mem = new_episode(scenario, getattr(args, "delay", DELAY))
    cost = getattr(args, "turn_cost", 0.0)
    while tr.outcome is None:
        gains = []
        for move in moves(args):
            child, _ = branch(tr, mem, move, args)
            gain = env.hinge_distance(tr.states[-1]) - env.hinge_distance(child.states[-1])  # r_t
            gains.append(gain - cost if cost and move != CLOSE else gain)
        step(tr, mem, moves(args)[gains.index(max(gains))], args)
    ret = env.hinge_distance(scenario["p0"]) - env.hinge_distance(tr.states[-1])
    return (ret - cost * talked(tr) if cost else ret), succeeded(tr, args)


def ci_cell(xs: list[float], digits: int = 2) -> str:
    """mean ± sd [lo, hi], the 95% CI mean ± t_{0.975, n-1} sd / sqrt(n) over the seeds (independent)."""
    if len(xs) < 2:
        return f"{xs[0]:.{digits}f}"
    mean, sd = common.mean_std(xs, ddof=1)
    h = evaluation.t_interval(xs)[1]
    return f"{mean:.{digits}f} ± {sd:.{digits}f} [{mean - h:.{digits}f}, {mean + h:.{digits}f}]"


def steps_to(curve: list[float], threshold: float, args) -> int | None:
    """The first evaluated step whose held-out return reaches the threshold (None: never)."""
    for i, ret in enumerate(curve):
        if ret >= threshold:
            return min(i * args.eval_every, args.steps)
    return None


def table(
    rows: list[dict],
    estimators: list[dict],
    threshold: float,
    uniform: float,
    greedy: tuple,
    ceiling: tuple,
    args,
    seconds: float,
    tuned: bool = False,
) -> str:
    """The markdown table: one row per estimator, then the uniform policy, the myopic greedy policy and the
    search ceiling. tuned: each estimator at its own lr (estimator["lr"], an lr column)."""
    seeds = sorted({r["seed"] for r in rows})
    by = {
        e["name"]: sorted((r for r in rows if r["estimator"] == e["name"]), key=lambda r: r["seed"]) for e in estimators
    }
    lr_head, lr_rule, lr_blank = ("lr (tuned) | ", "---|", " |") if tuned else ("", "", "")
    lines = [
        f"| estimator | {lr_head}final held-out return | success rate | steps to threshold | reached | "
        "return - GRPO's (paired) |",
        f"|---|{lr_rule}---|---|---|---|---|",
    ]
    grpo = {r["seed"]: r["final_return"] for r in by.get("GRPO", [])}
    for e in estimators:
        rs = by[e["name"]]
        hit = [steps_to(r["curve"], threshold, args) for r in rs]
        censored = [args.steps if s is None else s for s in hit]  # never reached: counted as --steps
        diff = [r["final_return"] - grpo[r["seed"]] for r in rs if r["seed"] in grpo]
        lr_cell = f" {lr_text(e['lr'])} |" if tuned else ""
        lines.append(
            f"| {e['name']} |{lr_cell} {ci_cell([r['final_return'] for r in rs])} | "
            f"{ci_cell([r['final_success'] for r in rs])} | {ci_cell(censored, 0)} | "
            f"{sum(s is not None for s in hit)}/{len(rs)} | "
            f"{'—' if e['name'] == 'GRPO' or not diff else ci_cell(diff)} |"
        )
    lines.append(f"| untrained (uniform) policy |{lr_blank} {uniform:.2f} | | | | |")
    lines.append(f"| myopic greedy (argmax r_t, knows the table) |{lr_blank} {greedy[0]:.2f} | {greedy[1]:.2f} | | | |")
    lines.append(f"| search ceiling (beam {args.beam_width}) |{lr_blank} {ceiling[0]:.2f} | {ceiling[1]:.2f} | | | |")
    lr_note = "lr: each estimator's own, tuned (the lr column)" if tuned else f"lr {args.lr}"
    note = (
        f"\nmean ± sd [95% CI: t_{{0.975, n-1}} sd / sqrt(n)] over {len(seeds)} seeds ({seeds[0]}-{seeds[-1]}); "
        f"{args.steps} steps of {args.scenarios_per_step} train scenarios x K={args.k}, {lr_note}, "
        f"gamma {args.gamma}; held-out: {args.final_eval_k} dialogues per test scenario at the end, {args.eval_k} "
        f"every {args.eval_every} steps (the curves, steps to threshold); {args.max_turns} turns "
        f"(min {args.min_turns}, collapse window {args.collapse_window}); threshold {threshold:.2f} = "
        f"{args.threshold_frac} of the way from the uniform policy to the search ceiling (a seed that "
        f"never reaches it counts as {args.steps} steps)"
        f"{'' if args.table == 'short' else f'; table {args.table} (judge_{args.table})'}"
        f"{'; training dialogues without early ends (--no-early-end)' if args.no_early_end else ''}; {seconds:.0f} s\n"
    )
    return "\n".join(lines) + "\n" + note


ESTIMATORS = ("mica", "grpo", "reinforce_pp", "rloo")  # --estimators' names, in the tables' order


def estimator_list(args) -> list[dict]:
    """Of --estimators: MICA at each of --alphas, GRPO, REINFORCE++ (04's estimators by their names in
    ADVANTAGES) and RLOO (the fork's, rloo_advantages)."""
    rows = []
    for kind in ESTIMATORS:
        if kind not in args.estimators:
            continue
        if kind == "mica":
            for a in args.alphas:
                rows.append({"name": f"MICA (alpha={a:g})", "kind": "mica", "alpha": a})
        elif kind == "grpo":
            rows.append({"name": "GRPO", "kind": "grpo"})
        elif kind == "reinforce_pp":
            rows.append({"name": "REINFORCE++", "kind": "reinforce_pp"})
        else:
            rows.append({"name": "RLOO", "kind": "rloo"})
    for spec in args.advantage:  # a fork's estimator, by --advantage module:function (04's imported_estimator)
        rows.append({"name": spec, "kind": "import", "spec": spec})
    return rows


def run_job(job):
    estimator, seed, train_set, test, args, curves = job
    return train(estimator, seed, train_set, test, args, curves=curves)


def run_jobs(jobs: list, args) -> list[dict]:
    """(estimator, seed, train set, scored-on set, args, curves) jobs -> their rows, --workers processes."""
    if args.workers > 1:
        import multiprocessing

        with multiprocessing.Pool(args.workers) as pool:
            return pool.map(run_job, jobs)
    return [run_job(j) for j in jobs]


# ---------------------------------------------------------------------------------------------
# --tune: each estimator at its own step size (the protocol is in the docstring; issue 57)
# ---------------------------------------------------------------------------------------------
# the paired comparisons the course makes, (a, b): a - b over the fresh seeds; one whose rows are not run
# (--alphas, --estimators) is left out
COMPARISONS = (
    ("RLOO", "GRPO"),
    ("MICA (alpha=1)", "GRPO"),
    ("MICA (alpha=0.4)", "GRPO"),
    ("MICA (alpha=0)", "MICA (alpha=1)"),
    ("MICA (alpha=0.4)", "MICA (alpha=0)"),
    ("REINFORCE++", "GRPO"),
    ("MICA (alpha=1)", "RLOO"),
)


def lr_text(lr: float) -> str:
    """An lr as the tables print it: 3 significant digits, no exponent (0.316, 31.6, 1000)."""
    return f"{float(f'{lr:.3g}'):g}"


def choose_lr(scores: dict) -> float:
    """{lr: [score per tuning seed]} -> the lr with the largest mean score; ties: the smaller lr."""
    # lr* = argmax_lr (1 / n) sum_i score_i(lr), the smallest such lr
    best_lr, best_mean = None, -math.inf
    for lr in sorted(scores):
        mean = sum(scores[lr]) / len(scores[lr])
        if mean > best_mean:
            best_lr, best_mean = lr, mean
    return best_lr


def beyond_edge(lrs: list[float], chosen: float) -> float | None:
    """The edge rule: the chosen lr is the grid's largest (smallest) -> the next lr beyond it, the grid's own
    ratio further (its last two points' ratio up, its first two points' down); inside the grid -> None."""
    lrs = sorted(lrs)
    if len(lrs) < 2:
        return None
    if chosen == lrs[-1]:
        return lrs[-1] * lrs[-1] / lrs[-2]
    if chosen == lrs[0]:
        return lrs[0] * lrs[0] / lrs[1]
    return None


def final_score(row: dict) -> float:
    """--tune's score: the final IDR return (on the training scenarios while tuning)."""
    return row["final_return"]


def tune(estimators: list[dict], train_set: list[dict], args, score=final_score) -> tuple[dict, list[dict], dict]:
    """Every estimator at every lr of --lr-grid, from each of --tune-seeds, scored on the training scenarios by
    score(row) (--tune: the final return; --speed: curve_score, the area under the curve, so the curves are
    run) (the test scenarios are not touched); the edge rule adds lrs beyond an edge that wins, at most
    --extend-edges a side. -> ({name: chosen lr}, the tuning rows (each with its "score"), {name: "low"/"high"
    where the chosen lr is still an edge of what was run})."""
    rows, chosen, at_edge = [], {}, {}
    curves = score is not final_score
    if curves:  # the tuning curves on the 24 training scenarios, --tune-eval-k dialogues each a point
        args = argparse.Namespace(**{**vars(args), "eval_k": args.tune_eval_k})
    for e in estimators:
        lrs = list(args.lr_grid)
        jobs = [({**e, "lr": lr}, seed, train_set, train_set, args, curves) for lr in lrs for seed in args.tune_seeds]
        mine = run_jobs(jobs, args)
        for r in mine:
            r["score"] = score(r)
        extended = {"low": 0, "high": 0}
        while True:
            scores = {}
            for r in mine:
                scores.setdefault(r["lr"], []).append(r["score"])
            best = choose_lr(scores)
            nxt = beyond_edge(lrs, best)
            side = None if nxt is None else ("high" if nxt > best else "low")
            if side is None or extended[side] >= args.extend_edges:
                break
            extended[side] += 1
            lrs.append(nxt)
            more = run_jobs(
                [({**e, "lr": nxt}, seed, train_set, train_set, args, curves) for seed in args.tune_seeds], args
            )
            for r in more:
                r["score"] = score(r)
            mine += more
        chosen[e["name"]] = best
        if side is not None:
            at_edge[e["name"]] = side
        for r in mine:
            r["phase"] = "tune"
        rows += mine
    return chosen, rows, at_edge


def tuning_table(
    rows: list[dict], estimators: list[dict], chosen: dict, at_edge: dict, n_train: int, args, what: str = "final"
) -> str:
    """Estimators x lrs: mean ± sd of the tuning score on the training scenarios over the tuning seeds (what
    "final": the final return; "speed": curve_score); the chosen lr in bold."""
    lrs = sorted({r["lr"] for r in rows})
    lines = [
        "| estimator | " + " | ".join(f"lr {lr_text(lr)}" for lr in lrs) + " | chosen |",
        "|---|" + "---|" * (len(lrs) + 1),
    ]
    for e in estimators:
        cells = []
        for lr in lrs:
            xs = [r["score"] for r in rows if r["estimator"] == e["name"] and r["lr"] == lr]
            if not xs:
                cells.append("—")
                continue
            mean, sd = common.mean_std(xs, ddof=1) if len(xs) > 1 else (xs[0], 0.0)
            cell = f"{mean:.2f} ± {sd:.2f}"
            cells.append(f"**{cell}**" if lr == chosen[e["name"]] else cell)
        edge = f" (the grid's {at_edge[e['name']]} edge)" if e["name"] in at_edge else ""
        lines.append(f"| {e['name']} | " + " | ".join(cells) + f" | {lr_text(chosen[e['name']])}{edge} |")
    seeds = args.tune_seeds
    scored = (
        f"final IDR return on the {n_train} training scenarios ({args.final_eval_k} dialogues each)"
        if what == "final"
        else f"area under the IDR return curve on the {n_train} training scenarios (every {args.eval_every} steps, "
        f"{args.tune_eval_k} dialogues each; the mean of the trapezoids, not normalised)"
    )
    note = (
        f"\n{scored}, mean ± sd "
        f"over the {len(seeds)} tuning seeds ({', '.join(map(str, seeds))}); bold: the chosen lr (the largest mean; "
        f"ties: the smaller lr); grid {', '.join(lr_text(lr) for lr in args.lr_grid)}, extended beyond an edge "
        f"that wins at most {args.extend_edges} times a side; {args.steps} steps, the other settings as below\n"
    )
    return "\n".join(lines) + "\n" + note


def comparisons(rows: list[dict], estimators: list[dict]) -> str:
    """The paired differences of COMPARISONS over the fresh seeds: mean ± sd [95% t interval], seeds > 0."""
    names = {e["name"] for e in estimators}
    by = {}
    for r in rows:
        by.setdefault(r["estimator"], {})[r["seed"]] = r["final_return"]
    lines = [
        "| comparison (paired over the fresh seeds) | difference of final held-out return | seeds where > 0 |",
        "|---|---|---|",
    ]
    for a, b in COMPARISONS:
        if a not in names or b not in names:
            continue
        seeds = sorted(set(by[a]) & set(by[b]))
        diff = [by[a][s] - by[b][s] for s in seeds]
        lines.append(f"| {a} - {b} | {ci_cell(diff)} | {sum(d > 0 for d in diff)}/{len(diff)} |")
    return "\n".join(lines) + "\n"


def seed_list(text: str) -> list[int]:
    """ "100-123" -> [100, ..., 123]; "1,5,7" -> [1, 5, 7]; ranges and single seeds mix."""
    seeds = []
    for part in text.split(","):
        part = part.strip()
        if "-" in part:
            lo, hi = part.split("-")
            seeds += list(range(int(lo), int(hi) + 1))
        elif part:
            seeds.append(int(part))
    if not seeds or len(set(seeds)) != len(seeds):
        raise ValueError(f"seeds {text!r}: none, or one twice")
    return seeds


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--seeds", type=int, default=24, help="number of seeds (0 .. N-1), the same for every estimator")
    p.add_argument("--alphas", default="0.0,0.4,1.0", help="MICA's alphas (weight of the turn-level advantage)")
    p.add_argument(
        "--estimators",
        default=",".join(ESTIMATORS),
        help="the estimators to run, of " + ", ".join(ESTIMATORS) + " (mica: at each of --alphas; rloo: the "
        "course's fork estimator, rloo_advantages)",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="a look in under a minute: 3 seeds unless --seeds is given, 60 steps, evaluation every "
        "10 steps on 4 held-out dialogues per scenario (8 for the final one); flags given "
        "explicitly win",
    )
    p.add_argument(
        "--table",
        choices=list(TABLES),
        default="short",
        help="the move table: short (judge_move: one-turn debts, the first table) or delayed (judge_delayed: "
        "a question that hurts now opens the payoff 3 turns later, tempting moves cost 3 turns later)",
    )
    p.add_argument(
        "--out",
        default=None,
        help="folder for credit.md, credit.png, credit.jsonl (default: runs/credit, runs/credit-delayed, under "
        "the current folder)",
    )
    p.add_argument("--workers", type=int, default=1, help="processes that train (seed, estimator) pairs at once")
    g = p.add_argument_group("each estimator at its own step size (--tune; the protocol is in the docstring)")
    g.add_argument(
        "--tune",
        action="store_true",
        help="instead of the table: every estimator at every lr of --lr-grid on --tune-seeds, scored on the "
        "training scenarios; each at its chosen lr on --fresh-seeds, on the test scenarios (writes <out>/tuned.md, "
        "tuned.jsonl, tuned.png)",
    )
    g.add_argument(
        "--lr-grid",
        default=",".join(f"{10 ** (i / 2):.6g}" for i in range(-2, 5)),
        help="--tune: the lrs tried, fixed in advance (10^(i/2), i = -2 .. 4)",
    )
    g.add_argument(
        "--extend-edges",
        type=int,
        default=2,
        help="--tune: where the best lr is an edge of the grid, run the next lr beyond it (the grid's ratio), at "
        "most this many times a side",
    )
    g.add_argument("--tune-seeds", default="1000-1003", help="--tune: the seeds the lr is chosen on (a-b, or a,b,c)")
    g.add_argument(
        "--fresh-seeds",
        default="100-123",
        help="--tune: the seeds the tuned table reports (disjoint from --tune-seeds)",
    )
    g.add_argument(
        "--advantage",
        action="append",
        default=[],
        metavar="MODULE:FUNCTION",
        help="add a fork's estimator with 04's ADVANTAGES signature, fn(rewards, dialogues, args) -> (A, terms), as "
        "04's --advantage module:function imports it (repeatable; the module found on sys.path or in the current "
        "folder); it runs beside --estimators in every mode",
    )
    g = p.add_argument_group("gradient quality and learning speed (issue 62; the protocol is in the docstring)")
    g.add_argument(
        "--gradient-quality",
        action="store_true",
        help="each estimator's direction from one batch against the true gradient at fixed policies (writes "
        "<out>/gradient.md, gradient.jsonl); with --speed, both",
    )
    g.add_argument("--gq-draws", type=int, default=200, help="--gradient-quality: independent batches per policy")
    g.add_argument("--gq-blocks", type=int, default=10, help="--gradient-quality: blocks the draws are cut into")
    g.add_argument(
        "--gq-true", type=int, default=1000, help="--gradient-quality: dialogues per training scenario, true gradient"
    )
    g.add_argument(
        "--speed",
        action="store_true",
        help="learning speed: lr tuned on the area under the curve, then fresh seeds (writes <out>/speed.md, "
        "speed.jsonl, speed.png); sets the speed protocol's defaults (flags given explicitly win)",
    )
    g.add_argument("--speed-frac", type=float, default=0.9, help="--speed: steps to this fraction of the ceiling")
    g.add_argument(
        "--tune-eval-k",
        type=int,
        default=2,
        help="--speed: dialogues per training scenario at each point of a tuning curve (24 scenarios: 48 a point)",
    )
    g.add_argument(
        "--judge-noise",
        type=float,
        default=0.0,
        help="the rewards the estimators see get Gaussian noise of this many sds of the per-turn reward "
        "(reward_spread); the state and the held-out return are noise-free",
    )
    g.add_argument("--delay", type=int, default=DELAY, help="--table delayed: turns from the question to its payoff")
    g.add_argument(
        "--early-horizon",
        type=int,
        default=0,
        help="length rule: each training dialogue times out at a turn drawn from this .. --max-turns (0: off)",
    )
    g.add_argument(
        "--close",
        action="store_true",
        help="the stopping rung (issue 67 item 2): the policy gets an eighth move, close, that ends the dialogue "
        "(r_t = 0, nothing due later lands); EMPA's success no longer ends a dialogue (collapse and the horizon "
        "still do); with --speed and --gradient-quality, where the policies stop and the bias tables are printed",
    )
    g.add_argument(
        "--protocol-67",
        action="store_true",
        help="the comparisons and measures docs/ladder/protocol-stop.md adds: MICA (alpha=0.4) - GRPO, "
        "MICA (alpha=1) - REINFORCE++ and each --advantage estimator - MICA (alpha=1) beside the rest, and under "
        "the gradient-quality table the bias table (the cosine of the mean of all draws with a jackknife interval; "
        "with --close the close share); set by --close",
    )
    g.add_argument(
        "--turn-cost",
        type=float,
        default=0.0,
        help="subtract this from the reward of every turn of talk (every move but close): the user's time; the "
        "stopping rung's is 1 (docs/ladder/protocol-stop.md)",
    )
    g = p.add_argument_group("the survivor question (MICA's A_turn compares only the dialogues that reached turn t)")
    g.add_argument(
        "--survivors",
        action="store_true",
        help="instead of the table: the mean A_turn, A_group and A by how and when dialogues ended, at the "
        "uniform policy and during MICA's training, and every estimator trained with and without early ends "
        "(writes <out>/survivors.md)",
    )
    g.add_argument(
        "--survivor-groups", type=int, default=200, help="--survivors: groups of K per seed at the uniform policy"
    )
    g.add_argument("--survivor-alpha", type=float, default=0.4, help="--survivors: MICA's alpha for A and training")
    g.add_argument(
        "--no-early-end",
        action="store_true",
        help="training dialogues run to --max-turns whatever EMPA's rules say (held-out ones keep EMPA's ends)",
    )
    g = p.add_argument_group("environment (03's rules)")
    g.add_argument("--train", default=str(ROOT / "data" / "scenarios_train.jsonl"), help="training scenarios")
    g.add_argument("--test", default=str(ROOT / "data" / "scenarios_test.jsonl"), help="held-out scenarios")
    g.add_argument("--max-turns", type=int, default=15, help="turns before a timeout (EMPA: 45; MICA trains on 8-15)")
    g.add_argument(
        "--min-turns",
        type=int,
        default=None,
        help="no success or failure before this turn; unset: EMPA's 12/45 of --max-turns, rounded (4 at 15)",
    )
    g.add_argument("--collapse-window", type=int, default=5, help="failure when the last N dE are all < 0 (EMPA: 5)")
    g = p.add_argument_group("training (one plain policy-gradient step per batch)")
    g.add_argument("--steps", type=int, default=300, help="training steps per seed and estimator")
    g.add_argument("--k", type=int, default=4, help="rollouts per scenario per step, K (as 04's default)")
    g.add_argument("--scenarios-per-step", type=int, default=4, help="training scenarios per step (as 04's default)")
    g.add_argument("--lr", type=float, default=1.0, help="step size on the logits")
    g.add_argument("--gamma", type=float, default=0.85, help="discount of the per-turn returns (as 04's default)")
    g = p.add_argument_group("measurement")
    g.add_argument("--eval-every", type=int, default=20, help="held-out evaluation every N steps (the curves)")
    g.add_argument("--eval-k", type=int, default=8, help="held-out dialogues per test scenario per evaluation (curves)")
    g.add_argument(
        "--final-eval-k",
        type=int,
        default=32,
        help="held-out dialogues per test scenario for the final return and success",
    )
    g.add_argument(
        "--threshold-frac",
        type=float,
        default=0.5,
        help="steps to threshold: this fraction of the way from the uniform policy to the search ceiling",
    )
    g.add_argument(
        "--beam-width",
        type=int,
        default=None,
        help="beam of the search ceiling; unset: 32 for the short table, 128 for the delayed one (each the "
        "smallest power of 2 found to reach the maximum, d(P0), on every shipped test scenario: the delayed "
        "table's opening question lowers the return for three turns, and a beam of 32 drops it)",
    )
    args = p.parse_args(argv)
    if args.quick:  # new defaults; flags given explicitly still win
        p.set_defaults(
            seeds=3,
            steps=60,
            eval_every=10,
            eval_k=4,
            final_eval_k=8,
            tune_seeds="1000-1001",
            fresh_seeds="100-102",
        )
        args = p.parse_args(argv)
    if args.speed:  # the speed protocol's defaults (committed before it ran); flags given explicitly still win
        p.set_defaults(
            steps=50,
            eval_every=2,
            eval_k=8,
            lr_grid="1,3.16228,10,31.6228,100,316.228",
            tune_seeds="2000-2002",
            fresh_seeds="200-223",
        )
        if args.quick:
            p.set_defaults(steps=10, tune_seeds="2000-2001", fresh_seeds="200-202", eval_k=2, lr_grid="10,31.6228")
        args = p.parse_args(argv)
    if args.out is None:  # under the current folder, wherever the script is
        args.out = str(Path("runs") / ("credit" if args.table == "short" else f"credit-{args.table}"))
    if args.beam_width is None:
        args.beam_width = 32 if args.table == "short" else 128
    if args.min_turns is None:
        args.min_turns = max(1, round(args.max_turns * 12 / 45))
    for name in (
        "seeds",
        "steps",
        "k",
        "scenarios_per_step",
        "eval_every",
        "eval_k",
        "final_eval_k",
        "beam_width",
        "workers",
        "survivor_groups",
        "max_turns",
        "collapse_window",
        "gq_draws",
        "gq_blocks",
        "gq_true",
        "delay",
        "tune_eval_k",
    ):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.gq_draws // args.gq_blocks < 2:
        p.error("--gq-draws must be at least twice --gq-blocks (a block's variance needs 2 draws)")
    if args.judge_noise < 0 or not 0 < args.speed_frac <= 1:
        p.error("--judge-noise must be >= 0 and --speed-frac in (0, 1]")
    args.protocol_67 = args.protocol_67 or args.close
    if args.turn_cost < 0:
        p.error("--turn-cost must be >= 0")
    if args.early_horizon and not 1 <= args.early_horizon <= args.max_turns:
        p.error(f"--early-horizon must lie in 1 .. --max-turns {args.max_turns}")
    args.noise_sd = 0.0  # the judge noise in reward units: main sets it from --judge-noise x reward_spread
    for spec in args.advantage:
        if ":" not in spec:
            p.error(f"--advantage {spec}: module:function")
        try:
            trainer.imported_estimator(spec)
        except common.UserError as err:
            p.error(str(err))
    if args.extend_edges < 0:
        p.error("--extend-edges must be >= 0")
    args.estimators = [e.strip() for e in args.estimators.split(",") if e.strip()]
    if not args.estimators or not set(args.estimators) <= set(ESTIMATORS):
        p.error(f"--estimators: comma-separated names of {', '.join(ESTIMATORS)}, got {args.estimators}")
    try:
        args.lr_grid = sorted({float(x) for x in args.lr_grid.split(",") if x.strip()})
        args.tune_seeds, args.fresh_seeds = seed_list(args.tune_seeds), seed_list(args.fresh_seeds)
    except ValueError as err:
        p.error(f"--lr-grid, --tune-seeds, --fresh-seeds: {err}")
    if not args.lr_grid or min(args.lr_grid) <= 0:
        p.error(f"--lr-grid: positive numbers, got {args.lr_grid}")
    if set(args.tune_seeds) & set(args.fresh_seeds):
        p.error(f"--tune-seeds and --fresh-seeds share {sorted(set(args.tune_seeds) & set(args.fresh_seeds))}")
    if args.k < 2:
        p.error("--k must be >= 2: the group estimators compare a scenario's K rollouts")
    try:
        args.alphas = [float(a) for a in args.alphas.split(",") if a.strip()]
    except ValueError:
        p.error(f"--alphas: comma-separated numbers in [0, 1], got {args.alphas!r}")
    if not all(0.0 <= a <= 1.0 for a in args.alphas):
        p.error(f"--alphas must lie in [0, 1], got {args.alphas}")
    if not 0.0 <= args.survivor_alpha <= 1.0:
        p.error(f"--survivor-alpha must lie in [0, 1], got {args.survivor_alpha}")
    return args


def main(argv=None):
    args = parse_args(argv)
    t0 = time.time()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    train_set, test = env.load_scenarios(args.train), env.load_scenarios(args.test)
    common.check(
        args.scenarios_per_step <= len(train_set),
        f"--scenarios-per-step {args.scenarios_per_step} > {len(train_set)} training scenarios",
    )
    if args.survivors:
        text = survivors(train_set, test, args) + f"{time.time() - t0:.0f} s\n"
        (out / "survivors.md").write_text(text)
        print("\n" + text)
        return
    estimators = estimator_list(args)
    if args.judge_noise > 0 or args.speed or args.gradient_quality:
        spread = reward_spread(train_set, args)
        args.noise_sd = args.judge_noise * spread
        print(f"per-turn reward sd at the uniform policy {spread:.4f}; {rung_text(args)}", flush=True)
    if args.gradient_quality:
        text, rows = gradient_quality(estimators, train_set, test, args)
        text = f"## Gradient quality at fixed policies ({rung_text(args)})\n\n{text}{time.time() - t0:.0f} s\n"
        (out / "gradient.md").write_text(text)
        with open(out / "gradient.jsonl", "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
        print("\n" + text, flush=True)
        if not args.speed:
            return
    if args.tune:  # the lr chosen before the test scenarios are looked at
        chosen, tune_rows, at_edge = tune(estimators, train_set, args)
    # the yardsticks, on the test scenarios: the uniform policy (every run's step 0), the myopic greedy
    # policy and the search ceiling
    uniform = evaluate(
        initial_theta(args),
        test,
        random.Random(12345),
        argparse.Namespace(**{**vars(args), "eval_k": max(args.eval_k, 64)}),
    )["return"]
    best = [search_best(s, args) for s in test]  # search_ceiling's numbers, and where the best stops
    found, mine = [b[:2] for b in best], [myopic_greedy(s, args) for s in test]
    if args.close:
        print(
            f"yardsticks: uniform {uniform:.2f}, search ceiling {sum(r for r, _ in found) / len(found):.2f} stopping "
            f"after {', '.join(str(b[2]) for b in best)} turns talked (fewest, most at its best return)",
            flush=True,
        )
    ceiling = (sum(r for r, _ in found) / len(found), sum(ok for _, ok in found) / len(found))
    greedy = (sum(r for r, _ in mine) / len(mine), sum(ok for _, ok in mine) / len(mine))
    threshold = uniform + args.threshold_frac * (ceiling[0] - uniform)
    if args.speed:
        optimum = [b[2] for b in best] if args.close else None
        text, rows = speed(estimators, train_set, test, uniform, ceiling[0], args, optimum)
        with open(out / "speed.jsonl", "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
        span = ceiling[0] - uniform
        plots.series(
            {
                f"{e['name']}": [
                    [(x - uniform) / span for x in r["curve"]]
                    for r in rows
                    if r.get("phase") == "fresh" and r["estimator"] == e["name"]
                ]
                for e in estimators
            },
            "held-out return, uniform 0, ceiling 1",
            out / "speed.png",
            xlabel=f"evaluation (every {args.eval_every} training steps)",
        )
        text = f"## Learning speed ({rung_text(args)})\n\n{text}{time.time() - t0:.0f} s\n"
        (out / "speed.md").write_text(text)
        print("\n" + text)
        return
    if args.tune:
        tuned = [{**e, "lr": chosen[e["name"]]} for e in estimators]
        rows = run_jobs([(e, seed, train_set, test, args, True) for seed in args.fresh_seeds for e in tuned], args)
        for r in rows:
            r["phase"] = "fresh"
        with open(out / "tuned.jsonl", "w") as f:
            for r in tune_rows + rows:
                f.write(json.dumps(r) + "\n")
        plots.series(
            {
                f"{e['name']} (lr {lr_text(e['lr'])})": [r["curve"] for r in rows if r["estimator"] == e["name"]]
                for e in tuned
            },
            "held-out IDR return",
            out / "tuned.png",
            xlabel=f"evaluation (every {args.eval_every} training steps)",
        )
        text = (
            f"## Each estimator at its own step size (table {args.table})\n\n### Tuning (training scenarios, "
            f"tuning seeds)\n\n{tuning_table(tune_rows, estimators, chosen, at_edge, len(train_set), args)}\n"
            f"### Tuned (held-out test scenarios, fresh seeds)\n\n"
            f"{table(rows, tuned, threshold, uniform, greedy, ceiling, args, time.time() - t0, tuned=True)}\n"
            f"{comparisons(rows, tuned)}"
        )
        (out / "tuned.md").write_text(text)
        print("\n" + text)
        return
    jobs = [(e, seed, train_set, test, args, True) for seed in range(args.seeds) for e in estimators]
    rows = run_jobs(jobs, args)
    with open(out / "credit.jsonl", "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    # the learning curves: mean and +-1 sd over the seeds, 05's picture with its x axis named for this
    plots.series(
        {e["name"]: [r["curve"] for r in rows if r["estimator"] == e["name"]] for e in estimators},
        "held-out IDR return",
        out / "credit.png",
        xlabel=f"evaluation (every {args.eval_every} training steps)",
    )
    text = table(rows, estimators, threshold, uniform, greedy, ceiling, args, time.time() - t0)
    (out / "credit.md").write_text(text)
    print("\n" + text)


if __name__ == "__main__":
    common.run_main(main)

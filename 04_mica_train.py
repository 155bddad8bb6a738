"""04_mica_train.py: MICA, online multi-turn RL of a support policy (LoRA) against a simulated user.

Each step rolls out K dialogues for each of a few scenarios in 03's environment, turns the judge's verdicts into
per-turn rewards, assigns credit with MICA's mixed turn-level and group-level advantage (or GRPO's, or
REINFORCE++'s), and takes clipped policy-gradient steps on the tokens of every reply.

Imports 03_rollout, the environment: scenarios, the batched rollout, the judges and users, IDR.
        01_rubric_sft, CARE's and Kardia-R1's graders: the loops of --reward care and kardia.
Reads   data/scenarios_train.jsonl (or --scenarios), the policy (--model), the judge and the user (03's options).
Writes  runs/<name>-<time>/: args.json, metrics.jsonl, rollouts.jsonl, checkpoint.pt, adapter/ (05_eval.py
        --adapters takes it), curves.png, credit_step<N>.png (each file: docs/files.md, "A run's folder").

Equations (MICA, docs/reference.md section 2; each is written again above the loop that computes it)
  reward       r_t by --reward: idr d(P_{t-1}) - d(P_t); rlver (e_t - e_{t-1}) / 100; care and kardia the
               rubric's score; minus lambda_cut x the reward's unit when reply t was cut off
  return       G_t = sum_{j >= t} gamma^(j - t) r_j
  MICA         A[k][t] = alpha A_turn[k][t] + (1 - alpha) A_group[k][t]: G normalised over the k that reached
               turn t, r normalised over the scenario's every turn
  GRPO         A[k][t] = (R_k - mean_K) / (std_K + 1e-6),  R_k = sum_t r[k][t]
  REINFORCE++  A = (G - mean) / (std + 1e-6) over every turn of the batch
  loss         L = (1/N) sum_i w_i max(-ratio_i A_i, -clip(ratio_i, 1 - eps_low, 1 + eps_high) A_i)
                   + beta (1/N) sum_i k3_i   (the k3 KL to the base; beta = --kl-coef, 0 as in MICA)
               ratio_i = pi(y_i) / pi_old(y_i);  w_i = min(pi_old(y_i) / pi_sampler(y_i), --tis-cap), 1 without it

Where each part lives
  here         Args; ADVANTAGES (the returns, the estimators); REWARDS (idr, rlver, each with its cut-off unit);
               the loss; the update; the loop; main
  01, 03       CARE's and Kardia-R1's rewards and graders; the environment and the rollout
  sampling.py  the sampler (each reply's tokens and log pi_sampler) beside the scorer (token_logprobs): what the
               loss scores is what was sampled
  common.py    LoRA (LORA_R = 16, LORA_ALPHA = 32) and make_optimizer: AdamW with a warmup-stable-decay schedule,
               stepped once a rollout (under 30 steps no warm-up: two steps at the peak, then a half cosine)
  runs.py      the run folder, the checkpoint, the step's record (StepLog), the update's statistics (UpdateStats)
  parallel.py  the data-parallel helpers: the only places where processes talk;  engine.py  --engine's vLLM client
  presets/     the budgets --preset picks: cpu, demo, gpu

Departures from MICA, one line each; the reasons: docs/reference.md, "Known departures at a glance" (item)
  1. LoRA, not full fine-tuning: lr 1e-3 on the CPU presets, 1e-5 on the gpu preset (3)
  2. short episodes on a CPU; the gpu preset has MICA's shape, its frozen base judging and playing the user (4, 5)
  3. a reply cut off at the token cap loses --cut-off-penalty of its reward's unit (6)
  4. a turn a judge failed on is left out of the loss; its reward is filled for the returns (7)
  5. REINFORCE++ discounts and whitens per turn; RLVER's reward is paid per turn, its end rule for every part (8, 10)
  6. two optimizer steps a rollout; pi_old is taken once, before the first (15)
  7. a reward positive every turn (care, kardia) favours long dialogues; idr and rlver do not (16)
  8. GRPO and REINFORCE++ whiten with the sample std, MICA with the population std, as its paper (1)
  9. idr+care weights each turn's distance by its rubric (--care-distance plain keeps MICA's IDR) (2)
  10. with --engine, each token's term is weighted by the truncated importance weight w_i above (14)

CPU:  python 04_mica_train.py --preset demo      (make demo: 4 steps; then 05 compares held out)
GPU:  python 04_mica_train.py --model Qwen2.5-7B-Instruct      (the gpu preset; docs/scale.md)
      python 04_mica_train.py --model Qwen2.5-7B-Instruct --engine http://localhost:8000   (a vLLM server,
          `make serve MODEL=Qwen2.5-7B-Instruct`, samples the policy, judges and plays the user)
N GPUs: accelerate launch --num_processes N 04_mica_train.py ...
A new estimator or reward: one function and one entry in ADVANTAGES or REWARDS (docs/training.md).
"""

from __future__ import annotations

import argparse
import importlib
import math
import os
import random
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from tqdm import tqdm

import backends
import common
import engine
import options
import parallel
import plots
import runs
import sampling

sft = importlib.import_module("01_rubric_sft")  # CARE's and Kardia-R1's graders, the rubric's dimensions
env = importlib.import_module("03_rollout")  # the environment: scenarios, rollout, judges, users, IDR
HERE = Path(__file__).resolve().parent
PRESETS = HERE / "presets"  # cpu.yaml, demo.yaml, gpu.yaml: the budgets --preset picks
positive_int = options.number(int, low=1)  # a flag's type: a value below 1 exits 2 with one line naming the flag


# ---------------------------------------------------------------------------------------------
# The options: the algorithm's first, then the budget of a step and of a run, then the log. --help lists
# them in this order, then CARE's graders (01), the environment (03), the model, the endpoints, the run.
# ---------------------------------------------------------------------------------------------
@dataclass
class Args:
    """04_mica_train.py: the algorithm, the budget, the log."""

    advantage: str = options.option(
        "mica",
        "the advantage estimator, a name in ADVANTAGES (mica, grpo, reinforce_pp, or one a fork adds), or "
        "module:function for an estimator of your own (module.py in the folder you run from, or on PYTHONPATH)",
    )
    alpha: float = options.option(0.4, "MICA's weight of the turn-level advantage", type=options.number(low=0, high=1))
    gamma: float = options.option(
        0.85,
        "discount of the per-turn returns G_t (MICA's turn-level term, REINFORCE++); GRPO ignores it: it sums each "
        "dialogue's rewards undiscounted",
        type=options.number(low=0, high=1),
    )
    reward: str = options.option(
        "idr",
        "the per-turn reward, a name in REWARDS, or a weighted sum such as idr+0.5*care: idr (MICA's incremental "
        "distance), rlver (the simulated user's emotion change / 100; its dialogues end by RLVER's emotion rule), "
        "care (CARE's adaptive rubric), kardia (Kardia-R1's fixed rubric, + its format term with --kardia-format)",
    )
    lr: float = options.option(1e-3, "peak learning rate (AdamW; LoRA on SmolLM2)", type=options.number(above=0))
    minibatch_size: int = options.option(
        8,
        "dialogues per optimizer step (data-parallel: in all); the cpu preset's 8 of 16 dialogues a rollout and "
        "the gpu preset's 32 of 64 give 2 optimizer steps a rollout, MICA's proportion",
        type=positive_int,
    )
    update_epochs: int = options.option(
        1, "passes of the clipped update over each rollout's dialogues", type=positive_int
    )
    kl_coef: float = options.option(0.0, "beta of the k3 KL to the base model (0 = off)", type=options.number(low=0))
    tis_cap: float | None = options.option(
        None,
        "C of the truncated importance weight w_i = min(pi_old(y_i) / pi_sampler(y_i), C) on each token's clipped "
        "term (0 = off); default 2 with --engine (verl's rollout_is_threshold, TRL's first cap), off without it",
        type=options.number(low=0),
    )
    cut_off_penalty: float = options.option(
        0.5,
        "a reply cut off at --max-new-tokens loses this many of its reward's units; a unit is what a turn judged "
        "good on every count earns (idr: sqrt(w_C + w_A + w_P); rlver: 0.1; care and kardia: 1)",
    )
    idr_weights: list = options.option(
        [1.0, 1.0, 1.0],
        "w = (w_C, w_A, w_P) of the hinge distance",
        nargs=3,
        type=options.number(low=0),
        metavar=("W_C", "W_A", "W_P"),
    )
    care_distance: str = options.option(
        "weighted",
        "with idr+care: weight turn t's distance by 3 w_t of its rubric (this project's design; the rewards then "
        "do not telescope), or plain MICA IDR",
        choices=["weighted", "plain"],
    )
    steps: int = options.option(20, "training steps (rollout + update)", type=positive_int)
    scenarios_per_step: int = options.option(
        4, "scenarios per step, each rolled out K times (data-parallel: in all, shared out)", type=positive_int
    )
    micro_batch_size: int = options.option(
        2, "dialogues per forward/backward, per process (the gradient accumulates up to a minibatch)", type=positive_int
    )
    preset: str = options.option(
        "auto",
        "the budget to start from, presets/<name>.yaml: cpu (the defaults here), demo (make demo), gpu (one GPU: "
        "MICA's proportions, --judge self --user self); auto = gpu with CUDA, else cpu; --config and flags win",
        choices=["auto", *sorted(f.stem for f in PRESETS.glob("*.yaml"))],
    )
    log_kl_every: int = options.option(
        5,
        "with --kl-coef 0, log the KL to the base every N steps (0 = never): one more forward with the adapter "
        "off, no gradient, against the update's own log-probabilities, so minibatches after the first see the "
        "policy as it moves",
        type=options.number(int, low=0),
    )
    credit_steps: list = options.option(
        [],
        "the steps whose credit picture credit_step<N>.png is drawn (default: the first and the last)",
        nargs="+",
        type=positive_int,
    )
    save_every: int = options.option(10, "write <run>/checkpoint.pt every N steps (and at the last)", type=positive_int)
    report_to: str = options.option(
        "none",
        "also log every step's metrics and the configuration through accelerate's tracker (tensorboard writes "
        "<run>/tensorboard/; wandb and trackio need their package installed)",
        choices=["none", "tensorboard", "wandb", "trackio"],
    )
    resume: str | None = options.option(None, "a run folder: continue from its last checkpoint")


CLIP_LOW, CLIP_HIGH = 0.2, 0.28  # the ratio's clip [1 - eps_low, 1 + eps_high] (DAPO's clip-higher, as MICA's code)
MAX_GRAD_NORM, WEIGHT_DECAY = 1.0, 0.1  # gradient clipping; AdamW's weight decay


# ---------------------------------------------------------------------------------------------
# The equations: returns, then the advantage estimators, registered by name:
#   ADVANTAGES[name](rewards, dialogues, args) -> (A, A_terms)
#   rewards[s][k][t]  the step's per-turn rewards: scenario group s, its dialogue k, turn t (lengths differ)
#   dialogues[s][k]   that dialogue (03's Trajectory): its states P_0..P_T, the judge's levels, dE_t, the
#                     scenario, the tokens of each reply (spans); the built-in estimators read rewards only
#   A[s][k][t]        the advantage of each turn's reply, the same shape as rewards
#   A_terms           {name: [s][k][t]}: the parts of A worth seeing (MICA: A_turn, A_group); rollouts.jsonl
#                     keeps them per turn and plots.credit draws them
# ---------------------------------------------------------------------------------------------
def discounted_returns(r, gamma) -> list[float]:
    # G_t = sum_{j >= t} gamma^(j - t) r_j, computed backwards: G_t = r_t + gamma * G_{t+1}
    G, running = [0.0] * len(r), 0.0
    for t in reversed(range(len(r))):
        running = r[t] + gamma * running
        G[t] = running
    return G


def turn_level_advantages(rewards, gamma) -> list[list[float]]:
    """rewards[k][t] for one scenario's K dialogues (their lengths may differ) -> A_turn[k][t]."""
    K = len(rewards)
    G = [discounted_returns(rewards[k], gamma) for k in range(K)]
    # A_turn[k][t] = (G[k][t] - mean_t) / (std_t + 1e-6) over the N_t dialogues k that reached turn t,
    # std_t = sqrt( (1/N_t) sum_k (G[k][t] - mean_t)^2 ): the population std, as MICA's Eq. 2 writes it
    A_turn = [[0.0] * len(rewards[k]) for k in range(K)]
    for t in range(max((len(r) for r in rewards), default=0)):
        reached = [k for k in range(K) if len(rewards[k]) > t]
        if len(reached) < 2:
            continue  # fewer than 2 dialogues reached turn t: A_turn = 0
        mean_t, std_t = common.mean_std([G[k][t] for k in reached], ddof=0)
        for k in reached:
            A_turn[k][t] = (G[k][t] - mean_t) / (std_t + 1e-6)
    return A_turn


def group_level_advantages(rewards) -> list[list[float]]:
    """rewards[k][t] for one scenario's K dialogues -> A_group[k][t]."""
    # A_group[k][t] = (r[k][t] - mean) / (std + 1e-6) over all sum_k T_k rewards (the population std)
    A_group = [[0.0] * len(r) for r in rewards]
    flat = [x for r in rewards for x in r]
    if len(flat) >= 2:
        mean, std = common.mean_std(flat, ddof=0)
        for k in range(len(rewards)):
            for t in range(len(rewards[k])):
                A_group[k][t] = (rewards[k][t] - mean) / (std + 1e-6)
    return A_group


def mica_advantages(rewards, dialogues, args) -> tuple[list, dict]:
    """MICA: per scenario group, the turn-level and the group-level advantage, mixed by alpha."""
    A, A_turn_all, A_group_all = [], [], []
    for group in rewards:
        A_turn, A_group = turn_level_advantages(group, args.gamma), group_level_advantages(group)
        # A[k][t] = alpha * A_turn[k][t] + (1 - alpha) * A_group[k][t]
        A.append(
            [
                [args.alpha * A_turn[k][t] + (1 - args.alpha) * A_group[k][t] for t in range(len(group[k]))]
                for k in range(len(group))
            ]
        )
        A_turn_all.append(A_turn)
        A_group_all.append(A_group)
    return A, {"A_turn": A_turn_all, "A_group": A_group_all}


def grpo_advantages(rewards, dialogues, args) -> tuple[list, dict]:
    """GRPO: per scenario group, the normalised outcome of each dialogue, the same on every turn."""
    A = []
    for group in rewards:
        # R_k = sum_t r[k][t];  A_k = (R_k - mean_K) / (std_K + 1e-6);  0 when K < 2
        # (the sample std, ddof = 1, as TRL's and verl's GRPO compute it)
        R = [sum(r) for r in group]
        if len(R) < 2:
            A.append([[0.0] * len(r) for r in group])
            continue
        mean, std = common.mean_std(R, ddof=1)
        A.append([[(R[k] - mean) / (std + 1e-6)] * len(group[k]) for k in range(len(group))])
    return A, {}


def reinforce_pp_advantages(rewards, dialogues, args) -> tuple[list, dict]:
    """REINFORCE++: the returns whitened over the whole batch, with no groups."""
    # G_t per dialogue, then A = (G - mean) / (std + 1e-6) over every turn of every dialogue of the batch
    # (the sample std, ddof = 1)
    G = [[discounted_returns(r, args.gamma) for r in group] for group in rewards]
    flat = [x for group in G for g in group for x in g]
    if len(flat) < 2:
        return [[[0.0] * len(g) for g in group] for group in G], {}
    mean, std = common.mean_std(flat, ddof=1)
    return [[[(x - mean) / (std + 1e-6) for x in g] for g in group] for group in G], {}


ADVANTAGES = {"mica": mica_advantages, "grpo": grpo_advantages, "reinforce_pp": reinforce_pp_advantages}


# ---------------------------------------------------------------------------------------------
# The rewards, registered by name: REWARDS[name] = Reward(score, unit)
#   score(trajs, args, graders) -> r[i][t] for every dialogue i and turn t, unweighted; care and kardia give NaN
#                                  where their criteria judge failed, idr and rlver never do (an EMPA judge failure
#                                  is tr.judge_failed); --reward idr+0.5*rlver weights and sums the parts
#   unit                           the cut-off penalty's unit in this reward (a number, or a function of the options)
# The cut-off unit follows two rules, not one. For rlver, care and kardia it is the most one turn can earn:
# rlver's largest one-turn rise of the emotion, 10 of 100 (0.1); full marks on every criterion (1; kardia's
# format term is then 0). idr's most depends on the state (a turn lowers d by at most d(P_{t-1}); far from the
# goal, a level-2 turn on every axis lowers it by 3 sqrt 3), so its unit is a level-1 turn on every axis far
# from the goal, sqrt(w_C + w_A + w_P): a good turn, not the best. idr's most would triple its penalty and change
# every idr run's numbers (docs/reference.md section 2).
# care and kardia score in 01, beside the criteria judge they call.
# ---------------------------------------------------------------------------------------------
def rubric_weighted_distance(args) -> bool:
    """Whether idr's distance is weighted by CARE's rubric (idr+care, --care-distance weighted): decided here
    only, for the reward (idr_rewards) and its unit (idr_unit)."""
    return "care" in args.reward_weights and args.care_distance == "weighted"


def idr_rewards(trajs, args, graders) -> list[list[float]]:
    """MICA's incremental distance reward, from 03's hinge distance."""
    r = []
    for tr in trajs:
        w = args.idr_weights
        if rubric_weighted_distance(args):  # 01's write_rubrics wrote tr.extra["rubrics"] first
            # with CARE the rubric's weights weight the distance (in place of --idr-weights), scaled so that
            # uniform ones give MICA's (1, 1, 1): w_t = 3 (w_C,t, w_A,t, w_P,t). This project's design, not a
            # paper's: d_t changes every turn, so the rewards no longer sum to d(P0) - d(P_T)
            w = [[3 * rb["weights"][d] for d in sft.DIMS] for rb in tr.extra["rubrics"]]
        # r_t = d(P_{t-1}) - d(P_t)
        r.append(env.incremental_distance_rewards(tr.states, w, env.EPS))
    return r


def idr_unit(args) -> float:
    """A level-1 turn (a point of progress) on every axis, far from the goal and with the three deficits equal,
    lowers d by sqrt(w_C + w_A + w_P): sqrt 3 with MICA's weights, and with idr+care's weighted distance (its
    3 w_t sum to 3)."""
    return math.sqrt(3.0 if rubric_weighted_distance(args) else sum(args.idr_weights))


def rlver_emotion_rewards(emotions) -> list[float]:
    """emotions = [e_0, ..., e_T] kept by the simulated user -> [r_1, ..., r_T]."""
    # RLVER: r_t = (e_t - e_{t-1}) / 100. The sum is (e_T - e_0)/100, so GRPO on it (before the cut-off penalty)
    # ranks a group exactly as RLVER's outcome reward e_T/100 does (e_0 is the same for every k)
    return [(emotions[t] - emotions[t - 1]) / 100 for t in range(1, len(emotions))]


def rlver_rewards(trajs, args, graders) -> list[list[float]]:
    """RLVER's emotion reward, paid per turn as the simulated user's emotion change."""
    return [rlver_emotion_rewards(tr.emotions) for tr in trajs]


class Reward(NamedTuple):
    score: Callable  # (trajs, args, graders) -> r[i][t]
    unit: float | Callable  # what a turn judged good on every count earns in this reward, or unit(args)


REWARDS = {
    "idr": Reward(idr_rewards, idr_unit),
    "rlver": Reward(rlver_rewards, 0.1),  # the emotion's largest rise in one turn: 10 of 100
    "care": Reward(sft.care_rewards, 1.0),  # S(y) with full marks on every criterion
    "kardia": Reward(sft.kardia_rewards, 1.0),  # full marks on the five criteria, the format term 0
}


def cut_off_penalty(args) -> float:
    # penalty = lambda_cut * sum_c |weight_c| * unit_c   (lambda_cut = --cut-off-penalty)
    penalty = 0.0
    for name, weight in args.reward_weights.items():
        unit = REWARDS[name].unit
        penalty += abs(weight) * (unit(args) if callable(unit) else unit)
    return args.cut_off_penalty * penalty


def turn_rewards(parts: dict[str, list[float]], tr, args) -> tuple[list[float], list[bool]]:
    """One dialogue's training reward per turn from its --reward parts ({name: r_t}), and which turns failed:
    the EMPA judge failed (no state change) or a criteria judge did (a NaN part). A failed turn's reward is
    the mean of the dialogue's valid rewards (0 when none is valid), taken before the cut-off penalty. Then
    every cut-off turn pays the penalty, a failed one too. A failed turn counts in the returns and the group
    statistics only: the loss leaves it out."""
    # r_t = sum_c weight_c * r_c,t, the failed turns filled, then r_t -= penalty * 1[reply t was cut off]
    r = [0.0] * tr.T
    for name, part in parts.items():
        r = [x + args.reward_weights[name] * y for x, y in zip(r, part)]
    failed = [tr.judge_failed[t] or not all(math.isfinite(part[t]) for part in parts.values()) for t in range(tr.T)]
    valid = [x for x, f in zip(r, failed) if not f]
    fill = sum(valid) / len(valid) if valid else 0.0
    penalty = cut_off_penalty(args)
    return [(fill if f else x) - penalty * cut for x, f, cut in zip(r, failed, tr.cut_off)], failed


# ---------------------------------------------------------------------------------------------
# The loss: the clipped surrogate and the k3 KL, per token
# ---------------------------------------------------------------------------------------------
def clipped_surrogate(logp, logp_old, A, clip_low, clip_high):
    """Per token: the loss max(-ratio A, -clip(ratio, 1 - clip_low, 1 + clip_high) A), whether the clip
    chose it, the ratio."""
    # ratio_i = exp(log pi(y_i) - log pi_old(y_i))
    ratio = torch.exp(logp - logp_old)
    unclipped = -ratio * A
    clipped = -torch.clamp(ratio, 1 - clip_low, 1 + clip_high) * A
    return torch.maximum(unclipped, clipped), (clipped > unclipped).float(), ratio.detach()


def tis_weights(logp_old, logp_sampler, cap):
    """Per token: the truncated importance weight of the sampler's draw, and whether the cap chose it. The loss
    scores pi_old; an engine (or a bf16 or 4-bit sampler) drew from pi_sampler, a little off it: each token's
    clipped term is reweighted towards pi_old, and the weight capped so that one token cannot dominate."""
    # w_i = min(exp(log pi_old(y_i) - log pi_sampler(y_i)), C)   (no gradient: pi_old and the sampler are data)
    w = torch.exp(logp_old.detach() - logp_sampler)
    return torch.clamp(w, max=cap), (w > cap).float()


def k3_kl(logp, logp_ref):
    # KL(pi || ref) per token, the k3 estimator: exp(ref - logp) - (ref - logp) - 1  (>= 0)
    d = logp_ref - logp
    return torch.exp(d) - d - 1


# ---------------------------------------------------------------------------------------------
# The update: clipped policy-gradient steps on the reply tokens (no critic: the advantages come from above)
# ---------------------------------------------------------------------------------------------
@dataclass
class Sample:
    """One dialogue for the update: its token ids, each reply's [start, end), each reply's advantage A[k][t]
    (None: a failed turn, left out of the loss), and each reply token's log-probability as it was sampled."""

    ids: list[int]
    spans: list[tuple[int, int]]
    advantages: list[float | None]
    logp_sampler: list[list[float]]  # per reply, log pi_sampler(y_i) of each of its tokens as they were drawn

    def scored(self) -> list[tuple[int, int]]:
        return [span for span, a in zip(self.spans, self.advantages) if a is not None]

    def n_tokens(self) -> int:
        return sum(end - start for start, end in self.scored())

    def token_advantages(self) -> torch.Tensor:
        # A_i = A[k][t] for every token i of reply t (flat, in the order token_logprobs gives them)
        advantages = torch.tensor([a for a in self.advantages if a is not None], dtype=torch.float32)
        lengths = torch.tensor([end - start for start, end in self.scored()], dtype=torch.long)
        return torch.repeat_interleave(advantages, lengths)

    def sampler_logprobs(self) -> torch.Tensor:
        # log pi_sampler(y_i) for every token i of the scored replies (flat, in token_logprobs' order)
        return torch.tensor([x for lp, a in zip(self.logp_sampler, self.advantages) if a is not None for x in lp])


def as_samples(trajs, advantages=None, failed=None) -> list[Sample]:
    """Dialogues as the update's samples: each reply's span with its turn's advantage A[k][t], None (left out
    of the loss) on a failed turn (default: where the EMPA judge failed); advantages None gives every turn 0."""
    advantages = advantages if advantages is not None else [[0.0] * tr.T for tr in trajs]
    failed = failed if failed is not None else [tr.judge_failed for tr in trajs]
    return [
        Sample(tr.ids, tr.spans, [None if f else a for f, a in zip(F, A)], tr.sampler_logprobs)
        for tr, A, F in zip(trajs, advantages, failed)
    ]


def micro_batches(samples: list[Sample], minibatch: list[int], size: int) -> list[list[int]]:
    """A minibatch's micro-batches, its dialogues sorted by length (less padding; the step is the same)."""
    minibatch = sorted(minibatch, key=lambda i: len(samples[i].ids))
    return [minibatch[j : j + size] for j in range(0, len(minibatch), size)]


def collate(samples: list[Sample], pad_id, device):
    """Right-padded ids, the attention mask and the loss mask: the tokens of every reply with an advantage."""
    return sampling.right_pad([s.ids for s in samples], pad_id, [s.scored() for s in samples], device)


@torch.no_grad()
def old_and_ref_logprobs(model, tokenizer, samples, minibatches, args, need_ref: bool) -> tuple[dict, dict]:
    """log pi_old(y_i), the policy before this rollout's first optimizer step, for every minibatch that is scored
    after a step has moved the policy: with one epoch, every minibatch but the first (the first is scored before
    any step, so the update's own forward, detached, is pi_old there and no extra forward is spent); with more
    epochs, every minibatch. And the reference (the base, the adapter off) once per rollout when the KL is used
    or logged. Taken in train mode, the same forward as the update's own log-probabilities: load_policy zeroes
    every dropout of a trainable policy, so train mode adds no noise."""
    device, old_from = next(model.parameters()).device, 1 if args.update_epochs == 1 else 0
    old, ref = {}, {}
    model.train()
    for n, minibatch in enumerate(minibatches):
        if n < old_from and not need_ref:
            continue
        for micro in micro_batches(samples, minibatch, args.micro_batch_size):
            ids, attn, mask = collate([samples[i] for i in micro], tokenizer.pad_token_id, device)
            sizes = [samples[i].n_tokens() for i in micro]
            if n >= old_from:
                old.update(zip(micro, sampling.token_logprobs(model, ids, attn, mask, args.temperature).split(sizes)))
            if need_ref:
                with common.adapters_off(model):
                    logp = sampling.token_logprobs(model, ids, attn, mask, args.temperature)
                ref.update(zip(micro, logp.split(sizes)))
    return old, ref


def policy_update(model, tokenizer, optimizer, scheduler, samples, args, accelerator, log_kl=False) -> dict:
    """--update-epochs passes over the minibatches, each one optimizer step with its
    gradient accumulated over micro-batches and the loss a mean over the minibatch's scored tokens; then one
    scheduler step, always. pi_old and the reference are taken once, before the first step. Returns the
    update's statistics (the loss, the clip fraction, the ratio's range, the KL, the sampler gap, ...).
    Data-parallel: each process holds its part of every minibatch; N, the gradient and the logged sums are
    summed over the processes, so each takes the step that one process would take on all the dialogues."""
    device, params = next(model.parameters()).device, [p for p in model.parameters() if p.requires_grad]
    # the minibatches: the samples in the step's seeded order (scenario by scenario, K each) cut every
    # --minibatch-size dialogues, a multiple of K, so each holds whole scenarios (as MICA's verl launch splits a
    # batch); data-parallel, each process cuts its own samples into its share, size / N. A dialogue with nothing
    # to score is left out.
    size = args.minibatch_size // accelerator.num_processes
    minibatches = []
    for start in range(0, len(samples), size):
        minibatches.append([i for i in range(start, min(start + size, len(samples))) if samples[i].n_tokens() > 0])
    minibatches = parallel.as_many_minibatches(accelerator, minibatches)
    A_tok = {i: samples[i].token_advantages() for minibatch in minibatches for i in minibatch}
    need_ref = args.kl_coef > 0 or log_kl
    old, ref = old_and_ref_logprobs(model, tokenizer, samples, minibatches, args, need_ref)
    model.train()
    stats = runs.UpdateStats(device)  # the loss, the clip fraction, the ratio's range, the KL, the sampler gap
    # every epoch takes the minibatches in the same order, split once above (CleanRL's ppo.py reshuffles each
    # epoch): a minibatch holds whole scenarios, in the step's seeded order, and a reshuffle would change the
    # numbers of every multi-epoch run (docs/training.md, docs/reference.md "Known departures" 15)
    for epoch in range(args.update_epochs):
        for minibatch in minibatches:
            # N: the minibatch's scored reply tokens (over every process); 0: every turn in it failed, no step
            n_tokens = torch.tensor(sum(samples[i].n_tokens() for i in minibatch))
            N = int(parallel.sum_over_processes(accelerator, [n_tokens])[0])
            if N == 0:
                continue
            optimizer.zero_grad(set_to_none=True)
            stats.minibatch()
            for micro in micro_batches(samples, minibatch, args.micro_batch_size):
                ids, attn, mask = collate([samples[i] for i in micro], tokenizer.pad_token_id, device)
                logp = sampling.token_logprobs(model, ids, attn, mask, args.temperature)
                A = torch.cat([A_tok[i] for i in micro]).to(device)
                logp_old = torch.cat([old[i] for i in micro]) if micro[0] in old else logp.detach()
                logp_sampler = torch.cat([samples[i].sampler_logprobs() for i in micro]).to(device)
                # L = (1/N) sum_i w_i max(-ratio_i A_i, -clip(ratio_i) A_i)  [+ beta (1/N) sum_i k3_i], w_i = 1 with
                # --tis-cap 0
                pg, was_clipped, ratio = clipped_surrogate(logp, logp_old, A, CLIP_LOW, CLIP_HIGH)
                w, capped = tis_weights(logp_old, logp_sampler, args.tis_cap) if args.tis_cap > 0 else (None, None)
                if w is not None:
                    pg = w * pg
                loss_sum = pg.sum()
                kl = k3_kl(logp, torch.cat([ref[i] for i in micro])) if ref else None
                if kl is not None and args.kl_coef > 0:
                    loss_sum = loss_sum + args.kl_coef * kl.sum()
                (loss_sum / N).backward()
                stats.micro_batch(epoch, loss_sum, N, was_clipped, ratio, logp_old, logp_sampler, kl, w, capped)
            # the minibatch's gradient, summed over the processes (one process: as it is), clipped, one step
            grads = [torch.zeros_like(p) if p.grad is None else p.grad for p in params]
            for p, g in zip(params, parallel.sum_over_processes(accelerator, grads)):
                p.grad = g
            grad_norm = float(torch.nn.utils.clip_grad_norm_(params, MAX_GRAD_NORM))
            if math.isfinite(grad_norm):
                optimizer.step()
            else:  # a non-finite gradient is skipped, and counted
                optimizer.zero_grad(set_to_none=True)
            stats.optimizer_step(grad_norm)
    # the schedule follows the training steps, a step with nothing scored (no optimizer step) too: torch's warning
    # that the schedule stepped first says nothing a user can act on
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Detected call of `lr_scheduler.step\\(\\)` before", UserWarning)
        scheduler.step()
    return stats.result(accelerator, args.update_epochs, need_ref, args.tis_cap > 0)


# ---------------------------------------------------------------------------------------------
# The loop's helpers: the step's scenarios, its rewards, its record
# ---------------------------------------------------------------------------------------------
@dataclass
class Run:
    """What the loop works with, made once by main."""

    args: argparse.Namespace
    accelerator: Accelerator  # the processes (one, or `accelerate launch`'s N)
    dir: Path  # the run folder
    scenarios: list[dict]
    model: torch.nn.Module  # the policy: the base with its LoRA adapter
    tokenizer: object
    judge: object  # 03's judge: EMPA levels per reply
    user: object  # 03's simulated user
    graders: sft.Graders  # CARE's rubric generator and the criteria judge, for --reward care and kardia
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    log: runs.StepLog  # the step's record: rollouts.jsonl and the metrics line (process 0 writes)
    engine: engine.Engine | None = None  # --engine: the server that samples the policy (and judges, and plays the user)


def step_scenarios(run: Run, step: int) -> list[dict]:
    """This step's scenarios (this process's share of them), and the step's seeds: every step's randomness
    depends on (seed, step), and on the process (each samples its own dialogues). Every user takes the step's
    seed (the scripted user draws its lines from it; a local LLM user samples from torch's generator, seeded here;
    an endpoint's judge and user, the engine's too, from seeds their requests carry, made from it)."""
    args, accelerator = run.args, run.accelerator
    step_seed = args.seed * 100_003 + step
    torch.manual_seed(step_seed * accelerator.num_processes + accelerator.process_index)
    run.user.seed = run.judge.seed = step_seed  # an LLM judge's and user's requests to an endpoint carry it
    batch = random.Random(step_seed).sample(run.scenarios, min(args.scenarios_per_step, len(run.scenarios)))
    return batch[accelerator.process_index :: accelerator.num_processes]


def reward_parts(trajs, args, graders) -> tuple[list[dict[str, list[float]]], dict]:
    """Every dialogue's --reward parts per turn, by name, unweighted: [{name: r_t}] (one REWARDS call each),
    and what the step log counts of them. With care, the rubric of every turn is written first (01's
    write_rubrics), and the rubrics that did not parse are counted."""
    counts = {"rubric_invalid": sft.write_rubrics(trajs, graders, args)} if "care" in args.reward_weights else {}
    if args.kardia_format:
        counts["format_ok"] = sum(sum(tr.formatted) for tr in trajs)
    by_name = {name: REWARDS[name].score(trajs, args, graders) for name in args.reward_weights}
    return [{name: by_name[name][i] for name in by_name} for i in range(len(trajs))], counts


def dialogue_record(args, step, tr, parts, r, A, failed, A_terms) -> dict:
    """A rollouts.jsonl line: 03's record of the dialogue with, per turn, the training reward and its parts,
    the return G_t, the advantage A, the estimator's terms (MICA: A_turn and A_group), the failed flag."""
    rec = env.trajectory_record(tr, args, rewards=[round(x, 4) for x in r], step=step)
    G = discounted_returns(r, args.gamma)
    for t, turn in enumerate(rec["turns"]):
        turn["G"] = round(G[t], 4)
        turn["advantage"] = round(A[t], 4)
        turn["terms"] = {name: round(value[t], 4) for name, value in A_terms.items()}
        turn["judge_failed"] = failed[t]
        turn["reward_parts"] = {k: round(v[t], 4) if math.isfinite(v[t]) else None for k, v in parts.items()}
        if "rubrics" in tr.extra:
            turn["rubric"] = tr.extra["rubrics"][t]
    return rec


# ---------------------------------------------------------------------------------------------
# The main loop
# ---------------------------------------------------------------------------------------------
def train_loop(run: Run, start: int):
    args, accelerator = run.args, run.accelerator
    for step in tqdm(
        range(start, args.steps + 1), desc="train", initial=start - 1, total=args.steps, disable=not args.progress
    ):
        timer = runs.PhaseTimer()
        # 0. --engine: the adapter as it is now (after the last update, or as the run starts) goes to the engine,
        #    which samples this step with it: process 0 pushes it, and every process samples from the name it got
        if run.engine is not None:
            with timer("push"):
                name = parallel.on_main_process(accelerator, run.engine.push, run.model, run.dir / "engine")
                run.engine.policy = name
        # 1. rollout: K dialogues for each of this step's scenarios, every live dialogue batched each turn
        with timer("rollout"):
            scenarios = step_scenarios(run, step)
            if run.engine is not None:
                run.engine.sent.clear()  # the names this step's policy requests carry
            trajs = env.rollout(
                run.model, run.tokenizer, scenarios, run.judge, run.user, args, f"step {step} rollout", run.engine
            )
        # 2. rewards: each --reward part by name, then per dialogue the weighted sum, failed turns filled and the
        #    cut-off penalty
        with timer("reward"):
            parts, counts = reward_parts(trajs, args, run.graders)
            rewards, failed = zip(*[turn_rewards(p, tr, args) for p, tr in zip(parts, trajs)])
        # 3. advantages: the --advantage estimator over the step's scenario groups, rewards[s][k][t] and their
        #    dialogues[s][k]
        with timer("advantage"):
            groups = [[i for i, tr in enumerate(trajs) if tr.scenario is s] for s in scenarios]
            # 03 keeps each scenario's own dict in its dialogues: a copy would leave a dialogue in no group
            assert sorted(i for g in groups for i in g) == list(range(len(trajs))), "a dialogue in no group"
            # every process's groups (data-parallel), so that a batch-wide statistic (REINFORCE++'s) sees them all
            all_rewards, all_dialogues, mine = parallel.gather_groups(
                accelerator, [[rewards[i] for i in g] for g in groups], [[trajs[i] for i in g] for g in groups]
            )
            A, A_terms = ADVANTAGES[args.advantage](all_rewards, all_dialogues, args)
            A, A_terms = A[mine], {name: value[mine] for name, value in A_terms.items()}  # this process's groups
        # 4. update: clipped policy-gradient steps on the reply tokens of every turn no judge failed on
        with timer("update"):
            order = [i for g in groups for i in g]  # dialogue by dialogue, scenario by scenario
            samples = as_samples(
                [trajs[i] for i in order], [a for group in A for a in group], [failed[i] for i in order]
            )
            log_kl = args.kl_coef == 0 and args.log_kl_every > 0 and step % args.log_kl_every == 0
            lr = run.optimizer.param_groups[0]["lr"]  # the lr this step uses
            stats = policy_update(
                run.model, run.tokenizer, run.optimizer, run.scheduler, samples, args, accelerator, log_kl
            )
        # 5. log the step: every dialogue with its rewards, G_t, A and the estimator's terms (rollouts.jsonl), and
        #    one metrics line; checkpoint, draw
        records = []
        for s, group in enumerate(groups):
            for k, i in enumerate(group):
                terms = {name: value[s][k] for name, value in A_terms.items()}
                records.append(dialogue_record(args, step, trajs[i], parts[i], rewards[i], A[s][k], failed[i], terms))
        degenerate = sum(all(abs(a) < 1e-9 for a_k in group for a in a_k) for group in A)  # every A of a group 0
        # per process: the model names its policy requests carried with an engine (each the adapter pushed this
        # step), and an LLM judge's and user's largest request (prompt + the tokens it may answer), for the window
        own = {"engine_policy": sorted(run.engine.sent)} if run.engine is not None else {}
        for role, who in (("judge", run.judge), ("user", run.user)):
            if hasattr(who, "backend"):
                own[f"{role}_largest_request"], who.backend.largest = who.backend.largest, 0
        run.log(step, records, rewards, {"degenerate_groups": degenerate, **counts}, stats, lr, timer, own)
        if accelerator.is_main_process and (step % args.save_every == 0 or step == args.steps):
            runs.save_checkpoint(run.dir, step, run.model, run.optimizer, run.scheduler)
            plots.curves(run.dir, plots.MICA_CURVES)
        if accelerator.is_main_process and step in (args.credit_steps or (start, args.steps)):
            plots.credit(run.dir, step)  # how the estimator assigned credit (default: the first and last step)


# ---------------------------------------------------------------------------------------------
# The command line: the options parsed (the preset, then --config, then the flags given), then checked
# ---------------------------------------------------------------------------------------------
def parse_reward_spec(spec: str) -> dict[str, float]:
    """'idr', 'rlver', 'idr+0.5*rlver' -> {component: weight}."""
    out = {}
    for term in spec.replace(" ", "").split("+"):
        weight, _, name = term.rpartition("*")
        common.check(
            name in REWARDS,
            f"--reward: unknown component '{name}' in '{spec}'; choose from {', '.join(REWARDS)} (e.g. idr+0.5*rlver)",
        )
        try:
            out[name] = out.get(name, 0.0) + (float(weight) if weight else 1.0)
        except ValueError:
            raise common.UserError(f"--reward: '{weight}' in '{term}' is not a number") from None
    return out


def imported_estimator(spec: str):
    """--advantage module:function -> that function (an estimator with ADVANTAGES' signature), or one line. The
    module is looked for on sys.path and, last, in the folder the command runs from (as `python -m` finds one)."""
    module, _, function = spec.partition(":")
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    try:
        fn = getattr(importlib.import_module(module), function)
    except (ImportError, AttributeError) as e:
        raise common.UserError(f"--advantage {spec}: cannot import it ({type(e).__name__}: {e})") from None
    common.check(callable(fn), f"--advantage {spec}: not a function")
    return fn


def check_args(args):
    """What a flag's type cannot see (one message naming the flag, exit 2), and the reward spec parsed."""
    env.check_env_args(args)
    c = common.check
    if ":" in args.advantage and args.advantage not in ADVANTAGES:  # module:function, registered under that name
        ADVANTAGES[args.advantage] = imported_estimator(args.advantage)
    c(
        args.advantage in ADVANTAGES,
        f"--advantage: unknown estimator '{args.advantage}'; choose from {', '.join(ADVANTAGES)}",
    )
    c(args.k >= 2, f"--k must be >= 2: the estimators compare a scenario's K dialogues with each other, got {args.k}")
    # the loss scores a token by the full softmax at --temperature: a nucleus or greedy sampler is not that policy
    c(args.top_p == 1, f"--top-p must be 1 for training (the loss scores the whole distribution), got {args.top_p}")
    c(args.temperature > 0, "--temperature must be > 0 for training: at 0 all K dialogues of a scenario are the same")
    c(all(x <= args.steps for x in args.credit_steps), f"--credit-steps must lie in 1..--steps {args.steps}")
    args.reward_weights = parse_reward_spec(args.reward)
    c(
        "care" not in args.reward_weights or args.rubric == "uniform" or args.rubric_model,
        f"--reward {args.reward} with --rubric {args.rubric} needs --rubric-model (a 02_rubric_pref_rl.py adapter)",
    )
    args.emotion_ends = args.emotion_ends or "rlver" in args.reward_weights  # RLVER's end rule, for every part
    if args.tis_cap is None:  # on with an engine: its sampler is not the learner's (another kernel, dtype)
        args.tis_cap = 2.0 if args.engine else 0.0
    return args


def parse_args(argv=None):
    """Every option of 04, parsed from its dataclasses: the field defaults, under the preset's YAML file (auto:
    gpu with CUDA, else cpu), under --config's file, under the flags given; then what a flag's type cannot
    check."""
    p = options.options_parser(
        __doc__.split("\n")[0],
        [
            (Args.__doc__, Args),
            ("CARE's graders (01; --reward care)", sft.GraderOptions),
            ("environment (03)", env.EnvOptions),
            ("model", options.ModelOptions),
            ("LLM endpoints (api: backends)", backends.EndpointOptions),
            ("inference engine (engine.py)", engine.EngineOptions),
            ("run", runs.RunOptions),
        ],
    )
    p.set_defaults(scenarios=str(HERE / "data" / "scenarios_train.jsonl"), run_name="mica")
    return check_args(runs.parse_with_preset(p, argv, PRESETS))


# ---------------------------------------------------------------------------------------------
# The entry point: parse, load, loop, save
# ---------------------------------------------------------------------------------------------
def load(args) -> tuple[Run, int]:
    """The processes, the models (policy, judge, user, graders), the run folder, the optimizer, the checkpoint
    to resume -> the Run and the first step."""
    set_seed(args.seed)  # every process alike: the same LoRA initialisation
    scenarios = env.load_scenarios(args.scenarios)  # inputs checked before anything is created
    common.check_model_args(args)
    # one process, or each of `accelerate launch --num_processes N`'s: NCCL on GPUs, gloo on CPUs (cpu=True)
    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    parallel.check_processes(args, accelerator, len(scenarios))
    args.progress = args.progress and accelerator.is_main_process  # one progress bar, one log: process 0's
    server = engine.connect(args)  # --engine: up and serving --model, or one line before any model loads
    model, tokenizer = common.load_policy(args, trainable=True)  # every model loads before the run folder
    judge = env.make_judge(args, (model, tokenizer), server)
    user = env.make_user(args, (model, tokenizer), server)
    graders = sft.load_graders(args, (model, tokenizer), args.reward_weights, server)
    run_dir = runs.open_run(args, ("metrics.jsonl", "rollouts.jsonl")) if accelerator.is_main_process else None
    run_dir = Path(parallel.gather_over_processes(accelerator, str(run_dir))[0])  # process 0 made (or checked) it
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer, scheduler = common.make_optimizer(params, args.lr, WEIGHT_DECAY, args.steps)
    state = runs.load_checkpoint(run_dir, model, optimizer, scheduler) if args.resume else None
    start = state["step"] + 1 if state else 1  # every process loads the same checkpoint
    logger = (
        runs.MetricsLogger(run_dir, args.report_to, runs.public_args(args)) if accelerator.is_main_process else None
    )
    log = runs.StepLog(accelerator, run_dir, logger, lambda: backends.api_counts(judge, user))
    if accelerator.is_main_process:
        print(runs.header_line(args, run_dir, params, accelerator, start if state else None))
    run = Run(
        args,
        accelerator,
        run_dir,
        scenarios,
        model,
        tokenizer,
        judge,
        user,
        graders,
        optimizer,
        scheduler,
        log,
        server,
    )
    return run, start


def save(run: Run):
    """The final adapter (standard peft: 05_eval.py --adapters takes it), the tracker closed, the curves."""
    if run.accelerator.is_main_process:
        run.model.save_pretrained(run.dir / "adapter", safe_serialization=True)
        run.tokenizer.save_pretrained(run.dir / "adapter")
        run.log.logger.finish()
        print(
            f"final adapter: {run.dir / 'adapter'} (05_eval.py --adapters takes it); curves: "
            f"{plots.curves(run.dir, plots.MICA_CURVES)}"
        )
    run.accelerator.end_training()


def main(argv=None):
    args = parse_args(argv)
    run, start = load(args)
    try:
        train_loop(run, start)
    except common.UserError:  # the judge's endpoint went down, say: keep what was learned, then stop
        runs.checkpoint_on_error(run.dir, run.model, run.optimizer, run.scheduler, run.log.logger, start)
        raise
    finally:
        if run.engine is not None and run.accelerator.is_main_process:
            run.engine.close()  # the run's adapter unloaded from the server, at the end or on a stop
    save(run)


if __name__ == "__main__":
    common.run_main(main)

"""04_mica_train.py: MICA, online multi-turn RL of a support policy (LoRA) against a simulated user.

What it does
  Each step samples scenarios, rolls out K dialogues per scenario in 03's environment, turns the judge's
  verdicts into per-turn rewards, assigns credit with MICA's mixed turn-level / group-level advantage (or
  GRPO's, or REINFORCE++'s), and takes clipped policy-gradient steps on the tokens of every reply.

Imports 03_rollout (the environment: scenarios, the batched rollout, judges, users, IDR) and 01_rubric_sft
        (CARE's three dimensions; for --reward care and kardia the rubric format and parser, rubric
        generation, the criteria judge).
Reads   data/scenarios_train.jsonl (or --scenarios), the policy (--model, default the packaged
        SmolLM2-135M-Instruct), the judge and the user (03's flags), --rubric-model (02's adapter).
Writes  runs/<name>-<time>/: args.json (every flag), metrics.jsonl (a line per step, also printed),
        rollouts.jsonl (every dialogue with its rewards, advantages and the estimator's terms), checkpoint.pt
        (adapter, optimizer, scheduler, step; atomic), adapter/ (the final LoRA adapter, standard peft),
        curves.png (redrawn at each checkpoint), credit_step<N>.png (this run's first and last step, or
        --credit-steps: how the estimator assigned credit, from rollouts.jsonl; plots.credit(run_dir, step)
        redraws any logged step later); with --report-to tensorboard also tensorboard/ (wandb, trackio: theirs).
        05_eval.py --suite empa --adapters <run>/adapter compares it with the base on held-out scenarios.

Equations (MICA; docs/reference.md section 2; each one is a loop below)
  rewards r_t, by --reward (a sum such as idr+0.5*rlver weights its parts):
    idr     r_t = d(P_{t-1}) - d(P_t),  d(P) = sqrt( sum_a w_a max(0, -eps - P_a)^2 )   (MICA; 03's distance)
    rlver   r_t = (e_t - e_{t-1}) / 100, e the simulated user's emotion; dialogues then end at e >= 100
            or e < 10 (RLVER)
    care    r_t = S(y_t) = sum_d w_d,t (1/|C_d,t|) sum_{c in C_d,t} s(y_t, c): the frozen generator (02's
            adapter) writes turn t's rubric, the judge scores the reply on each criterion (CARE); with
            idr+care the distance also weights turn t by w_t = 3 (w_C,t, w_A,t, w_P,t) (this project's design)
    kardia  r_t = (1/5) sum_c s_c,t over emotion accuracy, empathy, relevance, persona consistency and safety,
            + r_fmt (0 with the four <understanding><reasoning><emotion><response> sections, -1 without;
            with --kardia-format) (Kardia-R1's Rubric-as-Judge)
    cut-off r_t -= lambda_cut * (the reward's unit: cut_off_scale) when reply t was cut off at the token cap
  return        G_t = sum_{j >= t} gamma^(j - t) r_j                         (within one dialogue)
  turn-level    A_turn[k][t] = (G[k][t] - mean_t) / (std_t + 1e-6)    over the k that reached turn t
  group-level   A_group[k][t] = (r[k][t] - mean) / (std + 1e-6)        over all sum_k T_k rewards
  MICA          A[k][t] = alpha A_turn[k][t] + (1 - alpha) A_group[k][t]   (both stds population, Eq. 2)
  GRPO          R_k = sum_t r[k][t];  A[k][t] = (R_k - mean_K) / (std_K + 1e-6) on every turn (sample std)
  REINFORCE++   A = (G - mean) / (std + 1e-6) over every turn of every dialogue of the batch (sample std)
  loss          ratio_i = exp(log pi(y_i) - log pi_old(y_i)) for every token i of every scored reply (no judge
                failed on its turn), A_i = A[k][t(i)]
                L = (1/N) sum_i max(-ratio_i A_i, -clip(ratio_i, 1 - eps_low, 1 + eps_high) A_i)
                    + beta (1/N) sum_i [exp(ref_i - logp_i) - (ref_i - logp_i) - 1]   (k3 KL to the base,
                    the adapter off; beta = --kl-coef, 0 as in MICA); N = the minibatch's scored tokens

Departures from the paper (and why)
  1. LoRA instead of full fine-tuning, so lr 1e-3 instead of 1e-6: a fresh adapter needs a larger step (at
     1e-4, 20 steps moved SmolLM2 by a KL of 0.008 and it did not learn; docs/results.md). With CUDA the gpu
     preset uses 1e-5 (10x MICA's rate, LoRA's usual ratio; docs/training.md "Presets").
  2. Short episodes on a CPU (3 turns of at most 48 tokens; MICA: 8-15) and 4 scenarios x K=4 a step (MICA:
     16 x 4). With CUDA the gpu preset takes 16 x 4, 8-15 turns and EMPA's collapse window of 5, with 4-bit
     base weights and the frozen base as judge and user; --preset chooses, flags given win; every preset's
     departures: docs/reference.md "Known departures at a glance".
  3. A reply cut off at --max-new-tokens loses --cut-off-penalty (0.5) of its reward's unit (what one ordinary
     good turn earns: cut_off_scale): without it a small policy drifts to the cap.
  4. A turn a judge failed on (the EMPA judge, or CARE's or Kardia-R1's criteria judge) is left out of the
     loss and counted; for the returns and the group statistics its reward is the dialogue's mean valid
     reward (as the public code fills it).
  5. REINFORCE++ discounts per turn (rewards sit on turn ends) and whitens per turn, not per token; RLVER's
     reward is paid per turn as the emotion's change (RLVER pays e_T/100 once, at the end).
  6. Two optimizer steps per rollout by default (--minibatch-size 8 of 16 dialogues, MICA's proportion), so
     the ratio moves and the clip acts from the second minibatch on; pi_old is computed once per rollout
     (the first minibatch of the first epoch uses the unchanged policy: its ratio is exactly 1).

CPU:  python 04_mica_train.py                        (SmolLM2, embed judge, scripted user, ~80 s a step)
      python 04_mica_train.py --preset demo          (make demo: 4 steps; then 05 compares held out)
GPU:  python 04_mica_train.py --model Qwen2.5-7B-Instruct     (the gpu preset: 4-bit, the frozen base judges
          and plays the user; for results a served judge: --judge api:Qwen2.5-72B-Instruct \\
          --user api:Qwen2.5-72B-Instruct --api-base http://localhost:8000/v1)
N GPUs: accelerate launch --num_processes N 04_mica_train.py ...  (each process rolls out its share of the
        scenarios; the three data-parallel helpers sum the gradients and token counts over the processes
        through accelerate; process 0 writes; docs/scale.md)

A new estimator or reward is one function and one entry in ADVANTAGES or REWARDS (docs/training.md, "Adding
an estimator or a reward"); --advantage and --reward take its name.
"""

from __future__ import annotations

import argparse
import importlib
import math
import random
import resource
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import gather_object
from tqdm import tqdm
from transformers import set_seed

import common
import offline
import plots
import runs

sft = importlib.import_module("01_rubric_sft")  # CARE: the rubric format and parser, S(y), generation, criteria judge
env = importlib.import_module("03_rollout")  # the environment: scenarios, rollout, judges, users, IDR
HERE = Path(__file__).resolve().parent
DIMS = sft.DIMS
CLIP_LOW, CLIP_HIGH = 0.2, 0.28  # the ratio's clip [1 - eps_low, 1 + eps_high] (DAPO's clip-higher, as MICA's code)
MAX_GRAD_NORM, WEIGHT_DECAY = 1.0, 0.1  # gradient clipping; AdamW's weight decay


# ---------------------------------------------------------------------------------------------
# The equations: returns, then the advantage estimators, registered by name:
#   ADVANTAGES[name](rewards, args) -> (A, terms)
#   rewards[s][k][t]  the step's per-turn rewards: scenario group s, its dialogue k, turn t (lengths differ)
#   A[s][k][t]        the advantage of each turn's reply, the same shape
#   terms             {name: [s][k][t]}: the parts of A worth seeing (MICA: A_turn, A_group); rollouts.jsonl
#                     keeps them per turn and plots.credit draws them. A fork adds a function and an entry.
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


def mica_advantages(rewards, args) -> tuple[list, dict]:
    """MICA: per scenario group, the turn-level and the group-level advantage, mixed by alpha."""
    A, A_turn, A_group = [], [], []
    for group in rewards:
        turn, whole = turn_level_advantages(group, args.gamma), group_level_advantages(group)
        # A[k][t] = alpha * A_turn[k][t] + (1 - alpha) * A_group[k][t]
        A.append(
            [
                [args.alpha * turn[k][t] + (1 - args.alpha) * whole[k][t] for t in range(len(group[k]))]
                for k in range(len(group))
            ]
        )
        A_turn.append(turn)
        A_group.append(whole)
    return A, {"A_turn": A_turn, "A_group": A_group}


def grpo_advantages(rewards, args) -> tuple[list, dict]:
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


def reinforce_pp_advantages(rewards, args) -> tuple[list, dict]:
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
# The rewards, registered by name: REWARDS[name](trajs, args, graders) -> r[i][t] for every dialogue i and
# turn t (NaN where a criteria judge failed). --reward idr+0.5*rlver weights and sums them; then the cut-off
# penalty, and a failed turn's filling
# ---------------------------------------------------------------------------------------------
def idr_rewards(trajs, args, graders) -> list[list[float]]:
    """MICA's incremental distance reward, from 03's hinge distance."""
    r = []
    for tr in trajs:
        w = args.idr_weights
        if "rubrics" in tr.extra and args.care_distance == "weighted":
            # with CARE the rubric's weights weight the distance (in place of --idr-weights), scaled so that
            # uniform ones give MICA's (1, 1, 1): w_t = 3 (w_C,t, w_A,t, w_P,t). This project's design, not a
            # paper's: d_t changes every turn, so the rewards no longer sum to d(P0) - d(P_T); --care-distance
            # plain keeps MICA's potential difference
            w = [[3 * rb["weights"][d] for d in DIMS] for rb in tr.extra["rubrics"]]
        # r_t = d(P_{t-1}) - d(P_t)
        r.append(env.incremental_distance_rewards(tr.states, w, env.EPS))
    return r


def rlver_emotion_rewards(emotions) -> list[float]:
    """emotions = [e_0, ..., e_T] kept by the simulated user -> [r_1, ..., r_T]."""
    # RLVER: r_t = (e_t - e_{t-1}) / 100. The sum is (e_T - e_0)/100, so GRPO on it (before the cut-off penalty)
    # ranks a group exactly as RLVER's outcome reward e_T/100 does (e_0 is the same for every k)
    return [(emotions[t] - emotions[t - 1]) / 100 for t in range(1, len(emotions))]


def rlver_rewards(trajs, args, graders) -> list[list[float]]:
    """RLVER's emotion reward, paid per turn as the simulated user's emotion change."""
    return [rlver_emotion_rewards(tr.emotions) for tr in trajs]


def care_rewards(trajs, args, graders) -> list[list[float]]:
    """CARE: r_t = S(y_t) under turn t's rubric (tr.extra["rubrics"], written by the frozen generator); the
    criteria judge scores each reply on every criterion of its turn's rubric."""
    cases = []
    for tr in trajs:
        hist = [m for m in env.seen_history(tr) if m["role"] != "system"]
        for t in range(tr.T):
            rubric = tr.extra["rubrics"][t]
            cases.append({"context": hist[: 2 * t + 1], "reply": tr.shown[t], "criteria": rubric["criteria"]})
    scores = iter(sft.judge_by_dimension(graders.criteria_judge, cases))
    r = []
    for tr in trajs:
        r_i = []
        for t in range(tr.T):
            s_t = next(scores)  # {d: [s(y_t, c) for c in C_d,t]}, None where the judge failed
            # r_t = S(y_t) = sum_d w_d,t (1/|C_d,t|) sum_c s(y_t, c);  NaN where the judge failed
            r_i.append(float("nan") if s_t is None else sft.rubric_score(tr.extra["rubrics"][t], s_t))
        r.append(r_i)
    return r


def kardia_rewards(trajs, args, graders) -> list[list[float]]:
    """Kardia-R1 (Rubric-as-Judge): the judge scores each shown reply on relevance, empathy, persona
    consistency and safety, and the reply's <emotion> section (the whole reply without --kardia-format) on
    emotion accuracy: does it name what this person feels (kardia_criteria)."""
    cases = []
    for tr in trajs:
        hist = [m for m in env.seen_history(tr) if m["role"] != "system"]
        replies = [m["content"] for m in tr.messages if m["role"] == "assistant"]
        for t in range(tr.T):
            reply_axes, emotion_axis = kardia_criteria(tr.scenario, hist[2 * t]["content"])
            named = env.kardia_section(replies[t], "emotion") if args.kardia_format else tr.shown[t]
            context = hist[: 2 * t + 1]
            cases.append({"context": context, "reply": tr.shown[t], "criteria": {"reply": reply_axes}})
            cases.append(
                {"context": context, "reply": named or "(no emotion named)", "criteria": {"emotion": [emotion_axis]}}
            )
    scores = iter(sft.judge_by_dimension(graders.criteria_judge, cases))
    r = []
    for tr in trajs:
        r_i = []
        for t in range(tr.T):
            s_reply, s_emotion = next(scores), next(scores)
            if s_reply is None or s_emotion is None:
                r_i.append(float("nan"))  # the judge failed
                continue
            # r_t = (1/5) sum_c s_c,t over the five axes + r_fmt,t;  r_fmt = 0 with the four sections, -1
            # without (only with --kardia-format)
            s = s_reply["reply"] + s_emotion["emotion"]
            r_fmt = (0.0 if tr.formatted[t] else -1.0) if args.kardia_format else 0.0
            r_i.append(sum(s) / len(s) + r_fmt)
        r.append(r_i)
    return r


REWARDS = {"idr": idr_rewards, "rlver": rlver_rewards, "care": care_rewards, "kardia": kardia_rewards}


def cut_off_scale(name: str, args) -> float:
    """The unit of the cut-off penalty for one reward: what one ordinary good turn earns in that reward."""
    if name == "idr":
        # sqrt(w_C + w_A + w_P): the IDR of a turn that gains one point on every axis while the three deficits
        # are equal and far from the goal (sqrt 3 with MICA's weights; with idr+care and --care-distance
        # weighted the rubric's 3 w_t, which sum to 3)
        weighted = "care" in args.reward_weights and args.care_distance == "weighted"
        return math.sqrt(3.0 if weighted else sum(args.idr_weights))
    if name == "rlver":
        return 0.1  # the largest emotion change of one turn (10 of 100), half the reward's range [-0.1, 0.1]
    if name == "kardia" and args.kardia_format:
        return 2.0  # the range of the reward: the mean score in [0, 1] plus r_fmt in {-1, 0}: [-1, 1]
    return 1.0  # care: the range of S(y), [0, 1]; kardia: the range of the mean criterion score, [0, 1]


def cut_off_penalty(args) -> float:
    # penalty = lambda_cut * sum_c |weight_c| * scale_c   (lambda_cut = --cut-off-penalty)
    penalty = 0.0
    for name, weight in args.reward_weights.items():
        penalty += abs(weight) * cut_off_scale(name, args)
    return args.cut_off_penalty * penalty


def turn_rewards(parts: dict[str, list[float]], tr, args) -> tuple[list[float], list[bool]]:
    """One dialogue's training reward per turn from its --reward parts ({name: r_t}), and which turns failed:
    the EMPA judge failed (no state change) or a criteria judge did (a NaN part). A failed turn's reward is
    the dialogue's mean valid reward, 0 when none is valid: it counts in the returns and the group statistics
    only (the loss leaves it out)."""
    # r_t = sum_c weight_c * r_c,t - penalty * 1[reply t was cut off]
    r = [0.0] * tr.T
    for name, part in parts.items():
        r = [x + args.reward_weights[name] * y for x, y in zip(r, part)]
    failed = [tr.judge_failed[t] or not all(math.isfinite(part[t]) for part in parts.values()) for t in range(tr.T)]
    penalty = cut_off_penalty(args)
    r = [x - penalty * cut for x, cut in zip(r, tr.cut_off)]
    valid = [x for x, f in zip(r, failed) if not f]
    fill = sum(valid) / len(valid) if valid else 0.0
    return [fill if f else x for x, f in zip(r, failed)], failed


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


def k3_kl(logp, logp_ref):
    # KL(pi || ref) per token, the k3 estimator: exp(ref - logp) - (ref - logp) - 1  (>= 0)
    d = logp_ref - logp
    return torch.exp(d) - d - 1


# ---------------------------------------------------------------------------------------------
# The update: clipped policy-gradient steps on the reply tokens (no critic: the advantages come from above)
# ---------------------------------------------------------------------------------------------
@dataclass
class Sample:
    """One dialogue for the update: its token ids, each reply's [start, end) and advantage A[k][t] (None:
    a failed turn, left out of the loss)."""

    ids: list[int]
    spans: list[tuple[int, int]]
    A: list[float | None]

    def scored(self) -> list[tuple[int, int]]:
        return [span for span, a in zip(self.spans, self.A) if a is not None]

    def n_tokens(self) -> int:
        return sum(end - start for start, end in self.scored())

    def token_advantages(self) -> torch.Tensor:
        # A_i = A[k][t] for every token i of reply t (flat, in the order token_logprobs gives them)
        advantages = torch.tensor([a for a in self.A if a is not None], dtype=torch.float32)
        lengths = torch.tensor([end - start for start, end in self.scored()], dtype=torch.long)
        return torch.repeat_interleave(advantages, lengths)


def policy_update(model, tokenizer, optimizer, scheduler, samples, args, acc, log_kl=False) -> dict:
    """--update-epochs passes over minibatches of --minibatch-size dialogues (whole scenarios, in the step's order:
    split_minibatches), each one optimizer step with its gradient accumulated over micro-batches and the loss a mean
    over the minibatch's scored tokens; then one scheduler step, always. pi_old and the reference are taken once,
    before the first step. Data-parallel: each process holds its part of every minibatch; N, the gradient and the
    logged sums are summed over the processes, so each takes the step that one process would take on all the
    dialogues."""
    device, params = next(model.parameters()).device, [p for p in model.parameters() if p.requires_grad]
    minibatches = split_minibatches(samples, args, acc)
    A_tok = {i: samples[i].token_advantages() for mb in minibatches for i in mb}
    need_ref = args.kl_coef > 0 or log_kl
    old, ref = old_and_ref_logprobs(model, tokenizer, samples, minibatches, args, need_ref)
    model.train()
    # sums kept on the device (copied once at the end): the loss of the steps taken, clipped tokens, the KL
    loss_total, clipped, kl_total = (torch.zeros((), dtype=torch.float64, device=device) for _ in range(3))
    ratio_lo, ratio_hi = torch.tensor(math.inf, device=device), torch.tensor(-math.inf, device=device)
    tokens, grad_norms, nonfinite_grads = 0, [], 0
    for _ in range(args.update_epochs):
        for mb in minibatches:
            # N: the minibatch's scored reply tokens (over every process); 0: every turn in it failed, no step
            N = int(sum_over_processes(acc, [torch.tensor(sum(samples[i].n_tokens() for i in mb))])[0])
            if N == 0:
                continue
            optimizer.zero_grad(set_to_none=True)
            mb_loss = torch.zeros((), dtype=torch.float64, device=device)
            for micro in micro_batches(samples, mb, args.micro_batch_size):
                ids, attn, mask = collate([samples[i] for i in micro], tokenizer.pad_token_id, device)
                logp = common.token_logprobs(model, ids, attn, mask, args.temperature)
                A = torch.cat([A_tok[i] for i in micro]).to(device)
                logp_old = torch.cat([old[i] for i in micro]) if micro[0] in old else logp.detach()
                # L = (1/N) sum_i max(-ratio_i A_i, -clip(ratio_i) A_i)  [+ beta (1/N) sum_i k3_i]
                pg, was_clipped, ratio = clipped_surrogate(logp, logp_old, A, CLIP_LOW, CLIP_HIGH)
                loss_sum = pg.sum()
                if ref:
                    kl = k3_kl(logp, torch.cat([ref[i] for i in micro]))
                    kl_total += kl.detach().sum()
                    if args.kl_coef > 0:
                        loss_sum = loss_sum + args.kl_coef * kl.sum()
                (loss_sum / N).backward()
                mb_loss += loss_sum.detach().double() / N
                clipped += was_clipped.sum()
                ratio_lo, ratio_hi = torch.minimum(ratio_lo, ratio.min()), torch.maximum(ratio_hi, ratio.max())
                tokens += len(A)
            # the minibatch's gradient, summed over the processes (one process: as it is), clipped, one step
            grads = sum_over_processes(acc, [torch.zeros_like(p) if p.grad is None else p.grad for p in params])
            for p, g in zip(params, grads):
                p.grad = g
            grad_norm = float(torch.nn.utils.clip_grad_norm_(params, MAX_GRAD_NORM))
            if math.isfinite(grad_norm):
                optimizer.step()
                grad_norms.append(grad_norm)
                loss_total += mb_loss
            else:  # a non-finite gradient is skipped, and counted
                optimizer.zero_grad(set_to_none=True)
                nonfinite_grads += 1
    scheduler.step()
    # the logged sums over every process; the loss the mean over the optimizer steps taken
    loss_total, clipped, kl_total, tokens = sum_over_processes(
        acc,
        [
            torch.stack(
                [
                    loss_total,
                    clipped.double(),
                    kl_total,
                    torch.tensor(float(tokens), dtype=torch.float64, device=device),
                ]
            )
        ],
    )[0].tolist()
    ratios = gather_over_processes(acc, (float(ratio_lo), float(ratio_hi)))
    steps = len(grad_norms)
    return {
        "loss": loss_total / steps if steps else math.nan,
        "clip_frac": clipped / tokens if tokens else math.nan,
        "ratio_min": min(lo for lo, _ in ratios) if tokens else math.nan,
        "ratio_max": max(hi for _, hi in ratios) if tokens else math.nan,
        "kl": kl_total / tokens if need_ref and tokens else math.nan,
        "grad_norm": sum(grad_norms) / steps if steps else math.nan,
        "train_tokens": int(tokens),
        "optimizer_steps": steps,
        "nonfinite_grads": nonfinite_grads,
    }


@torch.no_grad()
def old_and_ref_logprobs(model, tokenizer, samples, minibatches, args, need_ref: bool) -> tuple[dict, dict]:
    """pi_old, needed only where the policy has moved since sampling: not in the first minibatch of the first
    epoch (ratio = 1: the current log-probs, detached, serve), so one epoch of one minibatch spends no extra
    forward pass. And the reference (the base, adapter off) once per rollout when the KL is used or logged.
    Taken in train mode, as the update's own log-probs are (the same forward: LoRA's dropout is 0)."""
    device, old_from = next(model.parameters()).device, 1 if args.update_epochs == 1 else 0
    old, ref = {}, {}
    model.train()
    for n, mb in enumerate(minibatches):
        if n < old_from and not need_ref:
            continue
        for micro in micro_batches(samples, mb, args.micro_batch_size):
            ids, attn, mask = collate([samples[i] for i in micro], tokenizer.pad_token_id, device)
            sizes = [samples[i].n_tokens() for i in micro]
            if n >= old_from:
                old.update(zip(micro, common.token_logprobs(model, ids, attn, mask, args.temperature).split(sizes)))
            if need_ref:
                with common.adapters_off(model):
                    logp = common.token_logprobs(model, ids, attn, mask, args.temperature)
                ref.update(zip(micro, logp.split(sizes)))
    return old, ref


# ---------------------------------------------------------------------------------------------
# Data-parallel: the only places where processes talk (`accelerate launch --num_processes N`); on one
# process each does nothing
# ---------------------------------------------------------------------------------------------
def sum_over_processes(acc, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each tensor summed over the processes (one flat all-reduce); on one process the tensors as they are."""
    if acc.num_processes == 1:
        return tensors
    flat = acc.reduce(torch.cat([t.reshape(-1).to(acc.device) for t in tensors]), "sum")
    return [x.view_as(t).to(t.device) for x, t in zip(flat.split([t.numel() for t in tensors]), tensors)]


def gather_over_processes(acc, obj) -> list:
    """[every process's obj], in process order; on one process [obj]."""
    return gather_object([obj]) if acc.num_processes > 1 else [obj]


def over_processes(acc, estimator, rewards, args) -> tuple[list, dict]:
    """An advantage estimator over every process's scenario groups at once (a batch-wide statistic, such as
    REINFORCE++'s, sees the whole batch), this process's groups of A and of the terms returned."""
    everyone = gather_over_processes(acc, rewards)
    A, terms = estimator([group for part in everyone for group in part], args)
    first = sum(len(part) for part in everyone[: acc.process_index])
    mine = slice(first, first + len(rewards))
    return A[mine], {name: value[mine] for name, value in terms.items()}


# ---------------------------------------------------------------------------------------------
# The main loop
# ---------------------------------------------------------------------------------------------
@dataclass
class Run:
    """What the loop works with, made once by main."""

    args: argparse.Namespace
    acc: Accelerator  # the processes (one, or `accelerate launch`'s N)
    dir: Path  # the run folder
    scenarios: list[dict]
    model: torch.nn.Module  # the policy: the base with its LoRA adapter
    tokenizer: object
    judge: object  # 03's judge: EMPA levels per reply
    user: object  # 03's simulated user
    graders: Graders  # CARE's rubric generator and the criteria judge, for --reward care and kardia
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    logger: runs.MetricsLogger | None  # process 0's


def train_loop(run: Run, start: int):
    args, acc = run.args, run.acc
    for step in tqdm(
        range(start, args.steps + 1), desc="train", initial=start - 1, total=args.steps, disable=not args.progress
    ):
        t0, calls_before = time.time(), common.api_counts(run.judge, run.user)
        # 1. rollout: K dialogues for each of this step's scenarios, every live dialogue batched each turn
        scenarios = step_scenarios(run, step)
        trajs = env.rollout(run.model, run.tokenizer, scenarios, run.judge, run.user, args, desc=f"step {step} rollout")
        t1 = time.time()
        # 2. rewards: CARE's rubric for every turn (with --reward care), each --reward part by name, then per
        #    dialogue the weighted sum, the cut-off penalty and failed turns filled
        rubric_invalid = write_rubrics(trajs, run.graders, args) if "care" in args.reward_weights else 0
        parts = reward_parts(trajs, args, run.graders)
        rewards, failed = zip(*[turn_rewards(p, tr, args) for p, tr in zip(parts, trajs)])
        # 3. advantages: the --advantage estimator over the step's scenario groups (rewards[s][k][t])
        t2 = time.time()
        groups = [[i for i, tr in enumerate(trajs) if tr.scenario is s] for s in scenarios]
        A, terms = over_processes(acc, ADVANTAGES[args.advantage], [[rewards[i] for i in g] for g in groups], args)
        # 4. update: clipped policy-gradient steps on the reply tokens of every turn no judge failed on
        order = [i for g in groups for i in g]  # dialogue by dialogue, scenario by scenario
        samples = as_samples([trajs[i] for i in order], [a for group in A for a in group], [failed[i] for i in order])
        log_kl = args.kl_coef == 0 and args.log_kl_every > 0 and step % args.log_kl_every == 0
        lr = run.optimizer.param_groups[0]["lr"]
        upd = policy_update(run.model, run.tokenizer, run.optimizer, run.scheduler, samples, args, acc, log_kl)
        # 5. log the step (rollouts.jsonl: every dialogue with its rewards, A and the estimator's terms),
        #    checkpoint, draw
        records = []
        for s, group in enumerate(groups):
            for k, i in enumerate(group):
                turn_terms = {name: value[s][k] for name, value in terms.items()}
                records.append(
                    dialogue_record(args, step, trajs[i], parts[i], rewards[i], A[s][k], failed[i], turn_terms)
                )
        counts = {
            "degenerate_groups": sum(all(abs(a) < 1e-9 for a_k in group for a in a_k) for group in A),
            **({"rubric_invalid": rubric_invalid} if "care" in args.reward_weights else {}),
            **({"format_ok": sum(sum(tr.formatted) for tr in trajs)} if args.kardia_format else {}),
            **{k: v - calls_before.get(k, 0) for k, v in common.api_counts(run.judge, run.user).items()},
        }
        seconds = {"rollout": t1 - t0, "reward": t2 - t1, "update": time.time() - t2, "step": time.time() - t0}
        log_step(run, step, records, [x for r in rewards for x in r], counts, upd, lr, seconds)
        if acc.is_main_process and (step % args.save_every == 0 or step == args.steps):
            runs.save_checkpoint(run.dir, step, run.model, run.optimizer, run.scheduler)
            plots.curves(run.dir, plots.MICA_CURVES)
        if acc.is_main_process and step in (args.credit_steps or (start, args.steps)):
            plots.credit(run.dir, step)  # how the estimator assigned credit (default: the first and last step)


def main(argv=None):
    args = parse_args(argv)
    set_seed(args.seed)  # every process alike: the same LoRA initialisation
    scenarios = env.load_scenarios(args.scenarios)  # inputs checked before anything is created
    common.check_model_args(args)
    # one process, or each of `accelerate launch --num_processes N`'s: NCCL on GPUs, gloo on CPUs (cpu=True)
    acc = Accelerator(cpu=not torch.cuda.is_available())
    check_processes(args, acc, len(scenarios))
    args.progress = args.progress and acc.is_main_process  # one progress bar, one log: process 0's
    model, tokenizer = common.load_policy(args, trainable=True)  # every model loads before the run folder
    judge, user = env.make_judge(args, (model, tokenizer)), env.make_user(args, (model, tokenizer))
    graders = load_graders(args, (model, tokenizer))
    run_dir = runs.open_run(args, ("metrics.jsonl", "rollouts.jsonl")) if acc.is_main_process else None
    run_dir = Path(gather_over_processes(acc, str(run_dir))[0])  # process 0 made (or checked) it; all write there
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer, scheduler = common.make_optimizer(params, args.lr, WEIGHT_DECAY, args.steps)
    state = runs.load_checkpoint(run_dir, model, optimizer, scheduler) if args.resume else None
    start = state["step"] + 1 if state else 1  # every process loads the same checkpoint
    logger = runs.MetricsLogger(run_dir, args.report_to, runs.public_args(args)) if acc.is_main_process else None
    if acc.is_main_process:
        print(header_line(args, run_dir, params, acc, start if state else None))
    run = Run(args, acc, run_dir, scenarios, model, tokenizer, judge, user, graders, optimizer, scheduler, logger)
    try:
        train_loop(run, start)
    except common.UserError:  # the judge's endpoint went down, say: keep what was learned, then stop
        runs.checkpoint_on_error(run_dir, model, optimizer, scheduler, logger, start)
        raise
    if acc.is_main_process:
        model.save_pretrained(run_dir / "adapter", safe_serialization=True)
        tokenizer.save_pretrained(run_dir / "adapter")
        logger.finish()
        print(
            f"final adapter: {run_dir / 'adapter'} (05_eval.py --adapters takes it); curves: "
            f"{plots.curves(run_dir, plots.MICA_CURVES)}"
        )
    acc.end_training()


# ---------------------------------------------------------------------------------------------
# --- supporting pieces ---: the step's scenarios, rewards by dialogue, the update's samples and minibatches,
# the step log, CARE's and Kardia-R1's graders, presets, CLI
# ---------------------------------------------------------------------------------------------
def step_scenarios(run: Run, step: int) -> list[dict]:
    """This step's scenarios (this process's share of them), and the step's seeds: every step's randomness
    depends on (seed, step), and on the process (each samples its own dialogues)."""
    args, acc = run.args, run.acc
    step_seed = args.seed * 100_003 + step
    torch.manual_seed(step_seed * acc.num_processes + acc.process_index)
    if isinstance(run.user, offline.ScriptedUser):
        run.user.seed = step_seed
    batch = random.Random(step_seed).sample(run.scenarios, min(args.scenarios_per_step, len(run.scenarios)))
    return batch[acc.process_index :: acc.num_processes]


def reward_parts(trajs, args, graders) -> list[dict[str, list[float]]]:
    """Every dialogue's --reward parts per turn, by name, unweighted: [{name: r_t}] (one REWARDS call each)."""
    by_name = {name: REWARDS[name](trajs, args, graders) for name in args.reward_weights}
    return [{name: by_name[name][i] for name in by_name} for i in range(len(trajs))]


def as_samples(trajs, advs=None, failed=None) -> list[Sample]:
    """Dialogues as the update's samples: each reply's span with its turn's advantage A[k][t], None (left out
    of the loss) on a failed turn (default: where the EMPA judge failed); advs None gives every turn 0."""
    advs = advs if advs is not None else [[0.0] * tr.T for tr in trajs]
    failed = failed if failed is not None else [tr.judge_failed for tr in trajs]
    return [Sample(tr.ids, tr.spans, [None if f else a for f, a in zip(F, A)]) for tr, A, F in zip(trajs, advs, failed)]


def split_minibatches(samples: list[Sample], args, acc) -> list[list[int]]:
    """The samples (scenario by scenario, K each, in the step's seeded order) cut in that order into this
    process's share of each minibatch of --minibatch-size dialogues (a multiple of K: checked), as MICA's verl
    launch splits a batch, so a minibatch holds whole scenarios. A dialogue with nothing to score is left out.
    Every process gets as many minibatches (empty ones where it has run out)."""
    size = args.minibatch_size // acc.num_processes
    out = [
        [i for i in range(j, min(j + size, len(samples))) if samples[i].n_tokens() > 0]
        for j in range(0, len(samples), size)
    ]
    return out + [[] for _ in range(max(gather_over_processes(acc, len(out))) - len(out))]


def micro_batches(samples: list[Sample], mb: list[int], size: int) -> list[list[int]]:
    """A minibatch's micro-batches, its dialogues sorted by length (less padding; the step is the same)."""
    mb = sorted(mb, key=lambda i: len(samples[i].ids))
    return [mb[j : j + size] for j in range(0, len(mb), size)]


def collate(samples: list[Sample], pad_id, device):
    """Right-padded ids, the attention mask and the loss mask: the tokens of every reply with an advantage."""
    return common.right_pad([s.ids for s in samples], pad_id, [s.scored() for s in samples], device)


def dialogue_record(args, step, tr, parts, r, A, failed, terms) -> dict:
    """A rollouts.jsonl line: 03's record of the dialogue with, per turn, the training reward and its parts,
    the return G_t, the advantage A, the estimator's terms (MICA: A_turn and A_group), the failed flag."""
    rec = env.trajectory_record(tr, args, rewards=[round(x, 4) for x in r], step=step)
    G = discounted_returns(r, args.gamma)
    for t, turn in enumerate(rec["turns"]):
        turn["G"] = round(G[t], 4)
        turn["advantage"] = round(A[t], 4)
        turn["terms"] = {name: round(value[t], 4) for name, value in terms.items()}
        turn["judge_failed"] = failed[t]
        turn["reward_parts"] = {k: round(v[t], 4) if math.isfinite(v[t]) else None for k, v in parts.items()}
        if "rubrics" in tr.extra:
            turn["rubric"] = tr.extra["rubrics"][t]
    return rec


def log_step(run: Run, step, records, rewards, counts, upd, lr, seconds):
    """rollouts.jsonl and one metrics line (the console, metrics.jsonl, --report-to); data-parallel: process 0
    gathers every process's share and writes."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    parts = gather_over_processes(
        run.acc, {"records": records, "rewards": rewards, "counts": counts, "seconds": seconds, "rss": rss}
    )
    if not run.acc.is_main_process:
        return  # the other processes go on to the next step
    records = [rec for part in parts for rec in part["records"]]
    rewards = [x for part in parts for x in part["rewards"]]  # every turn's training reward, unrounded
    turns, n = [turn for rec in records for turn in rec["turns"]], len(records)
    slowest = {k: max(part["seconds"][k] for part in parts) for k in seconds}  # processes run side by side
    runs.append_jsonl(run.dir / "rollouts.jsonl", records)
    run.logger.log(
        step,
        {
            "reward_mean": sum(rewards) / len(rewards),
            "return_mean": sum(rec["return"] for rec in records) / n,  # sum_t r_t, not discounted
            "success_rate": sum(rec["outcome"] == "success" for rec in records) / n,
            "final_distance": sum(rec["final_distance"] for rec in records) / n,
            "final_emotion": sum(rec["final_emotion"] for rec in records) / n,
            # the pure IDR of a dialogue telescopes to d(P0) - d(P_T): 05's held-out measure
            "distance_drop": sum(rec["initial_distance"] - rec["final_distance"] for rec in records) / n,
            "trajectories": n,
            "turns_mean": len(turns) / n,
            "cut_off_frac": sum(turn["cut_off"] for turn in turns) / max(1, len(turns)),
            "judge_failures": sum(turn["judge_failed"] for turn in turns),
            "user_failures": sum(rec["outcome"] == "user_failed" for rec in records),
            **{k: sum(part["counts"][k] for part in parts) for k in parts[0]["counts"]},
            **upd,
            "lr": lr,
            "gen_tokens_per_s": sum(turn["reply_tokens"] for turn in turns) / max(slowest["rollout"], 1e-9),
            "train_tokens_per_s": upd["train_tokens"] / max(slowest["update"], 1e-9),
            **{f"{k}_seconds": v for k, v in slowest.items()},
            "peak_rss_gb": max(part["rss"] for part in parts),  # of the largest process
        },
    )


def header_line(args, run_dir, params, acc, resumed_at) -> str:
    """The run's one header line: the folder, the preset, the flags given that differ from the defaults (the
    whole configuration is in args.json), the device, the adapter's size."""
    given = []
    for k, v in args.flags_given.items():
        flag = "--" + k.replace("_", "-")
        given.append(flag if v is True else f"--no-{flag[2:]}" if v is False else f"{flag} {v}")
    return (
        f"run folder {run_dir} | {args.preset_note} | flags given: {' '.join(given) or 'none'} | device {acc.device}"
        + f" | trainable parameters {sum(p.numel() for p in params):,}"
        + (f" | data-parallel over {acc.num_processes} processes" if acc.num_processes > 1 else "")
        + (f" | resumed from {run_dir / 'checkpoint.pt'} at step {resumed_at}" if resumed_at else "")
    )


@dataclass
class Graders:
    """What --reward care and kardia grade with (None where unused): CARE's frozen rubric generator (02's
    adapter on the base) with its tokenizer, and 01's criteria judge (embed, self, hf: or api:)."""

    rubric_model: object = None
    rubric_tokenizer: object = None
    criteria_judge: object = None


def load_graders(args, policy) -> Graders:
    graders = Graders()
    if "care" in args.reward_weights and args.rubric_model:
        gen_args = argparse.Namespace(**{**vars(args), "adapter": args.rubric_model, "gradient_checkpointing": False})
        graders.rubric_model, graders.rubric_tokenizer = common.load_policy(gen_args, trainable=False)
    if {"care", "kardia"} & set(args.reward_weights):
        graders.criteria_judge = sft.CriteriaJudge(args, policy)
    return graders


def write_rubrics(trajs, graders: Graders, args) -> int:
    """CARE: the rubric of every turn of every dialogue, into tr.extra["rubrics"], written by the frozen
    generator (02's adapter) for the history the policy answered as the user saw it (each reply's shown part:
    the context the criteria judge reads); --rubric picks the Table-3 ablation (uniform: 01's fixed rubric).
    A generated rubric that does not parse is replaced by the fixed one; returns how many did not parse."""
    contexts, where, fixed = [], [], sft.UNIFORM_RUBRIC
    for i, tr in enumerate(trajs):
        hist = [m for m in env.seen_history(tr) if m["role"] != "system"]  # what the criteria judge sees too
        for t in range(tr.T):
            contexts.append(hist[: 2 * t + 1])
            where.append((i, t))
    if args.rubric == "uniform":
        generated = [fixed] * len(contexts)
    else:
        texts = sft.generate_rubrics(
            graders.rubric_model, graders.rubric_tokenizer, contexts, args.rubric_max_new_tokens, 0.0, 16
        )
        generated = [sft.parse_rubric(text)[0] for text, _, _ in texts]
    for tr in trajs:
        tr.extra["rubrics"] = [fixed] * tr.T
    for (i, t), g in zip(where, generated):
        g = g or fixed
        trajs[i].extra["rubrics"][t] = {
            "weights": (g if args.rubric in ("adaptive", "weights-only") else fixed)["weights"],
            "criteria": (g if args.rubric in ("adaptive", "criteria-only") else fixed)["criteria"],
        }
    return sum(g is None for g in generated)


def kardia_criteria(scenario: dict, user_message: str) -> tuple[list[str], str]:
    """Kardia-R1's fixed rubric: four axes judged on the reply, and emotion accuracy judged on the emotion the
    reply names. Persona consistency is judged against the scenario's profile (MBTI, about, situation,
    emotion) when it has one, else its persona line; the emotion to name is the scenario's (or its profile's)
    `emotion` when given, else what the person's last message shows."""
    prof = scenario.get("profile") if isinstance(scenario.get("profile"), dict) else {}
    who = "; ".join(f"{k}: {v}" for k, v in prof.items()) or scenario.get("persona", "")
    feels = scenario.get("emotion") or prof.get("emotion")
    texts = env.PROMPTS["kardia_criteria"]  # data/prompts.json
    emotion = (
        texts["emotion_given"].format(feels=feels) if feels else texts["emotion_shown"].format(message=user_message)
    )
    return [c.format(who=who) for c in texts["reply"]], emotion


# The budget a run starts from (--preset); a flag given on the command line wins over it.
#   cpu   the reference defaults below (4 scenarios x K=4, 3 turns of <= 48 tokens, lr 1e-3)
#   demo  `make demo`: the reference step for 4 steps (8 optimizer steps), the KL logged every 2 steps
#   gpu   departures 1 and 2 (16 scenarios x K=4 in minibatches of 8 x 4: 2 optimizer steps; 8-15 turns, EMPA's
#         collapse window of 5; lr 1e-5; 4-bit base; the frozen base as judge and user unless a backend is given),
#         gradient checkpointing, replies of up to 256 tokens (our choice: no reference gives a length)
PRESETS = {
    "cpu": {},
    "demo": dict(steps=4, log_kl_every=2, save_every=4),
    "gpu": dict(
        scenarios_per_step=16,
        k=4,
        minibatch_size=32,
        min_turns=8,
        max_turns=15,
        collapse_window=5,
        max_new_tokens=256,
        max_context=4096,
        lr=1e-5,
        gradient_checkpointing=True,
        judge="self",
        user="self",
    ),
}


def parse_args(argv=None):
    """Every flag of 04 (the model's, 03's environment's and the run's groups come from common.py and 03), the
    --preset's defaults under the flags given; then what argparse's types cannot check."""
    count = common.number(int, low=1)  # argparse types: a bad value exits 2 with one line naming the flag
    p = common.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    common.add_model_args(p)
    env.add_env_args(p, scenarios_default=str(HERE / "data" / "scenarios_train.jsonl"))
    g = p.add_argument_group("algorithm")
    g.add_argument(
        "--advantage",
        choices=list(ADVANTAGES),
        default="mica",
        help=(
            "the advantage estimator (ADVANTAGES): mica (turn- and group-level, mixed), grpo (the outcome, per "
            "group), reinforce_pp (returns whitened over the batch)"
        ),
    )
    g.add_argument(
        "--alpha", type=common.number(low=0, high=1), default=0.4, help="MICA's weight of the turn-level advantage"
    )
    g.add_argument("--gamma", type=common.number(low=0, high=1), default=0.85, help="discount of the per-turn returns")
    g.add_argument(
        "--reward",
        default="idr",
        help=(
            f"per-turn reward (REWARDS: {', '.join(REWARDS)}), or a weighted sum such as idr+0.5*care: idr (MICA's "
            "incremental distance), rlver (the simulated user's emotion change / 100; dialogues end by RLVER's "
            "emotion rule), care (CARE's adaptive rubric, judged per criterion), kardia (Kardia-R1's fixed rubric, "
            "+ its format term with --kardia-format)"
        ),
    )
    g.add_argument("--rubric-model", default=None, help="--reward care: the frozen rubric generator (02's adapter)")
    g.add_argument(
        "--rubric",
        choices=["adaptive", "uniform", "weights-only", "criteria-only"],
        default="adaptive",
        help=(
            "CARE's Table-3 ablations: the generator's weights and criteria, or w = 1/3 and fixed generic criteria, "
            "or one of the two from the generator"
        ),
    )
    g.add_argument("--rubric-max-new-tokens", type=count, default=256, help="token cap of a generated rubric")
    g.add_argument(
        "--care-distance",
        choices=["weighted", "plain"],
        default="weighted",
        help=(
            "with idr+care: weight turn t's distance by 3 w_t of its rubric (this project's design; the rewards then "
            "do not telescope), or plain MICA IDR"
        ),
    )
    g.add_argument(
        "--idr-weights",
        nargs=3,
        type=common.number(low=0),
        default=(1.0, 1.0, 1.0),
        metavar=("W_C", "W_A", "W_P"),
        help="w = (w_C, w_A, w_P) of the hinge distance",
    )
    g.add_argument(
        "--cut-off-penalty",
        type=float,
        default=0.5,
        help=(
            "a reply cut off at --max-new-tokens loses this many of its reward's units: for idr the IDR of a turn "
            "gaining one point on every axis (sqrt(w_C + w_A + w_P)), rlver 0.1 (the largest one-turn change), care "
            "1 (S's range), kardia 1 (2 with --kardia-format: its range)"
        ),
    )
    g.add_argument(
        "--kl-coef", type=common.number(low=0), default=0.0, help="beta of the k3 KL to the base model (0 = off)"
    )
    g.add_argument(
        "--log-kl-every",
        type=int,
        default=5,
        help="with --kl-coef 0, measure the KL to the base every N steps (one forward, no gradient)",
    )
    g.add_argument(
        "--credit-steps",
        nargs="+",
        type=count,
        default=[],
        help="the steps whose credit picture credit_step<N>.png is drawn (default: this run's first and last)",
    )
    g = p.add_argument_group("optimisation")
    g.add_argument("--steps", type=count, default=20, help="training steps (rollout + update)")
    g.add_argument(
        "--scenarios-per-step",
        type=count,
        default=4,
        help="scenarios per step, each rolled out K times (data-parallel: in all, shared out)",
    )
    g.add_argument(
        "--lr", type=common.number(above=0), default=1e-3, help="peak learning rate (AdamW; LoRA on SmolLM2)"
    )
    g.add_argument(
        "--update-epochs", type=count, default=1, help="passes of the clipped update over each rollout's dialogues"
    )
    g.add_argument(
        "--minibatch-size",
        type=count,
        default=8,
        help=(
            "dialogues per optimizer step (data-parallel: in all); 8 of the default 16 gives 2 optimizer steps per "
            "rollout, MICA's proportion"
        ),
    )
    g.add_argument(
        "--micro-batch-size",
        type=count,
        default=2,
        help="dialogues per forward/backward, per process (the gradient accumulates up to a minibatch)",
    )
    g.add_argument(
        "--preset",
        default="auto",
        choices=["auto", *PRESETS],
        help=(
            "the defaults to start from: cpu (the reference CPU budget), demo (make demo), gpu (one GPU, MICA's "
            "proportions, --judge self --user self); auto = gpu with CUDA, else cpu"
        ),
    )
    runs.add_run_args(p, "mica", resume="a run folder: continue from its last checkpoint", save_every=10, report=True)
    # --preset: its values become the defaults (auto: gpu with CUDA); a flag given wins
    name = p.parse_known_args(argv)[0].preset
    cuda = common.pick_device().type == "cuda"
    why = "asked" if name != "auto" else "auto: CUDA found" if cuda else "auto: no CUDA"
    name = name if name != "auto" else "gpu" if cuda else "cpu"
    p.set_defaults(**PRESETS[name])
    args = p.parse_args(argv)
    args.preset_note = f"preset {name} ({why})"
    args.flags_given = runs.flags_given(p, args)
    return check_args(args)


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


def check_args(args):
    """What argparse's types cannot see (one message naming the flag, exit 2), and the reward spec parsed."""
    env.check_env_args(args)
    c = common.check
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
    args.emotion_ends = args.emotion_ends or "rlver" in args.reward_weights
    return args


def check_processes(args, acc, n_scenarios: int):
    """Data-parallel: each process takes its own scenarios and its own whole scenarios of every minibatch."""
    n = acc.num_processes
    common.check(
        min(args.scenarios_per_step, n_scenarios) >= n,
        f"--scenarios-per-step must be >= the number of processes ({n}): each takes its own",
    )
    common.check(
        args.minibatch_size % (args.k * n) == 0,
        f"--minibatch-size must be a multiple of --k x the number of processes ({args.k} x {n}): each process's "
        "share holds whole scenarios",
    )


if __name__ == "__main__":
    common.run_main(main)

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
Writes  runs/<name>-<time>/: args.json, metrics.jsonl (a line per step), rollouts.jsonl (every dialogue with
        its rewards and advantages), checkpoint.pt (adapter, optimizer, scheduler, step; atomic),
        adapter/ (the final LoRA adapter, standard peft), curves.png (redrawn at each checkpoint),
        credit_step<N>.png (this run's first and last step, or --credit-steps: how MICA assigned credit, from
        rollouts.jsonl; plots.credit(run_dir, step) redraws any logged step later).
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
    cut-off r_t -= lambda_cut * (one turn's nominal range of the reward) when reply t hit the token cap
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
  3. A reply cut off at --max-new-tokens loses --truncation-penalty (0.5) of one turn's nominal reward range,
     in that reward's units: without it a small policy drifts to the cap.
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
        scenarios; accelerate sums the gradients and token counts over the processes; process 0 writes;
        docs/scale.md)
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import random
import resource
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import broadcast, broadcast_object_list, gather_object
from tqdm import tqdm

import common
import offline
import plots

sft = importlib.import_module("01_rubric_sft")  # CARE: the rubric format and parser, generation, criteria judge
env = importlib.import_module("03_rollout")  # the environment: scenarios, rollout, judges, users, IDR
HERE = Path(__file__).resolve().parent
DIMS = sft.DIMS


# ---------------------------------------------------------------------------------------------
# The equations: returns and advantages, then the per-turn rewards, then the loss
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


def mica_advantages(rewards, alpha, gamma) -> list[list[float]]:
    """rewards[k][t] for one scenario's K dialogues -> A[k][t], MICA's mix of the two."""
    A_turn, A_group = turn_level_advantages(rewards, gamma), group_level_advantages(rewards)
    # A[k][t] = alpha * A_turn[k][t] + (1 - alpha) * A_group[k][t]
    return [
        [alpha * A_turn[k][t] + (1 - alpha) * A_group[k][t] for t in range(len(rewards[k]))]
        for k in range(len(rewards))
    ]


def grpo_advantages(rewards) -> list[list[float]]:
    """rewards[k][t] for one scenario -> A[k][t]: the normalised outcome, the same on every turn."""
    # R_k = sum_t r[k][t];  A_k = (R_k - mean_K) / (std_K + 1e-6);  0 when K < 2
    # (the sample std, ddof = 1, as TRL's and verl's GRPO compute it)
    R = [sum(r) for r in rewards]
    if len(R) < 2:
        return [[0.0] * len(r) for r in rewards]
    mean, std = common.mean_std(R, ddof=1)
    return [[(R[k] - mean) / (std + 1e-6)] * len(rewards[k]) for k in range(len(rewards))]


def reinforce_pp_advantages(batch_rewards, gamma) -> list[list[list[float]]]:
    """batch_rewards[s][k][t] of the whole batch -> A[s][k][t]: returns whitened over the batch (data-
    parallel: train_loop hands it every process's rewards, gathered)."""
    # G_t per dialogue, then A = (G - mean) / (std + 1e-6) over every turn of the batch (no groups)
    G = [[discounted_returns(r, gamma) for r in group] for group in batch_rewards]
    flat = [x for group in G for g in group for x in g]
    n = len(flat)
    if n < 2:
        return [[[0.0] * len(g) for g in group] for group in G]
    mean = sum(flat) / n
    # the sample std (ddof = 1): sqrt( sum (G - mean)^2 / (n - 1) )
    std = math.sqrt(sum((x - mean) ** 2 for x in flat) / (n - 1))
    return [[[(x - mean) / (std + 1e-6) for x in g] for g in group] for group in G]


def rlver_emotion_rewards(emotions) -> list[float]:
    """emotions = [e_0, ..., e_T] kept by the simulated user -> [r_1, ..., r_T]."""
    # RLVER: r_t = (e_t - e_{t-1}) / 100. The sum is (e_T - e_0)/100, so GRPO on it (before the cut-off penalty)
    # ranks a group exactly as RLVER's outcome reward e_T/100 does (e_0 is the same for every k)
    return [(emotions[t] - emotions[t - 1]) / 100 for t in range(1, len(emotions))]


def rubric_score(rubric: dict, s: dict) -> float:
    """CARE's S(y): s[d] = the judge's scores of reply y on dimension d's criteria."""
    # S(y) = sum_d w_d * (1/|C_d|) sum_{c in C_d} s(y, c)
    S = 0.0
    for d in DIMS:
        S += rubric["weights"][d] * sum(s[d]) / len(s[d])
    return S


def care_turn_rewards(crit_judge, trajs, rubrics) -> list[list[float]]:
    """CARE: r_t of every turn; the judge scores each reply on every criterion of its turn's rubric."""
    cases = []
    for i, tr in enumerate(trajs):
        hist = [m for m in env.seen_history(tr) if m["role"] != "system"]
        cases += [
            {"context": hist[: 2 * t + 1], "reply": tr.shown[t], "criteria": rubrics[i][t]["criteria"]}
            for t in range(tr.T)
        ]
    scores = iter(sft.judge_by_dimension(crit_judge, cases))
    r = []
    for i, tr in enumerate(trajs):
        r_i = []
        for t in range(tr.T):
            s_t = next(scores)  # {d: [s(y_t, c) for c in C_d,t]}, None where the judge failed
            # r_t = S(y_t) under turn t's rubric; NaN where the judge failed (failed_turns leaves it out)
            r_i.append(float("nan") if s_t is None else rubric_score(rubrics[i][t], s_t))
        r.append(r_i)
    return r


def kardia_turn_rewards(crit_judge, trajs, use_format: bool) -> list[list[float]]:
    """Kardia-R1 (Rubric-as-Judge): the judge scores each shown reply on relevance, empathy, persona
    consistency and safety, and the reply's <emotion> section (the whole reply without --kardia-format) on
    emotion accuracy: does it name what this person feels (kardia_criteria)."""
    cases = []
    for tr in trajs:
        hist = [m for m in env.seen_history(tr) if m["role"] != "system"]
        replies = [m["content"] for m in tr.messages if m["role"] == "assistant"]
        for t in range(tr.T):
            reply_axes, emotion_axis = kardia_criteria(tr.scenario, hist[2 * t]["content"])
            named = env.kardia_section(replies[t], "emotion") if use_format else tr.shown[t]
            cases.append({"context": hist[: 2 * t + 1], "reply": tr.shown[t], "criteria": {"reply": reply_axes}})
            cases.append(
                {
                    "context": hist[: 2 * t + 1],
                    "reply": named or "(no emotion named)",
                    "criteria": {"emotion": [emotion_axis]},
                }
            )
    scores = iter(sft.judge_by_dimension(crit_judge, cases))
    r = []
    for tr in trajs:
        # r_t = (1/5) sum_c s_c,t + r_fmt,t over the five axes; r_fmt = 0 with the four sections, -1 without
        # (only with --kardia-format); NaN where the judge failed (failed_turns leaves it out)
        r_i = []
        for t in range(tr.T):
            s_reply, s_emotion = next(scores), next(scores)
            fmt = (0.0 if tr.formatted[t] else -1.0) if use_format else 0.0
            if s_reply is None or s_emotion is None:
                r_i.append(float("nan"))
                continue
            s = s_reply["reply"] + s_emotion["emotion"]
            r_i.append(sum(s) / len(s) + fmt)
        r.append(r_i)
    return r


def reward_parts(tr, args) -> dict[str, list[float]]:
    """Each --reward component's per-turn values for one dialogue (unweighted)."""
    parts = {}
    for name in args.reward_weights:
        if name == "idr" and "rubrics" in tr.extra and args.care_distance == "weighted":
            # with CARE the rubric's weights weight the distance (in place of --idr-weights), scaled so that
            # uniform ones give MICA's (1, 1, 1): r_t = d_t(P_{t-1}) - d_t(P_t), w_t = 3 (w_C,t, w_A,t, w_P,t). This
            # project's design, not a paper's: d_t changes every turn, so the rewards no longer sum to
            # d(P0) - d(P_T); --care-distance plain keeps MICA's potential difference
            w_t = [[3 * rb["weights"][d] for d in DIMS] for rb in tr.extra["rubrics"]]
            parts["idr"] = env.incremental_distance_rewards(tr.states, w_t, args.eps)
        elif name == "idr":
            # IDR: r_t = d(P_{t-1}) - d(P_t)
            parts["idr"] = env.incremental_distance_rewards(tr.states, args.idr_weights, args.eps)
        elif name == "rlver":
            parts["rlver"] = rlver_emotion_rewards(tr.emotions)
        else:
            parts[name] = tr.extra[name]  # care / kardia: judged per criterion in the train loop
    return parts


def cutoff_penalty(args) -> float:
    """The cut-off penalty in the reward's own units: --truncation-penalty is a share of each component's
    nominal range in one turn, weighted as the reward weights it."""
    # penalty = lambda_cut * sum_c |weight_c| * scale_c,   the per-turn scales:
    #   idr     sqrt(w_C + w_A + w_P): the IDR of a level-1 turn on every axis, far from the goal (sqrt 3); the
    #           w are --idr-weights, or with idr+care and --care-distance weighted the rubric's 3 w_t (sum 3)
    #   rlver   10 / 100: the largest change of the user's emotion in one turn
    #   care    1: the judge's scores and the rubric's weights lie in [0, 1]
    #   kardia  1: the mean criterion score lies in [0, 1]; 2 with --kardia-format (r_fmt: [-1, 1])
    weighted = "care" in args.reward_weights and args.care_distance == "weighted"
    scale = {
        "idr": math.sqrt(3.0 if weighted else sum(args.idr_weights)),
        "rlver": 0.1,
        "care": 1.0,
        "kardia": 2.0 if args.kardia_format else 1.0,
    }
    penalty = 0.0
    for name, weight in args.reward_weights.items():
        penalty += abs(weight) * scale[name]
    return args.truncation_penalty * penalty


def failed_turns(tr, args) -> list[bool]:
    """The turns a judge failed on: the EMPA judge (no state change), or CARE's or Kardia-R1's criteria judge
    (its part is NaN); any other non-finite reward too. They are left out of the loss, and counted."""
    parts = reward_parts(tr, args).values()
    return [tr.judge_failed[t] or not all(math.isfinite(part[t]) for part in parts) for t in range(tr.T)]


def turn_rewards(tr, args) -> list[float]:
    """The training reward of each turn of one dialogue: the --reward components, weighted and summed, minus
    the cut-off penalty; a failed turn gets the dialogue's mean valid reward, 0 when none is valid (for the
    returns and the group statistics only: the loss leaves it out)."""
    # r_t = sum_c weight_c * r_c,t - penalty * 1[reply t was cut off]
    r = [0.0] * tr.T
    for name, part in reward_parts(tr, args).items():
        r = [x + args.reward_weights[name] * y for x, y in zip(r, part)]
    valid = [not failed and math.isfinite(x) for failed, x in zip(failed_turns(tr, args), r)]
    penalty = cutoff_penalty(args)
    r = [x - penalty * cut for x, cut in zip(r, tr.truncated)]
    fill = [x for x, ok in zip(r, valid) if ok]
    fill = sum(fill) / len(fill) if fill else 0.0
    return [x if ok else fill for x, ok in zip(r, valid)]


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
# The update: clipped policy-gradient steps on the reply tokens
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
        return torch.repeat_interleave(
            torch.tensor([a for a in self.A if a is not None], dtype=torch.float32),
            torch.tensor([end - start for start, end in self.scored()], dtype=torch.long),
        )


def ppo_update(model, tokenizer, optimizer, scheduler, samples: list[Sample], args, acc, log_kl=False) -> dict:
    """--ppo-epochs passes over minibatches of --minibatch-size dialogues (whole scenarios, in the step's order),
    each one optimizer step with its gradient accumulated over micro-batches, the loss a
    token mean over the minibatch; then one scheduler step, always. Data-parallel (acc, accelerate's
    Accelerator, holds the processes): each process holds its own scenarios and takes its share of every
    minibatch; N and the gradients are summed over the processes (acc.reduce), so each takes the step that
    one process would take on all the dialogues."""
    device, params = next(model.parameters()).device, [p for p in model.parameters() if p.requires_grad]
    # minibatches as MICA's verl launch splits a batch: the samples come scenario by scenario (K each, in the
    # step's seeded sample order) and are cut in that order, into this process's share of each minibatch (a
    # multiple of K: main checks), so a minibatch holds whole scenarios; sorting by length happens only inside
    # one (micro_batches: padding). A dialogue with nothing to score is left out; every process gets as many
    # minibatches (empty ones where it has run out)
    size = args.minibatch_size // acc.num_processes
    minibatches = [
        [i for i in range(j, min(j + size, len(samples))) if samples[i].n_tokens() > 0]
        for j in range(0, len(samples), size)
    ]
    minibatches += [[] for _ in range(max(gather_object([len(minibatches)])) - len(minibatches))]
    total = int(acc.reduce(torch.tensor(sum(s.n_tokens() for s in samples), device=acc.device), "sum"))
    if total == 0:  # nothing to score anywhere: no update, the schedule still moves
        scheduler.step()
        return {
            "loss": math.nan,
            "clip_frac": math.nan,
            "ratio_min": math.nan,
            "ratio_max": math.nan,
            "kl": math.nan,
            "grad_norm": math.nan,
            "train_tokens": 0,
            "optimizer_steps": 0,
            "nonfinite_grads": 0,
            "empty_updates": 1,
        }
    A_tok = {i: samples[i].token_advantages() for mb in minibatches for i in mb}
    need_ref = args.kl_coef > 0 or log_kl
    old, ref = old_and_ref_logprobs(model, tokenizer, samples, minibatches, args, need_ref)
    model.train()
    # sums (and the ratio's range) kept on the device, copied once at the end
    loss_total, clipped, kl_total, ratio_lo, ratio_hi = torch.tensor(
        [0, 0, 0, math.inf, -math.inf], dtype=torch.float64, device=device
    )
    grad_norms, tokens, nonfinite_grads, n_updates = [], 0, 0, 0
    for _ in range(args.ppo_epochs):
        for mb in minibatches:
            # N: the minibatch's reply tokens, over every process (0: every dialogue in it failed, no step)
            N = int(acc.reduce(torch.tensor(sum(samples[i].n_tokens() for i in mb), device=acc.device), "sum"))
            if N == 0:
                continue
            n_updates += 1
            optimizer.zero_grad(set_to_none=True)
            for micro in micro_batches(samples, mb, args.micro_batch_size):
                ids, attn, mask = collate([samples[i] for i in micro], tokenizer.pad_token_id, device)
                logp = common.token_logprobs(model, ids, attn, mask, args.temperature)
                A = torch.cat([A_tok[i] for i in micro]).to(device)
                logp_old = torch.cat([old[i] for i in micro]) if micro[0] in old else logp.detach()
                # L = (1/N) sum_i max(-ratio_i A_i, -clip(ratio_i) A_i)  [+ beta (1/N) sum_i k3_i]
                pg, was_clipped, ratio = clipped_surrogate(logp, logp_old, A, args.clip_low, args.clip_high)
                ratio_lo, ratio_hi = torch.minimum(ratio_lo, ratio.min()), torch.maximum(ratio_hi, ratio.max())
                loss_sum = pg.sum()
                if ref:
                    kl = k3_kl(logp, torch.cat([ref[i] for i in micro]))
                    kl_total += kl.detach().sum()
                    if args.kl_coef > 0:
                        loss_sum = loss_sum + args.kl_coef * kl.sum()
                acc.backward(loss_sum / N)
                loss_total += loss_sum.detach().double() / N
                clipped += was_clipped.sum()
                tokens += len(A)
            if acc.num_processes > 1:  # the gradients summed over the processes, in one flat buffer
                grads = [torch.zeros_like(p) if p.grad is None else p.grad for p in params]
                flat = acc.reduce(torch.cat([g.reshape(-1) for g in grads]), "sum")
                for p, g in zip(params, flat.split([p.numel() for p in params])):
                    p.grad = g.view_as(p)
            grad_norm = float(torch.nn.utils.clip_grad_norm_(params, MAX_GRAD_NORM))
            if math.isfinite(grad_norm):
                optimizer.step()
                grad_norms.append(grad_norm)
            else:  # a non-finite gradient is skipped, and counted
                optimizer.zero_grad(set_to_none=True)
                nonfinite_grads += 1
    scheduler.step()
    # the sums over every process: one copy from the device, one collective
    totals = torch.stack(
        [loss_total, clipped, kl_total, torch.tensor(float(tokens), dtype=torch.float64, device=device)]
    )
    loss_total, clipped, kl_total, tokens = acc.reduce(totals, "sum").tolist()
    ratios = gather_object([(float(ratio_lo), float(ratio_hi))])  # every process's (min, max)
    # loss: the mean of the minibatch losses (the micro losses add up to a minibatch's); grad_norm: the mean over
    # the optimizer steps taken (optimizer_steps); a minibatch with a non-finite gradient is counted apart
    return {
        "loss": loss_total / n_updates,
        "clip_frac": clipped / tokens,
        "ratio_min": min(lo for lo, _ in ratios),
        "ratio_max": max(hi for _, hi in ratios),
        "kl": kl_total / tokens if need_ref else math.nan,
        "grad_norm": sum(grad_norms) / len(grad_norms) if grad_norms else math.nan,
        "train_tokens": int(tokens),
        "optimizer_steps": len(grad_norms),
        "nonfinite_grads": nonfinite_grads,
        "empty_updates": 0,
    }


@torch.no_grad()
def old_and_ref_logprobs(model, tokenizer, samples, minibatches, args, need_ref: bool) -> tuple[dict, dict]:
    """pi_old, needed only where the policy has moved since sampling: not in the first minibatch of the first
    epoch (ratio = 1: the current log-probs, detached, serve), so one epoch of one minibatch spends no extra
    forward pass. And the reference (the base, adapter off) once per rollout when the KL is used or logged."""
    device, old_from = next(model.parameters()).device, 1 if args.ppo_epochs == 1 else 0
    old, ref = {}, {}
    model.eval()
    for n, mb in enumerate(minibatches):
        if n < old_from and not need_ref:
            continue
        for micro in micro_batches(samples, mb, args.micro_batch_size):
            ids, attn, mask = collate([samples[i] for i in micro], tokenizer.pad_token_id, device)
            sizes = [samples[i].n_tokens() for i in micro]
            if n >= old_from:
                old.update(zip(micro, common.token_logprobs(model, ids, attn, mask, args.temperature).split(sizes)))
            if need_ref:
                with model.disable_adapter():
                    logp = common.token_logprobs(model, ids, attn, mask, args.temperature)
                ref.update(zip(micro, logp.split(sizes)))
    return old, ref


# ---------------------------------------------------------------------------------------------
# The main loop
# ---------------------------------------------------------------------------------------------
def train_loop(args, acc, run_dir, scenarios, model, tokenizer, judge, user, optimizer, scheduler, logger, start, care):
    rank, n_ranks = acc.process_index, acc.num_processes
    for step in tqdm(
        range(start, args.steps + 1), desc="train", initial=start - 1, total=args.steps, disable=not args.progress
    ):
        t0, before = time.time(), common.api_counts(judge, user)
        step_seed = args.seed * 100_003 + step  # every step's randomness depends on (seed, step)
        torch.manual_seed(step_seed * n_ranks + rank)  # (and on the process: each samples its own)
        if isinstance(user, offline.ScriptedUser):
            user.seed = step_seed
        batch = random.Random(step_seed).sample(scenarios, min(args.scenarios_per_step, len(scenarios)))
        batch = batch[rank::n_ranks]  # data-parallel: this process's share of the scenarios
        # 1. rollout: K dialogues per scenario, every live dialogue batched each turn
        trajs = env.rollout(model, tokenizer, batch, judge, user, args, desc=f"step {step} rollout")
        t_roll = time.time() - t0
        # 2. rewards: the --reward components per turn (cut-off penalty, failed turns filled), by scenario
        rubric_invalid = 0
        if "care" in args.reward_weights:  # CARE: each turn's rubric, then the judge per criterion
            rubrics, rubric_invalid = turn_rubrics(care[0], care[1], trajs, args)
            for tr, rb, r_care in zip(trajs, rubrics, care_turn_rewards(care[2], trajs, rubrics)):
                tr.extra["rubrics"], tr.extra["care"] = rb, r_care
        if "kardia" in args.reward_weights:  # Kardia-R1: the fixed rubric (+ the format term)
            for tr, r_k in zip(trajs, kardia_turn_rewards(care[2], trajs, args.kardia_format)):
                tr.extra["kardia"] = r_k
        groups = [[tr for tr in trajs if tr.scenario is s] for s in batch]
        rewards = [[turn_rewards(tr, args) for tr in g] for g in groups]
        # 3. advantages
        if args.advantage == "mica":
            advs = [mica_advantages(r, args.alpha, args.gamma) for r in rewards]
        elif args.advantage == "grpo":
            advs = [grpo_advantages(r) for r in rewards]
        else:  # whitened over the whole batch: every process's rewards, gathered, then this process's part
            everyone = gather_object([rewards])
            mine = sum(len(part) for part in everyone[:rank])
            advs = reinforce_pp_advantages([g for part in everyone for g in part], args.gamma)
            advs = advs[mine : mine + len(rewards)]
        # a group whose rewards are all equal (or that has one dialogue) has zero advantage and teaches
        # nothing (counted); a non-finite advantage is set to 0 (counted): its tokens add no policy gradient
        degenerate = sum(all(abs(a) < 1e-9 for A in group for a in A) for group in advs)
        nonfinite = sum(not math.isfinite(a) for group in advs for A in group for a in A)
        flat_trajs = [tr for g in groups for tr in g]
        flat_advs = [[a if math.isfinite(a) else 0.0 for a in A] for group in advs for A in group]
        failed = [failed_turns(tr, args) for tr in flat_trajs]
        # 4. update: the clipped surrogate on the reply tokens of every turn no judge failed on
        t1, lr = time.time(), optimizer.param_groups[0]["lr"]
        log_kl = args.kl_coef == 0 and args.log_kl_every > 0 and step % args.log_kl_every == 0
        upd = ppo_update(
            model, tokenizer, optimizer, scheduler, as_samples(flat_trajs, flat_advs, failed), args, acc, log_kl
        )
        # 5. log, keep the rollouts (with MICA's two terms, for the credit picture), checkpoint (data-
        # parallel: process 0 gathers every process's and writes)
        terms = (
            [t for r in rewards for t in zip(turn_level_advantages(r, args.gamma), group_level_advantages(r))]
            if args.advantage == "mica"
            else None
        )
        counts = {
            "degenerate_groups": degenerate,
            "nonfinite_advantages": nonfinite,
            **({"rubric_invalid": rubric_invalid} if "care" in args.reward_weights else {}),
            **({"format_ok": sum(sum(tr.formatted) for tr in flat_trajs)} if args.kardia_format else {}),
            **{k: v - before.get(k, 0) for k, v in common.api_counts(judge, user).items()},
        }
        records = [
            dialogue_record(args, step, tr, r, A, F, terms[i] if terms else None)
            for i, (tr, r, A, F) in enumerate(zip(flat_trajs, [r for g in rewards for r in g], flat_advs, failed))
        ]
        log_step(
            acc,
            run_dir,
            logger,
            step,
            records,
            [x for g in rewards for r in g for x in r],
            counts,
            upd,
            lr,
            t0,
            t_roll,
            time.time() - t1,
        )
        if acc.is_main_process and (step % args.save_every == 0 or step == args.steps):
            common.save_checkpoint(run_dir, step, model, optimizer, scheduler)
            plots.curves(run_dir, plots.MICA_CURVES)
        if acc.is_main_process and step in (args.credit_steps or (start, args.steps)) and args.advantage == "mica":
            plots.credit(run_dir, step)  # how MICA assigned credit (default: the first and last step)


def main(argv=None):
    args = parse_args(argv)
    common.set_seed(args.seed)
    print(args.preset_note)
    scenarios = env.load_scenarios(args.scenarios)  # inputs checked before anything is created
    common.check_model_args(args)
    # one process, or each of `accelerate launch --num_processes N`'s: NCCL on GPUs, gloo on CPUs (cpu=True)
    acc = Accelerator(cpu=not torch.cuda.is_available())
    n_ranks = acc.num_processes
    common.check(
        min(args.scenarios_per_step, len(scenarios)) >= n_ranks,
        f"--scenarios-per-step must be >= the number of processes ({n_ranks}): each takes its own",
    )
    common.check(
        args.minibatch_size % (args.k * n_ranks) == 0,
        f"--minibatch-size must be a multiple of --k x the "
        f"number of processes ({args.k} x {n_ranks}): each process's share holds whole scenarios",
    )
    args.progress = args.progress and acc.is_main_process  # one progress bar, one log: process 0's
    model, tokenizer = common.load_policy(args, trainable=True)  # every model loads before the run folder
    judge, user = env.make_judge(args, (model, tokenizer)), env.make_user(args, (model, tokenizer))
    care = load_care(args, (model, tokenizer))
    box = [str(common.open_run(args, ("metrics.jsonl", "rollouts.jsonl"))) if acc.is_main_process else None]
    run_dir = Path(broadcast_object_list(box)[0])  # process 0 made (or checked) the run folder; all write there
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer, scheduler = common.make_optimizer(params, args.lr, WEIGHT_DECAY, args.steps)
    state = common.load_checkpoint(run_dir, model, optimizer, scheduler) if args.resume else None
    start = state["step"] + 1 if state else 1  # every process loads the same checkpoint
    for p in params:  # every process starts from process 0's adapter
        broadcast(p.data)
    logger = common.MetricsLogger(run_dir) if acc.is_main_process else None
    if acc.is_main_process:
        print(
            f"run folder {run_dir} | trainable parameters {sum(p.numel() for p in params):,} | device "
            f"{common.pick_device()}"
            + (f" | data-parallel over {n_ranks} processes" if n_ranks > 1 else "")
            + (f" | resumed from {run_dir / 'checkpoint.pt'} at step {start}" if state else "")
        )
    try:
        train_loop(
            args, acc, run_dir, scenarios, model, tokenizer, judge, user, optimizer, scheduler, logger, start, care
        )
    except common.UserError:  # the judge's endpoint went down, say: keep what was learned, then stop
        common.checkpoint_on_error(run_dir, model, optimizer, scheduler, logger, start)
        raise
    if n_ranks > 1:  # the processes must hold the same adapter: checked, and each one's weight sum written down
        sums = gather_object([sum(float(p.detach().double().sum()) for p in params)])
        if acc.is_main_process:
            (run_dir / "data_parallel.json").write_text(json.dumps({"world_size": n_ranks, "adapter_sums": sums}))
            common.check(len(set(sums)) == 1, f"the {n_ranks} processes ended with different adapters: {sums}")
    if acc.is_main_process:
        model.save_pretrained(run_dir / "adapter", safe_serialization=True)
        tokenizer.save_pretrained(run_dir / "adapter")
        print(
            f"final adapter: {run_dir / 'adapter'} (05_eval.py --adapters takes it); curves: "
            f"{plots.curves(run_dir, plots.MICA_CURVES)}"
        )
    acc.end_training()


# ---------------------------------------------------------------------------------------------
# --- supporting pieces ---: the update's samples, the step log and the credit picture, CARE's rubrics and
# Kardia-R1's criteria, presets, CLI
# ---------------------------------------------------------------------------------------------
def as_samples(trajs, advs=None, failed=None) -> list[Sample]:
    """Dialogues as the update's samples: each reply's span with its turn's advantage A[k][t], None (left out
    of the loss) on a failed turn (default: where the EMPA judge failed); advs None gives every turn 0."""
    advs = advs if advs is not None else [[0.0] * tr.T for tr in trajs]
    failed = failed if failed is not None else [tr.judge_failed for tr in trajs]
    return [Sample(tr.ids, tr.spans, [None if f else a for f, a in zip(F, A)]) for tr, A, F in zip(trajs, advs, failed)]


def micro_batches(samples: list[Sample], mb: list[int], size: int) -> list[list[int]]:
    """A minibatch's micro-batches, its dialogues sorted by length (less padding; the step is the same)."""
    mb = sorted(mb, key=lambda i: len(samples[i].ids))
    return [mb[j : j + size] for j in range(0, len(mb), size)]


def collate(samples: list[Sample], pad_id, device):
    """Right-padded ids, the attention mask and the loss mask: the tokens of every reply with an advantage."""
    return common.right_pad([s.ids for s in samples], pad_id, [s.scored() for s in samples], device)


def dialogue_record(args, step, tr, r, A, failed, terms) -> dict:
    """A rollouts.jsonl line: 03's record of the dialogue with, per turn, the training reward and its parts,
    the return G_t, the advantage A (and for MICA its two terms A_turn and A_group), the failed flag."""
    rec = env.trajectory_record(tr, args, rewards=[round(x, 4) for x in r], step=step)
    parts, G = reward_parts(tr, args), discounted_returns(r, args.gamma)
    for t, turn in enumerate(rec["turns"]):
        turn.update(
            G=round(G[t], 4),
            advantage=round(A[t], 4),
            judge_failed=failed[t],
            reward_parts={k: round(v[t], 4) if math.isfinite(v[t]) else None for k, v in parts.items()},
        )
        if terms:
            turn.update(A_turn=round(terms[0][t], 4), A_group=round(terms[1][t], 4))
        if "rubrics" in tr.extra:
            turn["rubric"] = tr.extra["rubrics"][t]
    return rec


def log_step(acc, run_dir, logger, step, records, rewards, counts, upd, lr, t0, t_roll, t_upd):
    """rollouts.jsonl and one metrics line; data-parallel: process 0 gathers every process's share, writes."""
    parts = gather_object(
        [
            {
                "records": records,
                "rewards": rewards,
                "counts": counts,
                "t_roll": t_roll,
                "t_upd": t_upd,
                "rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
            }
        ]
    )
    if not acc.is_main_process:
        return  # the other processes go on to the next step
    records = [rec for part in parts for rec in part["records"]]
    rewards = [x for part in parts for x in part["rewards"]]
    turns, n = [turn for rec in records for turn in rec["turns"]], len(records)
    common.append_jsonl(run_dir / "rollouts.jsonl", records)
    logger.log(
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
            "truncated_frac": sum(turn["truncated"] for turn in turns) / max(1, len(turns)),
            "judge_failures": sum(turn["judge_failed"] for turn in turns),
            "user_failures": sum(rec["outcome"] == "user_failed" for rec in records),
            **{k: sum(part["counts"][k] for part in parts) for k in parts[0]["counts"]},
            **upd,
            "lr": lr,
            # the processes run side by side: all their tokens over the slowest one's time
            "gen_tokens_per_s": sum(turn["reply_tokens"] for turn in turns)
            / max(max(x["t_roll"] for x in parts), 1e-9),
            "train_tokens_per_s": upd["train_tokens"] / max(max(x["t_upd"] for x in parts), 1e-9),
            "step_seconds": time.time() - t0,
            "peak_rss_gb": max(x["rss"] for x in parts),  # of the largest process
        },
    )


def load_care(args, policy):
    """--reward care / kardia: (the frozen rubric generator and its tokenizer, or None; 01's criteria judge:
    embed, self (the policy's frozen base), hf: or api:); else None."""
    if not {"care", "kardia"} & set(args.reward_weights):
        return None
    gen_args = argparse.Namespace(**{**vars(args), "adapter": args.rubric_model, "gradient_checkpointing": False})
    rubric_model, rubric_tok = (
        common.load_policy(gen_args, trainable=False)
        if args.rubric_model and "care" in args.reward_weights
        else (None, None)
    )
    return rubric_model, rubric_tok, sft.CriteriaJudge(args, policy)


def turn_rubrics(rubric_model, rubric_tok, trajs, args) -> tuple[list[list[dict]], int]:
    """CARE: the rubric of every turn of every dialogue, written by the frozen generator (02's adapter) for
    the history the policy answered as the user saw it (each reply's shown part: the context the criteria
    judge reads); --rubric picks the Table-3 ablation (uniform: 01's fixed rubric). A generated rubric that
    does not parse is replaced by the fixed one, and counted."""
    contexts, where, fixed = [], [], sft.UNIFORM_RUBRIC
    for i, tr in enumerate(trajs):
        hist = [m for m in env.seen_history(tr) if m["role"] != "system"]  # what the criteria judge sees too
        for t in range(tr.T):
            contexts.append(hist[: 2 * t + 1])
            where.append((i, t))
    if args.rubric == "uniform":
        generated = [fixed] * len(contexts)
    else:
        texts = sft.generate_rubrics(rubric_model, rubric_tok, contexts, args.rubric_max_new_tokens, 0.0, 16)
        generated = [sft.parse_rubric(text)[0] for text, _, _ in texts]
    out = [[fixed] * tr.T for tr in trajs]
    for (i, t), g in zip(where, generated):
        g = g or fixed
        out[i][t] = {
            "weights": (g if args.rubric in ("adaptive", "weights-only") else fixed)["weights"],
            "criteria": (g if args.rubric in ("adaptive", "criteria-only") else fixed)["criteria"],
        }
    return out, sum(g is None for g in generated)


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


REWARDS = ("idr", "rlver", "care", "kardia")  # the per-turn reward components --reward can combine
MAX_GRAD_NORM, WEIGHT_DECAY = 1.0, 0.1  # gradient clipping; AdamW's weight decay (no warmup under 30 steps)
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
    count = common.number(int, low=1)  # argparse types: a bad value exits 2 with one line naming the flag
    p = common.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    common.add_model_args(p)
    env.add_env_args(p, scenarios_default=str(HERE / "data" / "scenarios_train.jsonl"))
    g = p.add_argument_group("algorithm")
    g.add_argument(
        "--advantage",
        choices=["mica", "grpo", "reinforce_pp"],
        default="mica",
        help="credit assignment: MICA mixed turn/group, GRPO outcome, REINFORCE++ batch-whitened",
    )
    g.add_argument(
        "--alpha", type=common.number(low=0, high=1), default=0.4, help="MICA's weight of the turn-level advantage"
    )
    g.add_argument("--gamma", type=common.number(low=0, high=1), default=0.85, help="discount of the per-turn returns")
    g.add_argument(
        "--reward",
        default="idr",
        help="per-turn reward: idr (MICA's incremental distance), rlver "
        "(the simulated user's emotion change / 100; dialogues end by RLVER's emotion rule), care (CARE's "
        "adaptive rubric, judged per criterion), kardia (Kardia-R1's fixed rubric, + its format term "
        "with --kardia-format), or a weighted sum such as idr+0.5*care",
    )
    g.add_argument("--rubric-model", default=None, help="--reward care: the frozen rubric generator (02's adapter)")
    g.add_argument(
        "--rubric",
        choices=["adaptive", "uniform", "weights-only", "criteria-only"],
        default="adaptive",
        help="CARE's Table-3 ablations: the generator's weights and criteria, or w = 1/3 and fixed "
        "generic criteria, or one of the two from the generator",
    )
    g.add_argument("--rubric-max-new-tokens", type=int, default=256, help="token cap of a generated rubric")
    g.add_argument(
        "--care-distance",
        choices=["weighted", "plain"],
        default="weighted",
        help="with idr+care: weight turn t's distance by 3 w_t of its rubric (this project's design; "
        "the rewards then do not telescope), or plain MICA IDR",
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
        "--truncation-penalty",
        type=float,
        default=0.5,
        help="a reply cut off at --max-new-tokens "
        "loses this share of one turn's nominal reward range (IDR sqrt(3), RLVER 0.1, CARE and Kardia 1)",
    )
    g.add_argument("--clip-low", type=common.number(low=0), default=0.2, help="ratio clip below: 1 - clip_low")
    g.add_argument("--clip-high", type=common.number(low=0), default=0.28, help="ratio clip above: 1 + clip_high")
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
        help="MICA: the steps whose credit picture credit_step<N>.png is drawn (default: this run's first and last)",
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
    g.add_argument("--ppo-epochs", type=count, default=1, help="passes over each rollout batch")
    g.add_argument(
        "--minibatch-size",
        type=count,
        default=8,
        help="dialogues per optimizer step (data-parallel: "
        "in all); 8 of the default 16 gives 2 optimizer steps per rollout, MICA's proportion",
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
        help="the defaults to start from: cpu (the reference CPU budget), demo (make demo), gpu (one "
        "GPU, MICA's proportions, --judge self --user self); auto = gpu with CUDA, else cpu",
    )
    common.add_run_args(p, "mica", resume="a run folder: continue from its last checkpoint", save_every=10)
    # --preset: its values become the defaults (auto: gpu with CUDA); a flag given wins
    name = p.parse_known_args(argv)[0].preset
    why = "asked" if name != "auto" else "auto: CUDA found" if common.pick_device().type == "cuda" else "auto: no CUDA"
    name = name if name != "auto" else "gpu" if common.pick_device().type == "cuda" else "cpu"
    p.set_defaults(**PRESETS[name])
    args = p.parse_args(argv)
    given = [
        f"--{k.replace('_', '-')} {v}" + ("" if getattr(args, k) == v else f" (given: {getattr(args, k)})")
        for k, v in PRESETS[name].items()
    ]
    args.preset_note = (
        f"defaults: preset {name} ({why}): "
        + (", ".join(given) or "the reference CPU defaults")
        + "; flags given win (--preset cpu | demo | gpu to choose)"
    )
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
    c(
        args.k >= 2 or args.advantage == "reinforce_pp",
        f"--k must be >= 2 for --advantage {args.advantage} (it normalises within the K), got {args.k}",
    )
    c(all(x <= args.steps for x in args.credit_steps), f"--credit-steps must lie in 1..--steps {args.steps}")
    args.reward_weights = parse_reward_spec(args.reward)
    c(
        "care" not in args.reward_weights or args.rubric == "uniform" or args.rubric_model,
        f"--reward {args.reward} with --rubric {args.rubric} needs --rubric-model (a 02_rubric_pref_rl.py adapter)",
    )
    args.emotion_ends = args.emotion_ends or "rlver" in args.reward_weights
    return args


if __name__ == "__main__":
    common.run_main(main)

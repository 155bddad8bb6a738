"""04_mica_train.py: MICA, online multi-turn RL of a support policy (LoRA) against a simulated user.

What it does
  Each step samples scenarios, rolls out K dialogues per scenario with 03_rollout's environment,
  turns the judge's state changes into per-turn rewards, assigns credit with MICA's mixed
  turn-level / group-level advantage (or GRPO, or REINFORCE++), and takes a clipped policy-gradient
  step on the assistant tokens of every turn.

Reads   data/scenarios_train.jsonl (or --scenarios), the policy model (--model, default: the packaged
        SmolLM2-135M-Instruct), the judge and user backends (03_rollout flags).
Writes  runs/<name>-<time>/ : args.json, metrics.jsonl (one line per step), rollouts.jsonl (every
        trajectory with rewards and advantages), checkpoints/step_N/ (adapter, optimizer, scheduler,
        RNG, step; written atomically), adapter/ (the final LoRA adapter, standard peft format).

Equations (MICA, REFERENCE.md section 2; the code below writes each out as a loop)
  distance      d(P) = sqrt( sum_a w_a max(0, -eps - P_a)^2 )                       (03_rollout)
  IDR           r_t = d(P_{t-1}) - d(P_t)                                   (--reward idr, the default)
  RLVER         r_t = (e_t - e_{t-1}) / 100, e the simulated user's emotion (03)  (--reward rlver; with it
                dialogues end at e >= 100 or e < 10); sums such as --reward idr+0.5*rlver
  CARE          r_t = sum_d w_d,t s_d,t: the frozen generator (--rubric-model, 02) writes turn t's rubric,
                the judge scores the reply on its criteria (02's criteria judge: embed, hf:, api:);
                with idr+care the distance uses w_t = 3 (w_C,t, w_A,t, w_P,t) (uniform = MICA's 1,1,1);
                --rubric adaptive | uniform | weights-only | criteria-only (Table-3 ablations)
  Kardia-R1     r_t = (1/5) sum_c s_c,t over relevance, empathy, persona consistency, safety, fluency,
                + r_fmt (0 with the <understanding><reasoning><emotion><response> format, -1 without;
                with --kardia-format, where only <response> reaches the user and the judge)
  return        G_t = sum_{j >= t} gamma^(j - t) r_j                       (within one trajectory)
  turn-level    A_turn[k][t] = (G[k][t] - mean_t) / (std_t + 1e-6)   over the k that reached turn t
  group-level   A_group[k][t] = (r[k][t] - mean) / (std + 1e-6)       over all sum_k T_k rewards
  MICA          A[k][t] = alpha A_turn[k][t] + (1 - alpha) A_group[k][t]   (std: sample, ddof = 1)
  GRPO          R_k = sum_t r[k][t];  A[k][t] = (R_k - mean_K) / (std_K + 1e-6) for every t
  REINFORCE++   A = (G - mean) / (std + 1e-6) over every turn of every trajectory in the batch
  update        ratio = exp(log pi(y_i) - log pi_old(y_i)) per assistant token i, A_i = A[k][t(i)]
                L = (1/N) sum_i max(-ratio_i A_i, -clip(ratio_i, 1 - eps_low, 1 + eps_high) A_i)
                    + beta (1/N) sum_i [exp(ref_i - logp_i) - (ref_i - logp_i) - 1]   (k3 KL to the
                    base model with the adapter off; beta = --kl-coef, 0 by default as in MICA)

Departures from the paper (and why)
  1. LoRA instead of full fine-tuning, so lr is 1e-3 instead of 1e-6: a fresh LoRA adapter needs a much
     larger step (at 1e-4, 20 steps moved SmolLM2 by a KL of 0.008 and it did not learn; at 1e-3 it did,
     README "Learning, measured"). For a 7B model start at 1e-5 to 1e-4.
  2. Short episodes by default (3 turns of at most 48 tokens; MICA trains on 8-15) and 4 scenarios x K=4 per step
     (MICA: 16 x 4), so that a laptop CPU can run it; raise --max-turns / --scenarios-per-step on a GPU.
  3. A reply cut off at --max-new-tokens loses --truncation-penalty from its turn's reward: without
     it a small policy drifts to the token cap.
  4. A turn the judge failed on is left out of the loss; for the returns and group statistics its
     reward is the trajectory's mean valid reward (as the public code fills it).
  5. REINFORCE++ discounts per turn (rewards sit on turn ends) and whitens per turn, not per token.
  6. Old log-probs: with one optimizer step per rollout (the default) the policy that sampled is the
     policy being updated, so old log-probs are the current ones detached (ratio = 1) and no extra
     forward pass is spent; with more PPO epochs or minibatches they are computed once per rollout
     (not for the first minibatch of the first epoch, which the unchanged policy updates).

CPU:  python 04_mica_train.py                          (SmolLM2, embed judge, scripted user, ~80 s/step)
GPU:  python 04_mica_train.py --model Qwen2.5-7B-Instruct --judge api:Qwen2.5-72B-Instruct \\
          --user api:Qwen2.5-72B-Instruct --api-base http://localhost:8000/v1 --max-turns 15 \\
          --scenarios-per-step 16 --max-new-tokens 256 --lr 1e-5
N GPUs: accelerate launch --num_processes N 04_mica_train.py ... (data-parallel: each process rolls out
        its share of the step's scenarios, gradients and token counts are summed over the processes,
        process 0 writes everything; see the README's "Performance and scale")
"""
from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import math
import os
import random
import resource
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint
from tqdm import tqdm

import common

env = importlib.import_module("03_rollout")  # the environment: scenarios, judge, user, rollout
HERE = Path(__file__).resolve().parent


# ---------------------------------------------------------------------------------------------
# Rewards and advantages: the equations, one loop each
# ---------------------------------------------------------------------------------------------
def incremental_distance_rewards(states, weights=(1.0, 1.0, 1.0), eps=1.0) -> list[float]:
    """states = [P0, P1, ..., PT] of one trajectory -> [r_1, ..., r_T]."""
    # r_t = d(P_{t-1}) - d(P_t),  d(P) = sqrt( sum_a w_a max(0, -eps - P_a)^2 )
    r = []
    for t in range(1, len(states)):
        r.append(env.hinge_distance(states[t - 1], weights, eps) - env.hinge_distance(states[t], weights, eps))
    return r


def _mean_std(xs):
    """Mean and sample standard deviation (ddof = 1) of a list with at least 2 values."""
    mean = sum(xs) / len(xs)
    std = math.sqrt(sum((x - mean) ** 2 for x in xs) / (len(xs) - 1))
    return mean, std


def discounted_returns(r, gamma) -> list[float]:
    # G_t = sum_{j >= t} gamma^(j - t) r_j, computed backwards: G_t = r_t + gamma * G_{t+1}
    G, running = [0.0] * len(r), 0.0
    for t in reversed(range(len(r))):
        running = r[t] + gamma * running
        G[t] = running
    return G


def mica_advantages(rewards, alpha, gamma) -> list[list[float]]:
    """rewards[k][t] for one scenario's K trajectories (lengths may differ) -> A[k][t]."""
    K = len(rewards)
    G = [discounted_returns(rewards[k], gamma) for k in range(K)]
    T_max = max((len(r) for r in rewards), default=0)
    # turn-level: A_turn[k][t] = (G[k][t] - mean_t) / (std_t + 1e-6) over the k that reached turn t
    A_turn = [[0.0] * len(rewards[k]) for k in range(K)]
    for t in range(T_max):
        reached = [k for k in range(K) if len(rewards[k]) > t]
        if len(reached) < 2:
            continue  # fewer than 2 trajectories reached turn t: A_turn = 0
        mean_t, std_t = _mean_std([G[k][t] for k in reached])
        for k in reached:
            A_turn[k][t] = (G[k][t] - mean_t) / (std_t + 1e-6)
    # group-level: A_group[k][t] = (r[k][t] - mean) / (std + 1e-6) over all sum_k T_k rewards
    A_group = [[0.0] * len(rewards[k]) for k in range(K)]
    flat = [x for r in rewards for x in r]
    if len(flat) >= 2:
        mean, std = _mean_std(flat)
        for k in range(K):
            for t in range(len(rewards[k])):
                A_group[k][t] = (rewards[k][t] - mean) / (std + 1e-6)
    # mixed: A = alpha * A_turn + (1 - alpha) * A_group
    return [[alpha * A_turn[k][t] + (1 - alpha) * A_group[k][t] for t in range(len(rewards[k]))]
            for k in range(K)]


def grpo_advantages(rewards) -> list[list[float]]:
    """rewards[k][t] for one scenario -> A[k][t] = normalised trajectory outcome, same on every turn."""
    # R_k = sum_t r[k][t];  A_k = (R_k - mean_K) / (std_K + 1e-6);  0 when K < 2
    R = [sum(r) for r in rewards]
    if len(R) < 2:
        return [[0.0] * len(r) for r in rewards]
    mean, std = _mean_std(R)
    return [[(R[k] - mean) / (std + 1e-6)] * len(rewards[k]) for k in range(len(rewards))]


def reinforce_pp_advantages(batch_rewards, gamma) -> list[list[list[float]]]:
    """batch_rewards[s][k][t] for the whole batch -> A[s][k][t]: returns whitened over the batch
    (in data-parallel training over every rank's batch: the sums below are summed over the ranks)."""
    # G_t per trajectory, then A = (G - mean) / (std + 1e-6) over every turn in the batch (no grouping)
    G = [[discounted_returns(r, gamma) for r in group] for group in batch_rewards]
    flat = [x for group in G for g in group for x in g]
    n, total = all_reduce([len(flat), sum(flat)])
    if n < 2:
        return [[[0.0] * len(g) for g in group] for group in G]
    mean = total / n
    # sample std (ddof = 1): sqrt( sum (G - mean)^2 / (n - 1) )
    std = math.sqrt(all_reduce([sum((x - mean) ** 2 for x in flat)])[0] / (n - 1))
    return [[[(x - mean) / (std + 1e-6) for x in g] for g in group] for group in G]


def rlver_emotion_rewards(emotions) -> list[float]:
    """emotions = [e_0, ..., e_T] kept by the simulated user -> [r_1, ..., r_T]."""
    # RLVER: r_t = (e_t - e_{t-1}) / 100. Its sum is (e_T - e_0)/100, so GRPO on this sum ranks a
    # group exactly as RLVER's outcome reward e_T/100 does (e_0 is the same for every k).
    return [(emotions[t] - emotions[t - 1]) / 100 for t in range(1, len(emotions))]


REWARDS = ("idr", "rlver", "care", "kardia")  # the per-turn reward components --reward can combine
DIMS = ("cognitive", "affective", "proactive")
# --rubric uniform (and the fixed half of weights-only / criteria-only): CARE's "fixed rubric" ablation
UNIFORM_RUBRIC = {"weights": {d: 1 / 3 for d in DIMS},
                  "criteria": {"cognitive": ["Shows it understands the person's situation and what they said"],
                               "affective": ["Recognises and validates the person's feelings"],
                               "proactive": ["Helps the person find a concrete, manageable next step"]}}


def turn_rubrics(rubric_model, rubric_tok, trajs, args) -> tuple[list[list[dict]], int]:
    """CARE: the rubric of every turn of every trajectory, written by the frozen generator (02's
    adapter) for the context the policy answered; --rubric picks the Table-3 ablation. A generated
    rubric that does not parse is replaced by the uniform one and counted."""
    sft = importlib.import_module("01_rubric_sft")        # the rubric prompt, parser and generation
    contexts, where = [], []
    for i, tr in enumerate(trajs):
        replies = [j for j, m in enumerate(tr.messages) if m["role"] == "assistant"]
        for t, j in enumerate(replies[: tr.T]):
            contexts.append([m for m in tr.messages[:j] if m["role"] != "system"])
            where.append((i, t))
    if args.rubric == "uniform":
        generated = [UNIFORM_RUBRIC] * len(contexts)
    else:
        texts = sft.generate_rubrics(rubric_model, rubric_tok, contexts, args.rubric_max_new_tokens, 0.0, 16)
        generated = [sft.parse_rubric(text)[0] for text, _, _ in texts]
    invalid = sum(g is None for g in generated)
    out = [[UNIFORM_RUBRIC] * tr.T for tr in trajs]
    for (i, t), g in zip(where, generated):
        g = g or UNIFORM_RUBRIC
        out[i][t] = {"weights": g["weights"] if args.rubric in ("adaptive", "weights-only") else UNIFORM_RUBRIC["weights"],
                     "criteria": g["criteria"] if args.rubric in ("adaptive", "criteria-only") else UNIFORM_RUBRIC["criteria"]}
    return out, invalid


def kardia_criteria(scenario: dict) -> list[str]:
    """Kardia-R1's fixed rubric; persona consistency is judged against the scenario's profile (MBTI,
    about, situation, emotion) when it has one, else its persona line."""
    prof = scenario.get("profile")
    who = "; ".join(f"{k}: {v}" for k, v in prof.items()) if isinstance(prof, dict) else scenario.get("persona", "")
    return ["Relevance: responds directly to what the person just said",
            "Empathy: recognises the person's feelings and responds to them warmly",
            f"Persona consistency: fits who this person is ({who})",
            "Safety: nothing harmful, dismissive, judgemental or unsafe",
            "Fluency: clear, natural, well-formed language"]


def kardia_turn_rewards(crit_judge, trajs, use_format: bool) -> list[list[float]]:
    """Kardia-R1 (Rubric-as-Judge): the judge scores each shown reply on the fixed rubric."""
    items = []
    for tr in trajs:
        hist = [m for m in env.seen_history(tr) if m["role"] != "system"]
        for t in range(tr.T):
            items.append({"context": hist[: 2 * t + 1], "reply": tr.shown[t], "criteria": kardia_criteria(tr.scenario)})
    scores = iter(crit_judge.score(items))
    r = []
    for tr in trajs:
        # r_t = (1/5) sum_c s_c,t  +  r_fmt,t   (r_fmt = 0 for the 4-section format, -1 without it;
        # only with --kardia-format);  a turn the judge failed on is NaN: left out as failed
        r_i = []
        for t in range(tr.T):
            s = next(scores)
            fmt = (0.0 if tr.formatted[t] else -1.0) if use_format else 0.0
            r_i.append(float("nan") if s is None else sum(s) / len(s) + fmt)
        r.append(r_i)
    return r


def care_turn_rewards(crit_judge, trajs, rubrics) -> list[list[float]]:
    """r_t for every turn: the judge scores the reply on each criterion of its turn's rubric."""
    items, where = [], []
    for i, tr in enumerate(trajs):
        hist = [m for m in env.seen_history(tr) if m["role"] != "system"]
        for t in range(tr.T):
            for d in DIMS:
                items.append({"context": hist[: 2 * t + 1], "reply": tr.shown[t],
                              "criteria": rubrics[i][t]["criteria"][d]})
                where.append((i, t, d))
    scores = crit_judge.score(items)
    s = [[{} for _ in range(tr.T)] for tr in trajs]
    for (i, t, d), sc in zip(where, scores):
        s[i][t][d] = sc
    r = []
    for i, tr in enumerate(trajs):
        # CARE: r_t = sum_d w_d,t * s_d,t,  s_d,t = mean over dimension d's criteria of the judge's score
        # (a turn the judge failed on is NaN here: turn_rewards then treats it as failed)
        r_i = []
        for t in range(tr.T):
            if any(s[i][t][d] is None for d in DIMS):
                r_i.append(float("nan"))
                continue
            r_i.append(sum(rubrics[i][t]["weights"][d] * sum(s[i][t][d]) / len(s[i][t][d]) for d in DIMS))
        r.append(r_i)
    return r


def parse_reward_spec(spec: str) -> dict[str, float]:
    """'idr', 'rlver', 'idr+0.5*rlver' -> {component: weight}."""
    out = {}
    for term in spec.replace(" ", "").split("+"):
        weight, _, name = term.rpartition("*")
        common.check(name in REWARDS, f"--reward: unknown component '{name}' in '{spec}'; "
                                      f"choose from {', '.join(REWARDS)} (e.g. idr+0.5*rlver)")
        try:
            out[name] = out.get(name, 0.0) + (float(weight) if weight else 1.0)
        except ValueError:
            raise common.UserError(f"--reward: '{weight}' in '{term}' is not a number") from None
    return out


def reward_parts(tr, args) -> dict[str, list[float]]:
    """Each --reward component's per-turn values for one trajectory (unweighted)."""
    parts = {}
    for name in args.reward_weights:
        if name == "idr" and "rubrics" in tr.extra:
            # with CARE the rubric's weights also weight the distance, scaled so that uniform weights
            # give MICA's (1, 1, 1): w_t = 3 * (w_C,t, w_A,t, w_P,t)
            parts["idr"] = []
            for t, rb in enumerate(tr.extra["rubrics"]):
                w_t = [3 * rb["weights"][d] for d in DIMS]
                parts["idr"].append(env.hinge_distance(tr.states[t], w_t, args.eps)
                                    - env.hinge_distance(tr.states[t + 1], w_t, args.eps))
        elif name == "idr":
            parts["idr"] = incremental_distance_rewards(tr.states, args.idr_weights, args.eps)
        elif name == "rlver":
            parts["rlver"] = rlver_emotion_rewards(tr.emotions)
        else:
            parts[name] = tr.extra[name]        # care / kardia: judged per criterion in the train loop
    return parts


def turn_rewards(tr, args) -> list[float]:
    """Per-turn training reward of one trajectory: the --reward components, weighted and summed, minus
    the cut-off penalty; a turn the judge failed on (or a non-finite value) gets the trajectory's mean
    valid reward."""
    # r_t = sum_c weight_c * r_c,t - truncation_penalty * 1[reply t was cut off]
    r = [0.0] * tr.T
    for name, part in reward_parts(tr, args).items():
        r = [x + args.reward_weights[name] * y for x, y in zip(r, part)]
    valid = [not failed and math.isfinite(x) for failed, x in zip(tr.judge_failed, r)]
    r = [x - args.truncation_penalty * cut for x, cut in zip(r, tr.truncated)]
    fill = [x for x, ok in zip(r, valid) if ok]
    fill = sum(fill) / len(fill) if fill else 0.0
    return [x if ok else fill for x, ok in zip(r, valid)]


# ---------------------------------------------------------------------------------------------
# Data-parallel training (`accelerate launch --num_processes N`, or torchrun): a few collectives
# over torch.distributed, each a no-op in a single process
# ---------------------------------------------------------------------------------------------
def init_distributed():
    """Join the process group when a launcher started N > 1 processes (it sets WORLD_SIZE, RANK,
    MASTER_ADDR): NCCL with GPUs (one per process, LOCAL_RANK), gloo on CPUs."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        if torch.cuda.is_available():
            torch.cuda.set_device(common.pick_device())
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")


def world() -> tuple[int, int]:
    """(rank, number of processes): (0, 1) when not launched data-parallel."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _dist_device():
    return common.pick_device() if dist.get_backend() == "nccl" else torch.device("cpu")


def all_reduce(values, op="sum") -> list[float]:
    """A few numbers summed (or max) over the ranks; unchanged in a single process."""
    if world()[1] == 1:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=_dist_device())
    dist.all_reduce(t, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
    return t.tolist()


def all_reduce_grads(params):
    """Sum the gradients over the ranks: one flat buffer, one call (a rank with nothing to learn
    from in this minibatch adds zeros)."""
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    for p, g in zip(params, flat.split([p.numel() for p in params])):
        p.grad = g.view_as(p)


def gather(obj) -> list:
    """Every rank's obj (picklable), in rank order; [obj] in a single process."""
    if world()[1] == 1:
        return [obj]
    out = [None] * world()[1]
    dist.all_gather_object(out, obj)
    return out


def from_rank0(obj):
    """Rank 0's obj on every rank (e.g. the run folder it created)."""
    if world()[1] == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def adapter_sha256(model) -> str:
    """A fingerprint of the trainable (LoRA) weights: equal on every rank when they stay in step."""
    h = hashlib.sha256()
    for name, p in model.named_parameters():
        if p.requires_grad:
            h.update(name.encode())
            h.update(p.detach().float().cpu().numpy().tobytes())
    return h.hexdigest()


# ---------------------------------------------------------------------------------------------
# Log-probabilities and the clipped surrogate
# ---------------------------------------------------------------------------------------------
LOGIT_CHUNK = 2**27   # logits per chunk of the LM head (0.5 GB in fp32); see token_logprobs


def token_logprobs(model, input_ids, attention_mask, loss_mask, temperature=1.0):
    """log pi(token) for every position where loss_mask is 1, flat [N] in row-major order.

    Memory-light: the LM head runs only on the N scored positions, not on all B x L, and in chunks of
    at most LOGIT_CHUNK logits whose values are recomputed in the backward pass instead of kept (with a
    152k vocabulary, 7680 scored tokens would otherwise hold ~12 GB of logits and their gradient)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    hidden = base.get_decoder()(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
    pick = loss_mask[:, 1:].bool()                              # position j predicts token j + 1
    h = hidden[:, :-1][pick]                                    # [N, H]
    targets = input_ids[:, 1:][pick]                            # [N]
    head = base.get_output_embeddings()

    def logp(h, targets):
        logits = head(h).float()                                # [n, V]
        if temperature > 0 and temperature != 1.0:
            logits = logits / temperature                       # the distribution that sampled
        # log softmax at the sampled token: logit - logsumexp(logits)
        return logits.gather(-1, targets[:, None]).squeeze(-1) - torch.logsumexp(logits, dim=-1)

    rows = max(1, LOGIT_CHUNK // head.weight.shape[0])
    if len(h) <= rows:
        return logp(h, targets)                                 # the usual case for short dialogues
    chunk = (lambda *x: checkpoint(logp, *x, use_reentrant=False)) \
        if torch.is_grad_enabled() else logp
    return torch.cat([chunk(h[j:j + rows], targets[j:j + rows]) for j in range(0, len(h), rows)])


def clipped_surrogate(logp, logp_old, A, clip_low, clip_high):
    """Per-token loss -min(ratio A, clip(ratio, 1 - clip_low, 1 + clip_high) A) and a clipped flag."""
    ratio = torch.exp(logp - logp_old)
    unclipped = -ratio * A
    clipped = -torch.clamp(ratio, 1 - clip_low, 1 + clip_high) * A
    return torch.maximum(unclipped, clipped), (clipped > unclipped).float()


def k3_kl(logp, logp_ref):
    # KL(pi || ref) per token, k3 estimator: exp(ref - logp) - (ref - logp) - 1  (>= 0)
    d = logp_ref - logp
    return torch.exp(d) - d - 1


def collate(trajs, pad_id, device):
    """Right-padded ids, attention mask and the loss mask (the assistant tokens of every turn the
    judge did not fail on) for a list of trajectories."""
    L = max(len(tr.ids) for tr in trajs)
    ids = torch.full((len(trajs), L), pad_id, dtype=torch.long)
    attn = torch.zeros((len(trajs), L), dtype=torch.long)
    mask = torch.zeros((len(trajs), L), dtype=torch.long)
    for b, tr in enumerate(trajs):
        ids[b, : len(tr.ids)] = torch.tensor(tr.ids)
        attn[b, : len(tr.ids)] = 1
        for (s, e), failed in zip(tr.spans, tr.judge_failed):
            if not failed:
                mask[b, s:e] = 1
    return ids.to(device), attn.to(device), mask.to(device)


def token_advantages(tr, A) -> torch.Tensor:
    """Every token of turn t gets A[t] (flat, in the order token_logprobs returns them)."""
    turns = [(e - s, a) for (s, e), failed, a in zip(tr.spans, tr.judge_failed, A) if not failed]
    return torch.repeat_interleave(torch.tensor([a for _, a in turns], dtype=torch.float32),
                                   torch.tensor([n for n, _ in turns], dtype=torch.long))


def n_scored(tr) -> int:
    return sum(e - s for (s, e), failed in zip(tr.spans, tr.judge_failed) if not failed)


def ppo_update(model, tokenizer, optimizer, scheduler, trajs, advs, args, log_kl: bool) -> dict:
    """PPO epochs over minibatches of trajectories (sorted by length to cut padding), gradient
    accumulation over micro-batches, token-mean loss over each minibatch, grad clipping.
    The statistics stay on the device until one copy at the end (no sync per micro-batch).

    Data-parallel: each rank holds its own trajectories and takes 1/world of every minibatch; the
    token count N of a minibatch and the gradients are summed over the ranks before the step, so every
    rank takes the same step, the one a single process would take on all the trajectories."""
    device = next(model.parameters()).device
    pad = tokenizer.pad_token_id
    params = [p for p in model.parameters() if p.requires_grad]
    n_ranks = world()[1]
    keep = [i for i, tr in enumerate(trajs) if n_scored(tr) > 0]   # nothing to learn from the rest
    order = sorted(keep, key=lambda i: len(trajs[i].ids))
    size = math.ceil(args.minibatch_size / n_ranks)               # this rank's share of a minibatch
    minibatches = [order[j:j + size] for j in range(0, len(order), size)]
    n_mb = int(all_reduce([len(minibatches)], op="max")[0])         # every rank steps as often
    minibatches += [[] for _ in range(n_mb - len(minibatches))]
    if n_mb == 0:
        return {"loss": float("nan"), "clip_frac": float("nan"), "kl": float("nan"),
                "grad_norm": float("nan"), "train_tokens": 0, "skipped_updates": 1}
    A_tok = {i: token_advantages(trajs[i], advs[i]) for i in order}

    def micro_batches(mb):
        return [mb[j:j + args.micro_batch_size] for j in range(0, len(mb), args.micro_batch_size)]

    # old log-probs pi_old: needed only where the policy has moved since sampling. In the first
    # minibatch of the first epoch it has not (ratio = 1), so the current log-probs, detached, serve;
    # with one epoch and one minibatch (the default) no extra forward pass is spent at all.
    old_from = 1 if args.ppo_epochs == 1 else 0           # the first minibatch that needs pi_old
    old, ref = {}, {}
    need_ref = args.kl_coef > 0 or log_kl
    if len(minibatches) > old_from or need_ref:
        model.eval()
        with torch.no_grad():
            for n, mb in enumerate(minibatches):
                if n < old_from and not need_ref:
                    continue
                for micro in micro_batches(mb):
                    ids, attn, mask = collate([trajs[i] for i in micro], pad, device)
                    sizes = [n_scored(trajs[i]) for i in micro]
                    if n >= old_from:
                        old.update(zip(micro, token_logprobs(model, ids, attn, mask, args.temperature).split(sizes)))
                    if need_ref:  # the reference: the base model, adapter off; once per rollout
                        with model.disable_adapter():
                            lp = token_logprobs(model, ids, attn, mask, args.temperature)
                        ref.update(zip(micro, lp.split(sizes)))
    model.train()
    zero = lambda: torch.zeros((), dtype=torch.float64, device=device)  # noqa: E731
    loss_total, clipped, kl_total = zero(), zero(), zero()   # summed on the device, copied once
    grad_norms, tokens, nonfinite_grad = [], 0, 0
    for _ in range(args.ppo_epochs):
        for mb in minibatches:
            N = all_reduce([sum(n_scored(trajs[i]) for i in mb)])[0]  # token-mean over the minibatch
            optimizer.zero_grad(set_to_none=True)
            for micro in micro_batches(mb):
                ids, attn, mask = collate([trajs[i] for i in micro], pad, device)
                logp = token_logprobs(model, ids, attn, mask, args.temperature)
                A = torch.cat([A_tok[i] for i in micro]).to(device)
                logp_old = torch.cat([old[i] for i in micro]) if micro[0] in old else logp.detach()
                pg, was_clipped = clipped_surrogate(logp, logp_old, A, args.clip_low, args.clip_high)
                loss_sum = pg.sum()
                if ref:
                    kl = k3_kl(logp, torch.cat([ref[i] for i in micro]))
                    kl_total += kl.detach().sum()
                    if args.kl_coef > 0:
                        loss_sum = loss_sum + args.kl_coef * kl.sum()
                (loss_sum / N).backward()
                loss_total += loss_sum.detach().double() / N
                clipped += was_clipped.sum()
                tokens += len(A)
            if n_ranks > 1:
                all_reduce_grads(params)                          # sum over ranks: the minibatch's gradient
            gn = torch.nn.utils.clip_grad_norm_(params, args.max_grad_norm)
            grad_norms.append(float(gn))                          # one sync per optimizer step
            if math.isfinite(grad_norms[-1]):
                optimizer.step()
            else:
                optimizer.zero_grad(set_to_none=True)
                nonfinite_grad += 1
    scheduler.step()
    loss_total, clipped, kl_total, tokens = all_reduce(torch.stack([loss_total, clipped, kl_total]).tolist()
                                                       + [tokens])          # one copy, one collective
    n_updates = args.ppo_epochs * n_mb                    # the micro losses add up to one minibatch's loss
    return {"loss": loss_total / n_updates, "clip_frac": clipped / tokens,
            "kl": kl_total / tokens if need_ref else float("nan"), "grad_norm": sum(grad_norms) / len(grad_norms),
            "train_tokens": int(tokens), "skipped_updates": nonfinite_grad}


def cosine_with_warmup(step, total, warmup):
    # lr factor: step / warmup during warmup, then 0.5 (1 + cos(pi * progress)) down to 0
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


# ---------------------------------------------------------------------------------------------
# Config and main loop
# ---------------------------------------------------------------------------------------------
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    common.add_model_args(p)
    env.add_env_args(p, scenarios_default=str(HERE / "data" / "scenarios_train.jsonl"))
    g = p.add_argument_group("algorithm")
    g.add_argument("--advantage", choices=["mica", "grpo", "reinforce_pp"], default="mica",
                   help="credit assignment: MICA mixed turn/group, GRPO outcome, REINFORCE++ batch-whitened")
    g.add_argument("--alpha", type=float, default=0.4, help="MICA weight of the turn-level advantage")
    g.add_argument("--gamma", type=float, default=0.85, help="discount of the per-turn returns")
    g.add_argument("--reward", default="idr",
                   help="per-turn reward: idr (MICA's incremental distance), rlver (change of the simulated "
                        "user's emotion / 100; also ends dialogues by RLVER's emotion rule), care (CARE's "
                        "adaptive rubric, judged per criterion), kardia (Kardia-R1's fixed rubric, plus its "
                        "format term with --kardia-format), or a weighted sum such as idr+0.5*care")
    g.add_argument("--rubric-model", default=None,
                   help="--reward care: the frozen rubric generator, a 02_rubric_pref_rl.py adapter folder")
    g.add_argument("--rubric-base", default=None, help="the generator's base model (default: --model)")
    g.add_argument("--rubric", choices=["adaptive", "uniform", "weights-only", "criteria-only"], default="adaptive",
                   help="CARE's Table-3 ablations: the generator's weights and criteria, or w = 1/3 and fixed "
                        "generic criteria, or one of the two from the generator")
    g.add_argument("--rubric-max-new-tokens", type=int, default=256, help="token cap of a generated rubric")
    g.add_argument("--idr-weights", default="1,1,1", help="w = (w_C, w_A, w_P) of the hinge distance")
    g.add_argument("--truncation-penalty", type=float, default=1.0,
                   help="subtracted from the reward of a reply cut off at --max-new-tokens")
    g.add_argument("--clip-low", type=float, default=0.2, help="ratio clip below: 1 - clip_low")
    g.add_argument("--clip-high", type=float, default=0.28, help="ratio clip above: 1 + clip_high")
    g.add_argument("--kl-coef", type=float, default=0.0, help="beta of the k3 KL to the base model (0 = off)")
    g.add_argument("--log-kl-every", type=int, default=5,
                   help="when --kl-coef is 0, measure the KL to the base every N steps (one no-grad forward)")
    g = p.add_argument_group("optimisation")
    g.add_argument("--steps", type=int, default=20, help="training steps (rollout + update)")
    g.add_argument("--scenarios-per-step", type=int, default=4, help="scenarios per step (each gets K rollouts; data-parallel: in all, shared out)")
    g.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (AdamW; LoRA on SmolLM2, see README)")
    g.add_argument("--weight-decay", type=float, default=0.1, help="AdamW weight decay")
    g.add_argument("--warmup-ratio", type=float, default=0.05, help="share of steps with linear warmup")
    g.add_argument("--ppo-epochs", type=int, default=1, help="passes over each rollout batch")
    g.add_argument("--minibatch-size", type=int, default=64, help="trajectories per optimizer step (data-parallel: in all)")
    g.add_argument("--micro-batch-size", type=int, default=2,
                   help="trajectories per forward/backward, per process (gradient accumulation up to a minibatch); "
                        "activations cost ~2.4 MB per token for SmolLM2-135M in fp32")
    g.add_argument("--max-grad-norm", type=float, default=1.0, help="gradient clipping")
    g = p.add_argument_group("run")
    g.add_argument("--seed", type=int, default=0, help="random seed")
    g.add_argument("--out-dir", default="runs", help="each run writes into its own folder under this")
    g.add_argument("--run-name", default="mica", help="prefix of the run folder")
    g.add_argument("--resume", default=None, help="a run folder: continue from its last checkpoint")
    g.add_argument("--save-every", type=int, default=10, help="checkpoint every N steps")
    g.add_argument("--keep-checkpoints", type=int, default=2, help="how many checkpoints to keep")
    g.add_argument("--track", choices=["tensorboard", "wandb"], default=None, help="also log metrics there")
    args = p.parse_args(argv)
    env.check_env_args(args)
    c = common.check
    c(0.0 <= args.alpha <= 1.0, f"--alpha must be in [0, 1], got {args.alpha}")
    c(0.0 <= args.gamma <= 1.0, f"--gamma must be in [0, 1], got {args.gamma}")
    c(args.k >= 2 or args.advantage == "reinforce_pp",
      f"--k must be >= 2 for --advantage {args.advantage} (it normalises within the K), got {args.k}")
    c(args.steps >= 1, f"--steps must be >= 1, got {args.steps}")
    c(args.scenarios_per_step >= 1, f"--scenarios-per-step must be >= 1, got {args.scenarios_per_step}")
    c(args.lr > 0, f"--lr must be > 0, got {args.lr}")
    c(args.ppo_epochs >= 1, f"--ppo-epochs must be >= 1, got {args.ppo_epochs}")
    c(args.minibatch_size >= 1 and args.micro_batch_size >= 1, "--minibatch-size and --micro-batch-size must be >= 1")
    c(args.clip_low >= 0 and args.clip_high >= 0, "--clip-low and --clip-high must be >= 0")
    c(args.kl_coef >= 0, f"--kl-coef must be >= 0, got {args.kl_coef}")
    c(args.save_every >= 1 and args.keep_checkpoints >= 1, "--save-every and --keep-checkpoints must be >= 1")
    try:
        args.idr_weights = tuple(float(x) for x in args.idr_weights.split(","))
    except ValueError:
        raise common.UserError(f"--idr-weights must be 3 comma-separated numbers, got '{args.idr_weights}'") from None
    c(len(args.idr_weights) == 3 and min(args.idr_weights) >= 0,
      f"--idr-weights must be 3 non-negative numbers, got {args.idr_weights}")
    args.reward_weights = parse_reward_spec(args.reward)
    c("care" not in args.reward_weights or args.rubric == "uniform" or args.rubric_model,
      f"--reward {args.reward} with --rubric {args.rubric} needs --rubric-model (a 02_rubric_pref_rl.py adapter)")
    args.emotion_ends = args.emotion_ends or "rlver" in args.reward_weights
    return args


def main(argv=None):
    args = parse_args(argv)
    common.set_seed(args.seed)
    scenarios = env.load_scenarios(args.scenarios)  # validate inputs before creating anything
    common.check_model_args(args)
    init_distributed()                              # N processes under accelerate launch; else nothing
    rank, n_ranks = world()
    common.check(min(args.scenarios_per_step, len(scenarios)) >= n_ranks,
                 f"--scenarios-per-step must be >= the number of processes ({n_ranks}): each takes its own")
    args.progress = args.progress and rank == 0     # one progress bar, one log: rank 0's
    run_dir = common.open_run(args, ("metrics.jsonl", "rollouts.jsonl"), write=rank == 0)
    if not args.resume:
        run_dir = Path(from_rank0(str(run_dir) if run_dir else None))
    model, tokenizer = common.load_policy(args, trainable=True)
    judge, user = env.make_judge(args), env.make_user(args)
    care = None
    if {"care", "kardia"} & set(args.reward_weights):
        # the criteria judge of 02 (embed, hf: or api:) and, for CARE, the frozen rubric generator
        pref = importlib.import_module("02_rubric_pref_rl")
        gen_args = argparse.Namespace(**{**vars(args), "model": args.rubric_base or args.model,
                                         "adapter": args.rubric_model, "gradient_checkpointing": False})
        rubric_model, rubric_tok = (common.load_policy(gen_args, trainable=False)
                                    if args.rubric_model and "care" in args.reward_weights else (None, None))
        care = (rubric_model, rubric_tok, pref.make_criteria_judge(args))
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=args.weight_decay)
    warmup = max(1, round(args.warmup_ratio * args.steps))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: cosine_with_warmup(s, args.steps, warmup))
    start = 1
    if args.resume:
        ckpt = common.latest_checkpoint(run_dir / "checkpoints")
        if ckpt is not None:                        # every rank loads the same checkpoint
            start = common.load_checkpoint(ckpt, model, optimizer, scheduler)["step"] + 1
            if rank == 0:
                print(f"resumed from {ckpt} at step {start}")
    if n_ranks > 1:                                 # every rank starts from rank 0's adapter weights
        for p in params:
            dist.broadcast(p.data, src=0)
    logger = common.MetricsLogger(run_dir, args.track, common.public_args(args)) if rank == 0 else None
    n_trainable = sum(p.numel() for p in params)
    if rank == 0:
        print(f"run folder {run_dir} | trainable parameters {n_trainable:,} | device {common.pick_device()}"
              + (f" | data-parallel over {n_ranks} processes" if n_ranks > 1 else ""))

    try:
        train_loop(args, run_dir, scenarios, model, tokenizer, judge, user, optimizer, scheduler, logger, start,
                   care)
    except common.UserError:
        # e.g. the judge's endpoint went down: keep what was learned, then stop with the one message
        done = logger.last_step if logger else None
        if done is not None and done >= start:
            common.save_checkpoint(run_dir / "checkpoints", done, model, optimizer, scheduler,
                                   keep=args.keep_checkpoints)
            print(f"saved checkpoint step {done} before stopping; continue with --resume {run_dir}",
                  file=sys.stderr)
        raise
    if n_ranks > 1:   # the ranks must hold the same adapter: check it, and write the fingerprints down
        hashes = gather(adapter_sha256(model))
        if rank == 0:
            (run_dir / "data_parallel.json").write_text(json.dumps(
                {"world_size": n_ranks, "adapter_sha256": hashes}, indent=2))
            common.check(len(set(hashes)) == 1, f"the {n_ranks} processes ended with different adapters: "
                                                f"{hashes} (see {run_dir / 'data_parallel.json'})")
    if rank == 0:
        model.save_pretrained(run_dir / "adapter", safe_serialization=True)
        tokenizer.save_pretrained(run_dir / "adapter")
        logger.close()
        print(f"final adapter: {run_dir / 'adapter'}  (PeftModel.from_pretrained loads it)")
    if n_ranks > 1:
        dist.destroy_process_group()


def api_counts(judge, user, before: dict | None = None) -> dict:
    """Retries and failed calls of the judge's and the user's LLM endpoints (api: backends), as
    totals, or as the change since `before`: the step log shows what the faults cost."""
    now = {}
    for who, obj in (("judge", judge), ("user", user)):
        backend = getattr(obj, "backend", None)
        if backend is not None and backend.kind == "api":
            now[f"{who}_api_retries"] = backend.retried
            now[f"{who}_api_failed_calls"] = backend.failures
    return {k: v - before.get(k, 0) for k, v in now.items()} if before is not None else now


def train_loop(args, run_dir, scenarios, model, tokenizer, judge, user, optimizer, scheduler, logger, start,
               care=None):
    rank, n_ranks = world()
    for step in tqdm(range(start, args.steps + 1), desc="train", initial=start - 1, total=args.steps,
                     disable=not args.progress):
        t0 = time.time()
        before = api_counts(judge, user)
        step_seed = args.seed * 100_003 + step          # every step's randomness depends on (seed, step)
        torch.manual_seed(step_seed * n_ranks + rank)   # (and on the rank: each samples its own)
        if isinstance(user, env.ScriptedUser):
            user.seed = step_seed
        batch = random.Random(step_seed).sample(scenarios, min(args.scenarios_per_step, len(scenarios)))
        batch = batch[rank::n_ranks]                    # data-parallel: this rank's share of the scenarios
        # 1. rollout: K dialogues per scenario, batched over all live dialogues each turn
        trajs = env.rollout(model, tokenizer, batch, judge, user, args, desc=f"step {step} rollout")
        t_roll = time.time() - t0
        # 2. rewards: the --reward components per turn (cut-off penalty, failed turns filled), by scenario
        rubric_invalid = 0
        if "care" in args.reward_weights:      # CARE: each turn's rubric, then the judge per criterion
            rubrics, rubric_invalid = turn_rubrics(care[0], care[1], trajs, args)
            for tr, rb, r_care in zip(trajs, rubrics, care_turn_rewards(care[2], trajs, rubrics)):
                tr.extra["rubrics"], tr.extra["care"] = rb, r_care
        if "kardia" in args.reward_weights:    # Kardia-R1: the fixed rubric (+ the format term)
            for tr, r_k in zip(trajs, kardia_turn_rewards(care[2], trajs, args.kardia_format)):
                tr.extra["kardia"] = r_k
        groups = [[tr for tr in trajs if tr.scenario is s] for s in batch]
        rewards = [[turn_rewards(tr, args) for tr in g] for g in groups]
        # 3. advantages
        if args.advantage == "mica":
            advs = [mica_advantages(r, args.alpha, args.gamma) for r in rewards]
        elif args.advantage == "grpo":
            advs = [grpo_advantages(r) for r in rewards]
        else:
            advs = reinforce_pp_advantages(rewards, args.gamma)
        # degenerate signals: a group whose rewards are all equal (or with a single trajectory) has
        # zero advantage and teaches nothing; a non-finite advantage never reaches the loss
        degenerate = sum(all(abs(a) < 1e-9 for A in group for a in A) for group in advs)
        nonfinite = sum(not math.isfinite(a) for group in advs for A in group for a in A)
        advs = [[[a if math.isfinite(a) else 0.0 for a in A] for A in group] for group in advs]
        flat_trajs = [tr for g in groups for tr in g]
        flat_advs = [a for group in advs for a in group]
        # 4. update: clipped surrogate on the assistant tokens of each turn
        t1 = time.time()
        lr = optimizer.param_groups[0]["lr"]             # the rate this step's update uses
        log_kl = args.kl_coef == 0 and args.log_kl_every > 0 and step % args.log_kl_every == 0
        upd = ppo_update(model, tokenizer, optimizer, scheduler, flat_trajs, flat_advs, args, log_kl)
        t_upd = time.time() - t1
        # 5. log, keep the rollouts, checkpoint (data-parallel: rank 0 gathers every rank's and writes)
        records = []
        for tr, r, a in zip(flat_trajs, [r for g in rewards for r in g], flat_advs):
            rec = env.trajectory_record(tr, args, rewards=[round(x, 4) for x in r], step=step)
            comp = reward_parts(tr, args)
            for t, (turn, adv) in enumerate(zip(rec["turns"], a)):
                turn["advantage"] = round(adv, 4)
                turn["reward_parts"] = {k: round(v[t], 4) if math.isfinite(v[t]) else None for k, v in comp.items()}
                if "rubrics" in tr.extra:
                    turn["rubric"] = tr.extra["rubrics"][t]
            records.append(rec)
        parts = gather({"records": records, "rewards": [x for group in rewards for r in group for x in r],
                        "counts": {"degenerate_groups": degenerate, "nonfinite_advantages": nonfinite,
                                   **({"rubric_invalid": rubric_invalid} if "care" in args.reward_weights else {}),
                                   **({"format_ok": sum(sum(tr.formatted) for tr in flat_trajs)}
                                      if args.kardia_format else {}),
                                   **api_counts(judge, user, before)},
                        "t_roll": t_roll, "t_upd": t_upd,
                        "rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20})
        if rank != 0:
            continue                                     # the other ranks go on to the next step
        records = [rec for part in parts for rec in part["records"]]
        flat_r = [x for part in parts for x in part["rewards"]]
        turns = [turn for rec in records for turn in rec["turns"]]
        common.append_jsonl(run_dir / "rollouts.jsonl", records)
        metrics = {
            "reward_mean": sum(flat_r) / len(flat_r),
            "return_mean": sum(rec["return"] for rec in records) / len(records),
            "success_rate": sum(rec["outcome"] == "success" for rec in records) / len(records),
            "final_distance": sum(rec["final_distance"] for rec in records) / len(records),
            "final_emotion": sum(rec["final_emotion"] for rec in records) / len(records),
            # sum of the pure IDR over a trajectory telescopes to d(P0) - d(P_T): the held-out measure
            "distance_drop": sum(rec["initial_distance"] - rec["final_distance"] for rec in records) / len(records),
            "trajectories": len(records),
            "turns_mean": len(turns) / len(records),
            "truncated_frac": sum(turn["truncated"] for turn in turns) / max(1, len(turns)),
            "judge_failures": sum(turn["judge_failed"] for turn in turns),
            "user_failures": sum(rec["outcome"] == "user_failed" for rec in records),
            **{k: sum(part["counts"][k] for part in parts) for k in parts[0]["counts"]},
            **{k: v for k, v in upd.items()},
            "lr": lr,
            # the ranks run side by side: all their tokens over the slowest rank's time
            "gen_tokens_per_s": sum(turn["reply_tokens"] for turn in turns) / max(max(x["t_roll"] for x in parts), 1e-9),
            "train_tokens_per_s": upd["train_tokens"] / max(max(x["t_upd"] for x in parts), 1e-9),
            "step_seconds": time.time() - t0,
            "peak_rss_gb": max(x["rss"] for x in parts),     # of the largest process
        }
        logger.log(step, metrics)
        if step % args.save_every == 0 or step == args.steps:
            common.save_checkpoint(run_dir / "checkpoints", step, model, optimizer, scheduler,
                                   keep=args.keep_checkpoints)


if __name__ == "__main__":
    common.run_main(main)

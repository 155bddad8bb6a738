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
        RNG, step; written atomically), adapter/ (the final LoRA adapter, standard peft format),
        curves.png (return, reward, cut-off share, KL, clip fraction by step; redrawn at each checkpoint),
        heldout.json (with --heldout-scenarios: base vs trained on held-out scenarios).

Equations (MICA; docs/reference.md section 2; the code below writes each out as a loop)
  distance      d(P) = sqrt( sum_a w_a max(0, -eps - P_a)^2 )                       (03_rollout)
  IDR           r_t = d(P_{t-1}) - d(P_t)          (03_rollout; --reward idr, the default)
  RLVER         r_t = (e_t - e_{t-1}) / 100, e the simulated user's emotion (03)  (--reward rlver; with it
                dialogues end at e >= 100 or e < 10); sums such as --reward idr+0.5*rlver
  CARE          r_t = sum_d w_d,t s_d,t (02's rubric_score): the frozen generator (--rubric-model, 02)
                writes turn t's rubric, the judge scores the reply on its criteria (02's criteria judge);
                with idr+care the distance uses w_t = 3 (w_C,t, w_A,t, w_P,t) (uniform = MICA's 1,1,1), this
                project's design: the sum no longer telescopes to d(P0) - d(P_T) (--care-distance plain does);
                --rubric adaptive | uniform | weights-only | criteria-only (Table-3 ablations)
  Kardia-R1     r_t = (1/5) sum_c s_c,t over emotion accuracy (the <emotion> section against what the user
                feels), empathy, relevance, persona consistency, safety, + r_fmt (0 with the <understanding>
                <reasoning><emotion><response> format, -1 without; with --kardia-format, where only
                <response> reaches the user and the judge)
  return        G_t = sum_{j >= t} gamma^(j - t) r_j                       (within one trajectory)
  turn-level    A_turn[k][t] = (G[k][t] - mean_t) / (std_t + 1e-6)   over the k that reached turn t
  group-level   A_group[k][t] = (r[k][t] - mean) / (std + 1e-6)       over all sum_k T_k rewards
  MICA          A[k][t] = alpha A_turn[k][t] + (1 - alpha) A_group[k][t]   (both stds: population, Eq. 2)
  GRPO          R_k = sum_t r[k][t];  A[k][t] = (R_k - mean_K) / (std_K + 1e-6) for every t   (sample std,
                as TRL and verl compute it; so is REINFORCE++'s)
  REINFORCE++   A = (G - mean) / (std + 1e-6) over every turn of every trajectory in the batch
  update        02's ppo_update: ratio = exp(log pi(y_i) - log pi_old(y_i)) per assistant token i, A_i = A[k][t(i)]
                L = (1/N) sum_i max(-ratio_i A_i, -clip(ratio_i, 1 - eps_low, 1 + eps_high) A_i)
                    + beta (1/N) sum_i [exp(ref_i - logp_i) - (ref_i - logp_i) - 1]   (k3 KL to the
                    base model with the adapter off; beta = --kl-coef, 0 by default as in MICA)

Departures from the paper (and why)
  1. LoRA instead of full fine-tuning, so lr is 1e-3 instead of 1e-6: a fresh LoRA adapter needs a much
     larger step (at 1e-4, 20 steps moved SmolLM2 by a KL of 0.008 and it did not learn; at 1e-3 it did,
     docs/results.md "Learning, measured"). With CUDA, --preset gpu uses 1e-5 (10x MICA's full fine-tuning
     rate, LoRA's usual ratio; docs/training.md "Presets").
  2. Short episodes on a CPU (3 turns of at most 48 tokens; MICA trains on 8-15) and 4 scenarios x K=4 per
     step (MICA: 16 x 4), so that a laptop CPU can run it. With CUDA the gpu preset takes MICA's shape
     (16 x 4, 8-15 turns, 256-token replies); --preset cpu | demo | gpu chooses, flags given win.
  3. A reply cut off at --max-new-tokens loses a share (--truncation-penalty, 0.5) of one turn's nominal
     reward range, in that reward's units (cutoff_penalty): without it a small policy drifts to the cap.
  4. A turn the judge failed on is left out of the loss; for the returns and group statistics its
     reward is the trajectory's mean valid reward (as the public code fills it).
  5. REINFORCE++ discounts per turn (rewards sit on turn ends) and whitens per turn, not per token.
  6. Two optimizer steps per rollout by default (--minibatch-size 8 of 16 trajectories, MICA's
     proportion), so the ratio moves and the clip works from the second minibatch on. Old log-probs
     (02's ppo_update) are computed once per rollout, except for the first minibatch of the first
     epoch, which the unchanged policy updates (its ratio is exactly 1).

CPU:  python 04_mica_train.py                          (SmolLM2, embed judge, scripted user, ~80 s/step)
      python 04_mica_train.py --preset demo            (make demo: fewer steps, then base vs trained held out)
GPU:  python 04_mica_train.py --model Qwen2.5-7B-Instruct          (the gpu preset: the frozen base judges and
          plays the user; for results a stronger served judge: --judge api:Qwen2.5-72B-Instruct \\
          --user api:Qwen2.5-72B-Instruct --api-base http://localhost:8000/v1)
N GPUs: accelerate launch --num_processes N 04_mica_train.py ... (data-parallel: each process rolls out
        its share of the step's scenarios, gradients and token counts are summed over the processes,
        process 0 writes everything; see docs/scale.md)
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import math
import random
import re
import resource
import time
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm import tqdm

import common

sft = importlib.import_module("01_rubric_sft")      # the rubric format, parser and generation (CARE)
pref = importlib.import_module("02_rubric_pref_rl")  # the criteria judge, S = sum_d w_d s_d, ppo_update
env = importlib.import_module("03_rollout")          # the environment: scenarios, judge, user, rollout, IDR
HERE = Path(__file__).resolve().parent
DIMS = sft.DIMS


# ---------------------------------------------------------------------------------------------
# The equations: returns and advantages (one loop each), then the per-turn rewards
# ---------------------------------------------------------------------------------------------
# IDR, 03's incremental_distance_rewards:  r_t = d(P_{t-1}) - d(P_t),  d(P) = sqrt( sum_a w_a max(0, -eps - P_a)^2 )
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
    # turn-level: A_turn[k][t] = (G[k][t] - mean_t) / (std_t + 1e-6) over the N_t trajectories k that reached
    # turn t, sigma_t = sqrt( (1/N_t) sum_k (G[k][t] - mean_t)^2 ): the population std, as MICA's Eq. 2 writes it
    A_turn = [[0.0] * len(rewards[k]) for k in range(K)]
    for t in range(T_max):
        reached = [k for k in range(K) if len(rewards[k]) > t]
        if len(reached) < 2:
            continue  # fewer than 2 trajectories reached turn t: A_turn = 0
        mean_t, std_t = common.mean_std([G[k][t] for k in reached], ddof=0)   # population std (MICA's Eq. 2)
        for k in reached:
            A_turn[k][t] = (G[k][t] - mean_t) / (std_t + 1e-6)
    # group-level: A_group[k][t] = (r[k][t] - mean) / (std + 1e-6) over all sum_k T_k rewards
    A_group = [[0.0] * len(rewards[k]) for k in range(K)]
    flat = [x for r in rewards for x in r]
    if len(flat) >= 2:
        mean, std = common.mean_std(flat, ddof=0)                          # population std (MICA's Eq. 2)
        for k in range(K):
            for t in range(len(rewards[k])):
                A_group[k][t] = (rewards[k][t] - mean) / (std + 1e-6)
    # mixed: A = alpha * A_turn + (1 - alpha) * A_group
    return [[alpha * A_turn[k][t] + (1 - alpha) * A_group[k][t] for t in range(len(rewards[k]))]
            for k in range(K)]


def grpo_advantages(rewards) -> list[list[float]]:
    """rewards[k][t] for one scenario -> A[k][t] = normalised trajectory outcome, same on every turn."""
    # R_k = sum_t r[k][t];  A_k = (R_k - mean_K) / (std_K + 1e-6);  0 when K < 2
    # (sample std, ddof = 1, as TRL's and verl's GRPO compute it)
    R = [sum(r) for r in rewards]
    if len(R) < 2:
        return [[0.0] * len(r) for r in rewards]
    mean, std = common.mean_std(R, ddof=1)
    return [[(R[k] - mean) / (std + 1e-6)] * len(rewards[k]) for k in range(len(rewards))]


def reinforce_pp_advantages(batch_rewards, gamma) -> list[list[list[float]]]:
    """batch_rewards[s][k][t] for the whole batch -> A[s][k][t]: returns whitened over the batch
    (in data-parallel training over every rank's batch: the sums below are summed over the ranks)."""
    # G_t per trajectory, then A = (G - mean) / (std + 1e-6) over every turn in the batch (no grouping)
    G = [[discounted_returns(r, gamma) for r in group] for group in batch_rewards]
    flat = [x for group in G for g in group for x in g]
    n, total = common.all_reduce([len(flat), sum(flat)])
    if n < 2:
        return [[[0.0] * len(g) for g in group] for group in G]
    mean = total / n
    # sample std (ddof = 1): sqrt( sum (G - mean)^2 / (n - 1) )
    std = math.sqrt(common.all_reduce([sum((x - mean) ** 2 for x in flat)])[0] / (n - 1))
    return [[[(x - mean) / (std + 1e-6) for x in g] for g in group] for group in G]


def rlver_emotion_rewards(emotions) -> list[float]:
    """emotions = [e_0, ..., e_T] kept by the simulated user -> [r_1, ..., r_T]."""
    # RLVER: r_t = (e_t - e_{t-1}) / 100. Its sum is (e_T - e_0)/100, so GRPO on this sum ranks a
    # group exactly as RLVER's outcome reward e_T/100 does (e_0 is the same for every k).
    return [(emotions[t] - emotions[t - 1]) / 100 for t in range(1, len(emotions))]


def care_turn_rewards(crit_judge, trajs, rubrics) -> list[list[float]]:
    """CARE: r_t for every turn; the judge scores the reply on each criterion of its turn's rubric."""
    cases = []
    for i, tr in enumerate(trajs):
        hist = [m for m in env.seen_history(tr) if m["role"] != "system"]
        for t in range(tr.T):
            cases.append({"context": hist[: 2 * t + 1], "reply": tr.shown[t], "criteria": rubrics[i][t]["criteria"]})
    scores = iter(pref.judge_by_dimension(crit_judge, cases))
    r = []
    for i, tr in enumerate(trajs):
        r_i = []
        for t in range(tr.T):
            s_t = next(scores)        # {d: [s(y_t, c) for c in C_d,t]}, None where the judge failed
            # r_t = sum_d w_d,t * s_d,t,  s_d,t = (1/|C_d,t|) sum_{c in C_d,t} s(y_t, c)   (02's rubric_score);
            # a turn the judge failed on is NaN here: turn_rewards then treats it as failed
            r_i.append(float("nan") if s_t is None else pref.rubric_score(rubrics[i][t], s_t))
        r.append(r_i)
    return r


def kardia_turn_rewards(crit_judge, trajs, use_format: bool) -> list[list[float]]:
    """Kardia-R1 (Rubric-as-Judge): the judge scores each shown reply on relevance, empathy, persona
    consistency and safety, and the reply's <emotion> section (the whole reply without --kardia-format)
    on emotion accuracy: does it name what this person feels (kardia_criteria)."""
    cases = []
    for tr in trajs:
        hist = [m for m in env.seen_history(tr) if m["role"] != "system"]
        replies = [m["content"] for m in tr.messages if m["role"] == "assistant"]
        for t in range(tr.T):
            reply_axes, emotion_axis = kardia_criteria(tr.scenario, hist[2 * t]["content"])
            named = kardia_section(replies[t], "emotion") if use_format else tr.shown[t]
            cases.append({"context": hist[: 2 * t + 1], "reply": tr.shown[t], "criteria": {"reply": reply_axes}})
            cases.append({"context": hist[: 2 * t + 1], "reply": named or "(no emotion named)",
                          "criteria": {"emotion": [emotion_axis]}})
    scores = iter(pref.judge_by_dimension(crit_judge, cases))
    r = []
    for tr in trajs:
        # r_t = (1/5) sum_c s_c,t  +  r_fmt,t   over the five axes (emotion accuracy, empathy, relevance,
        # persona consistency, safety); r_fmt = 0 for the 4-section format, -1 without it (only with
        # --kardia-format);  a turn the judge failed on is NaN: left out as failed
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
    """Each --reward component's per-turn values for one trajectory (unweighted)."""
    parts = {}
    for name in args.reward_weights:
        if name == "idr" and "rubrics" in tr.extra and args.care_distance == "weighted":
            # with CARE the rubric's weights also weight the distance, scaled so that uniform weights
            # give MICA's (1, 1, 1): r_t = d_t(P_{t-1}) - d_t(P_t) with w_t = 3 * (w_C,t, w_A,t, w_P,t).
            # This project's design, not a paper's: d_t changes every turn, so the rewards no longer sum
            # to d(P0) - d(P_T); --care-distance plain keeps MICA's potential difference
            w_t = [[3 * rb["weights"][d] for d in DIMS] for rb in tr.extra["rubrics"]]
            parts["idr"] = env.incremental_distance_rewards(tr.states, w_t, args.eps)
        elif name == "idr":
            # IDR (03): r_t = d(P_{t-1}) - d(P_t)
            parts["idr"] = env.incremental_distance_rewards(tr.states, args.idr_weights, args.eps)
        elif name == "rlver":
            parts["rlver"] = rlver_emotion_rewards(tr.emotions)
        else:
            parts[name] = tr.extra[name]        # care / kardia: judged per criterion in the train loop
    return parts


def cutoff_penalty(args) -> float:
    """The cut-off penalty in the reward's own units: --truncation-penalty is a fraction of each --reward
    component's nominal per-turn range, weighted as the reward weights it."""
    # penalty = lambda_cut * sum_c |weight_c| * scale_c,   the per-turn scales:
    #   idr     sqrt(w_C + w_A + w_P): the IDR of a level-1 turn on every axis, far from the goal (sqrt 3)
    #   rlver   10 / 100: the largest change of the user's emotion in one turn
    #   care    1: the judge's scores and the rubric's weights lie in [0, 1]
    #   kardia  1: the mean criterion score lies in [0, 1]
    scale = {"idr": math.sqrt(sum(args.idr_weights)), "rlver": 0.1, "care": 1.0, "kardia": 1.0}
    penalty = 0.0
    for name, weight in args.reward_weights.items():
        penalty += abs(weight) * scale[name]
    return args.truncation_penalty * penalty


def turn_rewards(tr, args) -> list[float]:
    """Per-turn training reward of one trajectory: the --reward components, weighted and summed, minus
    the cut-off penalty; a turn the judge failed on (or a non-finite value) gets the trajectory's mean
    valid reward."""
    # r_t = sum_c weight_c * r_c,t - penalty * 1[reply t was cut off]     (penalty: cutoff_penalty)
    r = [0.0] * tr.T
    for name, part in reward_parts(tr, args).items():
        r = [x + args.reward_weights[name] * y for x, y in zip(r, part)]
    valid = [not failed and math.isfinite(x) for failed, x in zip(tr.judge_failed, r)]
    penalty = cutoff_penalty(args)
    r = [x - penalty * cut for x, cut in zip(r, tr.truncated)]
    fill = [x for x, ok in zip(r, valid) if ok]
    fill = sum(fill) / len(fill) if fill else 0.0
    return [x if ok else fill for x, ok in zip(r, valid)]


# ---------------------------------------------------------------------------------------------
# The main loop
# ---------------------------------------------------------------------------------------------
def train_loop(args, run_dir, scenarios, model, tokenizer, judge, user, optimizer, scheduler, logger, start,
               care=None):
    rank, n_ranks = common.world()
    for step in tqdm(range(start, args.steps + 1), desc="train", initial=start - 1, total=args.steps,
                     disable=not args.progress):
        t0 = time.time()
        before = common.api_counts(judge, user)
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
        # 4. update: 02's clipped surrogate on the assistant tokens of each turn the judge did not fail on
        t1 = time.time()
        lr = optimizer.param_groups[0]["lr"]             # the rate this step's update uses
        log_kl = args.kl_coef == 0 and args.log_kl_every > 0 and step % args.log_kl_every == 0
        upd = pref.ppo_update(model, tokenizer, optimizer, scheduler, as_samples(flat_trajs, flat_advs), args, log_kl)
        # 5. log, keep the rollouts, checkpoint (data-parallel: rank 0 gathers every rank's and writes)
        counts = {"degenerate_groups": degenerate, "nonfinite_advantages": nonfinite,
                  **({"rubric_invalid": rubric_invalid} if "care" in args.reward_weights else {}),
                  **({"format_ok": sum(sum(tr.formatted) for tr in flat_trajs)} if args.kardia_format else {}),
                  **common.api_counts(judge, user, before=before)}
        log_step(args, run_dir, logger, step, flat_trajs, [r for g in rewards for r in g], flat_advs, counts, upd,
                 lr, t0, t_roll, time.time() - t1)
        if rank == 0 and (step % args.save_every == 0 or step == args.steps):
            common.save_checkpoint(run_dir / "checkpoints", step, model, optimizer, scheduler,
                                   keep=args.keep_checkpoints)
            common.plot_metrics(run_dir, CURVES)          # curves.png: the run so far, to look at


def main(argv=None):
    args = parse_args(argv)
    common.set_seed(args.seed)
    print(args.preset_note)
    scenarios = env.load_scenarios(args.scenarios)  # validate inputs before creating anything
    if args.heldout_scenarios:
        env.load_scenarios(args.heldout)
    common.check_model_args(args)
    common.init_distributed()                       # N processes under accelerate launch; else nothing
    rank, n_ranks = common.world()
    common.check(min(args.scenarios_per_step, len(scenarios)) >= n_ranks,
                 f"--scenarios-per-step must be >= the number of processes ({n_ranks}): each takes its own")
    args.progress = args.progress and rank == 0     # one progress bar, one log: rank 0's
    run_dir = common.open_run(args, ("metrics.jsonl", "rollouts.jsonl"), write=rank == 0)
    if not args.resume:
        run_dir = Path(common.from_rank0(str(run_dir) if run_dir else None))
    model, tokenizer = common.load_policy(args, trainable=True)
    judge, user = env.make_judge(args, (model, tokenizer)), env.make_user(args, (model, tokenizer))
    care = load_care(args)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer, scheduler = common.make_optimizer(params, args, args.steps)
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
    if rank == 0:
        print(f"run folder {run_dir} | trainable parameters {sum(p.numel() for p in params):,} | device "
              f"{common.pick_device()}" + (f" | data-parallel over {n_ranks} processes" if n_ranks > 1 else ""))
    try:
        train_loop(args, run_dir, scenarios, model, tokenizer, judge, user, optimizer, scheduler, logger, start,
                   care)
    except common.UserError:    # e.g. the judge's endpoint went down: keep what was learned, then stop
        common.checkpoint_on_error(run_dir, model, optimizer, scheduler, logger, start, args.keep_checkpoints)
        raise
    if n_ranks > 1:   # the ranks must hold the same adapter: check it, and write the fingerprints down
        hashes = common.gather(common.adapter_sha256(model))
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
        print(f"curves: {common.plot_metrics(run_dir, CURVES)}")
        if args.heldout_scenarios:      # base (adapter off) vs trained on held-out scenarios, same seeds
            heldout_compare(model, tokenizer, judge, user, args, run_dir)
    if n_ranks > 1:
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------
# --- supporting pieces ---: the step log, CARE's rubrics and Kardia-R1's criteria, the reward spec, CLI
# ---------------------------------------------------------------------------------------------
def log_step(args, run_dir, logger, step, trajs, rewards, advs, counts, upd, lr, t0, t_roll, t_upd):
    """rollouts.jsonl (every trajectory with its rewards, parts and advantages) and one metrics line;
    data-parallel: rank 0 gathers every rank's share and writes."""
    records = []
    for tr, r, a in zip(trajs, rewards, advs):
        rec = env.trajectory_record(tr, args, rewards=[round(x, 4) for x in r], step=step)
        comp = reward_parts(tr, args)
        for t, (turn, adv) in enumerate(zip(rec["turns"], a)):
            turn["advantage"] = round(adv, 4)
            turn["reward_parts"] = {k: round(v[t], 4) if math.isfinite(v[t]) else None for k, v in comp.items()}
            if "rubrics" in tr.extra:
                turn["rubric"] = tr.extra["rubrics"][t]
        records.append(rec)
    parts = common.gather({"records": records, "rewards": [x for r in rewards for x in r], "counts": counts,
                           "t_roll": t_roll, "t_upd": t_upd,
                           "rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20})
    if common.world()[0] != 0:
        return                                            # the other ranks go on to the next step
    records = [rec for part in parts for rec in part["records"]]
    flat_r = [x for part in parts for x in part["rewards"]]
    turns = [turn for rec in records for turn in rec["turns"]]
    common.append_jsonl(run_dir / "rollouts.jsonl", records)
    n = len(records)
    logger.log(step, {
        "reward_mean": sum(flat_r) / len(flat_r),
        "return_mean": sum(rec["return"] for rec in records) / n,
        "success_rate": sum(rec["outcome"] == "success" for rec in records) / n,
        "final_distance": sum(rec["final_distance"] for rec in records) / n,
        "final_emotion": sum(rec["final_emotion"] for rec in records) / n,
        # sum of the pure IDR over a trajectory telescopes to d(P0) - d(P_T): the held-out measure
        "distance_drop": sum(rec["initial_distance"] - rec["final_distance"] for rec in records) / n,
        "trajectories": n,
        "turns_mean": len(turns) / n,
        "truncated_frac": sum(turn["truncated"] for turn in turns) / max(1, len(turns)),
        "judge_failures": sum(turn["judge_failed"] for turn in turns),
        "user_failures": sum(rec["outcome"] == "user_failed" for rec in records),
        **{k: sum(part["counts"][k] for part in parts) for k in parts[0]["counts"]},
        **upd,
        "lr": lr,
        # the ranks run side by side: all their tokens over the slowest rank's time
        "gen_tokens_per_s": sum(turn["reply_tokens"] for turn in turns) / max(max(x["t_roll"] for x in parts), 1e-9),
        "train_tokens_per_s": upd["train_tokens"] / max(max(x["t_upd"] for x in parts), 1e-9),
        "step_seconds": time.time() - t0,
        "peak_rss_gb": max(x["rss"] for x in parts),     # of the largest process
    })


def as_samples(trajs, advs=None) -> list:
    """Trajectories as 02's update samples: each reply's span with its turn's advantage A[k][t] (None,
    left out of the loss, where the judge failed); advs None gives every turn 0 (for inspection)."""
    advs = advs if advs is not None else [[0.0] * tr.T for tr in trajs]
    return [pref.Sample(tr.ids, tr.spans, [None if failed else a for failed, a in zip(tr.judge_failed, A)])
            for tr, A in zip(trajs, advs)]


def load_care(args):
    """--reward care / kardia: (the frozen rubric generator and its tokenizer, or None; 02's criteria
    judge: embed, hf: or api:), else None."""
    if not {"care", "kardia"} & set(args.reward_weights):
        return None
    gen_args = argparse.Namespace(**{**vars(args), "model": args.rubric_base or args.model,
                                     "adapter": args.rubric_model, "gradient_checkpointing": False})
    rubric_model, rubric_tok = (common.load_policy(gen_args, trainable=False)
                                if args.rubric_model and "care" in args.reward_weights else (None, None))
    return rubric_model, rubric_tok, pref.make_criteria_judge(args)


REWARDS = ("idr", "rlver", "care", "kardia")  # the per-turn reward components --reward can combine
# --rubric uniform (and the fixed half of weights-only / criteria-only): CARE's "fixed rubric" ablation
UNIFORM_RUBRIC = {"weights": {d: 1 / 3 for d in DIMS},
                  "criteria": {"cognitive": ["Shows it understands the person's situation and what they said"],
                               "affective": ["Recognises and validates the person's feelings"],
                               "proactive": ["Helps the person find a concrete, manageable next step"]}}


def turn_rubrics(rubric_model, rubric_tok, trajs, args) -> tuple[list[list[dict]], int]:
    """CARE: the rubric of every turn of every trajectory, written by the frozen generator (02's
    adapter) for the context the policy answered; --rubric picks the Table-3 ablation. A generated
    rubric that does not parse is replaced by the uniform one and counted."""
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


def kardia_section(text: str, name: str) -> str:
    """The text of one of Kardia-R1's sections (<emotion>...</emotion>) of a reply, "" when absent."""
    m = re.search(rf"<{name}>(.*?)</{name}>", text, re.S)
    return m.group(1).strip() if m else ""


def kardia_criteria(scenario: dict, user_message: str) -> tuple[list[str], str]:
    """Kardia-R1's fixed rubric: four axes judged on the reply, and emotion accuracy judged on the emotion
    the reply names. Persona consistency is judged against the scenario's profile (MBTI, about,
    situation, emotion) when it has one, else its persona line; the emotion to name is the scenario's
    (or its profile's) `emotion` when given, else what the person's last message shows."""
    prof = scenario.get("profile") if isinstance(scenario.get("profile"), dict) else {}
    who = "; ".join(f"{k}: {v}" for k, v in prof.items()) or scenario.get("persona", "")
    feels = scenario.get("emotion") or prof.get("emotion")
    emotion = (f"Emotion accuracy: names what the person feels ({feels})" if feels else
               f"Emotion accuracy: names the emotion the person expresses here: \"{user_message}\"")
    return (["Relevance: responds directly to what the person just said",
             "Empathy: recognises the person's feelings and responds to them warmly",
             f"Persona consistency: fits who this person is ({who})",
             "Safety: nothing harmful, dismissive, judgemental or unsafe"], emotion)


CURVES = {"return_mean": "return (mean per trajectory)", "reward_mean": "reward (mean per turn)",
          "truncated_frac": "cut-off share", "kl": "KL to the base", "clip_frac": "clip fraction"}


def heldout_compare(model, tokenizer, judge, user, args, run_dir) -> dict:
    """Base (the adapter off) vs trained on the first --heldout-scenarios of --heldout, K dialogues each,
    the same sampling seed for both: IDR return d(P0) - d(P_T) (the sum of the pure IDR; no cut-off
    penalty), collapse share (EMPA failures) and cut-off share. The difference is paired by (scenario, k),
    with its 95% CI; one line per measure, and heldout.json."""
    scenarios = env.load_scenarios(args.heldout)[:args.heldout_scenarios]
    per = {}
    for name in ("base", "trained"):
        torch.manual_seed(args.seed + 1_000_003)           # the same sampling seed for both
        if isinstance(user, env.ScriptedUser):
            user.seed = args.seed + 1_000_003
        with model.disable_adapter() if name == "base" else contextlib.nullcontext():
            trajs = env.rollout(model, tokenizer, scenarios, judge, user, args, desc=f"held-out {name}")
        recs = [env.trajectory_record(tr, args) for tr in trajs]
        per[name] = {"return": [r["initial_distance"] - r["final_distance"] for r in recs],
                     "collapse": [float(r["outcome"] == "failure") for r in recs],
                     "cut_off": [sum(t["truncated"] for t in r["turns"]) / max(1, len(r["turns"])) for r in recs]}
    n = len(per["base"]["return"])
    print(f"held-out: {len(scenarios)} scenarios x K={args.k} = {n} dialogues of {args.heldout}, "
          f"base = the adapter off, the same seeds")
    summary = {}
    for key, label, higher in (("return", "IDR return", True), ("collapse", "collapse share", False),
                               ("cut_off", "cut-off share", False)):
        b, t = per["base"][key], per["trained"][key]
        m_b, sd_b = common.mean_std(b) if n > 1 else (b[0], 0.0)
        m_t, sd_t = common.mean_std(t) if n > 1 else (t[0], 0.0)
        diff, lo, hi = paired_ci([y - x for x, y in zip(b, t)])
        better = lo > 0 if higher else hi < 0
        worse = hi < 0 if higher else lo > 0
        verdict = ("trained ahead beyond the spread" if better else "trained behind beyond the spread" if worse
                   else "within the spread: this budget does not show a difference")
        print(f"  {label:14s} base {m_b:+.3f} ± {sd_b:.3f}, trained {m_t:+.3f} ± {sd_t:.3f} (mean ± sd); "
              f"trained - base {diff:+.3f}, 95% CI [{lo:+.3f}, {hi:+.3f}]: {verdict}")
        summary[key] = {"base": [m_b, sd_b], "trained": [m_t, sd_t], "diff": [diff, lo, hi], "verdict": verdict}
    out = {"scenarios": [s["id"] for s in scenarios], "k": args.k, "n": n, "summary": summary, "per_dialogue": per}
    (run_dir / "heldout.json").write_text(json.dumps(out, indent=2))
    return out


def paired_ci(d: list[float]) -> tuple[float, float, float]:
    """Mean of paired differences and its 95% CI: mean +- 1.96 sd / sqrt(n) (sample sd; 0 wide for n = 1)."""
    if len(d) < 2:
        return (d[0], d[0], d[0]) if d else (0.0, 0.0, 0.0)
    m, sd = common.mean_std(d)
    half = 1.96 * sd / math.sqrt(len(d))
    return m, m - half, m + half


# The budget a run starts from (--preset); any flag given on the command line wins over it.
#   cpu   the reference defaults of parse_args (4 scenarios x K=4, 3 turns of <= 48 tokens, lr 1e-3)
#   demo  `make demo`: the reference step for 4 steps (8 optimizer steps), then the held-out comparison on
#         4 scenarios x K=4 (<= 10 minutes on 2 cores; on a CPU a rollout's time hardly depends on its rows)
#   gpu   one GPU in the spirit of MICA's launch config: 16 scenarios x K=4 a step in minibatches of 8 x 4
#         (2 optimizer steps), 8-15 turns, 256-token replies, gradient checkpointing; lr 1e-5: MICA fine-tunes
#         fully at 1e-6, and LoRA's best rate is about 10x full fine-tuning's (Schulman et al., "LoRA Without
#         Regret", 2025); the frozen base judges and plays the user (self) unless a backend is given
PRESETS = {
    "cpu": {},
    "demo": dict(steps=4, heldout_scenarios=4, log_kl_every=2, save_every=4),
    "gpu": dict(scenarios_per_step=16, k=4, minibatch_size=32, min_turns=8, max_turns=15, max_new_tokens=256,
                max_context=4096, lr=1e-5, gradient_checkpointing=True, judge="self", user="self"),
}


def apply_preset(p: argparse.ArgumentParser, argv) -> tuple[str, str]:
    """--preset's values become the parser's defaults (auto: gpu with CUDA, cpu without) -> (name, why)."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--preset", default="auto", choices=["auto", *PRESETS])
    name, why = pre.parse_known_args(argv)[0].preset, "asked"
    if name == "auto":
        cuda = common.pick_device().type == "cuda"
        name, why = ("gpu", "auto: CUDA found") if cuda else ("cpu", "auto: no CUDA")
    p.set_defaults(**PRESETS[name])
    return name, why


def preset_note(args, name: str, why: str) -> str:
    """One line for the log: which defaults the preset chose, and which flags given overrode them."""
    parts = [f"--{k.replace('_', '-')} {v}" + ("" if getattr(args, k) == v else f" (given: {getattr(args, k)})")
             for k, v in PRESETS[name].items()]
    return f"defaults: preset {name} ({why}): " + (", ".join(parts) or "the reference CPU defaults") + \
        "; flags given win (--preset cpu | demo | gpu to choose)"


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
    g.add_argument("--care-distance", choices=["weighted", "plain"], default="weighted",
                   help="with idr+care: weight turn t's distance by 3 w_t of its rubric (this project's design; "
                        "the rewards then do not telescope), or plain MICA IDR, d(P_{t-1}) - d(P_t)")
    g.add_argument("--idr-weights", default="1,1,1", help="w = (w_C, w_A, w_P) of the hinge distance")
    g.add_argument("--truncation-penalty", type=float, default=0.5,
                   help="a reply cut off at --max-new-tokens loses this fraction of one turn's nominal reward "
                        "range (cutoff_penalty: IDR sqrt(3), RLVER 0.1, CARE and Kardia 1, weighted as --reward)")
    g.add_argument("--clip-low", type=float, default=0.2, help="ratio clip below: 1 - clip_low")
    g.add_argument("--clip-high", type=float, default=0.28, help="ratio clip above: 1 + clip_high")
    g.add_argument("--kl-coef", type=float, default=0.0, help="beta of the k3 KL to the base model (0 = off)")
    g.add_argument("--log-kl-every", type=int, default=5,
                   help="when --kl-coef is 0, measure the KL to the base every N steps (one no-grad forward)")
    g = p.add_argument_group("optimisation")
    g.add_argument("--steps", type=int, default=20, help="training steps (rollout + update)")
    g.add_argument("--scenarios-per-step", type=int, default=4, help="scenarios per step (each gets K rollouts; data-parallel: in all, shared out)")
    g.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (AdamW; LoRA on SmolLM2, see docs/results.md)")
    g.add_argument("--weight-decay", type=float, default=0.1, help="AdamW weight decay")
    g.add_argument("--warmup-ratio", type=float, default=0.05, help="share of steps with linear warmup")
    g.add_argument("--ppo-epochs", type=int, default=1, help="passes over each rollout batch")
    g.add_argument("--minibatch-size", type=int, default=8,
                   help="trajectories per optimizer step (data-parallel: in all); 8 of the default 4 x 4 = 16 "
                        "gives 2 optimizer steps per rollout, MICA's proportion (16 x 4 with minibatches of 8 x 4)")
    g.add_argument("--micro-batch-size", type=int, default=2,
                   help="trajectories per forward/backward, per process (gradient accumulation up to a minibatch); "
                        "activations cost ~2.4 MB per token for SmolLM2-135M in fp32")
    g.add_argument("--max-grad-norm", type=float, default=1.0, help="gradient clipping")
    g.add_argument("--heldout", default=str(HERE / "data" / "scenarios_test.jsonl"),
                   help="held-out scenarios for the comparison at the end (--heldout-scenarios)")
    g.add_argument("--heldout-scenarios", type=int, default=0,
                   help="after training, roll out this many held-out scenarios (x K) with the base (adapter off) "
                        "and the trained policy, same seeds, and print the difference with its 95%% CI (0 = off)")
    g.add_argument("--preset", default="auto", choices=["auto", *PRESETS],
                   help="the defaults to start from: cpu (the reference CPU budget), demo (make demo: 10 minutes), "
                        "gpu (one GPU, MICA's proportions, --judge self --user self); auto = gpu with CUDA, "
                        "else cpu. Flags given win")
    common.add_run_args(p, "mica", save_every=10, resume="a run folder: continue from its last checkpoint", progress=False)
    preset, why = apply_preset(p, argv)
    args = p.parse_args(argv)
    args.preset_note = preset_note(args, preset, why)
    return check_args(args)


def check_args(args):
    """Validate 04's flags (one message naming the flag, exit 2) and derive the reward spec."""
    env.check_env_args(args)
    c = common.check
    c(0.0 <= args.alpha <= 1.0, f"--alpha must be in [0, 1], got {args.alpha}")
    c(0.0 <= args.gamma <= 1.0, f"--gamma must be in [0, 1], got {args.gamma}")
    c(args.k >= 2 or args.advantage == "reinforce_pp",
      f"--k must be >= 2 for --advantage {args.advantage} (it normalises within the K), got {args.k}")
    c(args.steps >= 1, f"--steps must be >= 1, got {args.steps}")
    c(args.heldout_scenarios >= 0, f"--heldout-scenarios must be >= 0, got {args.heldout_scenarios}")
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


if __name__ == "__main__":
    common.run_main(main)

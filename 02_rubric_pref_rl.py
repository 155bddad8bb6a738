"""02_rubric_pref_rl.py: CARE stage 2, preference RL of the rubric generator.

What it does
  Starts from the SFT generator (01's adapter). Each step takes preference pairs (a context, the
  reply people preferred, the one they did not), samples G rubrics per context, lets the judge score
  both replies on every criterion of each rubric, and rewards a rubric that ranks the preferred reply
  higher (preference recovery), by how much (margin), and that parses at all (format). Advantages are
  normalised within each context's G rubrics; the update is a clipped policy gradient on the
  rubric tokens (ppo_update, written here as the reader's first RL update; 04 imports it). Before and after RL it reports, on held-out pairs, preference-recovery accuracy and
  the parse-valid rate, and on held-out supervision turns the mean weights by turn index and by the
  user's emotion (the paper's Figures 3-4) as a table and PNG plots. The final adapter is the frozen
  generator that 04 (--reward care) and 05 use.

Reads   data/rubric_pref_train.jsonl / data/rubric_pref_test.jsonl (TRL preference format:
        "prompt" or "messages" ending with a user turn, "chosen", "rejected": a string or a one-message
        list), data/rubric_sft_val.jsonl (turn and emotion per turn, for the weights report), the
        generator (--model + --adapter from 01), the judge (embed offline, hf:, api:).
Writes  runs/<name>-<time>/ : args.json, metrics.jsonl, rollouts.jsonl (every sampled rubric with its
        scores and reward), report.md + report.json (before / after), weights_by_turn.png,
        weights_by_emotion.png, checkpoints/, adapter/, curves.png (reward, recovery, parse-valid, clip).

Equations (CARE; docs/reference.md section 5)
  rubric score  S(y) = sum_d w_d * (1/|C_d|) sum_{c in C_d} s(y, c)      s in [0, 1], the judge's score
  recovery      r_rec = 1 if S(chosen) > S(rejected) else 0
  margin        r_margin = lambda * tanh((S(chosen) - S(rejected)) / tau)
  format        r_fmt = 0 for a rubric that parses, -1 otherwise (then r_rec = r_margin = 0)
  reward        r = r_rec + r_margin + r_fmt      (Table-4 ablations: --no-margin, --no-format,
                                                   --recovery-only)
  advantage     A_g = (r_g - mean_G) / (std_G + 1e-6)     over the G rubrics of one context
  update        ratio_i = exp(log pi(y_i) - log pi_old(y_i)) per rubric token i
                L = (1/N) sum_i max(-ratio_i A_i, -clip(ratio_i, 1 - eps_low, 1 + eps_high) A_i)
                    + beta (1/N) sum_i [exp(ref_i - logp_i) - (ref_i - logp_i) - 1]   (k3 KL to the base
                    with the adapter off; beta = --kl-coef, 0 by default); token-mean over a minibatch;
                    old log-probs once per rollout, where the policy has moved since sampling
  accuracy      share of held-out pairs whose greedy rubric gives S(chosen) > S(rejected)
                (an invalid rubric counts as a miss)

The offline judge (--judge embed) and its limits
  s(y, c) = max(0, cos(e(y), e(c))) with all-MiniLM-L6-v2 sentence embeddings: how close the reply is
  in meaning to the criterion. It rewards rubrics whose criteria and weights point at what the
  preferred reply does, which is the signal CARE trains on, but it is a similarity, not a judgement:
  it cannot tell "validates the fear" from "dismisses the fear" when both talk about fear. Use an LLM
  judge (hf: / api:, asked for a 0-10 score per criterion) for real results.

Departures from the paper (and why)
  1. LoRA, a small generator and a small preference set written for this project.
  2. The margin term is lambda * tanh(diff / tau), bounded so it cannot outweigh recovery; the paper
     does not give its exact form.
  3. The offline judge is an embedding similarity (above).

CPU:  python 02_rubric_pref_rl.py --adapter runs/rubric-sft-<time>/adapter       (~1-2 min/step)
GPU:  python 02_rubric_pref_rl.py --model Qwen2.5-7B-Instruct --adapter <01 adapter> \\
          --judge api:Qwen/Qwen2.5-72B-Instruct --api-base http://localhost:8000/v1 --contexts-per-step 16 --g 8
"""
from __future__ import annotations

import argparse
import importlib
import json
import math
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

import common

sft = importlib.import_module("01_rubric_sft")  # the rubric format, parser, prompt and generation
HERE = Path(__file__).resolve().parent
DIMS = sft.DIMS


# ---------------------------------------------------------------------------------------------
# The equations: rubric score, preference reward, group advantage, the clipped policy-gradient update
# ---------------------------------------------------------------------------------------------
def rubric_score(rubric: dict, s: dict) -> float:
    """s[d] = the judge's scores of one reply on dimension d's criteria."""
    # S(y) = sum_d w_d * (1/|C_d|) sum_{c in C_d} s(y, c)
    S = 0.0
    for d in DIMS:
        S += rubric["weights"][d] * sum(s[d]) / len(s[d])
    return S


def preference_reward(S_chosen, S_rejected, valid: bool, margin_coef: float, margin_tau: float,
                      use_margin: bool = True, use_format: bool = True) -> dict:
    """r = r_rec + r_margin + r_fmt for one sampled rubric (all three returned for the log)."""
    if not valid:
        # r_fmt = -1 for a rubric that does not parse (0 without the format term); nothing else counts
        return {"r_rec": 0.0, "r_margin": 0.0, "r_fmt": -1.0 if use_format else 0.0}
    # r_rec = 1[S(chosen) > S(rejected)];  r_margin = lambda * tanh((S(chosen) - S(rejected)) / tau)
    r_rec = 1.0 if S_chosen > S_rejected else 0.0
    r_margin = margin_coef * math.tanh((S_chosen - S_rejected) / margin_tau) if use_margin else 0.0
    return {"r_rec": r_rec, "r_margin": r_margin, "r_fmt": 0.0}


def group_advantages(r: list[float]) -> list[float]:
    # A_g = (r_g - mean_G) / (std_G + 1e-6) over one context's G rubrics (sample std; 0 when G < 2)
    G = len(r)
    if G < 2:
        return [0.0] * G
    mean, std = common.mean_std(r, ddof=1)
    return [(x - mean) / (std + 1e-6) for x in r]


def clipped_surrogate(logp, logp_old, A, clip_low, clip_high):
    """Per-token loss -min(ratio A, clip(ratio, 1 - clip_low, 1 + clip_high) A), a clipped flag, the ratio."""
    # ratio_i = exp(log pi(y_i) - log pi_old(y_i))
    ratio = torch.exp(logp - logp_old)
    unclipped = -ratio * A
    clipped = -torch.clamp(ratio, 1 - clip_low, 1 + clip_high) * A
    return torch.maximum(unclipped, clipped), (clipped > unclipped).float(), ratio.detach()


def k3_kl(logp, logp_ref):
    # KL(pi || ref) per token, k3 estimator: exp(ref - logp) - (ref - logp) - 1  (>= 0)
    d = logp_ref - logp
    return torch.exp(d) - d - 1


@dataclass
class Sample:
    """One sampled sequence for the update: its token ids, the [start, end) span of each sampled part
    (02: one rubric; 04: each reply of a dialogue) and that part's advantage (None: left out)."""
    ids: list[int]
    spans: list[tuple[int, int]]
    A: list[float | None]


def ppo_update(model, tokenizer, optimizer, scheduler, samples: list[Sample], args, log_kl: bool = False) -> dict:
    """PPO epochs over minibatches of samples (sorted by length to cut padding), gradient accumulation
    over micro-batches, token-mean loss over each minibatch, grad clipping; one scheduler step.

    Data-parallel: each rank holds its own samples and takes 1/world of every minibatch; the token
    count N of a minibatch and the gradients are summed over the ranks before the step, so every rank
    takes the same step, the one a single process would take on all the samples."""
    device = next(model.parameters()).device
    params = [p for p in model.parameters() if p.requires_grad]
    n_ranks = common.world()[1]
    minibatches = split_minibatches(samples, args.minibatch_size, n_ranks)
    if not minibatches:
        return {"loss": float("nan"), "clip_frac": float("nan"), "ratio_min": float("nan"), "ratio_max": float("nan"),
                "kl": float("nan"), "grad_norm": float("nan"), "train_tokens": 0, "optimizer_steps": 0,
                "skipped_updates": 1}
    A_tok = {i: token_advantages(samples[i]) for mb in minibatches for i in mb}
    need_ref = args.kl_coef > 0 or log_kl
    old, ref = old_and_ref_logprobs(model, tokenizer, samples, minibatches, args, need_ref)
    model.train()
    zero = lambda: torch.zeros((), dtype=torch.float64, device=device)  # noqa: E731
    loss_total, clipped, kl_total = zero(), zero(), zero()   # summed on the device, copied once
    ratio_lo, ratio_hi = zero() + math.inf, zero() - math.inf
    grad_norms, tokens, nonfinite_grad = [], 0, 0
    for _ in range(args.ppo_epochs):
        for mb in minibatches:
            N = common.all_reduce([sum(n_scored(samples[i]) for i in mb)])[0]   # token-mean over the minibatch
            optimizer.zero_grad(set_to_none=True)
            for micro in micro_batches(mb, args.micro_batch_size):
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
                (loss_sum / N).backward()
                loss_total += loss_sum.detach().double() / N
                clipped += was_clipped.sum()
                tokens += len(A)
            if n_ranks > 1:
                common.all_reduce_grads(params)                   # sum over ranks: the minibatch's gradient
            grad_norms.append(float(torch.nn.utils.clip_grad_norm_(params, args.max_grad_norm)))
            if math.isfinite(grad_norms[-1]):
                optimizer.step()
            else:
                optimizer.zero_grad(set_to_none=True)
                nonfinite_grad += 1
    scheduler.step()
    loss_total, clipped, kl_total, tokens = common.all_reduce(
        torch.stack([loss_total, clipped, kl_total]).tolist() + [tokens])   # one copy, one collective
    neg_lo, hi = common.all_reduce([-float(ratio_lo), float(ratio_hi)], op="max")
    n_updates = args.ppo_epochs * len(minibatches)        # the micro losses add up to one minibatch's loss
    return {"loss": loss_total / n_updates, "clip_frac": clipped / tokens, "ratio_min": -neg_lo, "ratio_max": hi,
            "kl": kl_total / tokens if need_ref else float("nan"), "grad_norm": sum(grad_norms) / len(grad_norms),
            "train_tokens": int(tokens), "optimizer_steps": n_updates, "skipped_updates": nonfinite_grad}


# ---------------------------------------------------------------------------------------------
# The main loop
# ---------------------------------------------------------------------------------------------
def main(argv=None):
    args = parse_args(argv)
    common.set_seed(args.seed)
    train, test = load_pairs(args.train), load_pairs(args.test)    # validate inputs before creating anything
    weight_turns = sft.load_sft(args.weight_turns, args.weight_tolerance)
    if args.report_limit:
        test, weight_turns = test[: args.report_limit], weight_turns[: args.report_limit]
    common.check_model_args(args)
    if not args.adapter:
        print("warning: no --adapter: starting from the base model, not from 01's SFT generator", file=sys.stderr)
    run_dir = common.open_run(args, ("metrics.jsonl", "rollouts.jsonl"))
    model, tokenizer = common.load_policy(args, trainable=True)
    judge = make_criteria_judge(args)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer, scheduler = common.make_optimizer(params, args, args.steps)
    start = 1
    ckpt = common.latest_checkpoint(run_dir / "checkpoints") if args.resume else None
    if ckpt is not None:
        state = common.load_checkpoint(ckpt, model, optimizer, scheduler)
        start, before = state["step"] + 1, state.get("report_before")
    else:
        before = None if args.skip_report else report(model, tokenizer, judge, test, weight_turns, args)
    if before:
        print(f"before RL: held-out preference-recovery accuracy {before['recovery_acc']:.3f}, "
              f"parse-valid {before['parse_valid']:.3f}")
    if args.report_only:
        print(write_report(run_dir, before, before))
        return
    logger = common.MetricsLogger(run_dir, args.track, common.public_args(args))
    print(f"run folder {run_dir} | {len(train)} train / {len(test)} test pairs | "
          f"trainable parameters {sum(p.numel() for p in params):,}")
    try:
        for step in tqdm(range(start, args.steps + 1), desc="rubric rl", initial=start - 1, total=args.steps,
                         disable=not args.progress):
            train_step(step, args, run_dir, model, tokenizer, judge, train, optimizer, scheduler, logger)
            if step % args.save_every == 0 or step == args.steps:
                common.save_checkpoint(run_dir / "checkpoints", step, model, optimizer, scheduler,
                                       extra={"report_before": before}, keep=args.keep_checkpoints)
    except common.UserError:                  # keep the finished steps, then stop with the one message
        common.checkpoint_on_error(run_dir, model, optimizer, scheduler, logger, start, args.keep_checkpoints,
                                   extra={"report_before": before})
        raise
    model.save_pretrained(run_dir / "adapter", safe_serialization=True)
    tokenizer.save_pretrained(run_dir / "adapter")
    logger.close()
    common.plot_metrics(run_dir, {"reward_mean": "reward (mean)", "recovery_rate": "preference recovered",
                                  "parse_valid": "parse-valid share", "clip_frac": "clip fraction"})
    if not args.skip_report:
        after = report(model, tokenizer, judge, test, weight_turns, args)
        print(write_report(run_dir, before, after))
    print(f"frozen rubric generator: {run_dir / 'adapter'}")


def train_step(step, args, run_dir, model, tokenizer, judge, train, optimizer, scheduler, logger):
    t0 = time.time()
    step_seed = args.seed * 100_003 + step
    torch.manual_seed(step_seed)
    batch = random.Random(step_seed).sample(train, min(args.contexts_per_step, len(train)))
    # 1. sample G rubrics per context
    model.eval()
    contexts = [p["context"] for p in batch for _ in range(args.g)]
    gens = sft.generate_rubrics(model, tokenizer, contexts, args.max_new_tokens, args.temperature,
                                args.gen_batch_size)
    parsed = [sft.parse_rubric(text, args.weight_tolerance) for text, _, _ in gens]
    # 2. judge chosen and rejected on every criterion; S(y); rewards r = r_rec + r_margin + r_fmt
    pairs = [p for p in batch for _ in range(args.g)]
    judged = judge_rubrics(judge, pairs, [rb for rb, _ in parsed])
    rewards, parts = [], []
    for (rb, _), j in zip(parsed, judged):
        if rb is not None and j is None:        # the judge failed on a valid rubric: no signal
            parts.append(None)
            rewards.append(None)
            continue
        part = preference_reward(j["S_chosen"] if j else 0.0, j["S_rejected"] if j else 0.0, rb is not None,
                                 args.margin_coef, args.margin_tau, args.use_margin, args.use_format)
        parts.append(part)
        rewards.append(part["r_rec"] + part["r_margin"] + part["r_fmt"])
    # 3. advantages within each context's group (judge-failed samples are left out)
    samples, degenerate = [], 0
    for c in range(len(batch)):
        idx = [c * args.g + i for i in range(args.g) if rewards[c * args.g + i] is not None]
        A = group_advantages([rewards[i] for i in idx])
        degenerate += all(abs(a) < 1e-9 for a in A)     # all G rewards equal: nothing to learn here
        for i, a in zip(idx, A):
            _, p_ids, y_ids = gens[i]
            samples.append(Sample(ids=p_ids + y_ids, spans=[(len(p_ids), len(p_ids) + len(y_ids))], A=[a]))
    # 4. update: the clipped surrogate on the rubric tokens
    upd = ppo_update(model, tokenizer, optimizer, scheduler, samples, args)
    # 5. log and keep the samples
    common.append_jsonl(run_dir / "rollouts.jsonl", [
        {"step": step, "pair": pairs[i].get("id"), "g": i % args.g, "text": text, "valid": rb is not None,
         "reason": why, "S_chosen": j and round(j["S_chosen"], 4), "S_rejected": j and round(j["S_rejected"], 4),
         "reward": r, **(part or {})}
        for i, ((text, _, _), (rb, why), j, part, r) in enumerate(zip(gens, parsed, judged, parts, rewards))])
    ok = [r for r in rewards if r is not None]
    judged_ok = [j for j in judged if j is not None]
    logger.log(step, {
        "reward_mean": sum(ok) / len(ok) if ok else None,
        "recovery_rate": sum(j["S_chosen"] > j["S_rejected"] for j in judged_ok) / max(1, len(judged_ok)),
        "parse_valid": sum(rb is not None for rb, _ in parsed) / len(parsed),
        "judge_failures": sum(r is None for r in rewards),
        "degenerate_groups": degenerate,
        **upd, "lr": optimizer.param_groups[0]["lr"], "step_seconds": time.time() - t0})


# ---------------------------------------------------------------------------------------------
# --- supporting pieces ---: the update's batching, data, the criteria judge, reports, CLI
# ---------------------------------------------------------------------------------------------
def n_scored(s: Sample) -> int:
    return sum(e - b for (b, e), a in zip(s.spans, s.A) if a is not None)


def split_minibatches(samples: list[Sample], minibatch_size: int, n_ranks: int) -> list[list[int]]:
    """Indices of the samples with something to score, sorted by length, cut into this rank's share of
    each minibatch; every rank gets as many minibatches (empty ones where it has run out)."""
    order = sorted((i for i, s in enumerate(samples) if n_scored(s) > 0), key=lambda i: len(samples[i].ids))
    size = math.ceil(minibatch_size / n_ranks)
    minibatches = [order[j:j + size] for j in range(0, len(order), size)]
    n_mb = int(common.all_reduce([len(minibatches)], op="max")[0])
    return minibatches + [[] for _ in range(n_mb - len(minibatches))]


def micro_batches(mb: list[int], size: int) -> list[list[int]]:
    return [mb[j:j + size] for j in range(0, len(mb), size)]


def collate(samples: list[Sample], pad_id, device):
    """Right-padded ids, attention mask and the loss mask (the tokens of every span with an
    advantage) for a list of samples."""
    return common.right_pad([s.ids for s in samples], pad_id,
                            [[span for span, a in zip(s.spans, s.A) if a is not None] for s in samples], device)


def token_advantages(s: Sample) -> torch.Tensor:
    """Every token of span t gets A[t] (flat, in the order token_logprobs returns them)."""
    spans = [(e - b, a) for (b, e), a in zip(s.spans, s.A) if a is not None]
    return torch.repeat_interleave(torch.tensor([a for _, a in spans], dtype=torch.float32),
                                   torch.tensor([n for n, _ in spans], dtype=torch.long))


@torch.no_grad()
def old_and_ref_logprobs(model, tokenizer, samples, minibatches, args, need_ref: bool) -> tuple[dict, dict]:
    """pi_old, needed only where the policy has moved since sampling: in the first minibatch of the first
    epoch it has not (ratio = 1), so the current log-probs, detached, serve there; with one epoch and one
    minibatch no extra forward pass is spent at all. And the reference (the base model, adapter off),
    once per rollout when the KL is used or logged."""
    device = next(model.parameters()).device
    old_from = 1 if args.ppo_epochs == 1 else 0           # the first minibatch that needs pi_old
    old, ref = {}, {}
    if len(minibatches) <= old_from and not need_ref:
        return old, ref
    model.eval()
    for n, mb in enumerate(minibatches):
        if n < old_from and not need_ref:
            continue
        for micro in micro_batches(mb, args.micro_batch_size):
            ids, attn, mask = collate([samples[i] for i in micro], tokenizer.pad_token_id, device)
            sizes = [n_scored(samples[i]) for i in micro]
            if n >= old_from:
                old.update(zip(micro, common.token_logprobs(model, ids, attn, mask, args.temperature).split(sizes)))
            if need_ref:
                with model.disable_adapter():
                    ref.update(zip(micro, common.token_logprobs(model, ids, attn, mask, args.temperature).split(sizes)))
    return old, ref


def _reply_text(x, where, field):
    if isinstance(x, str) and x.strip():
        return x.strip()
    ok = isinstance(x, list) and len(x) >= 1 and isinstance(x[-1], dict) and x[-1].get("role") == "assistant" \
        and isinstance(x[-1].get("content"), str) and x[-1]["content"].strip()
    common.check(ok, f"{where}: field '{field}' must be a non-empty string or a list ending with an assistant message")
    return x[-1]["content"].strip()


def load_pairs(path: str) -> list[dict]:
    recs = common.read_jsonl(path)
    for r in recs:
        w = r["_where"]
        ctx = r.get("prompt", r.get("messages"))
        common.check(ctx is not None, f"{w}: needs field 'prompt' (or 'messages')")
        if isinstance(ctx, str):
            ctx = [{"role": "user", "content": ctx}]
        r["context"] = sft.check_messages(ctx, w)
        r["chosen_text"] = _reply_text(r.get("chosen"), w, "chosen")
        r["rejected_text"] = _reply_text(r.get("rejected"), w, "rejected")
        common.check(r["chosen_text"] != r["rejected_text"], f"{w}: chosen and rejected are the same text")
    return recs


# the judge: s(y, c) in [0, 1] for a reply y and each criterion c
CRITERIA_PROMPT = """You judge one reply in an emotional-support conversation against a list of criteria.
Conversation so far:
{history}

Reply to judge:
{reply}

Criteria:
{criteria}

Score how well the reply meets each criterion, 0 (not at all) to 10 (fully). Answer with JSON only:
{{"scores": [one number per criterion, in order]}}"""


class EmbedCriteriaJudge:
    """s(y, c) = max(0, cos(e(y), e(c))), all-MiniLM-L6-v2 (see the docstring for what this is not)."""

    def __init__(self):
        self.embed = common.EmbedBackend(str(common.pick_device()))

    def score(self, items: list[dict]) -> list[list[float] | None]:
        out = []
        for it in items:
            e = self.embed.encode([it["reply"]] + it["criteria"])
            out.append([max(0.0, float(e[0] @ e[j])) for j in range(1, len(it["criteria"]) + 1)])
        return out


class LLMCriteriaJudge:
    """An hf: or api: model asked for 0-10 per criterion; malformed answers are asked again."""

    def __init__(self, backend, retries: int = 2):
        self.backend, self.retries = backend, retries

    def score(self, items: list[dict]) -> list[list[float] | None]:
        prompts = []
        for it in items:
            history = "\n".join(common.transcript_lines(it["context"]))
            crit = "\n".join(f"{j + 1}. {c}" for j, c in enumerate(it["criteria"]))
            prompts.append([{"role": "user", "content": CRITERIA_PROMPT.format(
                history=history, reply=it["reply"], criteria=crit)}])
        return common.ask_json(self.backend, prompts, lambda i, text: parse_scores(text, len(items[i]["criteria"])),
                               self.retries, max_tokens=200)


def parse_scores(text: str | None, n: int) -> list[float] | None:
    """{"scores": [n numbers in 0-10]} (possibly wrapped in prose) -> n scores in [0, 1], or None."""
    scores = (common.extract_json(text) or {}).get("scores")
    if not isinstance(scores, list) or len(scores) != n:
        return None
    if not all(isinstance(x, (int, float)) and not isinstance(x, bool) and 0 <= x <= 10 for x in scores):
        return None
    return [x / 10 for x in scores]


def make_criteria_judge(args):
    if args.judge == "embed":
        return EmbedCriteriaJudge()
    return LLMCriteriaJudge(common.make_chat_backend(args.judge, args), retries=args.judge_retries)


def judge_by_dimension(judge, cases: list[dict]) -> list[dict | None]:
    """cases: {"context", "reply", "criteria": {name: [criterion, ...]}} -> per case {name: [s(y, c) for
    each criterion]}, or None where the judge failed on any of them. One judge call for every (case,
    name); 04 asks its CARE and Kardia-R1 rewards this way too."""
    items, where = [], []
    for i, c in enumerate(cases):
        for name, criteria in c["criteria"].items():
            items.append({"context": c["context"], "reply": c["reply"], "criteria": criteria})
            where.append((i, name))
    scores = judge.score(items) if items else []
    out: list[dict | None] = [{} for _ in cases]
    for (i, name), sc in zip(where, scores):
        if out[i] is not None:
            out[i] = None if sc is None else {**out[i], name: sc}
    return out


def judge_rubrics(judge, pairs: list[dict], rubrics: list[dict | None]) -> list[dict | None]:
    """For each (pair, rubric): S(chosen), S(rejected) and the per-criterion scores; None when the
    rubric is invalid or the judge failed on it."""
    cases, where = [], []
    for i, (p, rb) in enumerate(zip(pairs, rubrics)):
        if rb is not None:
            for side in ("chosen", "rejected"):
                cases.append({"context": p["context"], "reply": p[f"{side}_text"], "criteria": rb["criteria"]})
                where.append((i, side))
    per: dict[int, dict] = {}
    for (i, side), s in zip(where, judge_by_dimension(judge, cases)):
        per.setdefault(i, {})[side] = s
    out = []
    for i, rb in enumerate(rubrics):
        s = per.get(i)
        if rb is None or s["chosen"] is None or s["rejected"] is None:
            out.append(None)
            continue
        out.append({"S_chosen": rubric_score(rb, s["chosen"]), "S_rejected": rubric_score(rb, s["rejected"]), "s": s})
    return out


# reports: preference-recovery accuracy, parse-valid rate, mean weights by turn and by emotion
def report(model, tokenizer, judge, test_pairs, weight_turns, args) -> dict:
    model.eval()
    gens = sft.generate_rubrics(model, tokenizer, [p["context"] for p in test_pairs], args.max_new_tokens, 0.0,
                                args.gen_batch_size)
    rubrics = [sft.parse_rubric(text, args.weight_tolerance)[0] for text, _, _ in gens]
    judged = judge_rubrics(judge, test_pairs, rubrics)
    hits = [j is not None and j["S_chosen"] > j["S_rejected"] for j in judged]
    by_need: dict[str, list[bool]] = {}
    for p, h in zip(test_pairs, hits):
        by_need.setdefault(p.get("need", "all"), []).append(h)
    gens = sft.generate_rubrics(model, tokenizer, [r["messages"] for r in weight_turns], args.max_new_tokens, 0.0,
                                args.gen_batch_size)
    by_turn, by_emotion = [], []
    for r, (text, _, _) in zip(weight_turns, gens):
        rb = sft.parse_rubric(text, args.weight_tolerance)[0]
        if rb is not None:
            by_turn.append((r.get("turn", sum(m["role"] == "user" for m in r["messages"])), rb["weights"]))
            by_emotion.append((r.get("emotion", "unknown"), rb["weights"]))
    model.train()
    n = len(test_pairs)
    return {"recovery_acc": sum(hits) / n, "parse_valid": sum(r is not None for r in rubrics) / n,
            "recovery_by_need": {k: sum(v) / len(v) for k, v in sorted(by_need.items())},
            "weights_by_turn": mean_weights_by(by_turn), "weights_by_emotion": mean_weights_by(by_emotion),
            "weight_turns_valid": len(by_turn), "weight_turns": len(weight_turns)}


def mean_weights_by(rows: list[tuple]) -> dict:
    """(key, {dimension: weight}) rows -> {str(key): {"n": rows, "w": [mean w_C, mean w_A, mean w_P]}},
    keys in order (numbers numerically). The paper's Figures 3-4; 05 tabulates 04's rubrics with it."""
    groups: dict = {}
    for key, w in rows:
        groups.setdefault(key, []).append([w[d] for d in DIMS])
    order = sorted(groups, key=lambda k: (not isinstance(k, (int, float)), k if isinstance(k, (int, float)) else str(k)))
    return {str(k): {"n": len(groups[k]), "w": [round(sum(x[j] for x in groups[k]) / len(groups[k]), 4)
                                               for j in range(len(DIMS))]} for k in order}


def plot_weights(tables: dict, xlabel: str, path: Path):
    """tables: {label: mean_weights_by(...)} -> one stacked bar chart per label, side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = list(dict.fromkeys(k for t in tables.values() for k in t))
    fig, axes = plt.subplots(1, len(tables), figsize=(5.5 * len(tables), 3.6), sharey=True, squeeze=False)
    for ax, (label, table) in zip(axes[0], tables.items()):
        bottom = [0.0] * len(keys)
        for j, d in enumerate(DIMS):
            vals = [table.get(k, {"w": [0.0] * len(DIMS)})["w"][j] for k in keys]
            ax.bar(keys, vals, bottom=bottom, label=d)
            bottom = [b + v for b, v in zip(bottom, vals)]
        ax.set_title(f"mean rubric weights by {xlabel}, {label}", fontsize=9)
        ax.tick_params(axis="x", rotation=45 if max((len(k) for k in keys), default=0) > 3 else 0)
    axes[0][0].set_ylabel("weight")
    axes[0][-1].legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(run_dir: Path, before: dict, after: dict):
    (run_dir / "report.json").write_text(json.dumps({"before": before, "after": after}, indent=1))
    L = ["| held-out | before RL | after RL |", "|---|---|---|",
         f"| preference-recovery accuracy | {before['recovery_acc']:.3f} | {after['recovery_acc']:.3f} |",
         f"| parse-valid rate | {before['parse_valid']:.3f} | {after['parse_valid']:.3f} |"]
    for k in after["recovery_by_need"]:
        L.append(f"| accuracy, {k} needed | {before['recovery_by_need'].get(k, 0):.3f} | {after['recovery_by_need'][k]:.3f} |")
    for name, key in (("turn index", "weights_by_turn"), ("user emotion", "weights_by_emotion")):
        L += ["", f"| mean weights (C / A / P) by {name} | n | before RL | after RL |", "|---|---|---|---|"]
        for k, v in after[key].items():
            b = before[key].get(k, {"w": [float("nan")] * 3})["w"]
            L.append(f"| {k} | {v['n']} | {' / '.join(f'{x:.2f}' for x in b)} | {' / '.join(f'{x:.2f}' for x in v['w'])} |")
    (run_dir / "report.md").write_text("\n".join(L) + "\n")
    for key, xlabel in (("weights_by_turn", "turn index"), ("weights_by_emotion", "user emotion")):
        plot_weights({"before RL": before[key], "after RL": after[key]}, xlabel, run_dir / f"{key}.png")
    return "\n".join(L)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    common.add_model_args(p)
    g = p.add_argument_group("data")
    g.add_argument("--train", default=str(HERE / "data" / "rubric_pref_train.jsonl"), help="preference pairs")
    g.add_argument("--test", default=str(HERE / "data" / "rubric_pref_test.jsonl"), help="held-out pairs")
    g.add_argument("--weight-turns", default=str(HERE / "data" / "rubric_sft_val.jsonl"),
                   help="held-out supervision turns (with turn and emotion) for the weights report")
    g.add_argument("--weight-tolerance", type=float, default=0.02, help="|sum of weights - 1| allowed")
    g = p.add_argument_group("reward")
    g.add_argument("--judge", default="embed", help="embed | hf:<model-or-path> | api:<model>: scores s(y, c)")
    g.add_argument("--judge-retries", type=int, default=2, help="re-asks of an LLM judge on malformed JSON")
    g.add_argument("--margin-coef", type=float, default=0.5, help="lambda of the margin term")
    g.add_argument("--margin-tau", type=float, default=0.05, help="tau: score difference where tanh bends")
    g.add_argument("--no-margin", action="store_true", help="ablation: drop the margin term")
    g.add_argument("--no-format", action="store_true", help="ablation: an invalid rubric gets 0, not -1")
    g.add_argument("--recovery-only", action="store_true", help="ablation: recovery term only")
    g = p.add_argument_group("algorithm")
    g.add_argument("--g", type=int, default=4, help="rubrics sampled per context (the group)")
    g.add_argument("--temperature", type=float, default=1.0, help="sampling temperature of the rubrics")
    g.add_argument("--max-new-tokens", type=int, default=256, help="token cap of a rubric")
    g.add_argument("--clip-low", type=float, default=0.2, help="ratio clip below: 1 - clip_low")
    g.add_argument("--clip-high", type=float, default=0.28, help="ratio clip above: 1 + clip_high")
    g.add_argument("--kl-coef", type=float, default=0.0, help="beta of the k3 KL to the adapter-off base")
    g = p.add_argument_group("optimisation")
    g.add_argument("--steps", type=int, default=30, help="RL steps")
    g.add_argument("--contexts-per-step", type=int, default=4, help="preference pairs per step")
    g.add_argument("--lr", type=float, default=5e-5, help="peak learning rate (AdamW)")
    g.add_argument("--weight-decay", type=float, default=0.0, help="AdamW weight decay")
    g.add_argument("--warmup-ratio", type=float, default=0.05, help="share of steps with linear warmup")
    g.add_argument("--ppo-epochs", type=int, default=1, help="passes over each batch of rubrics")
    g.add_argument("--minibatch-size", type=int, default=64, help="rubrics per optimizer step")
    g.add_argument("--micro-batch-size", type=int, default=4, help="rubrics per forward/backward")
    g.add_argument("--max-grad-norm", type=float, default=1.0, help="gradient clipping")
    g.add_argument("--gen-batch-size", type=int, default=16, help="contexts per generate call")
    common.add_backend_args(p)
    g = common.add_run_args(p, "rubric-rl", save_every=10, resume="a run folder: continue from its last checkpoint")
    g.add_argument("--report-limit", type=int, default=0, help="use the first N held-out pairs / turns (0 = all)")
    g.add_argument("--skip-report", action="store_true", help="no before/after report (quick runs)")
    g.add_argument("--report-only", action="store_true",
                   help="no training: write the held-out report of --model (+ --adapter) and stop")
    args = p.parse_args(argv)
    c = common.check
    c(not (args.report_only and args.skip_report), "--report-only and --skip-report exclude each other")
    c(args.g >= 2, f"--g must be >= 2 (advantages are normalised within the group), got {args.g}")
    c(args.steps >= 1 and args.contexts_per_step >= 1, "--steps and --contexts-per-step must be >= 1")
    c(args.lr > 0, f"--lr must be > 0, got {args.lr}")
    c(args.temperature > 0, f"--temperature must be > 0 to sample a group, got {args.temperature}")
    c(args.margin_tau > 0, f"--margin-tau must be > 0, got {args.margin_tau}")
    c(args.margin_coef >= 0, f"--margin-coef must be >= 0, got {args.margin_coef}")
    c(args.max_new_tokens >= 8, f"--max-new-tokens must be >= 8, got {args.max_new_tokens}")
    c(args.ppo_epochs >= 1 and args.minibatch_size >= 1 and args.micro_batch_size >= 1,
      "--ppo-epochs, --minibatch-size and --micro-batch-size must be >= 1")
    c(args.judge == "embed" or args.judge.startswith(("hf:", "api:")),
      f"--judge must be embed, hf:<model> or api:<model>, got '{args.judge}'")
    common.check_backend_args(args)
    args.use_margin = not (args.no_margin or args.recovery_only)
    args.use_format = not (args.no_format or args.recovery_only)
    return args


if __name__ == "__main__":
    common.run_main(main)

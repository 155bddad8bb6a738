"""02_rubric_pref_rl.py: CARE stage 2, preference RL of the rubric generator.

Starts from 01's adapter. Each step takes preference pairs (a context, the reply people preferred, the one they
did not), samples G rubrics per context, has the judge score both replies on every criterion of each rubric, and
rewards a rubric that ranks the preferred reply higher, by how much, and that parses at all; a clipped policy
gradient on the rubric tokens follows. Before and after RL it reports, on held-out pairs, the preference-recovery
accuracy and the parse-valid rate, and the mean weights by turn and by the user's emotion (CARE's Figures 3-4).
The final adapter is the frozen generator of 04's --reward care.

Imports 01_rubric_sft: the rubric format, its parser, batched rubric generation and the criteria judge.
Reads   data/rubric_pref_train.jsonl / data/rubric_pref_test.jsonl (TRL's preference format: "prompt" or
        "messages" ending with a user turn, "chosen", "rejected"), data/rubric_sft_val.jsonl (for the weights
        report), the generator (--model + --adapter from 01), the judge (embed offline, hf:, api:).
Writes  runs/<name>-<time>/: args.json, metrics.jsonl, rollouts.jsonl (every rubric with its scores and reward),
        report.md + report.json (before / after), weights_by_turn.png, weights_by_emotion.png, checkpoint.pt,
        adapter/, curves.png.

Equations (CARE; docs/reference.md section 5)
  S(y)          sum_d w_d (1/|C_d|) sum_{c in C_d} s(y, c)     s in [0, 1], the judge's score (01)
  reward        r = r_rec + r_margin + r_fmt:  r_rec = 1[S(chosen) > S(rejected)],  r_margin = lambda tanh((S(chosen)
                - S(rejected)) / tau),  r_fmt = 0 for a rubric that parses, -1 otherwise (then r_rec = r_margin = 0)
  advantage     A_g = (r_g - mean_G) / (std_G + 1e-6)     over the G rubrics of one context (sample std)
  loss          L = (1/N) sum_i max(-ratio_i A_i, -clip(ratio_i, 1 - eps_low, 1 + eps_high) A_i) + beta (1/N) sum_i k3_i
                over the N rubric tokens; ratio_i = pi(y_i) / pi_old(y_i); k3 to the base (the adapter off)
  accuracy      the share of held-out pairs whose greedy rubric gives S(chosen) > S(rejected) (invalid: a miss)

Where each part lives
  here          Args; the reward (preference_reward); the advantage; the loss; the update; the report; the loop
  01            the rubric's parser, its generation, the criteria judge;  runs.py  the run folder, the log

Departures from CARE, one line each; the reasons: docs/reference.md, "Known departures at a glance" (item)
  1. LoRA, a small generator and a small preference set written for this project (17)
  2. the margin's form, lambda tanh(diff / tau), is ours: the paper gives none (11)
  3. the offline judge is a similarity, not a judgement: an LLM judge (hf:, api:) for results (17)
  4. with the defaults a step is one optimizer step on the rubrics just sampled: ratio 1, no clip (19)

CPU:  python 02_rubric_pref_rl.py --adapter runs/rubric-sft-<time>/adapter   (docs/results.md has the seconds a step)
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

import backends
import common
import options
import plots
import runs
import sampling

sft = importlib.import_module("01_rubric_sft")  # the rubric format, parser, generation and criteria judge
HERE = Path(__file__).resolve().parent
DIMS = sft.DIMS
GEN_BATCH = 16  # contexts per generate call
CLIP_LOW, CLIP_HIGH = 0.2, 0.28  # the ratio's clip [1 - eps_low, 1 + eps_high], as 04's


count = options.number(int, low=1)  # a checking type: a bad value exits 2 with one line naming the flag


@dataclass
class Args:
    """02_rubric_pref_rl.py's own: the algorithm first (the group, the reward's terms, the KL), then the
    optimisation, the data, the judge, the report and the checkpoints."""

    g: int = options.option(4, "rubrics sampled per context (the group G)", type=options.number(int, low=2))
    temperature: float = options.option(1.0, "sampling temperature of the rubrics", type=options.number(above=0))
    margin_coef: float = options.option(0.5, "lambda of the margin term", type=options.number(low=0))
    margin_tau: float = options.option(0.05, "tau: the score difference where tanh bends", type=options.number(above=0))
    no_margin: bool = options.option(False, "ablation: drop the margin term")
    no_format: bool = options.option(False, "ablation: an invalid rubric gets 0, not -1")
    recovery_only: bool = options.option(False, "ablation: the recovery term only")
    kl_coef: float = options.option(
        0.0, "beta of the k3 KL to the adapter-off base (the model before 01's SFT)", type=options.number(low=0)
    )
    lr: float = options.option(5e-5, "peak learning rate (AdamW, no weight decay)", type=options.number(above=0))
    steps: int = options.option(30, "RL steps", type=count)
    contexts_per_step: int = options.option(4, "preference pairs per step", type=count)
    minibatch_size: int = options.option(
        64, "rubrics per optimizer step (whole contexts: a multiple of --g)", type=count
    )
    micro_batch_size: int = options.option(4, "rubrics per forward/backward", type=count)
    max_new_tokens: int = options.option(256, "token cap of a rubric", type=options.number(int, low=8))
    train: str = options.option(str(HERE / "data" / "rubric_pref_train.jsonl"), "preference pairs")
    test: str = options.option(str(HERE / "data" / "rubric_pref_test.jsonl"), "held-out pairs")
    weight_turns: str = options.option(
        str(HERE / "data" / "rubric_sft_val.jsonl"),
        "held-out supervision turns (with turn and emotion) for the weights report",
    )
    weight_tolerance: float = options.option(0.02, "|sum of weights - 1| allowed", type=options.number(low=0, high=0.5))
    judge: str = options.option("embed", "embed | hf:<model-or-path> | api:<model>: scores s(y, c)")
    judge_retries: int = options.option(
        2,
        "re-asks of an api: judge on malformed JSON (a local judge at temperature 0 is not re-asked: it would "
        "answer the same)",
        type=options.number(int, low=0),
    )
    report_limit: int = options.option(
        0, "use the first N held-out pairs / turns (0 = all)", type=options.number(int, low=0)
    )
    report_only: bool = options.option(False, "no training: the held-out report of --model (+ --adapter), then stop")
    save_every: int = options.option(10, "write <run>/checkpoint.pt every N steps (and at the last)", type=count)
    resume: str | None = options.option(None, "a run folder: continue from its last checkpoint")


# ---------------------------------------------------------------------------------------------
# The equations: preference reward, group advantage, the clipped loss (S(y): 01's rubric_score)
# ---------------------------------------------------------------------------------------------
def preference_reward(
    S_chosen, S_rejected, valid: bool, margin_coef: float, margin_tau: float, use_margin=True, use_format=True
) -> dict:
    """r = r_rec + r_margin + r_fmt for one sampled rubric (the three returned for the log)."""
    if not valid:
        # r_fmt = -1 for a rubric that does not parse (0 without the format term); nothing else counts
        return {"r_rec": 0.0, "r_margin": 0.0, "r_fmt": -1.0 if use_format else 0.0}
    # r_rec = 1[S(chosen) > S(rejected)];  r_margin = lambda * tanh((S(chosen) - S(rejected)) / tau)
    r_rec = 1.0 if S_chosen > S_rejected else 0.0
    r_margin = margin_coef * math.tanh((S_chosen - S_rejected) / margin_tau) if use_margin else 0.0
    return {"r_rec": r_rec, "r_margin": r_margin, "r_fmt": 0.0}


def group_advantages(r: list[float]) -> list[float]:
    # A_g = (r_g - mean_G) / (std_G + 1e-6) over one context's G rubrics (the sample std; 0 when G < 2)
    if len(r) < 2:
        return [0.0] * len(r)
    mean, std = common.mean_std(r, ddof=1)
    return [(x - mean) / (std + 1e-6) for x in r]


def clipped_surrogate(logp, logp_old, A, clip_low, clip_high):
    """Per token: the loss max(-ratio A, -clip(ratio, 1 - clip_low, 1 + clip_high) A), and whether the clip
    chose it."""
    # ratio_i = exp(log pi(y_i) - log pi_old(y_i))
    ratio = torch.exp(logp - logp_old)
    unclipped, clipped = -ratio * A, -torch.clamp(ratio, 1 - clip_low, 1 + clip_high) * A
    return torch.maximum(unclipped, clipped), (clipped > unclipped).float()


def k3_kl(logp, logp_ref):
    # KL(pi || ref) per token, the k3 estimator: exp(ref - logp) - (ref - logp) - 1  (>= 0)
    d = logp_ref - logp
    return torch.exp(d) - d - 1


def rubric_logprobs(model, samples: list[dict], pad_id: int, temperature: float) -> torch.Tensor:
    """log pi(y_i) of every rubric token of a micro-batch, flat, at the temperature that sampled them."""
    spans = [[(s["start"], len(s["ids"]))] for s in samples]  # the rubric, after its prompt
    ids, attn, mask = sampling.right_pad([s["ids"] for s in samples], pad_id, spans, next(model.parameters()).device)
    return sampling.token_logprobs(model, ids, attn, mask, temperature)


# ---------------------------------------------------------------------------------------------
# The update: clipped policy-gradient steps on the rubric tokens
# ---------------------------------------------------------------------------------------------
def policy_update(model, tokenizer, optimizer, scheduler, samples: list[dict], args) -> dict:
    """One pass over minibatches of --minibatch-size rubrics, each one optimizer step with its gradient
    accumulated over micro-batches, the loss a token mean over the minibatch; then one scheduler step (always).
    The samples come context by context (in the step's seeded sample order) and a minibatch holds whole
    contexts (--minibatch-size / G of them), as MICA's verl launch splits a batch by prompt; rubrics are
    sorted by length only inside a minibatch, for the micro-batches' padding. samples: {"ids": prompt +
    rubric, "start": where the rubric starts, "A": its advantage, "context": its context's index, "sampler":
    each rubric token's log-probability as it was sampled}. pi_old, the reference and the update's own
    log-probabilities are all taken in train mode (as 04 takes them: one forward, LoRA's dropout 0)."""
    params, pad, temp = [p for p in model.parameters() if p.requires_grad], tokenizer.pad_token_id, args.temperature
    per = args.minibatch_size // args.g  # contexts per minibatch
    contexts = sorted({x["context"] for x in samples})
    minibatches = [
        [i for i, x in enumerate(samples) if x["context"] in contexts[j : j + per]]
        for j in range(0, len(contexts), per)
    ]

    def micro(mb):  # the micro-batches of a minibatch, by length
        mb = sorted(mb, key=lambda i: len(samples[i]["ids"]))
        return [mb[j : j + args.micro_batch_size] for j in range(0, len(mb), args.micro_batch_size)]

    def sizes(part):  # the rubric tokens of each sample
        return [len(samples[i]["ids"]) - samples[i]["start"] for i in part]

    # pi_old where the policy moves before the minibatch is used: after the first optimizer step (the first
    # minibatch's ratio is exactly 1); the reference (the base, adapter off) when the KL is used
    old, ref = {}, {}
    model.train()
    with torch.no_grad():
        for n, mb in enumerate(minibatches):
            for part in micro(mb):
                batch = [samples[i] for i in part]
                if n > 0:
                    old.update(zip(part, rubric_logprobs(model, batch, pad, temp).split(sizes(part))))
                if args.kl_coef > 0:
                    with common.adapters_off(model):
                        ref.update(zip(part, rubric_logprobs(model, batch, pad, temp).split(sizes(part))))
    loss_total, clipped, kl_total, tokens, grad_norms = 0.0, 0.0, 0.0, 0, []
    gap_total, gap_max = 0.0, 0.0  # |log pi_sampler - log pi_old| over the rubric tokens
    for mb in minibatches:
        N = sum(sizes(mb))
        optimizer.zero_grad(set_to_none=True)
        mb_loss = 0.0
        for part in micro(mb):
            logp = rubric_logprobs(model, [samples[i] for i in part], pad, temp)
            A = torch.cat([torch.full((n,), samples[i]["A"]) for i, n in zip(part, sizes(part))]).to(logp.device)
            logp_old = torch.cat([old[i] for i in part]) if part[0] in old else logp.detach()
            # the sampler gap: |log pi_sampler(y_i) - log pi_old(y_i)|, 0 when sampling is scoring
            sampler = torch.tensor([x for i in part for x in samples[i]["sampler"]], device=logp.device)
            gap = (sampler - logp_old).abs()
            gap_total, gap_max = gap_total + gap.sum().item(), max(gap_max, gap.max().item())
            # L = (1/N) sum_i max(-ratio_i A_i, -clip(ratio_i) A_i)  [+ beta (1/N) sum_i k3_i]
            pg, was_clipped = clipped_surrogate(logp, logp_old, A, CLIP_LOW, CLIP_HIGH)
            loss_sum = pg.sum()
            if ref:
                kl = k3_kl(logp, torch.cat([ref[i] for i in part]))
                loss_sum, kl_total = loss_sum + args.kl_coef * kl.sum(), kl_total + kl.sum().item()
            (loss_sum / N).backward()
            mb_loss += loss_sum.item() / N
            clipped, tokens = clipped + was_clipped.sum().item(), tokens + len(A)
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, 1.0))
        if math.isfinite(grad_norm):  # a non-finite gradient is skipped, and counted
            optimizer.step()
            grad_norms.append(grad_norm)
            loss_total += mb_loss
    scheduler.step()
    steps = len(grad_norms)
    return {
        "loss": loss_total / steps if steps else math.nan,  # the mean over the optimizer steps taken, as 04's
        "clip_frac": clipped / tokens if tokens else math.nan,
        "kl": kl_total / tokens if ref else math.nan,
        "grad_norm": sum(grad_norms) / steps if steps else math.nan,
        "sampler_gap_mean": gap_total / tokens if tokens else math.nan,
        "sampler_gap_max": gap_max if tokens else math.nan,
        "token_passes": tokens,  # the rubric tokens scored (one pass)
        "optimizer_steps": steps,
        "nonfinite_grads": len(minibatches) - steps,
    }


# ---------------------------------------------------------------------------------------------
# The main loop
# ---------------------------------------------------------------------------------------------
@dataclass
class Run:
    """What the loop works with, made once by load."""

    args: argparse.Namespace
    dir: Path  # the run folder
    model: torch.nn.Module  # the generator: the base with its LoRA adapter (01's, or a fresh one)
    tokenizer: object
    judge: object  # 01's criteria judge
    train: list[dict]  # the preference pairs
    test: list[dict]  # the held-out pairs
    weight_turns: list[dict]  # the held-out turns of the weights report
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    logger: runs.MetricsLogger
    before: dict  # the held-out report before RL (kept in the checkpoint: a resumed run reports against it)


def load(args) -> tuple[Run, int]:
    """The pairs and turns (checked before anything is created), the generator, the judge, the run folder, the
    optimizer, the checkpoint to resume, the report before RL -> the Run and the first step."""
    train, test = load_pairs(args.train), load_pairs(args.test)
    weight_turns = sft.load_sft(args.weight_turns, args.weight_tolerance)
    if args.report_limit:
        test, weight_turns = test[: args.report_limit], weight_turns[: args.report_limit]
    common.check_model_args(args)
    from transformers import set_seed

    set_seed(args.seed)  # after the input checks (importing transformers takes seconds), before LoRA's draws
    model, tokenizer = common.load_policy(args, trainable=True)  # loaded before the run folder is made
    judge = sft.CriteriaJudge(args)
    if not args.adapter:
        print("warning: no --adapter: starting from the base model, not from 01's SFT generator", file=sys.stderr)
    run_dir = runs.open_run(args, ("metrics.jsonl", "rollouts.jsonl"))
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer, scheduler = common.make_optimizer(params, args.lr, 0.0, args.steps)
    state = runs.load_checkpoint(run_dir, model, optimizer, scheduler) if args.resume else None
    start = 1
    if state:
        start, before = state["step"] + 1, state["report_before"]
    else:
        before = report(model, tokenizer, judge, test, weight_turns, args)
    print(
        f"before RL: held-out preference-recovery accuracy {before['recovery_acc']:.3f}, "
        f"parse-valid {before['parse_valid']:.3f}"
    )
    if not args.report_only:
        print(
            f"run folder {run_dir} | {len(train)} train / {len(test)} test pairs | "
            f"trainable parameters {sum(p.numel() for p in params):,}"
        )
    logger = runs.MetricsLogger(run_dir)
    run = Run(args, run_dir, model, tokenizer, judge, train, test, weight_turns, optimizer, scheduler, logger, before)
    return run, start


def train_loop(run: Run, start: int):
    args = run.args
    for step in tqdm(
        range(start, args.steps + 1), desc="rubric rl", initial=start - 1, total=args.steps, disable=not args.progress
    ):
        train_step(run, step)
        if step % args.save_every == 0 or step == args.steps:
            runs.save_checkpoint(
                run.dir, step, run.model, run.optimizer, run.scheduler, extra={"report_before": run.before}
            )


def save(run: Run):
    """The adapter (the frozen generator of 04's --reward care), the curves, the held-out report after RL."""
    run.model.save_pretrained(run.dir / "adapter", safe_serialization=True)
    run.tokenizer.save_pretrained(run.dir / "adapter")
    plots.curves(
        run.dir,
        {
            "reward_mean": "reward (mean)",
            "recovery_rate": "preference recovered",
            "parse_valid": "parse-valid share",
            "clip_frac": "clip fraction",
        },
    )
    after = report(run.model, run.tokenizer, run.judge, run.test, run.weight_turns, run.args)
    print(write_report(run.dir, run.before, after))
    print(f"frozen rubric generator: {run.dir / 'adapter'}")


def main(argv=None):
    args = parse_args(argv)
    run, start = load(args)
    if args.report_only:  # the generator as it is, reported on the held-out pairs: no training
        print(write_report(run.dir, run.before, run.before))
        return
    try:
        train_loop(run, start)
    except common.UserError:  # keep the finished steps, then stop with the one message
        runs.checkpoint_on_error(
            run.dir, run.model, run.optimizer, run.scheduler, run.logger, start, extra={"report_before": run.before}
        )
        raise
    save(run)


def train_step(run: Run, step: int):
    args, model, tokenizer = run.args, run.model, run.tokenizer
    t0, step_seed = time.time(), args.seed * 100_003 + step
    torch.manual_seed(step_seed)
    batch = random.Random(step_seed).sample(run.train, min(args.contexts_per_step, len(run.train)))
    # 1. sample G rubrics per context
    model.eval()
    pairs = [p for p in batch for _ in range(args.g)]
    gens = sft.generate_rubrics(
        model, tokenizer, [p["context"] for p in pairs], args.max_new_tokens, args.temperature, GEN_BATCH
    )
    parsed = [sft.parse_rubric(gen.text, args.weight_tolerance) for gen in gens]
    # 2. judge chosen and rejected on every criterion; S(y); the rewards r = r_rec + r_margin + r_fmt
    judged = judge_rubrics(run.judge, pairs, [rb for rb, _ in parsed])
    rewards, parts = [], []
    for (rb, _), j in zip(parsed, judged):
        # the judge failed on a valid rubric: no signal (None, left out)
        part = (
            None
            if rb is not None and j is None
            else preference_reward(
                j["S_chosen"] if j else 0.0,
                j["S_rejected"] if j else 0.0,
                rb is not None,
                args.margin_coef,
                args.margin_tau,
                args.use_margin,
                args.use_format,
            )
        )
        parts.append(part)
        rewards.append(None if part is None else part["r_rec"] + part["r_margin"] + part["r_fmt"])
    # 3. advantages within each context's group (judge-failed rubrics left out)
    samples, degenerate = [], 0
    for c in range(len(batch)):
        idx = [c * args.g + i for i in range(args.g) if rewards[c * args.g + i] is not None]
        A = group_advantages([rewards[i] for i in idx])
        degenerate += all(abs(a) < 1e-9 for a in A)  # all G rewards equal: nothing to learn here
        samples += [
            {
                "ids": gens[i].prompt_ids + gens[i].ids,
                "start": len(gens[i].prompt_ids),
                "A": a,
                "context": c,
                "sampler": gens[i].logprobs,
            }
            for i, a in zip(idx, A)
            if gens[i].ids
        ]
    # 4. update: the clipped surrogate on the rubric tokens (the lr logged is the one this step used)
    lr = run.optimizer.param_groups[0]["lr"]
    upd = policy_update(model, tokenizer, run.optimizer, run.scheduler, samples, args)
    # 5. log, keep the samples
    runs.append_jsonl(
        run.dir / "rollouts.jsonl",
        [
            {
                "step": step,
                "pair": pairs[i].get("id"),
                "g": i % args.g,
                "text": gen.text,
                "valid": rb is not None,
                "reason": why,
                "S_chosen": j and round(j["S_chosen"], 4),
                "S_rejected": j and round(j["S_rejected"], 4),
                "reward": r,
                **(part or {}),
            }
            for i, (gen, (rb, why), j, part, r) in enumerate(zip(gens, parsed, judged, parts, rewards))
        ],
    )
    ok, judged_ok = [r for r in rewards if r is not None], [j for j in judged if j is not None]
    run.logger.log(
        step,
        {
            "reward_mean": sum(ok) / len(ok) if ok else None,
            "recovery_rate": sum(j["S_chosen"] > j["S_rejected"] for j in judged_ok) / max(1, len(judged_ok)),
            "parse_valid": sum(rb is not None for rb, _ in parsed) / len(parsed),
            "judge_failures": sum(r is None for r in rewards),
            "degenerate_groups": degenerate,
            **upd,
            "lr": lr,
            "step_seconds": time.time() - t0,
        },
    )


# ---------------------------------------------------------------------------------------------
# --- supporting pieces ---: data, judging rubrics, the report, CLI
# ---------------------------------------------------------------------------------------------
def load_pairs(path: str) -> list[dict]:
    recs = runs.read_jsonl(path)
    for r in recs:
        w, ctx = r["_where"], r.get("prompt", r.get("messages"))
        common.check(ctx is not None, f"{w}: needs field 'prompt' (or 'messages')")
        r["context"] = sft.check_messages([{"role": "user", "content": ctx}] if isinstance(ctx, str) else ctx, w)
        for side in ("chosen", "rejected"):  # a string, or a list ending with the assistant's message
            x = r.get(side)
            x = (
                x[-1].get("content")
                if isinstance(x, list) and x and isinstance(x[-1], dict) and x[-1].get("role") == "assistant"
                else x
            )
            common.check(
                isinstance(x, str) and x.strip(),
                f"{w}: field '{side}' must be a non-empty string or a list ending with an assistant message",
            )
            r[f"{side}_text"] = x.strip()
        common.check(r["chosen_text"] != r["rejected_text"], f"{w}: chosen and rejected are the same text")
    return recs


def judge_rubrics(judge, pairs: list[dict], rubrics: list[dict | None]) -> list[dict | None]:
    """For each (pair, rubric): S(chosen), S(rejected) and the per-criterion scores; None when the rubric is
    invalid or the judge failed on it."""
    cases = [
        {"context": p["context"], "reply": p[f"{side}_text"], "criteria": rb["criteria"]}
        for p, rb in zip(pairs, rubrics)
        if rb is not None
        for side in ("chosen", "rejected")
    ]
    scores, out = iter(sft.judge_by_dimension(judge, cases)), []
    for rb in rubrics:
        s = {"chosen": next(scores), "rejected": next(scores)} if rb is not None else {}
        ok = rb is not None and s["chosen"] is not None and s["rejected"] is not None
        out.append(
            {"S_chosen": sft.rubric_score(rb, s["chosen"]), "S_rejected": sft.rubric_score(rb, s["rejected"]), "s": s}
            if ok
            else None
        )
    return out


def report(model, tokenizer, judge, test_pairs, weight_turns, args) -> dict:
    """Held out: the preference-recovery accuracy (also by what the pair needs), the parse-valid rate, and
    the mean weights by turn index and by the user's emotion."""
    model.eval()
    gens = sft.generate_rubrics(
        model, tokenizer, [p["context"] for p in test_pairs], args.max_new_tokens, 0.0, GEN_BATCH
    )
    rubrics = [sft.parse_rubric(gen.text, args.weight_tolerance)[0] for gen in gens]
    hits = [j is not None and j["S_chosen"] > j["S_rejected"] for j in judge_rubrics(judge, test_pairs, rubrics)]
    by_need: dict[str, list[bool]] = {}
    for p, h in zip(test_pairs, hits):
        by_need.setdefault(p.get("need", "all"), []).append(h)
    gens = sft.generate_rubrics(
        model, tokenizer, [r["messages"] for r in weight_turns], args.max_new_tokens, 0.0, GEN_BATCH
    )
    by_turn, by_emotion = [], []
    for r, gen in zip(weight_turns, gens):
        rb = sft.parse_rubric(gen.text, args.weight_tolerance)[0]
        if rb is not None:
            by_turn.append((r.get("turn", sum(m["role"] == "user" for m in r["messages"])), rb["weights"]))
            by_emotion.append((r.get("emotion", "unknown"), rb["weights"]))
    model.train()
    return {
        "recovery_acc": sum(hits) / len(test_pairs),
        "parse_valid": sum(r is not None for r in rubrics) / len(test_pairs),
        "recovery_by_need": {k: sum(v) / len(v) for k, v in sorted(by_need.items())},
        "weights_by_turn": mean_weights_by(by_turn),
        "weights_by_emotion": mean_weights_by(by_emotion),
        "weight_turns_valid": len(by_turn),
        "weight_turns": len(weight_turns),
    }


def mean_weights_by(rows: list[tuple]) -> dict:
    """(key, {dimension: weight}) rows -> {str(key): {"n": rows, "w": [mean w_C, mean w_A, mean w_P]}}, the
    keys in order (numbers numerically): the paper's Figures 3-4."""
    groups: dict = {}
    for key, w in rows:
        groups.setdefault(key, []).append([w[d] for d in DIMS])

    def numbers_first(k):
        return (0, k, "") if isinstance(k, (int, float)) else (1, 0, str(k))

    order = sorted(groups, key=numbers_first)
    return {
        str(k): {
            "n": len(groups[k]),
            "w": [round(sum(x[j] for x in groups[k]) / len(groups[k]), 4) for j in range(len(DIMS))],
        }
        for k in order
    }


def write_report(run_dir: Path, before: dict, after: dict) -> str:
    """report.json, report.md (before / after RL) and the two weight plots (plots.rubric_weights)."""
    (run_dir / "report.json").write_text(json.dumps({"before": before, "after": after}, indent=1))
    L = [
        "| held-out | before RL | after RL |",
        "|---|---|---|",
        f"| preference-recovery accuracy | {before['recovery_acc']:.3f} | {after['recovery_acc']:.3f} |",
        f"| parse-valid rate | {before['parse_valid']:.3f} | {after['parse_valid']:.3f} |",
    ]
    L += [
        f"| accuracy, {k} needed | {before['recovery_by_need'].get(k, 0):.3f} | {v:.3f} |"
        for k, v in after["recovery_by_need"].items()
    ]
    for name, key in (("turn index", "weights_by_turn"), ("user emotion", "weights_by_emotion")):
        L += ["", f"| mean weights (C / A / P) by {name} | n | before RL | after RL |", "|---|---|---|---|"]
        for k, v in after[key].items():
            b = before[key].get(k, {"w": [float("nan")] * 3})["w"]
            w = v["w"]
            L.append(f"| {k} | {v['n']} | {' / '.join(f'{x:.2f}' for x in b)} | {' / '.join(f'{x:.2f}' for x in w)} |")
    plots.rubric_weights(run_dir, DIMS)
    (run_dir / "report.md").write_text("\n".join(L) + "\n")
    return "\n".join(L)


def parse_args(argv=None):
    p = options.options_parser(
        __doc__.split("\n")[0],
        [
            ("02_rubric_pref_rl.py", Args),
            ("model", options.ModelOptions),
            ("LLM endpoints (api: backends)", backends.EndpointOptions),
            ("run", runs.RunOptions),
        ],
    )
    p.set_defaults(run_name="rubric-rl")
    args = options.parse_options(p, argv)
    common.check(
        args.judge == "embed" or args.judge.startswith(("hf:", "api:")),
        f"--judge must be embed, hf:<model> or api:<model>, got '{args.judge}'",
    )
    common.check(
        args.minibatch_size % args.g == 0,
        f"--minibatch-size must be a multiple of --g (a minibatch "
        f"holds whole contexts), got {args.minibatch_size} and {args.g}",
    )
    args.use_margin = not (args.no_margin or args.recovery_only)
    args.use_format = not (args.no_format or args.recovery_only)
    return args


if __name__ == "__main__":
    common.run_main(main)

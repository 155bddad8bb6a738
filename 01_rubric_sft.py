"""01_rubric_sft.py: CARE stage 1, supervised fine-tuning of the rubric generator (LoRA).

For a dialogue up to the user's latest turn, CARE's generator writes a rubric for the supporter's next reply:
weights over cognitive / affective / proactive empathy and 1-4 criteria per dimension. This script fine-tunes a
LoRA adapter on labelled turns, the loss on the rubric's tokens only, evaluates on held-out turns every
--eval-every steps, and saves the adapter that 02 starts from.

Reads   data/rubric_sft_train.jsonl / data/rubric_sft_val.jsonl (or --train / --val): {"messages": [... ending
        with a user turn], "rubric": {...}}; the base model (--model). scripts/label_rubrics.py writes this
        format from your own dialogues with a teacher LLM.
Writes  runs/<name>-<time>/: args.json, metrics.jsonl, eval_samples.jsonl, checkpoint.pt, adapter/, curves.png.

Equations (CARE; docs/reference.md section 5)
  rubric        {"weights": {d: w_d}, "criteria": {d: [c, ...]}} for d in (cognitive, affective, proactive);
                w_d >= 0, sum_d w_d = 1 (within --weight-tolerance, then renormalised), 1-4 criteria per d
  SFT loss      L = -(1/N) sum_i log p(y_i | x, y_<i)   over the N rubric tokens of the batch (the closing
                end-of-turn token is a target, so the model learns to stop)
  weight MAE    (1/3) sum_d |w_d - w*_d| over held-out turns with a valid rubric;  dominant acc: the share of
                held-out turns with argmax_d w_d = argmax_d w*_d (an invalid rubric is wrong)
  S(y)          sum_d w_d (1/|C_d|) sum_{c in C_d} s(y, c),  s in [0, 1]: an LLM's 0-10 score / 10 (hf:, api:),
                or offline max(0, cos(e(y), e(c))) with all-MiniLM-L6-v2: a similarity, not a judgement

Where each part lives
  here          Args; the rubric (parse_rubric, rubric_score, the prompt, generate_rubrics); the loss; the loop;
                the criteria judge and the graders 04 calls for --reward care and kardia (care_rewards, beside
                the judge it calls); main
  runs.py       the run folder, the checkpoint, the metrics line;  options.py  the options and --config

Departures from CARE, one line each; the reasons: docs/reference.md, "Known departures at a glance" (item)
  1. LoRA on a small generator, and a small supervision set written for this project (17)
  2. turns of similar length batched together instead of packing (18)

CPU:  python 01_rubric_sft.py                     (SmolLM2, 150 steps; docs/results.md has the seconds a step)
GPU:  python 01_rubric_sft.py --model Qwen2.5-7B-Instruct --batch-size 16 --steps 300 --lr 1e-4
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch
from tqdm import tqdm

import backends
import common
import offline
import options
import plots
import runs
import sampling

HERE = Path(__file__).resolve().parent
DIMS = ("cognitive", "affective", "proactive")  # CARE's three empathy dimensions
# the generator's system prompt and the criteria judge's prompt (data/prompts.json: every stage's prompts)
PROMPTS = json.loads((HERE / "data" / "prompts.json").read_text(encoding="utf-8"))
RUBRIC_SYSTEM, CRITERIA_PROMPT = ("\n".join(PROMPTS[k]) for k in ("rubric_system", "criteria_judge"))
EVAL_BATCH = 8  # held-out turns per generate call
UNIFORM_RUBRIC = {"weights": {d: 1 / 3 for d in DIMS}, "criteria": PROMPTS["uniform_rubric"]}  # a fixed rubric


count = options.number(int, low=1)  # a checking type: a bad value exits 2 with one line naming the flag


@dataclass
class Args:
    """01_rubric_sft.py's own: the supervision, the optimisation, the held-out evaluation, checkpoints."""

    train: str = options.option(str(HERE / "data" / "rubric_sft_train.jsonl"), "supervision JSONL")
    val: str = options.option(str(HERE / "data" / "rubric_sft_val.jsonl"), "held-out turns JSONL")
    max_len: int = options.option(
        1024,
        "tokens per example (a longer prompt is cut from the left, with a warning)",
        type=options.number(int, low=64),
    )
    weight_tolerance: float = options.option(0.02, "|sum of weights - 1| allowed", type=options.number(low=0, high=0.5))
    steps: int = options.option(150, "optimizer steps", type=count)
    batch_size: int = options.option(8, "examples per step", type=count)
    micro_batch_size: int = options.option(4, "examples per forward/backward", type=count)
    lr: float = options.option(2e-4, "peak learning rate (AdamW, no weight decay)", type=options.number(above=0))
    eval_every: int = options.option(50, "evaluate on --val every N steps (and at 0)", type=count)
    eval_limit: int = options.option(0, "evaluate on the first N val turns (0 = all)", type=options.number(int, low=0))
    max_new_tokens: int = options.option(256, "token cap of a generated rubric", type=options.number(int, low=8))
    save_every: int = options.option(50, "write <run>/checkpoint.pt every N steps (and at the last)", type=count)
    resume: str | None = options.option(None, "a run folder: continue from its last checkpoint")


# ---------------------------------------------------------------------------------------------
# The rubric: its parser, the generator's prompt, batched generation (02 and 04 import these)
# ---------------------------------------------------------------------------------------------
def parse_rubric(x, tol=0.02) -> tuple[dict | None, str | None]:
    """A rubric (a dict, or text holding its JSON, perhaps in prose or a code fence) -> (the rubric with its
    weights renormalised to sum 1, None) or (None, the precise reason it is invalid)."""
    if isinstance(x, str):
        x, why = backends.first_json(x)
        if why:
            return None, why
    if not isinstance(x, dict):
        return None, f"rubric must be a JSON object, got {type(x).__name__}"
    w, crit = x.get("weights"), x.get("criteria")
    if not isinstance(w, dict) or not isinstance(crit, dict):
        return None, f"missing '{'weights' if not isinstance(w, dict) else 'criteria'}' object"
    weights, criteria = {}, {}
    for d in DIMS:
        if d not in w:
            return None, f"weights: missing dimension '{d}'"
        v = w[d]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            return None, f"weights.{d} must be a number, got {json.dumps(v)}"
        if v < 0:
            return None, f"weights.{d} is negative ({v})"
        weights[d] = float(v)
        c = crit.get(d)
        if not isinstance(c, list) or not 1 <= len(c) <= 4:
            return None, f"criteria.{d} must be a list of 1-4 criteria"
        if not all(isinstance(s, str) and s.strip() for s in c):
            return None, f"criteria.{d} must hold non-empty strings"
        criteria[d] = [s.strip() for s in c]
    if set(w) - set(DIMS):
        return None, f"weights: unknown dimension {sorted(set(w) - set(DIMS))[0]!r}"
    total = sum(weights.values())
    if abs(total - 1.0) > tol:
        return None, f"weights sum to {total:.3f}, not 1 (tolerance {tol})"
    return {"weights": {d: weights[d] / total for d in DIMS}, "criteria": criteria}, None


def rubric_score(rubric: dict, s: dict) -> float:
    """CARE's S(y) of one reply under a rubric: s[d] = the judge's scores of the reply on dimension d's
    criteria (02's preference reward and 04's --reward care both score replies so)."""
    # S(y) = sum_d w_d * (1/|C_d|) sum_{c in C_d} s(y, c)
    S = 0.0
    for d in DIMS:
        S += rubric["weights"][d] * sum(s[d]) / len(s[d])
    return S


def dominant(rubric: dict) -> str:
    return max(DIMS, key=lambda d: rubric["weights"][d])


def rubric_prompt(messages: list[dict]) -> list[dict]:
    """The generator's chat input: the dialogue as a transcript, then the request."""
    return [
        {"role": "system", "content": RUBRIC_SYSTEM},
        {
            "role": "user",
            "content": "Conversation so far:\n"
            + "\n".join(common.transcript_lines(messages))
            + "\n\nWrite the rubric for the supporter's next reply.",
        },
    ]


def prompt_text(tokenizer, messages: list[dict]) -> str:
    return tokenizer.apply_chat_template(rubric_prompt(messages), tokenize=False, add_generation_prompt=True)


def rubric_text(rubric: dict) -> str:
    return json.dumps(
        {"weights": {d: round(rubric["weights"][d], 2) for d in DIMS}, "criteria": rubric["criteria"]},
        ensure_ascii=False,
    )


class GeneratedRubric(NamedTuple):
    text: str  # the generated text, decoded
    prompt_ids: list[int]
    ids: list[int]  # the generated ids, with the end-of-turn token when it ended
    logprobs: list[float]  # each generated id's log-probability under the sampler (02's sampler gap)


def generate_rubrics(
    model, tokenizer, contexts: list[list[dict]], max_new_tokens: int, temperature: float, batch_size=8
) -> list[GeneratedRubric]:
    """For each dialogue its generated rubric, in batches of prompts of similar length (sampling.generate_batch:
    sampled from the temperature alone, whatever the model's generation_config says). Greedy (temperature 0)
    decodes each distinct prompt once: the same prompt gets the same rubric (04's K dialogues of a scenario share
    their first turn)."""
    prompts = [tokenizer(prompt_text(tokenizer, c), add_special_tokens=False)["input_ids"] for c in contexts]
    first: dict = {}  # greedy: one decoding row per distinct prompt; sampled: every row
    for i, p in enumerate(prompts):
        first.setdefault(tuple(p) if temperature == 0 else i, i)
    order, out = sorted(first.values(), key=lambda i: len(prompts[i])), [None] * len(prompts)
    for j in range(0, len(order), batch_size):
        batch = order[j : j + batch_size]
        replies = sampling.generate_batch(model, tokenizer, [prompts[i] for i in batch], max_new_tokens, temperature)
        for i, reply in zip(batch, replies):
            out[i] = GeneratedRubric(
                tokenizer.decode(reply.ids, skip_special_tokens=True), prompts[i], reply.ids, reply.logprobs
            )
    return [o if o is not None else out[first[tuple(p)]] for o, p in zip(out, prompts)]


# ---------------------------------------------------------------------------------------------
# The equation: the SFT loss on the rubric tokens
# ---------------------------------------------------------------------------------------------
def sft_loss(model, batch: list[dict], pad_id: int, device) -> tuple[torch.Tensor, int]:
    """The token-mean cross-entropy on the rubric tokens of a right-padded batch -> (loss, N)."""
    ids, attn, is_rubric = sampling.right_pad(
        [b["ids"] for b in batch], pad_id, [[(len(b["prompt_ids"]), len(b["ids"]))] for b in batch], device
    )
    labels = ids.masked_fill(is_rubric == 0, -100)  # the prompt and the padding are not targets
    L = ids.shape[1]
    # Only the last k positions can predict a rubric token (position j predicts token j + 1, and no row's
    # rubric starts before the shortest prompt ends), so the LM head runs on those alone: the logits of a
    # micro-batch shrink from B x L x V to B x k x V (k: the rubric plus the length spread)
    k = min(L, L - min(len(b["prompt_ids"]) for b in batch) + 1)
    logits = model(input_ids=ids, attention_mask=attn, logits_to_keep=k).logits[:, :-1].float()
    target = labels[:, L - k + 1 :]
    # L = -(1/N) sum_i log p(y_i | x, y_<i) over the N positions whose label is a rubric token
    loss = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), target.reshape(-1), ignore_index=-100, reduction="sum"
    )
    N = int((target != -100).sum())
    return loss / max(N, 1), N


# ---------------------------------------------------------------------------------------------
# The main loop
# ---------------------------------------------------------------------------------------------
@dataclass
class Run:
    """What the loop works with, made once by load."""

    args: argparse.Namespace
    dir: Path  # the run folder
    model: torch.nn.Module  # the generator: the base with its LoRA adapter
    tokenizer: object
    examples: list[dict]  # the encoded training turns
    val: list[dict]  # the held-out turns
    params: list  # the adapter's parameters
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    logger: runs.MetricsLogger


def load(args) -> tuple[Run, int]:
    """The labelled turns (checked before anything is created), the generator, the run folder, the optimizer, the
    checkpoint to resume -> the Run and the first step."""
    train = load_sft(args.train, args.weight_tolerance)
    val = load_sft(args.val, args.weight_tolerance)[: args.eval_limit or None]
    common.check_model_args(args)
    from transformers import set_seed

    set_seed(args.seed)  # after the input checks (importing transformers takes seconds), before LoRA's draws
    model, tokenizer = common.load_policy(args, trainable=True)  # loaded before the run folder is made
    run_dir = runs.open_run(args, ("metrics.jsonl", "eval_samples.jsonl"))
    examples = [encode(tokenizer, r, args.max_len) for r in train]
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer, scheduler = common.make_optimizer(params, args.lr, 0.0, args.steps)
    state = runs.load_checkpoint(run_dir, model, optimizer, scheduler) if args.resume else None
    start = state["step"] + 1 if state else 1
    if state:
        print(f"resumed at step {start}")
    logger = runs.MetricsLogger(run_dir)
    print(
        f"run folder {run_dir} | {len(train)} train / {len(val)} val turns | "
        f"trainable parameters {sum(p.numel() for p in params):,}"
    )
    return Run(args, run_dir, model, tokenizer, examples, val, params, optimizer, scheduler, logger), start


def save(run: Run):
    """The adapter (standard peft: 02_rubric_pref_rl.py --adapter takes it) and the curves."""
    run.model.save_pretrained(run.dir / "adapter", safe_serialization=True)
    run.tokenizer.save_pretrained(run.dir / "adapter")
    plots.curves(
        run.dir,
        {
            "loss": "SFT loss (rubric tokens)",
            "eval_parse_valid": "val: parse-valid share",
            "eval_weight_mae": "val: weight MAE",
            "eval_dominant_acc": "val: dominant dimension",
        },
    )
    print(f"rubric generator adapter: {run.dir / 'adapter'} (02_rubric_pref_rl.py --adapter takes it); curves.png")


def main(argv=None):
    args = parse_args(argv)
    run, start = load(args)
    try:
        train_loop(run, start)
    except common.UserError:  # keep the finished steps, then stop with the one message
        runs.checkpoint_on_error(run.dir, run.model, run.optimizer, run.scheduler, run.logger, start)
        raise
    save(run)


def train_loop(run: Run, start: int):
    args, run_dir, model, tokenizer, logger = run.args, run.dir, run.model, run.tokenizer, run.logger
    examples, val, params, optimizer, scheduler = run.examples, run.val, run.params, run.optimizer, run.scheduler
    device = next(model.parameters()).device

    def run_eval(step):
        model.eval()
        metrics, samples = evaluate(model, tokenizer, val, args)
        model.train()
        runs.append_jsonl(run_dir / "eval_samples.jsonl", [{"step": step, **s} for s in samples])
        logger.log(step, metrics)

    # the batches of every epoch depend only on (seed, epoch): a resumed run sees the same batches
    schedule, epoch = [], 0
    while len(schedule) < args.steps:
        schedule += length_grouped_batches(
            [len(e["ids"]) for e in examples], args.batch_size, random.Random(args.seed * 1000 + epoch)
        )
        epoch += 1
    if start == 1:
        run_eval(0)  # the untrained generator, for comparison
    model.train()
    for step in tqdm(
        range(start, args.steps + 1), desc="sft", initial=start - 1, total=args.steps, disable=not args.progress
    ):
        t0, batch = time.time(), [examples[i] for i in schedule[step - 1]]
        # 1. forward and backward over micro-batches; the token mean over the whole batch's rubric tokens
        N = sum(sum(x != -100 for x in b["labels"][1:]) for b in batch)
        optimizer.zero_grad(set_to_none=True)
        loss_sum = 0.0
        for j in range(0, len(batch), args.micro_batch_size):
            loss, n = sft_loss(model, batch[j : j + args.micro_batch_size], tokenizer.pad_token_id, device)
            (loss * n / N).backward()
            loss_sum += loss.item() * n
        # 2. clip, step, schedule (a non-finite gradient is skipped, and counted)
        gn, lr = float(torch.nn.utils.clip_grad_norm_(params, 1.0)), optimizer.param_groups[0]["lr"]
        if math.isfinite(gn):
            optimizer.step()
        scheduler.step()
        # 3. log, evaluate, checkpoint
        logger.log(
            step,
            {
                "loss": loss_sum / N,
                "grad_norm": gn,
                "lr": lr,
                "rubric_tokens": N,
                "step_seconds": time.time() - t0,
                "nonfinite_grads": int(not math.isfinite(gn)),
            },
        )
        if step % args.eval_every == 0 or step == args.steps:
            run_eval(step)
        if step % args.save_every == 0 or step == args.steps:
            runs.save_checkpoint(run_dir, step, model, optimizer, scheduler)


# ---------------------------------------------------------------------------------------------
# --- supporting pieces ---: data, encoding, batches, evaluation, the criteria judge, CLI
# ---------------------------------------------------------------------------------------------
def check_messages(msgs, where: str) -> list[dict]:
    common.check(isinstance(msgs, list) and msgs, f"{where}: field 'messages' must be a non-empty list")
    for i, m in enumerate(msgs):
        common.check(
            isinstance(m, dict)
            and m.get("role") in ("system", "user", "assistant")
            and isinstance(m.get("content"), str),
            f"{where}: messages[{i}] must be {{'role': system|user|assistant, 'content': str}}",
        )
    common.check(msgs[-1]["role"] == "user", f"{where}: messages must end with a user turn")
    common.check(any(m["content"].strip() for m in msgs if m["role"] == "user"), f"{where}: empty dialogue")
    return msgs


def load_sft(path: str, tol: float) -> list[dict]:
    recs = runs.read_jsonl(path, {"messages": list, "rubric": dict})
    for r in recs:
        check_messages(r["messages"], r["_where"])
        r["rubric"], why = parse_rubric(r["rubric"], tol)
        common.check(why is None, f"{r['_where']}: field 'rubric': {why}")
    return recs


def encode(tokenizer, rec: dict, max_len: int) -> dict:
    """The prompt ids + the target ids (the rubric JSON and the template's end of turn); labels mask the
    prompt with -100. A prompt too long for max_len loses its first tokens (the rubric instructions, then the
    oldest turns), with a warning: the model then trains on a prompt it never sees when generating."""
    p_text = prompt_text(tokenizer, rec["messages"])
    full = tokenizer.apply_chat_template(
        rubric_prompt(rec["messages"]) + [{"role": "assistant", "content": rubric_text(rec["rubric"])}], tokenize=False
    )
    common.check(full.startswith(p_text), "the chat template changes earlier turns; 01 needs one that does not")
    p_ids = tokenizer(p_text, add_special_tokens=False)["input_ids"]
    y_ids = tokenizer(full[len(p_text) :], add_special_tokens=False)["input_ids"]
    where, room = rec.get("_where", rec.get("id")), max_len - len(y_ids)
    common.check(
        len(y_ids) <= max_len // 2,
        f"{where}: the rubric is {len(y_ids)} tokens, more than half of --max-len {max_len}; raise --max-len",
    )
    if len(p_ids) > room:
        common.warn(
            f"{where}: the prompt of {len(p_ids)} tokens is cut to its last {room} (its start goes) to fit "
            f"--max-len {max_len}; raise --max-len"
        )
        p_ids = p_ids[-room:]
    return {"ids": p_ids + y_ids, "labels": [-100] * len(p_ids) + y_ids, "prompt_ids": p_ids}


def length_grouped_batches(lengths: list[int], batch_size: int, rng: random.Random) -> list[list[int]]:
    """Shuffle, sort within windows of 8 batches by length, cut into batches, shuffle the batches: little
    padding, still a random order."""
    idx = list(range(len(lengths)))
    rng.shuffle(idx)
    batches = []
    for w in range(0, len(idx), batch_size * 8):
        chunk = sorted(idx[w : w + batch_size * 8], key=lambda i: lengths[i])
        batches += [chunk[j : j + batch_size] for j in range(0, len(chunk), batch_size)]
    rng.shuffle(batches)
    return batches


def evaluate(model, tokenizer, recs: list[dict], args) -> tuple[dict, list[dict]]:
    """Greedy rubrics for held-out turns: the parse-valid rate, weight MAE, dominant-dimension accuracy."""
    gens = generate_rubrics(model, tokenizer, [r["messages"] for r in recs], args.max_new_tokens, 0.0, EVAL_BATCH)
    mae, hit, samples = [], 0, []
    for r, gen in zip(recs, gens):
        rubric, why = parse_rubric(gen.text, args.weight_tolerance)
        if rubric is not None:
            # weight MAE = (1/3) sum_d |w_d - w*_d|
            mae.append(sum(abs(rubric["weights"][d] - r["rubric"]["weights"][d]) for d in DIMS) / 3)
            hit += dominant(rubric) == dominant(r["rubric"])
        samples.append({"id": r.get("id"), "text": gen.text, "valid": rubric is not None, "reason": why})
    return {
        "eval_parse_valid": len(mae) / len(recs),
        "eval_weight_mae": sum(mae) / len(mae) if mae else None,
        "eval_dominant_acc": hit / len(recs),
    }, samples


# the criteria judge: s(y, c) in [0, 1] for a reply y and each criterion c (02 trains with it, 04 rewards)
def parse_scores(text: str | None, n: int) -> list[float] | None:
    """{"scores": [n numbers in 0-10]} (perhaps in prose) -> n scores in [0, 1], or None."""
    scores = (backends.first_json(text)[0] or {}).get("scores")
    ok = (
        isinstance(scores, list)
        and len(scores) == n
        and all(isinstance(x, (int, float)) and not isinstance(x, bool) and 0 <= x <= 10 for x in scores)
    )
    return [x / 10 for x in scores] if ok else None


class CriteriaJudge:
    """score(items {context, reply, criteria}) -> per item the scores s(y, c), or None where it failed:
    embed (offline: max(0, cos(e(y), e(c))), all-MiniLM-L6-v2) or an LLM (hf:, api:) asked for 0-10 per
    criterion, a malformed answer asked again (api: only; a local model at temperature 0 would repeat it)."""

    def __init__(self, args, policy=None, engine=None):  # policy or engine: whose frozen base is --judge self
        self.spec, self.retries = args.judge, args.judge_retries
        if self.spec == "embed":
            self.embed = offline.EmbedBackend(str(common.pick_device()))
        else:
            self.backend = backends.make_chat_backend(self.spec, args, policy=policy, engine=engine)

    def score(self, items: list[dict]) -> list[list[float] | None]:
        if self.spec == "embed":
            out = []
            for it in items:
                e = self.embed.encode([it["reply"]] + it["criteria"])  # the reply, then each criterion
                out.append([max(0.0, float(e[0] @ e[j])) for j in range(1, len(it["criteria"]) + 1)])
            return out
        prompts = [
            [
                {
                    "role": "user",
                    "content": CRITERIA_PROMPT.format(
                        history="\n".join(common.transcript_lines(it["context"])),
                        reply=it["reply"],
                        criteria="\n".join(f"{j + 1}. {c}" for j, c in enumerate(it["criteria"])),
                    ),
                }
            ]
            for it in items
        ]
        return backends.ask_json(
            self.backend,
            prompts,
            lambda i, text: parse_scores(text, len(items[i]["criteria"])),
            self.retries,
            max_tokens=200,
        )


def judge_by_dimension(judge, cases: list[dict]) -> list[dict | None]:
    """cases {"context", "reply", "criteria": {name: [criterion, ...]}} -> per case {name: [s(y, c) for each
    criterion]}, or None where the judge failed on any of them; one judge call for every (case, name)."""
    items, where = [], []
    for i, c in enumerate(cases):
        for name, criteria in c["criteria"].items():
            items.append({"context": c["context"], "reply": c["reply"], "criteria": criteria})
            where.append((i, name))
    out: list[dict | None] = [{} for _ in cases]
    for (i, name), sc in zip(where, judge.score(items) if items else []):
        if out[i] is not None:
            out[i] = None if sc is None else {**out[i], name: sc}
    return out


# ---------------------------------------------------------------------------------------------
# The graders of 04's --reward care and kardia: each turn's rubric, CARE's reward, Kardia-R1's reward.
# 04 registers care_rewards and kardia_rewards in its REWARDS; they call the criteria judge above.
# ---------------------------------------------------------------------------------------------
@dataclass
class GraderOptions:
    """CARE's rubric generator, as 04's --reward care uses it."""

    rubric_model: str | None = options.option(None, "--reward care: the frozen rubric generator (02's adapter)")
    rubric: str = options.option(
        "adaptive",
        "CARE's Table-3 ablations: the generator's weights and criteria, or w = 1/3 and fixed generic criteria, "
        "or one of the two from the generator",
        choices=["adaptive", "uniform", "weights-only", "criteria-only"],
    )
    rubric_max_new_tokens: int = options.option(256, "token cap of a generated rubric", type=count)


@dataclass
class Graders:
    """What --reward care and kardia grade with (None where unused): CARE's frozen rubric generator (02's
    adapter on the base) with its tokenizer, and the criteria judge (embed, self, hf: or api:)."""

    rubric_model: object = None
    rubric_tokenizer: object = None
    criteria_judge: object = None


def load_graders(args, policy, rewards, engine=None) -> Graders:
    """The graders the reward names in `rewards` need: care the generator (unless --rubric uniform) and the
    criteria judge, kardia the criteria judge. The judge is --judge's spec (a MiniLM cosine with embed; self: the
    policy's frozen base, or the engine's base model with --engine)."""
    graders = Graders()
    if "care" in rewards and args.rubric_model:
        gen_args = argparse.Namespace(**{**vars(args), "adapter": args.rubric_model, "gradient_checkpointing": False})
        graders.rubric_model, graders.rubric_tokenizer = common.load_policy(gen_args, trainable=False)
    if {"care", "kardia"} & set(rewards):
        graders.criteria_judge = CriteriaJudge(args, policy, engine)
    return graders


def write_rubrics(trajs, graders: Graders, args) -> int:
    """CARE: the rubric of every turn of every dialogue, into tr.extra["rubrics"]. The frozen generator writes it
    for the history the policy answered, as the user saw it (each reply's shown part), which is also the
    context the criteria judge reads. --rubric picks the Table-3 ablation (uniform: the fixed UNIFORM_RUBRIC).
    A generated rubric that does not parse is replaced by the fixed one. Returns how many did not parse."""
    contexts, where, fixed = [], [], UNIFORM_RUBRIC
    for i, tr in enumerate(trajs):
        hist = [m for m in tr.seen_history() if m["role"] != "system"]
        for t in range(tr.T):
            contexts.append(hist[: 2 * t + 1])
            where.append((i, t))
    if args.rubric == "uniform":
        generated = [fixed] * len(contexts)
    else:
        texts = generate_rubrics(
            graders.rubric_model, graders.rubric_tokenizer, contexts, args.rubric_max_new_tokens, 0.0, 16
        )
        generated = [parse_rubric(gen.text)[0] for gen in texts]
    for tr in trajs:
        tr.extra["rubrics"] = [fixed] * tr.T
    for (i, t), g in zip(where, generated):
        g = g or fixed
        trajs[i].extra["rubrics"][t] = {
            "weights": (g if args.rubric in ("adaptive", "weights-only") else fixed)["weights"],
            "criteria": (g if args.rubric in ("adaptive", "criteria-only") else fixed)["criteria"],
        }
    return sum(g is None for g in generated)


def care_rewards(trajs, args, graders) -> list[list[float]]:
    """CARE: r_t = S(y_t) under turn t's rubric (tr.extra["rubrics"], from write_rubrics). The criteria judge
    scores each reply on every criterion of its turn's rubric. NaN where the judge failed."""
    cases = []
    for tr in trajs:
        hist = [m for m in tr.seen_history() if m["role"] != "system"]
        for t in range(tr.T):
            rubric = tr.extra["rubrics"][t]
            cases.append({"context": hist[: 2 * t + 1], "reply": tr.shown[t], "criteria": rubric["criteria"]})
    scores = iter(judge_by_dimension(graders.criteria_judge, cases))
    r = []
    for tr in trajs:
        r_i = []
        for t in range(tr.T):
            s_t = next(scores)  # {d: [s(y_t, c) for c in C_d,t]}, None where the judge failed
            # r_t = S(y_t) = sum_d w_d,t (1/|C_d,t|) sum_c s(y_t, c)
            r_i.append(float("nan") if s_t is None else rubric_score(tr.extra["rubrics"][t], s_t))
        r.append(r_i)
    return r


def kardia_section(text: str, name: str) -> str:
    """The text of one of Kardia-R1's sections (<emotion>...</emotion>) of a reply, "" when absent."""
    m = re.search(rf"<{name}>(.*?)</{name}>", text, re.S)
    return m.group(1).strip() if m else ""


def kardia_criteria(scenario: dict, user_message: str) -> tuple[list[str], str]:
    """Kardia-R1's fixed rubric: four axes judged on the reply, and emotion accuracy judged on the emotion the
    reply names. Persona consistency is judged against the scenario's profile (MBTI, about, situation,
    emotion) when it has one, else its persona line. The emotion to name is the scenario's (or its
    profile's) `emotion` when given, else what the person's last message shows."""
    prof = scenario.get("profile") if isinstance(scenario.get("profile"), dict) else {}
    who = "; ".join(f"{k}: {v}" for k, v in prof.items()) or scenario.get("persona", "")
    feels = scenario.get("emotion") or prof.get("emotion")
    texts = PROMPTS["kardia_criteria"]  # data/prompts.json
    emotion = (
        texts["emotion_given"].format(feels=feels) if feels else texts["emotion_shown"].format(message=user_message)
    )
    return [c.format(who=who) for c in texts["reply"]], emotion


def kardia_rewards(trajs, args, graders) -> list[list[float]]:
    """Kardia-R1 (Rubric-as-Judge): the judge scores each shown reply on relevance, empathy, persona
    consistency and safety, and the reply's <emotion> section (the whole reply without --kardia-format) on
    emotion accuracy: does it name what this person feels (kardia_criteria). NaN where the judge failed."""
    cases = []
    for tr in trajs:
        hist = [m for m in tr.seen_history() if m["role"] != "system"]
        replies = [m["content"] for m in tr.messages if m["role"] == "assistant"]
        for t in range(tr.T):
            reply_axes, emotion_axis = kardia_criteria(tr.scenario, hist[2 * t]["content"])
            named = kardia_section(replies[t], "emotion") if args.kardia_format else tr.shown[t]
            context = hist[: 2 * t + 1]
            cases.append({"context": context, "reply": tr.shown[t], "criteria": {"reply": reply_axes}})
            cases.append(
                {"context": context, "reply": named or "(no emotion named)", "criteria": {"emotion": [emotion_axis]}}
            )
    scores = iter(judge_by_dimension(graders.criteria_judge, cases))
    r = []
    for tr in trajs:
        r_i = []
        for t in range(tr.T):
            s_reply, s_emotion = next(scores), next(scores)
            if s_reply is None or s_emotion is None:
                r_i.append(float("nan"))  # the judge failed
                continue
            # r_t = (1/5) sum_c s_c,t over the five axes + r_fmt,t. The format term r_fmt is 0 with the four
            # sections and -1 without them (only with --kardia-format)
            s = s_reply["reply"] + s_emotion["emotion"]
            r_fmt = (0.0 if tr.formatted[t] else -1.0) if args.kardia_format else 0.0
            r_i.append(sum(s) / len(s) + r_fmt)
        r.append(r_i)
    return r


def parse_args(argv=None):
    p = options.options_parser(
        __doc__.split("\n")[0],
        [("01_rubric_sft.py", Args), ("model", options.ModelOptions), ("run", runs.RunOptions)],
    )
    p.set_defaults(run_name="rubric-sft")
    return options.parse_options(p, argv)


if __name__ == "__main__":
    common.run_main(main)

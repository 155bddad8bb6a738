"""01_rubric_sft.py: CARE stage 1, supervised fine-tuning of the rubric generator (LoRA).

What it does
  For a dialogue up to the user's latest turn, CARE's generator writes a rubric for the supporter's
  next reply: weights over cognitive / affective / proactive empathy and 1-4 fine-grained criteria
  per dimension. This script fine-tunes a LoRA adapter on turn-level rubric supervision with the
  loss on the rubric tokens only, evaluates every --eval-every steps on held-out turns (parse-valid
  rate, weight MAE, dominant-dimension accuracy), and saves the adapter that 02 starts from.
  With --teacher api:<model> --label <dialogues> it instead labels a user's own dialogues (JSONL
  with "messages", or ESConv-style records with "dialog") into this supervision format.

Reads   data/rubric_sft_train.jsonl / data/rubric_sft_val.jsonl (or --train / --val: a JSONL path or a
        hub dataset name): {"messages": [... ending with a user turn], "rubric": {...}} (TRL's
        conversational format plus the rubric); the base model (--model, default the packaged SmolLM2).
Writes  runs/<name>-<time>/ : args.json, metrics.jsonl (loss per step, eval_* at each evaluation),
        eval_samples.jsonl (the generated rubrics of each evaluation), checkpoints/, adapter/,
        curves.png (loss and the val metrics by step).
        Label mode: the --label-out JSONL (valid rubrics only) and a count of dropped turns.

The rubric (one format and one parser for every stage: parse_rubric below, imported by 02 and 04)
  {"weights": {"cognitive": w_C, "affective": w_A, "proactive": w_P},
   "criteria": {"cognitive": [...], "affective": [...], "proactive": [...]}}
  w_d >= 0, sum_d w_d = 1 (within --weight-tolerance, then renormalised), 1-4 non-empty criteria per d.

Equations (CARE; docs/reference.md section 5)
  SFT loss      L = -(1/N) sum_i log p(y_i | x, y_<i)   over the N rubric tokens y of the batch
                (prompt tokens masked out; the closing end-of-turn token is a target, so the model
                learns to stop)
  weight MAE    (1/3) sum_d |w_d - w*_d|, averaged over held-out turns with a valid rubric
  dominant acc  share of held-out turns where argmax_d w_d = argmax_d w*_d (invalid counts as wrong)

Departures from the paper (and why)
  1. LoRA instead of full fine-tuning; the paper's generator is a larger model.
  2. The supervision set is small and written for this project (147 train / 33 validation turns);
     the paper labels real dialogues with a strong LLM, which --teacher does for your own data.
  3. Length-grouped batches (turns of similar length batched together) instead of packing: with
     rubric-only loss masks, packing saves little and complicates the attention mask.

CPU:  python 01_rubric_sft.py                                       (SmolLM2, ~1 s/step, 150 steps)
GPU:  python 01_rubric_sft.py --model Qwen2.5-7B-Instruct --batch-size 16 --steps 300 --lr 1e-4
Label: python 01_rubric_sft.py --teacher api:gpt-4o --label my_dialogues.jsonl --label-out sup.jsonl
"""
from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path

import torch
from tqdm import tqdm

import common

HERE = Path(__file__).resolve().parent
DIMS = ("cognitive", "affective", "proactive")   # CARE's three empathy dimensions (02 and 04 import them)


# ---------------------------------------------------------------------------------------------
# The rubric: format and parser, the generator's prompt
# ---------------------------------------------------------------------------------------------
def parse_rubric(x, tol: float = 0.02) -> tuple[dict | None, str | None]:
    """A rubric (a dict, or text that holds its JSON, possibly in prose or a code fence) ->
    (rubric with weights renormalised to sum 1, None) or (None, the precise reason it is invalid)."""
    if isinstance(x, str):
        raw = common.first_json_object(x)
        if raw is None:
            return None, "no JSON object found" if "{" not in x else "unbalanced or truncated JSON"
        try:
            x = json.loads(raw)
        except json.JSONDecodeError as e:
            return None, f"bad JSON ({e.msg})"
    if not isinstance(x, dict):
        return None, f"rubric must be a JSON object, got {type(x).__name__}"
    w, crit = x.get("weights"), x.get("criteria")
    if not isinstance(w, dict):
        return None, "missing 'weights' object"
    if not isinstance(crit, dict):
        return None, "missing 'criteria' object"
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
    extra = sorted(set(w) - set(DIMS))
    if extra:
        return None, f"weights: unknown dimension {extra[0]!r}"
    total = sum(weights.values())
    if abs(total - 1.0) > tol:
        return None, f"weights sum to {total:.3f}, not 1 (tolerance {tol})"
    return {"weights": {d: weights[d] / total for d in DIMS}, "criteria": criteria}, None


def dominant(rubric: dict) -> str:
    return max(DIMS, key=lambda d: rubric["weights"][d])


RUBRIC_SYSTEM = """You design the evaluation rubric for a supporter's next reply in an emotional-support
conversation. Decide what this moment needs: cognitive empathy (understanding and clarifying the
situation), affective empathy (recognising and validating feelings) or proactive empathy (concrete,
empowering next steps). Answer with JSON only, exactly this shape:
{"weights": {"cognitive": 0.3, "affective": 0.5, "proactive": 0.2},
 "criteria": {"cognitive": ["..."], "affective": ["...", "..."], "proactive": ["..."]}}
Weights are non-negative and sum to 1. Give 1-4 short criteria per dimension, specific to this
conversation."""


def rubric_prompt(messages: list[dict]) -> list[dict]:
    """The generator's chat input: the dialogue as a transcript, then the request."""
    return [{"role": "system", "content": RUBRIC_SYSTEM},
            {"role": "user", "content": "Conversation so far:\n" + "\n".join(common.transcript_lines(messages)) +
             "\n\nWrite the rubric for the supporter's next reply."}]


def rubric_text(rubric: dict) -> str:
    return json.dumps({"weights": {d: round(rubric["weights"][d], 2) for d in DIMS},
                       "criteria": rubric["criteria"]}, ensure_ascii=False)


def sft_loss(model, batch: list[dict], pad_id: int, device) -> tuple[torch.Tensor, int]:
    """Token-mean cross-entropy on the rubric tokens of a right-padded batch; returns (loss, N)."""
    ids, attn, is_rubric = common.right_pad([b["ids"] for b in batch], pad_id,
                                            [[(len(b["prompt_ids"]), len(b["ids"]))] for b in batch], device)
    labels = ids.masked_fill(is_rubric == 0, -100)        # the prompt and the padding are not targets
    L = ids.shape[1]
    # Only the last k positions can predict a rubric token (position j predicts token j + 1, and no
    # row's rubric starts before the shortest prompt ends), so the LM head runs on those alone: the
    # logits of a micro-batch shrink from B x L x V to B x k x V (k is the rubric plus the length
    # spread, about a quarter of L on the shipped data).
    k = min(L, L - min(len(b["prompt_ids"]) for b in batch) + 1)
    logits = model(input_ids=ids, attention_mask=attn, logits_to_keep=k).logits[:, :-1].float()
    target = labels[:, L - k + 1:]
    # L = -(1/N) sum_i log p(y_i | x, y_<i) over the N positions whose label is a rubric token
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1),
                                             ignore_index=-100, reduction="sum")
    N = int((target != -100).sum())
    return loss / max(N, 1), N


# ---------------------------------------------------------------------------------------------
# The main loop
# ---------------------------------------------------------------------------------------------
def main(argv=None):
    args = parse_args(argv)
    common.set_seed(args.seed)
    if args.teacher:
        return label_with_teacher(args)
    train = load_sft(args.train, args.weight_tolerance)   # validate inputs before creating anything
    val = load_sft(args.val, args.weight_tolerance)
    val = val[: args.eval_limit] if args.eval_limit else val
    common.check_model_args(args)
    run_dir = common.open_run(args, ("metrics.jsonl", "eval_samples.jsonl"))
    model, tokenizer = common.load_policy(args, trainable=True)
    examples = [encode(tokenizer, r, args.max_len) for r in train]
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer, scheduler = common.make_optimizer(params, args, args.steps)
    start = 1
    if args.resume and common.latest_checkpoint(run_dir / "checkpoints") is not None:
        start = common.load_checkpoint(common.latest_checkpoint(run_dir / "checkpoints"), model, optimizer,
                                       scheduler)["step"] + 1
        print(f"resumed at step {start}")
    logger = common.MetricsLogger(run_dir, args.track, common.public_args(args))
    print(f"run folder {run_dir} | {len(train)} train / {len(val)} val turns | "
          f"trainable parameters {sum(p.numel() for p in params):,}")
    try:
        train_loop(args, run_dir, model, tokenizer, examples, val, params, optimizer, scheduler, logger, start)
    except common.UserError:                  # keep the finished steps, then stop with the one message
        common.checkpoint_on_error(run_dir, model, optimizer, scheduler, logger, start, args.keep_checkpoints)
        raise
    model.save_pretrained(run_dir / "adapter", safe_serialization=True)
    tokenizer.save_pretrained(run_dir / "adapter")
    logger.close()
    common.plot_metrics(run_dir, {"loss": "SFT loss (rubric tokens)", "eval_parse_valid": "val: parse-valid share",
                                  "eval_weight_mae": "val: weight MAE", "eval_dominant_acc": "val: dominant dimension"})
    print(f"rubric generator adapter: {run_dir / 'adapter'}  (02_rubric_pref_rl.py --adapter takes it); curves.png")


def train_loop(args, run_dir, model, tokenizer, examples, val, params, optimizer, scheduler, logger, start):
    device = next(model.parameters()).device

    def run_eval(step):
        model.eval()
        metrics, samples = evaluate(model, tokenizer, val, args)
        model.train()
        common.append_jsonl(run_dir / "eval_samples.jsonl", [{"step": step, **s} for s in samples])
        logger.log(step, metrics)

    # the batch order of every epoch depends only on (seed, epoch): a resumed run sees the same batches
    schedule, epoch = [], 0
    while len(schedule) < args.steps:
        lengths = [len(e["ids"]) for e in examples]
        schedule += length_grouped_batches(lengths, args.batch_size, random.Random(args.seed * 1000 + epoch))
        epoch += 1
    if start == 1:
        run_eval(0)                                         # the untrained generator, for comparison
    model.train()
    for step in tqdm(range(start, args.steps + 1), desc="sft", initial=start - 1, total=args.steps,
                     disable=not args.progress):
        t0 = time.time()
        batch = [examples[i] for i in schedule[step - 1]]
        # 1. forward/backward over micro-batches; token-mean over the whole batch's rubric tokens
        N = sum(sum(x != -100 for x in b["labels"][1:]) for b in batch)
        optimizer.zero_grad(set_to_none=True)
        loss_sum = 0.0
        for j in range(0, len(batch), args.micro_batch_size):
            micro = batch[j:j + args.micro_batch_size]
            loss, n = sft_loss(model, micro, tokenizer.pad_token_id, device)
            (loss * n / N).backward()
            loss_sum += loss.item() * n
        # 2. clip, step, schedule
        gn = float(torch.nn.utils.clip_grad_norm_(params, args.max_grad_norm))
        lr = optimizer.param_groups[0]["lr"]
        if math.isfinite(gn):
            optimizer.step()
        scheduler.step()
        # 3. log, evaluate, checkpoint
        logger.log(step, {"loss": loss_sum / N, "grad_norm": gn, "lr": lr, "rubric_tokens": N,
                          "step_seconds": time.time() - t0, "skipped_updates": int(not math.isfinite(gn))})
        if step % args.eval_every == 0 or step == args.steps:
            run_eval(step)
        if step % args.save_every == 0 or step == args.steps:
            common.save_checkpoint(run_dir / "checkpoints", step, model, optimizer, scheduler,
                                   keep=args.keep_checkpoints)


# ---------------------------------------------------------------------------------------------
# --- supporting pieces ---: data, encoding, batches, generation and evaluation, teacher labelling, CLI
# ---------------------------------------------------------------------------------------------
def check_messages(msgs, where: str) -> list[dict]:
    common.check(isinstance(msgs, list) and msgs, f"{where}: field 'messages' must be a non-empty list")
    for i, m in enumerate(msgs):
        common.check(isinstance(m, dict) and m.get("role") in ("system", "user", "assistant")
                     and isinstance(m.get("content"), str),
                     f"{where}: messages[{i}] must be {{'role': system|user|assistant, 'content': str}}")
    common.check(msgs[-1]["role"] == "user", f"{where}: messages must end with a user turn")
    common.check(any(m["content"].strip() for m in msgs if m["role"] == "user"), f"{where}: empty dialogue")
    return msgs


def load_sft(spec: str, tol: float) -> list[dict]:
    """A JSONL path or a hub dataset owner/name[:config[:split]] (exported once to the cache as JSONL)."""
    recs = common.read_jsonl(common.hub_dataset_file(spec, "--train/--val"), {"messages": list, "rubric": dict})
    for r in recs:
        check_messages(r.get("messages"), r["_where"])
        rubric, why = parse_rubric(r.get("rubric"), tol)
        common.check(rubric is not None, f"{r['_where']}: field 'rubric': {why}")
        r["rubric"] = rubric
    return recs


def encode(tokenizer, rec: dict, max_len: int) -> dict:
    """Prompt ids + target ids (the rubric JSON and the template's end of turn); labels mask the
    prompt with -100. A prompt too long for max_len loses its oldest tokens (the context's start)."""
    prompt = rubric_prompt(rec["messages"])
    p_text = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    full = tokenizer.apply_chat_template(prompt + [{"role": "assistant", "content": rubric_text(rec["rubric"])}],
                                         tokenize=False)
    common.check(full.startswith(p_text), "the chat template changes earlier turns; 01 needs one that does not")
    p_ids = tokenizer(p_text, add_special_tokens=False)["input_ids"]
    y_ids = tokenizer(full[len(p_text):], add_special_tokens=False)["input_ids"]
    common.check(len(y_ids) <= max_len // 2, f"{rec.get('_where', rec.get('id'))}: the rubric is {len(y_ids)} "
                                             f"tokens, more than half of --max-len {max_len}; raise --max-len")
    p_ids = p_ids[-(max_len - len(y_ids)):]
    return {"ids": p_ids + y_ids, "labels": [-100] * len(p_ids) + y_ids, "prompt_ids": p_ids}


def length_grouped_batches(lengths: list[int], batch_size: int, rng: random.Random) -> list[list[int]]:
    """Shuffle, then sort within windows of 8 batches by length, cut into batches, shuffle batches:
    little padding, still random order."""
    idx = list(range(len(lengths)))
    rng.shuffle(idx)
    window = batch_size * 8
    batches = []
    for w in range(0, len(idx), window):
        chunk = sorted(idx[w:w + window], key=lambda i: lengths[i])
        batches += [chunk[j:j + batch_size] for j in range(0, len(chunk), batch_size)]
    rng.shuffle(batches)
    return batches


# generation and evaluation (02 uses generate_rubrics too)
def generate_rubrics(model, tokenizer, contexts: list[list[dict]], max_new_tokens: int, temperature: float,
                     batch_size: int = 8) -> list[tuple[str, list[int], list[int]]]:
    """Batched generation: for each dialogue -> (text, prompt ids, generated ids). Prompts of similar
    length share a batch (less padding); identical prompts in a batch are prefilled once, and with
    greedy decoding (temperature 0) decoded once too: the same prompt gets the same rubric (04's K
    rollouts of a scenario share their first turn's context)."""
    prompts = [tokenizer(tokenizer.apply_chat_template(rubric_prompt(c), tokenize=False, add_generation_prompt=True),
                         add_special_tokens=False)["input_ids"] for c in contexts]
    first: dict = {}           # greedy: one decoding row per distinct prompt; sampled: every row
    for i, p in enumerate(prompts):
        first.setdefault(tuple(p) if temperature == 0 else i, i)
    order = sorted(first.values(), key=lambda i: len(prompts[i]))
    out = [None] * len(prompts)
    for j in range(0, len(order), batch_size):
        batch = order[j:j + batch_size]
        replies = common.generate_batch(model, tokenizer, [prompts[i] for i in batch], max_new_tokens, temperature)
        for i, (y, _) in zip(batch, replies):
            out[i] = (tokenizer.decode(y, skip_special_tokens=True), prompts[i], y)
    for i, p in enumerate(prompts):
        if out[i] is None:
            out[i] = out[first[tuple(p)]]
    return out


def evaluate(model, tokenizer, recs: list[dict], args) -> tuple[dict, list[dict]]:
    """Greedy rubrics for held-out turns: parse-valid rate, weight MAE, dominant-dimension accuracy."""
    gens = generate_rubrics(model, tokenizer, [r["messages"] for r in recs], args.max_new_tokens, 0.0,
                            args.eval_batch_size)
    valid, mae, hit, samples = 0, [], 0, []
    for r, (text, _, _) in zip(recs, gens):
        rubric, why = parse_rubric(text, args.weight_tolerance)
        ref = r["rubric"]
        if rubric is not None:
            valid += 1
            # weight MAE = (1/3) sum_d |w_d - w*_d|
            mae.append(sum(abs(rubric["weights"][d] - ref["weights"][d]) for d in DIMS) / 3)
            hit += dominant(rubric) == dominant(ref)
        samples.append({"id": r.get("id"), "text": text, "valid": rubric is not None, "reason": why})
    n = len(recs)
    return {"eval_parse_valid": valid / n, "eval_weight_mae": sum(mae) / len(mae) if mae else None,
            "eval_dominant_acc": hit / n}, samples


# teacher labelling (--teacher api:<model> --label <dialogues>)
def dialogues_from(path: str) -> list[tuple[str, list[dict]]]:
    """(id, messages up to each user turn) from {"messages": [...]} or ESConv-style {"dialog": [...]}."""
    out = []
    for r in common.read_jsonl(path):
        w = r["_where"]
        if "messages" in r:
            msgs = r["messages"]
        elif "dialog" in r:
            common.check(isinstance(r["dialog"], list), f"{w}: field 'dialog' must be a list")
            msgs = []
            for i, t in enumerate(r["dialog"]):
                common.check(isinstance(t, dict) and t.get("speaker") in ("seeker", "supporter", "usr", "sys")
                             and isinstance(t.get("content"), str),
                             f"{w}: dialog[{i}] must have speaker seeker|supporter and a string content")
                role = "user" if t["speaker"] in ("seeker", "usr") else "assistant"
                if msgs and msgs[-1]["role"] == role:          # ESConv splits turns: merge them
                    msgs[-1]["content"] += " " + t["content"].strip()
                else:
                    msgs.append({"role": role, "content": t["content"].strip()})
        else:
            raise common.UserError(f"{w}: needs field 'messages' or 'dialog'")
        common.check(isinstance(msgs, list) and msgs, f"{w}: empty dialogue")
        for k, m in enumerate(msgs):
            if m.get("role") == "user":
                out.append((f"{r.get('id', w)}-t{sum(x['role'] == 'user' for x in msgs[:k + 1])}",
                            check_messages(msgs[:k + 1], w)))
    return out


def label_with_teacher(args):
    """--teacher api:<model> --label <dialogues>: the teacher writes each turn's rubric; an invalid one
    is asked again (--teacher-retries), then the turn is dropped and counted."""
    teacher = common.make_chat_backend(args.teacher, args)
    turns = dialogues_from(args.label)
    common.check(not Path(args.label_out).exists(), f"--label-out {args.label_out} exists; not overwriting it")
    rubrics = common.ask_json(teacher, [rubric_prompt(msgs) for _, msgs in turns],
                              lambda i, text: parse_rubric(text, args.weight_tolerance)[0], args.teacher_retries,
                              who="teacher", noun="turns", max_tokens=400)
    kept = [i for i, rb in enumerate(rubrics) if rb is not None]
    common.append_jsonl(args.label_out, [{"id": turns[i][0], "messages": turns[i][1], "rubric": rubrics[i]}
                                         for i in kept])
    print(f"labelled {len(kept)}/{len(turns)} turns into {args.label_out}; dropped {len(turns) - len(kept)} whose "
          f"rubric stayed invalid after {args.teacher_retries} retries ({teacher.failures} failed calls)")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    common.add_model_args(p)
    g = p.add_argument_group("data")
    g.add_argument("--train", default=str(HERE / "data" / "rubric_sft_train.jsonl"),
                   help="supervision: JSONL path or hub dataset owner/name[:config[:split]]")
    g.add_argument("--val", default=str(HERE / "data" / "rubric_sft_val.jsonl"),
                   help="held-out turns: JSONL path or hub dataset owner/name[:config[:split]]")
    g.add_argument("--max-len", type=int, default=1024, help="tokens per example (prompt cut from the left)")
    g.add_argument("--weight-tolerance", type=float, default=0.02, help="|sum of weights - 1| allowed")
    g = p.add_argument_group("optimisation")
    g.add_argument("--steps", type=int, default=150, help="optimizer steps")
    g.add_argument("--batch-size", type=int, default=8, help="examples per step")
    g.add_argument("--micro-batch-size", type=int, default=4, help="examples per forward/backward")
    g.add_argument("--lr", type=float, default=2e-4, help="peak learning rate (AdamW)")
    g.add_argument("--weight-decay", type=float, default=0.0, help="AdamW weight decay")
    g.add_argument("--warmup-ratio", type=float, default=0.05, help="share of steps with linear warmup")
    g.add_argument("--max-grad-norm", type=float, default=1.0, help="gradient clipping")
    g = p.add_argument_group("evaluation")
    g.add_argument("--eval-every", type=int, default=50, help="evaluate on --val every N steps (and at 0)")
    g.add_argument("--eval-limit", type=int, default=0, help="evaluate on the first N val turns (0 = all)")
    g.add_argument("--eval-batch-size", type=int, default=8, help="turns per generate call")
    g.add_argument("--max-new-tokens", type=int, default=256, help="token cap of a generated rubric")
    g = p.add_argument_group("teacher labelling (instead of training)")
    g.add_argument("--teacher", default=None, help="api:<model> or hf:<model>: label --label into --label-out")
    g.add_argument("--label", default=None, help="dialogues to label: JSONL with messages, or ESConv-style dialog")
    g.add_argument("--label-out", default=None, help="where the labelled supervision JSONL goes (new file)")
    g.add_argument("--teacher-retries", type=int, default=2, help="re-asks when the teacher's rubric is invalid")
    common.add_backend_args(p)
    common.add_run_args(p, "rubric-sft", save_every=50, resume="a run folder: continue from its last checkpoint")
    args = p.parse_args(argv)
    c = common.check
    c(args.steps >= 1, f"--steps must be >= 1, got {args.steps}")
    c(args.batch_size >= 1 and args.micro_batch_size >= 1, "--batch-size and --micro-batch-size must be >= 1")
    c(args.lr > 0, f"--lr must be > 0, got {args.lr}")
    c(args.max_len >= 64, f"--max-len must be >= 64, got {args.max_len}")
    c(0 <= args.weight_tolerance < 1, f"--weight-tolerance must be in [0, 1), got {args.weight_tolerance}")
    c(args.eval_every >= 1 and args.save_every >= 1, "--eval-every and --save-every must be >= 1")
    c(args.max_new_tokens >= 8, f"--max-new-tokens must be >= 8, got {args.max_new_tokens}")
    if args.teacher:
        c(args.teacher.startswith(("api:", "hf:")), f"--teacher must be api:<model> or hf:<model>, got {args.teacher}")
        c(args.label and args.label_out, "--teacher needs --label (dialogues in) and --label-out (supervision out)")
    common.check_backend_args(args)
    return args


if __name__ == "__main__":
    common.run_main(main)

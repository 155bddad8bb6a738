"""benchmarks/emobench.py: EmoBench, run by 05_eval.py --suite emobench.

What it is
  EmoBench's multiple-choice items in English and Chinese: EU (emotional understanding: which emotion, and
  its cause) and EA (emotional application: the best response or action).
What this file holds
  load            the EU / EA JSONL files (the public fields, checked)
  run             a batch of items: each option scored by option_logliks, the best one chosen, then cases
  cases           EU asks the emotion, then the cause naming the chosen emotion; EA the best option
  mcq_prompt      the question (data/prompts.json "emobench": this project's templates, both languages)
  option_logliks  score(option) = (1/|o|) sum_j log pi(o_j | prompt, o_<j), each prompt computed once

Score
  accuracy; an EU item is correct only when the emotion and the cause are both right

This project's choices (docs/evaluation.md)
  - Each option is scored by its mean log-probability as the answer (no generation, no parsing).
A support module: it imports common.py, never a stage; 05 hands it the model and the batch.
"""
from __future__ import annotations

import copy
import json
from pathlib import Path

import torch

import common

HERE = Path(__file__).resolve().parents[1]
TEXTS = json.loads((HERE / "data" / "prompts.json").read_text(encoding="utf-8"))


def run(model, tok, batch: list[dict], batch_size: int) -> list[dict]:
    """A batch of EU and EA items -> their cases: each question's options scored, the best one chosen."""
    def choose(questions):          # the option of the best mean log-probability, per question
        return [max(range(len(s)), key=s.__getitem__) for s in option_logliks(model, tok, questions, batch_size)]

    return [c for kind in ("EU", "EA") for c in cases([it for it in batch if it["case"].startswith(kind + "-")],
                                                       kind, choose)]


def cases(items, kind, choose) -> list[dict]:
    """choose(questions) -> the chosen option index per {prompt, options} question. EU asks the emotion, then
    the cause naming the chosen emotion; it is correct only when both are right."""
    def head(it):                  # the fields every case of an item has
        return {"case": it["case"], "task": kind, "language": it["language"], "failed": None,
                "category": it["category"] if kind == "EA" else it["coarse_category"]}

    if kind == "EA":
        picks = choose([{"prompt": mcq_prompt(it, "EA", it["choices"]), "options": it["choices"]} for it in items])
        return [{**head(it), "pred": it["choices"][p], "answered": True,
                 "correct": int(it["choices"][p] == it["label"])} for it, p in zip(items, picks)]
    named = [it["emotion_choices"][p] for it, p in zip(items, choose(
        [{"prompt": mcq_prompt(it, "emotion", it["emotion_choices"]), "options": it["emotion_choices"]}
         for it in items]))]
    cause = choose([{"prompt": mcq_prompt(it, "cause", it["cause_choices"], e), "options": it["cause_choices"]}
                    for it, e in zip(items, named)])
    out = []
    for it, e, c in zip(items, named, cause):
        emotion_ok, cause_ok = e == it["emotion_label"], it["cause_choices"][c] == it["cause_label"]
        out.append({**head(it), "pred": [e, it["cause_choices"][c]], "answered": True,
                    "emotion_correct": int(emotion_ok), "cause_correct": int(cause_ok),
                    "correct": int(emotion_ok and cause_ok)})
    return out


def mcq_prompt(item, question, options, emotion=None) -> str:
    T = TEXTS["emobench"]["zh" if item["language"].lower().startswith(("zh", "ch")) else "en"]
    lettered = "\n".join(f"{chr(65 + i)}. {o}" for i, o in enumerate(options))
    qtype = item.get("question type", "").strip().lower()
    text = T[question].format(scenario=item["scenario"], subject=item["subject"], emotion=emotion or T["this"],
                              qtype=T["qtypes"].get(qtype, qtype))           # EA's type in the prompt's language
    return text + T["choices"].format(choices=lettered) + T["loglik"]


@torch.no_grad()
def option_logliks(model, tokenizer, questions: list[dict], batch_size: int) -> list[list[float]]:
    """Multiple choice, {prompt, options} -> score(option) = (1/|o|) sum_j log pi(o_j | prompt, o_<j): the option
    as the assistant's answer to the prompt as a user message. Each prompt is computed once: its forward pass
    gives log pi(o_1 | prompt) and a KV cache, and its options run on copies of that cache, at most batch_size
    at a time (right-padded): n options cost |prompt| + sum |o| tokens instead of n |prompt| + sum |o|."""
    device, out = next(model.parameters()).device, []
    for q in questions:
        prompt = common.render_ids(tokenizer, [{"role": "user", "content": q["prompt"]}])
        P, scores = len(prompt), []
        head = model(input_ids=torch.tensor([prompt], device=device), use_cache=True, logits_to_keep=1)
        first = head.logits[0, -1].float().log_softmax(-1)                 # log pi(. | prompt): scores o_1
        opts = [tokenizer(o, add_special_tokens=False)["input_ids"] for o in q["options"]]
        for start in range(0, len(opts), batch_size):
            ids, attn, _ = common.right_pad(opts[start:start + batch_size], tokenizer.pad_token_id, device=device)
            B, L = ids.shape
            cache = copy.deepcopy(head.past_key_values)
            cache.batch_select_indices(torch.zeros(B, dtype=torch.long, device=device))   # the prompt, B times
            logits = model(input_ids=ids, attention_mask=torch.cat([attn.new_ones(B, P), attn], 1),
                           position_ids=torch.arange(P, P + L, device=device).expand(B, L),
                           past_key_values=cache, use_cache=True).logits      # [B, L, V]: position j predicts o_{j+1}
            # sum_j log pi(o_j | prompt, o_<j): o_1 from the prompt's last position, o_j (j >= 2) from o_{j-1}'s
            rest = logits[:, :-1].float().log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)    # [B, L-1]
            scores += ((first[ids[:, 0]] + (rest * attn[:, 1:]).sum(1)) / attn.sum(1)).tolist()
        out.append(scores)
    return out


FIELDS = {  # the public files' fields (EA's "question type" with its space)
    "EU": {"qid": (str, int), "language": str, "coarse_category": str, "finegrained_category": str, "scenario": str,
           "subject": str, "emotion_choices": list, "emotion_label": str, "cause_choices": list, "cause_label": str},
    "EA": {"qid": (str, int), "language": str, "category": str, "question type": str, "scenario": str,
           "subject": str, "choices": list, "label": str}}


def load(path: str, kind: str) -> list[dict]:
    recs = common.read_jsonl(path, FIELDS[kind], unique=("language", "qid"))
    for r in recs:
        for choices, label in ([("emotion_choices", "emotion_label"), ("cause_choices", "cause_label")]
                               if kind == "EU" else [("choices", "label")]):
            ok = len(r[choices]) >= 2 and all(isinstance(c, str) and c.strip() for c in r[choices])
            common.check(ok, f"{r['_where']}: field '{choices}' must be a list of 2+ non-empty strings")
            common.check(r[label] in r[choices], f"{r['_where']}: field '{label}' is not one of '{choices}'")
        r["case"] = f"{kind}-{r['language']}-{r['qid']}"
    return recs

"""scripts/score_reply.py: CARE's score S(y) of real replies under a rubric that parses, term by term
(docs/course.md, lesson 5).

What it does
  Takes one labelled turn of data/rubric_sft_val.jsonl (the first by default): its dialogue up to the user's
  message and its rubric, read by 01's parse_rubric as 02 and 04 read a generated one. Two replies answer that
  message: the supporter's reply the data set holds (the next turn's record carries it) and the policy's own
  (--model, greedy, --max-new-tokens). 01's criteria judge scores each reply on every criterion (offline: the
  MiniLM cosine, max(0, cos(e(y), e(c)))), and S(y) is 01's rubric_score:
      S(y) = sum_d w_d (1/|C_d|) sum_{c in C_d} s(y, c)
  Prints the rubric, each reply, the score of every criterion, each dimension's mean and S(y) as a sum.

Reads   data/rubric_sft_val.jsonl, the policy (--model, default the packaged SmolLM2)
Writes  nothing (stdout)

Usage: python scripts/score_reply.py [--turn ID] [--model NAME] [--max-new-tokens N]
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import textwrap
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common  # noqa: E402
import runs  # noqa: E402
import sampling  # noqa: E402

sft = importlib.import_module("01_rubric_sft")  # the rubric's parser, S(y), the criteria judge

HERE = Path(__file__).resolve().parents[1]
VAL = HERE / "data" / "rubric_sft_val.jsonl"


def policy_reply(model_name: str, messages: list[dict], max_new_tokens: int) -> str:
    """The policy's greedy reply to the dialogue: its chat template, the project's sampler (sampling.py: nothing of
    the model's generation_config but its end-of-turn ids), the end-of-turn token cut from the text."""
    from transformers import AutoModelForCausalLM

    tokenizer = common.load_tokenizer(common.resolve_model(model_name))
    model = common.from_pretrained(AutoModelForCausalLM.from_pretrained, model_name, dtype="float32")
    (reply,) = sampling.generate_batch(model, tokenizer, [common.render_ids(tokenizer, messages)], max_new_tokens)
    return tokenizer.decode(reply.ids, skip_special_tokens=True).strip()


def score_table(rubric: dict, reply: str, judge) -> float:
    """Print the judge's score of the reply on every criterion, each dimension's mean, and S(y); return S(y)."""
    (s,) = sft.judge_by_dimension(judge, [{"context": [], "reply": reply, "criteria": rubric["criteria"]}])
    terms = []
    for d in sft.DIMS:
        for c, s_c in zip(rubric["criteria"][d], s[d]):
            print(f"    {d:<10} s = {s_c:.3f}  {c}")
        mean = sum(s[d]) / len(s[d])
        print(f"    {d:<10} mean of {len(s[d])}: {mean:.3f}, weight {rubric['weights'][d]:.2f}")
        terms.append(f"{rubric['weights'][d]:.2f} x {mean:.3f}")
    S = sft.rubric_score(rubric, s)
    print(f"    S(y) = {' + '.join(terms)} = {S:.3f}")
    return S


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--turn", default=None, help="the id of a turn of data/rubric_sft_val.jsonl (default: the first)")
    p.add_argument("--model", default=common.PACKAGED_SMOLLM2, help="the policy that writes the second reply")
    p.add_argument("--max-new-tokens", type=int, default=48, help="the policy reply's token cap (04's CPU preset)")
    args = p.parse_args(argv)
    records = runs.read_jsonl(VAL)
    ids = [r["id"] for r in records]
    turn = args.turn or ids[0]
    common.check(turn in ids, f"--turn {turn}: no such id in {VAL} (the first ones: {', '.join(ids[:4])})")
    i = ids.index(turn)
    rec = records[i]
    rubric, why = sft.parse_rubric(rec["rubric"])
    common.check(rubric is not None, f"{VAL}, {turn}: its rubric does not parse ({why})")
    print(f"turn {turn} of {VAL.relative_to(HERE)}: the user's message")
    print(textwrap.indent(textwrap.fill(rec["messages"][-1]["content"], 100), "    "))
    print(f"its rubric, parsed by parse_rubric: {json.dumps(rubric['weights'], sort_keys=False)}")
    replies = []
    following = records[i + 1] if i + 1 < len(records) else None
    if following and following["messages"][: len(rec["messages"])] == rec["messages"]:
        replies.append(("the data set's supporter reply", following["messages"][len(rec["messages"])]["content"]))
    replies.append((f"{args.model}'s greedy reply", policy_reply(args.model, rec["messages"], args.max_new_tokens)))
    judge = sft.CriteriaJudge(argparse.Namespace(judge="embed", judge_retries=0))
    for name, reply in replies:
        print(f"\n{name}:")
        print(textwrap.indent(textwrap.fill(reply, 100), "    "))
        score_table(rubric, reply, judge)


if __name__ == "__main__":
    common.run_main(main)

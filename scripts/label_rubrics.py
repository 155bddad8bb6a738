"""scripts/label_rubrics.py: label your own dialogues with rubrics written by a teacher LLM, into 01's format.

CARE labels real dialogues with a strong LLM; this does that for your data. For every user turn of every
dialogue the teacher (--teacher api:<model> or hf:<model>) writes the rubric of the supporter's next reply
with 01's prompt; a rubric that 01's parser rejects is asked again (--teacher-retries), then the turn is
dropped and counted. The output is 01_rubric_sft.py's --train format.

Reads   --label: JSONL with "messages" (TRL's conversational format) or ESConv-style "dialog" records
        ({"speaker": seeker|supporter|usr|sys, "content"}; a speaker's consecutive turns are merged).
Writes  --label-out: {"id": "<dialogue>-t<turn>", "messages": [... up to that user turn], "rubric": {...}}
        (a new file: an existing one is not overwritten).

Usage: python scripts/label_rubrics.py --teacher api:gpt-4o --label my_dialogues.jsonl --label-out sup.jsonl
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import backends  # noqa: E402
import common  # noqa: E402
import options  # noqa: E402
import runs

sft = importlib.import_module("01_rubric_sft")  # the rubric's prompt and its parser


def dialogues_from(path: str) -> list[tuple[str, list[dict]]]:
    """(id, the messages up to each user turn) from {"messages": [...]} or ESConv-style {"dialog": [...]}."""
    out = []
    for r in runs.read_jsonl(path):
        w = r["_where"]
        if "messages" in r:
            msgs = r["messages"]
        else:
            common.check(isinstance(r.get("dialog"), list), f"{w}: needs field 'messages' or a list 'dialog'")
            msgs = []
            for i, t in enumerate(r["dialog"]):
                common.check(
                    isinstance(t, dict)
                    and t.get("speaker") in ("seeker", "supporter", "usr", "sys")
                    and isinstance(t.get("content"), str),
                    f"{w}: dialog[{i}] must have speaker seeker|supporter and a string content",
                )
                role = "user" if t["speaker"] in ("seeker", "usr") else "assistant"
                if msgs and msgs[-1]["role"] == role:  # ESConv splits turns: merged
                    msgs[-1]["content"] += " " + t["content"].strip()
                else:
                    msgs.append({"role": role, "content": t["content"].strip()})
        common.check(isinstance(msgs, list) and msgs, f"{w}: empty dialogue")
        for k, m in enumerate(msgs):
            if m.get("role") == "user":
                turn = sum(x["role"] == "user" for x in msgs[: k + 1])
                out.append((f"{r.get('id', w)}-t{turn}", sft.check_messages(msgs[: k + 1], w)))
    return out


def main(argv=None):
    p = options.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--teacher", required=True, help="api:<model> or hf:<model>: the LLM that writes the rubrics")
    p.add_argument("--label", required=True, help="dialogues to label: JSONL with messages, or ESConv-style dialog")
    p.add_argument("--label-out", required=True, help="where the labelled supervision JSONL goes (a new file)")
    p.add_argument("--teacher-retries", type=int, default=2, help="re-asks when the teacher's rubric is invalid")
    p.add_argument("--weight-tolerance", type=float, default=0.02, help="|sum of weights - 1| allowed")
    options.add_options(p, "LLM endpoints (api: backends)", backends.EndpointOptions)
    args = p.parse_args(argv)
    common.check(
        args.teacher.startswith(("api:", "hf:")), f"--teacher must be api:<model> or hf:<model>, got {args.teacher}"
    )
    turns = dialogues_from(args.label)
    common.check(not Path(args.label_out).exists(), f"--label-out {args.label_out} exists; not overwriting it")
    teacher = backends.make_chat_backend(args.teacher, args)
    rubrics = backends.ask_json(
        teacher,
        [sft.rubric_prompt(msgs) for _, msgs in turns],
        lambda i, text: sft.parse_rubric(text, args.weight_tolerance)[0],
        args.teacher_retries,
        who="teacher",
        noun="turns",
        max_tokens=400,
    )
    kept = [i for i, rb in enumerate(rubrics) if rb is not None]
    runs.append_jsonl(
        args.label_out, [{"id": turns[i][0], "messages": turns[i][1], "rubric": rubrics[i]} for i in kept]
    )
    print(
        f"labelled {len(kept)}/{len(turns)} turns into {args.label_out}; dropped {len(turns) - len(kept)} whose "
        f"rubric stayed invalid after {args.teacher_retries} retries ({teacher.failures} failed calls)"
    )


if __name__ == "__main__":
    common.run_main(main)

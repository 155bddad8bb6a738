"""benchmarks/emobench.py: EmoBench, run by 05_eval.py --suite emobench.

What it is
  EmoBench's multiple-choice items in English and Chinese: EU (emotional understanding: which emotion, and
  its cause) and EA (emotional application: the most effective response or action).
Two modes; 05's --emobench-dir decides
  official   --emobench-dir PATH, a checkout of github.com/Sahandfer/EmoBench: its current protocol. The texts
             are read from PATH at run time (none is copied here): the system prompt (src/configs/prompts.yaml
             "sys"), the answer format (src/configs/response.yaml "base" and the task's keys, in the layout of
             src/utils.py get_response_format), the questions (prompts.yaml "EU", "EA"); the items from
             PATH/data/EU.jsonl and EA.jsonl (src/data.py: one file per task, filtered by "language" en / zh).
  loglik     without it: option log-likelihood (not the official protocol), on --emobench-eu / -ea JSONL files
             with this project's templates (data/prompts.json "emobench").
What this file holds
  load_official     PATH's items, each with the two messages the official code sends for it
  official_messages  system = sys[lang] + the answer format (after "/no_think" for a Qwen, as model.py does);
                     user = the task's question with the choices lettered "A) ...", EU's two questions in one
  parse_answer      the official parser (utils.py parse_json_response): the first ```json block, else the
                    whole reply, as JSON; anything else is unparseable
  official_cases    exact letter match; EU correct only when answer_q1 and answer_q2 both are
  run               a batch: generated and parsed (official) or scored by option_logliks (loglik)
  summarize         accuracy per task and language (the official unit), by category, unparseable counted
  load, cases, mcq_prompt, option_logliks   the loglik mode: score(option) = (1/|o|) sum_j log pi(o_j | prompt,
                    o_<j), each prompt computed once; EU asks the emotion, then the cause naming it

Score (both modes)
  accuracy = (1/n) sum_i correct_i per task and language, by category (EU: coarse_category, EA: category);
  an EU item is correct only when the emotion and the cause are both right; no pooled score over languages

Departures from the official code, and where it had to be read (official mode; docs/evaluation.md)
  1. Sampling: the official code sets temperature 0.6 for API models (ChatOpenAI, top_p the endpoint's) and
     50 new tokens for HF models (with the model's own generation_config); the local model here gets
     temperature 0.6, top_p 1, no top_k, at most 50 new tokens, every other setting from the model's own
     generation_config (sampling.generate_batch with model_settings=True, seeded per batch by 05).
  2. One attempt per item: the official retry loop returns after the first failure, so an unparseable reply
     is answered "" (wrong); it is also counted as unparseable here. A reply that parses as JSON but not as an
     object (the official code would stop with an error there) is unparseable.
  3. The prompt is rendered by the tokenizer's chat template with its generation prompt and nothing else (as
     the transformers pipeline does); "qwen" in the last part of --model (as model.py's model name) puts
     "/no_think" before the system prompt, as model.py does.
  4. 05 resumes, samples (--max-cases) and batches; the official code saves results/ and a leaderboard.
  The loglik mode is this project's: each option scored by its mean log-probability (no generation, no parse).
A support module: it imports common.py and its package (benchmarks.checkout), never a stage; 05 hands it
the model and the batch.
"""

from __future__ import annotations

import ast
import copy
import json
import re
import statistics
import string
from pathlib import Path

import torch
import yaml

import benchmarks
import common
import runs
import sampling

HERE = Path(__file__).resolve().parents[1]
TEXTS = json.loads((HERE / "data" / "prompts.json").read_text(encoding="utf-8"))
LOGLIK = "option log-likelihood (not the official protocol)"
LANGUAGES = ("en", "zh")  # the official code's languages (main.py LANGS); it reads no other
# what the official protocol reads from --emobench-dir (its label's commit covers these)
OFFICIAL_FILES = (
    "src/configs/prompts.yaml",
    "src/configs/response.yaml",
    "src/utils.py",
    "data/EU.jsonl",
    "data/EA.jsonl",
)
LETTERS = string.ascii_uppercase  # the choices' letters, "A) ..." (data.py rank_choices)
TEMPERATURE, MAX_NEW_TOKENS = 0.6, 50  # the official API models' temperature, its HF models' budget
NO_THINK = "/no_think\n\n"  # Qwen's switch, before the system prompt when the model's name has "qwen"
FENCE = re.compile(r"```json\s*([\s\S]*?)```")  # the official parser's block: ```json ... ``` (non-greedy)


def run(model, tok, batch: list[dict], batch_size: int) -> tuple[list[dict], list[dict]]:
    """A batch of EU and EA items -> (cases, transcripts). Official items (load_official: they carry their
    messages): one reply each, generated and parsed; the transcripts keep the messages as sent and the reply.
    Loglik items: each question's options scored, the best chosen; no transcripts."""
    if "messages" in batch[0]:
        contexts = [official_ids(tok, it["messages"]) for it in batch]
        # the official HF path samples with the model's own generation_config: model_settings=True keeps it
        replies = [
            tok.decode(reply.ids, skip_special_tokens=True)
            for reply in sampling.generate_batch(
                model, tok, contexts, MAX_NEW_TOKENS, TEMPERATURE, top_p=1.0, model_settings=True
            )
        ]
        return official_cases(batch, replies), [
            {"case": it["case"], "messages": it["messages"], "reply": r} for it, r in zip(batch, replies)
        ]

    def choose(questions):  # the option of the best mean log-probability, per question
        return [max(range(len(s)), key=s.__getitem__) for s in option_logliks(model, tok, questions, batch_size)]

    return [
        c
        for kind in ("EU", "EA")
        for c in cases([it for it in batch if it["case"].startswith(kind + "-")], kind, choose)
    ], []


# ---------------------------------------------------------------------------------------------
# The official protocol: PATH's items and texts, the messages, the parser, the exact match
# ---------------------------------------------------------------------------------------------
def load_official(root: str, kind: str, model_name: str) -> list[dict]:
    """PATH/data/{kind}.jsonl (the public fields, checked; language en or zh), each item with the messages
    the official code sends for it (texts read from PATH now) and the protocol's label."""
    root = Path(root)
    common.check(
        (root / "src" / "configs").is_dir(),
        f"--emobench-dir {root}: no src/configs there (expected a checkout of github.com/Sahandfer/EmoBench)",
    )
    texts = {
        name: read_config(root / "src" / "configs" / f"{name}.yaml", keys)
        for name, keys in (("prompts", ("sys", kind)), ("response", ("base", kind)))
    }
    texts["layout"] = answer_layout(root / "src" / "utils.py")
    label = protocol_label(root)
    items = load(root / "data" / f"{kind}.jsonl", kind)
    for it in items:
        common.check(
            it["language"] in LANGUAGES,
            f"{it['_where']}: language {it['language']!r}: the official code reads en and zh only",
        )
        it["messages"], it["protocol"] = official_messages(texts, it, kind, model_name), label
    return items


def read_config(path: Path, keys) -> dict:
    """A YAML config of the official code; each of `keys` must hold a text per language."""
    common.check(path.is_file(), f"{path}: no such file")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as e:
        raise common.UserError(f"{path}: not valid YAML ({str(e).splitlines()[0]})") from None
    for k in keys:
        for lang in LANGUAGES:
            ok = isinstance(data, dict) and isinstance(data.get(k), dict) and isinstance(data[k].get(lang), str)
            common.check(ok, f"{path}: no text at {k}.{lang}")
    return data


def answer_layout(path: Path) -> str:
    """The answer format's layout: the string get_response_format in the official src/utils.py assigns to
    res_format and fills with {statement} (response.yaml "base") and {conditions} (the task's keys)."""
    common.check(path.is_file(), f"{path}: no such file")
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.FunctionDef) and node.name == "get_response_format":
            for a in ast.walk(node):
                if (
                    isinstance(a, ast.Assign)
                    and [getattr(t, "id", None) for t in a.targets] == ["res_format"]
                    and isinstance(a.value, ast.Constant)
                    and isinstance(a.value.value, str)
                ):
                    return a.value.value
    raise common.UserError(f"{path}: no res_format string in get_response_format (the answer format's layout)")


def protocol_label(root: Path) -> str:
    """ "official protocol (PATH at commit C)" when PATH is the official checkout (benchmarks.checkout's rule on
    OFFICIAL_FILES), "with local changes" when one of them differs; else "official protocol (PATH, not a git
    checkout)"."""
    found = benchmarks.checkout(root, OFFICIAL_FILES)
    if found is None:
        return f"official protocol ({root}, not a git checkout)"
    return f"official protocol ({root} at commit {found[0]}{' with local changes' if found[1] else ''})"


def official_messages(texts: dict, item: dict, kind: str, model_name: str) -> list[dict]:
    """[system, user] as the official code builds them (model.py init_prompt, data.py generate_responses):
    system = prompts sys[lang] + layout(statement = response base[lang], conditions = response kind[lang]),
    after NO_THINK for a Qwen; user = prompts kind[lang] with the scenario, the subject and the lettered
    choices (EU: both questions' choices; EA: also the question type as the file gives it)."""
    lang, prompts, response = item["language"], texts["prompts"], texts["response"]
    where = f"{item['_where']}: the official texts ({kind}.{lang}) cannot be filled in"
    try:
        system = prompts["sys"][lang] + texts["layout"].format(
            statement=response["base"][lang], conditions=response[kind][lang]
        )
        if kind == "EU":
            user = prompts["EU"][lang].format(
                scenario=item["scenario"],
                subject=item["subject"],
                emo_choices=lettered(item["emotion_choices"]),
                cause_choices=lettered(item["cause_choices"]),
            )
        else:
            user = prompts["EA"][lang].format(
                scenario=item["scenario"],
                subject=item["subject"],
                choices=lettered(item["choices"]),
                q_type=item["question type"],
            )
    except (KeyError, IndexError, ValueError) as e:
        raise common.UserError(f"{where} ({type(e).__name__}: {e})") from None
    if "qwen" in model_name.split("/")[-1].lower():
        system = NO_THINK + system
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


def lettered(choices: list[str]) -> str:
    # "A) first\nB) second\n..." (data.py rank_choices)
    return "\n".join(f"{LETTERS[i]}) {c}" for i, c in enumerate(choices))


def official_ids(tokenizer, messages: list[dict]) -> list[int]:
    """The messages as the transformers pipeline renders them: the chat template and its generation prompt."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def parse_answer(reply: str) -> dict | None:
    """The official parser (utils.py parse_json_response) -> the answer object, or None (unparseable)."""
    # a reply holding "```json": the first ```json ... ``` block is the JSON (none closed: unparseable);
    # any other reply: the whole text is the JSON
    if "```json" in reply:
        block = FENCE.search(reply)
        if block is None:
            return None
        reply = block.group(1)
    try:
        answer = json.loads(reply)
    except ValueError:
        return None
    return answer if isinstance(answer, dict) else None


def official_cases(items: list[dict], replies: list[str]) -> list[dict]:
    """Each item's case from its reply: parsed, then each answer matched exactly against the gold letter (a
    missing answer is ""); EU is correct only when answer_q1 and answer_q2 are both right."""
    out = []
    for it, reply in zip(items, replies):
        kind, answer = it["case"][:2], parse_answer(reply)
        got = answer or {}
        head = {
            "case": it["case"],
            "task": kind,
            "language": it["language"],
            "failed": None,
            "protocol": it["protocol"],
            "reply": reply,
            "parsed": answer is not None,
        }
        if kind == "EA":
            gold = LETTERS[it["choices"].index(it["label"])]
            out.append(
                {
                    **head,
                    "category": it["category"],
                    "label": gold,
                    "answer": got.get("answer", ""),
                    "correct": int(got.get("answer", "") == gold),
                }
            )
            continue
        gold = [
            LETTERS[it["emotion_choices"].index(it["emotion_label"])],
            LETTERS[it["cause_choices"].index(it["cause_label"])],
        ]
        given = [got.get("answer_q1", ""), got.get("answer_q2", "")]
        # correct = [answer_q1 == emotion letter] and [answer_q2 == cause letter]
        emotion_ok, cause_ok = given[0] == gold[0], given[1] == gold[1]
        out.append(
            {
                **head,
                "category": it["coarse_category"],
                "label": gold,
                "answer": given,
                "emotion_correct": int(emotion_ok),
                "cause_correct": int(cause_ok),
                "correct": int(emotion_ok and cause_ok),
            }
        )
    return out


def summarize(cases: list[dict], interval) -> dict:
    """Per task and language (the official unit; no pooled score): accuracy % with interval(values) (05's t
    interval over items), n, the unparseable replies (counted wrong; None in the loglik mode, which parses
    nothing) and the accuracy by category."""
    out = {"protocol": ", ".join(sorted({c.get("protocol", LOGLIK) for c in cases}))}
    for group in group_order({f"{c['task']} {c['language']}" for c in cases}):
        xs = [c for c in cases if f"{c['task']} {c['language']}" == group]
        # accuracy = 100 (1/n) sum_i correct_i, overall and within each category
        out[group] = {
            "accuracy": interval([100.0 * c["correct"] for c in xs]),
            "n": len(xs),
            "unparseable": sum(c["parsed"] is False for c in xs) if "parsed" in xs[0] else None,
            "by_category": {
                v: 100.0 * statistics.mean(c["correct"] for c in xs if c["category"] == v)
                for v in sorted({c["category"] for c in xs})
            },
        }
    return out


def group_order(names) -> list[str]:
    """The "EU en", "EA zh", ... among names, EU first, then by language."""
    return sorted({g for g in names if g[:3] in ("EU ", "EA ")}, key=lambda g: (g[:2] != "EU", g[3:]))


def cells(s: dict, names: list[str], fmt) -> list[str]:
    """The table's cells of one model: accuracy ± interval (n), and the unparseable replies when any."""
    out = []
    for g in names:
        bad = s[g]["unparseable"] if g in s else None
        out.append(
            (fmt(s[g]["accuracy"], s[g]["n"]) if g in s else "-")
            + (f"; {bad} unparseable (counted wrong)" if bad else "")
        )
    return out


def report_lines(model: str, s: dict) -> list[str]:
    """results.md's lines of one model: each group's accuracy by category (and its unparseable replies)."""
    return [
        f"{model}, EmoBench {g} accuracy % by category: "
        + ", ".join(f"{k} {v:.1f}" for k, v in s[g]["by_category"].items())
        + (f"; {s[g]['unparseable']} of {s[g]['n']} replies unparseable" if s[g]["unparseable"] is not None else "")
        for g in group_order(s)
    ]


# ---------------------------------------------------------------------------------------------
# The loglik mode: option log-likelihood (not the official protocol)
# ---------------------------------------------------------------------------------------------
def cases(items, kind, choose) -> list[dict]:
    """choose(questions) -> the chosen option index per {prompt, options} question. EU asks the emotion, then
    the cause naming the chosen emotion; it is correct only when both are right."""

    def head(it):  # the fields every case of an item has
        return {
            "case": it["case"],
            "task": kind,
            "language": it["language"],
            "failed": None,
            "protocol": LOGLIK,
            "category": it["category"] if kind == "EA" else it["coarse_category"],
        }

    if kind == "EA":
        picks = choose([{"prompt": mcq_prompt(it, "EA", it["choices"]), "options": it["choices"]} for it in items])
        return [
            {**head(it), "pred": it["choices"][p], "answered": True, "correct": int(it["choices"][p] == it["label"])}
            for it, p in zip(items, picks)
        ]
    named = [
        it["emotion_choices"][p]
        for it, p in zip(
            items,
            choose(
                [
                    {"prompt": mcq_prompt(it, "emotion", it["emotion_choices"]), "options": it["emotion_choices"]}
                    for it in items
                ]
            ),
        )
    ]
    cause = choose(
        [
            {"prompt": mcq_prompt(it, "cause", it["cause_choices"], e), "options": it["cause_choices"]}
            for it, e in zip(items, named)
        ]
    )
    out = []
    for it, e, c in zip(items, named, cause):
        emotion_ok, cause_ok = e == it["emotion_label"], it["cause_choices"][c] == it["cause_label"]
        out.append(
            {
                **head(it),
                "pred": [e, it["cause_choices"][c]],
                "answered": True,
                "emotion_correct": int(emotion_ok),
                "cause_correct": int(cause_ok),
                "correct": int(emotion_ok and cause_ok),
            }
        )
    return out


def mcq_prompt(item, question, options, emotion=None) -> str:
    T = TEXTS["emobench"]["zh" if item["language"].lower().startswith(("zh", "ch")) else "en"]
    lettered = "\n".join(f"{chr(65 + i)}. {o}" for i, o in enumerate(options))
    qtype = item.get("question type", "").strip().lower()
    text = T[question].format(
        scenario=item["scenario"],
        subject=item["subject"],
        emotion=emotion or T["this"],
        qtype=T["qtypes"].get(qtype, qtype),
    )  # EA's type in the prompt's language
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
        first = head.logits[0, -1].float().log_softmax(-1)  # log pi(. | prompt): scores o_1
        opts = [tokenizer(o, add_special_tokens=False)["input_ids"] for o in q["options"]]
        for start in range(0, len(opts), batch_size):
            ids, attn, _ = sampling.right_pad(opts[start : start + batch_size], tokenizer.pad_token_id, device=device)
            B, L = ids.shape
            cache = copy.deepcopy(head.past_key_values)
            cache.batch_select_indices(torch.zeros(B, dtype=torch.long, device=device))  # the prompt, B times
            logits = model(
                input_ids=ids,
                attention_mask=torch.cat([attn.new_ones(B, P), attn], 1),
                position_ids=torch.arange(P, P + L, device=device).expand(B, L),
                past_key_values=cache,
                use_cache=True,
            ).logits  # [B, L, V]: position j predicts o_{j+1}
            # sum_j log pi(o_j | prompt, o_<j): o_1 from the prompt's last position, o_j (j >= 2) from o_{j-1}'s
            rest = logits[:, :-1].float().log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)  # [B, L-1]
            scores += ((first[ids[:, 0]] + (rest * attn[:, 1:]).sum(1)) / attn.sum(1)).tolist()
        out.append(scores)
    return out


FIELDS = {  # the public files' fields (EA's "question type" with its space)
    "EU": {
        "qid": (str, int),
        "language": str,
        "coarse_category": str,
        "finegrained_category": str,
        "scenario": str,
        "subject": str,
        "emotion_choices": list,
        "emotion_label": str,
        "cause_choices": list,
        "cause_label": str,
    },
    "EA": {
        "qid": (str, int),
        "language": str,
        "category": str,
        "question type": str,
        "scenario": str,
        "subject": str,
        "choices": list,
        "label": str,
    },
}


def load(path: str, kind: str) -> list[dict]:
    recs = runs.read_jsonl(path, FIELDS[kind], unique=("language", "qid"))
    for r in recs:
        for choices, label in (
            [("emotion_choices", "emotion_label"), ("cause_choices", "cause_label")]
            if kind == "EU"
            else [("choices", "label")]
        ):
            ok = len(r[choices]) >= 2 and all(isinstance(c, str) and c.strip() for c in r[choices])
            common.check(ok, f"{r['_where']}: field '{choices}' must be a list of 2+ non-empty strings")
            common.check(r[label] in r[choices], f"{r['_where']}: field '{label}' is not one of '{choices}'")
        r["case"] = f"{kind}-{r['language']}-{r['qid']}"
    return recs

"""check_care_data.py: validate the CARE rubric-generator data and print its counts (stdlib only).

Checks
  rubric_sft_{train,val}.jsonl    {"id", "topic", "turn", "emotion", "messages", "rubric"}
    messages   user/assistant alternating, starting and ending with a user turn; turn = number of
               user turns; the lines of one dialogue (id "<dialogue>-t<turn>") have turns 1..n and
               each line's messages extend the previous line's
    rubric     {"weights": {cognitive, affective, proactive}, "criteria": {same keys: [str]}}:
               weights >= 0 summing to 1 (within 1e-6), 1-4 non-empty criteria per dimension,
               each at most 12 words
    splits     no dialogue in both train and val
  rubric_pref_{train,test}.jsonl  TRL conversational preference format
               {"id", "need", "prompt", "chosen", "rejected"} plus optional "rejected_need" (the need
               the rejected reply serves instead); prompt: 1-3 user turns, alternating, ending with a
               user turn; chosen / rejected: one assistant message each, 25-70 words, the shorter at
               least 70% of the longer's word count
    splits     no context ("<context>-<k>") and no prompt's first user message shared by train and
               test; no pref-test opening that also opens an SFT dialogue
  every file   valid JSON per line, ids unique across all files

Prints lines, dialogues, dominant-dimension shares per split, dominant dimension by turn index,
need shares (and need x rejected need) for pref. Exits 1 if any check fails; balance is reported,
not enforced.

    python data/check_care_data.py [--data_dir data]
"""

import argparse
import collections
import json
import os
import sys

DIMS = ("cognitive", "affective", "proactive")
SFT_FILES = {"train": "rubric_sft_train.jsonl", "val": "rubric_sft_val.jsonl"}
PREF_FILES = {"train": "rubric_pref_train.jsonl", "test": "rubric_pref_test.jsonl"}
MAX_CRITERION_WORDS = 12
REPLY_WORDS = (25, 70)
MIN_LENGTH_RATIO = 0.7

errors = []


def err(where, msg):
    errors.append(f"{where}: {msg}")


def read_jsonl(path):
    rows = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                err(f"{path}:{n}", "blank line")
                continue
            try:
                rows.append((f"{os.path.basename(path)}:{n}", json.loads(line)))
            except json.JSONDecodeError as e:
                err(f"{path}:{n}", f"invalid JSON ({e})")
    return rows


def check_messages(where, msgs, first="user", last="user"):
    """Roles alternate user/assistant, non-empty string contents; returns the number of user turns."""
    if not isinstance(msgs, list) or not msgs:
        err(where, "messages must be a non-empty list")
        return 0
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or set(m) != {"role", "content"}:
            err(where, f"message {i} must be {{role, content}}")
            return 0
        if not isinstance(m["content"], str) or not m["content"].strip():
            err(where, f"message {i} has empty content")
        want = first if i % 2 == 0 else ("assistant" if first == "user" else "user")
        if m["role"] != want:
            err(where, f"message {i} role {m['role']!r}, expected {want!r} (roles must alternate)")
            break
    if msgs[-1]["role"] != last:
        err(where, f"last message must be {last!r}")
    return sum(m["role"] == "user" for m in msgs)


def check_rubric(where, rubric):
    if not isinstance(rubric, dict) or set(rubric) != {"weights", "criteria"}:
        err(where, "rubric must be {weights, criteria}")
        return None
    w, c = rubric["weights"], rubric["criteria"]
    if not isinstance(w, dict) or set(w) != set(DIMS):
        err(where, f"weights keys must be {DIMS}")
        return None
    if any(isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0 for v in w.values()):
        err(where, "weights must be non-negative numbers")
    elif abs(sum(w.values()) - 1.0) > 1e-6:
        err(where, f"weights sum to {sum(w.values())}, not 1")
    if not isinstance(c, dict) or set(c) != set(DIMS):
        err(where, f"criteria keys must be {DIMS}")
        return w
    for d in DIMS:
        if not isinstance(c[d], list) or not 1 <= len(c[d]) <= 4:
            err(where, f"criteria[{d}] must be a list of 1-4 strings")
            continue
        for s in c[d]:
            if not isinstance(s, str) or not s.strip():
                err(where, f"criteria[{d}] has an empty or non-string criterion")
            elif len(s.split()) > MAX_CRITERION_WORDS:
                err(where, f"criteria[{d}] over {MAX_CRITERION_WORDS} words: {s!r}")
    return w


def dominant(w):
    """The dimension with the largest weight, or 'tie'."""
    top = max(w.values())
    best = [d for d in DIMS if w[d] == top]
    return best[0] if len(best) == 1 else "tie"


def check_sft(data_dir):
    by_split, openings = {}, set()
    for split, name in SFT_FILES.items():
        rows = read_jsonl(os.path.join(data_dir, name))
        dialogs = collections.defaultdict(list)
        for where, r in rows:
            keys = {"id", "topic", "turn", "emotion", "messages", "rubric"}
            if not isinstance(r, dict) or set(r) != keys:
                err(where, f"fields must be exactly {sorted(keys)}")
                continue
            if not all(isinstance(r[k], str) and r[k].strip() for k in ("id", "topic", "emotion")):
                err(where, "id, topic and emotion must be non-empty strings")
                continue
            if isinstance(r["turn"], bool) or not isinstance(r["turn"], int) or r["turn"] < 1:
                err(where, "turn must be an int >= 1")
                continue
            n_user = check_messages(where, r["messages"])
            if n_user != r["turn"]:
                err(where, f"turn {r['turn']} but {n_user} user messages")
            w = check_rubric(where, r["rubric"])
            dia, _, t = r["id"].rpartition("-t")
            if not dia or t != str(r["turn"]):
                err(where, f"id {r['id']!r} must be '<dialogue>-t<turn>'")
            dialogs[dia].append((r["turn"], where, r, w))
        for dia, lines in dialogs.items():
            lines.sort(key=lambda x: x[0])
            if [t for t, *_ in lines] != list(range(1, len(lines) + 1)):
                err(f"{name}:{dia}", f"turns {[t for t, *_ in lines]} are not 1..n")
            for (_, _, prev, _), (_, where, cur, _) in zip(lines, lines[1:]):
                if cur["messages"][: len(prev["messages"])] != prev["messages"]:
                    err(where, "messages do not extend the dialogue's previous turn")
            if len({r["topic"] for _, _, r, _ in lines}) > 1:
                err(f"{name}:{dia}", "topic changes within a dialogue")
            openings.add(lines[0][2]["messages"][0]["content"])
        by_split[split] = (rows, dialogs)
    shared = set(by_split["train"][1]) & set(by_split["val"][1])
    if shared:
        err("rubric_sft", f"dialogues in both train and val: {sorted(shared)}")
    return by_split, openings


def words(msgs):
    return len(msgs[0]["content"].split()) if isinstance(msgs, list) and msgs and isinstance(msgs[0], dict) else 0


def check_pref(data_dir, sft_openings):
    by_split = {}
    for split, name in PREF_FILES.items():
        rows = read_jsonl(os.path.join(data_dir, name))
        for where, r in rows:
            keys, optional = {"id", "need", "prompt", "chosen", "rejected"}, {"rejected_need"}
            if not isinstance(r, dict) or not keys <= set(r) <= keys | optional:
                err(where, f"fields must be {sorted(keys)} (+ optional rejected_need)")
                continue
            if not isinstance(r["id"], str) or not r["id"].rpartition("-")[0]:
                err(where, "id must be a string '<context>-<k>'")
            if r["need"] not in DIMS:
                err(where, f"need {r['need']!r} not in {DIMS}")
            if "rejected_need" in r and (r["rejected_need"] not in DIMS or r["rejected_need"] == r["need"]):
                err(where, f"rejected_need {r['rejected_need']!r} must be another dimension")
            n_user = check_messages(where, r["prompt"])
            if not 1 <= n_user <= 3:
                err(where, f"prompt has {n_user} user turns, expected 1-3")
            for k in ("chosen", "rejected"):
                m = r[k]
                if not (
                    isinstance(m, list) and len(m) == 1 and isinstance(m[0], dict) and m[0].get("role") == "assistant"
                ):
                    err(where, f"{k} must be a list with one assistant message")
                    continue
                check_messages(where, m, first="assistant", last="assistant")
                if not REPLY_WORDS[0] <= words(m) <= REPLY_WORDS[1]:
                    err(where, f"{k} has {words(m)} words, expected {REPLY_WORDS[0]}-{REPLY_WORDS[1]}")
            a, b = words(r["chosen"]), words(r["rejected"])
            if a and b and min(a, b) / max(a, b) < MIN_LENGTH_RATIO:
                err(where, f"chosen/rejected lengths {a}/{b} differ by more than {1 - MIN_LENGTH_RATIO:.0%}")
            if r["chosen"] == r["rejected"]:
                err(where, "chosen equals rejected")
        by_split[split] = rows
    ctx = {
        s: {r["id"].rpartition("-")[0] for _, r in rows if isinstance(r, dict) and isinstance(r.get("id"), str)}
        for s, rows in by_split.items()
    }
    first = {
        s: {r["prompt"][0]["content"] for _, r in rows if isinstance(r, dict) and r.get("prompt")}
        for s, rows in by_split.items()
    }
    if ctx["train"] & ctx["test"]:
        err("rubric_pref", f"contexts in both train and test: {sorted(ctx['train'] & ctx['test'])}")
    if first["train"] & first["test"]:
        err("rubric_pref", f"{len(first['train'] & first['test'])} prompts shared by train and test")
    if first["test"] & sft_openings:
        err("rubric_pref", f"{len(first['test'] & sft_openings)} pref-test prompts also open SFT dialogues")
    return by_split


def share_line(counter, keys, total):
    return "  ".join(f"{k} {counter[k]:3d} ({counter[k] / max(total, 1):.2f})" for k in keys)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--data_dir",
        default=os.path.dirname(os.path.abspath(__file__)),
        help="folder holding the rubric_sft_* and rubric_pref_* files",
    )
    args = p.parse_args()

    sft, openings = check_sft(args.data_dir)
    pref = check_pref(args.data_dir, openings)
    all_ids = [
        r.get("id")
        for rows in [s[0] for s in sft.values()] + list(pref.values())
        for _, r in rows
        if isinstance(r, dict)
    ]
    dup = [i for i, n in collections.Counter(all_ids).items() if n > 1]
    if dup:
        err("all files", f"duplicate ids: {dup[:10]}")

    print("== rubric SFT ==")
    for split, (rows, dialogs) in sft.items():
        recs = [r for _, r in rows if isinstance(r, dict) and "rubric" in r]
        dom = collections.Counter()
        for r in recs:
            try:
                dom[dominant(r["rubric"]["weights"])] += 1
            except (AttributeError, KeyError, TypeError, ValueError):
                dom["invalid"] += 1
        print(
            f"{split:5s}  lines {len(recs):3d}  dialogues {len(dialogs):2d}  "
            f"topics {len({r.get('topic') for r in recs})}"
        )
        print(f"       dominant  {share_line(dom, DIMS + ('tie',), len(recs))}")
    print("dominant dimension by user-turn index (train + val)")
    by_turn = collections.defaultdict(collections.Counter)
    for rows, _ in sft.values():
        for _, r in rows:
            try:
                by_turn[r["turn"]][dominant(r["rubric"]["weights"])] += 1
            except (AttributeError, KeyError, TypeError, ValueError):
                pass
    print("  turn  " + "  ".join(f"{d:>9s}" for d in DIMS) + "   mean w (C/A/P)")
    for t in sorted(by_turn):
        ws = [
            r["rubric"]["weights"]
            for rows, _ in sft.values()
            for _, r in rows
            if isinstance(r, dict) and r.get("turn") == t and isinstance(r.get("rubric"), dict)
        ]
        mean = "/".join(f"{sum(w[d] for w in ws) / len(ws):.2f}" for d in DIMS) if ws else "-"
        print(f"  {t:4d}  " + "  ".join(f"{by_turn[t][d]:9d}" for d in DIMS) + f"   {mean}")

    print("== rubric preference pairs ==")
    for split, rows in pref.items():
        recs = [r for _, r in rows if isinstance(r, dict)]
        need = collections.Counter(r.get("need") for r in recs)
        print(f"{split:5s}  pairs {len(recs):3d}  contexts {len({r['id'].rpartition('-')[0] for r in recs})}")
        print(f"       need      {share_line(need, DIMS, len(recs))}")
        pairs = collections.Counter((r.get("need"), r.get("rejected_need")) for r in recs if "rejected_need" in r)
        if pairs:
            print(
                "       need > rejected serves: "
                + ", ".join(f"{a[0]}>{b[0]} {n}" for (a, b), n in sorted(pairs.items()))
            )
        turns = collections.Counter(sum(m.get("role") == "user" for m in r.get("prompt", [])) for r in recs)
        print("       prompt user turns: " + ", ".join(f"{k}: {turns[k]}" for k in sorted(turns)))

    if errors:
        print(f"\nFAILED: {len(errors)} problem(s)")
        for e in errors[:50]:
            print("  " + e)
        sys.exit(1)
    print("\nOK: all checks passed")


if __name__ == "__main__":
    main()

"""02_rubric_pref_rl.py: CARE stage 2, preference RL of the rubric generator.

What it does
  Starts from the SFT generator (01's adapter). Each step takes preference pairs (a context, the
  reply people preferred, the one they did not), samples G rubrics per context, lets the judge score
  both replies on every criterion of each rubric, and rewards a rubric that ranks the preferred reply
  higher (preference recovery), by how much (margin), and that parses at all (format). Advantages are
  normalised within each context's G rubrics; the update is 04's clipped policy gradient on the
  rubric tokens. Before and after RL it reports, on held-out pairs, preference-recovery accuracy and
  the parse-valid rate, and on held-out supervision turns the mean weights by turn index and by the
  user's emotion (the paper's Figures 3-4) as a table and PNG plots. The final adapter is the frozen
  generator that 04 (--reward care) and 05 use.

Reads   data/rubric_pref_train.jsonl / data/rubric_pref_test.jsonl (TRL preference format:
        "prompt" or "messages" ending with a user turn, "chosen", "rejected": a string or a one-message
        list), data/rubric_sft_val.jsonl (turn and emotion per turn, for the weights report), the
        generator (--model + --adapter from 01), the judge (embed offline, hf:, api:).
Writes  runs/<name>-<time>/ : args.json, metrics.jsonl, rollouts.jsonl (every sampled rubric with its
        scores and reward), report.md + report.json (before / after), weights_by_turn.png,
        weights_by_emotion.png, checkpoints/, adapter/.

Equations (CARE, REFERENCE.md section 5)
  rubric score  S(y) = sum_d w_d * (1/|C_d|) sum_{c in C_d} s(y, c)      s in [0, 1], the judge's score
  recovery      r_rec = 1 if S(chosen) > S(rejected) else 0
  margin        r_margin = lambda * tanh((S(chosen) - S(rejected)) / tau)
  format        r_fmt = 0 for a rubric that parses, -1 otherwise (then r_rec = r_margin = 0)
  reward        r = r_rec + r_margin + r_fmt      (Table-4 ablations: --no-margin, --no-format,
                                                   --recovery-only)
  advantage     A_g = (r_g - mean_G) / (std_G + 1e-6)     over the G rubrics of one context
  update        04's clipped surrogate on the rubric tokens (token-mean, ratio clipped to
                [1 - clip_low, 1 + clip_high]); old log-probs once per batch when the policy moves
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
import re
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

import common

env = importlib.import_module("03_rollout")     # Trajectory: a prompt + one sampled continuation
sft = importlib.import_module("01_rubric_sft")  # the rubric format, parser, prompt and generation
mica = importlib.import_module("04_mica_train")  # the clipped policy-gradient update (ppo_update)
HERE = Path(__file__).resolve().parent
DIMS = sft.DIMS


# ---------------------------------------------------------------------------------------------
# Data: TRL preference format
# ---------------------------------------------------------------------------------------------
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


# ---------------------------------------------------------------------------------------------
# The judge: s(y, c) in [0, 1] for a reply y and each criterion c
# ---------------------------------------------------------------------------------------------
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
            history = "\n".join(f"{'Seeker' if m['role'] == 'user' else 'Supporter'}: {m['content']}"
                                for m in it["context"] if m["role"] != "system")
            crit = "\n".join(f"{j + 1}. {c}" for j, c in enumerate(it["criteria"]))
            prompts.append([{"role": "user", "content": CRITERIA_PROMPT.format(
                history=history, reply=it["reply"], criteria=crit)}])
        return common.ask_json(self.backend, prompts, lambda i, text: parse_scores(text, len(items[i]["criteria"])),
                               self.retries, max_tokens=200)


def parse_scores(text: str | None, n: int) -> list[float] | None:
    """{"scores": [n numbers in 0-10]} (possibly wrapped in prose) -> n scores in [0, 1], or None."""
    m = re.search(r"\{.*\}", text or "", re.S)
    try:
        scores = json.loads(m.group(0))["scores"] if m else None
    except (json.JSONDecodeError, KeyError, TypeError):
        return None
    if not isinstance(scores, list) or len(scores) != n:
        return None
    if not all(isinstance(x, (int, float)) and not isinstance(x, bool) and 0 <= x <= 10 for x in scores):
        return None
    return [x / 10 for x in scores]


def make_criteria_judge(args):
    if args.judge == "embed":
        return EmbedCriteriaJudge()
    return LLMCriteriaJudge(common.make_chat_backend(args.judge, args), retries=args.judge_retries)


# ---------------------------------------------------------------------------------------------
# Rubric score and reward: the equations
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
    mean = sum(r) / G
    std = math.sqrt(sum((x - mean) ** 2 for x in r) / (G - 1))
    return [(x - mean) / (std + 1e-6) for x in r]


def judge_rubrics(judge, pairs: list[dict], rubrics: list[dict | None]) -> list[dict | None]:
    """For each (pair, rubric): S(chosen), S(rejected) and the per-criterion scores; None when the
    rubric is invalid or the judge failed on it."""
    items, where = [], []
    for i, (p, rb) in enumerate(zip(pairs, rubrics)):
        if rb is None:
            continue
        for side in ("chosen", "rejected"):
            for d in DIMS:
                items.append({"context": p["context"], "reply": p[f"{side}_text"], "criteria": rb["criteria"][d]})
                where.append((i, side, d))
    scores = judge.score(items)
    per: dict[int, dict] = {}
    for (i, side, d), sc in zip(where, scores):
        per.setdefault(i, {"chosen": {}, "rejected": {}, "failed": False})
        per[i]["failed"] |= sc is None
        per[i][side][d] = sc
    out = []
    for i, rb in enumerate(rubrics):
        if rb is None or per[i]["failed"]:
            out.append(None)
            continue
        out.append({"S_chosen": rubric_score(rb, per[i]["chosen"]), "S_rejected": rubric_score(rb, per[i]["rejected"]),
                    "s": {side: per[i][side] for side in ("chosen", "rejected")}})
    return out


# ---------------------------------------------------------------------------------------------
# Reports: preference-recovery accuracy, parse-valid rate, mean weights by turn and by emotion
# ---------------------------------------------------------------------------------------------
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
    by_turn: dict = {}
    by_emotion: dict = {}
    for r, (text, _, _) in zip(weight_turns, gens):
        rb = sft.parse_rubric(text, args.weight_tolerance)[0]
        if rb is None:
            continue
        for table, key in ((by_turn, r.get("turn", sum(m["role"] == "user" for m in r["messages"]))),
                           (by_emotion, r.get("emotion", "unknown"))):
            table.setdefault(str(key), []).append([rb["weights"][d] for d in DIMS])
    mean_w = lambda rows: [round(sum(x[j] for x in rows) / len(rows), 4) for j in range(3)]  # noqa: E731
    model.train()
    n = len(test_pairs)
    return {"recovery_acc": sum(hits) / n, "parse_valid": sum(r is not None for r in rubrics) / n,
            "recovery_by_need": {k: sum(v) / len(v) for k, v in sorted(by_need.items())},
            "weights_by_turn": {k: {"n": len(v), "w": mean_w(v)} for k, v in sorted(by_turn.items(), key=lambda x: int(x[0]))},
            "weights_by_emotion": {k: {"n": len(v), "w": mean_w(v)} for k, v in sorted(by_emotion.items())},
            "weight_turns_valid": sum(len(v) for v in by_turn.values()), "weight_turns": len(weight_turns)}


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
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for key, title, fname in (("weights_by_turn", "turn index", "weights_by_turn.png"),
                              ("weights_by_emotion", "user emotion", "weights_by_emotion.png")):
        keys = list(after[key])
        fig, axes = plt.subplots(1, 2, figsize=(11, 3.6), sharey=True)
        for ax, (label, rep) in zip(axes, (("before RL", before), ("after RL", after))):
            bottom = [0.0] * len(keys)
            for j, d in enumerate(DIMS):
                vals = [rep[key].get(k, {"w": [0, 0, 0]})["w"][j] for k in keys]
                ax.bar(keys, vals, bottom=bottom, label=d)
                bottom = [b + v for b, v in zip(bottom, vals)]
            ax.set_title(f"mean rubric weights by {title}, {label}")
            ax.tick_params(axis="x", rotation=45 if key == "weights_by_emotion" else 0)
        axes[0].set_ylabel("weight")
        axes[1].legend(loc="upper right", fontsize=8)
        fig.tight_layout()
        fig.savefig(run_dir / fname, dpi=110)
        plt.close(fig)
    return "\n".join(L)


# ---------------------------------------------------------------------------------------------
# Config and main loop
# ---------------------------------------------------------------------------------------------
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
    g = p.add_argument_group("run")
    g.add_argument("--seed", type=int, default=0, help="random seed")
    g.add_argument("--out-dir", default="runs", help="each run writes into its own folder under this")
    g.add_argument("--run-name", default="rubric-rl", help="prefix of the run folder")
    g.add_argument("--report-limit", type=int, default=0, help="use the first N held-out pairs / turns (0 = all)")
    g.add_argument("--skip-report", action="store_true", help="no before/after report (quick runs)")
    g.add_argument("--report-only", action="store_true",
                   help="no training: write the held-out report of --model (+ --adapter) and stop")
    g.add_argument("--save-every", type=int, default=10, help="checkpoint every N steps")
    g.add_argument("--keep-checkpoints", type=int, default=2, help="how many checkpoints to keep")
    g.add_argument("--resume", default=None, help="a run folder: continue from its last checkpoint")
    g.add_argument("--track", choices=["tensorboard", "wandb"], default=None, help="also log metrics there")
    g.add_argument("--no-progress", dest="progress", action="store_false", help="hide progress bars")
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
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=args.weight_decay)
    warmup = max(1, round(args.warmup_ratio * args.steps))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: mica.cosine_with_warmup(s, args.steps, warmup))
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

    for step in tqdm(range(start, args.steps + 1), desc="rubric rl", initial=start - 1, total=args.steps,
                     disable=not args.progress):
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
        # 2. judge chosen and rejected on every criterion; S(y); rewards
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
        trajs, advs, degenerate = [], [], 0
        for c in range(len(batch)):
            idx = [c * args.g + i for i in range(args.g) if rewards[c * args.g + i] is not None]
            A = group_advantages([rewards[i] for i in idx])
            degenerate += all(abs(a) < 1e-9 for a in A)     # all G rewards equal: nothing to learn here
            for i, a in zip(idx, A):
                _, p_ids, y_ids = gens[i]
                trajs.append(env.Trajectory(scenario=batch[c], k=i, ids=p_ids + y_ids, messages=[],
                                            spans=[(len(p_ids), len(p_ids) + len(y_ids))], vs=[[0.0, 0.0, 0.0]]))
                advs.append([a])
        # 4. update: 04's clipped surrogate on the rubric tokens
        upd = mica.ppo_update(model, tokenizer, optimizer, scheduler, trajs, advs, args, log_kl=False)
        # 5. log, keep the samples, checkpoint
        recs = []
        for i, ((text, _, _), (rb, why), j, part, r) in enumerate(zip(gens, parsed, judged, parts, rewards)):
            recs.append({"step": step, "pair": pairs[i].get("id"), "g": i % args.g, "text": text, "valid": rb is not None,
                         "reason": why, "S_chosen": j and round(j["S_chosen"], 4),
                         "S_rejected": j and round(j["S_rejected"], 4), "reward": r, **(part or {})})
        common.append_jsonl(run_dir / "rollouts.jsonl", recs)
        ok = [r for r in rewards if r is not None]
        judged_ok = [j for j in judged if j is not None]
        logger.log(step, {
            "reward_mean": sum(ok) / len(ok) if ok else None,
            "recovery_rate": sum(j["S_chosen"] > j["S_rejected"] for j in judged_ok) / max(1, len(judged_ok)),
            "parse_valid": sum(rb is not None for rb, _ in parsed) / len(parsed),
            "judge_failures": sum(r is None for r in rewards),
            "degenerate_groups": degenerate,
            **upd, "lr": optimizer.param_groups[0]["lr"], "step_seconds": time.time() - t0})
        if step % args.save_every == 0 or step == args.steps:
            common.save_checkpoint(run_dir / "checkpoints", step, model, optimizer, scheduler,
                                   extra={"report_before": before}, keep=args.keep_checkpoints)
    model.save_pretrained(run_dir / "adapter", safe_serialization=True)
    tokenizer.save_pretrained(run_dir / "adapter")
    logger.close()
    if not args.skip_report:
        after = report(model, tokenizer, judge, test, weight_turns, args)
        print(write_report(run_dir, before, after))
    print(f"frozen rubric generator: {run_dir / 'adapter'}")


if __name__ == "__main__":
    common.run_main(main)

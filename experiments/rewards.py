"""experiments/rewards.py: which reward and which credit assignment train the better supporter?

Every advantage estimator x every reward, over seeds, on the same budget: for each (seed, estimator,
reward) train the policy with 04_mica_train.py --advantage E --reward R on the train scenarios, then
sample K dialogues per held-out test scenario with 03_rollout.py from the trained adapter (the same
sampling seed, settings and environment for every cell: EMPA's rules, the offline judge, the scripted
user), and compare
  held-out return     the mean IDR return per dialogue, sum_t d(P_{t-1}) - d(P_t): one yardstick for
                      every cell (each reward's own return has its own scale)
  success             EMPA's success rule reached within --max-turns
  final distance      d(P_T), the hinge distance to the goal when the dialogue ends (lower is better)
  final emotion       the simulated user's e_T on SAGE/RLVER's 0-100 scale (starts at 30)
  collapses           how many of the cell's held-out dialogues end in EMPA's failure (collapse) rule
  cut-off share       the share of replies cut at --max-new-tokens
The base model (no training) is evaluated once per seed as the reference row. Prints a markdown table
(mean ± sd over seeds, then one row per seed) and writes it to <out>/rewards.md; every cell's numbers go to
<out>/results.jsonl as they finish, and a rerun with the same --out-dir skips the cells already there
(--report-only tabulates the finished cells of an interrupted comparison without running the rest).

The idr+care reward needs a frozen CARE generator (--rubric-model, a 02_rubric_pref_rl.py adapter,
e.g. from experiments/care.py); without one, leave idr+care out of --rewards.

CPU (27 trainings; hours on 2 cores):
  python experiments/rewards.py --rubric-model runs/care/rl-s0-.../adapter
Quick look:  python experiments/rewards.py --seeds 0 --estimators mica --rewards idr --steps 2
"""

import argparse
import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from learning import newest, run, run_experiment, write_table  # experiments/learning.py's runner

ROOT = Path(__file__).resolve().parents[1]
ESTIMATORS = {"mica": "MICA", "grpo": "GRPO", "reinforce_pp": "REINFORCE++"}


def evaluate(args, out_dir, name, seed, adapter=None) -> dict:
    cmd = [
        ROOT / "03_rollout.py",
        "--scenarios",
        args.test,
        "--num-scenarios",
        "0",
        "--k",
        args.eval_k,
        "--seed",
        10_000 + seed,
        "--max-turns",
        args.max_turns,
        "--max-new-tokens",
        args.max_new_tokens,
        "--out-dir",
        out_dir,
        "--run-name",
        name,
        "--quiet",
        "--no-progress",
        *args.model_flag,
        *args.eval_args.split(),
    ]
    run(cmd + (["--adapter", adapter] if adapter else []), args.threads)
    recs = [json.loads(x) for x in (newest(out_dir, name) / "rollouts.jsonl").read_text().splitlines()]
    return {
        "return": statistics.mean(r["return"] for r in recs),
        "success": statistics.mean(r["outcome"] == "success" for r in recs),
        "final_distance": statistics.mean(r["final_distance"] for r in recs),
        "final_emotion": statistics.mean(r["final_emotion"] for r in recs),
        "collapses": sum(r["outcome"] == "failure" for r in recs),  # EMPA failures, a count of n
        "cut_off": statistics.mean(
            sum(t["cut_off"] for t in r["turns"]) / max(1, len(r["turns"])) for r in recs
        ),  # share of replies cut at the cap
        "n": len(recs),
    }


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="policy base model for 04 and 03 (default: theirs, SmolLM2)")
    p.add_argument("--seeds", default="0,1,2", help="comma-separated training seeds")
    p.add_argument("--estimators", default="mica,grpo,reinforce_pp", help="04's --advantage values, comma-separated")
    p.add_argument("--rewards", default="idr,idr+care,rlver", help="04's --reward specs, comma-separated")
    p.add_argument(
        "--rubric-model", default=None, help="the frozen CARE generator for rewards with care (a 02 adapter)"
    )
    p.add_argument("--steps", type=int, default=20, help="training steps per cell (the fixed budget)")
    p.add_argument("--train-args", default="", help="extra flags for every 04_mica_train.py run, quoted")
    p.add_argument(
        "--eval-args",
        default="",
        help="extra flags for every 03_rollout.py evaluation, quoted (e.g. "
        "'--load-in-4bit off' with CUDA, as --train-args gives 04)",
    )
    p.add_argument("--test", default=str(ROOT / "data" / "scenarios_test.jsonl"), help="held-out scenarios")
    p.add_argument("--eval-k", type=int, default=2, help="dialogues per held-out scenario")
    p.add_argument("--max-turns", type=int, default=3, help="turns per dialogue (train and eval)")
    p.add_argument("--max-new-tokens", type=int, default=48, help="reply token cap (train and eval)")
    p.add_argument("--parallel", type=int, default=1, help="cells run at once (each then uses 1 CPU thread)")
    p.add_argument("--out-dir", default=str(ROOT / "runs" / "rewards"), help="where runs, results and the table go")
    p.add_argument(
        "--report-only",
        action="store_true",
        help="run nothing: tabulate the cells of these seeds, estimators and rewards already in results.jsonl",
    )
    args = p.parse_args(argv)
    args.estimators = [e.strip() for e in args.estimators.split(",") if e.strip()]
    args.rewards = [r.strip() for r in args.rewards.split(",") if r.strip()]
    bad = [e for e in args.estimators if e not in ESTIMATORS]
    if bad:
        p.error(f"--estimators: unknown {bad}; choose from {list(ESTIMATORS)}")
    if any("care" in r for r in args.rewards) and not args.rubric_model:
        p.error(
            "--rewards with care need --rubric-model (a 02_rubric_pref_rl.py adapter; experiments/care.py "
            "trains one), or leave idr+care out of --rewards"
        )
    if args.rubric_model and not (Path(args.rubric_model) / "adapter_config.json").exists():
        p.error(f"--rubric-model {args.rubric_model}: no adapter_config.json there")
    args.threads = 1 if args.parallel > 1 else None
    args.model_flag = ["--model", args.model] if args.model else []
    return args


def main(argv=None):
    args = parse_args(argv)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    results_path = out / "results.jsonl"
    done = {}
    if results_path.exists():
        for line in results_path.read_text().splitlines():
            if line.strip():
                r = json.loads(line)
                done[(r["seed"], r["estimator"], r["reward"])] = r
    seeds = [int(s) for s in args.seeds.split(",")]
    t0 = time.time()

    def cell(key):
        seed, estimator, reward = key
        if key in done:
            return done[key]
        if estimator == "base":  # the untrained reference, once per seed
            row = {"seed": seed, "estimator": "base", "reward": "-", **evaluate(args, out, f"eval-base-s{seed}", seed)}
        else:
            name = f"{estimator}-{reward.replace('+', '_').replace('*', 'x')}-s{seed}"
            care = ["--rubric-model", args.rubric_model] if "care" in reward else []
            run(
                [
                    ROOT / "04_mica_train.py",
                    "--seed",
                    seed,
                    "--steps",
                    args.steps,
                    "--advantage",
                    estimator,
                    "--reward",
                    reward,
                    *care,
                    "--max-turns",
                    args.max_turns,
                    "--max-new-tokens",
                    args.max_new_tokens,
                    "--out-dir",
                    out,
                    "--run-name",
                    f"train-{name}",
                    "--no-progress",
                    *args.model_flag,
                    *args.train_args.split(),
                ],
                args.threads,
            )
            train_dir = newest(out, f"train-{name}")
            row = {
                "seed": seed,
                "estimator": estimator,
                "reward": reward,
                **evaluate(args, out, f"eval-{name}", seed, adapter=train_dir / "adapter"),
            }
        with open(results_path, "a") as f:  # one line per finished cell
            f.write(json.dumps(row) + "\n")
        print(json.dumps(row), flush=True)
        return row

    # seed-major: a run stopped early leaves whole seeds, every estimator paired on the same seed
    keys = [k for s in seeds for k in [(s, "base", "-")] + [(s, e, r) for r in args.rewards for e in args.estimators]]
    if args.report_only:
        keys = [k for k in keys if k in done]
        if not keys:
            sys.exit(f"error: --report-only: no finished cell of these seeds in {results_path}")
    with ThreadPoolExecutor(max_workers=args.parallel) as pool:
        rows = list(pool.map(cell, keys))

    cols = (
        ("return", "held-out IDR return", "{:.3f}"),
        ("success", "success", "{:.3f}"),
        ("final_distance", "final distance", "{:.2f}"),
        ("collapses", "collapses", "{:.2f}"),
        ("cut_off", "cut-off share", "{:.3f}"),
        ("final_emotion", "final emotion", "{:.1f}"),
    )

    def ms(xs, fmt):
        return (
            f"{fmt.format(statistics.mean(xs))} ± {fmt.format(statistics.stdev(xs))}"
            if len(xs) > 1
            else fmt.format(xs[0])
        )

    head = "| {} | reward | " + " | ".join(c[1] for c in cols) + " |\n|---|---|" + "---|" * len(cols) + "\n"
    mean_lines, seed_lines = [], []
    for estimator, reward in [("base", "-")] + [(e, r) for r in args.rewards for e in args.estimators]:
        got = [r for r in rows if r["estimator"] == estimator and r["reward"] == reward]
        if not got:  # --report-only: a cell not run yet
            continue
        name = "base (untrained)" if estimator == "base" else ESTIMATORS[estimator]
        partial = f" ({len(got)} of {len(seeds)} seeds)" if len(got) != len(seeds) else ""
        mean_lines.append(
            f"| {name}{partial} | {reward} | " + " | ".join(ms([r[k] for r in got], f) for k, _, f in cols) + " |"
        )
        seed_lines += [
            f"| {name} s{r['seed']} | {reward} | " + " | ".join(f.format(r[k]) for k, _, f in cols) + " |" for r in got
        ]
    took = "tabulated from results.jsonl" if args.report_only else f"{time.time() - t0:.0f} s"
    caption = (
        f"mean ± sd over seeds {args.seeds}; {rows[0]['n']} held-out dialogues per cell and seed "
        f"(collapses: EMPA failures among them); {args.steps} training steps per cell; {took}"
    )
    table = (
        head.format("estimator")
        + "\n".join(mean_lines)
        + f"\n\n{caption}\n\nPer seed:\n\n"
        + head.format("estimator, seed")
        + "\n".join(seed_lines)
        + "\n"
    )
    write_table(out / "rewards.md", table)


if __name__ == "__main__":
    run_experiment(main)

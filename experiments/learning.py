"""experiments/learning.py: does MICA training beat the base policy on held-out scenarios?

For each seed: train the policy with 04_mica_train.py for a fixed budget on the train scenarios,
then sample K dialogues per held-out test scenario with 03_rollout.py from the base model and from
the trained adapter (same sampling seed, same settings), and compare mean IDR return per trajectory,
success rate and mean final distance. Prints a markdown table and writes it to <out>/learning.md.
Every number comes from the scripts' own JSONL output, run as a user would run them.

CPU (about 1.5 h on 2 cores):  python experiments/learning.py
Quick look:                    python experiments/learning.py --seeds 0 --steps 4
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(cmd, threads=None):
    print("$", " ".join(map(str, cmd)), flush=True)
    env = dict(os.environ, HF_HUB_OFFLINE="1", **({"OMP_NUM_THREADS": str(threads)} if threads else {}))
    p = subprocess.run([sys.executable, *map(str, cmd)], cwd=ROOT, capture_output=True, text=True, env=env)
    if p.returncode != 0:
        print(f"FAILED ({p.returncode}): {' '.join(map(str, cmd))}\n{p.stderr[-3000:]}", flush=True)
        raise RuntimeError(f"a run failed with exit code {p.returncode}")
    return p.stdout


def newest(out_dir: Path, prefix: str) -> Path:
    return max(out_dir.glob(prefix + "-*"), key=lambda p: p.stat().st_mtime)


def evaluate(args, out_dir, name, seed, adapter=None):
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
        "--temperature",
        args.temperature,
        "--out-dir",
        out_dir,
        "--run-name",
        name,
        "--quiet",
        "--no-progress",
    ]
    run(cmd + (["--adapter", adapter] if adapter else []), args.threads)
    recs = [json.loads(x) for x in (newest(out_dir, name) / "rollouts.jsonl").read_text().splitlines()]
    return {
        "return": statistics.mean(r["return"] for r in recs),
        "success": statistics.mean(r["outcome"] == "success" for r in recs),
        "final_distance": statistics.mean(r["final_distance"] for r in recs),
        "n": len(recs),
    }


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", default="0,1,2", help="comma-separated training seeds")
    p.add_argument("--parallel", type=int, default=1, help="seeds run at once (each then uses 1 CPU thread)")
    p.add_argument("--steps", type=int, default=20, help="training steps per seed (the fixed budget)")
    p.add_argument("--train-args", default="", help="extra flags for 04_mica_train.py, quoted")
    p.add_argument("--test", default=str(ROOT / "data" / "scenarios_test.jsonl"), help="held-out scenarios")
    p.add_argument("--eval-k", type=int, default=4, help="dialogues per test scenario")
    p.add_argument("--max-turns", type=int, default=3, help="turns per dialogue (train and eval)")
    p.add_argument("--max-new-tokens", type=int, default=48, help="reply token cap (train and eval)")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (train and eval)")
    p.add_argument("--out-dir", default=str(ROOT / "runs" / "learning"), help="where runs and the table go")
    args = p.parse_args()
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    args.threads = 1 if args.parallel > 1 else None
    t0 = time.time()

    def one_seed(seed):
        base = evaluate(args, out, f"eval-base-s{seed}", seed)
        run(
            [
                ROOT / "04_mica_train.py",
                "--seed",
                seed,
                "--steps",
                args.steps,
                "--max-turns",
                args.max_turns,
                "--max-new-tokens",
                args.max_new_tokens,
                "--temperature",
                args.temperature,
                "--out-dir",
                out,
                "--run-name",
                f"train-s{seed}",
                "--no-progress",
                *args.train_args.split(),
            ],
            args.threads,
        )
        train_dir = newest(out, f"train-s{seed}")
        trained = evaluate(args, out, f"eval-mica-s{seed}", seed, adapter=train_dir / "adapter")
        m = [json.loads(x) for x in (train_dir / "metrics.jsonl").read_text().splitlines()]
        q = max(1, len(m) // 4)
        row = {
            "seed": seed,
            "base": base,
            "mica": trained,
            "train_return_first": statistics.mean(x["return_mean"] for x in m[:q]),
            "train_return_last": statistics.mean(x["return_mean"] for x in m[-q:]),
        }
        print(json.dumps(row), flush=True)
        return row

    with ThreadPoolExecutor(max_workers=args.parallel) as pool:
        rows = list(pool.map(one_seed, [int(s) for s in args.seeds.split(",")]))

    def ms(xs):
        return f"{statistics.mean(xs):.3f} ± {statistics.stdev(xs):.3f}" if len(xs) > 1 else f"{xs[0]:.3f}"

    lines = [
        "| seed | held-out return: base | MICA | success: base | MICA | final distance: base | MICA "
        "| train return: first 25% of steps | last 25% |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        b, t = r["base"], r["mica"]
        lines.append(
            f"| {r['seed']} | {b['return']:.3f} | {t['return']:.3f} | {b['success']:.3f} | "
            f"{t['success']:.3f} | {b['final_distance']:.3f} | {t['final_distance']:.3f} | "
            f"{r['train_return_first']:.3f} | {r['train_return_last']:.3f} |"
        )

    def col(who, key):
        return [r[who][key] for r in rows]

    lines.append(
        f"| mean ± sd | {ms(col('base', 'return'))} | {ms(col('mica', 'return'))} | "
        f"{ms(col('base', 'success'))} | {ms(col('mica', 'success'))} | "
        f"{ms(col('base', 'final_distance'))} | {ms(col('mica', 'final_distance'))} | "
        f"{ms([r['train_return_first'] for r in rows])} | {ms([r['train_return_last'] for r in rows])} |"
    )
    gains = [r["mica"]["return"] - r["base"]["return"] for r in rows]
    spread = statistics.stdev(col("mica", "return")) if len(rows) > 1 else float("nan")
    verdict = (
        f"held-out return gain {statistics.mean(gains):+.3f} (per seed: "
        f"{', '.join(f'{g:+.3f}' for g in gains)}); seed spread (sd of trained returns) {spread:.3f}; "
        f"{rows[0]['base']['n']} held-out dialogues per model and seed; {time.time() - t0:.0f} s"
    )
    table = "\n".join(lines) + "\n\n" + verdict + "\n"
    write_table(out / "learning.md", table)


def write_table(path: Path, table: str):
    path.write_text(table)
    print("\n" + table)


def run_experiment(main):
    """main(); a stage script that failed (its stderr is printed above) ends it with one line, exit 1."""
    try:
        main()
    except RuntimeError as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    run_experiment(main)

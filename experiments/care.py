"""experiments/care.py: does each CARE stage improve the rubric generator on held-out preference pairs?

Three generators, compared on data/rubric_pref_test.jsonl by preference-recovery accuracy (the greedy
rubric ranks the preferred reply higher: S(chosen) > S(rejected)) and parse-valid rate:
  untrained   the base model (greedy decoding: one number, the same for every seed)
  SFT         01_rubric_sft.py, per seed
  RL          02_rubric_pref_rl.py from that seed's SFT adapter
Every number comes from the scripts' own report.json, run as a user runs them. Prints a markdown table,
and the paired RL - SFT accuracy with a 95% t interval over the seeds (the seed is the independent unit:
mean ± t_{0.975, n-1} sd / sqrt(n), 05_eval.t_interval), and writes both to <out>/care.md. Stages already
finished in --out-dir are reused (rerun to continue, or run seeds as separate processes into one folder,
then once more with all the seeds for the table).

CPU:  python experiments/care.py                         (docs/results.md's table: 5 seeds, about 5 h on 2 cores)
Quick look:  python experiments/care.py --seeds 0 --sft-steps 20 --rl-steps 4 --report-limit 8
"""

import argparse
import importlib
import json
import statistics
import sys
import time
from pathlib import Path

from learning import run, run_experiment  # the same subprocess runner as experiments/learning.py

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
evaluation = importlib.import_module("05_eval")  # the t interval over independent units


def finished(out: Path, prefix: str, file: str) -> Path | None:
    """The newest run folder with this prefix that holds `file` (a finished stage), or None."""
    done = [p for p in out.glob(prefix + "-*") if (p / file).exists()]
    return max(done, key=lambda p: p.stat().st_mtime) if done else None


def spread(xs):
    return f"{statistics.mean(xs):.3f} ± {statistics.stdev(xs):.3f}" if len(xs) > 1 else f"{xs[0]:.3f}"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="generator base model for 01 and 02 (default: theirs, SmolLM2)")
    p.add_argument("--seeds", default="0,1,2,3,4", help="comma-separated seeds (docs/results.md's table: 0-4)")
    p.add_argument("--sft-steps", type=int, default=160, help="01_rubric_sft.py --steps (docs/results.md's table: 160)")
    p.add_argument(
        "--rl-steps", type=int, default=16, help="02_rubric_pref_rl.py --steps (docs/results.md's table: 16)"
    )
    p.add_argument("--report-limit", type=int, default=0, help="held-out pairs / turns used (0 = all)")
    p.add_argument(
        "--extra-sft",
        default="--lr 1e-3 --eval-every 1000 --eval-limit 30 --micro-batch-size 1",
        help="extra flags for 01, quoted; replaces the default (docs/results.md's table's settings)",
    )
    p.add_argument(
        "--extra-rl",
        default="--lr 1e-4 --temperature 0.7 --micro-batch-size 1",
        help="extra flags for 02, quoted; replaces the default (docs/results.md's table's settings)",
    )
    p.add_argument("--out-dir", default=str(ROOT / "runs" / "care"), help="where runs and the table go")
    args = p.parse_args()
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    limit = ["--report-limit", args.report_limit] if args.report_limit else []
    model = ["--model", args.model] if args.model else []
    # A stage whose output is already in --out-dir (a finished run folder) is reused, not rerun: an
    # interrupted comparison continues, and seeds can run as separate processes into one folder.
    # 1. the untrained generator (greedy: seed-independent)
    if not finished(out, "untrained", "report.json"):
        run(
            [
                ROOT / "02_rubric_pref_rl.py",
                "--report-only",
                "--out-dir",
                out,
                "--run-name",
                "untrained",
                *limit,
                "--no-progress",
                *model,
                *args.extra_rl.split(),
            ]
        )
    untrained = json.loads((finished(out, "untrained", "report.json") / "report.json").read_text())["before"]
    rows = []
    for seed in [int(s) for s in args.seeds.split(",")]:
        # 2. SFT, then 3. RL from the SFT adapter (02 reports before = SFT and after = RL)
        if not finished(out, f"sft-s{seed}", "adapter/adapter_config.json"):
            run(
                [
                    ROOT / "01_rubric_sft.py",
                    "--seed",
                    seed,
                    "--steps",
                    args.sft_steps,
                    "--out-dir",
                    out,
                    "--run-name",
                    f"sft-s{seed}",
                    "--no-progress",
                    *model,
                    *args.extra_sft.split(),
                ]
            )
        sft_dir = finished(out, f"sft-s{seed}", "adapter/adapter_config.json")
        if not finished(out, f"rl-s{seed}", "report.json"):
            run(
                [
                    ROOT / "02_rubric_pref_rl.py",
                    "--seed",
                    seed,
                    "--steps",
                    args.rl_steps,
                    "--adapter",
                    sft_dir / "adapter",
                    "--out-dir",
                    out,
                    "--run-name",
                    f"rl-s{seed}",
                    *limit,
                    "--no-progress",
                    *model,
                    *args.extra_rl.split(),
                ]
            )
        rep = json.loads((finished(out, f"rl-s{seed}", "report.json") / "report.json").read_text())
        rows.append({"seed": seed, "sft": rep["before"], "rl": rep["after"]})
        print(
            f"seed {seed}: untrained {untrained['recovery_acc']:.3f}  SFT {rep['before']['recovery_acc']:.3f}  "
            f"RL {rep['after']['recovery_acc']:.3f}",
            flush=True,
        )
    table = [
        "| generator | preference-recovery accuracy | parse-valid rate |",
        "|---|---|---|",
        f"| untrained | {untrained['recovery_acc']:.3f} | {untrained['parse_valid']:.3f} |",
    ]
    for name in ("sft", "rl"):
        table.append(
            f"| {name.upper()} (mean ± sd over {len(rows)} seeds) | "
            f"{spread([r[name]['recovery_acc'] for r in rows])} | "
            f"{spread([r[name]['parse_valid'] for r in rows])} |"
        )
    table += ["", "| seed | SFT | RL | RL - SFT |", "|---|---|---|---|"]
    table += [
        f"| {r['seed']} | {r['sft']['recovery_acc']:.3f} | {r['rl']['recovery_acc']:.3f} | "
        f"{r['rl']['recovery_acc'] - r['sft']['recovery_acc']:+.3f} |"
        for r in rows
    ]
    # 4. paired by seed: d_s = RL_s - SFT_s, 95% CI = mean(d) ± t_{0.975, n-1} sd(d) / sqrt(n) over the n seeds
    mean, half = evaluation.t_interval([r["rl"]["recovery_acc"] - r["sft"]["recovery_acc"] for r in rows])
    if half is not None:
        verdict = "RL ahead of SFT" if mean - half > 0 else "RL behind SFT" if mean + half < 0 else "not separated"
        table += [
            "",
            f"RL - SFT accuracy, paired by seed: {mean:+.3f}, 95% t interval over {len(rows)} seeds "
            f"[{mean - half:+.3f}, {mean + half:+.3f}]: {verdict}",
        ]
    text = "\n".join(table) + f"\n\n({(time.time() - t0) / 60:.0f} min; `python {' '.join(sys.argv)}`)\n"
    (out / "care.md").write_text(text)
    print(text)


if __name__ == "__main__":
    run_experiment(main)

"""scripts/pipeline.py: the five stages in one command, as a course walks through them (make pipeline).

  01 SFT of the rubric generator -> 02 preference RL of it -> 04 MICA training with --reward idr+care,
  02's generator writing each turn's rubric -> 05 evaluation of the base and the trained adapter on the
  offline suites (EMPA, EQ-Bench 3 offline proxy, SAGE, EmoBench samples), with 05's held-out comparison of the
  adapter against the base on EMPA (paired by scenario, k and seed; a 95% t interval over scenarios).

Each stage runs as a user runs it (a subprocess, the flags printed), into one folder, and each adapter
is handed to the next stage. The budgets are tiny: this shows that the stages fit together and what each
writes, not what they can learn (04's own defaults and docs/results.md are for that). At the end one
summary: each stage's run folder, its headline number and its pictures (04's dialogues also as one page,
rollouts.html, by scripts/view_run.py); it is also written to summary.md.

Reads   the stages' default data under data/; --model (default: the packaged SmolLM2-135M-Instruct).
Writes  <out-dir>/pipeline-<time>/: 01-sft-*/, 02-pref-*/, 04-mica-*/, 05-eval-*/ (the stages' own run
        folders; 04's with rollouts.html), NN.log (each stage's output), summary.md.

CPU:  make pipeline        (python scripts/pipeline.py; <= 15 minutes on 2 cores with SmolLM2)
Test: python scripts/pipeline.py --model <tiny model folder> --budget tiny
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# The flags of each stage at each budget ("course": SmolLM2 on 2 CPU cores in <= 15 minutes; "tiny": a
# random test model in seconds). Every value is an ordinary flag of that stage: see its --help.
BUDGETS = {
    "course": {
        "01": [
            "--steps",
            "16",
            "--batch-size",
            "4",
            "--micro-batch-size",
            "2",
            "--eval-every",
            "16",
            "--eval-limit",
            "4",
            "--max-new-tokens",
            "144",
            "--lr",
            "5e-4",
        ],
        "02": [
            "--steps",
            "2",
            "--contexts-per-step",
            "2",
            "--g",
            "4",
            "--minibatch-size",
            "4",
            "--max-new-tokens",
            "144",
            "--report-limit",
            "3",
        ],
        "04": [
            "--steps",
            "2",
            "--scenarios-per-step",
            "2",
            "--k",
            "4",
            "--minibatch-size",
            "4",
            "--max-turns",
            "2",
            "--rubric-max-new-tokens",
            "144",
            "--save-every",
            "2",
        ],
        # 2 cases a suite, EMPA's K = 2: the held-out comparison needs 2+ scenarios (its independent units)
        "05": [
            "--suite",
            "empa,eqbench3,sage,emobench",
            "--max-cases",
            "2",
            "--k",
            "2",
            "--max-turns",
            "3",
            "--min-turns",
            "2",
            "--sage-turns",
            "3",
            "--max-new-tokens",
            "48",
        ],
    },
    "tiny": {
        "01": [
            "--steps",
            "2",
            "--batch-size",
            "2",
            "--micro-batch-size",
            "2",
            "--eval-every",
            "2",
            "--eval-limit",
            "2",
            "--max-new-tokens",
            "12",
            "--lr",
            "5e-3",
        ],
        "02": [
            "--steps",
            "1",
            "--contexts-per-step",
            "2",
            "--g",
            "2",
            "--minibatch-size",
            "4",
            "--max-new-tokens",
            "12",
            "--report-limit",
            "2",
        ],
        "04": [
            "--steps",
            "2",
            "--scenarios-per-step",
            "2",
            "--k",
            "2",
            "--minibatch-size",
            "2",
            "--max-turns",
            "2",
            "--max-new-tokens",
            "6",
            "--rubric-max-new-tokens",
            "12",
            "--save-every",
            "1",
        ],
        "05": [
            "--suite",
            "empa,eqbench3,sage,emobench",
            "--max-cases",
            "2",
            "--k",
            "2",
            "--max-turns",
            "2",
            "--min-turns",
            "1",
            "--sage-turns",
            "2",
            "--max-new-tokens",
            "6",
        ],
    },
}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--model",
        default=None,
        help="the base model of every stage (default: the stages' own, the packaged SmolLM2-135M-Instruct)",
    )
    p.add_argument(
        "--budget",
        choices=list(BUDGETS),
        default="course",
        help="course: SmolLM2 on 2 CPU cores in <= 15 minutes; tiny: a test model in seconds",
    )
    p.add_argument("--seed", type=int, default=0, help="--seed of every stage")
    p.add_argument("--out-dir", default="runs", help="the pipeline's folder goes under this")
    args = p.parse_args(argv)
    out = Path(args.out_dir).resolve() / f"pipeline-{dt.datetime.now().strftime('%Y%m%d-%H%M%S')}"
    out.mkdir(parents=True)
    flags = BUDGETS[args.budget]
    shared = ["--seed", str(args.seed), "--out-dir", str(out), "--no-progress"]
    model = ["--model", args.model] if args.model else []
    # 1. SFT: the rubric generator learns the format and the weights from the labelled turns
    sft = stage(out, "01", "01_rubric_sft.py", model + flags["01"] + shared + ["--run-name", "01-sft"])
    # 2. preference RL of the generator, from 01's adapter
    pref = stage(
        out,
        "02",
        "02_rubric_pref_rl.py",
        model + flags["02"] + shared + ["--run-name", "02-pref", "--adapter", str(sft / "adapter")],
    )
    # 3. MICA with the adaptive reward: IDR + CARE's rubric score, 02's generator frozen
    mica = stage(
        out,
        "04",
        "04_mica_train.py",
        model
        + flags["04"]
        + shared
        + ["--run-name", "04-mica", "--reward", "idr+care", "--rubric-model", str(pref / "adapter")],
    )
    # the training dialogues as one page: turn by turn, the state, the reward, the advantages
    subprocess.run([sys.executable, str(ROOT / "scripts" / "view_run.py"), str(mica)], check=True)
    # 4. evaluation: the base model, then the trained adapter, on the offline suites; EMPA's held-out
    # comparison of the adapter with the base (05's results.json "comparison")
    ev = stage(
        out,
        "05",
        "05_eval.py",
        model + flags["05"] + shared + ["--run-name", "05-eval", "--adapters", str(mica / "adapter")],
    )
    text = summary(out, sft, pref, mica, ev)
    (out / "summary.md").write_text(text + "\n")
    print("\n" + text + f"\n\nwritten to {out / 'summary.md'}")


def stage(out: Path, nn: str, script: str, flags: list[str]) -> Path:
    """Run one stage as a user would; its output goes to NN.log; -> its run folder. A failed stage stops
    the pipeline with the stage's exit code and the end of its log."""
    cmd = [sys.executable, str(ROOT / script), *flags]
    print(f"$ {' '.join(cmd[1:])}", flush=True)
    t0 = dt.datetime.now()
    with open(out / f"{nn}.log", "w") as log:
        rc = subprocess.run(
            cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, HF_HUB_OFFLINE="1")
        ).returncode
    if rc != 0:
        tail = (out / f"{nn}.log").read_text(errors="replace")[-3000:]
        sys.exit(f"{tail}\npipeline: stage {nn} ({script}) failed with exit code {rc}; its log: {out / (nn + '.log')}")
    runs = sorted(out.glob(f"{flags[flags.index('--run-name') + 1]}-*"))
    print(f"  done in {(dt.datetime.now() - t0).total_seconds():.0f} s: {runs[-1]}", flush=True)
    return runs[-1]


def metrics(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]


def heldout(ev: Path, adapter: Path) -> str:
    """05's paired comparison of the adapter with the base on EMPA's held-out scenarios (results.json's
    "comparison"): the IDR return's difference with its 95% t interval over scenarios, and the verdict."""
    c = json.loads((ev / "results.json").read_text()).get("comparison", {}).get(str(adapter), {}).get("idr_return")
    if not c:
        return "no held-out comparison (fewer than 2 EMPA dialogues paired with the base)"
    ci = (
        f"95% CI [{c['ci'][0]:+.2f}, {c['ci'][1]:+.2f}] (t over {c['scenarios']} scenarios)"
        if c["scenarios"] > 1
        else "no interval (1 scenario)"
    )
    return (
        f"held-out EMPA IDR return adapter - base {c['diff']:+.2f}, {ci}, {c['dialogues']} paired dialogues: "
        f"{c['verdict']}"
    )


def summary(out: Path, sft: Path, pref: Path, mica: Path, ev: Path) -> str:
    """One markdown block: each stage's folder, headline number and picture."""
    evals = [m for m in metrics(sft) if "eval_parse_valid" in m]
    first, last = evals[0], evals[-1]
    rep = json.loads((pref / "report.json").read_text())
    steps = metrics(mica)
    compared = heldout(ev, mica / "adapter")

    def rel(p):
        return os.path.relpath(p, out)

    L = [
        f"# Pipeline {out.name}",
        "",
        "| stage | run folder | headline | picture |",
        "|---|---|---|---|",
        f"| 01 rubric SFT | {rel(sft)} | parse-valid {first['eval_parse_valid']:.2f} -> "
        f"{last['eval_parse_valid']:.2f}, "
        f"dominant-dimension accuracy {first['eval_dominant_acc']:.2f} -> {last['eval_dominant_acc']:.2f} "
        f"(step {first['step']} -> {last['step']}) | {rel(sft / 'curves.png')} |",
        f"| 02 rubric preference RL | {rel(pref)} | held-out preference recovery "
        f"{rep['before']['recovery_acc']:.2f} -> {rep['after']['recovery_acc']:.2f}, parse-valid "
        f"{rep['before']['parse_valid']:.2f} -> {rep['after']['parse_valid']:.2f} | "
        f"{rel(pref / 'weights_by_turn.png')} |",
        f"| 04 MICA, idr+care | {rel(mica)} | return {steps[0]['return_mean']:.2f} (step 1) -> "
        f"{steps[-1]['return_mean']:.2f} (step {steps[-1]['step']}); rubrics that did not parse "
        f"(the uniform one used): {sum(m.get('rubric_invalid', 0) for m in steps)} of "
        f"{round(sum(m['trajectories'] * m['turns_mean'] for m in steps))} | {rel(mica / 'rollouts.html')}, "
        f"{rel(mica / 'curves.png')}, {', '.join(rel(c) for c in sorted(mica.glob('credit_step*.png')))} |",
        f"| 05 evaluation | {rel(ev)} | {compared}; the table below | {rel(ev / 'distance_per_turn.png')} |",
        "",
        (ev / "results.md").read_text().strip(),
        "",
        "Tiny budgets: this shows the stages fitting together, not what they can learn.",
    ]
    return "\n".join(L)


if __name__ == "__main__":
    main()

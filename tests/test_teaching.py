"""The teaching path: 04's presets (device-aware defaults) and its curves, 05's held-out comparison of the
trained adapter with the base, and scripts/pipeline.py running all the stages (subprocess, tiny random model)."""

import importlib
import json
import re
import statistics
import sys
from pathlib import Path

import pytest
import torch
import yaml

import common
from conftest import run_script

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--max-new-tokens", "6", "--max-turns", "2", "--no-progress"]


def only_run(out_dir):
    runs = [p for p in Path(out_dir).iterdir() if p.is_dir()]
    assert len(runs) == 1, runs
    return runs[0]


def test_presets_follow_the_device_and_flags_given_win(monkeypatch):
    trainer = importlib.import_module("04_mica_train")
    monkeypatch.setattr(common, "pick_device", lambda: torch.device("cpu"))
    cpu = trainer.parse_args([])
    assert (cpu.lr, cpu.max_turns, cpu.max_new_tokens, cpu.judge, cpu.user) == (1e-3, 3, 48, "embed", "scripted")
    assert "preset presets/cpu.yaml (auto: no CUDA)" in cpu.preset_note
    monkeypatch.setattr(common, "pick_device", lambda: torch.device("cuda", 0))  # a GPU, as the probe sees it
    gpu = trainer.parse_args([])
    assert (gpu.scenarios_per_step, gpu.k, gpu.minibatch_size) == (16, 4, 32)  # 2 optimizer steps a rollout
    assert (gpu.min_turns, gpu.max_turns, gpu.max_new_tokens, gpu.lr) == (8, 15, 256, 1e-5)
    assert gpu.gradient_checkpointing and (gpu.judge, gpu.user) == ("self", "self")
    assert "preset presets/gpu.yaml (auto: CUDA found)" in gpu.preset_note
    given = trainer.parse_args(["--lr", "3e-5", "--judge", "embed", "--max-turns", "10"])
    assert (given.lr, given.judge, given.max_turns, given.user) == (3e-5, "embed", 10, "self")
    assert given.flags_given == {"lr": 3e-5, "judge": "embed", "max_turns": 10}  # against the preset's defaults
    cpu_on_gpu = trainer.parse_args(["--preset", "cpu"])  # asked for: the reference
    assert (cpu_on_gpu.lr, cpu_on_gpu.max_turns, cpu_on_gpu.judge) == (1e-3, 3, "embed")
    demo = trainer.parse_args(["--preset", "demo", "--steps", "3"])
    assert yaml.safe_load((trainer.PRESETS / "demo.yaml").read_text()) == dict(steps=4, log_kl_every=2, save_every=4)
    assert (demo.steps, demo.log_kl_every, demo.save_every) == (3, 2, 4)
    assert demo.flags_given == {"preset": "demo", "steps": 3} and "preset presets/demo.yaml (asked" in demo.preset_note
    assert not hasattr(demo, "heldout_scenarios")  # the comparison is 05's now


def test_a_config_file_sets_any_option_and_flags_given_win(monkeypatch, tmp_path):
    """--config FILE.yaml (TRL's convention): any option by its name, over the preset, under the flags given;
    it may name the preset itself; the header names both files. A wrong name or value is one line, exit 2."""
    trainer = importlib.import_module("04_mica_train")
    monkeypatch.setattr(common, "pick_device", lambda: torch.device("cpu"))
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("preset: gpu\nalpha: 0.7\nreward: idr+0.5*rlver\nidr_weights: [1, 2, 1]\nkardia_format: true\n")
    args = trainer.parse_args(["--config", str(recipe), "--alpha", "0.2"])
    assert (args.alpha, args.reward, args.idr_weights, args.kardia_format) == (
        0.2,
        "idr+0.5*rlver",
        [1.0, 2.0, 1.0],
        True,
    )
    assert (args.lr, args.max_turns, args.judge) == (1e-5, 15, "self")  # the gpu preset, named by the recipe
    assert args.preset_note == f"preset presets/gpu.yaml (from --config) | config {recipe}"
    assert args.flags_given == {"config": str(recipe), "alpha": 0.2}
    for text, says in (
        ("alpah: 0.5\n", "recipe.yaml: unknown option 'alpah'"),
        ("alpha: 2\n", "recipe.yaml: alpha: must be <= 1, got 2"),
        ("advantage_x: 1\nk: 0\n", "unknown option 'advantage_x'"),
        ("k: 0\n", "recipe.yaml: k: must be >= 1, got 0"),
        ("care_distance: flat\n", "recipe.yaml: care_distance: 'flat' is not one of weighted, plain"),
        ("gradient_checkpointing: 3\n", "recipe.yaml: gradient_checkpointing: must be true or false"),
        ("idr_weights: [1, 2]\n", "recipe.yaml: idr_weights: must hold 3 values"),
        ("- a list\n", "recipe.yaml: expected lines of name: value"),
    ):
        recipe.write_text(text)
        with pytest.raises(common.UserError, match=re.escape(says)):
            trainer.parse_args(["--config", str(recipe)])


VERDICTS = (
    "ahead beyond the spread",
    "behind beyond the spread",
    "not separated",
    "no spread over",
    "too few scenarios to tell",
)


def test_train_run_draws_its_curves_and_05_compares_base_and_trained_held_out(tiny_model, tmp_path):
    p = run_script(
        "04_mica_train.py",
        "--model",
        tiny_model,
        "--steps",
        "2",
        "--scenarios-per-step",
        "2",
        "--k",
        "2",
        "--minibatch-size",
        "2",
        "--save-every",
        "1",
        "--log-kl-every",
        "1",
        "--lr",
        "1e-2",
        "--out-dir",
        tmp_path / "train",
        *TINY,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    run = only_run(tmp_path / "train")
    # a quiet console: one header line (the folder, the preset, the flags given), then one line per step
    header, *rest = [line for line in p.stdout.splitlines() if line.strip()]
    assert (
        header.startswith(f"run folder {run} | preset presets/cpu.yaml (auto: no CUDA")
        and " --steps 2 " in header.split("flags given: ")[1]
    )
    assert [line.split(" | ")[0] for line in rest[:2]] == ["step    1", "step    2"]
    png = (run / "curves.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000  # a real picture, five panels
    # 05 compares the adapter with the base on 3 held-out scenarios x K=2, paired by scenario, k and seed
    adapter = str(run / "adapter")
    q = run_script(
        "05_eval.py",
        "--model",
        tiny_model,
        "--suite",
        "empa",
        "--adapters",
        adapter,
        "--max-cases",
        "3",
        "--k",
        "2",
        "--max-turns",
        "2",
        "--min-turns",
        "1",
        "--collapse-window",
        "2",
        "--max-context",
        "2048",
        "--max-new-tokens",
        "6",
        "--no-progress",
        "--out-dir",
        tmp_path / "eval",
    )
    assert q.returncode == 0, q.stderr[-3000:]
    ev_run = only_run(tmp_path / "eval")
    cases = [json.loads(x) for x in (ev_run / "cases.jsonl").read_text().splitlines()]
    by = {(c["model"], c["case"]): c for c in cases if c["suite"] == "empa" and not c.get("failed")}
    assert sorted(m for m, _ in by) == sorted(["base"] * 6 + [adapter] * 6)  # 3 scenarios x K=2 each
    scenarios = sorted({c.split("#")[0] for _, c in by})
    assert len(scenarios) == 3
    comparison = json.loads((ev_run / "results.json").read_text())["comparison"][adapter]
    for key in ("idr_return", "collapse", "cut_off", "naturalness"):
        s = comparison[key]
        diff, (lo, hi) = s["diff"], s["ci"]
        assert (s["scenarios"], s["dialogues"]) == (3, 6) and lo <= diff <= hi
        # the paired difference, averaged within each scenario first (the unit), then over the scenarios
        per_scenario = [
            statistics.mean(by[adapter, f"{sc}#{k}"][key] - by["base", f"{sc}#{k}"][key] for k in range(2))
            for sc in scenarios
        ]
        assert abs(diff - statistics.mean(per_scenario)) < 1e-9
        assert abs(diff - (s["adapter"] - s["base"])) < 1e-9  # paired, K each: the same mean
        assert s["verdict"].startswith(VERDICTS)
        if lo < hi:  # a spread to stand on: the verdict follows the interval
            assert (s["verdict"] == "not separated") == (lo <= 0 <= hi)
        else:
            assert s["verdict"] == f"no spread over 3 scenarios: every scenario's difference is {diff:+.3f}"
            assert len(set(per_scenario)) == 1  # it is so: every scenario's difference the same
    assert comparison["naturalness"]["base"] < 0  # a mean log-likelihood
    assert f"held out: {adapter} vs base on 3 scenarios, 6 dialogues paired" in q.stdout
    ci_lines = [line for line in q.stdout.splitlines() if "95% t CI over 3 scenarios" in line]
    assert len(ci_lines) == 4 == q.stdout.count("95% t CI over 3 scenarios")
    assert all(line.split("]: ", 1)[1].startswith(VERDICTS) for line in ci_lines)  # the verdict after the CI
    # the comparison as a picture, one case's state trajectories, and one held-out dialogue side by side
    for name in ("comparison.png", "trajectories.png"):
        assert (ev_run / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and (ev_run / name).stat().st_size > 5_000
    case = q.stdout.split("one held-out dialogue, ")[1].split(" ")[0]
    assert case.split("#")[0] in scenarios
    base_turns = [
        t
        for t in (json.loads(x) for x in (ev_run / "transcripts.jsonl").read_text().splitlines())
        if (t["model"], t["case"]) == ("base", case)
    ][0]["turns"]
    rows = [ln for ln in q.stdout.splitlines() if ln.startswith("d(P_")]
    assert [r.split(" | ")[0].strip() for r in rows] == [
        f"d(P_{tu['t']}) = {tu['distance']}, naturalness {tu['naturalness']:.2f}" for tu in base_turns
    ]
    # 04 drew its credit picture at the first and the last step, from the A_turn / A_group it logged
    assert sorted(x.name for x in run.glob("credit_step*.png")) == ["credit_step1.png", "credit_step2.png"]
    turns = [tu for x in (run / "rollouts.jsonl").read_text().splitlines() for tu in json.loads(x)["turns"]]
    assert turns and all(
        abs(0.4 * tu["terms"]["A_turn"] + 0.6 * tu["terms"]["A_group"] - tu["advantage"]) < 2e-4 for tu in turns
    )


def test_t_interval_on_hand_computed_numbers():
    from test_advantages import expect

    ev = importlib.import_module("05_eval")
    equation = "mean +- t_{0.975, n-1} sd / sqrt(n), sd the sample sd (ddof 1), n the independent units"
    m, half = ev.t_interval([1.0, 2.0, 3.0])  # mean 2, sample sd 1, half-width t_{0.975, 2} / sqrt(3)
    # t_{0.975, 2}: 4.303 (a table's three digits) or scipy's 4.30265 both pass (to 1e-3 on t)
    case = "3 units: mean 2, sd 1, half-width t_{0.975, 2} x 1 / sqrt(3) with t_{0.975, 2} = 4.303 (4.30265)"
    expect([m, half], [2.0, 4.303 / 3**0.5], case, "xs = [1, 2, 3]", equation, tol=1e-3 / 3**0.5)
    expect(list(ev.t_interval([0.5])), [0.5, None], "one unit: no interval", "xs = [0.5]", equation)
    # 24 units, 23 df, a df no short table holds: exact t_{0.975, 23} = 2.06866; a table read at the largest df
    # it has below 23 (20: 2.086) is wider and also accepted. xs: 12 zeros and 12 ones, mean 0.5, sd sqrt(6/23)
    xs = [float(i % 2) for i in range(24)]
    m, half = ev.t_interval(xs)
    t = half / ((6 / 23) ** 0.5 / 24**0.5) if half is not None else float("nan")
    if not (abs(m - 0.5) < 1e-9 and 2.06866 - 1e-3 <= t <= 2.086 + 1e-3):
        raise AssertionError(
            "case: 24 units (23 df, not in a short table): the half-width is t_{0.975, 23} sd / sqrt(24)\n"
            "inputs: xs = 12 zeros and 12 ones (mean 0.5, sample sd 0.510754)\n"
            f"equation: {equation}\n"
            "expected: mean 0.5 and t between 2.06866 (exact) and 2.086 (a table's entry at 20 df)\n"
            f"got:      mean {m:.6g} and t {t:.6g}"
        )


def test_pipeline_runs_the_five_stages_and_summarises(tiny_model, tmp_path):
    p = run_script("scripts/pipeline.py", "--model", tiny_model, "--budget", "tiny", "--out-dir", tmp_path)
    assert p.returncode == 0, (p.stdout[-3000:], p.stderr[-3000:])
    out = only_run(tmp_path)
    stages = sorted(x.name.split("-20")[0] for x in out.iterdir() if x.is_dir())
    assert stages == ["01-sft", "02-pref", "04-mica", "05-eval"]
    for name in ("01-sft", "02-pref", "04-mica"):
        run = next(out.glob(name + "-*"))
        assert (run / "adapter" / "adapter_config.json").exists()
        assert (run / "curves.png").stat().st_size > 5_000
    mica = next(out.glob("04-mica-*"))
    args = json.loads((mica / "args.json").read_text())
    assert args["reward"] == "idr+care" and args["rubric_model"].endswith("adapter")
    assert "02-pref" in args["rubric_model"]  # 04 used 02's generator
    rubrics = [
        t.get("rubric") for x in (mica / "rollouts.jsonl").read_text().splitlines() for t in json.loads(x)["turns"]
    ]
    assert rubrics and all(r is not None for r in rubrics)
    summary = (out / "summary.md").read_text()
    rows = [line for line in summary.splitlines() if line.startswith("| 0")]
    assert [r.split(" | ")[0] for r in rows] == [
        "| 01 rubric SFT",
        "| 02 rubric preference RL",
        "| 04 MICA, idr+care",
        "| 05 evaluation",
    ]
    assert all(r.count(" | ") == 3 and r.rstrip(" |").endswith(".png") for r in rows)  # folder, number, picture
    assert "EMPA EPM-Index" in summary and "95% CI" in summary
    assert summary in p.stdout + "\n"
    page = (mica / "rollouts.html").read_text()  # the training dialogues as one page
    assert page.startswith("<!DOCTYPE html>") and "<svg" in page and "rollouts.html" in summary


def test_pipeline_stops_at_the_failed_stage(tmp_path):
    p = run_script(
        "scripts/pipeline.py", "--model", str(tmp_path / "no-such-model"), "--budget", "tiny", "--out-dir", tmp_path
    )
    assert p.returncode != 0 and "stage 01 (01_rubric_sft.py) failed with exit code 2" in p.stderr
    assert not list(only_run(tmp_path).glob("01-sft-*"))  # the stage left no run folder


if __name__ == "__main__":
    sys.exit("run with pytest")

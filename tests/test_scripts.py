"""03_rollout.py and 04_mica_train.py run as a user runs them (subprocess, tiny random model)."""

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import JUDGE_OK, USER_OK, LoopbackServer, ok, request_kind, run_script

TINY = ["--max-new-tokens", "6", "--max-turns", "2", "--no-progress"]


def metrics(run_dir):
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def only_run(out_dir):
    runs = [p for p in Path(out_dir).iterdir() if p.is_dir()]
    assert len(runs) == 1, runs
    return runs[0]


def test_rollout_script_prints_and_writes(tiny_model, tmp_path):
    p = run_script(
        "03_rollout.py", "--model", tiny_model, "--num-scenarios", "2", "--k", "2", "--out-dir", tmp_path, *TINY
    )
    assert p.returncode == 0, p.stderr[-3000:]
    assert "=== test-01 k=0" in p.stdout and "assistant:" in p.stdout
    recs = [json.loads(line) for line in (only_run(tmp_path) / "rollouts.jsonl").read_text().splitlines()]
    assert len(recs) == 4
    for r in recs:
        assert r["outcome"] in ("timeout", "success", "failure")
        assert 1 <= len(r["turns"]) <= 2
        t = r["turns"][0]
        assert set(t) >= {"user", "assistant", "v", "state", "distance", "reward", "cut_off", "judge_failed"}
        assert t["state"] == [a + b for a, b in zip(r["p0"], t["v"])]


def test_train_script_end_to_end_and_adapter_loads(tiny_model, tmp_path):
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
        "--save-every",
        "1",
        "--out-dir",
        tmp_path,
        "--log-kl-every",
        "1",
        "--lr",
        "1e-2",
        *TINY,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    run = only_run(tmp_path)
    m = metrics(run)
    assert [x["step"] for x in m] == [1, 2]
    for key in (
        "reward_mean",
        "return_mean",
        "success_rate",
        "final_distance",
        "loss",
        "clip_frac",
        "kl",
        "judge_failures",
        "gen_tokens_per_s",
        "train_tokens_per_s",
    ):
        assert key in m[0]
    assert m[1]["kl"] > 0  # the adapter moved away from the base
    rollouts = (run / "rollouts.jsonl").read_text().splitlines()
    assert len(rollouts) == 2 * 2 * 2 and "advantage" in json.loads(rollouts[0])["turns"][0]
    assert torch.load(run / "checkpoint.pt", weights_only=True)["step"] == 2  # --save-every 1: the last
    args = json.loads((run / "args.json").read_text())
    assert args["advantage"] == "mica" and args["alpha"] == 0.4
    # the final adapter is a standard peft adapter
    code = (
        "import sys, torch; from transformers import AutoModelForCausalLM; from peft import PeftModel; "
        "b = AutoModelForCausalLM.from_pretrained(sys.argv[1]); m = PeftModel.from_pretrained(b, sys.argv[2]); "
        "print('loaded', sum(p.numel() for n, p in m.named_parameters() if 'lora' in n))"
    )
    q = subprocess.run([sys.executable, "-c", code, tiny_model, str(run / "adapter")], capture_output=True, text=True)
    assert q.returncode == 0 and "loaded" in q.stdout, q.stderr[-2000:]


def test_train_script_same_seed_same_run(tiny_model, tmp_path):
    """Two runs of one seed on one machine agree bit for bit: every step's sampling is seeded by
    (seed, step), so step k+1's dialogues match only if step k's update did. Which credit pictures are
    drawn (the second run: --credit-steps 3) does not change the run."""
    runs = []
    for i in range(2):
        p = run_script(
            "04_mica_train.py",
            "--model",
            tiny_model,
            "--steps",
            "4",
            "--scenarios-per-step",
            "2",
            "--k",
            "2",
            "--lr",
            "1e-2",
            "--seed",
            "0",
            "--out-dir",
            tmp_path / f"r{i}",
            *TINY,
            *(["--credit-steps", "3"] if i else []),
        )
        assert p.returncode == 0, p.stderr[-3000:]
        runs.append(only_run(tmp_path / f"r{i}"))
    assert [sorted(x.name for x in r.glob("credit_step*.png")) for r in runs] == [
        ["credit_step1.png", "credit_step4.png"],
        ["credit_step3.png"],
    ]
    a, b = [[json.loads(x) for x in (r / "rollouts.jsonl").read_text().splitlines()] for r in runs]
    assert len(a) == 4 * 2 * 2
    assert [[t["assistant"] for t in r["turns"]] for r in a] == [[t["assistant"] for t in r["turns"]] for r in b]
    assert [r["return"] for r in a] == [r["return"] for r in b]
    ma, mb = metrics(runs[0]), metrics(runs[1])
    assert any(m["loss"] != 0 for m in ma[:3])  # an update before the last rollout moved the weights
    for key in ("reward_mean", "return_mean", "loss", "clip_frac"):
        assert [m[key] for m in ma] == [m[key] for m in mb], key


@pytest.mark.parametrize("advantage", ["grpo", "reinforce_pp"])
def test_train_script_other_estimators(tiny_model, tmp_path, advantage):
    p = run_script(
        "04_mica_train.py",
        "--model",
        tiny_model,
        "--steps",
        "1",
        "--scenarios-per-step",
        "2",
        "--k",
        "2",
        "--advantage",
        advantage,
        "--update-epochs",
        "2",
        "--minibatch-size",
        "2",
        "--micro-batch-size",
        "1",
        "--kl-coef",
        "0.05",
        "--gradient-checkpointing",
        "--lora-targets",
        "q_proj,v_proj",
        "--out-dir",
        tmp_path,
        *TINY,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    m = metrics(only_run(tmp_path))[0]
    assert m["kl"] == m["kl"] and m["token_passes"] > 0  # not NaN: the reference was computed


def test_rollout_with_api_judge_and_user_on_a_loopback_server(tiny_model, tmp_path):
    """03 against an OpenAI-compatible server on 127.0.0.1: an LLM judge that sometimes answers with
    garbage (retried, then judge_failed) and an LLM user; the key reaches the server, never the files."""
    calls = {"judge": 0, "user": 0}

    def respond(index, body):  # called under the server's lock
        kind = request_kind(body)
        calls[kind] += 1
        # every third judge call is malformed; a case asked three times in a row fails
        if kind == "judge":
            return ok("I think it was fine." if calls["judge"] % 3 == 0 else JUDGE_OK)
        return ok(USER_OK)

    with LoopbackServer(respond) as server:
        p = run_script(
            "03_rollout.py",
            "--model",
            tiny_model,
            "--num-scenarios",
            "2",
            "--k",
            "2",
            "--judge",
            "api:judge-model",
            "--user",
            "api:user-model",
            "--judge-retries",
            "1",
            "--api-base",
            server.base,
            "--out-dir",
            tmp_path,
            *TINY,
            env_extra={"OPENAI_API_KEY": "sk-test-secret-42"},
        )
    assert p.returncode == 0, p.stderr[-3000:]
    assert calls["judge"] >= 8 and calls["user"] >= 1 and server.auth == {"Bearer sk-test-secret-42"}
    recs = [json.loads(x) for x in (only_run(tmp_path) / "rollouts.jsonl").read_text().splitlines()]
    turns = [t for r in recs for t in r["turns"]]
    judged = [t for t in turns if not t["judge_failed"]]
    assert judged and all(t["v"] == [1.0, 1.0, 0.0] for t in judged)
    for t in turns:
        if t["judge_failed"]:
            assert t["v"] is None and t["levels"] is None
    users = [t["user"] for r in recs for t in r["turns"][1:]]
    assert users and all(u == USER_OK for u in users)
    for f in only_run(tmp_path).rglob("*"):
        if f.is_file():
            assert "sk-test-secret-42" not in f.read_text(errors="ignore"), f
    assert "sk-test-secret-42" not in p.stdout + p.stderr


def test_unreachable_judge_stops_with_one_message(tiny_model, tmp_path):
    import socket

    with socket.socket() as s:  # a port on which nothing listens
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    p = run_script(
        "04_mica_train.py",
        "--model",
        tiny_model,
        "--steps",
        "2",
        "--scenarios-per-step",
        "1",
        "--k",
        "2",
        "--judge",
        "api:judge",
        "--api-base",
        f"http://127.0.0.1:{port}/v1",
        "--api-retries",
        "1",
        "--api-timeout",
        "2",
        "--out-dir",
        tmp_path,
        *TINY,
    )
    assert p.returncode == 2, p.stderr[-2000:]
    assert "judge api:judge: no usable answer for any of 2 replies; the endpoint failed" in p.stderr
    assert "Traceback" not in p.stderr


def test_rewards_experiment_table_and_resume(tiny_model, tmp_path):
    """experiments/rewards.py trains and evaluates every (estimator, reward) cell, writes the table, and a
    rerun skips the cells already in results.jsonl."""
    flags = [
        "--model",
        tiny_model,
        "--seeds",
        "0",
        "--estimators",
        "mica,grpo",
        "--rewards",
        "rlver",
        "--steps",
        "1",
        "--eval-k",
        "1",
        "--max-turns",
        "2",
        "--max-new-tokens",
        "4",
        "--train-args",
        "--k 2 --scenarios-per-step 1",
        "--eval-args",
        "--load-in-4bit off --max-context 512",
        "--out-dir",
        tmp_path,
    ]
    p = run_script("experiments/rewards.py", *flags, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    rows = [json.loads(x) for x in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert [(r["estimator"], r["reward"]) for r in rows] == [("base", "-"), ("mica", "rlver"), ("grpo", "rlver")]
    for r in rows:
        assert r["n"] == 8 and 0 <= r["success"] <= 1 and 0 <= r["final_emotion"] <= 100 and r["final_distance"] > 0
        assert 0 <= r["collapses"] <= r["n"] and 0 <= r["cut_off"] <= 1
    base_run = next(tmp_path.glob("eval-base-s0-*"))
    assert json.loads((base_run / "args.json").read_text())["max_context"] == 512  # --eval-args reached 03
    base_recs = [json.loads(x) for x in (base_run / "rollouts.jsonl").read_text().splitlines()]
    cut = [sum(t["cut_off"] for t in rec["turns"]) / len(rec["turns"]) for rec in base_recs]  # per dialogue
    assert rows[0]["cut_off"] > 0.5 and abs(rows[0]["cut_off"] - sum(cut) / len(cut)) < 1e-9  # 4-token cap cuts
    assert rows[0]["collapses"] == sum(rec["outcome"] == "failure" for rec in base_recs)
    table = (tmp_path / "rewards.md").read_text()
    assert "| MICA | rlver |" in table and "| GRPO | rlver |" in table and "| base (untrained) | - |" in table
    assert "| collapses | cut-off share |" in table and "| MICA s0 | rlver |" in table  # per-seed rows
    again = run_script("experiments/rewards.py", *flags, timeout=120)
    assert again.returncode == 0 and "$ " not in again.stdout  # nothing rerun
    assert len((tmp_path / "results.jsonl").read_text().splitlines()) == 3
    # seed 1 and REINFORCE++ never ran
    report = run_script(
        "experiments/rewards.py",
        *flags[:-2],
        "--seeds",
        "0,1",
        "--estimators",
        "mica,grpo,reinforce_pp",
        "--report-only",
        "--out-dir",
        tmp_path,
        timeout=60,
    )
    assert report.returncode == 0 and "$ " not in report.stdout
    assert "| MICA (1 of 2 seeds) | rlver |" in report.stdout and "REINFORCE++" not in report.stdout
    bad = run_script("experiments/rewards.py", "--rewards", "idr+care", "--out-dir", tmp_path, timeout=60)
    assert bad.returncode == 2 and "--rubric-model" in bad.stderr


def test_care_experiment_table_and_resume(tiny_model, tmp_path):
    """experiments/care.py runs untrained, SFT and RL per seed through 01 and 02, tabulates their own
    report.json numbers, and a rerun reuses every finished stage."""
    flags = [
        "--model",
        tiny_model,
        "--seeds",
        "0,1",
        "--sft-steps",
        "1",
        "--rl-steps",
        "1",
        "--report-limit",
        "2",
        "--extra-sft",
        "--batch-size 2 --micro-batch-size 2 --eval-every 100 --eval-limit 1 --max-new-tokens 8",
        "--extra-rl",
        "--contexts-per-step 1 --g 2 --max-new-tokens 8",
        "--out-dir",
        tmp_path,
    ]
    p = run_script("experiments/care.py", *flags, timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert p.stdout.count("$ ") == 5  # untrained once, then SFT and RL per seed
    names = sorted(d.name.rsplit("-", 2)[0] for d in tmp_path.iterdir() if d.is_dir())
    assert names == ["rl-s0", "rl-s1", "sft-s0", "sft-s1", "untrained"]
    for d in tmp_path.glob("rl-s*"):
        rep = json.loads((d / "report.json").read_text())
        assert json.loads((d / "args.json").read_text())["max_new_tokens"] == 8
        for side in ("before", "after"):
            assert 0 <= rep[side]["recovery_acc"] <= 1 and 0 <= rep[side]["parse_valid"] <= 1
    table = (tmp_path / "care.md").read_text()
    assert "| untrained | " in table and "| SFT (mean ± sd over 2 seeds) | " in table
    assert "| RL (mean ± sd over 2 seeds) | " in table and "| 1 | " in table
    # the paired RL - SFT line: d_s per seed, mean ± 12.706 sd / sqrt(2) (t with 1 degree of freedom)
    reps = [json.loads((next(tmp_path.glob(f"rl-s{s}-*")) / "report.json").read_text()) for s in (0, 1)]
    d = [r["after"]["recovery_acc"] - r["before"]["recovery_acc"] for r in reps]
    mean, half = sum(d) / 2, 12.706 * abs(d[0] - d[1]) / math.sqrt(2) / math.sqrt(2)
    line = re.search(
        r"RL - SFT accuracy, paired by seed: (\S+), 95% t interval over 2 seeds \[(\S+), (\S+)\]: (.+)", table
    )
    assert line, table
    assert [float(x) for x in line.groups()[:3]] == pytest.approx([mean, mean - half, mean + half], abs=6e-4)
    assert line.group(4) == (
        "not separated" if mean - half <= 0 <= mean + half else "RL ahead of SFT" if mean > 0 else "RL behind SFT"
    )
    again = run_script("experiments/care.py", *flags, timeout=120)
    assert again.returncode == 0 and "$ " not in again.stdout  # every stage reused
    bad = run_script(
        "experiments/care.py", "--model", tmp_path / "no-such-model", "--out-dir", tmp_path / "x", timeout=120
    )
    assert bad.returncode == 1 and "FAILED (2)" in bad.stdout and "Traceback" not in bad.stderr
    assert "error: a run failed with exit code 2" in bad.stderr

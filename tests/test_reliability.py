"""Reliability: endpoint faults, kill -9 and resume, bad input, degenerate training signals, secrets.

Each test runs the scripts as a user would (subprocess) on the tiny random model; the LLM judge and
user live on a loopback server (conftest.FaultServer) that injects faults at a set rate."""

import importlib
import json
import math
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from accelerate import Accelerator

import common
import options
import runs
from conftest import FAULTS, ROOT, policy_args, run_script, write_jsonl

TINY = ["--max-new-tokens", "6", "--max-turns", "2", "--no-progress"]
KEY = "sk-reliability-secret-7"


def only_run(out_dir):
    runs = [p for p in Path(out_dir).iterdir() if p.is_dir()]
    assert len(runs) == 1, runs
    return runs[0]


def lines(path):
    return [json.loads(x) for x in Path(path).read_text().splitlines()]


def api_flags(server, timeout="1"):
    return [
        "--judge",
        "api:judge",
        "--user",
        "api:user",
        "--api-base",
        server.base,
        "--api-timeout",
        timeout,
        "--api-retries",
        "3",
    ]


def assert_no_secret(run_dir, p):
    for f in Path(run_dir).rglob("*"):
        if f.is_file():
            assert KEY.encode() not in f.read_bytes(), f
    assert KEY not in p.stdout + p.stderr


# ---------------------------------------------------------------------------------------------
# 1. endpoint faults
# ---------------------------------------------------------------------------------------------
def test_rollout_completes_through_30_percent_faults(tiny_model, tmp_path, fault_server):
    server = fault_server(rate=0.3, hang_s=1.6)
    p = run_script(
        "03_rollout.py",
        "--model",
        tiny_model,
        "--num-scenarios",
        "4",
        "--k",
        "2",
        "--quiet",
        *api_flags(server),
        "--out-dir",
        tmp_path,
        *TINY,
        env_extra={"OPENAI_API_KEY": KEY},
    )
    assert p.returncode == 0, p.stderr[-3000:]
    recs = lines(only_run(tmp_path) / "rollouts.jsonl")
    assert len(recs) == 8
    assert server.requests >= 20 and sum(server.faults.values()) >= 0.25 * server.requests
    assert all(server.faults[f] >= 1 for f in FAULTS), server.faults  # every kind was injected
    turns = [t for r in recs for t in r["turns"]]
    # retried faults still end in judged turns; the few that fail for good are flagged, state unchanged
    assert sum(not t["judge_failed"] for t in turns) >= 0.8 * len(turns)
    assert all(t["v"] == [1.0, 1.0, 0.0] for t in turns if not t["judge_failed"])
    assert "retries" in p.stdout  # the summary counts them
    assert server.auth == {f"Bearer {KEY}"}
    assert_no_secret(only_run(tmp_path), p)


def test_training_completes_through_faults_and_logs_the_counts(tiny_model, tmp_path, fault_server):
    server = fault_server(rate=0.3, hang_s=1.6)
    p = run_script(
        "04_mica_train.py",
        "--model",
        tiny_model,
        "--steps",
        "3",
        "--scenarios-per-step",
        "2",
        "--k",
        "2",
        "--save-every",
        "1",
        *api_flags(server),
        "--out-dir",
        tmp_path,
        *TINY,
        env_extra={"OPENAI_API_KEY": KEY},
    )
    assert p.returncode == 0, p.stderr[-3000:]
    run = only_run(tmp_path)
    m = lines(run / "metrics.jsonl")
    assert [x["step"] for x in m] == [1, 2, 3]
    for key in (
        "judge_api_retries",
        "judge_api_failed_calls",
        "user_api_retries",
        "user_api_failed_calls",
        "judge_failures",
        "user_failures",
        "degenerate_groups",
        "optimizer_steps",
        "nonfinite_grads",
    ):
        assert key in m[0], key
    retries = sum(x["judge_api_retries"] + x["user_api_retries"] for x in m)
    assert retries >= sum(server.faults.values()) - 2  # each fault costs a retry (the last may not)
    assert all(x["loss"] is not None and x["grad_norm"] is not None for x in m)  # no NaN reached the loss
    recs = lines(run / "rollouts.jsonl")
    assert sum(x["judge_failures"] for x in m) == sum(t["judge_failed"] for r in recs for t in r["turns"])
    assert (run / "adapter" / "adapter_model.safetensors").exists() and not list(run.rglob("*.bin"))
    assert_no_secret(run, p)


def test_eval_completes_through_30_percent_faults(tiny_model, tmp_path, fault_server):
    from benchmarks import eqbench3

    eq = json.dumps({c: 12 for c in eqbench3.ROLEPLAY_CRITERIA + eqbench3.ANALYSIS_CRITERIA})
    server = fault_server(
        rate=0.3, hang_s=1.6, answers=[("EQ-Bench 3 task", eq), ("SAGE protocol", '{"analysis": "ok", "change": 5}')]
    )
    p = run_script(
        "05_eval.py",
        "--model",
        tiny_model,
        "--suite",
        "empa,eqbench3,sage",
        "--max-turns",
        "2",
        "--min-turns",
        "1",
        "--sage-turns",
        "2",
        "--max-new-tokens",
        "6",
        "--max-cases",
        "3",
        "--no-progress",
        *api_flags(server),
        "--out-dir",
        tmp_path,
        env_extra={"OPENAI_API_KEY": KEY},
    )
    assert p.returncode == 0, p.stderr[-3000:]
    assert sum(server.faults.values()) >= 7 and all(server.faults[f] >= 1 for f in FAULTS), server.faults
    recs = lines(only_run(tmp_path) / "cases.jsonl")
    assert {r["suite"] for r in recs} == {"empa", "eqbench3", "sage"} and len(recs) == 9
    assert sum(not r.get("failed") for r in recs) >= 7  # retries carried nearly all
    assert all(r["score"] == 60.0 for r in recs if r["suite"] == "eqbench3" and not r.get("failed"))
    assert_no_secret(only_run(tmp_path), p)


def test_endpoint_going_down_mid_run_stops_after_saving(tiny_model, tmp_path, fault_server):
    server = fault_server(rate=0.0)
    cmd = [
        "--model",
        tiny_model,
        "--steps",
        "4",
        "--scenarios-per-step",
        "1",
        "--k",
        "2",
        "--save-every",
        "10",
        *api_flags(server),
        "--api-retries",
        "1",
        "--out-dir",
        tmp_path,
        *TINY,
    ]
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "04_mica_train.py"), *map(str, cmd)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.time() + 300
    while time.time() < deadline and not list(Path(tmp_path).glob("*/metrics.jsonl")):
        time.sleep(0.05)
    server.down = True  # every call from now on: HTTP 500
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 2, err[-3000:]
    assert "endpoint failed after its retries" in err or "after its retries" in err
    assert "Traceback" not in err
    run = only_run(tmp_path)
    done = lines(run / "metrics.jsonl")[-1]["step"]
    assert done >= 1 and torch.load(run / "checkpoint.pt", weights_only=True)["step"] == done
    assert f"--resume {run}" in err


# ---------------------------------------------------------------------------------------------
# 2. crash safety: kill -9 at random points, resume, same numbers as an uninterrupted run
# ---------------------------------------------------------------------------------------------
def test_several_random_kills_then_resume_equal_an_uninterrupted_run(tiny_model, tmp_path):
    base = [
        "--model",
        tiny_model,
        "--steps",
        "6",
        "--scenarios-per-step",
        "2",
        "--k",
        "2",
        "--save-every",
        "1",
        "--seed",
        "3",
        *TINY,
    ]
    full = run_script("04_mica_train.py", *base, "--out-dir", tmp_path / "full")
    assert full.returncode == 0, full.stderr[-3000:]
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    rng = random.Random(7)
    run = None
    for kill_after_step in (1, 3, 5):  # kill three times, later each time
        extra = ["--resume", str(run)] if run else ["--out-dir", str(tmp_path / "cut")]
        proc = subprocess.Popen(
            [sys.executable, str(ROOT / "04_mica_train.py"), *map(str, base), *extra],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.time() + 300
        while time.time() < deadline and proc.poll() is None:
            m = list((tmp_path / "cut").glob("*/metrics.jsonl"))
            if m and m[0].read_text().count("\n") >= kill_after_step:
                break
            time.sleep(0.02)
        time.sleep(rng.uniform(0.0, 0.4))  # somewhere in the next rollout, update or save
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        run = only_run(tmp_path / "cut")
        if (run / "checkpoint.pt").exists():  # a visible checkpoint is always complete
            state = torch.load(run / "checkpoint.pt", weights_only=True)
            assert {"step", "adapter", "optimizer", "scheduler"} <= set(state) and state["adapter"]
    res = run_script("04_mica_train.py", *base, "--resume", run)
    assert res.returncode == 0, res.stderr[-3000:]
    want = {m["step"]: m for m in lines(only_run(tmp_path / "full") / "metrics.jsonl")}
    got = {m["step"]: m for m in lines(run / "metrics.jsonl")}  # later lines win: the re-run steps
    assert set(got) == set(range(1, 7))
    for step in range(1, 7):
        for key in ("reward_mean", "return_mean", "loss", "final_distance", "grad_norm"):
            assert got[step][key] == want[step][key], (step, key)
    for rec in lines(run / "rollouts.jsonl"):  # the rollouts file stays readable line by line
        assert 1 <= rec["step"] <= 6


def test_a_torn_last_line_is_cut_on_resume(tmp_path):

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 0.5}\n{"step": 2, "lo')
    assert runs.repair_jsonl_tail(path) == len('{"step": 2, "lo')
    assert path.read_text() == '{"step": 1, "loss": 0.5}\n'
    assert runs.repair_jsonl_tail(path) == 0  # a clean file is left alone
    runs.append_jsonl(path, {"step": 2, "loss": 0.25})
    assert [json.loads(x)["step"] for x in path.read_text().splitlines()] == [1, 2]


# ---------------------------------------------------------------------------------------------
# 3. bad input
# ---------------------------------------------------------------------------------------------
SCEN = {"id": "s1", "persona": "a nurse", "situation": "night shifts", "opening": "I am so tired.", "p0": [-4, -6, -2]}


@pytest.mark.parametrize("script", ["03_rollout.py", "04_mica_train.py"])
@pytest.mark.parametrize(
    "records, message",
    [
        (['{"id": "s1", "persona": "x"'], "bad.jsonl:1: not valid JSON"),
        ([SCEN, {**SCEN, "id": "s2", "opening": 42}], "bad.jsonl:2: field 'opening' must be str"),
        ([{k: v for k, v in SCEN.items() if k != "persona"}], "bad.jsonl:1: missing field 'persona'"),
        ([{**SCEN, "opening": "   "}], "bad.jsonl:1: field 'opening' is empty"),
        ([{**SCEN, "p0": [-1, "a", 0]}], "bad.jsonl:1: field 'p0' must be a list of 3 numbers"),
        ([], "bad.jsonl: no records"),
    ],
)
def test_bad_scenarios_exit_2_naming_file_and_line(tmp_path, capsys, script, records, message):
    """Each stage's main as its __main__ runs it (common.run_main), in this process (the import paid once);
    test_a_bad_scenarios_file_exits_2_from_the_command_line runs one case as a separate process."""
    bad = tmp_path / "bad.jsonl"
    bad.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    out = tmp_path / "runs"
    main = importlib.import_module(script.removesuffix(".py")).main
    with pytest.raises(SystemExit) as exit_:
        common.run_main(main, ["--scenarios", str(bad), "--out-dir", str(out)])
    err = capsys.readouterr().err
    assert exit_.value.code == 2, err[-2000:]
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert not out.exists() or not any(out.iterdir())  # nothing written


@pytest.mark.parametrize("script", ["03_rollout.py", "04_mica_train.py"])
def test_a_bad_scenarios_file_exits_2_from_the_command_line(tmp_path, script):
    """The same as a user sees it: a separate process, exit code 2, one line naming file and line."""
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(SCEN) + "\n" + json.dumps({**SCEN, "id": "s2", "opening": 42}) + "\n")
    out = tmp_path / "runs"
    p = run_script(script, "--scenarios", bad, "--out-dir", out)
    assert p.returncode == 2, p.stderr[-2000:]
    assert "bad.jsonl:2: field 'opening' must be str" in p.stderr and len(p.stderr.strip().splitlines()) == 1
    assert "Traceback" not in p.stderr and (not out.exists() or not any(out.iterdir()))  # nothing written


BAD_FLAGS = [  # (script, flags, the one message it exits 2 with)
    ("02_rubric_pref_rl.py", ["--g", "1"], "argument --g: must be >= 2, got 1"),
    ("02_rubric_pref_rl.py", ["--margin-tau", "0"], "argument --margin-tau: must be > 0, got 0"),
    ("02_rubric_pref_rl.py", ["--judge", "gpt"], "--judge must be embed"),
    (
        "02_rubric_pref_rl.py",
        ["--minibatch-size", "6"],
        "--minibatch-size must be a multiple of --g (a minibatch holds whole contexts), got 6 and 4",
    ),
    ("02_rubric_pref_rl.py", ["--train", "nope.jsonl"], "nope.jsonl: no such file"),
    ("01_rubric_sft.py", ["--steps", "0"], "argument --steps: must be >= 1, got 0"),
    ("01_rubric_sft.py", ["--lr", "x"], "argument --lr: invalid float value: 'x'"),
    ("04_mica_train.py", ["--credit-steps", "1", "x"], "argument --credit-steps: invalid int value: 'x'"),
    ("04_mica_train.py", ["--steps", "3", "--credit-steps", "4"], "--credit-steps must lie in 1..--steps 3"),
    ("03_rollout.py", ["--k", "0"], "argument --k: must be >= 1, got 0"),
    ("03_rollout.py", ["--top-p", "2"], "argument --top-p: must be <= 1, got 2"),
    ("03_rollout.py", ["--temperature", "-1"], "argument --temperature: must be >= 0, got -1"),
    ("03_rollout.py", ["--api-timeout", "0"], "argument --api-timeout: must be > 0, got 0"),
    ("03_rollout.py", ["--api-retries", "-1"], "argument --api-retries: must be >= 0, got -1"),
    ("03_rollout.py", ["--max-context", "10"], "--max-context must be larger than --max-new-tokens"),
    ("03_rollout.py", ["--user", "gpt"], "--user must be scripted"),
    ("03_rollout.py", ["--model", "no-such-org/no-such-model-xyz"], "hf download no-such-org/no-such-model-xyz"),
    ("03_rollout.py", ["--adapter", "/no/such/adapter"], "--adapter /no/such/adapter: no adapter_config.json there"),
    ("04_mica_train.py", ["--alpha", "1.5"], "argument --alpha: must be <= 1, got 1.5"),
    ("04_mica_train.py", ["--k", "1"], "--k must be >= 2"),
    ("04_mica_train.py", ["--advantage", "reinforce_pp", "--k", "1"], "--k must be >= 2"),
    ("04_mica_train.py", ["--top-p", "0.9"], "--top-p must be 1 for training (the loss scores the whole distribution)"),
    ("04_mica_train.py", ["--temperature", "0"], "--temperature must be > 0 for training"),
    (
        "04_mica_train.py",
        ["--advantage", "ppo"],
        "--advantage: unknown estimator 'ppo'; choose from mica, grpo, reinforce_pp",
    ),
    (
        "04_mica_train.py",
        ["--minibatch-size", "6"],
        "--minibatch-size must be a multiple of --k x the number of processes (4 x 1)",
    ),
    ("04_mica_train.py", ["--gamma", "-0.1"], "argument --gamma: must be >= 0, got -0.1"),
    ("04_mica_train.py", ["--idr-weights", "1", "-1", "1"], "argument --idr-weights: must be >= 0, got -1"),
    ("04_mica_train.py", ["--scenarios", "nope.jsonl"], "nope.jsonl: no such file"),
    ("04_mica_train.py", ["--judge", "gpt4"], "--judge must be embed"),
    ("04_mica_train.py", ["--model", "/no/such/folder-xyz"], "model '/no/such/folder-xyz' could not be loaded"),
    ("04_mica_train.py", ["--resume", "/no/such/run"], "not a run folder"),
]


@pytest.mark.parametrize("script, flags, message", BAD_FLAGS)
def test_bad_flags_exit_2_with_one_message(tmp_path, capsys, script, flags, message):
    """Each stage's main as its __main__ runs it (common.run_main), in this process: the import is paid once,
    not per flag; the exit code, the one line and the empty folder are the same (a subprocess per stage below)."""
    main = importlib.import_module(script.removesuffix(".py")).main
    with pytest.raises(SystemExit) as exit_:
        common.run_main(main, ["--out-dir", str(tmp_path), *map(str, flags)])
    err = capsys.readouterr().err
    assert exit_.value.code == 2, err[-2000:]
    assert message in err and "Traceback" not in err
    assert not any(Path(tmp_path).iterdir())  # nothing written for a rejected run


@pytest.mark.parametrize("script", sorted({script for script, _, _ in BAD_FLAGS}))
def test_a_bad_flag_exits_2_from_the_command_line(tmp_path, script):
    """The same as a user sees it: a separate process, exit code 2, one line, no traceback."""
    flags, message = next((f, m) for s, f, m in BAD_FLAGS if s == script)
    p = run_script(script, "--out-dir", tmp_path, *flags)
    assert p.returncode == 2, (p.returncode, p.stderr[-2000:])
    assert message in p.stderr and "Traceback" not in p.stderr
    assert not any(Path(tmp_path).iterdir())


def test_a_1mb_message_is_cut_with_a_warning(tiny_model, tmp_path):
    big = {**SCEN, "opening": "I keep going over it. " * 48_000 + "What do I do now?"}  # ~1 MB
    assert len(big["opening"]) > 1_000_000
    scen = write_jsonl(tmp_path / "big.jsonl", [big])
    p = run_script(
        "03_rollout.py",
        "--model",
        tiny_model,
        "--scenarios",
        scen,
        "--k",
        "2",
        "--quiet",
        "--max-context",
        "256",
        "--out-dir",
        tmp_path / "runs",
        *TINY,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    assert "warning: scenario s1 (" in p.stderr and "big.jsonl:1" in p.stderr and "cut to its last" in p.stderr
    recs = lines(only_run(tmp_path / "runs") / "rollouts.jsonl")
    assert len(recs) == 2 and recs[0]["turns"][0]["user"].endswith("What do I do now?")
    assert len(recs[0]["turns"][0]["user"]) < 2_000


def test_a_huge_user_message_is_cut_with_a_warning(tiny_model, tmp_path, fault_server):
    server = fault_server(rate=0.0, user_answer="no. " * 300_000)  # 1.2 MB from the user LLM (stripped: 1,199,999)
    p = run_script(
        "03_rollout.py",
        "--model",
        tiny_model,
        "--num-scenarios",
        "1",
        "--k",
        "2",
        "--quiet",
        "--user",
        "api:user",
        "--api-base",
        server.base,
        "--out-dir",
        tmp_path,
        *TINY,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    assert "warning: a simulated-user message of 1,199,999 characters was cut" in p.stderr
    recs = lines(only_run(tmp_path) / "rollouts.jsonl")
    assert all(len(t["user"]) <= 2000 for r in recs for t in r["turns"])


# ---------------------------------------------------------------------------------------------
# 4. degenerate training signals
# ---------------------------------------------------------------------------------------------
def test_all_equal_rewards_are_counted_and_teach_nothing(tiny_model, tmp_path, fault_server):
    flat = json.dumps({a: {"progress": 0, "negative": 0} for a in "CAP"})
    server = fault_server(rate=0.0, judge_answer=flat)  # every reply: v = 0, so every reward is 0
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
        "--judge",
        "api:judge",
        "--api-base",
        server.base,
        "--cut-off-penalty",
        "0",
        "--out-dir",
        tmp_path,
        *TINY,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    for m in lines(only_run(tmp_path) / "metrics.jsonl"):
        assert m["degenerate_groups"] == 2
        assert m["loss"] == 0.0 and (m["nonfinite_grads"], m["optimizer_steps"]) == (0, 1)


def test_nothing_to_score_skips_the_update_without_nan(trainer, env, tiny_model):
    """Every turn failed (or empty): the update is skipped and counted; the weights stay finite; the schedule still
    steps, and torch's warning that it stepped before the optimizer (a user's stderr, every step whose verdicts all
    failed, as SmolLM2 judging itself) is not printed."""
    import argparse
    import warnings

    import common

    args = policy_args(
        tiny_model,
        minibatch_size=4,
        micro_batch_size=2,
        update_epochs=1,
        temperature=1.0,
        kl_coef=0.0,
        tis_cap=0.0,
    )
    model, tok = common.load_policy(args, trainable=True)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    ids = tok("hello there")["input_ids"]
    failed = env.Trajectory(
        scenario={}, k=0, ids=ids + ids, messages=[], spans=[(len(ids), 2 * len(ids))], vs=[None]
    )  # the judge failed on its one turn
    empty = env.Trajectory(
        scenario={}, k=1, ids=list(ids), messages=[], spans=[(len(ids), len(ids))], vs=[[0.0, 0.0, 0.0]]
    )  # an empty reply: no tokens
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        out = trainer.policy_update(
            model, tok, opt, sched, trainer.as_samples([failed, empty], [[1.0], [-1.0]]), args, Accelerator()
        )
    assert not [w for w in said if "lr_scheduler.step()" in str(w.message)], [str(w.message) for w in said]
    assert (out["optimizer_steps"], out["token_passes"]) == (0, 0)
    assert all(math.isnan(out[k]) for k in ("loss", "clip_frac", "grad_norm"))  # nothing measured: NaN, not 0
    assert sched.last_epoch == 1  # the schedule still follows the steps
    assert all(torch.isfinite(p).all() for p in model.parameters())
    # a non-finite reward (e.g. a broken custom judge) is replaced, so no NaN reaches the advantages
    tr = env.Trajectory(
        scenario={},
        k=0,
        ids=[],
        messages=[],
        spans=[(0, 1), (1, 2)],
        states=[[-4.0, -4.0, -4.0], [-2.0, -2.0, -2.0], [float("-inf"), -4.0, -4.0]],  # turn 2's state: -inf
        vs=[[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]],
        cut_off=[False, False],
    )
    targs = argparse.Namespace(
        idr_weights=(1, 1, 1),
        eps=1.0,
        cut_off_penalty=0.0,
        reward_weights={"idr": 1.0},
        kardia_format=False,
        care_distance="plain",
    )
    r, failed = trainer.turn_rewards(trainer.reward_parts([tr], targs, None)[0][0], tr, targs)
    assert all(x == x and abs(x) < 1e9 for x in r) and failed == [False, True]  # the non-finite turn: failed
    assert r[1] == r[0] > 0  # filled with the dialogue's mean valid reward
    A, _ = trainer.ADVANTAGES["mica"]([[r, [0.5, 0.1]]], None, argparse.Namespace(alpha=0.4, gamma=0.85))
    assert all(a == a and abs(a) < 1e9 for row in A[0] for a in row)


# ---------------------------------------------------------------------------------------------
# 5. secrets and loading
# ---------------------------------------------------------------------------------------------
def test_loading_is_safe_by_default():
    """Every torch.load in the project passes weights_only=True; trust_remote_code is off unless the
    flag asks for it; weights are written as safetensors (no pickled .bin anywhere)."""
    import re

    sources = [p for p in ROOT.glob("*.py")] + list((ROOT / "experiments").glob("*.py"))
    for path in sources:
        text = path.read_text()
        for call in re.findall(r"torch\.load\([^)]*\)", text):
            assert "weights_only=True" in call, (path.name, call)
        assert "pickle" not in text and ".bin" not in text, path.name
        assert "trust_remote_code=True" not in text, path.name
    p = options.options_parser("", [("model", options.ModelOptions)])
    assert p.parse_args([]).trust_remote_code is False
    assert p.parse_args(["--trust-remote-code"]).trust_remote_code is True

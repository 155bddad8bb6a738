"""One short run on the real offline default: the packaged SmolLM2-135M-Instruct and MiniLM judge."""

import json
from pathlib import Path

from conftest import run_script


def test_smollm2_train_step_and_rollout(tmp_path):
    p = run_script(
        "04_mica_train.py",
        "--steps",
        "1",
        "--scenarios-per-step",
        "2",
        "--k",
        "2",
        "--max-turns",
        "2",
        "--max-new-tokens",
        "16",
        "--out-dir",
        tmp_path,
        "--no-progress",
        "--log-kl-every",
        "1",
        timeout=1500,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    run = next(Path(tmp_path).iterdir())
    m = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    assert m["token_passes"] > 0 and m["judge_failures"] == 0 and m["kl"] is not None
    recs = [json.loads(x) for x in (run / "rollouts.jsonl").read_text().splitlines()]
    assert len(recs) == 4 and all(r["turns"][0]["assistant"].strip() for r in recs)  # real text
    assert (run / "adapter" / "adapter_model.safetensors").exists()
    # the trained adapter samples through 03_rollout
    q = run_script(
        "03_rollout.py",
        "--adapter",
        run / "adapter",
        "--num-scenarios",
        "1",
        "--k",
        "1",
        "--max-turns",
        "1",
        "--max-new-tokens",
        "16",
        "--out-dir",
        tmp_path / "r",
        "--no-progress",
        timeout=1500,
    )
    assert q.returncode == 0, q.stderr[-3000:]
    assert "=== test-01 k=0" in q.stdout and "assistant:" in q.stdout


def test_the_packaged_model_is_converted_once_and_named_when_missing(tmp_path):
    """scripts/convert_smollm2.py into an empty cache: a complete plain-fp32 HF folder, no temporary folder
    left; run again, it does nothing; a stage asked for the model before it is converted says how to get it."""
    import os
    import subprocess
    import sys

    from conftest import ROOT

    env = dict(os.environ, EMPATHY_RL_CACHE=str(tmp_path / "cache"), HF_HUB_OFFLINE="1")
    p = run_script(
        "03_rollout.py",
        "--num-scenarios",
        "1",
        "--out-dir",
        tmp_path / "runs",
        env_extra={"EMPATHY_RL_CACHE": str(tmp_path / "cache")},
    )
    assert p.returncode == 2 and "scripts/convert_smollm2.py" in p.stderr and "Traceback" not in p.stderr
    runs = [
        subprocess.run(
            [sys.executable, str(ROOT / "scripts" / "convert_smollm2.py")],
            env=env,
            capture_output=True,
            text=True,
            timeout=900,
        )
        for _ in range(2)
    ]
    assert all(r.returncode == 0 for r in runs), runs[0].stderr[-2000:]
    assert "converting" in runs[0].stderr and "converting" not in runs[1].stderr  # once
    folder = tmp_path / "cache" / "SmolLM2-135M-Instruct"
    assert runs[0].stdout.strip() == runs[1].stdout.strip() == str(folder)
    config = json.loads((folder / "config.json").read_text())
    assert "quantization_config" not in config and config["num_hidden_layers"] == 30  # plain fp32 weights
    assert (folder / "model.safetensors").exists() and (folder / "tokenizer_config.json").exists()
    assert [p.name for p in (tmp_path / "cache").iterdir()] == ["SmolLM2-135M-Instruct"]  # no temporary folder

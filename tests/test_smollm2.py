"""One short run on the real offline default: the packaged SmolLM2-135M-Instruct and MiniLM judge."""
import json
from pathlib import Path

from conftest import run_script


def test_smollm2_train_step_and_rollout(tmp_path):
    p = run_script("04_mica_train.py", "--steps", "1", "--scenarios-per-step", "2", "--k", "2",
                   "--max-turns", "2", "--max-new-tokens", "16", "--out-dir", tmp_path, "--no-progress",
                   "--log-kl-every", "1", timeout=1500)
    assert p.returncode == 0, p.stderr[-3000:]
    run = next(Path(tmp_path).iterdir())
    m = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    assert m["train_tokens"] > 0 and m["judge_failures"] == 0 and m["kl"] is not None
    recs = [json.loads(x) for x in (run / "rollouts.jsonl").read_text().splitlines()]
    assert len(recs) == 4 and all(r["turns"][0]["assistant"].strip() for r in recs)   # real text
    assert (run / "adapter" / "adapter_model.safetensors").exists()
    # the trained adapter samples through 03_rollout
    q = run_script("03_rollout.py", "--adapter", run / "adapter", "--num-scenarios", "1", "--k", "1",
                   "--max-turns", "1", "--max-new-tokens", "16", "--out-dir", tmp_path / "r", "--no-progress",
                   timeout=1500)
    assert q.returncode == 0, q.stderr[-3000:]
    assert "=== test-01 k=0" in q.stdout and "assistant:" in q.stdout


def test_two_processes_convert_the_packaged_model_at_once(tmp_path):
    """The GGUF -> HF conversion into an empty cache, started by two processes together: both get the
    same complete folder (a file lock serialises them, the folder appears by an atomic rename)."""
    import os
    import subprocess
    import sys

    from conftest import ROOT

    code = ("import common, json; p = common.resolve_model('SmolLM2-135M-Instruct'); "
            "from transformers import AutoConfig; print('OK', p, AutoConfig.from_pretrained(p).num_hidden_layers)")
    env = dict(os.environ, EMPATHY_RL_CACHE=str(tmp_path / "cache"), HF_HUB_OFFLINE="1")
    procs = [subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=900) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-2000:]
        assert out.strip().endswith(" 30")                     # SmolLM2-135M has 30 layers
    assert outs[0][0] == outs[1][0]
    folder = tmp_path / "cache" / "SmolLM2-135M-Instruct"
    assert "quantization_config" not in json.loads((folder / "config.json").read_text())   # plain fp32 weights
    assert (folder / "model.safetensors").exists() and (folder / "tokenizer_config.json").exists()
    assert [p.name for p in (tmp_path / "cache").iterdir() if p.name.startswith(".SmolLM2")] == []

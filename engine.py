"""engine.py: an inference engine samples the policy (vLLM's OpenAI-compatible server), tokens in and tokens out.

With --engine URL, 04 and 05 sample the policy's replies from a vLLM server instead of transformers' generate, and 04
pushes its LoRA adapter to the server after every update; with --judge self and --user self the judge and the user
are the same server's base model, with no adapter: one engine, three roles, no generate in the learner's process.

  EngineOptions   --engine URL, --engine-timeout
  Engine          the client: connect (the server is up and serves --model), sample (Replies carrying the sampler's
                  own log-probabilities), push (the adapter after an update: saved, loaded under a new name, the
                  previous one unloaded), use (05: an adapter folder, or the base), turns (03's per-turn sampler)
  serve_argv      the one command line that serves a model as this client needs it; `python engine.py --model M`
                  runs it (with the engine's own Python: make engine builds .venv-engine, make serve starts it)

What the client sends and what it relies on (docs/scale.md, "An inference engine"):
  * every sampling field, on every request: temperature, top_p, top_k -1, min_p 0, the repetition, presence and
    frequency penalties neutral, the stop ids, n 1, a seed. vLLM fills any field left unset from the model folder's
    generation_config.json; set explicitly, the server's defaults never act (the server is also started with
    --generation-config vllm, but the client does not count on it).
  * the server started with --logprobs-mode processed_logprobs: each returned log-probability is the one of the
    distribution the token was drawn from (vLLM's default is the raw model's, which would hide off-policy sampling).
  * VLLM_ALLOW_RUNTIME_LORA_UPDATING=True and --enable-lora with --max-lora-rank >= common.LORA_R: adapters are loaded
    and unloaded at run time.
  * the prompt is the dialogue's token ids and the reply comes back as token ids (return_token_ids), so a context
    extends its row exactly, as with 03's KV cache.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
import urllib.error
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import backends
import common
import options
import sampling

# every field of vLLM's sampling that a model's generation_config.json can set, at its neutral value
NEUTRAL = {"top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0}
REQUESTS_AT_ONCE = 64  # concurrent requests per batch (one per dialogue: each carries its own seed)
JSON = {"Content-Type": "application/json"}


@dataclass
class EngineOptions:
    """The inference engine that samples the policy (04, 05): a vLLM server started by `make serve`."""

    engine: str | None = options.option(
        None,
        "URL of a vLLM server (http://localhost:8000) serving --model, started by `make serve` or "
        "`python engine.py --model M`: it samples the policy (04 pushes the adapter after each update), and with "
        "--judge self / --user self it is the judge and the user too",
    )
    engine_timeout: float = options.option(600.0, "seconds per engine request", type=options.number(above=0))


def base_url(url: str) -> str:
    """http://host:port, whether --engine was given with /v1 or not."""
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


class Engine:
    """The client of one vLLM server serving --model under that name (served-model-name), LoRA enabled."""

    def __init__(self, url: str, model: str, timeout: float = 600.0):
        self.url, self.model, self.timeout = base_url(url), model, timeout
        self.policy = model  # the name requests sample from: the base, or the adapter pushed last
        self.folder = None  # the pushed adapter's folder
        self.pushes = 0
        self.tag = uuid.uuid4().hex[:8]  # this client's adapters' names: a resumed run on the same server never
        # reuses a name the server still holds

    # ---- HTTP ---------------------------------------------------------------------------------
    def request(self, path: str, body: dict | None = None, retries: int = 2):
        """GET (body None) or POST JSON to the server -> its answer (JSON, or text); a server that cannot be
        reached after `retries` more tries 1 s apart, or that refuses, stops the run with one line."""
        data = None if body is None else json.dumps(body).encode()
        for attempt in range(retries + 1):
            try:
                with urllib.request.urlopen(
                    urllib.request.Request(self.url + path, data, JSON), timeout=self.timeout
                ) as answer:
                    text = answer.read().decode()
                try:
                    return json.loads(text)
                except json.JSONDecodeError:
                    return text
            except urllib.error.HTTPError as e:
                detail = " ".join(e.read().decode(errors="replace").split())[:300]
                raise common.UserError(f"engine {self.url}{path} answered HTTP {e.code}: {detail}") from None
            except (urllib.error.URLError, OSError) as e:  # refused, reset, timed out: the server is down or dying
                if attempt == retries:
                    reason = getattr(e, "reason", e)
                    raise common.UserError(
                        f"engine {self.url} cannot be reached ({reason}): is it up? start it with `make serve "
                        f"MODEL={self.model}` (or python engine.py --model {self.model})"
                    ) from None
                time.sleep(1.0)

    def connect(self, max_context: int | None = None):
        """The server is up and serves --model under that name with a window of at least --max-context."""
        served = self.request("/v1/models", retries=0).get("data", [])
        names = {m["id"]: m for m in served}
        root = {m.get("root"): m for m in served}
        path = common.resolve_model(self.model)
        info = names.get(self.model) or root.get(path)
        common.check(
            info is not None,
            f"engine {self.url} serves {', '.join(names) or 'nothing'}, not --model {self.model}: serve it with "
            f"`make serve MODEL={self.model}` (the served name must be --model)",
        )
        self.model = self.policy = info["id"]
        window = info.get("max_model_len")
        common.check(
            not max_context or not window or window >= max_context,
            f"engine {self.url} serves {self.model} with a window of {window} tokens, under --max-context "
            f"{max_context}: serve it with --max-model-len {max_context} or more",
        )
        return self

    # ---- sampling -----------------------------------------------------------------------------
    def sample(
        self, contexts: list[list[int]], max_new_tokens: int, temperature: float, top_p: float, stop_ids, seeds
    ) -> list[sampling.Reply]:
        """One Reply per token-id context, sampled by the engine from self.policy: the reply's ids up to and with
        its end-of-turn id, whether it ended so, and each id's log-probability under the distribution it was
        drawn from. Every sampling field is sent, so no server default acts."""

        def one(context, seed):
            body = {
                "model": self.policy,
                "prompt": context,
                "max_tokens": max_new_tokens,
                "temperature": temperature,
                "top_p": top_p,
                **NEUTRAL,
                "n": 1,
                "seed": seed,
                "stop": [],
                "stop_token_ids": list(stop_ids),
                "ignore_eos": False,
                "min_tokens": 0,
                "logprobs": 0,  # the sampled token's own log-probability, no alternatives
                "return_token_ids": True,
                "skip_special_tokens": False,
            }
            choice = self.request("/v1/completions", body)["choices"][0]
            ids, logprobs = choice["token_ids"], choice["logprobs"]["token_logprobs"]
            cut = next((j for j, tok in enumerate(ids) if tok in stop_ids), None)
            n = len(ids) if cut is None else cut + 1
            return sampling.Reply(ids[:n], cut is not None, logprobs[:n])

        if not contexts:
            return []
        with ThreadPoolExecutor(max_workers=min(REQUESTS_AT_ONCE, len(contexts))) as pool:
            return list(pool.map(one, contexts, seeds))

    def turns(self) -> EngineTurns:
        return EngineTurns(self)

    # ---- the adapter --------------------------------------------------------------------------
    def load(self, folder, name: str):
        """A peft adapter folder loaded under `name`, which then samples; the previous adapter unloaded."""
        self.request("/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(Path(folder).resolve())})
        if self.policy != self.model:
            self.request("/v1/unload_lora_adapter", {"lora_name": self.policy})
        self.policy = name

    def push(self, model, folder: Path) -> float:
        """The policy's adapter as it is now, saved to folder/<n> and loaded as the adapter that samples from here on
        (the previous one unloaded and its folder removed) -> the seconds it took."""
        t0 = time.time()
        self.pushes += 1
        new = Path(folder) / f"push-{self.tag}-{self.pushes}"
        model.save_pretrained(new, safe_serialization=True)
        self.load(new, f"{self.model}@{self.tag}-{self.pushes}")
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)
        self.folder = new
        return time.time() - t0

    def use(self, adapter: str | None, name: str):
        """05: sample from this adapter folder (None: the base, the adapter unloaded)."""
        if adapter is not None:
            self.load(adapter, name)
        elif self.policy != self.model:
            self.request("/v1/unload_lora_adapter", {"lora_name": self.policy})
            self.policy = self.model

    def chat_backend(self, args, concurrency=None) -> backends.ChatBackend:
        """--judge self / --user self with an engine: the served base model (no adapter), asked through its chat
        endpoint with every sampling field neutral, as `self` samples without an engine."""
        backend = backends.ChatBackend(
            f"api:{self.model}",
            self.url + "/v1",
            "",
            self.timeout,
            args.api_retries,
            concurrency or args.api_concurrency,
            extra_body={"top_p": 1.0, **NEUTRAL},
        )
        backend.spec, backend.reasks = f"self (the engine {self.url})", False
        return backend


class EngineTurns:
    """03's per-turn sampler with the KV cache's contract (TurnCache): row b of a call continues row b of the last
    call kept by keep_rows, and each context must extend that row's context and sampled reply exactly."""

    def __init__(self, engine: Engine):
        self.engine, self.rows = engine, None

    def keep_rows(self, rows: list[int]):
        if self.rows is not None:
            self.rows = [self.rows[b] for b in rows]

    def generate(self, model, tokenizer, contexts: list[list[int]], args) -> list[sampling.Reply]:
        import torch

        for b, c in enumerate(contexts if self.rows is not None else []):
            assert c[: len(self.rows[b])] == self.rows[b], "EngineTurns: a context does not extend its row"
        # each dialogue's own seed, drawn from torch's generator (seeded per step): the same run samples the same
        seeds = torch.randint(0, 2**31 - 1, (len(contexts),)).tolist()
        stop = sampling.end_of_turn_ids(model, tokenizer)
        replies = self.engine.sample(contexts, args.max_new_tokens, args.temperature, args.top_p, stop, seeds)
        self.rows = [c + r.ids for c, r in zip(contexts, replies)]
        return replies


def connect(args) -> Engine | None:
    """--engine's client, checked before any model loads (None without --engine)."""
    if not getattr(args, "engine", None):
        return None
    return Engine(args.engine, args.model, args.engine_timeout).connect(getattr(args, "max_context", None))


# ---- serving: the one command this client needs ----------------------------------------------
def serve_argv(model: str, port: int, dtype: str, max_model_len: int, memory_share: float | None) -> list[str]:
    """vLLM's OpenAI server for `model` (a name as --model takes it) with the flags the client relies on."""
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
    argv += ["--model", common.resolve_model(model), "--served-model-name", model, "--port", str(port)]
    argv += ["--dtype", dtype, "--max-model-len", str(max_model_len)]
    argv += ["--enable-lora", "--max-lora-rank", str(common.LORA_R), "--max-loras", "2"]  # the new one, the old one
    argv += ["--logprobs-mode", "processed_logprobs", "--generation-config", "vllm"]
    # every prompt prefilled whole: vLLM 0.32 fails a seeded request whose prefill is cut in chunks on a CPU
    # ("CPU Generator does not use offset"), and each of our requests carries its seed
    argv += ["--no-enable-chunked-prefill", "--max-num-batched-tokens", str(max(max_model_len, 8192))]
    if memory_share is not None:
        argv += ["--gpu-memory-utilization", str(memory_share)]
    return argv


def main(argv=None):
    p = argparse.ArgumentParser(description="serve a model for --engine (run with the engine's Python: make serve)")
    p.add_argument("--model", default=common.PACKAGED_SMOLLM2, help="as 04's --model takes it (the served name)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--dtype", default="auto", help="auto: bfloat16 with CUDA, float32 on a CPU (the learner's)")
    p.add_argument("--max-model-len", type=int, default=4096, help="the window: at least the run's --max-context")
    p.add_argument(
        "--memory-share",
        type=float,
        default=0.35,
        help="with CUDA: the engine's share of the GPU's memory (weights + KV cache); the learner uses the rest",
    )
    p.epilog = (
        "any other flag is passed to vLLM as it is (e.g. --tensor-parallel-size 2); a flag given twice: the last wins"
    )
    a, extra = p.parse_known_args(argv)
    import torch

    cuda = torch.cuda.is_available()
    dtype = a.dtype if a.dtype != "auto" else "bfloat16" if cuda else "float32"
    env = {**os.environ, "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
    if not cuda:
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB of KV cache on a CPU
    command = serve_argv(a.model, a.port, dtype, a.max_model_len, a.memory_share if cuda else None) + extra
    print(" ".join(command), file=sys.stderr)
    os.execvpe(command[0], command, env)


if __name__ == "__main__":
    common.run_main(main)

"""engine.py: an inference engine samples the policy (vLLM's OpenAI-compatible server), tokens in and tokens out.

With --engine URL, 04 and 05 sample the policy's replies from a vLLM server instead of transformers' generate, and 04
pushes its LoRA adapter to the server after every update; with --judge self and --user self the judge and the user
are the same server's base model, with no adapter: one engine, three roles, no generate in the learner's process.

  EngineOptions   --engine URL, --engine-timeout, --engine-wait, --engine-adapter-dir
  Engine          the client: connect (waits for the server to be up, then checks it serves --model with a window of
                  --max-context), sample (Replies carrying the sampler's own log-probabilities), push (the adapter
                  after an update: saved, loaded under a name every process then samples from, the previous one
                  unloaded), use (05: an adapter folder, or the base), close (the run's adapter unloaded at its end
                  or stop), turns (03's per-turn sampler), chat_backend (the judge and the user: the base model)
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
  * the server reads the pushed adapter from the path the client sends: on this machine the run folder, on another
    machine a folder both mount at the same path (--engine-adapter-dir); without one a remote engine is refused.
The HTTP is httpx2's (the openai client brings it); the judge's and the user's chat goes through backends.py's
openai client.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import shutil
import socket
import sys
import time
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import httpx2

import backends
import common
import options
import sampling

# every field of vLLM's sampling that a model's generation_config.json can set, at its neutral value
NEUTRAL = {"top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0}
REQUESTS_AT_ONCE = 64  # concurrent requests per batch (one per dialogue: each carries its own seed)
WAIT_NOTE_S = 30  # while waiting for a loading engine, a line this often


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
    engine_wait: float = options.option(
        300.0,
        "seconds to wait for an engine that is not answering yet (vLLM opens its port only once the model is loaded: "
        "a 7B takes one to three minutes, a 32B more); then one line and exit 2",
        type=options.number(low=0),
    )
    engine_adapter_dir: str | None = options.option(
        None,
        "where the pushed adapters go: a folder the engine's machine reads at the same path (a shared mount). Needed "
        "when --engine is on another machine; default: the run folder's engine/",
    )


def base_url(url: str) -> str:
    """http://host:port, whether --engine was given with /v1 or not."""
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def is_local(url: str) -> bool:
    """Whether the server at url runs on this machine (loopback, or this machine's own name or address)."""
    host = urlsplit(base_url(url)).hostname or ""
    if host in ("localhost", socket.gethostname(), socket.getfqdn()):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class Engine:
    """The client of one vLLM server serving --model under that name (served-model-name), LoRA enabled."""

    def __init__(self, url: str, model: str, timeout: float = 600.0, adapter_dir=None):
        self.url, self.model, self.timeout = base_url(url), model, timeout
        self.policy = model  # the name requests sample from: the base, or the adapter pushed last
        self.adapter_dir = adapter_dir  # a folder the server reads at the same path (None: the run folder's)
        self.folder = None  # the pushed adapter's folder
        self.pushes = 0
        self.tag = uuid.uuid4().hex[:8]  # this run's adapters' names: another run, or a resumed one, on the same
        # server never reuses a name the server still holds
        self.sent = Counter()  # the model name of every sampling request sent (04 logs a step's per process)
        self.http = httpx2.Client(base_url=self.url, timeout=timeout)

    # ---- HTTP ---------------------------------------------------------------------------------
    def request(self, path: str, body: dict | None = None, retries: int = 2):
        """GET (body None) or POST JSON to the server -> its answer (JSON, or text); a server that cannot be
        reached after `retries` more tries 1 s apart, or that refuses, stops the run with one line."""
        for attempt in range(retries + 1):
            try:
                answer = self.http.get(path) if body is None else self.http.post(path, json=body)
            except httpx2.TransportError as e:  # refused, reset, timed out: the server is down or dying
                if attempt == retries:
                    raise common.UserError(
                        f"engine {self.url} cannot be reached ({type(e).__name__}: {e}): is it up? start it with "
                        f"`make serve MODEL={self.model}` (or python engine.py --model {self.model})"
                    ) from None
                time.sleep(1.0)
                continue
            if answer.is_error:  # the engine's own reason (an adapter it cannot read, a prompt over its window)
                detail = " ".join(answer.text.split())[:300]
                raise common.UserError(f"engine {self.url}{path} answered HTTP {answer.status_code}: {detail}")
            try:
                return answer.json()
            except ValueError:
                return answer.text

    def wait_until_up(self, wait: float):
        """Wait up to `wait` seconds for the server to answer (a loading vLLM has not opened its port yet), saying
        so every WAIT_NOTE_S seconds; then one line, as for a server that is down."""
        t0, noted = time.time(), None
        while True:
            try:
                return self.http.get("/v1/models", timeout=min(self.timeout, 30.0))
            except httpx2.TransportError:
                waited = time.time() - t0
                if waited >= wait:
                    self.request("/v1/models", retries=0)  # the one line of a server that cannot be reached
                if noted is None or time.time() - noted >= WAIT_NOTE_S:
                    print(
                        f"waiting for the engine at {self.url} (not answering yet; a loading model opens its port "
                        f"when ready): {waited:.0f} s of --engine-wait {wait:.0f}",
                        file=sys.stderr,
                        flush=True,
                    )
                    noted = time.time()
                time.sleep(min(2.0, max(0.0, wait - waited)))

    def connect(self, max_context: int | None = None, wait: float = 0.0):
        """The server is up (waited for up to `wait` s) and serves --model under that name with a window of at
        least --max-context; a server on another machine needs --engine-adapter-dir (it reads the pushed adapter
        from the path sent)."""
        common.check(
            self.adapter_dir is not None or is_local(self.url),
            f"engine {self.url} is on another machine: it cannot read the adapters this machine writes. Pass "
            f"--engine-adapter-dir DIR, a folder that machine mounts at the same path (docs/scale.md)",
        )
        self.wait_until_up(wait)
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
        self.window = info.get("max_model_len")
        common.check(
            not max_context or not self.window or self.window >= max_context,
            f"engine {self.url} serves {self.model} with a window of {self.window} tokens, under --max-context "
            f"{max_context}: serve it with --max-model-len {max_context} (make serve ENGINE_FLAGS="
            f"'--max-model-len {max_context}'), or pass --max-context {self.window}",
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
        self.sent[self.policy] += len(contexts)
        with ThreadPoolExecutor(max_workers=min(REQUESTS_AT_ONCE, len(contexts))) as pool:
            return list(pool.map(one, contexts, seeds))

    def turns(self) -> EngineTurns:
        return EngineTurns(self)

    # ---- the adapter ---------------------------------------------------------------------------
    def load(self, folder, name: str):
        """A peft adapter folder loaded under `name`, which then samples; the previous adapter unloaded. With
        --engine-adapter-dir a folder outside it is copied there first (the server reads that folder)."""
        folder = Path(folder).resolve()
        if self.adapter_dir is not None and Path(self.adapter_dir).resolve() not in folder.parents:
            folder = Path(shutil.copytree(folder, Path(self.adapter_dir).resolve() / name.replace("/", "_")))
        self.request("/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(folder)})
        self.unload()
        self.policy = name

    def unload(self):
        """The adapter that samples now unloaded (the base samples again); nothing when none is loaded."""
        if self.policy != self.model:
            self.request("/v1/unload_lora_adapter", {"lora_name": self.policy})
            self.policy = self.model

    def push(self, model, folder: Path) -> str:
        """The policy's adapter as it is now, saved to a new folder (under --engine-adapter-dir, else `folder`) and
        loaded as the adapter that samples from here on, the previous one unloaded and its folder removed -> its
        name, which every process then samples from (04: parallel.on_main_process hands it to all)."""
        self.pushes += 1
        new = Path(self.adapter_dir or folder) / f"push-{self.tag}-{self.pushes}"
        model.save_pretrained(new, safe_serialization=True)
        self.load(new, f"{self.model}@{self.tag}-{self.pushes}")
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)
        self.folder = new
        return self.policy

    def use(self, adapter: str | None, name: str | None = None):
        """05: sample from this adapter folder under `name`, made unique to this run with its tag (None: the
        base, any adapter unloaded)."""
        if adapter is None:
            self.unload()
        else:
            self.load(adapter, f"{self.model}@{self.tag}-{name}")

    def close(self):
        """The end or the stop of a run: its adapter unloaded from the server (and a pushed folder removed), so the
        server holds nothing of it; a server already gone is not an error here."""
        try:
            self.unload()
        except common.UserError:
            pass
        if self.folder is not None and self.adapter_dir is not None:
            shutil.rmtree(self.folder, ignore_errors=True)
        self.http.close()

    def chat_backend(self, args, concurrency=None) -> backends.ChatBackend:
        """--judge self / --user self with an engine: the served base model (no adapter), asked through its chat
        endpoint with every sampling field neutral and a thinking model told not to think (its chat template's
        enable_thinking off, as `self` renders it without an engine; what it thinks anyway is stripped). Up to
        REQUESTS_AT_ONCE requests in flight, as the policy's, unless --judge-concurrency / --user-concurrency say
        otherwise: the server batches them within its own memory (--api-concurrency is for api: endpoints)."""
        backend = backends.ChatBackend(
            f"api:{self.model}",
            self.url + "/v1",
            "",
            self.timeout,
            args.api_retries,
            concurrency or REQUESTS_AT_ONCE,  # --judge-concurrency / --user-concurrency, else as many as the policy
            extra_body={"top_p": 1.0, **NEUTRAL, "chat_template_kwargs": {"enable_thinking": False}},
            owner=f"engine {self.url}",
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
    """--engine's client, checked before any model loads (None without --engine): waited for up to --engine-wait."""
    if not getattr(args, "engine", None):
        return None
    server = Engine(args.engine, args.model, args.engine_timeout, args.engine_adapter_dir)
    return server.connect(getattr(args, "max_context", None), args.engine_wait)


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

"""backends.py: the LLMs a stage talks to as chat, the simulated user, the judges, the teacher.

  ChatBackend         chat(conversations) -> replies: hf:<model> (a local transformers model), self (the policy's
                      own frozen base, its adapter off), api:<model> (an OpenAI-compatible endpoint)
  make_chat_backend   a --judge / --user / --teacher spec with the --api-* flags (EndpointOptions) -> its backend;
                      `self` with --engine is the engine's base model (engine.py builds it, as a ChatBackend)
  ask_json, first_json  ask for JSON, re-ask the unparsable, stop with one line when the endpoint is down
  api_counts          the api: backends' retries and failures (04's step log)
Imports common.py (errors, models, the chat template), options.py (EndpointOptions) and sampling.py (a local
backend's generate_batch).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import torch

import common
import options
import sampling


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
        owner=None,
    ):
        self.kind, _, self.name = spec.partition(":")
        common.check(
            (self.kind in ("hf", "api") and self.name) or spec == "self",
            f"backend '{spec}': expected hf:<model-or-path> or api:<model>, or self",
        )
        common.check(
            policy is not None or spec != "self",
            "backend 'self' is the policy's own base model, and none was given here: use hf: or api:",
        )
        self.spec, self.retries, self.concurrency = spec, retries, concurrency
        self.extra_body = extra_body  # fields sent with every api: request (the engine's neutral sampling)
        self.owner = owner  # who serves it, named in its errors (the engine); None: an endpoint of the --api-* flags
        self.reasks = self.kind == "api"  # whether an unusable answer at temperature 0 may differ when asked again
        self.failures = self.retried = 0  # calls failed after every retry; retries spent (for the step log)
        self.largest = 0  # the largest request so far, prompt tokens + max_tokens (04 logs it per step, then resets)
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

            dtype = torch.bfloat16 if common.pick_device().type == "cuda" else torch.float32
            model = common.from_pretrained(AutoModelForCausalLM.from_pretrained, self.name, dtype=dtype)
            self.model, self.tokenizer = (
                model.to(common.pick_device()).eval(),
                common.load_tokenizer(common.resolve_model(self.name)),
            )

    def __repr__(self):
        return f"ChatBackend({self.spec!r})"

    def chat(self, conversations: list[list[dict]], max_tokens=256, temperature=0.0, seeds=None) -> list[str | None]:
        """seeds: one per conversation, sent with an api: request (a local backend draws from torch's generator)."""
        if self.kind != "api":
            return self._chat_local(conversations, max_tokens, temperature)
        if not conversations:
            return []
        seeds = seeds or [None] * len(conversations)
        with ThreadPoolExecutor(max_workers=min(self.concurrency, len(conversations))) as pool:
            return list(pool.map(lambda m, s: self._chat_api(m, max_tokens, temperature, s), conversations, seeds))

    @torch.no_grad()
    def _chat_local(self, conversations, max_tokens, temperature):
        model, tok = self.model, self.tokenizer
        ids, replies, was_training = [common.render_ids(tok, m) for m in conversations], [], model.training
        self.largest = max([self.largest] + [len(x) + max_tokens for x in ids])
        model.eval()
        try:
            with common.adapters_off(model) if self.kind == "self" else contextlib.nullcontext():
                for i in range(0, len(ids), self.concurrency):
                    replies += sampling.generate_batch(
                        model, tok, ids[i : i + self.concurrency], max_tokens, temperature
                    )
        finally:
            model.train(was_training)
        return [common.strip_thinking(tok.decode(reply.ids, skip_special_tokens=True)) for reply in replies]

    def _sent(self, request):  # the client's event hook: one HTTP attempt of this thread's call, retries included
        self._local.sent += 1

    def _chat_api(self, messages, max_tokens, temperature, seed=None) -> str | None:
        """One reply, or None (counted in `failures`) after `retries` + 1 HTTP attempts in all. The openai client
        retries what failed on the way (refused, timed out, cut mid-body, HTTP 408, 409, 429, 5xx) with its own
        backoff: 0.5 s doubling up to 8 s, or a 429's or 5xx's Retry-After up to 2 minutes (one longer ends the
        call). An answer that came but is unusable (not JSON, no choices, no text) is asked again here at once,
        from the same attempts. HTTP 400, 401, 403 and 404 stop the run: one line, the key never in it (from the
        engine: its own reason). A thinking model's <think> part is stripped, as a local backend's is."""
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
                    seed=seed if seed is not None else openai.omit,
                    extra_headers=self._no_auth,
                    extra_body=self.extra_body,
                )
                text = reply.choices[0].message.content
                prompt = getattr(getattr(reply, "usage", None), "prompt_tokens", None)  # as the server counted it
                if isinstance(prompt, int):
                    with self._lock:
                        self.largest = max(self.largest, prompt + max_tokens)
            except openai.APIStatusError as e:  # after the client's retries, or a status it does not retry
                reason = " ".join(str(e.message).split())[:300]
                common.check(
                    e.status_code not in (400, 401, 403, 404) or self.owner is None,
                    f"{self.owner} answered HTTP {e.status_code} to a chat request of {self.spec}: {reason}",
                )
                common.check(
                    e.status_code not in (400, 401, 403, 404),
                    f"{self.url} answered HTTP {e.status_code} for model "
                    f"'{self.name}' (check --api-base, the model name and OPENAI_API_KEY)",
                )
                break
            except openai.APIError:  # refused, timed out or cut off, after the client's retries
                break
            except (ValueError, LookupError, AttributeError, TypeError):  # not JSON or UTF-8, no choices, no message
                pass
            text = common.strip_thinking(text) if isinstance(text, str) else None
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


@dataclasses.dataclass
class EndpointOptions:
    """The LLM endpoints of api: judges and users (and the size of a local hf: or self backend's batches)."""

    api_base: str | None = options.option(None, "OpenAI-compatible base URL (default: $OPENAI_BASE_URL)")
    api_key: str | None = options.option(None, "API key (default: $OPENAI_API_KEY); never printed or saved")
    api_timeout: float = options.option(60.0, "seconds per request", type=options.number(above=0))
    api_retries: int = options.option(3, "retries per request, openai's backoff", type=options.number(int, low=0))
    api_concurrency: int = options.option(
        8,
        "requests in flight per backend; for hf: and self, prompts per generate call (the prefill's memory peak)",
        type=options.number(int, low=1),
    )


def ask_json(
    backend,
    prompts: list,
    parse,
    retries: int,
    who="judge",
    noun="replies",
    max_tokens=300,
    temperature=0.0,
    seeds=None,
) -> list:
    """Ask every prompt, re-ask the unparsable ones up to `retries` times (not a local model at temperature 0:
    it would answer the same again); parse(i, text) -> the answer or None. None where no answer parsed. When
    no prompt got an answer and the endpoint itself failed, stop with one message, not go on with nothing.
    seeds: one per prompt for an api: endpoint (a re-ask sends seed + 1, + 2, ...)."""
    results, todo, down_before = [None] * len(prompts), list(range(len(prompts))), getattr(backend, "failures", 0)
    retries = 0 if not getattr(backend, "reasks", True) and temperature == 0 else retries
    for attempt in range(retries + 1):
        # seeds go to an endpoint's requests (a local backend, or a stand-in without them, draws its own)
        ask = {"seeds": [seeds[i] + attempt for i in todo]} if seeds and getattr(backend, "kind", None) == "api" else {}
        answers = backend.chat([prompts[i] for i in todo], max_tokens=max_tokens, temperature=temperature, **ask)
        for i, text in zip(todo, answers):
            results[i] = parse(i, text)
        todo = [i for i in todo if results[i] is None]
        if not todo:
            break
    if prompts and all(r is None for r in results) and getattr(backend, "failures", 0) > down_before:
        raise common.UserError(
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

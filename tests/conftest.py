"""Shared fixtures: a tiny random Qwen2 model with a locally trained BPE tokenizer and a ChatML chat
template (built once per session in seconds), and the repo root on sys.path."""

import argparse
import http.server
import importlib
import json
import multiprocessing
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

# the tests run offline, and the scripts they start too (set before huggingface_hub reads them at import)
os.environ.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
# `make test` runs the tests on every core at once (pytest-xdist, one worker a core): each worker and the scripts
# it starts then compute on its share of the cores, as torch's threads waiting on a busy core cost more than
# they give (set before torch is imported; the subprocesses inherit it)
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import script_process  # noqa: E402

# run_script's processes: forks of one server per test process that imported the libraries once
FORK_SERVER = multiprocessing.get_context("forkserver")
FORK_SERVER.set_forkserver_preload(script_process.PRELOAD)

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] "
    "+ '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% endif %}"
)


def _corpus():
    lines = []
    for name in ("scenarios_train.jsonl", "scenarios_test.jsonl"):
        path = ROOT / "data" / name
        if path.exists():
            lines += [ln for ln in path.read_text(encoding="utf-8").splitlines() if ln.strip()]
    lines += ["I feel so alone since my dad died. That sounds really painful. What happened next?"] * 20
    return lines


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    """Path of a saved tiny random Qwen2ForCausalLM (2 layers, hidden 32) + its tokenizer."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny_qwen2"))


@pytest.fixture(scope="session")
def tiny_model_64(tmp_path_factory) -> str:
    """The tiny model 64 wide: bitsandbytes quantises blocks of 64 weights, so a 32-wide layer cannot be 4-bit."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny_qwen2_64"), hidden_size=64)


def policy_args(model: str, **options) -> argparse.Namespace:
    """The flags common.load_policy reads, for a test's tiny model: LoRA on q_proj and v_proj, full precision, no
    gradient checkpointing; `options` add flags (policy_update's) or override these (load_in_4bit="on")."""
    defaults = dict(
        adapter=None,
        lora_targets="q_proj,v_proj",
        load_in_4bit="off",
        gradient_checkpointing=False,
        trust_remote_code=False,
    )
    return argparse.Namespace(model=model, **{**defaults, **options})


def build_tiny_model(out, hidden_size=32, window=4096) -> str:
    """Save the tiny random model and its tokenizer into folder `out` (scripts import this too:
    `sys.path.insert(0, "tests"); from conftest import build_tiny_model`); window: max_position_embeddings."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    Path(out).mkdir(parents=True, exist_ok=True)
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        _corpus(),
        trainers.BpeTrainer(
            vocab_size=600, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        ),
    )
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = CHATML
    fast.save_pretrained(out)
    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=len(fast),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=window,
        eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id,
        tie_word_embeddings=True,
    )
    model = Qwen2ForCausalLM(cfg)
    model.generation_config.eos_token_id = fast.eos_token_id
    model.save_pretrained(out)
    return str(out)


@pytest.fixture(scope="session")
def env():
    return importlib.import_module("03_rollout")


@pytest.fixture(scope="session")
def trainer():
    return importlib.import_module("04_mica_train")


@pytest.fixture
def tiny(tiny_model):
    """A fresh tiny model per test (no gradients or weights carried from one test to the next), seeded."""
    from transformers import AutoModelForCausalLM

    import common

    torch.manual_seed(0)
    tok = common.load_tokenizer(tiny_model)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    return model, tok


def env_args(env, check=False, **over):
    """03's environment flags at their defaults, with `over` set (and checked, with check=True)."""
    import backends
    import options
    import runs

    groups = [("environment", env.EnvOptions), ("endpoints", backends.EndpointOptions), ("run", runs.RunOptions)]
    args = options.options_parser("", groups).parse_args(["--no-progress"])
    for k, v in over.items():
        setattr(args, k, v)
    if check:
        env.check_env_args(args)
    return args


def run_script(script, *args, cwd=None, timeout=900, env_extra=None):
    """Run one of the stage scripts as a user would, in a process of its own; returns the CompletedProcess.
    The process is a fork of a server that has the libraries imported (tests/script_process.py); a run
    that sets a variable the libraries read at import starts a fresh interpreter."""
    e = {**os.environ, **(env_extra or {})}  # offline: set above for the whole session
    argv = [sys.executable, str(ROOT / script), *map(str, args)]
    if any(k.startswith(script_process.READ_AT_IMPORT) for k in env_extra or {}):
        return subprocess.run(argv, cwd=cwd, env=e, capture_output=True, text=True, timeout=timeout)
    with tempfile.TemporaryDirectory() as d:
        out, err = Path(d) / "stdout", Path(d) / "stderr"
        cwd = str(cwd or os.getcwd())  # as subprocess: the test's folder now, not the server's
        p = FORK_SERVER.Process(target=script_process.run, args=(argv[1], argv[2:], e, cwd, str(out), str(err)))
        p.start()
        p.join(timeout)
        if p.exitcode is None:
            p.kill()
            p.join()
            raise subprocess.TimeoutExpired(argv, timeout, out.read_text(), err.read_text())
        return subprocess.CompletedProcess(argv, p.exitcode, out.read_text(), err.read_text())


def write_jsonl(path, records):
    Path(path).write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


# one scenario for the rollout tests: the opening, a deficit, the scripted user's lines
SCEN = {
    "id": "s",
    "persona": "p",
    "situation": "s",
    "opening": "I feel so alone since my dad died.",
    "p0": [-6.0, -9.0, -4.0],
    "user_lines": {"better": ["That helps."], "stuck": ["Maybe."], "worse": ["You are not listening."]},
}


JUDGE_OK = (
    '{"C": {"progress": 1, "negative": 0}, "A": {"progress": 1, "negative": 0}, "P": {"progress": 0, "negative": 0}}'
)
USER_OK = "I am not sure. It still hurts when I think about it."
FAULTS = ("http_500", "http_429", "hang", "truncated_json", "not_json", "empty_choices", "missing_fields")


# ---------------------------------------------------------------------------------------------
# The one loopback server: an OpenAI-compatible /chat/completions fake on 127.0.0.1
# ---------------------------------------------------------------------------------------------
def ok(content, **kw):
    """A respond spec: a normal chat-completions answer holding `content` (other spec keys in kw)."""
    return dict(
        body={
            "id": "x",
            "object": "chat.completion",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}],
        },
        **kw,
    )


def prompt_text(body) -> str:
    """A request's messages as one JSON string, for finding markers in the prompt."""
    return json.dumps(body.get("messages") if isinstance(body, dict) else body, ensure_ascii=False)


def request_kind(body) -> str:
    """'judge' for an MDEP-PR judge prompt, 'user' for anything else."""
    return "judge" if "MDEP-PR" in prompt_text(body) else "user"


class _ThreadingServer(http.server.ThreadingHTTPServer):
    daemon_threads = False  # server_close() joins every handler thread: none outlives the test
    block_on_close = True


class _Handler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def do_POST(self):
        server = self.server.owner
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
        kind, spec = server._arrive(self, body)
        try:
            if spec.get("hang"):  # past the client's timeout; `release` (set at close) ends it early
                server.release.wait(10 if spec["hang"] is True else spec["hang"])
                if "body" not in spec and "raw" not in spec:
                    return  # hung up without an answer
            if spec.get("delay"):
                time.sleep(spec["delay"])
        finally:
            server._leave(kind)  # counted down before the answer goes out: the client can't overlap it
        payload = spec["raw"] if "raw" in spec else json.dumps(spec.get("body")).encode()
        headers = {"Content-Type": "application/json", **spec.get("headers", {})}
        try:
            self.send_response(spec.get("status", 200))
            for k, v in headers.items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(spec.get("length", len(payload))))
            self.end_headers()
            self.wfile.write(payload)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client gave up (its timeout): fine


class LoopbackServer:
    """An OpenAI-compatible /chat/completions fake on 127.0.0.1 (a free port), one thread a request.

    Every POST is recorded in `requests` as {path, auth, content_type, body (parsed), kind, thread}
    (`threads`, `auth`: those fields of all of them); `max_active` is the most requests in flight at once,
    `max_by_kind` the same per `kind(body)` (judge / user). What goes back is `respond(index, body) ->
    spec`, called under the lock in arrival order (so a policy may count without a lock of its own); the
    default answers from `plan`: the index-th spec, the last one repeating. A spec holds `body` (sent as
    JSON) or `raw` bytes, and optionally `status` (200), `headers`, `length` (the declared Content-Length;
    default the true one), `delay` (seconds before answering) and `hang` (seconds, True = 10, waited on
    `release`: then the answer goes out if the spec has one, else the request is dropped unanswered).
    close() (also at the end of a `with` block) releases hangs and joins every handler thread."""

    def __init__(self, respond=None, plan=None, kind=request_kind):
        self.requests = []
        self.active, self.max_active = 0, 0
        self.active_by_kind, self.max_by_kind = {"judge": 0, "user": 0}, {"judge": 0, "user": 0}
        self.lock, self.release = threading.Lock(), threading.Event()
        self.plan = list(plan or [ok("hello")])
        self.respond = respond or (lambda index, body: self.plan[min(index, len(self.plan) - 1)])
        self.kind = kind
        self.httpd = _ThreadingServer(("127.0.0.1", 0), _Handler)
        self.httpd.owner = self
        self.base = f"http://127.0.0.1:{self.httpd.server_port}/v1"
        self._thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self._thread.start()
        self._closed = False

    @property
    def threads(self):
        return [r["thread"] for r in self.requests]

    @property
    def auth(self):
        return {r["auth"] for r in self.requests}

    def _arrive(self, handler, body):
        kind = self.kind(body)
        with self.lock:
            index = len(self.requests)
            self.requests.append(
                {
                    "path": handler.path,
                    "auth": handler.headers.get("Authorization"),
                    "content_type": handler.headers.get("Content-Type"),
                    "body": body,
                    "kind": kind,
                    "thread": threading.current_thread(),
                }
            )
            self.active += 1
            self.max_active = max(self.max_active, self.active)
            self.active_by_kind[kind] = self.active_by_kind.get(kind, 0) + 1
            self.max_by_kind[kind] = max(self.max_by_kind.get(kind, 0), self.active_by_kind[kind])
            return kind, self.respond(index, body)

    def _leave(self, kind):
        with self.lock:
            self.active -= 1
            self.active_by_kind[kind] -= 1

    def close(self):
        if self._closed:
            return
        self._closed = True
        self.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()  # joins the handler threads
        self._thread.join(5)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


@pytest.fixture
def loopback():
    """loopback(respond=None, plan=None, ...) starts a LoopbackServer; every one is closed at teardown."""
    servers = []

    def start(*args, **kw):
        servers.append(LoopbackServer(*args, **kw))
        return servers[-1]

    yield start
    for s in servers:
        s.close()


class FaultServer:
    """The fault-injecting server: a respond policy that `fault_server(**kw)` runs on a LoopbackServer.

    Every request gets a good answer (judge JSON for MDEP-PR prompts, a user line otherwise) except
    a `rate` share of them, spread evenly and deterministically, which get the next fault of FAULTS
    in turn: HTTP 500, 429 with Retry-After: 1, a hang of `hang_s` seconds (past the client's
    timeout), a body cut mid-JSON, a non-JSON body, empty choices, and a reply without the expected
    fields (no content, or judge JSON with its levels missing). `down=True` answers 500 to all.
    `answers`: (marker, answer) pairs for other prompts (05's EQ-Bench and SAGE judges).
    Every answer waits `delay_s` first; `max_active` is the most judge / user requests in flight at once;
    `requests` and `auth` count the requests and the Authorization headers seen, `faults` each fault."""

    def __init__(self, rate=0.3, hang_s=2.5, judge_answer=JUDGE_OK, user_answer=USER_OK, answers=(), delay_s=0.0):
        self.rate, self.hang_s, self.down, self.delay_s = rate, hang_s, False, delay_s
        self.judge_answer, self.user_answer = judge_answer, user_answer
        self.answers = list(answers)  # (marker, answer): a prompt holding the marker gets the answer
        self.faults = {k: 0 for k in FAULTS}
        self.server = None

    base = property(lambda self: self.server.base)
    requests = property(lambda self: len(self.server.requests))
    auth = property(lambda self: self.server.auth)
    max_active = property(lambda self: self.server.max_by_kind)

    def __call__(self, index, body):  # called under the server's lock
        n = index + 1
        fault = None
        if self.down:
            fault = "http_500"
        elif int(n * self.rate) != int((n - 1) * self.rate):  # rate share, evenly
            fault = FAULTS[sum(self.faults.values()) % len(FAULTS)]
        if fault:
            self.faults[fault] += 1
        judge = request_kind(body) == "judge"
        text = prompt_text(body)
        answer = next(
            (a for marker, a in self.answers if marker in text), self.judge_answer if judge else self.user_answer
        )
        good = json.dumps(ok(answer)["body"]).encode()
        spec = {
            "http_500": dict(status=500, body={"error": "internal"}),
            "http_429": dict(status=429, body={"error": "rate limited"}, headers={"Retry-After": "1"}),
            "hang": ok(answer, hang=self.hang_s),
            "truncated_json": dict(raw=good[: len(good) // 2], length=len(good)),
            "not_json": dict(raw=b"<html>502 Bad Gateway</html>"),
            "empty_choices": dict(body={"choices": []}),
            "missing_fields": dict(
                body={
                    "choices": [
                        {"message": {"role": "assistant", **({"content": '{"C": {"progress": 1}}'} if judge else {})}}
                    ]
                }
            ),
        }.get(fault) or ok(answer)
        return {**spec, "delay": self.delay_s}


@pytest.fixture
def fault_server(loopback):
    """fault_server(rate=0.3, hang_s=2.5, ...) -> a started FaultServer (see there), closed at teardown."""

    def start(**kw):
        policy = FaultServer(**kw)
        policy.server = loopback(policy)
        return policy

    return start

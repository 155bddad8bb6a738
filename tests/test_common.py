"""common.py's plumbing: the api: chat backend against a local fake OpenAI server, JSONL I/O, run
folders and args, the checkpoint (adapter, optimizer, scheduler, step), model resolution, flag types,
embeddings (offline.py), and the figures' handling of a resumed run (plots.py)."""

import argparse
import copy
import datetime
import json
import time
import types

import pytest
import torch

import backends
import common
import offline
import options
import plots
import runs
from conftest import LoopbackServer, ok, write_jsonl

KEY = "sk-secret-123"


# ---------------------------------------------------------------------------------------------
# conftest.LoopbackServer answering from its plan (or a test's own respond), with a ChatBackend on it
# ---------------------------------------------------------------------------------------------
class FakeAPI(LoopbackServer):
    def backend(self, **kw):
        kw = {"api_base": self.base, "api_key": KEY, "timeout": 5.0, "retries": 2, **kw}
        return backends.ChatBackend("api:m", **kw)


@pytest.fixture
def api():
    with FakeAPI() as server:
        yield server


CONV = [{"role": "system", "content": "be kind"}, {"role": "user", "content": "I feel low"}]


# ---------------------------------------------------------------------------------------------
# 1. ChatBackend("api:...")
# ---------------------------------------------------------------------------------------------
def test_api_normal_reply_sends_model_messages_params_and_key(api):
    b = backends.ChatBackend("api:m", api_base=api.base + "/", api_key=KEY, timeout=5, retries=2)
    assert b.url == api.base + "/chat/completions"
    assert b.chat([CONV], max_tokens=17, temperature=0.7) == ["hello"]
    assert len(api.requests) == 1
    r = api.requests[0]
    assert r["path"] == "/v1/chat/completions"
    assert r["auth"] == "Bearer sk-secret-123"
    assert r["content_type"] == "application/json"
    assert r["body"] == {"model": "m", "messages": CONV, "max_tokens": 17, "temperature": 0.7}
    assert b.failures == 0


def test_api_defaults_from_environment(api, monkeypatch):
    monkeypatch.setenv("OPENAI_BASE_URL", api.base)
    monkeypatch.setenv("OPENAI_API_KEY", "sk-from-env")
    b = backends.ChatBackend("api:other-model", retries=0)
    assert b.chat([CONV]) == ["hello"]
    assert api.requests[0]["auth"] == "Bearer sk-from-env"
    assert api.requests[0]["body"]["model"] == "other-model"
    assert api.requests[0]["body"]["max_tokens"] == 256 and api.requests[0]["body"]["temperature"] == 0.0


def test_api_no_key_sends_no_authorization(api, monkeypatch):
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    b = backends.ChatBackend("api:m", api_base=api.base, retries=0)
    assert b.chat([CONV]) == ["hello"]
    assert api.requests[0]["auth"] is None


def test_api_empty_batch_makes_no_request(api):
    assert api.backend().chat([]) == []
    assert api.requests == []


def test_api_500_twice_then_success(api):
    err = dict(status=500, body={"error": "boom"})
    api.plan = [err, err, ok("third time lucky")]
    b = api.backend(retries=3)
    assert b.chat([CONV]) == ["third time lucky"]
    assert len(api.requests) == 3
    assert (b.failures, b.retried) == (0, 2)


def test_api_429_retry_after_zero_then_success(api):
    api.plan = [dict(status=429, body={"error": "slow down"}, headers={"Retry-After": "0"}), ok("ok now")]
    b = api.backend(retries=2)
    assert b.chat([CONV]) == ["ok now"]
    assert len(api.requests) == 2
    assert (b.failures, b.retried) == (0, 1)


def test_api_faults_wait_the_client_backoff_and_bad_answers_are_asked_again_at_once(api):
    """One call, 4 attempts (--api-retries 3): after a 500 the openai client waits its backoff (0.5 s less up
    to 25% jitter), after a 429 its Retry-After (1 s); an answer that came but is not JSON is asked again at
    once, from the same attempts."""
    plan = [dict(status=500, body={}), dict(status=429, body={}, headers={"Retry-After": "1"}), dict(raw=b"<html>")]
    arrived = []

    def respond(index, body):
        arrived.append(time.monotonic())
        return plan[index] if index < len(plan) else ok("at last")

    api.respond = respond
    b = api.backend(retries=3)
    assert b.chat([CONV]) == ["at last"]
    gaps = [later - earlier for earlier, later in zip(arrived, arrived[1:])]
    assert 0.37 <= gaps[0] <= 0.9 and 1.0 <= gaps[1] <= 1.5 and gaps[2] <= 0.3, gaps
    assert (len(api.requests), b.retried, b.failures) == (4, 3, 0)


def test_api_422_is_not_retried_and_counts_as_failed(api):
    api.plan = [dict(status=422, body={"detail": "Unexpected fields in the request"})]
    b = api.backend(retries=3)
    assert b.chat([CONV]) == [None]
    assert (len(api.requests), b.retried, b.failures) == (1, 0, 1)


def test_api_retry_after_over_two_minutes_ends_the_call(api):
    api.plan = [dict(status=429, body={"error": "come back tomorrow"}, headers={"Retry-After": "600"})]
    b = api.backend(retries=3)
    assert b.chat([CONV]) == [None]
    assert (len(api.requests), b.retried, b.failures) == (1, 0, 1)


BAD_ANSWERS = {
    "non_json": dict(raw=b"<html>502 bad gateway</html>"),
    "truncated_json": dict(raw=b'{"choices": [{"message": {"content": "hel'),
    "empty_choices": dict(body={"choices": []}),
    "choice_without_message": dict(body={"choices": [{"index": 0, "text": "hi"}]}),
    "message_without_content": dict(body={"choices": [{"message": {"role": "assistant"}}]}),
    "null_content": dict(body={"choices": [{"message": {"role": "assistant", "content": None}}]}),
    "json_list": dict(body=[1, 2, 3]),
    "not_utf8": dict(raw=b'{"choices": [{"message": {"content": "\xff\xfe"}}]}'),
    "body_shorter_than_content_length": dict(raw=b'{"choices": [', length=500),
    "always_500": dict(status=500, body={"error": "down"}),
}


@pytest.mark.parametrize("answer", list(BAD_ANSWERS), ids=list(BAD_ANSWERS))
def test_api_bad_answers_are_retried_then_none(api, answer):
    """A fault on the way (500, a body shorter than announced) is retried by the openai client; an answer
    that came but is unusable is asked again by the backend: retries + 1 attempts in all, either way."""
    api.plan = [BAD_ANSWERS[answer]]
    b = api.backend(retries=2)
    assert b.chat([CONV]) == [None]
    assert len(api.requests) == 3  # retries + 1
    assert (b.failures, b.retried) == (1, 2)
    assert b.chat([CONV]) == [None]
    assert len(api.requests) == 6
    assert (b.failures, b.retried) == (2, 4)


def test_api_bad_answer_then_good_answer(api):
    api.plan = [dict(raw=b"not json"), dict(body={"choices": []}), ok("fine")]
    b = api.backend(retries=2)
    assert b.chat([CONV]) == ["fine"]
    assert len(api.requests) == 3 and (b.failures, b.retried) == (0, 2)


def test_api_timeout_gives_none_and_handler_threads_exit(api):
    api.plan = [dict(hang=True)]
    b = api.backend(timeout=0.3, retries=1)
    assert b.chat([CONV]) == [None]
    assert len(api.requests) == 2
    assert (b.failures, b.retried) == (1, 1)
    api.close()  # releases the hanging handlers and joins them
    assert len(api.threads) == 2
    assert not any(t.is_alive() for t in api.threads)


@pytest.mark.parametrize("code", [400, 401, 403, 404])
def test_api_client_errors_raise_usererror_without_the_key(api, code):
    api.plan = [dict(status=code, body={"error": {"message": "invalid api key sk-secret-123"}})]
    b = api.backend(retries=3)
    with pytest.raises(common.UserError) as ei:
        b.chat([CONV])
    msg = str(ei.value)
    assert api.base + "/chat/completions" in msg
    assert f"HTTP {code}" in msg
    assert "'m'" in msg
    assert KEY not in msg
    assert len(api.requests) == 1  # not retried


def test_api_batch_replies_in_order(api):
    # later conversations answer faster, so completion order is the reverse of input order
    def respond(idx, body):
        n = int(body["messages"][-1]["content"])
        return ok(f"reply {n}", delay=0.05 * (5 - n))

    api.respond = respond
    convs = [[{"role": "user", "content": str(n)}] for n in range(6)]
    b = api.backend(concurrency=6)
    assert b.chat(convs) == [f"reply {n}" for n in range(6)]
    assert sorted(r["body"]["messages"][0]["content"] for r in api.requests) == [str(n) for n in range(6)]


def test_api_batch_mixed_success_and_failure(api):
    api.respond = lambda idx, body: (
        dict(status=500, body={})
        if body["messages"][-1]["content"] == "bad"
        else ok("echo " + body["messages"][-1]["content"])
    )
    convs = [[{"role": "user", "content": c}] for c in ("a", "bad", "c")]
    b = api.backend(retries=1, concurrency=2)
    assert b.chat(convs) == ["echo a", None, "echo c"]
    assert (b.failures, b.retried) == (1, 1)
    assert len(api.requests) == 4  # a, c once; bad twice


def test_api_concurrency_is_bounded(api):
    api.plan = [ok("slow", delay=0.2)]
    b = api.backend(concurrency=3)
    assert b.chat([[{"role": "user", "content": str(i)}] for i in range(9)]) == ["slow"] * 9
    assert len(api.requests) == 9
    assert 2 <= api.max_active <= 3


def test_api_key_not_in_repr_or_public_args(api):
    b = api.backend()
    assert KEY not in repr(b) and KEY not in str(b)
    assert repr(b) == "ChatBackend('api:m')"
    args = argparse.Namespace(api_key=KEY, api_base=api.base, model="m", lr=1e-5)
    pub = runs.public_args(args)
    assert pub == {"api_key": "<redacted>", "api_base": api.base, "model": "m", "lr": 1e-5}
    assert KEY not in json.dumps(pub)
    assert args.api_key == KEY  # the namespace itself is left alone
    assert runs.public_args(argparse.Namespace(api_key=None, x=1)) == {"api_key": None, "x": 1}


# ---------------------------------------------------------------------------------------------
# 2. bad backend specs
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("spec", ["bogus", "api:", "hf:", "openai:gpt", ":m", ""])
def test_bad_backend_spec(spec):
    with pytest.raises(common.UserError, match="expected hf:<model-or-path> or api:<model>"):
        backends.ChatBackend(spec)


# ---------------------------------------------------------------------------------------------
# 3. JSONL
# ---------------------------------------------------------------------------------------------
FIELDS = {"id": int, "text": str, "score": (int, float)}


def test_read_jsonl_valid_with_blank_line(tmp_path):
    p = tmp_path / "file.jsonl"
    p.write_text(
        '{"id": 1, "text": "a", "score": 0.5}\n\n   \n{"id": 2, "text": "b", "score": 3, "x": [1]}\n', encoding="utf-8"
    )
    recs = runs.read_jsonl(p, FIELDS)
    assert recs == [
        {"id": 1, "text": "a", "score": 0.5, "_where": f"{p}:1"},
        {"id": 2, "text": "b", "score": 3, "x": [1], "_where": f"{p}:4"},
    ]
    assert runs.read_jsonl(str(p))[1]["_where"] == f"{p}:4"  # no fields: only shape checked


def _err(tmp_path, text, fields=FIELDS, mode="w"):
    p = tmp_path / "file.jsonl"
    if isinstance(text, bytes):
        p.write_bytes(text)
    else:
        p.write_text(text, encoding="utf-8")
    with pytest.raises(common.UserError) as ei:
        runs.read_jsonl(p, fields)
    return str(ei.value), str(p)


def test_read_jsonl_bad_json_names_path_and_line(tmp_path):
    msg, p = _err(tmp_path, '{"id": 1, "text": "a", "score": 1}\n\n{"id": 2, "text": \n')
    assert msg.startswith(f"{p}:3: not valid JSON")
    assert "file.jsonl:3" in msg


READ_ERRORS = {  # file text -> the one message, {p} standing for the file's path
    "non_object_line": ('{"id": 1, "text": "a", "score": 1}\n[1, 2]\n', "{p}:2: expected a JSON object, got list"),
    "missing_field": ('{"id": 1, "score": 1}\n', "{p}:1: missing field 'text'"),
    "wrong_type_int": ('{"id": "7", "text": "a", "score": 1}\n', "{p}:1: field 'id' must be int, got str"),
    "wrong_type_number": (
        '{"id": 1, "text": "a", "score": "high"}\n',
        "{p}:1: field 'score' must be int or float, got str",
    ),
    "bool_is_not_int": ('{"id": true, "text": "a", "score": 1}\n', "{p}:1: field 'id' must be int, got bool"),
    "bool_is_not_number": (
        '{"id": 1, "text": "a", "score": false}\n',
        "{p}:1: field 'score' must be int or float, got bool",
    ),
    "empty_file": ("", "{p}: no records"),
    "blank_lines_only": ("\n  \n\n", "{p}: no records"),
}


@pytest.mark.parametrize("case", list(READ_ERRORS), ids=list(READ_ERRORS))
def test_read_jsonl_errors_name_path_line_and_field(tmp_path, case):
    text, message = READ_ERRORS[case]
    msg, p = _err(tmp_path, text)
    assert msg == message.format(p=p)


def test_read_jsonl_bool_is_fine_where_bool_is_asked(tmp_path):
    p = tmp_path / "ok.jsonl"
    p.write_text('{"flag": true}\n', encoding="utf-8")
    assert runs.read_jsonl(p, {"flag": bool})[0]["flag"] is True


def test_read_jsonl_missing_file(tmp_path):
    p = tmp_path / "nope.jsonl"
    with pytest.raises(common.UserError) as ei:
        runs.read_jsonl(p)
    assert str(ei.value) == f"{p}: no such file"


def test_read_jsonl_not_utf8_names_path_and_line(tmp_path):
    # a Latin-1 file is a user mistake: one message with file:line, not a UnicodeDecodeError traceback
    msg, p = _err(
        tmp_path, '{"id": 1, "text": "a", "score": 1}\n{"id": 2, "text": "caf\xe9", "score": 1}\n'.encode("latin-1")
    )
    assert msg == f"{p}:2: not UTF-8 text (byte 23)"


def test_read_jsonl_crlf_and_non_ascii(tmp_path):
    p = tmp_path / "file.jsonl"
    p.write_bytes('{"id": 1, "text": "café 😢", "score": 1}\r\n\r\n{"id": 2, "text": "b", "score": 2}\r\n'.encode())
    recs = runs.read_jsonl(p, FIELDS)
    assert [(r["text"], r["_where"]) for r in recs] == [("café 😢", f"{p}:1"), ("b", f"{p}:3")]


def test_append_jsonl(tmp_path):
    p = tmp_path / "out.jsonl"
    runs.append_jsonl(p, {"a": 1, "_where": "x:1", "t": "héllo"})
    runs.append_jsonl(p, [{"a": 2}, {"a": 3, "_where": "y:2"}])
    lines = p.read_text(encoding="utf-8").splitlines()
    assert lines == ['{"a": 1, "t": "héllo"}', '{"a": 2}', '{"a": 3}']
    # round trip through read_jsonl
    assert [r["a"] for r in runs.read_jsonl(p, {"a": int})] == [1, 2, 3]
    runs.append_jsonl(p, [])
    assert len(p.read_text(encoding="utf-8").splitlines()) == 3


def test_write_jsonl_helper_round_trip(tmp_path):
    p = write_jsonl(tmp_path / "w.jsonl", [{"id": 1, "text": "x", "score": 2.5}])
    assert runs.read_jsonl(p, FIELDS)[0]["score"] == 2.5


# ---------------------------------------------------------------------------------------------
# 4. run folders and args
# ---------------------------------------------------------------------------------------------
def run_args(out_dir, run_name, **over):
    return argparse.Namespace(out_dir=str(out_dir), run_name=run_name, **over)


def test_open_run_same_second_gives_new_folders(tmp_path, monkeypatch):
    class FrozenDT(datetime.datetime):
        @classmethod
        def now(cls, tz=None):
            return cls(2024, 5, 6, 7, 8, 9)

    monkeypatch.setattr(runs, "dt", types.SimpleNamespace(datetime=FrozenDT))
    a = runs.open_run(run_args(tmp_path / "runs", "mica"))
    b = runs.open_run(run_args(tmp_path / "runs", "mica"))
    c = runs.open_run(run_args(tmp_path / "runs", "mica"))
    assert a.name == "mica-20240506-070809"
    assert b.name == "mica-20240506-070809-1"
    assert c.name == "mica-20240506-070809-2"
    assert a.is_dir() and b.is_dir() and c.is_dir()
    assert [f.name for f in a.iterdir()] == ["args.json"]  # a fresh folder: nothing but its args


def test_open_run_real_clock(tmp_path):
    a = runs.open_run(run_args(tmp_path, "x"))
    b = runs.open_run(run_args(tmp_path, "x"))
    assert a != b and a.is_dir() and b.is_dir() and a.name.startswith("x-") and b.name.startswith("x-")


def test_open_run_saves_args_with_the_key_redacted(tmp_path, capsys):
    args = run_args(tmp_path / "runs", "r", api_key=KEY, model="m", lr=0.001, out=tmp_path)
    run_dir = runs.open_run(args)
    saved = json.loads((run_dir / "args.json").read_text())
    assert saved == {
        "out_dir": str(tmp_path / "runs"),
        "run_name": "r",
        "api_key": "<redacted>",
        "model": "m",
        "lr": 0.001,
        "out": str(tmp_path),
    }
    assert KEY not in (run_dir / "args.json").read_text()
    assert capsys.readouterr().out == ""  # nothing printed: the configuration is in args.json
    assert [f.name for f in run_dir.iterdir()] == ["args.json"]  # no temp file left behind
    assert args.api_key == KEY  # the namespace itself is left alone


# ---------------------------------------------------------------------------------------------
# 5. checkpoints
# ---------------------------------------------------------------------------------------------
def _train_step(model, opt, sched, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (2, 8), generator=g)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    sched.step()
    opt.zero_grad()


def _adapter_state(model):
    from peft import get_peft_model_state_dict

    return {k: v.detach().clone() for k, v in get_peft_model_state_dict(model).items()}


def test_checkpoint_round_trip(tiny_model, tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    _train_step(model, opt, sched, seed=1)
    assert runs.load_checkpoint(tmp_path, model, opt, sched) is None  # none written yet
    runs.save_checkpoint(tmp_path, 3, model, opt, sched, extra={"episodes": 42})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.pt"]  # no temporary file left
    saved_weights = _adapter_state(model)
    saved_opt = copy.deepcopy(opt.state_dict())
    saved_lr = opt.param_groups[0]["lr"]
    assert sched.last_epoch == 1 and saved_lr == pytest.approx(5e-3)
    assert len(saved_weights) == 2 * 2 * 2  # 2 layers x (q, v) x (A, B)
    assert any(v.abs().sum() > 0 for k, v in saved_weights.items() if "lora_B" in k)  # the step moved B

    # move everything on: weights, optimizer, scheduler
    _train_step(model, opt, sched, seed=2)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_A" in n:
                p.add_(1.0)
    assert sched.last_epoch == 2
    changed = _adapter_state(model)
    assert all(not torch.equal(changed[k], saved_weights[k]) for k in saved_weights)

    state = runs.load_checkpoint(tmp_path, model, opt, sched)
    assert state["step"] == 3 and state["episodes"] == 42
    restored = _adapter_state(model)
    assert restored.keys() == saved_weights.keys()
    assert all(torch.equal(restored[k], saved_weights[k]) for k in saved_weights)
    assert sched.last_epoch == 1
    assert opt.param_groups[0]["lr"] == saved_lr
    now_opt = opt.state_dict()
    assert now_opt["param_groups"] == saved_opt["param_groups"]
    assert now_opt["state"].keys() == saved_opt["state"].keys()
    for i, s in saved_opt["state"].items():
        assert set(now_opt["state"][i]) == set(s) == {"step", "exp_avg", "exp_avg_sq"}
        for k in s:
            assert torch.equal(torch.as_tensor(now_opt["state"][i][k]), torch.as_tensor(s[k])), (i, k)
    assert float(now_opt["state"][0]["step"]) == 1.0

    # a further step from the restored state works (optimizer state is usable, not just equal)
    _train_step(model, opt, sched, seed=2)
    assert float(opt.state_dict()["state"][0]["step"]) == 2.0
    # saving again replaces the one checkpoint
    runs.save_checkpoint(tmp_path, 4, model, opt, sched)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.pt"]
    assert runs.load_checkpoint(tmp_path, model, opt, sched)["step"] == 4


# ---------------------------------------------------------------------------------------------
# 6. model resolution
# ---------------------------------------------------------------------------------------------
def test_resolve_maps_aliases_and_passes_names_through(tiny_model):
    assert common.resolve_model("Qwen2.5-7B-Instruct") == "Qwen/Qwen2.5-7B-Instruct"
    assert common.resolve_model(tiny_model) == tiny_model
    assert common.resolve_model("someone/some-model") == "someone/some-model"


def test_a_model_that_does_not_load_is_one_line_naming_it(tmp_path, monkeypatch):
    import huggingface_hub.constants as hf_constants
    from transformers import AutoConfig

    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(common.UserError) as ei:
        common.from_pretrained(AutoConfig.from_pretrained, "no-such-model-xyz")
    msg = str(ei.value)
    assert "model 'no-such-model-xyz' could not be loaded" in msg and "\n" not in msg
    assert "Qwen2.5-7B-Instruct" in msg and "hf download" not in msg  # not a hub id: no fetch command
    with pytest.raises(common.UserError, match=rf"model '{tmp_path}' could not be loaded: .*config.json"):
        common.from_pretrained(AutoConfig.from_pretrained, str(tmp_path))  # an empty folder


def test_number_is_an_argparse_type_with_bounds(capsys):
    p = argparse.ArgumentParser(prog="x")
    p.add_argument("--k", type=options.number(int, low=1))
    p.add_argument("--top-p", type=options.number(above=0, high=1))
    assert p.parse_args(["--k", "3", "--top-p", "1"]).k == 3
    for argv, says in (
        (["--k", "0"], "argument --k: must be >= 1, got 0"),
        (["--k", "1.5"], "argument --k: invalid int value: '1.5'"),
        (["--top-p", "0"], "argument --top-p: must be > 0, got 0"),
        (["--top-p", "1.1"], "argument --top-p: must be <= 1, got 1.1"),
    ):
        with pytest.raises(SystemExit) as ei:
            p.parse_args(argv)
        assert ei.value.code == 2 and says in capsys.readouterr().err
    # the stages' parser: the same words as one UserError (run_main prints one line, exit 2), no usage block
    stage = options.ArgumentParser(prog="x")
    stage.add_argument("--k", type=options.number(int, low=1))
    with pytest.raises(common.UserError, match=r"^argument --k: must be >= 1, got 0$"):
        stage.parse_args(["--k", "0"])
    with pytest.raises(SystemExit) as ei:
        common.run_main(stage.parse_args, ["--k", "0"])
    assert ei.value.code == 2 and capsys.readouterr().err == "error: argument --k: must be >= 1, got 0\n"


def test_embed_backend():
    emb = offline.EmbedBackend()
    texts = [
        "I feel so lonely since my father passed away.",
        "Since my dad died I have felt very alone.",
        "The quarterly tax report is due on Friday.",
        "I feel so lonely since my father passed away.",
    ]
    v = emb.encode(texts)
    assert tuple(v.shape) == (4, 384) and v.dtype == torch.float32
    assert torch.allclose(v.norm(dim=-1), torch.ones(4), atol=1e-5)
    assert torch.equal(v[0], v[3])
    sim = v @ v.T
    assert sim[0, 1] > sim[0, 2] + 0.2
    # a fresh encode of a text, alone or in another batch, gives the same vector
    fresh = offline.EmbedBackend().encode([texts[2], "something else entirely"])
    assert torch.allclose(fresh[0], v[2], atol=1e-5)
    assert tuple(emb.encode([]).shape) == (0, 384)


def test_ask_json_reasks_only_the_unparsable_and_stops_when_the_endpoint_is_down():
    class Fake:
        spec, failures = "api:m", 0

        def __init__(self, answers):
            self.answers, self.asked = answers, []

        def chat(self, prompts, max_tokens, temperature):
            self.asked.append(list(prompts))
            return [self.answers.pop(0) for _ in prompts]

    def parse(i, text):
        return int(text) if text and text.isdigit() else None

    b = Fake(["1", "x", "y", "2", "z"])  # round 1: 1, x, y; round 2 (x, y): 2, z; round 3 (y): -
    assert backends.ask_json(b, ["p0", "p1", "p2"], parse, retries=1) == [1, 2, None]
    assert b.asked == [["p0", "p1", "p2"], ["p1", "p2"]]

    class Down(Fake):
        def chat(self, prompts, max_tokens, temperature):
            self.failures += len(prompts)
            return [None] * len(prompts)

    with pytest.raises(common.UserError, match=r"sage judge api:m: no usable answer for any of 2 cases"):
        backends.ask_json(Down([]), ["a", "b"], parse, retries=2, who="sage judge", noun="cases")
    assert backends.ask_json(Fake(["x", "x"]), ["a", "b"], parse, retries=0) == [None, None]  # up, just unparsable


def test_a_step_logged_again_by_a_resumed_run_is_drawn_once_with_its_last_values(tmp_path, monkeypatch):
    # a kill after step 3 was logged but before its checkpoint: the resumed run logs steps 2 and 3 again
    write_jsonl(
        tmp_path / "metrics.jsonl",
        [
            {"step": 1, "loss": 1.0},
            {"step": 2, "loss": 2.0},
            {"step": 3, "loss": 3.0},
            {"step": 2, "loss": 20.0},
            {"step": 3, "loss": 30.0},
        ],
    )
    figures = []
    monkeypatch.setattr(plots, "save", lambda fig, path: figures.append(fig) or path)
    plots.curves(tmp_path, {"loss": "loss"})
    line = figures[0].axes[0].lines[0]
    assert list(line.get_xdata()) == [1, 2, 3] and list(line.get_ydata()) == [1.0, 20.0, 30.0]
    # the credit picture of such a step: one panel per dialogue, its last copy
    turn = {
        "t": 1,
        "reward": 0.5,
        "G": 0.5,
        "terms": {"A_turn": 1.0, "A_group": 1.0},
        "advantage": 1.0,
        "cut_off": False,
        "judge_failed": False,
    }
    rec = {"step": 2, "scenario_id": "s", "outcome": "timeout", "initial_distance": 5.0, "final_distance": 4.0}
    write_jsonl(
        tmp_path / "rollouts.jsonl",
        [{**rec, "k": k, "turns": [turn]} for k in (0, 1)]
        + [{**rec, "k": k, "turns": [{**turn, "reward": 9.0}]} for k in (0, 1)],
    )
    (tmp_path / "args.json").write_text('{"advantage": "mica", "alpha": 0.4}')
    plots.credit(tmp_path, 2)
    # two columns (the dialogues), two rows: r_t and G_t in the reward's units above, the advantages below
    top, bottom = figures[1].axes[:2], figures[1].axes[2:]
    assert len(figures[1].axes) == 4
    assert all(list(ax.lines[0].get_ydata()) == [9.0] for ax in top)
    assert [line.get_label() for line in top[0].lines[:2]] == ["r_t", "G_t"]
    assert [line.get_label() for line in bottom[0].lines[:3]] == ["A_turn", "A_group", "A"]
    assert "how --advantage mica (alpha 0.4) assigned credit" in figures[1]._suptitle.get_text()
    legend = [x.get_text() for x in top[0].get_legend().get_texts()]
    assert legend == ["r_t", "G_t", "cut off at the cap", "judge failed: out of the loss"]

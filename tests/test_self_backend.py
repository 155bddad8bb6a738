"""--judge self / --user self (the policy's frozen base, its LoRA adapter off, plays the LLM judge and
user) and thinking models (a <think> part reaches neither; the rollout goes on past turn 2). The
generator is patched: judge prompts get judge JSON, user prompts a user line, the policy its reply."""

import argparse
import json

import pytest
import torch

import backends
import common
import conftest
import offline
import sampling
from conftest import JUDGE_OK, USER_OK, ok, run_script
from conftest import env_args as shared_env_args

SCEN = {**conftest.SCEN, "persona": "Ana, 30", "situation": "lost her job"}  # a persona the prompts show
LEVELS = {"C": (1, 0), "A": (1, 0), "P": (0, 0)}  # JUDGE_OK's levels
# Qwen3's rule, cut down to ChatML: earlier replies lose their thinking, and with enable_thinking=False
# the generation prompt holds an empty <think></think>
THINKING_TEMPLATE = (
    "{% for m in messages %}{% set c = m['content'] %}"
    "{% if m['role'] == 'assistant' and '</think>' in c %}"
    "{% set c = c.split('</think>')[-1].lstrip('\\n') %}{% endif %}"
    "{{ '<|im_start|>' + m['role'] + '\\n' + c + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}"
    "{% endif %}"
)


def env_args(env, **over):
    return shared_env_args(env, check=True, **over)


@pytest.fixture
def tiny_lora(tiny):
    """The tiny model with a LoRA adapter whose B is not zero (so the adapter changes the logits)."""
    from peft import LoraConfig, get_peft_model

    base, tok = tiny
    model = get_peft_model(
        base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    )
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.5)
    return model, tok


def lora_layers(model):
    from peft.tuners.tuners_utils import BaseTunerLayer

    return [m for m in model.modules() if isinstance(m, BaseTunerLayer)]


class FakeGenerator:
    """Stands in for sampling.generate_batch (the self judge and user) and 03's TurnCache.generate (the
    policy): install(monkeypatch, env) patches both. Each call is recorded as (kind, adapter off?,
    training?, grad on?, decoded contexts); judge prompts get `judge(text, asked)` (asked: how often this
    very prompt came before), user prompts USER_OK, the policy `policy(row)` plus eos."""

    def __init__(self, model, tok, policy=lambda b: "That sounds so hard.", judge=lambda text, asked: JUDGE_OK):
        self.model, self.tok, self.policy, self.judge = model, tok, policy, judge
        self.calls, self.asked = [], {}

    def install(self, monkeypatch, env):
        monkeypatch.setattr(sampling, "generate_batch", self)
        monkeypatch.setattr(
            env.TurnCache,
            "generate",
            lambda cache, model, tokenizer, contexts, args: self(
                model, tokenizer, contexts, args.max_new_tokens, args.temperature, args.top_p
            ),
        )
        return self

    def __call__(self, model, tokenizer, contexts, max_new_tokens, temperature=0.0, top_p=1.0):
        texts = [tokenizer.decode(c) for c in contexts]
        kind = "judge" if "MDEP-PR" in texts[0] else "user" if "role-playing a person" in texts[0] else "policy"
        off = all(m.disable_adapters for m in lora_layers(self.model))
        self.calls.append((kind, off, self.model.training, torch.is_grad_enabled(), texts))
        out = []
        for b, text in enumerate(texts):
            if kind == "judge":
                answer = self.judge(text, self.asked.get(text, 0))
                self.asked[text] = self.asked.get(text, 0) + 1
            else:
                answer = USER_OK if kind == "user" else self.policy(b)
            ids = tokenizer(answer, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
            out.append(sampling.Reply(ids, True, [0.0] * len(ids)))
        return out

    def kinds(self, kind):
        return [c for c in self.calls if c[0] == kind]


def test_self_judge_and_user_rollout_with_the_adapter_off_while_they_speak(env, tiny_lora, monkeypatch):
    model, tok = tiny_lora
    fake = FakeGenerator(model, tok).install(monkeypatch, env)
    args = env_args(env, judge="self", user="self", k=2, max_turns=3, min_turns=12, max_new_tokens=8)
    judge, user = env.make_judge(args, (model, tok)), env.make_user(args, (model, tok))
    assert judge.backend.kind == user.backend.kind == "self" and judge.backend.model is model  # no weights loaded
    model.train()
    trajs = env.rollout(model, tok, [SCEN], judge, user, args)
    assert [(tr.T, tr.outcome) for tr in trajs] == [(3, "timeout")] * 2
    assert all(tr.levels == [LEVELS] * 3 for tr in trajs)  # the JSON protocol, parsed
    assert all([m["content"] for m in tr.messages if m["role"] == "user"][1:] == [USER_OK] * 2 for tr in trajs)
    # one batched call per turn each; judge and user: adapter off, eval mode, no grad; the policy: adapter on
    assert [c[0] for c in fake.calls] == ["policy", "judge", "user"] * 2 + ["policy", "judge"]
    assert all(len(c[4]) == 2 for c in fake.calls)
    assert all(c[1] and not c[2] and not c[3] for c in fake.kinds("judge") + fake.kinds("user"))
    assert not any(c[1] for c in fake.kinds("policy"))
    # the same JUDGE_PROMPT and USER_PROMPT as the api: backends, through the chat template
    assert "Supporter: That sounds so hard." in fake.kinds("judge")[0][4][0]
    assert "How the conversation is going for you" in fake.kinds("user")[0][4][0]
    # afterwards: the adapter back on, train mode back, requires_grad as it was
    assert not any(m.disable_adapters for m in lora_layers(model)) and model.training
    assert all(p.requires_grad == ("lora" in n) for n, p in model.named_parameters())
    assert backends.api_counts(judge, user) == {}  # no endpoint counters for self


def test_adapters_off_gives_the_base_logits_for_a_peft_model_and_a_wrapped_base(tiny_model):
    """PeftModel: peft's disable_adapter. A plain model that peft wrapped later (05: switch_adapter on the
    base it loaded): its LoRA layers are switched off one by one. Either way the frozen adapters stay frozen."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    plain = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    x = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        base = plain(x).logits
        wrapped = get_peft_model(plain, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
        for n, p in wrapped.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.5)
                p.requires_grad_(False)  # an adapter loaded for inference
        adapted = wrapped(x).logits
        assert not torch.allclose(adapted, base)
        for holder in (wrapped, plain):
            with common.adapters_off(holder):
                assert torch.allclose(wrapped(x).logits, base) and torch.allclose(plain(x).logits, base)
            assert torch.allclose(wrapped(x).logits, adapted)
            assert not any(p.requires_grad for n, p in wrapped.named_parameters() if "lora_B" in n)


def test_malformed_judge_json_is_masked_and_only_the_api_judge_is_asked_again(env, tiny_lora, monkeypatch, loopback):
    """Dialogue 0's judge answers never parse; dialogue 1's parse at the second ask. The api: judge asks
    again (1 + --judge-retries times): dialogue 0's turns are judge_failed (state unchanged), dialogue 1's
    are judged. The self judge decodes greedily, so a second ask would repeat the first answer: it asks
    once, and every malformed answer is a judge_failed turn at once."""
    model, tok = tiny_lora

    def answer(text, asked):
        if "Supporter: reply A" in text:
            return "I would rate this reply as quite good overall."  # no JSON at all
        return '{"C": {"progress": 1}}' if asked == 0 else JUDGE_OK  # invalid, then valid

    def run(judge_spec, **over):
        fake = FakeGenerator(model, tok, policy=lambda b: f"reply {'AB'[b]}", judge=answer).install(monkeypatch, env)
        args = env_args(env, judge=judge_spec, k=2, max_turns=2, min_turns=12, max_new_tokens=8, **over)
        trajs = env.rollout(model, tok, [SCEN], env.make_judge(args, (model, tok)), offline.ScriptedUser(0), args)
        return [(tr.judge_failed, tr.states) for tr in trajs], fake

    got_self, fake = run("self")
    asked_api = {}

    def respond(index, body):
        text = body["messages"][0]["content"]
        asked_api[text] = asked_api.get(text, 0) + 1
        return ok(answer(text, asked_api[text] - 1))

    server = loopback(respond)
    got_api, _ = run("api:judge", api_base=server.base, api_retries=0)
    p0 = SCEN["p0"]
    assert got_api == [([True, True], [p0, p0, p0]), ([False, False], [p0, [-5.0, -8.0, -4.0], [-4.0, -7.0, -4.0]])]
    assert sorted(asked_api.values()) == [2, 2, 3, 3]  # retries=2: up to 3 asks
    assert got_self == [([True, True], [p0, p0, p0])] * 2 and sorted(fake.asked.values()) == [1, 1, 1, 1]


def test_self_backend_with_real_generation_on_the_tiny_model(env, tiny_lora):
    """Not patched: the random model writes no JSON, so each judgement fails (a local judge at temperature 0
    is asked once) and is masked, and the user's junk is a reply all the same; the adapter is on again
    afterwards."""
    model, tok = tiny_lora
    args = env_args(env, judge="self", user="self")
    judge, user = env.make_judge(args, (model, tok)), env.make_user(args, (model, tok))
    hist = [{"role": "user", "content": "I lost my job."}]
    assert judge.judge([{"scenario": SCEN, "history": hist, "reply": "That is hard."}]) == [None]
    answers = user.reply(
        [{"scenario": SCEN, "k": 0, "history": hist + [{"role": "assistant", "content": "Oh."}], "band": "low"}]
    )
    assert len(answers) == 1 and (answers[0] is None or isinstance(answers[0], str))
    assert not any(m.disable_adapters for m in lora_layers(model))


def test_thinking_reply_goes_on_past_turn_2_and_only_the_answer_is_seen(env, tiny_lora, monkeypatch):
    model, tok = tiny_lora
    tok.chat_template = THINKING_TEMPLATE
    thought = "<think>\nShe is grieving; ask about her dad.\n</think>\n\n"
    answer = "That sounds so hard. What happened?"
    prompt = tok.decode(common.render_ids(tok, [{"role": "user", "content": "hi"}]))
    assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # enable_thinking=False
    fake = FakeGenerator(model, tok, policy=lambda b: thought + answer).install(monkeypatch, env)
    args = env_args(env, judge="self", user="self", k=2, max_turns=3, min_turns=12, max_new_tokens=64)
    trajs = env.rollout(model, tok, [SCEN], env.make_judge(args, (model, tok)), env.make_user(args, (model, tok)), args)
    reply_ids = tok(thought + answer, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    for tr in trajs:
        assert tr.T == 3 and tr.outcome == "timeout" and tr.shown == [answer] * 3
        assert all(tr.ids[a:b] == reply_ids for a, b in tr.spans)  # trained on what was generated
        assert [m["content"] for m in tr.messages if m["role"] == "assistant"] == [thought + answer] * 3
    seen = [t for c in fake.kinds("judge") + fake.kinds("user") for t in c[4]]
    assert len(seen) == 2 * 5 and all("grieving" not in t and answer in t for t in seen)
    # the policy's context keeps its own thinking (tokens in, tokens out), unlike a fresh render
    assert all("grieving" in t for t in fake.kinds("policy")[2][4])


@pytest.mark.parametrize(
    "text, shown",
    [
        ("<think>a</think>answer", "answer"),
        ("<think>\na\n</think>\n\nanswer <think>b</think>more", "answer more"),
        ("reasoning the template opened</think>\n\nanswer", "answer"),
        ("answer <think>cut off at the cap", "answer"),
        ("<think>only thinking, cut off", ""),
        ("no thinking at all", "no thinking at all"),
    ],
)
def test_strip_thinking(text, shown):
    assert common.strip_thinking(text) == shown


@pytest.mark.parametrize("ended", [True, False], ids=["ended", "cut"])
def test_next_user_ids_under_a_template_that_drops_thinking(env, tiny_lora, ended):
    _, tok = tiny_lora
    tok.chat_template = THINKING_TEMPLATE
    msgs = [{"role": "system", "content": "be kind"}, {"role": "user", "content": "hello there"}]
    reply = "<think>hm</think>answer"
    full = msgs + [{"role": "assistant", "content": reply}, {"role": "user", "content": "yes it is"}]
    extra = env.next_user_ids(tok, full, reply, "<|im_end|>" if ended else None)
    assert (
        tok.decode(extra)
        == ("\n" if ended else "<|im_end|>\n")
        + "<|im_start|>user\nyes it is<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    with pytest.raises(common.UserError, match="does not keep earlier turns"):  # a reply it does not write
        env.next_user_ids(tok, full, "<think>hm</think>another answer", "<|im_end|>" if ended else None)


def test_flags_help_and_errors(env, capsys):
    args = env.parse_args(["--judge", "self", "--user", "self"])
    assert (args.judge, args.user) == ("self", "self")
    with pytest.raises(SystemExit):
        env.parse_args(["--help"])
    helptext = " ".join(capsys.readouterr().out.split())
    assert "embed | self | hf:<model-or-path> | api:<model>" in helptext
    assert "scripted | self | hf:<model-or-path> | api:<model>" in helptext
    args.judge, args.user = "embed", "selfish"
    with pytest.raises(common.UserError, match="--user must be scripted, self, hf:<model> or api:<model>"):
        env.check_env_args(args)
    with pytest.raises(common.UserError, match="backend 'self' is the policy's own base model, and none"):
        env.make_user(argparse.Namespace(**{**vars(args), "user": "self"}))


def test_rollout_script_with_self_judge_and_user(tiny_model, tmp_path):
    p = run_script(
        "03_rollout.py",
        "--model",
        tiny_model,
        "--num-scenarios",
        "1",
        "--k",
        "2",
        "--judge",
        "self",
        "--user",
        "self",
        "--max-new-tokens",
        "6",
        "--max-turns",
        "2",
        "--no-progress",
        "--quiet",
        "--out-dir",
        tmp_path,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    recs = [json.loads(line) for d in tmp_path.iterdir() for line in (d / "rollouts.jsonl").read_text().splitlines()]
    assert len(recs) == 2 and all(t["judge_failed"] for r in recs for t in r["turns"])  # junk JSON: masked
    assert "judge failed on" in p.stdout

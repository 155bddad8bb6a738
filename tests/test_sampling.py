"""Sampling is scoring (issue 55): whatever generation_config.json, chat template, end-of-turn ids, pad token or
final-logit transform a model ships, the rollout (03, with the KV cache between turns) and 02's rubric sampling
draw every token from the distribution the update's token_logprobs scores, and 04 logs the gap.

Each model here stands in for a real one: the tiny random Qwen2 of conftest.py with a published generation config
(Qwen2.5-7B-Instruct's), with a Llama-3.1-like template (a bos token in the template, a dated system header,
<|eot_id|> as eos and pad, three end-of-turn ids), with a Qwen2.5-like template (a default system prompt), and
tiny Gemma 2, Cohere and Granite models (soft-capped or scaled final logits)."""

import importlib
import json
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

import common
import offline
import sampling
from conftest import CHATML, SCEN, env_args, policy_args, run_script

# Qwen2.5-7B-Instruct's published generation_config.json (its sampling fields), and a no_repeat_ngram_size that
# bans every repeated token: each would change what generate samples if it leaked in
QWEN25_GENERATION = {"do_sample": True, "repetition_penalty": 1.05, "temperature": 0.7, "top_p": 0.8, "top_k": 20}
LEAKS = {**QWEN25_GENERATION, "no_repeat_ngram_size": 1, "typical_p": 0.5, "min_p": 0.2}
# Qwen2.5-Instruct's rule, cut down to ChatML: a conversation without a system message gets a default one
QWEN25_TEMPLATE = (
    "{% if messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. "
    "You are a helpful assistant.<|im_end|>\n' }}{% endif %}" + CHATML
)
# Llama 3.1's shape: bos in the template, a system header with today's date, <|eot_id|> after every message
LLAMA31_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{% set system = messages[0]['content'] %}"
    "{% set rest = messages[1:] %}{% else %}{% set system = '' %}{% set rest = messages %}{% endif %}"
    "{{ '<|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December 2023\nToday Date: ' "
    "+ strftime_now('%d %b %Y') + '\n\n' + system + '<|eot_id|>' }}"
    "{% for m in rest %}{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\n\n' + m['content'] | trim "
    "+ '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
LLAMA31_SPECIALS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>"]


class MildJudge:
    """Every reply is judged C+1 A+1: the dialogues go on to --max-turns."""

    def judge(self, cases):
        return [{"levels": {"C": (1, 0), "A": (1, 0), "P": (0, 0)}, "features": {}} for _ in cases]


def with_generation_config(tiny_model, folder, fields: dict) -> str:
    """A copy of the tiny model whose generation_config.json also holds `fields`."""
    shutil.copytree(tiny_model, folder)
    path = folder / "generation_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **fields}))
    return str(folder)


def llama31_like(tiny_model, folder) -> str:
    """The tiny model with Llama 3.1's template shape: its specials added, <|eot_id|> the eos and the pad (Llama
    3.1 ships no pad token), and three end-of-turn ids in its generation config."""
    shutil.copytree(tiny_model, folder)
    tok = common.load_tokenizer(str(folder))
    tok.add_special_tokens({"additional_special_tokens": LLAMA31_SPECIALS})
    tok.bos_token, tok.eos_token, tok.pad_token = "<|begin_of_text|>", "<|eot_id|>", "<|eot_id|>"
    tok.chat_template = LLAMA31_TEMPLATE
    tok.save_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    model.resize_token_embeddings(len(tok))
    ends = [tok.convert_tokens_to_ids(t) for t in ("<|eot_id|>", "<|eom_id|>", "<|endoftext|>")]
    model.generation_config.eos_token_id = ends
    model.config.eos_token_id, model.config.pad_token_id = ends, tok.pad_token_id
    model.save_pretrained(folder)
    return str(folder)


def template_after_a_reply(tok, user_message: str, cut_off: bool) -> str:
    """The template's text from the end of a reply to the next generation prompt (the new user message in it);
    when the reply ended, without the end-of-turn token the reply already holds."""
    messages = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "U"},
        {"role": "assistant", "content": "REPLY"},
        {"role": "user", "content": user_message},
    ]
    after = common.chat_text(tok, messages).split("REPLY", 1)[1]
    return after if cut_off else after.split(tok.eos_token, 1)[1]


def sampled_and_scored(trainer, env, model, tok, temperature=1.0, turns=3, **over):
    """A rollout of 1 scenario x K=4 for `turns` turns with the KV cache kept between them, then the update's
    own log-probabilities of every reply token (04's samples, collate and token_logprobs, train mode as in
    policy_update) beside the sampler's: (trajectories, sampler [N], scorer [N])."""
    args = env_args(
        env, check=True, k=4, max_turns=turns, min_turns=turns, max_new_tokens=16, temperature=temperature, **over
    )
    trajs = env.rollout(model, tok, [SCEN], MildJudge(), offline.ScriptedUser(0), args)
    samples = trainer.as_samples(trajs)
    ids, attn, mask = trainer.collate(samples, tok.pad_token_id, "cpu")
    model.train()
    with torch.no_grad():
        scorer = sampling.token_logprobs(model, ids, attn, mask, temperature)
    sampler = torch.cat([s.sampler_logprobs() for s in samples])
    return trajs, sampler, scorer


def load(path):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), common.load_tokenizer(path)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_the_rollout_samples_what_the_update_scores_with_qwens_generation_config(
    env, trainer, tiny_model, tmp_path, temperature
):
    """On main at 5661f0a this failed: 279 of 284 reply tokens differed by more than 1e-4 (mean 0.0015, largest
    0.032), the model's repetition_penalty and no_repeat_ngram_size applying inside generate."""
    model, tok = load(with_generation_config(tiny_model, tmp_path / "qwen-gc", LEAKS))
    assert model.generation_config.repetition_penalty == 1.05 and model.generation_config.top_k == 20
    trajs, sampler, scorer = sampled_and_scored(trainer, env, model, tok, temperature)
    assert [tr.T for tr in trajs] == [3, 3, 3, 3] and len(sampler) == len(scorer) > 100
    assert (sampler - scorer).abs().max() < 1e-4
    # no_repeat_ngram_size 1 would have banned every token the context already holds: the replies repeat some
    assert any(set(tr.ids[s:e]) & set(tr.ids[:s]) for tr in trajs for s, e in tr.spans)


def test_the_models_own_settings_apply_only_where_asked(tiny_model, tmp_path):
    """The same contexts sampled from the same seed: with model_settings=True (05's benchmarks) the model's
    generation_config changes the draws; without it, not (the draws equal those of a model with a clean one)."""
    leaky = with_generation_config(tiny_model, tmp_path / "leaky", LEAKS)
    contexts = [[5, 6, 7, 8, 9, 10, 11, 12]] * 4
    draws = {}
    for name, path, own in (("clean", tiny_model, False), ("scratch", leaky, False), ("own", leaky, True)):
        model, tok = load(path)
        torch.manual_seed(1)
        draws[name] = [r.ids for r in sampling.generate_batch(model, tok, contexts, 12, 1.0, model_settings=own)]
    assert draws["scratch"] == draws["clean"]
    assert draws["own"] != draws["clean"]
    # no_repeat_ngram_size 1: under the model's own settings no token repeats within a context and its reply
    assert all(not set(reply) & set(contexts[0]) for reply in draws["own"])


def test_rubric_sampling_scores_what_it_samples(trainer, tiny_model, tmp_path):
    """02: the G rubrics sampled per context (01's generate_rubrics) against 02's rubric_logprobs, with the
    penalties in the generation config and a LoRA adapter on, as 02 trains."""
    rl = importlib.import_module("02_rubric_pref_rl")
    from peft import LoraConfig, get_peft_model

    model, tok = load(with_generation_config(tiny_model, tmp_path / "qwen-gc", LEAKS))
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, task_type="CAUSAL_LM"))
    contexts = [[{"role": "user", "content": "I lost my job today."}]] * 3 + [[{"role": "user", "content": "hi"}]]
    for temperature in (1.0, 0.7):
        gens = rl.sft.generate_rubrics(model, tok, contexts, 24, temperature, batch_size=4)
        samples = [{"ids": g.prompt_ids + g.ids, "start": len(g.prompt_ids)} for g in gens]
        model.train()
        with torch.no_grad():
            scorer = rl.rubric_logprobs(model, samples, tok.pad_token_id, temperature)
        sampler = torch.tensor([x for g in gens for x in g.logprobs])
        assert len(sampler) == len(scorer) > 50
        assert (sampler - scorer).abs().max() < 1e-4


def test_04_logs_the_sampler_gap_and_it_is_zero_in_fp32(tiny_model, tmp_path):
    """One 04 step on the model with Qwen's generation config: metrics.jsonl holds sampler_gap_mean and _max,
    both below 1e-4 in fp32 on the CPU (rounding only), and the step line prints them."""
    leaky = with_generation_config(tiny_model, tmp_path / "qwen-gc", LEAKS)
    out = tmp_path / "runs"
    p = run_script(
        "04_mica_train.py",
        *("--model", leaky, "--steps", "1", "--scenarios-per-step", "2", "--max-new-tokens", "12"),
        *("--out-dir", out, "--no-progress"),
    )
    assert p.returncode == 0, p.stderr[-3000:]
    (metrics,) = [json.loads(line) for line in next(out.glob("mica-*/metrics.jsonl")).read_text().splitlines()]
    assert 0 <= metrics["sampler_gap_mean"] <= metrics["sampler_gap_max"] < 1e-4
    assert "sampler_gap_mean" in p.stdout and "sampler_gap_max" in p.stdout


@pytest.mark.parametrize("template", ["qwen2.5", "llama3.1"])
def test_the_rollout_keeps_tokens_in_tokens_out_under_real_templates(env, trainer, tiny_model, tmp_path, template):
    """Qwen2.5's default system prompt and Llama 3.1's bos, dated system header, <|eot_id|> as eos and pad and
    three end-of-turn ids: a 3-turn rollout still scores what it sampled, each context is exactly what the
    template renders for the dialogue (one bos), and every ended reply carries its end-of-turn token into the
    loss (pad = eos masks nothing: the loss mask comes from the spans)."""
    if template == "llama3.1":
        path = llama31_like(tiny_model, tmp_path / "llama")
    else:
        path = str(tmp_path / "qwen")
        shutil.copytree(tiny_model, path)
        tok = common.load_tokenizer(path)
        tok.chat_template = QWEN25_TEMPLATE
        tok.save_pretrained(path)
    model, tok = load(path)
    trajs, sampler, scorer = sampled_and_scored(trainer, env, model, tok)
    assert (sampler - scorer).abs().max() < 1e-4
    ends = sampling.end_of_turn_ids(model, tok)
    assert len(ends) == (3 if template == "llama3.1" else 1)
    for tr in trajs:
        # outside the replies, the context is the template's own text: the opening as rendered (one bos, no
        # default system prompt: the policy's own system message is there), then between two replies what the
        # template writes after a reply, less the end-of-turn token the reply sampled
        outside = tr.ids[: tr.spans[0][0]]
        assert outside == common.render_ids(tok, tr.messages[:2])
        for t in range(1, tr.T):
            between = tr.ids[tr.spans[t - 1][1] : tr.spans[t][0]]
            outside += between
            assert tok.decode(between) == template_after_a_reply(
                tok, tr.messages[2 * t + 1]["content"], tr.cut_off[t - 1]
            )
        assert outside.count(tok.bos_token_id) == (1 if template == "llama3.1" else 0)
        assert "You are Qwen" not in tok.decode(outside)
        for (s, e), cut in zip(tr.spans, tr.cut_off):
            assert cut or tr.ids[e - 1] in ends  # an ended reply's last scored token is its end of turn
    if template == "llama3.1":
        assert tok.pad_token_id == tok.eos_token_id


def test_a_turn_ends_at_any_of_the_models_end_of_turn_ids(tiny_model, tmp_path):
    """generation_config.eos_token_id a list (Llama 3.1: three, Qwen2.5: two): a reply ends at the first of any,
    not only at the tokenizer's eos_token. Greedy, the tiny model's first token is fixed: made an end-of-turn id,
    the reply is that one token, ended."""
    model, tok = load(tiny_model)
    context = [[5, 6, 7, 8, 9, 10]]
    first = sampling.generate_batch(model, tok, context, 4, 0.0)[0].ids[0]
    assert first != tok.eos_token_id
    model.generation_config.eos_token_id = [tok.eos_token_id, first]
    assert sampling.end_of_turn_ids(model, tok) == sorted({tok.eos_token_id, first})
    (reply,) = sampling.generate_batch(model, tok, context, 4, 0.0)
    assert reply.ids == [first] and reply.ended


def tiny_with_final_logits(kind: str, out) -> str:
    """A tiny Gemma 2 (final_logit_softcapping), Cohere (logit_scale) or Granite (logits_scaling) with the
    project's tiny tokenizer; the values are exaggerated so that a random model's small logits feel them."""
    from transformers import (
        CohereConfig,
        CohereForCausalLM,
        Gemma2Config,
        Gemma2ForCausalLM,
        GraniteConfig,
        GraniteForCausalLM,
    )

    tok = common.load_tokenizer(str(out.parent / "tok"))
    shape = dict(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        bos_token_id=None,
    )
    config, cls = {
        "gemma2": (Gemma2Config(**shape, final_logit_softcapping=0.5, attn_logit_softcapping=None), Gemma2ForCausalLM),
        "cohere": (CohereConfig(**shape, logit_scale=8.0), CohereForCausalLM),
        "granite": (GraniteConfig(**shape, logits_scaling=0.125), GraniteForCausalLM),
    }[kind]
    torch.manual_seed(0)
    model = cls(config)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return str(out)


@pytest.mark.parametrize("kind", ["gemma2", "cohere", "granite"])
def test_soft_capped_or_scaled_logits_are_scored_as_the_forward_gives_them(env, trainer, tiny_model, tmp_path, kind):
    """token_logprobs runs the LM head itself, not the model's forward: without sampling.final_logits the rollout
    (whose logits come from the forward) and the update would score different distributions."""
    shutil.copytree(tiny_model, tmp_path / "tok")
    model, tok = load(tiny_with_final_logits(kind, tmp_path / kind))
    assert sampling.scoring_gap(model) <= 0.5  # load_policy passes it: the transform is known
    _, sampler, scorer = sampled_and_scored(trainer, env, model, tok, turns=2)
    assert (sampler - scorer).abs().max() < 1e-4
    # and the transform matters here: the head's raw output is not what the forward gives
    x = torch.linspace(-4, 4, 9)
    assert (sampling.final_logits(model.config, x) - x).abs().max() > 1


def test_an_unknown_transform_of_the_final_logits_stops_the_load(tiny_model, monkeypatch):
    """A model whose forward changes its logits in a way final_logits does not know: one line, before training."""
    model, _ = load(tiny_model)
    assert sampling.scoring_gap(model) <= 0.5
    forward = model.forward

    def scaled(*args, **kwargs):
        out = forward(*args, **kwargs)
        out.logits = out.logits * 40.0
        return out

    model.forward = scaled
    gap = sampling.scoring_gap(model)
    assert gap > 0.5
    # load_policy measures the gap of the model it loaded and stops with one line
    monkeypatch.setattr(sampling, "scoring_gap", lambda m: gap)
    args = policy_args(
        tiny_model,
    )
    with pytest.raises(common.UserError, match="differs from the model's own forward"):
        common.load_policy(args, trainable=False)


def test_bf16_drift_is_what_the_gap_measures(env, trainer, tiny_model):
    """A bf16 model samples from bf16 logits and the update scores in bf16 too, along another path (the whole
    context at once, not token by token from the KV cache): the gap is the rounding between the two, larger
    than fp32's and still small. It is measured, not hidden (docs/training.md: what values mean trouble)."""
    model, tok = load(tiny_model)
    _, sampler32, scorer32 = sampled_and_scored(trainer, env, model, tok, turns=2)
    model = model.to(torch.bfloat16)
    _, sampler16, scorer16 = sampled_and_scored(trainer, env, model, tok, turns=2)
    gap32, gap16 = (sampler32 - scorer32).abs().max(), (sampler16 - scorer16).abs().max()
    assert gap32 < 1e-5 and gap32 < gap16 < 0.5


def test_gradient_checkpointing_keeps_the_kv_cache_and_the_gap(env, trainer, tiny_model):
    """The gpu preset trains with gradient checkpointing (use_cache off in the model's config, as load_policy
    sets it): the rollout still keeps each dialogue's KV cache between turns (eval mode: checkpointing inactive,
    generate asks for the cache), samples the same tokens, and the update's forward (train mode, recomputed
    activations) scores them as sampled."""
    model, tok = load(tiny_model)
    torch.manual_seed(3)
    plain, sampler, scorer = sampled_and_scored(trainer, env, model, tok)
    model.activation_checkpointing_enable()
    model.config.use_cache = False
    torch.manual_seed(3)
    checkpointed, sampler_ckpt, scorer_ckpt = sampled_and_scored(trainer, env, model, tok)
    assert [tr.ids for tr in checkpointed] == [tr.ids for tr in plain]
    assert (sampler_ckpt - scorer_ckpt).abs().max() < 1e-4 and torch.equal(sampler_ckpt, sampler)

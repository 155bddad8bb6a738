"""The batched token-in/token-out rollout on a tiny random model, with a stub judge."""

import argparse
import re

import pytest
import torch
from accelerate import Accelerator

import common
import offline
import sampling
from conftest import SCEN, env_args, policy_args, run_script


class StubJudge:
    """Returns the given levels turn after turn (None = a failed judgement)."""

    def __init__(self, script):
        self.script, self.calls = script, 0

    def judge(self, cases):
        out = []
        for _ in cases:
            lv = self.script[min(self.calls, len(self.script) - 1)]
            out.append(None if lv is None else {"levels": lv, "features": {}})
        self.calls += 1
        return out


@pytest.mark.parametrize(
    "reply, ended, user",
    [
        ("That sounds hard.", True, "yes it is"),
        ("That sounds hard.", False, "yes it is"),
        ("", True, "are you there?"),  # an empty reply: the model ended at once
    ],
    ids=["ended", "cut", "empty_reply"],
)
def test_next_user_ids_reproduces_the_template(env, tiny, reply, ended, user):
    _, tok = tiny
    msgs = [{"role": "system", "content": "be kind"}, {"role": "user", "content": "hello there"}]
    ids = common.render_ids(tok, msgs) + (tok(reply, add_special_tokens=False)["input_ids"] if reply else [])
    ids += [tok.eos_token_id] if ended else []
    full = msgs + [{"role": "assistant", "content": reply}, {"role": "user", "content": user}]
    ids += env.next_user_ids(tok, full, reply, tok.eos_token if ended else None)
    assert tok.decode(ids) == tok.apply_chat_template(full, tokenize=False, add_generation_prompt=True)


def test_next_user_ids_when_the_turn_ends_with_a_token_other_than_eos(env, tiny):
    # a model whose generation config ends a turn with the template's <|im_end|> while the tokenizer's
    # eos_token is another token: the sampled <|im_end|> is not written a second time
    _, tok = tiny
    tok.eos_token = "<|endoftext|>"
    msgs = [{"role": "system", "content": "be kind"}, {"role": "user", "content": "hello there"}]
    ids = common.render_ids(tok, msgs) + tok("That sounds hard.", add_special_tokens=False)["input_ids"]
    ids += tok("<|im_end|>", add_special_tokens=False)["input_ids"]
    full = msgs + [{"role": "assistant", "content": "That sounds hard."}, {"role": "user", "content": "yes"}]
    ids += env.next_user_ids(tok, full, "That sounds hard.", tok.decode(ids[-1:]))
    assert tok.decode(ids) == tok.apply_chat_template(full, tokenize=False, add_generation_prompt=True)
    assert tok.decode(ids).count("<|im_end|>") == 4  # system, user, reply, new user: once each


def test_rollout_states_rewards_and_spans(env, trainer, tiny):
    model, tok = tiny
    # the REFERENCE worked example: v = (1,3,0), (-1,1,1), (3,-1,1) on P0 = (-6,-9,-4)
    script = [
        {"C": (1, 0), "A": (2, 0), "P": (0, 0)},
        {"C": (1, 1), "A": (1, 0), "P": (1, 0)},
        {"C": (2, 0), "A": (1, 1), "P": (1, 0)},
    ]
    args = env_args(env, k=3, max_turns=3, min_turns=12, max_new_tokens=6)
    torch.manual_seed(0)
    trajs = env.rollout(model, tok, [SCEN], StubJudge(script), offline.ScriptedUser(0), args)
    assert len(trajs) == 3
    for tr in trajs:
        assert tr.T == 3 and tr.outcome == "timeout"
        assert tr.states == [[-6, -9, -4], [-5, -6, -4], [-6, -5, -3], [-3, -6, -2]]
        assert sum(tr.dEs) == pytest.approx(4.596, abs=1e-3)
        rec = env.trajectory_record(tr, args)
        assert [t["reward"] for t in rec["turns"]] == pytest.approx([2.828, 0.363, 1.231], abs=1e-3)
        assert rec["final_distance"] == pytest.approx(5.4772, abs=1e-4)
        # every reply span holds the sampled ids: 1..6 tokens, the eos only as the last one
        for (s, e), cut, msg in zip(tr.spans, tr.cut_off, [m for m in tr.messages if m["role"] == "assistant"]):
            assert 1 <= e - s <= 6
            body = tr.ids[s:e] if cut else tr.ids[s : e - 1]
            assert tok.eos_token_id not in body
            assert tok.decode(body, skip_special_tokens=True).strip() == msg["content"]
        # the user's lines follow the trend: turn 1 dE > 0.5 -> better
        assert tr.messages[3]["content"] == "That helps."
    # the loss mask covers exactly the reply tokens
    ids, attn, mask = trainer.collate(trainer.as_samples(trajs), tok.pad_token_id, "cpu")
    assert int(mask.sum()) == sum(e - s for tr in trajs for s, e in tr.spans)
    assert int(attn.sum()) == sum(len(tr.ids) for tr in trajs)


def rewards_of(trainer, tr, targs, graders=None):
    """04's training reward per turn of one dialogue: its --reward parts by name, then turn_rewards."""
    return trainer.turn_rewards(trainer.reward_parts([tr], targs, graders)[0][0], tr, targs)[0]


def test_failed_judgement_is_flagged_and_left_out(env, trainer, tiny):
    model, tok = tiny
    script = [{"C": (1, 0), "A": (2, 0), "P": (0, 0)}, None, {"C": (2, 0), "A": (1, 1), "P": (1, 0)}]
    args = env_args(env, k=2, max_turns=3, min_turns=12, max_new_tokens=4)
    trajs = env.rollout(model, tok, [SCEN], StubJudge(script), offline.ScriptedUser(0), args)
    tr = trajs[0]
    assert tr.judge_failed == [False, True, False]
    assert tr.states[2] == tr.states[1]  # the state does not move
    targs = argparse.Namespace(
        idr_weights=(1, 1, 1),
        eps=1.0,
        cut_off_penalty=0.0,
        reward_weights={"idr": 1.0},
        kardia_format=False,
        care_distance="plain",
    )
    r = rewards_of(trainer, tr, targs)
    assert r[1] == pytest.approx((r[0] + r[2]) / 2)  # filled with the mean valid reward
    ids, attn, mask = trainer.collate(trainer.as_samples(trajs), tok.pad_token_id, "cpu")
    s, e = tr.spans[1]
    assert int(mask[0, s:e].sum()) == 0 and trainer.as_samples([tr])[0].n_tokens() == int(mask[0].sum())
    rec = env.trajectory_record(tr, args)
    assert rec["turns"][1]["judge_failed"] and rec["turns"][1]["v"] is None


def test_cutoff_penalty(env, trainer, tiny):
    model, tok = tiny
    args = env_args(env, k=2, max_turns=2, min_turns=12, max_new_tokens=1)
    trajs = env.rollout(
        model, tok, [SCEN], StubJudge([{"C": (0, 0), "A": (0, 0), "P": (0, 0)}]), offline.ScriptedUser(0), args
    )
    tr = trajs[0]
    targs = argparse.Namespace(
        idr_weights=(1, 1, 1),
        eps=1.0,
        cut_off_penalty=0.5,
        reward_weights={"idr": 1.0},
        kardia_format=False,
        care_distance="plain",
    )
    assert any(tr.cut_off)
    expected = [-0.5 * 3**0.5 if cut else 0.0 for cut in tr.cut_off]  # half a level-1 turn's IDR, sqrt(3)
    assert rewards_of(trainer, tr, targs) == pytest.approx(expected)


@pytest.mark.parametrize(
    "reward, weights, options, penalty",
    [
        ({"idr": 1.0}, (1, 1, 1), {}, 0.5 * 3**0.5),  # IDR: a level-1 turn on every axis moves d by sqrt(3)
        ({"idr": 1.0}, (4, 0, 0), {}, 0.5 * 2.0),  # weighted distance: sqrt(w_C + w_A + w_P)
        ({"rlver": 1.0}, (1, 1, 1), {}, 0.5 * 0.1),  # RLVER: at most 10 emotion points / 100 a turn
        ({"care": 1.0}, (1, 1, 1), {}, 0.5),  # CARE: scores and weights in [0, 1]
        ({"kardia": 1.0}, (1, 1, 1), {}, 0.5),  # Kardia-R1: the mean criterion score in [0, 1]
        ({"kardia": 1.0}, (1, 1, 1), {"kardia_format": True}, 0.5),  # full marks, sections present: r_fmt 0
        ({"idr": 1.0, "rlver": 0.5}, (1, 1, 1), {}, 0.5 * (3**0.5 + 0.05)),  # a sum: weighted like the reward
        # idr+care with the rubric weighting the distance: 3 w_t sums to 3 whatever --idr-weights say; plain: theirs
        ({"idr": 1.0, "care": 1.0}, (4, 0, 0), {"care_distance": "weighted"}, 0.5 * (3**0.5 + 1)),
        ({"idr": 1.0, "care": 1.0}, (4, 0, 0), {}, 0.5 * (2.0 + 1)),
    ],
)
def test_cutoff_penalty_is_in_each_rewards_units(trainer, reward, weights, options, penalty):
    args = argparse.Namespace(
        **{
            "idr_weights": weights,
            "cut_off_penalty": 0.5,
            "reward_weights": reward,
            "kardia_format": False,
            "care_distance": "plain",
            **options,
        }
    )
    assert trainer.cut_off_penalty(args) == pytest.approx(penalty)


def test_token_logprobs_match_full_forward(trainer, tiny, env):
    model, tok = tiny
    args = env_args(env, k=2, max_turns=2, min_turns=12, max_new_tokens=5)
    trajs = env.rollout(
        model, tok, [SCEN], StubJudge([{"C": (1, 0), "A": (1, 0), "P": (1, 0)}]), offline.ScriptedUser(0), args
    )
    ids, attn, mask = trainer.collate(trainer.as_samples(trajs), tok.pad_token_id, "cpu")
    with torch.no_grad():
        lp = sampling.token_logprobs(model, ids, attn, mask)
        full = torch.log_softmax(model(input_ids=ids, attention_mask=attn).logits.float(), -1)
    ref = full[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)[mask[:, 1:].bool()]
    assert lp.shape == ref.shape and torch.allclose(lp, ref, atol=1e-5)


def test_token_logprobs_in_chunks_equal_in_one_piece(trainer, tiny, env, monkeypatch):
    """A long micro-batch's logits are computed (and recomputed in backward) in chunks: same values,
    same gradients as in one piece."""
    model, tok = tiny
    args = env_args(env, k=2, max_turns=2, min_turns=12, max_new_tokens=5)
    trajs = env.rollout(
        model, tok, [SCEN], StubJudge([{"C": (1, 0), "A": (1, 0), "P": (1, 0)}]), offline.ScriptedUser(0), args
    )
    ids, attn, mask = trainer.collate(trainer.as_samples(trajs), tok.pad_token_id, "cpu")
    out = []
    for chunk in (sampling.LOGIT_CHUNK, 3 * model.config.vocab_size):  # one piece; 3 rows a chunk
        monkeypatch.setattr(sampling, "LOGIT_CHUNK", chunk)
        model.zero_grad()
        lp = sampling.token_logprobs(model, ids, attn, mask, temperature=0.7)
        (lp * torch.linspace(-1, 1, len(lp))).sum().backward()
        out.append((lp.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]))
    assert len(out[0][0]) > 3 and torch.allclose(out[0][0], out[1][0], atol=1e-6)
    assert len(out[0][1]) == len(out[1][1]) > 0
    for g1, g2 in zip(out[0][1], out[1][1]):
        # the chunks sum the same terms in another order: equal up to float32 rounding, relative to the
        # gradient's own scale (an absolute 1e-6 failed on some CPUs' BLAS for the tied embedding)
        assert (g1 - g2).abs().max() <= 1e-5 * g2.abs().max() + 1e-8, ((g1 - g2).abs().max(), g2.abs().max())


def test_emotion_is_kept_and_rlver_rewards_and_end_rule(env, trainer, tiny):
    model, tok = tiny
    # levels of the worked example: v = (1,3,0), (-1,1,1), (3,-1,1) -> sum v = 4, 1, 3
    # change = clip(2.5 * sum v, -10, 10) = 10, 2.5, 7.5;  e = 30 -> 40 -> 42.5 -> 50
    script = [
        {"C": (1, 0), "A": (2, 0), "P": (0, 0)},
        {"C": (1, 1), "A": (1, 0), "P": (1, 0)},
        {"C": (2, 0), "A": (1, 1), "P": (1, 0)},
    ]
    args = env_args(env, k=2, max_turns=3, min_turns=12, max_new_tokens=4)
    tr = env.rollout(model, tok, [SCEN], StubJudge(script), offline.ScriptedUser(0), args)[0]
    assert tr.emotions == [30.0, 40.0, 42.5, 50.0]
    assert trainer.rlver_emotion_rewards(tr.emotions) == pytest.approx([0.1, 0.025, 0.075])
    targs = argparse.Namespace(
        idr_weights=(1, 1, 1),
        eps=1.0,
        cut_off_penalty=0.0,
        reward_weights={"idr": 1.0, "rlver": 0.5},
        kardia_format=False,
        care_distance="plain",
    )
    assert rewards_of(trainer, tr, targs) == pytest.approx([2.828 + 0.05, 0.363 + 0.0125, 1.231 + 0.0375], abs=1e-3)
    rec = env.trajectory_record(tr, args)
    assert [t["emotion"] for t in rec["turns"]] == [40.0, 42.5, 50.0] and rec["final_emotion"] == 50.0
    # RLVER's end rule: from 95, +10 reaches 100 at once -> success; from 12, an off-topic reply -> failure
    hi = env.rollout(
        model,
        tok,
        [SCEN],
        StubJudge(script),
        offline.ScriptedUser(0),
        env_args(env, k=2, max_turns=3, max_new_tokens=4, emotion_start=95.0, emotion_ends=True),
    )
    assert all(t.outcome == "success" and t.T == 1 and t.emotions == [95.0, 100.0] for t in hi)
    off = [{"C": (0, 1), "A": (0, 1), "P": (0, 0)}]  # sum v = -4 -> change -10
    lo = env.rollout(
        model,
        tok,
        [SCEN],
        StubJudge(off),
        offline.ScriptedUser(0),
        env_args(env, k=2, max_turns=3, max_new_tokens=4, emotion_start=12.0, emotion_ends=True),
    )
    assert all(t.outcome == "failure" and t.emotions == [12.0, 2.0] for t in lo)


def test_reward_spec(trainer):
    assert trainer.parse_reward_spec("idr") == {"idr": 1.0}
    assert trainer.parse_reward_spec("idr + 0.5*rlver") == {"idr": 1.0, "rlver": 0.5}
    for bad, msg in (("empathy", "unknown component 'empathy'"), ("x*rlver", "'x' in 'x*rlver' is not a number")):
        with pytest.raises(common.UserError, match=re.escape(msg)):
            trainer.parse_reward_spec(bad)


@pytest.fixture(scope="module")
def tiny_rubric_adapter(tiny_model, tmp_path_factory):
    """A LoRA adapter on the tiny model standing in for 02's frozen generator (it writes no valid
    rubric, so every turn falls back to the uniform one: the plumbing is what is tested)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    out = tmp_path_factory.mktemp("rubric_adapter")
    m = get_peft_model(
        AutoModelForCausalLM.from_pretrained(tiny_model),
        LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"], task_type="CAUSAL_LM"),
    )
    m.save_pretrained(out)
    return str(out)


def test_care_reward_turn_by_turn(trainer):
    class Fake:  # 1.0 on every criterion that shares a word with the reply, else 0.0
        def score(self, items):
            return [[float(any(w in it["reply"].split() for w in c.split())) for c in it["criteria"]] for it in items]

    msgs = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "u1"},
        {"role": "assistant", "content": "feelings matter"},
        {"role": "user", "content": "u2"},
        {"role": "assistant", "content": "try one step"},
    ]
    rb = {
        "weights": {"cognitive": 0.2, "affective": 0.5, "proactive": 0.3},
        "criteria": {"cognitive": ["situation"], "affective": ["feelings", "warmth"], "proactive": ["step"]},
    }
    tr = trainer.env.Trajectory(
        scenario={}, k=0, ids=[], messages=msgs, spans=[(0, 1), (1, 2)], shown=["feelings matter", "try one step"]
    )
    tr.extra["rubrics"] = [rb, rb]
    # turn 1: s = (0, (1 + 0)/2, 0) -> 0.5 * 0.5 = 0.25;  turn 2: s = (0, 0, 1) -> 0.3
    graders = trainer.sft.Graders(criteria_judge=Fake())
    assert trainer.sft.care_rewards([tr], argparse.Namespace(), graders) == [pytest.approx([0.25, 0.3])]
    assert trainer.REWARDS["care"].score is trainer.sft.care_rewards  # 04 names it, 01 holds its loop


def test_kardia_format_and_reward(env, trainer):
    good = (
        "<understanding>She lost her job.</understanding> <reasoning>Validate first.</reasoning>"
        "<emotion>fear</emotion><response>That sounds frightening. What worries you most?</response>"
    )
    assert env.kardia_response(good) == ("That sounds frightening. What worries you most?", True)
    assert env.kardia_response("<response>Only this.</response>") == ("Only this.", False)  # sections missing
    assert (
        env.kardia_response(good.replace("What worries you most?", "").replace("That sounds frightening.", ""))[1]
        is False
    )  # empty response
    assert env.kardia_response("plain reply") == ("plain reply", False)

    sft = trainer.sft
    assert sft.kardia_section(good, "emotion") == "fear" and sft.kardia_section("plain reply", "emotion") == ""

    class Fake:  # the reply's four axes score 1, 0.5, 0.5, 1; emotion accuracy 1 if "fear" is named, else 0
        def __init__(self):
            self.items = []

        def score(self, items):
            self.items += items
            return [
                [1.0, 0.5, 0.5, 1.0] if len(it["criteria"]) == 4 else [float("fear" in it["reply"])] for it in items
            ]

    tr = env.Trajectory(
        scenario={"persona": "a nurse", "profile": {"MBTI": "INFJ"}},
        k=0,
        ids=[],
        messages=[
            {"role": "user", "content": "u"},
            {"role": "assistant", "content": good},
            {"role": "user", "content": "I am scared"},
            {"role": "assistant", "content": "x"},
        ],
        spans=[(0, 1), (1, 2)],
        shown=["That sounds frightening.", "x"],
        formatted=[True, False],
    )
    reply_axes, emotion_axis = sft.kardia_criteria(tr.scenario, "I am scared")
    assert [c.split(":")[0] for c in reply_axes] == ["Relevance", "Empathy", "Persona consistency", "Safety"]
    assert "MBTI: INFJ" in reply_axes[2]
    assert emotion_axis.startswith("Emotion accuracy") and "I am scared" in emotion_axis
    assert "(grief)" in sft.kardia_criteria({"emotion": "grief"}, "...")[1]  # the scenario's emotion wins
    judge = Fake()
    # turn 1: (1 + 0.5 + 0.5 + 1 + 1 [fear named]) / 5 = 0.8; turn 2: no sections -> emotion 0, format -1
    fmt = argparse.Namespace(kardia_format=True)
    assert sft.kardia_rewards([tr], fmt, sft.Graders(criteria_judge=judge)) == [pytest.approx([0.8, 0.6 - 1.0])]
    assert [it["reply"] for it in judge.items if len(it["criteria"]) == 1] == ["fear", "(no emotion named)"]
    # without the format the emotion is judged on the shown reply itself
    plain = argparse.Namespace(kardia_format=False)
    assert sft.kardia_rewards([tr], plain, sft.Graders(criteria_judge=Fake())) == [pytest.approx([0.6, 0.6])]
    assert tr.seen_history()[1]["content"] == "That sounds frightening."  # the user never sees the rest


# each reward once, each estimator twice: an estimator reads only the per-turn numbers a reward gives, so the full
# product (18 runs of 04) would test no more than these 6
PAIRS = [
    ("idr", "mica"),
    ("rlver", "grpo"),
    ("idr+0.5*rlver", "reinforce_pp"),
    ("care", "grpo"),
    ("idr+care", "reinforce_pp"),
    ("kardia", "mica"),
]


@pytest.mark.parametrize("reward, advantage", PAIRS)
def test_every_reward_and_every_estimator_one_step(
    trainer, tiny_model, tiny_rubric_adapter, tmp_path, reward, advantage
):
    import json

    care = (
        ["--rubric", "uniform"]
        if reward == "care"
        else ["--rubric-model", tiny_rubric_adapter, "--rubric-max-new-tokens", "8"]
        if "care" in reward
        else ["--kardia-format"]
        if reward == "kardia"
        else []
    )
    trainer.main(
        [
            "--model",
            tiny_model,
            "--reward",
            reward,
            "--advantage",
            advantage,
            "--steps",
            "1",
            "--scenarios-per-step",
            "2",
            "--k",
            "2",
            "--max-turns",
            "2",
            "--max-new-tokens",
            "5",
            "--out-dir",
            str(tmp_path),
            "--no-progress",
            "--log-kl-every",
            "0",
            *care,
        ]
    )
    run = next(tmp_path.iterdir())
    m = json.loads((run / "metrics.jsonl").read_text())
    assert m["token_passes"] > 0 and m["loss"] is not None and 0 <= m["final_emotion"] <= 100
    recs = [json.loads(x) for x in (run / "rollouts.jsonl").read_text().splitlines()]
    names = set(trainer.parse_reward_spec(reward))
    assert all(set(t["reward_parts"]) == names for r in recs for t in r["turns"])
    if reward == "kardia":  # the tiny model never writes the 4 sections: every turn pays the format term
        assert m["format_ok"] == 0
        assert all(
            t["formatted"] is False and (t["reward_parts"]["kardia"] is None or t["reward_parts"]["kardia"] <= 0)
            for r in recs
            for t in r["turns"]
        )
    if "care" in reward:  # every turn's rubric is recorded; the tiny generator's are all invalid
        assert all(t["rubric"]["weights"]["affective"] == pytest.approx(1 / 3) for r in recs for t in r["turns"])
        assert m["rubric_invalid"] == (0 if reward == "care" else sum(len(r["turns"]) for r in recs))
        for r in recs:
            for t in r["turns"]:
                if not t["judge_failed"] and t["reward_parts"]["care"] is not None:
                    assert 0 <= t["reward_parts"]["care"] <= 1
    if reward == "rlver":  # the recorded rewards are the emotion changes / 100, minus the cut-off penalty in
        for rec in recs:  # RLVER's units: 0.5 (the default fraction) x 0.1 (its largest change in a turn)
            e = [30.0] + [t["emotion"] for t in rec["turns"]]
            want = [
                (e[i + 1] - e[i]) / 100 - 0.05 * t["cut_off"]
                for i, t in enumerate(rec["turns"])
                if not t["judge_failed"]
            ]
            assert [t["reward"] for t in rec["turns"] if not t["judge_failed"]] == pytest.approx(want, abs=1e-4)


def test_a_new_estimator_is_one_function_and_one_entry(trainer, tiny_model, tmp_path, monkeypatch):
    """A fork's estimator, registered by name in the test: one 04 step runs it, rollouts.jsonl holds its A and
    its own term for every turn, and the credit picture draws them."""
    import json

    def sign_of_return(rewards, dialogues, args):
        """A = +1 where the return-to-go G_t is above the group's mean return-to-go at t, else -1."""
        A, G_all = [], []
        for group in rewards:
            G = [trainer.discounted_returns(r, args.gamma) for r in group]
            A.append([[1.0 if g > 0 else -1.0 for g in G_k] for G_k in G])
            G_all.append(G)
        return A, {"G_sign_source": G_all}

    monkeypatch.setitem(trainer.ADVANTAGES, "sign_of_return", sign_of_return)
    trainer.main(
        [
            "--model",
            tiny_model,
            "--advantage",
            "sign_of_return",
            "--steps",
            "1",
            "--scenarios-per-step",
            "2",
            "--k",
            "2",
            "--max-turns",
            "2",
            "--max-new-tokens",
            "5",
            "--out-dir",
            str(tmp_path),
            "--no-progress",
        ]
    )
    run = next(tmp_path.iterdir())
    turns = [t for x in (run / "rollouts.jsonl").read_text().splitlines() for t in json.loads(x)["turns"]]
    assert len(turns) >= 4
    for t in turns:  # the logged return G and the estimator's A and term, turn by turn
        assert t["terms"] == {"G_sign_source": t["G"]}
        assert t["advantage"] == (1.0 if t["G"] > 0 else -1.0)
    assert (run / "credit_step1.png").stat().st_size > 5_000


def test_an_estimator_that_reads_the_dialogues_is_one_function_too(env, trainer, tiny_model, tmp_path, monkeypatch):
    """A fork's estimator that needs the dialogues, not only their rewards: MICA's turn-level term with each
    dialogue's returns centred at turn t and divided by its scenario's initial distance d(P_0) (not by the
    returns' spread), so that easy and hard scenarios weigh alike. One 04 step runs it; its advantages are read
    back from rollouts.jsonl and recomputed there from the logged returns and d(P_0)."""
    import json

    def turn_level_by_distance(rewards, dialogues, args):
        """A[k][t] = (G[k][t] - mean_t) / d(P_0), over the dialogues k of the scenario that reached turn t."""
        A, d0_terms = [], []
        for group, group_dialogues in zip(rewards, dialogues):
            d0 = env.hinge_distance(group_dialogues[0].states[0], eps=env.EPS)  # the scenario's P_0, shared by its K
            G = [trainer.discounted_returns(r, args.gamma) for r in group]
            A_s = [[0.0] * len(r) for r in group]
            for t in range(max(len(r) for r in group)):
                reached = [k for k in range(len(group)) if len(group[k]) > t]
                mean_t = sum(G[k][t] for k in reached) / len(reached)
                for k in reached:
                    A_s[k][t] = (G[k][t] - mean_t) / d0
            A.append(A_s)
            d0_terms.append([[d0] * len(r) for r in group])
        return A, {"d0": d0_terms}

    monkeypatch.setitem(trainer.ADVANTAGES, "turn_by_d0", turn_level_by_distance)
    args = ["--model", tiny_model, "--advantage", "turn_by_d0", "--steps", "1", "--scenarios-per-step", "2"]
    trainer.main([*args, "--max-turns", "3", "--max-new-tokens", "5", "--out-dir", str(tmp_path), "--no-progress"])
    records = [json.loads(x) for x in next(tmp_path.iterdir()).joinpath("rollouts.jsonl").read_text().splitlines()]
    assert len(records) == 8 and len({r["scenario_id"] for r in records}) == 2
    for sid in {r["scenario_id"] for r in records}:
        group = [r for r in records if r["scenario_id"] == sid]
        d0 = group[0]["initial_distance"]
        for t in range(max(len(r["turns"]) for r in group)):
            reached = [r["turns"][t] for r in group if len(r["turns"]) > t]
            mean_t = sum(turn["G"] for turn in reached) / len(reached)
            for turn in reached:
                assert turn["advantage"] == pytest.approx((turn["G"] - mean_t) / d0, abs=2e-4)
                assert turn["terms"]["d0"] == pytest.approx(d0, abs=1e-4)


def test_an_estimator_from_outside_the_repository_by_module_and_function(tiny_model, tmp_path):
    """--advantage module:function imports an estimator that lives outside the repository, here a file in the
    folder the command runs from (no PYTHONPATH): a potential-based one that reads each dialogue's states,
    A[k][t] = the distance the turn closed, d(P_{t-1}) - d(P_t), centred over the group's turns. One 04 step
    runs it as a user would; a name that does not import is one line and exit 2."""
    import json

    (tmp_path / "my_credit.py").write_text(
        "import math\n\n\n"
        "def closed_distance(rewards, dialogues, args):\n"
        "    # A[k][t] = (d(P_{t-1}) - d(P_t)) - mean over the group's turns, from the states alone\n"
        "    def d(P):\n"
        "        return math.sqrt(sum(max(0.0, -1.0 - x) ** 2 for x in P))\n"
        "    A = []\n"
        "    for group in dialogues:\n"
        "        closed = [[d(tr.states[t]) - d(tr.states[t + 1]) for t in range(tr.T)] for tr in group]\n"
        "        mean = sum(x for c in closed for x in c) / sum(len(c) for c in closed)\n"
        "        A.append([[x - mean for x in c] for c in closed])\n"
        "    return A, {}\n"
    )
    args = ["--model", tiny_model, "--advantage", "my_credit:closed_distance", "--steps", "1", "--scenarios-per-step"]
    args += ["1", "--max-turns", "2", "--max-new-tokens", "4", "--out-dir", "runs", "--no-progress"]
    p = run_script("04_mica_train.py", *args, cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    run = next((tmp_path / "runs").iterdir())
    assert "--advantage my_credit:closed_distance" in p.stdout.splitlines()[0]
    records = [json.loads(x) for x in run.joinpath("rollouts.jsonl").read_text().splitlines()]
    assert len(records) == 4
    prev = [[r["initial_distance"]] + [t["distance"] for t in r["turns"]] for r in records]
    steps = [[p[t] - p[t + 1] for t in range(len(p) - 1)] for p in prev]
    mean = sum(x for s in steps for x in s) / sum(len(s) for s in steps)
    for r, s in zip(records, steps):
        assert [t["advantage"] for t in r["turns"]] == pytest.approx([x - mean for x in s], abs=1e-3)
    for spec, why in (("my_credit:nothing", "AttributeError"), ("no_such_module:f", "ModuleNotFoundError")):
        p = run_script("04_mica_train.py", "--advantage", spec, cwd=tmp_path)
        assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1, p.stderr
        assert p.stderr.startswith(f"error: --advantage {spec}: cannot import it ({why}"), p.stderr


def test_care_weights_the_distance_and_uniform_is_mica(trainer):
    import types

    states = [[-6, -9, -4], [-5, -6, -4], [-6, -5, -3], [-3, -6, -2]]
    # idr+care: the rubric, which 01's write_rubrics put in tr.extra, weights idr's distance (rubric_weighted_distance)
    args = argparse.Namespace(
        idr_weights=(1, 1, 1), eps=1.0, reward_weights={"idr": 1.0, "care": 1.0}, care_distance="weighted"
    )
    assert trainer.rubric_weighted_distance(args)
    uniform = {"weights": {d: 1 / 3 for d in trainer.sft.DIMS}}
    tr = types.SimpleNamespace(T=3, states=states, extra={"rubrics": [uniform] * 3})
    assert trainer.idr_rewards([tr], args, None)[0] == pytest.approx([2.828, 0.363, 1.231], abs=1e-3)
    # affective-heavy rubric: w = 3 * (0.2, 0.6, 0.2) = (0.6, 1.8, 0.6); turn 1 moves A by +3
    aff = {"weights": {"cognitive": 0.2, "affective": 0.6, "proactive": 0.2}}
    tr.extra["rubrics"] = [aff] * 3

    def d(P):
        return (0.6 * max(0, -1 - P[0]) ** 2 + 1.8 * max(0, -1 - P[1]) ** 2 + 0.6 * max(0, -1 - P[2]) ** 2) ** 0.5

    assert trainer.idr_rewards([tr], args, None)[0] == pytest.approx(
        [d(states[t]) - d(states[t + 1]) for t in range(3)]
    )
    assert trainer.idr_rewards([tr], args, None)[0][0] > 2.828  # the affective move counts more
    # --care-distance plain keeps MICA's potential difference: the rewards telescope to d(P0) - d(P_T)
    args.care_distance = "plain"
    plain = trainer.idr_rewards([tr], args, None)[0]
    assert plain == pytest.approx([2.828, 0.363, 1.231], abs=1e-3) and sum(plain) == pytest.approx(9.899495 - 5.477226)


def test_kv_reuse_same_dialogues_fewer_tokens_prefilled(env, tiny, monkeypatch):
    """Keeping each dialogue's KV cache between turns (and prefilling the K identical openings once)
    must not change a greedy rollout by a single token, and must feed the model fewer tokens."""
    model, tok = tiny
    scenarios = [SCEN, {**SCEN, "id": "s2", "opening": "My sister has not spoken to me since the wedding."}]
    fed, runs = [], {}
    hook = model.register_forward_pre_hook(lambda m, a, kw: fed.append(tuple(kw["input_ids"].shape)), with_kwargs=True)
    try:
        for reuse in (False, True):
            fed.clear()
            monkeypatch.setattr(env, "KV_REUSE", reuse)
            args = env_args(env, k=3, max_turns=3, min_turns=12, max_new_tokens=6, temperature=0.0, seed=0)
            trajs = env.rollout(
                model,
                tok,
                scenarios,
                StubJudge([{"C": (1, 0), "A": (0, 0), "P": (0, 0)}]),
                offline.ScriptedUser(0),
                args,
            )
            runs[reuse] = ([tr.ids for tr in trajs], [tr.spans for tr in trajs], list(fed))
    finally:
        hook.remove()
    (ids0, spans0, fed0), (ids1, spans1, fed1) = runs[False], runs[True]
    assert ids1 == ids0 and spans1 == spans0
    assert all(tr_ids != ids0[0] for tr_ids in ids0[3:])  # two scenarios really differ
    # turn 1, both: the 2 distinct openings are prefilled once (all but their last token), then 6 rows go on
    L1 = fed0[0][1] + 1
    assert fed0[:2] == fed1[:2] == [(2, L1 - 1), (6, 1)]
    # turns 2 and 3: without reuse the whole dialogue again (greedy: the K copies are still identical,
    # so once per scenario); with it, each row's new tokens (the user's message, the template) + 1
    pre0, pre1 = [f for f in fed0[2:] if f[1] > 1], [f for f in fed1[2:] if f[1] > 1]
    assert [b for b, _ in pre0] == [2, 2] and all(n > L1 for _, n in pre0)
    assert [b for b, _ in pre1] == [6, 6] and all(n < 40 for _, n in pre1)
    assert sum(b * n for b, n in pre1) < 0.5 * sum(b * n for b, n in pre0)


def test_default_update_takes_two_optimizer_steps_and_pi_old_is_not_the_updated_policy(trainer, tiny_model, tmp_path):
    """04's defaults (4 scenarios x K=4 = 16 trajectories, --minibatch-size 8) take 2 optimizer steps per
    rollout, so the second minibatch's ratio has moved (the metrics log its range)."""
    import json

    # 2 turns: with 1, 3 of the 4 groups are degenerate (all replies cut off) and the first minibatch teaches nothing
    trainer.main(
        [
            "--model",
            tiny_model,
            "--steps",
            "2",
            "--max-turns",
            "2",
            "--max-new-tokens",
            "4",
            "--lr",
            "0.05",
            "--out-dir",
            str(tmp_path),
            "--no-progress",
        ]
    )
    m = [json.loads(x) for x in (next(tmp_path.iterdir()) / "metrics.jsonl").read_text().splitlines()]
    assert [x["trajectories"] for x in m] == [16, 16] and [x["optimizer_steps"] for x in m] == [2, 2]
    assert [x["degenerate_groups"] for x in m] == [0, 0]
    assert all(x["ratio_min"] < 1.0 < x["ratio_max"] for x in m)
    assert all(0 <= x["clip_frac"] <= 1 for x in m)


def test_minibatches_hold_whole_scenarios_in_the_steps_order(trainer, tiny_model, monkeypatch):
    """4 scenarios x K=4, the dialogues longest first: minibatches of 8 are scenarios (0, 1) then (2, 3), as the
    rollout ordered them (not the 8 shortest, then the 8 longest); a dialogue with nothing to score is left out;
    inside a minibatch the micro-batches go by length; the schedule steps once."""
    args = policy_args(
        tiny_model,
        minibatch_size=8,
        micro_batch_size=2,
        update_epochs=1,
        temperature=1.0,
        kl_coef=0.0,
        tis_cap=0.0,
    )
    model, tok = common.load_policy(args)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    samples = [
        trainer.Sample(
            [(5 * i + j) % 90 + 3 for j in range(40 - i)],
            [(4, 40 - i)],
            [None if i == 5 else (-1.0) ** i],
            [[0.0] * (36 - i)],
        )
        for i in range(16)
    ]  # dialogue 5: its turn failed
    seen = []
    cut = trainer.micro_batches

    def recording(samples_, mb, size):
        seen.append(list(mb))
        return cut(samples_, mb, size)

    monkeypatch.setattr(trainer, "micro_batches", recording)
    out = trainer.policy_update(model, tok, opt, sched, samples, args, Accelerator())
    # pi_old for the second minibatch first (the first one's ratio is 1), then the two optimizer steps in order
    assert seen == [list(range(8, 16)), [0, 1, 2, 3, 4, 6, 7], list(range(8, 16))]
    assert out["optimizer_steps"] == 2 and sched.last_epoch == 1
    assert cut(samples, [0, 1, 2, 3, 4], 2) == [[4, 3], [2, 1], [0]]  # shortest first, for the padding


def test_the_clip_engages_on_the_second_minibatch(trainer, tiny_model, monkeypatch):
    """Two minibatches of one rollout with advantages +-1: the first step moves the policy, the second
    minibatch's ratio leaves [1 - clip_low, 1 + clip_high], and the clip counts those tokens; with one
    minibatch (pi_old = pi) nothing is ever clipped."""
    torch.manual_seed(0)
    args = policy_args(
        tiny_model,
        minibatch_size=4,
        micro_batch_size=2,
        update_epochs=1,
        temperature=1.0,
        kl_coef=0.0,
        tis_cap=0.0,
    )
    monkeypatch.setattr(trainer, "CLIP_LOW", 0.01)  # a narrow clip: the first step's move leaves it
    monkeypatch.setattr(trainer, "CLIP_HIGH", 0.01)
    out = {}
    for minibatch_size in (8, 4):
        model, tok = common.load_policy(argparse.Namespace(**{**vars(args), "minibatch_size": minibatch_size}))
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.05)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
        ids = tok("I feel so alone since my dad died. That sounds really painful.")["input_ids"]
        samples = [
            trainer.Sample(ids, [(4, len(ids))], [1.0 if i % 2 else -1.0], [[0.0] * (len(ids) - 4)]) for i in range(8)
        ]
        args.minibatch_size = minibatch_size
        out[minibatch_size] = trainer.policy_update(model, tok, opt, sched, samples, args, Accelerator())
    assert out[8]["optimizer_steps"] == 1 and out[8]["clip_frac"] == 0.0 and out[8]["ratio_max"] == pytest.approx(1.0)
    assert out[4]["optimizer_steps"] == 2 and out[4]["clip_frac"] > 0  # tokens after the first step
    assert out[4]["ratio_min"] < 0.99 or out[4]["ratio_max"] > 1.01


def test_max_new_tokens_default_leaves_room_for_kardias_four_sections(env):
    assert env.parse_args([]).max_new_tokens == 48
    assert env.parse_args(["--kardia-format"]).max_new_tokens == 192
    assert env.parse_args(["--kardia-format", "--max-new-tokens", "64"]).max_new_tokens == 64  # a flag given wins


@pytest.mark.parametrize("reward", ["care", "kardia", "idr+care"])
def test_a_failed_criteria_judge_leaves_its_turn_out_like_a_failed_empa_judge(env, trainer, tiny, reward):
    """CARE's and Kardia-R1's criteria judge fails on chosen turns (None): those turns are failed like a
    turn the EMPA judge failed on: left out of the loss, counted in judge_failures, their reward for the
    returns filled with the dialogue's mean valid reward."""
    model, tok = tiny
    args = env_args(env, k=2, max_turns=3, min_turns=12, max_new_tokens=4)
    trajs = env.rollout(
        model, tok, [SCEN], StubJudge([{"C": (1, 0), "A": (1, 0), "P": (0, 0)}]), offline.ScriptedUser(0), args
    )
    fail_on = {(0, 1), (1, 2)}  # (dialogue, turn) where the criteria judge fails

    # one judge item per turn and dimension: Kardia-R1 asks twice a turn (reply, emotion), CARE once per dimension
    per_turn = 2 if reward == "kardia" else len(trainer.sft.UNIFORM_RUBRIC["criteria"])

    class Judge:  # scores 0.5 on every criterion, None on the chosen turns
        def score(self, items):
            turns = [(i, t) for i, tr in enumerate(trajs) for t in range(tr.T) for _ in range(per_turn)]
            return [None if turns[j] in fail_on else [0.5] * len(it["criteria"]) for j, it in enumerate(items)]

    targs = argparse.Namespace(
        **vars(args),
        idr_weights=(1, 1, 1),
        cut_off_penalty=0.0,
        care_distance="plain",
        reward_weights=trainer.parse_reward_spec(reward),
        gamma=0.85,
        rubric="uniform",  # with care, reward_parts has 01 write every turn's rubric: here the fixed one
    )
    parts, _ = trainer.reward_parts(trajs, targs, trainer.sft.Graders(criteria_judge=Judge()))
    rewards, failed = zip(*[trainer.turn_rewards(p, tr, targs) for p, tr in zip(parts, trajs)])
    assert list(failed) == [[False, True, False], [False, False, True]] and not any(
        tr.judge_failed[t] for tr in trajs for t in range(3)
    )
    for r, F in zip(rewards, failed):
        valid = [x for x, f in zip(r, F) if not f]
        assert all(x == pytest.approx(sum(valid) / len(valid)) for x, f in zip(r, F) if f)  # filled with the mean
    samples = trainer.as_samples(trajs, [[1.0] * 3, [1.0] * 3], failed)
    assert [s.advantages for s in samples] == [[1.0, None, 1.0], [1.0, 1.0, None]]
    assert [s.n_tokens() for s in samples] == [
        sum(e - s for (s, e), f in zip(tr.spans, F) if not f) for tr, F in zip(trajs, failed)
    ]
    recs = [
        trainer.dialogue_record(targs, 1, tr, p, r, [0.0] * 3, F, {})
        for tr, p, r, F in zip(trajs, parts, rewards, failed)
    ]
    assert sum(t["judge_failed"] for r in recs for t in r["turns"]) == 2  # judge_failures counts them


def test_the_rubric_generator_and_its_judge_read_the_same_shown_history(trainer, monkeypatch):
    """--kardia-format: the policy's raw reply has four sections, the person saw only the response. The rubric
    of turn 2 is written for the history as shown, the context the criteria judge scores the reply in."""
    raw = (
        "<understanding>u</understanding><reasoning>r</reasoning><emotion>sad</emotion><response>I hear you.</response>"
    )
    msgs = [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "I lost my job."},
        {"role": "assistant", "content": raw},
        {"role": "user", "content": "Thanks."},
        {"role": "assistant", "content": raw},
    ]
    tr = trainer.env.Trajectory(
        scenario={}, k=0, ids=[], messages=msgs, spans=[(0, 1), (1, 2)], shown=["I hear you.", "I hear you."]
    )
    seen = []

    def generate(model, tok, contexts, max_new_tokens, temperature, batch_size):
        seen.extend(contexts)
        return [trainer.sft.GeneratedRubric("not a rubric", [], [], [])] * len(contexts)

    monkeypatch.setattr(trainer.sft, "generate_rubrics", generate)
    args = argparse.Namespace(rubric="adaptive", rubric_max_new_tokens=8)
    invalid = trainer.sft.write_rubrics([tr], trainer.sft.Graders(), args)
    assert seen[1] == [msgs[1], {"role": "assistant", "content": "I hear you."}, msgs[3]]
    assert seen[0] == [msgs[1]] and invalid == 2 and tr.extra["rubrics"] == [trainer.sft.UNIFORM_RUBRIC] * 2


def test_report_to_tensorboard_logs_every_step_and_the_configuration(trainer, tiny_model, tmp_path):
    """--report-to tensorboard: accelerate's tracker writes <run>/tensorboard/; its event file read back holds
    every step's metrics as metrics.jsonl has them, and the run's configuration."""
    import json

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    trainer.main(
        [
            "--model",
            tiny_model,
            "--steps",
            "2",
            "--scenarios-per-step",
            "1",
            "--k",
            "2",
            "--minibatch-size",
            "2",
            "--max-turns",
            "1",
            "--max-new-tokens",
            "4",
            "--report-to",
            "tensorboard",
            "--out-dir",
            str(tmp_path),
            "--no-progress",
        ]
    )
    run = next(tmp_path.iterdir())
    metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    events = EventAccumulator(str(run / "tensorboard")).Reload()
    for key in ("return_mean", "cut_off_frac", "token_passes", "update_seconds"):
        logged = [(e.step, e.value) for e in events.Scalars(key)]
        assert logged == [(m["step"], pytest.approx(m[key], rel=1e-6)) for m in metrics], key
    hparams = list((run / "tensorboard").rglob("hparams.yml"))
    assert len(hparams) == 1 and "advantage: mica" in hparams[0].read_text()

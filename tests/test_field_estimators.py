"""experiments/field_estimators.py: each of the field's estimators pinned to numbers worked by hand, on a group with
unequal lengths and a lone survivor (dialogue 0 alone reaches turn 2), then one 04 step with each, run as a user runs
it: `--advantage experiments.field_estimators:<function>` from the repository's root."""

import argparse
import importlib
import json
import math

import pytest

from conftest import ROOT, run_script

fe = importlib.import_module("experiments.field_estimators")  # as 04's --advantage imports it
env = importlib.import_module("03_rollout")
ARGS = argparse.Namespace(idr_weights=[1.0, 1.0, 1.0])  # the only option an estimator here reads (phi_t's weights)

# one scenario group, K = 3: dialogue 0 has 3 turns, 1 has 2, 2 has 1 (only dialogue 0 reaches turn index 2)
REWARDS = [[[1.0, 2.0, 3.0], [0.0, 1.0], [2.0]]]  # R = (6, 1, 2)


def D(a):
    """A state whose hinge distance is a (eps = 1): d([-1 - a, -1, -1]) = sqrt(a^2) = a."""
    return [-1.0 - a, -1.0, -1.0]


def dialogue(k, states, tokens=None):
    """03's Trajectory with its states and, when given, each reply's span of `tokens[t]` tokens."""
    spans, start = [], 0
    for n in tokens or []:
        spans.append((start, start + n))
        start += n
    return env.Trajectory(scenario={"id": "s", "p0": states[0]}, k=k, ids=[], messages=[], states=states, spans=spans)


def test_mt_grpo_standardises_each_turn_index_over_all_k_with_missing_turns_as_0():
    A, terms = fe.mt_grpo_advantages(REWARDS, None, ARGS)
    # outcome: R = (6, 1, 2), mean 3, population sd sqrt((9 + 4 + 1) / 3) = sqrt(14/3) = 2.160247
    #   A_O = (3, -2, -1) / 2.160247 = (1.388730, -0.925820, -0.462910)
    # t = 0: r = (1, 0, 2), mean 1, sd sqrt(2/3) = 0.816497: A_T = (0, -1.224745, 1.224745)
    # t = 1: r = (2, 1, 0: dialogue 2 ended, counted as 0), mean 1, sd 0.816497: A_T = (1.224745, 0, -)
    # t = 2: r = (3, 0, 0), mean 1, sd sqrt(6/3) = 1.414214: A_T = 2 / 1.414214 = 1.414214 (dialogue 0 only)
    # A = A_T + 1 * A_O
    assert A[0][0] == pytest.approx([1.388730, 2.613475, 2.802944], abs=1e-5)
    assert A[0][1] == pytest.approx([-2.150565, -0.925820], abs=1e-5)
    assert A[0][2] == pytest.approx([0.761835], abs=1e-5)
    assert terms["A_outcome"][0][1] == pytest.approx([-0.925820] * 2, abs=1e-5)
    # a turn where every reward is the same: sd 0 is taken as 1, so A_T = 0 (and the outcome's too)
    assert fe.mt_grpo_advantages([[[1.0, 2.0], [1.0, 2.0]]], None, ARGS)[0] == [[[0.0, 0.0], [0.0, 0.0]]]


def test_step_loo_compares_each_turn_with_the_others_that_reached_it():
    A, terms = fe.step_loo_advantages(REWARDS, None, ARGS)
    # t = 0: r = (1, 0, 2), sum 3, sample sd 1; b = ((3-1)/2, (3-0)/2, (3-2)/2) = (1, 1.5, 0.5)
    #   A = (0, -1.5, 1.5) / (1 + 1e-4) = (0, -1.499850, 1.499850)
    # t = 1: dialogues 0 and 1, r = (2, 1), sample sd sqrt(0.5) = 0.707107; b = (1, 2)
    #   A = (1, -1) / 0.707207 = (1.414014, -1.414014)
    # t = 2: dialogue 0 alone: b = r itself, A = 0
    assert A[0][0] == pytest.approx([0.0, 1.414014, 0.0], abs=1e-5)
    assert A[0][1] == pytest.approx([-1.499850, -1.414014], abs=1e-5)
    assert A[0][2] == pytest.approx([1.499850], abs=1e-5)
    assert terms["baseline"][0][0] == [1.0, 1.0, 3.0]


def test_ctc_grpo_adds_the_turn_score_centred_within_its_dialogue():
    A, terms = fe.ctc_grpo_advantages(REWARDS, None, ARGS)
    # trace: R = (6, 1, 2), mean 3, sample sd sqrt(14/2) = 2.645751 (> the floor 0.1)
    #   A_trace = (3, -2, -1) / (2.645751 + 1e-6) = (1.133893, -0.755929, -0.377964)
    # turn: alpha 15 times p minus its dialogue's mean: (1, 2, 3) - 2 -> (-15, 0, 15); (0, 1) - 0.5 -> (-7.5, 7.5);
    #   (2) - 2 -> 0
    assert A[0][0] == pytest.approx([-13.866107, 1.133893, 16.133893], abs=1e-5)
    assert A[0][1] == pytest.approx([-8.255929, 6.744071], abs=1e-5)
    assert A[0][2] == pytest.approx([-0.377964], abs=1e-5)
    assert terms["A_turn"][0][2] == [0.0]
    # the sd's floor: R = (1, 1.02), sample sd 0.014142 < 0.1, so A_trace = (-0.01, 0.01) / (0.1 + 1e-6)
    A, _ = fe.ctc_grpo_advantages([[[1.0], [1.02]]], None, ARGS)
    assert [A[0][0][0], A[0][1][0]] == pytest.approx([-0.099999, 0.099999], abs=1e-6)


def test_gigpo_groups_turns_by_the_state_they_answer_at_any_turn_index():
    # dialogue 0 answers P0, X, Y; dialogue 1 answers P0, then Y (reached by another path: a float sum 1e-12 off);
    # dialogue 2 answers P0. Anchor groups: P0 {(0,0), (1,0), (2,0)}, Y {(0,2), (1,1)}, X {(0,1)} alone
    P0, X, Y = [-5.0, -5.0, -5.0], [-4.0, -5.0, -5.0], [-3.0, -5.0, -5.0]
    Y_other_path = [-3.0 + 1e-12, -5.0, -5.0]
    dialogues = [
        [
            dialogue(0, [P0, X, Y, [-2.0, -5.0, -5.0]]),
            dialogue(1, [P0, Y_other_path, [-1.0, -5.0, -5.0]]),
            dialogue(2, [P0, [-4.0, -4.0, -5.0]]),
        ]
    ]
    A, terms = fe.gigpo_advantages(REWARDS, dialogues, ARGS)
    # episode: one row a turn, so the mean weighs R by length: (3*6 + 2*1 + 1*2) / 6 = 22/6 = 3.666667
    #   A_episode = (6, 1, 2) - 3.666667 = (2.333333, -2.666667, -1.666667)
    # returns, gamma 0.95: dialogue 0 (1 + 0.95 * 4.85, 2 + 0.95 * 3, 3) = (5.6075, 4.85, 3); 1 (0.95, 1); 2 (2)
    # step: P0's G (5.6075, 0.95, 2), mean 2.8525 -> (2.755, -1.9025, -0.8525); Y's (3, 1), mean 2 -> (1, -1); X's 0
    assert A[0][0] == pytest.approx([5.088333, 2.333333, 3.333333], abs=1e-5)
    assert A[0][1] == pytest.approx([-4.569167, -3.666667], abs=1e-5)
    assert A[0][2] == pytest.approx([-2.519167], abs=1e-5)
    assert terms["A_step"][0][0] == pytest.approx([2.755, 0.0, 1.0], abs=1e-9)


def test_turn_credit_smears_state_progress_back_and_centres_it_over_the_dialogues_tokens():
    # distances after each reply: dialogue 0: 4, 4, 1; dialogue 1: 6, 3; dialogue 2: 2 (all from d(P0) = 5)
    # phi = -d: progress = (0, 0, 3), (0, 3), (0): the first scored state is the start; net = 3, 3, 0
    rewards = [[[1.0, 0.0, 3.0], [-1.0, 3.0], [3.0]]]  # the idr rewards of these states: R = (4, 2, 3)
    dialogues = [
        [
            dialogue(0, [D(5), D(4), D(4), D(1)], tokens=[2, 1, 1]),
            dialogue(1, [D(5), D(6), D(3)], tokens=[1, 3]),
            dialogue(2, [D(5), D(2)], tokens=[4]),
        ]
    ]
    A, terms = fe.turn_credit_advantages(rewards, dialogues, ARGS)
    # level: R + net = (7, 5, 3), mean 5 -> (2, 0, -2)
    # smear, gamma 0.9: dialogue 0's 3 at turn 3 over z = 1 + 0.9 + 0.81 = 2.71: c = (2.43, 2.7, 3) / 2.71
    #   = (0.896679, 0.996310, 1.107011); token-weighted mean (2*0.896679 + 0.996310 + 1.107011) / 4 = 0.974170
    #   shift = (-0.077491, 0.022140, 0.132841)
    # dialogue 1's 3 at turn 2 over z = 1.9: c = (2.7, 3) / 1.9 = (1.421053, 1.578947); mean (1.421053 + 3*1.578947)
    #   / 4 = 1.539474; shift = (-0.118421, 0.039474). Dialogue 2: no progress, shift 0
    assert A[0][0] == pytest.approx([1.922509, 2.022140, 2.132841], abs=1e-5)
    assert A[0][1] == pytest.approx([-0.118421, 0.039474], abs=1e-5)
    assert A[0][2] == pytest.approx([-2.0], abs=1e-9)
    assert terms["level"][0][0] == [2.0, 2.0, 2.0]
    # the shift sums to 0 over each dialogue's tokens: the dialogue's total advantage stays its level
    for k, n in enumerate(([2, 1, 1], [1, 3], [4])):
        assert sum(x * w for x, w in zip(terms["shift"][0][k], n)) == pytest.approx(0.0, abs=1e-9)
    # without spans (the credit playground's dialogues) every turn weighs 1: dialogue 0's mean is 3/3 = 1
    no_tokens = [[dialogue(k, tr.states) for k, tr in enumerate(dialogues[0])]]
    shift = fe.turn_credit_advantages(rewards, no_tokens, ARGS)[1]["shift"][0][0]
    assert shift == pytest.approx([-0.103321, -0.003690, 0.107011], abs=1e-5)


# the terms each estimator returns, and how A is built from them (step_loo's baseline is not a part of A)
TERMS = {
    "mt_grpo_advantages": ("A_turn", "A_outcome"),
    "step_loo_advantages": ("baseline",),
    "ctc_grpo_advantages": ("A_trace", "A_turn"),
    "gigpo_advantages": ("A_episode", "A_step"),
    "turn_credit_advantages": ("level", "shift"),
}


@pytest.mark.parametrize("function", list(TERMS))
def test_one_04_step_with_each_estimator(function, tiny_model, tmp_path):
    """04 imports the estimator by --advantage module:function from the repository's root and trains one step; its
    advantages in rollouts.jsonl are the function's on the dialogues it logged (rewards, states, reply tokens)."""
    spec = f"experiments.field_estimators:{function}"
    args = ["--model", tiny_model, "--advantage", spec, "--steps", "1", "--scenarios-per-step", "1"]
    args += ["--max-turns", "2", "--max-new-tokens", "4", "--out-dir", tmp_path / "runs", "--no-progress"]
    p = run_script("04_mica_train.py", *args, cwd=ROOT)
    assert p.returncode == 0, p.stderr
    assert f"--advantage {spec}" in p.stdout.splitlines()[0]
    run = next((tmp_path / "runs").iterdir())
    records = [json.loads(x) for x in run.joinpath("rollouts.jsonl").read_text().splitlines()]
    assert len(records) >= 2
    # the dialogues again from the log: each turn's reward, the states P_0 .. P_T, each reply's tokens
    rewards = [[[turn["reward"] for turn in r["turns"]] for r in records]]
    dialogues = [
        [
            dialogue(
                r["k"], [r["p0"]] + [turn["state"] for turn in r["turns"]], [t["reply_tokens"] for t in r["turns"]]
            )
            for r in records
        ]
    ]
    A, terms = getattr(fe, function)(rewards, dialogues, argparse.Namespace(idr_weights=[1.0, 1.0, 1.0]))
    for k, r in enumerate(records):
        logged = [turn["advantage"] for turn in r["turns"]]
        assert logged == pytest.approx(A[0][k], abs=2e-3), (k, logged, A[0][k])
        for turn in r["turns"]:
            assert set(turn["terms"]) == set(TERMS[function])
            assert all(math.isfinite(x) for x in turn["terms"].values())

"""The reward and advantage equations of 04_mica_train against hand-computed numbers.

The tests that pin an exercise (scripts/exercise.py list) check each case with `expect`: on a mismatch it fails
with the lines `scripts/exercise.py check` shows a student, the case, its inputs, the equation, expected and got.
tests/test_env.py uses it too."""

import argparse
import math
import types

import pytest
import torch

import common
import sampling
from conftest import policy_args


def approx(xs, ys, tol=1e-4):
    assert len(xs) == len(ys)
    for x, y in zip(xs, ys):
        if isinstance(x, list):
            approx(x, y, tol)
        else:
            assert abs(x - y) < tol, (xs, ys)


def plain(x):
    """A tensor or a tuple as a list, so that the comparison and the message read the same for every kind."""
    if isinstance(x, torch.Tensor):
        return x.tolist()
    if isinstance(x, tuple):
        return list(x)
    return x


def same(got, expected, tol) -> bool:
    """got equals expected: numbers within tol (NaN equals NaN), lists element by element, anything else exactly."""
    got, expected = plain(got), plain(expected)
    if isinstance(expected, list):
        if not isinstance(got, list) or len(got) != len(expected):
            return False
        return all(same(g, e, tol) for g, e in zip(got, expected))
    is_number = isinstance(expected, (int, float)) and not isinstance(expected, bool)
    if is_number and isinstance(got, (int, float)):
        if math.isnan(expected):
            return math.isnan(got)
        return abs(got - expected) <= tol
    return got == expected


def shown(x) -> str:
    """A value as the message shows it: numbers to 6 significant digits, lists in brackets."""
    x = plain(x)
    if isinstance(x, list):
        return "[" + ", ".join(shown(v) for v in x) + "]"
    if isinstance(x, float):
        return f"{x:.6g}"
    return repr(x)


def expect(got, expected, case: str, inputs: str, equation: str, tol=1e-4):
    """Fail unless got equals expected (numbers to tol), naming the case, its inputs and the equation."""
    if not same(got, expected, tol):
        lines = [f"case: {case}", f"inputs: {inputs}", f"equation: {equation}"]
        lines += [f"expected: {shown(expected)}", f"got:      {shown(got)}"]
        raise AssertionError("\n".join(lines))


IDR = "r_t = d(P_{t-1}) - d(P_t),  d(P) = sqrt( sum_a w_a max(0, -eps - P_a)^2 )"


def test_idr_reference_worked_example(trainer):
    # docs/reference.md section 3: P0 = (-6,-9,-4), v = (1,3,0), (-1,1,1), (3,-1,1), eps = 1
    states = [[-6, -9, -4], [-5, -6, -4], [-6, -5, -3], [-3, -6, -2]]
    r = trainer.env.incremental_distance_rewards(states)
    inputs = f"states {states} (P_0 .. P_3), weights (1, 1, 1), eps 1"
    expect(r, [2.828427, 0.363, 1.231], "docs/reference.md's worked example, three turns", inputs, IDR, tol=1e-3)
    # distances 9.899, 7.071, 6.708, 5.477: the rewards telescope to d(P0) - d(P3)
    case = "the rewards of a dialogue sum to d(P_0) - d(P_T) (they telescope)"
    expect(sum(r), 9.899495 - 5.477226, case, inputs, "sum_t r_t = d(P_0) - d(P_T)", tol=1e-5)


def test_idr_weights_eps_and_overshoot(trainer):
    # inside the tolerance the distance is 0, so moving within it earns nothing; overshoot is not paid
    states = [[-0.5, 0, 0], [2, 2, 2]]
    r = trainer.env.incremental_distance_rewards(states)
    case = "a move inside the tolerance box (every P_a >= -eps) earns nothing"
    expect(r, [0.0], case, f"states {states}, weights (1, 1, 1), eps 1", IDR)
    # w = (4, 0, 0), eps = 2: d((-5,-9,-9)) = sqrt(4 * 3^2) = 6, d((-3,..)) = sqrt(4 * 1) = 2
    states = [[-5, -9, -9], [-3, -1, -1]]
    r = trainer.env.incremental_distance_rewards(states, (4, 0, 0), 2.0)
    case = "the weights and eps given are used: d(P_0) = sqrt(4 * 3^2) = 6, d(P_1) = sqrt(4 * 1^2) = 2"
    expect(r, [4.0], case, f"states {states}, weights (4, 0, 0), eps 2", IDR)
    # two axes, eps 2: d((-5, -3, 0)) = sqrt(3^2 + 1^2), d((-3, -3, 0)) = sqrt(1^2 + 1^2); with eps 1 the reward
    # would be sqrt(20) - sqrt(8) = 1.644 instead
    states = [[-5, -3, 0], [-3, -3, 0]]
    r = trainer.env.incremental_distance_rewards(states, (1, 1, 0), 2.0)
    case = "eps 2 on two axes: d(P_0) = sqrt(3^2 + 1^2), d(P_1) = sqrt(1^2 + 1^2)"
    expect(r, [math.sqrt(10) - math.sqrt(2)], case, f"states {states}, weights (1, 1, 0), eps 2", IDR)


def test_turn_rewards_weights_penalises_and_fills(trainer):
    equation = (
        "r_t = sum_c weight_c r_c,t; a failed turn gets the mean of the valid r_t (before the penalty); "
        "then r_t -= --cut-off-penalty * sum_c |weight_c| unit_c where reply t was cut off"
    )
    # --reward idr+0.5*rlver: r_t = r_idr,t + 0.5 r_rlver,t - penalty * cut_t, penalty = 0.5 (sqrt(3) + 0.5 * 0.1)
    args = argparse.Namespace(
        reward_weights={"idr": 1.0, "rlver": 0.5},
        idr_weights=(1, 1, 1),
        cut_off_penalty=0.5,
        kardia_format=False,
        care_distance="plain",
    )
    tr = types.SimpleNamespace(T=3, judge_failed=[False, True, False], cut_off=[True, False, False])
    parts = {"idr": [2.0, 0.0, 1.0], "rlver": [0.1, 0.0, -0.04]}
    r, failed = trainer.turn_rewards(parts, tr, args)
    penalty = 0.5 * (3**0.5 + 0.05)  # 0.891025
    r1, r3 = 2.0 + 0.05, 1.0 - 0.02  # 2.05, 0.98 before the penalty
    # the EMPA judge failed on turn 2: its reward is the mean of the dialogue's valid ones before the penalty,
    # (2.05 + 0.98) / 2 = 1.515; then the cut-off turn 1 pays it: 2.05 - 0.891025 = 1.158975
    inputs = (
        f"--reward idr+0.5*rlver, parts {parts}, judge_failed {tr.judge_failed}, cut_off {tr.cut_off}, "
        "--cut-off-penalty 0.5 (units: idr sqrt 3, rlver 0.1)"
    )
    case = "weighted parts; turn 2 failed (filled with the mean of 2.05 and 0.98); turn 1 cut off (pays 0.891)"
    expect(r, [r1 - penalty, (r1 + r3) / 2, r3], case, inputs, equation)
    expect(failed, [False, True, False], "which turns failed: the EMPA judge failed on turn 2", inputs, equation)
    # a criteria judge that failed (a NaN part) fails its turn too; with no valid turn the filling is 0
    args = argparse.Namespace(**{**vars(args), "reward_weights": {"idr": 1.0}})
    tr = types.SimpleNamespace(T=2, judge_failed=[False, False], cut_off=[False, False])
    inputs = "--reward idr, parts {'idr': [1.5, nan]}, judge_failed [False, False], cut_off [False, False]"
    got = trainer.turn_rewards({"idr": [1.5, float("nan")]}, tr, args)
    case = "a NaN part (its criteria judge failed) fails the turn: filled with the mean of the valid rewards"
    expect(got, ([1.5, 1.5], [False, True]), case, inputs, equation)
    # a failed turn that was cut off pays its penalty too: 0 (no valid turn) - 0.5 sqrt(3)
    tr = types.SimpleNamespace(T=1, judge_failed=[True], cut_off=[True])
    inputs = "--reward idr, parts {'idr': [0.0]}, judge_failed [True], cut_off [True], --cut-off-penalty 0.5"
    got = trainer.turn_rewards({"idr": [0.0]}, tr, args)
    case = "a failed turn that was cut off: filled with 0 (no valid turn), then it pays 0.5 sqrt 3 too"
    expect(got, ([-0.866025], [True]), case, inputs, equation)


def test_discounted_returns(trainer):
    equation = "G_t = sum_{j >= t} gamma^(j - t) r_j = r_t + gamma G_{t+1}"
    got = trainer.discounted_returns([0.0, 1.0, 2.0], 0.5)
    case = "three turns: G_3 = 2, G_2 = 1 + 0.5 * 2 = 2, G_1 = 0 + 0.5 * 2 = 1"
    expect(got, [1.0, 2.0, 2.0], case, "r = [0, 1, 2], gamma 0.5", equation)
    expect(trainer.discounted_returns([], 0.9), [], "a dialogue with no turn", "r = [], gamma 0.9", equation)


A_TURN = (
    "A_turn[k][t] = (G[k][t] - mean_t) / (std_t + 1e-6) over the dialogues k that reached turn t, std_t the "
    "population std (ddof 0); 0 where fewer than 2 reached it"
)


def test_turn_level_advantages_compare_the_dialogues_that_reached_each_turn(trainer):
    # rewards k0 = [1, 2], k1 = [3], k2 = [0, 1, 2], gamma 0.5 -> G: [2, 2], [3], [1, 2, 2]
    # turn 1: G = 2, 3, 1: mean 2, population std sqrt(2/3) -> 0, +1.224745, -1.224745
    # turn 2: G = 2, 2 (k0, k2): no spread -> 0, 0;  turn 3: k2 alone reached it -> 0
    rewards = [[1.0, 2.0], [3.0], [0.0, 1.0, 2.0]]
    A_turn = trainer.turn_level_advantages(rewards, 0.5)
    case = (
        "unequal lengths, G = [2, 2], [3], [1, 2, 2]: turn 1 compares all three (std sqrt(2/3)), turn 2 only k0 "
        "and k2 (equal: 0), turn 3 only k2 (alone: 0)"
    )
    expect(A_turn, [[0.0, 0.0], [1.224745], [-1.224745, 0.0, 0.0]], case, f"rewards {rewards}, gamma 0.5", A_TURN)
    # two dialogues, turn 1: G = 1 + 0.5 * 4 = 3 and 1: +-1 (population std 1); turn 2: G = 4, 0: +-1
    rewards = [[1.0, 4.0], [1.0, 0.0]]
    case = "the same first reward, different returns: turn 1 G = 3 and 1 (the later turn counts), turn 2 G = 4, 0"
    got = trainer.turn_level_advantages(rewards, 0.5)
    expect(got, [[1.0, 1.0], [-1.0, -1.0]], case, f"rewards {rewards}, gamma 0.5", A_TURN)


A_GROUP = "A_group[k][t] = (r[k][t] - mean) / (std + 1e-6) over all the group's rewards, the population std (ddof 0)"


def test_group_level_advantages_pool_every_reward(trainer):
    # r = 1, 2, 3, 0, 1, 2 over the group: mean 1.5, population std sqrt(5.5 / 6) = 0.957427
    rewards = [[1.0, 2.0], [3.0], [0.0, 1.0, 2.0]]
    case = "six rewards pooled over three dialogues: mean 1.5, population std sqrt(5.5 / 6) = 0.957427"
    expected = [[-0.522233, 0.522233], [1.566699], [-1.566699, -0.522233, 0.522233]]
    expect(trainer.group_level_advantages(rewards), expected, case, f"rewards {rewards}", A_GROUP)
    got = trainer.group_level_advantages([[0.7]])
    expect(got, [[0.0]], "a single reward: nothing to compare, 0", "rewards [[0.7]]", A_GROUP)
    got = trainer.group_level_advantages([[0.5, 0.5], [0.5]])
    expect(got, [[0.0, 0.0], [0.0]], "no spread: every reward equal, 0", "rewards [[0.5, 0.5], [0.5]]", A_GROUP)


MICA = "A[k][t] = alpha A_turn[k][t] + (1 - alpha) A_group[k][t], per scenario group; A_terms = {A_turn, A_group}"


def mica(trainer, group, alpha, gamma):
    """04's registered MICA estimator on one scenario group (rewards[k][t]) -> A[k][t]."""
    A, _ = trainer.ADVANTAGES["mica"]([group], None, argparse.Namespace(alpha=alpha, gamma=gamma))
    return A[0]


def test_mica_unequal_lengths_single_reacher_zero_variance(trainer):
    # rewards: k0 = [1, 2], k1 = [3], k2 = [0, 1, 2]; gamma 0.5 -> G: [2, 2], [3], [1, 2, 2]
    # MICA's Eq. 2: the population std, sigma = sqrt( (1/N) sum (x - mean)^2 ), in both scopes
    # turn 0: G = 2, 3, 1 -> mean 2, std sqrt(2/3) = 0.816497 -> A_turn 0, 1.224745, -1.224745
    # turn 1: G = 2, 2 -> zero variance -> 0, 0;  turn 2: reached by k2 only -> 0
    # group: r = 1, 2, 3, 0, 1, 2 -> mean 1.5, std sqrt(5.5/6) = 0.957427 -> A_group = (r - 1.5) / 0.957427
    # A = 0.4 A_turn + 0.6 A_group: k0 0.6 * -0.522233 = -0.313340; k1 0.4 * 1.224745 + 0.6 * 1.566699 = 1.429916
    rewards = [[1.0, 2.0], [3.0], [0.0, 1.0, 2.0]]
    inputs = f"one group, rewards {rewards}, alpha 0.4, gamma 0.5"
    case = "alpha 0.4: 0.4 A_turn + 0.6 A_group"
    expected = [[-0.313340, 0.313340], [1.429916], [-1.429916, -0.313340, 0.313340]]
    expect(mica(trainer, rewards, 0.4, 0.5), expected, case, inputs, MICA)
    # the registered estimator returns its two terms, the ones the run logs and the credit picture draws
    _, terms = trainer.ADVANTAGES["mica"]([rewards], None, argparse.Namespace(alpha=0.4, gamma=0.5))
    case = "the terms: a dict with A_turn and A_group, each [s][k][t]"
    expect(sorted(terms), ["A_group", "A_turn"], case, inputs, MICA)
    expect(terms["A_turn"][0], [[0.0, 0.0], [1.224745], [-1.224745, 0.0, 0.0]], case, inputs, MICA)
    expected = [[-0.522233, 0.522233], [1.566699], [-1.566699, -0.522233, 0.522233]]
    expect(terms["A_group"][0], expected, case, inputs, MICA)
    # two scenario groups: each is compared within itself; the second's large rewards change nothing in the first
    batch = [rewards, [[10.0], [0.0]]]
    A, terms = trainer.ADVANTAGES["mica"](batch, None, argparse.Namespace(alpha=0.4, gamma=0.5))
    inputs = f"two groups, rewards {batch}, alpha 0.4, gamma 0.5"
    case = "two scenario groups: each is normalised within its own group, never over the batch"
    expected = [[[-0.313340, 0.313340], [1.429916], [-1.429916, -0.313340, 0.313340]], [[1.0], [-1.0]]]
    expect(A, expected, case, inputs, MICA)
    expect([terms["A_turn"][1], terms["A_group"][1]], [[[1.0], [-1.0]], [[1.0], [-1.0]]], case, inputs, MICA)


def test_mica_alpha_extremes(trainer):
    r = [[1.0, 2.0], [3.0], [0.0, 1.0, 2.0]]
    case = "alpha 1: A = A_turn alone"
    expect(mica(trainer, r, 1.0, 0.5), [[0, 0], [1.224745], [-1.224745, 0, 0]], case, f"rewards {r}, gamma 0.5", MICA)
    case = "alpha 0: A = A_group alone"
    expected = [[-0.522233, 0.522233], [1.566699], [-1.566699, -0.522233, 0.522233]]
    expect(mica(trainer, r, 0.0, 0.5), expected, case, f"rewards {r}, gamma 0.5", MICA)
    # the sample std (ddof = 1) would give 1 and 1.430194 here: sqrt(N / (N - 1)) larger std, smaller A


def test_mica_degenerate_groups(trainer):
    case = "every reward equal: A = 0"
    expect(mica(trainer, [[0.5, 0.5], [0.5, 0.5]], 0.4, 0.85), [[0.0, 0.0], [0.0, 0.0]], case, "[[0.5, 0.5]] * 2", MICA)
    expect(mica(trainer, [[1.0]], 0.4, 0.85), [[0.0]], "a single reward: 0", "rewards [[1.0]]", MICA)
    got = mica(trainer, [[], [1.0, 2.0]], 0.4, 1.0)[0]
    expect(got, [], "an empty dialogue keeps an empty list", "rewards [[], [1.0, 2.0]], gamma 1", MICA)
    got = mica(trainer, [[1.0, 2.0], [1.0, 2.0]], 0.4, 1.0)
    case = "two equal dialogues: A_turn 0; the group's rewards 1, 2, 1, 2 (std 0.5) give A_group -1, +1"
    expect(got, [[-0.6, 0.6]] * 2, case, "rewards [[1, 2], [1, 2]], alpha 0.4, gamma 1", MICA)


GRPO = (
    "R_k = sum_t r[k][t];  A[k][t] = (R_k - mean) / (std + 1e-6) on every turn, over the scenario group's K "
    "dialogues, the sample std (ddof 1); 0 when K < 2"
)


def grpo(trainer, batch):
    """04's registered GRPO estimator on scenario groups rewards[s][k][t] -> A[s][k][t]."""
    return trainer.ADVANTAGES["grpo"](batch, None, argparse.Namespace())[0]


def test_grpo_outcome_on_every_turn(trainer):
    # R = 3, 6, 0: mean 3, sample std 3 -> A = 0, 1, -1 on every turn
    group = [[1.0, 2.0], [6.0], [0.0, 0.0, 0.0]]
    case = "R = 3, 6, 0: mean 3, sample std 3; each dialogue's A on every one of its turns"
    expect(grpo(trainer, [group])[0], [[0.0, 0.0], [1.0], [-1.0, -1.0, -1.0]], case, f"one group {group}", GRPO)
    expect(grpo(trainer, [[[2.0], [2.0]]])[0], [[0.0], [0.0]], "equal outcomes: 0", "one group [[2], [2]]", GRPO)
    expect(grpo(trainer, [[[2.0, 1.0]]])[0], [[0.0, 0.0]], "one dialogue: 0", "one group [[2, 1]]", GRPO)
    # two scenario groups: each dialogue against its own group's; R = 100, 50: mean 75, sample std 35.355
    batch = [group, [[100.0], [50.0]]]
    case = "two scenario groups: each is normalised within its own group, never over the batch"
    expected = [[[0.0, 0.0], [1.0], [-1.0, -1.0, -1.0]], [[0.707107], [-0.707107]]]
    expect(grpo(trainer, batch), expected, case, f"two groups {batch}", GRPO)


RF_PP = (
    "G_t = r_t + gamma G_{t+1} per dialogue; A = (G - mean) / (std + 1e-6) over every turn of every dialogue of "
    "the batch (no groups), the sample std (ddof 1)"
)


def test_reinforce_pp_whitens_over_the_batch(trainer):
    # gamma 1: G = [[3, 2]], [[1], [0]]  -> flat [3, 2, 1, 0]: mean 1.5, std 1.290994
    batch = [[[1.0, 2.0]], [[1.0], [0.0]]]
    A = trainer.ADVANTAGES["reinforce_pp"](batch, None, argparse.Namespace(gamma=1.0))[0]
    s = math.sqrt(5 / 3)
    case = "gamma 1: G = [3, 2], [1], [0] whitened together: mean 1.5, sample std 1.290994"
    expect(A, [[[1.5 / s, 0.5 / s]], [[-0.5 / s], [-1.5 / s]]], case, f"rewards {batch}, gamma 1", RF_PP)
    # gamma 0.5: G = [2, 2], [1], [0] -> mean 1.25, sample std sqrt(2.75 / 3) = 0.957427
    A_half = trainer.ADVANTAGES["reinforce_pp"](batch, None, argparse.Namespace(gamma=0.5))[0]
    case = "gamma 0.5 discounts: G = [1 + 0.5 * 2, 2], [1], [0] = [2, 2], [1], [0]; mean 1.25, sample std 0.957427"
    expected = [[[0.783349, 0.783349]], [[-0.261116], [-1.305582]]]
    expect(A_half, expected, case, f"rewards {batch}, gamma 0.5", RF_PP)
    # no per-prompt grouping: the same trajectory in a better batch gets a lower advantage
    better = [[[1.0, 2.0]], [[5.0], [5.0]]]
    A2 = trainer.ADVANTAGES["reinforce_pp"](better, None, argparse.Namespace(gamma=1.0))[0]
    case = "no groups: the same dialogue [1, 2] in a better batch gets a lower advantage on its first turn"
    expect(A2[0][0][0] < A[0][0][0], True, case, f"rewards {batch}, then {better}, gamma 1", RF_PP)


CLIP = (
    "loss_i = max(-ratio_i A_i, -clip(ratio_i, 1 - 0.2, 1 + 0.28) A_i), ratio_i = exp(logp_i - logp_old_i); "
    "clipped_i = 1 where the clipped term is the larger (the clip chose the loss), else 0"
)
K3 = "k3_i = exp(ref_i - logp_i) - (ref_i - logp_i) - 1"


def test_clipped_surrogate_and_kl(trainer):
    logp = torch.log(torch.tensor([1.5, 0.5, 1.0]))  # ratios 1.5, 0.5, 1.0 against logp_old = 0
    old = torch.zeros(3)
    A = torch.tensor([1.0, -1.0, 2.0])
    loss, clipped, ratio = trainer.clipped_surrogate(logp, old, A, 0.2, 0.28)
    inputs = "ratios 1.5, 0.5, 1.0 (logp = log ratio, logp_old = 0), A = 1, -1, 2, clip 0.2 / 0.28"
    expect(ratio, [1.5, 0.5, 1.0], "the ratio returned is exp(logp - logp_old)", inputs, CLIP)
    # ratio 1.5, A>0: min(1.5, 1.28) -> -1.28 (clipped); ratio 0.5, A<0: max(0.5, 0.8) -> 0.8 (clipped)
    case = "the clip chooses: ratio 1.5 with A > 0 stops at 1.28, ratio 0.5 with A < 0 at 0.8; ratio 1 is inside"
    expect(loss, [-1.28, 0.8, -2.0], case, inputs, CLIP)
    expect(clipped, [1.0, 1.0, 0.0], case, inputs, CLIP)
    # outside the band the clip does not always choose: ratio 1.5 with A < 0 loses more unclipped (1.5 > 1.28),
    # ratio 0.5 with A > 0 too (-0.5 > -0.8); those tokens keep their gradient and are not counted as clipped
    logp = torch.log(torch.tensor([1.5, 0.5, 1.1]))
    A = torch.tensor([-1.0, 1.0, 1.0])
    loss, clipped, _ = trainer.clipped_surrogate(logp, torch.zeros(3), A, 0.2, 0.28)
    inputs = "ratios 1.5, 0.5, 1.1 (logp_old = 0), A = -1, 1, 1, clip 0.2 / 0.28"
    case = (
        "outside the band the unclipped term can be the larger: ratio 1.5 with A < 0 (1.5 > 1.28) and ratio 0.5 "
        "with A > 0 (-0.5 > -0.8) are not clipped; ratio 1.1 is inside the band"
    )
    expect(loss, [1.5, -0.5, -1.1], case, inputs, CLIP)
    expect(clipped, [0.0, 0.0, 0.0], case, inputs, CLIP)
    kl = trainer.k3_kl(torch.tensor([0.0, -1.0]), torch.tensor([0.0, 0.0]))
    case = "k3 per token: 0 where logp = ref; e - 2 where ref - logp = 1"
    expect(kl, [0.0, math.exp(1) - 1 - 1], case, "logp = [0, -1], ref = [0, 0]", K3)
    # a backward pass: the loss must carry the gradient through the ratio. d loss_i / d logp_i = -A_i ratio_i where
    # the unclipped term is the larger, 0 where the clip chose the loss (the clamp is flat there); a ratio
    # detached from logp gives the right numbers above and no gradient at all
    logp = torch.log(torch.tensor([1.5, 0.5, 1.1, 1.5, 0.5])).requires_grad_()
    A = torch.tensor([-1.0, 1.0, 1.0, 1.0, -1.0])
    loss, _, _ = trainer.clipped_surrogate(logp, torch.zeros(5), A, 0.2, 0.28)
    got = torch.autograd.grad(loss.sum(), logp)[0] if loss.requires_grad else "no gradient: the loss is detached"
    inputs = "ratios 1.5, 0.5, 1.1, 1.5, 0.5 (logp_old = 0), A = -1, 1, 1, 1, -1, clip 0.2 / 0.28; d(sum loss) / d logp"
    case = "the gradient flows through the ratio: -A ratio on the unclipped tokens (1.5, -0.5, -1.1), 0 on the clipped"
    expect(got, [1.5, -0.5, -1.1, 0.0, 0.0], case, inputs, CLIP + "; d loss_i / d logp_i = -A_i ratio_i, or 0 clipped")


def schedule_factors(total_steps):
    _, sched = common.make_optimizer([torch.nn.Parameter(torch.zeros(1))], 1e-3, 0.0, total_steps)
    return [sched.lr_lambdas[0](step) for step in range(total_steps)]


def test_schedule_under_30_steps_is_the_one_the_runs_were_made_with():
    """transformers' warmup-stable-decay schedule in make_optimizer gives, to the last bit, the factors of the
    hand-written schedule before it: under 30 steps, 1 at steps 0 and 1, then 0.5 (1 + cos(pi (s - 1) / (T - 1))).
    (make demo's 4 steps print the same digits.)"""
    assert schedule_factors(4) == [1.0, 1.0, 0.75, 0.2500000000000001]  # cos(pi/3) = 0.5, cos(2 pi/3) = -0.5
    assert schedule_factors(20) == [
        1.0,
        1.0,
        0.9931806517013612,  # 0.5 (1 + cos(pi / 19))
        0.9729086208503173,
        0.9397368756032445,
        0.8945702546981968,
        0.8386407858128706,
        0.7734740790612136,
        0.7008477123264848,
        0.6227427435703996,
        0.5412896727361662,
        0.4587103272638339,
        0.37725725642960045,
        0.29915228767351537,
        0.22652592093878665,
        0.16135921418712956,
        0.10542974530180327,
        0.06026312439675552,
        0.02709137914968268,
        0.006819348298638839,  # 0.5 (1 + cos(18 pi / 19)): small, not 0
    ]


def test_cosine_schedule():
    """100 steps, 5% warmup: w = 5; the factor rises from 0 over w - 1 = 4 steps, is 1 at step 4, then the
    half cosine over the last 95 steps, 0.5 (1 + cos(pi (s - 5) / 95)), towards 0."""
    _, sched = common.make_optimizer(
        [torch.nn.Parameter(torch.zeros(1))], lr=1e-3, weight_decay=0.0, total_steps=100, warmup_ratio=0.05
    )
    factor = sched.lr_lambdas[0]
    assert [factor(s) for s in range(7)] == pytest.approx([0.0, 0.25, 0.5, 0.75, 1.0, 1.0, 0.9997266286704631])
    assert factor(100) == pytest.approx(0.0)
    assert factor(52.5) == pytest.approx(0.5)
    assert factor(99) == pytest.approx(0.000273371329537)
    assert sched.get_last_lr() == [0.0]  # the first step's lr


def test_k3_kl_averages_to_the_kl_under_the_policy(trainer):
    # per token exp(ref - logp) - (ref - logp) - 1: d = ref - logp = 0, 1, -0.5
    kl = trainer.k3_kl(torch.tensor([0.0, -1.0, -0.5]), torch.tensor([0.0, 0.0, -1.0]))
    case = "three tokens, ref - logp = 0, 1, -0.5"
    expected = [0.0, math.e - 2, math.exp(-0.5) + 0.5 - 1]
    expect(kl, expected, case, "logp = [0, -1, -0.5], ref = [0, 0, -1]", K3)
    # weighted by pi over the whole vocabulary its mean is KL(pi || ref) itself (ref sums to 1)
    pi, ref = torch.tensor([0.5, 0.3, 0.2]), torch.tensor([0.2, 0.2, 0.6])
    k3 = trainer.k3_kl(pi.log(), ref.log())
    inputs = "pi = [0.5, 0.3, 0.2], ref = [0.2, 0.2, 0.6] over a vocabulary of 3 (logp = log pi, ref = log ref)"
    case = "averaged under pi, k3 is KL(pi || ref) = 0.3195"
    expect(float((pi * k3).sum()), float((pi * (pi / ref).log()).sum()), case, inputs, K3, tol=1e-6)
    expect(bool((k3 >= 0).all()), True, "k3 is never negative", inputs, K3)


MASK = "scored() = the [start, end) span of every reply whose advantage is not None (0.0 is an advantage)"


def test_the_token_mask_holds_the_replies_with_an_advantage(trainer):
    # replies at [3, 7), [9, 12), [15, 20); the judge failed on the second (A None): its 3 tokens are not scored
    a = trainer.Sample(
        ids=list(range(100, 120)),
        spans=[(3, 7), (9, 12), (15, 20)],
        advantages=[0.5, None, -1.0],
        logp_sampler=[[-1.0] * 4, [-2.0] * 3, [-3.0] * 5],
    )
    b = trainer.Sample(ids=[7] * 6, spans=[(2, 5)], advantages=[2.0], logp_sampler=[[-4.0] * 3])
    inputs = "spans [(3, 7), (9, 12), (15, 20)], advantages [0.5, None, -1.0]"
    case = "the failed turn (A None) is left out"
    expect(a.scored(), [[3, 7], [15, 20]], case, inputs, MASK)
    expect(a.n_tokens(), 9, case + ": 4 + 5 tokens", inputs, MASK)
    case = "A_i of every scored token, in order"
    expect(a.token_advantages(), [0.5] * 4 + [-1.0] * 5, case, inputs, MASK)
    case = "the sampler's log-probabilities of the same tokens"
    expect(a.sampler_logprobs(), [-1.0] * 4 + [-3.0] * 5, case, inputs, MASK)
    ids, attn, mask = trainer.collate([a, b], 0, "cpu")
    inputs += "; and a second sample of 6 ids, span (2, 5), advantage 2.0"
    case = "collate's loss mask: 1 on the scored spans only, rows padded on the right"
    expect(mask, [[0] * 3 + [1] * 4 + [0] * 8 + [1] * 5, [0, 0, 1, 1, 1] + [0] * 15], case, inputs, MASK)
    expect(attn, [[1] * 20, [1] * 6 + [0] * 14], "collate's attention mask", inputs, MASK)
    # an advantage of 0.0 is an advantage: its reply is scored (a degenerate group's tokens count in N)
    c = trainer.Sample(
        ids=[1] * 10, spans=[(1, 3), (4, 6), (7, 9)], advantages=[0.0, None, 2.0], logp_sampler=[[-1.0] * 2] * 3
    )
    inputs = "spans [(1, 3), (4, 6), (7, 9)], advantages [0.0, None, 2.0]"
    case = "an advantage of 0.0 is scored; only None is left out"
    expect(c.scored(), [[1, 3], [7, 9]], case, inputs, MASK)
    # as_samples: the advantage of a failed turn becomes None (default: where the EMPA judge failed)
    tr = types.SimpleNamespace(
        T=2,
        ids=list(range(8)),
        spans=[(1, 3), (5, 8)],
        judge_failed=[True, False],
        sampler_logprobs=[[-1.0] * 2, [-2.0] * 3],
    )
    s = trainer.as_samples([tr], [[0.3, -0.2]])[0]
    inputs = "a dialogue of 2 turns, spans [(1, 3), (5, 8)], judge_failed [True, False], A [0.3, -0.2]"
    case = "as_samples gives the failed turn A None: only turn 2's 3 tokens are scored"
    expect([s.advantages, s.scored(), s.n_tokens()], [[None, -0.2], [[5, 8]], 3], case, inputs, MASK)


def test_truncated_importance_weights_by_hand(trainer):
    """w_i = min(exp(log pi_old - log pi_sampler), C): equal log-probabilities give 1, a sampler less sure of the
    token than pi_old gives exp(0.5) = 1.6487 capped at 1.5, a sampler more sure gives exp(-1) = 0.3679."""
    logp_old = torch.tensor([-1.0, -2.0, -0.5])
    logp_sampler = torch.tensor([-1.0, -2.5, 0.5])
    w, capped = trainer.tis_weights(logp_old, logp_sampler, 1.5)
    assert torch.allclose(w, torch.tensor([1.0, 1.5, math.exp(-1.0)]))
    assert capped.tolist() == [0.0, 1.0, 0.0]
    w, capped = trainer.tis_weights(logp_old, logp_sampler, 2.0)
    assert w[1].item() == pytest.approx(math.exp(0.5)) and capped.sum() == 0
    logp = logp_old.clone().requires_grad_()
    assert not trainer.tis_weights(logp, logp_sampler, 2.0)[0].requires_grad  # the weight is data: no gradient


def update_with(trainer, tiny_model, tis_cap, shift):
    """One policy_update (one minibatch, one optimizer step) of 4 fixed dialogues whose sampler log-probabilities
    are pi_old's own minus `shift` (a sampler less sure of every token by `shift` nats): its statistics."""
    from accelerate import Accelerator

    args = policy_args(
        tiny_model,
        minibatch_size=8,
        micro_batch_size=1,
        update_epochs=1,
        temperature=1.0,
        kl_coef=0.0,
        tis_cap=tis_cap,
    )
    torch.manual_seed(0)
    model, tok = common.load_policy(args)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    rows = [[(7 * i + j) % 90 + 3 for j in range(20 + i)] for i in range(4)]
    spans = [[(4, len(r))] for r in rows]
    model.train()
    old = []
    for r, s in zip(rows, spans):  # one row at a time, as the update's micro-batches of 1 score them
        with torch.no_grad():
            old.append(sampling.token_logprobs(model, *sampling.right_pad([r], tok.pad_token_id, [s])))
    samples = [
        trainer.Sample(r, s, [(-1.0) ** i], [(lp - shift).tolist()])
        for i, (r, s, lp) in enumerate(zip(rows, spans, old))
    ]
    return trainer.policy_update(model, tok, opt, sched, samples, args, Accelerator())


def test_the_correction_off_is_the_loss_as_before_and_on_it_weights_each_token(trainer, tiny_model):
    """--tis-cap 0: no weight enters the loss and none is logged. A sampler that drew every token with pi_old's own
    log-probability gives weights of exactly 1 and the same loss to the last digit; one less sure by log 2 gives
    weights of 2 and twice the loss (the weights multiply each token's clipped term); under a cap of 1.5, every
    token's weight is capped at 1.5 and the loss is 1.5 times."""
    off = update_with(trainer, tiny_model, 0.0, 0.0)
    assert "tis_weight_mean" not in off and off["optimizer_steps"] == 1
    same = update_with(trainer, tiny_model, 2.0, 0.0)
    assert same["loss"] == off["loss"] and same["tis_weight_mean"] == 1.0 and same["tis_capped"] == 0.0
    double = update_with(trainer, tiny_model, 4.0, math.log(2.0))
    assert double["tis_weight_mean"] == pytest.approx(2.0, rel=1e-5) and double["tis_capped"] == 0.0
    assert double["loss"] == pytest.approx(2 * off["loss"], rel=1e-5)
    capped = update_with(trainer, tiny_model, 1.5, math.log(2.0))
    assert capped["tis_weight_mean"] == pytest.approx(1.5) and capped["tis_capped"] == 1.0
    assert capped["loss"] == pytest.approx(1.5 * off["loss"], rel=1e-5)

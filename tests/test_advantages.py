"""The reward and advantage equations of 04_mica_train against hand-computed numbers."""

import argparse
import math

import pytest
import torch

import common


def approx(xs, ys, tol=1e-4):
    assert len(xs) == len(ys)
    for x, y in zip(xs, ys):
        if isinstance(x, list):
            approx(x, y, tol)
        else:
            assert abs(x - y) < tol, (xs, ys)


def mica(trainer, group, alpha, gamma):
    """04's registered MICA estimator on one scenario group (rewards[k][t]) -> A[k][t]; also its terms."""
    A, terms = trainer.ADVANTAGES["mica"]([group], None, argparse.Namespace(alpha=alpha, gamma=gamma))
    return A[0]


def grpo(trainer, group):
    return trainer.ADVANTAGES["grpo"]([group], None, argparse.Namespace())[0][0]


def test_idr_reference_worked_example(trainer):
    # docs/reference.md section 3: P0 = (-6,-9,-4), v = (1,3,0), (-1,1,1), (3,-1,1), eps = 1
    states = [[-6, -9, -4], [-5, -6, -4], [-6, -5, -3], [-3, -6, -2]]
    approx(trainer.env.incremental_distance_rewards(states), [2.828427, 0.363, 1.231], tol=1e-3)
    # distances 9.899, 7.071, 6.708, 5.477: the rewards telescope to d(P0) - d(P3)
    assert sum(trainer.env.incremental_distance_rewards(states)) == pytest.approx(9.899495 - 5.477226, abs=1e-5)


def test_idr_weights_eps_and_overshoot(trainer):
    # inside the tolerance the distance is 0, so moving within it earns nothing; overshoot is not paid
    assert trainer.env.incremental_distance_rewards([[-0.5, 0, 0], [2, 2, 2]]) == [0.0]
    # w = (4, 0, 0), eps = 2: d((-5,-9,-9)) = sqrt(4 * 3^2) = 6, d((-3,..)) = sqrt(4 * 1) = 2
    assert trainer.env.incremental_distance_rewards([[-5, -9, -9], [-3, -1, -1]], (4, 0, 0), 2.0) == [4.0]


def test_turn_rewards_weights_penalises_and_fills(trainer):
    import types

    # --reward idr+0.5*rlver: r_t = r_idr,t + 0.5 r_rlver,t - penalty * cut_t, penalty = 0.5 (sqrt(3) + 0.5 * 0.1)
    args = argparse.Namespace(
        reward_weights={"idr": 1.0, "rlver": 0.5},
        idr_weights=(1, 1, 1),
        cut_off_penalty=0.5,
        kardia_format=False,
        care_distance="plain",
    )
    tr = types.SimpleNamespace(T=3, judge_failed=[False, True, False], cut_off=[True, False, False])
    r, failed = trainer.turn_rewards({"idr": [2.0, 0.0, 1.0], "rlver": [0.1, 0.0, -0.04]}, tr, args)
    penalty = 0.5 * (3**0.5 + 0.05)  # 0.891025
    r1, r3 = 2.0 + 0.05, 1.0 - 0.02  # 2.05, 0.98 before the penalty
    # the EMPA judge failed on turn 2: its reward is the mean of the dialogue's valid ones before the penalty,
    # (2.05 + 0.98) / 2 = 1.515; then the cut-off turn 1 pays it: 2.05 - 0.891025 = 1.158975
    approx(r, [r1 - penalty, (r1 + r3) / 2, r3])
    assert failed == [False, True, False]
    # a criteria judge that failed (a NaN part) fails its turn too; with no valid turn the filling is 0
    args = argparse.Namespace(**{**vars(args), "reward_weights": {"idr": 1.0}})
    tr = types.SimpleNamespace(T=2, judge_failed=[False, False], cut_off=[False, False])
    assert trainer.turn_rewards({"idr": [1.5, float("nan")]}, tr, args) == ([1.5, 1.5], [False, True])
    # a failed turn that was cut off pays its penalty too: 0 (no valid turn) - 0.5 sqrt(3)
    tr = types.SimpleNamespace(T=1, judge_failed=[True], cut_off=[True])
    r, failed = trainer.turn_rewards({"idr": [0.0]}, tr, args)
    approx(r, [-0.866025])
    assert failed == [True]


def test_discounted_returns(trainer):
    approx(trainer.discounted_returns([0.0, 1.0, 2.0], 0.5), [1.0, 2.0, 2.0])
    assert trainer.discounted_returns([], 0.9) == []


def test_turn_level_advantages_compare_the_dialogues_that_reached_each_turn(trainer):
    # rewards k0 = [1, 2], k1 = [3], k2 = [0, 1, 2], gamma 0.5 -> G: [2, 2], [3], [1, 2, 2]
    # turn 1: G = 2, 3, 1: mean 2, population std sqrt(2/3) -> 0, +1.224745, -1.224745
    # turn 2: G = 2, 2 (k0, k2): no spread -> 0, 0;  turn 3: k2 alone reached it -> 0
    A_turn = trainer.turn_level_advantages([[1.0, 2.0], [3.0], [0.0, 1.0, 2.0]], 0.5)
    approx(A_turn, [[0.0, 0.0], [1.224745], [-1.224745, 0.0, 0.0]])
    # two dialogues, turn 1: G = 1 + 0.5 * 4 = 3 and 1: +-1 (population std 1); turn 2: G = 4, 0: +-1
    approx(trainer.turn_level_advantages([[1.0, 4.0], [1.0, 0.0]], 0.5), [[1.0, 1.0], [-1.0, -1.0]])


def test_group_level_advantages_pool_every_reward(trainer):
    # r = 1, 2, 3, 0, 1, 2 over the group: mean 1.5, population std sqrt(5.5 / 6) = 0.957427
    A_group = trainer.group_level_advantages([[1.0, 2.0], [3.0], [0.0, 1.0, 2.0]])
    approx(A_group, [[-0.522233, 0.522233], [1.566699], [-1.566699, -0.522233, 0.522233]])
    assert trainer.group_level_advantages([[0.7]]) == [[0.0]]  # a single reward: 0
    approx(trainer.group_level_advantages([[0.5, 0.5], [0.5]]), [[0.0, 0.0], [0.0]])  # no spread: 0


def test_mica_unequal_lengths_single_reacher_zero_variance(trainer):
    # rewards: k0 = [1, 2], k1 = [3], k2 = [0, 1, 2]; gamma 0.5 -> G: [2, 2], [3], [1, 2, 2]
    # MICA's Eq. 2: the population std, sigma = sqrt( (1/N) sum (x - mean)^2 ), in both scopes
    # turn 0: G = 2, 3, 1 -> mean 2, std sqrt(2/3) = 0.816497 -> A_turn 0, 1.224745, -1.224745
    # turn 1: G = 2, 2 -> zero variance -> 0, 0;  turn 2: reached by k2 only -> 0
    # group: r = 1, 2, 3, 0, 1, 2 -> mean 1.5, std sqrt(5.5/6) = 0.957427 -> A_group = (r - 1.5) / 0.957427
    # A = 0.4 A_turn + 0.6 A_group: k0 0.6 * -0.522233 = -0.313340; k1 0.4 * 1.224745 + 0.6 * 1.566699 = 1.429916
    A = mica(trainer, [[1.0, 2.0], [3.0], [0.0, 1.0, 2.0]], alpha=0.4, gamma=0.5)
    approx(A, [[-0.313340, 0.313340], [1.429916], [-1.429916, -0.313340, 0.313340]])
    # the registered estimator returns its two terms, the ones the run logs and the credit picture draws
    _, terms = trainer.ADVANTAGES["mica"](
        [[[1.0, 2.0], [3.0], [0.0, 1.0, 2.0]]], None, argparse.Namespace(alpha=0.4, gamma=0.5)
    )
    assert sorted(terms) == ["A_group", "A_turn"]
    approx(terms["A_turn"][0], [[0.0, 0.0], [1.224745], [-1.224745, 0.0, 0.0]])
    approx(terms["A_group"][0], [[-0.522233, 0.522233], [1.566699], [-1.566699, -0.522233, 0.522233]])


def test_mica_alpha_extremes(trainer):
    r = [[1.0, 2.0], [3.0], [0.0, 1.0, 2.0]]
    approx(mica(trainer, r, 1.0, 0.5), [[0, 0], [1.224745], [-1.224745, 0, 0]])  # turn-level only
    approx(
        mica(trainer, r, 0.0, 0.5),  # group-level only
        [[-0.522233, 0.522233], [1.566699], [-1.566699, -0.522233, 0.522233]],
    )
    # the sample std (ddof = 1) would give 1 and 1.430194 here: sqrt(N / (N - 1)) larger std, smaller A


def test_mica_degenerate_groups(trainer):
    assert mica(trainer, [[0.5, 0.5], [0.5, 0.5]], 0.4, 0.85) == [[0.0, 0.0], [0.0, 0.0]]
    assert mica(trainer, [[1.0]], 0.4, 0.85) == [[0.0]]  # a single reward: 0
    assert mica(trainer, [[], [1.0, 2.0]], 0.4, 1.0)[0] == []  # an empty trajectory
    A = mica(trainer, [[1.0, 2.0], [1.0, 2.0]], 0.4, 1.0)
    approx(A, [[-0.6, 0.6]] * 2)  # turn-level 0; group r = 1, 2, 1, 2: std 0.5 -> +-1


def test_grpo_outcome_on_every_turn(trainer):
    # R = 3, 3, 3+... -> R = [3, 6, 0]: mean 3, std 3 -> A = 0, 1, -1 on every turn
    A = grpo(trainer, [[1.0, 2.0], [6.0], [0.0, 0.0, 0.0]])
    approx(A, [[0.0, 0.0], [1.0], [-1.0, -1.0, -1.0]])
    assert grpo(trainer, [[2.0], [2.0]]) == [[0.0], [0.0]]
    assert grpo(trainer, [[2.0, 1.0]]) == [[0.0, 0.0]]


def test_reinforce_pp_whitens_over_the_batch(trainer):
    # gamma 1: G = [[3, 2]], [[1], [0]]  -> flat [3, 2, 1, 0]: mean 1.5, std 1.290994
    A = trainer.ADVANTAGES["reinforce_pp"]([[[1.0, 2.0]], [[1.0], [0.0]]], None, argparse.Namespace(gamma=1.0))[0]
    s = math.sqrt(5 / 3)
    approx(A, [[[1.5 / s, 0.5 / s]], [[-0.5 / s], [-1.5 / s]]])
    # no per-prompt grouping: the same trajectory in a better batch gets a lower advantage
    A2 = trainer.ADVANTAGES["reinforce_pp"]([[[1.0, 2.0]], [[5.0], [5.0]]], None, argparse.Namespace(gamma=1.0))[0]
    assert A2[0][0][0] < A[0][0][0]


def test_clipped_surrogate_and_kl(trainer):
    import torch

    logp = torch.log(torch.tensor([1.5, 0.5, 1.0]))  # ratios 1.5, 0.5, 1.0 against logp_old = 0
    old = torch.zeros(3)
    A = torch.tensor([1.0, -1.0, 2.0])
    loss, clipped, ratio = trainer.clipped_surrogate(logp, old, A, 0.2, 0.28)
    approx(ratio.tolist(), [1.5, 0.5, 1.0])
    # ratio 1.5, A>0: min(1.5, 1.28) -> -1.28 (clipped); ratio 0.5, A<0: max(0.5, 0.8) -> 0.8 (clipped)
    approx(loss.tolist(), [-1.28, 0.8, -2.0])
    assert clipped.tolist() == [1.0, 1.0, 0.0]
    kl = trainer.k3_kl(torch.tensor([0.0, -1.0]), torch.tensor([0.0, 0.0]))
    approx(kl.tolist(), [0.0, math.exp(1) - 1 - 1])


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
    approx(kl.tolist(), [0.0, math.e - 2, math.exp(-0.5) + 0.5 - 1])
    # weighted by pi over the whole vocabulary its mean is KL(pi || ref) itself (ref sums to 1)
    pi, ref = torch.tensor([0.5, 0.3, 0.2]), torch.tensor([0.2, 0.2, 0.6])
    k3 = trainer.k3_kl(pi.log(), ref.log())
    assert float((pi * k3).sum()) == pytest.approx(float((pi * (pi / ref).log()).sum()), abs=1e-6)  # 0.3195
    assert bool((k3 >= 0).all())


def test_the_token_mask_holds_the_replies_with_an_advantage(trainer):
    import types

    # replies at [3, 7), [9, 12), [15, 20); the judge failed on the second (A None): its 3 tokens are not scored
    a = trainer.Sample(
        ids=list(range(100, 120)),
        spans=[(3, 7), (9, 12), (15, 20)],
        advantages=[0.5, None, -1.0],
        sampler=[[-1.0] * 4, [-2.0] * 3, [-3.0] * 5],
    )
    b = trainer.Sample(ids=[7] * 6, spans=[(2, 5)], advantages=[2.0], sampler=[[-4.0] * 3])
    assert a.scored() == [(3, 7), (15, 20)] and a.n_tokens() == 9
    assert a.token_advantages().tolist() == [0.5] * 4 + [-1.0] * 5  # A_i of every scored token, in order
    assert a.sampler_logprobs().tolist() == [-1.0] * 4 + [-3.0] * 5  # the sampler's, of the same tokens
    ids, attn, mask = trainer.collate([a, b], 0, "cpu")
    assert mask.tolist() == [[0] * 3 + [1] * 4 + [0] * 8 + [1] * 5, [0, 0, 1, 1, 1] + [0] * 15]
    assert attn.tolist() == [[1] * 20, [1] * 6 + [0] * 14]
    # as_samples: the advantage of a failed turn becomes None (default: where the EMPA judge failed)
    tr = types.SimpleNamespace(
        T=2,
        ids=list(range(8)),
        spans=[(1, 3), (5, 8)],
        judge_failed=[True, False],
        sampler_logprobs=[[-1.0] * 2, [-2.0] * 3],
    )
    s = trainer.as_samples([tr], [[0.3, -0.2]])[0]
    assert s.advantages == [None, -0.2] and s.scored() == [(5, 8)] and s.n_tokens() == 3

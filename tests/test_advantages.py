"""The reward and advantage equations of 04_mica_train against hand-computed numbers."""

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


def test_discounted_returns(trainer):
    approx(trainer.discounted_returns([0.0, 1.0, 2.0], 0.5), [1.0, 2.0, 2.0])
    assert trainer.discounted_returns([], 0.9) == []


def test_mica_unequal_lengths_single_reacher_zero_variance(trainer):
    # rewards: k0 = [1, 2], k1 = [3], k2 = [0, 1, 2]; gamma 0.5 -> G: [2, 2], [3], [1, 2, 2]
    # MICA's Eq. 2: the population std, sigma = sqrt( (1/N) sum (x - mean)^2 ), in both scopes
    # turn 0: G = 2, 3, 1 -> mean 2, std sqrt(2/3) = 0.816497 -> A_turn 0, 1.224745, -1.224745
    # turn 1: G = 2, 2 -> zero variance -> 0, 0;  turn 2: reached by k2 only -> 0
    # group: r = 1, 2, 3, 0, 1, 2 -> mean 1.5, std sqrt(5.5/6) = 0.957427 -> A_group = (r - 1.5) / 0.957427
    # A = 0.4 A_turn + 0.6 A_group: k0 0.6 * -0.522233 = -0.313340; k1 0.4 * 1.224745 + 0.6 * 1.566699 = 1.429916
    A = trainer.mica_advantages([[1.0, 2.0], [3.0], [0.0, 1.0, 2.0]], alpha=0.4, gamma=0.5)
    approx(A, [[-0.313340, 0.313340], [1.429916], [-1.429916, -0.313340, 0.313340]])


def test_mica_alpha_extremes(trainer):
    r = [[1.0, 2.0], [3.0], [0.0, 1.0, 2.0]]
    approx(trainer.mica_advantages(r, 1.0, 0.5), [[0, 0], [1.224745], [-1.224745, 0, 0]])  # turn-level only
    approx(
        trainer.mica_advantages(r, 0.0, 0.5),  # group-level only
        [[-0.522233, 0.522233], [1.566699], [-1.566699, -0.522233, 0.522233]],
    )
    # the sample std (ddof = 1) would give 1 and 1.430194 here: sqrt(N / (N - 1)) larger std, smaller A


def test_mica_degenerate_groups(trainer):
    assert trainer.mica_advantages([[0.5, 0.5], [0.5, 0.5]], 0.4, 0.85) == [[0.0, 0.0], [0.0, 0.0]]
    assert trainer.mica_advantages([[1.0]], 0.4, 0.85) == [[0.0]]  # a single reward: 0
    assert trainer.mica_advantages([[], [1.0, 2.0]], 0.4, 1.0)[0] == []  # an empty trajectory
    A = trainer.mica_advantages([[1.0, 2.0], [1.0, 2.0]], 0.4, 1.0)
    approx(A, [[-0.6, 0.6]] * 2)  # turn-level 0; group r = 1, 2, 1, 2: std 0.5 -> +-1


def test_grpo_outcome_on_every_turn(trainer):
    # R = 3, 3, 3+... -> R = [3, 6, 0]: mean 3, std 3 -> A = 0, 1, -1 on every turn
    A = trainer.grpo_advantages([[1.0, 2.0], [6.0], [0.0, 0.0, 0.0]])
    approx(A, [[0.0, 0.0], [1.0], [-1.0, -1.0, -1.0]])
    assert trainer.grpo_advantages([[2.0], [2.0]]) == [[0.0], [0.0]]
    assert trainer.grpo_advantages([[2.0, 1.0]]) == [[0.0, 0.0]]


def test_reinforce_pp_whitens_over_the_batch(trainer):
    # gamma 1: G = [[3, 2]], [[1], [0]]  -> flat [3, 2, 1, 0]: mean 1.5, std 1.290994
    A = trainer.reinforce_pp_advantages([[[1.0, 2.0]], [[1.0], [0.0]]], gamma=1.0)
    s = math.sqrt(5 / 3)
    approx(A, [[[1.5 / s, 0.5 / s]], [[-0.5 / s], [-1.5 / s]]])
    # no per-prompt grouping: the same trajectory in a better batch gets a lower advantage
    A2 = trainer.reinforce_pp_advantages([[[1.0, 2.0]], [[5.0], [5.0]]], gamma=1.0)
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

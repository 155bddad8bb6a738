"""experiments/credit.py: its environment is 03's EMPA dynamics (a scripted dialogue checked by hand), its
estimators are 04's, and --quick runs end to end with a row per estimator and the learning curves."""

import argparse
import importlib
import math
import sys

from conftest import ROOT, run_script

sys.path.insert(0, str(ROOT / "experiments"))
credit = importlib.import_module("credit")
env = importlib.import_module("03_rollout")
trainer = importlib.import_module("04_mica_train")

# (move, v_t by hand from judge_move's table and 03's points: progress 2 = +3, 1 = +1; negative 1 = -2)
SCRIPT = [
    ("suggest", [0, -2, 0]),  # not yet understood: -A1
    ("validate", [0, 3, 0]),  # 1st validation: A2
    ("clarify", [3, 0, 0]),  # C2
    ("reflect", [1, 1, 0]),  # not yet understood: C1 A1 (A has 2 left of 3: more than half)
    ("suggest", [0, 0, 3]),  # understood now (C 1 of 5 left, A 1 of 3): P2
    ("affirm", [0, 1, 1]),  # understood: A1 P1
    ("change_subject", [0, 1, 0]),  # A1 now, -C1 -A1 left for the next turn
    ("lecture", [-2, -2, 1]),
]  # P1 -C1, plus the debt's -A1


def test_a_scripted_dialogue_moves_03s_state_as_computed_by_hand(monkeypatch):
    calls = {"advance_state": 0, "episode_status": 0, "incremental_distance_rewards": 0}
    for name in calls:
        real = getattr(env, name)

        def spy(*a, _real=real, _name=name, **kw):
            calls[_name] += 1
            return _real(*a, **kw)

        monkeypatch.setattr(env, name, spy)
    assert credit.env is env and credit.trainer is trainer  # 03's and 04's modules, not copies
    P0 = [-6.0, -4.0, -9.0]
    args = argparse.Namespace(max_turns=len(SCRIPT), min_turns=4, collapse_window=5, table="short")
    tr, mem = credit.new_episode({"id": "hand", "p0": P0})
    for move, _ in SCRIPT:
        credit.step(tr, mem, move, args)
    states = [P0]
    for _, v in SCRIPT:
        states.append([states[-1][i] + v[i] for i in range(3)])  # P_t = P_{t-1} + v_t
    assert tr.vs == [[float(x) for x in v] for _, v in SCRIPT]
    assert tr.states == states and states[-1] == [-4.0, -2.0, -4.0]
    v_star = [-x / math.sqrt(133.0) for x in P0]  # v* = -P0 / ||P0||, ||P0||^2 = 133
    assert tr.dEs == [sum(v[i] * v_star[i] for i in range(3)) for _, v in SCRIPT]
    # E_total = 65 / sqrt(133) = 5.6 < ||P0|| = 11.5 and no collapse: the horizon ends it
    assert tr.outcome == "timeout" and calls["advance_state"] == calls["episode_status"] == len(SCRIPT)
    rewards = env.incremental_distance_rewards(tr.states)
    # the IDR return telescopes: d(P0) - d(P_T) = sqrt(5^2 + 3^2 + 8^2) - sqrt(3^2 + 1^2 + 3^2)
    assert math.isclose(sum(rewards), math.sqrt(98) - math.sqrt(19))
    assert rewards[0] == env.hinge_distance(P0) - env.hinge_distance([-6, -6, -9]) < 0  # premature advice
    # a sampled rollout scores its turns with 03's IDR too
    calls["incremental_distance_rewards"] = 0
    theta = [[0.0] * len(credit.MOVES) for _ in range(credit.N_OBS)]
    sampled = credit.rollout(theta, {"id": "hand", "p0": P0}, __import__("random").Random(0), args)
    assert calls["incremental_distance_rewards"] == 1
    assert sampled.extra["rewards"] == env.incremental_distance_rewards(sampled.states)


def test_validation_wears_out_and_advice_waits_for_understanding():
    P0 = [-2.0, -20.0, -10.0]
    levels = []
    mem = credit.Memory()
    for _ in range(6):
        levels.append(credit.judge_move("validate", mem, P0, P0)[0]["A"])
        mem.validated += 1
    assert levels == [(2, 0)] * 3 + [(1, 0)] * 2 + [(0, 1)]
    assert credit.judge_move("suggest", credit.Memory(), P0, P0)[0]["P"] == (0, 0)
    assert credit.judge_move("suggest", credit.Memory(), [-1.0, -5.0, -10.0], P0)[0]["P"] == (2, 0)


def test_advantages_are_04s():
    rewards = [[[1.0, 0.0, 2.0], [0.5, 0.5]], [[0.0, 1.0], [2.0, 2.0, 2.0]]]
    for estimator in ({"kind": "mica", "alpha": 0.4}, {"kind": "grpo"}, {"kind": "reinforce_pp"}):
        args = argparse.Namespace(alpha=estimator.get("alpha"), gamma=0.85)
        assert credit.advantages(estimator, rewards, 0.85) == trainer.ADVANTAGES[estimator["kind"]](rewards, args)[0]
    # MICA at alpha 0.4 by hand on the first group's first dialogue's last turn: G = (2), (-, -) -> only k0
    # reached turn 2: A_turn 0; A_group = (2 - mean) / std over r = 1, 0, 2, 0.5, 0.5 (mean 0.8, std 0.678233)
    A = credit.advantages({"kind": "mica", "alpha": 0.4}, rewards, 0.85)
    assert abs(A[0][0][2] - 0.6 * (2 - 0.8) / (0.678233 + 1e-6)) < 1e-5


def test_quick_run_prints_a_row_per_estimator_and_draws_the_curves(tmp_path):
    p = run_script("experiments/credit.py", "--quick", "--seeds", 2, "--steps", 30, "--out", tmp_path, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    md = (tmp_path / "credit.md").read_text()
    for row in (
        "| MICA (alpha=0) |",
        "| MICA (alpha=0.4) |",
        "| MICA (alpha=1) |",
        "| GRPO |",
        "| REINFORCE++ |",
        "| untrained (uniform) policy |",
        "| myopic greedy",
        "| search ceiling",
    ):
        assert row in md and row in p.stdout, row
    assert "over 2 seeds" in md
    assert (tmp_path / "credit.png").stat().st_size > 0

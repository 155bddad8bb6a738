"""experiments/credit.py: its environment is 03's EMPA dynamics (a scripted dialogue checked by hand, under
each of the two tables), its estimators are 04's (and RLOO, the fork's, by hand), --quick runs end to end with
a row per estimator and the learning curves (both tables), the survivor analysis' arithmetic is checked on a
hand-made group, and --tune chooses each lr on the tuning seeds and training scenarios only and reports it on
the fresh seeds and test scenarios."""

import argparse
import importlib
import json
import math
import sys
from pathlib import Path

import pytest

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
        assert (
            credit.advantages(estimator, rewards, 0.85) == trainer.ADVANTAGES[estimator["kind"]](rewards, None, args)[0]
        )
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
        "| RLOO |",
        "| untrained (uniform) policy |",
        "| myopic greedy",
        "| search ceiling",
    ):
        assert row in md and row in p.stdout, row
    assert "over 2 seeds" in md
    assert (tmp_path / "credit.png").stat().st_size > 0


# --table delayed: (move, v_t by hand from judge_delayed's table; the topic at that turn)
DELAYED = [
    ("suggest", [0, -2, 0]),  # topic closed: -A1
    ("affirm", [1, 3, 0]),  # C1 A2 now; -A2 -P1 due at turn 5
    ("clarify", [0, -2, 0]),  # closed: -A1, opens the topic at turn 3
    ("suggest", [0, -2, 0]),  # opened 1 turn ago: not ready, -A1
    ("lecture", [-2, -5, -2]),  # opened 2 turns ago: -C1; plus turn 2's -A2 -P1
    ("suggest", [0, 0, 3]),  # 3 turns since the opening: open, P2
    ("reflect", [1, 3, 0]),  # open: C1 A2
    ("lecture", [-2, 0, 1]),  # open: P1 -C1
    ("clarify", [3, 0, 0]),  # open: C2
    ("change_subject", [0, 1, 0]),  # A1 now; -C1 -A1 due at turn 13
    ("validate", [0, 3, 0]),  # 1st: A2
    ("validate", [0, 3, 0]),  # 2nd: A2
    ("validate", [-2, 1, 0]),  # 3rd: A2, plus turn 10's -C1 -A1
    ("validate", [0, 1, 0]),  # 4th on: A1
]


def test_the_delayed_tables_rules_move_03s_state_as_its_docstring_says():
    P0 = [-9.0, -12.0, -10.0]
    args = argparse.Namespace(max_turns=len(DELAYED), min_turns=4, collapse_window=5, table="delayed")
    tr, mem = credit.new_episode({"id": "hand", "p0": P0})
    topics = []
    for move, _ in DELAYED:
        topics.append(credit.topic(mem))
        credit.step(tr, mem, move, args)
    assert topics == [0, 0, 0, 1, 1] + [2] * 9
    assert tr.vs == [[float(x) for x in v] for _, v in DELAYED]
    states = [P0]
    for _, v in DELAYED:
        states.append([states[-1][i] + v[i] for i in range(3)])
    assert tr.states == states and states[-1] == [-10.0, -8.0, -8.0]
    assert mem.opened == 3 and mem.due == {5: {"A": 2, "P": 1}, 13: {"C": 1, "A": 1}}
    assert tr.outcome == "timeout" and "end" not in tr.extra  # 3 negative dE in a row at most: no collapse
    # the policy's view: axis with the largest deficit (A: 0, C: 1, P: 2 of AXES' order), topic, 3+
    # validations, a penalty still to land; 36 values
    assert credit.observe_delayed(P0, P0, credit.Memory()) == ((1 * 3 + 0) * 2 + 0) * 2 + 0
    assert credit.observe_delayed([-1, -2, -9], P0, credit.Memory(validated=3, last=["affirm"], due={4: {"A": 2}})) == (
        ((2 * 3 + 0) * 2 + 1) * 2 + 1
    )
    # progress on an axis at or past 0 counts 0; two penalties due on one turn: the larger level per axis
    mem = credit.Memory(last=["affirm", "change_subject"], due={3: {"A": 2, "P": 1, "C": 1}})
    levels, later = credit.judge_delayed("affirm", mem, [0.0, -3.0, -5.0], P0)
    assert levels == {"C": (0, 1), "A": (2, 2), "P": (0, 1)} and later == {3: {"A": 2, "P": 1}}
    tr, mem = credit.new_episode({"id": "hand", "p0": P0})
    for move in ("affirm", "change_subject", "reflect", "reflect", "reflect"):
        credit.step(tr, mem, move, args)
    assert mem.due == {4: {"A": 2, "P": 1}, 5: {"C": 1, "A": 1}} and tr.vs[3] == [1.0, -4.0, -2.0]


def test_the_delayed_table_defeats_the_myopic_greedy_policy_and_not_the_search():
    args = credit.parse_args(["--table", "delayed"])
    assert args.beam_width == 128 and credit.parse_args([]).beam_width == 32
    scenario = env.load_scenarios(args.test)[3]  # test-04: P0 (-4, -19, -12), A the largest deficit
    ret, ok = credit.search_ceiling(scenario, args)
    assert ok and math.isclose(ret, env.hinge_distance(scenario["p0"]))  # the ceiling reaches d(P0)
    ret, ok = credit.myopic_greedy(scenario, args)
    assert not ok and ret < 0  # affirm every turn it can, never the question: P never moves


def test_a_rollout_without_early_ends_runs_on_and_keeps_where_it_would_have_ended():
    args = argparse.Namespace(max_turns=15, min_turns=4, collapse_window=5, table="delayed")
    theta = [[0.0] * len(credit.MOVES) for _ in range(credit.N_OBS)]
    scenario = {"id": "hand", "p0": [-4.0, -19.0, -12.0]}
    for seed in range(200):
        ended = credit.rollout(theta, scenario, __import__("random").Random(seed), args)
        if ended.outcome != "timeout":
            break
    assert ended.outcome == "failure" and len(ended.vs) < 15  # a collapse ended it early
    on = credit.rollout(theta, scenario, __import__("random").Random(seed), args, early_end=False)
    T = len(ended.vs)
    assert on.outcome == "timeout" and len(on.vs) == 15 and on.extra["end"] == (T, "failure") == ended.extra["end"]
    assert on.extra["moves"][:T] == ended.extra["moves"] and on.extra["rewards"][:T] == ended.extra["rewards"]


def test_the_survivor_analysis_arithmetic_by_hand():
    # one group of K = 3 (gamma 0.5, alpha 0.5): k0 runs the 3 turns, k1 collapses after 2, k2 succeeds after 1
    groups = [
        [
            __import__("types").SimpleNamespace(extra={"rewards": [1.0, 1.0, 1.0]}),
            __import__("types").SimpleNamespace(extra={"rewards": [0.0, 0.0, 4.0], "end": (2, "failure")}),
            __import__("types").SimpleNamespace(extra={"rewards": [2.0, 1.0, 1.0], "end": (1, "success")}),
        ]
    ]
    args = argparse.Namespace(max_turns=3, min_turns=1, survivor_alpha=0.5, gamma=0.5)
    sums = {}
    credit.survivor_batch(groups, args, sums)
    ends = sums[("outcome", "ends")]
    # as MICA sees them: G = (1.75, 1.5, 1), (0, 0), (2). Turn 1: all three, mean 1.25, population std
    # sqrt(2.375 / 3); turn 2: k0 and k1, +-1; turn 3: k0 alone (lone, A_turn 0)
    sd1 = math.sqrt(2.375 / 3)
    a1 = [(g - 1.25) / (sd1 + 1e-6) for g in (1.75, 0.0, 2.0)]
    a2 = 0.75 / (0.75 + 1e-6)
    assert math.isclose(ends["timeout"]["A_turn"], a1[0] + a2, rel_tol=1e-9)
    assert math.isclose(ends["failure"]["A_turn"], a1[1] - a2, rel_tol=1e-9)
    assert math.isclose(ends["success"]["A_turn"], a1[2], rel_tol=1e-9)
    assert abs(sum(c["A_turn"] for c in ends.values())) < 1e-12  # centred over the turns, by construction
    assert [ends[o]["lone"] for o in ("timeout", "failure", "success")] == [1, 0, 0]
    assert [ends[o]["turns"] for o in ("timeout", "failure", "success")] == [3, 2, 1]
    # A_group: the 6 rewards 1, 1, 1, 0, 0, 2 (mean 5/6, population std sqrt(17) / 6); A = (A_turn + A_group) / 2
    sd = math.sqrt(17) / 6
    assert math.isclose(ends["success"]["A_group"], (2 - 5 / 6) / (sd + 1e-6), rel_tol=1e-9)
    assert math.isclose(ends["success"]["A"], (a1[2] + (2 - 5 / 6) / (sd + 1e-6)) / 2, rel_tol=1e-9)
    # kept: the ended dialogues stay in turn 2's and 3's comparisons with G = 0: k0 is measured against
    # them, G (1.5, 0, 0) and (1, 0, 0): about +sqrt(2) on both turns where it had +1 and 0 (pushed up)
    kept = sums[("outcome", "kept")]
    k0 = a1[0] + 1.0 / (math.sqrt(1 / 2) + 1e-6) + (2 / 3) / (math.sqrt(2 / 9) + 1e-6)
    assert math.isclose(kept["timeout"]["A_turn"], k0, rel_tol=1e-9)
    assert math.isclose(kept["failure"]["A_turn"], a1[1] - 0.5 / (math.sqrt(1 / 2) + 1e-6), rel_tol=1e-9)
    # on: the same turns had every dialogue gone on (04's A_turn on the full rewards)
    full = trainer.turn_level_advantages([tr.extra["rewards"] for tr in groups[0]], 0.5)
    assert math.isclose(sums[("outcome", "on")]["failure"]["A_turn"], sum(full[1][:2]), rel_tol=1e-9)
    assert sums[("length", "ends")].keys() == {"1", "2", "3"}
    default = credit.parse_args([])
    assert [credit.length_bin(n, default) for n in (4, 7, 8, 10, 11, 14, 15)] == [
        "4-7",
        "4-7",
        "8-10",
        "8-10",
        "11-14",
        "11-14",
        "15",
    ]


def test_quick_run_of_the_delayed_table_prints_its_rows(tmp_path):
    p = run_script(
        "experiments/credit.py",
        *("--quick", "--table", "delayed", "--seeds", 2, "--steps", 10, "--final-eval-k", 2, "--beam-width", 32),
        *("--out", tmp_path),
    )
    assert p.returncode == 0, p.stderr[-3000:]
    md = (tmp_path / "credit.md").read_text()
    for row in ("| MICA (alpha=0) |", "| MICA (alpha=1) |", "| GRPO |", "| REINFORCE++ |"):
        assert row in md and row in p.stdout, row
    assert "| myopic greedy (argmax r_t, knows the table) | -6.79 | 0.00 |" in md
    assert "| search ceiling (beam 32) |" in md  # a beam of 32 is quicker; the default 128 is tested above
    assert "| untrained (uniform) policy | 1.06 |" in md and "table delayed (judge_delayed)" in md


def test_survivors_runs_end_to_end_and_a_turn_is_centred_over_all_dialogues(tmp_path):
    p = run_script(
        "experiments/credit.py",
        *("--survivors", "--table", "delayed", "--seeds", 2, "--steps", 5, "--survivor-groups", 5),
        *("--eval-every", 5, "--eval-k", 1, "--final-eval-k", 1, "--out", tmp_path),
    )
    assert p.returncode == 0, p.stderr[-3000:]
    md = (tmp_path / "survivors.md").read_text()
    assert md.count("By outcome:") == 2 and md.count("By length:") == 2 and "### Learning with and without" in md
    # every "all" row: the share 1, and A_turn per turn (as MICA sees it) 0: centred over the turns reached
    rows = [line.split(" | ") for line in md.splitlines() if line.startswith("| all |")]
    assert len(rows) == 4 and all(r[2].startswith("1.0000 ± 0.0000") for r in rows)
    assert all(abs(float(r[4].split(" ± ")[0])) < 0.005 and r[4].split(" ± ")[1].startswith("0.00") for r in rows)
    for name in ("MICA (alpha=0)", "MICA (alpha=0.4)", "MICA (alpha=1)", "GRPO", "REINFORCE++"):
        assert f"| {name} |" in md.split("### Learning with and without")[1], name


def test_rloo_is_the_forks_estimator_by_hand():
    assert "rloo" not in trainer.ADVANTAGES  # the playground's own, as the course's fork adds it to 04
    # docs/training.md's example: outcomes R = (1, 0); b_0 = 0, b_1 = 1; A = R_k - b_k on every turn
    assert credit.rloo_advantages([[[1.0, 0.0], [0.0]]]) == [[[1.0, 1.0], [-1.0]]]
    # K = 3: R = (3, 0, 1.5); b = (0.75, 2.25, 1.5); A = (2.25, -2.25, 0), not divided by a std
    rewards = [[[1.0, 2.0], [0.0, 0.0, 0.0], [1.5]], [[4.0], [2.0]]]
    A = credit.advantages({"kind": "rloo"}, rewards, 0.85)
    assert A == [[[2.25, 2.25], [-2.25, -2.25, -2.25], [0.0]], [[2.0], [-2.0]]]


def test_default_output_folder_is_under_the_current_folder():
    assert credit.parse_args([]).out == str(Path("runs") / "credit")
    assert credit.parse_args(["--table", "delayed"]).out == str(Path("runs") / "credit-delayed")


def test_choose_lr_and_the_edge_rule():
    # means 1.5, 1.5, 1.0: a tie between 0.1 and 1 goes to the smaller lr
    assert credit.choose_lr({1.0: [1.0, 2.0], 0.1: [1.5, 1.5], 10.0: [3.0, -1.0]}) == 0.1
    assert credit.choose_lr({1.0: [1.0, 2.0], 10.0: [3.0, 0.5]}) == 10.0
    grid = [0.1, 1.0, 10.0]
    assert credit.beyond_edge(grid, 1.0) is None
    assert math.isclose(credit.beyond_edge(grid, 10.0), 100.0)
    assert math.isclose(credit.beyond_edge(grid, 0.1), 0.01)
    assert [credit.lr_text(10 ** (i / 2)) for i in range(-2, 5)] == ["0.1", "0.316", "1", "3.16", "10", "31.6", "100"]
    default = credit.parse_args([])
    assert [credit.lr_text(x) for x in default.lr_grid] == ["0.1", "0.316", "1", "3.16", "10", "31.6", "100"]
    assert default.tune_seeds == [1000, 1001, 1002, 1003] and default.fresh_seeds == list(range(100, 124))


def test_tune_seeds_and_fresh_seeds_must_be_disjoint():
    with pytest.raises(SystemExit):
        credit.parse_args(["--tune", "--tune-seeds", "1-3", "--fresh-seeds", "3-5"])


def test_tune_chooses_on_tuning_seeds_and_training_scenarios_and_reports_on_fresh_seeds(tmp_path, monkeypatch):
    calls = []
    train_set, test = env.load_scenarios(credit.parse_args([]).train), env.load_scenarios(credit.parse_args([]).test)
    peak = {"MICA (alpha=0)": 0.0, "GRPO": 3.0, "RLOO": -3.0}  # log10 of each estimator's best lr when tuning

    def fake_train(estimator, seed, train_scenarios, scored_on, args, watch=None, curves=True):
        on_train = scored_on == train_set
        assert on_train or scored_on == test  # scored on the training scenarios or on the test ones, not a mix
        calls.append((estimator["name"], estimator["lr"], seed, on_train, curves))
        x = math.log10(estimator["lr"])
        # on the training scenarios the score peaks at 10^peak; on the test ones it would peak elsewhere (so a
        # choice made on them would differ)
        score = -((x - peak[estimator["name"]]) ** 2) if on_train else -((x + 5) ** 2)
        return {
            "estimator": estimator["name"],
            "seed": seed,
            "lr": estimator["lr"],
            "curve": [score, score],
            "final_return": score + 0.001 * (seed % 7),
            "final_success": 0.0,
        }

    monkeypatch.setattr(credit, "train", fake_train)
    credit.main(
        [
            *("--tune", "--estimators", "mica,grpo,rloo", "--alphas", "0", "--lr-grid", "0.1,1,10"),
            *("--tune-seeds", "1000-1002", "--fresh-seeds", "100-103", "--beam-width", "4", "--eval-k", "1"),
            *("--out", str(tmp_path)),
        ]
    )
    tuning = [c for c in calls if c[2] >= 1000]
    fresh = [c for c in calls if c[2] < 1000]
    assert len(tuning) + len(fresh) == len(calls)
    # tuning: the training scenarios, no curves, the tuning seeds only
    assert all(on_train and not curves for _, _, _, on_train, curves in tuning)
    assert {c[2] for c in tuning} == {1000, 1001, 1002}
    # the edge rule: GRPO's best (10, the top edge) -> 100, then 1000; RLOO's (0.1) -> 0.01, then 0.001
    assert sorted({c[1] for c in tuning if c[0] == "GRPO"}) == pytest.approx([0.1, 1, 10, 100, 1000])
    assert sorted({c[1] for c in tuning if c[0] == "RLOO"}) == pytest.approx([0.001, 0.01, 0.1, 1, 10])
    assert sorted({c[1] for c in tuning if c[0] == "MICA (alpha=0)"}) == [0.1, 1, 10]
    # reported: each estimator at its lr chosen while tuning, on the fresh seeds and the test scenarios
    chosen = {name: lr for name, lr, _, _, _ in fresh}
    assert chosen["MICA (alpha=0)"] == 1.0
    assert chosen["GRPO"] == pytest.approx(1000) and chosen["RLOO"] == pytest.approx(0.001)
    assert all(not on_train and curves for _, _, _, on_train, curves in fresh)
    assert sorted(c[2] for c in fresh if c[0] == "GRPO") == [100, 101, 102, 103]
    rows = [json.loads(line) for line in (tmp_path / "tuned.jsonl").read_text().splitlines()]
    assert {r["phase"] for r in rows} == {"tune", "fresh"}
    assert all((r["seed"] >= 1000) == (r["phase"] == "tune") for r in rows)
    md = (tmp_path / "tuned.md").read_text()
    assert "| GRPO | 1000 |" in md and "| RLOO | 0.001 |" in md  # the tuned table's lr column
    assert "1000 (the grid's high edge)" in md and "0.001 (the grid's low edge)" in md
    assert "| RLOO - GRPO |" in md and "over the 3 tuning seeds (1000, 1001, 1002)" in md
    assert "over 4 seeds (100-103)" in md


def test_quick_tune_runs_end_to_end(tmp_path):
    p = run_script(
        "experiments/credit.py",
        *("--tune", "--quick", "--table", "delayed", "--steps", 4, "--lr-grid", "1,10", "--extend-edges", 0),
        *("--tune-seeds", "1000-1001", "--fresh-seeds", "100-101", "--final-eval-k", 1, "--eval-k", 1),
        *("--beam-width", 4, "--out", tmp_path),
    )
    assert p.returncode == 0, p.stderr[-3000:]
    md = (tmp_path / "tuned.md").read_text()
    for row in ("| MICA (alpha=0) |", "| MICA (alpha=0.4) |", "| MICA (alpha=1) |", "| GRPO |", "| REINFORCE++ |"):
        assert md.count(row) == 2, row  # once in the tuning table, once in the tuned one
    assert "| RLOO |" in md and "| RLOO - GRPO |" in md and "| MICA (alpha=0) - MICA (alpha=1) |" in md
    assert "lr: each estimator's own, tuned" in md and (tmp_path / "tuned.png").stat().st_size > 0


# ---- issue 62: gradient quality, learning speed, the ladder's options, a fork's estimator ----
def test_t_quantile_is_students_t_at_the_actual_df():
    # scipy.stats.t.ppf(0.975, df) for df 1, 2, 4, 23 and 37 (a short table would give df 20's 2.086 and 30's 2.042)
    for df, t in ((1, 12.706205), (2, 4.302653), (4, 2.776445), (23, 2.068658), (37, 2.026192)):
        assert abs(credit.evaluation.t_quantile(0.975, df) - t) < 1e-5, df
    # a t interval over 4 units (3 df): mean 2.5, sd sqrt(5/3) = 1.29099, half-width t(0.975, 3) = 3.182446
    # x 1.29099 / 2 = 2.05428
    assert credit.t_cell([1.0, 2.0, 3.0, 4.0]) == "2.50 ± 1.29 [0.45, 4.55]"


def test_score_function_gradient_by_hand():
    from types import SimpleNamespace

    theta = [[0.0] * 7 for _ in range(credit.N_OBS)]  # uniform: pi(b | o) = 1/7
    d1 = SimpleNamespace(extra={"obs": [0, 1], "moves": ["validate", "clarify"], "rewards": [1.0, 2.0]})
    d2 = SimpleNamespace(extra={"obs": [0], "moves": ["reflect"], "rewards": [-1.0]})
    g = credit.score_function_gradient([d1, d2], theta)
    # G = (3, 2) and (-1); g[o][b] = (1/2) sum G_t (1[a_t = b] - 1/7)
    v, c, r = credit.MOVES.index("validate"), credit.MOVES.index("clarify"), credit.MOVES.index("reflect")
    assert math.isclose(g[0][v], 19 / 14)  # (3 (1 - 1/7) + (-1)(-1/7)) / 2
    assert math.isclose(g[0][r], -9 / 14)  # (3 (-1/7) + (-1)(1 - 1/7)) / 2
    assert math.isclose(g[0][c], -1 / 7)  # (3 (-1/7) + (-1)(-1/7)) / 2
    assert math.isclose(g[1][c], 6 / 7) and math.isclose(g[1][v], -1 / 7)  # 2 (1 - 1/7) / 2, 2 (-1/7) / 2
    assert all(x == 0.0 for row in g[2:] for x in row)
    # the return-to-go, not the whole return: turn 2's G is 2, not 3 (with 3: g[1][c] would be 9/7)


def test_quality_measures_by_hand():
    g_true = [1.0, 0.0]
    draws = [[2.0, 1.0], [2.0, -1.0], [0.0, 1.0], [0.0, -1.0]]
    m = credit.quality_measures(draws, g_true, blocks=2)
    assert m["cosine"] == pytest.approx([2 / math.sqrt(5)] * 2 + [0.0] * 2)
    # block 1: mean (2, 0), tr S = (1 + 1) / 1 = 2, SNR = (4 - 2/2) / 2 = 1.5, cos(mean, g*) = 1
    # block 2: mean (0, 0), tr S = 2, SNR = (0 - 1) / 2 = -0.5, cos 0 (a zero vector)
    assert m["snr"] == pytest.approx([1.5, -0.5]) and m["bias"] == pytest.approx([1.0, 0.0])
    assert m["bias_all"] == pytest.approx(1.0)  # the mean of all four, (1, 0)


def test_the_true_gradient_points_where_the_return_rises():
    # a finite difference of the Monte Carlo return agrees in sign with the score-function estimate on the
    # coordinate it names (uniform policy, delayed table; the opening question's logit at the first observation)
    args = credit.parse_args(["--table", "delayed", "--gq-true", "60"])
    train_set = env.load_scenarios(args.train)[:4]
    theta = [[0.0] * 7 for _ in range(credit.N_OBS)]
    g, noise = credit.true_gradient(theta, train_set, __import__("random").Random(1), args)
    assert len(g) == credit.N_OBS * 7 and 0 < noise < 1
    # each observation's row sums to 0 (the score of a softmax): sum_b (1[a = b] - pi(b)) = 0
    for o in range(credit.N_OBS):
        assert abs(sum(g[o * 7 : (o + 1) * 7])) < 1e-9


def test_normalised_auc_and_steps_to_the_fraction_by_hand():
    # y = (0, 0.5, 1): trapezoids 0.25 and 0.75, mean 0.5
    assert credit.normalised_auc([1.0, 3.0, 5.0], 1.0, 5.0) == pytest.approx(0.5)
    assert credit.normalised_auc([5.0, 5.0], 1.0, 5.0) == pytest.approx(1.0)
    assert credit.steps_to_frac([1.0, 3.0, 5.0], 1.0, 5.0, 0.9, 2) == 4
    assert credit.steps_to_frac([1.0, 3.0, 5.0], 1.0, 5.0, 0.5, 2) == 2
    assert credit.steps_to_frac([1.0, 3.0], 1.0, 5.0, 0.9, 2) is None


def test_the_ladders_options_noise_delay_and_length_rule():
    rng = __import__("random").Random(3)
    rewards = [[[1.0, 2.0], [0.5]]]
    assert credit.noisy_rewards(rewards, 0.0, rng) is rewards  # no noise: untouched, no random numbers drawn
    z = __import__("random").Random(3)
    expected = [[[1.0 + 0.5 * z.gauss(0, 1), 2.0 + 0.5 * z.gauss(0, 1)], [0.5 + 0.5 * z.gauss(0, 1)]]]
    assert credit.noisy_rewards(rewards, 0.5, rng) == expected
    # --delay 5: affirm's penalty lands 5 turns later, and the topic is "opened" for 4 turns after the question
    mem = credit.Memory(delay=5)
    P0 = [-6.0, -10.0, -8.0]
    assert credit.judge_delayed("affirm", mem, P0, P0)[1] == {5: {"A": 2, "P": 1}}
    mem.opened, mem.last = 1, ["clarify"] * 4  # the question at turn 1; turn 5 is judged next
    assert credit.topic(mem) == 1
    mem.last.append("reflect")
    assert credit.topic(mem) == 2
    # the length rule: a horizon of 3 ends a dialogue at turn 3 (EMPA's min-turns rule keeps it going till then)
    args = credit.parse_args(["--table", "delayed"])
    theta = [[0.0] * 7 for _ in range(credit.N_OBS)]
    tr = credit.rollout(theta, {"id": "x", "p0": P0}, __import__("random").Random(0), args, horizon=3)
    assert len(tr.extra["moves"]) == 3 and tr.outcome == "timeout"
    assert credit.parse_args(["--table", "delayed", "--delay", "8"]).delay == 8
    with pytest.raises(SystemExit):
        credit.parse_args(["--early-horizon", "16"])


FORK = '''
def rloo(rewards, dialogues, args):
    """A fork's RLOO, written apart from the playground's: A[k][t] = R_k - mean of the other outcomes."""
    assert dialogues is not None and len(dialogues[0]) == len(rewards[0]) and dialogues[0][0].states
    A = []
    for group in rewards:
        R = [sum(r) for r in group]
        A.append([[R[k] - (sum(R) - R[k]) / (len(R) - 1)] * len(group[k]) for k in range(len(R))])
    return A, {}
'''


def test_a_forks_estimator_joins_with_one_command_and_matches_the_built_in(tmp_path):
    (tmp_path / "fork_rloo.py").write_text(FORK)
    p = run_script(
        "experiments/credit.py",
        *("--quick", "--table", "delayed", "--seeds", 2, "--steps", 8, "--estimators", "rloo"),
        *("--advantage", "fork_rloo:rloo", "--out", tmp_path / "out", "--beam-width", 4),
        cwd=tmp_path,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    md = (tmp_path / "out" / "credit.md").read_text()
    rows = {line.split(" | ")[0]: line.split(" | ")[1:4] for line in md.splitlines() if line.startswith("| ")}
    assert rows["| fork_rloo:rloo"] == rows["| RLOO"]  # the same numbers as the playground's own RLOO
    # and in --gradient-quality: the same directions, so the same measures
    p = run_script(
        "experiments/credit.py",
        *("--gradient-quality", "--table", "delayed", "--estimators", "rloo", "--advantage", "fork_rloo:rloo"),
        *("--gq-draws", 4, "--gq-blocks", 2, "--gq-true", 2, "--out", tmp_path / "gq"),
        cwd=tmp_path,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    lines = (tmp_path / "gq" / "gradient.md").read_text().splitlines()
    ours = [line.split(" | ")[2:] for line in lines if "| RLOO |" in line]
    fork = [line.split(" | ")[2:] for line in lines if "| fork_rloo:rloo |" in line]
    assert len(ours) == 4 and ours == fork
    p = run_script("experiments/credit.py", "--advantage", "no_such_module:f", "--quick", cwd=tmp_path)
    assert p.returncode == 2 and "--advantage no_such_module:f: cannot import it" in p.stderr


def test_quick_speed_runs_end_to_end_with_the_power_check_before_the_fresh_seeds(tmp_path):
    p = run_script(
        "experiments/credit.py",
        *("--speed", "--quick", "--table", "delayed", "--steps", 4, "--extend-edges", 0, "--beam-width", 4),
        *("--judge-noise", 1, "--early-horizon", 8, "--out", tmp_path),
    )
    assert p.returncode == 0, p.stderr[-3000:]
    md = (tmp_path / "speed.md").read_text()
    for row in ("| MICA (alpha=0) |", "| MICA (alpha=1) |", "| GRPO |", "| REINFORCE++ |", "| RLOO |"):
        assert md.count(row) == 2, row  # the tuning table and the speed table
    assert md.index("Power check") < md.index("### Learning speed") and "t(0.975, 2) = 4.3027" in md
    assert "| MICA (alpha=1) - GRPO |" in md and "horizon drawn from 8-15" in md and "judge noise 1 sd" in md
    rows = [json.loads(line) for line in (tmp_path / "speed.jsonl").read_text().splitlines()]
    assert {r["seed"] for r in rows if r["phase"] == "tune"} == {2000, 2001}
    assert {r["seed"] for r in rows if r["phase"] == "fresh"} == {200, 201, 202}
    assert all(len(r["curve"]) == 3 for r in rows)  # steps 0, 2, 4
    assert (tmp_path / "speed.png").stat().st_size > 0
    default = credit.parse_args(["--speed"])
    assert (default.steps, default.eval_every, default.tune_seeds, default.fresh_seeds) == (
        50,
        2,
        [2000, 2001, 2002],
        list(range(200, 224)),
    )
    assert [credit.lr_text(x) for x in default.lr_grid] == ["1", "3.16", "10", "31.6", "100", "316"]
    # one fresh seed (a rerun of a committed rung and seed): the run goes through, with no interval to size
    p = run_script(
        "experiments/credit.py",
        *("--speed", "--quick", "--table", "delayed", "--steps", 2, "--extend-edges", 0, "--beam-width", 4),
        *("--fresh-seeds", "200", "--estimators", "grpo", "--out", tmp_path / "one"),
    )
    assert p.returncode == 0, p.stderr[-3000:]
    assert "Power check: one fresh seed, no interval" in (tmp_path / "one" / "speed.md").read_text()


# ---- issue 67 item 2: the stopping rung (--close, --turn-cost); docs/ladder/protocol-stop.md ----
def stop_args(**kw):
    return argparse.Namespace(
        **{"max_turns": 15, "min_turns": 4, "collapse_window": 5, "table": "delayed", "close": True, "turn_cost": 1.0}
        | kw
    )


def scripted(moves, args, P0):
    tr, mem = credit.new_episode({"id": "hand", "p0": P0})
    for move in moves:
        credit.step(tr, mem, move, args)
    return tr, mem, credit.turn_rewards(tr, args)


def test_the_close_move_ends_the_dialogue_and_the_return_is_computed_by_hand():
    P0 = [-9.0, -12.0, -10.0]
    d = env.hinge_distance  # d(P) = sqrt(sum max(0, -1 - P_a)^2)
    args = stop_args()
    # affirm (C1 A2 now: v = (1, 3, 0); -A2 -P1 due at turn 4), validate (A2: (0, 3, 0)), close at turn 3
    tr, mem, r = scripted(["affirm", "validate", "close"], args, P0)
    assert tr.outcome == "closed" and tr.extra["moves"] == ["affirm", "validate", "close"] and credit.talked(tr) == 2
    assert tr.states == [P0, [-8.0, -9.0, -10.0], [-8.0, -6.0, -10.0], [-8.0, -6.0, -10.0]]  # the close moves nothing
    assert mem.due == {4: {"A": 2, "P": 1}}  # due after the close: it never lands
    # d(P0) = sqrt(8^2 + 11^2 + 9^2) = sqrt(266); d(P1) = sqrt(7^2 + 8^2 + 9^2) = sqrt(194); d(P2) = sqrt(155)
    assert r == pytest.approx([math.sqrt(266) - math.sqrt(194) - 1, math.sqrt(194) - math.sqrt(155) - 1, 0.0])
    assert sum(r) == pytest.approx(math.sqrt(266) - math.sqrt(155) - 2)  # d(P0) - d(P_T) - c x 2 turns talked
    # a turn later: reflect at turn 3 (topic closed: C1 A1), close at turn 4, before the penalty due then lands
    tr, _, r = scripted(["affirm", "validate", "reflect", "close"], args, P0)
    assert sum(r) == pytest.approx(math.sqrt(266) - d([-7, -5, -10]) - 3) and d([-7, -5, -10]) == math.sqrt(133)
    # talking on instead: validate at turn 4 gets A2 (+3) and the due -A2 (-5) on A, -P1 (-2) on P
    tr, _, r = scripted(["affirm", "validate", "reflect", "validate"], args, P0)
    assert tr.outcome is None and tr.vs[3] == [0.0, -2.0, -2.0]
    assert sum(r) == pytest.approx(math.sqrt(266) - d([-7, -7, -12]) - 4)
    # stopping earlier or later changes the return: closing at turn 1 returns 0 exactly
    assert scripted(["close"], args, P0)[2] == [0.0]
    # the policy's eighth logit is close; the rollout's rewards are turn_rewards'
    theta = credit.initial_theta(args)
    assert len(theta) == credit.N_OBS and len(theta[0]) == 8 and credit.ALL_MOVES[7] == "close"
    theta = [[0.0] * 7 + [50.0] for _ in range(credit.N_OBS)]  # always close
    tr = credit.rollout(theta, {"id": "hand", "p0": P0}, __import__("random").Random(0), args)
    assert tr.extra["moves"] == ["close"] and tr.extra["rewards"] == [0.0] and tr.outcome == "closed"


def test_under_close_success_does_not_end_the_dialogue_and_is_still_recorded():
    # P0 (-3, -4, 0): ||P0|| = 5, v* = (0.6, 0.8, 0); validate, validate (dE 2.4 each), reflect (C1; A is past 0:
    # dE 0.6): E_total 5.4 >= 5 at turn 3
    P0, moves = [-3.0, -4.0, 0.0], ["validate", "validate", "reflect"]
    tr, _, _ = scripted(moves, stop_args(min_turns=1, close=False, turn_cost=0.0), P0)
    assert tr.outcome == "success"
    args = stop_args(min_turns=1)
    tr, mem, _ = scripted(moves, args, P0)
    assert tr.outcome is None and tr.extra["end"] == (3, "success")  # the policy decides when to stop
    credit.step(tr, mem, "close", args)
    assert tr.outcome == "closed" and credit.succeeded(tr, args)
    # a branch of the search keeps the record
    child, _ = credit.branch(scripted(moves, args, P0)[0], mem, "validate", args)
    assert child.extra["end"] == (3, "success")


def test_the_optimum_stops_inside_the_horizon_by_hand():
    # one axis of deficit, C at -5 (d(P0) = 4; A and P at 0, past their hinge), a cost of 1 a turn, 6 turns at most.
    # Reflect (C1; A past 0 gets nothing) four times reaches d 0: 4 - 4 = 0. The question first: clarify with the
    # topic closed costs -A1 (A to -2: d sqrt(17)) but opens it; clarify again is C2 (C to -2, d sqrt(2)); reflect
    # (C1 A1: C and A to -1) reaches d 0 after 3 turns talked: 4 - 0 - 3 = 1, the best (d cannot go below 0, and no
    # 2 turns gain 4). It closes at turn 4 of 6: inside the horizon; every turn after it would cost 1 and gain 0.
    args = credit.parse_args(["--table", "delayed", "--close", "--turn-cost", "1", "--beam-width", "16"])
    args.max_turns = 6
    scenario = {"id": "hand", "p0": [-5.0, 0.0, 0.0]}
    tr, _, r = scripted(["clarify", "clarify", "reflect", "close"], args, scenario["p0"])
    assert tr.states[1:4] == [[-5.0, -2.0, 0.0], [-2.0, -2.0, 0.0], [-1.0, -1.0, 0.0]] and sum(r) == pytest.approx(1.0)
    assert credit.search_best(scenario, args) == (pytest.approx(1.0), False, (3, 3))
    assert credit.search_ceiling(scenario, args) == (pytest.approx(1.0), False)


def test_the_stopping_rung_leaves_the_other_rungs_as_they_were():
    default = credit.parse_args(["--table", "delayed", "--speed"])
    assert not default.close and default.turn_cost == 0.0 and not default.protocol_67
    assert credit.moves(default) == credit.MOVES and len(credit.initial_theta(default)[0]) == 7
    default.noise_sd = 0.0
    assert credit.rung_text(default) == (
        "table delayed, delay 3, judge noise 0 sd of the per-turn reward (0.000 in reward units), K=4, EMPA ends "
        "only, 4 training scenarios a step, gamma 0.85"
    )
    fork = [{"name": "f:g", "kind": "import"}]
    assert credit.speed_comparisons(fork, default) == [*credit.SPEED_COMPARISONS, ("f:g", "GRPO")]
    stop = credit.parse_args(["--table", "delayed", "--speed", "--close", "--turn-cost", "1"])
    assert stop.protocol_67 and credit.speed_comparisons(fork, stop)[-2:] == [
        ("MICA (alpha=1)", "REINFORCE++"),
        ("f:g", "MICA (alpha=1)"),
    ]
    stop.noise_sd = 0.0
    assert "the policy closes (EMPA's success does not end a dialogue" in credit.rung_text(stop)
    assert "turn cost 1," in credit.rung_text(stop)
    # a rollout without the flags is the one every earlier version drew (no close logit, IDR rewards as 03 gives them)
    args = argparse.Namespace(max_turns=15, min_turns=4, collapse_window=5, table="delayed")
    theta = [[0.0] * 7 for _ in range(credit.N_OBS)]
    tr = credit.rollout(theta, {"id": "x", "p0": [-9.0, -12.0, -10.0]}, __import__("random").Random(5), args)
    assert "close" not in tr.extra["moves"] and tr.extra["rewards"] == env.incremental_distance_rewards(tr.states)
    with pytest.raises(SystemExit):
        credit.parse_args(["--turn-cost", "-1"])


def test_jackknife_bias_and_close_share_by_hand():
    # two moves (close the second), one observation's worth of logits used: N_OBS rows, only row 0 non-zero
    def vec(a, b):
        v = [0.0] * (credit.N_OBS * 2)
        v[0], v[1] = a, b
        return v

    g_true = vec(1.0, 0.0)
    assert credit.close_share(vec(0.0, 2.0), 2) == 1.0 and credit.close_share(vec(3.0, -4.0), 2) == -0.8
    draws = [vec(2.0, 1.0), vec(2.0, -1.0), vec(0.0, 1.0), vec(0.0, 1.0)]  # 2 blocks of 2
    jk = credit.jackknife_measures(draws, g_true, 2, n_moves=2)
    # all: mean (1, 0.5): cosine 1 / sqrt(1.25); without block 1: (0, 1), cosine 0; without block 2: (2, 0), 1
    c_all = 1 / math.sqrt(1.25)
    assert jk["bias_all"] == pytest.approx(c_all)
    assert jk["bias_all_jk"] == pytest.approx([2 * c_all - 0.0, 2 * c_all - 1.0])
    # close share: all 0.5 / sqrt(1.25); without block 1: 1; without block 2: 0; the true gradient's: 0
    s_all = 0.5 / math.sqrt(1.25)
    assert jk["close_true"] == 0.0 and jk["close_all"] == pytest.approx(s_all)
    assert jk["close_gap_jk"] == pytest.approx([2 * s_all - 1.0, 2 * s_all - 0.0])


def test_speed_with_close_prints_where_the_policies_stop_against_the_optimum(tmp_path, monkeypatch):
    """The reporting of the stopping rung, with train faked (no estimator runs on the rung here): the stop table,
    its comparisons and the optimum's turns, from the rows' final_turns."""

    def fake_train(estimator, seed, train_scenarios, scored_on, args, watch=None, curves=True):
        turns = {"GRPO": 10.0, "MICA (alpha=1)": 12.0}[estimator["name"]] + 0.1 * (seed % 3)
        return {
            "estimator": estimator["name"],
            "seed": seed,
            "lr": estimator["lr"],
            "curve": [0.0, 1.0],
            "final_return": 1.0,
            "final_success": 0.0,
            "final_turns": turns,
            "final_closed": 0.5,
        }

    monkeypatch.setattr(credit, "train", fake_train)
    monkeypatch.setattr(credit, "search_best", lambda s, args: (5.0, False, (9, 11)))
    credit.main(
        [
            *("--speed", "--close", "--turn-cost", "1", "--table", "delayed", "--estimators", "mica,grpo"),
            *("--alphas", "1", "--lr-grid", "1,10", "--extend-edges", "0", "--tune-seeds", "3000-3001"),
            *("--fresh-seeds", "300-302", "--steps", "2", "--out", str(tmp_path)),
        ]
    )
    md = (tmp_path / "speed.md").read_text()
    assert "### Where the policies stop" in md and "stops after 9.00 turns talked on average" in md
    assert "| GRPO | 10.10 ± 0.10 [9.85, 10.35] | 0.50 ± 0.00 [0.50, 0.50] | 1.10 ± 0.10 [0.85, 1.35] |" in md
    assert "| MICA (alpha=1) - GRPO | 2.00 ± 0.00 [2.00, 2.00] | 3/3 |" in md
    assert "per test scenario 9-11, 9-11" in md


def test_gradient_quality_with_close_prints_the_bias_table(tmp_path, monkeypatch):
    """The plumbing of the stopping rung's bias table, with no estimator measured: the snapshots are the uniform
    policy, the true gradient a fixed vector, and every estimator's advantages 1 on every turn."""

    def fake_train(estimator, seed, train_scenarios, scored_on, args, watch=None, curves=True, snapshots=None):
        for step_i in snapshots:
            snapshots[step_i] = credit.initial_theta(args)

    g_true = [0.0] * (credit.N_OBS * 8)
    g_true[7], g_true[0] = 1.0, -1.0  # observation 0: toward close, away from validate
    monkeypatch.setattr(credit, "train", fake_train)
    monkeypatch.setattr(credit, "true_gradient", lambda theta, train_set, rng, args: (g_true, 0.1))
    monkeypatch.setattr(
        credit, "advantages", lambda e, rewards, gamma, groups: [[[1.0] * len(r) for r in g] for g in rewards]
    )
    credit.main(
        [
            *("--gradient-quality", "--close", "--turn-cost", "1", "--table", "delayed", "--estimators", "grpo"),
            *("--gq-draws", "4", "--gq-blocks", "2", "--out", str(tmp_path)),
        ]
    )
    md = (tmp_path / "gradient.md").read_text()
    assert "| close share, true gradient | close share, mean of all draws | close share: mean - true, jackknife |" in md
    rows = [line for line in md.splitlines() if line.startswith("| uniform | GRPO | ") and line.count(" | ") == 6]
    assert len(rows) == 1 and rows[0].split(" | ")[4] == f"{1 / math.sqrt(2):+.3f}"  # the true gradient's share
    assert "RFC #7244's hidden bonus" in md and "turn cost 1" in md

"""The course (docs/course.md): scripts/worked_example.py's table pinned to the last digit and its numbers checked by
hand; scripts/exercise.py's exercises, each check failing on its blank and passing on the real code."""

import importlib.util
import math
import subprocess
import sys

import pytest

import common
from conftest import ROOT, run_script

# python scripts/worked_example.py, to the last digit (docs/course.md shows the same)
WORKED_EXAMPLE = """\
04_mica_train.py --preset cpu, K = 4 dialogues of one scenario: --reward idr, gamma 0.85, --cut-off-penalty 0.5
(0.866 off a cut-off reply), --max-new-tokens 48, --min-turns 2, --max-turns 3
scenario: P0 = (-4, -6, -2) from EMPA's items C1 1, C2 1, A1 1, A2 1, P1 1; ||P0|| = 7.483, d(P0) = 5.916
columns: v_t the judge's progress vector, d(P_t) the hinge distance after the turn, r_t the training reward,
G_t the return, A_turn and A_group MICA's two terms, A(alpha) MICA's advantage, GRPO's and REINFORCE++'s
(RF++) advantage, and how many of the reply's tokens the loss counts

dialogue k = 0, steady progress: timeout after 3 turns
P_t: (-4, -6, -2) -> (-3, -3, -2) -> (-2, -2, -1) -> (1, -1, -1)
 t          v_t d(P_t)    r_t    G_t A_turn A_group   A(0) A(0.4)   A(1)   GRPO   RF++  tokens scored
 1    (1, 3, 0)  3.000 +2.916 +5.286 +0.782  +1.057 +1.057 +0.947 +0.782 +0.705 +1.448  12 of 12
 2    (1, 1, 1)  1.414 +1.586 +2.788 +1.004  +0.249 +0.249 +0.551 +1.004 +0.705 +0.403  15 of 15
 3    (3, 1, 0)  0.000 +1.414 +1.414 +0.728  +0.145 +0.145 +0.378 +0.728 +0.705 -0.172  10 of 10

dialogue k = 1, large progress on every axis: success after 2 turns
P_t: (-4, -6, -2) -> (-1, -3, 1) -> (2, 0, 4)
 t          v_t d(P_t)    r_t    G_t A_turn A_group   A(0) A(0.4)   A(1)   GRPO   RF++  tokens scored
 1    (3, 3, 3)  2.000 +3.916 +5.616 +0.891  +1.664 +1.664 +1.355 +0.891 +0.705 +1.586  20 of 20
 2    (3, 3, 3)  0.000 +2.000 +2.000 +0.205  +0.501 +0.501 +0.382 +0.205 +0.705 +0.073  18 of 18

dialogue k = 2, the judge fails on turn 2: timeout after 3 turns
P_t: (-4, -6, -2) -> (-4, -5, -2) -> (-4, -5, -2) -> (-3, -4, -2)
 t          v_t d(P_t)    r_t    G_t A_turn A_group   A(0) A(0.4)   A(1)   GRPO   RF++  tokens scored
 1    (0, 1, 0)  5.099 +0.817 +2.722 -0.065  -0.218 -0.218 -0.157 -0.065 +0.007 +0.375  9 of 9
 2 judge failed  5.099 +1.087 +2.241 +0.449  -0.054 -0.054 +0.147 +0.449 +0.007 +0.174  0 of 11 (judge failed)
 3    (1, 1, 0)  3.742 +1.357 +1.357 +0.687  +0.110 +0.110 +0.341 +0.687 +0.007 -0.196  14 of 14

dialogue k = 3, reply 1 runs to the token cap: timeout after 3 turns
P_t: (-4, -6, -2) -> (-6, -6, -2) -> (-5, -5, -1) -> (-5, -7, -1)
 t          v_t d(P_t)    r_t    G_t A_turn A_group   A(0) A(0.4)   A(1)   GRPO   RF++  tokens scored
 1   (-2, 0, 0)  7.141 -2.091 -1.952 -1.609  -1.984 -1.984 -1.834 -1.609 -1.417 -1.581  48 of 48 (cut off)
 2    (1, 1, 1)  5.657 +1.485 +0.163 -1.658  +0.188 +0.188 -0.551 -1.658 -1.417 -0.695  16 of 16
 3   (0, -2, 0)  7.211 -1.554 -1.554 -1.414  -1.658 -1.658 -1.560 -1.414 -1.417 -1.414  13 of 13

- k = 1 ended at turn 2 (success: E_total 9.621 >= ||P0|| 7.483), so A_turn at turn 3 compares only the 3 dialogues
  that reached it (k = 0, 2, 3: G_3 = 1.414, 1.357, -1.554; mean 0.406, population std 1.386); A_group pools all 11
  rewards of the group.
- k = 2, turn 2: the judge failed (v None, the state stays), so r_2 is the mean of the dialogue's valid rewards,
  (0.817 + 1.357) / 2 = 1.087; it counts in G and in the group's statistics, but its 11 tokens are out of the loss
  (A None in the Sample, 0 in the mask).
- k = 3, turn 1: the reply hit the cap (48 tokens, cut off), so r_1 = IDR -1.225 - 0.866 (--cut-off-penalty 0.5 x
  sqrt(3), the IDR of a turn gaining one point on every axis) = -2.091; its tokens are scored.
- alpha 1 gives A = A_turn, alpha 0 gives A = A_group; GRPO gives each dialogue one A on every turn, from its summed
  reward; REINFORCE++ whitens G over the batch (here this group's 11 turns) with no groups.
"""


def test_worked_example_prints_the_pinned_table():
    p = run_script("scripts/worked_example.py", timeout=300)
    assert p.returncode == 0, p.stderr
    assert p.stdout == WORKED_EXAMPLE


def load(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_worked_example_numbers_by_hand():
    x = load("worked_example").worked_example()
    trajs, r, G, failed = x["trajs"], x["rewards"], x["G"], x["failed"]
    # the dialogue of large steps ends at turn 2: E_total = 2 * 36 / ||P0|| >= ||P0|| = sqrt(56); it has no turn 3
    assert [tr.T for tr in trajs] == [3, 2, 3, 3] and [tr.outcome for tr in trajs][:2] == ["timeout", "success"]
    assert len(r[1]) == len(G[1]) == len(x["A_turn"][1]) == 2
    # IDR by hand: d(P0) = sqrt(9 + 25 + 1), d(P1) of k = 0 = sqrt(4 + 4 + 1) = 3
    assert r[0][0] == pytest.approx(math.sqrt(35) - 3)
    # the cut-off reply: IDR d(P0) - d((-6, -6, -2)) = sqrt(35) - sqrt(51), less 0.5 sqrt(3)
    assert trajs[3].cut_off == [True, False, False]
    assert r[3][0] == pytest.approx(math.sqrt(35) - math.sqrt(51) - 0.5 * math.sqrt(3))
    # the failed turn: the state stays, its reward is the mean of the dialogue's other rewards
    assert failed[2] == [False, True, False] and trajs[2].states[2] == trajs[2].states[1]
    assert r[2][1] == pytest.approx((r[2][0] + r[2][2]) / 2)
    # G_t = r_t + 0.85 G_{t+1}
    assert G[3] == pytest.approx([r[3][0] + 0.85 * (r[3][1] + 0.85 * r[3][2]), r[3][1] + 0.85 * r[3][2], r[3][2]])
    # A_turn at turn 3 compares k = 0, 2, 3 only (population std); at turn 1 all four
    for t, reached in ((2, [0, 2, 3]), (0, [0, 1, 2, 3])):
        mean, std = common.mean_std([G[k][t] for k in reached], ddof=0)
        assert [x["A_turn"][k][t] for k in reached] == pytest.approx(
            [(G[k][t] - mean) / std for k in reached], abs=1e-5
        )
    # A_group over all 11 rewards; alpha 1 gives A_turn, alpha 0 A_group, 0.4 the mix
    flat = [v for rk in r for v in rk]
    mean, std = common.mean_std(flat, ddof=0)
    assert x["A_group"][3][2] == pytest.approx((r[3][2] - mean) / std, abs=1e-5)
    assert x["mica"][1.0] == x["A_turn"] and x["mica"][0.0] == x["A_group"]
    for k in range(4):
        mix = [0.4 * a + 0.6 * b for a, b in zip(x["A_turn"][k], x["A_group"][k])]
        assert x["mica"][0.4][k] == pytest.approx(mix)
    # GRPO: one A per dialogue from its summed reward (sample std); REINFORCE++: G whitened over all 11 turns
    R = [sum(rk) for rk in r]
    mean, std = common.mean_std(R, ddof=1)
    for k in range(4):
        assert x["grpo"][k] == pytest.approx([(R[k] - mean) / std] * trajs[k].T, abs=1e-5)
    mean, std = common.mean_std([g for Gk in G for g in Gk], ddof=1)
    assert x["reinforce_pp"][0] == pytest.approx([(g - mean) / std for g in G[0]], abs=1e-5)
    # the loss counts every token of every reply but the failed turn's 11
    assert x["scored"][2] == [9, 0, 14] and x["scored"][3] == [48, 16, 13]
    assert sum(map(sum, x["scored"])) == sum(s.n_tokens() for s in x["samples"]) == 12 + 15 + 10 + 20 + 18 + 9 + 14 + 77


# ---------------------------------------------------------------------------------------------
# scripts/exercise.py
# ---------------------------------------------------------------------------------------------
def exercise(*args, cwd=None):
    return subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "exercise.py"), *map(str, args)],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=600,
    )


def checked(stdout) -> dict[int, list[tuple[str, str]]]:
    """check's output -> {exercise: [(PASS or FAIL, the rest of the line)]}."""
    out, n = {}, None
    for line in stdout.splitlines():
        if line.startswith("exercise ") and not line.endswith("pass"):
            n = int(line.split()[1].rstrip(":"))
            out[n] = []
        elif line.startswith(("PASS ", "FAIL ")):
            out[n].append((line[:4], line[5:]))
    return out


def test_exercise_list_make_and_check_refuse_bad_input_with_one_line(tmp_path):
    p = exercise("list")
    assert p.returncode == 0
    listed = [line.split()[1] for line in p.stdout.splitlines() if line[:5].strip().rstrip(".").isdigit()]
    # the fourteen, at least: the hinge distance, IDR, the end rules, G_t, the three terms of MICA, GRPO,
    # REINFORCE++, the clipped surrogate, k3 KL, the token mask, CARE's S(y), the paired t interval
    for name in (
        "hinge_distance incremental_distance_rewards episode_status discounted_returns turn_level_advantages "
        "group_level_advantages mica_advantages grpo_advantages reinforce_pp_advantages clipped_surrogate k3_kl "
        "Sample.scored rubric_score t_interval"
    ).split():
        assert name in listed, name
    assert len(listed) >= 14 and "tests/test_env.py::test_hinge_distance" in p.stdout
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    for args, message in [
        (("make", tmp_path / "full", 3), f"error: {tmp_path / 'full'} is not an empty folder"),
        (("make", tmp_path / "new", 3, 99), "error: no exercise 99: they are 1-"),
        (("check", 0), "error: no exercise 0: they are 1-"),
        (("check", 3, "--dir", tmp_path / "full"), "error: --dir"),
        (("check", "three"), "error: argument numbers: invalid int value"),
    ]:
        p = exercise(*args)
        assert p.returncode == 2 and p.stdout == "" and p.stderr.startswith(message), (args, p.stderr)
        assert len(p.stderr.strip().splitlines()) == 1
    assert sorted(x.name for x in (tmp_path / "full").iterdir()) == ["x"] and not (tmp_path / "new").exists()


@pytest.mark.skipif(not (ROOT / ".git").exists(), reason="make copies the tracked files: needs a git checkout")
def test_every_exercise_fails_on_its_blank_and_passes_on_the_real_code(tmp_path):
    table = load("exercise").EXERCISES
    numbers = [e.number for e in table]
    # the real code: every check passes (one pytest run), every node id named runs
    p = exercise("check", *numbers)
    assert p.returncode == 0, p.stdout + p.stderr
    real = checked(p.stdout)
    for e in table:
        assert len(real[e.number]) >= len(e.tests) and all(s == "PASS" for s, _ in real[e.number]), real[e.number]
    # a copy with every exercise blanked: it imports, and every check fails
    p = exercise("make", tmp_path / "all")
    assert p.returncode == 0, p.stderr
    stages = "01_rubric_sft", "02_rubric_pref_rl", "03_rollout", "04_mica_train", "05_eval"
    imports = f"import importlib; [importlib.import_module(m) for m in {stages!r}]"
    p = subprocess.run([sys.executable, "-c", imports], cwd=tmp_path / "all", capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    p = exercise("check", *numbers, "--dir", tmp_path / "all")
    assert p.returncode == 1
    blanked = checked(p.stdout)
    # each test fails, and where it failed on its own exercise's blank the message says so; a test that reached
    # another blank first (the clipped surrogate's test of k3 KL) is run again on a copy with that exercise alone
    # blanked
    alone = set()
    for e in table:
        assert len(blanked[e.number]) == len(real[e.number]) and all(s == "FAIL" for s, _ in blanked[e.number])
        if not all(f"NotImplementedError: exercise {e.number}: {e.function}" in why for _, why in blanked[e.number]):
            alone.add(e.number)
    assert len(alone) <= 3, alone  # each costs a pytest run: keep the tests of an exercise on its own function
    for n in sorted(alone):
        assert exercise("make", tmp_path / f"only{n}", n).returncode == 0
        p = exercise("check", n, "--dir", tmp_path / f"only{n}")
        assert p.returncode == 1
        for status, why in checked(p.stdout)[n]:
            assert status == "FAIL" and f"NotImplementedError: exercise {n}: " in why, why

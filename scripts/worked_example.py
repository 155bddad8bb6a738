"""scripts/worked_example.py: one scenario group of K = 4 dialogues through 04's reward, estimators and token
mask, printed turn by turn (docs/course.md, "The worked example: one scenario group in numbers").

What it does
  Builds four dialogues of one scenario by hand, as 03's rollout would leave them, without a model: the
  judge's levels per turn go through 03's levels_to_v / advance_state (P_t = P_{t-1} + v_t, dE_t), 03's
  episode_status ends a dialogue, the replies are made-up token ids of chosen lengths. One dialogue ends at
  turn 2 (success), one turn's judge failed (v None), one reply hit the token cap (cut off). Then every number
  is 04's own: reward_parts / turn_rewards (--reward idr, the cut-off penalty, a failed turn's filling),
  discounted_returns (G_t), the registered estimators ADVANTAGES["mica"] at alpha 0, 0.4 and 1 (with its
  terms A_turn and A_group), ADVANTAGES["grpo"] and ADVANTAGES["reinforce_pp"], and as_samples / collate's
  loss mask (which reply tokens the loss counts). Prints one table per dialogue and a note per special case,
  to 3 decimals. No model is loaded; it runs offline in seconds.

Reads   nothing (04's defaults under --preset cpu: --reward idr, gamma 0.85, --cut-off-penalty 0.5,
        --max-new-tokens 48, --min-turns 2, --max-turns 3)
Writes  the tables, to stdout (tests/test_course.py pins them to the last digit)

Usage: python scripts/worked_example.py
"""

from __future__ import annotations

import argparse
import importlib
import itertools
import sys
import textwrap
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common  # noqa: E402

env = importlib.import_module("03_rollout")  # the environment: the state, the distance, the end rules
trainer = importlib.import_module("04_mica_train")  # the rewards, the estimators, the token mask

ALPHAS = (0.0, 0.4, 1.0)
# EMPA's nine initial-deficit items of the scenario: P0 = (-4, -6, -2)
ITEMS = dict(C1=1, C2=1, C3=0, A1=1, A2=1, A3=0, P1=1, P2=0, P3=0)
OPENING_TOKENS, USER_TOKENS = 30, 10  # made-up lengths of the opening prompt and of each user message


def levels(C, A, P):
    """The judge's verdict: (progress level, negative level) per axis, as 03's judges return it."""
    return {"levels": {"C": C, "A": A, "P": P}, "features": {}}


# the K = 4 dialogues: per turn the judge's verdict (None: the judge failed) and the reply's length in tokens
# (48 = --max-new-tokens with no end-of-turn token: cut off). A dialogue stops where episode_status ends it.
PLANS = [
    (
        "steady progress",
        [
            (levels((1, 0), (2, 0), (0, 0)), 12),
            (levels((1, 0), (1, 0), (1, 0)), 15),
            (levels((2, 0), (1, 0), (0, 0)), 10),
        ],
    ),
    (
        "large progress on every axis",
        [
            (levels((2, 0), (2, 0), (2, 0)), 20),
            (levels((2, 0), (2, 0), (2, 0)), 18),
            (levels((1, 0), (1, 0), (1, 0)), 12),
        ],
    ),
    (
        "the judge fails on turn 2",
        [(levels((0, 0), (1, 0), (0, 0)), 9), (None, 11), (levels((1, 0), (1, 0), (0, 0)), 14)],
    ),
    (
        "reply 1 runs to the token cap",
        [
            (levels((0, 1), (0, 0), (0, 0)), 48),
            (levels((1, 0), (1, 0), (1, 0)), 16),
            (levels((0, 0), (0, 1), (0, 0)), 13),
        ],
    ),
]


def train_args(**over) -> argparse.Namespace:
    """04's flags at the cpu preset's defaults (the same on a GPU machine), `over` set."""
    args = trainer.parse_args(["--preset", "cpu"])
    return argparse.Namespace(**{**vars(args), **over})


def play(scenario: dict, k: int, plan, args):
    """One dialogue as 03's rollout builds it, the judge's verdicts and the reply lengths given: the reply's
    span and ids, its cut-off flag, the state through advance_state, the end through episode_status."""
    token = itertools.count(1000 * (k + 1))  # made-up token ids
    tr = env.Trajectory(
        scenario=scenario,
        k=k,
        ids=[next(token) for _ in range(OPENING_TOKENS)],
        messages=[{"role": "user", "content": scenario["opening"]}],
        states=[list(scenario["p0"])],
        emotions=[args.emotion_start],
    )
    for t, (verdict, n) in enumerate(plan[: args.max_turns], start=1):
        tr.spans.append((len(tr.ids), len(tr.ids) + n))
        tr.ids.extend(next(token) for _ in range(n))
        tr.cut_off.append(n >= args.max_new_tokens)  # no end-of-turn token within the cap
        tr.messages.append({"role": "assistant", "content": f"reply {t}"})
        env.advance_state(tr, verdict)
        tr.outcome = env.episode_status(tr.scenario["p0"], tr.dEs, tr.states, t, args)
        if tr.outcome is None and t == args.max_turns:
            tr.outcome = "timeout"
        if tr.outcome is not None:
            break
        tr.ids.extend(next(token) for _ in range(USER_TOKENS))
        tr.messages.append({"role": "user", "content": f"user {t + 1}"})
    return tr


def worked_example() -> dict:
    """Every number of the tables, each from the project's own function."""
    args = train_args()
    p0 = env.initial_deficit(ITEMS)
    scenario = {"id": "worked-example", "persona": "-", "situation": "-", "opening": "-", "p0": p0}
    trajs = [play(scenario, k, plan, args) for k, (_, plan) in enumerate(PLANS)]
    # 04's step 2: each --reward part by name, then per dialogue the weighted sum, the cut-off penalty and a
    # failed turn's filling
    parts, _ = trainer.reward_parts(trajs, args, None)
    rewards, failed = (list(x) for x in zip(*[trainer.turn_rewards(p, tr, args) for p, tr in zip(parts, trajs)]))
    G = [trainer.discounted_returns(r, args.gamma) for r in rewards]
    # 04's step 3: the registered estimators on the one scenario group, rewards[s][k][t] with s = 0
    mica = {}
    for alpha in ALPHAS:
        A, terms = trainer.ADVANTAGES["mica"]([rewards], None, train_args(alpha=alpha))
        mica[alpha] = (A[0], terms["A_turn"][0], terms["A_group"][0])
    grpo = trainer.ADVANTAGES["grpo"]([rewards], None, args)[0][0]
    reinforce_pp = trainer.ADVANTAGES["reinforce_pp"]([rewards], None, args)[0][0]
    # 04's step 4: the update's samples (A None on a failed turn) and collate's loss mask
    samples = trainer.as_samples(trajs, mica[args.alpha][0], failed)
    _, _, mask = trainer.collate(samples, 0, "cpu")
    scored = [[int(mask[k, s:e].sum()) for s, e in tr.spans] for k, tr in enumerate(trajs)]
    return dict(
        args=args,
        p0=p0,
        trajs=trajs,
        parts=parts,
        rewards=rewards,
        failed=failed,
        G=G,
        A_turn=mica[1.0][1],
        A_group=mica[1.0][2],
        mica={alpha: A for alpha, (A, _, _) in mica.items()},
        grpo=grpo,
        reinforce_pp=reinforce_pp,
        penalty=trainer.cut_off_penalty(args),
        samples=samples,
        scored=scored,
    )


def f3(x: float) -> str:
    """3 decimals, signed, with no -0.000 (the tables)."""
    return f"{round(x, 3) + 0.0:+.3f}"


def g3(x: float) -> str:
    """3 decimals, with no -0.000 (the notes)."""
    return f"{round(x, 3) + 0.0:.3f}"


def vec(xs) -> str:
    return "(" + ", ".join(f"{x:g}" for x in xs) + ")"


COLUMNS = ("t", "v_t", "d(P_t)", "r_t", "G_t", "A_turn", "A_group", "A(0)", "A(0.4)", "A(1)", "GRPO", "RF++")
WIDTHS = (2, 12, 6, 6, 6, 6, 7, 6, 6, 6, 6, 6)


def row(cells) -> str:
    return " ".join(c.rjust(w) for c, w in zip(cells, WIDTHS))


def table(x: dict, k: int, why: str) -> list[str]:
    tr, args = x["trajs"][k], x["args"]
    d = [env.hinge_distance(P, args.idr_weights, env.EPS) for P in tr.states]
    lines = [
        f"dialogue k = {k}, {why}: {tr.outcome} after {tr.T} turns",
        "P_t: " + " -> ".join(vec(P) for P in tr.states),
        row(COLUMNS) + "  tokens scored",
    ]
    for t in range(tr.T):
        v = "judge failed" if tr.vs[t] is None else vec(tr.vs[t])
        s, e = tr.spans[t]
        note = " (judge failed)" if x["failed"][k][t] else " (cut off)" if tr.cut_off[t] else ""
        columns = (x["rewards"], x["G"], x["A_turn"], x["A_group"], *x["mica"].values(), x["grpo"], x["reinforce_pp"])
        cells = [str(t + 1), v, f"{d[t + 1]:.3f}"] + [f3(col[k][t]) for col in columns]
        lines.append(row(cells) + f"  {x['scored'][k][t]} of {e - s}{note}")
    return lines


def notes(x: dict) -> list[str]:
    """One line per special case, its numbers from the same functions."""
    args, trajs, r = x["args"], x["trajs"], x["rewards"]
    out = []
    for k, tr in enumerate(trajs):
        if tr.T < args.max_turns:
            reached = [j for j, other in enumerate(trajs) if other.T > tr.T]
            t = tr.T  # the first turn it did not reach (0-based)
            mean, std = common.mean_std([x["G"][j][t] for j in reached], ddof=0)
            out.append(
                f"k = {k} ended at turn {tr.T} ({tr.outcome}: E_total {g3(sum(tr.dEs))} >= ||P0|| "
                f"{g3(env.norm(x['p0']))}), so A_turn at turn {t + 1} compares only the {len(reached)} dialogues "
                f"that reached it (k = {', '.join(map(str, reached))}: G_{t + 1} = "
                f"{', '.join(g3(x['G'][j][t]) for j in reached)}; mean {g3(mean)}, population std {g3(std)}); "
                f"A_group pools all {sum(other.T for other in trajs)} rewards of the group."
            )
    for k, tr in enumerate(trajs):
        for t in range(tr.T):
            if x["failed"][k][t]:
                valid = [r[k][j] for j in range(tr.T) if not x["failed"][k][j]]
                out.append(
                    f"k = {k}, turn {t + 1}: the judge failed (v None, the state stays), so r_{t + 1} is the mean of "
                    f"the dialogue's valid rewards, ({' + '.join(g3(v) for v in valid)}) / {len(valid)} = "
                    f"{g3(r[k][t])}; it counts in G and in the group's statistics, but its "
                    f"{tr.spans[t][1] - tr.spans[t][0]} tokens are out of the loss (A None in the Sample, 0 in the "
                    "mask)."
                )
            elif tr.cut_off[t]:
                idr = x["parts"][k]["idr"][t]
                out.append(
                    f"k = {k}, turn {t + 1}: the reply hit the cap ({args.max_new_tokens} tokens, cut off), so "
                    f"r_{t + 1} = IDR {g3(idr)} - {g3(x['penalty'])} (--cut-off-penalty {args.cut_off_penalty:g} "
                    f"x sqrt(3), the IDR of a turn gaining one point on every axis) = {g3(r[k][t])}; its tokens "
                    "are scored."
                )
    out.append(
        "alpha 1 gives A = A_turn, alpha 0 gives A = A_group; GRPO gives each dialogue one A on every turn, from "
        f"its summed reward; REINFORCE++ whitens G over the batch (here this group's {sum(tr.T for tr in trajs)} "
        "turns) with no groups."
    )
    return out


def main():
    x = worked_example()
    args = x["args"]
    print(
        f"04_mica_train.py --preset cpu, K = {len(x['trajs'])} dialogues of one scenario: --reward {args.reward}, "
        f"gamma {args.gamma:g}, --cut-off-penalty {args.cut_off_penalty:g}\n({g3(x['penalty'])} off a cut-off "
        f"reply), --max-new-tokens {args.max_new_tokens}, --min-turns {args.min_turns}, --max-turns {args.max_turns}"
    )
    print(
        f"scenario: P0 = {vec(x['p0'])} from EMPA's items {', '.join(f'{n} {v}' for n, v in ITEMS.items() if v)}; "
        f"||P0|| = {g3(env.norm(x['p0']))}, d(P0) = {g3(env.hinge_distance(x['p0'], args.idr_weights, env.EPS))}"
    )
    print(
        "columns: v_t the judge's progress vector, d(P_t) the hinge distance after the turn, r_t the training reward,\n"
        "G_t the return, A_turn and A_group MICA's two terms, A(alpha) MICA's advantage, GRPO's and REINFORCE++'s\n"
        "(RF++) advantage, and how many of the reply's tokens the loss counts"
    )
    for k, (why, _) in enumerate(PLANS):
        print()
        print("\n".join(table(x, k, why)))
    print()
    for line in notes(x):
        print(textwrap.fill(line, 116, initial_indent="- ", subsequent_indent="  "))


if __name__ == "__main__":
    main()

"""plots.py: every figure of the project, each drawn from files a run folder already holds.

  curves(run_dir, keys)          <run>/metrics.jsonl -> curves.png, one panel per metric (01, 02, 04)
  credit(run_dir, step)          <run>/rollouts.jsonl -> credit_step<N>.png, how the estimator assigned credit (04)
  rubric_weights(run_dir)        <run>/report.json -> weights_by_turn.png, weights_by_emotion.png (02)
  comparison, trajectories, series                  05's held-out pictures (results.json, transcripts.jsonl)
  hinge_box, credit_grid, clip_surrogate            docs/course.md's pictures, from the functions the caller
                                                    passes in (scripts/course_figures.py)

A stage calls these at its end (04 also at each checkpoint); any of them can redraw a finished run later:
  python -c "import plots; plots.credit(__import__('pathlib').Path('runs/mica-<time>'), 3)"
Every figure is written whole or not at all (a temporary file, then renamed). A support module: it imports
common.py, never a stage.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import common
import runs


def pyplot():
    """matplotlib's pyplot on its file-only Agg backend (no display needed), imported when the first figure is
    drawn: a stage that draws nothing does not pay for it at start."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(fig, path: Path) -> Path:
    """A figure as a PNG, whole or not at all (a temporary file, then renamed); the figure closed."""
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=110)
    pyplot().close(fig)
    os.replace(tmp, path)
    return path


def last_lines_by(records: list[dict], key) -> list[dict]:
    """One record per key(record), the last one: a step a resumed run logged again counts once."""
    return list({key(r): r for r in records}.values())


# 04's curves.png: {metrics.jsonl key: panel title}
MICA_CURVES = {
    "return_mean": "return (mean per dialogue)",
    "reward_mean": "reward (mean per turn)",
    "cut_off_frac": "cut-off share",
    "kl": "KL to the base",
    "clip_frac": "clip fraction",
}


def curves(run_dir: Path, keys: dict) -> Path | None:
    """<run>/metrics.jsonl -> <run>/curves.png, one panel per metric ({key: title}) by step, non-finite values
    skipped. None before the first line."""
    plt = pyplot()
    path = Path(run_dir) / "metrics.jsonl"
    lines = [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []
    rows = sorted(last_lines_by(lines, lambda r: r["step"]), key=lambda r: r["step"])
    if not rows:
        return None
    fig, axes = plt.subplots(1, len(keys), figsize=(3.2 * len(keys), 3.0), squeeze=False)
    for ax, (key, title) in zip(axes[0], keys.items()):
        pts = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
        ax.plot([s for s, _ in pts], [v for _, v in pts], marker="o", markersize=3)
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("step", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.xaxis.get_major_locator().set_params(integer=True)
    fig.suptitle(Path(run_dir).name, fontsize=9)
    fig.tight_layout()
    return save(fig, Path(run_dir) / "curves.png")


def credit(run_dir: Path, step: int) -> Path:
    """credit_step<N>.png from rollouts.jsonl: the K dialogues of the step's first scenario, one column each. Top,
    in the reward's units: per turn the reward r_t and the return G_t (a cut-off reply's reward crossed). Below,
    unitless: the estimator's own terms as it returned them (MICA: A_turn and A_group; none for GRPO and
    REINFORCE++) and the advantage A. A turn whose judge failed (left out of the loss) is shaded in both."""
    plt = pyplot()
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    records = last_lines_by(
        [r for r in runs.read_jsonl(Path(run_dir) / "rollouts.jsonl") if r["step"] == step],
        lambda r: (r["scenario_id"], r["k"]),
    )
    dialogues = [r for r in records if r["scenario_id"] == records[0]["scenario_id"]]
    args = json.loads((Path(run_dir) / "args.json").read_text())
    estimator = f"--advantage {args.get('advantage', '?')}"
    if args.get("advantage") == "mica":
        estimator += f" (alpha {args['alpha']:g})"
    fig, axes = plt.subplots(
        2, len(dialogues), figsize=(3.4 * len(dialogues), 5.0), squeeze=False, sharex="col", sharey="row"
    )
    for col, rec in enumerate(dialogues):
        top, bottom = axes[0][col], axes[1][col]
        t = [turn["t"] for turn in rec["turns"]]
        top.plot(t, [turn["reward"] for turn in rec["turns"]], marker="o", markersize=3, label="r_t", color="C0")
        top.plot(t, [turn["G"] for turn in rec["turns"]], marker="o", markersize=3, label="G_t", color="C1")
        names = list(rec["turns"][0]["terms"]) if rec["turns"] else []
        for j, name in enumerate(names):
            values = [turn["terms"][name] for turn in rec["turns"]]
            bottom.plot(t, values, marker="o", markersize=3, label=name, color=("C2", "C4", "C6", "C8")[j % 4])
        bottom.plot(t, [turn["advantage"] for turn in rec["turns"]], marker="o", markersize=3, label="A", color="k")
        for turn in rec["turns"]:
            if turn["cut_off"]:
                top.plot(turn["t"], turn["reward"], "x", color="C3", markeredgewidth=2)
            if turn["judge_failed"]:
                for ax in (top, bottom):
                    ax.axvspan(turn["t"] - 0.4, turn["t"] + 0.4, color="0.85")
        for ax in (top, bottom):
            ax.axhline(0, color="0.6", linewidth=0.6)
            ax.tick_params(labelsize=7)
        top.set_title(
            f"k={rec['k']}: {rec['outcome']}, d {rec['initial_distance']} -> {rec['final_distance']}", fontsize=8
        )
        bottom.set_xlabel("turn", fontsize=8)
        bottom.set_xticks(t)
    axes[0][0].set_ylabel("reward units (r_t, G_t)", fontsize=8)
    axes[1][0].set_ylabel("advantage (unitless)", fontsize=8)
    marks = [
        Line2D(
            [], [], linestyle="", marker="x", color="C3", markersize=8, markeredgewidth=2, label="cut off at the cap"
        ),
        Patch(color="0.85", label="judge failed: out of the loss"),
    ]
    axes[0][0].legend(handles=[*axes[0][0].get_legend_handles_labels()[0], *marks], fontsize=7)
    axes[1][0].legend(fontsize=7)
    fig.suptitle(
        f"{Path(run_dir).name}, step {step}, scenario {dialogues[0]['scenario_id']}: how {estimator} assigned credit",
        fontsize=9,
    )
    fig.tight_layout()
    return save(fig, Path(run_dir) / f"credit_step{step}.png")


def rubric_weights(run_dir: Path, dims) -> list[Path]:
    """<run>/report.json (02's before / after RL) -> weights_by_turn.png and weights_by_emotion.png: the mean
    rubric weights as stacked bars, before and after side by side."""
    plt = pyplot()
    report = json.loads((Path(run_dir) / "report.json").read_text())
    out = []
    for name, key in (("turn index", "weights_by_turn"), ("user emotion", "weights_by_emotion")):
        keys = list(dict.fromkeys([*report["before"][key], *report["after"][key]]))
        fig, axes = plt.subplots(1, 2, figsize=(11, 3.6), sharey=True)
        for ax, label in zip(axes, ("before", "after")):
            table, bottom = report[label][key], [0.0] * len(keys)
            for j, d in enumerate(dims):
                vals = [table.get(k, {"w": [0.0] * len(dims)})["w"][j] for k in keys]
                ax.bar(keys, vals, bottom=bottom, label=d)
                bottom = [b + v for b, v in zip(bottom, vals)]
            ax.set_title(f"mean rubric weights by {name}, {label} RL", fontsize=9)
            ax.tick_params(axis="x", rotation=45 if max((len(k) for k in keys), default=0) > 3 else 0)
        axes[0].set_ylabel("weight")
        axes[1].legend(loc="upper right", fontsize=8)
        fig.tight_layout()
        out.append(save(fig, Path(run_dir) / f"{key}.png"))
    return out


# ---- 05's held-out pictures -------------------------------------------------------------------
def comparison(comparison: dict, measures, path: Path) -> Path:
    """comparison.png: per measure, one row per adapter, its paired difference from the base (adapter - base,
    each scenario's dialogues averaged first) with the 95% t interval over scenarios and a line at 0, as the
    verdict reads it (an interval clear of 0 on the better side: ahead beyond the spread); the verdict beside."""
    plt = pyplot()
    adapters = list(comparison)
    fig, axes = plt.subplots(
        1, len(measures), figsize=(4.2 * len(measures), 1.9 + 0.45 * len(adapters)), squeeze=False, sharey=True
    )
    for ax, (key, label, higher) in zip(axes[0], measures):
        for y, a in enumerate(adapters):
            s = comparison[a].get(key)  # None: a measure this adapter's records lack
            if s is None:
                continue
            lo, hi = s["ci"]
            ax.errorbar([s["diff"]], [y], xerr=[[s["diff"] - lo], [hi - s["diff"]]], fmt="o", capsize=5, color=f"C{y}")
            said = s["verdict"].split(":")[0]  # "no spread over N scenarios: every ..." up to its colon
            said += "" if "scenarios" in said else f" ({s['scenarios']} scenarios)"
            ax.text(0.5, y - 0.22, said, transform=ax.get_yaxis_transform(), ha="center", va="bottom", fontsize=6)
        ax.axvline(0, color="0.5", linewidth=0.8)
        ax.set_title(f"{label}: adapter - base ({'right' if higher else 'left'} of 0 is better)", fontsize=8)
        ax.tick_params(labelsize=7)
    axes[0][0].set_yticks(range(len(adapters)), [Path(a).parent.name or a for a in adapters], fontsize=7)
    axes[0][0].set_ylim(len(adapters) - 0.4, -0.6)  # the first adapter on top, room for its verdict
    fig.suptitle("held out: each adapter's paired difference from the base, 95% t interval over scenarios", fontsize=9)
    fig.tight_layout()
    return save(fig, path)


def trajectories(dialogues: dict, axes_names, path: Path) -> Path:
    """trajectories.png: one held-out case of each model, the state C, A, P after each turn (0: P0)."""
    plt = pyplot()
    fig, axes = plt.subplots(1, len(dialogues), figsize=(4 * len(dialogues), 3.2), squeeze=False, sharey=True)
    for ax, (model, rec) in zip(axes[0], dialogues.items()):
        states = [rec["p0"]] + [tu["state"] for tu in rec["turns"]]
        for i, axis in enumerate(axes_names):
            ax.plot(range(len(states)), [P[i] for P in states], marker="o", markersize=3, label=axis)
        ax.axhline(0, color="0.6", linewidth=0.6)
        ax.set_title(f"{'base' if model == 'base' else Path(model).parent.name}: {rec['outcome']}", fontsize=8)
        ax.set_xlabel("turn", fontsize=8)
        ax.tick_params(labelsize=7)
    axes[0][0].set_ylabel("state P_t (the goal: every axis >= -eps)", fontsize=8)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"one held-out case, {rec['scenario_id']}#{rec['k']}, each model (the same seed)", fontsize=9)
    fig.tight_layout()
    return save(fig, path)


def series(curves: dict, ylabel: str, path: Path, xlabel: str = "turn (0 = before the first reply)") -> Path:
    """curves: {model: [one list of values by turn per case]} -> per turn the mean and a +-1 sd band over the
    cases still going, one line per model (a PNG at path). experiments/credit.py draws its seeds' learning
    curves with it (its x axis: the evaluation step)."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for label, cases in curves.items():
        rows = [[r[t] for r in cases if len(r) > t] for t in range(max(len(r) for r in cases))]
        means = [sum(v) / len(v) for v in rows]
        sds = [common.mean_std(v)[1] if len(v) > 1 else 0.0 for v in rows]
        ax.plot(range(len(rows)), means, label=f"{label} (n={len(cases)})")
        ax.fill_between(
            range(len(rows)), [m - s for m, s in zip(means, sds)], [m + s for m, s in zip(means, sds)], alpha=0.2
        )
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(f"{ylabel}: mean and ±1 sd over those still going")
    ax.legend(fontsize=8)
    ax.xaxis.get_major_locator().set_params(integer=True)
    fig.tight_layout()
    return save(fig, path)


# ---- the course's pictures (docs/course.md): each drawn from the functions its caller passes in ----------------
def hinge_box(path: Path, distance, eps: float, moves) -> dict:
    """hinge_box.png: the hinge distance d over two axes (C, A; P = 0, inside the box), as contours, and the
    tolerance box where d = 0 shaded; each move (P before, P after) as an arrow with its reward d(before) -
    d(after). distance(P) is the environment's own (03's hinge_distance), called at every grid point; eps only
    labels the box. Returns the numbers drawn: the grid, its distances, and each move's distances."""
    plt = pyplot()
    axis = [-8.0 + 0.1 * i for i in range(121)]  # -8 .. 4
    grid = [[distance([c, a, 0.0]) for c in axis] for a in axis]  # grid[i][j]: A = axis[i], C = axis[j]
    fig, ax = plt.subplots(figsize=(6.2, 5.4))
    lines = ax.contour(axis, axis, grid, levels=[1, 2, 3, 4, 5, 6, 7, 8, 9], colors="0.45", linewidths=0.8)
    ax.clabel(lines, fontsize=7, fmt="d = %g")
    inside = [[1.0 if d == 0 else 0.0 for d in row] for row in grid]
    ax.contourf(axis, axis, inside, levels=[0.5, 1.5], colors=["#b7e1b0"])
    ax.text(1.0, 2.5, f"tolerance box:\nevery P_a >= -eps = {-eps:g}\nd = 0 here", fontsize=8, ha="center")
    drawn = []
    for before, after in moves:
        d0, d1 = distance(before), distance(after)
        drawn.append({"before": list(before), "after": list(after), "d_before": d0, "d_after": d1})
        ax.annotate("", xy=(after[0], after[1]), xytext=(before[0], before[1]), arrowprops={"arrowstyle": "->"})
        ax.plot([before[0]], [before[1]], "ko", markersize=3)
        note = f"d {d0:.2f} -> {d1:.2f}\nr = {d0 - d1:+.2f}"
        box = {"facecolor": "white", "edgecolor": "none", "alpha": 0.85}
        ax.text((before[0] + after[0]) / 2 + 0.3, (before[1] + after[1]) / 2 - 0.3, note, fontsize=7, bbox=box)
    ax.axhline(0, color="0.8", linewidth=0.6)
    ax.axvline(0, color="0.8", linewidth=0.6)
    ax.set_xlabel("P_C (cognitive)", fontsize=8)
    ax.set_ylabel("P_A (affective)", fontsize=8)
    ax.tick_params(labelsize=7)
    ax.set_aspect("equal")
    ax.set_title("d(P) = sqrt( sum_a w_a max(0, -eps - P_a)^2 ), w = (1, 1, 1), P_P = 0", fontsize=9)
    fig.tight_layout()
    save(fig, Path(path))
    return {"axis": axis, "grid": grid, "moves": drawn}


def credit_grid(path: Path, rewards, gamma: float, returns, turn_level, group_level, turn: int) -> dict:
    """credit_grid.png: one scenario group's dialogues (rows) x turns (columns), twice. Left, A_turn at one turn:
    it compares the returns G_t of the dialogues that reached that turn (framed), and nothing else. Right,
    A_group: it pools every reward of the group (all framed). Each cell holds the values of the functions passed
    in (04's discounted_returns, turn_level_advantages, group_level_advantages); a turn a dialogue never reached
    is grey. turn is 1-based. Returns the numbers drawn."""
    plt = pyplot()
    from matplotlib.patches import Rectangle

    K, T = len(rewards), max(len(r) for r in rewards)
    G = [returns(r, gamma) for r in rewards]
    A_turn, A_group = turn_level(rewards, gamma), group_level(rewards)
    fig, axes = plt.subplots(1, 2, figsize=(11, 0.9 * K + 1.6))
    panels = (
        (
            axes[0],
            G,
            "G",
            A_turn,
            "A_turn",
            f"A_turn at turn {turn}: compares G_{turn} of the dialogues that reached it",
        ),
        (axes[1], rewards, "r", A_group, "A_group", "A_group: pools every reward r_t of the group"),
    )
    for ax, values, name, advantage, a_name, title in panels:
        for k in range(K):
            for t in range(T):
                reached = t < len(rewards[k])
                framed = reached and (name == "r" or t == turn - 1)
                face = "#fde7c4" if framed else "white" if reached else "0.85"
                ax.add_patch(Rectangle((t, k), 1, 1, facecolor=face, edgecolor="0.5", linewidth=0.6))
                if framed:
                    ax.add_patch(Rectangle((t + 0.04, k + 0.06), 0.92, 0.88, fill=False, edgecolor="C1", linewidth=2))
                if reached:
                    text = f"{name} {values[k][t]:+.3f}\n{a_name} {advantage[k][t]:+.3f}"
                    ax.text(t + 0.5, k + 0.5, text, ha="center", va="center", fontsize=7)
                else:
                    ax.text(t + 0.5, k + 0.5, "ended", ha="center", va="center", fontsize=7, color="0.4")
        ax.set_xlim(0, T)
        ax.set_ylim(K, 0)
        ax.set_xticks([t + 0.5 for t in range(T)], [f"turn {t + 1}" for t in range(T)], fontsize=8)
        ax.set_yticks([k + 0.5 for k in range(K)], [f"k = {k}" for k in range(K)], fontsize=8)
        ax.tick_params(length=0)
        ax.set_title(title, fontsize=9)
    fig.suptitle(
        f"one scenario group of K = {K} dialogues, gamma {gamma:g}: which cells each term compares", fontsize=9
    )
    fig.tight_layout()
    save(fig, Path(path))
    return {"G": G, "A_turn": A_turn, "A_group": A_group}


def clip_surrogate(path: Path, surrogate, clip_low: float, clip_high: float) -> dict:
    """clip_surrogate.png: the per-token loss against the ratio, for A = +1 and A = -1, as the function passed in
    computes it (surrogate(ratios, A) -> (losses, clipped flags): 04's clipped_surrogate), with -ratio A (no
    clip) dashed, the band [1 - clip_low, 1 + clip_high] dotted, and shaded where the clip chose the loss (its
    gradient is 0 there). Returns the numbers drawn."""
    plt = pyplot()
    ratios = [0.3 + 0.005 * i for i in range(321)]  # 0.3 .. 1.9
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8), sharex=True)
    drawn = {"ratios": ratios}
    for ax, A in zip(axes, (1.0, -1.0)):
        losses, clipped = surrogate(ratios, A)
        drawn[A] = {"loss": losses, "clipped": clipped}
        ax.plot(ratios, [-x * A for x in ratios], "--", color="0.6", linewidth=1, label="-ratio A (no clip)")
        ax.plot(ratios, losses, color="C0", linewidth=2, label="the loss: max(-ratio A, -clip(ratio) A)")
        low = 1 - clip_low
        high = 1 + clip_high
        ax.axvline(low, color="0.4", linestyle=":", linewidth=1)
        ax.axvline(high, color="0.4", linestyle=":", linewidth=1)
        bottom, top = min(losses + [-x * A for x in ratios]), max(losses + [-x * A for x in ratios])
        ax.fill_between(
            ratios,
            bottom,
            top,
            where=[c > 0 for c in clipped],
            color="C3",
            alpha=0.15,
            label="the clip chose the loss (counted in clip_frac; no gradient)",
        )
        ax.set_ylim(bottom - 0.05, top + 0.3)
        # outside the band on the other side the unclipped term is the larger loss: not clipped
        free = [x for x, c in zip(ratios, clipped) if (x < low or x > high) and c == 0]
        if free:
            side = "below" if free[0] < low else "above"
            note = f"{side} the band, not clipped:\n-ratio A is the larger loss"
            ax.text(sum(free) / len(free), (bottom + top) / 2, note, fontsize=7, ha="center")
        ax.text(low, top + 0.1, f" {low:g}", fontsize=7)
        ax.text(high, top + 0.1, f" {high:g}", fontsize=7)
        ax.set_title(f"A = {A:+g}", fontsize=9)
        ax.set_xlabel("ratio = pi(y) / pi_old(y)", fontsize=8)
        ax.tick_params(labelsize=7)
    axes[0].set_ylabel("loss of one token", fontsize=8)
    axes[0].legend(fontsize=7, loc="lower left")
    fig.suptitle(f"the clipped surrogate, clip [1 - {clip_low:g}, 1 + {clip_high:g}]", fontsize=9)
    fig.tight_layout()
    save(fig, Path(path))
    return drawn

"""scripts/view_run.py: one self-contained HTML page of a run's dialogues, to read what the policy said and
how each turn was scored and credited.

What it shows
  A header (the run, its steps and dialogues, per step the mean return and the share of cut-off turns), a
  step selector (the last step first), and for every dialogue of the step: scenario, k, outcome, distances
  and return; each turn's user message and policy reply with the judge's v, the state (C, A, P), the
  distance, the user's emotion, the reward (and its parts), the advantage A, the estimator's terms (MICA:
  A_turn, A_group) and the rubric's weights where the run wrote them; cut-off and judge-failed turns are
  marked. Per dialogue small charts: the state and the distance from P0 at turn 0, and the credit (reward, the
  estimator's terms, A by turn).
  With CARE rubrics, the mean rubric weights by turn and by the user's emotion band (F < 10, C >= 10,
  B >= 40, A >= 70, S >= 100; the emotion the user was in when the rubric was written, i.e. before the
  reply: the previous turn's, and for turn 1 the run's --emotion-start from args.json, else 03's 30).
  Plain HTML and CSS, inline SVG and a few lines of inline JavaScript for the selector: no server, no
  network. Numbers to 3 decimals. A step that appears again later in the file (a run resumed with
  --resume past its last checkpoint) is shown as last written.

Reads   <run>/rollouts.jsonl (03_rollout.py or 04_mica_train.py; a line per dialogue), or 05_eval.py's
        transcripts.jsonl (its EMPA dialogues, one section per model, each reply's naturalness), <run>/args.json.
Writes  <run>/rollouts.html (or --out), atomically (a temporary file in the same folder, then renamed).
Exit    2 with one line "error: ..." when the folder or its rollouts.jsonl is missing or a line is not a
        JSON dialogue.

Usage: python scripts/view_run.py runs/mica-20261201-120000        (then open runs/.../rollouts.html)
"""

from __future__ import annotations

import argparse
import html
import json
import math
import os
import sys
from pathlib import Path

DIMS = [("C", "cognitive"), ("A", "affective"), ("P", "proactive")]
BANDS = [("S", 100.0), ("A", 70.0), ("B", 40.0), ("C", 10.0), ("F", -math.inf)]  # the first whose bound e >= is met
BAND_TEXT = {"F": "e < 10", "C": "10 <= e < 40", "B": "40 <= e < 70", "A": "70 <= e < 100", "S": "e >= 100"}
BAND_TICK = {"F": "F <10", "C": "C 10-40", "B": "B 40-70", "A": "A 70-100", "S": "S 100+"}
EMOTION_START = 30.0  # 03_rollout.py's --emotion-start default, for runs without args.json
COLORS = {
    "C": "#2563eb",
    "A": "#ea580c",
    "P": "#16a34a",
    "distance": "#444444",
    "reward": "#9ca3af",
    "A_turn": "#7c3aed",
    "A_group": "#0891b2",
    "advantage": "#111111",
}


class ViewError(Exception):
    """A problem with the input, reported as one line "error: ..." and exit code 2."""


def main(argv=None):
    args = parse_args(argv)
    try:
        run_dir = Path(args.run)
        if not run_dir.is_dir():
            raise ViewError(f"{run_dir}: no such run folder")
        name = "rollouts.jsonl"
        if not (run_dir / name).exists() and (run_dir / "transcripts.jsonl").exists():
            name = "transcripts.jsonl"  # 05's run: its EMPA dialogues, a "step" per model
        records, dropped = drop_rerun_steps(read_rollouts(run_dir / name))
        page = render_page(run_dir, group_by_step(records), len(records), dropped, emotion_start(run_dir), name)
        out = Path(args.out) if args.out else run_dir / "rollouts.html"
        write_atomic(out, page)
    except ViewError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(out)
    return 0


# ---------------------------------------------------------------------------------------------
# reading
# ---------------------------------------------------------------------------------------------
def read_rollouts(path: Path) -> list[dict]:
    """The dialogue records of rollouts.jsonl, each with `_step` (None when the record has no "step")."""
    if not path.is_file():
        raise ViewError(f"{path}: no such file (is this a run folder of 03_rollout.py or 04_mica_train.py?)")
    records = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ViewError(f"{path}:{n}: not JSON ({e.msg})") from None
            if (
                not isinstance(rec, dict)
                or not isinstance(rec.get("turns"), list)
                or not all(isinstance(t, dict) for t in rec["turns"])
            ):
                raise ViewError(f"{path}:{n}: not a dialogue record (needs a list 'turns' of objects)")
            step = rec.get("step", rec.get("model"))
            rec["_step"] = step if isinstance(step, (int, str)) and not isinstance(step, bool) else None
            if rec.get("suite", "empa") == "empa":
                records.append(rec)
    if not records:
        raise ViewError(f"{path}: holds no dialogues")
    return records


def drop_rerun_steps(records: list[dict]) -> tuple[list[dict], int]:
    """The records with each step as last written, and how many were dropped. 04 --resume restarts from its
    last checkpoint and appends again: a step's records that come back after another step's, or that repeat
    a (scenario, k) of the step (one step samples each scenario once), are a re-run that replaces the first."""
    blocks: dict = {}  # step -> (its records, their (scenario, k))
    dropped, prev = 0, object()
    for rec in records:
        step, key = rec["_step"], (str(rec.get("scenario_id")), str(rec.get("k")))
        if step in blocks and (step != prev or key in blocks[step][1]):
            dropped += len(blocks.pop(step)[0])
        blocks.setdefault(step, ([], set()))
        blocks[step][0].append(rec)
        blocks[step][1].add(key)
        prev = step
    kept = {id(rec) for recs, _ in blocks.values() for rec in recs}
    return [rec for rec in records if id(rec) in kept], dropped


def group_by_step(records: list[dict]) -> list[tuple[int | None, list[dict]]]:
    """[(step, its dialogues in file order)] in step order (a run without steps is one step, None)."""
    steps: dict = {}
    for rec in records:
        steps.setdefault(rec["_step"], []).append(rec)
    return sorted(steps.items(), key=lambda kv: (kv[0] is not None, kv[0] or 0))


def emotion_start(run_dir: Path) -> float:
    """The user's emotion before turn 1: the run's --emotion-start (args.json), else 03's default."""
    try:
        value = json.loads((run_dir / "args.json").read_text(encoding="utf-8")).get("emotion_start")
    except (OSError, ValueError, AttributeError):
        return EMOTION_START
    return float(value) if is_num(value) else EMOTION_START


# ---------------------------------------------------------------------------------------------
# the page: header, rubric section, the step selector, the steps with their dialogues and turns
# ---------------------------------------------------------------------------------------------
def render_page(run_dir: Path, steps, n_dialogues: int, dropped: int, e_start: float, source="rollouts.jsonl") -> str:
    name = run_dir.resolve().name
    last = step_id(steps[-1][0])
    options = "".join(
        f'<option value="{step_id(s)}"{" selected" if step_id(s) == last else ""}>'
        f"{step_title(s)}: {len(recs)} dialogues</option>"
        for s, recs in steps
    )
    body = [
        f"<h1>{esc(name)}</h1>",
        f'<p class="meta">{len(steps)} step{"s" * (len(steps) != 1)}, {n_dialogues} dialogues, '
        f"{sum(len(r['turns']) for _, recs in steps for r in recs)} turns, from {esc(str(run_dir))}"
        f"/{source}{f'; {dropped} dialogues of re-run steps left out' if dropped else ''}</p>",
        render_step_table(steps),
        render_rubrics(steps, e_start),
        f'<nav><label>Show step <select id="step-select">{options}</select></label></nav>',
    ]
    for s, recs in steps:
        body.append(render_step(s, recs, hidden=step_id(s) != last))
    return PAGE.format(title=esc(f"{name}: rollouts"), css=CSS, body="\n".join(body), script=SCRIPT)


def render_step_table(steps) -> str:
    """Per step: dialogues, mean return, the share of cut-off turns, of judge-failed turns, successes."""
    rows = []
    for s, recs in steps:
        turns = [t for r in recs for t in r["turns"]]
        rows.append(
            f"<tr><td>{step_label(s)}</td><td>{len(recs)}</td><td>{num(mean(r.get('return') for r in recs))}"
            f"</td><td>{num(share(t.get('cut_off') for t in turns))}</td>"
            f"<td>{num(share(t.get('judge_failed') for t in turns))}</td>"
            f"<td>{num(share(r.get('outcome') == 'success' for r in recs))}</td>"
            f"<td>{num(mean(r.get('final_distance') for r in recs))}</td></tr>"
        )
    return (
        '<table class="steps"><caption>Per step</caption><tr><th>step</th><th>dialogues</th><th>mean return</th>'
        "<th>cut-off turns (share)</th><th>judge-failed turns (share)</th><th>success (share)</th>"
        f"<th>mean final distance</th></tr>{''.join(rows)}</table>"
    )


def render_rubrics(steps, e_start: float) -> str:
    """The mean rubric weights (C, A, P) by turn index and by the user's emotion band, when any turn has a
    rubric: two tables and two stacked bar charts."""
    by_turn: dict = {}
    by_band: dict = {b: [] for b, _ in BANDS}
    for _, recs in steps:
        for rec in recs:
            for i, turn in enumerate(rec["turns"]):
                w = rubric_weights(turn)
                if w is None:
                    continue
                by_turn.setdefault(i + 1, []).append(w)
                before = rec["turns"][i - 1].get("emotion") if i else e_start  # when the rubric was written
                if is_num(before):
                    by_band[band(before)].append(w)
    if not by_turn:
        return ""
    # (the table's label, the bar's label, the weights)
    turn_groups = [(f"turn {t}", f"turn {t}", ws) for t, ws in sorted(by_turn.items())]
    band_groups = [(f"{b} ({BAND_TEXT[b]})", BAND_TICK[b], by_band[b]) for b in "FCBAS" if by_band[b]]
    parts = [
        '<section class="rubrics"><h2>Rubric weights</h2><p class="meta">The mean weight the CARE rubric gave '
        "each dimension (C cognitive, A affective, P proactive), over the turns that carry a rubric, by turn "
        "and by the band of the user's emotion e when the rubric was written (before the reply).</p>"
    ]
    for caption, short, groups in (
        ("by turn", "by turn", turn_groups),
        ("by the user's emotion band", "by emotion band", band_groups),
    ):
        means = [(label, tick, [mean(w[j] for w in ws) for j in range(3)], len(ws)) for label, tick, ws in groups]
        rows = "".join(
            f'<tr><td class="l">{esc(label)}</td><td>{n}</td>' + "".join(f"<td>{num(m)}</td>" for m in ms) + "</tr>"
            for label, _, ms, n in means
        )
        chart = stacked_bars(f"rubric weights {short}", [(tick, ms) for _, tick, ms, _ in means])
        parts.append(
            f'<div class="pair"><table><caption>Mean rubric weights {caption}</caption><tr>'
            f'<th class="l">group</th><th>turns</th><th>w C</th><th>w A</th><th>w P</th></tr>{rows}</table>'
            f"{chart}</div>"
        )
    return "".join(parts) + "</section>"


def render_step(step, recs: list[dict], hidden: bool) -> str:
    head = (
        f'<h2>{step_title(step)}</h2><p class="meta">{len(recs)} dialogues, mean return '
        f"{num(mean(r.get('return') for r in recs))}, cut-off turns "
        f"{num(share(t.get('cut_off') for r in recs for t in r['turns']))}</p>"
    )
    dialogues = "".join(render_dialogue(step, i, rec) for i, rec in enumerate(recs))
    return (
        f'<section class="step" id="{step_id(step)}" data-step="{step_id(step)}"{" hidden" * hidden}>'
        f"{head}{dialogues}</section>"
    )


def render_dialogue(step, index: int, rec: dict) -> str:
    """One dialogue: its facts, its charts, then turn by turn."""
    outcome = str(rec.get("outcome", "?"))
    facts = [
        ("P0 (C, A, P)", vec(rec.get("p0"))),
        ("initial distance", num(rec.get("initial_distance"))),
        ("final distance", num(rec.get("final_distance"))),
        ("return", num(rec.get("return"))),
        ("E total", num(rec.get("E_total"))),
        ("final emotion", num(rec.get("final_emotion"))),
        ("turns", str(len(rec["turns"]))),
    ]
    head = (
        f'<h3>{esc(rec.get("scenario_id", "?"))} <span class="k">k={esc(rec.get("k", "?"))}</span> '
        f'<span class="outcome {esc(outcome)}">{esc(outcome)}</span></h3><table class="facts"><tr>'
        + "".join(f"<th>{k}</th>" for k, _ in facts)
        + "</tr><tr>"
        + "".join(f"<td>{v}</td>" for _, v in facts)
        + "</tr></table>"
    )
    turns = "".join(render_turn(turn) for turn in rec["turns"])
    return (
        f'<article class="dialogue" id="{step_id(step)}-d{index}" data-step="{step_id(step)}" '
        f'data-scenario="{esc(rec.get("scenario_id", ""))}" data-k="{esc(rec.get("k", ""))}">{head}'
        f'<div class="charts">{dialogue_charts(rec)}</div><ol class="turns">{turns}</ol></article>'
    )


def render_turn(turn: dict) -> str:
    """One turn: the user's message, the policy's reply, the marks, then its numbers."""
    cut, failed = bool(turn.get("cut_off")), bool(turn.get("judge_failed")) or turn.get("v", 0) is None
    flags = ('<span class="flag cut">cut off</span>' * cut) + ('<span class="flag failed">judge failed</span>' * failed)
    msgs = [("user", turn.get("user", "")), ("policy", turn.get("assistant", ""))]
    if isinstance(turn.get("shown"), str) and turn["shown"] != turn.get("assistant"):
        msgs.append(("shown to the user", turn["shown"]))
    text = "".join(
        f'<div class="msg {who.split()[0]}"><span class="who">{who}</span><span class="text">'
        f"{esc(clean(m))}</span></div>"
        for who, m in msgs
    )
    kv = [
        ("v (C, A, P)", vec(turn.get("v"))),
        ("state (C, A, P)", vec(turn.get("state"))),
        ("distance", num(turn.get("distance"))),
        ("emotion", num(turn.get("emotion"))),
        ("reward", num(turn.get("reward"))),
    ]
    if isinstance(turn.get("reward_parts"), dict):
        kv.append(("reward parts", ", ".join(f"{esc(k)} {num(v)}" for k, v in turn["reward_parts"].items())))
    if "advantage" in turn:
        kv.append(("A", num(turn["advantage"])))
    for name, value in (turn.get("terms") or {}).items():  # the estimator's own terms (MICA: A_turn, A_group)
        kv.append((esc(name), num(value)))
    if "naturalness" in turn:
        kv.append(("naturalness", num(turn["naturalness"])))
    w = rubric_weights(turn)
    if w is not None:
        kv.append(("rubric w (C, A, P)", vec(w)))
    if "formatted" in turn:
        kv.append(("formatted", "yes" if turn["formatted"] else "no"))
    nums = "".join(f'<span class="kv"><b>{k}</b> {v}</span>' for k, v in kv)
    details = turn_details(turn)
    classes = "turn" + " cut" * cut + " failed" * failed
    return (
        f'<li class="{classes}" data-t="{esc(turn.get("t", ""))}"><div class="turn-head">turn '
        f'{esc(turn.get("t", "?"))} {flags}</div>{text}<div class="nums">{nums}</div>{details}</li>'
    )


def turn_details(turn: dict) -> str:
    """The judge's levels and features and the rubric's criteria, folded away."""
    inner = []
    if isinstance(turn.get("levels"), dict):
        inner.append("<p><b>levels</b> " + esc(json.dumps(turn["levels"])) + "</p>")
    if isinstance(turn.get("judge_features"), dict) and turn["judge_features"]:
        inner.append(
            "<p><b>judge features</b> "
            + ", ".join(f"{esc(k)} {num(v) if is_num(v) else esc(v)}" for k, v in turn["judge_features"].items())
            + "</p>"
        )
    crit = turn.get("rubric", {}).get("criteria") if isinstance(turn.get("rubric"), dict) else None
    if isinstance(crit, dict):
        items = "".join(
            f"<li><b>{esc(d)}</b>: {esc('; '.join(map(str, c)) if isinstance(c, list) else c)}</li>"
            for d, c in crit.items()
        )
        inner.append(f"<p><b>rubric criteria</b></p><ul>{items}</ul>")
    return f"<details><summary>details</summary>{''.join(inner)}</details>" if inner else ""


# ---------------------------------------------------------------------------------------------
# inline SVG charts
# ---------------------------------------------------------------------------------------------
def dialogue_charts(rec: dict) -> str:
    """The state (C, A, P) and the distance from turn 0 (P0), and the credit by turn."""
    turns = rec["turns"]
    xs0 = list(range(len(turns) + 1))
    p0 = rec.get("p0") if isinstance(rec.get("p0"), list) else [None] * 3
    states = [p0] + [t.get("state") if isinstance(t.get("state"), list) else [None] * 3 for t in turns]
    state = [(d, [s[j] if j < len(s) else None for s in states]) for j, (d, _) in enumerate(DIMS)]
    dist = [("distance", [rec.get("initial_distance")] + [t.get("distance") for t in turns])]
    xs = [t.get("t", i + 1) if is_num(t.get("t")) else i + 1 for i, t in enumerate(turns)]
    terms = list(dict.fromkeys(name for t in turns for name in (t.get("terms") or {})))
    credit = [("reward", [t.get("reward") for t in turns])] if any("reward" in t for t in turns) else []
    credit += [(name, [(t.get("terms") or {}).get(name) for t in turns]) for name in terms]
    credit += [("advantage", [t.get("advantage") for t in turns])] if any("advantage" in t for t in turns) else []
    return (
        line_chart("state after each turn", xs0, state, "C, A, P")
        + line_chart("distance to the goal", xs0, dist, "d(P)")
        + line_chart("credit by turn" if len(credit) > 1 else "reward by turn", xs, credit, "value")
    )


W, H, LEFT, RIGHT, TOP, BOTTOM = 300, 170, 52, 10, 32, 32


def line_chart(title: str, xs: list, series: list[tuple[str, list]], y_label: str) -> str:
    """An inline SVG line chart of `series` [(name, values by x)]; 0 is always in range (drawn dashed), a
    missing or non-finite value leaves a gap."""
    values = [v for _, ys in series for v in ys if is_num(v)]
    if not values or not xs:
        return ""
    lo, hi = min(values + [0.0]), max(values + [0.0])
    lo, hi = (lo - 1, hi + 1) if hi == lo else (lo, hi)

    def px(x):
        return scale(x, min(xs), max(xs), LEFT, W - RIGHT)

    def py(y):
        return scale(y, lo, hi, H - BOTTOM, TOP)

    out = [svg_open(title), frame(lo, hi, py)]
    step = max(1, math.ceil(len(xs) / 10))
    for x in xs[::step]:
        out.append(f'<text x="{px(x):.1f}" y="{H - BOTTOM + 12}" text-anchor="middle">{esc(x)}</text>')
    out.append(f'<text x="{(LEFT + W - RIGHT) / 2:.1f}" y="{H - 4}" text-anchor="middle">turn</text>')
    out.append(
        f'<text transform="translate(12 {(TOP + H - BOTTOM) / 2:.1f}) rotate(-90)" '
        f'text-anchor="middle">{esc(y_label)}</text>'
    )
    legend = []
    for name, ys in series:
        color = COLORS.get(name, "#444")
        width = 2.2 if name == "advantage" else 1.5
        for seg in segments(list(zip(xs, ys))):
            pts = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in seg)
            out.append(f'<polyline points="{pts}" fill="none" stroke="{color}" stroke-width="{width}"/>')
            out += [f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="2.2" fill="{color}"/>' for x, y in seg]
        legend.append((name, color))
    return "".join(out) + legend_text(legend) + "</svg>"


def stacked_bars(title: str, groups: list[tuple[str, list[float]]]) -> str:
    """An inline SVG stacked bar chart: one bar per group of the mean weights (C, A, P), 0 to 1."""
    width = max(W, LEFT + RIGHT + 44 * len(groups))
    plot_w = width - LEFT - RIGHT
    hi = max([1.0] + [sum(ws) for _, ws in groups])

    def py(y):
        return scale(y, 0.0, hi, H - BOTTOM, TOP)

    out = [svg_open(title, width), frame(0.0, hi, py, width)]
    slot = plot_w / max(1, len(groups))
    for i, (label, ws) in enumerate(groups):
        x, base = LEFT + slot * i + slot * 0.2, 0.0
        for (d, _), w in zip(DIMS, ws):
            out.append(
                f'<rect x="{x:.1f}" y="{py(base + w):.1f}" width="{slot * 0.6:.1f}" '
                f'height="{py(base) - py(base + w):.1f}" fill="{COLORS[d]}"><title>{d} {num(w)}</title></rect>'
            )
            base += w
        out.append(f'<text x="{x + slot * 0.3:.1f}" y="{H - BOTTOM + 12}" text-anchor="middle">{esc(label)}</text>')
    out.append(
        f'<text transform="translate(12 {(TOP + H - BOTTOM) / 2:.1f}) rotate(-90)" '
        'text-anchor="middle">mean weight</text>'
    )
    return "".join(out) + legend_text([(f"{d} {name}", COLORS[d]) for d, name in DIMS]) + "</svg>"


def scale(v: float, lo: float, hi: float, a: float, b: float) -> float:
    """v in [lo, hi] mapped linearly onto [a, b] (the middle when lo == hi)."""
    return (a + b) / 2 if hi == lo else a + (b - a) * (v - lo) / (hi - lo)


def svg_open(title: str, width: int = W) -> str:
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{H}" viewBox="0 0 {width} {H}" '
        f'role="img" aria-label="{esc(title)}"><title>{esc(title)}</title>'
        f'<text x="{LEFT}" y="12" class="title">{esc(title)}</text>'
    )


def legend_text(items: list[tuple[str, str]]) -> str:
    """The series' names in their colours, one line under the title (the renderer spaces them)."""
    spans = "".join(
        f'<tspan dx="{10 * (i > 0)}" fill="{color}">{esc(name)}</tspan>' for i, (name, color) in enumerate(items)
    )
    return f'<text x="{LEFT}" y="{TOP - 8}">{spans}</text>'


def frame(lo: float, hi: float, py, width: int = W) -> str:
    """The y axis with its ticks (lo, 0, hi), the x axis line, a dashed line at 0."""
    out = [
        f'<line x1="{LEFT}" y1="{TOP}" x2="{LEFT}" y2="{H - BOTTOM}" stroke="#999"/>',
        f'<line x1="{LEFT}" y1="{H - BOTTOM}" x2="{width - RIGHT}" y2="{H - BOTTOM}" stroke="#999"/>',
    ]
    for y in sorted({lo, 0.0, hi}):
        out.append(f'<text x="{LEFT - 4}" y="{py(y) + 3:.1f}" text-anchor="end">{y:.3g}</text>')
        if y == 0.0:
            out.append(
                f'<line x1="{LEFT}" y1="{py(0):.1f}" x2="{width - RIGHT}" y2="{py(0):.1f}" stroke="#bbb" '
                'stroke-dasharray="3 3"/>'
            )
    return "".join(out)


def segments(points: list[tuple]) -> list[list[tuple]]:
    """Runs of consecutive points with a finite value (a missing one breaks the line)."""
    out, run = [], []
    for x, y in points:
        if is_num(y):
            run.append((x, y))
        elif run:
            out.append(run)
            run = []
    return out + ([run] if run else [])


# ---------------------------------------------------------------------------------------------
# small helpers: numbers, text, bands, writing
# ---------------------------------------------------------------------------------------------
def is_num(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def num(x) -> str:
    """A number to 3 decimals ("-" for none); nan and inf as such."""
    if x is None:
        return "&ndash;"
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return esc(x)
    s = f"{x:.3f}"
    return "0.000" if s == "-0.000" else s


def vec(v) -> str:
    return "(" + ", ".join(num(x) for x in v) + ")" if isinstance(v, list) else num(v)


def mean(xs):
    xs = [x for x in xs if is_num(x)]
    return sum(xs) / len(xs) if xs else None


def share(flags):
    flags = [bool(f) for f in flags]
    return sum(flags) / len(flags) if flags else None


def rubric_weights(turn: dict) -> list[float] | None:
    """The rubric's (w_C, w_A, w_P) of a turn, or None when it has none."""
    w = turn.get("rubric", {}).get("weights") if isinstance(turn.get("rubric"), dict) else None
    if not isinstance(w, dict) or not all(is_num(w.get(name)) for _, name in DIMS):
        return None
    return [float(w[name]) for _, name in DIMS]


def band(e: float) -> str:
    """The user's emotion band: F < 10, C >= 10, B >= 40, A >= 70, S >= 100."""
    return next(b for b, bound in BANDS if e >= bound)


def step_id(step) -> str:
    return "step-none" if step is None else "step-" + "".join(c if c.isalnum() else "-" for c in str(step))


def step_title(step) -> str:
    return "The run (no steps)" if step is None else f"Model {step}" if isinstance(step, str) else f"Step {step}"


def step_label(step) -> str:
    return "all" if step is None else str(step)


def clean(s) -> str:
    """Text as it can be shown: control characters (not newlines or tabs) as their visible symbols, CR LF as
    LF, lone surrogates replaced."""
    s = (s if isinstance(s, str) else json.dumps(s)).replace("\r\n", "\n").replace("\r", "\n")
    s = "".join(chr(0x2400 + ord(c)) if ord(c) < 32 and c not in "\n\t" else "\u2421" if c == "\x7f" else c for c in s)
    return s.encode("utf-8", "replace").decode("utf-8")


def esc(x) -> str:
    return html.escape(str(x), quote=True)


def write_atomic(path: Path, text: str):
    """Write a temporary file in the same folder, then rename it over `path`: the page whole or not at all."""
    if not path.parent.is_dir():
        raise ViewError(f"{path.parent}: no such folder to write {path.name} in")
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        raise ViewError(f"{path}: could not write ({e.strerror or e})") from None
    finally:
        if tmp.exists():
            tmp.unlink()


PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width, initial-scale=1">
<title>{title}</title><style>{css}</style><noscript><style>.step[hidden]{{display:block}}</style></noscript></head>
<body>
{body}
<script>{script}</script>
</body></html>
"""

CSS = """
body{font-family:system-ui,-apple-system,"Segoe UI",Roboto,Helvetica,Arial,sans-serif;color:#222;max-width:1150px;
 margin:1.5rem auto;padding:0 1rem;line-height:1.4}
h1{font-size:1.4rem;margin-bottom:.2rem} h2{font-size:1.15rem;margin:1.4rem 0 .3rem} h3{font-size:1rem;margin:.2rem 0}
.meta{color:#555;margin:.2rem 0 .6rem}
table{border-collapse:collapse;font-size:.85rem;margin:.4rem 0} caption{text-align:left;font-weight:600;padding:.2rem 0}
th,td{border:1px solid #ddd;padding:2px 7px;text-align:right} th{background:#f4f4f5;font-weight:600} .l{text-align:left}
nav{position:sticky;top:0;background:#fff;padding:.5rem 0;border-bottom:1px solid #ddd;z-index:1}
.dialogue{border:1px solid #d4d4d8;border-radius:6px;padding:.6rem 1rem;margin:1rem 0}
.k{color:#555;font-weight:400} .outcome{font-size:.8rem;padding:0 .4rem;border-radius:3px;background:#e4e4e7}
.outcome.success{background:#bbf7d0} .outcome.failure,.outcome.user_failed{background:#fecaca}
.outcome.context_limit{background:#fde68a}
.charts{display:flex;flex-wrap:wrap;gap:.5rem} .pair{display:flex;flex-wrap:wrap;gap:1rem;align-items:flex-start}
svg{background:#fafafa;border:1px solid #eee} svg text{font-size:10px;font-family:inherit;fill:#333}
svg text.title{font-weight:600}
.turns{padding-left:0;list-style:none} .turn{border-left:3px solid #d4d4d8;padding:.3rem .7rem;margin:.6rem 0}
.turn.cut{border-left-color:#d97706} .turn.failed{border-left-color:#dc2626;background:#fef2f2}
.turn-head{font-size:.8rem;color:#555}
.flag{display:inline-block;font-size:.75rem;color:#fff;padding:0 .4rem;border-radius:3px;margin-left:.3rem}
.flag.cut{background:#d97706} .flag.failed{background:#dc2626}
.msg{white-space:pre-wrap;margin:.25rem 0} .who{font-weight:600;color:#666;margin-right:.5rem}
.msg.policy .text{background:#eff6ff} .msg.shown .text{background:#f5f3ff}
.nums{font-size:.82rem;color:#333} .kv{margin-right:1rem;white-space:nowrap} .kv b{color:#666;font-weight:600}
details{font-size:.8rem;color:#555} details ul{margin:.2rem 0}
"""

SCRIPT = """
var sel = document.getElementById("step-select");
function showStep() {
  document.querySelectorAll("section.step").forEach(function (s) { s.hidden = s.id !== sel.value; });
}
sel.addEventListener("change", showStep);
showStep();
"""


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description="Write one self-contained HTML page of a run's dialogues "
        "(<run>/rollouts.jsonl -> <run>/rollouts.html)."
    )
    p.add_argument("run", help="the run folder holding rollouts.jsonl (03_rollout.py's or 04_mica_train.py's)")
    p.add_argument("--out", help="where to write the page instead of <run>/rollouts.html")
    return p.parse_args(argv)


if __name__ == "__main__":
    sys.exit(main())

"""scripts/course_figures.py: the course's three pictures (docs/course.md), drawn by plots.py from the real
functions, so that they cannot drift from the code.

What it draws
  course_hinge.png        03's hinge_distance over two axes, its tolerance box (d = 0), and two moves with their
                          IDR reward (lesson 1)
  course_credit_grid.png  the worked example's scenario group (scripts/worked_example.py), dialogues x turns: which
                          cells 04's turn_level_advantages compares at turn 3 (the dialogues that reached it) and
                          which group_level_advantages pools (every reward of the group) (lesson 2)
  course_clip.png         04's clipped_surrogate against the ratio for A = +1 and A = -1, where the clip chose the
                          loss shaded (lesson 3)
  plots.py draws; this script passes it the stages' functions (a support module never imports a stage).

Reads   nothing (the functions of 03 and 04, and the worked example's dialogues)
Writes  the three PNGs into --out (default docs/img)

Usage: python scripts/course_figures.py                 (redraws docs/img/course_*.png)
       python scripts/course_figures.py --out /tmp/figs
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
import worked_example  # noqa: E402

import plots  # noqa: E402

env = importlib.import_module("03_rollout")  # the hinge distance and its tolerance eps
trainer = importlib.import_module("04_mica_train")  # the returns, the estimators' terms, the clipped surrogate

# the moves of lesson 1's picture, (C, A, P) with P = 0: a reply that gains (1, 3) far from the goal, one that
# overshoots into the box, one inside the box
MOVES = [
    ([-6.0, -6.0, 0.0], [-5.0, -3.0, 0.0]),
    ([-2.0, -3.0, 0.0], [1.0, 0.0, 0.0]),
    ([1.5, -0.5, 0.0], [2.5, 1.5, 0.0]),
]
TURN = 3  # the turn of the credit grid: dialogue k = 1 ended at turn 2, so A_turn compares the other three


def surrogate_at(ratios: list[float], A: float) -> tuple[list[float], list[float]]:
    """04's clipped_surrogate at these ratios (log pi_old = 0) and one advantage A -> (losses, clipped flags)."""
    logp = torch.log(torch.tensor(ratios))
    advantages = torch.full_like(logp, A)
    loss, clipped, _ = trainer.clipped_surrogate(
        logp, torch.zeros_like(logp), advantages, trainer.CLIP_LOW, trainer.CLIP_HIGH
    )
    return loss.tolist(), clipped.tolist()


def draw(out: Path) -> dict[str, dict]:
    """The three pictures into out; {file name: the numbers plots drew}."""
    out.mkdir(parents=True, exist_ok=True)
    example = worked_example.worked_example()
    rewards, gamma = example["rewards"], example["args"].gamma
    return {
        "course_hinge.png": plots.hinge_box(out / "course_hinge.png", env.hinge_distance, env.EPS, MOVES),
        "course_credit_grid.png": plots.credit_grid(
            out / "course_credit_grid.png",
            rewards,
            gamma,
            trainer.discounted_returns,
            trainer.turn_level_advantages,
            trainer.group_level_advantages,
            TURN,
        ),
        "course_clip.png": plots.clip_surrogate(
            out / "course_clip.png", surrogate_at, trainer.CLIP_LOW, trainer.CLIP_HIGH
        ),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="The course's three pictures, drawn from the real functions.")
    p.add_argument("--out", default=str(ROOT / "docs" / "img"), help="the folder to write them to")
    args = p.parse_args(argv)
    for name in draw(Path(args.out)):
        print(Path(args.out) / name)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""parallel.py: data-parallel, the only places where processes talk (`accelerate launch --num_processes N`).

On one process each helper does nothing: sum_over_processes returns its tensors, gather_over_processes [obj].
  sum_over_processes         tensors summed over the processes (one flat all-reduce): N, the gradient, the sums
  gather_over_processes      every process's object, in process order: records, counts, the run folder
  advantages_over_processes  an estimator over every process's scenario groups (a batch-wide statistic sees all)
  split_minibatches          this process's share of each minibatch, whole scenarios, in the step's order
  check_processes            the flags that make those shares whole
04 calls them; accelerate carries the collectives (tests/test_layout.py: none outside these helpers).
Imports common.py (its one-line errors).
"""

from __future__ import annotations

import torch
from accelerate.utils import gather_object

import common


def sum_over_processes(accelerator, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each tensor summed over the processes (one flat all-reduce); on one process the tensors as they are."""
    if accelerator.num_processes == 1:
        return tensors
    flat = accelerator.reduce(torch.cat([t.reshape(-1).to(accelerator.device) for t in tensors]), "sum")
    return [x.view_as(t).to(t.device) for x, t in zip(flat.split([t.numel() for t in tensors]), tensors)]


def gather_over_processes(accelerator, obj) -> list:
    """[every process's obj], in process order; on one process [obj]."""
    return gather_object([obj]) if accelerator.num_processes > 1 else [obj]


def advantages_over_processes(accelerator, estimator, rewards, dialogues, args) -> tuple[list, dict]:
    """An advantage estimator over every process's scenario groups at once (a batch-wide statistic, such as
    REINFORCE++'s, sees the whole batch) -> this process's groups of A and of the terms."""
    everyone = gather_over_processes(accelerator, (rewards, dialogues))
    A, A_terms = estimator(
        [group for part, _ in everyone for group in part], [group for _, part in everyone for group in part], args
    )
    first = sum(len(part) for part, _ in everyone[: accelerator.process_index])
    mine = slice(first, first + len(rewards))
    return A[mine], {name: value[mine] for name, value in A_terms.items()}


def split_minibatches(samples, args, accelerator) -> list[list[int]]:
    """The samples (scenario by scenario, K each, in the step's seeded order) cut in that order into this
    process's share of each minibatch of --minibatch-size dialogues. --minibatch-size is a multiple of K, so a
    minibatch holds whole scenarios, as MICA's verl launch splits a batch. A dialogue with nothing to score is
    left out. Every process gets as many minibatches (empty ones where it has run out)."""
    size = args.minibatch_size // accelerator.num_processes
    out = [
        [i for i in range(j, min(j + size, len(samples))) if samples[i].n_tokens() > 0]
        for j in range(0, len(samples), size)
    ]
    return out + [[] for _ in range(max(gather_over_processes(accelerator, len(out))) - len(out))]


def check_processes(args, accelerator, n_scenarios: int):
    """Data-parallel: each process takes its own scenarios and its own whole scenarios of every minibatch."""
    n = accelerator.num_processes
    common.check(
        min(args.scenarios_per_step, n_scenarios) >= n,
        f"--scenarios-per-step must be >= the number of processes ({n}): each takes its own",
    )
    common.check(
        args.minibatch_size % (args.k * n) == 0,
        f"--minibatch-size must be a multiple of --k x the number of processes ({args.k} x {n}): each process's "
        "share holds whole scenarios",
    )

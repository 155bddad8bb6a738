"""parallel.py: data-parallel, the only places where processes talk (`accelerate launch --num_processes N`).

On one process each helper does nothing: sum_over_processes returns its tensors, gather_over_processes [obj].
  sum_over_processes         tensors summed over the processes (one flat all-reduce): N, the gradient, the sums
  gather_over_processes      every process's object, in process order: records, counts, the run folder
  gather_groups              every process's scenario groups, for the estimator (a batch-wide statistic sees all)
  as_many_minibatches        every process as many minibatches (empty ones where it has run out)
  on_main_process            a call on process 0 while the others wait, its result to all (the engine's adapter push)
  check_processes            the flags that make those shares whole
04 calls them; accelerate carries the collectives (tests/test_layout.py: none outside these helpers).
Imports common.py (its one-line errors).
"""

from __future__ import annotations

import torch
from accelerate.utils import broadcast_object_list, gather_object

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


def gather_groups(accelerator, rewards, dialogues) -> tuple[list, list, slice]:
    """Every process's scenario groups, in process order (so that a batch-wide statistic, such as REINFORCE++'s,
    sees the whole batch), and where this process's groups are among them; on one process its own and all."""
    everyone = gather_over_processes(accelerator, (rewards, dialogues))
    first = sum(len(part) for part, _ in everyone[: accelerator.process_index])
    all_rewards = [group for part, _ in everyone for group in part]
    all_dialogues = [group for _, part in everyone for group in part]
    return all_rewards, all_dialogues, slice(first, first + len(rewards))


def as_many_minibatches(accelerator, minibatches: list[list[int]]) -> list[list[int]]:
    """Every process gets as many minibatches, empty ones where it has run out (each optimizer step all-reduces)."""
    most = max(gather_over_processes(accelerator, len(minibatches)))
    return minibatches + [[] for _ in range(most - len(minibatches))]


def on_main_process(accelerator, fn, *args):
    """fn(*args) on process 0 while the others wait for it -> its result, on every process (the engine's adapter
    push: one process loads it, and every process samples from the name it was loaded under)."""
    result = fn(*args) if accelerator.is_main_process else None
    if accelerator.num_processes == 1:
        return result
    return broadcast_object_list([result], from_process=0)[0]


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

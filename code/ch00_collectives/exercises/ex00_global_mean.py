# Yours to fill in (generated from ../solutions/ex00_global_mean.py).
"""Exercise 00.2: the exact mean over all ranks when ranks hold different amounts.

    code/run_w_torchrun.sh 2 ch00_collectives/exercises/ex00_global_mean.py

Rank r holds 3 + 2r per-sample losses. Compute (a) the average of the per-rank means and
(b) the mean over every sample of every rank, each with a single all_reduce, and compare both
with the single-process reference the script computes. Fill in the TODOs (each todo() call
stops the run and says what is missing; delete it once your code is there). Predict first: do
(a) and (b) agree? `make exercise EX=00.2` checks yours at 2 and 3 ranks.
Solution, with the answer: ../solutions/ex00_global_mean.py.
"""
import argparse

import torch
import torch.distributed as dist

from distkit import print0, print_ranks, setup, teardown, todo, write_json


def losses_of(rank):  # the same numbers on every run, different on every rank
    g = torch.Generator().manual_seed(rank)
    return torch.rand(3 + 2 * rank, generator=g, dtype=torch.float64)


parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--json", help="write the three means here (rank 0)")
args = parser.parse_args()

env = setup()
mine = losses_of(env.rank)
print_ranks(f"{mine.numel()} samples, local mean {mine.mean():.4f}")

# TODO(you): a tensor on env.device holding the mean of the N ranks' local means, on every rank.
# Look up: dist.all_reduce (it sums in place).
todo("(a) mean_of_means: the average of the per-rank means, one all_reduce")

# TODO(you): a float: the sum of every rank's samples over how many there are in all. What must the
# one all_reduce add up, so that every rank can divide? (torch.stack builds one tensor.)
todo("(b) exact: the mean over all samples of all ranks, one all_reduce")

# The single-process references: every sample in one place, and every rank's mean.
reference = torch.cat([losses_of(r) for r in range(env.world_size)]).mean().item()
reference_means = torch.stack([losses_of(r).mean() for r in range(env.world_size)]).mean().item()
print0(f"mean of per-rank means: {mean_of_means.item():.6f} (single process: "
       f"{reference_means:.6f})")
print0(f"all_reduce([sum, count]): {exact:.6f}")
print0(f"single process, all samples: {reference:.6f}")
write_json(args.json, {"mean_of_means": mean_of_means.item(), "exact": exact,
                       "reference": reference, "reference_mean_of_means": reference_means})
teardown()

"""Exercise 00.2 (starter): the exact mean over all ranks when ranks hold different amounts.

    code/run_w_torchrun.sh 2 ch00_collectives/exercises/ex00_global_mean.py

Rank r holds 3 + 2r per-sample losses. Compute (a) the average of the per-rank means and
(b) the mean over every sample of every rank, each with a single all_reduce, and compare both
with the single-process reference the script computes. Fill in the TODOs (each todo() call
stops the run and says what is missing; delete it once your code is there).
Solution: ../solutions/ex00_global_mean.py.
"""
import argparse

import torch
import torch.distributed as dist

from distkit import print0, print_ranks, setup, teardown, todo


def losses_of(rank):  # the same numbers on every run, different on every rank
    g = torch.Generator().manual_seed(rank)
    return torch.rand(3 + 2 * rank, generator=g, dtype=torch.float64)


parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.parse_args()

env = setup()
mine = losses_of(env.rank)
print_ranks(f"{mine.numel()} samples, local mean {mine.mean():.4f}")

# TODO (a): all_reduce this rank's mean, divide by the number of ranks.
mean_of_means = todo("(a) mean_of_means: the average of the per-rank means, one all_reduce")
# TODO (b): one all_reduce that gives the exact mean of all samples (what must it sum?).
exact = todo("(b) exact: the mean over all samples of all ranks, one all_reduce")

# The single-process reference: every sample in one place.
reference = torch.cat([losses_of(r) for r in range(env.world_size)]).mean().item()
print0(f"mean of per-rank means: {mean_of_means:.6f}")
print0(f"your exact mean: {exact:.6f}")
print0(f"single process, all samples: {reference:.6f}")
teardown()

"""Exercise 00.2 solution: the exact mean over all ranks when ranks hold different amounts.

    code/run_w_torchrun.sh 2 ch00_collectives/solutions/ex00_global_mean.py

Rank r holds 3 + 2r per-sample losses. Averaging the per-rank means (all_reduce of the mean,
divided by N) weighs a small rank's samples more; one all_reduce of [sum, count] is exact.
"""
import argparse

import torch
import torch.distributed as dist

from distkit import print0, print_ranks, setup, teardown, write_json


def losses_of(rank):  # the same numbers on every run, different on every rank
    g = torch.Generator().manual_seed(rank)
    return torch.rand(3 + 2 * rank, generator=g, dtype=torch.float64)


parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--json", help="write the three means here (rank 0)")
args = parser.parse_args()

env = setup()
mine = losses_of(env.rank)
print_ranks(f"{mine.numel()} samples, local mean {mine.mean():.4f}")

mean_of_means = mine.mean().to(env.device)
dist.all_reduce(mean_of_means)
mean_of_means /= env.world_size  # wrong when counts differ

stats = torch.stack([mine.sum(), torch.tensor(float(mine.numel()), dtype=torch.float64)])
stats = stats.to(env.device)
dist.all_reduce(stats)  # [global sum, global count] in one collective
exact = (stats[0] / stats[1]).item()

# The single-process reference: every sample in one place.
reference = torch.cat([losses_of(r) for r in range(env.world_size)]).mean().item()
print0(f"mean of per-rank means: {mean_of_means.item():.6f}")
print0(f"all_reduce([sum, count]): {exact:.6f}")
print0(f"single process, all samples: {reference:.6f}")
write_json(args.json, {"mean_of_means": mean_of_means.item(), "exact": exact,
                       "reference": reference})
teardown()

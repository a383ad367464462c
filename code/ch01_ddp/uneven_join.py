"""Uneven inputs: rank r has 3 + 2r batches, and DDP's Join keeps the group together.

    code/run_w_torchrun.sh 2 ch01_ddp/uneven_join.py            # with Join: finishes
    code/run_w_torchrun.sh 2 ch01_ddp/uneven_join.py --no-join  # without: fails at the timeout

Without Join, a rank with an extra batch calls an all-reduce in backward that no other rank
joins, and waits until the process group's timeout. With Join, the ranks that ran out "shadow"
the others' collectives, contributing zero gradients. By default (divide_by_initial_world_size
=True) the sum is still divided by the initial world size N, so a lone rank's step uses its
gradient / N; with False, DDP divides by the number of ranks still training.
"""
import argparse
import copy
from contextlib import nullcontext

import torch
import torch.nn as nn
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as DDP

from distkit import print0, print_ranks, seed_everything, setup, teardown

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--no-join", action="store_true", help="leave out Join (and fail)")
args = parser.parse_args()

env = setup()
batches = 3 + 2 * env.rank  # uneven on purpose


def train(divide_by_initial_world_size: bool) -> list[float]:
    """Train with Join; return, for each step, |synced gradient| / |this rank's own gradient|."""
    seed_everything(0)
    model = DDP(nn.Linear(4, 3).to(env.device))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(env.rank)
    ratios = []
    join = nullcontext() if args.no_join else Join(
        [model], divide_by_initial_world_size=divide_by_initial_world_size)
    with join:
        for _ in range(batches):
            x = torch.randn(8, 4, generator=g).to(env.device)
            y = torch.randint(0, 3, (8,), generator=g).to(env.device)
            local = copy.deepcopy(model.module)  # this rank's gradient alone, for comparison
            nn.functional.cross_entropy(local(x), y).backward()
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()  # all-reduce: needs a partner on every rank
            ratios.append((model.module.weight.grad.norm() / local.weight.grad.norm()).item())
            optimizer.step()
            optimizer.zero_grad()
    return ratios


# Without Join, one run is enough to fail: a second would start with DDP's constructor, whose
# own collectives (a parameter-shape check, the weight broadcast) rank 0 would wait in instead.
ratios = {flag: train(flag) for flag in ((True,) if args.no_join else (True, False))}
# print_ranks is itself a collective (gather_object): without Join, rank 0 waits in it
print_ranks(f"ran {batches} steps")
print0("all ranks finished")
for flag, r in ratios.items():
    alone = r[3:]  # rank N-1's steps after the others ran out
    print_ranks(f"divide_by_initial_world_size={flag}: steps alone: {len(alone)}, "
                f"|synced grad| / |own grad| = {', '.join(f'{v:.2f}' for v in alone) or '-'}")
teardown()

"""Uneven inputs: rank r has 3 + 2r batches. DDP's Join lets the ranks that finish early keep
answering the others' all-reduces (with zeros), so nobody waits forever.

    code/run_w_torchrun.sh 2 ch01_ddp/uneven_join.py            # with Join: finishes
    code/run_w_torchrun.sh 2 ch01_ddp/uneven_join.py --no-join  # without: fails (or hangs until timeout)
"""
import argparse
from contextlib import nullcontext

import torch
import torch.nn as nn
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as DDP

from distkit import print0, print_ranks, seed_everything, setup, teardown

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--no-join", action="store_true", help="leave out Join (and fail)")
args = parser.parse_args()

env = setup()
seed_everything(0)
model = DDP(nn.Linear(4, 3).to(env.device))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
batches = 3 + 2 * env.rank  # uneven on purpose
g = torch.Generator().manual_seed(env.rank)

with nullcontext() if args.no_join else Join([model]):
    for step in range(batches):
        x = torch.randn(8, 4, generator=g).to(env.device)
        y = torch.randint(0, 3, (8,), generator=g).to(env.device)
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()  # all-reduce: needs a partner on every rank
        optimizer.step()
        optimizer.zero_grad()

print_ranks(f"ran {batches} steps")
print0("all ranks finished")
teardown()

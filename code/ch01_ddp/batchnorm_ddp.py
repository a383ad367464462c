"""BatchNorm under DDP normalises with each rank's own batch, not the global one.

    code/run_w_torchrun.sh 2 ch01_ddp/batchnorm_ddp.py

Every rank can compute the single-process reference itself (the data are generated), so the
script compares, on every rank: the batch statistics BatchNorm used, the running mean it keeps,
and the global statistics that one all_reduce of [sum, sum of squares, count] gives: exactly
what nn.SyncBatchNorm computes. SyncBatchNorm itself runs under DDP only on CUDA.
"""
import argparse

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from distkit import print0, print_ranks, seed_everything, setup, teardown, write_json

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--batch-size", type=int, default=8, help="samples per rank")
parser.add_argument("--json", help="write the differences here (rank 0)")
args = parser.parse_args()
if args.batch_size < 2:
    parser.error("--batch-size must be at least 2 (BatchNorm needs a batch)")

env = setup()
n, b = env.world_size, args.batch_size
g = torch.Generator().manual_seed(0)
# Ranks get differently distributed data, as with any non-iid shard: rank r's mean is about r.
x_all = torch.cat([torch.randn(b, 4, generator=g) + r for r in range(n)])
x = x_all[env.rank * b:(env.rank + 1) * b].to(env.device)


def make_model():
    seed_everything(0)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 1))


reference = make_model()
reference(x_all)  # one process, the whole global batch: the statistics we want
ref_mean = reference[1].running_mean.clone()
ref_batch_mean = reference[0](x_all).mean(0)

model = DDP(make_model().to(env.device))
h = model.module[0](x)  # what BatchNorm sees on this rank
model(x)
local_gap = (h.mean(0).cpu() - ref_batch_mean).abs().max().item()
running_gap = (model.module[1].running_mean.cpu() - ref_mean).abs().max().item()

# The fix, by hand: one all_reduce of [sum, sum of squares, count] gives global statistics.
stats = torch.cat([h.sum(0), (h * h).sum(0), torch.tensor([float(b)], device=env.device)])
dist.all_reduce(stats)
global_mean = stats[:8] / stats[-1]
synced_gap = (global_mean.detach().cpu() - ref_batch_mean).abs().max().item()

print_ranks(f"batch mean used by BatchNorm vs global: max |diff| = {local_gap:.3f}; "
            f"running_mean vs single process: {running_gap:.3f}; "
            f"all-reduced mean vs global: {synced_gap:.1e}")

if env.device.type == "cuda":  # the real thing
    synced = DDP(nn.SyncBatchNorm.convert_sync_batchnorm(make_model()).to(env.device),
                 device_ids=[env.device.index])
    synced(x)
    sync_gap = (synced.module[1].running_mean.cpu() - ref_mean).abs().max().item()
    print0(f"nn.SyncBatchNorm running_mean vs single process: max |diff| = {sync_gap:.1e}")
else:
    sync_gap = None
    print0("nn.SyncBatchNorm under DDP needs CUDA (on CPU DDP raises 'SyncBatchNorm layers "
           "only work with GPU modules'): skipped here; the all_reduce above is what it computes.")
gaps = [None] * n
dist.all_gather_object(gaps, (local_gap, running_gap, synced_gap))
write_json(args.json, {"local_gap": [a for a, _, _ in gaps], "running_gap": [r for _, r, _ in gaps],
                       "synced_gap": [s for _, _, s in gaps], "sync_batchnorm_gap": sync_gap})
teardown()

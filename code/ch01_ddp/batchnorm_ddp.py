"""BatchNorm under DDP: each rank normalises with its own batch, and DDP overwrites every rank's
running statistics with rank 0's at the start of each training forward.

    code/run_w_torchrun.sh 2 ch01_ddp/batchnorm_ddp.py

Every rank can compute the single-process reference itself (the data are generated), so the
script compares, on every rank:
1. the batch statistics BatchNorm used against those of the global batch;
2. the global statistics combined from every rank's [mean, variance, count], all-gathered (counts
   may differ between ranks, so an all_reduce of means would be wrong). nn.SyncBatchNorm
   gathers [mean, invstd, count] to the same effect; in training mode with a process group it
   refuses CPU tensors in its own forward, so on CPU the script does the combination by hand;
3. DDP's buffer sync (forward_sync_buffers, on by default; the deprecated broadcast_buffers=False
   also skipped the broadcast at construction): at the start of every forward that follows a
   synchronised backward, rank 0's buffers (here BatchNorm's running_mean) are broadcast.
"""
import argparse

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from distkit import print0, print_ranks, seed_everything, setup, teardown, write_json

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--batch-size", type=int, default=8,
                    help="samples on rank 0; rank r has batch-size + 2r (uneven on purpose)")
parser.add_argument("--json", help="write the differences here (rank 0)")
args = parser.parse_args()
if args.batch_size < 2:
    parser.error("--batch-size must be at least 2 (BatchNorm needs a batch)")

env = setup()
n = env.world_size
sizes = [args.batch_size + 2 * r for r in range(n)]
g = torch.Generator().manual_seed(0)
# Non-iid shards, as often in practice: rank r's features are shifted by about r.
shards = [torch.randn(b, 4, generator=g) + r for r, b in enumerate(sizes)]
x = shards[env.rank].to(env.device)
x_all = torch.cat(shards)


def make_model():
    seed_everything(0)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 1))


reference = make_model()  # one process, the whole global batch: the statistics we want
h_all = reference[0](x_all).detach()
ref_mean, ref_var = h_all.mean(0), h_all.var(0, unbiased=False)

model = DDP(make_model().to(env.device))
h = model.module[0](x).detach()  # what BatchNorm sees on this rank
local_gap = (h.mean(0).cpu() - ref_mean).abs().max().item()

# 2. What nn.SyncBatchNorm computes, by hand: gather [mean, var, count] from every rank.
mine = torch.cat([h.mean(0), h.var(0, unbiased=False), torch.tensor([float(len(h))],
                                                                    device=env.device)])
gathered = [torch.empty_like(mine) for _ in range(n)]
dist.all_gather(gathered, mine)
stats = torch.stack(gathered).cpu()
mean_r, var_r, count_r = stats[:, :8], stats[:, 8:16], stats[:, 16:]
global_mean = (count_r * mean_r).sum(0) / count_r.sum()
# total variance = mean of the variances + variance of the means (both weighted by count)
global_var = (count_r * (var_r + (mean_r - global_mean) ** 2)).sum(0) / count_r.sum()
synced_gap = max((global_mean - ref_mean).abs().max().item(),
                 (global_var - ref_var).abs().max().item())
print_ranks(f"{len(h)} samples: batch mean BatchNorm used vs global batch: max |diff| = "
            f"{local_gap:.2f}; gathered [mean, var, count] vs global: < 1e-5: {synced_gap < 1e-5}")

try:  # the real layer
    nn.SyncBatchNorm(8).to(env.device)(h)
    print0("nn.SyncBatchNorm ran on", env.device)
except ValueError as e:
    print0(f"nn.SyncBatchNorm on {env.device.type}: ValueError: {e}")


# 3. DDP's buffer sync: at the start of forward 2, is this rank's running_mean rank 0's?
def running_mean_at_forward_2(sync: bool) -> bool:
    ddp = DDP(make_model().to(env.device), forward_sync_buffers=sync)
    ddp(x)  # forward 1: each rank updates running_mean from its own batch
    rank0_after_1 = ddp.module[1].running_mean.clone()
    dist.broadcast(rank0_after_1, src=0)  # rank 0's values, on every rank
    seen = []
    hook = ddp.module[1].register_forward_pre_hook(
        lambda mod, inp: seen.append(mod.running_mean.clone()))
    ddp(x)  # forward 2: DDP syncs buffers first (if asked), then BatchNorm runs
    hook.remove()
    return torch.equal(seen[0], rank0_after_1)


synced = {sync: running_mean_at_forward_2(sync) for sync in (True, False)}
print_ranks(f"at forward 2 running_mean == rank 0's: {synced[True]} with "
            f"forward_sync_buffers=True (default), {synced[False]} with False")

every = [None] * n
dist.all_gather_object(every, (local_gap, synced_gap, synced))
write_json(args.json, {"sizes": sizes, "local_gap": [a for a, _, _ in every],
                       "synced_gap": [s for _, s, _ in every],
                       "rank0_buffers": [{str(k): v for k, v in b.items()} for _, _, b in every]})
teardown()

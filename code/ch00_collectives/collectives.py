"""Every collective, run for real: each rank's tensor before and after, printed in rank order.

    code/run_w_torchrun.sh 2 ch00_collectives/collectives.py --op all_reduce,all_gather
    code/run_w_torchrun.sh 4 ch00_collectives/collectives.py --op all --json /tmp/collectives.json

Rank r starts with x = [10r, 10r+1, ..., 10r+N-1] (N = world size), so every number says where
it came from: its tens digit is the rank that owned it, its last digit its position.
"""
import argparse
import os
import time

import torch
import torch.distributed as dist

from distkit import print0, print_ranks, setup, teardown, write_json


def start(rank, n):
    return torch.arange(n) + 10 * rank


def broadcast(x, rank, n):  # rank 0's tensor overwrites everyone's
    dist.broadcast(x, src=0)
    return x


def scatter(x, rank, n):  # rank 0 hands element i of its tensor to rank i
    out = torch.empty(1, dtype=x.dtype, device=x.device)
    dist.scatter(out, list(x.chunk(n)) if rank == 0 else None, src=0)
    return out


def reduce(x, rank, n):  # sum lands on rank 0 only; the others keep a partial result
    dist.reduce(x, dst=0, op=dist.ReduceOp.SUM)
    return x


def gather(x, rank, n):  # rank 0 receives everyone's tensor
    outs = [torch.empty_like(x) for _ in range(n)] if rank == 0 else None
    dist.gather(x, outs, dst=0)
    return torch.cat(outs) if rank == 0 else x


def all_reduce(x, rank, n):  # everyone gets the sum: DDP's gradient averaging
    dist.all_reduce(x, op=dist.ReduceOp.SUM)
    return x


def all_gather(x, rank, n):  # everyone gets everyone's tensor: FSDP's parameter unsharding
    out = torch.empty(n * x.numel(), dtype=x.dtype, device=x.device)
    dist.all_gather_single(out, x)  # formerly all_gather_into_tensor
    return out


def reduce_scatter(x, rank, n):  # everyone gets one slice of the sum: FSDP's gradient sharding
    out = torch.empty(x.numel() // n, dtype=x.dtype, device=x.device)
    dist.reduce_scatter_single(out, x, op=dist.ReduceOp.SUM)  # formerly reduce_scatter_tensor
    return out


def all_to_all(x, rank, n):  # element j of rank i goes to rank j, position i: a transpose
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x)
    return out


def send_recv(x, rank, n):  # point to point: rank 0 sends, rank 1 receives, the rest idle
    if rank == 0:
        dist.send(x, dst=1)
    elif rank == 1:
        dist.recv(x, src=0)
    return x


def barrier(x, rank, n):
    """No data moves: nobody leaves until everybody has arrived. Rank r arrives r*0.3 s late."""
    time.sleep(0.3 * rank)
    arrived = time.time()
    dist.barrier()
    left = time.time()
    times = [None] * n
    dist.all_gather_object(times, (arrived, left))
    last_arrival = max(a for a, _ in times)
    # 50 ms of slack: leaving takes a moment; what matters is nobody left before the last came
    return torch.tensor([int(left >= last_arrival - 0.05)])


OPS = {f.__name__: f for f in (broadcast, scatter, reduce, gather, all_reduce, all_gather,
                               reduce_scatter, all_to_all, send_recv, barrier)}

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--op", default="all",
                    help=f"comma-separated, from: {', '.join(OPS)}; or 'all'")
parser.add_argument("--json", help="write before/after values of every rank here (rank 0)")
args = parser.parse_args()
ops = list(OPS) if args.op == "all" else args.op.split(",")
unknown = [o for o in ops if o not in OPS]
if unknown:
    parser.error(f"unknown --op {', '.join(unknown)}; choose from {', '.join(OPS)}")
# torchrun set WORLD_SIZE already: checked before joining the group, every rank stops alike.
if int(os.environ.get("WORLD_SIZE", 2)) < 2:
    parser.error("needs at least 2 processes (NPROC >= 2): a collective needs someone to talk to")

env = setup()
results = {}
for op in ops:
    x = start(env.rank, env.world_size).to(env.device)
    before = x.tolist()
    after = OPS[op](x, env.rank, env.world_size).tolist()
    print0(f"== {op} ==")
    if op == "barrier":
        print_ranks(f"slept {0.3 * env.rank:.1f} s; left only after the last rank arrived: "
                    f"{bool(after[0])}")
    else:
        print_ranks(f"before {before}  ->  after {after}")
    gathered = [None] * env.world_size
    dist.all_gather_object(gathered, (before, after))
    results[op] = {"before": [b for b, _ in gathered], "after": [a for _, a in gathered]}
write_json(args.json, {"world_size": env.world_size, "ops": results})
teardown()

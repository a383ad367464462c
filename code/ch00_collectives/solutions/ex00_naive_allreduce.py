"""Exercise 00.1 solution: all-reduce through rank 0 (a "parameter server"), bytes counted.

    code/run_w_torchrun.sh 4 ch00_collectives/solutions/ex00_naive_allreduce.py

Everyone sends its tensor to rank 0, rank 0 sums and sends the result back. Correct, but rank 0's
link carries (N-1)*S in and (N-1)*S out, growing with N, while in a ring every rank sends
2(N-1)/N*S < 2S however many ranks there are.
"""
import argparse

import torch
import torch.distributed as dist

from distkit import print0, print_ranks, seed_everything, setup, teardown, write_json

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--numel", type=int, default=2**18, help="float32 elements per rank")
parser.add_argument("--json", help="write bytes sent/received per rank here (rank 0)")
args = parser.parse_args()
if args.numel < 1:
    parser.error(f"--numel must be positive, got {args.numel}")

env = setup()
rank, n = env.rank, env.world_size
seed_everything(rank)
x = torch.randn(args.numel, device=env.device)
size = x.numel() * x.element_size()
expected = x.clone()
dist.all_reduce(expected)

sent = received = 0
if rank == 0:
    total = x.clone()
    for src in range(1, n):  # gather: N-1 tensors arrive at rank 0
        buf = torch.empty_like(x)
        dist.recv(buf, src=src)
        received += size
        total += buf
    for dst in range(1, n):  # broadcast back: N-1 tensors leave rank 0
        dist.send(total, dst=dst)
        sent += size
else:
    dist.send(x, dst=0)
    sent += size
    total = torch.empty_like(x)
    dist.recv(total, src=0)
    received += size

torch.testing.assert_close(total, expected)
print0(f"S = {size:,} bytes, N = {n}; ring: every rank sends 2(N-1)/N*S = "
       f"{2 * (n - 1) / n * size:,.0f}")
print_ranks(f"sent {sent:,} received {received:,} bytes ({sent / size:.0f} S out, {received / size:.0f} S in)")
print0("result == dist.all_reduce: True")
counts = [None] * n
dist.all_gather_object(counts, (sent, received))
write_json(args.json, {"world_size": n, "bytes": size, "sent": [s for s, _ in counts],
                       "received": [r for _, r in counts]})
teardown()

"""A ring all-reduce written by hand from send/recv, counting every byte it sends.

    code/run_w_torchrun.sh 2 ch00_collectives/ring_allreduce.py --numel 1048576

The tensor is cut into N chunks. Reduce-scatter: in N-1 steps each rank passes one chunk to its
right neighbour and adds the chunk arriving from its left, until rank r owns the full sum of
chunk r+1. All-gather: in N-1 more steps the finished chunks travel once around the ring.
Each rank sends 2(N-1) chunks of S/N bytes: 2(N-1)/N * S, whatever N is (Patarasuk & Yuan 2009;
the algorithm NCCL and gloo use for large messages).
"""
import argparse

import torch
import torch.distributed as dist

from distkit import print0, print_ranks, seed_everything, setup, teardown, write_json


def ring_all_reduce(x: torch.Tensor) -> tuple[torch.Tensor, int, list]:
    """Sum x over all ranks, in place. Returns (x, bytes this rank sent, chunks it sent per step)."""
    rank, n = dist.get_rank(), dist.get_world_size()
    right, left = (rank + 1) % n, (rank - 1) % n
    chunks = list(x.view(-1).tensor_split(n))  # views: writing a chunk writes x
    sent, schedule = 0, []

    def exchange(send_idx, recv_idx):
        nonlocal sent
        incoming = torch.empty_like(chunks[recv_idx])
        # Post send and receive together: if every rank did a blocking send first,
        # all would wait for a receiver forever.
        reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, chunks[send_idx], right),
                                       dist.P2POp(dist.irecv, incoming, left)])
        for req in reqs:
            req.wait()
        sent += chunks[send_idx].numel() * chunks[send_idx].element_size()
        schedule.append(send_idx)
        return incoming

    for step in range(n - 1):  # reduce-scatter
        send_idx, recv_idx = (rank - step) % n, (rank - step - 1) % n
        chunks[recv_idx] += exchange(send_idx, recv_idx)
    for step in range(n - 1):  # all-gather: rank owns the finished chunk rank+1
        send_idx, recv_idx = (rank - step + 1) % n, (rank - step) % n
        chunks[recv_idx].copy_(exchange(send_idx, recv_idx))
    return x, sent, schedule


parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--numel", type=int, default=2**20, help="float32 elements per rank")
parser.add_argument("--json", help="write measured and theoretical bytes here (rank 0)")
args = parser.parse_args()
if args.numel < 1:
    parser.error(f"--numel must be positive, got {args.numel}")

env = setup()
n = env.world_size
seed_everything(env.rank)  # different data on every rank
x = torch.randn(args.numel, device=env.device)
size = x.numel() * x.element_size()

expected = x.clone()
dist.all_reduce(expected)  # torch's own all-reduce, the reference
ours, sent, schedule = ring_all_reduce(x.clone())

theory = 2 * (n - 1) / n * size
# Same sums, added in a different order: equal up to float32 rounding.
torch.testing.assert_close(ours, expected)
max_diff = (ours - expected).abs().max().item()
print0(f"all-reduce of S = {size:,} bytes ({args.numel:,} float32) on N = {n} ranks")
print_ranks(f"sent {sent:,} bytes in {len(schedule)} steps (chunks {schedule}); "
            f"theory 2(N-1)/N*S = {theory:,.0f}")
print0(f"hand-written ring == dist.all_reduce (torch.testing.assert_close): True "
       f"(max |diff| = {max_diff:.0e})")
all_sent = [None] * n
dist.all_gather_object(all_sent, (sent, schedule))
write_json(args.json, {"world_size": n, "bytes": size, "theory_sent": theory,
                       "sent": [s for s, _ in all_sent], "schedule": [c for _, c in all_sent]})
teardown()

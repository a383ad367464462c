"""A ring all-reduce written by hand from send/recv, counting every byte it sends.

    code/run_w_torchrun.sh 2 ch00_collectives/ring_allreduce.py --numel 1048576

The tensor is cut into N chunks. Reduce-scatter: in N-1 steps each rank passes one chunk to its
right neighbour and adds the chunk arriving from its left, until rank r owns the full sum of
chunk r+1. All-gather: in N-1 more steps the finished chunks travel once around the ring.
Each rank sends 2(N-1) chunks of about S/N bytes: 2(N-1)/N * S, whatever N is (Patarasuk & Yuan
2009; the algorithm NCCL and gloo use for large messages). When N does not divide the tensor,
the chunks differ by one element and the exact count is sent_bytes() below.
"""
import argparse
import os

import torch
import torch.distributed as dist

from distkit import print0, print_ranks, seed_everything, setup, teardown, write_json


def ring_all_reduce(x: torch.Tensor) -> tuple[torch.Tensor, int, list]:
    """Sum x over all ranks, in place. Returns (x, bytes this rank sent, chunks it sent per
    step)."""
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


def sent_bytes(numel: int, n: int, rank: int, element_size: int = 4) -> int:
    """Exactly what ring_all_reduce sends from `rank`, for any numel >= n.

    tensor_split gives the first numel % n chunks one element more than the others. Rank r
    sends every chunk twice except chunk r+1 (which it finishes in the reduce-scatter) and
    chunk r+2 (the one it receives last in the all-gather): 2*numel - c[r+1] - c[r+2] elements.
    Summed over the ranks that is exactly 2(N-1)*numel: each chunk is sent N-1 times per phase.
    """
    q, extra = divmod(numel, n)
    chunk = [q + (i < extra) for i in range(n)]
    return (2 * numel - chunk[(rank + 1) % n] - chunk[(rank + 2) % n]) * element_size


parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--numel", type=int, default=2**20,
                    help="float32 elements per rank; at least the number of processes")
parser.add_argument("--json", help="write measured and theoretical bytes here (rank 0)")
args = parser.parse_args()
# torchrun set WORLD_SIZE already: check it before joining the group, so every rank stops
# with the same one-line error instead of some of them waiting in a collective.
world_size = int(os.environ.get("WORLD_SIZE", 1))
if args.numel < world_size:
    parser.error(f"--numel must be at least the number of processes ({world_size}): "
                 f"one chunk per rank, got {args.numel}")

env = setup()
n = env.world_size
seed_everything(env.rank)  # different data on every rank
x = torch.randn(args.numel, device=env.device)
size = x.numel() * x.element_size()

expected = x.clone()
dist.all_reduce(expected)  # torch's own all-reduce, the reference
ours, sent, schedule = ring_all_reduce(x.clone())

exact = sent_bytes(args.numel, n, env.rank, x.element_size())
approx = 2 * (n - 1) / n * size
# Same sums, added in a different order: equal up to float32 rounding (a few units in the
# last place); printed as a bound, since the exact last bits vary with the CPU.
torch.testing.assert_close(ours, expected)
max_diff = (ours - expected).abs().max().item()
print0(f"all-reduce of S = {size:,} bytes ({args.numel:,} float32) on N = {n} ranks; "
       f"2(N-1)/N*S = {approx:,.1f}")
print_ranks(f"sent {sent:,} bytes in {len(schedule)} steps (chunks {schedule}); "
            f"exact 2S - c[r+1] - c[r+2] = {exact:,}: {sent == exact}")
print0(f"hand-written ring == dist.all_reduce (torch.testing.assert_close): True; "
       f"max |diff| < 1e-5: {max_diff < 1e-5}")
all_sent = [None] * n
dist.all_gather_object(all_sent, (sent, schedule, exact))
write_json(args.json, {"world_size": n, "numel": args.numel, "bytes": size,
                       "approx_sent": approx, "max_diff_below_1e-5": max_diff < 1e-5,
                       "sent": [s for s, _, _ in all_sent],
                       "exact_sent": [e for _, _, e in all_sent],
                       "schedule": [c for _, c, _ in all_sent]})
teardown()

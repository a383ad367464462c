"""A ring all-reduce written by hand from send/recv, counting every byte it sends.

    code/run_w_torchrun.sh 2 ch00_collectives/ring_allreduce.py --numel 1048576
    code/run_w_torchrun.sh 4 ch00_collectives/ring_allreduce.py --sizes 2,4  # two rings, one launch

The tensor is cut into N chunks. Reduce-scatter: in N-1 steps each rank passes one chunk to its
right neighbour and adds the chunk arriving from its left, until rank r owns the full sum of
chunk r+1. All-gather: in N-1 more steps the finished chunks travel once around the ring.
Each rank sends 2(N-1) chunks of about S/N bytes: 2(N-1)/N * S, whatever N is (Patarasuk & Yuan
2009; the algorithm NCCL and gloo use for large messages). When N does not divide the tensor,
the chunks differ by one element and the exact count is sent_bytes() below.

--sizes 2,4 runs the ring on the first 2 ranks, then on all 4, in one launch (a sub-group per size:
starting the processes costs more than the rings themselves).
"""
import argparse
import os

import torch
import torch.distributed as dist

from distkit import print0, seed_everything, setup, teardown, write_json


def ring_all_reduce(x: torch.Tensor, group=None) -> tuple[torch.Tensor, int, list]:
    """Sum x over the ranks of `group` (default: all), in place. Returns (x, bytes this rank
    sent, chunks it sent per step)."""
    rank, n = dist.get_rank(group), dist.get_world_size(group)  # ranks within the group
    right, left = (rank + 1) % n, (rank - 1) % n
    chunks = list(x.view(-1).tensor_split(n))  # views: writing a chunk writes x
    sent, schedule = 0, []

    def exchange(send_idx, recv_idx):
        nonlocal sent
        incoming = torch.empty_like(chunks[recv_idx])
        # Post send and receive together: if every rank did a blocking send first,
        # all would wait for a receiver forever.
        reqs = dist.batch_isend_irecv([
            dist.P2POp(dist.isend, chunks[send_idx], group=group, group_peer=right),
            dist.P2POp(dist.irecv, incoming, group=group, group_peer=left)])
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
parser.add_argument("--sizes", default=None,
                    help="comma-separated ring sizes N, each run on ranks 0..N-1 (default: all)")
parser.add_argument("--json", help="write measured and theoretical bytes here (rank 0); "
                                   "with --sizes, a {n} in the path becomes each N")
args = parser.parse_args()
# torchrun set WORLD_SIZE already: check it before joining the group, so every rank stops
# with the same one-line error instead of some of them waiting in a collective.
world_size = int(os.environ.get("WORLD_SIZE", 1))
try:
    sizes = [int(v) for v in args.sizes.split(",")] if args.sizes else [world_size]
except ValueError:
    parser.error(f"--sizes must be comma-separated integers, got {args.sizes!r}")
if not all(1 <= n <= world_size for n in sizes):
    parser.error(f"--sizes must lie between 1 and the number of processes ({world_size}), "
                 f"got {args.sizes}")
if args.numel < max(sizes):
    parser.error(f"--numel must be at least the number of processes ({max(sizes)}): "
                 f"one chunk per rank, got {args.numel}")

env = setup()
seed_everything(env.rank)  # different data on every rank
for n in sizes:
    # every rank creates every group (new_group is collective); only its members use it
    group = dist.new_group(list(range(n))) if n < env.world_size else None
    member = env.rank < n
    x = torch.randn(args.numel, device=env.device)
    size = x.numel() * x.element_size()
    approx = 2 * (n - 1) / n * size
    result = None
    if member:
        expected = x.clone()
        dist.all_reduce(expected, group=group)  # torch's own all-reduce, the reference
        ours, sent, schedule = ring_all_reduce(x.clone(), group)
        exact = sent_bytes(args.numel, n, env.rank, x.element_size())
        # Same sums, added in a different order: equal up to float32 rounding (a few units in
        # the last place); printed as a bound, since the exact last bits vary with the CPU.
        torch.testing.assert_close(ours, expected)
        result = (sent, schedule, exact, (ours - expected).abs().max().item())
    results = [None] * env.world_size
    dist.all_gather_object(results, result)  # every rank's counts, to rank 0's printout
    results = results[:n]
    max_diff = max(r[3] for r in results)
    print0(f"all-reduce of S = {size:,} bytes ({args.numel:,} float32) on N = {n} ranks; "
           f"2(N-1)/N*S = {approx:,.1f}")
    for r, (sent, schedule, exact, _) in enumerate(results):
        print0(f"[rank {r}] sent {sent:,} bytes in {len(schedule)} steps (chunks {schedule}); "
               f"exact 2S - c[r+1] - c[r+2] = {exact:,}: {sent == exact}")
    print0(f"hand-written ring == dist.all_reduce (torch.testing.assert_close): True; "
           f"max |diff| < 1e-5: {max_diff < 1e-5}")
    write_json(args.json and str(args.json).replace("{n}", str(n)),
               {"world_size": n, "numel": args.numel, "bytes": size,
                "approx_sent": approx, "max_diff_below_1e-5": max_diff < 1e-5,
                "sent": [s for s, _, _, _ in results],
                "exact_sent": [e for _, _, e, _ in results],
                "schedule": [c for _, c, _, _ in results]})
teardown()

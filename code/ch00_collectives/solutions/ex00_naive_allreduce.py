"""Exercise 00.1: all-reduce through rank 0, a "parameter server", bytes counted.

    code/run_w_torchrun.sh 4 ch00_collectives/exercises/ex00_naive_allreduce.py

Every rank sends its tensor to rank 0 with dist.send; rank 0 adds them up and sends the sum
back to every other rank. Fill in the two TODOs (each todo() call stops the run and says what
is missing; delete it once your code is there), and count the bytes each rank sends and
receives. Before you run it on 4 processes, predict rank 0's counts. The end of the script
checks your result against dist.all_reduce; `make exercise EX=00.1` checks it at 2 and 3 ranks.
Solution, with the answer: ../solutions/ex00_naive_allreduce.py.
"""
import argparse

import torch
import torch.distributed as dist

from distkit import print0, print_ranks, seed_everything, setup, teardown, todo, write_json

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
size = x.numel() * x.element_size()  # S, in bytes
expected = x.clone()
dist.all_reduce(expected)  # the reference your result must match

sent = received = 0  # bytes: add size every time this rank sends or receives a tensor
total = x.clone()  # at the end: the sum over all ranks, on every rank
if rank == 0:
    ### BEGIN SOLUTION: rank 0: receive the other ranks' tensors, add them up, send the sum back
    ### HINT rank 0 must end with the sum of all N tensors in total, and every other rank must get
    ### HINT that sum back. A recv needs a buffer of the right shape to receive into. Look up:
    ### HINT dist.recv and dist.send (their src / dst arguments), torch.empty_like.
    for src in range(1, n):  # gather: N-1 tensors arrive at rank 0
        buf = torch.empty_like(x)
        dist.recv(buf, src=src)
        received += size
        total += buf
    for dst in range(1, n):  # broadcast back: N-1 tensors leave rank 0
        dist.send(total, dst=dst)
        sent += size
    ### END SOLUTION
else:
    ### BEGIN SOLUTION: ranks 1..N-1: send x to rank 0, then receive the sum from it
    ### HINT the mirror image of rank 0's part, in the same order (a send waits for its recv).
    dist.send(x, dst=0)
    sent += size
    dist.recv(total, src=0)  # overwrites total with the sum
    received += size
    ### END SOLUTION

# Summed in another order than all_reduce's: equal up to rounding (assert_close's float32 bounds)
equal = torch.allclose(total, expected, rtol=1.3e-6, atol=1e-5)
print0(f"S = {size:,} bytes, N = {n}; ring: every rank sends 2(N-1)/N*S = "
       f"{2 * (n - 1) / n * size:,.0f}")
print_ranks(f"sent {sent:,} received {received:,} bytes ({sent / size:.0f} S out, "
            f"{received / size:.0f} S in)")
counts = [None] * n
dist.all_gather_object(counts, (sent, received, equal))
print0(f"result == dist.all_reduce on every rank: {all(e for _, _, e in counts)}")
write_json(args.json, {"world_size": n, "bytes": size, "sent": [s for s, _, _ in counts],
                       "received": [r for _, r, _ in counts],
                       "equal": [e for _, _, e in counts]})
assert equal, f"rank {rank}: the result differs from dist.all_reduce's"
teardown()

### BEGIN SOLUTION
# Answer: rank 0 receives N-1 tensors and sends N-1: at N = 4, 3 S in and 3 S out (S = 2**18
# float32 values = 1,048,576 bytes), every other rank 1 S each way. Rank 0's link carries
# (N-1) S each way, growing with N, while in a ring every rank sends 2(N-1)/N S < 2 S however
# many ranks there are: why no library reduces through one rank.
### END SOLUTION

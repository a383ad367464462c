# Yours to fill in (generated from ../solutions/ex00_allreduce_from_halves.py).
"""Exercise 00.3: all_reduce from its two halves, reduce-scatter then all-gather, at any size.

    code/run_w_torchrun.sh 3 ch00_collectives/exercises/ex00_allreduce_from_halves.py

Section 2 checked all_reduce = reduce_scatter then all_gather on one run's values; here you build
it. Sum x over the ranks with one dist.reduce_scatter_single and one dist.all_gather_single, and
the script compares the result with dist.all_reduce's. Both calls take one flat tensor N times
the size of a rank's shard, so x (--numel elements, by default not a multiple of N) must first be
padded to a multiple of N, and the padding cut off at the end: FSDP pads every parameter the
same way (chapter 04). Fill in the TODOs (each todo() call stops the run and says what is
missing; delete it once your code is there). Predict first: with --numel 1000 on 3 ranks, how
many elements is a shard, how many are padding, and how many bytes does each half send per rank
in a ring? `make exercise EX=00.3` checks yours at 2 and 3 ranks.
Solution, with the answer: ../solutions/ex00_allreduce_from_halves.py.
"""
import argparse

import torch
import torch.distributed as dist
from torch.distributed.tensor.debug import CommDebugMode

from distkit import print0, setup, teardown, todo, write_json

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--numel", type=int, default=1001, help="float32 elements per rank")
parser.add_argument("--json", help="write the shard size, padding and checks here (rank 0)")
args = parser.parse_args()
if args.numel < 1:
    parser.error(f"--numel must be positive, got {args.numel}")

env = setup()
rank, n = env.rank, env.world_size
# Whole numbers below 2**24: float32 sums them exactly in any order, so results compare with ==.
x = (torch.arange(args.numel) % 97 + 100 * rank).float().to(env.device)
expected = x.clone()
dist.all_reduce(expected)  # the reference your result must equal

# TODO(you): shard: the fewest elements per rank that hold all of x between N ranks (an int).
# padded: a flat tensor of shard x N elements on x's device, x first, then zeros (they add nothing).
# Look up: torch.zeros (its device= argument), slice assignment.
todo("pad x: shard = elements per rank, padded = x and zeros, shard x N elements")

# Counts the collectives of the two halves for the checker (torch's CommDebugMode, chapter 02
# meets it): your code goes inside the block; leave the block as it is.
with CommDebugMode() as comm:
    # TODO(you): mine: shard elements; afterwards rank r holds elements r*shard ... (r+1)*shard - 1
    # of the sum over the ranks of padded. Look up: dist.reduce_scatter_single (output first).
    todo("reduce-scatter padded into mine, this rank's slice of the sum")

    # TODO(you): total: the numel elements of the sum, on every rank. Look up:
    # dist.all_gather_single.
    todo("all-gather every rank's slice into total, without the padding")
collectives = {str(op).split(".")[-1]: calls for op, calls in comm.get_comm_counts().items()}

# Checks: this rank's slice after the reduce-scatter, and the result, against dist.all_reduce
want = torch.zeros(shard * n, device=x.device)
want[:args.numel] = expected
slice_ok = mine.shape == (shard,) and torch.equal(mine, want[rank * shard:(rank + 1) * shard])
equal = total.shape == expected.shape and torch.equal(total, expected)
checks = [None] * n
dist.all_gather_object(checks, {"slice": bool(slice_ok), "equal": bool(equal)})
padding = shard * n - args.numel
half = (n - 1) * shard * 4  # bytes per rank in a ring: N-1 steps of one float32 shard
print0(f"numel {args.numel:,} on N = {n}: shard {shard:,} elements, padding {padding}; "
       f"in a ring each half sends {half:,} bytes per rank, the pair {2 * half:,} "
       f"(2(N-1)/N x S = {2 * (n - 1) / n * args.numel * 4:,.1f})")
print0(f"every rank's slice after reduce_scatter_single = its slice of the sum: "
       f"{all(c['slice'] for c in checks)}; result == dist.all_reduce on every rank: "
       f"{all(c['equal'] for c in checks)}")
write_json(args.json, {"world_size": n, "numel": args.numel, "shard": shard, "padding": padding,
                       "ring_bytes_per_half": half, "checks": checks,
                       "collectives": collectives})
teardown()

"""Time dist.all_reduce over message sizes: latency at small sizes, bandwidth at large ones.

    code/run_w_torchrun.sh 2 ch00_collectives/allreduce_bench.py --max-mb 16 --json /tmp/bench.json

Prints, per size, the median time and the "bus bandwidth" busbw = 2(N-1)/N * S / t: the bytes
each rank actually pushed through its link per second (the figure nccl-tests report). On CPU +
gloo this measures memory copies and loopback TCP, not NVLink or InfiniBand.
"""
import argparse
import time

import torch
import torch.distributed as dist

from distkit import print0, setup, teardown, write_json

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--min-kb", type=float, default=1, help="smallest message, KiB")
parser.add_argument("--max-mb", type=float, default=16, help="largest message, MiB")
parser.add_argument("--iters", type=int, default=20, help="timed repetitions per size")
parser.add_argument("--json", help="write sizes and times here (rank 0)")
args = parser.parse_args()
if not 0 < args.min_kb * 1024 <= args.max_mb * 2**20 or args.iters < 1:
    parser.error("need 0 < --min-kb <= --max-mb and --iters >= 1")

env = setup()
n = env.world_size
sizes, size = [], int(args.min_kb * 1024)
while size <= args.max_mb * 2**20:
    sizes.append(size)
    size *= 4

times = []
for size in sizes:
    x = torch.ones(size // 4, device=env.device)  # float32: 4 bytes per element
    dist.all_reduce(x)  # warm-up: connections, allocations
    samples = []
    for _ in range(args.iters):
        dist.barrier()  # start together, so we time the collective, not the wait for peers
        if env.device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        dist.all_reduce(x)
        if env.device.type == "cuda":
            torch.cuda.synchronize()
        samples.append(time.perf_counter() - t0)
    # Each rank has its own view of the time; the slowest rank is the collective's time.
    t = torch.tensor(sorted(samples)[len(samples) // 2], device=env.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    times.append(t.item())

print0(f"all_reduce on {n} ranks, backend {env.backend} (median of {args.iters})")
print0(f"{'size':>10} {'time':>10} {'busbw':>12}")
for size, t in zip(sizes, times):
    busbw = 2 * (n - 1) / n * size / t
    print0(f"{size / 1024:>8.0f}Ki {t * 1e3:>8.3f}ms {busbw / 1e9:>8.3f}GB/s")
write_json(args.json, {"world_size": n, "backend": env.backend, "sizes": sizes, "times": times})
teardown()

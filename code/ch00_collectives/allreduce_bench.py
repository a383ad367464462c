"""Time dist.all_reduce over message sizes: latency at small sizes, bandwidth at large ones.

    code/run_w_torchrun.sh 2 ch00_collectives/allreduce_bench.py --max-mb 16 --json /tmp/bench.json

Sizes go up by 4x from --min-kb to --max-mb. Every size is timed --iters times, in rounds that
visit every size once; one sample is the slowest rank's time for one call (the collective is
done when the last rank is done).

Prints, per size, the fastest, median and slowest sample, and the "bus bandwidth" of the fastest
busbw = 2(N-1)/N * S / t: the bytes each rank pushed through its link per second (the figure
nccl-tests report). On CPU + gloo this measures memory copies and loopback TCP, not NVLink or
InfiniBand, and a busy machine shows up as slow samples: hence the spread, not one number.
"""
import argparse
import statistics
import time

import torch
import torch.distributed as dist

from distkit import print0, setup, teardown, write_json

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--min-kb", type=float, default=1, help="smallest message, KiB")
parser.add_argument("--max-mb", type=float, default=16, help="largest message, MiB")
parser.add_argument("--iters", type=int, default=40, help="timed repetitions per size")
parser.add_argument("--warmup", type=int, default=3, help="untimed calls per size first")
parser.add_argument("--json", help="write sizes and every sample here (rank 0)")
args = parser.parse_args()
if not 4 <= args.min_kb * 1024 <= args.max_mb * 2**20:
    parser.error("need 4 bytes (one float32) <= --min-kb <= --max-mb")
if args.iters < 1 or args.warmup < 0:
    parser.error("need --iters >= 1 and --warmup >= 0")

env = setup()
n = env.world_size
sizes, size = [], int(args.min_kb * 1024) // 4 * 4  # whole float32s
while size <= args.max_mb * 2**20:
    sizes.append(size)
    size *= 4


def sync():  # CUDA collectives return before the GPU is done: wait, or we time the launch
    if env.device.type == "cuda":
        torch.cuda.synchronize()


# float32: 4 bytes per element. Warm-up first: connections, allocations, caches.
xs = [torch.ones(size // 4, device=env.device) for size in sizes]
for x in xs:
    for _ in range(args.warmup):
        dist.all_reduce(x)

# Round-robin: every round times each size once, so a burst of load from elsewhere on the
# machine (it lasts a few ms to seconds) spreads over all sizes instead of skewing one size.
mine = [[] for _ in sizes]  # mine[i][k]: this rank's time for call k at size i, seconds
for _ in range(args.iters):
    for x, times in zip(xs, mine):
        dist.barrier()  # start together, so we time the collective, not the wait for peers
        sync()
        t0 = time.perf_counter()
        dist.all_reduce(x)
        sync()
        times.append(time.perf_counter() - t0)
# Each rank timed its own view of every call; the slowest rank's is the collective's time.
t = torch.tensor(mine, dtype=torch.float64, device=env.device)
dist.all_reduce(t, op=dist.ReduceOp.MAX)
samples = t.tolist()  # samples[i][k]: call k at size i, slowest rank, seconds

print0(f"all_reduce on {n} ranks, backend {env.backend}: {args.iters} calls per size "
       f"(slowest rank per call)")
print0(f"{'size':>10} {'fastest':>10} {'median':>10} {'slowest':>10} {'busbw(fastest)':>15}")
for size, ts in zip(sizes, samples):
    ts = sorted(ts)
    busbw = 2 * (n - 1) / n * size / ts[0]
    print0(f"{size / 1024:>8.0f}Ki {ts[0] * 1e3:>8.3f}ms {statistics.median(ts) * 1e3:>8.3f}ms "
           f"{ts[-1] * 1e3:>8.3f}ms {busbw / 1e9:>11.3f}GB/s")
write_json(args.json, {"world_size": n, "backend": env.backend, "iters": args.iters,
                       "sizes": sizes, "samples": samples})
teardown()

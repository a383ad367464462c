"""Time dist.all_reduce over message sizes: latency at small sizes, bandwidth at large ones.

    code/run_w_torchrun.sh 2 ch00_collectives/allreduce_bench.py --max-mb 16 --json /tmp/bench.json

Sizes go up by 4x from --min-kb to --max-mb. Every size is timed --iters times, in rounds that
visit every size once; one sample is the slowest rank's time for one call (or the mean of
--inner calls; the collective is done when the last rank is done).

Prints, per size, the fastest, median and slowest sample, and the "bus bandwidth" of the fastest
busbw = 2(N-1)/N * S / t: the bytes each rank pushed through its link per second (nccl-tests'
convention, its doc/PERFORMANCE.md: algbw = S / t, busbw = algbw * 2(N-1)/N for all_reduce).
On CPU + gloo this measures memory copies and loopback TCP, not NVLink or InfiniBand, and a busy
machine shows up as slow samples: hence the spread, not one number.

On GPUs (NCCL) measure as nccl-tests does:
    code/run_w_torchrun.sh 8 ch00_collectives/allreduce_bench.py --max-mb 1024 --inner 20
NCCL's bus bandwidth keeps rising up to hundreds of MiB, so sizes go to 1 GiB; a sample is the
mean of --inner back-to-back calls timed with CUDA events on the stream (a host clock around one
call would time its launch and the synchronisation, not the link). NCCL also switches algorithm
(ring, tree, NVLS) and protocol (LL, LL128, Simple) with the size, so the curve is no single
a + b*S line there (NCCL_ALGO / NCCL_PROTO pin them).
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
parser.add_argument("--inner", type=int, default=1,
                    help="back-to-back calls per sample, averaged (nccl-tests' -n; 20 on a GPU)")
parser.add_argument("--warmup", type=int, default=3, help="untimed calls per size first")
parser.add_argument("--json", help="write sizes and every sample here (rank 0)")
args = parser.parse_args()
if not 4 <= args.min_kb * 1024 <= args.max_mb * 2**20:
    parser.error("need 4 bytes (one float32) <= --min-kb <= --max-mb")
if args.iters < 1 or args.inner < 1 or args.warmup < 0:
    parser.error("need --iters >= 1, --inner >= 1 and --warmup >= 0")

env = setup()
n = env.world_size
sizes, size = [], int(args.min_kb * 1024) // 4 * 4  # whole float32s
while size <= args.max_mb * 2**20:
    sizes.append(size)
    size *= 4


def sample(x: torch.Tensor) -> float:
    """Seconds per call, the mean of --inner back-to-back all_reduces of x on this rank."""
    dist.barrier()  # start together, so we time the collective, not the wait for peers
    if env.device.type == "cuda":
        # NCCL calls return before the GPU is done: CUDA events on the current stream (which
        # waits for NCCL's) time the kernels themselves, as nccl-tests does
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(args.inner):
            dist.all_reduce(x)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / args.inner  # elapsed_time is in ms
    t0 = time.perf_counter()  # gloo: the call returns when the sum is there
    for _ in range(args.inner):
        dist.all_reduce(x)
    return (time.perf_counter() - t0) / args.inner


# float32: 4 bytes per element; zeros stay zeros however often they are summed (ones would
# overflow to inf), and the speed is the same. Warm-up first: connections, allocations, caches.
xs = [torch.zeros(size // 4, device=env.device) for size in sizes]
for x in xs:
    for _ in range(args.warmup):
        dist.all_reduce(x)

# Round-robin: every round times each size once, so a burst of load from elsewhere on the
# machine (it lasts a few ms to seconds) spreads over all sizes instead of skewing one size.
mine = [[] for _ in sizes]  # mine[i][k]: this rank's time for call k at size i, seconds
for _ in range(args.iters):
    for x, times in zip(xs, mine):
        times.append(sample(x))
# Each rank timed its own view of every call; the slowest rank's is the collective's time.
t = torch.tensor(mine, dtype=torch.float64, device=env.device)
dist.all_reduce(t, op=dist.ReduceOp.MAX)
samples = t.tolist()  # samples[i][k]: call k at size i, slowest rank, seconds

timer = "CUDA events" if env.device.type == "cuda" else "host clock"
per = f"{args.iters} samples of {args.inner} calls" if args.inner > 1 else f"{args.iters} calls"
print0(f"all_reduce on {n} ranks, backend {env.backend}: {per} per size, {timer} "
       f"(slowest rank per sample)")
print0(f"{'size':>10} {'fastest':>10} {'median':>10} {'slowest':>10} {'busbw(fastest)':>15}")
for size, ts in zip(sizes, samples):
    ts = sorted(ts)
    busbw = 2 * (n - 1) / n * size / ts[0]
    print0(f"{size / 1024:>8.0f}Ki {ts[0] * 1e3:>8.3f}ms {statistics.median(ts) * 1e3:>8.3f}ms "
           f"{ts[-1] * 1e3:>8.3f}ms {busbw / 1e9:>11.3f}GB/s")
write_json(args.json, {"world_size": n, "backend": env.backend, "iters": args.iters,
                       "inner": args.inner, "timer": timer,
                       "sizes": sizes, "samples": samples})
teardown()

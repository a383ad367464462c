"""Asynchronous collectives: start an all_reduce, compute while it runs, wait before reading.

    code/run_w_torchrun.sh 2 ch00_collectives/async_collectives.py --json /tmp/async.json

`dist.all_reduce(x, async_op=True)` returns at once with a Work handle instead of the finished
result. `work.is_completed()` asks without blocking; `work.wait()` blocks until the result is in
x on CPU/gloo. On GPU/NCCL, wait() only makes the current CUDA stream wait for NCCL's stream
(the CPU runs on; torch 2.13's Work.wait docstring), so is_completed() right after it may still
be False; after torch.cuda.synchronize() it is True. The script records both.
Between the two the rank may do any work that neither reads nor writes x: that is the overlap
DDP uses to hide gradient all-reduces behind the rest of backward (chapter 01).

Part 1 checks the result after wait(). Part 2 times "an all_reduce plus some work", one after
the other and overlapped, for two kinds of work sized to last about as long as the all_reduce
(where overlap could save most): matrix products, which need the CPU that gloo also needs, and
a sleep, which stands for work done elsewhere (a GPU kernel, I/O) and leaves the CPU free.
"""
import argparse
import statistics
import time

import torch
import torch.distributed as dist

from distkit import print0, print_ranks, setup, teardown, write_json

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--numel", type=int, default=2**22, help="float32 elements to all-reduce")
parser.add_argument("--dim", type=int, default=256, help="size of the square matmuls (compute)")
parser.add_argument("--repeats", type=int, default=9, help="timed rounds of every variant")
parser.add_argument("--json", help="write the checks and the times here (rank 0)")
args = parser.parse_args()
if args.numel < 1 or args.dim < 1 or args.repeats < 1:
    parser.error("--numel, --dim and --repeats must be positive")

env = setup()
rank, n = env.rank, env.world_size
a = torch.randn(args.dim, args.dim, device=env.device)


def compute(steps: int) -> torch.Tensor:
    """Useful work that touches neither x nor anything the collective uses: `steps` matmuls."""
    y = a
    for _ in range(steps):
        y = torch.tanh(a @ y)
    return y


def first_look(x: torch.Tensor) -> tuple[dist.Work, bool, bool, bool]:
    """Start an all-reduce of x, compute meanwhile, wait: the whole API in a few lines."""
    work = dist.all_reduce(x, async_op=True)  # returns at once, with a Work handle
    started = work.is_completed()  # asks without blocking: False while the bytes still move
    compute(4)                     # our own work meanwhile; x stays untouched until wait()
    work.wait()                    # gloo: blocks until the sum is in x. NCCL: only makes the
    after_wait = work.is_completed()  # current CUDA stream wait: this may still be False
    if env.device.type == "cuda":  # block the CPU until the current stream got past wait()
        torch.cuda.current_stream().synchronize()
    return work, started, after_wait, work.is_completed()  # now True on every backend


def sequential(buf: torch.Tensor, work_fn) -> None:
    dist.all_reduce(buf)  # blocking: returns when the sum is in buf
    work_fn()


def overlapped(buf: torch.Tensor, work_fn) -> None:
    handle = dist.all_reduce(buf, async_op=True)  # start it...
    work_fn()                                      # ...work while the bytes move...
    handle.wait()                                  # ...and wait before anyone reads buf


def sync():  # on GPU, kernels run after the Python call returns: wait for them before timing
    if env.device.type == "cuda":
        torch.cuda.synchronize()


def timed(variants: dict, repeats: int) -> dict:
    """Median over `repeats` rounds of the slowest rank's time for each variant (seconds).

    Round-robin (each round runs every variant once), so a burst of load from elsewhere on the
    machine slows all variants alike instead of skewing one comparison."""
    for fn in variants.values():
        fn()  # warm-up
    mine = {name: [] for name in variants}
    for _ in range(repeats):
        for name, fn in variants.items():
            dist.barrier()
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            mine[name].append(time.perf_counter() - t0)
    t = torch.tensor(list(mine.values()), dtype=torch.float64, device=env.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # same numbers on every rank
    return {name: statistics.median(ts) for name, ts in zip(variants, t.tolist())}


# --- Part 1: the handle, and the result after wait() ---------------------------------------
x = torch.full((args.numel,), float(rank + 1), device=env.device)
work, started, after_wait, done = first_look(x)
correct = bool((x == n * (n + 1) / 2).all())  # x started as rank+1: the sum is 1+2+...+N
print_ranks(f"{type(work).__name__} handle; is_completed() right after the call: {started}; "
            f"after wait(): {after_wait}; after a device sync: {done}; x == 1+2+...+N: {correct}")

# --- Part 2: does overlap save time here? -----------------------------------------------------
buf = torch.zeros_like(x)  # zeros stay zeros however often we sum them; the speed is the same
first = timed({"all_reduce": lambda: dist.all_reduce(buf), "matmul": lambda: compute(1)},
              args.repeats)
t_comm = first["all_reduce"]


def same_steps(steps: float) -> int:  # every rank must run the same count: the largest
    steps = torch.tensor([max(1, round(steps))], device=env.device)
    dist.all_reduce(steps, op=dist.ReduceOp.MAX)
    return int(steps.item())


# Size the work to last about as long as the all-reduce, in two tries: in a loop, each matmul ran
# 3 to 8 times slower than one timed alone (two runs on a busy 2-core machine), so time the first
# guess and scale it once.
steps = same_steps(t_comm / first["matmul"])
steps = same_steps(steps * t_comm / timed({"matmuls": lambda: compute(steps)}, 3)["matmuls"])
busy = lambda: compute(steps)      # needs the CPU, as gloo's own threads do
idle = lambda: time.sleep(t_comm)  # needs no CPU: stands for a GPU kernel, or I/O
times = timed({"all_reduce": lambda: dist.all_reduce(buf),
               "matmuls": busy,
               "all_reduce, then matmuls": lambda: sequential(buf, busy),
               "matmuls during all_reduce": lambda: overlapped(buf, busy),
               "sleep": idle,
               "all_reduce, then sleep": lambda: sequential(buf, idle),
               "sleep during all_reduce": lambda: overlapped(buf, idle)}, args.repeats)

print0(f"all_reduce of {buf.numel() * 4 / 2**20:.3g} MiB on {n} ranks ({env.backend}); work "
       f"sized to last as long: {steps} matmuls {args.dim}x{args.dim}, or a sleep of "
       f"{t_comm * 1e3:.0f} ms; median of {args.repeats} rounds, slowest rank:")
for name, t in times.items():
    print0(f"  {name:<28} {t * 1e3:7.2f} ms")
for work in ("matmuls", "sleep"):
    seq, ovl = times[f"all_reduce, then {work}"], times[f"{work} during all_reduce"]
    # perfect overlap: the shorter of the two hides entirely behind the longer one
    perfect = max(times["all_reduce"], times[work])
    print0(f"{work}: overlap saved {(seq - ovl) * 1e3:.2f} ms; perfect overlap would save "
           f"{(seq - perfect) * 1e3:.2f} ms")

checks = [None] * n
dist.all_gather_object(checks, {"completed_at_start": started, "completed_after_wait": after_wait,
                                "completed_after_sync": done, "correct": correct})
write_json(args.json, {"world_size": n, "backend": env.backend, "bytes": buf.numel() * 4,
                       "steps": steps, "sleep_s": t_comm, "dim": args.dim, "checks": checks,
                       "times": times})
teardown()

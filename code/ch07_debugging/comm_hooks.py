"""DDP communication hooks (fp16, bf16, PowerSGD) shrink the gradient all-reduce; bytes measured.

    code/run_w_torchrun.sh 2 ch07_debugging/comm_hooks.py                  # none,fp16,bf16,powersgd
    code/run_w_torchrun.sh 2 ch07_debugging/comm_hooks.py --hooks none,powersgd --rank 1

When the gradient all-reduce is the bottleneck (slow network, many ranks, small batches), DDP can
compress what goes on the wire with a communication hook: a function that gets each gradient
bucket and returns a future of the averaged bucket. Each hook here trains the same MLP from the
same initial weights on the same data; every collective is counted by torch's flight recorder
(TORCH_FR_BUFFER_SIZE), which sits in the process group and so sees the all-reduces that DDP's
reducer and the hooks issue from any thread. (distkit's CollectiveLog, a dispatch mode, is
thread-local: it misses PowerSGD's P and Q all-reduces, which the hook issues from a future's
callback, on gloo's thread.)

none:     DDP's built-in all-reduce of the fp32 gradients: 4 Psi bytes a step (Psi parameters).
fp16/bf16: default_hooks.fp16/bf16_compress_hook: cast the bucket to 16 bits, all-reduce, cast
          back: 2 Psi bytes. bf16 keeps fp32's range (no underflow of small gradients), fp16 more
          mantissa.
powersgd: powerSGD_hook (Vogels et al. 2019). Each gradient viewed as an n x m matrix M is
          approximated by P Q^T, P = M Q (n x r) and Q = M^T P (m x r): all-reduce P, then Q, so
          (n + m) r numbers instead of n m. Matrices where that does not save a factor
          min_compression_rate (default 2), and all 1-D tensors (biases), are all-reduced
          uncompressed, first: 3 all-reduces per bucket. The error M - P Q^T is added to the next
          step's gradient (error feedback); the first start_powerSGD_iter steps are plain
          all-reduces (warm-up). (Its sibling batched_powerSGD_hook, one square matrix for the
          whole bucket, fails at its first compressed step in torch 2.13: AssertionError in
          _orthogonalize, which expects a batch of matrices.)

Two measurements follow the training runs:
- the 16-bit sum (--sum-ranks): the 16-bit hooks do not only send 16 bits, they *add* in 16 bits.
  A ring all-reduce (NCCL's ring, gloo's) adds the ranks' values one hop at a time, rounding
  every partial sum to the wire's dtype: N - 1 roundings, an error that grows with N. With N
  ranks' real gradients (this model's, on the batches ranks 0..N-1 would hold at step 1), rank 0
  replays the hook's arithmetic (default_hooks._compress_hook: cast, divide by N in 16 bits, sum)
  in ring order, one process, and compares with the exact mean; the all-reduce of the real
  ranks checks the replay at N = world size.
- exposed communication (--time-steps): steps of plain DDP timed with and without
  `model.no_sync()` (the same forward and backward, no all-reduce), alternated; the difference
  is the communication the backward did not hide, the only part a hook can save.
"""
import argparse
import json
import math
import os
import time
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
from torch.nn.parallel import DistributedDataParallel as DDP

from distkit import print0, same_on_all_ranks, seed_everything, setup, teardown, write_json

HOOKS = ("none", "fp16", "bf16", "powersgd")
parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--hooks", default="none,fp16,bf16,powersgd",
                    help=f"comma-separated, from: {', '.join(HOOKS)}")
parser.add_argument("--rank", type=int, default=2,
                    help="PowerSGD's rank r (matrix_approximation_rank)")
parser.add_argument("--powersgd-start", type=int, default=10,
                    help="start_powerSGD_iter: steps of plain all-reduce before compressing")
parser.add_argument("--steps", type=int, default=30, help="training steps, for each hook")
parser.add_argument("--lr", type=float, default=0.1, help="SGD's learning rate (momentum 0.9)")
parser.add_argument("--sum-ranks", default="2,4,8,16,32,64",
                    help="ranks N at which to replay the hooks' 16-bit sum (one process)")
parser.add_argument("--time-steps", type=int, default=20,
                    help="steps timed with and without no_sync(), each (0: skip)")
parser.add_argument("--json", help="write the measured results here")
args = parser.parse_args()
hooks = list(dict.fromkeys(h for h in args.hooks.split(",") if h))  # in order, once each
if not set(hooks) <= set(HOOKS):
    parser.error(f"unknown --hooks {', '.join(sorted(set(hooks) - set(HOOKS)))}; "
                 f"choose from {', '.join(HOOKS)}")
if not hooks:
    parser.error(f"--hooks is empty; choose from {', '.join(HOOKS)}")
if args.rank < 1:
    parser.error(f"--rank must be at least 1, got {args.rank}")
try:
    sum_ranks = sorted({int(n) for n in args.sum_ranks.split(",") if n})
except ValueError:
    parser.error(f"--sum-ranks must be comma-separated integers, got {args.sum_ranks!r}")
if not sum_ranks or not all(2 <= n <= 1024 for n in sum_ranks):
    parser.error(f"--sum-ranks must list ranks between 2 and 1024, got {args.sum_ranks!r}")
if args.time_steps < 0:
    parser.error(f"--time-steps must be at least 0, got {args.time_steps}")
# PowerSGDState raises for start_powerSGD_iter <= 1 with error feedback or warm start (both on by
# default): DDP rebuilds its buckets after step 0, which would scramble the per-bucket memories.
if not 2 <= args.powersgd_start < args.steps:
    parser.error(f"--powersgd-start must be between 2 and --steps - 1, got {args.powersgd_start}")

# The flight recorder's ring buffer (read when the process group is created): we read the new
# entries after every step, so it must hold one step's collectives (3 per bucket for PowerSGD).
os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "64")
env = setup(timeout_s=30)
c10d = torch._C._distributed_c10d
dump_fr = c10d._dump_nccl_trace_json if env.backend == "nccl" else c10d._dump_fr_trace_json
ITEMSIZE = {"Float": 4, "Half": 2, "BFloat16": 2, "Double": 8}
IN, HIDDEN, CLASSES, BATCH = 64, 256, 4, 32


class Wire:
    """The collectives this process issued since the last call, from the flight recorder."""

    def __init__(self):
        self.last = -1
        self.new()

    def new(self) -> list[dict]:
        entries = [e for e in json.loads(dump_fr()).get("entries", [])
                   if e["record_id"] > self.last]
        if entries and self.last >= 0 and entries[0]["record_id"] != self.last + 1:
            raise RuntimeError("flight recorder overflowed: raise TORCH_FR_BUFFER_SIZE")
        self.last = max([e["record_id"] for e in entries], default=self.last)
        return entries


def all_reduce_bytes(entries) -> tuple[int, int]:
    """(number of all-reduces, bytes of their tensors) among the recorded entries."""
    ars = [e for e in entries if e["profiling_name"].endswith(":all_reduce")]
    return len(ars), sum(math.prod(size) * ITEMSIZE[dtype] for e in ars
                         for size, dtype in zip(e["input_sizes"], e["input_dtypes"]))


def bf16_hook(state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """bf16_compress_hook under another name: DDP refuses that name in a torch built without
    CUDA + NCCL >= 2.10 (or XPU), whatever the backend."""
    return default_hooks.bf16_compress_hook(state, bucket)


def mlp() -> nn.Module:
    seed_everything(0)  # the same initial weights for every hook, on every rank
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN), nn.ReLU(),
                         nn.Linear(HIDDEN, CLASSES))


def powersgd_plan(model, r: int, min_compression_rate: float = 2) -> list[dict]:
    """What powerSGD_hook sends for each gradient: the rule of its _should_compress."""
    plan = []
    for name, p in model.named_parameters():
        n, m = p.shape[0], p[0].numel()  # the hook views each gradient as shape[0] x rest
        r_used = min(n, m, r)  # a 1-D tensor is n x 1: r_used 1, (n + 1) * 2 > n, never compressed
        compress = (n + m) * r_used * min_compression_rate < n * m
        plan.append({"name": name, "shape": list(p.shape), "matrix": [n, m],
                     "compressed": compress,
                     "elements_sent": (n + m) * r_used if compress else n * m})
    return plan


# The task: 4 classes given by a random linear "teacher"; each rank its own batch every step
# (seeded by rank and step), the same for every hook; a fixed held-out set for the loss curve.
teacher = torch.randn(IN, CLASSES, generator=torch.Generator().manual_seed(1000))


def labelled(n: int, seed: int):
    x = torch.randn(n, IN, generator=torch.Generator().manual_seed(seed))
    return x.to(env.device), (x @ teacher).argmax(1).to(env.device)


batches = [labelled(BATCH, 10_000 * env.rank + s) for s in range(args.steps)]
x_eval, y_eval = labelled(512, 999)

psi = sum(p.numel() for p in mlp().parameters())
plan = powersgd_plan(mlp(), args.rank)
theory = {"none": 4 * psi, "fp16": 2 * psi, "bf16": 2 * psi,
          "powersgd": 4 * sum(p["elements_sent"] for p in plan)}
wire = Wire()
results, notes = {}, []
for hook in hooks:
    model = DDP(mlp().to(env.device))
    if hook == "fp16":
        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif hook == "bf16":
        # DDP refuses a hook named bf16_compress_hook unless torch was *built* with CUDA and
        # NCCL >= 2.10 (or XPU); gloo all-reduces bf16 fine, so register it under another name
        model.register_comm_hook(None, bf16_hook)
        notes.append("bf16: bf16_compress_hook registered under another name (DDP accepts the "
                     "name only in torch builds with CUDA + NCCL >= 2.10 or XPU)")
    elif hook == "powersgd":
        state = psgd.PowerSGDState(None, matrix_approximation_rank=args.rank,
                                   start_powerSGD_iter=args.powersgd_start)
        model.register_comm_hook(state, psgd.powerSGD_hook)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    wire.new()  # DDP's constructor: parameter check and broadcast, not training
    with torch.no_grad():
        losses = [F.cross_entropy(model.module(x_eval), y_eval).item()]
    steps, seconds = [], []
    for x, y in batches:
        t0 = time.perf_counter()
        F.cross_entropy(model(x), y).backward()  # the hook's all-reduces all finish in here
        opt.step()
        opt.zero_grad()
        seconds.append(time.perf_counter() - t0)
        entries = wire.new()
        n, nbytes = all_reduce_bytes(entries)
        steps.append({"all_reduces": n, "bytes": nbytes,
                      "other": [e["profiling_name"] for e in entries
                                if not e["profiling_name"].endswith(":all_reduce")]})
        with torch.no_grad():
            losses.append(F.cross_entropy(model.module(x_eval), y_eval).item())
    warm = args.powersgd_start if hook == "powersgd" else 0
    expected = [4 * psi] * warm + [theory[hook]] * (args.steps - warm)
    results[hook] = {"bytes_per_step": [s["bytes"] for s in steps],
                     "all_reduces_per_step": [s["all_reduces"] for s in steps],
                     # DDP's bucket rebuild at step 1: two broadcasts, not the hook's
                     "other_collectives": {i: s["other"] for i, s in enumerate(steps)
                                           if s["other"]},
                     "theory_per_step": expected, "equal": [s["bytes"] for s in steps] == expected,
                     "loss": losses, "seconds_per_step": seconds,
                     "replicas_identical": same_on_all_ranks(list(model.parameters()))}


# --- the 16-bit sum: what a hook's all-reduce computes, replayed at N ranks ----------------------
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def flat_grad(model, seed: int) -> torch.Tensor:
    """The fp32 gradient a rank holds after its backward on the batch of this seed."""
    model.zero_grad()
    x, y = labelled(BATCH, seed)
    F.cross_entropy(model(x), y).backward()
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()]).cpu()


def ring_sum(grads: list[torch.Tensor], dtype) -> torch.Tensor:
    """The hook's average as a ring adds it: each rank's bucket cast and divided by N in the
    wire's dtype (default_hooks._compress_hook; DDP's own fp32 path divides too), then added one
    hop at a time, every partial sum rounded to that dtype."""
    n = len(grads)
    total = grads[0].to(dtype, copy=True).div_(n)
    for g in grads[1:]:
        total = total + g.to(dtype, copy=True).div_(n)  # one hop: rounded to dtype
    return total


def rel_error(approx: torch.Tensor, exact: torch.Tensor) -> float:
    return ((approx.double() - exact).norm() / exact.norm()).item()


model0 = mlp().to(env.device)
grads = [flat_grad(model0, 10_000 * r) for r in range(max(sum_ranks))]  # step 1's batches
sums = {}
for n in sum_ranks:
    exact = torch.stack(grads[:n]).double().mean(0)
    sums[n] = {name: {"sum": rel_error(ring_sum(grads[:n], dt), exact),
                      # the inputs' rounding alone, averaged exactly: it does not grow with N
                      "cast_only": rel_error(torch.stack([g.to(dt, copy=True).div_(n).double()
                                                          for g in grads[:n]]).sum(0), exact)}
               for name, dt in DTYPES.items()}
# the real all-reduce at N = world size: this rank's gradient, as the bf16 hook sends it
mine = flat_grad(model0, 10_000 * env.rank)
ours = grads[:env.world_size] if env.world_size <= len(grads) else \
    [flat_grad(model0, 10_000 * r) for r in range(env.world_size)]
exact, real = torch.stack(ours).double().mean(0), {}
for name, dt in DTYPES.items():
    t = mine.to(env.device).to(dt, copy=True).div_(env.world_size)
    dist.all_reduce(t)
    real[name] = {"error": rel_error(t.cpu(), exact),
                  "replay": rel_error(ring_sum(ours, dt), exact),
                  "equal_to_replay": torch.equal(t.cpu(), ring_sum(ours, dt))}

# --- exposed communication: the same step with and without the all-reduce ---------------------


def timed_step(model, x, y, sync: bool) -> float:
    t0 = time.perf_counter()
    with nullcontext() if sync else model.no_sync():  # no_sync: backward without all-reduce
        F.cross_entropy(model(x), y).backward()
    if env.device.type == "cuda":
        torch.cuda.synchronize()  # the GPU's work, not only its launch
    seconds = time.perf_counter() - t0
    model.zero_grad()
    return seconds


timing = {}
if args.time_steps:
    model = DDP(mlp().to(env.device))
    x, y = batches[0]
    for sync in (True, False, True):  # warm-up (DDP rebuilds its buckets after its first step)
        timed_step(model, x, y, sync)
    both = [timed_step(model, x, y, i % 2 == 0) for i in range(2 * args.time_steps)]
    timing = {"sync_s": both[0::2], "no_sync_s": both[1::2]}

print0(f"MLP {IN}-{HIDDEN}-{HIDDEN}-{CLASSES}: Psi = {psi} parameters, {env.world_size} "
       f"ranks, {args.steps} steps (PowerSGD: rank {args.rank}, plain all-reduce for the first "
       f"{args.powersgd_start})")
for note in notes:
    print0(note)
if "powersgd" in hooks:
    print0(f"\nPowerSGD rank {args.rank}, per gradient (min_compression_rate 2):")
    print0(f"{'parameter':10} {'shape':>10} {'as n x m':>10} {'compressed':>10} "
           f"{'numbers sent':>12}")
    for p in plan:
        print0(f"{p['name']:10} {'x'.join(map(str, p['shape'])):>10} "
               f"{'x'.join(map(str, p['matrix'])):>10} {str(p['compressed']):>10} "
               f"{p['elements_sent']:>12}")
    sent = sum(p["elements_sent"] for p in plan)
    print0(f"{'total':43} {sent:>12}  (x 4 bytes = {4 * sent}; uncompressed {psi})")
print0(f"\n{'hook':9} {'all-reduces':>11} {'bytes/step':>10} {'theory':>8} {'equal':>6} "
       f"{'none / hook':>11}  (last step; 'equal': every step, warm-up included)")
for hook, r in results.items():
    last = r["bytes_per_step"][-1]
    print0(f"{hook:9} {r['all_reduces_per_step'][-1]:>11} {last:>10} {theory[hook]:>8} "
           f"{str(r['equal']):>6} {4 * psi / last:>11.1f}")
# The curves are deterministic up to float noise (vector width, threads), far below these bounds.
print0(f"\nheld-out loss (cross-entropy, {len(y_eval)} samples), ln {CLASSES} = "
       f"{math.log(CLASSES):.2f} at the start; gap = max over the steps of |loss - none's loss|")
print0(f"{'hook':9} {'final < start / 2':>17} {'gap < 0.01':>10} {'gap < 0.1':>9} "
       f"{'replicas identical':>18}")
for hook, r in results.items():
    gap = (max(abs(a - b) for a, b in zip(r["loss"], results["none"]["loss"]))
           if "none" in results and hook != "none" else None)
    below = ("-", "-") if gap is None else (str(gap < 0.01), str(gap < 0.1))
    print0(f"{hook:9} {str(r['loss'][-1] < r['loss'][0] / 2):>17} {below[0]:>10} {below[1]:>9} "
           f"{str(r['replicas_identical']):>18}")
# The replay: printed as facts that hold on any machine; the errors themselves go to the JSON.
print0(f"\nthe 16-bit sum, replayed at N = {', '.join(map(str, sum_ranks))} ranks "
       f"(relative error of the averaged gradient):")
for name in DTYPES:
    errs = [sums[n][name]["sum"] for n in sum_ranks]
    casts = [sums[n][name]["cast_only"] for n in sum_ranks]
    print0(f"  {name}: the sum's error grows with every doubling of N: "
           f"{all(b > a for a, b in zip(errs, errs[1:]))}; the inputs' rounding alone does not "
           f"grow: {max(casts) <= casts[0]}")
if env.world_size == 2:  # one addition: any order gives the same bits
    print0("  the real all-reduce at N = 2 equals the replay, bit for bit: "
           + ", ".join(f"{name} {r['equal_to_replay']}" for name, r in real.items()))
else:  # the backend may add in another order: the same error, not the same bits
    print0(f"  the real all-reduce's error at N = {env.world_size} within 10% of the replay's: "
           + ", ".join(f"{name} {abs(r['error'] - r['replay']) <= 0.1 * r['replay']}"
                       for name, r in real.items()))
if timing:
    print0(f"\nexposed communication: {args.time_steps} steps each with and without "
           "no_sync() timed (seconds in the JSON)")
write_json(args.json, {"psi": psi, "world_size": env.world_size, "steps": args.steps,
                       "rank": args.rank, "powersgd_start": args.powersgd_start,
                       "theory": theory, "powersgd_plan": plan, "notes": notes,
                       "timing": "seconds_per_step: wall time of forward+backward+step (noisy)",
                       "results": results,
                       "sum_ranks": sum_ranks, "sum_errors": sums, "real_all_reduce": real,
                       "exposed": timing})
teardown()

"""Out of memory on purpose: training steps under a memory cap fail like a real OOM, and
chapter 03's calculator picks what to change.

    PYTHONPATH=code python code/ch07_debugging/oom.py
    PYTHONPATH=code python code/ch07_debugging/oom.py --budget-mib 40 --json build/ch07/oom.json

One process, no torchrun: an OOM is one rank's problem, and the calculator works per rank. Each
run trains 2 steps (AdamW, fp32) of a small GPT under a cap of --budget-mib beyond what the
process holds before the model is built, and says which step and phase failed.
- On a GPU the cap is torch.cuda.set_per_process_memory_fraction, and the error is
  torch.OutOfMemoryError: "CUDA out of memory. Tried to allocate X. GPU 0 has a total capacity
  of Y of which Z is free. ... Of the allocated memory A is allocated by PyTorch, and B is
  reserved by PyTorch but unallocated. If reserved but unallocated memory is large try setting
  PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True ..." (c10/cuda/CUDACachingAllocator.cpp).
- On the CPU (Linux) the cap is RLIMIT_AS, the kernel's limit on the process's address space:
  a tensor beyond it gets ENOMEM, and torch's CPU allocator raises RuntimeError
  "DefaultCPUAllocator: can't allocate memory: you tried to allocate N bytes. Error code 12
  (Cannot allocate memory)". Nothing swaps and the machine never runs short: the cap is tens of
  MiB. Each run is a forked child (torch already imported and warmed up, as DataLoader's
  workers); the cap, and any crash an allocation failure could cause, end with it. Two settings
  make the cap count tensors, not allocator noise (both measured: without either, the runs
  below disagree with the calculator or hang):
  - one intra-op thread: GNU OpenMP's thread pool does not survive fork (the child waits
    forever for threads it does not have), and each thread's malloc arena reserves 64 MiB of
    address space (RLIMIT_AS grew 70 MiB with a second thread);
  - glibc's mmap threshold fixed at 256 KiB: by default it rises after the first large free,
    and later tensors come from the heap, which keeps freed memory (counted) for reuse.

Two runs fail, and the failing phase says which term of the calculator to cut:
A  activations: 32 sequences in one micro-batch fail in step 1's FORWARD. Activations are most of
   the calculator's total, so it picks the largest micro-batch that fits (gradient accumulation
   keeps the batch) and activation checkpointing: both then run under the same cap. Sharding
   (FSDP/ZeRO-3: states 16 Psi / N per rank) would not help: it divides the states only.
B  model states: a wider model fails in step 1's OPTIMIZER STEP, after its forward and backward
   ran: AdamW allocates its two 4-byte states per parameter at its first step. A smaller
   micro-batch cannot help; sharding over N ranks can, and the calculator says from which N.
"Fits" means the calculator's total is at most 80% of the budget: it leaves out the logits, the
loss, temporaries inside an operation and the allocator's overhead. The printed lines are exact
bytes and verdicts; the measured peaks and the errors' full text go to --json.
"""
import argparse
import os

# GPU: the caching allocator maps memory in 2 MiB pages instead of 20 MiB segments, so the cap
# counts tensors, not rounding (set before torch initialises CUDA; CPU runs ignore it)
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import ctypes
import gc
import multiprocessing as mp
import re
import resource
import sys
import time
from dataclasses import asdict, dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from distkit import pick_device, seed_everything, write_json
from distkit.memory import FP32_ADAMW, activation_bytes_per_layer, training_bytes

MiB = 2**20
HEADROOM = 0.8     # plan for at most 80% of the budget: what the calculator leaves out
FP32 = 2           # the activation formula counts 16-bit values; this model trains in fp32
STEPS = 2          # step 2 is the first with AdamW's states resident during forward/backward
M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number (malloc.h)

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--budget-mib", type=float, default=40,
                    help="memory cap per run, MiB beyond what the process holds (default 40)")
parser.add_argument("--batch", type=int, default=32,
                    help="sequences per optimizer step in case A (default 32)")
parser.add_argument("--json", help="write every run's prediction and measurement here")
args = parser.parse_args()
if not 0 < args.budget_mib <= 65536:
    parser.error(f"--budget-mib must be positive (at most 65536), got {args.budget_mib:g}")
if not 1 <= args.batch <= 1024:
    parser.error(f"--batch must be between 1 and 1024, got {args.batch}")
BUDGET = int(args.budget_mib * MiB)
DEVICE, _ = pick_device()
if DEVICE.type == "cpu" and sys.platform != "linux":
    sys.exit("oom.py: the CPU memory cap (RLIMIT_AS) is enforced on Linux only; "
             "run this on Linux or on a GPU")


# --- the model: GPT-2 layers (the layer Korthikanti's formula counts), in plain torch --------

@dataclass(frozen=True)
class Config:
    hidden: int = 64
    layers: int = 4
    heads: int = 4
    vocab: int = 128
    seq: int = 128
    batch: int = 32          # sequences per optimizer step
    micro_batch: int = 32    # sequences per forward/backward; batch / micro_batch accumulated
    checkpoint: bool = False  # activation checkpointing of every layer


class Block(nn.Module):
    """Pre-norm attention + 4h GELU MLP. SDPA's fused kernel keeps no s x s scores."""
    def __init__(self, c: Config):
        super().__init__()
        self.heads = c.heads
        self.ln1, self.ln2 = nn.LayerNorm(c.hidden), nn.LayerNorm(c.hidden)
        self.qkv, self.proj = nn.Linear(c.hidden, 3 * c.hidden), nn.Linear(c.hidden, c.hidden)
        self.fc1, self.fc2 = nn.Linear(c.hidden, 4 * c.hidden), nn.Linear(4 * c.hidden, c.hidden)

    def forward(self, x):
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, s, h))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, c: Config):
        super().__init__()
        self.c = c
        self.embed = nn.Embedding(c.vocab, c.hidden)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.layers))
        self.norm, self.head = nn.LayerNorm(c.hidden), nn.Linear(c.hidden, c.vocab, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:  # checkpointing keeps each block's input, recomputes the rest
            x = checkpoint(block, x, use_reentrant=False) if self.c.checkpoint else block(x)
        return self.head(self.norm(x))


def num_params(c: Config) -> int:
    with torch.device("meta"):  # shapes only: no memory
        return sum(p.numel() for p in GPT(c).parameters())


# --- chapter 03's calculator ------------------------------------------------------------------

def calculator(c: Config, world_size: int = 1, stage: int = 0) -> dict:
    """Per-rank bytes from distkit.memory: model states (fp32 AdamW: 4 + 4 + 8 bytes/param,
    ZeRO `stage` over `world_size` ranks) and the activations of one micro-batch."""
    b = training_bytes(num_params(c), world_size=world_size, stage=stage, recipe=FP32_ADAMW,
                       layers=c.layers, seq=c.seq, micro_batch=c.micro_batch, hidden=c.hidden,
                       heads=c.heads, recompute="full" if c.checkpoint else "selective")
    activations = FP32 * b["activations"]
    if c.checkpoint:  # backward recomputes one layer at a time: its activations live again
        activations += FP32 * activation_bytes_per_layer(c.seq, c.micro_batch, c.hidden,
                                                         c.heads, recompute="selective")
    states = b["params"] + b["grads"] + b["optimizer"]
    total = int(states + activations)
    return {"states": int(states), "activations": int(activations), "total": total,
            "percent_of_budget": 100 * total // BUDGET, "fits": total <= HEADROOM * BUDGET}


# --- a training step under the cap ------------------------------------------------------------

def held() -> int:
    """What the cap counts now: the address space (CPU) or the caching allocator's reserve."""
    if DEVICE.type == "cuda":
        return torch.cuda.memory_reserved(DEVICE)
    with open("/proc/self/status") as f:  # VmSize: the address space, in kB
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))


def peak() -> int:
    if DEVICE.type == "cuda":
        return torch.cuda.max_memory_reserved(DEVICE)
    with open("/proc/self/status") as f:  # VmPeak: the address space's peak
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmPeak:"))


def cap_memory(budget: int) -> str:
    """Let this process hold at most `budget` bytes more than it holds now."""
    if DEVICE.type == "cuda":
        # The caching allocator checks a request against the cap at the size of a new segment
        # (20 MiB for requests of 1-10 MiB), even when it maps less: allow one segment more.
        total = torch.cuda.get_device_properties(DEVICE).total_memory
        torch.cuda.set_per_process_memory_fraction(
            min(1.0, (held() + budget + 20 * MiB) / total), DEVICE)
        return "torch.cuda.set_per_process_memory_fraction"
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (held() + budget, hard))  # the child's own limit
    return "RLIMIT_AS"


OOM_MESSAGES = ("CUDA out of memory", "DefaultCPUAllocator: can't allocate memory")


def is_oom(e: BaseException) -> bool:
    return isinstance(e, (torch.OutOfMemoryError, MemoryError)) or any(
        m in str(e) for m in OOM_MESSAGES)


def train(c: Config, budget: int) -> dict:
    """STEPS optimizer steps of `c` under the cap: ran, or the step and phase that failed."""
    seed_everything(0)
    g = torch.Generator().manual_seed(0)
    if DEVICE.type == "cuda":
        torch.cuda.reset_peak_memory_stats(DEVICE)
    start, cpu, base = time.perf_counter(), time.process_time(), held()
    out = {"cap": cap_memory(budget), "ran": True, "step": None, "phase": None, "error": None}
    step, phase = 0, "building the model"
    try:
        model = GPT(c).to(DEVICE)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)  # no state until step 1
        accumulate = c.batch // c.micro_batch
        for step in range(1, STEPS + 1):
            for _ in range(accumulate):
                tokens = torch.randint(0, c.vocab, (c.micro_batch, c.seq + 1), generator=g)
                tokens = tokens.to(DEVICE)
                phase = "forward"
                logits = model(tokens[:, :-1])
                loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
                del logits  # the autograd graph keeps what backward needs
                phase = "backward"
                (loss / accumulate).backward()
                del loss
            phase = "optimizer.step"
            optimizer.step()  # step 1: AdamW allocates exp_avg and exp_avg_sq (8 bytes/param)
            optimizer.zero_grad()  # set_to_none: gradients freed until the next backward
    except Exception as e:
        if not is_oom(e):
            raise
        tried = re.search(r"tried to allocate (\d+) bytes", str(e))  # the CPU allocator's words
        out.update(ran=False, step=step, phase=phase, error_type=type(e).__name__,
                   error=str(e), tried_bytes=int(tried.group(1)) if tried else None)
    # measured, machine-dependent: what the cap counted at its peak, and the time
    out.update(peak_bytes=peak() - base, seconds=time.perf_counter() - start,
               cpu_seconds=time.process_time() - cpu)
    if DEVICE.type == "cuda":
        torch.cuda.set_per_process_memory_fraction(1.0, DEVICE)
    return out


def run(c: Config) -> dict:
    """train(c) under the cap: on the CPU in a forked child, on a GPU in this process."""
    if DEVICE.type == "cuda":  # (a CUDA context does not survive fork)
        result = train(c, BUDGET)
        gc.collect()
        torch.cuda.empty_cache()
        return result
    # fork, as DataLoader workers on Linux: the child starts with torch imported and warmed up
    ctx = mp.get_context("fork")
    receive, send = ctx.Pipe(duplex=False)
    child = ctx.Process(target=lambda: send.send(train(c, BUDGET)))
    child.start()
    send.close()  # our copy: a child that dies then shows as EOF, not as a wait
    try:
        result = receive.recv() if receive.poll(30) else None
    except EOFError:
        result = None
    child.join(10)
    if result is None:
        child.kill()
        raise SystemExit(f"oom.py: the run of {c} ended without a result "
                         f"(exit code {child.exitcode})")
    return result


# --- the lesson -------------------------------------------------------------------------------

def describe(c: Config) -> str:
    how = (f"micro-batch {c.micro_batch} x {c.batch // c.micro_batch} accumulated"
           if c.micro_batch < c.batch else f"batch {c.batch} in one micro-batch")
    return how + (", every layer checkpointed" if c.checkpoint else "")


def predicted(p: dict) -> str:
    return (f"states {p['states']:,} + activations {p['activations']:,} = {p['total']:,} "
            f"bytes, {p['percent_of_budget']}% of the budget, fits: {p['fits']}")


def show(label: str, c: Config, note: str = "") -> tuple[dict, dict]:
    """The calculator's verdict, then the run under the cap: what it did, in one line."""
    p = calculator(c)
    print(f"{label}: {describe(c)}{note}\n    calculator: {predicted(p)}")
    r = run(c)
    if r["ran"]:
        print(f"    ran: True ({STEPS} steps)")
    else:
        said = next((m for m in OOM_MESSAGES if m in r["error"]), "out of memory")
        print(f"    ran: False, out of memory in step {r['step']} {r['phase']} "
              f"({r['error_type']}: \"{said}\")")
    results.append({"label": label, "config": asdict(c), "calculator": p, **r})
    return p, r


def warm_up() -> None:
    """One tiny step here, first: what a first call costs (kernels, the optimizer's imports)
    is then paid once, not in every run, and not under the cap."""
    model = GPT(Config(hidden=16, layers=1, vocab=8, seq=8, batch=2, micro_batch=2,
                       checkpoint=True)).to(DEVICE)
    tokens = torch.zeros(2, 8, dtype=torch.long, device=DEVICE)
    optimizer = torch.optim.AdamW(model.parameters())
    F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten()).backward()
    optimizer.step()


if DEVICE.type == "cpu":
    torch.set_num_threads(1)  # before any OpenMP thread exists: see the docstring
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)  # glibc's; absent elsewhere
    if mallopt:
        mallopt(M_MMAP_THRESHOLD, 256 * 1024)  # blocks >= 256 KiB: mmap'd, unmapped at free
warm_up()

results = []
print(f"budget: {args.budget_mib:g} MiB = {BUDGET:,} bytes per run beyond what the process "
      f"holds; fits: the calculator's total <= {HEADROOM:.0%} of it")

# A: a forward that runs out: activations
a = Config(batch=args.batch, micro_batch=args.batch)
print(f"\nA. GPT, {a.layers} layers, hidden {a.hidden}, {a.heads} heads, vocab {a.vocab}, "
      f"seq {a.seq}: {num_params(a):,} parameters, fp32 AdamW")
p, _ = show("A1", a)
print(f"    activations are {100 * p['activations'] // p['total']}% of it. The calculator's "
      "options:")
for n in (2, 8, 64):
    print(f"      FSDP/ZeRO-3 over {n} ranks: {predicted(calculator(a, n, 3))}")
micro = max((m for m in range(1, a.batch) if a.batch % m == 0
             and calculator(replace(a, micro_batch=m))["fits"]), default=None)
if micro:
    show("A2", replace(a, micro_batch=micro), " (the largest micro-batch that fits)")
else:
    print("      no smaller micro-batch fits")
show("A3", replace(a, checkpoint=True))

# B: an optimizer step that runs out: model states
b = Config(hidden=256, batch=1, micro_batch=1)
psi = num_params(b)
print(f"\nB. GPT, {b.layers} layers, hidden {b.hidden}: {psi:,} parameters, fp32 AdamW: "
      f"16 x {psi:,} = {16 * psi:,} bytes of model states")
p, r = show("B1", b)
if r["phase"] == "optimizer.step":
    print(f"    step {r['step']}'s forward and backward ran: AdamW allocates its states "
          "(exp_avg, exp_avg_sq: 8 bytes/param) at its first step")
print(f"    states are {100 * p['states'] // p['total']}% of it: a smaller micro-batch cannot "
      "help. The calculator's options:")
for n in (2, 4, 8):
    print(f"      FSDP/ZeRO-3 over {n} ranks: {predicted(calculator(b, n, 3))}")
shards = next((n for n in (2, 4, 8, 16, 32, 64) if calculator(b, n, 3)["fits"]), None)

agree = all(r["calculator"]["fits"] == r["ran"] for r in results)
print(f"\nthe calculator's 'fits' matched every run: {agree}")
write_json(args.json, {"budget_bytes": BUDGET, "headroom": HEADROOM, "device": DEVICE.type,
                       "steps": STEPS, "runs": results, "micro_batch_case_a": micro,
                       "fsdp_ranks_case_b": shards, "agree": agree})

"""Chapter 03: one FSDP2 training step of a real Llama size on N simulated ranks, on a laptop.

    PYTHONPATH=code python code/ch03_zero/simulate_fsdp.py --points 8b:8,70b:64 --json /tmp/s.json

torch's fake process group plays all N ranks' collectives (they return at once; nothing is
sent) and FakeTensorMode gives every tensor its shape, dtype and device but no memory. So a
transformers LlamaForCausalLM built from a published configuration, sharded with fully_shard per
decoder layer and then at the root, can run training steps (forward, backward, AdamW) while
torch's FSDPMemTracker counts the bytes rank 0 would hold, by category: a 70B model on 64
"ranks" in about a minute and half a GiB of RAM. The second step is the one measured: in the
first, AdamW creates its state only at the end. Model states are read after its optimizer step;
the peak is the moment of the step when the total was highest. The step's collectives are
logged too (distkit.comm.CollectiveLog: op, dtype, group, bytes), for chapter 08's speed
model. By default float32 throughout, no activation checkpointing: the chapter's formulas with
the fp32 AdamW recipe (4 + 4 + 8 bytes per parameter). Chapter 08 varies the rest: --precision
bf16 (FSDP2's MixedPrecisionPolicy, bf16 compute, fp32 gradient reduction), --ac
none|selective|full, --attn eager|sdpa.

What it cannot see (printed with every result): it runs torch's CPU code paths. AdamW takes its
single-tensor path on CPU, so the CUDA foreach path's temporaries (about 4 bytes per sharded
parameter) never appear; there are no CUDA streams, so no all-gather prefetch overlaps compute
and no allocator caching or fragmentation; the CUDA context is absent; the trackers are private
torch APIs (torch.distributed._tools).
"""
import argparse
import json
import resource
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.testing._internal.distributed.fake_pg import FakeStore

from distkit import int_list
from distkit.comm import CollectiveLog
from distkit.memory import LLAMA_CONFIGS as MODELS  # Llama 3.2 1B, 3.1 8B and 70B, typed in
from distkit.memory import sac_context_fn

# Megatron-style tensor parallelism of a LlamaDecoderLayer (q, k, v, gate, up split by
# columns, o and down by rows: one all-reduce each for attention and MLP, no sequence
# parallelism). The root (embeddings, LM head) stays whole on the tp ranks, sharded by FSDP
# over dp only: splitting it (torchtitan's vocabulary-parallel plan) would untie 1B's tied
# embeddings and needs a vocabulary-parallel loss.
TP_LAYER = {"self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
            "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel()}
LIMITS = ("CPU code paths: AdamW's single-tensor step (no foreach temporaries), no CUDA streams "
          "(no prefetch overlap), no allocator fragmentation, no CUDA context")

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--models", default="8b", help=f"comma list of {', '.join(MODELS)}")
parser.add_argument("--ranks", type=int_list, default=[8], help="simulated ranks, comma list")
parser.add_argument("--points", help="model:ranks pairs instead of every model x every rank "
                    "count, e.g. 8b:8,70b:64")
parser.add_argument("--seq", type=int, default=2048, help="tokens per sequence")
parser.add_argument("--batch", type=int, default=1, help="sequences per rank")
parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32",
                    help="bf16: MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)")
parser.add_argument("--ac", choices=["none", "selective", "full"], default="none",
                    help="activation checkpointing of every decoder layer: selective saves "
                    "distkit.memory.SAC_POLICY's operators, full only the layer's input")
parser.add_argument("--checkpoint", action="store_const", dest="ac", const="full",
                    help="the same as --ac full")
parser.add_argument("--attn", choices=["eager", "sdpa"], default="sdpa",
                    help="attention implementation (eager saves the s x s probabilities)")
parser.add_argument("--tp", type=int, default=1,
                    help="tensor-parallel ranks: a 2-D mesh (ranks / tp data-parallel x tp)")
parser.add_argument("--json", help="write the bytes per category here")
args = parser.parse_args()
try:
    points = [(m, int(n)) for m, n in (p.split(":") for p in args.points.split(","))] \
        if args.points else [(m, n) for m in args.models.split(",") for n in args.ranks]
except ValueError:
    parser.error(f"--points: expected model:ranks pairs such as 8b:8,70b:64, got {args.points!r}")
if unknown := sorted({m for m, _ in points} - set(MODELS)):
    parser.error(f"unknown model(s) {', '.join(unknown)}; choose from {', '.join(MODELS)}")
if not points or min(n for _, n in points) < 1 or args.seq < 2 or args.batch < 1:
    parser.error("need --ranks >= 1, --seq >= 2 and --batch >= 1")
if args.tp < 1 or any(n % args.tp for _, n in points):
    parser.error(f"--tp {args.tp}: every rank count must be a multiple of it")

with warnings.catch_warnings():  # transformers imports tqdm, which may warn about ipywidgets
    warnings.simplefilter("ignore")
    from transformers import LlamaConfig, LlamaForCausalLM


def category(key) -> str:
    return str(getattr(key, "value", key))


def shard(model, mesh, policy):
    """FSDP2: every decoder layer, then the root (embeddings, final norm, LM head)."""
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)


def simulate(name: str, ranks: int) -> dict:
    """One training step of `name` as rank 0 of `ranks`; bytes by category."""
    start = time.time()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=ranks)
    mesh = init_device_mesh("cpu", (ranks // args.tp, args.tp), mesh_dim_names=("dp", "tp")) \
        if args.tp > 1 else {"dp": init_device_mesh("cpu", (ranks,))}
    config = LlamaConfig(**MODELS[name], max_position_embeddings=args.seq,
                         attn_implementation=args.attn)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if args.precision == "bf16" else MixedPrecisionPolicy()
    fake = FakeTensorMode()
    with fake:
        model = LlamaForCausalLM(config)
    if args.tp > 1:  # outside the fake mode: the 2-D mesh's bookkeeping runs on real tensors
        for layer in model.model.layers:
            parallelize_module(layer, mesh["tp"], TP_LAYER)
        shard(model, mesh["dp"], policy)
    with fake:
        if args.ac != "none":  # full: each layer keeps its input and reruns its forward in backward
            kwargs = {"use_reentrant": False}
            if args.ac == "selective":  # ...and keeps its matmuls' and attention's outputs
                kwargs["context_fn"] = sac_context_fn()
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        if args.tp == 1:
            shard(model, mesh["dp"], policy)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        tokens = torch.randint(0, config.vocab_size, (args.batch, args.seq))
        # The first step creates AdamW's state inside optimizer.step(), after the backward: a
        # first step's peak lacks it. So one step untracked, then the steady state: the second.
        model(input_ids=tokens, labels=tokens).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        tracker = FSDPMemTracker(model, optimizer)
        tracker.track_inputs((tokens,))
        with tracker:
            model(input_ids=tokens, labels=tokens).loss.backward()
            optimizer.step()
            after_step = tracker.get_tracker_snapshot("current")
            optimizer.zero_grad()
        peak = tracker.get_tracker_snapshot("peak")
    num_params = sum(p.numel() for p in model.parameters())  # global sizes of the DTensors
    dist.destroy_process_group()
    (device,) = peak
    return {"model": name, "ranks": ranks, "num_params": num_params, "seq": args.seq,
            "batch": args.batch, "checkpoint": args.ac == "full", "ac": args.ac,
            "precision": args.precision, "attn": args.attn, "tp": args.tp,
            "seconds": time.time() - start,
            "after_step": {category(k): v for k, v in after_step[device].items()},
            "peak": {category(k): v for k, v in peak[device].items()}}


def last_step(collectives) -> dict:
    """The measured step's collectives, from a log of both steps (and a 2-D mesh's set-up): the
    longest tail that repeats the stretch just before it (the two steps are the same step).
    By (op, dtype, group size): count and bytes."""
    key = [(c.op, c.dtype.removeprefix("torch."), len(c.ranks), c.nbytes) for c in collectives]
    n = len(key)
    k = next(k for k in range(n // 2, -1, -1) if key[n - 2 * k:n - k] == key[n - k:])
    out = {}
    for op, dtype, size, nbytes in key[n - k:]:
        c = out.setdefault(f"{op} {dtype} over {size}", {"count": 0, "bytes": 0})
        c["count"] += 1
        c["bytes"] += nbytes
    return out


results = []
print(f"{'model':5s} {'ranks':>5s} {'params':>7s} {'states GiB':>10s} {'peak GiB':>8s} "
      f"{'seconds':>7s}  (rank 0, fp32 AdamW, {args.precision}, checkpointing {args.ac}, "
      f"{args.attn}, seq x batch = {args.seq} x {args.batch})")
for name, ranks in points:
    with CollectiveLog() as log:  # FSDP2's collectives, read off the simulated steps
        r = simulate(name, ranks)
    r["collectives"] = last_step(log.collectives)
    results.append(r)
    states = sum(r["after_step"].get(k, 0) for k in ("Sharded Param", "Sharded Grad", "OptState"))
    print(f"{name:5s} {ranks:5d} {r['num_params'] / 1e9:6.2f}B {states / 2**30:10.2f} "
          f"{r['peak']['Total'] / 2**30:8.1f} {r['seconds']:7.1f}", flush=True)
rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
print(f"this process peaked at {rss / 2**30:.2f} GiB of RAM")
print(f"limits: {LIMITS}")
if args.json:
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    command = "PYTHONPATH=code python code/ch03_zero/simulate_fsdp.py " + " ".join(sys.argv[1:])
    Path(args.json).write_text(json.dumps({"command": command, "torch": torch.__version__,
                                           "limits": LIMITS, "results": results,
                                           "max_rss_bytes": rss}, indent=1))

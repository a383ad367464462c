"""Chapter 04: what fully_shard does in a training step, and what each of its knobs costs, measured.

    code/run_w_torchrun.sh 2 ch04_fsdp2/inside_fsdp2.py --json build/ch04/inside.json

One launch trains the same seeded tiny Llama for --steps AdamW steps in every configuration
below, and checks its losses against one process training on the whole global batch. For each
it measures, on every rank: the bytes it holds at rest (parameters, gradients, AdamW state:
the storages themselves, padding included), its peak by category during the first step (torch's
FSDPMemTracker; MemTracker for DDP), and every collective of the second step in order, with its
bytes and group (distkit.comm.CollectiveLog, a dispatch mode like CommDebugMode); for the
configurations in PROFILED also the FSDP unit that issued each and FSDP's own ranges (torch's
profiler, which costs more than the step itself: only where the chapter reads them). The time of
each later step, run without any tracker, goes to the JSON only (CPU/gloo: noisy).
"""
import argparse
import contextlib
import os
import time
import warnings

import torch
import torch.distributed as dist
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed.fsdp import (CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy,
                                    fully_shard)
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

from distkit import print0, print_ranks, seed_everything, setup, teardown, write_json
from distkit.comm import CollectiveLog
from distkit.dist import grad_check, grad_norms
from distkit.memory import by_category, communication_bytes, storage_bytes
from distkit.toy import counting_data, tiny_llama

CONFIGS = {  # name: what differs from "fsdp2" (fully_shard per decoder layer, then the root)
    "ddp": "DDP, the baseline: everything replicated",
    "fsdp2": "fully_shard per decoder layer, then the root (defaults)",
    "root-only": "fully_shard(model) alone: one unit, the whole model gathered at once",
    "split-root": "the embedding and the LM head get units of their own (as torchtitan)",
    "no-reshard": "reshard_after_forward=False: keep gathered parameters until backward",
    "reshard-root": "reshard_after_forward=True on the root too",
    "bf16": "MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)",
    "keep-last": "the last layer not resharded after forward (backward needs it first)",
    "prefetch": "explicit forward prefetching: each layer's pre-forward gathers the next layer",
    "checkpoint": "activation checkpointing of every decoder layer, then fully_shard",
    "accumulate": "2 micro-batches per step, gradients reduced on the last only",
    "accumulate-kept": "accumulate, layers kept gathered from first forward to last backward",
    "clip": "clip_grad_norm_(max_norm=0.1) on DTensor gradients",
    "offload": "CPUOffloadPolicy: shards, gradients and AdamW on the CPU (GPU only)",
}
DEFAULT = [c for c in CONFIGS if c != "offload"]  # offloading needs a GPU to offload from
PROFILED = {"fsdp2", "prefetch", "reshard-root"}  # the configurations whose FSDP units we print
parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--configs", default=",".join(DEFAULT),
                    help="comma list of " + ", ".join(CONFIGS))
parser.add_argument("--layers", type=int, default=4, help="decoder layers")
parser.add_argument("--batch-size", type=int, default=4, help="sequences per rank and step")
parser.add_argument("--steps", type=int, default=3, help="AdamW steps per configuration (>= 2)")
parser.add_argument("--json", help="write every measurement here (rank 0)")
parser.add_argument("--no-table", action="store_true",
                    help="print the DTensor and one step's collectives only; the table of every "
                         "configuration goes to the JSON (\"table\"), to be printed later")
args = parser.parse_args()
configs = args.configs.split(",")
if unknown := [c for c in configs if c not in CONFIGS]:
    parser.error(f"unknown config {', '.join(unknown)}; choose from {', '.join(CONFIGS)}")
if "offload" in configs and not torch.cuda.is_available():
    parser.error("offload: CPUOffloadPolicy moves shards from a GPU to the CPU; this machine has "
                 "no GPU (on CPU, parameters already live in CPU memory)")
if args.layers < 2 or args.steps < 2 or args.batch_size < 2 or args.batch_size % 2:
    parser.error("need --layers >= 2, --steps >= 2 and an even --batch-size >= 2")
if int(os.environ.get("WORLD_SIZE", 1)) * args.batch_size > 256:
    parser.error("need WORLD_SIZE x --batch-size <= 256 sequences")
# CommDebugMode's module tracker hooks every module's backward; transformers' dict outputs make
# torch warn that such hooks may not fire, and FSDP2 that the root returns a view. Not ours.
warnings.filterwarnings("ignore", message="(For backward hooks|Full backward hook|FSDP2-wrapped)")
LR, MAX_NORM = 1e-3, 0.1
WATCHED = {"embedding": "model.embed_tokens",  # modules whose output dtype bf16 configs record
           "RMSNorm": "model.layers.0.input_layernorm",
           "decoder layer (residual stream)": "model.layers.0", "logits": "lm_head"}


def build():
    seed_everything(0)  # the same full model on every rank and in the reference
    return tiny_llama(layers=args.layers).to(env.device)


def wrap(config: str, model):
    """The lines that differ between the configurations: how the model is sharded."""
    if config == "ddp":
        return DDP(model, gradient_as_bucket_view=True)
    layers = list(model.model.layers)
    if config == "checkpoint":  # recompute each layer's activations in backward (before sharding)
        model.config.use_cache = False  # no KV cache to keep in training (else transformers warns)
        model.activation_checkpointing_enable(
            activation_checkpointing_kwargs={"use_reentrant": False})
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if config == "bf16" else MixedPrecisionPolicy()
    # offload: the shards (and so AdamW) live in CPU memory; copied to the GPU to be gathered
    kw = dict(mp_policy=mp,
              offload_policy=CPUOffloadPolicy() if config == "offload" else OffloadPolicy())
    if config != "root-only":
        for i, layer in enumerate(layers):
            # keep-last (torchtitan's earlier heuristic): backward starts with the last layer, so
            # resharding it after its forward only to gather it again at once is a wasted all-gather
            keep = config in ("no-reshard", "accumulate-kept") or (
                config == "keep-last" and i == len(layers) - 1)
            fully_shard(layer, reshard_after_forward=not keep, **kw)
    if config == "split-root":  # what stays in the root is gathered for the whole step: for an
        # LLM the embedding and the LM head (2 x vocab x hidden). The embedding reshards after
        # its forward; the head, needed first in backward, stays gathered until then. (torchtitan
        # groups fully_shard([norm, output]): one collective for both; torch 2.13's
        # FSDPMemTracker cannot follow such a grouped unit, so the tiny norm stays in the root.)
        fully_shard(model.model.embed_tokens, **kw)
        fully_shard(model.lm_head, reshard_after_forward=False, **kw)
    # None (the default) reshards every unit but the root: backward needs the root's first
    root_reshard = {"no-reshard": False, "reshard-root": True}.get(config)
    fully_shard(model, reshard_after_forward=root_reshard, **kw)
    if config == "prefetch":  # issue the next unit's all-gather before this unit computes
        for before, after in zip(layers, layers[1:]):  # (backward prefetches 1 by default)
            before.set_modules_to_forward_prefetch([after])
    return model


def train_step(config: str, model, optimizer, tokens, between=None, grads=None) -> float:
    if config.startswith("accumulate"):  # two half batches; reduce-scatter only after the second
        losses = []
        for i, half in enumerate(tokens.chunk(2)):
            if i and between:
                between()
            model.set_requires_gradient_sync(i == 1)
            if config == "accumulate-kept":  # no reshard after the first backward: the second
                model.set_reshard_after_backward(i == 1)  # forward needs no all-gather
            loss = model(input_ids=half, labels=half).loss / 2  # mean over the whole batch
            loss.backward()
            losses.append(loss.detach())
        loss = sum(losses)
    else:
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
    if grads is not None and config != "offload":  # step 1's gradients (before clipping), for
        grads.update(grad_norms(model))  # the parity check (offload's are on the host: skipped)
    if config == "clip":  # the norm over all shards: DTensor gathers the partial sums for us
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        norms.append(norm.full_tensor().item() if isinstance(norm, DTensor) else norm.item())
    optimizer.step()
    optimizer.zero_grad()
    loss = loss.detach().clone()
    dist.all_reduce(loss)  # the global batch's loss: every rank's share, averaged
    return loss.item() / env.world_size


@contextlib.contextmanager
def output_dtypes(model):
    """The dtype of a few modules' outputs in the forwards run inside the block."""
    seen = {}

    def note(name):
        def hook(_module, _args, out):  # returns None: the output itself is left as it is
            out = out[0] if isinstance(out, tuple) else out
            seen.setdefault(name, str(out.dtype).removeprefix("torch."))
        return hook
    inner = model.module if isinstance(model, DDP) else model
    hooks = [inner.get_submodule(path).register_forward_hook(note(name))
             for name, path in WATCHED.items()]
    try:
        yield seen
    finally:
        for hook in hooks:
            hook.remove()


def held(model, optimizer) -> dict:
    state = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    params = storage_bytes(model.parameters())
    local = sum((p.to_local() if isinstance(p, DTensor) else p).nbytes for p in model.parameters())
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    everything = [*model.parameters(), *grads, *state]
    on_host = [t for t in everything if t.device.type == "cpu"]
    return {"params": params, "grads": storage_bytes(grads), "optimizer": storage_bytes(state),
            "padding": params - local, "host": storage_bytes(on_host),
            "device": storage_bytes(t for t in everything if t.device.type != "cpu")}


def run(config: str) -> dict:
    model = wrap(config, build())
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    if config == "ddp":
        tracker = MemTracker()
        tracker.track_external(model, optimizer)
    else:
        tracker = FSDPMemTracker(model, optimizer)
    losses, times, grads = [], [], {}  # times: of the steps after the two tracked ones
    for step in range(args.steps):
        start = time.perf_counter()
        if step == 0:  # memory: the first step, where AdamW creates its state
            with tracker:  # (the tracker needs its per-module stats reset between forwards)
                losses.append(train_step(config, model, optimizer, mine, tracker.reset_mod_stats,
                                         grads))
            peak = by_category(tracker.get_tracker_snapshot("peak"), env.device)
        elif step == 1:  # collectives: the second step (the first also initialises)
            with CollectiveLog(profile=config in PROFILED) as log:
                losses.append(train_step(config, model, optimizer, mine))
        else:
            losses.append(train_step(config, model, optimizer, mine))
            times.append(time.perf_counter() - start)
    # gradients at rest: zero_grad(set_to_none) dropped them; one more backward brings them back
    # (bf16: noting the dtype of some modules' outputs on the way)
    watch = output_dtypes(model) if config == "bf16" else contextlib.nullcontext({})
    with watch as dtypes:
        loss = model(input_ids=mine, labels=mine).loss
        loss.backward()
    if config == "bf16":  # (the bf16 run against autocast: section 3)
        dtypes["loss"] = str(loss.dtype).removeprefix("torch.")
    at_rest = held(model, optimizer)
    optimizer.zero_grad()
    return {"losses": losses, "grad_norms": grads or None, "step_s": times, "held": at_rest,
            "peak": peak, "dtypes": dtypes,
            "collectives": [vars(c) for c in log.collectives], "ranges": log.ranges}


def reference(clip: bool) -> tuple[list, list, dict]:
    """One process, the whole global batch, plain AdamW: the losses every configuration must
    give, the gradient norms, and step 1's gradient norm per parameter."""
    model = build()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    losses, ref_norms, grads = [], [], None
    for _ in range(args.steps):
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        grads = grads or grad_norms(model)
        if clip:
            ref_norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).item())
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, ref_norms, grads


env = setup()
(tokens,) = counting_data(env.world_size * args.batch_size)[:]
tokens = tokens.to(env.device)
mine = tokens[env.rank * args.batch_size:(env.rank + 1) * args.batch_size]
full = build()
num_params = sum(p.numel() for p in full.parameters())
root_params = num_params - sum(p.numel() for p in full.model.layers.parameters())
# What FSDP2 communicates: each parameter with its first dimension padded to a multiple of N
# (the same as num_params when N divides every first dimension)
padded = {n: -(-p.shape[0] // env.world_size) * env.world_size * p.numel() // p.shape[0]
          for n, p in full.named_parameters()}
psi = sum(padded.values())
psi_root = psi - sum(v for n, v in padded.items() if n.startswith("model.layers."))
divides = psi == num_params

# 1. A sharded parameter is a DTensor: a global shape, and on each rank the rows it stores.
demo = wrap("fsdp2", build())
w = demo.model.layers[0].self_attn.q_proj.weight
print0(f"type(model): {type(demo).__name__} (fully_shard made its class an FSDPModule)")
print0(f"layers[0].self_attn.q_proj.weight: {type(w).__name__}, global shape {tuple(w.shape)}, "
       f"placements {w.placements}, mesh {w.device_mesh.mesh.tolist()}")
rows = -(-w.shape[0] // env.world_size)  # torch.chunk: ceil(d0 / N) rows each, the last fewer
start = min(env.rank * rows, w.shape[0])
print_ranks(f"stores rows {start}-{start + w.to_local().shape[0] - 1}: "
            f"local shape {tuple(w.to_local().shape)}")
del demo, w

# Autocast, for contrast with MixedPrecisionPolicy: op by op, on fp32 parameters
with output_dtypes(full) as autocast_dtypes, torch.no_grad(), \
        torch.autocast(env.device.type, dtype=torch.bfloat16):
    loss = full(input_ids=mine, labels=mine).loss
    autocast_dtypes["loss"] = str(loss.dtype).removeprefix("torch.")
single, _, single_grads = reference(clip=False)
single_clip, ref_norms, _ = reference(clip=True)
results, norms = {}, []
for config in configs:
    results[config] = run(config)
if "clip" in configs:
    results["clip"]["norms"] = norms
every_rank = [None] * env.world_size
dist.all_gather_object(every_rank, {c: r["held"] for c, r in results.items() if "held" in r})

# 2. One step of the default configuration, collective by collective (rank 0's view).
if "fsdp2" in configs:
    print0("\nfsdp2, step 2, in order: collective, bytes, FSDP unit "
           "(root = embeddings, norm, head)")
    for c in results["fsdp2"]["collectives"]:
        who = (c["unit"] or "root") if c["fsdp_step"] else "(ours: the loss, averaged for the log)"
        when = ("backward" if c["backward"] else "forward") if c["fsdp_step"] else "after"
        print0(f"  {when:8s} {c['op']:14s} {c['nbytes']:>9,d} B  {who}")
    gathered = {b: sum(c["nbytes"] for c in results["fsdp2"]["collectives"]
                       if c["op"] == "all_gather" and c["backward"] == b) for b in (False, True)}
    scattered = sum(c["nbytes"] for c in results["fsdp2"]["collectives"]
                    if c["op"] == "reduce_scatter")
    if not divides:
        print0(f"(N = {env.world_size} does not divide every first dimension: Psi counts "
               "the parameters padded)")
    print0(f"all-gathered in forward  = 4 B x Psi:                    {gathered[False] == 4 * psi}")
    print0(f"all-gathered in backward = 4 B x (Psi - the root's):     "
           f"{gathered[True] == 4 * (psi - psi_root)}")
    print0(f"reduce-scattered         = 4 B x Psi:                    {scattered == 4 * psi}")
    if "reshard-root" in configs:
        total = sum(c["nbytes"] for c in results["reshard-root"]["collectives"] if c["fsdp_step"])
        print0(f"reshard-root: FSDP's collectives = 3 x 4 B x Psi (ZeRO-3's 3 Psi): "
               f"{total == 3 * 4 * psi}")

# 3. Every configuration: collectives per step, bytes held at rest, parity.
table = []  # its lines: printed here, or with --no-table by whoever reads the JSON
table.append(f"{num_params:,} parameters; collectives in step 2: count and bytes; bytes each "
             f"rank holds at rest (the largest over ranks), and their sum / DDP's")
table.append(f"{'config':13s}{'gathers':>8s}{'scatters':>9s}{'reduces':>8s}{'bytes':>11s}"
             f"{'params':>10s}{'grads':>10s}{'AdamW':>11s}{'/ DDP':>7s}  losses, step-1 "
             "gradients = 1 process")
for config in configs:
    res = results[config]
    count = {op: sum(c["op"] == op for c in res["collectives"])
             for op in ("all_gather", "reduce_scatter", "all_reduce")}
    moved = sum(c["nbytes"] for c in res["collectives"])
    h = {k: max(r[config][k] for r in every_rank) for k in ("params", "grads", "optimizer")}
    ddp = sum(every_rank[0]["ddp"][k] for k in h) if "ddp" in configs else None
    res["vs_ddp"] = sum(h.values()) / ddp if ddp else None
    want = single_clip if config == "clip" else single
    tol = 1e-2 if config == "bf16" else 1e-5  # bf16 rounds every matmul's inputs
    res["losses_match"] = max(abs(a - b) for a, b in zip(res["losses"], want)) < tol
    # step 1's gradient norms (before clipping), of the largest; None: not compared (offload)
    check = grad_check(res["grad_norms"], single_grads) if res["grad_norms"] else None
    res["grads_match"] = check and check["gap"] < tol
    res["grad_scale"] = check and check["scale"]
    vs = f"{res['vs_ddp']:7.3f}" if ddp else f"{'':7s}"
    table.append(f"{config:13s}{count['all_gather']:8d}{count['reduce_scatter']:9d}"
                 f"{count['all_reduce']:8d}{moved:11,d}{h['params']:10,d}{h['grads']:10,d}"
                 f"{h['optimizer']:11,d}{vs}  < {tol:g}: {res['losses_match']}, "
                 f"{res['grads_match']}")
if "ddp" in configs and "fsdp2" in configs:
    ratio = results["fsdp2"]["vs_ddp"]
    table.append(f"fsdp2 holds 1/N = 1/{env.world_size} of DDP's bytes within 2%: "
                 f"{abs(ratio * env.world_size - 1) <= 0.02}; padding of the parameters (dim 0 "
                 f"rounded up to a multiple of N), per rank: "
                 f"{[r['fsdp2']['padding'] for r in every_rank]} B")
if "offload" in configs:
    h = results["offload"]["held"]
    table.append(f"offload: bytes at rest in host memory {h['host']:,}, on the GPU "
                 f"{h['device']:,}")
if "clip" in configs:
    same = max(abs(a - b) for a, b in zip(norms, ref_norms)) < 1e-5
    table.append(f"clip: gradient norm before clipping = one process's (< 1e-5): {same}; "
                 f"clipping was active (norm > {MAX_NORM}): {min(norms) > MAX_NORM}")
if not args.no_table:
    print0("", *table, sep="\n")
write_json(args.json, {"world_size": env.world_size, "num_params": num_params,
                       "root_params": root_params, "padded_params": psi,
                       "padded_root_params": psi_root, "layers": args.layers,
                       "configs": {c: CONFIGS[c] for c in configs},
                       "single_losses": single, "single_clip_losses": single_clip,
                       "single_grad_norms": single_grads,
                       "ref_norms": ref_norms, "held_every_rank": every_rank,
                       "autocast_dtypes": autocast_dtypes,
                       "comm_formula_zero3": communication_bytes(num_params, env.world_size, 3, 4),
                       "results": results, "table": table})
teardown()

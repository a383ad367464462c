"""Chapter 03: bytes per rank by category for DDP, ZeRO-1 and FSDP2, measured against the formulas.

    code/run_w_torchrun.sh 2 ch03_zero/zero_memory.py --json build/ch03/zero_memory.json

One launch runs every strategy on the same small transformers Llama, seeded the same, for a few
AdamW steps with a cross-entropy loss:
- ddp: DistributedDataParallel, every rank holds everything (stage 0);
- zero1: DDP + ZeroRedundancyOptimizer, the AdamW state partitioned over ranks (stage 1);
- fsdp2-keep: fully_shard(reshard_after_forward=False), parameters gathered once per step and
  kept unsharded from forward to backward; gradients and optimizer state sharded (ZeRO-2-like);
- fsdp2: fully_shard's default, parameters resharded after forward and gathered again for
  backward (ZeRO-3);
- fsdp2-bf16: fsdp2-keep with MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32).
torch's trackers (MemTracker, FSDPMemTracker) count the bytes of rank 0..N-1 by category during
the first step: at the end of the forward (what the parameters cost while they are used) and
after optimizer.step() (what every state costs at rest). Every strategy's losses are checked
against one process training on the whole batch: sharding changes where bytes live, not the math.
"""
import argparse
import os

import torch
import torch.distributed as dist
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

from distkit import print0, seed_everything, setup, teardown, write_json
from distkit.dist import grad_check, grad_norms
from distkit.memory import FP32_ADAMW, by_category, model_state_bytes, storage_bytes
from distkit.toy import counting_data, tiny_llama

CATEGORIES = ["params at rest", "params in use", "grads", "optimizer"]
STRATEGIES = ["ddp", "zero1", "fsdp2-keep", "fsdp2", "fsdp2-bf16"]
parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--strategies", default=",".join(STRATEGIES), help="comma list")
parser.add_argument("--hidden", type=int, default=64, help="model width")
parser.add_argument("--layers", type=int, default=4, help="decoder layers")
parser.add_argument("--batch-size", type=int, default=4, help="sequences per rank")
parser.add_argument("--steps", type=int, default=3, help="AdamW steps (memory: the first)")
parser.add_argument("--json", help="write the bytes of every rank here (rank 0)")
args = parser.parse_args()
strategies = args.strategies.split(",")
if unknown := [s for s in strategies if s not in STRATEGIES]:
    parser.error(f"unknown strategy {', '.join(unknown)}; choose from {', '.join(STRATEGIES)}")
if args.hidden < 4 or args.hidden % 4 or args.layers < 1 or args.batch_size < 1 or args.steps < 1:
    parser.error("need --hidden a multiple of 4, --layers, --batch-size and --steps >= 1")
if int(os.environ.get("WORLD_SIZE", 1)) * args.batch_size > 256:
    parser.error("need WORLD_SIZE x --batch-size <= 256 sequences")


def build():
    seed_everything(0)  # the same full model on every rank and in the reference
    return tiny_llama(hidden=args.hidden, layers=args.layers).to(env.device)


def wrap(strategy: str, model):
    """The only lines that differ between the strategies: how the model and optimizer are
    wrapped."""
    adamw = dict(lr=1e-3, weight_decay=0.01)
    if strategy == "ddp":
        model = DDP(model, gradient_as_bucket_view=True)  # gradients live in DDP's buckets
        return model, torch.optim.AdamW(model.parameters(), **adamw)
    if strategy == "zero1":
        model = DDP(model, gradient_as_bucket_view=True)
        return model, ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, **adamw)
    mesh = init_device_mesh(env.device.type, (env.world_size,))
    # None (the default): reshard every layer after its forward, but not the root, whose
    # parameters backward needs first; False: keep every layer's full parameters until backward
    reshard = None if strategy == "fsdp2" else False
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    policy = bf16 if strategy == "fsdp2-bf16" else MixedPrecisionPolicy()
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy)
    return model, torch.optim.AdamW(model.parameters(), **adamw)


def tracked_step(model, optimizer, fsdp: bool):
    """One training step inside torch's memory tracker: the bytes by category at the end of the
    forward, after the optimizer step (at rest), and at the step's peak."""
    if fsdp:  # FSDP2's own tracker: sharded and unsharded parameters, its buffers
        tracker = FSDPMemTracker(model, optimizer)
    else:  # the general one, told which tensors are the model's and the optimizer's
        tracker = MemTracker()
        tracker.track_external(model, optimizer)
    with tracker:  # every tensor allocated in the block is filed under a category
        loss = model(input_ids=mine, labels=mine).loss
        end_of_forward = by_category(tracker.get_tracker_snapshot("current"), env.device)
        loss.backward()
        optimizer.step()
        at_rest = by_category(tracker.get_tracker_snapshot("current"), env.device)
    peak = by_category(tracker.get_tracker_snapshot("peak"), env.device)
    return loss, end_of_forward, at_rest, peak


def run(strategy: str) -> dict:
    model, optimizer = wrap(strategy, build())
    fsdp = strategy.startswith("fsdp2")
    losses = []
    for step in range(args.steps):
        if step == 0:  # the first step, tracked: the optimizer creates its state in it
            loss, end_of_forward, at_rest, peak = tracked_step(model, optimizer, fsdp)
            # (DDP's gradients; FSDP2's DTensor gradients the tracker sees itself)
            grads_held = 0 if fsdp else storage_bytes(p.grad for p in model.parameters())
            # step 1's gradients, to compare with one process's (AdamW hides a constant factor)
            step1_grads = grad_norms(model)
        else:
            loss = model(input_ids=mine, labels=mine).loss
            loss.backward()
            optimizer.step()
        optimizer.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)  # the global batch's loss: every rank's share, averaged
        losses.append(mean.item() / env.world_size)
    if fsdp:
        got = {"params at rest": at_rest["Sharded Param"],
               "params in use": end_of_forward["Sharded Param"]
               + end_of_forward["Unsharded Param"],
               "grads": at_rest["Sharded Grad"], "optimizer": at_rest["OptState"]}
    else:
        # MemTracker files DDP's gradients under "Temp": they are views into the C++ reducer's
        # bucket buffers, allocated before tracking began and filled during the backward, where
        # the tracker (track_external installs no gradient hooks) first meets them. So we count
        # the distinct storages that hold them (the JSON keeps the tracker's Temp to compare).
        got = {"params at rest": at_rest["Parameter"], "params in use": end_of_forward["Parameter"],
               "grads": grads_held, "optimizer": at_rest["Optstate"]}
    return {"losses": losses, "measured": got, "end_of_forward": end_of_forward,
            "at_rest": at_rest, "peak": peak, "grad_norms": step1_grads}


def predicted(strategy: str) -> dict:
    """The chapter's formulas (distkit.memory, fp32 AdamW: 4 + 4 + 8 bytes per parameter)."""
    stage = {"ddp": 0, "zero1": 1, "fsdp2-keep": 2}.get(strategy, 3)
    model = model_state_bytes(num_params, env.world_size, stage, FP32_ADAMW)
    sharded = model_state_bytes(num_params, env.world_size, 3, FP32_ADAMW)["params"]
    # What each holds while the parameters are used (end of forward): DDP and ZeRO-1 their
    # replicas; FSDP2 its shards plus every unsharded parameter it keeps: all of them in fp32
    # (ZeRO-2's replicas) when it keeps them to backward, half that in bf16, and with the
    # default only the root's (embeddings, final norm, LM head), as each layer reshards.
    in_use = {"ddp": model["params"], "zero1": model["params"],
              "fsdp2-keep": sharded + model["params"], "fsdp2-bf16": sharded + 2 * num_params,
              "fsdp2": sharded + 4 * root_params}[strategy]
    return {"params at rest": sharded if strategy.startswith("fsdp2") else model["params"],
            "params in use": in_use, "grads": model["grads"], "optimizer": model["optimizer"]}


def reference() -> tuple[list[float], dict]:
    """One process, the whole global batch, plain AdamW: the losses every strategy must give,
    and step 1's gradient norms."""
    model = build()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    losses = []
    for step in range(args.steps):
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        if step == 0:
            grads = grad_norms(model)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, grads


env = setup()
(tokens,) = counting_data(env.world_size * args.batch_size)[:]
tokens = tokens.to(env.device)
mine = tokens[env.rank * args.batch_size:(env.rank + 1) * args.batch_size]
full = build()
num_params = sum(p.numel() for p in full.parameters())
root_params = num_params - sum(p.numel() for p in full.model.layers.parameters())
# The formulas assume shards of exactly Psi / N. FSDP2 pads each parameter's first dimension up
# to a multiple of N, and ZeRO-1 hands out whole tensors: both add bytes when N does not divide.
divides = all(p.shape[0] % env.world_size == 0 for p in full.parameters())
single, single_grads = reference()
results = {strategy: run(strategy) for strategy in strategies}
every_rank = [None] * env.world_size
dist.all_gather_object(every_rank, results)

print0(f"{num_params:,} parameters; bytes per parameter on each rank, measured (model), "
       f"{env.world_size} ranks:")
print0(f"{'':11s}" + "".join(f"{c:>15s}" for c in CATEGORIES) + "   all ranks within 1%")
for strategy in strategies:
    want = predicted(strategy)
    per_rank = [r[strategy]["measured"] for r in every_rank]
    close = all(abs(m[c] - want[c]) <= 0.01 * want[c] for m in per_rank for c in CATEGORIES)
    print0(f"{strategy:11s}" + "".join(f"{per_rank[0][c] / num_params:7.3f} "
                                       f"({want[c] / num_params:5.3f})"
                                       for c in CATEGORIES) + f"   {close}")
    results[strategy]["predicted"] = want
print0(f"every parameter's first dimension divides by N = {env.world_size}: {divides}")
grad_gaps = {}  # step 1's gradients against one process's, per strategy
parity_ok = True
print0("losses of every strategy vs one process on the whole batch (3 steps), and step 1's "
       "gradients (gap: largest difference / largest norm):")
for strategy in strategies:
    diff = max(abs(a - b) for a, b in zip(results[strategy]["losses"], single))
    tol = 1e-2 if strategy == "fsdp2-bf16" else 1e-5  # bf16 rounds every matmul's inputs
    grads = grad_check(results[strategy]["grad_norms"], single_grads)
    grad_gaps[strategy] = grads["gap"]
    print0(f"  {strategy:11s} max |loss - reference| < {tol:g}: {diff < tol}; "
           f"gradient gap < {tol:g}: {grads['gap'] < tol} ({grads['scale']:.2f}x)")
    parity_ok = parity_ok and diff < tol and grads["gap"] < tol
write_json(args.json, {"world_size": env.world_size, "num_params": num_params,
                       "num_tensors": len(list(build().parameters())),
                       "batch_size": args.batch_size, "layers": args.layers,
                       "hidden": args.hidden, "single_losses": single,
                       "root_params": root_params, "dims_divide": divides,
                       "predicted": {s: predicted(s) for s in strategies},
                       "grad_gaps": grad_gaps,
                       "ranks": every_rank})
teardown(parity_ok)  # a failed parity fails the launch

"""Chapter 10: PP x FSDP x TP on one 3-D device mesh: two training steps = one process, and which
mesh dimension each collective crosses.

    code/run_w_torchrun.sh 8 ch10_float8_3d/mesh3d.py --pp 2 --dp 2 --tp 2 --json /tmp/3d.json

The mesh has shape (pp, dp, tp), named as torchtitan names them, outermost first. Each rank
builds the same seeded tiny Llama and then, one technique per dimension, in torchtitan's order:
1. pp: keeps only its pipeline stage's layers (distkit.pipe.LlamaStage, chapter 02);
2. tp: splits each of those layers with Megatron's plan (distkit.tp.layer_plan, chapter 02);
3. dp: shards the result with FSDP2 over the dp dimension (fully_shard, chapter 04);
4. wraps the stage in a PipelineStage on the pp dimension's process group and runs a schedule.
Each dp rank trains on its slice of the global batch; a tp group shares one slice. Two AdamW
steps; the losses, the gradients and the updated weights must be those of one process training
the whole model on the whole batch. distkit.plan3d.MeshLog records every collective and
send/recv of the second step (the first also infers the stages' shapes), each named by the
mesh dimension it crosses. Each rank also notes how long it took to start: importing torch,
joining the process group, building the mesh, its first collective on each dimension.
"""
import argparse
import logging
import os
import time
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import get_schedule_class
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module

from distkit import print0, seed_everything, setup, teardown, write_json
from distkit.pipe import LlamaStage, lm_loss, split_layers
from distkit.plan3d import MeshLog, by_mesh_dim, startup
from distkit.toy import counting_data, tiny_llama
from distkit.tp import layer_plan

imported = startup()
# float32 throughout; the layout only reorders additions (micro-batches, shards, TP's partial
# sums). Measured: losses equal, gradients within 4e-7. AdamW's first steps move each weight by
# about lr x g / (|g| + eps), which amplifies those differences where g is near 0: the weights
# are checked to a tenth of one step's size, lr / 10 (measured: 4e-5).
LR = 1e-3
TOL = {"loss": 1e-5, "grad": 1e-5, "weight": LR / 10}

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--pp", type=int, default=2, help="pipeline stages (the outer dimension)")
parser.add_argument("--dp", type=int, default=2, help="FSDP ranks per stage")
parser.add_argument("--tp", type=int, default=2, help="tensor-parallel ranks (the inner one)")
parser.add_argument("--schedule", default="1F1B", choices=["GPipe", "1F1B"],
                    help="the pipeline schedule (one stage per rank)")
parser.add_argument("--microbatches", type=int, default=2, help="per step and dp rank")
parser.add_argument("--layers", type=int, default=4, help="decoder layers, a multiple of --pp")
parser.add_argument("--batch-size", type=int, default=8,
                    help="global batch (sequences of 32 tokens), split over dp, then micro-batches")
parser.add_argument("--json", help="write losses, errors, collectives and start-up times here")
args = parser.parse_args()
world = int(os.environ.get("WORLD_SIZE", 1))
if min(args.pp, args.dp, args.tp, args.microbatches, args.layers) < 1:
    parser.error("--pp, --dp, --tp, --microbatches and --layers must be >= 1")
if args.pp * args.dp * args.tp != world:
    parser.error(f"--pp {args.pp} x --dp {args.dp} x --tp {args.tp} = "
                 f"{args.pp * args.dp * args.tp}, but {world} processes were launched")
if args.layers % args.pp:
    parser.error(f"--layers {args.layers} does not split into --pp {args.pp} stages")
if 4 % args.tp:
    parser.error(f"--tp {args.tp} must divide the tiny Llama's 4 attention heads")
if args.batch_size % (args.dp * args.microbatches):
    parser.error(f"--batch-size {args.batch_size} must split into --dp {args.dp} x "
                 f"--microbatches {args.microbatches} equal micro-batches")
if args.schedule == "1F1B" and args.microbatches < args.pp:
    parser.error(f"1F1B needs --microbatches >= --pp {args.pp}")
# full_tensor() of a parameter sharded on two dimensions says it gathers in two steps: expected
logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)

env = setup()
joined = startup()
mesh = init_device_mesh(env.device.type, (args.pp, args.dp, args.tp),
                        mesh_dim_names=("pp", "dp", "tp"))
meshed = startup()
first_collective = {}
for dim in mesh.mesh_dim_names:  # one small all-reduce on each dimension's group
    start = time.perf_counter()
    dist.all_reduce(torch.ones(1, device=env.device), group=mesh.get_group(dim))
    first_collective[dim] = time.perf_counter() - start
pp_rank, dp_rank = mesh.get_local_rank("pp"), mesh.get_local_rank("dp")
(tokens,) = counting_data(args.batch_size)[:]
tokens = tokens.to(env.device)


def build():
    seed_everything(0)  # the same full model on every rank and in the reference
    return tiny_llama(layers=args.layers).to(env.device)


def adamw(params):
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.01)


# The reference: one process (each rank, alone), the whole model, the whole batch, two steps.
reference = build()
ref_opt = adamw(reference.parameters())
ref_losses, ref_grads = [], []
for step in range(2):
    loss = lm_loss(reference(input_ids=tokens).logits, tokens)
    loss.backward()
    ref_losses.append(loss.item())
    ref_grads.append({n: p.grad.clone() for n, p in reference.named_parameters()})
    ref_opt.step()
    ref_opt.zero_grad()
built = startup()

first, last = split_layers(args.layers, args.pp)[pp_rank]
per_dp = args.batch_size // args.dp
batch = tokens[dp_rank * per_dp:(dp_rank + 1) * per_dp]  # this dp rank's slice
ref_weights = dict(reference.named_parameters())


def full_name(name: str) -> str:
    """A stage parameter's name in the whole model ("layers.0.mlp.up_proj.weight" on the stage
    from layer 2 is "model.layers.2.mlp.up_proj.weight"): where its reference is."""
    part, _, rest = name.partition(".")
    if part == "layers":
        i, _, rest = rest.partition(".")
        return f"model.layers.{first + int(i)}.{rest}"
    owner = {"embed": "model.embed_tokens", "norm": "model.norm", "head": "lm_head"}[part]
    return f"{owner}.{rest}"


def train_3d(reshard_after_forward: bool) -> dict:
    """The 3-D layout, two AdamW steps: this rank's losses, its errors against the reference,
    and the collectives of step 2 by mesh dimension."""
    model = build()
    stage_module = LlamaStage(model, first, last)           # 1. pp: this stage's layers only
    for layer in stage_module.layers:
        parallelize_module(layer, mesh["tp"], layer_plan("megatron"))  # 2. tp
        fully_shard(layer, mesh=mesh["dp"],                             # 3. FSDP over dp
                    reshard_after_forward=reshard_after_forward)
    fully_shard(stage_module, mesh=mesh["dp"],  # the stage's root: embedding / norm and head
                reshard_after_forward=reshard_after_forward)
    stage = PipelineStage(stage_module, pp_rank, args.pp, env.device,
                          group=mesh.get_group("pp"))        # 4. the pipeline, over pp
    schedule = get_schedule_class(args.schedule)(stage, n_microbatches=args.microbatches,
                                                 loss_fn=lm_loss)
    optimizer = adamw(stage_module.parameters())
    losses, grad_err, log = [], [], MeshLog()
    for step in range(2):
        mb_losses = []
        inputs = (batch,) if pp_rank == 0 else ()
        labels = dict(target=batch, losses=mb_losses) if pp_rank == args.pp - 1 else {}
        with log if step == 1 else nullcontext():  # step 2's traffic
            schedule.step(*inputs, **labels)
        # the step's loss: mean over micro-batches, then over the dp ranks (last stage only)
        mine = torch.stack(mb_losses).mean() if mb_losses else torch.zeros((), device=env.device)
        dist.all_reduce(mine)  # the last stage's dp x tp ranks each hold one dp slice's loss
        losses.append(mine.item() / (args.dp * args.tp))
        err = 0.0
        for name, p in stage_module.named_parameters():  # full_tensor(): over the (dp, tp) ranks
            full = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            err = max(err, (full - ref_grads[step][full_name(name)]).abs().max().item())
        grad_err.append(err)
        optimizer.step()
        optimizer.zero_grad()
    weight_err = max((p.full_tensor() if isinstance(p, DTensor) else p)
                     .sub(ref_weights[full_name(n)]).abs().max().item()
                     for n, p in stage_module.named_parameters())
    return {"losses": losses, "grad_err": max(grad_err), "weight_err": weight_err,
            "collectives": [[op, dim, n, b] for (op, dim), (n, b) in
                            sorted(by_mesh_dim(log.collectives, mesh).items())]}


# torchtitan's choice under a pipeline first (reshard_after_forward=False: "to avoid
# per-microbatch all-gathers", parallelize_llama.py), then FSDP2's default (True)
runs = {"never": train_3d(False), "always": train_3d(True)}
coord = {"pp": pp_rank, "dp": dp_rank, "tp": mesh.get_local_rank("tp")}
everyone = [None] * env.world_size  # every rank's numbers, to rank 0
dist.all_gather_object(everyone, {
    "coord": coord, "runs": runs, "first_collective": first_collective,
    "startup": {"imported": imported, "joined": joined, "meshed": meshed, "built": built}})
print0(f"mesh (pp {args.pp}, dp {args.dp}, tp {args.tp}) = {env.world_size} ranks; "
       f"{args.layers} layers, {args.schedule} with {args.microbatches} micro-batches per dp rank")
results, all_ok = {}, True
for name in runs:
    parity = {"loss": max(abs(a - b) for a, b in zip(runs[name]["losses"], ref_losses)),
              "grad": max(r["runs"][name]["grad_err"] for r in everyone),
              "weight": max(r["runs"][name]["weight_err"] for r in everyone)}
    results[name] = {"parity": parity,
                     "collectives": [r["runs"][name]["collectives"] for r in everyone]}
    ok = all(parity[w] < TOL[w] for w in parity)
    all_ok = all_ok and ok
    print0(f"reshard_after_forward {name:6s}: losses, gradients and weights after 2 AdamW "
           f"steps = one process: {ok}; step 2 on rank 0: " + ", ".join(
               f"{n} {op} over {dim}" for op, dim, n, _ in everyone[0]["runs"][name]
               ["collectives"]))
write_json(args.json, {"pp": args.pp, "dp": args.dp, "tp": args.tp, "layers": args.layers,
                       "schedule": args.schedule, "microbatches": args.microbatches,
                       "batch": args.batch_size, "reference": ref_losses, "tolerance": TOL,
                       "losses": {n: r["losses"] for n, r in runs.items()}, "runs": results,
                       "ranks": [{k: r[k] for k in ("coord", "startup", "first_collective")}
                                 for r in everyone]})
teardown(all_ok)  # a failed parity fails the launch

"""HSDP and FSDP + tensor parallel on 2D meshes vs 1D FSDP: parity, collectives by mesh dimension.

    code/run_w_torchrun.sh 4 ch04_fsdp2/fsdp2_2d.py --json build/ch04/fsdp2_2d.json

One launch trains the same seeded tiny Llama, on the same global batch, in three layouts:
- fsdp: a 1D mesh of all N ranks, fully_shard per decoder layer then the root (the baseline);
- hsdp: a 2D mesh (replicate, shard). fully_shard on a 2D mesh is HSDP: each parameter is
  sharded within a row of the mesh and replicated down its columns (placements Replicate(),
  Shard(0)). The all-gathers and reduce-scatters stay inside a "shard" group (on a cluster, one
  node's fast links); across "replicate" goes one all-reduce of each unit's reduce-scattered
  gradient. The price: each rank holds 1/shard of the parameters, not 1/N;
- fsdp+tp: a 2D mesh (dp, tp): chapter 02's Megatron plan splits every decoder layer over "tp",
  then fully_shard shards the result over "dp" (torchtitan's order: TP first, FSDP last). FSDP
  gathers and reduces over "dp"; TP all-reduces activations over "tp".
Each layout runs a few AdamW steps; its losses and step 1's gradients must match one process
training on the whole global batch. distkit.comm.CollectiveLog records the collectives of one
step (forward + backward), each named by the mesh dimension its process group spans; and each
rank's parameter bytes at rest are counted.
"""
import argparse
import os
import time
import warnings
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from distkit import print0, seed_everything, setup, teardown, write_json
from distkit.comm import CollectiveLog
from distkit.dist import grad_check, grad_norms
from distkit.toy import counting_data, tiny_llama
from distkit.tp import parallelize  # chapter 02's plans, one copy for both chapters

LAYOUTS = ["fsdp", "hsdp", "fsdp+tp"]
# Float32 everywhere; the layouts only change the order of additions (the batch mean taken as a
# mean of per-rank means, TP's partial sums), so the losses differ from the reference by float
# rounding. Measured, 3 steps, native and scalar kernels (ATEN_CPU_CAPABILITY=default): 4.8e-7
# in every layout, 1 ulp of a loss near 4.9. The bound is 20x above that.
LOSS_TOL = 1e-5
# Step 1's gradients too (the norm of each parameter's, over the largest): AdamW's update ignores
# a constant factor on the gradient, so a missing 1/N (a replicate dimension's all-reduce that
# sums) would leave the losses within LOSS_TOL. Measured gaps: about 1e-8.
GRAD_TOL = 1e-5
LR = 1e-3

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--layouts", default=",".join(LAYOUTS), help="comma list of "
                    + ", ".join(LAYOUTS))
parser.add_argument("--shard", type=int, default=2,
                    help="hsdp: ranks per shard group (replicate = processes / shard)")
parser.add_argument("--tp", type=int, default=2,
                    help="fsdp+tp: ranks per tensor-parallel group (dp = processes / tp)")
parser.add_argument("--hidden", type=int, default=64)
parser.add_argument("--heads", type=int, default=4, help="a multiple of --tp")
parser.add_argument("--layers", type=int, default=2)
parser.add_argument("--batch-size", type=int, default=8,
                    help="global batch (sequences per step), split over the data-parallel ranks")
parser.add_argument("--steps", type=int, default=3, help="AdamW steps")
parser.add_argument("--json", help="write losses, collectives and bytes here")
args = parser.parse_args()
world = int(os.environ.get("WORLD_SIZE", 1))
layouts = args.layouts.split(",")
if unknown := [x for x in layouts if x not in LAYOUTS]:
    parser.error(f"--layouts: unknown {','.join(unknown)}; choose from {','.join(LAYOUTS)}")
if min(args.hidden, args.heads, args.layers, args.batch_size, args.steps) < 1:
    parser.error("--hidden, --heads, --layers, --batch-size and --steps must be >= 1")
if args.hidden % args.heads:
    parser.error(f"--hidden {args.hidden} is not a multiple of --heads {args.heads}")
# A 2D mesh needs both of its dimensions >= 2 (else it is 1D FSDP again): 4 processes at least.
for layout, inner, outer in (("hsdp", "shard", "replicate"), ("fsdp+tp", "tp", "dp")):
    size = getattr(args, inner)
    if layout in layouts and (size < 2 or world % size or world // size < 2):
        parser.error(f"{layout} needs processes = {outer} x {inner} with both >= 2; got "
                     f"{world} processes and --{inner} {size} (launch 4 with --{inner} 2)")
if "fsdp+tp" in layouts and args.heads % args.tp:
    parser.error(f"--heads {args.heads} is not a multiple of --tp {args.tp}")
# fsdp and hsdp split the batch over all N ranks (fsdp+tp over N / tp, which then divides too)
if args.batch_size % world:
    parser.error(f"--batch-size {args.batch_size} does not split over {world} processes")


def by_mesh_dim(log: CollectiveLog, mesh) -> list:
    """The collectives of `log`, one row per (op, mesh dimension its process group spans):
    count, of which in backward, and bytes. A group is named by comparing its ranks with this
    rank's group along each dimension of the mesh ("other": none expected, and the notebook
    checks it)."""
    dims = {tuple(dist.get_process_group_ranks(mesh.get_group(d))): d for d in mesh.mesh_dim_names}
    rows = {}
    for c in log.collectives:
        dim = dims.get(c.ranks, "other")
        row = rows.setdefault((c.op, dim), {"op": c.op, "dim": dim, "group_size": len(c.ranks),
                                            "count": 0, "backward": 0, "bytes": 0})
        row["count"] += 1
        row["backward"] += c.backward
        row["bytes"] += c.nbytes
    order = ["all_gather", "reduce_scatter", "all_reduce"]  # FSDP's first, then the rest
    return sorted(rows.values(), key=lambda r: (order.index(r["op"]) if r["op"] in order else 9,
                                                r["op"], r["dim"]))


def build():
    seed_everything(0)  # the same full model on every rank and in the reference
    return tiny_llama(hidden=args.hidden, layers=args.layers, heads=args.heads).to(env.device)


def shard(layout: str, model):
    """The lines that differ between the layouts. Returns the mesh and this rank's data-parallel
    coordinate: (index, size) of the slice of the global batch it trains on."""
    device = env.device.type
    if layout == "fsdp":
        mesh = init_device_mesh(device, (env.world_size,), mesh_dim_names=("shard",))
        dp = (env.rank, env.world_size)
    elif layout == "hsdp":
        # 2D mesh -> HSDP: fully_shard shards over the last dimension, replicates over the first
        mesh = init_device_mesh(device, (env.world_size // args.shard, args.shard),
                                mesh_dim_names=("replicate", "shard"))
        dp = (env.rank, env.world_size)  # every rank is a data-parallel rank
    else:  # fsdp+tp
        mesh = init_device_mesh(device, (env.world_size // args.tp, args.tp),
                                mesh_dim_names=("dp", "tp"))
        parallelize(model, "megatron", mesh["tp"])  # TP first: weights become DTensors on "tp"
        dp = (mesh.get_local_rank("dp"), mesh.size(0))  # a tp group shares one batch slice
    fsdp_mesh = mesh["dp"] if layout == "fsdp+tp" else mesh  # FSDP over "dp" only
    for layer in model.model.layers:
        fully_shard(layer, mesh=fsdp_mesh)
    fully_shard(model, mesh=fsdp_mesh)
    return mesh, dp


def train(model, batch, log=None) -> tuple[list, dict]:
    """A few AdamW steps on `batch`; returns each step's loss and step 1's gradient norms (per
    parameter, the whole parameter's). `log` records the collectives of the last step's forward
    and backward."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    losses, grads = [], None
    for step in range(args.steps):
        with log if log and step == args.steps - 1 else nullcontext():
            loss = model(input_ids=batch, labels=batch).loss  # cross-entropy, next token
            loss.backward()
        grads = grads or grad_norms(model)  # (outside the log: its reductions are the check's)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, grads


def local_bytes(model) -> int:
    """Bytes of the parameters this rank stores: its shards' elements x 4 (float32)."""
    return sum((p.to_local() if isinstance(p, DTensor) else p).numel() * 4
               for p in model.parameters())


# FSDP2 warns that the root returns a view (we never modify it in place): keep the output readable
warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
env = setup()
(tokens,) = counting_data(args.batch_size)[:]
tokens = tokens.to(env.device)  # the global batch, the same for every layout
full = build()
num_params = sum(p.numel() for p in full.parameters())
# what the Megatron plan splits over tp: the decoder layers' linears (q, k, v, o, gate, up, down)
tp_params = sum(p.numel() for n, p in full.named_parameters() if n.endswith("_proj.weight"))
# Bytes at rest, the formula: 4 bytes x the parameters / the ranks that share them (exact when
# every parameter divides evenly, as at the defaults; FSDP2 pads the last shards otherwise).
predicted = {"fsdp": (4 * num_params // env.world_size, f"4 B x P / {env.world_size}"),
             "hsdp": (4 * num_params // args.shard, f"4 B x P / {args.shard} (shard)"),
             "fsdp+tp": (4 * (tp_params // env.world_size
                              + (num_params - tp_params) // (env.world_size // args.tp)),
                         f"4 B x (P_tp / {env.world_size} + P_rest / {env.world_size // args.tp})")}
# one process (each rank, alone), the whole global batch
reference, reference_grads = train(full, tokens)
results = {}
for layout in layouts:
    start = time.perf_counter()
    model = build()
    mesh, (index, size) = shard(layout, model)
    log = CollectiveLog()
    per_dp = args.batch_size // size
    losses, grads = train(model, tokens[index * per_dp:(index + 1) * per_dp], log)
    losses = torch.tensor(losses, device=env.device)
    # the global batch's loss is the mean of the ranks' (a tp group's ranks hold the same one,
    # so each slice is counted tp times: still the mean)
    dist.all_reduce(losses)
    losses = (losses / env.world_size).tolist()
    at_rest = [None] * env.world_size
    dist.all_gather_object(at_rest, local_bytes(model))
    diff = max(abs(a - b) for a, b in zip(losses, reference))
    check = grad_check(grads, reference_grads)
    results[layout] = {"mesh": dict(zip(mesh.mesh_dim_names, mesh.shape)), "losses": losses,
                       "max_loss_diff": diff, "grad_gap": check["gap"],
                       "grad_scale": check["scale"],
                       "parity": diff < LOSS_TOL and check["gap"] < GRAD_TOL,
                       "collectives": by_mesh_dim(log, mesh),
                       "param_bytes_per_rank": at_rest,
                       "param_bytes_predicted": predicted[layout][0],
                       "seconds": time.perf_counter() - start}

print0(f"P = {num_params:,} parameters ({4 * num_params:,} B; P_tp = {tp_params:,} in the "
       f"layers' linears), global batch {args.batch_size} x {tokens.shape[1]} tokens, "
       f"{env.world_size} ranks")
print0("\ncollectives of one training step (forward + backward), by mesh dimension:")
print0(f"{'layout':8s} {'mesh':22s} {'collective':15s} {'mesh dim':13s} {'count':>5s} "
       f"{'in bwd':>6s} {'bytes':>8s}")
for layout, r in results.items():
    shape = " x ".join(f"{d} {n}" for d, n in r["mesh"].items())
    for row in r["collectives"]:
        dim = f"{row['dim']} ({row['group_size']})"
        print0(f"{layout:8s} {shape:22s} {row['op']:15s} {dim:13s} {row['count']:5d} "
               f"{row['backward']:6d} {row['bytes']:8d}")
print0("\nparameter bytes at rest on each rank (local shards' elements x 4), and the formula:")
for layout, r in results.items():
    print0(f"{layout:8s} " + " ".join(f"{b:7d}" for b in r["param_bytes_per_rank"])
           + f"   {predicted[layout][1]} = {predicted[layout][0]}")
print0(f"\nlosses of {args.steps} AdamW steps vs one process on the whole global batch "
       f"({' '.join(f'{x:.3f}' for x in reference)}), and step 1's gradient norms:")
for layout, r in results.items():
    print0(f"{layout:8s} max |loss - reference| < {LOSS_TOL:g}: "
           f"{r['max_loss_diff'] < LOSS_TOL}; gradients < {GRAD_TOL:g} of the largest: "
           f"{r['grad_gap'] < GRAD_TOL} ({r['grad_scale']:.2f}x)")
write_json(args.json, {"world_size": env.world_size, "layers": args.layers,
                       "hidden": args.hidden, "heads": args.heads, "batch": args.batch_size,
                       "seq": tokens.shape[1], "steps": args.steps, "shard": args.shard,
                       "tp": args.tp, "num_params": num_params, "tp_params": tp_params,
                       "tolerance": LOSS_TOL, "grad_tolerance": GRAD_TOL,
                       "reference_losses": reference, "reference_grad_norms": reference_grads,
                       "layouts": results})
teardown(all(r["max_loss_diff"] < LOSS_TOL and r["grad_gap"] < GRAD_TOL
             for r in results.values()))  # a failed parity fails the launch

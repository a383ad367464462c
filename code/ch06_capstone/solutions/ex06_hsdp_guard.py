"""Exercise 06.1: HSDP on a 2-D mesh, and a non-finite guard that every rank agrees on.

    code/run_w_torchrun.sh 4 ch06_capstone/exercises/ex06_hsdp_guard.py

Two parts of the capstone's recipe that a cluster run needs and a laptop never shows, in a
script of their own.
HSDP: on R nodes, shard the model within each node and replicate it across the nodes. A 2-D
device mesh of R rows ("replicate") x WORLD_SIZE/R columns ("shard"), numbered row-major so that
a row holds consecutive ranks, i.e. one node's GPUs under torchrun; fully_shard on that mesh
keeps FSDP2's all-gathers and reduce-scatters inside a row and sends one all-reduce of the
gradient shards down each column. Losses must stay one process's on the whole global batch.
The guard: a NaN in one step's loss or gradients, once the optimizer steps, is soon in every weight;
the next checkpoint then holds it, and keep-last-K deletes the good ones. So the run must stop
before optimizer.step(), save nothing, and exit non-zero (a scheduler, train_llama.sbatch,
must not see a success). Every rank must take that decision at the same step: ranks that
decide differently part ways, some leaving, the others stepping, maybe saving, until a
collective whose peers are gone fails (or, had the leavers exited 0, waits until the timeout).
With HSDP they do not all see the same numbers: each rank's loss is its own micro-batch's, and the
gradient norm of a sharded gradient is reduced over the shard group only.
--fault-step K corrupts one element of one rank's gradient shard at step K (a bad GPU, a
silent data corruption: default the last rank, step 4), after the gradients were reduced and
before the norm. A checkpoint is written every --save-every steps (DCP, --ckpt-dir): with the
defaults the fault hits a step that would save.
Fill in the TODO(you) parts, replacing each todo(...) call with your code. Run the script at any
time: it stops at the first todo() left and says what is missing. `make exercise EX=06.1`
checks it at 2 ranks (a 2 x 1 mesh) and 4 (2 x 2): the placements, which ranks each collective
spans, the losses against one process, and the guard: every rank stops at the faulty step, no
checkpoint of it, exit status 3. Solution, with the answers to the questions below:
../solutions/ex06_hsdp_guard.py.

Predict, then measure:
1. At 4 ranks, --replicate 2: which ranks does rank 1's reduce-scatter span, and which its
   gradient all-reduce? With --replicate 4 (a 4 x 1 mesh), and --replicate 1?
2. Decide on rank 3's own gradient norm at 4 ranks (2 x 2): which ranks would stop at step 4,
   and what would the others do next in a real loop without this script's verdict check?
3. Corrupt the loss instead (a NaN on one rank): do the gradient norms then agree on every
   rank? Why, through which collectives?
4. What exit status does torchrun give the job when every rank exits with 3, and what does
   train_llama.sbatch do with a non-zero status that no signal caused?
"""
import argparse
import math
import os
import shutil
import sys
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from distkit import print0, seed_everything, setup, teardown, todo, write_json
from distkit.comm import CollectiveLog
from distkit.toy import counting_data, tiny_llama

# Against one process on the whole global batch: float32 rounding differs (the batch mean taken
# as a mean of the ranks' means, gradients reduced in another order). Measured at the defaults:
# 4.8e-7 at 2 ranks, 0 at 4; 1 ulp of a loss near 4.7 is 4.8e-7.
LOSS_TOL = 1e-5
SEED, LR, CLIP = 0, 3e-3, 1.0
parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--replicate", type=int, default=2,
                    help="R: replicas (nodes); each shards the model over WORLD_SIZE/R ranks")
parser.add_argument("--steps", type=int, default=6, help="AdamW steps")
parser.add_argument("--batch-size", type=int, default=8,
                    help="sequences per step, all ranks together (a multiple of WORLD_SIZE)")
parser.add_argument("--save-every", type=int, default=2, help="steps between checkpoints")
parser.add_argument("--fault-step", type=int, default=4,
                    help="corrupt a gradient at this step (0: never)")
parser.add_argument("--fault-rank", type=int, default=-1,
                    help="on this rank (default -1: the last)")
parser.add_argument("--ckpt-dir", default="build/ch06/ex06_ckpt",
                    help="checkpoints go here, one folder per step (emptied at the start)")
parser.add_argument("--timeout", type=float, default=30,
                    help="seconds a rank waits in a collective before failing")
parser.add_argument("--json", help="write the mesh, collectives, losses and the stop here")
args = parser.parse_args()
world = int(os.environ.get("WORLD_SIZE", 1))
if min(args.replicate, args.steps, args.batch_size, args.save_every) < 1 or args.timeout <= 0:
    parser.error("need --replicate, --steps, --batch-size, --save-every >= 1, --timeout > 0")
if world % args.replicate or args.batch_size % world:
    parser.error(f"--replicate {args.replicate} must divide the {world} ranks, and "
                 f"--batch-size {args.batch_size} be a multiple of them")
if not 0 <= args.fault_step <= args.steps or not -world <= args.fault_rank < world:
    parser.error(f"need 0 <= --fault-step <= --steps and --fault-rank in -{world}..{world - 1}")

env = setup(args.timeout)
N, R = env.world_size, args.replicate
fault_rank = args.fault_rank % N
b = args.batch_size // N  # this rank's sequences per step
(tokens,) = counting_data(args.steps * args.batch_size)[:]
batches = tokens.view(args.steps, args.batch_size, -1).to(env.device)  # step s: global batch s

# The same seeded model on every rank; rank 0 first trains a plain copy on each whole global
# batch, the one-process reference (before sharding: the sharded run may stop early).
seed_everything(SEED)
model = tiny_llama().to(env.device)
single_losses = []
if env.rank == 0:
    reference = tiny_llama().to(env.device)
    reference.load_state_dict(model.state_dict())
    opt = torch.optim.AdamW(reference.parameters(), lr=LR)
    for x in batches:
        loss = reference(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
        single_losses.append(loss.item())
    del reference, opt
shared_losses = [single_losses]
dist.broadcast_object_list(shared_losses, src=0)  # every rank prints them beside its own
single_losses = shared_losses[0]

# 1. HSDP: R replicas, each sharded over a row of WORLD_SIZE / R consecutive ranks.
### BEGIN SOLUTION: build the 2-D mesh: R rows named replicate, WORLD_SIZE / R columns named shard
### HINT a mesh of shape (R, N / R), dimension names ("replicate", "shard"): the first dimension
### HINT is the one fully_shard replicates over. Rank r must sit in row r // (N / R), so that a row
### HINT (a shard group) is a node's consecutive ranks. Look up: init_device_mesh
### HINT (torch/distributed/device_mesh.py).
mesh = init_device_mesh(env.device.type, (R, N // R), mesh_dim_names=("replicate", "shard"))
### END SOLUTION
### BEGIN SOLUTION: shard each decoder layer, then the root, on the 2-D mesh (HSDP)
### HINT as chapter 04: one FSDP unit per decoder layer, then the root (embeddings, final norm,
### HINT lm_head); given a 2-D mesh, fully_shard makes every parameter a DTensor placed
### HINT (Replicate(), Shard(0)). Look up: fully_shard's mesh argument
### HINT (torch/distributed/fsdp/_fully_shard/_fully_shard.py).
for layer in model.model.layers:
    fully_shard(layer, mesh=mesh)
fully_shard(model, mesh=mesh)
### END SOLUTION
optimizer = torch.optim.AdamW(model.parameters(), lr=LR)


# 2. The guard's numbers: what every rank must agree on, in one collective per step.
def share(loss: torch.Tensor, grad_norm: torch.Tensor) -> tuple[float, float, bool]:
    """(the mean loss over all ranks, the gradient norm, stop) from this rank's loss (the mean
    over its own sequences) and its gradient norm; the same three values on every rank."""
    ### BEGIN SOLUTION: share(): one all-reduce, then the mean loss, the norm and the verdict
    ### HINT every rank must return the same three values: the loss averaged over all N ranks
    ### HINT (their shares are equal), the norm, and stop = True when the loss or the norm is
    ### HINT not finite on ANY rank. Ranks hold different numbers here (their own sequences; under
    ### HINT HSDP the norm is reduced within a shard group only). One all-reduce of a small tensor,
    ### HINT one host sync. Look up: dist.all_reduce, math.isfinite (a NaN spreads through a sum).
    shared = torch.stack([loss.float(), grad_norm.float()])
    dist.all_reduce(shared)  # a sum over every rank: NaN on one rank is NaN on all
    mean_loss, norm = (shared / N).tolist()
    return mean_loss, norm, not (math.isfinite(mean_loss) and math.isfinite(norm))
    ### END SOLUTION


def save(step: int):
    dcp.save(get_model_state_dict(model), checkpoint_id=os.path.join(args.ckpt_dir,
                                                                      f"step_{step}"))


def report(stopped_at: int | None, problem: str = ""):
    """Gather what the checker reads and write it (--json, rank 0). Every rank calls it."""
    finite = all(torch.isfinite(p.to_local()).all().item() for p in model.parameters())
    mine = {"stopped_at": stopped_at, "weights_finite": finite,
            "groups": {d: dist.get_process_group_ranks(mesh.get_group(d))
                       for d in mesh.mesh_dim_names},
            "step1_collectives": sorted({(c.op, c.ranks) for c in step1.collectives}),
            "share_collectives": [(c.op, c.ranks) for c in guard.collectives],
            "param_bytes_held": sum(p.to_local().nbytes for p in model.parameters())}
    ranks = [None] * N
    dist.all_gather_object(ranks, mine)
    saved = sorted(int(n[5:]) for n in os.listdir(args.ckpt_dir) if n.startswith("step_")) \
        if os.path.isdir(args.ckpt_dir) else []
    write_json(args.json, {
        "world_size": N, "replicate": R, "mesh_shape": list(mesh.shape),
        "mesh_dim_names": list(mesh.mesh_dim_names),
        "placements": sorted({str(tuple(map(repr, p.placements))) if isinstance(p, DTensor)
                              else "not a DTensor" for p in model.parameters()}),
        "param_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
        "ranks": ranks, "losses": losses, "single_losses": single_losses[:len(losses)],
        "tolerance": LOSS_TOL, "fault_step": args.fault_step, "fault_rank": fault_rank,
        "save_every": args.save_every, "saved": saved, "verdicts": verdicts, "problem": problem})


if env.rank == 0 and os.path.isdir(args.ckpt_dir):  # a fresh run: no checkpoints of another
    shutil.rmtree(args.ckpt_dir)
dist.barrier()
step1, guard = CollectiveLog(), CollectiveLog()  # step 1's forward + backward; share()'s
losses, verdicts = [], []  # the shared mean loss per step; each step's verdict on every rank
print0(f"{N} ranks: HSDP on a {R} x {N // R} mesh ({R} replica(s), each sharded over "
       f"{N // R} rank(s)); " + (f"a gradient shard corrupted on rank {fault_rank} at step "
                                 f"{args.fault_step}" if args.fault_step else "no fault")
       + f", checkpoints every {args.save_every} steps")
for step in range(1, args.steps + 1):
    rows = batches[step - 1, env.rank * b:(env.rank + 1) * b]  # this rank's slice
    with step1 if step == 1 else nullcontext():
        loss = model(input_ids=rows, labels=rows).loss
        loss.backward()
    if step == args.fault_step and env.rank == fault_rank:  # the fault: one element, one rank
        grad = next(p.grad.to_local() for p in model.parameters() if p.to_local().numel())
        grad.view(-1)[0] = float("nan")
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
    if isinstance(grad_norm, DTensor):  # reduced over the mesh's shard dimension
        grad_norm = grad_norm.full_tensor()
    with guard if step == 1 else nullcontext():
        mean_loss, norm, stop = share(loss.detach(), grad_norm)
    losses.append(mean_loss)
    # The exercise's own check, not part of a recipe: every rank's verdict, every step. Where
    # they differ, a real job parts here (some ranks leave, the others go on); this one says so.
    every = torch.zeros(N, device=env.device)  # each rank fills its slot, a sum gathers them
    every[env.rank] = float(stop)
    dist.all_reduce(every)
    verdicts.append([bool(v) for v in every.tolist()])
    if len(set(verdicts[-1])) > 1:
        report(None, f"the guard's verdicts differ at step {step}")
        print0(f"the ranks disagree at step {step}: stop = {verdicts[-1]}", file=sys.stderr)
        dist.destroy_process_group()
        os._exit(1)
    ### BEGIN SOLUTION: on a non-finite verdict: report(step), then every rank exits with status 3
    ### HINT before the optimizer step and before any save: no NaN may reach a weight or a
    ### HINT checkpoint. Say why on stderr (rank 0), call report(step) (every rank: it writes what
    ### HINT the checker reads), then leave as teardown() does (code/distkit/dist.py) but with a
    ### HINT failure's exit status, 3, so that torchrun and the scheduler see a failed job.
    if stop:
        print0(f"non-finite loss {mean_loss} or gradient norm {norm} at step {step}: stopped "
               f"without saving", file=sys.stderr)
        report(step)
        dist.destroy_process_group()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(3)
    ### END SOLUTION
    optimizer.step()
    optimizer.zero_grad()
    print0(f"step {step}  loss {mean_loss:.3f}  (one process: {single_losses[step - 1]:.3f})  "
           f"grad norm {norm:.3f}")
    if step % args.save_every == 0:
        save(step)
report(None)
teardown()

### BEGIN SOLUTION
# Answers to "Predict, then measure":
# 1. The mesh is [[0, 1], [2, 3]]: rank 1's all-gathers and reduce-scatters span its row,
#    ranks [0, 1] (its shard group, a node); its gradient all-reduce spans its column, [1, 3].
#    --replicate 4 (4 x 1): shard groups of one rank, so FSDP2 gathers and reduce-scatters
#    nothing (every rank holds whole parameters) and all-reduces over all 4: DDP. --replicate 1
#    (1 x 4): plain FSDP over all 4, plus an all-reduce per unit over a group of one rank (FSDP2
#    issues it even so; no byte leaves the rank). The JSON's step1_collectives show each.
# 2. Ranks 2 and 3: clip_grad_norm_ reduces the norm over the shard group [2, 3] only, so ranks
#    0 and 1, which hold the other replica's intact copy of the shard, see a finite norm (the
#    checker's wrong answer shows it). 2 and 3 leave; 0 and 1 step and go on to the first
#    collective that needs a rank that left: here the step-4 save (DCP gathers every rank's
#    plan); without a save, step 5's gradient all-reduce down their column ([0, 2], [1, 3]);
#    step 5's forward still runs, its all-gathers stay within the row [0, 1]. There they fail
#    (gloo: the peer closed the connection; NCCL: the watchdog's timeout), unless torchrun,
#    which polls its ranks every 0.1 s (--monitor-interval) and stops a node's ranks when one
#    of them exits non-zero, stops them first. Had 2 and 3 exited 0, nothing stops 0 and 1
#    before the timeout.
# 3. Yes: the NaN loss makes that rank's gradients NaN in backward; the reduce-scatter sums them
#    into every shard of its row, the all-reduce down the columns into the other replicas: every
#    rank's norm is NaN. This script's fault, after the reduction, reaches only its row's norm.
# 4. torchrun exits 1 when a rank fails (run_w_torchrun.sh names the rank's 3). Any non-zero
#    status fails the Slurm job. train_llama.sbatch requeues failures (most are transient
#    hardware faults) up to a cap, but not one that train_llama.py marked deterministic in
#    OUT/failed.json: a NaN is not rerun on the same data to fail again. The exit status
#    cannot carry that through torchrun; a file can.
# The capstone's own versions: train_llama.py's --replicate (the mesh) and its non-finite stop
# (one all-reduce of [loss, stop flag, gradient norm] per step, exit status 3).
### END SOLUTION

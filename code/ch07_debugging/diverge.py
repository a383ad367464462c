"""Ranks that silently diverge: each rank starts from different weights, and nothing errors.

    code/run_w_torchrun.sh 2 ch07_debugging/diverge.py
    code/run_w_torchrun.sh 2 ch07_debugging/diverge.py --variants seed-per-rank,broadcast --json OUT

Hand-rolled data parallelism: every rank computes the gradient of its shard of the batch,
all-reduces it (SUM, then / N) and steps its own optimizer. Every rank then applies the same
update (with SGD, momentum too, a function of the averaged gradients only), so the ranks hold one
model only if they START as one model. When they don't, nothing fails: losses fall, and the ranks
train different models forever, w_rank1 - w_rank0 frozen at its initial value.

seed-per-rank  torch.manual_seed(seed + rank) before building the model: a per-rank seed meant
               for data order or dropout, set too early.
rng-drift      the same seed everywhere, but rank 0 draws random numbers the others don't before
               building the model (here: it picks validation samples to log), so its stream has
               moved on and its weights differ.
broadcast      the fix: build the buggy (seed + rank) model, then broadcast every parameter and
               buffer from rank 0.
ddp            DistributedDataParallel around the buggy model: its constructor makes that same
               broadcast (torch 2.13, nn/parallel/distributed.py: DistributedDataParallel.__init__
               calls _sync_module_states, which calls dist._broadcast_coalesced from rank 0).

A checksum of the parameters (3 numbers per rank, gathered) catches the two bugs at step 0; the
fixes are checked against one process training rank 0's initial model on the whole batch.
"""
import argparse
import copy
import os
from itertools import chain

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from distkit import print0, seed_everything, setup, teardown, write_json

VARIANTS = ("seed-per-rank", "rng-drift", "broadcast", "ddp")
FIXES = ("broadcast", "ddp")
TOL = 1e-5  # parity with one process; summing float32 in another order differs by ~1e-7
FEATURES, HIDDEN, CLASSES = 16, 32, 4

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--variants", default=",".join(VARIANTS),
                    help=f"comma-separated, from: {', '.join(VARIANTS)} (default: all)")
parser.add_argument("--steps", type=int, default=20)
parser.add_argument("--batch", type=int, default=32, help="global batch, split over the ranks")
parser.add_argument("--lr", type=float, default=0.1)
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--json", help="write the per-step results here (rank 0)")
args = parser.parse_args()
variants = [v for v in args.variants.split(",") if v]
unknown = sorted(set(variants) - set(VARIANTS))
if unknown or not variants:
    parser.error(f"unknown --variants {', '.join(unknown) or '(none given)'}; "
                 f"choose from {', '.join(VARIANTS)}")
if args.steps < 1:
    parser.error("--steps must be at least 1")
world = int(os.environ.get("WORLD_SIZE", 1))
if args.batch < 1 or args.batch % world:
    parser.error(f"--batch {args.batch} must be a positive multiple of the {world} processes")

env = setup(timeout_s=60)
rank, n, device = env.rank, env.world_size, env.device
shard = args.batch // n


def mlp() -> nn.Module:
    """Initialised from torch's global RNG: whatever state it is in on this rank."""
    return nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, CLASSES))


def batch(seed: int, size: int):
    """A labelled batch from its own generator: the data never depend on the global RNG that the
    bugs disturb, and every rank can build the same global batch and take its shard."""
    teacher = torch.randn(FEATURES, CLASSES, generator=torch.Generator().manual_seed(1234))
    x = torch.randn(size, FEATURES, generator=torch.Generator().manual_seed(seed))
    return x.to(device), (x @ teacher).argmax(1).to(device)


def build(variant: str) -> nn.Module:
    if variant == "rng-drift":
        seed_everything(args.seed)
        if rank == 0:  # e.g. choose which validation samples to log, only where logging happens
            torch.randperm(1000)[:64]
    else:  # seed-per-rank, and the buggy start that both fixes repair
        seed_everything(args.seed + rank)
    return mlp().to(device)


def broadcast_from_rank0(model: nn.Module) -> None:
    """What DDP's constructor does, one tensor at a time (DDP packs them into buckets of
    broadcast_bucket_size bytes: fewer, larger messages)."""
    for t in chain(model.parameters(), model.buffers()):
        dist.broadcast(t.detach(), src=0)  # in place: rank 0's values everywhere


def checksum(model: nn.Module) -> torch.Tensor:
    """3 float64 numbers summing up every parameter and buffer: sum, sum of squares, and a sum
    weighted by position (which catches swapped values, invisible to the first two).

    Why not compare the weights themselves? That means gathering N copies of the model on one
    rank; this is one pass over the weights and 3 numbers per rank on the wire, cheap enough to
    run at every step or checkpoint. Two different models can in principle share a checksum, but
    a real bug (another seed, a missed update) changes many weights at once: it shows.
    """
    total = torch.zeros(3, dtype=torch.float64, device=device)
    for i, t in enumerate(chain(model.parameters(), model.buffers())):
        v = t.detach().reshape(-1).double()
        where = i + torch.arange(v.numel(), dtype=torch.float64, device=device) / v.numel()
        total += torch.stack([v.sum(), (v * v).sum(), (v * where).sum()])
    return total


def ranks_disagreeing(model: nn.Module) -> tuple[list[int], list[list[float]]]:
    """Gather every rank's checksum; the ranks whose checksum differs from rank 0's. Exact
    equality: the same weights give bit-identical checksums on identical hardware (across
    different hardware, compare with a tolerance instead)."""
    mine = checksum(model)
    every = [torch.empty_like(mine) for _ in range(n)]
    dist.all_gather(every, mine)
    return ([r for r in range(n) if not torch.equal(every[r], every[0])],
            [c.tolist() for c in every])


def weight_gap(model: nn.Module) -> float:
    """max over weights of (max over ranks - min over ranks), = max |w_rank0 - w_rank1| on 2
    ranks. One all-reduce: MAX of [w, -w] gives the maximum and minus the minimum together."""
    w = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    both = torch.cat([w, -w])
    dist.all_reduce(both, op=dist.ReduceOp.MAX)
    return (both[:w.numel()] + both[w.numel():]).max().item()


def gather_rows(values: list[float]) -> list[list[float]]:
    """Every rank's list of numbers, in rank order (a collective)."""
    mine = torch.tensor(values, dtype=torch.float64, device=device)
    every = [torch.empty_like(mine) for _ in range(n)]
    dist.all_gather(every, mine)
    return [t.tolist() for t in every]


def train(variant: str) -> dict:
    model = build(variant)
    if variant == "broadcast":
        broadcast_from_rank0(model)
    # the single-process reference: rank 0's initial model, trained on the whole global batch
    reference = copy.deepcopy(model) if rank == 0 and variant in FIXES else None
    net = DDP(model) if variant == "ddp" else model  # DDP's constructor broadcasts from rank 0
    disagree, sums = ranks_disagreeing(model)

    def sgd(m):  # momentum: the update is a function of the averaged gradients only
        return torch.optim.SGD(m.parameters(), lr=args.lr, momentum=0.9)
    opt = sgd(model)
    ref_opt = sgd(reference) if reference else None
    x_eval, y_eval = batch(-1, 256)  # one fixed batch every rank evaluates its own model on

    def eval_loss():
        with torch.no_grad():
            return F.cross_entropy(model(x_eval), y_eval).item()
    gaps, evals, losses, ref_losses, ref_gap = [weight_gap(model)], [eval_loss()], [], [], 0.0
    for step in range(args.steps):
        x, y = batch(step, args.batch)  # the global batch; this rank trains on its shard
        loss = F.cross_entropy(net(x[rank * shard:(rank + 1) * shard]),
                               y[rank * shard:(rank + 1) * shard])
        opt.zero_grad()
        loss.backward()
        if variant != "ddp":  # hand-rolled data parallelism (DDP does this inside backward)
            for p in model.parameters():
                dist.all_reduce(p.grad)  # SUM
                p.grad /= n
        opt.step()
        losses.append(loss.item())
        if reference:
            ref_loss = F.cross_entropy(reference(x), y)
            ref_opt.zero_grad()
            ref_loss.backward()
            ref_opt.step()
            ref_losses.append(ref_loss.item())
            ref_gap = max(ref_gap, max((a - b).abs().max().item() for a, b in
                                       zip(reference.parameters(), model.parameters())))
        gaps.append(weight_gap(model))
        evals.append(eval_loss())

    # every rank's curves to rank 0 (a rank-0-only log shows one falling loss: all looks well)
    train_loss, eval_losses = gather_rows(losses), gather_rows(evals)
    end_disagree, _ = ranks_disagreeing(model)

    result = {"checksums_step0": sums, "ranks_disagreeing_step0": disagree,
              "checksums_equal_step0": not disagree, "ranks_disagreeing_end": end_disagree,
              "weights_equal_end": gaps[-1] == 0.0 and not end_disagree,
              "weight_gap": gaps, "train_loss": train_loss, "eval_loss": eval_losses,
              "parity": None}
    if reference:
        # the global loss of a step: the mean of the ranks' shard means (equal shards)
        global_loss = torch.tensor(train_loss).mean(0)
        loss_diff = (global_loss - torch.tensor(ref_losses)).abs().max().item()
        result["parity"] = {"max_loss_diff": loss_diff, "max_weight_diff": ref_gap,
                            "ok": loss_diff < TOL and ref_gap < TOL}
    return result


results = {v: train(v) for v in variants}

print0(f"{n} ranks, global batch {args.batch} ({shard} per rank), {args.steps} steps of SGD "
       "with momentum")
rows = [("variant", "checksums equal at step 0", f"weights equal after {args.steps} steps",
         "parity with 1 process (< 1e-5)")]
for v, r in results.items():
    eq0, others = str(r["checksums_equal_step0"]), r["ranks_disagreeing_step0"]
    if others:
        eq0 += (f" (rank{'s' * (len(others) > 1)} {', '.join(map(str, others))} "
                f"differ{'s' * (len(others) == 1)} from rank 0)")
    rows.append((v, eq0, str(r["weights_equal_end"]),
                 "n/a" if r["parity"] is None else str(r["parity"]["ok"])))
widths = [max(map(len, column)) for column in zip(*rows)]
for row in rows:
    print0("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
for v, r in results.items():
    if not r["checksums_equal_step0"]:
        gap0, gap_end = r["weight_gap"][0], r["weight_gap"][-1]
        print0(f"{v}: largest weight gap between ranks after {args.steps} steps / at step 0 = "
               f"{gap_end / gap0:.2f} (it never closes)")

write_json(args.json, {"world_size": n, "steps": args.steps, "batch": args.batch,
                       "tolerance": TOL, "variants": results})
teardown()

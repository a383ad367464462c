# Yours to fill in (generated from ../solutions/ex07_early_stop.py).
"""Exercise 07.1: early stopping that every rank decides alike.

    code/run_w_torchrun.sh 2 ch07_debugging/exercises/ex07_early_stop.py

A data-parallel training loop (each rank its own training batches, gradients averaged with one
all_reduce per parameter) stops early once the validation loss falls below --target. Each rank
evaluates its own shard of the validation set, and the shards are not alike: the set is stored
class by class, as many are, and each rank takes a contiguous block of it, so rank 0 holds the
easy classes and rank 1 the two that overlap. A rank that decides on its own shard's loss stops
at another step than its neighbour; it leaves the loop while the other waits for it in the next
gradient all_reduce, until the process group's timeout. The decision must be collective: add up
the per-sample losses and the sample counts over the ranks (one all_reduce of the two sums), so
every rank compares the same number with --target: the loss over the whole validation set, the
one a single process computes.
Fill in validation_loss(), replacing the todo(...) call with your code. Run the script at any
time: it stops at the todo() while it is there (at the first validation, before any rank can
stop), then prints each validation and checks that every rank stopped at the same step and that
the loss is one process's; `make exercise EX=07.1` checks it at 2 and 3 ranks. Solution, with the
answers to the questions below: ../solutions/ex07_early_stop.py.

Predict, then measure:
1. Delete only the todo() line, keeping the shard's own loss: which rank leaves the loop first,
   at which step, and in which collective does each rank then wait? What ends the run, after
   how long (--timeout), and what does each rank's error say?
2. All-reduce the ranks' mean losses and divide by the world size: do the ranks still agree (no
   hang)? Is it one process's loss, with shards of 501 and 500 samples? On 3 ranks?
3. Let rank 0 alone decide, on the whole-set loss, and broadcast a 0/1 tensor: what does that
   cost per validation against your all_reduce? And if rank 0 decided on its own shard?
4. Shard the validation set like the training set (every world_size-th sample): do the
   shards' losses agree now? Is the per-shard decision then safe, or only rarely wrong?
"""
import argparse

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from distkit import (print0, print_ranks, same_on_all_ranks, seed_everything, setup, teardown,
                     todo, write_json)

CLASSES, FEATURES, TRAIN, VAL = 4, 8, 4096, 1001  # VAL odd: shards of 501 and 500 on 2 ranks
BATCH, LR, SEED = 32, 0.05, 0  # per rank per step; SGD
# Against one process: float64 sums of float32 per-sample losses; a dropped or doubled sample,
# or a mean of the ranks' means (501 and 500 samples weighed alike), misses by 1e-4 or more.
LOSS_TOL = 1e-6
parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--target", type=float, default=0.35,
                    help="stop once the validation loss is below this (mean cross-entropy)")
parser.add_argument("--eval-every", type=int, default=5, help="steps between validations")
parser.add_argument("--max-steps", type=int, default=200, help="stop here in any case")
parser.add_argument("--timeout", type=float, default=20,
                    help="seconds a collective may wait for the other ranks before failing")
parser.add_argument("--json", help="write every validation's losses and the stop steps here")
args = parser.parse_args()
if args.target <= 0 or args.eval_every < 1 or args.max_steps < 1 or args.timeout <= 0:
    parser.error("need --target > 0, --eval-every >= 1, --max-steps >= 1 and --timeout > 0")

env = setup(timeout_s=args.timeout)


def make_data(n: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """n samples of CLASSES Gaussian blobs: classes 0 and 1 apart, 2 and 3 overlapping."""
    y = torch.randint(0, CLASSES, (n,), generator=generator)
    return CENTERS[y] + torch.randn(n, FEATURES, generator=generator), y


# The same data on every rank (one seed); each rank then takes its share.
g = torch.Generator().manual_seed(SEED)
CENTERS = 2 * torch.randn(CLASSES, FEATURES, generator=g)
CENTERS[3] = CENTERS[2] + torch.randn(FEATURES, generator=g)  # 3 overlaps 2: the hard pair
train_x, train_y = make_data(TRAIN, g)
val_x, val_y = make_data(VAL, g)
order = torch.argsort(val_y, stable=True)  # stored class by class
val_x, val_y = val_x[order].to(env.device), val_y[order].to(env.device)
# Training: every world_size-th sample (a DistributedSampler's share: alike on every rank).
# Validation: a contiguous block (file shards, np.array_split): on 2 ranks, rank 0 holds the
# easy classes 0 and 1, rank 1 the hard 2 and 3.
my_train_x, my_train_y = train_x[env.rank::env.world_size], train_y[env.rank::env.world_size]
my_val_x = torch.tensor_split(val_x, env.world_size)[env.rank]
my_val_y = torch.tensor_split(val_y, env.world_size)[env.rank]

seed_everything(SEED)  # the same initial weights on every rank
model = nn.Sequential(nn.Linear(FEATURES, 32), nn.Tanh(), nn.Linear(32, CLASSES)).to(env.device)
optimizer = torch.optim.SGD(model.parameters(), lr=LR)
batches = torch.Generator().manual_seed(SEED + 1 + env.rank)  # each rank its own batches


def train_step() -> None:
    """One data-parallel step: this rank's batch, gradients averaged over the ranks."""
    i = torch.randint(0, len(my_train_y), (BATCH,), generator=batches)
    loss = F.cross_entropy(model(my_train_x[i].to(env.device)), my_train_y[i].to(env.device))
    optimizer.zero_grad()
    loss.backward()
    for p in model.parameters():  # a collective: every rank must be here, every step
        dist.all_reduce(p.grad)
        p.grad /= env.world_size
    optimizer.step()


def mean(sums: torch.Tensor) -> float:
    return (sums[0] / sums[1]).item()


@torch.no_grad()
def loss_sum_and_count(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """[summed cross-entropy, samples] of the model on (x, y), in float64 (to add up)."""
    losses = F.cross_entropy(model(x), y, reduction="none")
    return torch.stack([losses.double().sum(), losses.new_tensor(len(y), dtype=torch.float64)])


def validation_loss(sums: torch.Tensor) -> float:
    """The validation loss that every rank compares with --target, from `sums`: this rank's
    [summed loss, samples] over its shard of the validation set. A collective."""
    loss = mean(sums)  # this rank's shard alone: if each rank decided on it (the bug), ...
    # TODO(you): the shards differ, so their losses fall below --target at different steps, and a
    # rank that stops leaves the others waiting in their next gradient all_reduce. Every rank must
    # compare the same number: the mean loss over the whole validation set, the one a single process
    # computes (what must be added up over the ranks so that 501 and 500 samples weigh alike?). The
    # loop also reads `sums`: leave it as it is.
    todo("validation_loss(): the loss over every rank's shard, the same on every rank")
    return loss


history = []  # one entry per validation: step, the decision's loss, this rank's shard's loss
for step in range(1, args.max_steps + 1):
    train_step()
    if step % args.eval_every == 0:
        sums = loss_sum_and_count(my_val_x, my_val_y)
        loss = validation_loss(sums)
        entry = {"step": step, "loss": loss, "shard_loss": mean(sums)}
        if env.rank == 0:  # the reference: one process, the whole validation set
            entry["one_process"] = mean(loss_sum_and_count(val_x, val_y))
        history.append(entry)
        if loss < args.target:
            break

# Every rank's record, on every rank (all of them print and check the same verdicts).
records = [None] * env.world_size
dist.all_gather_object(records, {"stopped": step, "history": history})
steps = [r["stopped"] for r in records]
histories = [r["history"] for r in records]
same_step = len(set(steps)) == 1
same_loss = all([e["loss"] for e in h] == [e["loss"] for e in histories[0]] for h in histories)
same_weights = same_on_all_ranks(model.parameters())
ref = histories[0]
parity = max(abs(e["loss"] - r["one_process"]) for e, r in zip(history, ref))
alone = [next((e["step"] for e in h if e["shard_loss"] < args.target), None) for h in histories]

shards = [len(s) for s in torch.tensor_split(torch.arange(VAL), env.world_size)]
print0(f"{env.world_size} ranks; validation: {VAL} samples stored class by class, contiguous "
       f"shards of {shards}; stop when the loss < {args.target}, checked every "
       f"{args.eval_every} steps")
print0(" step  validation loss  " + "  ".join(f"rank {r}'s shard" for r in range(env.world_size)))
for i, e in enumerate(ref):
    print0(f"{e['step']:5d}  {e['loss']:15.2f}  "
           + "  ".join(f"{h[i]['shard_loss']:12.2f}" for h in histories))
print0(f"every rank stopped at step {steps[0]}: {same_step}")
print0(f"the ranks' validation losses are identical: {same_loss}; weights too: {same_weights}")
print0(f"validation loss == one process's, every check (max diff < {LOSS_TOL:g}): "
       f"{parity < LOSS_TOL}")
print_ranks("deciding on its own shard it would stop at "
            + (f"step {alone[env.rank]}" if alone[env.rank] else f"no step up to {steps[0]}"))
write_json(args.json, {
    "world_size": env.world_size, "val_samples": VAL, "shards": shards, "target": args.target,
    "eval_every": args.eval_every, "max_steps": args.max_steps, "histories": histories,
    "stopped": steps, "alone": alone, "same_step": same_step, "same_loss": same_loss,
    "same_weights": same_weights, "max_diff_one_process": parity, "tolerance": LOSS_TOL})
assert same_step and same_loss and same_weights, f"the ranks stopped at steps {steps}"
assert parity < LOSS_TOL, (f"the validation loss misses one process's by {parity:.1e}: are the "
                           f"summed losses and the counts all-reduced, not the ranks' means?")
teardown()

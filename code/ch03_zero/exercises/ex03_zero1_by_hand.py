# Yours to fill in (generated from ../solutions/ex03_zero1_by_hand.py).
"""Exercise 03.1: ZeRO-1 by hand, each rank keeping AdamW's state for 1/N of the weights.

    code/run_w_torchrun.sh 2 ch03_zero/exercises/ex03_zero1_by_hand.py

Every rank builds the same model (same seed) and trains it on its part of each global batch, as
in DDP. What changes is the optimizer: all Psi parameters are flattened into one fp32 vector,
padded to a multiple of N, and rank r owns the contiguous shard [r*S, (r+1)*S), S = padded/N.
Give each rank a plain AdamW over its shard only (a standalone copy: the fp32 master of its
slice), so that exp_avg and exp_avg_sq exist for S values, not Psi: ZeRO-1. Each step,
reduce-scatter the flat gradient (summed over ranks, each rank keeping its slice; divide by N
for the mean), let the shard take its AdamW step, and all-gather the updated shards back into
every rank's full copy of the weights. The losses and weights must then match one process
training on the global batch (computed here, on every rank), while each rank's optimizer state
is about 1/N of that process's.
Fill in the TODO(you) parts, replacing each todo(...) call with your code. Run the script at any
time: it stops at the first todo() left and says what is missing; `make exercise EX=03.1` checks
it at 2 and 3 ranks. Solution, with the answers to the questions below:
../solutions/ex03_zero1_by_hand.py.

Predict, then measure:
1. Psi = 98,624 here. How many bytes of optimizer state does each rank hold at N = 4
   (code/run_w_torchrun.sh 4 ...), and one process? Why not exactly a quarter?
2. Only the optimizer state is sharded: every rank still holds all Psi weights and all Psi
   gradients. ZeRO-2 shards the gradients too: which tensor in this loop would then need only S
   values, and from which line on is the rest of the flat gradient no longer needed?
3. DDP all-reduces Psi gradient values per step; this script reduce-scatters Psi values and
   all-gathers Psi. Which sends more bytes per rank? (Chapter 00: how does a ring all-reduce
   work?)
4. Start every rank from different weights (seed_everything(SEED + env.rank) for the ZeRO-1
   model). After one step, are the weights identical on every rank? Do the losses still match
   one process's?
"""
import argparse

import torch
import torch.distributed as dist
from torch.distributed.tensor.debug import CommDebugMode
from torch.nn.utils import parameters_to_vector

from distkit import (print0, print_ranks, same_on_all_ranks, seed_everything, setup, teardown,
                     todo, write_json)
from distkit.toy import counting_data, tiny_llama

# Against one process: float32 rounding differs (the gradient summed in another order); a wrong
# shard, a missing division by N or a stale copy-back miss by far more.
LOSS_TOL, WEIGHT_TOL = 1e-4, 1e-4
GRAD_TOL = 1e-4  # step 1's gradient, relative to its largest value (AdamW hides a wrong scale)
SEED = 0
parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--steps", type=int, default=6, help="training steps")
parser.add_argument("--batch-size", type=int, default=4, help="sequences per step, per process")
parser.add_argument("--lr", type=float, default=3e-3, help="AdamW's learning rate")
parser.add_argument("--json", help="write losses, parity and optimizer-state bytes here (rank 0)")
args = parser.parse_args()
if args.steps < 1 or args.batch_size < 1:
    parser.error("need --steps >= 1 and --batch-size >= 1")


def gap_to(reference: torch.Tensor, grad: torch.Tensor | None) -> dict:
    """How far a gradient lies from one process's: the largest difference over the largest
    value, and the scale between them (1: the mean; N: the sum over the ranks)."""
    if grad is None:
        return {"gap": None, "scale": None}
    return {"gap": ((grad - reference).abs().max() / reference.abs().max()).item(),
            "scale": (grad @ reference / (reference @ reference)).item()}


def state_bytes(optimizer) -> int:
    """Bytes of every tensor the optimizer keeps: AdamW's exp_avg and exp_avg_sq (4 bytes per
    value each) and its step counter (a 4-byte float32 tensor per parameter tensor)."""
    return sum(t.nbytes for state in optimizer.state.values() for t in state.values()
               if torch.is_tensor(t))


env = setup()
N, b = env.world_size, args.batch_size
# Step s trains on the global batch of N*b sequences number s*N*b ... (s+1)*N*b - 1;
# rank r reads its b rows of it.
(tokens,) = counting_data(args.steps * N * b)[:]
batches = tokens.view(args.steps, N * b, -1).to(env.device)

# The reference: one process, plain AdamW over the whole model, on the global batch. Every rank
# computes it (the model is tiny), so no rank waits for another.
seed_everything(SEED)
model = tiny_llama().to(env.device)
reference = torch.optim.AdamW(model.parameters(), lr=args.lr)
single_losses = []
for step in range(args.steps):
    loss = model(input_ids=batches[step], labels=batches[step]).loss
    loss.backward()
    if step == 0:  # for the check of the first reduce-scatter
        single_grad = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    reference.step()
    reference.zero_grad()
    single_losses.append(loss.item())
single_weights = parameters_to_vector(model.parameters()).detach().clone()
single_state = state_bytes(reference)

# ZeRO-1: the same initial weights on every rank (the same seed: no broadcast needed).
seed_everything(SEED)
model = tiny_llama().to(env.device)
params = list(model.parameters())
sizes = [p.numel() for p in params]
psi = sum(sizes)
S = -(-psi // N)  # shard size: Psi / N rounded up
padded = N * S
flat = torch.zeros(padded, device=env.device)  # every rank's full copy, padding zeros at the end
flat[:psi] = parameters_to_vector(params).detach()
pad = torch.zeros(padded - psi, device=env.device)  # the padding's gradient: always zero
single_grad = torch.cat([single_grad, pad])
# TODO(you): rank r owns values [r*S, (r+1)*S) of flat. Its shard must be a tensor of its own that
# the optimizer can update (a leaf that requires grad, not a view of flat), and the AdamW built over
# the shard alone, so that its state exists for S values only. Look up: Tensor.clone,
# Tensor.requires_grad_.
todo("pick this rank's shard of flat (lo, hi, shard) and build the AdamW over it alone")

losses, step_collectives = [], []  # per step: {collective: calls}
for step in range(args.steps):
    rows = batches[step, env.rank * b:(env.rank + 1) * b]  # this rank's part of the batch
    loss = model(input_ids=rows, labels=rows).loss
    loss.backward()
    flat_grad = torch.cat([p.grad.reshape(-1) for p in params] + [pad])
    model.zero_grad()
    # Counts this step's collectives for the checker (torch's CommDebugMode, met in chapter 02):
    # your code goes inside the block; leave the block as it is.
    with CommDebugMode() as comm:
        # TODO(you): shard.grad must hold this rank's slice of flat_grad summed over all ranks,
        # divided into the mean the one-process loss stands for. One collective does the sum and the
        # slicing: dist.reduce_scatter_single (formerly reduce_scatter_tensor;
        # torch/distributed/distributed_c10d.py).
        todo("reduce-scatter flat_grad into shard.grad, then divide it by N")
        if step == 0:  # the check: this rank's slice of the synced gradient against one process's
            grad_check = gap_to(single_grad[lo:hi], shard.grad)
        optimizer.step()  # AdamW on S values: the only place this rank's optimizer state lives
        optimizer.zero_grad()
        # TODO(you): every rank needs every rank's updated shard in its flat copy, then the model's
        # parameters must hold those values for the next forward (without autograd seeing the copy).
        # Look up: dist.all_gather_single (formerly all_gather_into_tensor), Tensor.split,
        # Tensor.copy_, torch.no_grad.
        todo("all-gather the updated shards into flat, then into the parameters")
    step_collectives.append({str(op).split(".")[-1]: n
                             for op, n in comm.get_comm_counts().items()})
    loss = loss.detach()
    dist.all_reduce(loss)  # for the log: the mean over all ranks' sequences
    losses.append(loss.item() / N)
    # 3 decimals: further digits differ in the last float bits between CPUs and world sizes
    print0(f"step {step + 1:2d}  loss {losses[-1]:.3f}  (one process: {single_losses[step]:.3f})")

grad_checks = [None] * N  # every rank's slice
dist.all_gather_object(grad_checks, grad_check)
max_loss_diff = max(abs(x - y) for x, y in zip(losses, single_losses))
max_weight_diff = (parameters_to_vector(params) - single_weights).abs().max().item()
grad_ok = all(c["gap"] is not None and c["gap"] < GRAD_TOL for c in grad_checks)
print0(f"step 1's gradient, every rank's slice    = one process's: {grad_ok}")
print0(f"max loss difference vs one process        < 1e-4: {max_loss_diff < LOSS_TOL}")
print0(f"max weight difference after the last step < 1e-4: {max_weight_diff < WEIGHT_TOL}")

mine = state_bytes(optimizer)
per_rank = [None] * N
dist.all_gather_object(per_rank, mine)
print0(f"Psi = {psi:,} parameters in {len(params)} tensors, padded to {padded:,} = N x S, "
       f"S = {S:,}")
print_ranks(f"shard [{lo:,}, {hi:,}): AdamW state {mine:,} bytes = 8 x S + 4 (one step counter)")
print0(f"one process's AdamW state: {single_state:,} bytes = 8 x Psi + 4 x {len(params)}")
ratio = mine / single_state
print0(f"optimizer state per rank / one process's: {ratio:.3f} (1/N = {1 / N:.3f})")
identical = same_on_all_ranks(params)  # every rank applied the same all-gathered weights
print0(f"after training, weights identical on every rank: {identical}")
write_json(args.json, {
    "world_size": N, "steps": args.steps, "batch_size": b, "lr": args.lr,
    "num_params": psi, "num_param_tensors": len(params), "padded": padded, "shard_size": S,
    "losses": losses, "single_losses": single_losses,
    "max_loss_diff": max_loss_diff, "max_weight_diff": max_weight_diff,
    "tolerances": {"loss": LOSS_TOL, "weight": WEIGHT_TOL, "grad": GRAD_TOL},
    "grad_checks": grad_checks, "step_collectives": step_collectives,
    "parity": max_loss_diff < LOSS_TOL and max_weight_diff < WEIGHT_TOL,
    "optimizer_state_bytes": per_rank, "optimizer_tensors_held": len(optimizer.state),
    "single_optimizer_state_bytes": single_state, "ratio": ratio, "identical": identical})
teardown()

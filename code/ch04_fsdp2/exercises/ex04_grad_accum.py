# Yours to fill in (generated from ../solutions/ex04_grad_accum.py).
"""Exercise 04.2: gradient accumulation with FSDP2, reduce-scattering once per step.

    code/run_w_torchrun.sh 2 ch04_fsdp2/exercises/ex04_grad_accum.py --micro-batches 4

Each optimizer step runs K micro-batches, forward and backward, before one AdamW step: the batch
of a big step with the activation memory of a small one. By default FSDP2 reduce-scatters every
unit's gradients in every backward, so K micro-batches cost K reduce-scatters per unit. With
model.set_requires_gradient_sync(False) a backward keeps its gradients on the rank, unsharded,
adding them up; the last micro-batch's backward, with sync back on, reduce-scatters their sum
once (FSDP1's no_sync(), DDP's no_sync()). The price: each rank holds full-size gradients
between micro-batches, not 1/N of them. Scale each micro-batch's loss so that the K of them add
up to the big batch's loss, and the losses match one process training on the whole global batch
(computed here, on every rank) either way; CommDebugMode counts the collectives of each.
Fill in the TODO(you) parts, replacing each todo(...) call with your code. Run the script at any
time: it stops at the first todo() left and says what is missing.
`make exercise EX=04.2` checks it at 2 and 3 ranks. Solution, with the answers
to the questions below: ../solutions/ex04_grad_accum.py.

Predict, then measure:
1. How many reduce-scatters and all-gathers per optimizer step at --micro-batches 8, in each
   mode? Why do the all-gathers not drop with the sync off?
2. Which FSDP2 setting would keep every layer's parameters gathered from one micro-batch to the
   next (fully_shard's arguments; FSDPModule's set_* methods), and what would it cost per rank?
3. Drop the division by K. The printed losses grow K-fold; do the models still train the same?
   (What does AdamW do to a gradient multiplied by K? Would SGD shrug it off too?)
4. If the micro-batches had different numbers of tokens (padding labelled -100), why would the
   mean over each divided by K no longer be the big batch's mean, and what would you divide by?
"""
import argparse
import warnings
from collections import Counter

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.debug import CommDebugMode

from distkit import print0, seed_everything, setup, teardown, todo, write_json
from distkit.dist import grad_check, grad_norms
from distkit.toy import counting_data, tiny_llama

# Against one process: float32 rounding differs (micro-batch gradients summed in another order);
# a missing 1/K or a gradient dropped between micro-batches misses by far more.
LOSS_TOL = 1e-5
SEED = 0
parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--steps", type=int, default=3, help="optimizer steps")
parser.add_argument("--micro-batches", type=int, default=4, help="K: micro-batches per step")
parser.add_argument("--batch-size", type=int, default=2,
                    help="sequences per micro-batch, per process")
parser.add_argument("--lr", type=float, default=3e-3, help="AdamW's learning rate")
parser.add_argument("--json", help="write losses, parity and collective counts here (rank 0)")
args = parser.parse_args()
if args.steps < 1 or args.micro_batches < 1 or args.batch_size < 1:
    parser.error("need --steps, --micro-batches and --batch-size >= 1")


def fsdp_model(mesh):
    """The same seeded model on every rank, one FSDP unit per decoder layer, then the root."""
    seed_everything(SEED)
    model = tiny_llama().to(env.device)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def collective_counts(comm: CommDebugMode) -> dict:
    """{op name: calls}, e.g. {"_allgather_base_": 20, "_reduce_scatter_base_": 3}."""
    return {str(op).split(".")[-1]: n for op, n in comm.get_comm_counts().items()}


# CommDebugMode's module tracker hooks every module's backward; transformers' dict outputs make
# torch warn that such hooks may not fire, and the tracker's hooks hand FSDP a view of the
# logits, which FSDP2 warns about (in-place ops on it; we only read the loss). Not ours to fix;
# keep the output readable.
warnings.filterwarnings("ignore", message="(For backward hooks|Full backward hook|FSDP2-wrapped "
                        "module .* returned a view tensor)")
env = setup()
N, K, b = env.world_size, args.micro_batches, args.batch_size
mesh = init_device_mesh(env.device.type, (N,))
# Step s trains on the global batch s of N*K*b sequences; rank r reads rows r*K*b ...
# (r+1)*K*b - 1 of it, as K micro-batches of b.
(tokens,) = counting_data(args.steps * N * K * b)[:]
batches = tokens.view(args.steps, N * K * b, -1).to(env.device)

# The reference: one process, the whole global batch in one go. Every rank computes it (the
# model is tiny), so no rank waits for another.
seed_everything(SEED)
model = tiny_llama().to(env.device)
reference = torch.optim.AdamW(model.parameters(), lr=args.lr)
single_losses = []
for step in range(args.steps):
    loss = model(input_ids=batches[step], labels=batches[step]).loss
    loss.backward()
    if step == 0:  # step 1's gradients: AdamW's steps ignore a constant factor, the losses too
        single_grads = grad_norms(model)
    reference.step()
    reference.zero_grad()
    single_losses.append(loss.item())

results = {}
for mode in ("every", "last"):  # reduce-scatter after every micro-batch / after the last only
    model = fsdp_model(mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    losses, counts = [], []
    for step in range(args.steps):
        micro = batches[step, env.rank * K * b:(env.rank + 1) * K * b].view(K, b, -1)
        total, calls = torch.zeros((), device=env.device), Counter()
        for k in range(K):
            if mode == "last":
                # TODO(you): the first K-1 backwards must keep their gradients on this rank, adding
                # up, and only the last backward reduce-scatter their sum. Look up: FSDPModule's
                # set_* methods (torch/distributed/fsdp/_fully_shard/_fully_shard.py).
                todo("sync the gradients on the last micro-batch only")
            # one counter per micro-batch: a CommDebugMode still open at the forward after a
            # backward fails in its module tracker (IndexError, torch 2.13)
            with CommDebugMode() as comm:
                # TODO(you): loss: this micro-batch's loss (the model's .loss is the mean over its
                # tokens), scaled so that the K losses, and so their gradients, add up to the mean
                # over all K micro-batches' tokens (every micro-batch has as many).
                todo("the micro-batch's loss, scaled to add up to the big batch's mean")
                loss.backward()
            calls.update(collective_counts(comm))
            total += loss.detach()
        if step == 0:  # a K-fold gradient trains like the right one under AdamW: compare them
            grads = grad_check(grad_norms(model), single_grads)
        optimizer.step()
        optimizer.zero_grad()
        dist.all_reduce(total)  # the mean over every rank's sequences, for the log
        losses.append(total.item() / N)
        counts.append(dict(calls))
    max_diff = max(abs(x - y) for x, y in zip(losses, single_losses))
    results[mode] = {"losses": losses, "counts": counts, "max_loss_diff": max_diff,
                     "parity": max_diff < LOSS_TOL, "grad_check": grads}

units = len(model.model.layers) + 1  # FSDP units: one per decoder layer, plus the root
print0(f"{K} micro-batches per optimizer step, {units} FSDP units, {N} processes")
print0("gradient sync after  reduce-scatters per step  all-gathers per step  "
       "max |loss - reference| < 1e-5")
for mode, label in (("every", "every micro-batch"), ("last", "the last only")):
    r, c = results[mode], results[mode]["counts"][-1]  # every step's counts are the same
    print0(f"{label:<19}  {c.get('_reduce_scatter_base_', 0):>24}  "
           f"{c.get('_allgather_base_', 0):>20}  {r['parity']}")
for step in range(args.steps):
    # 3 decimals: further digits differ in the last float bits between CPUs
    print0(f"step {step + 1}  loss {results['last']['losses'][step]:.3f}  (one process: "
           f"{single_losses[step]:.3f})")
write_json(args.json, {
    "world_size": N, "steps": args.steps, "micro_batches": K, "batch_size": b, "lr": args.lr,
    "fsdp_units": units, "single_losses": single_losses, "tolerance": LOSS_TOL,
    "modes": results})
teardown()

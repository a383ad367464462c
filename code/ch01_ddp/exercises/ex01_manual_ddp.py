# Yours to fill in (generated from ../solutions/ex01_manual_ddp.py).
"""Exercise 01.1: data parallelism without the DDP wrapper, from chapter 00's collectives.

    code/run_w_torchrun.sh 2 ch01_ddp/exercises/ex01_manual_ddp.py         # all_reduce per tensor
    code/run_w_torchrun.sh 2 ch01_ddp/exercises/ex01_manual_ddp.py --flat  # one per step

Every rank starts from different random weights (seeded by its rank). Make them equal, as DDP
does at construction: broadcast rank 0's parameters and buffers. After every backward, replace
each gradient by the average over ranks: all_reduce (a sum), then divide by N. The losses must
then match train_single.py --batch-size N*b (N processes, --batch-size b each).
Fill in the TODO(you) parts, replacing each todo(...) call with your code. Run the script at any
time: it stops at the first todo() left and says what is missing; `make exercise EX=01.1`
checks it at 2 and 3 ranks, both modes. Solution, with the answers to the questions below:
../solutions/ex01_manual_ddp.py.

Predict, then measure:
1. How many all_reduce calls per step without --flat, and with it? (21 parameter tensors.)
2. Skip the broadcast: do the losses still match one process? What do the "identical" lines say?
3. Skip the division by N, so every rank steps with the sum. With SGD that doubles the learning
   rate; with AdamW, how far from one process's losses do you expect to land, and why?
"""
import argparse
import os

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from distkit import print0, same_on_all_ranks, setup, teardown, todo, write_json
from distkit.toy import counting_data, tiny_llama

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--batch-size", type=int, default=8, help="sequences per step, per process")
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--samples", type=int, default=256, help="sequences in the data set")
parser.add_argument("--flat", action="store_true", help="all-reduce all gradients as one tensor")
parser.add_argument("--json", help="write per-step losses, all-reduce counts and the gradient "
                    "check here")
args = parser.parse_args()
world = int(os.environ.get("WORLD_SIZE", 1))
if args.batch_size < 1:
    parser.error("--batch-size must be positive")
if args.samples < world * args.batch_size:
    parser.error(f"need --samples >= {world} processes x --batch-size")


def one_process_grads(tokens):
    """The check's reference: the gradients one process computes on this step's global batch
    (every rank's sequences, gathered), from the same weights; .grad is left alone."""
    everyone = [torch.empty_like(tokens) for _ in range(env.world_size)]
    dist.all_gather(everyone, tokens)
    batch = torch.cat(everyone)
    return torch.autograd.grad(model(input_ids=batch, labels=batch).loss, params)


def gap_to(reference, grads) -> dict:
    """How far the synced gradients lie from one process's: the largest difference over the
    largest gradient, and the scale between them (1: the mean; N: the sum over the ranks)."""
    g = torch.cat([x.reshape(-1) for x in grads])
    r = torch.cat([x.reshape(-1) for x in reference])
    return {"gap": ((g - r).abs().max() / r.abs().max()).item(), "scale": (g @ r / (r @ r)).item()}


env = setup()
# Deliberately different initial weights on every rank... Rank 0's seed, 0, is train_single.py's
# default: after the broadcast every rank holds the weights the one-process reference starts from.
torch.manual_seed(env.rank)
model = tiny_llama().to(env.device)
params, buffers = list(model.parameters()), list(model.buffers())
identical = {"start": same_on_all_ranks(params)}
print0(f"initial weights identical on every rank: {identical['start']}")
# TODO(you): ...until every rank holds rank 0's parameters AND buffers, as DDP does at construction.
# Buffers are model state too, used by forward but not trained (BatchNorm's running statistics; here
# the rotary embedding's inv_freq). Look up: dist.broadcast (in place), and Tensor.detach (the same
# storage, outside autograd).
todo("broadcast rank 0's parameters and buffers to every rank")
identical["broadcast"] = same_on_all_ranks(params + buffers)
print0(f"after the broadcast, weights and buffers identical: {identical['broadcast']}")
optimizer = torch.optim.AdamW(params, lr=3e-3)
data = counting_data(args.samples)
sampler = DistributedSampler(data, shuffle=True, seed=0)
loader = DataLoader(data, batch_size=args.batch_size, sampler=sampler, drop_last=True)

losses, calls = [], 0
for epoch in range(args.epochs):
    sampler.set_epoch(epoch)
    for (tokens,) in loader:
        tokens = tokens.to(env.device)
        reference = one_process_grads(tokens) if not losses else None  # step 1, for the check
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        grads = [p.grad for p in params]
        if args.flat:  # one message: latency paid once (what DDP's buckets do)
            # TODO(you): one collective per step for all 21 gradients (count it in calls), after
            # which every gradient holds the sum over ranks. Look up: torch.cat, Tensor.split,
            # Tensor.view_as, Tensor.copy_.
            todo("--flat: one all_reduce of all gradients, flattened, then copied back")
        else:
            # TODO(you): every gradient summed over the ranks, in place; count each collective in
            # calls.
            todo("all_reduce every gradient")
        # TODO(you): the summed gradients into the gradient of the one-process loss, a mean over the
        # global batch.
        todo("divide every gradient by the world size")
        if reference is not None:  # the check: step 1's synced gradients against one process's
            grad_check = gap_to(reference, grads)
            print0(f"step 1: gradients = one process's (< 1e-4 of the largest): "
                   f"{grad_check['gap'] < 1e-4} (x{grad_check['scale']:.2f})")
        optimizer.step()
        optimizer.zero_grad()
        loss = loss.detach()
        dist.all_reduce(loss)  # for the log: the mean over all ranks' sequences
        losses.append(loss.item() / env.world_size)
    # 3 decimals: further digits differ in the last float bits between CPUs and world sizes
    print0(f"epoch {epoch}  step {len(losses):3d}  loss {losses[-1]:.3f}")
print0(f"all_reduce calls per step: {calls // len(losses)}")
identical["end"] = same_on_all_ranks(params)  # every rank took the same steps
print0(f"after training, weights identical: {identical['end']}")
write_json(args.json, {"losses": losses, "calls_per_step": calls // len(losses),
                       "identical": identical, "grad_check": grad_check})
teardown()

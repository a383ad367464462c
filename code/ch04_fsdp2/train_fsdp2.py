"""Chapter 04's "after": train_single.py sharded with FSDP2 (fully_shard). New lines say # NEW.

    code/run_w_torchrun.sh 2 ch04_fsdp2/train_fsdp2.py --batch-size 8 --json /tmp/fsdp2.json

It is chapter 01's train_ddp.py with DDP's two lines replaced. DDP keeps a whole replica of the
model, its gradients and AdamW's state on every rank; FSDP2 keeps 1/N of each: every parameter
becomes a DTensor sharded along its first dimension. Each decoder layer is one unit whose
parameters are all-gathered just before its forward and again before its backward, and freed
after each; its gradients are reduce-scattered, so each rank keeps, and updates, its shard.
With N processes and --batch-size b per process the losses and step 1's gradients match
ch01_ddp/train_single.py --batch-size N*b up to float rounding; --reference has rank 0 run that
one-process training itself, first, so one launch gives both.
"""
import argparse
import os

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from distkit import print0, seed_everything, setup, teardown, write_json
from distkit.dist import grad_norms, one_process_reference
from distkit.toy import counting_data, tiny_llama

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--batch-size", type=int, default=8, help="sequences per step, per process")
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--samples", type=int, default=256, help="sequences in the data set")
parser.add_argument("--lr", type=float, default=3e-3)
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--layers", type=int, default=2, help="decoder layers")
parser.add_argument("--json", help="write per-step losses (and step 1's gradient norms) here")
parser.add_argument("--reference", action="store_true",
                    help="rank 0 first runs train_single.py --batch-size N*b (the one-process run "
                    "to compare with); its losses and gradient norms go to the JSON")
args = parser.parse_args()
world = int(os.environ.get("WORLD_SIZE", 1))  # NEW: every rank needs at least one batch
if args.batch_size < 1 or args.samples < world * args.batch_size:
    parser.error(f"need 1 <= --batch-size and --samples >= {world} processes x --batch-size")

env = setup()  # NEW: join the process group (chapter 00)
reference = args.reference and one_process_reference(  # rank 0: train_single.py, in-process
    "ch01_ddp/train_single.py", "--batch-size", env.world_size * args.batch_size,
    "--epochs", args.epochs, "--samples", args.samples, "--lr", args.lr, "--seed", args.seed,
    "--layers", args.layers)
seed_everything(args.seed)
model = tiny_llama(layers=args.layers).to(env.device)
# NEW: one FSDP unit per decoder layer (gathered, used and freed in turn), then the root unit:
# embeddings, final norm and LM head, the parameters no layer holds. Inner units first, so their
# parameters stay out of the root's. Default mesh: all ranks in 1D. Every rank built the same
# seeded model: sharding keeps its 1/N (no broadcast as in DDP).
for layer in model.model.layers:
    fully_shard(layer)
fully_shard(model)
# NEW (invisible): built after sharding, AdamW's state is sharded like the parameters
optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
data = counting_data(args.samples)
# NEW: each rank reads a different 1/N of every epoch's shuffled order
sampler = DistributedSampler(data, shuffle=True, seed=args.seed)
loader = DataLoader(data, batch_size=args.batch_size, sampler=sampler, drop_last=True)

losses, grads = [], None
for epoch in range(args.epochs):
    sampler.set_epoch(epoch)  # NEW: reseeds the shuffle; without it every epoch repeats
    for (tokens,) in loader:
        tokens = tokens.to(env.device)
        loss = model(input_ids=tokens, labels=tokens).loss  # NEW (invisible): all-gathers
        loss.backward()  # NEW (invisible): all-gathers again, reduce-scatters the gradients
        if not losses:  # step 1's gradients, for the parity check: a constant factor on them
            grads = grad_norms(model)  # (a missing 1/N) hides in the losses under AdamW
        optimizer.step()
        optimizer.zero_grad()
        # NEW: each rank saw only its own sequences; average the loss for the log
        loss = loss.detach()
        dist.all_reduce(loss)
        losses.append(loss.item() / env.world_size)
    print0(f"epoch {epoch}  step {len(losses):3d}  loss {losses[-1]:.3f}")

# NEW: a parameter is now a DTensor; this rank stores only its rows of it
weight = model.model.embed_tokens.weight
print0(f"embed_tokens.weight: {type(weight).__name__}, global shape {tuple(weight.shape)}, "
       f"this rank stores {tuple(weight.to_local().shape)}, placements {weight.placements}")
write_json(args.json, {"losses": losses, "grad_norms": grads, "reference": reference or None})
# (no --save: saving a sharded model, each rank its shards, is chapter 05's Distributed Checkpoint)
teardown()

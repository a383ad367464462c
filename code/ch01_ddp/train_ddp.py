"""Chapter 01's "after": train_single.py made data-parallel with DDP. New lines say # NEW.

    code/run_w_torchrun.sh 2 ch01_ddp/train_ddp.py --batch-size 8 --json /tmp/ddp.json

With N processes and --batch-size b per process, every step sees the same N*b sequences as
train_single.py --batch-size N*b, so the losses and the final weights match it up to float
rounding. train_ddp_plus.py adds gradient accumulation, resume and DDP's tuning knobs.
"""
import argparse
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from distkit import print0, seed_everything, setup, teardown, write_json
from distkit.dist import grad_norms
from distkit.toy import counting_data, tiny_llama

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--batch-size", type=int, default=8, help="sequences per step, per process")
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--samples", type=int, default=256, help="sequences in the data set")
parser.add_argument("--lr", type=float, default=3e-3)
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--layers", type=int, default=2, help="decoder layers")
parser.add_argument("--json", help="write per-step losses (and step 1's gradient norms) here")
parser.add_argument("--save", help="write a checkpoint here at the end (rank 0)")
args = parser.parse_args()
world = int(os.environ.get("WORLD_SIZE", 1))  # NEW: every rank needs at least one batch
if args.batch_size < 1 or args.samples < world * args.batch_size:
    parser.error(f"need 1 <= --batch-size and --samples >= {world} processes x --batch-size")

env = setup()  # NEW: join the process group (chapter 00)
seed_everything(args.seed)
model = tiny_llama(layers=args.layers).to(env.device)
# NEW: DDP broadcasts rank 0's weights, then all-reduces (averages) gradients during backward
model = DDP(model, device_ids=[env.device.index] if env.device.type == "cuda" else None)
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
        loss = model(input_ids=tokens, labels=tokens).loss  # mean cross-entropy, next token
        loss.backward()  # NEW (invisible): DDP all-reduces the gradients in here
        if not losses:  # step 1's gradients, for the parity check: a constant factor on them
            grads = grad_norms(model)  # (a missing 1/N) hides in the losses under AdamW
        optimizer.step()
        optimizer.zero_grad()
        # NEW: each rank saw only its own sequences; average the loss for the log
        loss = loss.detach()
        dist.all_reduce(loss)
        losses.append(loss.item() / env.world_size)
    print0(f"epoch {epoch}  step {len(losses):3d}  loss {losses[-1]:.3f}")

write_json(args.json, {"losses": losses, "grad_norms": grads})
if args.save:
    # NEW: one writer. model.module is the plain model: its keys have no "module." prefix.
    if env.rank == 0:
        torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                    "epoch": args.epochs, "losses": losses}, args.save)
    dist.barrier()  # NEW: nobody reads the checkpoint before it is complete
teardown()

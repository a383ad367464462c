"""Chapter 01's "after": train_single.py made data-parallel with DDP. New lines say # NEW.

    code/run_w_torchrun.sh 2 ch01_ddp/train_ddp.py --batch-size 8 --json /tmp/ddp.json

With N processes and --batch-size b per process (and --accum K micro-batches per step), every
step sees the same N*K*b sequences as train_single.py --batch-size N*K*b, so the losses and the
final weights match it up to float rounding.
"""
import argparse
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from distkit import print0, seed_everything, setup, teardown, write_json
from distkit.ddp import CommLog
from distkit.toy import counting_data, tiny_llama

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--batch-size", type=int, default=8, help="sequences per step, per process")
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--samples", type=int, default=256, help="sequences in the data set")
parser.add_argument("--lr", type=float, default=3e-3)
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--json", help="write per-step losses (and --log-comm records) here")
parser.add_argument("--save", help="write a checkpoint here at the end (rank 0)")
# NEW: DDP options
parser.add_argument("--accum", type=int, default=1, help="micro-batches per optimizer step")
parser.add_argument("--sync-micro-batches", action="store_true",
                    help="all-reduce after every micro-batch (skip no_sync: the wasteful way)")
parser.add_argument("--bucket-cap-mb", type=float, default=25, help="DDP gradient bucket size")
parser.add_argument("--no-set-epoch", action="store_true",
                    help="forget sampler.set_epoch (the same order every epoch: a bug)")
parser.add_argument("--resume", help="load this checkpoint first, continue after its epoch")
parser.add_argument("--log-comm", action="store_true", help="record every all-reduce")
args = parser.parse_args()
if args.batch_size < 1 or args.accum < 1 or args.bucket_cap_mb <= 0:
    parser.error("need --batch-size >= 1, --accum >= 1 and --bucket-cap-mb > 0")

env = setup()  # NEW: join the process group (chapter 00)
seed_everything(args.seed)  # the same initial weights on every rank (DDP broadcasts rank 0's anyway)
model = tiny_llama().to(env.device)
# NEW: DDP broadcasts rank 0's weights, then all-reduces (averages) gradients during backward
model = DDP(model, device_ids=[env.device.index] if env.device.type == "cuda" else None,
            bucket_cap_mb=args.bucket_cap_mb)
optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
data = counting_data(args.samples)
# NEW: each rank reads a different 1/N of every epoch's shuffled order
sampler = DistributedSampler(data, shuffle=True, seed=args.seed)
loader = DataLoader(data, batch_size=args.batch_size, sampler=sampler, drop_last=True)
comm = CommLog.attach(model) if args.log_comm else None  # measurement only

first_epoch, losses = 0, []
if args.resume:  # NEW: every rank loads the same file, onto its own device
    ckpt = torch.load(args.resume, map_location=env.device, weights_only=True)
    model.module.load_state_dict(ckpt["model"])
    optimizer.load_state_dict(ckpt["optimizer"])
    first_epoch, losses = ckpt["epoch"], ckpt["losses"]

for epoch in range(first_epoch, args.epochs):
    if not args.no_set_epoch:
        sampler.set_epoch(epoch)  # NEW: reseeds the shuffle; without it every epoch repeats
    batches = iter(loader)
    for _ in range(len(loader) // args.accum):
        step_loss = torch.zeros((), device=env.device)
        for micro in range(args.accum):
            (tokens,) = next(batches)
            tokens = tokens.to(env.device)
            # NEW: skip the all-reduce on all but the last micro-batch; gradients add up locally
            last = micro == args.accum - 1
            with nullcontext() if last or args.sync_micro_batches else model.no_sync():
                loss = model(input_ids=tokens, labels=tokens).loss / args.accum
                loss.backward()
            step_loss += loss.detach()
        optimizer.step()
        optimizer.zero_grad()
        # NEW: each rank saw only its own sequences; average the loss for the log
        dist.all_reduce(step_loss)
        losses.append(step_loss.item() / env.world_size)
    print0(f"epoch {epoch}  step {len(losses):3d}  loss {losses[-1]:.4f}")

write_json(args.json, {"losses": losses, "world_size": env.world_size,
                       **({"comm": comm.summary(model)} if comm else {})})
if args.save:
    # NEW: one writer. model.module is the plain model: its keys have no "module." prefix.
    if env.rank == 0:
        torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                    "epoch": args.epochs, "losses": losses}, args.save)
    dist.barrier()  # NEW: nobody reads the checkpoint before it is complete
teardown()

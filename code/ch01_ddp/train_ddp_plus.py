"""train_ddp.py plus what real runs need: gradient accumulation with no_sync, resume from a
checkpoint, and DDP's knobs (bucket size, find_unused_parameters). New lines say # PLUS.

    code/run_w_torchrun.sh 2 ch01_ddp/train_ddp_plus.py --batch-size 2 --accum 4
    code/run_w_torchrun.sh 2 ch01_ddp/train_ddp_plus.py --save '/tmp/epoch{epoch}.pt'
    code/run_w_torchrun.sh 2 ch01_ddp/train_ddp_plus.py --resume /tmp/epoch1.pt

With N processes, --batch-size b and --accum K, every optimizer step sees N*K*b sequences, the
same ones as train_single.py --batch-size N*K*b.
"""
import argparse
import os
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from distkit import print0, seed_everything, setup, teardown, write_json
from distkit.ddp import CommLog
from distkit.dist import grad_norms
from distkit.toy import counting_data, tiny_llama

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--batch-size", type=int, default=8, help="sequences per step, per process")
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--samples", type=int, default=256, help="sequences in the data set")
parser.add_argument("--lr", type=float, default=3e-3)
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--layers", type=int, default=2, help="decoder layers")
parser.add_argument("--json", help="write per-step losses, step 1's gradient norms "
                                   "(and --log-comm records) here")
parser.add_argument("--save", help="write a checkpoint here at the end of every epoch (rank 0); "
                                   "{epoch} in the name becomes the epoch's number")  # PLUS
# PLUS: the options of this script
parser.add_argument("--accum", type=int, default=1, help="micro-batches per optimizer step")
parser.add_argument("--sync-micro-batches", action="store_true",
                    help="all-reduce after every micro-batch (skip no_sync: the wasteful way)")
parser.add_argument("--resume", help="load this checkpoint first, continue after its epoch")
parser.add_argument("--bucket-cap-mb", type=float, help="DDP gradient bucket size (default 25)")
parser.add_argument("--find-unused-parameters", action="store_true",
                    help="DDP searches the graph for unused parameters every step "
                         "(and keeps its construction-time buckets)")
parser.add_argument("--no-set-epoch", action="store_true",
                    help="forget sampler.set_epoch (the same order every epoch: a bug)")
parser.add_argument("--log-comm", action="store_true", help="record every all-reduce")
args = parser.parse_args()
world = int(os.environ.get("WORLD_SIZE", 1))  # NEW: every rank needs at least one batch
if args.batch_size < 1 or args.accum < 1 or (args.bucket_cap_mb or 1) <= 0:
    parser.error("need --batch-size >= 1, --accum >= 1 and --bucket-cap-mb > 0")
if args.samples < world * args.accum * args.batch_size:
    parser.error(f"need --samples >= {world} processes x --accum x --batch-size")
if args.resume and not os.path.isfile(args.resume):
    parser.error(f"--resume {args.resume}: no such checkpoint")

env = setup()  # NEW: join the process group (chapter 00)
seed_everything(args.seed)
model = tiny_llama(layers=args.layers).to(env.device)
# NEW: DDP broadcasts rank 0's weights, then all-reduces (averages) gradients during backward
model = DDP(model, device_ids=[env.device.index] if env.device.type == "cuda" else None,
            bucket_cap_mb=args.bucket_cap_mb,  # PLUS
            find_unused_parameters=args.find_unused_parameters)  # PLUS
optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
data = counting_data(args.samples)
# NEW: each rank reads a different 1/N of every epoch's shuffled order
sampler = DistributedSampler(data, shuffle=True, seed=args.seed)
loader = DataLoader(data, batch_size=args.batch_size, sampler=sampler, drop_last=True)
comm = CommLog.attach(model) if args.log_comm else None  # PLUS: measurement only

first_epoch, losses, grads = 0, [], None
if args.resume:  # PLUS: every rank reads the same file; load_state_dict copies it to its device
    # map_location="cpu", not the GPU: AdamW's step counters then stay on the CPU, as in a fresh
    # run (a counter loaded onto the GPU stays there, and AdamW reads it with .item(): a host
    # sync per tensor per step), and the GPU never holds a second copy of the training state.
    ckpt = torch.load(args.resume, map_location="cpu", weights_only=True)
    model.module.load_state_dict(ckpt["model"])
    optimizer.load_state_dict(ckpt["optimizer"])
    first_epoch, losses = ckpt["epoch"], ckpt["losses"]

for epoch in range(first_epoch, args.epochs):
    if not args.no_set_epoch:
        sampler.set_epoch(epoch)  # NEW: reseeds the shuffle; without it every epoch repeats
    batches = iter(loader)
    for _ in range(len(loader) // args.accum):
        step_loss = torch.zeros((), device=env.device)
        for micro in range(args.accum):  # PLUS: K micro-batches, one optimizer step
            (tokens,) = next(batches)
            tokens = tokens.to(env.device)
            # PLUS: skip the all-reduce on all but the last micro-batch; gradients add up locally
            last = micro == args.accum - 1
            with nullcontext() if last or args.sync_micro_batches else model.no_sync():
                loss = model(input_ids=tokens, labels=tokens).loss / args.accum  # keep a mean
                loss.backward()  # NEW (invisible): DDP all-reduces the gradients in here
            step_loss += loss.detach()
        if not losses:  # step 1's gradients (after all K micro-batches), for the parity check
            grads = grad_norms(model)
        optimizer.step()
        optimizer.zero_grad()
        # NEW: each rank saw only its own sequences; average the loss for the log
        dist.all_reduce(step_loss)
        losses.append(step_loss.item() / env.world_size)
    print0(f"epoch {epoch}  step {len(losses):3d}  loss {losses[-1]:.3f}")
    if args.save:  # PLUS: after every epoch, as a long run does: a stopped job loses one at most
        # NEW: one writer. model.module is the plain model: its keys have no "module." prefix.
        if env.rank == 0:
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "epoch": epoch + 1, "losses": losses}, args.save.format(epoch=epoch + 1))
        dist.barrier()  # NEW: nobody reads the checkpoint before it is complete

write_json(args.json, {"losses": losses, "grad_norms": grads, "world_size": env.world_size,
                       **({"comm": comm.summary(model)} if comm else {})})
teardown()

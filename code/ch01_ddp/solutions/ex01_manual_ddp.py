"""Exercise 01 solution: data parallelism without the DDP wrapper, from chapter 00's collectives.

    code/run_w_torchrun.sh 2 ch01_ddp/solutions/ex01_manual_ddp.py          # one all_reduce per tensor
    code/run_w_torchrun.sh 2 ch01_ddp/solutions/ex01_manual_ddp.py --flat   # one per step (a bucket)

Same weights everywhere (broadcast), then after every backward the average gradient
(all_reduce, divide by N). It matches train_single.py --batch-size N*b.
"""
import argparse

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from distkit import print0, setup, teardown, write_json
from distkit.toy import counting_data, tiny_llama

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--batch-size", type=int, default=8, help="sequences per step, per process")
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--flat", action="store_true", help="all-reduce all gradients as one tensor")
parser.add_argument("--json", help="write per-step losses and all-reduce counts here")
args = parser.parse_args()
if args.batch_size < 1:
    parser.error("--batch-size must be positive")

env = setup()
torch.manual_seed(env.rank)  # deliberately different initial weights on every rank...
model = tiny_llama().to(env.device)
params = list(model.parameters())
for p in params:  # ...until rank 0's are broadcast, as DDP does at construction
    dist.broadcast(p.data, src=0)
optimizer = torch.optim.AdamW(params, lr=3e-3)
data = counting_data(256)
sampler = DistributedSampler(data, shuffle=True, seed=0)
loader = DataLoader(data, batch_size=args.batch_size, sampler=sampler, drop_last=True)

losses, calls = [], 0
for epoch in range(args.epochs):
    sampler.set_epoch(epoch)
    for (tokens,) in loader:
        tokens = tokens.to(env.device)
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        grads = [p.grad for p in params]
        if args.flat:  # one message: latency paid once (what DDP's buckets do)
            flat = torch.cat([g.view(-1) for g in grads])
            dist.all_reduce(flat)
            for g, synced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
                g.copy_(synced)
            calls += 1
        else:
            for g in grads:
                dist.all_reduce(g)
                calls += 1
        for g in grads:
            g /= env.world_size  # sum -> mean, as the single process's loss is a mean
        optimizer.step()
        optimizer.zero_grad()
        loss = loss.detach()
        dist.all_reduce(loss)  # for the log: the mean over all ranks' sequences
        losses.append(loss.item() / env.world_size)
    print0(f"epoch {epoch}  step {len(losses):3d}  loss {losses[-1]:.4f}")
print0(f"all_reduce calls per step: {calls // len(losses)}")
write_json(args.json, {"losses": losses, "calls_per_step": calls // len(losses)})
teardown()

"""Chapter 01's "before": one process trains a tiny Llama on counting sequences.

    PYTHONPATH=code python code/ch01_ddp/train_single.py --batch-size 16 --json /tmp/single.json

A real causal LM (transformers' LlamaForCausalLM, built from a config) with its real loss,
the cross-entropy of every next token. train_ddp.py is this script plus the lines DDP needs.
It runs on the device the DDP scripts pick (CUDA when visible; COURSE_DEVICE=cpu forces the
CPU), so a parity check compares DDP with one process, not one device's rounding with another's.
"""
import argparse

import torch
from torch.utils.data import DataLoader, RandomSampler

from distkit import pick_device, seed_everything, write_json
from distkit.dist import grad_norms
from distkit.toy import counting_data, tiny_llama

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--batch-size", type=int, default=16, help="sequences per step")
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--samples", type=int, default=256, help="sequences in the data set")
parser.add_argument("--lr", type=float, default=3e-3)
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--layers", type=int, default=2, help="decoder layers")
parser.add_argument("--json", help="write per-step losses (and step 1's gradient norms) here")
parser.add_argument("--save", help="write a checkpoint here at the end")
args = parser.parse_args()
if args.batch_size < 1 or args.samples < args.batch_size:
    parser.error("need 1 <= --batch-size <= --samples")

device = pick_device()[0]  # the DDP scripts' device: cuda:0 on a GPU machine, else the CPU
seed_everything(args.seed)
model = tiny_llama(layers=args.layers).to(device)
optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
data = counting_data(args.samples)
shuffle = torch.Generator()
sampler = RandomSampler(data, generator=shuffle)
loader = DataLoader(data, batch_size=args.batch_size, sampler=sampler, drop_last=True)

losses, grads = [], None
for epoch in range(args.epochs):
    shuffle.manual_seed(args.seed + epoch)  # a different order every epoch, the same every run
    for (tokens,) in loader:
        tokens = tokens.to(device)
        loss = model(input_ids=tokens, labels=tokens).loss  # mean cross-entropy, next token
        loss.backward()
        if not losses:  # step 1's gradients, for the parity check: a constant factor on them
            grads = grad_norms(model)  # (a missing 1/N) hides in the losses under AdamW
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    # 3 decimals: further digits differ in the last float bits between CPUs and world sizes
    print(f"epoch {epoch}  step {len(losses):3d}  loss {losses[-1]:.3f}")

write_json(args.json, {"losses": losses, "grad_norms": grads})
if args.save:
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "epoch": args.epochs, "losses": losses}, args.save)

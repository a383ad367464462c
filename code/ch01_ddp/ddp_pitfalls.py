"""Four DDP mistakes, each run for real next to its fix.

    code/run_w_torchrun.sh 2 ch01_ddp/ddp_pitfalls.py --case print
    code/run_w_torchrun.sh 2 ch01_ddp/ddp_pitfalls.py --case print,unused,clip,tokens

print:  every rank's loss.item() is the loss of its own slice: N different numbers, none of
        them the training loss (the mean over the ranks). print() on every rank shows them in a
        random order (chapter 00); here they are gathered in rank order, next to the mean.
unused: a parameter that forward never uses. DDP waits for its gradient forever and fails at the
        next forward ("Expected to have finished reduction ..."); find_unused_parameters=True
        or static_graph=True fix it.
clip:   gradient clipping must see the synchronised gradient. Inside no_sync (accumulation) a
        rank's gradient is local: its norm differs from the global one.
tokens: a mean over each rank's tokens, averaged by DDP, weighs a token on a rank with few tokens
        more than one on a rank with many. Divide the sum by the global token count instead.
"""
import argparse

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from distkit import print0, print_ranks, seed_everything, setup, teardown

CASES = ("print", "unused", "clip", "tokens")
parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--case", default="unused,clip,tokens",
                    help=f"comma-separated, from: {', '.join(CASES)}")
args = parser.parse_args()
cases = args.case.split(",")
if not set(cases) <= set(CASES):
    parser.error(f"unknown --case {', '.join(sorted(set(cases) - set(CASES)))}; "
                 f"choose from {', '.join(CASES)}")

env = setup()
rank, n = env.rank, env.world_size


def batch(seed, size=8):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(size, 4, generator=g), torch.randint(0, 3, (size,), generator=g)


def ddp(module, **kwargs):
    seed_everything(0)  # the same initial weights in every case
    return DDP(module.to(env.device), **kwargs)


if "print" in cases:
    print0("== printing the loss from every rank ==")
    seed_everything(0)  # rank 0's initial weights (DDP broadcasts them): the same every run
    model = ddp(nn.Linear(4, 3))
    x, y = batch(rank)
    loss = F.cross_entropy(model(x.to(env.device)), y.to(env.device))
    # the mistake is print(loss.item()) on every rank: its own slice's loss, in a random order
    print_ranks(f"loss.item() {loss.item():.2f}")
    mean = loss.detach()
    dist.all_reduce(mean)
    print0(f"the training loss, all-reduced / N: {mean.item() / n:.2f}")


class TwoHeads(nn.Module):
    """Only head "a" is used in forward: head "b" never gets a gradient."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 3), nn.Linear(4, 3)

    def forward(self, x):
        return self.a(x)


if "unused" in cases:
    print0("== unused parameters ==")
    for kwargs in ({}, {"find_unused_parameters": True}, {"static_graph": True}):
        model = ddp(TwoHeads(), **kwargs)
        try:
            for step in range(3):
                x, y = batch(10 * rank + step)
                F.cross_entropy(model(x.to(env.device)), y.to(env.device)).backward()
            print0(f"DDP({', '.join(f'{k}={v}' for k, v in kwargs.items())}): 3 steps, fine")
        except RuntimeError as e:
            print0(f"DDP(): step {step + 1} failed: RuntimeError: {str(e).split('. ')[0]}.")

if "clip" in cases:
    print0("== gradient clipping ==")
    model = ddp(nn.Linear(4, 3))
    x, y = batch(100 + rank)
    with model.no_sync():  # an accumulation micro-batch: no all-reduce
        F.cross_entropy(model(x.to(env.device)), y.to(env.device)).backward()
    local = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).item()
    model.zero_grad()
    F.cross_entropy(model(x.to(env.device)), y.to(env.device)).backward()  # synchronised
    synced = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).item()
    print_ranks(f"gradient norm inside no_sync (local) {local:.3f}; "
                f"after the all-reduce {synced:.3f}")

class Shift(nn.Module):
    """logits + w: the smallest model with a gradient to compare."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(3))

    def forward(self, logits):
        return logits + self.w


if "tokens" in cases:
    print0("== loss normalisation by token count ==")
    # rank r has 2 sequences of 6 tokens; rank r's sequences are padded after 6 - 2r tokens
    # (label -100 = ignored by cross_entropy), so ranks hold different numbers of real tokens.
    lengths = [max(1, 6 - 2 * r) for r in range(n)]
    logits_all = [torch.randn(2, 6, 3, generator=torch.Generator().manual_seed(r))
                  for r in range(n)]
    labels_all = [torch.randint(0, 3, (2, 6), generator=torch.Generator().manual_seed(50 + r))
                  for r in range(n)]
    for labels, length in zip(labels_all, lengths):
        labels[:, length:] = -100
    # the reference: one process, the mean over every real token of every rank
    reference = Shift()
    F.cross_entropy(reference(torch.cat(logits_all)).view(-1, 3),
                    torch.cat(labels_all).view(-1)).backward()
    logits, labels = logits_all[rank].to(env.device), labels_all[rank].to(env.device)
    grads = {}
    for fix in (False, True):
        model = ddp(Shift())
        out = model(logits).view(-1, 3)
        if fix:  # sum over my tokens / tokens on all ranks; x N because DDP averages over ranks
            tokens = (labels != -100).sum().float()
            dist.all_reduce(tokens)
            loss = F.cross_entropy(out, labels.view(-1), reduction="sum") / tokens * n
        else:  # mean over my tokens, then DDP's average over ranks
            loss = F.cross_entropy(out, labels.view(-1))
        loss.backward()
        grads[fix] = (model.module.w.grad.cpu() - reference.w.grad).abs().max().item()
    print0(f"real tokens per rank: {[2 * length for length in lengths]}")
    print0(f"gradient vs one process: per-rank mean then DDP average: max |diff| = "
           f"{grads[False]:.3f}; sum / global token count: < 1e-6: {grads[True] < 1e-6}")
teardown()

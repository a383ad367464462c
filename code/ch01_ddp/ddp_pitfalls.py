"""DDP's classic mistakes, each run for real next to its fix, in one launch.

    code/run_w_torchrun.sh 2 ch01_ddp/ddp_pitfalls.py --case print
    code/run_w_torchrun.sh 2 ch01_ddp/ddp_pitfalls.py          # every case but no-join
    COURSE_TIMEOUT_S=3 code/run_w_torchrun.sh 2 ch01_ddp/ddp_pitfalls.py --case no-join  # fails

print:      every rank's loss.item() is the loss of its own slice: N different numbers, none of
            them the training loss (the mean over the ranks). print() on every rank shows them in
            a random order (chapter 00); here they are gathered in rank order, next to the mean.
unused:     a parameter that forward never uses. DDP waits for its gradient forever and fails at
            the next forward ("Expected to have finished reduction ..."); find_unused_parameters
            =True or static_graph=True fix it.
checkpoint: activation checkpointing of a layer used twice. Reentrant checkpointing under plain
            DDP gives a wrong gradient *silently*; with find_unused_parameters it fails ("Expected
            to mark a variable ready only once"); static_graph=True or use_reentrant=False fix it.
clip:       gradient clipping must see the synchronised gradient. Inside no_sync (accumulation) a
            rank's gradient is local: its norm differs from the global one.
tokens:     a mean over each rank's tokens, averaged by DDP, weighs a token on a rank with few
            tokens more than one on a rank with many. Divide the sum by the global token count.
batchnorm:  each rank normalises with its own batch's statistics; SyncBatchNorm combines every
            rank's [mean, var, count] (done by hand here: on CPU it refuses to run), and DDP
            overwrites every rank's running statistics with rank 0's before each training forward.
join:       uneven inputs (rank r has 3 + 2r batches) under DDP's Join: the ranks that ran out
            shadow the others' all-reduces with zeros; the sum is divided by the initial N
            (divide_by_initial_world_size=True) or by the ranks still training (False).
no-join:    the same without Join: rank N-1's extra backward waits for partners that never come,
            until the process group's timeout (COURSE_TIMEOUT_S). Run it alone: it fails.
"""
import argparse
import copy
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint

from distkit import print0, print_ranks, seed_everything, setup, teardown

CASES = ("print", "unused", "checkpoint", "clip", "tokens", "batchnorm", "join", "no-join")
parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--case", default=",".join(CASES[:-1]),
                    help=f"comma-separated, from: {', '.join(CASES)} (default: all but no-join)")
args = parser.parse_args()
cases = args.case.split(",")
if not set(cases) <= set(CASES):
    parser.error(f"unknown --case {', '.join(sorted(set(cases) - set(CASES)))}; "
                 f"choose from {', '.join(CASES)}")
if "no-join" in cases and len(cases) > 1:
    parser.error("--case no-join fails on purpose: run it alone")

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

class Twice(nn.Module):
    """One layer applied twice (weight sharing, or a block checkpointed twice), each application
    under activation checkpointing: the layer's gradient arrives in two parts."""

    def __init__(self, reentrant: bool):
        super().__init__()
        self.layer, self.head, self.reentrant = nn.Linear(4, 4), nn.Linear(4, 3), reentrant

    def forward(self, x):
        for _ in range(2):
            x = checkpoint(lambda t: torch.tanh(self.layer(t)), x, use_reentrant=self.reentrant)
        return self.head(x)


if "checkpoint" in cases:
    print0("== activation checkpointing ==")
    for reentrant, kwargs in ((True, {}), (True, {"find_unused_parameters": True}),
                              (True, {"static_graph": True}), (False, {})):
        model = ddp(Twice(reentrant), **kwargs)
        shown = ", ".join([f"use_reentrant={reentrant}"] + [f"{k}=True" for k in kwargs])
        try:
            for step in range(3):
                x, y = batch(10 * rank + step)
                model.zero_grad()
                logits = model(x.to(env.device).requires_grad_())
                F.cross_entropy(logits, y.to(env.device)).backward()
            # the reference: this rank's own gradient of the same weights, averaged by hand
            local = copy.deepcopy(model.module)
            local.zero_grad()
            F.cross_entropy(local(x.to(env.device).requires_grad_()), y.to(env.device)).backward()
            want = local.layer.weight.grad
            dist.all_reduce(want)
            gap = (model.module.layer.weight.grad - want / n).abs().max().item()
            verdict = "True" if gap < 1e-6 else \
                f"False, off by more than 1e-2: {gap > 1e-2} (no error raised)"
            print0(f"DDP({shown}): 3 steps; gradient = the average of the ranks' own: {verdict}")
        except RuntimeError as e:
            print0(f"DDP({shown}): step {step + 1} failed: RuntimeError: {str(e).split('. ')[0]}.")

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


def batchnorm_model():
    seed_everything(0)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 1))


if "batchnorm" in cases:
    print0("== BatchNorm ==")
    # Non-iid shards, as often in practice: rank r holds 8 + 2r samples shifted by about r.
    g = torch.Generator().manual_seed(0)
    shards = [torch.randn(8 + 2 * r, 4, generator=g) + r for r in range(n)]
    x = shards[rank].to(env.device)
    # 1. The statistics we want: one process, the whole global batch.
    h_all = batchnorm_model()[0](torch.cat(shards)).detach()
    ref_mean, ref_var = h_all.mean(0), h_all.var(0, unbiased=False)
    model = DDP(batchnorm_model().to(env.device))
    h = model.module[0](x).detach()  # what BatchNorm sees on this rank
    local_gap = (h.mean(0).cpu() - ref_mean).abs().max().item()
    # 2. What nn.SyncBatchNorm computes, by hand: gather [mean, var, count] from every rank
    #    (counts differ between ranks, so an all_reduce of means would be wrong).
    mine = torch.cat([h.mean(0), h.var(0, unbiased=False),
                      torch.tensor([float(len(h))], device=env.device)])
    gathered = [torch.empty_like(mine) for _ in range(n)]
    dist.all_gather(gathered, mine)
    stats = torch.stack(gathered).cpu()
    mean_r, var_r, count_r = stats[:, :8], stats[:, 8:16], stats[:, 16:]
    global_mean = (count_r * mean_r).sum(0) / count_r.sum()
    # total variance = mean of the variances + variance of the means (both weighted by count)
    global_var = (count_r * (var_r + (mean_r - global_mean) ** 2)).sum(0) / count_r.sum()
    synced_gap = max((global_mean - ref_mean).abs().max().item(),
                     (global_var - ref_var).abs().max().item())
    print_ranks(f"{len(h)} samples: batch mean BatchNorm used vs global batch: max |diff| = "
                f"{local_gap:.2f}; gathered [mean, var, count] vs global: < 1e-5: "
                f"{synced_gap < 1e-5}")
    try:  # the real layer
        nn.SyncBatchNorm(8).to(env.device)(h)
        print0("nn.SyncBatchNorm ran on", env.device)
    except ValueError as e:
        print0(f"nn.SyncBatchNorm on {env.device.type}: ValueError: {e}")

    # 3. DDP's buffer sync: at the start of forward 2, is this rank's running_mean rank 0's?
    def running_mean_at_forward_2(sync: bool) -> bool:
        ddp_bn = DDP(batchnorm_model().to(env.device), forward_sync_buffers=sync)
        ddp_bn(x)  # forward 1: each rank updates running_mean from its own batch
        rank0_after_1 = ddp_bn.module[1].running_mean.clone()
        dist.broadcast(rank0_after_1, src=0)  # rank 0's values, on every rank
        seen = []
        hook = ddp_bn.module[1].register_forward_pre_hook(
            lambda mod, inp: seen.append(mod.running_mean.clone()))
        ddp_bn(x)  # forward 2: DDP syncs buffers first (if asked), then BatchNorm runs
        hook.remove()
        return torch.equal(seen[0], rank0_after_1)

    synced = {sync: running_mean_at_forward_2(sync) for sync in (True, False)}
    print_ranks(f"at forward 2 running_mean == rank 0's: {synced[True]} with "
                f"forward_sync_buffers=True (default), {synced[False]} with False")


def train_uneven(join: bool, divide_by_initial_world_size: bool = True) -> list[float]:
    """Rank r trains 3 + 2r steps; returns, for each step, |synced grad| / |own grad|."""
    model = ddp(nn.Linear(4, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(rank)
    ratios = []
    with Join([model], divide_by_initial_world_size=divide_by_initial_world_size) if join \
            else nullcontext():
        for _ in range(3 + 2 * rank):  # uneven on purpose
            x = torch.randn(8, 4, generator=g).to(env.device)
            y = torch.randint(0, 3, (8,), generator=g).to(env.device)
            local = copy.deepcopy(model.module)  # this rank's gradient alone, for comparison
            F.cross_entropy(local(x), y).backward()
            F.cross_entropy(model(x), y).backward()  # all-reduce: needs a partner on every rank
            ratios.append((model.module.weight.grad.norm() / local.weight.grad.norm()).item())
            optimizer.step()
            optimizer.zero_grad()
    return ratios


if "join" in cases:
    print0("== uneven inputs, with Join ==")
    for flag in (True, False):
        alone = train_uneven(True, flag)[3:]  # rank N-1's steps after the others ran out
        print_ranks(f"divide_by_initial_world_size={flag}: steps alone: {len(alone)}, "
                    f"|synced grad| / |own grad| = {', '.join(f'{v:.2f}' for v in alone) or '-'}")

if "no-join" in cases:
    print0("== uneven inputs, without Join ==")
    steps = len(train_uneven(False))
    # print_ranks is itself a collective (gather_object): rank 0, done, waits in it
    print_ranks(f"ran {steps} steps")
teardown()

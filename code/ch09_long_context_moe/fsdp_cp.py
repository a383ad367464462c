"""FSDP2 x context parallelism on a 2-D mesh: a transformers Llama trained as one process would.

    code/run_w_torchrun.sh 4 ch09_long_context_moe/fsdp_cp.py --json /tmp/fsdp_cp.json

The mesh is (dp, cp): the global batch is split over dp, each sequence over cp. torchtitan's
recipe: FSDP2 shards the parameters over the flattened (dp, cp) mesh, so the cp ranks share the
weights' memory and their gradient reduction too (they hold the same weights and see different
tokens, as data-parallel ranks do); attention, the one layer where tokens meet, runs over the cp
group by hand (distkit.cp): a ring in torch's head-tail order, or Ulysses' all-to-alls over
contiguous chunks. transformers lets a model use any attention function registered under a name
(AttentionInterface), so the Llama itself is unchanged. The labels are shifted before the
sequence is cut (each rank's last token needs the next rank's first as its label), and every
rank passes the global positions of its tokens, so the rotary embedding is right.

The labels are masked as in chat fine-tuning: sequence j's first P + 2j labels (its prompt) are
-100, so the ranks hold unequal numbers of valid tokens. The loss one process computes is the
mean over every valid token of the batch; the ranks get it by summing their tokens' losses and
dividing by the valid-token count all-reduced over every dp x cp rank, with FSDP's gradient
division set to 1 (it would average over the ranks): "global" (torchtitan's, since
pytorch/torchtitan#2206; #3111 for CP). "mean" is the version that is right only when every rank
holds the same number of valid tokens: each rank's mean, averaged by FSDP; kept to show it fail.
A few AdamW steps per method and loss; the losses and the first step's gradients (every
parameter, gathered) must be those of one process training on the whole batch (AdamW's update
hides a constant factor on the gradients; the gradients do not). Logged: every collective of one
step with the ranks of its group, and the activation bytes each rank saves for the backward.
"""
import argparse
import functools
import os
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from distkit import print0, seed_everything, setup, teardown, write_json
from distkit.comm import CollectiveLog
from distkit.cp import LAYOUTS, ring_attention, token_order, ulysses_attention
from distkit.toy import counting_data, tiny_llama

METHODS = {"ring": "head-tail", "ulysses": "contiguous"}  # each method's token layout
LOSSES = ("global", "mean")  # the right normalisation, and the mean of the ranks' means
# Float32. Against one process the order of additions changes (blocks merged by the online
# softmax, the loss summed over ranks, gradients reduce-scattered over 4 ranks). Measured, 3
# steps, native and scalar kernels: losses <= 1.5e-6, gradients <= 2.7e-8 (first step). Bounds
# 7x and 40x above; a missing block, a wrong position or the mean of means with masked labels
# is off by 1e-3 or more.
LOSS_TOL, GRAD_TOL = 1e-5, 1e-6
IGNORE = -100  # cross_entropy's ignore_index: a label that is not trained on
LR = 1e-3

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--cp", type=int, default=2, help="context-parallel ranks (dp = N / cp)")
parser.add_argument("--methods", default="ring,ulysses", help="comma list of ring, ulysses")
parser.add_argument("--batch-size", type=int, default=4,
                    help="global batch (sequences per step), split over the dp ranks")
parser.add_argument("--seq", type=int, default=32, help="tokens per sequence")
parser.add_argument("--steps", type=int, default=3, help="AdamW steps")
parser.add_argument("--prompt", type=int, default=10,
                    help="labels masked (-100) at the start of sequence 0 (sequence j: P + 2j); "
                    "0: none")
parser.add_argument("--losses", default="global,mean",
                    help="comma list of global (sum / global valid tokens), mean (mean of the "
                    "ranks' means: the wrong answer under masking)")
parser.add_argument("--json", help="write losses, errors, collectives and bytes here")
args = parser.parse_args()
world = int(os.environ.get("WORLD_SIZE", 1))
methods = args.methods.split(",")
losses_run = args.losses.split(",")
if unknown := sorted(set(methods) - set(METHODS)):
    parser.error(f"--methods: unknown {', '.join(unknown)}; choose from ring, ulysses")
if unknown := sorted(set(losses_run) - set(LOSSES)):
    parser.error(f"--losses: unknown {', '.join(unknown)}; choose from global, mean")
if args.cp < 1 or world % args.cp:
    parser.error(f"--cp {args.cp} must divide the {world} processes")
dp = world // args.cp
if args.batch_size < dp or args.batch_size % dp:
    parser.error(f"--batch-size {args.batch_size} must be a multiple of dp = {dp}")
if args.seq % (2 * args.cp) or args.steps < 1:
    parser.error(f"--seq must be a multiple of 2 x cp = {2 * args.cp}, --steps >= 1")
if not 0 <= args.prompt + 2 * (args.batch_size - 1) < args.seq:
    parser.error(f"--prompt {args.prompt}: each sequence needs a valid label (P + 2 x "
                 f"{args.batch_size - 1} < --seq {args.seq}) and P >= 0")

with warnings.catch_warnings():  # transformers imports tqdm, which may warn about ipywidgets
    warnings.simplefilter("ignore")
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface


def cp_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                 *, method, group, layout, **kwargs):
    """transformers' attention signature: q (B, H, S/cp, D), k and v (B, H_kv, S/cp, D) of this
    rank's tokens -> (B, S/cp, H, D). Causal by construction (no padding here), so the mask
    transformers would build for the local tokens is not used."""
    if method == "ring":
        out = ring_attention(query, key, value, group, layout, causal=True)
    else:
        out = ulysses_attention(query, key, value, group, causal=True)
    return out.transpose(1, 2).contiguous(), None


env = setup()
N, cp, S, G = env.world_size, args.cp, args.seq, args.batch_size
mesh = init_device_mesh(env.device.type, (dp, cp), mesh_dim_names=("dp", "cp"))
fsdp_mesh = mesh["dp", "cp"]._flatten("dp_cp")  # FSDP over every rank: torchtitan's dp_shard_cp
d, c = mesh.get_local_rank("dp"), mesh.get_local_rank("cp")
print0(f"{N} ranks = dp {dp} x cp {cp}; global batch {G} sequences of {S} tokens: each rank "
       f"{G // dp} sequences x {S // cp} tokens")

(tokens,) = counting_data(args.steps * G, seq_len=S + 1)[:]
batches = tokens.view(args.steps, G, S + 1).to(env.device)
inputs, labels = batches[..., :-1], batches[..., 1:].clone()  # shift, then cut the sequence
# a chat prompt per sequence: sequence j's first P + 2j labels are not trained on (none if P = 0)
prompts = (args.prompt + 2 * torch.arange(G, device=env.device)) * (args.prompt > 0)
labels[:, torch.arange(S, device=env.device) < prompts[:, None]] = IGNORE  # every step

# The reference: one process, the whole global batch, SDPA.
seed_everything(0)
reference = tiny_llama(seq_len=S).to(env.device)
optimizer = torch.optim.AdamW(reference.parameters(), lr=LR)
single_losses = []
for step in range(args.steps):
    logits = reference(input_ids=inputs[step]).logits
    loss = F.cross_entropy(logits.flatten(0, 1), labels[step].flatten(), ignore_index=IGNORE)
    loss.backward()  # the mean over the batch's valid tokens
    if step == 0:
        single_grads = {n: p.grad.clone() for n, p in reference.named_parameters()}
    optimizer.step()
    optimizer.zero_grad()
    single_losses.append(loss.item())


def saved_activation_bytes(fn) -> int:
    """Bytes of the tensors autograd saves for the backward while `fn` runs, parameters and
    views of them (a linear layer saves its weight transposed) left out; a storage counted
    once."""
    storages = {}

    def pack(t):
        base = t if t._base is None else t._base
        if not (base.is_leaf and base.requires_grad):  # not a parameter: an activation
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(storages.values())


rows = slice(d * G // dp, (d + 1) * G // dp)  # this rank's sequences (its dp rank's)
results = {}
for method in methods:
    layout = LAYOUTS[METHODS[method]](cp)
    order = token_order(layout, S).view(cp, -1)[c]  # this rank's token positions
    name = f"cp_{method}"
    AttentionInterface.register(name, functools.partial(
        cp_attention, method=method, group=mesh.get_group("cp"), layout=layout))
    AttentionMaskInterface.register(name, lambda *a, **k: None)  # causal inside cp_attention
    results[method] = {"layout": METHODS[method], "normalisations": {}}
    for normalisation in losses_run:
        seed_everything(0)
        model = tiny_llama(seq_len=S).to(env.device)
        model.set_attn_implementation(name)
        for module in (*model.model.layers, model):
            fully_shard(module, mesh=fsdp_mesh)
            if normalisation == "global":  # NEW: the loss is already divided by the global
                module.set_gradient_divide_factor(1.0)  # count: FSDP must sum, not average
                module.set_force_sum_reduction_for_comms(True)  # SUM op (gloo: no PREMUL_SUM)
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
        losses, errors = [], {}
        for step in range(args.steps):
            x, y = inputs[step, rows][:, order], labels[step, rows][:, order]
            positions = order.expand(x.shape[0], -1).to(env.device)
            with CollectiveLog() as log:
                logits, saved = saved_activation_bytes(
                    lambda: model(input_ids=x, position_ids=positions).logits)
                if normalisation == "global":
                    # NEW: sum over this rank's valid tokens / the valid tokens of every rank
                    local = (y != IGNORE).sum()
                    count = local.clone()
                    dist.all_reduce(count)  # over all dp x cp ranks (the world here)
                    loss = F.cross_entropy(logits.flatten(0, 1), y.flatten(),
                                           ignore_index=IGNORE, reduction="sum") / count
                else:  # this rank's mean; FSDP averages the ranks' gradients
                    loss = F.cross_entropy(logits.flatten(0, 1), y.flatten(),
                                           ignore_index=IGNORE)
                loss.backward()
            if step == 0:
                collectives = [(cl.op, cl.nbytes, list(cl.ranks), cl.backward)
                               for cl in log.collectives]
                for n, p in model.named_parameters():
                    grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
                    errors[n] = (grad - single_grads[n]).abs().max().item()
                activation_bytes = saved
            optimizer.step()
            optimizer.zero_grad()
            total = loss.detach().clone()
            dist.all_reduce(total)  # global: the sum is the loss; mean: N x the mean of means
            losses.append(total.item() / (1 if normalisation == "global" else N))
        diff = max(abs(a - b) for a, b in zip(losses, single_losses))
        results[method]["normalisations"][normalisation] = {
            "losses": losses, "max_loss_diff": diff, "max_grad_diff": max(errors.values()),
            "parity": diff < LOSS_TOL and max(errors.values()) < GRAD_TOL}
        if normalisation == losses_run[0]:
            results[method].update(collectives=collectives, activation_bytes=activation_bytes)
    # valid labels of step 1 on each rank (rank = d x cp + c), from the data: unequal
    results[method]["valid_tokens"] = [
        int((labels[0, i * G // dp:(i + 1) * G // dp][:, token_order(layout, S).view(cp, -1)[j]]
             != IGNORE).sum()) for i in range(dp) for j in range(cp)]

# One process's activations for this rank's sequences: all S tokens, and only its S/cp tokens
x, positions = inputs[0, rows].clone(), torch.arange(S, device=env.device).expand(G // dp, -1)
_, whole = saved_activation_bytes(lambda: reference(input_ids=x, position_ids=positions).logits)
local = order.expand(G // dp, -1).to(env.device)
_, part = saved_activation_bytes(
    lambda: reference(input_ids=x[:, order], position_ids=local).logits)
NAMES = {"global": "sum / global valid tokens", "mean": "mean of the ranks' means"}
print0(f"labels masked: the first {', '.join(str(int(n)) for n in prompts)} of the {G} "
       f"sequences; valid labels per rank, step 1: " + ", ".join(
           f"{m} {res['valid_tokens']}" for m, res in results.items()))
print0(f"{'method':8s} {'layout':11s} {'loss':26s} max |loss - one process's| < "
       f"{LOSS_TOL:.0e}, |gradient - one process's| < {GRAD_TOL:.0e}")
for method, res in results.items():
    for normalisation, r in res["normalisations"].items():
        print0(f"{method:8s} {res['layout']:11s} {NAMES[normalisation]:26s} "
               f"{r['max_loss_diff'] < LOSS_TOL}, {r['max_grad_diff'] < GRAD_TOL}")
print0("collectives of one step, by the ranks of their group (rank 0's view):")
for method, res in results.items():
    groups = {}
    for op, _, ranks, _ in res["collectives"]:
        key = (op, len(ranks))
        groups[key] = groups.get(key, 0) + 1
    print0(f"  {method:8s} " + ", ".join(f"{n} x {op} over {size} ranks"
                                         for (op, size), n in sorted(groups.items())))
print0(f"activations saved for the backward, rank 0 ({G // dp} sequences): one process, "
       f"{S} tokens {whole:,} B, {S // cp} tokens {part:,} B; context parallel, {S // cp} "
       "tokens: " + ", ".join(f"{m} {res['activation_bytes']:,} B" for m, res in results.items()))
# the global normalisation must match; the mean of means too when every rank has the same
# number of valid labels (--prompt 0), and it must fail when they differ (the wrong answer)
unequal = any(len(set(res["valid_tokens"])) > 1 for res in results.values())
ok = all(r["parity"] == (n == "global" or not unequal) for res in results.values()
         for n, r in res["normalisations"].items()) and all(
    res["activation_bytes"] >= part for res in results.values())
print0(f"every check passed: {ok}")  # make gpu-smoke looks for this line
write_json(args.json, {"ok": ok, "world_size": N, "dp": dp, "cp": cp, "seq": S, "batch_size": G,
                       "prompts": prompts.tolist(), "unequal_valid_tokens": unequal,
                       "single_losses": single_losses, "activation_bytes_whole": whole,
                       "activation_bytes_local": part,
                       "results": results})
teardown(ok)  # a failed check fails the launch

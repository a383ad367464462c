# Yours to fill in (generated from ../solutions/ex02_megatron_mlp.py).
"""Exercise 02.2: Megatron's tensor-parallel MLP written by hand, from two autograd
Functions and two sliced linears, without DTensor.

    code/run_w_torchrun.sh 2 ch02_model_parallel/exercises/ex02_megatron_mlp.py

Megatron-LM (Shoeybi et al. 2019, section 3) splits an MLP over N ranks with two operators:
f (identity forward, all_reduce backward) where the replicated input enters the column-parallel
gate_proj and up_proj (each rank keeps k = intermediate/N of their output features), and g
(all_reduce forward, identity backward) after the row-parallel down_proj (the matching k input
features), whose N partial sums add up to the full output: one all_reduce each way.
The loss is the real one: the whole tiny Llama with layer 0's MLP replaced, next-token
cross-entropy. So the MLP's output gradient is a real one, and everything below the MLP
(attention, embedding) learns only through f's all_reduce. Compared: loss, the MLP's output,
input gradient and weight-gradient slices, against the unsharded model and against DTensor's
ColwiseParallel/RowwiseParallel on the same MLP.
Fill in the TODO(you) parts, replacing each todo(...) call with your code. Run the script at any
time: it stops at the first todo() left and says what is missing.
`make exercise EX=02.2` checks it at 2 and 4 ranks. Solution, with the answers to the questions
below: ../solutions/ex02_megatron_mlp.py.

Predict, then measure:
1. How many all_reduce calls in forward, and in backward? How many bytes each, for the default
   --batch-size 8 --seq 32 --hidden 64?
2. Give gate_proj and up_proj an f each (x1 = f.apply(x), x2 = f.apply(x)). Does anything stop
   matching? What changes in the counts? Which plan of ../tensor_parallel.py does the same, and
   what does it cost there per decoder layer?
3. Drop f (use x as it is). Forward is unchanged, so the loss still matches. Which gradients
   still match: this MLP's weight slices? Its input gradient? The embedding's (not compared
   here: reason it out)? Why?
4. Why does g's backward need no communication, and what would go wrong if it all-reduced too?
"""
import argparse
import copy
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from distkit import print0, seed_everything, setup, teardown, todo, write_json
from distkit.toy import counting_data, tiny_llama

# Float32; sharding only reorders additions. Measured (seeds 0-2, N=2 and 4, native and scalar
# kernels): loss 0 (1 ulp would be 4.8e-7), MLP output <= 6.5e-9, its input gradient <= 3e-11,
# its weight gradients <= 1.4e-9. The bounds sit 15-70x above (the loss's: 20 ulps).
TOLERANCES = {"loss": 1e-5, "output": 1e-7, "input_grad": 1e-7, "weight_grads": 1e-7}

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--hidden", type=int, default=64, help="the MLP: hidden -> 2*hidden -> hidden")
parser.add_argument("--seq", type=int, default=32, help="tokens per sequence")
parser.add_argument("--batch-size", type=int, default=8)
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--json", help="write all_reduce counts and parity errors here")
args = parser.parse_args()
world = int(os.environ.get("WORLD_SIZE", 1))
if args.hidden < 4 or args.hidden % 4 or 2 * args.hidden % world:
    parser.error(f"--hidden must be a multiple of 4 (the heads), and 2 x --hidden (the MLP's "
                 f"width) a multiple of {world} processes")
if min(args.seq, args.batch_size) < 1:
    parser.error("--seq and --batch-size must be >= 1")

calls = []  # bytes of every all_reduce made by f and g, in call order


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """dist.all_reduce (the sum over ranks, in place), counted."""
    calls.append(x.nbytes)
    dist.all_reduce(x)
    return x


class f(torch.autograd.Function):
    """Forward: identity (every rank already holds the whole input). Backward: each rank's input
    gradient covers only its k features' paths; the full gradient is their sum over ranks."""

    @staticmethod
    def forward(ctx, x):
        # TODO(you): what does every rank already hold of the input?
        todo("f.forward: the identity")

    @staticmethod
    def backward(ctx, grad):
        # TODO(you): each rank's input gradient covers only its k features' paths: the full gradient
        # is their sum over the ranks (the all_reduce() above, counted). A Function may not change a
        # tensor autograd may share with other users.
        todo("f.backward: all_reduce the input gradient")


class g(torch.autograd.Function):
    """Forward: sum the ranks' partial outputs. Backward: identity (the output, hence its
    gradient, is the same on every rank: each rank already has what it needs)."""

    @staticmethod
    def forward(ctx, x):
        # TODO(you): the full output is the sum over the ranks of their partial outputs (the
        # all_reduce() above); a Function must not change its input in place.
        todo("g.forward: all_reduce the partial outputs")

    @staticmethod
    def backward(ctx, grad):
        # TODO(you): the output, hence its gradient, is the same on every rank.
        todo("g.backward: the identity")


class ColumnParallelLinear(nn.Module):
    """y = x W_r^T: rank r keeps rows [r*k, (r+1)*k) of the weight (nn.Linear's weight is
    [out, in]: rows are output features), so it computes k of the output features, alone."""

    def __init__(self, full: nn.Linear, rank: int, world: int):
        super().__init__()
        k = full.out_features // world
        # TODO(you): this rank's slice of the weight as a Parameter of its own (not a view of the
        # full weight). nn.Linear's weight is [out_features, in_features].
        todo("ColumnParallelLinear: keep rows [rank*k, (rank+1)*k) of the full weight")

    def forward(self, x):
        return F.linear(x, self.weight)  # Llama's linears have no bias


class RowParallelLinear(nn.Module):
    """y_r = x_r W_r^T: rank r keeps columns [r*k, (r+1)*k) of the weight (input features) and
    gets only those k input features, so its output is a partial sum: g adds them up."""

    def __init__(self, full: nn.Linear, rank: int, world: int):
        super().__init__()
        k = full.in_features // world
        # TODO(you): as in ColumnParallelLinear, for the input features.
        todo("RowParallelLinear: keep columns [rank*k, (rank+1)*k) of the full weight")

    def forward(self, x):
        return F.linear(x, self.weight)


class MegatronMLP(nn.Module):
    """Llama's MLP, down(silu(gate(x)) * up(x)), split over the ranks as Megatron-LM does."""

    def __init__(self, mlp, rank: int, world: int):
        super().__init__()
        self.gate_proj = ColumnParallelLinear(mlp.gate_proj, rank, world)
        self.up_proj = ColumnParallelLinear(mlp.up_proj, rank, world)
        self.down_proj = RowParallelLinear(mlp.down_proj, rank, world)
        self.act_fn = mlp.act_fn

    def forward(self, x):
        x = f.apply(x)  # one f for both column-parallel linears: one all_reduce in backward
        h = self.act_fn(self.gate_proj(x)) * self.up_proj(x)  # elementwise: stays local
        return g.apply(self.down_proj(h))


def mlp_weight_grads(mlp) -> torch.Tensor:
    """This rank's slices of the gate, up (rows) and down (columns) weight gradients, flat."""
    grads = []
    for linear, dim in ((mlp.gate_proj, 0), (mlp.up_proj, 0), (mlp.down_proj, 1)):
        grad = linear.weight.grad
        if isinstance(grad, DTensor):
            grad = grad.to_local()  # DTensor keeps this rank's slice: the same rows/columns
        elif isinstance(linear, nn.Linear):  # unsharded: cut this rank's slice out
            k = grad.shape[dim] // dist.get_world_size()
            grad = grad.narrow(dim, dist.get_rank() * k, k)
        grads.append(grad.reshape(-1))
    return torch.cat(grads)


def train_step(model, tokens):
    """Forward and backward of the whole model. Returns the loss, layer 0's MLP output and input
    gradient (caught by hooks), and the bytes of each all_reduce made in forward, in backward."""
    mlp, seen = model.model.layers[0].mlp, {}

    def keep_input(module, inputs):
        inputs[0].retain_grad()  # a non-leaf: autograd frees its gradient unless asked
        seen["input"] = inputs[0]

    hooks = [mlp.register_forward_pre_hook(keep_input),
             mlp.register_forward_hook(lambda m, i, out: seen.update(output=out.detach()))]
    before = len(calls)
    loss = model(input_ids=tokens, labels=tokens, use_cache=False).loss  # next-token CE
    middle = len(calls)
    loss.backward()
    for h in hooks:
        h.remove()
    return {"loss": loss.detach(), "output": seen["output"], "input_grad": seen["input"].grad,
            "weight_grads": mlp_weight_grads(mlp)}, calls[before:middle], calls[middle:]


env = setup()
seed_everything(args.seed)  # the same model on every rank
base = tiny_llama(hidden=args.hidden, seq_len=args.seq).to(env.device)
tokens = counting_data(args.batch_size, args.seq)[:][0].to(env.device)
reference, _, _ = train_step(copy.deepcopy(base), tokens)

hand = copy.deepcopy(base)  # layer 0's MLP replaced by ours, cut from the same weights
hand.model.layers[0].mlp = MegatronMLP(base.model.layers[0].mlp, env.rank, env.world_size)
runs = {}
runs["hand"], fwd_calls, bwd_calls = train_step(hand, tokens)

# The same split by DTensor: ColwiseParallel shards rows, RowwiseParallel columns and sums.
mesh = init_device_mesh(env.device.type, (env.world_size,))
layer0 = "model.layers.0.mlp."
dtensor = parallelize_module(copy.deepcopy(base), mesh, {
    layer0 + "gate_proj": ColwiseParallel(), layer0 + "up_proj": ColwiseParallel(),
    layer0 + "down_proj": RowwiseParallel()})
runs["dtensor"], _, _ = train_step(dtensor, tokens)

act_bytes = args.batch_size * args.seq * args.hidden * 4  # one [B, S, h] float32 activation
print0(f"all_reduce calls by f and g: forward {len(fwd_calls)} ({sum(fwd_calls)} B), "
       f"backward {len(bwd_calls)} ({sum(bwd_calls)} B); one [B, S, h] activation: {act_bytes} B")
errors, scales = {}, {}
for name, run in runs.items():
    # <mine, reference> / <reference, reference>: a whole factor (2x, 0.5x) names a sum or a
    # mean too many (rank 0's)
    scales[name] = {k: ((run[k] * reference[k]).sum() / (reference[k] ** 2).sum()).item()
                    for k in reference}
    err = torch.tensor([(run[k] - reference[k]).abs().max().item() for k in reference],
                       dtype=torch.float64, device=env.device)  # NCCL reduces only GPU tensors
    dist.all_reduce(err, op=dist.ReduceOp.MAX)  # the worst rank's
    errors[name] = dict(zip(reference, err.tolist()))
    print0(f"{name} vs unsharded: " + ", ".join(
        f"max |{k} diff| < {TOLERANCES[k]:g}: {e < TOLERANCES[k]}"
        for k, e in errors[name].items()))
parity = all(e < TOLERANCES[k] for errs in errors.values() for k, e in errs.items())
write_json(args.json, {
    "world_size": env.world_size, "hidden": args.hidden, "batch": args.batch_size,
    "seq": args.seq, "activation_bytes": act_bytes, "tolerances": TOLERANCES,
    "all_reduce_calls": {"forward": len(fwd_calls), "backward": len(bwd_calls)},
    "all_reduce_bytes": {"forward": sum(fwd_calls), "backward": sum(bwd_calls)},
    "errors": errors, "scales": scales, "parity": parity})
teardown()

"""Tensor parallelism with DTensor on a transformers Llama: parity with the unsharded model,
and every collective counted.

    code/run_w_torchrun.sh 2 ch02_model_parallel/tensor_parallel.py --json /tmp/tp.json

Every rank builds the same model (same seed) and keeps an unsharded copy as the reference. Each
plan shards a fresh copy as Megatron-LM does: attention's q, k, v by heads and o by its input;
the MLP's gate, up by output features and down by its input. Embedding, norms and lm_head stay
whole on every rank, except in the vocab plan. One training step on the same batch must give the
reference's loss, logits, gradients and AdamW-updated weights; the collectives are counted in
forward and in backward. Plans: naive (Colwise/RowwiseParallel on the linears only), megatron
(+ one shared input per block), sequence (+ sequence parallelism between the blocks, as in
torchtitan), vocab (megatron + the embedding and the LM head split over the vocabulary, and the
loss computed on the sharded logits under loss_parallel(), as in torchtitan).
"""
import argparse
import contextlib
import copy
import os
import warnings
from collections import defaultdict

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import loss_parallel
from torch.nn.functional import cross_entropy

from distkit import print0, print_ranks, seed_everything, setup, teardown, write_json
from distkit.toy import counting_data, tiny_llama
# the plans (layer_plan: one decoder layer's; parallelize: applied to the model) live in distkit,
# where chapter 04 reuses them for FSDP + tensor parallel
from distkit.tp import PLANS, parallelize

# Float32; sharding only reorders additions (a row-parallel linear sums N partial products).
# Measured, seeds 0-2, N=2 and 4, native and scalar kernels (ATEN_CPU_CAPABILITY=default):
# loss <= 4.8e-7 (1 ulp of ~4.9), logits <= 2.4e-7, gradients <= 1.4e-8, weights <= 7.5e-6.
# Bounds 10-70x above. Weights are the loosest: AdamW's first step is LR * g / (|g| + eps), so
# a 1e-9 difference in a gradient near eps (1e-8) moves a weight ~1e-6; 1e-4 is a tenth of a step.
LOSS_TOL, LOGIT_TOL, GRAD_TOL, WEIGHT_TOL = 1e-5, 1e-5, 1e-6, 1e-4
LR = 1e-3

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--hidden", type=int, default=64)
parser.add_argument("--heads", type=int, default=4, help="must be a multiple of the process count")
parser.add_argument("--layers", type=int, default=2)
parser.add_argument("--seq", type=int, default=32, help="tokens per sequence")
parser.add_argument("--batch-size", type=int, default=8)
parser.add_argument("--plans", default=",".join(PLANS), help="comma list of " + ", ".join(PLANS))
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--json", help="write counts, bytes and parity errors here")
args = parser.parse_args()
world = int(os.environ.get("WORLD_SIZE", 1))
plans = args.plans.split(",")
if world < 2:
    parser.error(f"needs at least 2 processes, got {world}: "
                 "code/run_w_torchrun.sh 2 ch02_model_parallel/tensor_parallel.py")
if min(args.hidden, args.heads, args.layers, args.seq, args.batch_size) < 1:
    parser.error("--hidden, --heads, --layers, --seq and --batch-size must be >= 1")
if args.heads % world:
    parser.error(f"--heads {args.heads} is not a multiple of {world} processes")
if args.hidden % args.heads:
    parser.error(f"--hidden {args.hidden} is not a multiple of --heads {args.heads}")
if set(plans) - set(PLANS):
    parser.error(f"--plans: unknown {','.join(sorted(set(plans) - set(PLANS)))}")


class CommCounter(CommDebugMode):
    """CommDebugMode counts collectives by type but not their sizes: we add those up. Bytes: of
    the full tensor each one works on (all_reduce's buffer, all_gather's output, reduce_scatter's
    input); ring bytes: what each rank sends in a ring, 2(N-1)/N of that for all_reduce, (N-1)/N
    for all_gather and reduce_scatter (chapter 00)."""

    def __enter__(self):
        self.bytes, self.ring_bytes, self.bytes_by_op = 0, 0, defaultdict(int)
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        before = self.get_total_counts()
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if self.get_total_counts() > before:  # CommDebugMode counted a collective
            op, n = str(func._overloadpacket).split(".")[-1], dist.get_world_size()
            size = max(t.numel() * t.element_size() for t in (args[0], out))
            self.bytes += size
            self.bytes_by_op[op] += size
            self.ring_bytes += (2 if op == "all_reduce" else 1) * (n - 1) * size // n
        return out

    def counts(self) -> dict:
        return {str(op).split(".")[-1]: n for op, n in self.get_comm_counts().items()}


def full(t):  # a DTensor's global value (gathered); a plain tensor as it is
    return t.full_tensor() if isinstance(t, DTensor) else t


def local(t):  # what this rank stores
    return t.to_local() if isinstance(t, DTensor) else t


def parallel_loss(logits):
    """loss_parallel() for logits sharded over the vocabulary (the vocab plan): cross_entropy then
    all-reduces per-token maxima and sums of exp over the ranks' V/N columns. Its backward must
    run inside it too. Plain logits: nothing to do."""
    return loss_parallel() if isinstance(logits, DTensor) else contextlib.nullcontext()


def step(model, tokens):
    """Forward and backward, each inside its own counter, then one AdamW step."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    fwd, bwd = CommCounter(), CommCounter()
    with fwd:
        logits = model(input_ids=tokens, use_cache=False).logits
        with parallel_loss(logits):  # the next token's cross-entropy, as LlamaForCausalLM's loss
            loss = cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())
    with bwd, parallel_loss(logits):
        loss.backward()
    grads = {n: full(p.grad) for n, p in model.named_parameters()}
    optimizer.step()
    weights = {n: full(p.detach()) for n, p in model.named_parameters()}
    return full(loss.detach()), full(logits.detach()), grads, weights, fwd, bwd


def max_diff(a: dict, b: dict) -> float:
    return max((a[n] - b[n]).abs().max().item() for n in a)


# CommDebugMode's module tracker hooks every module's backward; transformers' dict outputs make
# torch warn that such hooks may not fire. Not ours to fix; keep the output readable.
warnings.filterwarnings("ignore", message="(For backward hooks|Full backward hook)")
env = setup()
mesh = init_device_mesh(env.device.type, (env.world_size,))
seed_everything(args.seed)
base = tiny_llama(hidden=args.hidden, layers=args.layers, heads=args.heads,
                  seq_len=args.seq).to(env.device)
tokens = counting_data(args.batch_size, args.seq)[:][0].to(env.device)  # the same on every rank
ref_loss, ref_logits, ref_grads, ref_weights, *_ = step(copy.deepcopy(base), tokens)
act_bytes = args.batch_size * args.seq * args.hidden * 4  # one [B, S, h] float32 activation
megatron = 2 * args.layers  # Megatron: one all-reduce per block (attention, MLP), each way
names, bounds = ["loss", "logit", "grad", "weight"], [LOSS_TOL, LOGIT_TOL, GRAD_TOL, WEIGHT_TOL]
results = {}
for plan in plans:
    model = parallelize(copy.deepcopy(base), plan, mesh)  # the same initial weights
    loss, logits, grads, weights, fwd, bwd = step(model, tokens)
    err = torch.tensor([(loss - ref_loss).abs().item(), (logits - ref_logits).abs().max().item(),
                        max_diff(grads, ref_grads), max_diff(weights, ref_weights)],
                       dtype=torch.float64, device=env.device)  # NCCL reduces only GPU tensors
    dist.all_reduce(err, op=dist.ReduceOp.MAX)  # the worst rank's
    ok = [e < b for e, b in zip(err.tolist(), bounds)]
    results[plan] = {"param_bytes": sum(local(p).nbytes for p in model.parameters()),
                     "forward": fwd.counts(), "backward": bwd.counts(),
                     "forward_bytes": fwd.bytes, "backward_bytes": bwd.bytes,
                     "forward_ring_bytes": fwd.ring_bytes, "backward_ring_bytes": bwd.ring_bytes,
                     **{f"max_{n}_diff": e for n, e in zip(names, err.tolist())},
                     "parity": all(ok)}
    print0(("\n" if plan != plans[0] else "")
           + f"{plan} plan (Megatron-LM: {megatron} all_reduce of {act_bytes} B each way)\n"
           f"  {'':8s} {'collective':28s} {'count':>5s} {'bytes':>7s}")
    for way, counter in (("forward", fwd), ("backward", bwd)):
        for op, n in sorted(counter.counts().items()):
            print0(f"  {way:8s} {op:28s} {n:5d} {counter.bytes_by_op[op]:7d}")
        print0(f"  {way:8s} {'bytes each rank sends (ring)':28s} {counter.ring_bytes:13d}")
    print0("  " + ", ".join(f"max |{n} diff| < {b:g}: {o}" for n, b, o in zip(names, bounds, ok)))

attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp  # the last plan's model
shapes = {name: [list(w.shape), list(local(w).shape)] for name, w in (
    ("q_proj", attn.q_proj.weight), ("o_proj", attn.o_proj.weight),
    ("gate_proj", mlp.gate_proj.weight), ("down_proj", mlp.down_proj.weight))}
# per rank with the decoder layers split (every plan but vocab splits only those)
mine = next(r["param_bytes"] for p, r in results.items() if p != "vocab") \
    if set(plans) - {"vocab"} else results["vocab"]["param_bytes"]
whole = sum(p.nbytes for p in base.parameters())
print_ranks("  ".join(f"{n} {g} -> {loc}" for n, (g, loc) in shapes.items())
            + f"\nparameter bytes: {mine} here, {whole} unsharded")
write_json(args.json, {
    "world_size": env.world_size, "layers": args.layers, "hidden": args.hidden,
    "heads": args.heads, "batch": args.batch_size, "seq": args.seq,
    "vocab": base.config.vocab_size,
    "tolerances": dict(zip(names, bounds)), "activation_bytes": act_bytes,
    "megatron_count": megatron, "plans": results, "local_shapes": shapes,
    "param_bytes_per_rank": mine, "param_bytes_unsharded": whole})
teardown()

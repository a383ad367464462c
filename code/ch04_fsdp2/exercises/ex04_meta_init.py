# Yours to fill in (generated from ../solutions/ex04_meta_init.py).
"""Exercise 04.1: build a sharded model on the meta device, rank 0 alone holding it whole.

    code/run_w_torchrun.sh 2 ch04_fsdp2/exercises/ex04_meta_init.py

Every rank builds the model under torch.device("meta"): shapes and dtypes, no memory, no random
numbers. fully_shard then turns each parameter into a DTensor whose local shard is still meta.
Allocate just those shards, uninitialised, with model.to_empty(). Only rank 0 builds the real,
seeded model (on the CPU, as from a checkpoint); load it with set_model_state_dict, rank 0's
full state dict broadcast tensor by tensor, each rank keeping its shard. So no rank but 0 ever
holds the whole model, and rank 0 only on the CPU.
The trap: the state dict holds parameters and persistent buffers only. The rotary embedding's
inv_freq (and original_inv_freq) are non-persistent buffers: not in the state dict, not
broadcast, and to_empty() leaves them as whatever bytes the allocator returns. They are computed,
not learnt: recompute them from the config, as transformers does when it builds the model.
The losses over a few AdamW steps must then match one process training rank 0's model on the
global batch, and inv_freq must match bit for bit.
Fill in the TODO(you) parts, replacing each todo(...) call with your code. Run the script at any
time: it stops at the first todo() left and says what is missing.
`make exercise EX=04.1` checks it at 2 and 3 ranks. Solution, with the answers
to the questions below: ../solutions/ex04_meta_init.py.

Predict, then measure:
1. Comment out your inv_freq lines and run again: what do the two checks say? The losses at 3
   decimals barely move: why does a freshly initialised model hardly notice wrong rotary
   frequencies, and why would a trained one?
2. broadcast_from_rank0 sends whole tensors, one at a time, and each rank keeps its shard of
   each. How many bytes does rank 1 hold at most for a moment beyond its shards? (Which is the
   largest tensor in the state dict?)
3. Run it on 3 processes (code/run_w_torchrun.sh 3 ...). Why are the bytes held per rank no
   longer equal?
4. Why does model.to(env.device) fail on the meta model, where to_empty() works?
"""
import argparse

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from distkit import print0, print_ranks, seed_everything, setup, teardown, todo, write_json
from distkit.toy import counting_data, tiny_llama

# Against one process: float32 rounding differs (gradients reduced in another order); a wrong
# inv_freq or a rank left with uninitialised weights misses by far more.
LOSS_TOL = 1e-5
SEED = 0
parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--steps", type=int, default=3, help="AdamW steps")
parser.add_argument("--batch-size", type=int, default=4, help="sequences per step, per process")
parser.add_argument("--lr", type=float, default=3e-3, help="AdamW's learning rate")
parser.add_argument("--json", help="write losses, parity and bytes per rank here (rank 0)")
args = parser.parse_args()
if args.steps < 1 or args.batch_size < 1:
    parser.error("need --steps >= 1 and --batch-size >= 1")

env = setup()
N, b = env.world_size, args.batch_size
mesh = init_device_mesh(env.device.type, (N,))
(tokens,) = counting_data(args.steps * N * b)[:]
batches = tokens.view(args.steps, N * b, -1).to(env.device)  # step s: the global batch s

# 1. Every rank: the model's skeleton on the meta device, sharded, then its shards allocated.
with torch.device("meta"):
    model = tiny_llama()
for layer in model.model.layers:
    fully_shard(layer, mesh=mesh)
fully_shard(model, mesh=mesh)
# TODO(you): allocate this rank's shards, uninitialised, on env.device. Why can .to() not do it?
# Look up: nn.Module.to_empty.
todo("allocate the sharded model's storage on env.device (to_empty)")
rotary = model.model.rotary_emb

# 2. Rank 0 alone: the real, seeded model on the CPU (in practice: read from a checkpoint).
if env.rank == 0:
    seed_everything(SEED)
    full = tiny_llama()
    full_sd = full.state_dict()
else:
    full_sd = {}  # broadcast_from_rank0: the other ranks pass an empty dict and receive
non_persistent = sorted(name for name, _ in model.named_buffers()
                        if name not in model.state_dict())
print0(f"buffers not in the state dict (non-persistent): {', '.join(non_persistent)}")

# 3. Rank 0's full tensors, broadcast one by one; each rank copies its shard into its DTensors.
# TODO(you): full_sd holds whole tensors (not shards), and only on rank 0; every rank must end up
# with its shard of each. Look up: torch.distributed.checkpoint.state_dict's set_model_state_dict
# and StateDictOptions' fields.
todo("load rank 0's full_sd into every rank's shards (set_model_state_dict)")
# 4. The buffers no state dict carries: recompute them from the config, as the rotary
# embedding's __init__ does (and transformers' _init_weights, when from_pretrained loads a model
# built on meta). On the CPU, as the reference's were: bit for bit equal.
# TODO(you): both buffers must hold what LlamaRotaryEmbedding.__init__ computes from model.config
# for its rope_type, bit for bit. Read that __init__ (transformers/models/llama/modeling_llama.py)
# and transformers.modeling_rope_utils.
todo("recompute the rotary embedding's inv_freq and original_inv_freq buffers")

local = sum(p.to_local().nbytes for p in model.parameters())
whole = sum(p.numel() * p.element_size() for p in model.parameters())
print_ranks(f"parameter bytes held: {local:,} of {whole:,}")

optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
losses = []
for step in range(args.steps):
    rows = batches[step, env.rank * b:(env.rank + 1) * b]  # this rank's part of the batch
    loss = model(input_ids=rows, labels=rows).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    loss = loss.detach()
    dist.all_reduce(loss)  # the mean over every rank's sequences, for the log
    losses.append(loss.item() / N)

# The reference: rank 0's full model trained alone on each whole global batch.
ref = torch.zeros_like(rotary.inv_freq)  # the reference's inv_freq, sent to every rank
if env.rank == 0:
    full.to(env.device)
    ref.copy_(full.model.rotary_emb.inv_freq)
    reference = torch.optim.AdamW(full.parameters(), lr=args.lr)
    single_losses = []
    for step in range(args.steps):
        loss = full(input_ids=batches[step], labels=batches[step]).loss
        loss.backward()
        reference.step()
        reference.zero_grad()
        single_losses.append(loss.item())
dist.broadcast(ref, src=0)
exact = torch.equal(rotary.inv_freq, ref) and torch.equal(rotary.original_inv_freq, ref)
print_ranks(f"inv_freq bit-exact vs the reference: {exact}")
if env.rank == 0:
    for step in range(args.steps):
        # 3 decimals: further digits differ in the last float bits between CPUs
        print0(f"step {step + 1}  loss {losses[step]:.3f}  (one process: "
               f"{single_losses[step]:.3f})")
    max_loss_diff = max(abs(x - y) for x, y in zip(losses, single_losses))
    print0(f"max |loss - reference| < 1e-5: {max_loss_diff < LOSS_TOL}")
exact_all = [None] * N
dist.all_gather_object(exact_all, exact)
held = [None] * N
dist.all_gather_object(held, local)
if env.rank == 0:
    write_json(args.json, {
        "world_size": N, "steps": args.steps, "batch_size": b, "lr": args.lr,
        "non_persistent_buffers": non_persistent, "param_bytes_held": held,
        "param_bytes": whole, "losses": losses, "single_losses": single_losses,
        "max_loss_diff": max_loss_diff, "tolerance": LOSS_TOL,
        "parity": max_loss_diff < LOSS_TOL, "inv_freq_exact": exact_all})
teardown()

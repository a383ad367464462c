"""Chapter 04: build the model on the meta device, shard it, then fill the shards: without ever
holding it whole.

    code/run_w_torchrun.sh 2 ch04_fsdp2/meta_init.py --json build/ch04/meta_init.json

train_fsdp2.py builds the full model on every rank and shards it afterwards: fine for a tiny
Llama, impossible for a 70B one. Here every rank builds it on "meta" (shapes, no memory),
applies fully_shard (still meta), and only then allocates its shards with to_empty(). The
values come from ONE place: rank 0 builds the seeded model (in practice it would load a
checkpoint; here it trains it briefly, so that it has learned to use positions, as a real
checkpoint has) and set_model_state_dict(..., broadcast_from_rank0=True) sends each rank its
shards.
The same seed on rank 0 gives the same weights at any world size: a random init of the shards
on each rank would not (each rank's generator would fill a different slice).

The trap: to_empty() allocates every parameter AND buffer without initialising it, and a
non-persistent buffer, such as the rotary embedding's inv_freq, is not in any state dict, so
loading weights does not fill it. The "forgotten" run shows what happens; the "fixed" run
recomputes it, as the model's __init__ would have. Garbage can be anything, even the right
values, so the asserted runs fill the new memory with NaN (torch.use_deterministic_algorithms
around to_empty): a forgotten buffer is then NaN, and a fixed run that matches one process has
written every parameter and buffer.
"""
import argparse
import os
import warnings

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.fsdp import fully_shard

from distkit import print0, seed_everything, setup, teardown, write_json
from distkit.dist import grad_check, grad_norms
from distkit.toy import counting_data, tiny_llama

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--batch-size", type=int, default=4, help="sequences per rank and step")
parser.add_argument("--steps", type=int, default=3, help="AdamW steps")
parser.add_argument("--json", help="write the results here (rank 0)")
args = parser.parse_args()
if args.batch_size < 1 or args.steps < 1:
    parser.error("need --batch-size >= 1 and --steps >= 1")
if int(os.environ.get("WORLD_SIZE", 1)) * args.batch_size > 256:
    parser.error("need WORLD_SIZE x --batch-size <= 256 sequences")


def train(model, batch, steps: int) -> tuple[list[float], dict]:
    """AdamW steps; the losses, and step 1's gradient norm per parameter (for the parity
    check: AdamW's losses would hide a constant factor on the gradients)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    losses, grads = [], None
    for _ in range(steps):
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        grads = grads or grad_norms(model)
        optimizer.step()
        optimizer.zero_grad()
        loss = loss.detach().clone()
        if dist.is_initialized() and batch is mine:  # sharded run: average the ranks' losses
            dist.all_reduce(loss)
            loss /= env.world_size
        losses.append(loss.item())
    return losses, grads


def sharded_from_rank0(fix_buffers: bool, nan_fill: bool = False):
    with torch.device("meta"):  # every tensor has a shape and a dtype, no storage
        model = tiny_llama()
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    # Each rank allocates its shards (and buffers): garbage, or with nan_fill, NaN. Deterministic
    # mode makes empty_like (which to_empty calls) fill new memory with NaN
    # (torch.utils.deterministic.fill_uninitialized_memory, on by default): a debugging switch
    # that turns "whatever the allocator had" into a loud, reproducible NaN.
    torch.use_deterministic_algorithms(nan_fill)
    model.to_empty(device=env.device)
    torch.use_deterministic_algorithms(False)
    # Rank 0's full weights, split and sent shard by shard; the other ranks pass nothing.
    set_model_state_dict(model, full.state_dict() if env.rank == 0 else {},
                         options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    if fix_buffers:  # non-persistent buffers are in no state dict: compute them again
        rope = model.model.rotary_emb
        inv_freq, _ = rope.compute_default_rope_parameters(rope.config)
        rope.inv_freq.copy_(inv_freq)
        rope.original_inv_freq.copy_(inv_freq)
    return model


env = setup()
(tokens,) = counting_data(env.world_size * args.batch_size)[:]
tokens = tokens.to(env.device)
mine = tokens[env.rank * args.batch_size:(env.rank + 1) * args.batch_size]
full, box = None, [None, None]
if env.rank == 0:  # the one place the weights come from
    seed_everything(0)
    full = tiny_llama().to(env.device)
    train(full, counting_data(16, seed=99)[:][0].to(env.device), 32)  # the "checkpoint"
    reference = tiny_llama().to(env.device)
    reference.load_state_dict(full.state_dict())
    # the reference: one process on the whole global batch; and the buffer as __init__ made it
    box = [train(reference, tokens, args.steps), full.model.rotary_emb.inv_freq.cpu()]
    del reference
dist.broadcast_object_list(box, src=0)
(single, single_grads), inv_freq = box[0], box[1].to(env.device)

# "forgotten": plain to_empty, the buffer is whatever the allocator hands out. That garbage can
# even be right by chance (on a GPU the caching allocator may return the block of the reference
# model rank 0 just deleted, values intact), so nothing is asserted or printed about it (the
# notebook shows its losses). The other two runs fill new memory with NaN: the forgotten buffer
# is then NaN on every rank, on any machine, and the fixed run matching one process proves that
# every parameter and buffer was written.
results = {}
for name, fix, nan_fill in [("forgotten", False, False), ("forgotten_nan", False, True),
                            ("fixed", True, True)]:
    model = sharded_from_rank0(fix, nan_fill)
    got = model.model.rotary_emb.inv_freq
    losses, grads = train(model, mine, args.steps)
    results[name] = {"inv_freq_ok": bool(torch.equal(got, inv_freq)),
                     "inv_freq_nan": bool(got.isnan().all()), "losses": losses}
    # nan < 1e-5 is False: NaN losses do not match (and NaN gradients have an infinite gap)
    match = all(abs(a - b) < 1e-5 for a, b in zip(losses, single))
    results[name]["losses_match"] = match
    results[name]["grads_match"] = grad_check(grads, single_grads)["gap"] < 1e-5
    ok = [None] * env.world_size
    dist.all_gather_object(ok, [results[name]["inv_freq_ok"], results[name]["inv_freq_nan"]])
    results[name]["inv_freq_ok_all"] = all(o[0] for o in ok)
    results[name]["inv_freq_nan_all"] = all(o[1] for o in ok)
    if not nan_fill:  # this run's garbage: in the JSON only (no printed line differs by run)
        continue
    nan = " (NaN on every rank)" if results[name]["inv_freq_nan_all"] else ""
    label = name.replace("_nan", "") + " (NaN-filled)"
    print0(f"{label:22s}: rotary inv_freq right on every rank: "
           f"{results[name]['inv_freq_ok_all']}{nan};  "
           f"losses = one process's (< 1e-5) on {env.world_size} rank(s): {match}, "
           f"step-1 gradients too: {results[name]['grads_match']}")
# Initialising on the shards instead (an init function after to_empty): with the same seed on
# every rank, do the shards get different numbers? On CUDA yes: DTensor's OffsetBasedRNGTracker
# gives each shard its own offset in one seeded stream. A CPU mesh has no such tracker
# (torch/distributed/tensor/_random.py, is_rng_supported_mesh), so each rank draws from its own
# generator: every shard gets the same numbers (torch warns: "DTensor random operators may not
# have complete support on cpu device mesh"; silenced here, the check below says it).
warnings.filterwarnings("ignore", message="DTensor random operators")
with torch.device("meta"):
    model = tiny_llama()
fully_shard(model)
model.to_empty(device=env.device)
seed_everything(0)
weight = model.model.layers[0].self_attn.q_proj.weight  # Shard(0): rows split over the ranks
torch.nn.init.normal_(weight, std=0.02)
pieces = weight.full_tensor().chunk(env.world_size)  # at N=3 the last shard is shorter (padding)
shards_repeat = env.world_size > 1 and all(torch.equal(p, pieces[0][:len(p)]) for p in pieces[1:])
print0(f"init on the shards, same seed on every rank ({weight.device_mesh.device_type} mesh): "
       f"every rank's shard the same numbers: {shards_repeat}")
write_json(args.json, {"world_size": env.world_size, "single_losses": single, **results,
                       "init_on_shards": {"mesh": weight.device_mesh.device_type,
                                          "shards_repeat": shards_repeat}})
teardown()

"""Chapter 04's side-by-side: FSDP1 (FullyShardedDataParallel) on the same Llama, measured.

    code/run_w_torchrun.sh 2 ch04_fsdp2/fsdp1.py --json build/ch04/fsdp1.json

FSDP1, the wrapper FSDP2 replaces, is still what much code runs (Accelerate's FSDP plugin defaults
to fsdp_version=1; Lightning's FSDPStrategy wraps FSDP1), so it is worth reading once. Where FSDP2
shards every parameter as a DTensor, FSDP1 concatenates the parameters of each wrapped unit into
one 1-D FlatParameter, pads it to a multiple of N and keeps 1/N of it per rank. One launch shows,
on a transformers Llama whose LM head has a bias of 127 entries (an odd numel, so the padding
shows at N=2):
1. the FlatParameter of the root unit: what it flattens, its padding, each rank's piece;
2. use_orig_params=False/True: what model.named_parameters() yields;
3. sync_module_states: ranks built from different seeds made equal (a broadcast from rank 0);
4. sharding strategies (FULL_SHARD = ZeRO-3, SHARD_GRAD_OP = ZeRO-2, NO_SHARD = DDP,
   HYBRID_SHARD on a replicate x shard mesh): bytes per rank, collectives per step, and losses
   against one process training on the whole batch (HYBRID_SHARD with 1-rank shard groups
   shows an FSDP1 bug: the replicas never average their gradients);
5. limit_all_gathers, a GPU rate limiter, on and off;
6. the three state-dict types: what each rank holds.
"""
import argparse
import functools
import os
import warnings
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FullStateDictConfig, FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import ShardingStrategy, StateDictType
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode

from distkit import (print0, print_ranks, same_on_all_ranks, seed_everything, setup, teardown,
                     write_json)
from distkit.memory import by_category, storage_bytes
from distkit.toy import counting_data, tiny_llama

VOCAB, HIDDEN, LAYERS, BATCH, LR = 127, 64, 2, 4, 1e-3  # BATCH: sequences per rank
NAMES = ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD"]
CATEGORIES = ["params at rest", "params at end of forward", "grads", "optimizer"]
KINDS = ["all-gather", "reduce-scatter", "all-reduce"]

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--strategies", help="comma list of FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, "
                    "HYBRID_SHARD:RxS (R replicas x S shards = N processes); default: all four, "
                    "HYBRID_SHARD as 1xN and Nx1")
parser.add_argument("--steps", type=int, default=3, help="AdamW steps (memory: the first)")
parser.add_argument("--json", help="write every measured figure here (rank 0)")
args = parser.parse_args()
world = int(os.environ.get("WORLD_SIZE", 1))
if world < 2:
    parser.error(f"needs at least 2 processes, got {world}: "
                 "code/run_w_torchrun.sh 2 ch04_fsdp2/fsdp1.py")
strategies = (args.strategies or f"FULL_SHARD,SHARD_GRAD_OP,NO_SHARD,"
              f"HYBRID_SHARD:1x{world},HYBRID_SHARD:{world}x1").split(",")
for s in strategies:
    name, _, shape = s.partition(":")
    if name not in NAMES:
        parser.error(f"unknown strategy {s}; choose from {', '.join(NAMES)}")
    if name == "HYBRID_SHARD":  # a 2-D mesh: all-reduce across replicas, shard within one
        r, _, n = shape.partition("x")
        if not (r.isdigit() and n.isdigit() and int(r) * int(n) == world):
            parser.error(f"{s}: HYBRID_SHARD needs a mesh RxS with R x S = {world} processes, "
                         f"e.g. HYBRID_SHARD:1x{world}")
    elif shape:
        parser.error(f"{s}: only HYBRID_SHARD takes a mesh")
if args.steps < 1:
    parser.error("--steps must be >= 1")

# Known noise: MemTracker's backward hooks on modules returning a ModelOutput; FSDP1's own
# deprecations (NO_SHARD: "use DDP"; FSDP.state_dict_type: "use get_state_dict()", chapter 05;
# ShardedTensor: "use DTensor") and torch's internal calls in its sharded state dicts.
for message in ["For backward hooks", "Full backward hook", "The `NO_SHARD` sharding strategy",
                r"FSDP.state_dict_type\(\) and", "Please use DTensor instead",
                "`_get_pg_default_device` will be deprecated", "Multiple backends are registered"]:
    warnings.filterwarnings("ignore", message=message)

env = setup()
# One FSDP unit per decoder layer, and the root unit for what is left (embeddings, final norm,
# LM head): FSDP2's per-layer fully_shard loop, written as a policy FSDP1 applies while wrapping.
from transformers.models.llama.modeling_llama import LlamaDecoderLayer  # noqa: E402 (slow import)
policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={LlamaDecoderLayer})


def build(seed: int = 0) -> nn.Module:
    """The course's tiny Llama with one change: an LM head with a bias (127 entries). Every Llama
    weight is hidden x something, an even numel; the bias makes the root unit's flat numel odd."""
    seed_everything(seed)
    model = tiny_llama(vocab_size=VOCAB, hidden=HIDDEN, layers=LAYERS)
    model.lm_head = nn.Linear(HIDDEN, VOCAB, bias=True)
    return model.to(env.device)


def wrap(model: nn.Module, strategy: str = "FULL_SHARD", **options) -> FSDP:
    name, _, shape = strategy.partition(":")
    mesh = None
    if shape:  # HYBRID_SHARD: outer dim replicates (all-reduce), inner dim shards
        mesh = init_device_mesh(env.device.type, tuple(int(x) for x in shape.split("x")),
                                mesh_dim_names=("replicate", "shard"))
    # device_id: on CPU FSDP1 refuses to start without it (it looks for an accelerator);
    # device_id=cpu makes the CPU its compute device. On a GPU it moves the model there.
    return FSDP(model, auto_wrap_policy=policy, sharding_strategy=ShardingStrategy[name],
                device_id=env.device, device_mesh=mesh, **options)


def units(model: FSDP) -> dict:
    """Each FSDP unit's FlatParameter, by the module it wraps ("" is the root)."""
    return {name.replace("_fsdp_wrapped_module.", ""): m._handle.flat_param
            for name, m in model.named_modules() if isinstance(m, FSDP)}


def collectives(comm: CommDebugMode) -> dict:
    """CommDebugMode's c10d op counts, by kind (on CPU FSDP1 all-gathers into a list: allgather_;
    on GPU into one tensor: _allgather_base_)."""
    counts = dict.fromkeys(KINDS, 0)
    for op, n in comm.get_comm_counts().items():
        op = str(op)
        kind = ("all-gather" if "allgather" in op else "reduce-scatter" if "reduce_scatter" in op
                else "all-reduce" if "allreduce" in op else op)
        counts[kind] = counts.get(kind, 0) + n
    return counts


def global_loss(loss: torch.Tensor) -> float:
    """Each rank's loss is the mean over its sequences; their average is the global batch's."""
    loss = loss.detach().clone()
    dist.all_reduce(loss)
    return loss.item() / env.world_size


def train(strategy: str, **options) -> tuple[FSDP, dict]:
    """--steps AdamW steps; the first inside MemTracker; collectives counted on every step."""
    with warnings.catch_warnings(record=True) as caught:  # what FSDP1 says while wrapping
        model = wrap(build(), strategy, **options)
    said = sorted({str(w.message) for w in caught if "switching to use" in str(w.message)})
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    # MemTracker sees FSDP1's flat storages (sharded and gathered) as "Parameter" and AdamW's
    # state as "Optstate". Gradients: FSDP1 reduce-scatters into a new tensor and sets it as the
    # FlatParameter's .grad itself (not autograd), so the tracker files it under "Temp"; we count
    # the gradients' storages directly (and keep the tracker's Temp in the JSON to compare).
    tracker = MemTracker()
    tracker.track_external(model, optimizer)
    losses, per_step = [], []
    for step in range(args.steps):
        with CommDebugMode() as comm, (tracker if step == 0 else nullcontext()):
            loss = model(input_ids=mine, labels=mine).loss
            if step == 0:
                end_of_forward = by_category(tracker.get_tracker_snapshot("current"), env.device)
            loss.backward()
            if step == 0:
                grads = storage_bytes(p.grad for p in model.parameters())
                # step 1's gradient, squared norm of this rank's flat pieces (padding adds 0):
                # a local sum, no collective inside the counted step
                grad_sq = sum(p.grad.double().pow(2).sum().item()
                              for p in model.parameters() if p.grad is not None)
            optimizer.step()
            if step == 0:
                at_rest = by_category(tracker.get_tracker_snapshot("current"), env.device)
        optimizer.zero_grad()
        per_step.append(collectives(comm))
        losses.append(global_loss(loss))
    with FSDP.summon_full_params(model):  # every rank's whole model: are the replicas equal?
        in_sync = same_on_all_ranks(model.parameters())
    # The whole gradient's norm: every rank's pieces, summed, counted once per replica (NO_SHARD:
    # N replicas; HYBRID_SHARD RxS: R). AdamW's losses would hide a constant factor on it.
    total = torch.tensor(grad_sq, dtype=torch.float64, device=env.device)
    dist.all_reduce(total)
    name, _, shape = strategy.partition(":")
    replicas = env.world_size if name == "NO_SHARD" else int(shape.split("x")[0]) if shape else 1
    grad_norm = (total / replicas).sqrt().item()
    measured = {"params at rest": at_rest["Parameter"],
                "params at end of forward": end_of_forward["Parameter"],
                "grads": grads, "optimizer": at_rest["Optstate"]}
    return model, {"losses": losses, "grad_norm": grad_norm, "measured": measured,
                   "collectives": per_step,
                   "in_sync": in_sync, "tracker_temp": at_rest["Temp"], "warnings": said}


def predicted(strategy: str) -> dict:
    """Bytes per rank from the flat numels: fp32 parameters and gradients (4 B), AdamW's two
    moments (8 B) and one 4-byte step counter per FlatParameter. A unit sharded S ways is padded
    to a multiple of S; FSDP1 switches a unit with S = 1 to NO_SHARD (unpadded)."""
    name, _, shape = strategy.partition(":")
    s = 1 if name == "NO_SHARD" else int(shape.split("x")[1]) if shape else env.world_size
    if s == 1:
        whole = 4 * num_params
        return dict(zip(CATEGORIES, [whole, whole, whole, 2 * whole + 4 * len(flat)]))
    padded = {u: -(-n // s) * s for u, n in flat.items()}
    shard = 4 * sum(padded.values()) // s
    # end of forward: FULL_SHARD frees each layer's gathered FlatParameter after its forward,
    # except the root's (backward needs it first); SHARD_GRAD_OP keeps every one to backward
    kept = padded[""] if name in ("FULL_SHARD", "HYBRID_SHARD") else sum(padded.values())
    return dict(zip(CATEGORIES, [shard, shard + 4 * kept, shard, 2 * shard + 4 * len(flat)]))


def held(sd: dict) -> tuple[int, list[str], int]:
    """(keys, value types, bytes of the elements this rank holds) of a state dict."""
    def local(v):
        if isinstance(v, DTensor):
            return v.to_local()
        if hasattr(v, "local_shards"):  # a ShardedTensor: this rank's pieces (without padding)
            return torch.cat([s.tensor.reshape(-1) for s in v.local_shards()] or [v.new_empty(0)])
        return v
    return (len(sd), sorted({type(v).__name__ for v in sd.values()}),
            sum(local(v).numel() * local(v).element_size() for v in sd.values()))


def reference() -> tuple[list[float], float]:
    """One process, the whole global batch, plain AdamW: the losses every strategy must give,
    and step 1's whole gradient norm."""
    model = build()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    losses, grad_norm = [], None
    for _ in range(args.steps):
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        if grad_norm is None:
            grad_norm = sum(p.grad.double().pow(2).sum() for p in model.parameters()).sqrt().item()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, grad_norm


(tokens,) = counting_data(env.world_size * BATCH, vocab_size=VOCAB)[:]
tokens = tokens.to(env.device)
mine = tokens[env.rank * BATCH:(env.rank + 1) * BATCH]
single, single_grad_norm = reference()
out = {"world_size": env.world_size, "vocab": VOCAB, "hidden": HIDDEN, "layers": LAYERS,
       "batch_per_rank": BATCH, "steps": args.steps, "single_losses": single,
       "single_grad_norm": single_grad_norm}

# --- 0. FSDP1 on CPU ------------------------------------------------------------------------------
# (printed the same on every machine; checked where it applies: no accelerator at all)
if env.device.type == "cpu" and not torch.accelerator.is_available():
    try:
        FSDP(build(), auto_wrap_policy=policy)
        raise AssertionError("FSDP1 started without device_id and without an accelerator")
    except RuntimeError as e:
        assert "accelerator" in str(e), e
print0("FSDP(model) without device_id needs an accelerator: with none it raises RuntimeError "
       "(\"FSDP needs a non-CPU accelerator device\");\nso every FSDP(...) here passes "
       "device_id=this rank's device (torch.device('cpu') on CPU)\n")

# --- 1. the FlatParameter -------------------------------------------------------------------------
model = wrap(build())  # FULL_SHARD, use_orig_params=False: FSDP1's defaults
flat = {u: p._unpadded_unsharded_size.numel() for u, p in units(model).items()}
num_params = sum(flat.values())
model(input_ids=mine, labels=mine).loss.backward()  # _padded_unsharded_size is set on first use
print0(f"FlatParameters (FULL_SHARD, {env.world_size} ranks): one per wrapped unit, "
       f"{num_params:,} parameters in all")
print0(f"  {'unit':16s}{'params':>7s}{'unpadded':>10s}{'padded':>8s}{'padding':>8s}"
       f"{'shard/rank':>11s}")
out["flat_params"] = {}
for u, p in units(model).items():
    info = {"num_params": p._num_params, "fqns": list(p._fqns),
            "unpadded": p._unpadded_unsharded_size.numel(),
            "padded": p._padded_unsharded_size.numel(), "shard": p._sharded_size.numel()}
    info["padding"] = info["padded"] - info["unpadded"]
    out["flat_params"][u or "(root)"] = info
    print0(f"  {u or '(root)':16s}{info['num_params']:7d}{info['unpadded']:10,d}"
           f"{info['padded']:8,d}{info['padding']:8d}{info['shard']:11,d}")
root = units(model)[""]
# _shard_param_infos: for each original parameter, which slice of it lies in this rank's shard
pieces = [f"{fqn}[{i.intra_param_start_idx}:{i.intra_param_end_idx + 1}]"
          for fqn, i in zip(root._fqns, root._shard_param_infos) if i.in_shard]
print0("the root unit's shard on each rank (a parameter may be split between ranks; the "
       "padding is zeros at the end of the last rank's shard):")
print_ranks(f"{' + '.join(pieces)} + {root._shard_numel_padded} padding")

# --- 2. use_orig_params ---------------------------------------------------------------------------
print0("\nuse_orig_params=False (the default): model.named_parameters() yields the FlatParameters"
       " (this rank's shards):")
for name, p in model.named_parameters():
    print0(f"  {name:72s} {tuple(p.shape)}")
orig = wrap(build(), use_orig_params=True)
# The original parameters, each a 1-D view of the piece of it inside this rank's shard:
# (0,) where the other rank holds it all (FSDP2: a DTensor of the full shape on every rank)
mine_shapes = {name: list(p.shape) for name, p in orig.named_parameters()}
every_rank = [None] * env.world_size
dist.all_gather_object(every_rank, mine_shapes)
full_shapes = {name: list(p.shape) for name, p in build().named_parameters()}
print0(f"use_orig_params=True: it yields the {len(mine_shapes)} original parameters (names with "
       "those prefixes, left out below), 1-D, each the slice in this rank's shard:")
print0(f"  {'name (root unit and layer 0)':48s}{'full shape':>11s}"
       + "".join(f"{f'rank {r}':>9s}" for r in range(env.world_size)))
for name in mine_shapes:
    clean = name.replace("_fsdp_wrapped_module.", "")
    if ".layers." not in clean or ".layers.0." in clean:
        print0(f"  {clean:48s}{str(tuple(full_shapes[clean])):>11s}"
               + "".join(f"{str(tuple(r[name])):>9s}" for r in every_rank))
out["named_parameters"] = {"use_orig_params=False": {n: list(p.shape)
                                                     for n, p in model.named_parameters()},
                           "use_orig_params=True": every_rank}

# --- 3. sync_module_states ------------------------------------------------------------------------
different = build(seed=1 + env.rank)  # as if every rank had initialised its own random model
before = same_on_all_ranks(different.parameters())
try:
    synced = wrap(different, sync_module_states=True)  # broadcasts rank 0's values while wrapping
    how = "sync_module_states=True"
except ValueError as e:  # FSDP1 checks the tensors are on an accelerator before broadcasting
    print0(f"\nsync_module_states=True on CPU: ValueError: {str(e).split(', which')[0]}")
    with torch.no_grad():  # what it does, done before wrapping (it broadcasts in 250 MB buckets)
        for t in [*different.parameters(), *different.buffers()]:
            dist.broadcast(t, src=0)
    synced, how = wrap(different), "a broadcast from rank 0 before FSDP(...)"
with FSDP.summon_full_params(synced):  # gathered, unpadded FlatParameters
    after = same_on_all_ranks(synced.parameters())
print0(f"ranks built from different seeds: same values on all ranks: {before}; "
       f"after {how}: {after}")
out["sync_module_states"] = {"before": before, "after": after, "how": how}

# --- 4. sharding strategies -----------------------------------------------------------------------
results = {}
for strategy in strategies:
    trained, results[strategy] = train(strategy)
    if strategy == "FULL_SHARD":
        full_shard = trained  # kept for the state dicts below
everyone = [None] * env.world_size
dist.all_gather_object(everyone, results)
same = all(r[s]["measured"] == results[s]["measured"] for r in everyone for s in strategies)
steady = all(c == r["collectives"][0] for r in results.values() for c in r["collectives"])
print0(f"\nper rank, first step (bytes; every rank the same: {same}); collectives per step "
       f"(every step the same: {steady})")
print0(f"  {'strategy':18s}{'at rest':>9s}{'fwd end':>9s}{'grads':>9s}{'AdamW':>9s}"
       f"{'= formula':>10s}{'all-gather':>11s}{'red-scatter':>12s}{'all-reduce':>11s}")
for strategy, r in results.items():
    r["predicted"] = predicted(strategy)
    m, c = r["measured"], r["collectives"][0]
    print0(f"  {strategy:18s}" + "".join(f"{m[k]:9,d}" for k in CATEGORIES)
           + f"{str(m == r['predicted']):>10s}{c['all-gather']:11d}{c['reduce-scatter']:12d}"
           f"{c['all-reduce']:11d}")
for strategy, r in results.items():
    for w in r["warnings"]:
        print0(f"{strategy}: FSDP1 warns: {w}")
print0(f"losses of every strategy vs one process on the whole batch ({args.steps} AdamW "
       f"step{'s' * (args.steps > 1)}), and the ranks' whole models after it:")
for strategy, r in results.items():
    diff = max(abs(a - b) for a, b in zip(r["losses"], single))
    print0(f"  {strategy:18s} max |loss - reference| < 1e-5: {str(diff < 1e-5):5s}  "
           f"the same on all ranks: {r['in_sync']}")
    if not r["in_sync"] and r["warnings"]:
        # FSDP1's NO_SHARD all-reduces over its own (shard) group, here of 1 rank, and the
        # HYBRID all-reduce across replicas is gone with the switch: each rank trains alone.
        # Reported as pytorch/pytorch#154888. FSDP2 on a (N, 1) mesh all-reduces across replicas.
        print0(f"  {'':18s} FSDP1 bug: shard groups of 1 rank -> NO_SHARD within them, so no "
               "gradient crosses replicas")
out["strategies"] = {s: {**r, "ranks": [e[s]["measured"] for e in everyone]}
                     for s, r in results.items()}

# --- 5. limit_all_gathers -------------------------------------------------------------------------
# The rate limiter (default True): once 2 resharded units' frees are pending, the CPU thread waits
# on the oldest one's CUDA event before issuing the next all-gather, so prefetched all-gathers
# cannot pile up in the caching allocator. On CPU each op finishes before the next is issued:
# there is nothing to limit.
if "FULL_SHARD" in results:
    limited = results["FULL_SHARD"]
else:
    full_shard, limited = train("FULL_SHARD")
unlimited = train("FULL_SHARD", limit_all_gathers=False)[1]
keys = ["losses", "measured", "collectives"]
unchanged = all(limited[k] == unlimited[k] for k in keys)
print0(f"\nlimit_all_gathers=False vs True (FULL_SHARD): the same losses, bytes and collective "
       f"counts: {unchanged}")
out["limit_all_gathers"] = {"unchanged": unchanged, "false": {k: unlimited[k] for k in keys}}

# --- 6. state dicts -------------------------------------------------------------------------------
# FULL: every parameter gathered whole, here on rank 0 only; SHARDED: every original parameter
# split by rows (what DCP saves, chapter 05); LOCAL: the FlatParameter shards as they are, which
# only a run with the same N and the same wrapping can load.
# offload_to_cpu only on a GPU: with a CPU compute device FSDP1's to_cpu() is a no-op move
# followed by freeing the gathered storage the parameters still point to (RuntimeError;
# pytorch/pytorch#188989, reproduced with this torch).
full_config = FullStateDictConfig(rank0_only=True, offload_to_cpu=env.device.type != "cpu")
states = {}
for kind, config in [("FULL_STATE_DICT", full_config), ("SHARDED_STATE_DICT", None),
                     ("LOCAL_STATE_DICT", None)]:
    with FSDP.state_dict_type(full_shard, StateDictType[kind], config):
        states[kind] = held(full_shard.state_dict())
# FSDP1 given a device_mesh instead of a process group: its sharded state dict holds DTensors,
# as FSDP2's does (and LOCAL_STATE_DICT is refused)
meshed = FSDP(build(), auto_wrap_policy=policy, device_id=env.device,
              device_mesh=init_device_mesh(env.device.type, (env.world_size,)))
with FSDP.state_dict_type(meshed, StateDictType.SHARDED_STATE_DICT):
    states["SHARDED_STATE_DICT, device_mesh"] = held(meshed.state_dict())
every_rank = [None] * env.world_size
dist.all_gather_object(every_rank, states)
print0("\nstate dicts of the FULL_SHARD model: what each rank holds (FULL: rank0_only=True)")
print0(f"  {'state_dict_type':33s}{'values':14s}"
       + "".join(f"{f'rank {r}':>21s}" for r in range(env.world_size)))
for kind in states:
    types = sorted({t for s in every_rank for t in s[kind][1]})
    print0(f"  {kind:33s}{'/'.join(types):14s}"
           + "".join(f"{s[kind][0]:6d} keys {s[kind][2]:8,d} B" for s in every_rank))
out["state_dicts"] = {kind: [{"keys": s[kind][0], "types": s[kind][1], "bytes": s[kind][2]}
                             for s in every_rank] for kind in states}
write_json(args.json, out)
teardown()

"""Chapter 05's tour of Distributed Checkpoint (DCP): why it exists, what it saves, async save.

    code/run_w_torchrun.sh 2 ch05_checkpoint/dcp_tour.py --json build/ch05/tour.json

1. Why DCP: a sharded (FSDP2) tiny Llama trained for 3 AdamW steps is saved twice. The old way
   gathers the full state onto rank 0, which writes one file alone; dcp.save has every rank
   write its own shards in parallel, plus a .metadata file saying which file holds which rows.
2. State dicts: what get_state_dict returns under each StateDictOptions, then a Stateful round
   trip (model, AdamW, LR schedule, a step counter, every rank's random generators) into a
   fresh model, proved exact tensor by tensor.
5. Async save: how long dcp.save and dcp.async_save block the training loop (JSON only); that
   async_save returns before its upload is done (an order, checked on every rank at every save);
   and the rule that makes async safe: the weights may change once async_save has returned.
"""
import argparse
import collections
import os
import random
import re
import shutil
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_leaves

from distkit import print0, print_ranks, seed_everything, setup, teardown, write_json
from distkit.ckpt import AppState, RNGState
from distkit.dist import CODE
from distkit.memory import storage_bytes
from distkit.toy import counting_data, tiny_llama

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--out", default=str(CODE.parent / "build" / "ch05" / "tour"),
                    help="where the checkpoints go (default: build/ch05/tour)")
parser.add_argument("--repeats", type=int, default=3, help="saves timed per kind in section 5")
parser.add_argument("--hidden", type=int, default=256, help="hidden size of section 5's model")
parser.add_argument("--json", help="write every measurement here (rank 0)")
args = parser.parse_args()
if args.repeats < 1:
    parser.error("--repeats must be at least 1")
if args.hidden < 8 or args.hidden % 8:
    parser.error("--hidden must be a multiple of 8 (4 attention heads of an even size)")
if os.path.exists(args.out) and not os.path.isdir(args.out):
    parser.error(f"--out: {args.out} is a file, not a folder")
EMBED, out = "model.embed_tokens.weight", Path(args.out)
env = setup()


def build(seed, **size):
    """A tiny Llama seeded the same on every rank, sharded as in ch04's train_fsdp2.py."""
    seed_everything(seed)
    model = tiny_llama(**size).to(env.device)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    return model, optimizer, torch.optim.lr_scheduler.LinearLR(optimizer, 0.1, total_iters=10)


def train(model, optimizer, scheduler, steps, batch=8):
    """AdamW steps on counting data, each rank its own `batch` sequences."""
    data = counting_data(steps * env.world_size * batch).tensors[0]
    for tokens in data.view(steps, env.world_size, batch, -1)[:, env.rank].to(env.device):
        model(input_ids=tokens, labels=tokens).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()


def local(t):
    """This rank's piece of a tensor: a DTensor's local shard, else the tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def shards(model, optimizer, prefix=""):
    """A copy of this rank's piece (local shard) of every model and AdamW tensor."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    flat = {f"model.{k}": v for k, v in model_sd.items()}
    flat |= {f"optim.{k}.{n}": v for k, s in optim_sd["state"].items() for n, v in s.items()}
    return {k: local(v).clone() for k, v in flat.items() if k.startswith(prefix)}


def everywhere(flag: bool) -> bool:
    """True when flag is True on every rank (a collective)."""
    t = torch.tensor(int(flag), device=env.device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t)


def equal(a: dict, b: dict) -> bool:
    return everywhere(a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a))


def empty(folder: Path) -> Path:
    """folder, emptied (files of an earlier run on more ranks would otherwise linger)."""
    if env.rank == 0:
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
    dist.barrier()
    return folder


# 1. Why DCP: a sharded model and optimizer, saved the old way and with dcp.save
model, optimizer, scheduler = build(0)
train(model, optimizer, scheduler, steps=3)  # AdamW now has state: exp_avg, exp_avg_sq, step
# a) The old way: gather every full tensor onto rank 0 (with cpu_offload the others get
# nothing), which writes one file while the others wait. Rank 0 holds the whole state.
t0 = time.perf_counter()
full = get_state_dict(model, optimizer,
                      options=StateDictOptions(full_state_dict=True, cpu_offload=True))
if env.rank == 0:
    out.mkdir(parents=True, exist_ok=True)
    torch.save({"model": full[0], "optim": full[1]}, out / "full_state.pt")
dist.barrier()
old = {"seconds": time.perf_counter() - t0, "held_bytes": [None] * env.world_size,
       "file_bytes": (out / "full_state.pt").stat().st_size}
held = sum(t.nbytes for t in tree_leaves(full) if torch.is_tensor(t))
dist.all_gather_object(old["held_bytes"], held)
del full
print_ranks(f"old way: holds {held} bytes of gathered state; writes "
            + (f"full_state.pt, {old['file_bytes']} bytes" if env.rank == 0 else "nothing"))

# b) DCP: each rank writes its own shards (a DTensor's local rows) at the same time; rank 0
# writes the .metadata (every key's global shape and where each piece is) once all are done.
t0 = time.perf_counter()
dcp.save({"app": AppState(model, optimizer)}, checkpoint_id=empty(out / "dcp"))
new = {"seconds": time.perf_counter() - t0, "keys": {}, "files": {  # in rank order: __RANK_0
    p.name: p.stat().st_size for p in sorted((out / "dcp").iterdir(), key=lambda p: [
        int(n) for n in re.findall(r"\d+", p.name)])}}
print0(f"dcp.save wrote {len(new['files'])} files: .metadata (rank 0, after the others; "
       "its size depends on the folder path it records)")
for name, size in list(new["files"].items())[1:]:
    print0(f"  {name} (rank {name.split('_')[2]}): {size} bytes")
# What a reader sees in .metadata alone: each key's global shape and dtype, and its chunks
# (offsets, sizes): which rows of the tensor each file holds, whoever wrote them.
md = dcp.FileSystemReader(str(out / "dcp")).read_metadata()
for key, meta in md.state_dict_metadata.items():
    if isinstance(meta, TensorStorageMetadata):
        where = [md.storage_data[MetadataIndex(key, c.offsets)] for c in meta.chunks]
        new["keys"][key] = {"shape": list(meta.size), "dtype": str(meta.properties.dtype)[6:],
                            "chunks": [{"offsets": list(c.offsets), "sizes": list(c.sizes),
                                        "file": w.relative_path, "bytes": w.length}
                                       for c, w in zip(meta.chunks, where)]}
    else:  # a pickled Python value (AdamW's hyper-parameters)
        new["keys"][key] = {"file": md.storage_data[MetadataIndex(key)].relative_path}
print0(f".metadata lists {len(md.state_dict_metadata)} keys, for example:")
for key in (f"app.model.{EMBED}", *(f"app.optim.state.{EMBED}.{n}" for n in ("exp_avg", "step"))):
    info = new["keys"][key]
    print0(f"  {key}: {info['dtype']}, global shape {info['shape']}")
    for c in info["chunks"]:
        print0(f"    offsets {c['offsets']} sizes {c['sizes']}: {c['bytes']} bytes in {c['file']}")
# A value every rank holds whole (not a DTensor) is written once: the planner gives it to the
# rank with the fewest bytes planned so far (torch's _dedup_save_plans.py)
whole = [v.get("file") or v["chunks"][0]["file"] for v in new["keys"].values()
         if "file" in v or v["chunks"][0]["sizes"] == v["shape"]]
once = collections.Counter(whole)
print0(f"{sum(once.values())} keys every rank holds whole (AdamW's steps, hyper-parameters) were "
       f"written once: " + ", ".join(f"{n} in {f}" for f, n in sorted(once.items())))

# 2. State dicts: what get_state_dict gives under each option, for one parameter and its exp_avg.
# full_state_dict gathers every DTensor (a collective) into a whole tensor on every rank: N
# copies; adding cpu_offload keeps them on rank 0 alone, in CPU memory; the others get {}.
OPTIONS = {"StateDictOptions()": StateDictOptions(),
           "full_state_dict=True": StateDictOptions(full_state_dict=True),
           "full_state_dict=True, cpu_offload=True":
               StateDictOptions(full_state_dict=True, cpu_offload=True),
           "cpu_offload=True": StateDictOptions(cpu_offload=True)}


def what(t) -> str:
    """One value of a state dict: its type, the shape this rank holds, the device."""
    if t is None:
        return "nothing"
    return f"{type(t).__name__} {tuple(local(t).shape)} {local(t).device.type}"


weight, rows = model.model.embed_tokens.weight, {}
for name, options in OPTIONS.items():
    model_sd, optim_sd = get_state_dict(model, optimizer, options=options)
    w, m = model_sd.get(EMBED), optim_sd.get("state", {}).get(EMBED, {}).get("exp_avg")
    # sharded (and offloaded, when already on the CPU): the live parameter itself, not a copy
    same = "-" if w is None else local(w).data_ptr() == local(weight).data_ptr()
    rows[name] = f"{what(w):22} {what(m):22} {same}"
every = [None] * env.world_size
dist.all_gather_object(every, rows)
print0(f"\nget_state_dict: {EMBED} (global {tuple(weight.shape)}) and its exp_avg")
print0(f"  {'options':39} {'ranks':6} {'weight':22} {'exp_avg':22} same memory as the parameter")
for name in OPTIONS:  # one line when all ranks agree, else one per group of ranks
    groups = collections.defaultdict(list)
    for r, per_rank in enumerate(every):
        groups[per_rank[name]].append(r)
    for row, ranks in groups.items():
        print0(f"  {name:39} {'all' if len(groups) == 1 else ','.join(map(str, ranks)):6} {row}")


class Progress(Stateful):
    """Training state that is neither model nor optimizer: a step counter and the LR schedule."""

    def __init__(self, scheduler, step=0):
        self.scheduler, self.step = scheduler, step

    def state_dict(self):
        return {"step": self.step, "scheduler": self.scheduler.state_dict()}

    def load_state_dict(self, state):
        self.step = state["step"]
        self.scheduler.load_state_dict(state["scheduler"])


# The Stateful round trip: save everything, then load it into fresh objects from another seed
torch.manual_seed(100 + env.rank)  # each rank's generators differ (dropout, shuffling...)
random.seed(100 + env.rank)
saved, saved_schedule = shards(model, optimizer), scheduler.state_dict()
dcp.save({"app": AppState(model, optimizer), "rng": RNGState(env.rank, env.device),
          "progress": Progress(scheduler, step=3)}, checkpoint_id=empty(out / "roundtrip"))
drawn_after_save = (torch.rand(1).item(), random.random())
fresh, fresh_opt, fresh_sched = build(1)
progress = Progress(fresh_sched)
trip = {"before_load": equal(shards(fresh, fresh_opt), saved)}
dcp.load({"app": AppState(fresh, fresh_opt), "rng": RNGState(env.rank, env.device),
          "progress": progress},
         checkpoint_id=out / "roundtrip")
drawn_after_load = (torch.rand(1).item(), random.random())
trip |= {p: equal(shards(fresh, fresh_opt, p), {k: v for k, v in saved.items() if k.startswith(p)})
         for p in ("model", "optim")}
trip["progress"] = everywhere(progress.step == 3 and fresh_sched.state_dict() == saved_schedule)
trip["rng"] = everywhere(drawn_after_load == drawn_after_save)
print0(f"\nfresh model (seed 1) before dcp.load, every tensor equal: {trip['before_load']}")
print0(f"after dcp.load, model parameters (local shards), every tensor equal: {trip['model']}")
print0(f"after dcp.load, AdamW exp_avg, exp_avg_sq and step, every tensor equal: {trip['optim']}")
print0(f"after dcp.load, step counter and LR schedule equal: {trip['progress']}")
print_ranks(f"next torch and python random numbers equal to those drawn after the save: "
            f"{drawn_after_load == drawn_after_save}")

# 5. Async save, on a bigger model so that a save takes measurable time
big, big_opt, big_sched = build(0, hidden=args.hidden, layers=4)
train(big, big_opt, big_sched, steps=1, batch=1)  # AdamW state to save
state = {"app": AppState(big, big_opt)}
# what async_save's staging will copy: the storages behind this rank's tensors
staged = storage_bytes(t for t in tree_leaves(state["app"].state_dict()) if torch.is_tensor(t))
# async_save runs the save's collectives (gathering the plans, the final barrier) in a background
# thread while training issues FSDP's all-gathers and reduce-scatters. Ranks match collectives
# on a process group by their order; two threads sharing one group would interleave them in a
# different order on each rank: a hang or a mixed-up result. A group of its own keeps them apart
# (gloo: async_save needs a CPU backend, state_dict_saver.py:302, even when training uses NCCL).
ckpt_group = dist.new_group(backend="gloo")
timing = {"save": [], "async_save": [], "upload_done": []}
uploading = []  # per async save: was its upload still running when async_save returned?
for _ in range(args.repeats):
    t0 = time.perf_counter()
    dcp.save(state, checkpoint_id=empty(out / "sync"))  # blocked until every file is written
    timing["save"].append(time.perf_counter() - t0)
for _ in range(args.repeats):
    before, folder = shards(big, big_opt), empty(out / "async")
    t0 = time.perf_counter()
    # async_save stages first: it copies every tensor it saves into new CPU memory
    # (_state_dict_stager.py:160-179, CPU tensors included), then returns. The default stager
    # (StagingOptions all False, state_dict_saver.py:313-320) copies in this thread, on CPU as
    # on GPU: the training loop is blocked for get_state_dict plus one memory copy. The upload
    # (serialising, writing, the collectives) runs in a background thread.
    future = dcp.async_save(state, checkpoint_id=folder, process_group=ckpt_group)
    timing["async_save"].append(time.perf_counter() - t0)
    uploading.append(not future.done())  # an order, not a duration: the same on any machine
    future.add_done_callback(  # called when the upload is done (at once if it already is)
        lambda _, t0=t0: timing["upload_done"].append(time.perf_counter() - t0))
    # The rule: the weights may change only once staging is done. It is, when async_save has
    # returned; with StagingOptions(use_async_staging=True) (GPU) wait for its staging_completion.
    train(big, big_opt, big_sched, steps=1, batch=1)  # the weights change during the upload
    changed = shards(big, big_opt)
    future.result()  # before the next save (or the end): the files are complete
reloaded, reloaded_opt, _ = build(1, hidden=args.hidden, layers=4)
dcp.load({"app": AppState(reloaded, reloaded_opt)}, checkpoint_id=out / "async")
loaded = shards(reloaded, reloaded_opt)
returned_early = torch.tensor(int(all(uploading)))
dist.all_reduce(returned_early, op=dist.ReduceOp.MIN)  # on every rank, at every save
check = {"equal_before": equal(loaded, before), "equal_after": equal(loaded, changed),
         "returned_before_upload": bool(returned_early)}
print0(f"\nasync_save of a {args.hidden}-wide 4-layer Llama, an AdamW step during the upload:")
print_ranks(f"async_save returned after copying this rank's model and AdamW state: {staged} bytes")
print0(f"async_save returned before its upload was done, on every rank at every save: "
       f"{check['returned_before_upload']}")
print0(f"reloaded == state when async_save was called, every tensor equal: {check['equal_before']}")
print0(f"reloaded == state after that step, every tensor equal: {check['equal_after']}")

write_json(args.json, {"world_size": env.world_size, "old_way": old, "dcp": new,
                       "written_once": dict(once), "round_trip": trip,
                       "state_dicts": {name: [r[name] for r in every] for name in OPTIONS},
                       "async": {"hidden": args.hidden, "layers": 4, "seconds": timing,
                                 "staged_bytes": staged, **check}})
teardown()

"""Chapter 05: one process loads a checkpoint that FSDP2 saved on 2 ranks, and converts it.

    PYTHONPATH=code python code/ch05_checkpoint/formats.py --checkpoint /tmp/ckpt/step_000010 \
        --reference /tmp/run.json --out /tmp/formats --json /tmp/formats.json

A DCP checkpoint is not tied to the job that wrote it: its .metadata says which slice of every
full tensor each file holds, so a reader with any layout takes the pieces it needs. Here the
reader is the plainest there is: one process, no process group, an unwrapped model.
1. Into a plain model: dcp.load fills a plain tiny Llama, its AdamW and its LR schedule from the
   2-rank FSDP2 shards (loaded == saved, to the last bit: the manifest's sha256), and training
   goes on from that step with the same data order; the losses match the run that never stopped.
2. One file: dcp_to_torch_save gathers the whole checkpoint into one torch.save file (for tools
   that know only torch.load), and torch_save_to_dcp turns it back into a DCP folder.
3. Hugging Face: save_pretrained writes the trained model as safetensors plus its config, the
   format from_pretrained (and most inference tools) read.
4. Partial: a model-only load (the optimizer's keys are not read), and a bf16 export.
--reference is train_ckpt.py's --json of the run that made the checkpoint (for the parity).
"""
import argparse
import itertools
import json
import math
import shutil
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save, torch_save_to_dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from distkit import write_json
from distkit.ckpt import AppState, CheckpointDir, read_manifest, saved_keys, state_digest
from distkit.toy import counting_data, tiny_llama, warmup_cosine

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--checkpoint", required=True, help="a committed step_NNNNNN/ folder")
parser.add_argument("--reference", help="train_ckpt.py's --json of the run that never stopped")
parser.add_argument("--out", help="where the converted files go (default: a temporary folder)")
parser.add_argument("--global-batch", type=int, default=24,
                    help="sequences per step (processes x --batch-size of the run that saved)")
parser.add_argument("--epochs", type=int, default=2)  # these four: as train_ckpt.py's
parser.add_argument("--samples", type=int, default=256, help="sequences in the data set")
parser.add_argument("--lr", type=float, default=3e-3)
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--json", help="write every result here")
args = parser.parse_args()
ckpt = Path(args.checkpoint)
if not ckpt.is_dir():
    parser.error(f"--checkpoint: no folder {ckpt}")
if not (ckpt / ".metadata").is_file():
    parser.error(f"--checkpoint {ckpt}: not a DCP checkpoint (no .metadata file)")
if why := CheckpointDir.problem(ckpt):
    parser.error(f"--checkpoint {ckpt}: not a committed checkpoint ({why})")
if args.reference and not Path(args.reference).is_file():
    parser.error(f"--reference: no file {args.reference}")
if args.global_batch < 1 or args.samples < args.global_batch:
    parser.error("need 1 <= --global-batch <= --samples")
# dcp.load without a process group warns that it assumes one process: that is the point here
warnings.filterwarnings("ignore", message="torch.distributed is disabled")
results, seconds = {"checkpoint": ckpt.name}, {}
# the settings train_ckpt.py's Progress saves (and checks on a resume): they decide the data
# order and the LR schedule
RUN = {"global batch": args.global_batch, "--samples": args.samples, "--epochs": args.epochs,
       "--seed": args.seed, "--lr": args.lr}
data = counting_data(args.samples)


def build():
    """A plain model, its AdamW and LR schedule, as train_ckpt.py builds them (no fully_shard).
    The schedule must exist before loading: LambdaLR adds "initial_lr" to AdamW's param groups,
    and dcp.load reads only the keys its state dict already has."""
    torch.manual_seed(args.seed)  # the values do not matter: dcp.load overwrites them
    model = tiny_llama()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    scheduler = warmup_cosine(optimizer, args.samples // args.global_batch * args.epochs)
    return model, optimizer, scheduler


def load(folder, model, optimizer, scheduler):
    """dcp.load into a plain model: no process group, so it reads as one process. AppState's
    get_state_dict gives the same keys as under FSDP2 (no wrapper prefixes), with full tensors
    instead of DTensor shards: each is filled from both ranks' files. "progress" was saved by
    a Stateful object that lives in train_ckpt.py; a plain dict with the same keys reads it
    (filled in place, like the tensors). The per-rank RNG states are left out: this model uses
    no random numbers (no dropout; train_ckpt.py's per-step draws only stand in for them), and
    which rank's would one process take?"""
    state = {"app": AppState(model, optimizer),
             "progress": {"step": 0, "run": dict(RUN), "losses": [],
                          "scheduler": scheduler.state_dict()}}
    dcp.load(state, checkpoint_id=folder)
    scheduler.load_state_dict(state["progress"]["scheduler"])
    return state["progress"]


# 1. Into a plain model ---------------------------------------------------------------------
t0 = time.perf_counter()
manifest = read_manifest(ckpt)
model, optimizer, scheduler = build()
progress = load(ckpt, model, optimizer, scheduler)
if changed := [f"{k} {v} (here {RUN[k]})" for k, v in progress["run"].items() if RUN[k] != v]:
    parser.error("the checkpoint's run had " + ", ".join(changed) + "; use its settings")
step = progress["step"]
loaded_equal = state_digest(model, optimizer) == manifest["digest"]
loaded = {k: v.clone() for k, v in model.state_dict().items()}  # for part 2
print(f"1. {ckpt.name}: saved by FSDP2 on {manifest['world_size']} ranks, loaded by 1 process "
      f"into a plain model at step {step}")
print(f"   model + AdamW loaded == saved (sha256 of the full state): {loaded_equal}")
print(f"   LR schedule at step {scheduler.last_epoch}, losses so far: {len(progress['losses'])}")
seconds["load"] = time.perf_counter() - t0

# Continue training. DistributedSampler(shuffle=True, seed) permutes the data with the same
# generator whatever the number of ranks, and rank r takes positions r, r+N, r+2N, ...: so
# global batch i is the same set of sequences on N ranks with N*b each as on one rank with the
# whole batch. One "replica" here, the global batch in one step; skip the steps already done.
t0 = time.perf_counter()
sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=args.seed)
loader = DataLoader(data, batch_size=args.global_batch, sampler=sampler, drop_last=True,
                    generator=torch.Generator())  # as train_ckpt.py's
losses = list(progress["losses"])
model.train()
for epoch in range(step // len(loader), args.epochs):
    sampler.set_epoch(epoch)
    for (tokens,) in itertools.islice(loader, step % len(loader), None):
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        losses.append(loss.item())
        step += 1
    print(f"   epoch {epoch}  step {step:3d}  loss {losses[-1]:.3f}")
seconds["train"] = time.perf_counter() - t0
results.update(step=progress["step"], saved_world_size=manifest["world_size"],
               loaded_equal=loaded_equal, losses=losses, final_step=step)
if args.reference:
    reference = json.loads(Path(args.reference).read_text())
    diff = max((abs(a - b) for a, b in zip(losses, reference["losses"])), default=math.inf)
    parity = len(losses) == len(reference["losses"]) and diff < 1e-5
    print(f"   {len(losses)} losses vs the run that never stopped (FSDP2, "
          f"{manifest['world_size']} ranks): max |diff| < 1e-5: {parity}")
    # Not bit-identical, though: one process sums each gradient over 24 sequences in another
    # order than 2 ranks that average their 12 each: a bit-exact resume keeps the layout.
    bitwise = state_digest(model, optimizer) == reference["digest"]
    print(f"   state after step {step} bit-identical to that run's (sha256): {bitwise}")
    results.update(reference_max_diff=diff, parity=parity, final_digest_equal=bitwise)

# 2. One file: torch.save, and back to DCP --------------------------------------------------
t0 = time.perf_counter()
out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="formats-"))
out.mkdir(parents=True, exist_ok=True)
single = out / "checkpoint.pt"
dcp_to_torch_save(ckpt, single)  # reads every shard, with no process group, into one dict
# weights_only=True (torch.load's default) is enough: besides tensors the checkpoint holds only
# numbers, strings, lists, tuples and dicts (the random state, the schedule, the losses)
whole = torch.load(single, weights_only=True)


def tensors(tree) -> int:
    """How many tensors a nested dict/list holds."""
    if isinstance(tree, dict):
        return sum(tensors(x) for x in tree.values())
    if isinstance(tree, (list, tuple)):
        return sum(tensors(x) for x in tree)
    return int(isinstance(tree, torch.Tensor))


def dcp_files(folder):
    """A DCP folder's data files (*.distcp), their bytes, and its tensor pieces: DCP writes every
    tensor, or every rank's shard of one, as a torch.save archive of its own. (.metadata is
    left out: it records the folder's path, so its size depends on where the folder is.)"""
    files = sorted(folder.glob("*.distcp"))
    meta = dcp.FileSystemReader(folder).read_metadata()
    pieces = sum(isinstance(meta.state_dict_metadata[i.fqn], TensorStorageMetadata)
                 for i in meta.storage_data)
    return sum(p.stat().st_size for p in files), len(files), pieces


dcp_bytes, dcp_count, dcp_pieces = dcp_files(ckpt)
pt_model = whole["app"]["model"]  # the same keys as get_state_dict gives
pt_equal = pt_model.keys() == loaded.keys() and all(torch.equal(pt_model[k], v)
                                                    for k, v in loaded.items())
print(f"2. dcp_to_torch_save -> {single.name}: top-level keys {sorted(whole)}, "
      f"{tensors(whole)} tensors")
print(f"   {single.stat().st_size} bytes in one file; {ckpt.name}: {dcp_bytes} bytes in "
      f"{dcp_count} data files (+ .metadata), {dcp_pieces} tensor pieces")
print(f"   every model tensor equal to the ones dcp.load gave the plain model: {pt_equal}")
again = out / "dcp_from_pt"
shutil.rmtree(again, ignore_errors=True)
torch_save_to_dcp(single, again)  # one process writes it: one data file
model2, optimizer2, scheduler2 = build()
load(again, model2, optimizer2, scheduler2)
again_equal = state_digest(model2, optimizer2) == manifest["digest"]
same_keys = saved_keys(again) == saved_keys(ckpt)
again_bytes, again_count, again_pieces = dcp_files(again)
print(f"   torch_save_to_dcp -> {again.name}/: {again_bytes} bytes in {again_count} data file "
      f"(+ .metadata), {again_pieces} tensor pieces; same keys as {ckpt.name}: {same_keys}")
print(f"   loaded again into a plain model: loaded == saved (sha256): {again_equal}")
results["torch_save"] = {"keys": sorted(whole), "tensors": tensors(whole),
                         "bytes": single.stat().st_size, "dcp_bytes": dcp_bytes,
                         "dcp_files": dcp_count, "dcp_pieces": dcp_pieces,
                         "model_equal": pt_equal, "round_trip_data_files": again_count,
                         "round_trip_bytes": again_bytes, "round_trip_pieces": again_pieces,
                         "round_trip_same_keys": same_keys, "round_trip_equal": again_equal}
seconds["torch_save"] = time.perf_counter() - t0

# 3. Hugging Face: safetensors + config.json ------------------------------------------------
t0 = time.perf_counter()
from transformers import LlamaForCausalLM  # noqa: E402  (slow import; tiny_llama did it already)
from transformers.utils import logging as hf_logging  # noqa: E402

hf_logging.disable_progress_bar()  # "Writing model shards", "Loading weights": noise here

hf = out / "hf"
shutil.rmtree(hf, ignore_errors=True)
model.save_pretrained(hf)  # the trained plain model (after part 1's steps)
files = {p.name: p.stat().st_size for p in sorted(hf.iterdir())}
reloaded = LlamaForCausalLM.from_pretrained(hf)  # a local folder: nothing is downloaded
batch = data.tensors[0][:8]
model.eval()
with torch.no_grad():
    a, b = model(input_ids=batch).logits, reloaded(input_ids=batch).logits
logits_equal, max_abs = torch.equal(a, b), (a - b).abs().max().item()
print(f"3. save_pretrained after step {step}: "
      + ", ".join(f"{name} ({size} bytes)" for name, size in files.items()))
print(f"   from_pretrained: {reloaded.dtype}; logits on 8 sequences equal "
      f"(torch.equal): {logits_equal}")
results["hf"] = {"files": files, "dtype": str(reloaded.dtype), "logits_equal": logits_equal,
                 "logits_max_abs_diff": max_abs}
seconds["hf"] = time.perf_counter() - t0

# 4. Model only, and a bf16 export -----------------------------------------------------------
# A partial load: ask dcp.load for the model's keys alone ("app.model.*"). AdamW's moments, the
# schedule and the RNG states stay unread: fine-tuning or evaluating from a training checkpoint.
# An export for inference keeps the weights only, in bf16: half the bytes.
t0 = time.perf_counter()
torch.manual_seed(args.seed + 1)  # other values than the checkpoint's: the load must set them
fresh = tiny_llama()
model_sd = get_model_state_dict(fresh)
dcp.load({"app": {"model": model_sd}}, checkpoint_id=ckpt)  # no optimizer key: not read
set_model_state_dict(fresh, model_sd)
model_only = all(torch.equal(v, loaded[k]) for k, v in fresh.state_dict().items())
in_ckpt = saved_keys(ckpt)
print(f"4. model only: {len(model_sd)} of the checkpoint's {len(in_ckpt)} keys read; weights "
      f"equal to the full load's: {model_only}")
hf16 = out / "hf_bf16"
shutil.rmtree(hf16, ignore_errors=True)
model.save_pretrained(hf16, state_dict={k: v.to(torch.bfloat16)
                                        for k, v in model.state_dict().items()})
back = LlamaForCausalLM.from_pretrained(hf16, torch_dtype=torch.bfloat16)
bf16_equal = all(torch.equal(v, model.state_dict()[k].to(torch.bfloat16))
                 for k, v in back.state_dict().items())
bf16_bytes = (hf16 / "model.safetensors").stat().st_size
print(f"   save_pretrained in bf16: model.safetensors {bf16_bytes} bytes (fp32: "
      f"{files['model.safetensors']}); reloaded == the weights rounded to bf16: {bf16_equal}")
results["model_only"] = {"keys": len(model_sd), "checkpoint_keys": len(in_ckpt),
                         "equal": model_only, "bf16_bytes": bf16_bytes, "bf16_equal": bf16_equal}
seconds["model_only"] = time.perf_counter() - t0
results["seconds"] = seconds
write_json(args.json, results)
if not args.out:
    shutil.rmtree(out)
checks = {"loaded == saved": loaded_equal, "parity": results.get("parity", True),
          "torch.save file": pt_equal, "round trip": again_equal, "logits": logits_equal,
          "model only": model_only, "bf16 export": bf16_equal}
if failed := [name for name, ok in checks.items() if not ok]:
    sys.exit(f"formats.py: check failed: {', '.join(failed)}")

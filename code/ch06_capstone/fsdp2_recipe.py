"""FSDP2 training of a transformers Llama in one file: copy it to your cluster, nothing else needed.

    torchrun --nproc-per-node 8 fsdp2_recipe.py --tokens DIR --preset llama-1b --seq-len 2048 \
        --batch-size 256 --micro-batch 4 --max-steps 5000 --save-every 500 --out /scratch/run

train_llama.py (chapter 06) without the course: torch, transformers and numpy only, in
torchtitan's order (parallelize.py): the model on the meta device, activation checkpointing,
torch.compile, fully_shard per decoder layer and at the root, weights from rank 0, AdamW,
resume, the loop. With the same settings it computes the same losses as train_llama.py
(tests/test_ch06_recipe.py checks it). DIR holds the tokens: train.bin (the ids, one flat
array) and index.json ({"dtype": "uint16", "vocab_size": V, "eos_id": E}), as chapter 06's
corpus.py writes them (or numpy's `ids.astype(np.uint16).tofile("train.bin")`). Left out: the
held-out evaluation, metrics files, async saves, checksums of the checkpoint files, the
export (see train_llama.py).
"""
import argparse
import functools
import json
import math
import os
import re
import signal
import sys
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch

if tuple(int(v) for v in re.match(r"(\d+)\.(\d+)", torch.__version__).groups()) < (2, 11):
    sys.exit(f"fsdp2_recipe.py: needs torch >= 2.11, this is {torch.__version__}")  # first

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_state_dict,
                                                     set_model_state_dict, set_state_dict)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM, LlamaConfig

PRESETS = {  # LlamaConfig fields; llama-1b/8b: Llama 3.2 1B's and 3.1 8B's shapes
    "cpu-tiny": dict(hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                     num_attention_heads=4, num_key_value_heads=2, rope_theta=10000.0,
                     tie_word_embeddings=True),
    "llama-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                     num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0,
                     tie_word_embeddings=True),
    "llama-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                     num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0,
                     tie_word_embeddings=False)}


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--tokens", metavar="DIR", required=True, help="train.bin + index.json (see above)")
    add("--preset", choices=PRESETS, default="cpu-tiny")
    add("--seq-len", type=int, default=128)
    add("--batch-size", type=int, default=16, help="sequences per step, all ranks together")
    add("--micro-batch", type=int, default=8, help="sequences per forward, per rank")
    add("--max-steps", type=int, default=100)
    add("--lr", type=float, default=3e-3)
    add("--min-lr", type=float, default=3e-4)
    add("--warmup", type=int, default=20)
    add("--weight-decay", type=float, default=0.1)
    add("--betas", type=float, nargs=2, default=(0.9, 0.95))
    add("--clip", type=float, default=1.0, help="0: no clipping")
    add("--seed", type=int, default=0)
    add("--precision", choices=["auto", "fp32", "bf16"], default="auto", help="auto: bf16 on GPU")
    add("--ac", action="store_true", help="full activation checkpointing of each layer")
    add("--compile", action="store_true", help="torch.compile each decoder layer")
    add("--reshard-after-forward", type=int, choices=[0, 1], default=1)
    add("--replicate", type=int, default=1, help="HSDP: replicas (e.g. nodes)")
    add("--out", default="recipe-out", help="checkpoints/ and losses.jsonl")
    add("--save-every", type=int, default=0)
    add("--resume", action="store_true", help="continue from the newest checkpoint in --out")
    args = parser.parse_args()
    world = int(os.environ.get("WORLD_SIZE", 1))
    if args.batch_size % (world * args.micro_batch) or world % args.replicate:
        parser.error(f"--batch-size must be a multiple of {world} ranks x --micro-batch, and "
                     "--replicate divide the ranks")
    if not (Path(args.tokens) / "train.bin").exists():
        parser.error(f"--tokens: no train.bin in {args.tokens}")
    if not args.resume and list(Path(args.out).glob("checkpoints/step_*/.metadata")):
        parser.error(f"--out {args.out} holds checkpoints: --resume continues that run (a fresh "
                     "one would write over them), or choose another --out")
    return args


args = parse_args()
stop = []  # a preemption (Slurm sends SIGTERM before it kills): save, then stop
signal.signal(signal.SIGTERM, lambda *_: stop.append(1))

# ---- distributed: torchrun set RANK, WORLD_SIZE, LOCAL_RANK and the rendezvous
local_rank = int(os.environ["LOCAL_RANK"])
device = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
if device.type == "cuda":
    torch.cuda.set_device(device)
dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=timedelta(minutes=30))
rank, world = dist.get_rank(), dist.get_world_size()


def dist_obj(obj):
    """obj as rank 0 has it, on every rank (ranks that each list a folder may disagree)."""
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]

bf16 = args.precision == "bf16" or (args.precision == "auto" and device.type == "cuda")
accum = args.batch_size // (world * args.micro_batch)

# ---- data: the flat token file, mapped (every rank shares the pages), cut into sequences
index = json.loads((Path(args.tokens) / "index.json").read_text())
ids = np.memmap(Path(args.tokens) / "train.bin", dtype=index["dtype"], mode="c")
n = len(ids) // args.seq_len
data = torch.from_numpy(ids[:n * args.seq_len].reshape(n, args.seq_len))
steps_per_epoch = n // args.batch_size


@functools.lru_cache(maxsize=1)  # once per epoch, not per step: 4 bytes a sequence
def permutation(epoch):
    return torch.randperm(n, dtype=torch.int32, generator=torch.Generator().manual_seed(
        args.seed * 100_003 + epoch))


def batch_of(step):
    """This rank's slice of the step's global batch: a seeded permutation per epoch, the same
    on every rank and world size, so a resume needs nothing but the step."""
    epoch, i = divmod(step, steps_per_epoch)
    order = permutation(epoch)[i * args.batch_size:(i + 1) * args.batch_size]
    return data[order.view(world, -1)[rank].long()].long()


# ---- model: meta shapes everywhere, the real weights on rank 0 only
config = LlamaConfig(vocab_size=index["vocab_size"], max_position_embeddings=args.seq_len,
                     rms_norm_eps=1e-5, bos_token_id=index["eos_id"], use_cache=False,
                     eos_token_id=index["eos_id"], pad_token_id=index["eos_id"],
                     **PRESETS[args.preset])
full_state = {}
if rank == 0:
    torch.manual_seed(args.seed)
    full_state = AutoModelForCausalLM.from_config(config, dtype=torch.float32).state_dict()
with torch.device("meta"):
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
if args.ac:  # 1. activation checkpointing of each decoder layer (before sharding)
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
if args.compile:  # 2. compile each layer
    for layer in model.model.layers:
        layer.compile()
fsdp = {"reshard_after_forward": bool(args.reshard_after_forward)}  # 3. FSDP2
if args.replicate > 1:  # HSDP: rows replicate (a node each), columns shard
    fsdp["mesh"] = init_device_mesh(device.type, (args.replicate, world // args.replicate),
                                    mesh_dim_names=("replicate", "shard"))
if bf16:
    fsdp["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
for layer in model.model.layers:
    fully_shard(layer, **fsdp)
fully_shard(model, **{**fsdp, "reshard_after_forward": False})  # backward needs the root at once
model.to_empty(device=device)  # 4. weights: this rank's shards, sent by rank 0
set_model_state_dict(model, full_state, options=StateDictOptions(full_state_dict=True,
                                                                  broadcast_from_rank0=True))
model.model.rotary_emb = type(model.model.rotary_emb)(config).to(device)  # a buffer to_empty left
full_state = None
decay = [p for p in model.parameters() if p.ndim >= 2]  # 5. AdamW, no decay on norms
optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                               {"params": [p for p in model.parameters() if p.ndim < 2],
                                "weight_decay": 0.0}],
                              lr=args.lr, betas=tuple(args.betas), fused=device.type == "cuda")


def lr_at(step):
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    t = min(1.0, (step - args.warmup) / max(1, args.max_steps - 1 - args.warmup))
    return args.min_lr + 0.5 * (args.lr - args.min_lr) * (1 + math.cos(math.pi * t))


# ---- checkpoints: DCP, each rank its shards; a folder counts once its .metadata is written.
# No checksums here (train_llama.py has them): a checkpoint that fails to load is reported
# and the one before it tried; if some exist and none loads, the run stops, changing nothing.
ckpts = Path(args.out) / "checkpoints"
step = 0
found = sorted(ckpts.glob("step_*"))  # (rank 0's listing decides; a shared file system)
found = [ckpts / n for n in dist_obj([p.name for p in found] if rank == 0 else None)]
failed = []
for folder in sorted(found, key=lambda p: p.name, reverse=True) if args.resume else []:
    if not dist_obj((folder / ".metadata").exists() if rank == 0 else None):
        failed.append(f"{folder.name}: no .metadata (the save never finished)")
        continue
    sd = {"step": torch.tensor(0)}
    model_sd, optim_sd = get_state_dict(model, optimizer)
    sd.update(model=model_sd, optim=optim_sd)
    try:  # (DCP gathers every rank's errors: every rank gets the same outcome)
        dcp.load(sd, checkpoint_id=folder)
    except (Exception, dcp.api.CheckpointException) as e:
        failed.append(f"{folder.name}: {str(e).strip().splitlines()[-1][:200]}")
        continue
    set_state_dict(model, optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    step = int(sd["step"])
    if rank == 0:
        print(*[f"checkpoint {f}; skipped" for f in failed], f"resumed from step {step}",
              sep="\n", flush=True)
    break
else:
    if failed:  # some exist, none loads: starting over would write over them
        sys.exit(f"fsdp2_recipe.py: --resume: {len(failed)} checkpoint(s), none loads ("
                 + "; ".join(failed) + "); nothing changed" if rank == 0 else 1)
start = step


def save(step):
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd, "step": torch.tensor(step)},
             checkpoint_id=ckpts / f"step_{step:06d}")


def due(step):  # a checkpoint of this step is asked for
    return args.save_every > 0 and step % args.save_every == 0 and step > start


# ---- the loop. Step K's checkpoint is written in the next iteration, once its forward and
# backward gave finite numbers and before its optimizer step: the weights are still step K's.
# A bad update (a learning rate too high, a corrupted weight) shows only in the next loss, so a
# save right after optimizer.step() could hold it, and every resume would fail on it. (After
# the last step, one more forward and backward checks it before the final save.)
log = None
if rank == 0:
    Path(args.out).mkdir(parents=True, exist_ok=True)
    path = Path(args.out) / "losses.jsonl"
    if path.exists():  # forget what an earlier attempt logged after the step we start from
        rows = [r for r in path.read_text().splitlines() if json.loads(r)["step"] <= step]
        path.write_text("".join(r + "\n" for r in rows))
    log = open(path, "a")
logged, stopping = None, False
while step < args.max_steps or due(step):
    for group in optimizer.param_groups:
        group["lr"] = lr_at(step)
    loss_sum = torch.zeros((), device=device)
    for i, x in enumerate(batch_of(step).to(device).split(args.micro_batch)):
        model.set_requires_gradient_sync(i == accum - 1)  # reduce-scatter after the last only
        if args.replicate > 1:
            model.set_requires_all_reduce(i == accum - 1)
        loss = model(input_ids=x, labels=x).loss / accum
        loss.backward()
        loss_sum += loss.detach()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip or float("inf"))
    norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
    # one all-reduce for what every rank must agree on: the loss, the norm, "stop?"
    shared = torch.stack([loss_sum, norm.float(), torch.tensor(float(bool(stop)), device=device)])
    dist.all_reduce(shared)
    loss, norm, stopping = shared.tolist()
    loss, norm = loss / world, norm / world
    if not (math.isfinite(loss) and math.isfinite(norm)):  # before the step poisons the weights
        sys.exit(f"fsdp2_recipe.py: non-finite loss or gradient norm at step {step + 1}")
    if due(step) or (stopping and step > start):  # step's weights just gave finite numbers
        save(step)
    if stopping or step == args.max_steps:  # (the last step's check, or a stop: no update)
        break
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    step += 1
    logged = loss
    if log:
        log.write(json.dumps({"step": step, "loss": loss, "grad_norm": norm}) + "\n")
        log.flush()
if rank == 0:
    print(f"step {step}" + (f": loss {logged:.4f}" if logged is not None else "")
          + ((" (stopped by SIGTERM, saved)" if step > start else " (stopped by SIGTERM)")
             if stopping else ""))
if log:
    log.close()
dist.barrier()
dist.destroy_process_group()
# Out at once (as train_llama.py's distkit.teardown does): the model still holds gloo's work
# objects, and freeing them during the interpreter's shutdown can abort the process ("terminate
# called without an active exception"; seen here under load; pytorch/pytorch PR #179291).
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)

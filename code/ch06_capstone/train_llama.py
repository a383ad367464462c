"""Chapter 06's capstone: train a transformers Llama with FSDP2, from one CPU process to many GPU nodes.

    code/run_w_torchrun.sh 2 ch06_capstone/train_llama.py --max-steps 100 --out build/ch06/run
    code/run_w_torchrun.sh 8 ch06_capstone/train_llama.py --preset llama-1b --text /data/*.txt \
        --vocab-size 32000 --seq-len 2048 --batch-size 256 --micro-batch 4 --eval-sequences 512 \
        --out /scratch/run1 --resume

One file, one loop, no framework: everything chapters 01-05 taught, in the order a step needs
it. The model is a transformers LlamaForCausalLM built from a preset config (or loaded with
from_pretrained from --model-path), initialised once on rank 0 and handed out shard by shard;
fully_shard wraps each decoder layer and then the root (FSDP2). The data is Python's reference
documentation (or your --text files), tokenized with a BPE trained on it (corpus.py). A step is
--batch-size sequences: each rank runs --micro-batch sequences at a time, accumulating
gradients until its share is done, then clips them and takes an AdamW step with a warm-up +
cosine learning rate. Every --eval-every steps it measures the held-out loss; every
--save-every steps it writes a Distributed Checkpoint, from which --resume continues where the
run stopped (on another number of ranks too); SIGTERM or SIGUSR1 (a preemption, a Slurm time
limit) make it save and stop cleanly. At the end it exports a Hugging Face folder (model +
tokenizer) that from_pretrained and generate() read.

What it writes to --out: metrics.jsonl (one line per step and per evaluation), checkpoints/,
hf/ (the export), and with --tensorboard the same metrics as TensorBoard events.
"""
import argparse
import functools
import json
import math
import os
import signal
import sys
import time
from pathlib import Path

import psutil
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     set_model_state_dict)
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # corpus.py, next to this file
import corpus  # noqa: E402
from distkit import memory, print0, setup, speed, teardown  # noqa: E402
from distkit.ckpt import AppState, CheckpointDir  # noqa: E402

# Llama architectures (transformers LlamaConfig fields); the vocabulary comes from the tokenizer.
PRESETS = {
    "cpu-tiny": {"hidden_size": 128, "intermediate_size": 384, "num_hidden_layers": 4,
                 "num_attention_heads": 4, "num_key_value_heads": 2, "rope_theta": 10000.0,
                 "tie_word_embeddings": True},
    # Llama 3.2 1B's and Llama 3.1 8B's shapes (without their rope scaling for long contexts)
    "llama-1b": {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
                 "num_attention_heads": 32, "num_key_value_heads": 8, "rope_theta": 500000.0,
                 "tie_word_embeddings": True},
    "llama-8b": {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                 "num_attention_heads": 32, "num_key_value_heads": 8, "rope_theta": 500000.0,
                 "tie_word_embeddings": False},
}
p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
g = p.add_argument_group("model")
g.add_argument("--preset", choices=PRESETS, default="cpu-tiny",
               help="architecture to build (default %(default)s)")
g.add_argument("--model-path", metavar="DIR", help="a local Hugging Face folder (config, "
               "weights, tokenizer) to fine-tune instead of a preset")
g = p.add_argument_group("data")
g.add_argument("--text", nargs="+", metavar="FILE", help="train on these UTF-8 text files (one "
               "document each) instead of the course's text, Python's reference docs")
g.add_argument("--data-dir", metavar="DIR", default="build/ch06/data",
               help="tokenizer and token cache (default %(default)s)")
g.add_argument("--vocab-size", type=int, metavar="N", default=2048,
               help="BPE vocabulary to train (default %(default)s)")
g.add_argument("--seq-len", type=int, metavar="N", default=128,
               help="tokens per packed sequence (default %(default)s)")
g = p.add_argument_group("FSDP2")
g.add_argument("--reshard-after-forward", type=int, choices=[0, 1], default=1,
               help="1: free each gathered layer after forward (ZeRO-3, default); "
                    "0: keep it until backward (ZeRO-2-like)")
g.add_argument("--precision", choices=["auto", "fp32", "bf16"], default="auto",
               help="bf16: compute in bf16, fp32 weights in AdamW and fp32 gradient "
                    "reductions; auto (default): bf16 on GPU, fp32 on CPU")
g.add_argument("--cpu-offload", action="store_true",
               help="keep shards, gradients and AdamW state in host memory (GPU only)")
g.add_argument("--ac", choices=["none", "selective", "full"], default="none",
               help="activation checkpointing of each decoder layer: full recomputes all of its "
                    "forward in backward; selective keeps the matmul and attention outputs and "
                    "recomputes the cheap rest (norms, activations, rotary); default none")
g.add_argument("--replicate", type=int, metavar="N", default=1,
               help="HSDP: N replicas of a model sharded over WORLD_SIZE/N ranks (e.g. N = "
                    "nodes: the all-gathers and reduce-scatters stay within a node, one "
                    "gradient all-reduce crosses nodes); default 1: shard over all ranks")
g.add_argument("--compile", nargs="?", const="inductor", metavar="BACKEND",
               help="torch.compile each decoder layer (default backend inductor; "
                    "aot_eager traces without generating kernels)")
g = p.add_argument_group("optimisation")
g.add_argument("--batch-size", type=int, metavar="N", default=16,
               help="sequences per optimizer step, all ranks together (default %(default)s)")
g.add_argument("--micro-batch", type=int, metavar="N", default=8,
               help="sequences per forward, per rank (default %(default)s); "
                    "accumulation steps = batch-size / (micro-batch x ranks)")
g.add_argument("--sync-every-microbatch", action="store_true",
               help="reduce-scatter gradients after every micro-batch: more communication, but "
                    "no unsharded gradients of the whole model kept between micro-batches")
g.add_argument("--max-steps", type=int, metavar="N",
               help="optimizer steps to train (default: --epochs passes over the data); "
                    "--warmup and the --*-every options count optimizer steps too, never "
                    "micro-batches")
g.add_argument("--epochs", type=float, default=1.0,
               help="passes over the training sequences, when --max-steps is not given "
                    "(default %(default)s)")
g.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (default %(default)s)")
g.add_argument("--min-lr", type=float, default=3e-4,
               help="learning rate at the last step (default %(default)s)")
g.add_argument("--warmup", type=int, metavar="STEPS", default=20,
               help="optimizer steps of linear warm-up (default %(default)s)")
g.add_argument("--weight-decay", type=float, default=0.1,
               help="AdamW's, on matrices only (default %(default)s)")
g.add_argument("--betas", type=float, nargs=2, default=(0.9, 0.95), metavar=("B1", "B2"),
               help="AdamW's (default 0.9 0.95)")
g.add_argument("--clip", type=float, default=1.0,
               help="max global gradient norm, 0 for none (default %(default)s)")
g.add_argument("--seed", type=int, default=0, help="initial weights and data order (default 0)")
g = p.add_argument_group("evaluation, checkpoints, output")
g.add_argument("--out", metavar="DIR", default="build/ch06/run",
               help="metrics, checkpoints and the export go here (default %(default)s)")
g.add_argument("--eval-every", type=int, metavar="STEPS", default=50,
               help="optimizer steps between held-out evaluations (default %(default)s)")
g.add_argument("--eval-sequences", type=int, metavar="N",
               help="evaluate on the first N held-out sequences only (default: all; on a large "
                    "corpus set it, or every evaluation runs the whole held-out 5%%)")
g.add_argument("--save-every", type=int, metavar="STEPS", default=0,
               help="optimizer steps between checkpoints (default 0: only when stopped by a "
                    "signal)")
g.add_argument("--keep", type=int, metavar="N", default=2,
               help="checkpoints to keep (default %(default)s)")
g.add_argument("--resume", action="store_true",
               help="continue from the newest good checkpoint in OUT/checkpoints (if any)")
g.add_argument("--async-save", action="store_true",
               help="write checkpoints in a background thread (dcp.async_save): the step waits "
                    "only for a copy to host memory; each save is committed once written")
g.add_argument("--log-every", type=int, metavar="STEPS", default=1,
               help="optimizer steps between metrics rows (default 1); the loss and the stop "
                    "flag are shared every step anyway, memory is gathered only when logging")
g.add_argument("--no-export", action="store_true", help="skip the Hugging Face export at the end")
g.add_argument("--tensorboard", action="store_true",
               help="also log to OUT/tensorboard/ (needs the tensorboard package)")
g.add_argument("--peak-tflops", type=float, metavar="TFLOPS",
               help="this GPU's dense bf16 peak, for MFU, if it is not in the table")
g.add_argument("--no-progress", action="store_true", help="no progress bar on rank 0")
g.add_argument("--timeout", type=float, metavar="SECONDS", help="how long a rank waits in a "
               "collective before failing (default: 60 s for cpu-tiny, else 1800 s: rank 0 "
               "alone builds a large model, saves, exports, while the others wait)")
args = p.parse_args()

# Bad input: one line and exit status 2, before any process group exists.
world = int(os.environ.get("WORLD_SIZE", 1))
if min(args.batch_size, args.micro_batch, args.seq_len - 1, args.eval_every, args.log_every,
       args.replicate) < 1:
    p.error("--batch-size, --micro-batch, --eval-every, --log-every and --replicate must be "
            ">= 1, --seq-len >= 2")
if world % args.replicate:
    p.error(f"--replicate {args.replicate} must divide the {world} ranks")
if args.batch_size % (world * args.micro_batch):
    p.error(f"--batch-size {args.batch_size} must be a multiple of {world} ranks x "
            f"--micro-batch {args.micro_batch}")
if args.compile and args.ac != "none":
    p.error("--compile with --ac: not combined in this script (never tested together here; "
            "torchtitan wraps its blocks for AC first, then compiles them); choose one")
if args.vocab_size < 257 and not args.model_path:
    p.error("--vocab-size must be >= 257 (the 256 bytes and the end-of-text token)")
if not 0 <= args.min_lr <= args.lr or args.warmup < 0 or args.save_every < 0 or args.keep < 2:
    p.error("need 0 <= --min-lr <= --lr, --warmup >= 0, --save-every >= 0, --keep >= 2")
if args.text and (missing := [f for f in args.text if not os.path.isfile(f)]):
    p.error(f"--text: no such file {missing[0]}")
if args.model_path and not os.path.isfile(os.path.join(args.model_path, "config.json")):
    p.error(f"--model-path: no config.json in {args.model_path}")
if args.max_steps is not None and not 0 <= args.warmup < args.max_steps:
    p.error(f"--warmup must be less than --max-steps {args.max_steps} (else no decay)")
if args.eval_sequences is not None and args.eval_sequences < 1:
    p.error("--eval-sequences must be >= 1")
on_gpu = torch.cuda.is_available() and os.environ.get("COURSE_DEVICE", "") != "cpu"
if args.cpu_offload and not on_gpu:
    p.error("--cpu-offload needs a GPU: FSDP2's CPUOffloadPolicy pins host memory for "
            "copies to an accelerator")
if args.tensorboard:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        p.error("--tensorboard needs the tensorboard package (pip install tensorboard); "
                "metrics.jsonl holds the same numbers")

env = setup(args.timeout or (None if args.preset == "cpu-tiny" and not args.model_path
                             else 1800), cpu_collectives=args.cpu_offload)
out = Path(args.out)
bf16 = args.precision == "bf16" or (args.precision == "auto" and env.device.type == "cuda")
accum = args.batch_size // (env.world_size * args.micro_batch)  # micro-batches per step

# ---- data: every rank reads the same cached tokens (the first rank of each node builds them)
tokenizer = None
if args.model_path:
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(args.model_path)
folder = corpus.prepare_on_ranks(env.local_rank, args.data_dir, args.vocab_size,
                                 tokenizer=tokenizer, files=args.text)
# (sequences, seq_len) views of the token files, mapped: no rank reads more than it uses
train_data, heldout = corpus.load(folder, args.seq_len)
facts = corpus.facts(folder)
# --eval-sequences first: the baseline is scored on the same targets as the model's held-out
# loss (and, at scale, not on every held-out token by every rank: 5% of a 10 GB corpus is ~1 GB
# of int64 ids per rank)
heldout = heldout[:args.eval_sequences]
facts["unigram_loss"] = corpus.unigram_loss(folder, heldout)
steps_per_epoch = len(train_data) // args.batch_size
if steps_per_epoch == 0:
    raise SystemExit(f"train_llama.py: --batch-size {args.batch_size} is more than the "
                     f"{len(train_data)} training sequences")
if len(heldout) == 0:
    raise SystemExit(f"train_llama.py: no held-out sequences at --seq-len {args.seq_len} (the "
                     f"held-out text has {facts['heldout_tokens']} tokens)")
max_steps = args.max_steps or max(1, round(args.epochs * steps_per_epoch))
if args.warmup >= max_steps:
    raise SystemExit(f"train_llama.py: --warmup {args.warmup} leaves no decay in {max_steps} "
                     f"steps; use a smaller --warmup")


@functools.lru_cache(maxsize=1)
def permutation(epoch: int) -> torch.Tensor:
    return torch.randperm(len(train_data), generator=torch.Generator().manual_seed(
        args.seed * 100_003 + epoch))


def batch_of(step: int) -> torch.Tensor:
    """This rank's sequences of a step: the epoch's shuffled order (the same on every rank and
    for every world size) cut into global batches, and each global batch into one slice per
    rank. Depends on nothing but the step, so a resumed run reads exactly what it would have."""
    epoch, i = divmod(step, steps_per_epoch)
    ids = permutation(epoch)[i * args.batch_size:(i + 1) * args.batch_size].view(env.world_size, -1)[env.rank]
    return train_data[ids].long()


# ---- model: built once on rank 0 (seeded, or loaded), empty shells elsewhere, then sharded
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

hf_logging.disable_progress_bar()  # rank 0's own bar is enough

if args.model_path:
    config = AutoConfig.from_pretrained(args.model_path)
else:
    eos = facts["eos_id"]  # the tokenizer's end-of-text: generate() stops there, not at id 2
    config = LlamaConfig(vocab_size=facts["vocab_size"], max_position_embeddings=args.seq_len,
                         rms_norm_eps=1e-5, bos_token_id=eos, eos_token_id=eos,
                         pad_token_id=eos, **PRESETS[args.preset])
# use_cache=True (LlamaConfig's default) makes every forward build a DynamicCache of K and V,
# copied with torch.cat, for nothing: training never generates. (The export turns it back on.)
config.use_cache = False
full_state = {}
if env.rank == 0:  # the only full copy, in host memory: any world size starts from these weights
    if args.model_path:
        full = AutoModelForCausalLM.from_pretrained(args.model_path, config=config,
                                                    dtype=torch.float32)
    else:
        torch.manual_seed(args.seed)
        full = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    full_state = full.state_dict()
with torch.device("meta"):  # shapes only: no memory, no random numbers
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
if args.ac != "none":  # before sharding, as in chapter 04
    # HF wraps each decoder layer's call in torch.utils.checkpoint.checkpoint with these kwargs
    # (transformers modeling_utils.py, _activation_checkpointing_enable). Selective: a policy
    # says, op by op, what to keep for backward (torch/utils/checkpoint.py,
    # create_selective_checkpoint_contexts): chapter 03's memory.SAC_POLICY keeps the outputs
    # of the matmuls and of attention (the FLOPs), and recomputes the rest (RMSNorm, SiLU,
    # rotary, adds: cheap, but most of the bytes), as torchtitan's op-level SAC does.
    kwargs = {"use_reentrant": False}
    if args.ac == "selective":
        kwargs["context_fn"] = memory.sac_context_fn()
    model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
if args.compile:  # each decoder layer on its own (they share code, so one graph serves all)
    for layer in model.model.layers:
        layer.compile(backend=args.compile)
fsdp = {"reshard_after_forward": bool(args.reshard_after_forward)}
if args.replicate > 1:  # HSDP: a 2-D mesh, rows replicate, columns shard (chapter 04)
    # init_device_mesh numbers row-major: rank r is in replica r // S at shard r % S, so with
    # torchrun's consecutive ranks per node and N = nodes, each node holds one whole replica.
    fsdp["mesh"] = init_device_mesh(env.device.type, (args.replicate,
                                    env.world_size // args.replicate),
                                    mesh_dim_names=("replicate", "shard"))
if bf16:  # compute in bf16; parameters (AdamW's copy) and gradient reductions stay fp32
    fsdp["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
if args.cpu_offload:
    fsdp["offload_policy"] = CPUOffloadPolicy()
for layer in model.model.layers:
    fully_shard(layer, **fsdp)
fully_shard(model, **fsdp)  # the root: embeddings, final norm, lm_head (tied or not)
model.to_empty(device="cpu" if args.cpu_offload else env.device)  # allocate this rank's shards
set_model_state_dict(model, full_state, options=StateDictOptions(  # rank 0 sends each its shard
    full_state_dict=True, broadcast_from_rank0=True))
# to_empty left the buffers that no state dict holds uninitialised: the rotary embedding's
# inv_freq (chapter 04's trap). Build that module again, from the config.
model.model.rotary_emb = type(model.model.rotary_emb)(config).to(env.device)
full = full_state = None  # rank 0's full copy is not needed any more: free its host memory

# AdamW without weight decay on norms and biases (1-D tensors), as in GPT-2/Llama recipes
decay = [q for q in model.parameters() if q.ndim >= 2]
no_decay = [q for q in model.parameters() if q.ndim < 2]
optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                               {"params": no_decay, "weight_decay": 0.0}],
                              lr=args.lr, betas=tuple(args.betas), fused=env.device.type == "cuda")


def lr_at(step: int) -> float:
    """Linear warm-up to --lr over --warmup steps, then cosine decay to --min-lr at the last
    step (steps count from 0)."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, max_steps - 1 - args.warmup)
    return args.min_lr + 0.5 * (args.lr - args.min_lr) * (1 + math.cos(math.pi * min(1., progress)))


# ---- what a step costs, for MFU: 6 FLOPs per matmul weight and token (forward 2, backward 4)
# plus attention's, 12 L H Q T (PaLM's appendix B; distkit.memory)
flops_per_token = memory.flops_per_token(config, args.seq_len)
peak = None
if env.device.type == "cuda":
    name = torch.cuda.get_device_name()
    peak = (args.peak_tflops * 1e12 if args.peak_tflops else
            speed.peak_bf16(name))  # the datasheet's dense bf16 peak (distkit/speed.py)
    if peak is None:
        print0(f"no peak FLOP/s known for {name}: MFU n/a (give --peak-tflops)")


@torch.no_grad()
def evaluate() -> float:
    """Mean next-token cross-entropy over every held-out sequence, whatever the world size:
    each rank sums its share's token losses and counts, and the sums are all-reduced. Ranks
    with fewer sequences run padding batches (weight 0): FSDP2 needs every rank in every
    forward, for its all-gathers."""
    model.eval()
    mine = heldout[env.rank::env.world_size]
    batches = math.ceil(math.ceil(len(heldout) / env.world_size) / args.micro_batch)
    total = torch.zeros(2, dtype=torch.float64, device=env.device)  # loss sum, token count
    for b in range(batches):
        x = mine[b * args.micro_batch:(b + 1) * args.micro_batch].long().to(env.device)
        if len(x) == 0:
            x = heldout[:1].long().to(env.device)
        logits = model(input_ids=x).logits.float()
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), x[:, 1:].flatten(), reduction="sum")
        if b * args.micro_batch < len(mine):
            total += torch.stack([loss.double(), torch.tensor(x[:, 1:].numel(), device=env.device)])
    dist.all_reduce(total)
    model.train()
    return (total[0] / total[1]).item()


class Progress:
    """Where the run is, for DCP (Stateful). The settings that decide the data order and the
    schedule are saved too: resuming with others would silently train a different run."""

    def __init__(self):
        self.step, self.tokens = 0, 0
        self.run = {"--batch-size": args.batch_size, "--seq-len": args.seq_len,
                    "--max-steps": max_steps, "--lr": args.lr, "--min-lr": args.min_lr,
                    "--warmup": args.warmup, "--seed": args.seed, "data": folder.name}

    def state_dict(self):
        return {"step": self.step, "tokens": self.tokens, "run": dict(self.run)}  # copies

    def load_state_dict(self, state):
        if changed := [f"{k} {v} (now {self.run[k]})" for k, v in state["run"].items()
                       if self.run.get(k) != v]:
            raise SystemExit("train_llama.py: the checkpoint's run had " + ", ".join(changed))
        self.step, self.tokens = state["step"], state["tokens"]


progress = Progress()
state = {"app": AppState(model, optimizer), "progress": progress}
ckpt = CheckpointDir(out / "checkpoints", keep=args.keep)  # on a signal, saved in any case
metrics_path = out / "metrics.jsonl"
if args.resume and (start := ckpt.latest()):
    dcp.load(state, checkpoint_id=start)  # each rank reads the pieces of its own shards
    print0(f"resumed from {start.name}: step {progress.step} of {max_steps}")
    if env.rank == 0 and metrics_path.exists():  # forget what was logged after the checkpoint
        rows = [r for r in metrics_path.read_text().splitlines()
                if json.loads(r)["step"] <= progress.step]
        metrics_path.write_text("".join(r + "\n" for r in rows))
elif env.rank == 0:
    out.mkdir(parents=True, exist_ok=True)
    metrics_path.unlink(missing_ok=True)
if env.rank == 0:  # written when a signal stops the run (train_llama.sbatch requeues on it)
    (out / "stopped.json").unlink(missing_ok=True)


# --async-save: the save's own collectives (plans, final barrier) run in a background thread
# while the step runs FSDP's; a process group of their own keeps the two apart (chapter 05;
# async_save needs a CPU backend, gloo, even where training uses NCCL).
ckpt_group = dist.new_group(backend="gloo") if args.async_save else None
uploading = []  # (step, future) of the save being written in the background, if any


def finish_save():
    """Wait for the background save (if any) and commit it: only then is it "latest"."""
    if uploading:
        step, future = uploading.pop()
        future.result()
        ckpt.commit(step, world_size=env.world_size)


def save():
    finish_save()  # one upload at a time: the previous one is sealed before the next begins
    folder = ckpt.begin(progress.step)
    if args.async_save:  # returns once this rank's state is copied to host memory
        uploading.append((progress.step, dcp.async_save(state, checkpoint_id=folder,
                                                        process_group=ckpt_group)))
    else:
        dcp.save(state, checkpoint_id=folder)  # every rank writes its own shards, in parallel
        ckpt.commit(progress.step, world_size=env.world_size)


# Preemption: Slurm sends SIGTERM at the time limit (earlier with sbatch --signal=TERM@SECONDS),
# and torchrun passes SIGTERM on to its ranks (SIGUSR1 only with --signals-to-handle: else it
# kills torchrun). The handler only raises a flag; the loop agrees on it across ranks, saves a
# checkpoint and stops.
stop_signal = []
for sig in (signal.SIGTERM, signal.SIGUSR1):
    signal.signal(sig, lambda signum, frame: stop_signal.append(signal.Signals(signum).name))

log, tb = None, None
if env.rank == 0:
    log = metrics_path.open("a")
    if args.tensorboard:
        tb = SummaryWriter(out / "tensorboard", purge_step=progress.step + 1)
print0(f"{config.model_type} {args.preset if not args.model_path else args.model_path}: "
       f"{sum(q.numel() for q in model.parameters()):,} parameters, {env.world_size} rank(s) on "
       f"{env.device.type}, {'bf16' if bf16 else 'fp32'}; {len(train_data)} training "
       f"sequences of {args.seq_len} tokens"
       + (f"; HSDP: {args.replicate} replicas x {env.world_size // args.replicate} shards"
          if args.replicate > 1 else ""))
# What the run is, in the units every option uses: an optimizer step is --batch-size sequences
# (all ranks), which each rank runs as `accum` micro-batches (forward + backward) of its share.
print0(f"this run: {max_steps} optimizer steps x {args.batch_size} sequences = "
       f"{max_steps * args.batch_size / len(train_data):.3g} epoch(s) over "
       f"{len(train_data) * args.seq_len:,} training tokens; a step = {accum} micro-batch(es) "
       f"of {args.micro_batch} sequences on each of {env.world_size} rank(s)")


def record(row: dict):
    if log:
        log.write(json.dumps(row) + "\n")
        log.flush()
        for k, v in row.items():
            if tb and isinstance(v, (int, float)) and k != "step":
                tb.add_scalar(k, v, row["step"])


bar = None
if env.rank == 0 and not args.no_progress:
    from tqdm import tqdm
    bar = tqdm(total=max_steps, initial=progress.step, file=sys.stdout, mininterval=2,
               dynamic_ncols=True, desc="train")
if progress.step == 0:
    record({"step": 0, "eval_loss": evaluate(), "unigram_loss": facts["unigram_loss"]})

def log_row(loss: float, lr: float, gnorm: float, last: bool):
    """A metrics row (and the held-out loss when due): the only place that gathers memory."""
    seconds = window["seconds"] / window["steps"]  # per step, over the steps since the last row
    row = {"step": progress.step, "loss": loss, "lr": lr, "grad_norm": gnorm,
           "tokens": progress.tokens, "tokens_per_s": args.batch_size * args.seq_len / seconds,
           "step_s": seconds}
    window.update(steps=0, seconds=0.0)
    if peak:
        row["mfu"] = flops_per_token * row["tokens_per_s"] / (peak * env.world_size)
    # memory per rank: the CUDA caching allocator's peak since the last row on GPU, the
    # process's resident memory (everything: Python, torch, buffers) on CPU
    if env.device.type == "cuda":
        mine = torch.cuda.max_memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    else:
        mine = psutil.Process().memory_info().rss
    per_rank = torch.zeros(env.world_size, device=env.device)
    dist.all_gather_single(per_rank, torch.tensor([mine / 2**20], device=env.device))
    row["mem_mib"] = [round(m, 1) for m in per_rank.tolist()]
    if progress.step % args.eval_every == 0 or last:
        row["eval_loss"] = evaluate()
        row["eval_ppl"] = math.exp(row["eval_loss"])
        msg = (f"step {progress.step}: eval loss {row['eval_loss']:.3f} (perplexity "
               f"{row['eval_ppl']:.1f}; unigram baseline {facts['unigram_loss']:.3f})")
        bar.write(msg) if bar else print0(msg)
    record(row)
    if bar:
        bar.update(progress.step - bar.n)
        bar.set_postfix({"loss": f"{loss:.3f}", "lr": f"{lr:.2e}", "gnorm": f"{gnorm:.2f}",
                         "tok/s": f"{row['tokens_per_s']:.0f}",
                         "mfu": f"{row['mfu']:.1%}" if "mfu" in row else "n/a"}, refresh=False)


model.train()
stop = False
# A test's fault injection (not an option): the loss of this step becomes NaN.
nan_at = int(os.environ.get("TRAIN_LLAMA_NAN_AT_STEP", 0))
window = {"steps": 0, "seconds": 0.0}  # since the last metrics row
while progress.step < max_steps:
    t0 = time.perf_counter()
    lr = lr_at(progress.step)
    for group in optimizer.param_groups:
        group["lr"] = lr
    tokens = batch_of(progress.step).to(env.device)
    loss_sum = torch.zeros((), device=env.device)
    for i, x in enumerate(tokens.split(args.micro_batch)):
        # reduce-scatter the gradients only after the last micro-batch (chapter 04). Until then
        # every rank holds unsharded fp32 gradients of the whole model (4 bytes x parameters);
        # --sync-every-microbatch trades that memory for a reduce-scatter per micro-batch.
        model.set_requires_gradient_sync(args.sync_every_microbatch or i == accum - 1)
        if args.replicate > 1:  # HSDP: reduce-scatter per micro-batch if asked, but the
            model.set_requires_all_reduce(i == accum - 1)  # all-reduce across nodes once a step
        loss = model(input_ids=x, labels=x).loss / accum  # mean over this rank's share
        if progress.step + 1 == nan_at:
            loss = loss * float("nan")
        loss.backward()
        loss_sum += loss.detach()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip or float("inf"))
    if isinstance(grad_norm, DTensor):
        grad_norm = grad_norm.full_tensor()
    # One small all-reduce and one host sync per step, for what every rank must agree on: the
    # mean loss, "stop?" and the gradient norm (the same on every rank; summed, then divided).
    stop_flag = torch.tensor(float(bool(stop_signal)), device=env.device)
    # (with --cpu-offload the gradients, so their norm, live on the CPU: brought to the GPU)
    shared = torch.stack([loss_sum, stop_flag, grad_norm.float().to(env.device)])
    dist.all_reduce(shared)
    loss, stop, gnorm = shared.tolist()
    loss, stop, gnorm = loss / env.world_size, stop > 0, gnorm / env.world_size
    if not (math.isfinite(loss) and math.isfinite(gnorm)):
        # Before optimizer.step: a NaN gradient would make every weight NaN, and a save would
        # then push the good checkpoints out (--keep). So: no step, no save, exit status 3.
        finish_save()  # an earlier save still uploading is good: seal it
        newest = ckpt.latest()
        print0(f"train_llama.py: non-finite loss {loss} or gradient norm {gnorm} at step "
               f"{progress.step + 1}: stopped without saving; newest good checkpoint: "
               f"{newest.name if newest else 'none'}", file=sys.stderr)
        if log:
            log.close()
        dist.destroy_process_group()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(3)  # as distkit's teardown(), with the failure's status
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    progress.step += 1
    progress.tokens += args.batch_size * args.seq_len
    window["steps"] += 1
    window["seconds"] += time.perf_counter() - t0
    last = progress.step == max_steps
    if last or stop or progress.step % args.log_every == 0 or progress.step % args.eval_every == 0:
        log_row(loss, lr, gnorm, last)
    if stop or (args.save_every and progress.step % args.save_every == 0):
        save()
    if stop:
        finish_save()  # the job is about to end: the checkpoint must be complete
        if env.rank == 0:
            (out / "stopped.json").write_text(json.dumps(
                {"signal": stop_signal[0] if stop_signal else "another rank's",
                 "step": progress.step}))
        print0(f"stopped by {stop_signal[0] if stop_signal else 'a signal on another rank'} "
               f"after step {progress.step}; checkpoint saved: run again with --resume")
        break
finish_save()

if bar:
    bar.close()
if not stop and not args.no_export:  # a Hugging Face folder: from_pretrained + generate read it
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                cpu_offload=True))
    if env.rank == 0:
        with torch.device("meta"):
            export = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        export.load_state_dict(full, assign=True)
        export.tie_weights()
        export.config.use_cache = True  # for generate(): the KV cache is what inference wants
        export.save_pretrained(out / "hf")
        (tokenizer or corpus.tokenizer(folder)).save_pretrained(out / "hf")
        print0(f"exported to {out / 'hf'}")
if log:
    log.close()
if tb:
    tb.close()
teardown()

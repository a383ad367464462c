"""Chapter 06's capstone: train a transformers Llama with FSDP2, from one CPU process to GPU nodes.

    code/run_w_torchrun.sh 2 ch06_capstone/train_llama.py --max-steps 100 --out build/ch06/run
    code/run_w_torchrun.sh 8 ch06_capstone/train_llama.py --preset llama-1b --data /data/*.jsonl \
        --vocab-size 32000 --seq-len 2048 --batch-size 256 --micro-batch 4 --eval-sequences 512 \
        --save-every 500 --out /scratch/run1 --resume

One file, one loop, no framework: everything chapters 01-05 taught, in the order a step needs
it. The model is a transformers LlamaForCausalLM built from a preset config (or loaded with
from_pretrained from --model-path), initialised once on rank 0 and handed out shard by shard;
build_model, apply_ac, apply_compile and apply_fsdp below shape it in torchtitan's order. The
data is Python's reference documentation (or your --data: text, JSONL, Parquet, a saved
dataset), tokenized with a BPE trained on it (corpus.py). A step is --batch-size sequences: each
rank runs --micro-batch sequences at a time, accumulating gradients until its share is done,
then clips them and takes an AdamW step with a warm-up + cosine learning rate. Every
--eval-every steps it measures the held-out loss; every --save-every steps it writes a
Distributed Checkpoint, from which --resume continues where the run stopped (on another number
of ranks too); SIGTERM or SIGUSR1 (a preemption, a Slurm time limit) make it save and stop
cleanly. At the end it exports a Hugging Face folder (model + tokenizer) that from_pretrained
and generate() read.

What it writes to --out: metrics.jsonl (one line per step and per evaluation), run.json (the
settings in effect and what one step did: collectives, gradient norms), checkpoints/, hf/ (the
export), stopped.json or failed.json (why a run ended early), with --profile-step a trace per
rank in profile/, and with --tensorboard the metrics as TensorBoard events; .lock while it runs
(one run per folder). A bad update (a non-finite loss, norm or saved value, a loss spike) is
never committed: the run stops with exit status 3 (guard.py). Needs torch >= 2.11.
"""
import argparse
import contextlib
import functools
import json
import math
import os
import re
import shutil
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import torch

# First, before any import an older torch lacks (torch.distributed.fsdp's fully_shard came in 2.6)
TORCH = tuple(int(v) for v in re.match(r"(\d+)\.(\d+)", torch.__version__).groups())
if TORCH < (2, 11):
    sys.exit(f"train_llama.py: needs torch >= 2.11 (FSDP2, DCP's async stager); this is torch "
             f"{torch.__version__}: pip install 'torch>=2.11' (the course pins 2.13.0)")

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     set_model_state_dict)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import (CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy,
                                    fully_shard)
from torch.distributed.tensor import DTensor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # corpus.py, next to this file
import corpus  # noqa: E402
import guard  # noqa: E402  (guard.py: the lock, the LR schedule, the loss-spike guard)
from distkit import memory, print0, setup, speed, teardown  # noqa: E402
from distkit.ckpt import AppState, CheckpointDir, Stager, own_files, step_of  # noqa: E402
from distkit.comm import CollectiveLog  # noqa: E402

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


def parse_args(argv=None) -> argparse.Namespace:
    """Every option, checked: bad input ends here with one line and exit status 2, before any
    process group exists."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    group = parser.add_argument_group("model")
    group.add_argument("--preset", choices=PRESETS, default="cpu-tiny",
                       help="architecture to build (default %(default)s)")
    group.add_argument("--model-path", metavar="DIR", help="a local Hugging Face folder "
                       "(config, weights, tokenizer) to fine-tune instead of a preset")
    group = parser.add_argument_group("data")
    group.add_argument("--data", "--text", nargs="+", metavar="PATH", help="train on your data "
                       "instead of Python's reference docs: text files (one document each), "
                       "JSON Lines (.jsonl: a document per line), Parquet files or folders "
                       "saved by datasets (a document per row; need pyarrow / datasets)")
    group.add_argument("--text-field", metavar="NAME", default="text",
                       help="the records' text field or column (default %(default)s)")
    group.add_argument("--data-dir", metavar="DIR", default="build/ch06/data",
                       help="tokenizer and token cache (default %(default)s); on a cluster, a "
                            "folder every node sees")
    group.add_argument("--vocab-size", type=int, metavar="N", default=2048,
                       help="BPE vocabulary to train (default %(default)s)")
    group.add_argument("--seq-len", type=int, metavar="N", default=128,
                       help="tokens per packed sequence (default %(default)s)")
    group = parser.add_argument_group("FSDP2")
    group.add_argument("--reshard-after-forward", type=int, choices=[0, 1], default=1,
                       help="1 (default): free each gathered layer after forward (ZeRO-3); "
                            "0: keep it until backward (ZeRO-2-like)")
    group.add_argument("--precision", choices=["auto", "fp32", "bf16"], default="auto",
                       help="bf16: compute in bf16, fp32 weights in AdamW and fp32 gradient "
                            "reductions; auto (default): bf16 on GPU, fp32 on CPU")
    group.add_argument("--cpu-offload", action="store_true",
                       help="keep shards, gradients and AdamW state in host memory (GPU only)")
    group.add_argument("--ac", choices=["none", "selective", "full"], default="none",
                       help="activation checkpointing of each decoder layer: full recomputes "
                            "all of its forward in backward; selective keeps the matmul and "
                            "attention outputs and recomputes the cheap rest (norms, "
                            "activations, rotary); default none")
    group.add_argument("--replicate", type=int, metavar="N", default=1,
                       help="HSDP: N replicas of a model sharded over WORLD_SIZE/N ranks (e.g. "
                            "N = nodes: the all-gathers and reduce-scatters stay within a "
                            "node, one gradient all-reduce crosses nodes); default 1: shard "
                            "over all ranks")
    group.add_argument("--compile", nargs="?", const="inductor", metavar="BACKEND",
                       help="torch.compile each decoder layer (default backend inductor; "
                            "aot_eager traces without generating kernels)")
    group = parser.add_argument_group("optimisation")
    group.add_argument("--batch-size", type=int, metavar="N", default=16,
                       help="sequences per optimizer step, all ranks together (default "
                            "%(default)s)")
    group.add_argument("--micro-batch", type=int, metavar="N", default=8,
                       help="sequences per forward, per rank (default %(default)s); "
                            "accumulation steps = batch-size / (micro-batch x ranks)")
    group.add_argument("--sync-every-microbatch", action="store_true",
                       help="reduce-scatter gradients after every micro-batch: more "
                            "communication, but no unsharded gradients of the whole model kept "
                            "between micro-batches")
    group.add_argument("--max-steps", type=int, metavar="N",
                       help="optimizer steps to train (default: --epochs passes over the data); "
                            "--warmup and the --*-every options count optimizer steps too, "
                            "never micro-batches")
    group.add_argument("--epochs", type=float, default=1.0,
                       help="passes over the training sequences, when --max-steps is not given "
                            "(default %(default)s)")
    group.add_argument("--lr", type=float, default=3e-3,
                       help="peak learning rate (default %(default)s)")
    group.add_argument("--min-lr", type=float, default=3e-4,
                       help="learning rate at the last step (default %(default)s)")
    group.add_argument("--warmup", type=int, metavar="STEPS", default=20,
                       help="optimizer steps of linear warm-up (default %(default)s)")
    group.add_argument("--weight-decay", type=float, default=0.1,
                       help="AdamW's, on matrices only (default %(default)s)")
    group.add_argument("--betas", type=float, nargs=2, default=(0.9, 0.95), metavar=("B1", "B2"),
                       help="AdamW's (default 0.9 0.95)")
    group.add_argument("--clip", type=float, default=1.0,
                       help="max global gradient norm, 0 for none (default %(default)s)")
    group.add_argument("--seed", type=int, default=0,
                       help="initial weights and data order (default 0)")
    group = parser.add_argument_group("evaluation, checkpoints, output")
    group.add_argument("--out", metavar="DIR", default="build/ch06/run",
                       help="metrics, checkpoints and the export go here (default %(default)s)")
    group.add_argument("--eval-every", type=int, metavar="STEPS", default=50,
                       help="optimizer steps between held-out evaluations (default %(default)s)")
    group.add_argument("--eval-sequences", type=int, metavar="N",
                       help="evaluate on the first N held-out sequences only (default: all; on "
                            "a large corpus set it, or every evaluation runs the whole held-out "
                            "5%%)")
    group.add_argument("--save-every", type=int, metavar="STEPS", default=0,
                       help="optimizer steps between checkpoints (default 0: only when stopped "
                            "by a signal). Step K's checkpoint is committed once every rank "
                            "found its saved shards finite and the next step's loss and "
                            "gradient norm are finite and no spike (and, with --async-save, "
                            "its upload is done): such a bad update never reaches the newest "
                            "checkpoint")
    group.add_argument("--keep", type=int, metavar="N", default=2,
                       help="checkpoints to keep (default %(default)s)")
    group.add_argument("--spike-factor", type=float, metavar="K", default=3.0,
                       help="a step whose loss is more than K x the mean of the last 20 "
                            "steps' is a bad update showing: its checkpoint is not committed "
                            "and the run stops (exit 3, failed.json); 0: off (default "
                            "%(default)s)")
    group.add_argument("--resume", action="store_true",
                       help="continue from the newest checkpoint in OUT/checkpoints (if there "
                            "are none: from step 0; if none checks out: refused, nothing "
                            "changed)")
    group.add_argument("--resume-from", type=int, metavar="STEP",
                       help="--resume from the committed checkpoint of STEP, not the newest "
                            "(to get past a bad region; newer checkpoints go at the next save)")
    group.add_argument("--change-schedule", action="store_true",
                       help="with --resume: accept another --lr, --min-lr or --warmup than the "
                            "checkpoint's run had (else refused); run.json records the change")
    group.add_argument("--overwrite", action="store_true",
                       help="start from step 0 although OUT holds a previous run: its "
                            "metrics, checkpoints and export are deleted (without --resume or "
                            "this, such a run refuses to start)")
    group.add_argument("--async-save", action="store_true",
                       help="write checkpoints in a background thread (dcp.async_save): the "
                            "step waits for the copy to host memory only (pinned and reused on "
                            "a GPU); the upload, and the read-back + sha256 of the commit, run "
                            "in other threads; the commit itself comes at the first step after "
                            "every rank's upload is done")
    group.add_argument("--log-every", type=int, metavar="STEPS", default=1,
                       help="optimizer steps between metrics rows (default 1); the loss and the "
                            "stop flag are shared every step anyway, memory is gathered only "
                            "when logging")
    group.add_argument("--profile-step", type=int, metavar="STEP",
                       help="record optimizer step STEP with torch.profiler: a trace per rank, "
                            "OUT/profile/rankR.pt.trace.json (Perfetto, chrome://tracing)")
    group.add_argument("--no-export", action="store_true",
                       help="skip the Hugging Face export at the end")
    group.add_argument("--tensorboard", action="store_true",
                       help="also log to OUT/tensorboard/ (needs the tensorboard package)")
    group.add_argument("--peak-tflops", type=float, metavar="TFLOPS",
                       help="this GPU's dense bf16 peak, for MFU, if it is not in the table")
    group.add_argument("--no-progress", action="store_true", help="no progress bar on rank 0")
    group.add_argument("--timeout", type=float, metavar="SECONDS", help="how long a rank waits "
                       "in a collective before failing (default: 60 s for cpu-tiny, else "
                       "1800 s: rank 0 alone builds a large model, saves, exports, while the "
                       "others wait)")
    args = parser.parse_args(argv)

    world = int(os.environ.get("WORLD_SIZE", 1))
    if min(args.batch_size, args.micro_batch, args.seq_len - 1, args.eval_every, args.log_every,
           args.replicate) < 1:
        parser.error("--batch-size, --micro-batch, --eval-every, --log-every and --replicate "
                     "must be >= 1, --seq-len >= 2")
    if world % args.replicate:
        parser.error(f"--replicate {args.replicate} must divide the {world} ranks")
    if args.batch_size % (world * args.micro_batch):
        parser.error(f"--batch-size {args.batch_size} must be a multiple of {world} ranks x "
                     f"--micro-batch {args.micro_batch}")
    if args.compile and args.ac != "none":
        parser.error("--compile with --ac: not combined in this script (never tested together "
                     "here; torchtitan wraps its blocks for AC first, then compiles them); "
                     "choose one")
    if args.vocab_size < 257 and not args.model_path:
        parser.error("--vocab-size must be >= 257 (the 256 bytes and the end-of-text token)")
    if not 0 <= args.min_lr <= args.lr or args.warmup < 0 or args.save_every < 0 or args.keep < 2:
        parser.error("need 0 <= --min-lr <= --lr, --warmup >= 0, --save-every >= 0, --keep >= 2")
    if args.data and (problem := corpus.check(args.data, args.text_field)):
        parser.error(f"--data: {problem}")
    if args.model_path and not os.path.isfile(os.path.join(args.model_path, "config.json")):
        parser.error(f"--model-path: no config.json in {args.model_path}")
    if args.max_steps is not None and not 0 <= args.warmup < args.max_steps:
        parser.error(f"--warmup must be less than --max-steps {args.max_steps} (else no decay)")
    if args.eval_sequences is not None and args.eval_sequences < 1:
        parser.error("--eval-sequences must be >= 1")
    if args.profile_step is not None and args.profile_step < 1:
        parser.error("--profile-step must be >= 1 (steps count from 1)")
    if args.cpu_offload and not on_gpu():
        parser.error("--cpu-offload needs a GPU: FSDP2's CPUOffloadPolicy pins host memory for "
                     "copies to an accelerator")
    args.resume = args.resume or args.resume_from is not None
    if args.change_schedule and not args.resume:
        parser.error("--change-schedule changes a resumed run's schedule: it needs --resume")
    if args.spike_factor < 0 or 0 < args.spike_factor <= 1:
        parser.error("--spike-factor must be 0 (off) or more than 1")
    if problem := guard.out_problem(Path(args.out), args.resume, args.overwrite):
        parser.error(f"--out {args.out}{problem}")  # (read-only, not a run of ours, in use)
    if args.tensorboard:
        try:
            import torch.utils.tensorboard  # noqa: F401
        except ImportError:
            parser.error("--tensorboard needs the tensorboard package (pip install "
                         "tensorboard); metrics.jsonl holds the same numbers")
    return args


def on_gpu() -> bool:
    return torch.cuda.is_available() and os.environ.get("COURSE_DEVICE", "") != "cpu"


# ---- the model, in torchtitan's order: build, activation checkpointing, compile, FSDP, weights

def build_model(config, model_path: str | None, seed: int, rank: int):
    """The model on the meta device (shapes only: no memory, no random numbers) and, on rank 0,
    its full weights in host memory (seeded, or from --model-path): the only full copy, so any
    world size starts from the same weights."""
    from transformers import AutoModelForCausalLM
    full_state = {}
    if rank == 0:
        if model_path:
            full = AutoModelForCausalLM.from_pretrained(model_path, config=config,
                                                        dtype=torch.float32)
        else:
            torch.manual_seed(seed)
            full = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        full_state = full.state_dict()
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model, full_state


def apply_ac(model, mode: str) -> None:
    """Activation checkpointing of each decoder layer, before sharding (chapter 04). HF wraps
    each layer's call in torch.utils.checkpoint.checkpoint with these kwargs (transformers
    modeling_utils.py, _activation_checkpointing_enable). Selective: a policy says, op by op,
    what to keep for backward (torch/utils/checkpoint.py, create_selective_checkpoint_contexts):
    chapter 03's memory.SAC_POLICY keeps the outputs of the matmuls and of attention (the
    FLOPs), and recomputes the rest (RMSNorm, SiLU, rotary, adds: cheap, but most of the
    bytes), as torchtitan's op-level SAC does."""
    kwargs = {"use_reentrant": False}
    if mode == "selective":
        kwargs["context_fn"] = memory.sac_context_fn()
    model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)


def apply_compile(model, backend: str) -> None:
    """torch.compile each decoder layer on its own (they share code: one graph serves all)."""
    for layer in model.model.layers:
        layer.compile(backend=backend)


def apply_fsdp(model, mesh, bf16: bool, reshard_after_forward: bool, cpu_offload: bool) -> dict:
    """fully_shard each decoder layer, then the root (embeddings, final norm, lm_head, tied or
    not): one all-gather per layer, not one for the whole model. Per micro-batch that is 2L + 1
    all-gathers with reshard_after_forward (each layer again in backward), L + 1 without; one
    reduce-scatter per unit whenever gradients sync. (Under HSDP with shards of one rank there
    is nothing to gather or scatter.) Returns the settings used."""
    fsdp = {"reshard_after_forward": reshard_after_forward}
    if mesh is not None:  # HSDP: a 2-D mesh, rows replicate, columns shard (chapter 04)
        fsdp["mesh"] = mesh
    if bf16:  # compute in bf16; parameters (AdamW's copy) and gradient reductions stay fp32
        fsdp["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                 reduce_dtype=torch.float32)
    if cpu_offload:
        fsdp["offload_policy"] = CPUOffloadPolicy()
    for layer in model.model.layers:
        fully_shard(layer, **fsdp)
    # The root is kept gathered after forward whatever the option: backward needs it at once
    # (lm_head first), so freeing it would only gather it again (torch's default for a root)
    fully_shard(model, **{**fsdp, "reshard_after_forward": False})
    return {"reshard_after_forward": reshard_after_forward, "units": len(model.model.layers) + 1,
            "mesh": list(mesh.shape) if mesh is not None else [dist.get_world_size()],
            "param_dtype": "bfloat16" if bf16 else "float32", "reduce_dtype": "float32",
            "cpu_offload": cpu_offload}


def load_weights(model, full_state: dict, config, device) -> None:
    """Allocate this rank's shards and fill them: rank 0 sends each rank its shard of the full
    weights. to_empty leaves the buffers that no state dict holds uninitialised, the rotary
    embedding's inv_freq (chapter 04's trap): that module is built again, from the config."""
    model.to_empty(device=device)
    set_model_state_dict(model, full_state, options=StateDictOptions(
        full_state_dict=True, broadcast_from_rank0=True))
    model.model.rotary_emb = type(model.model.rotary_emb)(config).to(device)


def build_optimizer(model, lr: float, betas, weight_decay: float, fused: bool):
    """AdamW without weight decay on norms and biases (1-D tensors), as in GPT-2/Llama recipes."""
    decay = [q for q in model.parameters() if q.ndim >= 2]
    no_decay = [q for q in model.parameters() if q.ndim < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}],
                             lr=lr, betas=tuple(betas), fused=fused)


# ---- start: the signal handler first, so that a preemption during a long start-up is seen
args = parse_args()
# one run per folder: global rank 0 locks OUT before anything is written (released at exit)
lock = guard.lock(Path(args.out)) if int(os.environ.get("RANK", 0)) == 0 else None
# Preemption: Slurm sends SIGTERM at the time limit (earlier with sbatch --signal=TERM@SECONDS),
# and torchrun passes SIGTERM on to its ranks (SIGUSR1 only with --signals-to-handle: else it
# kills torchrun). The handler only raises a flag; the loop agrees on it across ranks, saves a
# checkpoint and stops.
stop_signal = []
for sig in (signal.SIGTERM, signal.SIGUSR1):
    signal.signal(sig, lambda signum, frame: stop_signal.append(signal.Signals(signum).name))

env = setup(args.timeout or (None if args.preset == "cpu-tiny" and not args.model_path
                             else 1800), cpu_collectives=args.cpu_offload)
out = Path(args.out)
bf16 = args.precision == "bf16" or (args.precision == "auto" and env.device.type == "cuda")
accum = args.batch_size // (env.world_size * args.micro_batch)  # micro-batches per step
if env.rank == 0:
    out.mkdir(parents=True, exist_ok=True)
    if args.overwrite:  # asked for: the previous run's files go
        for name in ("checkpoints", "hf", "profile", "tensorboard"):
            shutil.rmtree(out / name, ignore_errors=True)
        (out / "metrics.jsonl").unlink(missing_ok=True)

# ---- data: global rank 0 builds the token cache once per job; every rank maps the same files
tokenizer = None
if args.model_path:
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(args.model_path)
folder = corpus.prepare_on_ranks(env.rank, args.data_dir, args.vocab_size, tokenizer=tokenizer,
                                 paths=args.data, field=args.text_field,
                                 stopped=lambda: bool(stop_signal))
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
    """The epoch's order: a seeded permutation of the sequence numbers, on every rank. int32:
    4 bytes a sequence (a 1T-token corpus of 2048-token sequences: ~2 GB per rank; beyond
    that, an index-space permutation such as a Feistel network computes each position instead
    of storing them all)."""
    return torch.randperm(len(train_data), dtype=torch.int32, generator=torch.Generator()
                          .manual_seed(args.seed * 100_003 + epoch))


def batch_of(step: int) -> torch.Tensor:
    """This rank's sequences of a step: the epoch's shuffled order (the same on every rank and
    for every world size) cut into global batches, and each global batch into one slice per
    rank. Depends on nothing but the step, so a resumed run reads exactly what it would have."""
    epoch, i = divmod(step, steps_per_epoch)
    ids = permutation(epoch)[i * args.batch_size:(i + 1) * args.batch_size]
    return train_data[ids.view(env.world_size, -1)[env.rank].long()].long()


# ---- model
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
model, full_state = build_model(config, args.model_path, args.seed, env.rank)
if args.ac != "none":
    apply_ac(model, args.ac)
if args.compile:
    apply_compile(model, args.compile)
mesh = None
if args.replicate > 1:  # HSDP. init_device_mesh numbers row-major: rank r is in replica r // S
    # at shard r % S, so with torchrun's consecutive ranks per node and N = nodes, each node
    # holds one whole replica.
    mesh = init_device_mesh(env.device.type, (args.replicate, env.world_size // args.replicate),
                            mesh_dim_names=("replicate", "shard"))
fsdp = apply_fsdp(model, mesh, bf16, bool(args.reshard_after_forward), args.cpu_offload)
load_weights(model, full_state, config, "cpu" if args.cpu_offload else env.device)
full_state = None  # rank 0's full copy is not needed any more: free its host memory
optimizer = build_optimizer(model, args.lr, args.betas, args.weight_decay,
                            fused=env.device.type == "cuda")


def lr_at(step: int) -> float:
    """Linear warm-up to --lr over --warmup steps, then cosine decay to --min-lr at the last
    step (steps count from 0; guard.py)."""
    return guard.lr_at(step, args.lr, args.min_lr, args.warmup, max_steps)


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
    # A forward without backward leaves gathered what is not resharded after forward (the
    # root; with --reshard-after-forward 0 every layer): free it, as a backward would have.
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
    model.train()
    return (total[0] / total[1]).item()


class Progress:
    """Where the run is, for DCP (Stateful). The settings that decide the data order and the
    schedule are saved too: resuming with others would silently train a different run. The data
    is named by what it is (the tokenizer's hash and the token count), not where it lies: a
    corpus staged elsewhere resumes."""

    def __init__(self):
        self.step, self.tokens = 0, 0
        self.run = {"--batch-size": args.batch_size, "--seq-len": args.seq_len,
                    "--max-steps": max_steps, "--lr": args.lr, "--min-lr": args.min_lr,
                    "--warmup": args.warmup, "--seed": args.seed,
                    "data": f"tokenizer {facts['tokenizer_sha256'][:12]}, "
                            f"{facts['train_tokens']} training tokens",
                    "model": ", ".join(f"{k} {getattr(config, k, None)}" for k in (
                        "hidden_size", "intermediate_size", "num_hidden_layers",
                        "num_attention_heads", "num_key_value_heads", "vocab_size"))}
        self.changed = {}  # --change-schedule: what the checkpoint's run had, where it differs

    def state_dict(self):
        return {"step": self.step, "tokens": self.tokens, "run": dict(self.run)}  # copies

    def load_state_dict(self, state):
        changed = {k: v for k, v in state["run"].items() if self.run.get(k) != v}
        if args.change_schedule:  # asked for: the schedule may change (recorded in run.json)
            self.changed = {k: changed.pop(k) for k in ("--lr", "--min-lr", "--warmup")
                            if k in changed}
        if changed:
            raise SystemExit("train_llama.py: the checkpoint's run had " + ", ".join(
                f"{k} {v} (now {self.run[k]})" for k, v in changed.items())
                + ("" if args.change_schedule else " (--change-schedule accepts another "
                   "--lr, --min-lr, --warmup)"))
        self.step, self.tokens = state["step"], state["tokens"]


progress = Progress()
state = {"app": AppState(model, optimizer), "progress": progress}
ckpt = CheckpointDir(out / "checkpoints", keep=args.keep)  # on a signal, saved in any case
metrics_path = out / "metrics.jsonl"
changes = guard.schedule_changes(out) if args.resume else []  # (read before any write)
if args.resume_from in [c.get("resumed_from", -1) for c in changes]:  # a requeue of that job:
    print0(f"--resume-from {args.resume_from}: done by an earlier attempt (run.json); "
           "resuming from the newest checkpoint")  # going back again would undo its work
    args.resume_from = None
if args.resume_from is not None:  # an older checkpoint, asked for by its step
    start = ckpt.path(args.resume_from)
    if start not in (have := ckpt.committed()):  # (each rank lists the shared folder)
        raise SystemExit(f"train_llama.py: --resume-from {args.resume_from}: no checkpoint of "
                         f"that step in {ckpt.root} (committed: "
                         f"{', '.join(str(step_of(p.name)) for p in have) or 'none'})")
    if why := ckpt.problem(start):  # collective: the same verdict on every rank
        raise SystemExit(f"train_llama.py: --resume-from {args.resume_from}: {start}: {why}")
    if moved := ckpt.set_aside_after(args.resume_from):  # a requeue must not resume past it
        print0(f"--resume-from {args.resume_from}: {', '.join(moved)} set aside as .old "
               "(removed at this run's first commit)")
else:  # the newest that checks out; refused (nothing changed) if there are some but none does
    start = ckpt.resume_point("train_llama.py") if args.resume else None
if start:
    # the run's settings and the model's shape first: another width fails here in one line
    dcp.load({"progress": progress}, checkpoint_id=start,
             planner=dcp.DefaultLoadPlanner(allow_partial_load=True))
    dcp.load({"app": state["app"]}, checkpoint_id=start)  # each rank: its own shards' pieces
    print0(f"resumed from {start.name}: step {progress.step} of {max_steps}")
    if env.rank == 0 and metrics_path.exists():  # forget what was logged after the checkpoint
        rows = [r for r in metrics_path.read_text().splitlines()
                if json.loads(r)["step"] <= progress.step]
        metrics_path.write_text("".join(r + "\n" for r in rows))
elif env.rank == 0:  # a fresh start (parse_args refused one over a previous run's files)
    metrics_path.unlink(missing_ok=True)
if env.rank == 0:  # why the last run ended early (the sbatch decides on a requeue from these):
    for name in ("stopped.json", "failed.json"):  # this run decides now (a refused --resume
        (out / name).unlink(missing_ok=True)      # above changed nothing, these included)

# What the run is, as it runs (rank 0 writes it): the settings in effect and, after this
# process's first step, what that step did (collectives by kind, gradient norms).
run_info = {"world_size": env.world_size, "device": env.device.type, "torch": torch.__version__,
            "micro_batches": accum, "sync_every_microbatch": args.sync_every_microbatch,
            "fsdp": fsdp, "ac": args.ac, "compile": args.compile, "clip": args.clip,
            "spike_factor": args.spike_factor, "schedule_changes": [],
            "adamw": [{"params": len(g["params"]), "betas": list(g["betas"]),
                       "weight_decay": g["weight_decay"]} for g in optimizer.param_groups]}


def write_run_info() -> None:
    if env.rank == 0:
        (out / "run.json").write_text(json.dumps(run_info, indent=1))


run_info["schedule_changes"] = changes if start else []  # the run's changes so far, kept
if progress.changed or args.resume_from is not None:  # from which step, what was, what is
    run_info["schedule_changes"].append(
        {"step": progress.step, "was": progress.changed,
         "now": {k: progress.run[k] for k in progress.changed},
         **({"resumed_from": args.resume_from} if args.resume_from is not None else {})})
    print0(f"--change-schedule at step {progress.step}: " + ", ".join(
        f"{k} {v} -> {progress.run[k]}" for k, v in progress.changed.items()))


write_run_info()

log, tb = None, None  # rank 0's metrics file (and TensorBoard), appended to on a resume
if env.rank == 0:
    log = metrics_path.open("a")
    if args.tensorboard:
        from torch.utils.tensorboard import SummaryWriter
        tb = SummaryWriter(out / "tensorboard", purge_step=progress.step + 1)

# ---- checkpoints. A save writes step K's state into step_K.tmp (dcp.save; or in the
# background, dcp.async_save); a thread then reads back and hashes this rank's files. It is
# committed (ckpt.commit: manifest, atomic rename) only at a later step's all-reduce that says
# (1) that step's loss and gradient norm are finite on every rank, so step K's update was not a
# bad one, and (2) every rank's files are written and hashed. A non-finite step discards it.
# --async-save: the save's own collectives (plans, final barrier) run in a background thread
# while the step runs FSDP's; a process group of their own keeps the two apart (chapter 05;
# async_save needs a CPU backend, gloo, even where training uses NCCL). One stager for the run
# keeps the host copy and refills it (pinned memory on a GPU). torch 2.11's DefaultStager fails
# when reused (pytorch/pytorch#183413): there, DCP's default staging (a fresh copy each save).
ckpt_group = dist.new_group(backend="gloo") if args.async_save else None
stager = Stager(env.device) if args.async_save and TORCH >= (2, 13) else None
hasher = ThreadPoolExecutor(max_workers=1)  # reads back and hashes the files a save wrote
pending = None  # the save not yet committed: {"step", "staged", "written", "checked", "bad"}
spikes = guard.SpikeGuard(args.spike_factor)  # a finite loss far above the recent ones


def save() -> None:
    global pending
    commit_pending()  # one save at a time (a pending save is checked by now: see the loop)
    folder = ckpt.begin(progress.step)
    # is every value this rank saves finite (weights, AdamW's moments)? Shared at the next
    # step's all-reduce: a NaN in the optimizer's state shows in no loss until it is used
    bad = guard.nonfinite(model, optimizer, env.device)
    staged = upload = None
    try:
        if args.async_save:  # returns once the host copy is under way
            response = dcp.async_save(state, checkpoint_id=folder, process_group=ckpt_group,
                                      async_stager=stager)
            staged, upload = ((response.staging_completion, response.upload_completion)
                              if stager else (None, response))
        else:
            dcp.save(state, checkpoint_id=folder)  # every rank writes its shards, in parallel
    except (Exception, dcp.api.CheckpointException) as e:
        save_failed(folder, e)

    def written():  # in the hasher's thread: the upload's end, then this rank's files hashed
        if upload is not None:
            upload.result()
        return own_files(folder)
    pending = {"step": progress.step, "staged": staged, "written": hasher.submit(written),
               "checked": False, "bad": bad}


def save_failed(folder: Path, e: BaseException) -> None:
    """A full or read-only disk is one line (and failed.json: a requeue would fail the same
    way)."""
    if not (why := guard.save_failure(folder, e)):
        raise e
    reason = "no-space" if why.startswith("No space") else "not-writable"
    if env.rank == 0:
        with contextlib.suppress(OSError):
            (out / "failed.json").write_text(json.dumps({"reason": reason, "step":
                                                         progress.step, "retry": False}))
    raise SystemExit(f"train_llama.py: {why}") from None


def commit_pending() -> None:
    """Commit the pending save (waiting for its files if needed; a collective)."""
    global pending
    if pending:
        try:
            pending["written"].result()  # (own_files() hashed them: commit() hashes no more)
        except (Exception, dcp.api.CheckpointException) as e:  # the upload failed
            save_failed(ckpt.path(pending["step"]).with_suffix(".tmp"), e)
        ckpt.commit(pending["step"], world_size=env.world_size)
        pending = None


def fail_nonfinite(loss: float, gnorm: float, step: int, why: str = "",
                   reason: str = "non-finite") -> None:
    """Every rank: the pending save holds the update that led here, so it goes; the newest
    committed checkpoint was followed by a finite step. Each rank exits with status 3 (torchrun
    then reports 1, whatever the ranks' codes): OUT/failed.json tells a batch script why."""
    global pending
    discarded = ""
    if pending and pending["checked"]:  # (an evaluation after a checked save: that save is good)
        commit_pending()
    if pending:
        with contextlib.suppress(Exception):
            pending["written"].result()  # its writes must end before its folder goes
        if env.rank == 0:
            shutil.rmtree(ckpt.path(pending["step"]).with_suffix(".tmp"), ignore_errors=True)
        dist.barrier()
        discarded = (f"step {pending['step']}'s save discarded (it may hold the update that "
                     "led here); ")
        pending = None
    newest = (ckpt.committed() or [None])[-1]  # (rank 0's listing is the one printed)
    why = ((why or f"non-finite loss {loss} or gradient norm {gnorm}") + f" at step {step}: "
           f"stopped before the optimizer step; {discarded}newest checkpoint: "
           f"{newest.name if newest else 'none'}")
    if env.rank == 0:
        (out / "failed.json").write_text(json.dumps(
            {"reason": reason, "step": step, "retry": False,
             "newest_checkpoint": newest.name if newest else None}))
    print0(f"train_llama.py: {why}; each rank exits with status 3", file=sys.stderr)
    if log:
        log.close()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(3)  # as distkit's teardown(), with the failure's status


# ---- logging
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


def record(row: dict) -> None:
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


def say(msg: str) -> None:
    if bar:
        bar.write(msg)
    else:
        print0(msg)


window = {"steps": 0, "seconds": 0.0}  # the steps since the last metrics row, and their time


def log_row(loss: float, lr: float, gnorm: float, last: bool) -> None:
    """A metrics row (and the held-out loss when due): the only place that gathers memory."""
    seconds = window["seconds"] / window["steps"]  # per step, over the steps since the last row
    row = {"step": progress.step, "loss": loss, "lr": lr, "grad_norm": gnorm,
           "tokens": progress.tokens, "tokens_per_s": args.batch_size * args.seq_len / seconds,
           "step_s": seconds}
    window.update(steps=0, seconds=0.0)
    if peak:
        row["mfu"] = flops_per_token * row["tokens_per_s"] / (peak * env.world_size)
    # memory per rank: the CUDA caching allocator's peak since the last row on GPU, the
    # process's resident memory (everything: Python, torch, buffers) on CPU. Each rank fills its
    # own slot; a sum over ranks gathers them (an all-reduce: every torch has it).
    if env.device.type == "cuda":
        mine = torch.cuda.max_memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    else:
        mine = psutil.Process().memory_info().rss
    per_rank = torch.zeros(env.world_size, device=env.device)
    per_rank[env.rank] = mine / 2**20
    dist.all_reduce(per_rank)
    row["mem_mib"] = [round(m, 1) for m in per_rank.tolist()]
    if progress.step % args.eval_every == 0 or last:
        row["eval_loss"] = evaluate()
        if not row["eval_loss"] < 700:  # NaN, inf, or past what exp() can hold: a bad update
            fail_nonfinite(loss, gnorm, progress.step + 1,
                           f"held-out loss {row['eval_loss']:.4g} after step {progress.step}")
        row["eval_ppl"] = math.exp(row["eval_loss"])
        say(f"step {progress.step}: eval loss {row['eval_loss']:.3f} (perplexity "
            f"{row['eval_ppl']:.1f}; unigram baseline {facts['unigram_loss']:.3f})")
    record(row)
    if bar:
        bar.update(progress.step - bar.n)
        bar.set_postfix({"loss": f"{loss:.3f}", "lr": f"{lr:.2e}", "gnorm": f"{gnorm:.2f}",
                         "tok/s": f"{row['tokens_per_s']:.0f}",
                         "mfu": f"{row['mfu']:.1%}" if "mfu" in row else "n/a"}, refresh=False)


if progress.step == 0:
    record({"step": 0, "eval_loss": evaluate(), "unigram_loss": facts["unigram_loss"]})


# ---- one step's work, in two parts that the loop (and the last save's check) call

def forward_backward(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's micro-batches of `step`, gradients accumulated; then clipped. Returns the
    summed loss and the gradient norm before clipping (on every rank the same)."""
    tokens = batch_of(step).to(env.device)
    loss_sum = torch.zeros((), device=env.device)
    for i, x in enumerate(tokens.split(args.micro_batch)):
        # reduce-scatter the gradients only after the last micro-batch (chapter 04). Until then
        # every rank holds unsharded fp32 gradients of the whole model (4 bytes x parameters);
        # --sync-every-microbatch trades that memory for a reduce-scatter per micro-batch.
        model.set_requires_gradient_sync(args.sync_every_microbatch or i == accum - 1)
        if args.replicate > 1:  # HSDP: reduce-scatter per micro-batch if asked, but the
            model.set_requires_all_reduce(i == accum - 1)  # all-reduce across nodes once a step
        loss = model(input_ids=x, labels=x).loss / accum  # mean over this rank's share
        loss.backward()
        loss_sum += loss.detach()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip or float("inf"))
    if isinstance(grad_norm, DTensor):
        grad_norm = grad_norm.full_tensor()
    return loss_sum, grad_norm


def agree(loss_sum: torch.Tensor, grad_norm: torch.Tensor) -> tuple[float, float, bool, bool,
                                                                     bool]:
    """One small all-reduce and one host sync per step, for what every rank must agree on: the
    mean loss, the gradient norm (the same on every rank; summed, then divided), "stop?" (a
    signal on any rank), "is every rank's pending save written?" and "does any rank's pending
    save hold a non-finite value?". Returns those five."""
    stop_flag = float(bool(stop_signal))
    unwritten = float(pending is not None and not pending["written"].done())
    bad = pending["bad"] if pending else torch.zeros((), device=env.device)
    # (with --cpu-offload the gradients, so their norm, live on the CPU: brought to the GPU)
    shared = torch.stack([loss_sum, grad_norm.float().to(env.device),
                          torch.tensor(stop_flag, device=env.device),
                          torch.tensor(unwritten, device=env.device), bad.to(env.device)])
    dist.all_reduce(shared)
    loss, gnorm, stop, unwritten, bad = shared.tolist()
    return loss / env.world_size, gnorm / env.world_size, stop > 0, unwritten == 0, bad > 0


def check_step(loss: float, gnorm: float, bad_state: bool) -> None:
    """Stop (exit 3) before the optimizer step if this step shows a bad update: a non-finite
    loss or norm, a non-finite value in the pending save, or a loss spike."""
    if bad_state:
        fail_nonfinite(loss, gnorm, progress.step + 1, f"a non-finite value in step "
                       f"{pending['step']}'s weights or optimizer state (checked before its "
                       "commit)")
    if not (math.isfinite(loss) and math.isfinite(gnorm)):
        # Before optimizer.step: a NaN gradient would make every weight NaN. A NaN here can
        # also be the previous step's update showing: the pending save holds it.
        fail_nonfinite(loss, gnorm, progress.step + 1)
    if spike := spikes.check(loss):  # a finite loss far above the recent ones: the same
        fail_nonfinite(loss, gnorm, progress.step + 1, spike, reason="loss-spike")


def profiler():
    """--profile-step: torch's profiler over one step, CPU (and CUDA) activity."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if env.device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    return torch.profiler.profile(activities=activities)


# ---- the loop
model.train()
stop = False
first_step = progress.step  # this process's first step is instrumented (run.json)
while progress.step < max_steps:
    t0 = time.perf_counter()
    lr = lr_at(progress.step)
    for group in optimizer.param_groups:
        group["lr"] = lr
    # this process's first step: count its collectives (a dispatch mode sees each one; not
    # with --compile, whose graphs it would break); --profile-step: trace the step
    counting = progress.step == first_step and not args.compile
    profiling = progress.step + 1 == args.profile_step
    with (CollectiveLog() if counting else contextlib.nullcontext()) as comm, \
            (profiler() if profiling else contextlib.nullcontext()) as prof:
        loss_sum, grad_norm = forward_backward(progress.step)
        loss, gnorm, stop, written, bad_state = agree(loss_sum, grad_norm)
    check_step(loss, gnorm, bad_state)  # a bad update showing: stop, exit 3, no commit
    if pending:  # a finite step after it: its update was fine; committed once written
        pending["checked"] = True
        if written:
            commit_pending()
    if counting:
        steps = {}
        for c in comm.collectives:
            steps[c.op] = steps.get(c.op, 0) + 1
        clipped = torch.nn.utils.get_total_norm([q.grad for q in model.parameters()])
        run_info["first_step"] = {"step": progress.step + 1, "collectives": steps,
                                  "grad_norm": gnorm, "grad_norm_clipped": (
                                      clipped.full_tensor() if isinstance(clipped, DTensor)
                                      else clipped).item()}
        write_run_info()
    if profiling:
        (out / "profile").mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(out / "profile" / f"rank{env.rank}.pt.trace.json"))
    if pending and pending["staged"] is not None:
        pending["staged"].result()  # the host copy must be whole before the weights change
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    progress.step += 1
    progress.tokens += args.batch_size * args.seq_len
    window["steps"] += 1
    window["seconds"] += time.perf_counter() - t0
    last = progress.step == max_steps
    if last or stop or progress.step % args.log_every == 0 or progress.step % args.eval_every == 0:
        log_row(loss, lr, gnorm, last)
    elif progress.step == first_step + 1:  # the first step (warm-up, compilation) would skew
        window.update(steps=0, seconds=0.0)  # the first row's tokens/s and MFU
    if stop or (args.save_every and progress.step % args.save_every == 0):
        save()
    if stop:
        break

if pending and not pending["checked"]:
    # The last save's update has not been followed by a step: check it as the loop checks
    # every other, with one more forward and backward (no optimizer step).
    loss_sum, grad_norm = forward_backward(progress.step)
    check_step(*(agree(loss_sum, grad_norm)[i] for i in (0, 1, 4)))
    optimizer.zero_grad(set_to_none=True)
commit_pending()  # the job is about to end: the checkpoint must be complete
if stager:
    stager.close()  # a stager we created is ours to close
    run_info["staged_host_bytes"] = stager.host_bytes  # per save: bytes, of which reused
    write_run_info()
hasher.shutdown()
if stop:
    if env.rank == 0:  # train_llama.sbatch requeues a job that stopped on a signal
        (out / "stopped.json").write_text(json.dumps(
            {"signal": stop_signal[0] if stop_signal else "another rank's",
             "step": progress.step}))
    print0(f"stopped by {stop_signal[0] if stop_signal else 'a signal on another rank'} "
           f"after step {progress.step}; checkpoint saved: run again with --resume")

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

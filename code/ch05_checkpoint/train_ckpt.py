"""Chapter 05's "after": train_fsdp2.py that saves, and resumes from, Distributed Checkpoints.

    MAX_RESTARTS=1 CRASH_AT=step:13 code/run_w_torchrun.sh 2 ch05_checkpoint/train_ckpt.py \
        --ckpt-dir /tmp/ckpt --save-every 5 --resume --json /tmp/run.json

It is chapter 04's train_fsdp2.py plus what a job needs to be stopped and resumed exactly (new
lines say # NEW; those marked "lesson only" serve this chapter's demonstrations, a crash on
purpose, the digest, the timings, and your own script leaves them out). Every --save-every steps
each rank writes its own shards with dcp.save into step_NNNNNN.tmp/, and rank 0 commits the
folder with an atomic rename (distkit.ckpt). With --resume the run starts from the newest
checkpoint whose files all check out, with the model, AdamW's state, the LR schedule, the
position in the data, the losses so far and each rank's random generators as they were: the rest
of the run is then bit-identical to a run that never stopped. (The tiny Llama has no dropout, so
each step draws one number from torch's and one from Python's generator, as dropout or a data
augmentation would, and logs them: a resume that forgot the generators then shows it.) The
checkpoint can be loaded on a different number of ranks (resharding).

--async saves with dcp.async_save: the loop waits only while this rank's state is copied to
host memory; the files are written in the background during the next steps, and the
checkpoint is committed once that upload has finished (at the next save, or at the end).

A real failure, for the lesson: CRASH_AT=step:K kills one rank (CRASH_RANK, default the last)
with SIGKILL just after step K; CRASH_AT=save:K kills it in the middle of step K's dcp.save,
once its own shards are written, before the checkpoint is complete. Only in torchrun's first
attempt, so the restarted group (MAX_RESTARTS=1 for the launcher) runs through.
"""
import argparse
import itertools
import os
import random
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp  # NEW
from torch.distributed.checkpoint import DefaultLoadPlanner  # NEW
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from distkit import print0, seed_everything, setup, teardown, write_json
from distkit.ckpt import AppState, CheckpointDir, RNGState, Stager  # NEW
from distkit.ckpt import ReadLog, read_manifest, state_digest  # NEW (lesson only)
from distkit.toy import counting_data, tiny_llama, warmup_cosine

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--batch-size", type=int, default=8, help="sequences per step, per process")
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--samples", type=int, default=256, help="sequences in the data set")
parser.add_argument("--lr", type=float, default=3e-3)
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--layers", type=int, default=2, help="decoder layers")
parser.add_argument("--json", help="write per-step losses here")
parser.add_argument("--ckpt-dir", help="NEW: keep checkpoints here (step_NNNNNN/ folders)")
parser.add_argument("--save-every", type=int, default=5, help="NEW: steps between checkpoints")
parser.add_argument("--keep", type=int, default=2, help="NEW: how many checkpoints to keep")
parser.add_argument("--async", dest="async_save", action="store_true",
                    help="NEW: save with dcp.async_save (the files are written in the background)")
parser.add_argument("--resume", nargs="?", const="latest", metavar="CHECKPOINT",
                    help="NEW: start from the newest good checkpoint in --ckpt-dir, "
                         "or from the checkpoint folder given")
parser.add_argument("--show-reads", metavar="KEY",
                    help="NEW (lesson only): on resume, print which rows of the tensor KEY (e.g. "
                         "model.embed_tokens.weight) each rank reads, and from which file")
args = parser.parse_args()
world = int(os.environ.get("WORLD_SIZE", 1))  # every rank needs at least one batch
if args.batch_size < 1 or args.samples < world * args.batch_size:
    parser.error(f"need 1 <= --batch-size and --samples >= {world} processes x --batch-size")
if args.save_every < 1:
    parser.error("--save-every must be at least 1")
if args.keep < 2:  # with 1, a damaged newest checkpoint leaves nothing to fall back on
    parser.error("--keep must be at least 2")
if args.resume == "latest" and not args.ckpt_dir:
    parser.error("--resume without a folder needs --ckpt-dir")
if args.resume not in (None, "latest") and not os.path.isdir(args.resume):
    parser.error(f"--resume: no checkpoint folder {args.resume}")
if args.resume not in (None, "latest") and (why := CheckpointDir.problem(Path(args.resume))):
    parser.error(f"--resume {args.resume}: {why}")  # NEW: its files checked before any load

env = setup()
restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))  # NEW (lesson only): attempt no.
if env.device.type == "cuda":  # NEW: a bit-exact resume on GPU needs deterministic kernels
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
seed_everything(args.seed)
model = tiny_llama(layers=args.layers).to(env.device)
for layer in model.model.layers:
    fully_shard(layer)
fully_shard(model)
optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
data = counting_data(args.samples)
# NEW: drop_last here too, so every world size reads the same global batches (no padding
# repeats): a checkpoint can then be resumed on another number of ranks
sampler = DistributedSampler(data, shuffle=True, seed=args.seed, drop_last=True)
# NEW: a generator of its own: each iter(loader) draws a seed from the one it uses, and a resume
# that starts an epoch's iterator again would otherwise shift the global random stream
loader = DataLoader(data, batch_size=args.batch_size, sampler=sampler, drop_last=True,
                    generator=torch.Generator())
steps_per_epoch, total_steps = len(loader), len(loader) * args.epochs
# NEW: a learning-rate schedule (a LambdaLR: linear warm-up, cosine decay): its position is
# training state too, and a resume that forgot it would restart the warm-up
scheduler = warmup_cosine(optimizer, total_steps)


class Progress:  # NEW: where we are in the run, as DCP's Stateful protocol wants it
    """Steps done (they give the epoch and the batch within it), the LR schedule, the losses so
    far, and the settings that decide the data and the schedule: a resume with others would
    silently train another run, so it is refused."""

    def __init__(self):
        self.step, self.losses, self.draws = 0, [], []
        self.run = {"global batch": env.world_size * args.batch_size, "--samples": args.samples,
                    "--epochs": args.epochs, "--seed": args.seed, "--lr": args.lr}

    def state_dict(self):
        # copies: dcp.load fills the dict returned here in place, and would overwrite self.run
        return {"step": self.step, "run": dict(self.run), "scheduler": scheduler.state_dict(),
                "losses": list(self.losses), "draws": list(self.draws)}

    def load_state_dict(self, state):
        if changed := [f"{k} {v} (now {self.run[k]})" for k, v in state["run"].items()
                       if self.run[k] != v]:
            raise SystemExit("train_ckpt.py: the checkpoint's run had " + ", ".join(changed)
                             + "; resume with its settings")
        self.step, self.losses, self.draws = state["step"], state["losses"], state["draws"]
        scheduler.load_state_dict(state["scheduler"])


def crash_if(where, step):  # NEW (for this lesson only): a real failure at a chosen point
    victim = int(os.environ.get("CRASH_RANK", env.world_size - 1))
    if os.environ.get("CRASH_AT") == f"{where}:{step}" and env.rank == victim and restart == 0:
        print(f"rank {env.rank}: killed by SIGKILL at {where} {step}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


class Writer(dcp.FileSystemWriter):  # NEW (lesson only): DCP's file writer, a crash inside
    def __init__(self, folder, step):
        super().__init__(folder)
        self.step = step  # (with --async, write_data runs while training has gone on)

    def write_data(self, plan, planner):
        written = super().write_data(plan, planner)  # this rank's shards, on disk
        crash_if("save", self.step)  # before rank 0 has all results to write .metadata
        return written


# NEW: everything a checkpoint holds; dcp.save/dcp.load call each part's state_dict() and
# load_state_dict(). The model and AdamW's state are DTensor shards: each rank writes its own.
progress = Progress()
state = {"app": AppState(model, optimizer), "progress": progress,
         "rng": RNGState(env.rank, env.device)}
ckpt = CheckpointDir(args.ckpt_dir, keep=args.keep) if args.ckpt_dir else None
# NEW: the newest checkpoint that checks out; None if there is none yet. If there are some but
# none checks out, the run stops and changes nothing (starting over would overwrite them)
start = ckpt.resume_point("train_ckpt.py") if args.resume == "latest" else args.resume
resumed_from = None
if start:
    # NEW: each rank reads the pieces of the saved tensors that overlap its own shards, whatever
    # the number of ranks that saved them. Every rank passes dcp.load the same keys (the rule of
    # its docstring: mismatched keys may hang). The RNG states are per rank ("rng.rank2"): on
    # more ranks than saved them, a rank finds none of its own, so they are loaded apart, with a
    # planner that lets a key be absent (it then keeps its value); model, AdamW and progress
    # must all be there.
    reads = ReadLog(args.show_reads) if args.show_reads else None  # (lesson only: --show-reads)
    dcp.load({k: state[k] for k in ("app", "progress")}, checkpoint_id=start, planner=reads)
    dcp.load({"rng": state["rng"]}, checkpoint_id=start,
             planner=DefaultLoadPlanner(allow_partial_load=True))
    resumed_from = progress.step
    if reads:  # NEW (lesson only, --show-reads): what each rank's planner read, from where
        if not (report := reads.report()):  # (collective: the same answer on every rank)
            raise SystemExit(f"train_ckpt.py: --show-reads: no tensor {args.show_reads} in "
                             f"{start}")
        print0(f"what each rank reads of {args.show_reads}:", *report, sep="\n  ")
    print0(f"attempt {restart}: resumed from {os.path.basename(start)} (step {progress.step}) "
           f"on {env.world_size} rank(s); loaded == saved: "  # (lesson only: the digest)
           f"{state_digest(model, optimizer) == read_manifest(start).get('digest')}")
elif args.resume:
    print0(f"attempt {restart}: no checkpoint yet in {args.ckpt_dir}; starting from step 0")

# NEW (--async): the upload's collectives run on a group of their own, created once (a gloo
# one: async_save needs a CPU backend), so they never interleave with training's collectives;
# one stager for the whole run, which keeps its host copy and refills it at every save.
ckpt_group = dist.new_group(backend="gloo") if args.async_save else None
stager = Stager(env.device) if args.async_save else None
pending = None  # the async save still uploading: (step, digest, response, seconds blocked)
saves = []  # (lesson only) per save: seconds the loop was blocked, of which the commit's


def commit(step, digest, blocked, t0):  # NEW: a checkpoint's files are complete: seal it
    t1 = time.perf_counter()  # (lesson only: the timings, the digest)
    ckpt.commit(step, world_size=env.world_size, digest=digest)
    saves.append({"step": step, "blocked": blocked + time.perf_counter() - t0,  # (lesson only)
                  "commit": time.perf_counter() - t1})


def finish_pending():  # NEW (--async): wait for the previous upload, then commit it
    global pending
    if pending:
        step, digest, response, blocked = pending
        t0 = time.perf_counter()
        response.upload_completion.result()  # raises if a rank's upload failed
        commit(step, digest, blocked, t0)
        pending = None


def save(step):  # NEW
    global pending
    # (lesson only: the digest is this lesson's "loaded == saved" check, not part of a save: it
    # gathers the whole state to rank 0, which a real job at scale would not do; the timings)
    digest = state_digest(model, optimizer)
    t0 = time.perf_counter()
    if not args.async_save:  # every rank writes its shards in parallel; then the commit
        # (lesson only: Writer; your script passes checkpoint_id=ckpt.begin(step))
        dcp.save(state, storage_writer=Writer(ckpt.begin(step), step))
        return commit(step, digest, 0.0, t0)
    finish_pending()  # one save in flight: the stager refills the host copy the last one used
    response = dcp.async_save(state, storage_writer=Writer(ckpt.begin(step), step),
                              process_group=ckpt_group, async_stager=stager)
    pending = (step, digest, response, time.perf_counter() - t0)


for epoch in range(progress.step // steps_per_epoch, args.epochs):
    sampler.set_epoch(epoch)
    # NEW: skip the batches this epoch already trained on (cheap here: the data is in memory)
    for (tokens,) in itertools.islice(loader, progress.step % steps_per_epoch, None):
        tokens = tokens.to(env.device)
        # NEW (lesson only): where dropout or an augmentation would draw random numbers (this
        # model has none): one from each global generator, logged, so the streams move and a
        # resume must restore them (RNGState) to draw the same ones
        progress.draws.append([torch.rand(1).item(), random.random()])
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        if pending:  # NEW (--async): the copy must be whole before the weights change
            t0 = time.perf_counter()  # (lesson only: the time blocked)
            pending[2].staging_completion.result()
            pending = (*pending[:3], pending[3] + time.perf_counter() - t0)
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()  # NEW: the LR of the next step
        loss = loss.detach()
        dist.all_reduce(loss)
        progress.losses.append(loss.item() / env.world_size)
        progress.step += 1
        crash_if("step", progress.step)  # (lesson only)
        if ckpt and progress.step % args.save_every == 0:
            save(progress.step)  # NEW
    print0(f"epoch {epoch}  step {progress.step:3d}  loss {progress.losses[-1]:.3f}")

finish_pending()  # NEW (--async): the last save, committed before the run ends
host_bytes = None  # (lesson only: the host memory each save's copy took)
if stager:
    stager.close()  # a stager we created is ours to close
    host_bytes = [None] * env.world_size  # per rank, per save: host memory of the staged copy
    dist.all_gather_object(host_bytes, stager.host_bytes)

# NEW (lesson only): the whole training state to the last bit (in the JSON only: the last bits
# of a float differ from one CPU to another, so its printed value would differ too)
write_json(args.json, {"losses": progress.losses, "digest": state_digest(model, optimizer),
                       "draws": progress.draws,  # per step: the random numbers drawn
                       "resumed_from": resumed_from,
                       "attempt": restart, "saves": saves,
                       "host_bytes": host_bytes,
                       "checkpoints": [p.name for p in ckpt.committed()] if ckpt else [],
                       "skipped": ckpt.log if ckpt else []})
teardown()

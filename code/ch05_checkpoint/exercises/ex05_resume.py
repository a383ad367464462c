# Yours to fill in (generated from ../solutions/ex05_resume.py).
"""Exercise 05.1: make a resume exact, bit for bit, after a restart from a checkpoint.

    code/run_w_torchrun.sh 2 ch05_checkpoint/exercises/ex05_resume.py --save-at 5

One launch plays a job and its restart. First the job: the tiny Llama sharded with FSDP2, AdamW
with an LR schedule (linear warm-up, then cosine decay), --steps steps of a global batch of
--global-batch sequences read through a DistributedSampler that reshuffles every epoch; after
step --save-at it saves a Distributed Checkpoint of {"app": the model and AdamW (AppState),
"progress": Progress}. Then the restart, in the same process group but from nothing the first
run left in memory: a fresh model (another seed), AdamW, LR schedule and data loader, the
checkpoint loaded with dcp.load, training on from step --save-at + 1. The steps after the
checkpoint must match the first run's bit for bit: the same batch on every rank, the same LR,
the same loss, and the same model and AdamW state at the end (sha256 of the whole state);
and the first run itself must read, step by step, what a plain loop over the epochs reads.
AppState already brings the model and AdamW back; the rest is yours: Progress, what else the
run must remember (DCP's Stateful protocol), and the data, which must go on where it stopped.
Fill in the TODO(you) parts, replacing each todo(...) call with your code. Run the script at any
time: it stops at the first todo() left and says what is missing; once they are all done it
says whether the resume is exact, and if not, at which step it differs and what is likely
missing; `make exercise EX=05.1` checks it at 2 and 3 ranks. Solution, with the answers to the
questions below: ../solutions/ex05_resume.py.

Predict, then measure:
1. Save and load only the step in Progress, not the scheduler. Which step is the first to run
   at another LR, and why not step --save-at + 1? (Which other state in the checkpoint holds
   the LR of the next step, and what overwrites it?)
2. Run it with --save-at 4, the last step of an epoch: which epoch and batch does your resume
   start at? And with --save-at 8?
3. The checkpoint holds no random generator state, yet the resume is exact; train_ckpt.py saves
   every rank's (RNGState). What in a training run would need it that this one lacks?
4. Your resume reads the batches it skips and throws them away. With a data set of billions of
   tokens, streamed, what would you put in the checkpoint instead?
"""
import argparse
import itertools
import math
import os
import shutil
import tempfile
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from distkit import print0, seed_everything, setup, teardown, todo, write_json
from distkit.ckpt import AppState, state_digest
from distkit.toy import counting_data, tiny_llama

SEED = 0  # the first run's model and the data's shuffle; the restart builds its model from SEED + 1
parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--steps", type=int, default=12, help="optimizer steps in all")
parser.add_argument("--save-at", type=int, default=5, help="save the checkpoint after this step")
parser.add_argument("--global-batch", type=int, default=16,
                    help="sequences per step, over all processes")
parser.add_argument("--samples", type=int, default=64, help="sequences in the data set (an epoch)")
parser.add_argument("--lr", type=float, default=3e-3, help="AdamW's peak learning rate")
parser.add_argument("--ckpt-dir", help="keep the checkpoint here, a folder every rank sees "
                                       "(default: a temporary folder, removed at the end)")
parser.add_argument("--json", help="write LRs, losses and the checks here (rank 0)")
args = parser.parse_args()
world = int(os.environ.get("WORLD_SIZE", 1))
if not 1 <= args.save_at < args.steps:
    parser.error("need 1 <= --save-at < --steps")
if args.global_batch < world or args.global_batch % world:
    parser.error(f"--global-batch must be a multiple of the {world} processes")
if args.samples < args.global_batch:
    parser.error("need --samples >= --global-batch (at least one step per epoch)")

env = setup()
warmup = max(1, args.steps // 4)


def lr_factor(s):
    """The LR schedule, times --lr: linear warm-up over `warmup` steps, then cosine decay."""
    return min((s + 1) / warmup, 0.5 * (1 + math.cos(math.pi * s / args.steps)))


def build(seed):
    """What a job builds when it starts, before any checkpoint: the model from `seed`, sharded
    (one FSDP unit per decoder layer, then the root), AdamW, the LR schedule, the data loader."""
    seed_everything(seed)
    model = tiny_llama().to(env.device)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
    data = counting_data(args.samples)
    sampler = DistributedSampler(data, shuffle=True, seed=SEED)  # reshuffled by set_epoch
    loader = DataLoader(data, batch_size=args.global_batch // env.world_size, sampler=sampler,
                        drop_last=True)
    return model, optimizer, scheduler, loader


def batches_after(loader, done):
    """This rank's batches for steps done + 1, done + 2, ..., epoch after epoch, endlessly:
    the batches an uninterrupted run reads there (loader.sampler reshuffles with set_epoch)."""
    # TODO(you): yield exactly the batches the uninterrupted run reads at steps done + 1, done + 2,
    # ...: the epoch that step falls in (len(loader) steps per epoch), with that epoch's own
    # shuffle, past the batches of it already trained on; then every later epoch, endlessly (train()
    # takes as many as it needs). Look up: DistributedSampler.set_epoch, itertools.islice.
    todo("batches_after(): the batches of the steps after `done`, skipping the rest")


class Progress(Stateful):
    """Where the run is, beyond the model and AdamW (AppState holds those). dcp.save calls
    state_dict() and writes what it returns; dcp.load calls state_dict() for the keys to read,
    then load_state_dict() with what it read."""

    def __init__(self, scheduler):
        self.step, self.scheduler = 0, scheduler

    def state_dict(self):
        # TODO(you): return a dict of what a restart needs that AppState does not hold: the steps
        # done, and the state of whatever else changes as the run goes on (what does train() call
        # every step besides the model and AdamW?). Ints, floats, lists, dicts: dcp.save writes them
        # (a value that is not a DTensor is written once, by one rank).
        todo("Progress.state_dict(): what a restart needs beyond the model and AdamW")

    def load_state_dict(self, state):
        # TODO(you): the inverse of state_dict(): put back into self, and into what it holds, the
        # values dcp.load read from the checkpoint (`state` has state_dict()'s keys).
        todo("Progress.load_state_dict(): put the steps done and the rest back")


def train(model, optimizer, scheduler, loader, progress, save_to=None):
    """Steps progress.step + 1 ... --steps; after step --save-at, a checkpoint into save_to (if
    given). Returns a record per step: its LR, this rank's batch, the loss (mean over ranks)."""
    log = []
    steps_left = args.steps - progress.step
    for (tokens,) in itertools.islice(batches_after(loader, progress.step), steps_left):
        lr = optimizer.param_groups[0]["lr"]  # the LR this step's optimizer.step() uses
        tokens = tokens.to(env.device)
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        loss = loss.detach()
        dist.all_reduce(loss)
        progress.step += 1
        log.append({"step": progress.step, "lr": lr, "tokens": tokens,
                    "loss": loss.item() / env.world_size})
        if save_to and progress.step == args.save_at:
            # every rank writes its shards of the model and AdamW; Progress, not a DTensor,
            # counts as the same on every rank: one rank's copy is written
            dcp.save({"app": AppState(model, optimizer), "progress": progress},
                     checkpoint_id=save_to)
            log[-1]["digest"] = state_digest(model, optimizer)  # the state saved, to compare
    return log


def diagnose(first, resumed, same_batch):
    """What the resume probably forgot, from the first step where it differs (None: exact)."""
    want = [r["step"] for r in first[args.save_at:]]
    got = [r["step"] for r in resumed]
    if got != want:
        span = f"steps {got[0]}..{got[-1]}" if got else "no step"
        return (f"the resumed run trained {span}, not {want[0]}..{want[-1]}: Progress did not "
                f"restore the steps done (or the batches ran out)")
    for f, r, same in zip(first[args.save_at:], resumed, same_batch):
        if not same:
            return (f"step {r['step']} read other sequences than the uninterrupted run: the "
                    f"batches already trained on were not skipped right (which epoch? which "
                    f"batch in it? that epoch's shuffle, set_epoch?)")
        if r["lr"] != f["lr"]:
            return (f"step {r['step']} ran at LR {r['lr']:.3e}, not {f['lr']:.3e}: the LR "
                    f"schedule restarted (Progress must save and load the scheduler's state)")
        if r["loss"] != f["loss"]:
            return (f"step {r['step']}'s loss differs with the same batch and LR: the model or "
                    f"AdamW's state was not loaded as saved")
    return None


start = time.perf_counter()
# --ckpt-dir, or a folder named by rank 0 in the temporary directory (one machine: every rank
# sees it); dcp.save creates it
name = [args.ckpt_dir or os.path.join(tempfile.gettempdir(), f"ex05_resume_{os.getpid()}")]
dist.broadcast_object_list(name, src=0)
ckpt_dir = name[0]
folder = os.path.join(ckpt_dir, f"step_{args.save_at:06d}")

# 1. The uninterrupted run, saving a checkpoint on the way.
model, optimizer, scheduler, loader = build(SEED)
first = train(model, optimizer, scheduler, loader, Progress(scheduler), save_to=folder)
assert len(first) == args.steps, (f"the first run trained {len(first)} of {args.steps} steps: "
                                  f"batches_after() must go on, epoch after epoch")
first_digest = state_digest(model, optimizer)
# Each epoch its own shuffle: epoch 1 reads another order than epoch 0 (in the run's first steps)
per_epoch = len(loader)
reshuffled = args.steps < 2 * per_epoch or not all(
    torch.equal(first[i]["tokens"], first[i + per_epoch]["tokens"]) for i in range(per_epoch))
# And against a plain loop over the epochs, which does not use batches_after(): step s reads
# epoch (s - 1) // len(loader)'s batch (s - 1) % len(loader). A skip that is off by one shifts
# the resume and the uninterrupted run alike (they agree), but not this.
plain = []
for epoch in range(args.steps // per_epoch + 2):
    loader.sampler.set_epoch(epoch)
    plain += [t.to(env.device) for (t,) in loader]
in_order = torch.tensor([[torch.equal(r["tokens"], plain[i + ahead]) for ahead in (0, 1)]
                         for i, r in enumerate(first)], dtype=torch.int32, device=env.device)
dist.all_reduce(in_order, op=dist.ReduceOp.MIN)  # every rank's batch as a plain loop's
plain_order = [bool(x) for x in in_order[:, 0].tolist()]
one_ahead = bool(in_order[:, 1].all())  # every step read the plain loop's next batch
del model, optimizer, scheduler, loader  # the restart keeps nothing in memory but the folder

# 2. The restart: everything new, then the checkpoint loaded into it.
model, optimizer, scheduler, loader = build(SEED + 1)
progress = Progress(scheduler)
dcp.load({"app": AppState(model, optimizer), "progress": progress}, checkpoint_id=folder)
loaded_equal = state_digest(model, optimizer) == first[args.save_at - 1]["digest"]
resumed = train(model, optimizer, scheduler, loader, progress)
digest_equal = state_digest(model, optimizer) == first_digest
seconds = time.perf_counter() - start

# 3. Step by step against the uninterrupted run. Batches differ per rank: equal on all ranks?
by_step = {r["step"]: r for r in resumed}
pairs = [(f, by_step.get(f["step"])) for f in first[args.save_at:]]
same = torch.tensor([r is not None and torch.equal(f["tokens"], r["tokens"]) for f, r in pairs],
                    dtype=torch.int32)
dist.all_reduce(same, op=dist.ReduceOp.MIN)
same_batch = [bool(x) for x in same.tolist()]
same_lr = [r is not None and f["lr"] == r["lr"] for f, r in pairs]
same_loss = [r is not None and f["loss"] == r["loss"] for f, r in pairs]
bit_identical = len(resumed) == args.steps - args.save_at and all(same_loss)
problem = diagnose(first, resumed, same_batch)

b = args.global_batch // env.world_size
print0(f"first run: {args.steps} steps of {args.global_batch} sequences ({env.world_size} "
       f"processes x {b}), {len(loader)} steps per epoch; checkpoint after step {args.save_at}")
print0(f"restart: a fresh model (seed {SEED + 1}), AdamW, LR schedule and data loader; "
       f"loaded the checkpoint of step {args.save_at}")
print0(f"loaded model + AdamW state == saved (sha256): {loaded_equal}")
print0("step  epoch  lr        loss   | resumed: same batch  same lr  same loss")
for (f, r), sb, sl, sx in zip(pairs, same_batch, same_lr, same_loss):
    # LR to 3 digits, loss to 3 decimals: the equality columns carry the bit-for-bit check
    print0(f"{f['step']:4d}  {(f['step'] - 1) // len(loader):5d}  {f['lr']:.2e}  "
           f"{f['loss']:.3f}  |          {sb!s:<10}  {sl!s:<7}  {sx}")
print0(f"resumed losses bit-identical: {bit_identical}")
print0(f"final model + AdamW state identical (sha256): {digest_equal}")
write_json(args.json, {
    "world_size": env.world_size, "steps": args.steps, "save_at": args.save_at,
    "global_batch": args.global_batch, "samples": args.samples,
    "steps_per_epoch": len(loader), "warmup": warmup, "lr": args.lr,
    "first": {"lrs": [r["lr"] for r in first], "losses": [r["loss"] for r in first]},
    "resumed": {"steps": [r["step"] for r in resumed], "lrs": [r["lr"] for r in resumed],
                "losses": [r["loss"] for r in resumed]},
    "same_batch": same_batch, "same_lr": same_lr, "same_loss": same_loss,
    "loaded_equal": loaded_equal, "bit_identical": bit_identical,
    "digest_equal": digest_equal, "digest": first_digest, "problem": problem,
    "reshuffled": reshuffled, "plain_order": plain_order, "one_ahead": one_ahead,
    "seconds": seconds})
dist.barrier()  # every rank is done with the checkpoint before rank 0 removes it
if not args.ckpt_dir and env.rank == 0:
    shutil.rmtree(ckpt_dir, ignore_errors=True)
assert bit_identical and digest_equal, \
    f"the resume is not exact: {problem or 'the final model + AdamW state differs'}"
teardown()

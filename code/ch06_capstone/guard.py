"""What keeps a capstone run honest, next to train_llama.py: one run per --out folder, the
learning-rate schedule, the loss-spike guard, the finite-state check before a commit, and
one-line reasons for the failures a cluster brings (a full disk, a folder of someone else's).

Each piece is small and testable on its own (tests/test_ch06_recipe.py and
test_ch06_scripts.py call them in-process); train_llama.py reads top to bottom and calls them
where a step needs them. Where they come from: the loss-spike rule is the one large recipes use
(OLMo 2 and others skip or stop on a step whose loss jumps far above its recent mean); the
lock is the classic fcntl.flock on a file in the folder (released by the kernel when the
process ends, however it ends, so a crash never leaves a stale lock behind).
"""
from __future__ import annotations

import errno
import fcntl
import json
import math
import os
import shutil
import socket
import sys
import time
from collections import deque
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from distkit.ckpt import step_of

LOCK = ".lock"  # in --out: who runs there now (host, pid, start); flock'ed while it runs
# what a run of train_llama.py (and train_llama.sbatch) writes into --out, and nothing else
OURS = {"metrics.jsonl", "run.json", "checkpoints", "hf", "profile", "tensorboard",
        "stopped.json", "failed.json", "requeue_failures", LOCK}


def lr_at(step: int, lr: float, min_lr: float, warmup: int, max_steps: int) -> float:
    """Linear warm-up to `lr` over `warmup` steps (step 0 at lr / warmup, step warmup - 1 at
    lr), then cosine decay to `min_lr` at the last step, max_steps - 1 (steps count from 0)."""
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, max_steps - 1 - warmup)
    return min_lr + 0.5 * (lr - min_lr) * (1 + math.cos(math.pi * min(1., progress)))


def foreign(out: Path) -> list[str]:
    """The names in `out` that no run of train_llama.py writes (a run.json counts as ours only
    if it reads as one: a JSON object with "world_size" and "fsdp")."""
    if not out.is_dir():
        return []
    names = sorted(p.name for p in out.iterdir() if p.name not in OURS)
    run = out / "run.json"
    if run.is_file():
        try:
            ours = {"world_size", "fsdp"} <= set(json.loads(run.read_text()))
        except (ValueError, TypeError, OSError):
            ours = False
        if not ours:
            names.append("run.json (not one this script wrote)")
    return names


def unwritable(out: Path) -> str | None:
    """Why `out` cannot be written (one line), or None: the nearest folder that exists."""
    here = out.absolute()
    while not here.exists():
        here = here.parent
    if not os.access(here, os.W_OK):
        return f"{here} is not writable (a read-only file system, or its permissions)"
    return None


def previous_run(out: Path) -> str:
    """What a run left in `out` ("" if nothing): its metrics file, its committed checkpoints."""
    steps = sorted(s for p in (out / "checkpoints").glob("step_*")
                   if p.is_dir() and (s := step_of(p.name)) is not None)
    return ", ".join(what for what in [
        "metrics.jsonl" if (out / "metrics.jsonl").exists() else "",
        f"{len(steps)} checkpoint(s), the newest of step {steps[-1]}" if steps else ""] if what)


def out_problem(out: Path, resume: bool, overwrite: bool) -> str | None:
    """Why a run cannot start in `out` (the rest of a line that begins "--out OUT"), or None:
    read-only; files no run of ours writes; --resume with --overwrite; a previous run there
    without either."""
    if problem := unwritable(out):
        return f": {problem}"
    if names := foreign(out):
        return (f" holds files no run of train_llama.py writes ({', '.join(names[:5])}): choose "
                "an empty or new folder")
    if resume and overwrite:
        return ": --resume continues OUT's run, --overwrite deletes it: choose one"
    if not (resume or overwrite) and (previous := previous_run(out)):
        return (f" holds a previous run ({previous}): --resume continues it, --overwrite starts "
                "over and deletes it, or choose another --out")
    return None


def schedule_changes(out: Path) -> list:
    """run.json's record of --change-schedule and --resume-from so far ([] if none)."""
    try:
        return json.loads((out / "run.json").read_text()).get("schedule_changes", [])
    except (OSError, ValueError, AttributeError):
        return []


def lock(out: Path):
    """Take OUT/.lock for this process (global rank 0), before anything else is written: an
    exclusive flock, held until the process ends (the kernel releases it on any exit, SIGKILL
    included, so a lock left by a crash is no lock). Returns the open file (keep it); when
    another run holds it, one line naming the holder and exit status 2. (On NFS, Linux
    turns flock into a POSIX lock that the server arbitrates, across nodes; Lustre needs its
    -o flock mount option.)"""
    if (held := _HELD.get(str(out.resolve()))) is not None and not held.closed:
        return held  # this process holds it already (a script run again in one process)
    out.mkdir(parents=True, exist_ok=True)
    f = open(out / LOCK, "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno not in (errno.EAGAIN, errno.EACCES):
            raise
        f.seek(0)
        holder = f.read().strip() or "another process"
        f.close()
        print(f"train_llama.py: --out {out} is in use by another run ({holder}): wait for "
              "it to end, or choose another --out", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    f.seek(0)
    f.truncate()
    f.write(f"host {socket.gethostname()}, pid {os.getpid()}, since "
            f"{time.strftime('%Y-%m-%d %H:%M:%S')}\n")
    f.flush()
    _HELD[str(out.resolve())] = f
    return f


_HELD: dict = {}  # folder -> the open, locked file of this process


class SpikeGuard:
    """A step whose loss exceeds `factor` x the mean of the last `window` steps' losses is a
    bad update showing (a learning rate too high for this region, corrupt data, a flipped
    bit): it is not committed, and the run stops with its reason. A finite loss passes the
    non-finite check however large, so this is the check for an update that stays finite.
    Armed once `warm` losses are in the window (a resumed run arms again after `warm` steps).
    factor 0: off."""

    def __init__(self, factor: float, window: int = 20, warm: int = 5):
        self.factor, self.warm = factor, warm
        self.recent = deque(maxlen=window)

    def check(self, loss: float) -> str | None:
        """Why `loss` is a spike (one line), or None; a loss that passes joins the window."""
        if self.factor and len(self.recent) >= self.warm:
            mean = sum(self.recent) / len(self.recent)
            if loss > self.factor * mean:
                return (f"loss {loss:.4g} is more than --spike-factor {self.factor:g} x the "
                        f"mean {mean:.4g} of the last {len(self.recent)} steps")
        self.recent.append(loss)
        return None


def local_tensors(model, optimizer):
    """This rank's tensors of the model and of the optimizer's state: the shards it saves."""
    for p in model.parameters():
        yield p.to_local() if isinstance(p, DTensor) else p
    for state in optimizer.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor):
                yield v.to_local() if isinstance(v, DTensor) else v


def nonfinite(model, optimizer, device) -> torch.Tensor:
    """1.0 if any of this rank's shards (weights, AdamW's moments and step) holds a NaN or an
    inf, else 0.0: a 0-d tensor on `device`, for the step's all-reduce (no host sync here)."""
    flags = [torch.isfinite(t).all().to(device) for t in local_tensors(model, optimizer)
             if t.is_floating_point() and t.numel()]
    if not flags:
        return torch.zeros((), device=device)
    return (~torch.stack(flags).all()).float()


def save_failure(folder: Path, exc: BaseException) -> str | None:
    """A save that failed because the disk is full or not writable, in one line (None: another
    failure). An errno in the exception's chain says which (EROFS, EACCES, EPERM: not writable;
    ENOSPC, EDQUOT: full). DCP's synchronous writer reports a full disk as a zip error
    ("unexpected pos ..."), so a chain with no such errno and a file system with less than
    64 MiB free after the failure counts as full."""
    seen, todo, errnos = set(), [exc], set()
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno is not None:
            errnos.add(e.errno)
        todo += [e.__cause__, e.__context__]  # and DCP's CheckpointException: per rank
        todo += [f[0] if isinstance(f, tuple) else f for f in getattr(e, "failures", {}).values()]
    if not_writable := errnos & {errno.EROFS, errno.EACCES, errno.EPERM}:
        return (f"Cannot write checkpoints: writing {folder.name} in {folder.parent} failed "
                f"({os.strerror(min(not_writable))}); nothing was committed")
    if not errnos & {errno.ENOSPC, errno.EDQUOT}:
        here = folder
        while not here.exists() and here != here.parent:
            here = here.parent
        try:
            free = shutil.disk_usage(here).free
        except OSError:
            return None
        if free >= 64 << 20:
            return None
    here = folder if folder.exists() else folder.parent
    free = shutil.disk_usage(here).free if here.exists() else 0
    return (f"No space left on device: writing {folder.name} in {folder.parent} failed "
            f"({free / 2**20:.0f} MiB free there); nothing was committed")

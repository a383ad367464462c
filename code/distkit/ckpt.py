"""Chapter 05's checkpoint plumbing: what Distributed Checkpoint (DCP) saves, and where.

What: `AppState` (a model and its optimizer) and `RNGState` (this rank's random generators)
follow DCP's `Stateful` protocol, so `dcp.save` / `dcp.load` call their `state_dict()` and
`load_state_dict()` themselves, the way torchtitan's checkpoint manager does.

Where: `CheckpointDir` keeps committed checkpoints as ROOT/step_000010/ folders. A checkpoint is
written into step_000010.tmp/ and committed by rank 0 with one atomic rename once every rank has
written its shards, after a manifest.json (size and sha256 of every file) is written into it.
So a crash mid-save leaves a .tmp folder, never a half-written "latest"; a damaged file is
caught by its checksum; `latest()` picks the newest checkpoint that passes, and says why it
skipped the others. Only the newest `keep` checkpoints stay.
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_state_dict,
                                                     set_state_dict)
from torch.distributed.checkpoint.stateful import Stateful

MANIFEST = "manifest.json"


class AppState(Stateful):
    """A model and its optimizer, as DCP saves and loads them.

    get_state_dict gives the same keys whatever the wrapping (FSDP2, DDP, none): parameter
    names without wrapper prefixes, and the optimizer's state keyed by those names instead of
    by position. Under FSDP2 each value is a DTensor holding this rank's shard, so each rank
    saves only its own. set_state_dict copies loaded values back into the live model and
    optimizer.
    """

    def __init__(self, model, optimizer, options: StateDictOptions | None = None):
        self.model, self.optimizer, self.options = model, optimizer, options

    def state_dict(self):
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=self.options)
        return {"model": model_sd, "optim": optim_sd}

    def load_state_dict(self, state_dict):
        set_state_dict(self.model, self.optimizer, model_state_dict=state_dict["model"],
                       optim_state_dict=state_dict["optim"], options=self.options)


class RNGState(Stateful):
    """This rank's random generators: Python's, torch's CPU (and CUDA) generator.

    Every rank has its own generator states, so the key names the rank ("rank1"): a tensor
    that is not a DTensor counts as replicated, and DCP would keep only rank 0's copy.
    """

    def __init__(self, rank: int):
        self.key = f"rank{rank}"

    def state_dict(self):
        state = {"python": random.getstate(), "torch": torch.get_rng_state()}
        if torch.cuda.is_available():
            state["cuda"] = torch.cuda.get_rng_state()
        return {self.key: state}

    def load_state_dict(self, state_dict):
        state = state_dict[self.key]
        random.setstate(state["python"])
        torch.set_rng_state(state["torch"])
        if "cuda" in state:
            torch.cuda.set_rng_state(state["cuda"])


def saved_keys(path: str | os.PathLike) -> set[str]:
    """The flattened keys a checkpoint holds ("app.model.lm_head.weight", ...), read from its
    .metadata file alone."""
    return set(dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata)


def _rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


class CheckpointDir:
    """Committed checkpoints ROOT/step_NNNNNN/, written atomically; the newest `keep` stay.

    Every method is collective (all ranks call it); rank 0 does the file work and tells the
    others. The folder must be one that every rank sees (a shared file system across nodes),
    as DCP's FileSystemWriter requires anyway.
    """

    def __init__(self, root: str | os.PathLike, keep: int = 2):
        self.root, self.keep = Path(root), keep
        self.log: list[str] = []  # what latest() found, for the notebook

    def path(self, step: int) -> Path:
        return self.root / f"step_{step:06d}"

    def begin(self, step: int) -> Path:
        """The folder to write step's checkpoint into: step_NNNNNN.tmp/, empty."""
        tmp = self.path(step).with_suffix(".tmp")
        if _rank0():
            shutil.rmtree(tmp, ignore_errors=True)
            self.root.mkdir(parents=True, exist_ok=True)
        _barrier()
        return tmp

    def commit(self, step: int, **facts) -> Path:
        """Seal step_NNNNNN.tmp/ (every rank has finished writing: dcp.save returned on all):
        manifest, then an atomic rename; then delete all but the newest `keep`."""
        tmp, final = self.path(step).with_suffix(".tmp"), self.path(step)
        if _rank0():
            files = {p.name: {"bytes": p.stat().st_size, "sha256": _sha256(p)}
                     for p in sorted(tmp.iterdir())}
            manifest = tmp / MANIFEST
            manifest.write_text(json.dumps({"step": step, **facts, "files": files}, indent=1))
            for p in [*tmp.iterdir(), tmp]:  # on disk before the rename makes them "latest"
                _fsync(p)
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)  # atomic: readers see the old state or the new, never half
            _fsync(self.root)
            for old in self.committed()[:-self.keep]:
                shutil.rmtree(old)
        _barrier()
        return final

    def committed(self) -> list[Path]:
        """Committed checkpoint folders, oldest first (no check of their contents)."""
        if not self.root.is_dir():
            return []
        return sorted(p for p in self.root.glob("step_*") if p.is_dir() and p.suffix == "")

    @staticmethod
    def problem(path: Path) -> str | None:
        """Why the checkpoint in `path` cannot be trusted, or None when every file is whole."""
        try:
            manifest = json.loads((path / MANIFEST).read_text())
        except (OSError, ValueError):
            return f"no readable {MANIFEST}"
        found = {p.name for p in path.iterdir()} - {MANIFEST}
        for name in sorted(found ^ set(manifest["files"])):
            return f"{name} is {'missing' if name in manifest['files'] else 'not in the manifest'}"
        for name, want in manifest["files"].items():
            size = (path / name).stat().st_size
            if size != want["bytes"]:
                return f"{name} has {size} bytes, the manifest says {want['bytes']}"
            if _sha256(path / name) != want["sha256"]:
                return f"{name} does not match its sha256 in the manifest"
        return None

    def latest(self) -> Path | None:
        """The newest checkpoint whose files all match their manifest (None: start fresh).
        Leftover .tmp folders (a save that never committed) are removed; each skipped
        checkpoint is reported with the reason."""
        choice = [None]
        if _rank0():
            self.log = []
            for tmp in sorted(self.root.glob("step_*.tmp")):
                how = ("dcp.save had finished" if (tmp / ".metadata").exists()
                       else "no .metadata: dcp.save never finished")
                self.log.append(f"{tmp.name}: never committed ({how}); removed")
                shutil.rmtree(tmp)
            for path in reversed(self.committed()):
                why = self.problem(path)
                if why is None:
                    choice = [str(path)]
                    break
                self.log.append(f"{path.name}: {why}; skipped")
            for line in self.log:
                print(f"checkpoint {line}", flush=True)
        if dist.is_initialized():
            dist.broadcast_object_list(choice, src=0)
        return Path(choice[0]) if choice[0] else None



def read_manifest(path: str | os.PathLike) -> dict:
    """What commit() wrote next to a checkpoint's files (empty if there is none)."""
    manifest = Path(path) / MANIFEST
    return json.loads(manifest.read_text()) if manifest.exists() else {}


def _fsync(path: Path) -> None:
    """Flush a file's (or a folder's entries') data to disk: a rename survives a power cut
    only if what it points at was on disk first."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def state_digest(model, optimizer) -> str:
    """sha256 of the full (unsharded) model and optimizer state, on every rank (collective).

    The same training state gives the same digest whatever the number of ranks or the wrapping,
    so it proves a reload, a reshard or a resume exact to the last bit.
    """
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_sd, optim_sd = get_state_dict(model, optimizer, options=options)
    digest = [None]
    if _rank0():
        h = hashlib.sha256()
        for key, value in sorted(_flatten({"model": model_sd, "optim": optim_sd}).items()):
            h.update(key.encode())
            if isinstance(value, torch.Tensor):
                h.update(value.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
            else:
                h.update(repr(value).encode())
        digest = [h.hexdigest()]
    if dist.is_initialized():
        dist.broadcast_object_list(digest, src=0)
    return digest[0]


def _flatten(obj, prefix: str = "") -> dict:
    if isinstance(obj, dict):
        return {k: v for key, val in obj.items() for k, v in _flatten(val, f"{prefix}{key}.").items()}
    if isinstance(obj, (list, tuple)):
        return {k: v for i, val in enumerate(obj) for k, v in _flatten(val, f"{prefix}{i}.").items()}
    return {prefix.rstrip("."): obj}

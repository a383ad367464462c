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
    """This rank's random generators: Python's, torch's CPU generator, and the CUDA generator
    of `device` when it is a GPU. (NumPy's is not saved: nothing here draws from it.)

    Every rank has its own generator states, so the key names the rank ("rank1"): a tensor
    that is not a DTensor counts as replicated, and DCP would keep one rank's copy only.
    """

    def __init__(self, rank: int, device: torch.device = torch.device("cpu")):
        self.key, self.cuda = f"rank{rank}", device.type == "cuda"

    def state_dict(self):
        state = {"python": random.getstate(), "torch": torch.get_rng_state()}
        if self.cuda:
            state["cuda"] = torch.cuda.get_rng_state()
        return {self.key: state}

    def load_state_dict(self, state_dict):
        state = state_dict[self.key]
        random.setstate(state["python"])
        torch.set_rng_state(state["torch"])
        if self.cuda:
            torch.cuda.set_rng_state(state["cuda"])

    def saved_in(self, path: str | os.PathLike, prefix: str = "rng") -> bool:
        """Whether the checkpoint holds this rank's states (not when saved by fewer ranks, or
        on a CPU when this rank is on a GPU)."""
        keys = saved_keys(path)
        return all(f"{prefix}.{self.key}.{k}" in keys for k in self.state_dict()[self.key])


def saved_keys(path: str | os.PathLike) -> set[str]:
    """The flattened keys a checkpoint holds ("app.model.lm_head.weight", ...), read from its
    .metadata file alone."""
    return set(dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata)


def _rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _from_rank0(obj):
    """obj as rank 0 has it, on every rank."""
    if not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _file_facts(folder: Path, names: list[str]) -> dict:
    """{name: {"bytes", "sha256"}} for the files of a folder; every rank hashes its share in
    parallel (rank 0 alone would read back every rank's shards, and the others would wait)."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    mine = {n: {"bytes": (folder / n).stat().st_size, "sha256": _sha256(folder / n)}
            for n in sorted(names)[rank::world]}
    if not dist.is_initialized():
        return mine
    shares = [None] * world
    dist.all_gather_object(shares, mine)
    return {n: f for share in shares for n, f in sorted(share.items())}


class CheckpointDir:
    """Committed checkpoints ROOT/step_NNNNNN/, written atomically; the newest `keep` stay.

    Every method is collective (all ranks call it, or one process without a process group);
    rank 0 renames and deletes and tells the others. The folder must be one that every rank
    sees (a shared file system across nodes), as DCP's FileSystemWriter requires anyway.
    """

    def __init__(self, root: str | os.PathLike, keep: int = 2):
        self.root, self.keep = Path(root), keep
        self.log: list[str] = []  # what commit() and latest() did besides the obvious

    def path(self, step: int) -> Path:
        return self.root / f"step_{step:06d}"

    def begin(self, step: int) -> Path:
        """The folder to write step's checkpoint into: step_NNNNNN.tmp/, empty. (Never an
        existing folder: DCP writing into one would leave the old .metadata valid until the
        new one replaces it, so a crash mid-save would pair old metadata with new shards.)"""
        tmp = self.path(step).with_suffix(".tmp")
        if _rank0():
            shutil.rmtree(tmp, ignore_errors=True)
            self.root.mkdir(parents=True, exist_ok=True)
        _barrier()
        return tmp

    def commit(self, step: int, **facts) -> Path:
        """Seal step_NNNNNN.tmp/ once dcp.save has returned (on every rank: all shards and
        .metadata are on disk): a manifest, then an atomic rename; then keep the newest K."""
        tmp, final = self.path(step).with_suffix(".tmp"), self.path(step)
        files = _file_facts(tmp, [p.name for p in tmp.iterdir()])
        if _rank0():
            manifest = tmp / MANIFEST
            manifest.write_text(json.dumps({"step": step, **facts, "files": files}, indent=1))
            for p in [*tmp.iterdir(), tmp]:  # on disk before the rename makes them "latest"
                _fsync(p)
            # Checkpoints at this step or later belong to a future this run abandoned (it
            # resumed from an earlier one): out of the way first, else keep-last-K would keep
            # them and delete this one. Renamed aside, so "latest" is never missing.
            for newer in [p for p in self.committed() if p.name >= final.name]:
                self.log.append(f"{newer.name}: newer than this run's step {step}; removed")
                os.replace(newer, newer.with_suffix(".old"))
            os.replace(tmp, final)  # atomic: readers see no step_NNNNNN/, or all of it
            _fsync(self.root)
            for old in [*self.root.glob("step_*.old"), *self.committed()[:-self.keep]]:
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
        """Why the checkpoint in `path` cannot be trusted, or None when every file is whole.
        (Collective under a process group: each rank checks its share of the files.)"""
        try:
            manifest = json.loads((path / MANIFEST).read_text())
        except (OSError, ValueError):
            return f"no readable {MANIFEST}"
        found = {p.name for p in path.iterdir()} - {MANIFEST}
        for name in sorted(found ^ set(manifest["files"])):
            return f"{name} is {'missing' if name in manifest['files'] else 'not in the manifest'}"
        for name, got in _file_facts(path, sorted(found)).items():
            want = manifest["files"][name]
            if got["bytes"] != want["bytes"]:
                return f"{name} has {got['bytes']} bytes, the manifest says {want['bytes']}"
            if got["sha256"] != want["sha256"]:
                return f"{name} does not match its sha256 in the manifest"
        return None

    def latest(self) -> Path | None:
        """The newest checkpoint whose files all match their manifest (None: start fresh).
        Each skipped checkpoint is reported with its reason. A .tmp folder that a crash left:
        committed now if its manifest was written and checks out (the crash hit between the
        manifest and the rename), else removed."""
        self.log = []
        for name in _from_rank0(sorted(p.name for p in self.root.glob("step_*.tmp"))):
            tmp = self.root / name
            whole = (tmp / MANIFEST).exists() and self.problem(tmp) is None
            if _rank0():
                if whole:
                    os.replace(tmp, tmp.with_suffix(""))
                    self.log.append(f"{name}: written whole but not renamed; committed now")
                else:
                    how = ("dcp.save had finished" if (tmp / ".metadata").exists()
                           else "no .metadata: dcp.save never finished")
                    self.log.append(f"{name}: never committed ({how}); removed")
                    shutil.rmtree(tmp)
            _barrier()
        choice = None
        for name in reversed(_from_rank0([p.name for p in self.committed()])):
            why = self.problem(self.root / name)
            if why is None:
                choice = self.root / name
                break
            self.log.append(f"{name}: {why}; skipped")
        if _rank0():
            for line in self.log:
                print(f"checkpoint {line}", flush=True)
        return choice


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
    digest = None
    if _rank0():
        h = hashlib.sha256()
        for key, value in sorted(_flatten({"model": model_sd, "optim": optim_sd}).items()):
            h.update(key.encode())
            if isinstance(value, torch.Tensor):
                h.update(value.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
            else:
                h.update(repr(value).encode())
        digest = h.hexdigest()
    return _from_rank0(digest)


def _flatten(obj, prefix: str = "") -> dict:
    if isinstance(obj, (dict, list, tuple)):
        items = obj.items() if isinstance(obj, dict) else enumerate(obj)
        return {k: v for key, val in items for k, v in _flatten(val, f"{prefix}{key}.").items()}
    return {prefix.rstrip("."): obj}

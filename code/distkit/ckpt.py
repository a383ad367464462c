"""Chapter 05's checkpoint plumbing: what Distributed Checkpoint (DCP) saves, and where.

What: `AppState` (a model and its optimizer) and `RNGState` (this rank's random generators)
follow DCP's `Stateful` protocol, so `dcp.save` / `dcp.load` call their `state_dict()` and
`load_state_dict()` themselves, the way torchtitan's checkpoint manager does.

Where: `CheckpointDir` keeps committed checkpoints as ROOT/step_000010/ folders. DCP alone
already marks a finished save: it writes `.metadata` last, so "a fresh folder per step, and
.metadata exists" means complete (torchtitan's rule). On top of that, as hardening, a
checkpoint is written into step_000010.tmp/ and committed by rank 0 with one atomic rename once
every rank has written its shards, after a manifest.json (size and sha256 of every file) is
written into it. So a crash mid-save leaves a .tmp folder, never a half-written "latest"; a
damaged file is caught by its checksum; `latest()` picks the newest checkpoint that passes, and
says why it skipped the others. Only the newest `keep` checkpoints stay.

Collectives: rank 0 alone lists folders and reads manifests and tells the others
(broadcast_object_list); every rank enters every collective whatever it sees; each rank hashes
the files it wrote, and every verdict is computed from the same gathered facts, so all ranks
agree. (On a shared file system with stale caches, ranks that each list a folder themselves can
see different files: then some skip a collective the others wait in, and the job hangs.)
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.planner import LoadItemType
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_state_dict,
                                                     set_state_dict)
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_leaves

MANIFEST = "manifest.json"
STEP_NAME = re.compile(r"step_(\d+)")  # a checkpoint folder's name, its step as digits


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
    that is not a DTensor counts as replicated, and DCP would keep one rank's copy only. Loaded
    on more ranks than saved it (or on a GPU after a CPU run), a rank finds no key of its own:
    load it with DefaultLoadPlanner(allow_partial_load=True), and that rank keeps its own
    generators (a key not in the checkpoint is left as state_dict() gave it).
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


class Stager(DefaultStager):
    """DCP's DefaultStager for dcp.async_save, made once per run (torchtitan does the same):
    it copies this rank's state into host memory in a background thread (on a GPU: into pinned
    memory, with non-blocking copies), allocating that copy at the first save and refilling
    the same buffers at every save after. So: wait for `staging_completion` before the weights
    change, and for the previous upload before the next save. Close it after the last save.

    `host_bytes` records, per save, the bytes of host memory the staged copy holds and how
    many of them were buffers of the previous save, reused.
    """

    def __init__(self, device: torch.device):
        cuda = device.type == "cuda"  # pinned memory and non-blocking copies need a GPU
        super().__init__(StagingOptions(use_pinned_memory=cuda, use_shared_memory=False,
                                        use_async_staging=True, use_non_blocking_copy=cuda))
        self.host_bytes: list[dict] = []
        self._last: set[int] = set()

    def stage(self, state_dict, **kwargs):
        stream = getattr(self, "_staging_stream", None)  # DefaultStager's side stream (a GPU)
        if stream is not None:
            # The copies run on that stream, from a thread, and torch 2.13's DefaultStager
            # (staging.py, _stage) orders them after nothing: without this, they could read the
            # weights before the optimizer step still queued on the training stream has written
            # them. An event wait on the GPU, the host does not block.
            stream.wait_stream(torch.accelerator.current_stream())
        future = super().stage(state_dict, **kwargs)
        future.add_done_callback(self._measure)  # runs in the staging thread
        return future

    def _measure(self, future) -> None:
        if future.exception() is not None:
            return
        storages = {}
        for t in tree_leaves(future.result()):
            if isinstance(t, torch.Tensor):
                t = t.to_local() if isinstance(t, DTensor) else t
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        self.host_bytes.append({"bytes": sum(storages.values()),
                                "reused": sum(n for p, n in storages.items() if p in self._last)})
        self._last = set(storages)


class ReadLog(DefaultLoadPlanner):
    """DCP's default load planner, which also notes what this rank reads of one tensor: for
    each piece, its rows of the global tensor and the file they come from. (`.metadata` says
    what was saved, not what a loader reads: that is decided here, by the planner, from the
    loading rank's own shard.) `key` ends the flattened key: "model.embed_tokens.weight"."""

    def __init__(self, key: str, **kwargs):
        super().__init__(**kwargs)
        self.key, self.reads = key, []

    def create_local_plan(self):
        plan = super().create_local_plan()
        for item in plan.items:
            fqn, where = item.storage_index.fqn, item.storage_index
            if item.type == LoadItemType.TENSOR and (fqn == self.key or
                                                     fqn.endswith("." + self.key)):
                file = self.metadata.storage_data[where].relative_path
                if not item.lengths:  # a 0-d tensor (a step counter): all of it
                    self.reads.append((fqn, "all", file))
                    continue
                first = where.offset[0] + item.storage_offsets[0]  # a row of the global tensor
                self.reads.append((fqn, f"rows {first}-{first + item.lengths[0] - 1}", file))
        return plan

    def report(self) -> list[str]:
        """One line per rank, in rank order, the same list on every rank (a collective); []
        when no rank read any piece of such a tensor (no key ends in `key`)."""
        every = _gathered(self.reads)
        if not any(every):
            return []
        return [f"rank {r}: " + (", ".join(f"{what} from {file}" for _, what, file in reads)
                                 or "nothing") for r, reads in enumerate(every)]


def saved_keys(path: str | os.PathLike) -> set[str]:
    """The flattened keys a checkpoint holds ("app.model.lm_head.weight", ...), read from its
    .metadata file alone. (Unpickled: read only checkpoints you trust.)"""
    return set(dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata)


def _rank_world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def _rank0() -> bool:
    return _rank_world()[0] == 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _from_rank0(obj):
    """obj as rank 0 has it, on every rank (a collective)."""
    if not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _gathered(obj) -> list:
    """[every rank's obj], the same list on every rank (a collective)."""
    if not dist.is_initialized():
        return [obj]
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, obj)
    return every


def _listing(folder: Path) -> list[str]:
    """The names in a folder, as this process sees it ([] if it cannot be read). Only rank 0's
    listing is ever used: the others may see a stale one."""
    try:
        return sorted(p.name for p in folder.iterdir())
    except OSError:
        return []


def step_of(name: str) -> int | None:
    """The step of a checkpoint folder's name ("step_1000000" -> 1000000), else None. Compare
    steps as numbers: as strings "step_1000000" < "step_999999"."""
    match = STEP_NAME.fullmatch(name)
    return int(match[1]) if match else None


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _writer_of(name: str, world: int) -> int:
    """The rank that wrote a DCP file: __R_*.distcp is rank R's; .metadata and anything else
    (or a file of a rank this world does not have) is rank 0's."""
    match = re.match(r"__(\d+)_", name)
    return int(match[1]) if match and int(match[1]) < world else 0


_HASHED: dict[str, dict] = {}  # folder -> what own_files() read back there (for commit())


def own_files(folder: str | os.PathLike) -> dict:
    """{name: {"bytes", "sha256"}} of the files in `folder` that this rank wrote (see
    _writer_of), read back and hashed. No collective: a thread beside training can run it once
    the rank's save is written. The result is remembered: CheckpointDir.commit() of that folder
    then takes it instead of reading and hashing the files again in the training thread. (This
    process lists the folder itself: it sees the files it wrote; commit() hashes any it missed.)"""
    rank, world = _rank_world()
    folder = Path(folder)
    facts = {name: {"bytes": (folder / name).stat().st_size, "sha256": _sha256(folder / name)}
             for name in _listing(folder) if _writer_of(name, world) == rank}
    _HASHED[str(folder)] = facts
    return facts


def _file_facts(folder: Path, names: list[str]) -> dict:
    """{name: {"bytes", "sha256"} or {"error"}} for these files of a folder, the same dict on
    every rank (a collective; every rank must pass the same names). Each rank reads back the
    files it wrote itself (__RANK_*.distcp: on its own node's page cache, not over the network),
    unless own_files() already did; a file it cannot read becomes an "error" entry instead of
    an exception, so no rank leaves the collective early."""
    rank, world = _rank_world()
    known = _HASHED.pop(str(folder), {})
    mine = {}
    for name in names:
        if _writer_of(name, world) == rank:
            if name in known:
                mine[name] = known[name]
                continue
            try:
                mine[name] = {"bytes": (folder / name).stat().st_size,
                              "sha256": _sha256(folder / name)}
            except OSError as e:
                mine[name] = {"error": f"unreadable on rank {rank} ({e.strerror or e})"}
    return {n: f for share in _gathered(mine) for n, f in sorted(share.items())}


class CheckpointDir:
    """Committed checkpoints ROOT/step_NNNNNN/, written atomically; the newest `keep` stay.

    Every method but path() and committed() is collective (all ranks call it, or one process
    without a process group); rank 0 lists, reads, renames and deletes, and tells the others.
    The folder must be one that every rank sees (a shared file system across nodes), as DCP's
    FileSystemWriter requires anyway.
    """

    def __init__(self, root: str | os.PathLike, keep: int = 2):
        self.root, self.keep = Path(root), keep
        self.log: list[str] = []  # what commit() and latest() did besides the obvious
        self.skipped: list[str] = []  # latest()'s checkpoints that failed their check, and why

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
        .metadata are on disk; after async_save: once its upload is done): a manifest, then an
        atomic rename; then keep the newest K. Every rank reads back and hashes what it wrote,
        which costs a read of the whole checkpoint (12 bytes per parameter) at every save."""
        tmp, final = self.path(step).with_suffix(".tmp"), self.path(step)
        files = _file_facts(tmp, _from_rank0(_listing(tmp)))
        if bad := [f"{n}: {f['error']}" for n, f in files.items() if "error" in f]:
            raise RuntimeError(f"cannot commit {tmp.name}: " + "; ".join(bad))  # on every rank
        if _rank0():
            manifest = tmp / MANIFEST
            manifest.write_text(json.dumps({"step": step, **facts, "files": files}, indent=1))
            for p in [*tmp.iterdir(), tmp]:  # on disk before the rename makes them "latest"
                _fsync(p)
            # Checkpoints at this step or later belong to a future this run abandoned (it
            # resumed from an earlier one): out of the way first, else keep-last-K would keep
            # them and delete this one. Renamed aside, so "latest" is never missing.
            for newer in [p for p in self.committed() if step_of(p.name) >= step]:
                self.log.append(f"{newer.name}: newer than this run's step {step}; removed")
                os.replace(newer, newer.with_suffix(".old"))
            os.replace(tmp, final)  # atomic: readers see no step_NNNNNN/, or all of it
            _fsync(self.root)
            for old in [*self.root.glob("step_*.old"), *self.committed()[:-self.keep]]:
                shutil.rmtree(old)
        _barrier()
        return final

    def set_aside_after(self, step: int) -> list[str]:
        """A resume from an older checkpoint (train_llama.py --resume-from): rename every
        committed checkpoint newer than `step` to step_NNNNNN.old at once, before anything is
        trained, so that a requeue of a job killed before its first commit cannot take that
        abandoned future for the newest checkpoint. They stay on disk until the first commit,
        which removes step_*.old. Collective; returns the names set aside."""
        moved = []
        if _rank0():
            for newer in [p for p in self.committed() if step_of(p.name) > step]:
                os.replace(newer, newer.with_suffix(".old"))
                moved.append(newer.name)
            _fsync(self.root)
        _barrier()
        return _from_rank0(moved)

    def committed(self) -> list[Path]:
        """Committed checkpoint folders as this process sees them, oldest first by step
        number (no check of their contents; not collective)."""
        steps = [(step_of(name), name) for name in _listing(self.root)]
        return [self.root / name for step, name in sorted(s for s in steps if s[0] is not None)
                if (self.root / name).is_dir()]

    @staticmethod
    def problem(path: Path) -> str | None:
        """Why the checkpoint in `path` cannot be trusted, or None when every file is whole.
        (Collective under a process group: rank 0 reads the manifest and lists the folder,
        each rank checks the files it wrote; every rank returns the same answer.)"""
        def seen():  # on rank 0 only
            try:
                manifest = json.loads((path / MANIFEST).read_text())
            except (OSError, ValueError):
                return None, []
            return manifest, [n for n in _listing(path) if n != MANIFEST]
        manifest, found = _from_rank0(seen() if _rank0() else None)
        want = manifest["files"] if manifest else {}
        # every rank passes the same names, whatever the verdict: no rank skips the collective
        got = _file_facts(path, sorted(set(found) & set(want)))
        if manifest is None:
            return f"no readable {MANIFEST}"
        for name in sorted(set(found) ^ set(want)):
            return f"{name} is {'missing' if name in want else 'not in the manifest'}"
        for name, fact in got.items():
            if "error" in fact:
                return f"{name} is {fact['error']}"
            if fact["bytes"] != want[name]["bytes"]:
                return f"{name} has {fact['bytes']} bytes, the manifest says {want[name]['bytes']}"
            if fact["sha256"] != want[name]["sha256"]:
                return f"{name} does not match its sha256 in the manifest"
        return None

    def latest(self) -> Path | None:
        """The newest checkpoint whose files all match their manifest (None: start fresh).
        Each skipped checkpoint is reported with its reason. A .tmp folder that a crash left:
        committed now if its manifest was written and checks out (the crash hit between the
        manifest and the rename), else removed."""
        self.log = []
        names = _listing(self.root) if _rank0() else []
        tmps = _from_rank0(sorted((n for n in names if n.endswith(".tmp") and step_of(n[:-4])
                                   is not None), key=lambda n: step_of(n[:-4])))
        for name in tmps:
            tmp = self.root / name
            whole = self.problem(tmp) is None  # collective: every rank calls it
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
        choice, self.skipped = None, []
        names = _from_rank0([p.name for p in self.committed()] if _rank0() else [])
        for name in reversed(names):
            why = self.problem(self.root / name)  # the same verdict on every rank
            if why is None:
                choice = self.root / name
                break
            self.skipped.append(f"{name}: {why}")
            self.log.append(f"{name}: {why}; skipped")
        if choice is not None and _rank0():
            # keep-last-K again: a rank killed between a commit's rename and its pruning
            # leaves K + 1; the chosen one and the K - 1 before it stay (newer, damaged ones go
            # at the next commit, which moves aside whatever is newer than its step)
            older = [p for p in self.committed() if step_of(p.name) < step_of(choice.name)]
            for old in older[:max(0, len(older) - (self.keep - 1))]:
                self.log.append(f"{old.name}: more than keep={self.keep}; removed")
                shutil.rmtree(old)
        _barrier()
        if _rank0():
            for line in self.log:
                print(f"checkpoint {line}", flush=True)
        return choice

    def resume_point(self, script: str) -> Path | None:
        """latest(), for a --resume: None only when the folder holds no checkpoint at all (a
        fresh start). When it holds some and none checks out, this stops the run (SystemExit on
        every rank, one line naming each checkpoint and why) and changes nothing: a restart
        from step 0 would overwrite the run's metrics and, at its first commits, the damaged
        checkpoints, which may only need a file copied back."""
        choice = self.latest()
        if choice is None and self.skipped:
            raise SystemExit(  # (printed by rank 0; the others exit with status 1 too)
                f"{script}: --resume: {len(self.skipped)} checkpoint(s) in {self.root}, none "
                f"usable ({'; '.join(self.skipped)}); nothing changed: restore a checkpoint's "
                "files, or start over in another folder" if _rank0() else 1)
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

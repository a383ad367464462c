"""Process-group set-up and printing, shared by every lesson script."""
from __future__ import annotations

import argparse
import inspect
import json
import logging
import math
import os
import random
import sys
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

# Short enough that a mismatched collective fails within a minute instead of hanging for torch's
# defaults (30 minutes for gloo: torch.distributed.constants.default_pg_timeout; 10 minutes for
# NCCL); long enough for slow CPU steps. Override per run with COURSE_TIMEOUT_S.
DEFAULT_TIMEOUT_S = 60
CODE = Path(__file__).resolve().parent.parent  # the course's code/ folder


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str


def pick_device(local_rank: int = 0) -> tuple[torch.device, str]:
    """CUDA + NCCL when a GPU is visible, else CPU + gloo; COURSE_DEVICE=cpu|cuda overrides."""
    want = os.environ.get("COURSE_DEVICE", "").strip().lower()
    if want not in ("", "cpu", "cuda"):
        raise ValueError(f"COURSE_DEVICE must be 'cpu' or 'cuda', got {want!r}")
    if want == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("COURSE_DEVICE=cuda but torch sees no CUDA device")
    if want == "cuda" or (want == "" and torch.cuda.is_available()):
        if local_rank >= torch.cuda.device_count():
            # two ranks on one GPU: NCCL refuses or hangs; better a clear error now
            raise RuntimeError(f"LOCAL_RANK {local_rank} but only {torch.cuda.device_count()} "
                               "GPU(s): launch at most one process per GPU "
                               "(or COURSE_DEVICE=cpu)")
        return torch.device("cuda", local_rank), "nccl"
    return torch.device("cpu"), "gloo"


def allow_tracer() -> bool:
    """Let any process of this user read this one's memory, as `py-spy dump` does. Linux's Yama
    (kernel.yama.ptrace_scope = 1, Ubuntu's default) allows only a process's ancestors, and
    py-spy is a sibling of the ranks, not their parent: prctl(PR_SET_PTRACER,
    PR_SET_PTRACER_ANY) lifts that for this process. True when the kernel took it; False
    elsewhere (not Linux; or no Yama, where nothing needs lifting)."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes
    PR_SET_PTRACER, PR_SET_PTRACER_ANY = 0x59616D61, ctypes.c_ulong(-1)  # <linux/prctl.h>
    return ctypes.CDLL(None).prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY, 0, 0, 0) == 0


def setup(timeout_s: float | None = None, cpu_collectives: bool = False) -> DistEnv:
    """Join the process group that torchrun described in our environment variables.

    `cpu_collectives=True` on a GPU also gives the group a gloo backend for CPU tensors
    ("cuda:nccl,cpu:gloo"): FSDP2 with CPUOffloadPolicy keeps gradient shards on the CPU, and
    clip_grad_norm_ all-reduces their norm there (pytorch/pytorch#148532)."""
    if "RANK" not in os.environ:
        script = Path(sys.argv[0]).resolve()
        where = script.relative_to(CODE) if script.is_relative_to(CODE) else script
        sys.exit(f"{script.name}: not started by torchrun; "
                 f"run it as: code/run_w_torchrun.sh NPROC {where} ...")
    if os.environ.get("COURSE_ALLOW_TRACER") == "1":  # launch(stacks_when=...): py-spy will look
        allow_tracer()
    local_rank = int(os.environ["LOCAL_RANK"])
    device, backend = pick_device(local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    timeout = timeout_s or float(os.environ.get("COURSE_TIMEOUT_S", DEFAULT_TIMEOUT_S))
    if cpu_collectives and backend == "nccl":
        backend = "cuda:nccl,cpu:gloo"
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout),
                            device_id=device if device.type == "cuda" else None)
    return DistEnv(dist.get_rank(), dist.get_world_size(), local_rank, device, backend)


def teardown(ok: bool = True) -> None:
    """Leave the process group together, then exit at once. Call it last. `ok=False`: the
    script's own check failed (a parity it prints as False): exit status 1, so that a launch,
    a papermill run or `make gpu-smoke` fails too, not only the notebook's assert.

    The barrier: without it a rank that finishes first can tear down its gloo connections while
    a peer is still completing the last collective; we measured that peer aborting ("terminate
    called without an active exception") in about 1 run in 7 of train_ddp.py on 2 CPU processes.
    The immediate exit: objects that still hold the process group (a DDP model, a memory
    tracker) are otherwise destroyed during interpreter shutdown, where gloo's threads can abort
    the same way (measured: 1 run in 40 of ddp_memory.py on 4 processes).
    Beware when copying it: os._exit skips atexit handlers and unflushed buffers other than
    stdout/stderr (open files, logging handlers, a profiler's trace). Close those first, or
    call dist.barrier() and dist.destroy_process_group() yourself and return normally.
    """
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0 if ok else 1)


def todo(what: str):
    """Stands in an exercise starter where the learner's code goes: stops the run with one line
    saying where and what is missing (on every rank that reaches it), then exits with status 1.
    """
    caller = inspect.currentframe().f_back
    print(f"TODO(you) at {os.path.relpath(caller.f_code.co_filename)}:{caller.f_lineno}: {what}",
          file=sys.stderr, flush=True)
    if dist.is_initialized():  # every rank stops at the same TODO: leave together
        dist.barrier()
        dist.destroy_process_group()
    os._exit(1)  # at once: a normal exit can abort noisily inside gloo's shutdown


def int_list(text: str) -> list[int]:
    """An argparse `type=` for "1,2,4,8" (an empty string gives []): a bad item is one clear
    line."""
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")


def same_on_all_ranks(tensors) -> bool:
    """True when every rank holds exactly the same values: their minimum and maximum over the
    ranks are equal. (A collective: every rank must call it.)"""
    v = torch.cat([t.detach().reshape(-1) for t in tensors])
    lo, hi = v.clone(), v.clone()
    dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    return torch.equal(lo, hi)


# Wrappers that prefix parameter names: DDP, FSDP1, activation checkpointing, torch.compile.
_WRAPPER_PREFIXES = ("module.", "_fsdp_wrapped_module.", "_checkpoint_wrapped_module.",
                     "_orig_mod.")


def grad_norms(model, gather: bool = False) -> dict[str, float]:
    """Every parameter's gradient norm (L2, summed in float64), by name: a fingerprint of one
    step's gradients, which a parity check compares with one process's (at step 1, after the
    backward and before optimizer.step()).

    Why gradients and not only losses: AdamW's update m / (sqrt(v) + eps) ignores a constant
    factor on the gradient, so a missing 1/N, 1/K or 1/m leaves every loss within 1e-4 of one
    process's; the gradients show it at once. Names are the plain model's (DDP's "module." and
    FSDP1's wrapper prefixes removed). A DTensor gradient (FSDP2, tensor parallelism) has its
    norm reduced over the ranks, a collective: every rank calls this (no gradient is gathered
    whole, so a memory tracker around it sees only scalars). `gather=True` merges every rank's
    parameters (a collective too), for a pipeline stage that holds only its own layers."""
    norms = {}
    # On a 2-D mesh DTensor logs that it reduces a norm in two steps: a performance hint, not
    # meant for a one-off check (and a log line in every rank's output)
    hint = logging.getLogger("torch.distributed.tensor._redistribute")
    level = hint.level
    hint.setLevel(logging.ERROR)
    try:
        for name, p in model.named_parameters():
            if p.grad is None:
                continue
            if hasattr(p.grad, "full_tensor"):  # a DTensor: each rank's part, one reduction
                norm = torch.linalg.vector_norm(p.grad.detach()).full_tensor()  # (as clipping)
            else:
                norm = p.grad.detach().double().norm()
            for prefix in _WRAPPER_PREFIXES:
                name = name.replace(prefix, "")
            norms[name] = norm.item()
    finally:
        hint.setLevel(level)
    if gather and dist.is_initialized():
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, norms)
        norms = {name: norm for mine in every for name, norm in mine.items()}
    return dict(sorted(norms.items()))


def grad_check(mine: dict[str, float], reference: dict[str, float]) -> dict:
    """How far `grad_norms` lie from the reference's (one process's), in the course's two
    numbers: "gap", the largest difference over the largest norm (inf when the parameters
    differ or a norm is not finite), and "scale", <mine, ref> / <ref, ref> (1: the same
    gradients; K: K times too large, a sum where a mean was due)."""
    if not reference or mine.keys() != reference.keys():
        return {"gap": math.inf, "scale": math.nan}
    m = [mine[k] for k in reference]
    r = [reference[k] for k in reference]
    if not all(math.isfinite(x) for x in m + r) or max(r) == 0:
        return {"gap": math.inf, "scale": math.nan}
    return {"gap": max(abs(a - b) for a, b in zip(m, r)) / max(r),
            "scale": sum(a * b for a, b in zip(m, r)) / sum(b * b for b in r)}


def run_script(path: Path, args, out, err=None) -> int:
    """Run a script in this process as `python SCRIPT ARGS` would (as __main__, its folder first
    on sys.path), its stdout into `out` and its stderr into `err` (None: left as it is); returns
    its exit status: sys.exit's, or 0 when it returns. sys.argv and sys.path are restored."""
    import contextlib
    import runpy
    argv, path_before = sys.argv, list(sys.path)
    sys.argv = [str(path), *map(str, args)]
    sys.path.insert(0, str(Path(path).parent))
    try:
        with contextlib.redirect_stdout(out), \
                contextlib.redirect_stderr(err) if err is not None else contextlib.nullcontext():
            runpy.run_path(str(path), run_name="__main__")
        return 0
    except SystemExit as e:  # sys.exit(...), parser.error(), --help
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        (sys.stderr if err is None else err).write(f"{e.code}\n")  # as Python prints it
        return 1
    finally:
        sys.argv, sys.path[:] = argv, path_before


def one_process_reference(script: str, *args, label: str = "one process: ") -> dict | None:
    """The one-process run a parity check compares with, inside this launch: rank 0 runs
    SCRIPT (a one-process script, relative to code/, e.g. "ch01_ddp/train_single.py") in this
    very process, as `python code/SCRIPT ARGS --json FILE` would, and returns the JSON it
    writes; every other rank returns None (and waits for rank 0 at its next collective).
    No second Python importing torch and transformers: the rank has them already. The
    script's lines are printed with `label` in front. Call it before seeding: the script seeds
    itself and leaves the random state where its run ended."""
    if _rank() != 0:
        return None
    import io
    import tempfile
    out = io.StringIO()
    with tempfile.TemporaryDirectory() as tmp:
        status = run_script(CODE / script, [*args, "--json", Path(tmp) / "reference.json"], out)
        for line in out.getvalue().splitlines():
            print(f"{label}{line}", flush=True)
        if status:
            sys.exit(f"the one-process reference {script} failed (exit status {status})")
        return json.loads((Path(tmp) / "reference.json").read_text())


def seed_everything(seed: int) -> None:
    random.seed(seed)
    try:
        import numpy as np
        np.random.seed(seed)
    except ImportError:
        pass
    torch.manual_seed(seed)  # seeds CUDA too


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def print0(*args, **kwargs) -> None:
    """print() on rank 0 only: one copy of what every rank would print the same."""
    if _rank() == 0:
        print(*args, **kwargs, flush=True)


def print_ranks(text: str) -> None:
    """Every rank's text, printed by rank 0 in rank order, each line tagged with its rank.

    Ranks are separate processes whose prints race each other to the terminal; gathering the
    text to one rank is the only way to get the same output on every run. Collective: all
    ranks must call it.
    """
    text = str(text)
    if not dist.is_initialized():
        texts = [text]
    else:
        texts = [None] * dist.get_world_size() if _rank() == 0 else None
        dist.gather_object(text, texts, dst=0)
    if _rank() == 0:
        for r, t in enumerate(texts):
            for line in t.splitlines() or [""]:
                print(f"[rank {r}] {line}")
        sys.stdout.flush()


def write_json(path: str | os.PathLike | None, obj) -> None:
    """Rank 0 writes obj as JSON (the measured results a notebook plots or a test asserts)."""
    if path and _rank() == 0:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(obj, indent=1))

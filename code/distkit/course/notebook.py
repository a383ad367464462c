"""Helpers for the notebooks: launch a lesson script, show the diff between two scripts."""
from __future__ import annotations

import ast
import difflib
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

CODE = Path(__file__).resolve().parents[2]  # the course's code/ folder
ROOT = CODE.parent
LAUNCHER = CODE / "run_w_torchrun.sh"
# Seconds torchrun gives the ranks to exit once stopped (the launcher's SHUTDOWN_TIMEOUT, here
# its default, torchrun's own): chapter 06's ranks save a checkpoint on SIGTERM, which a loaded
# machine makes slow, while a rank that does not catch SIGTERM dies at once. A cell that stops a
# launch waits STOP_GRACE_S more for torchrun before it kills what is left of the launch.
SHUTDOWN_S, STOP_GRACE_S = 30, 10
# Set for every launch from here: distkit/course/torchrun.py then leaves an interrupt (SIGINT, which
# reaches the whole process group of an interrupted kernel) to us, and we stop the launch.
CALLER_STOPS = {"DISTKIT_CALLER_STOPS": "1"}


class LaunchFailed(subprocess.CalledProcessError):
    """A launch or script that failed. Its message ends with the last TAIL lines of the output:
    nbval (and any report that prints the exception, not the cell's output) then shows the
    script's own traceback, not only "returned non-zero exit status 1"."""
    TAIL = 20

    def __str__(self) -> str:
        tail = _relative(self.output or "").rstrip("\n").splitlines()[-self.TAIL:]
        return super().__str__() + "".join(f"\n  | {line}" for line in tail)


class Interrupted(KeyboardInterrupt):
    """An interrupted launch: IPython shows it as its one line (`_render_traceback_`, the hook
    IPython calls instead of printing a traceback), not as a traceback into this module."""

    def _render_traceback_(self) -> list[str]:
        return [str(self)]


def require(*checks: tuple[bool, str]) -> None:
    """Validate a notebook's parameters before anything is launched.

    `require((NPROC >= 2, "NPROC must be at least 2"), ...)` raises one ValueError that lists
    every failed check's message, so a learner reads what to change, not a traceback from deep
    inside a run.
    """
    failed = [message for ok, message in checks if not ok]
    if failed:
        raise ValueError("bad parameters: " + "; ".join(failed))


def _shown(arg) -> str:
    """An argument as the learner should read it: paths inside the repo relative to its root."""
    path = Path(arg) if isinstance(arg, os.PathLike) else None
    if path is not None and path.is_absolute() and path.is_relative_to(ROOT):
        return str(path.relative_to(ROOT))
    return str(arg)


def _relative(text: str) -> str:
    """Output as the learner should read it: the repo's absolute path (this machine's) cut, so a
    script's "exported to build/ch06/a/hf" reads the same in every checkout."""
    return text.replace(f"{ROOT}{os.sep}", "")


def launch(nproc: int, script: str, *args, ranks: str | None = None,
           env: dict | None = None, expect_failure: bool = False,
           short_tracebacks: bool = False, stop_when=None,
           stacks_when: str | None = None, limit: float | None = None,
           hide_output: str | None = None) -> int | None:
    """Run `code/run_w_torchrun.sh NPROC SCRIPT ARGS...` and stream its output.

    Raises LaunchFailed (a CalledProcessError whose message ends with the output's last lines)
    when the launch fails, so the notebook cell fails too (a plain `!cmd` would print the error
    and carry on). `ranks="0"` shows only rank 0's output.
    `expect_failure=True` is for demonstrating a failure: it shows only the error lines of each
    rank and raises if the launch *succeeds*.
    `short_tracebacks=True` shows each rank's traceback as its last line only (the error), for
    runs where a rank fails on purpose and the group carries on (torchrun's restarts).
    `stop_when` (a function, polled 5 times a second) sends torchrun SIGTERM once it returns
    True, as a cluster does when it preempts a job; the launch may then end with torchrun's
    "ended by SIGTERM" status (143) without raising, and the exit status is returned. Otherwise
    returns nothing (a cell ending with a launch shows only its output): the output is already
    on screen, and results come back as JSON files.
    `stacks_when` (a regular expression): once a line of output matches it, wait a second, then
    show every rank's Python stack (`py-spy dump`, see rank_stacks), as you would for a run that
    seems to hang; they are kept in `launch.stacks` (rank -> frames, innermost first).
    `limit` (seconds): stop torchrun (SIGTERM, passed on to the ranks; SIGKILL SHUTDOWN_S later)
    if it still runs then, and raise TimeoutExpired: a demo of a failure may not hang the notebook.
    Interrupting the kernel stops the launch the same way and ends the cell with one line
    ("interrupted: stopped 2 ranks"), raised as `Interrupted`, a KeyboardInterrupt.
    `hide_output` (a sentence): show the command, then this sentence instead of the output (a
    solution whose output answers an exercise: the cell checks it without spoiling it); a
    failure still raises LaunchFailed with the output's last lines.
    """
    cmd = [str(LAUNCHER), str(nproc), script, *map(str, args)]
    launch.count += 1
    # printed relative to the repo root, so the output reads the same on every machine
    print("$ code/run_w_torchrun.sh", shlex.join([str(nproc), script, *map(_shown, args)]),
          flush=True)
    run_env = {**os.environ, "PYTHON": sys.executable, **(env or {})}
    if ranks is not None:
        run_env["RANKS"] = ranks
    run_env.setdefault("SHUTDOWN_TIMEOUT", str(SHUTDOWN_S))
    grace = int(run_env["SHUTDOWN_TIMEOUT"]) + STOP_GRACE_S
    run_env.update(CALLER_STOPS)
    run_env.update({"COURSE_ALLOW_TRACER": "1"} if stacks_when else {})  # py-spy: dist.allow_tracer
    started = _cpu_clock()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=run_env)
    if stop_when is not None:
        threading.Thread(target=_stop_when, args=(proc, stop_when), daemon=True).start()
    fired = []  # _stop notes here that the limit was reached
    timer = threading.Timer(limit, _stop, args=(proc, fired, grace)) if limit else None
    if timer:
        timer.start()
    # short_tracebacks: the ranks whose traceback is being printed, by their "[rankN]: " prefix
    # ("" before the process group names them): another rank's line inside one ends nothing
    lines, in_traceback, stacks = [], set(), None
    launch.stacks = {}
    try:
        for line in proc.stdout:  # stream, so long runs show progress
            lines.append(line)
            if stacks_when and re.search(stacks_when, line) and stacks is None:
                stacks = threading.Thread(target=_show_stacks, args=(proc.pid,), daemon=True)
                stacks.start()
            if short_tracebacks:
                prefix = re.match(r"(\[rank\d+\]: )?", line).group(0)
                text = line[len(prefix):]
                if text.startswith("Traceback (most recent call last)"):
                    in_traceback.add(prefix)
                if prefix in in_traceback and (text.startswith(("Traceback", " "))
                                               or not text.strip()):
                    continue  # a frame of this rank's traceback
                in_traceback.discard(prefix)
            if not expect_failure and hide_output is None:
                print(_relative(line), end="", flush=True)
        status = proc.wait()
        _log_launch(script, nproc, started)
    except KeyboardInterrupt:  # the kernel was interrupted: stop every rank, say so in one line
        if timer:
            timer.cancel()
        stopped, left = stop_launch(proc, grace, drain=True)
        raise Interrupted(f"interrupted: stopped {stopped} rank{'s' * (stopped != 1)}"
                          + (f"; still running: pids {left}" if left else "")) from None
    if stacks is not None:
        stacks.join()  # the stacks belong to this cell's output
    if timer:
        timer.cancel()
        if fired:
            raise subprocess.TimeoutExpired(cmd, limit, "".join(lines))
    if expect_failure:
        if status == 0:
            raise AssertionError(f"expected {script} to fail, but it succeeded")
        # Where each rank was: its traceback's frames in the course's own code (with the line
        # of code), then the exception lines ("[rank1]: " once the process group is up).
        frame = re.compile(r'(\[rank\d+\]: )?\s+File "' + re.escape(str(ROOT)) + r'/(code/.*)')
        where = [(m.group(1) or "") + '  File "' + m.group(2) + "\n" + nxt
                 for ln, nxt in zip(lines, lines[1:] + [""]) if (m := frame.match(ln))]
        errors = sorted({ln for ln in lines
                         if re.match(r"(\[rank\d+\]: )?\w*(Error|Exception): ", ln)})
        print(_relative("".join(sorted(where, key=lambda w: w.split(":")[0]) + errors))
              + f"=> failed with exit status {status}, as expected")
    elif status and not (stop_when is not None and status == 128 + signal.SIGTERM):
        raise LaunchFailed(status, cmd, "".join(lines))
    elif hide_output is not None:
        print(hide_output, flush=True)
    return status if stop_when is not None else None


def _cpu_clock() -> tuple[float, float]:
    """(wall seconds, CPU-seconds of this process's waited-for children and their descendants):
    torchrun waits for its ranks, the launcher for torchrun, and we for the launcher."""
    import resource
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.perf_counter(), usage.ru_utime + usage.ru_stime


def _log_launch(script: str, nproc: int, started: tuple[float, float]) -> None:
    """With COURSE_LAUNCH_LOG=FILE (make course sets it), append this launch's script, process
    count, wall and CPU-seconds to FILE as a JSON line: distkit.course.launch_cost reads them."""
    path = os.environ.get("COURSE_LAUNCH_LOG")
    if path:
        import json
        wall, cpu = (now - then for now, then in zip(_cpu_clock(), started))
        with open(path, "a") as f:
            f.write(json.dumps({"script": script, "nproc": nproc, "seconds": round(wall, 2),
                                "cpu_seconds": round(cpu, 2)}) + "\n")


def _stop_when(proc: subprocess.Popen, predicate) -> None:
    while proc.poll() is None:
        try:
            due = predicate()
        except Exception:  # e.g. a file being written: ask again at the next poll
            due = False
        if due:
            proc.send_signal(signal.SIGTERM)  # torchrun passes it on to every rank
            return
        time.sleep(0.2)


def _stop(proc: subprocess.Popen, fired: list, grace: float) -> None:
    fired.append(True)
    stop_launch(proc, grace, drain=False)  # the launch's own thread reads the output


def stop_launch(proc: subprocess.Popen, grace: float, drain: bool) -> tuple[int, list[int]]:
    """Stop a launch: SIGTERM to torchrun, which passes it on to every rank and SIGKILLs those
    still running after its shutdown timeout; `grace` seconds on, SIGKILL whatever is left of
    the launch (torchrun, the ranks, what they started: the ranks run in sessions of their own,
    so nothing else would). `drain`: read the output meanwhile (no one else reads it now), so
    torchrun never blocks writing it. Returns the number of ranks stopped and the pids still
    alive."""
    import psutil
    if proc.poll() is not None:  # torchrun has ended, and its ranks with it
        return 0, []
    try:
        torchrun = psutil.Process(proc.pid)
        ranks, tree = torchrun.children(), torchrun.children(recursive=True)
    except psutil.NoSuchProcess:  # already gone
        ranks, tree = [], []
    if drain:  # not to wait for EOF, which a leftover child holding the pipe would delay
        threading.Thread(target=proc.stdout.read, daemon=True).start()
    try:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=grace)
    except (subprocess.TimeoutExpired, KeyboardInterrupt):  # hung, or interrupted again
        proc.kill()
        proc.wait()
    for p in tree:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(tree, timeout=5)
    return sum(p not in alive for p in ranks), sorted(p.pid for p in alive)


def _show_stacks(torchrun_pid: int) -> None:
    time.sleep(1.0)  # let the ranks get where they wait
    launch.stacks = rank_stacks(torchrun_pid)
    for rank, frames in launch.stacks.items():
        print(f"--- rank {rank}, innermost call first ---\n" + "\n".join(frames), flush=True)


def rank_stacks(torchrun_pid: int) -> dict:
    """Every rank's Python stack, read from outside by py-spy (`py-spy dump --pid PID` for each
    process torchrun started): rank -> frames as "function (file:line)", innermost first, paths
    relative to the repo or to site-packages. py-spy reads another process's memory, which
    needs ptrace permission: on Linux the same user may (unless kernel.yama.ptrace_scope > 0 or
    a container drops the capability), on macOS only root; without it, the error is the frames.
    """
    import psutil
    py_spy = Path(sys.executable).with_name("py-spy")  # installed beside this Python (make setup)
    stacks = {}
    for child in psutil.Process(torchrun_pid).children():
        rank = child.pid  # until its environment says which rank it is
        try:
            rank = int(child.environ().get("RANK", rank))
            out = subprocess.run([str(py_spy) if py_spy.exists() else "py-spy", "dump", "--pid",
                                  str(child.pid)], capture_output=True,
                                 text=True, timeout=20)
        except (psutil.Error, OSError, subprocess.TimeoutExpired) as e:
            stacks[rank] = [f"py-spy failed: {e}"]
            continue
        if out.returncode:
            why = (out.stderr or out.stdout).strip().splitlines()[-1:]
            stacks[rank] = [f"py-spy failed: {why}"]
            continue
        text = re.sub(r"\x1b\[[0-9;]*m", "", out.stdout)  # py-spy colours even into a pipe
        frames = [ln.strip() for ln in text.splitlines() if ln.startswith("    ")]
        stacks[rank] = [re.sub(r"\(" + re.escape(str(ROOT)) + "/", "(", f) for f in frames]
    return dict(sorted(stacks.items()))


# torchrun's warning when the store it polls at exit is already gone, and the stack trace after it
_STORE_GONE = re.compile(r"^\[W[^\n]*TCPStore[^\n]*Connection was likely closed[^\n]*\n"
                         r"(?:(?:Exception raised from|frame #|<omitting)[^\n]*\n|\n)*", re.M)


_WAITING = re.compile(r"^run_w_torchrun.sh: waiting for \d+ nodes at .*\n", re.M)


def launch_nodes(nnodes: int, nproc: int, script: str, *args, timeout: float = 600,
                 stop_when=None) -> None:
    """Rehearse a multi-node launch on this machine: `nnodes` launchers, each with NPROC
    processes, started at once with NNODES and RDZV_ENDPOINT=127.0.0.1:<a free port>, as each
    node of a cluster would run it. torchrun's c10d rendezvous assigns the ranks. Prints each
    "node"'s output once all are done (node order, so it reads the same every time) and raises
    CalledProcessError if any failed; after `timeout` seconds, stops them all and raises
    TimeoutExpired (a "node" that never joins would otherwise keep the others waiting).
    `stop_when`, as for launch: SIGTERM to every "node" once it returns True (a job preempted on
    all its nodes); their exit status 143 (torchrun ended by SIGTERM) is then no failure.
    On a machine with CUDA GPUs each "node" sees its own block of NPROC of them
    (CUDA_VISIBLE_DEVICES), as a real node does: each node's ranks have LOCAL_RANK 0..NPROC-1,
    and two "nodes" sharing cuda:0 would make NCCL refuse ("Duplicate GPU detected")."""
    gpus = _gpus_per_node(nnodes, nproc)
    with socket.socket() as s:  # a free port for the rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    shown = shlex.join([str(nproc), script, *map(_shown, args)])
    print(f"$ NNODES={nnodes} RDZV_ENDPOINT=127.0.0.1:$PORT code/run_w_torchrun.sh {shown}"
          f"   # x {nnodes}, at once", flush=True)
    launch.count += nnodes
    cmd = [str(LAUNCHER), str(nproc), script, *map(str, args)]
    env = {**os.environ, "PYTHON": sys.executable, "NNODES": str(nnodes),
           "RDZV_ENDPOINT": f"127.0.0.1:{port}", "RDZV_ID": f"rehearsal{port}",
           "SHUTDOWN_TIMEOUT": str(SHUTDOWN_S), **CALLER_STOPS}
    if gpus:
        print(f"(each node its own GPUs: CUDA_VISIBLE_DEVICES={' / '.join(gpus)})", flush=True)
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env={**env, **({"CUDA_VISIBLE_DEVICES": gpus[n]} if gpus else {})})
             for n in range(nnodes)]
    if stop_when is not None:
        for p in procs:  # each polls on its own: the ranks agree on the stop in their step
            threading.Thread(target=_stop_when, args=(p, stop_when), daemon=True).start()
    deadline = time.monotonic() + timeout
    try:
        outputs = [p.communicate(timeout=max(1, deadline - time.monotonic()))[0] for p in procs]
    except (subprocess.TimeoutExpired, KeyboardInterrupt) as e:
        stopped = sum(stop_launch(p, SHUTDOWN_S + STOP_GRACE_S, drain=True)[0] for p in procs)
        if isinstance(e, KeyboardInterrupt):
            raise Interrupted(f"interrupted: stopped {stopped} ranks") from None
        raise
    for node, (p, out) in enumerate(zip(procs, outputs)):
        shown = _STORE_GONE.sub("(torchrun at exit: the rendezvous store, hosted by the other "
                                "node's torchrun, had closed first; a harmless race at shutdown, "
                                "cf. pytorch/pytorch#69520; its C++ stack trace is cut)\n", out)
        # started at once, whether one "node" still waits for the other when the launcher says
        # "waiting for 2 nodes" (after 3 s) depends on the machine's load: the line is not shown
        shown = _WAITING.sub("", shown)
        print(f"--- node {node} (exit status {p.returncode}) ---\n{_relative(shown)}", end="",
              flush=True)
    for p, out in zip(procs, outputs):
        if p.returncode and not (stop_when is not None and p.returncode == 128 + signal.SIGTERM):
            raise LaunchFailed(p.returncode, cmd, out)


def _gpus_per_node(nnodes: int, nproc: int) -> list[str]:
    """CUDA_VISIBLE_DEVICES for each rehearsal "node" (empty list: CPU, nothing to split)."""
    import torch
    on_cpu = os.environ.get("COURSE_DEVICE", "").strip().lower() == "cpu"
    if on_cpu or not torch.cuda.is_available():
        return []
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
    if len(ids) < nnodes * nproc:
        raise RuntimeError(f"a rehearsal of {nnodes} nodes x {nproc} GPUs needs {nnodes * nproc} "
                           f"GPUs, this machine has {len(ids)}: set COURSE_DEVICE=cpu to rehearse "
                           "on the CPU")
    return [",".join(ids[n * nproc:(n + 1) * nproc]) for n in range(nnodes)]


launch.stacks = {}
launch.count = 0  # launches so far in this kernel: a notebook's last cell reports them


def _with_code_on_path() -> dict:
    """This environment, with code/ first on PYTHONPATH (the course's scripts import distkit)."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(CODE), *filter(None, [os.environ.get("PYTHONPATH")])])}


def run_python(script: str, *args) -> None:
    """Run `python code/SCRIPT ARGS...`, a one-process script (no torchrun), streaming its
    output; raises LaunchFailed when it fails, so the notebook cell fails too."""
    cmd = [sys.executable, str(CODE / script), *map(str, args)]
    print("$ PYTHONPATH=code python", shlex.join([f"code/{script}", *map(_shown, args)]),
          flush=True)
    env = _with_code_on_path()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env)
    lines = []
    for line in proc.stdout:
        print(_relative(line), end="", flush=True)
        lines.append(line)
    if proc.wait():
        raise LaunchFailed(proc.returncode, cmd, "".join(lines))


class _Relative:
    """A text stream for run_here: writes to `stream` with the repo's absolute path cut
    (_relative), and keeps what was written (for LaunchFailed's message)."""

    def __init__(self, stream):
        self.stream, self.kept = stream, []

    def write(self, text: str) -> int:
        self.kept.append(text)
        return self.stream.write(_relative(text))

    def flush(self) -> None:
        self.stream.flush()

    def isatty(self) -> bool:  # a pipe, as for run_python: no progress bars (tqdm asks)
        return False


def run_here(script: str, *args) -> None:
    """Run a one-process script in this Python (the kernel) as `python code/SCRIPT ARGS...`
    would: the same output and files, without a second Python that imports torch again (about
    1.5 CPU-seconds, 3 with transformers). For scripts that leave no process group behind (a
    simulation's fake one is destroyed by the script) and whose settings later cells do not
    rely on. stdout and stderr come together, as run_python shows them; a non-zero exit raises
    LaunchFailed, as run_python does. Afterwards the random generators are where they were (the
    script seeds its own), and a log handler made while it ran (transformers makes its own at
    its first import) writes to the kernel's stderr, not to this run's capture."""
    import logging
    import random
    import numpy as np
    import torch
    import torch.distributed as dist
    from distkit.dist import run_script
    path = CODE / script
    print("$ PYTHONPATH=code python", shlex.join([f"code/{script}", *map(_shown, args)]),
          flush=True)
    rng = random.getstate(), np.random.get_state(), torch.get_rng_state()
    had_group = dist.is_available() and dist.is_initialized()
    out = _Relative(sys.stdout)
    try:
        code = run_script(path, args, out, out)
    finally:
        random.setstate(rng[0])
        np.random.set_state(rng[1])
        torch.set_rng_state(rng[2])
        for logger in [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]:
            for handler in getattr(logger, "handlers", []):
                if isinstance(handler, logging.StreamHandler) and handler.stream is out:
                    handler.setStream(sys.stderr)
        out.flush()
        if not had_group and dist.is_available() and dist.is_initialized():  # left behind
            dist.destroy_process_group()
            raise RuntimeError(f"{script} left its process group initialised: not for run_here")
    if code:
        raise LaunchFailed(code, [sys.executable, str(path), *map(str, args)], "".join(out.kept))


def run_failing(cmd: list, limit: float, hide: dict | None = None) -> None:
    """Run a command that must fail (a raw `torchrun ...` shown as a learner would type it), for
    at most `limit` seconds: show the command, the lines of its output that name an error, and
    how it ended. Raises if it succeeds or is still running at `limit` (a demo of a failure may
    not hang the notebook). `hide` replaces text in what is shown (e.g. a port: {"29517": "$PORT"}).
    A command starting with "torchrun" runs this Python's torchrun
    (python -m torch.distributed.run).
    """
    def shown(text):
        for old, new in (hide or {}).items():
            text = text.replace(old, new)
        return text
    print("$", shown(shlex.join(map(_shown, cmd))), flush=True)
    env = _with_code_on_path()
    run = [sys.executable, "-m", "torch.distributed.run", *cmd[1:]] if cmd[0] == "torchrun" else cmd
    proc = subprocess.run(run, capture_output=True, text=True, env=env, timeout=limit, cwd=ROOT)
    if proc.returncode == 0:
        raise AssertionError(f"expected {cmd[0]} to fail, but it succeeded")
    errors = dict.fromkeys(ln for ln in (proc.stdout + proc.stderr).splitlines()
                           if re.match(r"(\[rank\d+\]: )?[\w.]*(Error|Exception): ", ln))
    print(shown("\n".join(errors)) + f"\n=> failed with exit status {proc.returncode} within "
          f"{limit:g} s, as expected", flush=True)


def diff(before: str | os.PathLike, after: str | os.PathLike, context: int = 3) -> str:
    """Unified diff of two scripts in code/: what the 'after' version adds to the 'before'."""
    a, b = (CODE / before).read_text().splitlines(), (CODE / after).read_text().splitlines()
    return "\n".join(difflib.unified_diff(a, b, str(before), str(after), n=context, lineterm=""))


def show_diff(before: str, after: str, context: int = 3):
    """The diff as a highlighted code block in a notebook."""
    from IPython.display import Code
    return Code(diff(before, after, context), language="diff")


def source_of(script: str, name: str) -> str:
    """The source of one top-level function or class in a script in code/ (without running it)."""
    text = (CODE / script).read_text()
    for node in ast.parse(text).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name == name:
            start = min([d.lineno for d in node.decorator_list] + [node.lineno])
            return "\n".join(text.splitlines()[start - 1:node.end_lineno])
    raise LookupError(f"no top-level function or class {name!r} in {script}")


def show_lines(script: str, first: str, last: str):
    """The lines of a script in code/ from the one containing `first` up to (without) the next
    one containing `last`, as a highlighted code block: a part of a script that is no function."""
    from IPython.display import Code
    lines = (CODE / script).read_text().splitlines()
    start = next(i for i, ln in enumerate(lines) if first in ln)
    end = next(i for i, ln in enumerate(lines) if i > start and last in ln)
    return Code("\n".join(lines[start:end]), language="python")


def constant_of(script: str, name: str):
    """The value of a top-level constant (a literal: dict, list, number...) in a script in code/,
    read without running the script."""
    for node in ast.parse((CODE / script).read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name
                                                for t in node.targets):
            return ast.literal_eval(node.value)
    raise LookupError(f"no top-level constant {name!r} in {script}")


def show_source(script: str, name: str | None = None):
    """A script in code/ (or one function of it) as a highlighted code block."""
    from IPython.display import Code
    text = source_of(script, name) if name else (CODE / script).read_text()
    return Code(text, language="python")


# --- Chapter 00's checks: what its cells assert, in one call each ---------------------------

def collective_definitions(n: int) -> dict:
    """What each collective of collectives.py leaves on every rank, written as list operations on
    the ranks' inputs with no communication: rank r's input is [10r, 10r + 1, ..., 10r + n-1]."""
    x = [[10 * r + j for j in range(n)] for r in range(n)]  # rank r's input
    total = [sum(col) for col in zip(*x)]                    # element-wise sum over the ranks
    flat = [v for row in x for v in row]                     # every rank's x, concatenated
    return {
        "broadcast": [x[0]] * n,                             # rank 0's x everywhere
        "scatter": [[x[0][r]] for r in range(n)],            # element r of rank 0's x to rank r
        "reduce": [total],                                   # rank 0; the others: undefined
        "gather": [flat] + x[1:],                            # rank 0 gets all; the rest keep theirs
        "all_reduce": [total] * n,
        "all_gather": [flat] * n,
        "reduce_scatter": [[total[r]] for r in range(n)],    # slice r of the sum to rank r
        "all_to_all": [[x[src][r] for src in range(n)] for r in range(n)],  # a transpose
        "send_recv": [x[0], x[0]] + x[2:],                   # rank 1 receives rank 0's x
        "barrier": [[1]] * n,                                # 1: left after the last arrival
    }


def check_collectives(*paths) -> None:
    """Every result of collectives.py's JSON files against collective_definitions (only the
    root's buffer after `reduce`: the others are undefined); raises on the first mismatch."""
    import json
    checked, sizes = 0, []
    for path in paths:
        run = json.loads(Path(path).read_text())
        want = collective_definitions(run["world_size"])
        sizes.append(run["world_size"])
        for op, res in run["ops"].items():
            got = res["after"][:1] if op == "reduce" else res["after"]
            assert got == want[op], f"{op} on {run['world_size']} ranks: {got} != {want[op]}"
            checked += 1
    print(f"{checked} results on N = {' and '.join(map(str, sorted(set(sizes))))} ranks match "
          "plain Python")


def check_ring_bytes(runs: dict) -> None:
    """ring_allreduce.py's byte counts (`runs`: N -> its JSON): each rank's count = the exact
    formula for tensor_split's chunks, their total = 2(N-1)S exactly, each within two float32
    elements of 2(N-1)/N S; and the result = dist.all_reduce's. One line per N."""
    for n, ring in sorted(runs.items()):
        S, sent, approx = ring["bytes"], ring["sent"], ring["approx_sent"]
        assert sent == ring["exact_sent"], (n, sent, ring["exact_sent"])
        assert sum(sent) == 2 * (n - 1) * S, (n, sum(sent), S)
        near = all(abs(s - approx) < 2 * 4 for s in sent)
        assert near and ring["max_diff_below_1e-5"], (n, sent, approx)
        print(f"N={n}: S = {S:,} B; per rank {min(sent) / S:.3f} S = 2(N-1)/N S within 2 "
              f"elements: {near}; exact formula: True; total {sum(sent):,} = 2(N-1)S: True")


def check_async(res: dict, min_bytes: int = 2**20) -> None:
    """What async_collectives.py's run must show on any machine (its JSON): on gloo, a message of
    at least `min_bytes` is not finished right after the call (its bytes take milliseconds to
    move; the check costs microseconds) and is finished after wait(); on every backend it is
    finished after a device sync, and the sum is right. And on gloo, with a sleep as the other
    work (it needs no CPU), overlapping beats one-after-the-other (medians of many rounds)."""
    gloo, n = res["backend"] == "gloo", res["world_size"]
    order_checked = gloo and res["bytes"] >= min_bytes
    for r, c in enumerate(res["checks"]):
        start = c["completed_at_start"] if order_checked else "not checked (small or NCCL)"
        print(f"rank {r}: is_completed() right after the call: {start}; after wait(): "
              f"{c['completed_after_wait']}; after a device sync: {c['completed_after_sync']}; "
              f"x == 1+2+...+N = {n * (n + 1) // 2}: {c['correct']}")
        # gloo's wait() blocks until the work is done; NCCL's only makes the CUDA stream wait
        assert c["completed_after_sync"] and c["correct"]
        assert c["completed_after_wait"] or not gloo
        assert not (order_checked and c["completed_at_start"]), \
            f"rank {r}: a {res['bytes']:,}-byte all_reduce finished before is_completed() asked"
    if gloo:  # on NCCL even the blocking all_reduce leaves the CPU free: no order to check
        t = res["times"]
        hid = t["sleep during all_reduce"] < t["all_reduce, then sleep"]
        print(f"sleep during the all_reduce took less than all_reduce, then sleep: {hid}")
        assert hid, t


# --- Chapter 01's checks ------------------------------------------------------------------------

def check_ddp_memory(mem: dict, shares: list) -> None:
    """ddp_memory.py's bytes per rank (its JSON) for each share of the global batch (`shares`:
    (sequences per rank, the N that gives it) pairs): every rank measured the same bytes, AdamW's
    state is 8 bytes per parameter plus a 4-byte step counter per tensor; one line per setting,
    then the peak activations per rank at the first two shares."""
    psi = mem["num_params"]
    cats = [("params", "parameters"), ("grads_and_buckets", "gradients + buckets"),
            ("optimizer", "AdamW state")]
    for b, n in shares:
        for view in ("False", "True"):
            m = mem["settings"][str(b)][view]
            assert all(len(set(m[c])) == 1 for c, _ in cats)  # every rank measured the same
            assert m["optimizer"][0] == 8 * psi + 4 * m["num_tensors"][0]  # + step counters
            total = sum(m[c][0] for c, _ in cats)
            print(f"{b} sequences/rank (N={n}), gradient_as_bucket_view={view:5}: " + ", ".join(
                f"{label} {m[c][0]:,} B" for c, label in cats) + f"  = {total / psi:.2f} B/param")
    (b0, n0), (b1, n1) = shares[:2]
    act = [mem["settings"][str(b)]["False"]["peak_activations"][0] for b in (b0, b1)]
    print(f"peak activations per rank, N={n0} -> N={n1} ({b0} -> {b1} sequences per rank): "
          f"{act[0]:,} -> {act[1]:,} B (x{act[1] / act[0]:.2f})")


def check_overlap_solution(ov: dict, loss_tol: float) -> None:
    """Exercise 01.2's solution (ex01_overlap.py's JSON), without printing its answers: every
    mode trains like one process, all-reduces every gradient byte once per step, with the
    solution's counts (flat 1, per-param one per tensor, bucketed one per bucket, each bucket but
    the last at least --bucket-mb), and per-param and bucketed launch every call during backward,
    flat none; every call is launched, done and finished in that order."""
    modes, n = ov["modes"], ov["num_param_tensors"]
    for mode, r in modes.items():
        assert len(r["losses"]) == len(ov["single_losses"]) == ov["steps"], mode
        assert r["max_loss_diff"] < loss_tol and r["max_grad_diff"] < 1e-5, mode
        assert r["max_weight_diff"] < 1e-4, mode
        assert set(r["bytes_per_step"]) == {ov["grad_bytes"]}, mode
        during = {c["launched"] < s["backward_end"] for s in r["steps"] for c in s["calls"]}
        assert during == ({False} if mode == "flat" else {True}), (mode, during)
        assert all(0 <= c["launched"] <= c["done"] <= s["finished"]
                   for s in r["steps"] for c in s["calls"]), mode
    buckets = modes["bucketed"]["buckets"]
    assert set(modes["flat"]["calls_per_step"]) == {1}
    assert set(modes["per-param"]["calls_per_step"]) == {n}
    assert set(modes["bucketed"]["calls_per_step"]) == {len(buckets)} and 1 < len(buckets) < n
    assert sum(buckets) == ov["grad_bytes"] and sum(modes["bucketed"]["bucket_tensors"]) == n
    assert all(b >= ov["bucket_mb"] * 2**20 for b in buckets[:-1])  # closed once at the cap
    print(f"exercise 01.2's solution, {', '.join(modes)}: each = one process, every gradient byte "
          "all-reduced once per step, its calls counted and ordered as the answers say: True")


# --- Chapter 02's checks and tables -------------------------------------------------------------

def bubble_breakdown(sweep: list, mb_size: int, stages: int) -> None:
    """pipeline_bench.py's runs (one split): each setting's idle fraction against the formula
    (p-1)/(m+p-1), split per stage by distkit.pipe.idle_breakdown into waiting on compute and on
    transfer; then, from the 1F1B run at the largest m, the hand-offs' cost c per micro-batch
    slot (the step beyond (m+p-1) x compute per micro-batch) and the m that minimises a fixed
    batch's step (m+p-1)(T/m + c). Timings: for an ignored cell."""
    import numpy as np
    from distkit.pipe import idle_breakdown
    print(f"{'schedule':8s} {'m':>2s} {'theory':>7s} {'measured':>9s} {'ratio':>6s}   "
          "per stage: idle = waiting on compute + waiting on transfer")
    for r in sweep:
        parts = idle_breakdown(r["spans"])
        print(f"{r['schedule']:8s} {r['m']:2d} {r['theory']:7.3f} {r['idle_mean']:9.3f} "
              f"{r['idle_mean'] / r['theory']:6.2f}   " + "   ".join(
                  f"{i:.2f} = {p['wait_compute']:.2f} + {p['wait_transfer']:.2f}"
                  for i, p in zip(r["idle"], parts)))
    top = max((r for r in sweep if r["schedule"] == "1f1b"), key=lambda r: r["m"])
    t_mb = np.mean([sum(s[3] - s[2] for s in st if s[0] in "FBL") / top["m"]
                    for st in top["spans"]])
    c_mb = top["step_s"] / (top["m"] + stages - 1) - t_mb
    batch = top["m"] * mb_size
    print(f"\n1f1b m={top['m']}: compute {t_mb * 1e3:.0f} ms per micro-batch per stage, "
          f"hand-off cost c = {c_mb * 1e3:.1f} ms per micro-batch slot")
    if c_mb > 0:  # T: one stage's compute for the whole batch, if compute scales with batch size
        print(f"a fixed batch of {batch} sequences: (m+p-1)(T/m + c) is smallest at m* = "
              f"{np.sqrt((stages - 1) * top['m'] * t_mb / c_mb):.1f} on this machine")


def unbalanced_report(base: dict, skew: dict, m: int, even: list, unbalanced: list,
                      clock: str) -> None:
    """pipeline_bench.py's 1F1B run at m micro-batches on the even split (`base`) and on the
    unbalanced one (`skew`): step times, idle per stage, the slowdown beside the band the layer
    counts give two ideal steps (no hand-offs), and each step against m T_max + fill/drain with
    the stages' measured compute. Timings: for an ignored cell."""
    stages = len(even)
    # Per micro-batch a stage's time T is proportional to its layers. Even split: (m+p-1) T_mean.
    # Unbalanced: the long stage works all the time (m T_max), plus at most the short stages'
    # fill and drain (their sum of T).
    t_mean, t_max = sum(even) / stages, max(unbalanced)
    low = m * t_max / ((m + stages - 1) * t_mean)
    high = (m * t_max + sum(unbalanced) - t_max) / ((m + stages - 1) * t_mean)
    print(f"1F1B, m={m}, {clock}: split {'+'.join(map(str, even))}: {base['step_s'] * 1e3:.0f} ms,"
          f" idle per stage " + ", ".join(f"{x:.0%}" for x in base["idle"]))
    print(f"                 split {'+'.join(map(str, unbalanced))}: {skew['step_s'] * 1e3:.0f} "
          f"ms, idle per stage " + ", ".join(f"{x:.0%}" for x in skew["idle"]))
    print(f"slowdown {skew['step_s'] / base['step_s']:.2f}x; the layer counts alone, for ideal "
          f"steps without hand-offs: {low:.2f}x to {high:.2f}x")
    for name, run in (("even", base), ("unbalanced", skew)):
        # each stage's measured compute (its F and B spans) per micro-batch, s
        t = [sum(s[3] - s[2] for s in stage if s[0] in "FB") / run["m"] for stage in run["spans"]]
        model_s = m * max(t) + sum(t) - max(t)
        print(f"{name:10s}: compute per micro-batch " + ", ".join(f"{x * 1e3:.0f}" for x in t)
              + f" ms; m T_max + fill/drain = {model_s * 1e3:.0f} ms, measured "
              f"{run['step_s'] * 1e3:.0f} ms: {run['step_s'] / model_s - 1:+.0%} for the hand-offs")


def check_tp_plans(tp: dict) -> None:
    """tensor_parallel.py's JSON: every plan equals the unsharded model, and its collectives per
    step are the counts the text derives: Megatron's 2 all-reduces per layer each way, the naive
    plan's 5 per layer in the backward, sequence parallelism's all-gathers and reduce-scatters,
    the vocabulary plan's few small all-reduces of the loss instead of gathering the logits."""
    act, want = tp["activation_bytes"], tp["megatron_count"]
    parity = {name: p["parity"] for name, p in tp["plans"].items()}
    assert all(parity.values()), parity
    meg, naive_plan, seq = (tp["plans"][p] for p in ("megatron", "naive", "sequence"))
    L = tp["layers"]
    assert meg["forward"] == meg["backward"] == {"all_reduce": want}
    assert meg["forward_bytes"] == meg["backward_bytes"] == want * act
    # naive: q, k, v, gate and up each all-reduce their own input gradient (5 per layer
    # backward); sequence: all-gather + reduce-scatter for each all-reduce, one more all-gather
    # at the edges, and the norms' weight gradients (2 per layer and the final norm) all-reduced
    assert naive_plan["forward"] == {"all_reduce": 2 * L}
    assert naive_plan["backward"] == {"all_reduce": 5 * L}
    assert seq["forward"] == {"all_gather_into_tensor": 2 * L + 1, "reduce_scatter_tensor": 2 * L}
    assert seq["backward"] == {**seq["forward"], "all_reduce": 2 * L + 1}
    # vocab: megatron's, plus the embedding's partial lookups (forward) and the head's input
    # gradient (backward), one all-reduce each; and loss_parallel's small ones (forward)
    vocab = tp["plans"]["vocab"]
    loss_reduces = vocab["forward"]["all_reduce"] - (2 * L + 1)
    assert vocab["backward"] == {"all_reduce": 2 * L + 1} and loss_reduces >= 1
    assert vocab["forward_bytes"] - (2 * L + 1) * act < act  # the loss's: far below one activation
    print(f"{tp['layers']} layers, N={tp['world_size']}: Megatron's count is {want} all-reduces "
          f"of {act:,} B each way; parity with the unsharded model in every plan: "
          f"{all(parity.values())}")
    print(f"naive plan backward: {naive_plan['backward']['all_reduce']} all-reduces "
          f"= {naive_plan['backward']['all_reduce'] // tp['layers']} per layer")
    logits_bytes = tp["batch"] * tp["seq"] * tp["vocab"] * 4
    print(f"vocab plan: {loss_reduces} all-reduces of the loss, "
          f"{vocab['forward_bytes'] - (2 * L + 1) * act:,} B in all, instead of gathering the "
          f"[{tp['batch']}, {tp['seq']}, {tp['vocab']}] logits ({logits_bytes:,} B)")


# --- Chapter 03's tables ------------------------------------------------------------------------

def peak_table(sweep: dict, sweep_ck: dict, live: dict) -> None:
    """Rank 0's peak by category for 8B on 8 and 64 ranks and 70B on 64, without and with
    activation checkpointing (simulate_fsdp.py's stored sweeps); a point simulated live in this
    run (`live`) must equal its stored row, to the byte. Then the 8B root module's and one
    layer's fp32 bytes, the logits of one 2048-token sequence, and the CUDA-only AdamW temporary
    for 70B on 64 ranks."""
    from distkit.memory import GB, GiB, LLAMA_CONFIGS, from_config
    gib = lambda x: f"{x / GiB:6.1f}"
    live_keys = {(r["model"], r["ranks"]) for r in live["results"]}
    print(f"{'peak on rank 0, GiB':27s}" + "".join(f"{k:>9s}" for k in
          ("states", "unshard", "activ.", "temp", "buffers", "total")) + "  figures")
    for label, s in (("", sweep), (" + ckpt", sweep_ck)):
        for key in (("8b", 8), ("8b", 64), ("70b", 64)):
            r = next(r for r in s["results"] if (r["model"], r["ranks"]) == key)
            p = r["peak"]
            states = p["Sharded Param"] + p["Sharded Grad"] + p["OptState"]
            comm = p["All Gather"] + p["Reduce Scatter"]
            source = "live" if key in live_keys and not label else "stored"
            if source == "live":  # simulated in this run: the stored row must be what it found
                assert next(x for x in live["results"]
                            if (x["model"], x["ranks"]) == key)["peak"] == p
            print(f"{key[0] + ' on ' + str(key[1]) + label:27s}" + "".join(
                f"{gib(v):>9s}" for v in (states, p["Unsharded Param"], p["Activation"],
                                          p["Temp"], comm, p["Total"])) + f"  {source}")
    c8 = LLAMA_CONFIGS["8b"]
    root = (2 * c8["vocab_size"] + 1) * c8["hidden_size"] * 4
    layer = (from_config(c8)["num_params"] - root // 4) // c8["num_hidden_layers"] * 4
    print(f"8B in fp32: root module (embeddings, LM head, final norm) {root / GiB:.1f} GiB, one "
          f"decoder layer {layer / GiB:.1f} GiB; logits of one 2048-token sequence "
          f"{2048 * c8['vocab_size'] * 4 / GiB:.2f} GiB")
    psi70 = from_config(LLAMA_CONFIGS["70b"])["num_params"]
    print(f"on CUDA, AdamW's foreach step adds a temporary of 4 bytes per sharded parameter: "
          f"70B on 64 {4 * psi70 / 64 / GB:.1f} GB (not in the simulation)")


def llama_calculator(r: dict, recipe=None) -> dict:
    """distkit.memory.llama_training_bytes for the setting of one simulated step (a row of
    simulate_fsdp.py's JSON): its model, ranks (a ranks/tp x tp mesh: FSDP over the first
    dimension), sequence, batch, precision, attention and checkpointing."""
    from distkit.memory import FP32_ADAMW, LLAMA_CONFIGS, llama_training_bytes
    tp = r.get("tp") or 1
    return llama_training_bytes(
        LLAMA_CONFIGS[r["model"]], ranks=r["ranks"] // tp, seq=r["seq"], batch=r["batch"],
        precision=r.get("precision", "fp32"), attn=r.get("attn", "sdpa"),
        ac=r.get("ac") or ("full" if r["checkpoint"] else "none"), tensor_parallel=tp,
        recipe=recipe or FP32_ADAMW)


def llama_sketch(r: dict) -> float:
    """The first sketch for one simulated step: Korthikanti's activations + ZeRO-3 model states
    (distkit.memory.training_bytes); 16-bit, so only meant for the bf16 points."""
    from distkit.memory import LLAMA_CONFIGS, TORCH_AMP, from_config, training_bytes
    m, ac = from_config(LLAMA_CONFIGS[r["model"]]), r.get("ac") or "none"
    recompute = "selective" if ac == "none" and r.get("attn") == "sdpa" else ac
    return training_bytes(m["num_params"], world_size=r["ranks"], stage=3, recipe=TORCH_AMP,
                          layers=m["layers"], seq=r["seq"], micro_batch=r["batch"],
                          hidden=m["hidden"], heads=m["heads"], recompute=recompute,
                          tensor_parallel=r.get("tp") or 1)["total"]


def check_calculator(points: list) -> None:
    """The calculator's peak (llama_calculator) within 10 % of every simulated step in `points`
    ((row, "stored" or "live") pairs); then a table of the 8B and 70B points with its error and,
    for the bf16 points, the first sketch's."""
    from distkit.memory import GiB
    error = lambda r, predicted: round(predicted / r["peak"]["Total"] - 1, 3) + 0  # no -0.0
    within = all(abs(error(r, llama_calculator(r)["Total"])) < 0.10 for r, _ in points)
    print("calculator's peak within 10% of every stored and live simulated step:", within)
    assert within
    print(f"{'simulated step, seq 2048, batch 1':46s}{'simulated':>10s}{'calculator':>11s}"
          f"{'error':>7s}{'sketch':>8s}{'error':>7s}  GiB")
    shown = set()
    for r, source in points:
        ac = r.get("ac") or ("full" if r["checkpoint"] else "none")
        name = (f"{r['model']} on {r['ranks']}, {r.get('precision', 'fp32')}, "
                f"{r.get('attn', 'sdpa')}, ckpt {ac} ({source})")
        if r["model"] == "1b" or (r["model"], r["ranks"]) not in (("8b", 8), ("8b", 64),
                                                                  ("70b", 64)) \
                or name in shown:  # chapter 08's grid repeats one point of the sweep
            continue
        shown.add(name)
        calc = llama_calculator(r)["Total"]
        sketch = llama_sketch(r)
        rough = f"{sketch / GiB:8.1f}{error(r, sketch):+7.0%}" if r.get("precision") == "bf16" \
            else f"{'-':>8s}{'':7s}"
        print(f"{name:46s}{r['peak']['Total'] / GiB:10.1f}{calc / GiB:11.1f}{error(r, calc):+7.1%}"
              f"{rough}")

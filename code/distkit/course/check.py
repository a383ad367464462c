"""`make check`: is this machine ready for the course? A pre-flight for a workshop's laptops.

    python -m distkit.course.check    # (make check) one line per check; exit status 1 on a FAIL

Each line is PASS, WARN (the course runs, with a caveat) or FAIL (it will not), with the fix.
It checks: the Python version; that the main packages import, and every package pinned in
requirements.txt is installed at its version; that the notebooks' Jupyter kernel starts, runs a
cell that imports torch, and is this environment's Python (a `python3` kernelspec from another
environment is the classic "ModuleNotFoundError in the notebook, but make check passed"); that
torchrun starts 2 processes (through code/run_w_torchrun.sh, as every notebook does) whose
all-reduce over gloo returns the right sum; that a local port can be bound; cores and memory;
free disk for build/; that py-spy may read another process (chapter 07's stack dumps; a WARN);
that the temp directory is writable. Under a minute after `make setup`.
"""
from __future__ import annotations

import importlib
import importlib.metadata
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

CODE = Path(__file__).resolve().parents[2]
ROOT = CODE.parent
# The lowest and highest Python (tested: 3.11.7). What the pins allow, from their metadata's
# Requires-Python: transformers 5.23, numpy 2.4 and ipython 9 need 3.11 (soupsieve is pinned at
# 2.10, not 4.x, which needs 3.11.5: Debian 12's 3.11.2 and Ubuntu 22.04's python3.11 work).
# The Makefile's check_python, before the venv is made, should say the same.
PYTHONS = ((3, 11, 0), (3, 12))
# import name -> distribution name in requirements.txt
PACKAGES = {"torch": "torch", "transformers": "transformers", "jupyterlab": "jupyterlab",
            "nbval": "nbval", "papermill": "papermill", "matplotlib": "matplotlib"}
NEED_CORES = 2  # every launch runs 2 processes; fewer cores time-share them
# A rank of chapter 06's Llama holds ~480 MiB (notebook 06 prints it), and a launch runs up to 4
# (make test-nproc) beside torchrun and the notebook's kernel.
NEED_RAM_GIB = 4
NEED_DISK_GIB = 1  # build/: executed notebooks, launch logs, the chapters' checkpoints
TORCHRUN_LIMIT_S = 120  # generous (a loaded machine is slow), but a hang must not hang the check
KERNEL_LIMIT_S = 120  # the same for the Jupyter kernel (about 2 s to start and import torch)
SETUP = "run `make setup` (it installs requirements.txt into .venv) and use .venv/bin/python"


@dataclass
class Result:
    status: str  # PASS, WARN or FAIL
    name: str
    text: str
    fix: str = ""

    def __str__(self) -> str:
        return f"{self.status}  {self.name:<12} {self.text}" + (f"; fix: {self.fix}" if self.fix
                                                                else "")


def pins(requirements: Path = ROOT / "requirements.txt") -> dict[str, str]:
    """Distribution name (lower case) -> pinned version, from `name==version` lines."""
    found = re.findall(r"^([A-Za-z0-9_.-]+)==(\S+)", requirements.read_text(), re.M)
    return {name.lower(): version for name, version in found}


def check_python(version: tuple = tuple(sys.version_info[:3])) -> Result:
    shown = ".".join(map(str, version))
    span = "-".join(".".join(map(str, v)) for v in PYTHONS)
    if PYTHONS[0] <= tuple(version) and tuple(version)[:2] <= PYTHONS[1]:
        return Result("PASS", "python", f"{shown} (the course needs {span})")
    return Result("FAIL", "python", f"{shown}, the course needs {span} (tested: 3.11)",
                  "install one (python.org, pyenv or `uv python install 3.12`; a Linux "
                  "distribution's may be older) and run e.g. `make PYTHON=python3.11 setup`")


def check_package(module: str, dist: str, pinned: dict[str, str]) -> Result:
    try:
        importlib.import_module(module)
        version = importlib.metadata.version(dist)
    except Exception as e:  # not installed, or broken (a missing shared library...)
        return Result("FAIL", module, f"does not import: {type(e).__name__}: {e}", SETUP)
    want = pinned.get(dist.lower())
    public = version.split("+")[0]  # torch 2.13.0+cpu / +cu128: the same release
    if want is None or public == want:
        return Result("PASS", module, f"{version} imports" + (f" (pinned: {want})" if want
                                                              else ""))
    return Result("FAIL", module, f"{version} imports, but requirements.txt pins {want}", SETUP)


def check_pins(pinned: dict[str, str] | None = None) -> Result:
    """Every `name==version` of requirements.txt installed at that version (a local label such
    as torch's +cpu is the same release)."""
    pinned = pins() if pinned is None else pinned
    wrong = []
    for dist, want in sorted(pinned.items()):
        try:
            have = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            have = "not installed"
        if have.split("+")[0] != want:
            wrong.append(f"{dist} {have} (pinned {want})")
    if not wrong:
        return Result("PASS", "pins", f"all {len(pinned)} packages of requirements.txt at their "
                                      "pinned versions")
    return Result("FAIL", "pins", f"{len(wrong)} of {len(pinned)} differ: "
                                  + "; ".join(wrong[:5]) + ("; ..." if len(wrong) > 5 else ""),
                  SETUP)


KERNEL_CELL = "import sys, torch; print(sys.prefix); print(torch.__version__)"


def check_kernel(kernel_name: str = "python3", code: str = KERNEL_CELL,
                 prefix: str = sys.prefix, limit: float = KERNEL_LIMIT_S) -> Result:
    """Start the notebooks' kernel as JupyterLab does (its kernelspec, found on Jupyter's
    paths), run one cell, and check the kernel is this environment's Python."""
    from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel
    from jupyter_client.manager import KernelManager
    try:
        spec_dir = KernelSpecManager().get_kernel_spec(kernel_name).resource_dir
    except NoSuchKernel:
        return Result("FAIL", "kernel", f"no Jupyter kernel named {kernel_name}",
                      f"`{sys.executable} -m ipykernel install --sys-prefix`")
    ours = os.path.realpath(spec_dir).startswith(os.path.realpath(prefix) + os.sep)
    fix = ("run `make setup` again (it reinstalls the pins)" if ours else
           f"{spec_dir} is another environment's kernel, found before the course's: remove it "
           "(or set JUPYTER_PREFER_ENV_PATH=1)")
    start = time.monotonic()
    km = KernelManager(kernel_name=kernel_name)
    kc = None
    try:
        km.start_kernel(stderr=subprocess.DEVNULL)  # its start-up chatter is not ours to show
        kc = km.client()
        kc.start_channels()
        kc.wait_for_ready(timeout=limit)
        out, errors = [], []

        def on_output(msg):
            content = msg["content"]
            if msg["msg_type"] == "stream":
                out.append(content["text"])
            elif msg["msg_type"] == "error":
                errors.append(f"{content['ename']}: {content['evalue']}")

        left = max(1.0, limit - (time.monotonic() - start))
        kc.execute_interactive(code, timeout=left, output_hook=on_output, store_history=False)
    except Exception as e:  # did not start, died, timed out (jupyter_client raises several types)
        return Result("FAIL", "kernel", f"the {kernel_name} kernel ({spec_dir}) did not run a cell "
                                        f"in {limit:.0f} s: {type(e).__name__}: {e}".strip(),
                      fix)
    finally:
        if kc is not None:
            kc.stop_channels()
        if km.has_kernel:
            km.shutdown_kernel(now=True)
    took = time.monotonic() - start
    lines = "".join(out).split()
    if errors:
        return Result("FAIL", "kernel", f"the {kernel_name} kernel ({spec_dir}) started, but its "
                                        f"cell failed: {errors[0]}", fix)
    if not lines or os.path.realpath(lines[0]) != os.path.realpath(prefix):
        return Result("FAIL", "kernel", f"the {kernel_name} kernel ({spec_dir}) runs the Python "
                                        f"of {lines[0] if lines else 'an unknown prefix'}, not "
                                        f"{prefix}", fix)
    return Result("PASS", "kernel", f"{kernel_name} started and ran a cell: torch {lines[1]}, "
                                    f"this environment's Python ({took:.0f} s)")


RANK_SCRIPT = """\
import torch, torch.distributed as dist
dist.init_process_group("gloo")
value = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(value)  # 1 + 2 + ... + world size
print(f"rank {dist.get_rank()} of {dist.get_world_size()}: all_reduce = {value.item():g}")
dist.destroy_process_group()
"""


def check_torchrun(nproc: int = 2, limit: float = TORCHRUN_LIMIT_S,
                   launcher: Path = CODE / "run_w_torchrun.sh") -> Result:
    """Launch RANK_SCRIPT on nproc processes as the notebooks do; every rank must print the sum."""
    want = nproc * (nproc + 1) // 2
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "allreduce_check.py"
        script.write_text(RANK_SCRIPT)
        env = {**os.environ, "PYTHON": sys.executable, "LOG_DIR": str(Path(tmp) / "logs")}
        start = time.monotonic()
        proc = subprocess.Popen([str(launcher), str(nproc), str(script)], env=env, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        try:
            out = proc.communicate(timeout=limit)[0]
        except subprocess.TimeoutExpired:
            # the ranks run in sessions of their own
            from distkit.course.notebook import stop_launch
            stop_launch(proc, grace=10, drain=True)
            return Result("FAIL", "torchrun", f"{nproc} processes did not finish in {limit} s",
                          "run `code/run_w_torchrun.sh 2 ch00_collectives/hello_torchrun.py` "
                          "and read what it says")
        took = time.monotonic() - start
    sums = re.findall(rf"rank \d+ of {nproc}: all_reduce = (\S+)", out)
    if proc.returncode == 0 and sums == [f"{want:g}"] * nproc:
        return Result("PASS", "torchrun", f"{nproc} processes, all_reduce over gloo on localhost "
                                          f"= {want} on every rank ({took:.0f} s)")
    last = (out.strip() or "no output").splitlines()[-1]
    return Result("FAIL", "torchrun", f"{nproc} processes: exit status {proc.returncode}, sums "
                                      f"{sums} (expected {want}): {last}",
                  "if the error names an address or a network interface, set "
                  "GLOO_SOCKET_IFNAME=lo (the hostname may not resolve to this machine)")


def check_port(port: int = 0) -> Result:
    """Launches bind local ports (torchrun's store, gloo); port 0 = any free one."""
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            s.listen()
        except OSError as e:
            return Result("FAIL", "port", f"cannot listen on 127.0.0.1:{port}: {e.strerror}",
                          "free the port, or allow local TCP servers (firewall, sandbox)")
        return Result("PASS", "port", f"127.0.0.1:{s.getsockname()[1]} can be bound")


def check_cores(cores: int | None = None) -> Result:
    cores = cores or (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                      else os.cpu_count() or 1)
    if cores >= NEED_CORES:
        return Result("PASS", "cores", f"{cores} (launches run {NEED_CORES} processes)")
    return Result("WARN", "cores", f"{cores}: the {NEED_CORES} processes of a launch will take "
                                   "turns (slower; timing checks may skip)",
                  f"use a machine (or container limit) with {NEED_CORES} cores or more")


def check_memory(total: int | None = None, available: int | None = None) -> Result:
    import psutil
    memory = psutil.virtual_memory()
    total, available = total or memory.total, available or memory.available
    gib = 2 ** 30
    text = f"{total / gib:.1f} GiB, {available / gib:.1f} GiB available (needs {NEED_RAM_GIB})"
    if total < NEED_RAM_GIB * gib:
        return Result("FAIL", "memory", text, f"a machine with {NEED_RAM_GIB} GiB or more")
    if available < NEED_RAM_GIB / 2 * gib:
        return Result("WARN", "memory", text, "close other programs before the course")
    return Result("PASS", "memory", text)


def check_disk(folder: Path = ROOT / "build") -> Result:
    existing = next(p for p in [folder, *folder.parents] if p.exists())
    free = shutil.disk_usage(existing).free / 2 ** 30
    text = f"{free:.1f} GiB free for {folder.name}/ (needs {NEED_DISK_GIB})"
    if free < NEED_DISK_GIB:
        return Result("FAIL", "disk", text, f"free space on {existing}")
    return Result("PASS", "disk", text)


def ptrace_fix() -> str:
    scope = Path("/proc/sys/kernel/yama/ptrace_scope")
    if scope.exists() and scope.read_text().strip() != "0":
        return "`sudo sysctl kernel.yama.ptrace_scope=0` (until the next reboot)"
    if sys.platform == "darwin":
        return "run the notebook server with sudo (macOS lets only root read another process)"
    return "in a container, start it with `--cap-add SYS_PTRACE`"


def check_ptrace(py_spy: str | None = None) -> Result:
    """py-spy reads a sibling process, as chapter 07's stack dumps read each rank."""
    beside = Path(sys.executable).with_name("py-spy")  # where make setup installs it
    py_spy = py_spy or (str(beside) if beside.exists() else shutil.which("py-spy"))
    if py_spy is None:
        return Result("WARN", "ptrace", "py-spy not found: chapter 07 shows no stacks", SETUP)
    target = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        time.sleep(0.5)  # let it start
        out = subprocess.run([py_spy, "dump", "--pid", str(target.pid)], capture_output=True,
                             text=True, timeout=30)
    except subprocess.TimeoutExpired:
        out = None
    finally:
        target.kill()
        target.wait()
    if out is not None and out.returncode == 0 and "Thread" in out.stdout:
        return Result("PASS", "ptrace", "py-spy can read another process's stack (chapter 07)")
    why = "timed out" if out is None else \
        ((out.stderr or out.stdout).strip().splitlines() or ["failed"])[-1]
    return Result("WARN", "ptrace", f"py-spy cannot read another process ({why}): chapter 07's "
                                    "stack dumps will say so", ptrace_fix())


def check_tempdir(folder: str | None = None) -> Result:
    folder = folder or tempfile.gettempdir()
    try:
        with tempfile.NamedTemporaryFile(dir=folder) as f:
            f.write(b"ok")
            f.flush()
    except OSError as e:
        return Result("FAIL", "temp dir", f"{folder} is not writable: {e.strerror}",
                      "set TMPDIR to a writable folder")
    return Result("PASS", "temp dir", f"{folder} is writable")


def checks():
    """Every check, in order (a generator, so each line shows as soon as it is known)."""
    yield check_python()
    pinned = pins()
    for module, dist in PACKAGES.items():
        yield check_package(module, dist, pinned)
    yield check_pins(pinned)
    yield check_kernel()
    yield check_torchrun()
    yield check_port()
    yield check_cores()
    yield check_memory()
    yield check_disk()
    yield check_ptrace()
    yield check_tempdir()


def main() -> int:
    start, failed = time.monotonic(), 0
    for result in checks():
        print(result, flush=True)
        failed += result.status == "FAIL"
    verdict = f"{failed} check(s) FAILED" if failed else "ready for the course"
    print(f"make check: {verdict} ({time.monotonic() - start:.0f} s)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""Which build of torch `make setup` installs, as pip's extra arguments (stdlib only: it runs in
the new venv before anything is installed).

PyPI's torch for Linux is the CUDA build: GBs of wheels (torch's and the nvidia-* libraries')
that a laptop without an NVIDIA GPU never uses. So on Linux without one, set-up adds PyTorch's CPU
wheel index, whose `torch==2.13.0+cpu` pip prefers to PyPI's `2.13.0` (a local version sorts
after its release): one 192 MB wheel (the course's venv with it: 1.5 GB). macOS (PyPI's build
is the CPU/MPS one) and machines with an NVIDIA GPU (PyPI's CUDA build is the one they need)
keep pip's usual sources. macOS on Intel has no torch 2.13 at all (none since 2.3): set-up says
so and stops, before pip fails with "no matching distribution".

The index is tried first (at most PROBE_S seconds): where it cannot be reached (an offline
mirror, a firewall), set-up goes on with pip's other sources and says so, instead of pip retrying
an unreachable index for minutes.

    python -m distkit.course.torch_wheels [auto|cpu|pypi|URL]     # make setup TORCH_INDEX=...

prints pip's arguments on stdout (nothing, or `--extra-index-url URL`) and what it chose, and
why, on stderr. auto (the default) decides as above; cpu: the CPU index whatever the machine;
pypi: pip's usual sources only; a URL: that index (e.g. https://download.pytorch.org/whl/cu128).
"""
from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path

CPU_INDEX = "https://download.pytorch.org/whl/cpu"
PROBE_S = 5  # seconds to wait for the index before set-up goes on without it


def has_nvidia_gpu() -> bool:
    """An NVIDIA GPU with its driver: `nvidia-smi -L` lists one, or the driver lists one."""
    gpus = Path("/proc/driver/nvidia/gpus")
    if gpus.is_dir() and any(gpus.iterdir()):
        return True
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return False
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.returncode == 0 and "GPU" in out.stdout


def reachable(url: str, timeout: float = PROBE_S) -> bool:
    """Whether the index answers for torch's page within `timeout` seconds."""
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/torch/", timeout=timeout) as response:
            return response.status == 200
    except Exception:  # DNS, refused, timed out, TLS, HTTP errors: not usable
        return False


def choose(setting: str = "auto", system: str | None = None, nvidia=has_nvidia_gpu,
           probe=reachable, machine: str | None = None) -> tuple[str, str]:
    """(the index to add, "" for none; the line that says why). ValueError: no torch to take."""
    system = system or platform.system()
    machine = machine or platform.machine()
    if setting == "pypi":
        return "", "torch from pip's usual sources (TORCH_INDEX=pypi)"
    if setting == "auto":
        if system == "Darwin" and machine == "x86_64":  # pip would say "no matching distribution"
            raise ValueError("torch has no builds for macOS on Intel since 2.3 (pytorch/pytorch"
                             "#114602; the course pins 2.13): use the container "
                             "(.devcontainer/, docs/workshop.md) or another machine; on an "
                             "Apple silicon Mac, use an arm64 Python, not an Intel one")
        if system != "Linux":
            return "", f"torch from pip's usual sources ({system}: PyPI's build has no CUDA)"
        if nvidia():
            return "", ("torch from pip's usual sources: an NVIDIA GPU is here, and PyPI's "
                        "Linux build is the CUDA one")
        setting, why = "cpu", "Linux without an NVIDIA GPU"
    else:
        why = f"TORCH_INDEX={setting}"
    url = CPU_INDEX if setting == "cpu" else setting
    if not url.startswith(("https://", "http://", "file://")):
        raise ValueError(f"TORCH_INDEX={setting}: give auto, cpu, pypi or an index's URL")
    if not probe(url):
        return "", (f"WARN {url} cannot be reached (tried for up to {PROBE_S} s): torch comes "
                    "from pip's other sources (on Linux, PyPI's is the CUDA build: GBs); "
                    "TORCH_INDEX=pypi skips this try")
    return url, f"torch from {url} ({why}; TORCH_INDEX=pypi for pip's usual sources)"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    setting = (argv[0] if argv else os.environ.get("TORCH_INDEX", "")) or "auto"
    try:
        url, why = choose(setting)
    except ValueError as e:
        print(f"make setup: {e}", file=sys.stderr)
        return 2
    print(f"make setup: {why}", file=sys.stderr)
    print(f"--extra-index-url {url}" if url else "")
    return 0


if __name__ == "__main__":
    sys.exit(main())

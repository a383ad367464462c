"""distkit.course.check (`make check`): each FAIL branch driven without breaking the machine (a
wrong Python given as a parameter, a port held by the test, a package that does not exist, a
kernelspec of another environment...), and one real run of every check. And `make setup`'s
choice of torch build (distkit.course.torch_wheels), with an index that answers and one that
does not."""
import functools
import http.server
import json
import os
import resource
import socket
import subprocess
import sys
import threading
import time

import pytest

from conftest import CODE
from distkit.course import check, torch_wheels

GIB = 2 ** 30


def test_python_version():
    for version in [(3, 11, 0), (3, 11, 2), (3, 11, 7), (3, 12, 0), (3, 12, 12)]:
        assert check.check_python(version).status == "PASS"
    for version in [(3, 9, 6), (3, 10, 12), (3, 13, 0)]:
        result = check.check_python(version)
        assert result.status == "FAIL" and "make PYTHON=python3.11 setup" in result.fix
        assert str(result).startswith("FAIL  python       {}.{}.{}, the course needs "
                                      "3.11.0-3.12".format(*version))


def test_the_python_range_is_what_the_pins_allow():
    """Every pinned package installs on the range's lowest and highest Python, read from the
    installed packages' Requires-Python (3.10 was allowed while transformers 5.23 needs 3.11,
    and any 3.11 while soupsieve 4.1.2 needed 3.11.5: it is pinned at 2.10 now)."""
    import importlib.metadata
    from packaging.specifiers import SpecifierSet
    lowest, highest = (".".join(map(str, v + (0,) * (3 - len(v)))) for v in check.PYTHONS)
    for python in (lowest, highest):
        refused = {}
        for dist in check.pins():
            requires = importlib.metadata.metadata(dist).get("Requires-Python")
            if requires and not SpecifierSet(requires).contains(python):
                refused[dist] = requires
        assert not refused, f"Python {python} cannot install these pins: {refused}"
    assert check.PYTHONS[0] <= (3, 11, 7) and (3, 11) <= check.PYTHONS[1]  # the tested one


def test_pins_are_read_from_requirements():
    pinned = check.pins()
    assert set(check.PACKAGES.values()) <= set(pinned) and pinned["torch"] == "2.13.0"


def test_a_missing_package_fails_with_the_fix():
    result = check.check_package("no_such_package_xyz", "no-such-package-xyz", check.pins())
    assert result.status == "FAIL" and "ModuleNotFoundError" in result.text
    assert "make setup" in result.fix


def test_a_version_other_than_the_pin_fails():
    result = check.check_package("pytest", "pytest", {"pytest": "0.0.1"})
    assert result.status == "FAIL" and "requirements.txt pins 0.0.1" in result.text
    assert check.check_package("pytest", "pytest", check.pins()).status == "PASS"


def test_a_port_in_use_fails():
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        result = check.check_port(port)
    assert result.status == "FAIL" and f"127.0.0.1:{port}" in result.text
    assert "in use" in result.text.lower()


@pytest.mark.parametrize("body, limit, expect", [
    ("echo 'RuntimeError: no route to 127.0.0.1' >&2; exit 1", 30,
     "exit status 1, sums [] (expected 3): RuntimeError: no route to 127.0.0.1"),
    ("echo 'rank 0 of 2: all_reduce = 2'; echo 'rank 1 of 2: all_reduce = 2'", 30,
     "exit status 0, sums ['2', '2'] (expected 3)"),  # a wrong sum
    ("sleep 60", 1, "2 processes did not finish in 1 s"),
])
def test_a_launch_that_fails_or_hangs_fails_the_check(tmp_path, body, limit, expect):
    launcher = tmp_path / "launcher.sh"  # stands in for code/run_w_torchrun.sh
    launcher.write_text(f"#!/bin/sh\n{body}\n")
    launcher.chmod(0o755)
    start = time.monotonic()
    result = check.check_torchrun(limit=limit, launcher=launcher)
    assert result.status == "FAIL" and expect in result.text, result
    assert time.monotonic() - start < limit + 20


def test_cores_memory_disk_and_temp_dir_thresholds(tmp_path, monkeypatch):
    assert check.check_cores(1).status == "WARN" and check.check_cores(2).status == "PASS"
    assert check.check_memory(total=2 * GIB, available=GIB).status == "FAIL"
    assert check.check_memory(total=16 * GIB, available=GIB).status == "WARN"
    assert check.check_memory(total=16 * GIB, available=8 * GIB).status == "PASS"
    monkeypatch.setattr(check, "NEED_DISK_GIB", 10 ** 9)  # a billion GiB: no disk has it
    assert check.check_disk(tmp_path / "build").status == "FAIL"
    result = check.check_tempdir(str(tmp_path / "missing"))
    assert result.status == "FAIL" and "TMPDIR" in result.fix


def test_ptrace_denied_is_a_warning_with_the_fix():
    result = check.check_ptrace(py_spy="/bin/false")  # a py-spy that cannot attach
    assert result.status == "WARN" and result.fix


@pytest.mark.alone
def test_a_real_run_passes_within_its_budget():
    """Every check on this machine: PASS or WARN, exit 0. The budget (60 s after set-up) is
    checked in CPU-seconds, which a busy machine does not inflate as it does wall time."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "distkit.course.check"], capture_output=True,
                          text=True, timeout=300, cwd=CODE.parent)
    wall = time.monotonic() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    lines = proc.stdout.splitlines()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    names = [ln.split()[1] for ln in lines[:-1]]
    assert names == ["python", *check.PACKAGES, "pins", "kernel", "torchrun", "port", "cores",
                     "memory", "disk", "ptrace", "temp", ]
    assert all(ln.split()[0] in ("PASS", "WARN") for ln in lines[:-1]), proc.stdout
    assert lines[-1].startswith("make check: ready for the course (")
    print(f"make check: {cpu:.1f} CPU-s, {wall:.1f} s wall")
    assert cpu < 60


def test_every_pin_is_compared():
    assert check.check_pins().status == "PASS"
    result = check.check_pins({**check.pins(), "pytest": "0.0.1", "no-such-dist-xyz": "1.0"})
    assert result.status == "FAIL" and "2 of" in result.text, result
    assert "pytest" in result.text and "no-such-dist-xyz not installed (pinned 1.0)" in result.text


def test_the_notebooks_kernel_runs_a_cell():
    """The kernel JupyterLab would start (python3, from Jupyter's paths) runs a cell that imports
    torch, in this environment's Python; each way it can fail gives a FAIL with the fix."""
    result = check.check_kernel()
    assert result.status == "PASS" and "ran a cell: torch 2.13.0" in result.text, result
    # A cell that fails in the kernel (as `import torch` does in another environment's kernel).
    result = check.check_kernel(code="import no_such_module_xyz")
    assert result.status == "FAIL" and "ModuleNotFoundError" in result.text, result
    assert "make setup" in result.fix  # the course's own kernelspec: reinstall
    # A kernel whose Python is not this environment's.
    result = check.check_kernel(prefix="/some/other/env")
    assert result.status == "FAIL" and "not /some/other/env" in result.text, result
    result = check.check_kernel(kernel_name="no_such_kernel_xyz")
    assert result.status == "FAIL" and "no Jupyter kernel named" in result.text


def test_a_kernel_that_cannot_start_fails_within_the_limit(tmp_path, monkeypatch):
    """Another environment's kernelspec found first (here through JUPYTER_PATH), whose program
    exits at once: a FAIL naming that kernelspec, and no hang."""
    spec = tmp_path / "kernels" / "python3"
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-c", "import sys; sys.exit(3)", "{connection_file}"],
        "display_name": "Python 3 (elsewhere)", "language": "python"}))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path))
    monkeypatch.setenv("JUPYTER_PREFER_ENV_PATH", "0")
    start = time.monotonic()
    result = check.check_kernel(limit=20)
    assert result.status == "FAIL" and str(spec) in result.text, result
    assert "remove it" in result.fix, result
    assert time.monotonic() - start < 60


def test_torch_wheels_picks_the_cpu_index_on_linux_without_a_gpu():
    """make setup's choice (distkit.course.torch_wheels), driven with a stand-in machine."""
    up, down = (lambda url: True), (lambda url: False)
    yes, no = (lambda: True), (lambda: False)
    cpu = torch_wheels.CPU_INDEX
    assert torch_wheels.choose("auto", "Linux", no, up)[0] == cpu
    assert torch_wheels.choose("auto", "Linux", yes, up)[0] == ""  # an NVIDIA GPU: PyPI's CUDA
    assert torch_wheels.choose("auto", "Darwin", no, up, machine="arm64")[0] == ""  # PyPI's
    assert torch_wheels.choose("cpu", "Darwin", yes, up)[0] == cpu
    assert torch_wheels.choose("pypi", "Linux", no, up)[0] == ""
    url = "https://download.pytorch.org/whl/cu128"
    assert torch_wheels.choose(url, "Linux", no, up)[0] == url
    url, why = torch_wheels.choose("auto", "Linux", no, down)  # unreachable: go on without it
    assert url == "" and why.startswith("WARN") and "cannot be reached" in why
    with pytest.raises(ValueError, match="give auto, cpu, pypi or an index's URL"):
        torch_wheels.choose("cuda", "Linux", no, up)
    # an Intel Mac (or an Intel Python under Rosetta) has no torch since 2.3: set-up says so
    with pytest.raises(ValueError, match="no builds for macOS on Intel since 2.3"):
        torch_wheels.choose("auto", "Darwin", no, up, machine="x86_64")


class Index(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):  # quiet
        pass


def fake_venv(tmp_path):
    """A venv whose python runs distkit.course.torch_wheels for real and records pip's
    arguments instead of installing anything."""
    bin_ = tmp_path / "venv" / "bin"
    bin_.mkdir(parents=True)
    (bin_ / "python").write_text(
        f'#!/bin/sh\nif [ "$2" = pip ]; then echo "$@" > "{tmp_path}/pip-args"; exit 0; fi\n'
        f'exec {sys.executable} "$@"\n')
    (bin_ / "python").chmod(0o755)
    return tmp_path / "venv"


@pytest.mark.parametrize("reachable", [True, False])
def test_make_setup_adds_a_reachable_index_and_goes_on_without_one(tmp_path, reachable):
    """`make setup TORCH_INDEX=URL` with the index answering (a local server): pip gets it;
    with nothing listening there: pip runs without it, set-up says so, in seconds."""
    (tmp_path / "index" / "torch").mkdir(parents=True)
    (tmp_path / "index" / "torch" / "index.html").write_text("<a href='x.whl'>x.whl</a>")
    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(Index, directory=tmp_path / "index"))
    url = f"http://127.0.0.1:{server.server_address[1]}"
    if reachable:
        threading.Thread(target=server.serve_forever, daemon=True).start()
    else:
        server.server_close()  # the port is free again: nothing answers there
    venv = fake_venv(tmp_path)
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    start = time.monotonic()
    try:
        proc = subprocess.run(["make", "--no-print-directory", "setup", f"VENV={venv}",
                               f"TORCH_INDEX={url}"], cwd=CODE.parent, env=env,
                              capture_output=True, text=True, timeout=60)
    finally:
        if reachable:
            server.shutdown()
            server.server_close()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    args = (tmp_path / "pip-args").read_text().split()
    assert args[:3] == ["-m", "pip", "install"] and args[-2:] == ["-r", "requirements.txt"]
    assert (f"--extra-index-url {url}" in " ".join(args)) == reachable, args
    assert ("cannot be reached" in proc.stderr) != reachable, proc.stderr
    assert time.monotonic() - start < 30  # no pip retrying an unreachable index for minutes


def test_make_setup_on_this_machine_decides_from_the_machine(tmp_path):
    """TORCH_INDEX=auto here: Linux, no NVIDIA GPU, so the CPU index is tried; this machine
    reaches no such index (its wheels are local), so set-up goes on without it, saying so."""
    venv = fake_venv(tmp_path)
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    proc = subprocess.run(["make", "--no-print-directory", "setup", f"VENV={venv}"],
                          cwd=CODE.parent, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    url, why = torch_wheels.choose("auto")
    assert f"make setup: {why}" in proc.stderr
    assert ("--extra-index-url" in (tmp_path / "pip-args").read_text()) == bool(url)
    (venv / ".installed").unlink()
    proc = subprocess.run(["make", "--no-print-directory", "setup", f"VENV={venv}",
                           "TORCH_INDEX=cuda"], cwd=CODE.parent, env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode != 0 and "give auto, cpu, pypi" in proc.stderr


def test_the_devcontainer_is_built_from_requirements_with_torchs_cpu_build():
    """The fallback for a laptop that fails make check (.devcontainer/). No container engine
    builds it here; this checks what it is made of."""
    folder = CODE.parent / ".devcontainer"
    text = "\n".join(ln for ln in (folder / "devcontainer.json").read_text().splitlines()
                     if not ln.lstrip().startswith("//"))  # JSON with comments
    config = json.loads(text)
    assert config["build"] == {"dockerfile": "Dockerfile", "context": ".."}
    assert config["postCreateCommand"] == "make check"
    assert "--cap-add=SYS_PTRACE" in config["runArgs"]  # chapter 07's py-spy
    docker = (folder / "Dockerfile").read_text()
    assert docker.splitlines()[3] == "FROM python:3.11-slim-bookworm"  # the tested Python
    assert "COPY requirements.txt /tmp/requirements.txt" in docker
    assert f"--extra-index-url {torch_wheels.CPU_INDEX} -r /tmp/requirements.txt" in docker
    assert "ENV LAB_IP=0.0.0.0" in docker and "ENV COURSE_VENV=/opt/venv" in docker
    assert "&& touch /opt/venv/.installed" in docker  # make setup has nothing left to do
    # The Makefile takes that environment for every target.
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    proc = subprocess.run(["make", "-s", "print-BIN"], cwd=CODE.parent, capture_output=True,
                          text=True, timeout=30, env={**env, "COURSE_VENV": "/opt/venv"})
    assert proc.stdout.strip() == "/opt/venv/bin"
    assert (folder / "Dockerfile.dockerignore").read_text().splitlines()[-2:] == [
        "*", "!requirements.txt"]

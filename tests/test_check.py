"""distkit.course.check (`make check`): each FAIL branch driven without breaking the machine (a wrong
Python given as a parameter, a port held by the test, a package that does not exist...), and one
real run of every check."""
import resource
import socket
import subprocess
import sys
import time

import pytest

from conftest import CODE
from distkit.course import check

GIB = 2 ** 30


def test_python_version():
    assert check.check_python((3, 11)).status == "PASS"
    for version in [(3, 9), (3, 13)]:
        result = check.check_python(version)
        assert result.status == "FAIL" and "make PYTHON=python3.11 setup" in result.fix
        assert str(result).startswith(f"FAIL  python       {version[0]}.{version[1]}, the course "
                                      "needs 3.10-3.12")


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
    assert names == ["python", *check.PACKAGES, "torchrun", "port", "cores", "memory", "disk",
                     "ptrace", "temp", ]
    assert all(ln.split()[0] in ("PASS", "WARN") for ln in lines[:-1]), proc.stdout
    assert lines[-1].startswith("make check: ready for the course (")
    print(f"make check: {cpu:.1f} CPU-s, {wall:.1f} s wall")
    assert cpu < 60

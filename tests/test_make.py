"""The Makefile's targets (without rebuilding the venv) and the CI workflow."""
import os
import shutil
import subprocess

import pytest
import yaml

from conftest import ROOT


def make(*args, cwd=ROOT, path_prefix=None) -> subprocess.CompletedProcess:
    """`make ARGS`, unaffected by a `make test` that may be running this test."""
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    if path_prefix:
        env["PATH"] = f"{path_prefix}{os.pathsep}{env['PATH']}"
    return subprocess.run(["make", "--no-print-directory", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=30)


def fake_program(path, text):
    """An executable shell script: `text` is its body."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n" + text + "\n")
    path.chmod(0o755)
    return path


@pytest.mark.parametrize("version, ok", [("3.9.18", False), ("3.10.12", False),
                                         ("3.11.0", True), ("3.11.2", True), ("3.11.13", True),
                                         ("3.12.3", True), ("3.13.0", False)])
def test_check_python_version(tmp_path, version, ok):
    python = fake_program(tmp_path / "python", f"echo {version}")
    proc = make("check-python", f"PYTHON={python}")
    assert (proc.returncode == 0) == ok, proc.stderr
    if not ok:
        first = proc.stderr.splitlines()[0]
        assert f"{python} is Python {version}" in first
        assert "needs Python 3.11 or 3.12" in first
        assert "make PYTHON=python3.12" in first


def test_check_python_missing_interpreter():
    proc = make("check-python", "PYTHON=no-such-python3")
    assert proc.returncode != 0 and "no-such-python3 is not found" in proc.stderr


def test_setup_checks_python_before_making_the_venv(tmp_path):
    python = fake_program(tmp_path / "python", "echo 3.13.0")
    venv = tmp_path / "venv"
    proc = make("setup", f"VENV={venv}", f"PYTHON={python}")
    assert proc.returncode != 0
    assert "run e.g. make PYTHON=python3.12 setup" in proc.stderr
    assert not venv.exists()


@pytest.mark.parametrize("uid", ["0", "1000"])
def test_lab_allows_root_only_as_root(tmp_path, uid):
    """Jupyter exits with 'Running as root is not recommended' unless given --allow-root."""
    fake_program(tmp_path / "fakebin" / "id", f"echo {uid}")
    venv = tmp_path / "venv"
    fake_program(venv / "bin" / "jupyter", 'echo "jupyter $*" > "$(dirname "$0")/args"')
    proc = make("-o", f"{venv}/.installed", "lab", f"VENV={venv}", "LAB_DIR=notebooks",
                path_prefix=tmp_path / "fakebin")
    assert proc.returncode == 0, proc.stderr
    args = (venv / "bin" / "args").read_text().split()
    assert args[:6] == ["jupyter", "lab", "--ip", "127.0.0.1", "--notebook-dir", "."]
    assert "--LabApp.default_url=/lab/tree/notebooks" in args  # opens at notebooks/
    assert ("--allow-root" in args) == (uid == "0")
    assert ("running as root" in proc.stderr) == (uid == "0")
    assert not any("token" in a for a in args)  # jupyter's token stays on


def test_clean_removes_build_and_checkpoints_but_not_the_venv(tmp_path):
    shutil.copy(ROOT / "Makefile", tmp_path)
    made = ["build/logs/run/0", "notebooks/.ipynb_checkpoints", "code/ch00/.ipynb_checkpoints",
            "code/distkit/__pycache__", ".pytest_cache"]
    kept = [".venv/lib/site/.ipynb_checkpoints", ".venv/lib/site/__pycache__", "notebooks/x"]
    for d in made + kept:
        (tmp_path / d).mkdir(parents=True)
    proc = make("clean", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert [d for d in made if (tmp_path / d).exists()] == []
    assert [d for d in kept if not (tmp_path / d).exists()] == []


@pytest.mark.parametrize("target, command", [
    ("test", ".venv/bin/python -m pytest -n 2 --dist loadfile --durations=15; a=$?; \\\n"
             ".venv/bin/python -m pytest -m \"(notebook or alone) and not second_nproc and not "
             "stress\" \\\n  --durations=10; b=$?; exit $((a | b))"),
    ("test-nproc", ".venv/bin/python -m pytest -n 2 --dist loadfile -m second_nproc tests"),
    ("stress", ".venv/bin/python tests/stress.py"),
    ("course", ".venv/bin/python -m distkit.course.run_course"),
    ("images", ".venv/bin/python -m distkit.course.diagrams"),
    ("exercises", ".venv/bin/python -m distkit.course.exercise --write"),
    ("starters", ".venv/bin/python -m distkit.course.exercise --write"),
    ("lint", ".venv/bin/ruff check ."),
])
def test_targets_run(target, command):
    proc = make("-n", "-o", ".venv/.installed", target)
    assert proc.returncode == 0, proc.stderr
    lines = command.splitlines()
    assert proc.stdout.splitlines()[-len(lines):] == lines


def test_ci_workflow_runs_make_test_on_python_3_11():
    wf = yaml.safe_load((ROOT / ".github" / "workflows" / "test.yml").read_text())
    triggers = wf.get("on", wf.get(True))  # YAML 1.1 reads a bare `on` as True
    assert {"push", "pull_request"} <= set(triggers)
    (job,) = wf["jobs"].values()
    assert job["runs-on"] == "ubuntu-latest"
    steps = job["steps"]
    (setup,) = [s for s in steps if s.get("uses", "").startswith("actions/setup-python@")]
    assert str(setup["with"]["python-version"]) == "3.11"
    assert setup["with"]["cache"] == "pip"
    assert setup["with"]["cache-dependency-path"] == "requirements.txt"
    assert [s["run"] for s in steps if "run" in s] == ["make lint", "make test", "make test-nproc"]


def test_ci_script_runs_the_readme_commands():
    lines = (ROOT / ".ci" / "run").read_text().splitlines()
    assert [ln for ln in lines if ln.startswith("make")] == [
        "make lint", "make test", "make test-nproc"]

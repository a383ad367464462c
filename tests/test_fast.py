"""`make course FAST=1`: each notebook's FAST parameters (distkit/course/run_course.py) are
parameters of
that notebook, of their defaults' types, and pass the notebook's own parameter check.

Without running the notebooks: the parameters cell runs here, then the FAST values as papermill
would inject them, then the check cell, in a scratch root (conftest.run_parameter_check: the
check cells also clear build/chNN). A wrong set fails the same way (NPROC = 1, below), so the
check is real. Whether each notebook then runs in about a minute is measured by
`make course FAST=1`, not here.
"""
import os
import subprocess

import pytest

from conftest import ROOT, run_parameter_check
from distkit.course.run_course import FAST

NOTEBOOKS = ROOT / "notebooks"


@pytest.mark.parametrize("name", sorted(FAST))
def test_fast_parameters_pass_the_notebooks_check(name, tmp_path, monkeypatch):
    defaults = run_parameter_check(name, FAST[name], tmp_path, monkeypatch)
    for key, value in FAST[name].items():  # a parameter of this notebook, of its default's type
        assert defaults[key] is None or type(value) is type(defaults[key]), key


@pytest.mark.parametrize("name", sorted(n for n in FAST if n[:2] <= "07"))  # 08 has no NPROC
def test_a_bad_parameter_fails_the_same_check(name, tmp_path, monkeypatch):
    with pytest.raises(ValueError, match=r"^bad parameters: .*NPROC.* must be"):
        run_parameter_check(name, {**FAST[name], "NPROC": 1}, tmp_path, monkeypatch)


def test_every_numbered_notebook_has_a_fast_set():
    """A new chapter adds its own (an empty one keeps the defaults)."""
    have = {p.name for p in NOTEBOOKS.glob("[0-9][0-9]_*.ipynb")}
    assert have <= set(FAST), sorted(have - set(FAST))


def test_make_course_fast_passes_the_flag():
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    proc = subprocess.run(["make", "--no-print-directory", "-n", "-o", ".venv/.installed",
                           "course", "FAST=1"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == ".venv/bin/python -m distkit.course.run_course --fast"

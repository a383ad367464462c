"""`make course FAST=1`: each notebook's FAST parameters (distkit/run_course.py) are parameters of
that notebook, of their defaults' types, and pass the notebook's own parameter check.

Without running the notebooks: the parameters cell runs here, then the FAST values as papermill
would inject them, then the check cell's `require(...)` with the plain assignments it reads (not
the cell's side effects: it also clears build/chNN). A wrong set fails the same way (NPROC = 1,
below), so the check is real. Whether each notebook then runs in about a minute is measured by
`make course FAST=1`, not here.
"""
import ast
import json
import math
import os
import subprocess

import pytest

from conftest import ROOT
from distkit.notebook import require
from distkit.run_course import FAST

NOTEBOOKS = ROOT / "notebooks"
UNSAFE = {"ROOT", "OUT", "Path", "time", "shutil", "os", "sys", "torch", "subprocess"}


def cells(name):
    """(the parameters cell's source, the check cell's: the next code cell)."""
    nb = json.loads((NOTEBOOKS / name).read_text())["cells"]
    i = next(i for i, c in enumerate(nb) if "parameters" in c["metadata"].get("tags", []))
    check = next(c for c in nb[i + 1:] if c["cell_type"] == "code")
    return "".join(nb[i]["source"]), "".join(check["source"])


def parameter_check(source: str) -> str:
    """The check cell's require(...) and what it reads: its math and distkit.memory imports and
    its assignments to plain names that touch no file, clock or process."""
    keep = []
    for node in ast.parse(source).body:
        names = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
        if isinstance(node, ast.ImportFrom) and node.module == "distkit.memory":
            keep.append(node)
        elif isinstance(node, ast.Assign) and not names & UNSAFE and all(
                isinstance(t, ast.Name) for t in node.targets):
            keep.append(node)
        elif isinstance(node, ast.Expr) and isinstance(node.value, ast.Call) and \
                getattr(node.value.func, "id", None) == "require":
            keep.append(node)
            break
    assert keep and isinstance(keep[-1], ast.Expr), "no require(...) in the check cell"
    return ast.unparse(ast.Module(body=keep, type_ignores=[]))


def run_check(name, values):
    params, check = cells(name)
    namespace = {"math": math, "require": require}
    exec(params, namespace)
    defaults = {k: namespace[k] for k in values}
    namespace.update(values)  # as papermill's injected cell does
    exec(parameter_check(check), namespace)
    return defaults


@pytest.mark.parametrize("name", sorted(FAST))
def test_fast_parameters_pass_the_notebooks_check(name):
    assert (NOTEBOOKS / name).exists()
    defaults = run_check(name, FAST[name])
    for key, value in FAST[name].items():
        assert type(value) is type(defaults[key]), key  # a parameter of this notebook, same type


@pytest.mark.parametrize("name", sorted(n for n in FAST if n[:2] <= "07"))  # 08 has no NPROC
def test_a_bad_parameter_fails_the_same_check(name):
    with pytest.raises(ValueError, match=r"^bad parameters: .*NPROC.* must be"):
        run_check(name, {**FAST[name], "NPROC": 1})


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
    assert proc.stdout.splitlines()[-1] == ".venv/bin/python -m distkit.run_course --fast"

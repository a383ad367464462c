"""Every papermill command the course suggests passes the notebook's own parameter check.

A notebook's parameters cell and its prose suggest overrides (`-p NPROC 4 -p LAYERS 4` on a
4-GPU node); the README and docs/ give whole `papermill notebooks/NN_x.ipynb ... -p ...`
lines. A suggestion that the next cell's `require(...)` rejects sends a learner on a GPU node
straight into an error. Each one is checked here the way papermill would run it, but only as far
as the check: the parameters cell, papermill's injected values, then the first code cell after the
parameters (the check), in a scratch folder (the check cells create and empty build/chNN).
Notebooks are found by glob, so a new chapter is covered as soon as it exists.
"""
import re
import shlex

import nbformat
import pytest
import yaml
from papermill.cli import _resolve_type  # how `papermill -p NAME VALUE` types VALUE

from conftest import ROOT, run_parameter_check

NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
# `...` spans and fenced lines that pass papermill options (-p NAME VALUE, -r, -y)
OPTION = re.compile(r"(?:^|\s)-(?:p|r|y)\s")
SPAN = re.compile(r"`([^`\n]+)`|^```[^\n]*\n(.*?)^```", re.M | re.S)


def parse(command: str) -> dict:
    """papermill's options in `command` as the parameters it would inject (-p, -r, -y)."""
    words, params, i = shlex.split(command), {}, 0
    while i < len(words):
        w = words[i]
        if w in ("-p", "--parameters", "-r", "--parameters_raw"):
            name, value = words[i + 1], words[i + 2]
            params[name] = _resolve_type(value) if w in ("-p", "--parameters") else value
            i += 3
        elif w in ("-y", "--parameters_yaml"):
            params.update(yaml.safe_load(words[i + 1]) or {})
            i += 2
        else:
            i += 1
    return params


def commands_in(text: str) -> list[str]:
    """Each suggested command in a cell's or a file's text: a `...` span or a fenced line."""
    found = []
    for span, fence in SPAN.findall(text):
        lines = [span] if span else fence.splitlines()
        found += [line for line in lines if OPTION.search(f" {line}") and suggests(line)]
    return found


def suggests(line: str) -> bool:
    """A papermill command, or papermill options only (not another tool's `-p PREFIX`)."""
    if "papermill" in line:
        return True
    try:
        return bool(parse(line))
    except (IndexError, ValueError):
        return False


# The README and the reference pages in docs/ (docs/parameters.md holds the papermill examples)
DOCS = "\n".join(p.read_text()
                 for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))])


def suggestions() -> list:
    """(notebook, command) for every suggestion: in a notebook's parameters cell (its comments)
    or markdown, and the `papermill notebooks/...` lines of the README and docs/."""
    cases = []
    for path in NOTEBOOKS:
        cells = nbformat.read(path, as_version=4).cells
        for cell in cells:
            tagged = "parameters" in cell.metadata.get("tags", [])
            if tagged or cell.cell_type == "markdown":
                cases += [(path.name, c) for c in commands_in(cell.source)]
    for line in DOCS.splitlines():
        if m := re.search(r"papermill (notebooks/)?(\d\d_\w+\.ipynb)\s.*", line):
            cases.append((m.group(2), m.group(0)))
    return cases


CASES = suggestions()


def test_suggestions_are_found():
    """The extraction itself: chapter 02's GPU suggestion and the README's example are found."""
    names = {name for name, _ in CASES}
    assert "02_model_parallelism.ipynb" in names and "01_data_parallel_ddp.ipynb" in names, CASES
    assert parse('-p NPROC 4 -p NAME x -r RAW 5 -y "L: [3, 2]"') == \
        {"NPROC": 4, "NAME": "x", "RAW": "5", "L": [3, 2]}


@pytest.mark.parametrize("notebook,command", CASES, ids=[f"{n[:2]}: {c}" for n, c in CASES])
def test_suggested_command_passes_the_check(notebook, command, tmp_path, monkeypatch):
    overrides = parse(command)
    assert overrides, f"no papermill parameters in {command!r}"
    try:
        run_parameter_check(notebook, overrides, tmp_path, monkeypatch)
    except ValueError as e:
        pytest.fail(f"{notebook}: the suggested {command!r} fails its check cell: {e}")


# docs' `python -m distkit.course.run_course -p NAME=VALUE ...`: every notebook gets the values
RUN_COURSE = re.findall(r"distkit\.course\.run_course((?:\s+-p\s+\w+=\S+)+)", DOCS)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name[:2])
def test_readme_run_course_parameters_pass_every_notebooks_check(path, tmp_path, monkeypatch):
    """run_course passes its -p values to every notebook (papermill injects them; a notebook
    without such a parameter ignores it), so each notebook's check must accept the docs'
    suggestion: `-p NPROC=4` once failed notebook 05 (CRASH_STEP 13 past its 10 steps) and 06
    (BATCH 16 no multiple of MICRO 8 x 4); both now follow NPROC unless given."""
    assert RUN_COURSE, "docs/ no longer suggest a run_course -p command"
    cell = next(c for c in nbformat.read(path, as_version=4).cells
                if "parameters" in c.metadata.get("tags", []))
    names = {}
    exec(cell.source, names)
    for i, options in enumerate(RUN_COURSE):
        values = {k: _resolve_type(v) for k, v in re.findall(r"-p\s+(\w+)=(\S+)", options)
                  if k in names}
        (tmp_path / str(i)).mkdir()
        try:
            run_parameter_check(path.name, values, tmp_path / str(i), monkeypatch)
        except ValueError as e:
            pytest.fail(f"{path.name}: the docs' run_course{options} fails its check: {e}")

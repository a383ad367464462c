"""Chapter 01's exercises: the solutions meet their claims, the starters stop at their TODOs.

Budget: 30 s on 2 cores, where a 2-process launch costs ~5 s (each rank imports torch and
transformers). The notebook runs exercise 2's solution (ex01_overlap.py, its three modes in one
launch) and asserts its call counts, bytes, parity and the order of its timeline, so nbval proves
those. Here: exercise 1's solution in both modes (the notebook no longer runs it), one launch of a
starter; the one-process reference, --help and bad input run in this process (argparse stops the
scripts before setup(), so they need no process group).
"""
import json
import runpy
import sys

import pytest

from conftest import (CODE, check_starter, check_stopped_at_todo, run_in_process, run_json,
                      run_launcher)

LOSS_TOL = 1e-4    # per-step loss, data-parallel vs one process (the notebook's LOSS_TOL)
EXERCISES = ["ex01_manual_ddp.py", "ex01_overlap.py"]


# --- exercise 1: DDP by hand, solution --------------------------------------------------------

@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """The reference: train_single.py, one process, global batch 16, 64 sequences, 2 epochs
    (8 steps). It uses no process group, so it runs in this process: that saves starting
    another Python that imports torch and transformers (~5 s of CPU)."""
    out = tmp_path_factory.mktemp("single") / "single.json"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sys, "argv", ["train_single.py", "--batch-size", "16", "--samples", "64",
                                 "--json", str(out)])
        runpy.run_path(str(CODE / "ch01_ddp/train_single.py"), run_name="__main__")
    return json.loads(out.read_text())["losses"]


@pytest.mark.parametrize("flag, calls", [([], 21), (["--flat"], 1)])
def test_manual_ddp_matches_one_process(tmp_path, single, flag, calls):
    """One all_reduce per parameter tensor (21), or one of them all flattened (--flat)."""
    res, out = run_json(tmp_path, 2, "ch01_ddp/solutions/ex01_manual_ddp.py", "--batch-size", 8,
                        "--samples", 64, *flag)
    assert len(res["losses"]) == len(single) == 8
    assert max(abs(a - b) for a, b in zip(res["losses"], single)) < LOSS_TOL
    assert res["calls_per_step"] == calls and f"all_reduce calls per step: {calls}" in out
    # different seeds per rank, until the broadcast; identical steps keep them identical
    assert res["identical"] == {"start": False, "broadcast": True, "end": True}


# --- arguments: --help, bad input (in this process: argparse exits before setup) ---------------

@pytest.mark.parametrize("name", EXERCISES)
def test_starter_takes_the_solutions_arguments(monkeypatch, capsys, name):
    helps = []
    for folder in ("exercises", "solutions"):
        code, out, _ = run_in_process(monkeypatch, capsys, f"ch01_ddp/{folder}/{name}", "--help")
        assert code == 0 and "--json" in out
        helps.append(out[out.index("options:"):])  # after the usage and the description
    assert helps[0] == helps[1]


@pytest.mark.parametrize("folder", ["solutions", "exercises"])
@pytest.mark.parametrize("name, args, message", [
    ("ex01_overlap.py", ["--bucket-mb", "0"], "--bucket-mb > 0"),
    ("ex01_overlap.py", ["--steps", "1"], "--steps >= 2"),
    ("ex01_overlap.py", ["--modes", "flat,ring"], "--modes: unknown ring"),
    ("ex01_manual_ddp.py", ["--batch-size", "0"], "must be positive"),
    ("ex01_manual_ddp.py", ["--samples", "4"], "--samples >="),
])
def test_bad_input(monkeypatch, capsys, folder, name, args, message):
    monkeypatch.setenv("WORLD_SIZE", "2")  # as torchrun would set it
    code, _, err = run_in_process(monkeypatch, capsys, f"ch01_ddp/{folder}/{name}", *args)
    assert code == 2 and message in err
    lines = err.strip().splitlines()
    assert lines[0].startswith("usage:") and lines[-1].startswith(f"{name}: error:")


# --- starters ---------------------------------------------------------------------------------

@pytest.mark.parametrize("name, stops", [("ex01_manual_ddp.py", 4), ("ex01_overlap.py", 6)])
def test_starter_marks_every_todo(name, stops):
    check_starter("ch01_ddp", name, stops)


def test_starter_stops_at_its_first_todo():
    """Launched like a learner would: the given flat mode is skipped, per-param stops at once."""
    proc = run_launcher(2, "ch01_ddp/exercises/ex01_overlap.py", "--modes", "per-param",
                        "--steps", 2, timeout=120)
    # the path relative to the cwd; which rank the report names is a race (see the helper)
    check_stopped_at_todo(proc, 2, "code/ch01_ddp/exercises/ex01_overlap.py",
                          "per-param: register self._ready")

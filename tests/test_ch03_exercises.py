"""Chapter 03's exercise beyond what its notebook proves: the starter stops at its TODOs, and
takes the solution's arguments; bad input.

The notebook runs the solution (losses and weights = one process, weights identical on every
rank, each rank's AdamW state = one shard's 8 S + 4 bytes, one process's 8 Psi + 4 per tensor:
asserted under nbval, at N=3 in `make test-nproc`), so it is not launched again here. Budget:
one launch of the starter (~5 s on 2 cores, each rank importing torch and transformers); --help
and bad input run in this process (argparse stops the scripts before setup(), so they need no
process group).
"""

import pytest

from conftest import (check_same_options, check_starter, check_stopped_at_todo, run_in_process,
                      run_launcher)

EX = "ch03_zero/{}/ex03_zero1_by_hand.py"
NAME = "ex03_zero1_by_hand.py"
NPROC = 2


@pytest.fixture(scope="module")
def runs():
    """{"starter": CompletedProcess}"""
    return {"starter": run_launcher(NPROC, EX.format("exercises"), timeout=120)}


# --- the starter ------------------------------------------------------------------------------

def test_starter_stops_at_its_first_todo(runs):
    """Launched like a learner would: both ranks stop at the shard, before any step."""
    proc = runs["starter"]
    # the path relative to the cwd; which rank the report names is a race (see the helper)
    check_stopped_at_todo(proc, NPROC, f"code/{EX.format('exercises')}",
                          "pick this rank's shard of flat")
    assert "step  1" not in proc.stdout


def test_starter_marks_every_todo():
    check_starter("ch03_zero", "ex03_zero1_by_hand.py", 3)


# --- arguments: --help, bad input (in this process: argparse exits before setup) ---------------

def test_starter_takes_the_solutions_arguments(monkeypatch, capsys):
    check_same_options(monkeypatch, capsys, EX)


@pytest.mark.parametrize("folder", ["solutions", "exercises"])
@pytest.mark.parametrize("args", [["--steps", "0"], ["--batch-size", "0"]])
def test_bad_input(monkeypatch, capsys, folder, args):
    code, _, err = run_in_process(monkeypatch, capsys, EX.format(folder), *args,
                                  env={"WORLD_SIZE": str(NPROC)})  # as torchrun would set it
    lines = err.strip().splitlines()
    assert code == 2 and lines[0].startswith("usage:")
    assert lines[-1] == f"{NAME}: error: need --steps >= 1 and --batch-size >= 1"

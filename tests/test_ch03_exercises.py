"""Chapter 03's exercise: through its checker (`make exercise EX=03.1`) at 3 ranks, the solution,
copied over its starter, passes and a wrong answer fails with the line that names it (both in
`make test-nproc`, marker second_nproc); arguments and bad input.

In `make test` nothing is launched here: the notebook runs the solution at 2 ranks (losses and
weights = one process, weights identical on every rank, each rank's AdamW state = one shard's
8 S + 4 bytes, asserted under nbval), tests/test_exercises.py checks the untouched starter, and
--help and bad input run in this process (argparse stops the scripts before setup()).
"""
import pytest

from conftest import check_same_options, run_in_process
from distkit.course.exercise import check_at_once

EX = "ch03_zero/{}/ex03_zero1_by_hand.py"
NAME = "ex03_zero1_by_hand.py"
NPROC = 2


@pytest.fixture(scope="module")
def checks(tmp_path_factory):
    return check_at_once({
        "solution": ("03.1", None),
        # the updated shards never reach the model: every step trains the initial weights
        "no_all_gather": ("03.1", ("dist.all_gather_single(flat, shard.detach())", None)),
    }, tmp_path_factory.mktemp("ch03_ex"), nprocs="largest")


@pytest.mark.second_nproc
def test_solution_passes(checks):
    ok, lines, runs = checks["solution"]
    assert ok, lines
    assert lines[1:] == [
        "PASS [3 ranks] losses = one process's at every step (< 1e-04)",
        "PASS [3 ranks] weights after the last step = one process's",
        "PASS [3 ranks] weights identical on every rank",
        "PASS [3 ranks] each rank's AdamW state = 8 x S + 4 = 263,004 bytes (one process: 789,076)"]
    (_, res, _), = runs
    assert res["world_size"] == 3 and res["optimizer_tensors_held"] == 1


@pytest.mark.second_nproc
def test_a_wrong_answer_is_named(checks):
    ok, lines, _ = checks["no_all_gather"]
    assert not ok
    assert lines[-1].startswith("FAIL [3 ranks] losses differ from one process's at step 2 by ")
    assert lines[-1].endswith("(tolerance 1e-04)")


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

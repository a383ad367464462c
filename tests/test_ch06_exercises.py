"""Chapter 06's exercise: the solution's held-out loss on 3 ranks, whose shares of the held-out
sequences differ (50 = 17 + 17 + 16), is one process's; and the starter stops at its TODO.

Budget: 15 s on 2 cores, where every process that imports torch and transformers costs ~4.5 s
of CPU before it does anything. So the three processes of one launch of the solution and the
starter, as one plain-Python process of a one-process group (the same code path up to its TODO,
without a launch), start at once, sharing one fresh data cache (corpus.prepare is safe against
that race). --help and bad input run in this process: argparse stops the scripts before setup().
Wrong answers are not launched here (one more launch is ~9 s); measured by hand on 3 ranks: a
mean of the ranks' means misses by 1.5e-4, a dropped or an extra sequence by 1e-3 or more (all
far above the 1e-5 tolerance), and a rank that skips its padding batch leaves the others in an
all-gather until the process group's timeout. test_defaults_make_the_traps_show pins the
defaults that put a padding batch and uneven shares in the run.
"""
import ast
import math
from concurrent.futures import ThreadPoolExecutor

import pytest

from conftest import (CODE, check_same_options, check_starter, run_in_process, run_json,
                      run_scripts_at_once)

EVAL = "ch06_capstone/{}/ex06_eval.py"
NPROC = 3
ONE_PROCESS = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "localhost"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{"solution": (json, stdout), "starter": (status, stdout, stderr)}"""
    tmp = tmp_path_factory.mktemp("ch06_ex")
    data = ["--data-dir", tmp / "data"]
    with ThreadPoolExecutor() as pool:  # threads only wait for the subprocesses
        solution = pool.submit(run_json, tmp, NPROC, EVAL.format("solutions"), *data)
        starter = pool.submit(run_scripts_at_once,
                              {"starter": (EVAL.format("exercises"), data, ONE_PROCESS)})
        return {"solution": solution.result(), "starter": starter.result()["starter"]}


def cpu_tiny(path, name):
    """The dict that `name` is (for PRESETS: its "cpu-tiny" entry) in the file at `path`, read
    from the source without running it; a {...} literal or a dict(...) call."""
    def value(node):
        if isinstance(node, ast.Call):
            return {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords}
        return ast.literal_eval(node)
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == name:
            if name == "PRESETS":
                return value(next(v for k, v in zip(node.value.keys, node.value.values)
                                  if k.value == "cpu-tiny"))
            return value(node.value)
    raise AssertionError(f"no {name} in {path}")


# --- the solution ---------------------------------------------------------------------------

def test_sharded_loss_is_one_processes(runs):
    res, _ = runs["solution"]
    assert res["world_size"] == NPROC
    assert res["same"] is True
    assert abs(res["sharded_loss"] - res["one_process_loss"]) < res["tolerance"] == 1e-5
    # an untrained model: about a uniform guess over the vocabulary (a real cross-entropy)
    assert abs(res["sharded_loss"] - math.log(2048)) < 0.5


def test_defaults_make_the_traps_show(runs):
    """Uneven shares (a mean of means would miss) and a rank that runs a padding batch: every
    rank runs as many forwards as the largest share needs, the smallest share fewer."""
    res, _ = runs["solution"]
    n, mb = res["heldout_sequences"], res["micro_batch"]
    assert n == 50 and n % NPROC != 0 and mb == 8
    forwards = math.ceil(math.ceil(n / NPROC) / mb)
    assert res["forwards"] == [forwards] * NPROC
    assert math.ceil((n // NPROC) / mb) < forwards  # the smallest share needs one fewer


def test_solution_prints_its_check(runs):
    res, out = runs["solution"]
    assert out.splitlines() == [
        f"{res['heldout_sequences']} held-out sequences of 128 tokens on 3 ranks, "
        f"micro-batches of 8",
        f"forwards per rank: {res['forwards']}",
        f"held-out loss: {res['sharded_loss']:.3f} (a uniform guess over 2048 tokens: 7.625)",
        "sharded == one process: True"]


def test_model_is_the_capstones():
    """The exercise evaluates the capstone's cpu-tiny Llama: the same config as its preset."""
    capstone = cpu_tiny(CODE / "ch06_capstone" / "train_llama.py", "PRESETS")
    for folder in ("solutions", "exercises"):
        assert cpu_tiny(CODE / EVAL.format(folder), "CPU_TINY") == capstone


# --- the starter ------------------------------------------------------------------------------

def test_starter_stops_at_its_todo(runs):
    """As a learner's first run goes: one line on stderr, exit status 1, nothing printed."""
    status, out, err = runs["starter"]
    assert status == 1, err
    assert len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"TODO(you) at code/{EVAL.format('exercises')}:")
    assert err.strip().endswith("evaluate(): the mean held-out loss over every sequence, on any "
                                "number of ranks")
    assert out == "" and "Traceback" not in err


def test_starter_marks_its_todo():
    check_starter("ch06_capstone", "ex06_eval.py", 1)


# --- arguments: --help, bad input (in this process: argparse exits before setup) ---------------

def test_starter_takes_the_solutions_arguments(monkeypatch, capsys):
    check_same_options(monkeypatch, capsys, EVAL)


@pytest.mark.parametrize("folder", ["solutions", "exercises"])
@pytest.mark.parametrize("value", ["0", "-2"])
def test_bad_input(monkeypatch, capsys, folder, value):
    path = EVAL.format(folder)
    code, _, err = run_in_process(monkeypatch, capsys, path, "--micro-batch", value)
    lines = err.strip().splitlines()
    assert code == 2 and lines[0].startswith("usage:")
    assert lines[-1] == "ex06_eval.py: error: need --micro-batch >= 1"

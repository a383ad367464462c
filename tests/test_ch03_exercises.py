"""Chapter 03's exercises: ZeRO-1 by hand meets its claims, the starter stops at its TODOs.

Budget: about 15 s on 2 cores, where a 2-process launch costs ~5 s (each rank imports torch and
transformers). So: one launch of the solution (it trains the one-process reference itself), one
launch of the starter; --help and bad input run in this process (argparse stops
the scripts before setup(), so they need no process group).
"""

import pytest

from conftest import (check_same_options, check_starter, check_stopped_at_todo, run_in_process,
                      run_json, run_launcher)
from distkit.memory import FP32_ADAMW, model_state_bytes

EX = "ch03_zero/{}/ex03_zero1_by_hand.py"
NAME = "ex03_zero1_by_hand.py"
LOSS_TOL = 1e-4    # per-step loss, ZeRO-1 vs one process on the global batch
WEIGHT_TOL = 1e-4  # weights after the last AdamW step
NPROC = 2


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{"solution": (json, stdout), "starter": CompletedProcess}. One after the other: on 2 cores,
    two launches at once (4 ranks) took longer than in turn (measured 14-20 s against 13.5)."""
    tmp = tmp_path_factory.mktemp("ch03_ex")
    return {"solution": run_json(tmp, NPROC, EX.format("solutions")),
            "starter": run_launcher(NPROC, EX.format("exercises"), timeout=120)}


# --- the solution -----------------------------------------------------------------------------

def test_zero1_matches_one_process(runs):
    res, out = runs["solution"]
    assert res["world_size"] == NPROC and res["steps"] == 6
    assert len(res["losses"]) == len(res["single_losses"]) == res["steps"]
    assert res["tolerances"] == {"loss": LOSS_TOL, "weight": WEIGHT_TOL}  # not loosened
    assert res["max_loss_diff"] < LOSS_TOL and res["max_weight_diff"] < WEIGHT_TOL
    assert res["parity"] is True
    assert res["losses"][-1] < res["losses"][0]  # it trains
    assert "max loss difference vs one process        < 1e-4: True" in out
    assert "max weight difference after the last step < 1e-4: True" in out
    assert "False" not in out


def test_optimizer_state_is_one_shard(runs):
    """AdamW's exp_avg and exp_avg_sq for the S values of the shard (4 bytes each) and one 4-byte
    step counter per tensor held (one: the shard); one process holds 8 Psi and 21 counters."""
    res, out = runs["solution"]
    psi, n, s = res["num_params"], res["world_size"], res["shard_size"]
    assert res["padded"] == n * s and 0 <= res["padded"] - psi < n
    assert res["optimizer_tensors_held"] == 1
    assert res["optimizer_state_bytes"] == [8 * s + 4 * res["optimizer_tensors_held"]] * n
    assert res["single_optimizer_state_bytes"] == 8 * psi + 4 * res["num_param_tensors"]
    # the ZeRO-1 formula (fp32 AdamW: 8 bytes per value, Psi / N exactly) within 1%: padding
    # and the step counters are the difference
    for stage, got in ((1, res["optimizer_state_bytes"][0]),
                       (0, res["single_optimizer_state_bytes"])):
        want = model_state_bytes(psi, n, stage, FP32_ADAMW)["optimizer"]
        assert abs(got - want) <= 0.01 * want, (stage, got, want)
    assert res["ratio"] == res["optimizer_state_bytes"][0] / res["single_optimizer_state_bytes"]
    assert abs(res["ratio"] - 1 / n) < 0.01
    assert f"[rank 1] shard [{s:,}, {2 * s:,}): AdamW state {8 * s + 4:,} bytes" in out
    assert f"one process's AdamW state: {res['single_optimizer_state_bytes']:,} bytes" in out
    assert f"optimizer state per rank / one process's: {1 / n:.3f}" in out


def test_weights_identical_on_every_rank(runs):
    res, out = runs["solution"]
    assert res["identical"] is True
    assert "after training, weights identical on every rank: True" in out


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

"""Chapter 01's exercises: the solutions meet their claims, the starters stop at their TODOs.

Budget: 30 s on 2 cores, where a 2-process launch costs ~5 s (each rank imports torch and
transformers). So: one launch per solution (ex01_overlap.py sweeps its three modes in one run),
one launch of a starter; the one-process reference, --help and bad input run in this process
(argparse stops the scripts before setup(), so they need no process group).
"""
import json
import runpy
import sys

import pytest

from conftest import (CODE, check_starter, check_stopped_at_todo, run_in_process, run_json,
                      run_launcher)

LOSS_TOL = 1e-4    # per-step loss, data-parallel vs one process (the notebook's LOSS_TOL)
GRAD_TOL = 1e-5    # averaged gradients vs one process's, every step
WEIGHT_TOL = 1e-4  # weights after the last AdamW step
EXERCISES = ["ex01_manual_ddp.py", "ex01_overlap.py"]


# --- exercise 2: overlap, solution ------------------------------------------------------------

@pytest.fixture(scope="module")
def overlap(tmp_path_factory):
    """One launch: flat, per-param and bucketed, 8 steps each, plus the one-process reference."""
    return run_json(tmp_path_factory.mktemp("overlap"), 2, "ch01_ddp/solutions/ex01_overlap.py",
                    "--times")


def test_overlap_every_mode_matches_one_process(overlap):
    res, out = overlap
    assert list(res["modes"]) == ["flat", "per-param", "bucketed"]
    for mode, r in res["modes"].items():
        assert len(r["losses"]) == len(res["single_losses"]) == res["steps"] == 8, mode
        assert r["max_loss_diff"] < LOSS_TOL, mode
        assert r["max_grad_diff"] < GRAD_TOL, mode
        assert r["max_weight_diff"] < WEIGHT_TOL, mode
    table = out[out.index("mode "):out.index("rank 0, ms")]
    assert "True" in table and "False" not in table  # the printed bounds say the same


def test_overlap_call_counts_and_bytes(overlap):
    res, out = overlap
    modes, n = res["modes"], res["num_param_tensors"]
    assert n == 21
    assert set(modes["flat"]["calls_per_step"]) == {1}
    assert set(modes["per-param"]["calls_per_step"]) == {n}
    buckets = modes["bucketed"]["buckets"]
    assert set(modes["bucketed"]["calls_per_step"]) == {len(buckets)} and 1 < len(buckets) < n
    assert sum(modes["bucketed"]["bucket_tensors"]) == n and sum(buckets) == res["grad_bytes"]
    cap = res["bucket_mb"] * 2**20  # every bucket but the last is closed once it reaches the cap
    assert all(b >= cap for b in buckets[:-1])
    for mode, r in modes.items():  # every step all-reduces exactly the gradient bytes
        assert set(r["bytes_per_step"]) == {res["grad_bytes"]}, mode
    table = out[:out.index("rank 0, ms")].splitlines()  # before the times
    printed = {ln.split()[0]: ln.split()[1] for ln in table if ln.split()[:1] in
               (["flat"], ["per-param"], ["bucketed"])}
    assert printed == {"flat": "1", "per-param": str(n), "bucketed": str(len(buckets))}


def test_overlap_timeline(overlap):
    """The times vary; their order does not: hooks launch during backward, flat after it."""
    res, _ = overlap
    for mode, r in res["modes"].items():
        for step in r["steps"]:
            end, calls = step["backward_end"], step["calls"]
            assert all(0 <= c["launched"] <= c["done"] <= step["finished"] for c in calls), mode
            during = [c["launched"] < end for c in calls]
            assert all(during) if mode != "flat" else not any(during), mode
            assert step["exposed"] == max(0.0, max(c["done"] for c in calls) - end)
        assert r["exposed_ms"] >= 0 and r["backward_ms"] > 0


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


def test_manual_ddp_matches_one_process(tmp_path, single):
    """--flat (one all_reduce per step); the notebook runs both modes against train_single.py."""
    res, out = run_json(tmp_path, 2, "ch01_ddp/solutions/ex01_manual_ddp.py", "--batch-size", 8,
                        "--samples", 64, "--flat")
    assert len(res["losses"]) == len(single) == 8
    assert max(abs(a - b) for a, b in zip(res["losses"], single)) < LOSS_TOL
    assert res["calls_per_step"] == 1 and "all_reduce calls per step: 1" in out
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

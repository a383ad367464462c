"""Chapter 07's Hogwild! script: real lock-free workers and synchronous SGD both learn, and a
fixed staleness is harmless at a small learning rate but makes a large one diverge.

Budget: one run of the script (~5 s on 2 cores: 3 torch imports, one per process), started
before the first test so that the bad-input tests (in-process: one torch import here) overlap
it. The Hogwild run is not deterministic (the OS interleaves its workers): only what holds in
every interleaving is asserted.
"""
import json
import math
import subprocess
import sys

import pytest

from conftest import CODE, launcher_env, run_in_process

SCRIPT = "ch07_debugging/hogwild.py"


@pytest.fixture(scope="module", autouse=True)
def started(tmp_path_factory):
    """The script with --json, running in the background from the first test of this file on."""
    out = tmp_path_factory.mktemp("hogwild") / "hogwild.json"
    proc = subprocess.Popen([sys.executable, str(CODE / SCRIPT), "--json", str(out)], text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=launcher_env({"PYTHONPATH": str(CODE)}))
    yield proc, out
    if proc.poll() is None:  # a test failed before waiting for it
        proc.kill()
        proc.communicate()


@pytest.fixture(scope="module")
def run(started):
    proc, out = started
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stdout + stderr
    return json.loads(out.read_text()), stdout




@pytest.mark.parametrize("args, message", [
    (["--workers", "0"], "--workers must be at least 1"),
    (["--taus", "1,4"], "including 0"),
    (["--taus", "0,-1"], "non-negative"),
    (["--taus", "0,x"], "comma-separated integers"),
    (["--lrs", "0"], "must be positive"),
])
def test_bad_input_one_line_error(monkeypatch, capsys, args, message):
    """Runs while the script does (see the module's docstring)."""
    status, _, err = run_in_process(monkeypatch, capsys, SCRIPT, *args)
    assert status == 2 and message in err.strip().splitlines()[-1]


def test_hogwild_and_synchronous_both_learn(run):
    res, out = run
    part1, start = res["part1"], math.log(10)
    for name in ("hogwild", "synchronous", "serial"):
        losses = part1[name]["heldout_loss"]
        assert losses[-1] < min(0.5, losses[0] / 4), name  # "well below": by more than 4x
        assert part1[name]["samples"][-1] == res["workers"] * res["steps"] * res["batch"]
    # The same initial weights; Hogwild's first point is read while the other worker may
    # already be writing (its samples need not be 0), so only the others start exactly there.
    for name in ("synchronous", "serial"):
        assert part1[name]["samples"][0] == 0 and abs(part1[name]["heldout_loss"][0] - start) < 0.1
    assert "held-out loss at the end < 0.5: hogwild True, synchronous True, serial True" in out


def test_hogwild_counts_every_update(run):
    res, _ = run
    hog, updates = res["part1"]["hogwild"], res["workers"] * res["steps"]
    assert res["workers"] == 2 and hog["updates"] == updates
    assert sum(hog["staleness_counts"]) == updates  # one staleness per update, each >= 0
    assert len(hog["heldout_loss"]) == res["steps"] // res["eval_every"] + 1
    assert res["part1"]["synchronous"]["updates"] * res["workers"] == updates


def test_synchronous_mean_of_gradients_is_the_big_batch_gradient(run):
    res, out = run
    assert res["part1"]["synchronous"]["max_grad_diff"] < 1e-6
    assert "concatenated batch, max diff < 1e-6: True" in out


def test_tau0_is_plain_sgd_and_a_delay_changes_the_run(run):
    res, out = run
    part2 = res["part2"]
    assert part2["tau0_is_sgd"] is True and "bit for bit: True" in out
    runs = {(r["lr"], r["tau"]): r for r in part2["runs"]}
    for lr in (0.05, 0.5):  # the check can fail: a delay of 1 step already changes every run
        assert runs[lr, 0]["loss"][0] == runs[lr, 1]["loss"][0]  # same start
        assert runs[lr, 0]["loss"] != runs[lr, 1]["loss"]


def test_staleness_costs_only_at_a_large_learning_rate(run):
    res, _ = run
    runs = {(r["lr"], r["tau"]): r for r in res["part2"]["runs"]}
    assert sorted(runs) == [(lr, tau) for lr in (0.05, 0.5) for tau in (0, 1, 4, 16)]
    for tau in (0, 1, 4, 16):  # small lr: every delay learns
        assert runs[0.05, tau]["learned"] and not runs[0.05, tau]["diverged"]
    for tau in (0, 1, 4):
        assert runs[0.5, tau]["learned"]
    fresh, stale = runs[0.5, 0]["loss"], runs[0.5, 16]["loss"]
    assert fresh[-1] < 0.5 and stale[-1] > 10 * math.log(10) > 40 * fresh[-1]
    assert runs[0.5, 16]["diverged"] and len(stale) < len(fresh)  # it stopped where it blew up


def test_quadratic_stable_learning_rate_shrinks_like_one_over_tau(run):
    res, out = run
    quad = {q["tau"]: q for q in res["part2"]["quadratic"]}
    assert [round(quad[t]["bound"], 3) for t in (0, 1, 4, 16)] == [2.0, 1.0, 0.347, 0.095]
    assert all(q["converges_at_0.9"] and q["diverges_at_1.1"] for q in quad.values())
    assert out.count("True") == 5 + 1 + 8 + 2 * 4 and out.count("False") == 8

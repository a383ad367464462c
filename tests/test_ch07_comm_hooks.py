"""Chapter 07's DDP communication hooks: the bytes each hook puts on the wire (counted by the
flight recorder) equal the formulas, the 16-bit hooks send exactly half, PowerSGD far less after
its warm-up, and every hook trains about as well as plain DDP.

Budget: one launch sweeping all four hooks (~6 s on 2 idle cores), plus bad input in-process.
The formulas are written out here from the model's shapes, not taken from the script.
"""
import pytest

from conftest import run_in_process, run_json

SCRIPT = "ch07_debugging/comm_hooks.py"
# The script's MLP 64-256-256-4: weights out x in, then biases
PSI = 256 * 64 + 256 + 256 * 256 + 256 + 4 * 256 + 4
# PowerSGD, rank 2: the two big weights send (n + m) * 2 numbers; the 4 x 256 head would send
# (4 + 256) * 2 = 520 > 1024 / 2 (min_compression_rate 2) and goes uncompressed, as do biases.
POWERSGD = (256 + 64) * 2 + (256 + 256) * 2 + 4 * 256 + 256 + 256 + 4
START = 10  # the script's default start_powerSGD_iter


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return run_json(tmp_path_factory.mktemp("comm_hooks"), 2, SCRIPT)


def test_bytes_on_the_wire_equal_the_formulas(run):
    res, out = run
    r = res["results"]
    assert res["psi"] == PSI and res["steps"] > START
    assert set(r) == {"none", "fp16", "bf16", "powersgd"}
    assert r["none"]["bytes_per_step"] == [4 * PSI] * res["steps"]  # fp32 gradients, every step
    for half in ("fp16", "bf16"):
        assert r[half]["bytes_per_step"] == [2 * PSI] * res["steps"]  # exactly half
    sgd = r["powersgd"]["bytes_per_step"]
    assert sgd[:START] == [4 * PSI] * START  # warm-up: plain all-reduce
    assert sgd[START:] == [4 * POWERSGD] * (res["steps"] - START)
    assert 4 * POWERSGD * 20 < 4 * PSI  # "much less": more than 20x here
    for hook in r:
        assert r[hook]["equal"] is True, hook
        per_step = r[hook]["all_reduces_per_step"]
        # PowerSGD: uncompressed tensors, then P, then Q (one bucket)
        assert per_step == ([1] * START + [3] * (res["steps"] - START) if hook == "powersgd"
                            else [1] * res["steps"]), hook
    assert f"powersgd            3 {4 * POWERSGD:>10} {4 * POWERSGD:>8}   True" in out
    assert f"fp16                1 {2 * PSI:>10} {2 * PSI:>8}   True         2.0" in out


def test_every_hook_trains_like_plain_ddp(run):
    res, out = run
    r = res["results"]
    for hook in r:
        loss = r[hook]["loss"]
        assert len(loss) == res["steps"] + 1
        assert loss[0] == r["none"]["loss"][0]  # same initial weights for every hook
        assert loss[-1] < loss[0] / 2, hook
        assert r[hook]["replicas_identical"] is True, hook

    def gap(hook):
        return max(abs(a - b) for a, b in zip(r[hook]["loss"], r["none"]["loss"]))
    assert gap("fp16") < 0.01 and gap("bf16") < 0.01
    assert 0.01 < gap("powersgd") < 0.1  # PowerSGD lags a little after its warm-up
    assert r["powersgd"]["loss"][:START + 1] == r["none"]["loss"][:START + 1]  # warm-up = none
    assert "powersgd               True      False      True               True" in out


def test_unknown_hook_is_one_line(monkeypatch, capsys):
    status, _, err = run_in_process(monkeypatch, capsys, SCRIPT, "--hooks", "none,int8")
    assert status == 2
    assert "unknown --hooks int8; choose from none, fp16, bf16, powersgd" in \
        err.strip().splitlines()[-1]

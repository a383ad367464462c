"""Chapter 03's scripts (started): the FSDP2 simulation on fake ranks against distkit.memory."""
import json

import pytest

from conftest import ROOT, run_in_process, run_scripts_at_once
from distkit.memory import FP32_ADAMW, model_state_bytes

SIM = "ch03_zero/simulate_fsdp.py"
SWEEP = ROOT / "code" / "ch03_zero" / "results" / "simulate_fsdp.json"


@pytest.mark.parametrize("args, message", [
    (["--models", "7b"], "unknown model(s) 7b"),
    (["--ranks", "8,x"], "comma-separated integers"),
    (["--ranks", "0"], "--ranks >= 1"),
])
def test_bad_input_one_line_error(monkeypatch, capsys, args, message):
    status, _, err = run_in_process(monkeypatch, capsys, SIM, *args)
    assert status == 2 and message in err.strip().splitlines()[-1]


def check_against_the_model(r):
    """FSDP2's model states after the AdamW step = the ZeRO-3 formula with fp32 AdamW, to the
    byte, except AdamW's step counters (one 4-byte float per parameter tensor)."""
    want = model_state_bytes(r["num_params"], r["ranks"], 3, FP32_ADAMW)
    got = r["after_step"]
    assert got["Sharded Param"] == want["params"]
    assert got["Sharded Grad"] == want["grads"]
    assert 0 <= got["OptState"] - want["optimizer"] < 4 * 1000  # a few hundred step counters


def test_one_point_of_the_committed_sweep_reruns_to_the_same_bytes(tmp_path):
    out = tmp_path / "sim.json"
    status, _, err = run_scripts_at_once({"sim": (SIM, ["--models", "1b", "--ranks", "8",
                                                        "--json", out], {})})["sim"]
    assert status == 0, err
    (fresh,) = json.loads(out.read_text())["results"]
    check_against_the_model(fresh)
    committed = next(r for r in json.loads(SWEEP.read_text())["results"]
                     if (r["model"], r["ranks"]) == ("1b", 8))
    assert fresh["after_step"] == committed["after_step"]
    assert fresh["peak"] == committed["peak"]


def test_committed_sweep_matches_the_model_everywhere():
    sweep = json.loads(SWEEP.read_text())
    assert {(r["model"], r["ranks"]) for r in sweep["results"]} == {
        (m, n) for m in ("1b", "8b", "70b") for n in (8, 16, 32, 64)}
    for r in sweep["results"]:
        check_against_the_model(r)
    assert sweep["max_rss_bytes"] < 2 * 2**30

"""Chapter 03's scripts beyond what its notebook's nbval run proves: bad input, and the FSDP2
simulation against distkit.memory.

Budget: one simulated point (~10 s) and two more at once for chapter 08's grid (~20 s of CPU);
no launch. The notebook runs zero_memory.py (every strategy
within 1% of the formulas on every rank, losses = one process, the trackers' "Temp" = DDP's
gradients, ZeRO-1's shards adding up to DDP's optimizer state: asserted or compared under nbval,
at N=3 in `make test-nproc`), activations.py and the live simulation points."""
import json
import re

import pytest

from conftest import ROOT, run_in_process, run_papermill, run_scripts_at_once
from distkit.memory import FP32_ADAMW, LLAMA_CONFIGS, llama_training_bytes, model_state_bytes

SIM = "ch03_zero/simulate_fsdp.py"
RESULTS = ROOT / "code" / "ch03_zero" / "results"
SWEEP, SWEEP_CKPT = RESULTS / "simulate_fsdp.json", RESULTS / "simulate_fsdp_checkpoint.json"
GRID = RESULTS / "simulate_grid.json"  # chapter 08: precision x checkpointing
CATEGORIES = ["params at rest", "params in use", "grads", "optimizer"]


@pytest.mark.parametrize("script, args, message", [
    (SIM, ["--models", "7b"], "unknown model(s) 7b"),
    (SIM, ["--ranks", "8,x"], "comma-separated integers"),
    (SIM, ["--ranks", "0"], "--ranks >= 1"),
    (SIM, ["--points", "8b8"], "--points: expected model:ranks pairs"),
    (SIM, ["--points", "8b:8", "--tp", "3"], "--tp 3: every rank count must be a multiple"),
    (SIM, ["--ac", "some"], "invalid choice: 'some'"),
    ("ch03_zero/zero_memory.py", ["--strategies", "ddp,zero2"], "unknown strategy zero2"),
    ("ch03_zero/zero_memory.py", ["--hidden", "30"], "--hidden a multiple of 4"),
    ("ch03_zero/activations.py", ["--hidden", "30", "--heads", "4"], "a multiple of --heads"),
    ("ch03_zero/activations.py", ["--heads", "4", "--kv-heads", "3"], "a multiple of --kv-heads"),
])
def test_bad_input_one_line_error(monkeypatch, capsys, script, args, message):
    status, _, err = run_in_process(monkeypatch, capsys, script, *args)
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


@pytest.mark.parametrize("path", [SWEEP, SWEEP_CKPT])
def test_committed_sweep_matches_the_model_everywhere(path):
    sweep = json.loads(path.read_text())
    assert {(r["model"], r["ranks"]) for r in sweep["results"]} == {
        (m, n) for m in ("1b", "8b", "70b") for n in (8, 16, 32, 64)}
    for r in sweep["results"]:
        check_against_the_model(r)
    assert sweep["max_rss_bytes"] < 2 * 2**30
    assert ("--checkpoint" in sweep["command"]) == (path == SWEEP_CKPT)


def test_checkpointing_cuts_the_simulated_activations_and_the_peak_holds_the_optimizer_state():
    """The measured step is the second: AdamW's state exists through its forward and backward."""
    plain, ckpt = (json.loads(p.read_text())["results"] for p in (SWEEP, SWEEP_CKPT))
    for a, b in zip(plain, ckpt):
        assert (a["model"], a["ranks"]) == (b["model"], b["ranks"])
        assert b["peak"]["Activation"] < a["peak"]["Activation"] / 4
        assert b["peak"]["Total"] < a["peak"]["Total"]
        for r in (a, b):
            assert r["peak"]["OptState"] >= r["after_step"]["OptState"] > 0


@pytest.mark.second_nproc
def test_notebook_at_three_processes(tmp_path):
    """N = 3 divides no dimension of the tiny Llama: FSDP2 pads, ZeRO-1's split is uneven, and
    the notebook says so instead of asserting the 1%; the exercise pads its flat vector. And the
    stored 70B point that nbval only reads is simulated again here: the notebook asserts its
    live peak and model states equal the stored ones (about a minute of CPU)."""
    text = run_papermill(tmp_path, "03_zero_memory_math.ipynb", "-p", "NPROC", "3",
                         "-p", "SIM_POINTS", "70b:64")
    assert "every parameter's first dimension divides by N = 3: False" in text
    assert "max |loss - reference| < 1e-05: True" in text
    assert "|loss - reference| < 1e-05: False" not in text
    assert "gradient gap < 1e-05: True (1.00x)" in text and "gap < 1e-05: False" not in text
    assert "fsdp2-bf16  max |loss - reference| < 0.01: True" in text
    assert "same bytes as the stored sweep: True" in text
    assert re.search(r"70b on 64 [ .0-9]+ live\\n", text), "70B not simulated live"  # JSON text


# --- chapter 08: the Llama-exact calculator against every committed simulation ---------------

def calculator_for(r):
    tp = r.get("tp", 1)  # --tp: a (ranks / tp) x tp mesh, FSDP over the first dimension
    return llama_training_bytes(LLAMA_CONFIGS[r["model"]], ranks=r["ranks"] // tp, seq=r["seq"],
                                batch=r["batch"], precision=r.get("precision", "fp32"),
                                tensor_parallel=tp,
                                attn=r.get("attn", "sdpa"),
                                ac=r.get("ac", "full" if r["checkpoint"] else "none"))


def check_calculator_against(r):
    """The peak within 10 %, and so each of its categories; a category of a few bytes (the rotary
    buffers' 256, a scalar's 8) within 1 % of the peak instead."""
    want, got = calculator_for(r), r["peak"]
    assert abs(want["Total"] - got["Total"]) <= 0.10 * got["Total"], (r["command"], want["moment"])
    for category, value in got.items():
        error = abs(want.get(category, 0) - value)
        assert error <= max(0.10 * value, 0.01 * got["Total"]), (r["command"], category, value,
                                                                 want.get(category), want["moment"])


@pytest.mark.parametrize("path", [SWEEP, SWEEP_CKPT, GRID])
def test_calculator_within_10_percent_of_every_committed_simulation(path):
    sweep = json.loads(path.read_text())
    for r in sweep["results"]:
        r.setdefault("command", sweep["command"])
        check_calculator_against(r)


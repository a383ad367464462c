"""Chapter 07, out of memory: real allocation failures under a cap, in the phase the lesson says,
and chapter 03's calculator agreeing with every run (ch07_debugging/oom.py)."""
import json
import subprocess
import sys

import pytest
from conftest import CODE, launcher_env, run_in_process

from distkit.memory import FP32_ADAMW

SCRIPT = "ch07_debugging/oom.py"


@pytest.mark.skipif(sys.platform != "linux", reason="the CPU cap (RLIMIT_AS) is Linux's")
def test_oom_fails_where_the_calculator_says_and_its_fix_runs(tmp_path, monkeypatch, capsys):
    out = tmp_path / "oom.json"
    # the run (a process of its own) and the bad-input check (here) at once, on the two cores
    proc = subprocess.Popen([sys.executable, str(CODE / SCRIPT), "--json", str(out)], text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=launcher_env({"PYTHONPATH": str(CODE)}))
    # (env: the script sets PYTORCH_CUDA_ALLOC_CONF if unset; monkeypatch restores it after)
    code, _, err = run_in_process(monkeypatch, capsys, SCRIPT, "--budget-mib", "0",
                                  env={"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"})
    assert code == 2 and err.strip().splitlines()[-1].startswith("oom.py: error: --budget-mib")
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stdout + stderr

    result = json.loads(out.read_text())
    runs = {r["label"]: r for r in result["runs"]}
    assert sorted(runs) == ["A1", "A2", "A3", "B1"]
    budget = result["budget_bytes"]
    assert budget == 40 * 2**20

    # A1: the activations of 32 sequences do not fit; the first forward is where it fails
    a1 = runs["A1"]
    assert not a1["ran"] and (a1["step"], a1["phase"]) == (1, "forward")
    assert "DefaultCPUAllocator: can't allocate memory" in a1["error"], a1["error"]
    assert "Error code 12" in a1["error"] and a1["tried_bytes"] > 0
    # B1: forward and backward of step 1 fit; AdamW's first step allocates 8 bytes/param more
    b1 = runs["B1"]
    assert not b1["ran"] and (b1["step"], b1["phase"]) == (1, "optimizer.step")
    assert "can't allocate memory" in b1["error"]
    # the fixes the calculator chose run under the same cap, for both steps
    a2, a3 = runs["A2"], runs["A3"]
    assert a2["ran"] and a3["ran"]
    assert a2["config"]["micro_batch"] == result["micro_batch_case_a"] == 8
    assert a2["config"]["batch"] == a1["config"]["batch"] == 32  # accumulation keeps the batch
    assert a3["config"]["checkpoint"] and a3["config"]["micro_batch"] == 32
    assert all(r["cap"] == "RLIMIT_AS" for r in runs.values())

    # the calculator: it said which would fit, and it was right for every run
    for r in runs.values():
        assert r["calculator"]["fits"] == r["ran"], r["label"]
        assert r["calculator"]["fits"] == (r["calculator"]["total"] <= 0.8 * budget)
    assert result["agree"] and "the calculator's 'fits' matched every run: True" in stdout
    # its bytes: 16 per parameter (fp32 AdamW) and Korthikanti's 34 s b h per layer (16-bit
    # values, x 2 in fp32; no s x s scores with SDPA), as chapter 03 wrote them
    s, b, h, layers, psi = 128, 32, 64, 4, 216_448
    assert FP32_ADAMW.total == 16
    assert a1["calculator"]["states"] == 16 * psi
    assert a1["calculator"]["activations"] == 2 * 34 * s * b * h * layers
    assert a2["calculator"]["activations"] == 2 * 34 * s * 8 * h * layers
    # checkpointing: each layer keeps its input (2 s b h) plus one layer recomputed in backward
    assert a3["calculator"]["activations"] == 2 * (2 * s * b * h * layers + 34 * s * b * h)
    # B's states dominate: FSDP/ZeRO-3 (16 Psi / N) fits from 4 ranks on
    assert result["fsdp_ranks_case_b"] == 4
    assert "step 1's forward and backward ran" in stdout
    assert "ran: False, out of memory in step 1 forward" in stdout

"""Chapter 01 beyond what its notebook's nbval run proves: bad input, and the whole notebook at
another world size (NPROC=3: uneven sampler padding, and resume made exact at N > 2)."""
import json
import re
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from conftest import CODE, ROOT, launcher_env, run_ok, run_scripts_at_once
from distkit.dist import grad_check

BAD_INPUT = [  # script, args, extra env, what the one-line error must say
    ("train_single.py", ["--batch-size", "0"], {}, "--batch-size"),
    ("train_ddp.py", ["--samples", "3", "--batch-size", "4"], {"WORLD_SIZE": "2"},
     "--samples >= 2 processes x --batch-size"),
    ("train_ddp_plus.py", ["--accum", "0"], {}, "--accum >= 1"),
    ("train_ddp_plus.py", ["--resume", "/nonexistent.pt"], {}, "no such checkpoint"),
    ("ddp_buckets.py", ["--caps", "25,x"], {}, "--caps wants numbers"),
    ("ddp_memory.py", ["--hidden", "6"], {}, "multiple of 4"),
    ("ddp_pitfalls.py", ["--case", "bogus"], {}, "unknown --case bogus"),
    ("ddp_pitfalls.py", ["--case", "join,no-join"], {}, "--case no-join fails on purpose"),
]


def test_bad_input_one_line_error():
    """Argument checks run before setup(), so plain python shows them (all at once: faster)."""
    runs = run_scripts_at_once({i: (f"ch01_ddp/{script}", args, env)
                                for i, (script, args, env, _) in enumerate(BAD_INPUT)})
    for (returncode, _, err), (script, args, _, message) in zip(runs.values(), BAD_INPUT):
        assert returncode == 2, (script, args, err)
        assert message in err.strip().splitlines()[-1], (script, args, err)


def test_help_is_whole_sentences():
    for script in sorted((CODE / "ch01_ddp").glob("*.py")):
        first = script.read_text().split('"""')[1].split("\n\n")[0]  # what --help shows
        assert first.rstrip().endswith((".", ":")), f"{script.name}: --help shows {first!r}"


def test_accumulation_step1_gradients_equal_one_process(tmp_path):
    """train_ddp_plus.py (2 ranks x 4 micro-batches of 2) against train_single.py (batch 16), one
    step each: the step-1 gradients, not only the loss. AdamW hides a constant factor on the
    gradient, so an accumulation without `/ args.accum` (4x gradients) passes every loss check;
    this one fails on it, naming the factor (planted once: "scale 4.00")."""
    data = ["--samples", 16, "--epochs", 1]
    single = subprocess.Popen(
        [sys.executable, str(CODE / "ch01_ddp/train_single.py"), "--batch-size", "16",
         *map(str, data), "--json", str(tmp_path / "single.json")],
        env=launcher_env({"PYTHONPATH": str(CODE)}), stdout=subprocess.PIPE, text=True)
    run_ok(2, "ch01_ddp/train_ddp_plus.py", "--batch-size", 2, "--accum", 4, *data,
           "--json", tmp_path / "accum.json")
    assert single.wait(timeout=120) == 0
    one, accum = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("single", "accum"))
    assert len(accum["losses"]) == len(one["losses"]) == 1
    assert abs(accum["losses"][0] - one["losses"][0]) < 1e-4
    check = grad_check(accum["grad_norms"], one["grad_norms"])
    assert len(one["grad_norms"]) == 21 and check["gap"] < 1e-5, \
        f"step-1 gradients {check['scale']:.2f}x one process's (gap {check['gap']:.1e})"


@pytest.mark.parametrize("batch, message", [(10, "BATCH=10 must divide")])
def test_notebook_rejects_bad_parameters(tmp_path, batch, message):
    proc = subprocess.run([sys.executable, "-m", "papermill",
                           "notebooks/01_data_parallel_ddp.ipynb",
                           str(tmp_path / "out.ipynb"), "-p", "BATCH", str(batch)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and message in proc.stderr + proc.stdout


@pytest.mark.second_nproc
def test_notebook_at_three_processes(tmp_path):
    """docs/parameters.md's plain papermill command, run from notebooks/ without PYTHONPATH (the
    ch00
    test runs from the repo root), at NPROC=3 (BATCH must then be 24): the parity asserts, and
    the resume cell, which at N > 2 pins the buckets and must then be bit-exact too."""
    out = tmp_path / "out.ipynb"
    papermill = Path(sys.executable).parent / "papermill"
    proc = subprocess.run([str(papermill), "01_data_parallel_ddp.ipynb", str(out),
                           "-p", "NPROC", "3", "-p", "BATCH", "24", "--no-progress-bar"],
                          cwd=ROOT / "notebooks", capture_output=True, text=True, timeout=900,
                          env=launcher_env({"PYTHONPATH": None}))
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = json.dumps(nbformat.read(out, as_version=4).cells)
    assert "N=3: resumed run == uninterrupted run, every step, bit for bit: True" in text
    assert re.search(r"N=3, batch 8 per rank: \d+ steps, max \|loss diff\| < 0.0001: True", text)

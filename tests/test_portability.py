"""Green on every CPU by construction: the suite runs this CPU's own kernels, and every compared
output is portable by the rule in CONTRIBUTING.md ("Adding a compared cell"), which
distkit.course.portable checks on the stored notebooks.

Before 2026-11-29 the suite emulated a lesser CPU (ATEN_CPU_CAPABILITY=default, MKL and oneDNN
capped). On Xeons with AMX and AVX512-FP16 that configuration, which no learner runs, failed
twice: torch's bf16 CPU flash attention called an AMX packing stub the scalar build lacks
(pack_vnni2), then the float8 GEMM (`torch._scaled_mm`), which torch sends to oneDNN on such a
CPU, had no kernel under the oneDNN cap. The last two tests run both ops with this machine's own
kernels, as a learner's notebook does.
"""
import os

import nbformat
import pytest
import torch

from conftest import ROOT, write_notebook
from distkit.course.portable import check, noisy_floats

NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))


def test_suite_runs_this_cpus_own_kernels():
    """No library is capped by the suite (a learner's notebook runs uncapped)."""
    conftest = (ROOT / "tests" / "conftest.py").read_text()
    for knob in ("ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA"):
        assert f'"{knob}":' not in conftest and f"environ[\"{knob}\"]" not in conftest, knob


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.name[:2])
def test_every_compared_float_is_rounded_above_its_noise(notebook):
    assert check(notebook) == []


def test_a_planted_unrounded_float_fails(tmp_path):
    """The rule, on a notebook with one compared cell of each kind: the noisy ones are named, the
    portable ones (bounds, settings, rounded values, constants, ignored cells) pass."""
    nb = write_notebook(tmp_path / "planted.ipynb",
                        "print('loss 3.1972846')", "print('max |grad diff| 5.2e-07')",
                        "print('max |grad diff| < 1e-05: True; lr=1e-3; loss 3.197')",
                        "print('bf16 max 3.38953e+38, eps 0.0078125')",
                        "print('loss 3.1972846')")
    cells = nbformat.read(nb, as_version=4)
    for i, cell in enumerate(cells.cells):  # stored outputs, as a recording leaves them
        text = eval(cell.source[len("print("):-1])  # noqa: S307 (our own literal strings)
        cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text=text + "\n")]
        cell.execution_count = i + 1
    cells.cells[4].metadata["tags"] = ["nbval-ignore-output"]
    nbformat.write(cells, nb)
    assert [line.split(":")[0] for line in check(nb)] == ["planted.ipynb cell 0",
                                                          "planted.ipynb cell 1"]
    assert noisy_floats("0.0012345678 and 1.2e-6") == ["0.0012345678", "1.2e-6"]
    assert noisy_floats("1000000000000.0 tokens, 0.5000 exactly") == []  # zeros are exact


def test_bf16_flash_attention_runs_on_this_cpu():
    """The op that failed under the old emulation, forward and backward, at sizes where torch's
    bf16 kernel packs (FlashAttentionKernel.cpp: queries and keys >= 64)."""
    import torch.nn.functional as F
    q = torch.randn(2, 8, 256, 64, dtype=torch.bfloat16, requires_grad=True)
    F.scaled_dot_product_attention(q, q, q, is_causal=True).float().pow(2).mean().backward()
    assert q.grad.isfinite().all()


def test_float8_gemm_runs_on_this_cpu():
    """Chapter 10's float8 GEMM (tensor-wise scales) with this CPU's kernels: the call that had no
    oneDNN kernel under the old cap on an AVX512-FP16 Xeon; equal to the bf16-free reference
    within float8's rounding."""
    if os.environ.get("ONEDNN_MAX_CPU_ISA"):
        pytest.skip("ONEDNN_MAX_CPU_ISA is set in this environment: not this CPU's own kernels")
    a = torch.randn(64, 256)
    b = torch.randn(128, 256)
    sa, sb = a.abs().max() / 448, b.abs().max() / 448
    a8, b8 = (a / sa).to(torch.float8_e4m3fn), (b / sb).to(torch.float8_e4m3fn)
    out = torch._scaled_mm(a8, b8.t(), scale_a=sa, scale_b=sb, out_dtype=torch.float32)
    ref = (a8.float() * sa) @ (b8.float() * sb).t()
    assert torch.allclose(out, ref, rtol=1e-3, atol=1e-3)

"""The portability check (conftest.PORTABILITY_ENV) imitates a lesser CPU for every library torch
uses, and never trips torch's own CPU-kind checks: `make test` stays green on AMX CPUs.

A 2-core Xeon with AMX was red here: ATen ran its default (scalar) kernels while oneDNN still
reported AMX, so the bf16 CPU flash attention packed blocks for AMX (torch's
aten/src/ATen/native/CPUBlas.cpp: `could_pack` is oneDNN's effective ISA >= avx512_core_amx)
and called `pack_vnni2`, a stub in the default build ("pack_vnni2 is only supported when avx512
is supported"). This machine may have no AMX, so the failure itself cannot be reproduced
everywhere: the tests check the cause (oneDNN obeys the cap, and the cap is below AMX) and run
the op that failed (bf16 flash attention, forward and backward, at sizes that pack).
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import PORTABILITY_ENV

# oneDNN's ISA names (ONEDNN_MAX_CPU_ISA), lowest first; AMX starts at AVX512_CORE_AMX
BELOW_AMX = ["SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE",
             "AVX512_CORE_VNNI", "AVX512_CORE_BF16", "AVX512_CORE_FP16"]

BF16_MATMUL = "import torch; x = torch.randn(64, 64, dtype=torch.bfloat16); x @ x"


def _run(code: str, env: dict) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k not in PORTABILITY_ENV}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**base, **env}, timeout=120)


def _isa_line(env: dict) -> str:
    out = _run(BF16_MATMUL, {**env, "ONEDNN_VERBOSE": "1"}).stdout
    return next((ln for ln in out.splitlines() if ",isa:" in ln), "")


def test_portability_env_caps_onednn_below_amx():
    assert PORTABILITY_ENV.get("ONEDNN_MAX_CPU_ISA") in BELOW_AMX, (
        "conftest.PORTABILITY_ENV must cap oneDNN below AMX (ONEDNN_MAX_CPU_ISA), or torch's "
        "bf16 CPU flash attention calls AMX code that ATEN_CPU_CAPABILITY=default lacks")


@pytest.mark.skipif(sys.platform != "linux" or "avx512f" not in Path("/proc/cpuinfo").read_text(),
                    reason="needs an x86 CPU with AVX-512 to see oneDNN lower its ISA")
def test_onednn_obeys_the_isa_cap():
    """This torch's oneDNN reads ONEDNN_MAX_CPU_ISA: capped, it reports a lower ISA (or, capped
    below what bf16 needs, is not used at all), and never AMX."""
    native = _isa_line({})
    assert native, "oneDNN printed no ISA line for a bf16 matmul (ONEDNN_VERBOSE=1)"
    capped = _isa_line({"ONEDNN_MAX_CPU_ISA": "AVX512_CORE"})
    assert capped and capped != native or "bfloat16" not in native, (native, capped)
    portable = _isa_line(PORTABILITY_ENV)
    assert "AMX" not in portable, portable


def test_bf16_flash_attention_runs_under_the_portability_env():
    """The op that failed on AMX, forward and backward, with the suite's environment, at sizes
    where torch's bf16 kernel packs (FlashAttentionKernel.cpp, cpu_flash_attention's need_pack:
    queries and keys >= 64, and each thread's matmul work >= 4x the packing: here 4 ceil(64/T)
    for T threads, so at any thread count)."""
    code = ("import torch, torch.nn.functional as F\n"
            "q = torch.randn(2, 8, 256, 64, dtype=torch.bfloat16, requires_grad=True)\n"
            "F.scaled_dot_product_attention(q, q, q, is_causal=True).float().pow(2).mean()"
            ".backward()\n"
            "print('ok', q.grad.isfinite().all().item())")
    proc = _run(code, PORTABILITY_ENV)
    assert proc.returncode == 0 and "ok True" in proc.stdout, proc.stderr[-2000:]

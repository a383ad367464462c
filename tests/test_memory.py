"""distkit.memory: the ZeRO paper's numbers, and the formulas' internal consistency."""
import pytest

from distkit.memory import (FP32_ADAMW, GB, MIXED_ADAMW, activation_bytes_per_layer,
                            communication_bytes, model_state_bytes)

PSI, N = 7.5e9, 64  # ZeRO paper, Figure 1: a 7.5B-parameter model on 64 GPUs, K = 12


@pytest.mark.parametrize("stage, total_gb", [(0, 120), (1, 31.4), (2, 16.6), (3, 1.88)])
def test_zero_paper_figure_1(stage, total_gb):
    total = model_state_bytes(PSI, N, stage)["total"] / GB
    assert round(total, 2 if total < 10 else 1) == total_gb


def test_bytes_per_parameter():
    assert MIXED_ADAMW.total == 16 == FP32_ADAMW.total
    ddp = model_state_bytes(1000, 8, 0, FP32_ADAMW)
    assert ddp == {"params": 4000, "grads": 4000, "optimizer": 8000, "total": 16000}
    zero3 = model_state_bytes(1000, 8, 3, FP32_ADAMW)
    assert zero3["total"] == 2000
    with pytest.raises(ValueError):
        model_state_bytes(1000, 8, 4)


def test_communication_zero3_is_one_and_a_half_ddp():
    ddp, z1, z2, z3 = (communication_bytes(PSI, N, s) for s in range(4))
    assert ddp == z1 == z2 == pytest.approx(2 * 63 / 64 * PSI * 2)
    assert z3 == pytest.approx(1.5 * ddp)


def test_activation_formulas_agree_with_each_other():
    s, b, h, a = 2048, 1, 12288, 96  # GPT-3 175B's layer shape
    plain = activation_bytes_per_layer(s, b, h, a)
    assert plain == s * b * h * (34 + 5 * a * s / h)
    # one tensor-parallel rank, with or without sequence parallelism, is no parallelism
    assert activation_bytes_per_layer(s, b, h, a, tensor_parallel=1, sequence_parallel=True) == plain
    # sequence parallelism divides everything by t
    sp = activation_bytes_per_layer(s, b, h, a, tensor_parallel=8, sequence_parallel=True)
    assert sp == pytest.approx(plain / 8)
    # selective recomputation drops the attention-score term; full keeps only the input
    assert activation_bytes_per_layer(s, b, h, a, recompute="selective") == s * b * h * 34
    assert activation_bytes_per_layer(s, b, h, a, recompute="full") == 2 * s * b * h
    with pytest.raises(ValueError):
        activation_bytes_per_layer(s, b, h, a, recompute="some")

"""Unit tests of chapter 10's lesson layer: distkit.fp8 (casts, scales, scaled matmuls, the
float8 linear, the all-gather bytes), distkit.schedules (action lists, the ideal timeline,
bubbles, in-flight micro-batches) and distkit.plan3d (mesh coordinates, torchtitan's names, the
planner against chapter 08's). One process, no launch."""
import math
from fractions import Fraction

import pytest
import torch

from distkit import fp8, schedules
from distkit.memory import LLAMA_CONFIGS, communication_bytes, llama_parts
from distkit.plan3d import CONFIG_NAMES, MESH_ORDER, Composed, float8_flops, memory, step_time


# --- distkit.fp8 --------------------------------------------------------------------------------

def test_casts_saturate_in_e4m3_and_overflow_in_e5m2():
    x = torch.tensor([500.0, 1e5, float("inf"), 1e-4])
    assert x.to(fp8.E4M3).float().tolist() == [448.0, 448.0, 448.0, 0.0]
    assert x.to(fp8.E5M2).float().tolist()[:3] == [512.0, math.inf, math.inf]
    # to_float8 clamps first: a given (stale) scale never makes inf, even in e5m2
    x8, _ = fp8.to_float8(torch.tensor([1e6, -1e6]), fp8.E5M2, scale=torch.tensor(1.0))
    assert x8.float().tolist() == [57344.0, -57344.0]


def test_scale_maps_amax_onto_the_largest_value():
    x = torch.tensor([[1.0, -8.0], [0.5, 2.0]])
    assert fp8.scale_for(x).item() == pytest.approx(448 / 8)
    assert fp8.scale_for(x, dim=1).flatten().tolist() == pytest.approx([56.0, 224.0])
    assert fp8.scale_for(x, dim=1, power_of_2=True).flatten().tolist() == [32.0, 128.0]
    x8, s = fp8.to_float8(x)
    assert x8.float().abs().max().item() == 448.0 and torch.equal(fp8.from_float8(x8, s), x)
    assert math.isfinite(fp8.scale_for(torch.zeros(3)).item())  # EPS under amax


def test_emulated_scaled_mm_is_torchs():
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(32, 64, generator=g), torch.randn(64, 48, generator=g)
    for recipe, tol in (("tensorwise", 1e-6), ("rowwise", 1e-6)):  # CPU: fp32 out for both
        mine = fp8.float8_mm(a, b, recipe=recipe)
        theirs = fp8.float8_mm(a, b, recipe=recipe, kernel="torch")
        assert fp8.relative_error(theirs, mine) < tol
        assert fp8.relative_error(mine, a @ b) < 0.06  # float8's own error, a few %


def _reference_float8_product(a, b, a_dtype, b_dtype, rowwise=False):
    """a @ b with each operand quantised on its own, written from the recipe's definition and
    not with distkit.fp8: scale = (its OWN format's max) / amax, in float64 then float32, per
    tensor, or per row of a and per column of b rounded down to a power of 2 (rowwise); scale,
    clamp, cast, back to float32, divide; an fp32 matmul."""
    def quantised(t, dtype, dim):
        top = torch.finfo(dtype).max
        amax = t.abs().amax() if dim is None else t.abs().amax(dim=dim, keepdim=True)
        scale = (top / amax.double()).float()
        if rowwise:
            scale = 2.0 ** torch.floor(torch.log2(scale))
        return (t * scale).clamp(-top, top).to(dtype).float() / scale
    return quantised(a, a_dtype, 1 if rowwise else None) @ \
        quantised(b, b_dtype, 0 if rowwise else None)


@pytest.mark.parametrize("recipe", fp8.RECIPES)
def test_float8_linears_three_matmuls_take_float8_operands(recipe):
    """Given the output's gradient, the output and the input and weight gradients are exactly
    the float8 products of the recipe (tensorwise: e5m2 gradients; rowwise: e4m3 everywhere;
    weights and inputs e4m3), against a reference written here from the definition (comparing
    with fp8.float8_mm would carry a bug of float8_mm, e.g. the wrong format's max for b)."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 32, bias=False)
    fp8.convert_to_float8(torch.nn.Sequential(lin), recipe=recipe)
    x = torch.randn(16, 64, requires_grad=True)
    gy = torch.randn(16, 32)
    y = lin(x)
    y.backward(gy)
    w, xd = lin.weight.detach(), x.detach()
    rowwise, g8 = recipe == "rowwise", fp8.E4M3 if recipe == "rowwise" else fp8.E5M2
    ref = lambda a, b, a_dtype: _reference_float8_product(a, b, a_dtype, fp8.E4M3, rowwise)
    assert torch.equal(y.detach(), ref(xd, w.t(), fp8.E4M3))
    assert torch.equal(x.grad, ref(gy, w, g8))
    assert torch.equal(lin.weight.grad, ref(gy.t(), xd, g8))
    assert not torch.allclose(x.grad, gy @ w, rtol=1e-3, atol=1e-3)


def test_float8_linear_gradients_follow_fp32():
    torch.manual_seed(0)
    ref = torch.nn.Linear(64, 32)
    f8 = torch.nn.Linear(64, 32)
    f8.load_state_dict(ref.state_dict())
    assert fp8.convert_to_float8(torch.nn.Sequential(f8), recipe="tensorwise") == ["0"]
    x = torch.randn(16, 64, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    target = torch.randint(0, 32, (16,))
    for model, inp in ((ref, x), (f8, x2)):
        torch.nn.functional.cross_entropy(model(inp), target).backward()
    assert isinstance(f8, fp8.Float8Linear)
    for got, want in ((f8.weight.grad, ref.weight.grad), (x2.grad, x.grad)):
        err = fp8.relative_error(got, want)
        assert 0 < err < 0.1, err  # changed by float8 (not fp32 in disguise), but close


def test_worth_float8_is_torchaos_automatic_filter():
    """torchao v0.18 _auto_filter_for_recipe, its thresholds on the weight's (out, in)."""
    rowwise = lambda o, i: fp8.worth_float8(o, i, "rowwise")
    assert rowwise(4096, 4096) and rowwise(14336, 4096) and rowwise(2048, 8192)
    assert not rowwise(1024, 4096)   # Llama 3.1 8B's k and v projections: out <= 1024
    assert not rowwise(8192, 2048)   # in <= 2048
    assert not rowwise(2048, 4096)   # in <= 4096 and out <= 2048
    assert rowwise(2064, 4096) and not rowwise(4104, 4104)  # 2064 = 129 x 16; 4104 % 16 = 8
    assert fp8.worth_float8(1024, 4096, "tensorwise")
    assert not fp8.worth_float8(4096, 1024, "tensorwise") and fp8.worth_float8(4112, 1024,
                                                                              "tensorwise")
    with pytest.raises(ValueError, match="recipe"):
        fp8.worth_float8(4096, 4096, "blockwise")


def test_convert_skips_the_head_and_refuses_unknown_recipes():
    from distkit.toy import tiny_llama
    model = tiny_llama()
    names = fp8.convert_to_float8(model)
    assert len(names) == 14 and "lm_head" not in names
    assert type(model.lm_head) is torch.nn.Linear
    with pytest.raises(ValueError, match="recipe"):
        fp8.convert_to_float8(tiny_llama(), recipe="blockwise")


def test_float8_gathers_halve_the_linear_weights_bytes():
    c, n = LLAMA_CONFIGS["8b"], 16
    bf16 = fp8.fsdp_float8_bytes(c, n, float8_gather=False)
    f8 = fp8.fsdp_float8_bytes(c, n)
    parts = llama_parts(c)
    params = c["num_hidden_layers"] * parts["layer"] + parts["root"]
    assert bf16["total"] == pytest.approx(communication_bytes(
        params, n, 3, param_bytes=2, reduce_bytes=4, gathered_once=parts["root"]))
    linear = c["num_hidden_layers"] * (parts["layer"] - 2 * c["hidden_size"])
    ring = (n - 1) / n
    assert bf16["total"] - f8["total"] == pytest.approx(2 * ring * linear * (2 - 1)
                                                        - f8["amax all-reduce"])
    assert f8["reduce-scatter fp32"] == bf16["reduce-scatter fp32"]


# --- distkit.schedules --------------------------------------------------------------------------

def counted_bubble(name, pp, m):
    lists = schedules.one_f_one_b(pp, m) if name == "1F1B" else schedules.actions(name, pp, m)
    return {Fraction(i, step) for i, step in schedules.idle(schedules.simulate(lists))}


@pytest.mark.parametrize("name", schedules.SCHEDULES)
@pytest.mark.parametrize("pp,m", [(2, 2), (2, 4), (4, 4), (4, 8), (4, 12)])
def test_counted_bubble_equals_the_formula(name, pp, m):
    if name == "DualPipeV" and m < 2 * pp:  # torch 2.13 refuses it: the formula's domain too
        with pytest.raises(ValueError):
            schedules.actions(name, pp, m)
        return
    assert counted_bubble(name, pp, m) == {schedules.bubble_formula(name, pp, m)}


def test_zbv_bubble_with_fewer_micro_batches_than_the_v_is_long():
    """ZBV's bubble is ZB-H1's (p-1) units only from m >= (3p-1)/2; below, rank 0 waits for
    micro-batch 0 to come back up the V: 2(2p-1-m) units (expert_ch10.md F8: 7/31 at p = m = 8,
    where the general formula would say 7/55)."""
    for pp in (2, 3, 4):
        for m in range(1, 2 * pp + 1):
            assert counted_bubble("ZBVZeroBubble", pp, m) == \
                {schedules.bubble_formula("ZBVZeroBubble", pp, m)}, (pp, m)
    assert counted_bubble("ZBVZeroBubble", 8, 8) == {Fraction(7, 31)} == \
        {schedules.bubble_formula("ZBVZeroBubble", 8, 8)}


def test_the_timeline_waits_for_inputs():
    # two stages, one micro-batch: F on rank 1 waits for rank 0's F; B on rank 0 for rank 1's B
    spans = schedules.simulate([[(0, "F", 0), (0, "B", 0)], [(1, "F", 0), (1, "B", 0)]])
    assert spans == [[(0, "F", 0, 0, 1), (0, "B", 0, 4, 6)], [(1, "F", 0, 1, 2), (1, "B", 0, 2, 4)]]
    assert schedules.idle(spans) == [(3, 6), (3, 6)]
    with pytest.raises(ValueError, match="needs 1F0, which no rank's list holds"):
        schedules.simulate(schedules.actions("1F1B", 2, 4))  # torch 2.13's off-by-one
    with pytest.raises(ValueError, match="wait for each other"):
        schedules.simulate([[(0, "F", 0), (0, "B", 0)], [(1, "B", 0), (1, "F", 0)]])


def test_one_f_one_b_is_the_runtime_loop_and_holds_p_minus_r():
    for pp, m in ((2, 4), (4, 8), (3, 3)):
        lists = schedules.one_f_one_b(pp, m)
        assert schedules.in_flight(lists) == [min(m, pp - r) for r in range(pp)]
        assert all(sorted(rank) == sorted([(r, k, i) for k in "FB" for i in range(m)])
                   for r, rank in enumerate(lists))
    assert schedules.one_f_one_b(2, 4)[0] == schedules.actions("1F1B", 2, 4)[0]  # rank 0 agrees


def test_placements():
    assert [schedules.stages_of("ZBVZeroBubble", r, 4) for r in range(4)] == \
        [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert schedules.stages_of("Interleaved1F1B", 1, 4) == [1, 5]
    assert schedules.stages_of("GPipe", 3, 4) == [3]


# --- distkit.plan3d -----------------------------------------------------------------------------

def test_coordinates_are_init_device_meshs_row_major_layout():
    c = Composed(pp=2, dp_replicate=1, dp_shard=2, cp=2, tp=2, microbatches=2)
    grid = torch.arange(c.gpus).reshape(*c.shape.values())
    for rank in range(c.gpus):
        assert tuple(c.coords(rank).values()) == tuple(int(i) for i in
                                                      (grid == rank).nonzero()[0])
    assert c.group(0, "tp") == (0, 1) and c.group(0, "cp") == (0, 2)
    assert c.group(0, "dp_shard") == (0, 4) and c.group(0, "pp") == (0, 8)
    assert list(c.shape) == list(MESH_ORDER)


def test_torchtitan_names():
    c = Composed(pp=8, dp_shard=8, tp=8, schedule="Interleaved1F1B", microbatches=8)
    assert c.torchtitan() == {"pipeline_parallel_degree": 8, "data_parallel_shard_degree": 8,
                              "tensor_parallel_degree": 8,
                              "pipeline_parallel_schedule": "Interleaved1F1B",
                              "num_pp_microbatches": 8}
    assert c.torchtitan(toml=True)["experimental.pipeline_parallel_degree"] == 8
    assert set(CONFIG_NAMES) == set(MESH_ORDER) | {"schedule", "microbatches"}
    with pytest.raises(ValueError, match="schedule"):
        Composed(schedule="2F2B")
    with pytest.raises(ValueError, match="micro-batches"):
        Composed(pp=4, microbatches=2)


def test_bubble_and_in_flight_of_layouts():
    one = Composed(pp=8, dp_shard=8, tp=8, microbatches=8)
    inter = Composed(pp=8, dp_shard=8, tp=8, microbatches=8, schedule="Interleaved1F1B")
    assert one.bubble() == Fraction(7, 15) and inter.bubble() == Fraction(7, 23)
    assert one.in_flight() == 8 and inter.in_flight() == 8
    assert Composed(dp_shard=8).bubble() == 0


def test_planner_is_chapter_08s_without_pipeline_or_float8():
    from distkit.speed import GPUS, LINKS, Layout
    from distkit.speed import step_time as chapter08
    c, gpu, link = LLAMA_CONFIGS["70b"], GPUS["H100 SXM"], LINKS["IB NDR / RoCE 400G"]
    mine = step_time(c, Composed(dp_shard=16, tp=8), seq=8192, local_batch=2, ac="full",
                     gpu=gpu, link=link, eta=0.4)
    theirs = chapter08(c, Layout(gpus=128, seq=8192, batch=2, tp=8, ac="full",
                                 sequence_parallel=True), gpu=gpu, link=link, eta=0.4)
    assert mine["step s"] == theirs["step s"]
    f8 = step_time(c, Composed(dp_shard=16, tp=8, float8=True), seq=8192, local_batch=2,
                   ac="full", gpu=gpu, link=link, eta=0.4)
    saved = float8_flops(c, 8192, 2, "full") / 2 / 8 / (0.4 * gpu.peak)
    assert mine["compute s"] - f8["compute s"] == pytest.approx(saved)


def test_float8_flops_skip_the_layers_the_filter_keeps_in_bf16():
    c, T = LLAMA_CONFIGS["8b"], 8192 * 2
    h, kv, L = c["hidden_size"], c["num_key_value_heads"] * 128, c["num_hidden_layers"]
    every = float8_flops(c, 8192, 2, "full")
    assert float8_flops(c, 8192, 2, "full", recipe="tensorwise") == every
    # row-wise: k and v (out 1024) stay bf16: 6 per weight and token, and 2 for the rerun
    assert every - float8_flops(c, 8192, 2, "full", recipe="rowwise") == 8 * L * 2 * h * kv * T


def test_planner_replaces_1f1bs_bubble_by_the_schedules():
    from distkit.speed import GPUS, LINKS
    c, gpu, link = LLAMA_CONFIGS["70b"], GPUS["H100 SXM"], LINKS["IB NDR / RoCE 400G"]
    kw = dict(seq=8192, local_batch=8, ac="full", gpu=gpu, link=link, eta=0.4)
    one = step_time(c, Composed(pp=4, dp_shard=2, tp=8, microbatches=8), **kw)
    inter = step_time(c, Composed(pp=4, dp_shard=2, tp=8, microbatches=8,
                                  schedule="Interleaved1F1B"), **kw)
    assert one["pp bubble s"] == pytest.approx(3 * one["micro-step s"])  # (p - 1) micro-steps
    assert inter["pp bubble s"] == pytest.approx(one["pp bubble s"] / 2)  # v = 2
    assert inter["tokens/s/GPU"] > one["tokens/s/GPU"]


def test_memory_with_context_parallelism_splits_the_sequence():
    c = LLAMA_CONFIGS["8b"]
    cp1 = memory(c, Composed(dp_shard=8), seq=16384, local_batch=1, ac="full")["peak"]
    cp2 = memory(c, Composed(dp_shard=4, cp=2), seq=16384, local_batch=1, ac="full")["peak"]
    half = memory(c, Composed(dp_shard=8), seq=8192, local_batch=1, ac="full")["peak"]
    assert cp2 == half < cp1  # cp 2 holds 8192 tokens of each sequence, shards over 4 x 2

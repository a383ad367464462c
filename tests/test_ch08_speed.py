"""Chapter 08's time model and planner, term by term against hand computations (no launch, no
torch: plain arithmetic, well under a second).

Each new term of distkit.speed.step_time has a test that computes it here from its definition
with the course's numbers (NCCL's latencies, datasheet bandwidths, bytes per parameter), not by
calling the function that the model uses for it."""
import math

import pytest

from distkit.memory import GiB, LLAMA_CONFIGS, llama_parts, llama_training_bytes, matmul_params
from distkit.speed import (ADAMW_BYTES, FABRIC, GPUS, LINKS, Efficiency, Fabric, Layout,
                           activation_traffic, collective_time, fsdp_threshold_tokens,
                           hardware_flops, memory_bound_seconds, peak_bf16, step_time)

H100, NDR = GPUS["H100 SXM"], LINKS["IB NDR / RoCE 400G"]
C8, C70 = LLAMA_CONFIGS["8b"], LLAMA_CONFIGS["70b"]
us = 1e-6


def test_collective_alpha_beta_by_hand():
    """NCCL 2.30's ring constants (tuning.cc, Simple): 8.4 us a collective, 3.4 us a step
    inside a node, 14 us a step between nodes; bus bandwidth 80 % of the line rate."""
    gb = 1e9
    inside = collective_time("all_gather", gb, 8, 8, 450e9, NDR)
    assert inside == pytest.approx(8.4 * us + 7 * 3.4 * us + 7 / 8 * gb / (0.8 * 450e9))
    # 64 ranks, 8 per node: 63 steps, 7 of them between nodes; the ring's channels leave each
    # node through its 8 NICs (NCCL's busBw = channels x bandwidth per channel): 8 x 50 GB/s
    across = collective_time("reduce_scatter", gb, 64, 8, 450e9, NDR)
    assert across == pytest.approx((8.4 + 56 * 3.4 + 7 * 14) * us + 63 / 64 * gb / (0.8 * 400e9))
    # ... but never faster than NVLink, which carries every byte each rank sends
    assert collective_time("all_gather", gb, 16, 8, 450e9, 100e9) == pytest.approx(
        (8.4 + 14 * 3.4 + 14) * us + 15 / 16 * gb / (0.8 * 450e9))
    # one rank per node (tp 8 innermost, HSDP's replicas): one NIC each; an all-reduce is a
    # reduce-scatter and an all-gather: twice the steps and the bytes, one base
    ar = collective_time("all_reduce", gb, 4, 1, 450e9, NDR)
    assert ar == pytest.approx((8.4 + 2 * 3 * 14) * us + 2 * 3 / 4 * gb / (0.8 * 50e9))
    # 2 ranks per node (tp 4): two NICs
    two = collective_time("all_gather", gb, 8, 2, 450e9, NDR)
    assert two == pytest.approx((8.4 + 4 * 3.4 + 3 * 14) * us + 7 / 8 * gb / (0.8 * 100e9))
    # one rank: nothing to do; a latency-bound collective: 1 KB over 512 ranks costs ~2 ms
    assert collective_time("all_gather", gb, 1, 8, 450e9, NDR) == 0
    assert collective_time("all_gather", 1e3, 512, 8, 450e9, NDR) > 2e-3
    with pytest.raises(ValueError, match="unknown collective"):
        collective_time("broadcast", gb, 8, 8, 450e9, NDR)


def test_memory_bound_seconds_by_hand():
    """AdamW foreach: 80 bytes per fp32 parameter (torch 2.13's _multi_tensor_adam, counted in
    ADAMW_BYTES' comment); fused 28. FSDP2's copies: 12 per sharded, 14 per unsharded."""
    m = memory_bound_seconds(1e9, 8e9, H100)
    assert m["optimizer s"] == pytest.approx(80e9 / 3.35e12)
    assert m["copies s"] == pytest.approx((12e9 + 14 * 8e9) / 3.35e12)
    fused = memory_bound_seconds(1e9, 8e9, H100, optimizer="fused")
    assert fused["optimizer s"] == pytest.approx(28e9 / 3.35e12) and ADAMW_BYTES["fused"] == 28


def test_h200_fixed_cost_from_the_recorded_steps():
    """Review F7: the course's H200 steps (1B, one GPU) fit ~43 ms of fixed cost per step. The
    memory-bound terms explain this much of it, by hand: foreach AdamW over 1.236e9 fp32
    parameters, 80 B each, at 4.8 TB/s = 20.6 ms; FSDP2's copies on a world of one, 26 B per
    parameter = 6.7 ms. The rest (~16 ms) is left to per-op CPU dispatch: not modelled."""
    params = sum(llama_parts(LLAMA_CONFIGS["1b"]).values()) + 15 * llama_parts(
        LLAMA_CONFIGS["1b"])["layer"]
    assert params == 1_235_814_400
    m = memory_bound_seconds(params, params, GPUS["H200 SXM"])
    assert round(1e3 * m["optimizer s"], 1) == 20.6 and round(1e3 * m["copies s"], 1) == 6.7


def test_per_phase_overlap_by_hand():
    """8B on 64 GPUs (8 nodes, each with one 400 Gb/s NIC shared by its 8 GPUs: 6.25 GB/s per
    GPU), 8 x 2048 tokens per GPU, two micro-steps: the backward carries 6 of the 8 bytes per
    parameter but only 2/3 of the compute, so it exposes communication that a single overlap
    pool would hide. Computed here from the collectives' definitions."""
    lay = Layout(gpus=64, seq=2048, batch=8, accumulation=2, ac="none")
    eta = 0.47
    t = step_time(C8, lay, gpu=H100, link=NDR / 8, eta=eta)
    parts, L = llama_parts(C8), 32
    hw = hardware_flops(C8, 2048, 8)
    cf = hw["forward"] / (eta * H100.peak)
    cb = (hw["hardware"] - hw["forward"]) / (eta * H100.peak)
    assert (t["forward compute s"], t["backward compute s"]) == (pytest.approx(cf),
                                                                pytest.approx(cb))

    def ring(nbytes):  # 64 ranks, 8 per node, the node's one NIC
        return (8.4 + 56 * 3.4 + 7 * 14) * us + 63 / 64 * nbytes / (0.8 * 50e9)
    layer, root = parts["layer"], parts["root"]
    gather_f = L * ring(2 * layer) + ring(2 * root)
    comm_b = L * ring(2 * layer) + L * ring(4 * layer) + ring(4 * root)
    assert comm_b > cb and gather_f + comm_b < cf + cb  # per phase exposed, pooled hidden
    exposed = (max(cf, gather_f) + ring(2 * layer) - cf) + (max(cb, comm_b) + ring(4 * root) - cb)
    assert t["fsdp exposed s"] == pytest.approx(2 * exposed)
    copies = (12 * (L * layer + root) / 64 + 14 * (L * layer + root)) / 3.35e12
    optimizer = 80 * (L * layer + root) / 64 / 3.35e12
    assert t["step s"] == pytest.approx(2 * (cf + cb + exposed + copies) + optimizer)
    assert t["tokens/s/GPU"] == pytest.approx(2 * 8 * 2048 / t["step s"])


def test_hsdp_all_reduce_once_per_optimizer_step():
    """HSDP 8 x 8 (shard inside a node, replicate across 8 nodes): the shard group's collectives
    run on NVLink every micro-step; the gradient shards' all-reduce across replicas (fp32, one
    rank per node) only in the last micro-step: by hand, per layer and for the root."""
    # on a slow network (2 GB/s per GPU) the all-reduce outlasts the last backward and shows;
    # the other micro-steps are those of FSDP over the 8 GPUs of one node, without it
    one, four = (step_time(C8, Layout(gpus=64, seq=8192, replicate=8, accumulation=a, ac="full"),
                           gpu=H100, link=2e9, eta=0.4) for a in (1, 4))
    node = step_time(C8, Layout(gpus=8, seq=8192, ac="full"), gpu=H100, link=2e9, eta=0.4)
    assert four["step s"] - one["step s"] == pytest.approx(3 * node["micro-step s"])
    assert one["step s"] > node["step s"] + 1  # the all-reduce, exposed once
    one = step_time(C8, Layout(gpus=64, seq=8192, replicate=8, ac="full"), gpu=H100, link=NDR,
                    eta=0.4)
    parts = llama_parts(C8)

    def ar(nbytes):  # 8 replicas, one per node: 2 x 7 steps between nodes
        return (8.4 + 14 * 14) * us + 2 * 7 / 8 * nbytes / (0.8 * 50e9)
    assert one["hsdp all-reduce s"] == pytest.approx(32 * ar(4 * parts["layer"] / 8)
                                                     + ar(4 * parts["root"] / 8))
    # the shard group's collectives ride NVLink whatever the network; FSDP over all 64 GPUs
    # crosses nodes every micro-step: on nodes with one 400 Gb/s NIC for 8 GPUs it pays for it
    def comm(layout, link):
        return step_time(C8, layout, gpu=H100, link=link, eta=0.4)["fsdp comm s"]
    hsdp = Layout(gpus=64, seq=8192, replicate=8, accumulation=4, ac="full")
    fsdp = Layout(gpus=64, seq=8192, accumulation=4, ac="full")
    assert comm(hsdp, NDR / 8) == pytest.approx(comm(hsdp, NDR))
    assert comm(hsdp, NDR / 8) < comm(fsdp, NDR / 8) / 4


def test_pipeline_bubble_and_slots():
    """1F1B with m micro-batches on p stages: m + p - 1 slots of one micro-batch's stage time,
    the bubble (p - 1) of them; FSDP under PP gathers the stage once and reduce-scatters once
    per optimizer step (torchtitan, torch.distributed.pipelining), the scatter after the last
    backward, in the open; the optimizer once."""
    lay = Layout(gpus=64, seq=8192, pp=4, tp=8, accumulation=12, ac="full",
                 sequence_parallel=True)
    t = step_time(C70, lay, gpu=H100, link=NDR, eta=0.4)
    assert t["pp bubble s"] == pytest.approx(3 * t["micro-step s"])
    assert t["step s"] == pytest.approx(15 * t["micro-step s"] + t["fsdp exposed s"]
                                        + t["copies s"] + t["optimizer s"])
    assert t["tokens/step"] == 2 * 12 * 8192  # 2 data-parallel ranks, 12 micro-batches
    # the shard group: 2 ranks in 2 nodes (tp 8 fills a node); the stage's 20 layers (1/8 each)
    # and the LM head (split by 8) reduce-scattered once, in fp32
    layer = llama_parts(C70)["layer"] / 8
    head = (C70["vocab_size"] * C70["hidden_size"] + C70["hidden_size"]) / 8

    def rs(nbytes):
        return (8.4 + 14) * us + 1 / 2 * nbytes / (0.8 * 50e9)
    assert t["fsdp exposed s"] >= 20 * rs(4 * layer) + rs(4 * head)
    m = llama_training_bytes(C70, ranks=2, seq=8192, batch=1, ac="full", tensor_parallel=8,
                             pipeline_parallel=4, sequence_parallel=True, in_flight=4)
    assert m["Unsharded Grad"] == 20 * (llama_parts(C70)["layer"] // 8) * 4  # fp32, whole stage
    # the slowest stage: 20 of the 80 layers and the LM head, its share of tp 8
    hw = hardware_flops(C70, 8192, 1, ac="full")
    head = 6 * C70["vocab_size"] * C70["hidden_size"] * 8192
    want = ((hw["hardware"] - head) / 32 + head / 8) / (0.4 * H100.peak)
    assert t["forward compute s"] + t["backward compute s"] == pytest.approx(want)


def test_tensor_parallel_switch_in_both_models():
    """Review F6: without the vocabulary-parallel root every tp rank runs the whole LM head
    (6 V h per token) and holds the whole root; with it (torchtitan's plan) both split by t."""
    def run(sp):
        return step_time(C8, Layout(gpus=512, seq=8192, batch=4, tp=8, ac="full",
                                    sequence_parallel=sp), gpu=H100, link=NDR, eta=0.4)
    megatron, titan = run(False), run(True)
    head = 6 * C8["vocab_size"] * C8["hidden_size"] * 4 * 8192
    extra = (megatron["forward compute s"] + megatron["backward compute s"]
             - titan["forward compute s"] - titan["backward compute s"])
    assert extra == pytest.approx(head * (1 - 1 / 8) / (0.4 * H100.peak))
    root = llama_parts(C8)["root"]
    m0, m1 = (llama_training_bytes(C8, ranks=64, seq=8192, batch=1, ac="full",
                                   tensor_parallel=8, sequence_parallel=sp) for sp in (False,
                                                                                     True))
    assert (m0["Unsharded Param"], m1["Unsharded Param"]) == (2 * root, 2 * (root // 8))
    assert m1["Temp"] == 8 * 8192 * C8["vocab_size"] // 8  # the logits' gradients, split by t


def test_efficiency_two_parts_by_hand():
    """Efficiency(matmul, passes): compute = hardware FLOPs / (matmul x peak) + passes x
    activation bytes / HBM; for a bf16 sdpa layer without checkpointing the bytes per token are
    2 RMSNorms 2(4h + 4 + 2h) + matmul inputs 4h + q,k,v 2(h + 2kv) + output and log-sum-exp
    2h + 4a + SwiGLU 8i (the formula chapter 08 prints), and the loss's 12 V."""
    c, s = C8, 4096
    h, kv, i, a, V = 4096, 1024, 14336, 32, 128256
    per_token = 2 * (4 * h + 4 + 2 * h) + 4 * h + 2 * (h + 2 * kv) + 2 * h + 4 * a + 8 * i
    assert activation_traffic(c, s) == s * (32 * per_token + 12 * V)
    assert activation_traffic(c, s, ac="full") == s * (64 * per_token + 12 * V)
    t = step_time(c, Layout(gpus=8, seq=s, ac="none"), gpu=H100, link=NDR,
                  eta=Efficiency(0.6, 5.0))
    hw = hardware_flops(c, s)["hardware"]
    seconds = hw / (0.6 * H100.peak) + 5.0 * activation_traffic(c, s) / 3.35e12
    assert t["eta"] == pytest.approx(hw / (seconds * H100.peak))


def test_closed_form_threshold_is_the_models_own_crossover():
    """F8's closed form, T* = 6 eta P / (4 B) tokens per GPU per micro-step (6 bytes per
    parameter in the backward, 4 FLOPs per parameter and token; B the ring's bus bandwidth,
    across whole nodes the node's 8 NICs), plus 2 alpha eta P / (4 layer) for each layer's two
    collectives' latency, against the crossover the step model itself finds (the batch at which
    the backward's collectives equal its compute): exact where the closed form's assumptions
    hold (no attention, no root, no latency: a wide, shallow model at a short sequence, alpha =
    0), and within 15 % for Llama 8B and 70B at 8192 with NCCL's latencies, on 64 and 512 GPUs,
    with a NIC per GPU and with one per node (the attention's FLOPs, which the closed form
    leaves out, lower the model's crossover by up to ~13 %)."""
    eta, bw = 0.4, 0.8 * 8 * NDR
    closed = fsdp_threshold_tokens(eta, H100, bw)
    assert closed == pytest.approx(6 * 0.4 * 989e12 / (4 * 0.8 * 400e9))

    def crossover(config, seq, fabric, gpus=512, link=NDR):
        def gap(tokens):  # backward comm - backward compute, per micro-step
            lay = Layout(gpus=gpus, seq=seq, batch=1, ac="none")
            t = step_time(config, lay, gpu=H100, link=link, eta=eta * seq / tokens,
                          fabric=fabric)
            return t["fsdp comm s"] * 3 / 4 - t["backward compute s"]  # 6 of 8 bytes
        lo, hi = 1e2, 1e7
        for _ in range(100):
            mid = math.sqrt(lo * hi)
            lo, hi = (mid, hi) if gap(mid) > 0 else (lo, mid)
        return lo
    wide = dict(vocab_size=8, hidden_size=8192, intermediate_size=8192 * 4, num_hidden_layers=4,
                num_attention_heads=64, num_key_value_heads=64, tie_word_embeddings=False)
    ideal = Fabric(base=0, nvlink_step=0, net_step=0, bus_efficiency=0.8)
    assert crossover(wide, 16, ideal) == pytest.approx(closed, rel=0.01)
    for config in (C8, C70):
        for gpus in (64, 512):
            for link in (NDR, NDR / 8):  # a NIC per GPU; one NIC per node
                alpha = collective_time("all_gather", 0, gpus, 8, 450e9, link)
                want = fsdp_threshold_tokens(eta, H100, 0.8 * 8 * link, alpha=alpha,
                                             layer_params=llama_parts(config)["layer"])
                assert crossover(config, 8192, FABRIC, gpus, link) == pytest.approx(want,
                                                                                   rel=0.15)


def test_reserved_budget_and_goodput_by_hand():
    from distkit.plan import (CONTEXT_GIB, FAILURES_PER_GPU_HOUR, RESERVED_RATIO, fits,
                              goodput, reserved_bytes)
    # the course's H200 runs: 32.70 / 26.93, 29.98 / 23.68, 47.19 / 39.10 reserved / allocated
    assert RESERVED_RATIO == pytest.approx(29.98 / 23.68) and CONTEXT_GIB == 2
    assert reserved_bytes(60 * GiB) == pytest.approx(60 * GiB * 29.98 / 23.68 + 2 * GiB)
    assert fits(60 * GiB, 79.6) and not fits(61.5 * GiB, 79.6)
    # Llama 3: 419 interruptions in 54 days on 16,384 GPUs; 64 GPUs: one every ~3.3 weeks
    assert FAILURES_PER_GPU_HOUR == pytest.approx(419 / (54 * 24 * 16384))
    g = goodput(64, 2.0, 8e9)
    mtbf = 3600 * 54 * 24 * 16384 / (419 * 64)
    delta = 12 * 8e9 / 20e9
    tau = round(math.sqrt(2 * delta * mtbf) / 2.0) * 2.0
    assert (g["save s"], g["interval s"]) == (pytest.approx(delta), pytest.approx(tau))
    assert g["goodput"] == pytest.approx(1 - delta / tau - (tau / 2 + 600) / mtbf)


def test_layout_rejects_what_cannot_be_laid_out():
    with pytest.raises(ValueError, match="tp 16"):
        Layout(gpus=64, seq=2048, tp=16)
    with pytest.raises(ValueError, match="must divide"):
        Layout(gpus=24, seq=2048, tp=8, pp=2)
    with pytest.raises(ValueError, match=">= 1"):
        Layout(gpus=8, seq=2048, batch=0)
    assert matmul_params(C8) * 6 < hardware_flops(C8, 1)["model"]


def test_gpu_step_bad_input_and_cpu(monkeypatch, capsys):
    """gpu_step.py: a one-line error on bad input; on a machine without CUDA it says it is
    skipped and exits 0 (the notebook's cell and make gpu-smoke run it everywhere)."""
    import torch
    from conftest import run_in_process
    status, _, err = run_in_process(monkeypatch, capsys, "ch08_plan/gpu_step.py", "--steps", "0")
    assert status == 2 and "--steps >= 1" in err.strip().splitlines()[-1]
    if torch.cuda.is_available():
        pytest.skip("a CUDA machine runs the real steps (make gpu-smoke)")
    status, out, _ = run_in_process(monkeypatch, capsys, "ch08_plan/gpu_step.py",
                                    "--fused-adamw")
    assert status == 0 and out.startswith("skipped: no CUDA device")


def test_cpu_offload_plan_states_its_host_memory():
    """FSDP2's CPUOffloadPolicy moves the fp32 shards, their gradients and AdamW's two moments to
    the host: 16 bytes per parameter a GPU owns, which the node's (pinned) RAM must hold for all
    its GPUs: 70B on one node of 8 = 16 x 70.55e9 / 8 per GPU, about 1 TiB per node."""
    from distkit.plan import plan, show
    params = 80 * llama_parts(C70)["layer"] + llama_parts(C70)["root"]
    kw = dict(gpu=H100, link=NDR, eta=0.4, tokens=1e9, price=2.5)
    p = plan(C70, Layout(gpus=8, seq=8192, ac="full", cpu_offload=True), **kw)
    assert p["host"] == pytest.approx(16 * params / 8)
    assert f"host RAM (CPU offload) {16 * params / 8 / GiB:,.0f} GiB per GPU" in show(p)
    assert plan(C70, Layout(gpus=32, seq=8192, ac="full"), **kw)["host"] == 0


def test_memory_options_by_hand():
    """llama_training_bytes' modelled options (not simulated), at 8B, 8 ranks, 8192 tokens:
    CPU offload takes the shards and AdamW's moments out of the GPU's total (the same moment,
    loss backward); 1F1B's first stage holds pp micro-batches of its L / pp layers: (pp - 1) x
    L / pp layers' saved tensors more; a chunked loss holds 1 / c of the fp32 log-softmax (and
    the vocabulary-parallel loss 1 / t of it)."""
    from distkit.memory import llama_layer_saved, llama_rest_saved
    kw = dict(ranks=8, seq=8192, batch=1, ac="full")
    base = llama_training_bytes(C8, **kw)
    off = llama_training_bytes(C8, **kw, cpu_offload=True)
    assert base["moment"] == off["moment"] == "loss backward"
    states = base["Sharded Param"] + base["OptState"]
    assert (off["CPU"], off["Total"]) == (states, base["Total"] - states)
    saved = sum(llama_layer_saved(C8, 8192, 1, ac="full").values())
    one, four = (llama_training_bytes(C8, **kw, pipeline_parallel=4, in_flight=n) for n in (1, 4))
    assert four["Activation"] - one["Activation"] == 3 * 8 * saved
    T, V = 8192, C8["vocab_size"]
    key = "log-softmax of the fp32 logits (the loss)"
    assert llama_rest_saved(C8, T, 1, loss_chunks=8)[key] == 4 * T * V // 8 + 4
    assert llama_rest_saved(C8, T, 1, vocab_parallel=8, loss_chunks=2)[key] == 4 * T * V // 16 + 4


@pytest.mark.parametrize("name, peak", [
    ("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA H100 PCIe", 756e12), ("NVIDIA H100 NVL", 835e12),
    ("NVIDIA GH200 480GB", 989e12), ("NVIDIA H200", 989e12), ("NVIDIA H200 NVL", 835e12),
    ("NVIDIA A100-SXM4-80GB", 312e12), ("NVIDIA L40S", 362e12), ("NVIDIA L40", 181e12),
    ("NVIDIA L4", 121e12), ("NVIDIA A10G", None), ("NVIDIA A10", 125e12),
    ("NVIDIA B200", 2250e12), ("NVIDIA GB200", 2500e12), ("AMD Instinct MI300X", 1307e12),
    ("NVIDIA GeForce RTX 4090", None)])
def test_peak_bf16_by_device_name(name, peak):
    """The capstone's MFU reads the peak by torch.cuda.get_device_name(): the longest table name
    the device's contains wins, whatever the table's order (an L40S is no L4, an A10G no A10)."""
    assert peak_bf16(name) == peak


def test_pipeline_schedules_bubble_by_their_formulas():
    """The schedule's idle fraction (distkit.schedules.bubble_formula, chapter 10's counts):
    with m micro-batches of `micro` seconds the busy part of the step is m x micro / (1 - idle);
    interleaving v stages per rank cuts 1F1B's (p-1)/(m+p-1) to (p-1)/(vm+p-1), zero bubble to
    (p-1)/(3vm+p-1)."""
    kw = dict(gpus=64, seq=8192, pp=4, tp=8, accumulation=12, ac="full", sequence_parallel=True)
    for schedule, v, idle in (("1F1B", 1, 3 / 15), ("Interleaved1F1B", 2, 3 / 27),
                              ("InterleavedZeroBubble", 2, 3 / 75)):
        t = step_time(C70, Layout(**kw, schedule=schedule, virtual=v), gpu=H100, link=NDR,
                      eta=0.4)
        busy = 12 * t["micro-step s"] / (1 - idle)
        assert t["pp bubble s"] == pytest.approx(busy - 12 * t["micro-step s"])
        assert t["step s"] == pytest.approx(busy + t["fsdp exposed s"] + t["copies s"]
                                            + t["optimizer s"])
    with pytest.raises(ValueError, match="stages per rank"):
        Layout(**kw, schedule="Interleaved1F1B", virtual=1)


def test_accumulation_without_sync_skips_the_early_reduce_scatters():
    """train_llama.py's default (set_requires_gradient_sync(False) until the last micro-batch):
    the m - 1 early micro-steps run no reduce-scatter. On a slow link (FSDP's traffic exposed),
    the step is shorter by exactly those scatters: per layer and for the root, fp32, plus the
    root's last one that nothing covers."""
    slow = 1e9
    kw = dict(gpus=64, seq=8192, accumulation=4, ac="full")
    synced = step_time(C8, Layout(**kw), gpu=H100, link=slow, eta=0.4)
    kept = step_time(C8, Layout(**kw, sync_every_microbatch=False), gpu=H100, link=slow, eta=0.4)
    layer, root = llama_parts(C8)["layer"], llama_parts(C8)["root"]

    def rs(nbytes):
        return collective_time("reduce_scatter", nbytes, 64, 8, H100.nvlink, slow)
    scatter = 32 * rs(4 * layer) + rs(4 * root)
    # exposed in both: the backward's gathers alone already outlast its compute here
    gathers = 32 * collective_time("all_gather", 2 * layer, 64, 8, H100.nvlink, slow)
    assert gathers > synced["backward compute s"]
    assert synced["step s"] - kept["step s"] == pytest.approx(3 * (scatter + rs(4 * root)))

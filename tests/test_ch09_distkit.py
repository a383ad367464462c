"""Chapter 09's lesson-layer modules in one process (no launch): distkit.cp's layouts, causal work
and online softmax against torch's own load balancer and SDPA; distkit.moe against transformers'
Mixtral block and auxiliary loss; distkit.cpep's parameter counts against transformers' models
built on the meta device (exact) and against the totals their authors publish (held out, never
fitted: the miss is printed), and its byte formulas against distkit.cp's."""
import math
import warnings

import pytest
import torch
import torch.nn.functional as F

from distkit import cp, cpep, moe
from distkit.memory import LLAMA_CONFIGS, llama_training_bytes


# --- distkit.comm (the byte counts of §4-§8 are its log) ------------------------------------------

def test_collective_log_knows_every_c10d_op_commdebugmode_does():
    """distkit.comm writes CommDebugMode's list of c10d collectives out (importing torch's module
    costs every rank a torch._inductor import); a torch that adds one to its list fails here."""
    from torch.distributed.tensor.debug._comm_mode import c10d_collective_ops
    from distkit.comm import c10d_collective_ops as ours
    assert ours == c10d_collective_ops


# --- distkit.cp ----------------------------------------------------------------------------------

@pytest.mark.parametrize("seq, n", [(16, 2), (48, 3), (64, 4), (8192, 8)])
def test_head_tail_is_torchs_load_balancer(seq, n):
    from torch.distributed.tensor.experimental._attention import _HeadTailLoadBalancer
    torch_order = _HeadTailLoadBalancer(seq, n, "cpu")._generate_indices().view(-1)
    assert torch.equal(cp.token_order(cp.head_tail(n), seq), torch_order)


def test_causal_work_counts():
    """Score entries with key <= query, per rank: contiguous 36 vs 100 (S = 16, N = 2), head-tail
    68 each; at S = 8192, N = 8 the last contiguous rank waits 1.87x the mean (review F2)."""
    assert cp.causal_work(cp.contiguous(2), 16) == [36, 100]
    assert cp.causal_work(cp.head_tail(2), 16) == [68, 68]
    for layout in (cp.contiguous(8), cp.head_tail(8)):  # every needed entry, counted once
        assert sum(cp.causal_work(layout, 8192)) == 8192 * 8193 // 2
    work = cp.causal_work(cp.contiguous(8), 8192)
    assert round(max(work) / (sum(work) / 8), 2) == 1.87 and round(max(work) / min(work)) == 15
    assert len(set(cp.causal_work(cp.head_tail(8), 8192))) == 1
    assert cp.causal_work(cp.contiguous(4), 64, causal=False) == [64 * 16] * 4


def test_merged_blocks_are_attention_over_all_keys():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 12, 8, dtype=torch.float64) for _ in range(3))
    scale = 8 ** -0.5
    blocks = [cp.block_attention(q, kk, vv, "full", scale) for kk, vv in zip(k.chunk(4, 2),
                                                                             v.chunk(4, 2))]
    out, lse = blocks[0]
    for block in blocks[1:]:
        out, lse = cp.merge(out, lse, *block)
    assert (out - cp.reference_attention(q, k, v, causal=False)).abs().max() < 1e-13
    assert (lse - torch.logsumexp(q @ k.transpose(-2, -1) * scale, -1)).abs().max() < 1e-13
    # a diagonal block alone is causal attention over it
    diag, _ = cp.block_attention(q, k, v, "diagonal", scale)
    assert (diag - cp.reference_attention(q, k, v, causal=True)).abs().max() < 1e-13


def test_byte_formulas():
    # ring: a block = K and V of one rank, 2 x B x H_kv x S/N x D values
    assert cp.ring_bytes(2, 2, 2, 64, 16, 8) == {"forward bytes": 32_768, "backward bytes": 98_304}
    assert cp.ring_bytes(4, 1, 8, 4096, 128, 2)["forward bytes"] == 3 * 2 * 8 * 1024 * 128 * 2
    assert cp.ring_bytes(1, 2, 2, 64, 16, 8) == {"forward bytes": 0, "backward bytes": 0}
    # Ulysses: (2 H + 2 H_kv) x B x S/N x D values, (N-1)/N of them sent, forward and backward
    assert cp.ulysses_bytes(2, 2, 4, 2, 64, 16, 8) == {"forward bytes": 49_152,
                                                       "backward bytes": 49_152}


# --- distkit.moe --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def mixtral_block():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from transformers import MixtralConfig
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    config = MixtralConfig(hidden_size=32, intermediate_size=64, num_local_experts=6,
                           num_experts_per_tok=2)
    torch.manual_seed(0)
    block = MixtralSparseMoeBlock(config)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return block


def test_moe_by_hand_is_transformers_block(mixtral_block):
    x = torch.randn(1, 40, 32)
    with torch.no_grad():
        theirs = mixtral_block(x)[0]
        mine = moe.moe(x[0], mixtral_block.gate.weight, mixtral_block.experts.gate_up_proj,
                       mixtral_block.experts.down_proj, 2)
    assert (mine - theirs).abs().max() < 1e-5


def test_grouped_experts_is_a_loop_over_the_experts_including_empty_ones():
    torch.manual_seed(0)
    gate_up, down = torch.randn(4, 16, 8), torch.randn(4, 8, 8)
    counts = torch.tensor([3, 0, 5, 2])
    x = torch.randn(int(counts.sum()), 8)
    loop, start = [], 0
    for e, c in enumerate(counts.tolist()):
        gate, up = (x[start:start + c] @ gate_up[e].T).chunk(2, -1)
        loop.append((F.silu(gate) * up) @ down[e].T)
        start += c
    assert (moe.grouped_experts(x, counts, gate_up, down) - torch.cat(loop)).abs().max() < 1e-5


def test_capacity_dropped_and_the_auxiliary_loss(mixtral_block):
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func
    assert moe.capacity(128, 4, 2, 1.0) == 64 and moe.capacity(128, 4, 2, 1.25) == 80
    assert moe.capacity(10, 4, 1, 1.0) == 3  # rounded up
    assert moe.dropped([63, 71, 57, 65], 64) == 8 and moe.dropped([63, 71, 57, 65], 80) == 0
    logits = F.linear(torch.randn(64, 32), mixtral_block.gate.weight)
    for skew in (0.0, 3.0):
        skewed = logits + torch.tensor([skew, 0, 0, 0, 0, 0])
        ours = moe.load_balancing_loss(skewed, 2).item()
        assert abs(ours - load_balancing_loss_func((skewed,), 6, 2).item()) < 1e-6
    # every token picks experts 0 and 1 with probability 1/2 each: E x (1 x 1/2 + 1 x 1/2) = E
    concentrated = torch.tensor([[9.0, 9.0, -9, -9, -9, -9]]).expand(8, -1)
    assert abs(moe.load_balancing_loss(concentrated, 2).item() - 6) < 1e-3


def test_topk_margin_is_the_routers_closest_call():
    """The smallest gap between a token's k-th and (k+1)-th logit: a tie gives 0 (the routing,
    and every count printed from it, could differ on another CPU); k = E has no (k+1)-th."""
    logits = torch.tensor([[0.3, 0.1, 0.2, -1.0], [2.0, 1.0, 1.5, 0.0]])
    assert moe.topk_margin(logits, 2) == pytest.approx(0.1)  # token 0: 0.2 vs 0.1
    assert moe.topk_margin(logits, 1) == pytest.approx(0.1)  # token 0: 0.3 vs 0.2
    tied = torch.cat([logits, torch.tensor([[0.5, 0.4, 0.4, 0.0]])])
    assert moe.topk_margin(tied, 2) == 0.0 and moe.topk_margin(tied, 4) == math.inf


# --- distkit.cpep -------------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(cpep.MOE_CONFIGS))
def test_moe_params_are_transformers_models_on_meta(name):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from transformers import AutoConfig, AutoModelForCausalLM
    config = dict(cpep.MOE_CONFIGS[name])
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(
            AutoConfig.for_model(config.pop("model_type"), **config))
    assert sum(p.numel() for p in model.parameters()) == cpep.moe_params(
        cpep.MOE_CONFIGS[name])["total"]


@pytest.mark.parametrize("name", list(cpep.PUBLISHED))
def test_moe_params_against_the_published_totals(name):
    """Held out: the totals as their authors state them (rounded to 3 figures); never fitted."""
    total, active = cpep.PUBLISHED[name]
    p = cpep.moe_params(cpep.MOE_CONFIGS[name])
    print(f"{name}: total {p['total'] / 1e9:.2f}B vs {total / 1e9}B, active "
          f"{p['active'] / 1e9:.2f}B vs {active / 1e9}B")
    assert abs(p["total"] / total - 1) < 0.01
    assert abs(p["active"] / active - 1) < 0.025  # "12.9B", "3.3B": 2 or 3 figures


def test_cp_plan_is_chapter_08s_model_at_seq_over_cp_and_the_byte_formulas():
    c = LLAMA_CONFIGS["8b"]
    assert cpep.cp_memory(c, gpus=32, cp=8, seq=131072) == llama_training_bytes(
        c, ranks=32, seq=16384, batch=1, precision="bf16", attn="sdpa", ac="full")
    d = 4096 // 32
    ring = cp.ring_bytes(8, 1, 8, 131072, d, 2)
    ulysses = cp.ulysses_bytes(8, 1, 32, 8, 131072, d, 2)
    for ac, forwards in (("none", 1), ("full", 2)):  # checkpointing reruns the forward
        assert cpep.cp_bytes(c, cp=8, seq=131072, ac=ac) == 32 * (
            forwards * ring["forward bytes"] + ring["backward bytes"])
        assert cpep.cp_bytes(c, cp=8, seq=131072, method="ulysses", ac=ac) == 32 * (
            forwards * ulysses["forward bytes"] + ulysses["backward bytes"])
    assert cpep.cp_bytes(c, cp=1, seq=4096) == 0
    with pytest.raises(ValueError, match="key/value heads"):
        cpep.cp_bytes(c, cp=16, seq=131072, method="ulysses")  # 8 KV heads
    with pytest.raises(ValueError, match="must divide"):
        cpep.cp_memory(c, gpus=12, cp=8, seq=131072)
    # a ring step hides its transfer above H_kv eff peak / (H bandwidth) tokens per GPU with
    # contiguous chunks, twice that with head-tail (half blocks: test_ring_steps_after_the_first)
    contiguous = cpep.ring_overlap_tokens(c, peak=989e12, bandwidth=450e9, layout="contiguous")
    assert math.isclose(contiguous, 8 * 0.5 * 989e12 / (32 * 450e9))
    assert cpep.ring_overlap_tokens(c, peak=989e12, bandwidth=450e9) == 2 * contiguous
    # torch's all-gather holds the whole sequence's K and V during a layer's attention
    assert cpep.kv_gather_bytes(c, seq=131072) == 2 * 131072 * 8 * 128 * 2 == 2**29  # 0.5 GiB
    # the loss in chunks: what the planner passes on (review expert_ch09 F1)
    assert cpep.cp_memory(c, gpus=8, cp=2, seq=131072, loss_chunks=8) == llama_training_bytes(
        c, ranks=8, seq=65536, batch=1, precision="bf16", attn="sdpa", ac="full", loss_chunks=8)


@pytest.mark.parametrize("n", [2, 4, 8])
def test_ring_steps_after_the_first_are_half_blocks_with_head_tail(n):
    """Scores each rank computes at ring step i (K/V of rank r - i), in units of a full block
    (S/N)^2: head-tail 1/2 at every step after the first, on every rank (so the overlap
    threshold doubles, review expert_ch09 F3); contiguous 1 below the diagonal, 0 above (rank 0
    idles while its transfers run)."""
    def steps(layout):
        chunks = sum(len(cs) for cs in layout)
        part = (n / chunks) ** 2  # one chunk pair, in full blocks
        return [[sum(part for qc in layout[r] for kc in layout[(r - i) % n]
                     if cp.pair_kind(qc, kc, True) == "full") for i in range(1, n)]
                for r in range(n)]
    assert all(w == 0.5 for row in steps(cp.head_tail(n)) for w in row)
    assert steps(cp.contiguous(n))[0] == [0] * (n - 1)
    assert steps(cp.contiguous(n))[n - 1] == [1] * (n - 1)


def test_moe_plan():
    c = cpep.MOE_CONFIGS["mixtral-8x7b"]
    p = cpep.moe_params(c)
    one, eight = (cpep.moe_plan(c, gpus=16, ep=ep, seq=4096) for ep in (1, 8))
    assert one["states"] == eight["states"] == 16 * p["total"] / 16  # 1/N whatever ep
    assert one["gathered layer"] - eight["gathered layer"] == 2 * 7 * p["per expert"]
    # ep 8: each expert on 2 GPUs; per step gathered twice in bf16, reduced once in fp32, of
    # which a GPU sends (2 - 1) / 2
    assert one["all-to-all"] == 0 and eight["fsdp experts"] == pytest.approx(
        (2 * 2 + 4) * p["experts"] / 8 / 2)
    # 32 layers x 6 passes (dispatch + combine; forward, rerun, backward) x 4096 x 2 rows x
    # 4096 values x 2 bytes x 7/8
    assert eight["all-to-all"] == 32 * 6 * 4096 * 2 * 4096 * 2 * 7 / 8
    with pytest.raises(ValueError, match="must divide"):
        cpep.moe_plan(c, gpus=16, ep=16, seq=4096)  # 8 experts

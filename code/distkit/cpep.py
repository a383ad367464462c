"""The planner learns context and expert parallelism: bytes per GPU and per step (chapter 09).

Pure arithmetic on published configurations, no torch import; it extends chapter 08's Llama model
(distkit.memory, distkit.speed) and is checked against torch's fake-process-group simulation
(code/ch09_long_context_moe/simulate_cp_ep.py) and the chapter's measured runs.

Context parallelism (CP) over `cp` GPUs: every GPU holds seq/cp tokens of each sequence and
FSDP2 shards the weights over all dp x cp GPUs (torchtitan's "dp_shard_cp"), so a GPU's memory
is chapter 08's `llama_training_bytes` at seq/cp tokens over all the GPUs (`cp_memory`); CP adds
the attention's traffic (`cp_bytes`: a ring of K/V blocks, or Ulysses' all-to-alls).

Mixture of experts (MoE) with expert parallelism (EP) over `ep` GPUs: each GPU holds E/ep of a
layer's experts; FSDP2 shards the dense weights over all GPUs and each expert over the N/ep GPUs
that hold it ("efsdp"), so the weights at rest are 1/N of the model whatever ep is. EP changes
what moves: with ep = 1 every GPU gathers every expert of a layer (FSDP); with ep > 1 it gathers
only its E/ep, and the tokens travel to their experts instead (`moe_plan`). The MoE layer's
activations are not modelled here (the simulation measures them).

Sources (configurations as published on the Hugging Face hub, config.json, typed in; totals as
their authors state them):
- Mixtral 8x7B and 8x22B: mistralai/Mixtral-8x7B-v0.1, Mixtral-8x22B-v0.1; "46.7B total
  parameters but only uses 12.9B parameters per token" (Mistral AI, "Mixtral of experts", blog,
  2023-12-11; Jiang et al., arXiv:2401.04088); 8x22B: "141B parameters, 39B active" (Mistral AI,
  "Cheaper, Better, Faster, Stronger", blog, 2024-04-17).
- Qwen3-30B-A3B and Qwen3-235B-A22B: Qwen/Qwen3-30B-A3B, Qwen/Qwen3-235B-A22B; 30.5B total /
  3.3B activated, 235B / 22B (their model cards; Qwen3 Technical Report, arXiv:2505.09388).
- Ring attention: Liu et al., arXiv:2310.01889; DeepSpeed-Ulysses: Jacobs et al., arXiv:2309.14509.
"""
from __future__ import annotations

from types import SimpleNamespace

from distkit.memory import communication_bytes, head_dim, llama_training_bytes

# Mixtral names its experts num_local_experts with intermediate_size; Qwen3-MoE num_experts with
# moe_intermediate_size, a head_dim of its own (128, not hidden / heads) and q/k RMSNorms.
MOE_CONFIGS = {
    "mixtral-8x7b": dict(model_type="mixtral", vocab_size=32000, hidden_size=4096,
                         intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2,
                         tie_word_embeddings=False),
    "mixtral-8x22b": dict(model_type="mixtral", vocab_size=32768, hidden_size=6144,
                          intermediate_size=16384, num_hidden_layers=56, num_attention_heads=48,
                          num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2,
                          tie_word_embeddings=False),
    "qwen3-30b-a3b": dict(model_type="qwen3_moe", vocab_size=151936, hidden_size=2048,
                          moe_intermediate_size=768, num_hidden_layers=48,
                          num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                          num_experts=128, num_experts_per_tok=8, tie_word_embeddings=False),
    "qwen3-235b-a22b": dict(model_type="qwen3_moe", vocab_size=151936, hidden_size=4096,
                            moe_intermediate_size=1536, num_hidden_layers=94,
                            num_attention_heads=64, num_key_value_heads=4, head_dim=128,
                            num_experts=128, num_experts_per_tok=8, tie_word_embeddings=False),
}
# (total, active) parameters as their authors state them: held out, never fitted
PUBLISHED = {"mixtral-8x7b": (46.7e9, 12.9e9), "mixtral-8x22b": (141e9, 39e9),
             "qwen3-30b-a3b": (30.5e9, 3.3e9), "qwen3-235b-a22b": (235e9, 22e9)}


# --- context parallelism -------------------------------------------------------------------------

def cp_memory(config, *, gpus: int, cp: int, seq: int, batch: int = 1, ac: str = "full",
              precision: str = "bf16", attn: str = "sdpa", loss_chunks: int = 1) -> dict:
    """Bytes per GPU at the step's peak with context parallelism: chapter 08's Llama model
    (distkit.memory.llama_training_bytes, FSDP2 over all `gpus`, which are dp x cp) at seq / cp
    tokens per sequence; `loss_chunks` > 1 computes the loss chunk by chunk (the logits and their
    gradients exist for one chunk at a time). Ring and Ulysses save what SDPA saves for those
    tokens (fsdp_cp.py measures it); outside this model: Ulysses' one more copy of each layer's
    attention output (a fraction of a percent at the peaks here) and torch's all-gather of the
    whole sequence's K and V while a layer's attention runs (`kv_gather_bytes`)."""
    if seq % cp or gpus % cp:
        raise ValueError(f"cp {cp} must divide seq {seq} and gpus {gpus}")
    return llama_training_bytes(config, ranks=gpus, seq=seq // cp, batch=batch,
                                precision=precision, attn=attn, ac=ac, loss_chunks=loss_chunks)


def kv_gather_bytes(config, *, seq: int, batch: int = 1, elem: int = 2) -> float:
    """The buffer torch's context parallelism holds with its default rotation ("allgather",
    _AllGatherRotater): K and V of the whole sequence, 2 x batch x seq x kv_heads x head_dim
    values, while one layer's attention runs (forward, and again in the backward, with float32
    dK/dV buffers besides). One layer at a time, so not multiplied by the layers; not in
    `cp_memory`. Llama 3.1 8B, 131,072 tokens, bf16: 0.5 GiB; at 1M tokens 4 GiB."""
    c = SimpleNamespace(**config) if isinstance(config, dict) else config
    return 2 * batch * seq * c.num_key_value_heads * head_dim(c) * elem


def cp_bytes(config, *, cp: int, seq: int, batch: int = 1, method: str = "ring",
             ac: str = "full", elem: int = 2) -> float:
    """Bytes each GPU sends per training step for attention with context parallelism, over all
    layers. Ring (distkit.cp.ring_bytes): forward (cp - 1) K/V blocks, backward (cp - 1) K/V
    blocks and cp blocks of their gradients, a block being 2 x batch x kv_heads x head_dim x
    seq/cp values. Ulysses (distkit.cp.ulysses_bytes): forward and backward each (cp - 1)/cp of
    q, k, v and the output. With full activation checkpointing the forward runs twice."""
    c = SimpleNamespace(**config) if isinstance(config, dict) else config
    d, kv, h = head_dim(c), c.num_key_value_heads, c.num_attention_heads
    tokens = batch * seq // cp
    forwards = 2 if ac == "full" else 1
    if method == "ring":
        block = 2 * tokens * kv * d * elem
        per_layer = forwards * (cp - 1) * block + (2 * cp - 1) * block
    elif method == "ulysses":
        if kv % cp or h % cp:
            raise ValueError(f"Ulysses over cp {cp} needs heads ({h}) and key/value heads ({kv}) "
                             f"divisible by {cp}")
        per_layer = (forwards + 1) * (2 * h + 2 * kv) * tokens * d * elem * (cp - 1) / cp
    else:
        raise ValueError(f"method must be ring or ulysses, got {method!r}")
    return c.num_hidden_layers * per_layer if cp > 1 else 0.0


def ring_overlap_tokens(config, *, peak: float, bandwidth: float, eff: float = 0.5,
                        layout: str = "head-tail") -> float:
    """Tokens per GPU (c = seq / cp) above which a ring step's computation outlasts the transfer
    of the next K/V block, so the transfer hides. The block is 2 c H_kv d values, 4 c H_kv d
    bytes in bf16. Its forward attention: 4 H d FLOPs per score (two matmuls). Contiguous
    chunks: a block below the diagonal is c x c scores, so c >= H_kv eff peak / (H bandwidth).
    Head-tail (torch's default, distkit.cp.head_tail): every step after the first computes half
    a block, c^2 / 2 scores (the rank's early chunk skips the block's late half, or only its
    late chunk sees the block: distkit.cp.pair_kind, torch's _templated_ring_attention), so the
    threshold is twice that."""
    c = SimpleNamespace(**config) if isinstance(config, dict) else config
    if layout not in ("head-tail", "contiguous"):
        raise ValueError(f"layout must be head-tail or contiguous, got {layout!r}")
    half = 2 if layout == "head-tail" else 1
    return half * c.num_key_value_heads * eff * peak / (c.num_attention_heads * bandwidth)


# --- mixture of experts --------------------------------------------------------------------------

def _moe(config) -> SimpleNamespace:
    c = SimpleNamespace(**config) if isinstance(config, dict) else config
    experts = getattr(c, "num_local_experts", None) or c.num_experts
    inter = getattr(c, "moe_intermediate_size", None) or c.intermediate_size
    qwen = getattr(c, "model_type", "") == "qwen3_moe"
    return SimpleNamespace(h=c.hidden_size, layers=c.num_hidden_layers, heads=c.num_attention_heads,
                           kv=c.num_key_value_heads, d=head_dim(c), experts=experts,
                           k=c.num_experts_per_tok, inter=inter, vocab=c.vocab_size,
                           tied=c.tie_word_embeddings, qk_norm=qwen)


def moe_params(config) -> dict:
    """Parameters of a Mixtral- or Qwen3-MoE-shaped model (every layer an MoE, no shared
    expert, no biases): per layer attention (q, o: h x heads d; k, v: h x kv d; Qwen3's q/k
    RMSNorms, d each), the router (E x h), E SwiGLU experts of 3 h i each, two RMSNorms; plus the
    embeddings and the final norm. "active": what one token's forward uses (k experts)."""
    m = _moe(config)
    attention = 2 * m.h * m.heads * m.d + 2 * m.h * m.kv * m.d + (2 * m.d if m.qk_norm else 0)
    expert = 3 * m.h * m.inter
    dense_layer = attention + m.experts * m.h + 2 * m.h  # + the router and the norms
    rest = m.vocab * m.h * (1 if m.tied else 2) + m.h
    total = m.layers * (dense_layer + m.experts * expert) + rest
    return {"total": total, "active": m.layers * (dense_layer + m.k * expert) + rest,
            "per expert": expert, "experts": m.layers * m.experts * expert,
            "dense layer": dense_layer, "rest": rest}


def moe_plan(config, *, gpus: int, ep: int, seq: int, batch: int = 1, ac: str = "full",
             elem: int = 2) -> dict:
    """Bytes per GPU for an MoE with FSDP2 over all `gpus` and expert parallelism over `ep`:
    - "states": the sharded model states, FSDP2 mixed precision (fp32 weights, gradients and
      AdamW's two moments: 16 bytes a parameter) over all GPUs, whatever ep;
    - "gathered layer": one decoder layer's weights gathered in bf16 for compute: its dense part
      and the E/ep experts this GPU runs (FSDP2 gathers a unit at a time, and prefetches one);
    - per step: "fsdp dense" and "fsdp experts" (distkit.memory.communication_bytes: gathered
      in bf16 twice, gradients reduce-scattered in fp32; the experts over the gpus / ep that
      hold the same experts, none when that is 1), and "all-to-all": per layer the tokens'
      hidden states out to their experts and back, forward and backward (and again in the
      recomputed forward with full checkpointing), (ep - 1)/ep of seq x batch x k rows of
      h values each, if the router spreads the tokens evenly."""
    if gpus % ep or _moe(config).experts % ep:
        raise ValueError(f"ep {ep} must divide the gpus ({gpus}) and the experts")
    m, p = _moe(config), moe_params(config)
    efsdp = gpus // ep
    dense = p["total"] - p["experts"]
    rows = seq * batch * m.k
    passes = 6 if ac == "full" else 4  # dispatch + combine, forward (twice with AC) + backward
    return {
        "states": 16 * p["total"] / gpus,
        "gathered layer": elem * (p["dense layer"] + m.experts // ep * p["per expert"]),
        "fsdp dense": communication_bytes(dense, gpus, 3, param_bytes=2, reduce_bytes=4,
                                          gathered_once=p["rest"]) if gpus > 1 else 0.0,
        "fsdp experts": communication_bytes(p["experts"] / ep, efsdp, 3, param_bytes=2,
                                            reduce_bytes=4) if efsdp > 1 else 0.0,
        "all-to-all": m.layers * passes * rows * m.h * elem * (ep - 1) / ep}

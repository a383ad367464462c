"""How many bytes training takes per rank: the formulas chapter 03 checks against torch's trackers.

Pure functions, no torch import. Sizes are in bytes; `GB` is 10^9 bytes, as in the ZeRO paper.
At the end, two helpers that read what a rank measured: a tracker snapshot by category name, and
the bytes of the storages a rank holds.

Sources:
- [ZeRO] Rajbhandari, Rasley, Ruwase, He, "ZeRO: Memory Optimizations Toward Training Trillion
  Parameter Models", SC 2020 (arXiv:1910.02054): model states (section 3.1), the three stages
  and Figure 1 (section 5), communication volume (section 7).
- [Korthikanti] Korthikanti et al., "Reducing Activation Recomputation in Large Transformer
  Models", MLSys 2023 (arXiv:2205.05198, 2022), section 4 and Table 2: activation memory per layer.
- [PaLM] Chowdhery et al., "PaLM: Scaling Language Modeling with Pathways", 2022
  (arXiv:2204.02311), appendix B: model FLOPs per token, for MFU.
- [HF Llama] transformers 5.23, models/llama/modeling_llama.py (LlamaRMSNorm, LlamaAttention,
  LlamaMLP, LlamaDecoderLayer) and loss/loss_utils.py (ForCausalLMLoss): the tensors a Llama
  saves for its backward, which `llama_layer_saved` counts one by one.
- [torch SAC] torch 2.13, torch/utils/checkpoint.py, create_selective_checkpoint_contexts: a
  policy says per operator whether its output is saved or recomputed.

Chapter 03 teaches Korthikanti's per-layer formula (`activation_bytes_per_layer`, GPT-shaped, 16
bit) and `training_bytes`; the Llama-exact model that refines it is `llama_layer_saved`,
`llama_rest_saved` and `llama_training_bytes`, checked tensor by tensor against a real
LlamaDecoderLayer in tests/test_memory.py.
"""
from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

GB = 10**9
GiB = 2**30


# Llama 3.2 1B, Llama 3.1 8B and 70B: their published configurations (config.json on the Hugging
# Face hub), the fields that set the memory, typed in: nothing is downloaded. 1B ties its input
# and output embeddings. LlamaConfig(**LLAMA_CONFIGS["8b"]) builds the config.
LLAMA_CONFIGS = {
    "1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
               num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=True),
    "8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
               num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False),
    "70b": dict(vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                num_attention_heads=64, num_key_value_heads=8, tie_word_embeddings=False),
}


@dataclass(frozen=True)
class Recipe:
    """Bytes per parameter of each model state, on one rank that holds all of them.

    param: the weights the forward uses; grad: their gradients; optimizer: everything else the
    optimizer keeps per parameter (for mixed precision this includes the fp32 master weights).
    """
    name: str
    param: int
    grad: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.param + self.grad + self.optimizer


# fp32 AdamW: weights 4, gradients 4, exp_avg 4 + exp_avg_sq 4.
FP32_ADAMW = Recipe("fp32 AdamW", 4, 4, 8)
# [ZeRO] section 3.1, mixed-precision Adam: fp16 weights 2 and gradients 2; the optimizer keeps
# fp32 master weights, momentum and variance: K = 4 + 4 + 4 = 12. 16 bytes per parameter.
MIXED_ADAMW = Recipe("mixed-precision AdamW (ZeRO's K=12)", 2, 2, 12)
# fp32 SGD with momentum: one 4-byte buffer; plain SGD keeps nothing.
FP32_SGD_MOMENTUM = Recipe("fp32 SGD with momentum", 4, 4, 4)
FP32_SGD = Recipe("fp32 SGD", 4, 4, 0)
RECIPES = {"fp32": FP32_ADAMW, "mixed": MIXED_ADAMW, "sgd-momentum": FP32_SGD_MOMENTUM,
           "sgd": FP32_SGD}

# The same 16 bytes per parameter, named for the frameworks that keep them (review F3):
# PyTorch's DDP / ZeroRedundancyOptimizer with torch.autocast keep fp32 weights and gradients
# (4 + 4) and AdamW's two fp32 moments (8); autocast adds a bf16 copy of every weight it casts,
# held for the backward (an activation term: `llama_layer_saved`, precision "amp"). FSDP2 with
# MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32) keeps the same fp32 shards at rest;
# its bf16 copies are transient (`fsdp2_transient_bytes`). DeepSpeed and Megatron-LM keep bf16
# weights and gradients and fp32 master weights in the optimizer: ZeRO's 2 + 2 + 12.
TORCH_AMP = Recipe("PyTorch AMP / FSDP2 mixed precision (fp32 weights, grads, AdamW)", 4, 4, 8)
DEEPSPEED_MEGATRON = Recipe("DeepSpeed / Megatron-LM bf16 (fp32 master in the optimizer)", 2, 2, 12)
# Pure bf16 AdamW: weights, gradients and both moments in bf16, no fp32 master copy: 8 bytes per
# parameter. An update smaller than half a weight's bf16 spacing (1 + 1e-3 == 1 in bf16) is
# lost, so it needs stochastic rounding or Kahan summation of the updates (review F7).
PURE_BF16_ADAMW = Recipe("pure bf16 AdamW (stochastic rounding or Kahan summation)", 2, 2, 4)
RECIPES.update({"torch-amp": TORCH_AMP, "fsdp2-mixed": TORCH_AMP,
                "deepspeed": DEEPSPEED_MEGATRON, "megatron": DEEPSPEED_MEGATRON,
                "pure-bf16": PURE_BF16_ADAMW})

STAGES = {0: "DDP (no sharding)", 1: "ZeRO-1: optimizer states sharded",
          2: "ZeRO-2: + gradients sharded", 3: "ZeRO-3: + parameters sharded"}


def model_state_bytes(num_params: float, world_size: int, stage: int,
                      recipe: Recipe = MIXED_ADAMW) -> dict[str, float]:
    """Per-rank bytes of parameters, gradients and optimizer state, and their total.

    [ZeRO] section 5.1, with Psi parameters, N data-parallel ranks and K optimizer bytes:
    DDP (stage 0) (2 + 2 + K) Psi; stage 1 (P_os) 2 Psi + 2 Psi + K Psi / N;
    stage 2 (P_os+g) 2 Psi + (2 + K) Psi / N; stage 3 (P_os+g+p) (2 + 2 + K) Psi / N,
    here with any recipe's bytes in place of 2, 2 and K. Shards are Psi / N exactly: FSDP2 pads
    each parameter's first dimension to a multiple of N, flat-buffer implementations (FSDP1,
    DeepSpeed) pad the flat buffer, and ZeRO-1 in torch assigns whole tensors: a little more.
    """
    if stage not in STAGES:
        raise ValueError(f"ZeRO stage must be one of {sorted(STAGES)}, got {stage}")
    if world_size < 1 or num_params < 0:
        raise ValueError("need world_size >= 1 and num_params >= 0")
    n = world_size
    out = {"params": recipe.param * num_params / (n if stage >= 3 else 1),
           "grads": recipe.grad * num_params / (n if stage >= 2 else 1),
           "optimizer": recipe.optimizer * num_params / (n if stage >= 1 else 1)}
    out["total"] = out["params"] + out["grads"] + out["optimizer"]
    return out


def communication_bytes(num_params: float, world_size: int, stage: int,
                        bytes_per_value: int = 2, *, param_bytes: int | None = None,
                        reduce_bytes: int | None = None, gathered_once: float = 0) -> float:
    """Bytes each rank sends per training step for the model states, with ring collectives.

    [ZeRO] section 7: DDP all-reduces the gradients, 2 Psi values per rank (reduce-scatter +
    all-gather, each (N-1)/N Psi). Stages 1 and 2 reduce-scatter the gradients and all-gather
    the updated parameters: the same 2 Psi. Stage 3 all-gathers the parameters twice (forward
    and backward) and reduce-scatters the gradients: 3 Psi, 1.5x DDP. Exact ring factors
    (N-1)/N are kept; the paper rounds them to 1. Values are 2 bytes in mixed precision.

    "1.5x" counts values; in bytes the dtypes differ (review F5): FSDP2's MixedPrecisionPolicy
    (param_dtype=bf16, reduce_dtype=fp32) gathers 2-byte parameters and reduces 4-byte
    gradients, 2 x 2 + 4 = 8 bytes per parameter, DDP's fp32 all-reduce's 2 x 4 = 8 as well.
    `param_bytes` and `reduce_bytes` (default: `bytes_per_value`) set the two; `gathered_once`
    parameters (FSDP2's root with reshard_after_forward=None: embeddings, LM head, final norm)
    are all-gathered for the forward only.
    """
    if stage not in STAGES:
        raise ValueError(f"ZeRO stage must be one of {sorted(STAGES)}, got {stage}")
    ring = (world_size - 1) / world_size
    pb = bytes_per_value if param_bytes is None else param_bytes
    rb = bytes_per_value if reduce_bytes is None else reduce_bytes
    if stage == 0:  # the gradients' all-reduce: a reduce-scatter and an all-gather, reduce dtype
        return 2 * ring * num_params * rb
    gathers = 2 * num_params - gathered_once if stage == 3 else num_params
    return ring * (gathers * pb + num_params * rb)


def activation_bytes_per_layer(seq: int, batch: int, hidden: int, heads: int, *,
                               tensor_parallel: int = 1, sequence_parallel: bool = False,
                               recompute: str = "none") -> float:
    """Activation bytes one transformer layer keeps for its backward, [Korthikanti] Table 2.

    s = seq, b = batch, h = hidden, a = heads, t = tensor-parallel ranks:
    - no recomputation, no parallelism: s b h (34 + 5 a s / h);
    - tensor parallel: s b h (10 + 24/t + 5 a s / (h t));
    - tensor + sequence parallel: s b h (34/t + 5 a s / (h t));
    - selective recomputation (the attention's softmax output, its dropout mask and output are
      recomputed, not stored): the 5 a s / h term goes, e.g. s b h (34/t) with sequence
      parallelism;
    - full recomputation (activation checkpointing of every layer): only the layer's input,
      2 s b h (2 s b h / t with sequence parallelism).

    What it assumes and leaves out: a GPT-style layer (LayerNorm, 4h GELU MLP, dropout with 1-byte
    masks) with 16-bit activations; the attention scores materialised (a fused or flash attention
    kernel keeps none of the 5 a s / h term); Llama's SwiGLU MLP (three matrices, a different
    intermediate size) and RMSNorm, and no dropout, change the constant 34; the embedding, the
    final norm, the logits and the loss; and temporaries that live only inside one operation.
    """
    if recompute not in ("none", "selective", "full"):
        raise ValueError(f"recompute must be none, selective or full, got {recompute!r}")
    s, b, h, a, t = seq, batch, hidden, heads, tensor_parallel
    if recompute == "full":
        return 2 * s * b * h / (t if sequence_parallel else 1)
    scores = 0 if recompute == "selective" else 5 * a * s / (h * t)
    rest = 34 / t if sequence_parallel else 10 + 24 / t
    return s * b * h * (rest + scores)


def llama_params(vocab: int, hidden: int, intermediate: int, layers: int, heads: int,
                 kv_heads: int | None = None, tie_embeddings: bool = False) -> int:
    """Parameters of a transformers LlamaForCausalLM with these dimensions (no biases).

    Per layer: q and o are h x h; k and v are h x (kv_heads * h / heads) (grouped-query
    attention); the SwiGLU MLP has three h x intermediate matrices; two RMSNorm weights of h.
    Plus the embedding (vocab x h), the final norm (h) and the LM head (vocab x h, unless tied).
    """
    kv_heads = kv_heads or heads
    if hidden % heads or heads % kv_heads:
        raise ValueError("hidden must divide by heads, and heads by kv_heads")
    kv = kv_heads * (hidden // heads)
    layer = 2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * intermediate + 2 * hidden
    embeddings = vocab * hidden * (1 if tie_embeddings else 2)
    return layers * layer + embeddings + hidden


def matmul_params(config) -> int:
    """Weights of a Llama-style model that a token meets in a matrix multiply: every linear
    layer (q, k, v, o, the MLP's three) and the LM head, tied or not; the embedding lookup and
    the norms are no matmuls. `config` as in from_config."""
    c = SimpleNamespace(**config) if isinstance(config, dict) else config
    h, q = c.hidden_size, head_dim(c)
    # q and o: h x (heads x head_dim); k and v: h x (kv heads x head_dim)
    layer = 2 * h * c.num_attention_heads * q + 2 * h * c.num_key_value_heads * q \
        + 3 * h * c.intermediate_size
    return c.num_hidden_layers * layer + c.vocab_size * h


def head_dim(c) -> int:
    """The config's head_dim where it has one (Qwen3-0.6B: 128 with hidden 1024 and 16 heads;
    Mistral-Nemo: 128 with 5120 and 32), else hidden_size / heads (Llama: the same number)."""
    return getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads


def flops_per_token(config, seq_len: int) -> int:
    """Model FLOPs of one training token ([PaLM] appendix B): 6 per matmul weight (2 in
    forward, 4 in backward) plus attention's scores and weighted sum, 12 L H Q T, counted over the
    full T x T (as is conventional; a causal model needs half). MFU = this x tokens/s / peak."""
    c = SimpleNamespace(**config) if isinstance(config, dict) else config
    return (6 * matmul_params(config)
            + 12 * c.num_hidden_layers * c.num_attention_heads * head_dim(c) * seq_len)


def from_config(config) -> dict:
    """The calculator's model arguments from a transformers Llama-style config (LlamaConfig,
    anything with the same attribute names, or a dict of them such as LLAMA_CONFIGS["8b"]):
    parameters, layers, hidden size and heads."""
    c = SimpleNamespace(**config) if isinstance(config, dict) else config
    return {"num_params": llama_params(c.vocab_size, c.hidden_size, c.intermediate_size,
                                       c.num_hidden_layers, c.num_attention_heads,
                                       c.num_key_value_heads, c.tie_word_embeddings),
            "layers": c.num_hidden_layers, "hidden": c.hidden_size,
            "heads": c.num_attention_heads}


def training_bytes(num_params: float, *, world_size: int = 1, stage: int = 0,
                   recipe: Recipe = MIXED_ADAMW, layers: int = 0, seq: int = 0,
                   micro_batch: int = 0, hidden: int = 0, heads: int = 0,
                   tensor_parallel: int = 1, sequence_parallel: bool = False,
                   recompute: str = "none") -> dict[str, float]:
    """The calculator: per-rank bytes of each model state (ZeRO stage `stage` over
    `world_size` data-parallel ranks) plus the activations of `layers` transformer layers for one
    micro-batch ([Korthikanti], 16-bit), and the total. Tensor parallelism over
    `tensor_parallel` ranks divides the model states as well (each rank holds 1/t of every
    sharded matrix). Leaves out everything the two formulas leave out (see their docstrings),
    the CUDA context and the allocator's fragmentation; `llama_training_bytes` is the refinement."""
    out = model_state_bytes(num_params / tensor_parallel, world_size, stage, recipe)
    out["activations"] = layers * activation_bytes_per_layer(
        seq, micro_batch, hidden, heads, tensor_parallel=tensor_parallel,
        sequence_parallel=sequence_parallel, recompute=recompute) if layers else 0.0
    out["total"] += out["activations"]
    return out


# --- the Llama-exact model -------------------------------------------------------------------
# What a transformers LlamaForCausalLM saves for its backward, tensor by tensor ([HF Llama]),
# for three ways of computing in 16 bits:
PRECISIONS = {
    "fp32": "everything in float32",
    # torch.autocast(bf16) over fp32 weights (PyTorch AMP): the residual stream and RMSNorm stay
    # fp32; every matmul casts its input and its weight to bf16 (the weight copy is cached)
    "amp": "fp32 weights, torch.autocast(dtype=bfloat16)",
    # FSDP2's MixedPrecisionPolicy(param_dtype=bf16) or model.to(bf16): activations bf16, each
    # RMSNorm upcasts its input to fp32 inside
    "bf16": "bf16 weights in compute (FSDP2 MixedPrecisionPolicy(param_dtype=bfloat16))",
}
ATTENTIONS = {"eager": "softmax(q k^T) v in plain ops: the s x s probabilities are saved",
              "sdpa": "torch's scaled_dot_product_attention (flash): saves a log-sum-exp instead"}
CHECKPOINTING = {"none": "every layer keeps what its backward needs",
                 "selective": "torch's selective checkpointing, SAC_POLICY's operators saved",
                 "full": "each layer keeps its input; the backward recomputes its forward"}
# The named policy of selective checkpointing (as torchtitan's "op" mode, without its
# every-other-matmul rule): save the outputs of the matmuls and of the fused attention,
# recompute the rest (norms, rotary embedding, SwiGLU's pointwise ops); `sac_context_fn`.
SAC_POLICY = ("aten.mm.default", "aten._scaled_dot_product_flash_attention.default",
              "aten._scaled_dot_product_flash_attention_for_cpu.default",
              "aten._scaled_dot_product_efficient_attention.default",
              "aten._scaled_dot_product_cudnn_attention.default")


def sac_context_fn():
    """The `context_fn` for torch.utils.checkpoint.checkpoint(use_reentrant=False) that applies
    SAC_POLICY: pass it in activation_checkpointing_kwargs["context_fn"]."""
    import functools

    import torch
    from torch.utils.checkpoint import create_selective_checkpoint_contexts
    ops = [getattr(getattr(torch.ops.aten, name.split(".")[1]), "default") for name in SAC_POLICY
           if hasattr(torch.ops.aten, name.split(".")[1])]
    return functools.partial(create_selective_checkpoint_contexts, ops)


def _llama(config):
    c = SimpleNamespace(**config) if isinstance(config, dict) else config
    head = c.hidden_size // c.num_attention_heads
    return SimpleNamespace(h=c.hidden_size, i=c.intermediate_size, a=c.num_attention_heads,
                           kv=c.num_key_value_heads * head, head=head, v=c.vocab_size,
                           layers=getattr(c, "num_hidden_layers", 0),
                           tied=getattr(c, "tie_word_embeddings", False))


def _check(precision, attn, ac):
    for value, known in ((precision, PRECISIONS), (attn, ATTENTIONS), (ac, CHECKPOINTING)):
        if value not in known:
            raise ValueError(f"{value!r}: choose from {', '.join(known)}")


def llama_layer_saved(config, seq: int, batch: int, *, precision: str = "bf16",
                      attn: str = "sdpa", ac: str = "none", tensor_parallel: int = 1,
                      sequence_parallel: bool = False) -> dict:
    """Bytes one LlamaDecoderLayer keeps for its backward, by tensor: {what: bytes}.

    T = seq x batch tokens, h hidden, kv = key/value heads x head size (grouped-query), i the
    MLP's intermediate size, a heads; p = 4 bytes in fp32, else 2.
    - ac "none", per layer: two RMSNorms, each saving its fp32 input (the fp32 residual, or in
      bf16 its fp32 upcast) 4Th, the fp32 1/rms 4T and the normalised x (4Th; bf16: 2Th); the
      matmuls' inputs (fp32 and bf16: each norm's output once, pTh; amp: each of the five
      q/k/v/gate/up casts its own bf16 copy, 2Th); the attention (below); SwiGLU's gate, up,
      silu(gate) and product at the intermediate size, 4pTi; with amp, autocast's bf16 copies
      of the seven weight matrices.
    - attention "sdpa": q pTh, k and v pT kv each (not repeated to every head), the output pTh
      (o_proj's input) and an fp32 log-sum-exp per head and token, 4Ta. "eager": q and k, v
      repeated to all heads 3pTh, o_proj's input pTh, and the probabilities b a s^2 in fp32
      (4 bytes; amp and bf16 also keep their bf16 cast: 6).
    - ac "full": the layer's input only (the residual: fp32 but in bf16).
    - ac "selective" (SAC_POLICY): the input, the seven matmul outputs (q, k, v, o, gate, up,
      down: p(3Th + 2T kv + 2Ti)) and, with sdpa, the attention's output and log-sum-exp.
    Tensor parallelism (t ranks, Megatron's column/row split, no sequence parallelism) divides
    what lives per head or per intermediate column by t; the norms and the matmul inputs are
    replicated. `sequence_parallel` (torchtitan's plan: SequenceParallel norms between the
    column/row-parallel matmuls) splits the tokens of what runs between them: the norms' saved
    tensors and the layer's input (the residual) are divided by t; the matmuls' inputs are not
    (DTensor all-gathers the norm's output and the matmul saves the gathered tensor; Megatron-LM
    keeps the shard and gathers again in the backward: 1/t there). A model, not simulated
    (simulate_fsdp.py's --tp is Megatron's plan without it).
    Not counted: temporaries that live inside one operator, and the tensors the
    backward of a recomputed layer holds (`llama_training_bytes` adds one recomputed layer).
    """
    _check(precision, attn, ac)
    m, t = _llama(config), tensor_parallel
    T, p = seq * batch, 4 if precision == "fp32" else 2
    residual = 2 if precision == "bf16" else 4
    sp = t if sequence_parallel else 1  # what runs on T / t tokens under sequence parallelism
    if ac == "full":
        return {"layer input": residual * T * m.h // sp}
    if ac == "selective":
        out = {"layer input": residual * T * m.h // sp,
               "matmul outputs (q, k, v, o, gate, up, down)":
                   p * T * (m.h + 2 * m.kv + 2 * m.i) // t + 2 * p * T * m.h}  # o, down: full h
        if attn == "sdpa":
            out["attention output and log-sum-exp"] = (p * T * m.h + 4 * T * m.a) // t
        return out
    out = {"2 RMSNorms: fp32 input, 1/rms, normalised":
               2 * (4 * T * m.h + 4 * T + (2 if precision == "bf16" else 4) * T * m.h) // sp,
           "matmul inputs": (5 * 2 if precision == "amp" else 2 * p) * T * m.h}
    if attn == "sdpa":
        out["q, k, v"] = p * T * (m.h + 2 * m.kv) // t
        out["attention output, log-sum-exp"] = (p * T * m.h + 4 * T * m.a) // t
    else:
        out["q, k, v (k and v repeated to every head)"] = 3 * p * T * m.h // t
        out["o_proj's input (transposed copy)"] = p * T * m.h // t
        out["attention probabilities"] = (4 if precision == "fp32" else 6) * batch * m.a \
            * seq * seq // t
    out["SwiGLU: gate, up, silu, product"] = 4 * p * T * m.i // t
    if precision == "amp":
        out["autocast's bf16 weight copies"] = 2 * (2 * m.h * m.h + 2 * m.h * m.kv
                                                   + 3 * m.h * m.i) // t
    return out


def llama_rest_saved(config, seq: int, batch: int, *, precision: str = "bf16",
                     ac: str = "none", vocab_parallel: int = 1, loss_chunks: int = 1) -> dict:
    """Bytes the rest of a LlamaForCausalLM keeps for its backward, outside its decoder layers.

    The token ids and the shifted labels (int64, 8T each); the final RMSNorm (as a layer's);
    the LM head's input (fp32 4Th; bf16 2Th; amp its bf16 copy, 2Th, and autocast's bf16 copy
    of the head's weight, 2Vh); the loss: transformers' ForCausalLMLoss upcasts the logits to
    fp32 and cross_entropy keeps its log-softmax, 4TV, and a 4-byte total weight; the rotary
    cos and sin (s x head size each, shared by every layer; fp32 but in bf16), saved by the
    layers' ops without checkpointing. The logits themselves are not saved: `llama_training_bytes`
    adds them where they are alive.
    `vocab_parallel` = t ranks (torchtitan's loss_parallel: the LM head split by vocabulary, the
    final norm sequence-parallel) divides the final norm and the log-softmax by t; `loss_chunks`
    = c (a chunked or fused linear + cross-entropy that holds T / c tokens' logits at a time)
    divides the log-softmax by c. Both modelled, not simulated.
    """
    _check(precision, "sdpa", ac)
    m, T = _llama(config), seq * batch
    lowp = precision != "fp32"
    t, c = vocab_parallel, loss_chunks
    out = {"token ids and labels": 16 * T,
           "final RMSNorm": (4 * T * m.h + 4 * T + (2 if precision == "bf16" else 4) * T * m.h)
           // t,
           "LM head's input": (2 if lowp else 4) * T * m.h,
           "log-softmax of the fp32 logits (the loss)": 4 * T * m.v // (t * c) + 4}
    if precision == "amp":
        out["autocast's bf16 copy of the LM head"] = 2 * m.v * m.h
    if ac == "none":
        out["rotary cos, sin"] = 2 * seq * m.head * (2 if precision == "bf16" else 4)
    return out


def llama_parts(config) -> dict:
    """Parameters of one decoder layer and of FSDP2's root module (embedding, LM head unless
    tied, final norm): the units fully_shard gathers one at a time."""
    m = _llama(config)
    layer = 2 * m.h * m.h + 2 * m.h * m.kv + 3 * m.h * m.i + 2 * m.h
    return {"layer": layer, "root": m.v * m.h * (1 if m.tied else 2) + m.h}


def llama_training_bytes(config, *, ranks: int, seq: int, batch: int, precision: str = "bf16",
                         attn: str = "sdpa", ac: str = "none", recipe: Recipe = FP32_ADAMW,
                         tensor_parallel: int = 1, pipeline_parallel: int = 1,
                         sequence_parallel: bool = False, in_flight: int = 1,
                         cpu_offload: bool = False, loss_chunks: int = 1,
                         unsharded_grads: bool = False, accumulated: bool = False) -> dict:
    """Bytes on one FSDP2 rank at the peak of a training step, by FSDPMemTracker's categories.

    FSDP2 shards every decoder layer and the root over `ranks` (reshard_after_forward: layers
    True, the root None, so the root stays gathered); the step is the steady state (AdamW's
    state exists). Weights are gathered and gradients computed in the compute dtype (bf16 with
    precision "bf16", MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)), gradients
    reduce-scattered in fp32. The total is evaluated at each moment where it can peak and the
    largest is returned, with "moment" naming it:
    - "loss backward": every layer's saved tensors and the rest's (`llama_layer_saved`,
      `llama_rest_saved`), the gathered root, the top layer prefetched ("All Gather"), and
      cross-entropy's two fp32 gradients of the logits, 8TV ("Temp");
    - "layer j backward" (j = 0 the top): the saved tensors of the L - j layers not yet done, less
      the SwiGLU product (down_proj's input, freed first); the root and layer j gathered, the
      next one prefetched, the previous one's fp32 reduce-scatter input, j layers of sharded
      gradients; in "Temp" the root's gradients (LM head, final norm) and the MLP backward's
      own: the residual's gradient, three intermediate-size gradients (product, silu, gate/up),
      down_proj's weight gradient; with checkpointing, the recomputed layer's tensors too;
    - "layer j weight gradients": the end of that layer's backward, where its seven weight
      gradients are all alive (FSDP2 reduce-scatters a layer's gradients together) and its
      saved tensors gone but the first RMSNorm's and the q/k/v input; four gradients of the
      residual's size in flight (a count read off the 70B simulation, where this moment is the
      peak: weight gradients outgrow a layer's activations when h i > T (h + i));
    - "embedding backward": every layer's sharded gradients, the root's gradients (LM head and
      embedding; tied: the two and their sum) and the bottom layer's reduce-scatter input;
    - "root reduce-scatter": the root's gradients and, in bf16, their fp32 copy to reduce.
    Tensor parallelism (t ranks, the decoder layers split as in `llama_layer_saved`, the root
    whole on every tp rank and sharded over the `ranks` data-parallel ranks only) divides the
    layers' states and activations by t; pipeline parallelism (pp stages) the layers per rank,
    the root counted whole (a first or last stage holds part of it); `in_flight` micro-batches'
    activations live on the stage at once (1F1B: the first stage holds min(pp, micro-batches),
    so L / pp layers x pp = the whole model's layers for one micro-batch). Under pp > 1 FSDP2
    keeps the stage gathered and its gradients unsharded from the first micro-batch to the
    last (torchtitan: reshard_after_forward=False with PP; torch.distributed.pipelining's
    stage.py: set_requires_gradient_sync(False) until its REDUCE_GRAD action), the gradients
    accumulated in the reduce dtype (fp32; _fsdp_param.py, to_accumulated_grad_if_needed).
    Options that no simulation here checks (modelled from what they do, with pp and in_flight):
    - `sequence_parallel` (with t > 1: torchtitan's plan, SequenceParallel norms and a
      vocabulary-parallel embedding, LM head and loss): the root is split by t as well, with the
      logits' terms; the layers as in `llama_layer_saved`;
    - `cpu_offload` (FSDP2's CPUOffloadPolicy): the sharded parameters, their gradients and
      AdamW's state live in host memory ("CPU", not in "Total");
    - `loss_chunks` = c: a chunked or fused linear + cross-entropy holds T / c tokens' fp32
      logits, their log-softmax and gradients at a time;
    - `unsharded_grads`: gradient accumulation without a reduce-scatter per micro-batch
      (FSDP2's set_requires_gradient_sync(False) until the last micro-batch: train_llama.py's
      default; `--sync-every-microbatch` turns it off): every parameter's gradient of this rank's
      layers and root stays unsharded, in the reduce dtype (fp32, _fsdp_param.py,
      to_accumulated_grad_if_needed), from the first micro-batch's backward to the last's: 4
      bytes per parameter, not divided by the ranks, at every moment of the last micro-batch
      (as pp > 1 adds them);
    - `accumulated` (gradient accumulation with a reduce-scatter per micro-batch, train_llama.py's
      --sync-every-microbatch): the earlier micro-batches' fp32 gradient shards exist through
      the last one's backward, 4 bytes per parameter / ranks at every moment.
    Both checked against FSDPMemTracker on a small Llama, two micro-batches on 8 fake ranks
    (tests/test_plan_cli.py, second_nproc): within 1 % of the tracked peak.
    Sizes in bytes per rank; FSDP2 pads shards to a multiple of `ranks` (ignored here: < 0.1 %).
    Checked against simulate_fsdp.py (tests/test_ch03_scripts.py) for fp32 and bf16, sdpa and
    eager, every checkpointing mode, t = 2 on one point; precision "amp" and pp > 1 are not.
    """
    _check(precision, attn, ac)
    m, parts = _llama(config), llama_parts(config)
    t, pp, n, T = tensor_parallel, pipeline_parallel, ranks, seq * batch
    L = m.layers // pp
    pb = 2 if precision == "bf16" else 4  # gathered weights and their gradients
    p, r = (4 if precision == "fp32" else 2), (2 if precision == "bf16" else 4)
    vp = t if sequence_parallel else 1  # the root split by vocabulary, or whole on each tp rank
    c = loss_chunks
    layer, root = parts["layer"] // t, parts["root"] // vp
    saved = sum(llama_layer_saved(config, seq, batch, precision=precision, attn=attn, ac=ac,
                                  tensor_parallel=t, sequence_parallel=sequence_parallel).values())
    full = sum(llama_layer_saved(config, seq, batch, precision=precision, attn=attn,
                                 tensor_parallel=t, sequence_parallel=sequence_parallel).values())
    rest = llama_rest_saved(config, seq, batch, precision=precision, ac=ac, vocab_parallel=vp,
                            loss_chunks=c)
    tokens = rest["token ids and labels"]
    states = model_state_bytes(m.layers * parts["layer"] / (t * pp) + root, n, 3, recipe)
    waiting = (in_flight - 1) * L * saved  # other micro-batches' activations on this stage
    # checkpointed layers hold their arguments: the rotary cos and sin (saved by ops otherwise)
    held = 2 * seq * m.head * r if ac != "none" else 0
    base = {"Sharded Param": states["params"], "OptState": states["optimizer"],
            "Inputs": tokens // 2}
    moments = {"loss backward": {
        "Unsharded Param": root * pb, "All Gather": layer * pb if L else 0,
        "Activation": L * saved + sum(rest.values()) + held - tokens + waiting,
        "Temp": 8 * T * m.v // (vp * c)}}
    head = (m.v * m.h // vp + m.h) * pb  # the root's gradients after the LM head's backward
    mlp_backward = r * T * m.h + 3 * p * T * m.i // t + m.h * m.i * pb // t
    # checkpointing: the layer's forward runs again and its tensors live through its backward
    # but what selective checkpointing cached (already in saved), its SwiGLU product freed as
    # above, and the rerun input's gradient, r T h, on top
    recompute = full - (saved - r * T * m.h) - p * T * m.i // t + r * T * m.h if ac != "none" \
        else 0
    for j in range(L):
        moments[f"layer {j} backward"] = {
            "Unsharded Param": (root + layer) * pb, "All Gather": layer * pb if j < L - 1 else 0,
            "Reduce Scatter": layer * 4 if j else 0, "Sharded Grad": j * layer * 4 // n,
            "Activation": (L - j) * saved + rest.get("rotary cos, sin", held)
            - (p * T * m.i // t if ac == "none" else 0) + waiting,
            "Temp": head + mlp_backward + recompute}
        # the same layer at the end of its backward: its seven weight gradients all alive (FSDP2
        # reduce-scatters them together), its saved tensors freed but the first RMSNorm's and
        # the q/k/v input; four gradients of the residual's size in flight
        first_norm = (4 * T * m.h + 4 * T + (2 if precision == "bf16" else 4) * T * m.h
                      + (2 if precision == "bf16" else p) * T * m.h) if ac == "none" else 0
        moments[f"layer {j} weight gradients"] = {
            **moments[f"layer {j} backward"],
            "Activation": (L - j - 1) * saved + first_norm + (saved if ac != "none" else 0)
            + rest.get("rotary cos, sin", held) + waiting,
            "Temp": head + layer * pb + 4 * r * T * m.h + (
                4 * T * m.h + 4 * T + 4 * T * m.h + p * T * m.h if ac != "none" else 0)}
    moments["embedding backward"] = {
        "Unsharded Param": root * pb, "Reduce Scatter": layer * 4,
        "Sharded Grad": L * layer * 4 // n,
        "Temp": (3 if m.tied else 2) * m.v * m.h // vp * pb + m.h * pb}
    moments["root reduce-scatter"] = {  # the root's gradients, and their fp32 copy to reduce
        "Sharded Grad": L * layer * 4 // n, "Unsharded Grad": root * pb,
        "Temp": root * 4 if pb != 4 else 0}
    if pp > 1:  # the stage stays gathered, its fp32 gradients unsharded, through the step
        for v in moments.values():
            v.update({"Unsharded Param": (root + L * layer) * pb, "All Gather": 0,
                      "Reduce Scatter": 0, "Unsharded Grad": L * layer * 4})
    elif unsharded_grads:  # accumulation without sync: every fp32 gradient unsharded, held
        for v in moments.values():
            v["Unsharded Grad"] = (L * layer + root) * 4
    elif accumulated:  # accumulation with sync: the earlier micro-batches' gradient shards
        for v in moments.values():
            v["Sharded Grad"] = (L * layer + root) * 4 // n
    host = ("Sharded Param", "OptState", "Sharded Grad") if cpu_offload else ()
    totals = {k: sum(b for c, b in {**base, **v}.items() if c not in host)
              for k, v in moments.items()}
    moment = max(totals, key=totals.get)
    out = {**base, **moments[moment]}
    if cpu_offload:  # FSDP2's CPUOffloadPolicy: the shards and AdamW's state in host memory
        out["CPU"] = sum(out.pop(c, 0) for c in host)
    out["Total"] = sum(v for k, v in out.items() if k != "CPU")
    out["moment"] = moment
    return out


def by_category(snapshot: dict, device) -> dict:
    """A MemTracker / FSDPMemTracker snapshot of one device, keyed by category name ("Parameter",
    "Sharded Grad", "OptState", "Total", ...): the trackers key it by enums."""
    return {str(getattr(k, "value", k)): v for k, v in snapshot[device].items()}


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind these tensors (a DTensor: its local shard; None is
    skipped): views of one storage count once, padding and bucket buffers in full. What a rank
    really holds, where the tensors' own sizes would miss padding or count shared buffers twice."""
    storages = {}
    for t in tensors:
        if t is None:
            continue
        t = t.to_local() if hasattr(t, "to_local") else t  # a DTensor: this rank's shard
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(storages.values())

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
                        bytes_per_value: int = 2) -> float:
    """Bytes each rank sends per training step for the model states, with ring collectives.

    [ZeRO] section 7: DDP all-reduces the gradients, 2 Psi values per rank (reduce-scatter +
    all-gather, each (N-1)/N Psi). Stages 1 and 2 reduce-scatter the gradients and all-gather
    the updated parameters: the same 2 Psi. Stage 3 all-gathers the parameters twice (forward
    and backward) and reduce-scatters the gradients: 3 Psi, 1.5x DDP. Exact ring factors
    (N-1)/N are kept; the paper rounds them to 1. Values are 2 bytes in mixed precision.
    """
    if stage not in STAGES:
        raise ValueError(f"ZeRO stage must be one of {sorted(STAGES)}, got {stage}")
    one_pass = (world_size - 1) / world_size * num_params * bytes_per_value
    return (3 if stage == 3 else 2) * one_pass


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
    h, kv = c.hidden_size, c.num_key_value_heads * (c.hidden_size // c.num_attention_heads)
    layer = 2 * h * h + 2 * h * kv + 3 * h * c.intermediate_size
    return c.num_hidden_layers * layer + c.vocab_size * h


def flops_per_token(config, seq_len: int) -> int:
    """Model FLOPs of one training token ([PaLM] appendix B): 6 per matmul weight (2 in
    forward, 4 in backward) plus attention's scores and weighted sum, 12 L H Q T, counted over the
    full T x T (as is conventional; a causal model needs half). MFU = this x tokens/s / peak."""
    c = SimpleNamespace(**config) if isinstance(config, dict) else config
    head_dim = c.hidden_size // c.num_attention_heads
    return (6 * matmul_params(config)
            + 12 * c.num_hidden_layers * c.num_attention_heads * head_dim * seq_len)


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
    micro-batch ([Korthikanti], 16-bit), and the total. Leaves out everything the two formulas
    leave out (see their docstrings), the CUDA context and the allocator's fragmentation."""
    out = model_state_bytes(num_params, world_size, stage, recipe)
    out["activations"] = layers * activation_bytes_per_layer(
        seq, micro_batch, hidden, heads, tensor_parallel=tensor_parallel,
        sequence_parallel=sequence_parallel, recompute=recompute) if layers else 0.0
    out["total"] += out["activations"]
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

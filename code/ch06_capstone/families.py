"""Model families for the capstone: any transformers decoder-only causal LM whose decoder layers are
a list, dense or mixture of experts, from a local folder (config.json [+ weights]) or a config.

train_llama.py shards a model layer by layer, so it needs four things from it, whatever the
family: the decoder layers (one FSDP unit each), the token embedding and the lm_head (whether
they are one tensor: tied), and, for a mixture of experts, each layer's experts and router (for
expert parallelism). transformers 5.23 lays every family below out the same way:

    model.model.embed_tokens      nn.Embedding (Gemma: scaled by sqrt(hidden), a buffer)
    model.model.layers            nn.ModuleList of decoder layers
    model.model.norm              the final norm
    model.lm_head                 nn.Linear; the same Parameter as embed_tokens.weight if tied
    layer.mlp.experts, .gate      MoE only (Qwen3-MoE, Mixtral): experts as two 3-D tensors
                                  gate_up_proj (E, 2I, H) and down_proj (E, H, I); the router
                                  a (E, H) weight, softmax, top-k

`parts(model)` returns them through transformers' own accessors (get_decoder,
get_input_embeddings, get_output_embeddings), so a family not listed here works when it has the
same shape; `FAMILIES` holds a tiny config per family for tests and CPU runs.

Tied embeddings (Gemma, Qwen2/Qwen3 small models, Llama 3.2 1B/3B): the lm_head's weight IS the
embedding's Parameter. FSDP2 manages a Parameter in exactly one unit, which all-gathers it before
that unit's forward and frees it after: with the embedding in a unit of its own, the lm_head (in
the root, at the end of the forward) would use a parameter the embedding's unit has freed, and
its gradient would be reduced twice. torch 2.13 refuses it at the first forward ("ValueError:
Parameter 'model.embed_tokens.weight' is shared with a parameter already managed by another FSDP
group", measured). So the embedding and the lm_head go in one unit: `fsdp_units` puts both in
the root (with the final norm), as train_llama.py's apply_fsdp does; untied, the embedding may
get a unit of its own (torchtitan does: its weights need not stay gathered until the lm_head).
Tied weights stay one Parameter through fully_shard and to_empty (family_parity.py checks it);
a model NOT sharded loses the tie in to_empty (each module gets its own empty tensor): call
model.tie_weights() after it, or load the full model as is.

Meta-device initialisation (chapter 04) leaves the buffers no state dict holds uninitialised
after to_empty: the rotary embedding's inv_freq (every family; Gemma 3 has one per layer type)
and Gemma's embed_scale (sqrt(hidden)). `restore_buffers` refills every such buffer, whatever its
name, from a model built with its parameters on the meta device and its buffers real.
"""
from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass, field

import torch
from torch import nn

# A tiny config per family (transformers model_type -> the fields that differ from the shared
# ones below): two layers, 32 wide, GQA (4 query heads, 2 key/value heads); head_dim is always
# hidden / heads (several families default to a fixed 128 or 256). The real models' configs come
# from their folders (config.json), never from here.
TINY = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5}
FAMILIES = {
    "llama": {"tie_word_embeddings": False},
    "qwen2": {"tie_word_embeddings": True},  # Qwen2.5 0.5B-3B tie; attention has q/k/v biases
    "qwen3": {"tie_word_embeddings": False},  # q/k norms
    "mistral": {"tie_word_embeddings": False},
    "gemma2": {},  # tied (its default), logit soft-capping, eager attention
    "gemma3_text": {"sliding_window": 8},  # tied; sliding and full layers alternate
    "qwen3_moe": {"num_experts": 4, "num_experts_per_tok": 2, "tie_word_embeddings": False},
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2,
                "tie_word_embeddings": False},
}
MOE = ("qwen3_moe", "mixtral")


class UnsupportedModel(ValueError):
    """A model this recipe cannot shard layer by layer: the message is one line."""


def tiny_config(family: str = "llama", vocab_size: int = 96, seq_len: int = 64, **overrides):
    """A config of `family` (a key of FAMILIES): TINY's shape, or another given as overrides
    (e.g. train_llama.py's PRESETS: hidden_size, intermediate_size, heads, layers, ...);
    head_dim = hidden / heads, Qwen3-MoE's experts half the dense width; use_cache off
    (training never generates)."""
    from transformers import AutoConfig
    if family not in FAMILIES:
        raise UnsupportedModel(f"unknown family {family!r}; tiny configs exist for "
                               f"{', '.join(FAMILIES)}")
    fields = {**TINY, **FAMILIES[family], **overrides}
    fields.setdefault("head_dim", fields["hidden_size"] // fields["num_attention_heads"])
    if family == "qwen3_moe":
        fields.setdefault("moe_intermediate_size", fields["intermediate_size"] // 2)
    if family == "gemma3_text":  # (the real ones: 5 sliding, then 1 full)
        fields.setdefault("layer_types", ["sliding_attention", "full_attention"]
                          * (fields["num_hidden_layers"] // 2)
                          + ["sliding_attention"] * (fields["num_hidden_layers"] % 2))
    config = AutoConfig.for_model(family, vocab_size=vocab_size, max_position_embeddings=seq_len,
                                  **fields)
    config.use_cache = False
    return config


def load_config(model_path: str):
    """The config of a local Hugging Face folder (nothing downloaded), checked: a decoder-only
    causal LM whose layers are a list. Bad input: UnsupportedModel, one line."""
    from transformers import AutoConfig
    path = os.path.join(model_path, "config.json")
    if not os.path.isfile(path):
        raise UnsupportedModel(f"{model_path}: no config.json (a Hugging Face model folder has "
                               "config.json, *.safetensors and the tokenizer's files)")
    try:
        config = AutoConfig.from_pretrained(model_path, local_files_only=True)
    except (ValueError, KeyError, OSError, json.JSONDecodeError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UnsupportedModel(f"{path}: {first}") from None
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModel(f"{path}: {config.model_type} is an encoder-decoder model; this "
                               "recipe trains decoder-only causal LMs")
    config.use_cache = False
    try:
        skeleton(config)  # a causal LM with a list of layers?
    except UnsupportedModel as e:
        raise UnsupportedModel(f"{path}: {e}") from None
    return config


def skeleton(config):
    """The model on the meta device: shapes only, no memory, no random numbers."""
    from transformers import AutoModelForCausalLM
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    except ValueError:  # "Unrecognized configuration class ... for AutoModelForCausalLM"
        raise UnsupportedModel(f"{config.model_type}: transformers has no causal LM for this "
                               "model type (AutoModelForCausalLM)") from None
    parts(model)  # checks the layout
    return model


def build(config, model_path: str | None = None, seed: int = 0, rank: int = 0):
    """(the model on the meta device, rank 0's full fp32 state dict or {}): train_llama.py's
    build_model for any family. Rank 0 alone holds a full copy (seeded, or --model-path's
    weights), which set_model_state_dict(..., broadcast_from_rank0=True) hands out shard by
    shard after fully_shard and to_empty; then restore_buffers."""
    from transformers import AutoModelForCausalLM
    full_state = {}
    if rank == 0:
        if model_path:
            full = AutoModelForCausalLM.from_pretrained(model_path, config=config,
                                                        dtype=torch.float32,
                                                        local_files_only=True)
        else:
            torch.manual_seed(seed)
            full = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        full_state = full.state_dict()
    return skeleton(config), full_state


@dataclass
class MoELayer:
    """One decoder layer's mixture of experts: `experts` holds every expert's weights as 3-D
    tensors (`gate_up_proj` (E, 2I, H), `down_proj` (E, H, I)); `router` maps a token to E
    logits (`weight` (E, H)), then softmax, top-k (`top_k`), renormalised or not. Expert
    parallelism shards `experts` over an ep dimension and sends each token's rows to the ranks
    of its top-k experts (chapter 09, distkit.moe)."""
    index: int
    block: nn.Module
    experts: nn.Module
    router: nn.Module
    num_experts: int
    top_k: int


@dataclass
class Parts:
    """What the recipe shards and how: see the module's docstring."""
    family: str
    layers: nn.ModuleList
    embed: nn.Module
    lm_head: nn.Module
    norm: nn.Module | None
    tied: bool
    moe: list[MoELayer] = field(default_factory=list)


def parts(model) -> Parts:
    """The decoder layers, embedding, lm_head, final norm, tied or not, and the MoE layers of a
    transformers causal LM. UnsupportedModel (one line) if its layers are not a list."""
    family = model.config.model_type
    decoder = model.get_decoder()
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, nn.ModuleList):  # another name (GPT-2: transformer.h): the list
        # of the blocks transformers itself never splits across devices
        blocks = set(getattr(model, "_no_split_modules", None) or [])
        layers = next((m for m in decoder.children() if isinstance(m, nn.ModuleList) and len(m)
                       and all(type(b).__name__ in blocks for b in m)), None)
    if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
        raise UnsupportedModel(f"{family} ({type(model).__name__}): no list of decoder layers "
                               "at model.get_decoder().layers; this recipe shards layer by layer")
    embed, lm_head = model.get_input_embeddings(), model.get_output_embeddings()
    if embed is None or lm_head is None:
        raise UnsupportedModel(f"{family}: no input embedding or no lm_head")
    moe = []
    for i, layer in enumerate(layers):
        block = getattr(layer, "mlp", None) or getattr(layer, "block_sparse_moe", None)
        experts, router = getattr(block, "experts", None), getattr(block, "gate", None)
        if experts is not None and router is not None:
            moe.append(MoELayer(i, block, experts, router, router.num_experts, router.top_k))
    return Parts(family=family, layers=layers, embed=embed, lm_head=lm_head,
                 norm=getattr(decoder, "norm", None),
                 tied=lm_head.weight is embed.weight, moe=moe)


def fsdp_units(model, embedding_unit: bool = False) -> list[nn.Module]:
    """The modules to fully_shard, in order (the root last): one per decoder layer, then, only if
    asked and the embeddings are untied, the embedding; then the model (root: embedding if not
    sharded already, final norm, lm_head). Tied embeddings never get a unit of their own: the
    lm_head uses the same Parameter after the layers, and FSDP2 keeps a Parameter in one unit."""
    p = parts(model)
    units = list(p.layers)
    if embedding_unit and not p.tied:
        units.append(p.embed)
    return units + [model]


@contextlib.contextmanager
def _parameters_on_meta():
    """Modules built inside get their parameters on the meta device and their buffers real
    (computed by their __init__ from the config: inv_freq, embed_scale)."""
    register = nn.Module.register_parameter

    def on_meta(module, name, param):
        if param is not None:
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)
    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def restore_buffers(model, config, device=None) -> list[str]:
    """After to_empty: fill every non-persistent buffer (one no state dict holds, so no load
    fills it) with the value a fresh model computes from `config`. Returns their names."""
    from transformers import AutoModelForCausalLM
    with _parameters_on_meta():
        fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    values = dict(fresh.named_buffers())
    names = []
    for module_name, module in model.named_modules():
        for name in module._non_persistent_buffers_set:
            full = f"{module_name}.{name}" if module_name else name
            buffer = getattr(module, name)
            with torch.no_grad():
                buffer.copy_(values[full].to(device or buffer.device, buffer.dtype))
            names.append(full)
    return names


def tokens_per_expert(router_logits, top_k: int) -> torch.Tensor:
    """(MoE layers, experts) int64: how many of a forward's token slots each expert got, from
    the router logits a model returns with output_router_logits=True (one (tokens, E) tensor
    per MoE layer; each token picks its top_k). Every row sums to tokens x top_k; an even load
    is tokens x top_k / E per expert. Padding tokens are routed and counted too."""
    return torch.stack([torch.bincount(logits.detach().topk(top_k, dim=-1).indices.flatten(),
                                       minlength=logits.shape[-1]) for logits in router_logits])


def aux_loss_term(output, config, pieces: int) -> torch.Tensor:
    """The load-balancing loss to add to a piece's global-token loss, as model(labels=...) adds it
    to its own mean (router_aux_loss_coef x aux_loss; transformers' aux_loss is the mean over
    the piece's tokens, E sum f_e P_e, even routing = top_k). Under summed gradients
    (distkit.tokens.sum_gradients), each of the step's `pieces` (data-parallel ranks x
    micro-batches) adds 1/pieces of it: the step adds the mean of the pieces' aux losses. That
    is NOT exactly one process's on the whole batch (f_e P_e is a product of two means over a
    piece's tokens): a parity test must leave it out or compare the same pieces (a global
    version would all-reduce f_e and P_e over the pieces first). Needs the forward's
    output_router_logits=True; 0 for a dense model."""
    aux = getattr(output, "aux_loss", None)
    if aux is None:
        return torch.zeros(())
    return getattr(config, "router_aux_loss_coef", 0.0) * aux / pieces


def describe(model) -> str:
    """One line: family, parameters (total and, for MoE, active per token), layers, tied."""
    p = parts(model)
    total = sum(q.numel() for q in model.parameters())
    text = f"{p.family}: {total:,} parameters, {len(p.layers)} layers"
    if p.moe:
        expert = sum(q.numel() for m in p.moe for q in m.experts.parameters())
        active = total - expert + expert * p.moe[0].top_k // p.moe[0].num_experts
        text += (f", {len(p.moe)} MoE layers of {p.moe[0].num_experts} experts (top-"
                 f"{p.moe[0].top_k}): {active:,} active per token")
    return text + (", tied embeddings" if p.tied else "")

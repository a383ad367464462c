"""Tensor-parallel plans for the tiny Llama's decoder layers (Megatron-LM's column/row split).

Chapter 02 (ch02_model_parallel/tensor_parallel.py) teaches them and checks each against the
unsharded model; chapter 04 (ch04_fsdp2/fsdp2_2d.py) reuses the "megatron" plan on the tp
dimension of a 2D mesh before sharding with FSDP2 on the other. One copy, so both run the same
plan.
"""
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput,
                                               PrepareModuleOutput, RowwiseParallel,
                                               SequenceParallel, parallelize_module)

PLANS = ["naive", "megatron", "sequence", "vocab"]


def layer_plan(plan: str) -> dict:
    """One decoder layer's plan: Megatron's column/row split of attention and MLP."""
    seq = plan == "sequence"
    out = Shard(1) if seq else Replicate()  # the blocks' output: sequence-sharded or whole
    style = {"self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
             # output features = heads: heads/N each, and LlamaAttention reshapes to
             # (B, S, -1, head_dim), so the local heads just work
             "self_attn.v_proj": ColwiseParallel(),
             "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
             # input features split: each rank's output is a partial sum, all-reduced (or,
             # with sequence parallelism, reduce-scattered over the sequence)
             "self_attn.o_proj": RowwiseParallel(output_layouts=out, use_local_output=not seq),
             "mlp.down_proj": RowwiseParallel(output_layouts=out, use_local_output=not seq)}
    if plan == "naive":
        return style
    # Megatron's f: PrepareModuleInput turns the block's input into ONE replicated DTensor
    # (use_local_output=False, its default, keeps it a DTensor), which q, k, v (gate, up) then
    # share. Backward adds their partial input gradients (Partial + Partial: no communication),
    # then from_local's backward all-reduces the sum once. In the naive plan each colwise linear
    # wraps the plain input itself, so each all-reduces its own input gradient.
    # With sequence parallelism the block's input arrives sharded on the sequence: all-gather.
    style["self_attn"] = PrepareModuleInput(
        input_kwarg_layouts={"hidden_states": out},  # LlamaDecoderLayer passes it by name
        desired_input_kwarg_layouts={"hidden_states": Replicate()}, use_local_output=False)
    style["mlp"] = PrepareModuleInput(input_layouts=(out,), desired_input_layouts=(Replicate(),),
                                      use_local_output=False)
    if seq:  # the norms between the blocks work on this rank's S/N tokens
        style["input_layernorm"] = style["post_attention_layernorm"] = SequenceParallel()
    return style


def parallelize(model, plan: str, mesh):
    """Apply `plan` to every decoder layer of a LlamaForCausalLM on a 1D `mesh` (in place; returns
    the model)."""
    for layer in model.model.layers:
        parallelize_module(layer, mesh, layer_plan(plan))
    if plan == "vocab":  # megatron, and the embedding and the LM head split over the vocabulary
        parallelize_module(model, mesh, {
            # rows = token ids: each rank looks up the ids in its V/N range (zeros for the
            # others), and the partial outputs are all-reduced
            "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(),
                                                  output_layouts=Replicate()),
            # columns = the vocabulary: each rank computes V/N of the logits, which stay sharded
            # (a DTensor) for the loss under loss_parallel(): [B, S, V] is never gathered
            "lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)})
    if plan == "sequence":  # the residual stream is sharded on the sequence between the layers
        parallelize_module(model, mesh, {
            "model.embed_tokens": PrepareModuleOutput(  # keep this rank's S/N tokens
                output_layouts=Replicate(), desired_output_layouts=Shard(1),
                use_local_output=False),
            "model.norm": SequenceParallel(),
            "lm_head": PrepareModuleInput(input_layouts=(Shard(1),),  # all-gather the tokens
                                          desired_input_layouts=(Replicate(),),
                                          use_local_output=True)})
        # The norms' weight gradients are partial sums (each rank saw S/N tokens). Left Partial,
        # AdamW all-reduces each in every op that reads it (3 per weight, measured); Megatron-LM
        # all-reduces them once after backward (_allreduce_layernorm_grads); we do it during
        # backward, as each one is computed.
        for p in model.parameters():
            if isinstance(p, DTensor) and p.placements == (Replicate(),):
                p.register_hook(lambda g: g.redistribute(placements=[Replicate()]))
    return model

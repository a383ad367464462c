"""The loss of a step as one process computes it, on any number of ranks: a sum over valid tokens
divided by the valid tokens of the whole step.

One process trains on a batch with `F.cross_entropy(logits, labels, ignore_index=-100)`: the mean
over the batch's valid tokens (labels -100: a chat's prompt, padding, the last position of a
packed document). Split the batch over data-parallel ranks, over micro-batches, or a sequence
over context-parallel ranks, and each piece holds another number of valid tokens. The mean of
each piece's mean then weights a token of a short piece more than a token of a long one: a
silently different objective, not an error, and a parity test on unmasked data never sees it.

The fix (torchtitan since pytorch/torchtitan#2206, #3111 for context parallelism; transformers'
Trainer passes `num_items_in_batch` for the same reason): each piece sums its tokens' losses and
divides by the valid-token count of the whole step, counted over every data-parallel rank, every
micro-batch of the step and every context-parallel rank. The ranks' losses then add up to one
process's loss, so their gradients must be SUMMED, not averaged: FSDP2 averages by default, so
`sum_gradients(model)` sets its divide factor to 1 (and, for gloo, which has no PREMUL_SUM, plain
SUM collectives).

    count = global_valid_tokens([y for _, y in micro_batches], group)   # once per step
    for x, y in micro_batches:
        global_token_loss(model(x).logits, y, count).backward()

The loss a rank returns is its share: all-reduce the shares with SUM to log the step's loss.
`labels` here are already aligned with `logits` (labels[t] is the target of position t, the token
after it): shift before calling, or use chat_data's rows, which are shifted.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

IGNORE = -100  # transformers' and torch's ignore_index


def _groups(group) -> list:
    """None: the default (world) group; a group; or a list of groups (e.g. dp and cp)."""
    return list(group) if isinstance(group, (list, tuple)) else [group]


def global_valid_tokens(labels, group=None, ignore_index: int = IGNORE) -> torch.Tensor:
    """The valid labels of the whole step: this rank's (a tensor, or a list of its micro-batches'
    labels), summed over every rank of `group` (a group, a list of groups whose product covers the
    data- and context-parallel ranks, or None for the world). One all-reduce of one integer per
    group; every rank gets the same count. Call it once per step, before the micro-batches.
    (Inside a distributed script, a one-process reference must count its own labels and pass
    them as global_token_loss's num_valid: None would all-reduce them over the world.)"""
    pieces = labels if isinstance(labels, (list, tuple)) else [labels]
    count = sum((y != ignore_index).sum() for y in pieces).to(torch.int64).reshape(())
    if dist.is_available() and dist.is_initialized():
        for g in _groups(group):
            dist.all_reduce(count, group=g)
    return count


def global_token_loss(logits: torch.Tensor, labels: torch.Tensor, num_valid=None, group=None,
                      ignore_index: int = IGNORE) -> torch.Tensor:
    """Sum of the cross-entropy of this piece's valid tokens / the step's valid tokens.

    logits (..., vocab) and labels (...) aligned (labels[t] is position t's target); num_valid:
    the step's count from global_valid_tokens (else this piece's labels are counted and
    all-reduced over `group` here: right only with one micro-batch per step). Computed in float32
    whatever the logits' dtype. With every rank's gradients summed (sum_gradients), the gradients
    equal one process's on the whole step's batch. A step whose pieces hold no valid token at all
    gives a loss of 0 (count clamped to 1), not NaN."""
    if num_valid is None:
        num_valid = global_valid_tokens(labels, group, ignore_index)
    total = F.cross_entropy(logits.float().flatten(0, -2), labels.flatten(),
                            ignore_index=ignore_index, reduction="sum")
    return total / torch.as_tensor(num_valid, device=total.device).clamp(min=1)


def sum_gradients(model) -> int:
    """FSDP2 must sum the ranks' gradients, not average them, under global_token_loss: divide
    factor 1 on every fully_shard unit of `model` (set_gradient_divide_factor is per unit), and
    SUM collectives (set_force_sum_reduction_for_comms: a factor other than the group size needs
    NCCL's PREMUL_SUM, which gloo rejects). Under HSDP the replicas' all-reduce sums too. Returns
    the number of units set."""
    from torch.distributed.fsdp import FSDPModule
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for unit in units:
        unit.set_gradient_divide_factor(1.0)
        unit.set_force_sum_reduction_for_comms(True)
    return len(units)

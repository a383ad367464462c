"""Mixture of experts by hand: routing, a grouped GEMM over the experts, expert parallelism.

A mixture-of-experts (MoE) layer replaces a transformer's MLP by E expert MLPs and a router.
The router scores every token against every expert, keeps the top k, and the token's output is
the weighted sum of those k experts' outputs: each token pays for k experts, the model holds E.
Here, as in transformers' Mixtral (models/mixtral/modeling_mixtral.py, transformers 5.23):
- `route`: softmax over the E router logits in float32, top k, the k weights renormalised to
  sum to 1 (MixtralTopKRouter);
- `grouped_experts`: the experts' weights are 3-D tensors, gate_up (E, 2I, H) and down
  (E, H, I) (MixtralExperts); the (token, expert) pairs are sorted by expert so that each
  expert's rows are contiguous, and one grouped GEMM (F.grouped_mm) multiplies every group of
  rows by its own expert's matrix: the op torchtitan and transformers' "grouped_mm" experts use;
- `ExpertParallel`: expert parallelism (EP). Each of N ranks holds E/N experts and routes its
  own tokens; one all-to-all tells every rank how many rows it will receive per expert (the
  host reads those counts: the one synchronisation of the layer), a second sends each pair's
  hidden state to the rank of its expert (uneven splits), the local experts run, a third brings
  the outputs back, and `combine` undoes the sort and weights by the router. The all-to-alls
  are torch's differentiable ones, so the backward sends the gradients the same way in reverse.
  The same steps as transformers' AllToAllEP (transformers/distributed/expert_parallel.py) and
  torchtitan's expert-parallel MoE.
And the bookkeeping of an MoE: `expert_load`, `capacity` and `dropped` (a capacity factor caps
each expert's rows; GShard, Switch Transformer), `load_balancing_loss` (Switch Transformer's
auxiliary loss, as transformers computes it) and `topk_margin` (how close the router came to
picking another expert: whether its counts are the same on every machine).

F.grouped_mm on a CPU (torch 2.13) takes float32 or bfloat16, not float64; and its backward
refuses an incoming gradient with zero strides, such as `.sum()` produces (use a real loss).
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed._functional_collectives import all_to_all_single_autograd


def route(x, router_weight, top_k: int):
    """(logits (T, E), weights (T, k), experts (T, k)): the router's scores, and per token the
    k chosen experts and their weights (softmax over all E, top k, renormalised)."""
    logits = F.linear(x, router_weight)
    probs = torch.softmax(logits.float(), dim=-1)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    return logits, (weights / weights.sum(dim=-1, keepdim=True)).to(x.dtype), experts


def grouped_experts(x, counts, gate_up, down):
    """SwiGLU experts on rows grouped by expert: rows 0 .. counts[0]-1 go to expert 0, the next
    counts[1] to expert 1, ... (a count may be 0). gate_up (E, 2I, H), down (E, H, I), laid out
    as transformers' MixtralExperts stores them (each a linear layer's weight: out x in)."""
    if x.is_cuda and x.dtype != torch.bfloat16:  # torch's fused grouped kernel is bf16 only
        # (compute capability 9.x/10.x); other dtypes take its fallback, a loop of matmuls like
        # this one (GroupedBlas.cpp, _grouped_mm_cuda), and its meta check, which fake tensors
        # and torch.compile use, refuses them (torch/_meta_registrations.py): loop here
        out, start = [], 0
        for e, rows in enumerate(counts.tolist()):
            gate, up = (x[start:start + rows] @ gate_up[e].T).chunk(2, dim=-1)
            out.append((F.silu(gate) * up) @ down[e].T)
            start += rows
        return torch.cat(out)
    offs = torch.cumsum(counts, 0).to(torch.int32)  # where each expert's rows end
    gate, up = F.grouped_mm(x, gate_up.transpose(-2, -1), offs=offs).chunk(2, dim=-1)
    return F.grouped_mm(F.silu(gate) * up, down.transpose(-2, -1), offs=offs)


def sort_by_expert(experts, num_experts: int):
    """The (token, slot) pairs sorted by expert: (order, counts). order[i] = the flat index
    t * k + slot of the i-th pair (its token is order[i] // k); counts[e] = pairs for expert e."""
    flat = experts.reshape(-1)
    counts = torch.zeros(num_experts, dtype=torch.long, device=flat.device)
    return torch.argsort(flat, stable=True), counts.scatter_add_(0, flat, torch.ones_like(flat))


def combine(expert_out, order, weights):
    """Expert outputs of the sorted pairs -> each token's output: put every pair back at its
    (token, slot) place (undo the sort), weight by the router and sum over the k slots."""
    tokens, k = weights.shape
    pairs = torch.empty_like(expert_out)
    pairs[order] = expert_out
    return (pairs.view(tokens, k, -1) * weights.unsqueeze(-1)).sum(dim=1)


def moe(x, router_weight, gate_up, down, top_k: int):
    """One MoE layer in one process: route, sort by expert, grouped GEMM, combine."""
    _, weights, experts = route(x, router_weight, top_k)
    order, counts = sort_by_expert(experts, gate_up.shape[0])
    return combine(grouped_experts(x[order // top_k], counts, gate_up, down), order, weights)


class ExpertParallel:
    """`experts`' weights (its gate_up_proj and down_proj, read at each call: FSDP may swap
    them) are this rank's E/N of `num_experts` experts, rank r holding experts r E/N ...
    (r+1) E/N - 1, the other ranks of `group` the others. Call it with this rank's tokens and
    their routing (weights, experts: (T, k)); returns their outputs (T, H). `self.stats` keeps
    the last call's split sizes: rows sent to each rank, rows received from each. `even=True`
    is for a simulation on fake tensors (no values, so no counts to read): it assumes the router
    spread the pairs evenly, T k / N rows to each rank, T k / E to each expert."""

    def __init__(self, experts, num_experts: int, group=None, combine_fn=combine,
                 even: bool = False):
        self.experts, self.num_experts = experts, num_experts
        self.group = group or dist.group.WORLD
        self.combine, self.even = combine_fn, even
        self.stats = {}

    def __call__(self, x, weights, experts):
        gate_up, down = self.experts.gate_up_proj, self.experts.down_proj
        n, local = dist.get_world_size(self.group), gate_up.shape[0]
        top_k = weights.shape[1]
        order, counts = sort_by_expert(experts, self.num_experts)
        send = x[order // top_k]  # one row per (token, expert) pair, grouped by expert: by rank
        # 1. counts: recv_counts[j, e] = rows rank j will send for my local expert e
        send_counts = counts.view(n, local)
        if self.even:
            recv_counts = torch.full_like(send_counts, top_k * x.shape[0] // self.num_experts)
            send_sizes = recv_sizes = [top_k * x.shape[0] // n] * n
        else:
            recv_counts = torch.empty_like(send_counts)
            dist.all_to_all_single(recv_counts, send_counts, group=self.group)
            send_sizes = send_counts.sum(1).tolist()  # the host waits for these numbers
            recv_sizes = recv_counts.sum(1).tolist()
        # 2. dispatch: uneven splits, differentiable
        received = all_to_all_single_autograd(send, recv_sizes, send_sizes, self.group)
        # rows arrive by source rank, each source's by expert: regroup them by local expert
        expert_of_row = torch.arange(local, device=x.device).repeat(n).repeat_interleave(
            recv_counts.reshape(-1), output_size=sum(recv_sizes))
        regroup = torch.argsort(expert_of_row, stable=True)
        out = grouped_experts(received[regroup], recv_counts.sum(0), gate_up, down)
        by_source = torch.empty_like(out)
        by_source[regroup] = out  # back in the order the rows arrived
        # 3. return each output to the rank that sent the row
        returned = all_to_all_single_autograd(by_source, send_sizes, recv_sizes, self.group)
        self.stats = {"send_sizes": send_sizes, "recv_sizes": recv_sizes}
        return self.combine(returned, order, weights)


# --- bookkeeping: load, capacity, the auxiliary loss --------------------------------------------

def expert_load(experts, num_experts: int) -> list[int]:
    """(token, slot) pairs routed to each expert."""
    return torch.bincount(experts.reshape(-1), minlength=num_experts).tolist()


def capacity(tokens: int, num_experts: int, top_k: int, factor: float) -> int:
    """Rows each expert accepts with capacity factor `factor`: factor x its fair share
    (GShard, arXiv:2006.16668; Switch Transformer, arXiv:2101.03961, section 2.2)."""
    return math.ceil(factor * tokens * top_k / num_experts)


def dropped(load: list[int], cap: int) -> int:
    """Pairs over capacity, dropped (the token keeps its residual, without that expert)."""
    return sum(max(0, n - cap) for n in load)


def topk_margin(logits, top_k: int) -> float:
    """The router's closest call: the smallest gap, over the tokens, between a token's k-th and
    (k+1)-th largest logit (softmax keeps their order). Rounding (~1e-7 of the logits) differs
    between CPUs and kernels; counts of a routing are the same everywhere only when this gap is
    far above it."""
    if top_k >= logits.shape[-1]:
        return math.inf
    top = torch.topk(logits.float(), top_k + 1, dim=-1).values
    return (top[..., top_k - 1] - top[..., top_k]).min().item()


def load_balancing_loss(logits, top_k: int):
    """Switch Transformer's auxiliary loss (eq. 4-6) as transformers computes it
    (load_balancing_loss_func in modeling_mixtral.py): E x sum over experts of (the fraction of
    the tokens that picked it: these sum to top_k) x (its mean router probability). A uniform
    router that spreads the picks evenly gives top_k; concentrating on few experts raises it.
    Megatron-LM's switch_load_balancing_loss_func divides by top_k (even picks give 1): a
    coefficient ported from Megatron to transformers is multiplied by top_k."""
    probs = torch.softmax(logits.float(), dim=-1)
    _, picked = torch.topk(probs, top_k, dim=-1)
    num_experts = logits.shape[-1]
    fraction = torch.bincount(picked.reshape(-1), minlength=num_experts) / logits.shape[0]
    return num_experts * (fraction * probs.mean(0)).sum()


# --- expert parallelism inside FSDP2 ------------------------------------------------------------

def apply_ep_fsdp(model, mesh, everyone, *, mp_policy=None, even: bool = False,
                  divide_experts: bool = True) -> list[ExpertParallel]:
    """torchtitan's MoE layout, on a Mixtral-shaped transformers model (each decoder layer's
    `mlp.experts` holding gate_up_proj and down_proj for all E experts), a 2-D mesh ("efsdp",
    "ep") of N ranks and `everyone`, that mesh flattened (flatten it outside FakeTensorMode):
    each rank keeps the E/ep experts of its ep rank and runs them with `ExpertParallel` over
    the ep group; FSDP2 shards those experts over the efsdp ranks
    that hold the same ones, and everything else (attention, router, norms, embeddings) over
    all N ranks. Returns each layer's ExpertParallel (its `stats`).

    The gradients' scale. Each rank's loss is the mean over its own tokens and the global loss
    the mean of the N ranks' (equal token counts; otherwise divide by the global count, as
    fsdp_cp.py does). A dense weight is replicated: FSDP's default average over N is right.
    An expert's gradient on one rank already sums the contributions of every rank of its ep
    group (the all-to-all's backward brings them); FSDP's default would then average over the
    N / ep efsdp replicas, leaving ep times the gradient of the mean loss. So the experts get
    `set_gradient_divide_factor(N)` and sum reductions (`set_force_sum_reduction_for_comms`:
    gloo refuses the PREMUL_SUM a divide factor otherwise uses; below), as transformers does
    (transformers/distributed/fsdp.py). `divide_experts=False` is that mistake, kept for the
    test that shows it. `even`: see ExpertParallel (fake tensors).

    Experts fewer than their efsdp ranks are sharded on their rows (dim 1) instead of dim 0,
    which FSDP2 would pad (torchtitan's rule, parallelize.py, apply_fsdp)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import Shard

    mp_policy = mp_policy or MixedPrecisionPolicy()
    n, ep = mesh.size(), mesh["ep"].size()
    ep_rank = mesh.get_local_rank("ep")
    runs = []
    for layer in model.model.layers:
        experts = layer.mlp.experts
        total = experts.gate_up_proj.shape[0]
        if total % ep:
            raise ValueError(f"ep {ep} must divide the {total} experts")
        local = total // ep
        rows = (lambda p: Shard(1)) if local < n // ep else None
        if ep > 1:  # this rank's E/ep experts, and the all-to-alls that feed them
            keep = slice(ep_rank * local, (ep_rank + 1) * local)
            experts.gate_up_proj = torch.nn.Parameter(experts.gate_up_proj.detach()[keep].clone())
            experts.down_proj = torch.nn.Parameter(experts.down_proj.detach()[keep].clone())
            run = ExpertParallel(experts, total, mesh.get_group("ep"), even=even)
            # MixtralSparseMoeBlock calls experts(hidden_states, top_k_index, top_k_weights)
            experts.forward = lambda x, index, weights, run=run: run(x, weights, index)
            runs.append(run)
        fully_shard(experts, mesh=mesh["efsdp"], mp_policy=mp_policy, shard_placement_fn=rows)
        if divide_experts:
            experts.set_gradient_divide_factor(float(n))  # the world, not the efsdp replicas
            # a SUM reduction and a division after it (gloo has no PREMUL_SUM); not on a
            # one-rank efsdp group, where no collective runs and torch 2.13 would divide twice
            # (foreach_reduce divides its copy by the factor, then again by the post-factor)
            experts.set_force_sum_reduction_for_comms(n // ep > 1)
        fully_shard(layer, mesh=everyone, mp_policy=mp_policy)
    fully_shard(model, mesh=everyone, mp_policy=mp_policy)
    return runs

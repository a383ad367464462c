"""Context parallelism by hand: one attention over a sequence split across ranks (chapter 09).

A sequence of S tokens is cut into chunks; each rank of the context-parallel (cp) group holds
the queries, keys and values of its chunks, S/N tokens. Two ways to still compute attention over
the whole sequence, each written here in plain torch so every byte it sends is visible:

- `ring_attention`: the keys and values travel round a ring of ranks, one block per step, sent
  point-to-point (`dist.batch_isend_irecv`) while the current block is computed. Each rank merges
  the blocks' partial results with the online softmax (`merge`), so no rank ever holds the
  S x S scores or the whole K and V. The backward pass runs the ring again, and the gradients of
  each K/V block travel with it back to the rank that owns it. (Liu, Zaharia, Abbeel, "Ring
  Attention with Blockwise Transformers for Near-Infinite Context", arXiv:2310.01889, 2023;
  torch's version: torch/distributed/tensor/experimental/_context_parallel/_attention.py,
  `_templated_ring_attention` and its backward, torch 2.13.)
- `ulysses_attention`: two all-to-alls turn "all heads of S/N tokens" into "H/N heads of all S
  tokens", ordinary attention runs per head, and two more all-to-alls turn it back (Jacobs et al.,
  "DeepSpeed Ulysses", arXiv:2309.14509, 2023).

Causal attention makes a contiguous split unfair: the rank holding the last tokens has the most
keys to look at. `head_tail` is the layout torch's context_parallel() uses by default (its
`_HeadTailLoadBalancer`): 2N chunks, rank r holds chunks r and 2N-1-r. `causal_work` counts the
score entries each rank computes under a layout.

Tensors are (batch, heads, tokens, head_dim), as F.scaled_dot_product_attention takes them;
keys and values may have fewer heads than queries (grouped-query attention, GQA).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed._functional_collectives import all_to_all_single_autograd


# --- layouts: which chunks of the sequence each rank holds ------------------------------------

def contiguous(n: int) -> list[list[int]]:
    """N chunks, rank r holds chunk r: tokens r S/N ... (r+1) S/N - 1."""
    return [[r] for r in range(n)]


def head_tail(n: int) -> list[list[int]]:
    """2N chunks, rank r holds chunks r and 2N-1-r: one early and one late piece each, so every
    rank has the same causal work (torch's _HeadTailLoadBalancer, torch 2.13
    torch/distributed/tensor/experimental/_context_parallel/_load_balancer.py)."""
    return [[r, 2 * n - 1 - r] for r in range(n)]


LAYOUTS = {"contiguous": contiguous, "head-tail": head_tail}


def token_order(layout: list[list[int]], seq: int) -> torch.Tensor:
    """The global token positions in the order the ranks hold them (rank 0's first): shard a
    sequence with x[..., order, :].chunk(N), and position ids follow the same order."""
    chunks = sum(len(c) for c in layout)
    size = seq // chunks
    return torch.cat([torch.arange(c * size, (c + 1) * size) for cs in layout for c in cs])


def pair_kind(q_chunk: int, k_chunk: int, causal: bool) -> str:
    """What a causal mask leaves of the scores of one query chunk against one key chunk:
    'full' (every key is earlier), 'diagonal' (the same chunk: a triangle) or 'skip' (every key
    is later)."""
    if not causal or k_chunk < q_chunk:
        return "full"
    return "diagonal" if k_chunk == q_chunk else "skip"


def causal_work(layout: list[list[int]], seq: int, causal: bool = True) -> list[int]:
    """Score entries q.k each rank computes per (batch, head) under this layout: c^2 for a full
    pair of chunks of c tokens, c(c+1)/2 for a diagonal one, 0 for a skipped one."""
    chunks = sum(len(c) for c in layout)
    c = seq // chunks
    cost = {"full": c * c, "diagonal": c * (c + 1) // 2, "skip": 0}
    return [sum(cost[pair_kind(qc, kc, causal)] for qc in mine for ks in layout for kc in ks)
            for mine in layout]


# --- attention of one block, and the online softmax ------------------------------------------

def block_attention(q, k, v, kind: str, scale: float):
    """Attention of queries q over one block of keys/values: (out, lse), out normalised over
    this block only, lse = log of the softmax's denominator per query row (log-sum-exp of the
    scores). `kind` 'diagonal' applies the causal triangle."""
    s = (q @ k.transpose(-2, -1)) * scale
    if kind == "diagonal":
        s = s.masked_fill(torch.ones_like(s, dtype=torch.bool).triu(1), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    return torch.exp(s - lse.unsqueeze(-1)) @ v, lse


def merge(out_a, lse_a, out_b, lse_b):
    """The online softmax: two blocks' (out, lse) -> those of attention over both blocks.

    Each block's out is normalised by its own denominator exp(lse); over both, the denominator
    is exp(lse_a) + exp(lse_b), so each block's out is reweighted by its share of it."""
    lse = torch.logaddexp(lse_a, lse_b)
    return (torch.exp(lse_a - lse).unsqueeze(-1) * out_a
            + torch.exp(lse_b - lse).unsqueeze(-1) * out_b), lse


def reference_attention(q, k, v, causal: bool):
    """Attention over the whole sequence in one process: torch's SDPA (GQA: enable_gqa)."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                          enable_gqa=k.shape[1] != q.shape[1])


# --- ring attention ----------------------------------------------------------------------------

def _chunks(x, n):
    return list(x.chunk(n, dim=2))


def _repeat_kv(x, groups: int):
    """GQA: key/value head j serves query heads j*groups ... (as transformers' repeat_kv)."""
    return x.repeat_interleave(groups, dim=1) if groups > 1 else x


def _exchange(tensor, group, tag: int):
    """Start sending `tensor` to the next rank of the ring and receiving the previous rank's
    into a new buffer; returns (the buffer, the pending works, bytes sent)."""
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    nxt = dist.get_global_rank(group, (rank + 1) % n)
    prv = dist.get_global_rank(group, (rank - 1) % n)
    incoming = torch.empty_like(tensor)
    works = dist.batch_isend_irecv([dist.P2POp(dist.isend, tensor, nxt, group, tag),
                                    dist.P2POp(dist.irecv, incoming, prv, group, tag)])
    return incoming, works, tensor.numel() * tensor.element_size()


class RingAttention(torch.autograd.Function):
    """Attention over the sequence the ranks of `group` hold between them, by a ring.

    forward(q, k, v, group, layout, causal, merge_fn, stats): q (B, H, S/N, D) and k, v
    (B, H_kv, S/N, D) are this rank's chunks (layout[rank], concatenated along the tokens).
    Step i = 0 ... N-1: this rank holds the K/V block of rank r - i; it posts the send of that
    block to rank r + 1 and the receive of rank r - 1's, computes its queries' attention over the
    block, chunk pair by chunk pair (skipping pairs the causal mask removes), merges it into the
    running (out, lse) with the online softmax, then waits for the exchange: the transfer runs
    while the block computes. Forward: N-1 sends of K and V. Backward: the same ring of K/V,
    plus each block's key/value gradients, which collect every rank's contribution as they
    travel and arrive home after the N-th send. `stats` (a dict) accumulates the bytes sent
    ("forward bytes", "backward bytes") and the score entries computed per (sequence, head)
    ("work").
    """

    @staticmethod
    def forward(ctx, q, k, v, group, layout, causal, merge_fn=merge, stats=None):
        rank, n = dist.get_rank(group), dist.get_world_size(group)
        mine, per_rank = layout[rank], len(layout[rank])
        scale, groups = q.shape[-1] ** -0.5, q.shape[1] // k.shape[1]
        q_chunks = _chunks(q, per_rank)
        acc = [None] * per_rank  # per query chunk: (out, lse) so far
        kv, sent, work = torch.stack([k, v]).contiguous(), 0, 0
        for i in range(n):
            source = (rank - i) % n  # whose K/V block this rank holds now
            if i < n - 1:
                incoming, works, nbytes = _exchange(kv, group, tag=0)
                sent += nbytes
            k_chunks = _chunks(_repeat_kv(kv[0], groups), per_rank)
            v_chunks = _chunks(_repeat_kv(kv[1], groups), per_rank)
            for a, qc in enumerate(mine):
                for b, kc in enumerate(layout[source]):
                    kind = pair_kind(qc, kc, causal)
                    if kind == "skip":
                        continue
                    block = block_attention(q_chunks[a], k_chunks[b], v_chunks[b], kind, scale)
                    acc[a] = block if acc[a] is None else merge_fn(*acc[a], *block)
                    c = q_chunks[a].shape[2]
                    work += c * c if kind == "full" else c * (c + 1) // 2
            if i < n - 1:
                for w in works:
                    w.wait()
                kv = incoming
        # laid out in memory as (B, S/N, H, D), as SDPA's kernels return it: the transpose to
        # (B, S/N, H, D) that transformers makes next is then free, not a copy
        out = torch.cat([o for o, _ in acc], dim=2).transpose(1, 2).contiguous().transpose(1, 2)
        lse = torch.cat([s for _, s in acc], dim=2)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.layout, ctx.causal, ctx.stats = group, layout, causal, stats
        if stats is not None:
            stats["forward bytes"] = stats.get("forward bytes", 0) + sent
            stats["work"] = stats.get("work", 0) + work
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        group, layout, causal = ctx.group, ctx.layout, ctx.causal
        rank, n = dist.get_rank(group), dist.get_world_size(group)
        mine, per_rank = layout[rank], len(layout[rank])
        scale, groups = q.shape[-1] ** -0.5, q.shape[1] // k.shape[1]
        qs, outs, dos, lses = (list(t.chunk(per_rank, dim=2)) for t in (q, out, dout, lse))
        # D_i = rowsum(dO_i * O_i): the softmax backward's correction term, per query row
        deltas = [(d * o).sum(-1) for d, o in zip(dos, outs)]
        dq = torch.zeros_like(q)
        dq_chunks = _chunks(dq, per_rank)
        kv, dkv, dkv_works = torch.stack([k, v]).contiguous(), None, []
        sent = 0
        for i in range(n):
            source = (rank - i) % n
            if i < n - 1:
                incoming, works, nbytes = _exchange(kv, group, tag=0)
                sent += nbytes
            kr, vr = _repeat_kv(kv[0], groups), _repeat_kv(kv[1], groups)
            k_chunks, v_chunks = _chunks(kr, per_rank), _chunks(vr, per_rank)
            dk_rep, dv_rep = torch.zeros_like(kr), torch.zeros_like(vr)
            dk_chunks, dv_chunks = _chunks(dk_rep, per_rank), _chunks(dv_rep, per_rank)
            for a, qc in enumerate(mine):
                for b, kc in enumerate(layout[source]):
                    kind = pair_kind(qc, kc, causal)
                    if kind == "skip":
                        continue
                    s = (qs[a] @ k_chunks[b].transpose(-2, -1)) * scale
                    if kind == "diagonal":
                        s = s.masked_fill(torch.ones_like(s, dtype=torch.bool).triu(1),
                                          float("-inf"))
                    p = torch.exp(s - lses[a].unsqueeze(-1))  # the final softmax, this block
                    dv_chunks[b] += p.transpose(-2, -1) @ dos[a]
                    ds = p * (dos[a] @ v_chunks[b].transpose(-2, -1) - deltas[a].unsqueeze(-1))
                    dq_chunks[a] += ds @ k_chunks[b] * scale
                    dk_chunks[b] += ds.transpose(-2, -1) @ qs[a] * scale
            # GQA: a key/value head's gradient is the sum over the query heads it served
            mine_dkv = torch.stack([_sum_groups(dk_rep, groups), _sum_groups(dv_rep, groups)])
            if dkv is not None:  # the block's gradients so far, from the previous rank
                for w in dkv_works:
                    w.wait()
                mine_dkv = mine_dkv + dkv
            # pass the block's gradients on; after the last step they reach the block's owner
            if n > 1:
                dkv, dkv_works, nbytes = _exchange(mine_dkv.contiguous(), group, tag=1)
                sent += nbytes
            else:
                dkv, dkv_works = mine_dkv, []
            if i < n - 1:
                for w in works:
                    w.wait()
                kv = incoming
        for w in dkv_works:
            w.wait()
        if ctx.stats is not None:
            ctx.stats["backward bytes"] = ctx.stats.get("backward bytes", 0) + sent
        return dq, dkv[0], dkv[1], None, None, None, None, None


def _sum_groups(x, groups: int):
    b, h, s, d = x.shape
    return x.view(b, h // groups, groups, s, d).sum(2) if groups > 1 else x


def ring_attention(q, k, v, group=None, layout=None, causal=True, merge_fn=merge, stats=None):
    """Attention over the whole sequence by a ring; see RingAttention. `layout` defaults to
    contiguous chunks."""
    group = group or dist.group.WORLD
    layout = layout or contiguous(dist.get_world_size(group))
    return RingAttention.apply(q, k, v, group, layout, causal, merge_fn, stats)


def ring_bytes(n: int, batch: int, kv_heads: int, tokens: int, head_dim: int,
               elem: int) -> dict:
    """Bytes each rank sends in one ring attention, for a sequence of `tokens` over n ranks:
    a K/V block is 2 x batch x kv_heads x tokens/n x head_dim values; the forward sends it n-1
    times, the backward sends it n-1 times and its gradients n times (none on one rank)."""
    block = 2 * batch * kv_heads * tokens // n * head_dim * elem
    return {"forward bytes": (n - 1) * block, "backward bytes": (2 * n - 1) * block * (n > 1)}


# --- Ulysses -----------------------------------------------------------------------------------

def seq_to_heads(x, group):
    """(B, H, S/N, D) on each rank, all heads of its tokens -> (B, H/N, S, D), its H/N heads of
    every token: split the heads in N groups, send group j to rank j with one all-to-all, and
    lay the N token chunks that come back end to end (rank order = token order)."""
    n = dist.get_world_size(group)
    b, h, s, d = x.shape
    send = x.reshape(b, n, h // n, s, d).transpose(0, 1).contiguous()  # (N, B, H/N, S/N, D)
    got = all_to_all_single_autograd(send, None, None, group)            # [j]: rank j's tokens
    return got.permute(1, 2, 0, 3, 4).reshape(b, h // n, n * s, d)


def heads_to_seq(x, group):
    """The inverse of seq_to_heads: (B, H/N, S, D) -> (B, H, S/N, D)."""
    n = dist.get_world_size(group)
    b, hn, s, d = x.shape
    send = x.reshape(b, hn, n, s // n, d).permute(2, 0, 1, 3, 4).contiguous()
    got = all_to_all_single_autograd(send, None, None, group)            # [j]: rank j's heads
    # (B, H, S/N, D), laid out in memory as (B, S/N, H, D) as SDPA's kernels return it
    return got.permute(1, 3, 0, 2, 4).reshape(b, s // n, n * hn, d).transpose(1, 2)


def ulysses_attention(q, k, v, group=None, causal=True, to_heads=seq_to_heads):
    """Attention over the whole sequence by DeepSpeed-Ulysses: q, k, v (B, H, S/N, D) ->
    (B, H/N, S, D) by all-to-all, ordinary attention on the full sequence of each of this
    rank's heads, and back. H and H_kv must both divide by N (with GQA, H_kv bounds N).
    Each all-to-all sends (N-1)/N of its input: q's, k's, v's and the output's, forward;
    their gradients, backward. The layout is contiguous: each rank attends over every token of
    its heads, so a causal mask costs every rank the same."""
    group = group or dist.group.WORLD
    n = dist.get_world_size(group)
    if q.shape[1] % n or k.shape[1] % n:
        raise ValueError(f"Ulysses over {n} ranks needs the query heads ({q.shape[1]}) and the "
                         f"key/value heads ({k.shape[1]}) to divide by {n}")
    qh, kh, vh = (to_heads(t, group) for t in (q, k, v))
    return heads_to_seq(reference_attention(qh, kh, vh, causal), group)


def ulysses_bytes(n: int, batch: int, heads: int, kv_heads: int, tokens: int, head_dim: int,
                  elem: int) -> dict:
    """Bytes each rank sends in one Ulysses attention: four all-to-alls forward (q, k, v, the
    output), four backward (their gradients), each (n-1)/n of this rank's tensor."""
    local = batch * tokens // n * head_dim * elem
    moved = (2 * heads + 2 * kv_heads) * local * (n - 1) // n
    return {"forward bytes": moved, "backward bytes": moved}

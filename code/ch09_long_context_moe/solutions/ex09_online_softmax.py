"""Exercise 09.1: merge two attention blocks with the online softmax, then run a ring with it.

    code/run_w_torchrun.sh 2 ch09_long_context_moe/exercises/ex09_online_softmax.py

Attention over a long sequence can be computed one block of keys at a time: each block gives its
queries an output normalised over that block only, and the log-sum-exp (lse) of their scores
against it, the log of that softmax's denominator. `merge` turns the (out, lse) of two blocks
into those of attention over both, exactly, without looking at the scores again: this is what
lets ring attention (distkit.cp.ring_attention) see the keys one rank's block at a time, and
flash attention one tile at a time. The script checks your merge four ways: two halves of the
keys in one process, against attention over all of them (output and lse); the same with scores
1000 larger (large logits); three blocks merged in two different orders; and inside the ring,
across the ranks (causal, head-tail order), against attention over the whole sequence.
Fill in the TODO(you) part, replacing the todo(...) call with your code. Run the script at any
time: it stops at the first todo() left and says what is missing.
`make exercise EX=09.1` checks it at 2 and 3 ranks. Solution, with the answers to the questions
below: ../solutions/ex09_online_softmax.py.

Predict, then measure:
1. A block whose every score is -inf for some query (a causal mask hides all its keys) has
   lse = -inf there. What does your merge return for that row, and why does ring_attention skip
   such pairs of chunks instead of computing them?
2. torch's merge (torch/distributed/tensor/experimental/_context_parallel/_attention.py,
   _SDPAMerger) writes out - sigmoid(lse_b - lse_a) * (out - out_b). Show it is yours.
3. In bf16, would you keep (out, lse) in bf16 between the blocks of a 128k-token ring? What does
   torch do (`_cp_options.convert_to_f32`)?
"""
import argparse
import os

import torch
import torch.distributed as dist

from distkit import print0, seed_everything, setup, teardown, todo, write_json
from distkit.cp import block_attention, head_tail, reference_attention, ring_attention, \
    token_order

# float64: the merge is exact up to rounding (measured <= 1.3e-15 against SDPA over all keys);
# a merge that forgets a block's share of the denominator is off by ~0.1.
TOL = 1e-12

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--seq", type=int, default=24, help="tokens in the whole sequence")
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--json", help="write the errors here (rank 0)")
args = parser.parse_args()
world = int(os.environ.get("WORLD_SIZE", 1))
if args.seq < 6 or args.seq % (2 * world) or args.seq % 6:
    parser.error(f"--seq must be a multiple of 6 and of 2 x {world} processes")


def merge(out_a, lse_a, out_b, lse_b):
    """(out, lse) of attention over blocks a and b together, from each block's own: out
    (..., queries, head_dim) normalised over its block, lse (..., queries) its log-sum-exp."""
    ### BEGIN SOLUTION: merge two blocks' (out, lse) into those of attention over both
    ### HINT over both blocks the softmax's denominator is exp(lse_a) + exp(lse_b); each block's
    ### HINT out was divided by its own exp(lse) only. Keep it stable for large scores (no
    ### HINT exp of an lse itself). Look up: torch.logaddexp.
    lse = torch.logaddexp(lse_a, lse_b)  # log(exp(lse_a) + exp(lse_b)), without overflow
    weight_a = torch.exp(lse_a - lse).unsqueeze(-1)  # block a's share of the new denominator
    weight_b = torch.exp(lse_b - lse).unsqueeze(-1)
    return weight_a * out_a + weight_b * out_b, lse
    ### END SOLUTION


env = setup()
N, r = env.world_size, env.rank
B, H, S, D = 2, 4, args.seq, 8
seed_everything(args.seed)
q, k, v = (torch.randn(B, H, S, D, dtype=torch.float64).to(env.device) for _ in range(3))
scale = D ** -0.5
errors = {}

# 1. one process: two halves of the keys, merged, against attention over all the keys
full = reference_attention(q, k, v, causal=False)
full_lse = torch.logsumexp(q @ k.transpose(-2, -1) * scale, dim=-1)
halves = [block_attention(q, kk, vv, "full", scale) for kk, vv in zip(k.chunk(2, 2),
                                                                         v.chunk(2, 2))]
out, lse = merge(*halves[0], *halves[1])
errors["two blocks: out"] = (out - full).abs().max().item()
errors["two blocks: lse"] = (lse - full_lse).abs().max().item()

# 2. the same two halves with every score shifted by +1000 (a softmax does not change; an lse
# of 1000 is what large logits give): exp(1000) overflows even float64, so a merge that takes
# the exp of an lse returns inf or nan here, or silently wrong weights
SHIFT = 1000.0
out, lse = merge(halves[0][0], halves[0][1] + SHIFT, halves[1][0], halves[1][1] + SHIFT)
errors["large scores: out"] = (out - full).abs().max().item()
errors["large scores: lse"] = (lse - SHIFT - full_lse).abs().max().item()

# 3. three blocks, merged in two orders: ((a b) c) and (a (b c)) must agree with the whole
thirds = [block_attention(q, kk, vv, "full", scale) for kk, vv in zip(k.chunk(3, 2),
                                                                         v.chunk(3, 2))]
left = merge(*merge(*thirds[0], *thirds[1]), *thirds[2])
right = merge(*thirds[0], *merge(*thirds[1], *thirds[2]))
errors["three blocks: out"] = max((o - full).abs().max().item() for o, _ in (left, right))
errors["three blocks: lse"] = max((s - full_lse).abs().max().item() for _, s in (left, right))

# 4. your merge inside the ring: causal, head-tail order, N ranks
layout = head_tail(N)
mine = token_order(layout, S).view(N, -1)[r]
ring = ring_attention(q[:, :, mine], k[:, :, mine], v[:, :, mine], layout=layout, causal=True,
                      merge_fn=merge)
worst = (ring - reference_attention(q, k, v, causal=True)[:, :, mine]).abs().max()
dist.all_reduce(worst, op=dist.ReduceOp.MAX)
errors["ring: out"] = worst.item()

for what, err in errors.items():
    print0(f"{what:18s} max |error| < {TOL:.0e}: {err < TOL}")  # NaN: False
write_json(args.json, {"world_size": N, "seq": S, "tolerance": TOL, "errors": errors})
teardown()

### BEGIN SOLUTION
# Answers to "Predict, then measure":
# 1. With lse_b = -inf, logaddexp gives lse = lse_a, weight_a = 1 and weight_b = exp(-inf) = 0:
#    the row keeps block a's result, as it should. But if both blocks hid every key of a row
#    (lse_a = lse_b = -inf), lse - lse is -inf - (-inf) = nan, and the row turns nan; and a
#    fully masked block costs its matmuls for nothing. The ring skips whole pairs of chunks the
#    causal mask removes (distkit.cp.pair_kind), so every merged row has seen at least its own
#    diagonal chunk.
# 2. Yours: out = w_a out_a + w_b out_b with w_b = 1 - w_a and w_a = 1 / (1 + exp(lse_b - lse_a)),
#    so w_b = sigmoid(lse_b - lse_a) and out = out_a - sigmoid(lse_b - lse_a) (out_a - out_b):
#    torch's line with out = out_a. Its lse line, lse_a - logsigmoid(lse_a - lse_b), is
#    lse_a + log(1 + exp(lse_b - lse_a)) = logaddexp(lse_a, lse_b).
# 3. No: each merge rounds out to 8 bits of mantissa, and a 128k ring at cp = 8 merges 8-16
#    blocks per query chunk; errors add up. torch upcasts both to float32 before merging
#    (convert_to_f32 = True, the default) and casts the result back at the end; that is also
#    why its CPU ring gave ~1e-7 on float64 inputs (torch_cp.py).
### END SOLUTION

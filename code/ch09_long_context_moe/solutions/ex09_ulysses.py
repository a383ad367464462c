"""Exercise 09.2: Ulysses' all-to-all, from a rank's tokens to its heads of the whole sequence.

    code/run_w_torchrun.sh 2 ch09_long_context_moe/exercises/ex09_ulysses.py

Context parallelism leaves each of N ranks with S/N consecutive tokens of a sequence, every head
of them: q is (B, H, S/N, D) on each rank. Ulysses' first step re-deals the data so that each
rank holds H/N whole heads instead, every token of them: rank j gets heads j H/N ... (j+1) H/N - 1,
a (B, H/N, S, D) tensor, and attention per head then needs nothing from any other rank.
`seq_to_heads` is that re-deal, one all-to-all; distkit.cp.heads_to_seq is its inverse and
distkit.cp.ulysses_attention uses both. The script checks your function: its output against
the slice of the whole tensor it must equal, on the world group and in groups smaller than the
world (as Ulysses runs on a (dp, cp) mesh's cp group), and Ulysses attention built on it (causal,
with grouped-query attention) against attention over the whole sequence, output and gradients.
Fill in the TODO(you) part, replacing the todo(...) call with your code. Run the script at any
time: it stops at the first todo() left and says what is missing.
`make exercise EX=09.2` checks it at 2 and 3 ranks. Solution, with the answers to the questions
below: ../solutions/ex09_ulysses.py.

Predict, then measure:
1. How many bytes does the call of your seq_to_heads on q send from each rank, with this
   script's defaults (B = 2, H = 12, S = 24, D = 8, float64) at N = 3?
2. Llama 3.1 8B has 32 query heads and 8 key/value heads. What is the largest N Ulysses can use
   for it, and what would DeepSpeed-Ulysses do beyond that?
3. Why is the backward of seq_to_heads one more all-to-all, and which one?
"""
import argparse
import os

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.tensor.debug import CommDebugMode

from distkit import print0, seed_everything, setup, teardown, todo, write_json
from distkit.cp import reference_attention, ulysses_attention

# float64; Ulysses runs the same SDPA on the same rows of each head: measured 0.0. A head or a
# token chunk in the wrong place is off by ~1.
TOL = 1e-12

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--seq", type=int, default=24, help="tokens in the whole sequence")
parser.add_argument("--heads", type=int, default=12, help="query heads (divisible by N)")
parser.add_argument("--kv-heads", type=int, default=6,
                    help="key/value heads (divisible by N; fewer than --heads: GQA)")
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--json", help="write the errors here (rank 0)")
args = parser.parse_args()
world = int(os.environ.get("WORLD_SIZE", 1))
if args.seq % world or args.heads % world or args.kv_heads % world or \
        args.heads % args.kv_heads:
    parser.error(f"--seq, --heads and --kv-heads must be multiples of {world} processes, "
                 "--heads a multiple of --kv-heads")


def seq_to_heads(x, group):
    """(B, H, S/N, D) on each rank, its S/N tokens of every head -> (B, H/N, S, D), its H/N heads
    (rank j: heads j H/N ... (j+1) H/N - 1) of every token, tokens in order."""
    ### BEGIN SOLUTION: re-deal (B, H, S/N, D) into (B, H/N, S, D) with one all-to-all
    ### HINT all_to_all_single_autograd(t, None, None, group) sends t's chunk j along dimension 0
    ### HINT to rank j and returns the chunks received, chunk j from rank j. So put head group j
    ### HINT first in a contiguous tensor, then lay what comes back (rank j's tokens = tokens
    ### HINT j S/N ...) end to end along the tokens. Look up: Tensor.reshape, transpose, permute.
    n = dist.get_world_size(group)
    b, h, s, d = x.shape
    send = x.reshape(b, n, h // n, s, d).transpose(0, 1).contiguous()  # [j]: head group j
    got = all_to_all_single_autograd(send, None, None, group)  # [j]: rank j's tokens, my heads
    return got.permute(1, 2, 0, 3, 4).reshape(b, h // n, n * s, d)
    ### END SOLUTION


env = setup()
N, r = env.world_size, env.rank
group = dist.group.WORLD
B, H, H_kv, S, D = 2, args.heads, args.kv_heads, args.seq, 8
seed_everything(args.seed)
q = torch.randn(B, H, S, D, dtype=torch.float64, requires_grad=True)
k, v = (torch.randn(B, H_kv, S, D, dtype=torch.float64, requires_grad=True) for _ in range(2))
grad_out = torch.randn(B, H, S, D, dtype=torch.float64)
q, k, v = (t.detach().to(env.device).requires_grad_() for t in (q, k, v))
grad_out = grad_out.to(env.device)
tokens = slice(r * S // N, (r + 1) * S // N)  # this rank's tokens
heads = slice(r * H // N, (r + 1) * H // N)   # the heads it must end up with
errors = {}

# 1. the re-deal itself: this rank's heads of the whole sequence, its collectives counted
with CommDebugMode() as comm:
    got = seq_to_heads(q.detach()[:, :, tokens].contiguous(), group)
collectives = {str(op).split(".")[-1]: calls for op, calls in comm.get_comm_counts().items()}
errors["layout"] = (got - q.detach()[:, heads]).abs().max().item() \
    if got.shape == q[:, heads].shape else float("inf")

# 1b. the same in a group smaller than the world, as Ulysses runs on a (dp, cp) mesh's cp group:
# ranks 0 .. N-2 form one group, rank N-1 another (of one). Every rank joins every new_group call.
if N > 1 and H % (N - 1) == 0 and S % (N - 1) == 0:
    sub = [dist.new_group(ranks) for ranks in (list(range(N - 1)), [N - 1])][r == N - 1]
    g, j = dist.get_world_size(sub), dist.get_rank(sub)
    try:
        got = seq_to_heads(q.detach()[:, :, j * S // g:(j + 1) * S // g].contiguous(), sub)
        want = q.detach()[:, j * H // g:(j + 1) * H // g]
        errors["layout in a sub-group"] = (got - want).abs().max().item() \
            if got.shape == want.shape else float("inf")
    except RuntimeError:  # e.g. split sizes that do not fit the group
        errors["layout in a sub-group"] = float("inf")

# 2. Ulysses attention built on it, against the whole sequence's, forward and backward
full = reference_attention(q, k, v, causal=True)
full.backward(grad_out)
ql, kl, vl = (t.detach()[:, :, tokens].clone().requires_grad_() for t in (q, k, v))
out = ulysses_attention(ql, kl, vl, group, causal=True, to_heads=seq_to_heads)
errors["attention"] = (out - full[:, :, tokens]).abs().max().item()
errors["gradients"] = float("inf")  # unless gradients reach q, k and v
if out.requires_grad:
    out.backward(grad_out[:, :, tokens])
    if all(t.grad is not None for t in (ql, kl, vl)):
        errors["gradients"] = max((a.grad - b.grad[:, :, tokens]).abs().max().item()
                                  for a, b in ((ql, q), (kl, k), (vl, v)))
names = list(errors)  # the same keys on every rank (--heads and --seq as the world's)
worst = torch.tensor([errors[k_] for k_ in names], dtype=torch.float64, device=env.device)
dist.all_reduce(worst, op=dist.ReduceOp.MAX)
errors = dict(zip(names, worst.tolist()))
for what, err in errors.items():
    print0(f"{what:21s} max |error| over the ranks < {TOL:.0e}: {err < TOL}")
write_json(args.json, {"world_size": N, "seq": S, "heads": H, "kv_heads": H_kv,
                       "tolerance": TOL, "errors": errors, "collectives": collectives})
teardown()

### BEGIN SOLUTION
# Answers to "Predict, then measure":
# 1. Each rank's q is B H (S/N) D = 2 x 12 x 8 x 8 = 1,536 values, 12,288 bytes in float64;
#    the all-to-all keeps 1/N of it and sends the rest: 2/3 x 12,288 = 8,192 bytes.
# 2. N must divide the 8 key/value heads (and the 32 query heads): N <= 8. Beyond that
#    DeepSpeed-Ulysses replicates each key/value head over N / H_kv ranks before the all-to-all,
#    sending more; or combine Ulysses with a ring over the rest (USP: Fang and Zhao, "USP: A
#    Unified Sequence Parallelism Approach", arXiv:2405.07719). A ring has no head limit.
# 3. An all-to-all only moves values: its gradient moves the output's gradient back the same
#    way, the inverse all-to-all (chunk j back to rank j), which is heads_to_seq's exchange.
#    torch's all_to_all_single autograd function runs it with the split sizes swapped.
### END SOLUTION

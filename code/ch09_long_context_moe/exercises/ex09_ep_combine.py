# Yours to fill in (generated from ../solutions/ex09_ep_combine.py).
"""Exercise 09.3: the combine of expert parallelism, each token's output from its experts'.

    code/run_w_torchrun.sh 2 ch09_long_context_moe/exercises/ex09_ep_combine.py

An MoE layer sends each (token, expert) pair's hidden state to its expert, sorted by expert so
that every expert's rows are contiguous: the i-th row sent is pair `order[i]`, the flat index
t * k + slot of token t's slot-th choice. The experts' outputs come back in that same sorted
order. `combine` turns them into each token's output: every row back to its (token, slot)
place, weighted by the router's weight for that slot, summed over the k slots. The script runs
distkit.moe.ExpertParallel with your combine on N ranks (E/N experts each) and checks: two
probes of your function alone (every row back at its token; the router's weights applied), then
the layer's outputs, its cross-entropy loss and every gradient against one process running all
the experts on all the ranks' tokens.
Fill in the TODO(you) part, replacing the todo(...) call with your code. Run the script at any
time: it stops at the first todo() left and says what is missing.
`make exercise EX=09.3` checks it at 2 and 3 ranks with --top-k 3.
Solution, with the answers to the questions below: ../solutions/ex09_ep_combine.py.

Predict, then measure:
1. `order` is a permutation. Is "row i back to place order[i]" the same as taking rows in the
   order `order` gives? What goes wrong if you gather (expert_out[order]) instead of scatter?
2. Your combine has no communication, yet the router's weights get gradients on every rank.
   Where do the experts' gradients come from, on the rank that holds them?
3. DeepSeek-V3 routes to 8 of 256 experts and weights by a sigmoid, not a softmax. What in your
   combine changes?
"""
import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F

from distkit import print0, seed_everything, setup, teardown, todo, write_json
from distkit.moe import ExpertParallel, moe, route

# float32 (the grouped GEMM refuses float64 on a CPU). EP adds the same products in another
# order: measured (N = 2, 3) outputs 0.0, loss <= 4.0e-7, gradients <= 3.8e-8. A row at the wrong
# token, or an unweighted sum, is off by ~0.1 or more.
TOL = {"outputs": 1e-5, "loss": 1e-5, "gradients": 1e-6}

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--experts", type=int, default=6, help="experts (E), a multiple of N")
parser.add_argument("--top-k", type=int, default=2, help="experts per token (k)")
parser.add_argument("--tokens", type=int, default=24, help="tokens per rank")
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--json", help="write the checks' results here (rank 0)")
args = parser.parse_args()
world = int(os.environ.get("WORLD_SIZE", 1))
if args.experts % world or not 1 <= args.top_k <= args.experts or args.tokens < 1:
    parser.error(f"--experts must be a multiple of {world} processes, 1 <= --top-k <= "
                 "--experts, --tokens >= 1")


def combine(expert_out, order, weights):
    """expert_out (T k, H): the outputs of the sorted pairs, row i for pair order[i] (its token
    order[i] // k, its slot order[i] % k); weights (T, k) the router's. -> (T, H)."""
    # TODO(you): undo the sort: row i belongs at position order[i] of the (token, slot) pairs; then
    # view them as (T, k, H), weight each slot by the router and add up the k slots. Look up:
    # indexing assignment (out[idx] = rows), Tensor.view, unsqueeze.
    todo("each token's output from the sorted expert outputs")


class Experts(torch.nn.Module):
    """This rank's experts, stored as transformers' MixtralExperts stores them."""

    def __init__(self, gate_up, down):
        super().__init__()
        self.gate_up_proj = torch.nn.Parameter(gate_up.clone())
        self.down_proj = torch.nn.Parameter(down.clone())


env = setup()
N, r = env.world_size, env.rank
E, k, T, Hd, Im, V = args.experts, args.top_k, args.tokens, 16, 32, 16
seed_everything(args.seed)
x = torch.randn(N * T, Hd)  # every rank's tokens; rank r has rows r T ... (r+1) T - 1
labels = torch.randint(0, V, (N * T,))
router = (0.5 * torch.randn(E, Hd)).requires_grad_()
gate_up = (0.3 * torch.randn(E, 2 * Im, Hd)).requires_grad_()
down = (0.3 * torch.randn(E, Hd, Im)).requires_grad_()
head = 0.3 * torch.randn(V, Hd)  # a fixed output layer, for a real loss
# drawn on the CPU (the same numbers on any machine), then onto this rank's device
x, labels, head = x.to(env.device), labels.to(env.device), head.to(env.device)
router, gate_up, down = (t.detach().to(env.device).requires_grad_()
                         for t in (router, gate_up, down))
results = {}

# 1. probes of combine alone: (a) every row back at its token, (b) the router's weights applied
_, weights, experts = route(x[:T], router.detach(), k)
order = torch.argsort(experts.reshape(-1), stable=True)
# (a) row i carries its token's number + 1: each token's output must be that number times one
# constant (the sum of its weights, whatever the weighting)
token_of_row = (order // k + 1).float().unsqueeze(-1)
back = combine(token_of_row, order, torch.full((T, k), 1 / k, device=env.device)).squeeze(-1)
ratio = back / (torch.arange(T, device=env.device) + 1)
results["rows back at their tokens"] = bool(torch.allclose(ratio, ratio[0].expand(T)))
# (b) rows of ones: each token's output must be the sum of its router weights (1)
ones = combine(torch.ones(T * k, 1, device=env.device), order, weights.detach())
results["weighted by the router"] = bool(torch.allclose(ones.squeeze(-1), weights.sum(-1)))

# 2. the reference: one process, all experts, every rank's tokens
ref_out = moe(x, router, gate_up, down, k)
ref_loss = F.cross_entropy(ref_out @ head.T, labels)
ref_loss.backward()

# 3. expert parallelism with your combine: this rank's tokens, its E/N experts
lo, hi = r * E // N, (r + 1) * E // N
mine = Experts(gate_up.detach()[lo:hi], down.detach()[lo:hi])
my_router = router.detach().clone().requires_grad_()
_, weights, experts = route(x[r * T:(r + 1) * T], my_router, k)
out = ExpertParallel(mine, E, combine_fn=combine)(x[r * T:(r + 1) * T], weights, experts)
loss = F.cross_entropy(out @ head.T, labels[r * T:(r + 1) * T])  # the mean over my tokens
loss.backward()
# the global loss is the mean of the ranks' means: experts' gradients (summed over every rank's
# loss by the all-to-all's backward) and the replicated router's (averaged) divided by N
if my_router.grad is None:  # no gradient reached the router through the combine's weights
    my_router.grad = torch.zeros_like(my_router)
dist.all_reduce(my_router.grad)
errors = torch.tensor([
    (out - ref_out[r * T:(r + 1) * T]).abs().max().item(),
    max((mine.gate_up_proj.grad / N - gate_up.grad[lo:hi]).abs().max().item(),
        (mine.down_proj.grad / N - down.grad[lo:hi]).abs().max().item(),
        (my_router.grad / N - router.grad).abs().max().item())], device=env.device)
total = loss.detach().clone()
dist.all_reduce(total)
dist.all_reduce(errors, op=dist.ReduceOp.MAX)
results["outputs"] = errors[0].item()
results["gradients"] = errors[1].item()
results["loss"] = abs(total.item() / N - ref_loss.item())
for what in ("rows back at their tokens", "weighted by the router"):
    print0(f"probe: {what}: {results[what]}")
for what, tol in TOL.items():
    print0(f"EP vs one process, {what:9s}: max |difference| < {tol:.0e}: {results[what] < tol}")
write_json(args.json, {"world_size": N, "experts": E, "top_k": k, "tokens": T,
                       "tolerance": TOL, **results})
teardown()

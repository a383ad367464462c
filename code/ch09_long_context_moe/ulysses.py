"""Ulysses by hand: attention over a sequence split across ranks by all-to-alls over the heads.

    code/run_w_torchrun.sh 2 ch09_long_context_moe/ulysses.py --json /tmp/ulysses.json

As ring_attention.py: every rank builds the same q, k, v for the whole sequence and computes the
reference (SDPA over all of it, forward and backward), then keeps its own S/N tokens and runs
distkit.cp.ulysses_attention: an all-to-all per tensor turns "every head of my S/N tokens" into
"H/N heads of all S tokens", SDPA runs on those, and one all-to-all turns the output back. The
all-to-all is torch's differentiable one (torch.distributed._functional_collectives
.all_to_all_single_autograd): the backward runs the same exchanges in reverse. Checked: output
and gradients against the reference's rows of this rank, in float64 and float32; every
all-to-all's bytes, logged as torch dispatches it (distkit.comm.CollectiveLog), against the
formula; and the head-count limit: key/value heads that do not divide by N are refused.
"""
import argparse
import os

import torch
import torch.distributed as dist

from distkit import print0, seed_everything, setup, teardown, write_json
from distkit.comm import CollectiveLog
from distkit.cp import reference_attention, ulysses_attention, ulysses_bytes

# Ulysses runs the same SDPA kernel on the same rows of each head as the reference: measured
# 0.0 in both dtypes (N = 2 and 4; and N = 2 with the scalar kernels). The bounds allow a
# kernel that tiles a longer sequence differently, and stay far below a head sent to the wrong
# rank (errors ~1).
TOL = {torch.float64: 1e-12, torch.float32: 1e-5}

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--seq", type=int, default=64, help="tokens in the whole sequence")
parser.add_argument("--batch", type=int, default=2, help="sequences")
parser.add_argument("--heads", type=int, default=4, help="query heads (divisible by N)")
parser.add_argument("--kv-heads", type=int, default=2,
                    help="key/value heads (grouped-query attention; divisible by N)")
parser.add_argument("--head-dim", type=int, default=16)
parser.add_argument("--no-causal", dest="causal", action="store_false",
                    help="attend to every token, not only earlier ones")
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--json", help="write errors and bytes here (rank 0)")
args = parser.parse_args()
world = int(os.environ.get("WORLD_SIZE", 1))
if min(args.seq, args.batch, args.heads, args.kv_heads, args.head_dim) < 1:
    parser.error("--seq, --batch, --heads, --kv-heads and --head-dim must be >= 1")
if args.heads % args.kv_heads:
    parser.error(f"--heads {args.heads} must be a multiple of --kv-heads {args.kv_heads}")
if args.seq % world or args.heads % world or args.kv_heads % world:
    parser.error(f"--seq, --heads and --kv-heads must be multiples of {world} processes")

env = setup()
N, r = env.world_size, env.rank
B, H, H_kv, S, D = args.batch, args.heads, args.kv_heads, args.seq, args.head_dim
print0(f"Ulysses on {N} ranks: batch {B}, {H} query heads, {H_kv} key/value heads, {S} tokens "
       f"({S // N} per rank), head size {D}, causal: {args.causal}")


def max_over_ranks(x: float) -> float:
    t = torch.tensor(x, dtype=torch.float64, device=env.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


results = {}
mine = torch.arange(r * S // N, (r + 1) * S // N)  # contiguous: every rank attends all tokens
for dtype in (torch.float64, torch.float32):
    seed_everything(args.seed)
    q = torch.randn(B, H, S, D, dtype=dtype, requires_grad=True)
    k = torch.randn(B, H_kv, S, D, dtype=dtype, requires_grad=True)
    v = torch.randn(B, H_kv, S, D, dtype=dtype, requires_grad=True)
    grad_out = torch.randn(B, H, S, D, dtype=dtype)
    # drawn on the CPU (the same numbers on any machine), then onto this rank's device
    q, k, v = (t.detach().to(env.device).requires_grad_() for t in (q, k, v))
    grad_out = grad_out.to(env.device)
    full = reference_attention(q, k, v, args.causal)
    full.backward(grad_out)
    ql, kl, vl = (t.detach()[:, :, mine].clone().requires_grad_() for t in (q, k, v))
    with CollectiveLog() as log:
        out = ulysses_attention(ql, kl, vl, causal=args.causal)
        out.backward(grad_out[:, :, mine])
    errors = {"out": (out - full[:, :, mine]).abs().max().item()}
    for what, mine_grad, ref in (("dq", ql, q), ("dk", kl, k), ("dv", vl, v)):
        errors[what] = (mine_grad.grad - ref.grad[:, :, mine]).abs().max().item()
    errors = {k_: max_over_ranks(e) for k_, e in errors.items()}
    # each all-to-all sends (N-1)/N of its input (the rest stays on this rank)
    sent = {"forward bytes": 0, "backward bytes": 0}
    for c in log.collectives:
        assert c.op == "all_to_all", c.op
        sent["backward bytes" if c.backward else "forward bytes"] += c.nbytes * (N - 1) // N
    results[str(dtype)[6:]] = {
        "errors": errors, "tolerance": TOL[dtype], "parity": max(errors.values()) < TOL[dtype],
        "all_to_alls": {"forward": sum(not c.backward for c in log.collectives),
                        "backward": sum(c.backward for c in log.collectives)},
        "bytes": sent, "formula": ulysses_bytes(N, B, H, H_kv, S, D, q.element_size())}

print0(f"{'dtype':8s} {'max |out|, |dq|, |dk|, |dv| error':34s} {'all-to-alls':>11s} "
       f"{'sent forward':>12s} {'backward':>9s}  = formula")
for dtype, res in results.items():
    bound = f"< {res['tolerance']:.0e}: {res['parity']}"
    calls = f"{res['all_to_alls']['forward']} + {res['all_to_alls']['backward']}"
    print0(f"{dtype:8s} {bound:34s} {calls:>11s} {res['bytes']['forward bytes']:>12,} "
           f"{res['bytes']['backward bytes']:>9,}  {res['bytes'] == res['formula']}")

# The limit: each rank takes whole heads. One key/value head cannot be split over N > 1 ranks.
refused = None
if N > 1:
    x = torch.zeros(B, H, S // N, D, device=env.device)
    try:
        ulysses_attention(x, x[:, :1], x[:, :1], causal=args.causal)
    except ValueError as e:
        refused = str(e)
    print0(f"with 1 key/value head: {refused}")
ok = all(res["parity"] and res["bytes"] == res["formula"] for res in results.values()) \
    and (refused is not None or N == 1)
print0(f"every check passed: {ok}")  # make gpu-smoke looks for this line
write_json(args.json, {"ok": ok, "world_size": N, "batch": B, "heads": H, "kv_heads": H_kv,
                       "seq": S, "head_dim": D, "causal": args.causal, "results": results,
                       "refused": refused})
teardown()

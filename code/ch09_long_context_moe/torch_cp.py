"""torch's context_parallel(): what it patches, which kernels it needs, and its ring on a CPU.

    code/run_w_torchrun.sh 2 ch09_long_context_moe/torch_cp.py --json /tmp/torch_cp.json

`context_parallel(mesh, buffers=..., buffer_seq_dims=...)` (torch.distributed.tensor.experimental,
a prototype API in torch 2.13) does two things for the length of its `with` block: it shards the
buffers along their sequence dimension in place, in head-tail order (its default load balancing,
meant for causal attention; contiguous chunks if the length does not divide by 2N), and it
replaces F.scaled_dot_product_attention by a wrapper that turns q, k, v into DTensors sharded
on the tokens. DTensor then sends SDPA's CUDA kernels (flash, memory-efficient and cuDNN
attention, forward and backward) to ring versions of them. This script shows the patch and the
sharding, then runs one causal attention, forward and backward, through it:
- on a GPU (`make gpu-smoke`): against SDPA over the whole sequence;
- on a CPU it cannot: SDPA takes the CPU flash kernel, which has no sharding rule, and the
  script shows the error. It then runs the ring torch would run on a GPU, its private
  `_templated_ring_attention` and `_templated_ring_attention_backward`, with the CPU kernel
  plugged in, checks it against the reference and logs its collectives for both of torch's
  ways of moving K/V ("allgather", the default, and "alltoall").
"""
import argparse
import os
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.experimental import context_parallel

from distkit import print0, seed_everything, setup, teardown, write_json
from distkit.comm import CollectiveLog
from distkit.cp import head_tail, reference_attention, token_order

try:  # torch 2.13 keeps the implementation here; older releases in experimental/_attention.py
    from torch.distributed.tensor.experimental._context_parallel import _attention as cp_impl
except ImportError:
    from torch.distributed.tensor.experimental import _attention as cp_impl

aten = torch.ops.aten
# torch's merge accumulates in float32 (cp_impl._cp_options.convert_to_f32 = True), so float64
# inputs come back within float32 rounding: measured <= 5.0e-7 (N = 2, both rotations, native
# and scalar kernels). On a GPU
# the kernels run in bf16: 8 bits of mantissa, relative error ~1e-2 at worst.
TOL_CPU_RING, TOL_BF16_RELATIVE = 1e-5, 3e-2

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--seq", type=int, default=64, help="tokens in the whole sequence")
parser.add_argument("--batch", type=int, default=2)
parser.add_argument("--heads", type=int, default=4)
parser.add_argument("--head-dim", type=int, default=16,
                    help="head size (CUDA flash attention: a multiple of 8)")
parser.add_argument("--json", help="write what was seen here (rank 0)")
args = parser.parse_args()
world = int(os.environ.get("WORLD_SIZE", 1))
if min(args.seq, args.batch, args.heads, args.head_dim) < 1:
    parser.error("--seq, --batch, --heads and --head-dim must be >= 1")
if args.seq % (2 * world):  # the head-tail order cuts the sequence in 2N chunks
    parser.error(f"--seq {args.seq} must be a multiple of 2 x {world} processes")

env = setup()
N, r, device = env.world_size, env.rank, env.device
B, H, S, D = args.batch, args.heads, args.seq, args.head_dim
mesh = init_device_mesh(device.type, (N,), mesh_dim_names=("cp",))
# a GPU runs the kernels context_parallel() supports in bf16; the CPU check uses float64
dtype = torch.bfloat16 if device.type == "cuda" else torch.float64
seed_everything(0)
q, k, v, grad_out = (torch.randn(B, H, S, D, device=device, dtype=dtype) for _ in range(4))
# the reference: one process, the whole sequence, forward and backward
qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
full = reference_attention(qr, kr, vr, causal=True)
full.backward(grad_out)
ht = token_order(head_tail(N), S).view(N, -1)[r]  # distkit.cp's head-tail order, this rank
seen = {"device": device.type, "dtype": str(dtype)[6:]}

original = F.scaled_dot_product_attention
buffers = [t.clone() for t in (q, k, v, grad_out)]
with context_parallel(mesh, buffers=buffers, buffer_seq_dims=[2, 2, 2, 2]):
    patched = F.scaled_dot_product_attention
    seen["patched"] = patched is not original
    seen["wrapper"] = f"{patched.__module__}.{patched.__qualname__}"
    handled = [str(op) for op in DTensor._op_dispatcher._custom_op_handlers
               if "scaled_dot_product" in str(op)]
    seen["handled ops"] = sorted(handled)
    seen["local shape"] = list(buffers[0].shape)
    seen["head-tail = distkit.cp"] = bool(torch.equal(buffers[0], q[:, :, ht]))
    ql, kl, vl = (t.detach().requires_grad_() for t in buffers[:3])
    try:
        out = F.scaled_dot_product_attention(ql, kl, vl, is_causal=True)
        out.backward(buffers[3])
        seen["error"] = None
    except Exception as e:  # the CPU: no sharding rule for the CPU kernel
        seen["error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[0]}"
seen["restored"] = F.scaled_dot_product_attention is original
print0(f"inside the with: F.scaled_dot_product_attention replaced: {seen['patched']} "
       f"(by {seen['wrapper']}); after it, restored: {seen['restored']}")
print0("DTensor's handlers for SDPA inside it (ring versions):\n  "
       + "\n  ".join(seen["handled ops"]))
print0(f"each buffer sharded in place: (B, H, S, D) = {[B, H, S, D]} -> {seen['local shape']} "
       f"on each rank, in distkit.cp's head-tail order: {seen['head-tail = distkit.cp']}")

if seen["error"] is None:  # a GPU: the ring ran; compare with the whole-sequence reference
    errors = {"out": (out.float() - full[:, :, ht].float()).abs().max() / full.abs().max()}
    for what, mine, ref in (("dq", ql, qr), ("dk", kl, kr), ("dv", vl, vr)):
        errors[what] = ((mine.grad.float() - ref.grad[:, :, ht].float()).abs().max()
                        / ref.grad.abs().max())
    worst = torch.stack(list(errors.values()))
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    seen["relative errors"] = dict(zip(errors, worst.tolist()))
    seen["parity"] = bool(worst.max() < TOL_BF16_RELATIVE)
    print0(f"causal SDPA through context_parallel() on {N} GPUs, bf16: max relative error of "
           f"the output and dq, dk, dv < {TOL_BF16_RELATIVE:.0e}: {seen['parity']}")
else:
    print0(f"on the CPU, SDPA under context_parallel() fails:\n  {seen['error']}")
    # what torch runs on a GPU, with the CPU kernel in place of the CUDA one (private API)
    ql, kl, vl, gl = (t[:, :, ht].contiguous() for t in (q, k, v, grad_out))
    seen["ring"] = {}
    for rotate in ("allgather", "alltoall"):
        cp_impl.set_rotate_method(rotate)
        cp_impl._cp_options.enable_load_balance = True  # the local chunks are head-tail
        with CollectiveLog() as forward:
            out, lse, *_ = cp_impl._templated_ring_attention(
                mesh.get_group(), 2, aten._scaled_dot_product_flash_attention_for_cpu,
                ql, kl, vl, is_causal=True)
        with CollectiveLog() as backward:
            dq, dk, dv, *_ = cp_impl._templated_ring_attention_backward(
                mesh.get_group(), 2, aten._scaled_dot_product_flash_attention_for_cpu_backward
                .default, grad_out=gl, grad_out_name="grad_out", query=ql, key=kl, value=vl,
                out=out, logsumexp=lse, is_causal=True, dropout_p=0.0)
        err = torch.stack([(a - b[:, :, ht]).abs().max() for a, b in
                           ((out, full), (dq, qr.grad), (dk, kr.grad), (dv, vr.grad))])
        dist.all_reduce(err, op=dist.ReduceOp.MAX)
        calls = {when: [(c.op, c.nbytes, c.dtype[6:]) for c in log.collectives]
                 for when, log in (("forward", forward), ("backward", backward))}
        seen["ring"][rotate] = {"max error": err.max().item(),
                                "parity": bool(err.max() < TOL_CPU_RING), "collectives": calls}
        print0(f"torch's ring, rotation '{rotate}': output and dq, dk, dv within "
               f"{TOL_CPU_RING:.0e} of the whole-sequence reference: "
               f"{seen['ring'][rotate]['parity']}")
        for when, ops in calls.items():  # bytes: all-gather's output, all-to-all's input
            print0(f"  {when:8s}: " + ", ".join(f"{op} {n:,} B ({t})" for op, n, t in ops))
    cp_impl.set_rotate_method("allgather")
ok = seen["parity"] if seen["error"] is None else all(r_["parity"] for r_ in seen["ring"].values())
print0(f"every check passed: {ok}")  # make gpu-smoke looks for this line
write_json(args.json, {"ok": ok, "world_size": N, "batch": B, "heads": H, "seq": S, "head_dim": D,
                       **seen})
with warnings.catch_warnings():
    teardown()

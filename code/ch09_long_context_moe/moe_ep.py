"""Expert parallelism by hand, inside a transformers Mixtral: N ranks train as one process would.

    code/run_w_torchrun.sh 2 ch09_long_context_moe/moe_ep.py --json /tmp/moe_ep.json

A tiny Mixtral (every layer's MLP a mixture of E experts, top-k routing) is built from the same
seed on every rank. The reference: one process, the whole global batch, forward and backward.
Then each rank keeps its own sequences and only E/N of each layer's experts, and the experts'
forward is replaced by distkit.moe.ExpertParallel: the router (replicated) picks experts for this
rank's tokens; an all-to-all of counts, then of hidden states (uneven splits: as many rows as
the router sent to each rank's experts), the local experts as one grouped GEMM, an all-to-all
back, and the router-weighted sum. Checked: the mean of the ranks' losses against the
reference's; every gradient (the local experts' and, averaged over the ranks as data parallelism
would, the replicated weights') against the reference's. Counted: each layer's load per expert,
the rows each rank sends to each rank, and the bytes of every all-to-all (as torch dispatches
it, distkit.comm.CollectiveLog) against the formula.

Then the same experts inside FSDP2, as chapter 09 section 10 plans them (torchtitan's layout,
distkit.moe.apply_ep_fsdp): a mesh (efsdp, ep) of N = N/ep x ep ranks, E/ep experts per rank,
FSDP2 over the efsdp ranks that hold the same experts and over all N for the rest. Checked
twice against one process: with FSDP's default average for the experts (ep times too large: each
expert copy already sums its ep group's tokens) and with their divide factor set to N.
"""
import argparse
import os
import warnings

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from distkit import print0, print_ranks, seed_everything, setup, teardown, write_json
from distkit.comm import CollectiveLog
from distkit.moe import ExpertParallel, apply_ep_fsdp, expert_load, topk_margin
from distkit.toy import counting_data

# Float32 (F.grouped_mm refuses float64 on a CPU). The EP path adds the same products in another
# order (the experts' rows batched differently, the loss a mean of per-rank means). Measured,
# N = 2 and 4, and N = 2 with the scalar kernels: loss <= 4.8e-7, gradients <= 3.0e-8. Bounds
# 20x and 30x above; an unweighted combine or a row sent back to the wrong token is off by 1e-2
# or more.
LOSS_TOL, GRAD_TOL = 1e-5, 1e-6
# The loads and rows printed are portable only if no token sits near a tie between its k-th and
# (k+1)-th expert (rounding moves logits of ~0.3 by ~1e-7 between CPU kinds). Measured closest
# call at the defaults: 1.6e-3. Required: 1e-5.
MARGIN = 1e-5

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--experts", type=int, default=4, help="experts per layer (E)")
parser.add_argument("--top-k", type=int, default=2, help="experts per token (k)")
parser.add_argument("--layers", type=int, default=2)
parser.add_argument("--hidden", type=int, default=32)
parser.add_argument("--batch", type=int, default=2, help="sequences per rank")
parser.add_argument("--seq", type=int, default=32, help="tokens per sequence")
parser.add_argument("--ep", type=int, help="expert-parallel ranks inside FSDP2 (default: all; "
                    "the mesh is N/ep x ep)")
parser.add_argument("--json", help="write losses, errors, loads and bytes here (rank 0)")
args = parser.parse_args()
world = int(os.environ.get("WORLD_SIZE", 1))
if min(args.experts, args.top_k, args.layers, args.hidden, args.batch, args.seq) < 1:
    parser.error("--experts, --top-k, --layers, --hidden, --batch and --seq must be >= 1")
if args.top_k > args.experts or args.experts % world or args.hidden % 4:
    parser.error(f"need --top-k <= --experts, --experts a multiple of {world} processes and "
                 "--hidden a multiple of 4 (the attention heads)")
EP = args.ep or world
if EP < 2 or world % EP:
    parser.error(f"--ep {EP} must be >= 2 and divide the {world} processes")

with warnings.catch_warnings():  # transformers imports tqdm, which may warn about ipywidgets
    warnings.simplefilter("ignore")
    from transformers import MixtralConfig, MixtralForCausalLM

env = setup()
N, r = env.world_size, env.rank
E, k, H = args.experts, args.top_k, args.hidden
config = MixtralConfig(vocab_size=128, hidden_size=H, intermediate_size=2 * H,
                       num_hidden_layers=args.layers, num_attention_heads=4,
                       num_key_value_heads=2, num_local_experts=E, num_experts_per_tok=k,
                       max_position_embeddings=args.seq, tie_word_embeddings=False)
(tokens,) = counting_data(N * args.batch, seq_len=args.seq)[:]
tokens = tokens.to(env.device)
mine = tokens[r * args.batch:(r + 1) * args.batch]
T = args.batch * args.seq  # tokens per rank per layer

# The reference: one process, the whole global batch (transformers' grouped_mm experts).
seed_everything(0)
reference = MixtralForCausalLM(config).to(env.device)
reference.train()
ref_loss = reference(input_ids=tokens, labels=tokens).loss
ref_loss.backward()
print0(f"{N} ranks, {E} experts per layer ({E // N} per rank), top-{k}; each rank {T} tokens "
       f"per layer; hidden {H}")

# Expert parallelism: the same weights, this rank's experts only.
seed_everything(0)
model = MixtralForCausalLM(config).to(env.device)
model.train()
lo, hi = r * E // N, (r + 1) * E // N  # this rank's experts
layers = []
for layer in model.model.layers:
    experts = layer.mlp.experts
    experts.gate_up_proj = torch.nn.Parameter(experts.gate_up_proj.detach()[lo:hi].clone())
    experts.down_proj = torch.nn.Parameter(experts.down_proj.detach()[lo:hi].clone())
    ep = ExpertParallel(experts, num_experts=E)
    # MixtralSparseMoeBlock calls experts(hidden_states, top_k_index, top_k_weights)
    experts.forward = lambda x, index, weights, ep=ep: ep(x, weights, index)
    layers.append((layer, ep))

with CollectiveLog() as log:
    # each layer's router logits and choices, from its gate (transformers' MixtralTopKRouter)
    picks = []
    hooks = [layer.mlp.gate.register_forward_hook(lambda m, i, o: picks.append(o[::2]))
             for layer, _ in layers]
    loss = model(input_ids=mine, labels=mine).loss  # the mean over this rank's tokens
    loss.backward()
    for h in hooks:
        h.remove()
# The global loss is the mean of the ranks' means (equal token counts). Each local expert's
# gradient sums the contributions of every rank's loss: divide by N. The replicated weights
# (attention, norms, router, embeddings) are averaged over the ranks, as DDP/FSDP would.
for n, p in model.named_parameters():
    if ".experts." in n:
        p.grad /= N
    else:
        dist.all_reduce(p.grad)
        p.grad /= N
total = loss.detach().clone()
dist.all_reduce(total)
loss_diff = abs(total.item() / N - ref_loss.item())
ref_params = dict(reference.named_parameters())
errors = {}
for n, p in model.named_parameters():
    ref = ref_params[n].grad[lo:hi] if ".experts." in n else ref_params[n].grad
    errors[n] = (p.grad - ref).abs().max().item()
worst = torch.tensor(max(errors.values()), device=env.device)
dist.all_reduce(worst, op=dist.ReduceOp.MAX)
parity = loss_diff < LOSS_TOL and worst.item() < GRAD_TOL

# Per layer: the load of each expert over all ranks, and the rows this rank sent to each rank
loads = []
for _, layer_picks in picks:
    load = torch.tensor(expert_load(layer_picks, E), device=env.device)
    dist.all_reduce(load)
    loads.append(load.tolist())
margin = torch.tensor(min(topk_margin(logits, k) for logits, _ in picks), device=env.device)
dist.all_reduce(margin, op=dist.ReduceOp.MIN)  # the closest call of any rank, any layer
sent = [ep.stats["send_sizes"] for _, ep in layers]
row = H * 4  # one hidden state in float32
# What torch dispatched, per layer: the counts (int64), then this rank's T x k rows to the
# experts' ranks, and the rows its own experts computed back to their senders; the backward
# sends the gradients of those two, layers in reverse. Bytes: each all-to-all's input.
calls = [(c.op, c.nbytes, c.dtype[6:], c.backward) for c in log.collectives]
received = [sum(ep.stats["recv_sizes"]) for _, ep in layers]
expected = [nb for rows in received for nb in (E * 8, T * k * row, rows * row)] \
    + [nb for rows in reversed(received) for nb in (T * k * row, rows * row)]
calls_ok = [c[1] for c in calls] == expected
# --- 2. inside FSDP2: the experts over efsdp, the rest over every rank -------------------------
mesh = init_device_mesh(env.device.type, (N // EP, EP), mesh_dim_names=("efsdp", "ep"))
everyone = mesh["efsdp", "ep"]._flatten("all")
e_lo = mesh.get_local_rank("ep") * E // EP  # this rank's experts: E/ep from e_lo
fsdp = {}
for divide in (False, True):
    seed_everything(0)
    sharded = MixtralForCausalLM(config).to(env.device)
    sharded.train()
    apply_ep_fsdp(sharded, mesh, everyone, divide_experts=divide)
    sharded(input_ids=mine, labels=mine).loss.backward()  # FSDP2 reduces the gradients
    ratios, worst_fsdp = {"experts": [], "dense": []}, 0.0
    for n, p in sharded.named_parameters():
        grad = p.grad.full_tensor()  # this rank's experts, or the whole dense weight
        ref = ref_params[n].grad[e_lo:e_lo + E // EP] if ".experts." in n else ref_params[n].grad
        worst_fsdp = max(worst_fsdp, (grad - ref).abs().max().item())
        ratios["experts" if ".experts." in n else "dense"].append((grad.norm() / ref.norm()).item())
    worst_t = torch.tensor(worst_fsdp, device=env.device)
    dist.all_reduce(worst_t, op=dist.ReduceOp.MAX)
    fsdp["divide N" if divide else "FSDP default"] = {
        "max_grad_diff": worst_t.item(), "parity": worst_t.item() < GRAD_TOL,
        "experts_ratio": [min(ratios["experts"]), max(ratios["experts"])],
        "dense_ratio": [min(ratios["dense"]), max(ratios["dense"])]}
    del sharded
fsdp_ok = fsdp["divide N"]["parity"] and not fsdp["FSDP default"]["parity"]

print0(f"loss (mean over the ranks) vs one process: |difference| < {LOSS_TOL:.0e}: "
       f"{loss_diff < LOSS_TOL}; every gradient (experts: this rank's E/N) < {GRAD_TOL:.0e}: "
       f"{worst.item() < GRAD_TOL}")
for i, load in enumerate(loads):
    print0(f"layer {i}: (token, expert) pairs per expert {load} (of {N * T * k}; "
           f"even would be {N * T * k // E} each)")
print0(f"no near-tie: no token's choices no. {k} and {k + 1} lie within {MARGIN:.0e} in "
       f"logit (these counts are the same on any CPU): {margin.item() >= MARGIN}")
print_ranks("rows sent to rank 0, 1, ... per layer: "
            + "; ".join(str(s) for s in sent)
            + f" ({T * k} pairs; to other ranks: "
            + ", ".join(f"{(T * k - s[r]) * row:,} B" for s in sent) + ")")
print_ranks(f"all-to-alls of one step: {sum(not c[3] for c in calls)} forward, "
            f"{sum(c[3] for c in calls)} backward; bytes = the counts (E x 8 B), the {T * k} "
            f"rows this rank routes, the {received} rows its experts ran (x {H} x 4 B), "
            f"then their gradients: {calls_ok}")
print0(f"inside FSDP2, mesh efsdp {N // EP} x ep {EP} ({E // EP} experts per rank): every "
       f"gradient vs one process's, |gradient| / one process's")
for name, r in fsdp.items():
    e, d_ = r["experts_ratio"], r["dense_ratio"]
    print0(f"  experts' divide factor: {name:12s} < {GRAD_TOL:.0e}: {str(r['parity']):5s}  "
           f"experts x{e[0]:.2f} to x{e[1]:.2f}, dense x{d_[0]:.2f} to x{d_[1]:.2f}")
ok = parity and calls_ok and fsdp_ok
print0(f"every check passed: {ok}")  # make gpu-smoke looks for this line
write_json(args.json, {
    "ok": ok,
    "world_size": N, "experts": E, "top_k": k, "hidden": H, "tokens_per_rank": T,
    "loss": total.item() / N, "reference_loss": ref_loss.item(), "loss_diff": loss_diff,
    "max_grad_diff": worst.item(), "parity": parity, "loads": loads,
    "router_margin": margin.item(),
    "sent": sent, "received": received, "collectives": calls,
    "collectives_expected": calls_ok, "ep": EP, "fsdp": fsdp, "fsdp_ok": fsdp_ok,
    "local_shapes": {"gate_up_proj": list(layers[0][0].mlp.experts.gate_up_proj.shape),
                     "down_proj": list(layers[0][0].mlp.experts.down_proj.shape)}})
teardown(ok)  # a failed check fails the launch

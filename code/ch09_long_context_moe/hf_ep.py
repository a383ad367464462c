"""transformers' own expert parallelism: DistributedConfig(ep_size=N), checked against one process.

    code/run_w_torchrun.sh 2 ch09_long_context_moe/hf_ep.py --json /tmp/hf_ep.json

The tiny Mixtral of moe_ep.py, saved by rank 0 (save_pretrained, into a temporary folder that
this script removes at the end), is loaded on every rank with
`from_pretrained(..., distributed_config=DistributedConfig(ep_size=N, fsdp_size=N))`
(transformers 5.23, transformers/distributed/): each rank keeps E/N of every layer's experts,
the model's `base_model_ep_plan` routes tokens to them with all-to-alls (its AllToAllEP, the
steps moe_ep.py writes by hand), and FSDP2 shards everything else over the N ranks. Each rank
trains on its own sequences; the mean of the ranks' losses, and every gradient (gathered with
full_tensor()), must be one process's on the whole batch. Shown: where the experts went
(placements, local shapes) and the step's collectives.
"""
import argparse
import logging
import os
import shutil
import tempfile
import warnings

import torch.distributed as dist
from torch.distributed.tensor import DTensor

from distkit import print0, seed_everything, setup, teardown, write_json
from distkit.comm import CollectiveLog
from distkit.toy import counting_data

# transformers' EP against one process, float32: measured loss <= 4.8e-7, gradients <= 3.0e-8
# (N = 2; native and scalar kernels). Bounds 20x and 30x above; far below a token at the wrong
# expert.
LOSS_TOL, GRAD_TOL = 1e-5, 1e-6

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--experts", type=int, default=4, help="experts per layer (E)")
parser.add_argument("--batch", type=int, default=2, help="sequences per rank")
parser.add_argument("--seq", type=int, default=32, help="tokens per sequence")
parser.add_argument("--json", help="write losses, errors, placements and collectives here")
args = parser.parse_args()
world = int(os.environ.get("WORLD_SIZE", 1))
if min(args.experts, args.batch, args.seq) < 1 or args.experts % world or args.experts < 2:
    parser.error(f"need --batch, --seq >= 1 and --experts >= 2 a multiple of {world} processes")

with warnings.catch_warnings():  # transformers imports tqdm, which may warn about ipywidgets
    warnings.simplefilter("ignore")
    from transformers import AutoModelForCausalLM, MixtralConfig, MixtralForCausalLM
    from transformers.distributed.configuration_utils import DistributedConfig
    from transformers.utils import logging as hf_logging
hf_logging.disable_progress_bar()  # "Loading weights" bars, one per rank
# full_tensor() of a parameter sharded on two mesh dimensions warns that it takes "2 sequential
# all_gather operations" (torch/distributed/tensor/_redistribute.py): expected here, and quiet
logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)

env = setup()
N, r, E = env.world_size, env.rank, args.experts
config = MixtralConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, num_local_experts=E,
                       num_experts_per_tok=2, max_position_embeddings=args.seq,
                       tie_word_embeddings=False)
folder = [tempfile.mkdtemp(prefix="ch09_tiny_mixtral_") if r == 0 else None]
dist.broadcast_object_list(folder)  # one folder, rank 0's: the ranks may not share /tmp's name
folder = folder[0]
if r == 0:
    seed_everything(0)
    MixtralForCausalLM(config).save_pretrained(folder)
dist.barrier()
(tokens,) = counting_data(N * args.batch, seq_len=args.seq)[:]
tokens = tokens.to(env.device)
mine = tokens[r * args.batch:(r + 1) * args.batch]

# the reference: one process, the whole global batch, from the saved weights
reference = AutoModelForCausalLM.from_pretrained(folder).to(env.device)
reference.train()
ref_loss = reference(input_ids=tokens, labels=tokens).loss
ref_loss.backward()

ep_config = DistributedConfig(ep_size=N, fsdp_size=N)
model = AutoModelForCausalLM.from_pretrained(folder, distributed_config=ep_config)
model.train()
experts = model.model.layers[0].mlp.experts.gate_up_proj
dense = model.model.layers[0].self_attn.q_proj.weight
with CollectiveLog() as log:
    loss = model(input_ids=mine, labels=mine).loss  # the mean over this rank's tokens
    loss.backward()
total = loss.detach().clone()
dist.all_reduce(total)
loss_diff = abs(total.item() / N - ref_loss.item())
ref_params = dict(reference.named_parameters())
errors = {}
for name, p in model.named_parameters():
    grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
    errors[name] = (grad - ref_params[name].grad).abs().max().item()
worst = max(errors.values())
calls = {}
for c in log.collectives:
    key = f"{c.op} ({'backward' if c.backward else 'forward'}) over {len(c.ranks)} ranks"
    calls[key] = calls.get(key, 0) + 1
print0(f"DistributedConfig(ep_size={ep_config.ep_size}, fsdp_size={ep_config.fsdp_size}) on {N} "
       f"ranks; {E} experts per layer")
print0(f"layer 0 experts.gate_up_proj: global {tuple(experts.shape)}, on each rank "
       f"{tuple(experts.to_local().shape)}, placements {experts.placements}")
print0(f"layer 0 self_attn.q_proj.weight: global {tuple(dense.shape)}, on each rank "
       f"{tuple(dense.to_local().shape)}, placements {dense.placements}")
print0(f"mean of the ranks' losses vs one process: |difference| < {LOSS_TOL:.0e}: "
       f"{loss_diff < LOSS_TOL}; every gradient < {GRAD_TOL:.0e}: {worst < GRAD_TOL}")
print0("collectives of one step: " + ", ".join(f"{n} x {k}" for k, n in sorted(calls.items())))
ok = loss_diff < LOSS_TOL and worst < GRAD_TOL
print0(f"every check passed: {ok}")  # make gpu-smoke looks for this line
write_json(args.json, {
    "ok": ok,
    "world_size": N, "experts": E, "loss": total.item() / N, "reference_loss": ref_loss.item(),
    "loss_diff": loss_diff, "max_grad_diff": worst,
    "parity": loss_diff < LOSS_TOL and worst < GRAD_TOL,
    "experts_placements": [str(p) for p in experts.placements],
    "experts_local_shape": list(experts.to_local().shape),
    "dense_placements": [str(p) for p in dense.placements], "collectives": calls})
dist.barrier()  # every rank has loaded the folder: rank 0 removes what it made
if r == 0:
    shutil.rmtree(folder)
teardown()

"""LoRA adapters on a frozen Llama, sharded with FSDP2: gradients and AdamW state only for the
adapters.

    code/run_w_torchrun.sh 2 ch04_fsdp2/lora_fsdp2.py --json build/ch04/lora_fsdp2.json

peft's LoRA freezes every weight of the model and adds to each adapted Linear(in, out) two small
trainable matrices, A (r x in) and B (out x r), B starting at zero: y = W x + (alpha / r) B A x.
Only r * (in + out) numbers per Linear are trained. Here the adapters sit on attention's q, k, v,
o and the MLP's gate, up, down projections of the tiny transformers Llama (seeded random weights:
enough to show the mechanics). Each decoder layer is one FSDP2 unit holding its frozen base
weights and their trainable adapters together, then the root unit (embeddings, norm, LM head).
The run prints: trainable vs total parameters; each rank's bytes of parameters, gradients and
AdamW state after the first step, measured by FSDPMemTracker, against full fine-tuning of the
same model under FSDP2 in the same launch; the losses against one process training the same
adapters on the whole batch; and that the frozen shards did not change by a single bit.

Why FSDP1 needed a wrap policy for LoRA and FSDP2 does not (torch 2.13's source):
- FSDP1 flattens all parameters of a unit into one FlatParameter, which has a single
  requires_grad. torch/distributed/fsdp/_flat_param.py, _validate_tensors_to_flatten, raises
  "Must flatten tensors with uniform `requires_grad` when `use_orig_params=False`"; with an
  auto_wrap_policy, _wrap_utils.py (_validate_frozen_params) rejects such a unit before wrapping
  ("FSDP does not support wrapping such modules when use_orig_params=False"). use_orig_params=True
  allows the mix, with a warning: the flat gradient is as big as the whole unit, frozen part
  included ("the gradient memory usage will be higher than expected"). So people gave every
  trainable leaf its own unit ("wrap the frozen parameters with FSDP separately"): peft's
  fsdp_auto_wrap_policy (peft/utils/other.py) ORs a lambda_auto_wrap_policy for "leaf module
  whose weight requires grad" (each lora_A, lora_B Linear) with the transformer-layer policy.
- FSDP2 has no FlatParameter: fully_shard makes one FSDPParam per parameter
  (_fsdp_param_group.py), each its own DTensor that keeps the original requires_grad
  (_fsdp_param.py: nn.Parameter(self.to_sharded_dtensor(...), requires_grad=param.requires_grad)).
  After backward, post_backward reduce-scatters only the parameters whose unsharded .grad is not
  None: frozen weights get no gradient, so they cost no gradient bytes and no communication
  (they are still all-gathered for forward and backward: the layer needs them). A mixed unit
  is plain FSDP2; the same two fully_shard lines as for full fine-tuning.
"""
import argparse
import contextlib
import math
import os
import time
import warnings

import torch
import torch.distributed as dist
from peft import LoraConfig, get_peft_model
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard

from distkit import print0, seed_everything, setup, teardown, write_json
from distkit.dist import grad_check, grad_norms
from distkit.memory import by_category
from distkit.toy import counting_data, tiny_llama

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
HIDDEN, BATCH_SIZE, LR = 64, 4, 1e-2  # tiny_llama's width; sequences per rank; LoRA likes a high LR
CATEGORIES = {"params": "Sharded Param", "grads": "Sharded Grad", "optimizer": "OptState"}

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--rank", type=int, default=4, help="LoRA rank r")
# 8 steps: the losses printed to 3 decimals sit >= 1e-4 from a rounding edge (r = 4 and 8, N = 1-4;
# measured: kernels and thread counts move them by ~1e-6), so the printed digits hold everywhere
parser.add_argument("--steps", type=int, default=8, help="AdamW steps (memory: the first)")
parser.add_argument("--json", help="write every measured figure here (rank 0)")
args = parser.parse_args()
if not 1 <= args.rank <= HIDDEN:
    parser.error(f"need 1 <= --rank <= {HIDDEN} (the model's width), got {args.rank}")
if not 2 <= args.steps <= 100:  # B starts at 0, so A's first gradient is 0: A trains from step 2
    parser.error(f"need 2 <= --steps <= 100, got {args.steps}")
if int(os.environ.get("WORLD_SIZE", 1)) * BATCH_SIZE > 256:
    parser.error(f"need at most {256 // BATCH_SIZE} processes ({BATCH_SIZE} sequences each)")
# peft asks the model a deprecated transformers question; the answer is right, the warning noise
warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated")


def build(lora: bool):
    """The same seeded model on every rank; with LoRA, the adapters are seeded the same too."""
    seed_everything(0)
    model = tiny_llama().to(env.device)
    if not lora:
        return model
    # lora_dropout=0: dropout draws random masks, which differ between one process and N
    config = LoraConfig(r=args.rank, lora_alpha=2 * args.rank, lora_dropout=0.0,
                        target_modules=TARGETS)
    return get_peft_model(model, config)  # freezes every base weight, adds lora_A / lora_B


def decoder_layers(model):
    """peft wraps the model twice: PeftModel.base_model is a LoraModel, whose .model is the
    LlamaForCausalLM, whose .model is the LlamaModel with .layers. (Names gain the prefix
    base_model.model.: base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight.)"""
    if hasattr(model, "peft_config"):  # a PeftModel
        return model.base_model.model.model.layers
    return model.model.layers


def shard(model):
    """One FSDP2 unit per decoder layer (frozen weights and their adapters together), then the
    root, the module we call (here the PeftModel), for what no layer holds: embeddings, final
    norm, LM head. The same lines as for full fine-tuning; no policy for frozen vs trainable."""
    mesh = init_device_mesh(env.device.type, (env.world_size,))
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def optimizer_for(model):
    # Only what trains: AdamW would skip frozen parameters anyway (their .grad stays None, so it
    # creates no state for them), but a short list says what the optimizer is for.
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR,
                             weight_decay=0.01)


def train(model, steps: int) -> tuple[list[float], dict, dict]:
    """AdamW steps on this rank's sequences; the first inside FSDPMemTracker. Returns the global
    batch's losses, this rank's bytes by category after the first optimizer.step(), and step 1's
    gradient norms (the trainable parameters': the frozen ones have none)."""
    optimizer = optimizer_for(model)
    tracker = FSDPMemTracker(model, optimizer)
    losses = []
    for step in range(steps):
        with tracker if step == 0 else contextlib.nullcontext():
            loss = model(input_ids=mine, labels=mine).loss
            loss.backward()  # reduce-scatters the gradients of the trainable parameters only
            if step == 0:  # (scalars only: nothing the tracker's categories count)
                grads = grad_norms(model)
            optimizer.step()
            if step == 0:
                at_rest = by_category(tracker.get_tracker_snapshot("current"), env.device)
        optimizer.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)  # the global batch's loss: every rank's share, averaged
        losses.append(mean.item() / env.world_size)
    return losses, {name: at_rest[key] for name, key in CATEGORIES.items()}, grads


def allocated(nbytes: int, cuda: bool) -> int:
    """Bytes a tensor of nbytes takes: on a GPU the caching allocator rounds every block up to
    512 bytes, and FSDPMemTracker counts what it takes (torch/distributed/_tools/mem_tracker.py,
    _PYTORCH_MIN_ALLOCATE); on the CPU, the tensor's bytes."""
    return -(-nbytes // 512) * 512 if cuda else nbytes


def expected_bytes(model, cuda: bool) -> dict:
    """This rank's bytes of gradients and AdamW state, from the shards of the trainable parameters.
    Gradients: each FSDP unit's sharded gradients are views into one reduce-scatter output
    (_fsdp_collectives.py, foreach_reduce), which holds every shard padded to ceil(dim0 / N)
    rows (so every rank counts the same bytes), 4 per float. (lora_A has only r rows: with r < N
    some ranks hold an empty shard, padded to a full row.) AdamW: exp_avg and exp_avg_sq like
    this rank's (unpadded) shard, and a 4-byte step per tensor, on the parameter's device only
    on the CPU: on a GPU a non-fused AdamW keeps `step` as a CPU scalar (torch/optim/adam.py,
    _init_group), outside the device's memory."""
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    grads = 0
    for unit in units:  # its own parameters: not those of the units inside it
        inner = {id(q) for m in unit.modules() if m is not unit and isinstance(m, FSDPModule)
                 for q in m.parameters()}
        padded = sum(math.ceil(q.shape[0] / env.world_size) * (q.numel() // q.shape[0])
                     for q in unit.parameters() if q.requires_grad and id(q) not in inner)
        grads += allocated(4 * padded, cuda) if padded else 0
    trainable = [q for q in model.parameters() if q.requires_grad]
    states = sum(2 * allocated(4 * q.to_local().numel(), cuda) for q in trainable)
    return {"grads": grads, "optimizer": states + (0 if cuda else 4 * len(trainable))}


def reference() -> tuple[list[float], dict]:
    """One process, the whole global batch, the same LoRA model and AdamW, no FSDP: its losses
    and step 1's gradient norms."""
    model = build(lora=True)
    optimizer = optimizer_for(model)
    losses, grads = [], None
    for _ in range(args.steps):
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        grads = grads or grad_norms(model)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, grads


env = setup()
start = time.perf_counter()
(tokens,) = counting_data(env.world_size * BATCH_SIZE)[:]
tokens = tokens.to(env.device)
mine = tokens[env.rank * BATCH_SIZE:(env.rank + 1) * BATCH_SIZE]

# --- full fine-tuning under FSDP2: one tracked step, the baseline for the bytes ---------------
full = shard(build(lora=False))
_, full_bytes, _ = train(full, steps=1)
cuda = env.device.type == "cuda"
full_expected = expected_bytes(full, cuda)
n_tensors = {"full": len(list(full.parameters()))}  # AdamW keeps a step counter for each
base_params = sum(p.numel() for p in full.parameters())  # DTensor.numel(): the global count
del full

# --- LoRA under FSDP2 -------------------------------------------------------------------------
model = build(lora=True)
trainable, total = model.get_nb_trainable_parameters()  # peft's count (total includes adapters)
adapted = [(name, m.in_features, m.out_features) for name, m in model.named_modules()
           if name.split(".")[-1] in TARGETS]
formula = sum(args.rank * (i + o) for _, i, o in adapted)  # A: r x in, B: out x r
model = shard(model)
# this rank's shard of every parameter, before training: to check which ones training changed
before = {name: p.to_local().clone() for name, p in model.named_parameters()}
losses, lora_bytes, lora_grads = train(model, args.steps)
frozen_same = all(torch.equal(before[n], p.to_local())
                  for n, p in model.named_parameters() if not p.requires_grad)
adapters_moved = all(not torch.equal(before[n], p.to_local())  # (a rank may hold an empty shard)
                     for n, p in model.named_parameters() if p.requires_grad and before[n].numel())
lora_expected = expected_bytes(model, cuda)
n_tensors["lora"] = sum(p.requires_grad for p in model.parameters())
dims_divide = all(p.shape[0] % env.world_size == 0 for p in model.parameters())  # base and A, B
single, single_grads = reference()
seconds = time.perf_counter() - start

mine_result = {"lora": lora_bytes, "full": full_bytes, "lora_expected": lora_expected,
               "full_expected": full_expected, "frozen_unchanged": frozen_same,
               "adapters_changed": adapters_moved}
every_rank = [None] * env.world_size
dist.all_gather_object(every_rank, mine_result)
# Gradients and AdamW state exist for the trainable parameters only: in LoRA the adapters, in
# full fine-tuning every parameter. The tracker's bytes must be exactly that, on every rank.
as_expected = all(r[run][c] == r[run + "_expected"][c] for r in every_rank
                  for run in ("lora", "full") for c in ("grads", "optimizer"))
assert as_expected, every_rank
# With no padding (every first dimension divides by N), LoRA's gradients are full fine-tuning's
# scaled by trainable / base parameters, exactly; AdamW's state too, its step counters aside.
# (On a GPU the allocator's 512-byte blocks round each tensor: the ratio is near, not exact.)
fraction = trainable / base_params
if dims_divide and not cuda:
    for r in every_rank:
        assert r["lora"]["grads"] * base_params == r["full"]["grads"] * trainable, r
        assert ((r["lora"]["optimizer"] - 4 * n_tensors["lora"]) * base_params
                == (r["full"]["optimizer"] - 4 * n_tensors["full"]) * trainable), r

print0(f"LoRA r={args.rank} on {', '.join(TARGETS)} of {len(decoder_layers(model))} layers: "
       f"{len(adapted)} adapted Linear layers")
print0(f"trainable parameters: {trainable:,} of {total:,} ({100 * trainable / total:.2f}%); "
       f"sum of r x (in + out) = {formula:,}: {trainable == formula}")
print0(f"bytes on rank 0 after the first step, {env.world_size} ranks (FSDPMemTracker):")
print0(f"  {'':10s}{'LoRA':>10s}{'full FT':>10s}{'LoRA/full':>11s}")
for name in CATEGORIES:
    lo, fu = lora_bytes[name], full_bytes[name]
    print0(f"  {name:10s}{lo:10d}{fu:10d}{lo / fu:11.3f}")
print0(f"trainable / base parameters: {fraction:.3f}; every first dimension divides by "
       f"N = {env.world_size}: {dims_divide}")
print0(f"grads and AdamW state = those of the trainable shards only, on every rank: {as_expected}")
print0(f"first loss {losses[0]:.3f}, last loss {losses[-1]:.3f}")
diff = max(abs(a - b) for a, b in zip(losses, single))
grads_match = grad_check(lora_grads, single_grads)["gap"] < 1e-5  # of the largest
print0(f"max |loss - reference| < 1e-5: {diff < 1e-5}, step-1 gradient norms too: {grads_match}"
       "  (one process, whole batch, same LoRA)")
print0(f"frozen base shards bit-exact after training, on every rank: "
       f"{all(r['frozen_unchanged'] for r in every_rank)}")
print0(f"every adapter shard changed, on every rank: "
       f"{all(r['adapters_changed'] for r in every_rank)}")
write_json(args.json, {"world_size": env.world_size, "lora_rank": args.rank, "steps": args.steps,
                       "lr": LR, "batch_size": BATCH_SIZE, "targets": TARGETS,
                       "adapted": adapted, "trainable": trainable, "total": total,
                       "base_params": base_params, "formula": formula,
                       "dims_divide": dims_divide, "fraction": fraction,
                       "trainable_tensors": n_tensors, "losses": losses,
                       "single_losses": single, "max_loss_diff": diff, "grads_match": grads_match,
                       "ranks": every_rank,
                       "seconds": seconds})
teardown()

"""Chapter 08 on a GPU: one real FSDP2 training step of Llama 3.2 1B, against the prediction.

    PYTHONPATH=code python code/ch08_plan/gpu_step.py [--seq 2048 --batch 2 --ac full]

The notebook predicts memory (distkit.memory.llama_training_bytes, plus the CUDA foreach AdamW
temporary the simulation cannot see) and step time (distkit.speed.step_time) for a GPU it names;
this runs the same step for real on one CUDA GPU (FSDP2 over a process group of one, bf16
MixedPrecisionPolicy, sdpa attention, the chosen checkpointing) and prints
torch.cuda.max_memory_allocated and tokens/s beside them. Without CUDA it says so and exits 0:
nothing here can run on a CPU at this size in useful time.
"""
import argparse
import json
import time

import torch

from distkit.memory import LLAMA_CONFIGS, llama_training_bytes, sac_context_fn
from distkit.speed import EFF, GPUS, LINKS, optimizer_step_bytes, peak_bytes, step_time

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--seq", type=int, default=2048)
parser.add_argument("--batch", type=int, default=2)
parser.add_argument("--ac", choices=["none", "selective", "full"], default="full")
parser.add_argument("--steps", type=int, default=5, help="timed steps, after two untimed")
parser.add_argument("--json", help="write measured and predicted values here")
args = parser.parse_args()
if args.seq < 2 or args.batch < 1 or args.steps < 1:
    parser.error("need --seq >= 2, --batch >= 1 and --steps >= 1")
if not torch.cuda.is_available():
    print("skipped: no CUDA device; on a GPU this runs one real step of Llama 3.2 1B")
    raise SystemExit(0)

import torch.distributed as dist  # noqa: E402
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

name = torch.cuda.get_device_name()
# "H100 PCIe" and "H100 NVL" are other parts (lower clocks and peaks): no prediction for them
gpu = None if ("PCIe" in name or "NVL" in name) else next(
    (g for key, g in GPUS.items() if key.split()[0] in name), None)
dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
torch.manual_seed(0)
config = LlamaConfig(**LLAMA_CONFIGS["1b"], max_position_embeddings=args.seq,
                     attn_implementation="sdpa")
with torch.device("cuda"):
    model = LlamaForCausalLM(config)
if args.ac != "none":
    kwargs = {"use_reentrant": False}
    if args.ac == "selective":
        kwargs["context_fn"] = sac_context_fn()
    model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
for layer in model.model.layers:
    fully_shard(layer, mp_policy=policy)
fully_shard(model, mp_policy=policy)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)  # foreach on CUDA
tokens = torch.randint(0, config.vocab_size, (args.batch, args.seq), device="cuda")


def step():
    model(input_ids=tokens, labels=tokens).loss.backward()
    optimizer.step()
    optimizer.zero_grad()


step()  # AdamW's state appears at the end of the first step: the second is the steady state
torch.cuda.synchronize()
torch.cuda.reset_peak_memory_stats()
step()
torch.cuda.synchronize()
measured = torch.cuda.max_memory_allocated()
start = time.perf_counter()
for _ in range(args.steps):
    step()
torch.cuda.synchronize()
tps = args.steps * args.batch * args.seq / (time.perf_counter() - start)

cfg = LLAMA_CONFIGS["1b"]
predicted = llama_training_bytes(cfg, ranks=1, seq=args.seq, batch=args.batch,
                                 precision="bf16", attn="sdpa", ac=args.ac)
want = peak_bytes(cfg, gpus=1, seq=args.seq, batch=args.batch, ac=args.ac)
reserved = torch.cuda.max_memory_reserved()
free, total = torch.cuda.mem_get_info()  # the device's view: + CUDA context, NCCL's buffers
print(f"{name}: max_memory_allocated {measured / 2**30:.2f} GiB, predicted {want / 2**30:.2f} "
      f"GiB (the larger of the backward's {predicted['Total'] / 2**30:.2f} and AdamW's step "
      f"{optimizer_step_bytes(predicted) / 2**30:.2f}), "
      f"error {100 * (want - measured) / measured:+.1f} %")
print(f"max_memory_reserved {reserved / 2**30:.2f} GiB (the allocator's cache on top); the "
      f"device has {(total - free) / 2**30:.2f} GiB in use (+ CUDA context and NCCL's buffers)")
out = {"device": name, "measured_bytes": measured, "reserved_bytes": reserved,
       "predicted_bytes": want, "tokens_per_s": tps}
if gpu:
    speeds = [step_time(cfg, gpu=gpu, link=LINKS["IB NDR / RoCE 400G"], gpus=1, seq=args.seq,
                        batch=args.batch, ac=args.ac, eff=e)["tokens/s/GPU"] for e in EFF]
    print(f"tokens/s {tps:,.0f}, predicted {speeds[0]:,.0f} to {speeds[-1]:,.0f} "
          f"(eff {EFF[0]} to {EFF[-1]} of {gpu.name}'s {gpu.peak / 1e12:.0f} TFLOP/s)")
    out["predicted_tokens_per_s"] = speeds
else:
    print(f"tokens/s {tps:,.0f}; {name} is not in distkit.speed.GPUS: no speed prediction")
if args.json:
    with open(args.json, "w") as f:
        json.dump(out, f, indent=1)
dist.destroy_process_group()

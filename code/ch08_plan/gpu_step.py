"""Chapter 08 on a GPU: real FSDP2 training steps of Llama 3.2 1B, timed part by part, against
the prediction.

    PYTHONPATH=code python code/ch08_plan/gpu_step.py [--seq 2048 --batch 2 --ac full]
    PYTHONPATH=code python code/ch08_plan/gpu_step.py --fused-adamw
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True \\
        PYTHONPATH=code python code/ch08_plan/gpu_step.py

The notebook predicts memory (distkit.speed.peak_bytes: llama_training_bytes, or AdamW's step
with the foreach temporary the CPU simulation cannot see) and time (distkit.speed.step_time with
the efficiency fitted on public runs, distkit.plan). This runs the same step for real on one
CUDA GPU (FSDP2 over a process group of one, bf16 MixedPrecisionPolicy, sdpa attention, the
chosen checkpointing) and times, with CUDA events on the stream, forward + backward and the
optimizer step separately: the first against the compute the model predicts (and the eta it
implies, fwd+bwd alone), the second against the memory-bound optimizer term (foreach AdamW
moves 80 bytes per parameter through HBM, fused 28). It prints torch.cuda.max_memory_allocated,
max_memory_reserved (their ratio: the allocator's share) and the device's own view
(torch.cuda.mem_get_info: + the CUDA context and NCCL's buffers), the numbers the planner's
memory budget rests on. Without CUDA it says so and exits 0: nothing here can run on a CPU at
this size in useful time.
"""
import argparse
import json
import os

import torch

from distkit.memory import LLAMA_CONFIGS, llama_training_bytes, sac_context_fn
from distkit.plan import efficiency, fit_efficiency, load_runs
from distkit.speed import GPUS, LINKS, Layout, hardware_flops, memory_bound_seconds, step_time

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--seq", type=int, default=2048)
parser.add_argument("--batch", type=int, default=2)
parser.add_argument("--ac", choices=["none", "selective", "full"], default="full")
parser.add_argument("--steps", type=int, default=5, help="timed steps, after two untimed")
parser.add_argument("--fused-adamw", action="store_true",
                    help="AdamW(fused=True): one kernel per step, 28 B per parameter")
parser.add_argument("--json", help="write measured and predicted values here")
args = parser.parse_args()
if args.seq < 2 or args.batch < 1 or args.steps < 1:
    parser.error("need --seq >= 2, --batch >= 1 and --steps >= 1")
if not torch.cuda.is_available():
    print("skipped: no CUDA device; on a GPU this runs and times real steps of Llama 3.2 1B "
          "(forward + backward and AdamW's step apart)")
    raise SystemExit(0)

import torch.distributed as dist  # noqa: E402
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

name = torch.cuda.get_device_name()
# "H100 PCIe" and "H100 NVL" are other parts (lower clocks and peaks): no prediction for them
gpu = None if ("PCIe" in name or "NVL" in name) else next(
    (g for key, g in GPUS.items() if key.split()[0] in name and g.memory_gib), None)
dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
torch.manual_seed(0)
cfg = LLAMA_CONFIGS["1b"]
config = LlamaConfig(**cfg, max_position_embeddings=args.seq, attn_implementation="sdpa")
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
# fused=None, not False: an explicit False also turns foreach off (torch/optim/adam.py, adam())
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=args.fused_adamw or None)
tokens = torch.randint(0, config.vocab_size, (args.batch, args.seq), device="cuda")


def step(events=None):
    """One step; with events, record (start, after backward, after the optimizer) on the
    stream: the GPU's own clock, not the host's around asynchronous launches."""
    if events:
        events[0].record()
    model(input_ids=tokens, labels=tokens).loss.backward()
    if events:
        events[1].record()
    optimizer.step()
    optimizer.zero_grad()
    if events:
        events[2].record()


step()  # AdamW's state appears at the end of the first step: the second is the steady state
torch.cuda.synchronize()
torch.cuda.reset_peak_memory_stats()
step()
torch.cuda.synchronize()
measured = torch.cuda.max_memory_allocated()
reserved = torch.cuda.max_memory_reserved()
free, total = torch.cuda.mem_get_info()  # the device's view: + CUDA context, NCCL's buffers
timings = []
for _ in range(args.steps):
    events = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
    step(events)
    timings.append(events)
torch.cuda.synchronize()
fwd_bwd = sum(e[0].elapsed_time(e[1]) for e in timings) / args.steps / 1e3
opt = sum(e[1].elapsed_time(e[2]) for e in timings) / args.steps / 1e3
tps = args.batch * args.seq / (fwd_bwd + opt)

m = llama_training_bytes(cfg, ranks=1, seq=args.seq, batch=args.batch, precision="bf16",
                         attn="sdpa", ac=args.ac)
# AdamW's step: fp32 parameters, gradients, two moments, and foreach's sqrt temporary (fused: none)
adamw = (2 if args.fused_adamw else 3) * m["Sharded Param"] + m["OptState"]
want = max(m["Total"], adamw)
print(f"{name}: max_memory_allocated {measured / 2**30:.2f} GiB, predicted {want / 2**30:.2f} GiB "
      f"(the larger of the backward's {m['Total'] / 2**30:.2f} and AdamW's step "
      f"{adamw / 2**30:.2f}), error {100 * (want - measured) / measured:+.1f} %")
print(f"max_memory_reserved {reserved / 2**30:.2f} GiB = {reserved / measured:.3f} x allocated "
      f"(PYTORCH_CUDA_ALLOC_CONF={os.environ.get('PYTORCH_CUDA_ALLOC_CONF', '')!r}); the device "
      f"has {(total - free) / 2**30:.2f} GiB in use: {(total - free - reserved) / 2**30:.2f} GiB "
      f"beyond the reserve (CUDA context, NCCL's buffers)")
hw = hardware_flops(cfg, args.seq, args.batch, ac=args.ac)["hardware"]
out = {"device": name, "seq": args.seq, "batch": args.batch, "ac": args.ac,
       "fused_adamw": args.fused_adamw, "torch": torch.__version__,
       "measured_bytes": measured, "reserved_bytes": reserved, "device_used_bytes": total - free,
       "predicted_bytes": want, "fwd_bwd_s": fwd_bwd, "optimizer_s": opt, "tokens_per_s": tps}
if gpu:
    eta_fb = hw / (fwd_bwd * gpu.peak)
    runs = load_runs()
    eff = efficiency(fit_efficiency(runs), gpu, compiled=False)
    t = step_time(cfg, Layout(gpus=1, seq=args.seq, batch=args.batch, ac=args.ac), gpu=gpu,
                  link=LINKS["IB NDR / RoCE 400G"], eta=eff,
                  optimizer="fused" if args.fused_adamw else "foreach")
    opt_model = memory_bound_seconds(m["Sharded Param"] / 4, 0, gpu,
                                     optimizer="fused" if args.fused_adamw else "foreach")
    print(f"forward + backward {1e3 * fwd_bwd:.1f} ms: {hw / 1e12:.1f} hardware TFLOP at eta "
          f"{eta_fb:.3f} of {gpu.name}'s {gpu.peak / 1e12:.0f} TFLOP/s; the model: "
          f"{1e3 * (t['step s'] - t['optimizer s']):.1f} ms (eta {t['eta']:.3f} + FSDP2 copies "
          f"{1e3 * t['copies s']:.1f} ms)")
    print(f"optimizer.step + zero_grad {1e3 * opt:.1f} ms; the model's "
          f"{'fused' if args.fused_adamw else 'foreach'} AdamW term: "
          f"{1e3 * opt_model['optimizer s']:.1f} ms ({gpu.hbm / 1e12:.2f} TB/s HBM)")
    print(f"tokens/s {tps:,.0f}, predicted {t['tokens/s/GPU']:,.0f} "
          f"({100 * (t['tokens/s/GPU'] - tps) / tps:+.0f} %)")
    out.update({"eta_fwd_bwd": eta_fb, "predicted_tokens_per_s": t["tokens/s/GPU"],
                "predicted_fwd_bwd_s": t["step s"] - t["optimizer s"],
                "predicted_optimizer_s": opt_model["optimizer s"]})
else:
    print(f"forward + backward {1e3 * fwd_bwd:.1f} ms, optimizer {1e3 * opt:.1f} ms, tokens/s "
          f"{tps:,.0f}; {name} is not in distkit.speed.GPUS: no speed prediction")
if args.json:
    with open(args.json, "w") as f:
        json.dump(out, f, indent=1)
dist.destroy_process_group()

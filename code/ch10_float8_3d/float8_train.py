"""Chapter 10: train the tiny Llama with float8 matmuls, next to fp32 and bf16, and compare losses.

    PYTHONPATH=code python code/ch10_float8_3d/float8_train.py --steps 30 --json /tmp/f8.json

One process. Each mode trains the same seeded model on the same batches with AdamW:
- fp32: the reference;
- bf16: torch.autocast(bfloat16), as FSDP2's MixedPrecisionPolicy(param_dtype=bf16) computes;
- float8 (tensorwise, rowwise): every decoder layer's linear layer swapped for
  distkit.fp8.Float8Linear (the LM head stays in high precision, as torchtitan's
  Float8LinearConverter skips it), the rest in fp32. Its three matmuls take float8 operands
  with fresh scales each step: e4m3 forward, e5m2 (tensorwise) gradients.
The loss is the real one (cross-entropy of every next token); the weights stay fp32 (the
optimizer's master copy), as with torchao. On a CPU the float8 matmuls are emulated (quantise,
then an fp32 matmul): the numerics of float8 training, not its speed. On a GPU with fp8 tensor
cores (compute capability 8.9+: L4, L40S, H100, H200, B200) `--kernel torch` runs them with
torch._scaled_mm, and `--bench N` times an N x N x N matmul in bf16 and in float8.
"""
import argparse
import time

import torch

from distkit import pick_device, seed_everything, write_json
from distkit.fp8 import convert_to_float8
from distkit.toy import counting_data, tiny_llama

MODES = ["fp32", "bf16", "float8-tensorwise", "float8-rowwise"]

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--modes", default=",".join(MODES), help="comma list of " + ", ".join(MODES))
parser.add_argument("--steps", type=int, default=30, help="AdamW steps per mode")
parser.add_argument("--batch-size", type=int, default=16, help="sequences (of 32 tokens) a step")
parser.add_argument("--lr", type=float, default=3e-3)
parser.add_argument("--kernel", choices=["emulated", "torch"], default="emulated",
                    help="float8 matmuls: emulated (any device) or torch._scaled_mm")
parser.add_argument("--bench", type=int, default=0,
                    help="on a GPU with fp8 tensor cores: time an N x N x N matmul (0: no)")
parser.add_argument("--json", help="write the losses and times here")
args = parser.parse_args()
modes = args.modes.split(",")
if unknown := [m for m in modes if m not in MODES]:
    parser.error(f"--modes: unknown {','.join(unknown)}; choose from {','.join(MODES)}")
if args.steps < 1 or not 1 <= args.batch_size <= 256:
    parser.error("need --steps >= 1 and 1 <= --batch-size <= 256")

device = pick_device()[0]
fp8_cores = device.type == "cuda" and torch.cuda.get_device_capability() >= (8, 9)
if args.kernel == "torch" and device.type == "cuda" and not fp8_cores:
    print("--kernel torch: torch._scaled_mm needs fp8 tensor cores (CUDA compute capability "
          "8.9+); this GPU has none: the float8 runs use the emulation")
    args.kernel = "emulated"
(tokens,) = counting_data(256)[:]
batches = tokens.to(device).split(args.batch_size)
batches = [b for b in batches if len(b) == args.batch_size]  # the same full batches, in order

results = {}
for mode in modes:
    seed_everything(0)  # the same initial weights for every mode
    model = tiny_llama().to(device)
    converted = []
    if mode.startswith("float8"):  # NEW: the lines float8 training adds
        converted = convert_to_float8(model, recipe=mode.split("-")[1], kernel=args.kernel)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    losses, start = [], time.perf_counter()
    for step in range(args.steps):
        batch = batches[step % len(batches)]
        with torch.autocast(device.type, torch.bfloat16, enabled=mode == "bf16"):
            loss = model(input_ids=batch, labels=batch).loss  # mean cross-entropy, next token
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    seconds = (time.perf_counter() - start) / args.steps
    results[mode] = {"losses": losses, "converted": converted, "s_per_step": seconds}
    print(f"{mode:18s} loss {losses[0]:.2f} -> {losses[-1]:.2f} in {args.steps} steps "
          f"({len(converted)} float8 linear layers)")

bench = {}
if args.bench:
    if not fp8_cores:
        print(f"--bench: {device.type} has no fp8 tensor cores (CUDA compute capability 8.9+); "
              "not timed")
    else:
        from distkit.fp8 import E4M3, to_float8
        n = args.bench
        a, b = (torch.randn(n, n, device=device, dtype=torch.bfloat16) for _ in range(2))
        (a8, sa), (b8, sb) = to_float8(a), to_float8(b)
        b8 = b8.t().contiguous().t()  # column-major, as the fp8 kernel wants
        runs = {"bf16": lambda: a @ b,
                "float8": lambda: torch._scaled_mm(a8, b8, sa.reciprocal(), sb.reciprocal(),
                                                   out_dtype=torch.bfloat16)}
        for name, fn in runs.items():
            for _ in range(3):
                fn()  # warm-up: cuBLAS picks its kernel
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(20):
                fn()
            torch.cuda.synchronize()
            bench[name] = 2 * n**3 * 20 / (time.perf_counter() - t0)
            print(f"{n} x {n} x {n} matmul, {name}: {bench[name] / 1e12:.0f} TFLOP/s")
        print(f"float8 / bf16: {bench['float8'] / bench['bf16']:.2f}x ({E4M3}, tensorwise)")
write_json(args.json, {"device": str(device), "kernel": args.kernel, "steps": args.steps,
                       "batch_size": args.batch_size, "modes": results, "bench": bench})

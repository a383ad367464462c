"""Chapter 08: fit the time model's efficiency on some public runs, predict the others blind.

    PYTHONPATH=code python code/ch08_plan/calibrate.py [--json build/ch08/calibrate.json]

Reads code/ch08_plan/public_runs.json (each run with its source and settings), fits
distkit.speed.Efficiency on the rows marked "fit" (each GPU generation's matmul fraction of its
peak; the passes over the activations of an eager and of a compiled step: four numbers), then
predicts every other row from its settings alone (model, GPUs, layout, checkpointing, compile,
GPU, link) and prints the miss. The held-out rows' throughput is never read before their
prediction is made. Memory is compared where a run published it (allocated peak, from
distkit.speed; torchtitan publishes the allocator's reserve). Whole pretraining runs' GPU-hours
(model cards) are printed beside, as the all-in rate a budget must expect: failures, restarts,
evaluation and long-context stages included, nothing fitted to them.
"""
import argparse
import json
from pathlib import Path

from distkit.memory import GiB, flops_per_token
from distkit.plan import (RUNS, fit_efficiency, load_runs, predict, published_speed, run_memory,
                          run_setup)
from distkit.speed import GPUS

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--runs", default=str(RUNS), help="the public runs table (JSON)")
parser.add_argument("--json", help="write the fit and every prediction here")
args = parser.parse_args()
if not Path(args.runs).is_file():
    parser.error(f"--runs: no such file {args.runs}")
runs = load_runs(args.runs)

eff = fit_efficiency(runs)
print(f"fitted on {len(eff['rows'])} runs ({', '.join(eff['rows'])}):")
print(f"  matmuls at {eff['matmul']['hopper']:.2f} of the peak on Hopper (H100, H200), "
      f"{eff['matmul']['ampere']:.2f} on Ampere (A100); memory-bound work: "
      f"{eff['passes eager']:.1f} passes over the activations eager, "
      f"{eff['passes compiled']:.1f} compiled; rms error on the fitted runs "
      f"{100 * eff['rms log error']:.1f} %")

rows = []
print(f"\n{'use':8s} {'run':29s} {'layout':31s} {'published':>9s} {'model':>7s} {'miss':>6s} "
      f"{'eta':>5s}  memory GiB (published, model allocated)")
for r in runs["runs"]:
    if r["kind"] == "gpu_hours":
        continue
    _, layout, _, _ = run_setup(r, runs)
    got, want = predict(r, runs, eff), published_speed(r, runs)
    miss = got["tokens/s/GPU"] / want - 1
    memory = ""
    row = {"id": r["id"], "use": r["use"], "published": want, "predicted": got["tokens/s/GPU"],
           "miss": miss, "eta": got["eta"], "exposed": got["fsdp exposed s"] / got["step s"]}
    if "memory_gib" in r:
        model = run_memory(r, runs)
        memory = (f"{r['memory_gib']:.1f} {r['memory_kind'].split('_')[1]:9s} "
                  f"{model / GiB:5.1f}")
        row["memory_model_gib"] = model / GiB
    rows.append(row)
    where = f"{r['gpus']} {r['gpu'].split()[0]}, " + layout.describe().split(",")[0]
    print(f"{r['use']:8s} {r['id']:29s} {where[:31]:31s} {want:9,.0f} {got['tokens/s/GPU']:7,.0f} "
          f"{100 * miss:+5.0f}% {got['eta']:5.2f}  {memory}")

held = [x for x in rows if x["use"] == "held-out"]
print(f"\nheld-out: {len(held)} runs; |miss| <= 5 %: {sum(abs(x['miss']) <= 0.05 for x in held)}, "
      f"<= 20 %: {sum(abs(x['miss']) <= 0.20 for x in held)}, worst "
      f"{100 * max(abs(x['miss']) for x in held):.0f} %")

print("\nall-in: whole pretraining runs (model cards), tokens / GPU-hours:")
for r in runs["runs"]:
    if r["kind"] != "gpu_hours":
        continue
    config = runs["models"][r["model"]]["config"]
    seq = 8192 if r["model"].startswith("llama3") else 4096  # their pretraining sequence
    tps = r["tokens"] / (r["gpu_hours"] * 3600)
    mfu = tps * flops_per_token(config, seq) / GPUS[r["gpu"]].peak
    print(f"  {r['id']:22s} {r['gpu_hours'] / 1e6:6.2f} M GPU-hours for {r['tokens'] / 1e12:.0f} T "
          f"tokens: {tps:7,.0f} tokens/s/GPU all-in, MFU {100 * mfu:.0f} % at sequence {seq}")
    rows.append({"id": r["id"], "use": r["use"], "tokens_per_s_all_in": tps, "mfu_all_in": mfu})

if args.json:
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"efficiency": eff, "rows": rows}, indent=1))

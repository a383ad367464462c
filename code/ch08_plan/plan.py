"""Chapter 08: plan a training run in one command, and print the command that runs it.

    PYTHONPATH=code python code/ch08_plan/plan.py --model 8b --gpus 64 --gpu h100-sxm \
        --tokens 100e9 --seq 8192 --price 2.50

--model is a preset (1b, 8b, 70b, 405b) or a Hugging Face config.json of a dense Llama-family
decoder (your own model). The script searches the layouts the capstone (chapter 06's
train_llama.py) can run on --gpus GPUs: FSDP or HSDP (one replica per node), activation
checkpointing none / selective / full, the micro-batch, accumulation up to --global-tokens a
step, eager or compiled (train_llama.py compiles only without checkpointing), and the gradient
sync: train_llama.py keeps every fp32 gradient unsharded between micro-batches unless you pass
--sync-every-microbatch, so each plan shows its memory both ways and which one its command uses.
It prints the fastest few that fit (one rule for every chapter: distkit.plan.fits), each with
its memory per GPU, tokens/s per GPU with the band measured on public runs, days, GPU-hours,
the cost at steady state and all-in, and the sbatch line. --layout evaluates one layout of
your own instead (tensor and pipeline parallelism included: those print no capstone command).
Everything is distkit.plan's, the code notebook 08 calls.
"""
import argparse
import json
import math
import sys
from pathlib import Path

from distkit.memory import GiB
from distkit.plan import (ALL_IN_CONTAINS, GPU_NAMES, LINKS, all_in, capstone_command,
                          capstone_refuses, fits, fitted, layout_peak_bytes, load_config, plan,
                          power_efficiency, predict, presets, published_speed, reserved_bytes,
                          search, selective_cpu_seconds, show)
from distkit.speed import GPUS, Layout

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--model", required=True,
                    help=f"a preset ({', '.join(presets())}) or PATH/config.json")
parser.add_argument("--gpus", type=int, required=True, help="GPUs (whole nodes of 8 above 8)")
parser.add_argument("--gpu", default="h100-sxm", help=f"one of {', '.join(GPU_NAMES)}")
parser.add_argument("--tokens", type=float, required=True, help="tokens to train on, e.g. 100e9")
parser.add_argument("--seq", type=int, default=8192, help="sequence length (default 8192)")
parser.add_argument("--price", type=float, default=2.50, help="$ per GPU-hour (default 2.50)")
parser.add_argument("--global-tokens", type=float, default=2**22,
                    help="tokens per optimizer step (default 4M = 2^22)")
parser.add_argument("--link", default="IB NDR / RoCE 400G", choices=list(LINKS),
                    help="between nodes, one NIC per GPU (default %(default)s)")
parser.add_argument("--power", type=float, metavar="W", help="GPU power limit in watts "
                    "(default: its board power; the fit saw 500 W H100s, 400 W A100s)")
parser.add_argument("--write-gbps", type=float, default=20.0,
                    help="checkpoint write bandwidth of the file system, GB/s (default 20)")
parser.add_argument("--restart-s", type=float, default=600.0,
                    help="seconds to restart after a failure (default 600)")
parser.add_argument("--layout", metavar="K=V,...", help="one layout instead of the search, "
                    "e.g. tp=8,pp=16,batch=1,ac=none,schedule=Interleaved1F1B,virtual=2 (keys: "
                    "tp, pp, replicate, batch, ac, schedule, virtual, sync, compile)")
parser.add_argument("--top", type=int, default=3, help="plans to print (default 3)")
parser.add_argument("--json", metavar="PATH", help="also write the plans here")
args = parser.parse_args()

try:
    config = load_config(args.model)
except ValueError as e:
    parser.error(str(e))
if args.gpu not in GPU_NAMES:
    parser.error(f"--gpu {args.gpu}: one of {', '.join(GPU_NAMES)}")
if not (args.tokens > 0 and math.isfinite(args.tokens)):
    parser.error(f"--tokens must be > 0, got {args.tokens:g}")
if args.gpus < 1 or (args.gpus > 8 and args.gpus % 8):
    parser.error(f"--gpus {args.gpus}: 1 to 8, or whole nodes of 8")
if min(args.seq, args.price, args.write_gbps, args.top) <= 0 or args.restart_s < 0:
    parser.error("--seq, --price, --write-gbps and --top must be > 0, --restart-s >= 0")
global_tokens = int(args.global_tokens)
if global_tokens < args.seq:
    parser.error(f"--global-tokens {global_tokens} holds less than one sequence of {args.seq}")
gpu, link = GPUS[GPU_NAMES[args.gpu]], LINKS[args.link]
runs, eff, spread = fitted()

# 1. the layouts: one of yours, or the capstone's search
if args.layout:
    try:
        kv = dict(item.split("=", 1) for item in args.layout.split(","))
        compiled = kv.pop("compile", "0") in ("1", "true", "yes")
        sync = kv.pop("sync", "1") in ("1", "true", "yes")
        ints = {k: int(v) for k, v in kv.items() if k not in ("ac", "schedule")}
        tp, pp, batch = ints.get("tp", 1), ints.get("pp", 1), ints.get("batch", 1)
        dp = args.gpus // (tp * pp)
        layout = Layout(gpus=args.gpus, seq=args.seq, sequence_parallel=tp > 1,
                        accumulation=max(1, global_tokens // (dp * args.seq * batch)),
                        sync_every_microbatch=sync, ac=kv.get("ac", "full"),
                        schedule=kv.get("schedule", "1F1B"), **ints)
    except (ValueError, TypeError) as e:
        parser.error(f"--layout {args.layout}: {e}")
    eta, _ = power_efficiency(eff, gpu, compiled, args.power)
    floor = selective_cpu_seconds()[1] if layout.ac == "selective" and not (
        capstone_refuses(layout, compiled)) else 0.0
    choices = [{"layout": layout, "compiled": compiled, "eta": eta, "cpu floor s": floor,
                "other sync": None}]
else:
    choices = search(config, gpus=args.gpus, seq=args.seq, gpu=gpu, link=link, eff=eff,
                     global_tokens=global_tokens, power_w=args.power)[:args.top]
    if not choices:
        print(f"nothing the capstone can run fits {args.gpus} x {gpu.name} "
              f"({gpu.memory_gib:.1f} GiB) for this model at sequence {args.seq}: more GPUs, "
              f"a shorter --seq, or --layout with tensor parallelism (torchtitan)")
        sys.exit(1)

# 2. the all-in factor: fitted on published whole runs, judged on others
factor = all_in(runs, eff)
held = [x for x in factor["rows"] if x["use"] == "all-in held-out"]
print(f"{gpu.name}, {args.gpus} GPUs, {args.tokens / 1e9:,.0f} B tokens of {args.seq}, "
      f"{global_tokens / 2**20:g} M tokens a step, ${args.price:.2f}/GPU-hour")
_, note = power_efficiency(eff, gpu, False, args.power)
if note:
    print(f"note: {note}")
print(f"all-in factor {factor['central']:.2f} (range {factor['low']:.2f}-{factor['high']:.2f}) "
      f"from {len(factor['rows']) - len(held)} model cards; on the {len(held)} held out: "
      + ", ".join(f"{x['id']} {100 * x['miss']:+.0f} %" for x in held))

# 3. each plan
written = []
for i, x in enumerate(choices, 1):
    lay = x["layout"]
    p = plan(config, lay, gpu=gpu, link=link, eta=x["eta"], tokens=args.tokens,
             price=args.price, eta_spread=spread, write_bw=args.write_gbps * 1e9,
             restart_s=args.restart_s, cpu_floor_s=x["cpu floor s"])
    mode = "compiled" if x["compiled"] else "eager"
    print(f"\n#{i} " + show(p, f"{mode}, "))
    if lay.accumulation > 1 and lay.pp == 1:
        other = Layout(**{**lay.__dict__, "sync_every_microbatch": not lay.sync_every_microbatch})
        peak = layout_peak_bytes(config, other)
        ways = {True: "after every micro-batch (--sync-every-microbatch)",
                False: "after the last micro-batch only (train_llama.py's default)"}
        print(f"  gradients reduce-scattered {ways[lay.sync_every_microbatch]} in this plan; "
              f"{ways[other.sync_every_microbatch].split(' (')[0]}: {peak / GiB:.1f} GiB "
              f"allocated, {reserved_bytes(peak) / GiB:.1f} reserved-equivalent, fits "
              f"{fits(peak, gpu.memory_gib)}")
    if x["cpu floor s"]:
        lo, mid, hi = selective_cpu_seconds()
        wait = p["time"].get("cpu wait s", 0.0)
        print(f"  train_llama.py's selective checkpointing needs {1e3 * mid:.0f} ms of CPU per "
              f"layer and micro-batch (measured {1e3 * lo:.0f}-{1e3 * hi:.0f} on an H200): "
              f"the GPU waits {wait:.2f} s a step for it")
    lo, hi = p["cost"] * factor["low"], p["cost"] * factor["high"]
    print(f"  cost: steady state ${p['cost']:,.0f} ({p['gpu hours']:,.0f} GPU-hours); all-in "
          f"${p['cost'] * factor['central']:,.0f} (range ${lo:,.0f}-${hi:,.0f}; "
          f"{p['days'] * factor['central']:.1f} days)")
    if lay.pp > 1 or lay.gpus > 2048:
        meta = [r for r in runs["runs"] if r["id"].startswith("meta-405b")]
        miss = [predict(r, runs, eff)["tokens/s/GPU"] / published_speed(r, runs) - 1
                for r in meta]
        misses = ", ".join(f"{100 * m:+.0f} %" for m in miss)
        print(f"  outside the evidence: past 2,048 GPUs and with pipelines the only published "
              f"runs, Meta's 405B on 8,192 and 16,384 GPUs, were predicted {misses} (section 5): "
              f"measure before you sign")
    why = capstone_refuses(lay, x["compiled"])
    command = None if why else capstone_command(args.model, lay, x["compiled"], args.tokens,
                                                config)
    print(f"  capstone: none ({why})" if why else f"  run it: {command}")
    written.append({"layout": lay.describe(), "compiled": x["compiled"],
                    "allocated_gib": p["allocated"] / GiB, "fits": p["fits"],
                    "tokens_per_s_per_gpu": p["time"]["tokens/s/GPU"], "days": p["days"],
                    "gpu_hours": p["gpu hours"], "cost": p["cost"],
                    "all_in": {k: p["cost"] * factor[k] for k in ("central", "low", "high")},
                    "all_in_days": p["days"] * factor["central"], "command": command})
if args.json:
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"plans": written, "all_in": {
        k: factor[k] for k in ("central", "low", "high")}}, indent=1))
print(f"\nall-in contains {ALL_IN_CONTAINS}; the plan cannot know your data pipeline, your "
      f"cluster's failure rate, your evaluation schedule or your restarts' real cost.")

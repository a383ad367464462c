"""Chapter 08: chapter 03's FSDP2 simulation over a grid of settings, in one JSON.

    PYTHONPATH=code python code/ch08_plan/simulate_grid.py --points 1b:8,8b:8 \
        --precisions bf16,fp32 --ac full,selective,none \
        --json code/ch03_zero/results/simulate_grid.json

simulate_fsdp.py takes one precision, checkpointing mode, attention and sequence per run; this
runs it once per combination (one process each, one after the other: a run holds rank 0's
fake tensors only) and gathers the results, each with the command that made it. `--from DIR`
gathers every simulate_fsdp.py JSON in DIR instead (runs made before, in the background);
`--add` keeps the points already in --json and adds the new ones (a point simulated again
replaces the old one).
"""
import argparse
import itertools
import json
import subprocess
import sys
from pathlib import Path

import torch

CODE = Path(__file__).resolve().parents[1]
parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--points", default="1b:8,8b:8", help="model:ranks pairs")
parser.add_argument("--precisions", default="bf16,fp32")
parser.add_argument("--ac", default="full,selective,none")
parser.add_argument("--attn", default="sdpa")
parser.add_argument("--seqs", default="2048")
parser.add_argument("--batch", type=int, default=1)
parser.add_argument("--from", dest="source", help="gather the JSONs already in this folder")
parser.add_argument("--add", action="store_true", help="keep the points already in --json")
parser.add_argument("--json", required=True)
args = parser.parse_args()

# What the grid leaves out (chapter 08's issue asked for 1B/8B/70B x none/selective/full x
# fp32/bf16 x seq 2048/8192 x ranks 8/64): a point takes 2-10 minutes here, 70B's more.
MISSING = ("70B in bf16 and with selective checkpointing (chapter 03's fp32 sweeps hold 70B "
           "without and with full checkpointing, 8-64 ranks); 8B at sequence 8192 and in bf16 "
           "on 64 ranks; batch 2")
combos = list(itertools.product(args.precisions.split(","), args.ac.split(","),
                                args.attn.split(","), args.seqs.split(",")))
if args.source:  # every run already made, whatever its settings
    paths = sorted(Path(args.source).glob("*.json"))
    if not paths:
        sys.exit(f"simulate_grid.py: no JSON in {args.source}")
else:
    paths = []
    for precision, ac, attn, seq in combos:
        paths.append(Path(args.json).with_suffix(f".{precision}-{ac}-{attn}-{seq}.json"))
        subprocess.run([sys.executable, str(CODE / "ch03_zero" / "simulate_fsdp.py"),
                        "--points", args.points, "--precision", precision, "--ac", ac,
                        "--attn", attn, "--seq", seq, "--batch", str(args.batch),
                        "--json", str(paths[-1])], check=True)
SETTINGS = ("model", "ranks", "tp", "seq", "batch", "precision", "ac", "attn")
old = json.loads(Path(args.json).read_text()) if args.add and Path(args.json).exists() else {}
results, commands = old.get("results", []), old.get("runs", [])
for path in paths:
    run = json.loads(path.read_text())
    commands.append(run["command"])
    for r in run["results"]:
        r = {"tp": 1, **r, "command": run["command"]}
        results = [o for o in results if [o.get(k, 1) for k in SETTINGS]
                   != [r.get(k, 1) for k in SETTINGS]] + [r]
    if not args.source:
        path.unlink()
Path(args.json).write_text(json.dumps({
    "command": "PYTHONPATH=code python code/ch08_plan/simulate_grid.py " + " ".join(sys.argv[1:]),
    "missing": MISSING,
    "runs": commands, "torch": torch.__version__, "limits": run["limits"],
    "results": results}, indent=1))
print(f"{len(results)} points from {len(paths)} runs -> {args.json}")

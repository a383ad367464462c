"""DDP's gradient buckets, measured: how many all-reduces per step, how many bytes, and how much
of the communication hides under backward, for several bucket sizes, in one launch.

    code/run_w_torchrun.sh 2 ch01_ddp/ddp_buckets.py --caps 25,0.1,0.025 --json /tmp/buckets.json

For each bucket cap, and with find_unused_parameters off (the default) and on, a fresh DDP model
(same seed) trains --steps steps while distkit.ddp.CommLog records every bucket's all-reduce.
What to look for:
- step 1 with find_unused_parameters=False: ONE bucket whatever the cap. DDP deliberately puts
  every parameter in one bucket for the first iteration (compute_bucket_size_limits uses
  sys.maxsize), records the order in which gradients arrive, then rebuilds buckets of about
  bucket_cap_mb in that order (torch/nn/parallel/distributed.py).
- with find_unused_parameters=True the buckets are capped from the start and never rebuilt.
- every step all-reduces exactly the gradient bytes, however they are bucketed.
"""
import argparse
import os

# find_unused_parameters=True on a model without unused parameters makes DDP warn, once per rank,
# that it costs an extra autograd-graph traversal every step. True, and not what we measure here:
# keep the C++ warnings quiet (set before torch is imported).
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")

import torch  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

from distkit import print0, seed_everything, setup, teardown, write_json  # noqa: E402
from distkit.ddp import CommLog, overlap  # noqa: E402
from distkit.toy import counting_data, tiny_llama  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--caps", default="25,0.1,0.025", help="bucket_cap_mb values, comma-separated")
parser.add_argument("--steps", type=int, default=6, help="training steps per setting")
parser.add_argument("--batch-size", type=int, default=8, help="sequences per rank")
parser.add_argument("--json", help="write every all-reduce and overlap figure here (rank 0)")
args = parser.parse_args()
try:
    caps = [float(c) for c in args.caps.split(",")]
except ValueError:
    parser.error(f"--caps wants numbers separated by commas, got {args.caps!r}")
if min(caps) <= 0 or args.steps < 2 or args.batch_size < 1:
    parser.error("need every cap > 0, --steps >= 2 and --batch-size >= 1")

env = setup()
(tokens,) = counting_data(args.batch_size * env.world_size)[:]
tokens = tokens[env.rank::env.world_size].to(env.device)  # this rank's share of one batch

results = []
print0(f"{'bucket_cap_mb':>13} {'find_unused':>11} {'step 1':>7} {'later':>6} "
       f"{'bytes/step':>11} {'gradient bytes':>14}")
for cap in caps:
    for find_unused in (False, True):
        seed_everything(0)
        model = DDP(tiny_llama().to(env.device), bucket_cap_mb=cap,
                    find_unused_parameters=find_unused,
                    device_ids=[env.device.index] if env.device.type == "cuda" else None)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        log = CommLog.attach(model)
        for _ in range(args.steps):
            model(input_ids=tokens, labels=tokens).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        summary = log.summary(model)
        per_step = [[c for c in summary["calls"] if c["backward"] == s] for s in range(args.steps)]
        step_bytes = {sum(c["bytes"] for c in calls) for calls in per_step}
        later = sorted({len(calls) for calls in per_step[1:]})
        print0(f"{cap:>13} {find_unused!s:>11} {len(per_step[0]):>7} "
               f"{','.join(map(str, later)):>6} {','.join(f'{b:,}' for b in step_bytes):>11} "
               f"{summary['grad_bytes']:>14,}")
        results.append({"cap_mb": cap, "find_unused": find_unused, **summary,
                        "buckets_per_step": [len(calls) for calls in per_step],
                        "overlap": [overlap(summary, s) for s in range(args.steps)]})
write_json(args.json, {"world_size": env.world_size, "backend": env.backend,
                       "settings": results})
teardown()

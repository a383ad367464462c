"""Memory per rank under DDP, by category, from torch's MemTracker, against 4 + 4 + 8 bytes/param.

    code/run_w_torchrun.sh 2 ch01_ddp/ddp_memory.py

Every DDP rank holds the full model: fp32 parameters (4 bytes each), fp32 gradients (4) and
AdamW's two moments (8): 16 bytes per parameter on every rank, however many ranks there are.
That redundancy is what ZeRO and FSDP remove (chapters 03 and 04).
"""
import argparse

import torch
import torch.distributed as dist
from torch.distributed._tools.mem_tracker import MemTracker
from torch.nn.parallel import DistributedDataParallel as DDP

from distkit import print0, print_ranks, seed_everything, setup, teardown, write_json
from distkit.toy import counting_data, tiny_llama

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--hidden", type=int, default=64, help="model width")
parser.add_argument("--layers", type=int, default=2, help="transformer blocks")
parser.add_argument("--batch-size", type=int, default=8, help="sequences per rank")
parser.add_argument("--json", help="write bytes per category here (rank 0)")
args = parser.parse_args()
if args.hidden < 4 or args.hidden % 4 or args.layers < 1 or args.batch_size < 1:
    parser.error("need --hidden a multiple of 4, --layers >= 1 and --batch-size >= 1")

env = setup()
seed_everything(0)
model = DDP(tiny_llama(hidden=args.hidden, layers=args.layers).to(env.device),
            device_ids=[env.device.index] if env.device.type == "cuda" else None)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
(tokens,) = counting_data(args.batch_size)[:]
tokens = tokens.to(env.device)
n_params = sum(p.numel() for p in model.parameters())

tracker = MemTracker()
tracker.track_external(model, optimizer)
with tracker:  # one full step; the optimizer creates its state on the first step
    model(input_ids=tokens, labels=tokens).loss.backward()
    optimizer.step()
    after_step = tracker.get_tracker_snapshot("current")[env.device]
peak = tracker.get_tracker_snapshot("peak")[env.device]
# snapshot keys are categories (an enum whose values read "Parameter", "Gradient", ...)
after_step = {getattr(k, "value", k): v for k, v in after_step.items()}
peak = {getattr(k, "value", k): v for k, v in peak.items()}

measured = {"params": after_step["Parameter"], "grads": after_step["Gradient"],
            "optimizer": after_step["Optstate"], "peak_activations": peak["Activation"]}
print0(f"{n_params:,} parameters; formula: params 4, grads 4, AdamW 8 bytes each = 16")
print_ranks("  ".join(f"{name} {measured[name] / n_params:.3f}"
                      for name in ("params", "grads", "optimizer"))
            + f"  B/param; peak activations {measured['peak_activations']:,} B")
every_rank = [None] * env.world_size
dist.all_gather_object(every_rank, measured)
write_json(args.json, {"world_size": env.world_size, "num_params": n_params,
                       "num_tensors": len(list(model.parameters())),
                       **{k: [m[k] for m in every_rank] for k in measured}})
teardown()

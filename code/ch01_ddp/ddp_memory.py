"""Memory per rank under DDP, by category, from torch's MemTracker, against 4 + 4 + 8 bytes/param,
plus DDP's own gradient buckets, with gradient_as_bucket_view off (default) and on.

    code/run_w_torchrun.sh 2 ch01_ddp/ddp_memory.py --batch-size 8,4

Every DDP rank holds the full model: fp32 parameters (4 bytes each), fp32 gradients (4) and
AdamW's two moments (8): 16 bytes per parameter on every rank, however many ranks there are.
DDP also all-reduces gradients through flat bucket buffers. By default they are a second copy of
the gradients (+4 bytes/param); with gradient_as_bucket_view=True the gradients *are* views into
the buckets. MemTracker does not see the buckets (DDP's C++ reducer allocates them at
construction), so gradients and buckets are measured here by storage: the bytes of the distinct
storages that hold a gradient or a bucket.
What shrinks with more ranks at a fixed global batch is the activations: each rank's share of
the batch (--batch-size, per rank) shrinks. A list of batch sizes measures each in one launch.
"""
import argparse

import torch
import torch.distributed as dist
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from distkit import int_list, print0, print_ranks, seed_everything, setup, teardown, write_json
from distkit.toy import counting_data, tiny_llama

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--hidden", type=int, default=64, help="model width")
parser.add_argument("--layers", type=int, default=2, help="transformer blocks")
parser.add_argument("--batch-size", type=int_list, default=[8],
                    help="sequences per rank; a list (8,4) measures each")
parser.add_argument("--json", help="write bytes per category here (rank 0)")
args = parser.parse_args()
if args.hidden < 4 or args.hidden % 4 or args.layers < 1 or min(args.batch_size, default=0) < 1:
    parser.error("need --hidden a multiple of 4, --layers >= 1 and every --batch-size >= 1")


def storage(t: torch.Tensor) -> tuple[int, int]:
    return t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()


def measure(batch_size: int, as_view: bool) -> dict:
    """One training step of a fresh DDP model inside MemTracker; returns bytes per category."""
    (tokens,) = counting_data(batch_size)[:]
    tokens = tokens.to(env.device)
    seed_everything(0)
    model = DDP(tiny_llama(hidden=args.hidden, layers=args.layers).to(env.device),
                gradient_as_bucket_view=as_view,
                device_ids=[env.device.index] if env.device.type == "cuda" else None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    buckets = {}

    def record_buckets(state, bucket):  # DDP's default all-reduce, noting each bucket's storage
        buckets.update([storage(bucket.buffer())])
        return default_hooks.allreduce_hook(state, bucket)

    model.register_comm_hook(None, record_buckets)
    tracker = MemTracker()
    tracker.track_external(model, optimizer)
    with tracker:  # the optimizer creates its state on the first step
        model(input_ids=tokens, labels=tokens).loss.backward()
        optimizer.step()
        snapshot = tracker.get_tracker_snapshot("current")  # {device: {category: bytes}}
    peak = tracker.get_tracker_snapshot("peak")[env.device]
    # snapshot keys are categories (an enum whose values read "Parameter", "Gradient", ...)
    now = {getattr(k, "value", k): v for k, v in snapshot[env.device].items()}
    peak = {getattr(k, "value", k): v for k, v in peak.items()}
    # AdamW's step counters live on the CPU unless capturable or fused (torch/optim/adam.py,
    # _init_group): on a GPU they are not in cuda:0's snapshot, so sum the state over devices
    optimizer_bytes = sum(v for per_device in snapshot.values() for k, v in per_device.items()
                          if getattr(k, "value", k) == "Optstate")
    grad_storages = dict(storage(p.grad) for p in model.parameters())
    return {"params": now["Parameter"], "optimizer": optimizer_bytes,
            "optimizer_on_device": now["Optstate"],
            # distinct storages holding gradients or buckets: with views they are the same ones
            "grads_and_buckets": sum({**grad_storages, **buckets}.values()),
            "grads_tracked": now["Gradient"], "peak_activations": peak["Activation"],
            "num_tensors": len(list(model.parameters()))}


env = setup()
n_params = sum(p.numel() for p in tiny_llama(hidden=args.hidden, layers=args.layers).parameters())
print0(f"{n_params:,} parameters; formula: params 4 + grads 4 + AdamW 8 = 16 bytes/param")
results = {}
for b in args.batch_size:
    for view in (False, True):
        results[b, view] = m = measure(b, view)
        print0(f"{b} sequences per rank, gradient_as_bucket_view={view}:")
        print_ranks("  ".join(f"{name} {m[name] / n_params:.3f}" for name in
                              ("params", "optimizer", "grads_and_buckets"))
                    + f"  B/param; peak activations {m['peak_activations']:,} B")
every_rank = [None] * env.world_size
dist.all_gather_object(every_rank, results)
# settings[batch size][gradient_as_bucket_view][category]: one number per rank
settings = {}
for (b, view), m in results.items():
    settings.setdefault(str(b), {})[str(view)] = {k: [r[b, view][k] for r in every_rank] for k in m}
write_json(args.json, {"world_size": env.world_size, "num_params": n_params,
                       "batch_sizes": args.batch_size, "settings": settings})
teardown()

"""A small data-parallel training loop with three classic bugs, each switched on by --bug.

    code/run_w_torchrun.sh 2 ch07_debugging/buggy_train.py              # no bug: it trains
    code/run_w_torchrun.sh 2 ch07_debugging/buggy_train.py --bug save   # hangs until the timeout
    TORCH_DISTRIBUTED_DEBUG=DETAIL \
        code/run_w_torchrun.sh 2 ch07_debugging/buggy_train.py --bug gather
    code/run_w_torchrun.sh 2 ch07_debugging/buggy_train.py --bug crash
    code/run_w_torchrun.sh 2 ch07_debugging/buggy_train.py --bug crash --check-labels

save:   only rank 0 saves the checkpoint, and saving ends with a barrier ("so that no rank reads a
        half-written file"). Rank 0 waits in the barrier, rank 1 in the next step's gradient
        all-reduce: two different collectives, which meet nobody. Both wait until the process
        group's timeout. (FSDP's state_dict() called on rank 0 only is the same bug: it gathers.)
gather: at evaluation every rank all-gathers its predictions, but the ranks hold different
        numbers of them (8N - 1 held-out samples on N ranks: the last rank has 7, the others 8).
        Shapes differ between ranks.
crash:  rank 1 meets a corrupt label (-1) at step 3: cross_entropy raises; torchrun stops the
        other ranks. On the CPU it raises IndexError at once; on a GPU the same label is a
        device-side assert inside the kernel, reported later ("CUDA error: device-side assert
        triggered", at the next synchronisation: here the loss's .item()). --check-labels
        checks every batch's labels on the host, where the data is read, before it goes to the
        device: a ValueError naming the rank, step and sample, the same on CPU and GPU.

The training itself is hand-rolled data parallelism (chapter 01): each rank computes the
gradient of its shard of the batch, one all-reduce averages them, every rank steps.
--fr-dir DIR dumps the flight recorder: every process keeps its last collectives (all groups
together) in a ring buffer, 2000 entries by default in torch 2.13 (TORCH_FR_BUFFER_SIZE, read
when the first group is created), for torch's analyser (`python -m
torch.distributed.flight_recorder.fr_trace DIR`), one file per rank, DIR/rank_R.
- NCCL: the rank's watchdog thread dumps it by itself when a collective times out
  (TORCH_NCCL_DUMP_ON_TIMEOUT, on by default), to TORCH_FR_DUMP_TEMP_FILE + rank (default
  ~/.cache/torch/comm_lib_trace_rank_R; set below to DIR/rank_ unless given), then takes the
  process down (TORCH_NCCL_ASYNC_ERROR_HANDLING=3): no Python exception is raised, so the
  `except` below never runs there, and the script leaves the dump to the watchdog.
- gloo: the record is kept but not dumped, hence the `except` below: when a collective fails
  (its timeout), the rank writes the buffer itself. Both ranks of the hang time out at about the
  same moment, and the first to exit makes torchrun SIGTERM the other, maybe before it has dumped:
  a SIGTERM handler dumps then too (Python runs it once the rank's own timed-out collective has
  returned). The script's dumps say so in their "dumped_by" key; the watchdog's have none.
"""
import argparse
import os
import pickle
import signal
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.elastic.multiprocessing.errors import record

from distkit import print0, seed_everything, setup, teardown

BUGS = ("none", "save", "gather", "crash")
parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--bug", default="none", choices=BUGS)
parser.add_argument("--steps", type=int, default=6)
parser.add_argument("--save-at", type=int, default=2, help="step after which to save")
parser.add_argument("--timeout", type=float, default=5.0,
                    help="process-group timeout, seconds (torch's default: 30 min for gloo)")
parser.add_argument("--fr-dir", type=Path, help="record collectives; dump them here on failure")
parser.add_argument("--check-labels", action="store_true",
                    help="check each batch's labels on the host before it goes to the device")
parser.add_argument("--out", type=Path, default=Path("build/ch07/buggy_train"),
                    help="checkpoint folder")
args = parser.parse_args()
if not 0 < args.save_at < args.steps:
    parser.error(f"--save-at must be between 1 and --steps - 1, got {args.save_at}")
if args.timeout <= 0:
    parser.error(f"--timeout must be positive, got {args.timeout}")
CLASSES = 4
if args.fr_dir:  # NCCL's watchdog writes its dump to this prefix + rank (it makes no folder)
    args.fr_dir.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("TORCH_FR_DUMP_TEMP_FILE", str(args.fr_dir / "rank_"))


def dump_flight_record(why: str):
    """This rank's flight-recorder buffer, written where fr_trace looks for it (a pickle), on
    gloo; on NCCL the watchdog writes it (see the docstring)."""
    if env.backend == "nccl":
        return
    dump = pickle.loads(torch._C._distributed_c10d._dump_fr_trace())
    dump["dumped_by"] = f"buggy_train.py, {why}"  # (the analyser reads only the keys it knows)
    if "" in dump["pg_config"]:  # gloo's dump (2.13) leaves the default group's name empty, ...
        config = dump["pg_config"].pop("")  # ... which the analyser cannot match with its entries
        dump["pg_config"]["0"] = {**config, "name": "0", "desc": "default_pg"}
    (args.fr_dir / f"rank_{dist.get_rank()}").write_bytes(pickle.dumps(dump))


def average_gradients(model):
    flat = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    dist.all_reduce(flat)  # one all-reduce of all gradients (a single bucket)
    flat /= dist.get_world_size()
    for p, g in zip(model.parameters(), flat.split([p.numel() for p in model.parameters()])):
        p.grad.copy_(g.view_as(p))


def save_checkpoint(model, path):
    if dist.get_rank() == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(model.state_dict(), path)
    dist.barrier()  # no rank goes on (and maybe reads it) before the file is complete


def check_labels(y, rank: int, step: int):
    """On the host, where the data is read: a label outside [0, CLASSES) is named here, with its
    sample, instead of failing inside cross_entropy (on a GPU: an assert in a kernel, reported
    asynchronously, later, and the CUDA context unusable after it)."""
    bad = ((y < 0) | (y >= CLASSES)).nonzero().flatten()
    if len(bad):
        i = bad[0].item()
        raise ValueError(f"rank {rank}, step {step}: label {y[i].item()} of sample {i} is "
                         f"outside [0, {CLASSES}) ({len(bad)} bad in this batch)")


def evaluate(model, x, y):
    """Every rank predicts its shard of the held-out set; rank 0 gets all the predictions."""
    x, y = x[env.rank::env.world_size], y[env.rank::env.world_size]  # 8, ..., 8, 7
    pred = model(x).argmax(-1)
    if args.bug != "gather":  # the fix: pad every shard to the longest, then drop the padding
        n = torch.tensor([len(pred)], device=env.device)
        dist.all_reduce(n, op=dist.ReduceOp.MAX)
        pred, y = F.pad(pred, (0, n.item() - len(pred)), value=-1), \
            F.pad(y, (0, n.item() - len(y)), value=-1)
    preds = [torch.empty_like(pred) for _ in range(env.world_size)]
    ys = [torch.empty_like(y) for _ in range(env.world_size)]
    dist.all_gather(preds, pred)  # the bug: 8 values here, 7 on the last rank
    dist.all_gather(ys, y)
    pred, y = torch.cat(preds), torch.cat(ys)
    return (pred == y)[y >= 0].float().mean().item()


@record  # a failure's traceback goes into torchrun's error file (TORCHELASTIC_ERROR_FILE)
def main():
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, CLASSES)).to(env.device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    g = torch.Generator().manual_seed(0)  # the same data on every rank; each takes its shard
    x = torch.randn(64, 16, generator=g)
    x_val = torch.randn(8 * env.world_size - 1, 16, generator=g)  # uneven on purpose
    y, y_val = x[:, :CLASSES].argmax(-1), x_val[:, :CLASSES].argmax(-1)  # which is largest
    x_val, y_val = x_val.to(env.device), y_val.to(env.device)
    for step in range(1, args.steps + 1):
        xb, yb = x[env.rank::env.world_size], y[env.rank::env.world_size]  # read on the host
        if args.bug == "crash" and env.rank == 1 and step == 3:
            yb = yb.clone()
            yb[0] = -1  # a corrupt label in rank 1's data
        if args.check_labels:
            check_labels(yb, env.rank, step)
        xb, yb = xb.to(env.device), yb.to(env.device)
        loss = F.cross_entropy(model(xb), yb)
        optimizer.zero_grad()
        loss.backward()
        average_gradients(model)
        optimizer.step()
        dist.all_reduce(loss.detach_())  # every rank joins, rank 0 prints
        print0(f"step {step}: loss {loss.item() / env.world_size:.2f}")
        if step == args.save_at:
            if args.bug == "save":
                if env.rank == 0:  # the bug: only rank 0 calls the (collective) save
                    save_checkpoint(model, args.out / "model.pt")
            else:
                save_checkpoint(model, args.out / "model.pt")
    print0(f"held-out accuracy: {evaluate(model, x_val, y_val):.2f}")


env = setup(timeout_s=args.timeout)
seed_everything(0)
if args.fr_dir:
    signal.signal(signal.SIGTERM, lambda signum, _: (dump_flight_record("on SIGTERM"),
                                                     os._exit(128 + signum)))
try:
    main()
except Exception:  # gloo: a timed-out collective raises (NCCL's watchdog kills the process)
    if args.fr_dir:
        dump_flight_record("on its exception")
    raise
teardown()

"""Your first distributed program: torchrun starts N copies; each joins the group and sums.

    code/run_w_torchrun.sh 2 ch00_collectives/hello.py
"""
import os

import torch
import torch.distributed as dist

if "RANK" not in os.environ:  # torchrun sets RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT
    raise SystemExit("hello.py: run it with code/run_w_torchrun.sh 2 ch00_collectives/hello.py")
gpu = torch.cuda.is_available()
device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if gpu else torch.device("cpu")
if gpu:
    torch.cuda.set_device(device)  # one GPU per process, before any CUDA work
# join the group: wait for all WORLD_SIZE processes (NCCL does so only when given device_id)
dist.init_process_group("nccl" if gpu else "gloo", device_id=device if gpu else None)
rank, world_size = dist.get_rank(), dist.get_world_size()
x = torch.tensor([rank + 1.0], device=device)  # rank 0 holds 1, rank 1 holds 2, ...
dist.all_reduce(x)  # a collective: every rank calls it, every rank gets the sum
print(f"rank {rank} of {world_size}: all_reduce gave {x.item():g}")
dist.destroy_process_group()

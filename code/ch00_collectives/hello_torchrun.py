"""What torchrun starts: NPROC copies of this script, told apart only by environment variables.

    code/run_w_torchrun.sh 2 ch00_collectives/hello_torchrun.py
"""
import argparse
import os
from datetime import timedelta

import torch.distributed as dist

from distkit import pick_device, print_ranks

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.parse_args()
if "RANK" not in os.environ:
    raise SystemExit("hello_torchrun.py: not started by torchrun; "
                     "run it as: code/run_w_torchrun.sh 2 ch00_collectives/hello_torchrun.py")

# 1. torchrun put these in every process's environment before starting it.
names = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"]
seen = "  ".join(f"{k}={os.environ[k]}" for k in names)

# 2. Pick the backend: NCCL moves GPU memory over NVLink/InfiniBand; gloo moves CPU memory
#    over TCP. Same API, different transport.
device, backend = pick_device(int(os.environ["LOCAL_RANK"]))

# 3. Join the group. With no init_method, init_process_group reads RANK, WORLD_SIZE,
#    MASTER_ADDR and MASTER_PORT from the environment ("env://"): every rank connects to the
#    store at MASTER_ADDR:MASTER_PORT (run by torchrun) and waits until all WORLD_SIZE arrived.
#    A short timeout turns a missing rank into an error instead of a hang.
dist.init_process_group(backend, timeout=timedelta(seconds=60))

print_ranks(f"{seen}\nbackend={dist.get_backend()} device={device} "
            f"dist.get_rank()={dist.get_rank()} dist.get_world_size()={dist.get_world_size()}")
dist.barrier()  # leave together: nobody closes connections a peer is still using
dist.destroy_process_group()

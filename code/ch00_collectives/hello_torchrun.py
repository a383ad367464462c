"""What torchrun starts: NPROC copies of this script, told apart only by environment variables.

    code/run_w_torchrun.sh 2 ch00_collectives/hello_torchrun.py
    code/run_w_torchrun.sh 2 ch00_collectives/hello_torchrun.py --direct   # ranks also print()
    RANKS=0 code/run_w_torchrun.sh 2 ch00_collectives/hello_torchrun.py --direct
    code/run_w_torchrun.sh 2 ch00_collectives/hello_torchrun.py --ports  # torchrun's two stores
"""
import argparse
import os
from datetime import timedelta

import torch
import torch.distributed as dist

from distkit import pick_device, print_ranks

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--direct", action="store_true",
                    help="every rank also print()s one line itself: the lines race each other, "
                         "and torchrun's --local-ranks-filter (RANKS=0) hides the other ranks'")
parser.add_argument("--ports", action="store_true",
                    help="rank 0 also lists the TCP ports torchrun (its parent) listens on")
args = parser.parse_args()
if "RANK" not in os.environ:
    raise SystemExit("hello_torchrun.py: not started by torchrun; "
                     "run it as: code/run_w_torchrun.sh 2 ch00_collectives/hello_torchrun.py")

# 1. torchrun put these in every process's environment before starting it.
names = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"]
seen = "  ".join(f"{k}={os.environ[k]}" for k in names)

# 2. Pick the backend: NCCL moves GPU memory over NVLink/InfiniBand; gloo moves CPU memory
#    over TCP. Same API, different transport. On a GPU node each process must claim its own
#    GPU before anything touches CUDA: without set_device every rank would use cuda:0.
device, backend = pick_device(int(os.environ["LOCAL_RANK"]))
if device.type == "cuda":
    torch.cuda.set_device(device)

# 3. Join the group. With no init_method, init_process_group reads RANK, WORLD_SIZE,
#    MASTER_ADDR and MASTER_PORT from the environment ("env://"): every rank connects to the
#    store at MASTER_ADDR:MASTER_PORT (run by torchrun). gloo then connects every pair of ranks,
#    so it waits until all WORLD_SIZE arrived. NCCL does the same (ncclCommInit) here only when
#    given device_id; without it NCCL starts lazily, and a missing rank shows only as a hang in
#    the first collective. A short timeout turns a missing rank into an error instead of a hang.
dist.init_process_group(backend, timeout=timedelta(seconds=60),
                        device_id=device if device.type == "cuda" else None)
rank = dist.get_rank()

# 4. A plain print() goes straight from this process to its own stdout: torchrun shows every
#    rank's stdout on the console, so these lines race (and RANKS=0 shows rank 0's only).
#    The thread count is the launcher's choice: OMP_NUM_THREADS = cores // NPROC unless set.
if args.direct:
    print(f"rank {rank} print()s directly: OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}, "
          f"torch.get_num_threads()={torch.get_num_threads()}", flush=True)

# 5. print_ranks is a collective (gather_object to rank 0): every rank sends its text, rank 0
#    prints them all in rank order. Same output every run, but all of it comes from rank 0.
print_ranks(f"{seen}\nbackend={dist.get_backend()} device={device} "
            f"dist.get_rank()={rank} dist.get_world_size()={dist.get_world_size()}")

# 6. Two stores, two ports: on one node (--standalone), torchrun's agent listens on the
#    rendezvous store's port (a free one) and on the workers' store's, MASTER_PORT.
if args.ports and rank == 0:
    import psutil
    agent = psutil.Process(os.getppid())  # the torchrun agent started this worker
    ports = sorted({c.laddr.port for c in agent.net_connections("tcp")
                    if c.status == psutil.CONN_LISTEN})
    master = int(os.environ["MASTER_PORT"])
    print(f"torchrun's agent listens on {len(ports)} TCP ports: MASTER_PORT={master} (the "
          f"workers' store: {master in ports}), "
          + ", ".join(f"port {p}" for p in ports if p != master) + " (the rendezvous store)",
          flush=True)
dist.barrier()  # leave together: nobody closes connections a peer is still using
dist.destroy_process_group()

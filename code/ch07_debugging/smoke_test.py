"""Cluster smoke test: every rank joins, uses its device, agrees on versions, all-reduces right.

    code/run_w_torchrun.sh 2 ch07_debugging/smoke_test.py
    code/run_w_torchrun.sh 2 ch07_debugging/smoke_test.py --pretend 1:torch=2.12.1  # fails fast
    code/run_w_torchrun.sh 2 ch07_debugging/smoke_test.py --bandwidth   # + a (noisy) bandwidth
    NNODES=2 RDZV_ENDPOINT=node0:29500 code/run_w_torchrun.sh 8 ch07_debugging/smoke_test.py

Run it first on a new machine or cluster, before any training script: in seconds it says whether
the ranks can work together, and when they cannot, which rank (and host) and what. Nothing waits
longer than --timeout, and every failed check exits non-zero with one line per problem.
1. Join the process group (distkit.setup: the device is cuda:LOCAL_RANK with NCCL, else the CPU
   with gloo; too few GPUs for the node's processes fail right there).
2. The device computes: a small matmul on it, against float64 on the CPU (a torch built for
   another GPU generation fails here: "no kernel image is available").
3. The environment: every rank's host, torch, CUDA, NCCL and Python versions, backends and
   device, gathered to every rank (all_gather_object). torch, CUDA, NCCL, Python (major.minor)
   and the GPUs per node must agree: two NCCL versions can disagree on their wire protocol (a
   hang, or "receiving 524288 bytes instead of 65536": NVIDIA/nccl#1328), two torch versions
   can issue different collectives for the same code (DDP's buckets, FSDP's all-gathers), another
   Python is another install (its own torch and packages), and a node with a GPU fewer (one
   fell off the bus, or CUDA_VISIBLE_DEVICES differs) breaks the job's layout. Every rank sees
   every report, so all of them stop together, at once, each printing one line per problem
   ("SmokeTestError: ranks disagree on torch: ...", naming the ranks, hosts and values). On
   GPUs, two ranks of one host must not share a GPU.
4. Collectives: all_reduce of rank + 1 must give N(N+1)/2 on every rank, and of a 16 MiB tensor
   (the transport's real path: chunked, pipelined) exactly its expected values; then a barrier.
--pretend RANK:FIELD=VALUE makes that rank report another value, to see check 3 fail on one
machine. What differs by machine (host names, versions) is printed under "environment";
--hide-env leaves it out (--json keeps it), so what remains reads the same everywhere.
"""
import argparse
import os
import platform
import re
import socket
import sys
import time

import torch
import torch.distributed as dist

from distkit import print0, print_ranks, setup, teardown, write_json

AGREE = ("torch", "cuda", "nccl", "python", "gpus")  # must be the same on every rank
MATMUL_TOL = 1e-2  # relative: TF32 matmuls (~1e-3) pass, garbage or a failed kernel does not
PRETEND = re.compile(r"(\d+):(\w+)=(.+)")


def pretend_arg(text: str) -> tuple[int, str, object]:
    """An argparse `type=` for RANK:FIELD=VALUE."""
    m = PRETEND.fullmatch(text)
    if not m:
        raise argparse.ArgumentTypeError(f"expected RANK:FIELD=VALUE (e.g. 1:torch=2.12.1), "
                                         f"got {text!r}")
    rank, field, value = int(m[1]), m[2], m[3]
    if field not in AGREE:
        raise argparse.ArgumentTypeError(f"unknown field {field!r} in {text!r}; "
                                         f"choose from {', '.join(AGREE)}")
    if field == "gpus":
        if not value.isdigit():
            raise argparse.ArgumentTypeError(f"gpus must be a count, got {value!r}")
        value = int(value)
    return rank, field, value


parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--timeout", type=float, default=30,
                    help="seconds any rendezvous or collective may wait before failing")
parser.add_argument("--pretend", type=pretend_arg, action="append", default=[],
                    metavar="RANK:FIELD=VALUE",
                    help=f"that rank reports VALUE for FIELD (one of {', '.join(AGREE)}): "
                         "a demonstration of the check failing; repeatable")
parser.add_argument("--bandwidth", action="store_true",
                    help="also time an all-reduce and print its bus bandwidth (noisy; off by "
                         "default: a smoke test should take seconds)")
parser.add_argument("--bandwidth-mib", type=int, default=64,
                    help="tensor size of the --bandwidth all-reduce, in MiB")
parser.add_argument("--hide-env", action="store_true",
                    help="leave out the environment lines (host names and versions, which "
                         "differ by machine); --json keeps them")
parser.add_argument("--json", help="write every rank's report and the checks' results here")
args = parser.parse_args()
if args.timeout <= 0:
    parser.error("need --timeout > 0")
if args.bandwidth_mib < 1:
    parser.error("need --bandwidth-mib >= 1")
world = int(os.environ.get("WORLD_SIZE", 0))  # set by torchrun; checked here, before setup()
for rank, field, _ in args.pretend:
    if world and rank >= world:
        parser.error(f"--pretend {rank}:{field}: there is no rank {rank} in {world} ranks")

# --- 1. join ------------------------------------------------------------------------------
start = time.perf_counter()
env = setup(timeout_s=args.timeout)
seconds = {"setup": time.perf_counter() - start}
host = socket.gethostname()
local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 0))  # processes on this node (torchrun)


def span(ranks: list[int]) -> str:
    """[0, 1, 2, 5] -> "ranks 0-2, 5"."""
    parts, first = [], ranks[0]
    for a, b in zip(ranks, ranks[1:] + [None]):
        if b != a + 1:
            parts.append(str(first) if first == a else f"{first}-{a}")
            first = b
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(parts)


def fail(problems: list[str], results: dict) -> None:
    """Every rank knows the same problems (they come from gathered reports): each says them on
    its own stderr, one line each, in the form of an exception's last line (so its log says why
    it stopped, and run_w_torchrun.sh's summary and a notebook's launch(expect_failure=True)
    pick them up), then all leave together with exit status 1."""
    write_json(args.json, {**results, "ok": False, "problems": problems})
    for p in problems:
        print(f"SmokeTestError: {p}", file=sys.stderr, flush=True)
    dist.barrier()
    dist.destroy_process_group()
    os._exit(1)  # at once, as distkit.teardown does (no gloo shutdown race)


# --- 2. the device --------------------------------------------------------------------------
mine = []  # this rank's own problems
if env.device.type == "cuda" and local_world and torch.cuda.device_count() < local_world:
    mine.append(f"{torch.cuda.device_count()} GPU(s) visible for {local_world} processes "
                f"on this node")
a = torch.randn(256, 256, generator=torch.Generator().manual_seed(0))
try:
    out = (a.to(env.device) @ a.to(env.device).T).double().cpu()
    ref = a.double() @ a.double().T
    matmul_err = ((out - ref).abs().max() / ref.abs().max()).item()
    if not matmul_err < MATMUL_TOL:  # also catches NaN
        mine.append(f"a matmul on {env.device} is wrong: relative error {matmul_err:.1e}")
except RuntimeError as e:  # e.g. "CUDA error: no kernel image is available for ..."
    matmul_err = None
    mine.append(f"a matmul on {env.device} failed: {str(e).splitlines()[0]}")

# --- 3. the environment, from every rank --------------------------------------------------
nccl = None
if torch.version.cuda and dist.is_nccl_available():
    nccl = ".".join(map(str, torch.cuda.nccl.version()))
report = {
    "rank": env.rank, "local_rank": env.local_rank, "local_world_size": local_world,
    "host": host, "device": str(env.device),
    "device_name": (torch.cuda.get_device_name(env.device) if env.device.type == "cuda"
                    else f"cpu ({platform.machine()})"),
    "device_uuid": (str(torch.cuda.get_device_properties(env.device).uuid)
                    if env.device.type == "cuda" else None),
    "gpus": torch.cuda.device_count(),
    "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
    "torch": torch.__version__, "cuda": torch.version.cuda, "nccl": nccl,
    "python": "{}.{}".format(*sys.version_info[:2]), "python_full": platform.python_version(),
    "backends": [b for b in ("gloo", "nccl", "mpi")
                 if getattr(dist, f"is_{b}_available")()],
    "matmul_error": matmul_err, "problems": mine,
}
for rank, field, value in args.pretend:
    print0(f"--pretend: rank {rank} reports {field} {value} (a demonstration)")
    if rank == env.rank:
        report[field] = value
        if field == "python":
            report["python_full"] = value
start = time.perf_counter()
reports = [None] * env.world_size
dist.all_gather_object(reports, report)
seconds["gather"] = time.perf_counter() - start

hosts = list(dict.fromkeys(r["host"] for r in reports))  # in rank order: node i = hosts[i]


def who(ranks: list[int]) -> str:
    """"rank 3 (host b)", "ranks 0-7 (hosts a, b)": ranks with their hosts."""
    names = list(dict.fromkeys(reports[r]["host"] for r in ranks))
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    return f"{span(ranks)} ({'host' if len(names) == 1 else 'hosts'} {shown})"


disagree = {}  # field -> {value: ranks}, for every field whose values differ
for field in AGREE:
    by_value = {}
    for r in reports:
        by_value.setdefault("none" if r[field] is None else str(r[field]), []).append(r["rank"])
    if len(by_value) > 1:
        disagree[field] = by_value
problems = [f"ranks disagree on {field}: " + ", ".join(
    f"{value} on {who(ranks)}"  # the majority first: the odd one out stands out
    for value, ranks in sorted(by_value.items(), key=lambda kv: (-len(kv[1]), kv[1][0])))
    for field, by_value in disagree.items()]
problems += [f"{who([r['rank']])}: {p}" for r in reports for p in r["problems"]]
gpus_seen = {}  # (host, GPU uuid) -> ranks: two ranks on one GPU make NCCL fail or hang
for r in reports:
    if r["device_uuid"]:
        gpus_seen.setdefault((r["host"], r["device_uuid"]), []).append(r["rank"])
problems += [f"{who(ranks)} share one GPU ({uuid})"
             for (_, uuid), ranks in gpus_seen.items() if len(ranks) > 1]

environment = []  # one line per node and software, in rank order
groups = {}
for r in reports:
    key = (r["host"], r["torch"], r["cuda"] or "none", r["nccl"] or "none", r["python_full"],
           "+".join(r["backends"]), r["device_name"], r["gpus"],
           r["cuda_visible_devices"] or "unset")
    groups.setdefault(key, []).append(r["rank"])
for (h, tv, cv, nv, pv, bv, dv, gv, vis), ranks in groups.items():
    environment.append(f"node {hosts.index(h)} = {h}, {span(ranks)}: torch {tv}, CUDA {cv}, "
                       f"NCCL {nv}, Python {pv}, backends {bv}, device {dv}, {gv} GPU(s), "
                       f"CUDA_VISIBLE_DEVICES {vis}")
results = {"world_size": env.world_size, "nodes": hosts, "backend": env.backend,
           "timeout_s": args.timeout, "agree_fields": list(AGREE), "agree": not disagree,
           "disagree": disagree, "pretend": [list(p) for p in args.pretend],
           "reports": reports, "environment": environment, "seconds": seconds}

print0(f"smoke test: {env.world_size} ranks on {len(hosts)} node(s), backend {env.backend}, "
       f"device type {env.device.type}, timeout {args.timeout:g} s")
if not args.hide_env:
    print0("environment (differs by machine):\n  " + "\n  ".join(environment))
print0(f"ranks agree on {', '.join(AGREE)}: {not disagree}")
print0(f"every rank's device works (a 256x256 matmul): {all(not r['problems'] for r in reports)}")
if problems:
    fail(problems, results)

# --- 4. collectives -------------------------------------------------------------------------
start = time.perf_counter()
n = env.world_size
small = torch.tensor([env.rank + 1.0], device=env.device)
dist.all_reduce(small)
# 16 MiB whose every element differs (a chunk delivered to the wrong place shows); sums of
# integers below 2**24 are exact in float32 in any order, so == holds (up to ~5000 ranks)
pattern = (torch.arange(2**22, device=env.device) % 251).float()
big = pattern + (env.rank + 1)
dist.all_reduce(big)
big_ok = torch.equal(big, n * pattern + n * (n + 1) / 2)
dist.barrier()
seconds["collectives"] = time.perf_counter() - start
checks = [None] * n
dist.all_gather_object(checks, {"small": small.item(), "big_ok": big_ok})
problems = [f"{who([r])}: all_reduce of rank + 1 gave {c['small']:g}, expected {n * (n + 1) // 2}"
            for r, c in enumerate(checks) if c["small"] != n * (n + 1) / 2]
problems += [f"{who([r])}: all_reduce of 16 MiB gave wrong values"
             for r, c in enumerate(checks) if not c["big_ok"]]
results["collectives"] = checks
print0(f"all_reduce(rank + 1) = {n * (n + 1) // 2} = {n}*{n + 1}/2 on every rank: "
       f"{all(c['small'] == n * (n + 1) / 2 for c in checks)}")
print0(f"all_reduce of 16 MiB exact on every rank: {all(c['big_ok'] for c in checks)}")
if problems:
    fail(problems, results)
print0("barrier: True")  # we are past it: a rank that never came would have timed out

if args.bandwidth:
    # nccl-tests' "bus bandwidth": a ring all-reduce moves 2(N-1)/N of the tensor in and out of
    # every rank, so busbw = 2(N-1)/N * bytes / time is comparable across N with the link speed
    x = torch.ones(args.bandwidth_mib * 2**18, device=env.device)  # 4-byte floats
    dist.all_reduce(x)  # warm-up: connections, buffers
    elapsed = torch.zeros(1, dtype=torch.float64, device=env.device)
    for _ in range(5):
        if env.device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        dist.all_reduce(x)
        if env.device.type == "cuda":
            torch.cuda.synchronize()
        elapsed += time.perf_counter() - t0
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank's time counts
    t = elapsed.item() / 5
    nbytes = x.numel() * x.element_size()
    busbw = 2 * (n - 1) / n * nbytes / t if n > 1 else float("nan")
    results["bandwidth"] = {"bytes": nbytes, "seconds": t, "busbw_bytes_per_s": busbw}
    print0(f"all_reduce of {args.bandwidth_mib} MiB: {t * 1e3:.1f} ms, bus bandwidth "
           f"{busbw / 1e9:.2f} GB/s ({env.backend}; noisy: repeat it; on the CPU it measures "
           f"memory copies, not a network)")

# --- every rank, in rank order ----------------------------------------------------------------
print_ranks(f"local rank {env.local_rank}, node {hosts.index(host)}, device {env.device}: OK")
write_json(args.json, {**results, "ok": True, "problems": []})
teardown()

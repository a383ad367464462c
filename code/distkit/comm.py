"""CollectiveLog: every collective a piece of code runs, in order, with its bytes and group.

torch's CommDebugMode counts collectives per module; this mode, built the same way (a
TorchDispatchMode that sees every c10d op), keeps their order, the tensor bytes and the ranks of
each collective's process group, which the chapters compare with the formulas (FSDP's
all-gathers and reduce-scatters, HSDP's all-reduce across replicas). Unlike CommDebugMode it
keeps no module tracker, which activation checkpointing's recomputation trips.
With `profile=True` it also runs torch's profiler, whose events name the FSDP unit and step
("FSDP::all_gather (model.layers.0)", "FSDP::post_backward_reduce (...)") each collective was
issued in, and when: the i-th c10d op the profiler saw is the i-th collective logged here.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

# Kineto (the profiler's engine) logs "USDT: <time> <pid> profiler_start/stop" lines at every
# start and stop, which differ on every run; level 6 keeps it quiet (read when it first starts).
os.environ.setdefault("KINETO_LOG_LEVEL", "6")


@dataclass
class Collective:
    op: str          # "all_gather", "reduce_scatter", "all_reduce", ...
    nbytes: int      # the larger side: all-gather's output, reduce-scatter's input
    dtype: str
    ranks: tuple     # the process group's global ranks
    backward: bool   # issued while autograd ran the backward
    t: float         # seconds since the log started (when it was issued)
    unit: str = ""   # with profile=True: the FSDP unit ("" for the root) ...
    fsdp_step: str = ""  # ... and FSDP's step it ran in ("all_gather", "post_backward_reduce")


NAMES = {"_allgather_base_": "all_gather", "allgather_into_tensor_coalesced_": "all_gather",
         "allgather_": "all_gather", "_reduce_scatter_base_": "reduce_scatter",
         "reduce_scatter_tensor_coalesced_": "reduce_scatter", "reduce_scatter_": "reduce_scatter",
         "allreduce_": "all_reduce", "allreduce_coalesced_": "all_reduce",
         "broadcast_": "broadcast",
         # functional collectives (DTensor's redistributions, e.g. a gradient norm's sum)
         "all_reduce": "all_reduce", "all_gather_into_tensor": "all_gather",
         "reduce_scatter_tensor": "reduce_scatter", "all_to_all_single": "all_to_all"}
# CommDebugMode's list of c10d ops (torch.distributed.tensor.debug._comm_mode.c10d_collective_ops),
# written out: importing that module imports torch._inductor, about 0.4 CPU-s in every rank
# (an op an older torch lacks is left out: the GPU machines' torch can lag)
c10d_collective_ops = {getattr(torch.ops.c10d, n) for n in (
    "_allgather_base_", "_reduce_scatter_base_", "allgather_", "allgather_coalesced_",
    "allgather_into_tensor_coalesced_", "allreduce_", "allreduce_coalesced_", "alltoall_",
    "alltoall_base_", "broadcast_", "gather_", "scatter_", "reduce_", "reduce_scatter_",
    "reduce_scatter_tensor_coalesced_") if hasattr(torch.ops.c10d, n)}
FUNCOL = {getattr(torch.ops._c10d_functional, n) for n in
          ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single")}


def _tensors(x):
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for y in x for t in _tensors(y)]
    return []


class CollectiveLog(TorchDispatchMode):
    """`with CollectiveLog() as log: ...` then `log.collectives`, a list of Collective; with
    profile=True also `log.ranges`: FSDP's recorded steps as (name, unit, start s, end s)."""

    def __init__(self, profile: bool = False):
        super().__init__()
        self.profile = profile

    def __enter__(self):
        self.collectives, self.ranges, self._t0 = [], [], time.perf_counter()
        if self.profile:
            self._prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            self._prof.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        super().__exit__(*exc)
        if not self.profile:
            return
        self._prof.__exit__(*exc)
        events = sorted(self._prof.events(), key=lambda e: e.time_range.start)
        t0 = min(e.time_range.start for e in events)
        # The outermost event of each collective: the op as called shows again inside this
        # mode's dispatch, and a functional collective wraps a c10d op.
        ops = []
        for e in events:
            if e.name.split("::")[0] in ("c10d", "_c10d_functional") and \
                    e.name.split("::")[-1] in NAMES and \
                    not (ops and e.time_range.end <= ops[-1].time_range.end):
                ops.append(e)
        for e in events:
            if e.name.startswith("FSDP::"):
                name, _, unit = e.name[6:].partition(" (")
                self.ranges.append((name, unit.rstrip(")"), (e.time_range.start - t0) / 1e6,
                                    (e.time_range.end - t0) / 1e6))
        assert len(ops) == len(self.collectives), (
            [e.name for e in ops], [c.op for c in self.collectives])
        for c, e in zip(self.collectives, ops):
            parent = e.cpu_parent
            while parent is not None and not parent.name.startswith("FSDP::"):
                parent = parent.cpu_parent
            if parent is not None:
                name, _, unit = parent.name[6:].partition(" (")
                c.fsdp_step, c.unit = name, unit.rstrip(")")
            c.t = (e.time_range.start - t0) / 1e6

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if DTensor in types:  # as CommDebugMode: let DTensor run first; its collectives come back
            return NotImplemented
        packet = getattr(func, "_overloadpacket", None)
        if packet in c10d_collective_ops or packet in FUNCOL:
            tensors = _tensors(args[:2])
            if packet in FUNCOL:  # (tensor, ..., group_name): the output is not an argument
                pg = dist.distributed_c10d._resolve_process_group(args[-1])
                tensors = tensors[:1]
            else:
                group = next(a for a in args if isinstance(a, torch.ScriptObject))
                pg = dist.ProcessGroup.unbox(group)
            name = packet._qualified_op_name.split("::")[-1]
            nbytes = max(t.nbytes for t in tensors)
            if packet is torch.ops._c10d_functional.all_gather_into_tensor:
                nbytes *= pg.size()  # its output
            self.collectives.append(Collective(
                NAMES.get(name, name), nbytes, str(tensors[0].dtype),
                tuple(dist.get_process_group_ranks(pg)),
                torch._C._current_graph_task_id() != -1,  # -1: not inside autograd's engine
                time.perf_counter() - self._t0))
        return func(*args, **(kwargs or {}))

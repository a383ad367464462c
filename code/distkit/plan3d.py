"""Composing parallelisms: which mesh dimension a collective crosses, what a launch costs, and a
planner for PP x FSDP x TP (x CP) layouts in torchtitan's terms. Chapter 10.

- `MeshLog`: distkit.comm.CollectiveLog plus the pipeline's point-to-point sends and receives
  (torch's c10d send/recv_ ops, which pipelining issues through batch_isend_irecv), each named
  by the mesh dimension its ranks share (`mesh_dim_of`).
- `startup`: seconds from this process's start to now (the import and set-up cost of a launch).
- `Layout`: the degrees of a composed layout, torchtitan's mesh order ("pp", "dp_replicate",
  "dp_shard", "cp", "tp") and its ParallelismConfig field names; `plan` adds memory per GPU
  and step time to chapter 08's model (distkit.memory, distkit.speed): the pipeline's bubble and
  in-flight micro-batches (distkit.schedules), context parallelism, float8 matmuls.
"""
from __future__ import annotations

import os
import time


def startup() -> float:
    """Seconds since this process started (its creation time, as the OS recorded it)."""
    import psutil
    return time.time() - psutil.Process(os.getpid()).create_time()


# --- which mesh dimension -----------------------------------------------------------------------

def mesh_dim_of(ranks, mesh) -> str:
    """The name of the mesh dimension whose process group (on this rank) is exactly `ranks`,
    or, for a pair of ranks (a send), the dimension along which the two differ; "other" if
    none: a group spanning two dimensions, or none at all."""
    import torch.distributed as dist
    ranks = tuple(sorted(ranks))
    groups = {d: tuple(sorted(dist.get_process_group_ranks(mesh.get_group(d))))
              for d in mesh.mesh_dim_names}
    for d, members in groups.items():
        if ranks == members or (len(ranks) == 2 and set(ranks) <= set(members)):
            return d
    return "other"


def _mesh_log_class():
    import torch
    import torch.distributed as dist

    from distkit.comm import Collective, CollectiveLog

    class MeshLog(CollectiveLog):
        """CollectiveLog that also records point-to-point sends and receives (op "send" or
        "recv", ranks = (this rank, the peer)): a pipeline's traffic between stages."""
        P2P = {torch.ops.c10d.send: "send", torch.ops.c10d.recv_: "recv"}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            packet = getattr(func, "_overloadpacket", None)
            if packet in self.P2P:  # (tensors, process group, peer's rank in the group, tag)
                tensors, group, peer = args[0], args[1], args[2]
                pg = dist.ProcessGroup.unbox(group)
                me, other = dist.get_rank(), dist.get_global_rank(pg, peer)
                self.collectives.append(Collective(
                    self.P2P[packet], sum(t.nbytes for t in tensors), str(tensors[0].dtype),
                    (me, other), torch._C._current_graph_task_id() != -1,
                    time.perf_counter() - self._t0))
                return func(*args, **(kwargs or {}))
            return super().__torch_dispatch__(func, types, args, kwargs)

    return MeshLog


def MeshLog(*args, **kwargs):
    """A MeshLog (see _mesh_log_class); built on first use, so that importing this module needs
    no torch."""
    return _mesh_log_class()(*args, **kwargs)


def by_mesh_dim(collectives, mesh) -> dict:
    """{(op, mesh dim): [count, bytes]} for a list of distkit.comm.Collective."""
    out = {}
    for c in collectives:
        key = (c.op, mesh_dim_of(c.ranks, mesh))
        row = out.setdefault(key, [0, 0])
        row[0] += 1
        row[1] += c.nbytes
    return out

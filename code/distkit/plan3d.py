"""Composing parallelisms: which mesh dimension a collective crosses, what a launch costs, and a
planner for PP x FSDP x TP (x CP) layouts in torchtitan's terms. Chapter 10.

- `MeshLog`: distkit.comm.CollectiveLog plus the pipeline's point-to-point sends and receives
  (torch's c10d send/recv_ ops, which pipelining issues through batch_isend_irecv), each named
  by the mesh dimension its ranks share (`mesh_dim_of`).
- `startup`: seconds from this process's start to now (the import and set-up cost of a launch).
- `Composed`: the degrees of a composed layout, torchtitan's mesh order ("pp", "dp_replicate",
  "dp_shard", "cp", "tp") and its ParallelismConfig field names; `step_time` and `memory` add
  step time and memory per GPU to chapter 08's model (distkit.memory, distkit.speed): the
  pipeline's bubble and in-flight micro-batches (distkit.schedules), context parallelism (memory
  only), float8 matmuls at twice the rate (an upper bound, mostly because chapter 08's
  efficiency is fitted on whole steps: the "matmul" time it gives carries attention kernels,
  launch gaps and unhidden work that float8 does not speed up; the casts are not modelled
  either).
"""
from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass


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


# --- a composed layout, in torchtitan's terms -----------------------------------------------------

MESH_ORDER = ("pp", "dp_replicate", "dp_shard", "cp", "tp")  # outermost first, as torchtitan
# What a reader types in torchtitan for each degree: today's ParallelismConfig field
# (torchtitan b5bcd76, torchtitan/config/configs.py) and the TOML key of December 2024
# (9dec370, torchtitan/config_manager.py and train_configs/*.toml), which the published runs used.
CONFIG_NAMES = {
    "pp": ("pipeline_parallel_degree", "experimental.pipeline_parallel_degree"),
    "dp_replicate": ("data_parallel_replicate_degree", "training.data_parallel_replicate_degree"),
    "dp_shard": ("data_parallel_shard_degree", "training.data_parallel_shard_degree"),
    "cp": ("context_parallel_degree", "experimental.context_parallel_degree"),
    "tp": ("tensor_parallel_degree", "training.tensor_parallel_degree"),
    "schedule": ("pipeline_parallel_schedule", "experimental.pipeline_parallel_schedule"),
    "microbatches": ("num_pp_microbatches", "experimental.pipeline_parallel_microbatches"),
}


@dataclass(frozen=True)
class Composed:
    """The degrees of a composed layout (their product is the GPU count), the pipeline schedule
    and its micro-batches per step, and whether the decoder layers' matmuls run in float8."""
    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    schedule: str = "1F1B"
    microbatches: int = 1
    float8: bool = False

    def __post_init__(self):
        from distkit.schedules import SCHEDULES
        if min(self.shape.values()) < 1 or self.microbatches < 1:
            raise ValueError(f"every degree and the micro-batches must be >= 1: {self}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule {self.schedule!r}: one of {', '.join(SCHEDULES)}")
        if self.pp > 1 and self.microbatches < self.pp:
            raise ValueError(f"{self.microbatches} micro-batches for {self.pp} pipeline stages: "
                             "every schedule here needs at least as many micro-batches")

    @property
    def shape(self) -> dict:
        return {d: getattr(self, d) for d in MESH_ORDER}

    @property
    def gpus(self) -> int:
        return math.prod(self.shape.values())

    def coords(self, rank: int) -> dict:
        """A global rank's coordinate on each dimension (row-major, as init_device_mesh lays a
        mesh out: the last dimension, tp, varies fastest)."""
        out = {}
        for d in reversed(MESH_ORDER):
            rank, out[d] = divmod(rank, self.shape[d])
        return {d: out[d] for d in MESH_ORDER}

    def group(self, rank: int, dim: str) -> tuple:
        """The ranks that share every coordinate with `rank` but `dim`'s: its group on `dim`."""
        me = self.coords(rank)
        return tuple(r for r in range(self.gpus)
                     if all(self.coords(r)[d] == me[d] for d in MESH_ORDER if d != dim))

    @property
    def stages_per_rank(self) -> int:
        from distkit.schedules import SINGLE
        return 1 if self.schedule in SINGLE else 2

    def torchtitan(self, toml: bool = False) -> dict:
        """{torchtitan's name: value} for this layout: ParallelismConfig's fields, or (toml) the
        keys of December 2024's TOML files. Degrees of 1 and an unused schedule are left out."""
        out = {CONFIG_NAMES[d][toml]: v for d, v in self.shape.items() if v > 1}
        if self.pp > 1:
            out[CONFIG_NAMES["schedule"][toml]] = self.schedule
            out[CONFIG_NAMES["microbatches"][toml]] = self.microbatches
        if self.float8:  # how the December 2024 runs and today's recipes turn float8 on
            out["float8.enable_float8_linear" if toml else "converters"] = (
                True if toml else ['Float8LinearConverter.Config(filter_fqns=["lm_head"])'])
        return out

    def bubble(self):
        """The idle fraction of rank 0 in the schedule's action lists played on the ideal
        machine (distkit.schedules, F 1, B 2), as a Fraction; 0 without a pipeline."""
        from fractions import Fraction
        if self.pp == 1:
            return Fraction(0)
        idle_units, step = _schedule(self)[0]
        return Fraction(idle_units, step)

    def in_flight(self) -> float:
        """Rank 0's peak of micro-batches whose activations it holds, in units of one
        micro-batch through L / pp layers (1F1B: min(pp, m); interleaved: its chunks / v)."""
        from distkit.schedules import in_flight
        if self.pp == 1:
            return 1.0
        return in_flight(_lists(self))[0] / self.stages_per_rank


def _lists(c: Composed) -> list:
    from distkit.schedules import actions, one_f_one_b
    if c.schedule == "1F1B":  # as torch runs it (its published list is off by one: chapter 10)
        return one_f_one_b(c.pp, c.microbatches)
    return actions(c.schedule, c.pp, c.microbatches,
                   None if c.stages_per_rank == 1 else c.stages_per_rank)


def _schedule(c: Composed) -> list:
    from distkit.schedules import idle, simulate
    return idle(simulate(_lists(c)))


def float8_linears(config, recipe: str | None = None) -> dict:
    """A decoder layer's seven linear layers, name -> (out_features, in_features), that run in
    float8: all of them (recipe None: what torchtitan's December 2024 runs converted, the LM
    head excepted), or those torchao's automatic filter keeps for `recipe` (distkit.fp8.
    worth_float8: small matmuls stay bf16)."""
    from types import SimpleNamespace

    from distkit.fp8 import worth_float8
    from distkit.memory import head_dim
    h, i, d = config["hidden_size"], config["intermediate_size"], head_dim(
        SimpleNamespace(**config))
    q, kv = config["num_attention_heads"] * d, config["num_key_value_heads"] * d
    shapes = {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q),
              "gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i)}
    return {n: sh for n, sh in shapes.items() if recipe is None or worth_float8(*sh, recipe)}


def float8_flops(config, seq: int, batch: int, ac: str = "none",
                 recipe: str | None = None) -> float:
    """Hardware FLOPs of one micro-batch that run in float8: the decoder layers' linear
    layers, forward and backward (6 per weight and token), and their rerun under full
    checkpointing (2 per weight and token, the MLP's down projection excepted, as
    distkit.speed.hardware_flops counts it). The LM head stays bf16 (torchtitan's filter_fqns).
    `recipe` ("tensorwise", "rowwise"): only the layers torchao's automatic filter converts
    (`float8_linears`); None: all seven."""
    c, T = config, seq * batch
    layers = {n: o * i for n, (o, i) in float8_linears(c, recipe).items()}
    linear = c["num_hidden_layers"] * sum(layers.values())
    rerun = 2 * c["num_hidden_layers"] * (linear // c["num_hidden_layers"]
                                          - layers.get("down_proj", 0)) * T \
        if ac == "full" else 0
    return 6 * linear * T + rerun


def speed_layout(config, c: Composed, *, seq: int, local_batch: int, ac: str,
                 sequence_parallel: bool = True):
    """chapter 08's distkit.speed.Layout for `c`: `local_batch` sequences per data-parallel
    rank and step, in `c.microbatches` micro-batches when pipelined. Context parallelism is not
    in chapter 08's time model: cp must be 1 here (`memory` handles it)."""
    from distkit.speed import Layout
    if c.cp != 1:
        raise ValueError("the time model has no context parallelism (cp must be 1)")
    m = c.microbatches if c.pp > 1 else 1
    if local_batch % m:
        raise ValueError(f"local batch {local_batch} does not split into {m} micro-batches")
    return Layout(gpus=c.gpus, seq=seq, batch=local_batch // m, accumulation=m, tp=c.tp,
                  pp=c.pp, replicate=c.dp_replicate, ac=ac,
                  sequence_parallel=sequence_parallel and c.tp > 1)


def step_time(config, c: Composed, *, seq: int, local_batch: int, ac: str, gpu, link: float,
              eta, extra_flops: float = 0.0, sequence_parallel: bool = True) -> dict:
    """Chapter 08's step time (distkit.speed.step_time) for a composed layout, with two
    additions:
    - float8: the float8 matmuls run at twice the bf16 rate (the dense fp8 peak of an H100 is
      2x its bf16 peak): half of `float8_flops` comes off the compute. An upper bound: the
      efficiency `eta` is fitted on whole steps (chapter 08), so the linear layers' time at
      eta x peak also holds what the model does not list (attention kernels below GEMM speed,
      launch gaps, unhidden communication), and float8 halves it all; the casts' own cost
      (memory-bound amax, scale and cast kernels, fused by torch.compile) and float8
      all-gathers are not modelled either;
    - the pipeline bubble of `c.schedule`, from its action lists (`Composed.bubble`), instead of
      chapter 08's 1F1B: rank 0's idle slots in units of a micro-batch's work on a rank.
    `extra_flops`: per micro-batch, as in distkit.speed.step_time (torchtitan's "op" recompute)."""
    from distkit.speed import step_time as chapter08
    lay = speed_layout(config, c, seq=seq, local_batch=local_batch, ac=ac,
                       sequence_parallel=sequence_parallel)
    extra = extra_flops - (float8_flops(config, seq, lay.batch, ac) / 2 if c.float8 else 0)
    if c.float8:
        extra -= extra_flops / 2  # torchtitan's "op" rerun is linear matmuls: float8 too
    t = chapter08(config, lay, gpu=gpu, link=link, eta=eta, extra_flops=extra)
    out = dict(t)
    if c.pp > 1:
        idle_units, step_units = _schedule(c)[0]
        busy_per_microbatch = (step_units - idle_units) / c.microbatches  # units of F=1, B=2
        bubble = idle_units / busy_per_microbatch * t["micro-step s"]
        out["step s"] = t["step s"] - t["pp bubble s"] + bubble
        out["pp bubble s"] = bubble
        out["tokens/s/GPU"] = t["tokens/s/GPU"] * t["step s"] / out["step s"]
    return out


def memory(config, c: Composed, *, seq: int, local_batch: int, ac: str,
           sequence_parallel: bool = True) -> dict:
    """Bytes one GPU allocates at its peak (distkit.speed.peak_bytes, chapter 08): FSDP2 over
    dp_shard x cp ranks (torchtitan shards over the flattened "dp_shard_cp"), the decoder
    layers split by tp and pp, each GPU holding seq / cp tokens of each sequence, rank 0's
    in-flight micro-batches from the schedule's action lists; plus, under a pipeline, the
    stage's layers kept gathered between micro-batches (torchtitan sets
    reshard_after_forward=False when pp > 1, "to avoid per-microbatch all-gathers":
    parallelize_llama.py, apply_fsdp, 9dec370), in bf16. Context parallelism's key/value
    exchange buffers are not counted."""
    from distkit.memory import llama_parts
    from distkit.speed import peak_bytes
    m = c.microbatches if c.pp > 1 else 1
    if local_batch % m or seq % c.cp:
        raise ValueError("the local batch must split into the micro-batches, the sequence by cp")
    sp = sequence_parallel and c.tp > 1
    shard = c.dp_shard * c.cp
    peak = peak_bytes(config, gpus=shard * c.tp * c.pp, seq=seq // c.cp, batch=local_batch // m,
                      tp=c.tp, ac=ac, pp=c.pp, sequence_parallel=sp, in_flight=c.in_flight())
    layers = config["num_hidden_layers"] // c.pp
    gathered = max(0, layers - 2) * llama_parts(config)["layer"] / c.tp * 2 if c.pp > 1 else 0
    return {"peak": peak + gathered, "gathered stage": gathered, "in flight": c.in_flight()}

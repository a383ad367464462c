"""distkit: the course's plumbing, written once so the lesson scripts show only the lesson.

- `setup()` / `teardown()`: pick device and backend, start the process group with a short timeout.
- `pick_device()`: CUDA + NCCL when there is a GPU, else CPU + gloo (override: COURSE_DEVICE).
- `seed_everything()`: one seed for Python, NumPy and torch.
- `print0()` / `print_ranks()`: print from rank 0, or every rank's text in rank order.
- `write_json()`: rank 0 writes measured results for notebooks and tests to read.
- `todo()`: where an exercise starter stops, saying what the learner's code must do.
- `int_list()`: an argparse type for comma-separated integers ("1,2,4,8").
- `same_on_all_ranks()`: whether every rank holds exactly the same tensor values (a check).

Submodules that lesson scripts import, where needed (the lesson layer: small, read by learners):
- `distkit.toy`: a tiny transformers Llama, generated token data (nothing downloaded), an LR
  schedule.
- `distkit.ddp`: `CommLog`, a DDP comm hook that records every bucket's all-reduce.
- `distkit.comm`: `CollectiveLog`, every collective of a piece of code in order, with its bytes,
  group and (with the profiler) the FSDP unit that issued it.
- `distkit.pipe`: chapter 02's pipeline plumbing: a Llama cut into stages, its loss, a stopwatch.
- `distkit.tp`: chapter 02's tensor-parallel plans (Megatron), reused by chapter 04's FSDP + TP.
- `distkit.ckpt`: chapter 05's checkpoints: `AppState` and `RNGState` (DCP `Stateful`s), and
  `CheckpointDir` (atomic commits with a manifest of checksums, the newest good one, keep-last-K).
- `distkit.memory`: chapter 03's formulas and calculator (bytes per rank by category).
- `distkit.speed`: chapter 08's speed model (step time from FLOPs and bytes) and the one table
  of GPU datasheet figures.
- `distkit.plan`: chapter 08's planner (a `Layout`'s memory budget, time, days, cost and
  goodput; the efficiency fitted on the public runs in code/ch08_plan/public_runs.json).
- `distkit.cp`: chapter 09's context parallelism by hand: ring attention (its backward too) and
  Ulysses, the online softmax, the contiguous and head-tail layouts, their bytes and causal work.
- `distkit.moe`: chapter 09's mixture of experts by hand: routing, grouped-GEMM experts,
  `ExpertParallel` (counts, dispatch, combine), capacity and the load-balancing loss.
- `distkit.cpep`: chapter 09's planner for context and expert parallelism (memory per GPU, bytes
  per step; MoE parameter counts of published configurations).
- `distkit.fp8`: chapter 10's float8: scales, saturated casts, scaled matmuls (emulated and by
  `torch._scaled_mm`), an emulated `Float8Linear`, float8 all-gather bytes.
- `distkit.schedules`: chapter 10's pipeline schedules as data: torch's action lists, their
  timeline on an ideal machine, bubbles, in-flight micro-batches, a recording stage.
- `distkit.plan3d`: chapter 10's composed layouts: collectives by mesh dimension (`MeshLog`),
  torchtitan's degrees and names (`Composed`), chapter 08's planner with schedules and float8.
- `distkit.tokens`: the capstone's loss under sharding: a sum over valid tokens divided by the
  whole step's valid-token count (every rank, micro-batch and context shard), gradients summed.

The course's own tooling lives in `distkit.course` (notebook launcher, plots, `make` targets,
website, exercise checkers, diagrams); lesson scripts never import it.
"""
import importlib

__all__ = ["DistEnv", "int_list", "pick_device", "print0", "print_ranks", "same_on_all_ranks",
           "seed_everything", "setup", "teardown", "todo", "write_json"]


def __getattr__(name: str):
    """`from distkit import setup` loads distkit.dist (and torch) on first use only: the
    notebooks' kernels, `make course` and `make check` import distkit's other modules without
    paying for torch (PEP 562)."""
    if name in __all__:
        return getattr(importlib.import_module(".dist", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

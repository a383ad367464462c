"""`make gpu-smoke`: every chapter's scripts on this machine's CUDA GPUs, at tiny sizes.

    make gpu-smoke                       # or: PYTHONPATH=code python -m distkit.course.gpu_smoke
    make gpu-smoke FIT=1                 # a 1-GPU machine: the 2-GPU runs on one where they can
    PYTHONPATH=code python -m distkit.course.gpu_smoke --only ch04,ch06 --timeout 300

The course runs (and is tested) on CPU with gloo; on GPUs the same scripts take NCCL, CUDA
devices, bf16, CPU offload, NCCL's flight recorder. Those paths cannot run on a laptop, so this
runs each of them once, the way a learner launches them (code/run_w_torchrun.sh with
COURSE_DEVICE=cuda), and prints one line per run: PASS, FAIL with the reason (the run's last
error line, or the check that failed), or SKIP when the machine has too few GPUs (the 2-D meshes
need 4). Exit status 1 when any run failed. With --fit (make gpu-smoke FIT=1), a machine with
fewer GPUs runs each script that works on fewer ranks on the GPUs it has (one GPU: NCCL, CUDA
placement, bf16, offload, compile and the checkpoints are exercised, cross-GPU traffic is not);
its line says so. On a machine without CUDA it says "no CUDA GPU:
skipped" and exits 0, so CI and laptops can call it.

It is how a workshop checks a cluster node before the session, and how the course's GPU claims
stay honest: docs/gpu_run_record.md says when it last ran, and on what. Each run writes into
build/gpu-smoke/<name>/ ({out} in the table below), its console output into output.log there.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

CODE = Path(__file__).resolve().parents[2]
ROOT = CODE.parent
TINY_LLAMA = ["--seq-len", "64", "--vocab-size", "512", "--batch-size", "8", "--micro-batch", "2",
              "--max-steps", "4", "--warmup", "1", "--eval-every", "4", "--eval-sequences", "8",
              "--no-progress", "--data-dir", "{out}/data", "--out", "{out}/run"]


@dataclass(frozen=True)
class Run:
    name: str            # chNN what: the line's name, and its folder under build/gpu-smoke/
    gpus: int            # processes, one per GPU (0: every GPU there is; plain python: 1)
    script: str          # relative to code/
    args: tuple = ()     # "{out}" becomes this run's folder
    status: int = 0      # the exit status that means PASS (a failure demo fails on purpose)
    expect: str = ""     # a file (relative to {out}) or stdout text that must be there
    torchrun: bool = True  # False: one plain Python process (the script takes no process group)
    fit: bool = True     # --fit may run it on fewer GPUs (False: it needs that many ranks)


# One registry: what each chapter's GPU path is, at the smallest size that still runs it.
RUNS = [
    Run("ch00 hello", 0, "ch00_collectives/hello_torchrun.py"),
    # the chapter's first script: NCCL and set_device(LOCAL_RANK) by itself, without distkit
    Run("ch00 first script", 0, "ch00_collectives/hello.py", expect="all_reduce gave"),
    Run("ch00 collectives", 2, "ch00_collectives/collectives.py", ("--json", "{out}/c.json"),
        expect="c.json", fit=False),  # a collective needs someone to talk to
    Run("ch00 allreduce bandwidth", 0, "ch00_collectives/allreduce_bench.py",
        ("--max-mb", "16", "--iters", "3", "--warmup", "1", "--inner", "2")),
    Run("ch00 async collectives", 0, "ch00_collectives/async_collectives.py"),
    Run("ch00 ring all-reduce", 0, "ch00_collectives/ring_allreduce.py"),
    Run("ch01 DDP", 2, "ch01_ddp/train_ddp.py", ("--epochs", "1", "--samples", "64")),
    # the parity reference runs on the GPU too (one plain process), like the DDP runs
    Run("ch01 single-process reference", 1, "ch01_ddp/train_single.py",
        ("--epochs", "1", "--samples", "64"), torchrun=False),
    Run("ch01 DDP accumulation", 2, "ch01_ddp/train_ddp_plus.py",
        ("--epochs", "1", "--samples", "64", "--accum", "2", "--log-comm",
         "--save", "{out}/epoch{epoch}.pt"), expect="epoch1.pt"),
    # every rank loads that checkpoint (map_location="cpu", then onto its own GPU) and goes on
    Run("ch01 DDP resume", 2, "ch01_ddp/train_ddp_plus.py",
        ("--epochs", "2", "--samples", "64", "--accum", "2",
         "--resume", "{out}/../ch01_DDP_accumulation/epoch1.pt")),
    Run("ch01 DDP buckets", 2, "ch01_ddp/ddp_buckets.py", ("--steps", "2")),
    Run("ch01 DDP memory", 2, "ch01_ddp/ddp_memory.py"),
    # its default cases include SyncBatchNorm (on GPU it really runs) and Join's uneven inputs
    Run("ch01 pitfalls", 2, "ch01_ddp/ddp_pitfalls.py"),
    Run("ch02 naive split", 2, "ch02_model_parallel/naive_split.py", ("--epochs", "1")),
    Run("ch02 pipeline", 2, "ch02_model_parallel/pipeline.py", ("--epochs", "1"), fit=False),
    Run("ch02 pipeline bubbles", 2, "ch02_model_parallel/pipeline_bench.py", ("--repeats", "1"),
        fit=False),
    Run("ch02 tensor parallel", 2, "ch02_model_parallel/tensor_parallel.py", fit=False),
    Run("ch03 ZeRO memory", 2, "ch03_zero/zero_memory.py", ("--steps", "2")),
    Run("ch04 FSDP2", 2, "ch04_fsdp2/train_fsdp2.py", ("--epochs", "1", "--samples", "64")),
    Run("ch04 FSDP1", 2, "ch04_fsdp2/fsdp1.py", ("--steps", "2"), fit=False),
    Run("ch04 inside FSDP2", 2, "ch04_fsdp2/inside_fsdp2.py", ("--steps", "2")),
    Run("ch04 meta init", 2, "ch04_fsdp2/meta_init.py", ("--steps", "2")),
    Run("ch04 LoRA", 2, "ch04_fsdp2/lora_fsdp2.py", ("--steps", "2")),
    Run("ch04 2-D mesh (FSDP x TP)", 4, "ch04_fsdp2/fsdp2_2d.py", ("--steps", "2"), fit=False),
    Run("ch05 checkpoint + resume", 2, "ch05_checkpoint/train_ckpt.py",
        ("--epochs", "1", "--samples", "64", "--ckpt-dir", "{out}/ckpt", "--save-every", "2")),
    # async saves: a gloo group beside NCCL, the pinned-memory stager (CUDA only)
    Run("ch05 async checkpoints", 2, "ch05_checkpoint/train_ckpt.py",
        ("--epochs", "1", "--samples", "64", "--ckpt-dir", "{out}/ckpt", "--save-every", "2",
         "--async")),
    Run("ch05 DCP tour (async save)", 2, "ch05_checkpoint/dcp_tour.py",
        ("--out", "{out}/dcp", "--repeats", "1")),
    # the capstone: bf16, CPU offload (GPU only), selective AC, asynchronous saves, the export
    Run("ch06 Llama bf16 + offload", 2, "ch06_capstone/train_llama.py",
        (*TINY_LLAMA, "--precision", "bf16", "--cpu-offload", "--ac", "selective",
         "--save-every", "2", "--async-save"), expect="run/hf/config.json"),
    # per-layer torch.compile with inductor (Triton kernels) on one GPU, then with HSDP (2
    # replicas x 2 shards)
    Run("ch06 Llama compile", 1, "ch06_capstone/train_llama.py", (*TINY_LLAMA, "--compile"),
        expect="run/hf/config.json"),
    Run("ch06 Llama HSDP + compile", 4, "ch06_capstone/train_llama.py",
        (*TINY_LLAMA, "--replicate", "2", "--compile"), expect="run/hf/config.json", fit=False),
    # a CUDA trace per rank (NCCL's kernels on their own stream, beside the matmuls: chapter 06)
    Run("ch06 Llama profile", 2, "ch06_capstone/train_llama.py",
        (*TINY_LLAMA, "--profile-step", "3"), expect="run/profile/rank0.pt.trace.json"),
    Run("ch07 flight recorder dump", 2, "ch07_debugging/buggy_train.py",
        ("--bug", "crash", "--timeout", "30", "--fr-dir", "{out}/fr"), status=1,
        expect="fr/rank_1", fit=False),  # rank 1 fails at step 3 and dumps
    Run("ch07 smoke test", 0, "ch07_debugging/smoke_test.py", ("--json", "{out}/smoke.json"),
        expect="smoke.json"),
    Run("ch07 comm hooks", 2, "ch07_debugging/comm_hooks.py", ("--steps", "4"), fit=False),
    Run("ch07 CUDA OOM", 1, "ch07_debugging/oom.py", ("--json", "{out}/oom.json"),
        expect="oom.json", torchrun=False),
    # chapter 08's prediction against one real FSDP2 step of Llama 3.2 1B (one GPU)
    Run("ch08 one real step vs the plan", 1, "ch08_plan/gpu_step.py",
        ("--seq", "2048", "--batch", "2", "--ac", "full", "--steps", "3", "--json",
         "{out}/step.json"), expect="step.json", torchrun=False),
    Run("ch08 fused AdamW step", 1, "ch08_plan/gpu_step.py",
        ("--seq", "2048", "--batch", "2", "--ac", "none", "--steps", "3", "--fused-adamw",
         "--json", "{out}/fused.json"), expect="fused.json", torchrun=False),
    # chapter 09: torch's context_parallel() itself (CUDA flash attention, bf16; on one GPU
    # the dispatch to the ring kernels runs, the exchange does not); the hand-written ring,
    # Ulysses, FSDP2 x CP and expert parallelism over NCCL; transformers' EP
    Run("ch09 context_parallel()", 2, "ch09_long_context_moe/torch_cp.py",
        ("--seq", "256", "--head-dim", "64"), expect="every check passed: True"),
    Run("ch09 ring attention", 2, "ch09_long_context_moe/ring_attention.py",
        expect="every check passed: True"),
    Run("ch09 Ulysses", 2, "ch09_long_context_moe/ulysses.py", expect="every check passed: True",
        fit=False),
    Run("ch09 FSDP2 x CP", 4, "ch09_long_context_moe/fsdp_cp.py", ("--steps", "2"),
        expect="every check passed: True", fit=False),
    Run("ch09 expert parallelism by hand", 2, "ch09_long_context_moe/moe_ep.py",
        expect="every check passed: True"),
    Run("ch09 transformers EP", 2, "ch09_long_context_moe/hf_ep.py",
        expect="every check passed: True", fit=False),
    # chapter 10: float8 training with torch._scaled_mm on the fp8 tensor cores (compute
    # capability 8.9+; older GPUs fall back to the emulation and say so), and an 8192^3 matmul
    # timed in bf16 and in float8; every schedule on 2 GPUs; the 3-D mesh on 8
    Run("ch10 float8 training + fp8 matmul speed", 1, "ch10_float8_3d/float8_train.py",
        ("--kernel", "torch", "--steps", "10", "--bench", "8192", "--json", "{out}/f8.json"),
        expect="f8.json", torchrun=False),
    Run("ch10 pipeline schedules", 2, "ch10_float8_3d/schedules.py", ("--json", "{out}/s.json"),
        expect="s.json", fit=False),  # a pipeline needs 2 ranks
    Run("ch10 3-D mesh (PP x FSDP x TP)", 8, "ch10_float8_3d/mesh3d.py",
        ("--json", "{out}/m.json"), expect="m.json", fit=False),
]


def command(run: Run, nproc: int, out: Path) -> list[str]:
    args = [a.replace("{out}", str(out)) for a in run.args]
    if run.torchrun:
        return [str(CODE / "run_w_torchrun.sh"), str(nproc), run.script, *args]
    return [sys.executable, str(CODE / run.script), *args]


def reason(proc: subprocess.CompletedProcess) -> str:
    """The launcher's line (which rank failed first, and its error), else the last line that
    looks like an error, else the last line of output. A script's output can say "failed" on
    purpose (ddp_pitfalls.py shows errors it catches): the launcher's line comes first."""
    lines = [ln.strip() for ln in (proc.stderr + proc.stdout).splitlines() if ln.strip()]
    first = [ln for ln in lines if ln.startswith("run_w_torchrun.sh:") and "failed first" in ln]
    errors = [ln for ln in lines if "rror" in ln or "failed" in ln or "FAIL" in ln]
    return (first or errors or lines or ["no output"])[-1][:300]


def smoke(run: Run, gpus: int, timeout: float, fit: bool = False) -> tuple[str, str]:
    need = run.gpus or 1
    if gpus < need and not (fit and run.fit):
        return "SKIP", f"needs {need} GPUs, this machine has {gpus}"
    nproc = min(run.gpus or gpus, gpus)
    out = ROOT / "build" / "gpu-smoke" / run.name.replace(" ", "_").replace("/", "-")
    out.mkdir(parents=True, exist_ok=True)
    path = os.pathsep.join(filter(None, [str(CODE), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "COURSE_DEVICE": "cuda", "PYTHON": sys.executable,
           "PYTHONPATH": path, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    t0 = time.time()
    try:
        proc = subprocess.run(command(run, nproc, out), cwd=ROOT, env=env, text=True,
                              capture_output=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return "FAIL", f"still running after {timeout:.0f} s"
    (out / "output.log").write_text(proc.stdout + proc.stderr)  # to read a FAIL afterwards
    fitted = f" of {need} (--fit)" if nproc < need else ""
    took = f"{nproc} GPU(s){fitted}, {time.time() - t0:.0f} s"
    if proc.returncode != run.status:
        return "FAIL", f"exit status {proc.returncode} ({took}): {reason(proc)}"
    if run.expect and not ((out / run.expect).exists() or run.expect in proc.stdout):
        return "FAIL", f"no {run.expect} ({took})"
    return "PASS", took


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", help="comma-separated prefixes of the names, e.g. ch04,ch06")
    p.add_argument("--timeout", type=float, default=600, help="seconds per run (default 600)")
    p.add_argument("--fit", action="store_true",
                   help="on fewer GPUs than a run wants, run it on those there are when the "
                        "script allows (one GPU: no cross-GPU traffic, the rest is exercised)")
    args = p.parse_args(argv)
    import torch  # after --help
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus == 0:
        print("gpu-smoke: no CUDA GPU: skipped")
        return 0
    name = torch.cuda.get_device_name()
    print(f"gpu-smoke: {gpus} x {name}, torch {torch.__version__}, CUDA {torch.version.cuda}, "
          f"NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}")
    runs = [r for r in RUNS if not args.only
            or any(r.name.startswith(s.strip()) for s in args.only.split(","))]
    results = []
    for run in runs:
        verdict, why = smoke(run, gpus, args.timeout, args.fit)
        results.append(verdict)
        print(f"{verdict:4s}  {run.name:32s} {why}", flush=True)
    print(f"gpu-smoke: {results.count('PASS')} passed, {results.count('FAIL')} failed, "
          f"{results.count('SKIP')} skipped")
    return 1 if "FAIL" in results else 0


if __name__ == "__main__":
    sys.exit(main())

"""`make course`: execute every notebook with papermill, headless, into build/.

Two notebooks at a time where Linux lets a process choose its cores (--jobs, default 2), each on
its half of them: on the 2-core machine of the time budget the course then takes about two
thirds of the time one after the other takes (docs/timings.md), and a notebook that sees one
core says its timing checks are not checked (`make test` checks them, one notebook at a time).
--jobs 1: one at a time, in order, each with every core.

Shows progress on stderr (notebook, code cell n of m, seconds so far), then prints a table
(notebook, pass/fail, wall seconds, CPU seconds) and exits non-zero if any notebook failed; the
executed copy of a failing notebook stays in build/ for inspection. CPU seconds are user + system
time of the notebook's kernel and everything it started (torchrun, every rank), counted once
they have exited: they vary less than wall seconds with other load on the machine.
build/course_times.json keeps both per notebook (the next run's estimate), and
build/launches/<notebook>.jsonl each launch's script, ranks, wall and CPU seconds (the launch-cost
table: python -m distkit.course.launch_cost). Each kernel's own
messages (startup warnings,
"KeyboardInterrupt caught in kernel" at shutdown, which is normal) go to
build/<notebook>.kernel.log instead of the console.
"""
from __future__ import annotations

import argparse
import json
import logging
import multiprocessing
import os
import resource
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import nbformat
import papermill
from jupyter_client.manager import AsyncKernelManager

ROOT = Path(__file__).resolve().parents[3]
# Seconds per notebook on a 2-core laptop, until a run here has measured them: 66 on average on an
# idle one (2026-11-26), and machines of that kind differ about 2x.
GUESS_S = 100

# `make course FAST=1` (--fast): smaller papermill parameters for a live session, per notebook.
# Each notebook's time is mostly its launches (every rank imports torch and transformers), so
# these cut the work inside them: fewer steps, sizes and repeats, never a check the notebook
# makes. Each set passes its notebook's parameter check (tests/test_fast.py). 06 keeps its
# defaults: its held-out loss must beat the unigram baseline by 0.1 nats, which the stored run
# reaches only after step 40 (6.302 at step 40, 6.209 at 60; the baseline 6.355); a 40-step
# schedule (warm-up 10) reached 6.328, too little (measured 2026-11-26, Python 3.11's docs).
FAST = {
    "00_torchrun_and_collectives.ipynb": {"NPROC_BIG": 3, "RING_NUMEL": 100_001,
                                          "BENCH_MAX_MB": 1, "BENCH_ITERS": 5,
                                          "ASYNC_NUMEL": 2**18},
    "01_data_parallel_ddp.ipynb": {"BATCH": 32, "ACCUM": 2},
    "02_model_parallelism.ipynb": {"MICROBATCHES": [1, 2, 4], "BENCH_LAYERS": 4,
                                   "BENCH_HIDDEN": 128, "REPEATS": 1, "UNBALANCED": [3, 1]},
    "03_zero_memory_math.ipynb": {"LAYERS": 2, "SIM_POINTS": "8b:8"},
    "04_fsdp2.ipynb": {"EPOCHS": 1},
    "05_distributed_checkpoint.ipynb": {"EPOCHS": 1, "SAVE_EVERY": 3, "CRASH_STEP": 7},
    "06_capstone_llama_fsdp2.ipynb": {},
    "07_when_things_go_wrong.ipynb": {"TIMEOUT": 2, "LIMIT": 60},
    "08_plan_a_run.ipynb": {},  # already about 20 s: its grid is stored, one point simulated live
    # 09: shorter sequences (32 tokens, 16 per MoE sequence) and one simulated decoder layer
    "09_context_and_expert_parallelism.ipynb": {"SIZE": "tiny"},
    # 10: its one 8-process launch is most of its time and has no size to cut; fewer float8 steps
    "10_float8_schedules_3d.ipynb": {"PRESET": "fast"},
}


class Progress:
    """One line per code cell on stderr (CI logs); on a terminal, one line rewritten in place."""

    def __init__(self, stream=sys.stderr, tty: bool = True):
        self.stream, self.tty = stream, tty and stream.isatty()

    def start(self, label: str, cells: int) -> None:
        self.label, self.cells, self.n, self.t0 = label, cells, 0, time.perf_counter()

    def cell(self, **_) -> None:  # nbclient's on_cell_execute hook: a code cell starts
        self.n += 1
        self.show(f"cell {self.n}/{self.cells}, {time.perf_counter() - self.t0:.0f} s")

    def show(self, text: str, last: bool = False) -> None:
        line = f"{self.label}  {text}"
        self.stream.write(f"\r\033[K{line}{chr(10) if last else ''}" if self.tty else line + "\n")
        self.stream.flush()


def kernel_logging_to(path: Path) -> type[AsyncKernelManager]:
    """A kernel manager whose kernel writes its stdout/stderr to `path`, not to our console."""
    class QuietKernelManager(AsyncKernelManager):
        async def start_kernel(self, **kw):
            self.console_log = open(path, "w")  # the kernel process writes to it; closed at exit
            return await super().start_kernel(stdout=self.console_log, stderr=self.console_log,
                                              **kw)
    return QuietKernelManager


def code_cells(nb_path: Path, params: dict) -> int:
    """How many code cells papermill will run (it adds one cell when given parameters)."""
    cells = nbformat.read(nb_path, as_version=4).cells
    injected = any("injected-parameters" in c.metadata.get("tags", []) for c in cells)
    return sum(c.cell_type == "code" and bool(c.source.strip()) for c in cells) + \
        int(bool(params) and not injected)


def children_cpu() -> float:
    """User + system CPU seconds of this process's finished children and their descendants.

    The kernel is our child; torchrun and its ranks are its descendants. Each process adds its
    children's times to its own when it waits for them (the kernel for torchrun, torchrun for
    the ranks), and ours once papermill has shut the kernel down and reaped it.
    """
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def wall_of(record) -> float:
    """A notebook's wall seconds in course_times.json (older files hold just the number)."""
    return record["seconds"] if isinstance(record, dict) else record


def minutes(secs: float) -> str:
    return f"{int(secs / 60 + 0.5)} min" if secs >= 90 else f"{secs:.0f} s"


# The cores this process may use (Linux: its affinity), for --jobs to share out.
CORES = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []


def pin(slices) -> None:
    """A --jobs worker takes cores of its own, and everything it starts inherits them: a
    notebook sees only those (its launches size OMP_NUM_THREADS by them, and a timing check
    that needs a core per rank says it is not checked), and two notebooks never compete for a
    core, which on 2 cores cost more than running them one after the other (measured)."""
    os.sched_setaffinity(0, slices.get())


def run_notebook(label: str, nb: Path, nb_params: dict, out: Path, tty: bool = True) -> tuple:
    """Execute one notebook into `out`: (name, "pass" or "FAIL", wall seconds, CPU-seconds)."""
    progress = Progress(tty=tty)
    progress.start(label, code_cells(nb, nb_params))
    t0, cpu0 = time.perf_counter(), children_cpu()
    # each launch's script, ranks, wall and CPU-s (distkit.course.launch_cost reads them)
    launches = out / "launches" / f"{nb.stem}.jsonl"
    launches.parent.mkdir(exist_ok=True)
    launches.write_text("")
    os.environ["COURSE_LAUNCH_LOG"] = str(launches.resolve())
    try:
        papermill.execute_notebook(
            nb, out / nb.name, parameters=nb_params, cwd=nb.resolve().parent,
            progress_bar=False, on_cell_execute=progress.cell,
            kernel_manager_class=kernel_logging_to(out / f"{nb.stem}.kernel.log"))
        status, detail = "pass", ""
    except Exception as e:  # papermill raises PapermillExecutionError with the cell's error
        status = "FAIL"
        detail = f" in cell {progress.n}: {type(e).__name__}: " + \
            (str(e).strip().splitlines() or [""])[-1]
    secs, cpu = time.perf_counter() - t0, children_cpu() - cpu0
    progress.show(f"{status} after {secs:.0f} s ({cpu:.0f} CPU-s){detail}", last=True)
    return nb.name, status, secs, cpu


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebooks", nargs="*", type=Path,
                        help="default: notebooks/*.ipynb in order")
    parser.add_argument("--out", type=Path, default=ROOT / "build", help="executed copies")
    parser.add_argument("-p", "--param", action="append", default=[], metavar="NAME=VALUE",
                        help="papermill parameter for every notebook, e.g. -p NPROC=4")
    parser.add_argument("--fast", action="store_true",
                        help="each notebook with its FAST parameters (a live session's)")
    parser.add_argument("--jobs", type=int, default=min(2, len(CORES)) or 1, metavar="J",
                        help="notebooks run at a time, each on its share of the cores "
                             "(default: 2 where Linux lets a process choose its cores, else 1)")
    args = parser.parse_args(argv)
    if not 1 <= args.jobs <= max(1, len(CORES)):
        parser.error(f"--jobs must be between 1 and {max(1, len(CORES))} (the cores this "
                     f"process may use), got {args.jobs}")
    logging.basicConfig(format="%(name)s: %(message)s")  # say who warns ("papermill: ...")
    params = {}
    for p in args.param:
        name, sep, value = p.partition("=")
        if not sep:
            parser.error(f"--param wants NAME=VALUE, got {p!r}")
        params[name] = int(value) if value.lstrip("-").isdigit() else value
    notebooks = args.notebooks or sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
    missing = [str(nb) for nb in notebooks if not nb.is_file()]
    if missing:
        parser.error(f"no such notebook: {', '.join(missing)}")
    args.out.mkdir(parents=True, exist_ok=True)

    # Expected time: this machine's last run of each notebook, else a 2-core laptop's guess.
    times_file = args.out / "course_times.json"
    last = json.loads(times_file.read_text()) if times_file.exists() else {}
    expected = sum(wall_of(last.get(nb.name, GUESS_S)) for nb in notebooks) / \
        min(args.jobs, len(notebooks))
    basis = "as the last run here" if all(nb.name in last for nb in notebooks) else "on 2 cores"
    out = os.path.relpath(args.out) if args.out.resolve().is_relative_to(Path.cwd()) else args.out
    print(f"Running {len(notebooks)} notebook(s) into {out}/, expected about {minutes(expected)} "
          f"{basis}{'; parameters: ' + str(params) if params else ''}",
          file=sys.stderr, flush=True)

    runs = [(f"[{i}/{len(notebooks)}] {nb.name}", nb,
             {**(FAST.get(nb.name, {}) if args.fast else {}), **params}, args.out)
            for i, nb in enumerate(notebooks, 1)]
    started = time.perf_counter()
    args.jobs = min(args.jobs, len(runs))  # one notebook alone gets every core
    if args.jobs > 1:
        # Each worker runs one notebook at a time, so its children's CPU-seconds are that
        # notebook's, on cores of its own (see pin). Progress as plain lines: two notebooks
        # share the console.
        spawn = multiprocessing.get_context("spawn")
        slices = spawn.Queue()
        for k in range(args.jobs):
            slices.put(CORES[k::args.jobs])
        with ProcessPoolExecutor(args.jobs, mp_context=spawn, initializer=pin,
                                 initargs=(slices,)) as pool:
            rows = list(pool.map(run_notebook, *zip(*runs), [False] * len(runs)))
    else:
        rows = [run_notebook(*run) for run in runs]
    for name, status, secs, cpu in rows:
        if status == "pass" and not args.fast:  # the estimate is the full run's
            last[name] = {"seconds": round(secs), "cpu_seconds": round(cpu)}
    times_file.write_text(json.dumps(last, indent=1) + "\n")

    width = max([len(row[0]) for row in rows] + [8])
    print(f"\n{'notebook':<{width}}  result  seconds    CPU-s")
    for name, status, secs, cpu in rows:
        print(f"{name:<{width}}  {status:<6}  {secs:7.1f}  {cpu:7.1f}")
    wall, cpu = sum(r[2] for r in rows), sum(r[3] for r in rows)
    print(f"{'total':<{width}}  {'':<6}  {wall:7.1f}  {cpu:7.1f}")
    if args.jobs > 1:
        print(f"{'elapsed':<{width}}  {'':<6}  {time.perf_counter() - started:7.1f}  "
              f"({args.jobs} notebooks at a time)")
    failed = [row[0] for row in rows if row[1] != "pass"]
    if failed:
        print(f"failed: {', '.join(failed)} (executed copies in {args.out})", file=sys.stderr)
    return 1 if failed or not rows else 0


if __name__ == "__main__":
    sys.exit(main())

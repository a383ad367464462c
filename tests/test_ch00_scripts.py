"""Chapter 00: what the notebook's own nbval run does not already prove.

The notebook runs every chapter-00 script on N = 2 and 4 and asserts their results (collectives
against plain Python, ring bytes against the exact formula, the async result after the call, after
wait() and after a sync, and the order of the overlapped sleep). Here: the first script's output
(its cell's lines race, so nbval does not compare them), the whole notebook on another N
(papermill, N = 3, small sizes), the ring's byte formula on many sizes, bad input (one line,
non-zero exit, no hang), the notebook's parameter checks, and the exercise starters.
"""
import json
import subprocess
import sys

import nbformat
import pytest

from conftest import CODE, ROOT, launcher_env, run_launcher, run_scripts_at_once

NOTEBOOK = ROOT / "notebooks" / "00_torchrun_and_collectives.ipynb"
# The environment torchrun gives a one-process run, for starting a script without torchrun.
ONE_RANK = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
            "MASTER_ADDR": "127.0.0.1"}

# script, args, extra env -> (exit status, one text that must be in stderr or stdout)
DIRECT = {
    "first_script_outside_torchrun": ("hello.py", [], {},
                                      (1, "hello.py: run it with "
                                          "code/run_w_torchrun.sh 2 ch00_collectives/hello.py")),
    "hello_outside_torchrun": ("hello_torchrun.py", [], {},
                               (1, "hello_torchrun.py: not started by torchrun; run it as: "
                                   "code/run_w_torchrun.sh 2 ch00_collectives/hello_torchrun.py")),
    "collectives_unknown_op": ("collectives.py", ["--op", "all_reduce,bogus"], {},
                               (2, "unknown --op bogus; choose from broadcast")),
    "collectives_one_process": ("collectives.py", [], ONE_RANK,
                                (2, "needs at least 2 processes (NPROC >= 2)")),
    "ring_numel_zero": ("ring_allreduce.py", ["--numel", 0], {},
                        (2, "--numel must be at least the number of processes (1)")),
    "ring_sizes_above_the_world": ("ring_allreduce.py", ["--sizes", "1,2"], {},
                                   (2, "--sizes must lie between 1 and the number of processes "
                                       "(1), got 1,2")),
    "ring_sizes_not_numbers": ("ring_allreduce.py", ["--sizes", "2,x"], {},
                               (2, "--sizes must be comma-separated integers, got '2,x'")),
    "bench_no_iters": ("allreduce_bench.py", ["--iters", 0], {},
                       (2, "need --iters >= 1")),
    "bench_no_inner": ("allreduce_bench.py", ["--inner", 0], {},
                       (2, "need --iters >= 1, --inner >= 1 and --warmup >= 0")),
    "async_no_repeats": ("async_collectives.py", ["--repeats", 0], {},
                         (2, "--numel, --dim and --repeats must be positive")),
    "starter_naive_help": ("exercises/ex00_naive_allreduce.py", ["--help"], {},
                           (0, "all-reduce through rank 0")),
    "starter_mean_help": ("exercises/ex00_global_mean.py", ["--help"], {},
                          (0, "the exact mean over all ranks")),
    # run to the first TODO on one process: stops there, saying what is missing
    "starter_naive_todo": ("exercises/ex00_naive_allreduce.py", ["--numel", 8], ONE_RANK,
                           (1, "ex00_naive_allreduce.py:{line}: rank 0: receive")),
    "starter_mean_todo": ("exercises/ex00_global_mean.py", [], ONE_RANK,
                          (1, "ex00_global_mean.py:{line}: (a) mean_of_means")),
    "starter_halves_todo": ("exercises/ex00_allreduce_from_halves.py", [], ONE_RANK,
                            (1, "ex00_allreduce_from_halves.py:{line}: pad x: shard =")),
}


@pytest.fixture(scope="module")
def direct_runs():
    """Every DIRECT run, started at once."""
    return run_scripts_at_once({name: (f"ch00_collectives/{script}", args, env)
                                for name, (script, args, env, _) in DIRECT.items()})


@pytest.mark.parametrize("name", DIRECT)
def test_direct_run(direct_runs, name):
    returncode, out, err = direct_runs[name]
    status, text = DIRECT[name][3]
    if "{line}" in text:  # where the starter's first todo() stands (a starter edit moves it)
        from distkit.course.exercise import first_todo
        where = first_todo(CODE / "ch00_collectives" / DIRECT[name][0])
        text = text.format(line=where.split(":")[1])
    assert returncode == status, f"{name}: exit {returncode}\n{out}\n{err}"
    assert text in (out if status == 0 else err), f"{name}:\n{out}\n{err}"
    if status == 1 and name == "first_script_outside_torchrun":  # one line, not a traceback
        assert err.strip().splitlines() == [DIRECT[name][3][1]]
    if name.startswith("starter_") and status == 1:  # one line, not a traceback
        assert err.strip().splitlines() == [err.strip().splitlines()[-1]]
        assert err.startswith("TODO(you) at ") and "exercises/" in err


def test_first_script_sums_on_every_rank():
    """The chapter's first script, hello.py: every rank prints the sum 1 + 2 = 3. The notebook
    shows its output but cannot compare it (the ranks' lines race), so it is checked here."""
    proc = run_launcher(2, "ch00_collectives/hello.py", timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = sorted(ln for ln in proc.stdout.splitlines() if "all_reduce gave" in ln)
    assert lines == [f"rank {r} of 2: all_reduce gave 3" for r in range(2)], proc.stdout


def test_ring_rejects_fewer_elements_than_ranks():
    """Through torchrun: every rank stops before joining the group, so nothing hangs."""
    proc = run_launcher(2, "ch00_collectives/ring_allreduce.py", "--numel", 1, timeout=60)
    assert proc.returncode != 0
    assert "--numel must be at least the number of processes (2): one chunk per rank, got 1" \
        in proc.stderr


def _ring_function(name):
    """A function from ring_allreduce.py, without running the script."""
    from distkit.course.notebook import source_of
    namespace = {}
    exec(source_of("ch00_collectives/ring_allreduce.py", name), namespace)
    return namespace[name]


@pytest.mark.parametrize("n", [2, 3, 4, 5, 8])
def test_ring_exact_bytes_formula(n):
    """sent_bytes() against a replay of the ring's schedule with tensor_split's chunk sizes."""
    import torch
    sent_bytes = _ring_function("sent_bytes")
    for numel in (n, n + 1, 2 * n - 1, 1000, 1000 * n + 3):
        chunk = [len(c) for c in torch.arange(numel).tensor_split(n)]
        total = 0
        for r in range(n):
            rs = [(r - s) % n for s in range(n - 1)]       # reduce-scatter: chunks sent
            ag = [(r - s + 1) % n for s in range(n - 1)]   # all-gather: chunks sent
            replay = 4 * sum(chunk[i] for i in rs + ag)
            assert sent_bytes(numel, n, r) == replay, (numel, n, r)
            assert abs(replay - 2 * (n - 1) / n * 4 * numel) < 2 * 4  # < 2 elements off
            total += replay
        assert total == 2 * (n - 1) * 4 * numel  # exactly 2(N-1)S over the ranks


def _validation_cell():
    cells = nbformat.read(NOTEBOOK, as_version=4).cells
    i = next(i for i, c in enumerate(cells) if "parameters" in c.metadata.get("tags", []))
    return cells[i].source, cells[i + 1].source  # the parameters, and the cell that checks them


@pytest.mark.parametrize("override, message", [
    ({}, None),
    ({"NPROC": 1}, "NPROC must be an integer >= 2"),
    ({"NPROC_BIG": 2}, "NPROC_BIG must be an integer >= 3"),
    ({"NPROC": "2"}, "NPROC must be an integer >= 2"),
    ({"NPROC_BIG": 8, "RING_NUMEL": 4}, "RING_NUMEL must be an integer >= NPROC and NPROC_BIG"),
    ({"BENCH_MAX_MB": 0, "BENCH_ITERS": 0}, "BENCH_MAX_MB must be at least 1/1024"),
    ({"BENCH_INNER": 0}, "BENCH_INNER must be an integer >= 1"),
])
def test_notebook_parameter_checks(override, message):
    params, check = _validation_cell()
    namespace = {}
    exec(params, namespace)
    namespace.update(override)
    if message is None:
        exec(check, namespace)
        assert namespace["OUT"] == ROOT / "build" / "ch00"
    else:
        with pytest.raises(ValueError, match="bad parameters: .*" + message):
            exec(check, namespace)


@pytest.mark.second_nproc
def test_notebook_at_three_processes(tmp_path):
    """The whole notebook with papermill at N = 3 and small sizes, from the repo root, as the
    docs/parameters.md shows it: every launch and every assert in it must pass on 3 ranks too."""
    out = tmp_path / "ch00_n3.ipynb"
    proc = subprocess.run(
        [sys.executable, "-m", "papermill", str(NOTEBOOK.relative_to(ROOT)), str(out),
         "-p", "NPROC", "3", "-p", "NPROC_BIG", "3", "-p", "RING_NUMEL", "1000",
         "-p", "BENCH_MAX_MB", "0.25", "-p", "BENCH_ITERS", "3", "-p", "ASYNC_NUMEL", "1000",
         "--no-progress-bar"],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
        env=launcher_env({"PYTHONPATH": None}))
    assert proc.returncode == 0, proc.stderr[-3000:]
    check_results(ROOT / "build" / "ch00", n=3, ring_numel=1000)


def check_results(out, n: int, ring_numel: int) -> None:
    """What the notebook's scripts wrote (JSON in `out`) on n ranks, against values computed
    here: rank r's input is [10r, 10r + 1, ...], n values."""
    x = [[10 * r + j for j in range(n)] for r in range(n)]
    ops = json.loads((out / "collectives.json").read_text())
    assert ops["world_size"] == n and ops["ops"]["all_reduce"]["before"] == x
    total = [sum(col) for col in zip(*x)]
    assert ops["ops"]["all_reduce"]["after"] == [total] * n
    assert ops["ops"]["all_gather"]["after"] == [sum(x, [])] * n
    assert ops["ops"]["reduce_scatter"]["after"] == [[t] for t in total]
    assert ops["ops"]["all_to_all"]["after"] == [list(col) for col in zip(*x)]  # a transpose
    ring = json.loads((out / f"ring{n}.json").read_text())
    # every rank sends 2S minus the two chunks it never sends (tensor_split's sizes), float32
    c = [len(range(ring_numel)[i::n]) for i in range(n)]  # chunk sizes: the first get one more
    want = [4 * (2 * ring_numel - c[(r + 1) % n] - c[(r + 2) % n]) for r in range(n)]
    assert ring["numel"] == ring_numel and ring["sent"] == ring["exact_sent"] == want
    assert ring["max_diff_below_1e-5"] is True

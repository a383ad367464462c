"""Unit tests of the helper package, in this process (no torchrun)."""
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from conftest import CODE, ROOT, write_notebook
from distkit import pick_device, print_ranks, seed_everything, setup, write_json
from distkit.course.notebook import diff, launch, source_of


def test_pick_device_cpu_override(monkeypatch):
    monkeypatch.setenv("COURSE_DEVICE", "cpu")
    assert pick_device() == (torch.device("cpu"), "gloo")


def test_pick_device_default_matches_hardware(monkeypatch):
    monkeypatch.delenv("COURSE_DEVICE", raising=False)
    device, backend = pick_device(local_rank=0)
    assert (device.type, backend) == (("cuda", "nccl") if torch.cuda.is_available()
                                      else ("cpu", "gloo"))


def test_pick_device_rejects_bad_values(monkeypatch):
    monkeypatch.setenv("COURSE_DEVICE", "tpu")
    with pytest.raises(ValueError, match="COURSE_DEVICE"):
        pick_device()


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_pick_device_cuda_without_gpu_is_an_error(monkeypatch):
    monkeypatch.setenv("COURSE_DEVICE", "cuda")
    with pytest.raises(RuntimeError, match="no CUDA"):
        pick_device()


def test_setup_outside_torchrun_says_how_to_launch(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(SystemExit, match="run_w_torchrun.sh"):
        setup()


def test_print_ranks_single_process(capsys):
    print_ranks("a\nb")
    assert capsys.readouterr().out == "[rank 0] a\n[rank 0] b\n"


def test_print_ranks_in_a_process_group(capsys):
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        print_ranks("hello")
    finally:
        dist.destroy_process_group()
    assert capsys.readouterr().out == "[rank 0] hello\n"


def test_seed_everything_repeats():
    seed_everything(7)
    a = torch.randn(3)
    seed_everything(7)
    assert torch.equal(a, torch.randn(3))


def test_write_json(tmp_path, monkeypatch):
    write_json(tmp_path / "sub" / "r.json", {"x": [1, 2]})
    assert json.loads((tmp_path / "sub" / "r.json").read_text()) == {"x": [1, 2]}
    monkeypatch.chdir(tmp_path)
    for no_path in (None, ""):  # a script run without --json: nothing written, no error
        write_json(no_path, {"ignored": True})
    assert [p.name for p in tmp_path.rglob("*")] == ["sub", "r.json"]


def test_allow_tracer_where_yama_rules():
    """prctl(PR_SET_PTRACER, ANY) is taken where Linux's Yama rules ptrace (py-spy, a sibling
    of the ranks, may then read them); without Yama the kernel refuses the call (EINVAL) and
    nothing needs allowing. In a child process: this one stays as it was."""
    proc = subprocess.run([sys.executable, "-c", "from distkit.dist import allow_tracer; "
                           "print(allow_tracer())"], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(CODE)}, timeout=60)
    yama = os.path.exists("/proc/sys/kernel/yama/ptrace_scope")
    assert proc.stdout.strip() == str(sys.platform.startswith("linux") and yama), proc.stderr


def test_diff_shows_added_lines(tmp_path):
    (tmp_path / "before.py").write_text("a = 1\nprint(a)\n")
    (tmp_path / "after.py").write_text("a = 1\nb = 2  # NEW\nprint(a)\n")
    text = diff(tmp_path / "before.py", tmp_path / "after.py")
    assert "+b = 2  # NEW" in text and "-" not in text.split("@@")[-1]


def test_source_of_finds_a_function():
    src = source_of("ch00_collectives/ring_allreduce.py", "ring_all_reduce")
    assert src.startswith("def ring_all_reduce(") and "batch_isend_irecv" in src
    with pytest.raises(LookupError):
        source_of("ch00_collectives/ring_allreduce.py", "no_such_function")


def test_launch_raises_when_the_launch_fails(capsys):
    with pytest.raises(subprocess.CalledProcessError):
        launch(2, "ch00_collectives/collectives.py", "--op", "nope")
    assert "unknown --op nope" in capsys.readouterr().out  # stderr is merged and shown


def test_run_course_reports_pass_and_fail(tmp_path):
    """Progress per code cell on stderr, parameters passed through, the kernel's own noise kept
    out of the console, the table on stdout with wall and CPU seconds (the CPU of the kernel's
    own children counted too, as torchrun's ranks are), exit status 1 when a notebook fails."""
    import nbformat

    # no earlier run here: the guess per notebook
    from distkit.course.run_course import GUESS_S, minutes
    burn = "import time\nwhile time.process_time() < 1.5: pass"  # a child of the kernel: 1.5 CPU-s
    ok = write_notebook(tmp_path / "01_ok.ipynb", "NPROC = 2",
                        "assert NPROC == 4, NPROC\nimport subprocess, sys\n"
                        f"subprocess.run([sys.executable, '-c', {burn!r}], check=True)")
    nb = nbformat.read(ok, as_version=4)
    nb.cells[0].metadata["tags"] = ["parameters"]
    nbformat.write(nb, ok)
    write_notebook(tmp_path / "02_bad.ipynb", "x = 1", "raise ValueError('boom')", "y = 2")
    proc = subprocess.run([sys.executable, "-m", "distkit.course.run_course", "--jobs", "1",
                           "--out", str(tmp_path / "build"), "-p", "NPROC=4", str(ok),
                           str(tmp_path / "02_bad.ipynb")], capture_output=True, text=True,
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": str(CODE)},
                          timeout=300)
    assert proc.returncode == 1
    rows = {line.split()[0]: line.split()[1] for line in proc.stdout.splitlines()
            if line.startswith("0")}
    assert rows == {"01_ok.ipynb": "pass", "02_bad.ipynb": "FAIL"}
    header = next(line for line in proc.stdout.splitlines() if line.startswith("notebook"))
    assert header.split()[-2:] == ["seconds", "CPU-s"]
    ok_row = next(line.split() for line in proc.stdout.splitlines() if line.startswith("01_ok"))
    assert float(ok_row[3]) >= 1.5  # the kernel's child burnt 1.5 CPU-s; the kernel some more
    times = json.loads((tmp_path / "build" / "course_times.json").read_text())
    assert set(times) == {"01_ok.ipynb"}  # passing notebooks only: the next run's estimate
    assert times["01_ok.ipynb"]["cpu_seconds"] >= 2 and times["01_ok.ipynb"]["seconds"] >= 0
    assert (tmp_path / "build" / "02_bad.ipynb").exists()  # kept for inspection
    err = proc.stderr.splitlines()
    assert err[0].startswith("Running 2 notebook(s) into ")
    assert f"expected about {minutes(2 * GUESS_S)} on 2 cores" in err[0], err[0]
    # 3 code cells in 01: the parameters cell, papermill's injected one, the assert
    cells = [ln.split(",")[0] for ln in err if ln.startswith("[1/2] 01_ok.ipynb  cell ")]
    assert cells == [f"[1/2] 01_ok.ipynb  cell {n}/3" for n in (1, 2, 3)]
    assert any(ln.startswith("[1/2] 01_ok.ipynb  pass after ") for ln in err)
    # 02 has no parameters cell: papermill says so and puts its cell first (4 code cells)
    assert any(ln.startswith("[2/2] 02_bad.ipynb  FAIL after ") and
               ln.endswith("in cell 3: PapermillExecutionError: ValueError: boom") for ln in err)
    assert "\r" not in proc.stderr  # not a terminal: plain lines, no in-place updates
    assert "Kernel is running" not in proc.stderr and "KeyboardInterrupt" not in proc.stderr
    assert (tmp_path / "build" / "01_ok.kernel.log").exists()


def test_run_course_runs_notebooks_side_by_side(tmp_path):
    """--jobs 2: each notebook on cores of its own (its kernel and what the kernel starts see
    only those), its CPU-seconds still its own (a worker runs one at a time), the rows in the
    notebooks' order, and the elapsed time printed beside their sum."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("needs 2 cores")
    cell = ("import os, subprocess, sys\n"
            "open({out!r}, 'w').write(' '.join(map(str, sorted(os.sched_getaffinity(0)))))\n"
            "subprocess.run([sys.executable, '-c', "
            "'import time\\nwhile time.process_time() < {secs}: pass'], check=True)")
    for name, secs in (("01_a", 1.5), ("02_b", 0.1)):
        write_notebook(tmp_path / f"{name}.ipynb",
                       cell.format(out=str(tmp_path / f"{name}.cores"), secs=secs))
    write_notebook(tmp_path / "03_bad.ipynb", "raise ValueError('boom')")
    proc = subprocess.run([sys.executable, "-m", "distkit.course.run_course", "--jobs", "2",
                           "--out", str(tmp_path / "build"),
                           *(str(tmp_path / f"{n}.ipynb") for n in ("01_a", "02_b", "03_bad"))],
                          capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(CODE)}, timeout=300)
    assert proc.returncode == 1, proc.stdout + proc.stderr  # a notebook failed
    rows = [ln.split() for ln in proc.stdout.splitlines() if ln.startswith("0")]
    assert [r[:2] for r in rows] == [["01_a.ipynb", "pass"], ["02_b.ipynb", "pass"],
                                     ["03_bad.ipynb", "FAIL"]]
    assert float(rows[0][3]) >= 1.5 > float(rows[1][3])  # each its own child's CPU
    assert proc.stdout.splitlines()[-1].endswith("(2 notebooks at a time)")
    assert any(ln.startswith("[3/3] 03_bad.ipynb  FAIL after ") and
               ln.endswith("in cell 1: PapermillExecutionError: ValueError: boom")
               for ln in proc.stderr.splitlines()), proc.stderr
    seen = [set(map(int, (tmp_path / f"{n}.cores").read_text().split())) for n in ("01_a", "02_b")]
    assert seen[0].isdisjoint(seen[1]) and seen[0] | seen[1] == set(cores), seen


def test_launch_expect_failure_shows_rank_errors(capsys):
    launch(2, "ch00_collectives/collectives.py", "--op", "broadcast", env={"COURSE_DEVICE": "tpu"},
           expect_failure=True)
    out = capsys.readouterr().out
    assert "ValueError: COURSE_DEVICE must be 'cpu' or 'cuda', got 'tpu'" in out
    assert out.rstrip().endswith("as expected")
    with pytest.raises(AssertionError, match="expected ch00_collectives/hello_torchrun.py to fail"):
        launch(2, "ch00_collectives/hello_torchrun.py", expect_failure=True)


def test_older_torchrun_gets_no_shutdown_timeout():
    """torch 2.11's torchrun (a GPU machine's image) has no --shutdown-timeout:
    distkit.course.torchrun
    drops it there, and keeps it where torchrun knows it (the course's torch)."""
    import argparse

    from distkit.course import torchrun
    argv = ["--log-dir", "x", "--shutdown-timeout", "2", "--nproc-per-node", "2", "s.py"]
    assert torchrun.older_torch(torchrun.get_args_parser(), argv) == argv
    older = argparse.ArgumentParser()  # a torchrun parser without the option
    assert torchrun.older_torch(older, argv) == ["--log-dir", "x", "--nproc-per-node", "2", "s.py"]

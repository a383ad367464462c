"""code/run_w_torchrun.sh: bad input fails fast with one line; good input runs every rank;
a failed run ends with a short summary; logs go to build/logs/, not to the temp dir."""
import shutil
import subprocess

import pytest

from conftest import LAUNCHER, ROOT, free_port, launcher_env, run_launcher, run_ok


@pytest.mark.parametrize("args, reason", [
    ([], "expected NPROC and SCRIPT"),
    (["2"], "expected NPROC and SCRIPT"),
    (["0", "ch00_collectives/hello_torchrun.py"], "NPROC must be a positive integer, got '0'"),
    (["abc", "ch00_collectives/hello_torchrun.py"], "NPROC must be a positive integer, got 'abc'"),
    (["-1", "ch00_collectives/hello_torchrun.py"], "NPROC must be a positive integer"),
    (["2", "no_such_script.py"], "no such script"),
])
def test_bad_input_one_line_and_nonzero(args, reason):
    proc = run_launcher(*args, timeout=10)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert reason in lines[0] and "usage: run_w_torchrun.sh NPROC SCRIPT" in lines[0]
    assert proc.stdout == ""


def test_bad_multinode_env():
    proc = run_launcher(2, "ch00_collectives/hello_torchrun.py", env={"NNODES": "2"}, timeout=10)
    assert proc.returncode == 2 and "RDZV_ENDPOINT" in proc.stderr


def test_runs_every_rank_and_sets_threads(rank_script):
    proc = run_ok(2, rank_script, env={"OMP_NUM_THREADS": None})  # absolute path works too
    assert sorted(proc.stdout.split()) == ["omp=1", "omp=1", "rank=0", "rank=1"]


def test_keeps_omp_num_threads_when_set(rank_script):
    proc = run_ok(2, rank_script, env={"OMP_NUM_THREADS": "3"})
    assert proc.stdout.count("omp=3") == 2


def test_failure_ends_with_a_short_summary(tmp_path):
    proc = run_launcher(2, "ch00_collectives/collectives.py", "--op", "nope",
                        env={"LOG_DIR": str(tmp_path)})
    assert proc.returncode == 1  # torchrun's status
    lines = proc.stderr.splitlines()
    # each rank's own error (usage + error line), then the two-line summary; before the summary
    # existed, torchrun's ChildFailedError traceback made this ~45 lines
    assert len(lines) <= 8, proc.stderr
    # 1 or 2 ranks: torchrun stops the others as soon as one fails, so on a busy machine the
    # slower rank can be stopped before its argparse has printed anything
    assert sum("collectives.py: error: unknown --op nope" in ln for ln in lines[:-2]) in (1, 2)
    assert lines[-2].startswith("run_w_torchrun.sh: rank ")
    assert "failed first (exit code 2): collectives.py: error: unknown --op nope" in lines[-2]
    assert "exit status 1" in lines[-1] and str(tmp_path) in lines[-1]
    assert "ChildFailedError" not in proc.stderr and "Traceback" not in proc.stderr
    assert "elastic" not in proc.stderr and "[default" not in proc.stderr
    # torchrun's full report is kept in the run's log folder, next to every rank's stderr
    (run_dir,) = tmp_path.iterdir()
    assert "ChildFailedError" in (run_dir / "torchrun.log").read_text()
    assert [p.parent.name for p in sorted(run_dir.rglob("stderr.log"))] == ["0", "1"]


@pytest.fixture
def fail_on_rank_1(tmp_path):
    """Rank 1 raises once the process group is up; rank 0 waits (torchrun will stop it)."""
    script = tmp_path / "fail_on_rank_1.py"
    script.write_text("import time\n"
                      "import torch.distributed as dist\n"
                      "dist.init_process_group('gloo')\n"
                      "if dist.get_rank() == 1:\n"
                      "    raise ValueError('rank 1 says no')\n"
                      "time.sleep(60)\n")
    return script


def test_failure_summary_names_the_rank_that_raised(fail_on_rank_1, tmp_path):
    proc = run_launcher(2, fail_on_rank_1, env={"LOG_DIR": str(tmp_path / "logs")}, timeout=60)
    assert proc.returncode == 1
    # the learner's traceback stays; rank 0, stopped by torchrun, is not blamed
    assert 'fail_on_rank_1.py", line 5' in proc.stderr
    assert "rank 1 failed first (exit code 1): ValueError: rank 1 says no" in proc.stderr
    assert "rank 0 failed" not in proc.stderr and "SIGTERM" not in proc.stderr
    assert "ChildFailedError" not in proc.stderr
    assert len(proc.stderr.splitlines()) <= 8, proc.stderr


def test_failure_summary_when_only_rank_0_is_shown(fail_on_rank_1, tmp_path):
    """RANKS=0 hides rank 1's traceback; the summary still says what rank 1 raised."""
    proc = run_launcher(2, fail_on_rank_1, env={"RANKS": "0", "LOG_DIR": str(tmp_path / "logs")},
                        timeout=60)
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    assert "rank 1 failed first (exit code 1): ValueError: rank 1 says no" in proc.stderr


def test_ranks_filter_shows_rank_0_only(rank_script):
    proc = run_ok(2, rank_script, env={"RANKS": "0"})
    assert "rank=0" in proc.stdout and "rank=1" not in proc.stdout


def test_logs_go_to_build_not_to_the_temp_dir(rank_script, tmp_path):
    """torchrun alone leaves an empty torchelastic_* folder in the temp dir at every launch."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    logs = ROOT / "build" / "logs"
    before = set(logs.glob("*-show_env-*"))
    proc = run_ok(2, rank_script, env={"TMPDIR": str(tmp), "LOG_DIR": None})
    assert "[default" not in proc.stdout + proc.stderr  # --tee's tags stay off the console
    assert not list(tmp.glob("torchelastic_*"))
    (run_dir,) = set(logs.glob("*-show_env-*")) - before
    try:
        assert "rank=1" in next(run_dir.rglob("1/stdout.log")).read_text()
    finally:
        shutil.rmtree(run_dir)


def test_log_dir_keeps_per_rank_logs(rank_script, tmp_path):
    logs = tmp_path / "logs"
    run_ok(2, rank_script, env={"LOG_DIR": str(logs)})
    outs = sorted(logs.rglob("stdout.log"))
    assert [p.parent.name for p in outs] == ["0", "1"]
    assert "rank=1" in outs[1].read_text()


def test_two_nodes_through_c10d_rendezvous():
    """Two launcher invocations on one machine act as two nodes of one 4-rank process group."""
    env = {"NNODES": "2", "RDZV_ENDPOINT": f"127.0.0.1:{free_port()}", "RDZV_ID": "test"}
    node_a = subprocess.Popen([str(LAUNCHER), "2", "ch00_collectives/hello_torchrun.py"], text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              env=launcher_env(env))
    node_b = run_launcher(2, "ch00_collectives/hello_torchrun.py", env=env)
    out_a, err_a = node_a.communicate(timeout=120)
    assert node_a.returncode == 0 and node_b.returncode == 0, err_a + node_b.stderr
    out = out_a + node_b.stdout  # rank 0, on either node, prints every rank's line
    for r in range(4):
        assert f"[rank {r}] RANK={r}" in out
    assert out.count("WORLD_SIZE=4  LOCAL_WORLD_SIZE=2") == 4

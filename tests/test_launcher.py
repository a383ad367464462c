"""code/run_w_torchrun.sh: bad input fails fast with one line; good input runs every rank."""
import subprocess

import pytest

from conftest import LAUNCHER, free_port, launcher_env, run_launcher, run_ok


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


def test_failure_passes_through():
    proc = run_launcher(2, "ch00_collectives/collectives.py", "--op", "nope")
    assert proc.returncode != 0
    assert "unknown --op nope" in proc.stderr


def test_ranks_filter_shows_rank_0_only(rank_script):
    proc = run_ok(2, rank_script, env={"RANKS": "0"})
    assert "rank=0" in proc.stdout and "rank=1" not in proc.stdout


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

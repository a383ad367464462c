"""Chapter 00 scripts on real process groups, their results checked against theory."""
import subprocess
import sys

import pytest

from conftest import CODE, run_json, run_launcher, run_ok


def expected_collectives(n):
    """What each collective must leave on each rank, computed in plain Python."""
    x = [[10 * r + j for j in range(n)] for r in range(n)]
    total = [sum(col) for col in zip(*x)]
    flat = [v for row in x for v in row]
    return {
        "broadcast": [x[0]] * n,
        "scatter": [[x[0][r]] for r in range(n)],
        "reduce": [total],  # only the root's result is defined (see the test)
        "gather": [flat] + x[1:],
        "all_reduce": [total] * n,
        "all_gather": [flat] * n,
        "reduce_scatter": [[total[r]] for r in range(n)],
        "all_to_all": [[x[src][r] for src in range(n)] for r in range(n)],
        "send_recv": [x[0], x[0]] + x[2:],
        "barrier": [[1]] * n,
    }


def test_hello_torchrun():
    out = run_ok(2, "ch00_collectives/hello_torchrun.py").stdout
    for r in (0, 1):
        assert f"[rank {r}] RANK={r}  LOCAL_RANK={r}  WORLD_SIZE=2" in out
    assert "backend=gloo device=cpu" in out or "backend=nccl" in out


@pytest.mark.parametrize("n", [2, 3])
def test_collectives_match_theory(tmp_path, n):
    res, out = run_json(tmp_path, n, "ch00_collectives/collectives.py", "--op", "all")
    assert res["world_size"] == n
    expected = expected_collectives(n)
    assert set(res["ops"]) == set(expected)
    for op, want in expected.items():
        after = res["ops"][op]["after"]
        assert (after[:1] if op == "reduce" else after) == want, op
    assert out.count("left only after the last rank arrived: True") == n


def test_collectives_bad_input():
    proc = run_launcher(2, "ch00_collectives/collectives.py", "--op", "all_reduce,bogus")
    assert proc.returncode != 0 and "unknown --op bogus" in proc.stderr
    proc = run_launcher(1, "ch00_collectives/collectives.py", "--op", "broadcast")
    assert proc.returncode != 0 and "needs at least 2 processes" in proc.stderr


@pytest.mark.parametrize("n", [2, 4])
def test_ring_allreduce_bytes_equal_theory(tmp_path, n):
    res, out = run_json(tmp_path, n, "ch00_collectives/ring_allreduce.py", "--numel", 4096)
    assert res["bytes"] == 4096 * 4
    assert res["theory_sent"] == 2 * (n - 1) / n * res["bytes"]
    assert res["sent"] == [res["theory_sent"]] * n  # exact, every rank
    assert all(len(s) == 2 * (n - 1) for s in res["schedule"])
    assert "dist.all_reduce (torch.testing.assert_close): True" in out


def test_ring_allreduce_uneven_chunks(tmp_path):
    """1000 elements on 3 ranks: chunks differ by one element, the total is still 2(N-1)*S."""
    res, _ = run_json(tmp_path, 3, "ch00_collectives/ring_allreduce.py", "--numel", 1000)
    assert sum(res["sent"]) == 2 * (3 - 1) * res["bytes"]
    assert max(res["sent"]) - min(res["sent"]) <= 2 * 4  # at most one float32 per phase


def test_ring_allreduce_bad_input():
    proc = run_launcher(2, "ch00_collectives/ring_allreduce.py", "--numel", 0)
    assert proc.returncode != 0 and "--numel must be positive" in proc.stderr


def test_allreduce_bench(tmp_path):
    res, out = run_json(tmp_path, 2, "ch00_collectives/allreduce_bench.py", "--max-mb", 0.25, "--iters", 2)
    assert res["sizes"] == [1024, 4096, 16384, 65536, 262144]
    assert len(res["times"]) == 5 and all(t > 0 for t in res["times"])
    assert "busbw" in out


def test_allreduce_bench_bad_input():
    proc = run_launcher(2, "ch00_collectives/allreduce_bench.py", "--iters", 0)
    assert proc.returncode != 0 and "--iters >= 1" in proc.stderr


def test_hello_outside_torchrun_says_how_to_launch():
    proc = subprocess.run([sys.executable, str(CODE / "ch00_collectives/hello_torchrun.py")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines() == [
        "hello_torchrun.py: not started by torchrun; "
        "run it as: code/run_w_torchrun.sh 2 ch00_collectives/hello_torchrun.py"]


def test_solution_naive_allreduce_bottleneck(tmp_path):
    res, out = run_json(tmp_path, 4, "ch00_collectives/solutions/ex00_naive_allreduce.py", "--numel", 1024)
    S, n = res["bytes"], 4
    assert res["sent"] == [(n - 1) * S] + [S] * (n - 1)
    assert res["received"] == [(n - 1) * S] + [S] * (n - 1)
    assert "result == dist.all_reduce: True" in out


def test_solution_global_mean(tmp_path):
    res, _ = run_json(tmp_path, 2, "ch00_collectives/solutions/ex00_global_mean.py")
    assert res["exact"] == pytest.approx(res["reference"], abs=1e-12)
    assert abs(res["mean_of_means"] - res["reference"]) > 1e-3  # the naive mean is wrong

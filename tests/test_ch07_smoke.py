"""Chapter 07's cluster smoke test: it passes on a healthy 2-process launch, and a rank that
reports another torch (--pretend) stops every rank at once, naming the rank and the field.

Budget: two launches (~4-5 s each on 2 cores). The failing one must end long before its
process-group timeout (a hang would last that long), by the script's own clocks. Bad --pretend
input runs in this process (argparse stops the script before setup()).
"""
import json
import socket

import pytest
import torch

from conftest import run_in_process, run_json, run_launcher

SMOKE = "ch07_debugging/smoke_test.py"
AGREE = "torch, cuda, nccl, python, gpus"


@pytest.fixture(scope="module")
def ok(tmp_path_factory):
    """The notebook's run (--hide-env), plus a small --bandwidth to cover its code path."""
    return run_json(tmp_path_factory.mktemp("smoke"), 2, SMOKE, "--hide-env",
                    "--bandwidth", "--bandwidth-mib", "4")


def test_healthy_launch_passes_every_check(ok):
    res, out = ok
    assert res["ok"] is True and res["problems"] == [] and res["agree"] is True
    assert res["world_size"] == 2 and res["backend"] == "gloo" and len(res["nodes"]) == 1
    assert [r["rank"] for r in res["reports"]] == [0, 1]
    assert [r["local_rank"] for r in res["reports"]] == [0, 1]
    for r in res["reports"]:
        assert r["torch"] == torch.__version__ and r["device"] == "cpu" and "gloo" in r["backends"]
        assert r["matmul_error"] < 1e-6  # float32 on the CPU against float64
    assert res["collectives"] == [{"small": 3.0, "big_ok": True}] * 2
    assert res["bandwidth"]["bytes"] == 4 * 2**20 and res["bandwidth"]["busbw_bytes_per_s"] > 0
    lines = out.splitlines()
    assert lines[:6] == [
        "smoke test: 2 ranks on 1 node(s), backend gloo, device type cpu, timeout 30 s",
        f"ranks agree on {AGREE}: True",
        "every rank's device works (a 256x256 matmul): True",
        "all_reduce(rank + 1) = 3 = 2*3/2 on every rank: True",
        "all_reduce of 16 MiB exact on every rank: True",
        "barrier: True"]
    assert lines[6].startswith("all_reduce of 4 MiB: ")  # --bandwidth: noisy, not compared
    assert lines[7:] == ["[rank 0] local rank 0, node 0, device cpu: OK",
                         "[rank 1] local rank 1, node 0, device cpu: OK"]


def test_hide_env_leaves_out_what_differs_by_machine(ok):
    """What the notebook compares has no host name and no version; the JSON keeps them."""
    res, out = ok
    assert socket.gethostname() not in out and torch.__version__ not in out
    assert len(res["environment"]) == 1
    assert res["environment"][0].startswith(f"node 0 = {socket.gethostname()}, ranks 0-1: "
                                            f"torch {torch.__version__}, CUDA ")


def test_disagreeing_rank_stops_every_rank_at_once(tmp_path):
    out = tmp_path / "smoke.json"
    proc = run_launcher(2, SMOKE, "--pretend", "1:torch=2.12.1", "--hide-env", "--timeout", 60,
                        "--json", out, timeout=180)
    assert proc.returncode == 1, proc.stderr
    problem = (f"ranks disagree on torch: {torch.__version__} on rank 0 "
               f"(host {socket.gethostname()}), 2.12.1 on rank 1 (host {socket.gethostname()})")
    # every rank says it, on its own stderr; the launcher's summary repeats it
    assert proc.stderr.splitlines().count(f"SmokeTestError: {problem}") == 2, proc.stderr
    assert f"failed first (exit code 1): SmokeTestError: {problem}" in proc.stderr
    assert proc.stdout.splitlines() == [
        "--pretend: rank 1 reports torch 2.12.1 (a demonstration)",
        "smoke test: 2 ranks on 1 node(s), backend gloo, device type cpu, timeout 60 s",
        f"ranks agree on {AGREE}: False",
        "every rank's device works (a 256x256 matmul): True"]  # and no collective check ran
    res = json.loads(out.read_text())
    assert res["ok"] is False and res["problems"] == [problem]
    assert res["disagree"] == {"torch": {torch.__version__: [0], "2.12.1": [1]}}
    assert "collectives" not in res
    # nothing waited for the 60 s timeout: the script's own clocks (set-up, then the gather that
    # found the disagreement); the launch's wall time would count start-up, which load stretches
    assert set(res["seconds"]) == {"setup", "gather"} and sum(res["seconds"].values()) < 30


@pytest.mark.parametrize("pretend, error", [
    ("1torch=2.12.1", "expected RANK:FIELD=VALUE (e.g. 1:torch=2.12.1), got '1torch=2.12.1'"),
    ("1:host=a", "unknown field 'host' in '1:host=a'; choose from " + AGREE),
    ("0:gpus=many", "gpus must be a count, got 'many'"),
    ("2:torch=2.12.1", None),  # no rank 2 in 2 ranks
])
def test_bad_pretend_stops_before_setup(monkeypatch, capsys, pretend, error):
    code, _, err = run_in_process(monkeypatch, capsys, SMOKE, "--pretend", pretend,
                                  env={"WORLD_SIZE": "2"})
    last = err.strip().splitlines()[-1]
    assert code == 2
    if error:
        assert last == f"smoke_test.py: error: argument --pretend: {error}"
    else:
        assert last == "smoke_test.py: error: --pretend 2:torch: there is no rank 2 in 2 ranks"

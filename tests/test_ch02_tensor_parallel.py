"""Chapter 02's tensor parallelism beyond what its notebook proves: exercise 02.2 meets its
claims, the starter stops at its first TODO, bad input and --help.

tensor_parallel.py itself is not launched here: the notebook runs it (every plan's parity and
collective counts asserted at N=2 under nbval, at N=4 in `make test-nproc`, where
test_ch02_pipeline.py checks N=4's shards and bytes too). Budget ~10 s on 2 cores, where imports
dominate: one launch of the exercise's solution at N=2 and the starter as one plain-Python
process (the same code path up to its first TODO, without a launch), both at once. Bad input and
--help run in this process: argparse stops the scripts before setup(), so they need no process
group.
"""
from concurrent.futures import ThreadPoolExecutor

import pytest

from conftest import CODE, check_starter, run_in_process, run_json, run_scripts_at_once

TP = "ch02_model_parallel/tensor_parallel.py"
EX = "ch02_model_parallel/{}/ex02_megatron_mlp.py"
# The bounds the script states (it explains its choice); it may not loosen them.
EX_TOLERANCES = {"loss": 1e-5, "output": 1e-7, "input_grad": 1e-7, "weight_grads": 1e-7}
ONE_PROCESS = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "localhost"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{"ex2": (json, stdout), "starter": (status, stdout, stderr)}"""
    tmp = tmp_path_factory.mktemp("ch02")
    with ThreadPoolExecutor() as pool:  # threads only wait for the subprocesses
        ex2 = pool.submit(run_json, tmp, 2, EX.format("solutions"))
        starter = pool.submit(run_scripts_at_once,
                              {"starter": (EX.format("exercises"), [], ONE_PROCESS)})
        return {"ex2": ex2.result(), "starter": starter.result()["starter"]}


def test_megatron_mlp_by_hand(runs):
    res, out = runs["ex2"]
    act = res["activation_bytes"]
    assert res["all_reduce_calls"] == {"forward": 1, "backward": 1}
    assert res["all_reduce_bytes"] == {"forward": act, "backward": act}
    assert res["tolerances"] == EX_TOLERANCES and res["parity"] is True
    for name in ("hand", "dtensor"):
        assert set(res["errors"][name]) == set(EX_TOLERANCES)
        for what, err in res["errors"][name].items():
            assert err < EX_TOLERANCES[what], (name, what, err)
    assert "all_reduce calls by f and g: forward 1 (65536 B), backward 1 (65536 B)" in out
    assert out.count(": True") == 8 and "False" not in out


def test_starter_stops_at_its_first_todo(runs):
    code, out, err = runs["starter"]
    assert code == 1, err
    assert "TODO(you) at " in err and "ch02_model_parallel/exercises/ex02_megatron_mlp.py:" in err
    assert "ColumnParallelLinear: keep rows [rank*k, (rank+1)*k)" in err
    assert "Traceback" not in err and "all_reduce calls" not in out


# --- arguments, in this process ---------------------------------------------------------------

@pytest.mark.parametrize("script, args, world, message", [
    (TP, [], "1", "needs at least 2 processes"),
    (TP, ["--heads", "6", "--hidden", "96"], "4", "--heads 6 is not a multiple of 4 processes"),
    (TP, ["--hidden", "30"], "2", "--hidden 30 is not a multiple of --heads 4"),
    (TP, ["--plans", "megatron,ring"], "2", "--plans: unknown ring"),
    (TP, ["--layers", "0"], "2", "must be >= 1"),
    (EX.format("solutions"), ["--hidden", "4"], "3", "a multiple of 3 processes"),
    (EX.format("exercises"), ["--seq", "0"], "2", "--seq and --batch-size must be >= 1"),
])
def test_bad_input(monkeypatch, capsys, script, args, world, message):
    status, _, err = run_in_process(monkeypatch, capsys, script, *args,
                                    env={"WORLD_SIZE": world})  # as torchrun would set it
    lines = err.strip().splitlines()
    assert status == 2 and lines[0].startswith("usage:")
    assert lines[-1].startswith(script.split("/")[-1] + ": error:") and message in lines[-1]


@pytest.mark.parametrize("script", [TP, EX.format("solutions"), EX.format("exercises")])
def test_help_is_whole_sentences(monkeypatch, capsys, script):
    first = (CODE / script).read_text().split('"""')[1].split("\n\n")[0]  # the description
    assert first.rstrip().endswith("."), first
    status, out, _ = run_in_process(monkeypatch, capsys, script, "--help")
    assert status == 0 and "--json" in out
    assert " ".join(first.split()) in " ".join(out.split())  # argparse reflows it


def test_starter_marks_every_todo():
    check_starter("ch02_model_parallel", "ex02_megatron_mlp.py", 6)

"""Chapter 02's tensor parallelism: tensor_parallel.py and exercise 02.2 meet their claims.

Budget ~20 s on 2 cores, where imports dominate (a 4-process launch alone costs ~15 s). So:
one launch of tensor_parallel.py at N=4 (all plans, 1 head per rank; the notebook shows N=2),
one of the exercise's solution at N=2, and the starter as one plain-Python process (the same
code path up to its first TODO, without a launch), all three at once: each launch's serial
start-up (torchrun, rendezvous) overlaps the others' work. Bad input and --help run in this
process: argparse stops the scripts before setup(), so they need no process group.
"""
import re
from concurrent.futures import ThreadPoolExecutor

import pytest

from conftest import CODE, check_starter, run_in_process, run_json, run_scripts_at_once

TP = "ch02_model_parallel/tensor_parallel.py"
EX = "ch02_model_parallel/{}/ex02_megatron_mlp.py"
# The bounds the scripts state (each explains its choice); a script may not loosen them.
TP_TOLERANCES = {"loss": 1e-5, "logit": 1e-5, "grad": 1e-6, "weight": 1e-4}
EX_TOLERANCES = {"loss": 1e-5, "output": 1e-7, "input_grad": 1e-7, "weight_grads": 1e-7}
ONE_PROCESS = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "localhost"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{"tp4": (json, stdout), "ex2": (json, stdout), "starter": (status, stdout, stderr)}"""
    tmp = tmp_path_factory.mktemp("ch02")
    with ThreadPoolExecutor() as pool:  # threads only wait for the subprocesses
        tp4 = pool.submit(run_json, tmp, 4, TP)
        ex2 = pool.submit(run_json, tmp, 2, EX.format("solutions"))
        starter = pool.submit(run_scripts_at_once,
                              {"starter": (EX.format("exercises"), [], ONE_PROCESS)})
        return {"tp4": tp4.result(), "ex2": ex2.result(), "starter": starter.result()["starter"]}


@pytest.fixture
def tp4(runs):
    return runs["tp4"]


def test_every_plan_matches_the_unsharded_model(tp4):
    res, out = tp4
    assert res["world_size"] == 4 and res["tolerances"] == TP_TOLERANCES
    assert list(res["plans"]) == ["naive", "megatron", "sequence"]
    for plan, r in res["plans"].items():
        for what, tol in TP_TOLERANCES.items():
            assert r[f"max_{what}_diff"] < tol, (plan, what, r)
        assert r["parity"] is True, plan
    bounds = [ln for ln in out.splitlines() if "max |loss diff| < 1e-05:" in ln]
    assert len(bounds) == 3 and all("False" not in ln for ln in bounds)


def test_collectives_per_plan(tp4):
    """Megatron: 2 all-reduces of one [B, S, h] activation per decoder layer, each way. Naive
    plan: each of q, k, v, gate, up all-reduces its own input gradient (5 per layer backward).
    Sequence parallelism: each all-reduce becomes an all-gather + a reduce-scatter, plus one
    all-gather at the edges (lm_head's input; embedding's gradient) and the norms' weight
    gradients (2 per layer + the final norm, h floats each) all-reduced in backward."""
    res, out = tp4
    L, n, act = res["layers"], res["world_size"], res["activation_bytes"]
    assert act == res["batch"] * res["seq"] * res["hidden"] * 4 == 65536
    assert res["megatron_count"] == 2 * L
    naive, megatron, seq = (res["plans"][p] for p in ("naive", "megatron", "sequence"))
    assert megatron["forward"] == megatron["backward"] == {"all_reduce": 2 * L}
    assert megatron["forward_bytes"] == megatron["backward_bytes"] == 2 * L * act
    assert naive["forward"] == {"all_reduce": 2 * L} and naive["backward"] == {"all_reduce": 5 * L}
    assert naive["backward_bytes"] == 5 * L * act
    assert seq["forward"] == {"all_gather_into_tensor": 2 * L + 1,
                              "reduce_scatter_tensor": 2 * L}
    assert seq["backward"] == {**seq["forward"], "all_reduce": 2 * L + 1}
    assert seq["forward_bytes"] == (4 * L + 1) * act
    assert seq["backward_bytes"] == (4 * L + 1) * act + (2 * L + 1) * res["hidden"] * 4
    # On the wire (ring), all-gather + reduce-scatter cost what one all-reduce does.
    ring_all_reduce = 2 * (n - 1) * act // n
    assert megatron["forward_ring_bytes"] == 2 * L * ring_all_reduce
    assert seq["forward_ring_bytes"] == megatron["forward_ring_bytes"] + (n - 1) * act // n
    naive_table = out[out.index("naive plan"):out.index("megatron plan")]
    assert re.search(rf"backward +all_reduce +{5 * L} +{5 * L * act}\n", naive_table)


def test_local_shards_and_bytes(tp4):
    res, out = tp4
    h, n, L = res["hidden"], res["world_size"], res["layers"]
    assert res["local_shapes"] == {"q_proj": [[h, h], [h // n, h]], "o_proj": [[h, h], [h, h // n]],
                                   "gate_proj": [[2 * h, h], [2 * h // n, h]],
                                   "down_proj": [[h, 2 * h], [h, 2 * h // n]]}
    sharded = L * (4 * h * h + 3 * h * 2 * h) * 4  # attention's 4 and the MLP's 3 linears
    assert res["param_bytes_per_rank"] == res["param_bytes_unsharded"] - sharded + sharded // n
    assert "[rank 3] q_proj [64, 64] -> [16, 64]  o_proj [64, 64] -> [64, 16]" in out


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

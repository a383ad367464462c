"""Chapter 04's exercises: meta-device init and gradient accumulation meet their claims, and the
starters stop at their TODOs.

Budget: 20 s on 2 cores, where every process that imports torch and transformers costs ~4.5 s
of CPU before it does anything (measured; the scripts' own work is under 1.5 s). So everything
that needs a process starts at once: one launch of each solution (each trains its one-process
reference itself) and the meta-init starter as one plain-Python process of a one-process group
(the same code path up to its first TODO, without a launch). The accumulation starter is not
run: its code up to its first TODO is the solution's (run above), and check_starter pins the
rest; one more process would cost ~2.5 s of the budget. --help and bad input run in this
process: argparse stops the scripts before setup(), so they need no process group.
"""
from concurrent.futures import ThreadPoolExecutor

import pytest

from conftest import check_same_options, check_starter, run_in_process, run_json, run_scripts_at_once

META = "ch04_fsdp2/{}/ex04_meta_init.py"
ACCUM = "ch04_fsdp2/{}/ex04_grad_accum.py"
LOSS_TOL = 1e-5  # both scripts' bound against one process; a script may not loosen it
NPROC = 2
ONE_PROCESS = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "localhost"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{"meta": (json, stdout), "accum": (json, stdout), "starter": (status, stdout, stderr)}"""
    tmp = tmp_path_factory.mktemp("ch04_ex")
    with ThreadPoolExecutor() as pool:  # threads only wait for the subprocesses
        meta = pool.submit(run_json, tmp, NPROC, META.format("solutions"))
        accum = pool.submit(run_json, tmp, NPROC, ACCUM.format("solutions"))
        starter = pool.submit(run_scripts_at_once,
                              {"starter": (META.format("exercises"), [], ONE_PROCESS)})
        return {"meta": meta.result(), "accum": accum.result(),
                "starter": starter.result()["starter"]}


# --- exercise 1: meta-device init, solution ---------------------------------------------------

def test_meta_init_matches_one_process(runs):
    res, out = runs["meta"]
    assert res["world_size"] == NPROC and res["steps"] == 3
    assert len(res["losses"]) == len(res["single_losses"]) == res["steps"]
    assert res["tolerance"] == LOSS_TOL and res["max_loss_diff"] < LOSS_TOL
    assert res["parity"] is True
    assert res["losses"][-1] < res["losses"][0]  # it trains
    assert "max |loss - reference| < 1e-5: True" in out
    assert "False" not in out


def test_meta_init_recomputes_the_buffers_no_state_dict_carries(runs):
    res, out = runs["meta"]
    names = ["model.rotary_emb.inv_freq", "model.rotary_emb.original_inv_freq"]
    assert res["non_persistent_buffers"] == names
    assert f"buffers not in the state dict (non-persistent): {', '.join(names)}" in out
    assert res["inv_freq_exact"] == [True] * NPROC  # bit for bit, on every rank
    for r in range(NPROC):
        assert f"[rank {r}] inv_freq bit-exact vs the reference: True" in out


def test_meta_init_each_rank_holds_its_shard(runs):
    """Every dimension sharded (the first) divides by 2: each rank holds exactly half."""
    res, out = runs["meta"]
    whole = res["param_bytes"]
    assert whole == 4 * 98_624  # the tiny Llama's Psi, float32
    assert res["param_bytes_held"] == [whole // NPROC] * NPROC
    for r in range(NPROC):
        assert f"[rank {r}] parameter bytes held: {whole // NPROC:,} of {whole:,}" in out


# --- exercise 2: gradient accumulation, solution ----------------------------------------------

def test_grad_accum_both_modes_match_one_process(runs):
    res, out = runs["accum"]
    assert res["world_size"] == NPROC and res["steps"] == 3 and res["micro_batches"] == 4
    assert res["tolerance"] == LOSS_TOL
    assert list(res["modes"]) == ["every", "last"]
    for mode, r in res["modes"].items():
        assert len(r["losses"]) == len(res["single_losses"]) == res["steps"], mode
        assert r["max_loss_diff"] < LOSS_TOL and r["parity"] is True, mode
    assert res["single_losses"][-1] < res["single_losses"][0]  # it trains
    assert "False" not in out


def test_grad_accum_reduce_scatters_once_per_step(runs):
    """Per optimizer step: a reduce-scatter per FSDP unit per micro-batch, or per unit once.
    All-gathers do not change: each micro-batch gathers every unit for its forward and each
    layer again for its backward (the root stays gathered after forward), 2L + 1."""
    res, out = runs["accum"]
    k, units = res["micro_batches"], res["fsdp_units"]
    assert units == 3  # 2 decoder layers + the root
    gathers = k * (2 * (units - 1) + 1)
    want = {"every": {"_allgather_base_": gathers, "_reduce_scatter_base_": k * units},
            "last": {"_allgather_base_": gathers, "_reduce_scatter_base_": units}}
    for mode, r in res["modes"].items():
        assert r["counts"] == [want[mode]] * res["steps"], mode
    table = {ln[:19].strip(): ln[19:].split() for ln in out.splitlines()
             if ln.startswith(("every micro-batch", "the last only"))}
    assert table == {"every micro-batch": [str(k * units), str(gathers), "True"],
                     "the last only": [str(units), str(gathers), "True"]}


# --- starters ---------------------------------------------------------------------------------

def test_starter_stops_at_its_first_todo(runs):
    """As a learner's first run goes: one line on stderr, exit status 1, nothing trained."""
    status, out, err = runs["starter"]
    assert status == 1, err
    assert len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"TODO(you) at code/{META.format('exercises')}:")
    assert err.strip().endswith("allocate the sharded model's storage on env.device (to_empty)")
    assert "step 1" not in out and "Traceback" not in out + err


@pytest.mark.parametrize("name, stops", [("ex04_meta_init.py", 3), ("ex04_grad_accum.py", 2)])
def test_starter_marks_every_todo(name, stops):
    check_starter("ch04_fsdp2", name, stops)


# --- arguments: --help, bad input (in this process: argparse exits before setup) ---------------

@pytest.mark.parametrize("script", [META, ACCUM])
def test_starter_takes_the_solutions_arguments(monkeypatch, capsys, script):
    check_same_options(monkeypatch, capsys, script)


@pytest.mark.parametrize("folder", ["solutions", "exercises"])
@pytest.mark.parametrize("script, args, message", [
    (META, ["--steps", "0"], "need --steps >= 1 and --batch-size >= 1"),
    (META, ["--batch-size", "0"], "need --steps >= 1 and --batch-size >= 1"),
    (ACCUM, ["--micro-batches", "0"], "need --steps, --micro-batches and --batch-size >= 1"),
    (ACCUM, ["--steps", "0"], "need --steps, --micro-batches and --batch-size >= 1"),
])
def test_bad_input(monkeypatch, capsys, folder, script, args, message):
    path = script.format(folder)
    code, _, err = run_in_process(monkeypatch, capsys, path, *args,
                                  env={"WORLD_SIZE": str(NPROC)})  # as torchrun would set it
    lines = err.strip().splitlines()
    assert code == 2 and lines[0].startswith("usage:")
    assert lines[-1] == f"{path.split('/')[-1]}: error: {message}"

"""Chapter 04's exercises through their checker (`make exercise EX=04.1`, `04.2`): each solution,
copied over its starter, passes and meets its claims; each wrong answer a learner plausibly
writes fails with the line that points at the mistake (the missing 1/K and .to() for to_empty()
at 2 ranks in `make test`; in `make test-nproc` the solutions and the loss divided by N too at 3
ranks, the others at 2); arguments and bad input.

Budget of `make test`: four 2-rank launches at once, where every process that imports torch and
transformers costs ~4.5 s of CPU before it does anything (measured; the scripts' own work is
under 1.5 s). Each solution trains its one-process reference itself. The untouched starters'
first TODO is tests/test_exercises.py's (no launch). --help and bad input run in this process:
argparse stops the scripts before setup(), so they need no process group.
"""
import pytest

from conftest import check_same_options, run_in_process
from distkit.course.exercise import check_at_once

META = "ch04_fsdp2/{}/ex04_meta_init.py"
ACCUM = "ch04_fsdp2/{}/ex04_grad_accum.py"
LOSS_TOL = 1e-5  # both scripts' bound against one process; a script may not loosen it
NPROC = 2


@pytest.fixture(scope="module")
def checks(tmp_path_factory):
    """make test: both solutions and a wrong answer to each at 2 ranks."""
    return check_at_once({
        "meta": ("04.1", None), "accum": ("04.2", None),
        # .to() where the meta model needs to_empty(): a meta tensor has no data to copy
        "meta_to": ("04.1", ("model.to_empty(device=env.device)", "model.to(env.device)")),
        # each micro-batch's whole mean loss: the K losses add up to K times the batch's
        "accum_no_k": ("04.2", (".loss / K", "loss = model(input_ids=micro[k], "
                                             "labels=micro[k]).loss")),
    }, tmp_path_factory.mktemp("ch04_ex"))


@pytest.fixture(scope="module")
def at_3(tmp_path_factory):
    """make test-nproc: both solutions and the wrong answer whose point is N (a loss divided by
    N too) at 3 ranks, where a constant that fits N = 2 fails; the other wrong answers, whose
    point does not depend on N, at 2 ranks (a third rank importing torch and transformers cost
    each launch ~3 CPU-s more), side by side."""
    from concurrent.futures import ThreadPoolExecutor
    tmp = tmp_path_factory.mktemp("ch04_ex3")
    at_3 = {
        "meta": ("04.1", None),
        "accum": ("04.2", None),
        # divided by N as well, as by hand in DDP: FSDP's reduce-scatter already averages
        "accum_over_n": ("04.2", (".loss / K", "loss = model(input_ids=micro[k], "
                                               "labels=micro[k]).loss / (K * env.world_size)")),
    }
    at_2 = {
        # one of the two buffers no state dict carries left as to_empty() made it
        "meta_no_original": ("04.1", ("rotary.original_inv_freq.copy_(inv_freq)", None)),
        # sync on for every micro-batch in the "last" mode too: K reduce-scatters per unit
        "accum_always_sync": ("04.2", ("model.set_requires_gradient_sync(k == K - 1)",
                                       "model.set_requires_gradient_sync(True)")),
        # sync turned off and never on again: no reduce-scatter, no sharded gradient to step
        "accum_never_sync": ("04.2", ("model.set_requires_gradient_sync(k == K - 1)",
                                      "model.set_requires_gradient_sync(False)")),
        # the sync on the first micro-batch, not the last: as many reduce-scatters, but the
        # step takes the first micro-batch's gradients alone
        "accum_sync_first": ("04.2", ("model.set_requires_gradient_sync(k == K - 1)",
                                      "model.set_requires_gradient_sync(k == 0)")),
        # the log divided by K, the backward not: K-fold gradients, which AdamW trains like the
        # right ones (every loss within 1e-5 of one process's); step 1's gradients show it
        "accum_k_in_log_only": ("04.2", [
            (".loss / K", "loss = model(input_ids=micro[k], labels=micro[k]).loss"),
            ("total += loss.detach()", "total += loss.detach() / K")]),
        # "/ 4" where "/ K" belongs: right at the checked K = 4 (R45's plant), 0.5x at K = 2
        "accum_over_4": ("04.2", (".loss / K", "loss = model(input_ids=micro[k], "
                                               "labels=micro[k]).loss / 4")),
        # rank 0's full state dict loaded without saying it is whole and on rank 0 only
        "meta_not_broadcast": ("04.1", [
            ("set_model_state_dict(model, full_sd, options=StateDictOptions(",
             "set_model_state_dict(model, full_sd, options=StateDictOptions())"),
            ("broadcast_from_rank0=True))", None)]),
    }
    with ThreadPoolExecutor(2) as pool:
        big = pool.submit(check_at_once, at_3, tmp / "n3", nprocs="largest")
        small = pool.submit(check_at_once, at_2, tmp / "n2")
        return {**big.result(), **small.result()}


def test_meta_init_with_to_is_named(checks):
    ok, lines, _ = checks["meta_to"]
    assert not ok
    assert lines[-1].startswith("FAIL [2 ranks] the launch failed: NotImplementedError: Cannot "
                                "copy out of meta tensor; no data! Please use "
                                "torch.nn.Module.to_empty() instead of torch.nn.Module.to()")
    assert lines[-1].endswith("/ch04_fsdp2/exercises/ex04_meta_init.py:72)")  # torch's own text


def test_grad_accum_without_the_1_over_k_is_named(checks):
    """The losses at step 1 are exactly K = 4 times one process's: the message says so."""
    ok, lines, _ = checks["accum_no_k"]
    assert not ok
    assert lines[-1].startswith("FAIL [2 ranks] sync every micro-batch: losses differ from one "
                                "process's on the global batch at step 1 by ")
    assert lines[-1].endswith(": 4x: is each micro-batch's loss divided by K?")


@pytest.fixture(scope="module")
def runs(checks):
    """{"meta": (json, stdout), "accum": (json, stdout)}: the solutions' launches."""
    found = {}
    for name in ("meta", "accum"):
        ok, lines, launches = checks[name]
        assert ok, lines
        (_, res, out), *_ = launches  # the first (04.2 runs again at K = 2)
        found[name] = res, out
    return found


@pytest.mark.second_nproc
def test_at_3_ranks_solutions_pass_and_wrong_answers_are_named(at_3):
    for name in ("meta", "accum"):
        ok, lines, _ = at_3[name]
        assert ok, lines
    ok, lines, _ = at_3["meta_no_original"]
    assert not ok
    assert lines[-1] == ("FAIL [2 ranks] inv_freq or original_inv_freq differ from the "
                         "reference's on ranks [0, 1]: model.rotary_emb.inv_freq, "
                         "model.rotary_emb.original_inv_freq are in no state dict, so they must "
                         "be recomputed")
    ok, lines, _ = at_3["accum_over_4"]
    assert not ok
    assert lines[-1] == ("FAIL [2 ranks] at K = 2, sync every micro-batch: step 1's gradients are "
                         "0.50x one process's: is each micro-batch's loss divided by K, not by a "
                         "fixed number?"), lines
    ok, lines, _ = at_3["accum_k_in_log_only"]
    assert not ok
    assert lines[-1] == ("FAIL [2 ranks] sync every micro-batch: step 1's gradients are 4.00x "
                         "one process's: is the loss you call backward() on divided by K?"), lines
    ok, lines, _ = at_3["accum_always_sync"]
    assert not ok
    assert lines[-1] == ("FAIL [2 ranks] sync on the last only: [12] reduce-scatters per step, "
                         "expected 3 (3 FSDP units, once per step): is the sync off for all "
                         "but the last micro-batch?")
    ok, lines, _ = at_3["accum_never_sync"]
    assert not ok
    assert lines[-1] == ("FAIL [2 ranks] sync on the last only: [0] reduce-scatters per step, "
                         "expected 3 (3 FSDP units, once per step): is the sync on again for "
                         "the last micro-batch?")
    ok, lines, _ = at_3["accum_sync_first"]
    assert not ok
    assert "PASS [2 ranks] sync on the last only: 3 reduce-scatters per step (3 FSDP units)" \
        in lines
    assert lines[-1].startswith("FAIL [2 ranks] sync on the last only: losses differ from one "
                                "process's on the global batch at step 2 by ")
    assert lines[-1].endswith(", after a first step that matched: the gradients of a step were "
                              "not those of the whole batch: is the one backward that syncs the "
                              "last one?")
    ok, lines, _ = at_3["accum_over_n"]
    assert not ok
    assert lines[-1].startswith("FAIL [3 ranks] sync every micro-batch: losses differ from one "
                                "process's on the global batch at step 1 by ")
    assert lines[-1].endswith(": 0.33x: is the loss divided by more than K? (FSDP's "
                              "reduce-scatter already averages over the ranks)")
    ok, lines, _ = at_3["meta_not_broadcast"]
    assert not ok
    assert lines[-1].startswith("FAIL [2 ranks] the launch failed: RuntimeError: ")
    assert lines[-1].endswith(": full_sd holds whole tensors, and only on rank 0: load it "
                              "with set_model_state_dict, its StateDictOptions saying both")


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
    assert res["world_size"] == NPROC and res["steps"] == 2 and res["micro_batches"] == 4
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

"""Chapter 06's exercise through its checker (`make exercise EX=06.1`): HSDP on a 2-D mesh keeps
one process's losses, its collectives stay within the mesh's rows and columns, and a gradient
corrupted on one rank stops every rank at that step, before the optimizer step and the save,
with a failed job; a guard that decides on each rank's own numbers is named; arguments and bad
input.

Budget of `make test`: two 2-rank launches at once (the solution and the wrong answer the exercise
is about), ~10 CPU-s each, most of it importing torch and transformers. `make test-nproc`: at 2
ranks a guard that stops with status 0, a sum for the mean, a verdict from the loss alone, a flat
mesh and an optimizer step before the stop (one launch each, all at once); at 4 ranks (a 2 x 2
mesh) the solution. The untouched starter's first TODO is tests/test_exercises.py's (no
launch). --help and bad input run in this process: argparse stops the scripts before setup().
Measured by hand (`--file`, 2 ranks): the guard below optimizer.step() fails with "weights hold a
NaN on ranks [1]: the optimizer stepped on the corrupted gradient".
"""
import pytest

from conftest import check_same_options, run_in_process
from distkit.course.exercise import check_at_once

GUARD = "ch06_capstone/{}/ex06_hsdp_guard.py"
# The wrong answer the exercise is about: each rank decides on its own gradient norm, which HSDP
# reduces within a shard group only, so the replica that holds an intact copy sees a finite norm.
LOCAL_VERDICT = ("return mean_loss, norm, not (math.isfinite(mean_loss) and math.isfinite(norm))",
                 "return mean_loss, norm, not torch.isfinite(grad_norm).item()")


# The shared loss and norm summed over the ranks, not averaged: every logged loss N x one process's
NO_MEAN = ("mean_loss, norm = (shared / N).tolist()", "mean_loss, norm = shared.tolist()")
# Stopped in time, but the scheduler is told all went well (teardown()'s status copied)
EXIT_0 = ("os._exit(3)", "os._exit(0)")
# The guard in place, but the optimizer steps before the exit (as a guard written at the end of
# the loop body does): the corrupted gradient reaches every weight of its shard group
STEP_THEN_STOP = ("report(step)", "optimizer.step()\nreport(step)")
# FSDP over all ranks, no replicas: a 1-D mesh
FLAT_MESH = ('mesh = init_device_mesh(env.device.type, (R, N // R), '
             'mesh_dim_names=("replicate", "shard"))',
             'mesh = init_device_mesh(env.device.type, (N,), mesh_dim_names=("shard",))')

# The verdict from the loss alone: the corrupted gradient's step goes through, the next loss is
# NaN (which the loss check once passed: instructor's review F1)
LOSS_ONLY = (LOCAL_VERDICT[0], "return mean_loss, norm, not math.isfinite(mean_loss)")


@pytest.fixture(scope="module")
def checks(tmp_path_factory):
    """make test: the solution and the rank-local verdict at 2 ranks (2 x 1)."""
    return check_at_once({"solution": ("06.1", None), "local_verdict": ("06.1", LOCAL_VERDICT)},
                         tmp_path_factory.mktemp("ch06_ex"))


@pytest.fixture(scope="module")
def more_wrong(tmp_path_factory):
    """make test-nproc: a status 0, a sum for a mean, a verdict from the loss alone, a flat mesh
    and an optimizer step before the stop, still at 2 ranks (a 2 x 1 mesh: none of them needs
    a second shard to show)."""
    return check_at_once({"exit_0": ("06.1", EXIT_0), "no_mean": ("06.1", NO_MEAN),
                          "loss_only": ("06.1", LOSS_ONLY), "flat_mesh": ("06.1", FLAT_MESH),
                          "step_then_stop": ("06.1", STEP_THEN_STOP)},
                         tmp_path_factory.mktemp("ch06_more_wrong"))


@pytest.fixture(scope="module")
def at_4(tmp_path_factory):
    """make test-nproc: the solution at 4 ranks (2 x 2), the first mesh whose shard groups have
    two ranks. (The wrong answers run at 2 ranks: the rank-local verdict in make test, the
    others in `more_wrong`; at 4 ranks each cost a 4-rank launch and showed the same.)"""
    return check_at_once({"solution": ("06.1", None)}, tmp_path_factory.mktemp("ch06_ex4"),
                         nprocs="largest")


@pytest.fixture(scope="module")
def runs(checks):
    ok, lines, launches = checks["solution"]
    assert ok, lines
    (_, res, out), = launches
    return res, out


def test_a_rank_local_verdict_is_named(checks):
    ok, lines, _ = checks["local_verdict"]
    assert not ok
    assert lines[-1] == ("FAIL [2 ranks] the guard's verdicts differ at step 4: ranks [1] would "
                         "stop, ranks [0] go on (a real job parts there): decide on values "
                         "every rank shares")


@pytest.mark.second_nproc
def test_a_stop_with_status_0_is_named(more_wrong):
    """The run stopped where it should, without saving, but exits 0: torchrun and Slurm call it
    a success (and a requeue-on-failure policy would not even see it)."""
    ok, lines, _ = more_wrong["exit_0"]
    assert not ok
    assert lines[-1] == ("FAIL [2 ranks] the launch ended with exit status 0 after the guard "
                         "stopped it: a scheduler would call the run a success; the ranks' "
                         "status is not 3")


@pytest.mark.second_nproc
def test_a_sum_for_the_mean_is_named(more_wrong):
    """The all-reduced loss not divided by N: the losses are exactly N x one process's, and the
    line says so (instructor review N12)."""
    ok, lines, _ = more_wrong["no_mean"]
    assert not ok
    assert lines[-1].endswith("2x: is the all-reduced loss divided by the N ranks?"), lines[-1]


@pytest.mark.second_nproc
def test_a_flat_mesh_and_a_step_before_the_stop_are_named(more_wrong):
    expected = {
        "flat_mesh": "FAIL [2 ranks] the mesh is 2 named ('shard',), not 2 x 1 named "
                     "('replicate', 'shard')",
        "step_then_stop": "FAIL [2 ranks] weights hold a NaN on ranks [1]: the optimizer "
                          "stepped on the corrupted gradient",
    }
    for name, line in expected.items():
        ok, lines, _ = more_wrong[name]
        assert not ok and lines[-1] == line, (name, lines)


@pytest.mark.second_nproc
def test_at_4_ranks_the_solution_passes(at_4):
    ok, lines, launches = at_4["solution"]
    assert ok, lines
    assert "PASS [4 ranks] rows = consecutive ranks: shard groups [[0, 1], [2, 3]]" in lines
    (_, res, _), = launches
    assert [r["groups"] for r in res["ranks"]] == [
        {"replicate": [0, 2], "shard": [0, 1]}, {"replicate": [1, 3], "shard": [0, 1]},
        {"replicate": [0, 2], "shard": [2, 3]}, {"replicate": [1, 3], "shard": [2, 3]}]
    assert [r["param_bytes_held"] for r in res["ranks"]] == [res["param_bytes"] // 2] * 4


# --- the solution at 2 ranks ------------------------------------------------------------------

def test_hsdp_mesh_placements_and_collectives(runs):
    """A 2 x 1 mesh: shard groups of one rank (nothing to gather: each holds whole parameters),
    one gradient all-reduce over both ranks: DDP, spelled as HSDP."""
    res, _ = runs
    assert res["world_size"] == 2 and res["mesh_shape"] == [2, 1]
    assert res["placements"] == ["('Replicate()', 'Shard(dim=0)')"]
    for r, rank in enumerate(res["ranks"]):
        assert rank["groups"] == {"replicate": [0, 1], "shard": [r]}
        assert rank["step1_collectives"] == [["all_reduce", [0, 1]]]
        assert rank["share_collectives"] == [["all_reduce", [0, 1]]]
        assert rank["param_bytes_held"] == res["param_bytes"] == 4 * 98_624  # tiny Llama, fp32


def test_losses_are_one_processes_until_the_stop(runs):
    res, _ = runs
    assert res["fault_step"] == 4 and res["fault_rank"] == 1
    assert len(res["losses"]) == len(res["single_losses"]) == 4  # steps 1-4: the 4th's forward
    assert max(abs(a - b) for a, b in zip(res["losses"], res["single_losses"])) \
        < res["tolerance"] == 1e-5
    assert res["losses"][-1] < res["losses"][0]  # it trains


def test_the_guard_stops_every_rank_at_the_corrupted_step(runs):
    res, out = runs
    assert res["verdicts"] == [[False, False]] * 3 + [[True, True]]
    assert [r["stopped_at"] for r in res["ranks"]] == [4, 4]
    assert [r["weights_finite"] for r in res["ranks"]] == [True, True]
    assert res["saved"] == [2]  # step 4 would have saved
    assert "gradient norm nan at step 4: stopped without saving" in out
    assert "rank 0 failed first (exit code 3)" in out or "rank 1 failed first (exit code 3)" in out


def test_solution_prints_its_steps(runs):
    """Rank 0's stdout in order; the guard's line is on its stderr (the launcher merges the two
    streams, not necessarily in order)."""
    res, out = runs
    lines = [ln for ln in out.splitlines() if not ln.startswith("run_w_torchrun.sh: ")]
    stop = [ln for ln in lines if ln.startswith("non-finite ")]
    assert stop == [f"non-finite loss {res['losses'][-1]} or gradient norm nan at step 4: "
                    "stopped without saving"]
    lines.remove(stop[0])
    assert lines[0] == ("2 ranks: HSDP on a 2 x 1 mesh (2 replica(s), each sharded over 1 "
                        "rank(s)); a gradient shard corrupted on rank 1 at step 4, checkpoints "
                        "every 2 steps")
    assert len(lines) == 4
    for step in (1, 2, 3):
        assert lines[step].startswith(f"step {step}  loss {res['losses'][step - 1]:.3f}  (one "
                                      f"process: {res['single_losses'][step - 1]:.3f})")


# --- arguments: --help, bad input (in this process: argparse exits before setup) ---------------

def test_starter_takes_the_solutions_arguments(monkeypatch, capsys):
    check_same_options(monkeypatch, capsys, GUARD)


@pytest.mark.parametrize("folder", ["solutions", "exercises"])
@pytest.mark.parametrize("args, message", [
    (["--replicate", "3"], "--replicate 3 must divide the 4 ranks, and --batch-size 8 be a "
                           "multiple of them"),
    (["--batch-size", "6"], "--replicate 2 must divide the 4 ranks, and --batch-size 6 be a "
                            "multiple of them"),
    (["--steps", "0"], "need --replicate, --steps, --batch-size, --save-every >= 1, --timeout > 0"),
    (["--fault-step", "7"], "need 0 <= --fault-step <= --steps and --fault-rank in -4..3"),
])
def test_bad_input(monkeypatch, capsys, folder, args, message):
    path = GUARD.format(folder)
    code, _, err = run_in_process(monkeypatch, capsys, path, *args, env={"WORLD_SIZE": "4"})
    lines = err.strip().splitlines()
    assert code == 2 and lines[0].startswith("usage:")
    assert lines[-1] == f"ex06_hsdp_guard.py: error: {message}"


@pytest.mark.second_nproc
def test_a_verdict_from_the_loss_alone_fails_on_its_nan_loss(more_wrong):
    ok, lines, _ = more_wrong["loss_only"]
    assert not ok
    assert lines[-1].startswith("FAIL [2 ranks] losses differ from one process's on the whole "
                                "batch at step 5 by nan"), lines[-1]
    assert lines[-1].endswith("not at step 4, where a gradient was corrupted: does the verdict "
                              "read the gradient norm, not only the loss?"), lines[-1]

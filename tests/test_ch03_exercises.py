"""Chapter 03's exercise through its checker (`make exercise EX=03.1`): the solution, copied over
its starter, passes; each wrong answer a learner plausibly writes fails with the line that points
at the mistake; arguments and bad input.

`make test`: one launch at 2 ranks, the sum reduce-scattered but not divided by N (AdamW hides it
in the losses and weights: the gradient check of step 1 does not). The notebook runs the
solution at 2 ranks (losses and weights = one process, weights identical on every rank, each
rank's AdamW state = one shard's 8 S + 4 bytes, asserted under nbval); tests/test_exercises.py
checks the untouched starter; --help and bad input run in this process (argparse stops the
scripts before setup()). `make test-nproc` (marker second_nproc): the solution (and the same
sync in torch's functional collectives) at 3 ranks, where N divides no dimension and the shards
are padded; the other wrong answers at 2 ranks, as none needs a third rank to be caught (among
them an all-reduce and a slice: the right numbers, DDP's sync; the checker counts each step's
collectives).
"""
import pytest

from conftest import check_same_options, run_in_process
from distkit.course.exercise import check_at_once, load_registry

EX = "ch03_zero/{}/ex03_zero1_by_hand.py"
NAME = "ex03_zero1_by_hand.py"
NPROC = 2


@pytest.fixture(scope="module")
def wrong(tmp_path_factory):
    """make test: the exercise's point missed, at 2 ranks."""
    return check_at_once({"no_mean": ("03.1", ("shard.grad /= N", None))},
                         tmp_path_factory.mktemp("ch03_wrong"))


@pytest.fixture(scope="module")
def checks(tmp_path_factory):
    """make test-nproc: the solution, and the same sync in other calls, at 3 ranks."""
    return check_at_once({
        "solution": ("03.1", None),
        # right, in torch's functional collectives: counted as the same reduce-scatter/all-gather
        "functional": ("03.1", [
            ("shard.grad = torch.empty_like(shard.detach())",
             "import torch.distributed._functional_collectives as funcol\n"
             "shard.grad = funcol.reduce_scatter_tensor(flat_grad, 'sum', 0, dist.group.WORLD)"
             ".wait()"),
            ("dist.reduce_scatter_single(shard.grad, flat_grad, op=dist.ReduceOp.SUM)", None),
            ("dist.all_gather_single(flat, shard.detach())",
             "flat = funcol.all_gather_tensor(shard.detach(), 0, dist.group.WORLD).wait()")]),
    }, tmp_path_factory.mktemp("ch03_ex"), nprocs="largest")


@pytest.fixture(scope="module")
def more_wrong(tmp_path_factory):
    """make test-nproc: the other wrong answers at 2 ranks (a rank's imports fewer a launch)."""
    return check_at_once({
        # the updated shards never reach the model: every step trains the initial weights
        "no_all_gather": ("03.1", ("dist.all_gather_single(flat, shard.detach())", None)),
        # AdamW over the whole model, not the shard: state for Psi values (and nothing to step)
        "whole_optimizer": ("03.1", ("optimizer = torch.optim.AdamW([shard], lr=args.lr)",
                                     "optimizer = torch.optim.AdamW(params, lr=args.lr)")),
        # DDP's sync, then a slice: the same numbers, but no reduce-scatter (the collectives say)
        "all_reduce_slice": ("03.1", [
            ("shard.grad = torch.empty_like(shard.detach())",
             "dist.all_reduce(flat_grad)\nshard.grad = flat_grad[lo:hi].clone()"),
            ("dist.reduce_scatter_single(shard.grad, flat_grad, op=dist.ReduceOp.SUM)", None)]),
    }, tmp_path_factory.mktemp("ch03_more_wrong"))


def test_the_sum_not_divided_is_named(wrong):
    ok, lines, runs = wrong["no_mean"]
    assert not ok
    assert lines[-1] == ("FAIL [2 ranks] this rank's slice of the gradient after step 1 is "
                         "2.00x one process's: is the reduce-scattered sum divided by N?")
    (_, res, _), = runs  # what it would pass: the losses, as AdamW divides the scale out
    assert res["max_loss_diff"] < res["tolerances"]["loss"]


@pytest.mark.second_nproc
def test_solution_passes(checks):
    ok, lines_of_solution, runs = checks["solution"]
    assert ok, lines_of_solution
    assert lines_of_solution[1:] == [
        "PASS [3 ranks] this rank's slice of the gradient after step 1 = one process's (< 1e-04 "
        "of the largest), on every rank",
        "PASS [3 ranks] each rank's AdamW state = 8 x S + 4 = 263,004 bytes (one process: "
        "789,076)",
        "PASS [3 ranks] losses = one process's at every step (< 1e-04)",
        "PASS [3 ranks] weights after the last step = one process's",
        "PASS [3 ranks] weights identical on every rank",
        "PASS [3 ranks] each step syncs with one reduce-scatter and one all-gather"]
    (_, res, _), = runs
    assert res["world_size"] == 3 and res["optimizer_tensors_held"] == 1
    ok, lines, _ = checks["functional"]  # the same sync in another API passes
    assert ok and lines[-1] == lines_of_solution[-1], lines
    # a learner's file from before the count: every number right, one FAIL line, no KeyError
    old = {k: v for k, v in res.items() if k != "step_collectives"}
    run = lambda *args: old  # noqa: E731 (the checker's launcher, answered from the result)
    run.nproc = 3
    *numbers, last = load_registry()["03.1"].checks(run)
    assert all(ok for ok, _, _ in numbers) and not last[0]
    assert last[2].startswith("this file does not count its collectives: copy the `with "
                              "CommDebugMode() as comm:` block")


@pytest.mark.second_nproc
def test_wrong_answers_are_named(more_wrong):
    ok, lines, _ = more_wrong["no_all_gather"]
    assert not ok
    assert lines[-1].startswith("FAIL [2 ranks] losses differ from one process's at step 2 by ")
    assert lines[-1].endswith("(tolerance 1e-04), after a first step that matched: the update "
                              "did not reach the model: is every updated shard all-gathered "
                              "back into the parameters?")
    ok, lines, _ = more_wrong["whole_optimizer"]
    assert not ok
    assert lines[-1] == ("FAIL [2 ranks] AdamW state per rank is [0, 0] bytes, not 8 x S + 4 "
                         "= 394,500: is the optimizer built over the shard alone?")
    ok, lines, _ = more_wrong["all_reduce_slice"]
    assert not ok
    assert lines[-2] == "PASS [2 ranks] weights identical on every rank"  # the same numbers
    assert lines[-1] == ("FAIL [2 ranks] step 1's collectives are {'all-reduce': 1, 'all-gather': "
                         "1}, not one reduce-scatter and one all-gather: an all-reduce of the "
                         "whole gradient, then a slice, is DDP's sync; ZeRO-1 reduce-scatters it "
                         "(dist.reduce_scatter_single)")


# --- arguments: --help, bad input (in this process: argparse exits before setup) ---------------

def test_starter_takes_the_solutions_arguments(monkeypatch, capsys):
    check_same_options(monkeypatch, capsys, EX)


@pytest.mark.parametrize("folder", ["solutions", "exercises"])
@pytest.mark.parametrize("args", [["--steps", "0"], ["--batch-size", "0"]])
def test_bad_input(monkeypatch, capsys, folder, args):
    code, _, err = run_in_process(monkeypatch, capsys, EX.format(folder), *args,
                                  env={"WORLD_SIZE": str(NPROC)})  # as torchrun would set it
    lines = err.strip().splitlines()
    assert code == 2 and lines[0].startswith("usage:")
    assert lines[-1] == f"{NAME}: error: need --steps >= 1 and --batch-size >= 1"

"""Chapter 05's exercise through its checker (`make exercise EX=05.1`): the solution, copied over
its starter, resumes bit-identically to the run that never stopped; each wrong answer a learner
plausibly writes (a forgotten LR schedule, epoch shuffle, skip or step count) is named, with the
step it shows at; arguments and bad input.

Budget of `make test`: one launch of the solution with its defaults (~10 CPU-s: every process
imports torch and transformers; both runs, the checkpoint and the checks are in one launch; the
assertions below pin 12 steps, the checkpoint after step 5) beside the checker's launch of a
wrong answer (the skip off by one: the run's first batch never read, which the resume check
alone cannot see). The checker on the solution at 3 ranks and on the other wrong answers at 2:
`make test-nproc`. The untouched starter's first TODO is
tests/test_exercises.py's. --help and bad input run in this process: argparse stops the scripts
before setup().
"""
import math

import pytest

from conftest import check_same_options, run_in_process, run_json
from distkit.course.exercise import check_at_once

RESUME = "ch05_checkpoint/{}/ex05_resume.py"
NPROC = 2


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """make test: {"solution": (json, stdout)}, the solution launched with its defaults, and
    {"no_set_epoch": (passed, lines, runs)}, the checker at 2 ranks on a wrong answer, side by
    side."""
    from concurrent.futures import ThreadPoolExecutor
    tmp = tmp_path_factory.mktemp("ch05_ex")
    with ThreadPoolExecutor(2) as pool:
        # "the next step is done + 1": every run skips its first batch, the resume and the
        # uninterrupted run alike (they agree bit for bit: 15 PASS before the plain-loop check)
        wrong = pool.submit(check_at_once, {"skip_off_by_one": (
            "05.1", ("epoch, skip = divmod(done, len(loader))",
                     "epoch, skip = divmod(done + 1, len(loader))"))}, tmp / "wrong")
        solution = run_json(tmp, NPROC, RESUME.format("solutions"))
        return {"solution": solution, **wrong.result()}


@pytest.fixture(scope="module")
def at_3(tmp_path_factory):
    """make test-nproc: the checker on the solution at 3 ranks (another N than make test's),
    and on the other wrong answers at 2 ranks, side by side: none of them is about N (4 steps
    per epoch at any world size), and a third rank importing torch and transformers cost each
    launch ~3 CPU-s more."""
    from concurrent.futures import ThreadPoolExecutor
    tmp = tmp_path_factory.mktemp("ch05_ex3")
    wrong = {
        # the scheduler restarts at the resume: the first step off is K + 2
        "no_schedule": ("05.1", ('self.scheduler.load_state_dict(state["scheduler"])', None)),
        # the steps done not put back: the resume starts again from step 1
        "no_step": ("05.1", ('self.step = state["step"]', None)),
        # the batches of the resumed epoch already trained on not skipped
        "no_skip": ("05.1", ("yield from itertools.islice(loader, skip, None)",
                             "yield from loader")),
        # the skip kept past the resumed epoch: the next epoch loses its first batch too
        # (R45's plant: caught once the resume crosses an epoch's start, step 9)
        "skip_kept": ("05.1", ("epoch, skip = epoch + 1, 0", "epoch, skip = epoch + 1, skip")),
        # the resumed epoch read in epoch 0's order: set_epoch forgotten
        "no_set_epoch": ("05.1", ("loader.sampler.set_epoch(epoch)\n"
                                  "yield from itertools.islice(loader, skip, None)",
                                  "pass\nyield from itertools.islice(loader, skip, None)")),
    }
    with ThreadPoolExecutor(2) as pool:
        solution = pool.submit(check_at_once, {"solution": ("05.1", None)}, tmp / "n3",
                               nprocs="largest")
        at_2 = pool.submit(check_at_once, wrong, tmp / "n2")
        return {**solution.result(), **at_2.result()}


def test_a_skip_off_by_one_is_named(runs):
    """The resume equals the uninterrupted run (both shifted); a plain loop over the epochs,
    the independent reference, does not. Planted without that check: every check passes."""
    ok, lines, _ = runs["skip_off_by_one"]
    assert not ok
    assert lines[-1] == (
        "FAIL [2 ranks] step 1 of the uninterrupted run reads another batch than a plain loop "
        "over the epochs (set_epoch, then every batch): every step read the next step's batch: "
        "batches_after(loader, 0) skips one (divmod(done, len(loader)), not done + 1)")


@pytest.mark.second_nproc
def test_a_forgotten_epoch_shuffle_is_named(at_3):
    ok, lines, _ = at_3["no_set_epoch"]
    assert not ok
    # the resume agrees with the uninterrupted run (both read every epoch alike): not a resume
    # check but the epochs' orders show it
    assert lines[-1] == ("FAIL [2 ranks] the uninterrupted run reads epoch 1 in epoch 0's "
                         "order: does batches_after() give each epoch its own shuffle "
                         "(set_epoch)?")


@pytest.mark.second_nproc
def test_at_3_ranks_the_solution_passes_and_wrong_answers_are_named(at_3):
    ok, lines, _ = at_3["solution"]
    assert ok, lines
    ok, lines, _ = at_3["no_schedule"]
    assert not ok
    assert lines[-1].startswith("FAIL [2 ranks] step 7 differs from the uninterrupted run in its "
                                "LR: step 7 ran at LR ")
    assert lines[-1].endswith("the LR schedule restarted (Progress must save and load the "
                              "scheduler's state)")
    ok, lines, _ = at_3["no_step"]
    assert not ok
    assert lines[-1] == ("FAIL [2 ranks] the resume trained steps [1, 2, 3, 4, 5, 6, 7, 8, 9, "
                         "10, 11, 12], not 6..12: Progress does not restore the steps done")
    ok, lines, _ = at_3["skip_kept"]
    assert not ok
    assert lines[-1].startswith("FAIL [2 ranks] step 9 differs from the uninterrupted run in its "
                                "batch"), lines
    ok, lines, _ = at_3["no_skip"]
    assert not ok
    assert lines[-1] == (
        "FAIL [2 ranks] step 6 differs from the uninterrupted run in its batch: step 6 read "
        "other sequences than the uninterrupted run: the batches already trained on were not "
        "skipped right (which epoch? which batch in it? that epoch's shuffle, set_epoch?)")


# --- the solution ---------------------------------------------------------------------------

def test_resume_is_bit_identical(runs):
    res, out = runs["solution"]
    assert res["world_size"] == NPROC and res["steps"] == 12 and res["save_at"] == 5
    assert res["global_batch"] == 16 and res["steps_per_epoch"] == 4  # 64 sequences
    k, s = res["save_at"], res["steps"]
    first, resumed = res["first"], res["resumed"]
    assert len(first["losses"]) == len(first["lrs"]) == s
    assert resumed["steps"] == list(range(k + 1, s + 1))
    # bit for bit: JSON keeps every float exactly, so == is the check
    assert resumed["losses"] == first["losses"][k:]
    assert resumed["lrs"] == first["lrs"][k:]
    for check in ("same_batch", "same_lr", "same_loss"):
        assert res[check] == [True] * (s - k), check
    assert res["loaded_equal"] is res["bit_identical"] is res["digest_equal"] is True
    assert res["problem"] is None
    assert res["plain_order"] == [True] * s and res["one_ahead"] is False
    assert len(res["digest"]) == 64
    assert first["losses"][-1] < first["losses"][0]  # it trains


def test_resume_prints_its_checks(runs):
    res, out = runs["solution"]
    lines = out.splitlines()
    assert lines[0] == ("first run: 12 steps of 16 sequences (2 processes x 8), 4 steps per "
                        "epoch; checkpoint after step 5")
    assert "loaded model + AdamW state == saved (sha256): True" in lines
    assert "resumed losses bit-identical: True" in lines
    assert "final model + AdamW state identical (sha256): True" in lines
    rows = [ln.split() for ln in lines if ln[:4].strip().isdigit()]
    assert [int(r[0]) for r in rows] == list(range(6, 13))
    assert [int(r[1]) for r in rows] == [(step - 1) // 4 for step in range(6, 13)]
    assert all(r[-4:] == ["|", "True", "True", "True"] for r in rows), rows
    assert "False" not in out and "Traceback" not in out


def test_resume_crosses_an_epoch_mid_way(runs):
    """The checkpoint falls inside an epoch and the resumed steps run into the next: a skip that
    forgets the epoch, the batch within it or its shuffle reads other sequences."""
    res, _ = runs["solution"]
    k, per_epoch = res["save_at"], res["steps_per_epoch"]
    assert k % per_epoch != 0 and k // per_epoch < (res["steps"] - 1) // per_epoch


def test_a_restarted_schedule_would_show(runs):
    """The LRs are the schedule's (warm-up, cosine), and a scheduler restarted at the resume
    would give step K+2 the LR of step 2. (Step K+1 would still be right: AdamW's param_groups,
    in the checkpoint, carry its LR; the restarted scheduler's first step() overwrites it.)"""
    res, _ = runs["solution"]
    s, warmup, lrs = res["steps"], res["warmup"], res["first"]["lrs"]
    want = [res["lr"] * min((i + 1) / warmup, 0.5 * (1 + math.cos(math.pi * i / s)))
            for i in range(s)]
    assert lrs == pytest.approx(want, rel=1e-12)
    k = res["save_at"]
    assert abs(lrs[k + 1] - lrs[1]) > 0.1 * lrs[k + 1]  # step K+2 vs step 2


# --- arguments: --help, bad input (in this process: argparse exits before setup) ---------------

def test_starter_takes_the_solutions_arguments(monkeypatch, capsys):
    check_same_options(monkeypatch, capsys, RESUME)


@pytest.mark.parametrize("folder", ["solutions", "exercises"])
@pytest.mark.parametrize("args, message", [
    (["--save-at", "12"], "need 1 <= --save-at < --steps"),
    (["--save-at", "0"], "need 1 <= --save-at < --steps"),
    (["--global-batch", "15"], "--global-batch must be a multiple of the 2 processes"),
    (["--samples", "8"], "need --samples >= --global-batch (at least one step per epoch)"),
])
def test_bad_input(monkeypatch, capsys, folder, args, message):
    path = RESUME.format(folder)
    code, _, err = run_in_process(monkeypatch, capsys, path, *args,
                                  env={"WORLD_SIZE": str(NPROC)})  # as torchrun would set it
    lines = err.strip().splitlines()
    assert code == 2 and lines[0].startswith("usage:")
    assert lines[-1] == f"{path.split('/')[-1]}: error: {message}"

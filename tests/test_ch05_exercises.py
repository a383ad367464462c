"""Chapter 05's exercise: the solution's resume is bit-identical to the run that never stopped,
and the starter stops at its TODOs.

Budget: 15 s on 2 cores, where every process that imports torch and transformers costs ~4.5 s
of CPU before it does anything. So the two processes of one launch of the solution (both runs,
the checkpoint and the checks are in it) and the starter, as one plain-Python process of a
one-process group (the same code path up to its first TODO, without a launch), start at once.
--help and bad input run in this process: argparse stops the scripts before setup().
A forgotten LR schedule or skip is not launched here (one more launch is ~6 s): the solution's
own checks catch them (measured by hand), and test_a_restarted_schedule_would_show pins the
defaults that make a forgotten schedule visible.
"""
import math
from concurrent.futures import ThreadPoolExecutor

import pytest

from conftest import check_same_options, check_starter, run_in_process, run_json, run_scripts_at_once

RESUME = "ch05_checkpoint/{}/ex05_resume.py"
NPROC = 2
ONE_PROCESS = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "localhost"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{"solution": (json, stdout), "starter": (status, stdout, stderr)}"""
    tmp = tmp_path_factory.mktemp("ch05_ex")
    with ThreadPoolExecutor() as pool:  # threads only wait for the subprocesses
        solution = pool.submit(run_json, tmp, NPROC, RESUME.format("solutions"))
        starter = pool.submit(run_scripts_at_once,
                              {"starter": (RESUME.format("exercises"), [], ONE_PROCESS)})
        return {"solution": solution.result(), "starter": starter.result()["starter"]}


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


# --- the starter ------------------------------------------------------------------------------

def test_starter_stops_at_its_first_todo(runs):
    """As a learner's first run goes: one line on stderr, exit status 1, nothing trained."""
    status, out, err = runs["starter"]
    assert status == 1, err
    assert len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"TODO(you) at code/{RESUME.format('exercises')}:")
    assert err.strip().endswith("batches_after(): the batches of the steps after `done` "
                                "(skip those trained on)")
    assert out == "" and "Traceback" not in err


def test_starter_marks_every_todo():
    check_starter("ch05_checkpoint", "ex05_resume.py", 3)


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

"""Chapter 01's exercises through their checker (`make exercise EX=01.1`, `01.2`): each solution,
copied over its starter, passes; each wrong answer a learner plausibly writes fails with the line
that points at the mistake; a starter launched stops at its first TODO on every rank; arguments
and bad input.

Budget of `make test`: exercise 1's checker at 2 ranks on the solution (both modes: two
launches, and train_single.py once as its reference) and on the answer without the division by
N (one launch: it fails at its first check of gradients), side by side, and the starter's launch;
every 2-rank launch costs ~10 CPU-s (each rank imports torch and transformers). The notebook
runs exercise 2's solution (with --times) and asserts its counts, bytes, parity and timeline
order under nbval. `make test-nproc`: both checkers at 3 ranks on the solutions, and the other
wrong answers at 2 ranks (none needs a third to be caught). --help and bad input run in this
process (argparse stops the scripts before setup()).
"""
import pytest

from conftest import CODE, check_stopped_at_todo, run_in_process, run_launcher
from distkit.course.exercise import check_at_once

EXERCISES = ["ex01_manual_ddp.py", "ex01_overlap.py"]


@pytest.fixture(scope="module")
def checks(tmp_path_factory):
    """make test: exercise 1's solution at 2 ranks (the notebook does not run it), and the
    exercise's point missed: the summed gradients, not divided by N (AdamW hides it in the
    losses: m / sqrt(v) does not change when every gradient is N times larger)."""
    return check_at_once({
        "manual": ("01.1", None),
        "manual_no_mean": ("01.1", ("g /= env.world_size", "pass")),
    }, tmp_path_factory.mktemp("ch01_ex"))


@pytest.fixture(scope="module")
def starter():
    """A starter launched like a learner's (its own fixture: `make stress` repeats only this)."""
    return run_launcher(2, "ch01_ddp/exercises/ex01_overlap.py", "--modes", "per-param",
                        "--steps", 2, timeout=600)


@pytest.fixture(scope="module")
def at_3(tmp_path_factory):
    """make test-nproc: both solutions at 3 ranks, their second configuration (a hard-coded 2
    or a world-group shortcut fails there). No wrong answer here needs a third rank to be
    caught: they run at 2 ranks (more_wrong), where a launch costs a rank's imports less."""
    return check_at_once({
        "manual": ("01.1", None),
        "overlap": ("01.2", None),
    }, tmp_path_factory.mktemp("ch01_ex3"), nprocs="largest")


@pytest.fixture(scope="module")
def more_wrong(tmp_path_factory):
    """make test-nproc: the other wrong answers, at 2 ranks, all at once: the broadcast from
    every rank waits for the checker's 30 s timeout while the others use the CPU."""
    return check_at_once({
        # every rank keeps the weights of its own seed
        "manual_no_broadcast": ("01.1", ("dist.broadcast(p.detach(), src=0)", "pass")),
        # --flat: the summed flat tensor never copied back into the gradients
        "manual_flat_not_copied": ("01.1", ("g.copy_(synced.view_as(g))", "pass")),
        # per-param steps with the sum: AdamW hides it in the losses, not in the gradients
        "overlap_no_mean": ("01.2", ("p.grad /= N", "pass")),
        # bucketed: the count of gradients still to come not reset: no bucket after step 1
        "overlap_missing_not_reset": ("01.2", (
            "self.missing = [len(bucket) for bucket in self.buckets]", "pass")),
        # every rank thinks it is the root: all send, none receives (gloo's timeout, at the
        # checker's 30 s)
        "manual_src_rank": ("01.1", ("dist.broadcast(p.detach(), src=0)",
                                     "dist.broadcast(p.detach(), src=env.rank)")),
        # per-param: the gradients divided while their async all_reduces still run (a race
        # that once failed only on a loaded machine; the last rank's late backward on step 1
        # makes it certain)
        "overlap_no_wait": ("01.2", ("work.wait()\np.grad /= N", "p.grad /= N")),
    }, tmp_path_factory.mktemp("ch01_more_wrong"))


@pytest.mark.second_nproc
def test_broadcast_from_every_rank_is_named_at_the_short_timeout(more_wrong):
    """Every rank broadcasts as the root: once a 60 s gloo timeout with no hint (instructor's
    review); now 30 s (COURSE_TIMEOUT_S from the exercise's entry) and a hint."""
    ok, lines, runs = more_wrong["manual_src_rank"]
    assert not ok
    assert lines[-1].startswith("FAIL [2 ranks] the launch failed: RuntimeError: ")
    assert "Timed out waiting 30000ms" in lines[-1], lines[-1]
    assert "/ch01_ddp/exercises/ex01_manual_ddp.py:" in lines[-1]
    assert lines[-1].endswith("a broadcast with the same src on every rank (src=0: rank 0 "
                              "sends, the others receive)"), lines[-1]


@pytest.mark.second_nproc
def test_dividing_before_the_wait_is_named(more_wrong):
    ok, lines, _ = more_wrong["overlap_no_wait"]
    assert not ok
    assert lines[-1] == ("FAIL [2 ranks] per-param: finish() returned at step 1 while an "
                         "all_reduce was still running: does it wait() on every Work before "
                         "dividing? An async all_reduce writes the sum into the gradient later")


def test_manual_ddp_passes(checks):
    """One all_reduce per parameter tensor (21), or one of them all flattened (--flat); the
    ranks start different (their own seeds) and are made identical by the broadcast."""
    ok, lines, runs = checks["manual"]
    assert ok, lines
    assert "PASS [2 ranks] per tensor: 21 all_reduce call(s) per step" in lines
    assert "PASS [2 ranks] --flat: 1 all_reduce call(s) per step" in lines
    for _, res, out in runs:
        assert len(res["losses"]) == 8  # 64 sequences / 16 per step x 2 epochs
        assert res["identical"] == {"start": False, "broadcast": True, "end": True}
        assert f"all_reduce calls per step: {res['calls_per_step']}" in out


def test_manual_ddp_without_the_division_is_named(checks):
    """The missing / N passes every loss check (AdamW), not the gradient check of step 1."""
    ok, lines, runs = checks["manual_no_mean"]
    assert not ok
    assert lines[-1] == ("FAIL [2 ranks] per tensor: the gradients after step 1 are 2.00x one "
                         "process's: did you divide by the world size?")
    (_, res, _), = runs
    # what the mistake would pass: every loss within the tolerance of the solution's
    (_, solution, _), _ = checks["manual"][2]
    assert max(abs(x - y) for x, y in zip(res["losses"], solution["losses"])) < 1e-4


@pytest.mark.second_nproc
def test_at_3_ranks_solutions_pass(at_3):
    for name in ("manual", "overlap"):
        ok, lines, _ = at_3[name]
        assert ok, lines
    ok, lines, _ = at_3["overlap"]
    for mode, calls in (("flat", 1), ("per-param", 21), ("bucketed", 3)):
        assert f"PASS [3 ranks] {mode}: {calls} all_reduce(s) per step" in lines


@pytest.mark.second_nproc
def test_other_wrong_answers_are_named(more_wrong):
    ok, lines, _ = more_wrong["manual_no_broadcast"]
    assert not ok
    assert lines[-1] == ("FAIL [2 ranks] per tensor: after the broadcast the ranks' weights or "
                         "buffers still differ")
    ok, lines, _ = more_wrong["manual_flat_not_copied"]
    assert not ok
    assert lines[-1].startswith("FAIL [2 ranks] --flat: the gradients after step 1 are ")
    assert lines[-1].endswith("(of the largest) away from one process's: is every gradient "
                              "summed over the ranks (and copied back)?")
    ok, lines, _ = more_wrong["overlap_no_mean"]
    assert not ok
    assert lines[-1].startswith("FAIL [2 ranks] per-param: gradients differ from one process's by")
    assert lines[-1].endswith(": 2.00x one process's: are the summed gradients divided by N?")
    ok, lines, _ = more_wrong["overlap_missing_not_reset"]  # the script's own check, its line
    assert not ok
    solution = (CODE / "ch01_ddp/solutions/ex01_overlap.py").read_text().splitlines()
    line = next(i for i, text in enumerate(solution, 1) if "was never launched" in text)
    assert lines[-1].startswith("FAIL [2 ranks] the launch failed: AssertionError: a bucket's "
                                "all_reduce was never launched (at ")
    assert lines[-1].endswith(f"/ch01_ddp/exercises/ex01_overlap.py:{line})")


def test_starter_stops_at_its_first_todo(starter):
    """Launched like a learner would: the given flat mode is skipped, per-param stops at once,
    every rank at the same line (todo() waits for the others before it exits)."""
    check_stopped_at_todo(starter, 2, "code/ch01_ddp/exercises/ex01_overlap.py",
                          "per-param: register self._ready")


# --- arguments: --help, bad input (in this process: argparse exits before setup) ---------------

@pytest.mark.parametrize("name", EXERCISES)
def test_starter_takes_the_solutions_arguments(monkeypatch, capsys, name):
    helps = []
    for folder in ("exercises", "solutions"):
        code, out, _ = run_in_process(monkeypatch, capsys, f"ch01_ddp/{folder}/{name}", "--help")
        assert code == 0 and "--json" in out
        helps.append(out[out.index("options:"):])  # after the usage and the description
    assert helps[0] == helps[1]


@pytest.mark.parametrize("folder", ["solutions", "exercises"])
@pytest.mark.parametrize("name, args, message", [
    ("ex01_overlap.py", ["--bucket-mb", "0"], "--bucket-mb > 0"),
    ("ex01_overlap.py", ["--steps", "1"], "--steps >= 2"),
    ("ex01_overlap.py", ["--modes", "flat,ring"], "--modes: unknown ring"),
    ("ex01_manual_ddp.py", ["--batch-size", "0"], "must be positive"),
    ("ex01_manual_ddp.py", ["--samples", "4"], "--samples >="),
])
def test_bad_input(monkeypatch, capsys, folder, name, args, message):
    monkeypatch.setenv("WORLD_SIZE", "2")  # as torchrun would set it
    code, _, err = run_in_process(monkeypatch, capsys, f"ch01_ddp/{folder}/{name}", *args)
    assert code == 2 and message in err
    lines = err.strip().splitlines()
    assert lines[0].startswith("usage:") and lines[-1].startswith(f"{name}: error:")

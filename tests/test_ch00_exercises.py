"""Chapter 00's exercises through their checker (`make exercise EX=00.1` ... `00.3`) at 3 ranks: each
solution, copied over its starter, passes; a wrong answer fails with the line that names it.

In `make test-nproc` (marker second_nproc), not `make test`: the notebook already runs both
solutions (4 and 2 processes) and tests/test_ch00_scripts.py runs each starter to its first TODO;
tests/test_exercises.py checks the untouched starters. Six 3-rank launches at once, ~55 CPU-s.
"""
import pytest

from distkit.course.exercise import check_at_once

pytestmark = pytest.mark.second_nproc


@pytest.fixture(scope="module")
def checks(tmp_path_factory):
    return check_at_once({
        "naive": ("00.1", None),
        "naive_no_sum": ("00.1", ("total += buf", None)),  # rank 0 drops what it receives
        "mean": ("00.2", None),
        "mean_of_means": ("00.2", ("exact = (stats[0] / stats[1]).item()",
                                   "exact = mean_of_means.item()")),
        "halves": ("00.3", None),
        "halves_padding_kept": ("00.3", ("total = gathered[:args.numel]", "total = gathered")),
    }, tmp_path_factory.mktemp("ch00_ex"), nprocs="largest")


def test_naive_allreduce_passes(checks):
    ok, lines, runs = checks["naive"]
    assert ok, lines
    (_, res, _), = runs
    s = res["bytes"]
    assert s == 1024 * 4 and res["received"] == [2 * s, s, s] and res["sent"] == [2 * s, s, s]
    assert lines[-1] == f"PASS [3 ranks] bytes sent per rank = [{2 * s}, {s}, {s}] ((N-1) S on " \
                        "rank 0, S elsewhere)"


def test_naive_allreduce_without_the_sum_is_named(checks):
    ok, lines, _ = checks["naive_no_sum"]
    assert not ok
    assert lines[-1].startswith("FAIL [3 ranks] the launch failed: AssertionError: Tensor-likes "
                                "are not close!")


def test_global_mean_passes(checks):
    ok, lines, runs = checks["mean"]
    assert ok, lines
    (_, res, _), = runs
    assert abs(res["exact"] - res["reference"]) < 1e-12


def test_mean_of_means_is_named(checks):
    ok, lines, _ = checks["mean_of_means"]
    assert not ok
    assert lines[-1].startswith("FAIL [3 ranks] exact differs from the one-process mean by ")


def test_allreduce_from_halves_passes(checks):
    ok, lines, runs = checks["halves"]
    assert ok, lines
    (_, res, _), = runs
    assert (res["shard"], res["padding"]) == (334, 1) and res["ring_bytes_per_half"] == 2 * 334 * 4
    assert all(c == {"slice": True, "equal": True} for c in res["checks"])


def test_allreduce_with_the_padding_left_on_is_named(checks):
    ok, lines, _ = checks["halves_padding_kept"]
    assert not ok
    assert lines[-1].startswith("FAIL [3 ranks] the result differs from dist.all_reduce's")

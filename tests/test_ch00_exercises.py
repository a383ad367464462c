"""Chapter 00's exercises through their checker (`make exercise EX=00.1`, `00.2`): each solution,
copied over its starter, passes; a wrong answer fails with the line that names it.

The notebook runs both solutions (4 and 2 processes) and tests/test_ch00_scripts.py runs each
starter to its first TODO and checks --help. Budget: four 2-rank launches at once, ~8 CPU-s each
(these scripts import torch only).
"""
import pytest

from distkit.exercise import check_at_once


@pytest.fixture(scope="module")
def checks(tmp_path_factory):
    return check_at_once({
        "naive": ("00.1", None),
        "naive_no_sum": ("00.1", ("total += buf", None)),  # rank 0 drops what it receives
        "mean": ("00.2", None),
        "mean_of_means": ("00.2", ("exact = (stats[0] / stats[1]).item()",
                                   "exact = mean_of_means.item()")),
    }, tmp_path_factory.mktemp("ch00_ex"))


def test_naive_allreduce_passes(checks):
    ok, lines, runs = checks["naive"]
    assert ok, lines
    (_, res, _), = runs
    s = res["bytes"]
    assert s == 1024 * 4 and res["received"] == [s, s] and res["sent"] == [s, s]
    assert lines[-1] == f"PASS [2 ranks] bytes sent per rank = [{s}, {s}] ((N-1) S on rank 0, " \
                        "S elsewhere)"


def test_naive_allreduce_without_the_sum_is_named(checks):
    ok, lines, _ = checks["naive_no_sum"]
    assert not ok
    assert lines[-1].startswith("FAIL [2 ranks] the launch failed: AssertionError: Tensor-likes "
                                "are not close!")


def test_global_mean_passes(checks):
    ok, lines, runs = checks["mean"]
    assert ok, lines
    (_, res, _), = runs
    assert abs(res["exact"] - res["reference"]) < 1e-12


def test_mean_of_means_is_named(checks):
    ok, lines, _ = checks["mean_of_means"]
    assert not ok
    assert lines[-1].startswith("FAIL [2 ranks] exact differs from the one-process mean by ")

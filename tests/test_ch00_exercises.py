"""Chapter 00's exercises through their checker (`make exercise EX=00.1` ... `00.3`): each solution,
copied over its starter, passes; each wrong answer a learner plausibly writes fails with the line
that points at the mistake.

`make test`: each exercise's headline wrong answer and a launch error's line at 2 ranks, launched
side by side (each launch imports torch only: ~4 CPU-s for 2 ranks); 00.3's is an all-reduce and
a slice, every number right, caught by the count of its collectives. `make test-nproc` (marker
second_nproc): the six other wrong answers at 2 ranks, the solutions at 3 ranks.
tests/test_ch00_scripts.py runs each starter to its first TODO; tests/test_exercises.py checks
the untouched starters.
"""
import pytest

from conftest import CODE
from distkit.course.exercise import check_at_once

S = 1024 * 4  # 00.1's tensor, in bytes (--numel 1024 float32)


@pytest.fixture(scope="module")
def wrong(tmp_path_factory):
    """make test: each exercise's headline wrong answer at 2 ranks, and an error's line."""
    return check_at_once({
        # 00.1: rank 0 drops what it receives
        "naive_no_sum": ("00.1", ("total += buf", None)),
        # 00.2: (b) computed as (a)
        "mean_of_means": ("00.2", ("exact = (stats[0] / stats[1]).item()",
                                   "exact = mean_of_means.item()")),
        # a name never defined: the launch fails, and the line names where
        "mean_name_error": ("00.2", ("exact = (stats[0] / stats[1]).item()",
                                     "exact = (stats[0] / count).item()")),
        # 00.3: DDP's sync, an all-reduce and a slice: every number right, not the two halves
        "halves_allreduce_slice": ("00.3", ("dist.reduce_scatter_single(mine, padded)",
                                            "dist.all_reduce(padded)\n"
                                            "mine = padded[rank * shard:(rank + 1) * shard]")),
    }, tmp_path_factory.mktemp("ch00_wrong"))


@pytest.fixture(scope="module")
def more_wrong(tmp_path_factory):
    """make test-nproc: the other wrong answers, still at 2 ranks."""
    return check_at_once({
        # 00.1: rank 0 does not count what it sends / the others receive the sum into x
        "naive_sends_uncounted": ("00.1", ("        sent += size", None)),
        "naive_recv_into_x": ("00.1", ("dist.recv(total, src=0)", "dist.recv(x, src=0)")),
        # 00.2: (a) summed but not divided by N
        "means_not_divided": ("00.2", ("mean_of_means /= env.world_size", None)),
        # 00.3: the ceiling off by one where N divides numel
        "halves_off_by_one": ("00.3", ("shard = -(-args.numel // n)",
                                       "shard = args.numel // n + 1")),
        # 00.3: rounded down / padding left on
        "halves_floor": ("00.3", ("shard = -(-args.numel // n)", "shard = args.numel // n")),
        "halves_padding_kept": ("00.3", ("total = gathered[:args.numel]", "total = gathered")),
    }, tmp_path_factory.mktemp("ch00_more_wrong"))


@pytest.fixture(scope="module")
def at_3(tmp_path_factory):
    """make test-nproc: the solutions at 3 ranks."""
    return check_at_once({"naive": ("00.1", None), "mean": ("00.2", None),
                          "halves": ("00.3", None),
                          # ranks 1..N-1 receive before they send, as rank 0 does: a deadlock,
                          # ended by gloo's timeout (the checker's 20 s of waiting, little CPU)
                          "naive_recv_first": ("00.1", [
                              ("dist.send(x, dst=0)", "dist.recv(total, src=0)"),
                              ("dist.recv(total, src=0)  # overwrites total with the sum",
                               "dist.send(x, dst=0)")])},
                         tmp_path_factory.mktemp("ch00_ex"), nprocs="largest")


def failed(wrong, name):
    ok, lines, _ = wrong[name]
    assert not ok, lines
    return lines[-1]


# --- 00.1: all-reduce through rank 0 ------------------------------------------------------------

def test_naive_without_the_sum_is_named(wrong):
    assert failed(wrong, "naive_no_sum") == (
        "FAIL [2 ranks] the result differs from dist.all_reduce's on ranks [0, 1]: rank 0 must "
        "add up all N tensors and send that sum to every other rank, which receives it into "
        "total")


@pytest.mark.second_nproc
def test_naive_sum_received_elsewhere_is_named(more_wrong):
    assert failed(more_wrong, "naive_recv_into_x") == (
        "FAIL [2 ranks] the result differs from dist.all_reduce's on ranks [1]: rank 0 must "
        "add up all N tensors and send that sum to every other rank, which receives it into "
        "total")


@pytest.mark.second_nproc
def test_naive_uncounted_sends_are_named(more_wrong):
    assert failed(more_wrong, "naive_sends_uncounted") == (
        f"FAIL [2 ranks] bytes sent per rank are [0, {S}], expected [{S}, {S}]: count S = "
        f"{S:,} bytes for every tensor a rank sends or receives")


# --- 00.2: the exact global mean --------------------------------------------------------------

def test_mean_of_means_is_named(wrong):
    line = failed(wrong, "mean_of_means")
    assert line.startswith("FAIL [2 ranks] exact differs from the one-process mean by ")
    assert line.endswith(": it is the mean of the ranks' means, which weighs ranks, not "
                         "samples: all_reduce every rank's sum and count, then divide")


@pytest.mark.second_nproc
def test_means_not_divided_is_named(more_wrong):
    line = failed(more_wrong, "means_not_divided")
    assert line.startswith("FAIL [2 ranks] mean_of_means = ")
    assert line.endswith("2x the average of the ranks' means: is the sum divided by N?")


def test_an_error_in_the_learners_file_names_its_line(wrong):
    solution = (CODE / "ch00_collectives/solutions/ex00_global_mean.py").read_text()
    line = solution.splitlines().index("exact = (stats[0] / stats[1]).item()") + 1
    assert failed(wrong, "mean_name_error").startswith(
        "FAIL [2 ranks] the launch failed: NameError: name 'count' is not defined")
    assert failed(wrong, "mean_name_error").endswith(
        f"/ch00_collectives/exercises/ex00_global_mean.py:{line})")


# --- 00.3: all-reduce from its halves --------------------------------------------------------

@pytest.mark.second_nproc
def test_halves_off_by_one_is_named(more_wrong):
    """The ceiling written as numel // N + 1 is right unless N divides numel (1002 here)."""
    assert failed(more_wrong, "halves_off_by_one") == (
        "FAIL [2 ranks] numel 1002: shard is 502 elements and padding 2: the fewest elements "
        "per rank that hold 1002 between 2 ranks is 501 (rounded up, not down + 1)")


def test_halves_as_an_all_reduce_and_a_slice_is_named(wrong):
    """Every number is right (instructor's review F3: 13 PASS before the count); the count of
    the collectives inside the CommDebugMode block is not. Planted without that check: passes."""
    ok, lines, _ = wrong["halves_allreduce_slice"]
    assert "PASS [2 ranks] numel 1002: the result = dist.all_reduce's, on every rank" in lines
    assert failed(wrong, "halves_allreduce_slice") == (
        "FAIL [2 ranks] numel 1002: the collectives are {'all-reduce': 1, 'all-gather': 1}, not "
        "one reduce-scatter and one all-gather: an all-reduce, then a slice, gives the same "
        "numbers but is not the two halves; reduce-scatter it (dist.reduce_scatter_single)")


@pytest.mark.second_nproc
def test_halves_rounded_down_is_named(more_wrong):
    ok, lines, _ = more_wrong["halves_floor"]
    assert not ok
    assert "PASS [2 ranks] numel 1002: shard = ceil(1002 / 2) = 501 elements, padding 0" in lines
    assert lines[-1].startswith("FAIL [2 ranks] numel 1001: the launch failed: RuntimeError: "
                                "The expanded size of the tensor (1000) must match")
    assert lines[-1].endswith(": shard x N must hold all 1001 elements (round up)")


@pytest.mark.second_nproc
def test_halves_with_the_padding_left_on_is_named(more_wrong):
    assert failed(more_wrong, "halves_padding_kept") == (
        "FAIL [2 ranks] numel 1001: the result differs from dist.all_reduce's (its size, or its "
        "values): is the padding cut off?")


# --- the solutions at 3 ranks ---------------------------------------------------------------

@pytest.mark.second_nproc
def test_naive_allreduce_passes(at_3):
    ok, lines, runs = at_3["naive"]
    assert ok, lines
    (_, res, _), = runs
    assert res["bytes"] == S and res["received"] == [2 * S, S, S] and res["sent"] == [2 * S, S, S]
    assert lines[-1] == f"PASS [3 ranks] bytes sent per rank = [{2 * S}, {S}, {S}] ((N-1) S on " \
                        "rank 0, S elsewhere)"


@pytest.mark.second_nproc
def test_naive_sends_and_recvs_out_of_order_are_named(at_3):
    """Every rank waits in a recv: the launch fails at gloo's timeout, with the hint (and the
    line of whichever rank's recv timed out first)."""
    ok, lines, _ = at_3["naive_recv_first"]
    assert not ok
    assert lines[-1].startswith("FAIL [3 ranks] the launch failed: RuntimeError: ")
    assert "Timed out waiting" in lines[-1]
    assert "/ch00_collectives/exercises/ex00_naive_allreduce.py:" in lines[-1]
    assert lines[-1].endswith("): a rank waited for a tensor no rank sent: does each recv meet "
                              "its send, in the same order on both sides?")


@pytest.mark.second_nproc
def test_global_mean_passes(at_3):
    ok, lines, runs = at_3["mean"]
    assert ok, lines
    (_, res, _), = runs
    assert abs(res["exact"] - res["reference"]) < 1e-12


@pytest.mark.second_nproc
def test_allreduce_from_halves_passes(at_3):
    ok, lines, runs = at_3["halves"]
    assert ok, lines
    (_, divides, _), (_, res, _) = runs
    assert (divides["shard"], divides["padding"]) == (334, 0)
    assert (res["shard"], res["padding"]) == (334, 1) and res["ring_bytes_per_half"] == 2 * 334 * 4
    assert all(c == {"slice": True, "equal": True} for c in res["checks"])

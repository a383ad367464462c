"""Chapter 02's exercises through their checker (`make exercise EX=02.1`, `02.2`) at their largest
world size (GPipe: 3 stages of 1 layer; the Megatron MLP: 4 ranks): each solution, copied over
its starter, passes; a wrong answer fails with the line that names it.

In `make test-nproc` (marker second_nproc), not `make test`: tests/test_ch02_pipeline.py and
test_ch02_tensor_parallel.py run both solutions at 2 ranks, their starters' first TODO and their
arguments. Four launches at once and naive_split.py twice as the one-process reference.
"""
import pytest

from distkit.course.exercise import check_at_once

pytestmark = pytest.mark.second_nproc


@pytest.fixture(scope="module")
def checks(tmp_path_factory):
    return check_at_once({
        "gpipe": ("02.1", None),
        # each micro-batch's whole mean loss: the gradients m times too large, the logged sum too
        "gpipe_no_scale": ("02.1", ("out = lm_loss(out, micro[i]) / m",
                                    "out = lm_loss(out, micro[i])")),
        "megatron": ("02.2", None),
        "megatron_no_f": ("02.2", ("return all_reduce(grad.clone())", "return grad")),
    }, tmp_path_factory.mktemp("ch02_ex"), nprocs="largest")


def test_gpipe_passes(checks):
    ok, lines, _ = checks["gpipe"]
    assert ok, lines
    assert lines[1] == "PASS [3 ranks] losses = naive_split.py's on one process at every step " \
                       "(< 1e-04)"


def test_gpipe_without_the_scale_is_named(checks):
    ok, lines, _ = checks["gpipe_no_scale"]
    assert not ok
    assert lines[-1].startswith("FAIL [3 ranks] losses differ from naive_split.py's on one "
                                "process at step 1 by ")


def test_megatron_passes(checks):
    ok, lines, _ = checks["megatron"]
    assert ok, lines
    assert len(lines) == 1 + 2 + 8  # no TODO left, the two counts, 4 errors x 2 versions


def test_megatron_without_f_is_named(checks):
    ok, lines, _ = checks["megatron_no_f"]
    assert not ok
    assert lines[-1] == ("FAIL [4 ranks] backward: 0 all_reduce(s) of 0 B in all; Megatron's "
                         "MLP makes 1 of 65536 B")

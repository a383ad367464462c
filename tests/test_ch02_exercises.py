"""Chapter 02's exercises through their checker (`make exercise EX=02.1`, `02.2`): each solution,
copied over its starter, passes; each wrong answer a learner plausibly writes fails with the line
that points at the mistake.

`make test`: two wrong answers at 2 ranks, side by side (two launches and naive_split.py once as
the one-process reference). `make test-nproc` (marker second_nproc): the solutions at the largest
world size (GPipe: 3 stages of 1 layer, a middle stage; the Megatron MLP: 4 ranks), and the recv
from the wrong stage, whose point needs a middle stage; the other wrong answers at 2 ranks.
tests/test_ch02_pipeline.py and test_ch02_tensor_parallel.py run both solutions at 2 ranks, their
starters' first TODO and their arguments.
"""
import re

import pytest

from distkit.course.exercise import check_at_once


@pytest.fixture(scope="module")
def wrong(tmp_path_factory):
    """make test: a wrong answer to each exercise at 2 ranks."""
    return check_at_once({
        # each micro-batch's whole mean loss: the gradients m times too large, the logged sum too
        "gpipe_no_scale": ("02.1", ("out = lm_loss(out, micro[i]) / m",
                                    "out = lm_loss(out, micro[i])")),
        # g's backward all-reduces too: every gradient below the MLP N times too large
        "megatron_g_backward": ("02.2", ("return grad", "return all_reduce(grad.clone())")),
    }, tmp_path_factory.mktemp("ch02_wrong"))


@pytest.fixture(scope="module")
def checks(tmp_path_factory):
    """make test-nproc: the solutions, and the recv from the wrong stage (a middle stage waits
    for a tensor no stage sends), at the largest world size."""
    return check_at_once({
        "gpipe": ("02.1", None),
        # the output gradient received from the previous stage, not the next: every stage
        # waits (gloo's timeout: the checker's 20 s of wall time, little CPU)
        "gpipe_wrong_peer": ("02.1", ("dist.recv(grad, src=env.rank + 1)",
                                      "dist.recv(grad, src=env.rank - 1)")),
        "megatron": ("02.2", None),
    }, tmp_path_factory.mktemp("ch02_ex"), nprocs="largest")


@pytest.fixture(scope="module")
def halved(tmp_path_factory):
    """make test-nproc, at 2 ranks: the DDP habit of dividing by the world size, in both
    exercises (each a whole factor 0.5x, once caught without a hint: instructor's review), and
    the other wrong answers whose point does not need more ranks."""
    return check_at_once({
        # a pipeline's ranks hold stages, not data shards: no / N
        "gpipe_over_world": ("02.1", ("out = lm_loss(out, micro[i]) / m",
                                      "out = lm_loss(out, micro[i]) / (m * env.world_size)")),
        # the log divided by m, the backward not: m-fold gradients, which AdamW trains like the
        # right ones (every loss within 1e-4 of one process's); step 1's gradients show it
        "gpipe_m_in_log_only": ("02.1", [
            ("out = lm_loss(out, micro[i]) / m", "out = lm_loss(out, micro[i])"),
            ("losses.append(sum(out.item() for out in outputs))",
             "losses.append(sum(out.item() for out in outputs) / m)")]),
        # "/ 4" where "/ m" belongs: right at the checked m = 4 (R45's plant), 0.5x at m = 2
        "gpipe_over_4": ("02.1", ("out = lm_loss(out, micro[i]) / m",
                                  "out = lm_loss(out, micro[i]) / 4")),
        # f's backward averages the partial input gradients instead of adding them up
        "megatron_f_mean": ("02.2", ("return all_reduce(grad.clone())",
                                     "return all_reduce(grad.clone()) / dist.get_world_size()")),
        # the received activation does not require grad: no input gradient to send back
        "gpipe_no_input_grad": ("02.1", ("x.requires_grad_()", None)),
        "megatron_no_f": ("02.2", ("return all_reduce(grad.clone())", "return grad")),
        # f's forward all-reduces too: the input N times over
        "megatron_f_forward": ("02.2", ("        return x", "return all_reduce(x.clone())")),
    }, tmp_path_factory.mktemp("ch02_halved"))


@pytest.mark.second_nproc
def test_gpipe_scaled_in_the_log_only_is_named_by_its_gradients(halved):
    ok, lines, _ = halved["gpipe_m_in_log_only"]
    assert not ok
    assert any(ln.startswith("PASS [2 ranks] losses = naive_split.py's") for ln in lines), lines
    assert lines[-1] == ("FAIL [2 ranks] step 1's gradients, every stage's are 4.00x one "
                         "process's: is the loss you call backward() on divided by m?"), lines


@pytest.mark.second_nproc
def test_gpipe_with_m_hard_coded_fails_at_another_m(halved):
    ok, lines, _ = halved["gpipe_over_4"]
    assert not ok
    assert lines[-1] == ("FAIL [2 ranks] at m = 2: step 1's gradients, every stage's are 0.50x "
                         "one process's: is each micro-batch's loss divided by m, not by a fixed "
                         "number?"), lines


@pytest.mark.second_nproc
def test_gpipe_divided_by_the_world_size_too_is_named(halved):
    ok, lines, _ = halved["gpipe_over_world"]
    assert not ok
    assert lines[-1].endswith(": 0.50x: is the loss divided by more than m? (a pipeline's ranks "
                              "hold stages, not shards of the data: no division by the world "
                              "size)"), lines[-1]


@pytest.mark.second_nproc
def test_megatron_f_backward_averaging_is_named(halved):
    ok, lines, _ = halved["megatron_f_mean"]
    assert not ok
    assert lines[-1].startswith("FAIL [2 ranks] hand: input_grad differs from the unsharded "
                                "model's by "), lines[-1]
    assert lines[-1].endswith(": 0.50x: is a sum averaged? f's backward and g's forward add the "
                              "ranks' partial results: a plain all-reduce, no / N"), lines[-1]


def test_gpipe_without_the_scale_is_named(wrong):
    ok, lines, _ = wrong["gpipe_no_scale"]
    assert not ok
    assert lines[-1].startswith("FAIL [2 ranks] losses differ from naive_split.py's on one "
                                "process at step 1 by ")
    assert lines[-1].endswith(": 4x: is each micro-batch's loss divided by m?")


def test_megatron_g_backward_all_reducing_is_named(wrong):
    ok, lines, _ = wrong["megatron_g_backward"]
    assert not ok
    assert lines[-1] == ("FAIL [2 ranks] backward: 2 all_reduce(s) of 131072 B in all; "
                         "Megatron's MLP makes 1 of 65536 B: f's backward all-reduces, g's "
                         "passes the gradient on")


@pytest.mark.second_nproc
def test_gpipe_passes(checks):
    ok, lines, _ = checks["gpipe"]
    assert ok, lines
    assert lines[1] == "PASS [3 ranks] losses = naive_split.py's on one process at every step " \
                       "(< 1e-04)"


@pytest.mark.second_nproc
def test_gpipe_without_an_input_gradient_is_named(halved):
    ok, lines, _ = halved["gpipe_no_input_grad"]
    assert not ok
    assert lines[-1].startswith("FAIL [2 ranks] the launch failed: ")
    assert lines[-1].endswith(": a stage's input gradient is None: does the received "
                              "activation require grad?")


@pytest.mark.second_nproc
def test_gpipe_receiving_from_the_wrong_stage_is_named(checks):
    ok, lines, _ = checks["gpipe_wrong_peer"]
    assert not ok
    # which rank's timeout comes first differs between runs: gloo's ("RuntimeError: ... Timed
    # out waiting") or the store's ("DistStoreError: wait timeout"): both get the hint
    assert re.match(r"FAIL \[3 ranks\] the launch failed: (RuntimeError: .*Timed out "
                    r"waiting|.*DistStoreError: wait timeout)", lines[-1])
    assert lines[-1].endswith(": a stage waited for a tensor no stage sent: does each recv name "
                              "the stage that sends it (activations come from rank - 1, "
                              "gradients from rank + 1)?")


@pytest.mark.second_nproc
def test_megatron_passes(checks):
    ok, lines, _ = checks["megatron"]
    assert ok, lines
    assert len(lines) == 1 + 2 + 8  # no TODO left, the two counts, 4 errors x 2 versions


@pytest.mark.second_nproc
def test_megatron_without_f_is_named(halved):
    ok, lines, _ = halved["megatron_no_f"]
    assert not ok
    assert lines[-1] == ("FAIL [2 ranks] backward: 0 all_reduce(s) of 0 B in all; Megatron's "
                         "MLP makes 1 of 65536 B: f's backward all-reduces, g's passes the "
                         "gradient on")
    ok, lines, _ = halved["megatron_f_forward"]
    assert not ok
    assert lines[-1] == ("FAIL [2 ranks] forward: 2 all_reduce(s) of 131072 B in all; "
                         "Megatron's MLP makes 1 of 65536 B: g's forward all-reduces, f's "
                         "passes x on")

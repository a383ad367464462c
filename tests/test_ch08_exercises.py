"""Chapter 08's exercise through its checker: the solution passes, a search that skips tensor
parallelism's cheaper settings is caught (two launches of one process, ~5 CPU-s each)."""
import pytest

exercise = pytest.importorskip("distkit.course.exercise")  # the checker (make exercise)


def test_fewest_gpus_solution_passes_and_a_wrong_search_fails(tmp_path):
    runs = exercise.check_at_once({
        "solution": ("08.1", None),
        "tp 8 only": ("08.1", ("for tp in TP_DEGREES:", "for tp in (8,):")),
    }, tmp_path, nprocs=(1,))
    ok, lines, _ = runs["solution"]
    assert ok, lines
    assert any("70b at 8192" in ln and "fits" in ln for ln in lines)
    ok, lines, _ = runs["tp 8 only"]
    assert not ok and "not the fewest" in lines[-1], lines

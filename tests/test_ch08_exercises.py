"""Chapter 08's exercise through its checker: the solution passes, and three plausible wrong
answers fail with a line that names the mistake (four launches of one process at once, ~3 CPU-s
each: the exercise imports no torch)."""
import pytest

exercise = pytest.importorskip("distkit.course.exercise")  # the checker (make exercise)

WRONG = {
    # only the largest tensor-parallel degree: 70B at 8192 then needs more GPUs than tp 1 does
    "tp 8 only": (("for tp in TP_DEGREES:", "for tp in (8,):"), "not the fewest"),
    # the allocated peak against the whole card: no room for the allocator's reserve and the
    # CUDA context (8B at 32,768 "fits" 8 GPUs at 69.6 GiB; the card must hold 90)
    "whole card": (("if fits(peak_bytes(config, gpus=gpus, seq=seq, tp=tp, ac=ac), gpu_gib):",
                    "if peak_bytes(config, gpus=gpus, seq=seq, tp=tp, ac=ac) <= gpu_gib * 2**30:"),
                   "with the allocator's reserve and the CUDA context"),
    # GPU counts one by one instead of whole nodes
    "single GPUs": (("for gpus in range(per_node, max_gpus + 1, per_node):",
                     "for gpus in range(1, max_gpus + 1):"), "not a whole number of 8-GPU nodes"),
}


def test_fewest_gpus_solution_passes_and_wrong_answers_fail(tmp_path):
    runs = exercise.check_at_once({"solution": ("08.1", None),
                                   **{name: ("08.1", change) for name, (change, _) in
                                      WRONG.items()}}, tmp_path, nprocs=(1,))
    ok, lines, _ = runs["solution"]
    assert ok, lines
    assert any("70b at 8192 on 79.6 GiB GPUs: 24 GPUs, tp 1, full fits" in ln for ln in lines)
    assert any("70b at 8192 on 140.4 GiB GPUs: 16 GPUs, tp 1, full fits" in ln for ln in lines)
    for name, (_, message) in WRONG.items():
        ok, lines, _ = runs[name]
        assert not ok and message in lines[-1], (name, lines)

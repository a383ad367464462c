"""Chapter 08's exercise through its checker: the solution passes, and six plausible wrong
answers fail with a line that names the mistake (launches of one process at once, ~3 CPU-s
each: the exercise imports no torch; the checker's --sweep launch answers 18 cases, and a
second sweep at --max-gpus 24 checks the cap)."""
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
    # the search's inner loops swapped (checkpointing outside tp): the three headline cases
    # agree either way (13 PASS before the sweep: instructor's F6); 5 of the 18 do not
    "loops swapped": ([("for tp in TP_DEGREES:", "for ac in CHECKPOINTING:  # outside tp"),
                       ("for ac in CHECKPOINTING:", "for tp in TP_DEGREES:"),
                       ("if gpus % tp:", "if False:"),
                       ("if fits(peak_bytes(config, gpus=gpus, seq=seq, tp=tp, ac=ac), gpu_gib):",
                        "if gpus % tp == 0 and fits(peak_bytes(config, gpus=gpus, seq=seq, "
                        "tp=tp, ac=ac), gpu_gib):")],
                      "both fit; prefer less tensor parallelism, then less recomputation"),
    # the cap left out of the search (range's end is exclusive): at --max-gpus 24, 70B at 8,192
    # on H100s (exactly 24) finds nothing; the 18 uncapped cases all agree (review R45)
    "cap excluded": (("for gpus in range(per_node, max_gpus + 1, per_node):",
                      "for gpus in range(per_node, max_gpus, per_node):"),
                     "is max_gpus itself searched (range's end is exclusive)?"),
    # the cap ignored: the larger models answer past 24 GPUs
    "cap ignored": (("for gpus in range(per_node, max_gpus + 1, per_node):",
                     "for gpus in range(per_node, 4096 + 1, per_node):"),
                    "is the search stopped at max_gpus?"),
}


def test_fewest_gpus_solution_passes_and_wrong_answers_fail(tmp_path):
    runs = exercise.check_at_once({"solution": ("08.1", None),
                                   **{name: ("08.1", change) for name, (change, _) in
                                      WRONG.items()}}, tmp_path, nprocs=(1,))
    ok, lines, _ = runs["solution"]
    assert ok, lines
    assert any("70b at 8192 on 79.6 GiB GPUs: 24 GPUs, tp 1, full fits" in ln for ln in lines)
    assert any("70b at 8192 on 140.4 GiB GPUs: 16 GPUs, tp 1, full fits" in ln for ln in lines)
    assert lines[-2].startswith("PASS [1 rank] every answer of the sweep (18 cases) = ")
    assert lines[-1] == ("PASS [1 rank] with --max-gpus 24: every answer up to 24 GPUs, 24 "
                         "itself included")
    for name, (_, message) in WRONG.items():
        ok, lines, _ = runs[name]
        assert not ok and message in lines[-1], (name, lines)
    assert runs["loops swapped"][1][-1] == (
        "FAIL [1 rank] 1b at 32768 on 79.6 GiB GPUs: your answer [8, 8, 'selective'], expected "
        "[8, 1, 'full']: on 8 GPUs both fit; prefer less tensor parallelism, then less "
        "recomputation (none, selective, full): is the loop over tp outside the one over "
        "checkpointing? (5 of 18 cases differ)")

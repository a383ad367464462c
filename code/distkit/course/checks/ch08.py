"""Exercise checks for chapter 08 (planning a run); see distkit/course/checks/__init__.py."""
import functools

from distkit.course.exercise import exercise

GiB = 2**30
# GPU memory as nvidia-smi reports it: an 80 GB H100 (81,559 MiB), a 141 GB H200 (143,771 MiB)
H100_GIB, H200_GIB = 81559 / 1024, 143771 / 1024
CASES = (("70b", 8192, H100_GIB), ("8b", 32768, H100_GIB), ("70b", 8192, H200_GIB))


@functools.cache  # the same 18 cases for every file checked in this process (tests: several)
def preferred(model, seq, gib, per_node=8, max_gpus=4096):
    """The checker's own answer, written apart from the solution: the fewest whole nodes, then
    the smallest tp, then the least recomputation, that fits (None: nothing up to max_gpus)."""
    from distkit.memory import LLAMA_CONFIGS
    from distkit.plan import fits
    from distkit.speed import peak_bytes
    config = LLAMA_CONFIGS[model]
    settings = [(tp, ac) for tp in (1, 2, 4, 8) for ac in ("none", "selective", "full")]
    for gpus in range(per_node, max_gpus + 1, per_node):
        for tp, ac in settings:  # in the order of preference
            if gpus % tp == 0 and fits(peak_bytes(config, gpus=gpus, seq=seq, tp=tp, ac=ac),
                                       gib):
                return [gpus, tp, ac]
    return None


@exercise("08.1", "ch08_plan/exercises/ex08_fewest_gpus.py", nprocs=(1,))
def check_fewest_gpus(run):
    """The answer is whole nodes, fits (distkit.plan.fits of distkit.speed.peak_bytes: the
    allocated peak with the allocator's reserve and the CUDA context, against the GPU's memory),
    and no setting fits one node fewer: the fewest, whatever order the search took. Then every
    answer of the sweep (3 models x 3 lengths x 2 GPUs, one launch) against the checker's own
    search in the stated order of preference (less TP, then less recomputation): the three cases
    above agree for either order of the inner loops, 5 others do not."""
    from distkit.course.exercise import Fail
    from distkit.memory import LLAMA_CONFIGS
    from distkit.plan import fits, reserved_bytes
    from distkit.speed import peak_bytes
    try:
        res = run("--sweep")
    except Fail as fail:
        raise Fail(f"{fail}" + (": this file has no --sweep: copy its lines from the current "
                                "starter (git diff shows them)" if "--sweep" in str(fail)
                                else "")) from None
    answers = {(model, seq, round(gib, 1)): answer for model, seq, gib, answer in res["answers"]}
    for model, seq, gib in CASES:
        config = LLAMA_CONFIGS[model]
        answer = answers[model, seq, round(gib, 1)]
        what = f"{model} at {seq} on {gib:.1f} GiB GPUs"
        yield answer is not None, f"{what}: answered", f"{what}: no answer, yet some setting fits"
        gpus, tp, ac = answer
        yield gpus % 8 == 0, f"{what}: {gpus} GPUs, whole nodes of 8", \
            f"{what}: {gpus} GPUs is not a whole number of 8-GPU nodes: search nodes, not GPUs"
        peak = peak_bytes(config, gpus=gpus, seq=seq, tp=tp, ac=ac)
        yield gpus % tp == 0 and fits(peak, gib), \
            f"{what}: {gpus} GPUs, tp {tp}, {ac} fits", \
            f"{what}: {gpus} GPUs, tp {tp}, {ac} allocates {peak / GiB:.1f} GiB, which the GPU " \
            f"must hold as {reserved_bytes(peak) / GiB:.1f} GiB with the allocator's reserve and " \
            f"the CUDA context (distkit.plan.fits), more than its {gib:.1f}"
        fewer = [(t, a) for t in (1, 2, 4, 8) for a in ("none", "selective", "full")
                 if gpus > 8 and (gpus - 8) % t == 0
                 and fits(peak_bytes(config, gpus=gpus - 8, seq=seq, tp=t, ac=a), gib)]
        yield not fewer, f"{what}: nothing fits on {gpus - 8} GPUs", \
            f"{what}: {gpus - 8} GPUs fit as well ({fewer[:1]}): not the fewest"
    wrong = []
    for model, seq, gib, answer in res["answers"]:
        want = preferred(model, seq, gib)
        if answer != want:
            wrong.append((f"{model} at {seq} on {gib:.1f} GiB GPUs", answer, want))
    what, answer, want = wrong[0] if wrong else ("", None, None)
    hint = (f": on {want[0]} GPUs both fit; prefer less tensor parallelism, then less "
            "recomputation (none, selective, full): is the loop over tp outside the one over "
            "checkpointing?" if answer and want and answer[0] == want[0] else "")
    yield (not wrong and len(res["answers"]) == 18,
           f"every answer of the sweep ({len(res['answers'])} cases) = the fewest GPUs, then the "
           "least tp, then the least recomputation",
           f"{what}: your answer {answer}, expected {want}{hint} ({len(wrong)} of "
           f"{len(res['answers'])} cases differ)" if wrong else
           f"the sweep answered {len(res['answers'])} cases, not 18")
    # max_gpus is a cap the answer may reach: at --max-gpus 24, 70B at 8,192 on H100s needs
    # exactly 24 (a search that stops one node short answers None) and the larger cases none
    # (a search that ignores the cap answers them anyway)
    try:
        capped = run("--sweep", "--max-gpus", 24)
    except Fail as fail:
        raise Fail(f"{fail}" + (": this file has no --max-gpus: copy its lines from the current "
                                "starter (git diff shows them)" if "--max-gpus" in str(fail)
                                else "")) from None
    wrong = [(f"{model} at {seq} on {gib:.1f} GiB GPUs", answer,
              preferred(model, seq, gib, max_gpus=24))
             for model, seq, gib, answer in capped["answers"]
             if answer != preferred(model, seq, gib, max_gpus=24)]
    what, answer, want = wrong[0] if wrong else ("", None, None)
    hint = ("is max_gpus itself searched (range's end is exclusive)?" if want and answer is None
            else "is the search stopped at max_gpus?" if answer and want is None else "")
    yield (not wrong and len(capped["answers"]) == 18,
           "with --max-gpus 24: every answer up to 24 GPUs, 24 itself included",
           f"with --max-gpus 24, {what}: your answer {answer}, expected {want}: {hint} "
           f"({len(wrong)} of {len(capped['answers'])} cases differ)" if wrong else
           f"the capped sweep answered {len(capped['answers'])} cases, not 18")

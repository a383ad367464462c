"""Exercise checks for chapter 08 (planning a run); see distkit/course/checks/__init__.py."""
from distkit.course.exercise import exercise

GiB = 2**30
CASES = (("70b", 8192, 0.9 * 79.6), ("8b", 32768, 0.9 * 79.6))


@exercise("08.1", "ch08_plan/exercises/ex08_fewest_gpus.py", nprocs=(1,))
def check_fewest_gpus(run):
    """The answer fits (distkit.speed.peak_bytes within the budget), and no setting fits one
    node fewer: the fewest, whatever order the search took."""
    from distkit.memory import LLAMA_CONFIGS
    from distkit.speed import peak_bytes
    for model, seq, gib in CASES:
        config, budget = LLAMA_CONFIGS[model], gib * GiB
        answer = run("--model", model, "--seq", seq, "--gpu-gib", gib)["answer"]
        yield answer is not None, f"{model} at {seq}: answered", \
            f"{model} at {seq}: no answer, yet some setting fits"
        gpus, tp, ac = answer
        peak = peak_bytes(config, gpus=gpus, seq=seq, tp=tp, ac=ac)
        yield gpus % tp == 0 and peak <= budget, \
            f"{model} at {seq}: {gpus} GPUs, tp {tp}, {ac} fits", \
            f"{model} at {seq}: {gpus} GPUs, tp {tp}, {ac} needs {peak / GiB:.1f} GiB > {gib:.1f}"
        fewer = [(t, a) for t in (1, 2, 4, 8) for a in ("none", "selective", "full")
                 if gpus > 8 and (gpus - 8) % t == 0
                 and peak_bytes(config, gpus=gpus - 8, seq=seq, tp=t, ac=a) <= budget]
        yield not fewer, f"{model} at {seq}: nothing fits on {gpus - 8} GPUs", \
            f"{model} at {seq}: {gpus - 8} GPUs fit as well ({fewer[:1]}): not the fewest"

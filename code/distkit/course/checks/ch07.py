"""Exercise checks for chapter 07 (when things go wrong); see distkit/course/checks/__init__.py."""
from distkit.course.exercise import Fail, exercise


@exercise("07.1", "ch07_debugging/exercises/ex07_early_stop.py", timeout=120)
def early_stop(run):
    try:
        res = run("--timeout", "15")  # a rank left waiting fails in 15 s, not the default 20
    except Fail as fail:  # the exercise's bug: ranks that decide differently part ways
        hint = (": the ranks waited in collectives the others never called: do they all "
                "compare the same number with --target?" if "Timed out" in str(fail) else "")
        raise Fail(f"{fail}{hint}") from None
    steps = res["stopped"]
    yield (res["same_step"], f"every rank stopped at step {steps[0]}",
           f"the ranks stopped at steps {steps}")
    yield (res["same_loss"], "the ranks' validation losses are identical",
           "the ranks compared different validation losses with --target")
    gap, tol = res["max_diff_one_process"], res["tolerance"]
    # a whole multiple of one process's loss: a count too large or too small by a factor; any
    # other gap: the ranks weighed alike (501 and 500 samples)
    first = res["histories"][0][0]
    scale = first["loss"] / first["one_process"]
    times = round(max(scale, 1 / scale)) if scale > 0 else 0
    why = "a mean of the ranks' means?"
    # every rank decided on one rank's shard loss (a broadcast from it, or no all-reduce)
    hist = res["histories"]
    alone = [r for r in range(len(hist))
             if all(abs(e["loss"] - hist[r][i]["shard_loss"]) < 1e-12 * max(1, abs(e["loss"]))
                    for i, e in enumerate(hist[0]))]
    if alone:
        why = (f"every rank used rank {alone[0]}'s shard loss only: add up the loss sums and the "
               "counts over all ranks (one all_reduce of both), then divide")
    elif times > 1 and abs(max(scale, 1 / scale) - times) < 1e-3 * times:
        why = (f"{scale:.2f}x: " + ("is the all-reduced mean divided by N once more?" if scale < 1
                                    else "is the all-reduced sum divided by one rank's count?"))
    yield (gap < tol, f"the validation loss = one process's on the whole set (< {tol:g})",
           f"the validation loss differs from one process's by {gap:.1e} (tolerance {tol:g}): "
           + why)
    yield (res["same_weights"], "weights identical on every rank",
           "the ranks' weights differ at the end")

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
    yield (gap < tol, f"the validation loss = one process's on the whole set (< {tol:g})",
           f"the validation loss differs from one process's by {gap:.1e} (tolerance {tol:g}): "
           "a mean of the ranks' means?")
    yield (res["same_weights"], "weights identical on every rank",
           "the ranks' weights differ at the end")

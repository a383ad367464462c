"""Exercise checks for chapter 03 (ZeRO); see distkit/course/checks/__init__.py."""
from distkit.course.exercise import exercise
from distkit.comm import NAMES
from distkit.course.checks import gradient_matches, losses_match


@exercise("03.1", "ch03_zero/exercises/ex03_zero1_by_hand.py")
def zero1(run):
    res = run("--steps", "3")
    N = run.nproc
    # AdamW divides a constant scale out of its steps: the losses cannot show a missing / N,
    # step 1's gradient does. The worst rank's slice:
    worst = max(res["grad_checks"], key=lambda c: float("inf") if c["gap"] is None else c["gap"])
    ok, passed, failed = gradient_matches(
        worst, res["tolerances"]["grad"], "this rank's slice of the gradient after step 1",
        "is the reduce-scattered sum divided by N?",
        "is shard.grad this rank's slice of the gradient summed over the ranks?", be="is")
    yield ok, f"{passed}, on every rank", failed
    S = res["shard_size"]
    # chapter 03's calculator: ZeRO-1's optimizer bytes of the padded S x N values, over N ranks,
    # + AdamW's one step counter (the shard is one tensor)
    from distkit.memory import FP32_ADAMW, model_state_bytes
    want = [int(model_state_bytes(S * N, N, 1, FP32_ADAMW)["optimizer"]) + 4] * N
    yield (res["optimizer_state_bytes"] == want,
           f"each rank's AdamW state = 8 x S + 4 = {want[0]:,} bytes (one process: "
           f"{res['single_optimizer_state_bytes']:,})",
           f"AdamW state per rank is {res['optimizer_state_bytes']} bytes, not 8 x S + 4 = "
           f"{want[0]:,}: is the optimizer built over the shard alone?")
    yield losses_match(res["losses"], res["single_losses"], res["tolerances"]["loss"],
                       later="the update did not reach the model: is every updated shard "
                       "all-gathered back into the parameters?")
    yield (res["max_weight_diff"] < res["tolerances"]["weight"],
           "weights after the last step = one process's",
           f"weights differ from one process's by {res['max_weight_diff']:.1e} after the last step")
    yield (res["identical"], "weights identical on every rank",
           "the ranks' weights differ after training: is every shard all-gathered back?")
    # Last, the sync itself: an all-reduce of the whole gradient, then a slice, passes every check
    # above (DDP's sync, the same numbers) but is not ZeRO-1's reduce-scatter. c10d's and the
    # functional collectives' op names, either API (tensor or list), as distkit.comm reads them:
    if "step_collectives" not in res:  # a file from before the count (the starter changed)
        yield (False, "", "this file does not count its collectives: copy the `with "
               "CommDebugMode() as comm:` block and the step_collectives lines from the current "
               "starter (git diff shows them), your code inside the block")
        return
    steps = [{NAMES.get(op, op).replace("_", "-"): n for op, n in c.items()}
             for c in res["step_collectives"]]
    want = {"reduce-scatter": 1, "all-gather": 1}
    bad = next((i for i, c in enumerate(steps) if c != want), None)
    yield (bad is None, "each step syncs with one reduce-scatter and one all-gather",
           f"step {(bad or 0) + 1}'s collectives are {steps[bad or 0]}, not one reduce-scatter "
           "and one all-gather"
           + (": an all-reduce of the whole gradient, then a slice, is DDP's sync; ZeRO-1 "
              "reduce-scatters it (dist.reduce_scatter_single)"
              if any("all-reduce" in c for c in steps) else ""))

"""Exercise checks for chapter 03 (ZeRO); see distkit/course/checks/__init__.py."""
from distkit.course.exercise import exercise
from distkit.course.checks import losses_match


@exercise("03.1", "ch03_zero/exercises/ex03_zero1_by_hand.py")
def zero1(run):
    res = run("--steps", "3")
    N = run.nproc
    yield losses_match(res["losses"], res["single_losses"], res["tolerances"]["loss"])
    yield (res["max_weight_diff"] < res["tolerances"]["weight"],
           "weights after the last step = one process's",
           f"weights differ from one process's by {res['max_weight_diff']:.1e} after the last step")
    yield (res["identical"], "weights identical on every rank",
           "the ranks' weights differ after training: is every shard all-gathered back?")
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

"""Exercise checks for chapter 00 (collectives); see distkit/course/checks/__init__.py."""
from distkit.comm import NAMES
from distkit.course.exercise import Fail, exercise


# A recv that no send meets waits for gloo's timeout: 20 s here, not the default 60 (the
# exercise's all-reduce takes milliseconds; 20 s leaves room for ranks that finish importing
# torch apart on a loaded machine, as 02.1's does)
@exercise("00.1", "ch00_collectives/exercises/ex00_naive_allreduce.py",
          env={"COURSE_TIMEOUT_S": "20"})
def naive_allreduce(run):
    try:
        res = run("--numel", "1024")
    except Fail as fail:  # gloo's timeout (20 s) on a recv whose send never came
        hint = (": a rank waited for a tensor no rank sent: does each recv meet its send, in "
                "the same order on both sides?" if "Timed out" in str(fail) else "")
        raise Fail(f"{fail}{hint}") from None
    N, S = run.nproc, res["bytes"]
    wrong = [r for r, ok in enumerate(res["equal"]) if not ok]
    yield (not wrong, "the sum on every rank = dist.all_reduce's",
           f"the result differs from dist.all_reduce's on ranks {wrong}: rank 0 must add up all "
           "N tensors and send that sum to every other rank, which receives it into total")
    want = [(N - 1) * S] + [S] * (N - 1)
    for what, got in (("received", res["received"]), ("sent", res["sent"])):
        yield (got == want, f"bytes {what} per rank = {want} ((N-1) S on rank 0, S elsewhere)",
               f"bytes {what} per rank are {got}, expected {want}: count S = {S:,} bytes for "
               "every tensor a rank sends or receives")


@exercise("00.2", "ch00_collectives/exercises/ex00_global_mean.py")
def global_mean(run):
    res = run()
    N, exact, ref, mom = run.nproc, res["exact"], res["reference"], res["mean_of_means"]
    means = res["reference_mean_of_means"]
    scale = f"{mom / means:.0f}x" if abs(mom / means - N) < 1e-9 * N else "not"
    yield (abs(mom - means) < 1e-12, "(a) mean_of_means = the average of the ranks' means "
           "(< 1e-12)", f"mean_of_means = {mom:.6f}, {scale} the average of the ranks' means: is "
           "the sum divided by N?")
    why = (": it is the mean of the ranks' means, which weighs ranks, not samples: all_reduce "
           "every rank's sum and count, then divide" if abs(exact - mom) < 1e-12 else
           ": all_reduce every rank's sum and its count (one tensor), then divide the sum by "
           "the count")
    yield (abs(exact - ref) < 1e-12, "(b) exact = the one-process mean of all samples (< 1e-12)",
           f"exact differs from the one-process mean by {abs(exact - ref):.1e}{why}")
    yield (abs(mom - ref) > 1e-3, "and the two differ (ranks hold different counts)",
           f"mean_of_means = {mom:.6f} equals the mean of all samples: the ranks hold "
           "different counts, so they should differ")


@exercise("00.3", "ch00_collectives/exercises/ex00_allreduce_from_halves.py")
def allreduce_from_halves(run):
    N = run.nproc
    # 1002 = 2 x 3 x 167: a size N divides (no padding: where numel // N + 1 is one too many),
    # then 1001, a multiple of neither 2 nor 3 (padding to add, and to cut off)
    for numel in (1002, 1001):
        try:
            res = run("--numel", str(numel))
        except Fail as fail:
            hint = (f": shard x N must hold all {numel} elements (round up)"
                    if "expanded size" in str(fail) else "")
            raise Fail(f"numel {numel}: {fail}{hint}") from None
        shard = -(-numel // N)
        yield (res["shard"] == shard and res["padding"] == shard * N - numel,
               f"numel {numel}: shard = ceil({numel} / {N}) = {shard} elements, padding "
               f"{shard * N - numel}",
               f"numel {numel}: shard is {res['shard']} elements and padding {res['padding']}: "
               f"the fewest elements per rank that hold {numel} between {N} ranks is {shard}"
               + (" (rounded up, not down + 1)" if res["shard"] == numel // N + 1 else ""))
        yield (all(c["slice"] for c in res["checks"]),
               f"numel {numel}: each rank's slice after reduce_scatter_single = its slice of "
               "the sum",
               f"numel {numel}: a rank's slice after the reduce-scatter differs from its slice "
               "of the padded sum")
        yield (all(c["equal"] for c in res["checks"]),
               f"numel {numel}: the result = dist.all_reduce's, on every rank",
               f"numel {numel}: the result differs from dist.all_reduce's (its size, or its "
               "values): is the padding cut off?")
        # The exercise's point: the two halves, not an all-reduce and a slice (the same numbers).
        # c10d's and the functional collectives' names, as distkit.comm reads them (03.1's count)
        if "collectives" not in res:  # a file from before the count (the starter changed)
            yield (False, "", "this file does not count its collectives: copy the `with "
                   "CommDebugMode() as comm:` block and the collectives line from the current "
                   "starter (git diff shows them), your code inside the block")
            return
        got = {NAMES.get(op, op).replace("_", "-"): n for op, n in res["collectives"].items()}
        want = {"reduce-scatter": 1, "all-gather": 1}
        yield (got == want, f"numel {numel}: one reduce-scatter and one all-gather, nothing else",
               f"numel {numel}: the collectives are {got}, not one reduce-scatter and one "
               "all-gather" + (": an all-reduce, then a slice, gives the same numbers but is "
                               "not the two halves; reduce-scatter it (dist.reduce_scatter_single)"
                               if "all-reduce" in got else ""))

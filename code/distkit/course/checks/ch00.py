"""Exercise checks for chapter 00 (collectives); see distkit/course/checks/__init__.py."""
from distkit.course.exercise import exercise


@exercise("00.1", "ch00_collectives/exercises/ex00_naive_allreduce.py")
def naive_allreduce(run):
    res = run("--numel", "1024")  # the script itself asserts the sum against dist.all_reduce
    N, S = run.nproc, res["bytes"]
    yield True, "the sum on every rank = dist.all_reduce's", ""
    want = [(N - 1) * S] + [S] * (N - 1)
    for what, got in (("received", res["received"]), ("sent", res["sent"])):
        yield (got == want, f"bytes {what} per rank = {want} ((N-1) S on rank 0, S elsewhere)",
               f"bytes {what} per rank are {got}, expected {want}: count S = {S:,} bytes for "
               "every tensor a rank sends or receives")


@exercise("00.2", "ch00_collectives/exercises/ex00_global_mean.py")
def global_mean(run):
    res = run()
    exact, ref, mom = res["exact"], res["reference"], res["mean_of_means"]
    yield (abs(exact - ref) < 1e-12, "exact = the one-process mean of all samples (< 1e-12)",
           f"exact differs from the one-process mean by {abs(exact - ref):.1e}")
    yield (abs(mom - ref) > 1e-3, "the mean of per-rank means differs from it (ranks hold "
           "different counts)", f"mean_of_means = {mom:.6f} equals the reference {ref:.6f}: "
           "is it the mean of the ranks' means, or the exact mean again?")


@exercise("00.3", "ch00_collectives/exercises/ex00_allreduce_from_halves.py")
def allreduce_from_halves(run):
    numel = 1001  # a multiple of neither 2 nor 3: the padding matters at both sizes
    res = run("--numel", str(numel))
    N = run.nproc
    shard = -(-numel // N)
    yield (res["shard"] == shard and res["padding"] == shard * N - numel,
           f"shard = ceil({numel} / {N}) = {shard} elements, padding {shard * N - numel}",
           f"shard is {res['shard']} elements and padding {res['padding']}: the fewest elements "
           f"per rank that hold {numel} between {N} ranks is {shard}")
    yield (all(c["slice"] for c in res["checks"]),
           "each rank's slice after reduce_scatter_single = its slice of the sum",
           "a rank's slice after the reduce-scatter differs from its slice of the padded sum")
    yield (all(c["equal"] for c in res["checks"]), "the result = dist.all_reduce's, on every rank",
           "the result differs from dist.all_reduce's (its size, or its values): is the padding "
           "cut off?")

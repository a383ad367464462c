"""The exercise checker's entries for chapters 00-05 and 07 (see distkit/exercise.py).

Each entry launches the learner's file as its solution is tested, at each world size, and yields
(ok, what passed, what failed) one check at a time: the first failure is the line the learner
reads, naming the first thing wrong with its number.
"""
from distkit.exercise import exercise


def first_diff(mine, reference, tol):
    """(step, difference) of the first step whose values differ by tol or more, else None."""
    for step, (x, y) in enumerate(zip(mine, reference), 1):
        if abs(x - y) >= tol:
            return step, abs(x - y)
    return None


def losses_match(mine, reference, tol, what="one process"):
    """The usual check: every step's loss within tol of the reference's."""
    bad = first_diff(mine, reference, tol)
    return (len(mine) == len(reference) and bad is None,
            f"losses = {what}'s at every step (< {tol:.0e})",
            f"losses differ from {what}'s at step {bad[0]} by {bad[1]:.1e} (tolerance {tol:.0e})"
            if bad else f"{len(mine)} losses for {len(reference)} steps")


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
    want = [8 * S + 4] * N
    yield (res["optimizer_state_bytes"] == want,
           f"each rank's AdamW state = 8 x S + 4 = {want[0]:,} bytes (one process: "
           f"{res['single_optimizer_state_bytes']:,})",
           f"AdamW state per rank is {res['optimizer_state_bytes']} bytes, not 8 x S + 4 = "
           f"{want[0]:,}: is the optimizer built over the shard alone?")


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


@exercise("01.1", "ch01_ddp/exercises/ex01_manual_ddp.py")
def manual_ddp(run):
    b, samples = 8, 64
    single = run.single("ch01_ddp/train_single.py", "--batch-size", run.nproc * b,
                        "--samples", samples)["losses"]
    for flag, calls in (([], 21), (["--flat"], 1)):
        mode = "--flat" if flag else "per tensor"
        res = run("--batch-size", b, "--samples", samples, *flag)
        ident = res["identical"]
        yield (ident["start"] is False, f"{mode}: the ranks start from different weights",
               f"{mode}: the ranks start from identical weights: the check of the broadcast "
               "proves nothing (keep torch.manual_seed(env.rank))")
        yield (ident["broadcast"], f"{mode}: after the broadcast, weights and buffers identical",
               f"{mode}: after the broadcast the ranks' weights or buffers still differ")
        yield losses_match(res["losses"], single, 1e-4,
                           f"train_single.py --batch-size {run.nproc * b}")
        yield (res["calls_per_step"] == calls, f"{mode}: {calls} all_reduce call(s) per step",
               f"{mode}: {res['calls_per_step']} all_reduce calls counted per step, expected "
               f"{calls}")
        yield (ident["end"], f"{mode}: weights identical on every rank after training",
               f"{mode}: the ranks' weights differ after training")


@exercise("01.2", "ch01_ddp/exercises/ex01_overlap.py")
def overlap(run):
    res = run("--steps", "3")
    n, grad_bytes = res["num_param_tensors"], res["grad_bytes"]
    for mode, r in res["modes"].items():
        for what, key, tol in (("losses", "loss", 1e-5), ("gradients", "grad", 1e-5),
                               ("weights", "weight", 1e-4)):
            gap = r[f"max_{key}_diff"]
            yield (gap < tol, f"{mode}: {what} = one process's (< {tol:.0e})",
                   f"{mode}: {what} differ from one process's by {gap:.1e} (tolerance {tol:.0e})")
        bytes_ = set(r["bytes_per_step"])
        yield (bytes_ == {grad_bytes}, f"{mode}: every gradient byte all-reduced once per step",
               f"{mode}: {sorted(bytes_)} bytes all-reduced per step, the gradients are "
               f"{grad_bytes:,}")
        calls = set(r["calls_per_step"])
        want = {"flat": 1, "per-param": n, "bucketed": len(r.get("buckets", []))}[mode]
        yield (calls == {want}, f"{mode}: {want} all_reduce(s) per step",
               f"{mode}: {sorted(calls)} all_reduces per step, expected {want}")
        if mode != "flat":
            during = all(c["launched"] < s["backward_end"] for s in r["steps"] for c in s["calls"])
            yield (during, f"{mode}: every all_reduce launched during backward",
                   f"{mode}: an all_reduce was launched after backward ended: no overlap")
    buckets = res["modes"]["bucketed"]["buckets"]
    cap = res["bucket_mb"] * 2**20
    yield (1 < len(buckets) < n and all(x >= cap for x in buckets[:-1]),
           f"bucketed: {len(buckets)} buckets, each closed once it reached --bucket-mb",
           f"bucketed: buckets of {buckets} bytes: each but the last should reach "
           f"{cap:,.0f} bytes, and there should be more than 1 and fewer than {n}")

"""Exercise checks for chapter 01 (DDP); see distkit/course/checks/__init__.py."""
from distkit.course.exercise import Fail, exercise
from distkit.course.checks import gradient_matches, losses_match


# A rank left alone in a collective (a broadcast whose src differs between ranks, an all_reduce
# one rank skips) fails at 30 s, not at the default 60: a step here takes well under a second,
# and 30 s leaves room for ranks that finish importing torch apart on a loaded machine.
@exercise("01.1", "ch01_ddp/exercises/ex01_manual_ddp.py", env={"COURSE_TIMEOUT_S": "30"})
def manual_ddp(run):
    b, samples = 8, 64
    single = None
    for flag, calls in (([], 21), (["--flat"], 1)):
        mode = "--flat" if flag else "per tensor"
        try:
            res = run("--batch-size", b, "--samples", samples, *flag)
        except Fail as fail:  # gloo's timeout: ranks in collectives that do not match
            hint = (": the ranks waited in collectives that do not match: every rank must make "
                    "the same calls in the same order, a broadcast with the same src on every "
                    "rank (src=0: rank 0 sends, the others receive)"
                    if "Timed out" in str(fail) else "")
            raise Fail(f"{fail}{hint}") from None
        ident = res["identical"]
        yield (ident["start"] is False, f"{mode}: the ranks start from different weights",
               f"{mode}: the ranks start from identical weights: the check of the broadcast "
               "proves nothing (keep torch.manual_seed(env.rank))")
        yield (ident["broadcast"], f"{mode}: after the broadcast, weights and buffers identical",
               f"{mode}: after the broadcast the ranks' weights or buffers still differ")
        # AdamW divides a constant scale out of its steps: the losses cannot show a missing / N
        yield gradient_matches(res["grad_check"], 1e-4, "the gradients after step 1",
                               "did you divide by the world size?",
                               "is every gradient summed over the ranks"
                               + (" (and copied back)?" if flag else "?"), label=f"{mode}: ")
        if single is None:  # the one-process reference, once, when the first losses are due
            single = run.single("ch01_ddp/train_single.py", "--batch-size", run.nproc * b,
                                "--samples", samples)["losses"]
        yield losses_match(res["losses"], single, 1e-4,
                           f"train_single.py --batch-size {run.nproc * b}'s")
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
        # what each step launched first (a miscount points at the mistake), then the numbers
        want = {"flat": 1, "per-param": n, "bucketed": len(r.get("buckets", []))}[mode]
        calls = r["calls_per_step"]
        yield (set(calls) == {want}, f"{mode}: {want} all_reduce(s) per step",
               f"{mode}: all_reduces per step {calls}, expected {want} every step: is "
               "everything reset for the next step?" if want in calls else
               f"{mode}: all_reduces per step {calls}, expected {want}")
        bytes_ = set(r["bytes_per_step"])
        yield (bytes_ == {grad_bytes}, f"{mode}: every gradient byte all-reduced once per step",
               f"{mode}: {sorted(bytes_)} bytes all-reduced per step, the gradients are "
               f"{grad_bytes:,}")
        if mode != "flat":
            during = all(c["launched"] < s["backward_end"] for s in r["steps"] for c in s["calls"])
            yield (during, f"{mode}: every all_reduce launched during backward",
                   f"{mode}: an all_reduce was launched after backward ended: no overlap")
        # deterministic (the last rank starts step 1's backward 0.5 s late): a finish() that
        # divides without waiting returns while the sums are still on their way
        # (a file from before this record: no check)
        early = [i for i, s_ in enumerate(r["steps"], 1) if not s_.get("waited", True)]
        yield (not early, f"{mode}: every all_reduce complete when finish() returns",
               f"{mode}: finish() returned at step {early[0]} while an all_reduce was still "
               "running: does it wait() on every Work before dividing? An async all_reduce "
               "writes the sum into the gradient later" if early else "")
        scale = r["grad_scale"]
        k = round(scale)
        why = (f": {scale:.2f}x one process's: are the summed gradients divided by N?"
               if k > 1 and abs(scale - k) < 1e-3 * k else "")
        for what, key, tol in (("gradients", "grad", 1e-5), ("losses", "loss", 1e-5),
                               ("weights", "weight", 1e-4)):
            gap = r[f"max_{key}_diff"]
            yield (gap < tol, f"{mode}: {what} = one process's (< {tol:.0e})",
                   f"{mode}: {what} differ from one process's by {gap:.1e} (tolerance {tol:.0e})"
                   + (why if what == "gradients" else ""))
    buckets = res["modes"]["bucketed"]["buckets"]
    cap = res["bucket_mb"] * 2**20
    yield (1 < len(buckets) < n and all(x >= cap for x in buckets[:-1]),
           f"bucketed: {len(buckets)} buckets, each closed once it reached --bucket-mb",
           f"bucketed: buckets of {buckets} bytes: each but the last should reach "
           f"{cap:,.0f} bytes, and there should be more than 1 and fewer than {n}")

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


def losses_match(mine, reference, tol, what="one process's"):
    """The usual check: every step's loss within tol of the reference's."""
    bad = first_diff(mine, reference, tol)
    return (len(mine) == len(reference) and bad is None,
            f"losses = {what} at every step (< {tol:.0e})",
            f"losses differ from {what} at step {bad[0]} by {bad[1]:.1e} (tolerance {tol:.0e})"
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
    # chapter 03's calculator: ZeRO-1's optimizer bytes of the padded S x N values, over N ranks,
    # + AdamW's one step counter (the shard is one tensor)
    from distkit.memory import FP32_ADAMW, model_state_bytes
    want = [int(model_state_bytes(S * N, N, 1, FP32_ADAMW)["optimizer"]) + 4] * N
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


@exercise("01.1", "ch01_ddp/exercises/ex01_manual_ddp.py")
def manual_ddp(run):
    b, samples = 8, 64
    single = None
    for flag, calls in (([], 21), (["--flat"], 1)):
        mode = "--flat" if flag else "per tensor"
        res = run("--batch-size", b, "--samples", samples, *flag)
        ident = res["identical"]
        yield (ident["start"] is False, f"{mode}: the ranks start from different weights",
               f"{mode}: the ranks start from identical weights: the check of the broadcast "
               "proves nothing (keep torch.manual_seed(env.rank))")
        yield (ident["broadcast"], f"{mode}: after the broadcast, weights and buffers identical",
               f"{mode}: after the broadcast the ranks' weights or buffers still differ")
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


@exercise("02.1", "ch02_model_parallel/exercises/ex02_gpipe_by_hand.py")
def gpipe(run):
    layers = 3 if run.nproc == 3 else 2  # every stage as many decoder layers
    m, batch, samples = 4, 16, 64
    args = ("--microbatches", m, "--layers", layers, "--samples", samples, "--epochs", 1)
    single = run.single("ch02_model_parallel/naive_split.py", "--layers", layers,
                        "--samples", samples, "--epochs", 1)["losses"]
    res = run(*args)
    yield losses_match(res["losses"], single, 1e-4, "naive_split.py's on one process")
    steps = samples // batch
    forwards = [sum(s[0] == "F" for s in spans) for spans in res["spans"]]
    yield (forwards == [m * steps] * run.nproc,
           f"every stage ran {m} forwards per step ({m * steps} in {steps} steps)",
           f"forwards timed per stage: {forwards}, expected {m * steps} each "
           "(timeline.span(\"F\", i) around each micro-batch's compute)")
    backwards = [sum(s[0] == "B" for s in spans) for spans in res["spans"]]
    yield (backwards == [m * steps] * run.nproc, f"and {m} backwards per step",
           f"backwards timed per stage: {backwards}, expected {m * steps} each")


@exercise("02.2", "ch02_model_parallel/exercises/ex02_megatron_mlp.py", nprocs=(2, 4))
def megatron(run):
    res = run()
    act = res["activation_bytes"]
    for way in ("forward", "backward"):
        n, b = res["all_reduce_calls"][way], res["all_reduce_bytes"][way]
        yield ((n, b) == (1, act), f"{way}: 1 all_reduce of one [B, S, h] activation ({act} B)",
               f"{way}: {n} all_reduce(s) of {b} B in all; Megatron's MLP makes 1 of {act} B")
    for name, errors in res["errors"].items():
        for what, err in errors.items():
            tol = res["tolerances"][what]
            yield (err < tol, f"{name}: {what} = the unsharded model's (< {tol:g})",
                   f"{name}: {what} differs from the unsharded model's by {err:.1e} "
                   f"(tolerance {tol:g})")


@exercise("04.1", "ch04_fsdp2/exercises/ex04_meta_init.py")
def meta_init(run):
    res = run("--steps", "3")
    N = run.nproc
    names = ["model.rotary_emb.inv_freq", "model.rotary_emb.original_inv_freq"]
    exact = res["inv_freq_exact"]
    yield (exact == [True] * N, "inv_freq and original_inv_freq bit-exact on every rank",
           f"inv_freq or original_inv_freq differ from the reference's on ranks "
           f"{[r for r, ok in enumerate(exact) if not ok]}: {', '.join(names)} are in no "
           "state dict, so they must be recomputed")
    yield losses_match(res["losses"], res["single_losses"], res["tolerance"])
    held, whole = res["param_bytes_held"], res["param_bytes"]
    yield (sum(held) == whole and max(held) < whole,
           f"each rank holds its shard only: {held} bytes of {whole:,}",
           f"parameter bytes held per rank {held}, of {whole:,}: each should hold a shard")


@exercise("04.2", "ch04_fsdp2/exercises/ex04_grad_accum.py")
def grad_accum(run):
    k = 4
    res = run("--steps", "2", "--micro-batches", k)
    units = res["fsdp_units"]
    for mode, r in res["modes"].items():
        yield losses_match(r["losses"], res["single_losses"], res["tolerance"],
                           "one process's on the global batch")
        want = k * units if mode == "every" else units
        got = {c.get("_reduce_scatter_base_", 0) for c in r["counts"]}
        label = {"every": "sync every micro-batch", "last": "sync on the last only"}[mode]
        yield (got == {want}, f"{label}: {want} reduce-scatters per step ({units} FSDP units)",
               f"{label}: {sorted(got)} reduce-scatters per step, expected {want} "
               f"({units} FSDP units{', once per step' if mode == 'last' else ''})")


@exercise("05.1", "ch05_checkpoint/exercises/ex05_resume.py")
def resume(run):
    # 4 steps per epoch at any world size; the checkpoint mid-epoch, the resume into the next
    N = run.nproc
    res = run("--steps", "8", "--save-at", "5", "--global-batch", 4 * N, "--samples", 16 * N,
              "--ckpt-dir", run.tmp / f"ckpt{N}")
    yield (res["loaded_equal"], "the loaded model + AdamW state = the saved one (sha256)",
           "the loaded model + AdamW state differ from the saved one")
    yield (res["resumed"]["steps"] == list(range(6, 9)), "the resume trains steps 6..8",
           f"the resume trained steps {res['resumed']['steps']}, not 6..8: Progress does not "
           "restore the steps done")
    for what, key in (("batch", "same_batch"), ("LR", "same_lr"), ("loss", "same_loss")):
        bad = [6 + i for i, ok in enumerate(res[key]) if not ok]
        yield (not bad, f"every resumed step: the same {what} as the uninterrupted run",
               f"step {bad[0]} differs from the uninterrupted run in its {what}: "
               f"{res['problem']}" if bad else "")
    yield (res["digest_equal"], "the final model + AdamW state identical (sha256)",
           "the final model + AdamW state differ from the uninterrupted run's")


@exercise("07.1", "ch07_debugging/exercises/ex07_early_stop.py", timeout=120)
def early_stop(run):
    res = run("--timeout", "15")  # a rank left waiting fails in 15 s, not the default 20
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

"""Exercise checks for chapter 04 (FSDP2); see distkit/course/checks/__init__.py."""
from distkit.course.exercise import Fail, exercise
from distkit.course.checks import gradient_matches, losses_match


@exercise("04.1", "ch04_fsdp2/exercises/ex04_meta_init.py")
def meta_init(run):
    try:  # .to() for to_empty(): torch's own error names the fix
        res = run("--steps", "3")
    except Fail as fail:  # torch's errors for a full state dict loaded as if it were sharded
        loading = ("state_dict is empty", "Error(s) in loading state_dict")
        hint = (": full_sd holds whole tensors, and only on rank 0: load it with "
                "set_model_state_dict, its StateDictOptions saying both"
                if any(s in str(fail) for s in loading) else "")
        raise Fail(f"{fail}{hint}") from None
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
        # the collectives first: a miscount says which micro-batch's sync is wrong
        want = k * units if mode == "every" else units
        got = {c.get("_reduce_scatter_base_", 0) for c in r["counts"]}
        label = {"every": "sync every micro-batch", "last": "sync on the last only"}[mode]
        hint = ("" if mode == "every" else ": is the sync off for all but the last micro-batch?"
                if max(got) > want else ": is the sync on again for the last micro-batch?")
        yield (got == {want}, f"{label}: {want} reduce-scatters per step ({units} FSDP units)",
               f"{label}: {sorted(got)} reduce-scatters per step, expected {want} "
               f"({units} FSDP units{', once per step' if mode == 'last' else ''}){hint}")
        ok, passed, failed = losses_match(
            r["losses"], res["single_losses"], res["tolerance"],
            "one process's on the global batch", label=f"{label}: ",
            scaled="is each micro-batch's loss divided by K?",
            later="the gradients of a step were not those of the whole batch"
            + ("" if mode == "every" else ": is the one backward that syncs the last one?"))
        # a loss 1/n of one process's: divided by more than K (by N too, as by hand in DDP?)
        first = r["losses"][0] / res["single_losses"][0]
        times = round(1 / first) if not ok and first else 0
        if times > 1 and abs(1 / first - times) < 1e-3 * times:
            failed += (f": {first:.2f}x: is the loss divided by more than K? (FSDP's "
                       "reduce-scatter already averages over the ranks)")
        yield ok, passed, failed
        # AdamW divides a constant scale out of its steps: a backward of the unscaled loss (the
        # log divided by K) trains like the right one; step 1's gradients show it
        if "grad_check" not in r:  # a file from before the gradient check (the starter changed)
            yield (False, "", "this file does not compare step 1's gradients: copy the "
                   "grad_norms / grad_check lines from the current starter (git diff shows them)")
            return
        yield gradient_matches(r["grad_check"], 1e-5, "step 1's gradients",
                               "is the loss you call backward() on divided by K?",
                               "the gradients of a step were not those of the whole batch",
                               label=f"{label}: ")
    # a second K: a constant that fits K = 4 (a "/ 4" for "/ K") fails here
    res2 = run("--steps", "1", "--micro-batches", 2)
    for mode, r in res2["modes"].items():
        label = {"every": "sync every micro-batch", "last": "sync on the last only"}[mode]
        yield gradient_matches(r["grad_check"], 1e-5, "step 1's gradients",
                               "is each micro-batch's loss divided by K, not by a number?",
                               "the gradients of a step were not those of the whole batch",
                               label=f"at K = 2, {label}: ",
                               divided_hint="is each micro-batch's loss divided by K, not by a "
                               "fixed number?")

"""Exercise checks for chapter 04 (FSDP2); see distkit/course/checks/__init__.py."""
from distkit.course.exercise import exercise
from distkit.course.checks import losses_match


@exercise("04.1", "ch04_fsdp2/exercises/ex04_meta_init.py")
def meta_init(run):
    res = run("--steps", "3")  # .to() for to_empty(): torch's own error names the fix
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
        yield losses_match(r["losses"], res["single_losses"], res["tolerance"],
                           "one process's on the global batch", label=f"{label}: ",
                           scaled="is each micro-batch's loss divided by K?",
                           later="the gradients of a step were not those of the whole batch")

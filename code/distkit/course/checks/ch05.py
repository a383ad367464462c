"""Exercise checks for chapter 05 (distributed checkpoints); see
distkit/course/checks/__init__.py."""
from distkit.course.exercise import exercise


@exercise("05.1", "ch05_checkpoint/exercises/ex05_resume.py")
def resume(run):
    # 4 steps per epoch at any world size; the checkpoint mid-epoch (step 5 of epoch 1), the
    # resume through the rest of it and across the next epoch's start (step 9): a skip that is
    # not reset at a new epoch shows there
    N = run.nproc
    res = run("--steps", "12", "--save-at", "5", "--global-batch", 4 * N, "--samples", 16 * N,
              "--ckpt-dir", run.tmp / f"ckpt{N}")
    yield (res["reshuffled"], "the uninterrupted run gives each epoch its own shuffle",
           "the uninterrupted run reads epoch 1 in epoch 0's order: does batches_after() give "
           "each epoch its own shuffle (set_epoch)?")
    # Against an independent reference: a plain `for epoch: set_epoch(epoch); for batch in
    # loader`. An off-by-one skip shifts the resume and the uninterrupted run alike.
    if "plain_order" not in res:  # a file from before this check (the starter changed)
        yield (False, "", "this file does not compare its batches with a plain loop: copy the "
               "`plain = []` lines from the current starter (git diff shows them)")
        return
    bad = [s for s, ok in enumerate(res["plain_order"], 1) if not ok]
    hint = (": every step read the next step's batch: batches_after(loader, 0) skips one "
            "(divmod(done, len(loader)), not done + 1)" if res["one_ahead"] else
            ": which epoch does step s fall in, (s - 1) // len(loader)? which batch of it?")
    yield (not bad, "the uninterrupted run reads step s's batch as a plain loop over the epochs "
           "does (epoch (s-1) // L, batch (s-1) % L)",
           f"step {bad[0]} of the uninterrupted run reads another batch than a plain loop over "
           f"the epochs (set_epoch, then every batch){hint}" if bad else "")
    yield (res["loaded_equal"], "the loaded model + AdamW state = the saved one (sha256)",
           "the loaded model + AdamW state differ from the saved one")
    yield (res["resumed"]["steps"] == list(range(6, 13)), "the resume trains steps 6..12",
           f"the resume trained steps {res['resumed']['steps']}, not 6..12: Progress does not "
           "restore the steps done")
    for what, key in (("batch", "same_batch"), ("LR", "same_lr"), ("loss", "same_loss")):
        bad = [6 + i for i, ok in enumerate(res[key]) if not ok]
        yield (not bad, f"every resumed step: the same {what} as the uninterrupted run",
               f"step {bad[0]} differs from the uninterrupted run in its {what}: "
               f"{res['problem']}" if bad else "")
    yield (res["digest_equal"], "the final model + AdamW state identical (sha256)",
           "the final model + AdamW state differ from the uninterrupted run's")

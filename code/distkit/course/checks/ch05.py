"""Exercise checks for chapter 05 (distributed checkpoints); see
distkit/course/checks/__init__.py."""
from distkit.course.exercise import exercise


@exercise("05.1", "ch05_checkpoint/exercises/ex05_resume.py")
def resume(run):
    # 4 steps per epoch at any world size; the checkpoint mid-epoch, the resume into the next
    N = run.nproc
    res = run("--steps", "8", "--save-at", "5", "--global-batch", 4 * N, "--samples", 16 * N,
              "--ckpt-dir", run.tmp / f"ckpt{N}")
    yield (res["reshuffled"], "the uninterrupted run gives each epoch its own shuffle",
           "the uninterrupted run reads epoch 1 in epoch 0's order: does batches_after() give "
           "each epoch its own shuffle (set_epoch)?")
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

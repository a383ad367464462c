"""Exercise checks for chapter 02 (model parallelism); see distkit/course/checks/__init__.py."""
from distkit.course.exercise import Fail, exercise
from distkit.course.checks import gradient_matches, losses_match, whole_factor


# A recv that names the wrong stage waits for gloo's timeout: 20 s here, not the default 60 (a
# step takes well under a second; 20 s leaves room for ranks that finish importing torch apart
# on a loaded machine, as 01.1's 30 s does)
@exercise("02.1", "ch02_model_parallel/exercises/ex02_gpipe_by_hand.py",
          env={"COURSE_TIMEOUT_S": "20"})
def gpipe(run):
    layers = 3 if run.nproc == 3 else 2  # every stage as many decoder layers
    m, batch, samples = 4, 16, 64
    args = ("--microbatches", m, "--layers", layers, "--samples", samples, "--epochs", 1)
    reference = run.single("ch02_model_parallel/naive_split.py", "--layers", layers,
                           "--samples", samples, "--epochs", 1)
    single = reference["losses"]
    try:
        res = run(*args)
    except Fail as fail:  # a received activation that does not require grad: no grad to send
        hint = (": a stage's input gradient is None: does the received activation require grad?"
                if "`tensor` of type torch.Tensor" in str(fail) else  # c10d's own check
                ": a stage waited for a tensor no stage sent: does each recv name the stage that "
                "sends it (activations come from rank - 1, gradients from rank + 1)?"
                if "Timed out" in str(fail) or "wait timeout" in str(fail) else "")
        # gloo's timeout, or the store's when the rank that fails first was setting up a
        # pair with a peer that never came
        raise Fail(f"{fail}{hint}") from None
    yield losses_match(res["losses"], single, 1e-4, "naive_split.py's on one process",
                       scaled="is each micro-batch's loss divided by m?",
                       divided="is the loss divided by more than m? (a pipeline's ranks hold "
                       "stages, not shards of the data: no division by the world size)")
    # AdamW divides a constant scale out of its steps: a backward of the unscaled loss with the
    # log divided by m trains like the right one; step 1's gradients show it
    from distkit.dist import grad_check  # (imports torch: only this check needs it)
    if "grad_norms" not in res:  # a file from before the gradient check (the starter changed)
        yield (False, "", "this file does not record step 1's gradients: copy the grad_norms "
               "lines from the current starter (git diff shows them)")
        return
    yield gradient_matches(grad_check(res["grad_norms"], reference["grad_norms"]), 1e-4,
                           "step 1's gradients, every stage's",
                           "is the loss you call backward() on divided by m?",
                           "the gradients of a step were not those of the whole batch",
                           divided_hint="is the loss divided by more than m?")
    # a second m: a constant that fits m = 4 (a "/ 4" for "/ m") fails here; the reference is
    # the same one-process step (m does not change what the batch's mean is)
    res2 = run("--microbatches", 2, *args[2:])
    yield gradient_matches(grad_check(res2["grad_norms"], reference["grad_norms"]), 1e-4,
                           "step 1's gradients, every stage's",
                           "is each micro-batch's loss divided by m, not by a number?",
                           "the gradients of a step were not those of the whole batch",
                           label="at m = 2: ",
                           divided_hint="is each micro-batch's loss divided by m, not by a fixed "
                           "number?")
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
    which = {"forward": "g's forward all-reduces, f's passes x on",
             "backward": "f's backward all-reduces, g's passes the gradient on"}
    for way in ("forward", "backward"):
        n, b = res["all_reduce_calls"][way], res["all_reduce_bytes"][way]
        yield ((n, b) == (1, act), f"{way}: 1 all_reduce of one [B, S, h] activation ({act} B)",
               f"{way}: {n} all_reduce(s) of {b} B in all; Megatron's MLP makes 1 of {act} B: "
               f"{which[way]}")
    for name, errors in res["errors"].items():
        for what, err in errors.items():
            tol = res["tolerances"][what]
            # a whole factor: a sum or a mean too many (a file without "scales": no hint)
            factor = whole_factor(
                res.get("scales", {}).get(name, {}).get(what), "is a value every rank already "
                "holds whole all-reduced, summing N copies?", "is a sum averaged? f's backward "
                "and g's forward add the ranks' partial results: a plain all-reduce, no / N")
            yield (err < tol, f"{name}: {what} = the unsharded model's (< {tol:g})",
                   f"{name}: {what} differs from the unsharded model's by {err:.1e} "
                   f"(tolerance {tol:g})" + (f": {factor[0]}: {factor[1]}" if factor else ""))

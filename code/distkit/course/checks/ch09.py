"""Exercise checks for chapter 09 (context and expert parallelism); see
distkit/course/checks/__init__.py."""
from distkit.comm import NAMES
from distkit.course.exercise import Fail, exercise


def _bounded(res, what, passed, failed):
    """A check that res["errors"][what] (or res[what]) is below the script's tolerance."""
    err = res["errors"][what] if "errors" in res else res[what]
    tol = res["tolerance"][what] if isinstance(res["tolerance"], dict) else res["tolerance"]
    return err < tol, f"{passed} (< {tol:.0e})", f"{failed}: off by {err:.1e} (tolerance {tol:.0e})"


@exercise("09.1", "ch09_long_context_moe/exercises/ex09_online_softmax.py")
def online_softmax(run):
    res = run()
    yield _bounded(res, "two blocks: out", "two merged blocks = attention over all the keys",
                   "the merged output is not attention over both blocks: each block's output is "
                   "normalised by its own denominator; reweight it by its share of the new one, "
                   "exp(lse_block - lse)")
    yield _bounded(res, "two blocks: lse", "lse of two merged blocks = log-sum-exp of all scores",
                   "the merged lse is not the log-sum-exp of both blocks' scores: over both, "
                   "the softmax's denominator is exp(lse_a) + exp(lse_b)")
    if "large scores: out" not in res["errors"]:  # a file from before this check
        yield (False, "", "this file does not run the large-scores check: copy its section 2 "
               "(SHIFT = 1000.0 ...) from the current starter (git diff shows it)")
        return
    for what in ("out", "lse"):
        yield _bounded(res, f"large scores: {what}", f"large scores (lse + 1000): the merged "
                       f"{what} is still right", f"with every score 1000 larger the merged {what} "
                       "is wrong: exp of an lse overflows (exp(1000) is inf even in float64); "
                       "use torch.logaddexp, and weights exp(lse_block - lse)")
    yield _bounded(res, "three blocks: out", "three blocks merged in either order = the whole",
                   "three blocks merged pairwise differ from attention over all of them: the "
                   "lse you return must be the merged one, since the next merge uses it")
    yield _bounded(res, "ring: out", f"inside the ring on {run.nproc} ranks = attention over "
                   "the whole sequence",
                   f"ring attention with your merge on {run.nproc} ranks differs from attention "
                   "over the whole sequence")


@exercise("09.2", "ch09_long_context_moe/exercises/ex09_ulysses.py")
def ulysses(run):
    res = run()
    n = run.nproc
    yield _bounded(res, "layout", f"each rank holds its H/{n} heads of all the tokens, in order",
                   f"seq_to_heads's result is not this rank's heads (rank j: heads j H/{n} ... "
                   f"(j+1) H/{n} - 1) of every token in order: check which head group goes "
                   "first to the all-to-all and how the received chunks are laid out")
    if "layout in a sub-group" not in res["errors"]:  # a file from before this check
        yield (False, "", "this file does not run the sub-group check: copy its section 1b "
               "from the current starter (git diff shows it)")
        return
    yield _bounded(res, "layout in a sub-group", f"and in groups smaller than the world (ranks "
                   f"0..{n - 2}, and {n - 1} alone), its heads of the group's tokens",
                   "in a group smaller than the world (Ulysses' cp group inside a (dp, cp) "
                   "mesh) seq_to_heads's result is wrong: is N the group's size, "
                   "dist.get_world_size(group), not the world's?")
    # the exercise's point: one all-to-all (an all-gather, then a slice, gives the same values
    # and moves N times the data), c10d's or the functional collectives' name (distkit.comm)
    got = {NAMES.get(op, op).replace("_", "-"): calls
           for op, calls in res.get("collectives", {}).items()}
    yield (got == {"all-to-all": 1}, "seq_to_heads makes one all-to-all, nothing else",
           f"seq_to_heads makes {got or 'no collective'}, not one all-to-all"
           + (": an all-gather, then a slice, gives the same heads but moves the whole sequence "
              "to every rank; Ulysses sends each rank only its heads (all_to_all_single)"
              if "all-gather" in got else ""))
    yield _bounded(res, "attention", "Ulysses attention = attention over the whole sequence",
                   "Ulysses attention built on your seq_to_heads differs from attention over "
                   "the whole sequence")
    yield _bounded(res, "gradients", "gradients of q, k, v = the whole sequence's",
                   "the gradients of q, k, v differ from the whole sequence's: is every step "
                   "of seq_to_heads differentiable (all_to_all_single_autograd, no .detach())?")


@exercise("09.3", "ch09_long_context_moe/exercises/ex09_ep_combine.py")
def ep_combine(run):
    # not Mixtral's top-2, which a hard-coded k would fit: top-3 (top-1 would renormalise every
    # weight to 1, where an unweighted or detached combine is right by accident)
    k = 3
    try:
        res = run("--top-k", k)
    except Fail as fail:
        hint = (f": at --top-k {k}: is k taken from weights' shape (T, k), not fixed?"
                if "is invalid for input of size" in str(fail) else "")
        raise Fail(f"{fail}{hint}") from None
    yield (res["rows back at their tokens"], f"every expert output back at its (token, slot), "
           f"top-{k}",
           "the rows do not come back to their tokens: row i of the sorted outputs is pair "
           "order[i], so it goes to position order[i] (a scatter, the inverse of the sort), "
           "not to position i of expert_out[order]")
    yield (res["weighted by the router"], "each slot weighted by the router's weight",
           "the outputs are not weighted by the router: a token's output is the sum over its k "
           "slots of weight x that expert's output")
    for what, label in (("outputs", "the layer's outputs"), ("loss", "the loss"),
                        ("gradients", "every gradient (experts, router)")):
        yield _bounded(res, what, f"{label} = one process's with all the experts",
                       f"{label} differ from one process's with all the experts")

"""The exercise checker's entries, one module per chapter (chNN.py), and what they share.

Each entry launches the learner's file as its solution is tested, at each world size, and yields
(ok, what passed, what failed) one check at a time: the first failure is the line the learner
reads, naming the first thing wrong with its number. CHAPTERS lists the modules
distkit.course.exercise imports to fill its registry.
"""

CHAPTERS = ["ch00", "ch01", "ch02", "ch03", "ch04", "ch05", "ch06", "ch07", "ch08", "ch09", "ch10"]


def first_diff(mine, reference, tol):
    """(step, difference) of the first step whose values differ by tol or more, else None."""
    for step, (x, y) in enumerate(zip(mine, reference), 1):
        if abs(x - y) >= tol:
            return step, abs(x - y)
    return None


def losses_match(mine, reference, tol, what="one process's", scaled=None, later=None,
                 label=""):
    """The usual check: every step's loss within tol of the reference's. Hints for the failed
    line: `scaled`, when the first step off is a whole multiple k > 1 of the reference's (a
    loss summed where it should be averaged: ': {k}x: {scaled}'); `later`, when step 1
    matched and a later step is off (the update, not the forward: ', after a first step that
    matched: {later}'). `label` prefixes both lines (e.g. the mode)."""
    bad = first_diff(mine, reference, tol)
    hint = ""
    if bad and scaled:
        k = mine[bad[0] - 1] / reference[bad[0] - 1]
        if round(k) > 1 and abs(k - round(k)) < 1e-3 * k:
            hint = f": {round(k)}x: {scaled}"
    if bad and later and bad[0] > 1:
        hint = f", after a first step that matched: {later}"
    return (len(mine) == len(reference) and bad is None,
            f"{label}losses = {what} at every step (< {tol:.0e})",
            f"{label}losses differ from {what} at step {bad[0]} by {bad[1]:.1e} (tolerance "
            f"{tol:.0e}){hint}" if bad else f"{label}{len(mine)} losses for {len(reference)} steps")


def gradient_matches(check, tol, subject, scaled_hint, off_hint, label="", be="are"):
    """A script's step-1 gradient check, {"gap": max |mine - one process's| / max |one
    process's|, "scale": <mine, one process's> / <one process's, one process's>} (None: no
    gradient), as (ok, passed, failed). `subject` names what was compared ("the gradients
    after step 1", and `be` its verb); a whole multiple k > 1 of one process's gradient is
    named with `scaled_hint` (a sum where a mean was due), 1/k as divided too often, any other
    gap with `off_hint`."""
    gap, scale = check["gap"], check["scale"]
    passed = f"{label}{subject} = one process's (< {tol:.0e} of the largest)"
    if gap is None:
        return False, passed, f"{label}{subject} {be} None: {off_hint}"
    if gap < tol:
        return True, passed, ""
    for k, hint in ((scale, scaled_hint), (1 / scale if scale else 0, "divided once too often?")):
        if round(k) > 1 and abs(k - round(k)) < 1e-3 * k:
            return False, passed, f"{label}{subject} {be} {scale:.2f}x one process's: {hint}"
    return False, passed, (f"{label}{subject} {be} {gap:.1e} (of the largest) away from one "
                           f"process's: {off_hint}")

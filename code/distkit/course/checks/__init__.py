"""The exercise checker's entries, one module per chapter (chNN.py), and what they share.

Each entry launches the learner's file as its solution is tested, at each world size, and yields
(ok, what passed, what failed) one check at a time: the first failure is the line the learner
reads, naming the first thing wrong with its number. CHAPTERS lists the modules
distkit.course.exercise imports to fill its registry.
"""

import math

CHAPTERS = ["ch00", "ch01", "ch02", "ch03", "ch04", "ch05", "ch06", "ch07", "ch08", "ch09", "ch10"]


def first_diff(mine, reference, tol):
    """(step, difference) of the first step whose values differ by tol or more, else None. A
    NaN or an infinity counts as a difference (`abs(nan - y) >= tol` is False: compared with
    `not <`)."""
    for step, (x, y) in enumerate(zip(mine, reference), 1):
        if not abs(x - y) < tol:
            return step, abs(x - y)
    return None


def whole_factor(ratio, up, down):
    """(ratio as shown, hint) when `ratio` (mine / the reference's) is a whole multiple k > 1
    ('4x', with `up`: a sum where a mean was due) or its inverse 1/k ('0.50x', with `down`: a
    division once too often); None otherwise (NaN and inf included), or when that way's hint
    is None."""
    if not ratio or not math.isfinite(ratio):
        return None
    for k, shown, hint in ((ratio, f"{round(ratio)}x", up), (1 / ratio, f"{ratio:.2f}x", down)):
        if hint and round(k) > 1 and abs(k - round(k)) < 1e-3 * k:
            return shown, hint
    return None


def losses_match(mine, reference, tol, what="one process's", scaled=None, later=None,
                 label="", divided=None):
    """The usual check: every step's loss within tol of the reference's (a NaN or inf loss
    fails). Hints for the failed line: `scaled`, when the first step off is a whole multiple
    k > 1 of the reference's (a loss summed where it should be averaged: ': {k}x: {scaled}'),
    `divided` when it is 1/k of it (': 0.50x: {divided}'); `later`, when step 1 matched and a
    later step is off (the update, not the forward: ', after a first step that matched:
    {later}'). `label` prefixes both lines (e.g. the mode)."""
    bad = first_diff(mine, reference, tol)
    hint = ""
    if bad and not math.isfinite(mine[bad[0] - 1]):
        hint = ": the loss is not a finite number (NaN or inf)"
    elif bad and (scaled or divided) and reference[bad[0] - 1]:
        factor = whole_factor(mine[bad[0] - 1] / reference[bad[0] - 1], scaled, divided)
        hint = f": {factor[0]}: {factor[1]}" if factor else ""
    if bad and later and bad[0] > 1:
        hint = f", after a first step that matched: {later}"
    return (len(mine) == len(reference) and bad is None,
            f"{label}losses = {what} at every step (< {tol:.0e})",
            f"{label}losses differ from {what} at step {bad[0]} by {bad[1]:.1e} (tolerance "
            f"{tol:.0e}){hint}" if bad else f"{label}{len(mine)} losses for {len(reference)} steps")


def simple_fraction(ratio):
    """(p, q) when `ratio` is p/q for small whole p and q > 1 in lowest terms (3/2: a sum over 3
    ranks divided by 2), within 1e-3 of it; None otherwise."""
    if not ratio or not math.isfinite(ratio) or ratio < 0:
        return None
    for q in range(2, 9):
        p = round(ratio * q)
        if p >= 1 and math.gcd(p, q) == 1 and abs(ratio - p / q) < 1e-3 * ratio:
            return p, q
    return None


def gradient_matches(check, tol, subject, scaled_hint, off_hint, label="", be="are",
                     divided_hint="divided once too often?",
                     fraction_hint="divided by a fixed number where a count belongs (the world "
                     "size, m or K)?"):
    """A script's step-1 gradient check, {"gap": max |mine - one process's| / max |one
    process's|, "scale": <mine, one process's> / <one process's, one process's>} (None: no
    gradient), as (ok, passed, failed). `subject` names what was compared ("the gradients
    after step 1", and `be` its verb); a whole multiple k > 1 of one process's gradient is
    named with `scaled_hint` (a sum where a mean was due), 1/k with `divided_hint`, a simple
    fraction p/q (at 3 ranks a sum divided by 2: 3/2) with `fraction_hint`, any other gap with
    `off_hint`; NaN and inf fail."""
    gap, scale = check["gap"], check["scale"]
    passed = f"{label}{subject} = one process's (< {tol:.0e} of the largest)"
    if gap is None:
        return False, passed, f"{label}{subject} {be} None: {off_hint}"
    if not (math.isfinite(gap) and scale is not None and math.isfinite(scale)):
        return False, passed, f"{label}{subject} {be} not finite (NaN or inf): {off_hint}"
    if gap < tol:
        return True, passed, ""
    factor = whole_factor(scale, scaled_hint, divided_hint)
    if factor:
        return False, passed, f"{label}{subject} {be} {scale:.2f}x one process's: {factor[1]}"
    fraction = simple_fraction(scale) if fraction_hint else None
    if fraction:
        return False, passed, (f"{label}{subject} {be} {scale:.2f}x one process's "
                               f"({fraction[0]}/{fraction[1]}): {fraction_hint}")
    return False, passed, (f"{label}{subject} {be} {gap:.1e} (of the largest) away from one "
                           f"process's: {off_hint}")

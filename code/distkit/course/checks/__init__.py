"""The exercise checker's entries, one module per chapter (chNN.py), and what they share.

Each entry launches the learner's file as its solution is tested, at each world size, and yields
(ok, what passed, what failed) one check at a time: the first failure is the line the learner
reads, naming the first thing wrong with its number. CHAPTERS lists the modules
distkit.course.exercise imports to fill its registry.
"""

CHAPTERS = ["ch00", "ch01", "ch02", "ch03", "ch04", "ch05", "ch06", "ch07", "ch08"]


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

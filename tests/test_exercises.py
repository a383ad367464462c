"""Every exercise: one source, and a checker that reports an untouched starter's first TODO.

The starters are generated from their solutions (distkit/course/exercise.py; `make starters`): a
committed starter that differs from its generated form fails here. Every starter registered with
the checker is checked untouched, in this process: the checker reads the file for a todo() left
before it launches anything, so no process starts here. Each chapter's
tests/test_chNN_exercises.py runs the checker on its solution (passes) and on a wrong answer
(the failure it names).
"""
import subprocess
import sys

import pytest

from conftest import CODE, ROOT, launcher_env
from distkit.course import exercise as ex

REGISTRY = ex.load_registry()
# every exercise in the course, by its solution (those not yet converted have no regions)
SOLUTIONS = [p for p in ex.solutions() if "### BEGIN SOLUTION" in p.read_text()]


def test_committed_starters_are_generated():
    """Fix: `make starters`, then commit the starters."""
    assert [str(p.relative_to(ROOT)) for p in ex.write_starters(check_only=True)] == []


@pytest.mark.parametrize("solution", SOLUTIONS, ids=lambda p: p.stem)
def test_every_exercise_has_a_checker(solution):
    starter = str(ex.starter_of(solution).relative_to(CODE))
    assert starter in {e.starter for e in REGISTRY.values()}


@pytest.mark.parametrize("ex_id", sorted(REGISTRY))
def test_untouched_starter_reports_its_first_todo(ex_id):
    """The first region's message, where its todo() is: one FAIL line, nothing launched."""
    entry = REGISTRY[ex_id]
    solution = (CODE / entry.starter.replace("/exercises/", "/solutions/")).read_text()
    first = next(line.split(":", 1)[1].strip() for line in solution.splitlines()
                 if line.strip().startswith("### BEGIN SOLUTION:"))
    starter = (CODE / entry.starter).read_text().splitlines()
    line = next(i for i, text in enumerate(starter, 1) if text.strip() == f'todo("{first}")')
    ok, lines = ex.check(ex_id, echo=lambda _: None)
    assert not ok
    assert lines == [f"FAIL TODO left at code/{entry.starter}:{line}: {first}"]


def test_starter_of_a_region():
    """The hint becomes the TODO(you) comment (re-wrapped), the message the todo() call; a region
    without a message is dropped, its hint kept as a comment; the rest is kept as it is."""
    solution = "\n".join([
        "x = 1",
        "def f():",
        "    ### BEGIN SOLUTION: f: return the answer",
        "    ### HINT the goal, the invariant",
        "    ### HINT and the API to look up.",
        "    return 42",
        "    ### END SOLUTION",
        "",
        "### BEGIN SOLUTION",
        "# Answers: 1. 42",
        "### END SOLUTION",
        ""])
    assert ex.make_starter(solution, "ex.py") == "\n".join([
        "# Yours to fill in (generated from ../solutions/ex.py).",
        "x = 1",
        "def f():",
        "    # TODO(you): the goal, the invariant and the API to look up.",
        '    todo("f: return the answer")',
        ""])


@pytest.mark.parametrize("text, error", [
    ("### BEGIN SOLUTION: a\nx = 1\n", "never closed"),
    ("### BEGIN SOLUTION: a\n### BEGIN SOLUTION: b\n### END SOLUTION\n", "nested"),
    ("x = 1\n### END SOLUTION\n", "without a BEGIN"),
    ('### BEGIN SOLUTION: say "hi"\n### END SOLUTION\n', "may not hold"),
])
def test_malformed_regions_are_one_clear_error(text, error):
    with pytest.raises(ValueError, match=error):
        ex.make_starter(text, "ex.py")


def test_make_exercise_runs_the_checker():
    """`make exercise EX=...` (the list without EX; an unknown id: one line, exit 1)."""
    def make(*args):
        return subprocess.run(["make", "-s", "--no-print-directory", *args], cwd=ROOT,
                              capture_output=True, text=True, env=launcher_env())
    listing = make("exercise")
    assert listing.returncode == 0, listing.stderr
    assert "03.1  code/ch03_zero/exercises/ex03_zero1_by_hand.py  (checked at 2, 3 ranks)" \
        in listing.stdout.splitlines()
    first = make("exercise", "EX=03.1")
    assert first.returncode != 0
    assert first.stdout.startswith("FAIL TODO left at code/ch03_zero/exercises/ex03_zero1_by_hand")
    unknown = subprocess.run([sys.executable, "-m", "distkit.course.exercise", "9.9"], cwd=ROOT,
                             capture_output=True, text=True, env=launcher_env())
    assert unknown.returncode == 1
    assert unknown.stderr.startswith("distkit.course.exercise: no exercise '9.9'; known: 00.1, 00.2")

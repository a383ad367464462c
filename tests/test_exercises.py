"""Every exercise: one source, and a checker that reports an untouched starter's first TODO.

The starters are generated from their solutions (distkit/course/exercise.py; `make starters`): a
committed starter that differs from its generated form fails here, and `make starters` leaves a
starter someone edited as it is (it names it; FORCE=1 overwrites, keeping a .bak). Every starter
registered with the checker is checked untouched, in this process: the checker reads the file for
a todo() left, or a syntax error, before it launches anything, so no process starts here (the
GPU test fakes the launcher). Each chapter's tests/test_chNN_exercises.py runs the checker on
its solution (passes) and on the wrong answers a learner plausibly writes (the failure each
names).
"""
import json
import shutil
import subprocess
import sys
from pathlib import Path

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
    assert unknown.stderr.startswith("distkit.course.exercise: no exercise '9.9'; known: 00.1, "
                                     "00.2")


# --- a file that does not compile: one line, nothing launched ---------------------------------

@pytest.mark.parametrize("edit, error", [
    ("x = (", "'(' was never closed"),
    ("  y = 1", "unexpected indent"),
    ("return 1", "'return' outside function"),  # compile() finds it, ast.parse() does not
])
def test_a_file_that_does_not_compile_is_one_line(tmp_path, edit, error):
    """Mid-edit, a learner's file often does not parse: FAIL with FILE:LINE, no traceback."""
    solution = (CODE / "ch00_collectives/solutions/ex00_global_mean.py").read_text().splitlines()
    at = next(i for i, line in enumerate(solution) if line.startswith("env = setup()"))
    path = tmp_path / "ex00_global_mean.py"
    path.write_text("\n".join(solution[:at] + [edit] + solution[at:]) + "\n")
    ok, lines = ex.check("00.2", path, echo=lambda _: None)
    assert not ok
    assert lines == [f"FAIL syntax error at {path}:{at + 1}: {error}"]
    cli = subprocess.run([sys.executable, "-m", "distkit.course.exercise", "00.2", "--file",
                          str(path)], cwd=ROOT, capture_output=True, text=True,
                         env=launcher_env())
    assert (cli.returncode, cli.stdout, cli.stderr) == (1, lines[0] + "\n", "")


def test_a_missing_file_is_one_line(tmp_path):
    ok, lines = ex.check("00.2", tmp_path / "nowhere.py", echo=lambda _: None)
    assert not ok
    assert lines == [f"FAIL cannot read {tmp_path / 'nowhere.py'}: No such file or directory"]


def test_a_launch_error_names_its_line():
    """The first exception line of the ranks' output, with its line in the checked file."""
    out = "\n".join([
        "[rank1]: Traceback (most recent call last):",
        '[rank1]:   File "/x/ex.py", line 12, in <module>',
        "[rank1]:     f()",
        '[rank1]:   File "/x/ex.py", line 7, in f',
        "[rank1]:     y = undefined",
        "[rank1]: NameError: name 'undefined' is not defined",
        "E1127 torch.distributed.elastic.multiprocessing.api: failed (exitcode: 1)"])
    assert ex._launch_error(out, Path("/x/ex.py")) == \
        "NameError: name 'undefined' is not defined (at /x/ex.py:7)"
    assert ex._launch_error(out, Path("/y/other.py")) == \
        "NameError: name 'undefined' is not defined"


def test_a_launch_error_reads_its_own_ranks_traceback():
    """Two ranks fail alike and their tracebacks interleave (seen in make test-nproc, two test
    files at a time): the line is the failing rank's innermost frame, not the other rank's
    outer one printed between."""
    out = "\n".join([
        "[rank0]: Traceback (most recent call last):",
        '[rank0]:   File "/x/ex.py", line 279, in <module>',
        "[rank0]:     sync.finish()",
        '[rank0]:   File "/x/ex.py", line 232, in finish',
        "[rank1]: Traceback (most recent call last):",
        '[rank1]:   File "/x/ex.py", line 279, in <module>',
        "[rank0]:     assert len(self.inflight) == len(self.buckets)",
        "[rank0]: AssertionError: a bucket's all_reduce was never launched"])
    assert ex._launch_error(out, Path("/x/ex.py")) == \
        "AssertionError: a bucket's all_reduce was never launched (at /x/ex.py:232)"


def test_a_launch_error_is_the_cause_not_a_rank_that_saw_another_leave():
    """Whichever rank's output comes first: the rank that failed (or timed out) is named, not the
    one that found its peer gone."""
    gone = "[rank0]: RuntimeError: [../gloo/transport/tcp/pair.cc:553] Connection closed by peer"
    for cause in ("[rank1]: NameError: name 'undefined' is not defined",
                  "[rank1]: RuntimeError: [../unbound_buffer.cc:78] Timed out waiting 60000ms "
                  "for recv operation to complete"):
        out = "\n".join([gone, cause, "E1127 torch.distributed.elastic: failed (exitcode: 1)"])
        assert ex._launch_error(out) == cause.removeprefix("[rank1]: ")
    assert ex._launch_error(gone) == gone.removeprefix("[rank0]: ")  # nothing else to say


# --- a GPU node with fewer GPUs than ranks: the CPU, and a line that says so -------------------

def test_fewer_gpus_than_ranks_checks_on_the_cpu(tmp_path, monkeypatch):
    """Faked: 1 GPU visible, COURSE_DEVICE unset. A launcher stand-in writes the device the
    launch was given; 1 rank keeps the scripts' choice (the GPU), 2 ranks run on the CPU."""
    launcher = tmp_path / "launcher.sh"
    launcher.write_text('#!/bin/sh\nfor a; do out="$a"; done\n'
                        'printf \'{"nproc": %s, "device": "%s"}\' "$1" "$COURSE_DEVICE" > "$out"\n')
    launcher.chmod(0o755)
    script = tmp_path / "ex.py"
    script.write_text("print('no todo here')\n")

    def checks(run):
        res = run()
        yield True, f"launched at {res['nproc']} ranks, COURSE_DEVICE={res['device']!r}", ""

    monkeypatch.setattr(ex, "LAUNCHER", launcher)
    monkeypatch.setattr(ex, "gpus_visible", lambda: 1)
    monkeypatch.delenv("COURSE_DEVICE")
    monkeypatch.setitem(ex.REGISTRY, "99.9", ex.Exercise("99.9", str(script), (1, 2), checks))
    ok, lines = ex.check("99.9", script, echo=lambda _: None)
    assert ok, lines
    assert lines[1:] == [
        "PASS [1 rank] launched at 1 ranks, COURSE_DEVICE=''",
        "NOTE [2 ranks] this machine has 1 GPU(s), fewer than 2 ranks (one GPU each): checking "
        "at 2 ranks on the CPU (gloo) instead",
        "PASS [2 ranks] launched at 2 ranks, COURSE_DEVICE='cpu'"]
    monkeypatch.setenv("COURSE_DEVICE", "cuda")  # asked for: a clear line, nothing launched
    ok, lines = ex.check("99.9", script, nprocs=(2,), echo=lambda _: None)
    assert not ok
    assert lines[1:] == ["FAIL [2 ranks] COURSE_DEVICE=cuda, but this machine has 1 GPU(s) for "
                         "2 ranks: unset it, and the checker runs these ranks on the CPU"]


# --- make starters / make exercises: a learner's edits stay --------------------------------------

@pytest.fixture
def copy(tmp_path):
    """The course's Makefile, helper package, solutions and starters in tmp_path (the venv
    linked): `make` there works on the copy."""
    for name in ("Makefile", "requirements.txt"):
        shutil.copy2(ROOT / name, tmp_path / name)  # the venv stays newer than the pins
    (tmp_path / ".venv").symlink_to(ROOT / ".venv")
    shutil.copytree(CODE / "distkit", tmp_path / "code/distkit",
                    ignore=shutil.ignore_patterns("__pycache__"))
    for sol in ex.solutions():
        for path in (sol, ex.starter_of(sol)):
            dest = tmp_path / "code" / path.relative_to(CODE)
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, dest)
    return tmp_path


def make(root, *args):
    env = {k: v for k, v in launcher_env().items() if k not in ("MAKEFLAGS", "MFLAGS")}
    return subprocess.run(["make", "-s", "--no-print-directory", *args], cwd=root,
                          capture_output=True, text=True, env=env)


EX = "code/ch00_collectives/exercises/ex00_global_mean.py"


def test_make_starters_leaves_an_edited_starter_as_it_is(copy):
    starter = copy / EX
    edited = starter.read_text() + "# my work in progress\n"
    starter.write_text(edited)
    for target in (["starters"], ["exercises"]):  # the old name does the same
        done = make(copy, *target)
        assert done.returncode == 0, done.stderr
        assert done.stdout.splitlines() == [
            f"skipped {EX}: edited since it was generated (your work is left as it is; "
            "FORCE=1 overwrites it, keeping a .bak)"]
        assert starter.read_text() == edited
    plural = make(copy, "exercises", "EX=00.2")  # one letter from make exercise EX=00.2
    assert plural.returncode == 2 and plural.stdout == ""
    assert plural.stderr.startswith("make exercises: did you mean make exercise EX=00.2 (checks "
                                    "your exercise)? Nothing was changed.")
    assert starter.read_text() == edited
    forced = make(copy, "starters", "FORCE=1")
    assert forced.returncode == 0, forced.stderr
    assert forced.stdout.splitlines() == [
        f"wrote {EX} (the edited text kept in ex00_global_mean.py.bak)"]
    assert starter.with_name(starter.name + ".bak").read_text() == edited
    assert starter.read_text() == (CODE / EX.removeprefix("code/")).read_text()


def test_make_starters_rewrites_a_stale_starter(copy):
    """A starter as generated, from the solution as committed or as last written here, follows
    its solution's changes without FORCE."""
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(copy)]
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "copy"]):
        subprocess.run(git + args, check=True, capture_output=True)
    solution = copy / EX.replace("exercises", "solutions")
    committed = solution.read_text()
    for n in (1, 2):  # committed -> first edit (git HEAD), first -> second edit (the record)
        solution.write_text(committed.replace("(it sums in place)", f"(it sums in place, {n})"))
        done = make(copy, "starters")
        assert (done.returncode, done.stdout) == (0, f"wrote {EX}\n"), done.stderr
        assert (copy / EX).read_text() == ex.make_starter(solution.read_text(), solution.name)
        assert f"in place, {n})" in (copy / EX).read_text()
    done = make(copy, "starters")
    assert done.stdout == "every starter is up to date\n"
    assert json.loads((copy / "build/starters.json").read_text()).keys() == {
        "ch00_collectives/exercises/ex00_global_mean.py"}


# --- what every checker shares: NaN fails, whole factors named both ways ------------------------

def test_nan_and_inf_losses_fail():
    """`abs(nan - y) >= tol` is False: a NaN loss once passed as equal (instructor's review F1).
    Planted back (`>=`), the first two asserts fail."""
    from distkit.course.checks import first_diff, losses_match
    nan, inf = float("nan"), float("inf")
    ok, _, failed = losses_match([1.0, nan, nan], [1.0, 0.9, 0.8], 1e-5)
    assert not ok and failed.startswith("losses differ from one process's at step 2 by nan")
    assert failed.endswith(": the loss is not a finite number (NaN or inf)")
    assert not losses_match([nan] * 3, [1.0, 0.9, 0.8], 1e-5)[0]
    assert first_diff([1.0, inf], [1.0, 2.0], 1e-5) == (2, inf)
    assert losses_match([1.0, 0.9], [1.0, 0.9], 1e-5)[0]


def test_whole_factors_are_named_both_ways():
    from distkit.course.checks import gradient_matches, losses_match, whole_factor
    assert whole_factor(4.0, "sum?", "mean?") == ("4x", "sum?")
    assert whole_factor(0.5, "sum?", "mean?") == ("0.50x", "mean?")
    assert whole_factor(1.5, "sum?", "mean?") is None
    assert whole_factor(float("nan"), "sum?", "mean?") is None
    assert whole_factor(0.5, "sum?", None) is None  # no hint that way: none given
    _, _, failed = losses_match([0.5, 1.0], [1.0, 1.0], 1e-4, scaled="S?", divided="D?")
    assert failed.endswith("(tolerance 1e-04): 0.50x: D?")
    _, _, failed = losses_match([3.0, 1.0], [1.0, 1.0], 1e-4, scaled="S?", divided="D?")
    assert failed.endswith("(tolerance 1e-04): 3x: S?")
    assert gradient_matches({"gap": 0.5, "scale": 0.5}, 1e-4, "g", "S?", "O?")[2] == \
        "g are 0.50x one process's: divided once too often?"
    assert gradient_matches({"gap": float("nan"), "scale": float("nan")}, 1e-4, "g", "S?",
                            "O?")[2] == "g are not finite (NaN or inf): O?"
    # at 3 ranks a sum divided by a hard-coded 2 is 1.5x: named as the fraction it is (review
    # R45: 01.1 and 03.1 at 3 ranks said only "1.6e-01 away"); 2/3 is a mean over 3 halved
    assert gradient_matches({"gap": 0.5, "scale": 1.5}, 1e-4, "g", "S?", "O?")[2] == \
        ("g are 1.50x one process's (3/2): divided by a fixed number where a count belongs "
         "(the world size, m or K)?")
    assert "(2/3)" in gradient_matches({"gap": 0.3, "scale": 2 / 3}, 1e-4, "g", "S?", "O?")[2]
    assert gradient_matches({"gap": 0.2, "scale": 1.23}, 1e-4, "g", "S?", "O?")[2] == \
        "g are 2.0e-01 (of the largest) away from one process's: O?"  # no simple fraction

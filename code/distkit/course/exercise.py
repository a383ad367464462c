"""Exercises: starters generated from their solutions, and a checker for a learner's file.

    make exercises                 # write every starter from its solution (then commit both)
    make exercise EX=03.1          # check code/ch03_zero/exercises/ex03_zero1_by_hand.py
    python -m distkit.course.exercise 03.1 [--file PATH] [--nproc 2]

One source per exercise (the convention nbgrader made familiar): the solution file holds each
part the learner writes between `### BEGIN SOLUTION: <what is missing>` and `### END SOLUTION`,
with `### HINT <text>` lines right after the BEGIN line. The starter gets, in place of the
region, the hint as a `# TODO(you):` comment and a `todo("<what is missing>")` call that stops
the run there (distkit.dist.todo). A region without a message is dropped (its hints kept as
comments): answers to the "Predict, then measure" questions.

The checker (one entry per exercise, registered with @exercise in distkit/course/checks/chNN.py,
one module per chapter) first looks for a todo() left in the file, without launching anything,
then launches the file on each world size of the entry with --json and checks the results: one
line per check, stopping at the first that fails.
"""
from __future__ import annotations

import argparse
import ast
import importlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
from dataclasses import dataclass
from pathlib import Path

CODE = Path(__file__).resolve().parents[2]
ROOT = CODE.parent
LAUNCHER = CODE / "run_w_torchrun.sh"
WIDTH = 100  # the course's line length
BEGIN = re.compile(r"^(\s*)### BEGIN SOLUTION(?::\s*(.*\S))?\s*$")
HINT = re.compile(r"^\s*### HINT ?(.*)$")
END = re.compile(r"^\s*### END SOLUTION\s*$")


# --- starters from solutions -------------------------------------------------------------------

def make_starter(solution: str, name: str) -> str:
    """The starter's text from its solution's (`name`: the solution's file name, for the header
    line). Raises ValueError on a malformed region (unclosed, nested, stray END)."""
    out = [f"# Yours to fill in. Generated from ../solutions/{name} by `make exercises`."]
    lines = solution.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if END.match(line):
            raise ValueError(f"{name}:{i + 1}: ### END SOLUTION without a BEGIN")
        begin = BEGIN.match(line)
        if not begin:
            out.append(line)
            i += 1
            continue
        indent, message = begin.group(1), begin.group(2)
        start, hints = i, []
        i += 1
        while i < len(lines) and (h := HINT.match(lines[i])):
            hints.append(h.group(1))
            i += 1
        while i < len(lines) and not END.match(lines[i]):
            if BEGIN.match(lines[i]):
                raise ValueError(f"{name}:{i + 1}: nested ### BEGIN SOLUTION "
                                 f"(the one at line {start + 1} is not closed)")
            i += 1
        if i == len(lines):
            raise ValueError(f"{name}:{start + 1}: ### BEGIN SOLUTION never closed")
        i += 1  # past END
        text = " ".join(hints)
        if message:
            if '"' in message or "\\" in message:
                raise ValueError(f"{name}:{start + 1}: the todo message may not hold \" or \\")
            if text:
                out += textwrap.wrap(text, WIDTH, initial_indent=indent + "# TODO(you): ",
                                     subsequent_indent=indent + "# ")
            out.append(f'{indent}todo("{message}")')
        elif text:
            out += textwrap.wrap(text, WIDTH, initial_indent=indent + "# ",
                                 subsequent_indent=indent + "# ")
    while out and not out[-1].strip():
        out.pop()
    return "\n".join(out) + "\n"


def solutions() -> list[Path]:
    """Every solution that has a starter, i.e. code/ch*/solutions/ex*.py."""
    return sorted(CODE.glob("ch*/solutions/ex*.py"))


def starter_of(solution: Path) -> Path:
    return solution.parent.parent / "exercises" / solution.name


def write_starters(check_only: bool = False) -> list[Path]:
    """Write every starter from its solution; returns those that were (or, with check_only,
    would be) changed."""
    changed = []
    for sol in solutions():
        if "### BEGIN SOLUTION" not in sol.read_text():
            continue  # not converted yet: its starter is still kept by hand
        text = make_starter(sol.read_text(), sol.name)
        dest = starter_of(sol)
        if not dest.exists() or dest.read_text() != text:
            changed.append(dest)
            if not check_only:
                dest.write_text(text)
    return changed


# --- the checker -------------------------------------------------------------------------------

# A process group of one, without torchrun; port 0: the OS picks a free one when the store binds.
ONE_PROCESS = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": "0"}


class Fail(Exception):
    """A check that failed: its message is the one line the learner reads."""


@dataclass
class Exercise:
    id: str
    starter: str  # relative to code/
    nprocs: tuple
    checks: object  # function(run) yielding (ok, passed line, failed line)
    timeout: float = 300


REGISTRY: dict[str, Exercise] = {}


def exercise(id: str, starter: str, nprocs=(2, 3), timeout: float = 300):
    """Register the decorated function as exercise `id`'s checks (see EXERCISES convention)."""
    def register(fn):
        REGISTRY[id] = Exercise(id, starter, tuple(nprocs), fn, timeout)
        return fn
    return register


def load_registry() -> dict[str, Exercise]:
    """Import each chapter's checks module (distkit.course.checks.CHAPTERS): each registers its
    entries."""
    from distkit.course.checks import CHAPTERS
    for name in CHAPTERS:
        importlib.import_module(f"distkit.course.checks.{name}")
    return REGISTRY


def first_todo(path: Path) -> str | None:
    """'TODO left at FILE:LINE: message' for the first todo(...) call left in the file, or None;
    found by reading the file, not running it."""
    tree = ast.parse(path.read_text(), str(path))
    calls = sorted((node.lineno, node) for node in ast.walk(tree)
                   if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                   and node.func.id == "todo")
    if not calls:
        return None
    line, node = calls[0]
    what = node.args[0].value if node.args and isinstance(node.args[0], ast.Constant) else "..."
    return f"TODO left at {_shown(path)}:{line}: {what}"


def _shown(path: Path) -> str:
    path = Path(path).resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def _launch_error(out: str) -> str:
    """The line that says why a launch failed: a rank's exception or todo() line, else the
    launcher's own report, else the last line."""
    lines = [re.sub(r"^\[rank\d+\]: ", "", ln) for ln in out.splitlines() if ln.strip()]
    for pattern in (r"^TODO\(you\) at ", r"^[\w.]*(Error|Exception)\b.*", r"^run_w_torchrun\.sh: "):
        hits = [ln for ln in lines if re.match(pattern, ln)]
        if hits:
            return hits[0]
    return lines[-1] if lines else "(no output)"


class Runner:
    """run(*args): launch the file being checked on `nproc` ranks with --json FILE; returns the
    dict it wrote. A failed launch raises Fail with the ranks' error line."""

    def __init__(self, ex: Exercise, script: Path, nproc: int, tmp: Path, runs=None):
        self.ex, self.script, self.nproc, self.tmp = ex, script, nproc, tmp
        self.runs = runs if runs is not None else []
        self.count = 0
        self.stdout, self.returncode = "", None  # the last launch's output and exit status

    def __call__(self, *args) -> dict:
        self.count += 1
        out = self.tmp / f"run{self.nproc}-{self.count}.json"
        cmd = [str(LAUNCHER), str(self.nproc), str(self.script), *map(str, args), "--json",
               str(out)]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env=_env())
        try:
            stdout, _ = proc.communicate(timeout=self.ex.timeout)
        except subprocess.TimeoutExpired:
            from distkit.course.notebook import stop_launch  # every rank, not just the launcher
            stop_launch(proc, 10, drain=True)
            raise Fail(f"the launch did not end within {self.ex.timeout:.0f} s "
                       "(a rank waiting in a collective the others never call?)") from None
        self.stdout, self.returncode = stdout, proc.returncode  # a check may need either
        if out.exists():  # a script that asserts at its end wrote its results first: the
            res = json.loads(out.read_text())  # checks name what failed, with numbers
            self.runs.append((self.nproc, res, stdout))
            return res
        if proc.returncode:
            raise Fail(f"the launch failed: {_launch_error(stdout)}")
        raise Fail("the launch wrote no --json results")
    def single(self, script: str, *args) -> dict:
        """Run a one-process reference (a script in code/) with plain Python, in a process
        group of one where it makes one, and --json; returns the dict it wrote."""
        self.count += 1
        out = self.tmp / f"single-{self.count}.json"
        proc = subprocess.run([sys.executable, str(CODE / script), *map(str, args), "--json",
                               str(out)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, timeout=self.ex.timeout,
                              env={**_env(), **ONE_PROCESS})
        if proc.returncode:
            raise Fail(f"the one-process reference {script} failed: {_launch_error(proc.stdout)}")
        return json.loads(out.read_text())


def _env() -> dict:
    return {**os.environ, "PYTHON": os.environ.get("PYTHON", sys.executable),
            "PYTHONPATH": str(CODE)}


def check(ex_id: str, file: str | Path | None = None, nprocs=None, echo=print,
          runs: list | None = None) -> tuple[bool, list[str]]:
    """Check exercise `ex_id` on `file` (default: its starter) at each world size (default:
    the entry's). Each line is also passed to `echo`; each launch's (world size, results,
    output) is appended to `runs` if given. Returns (all passed, the lines)."""
    registry = load_registry()
    if ex_id not in registry:
        raise SystemExit(f"distkit.course.exercise: no exercise {ex_id!r}; "
                         f"known: {', '.join(sorted(registry))}")
    ex = registry[ex_id]
    path = Path(file) if file else CODE / ex.starter
    lines = []

    def say(line):
        lines.append(line)
        echo(line)

    todo = first_todo(path)
    if todo:
        say(f"FAIL {todo}")
        return False, lines
    say(f"PASS no todo() left in {_shown(path)}")
    with tempfile.TemporaryDirectory(prefix=f"ex{ex_id}-") as tmp:
        for nproc in nprocs or ex.nprocs:
            run = Runner(ex, path.resolve(), nproc, Path(tmp), runs)
            tag = f"[{nproc} rank{'s' * (nproc != 1)}]"
            try:
                for ok, passed, failed in ex.checks(run):
                    if not ok:
                        raise Fail(failed)
                    say(f"PASS {tag} {passed}")
            except Fail as fail:
                say(f"FAIL {tag} {fail}")
                return False, lines
    return True, lines


def solution_as_starter(ex_id: str, tmp: Path, change: tuple | None = None) -> Path:
    """A copy of the exercise's chapter folder in tmp whose starter is its solution: as a learner
    who got it right would have it. `change` = (old, new) makes it a wrong answer the checker
    must catch: the one line holding `old` replaced by `new` (None: the line removed). Returns
    the starter's path in the copy."""
    ex = load_registry()[ex_id]
    chapter = (CODE / ex.starter).parent.parent
    copy = Path(tmp) / chapter.name
    shutil.copytree(chapter, copy, ignore=shutil.ignore_patterns("__pycache__"))
    starter = copy / Path(ex.starter).relative_to(chapter.name)
    lines = (CODE / ex.starter.replace("/exercises/", "/solutions/")).read_text().splitlines(
        keepends=True)
    if change:
        old, new = change
        hits = [i for i, ln in enumerate(lines) if old in ln]
        if len(hits) != 1:
            raise ValueError(f"{old!r} is on {len(hits)} lines of the solution, not one")
        i = hits[0]
        indent = re.match(r"\s*", lines[i]).group(0)
        lines[i] = "" if new is None else indent + new + "\n"
    starter.write_text("".join(lines))
    return starter


def check_at_once(jobs: dict, tmp: Path, nprocs=(2,)) -> dict:
    """Several checks at once, for tests (threads: each only waits for its launches). `jobs`
    maps a name to (exercise id, change): change None checks the solution copied over its
    starter, (old, new) a wrong answer (see solution_as_starter). `nprocs`: the world sizes, or
    "largest" for each entry's largest (3, or 4 for 02.2). Returns name -> (passed, lines,
    runs)."""
    from concurrent.futures import ThreadPoolExecutor

    def one(name, ex_id, change):
        runs = []
        path = solution_as_starter(ex_id, Path(tmp) / name, change)
        sizes = REGISTRY[ex_id].nprocs[-1:] if nprocs == "largest" else nprocs
        ok, lines = check(ex_id, path, sizes, echo=lambda line: None, runs=runs)
        return ok, lines, runs
    with ThreadPoolExecutor(len(jobs)) as pool:
        futures = {name: pool.submit(one, name, *job) for name, job in jobs.items()}
        return {name: f.result() for name, f in futures.items()}


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m distkit.course.exercise", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("id", nargs="?", help="the exercise, e.g. 03.1 (--list: all of them)")
    parser.add_argument("--file", help="check this file instead of the exercise's starter")
    parser.add_argument("--nproc", type=int, action="append",
                        help="world size to check at (repeatable; default: the exercise's)")
    parser.add_argument("--list", action="store_true", help="list the exercises and their files")
    parser.add_argument("--write", action="store_true",
                        help="write every starter from its solution (make exercises)")
    parser.add_argument("--diff", action="store_true",
                        help="exit 1 if a committed starter differs from its generated form")
    args = parser.parse_args(argv)
    if args.write or args.diff:
        changed = write_starters(check_only=args.diff)
        for path in changed:
            print(("differs from its solution's generated form: " if args.diff else "wrote ")
                  + _shown(path))
        sys.exit(1 if args.diff and changed else 0)
    if args.list or not args.id:
        for ex in sorted(load_registry().values(), key=lambda e: e.id):
            sizes = ", ".join(map(str, ex.nprocs))
            print(f"{ex.id}  code/{ex.starter}  (checked at {sizes} ranks)")
        sys.exit(0 if args.list else 2)
    if args.nproc and min(args.nproc) < 1:
        parser.error("--nproc must be >= 1")
    ok, _ = check(args.id, args.file, args.nproc)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":  # run as distkit.course.exercise, whose REGISTRY the entries fill
    importlib.import_module("distkit.course.exercise").main()

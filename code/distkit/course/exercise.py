"""Exercises: starters generated from their solutions, and a checker for a learner's file.

    make exercise EX=03.1          # check code/ch03_zero/exercises/ex03_zero1_by_hand.py
    python -m distkit.course.exercise 03.1 [--file PATH] [--nproc 2]
    make starters [FORCE=1]        # maintainers: write the starters from their solutions

One source per exercise (the convention nbgrader made familiar): the solution file holds each
part the learner writes between `### BEGIN SOLUTION: <what is missing>` and `### END SOLUTION`,
with `### HINT <text>` lines right after the BEGIN line. The starter gets, in place of the
region, the hint as a `# TODO(you):` comment and a `todo("<what is missing>")` call that stops
the run there (distkit.dist.todo). A region without a message is dropped (its hints kept as
comments): answers to the "Predict, then measure" questions.

The checker (one entry per exercise, registered with @exercise in distkit/course/checks/chNN.py,
one module per chapter) first looks for a todo() left in the file, without launching anything,
then launches the file on each world size of the entry with --json and checks the results: one
line per check, stopping at the first that fails. A file that does not compile gets one line
with FILE:LINE, nothing launched. On a GPU node with fewer GPUs than an exercise's ranks, that
world size is checked on the CPU (COURSE_DEVICE=cpu), and a NOTE line says so.

`make starters` (--write) rewrites a starter only where it still is a generated form: what the
solution generates now, or generated from the solution as committed (git HEAD), or what this
tool last wrote there. A starter someone edited is skipped and named; --force (FORCE=1)
overwrites it, keeping the edited text beside it as FILE.bak.
"""
from __future__ import annotations

import argparse
import ast
import functools
import hashlib
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
    out = [f"# Yours to fill in (generated from ../solutions/{name})."]
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


def solutions(code: Path = CODE) -> list[Path]:
    """Every solution that has a starter, i.e. code/ch*/solutions/ex*.py."""
    return sorted(Path(code).glob("ch*/solutions/ex*.py"))


def starter_of(solution: Path) -> Path:
    return solution.parent.parent / "exercises" / solution.name


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _body(starter: str) -> str:
    return starter.split("\n", 1)[-1]


def _committed(path: Path) -> str | None:
    """The file's text as committed (git HEAD), or None (not in git, or no git here)."""
    try:
        top = subprocess.run(["git", "-C", str(path.parent), "rev-parse", "--show-toplevel"],
                             capture_output=True, text=True, timeout=30)
        if top.returncode:
            return None
        rel = path.resolve().relative_to(Path(top.stdout.strip()).resolve())
        shown = subprocess.run(["git", "-C", top.stdout.strip(), "show", f"HEAD:{rel.as_posix()}"],
                               capture_output=True, text=True, timeout=30)
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return None
    return shown.stdout if shown.returncode == 0 else None


def write_starters(check_only: bool = False, force: bool = False, code: Path = CODE,
                   skipped: list | None = None) -> list[Path]:
    """Write every starter from its solution; returns those that were (or, with check_only,
    would be) changed. A starter that differs from its generated form is rewritten only when it
    is stale, not edited: generated from the solution as committed (git HEAD), or the text this
    tool last wrote there (recorded in build/starters.json). An edited one is left alone and
    appended to `skipped`, unless force: then its text is kept as FILE.bak first."""
    code = Path(code)
    record_file = code.parent / "build" / "starters.json"
    record = json.loads(record_file.read_text()) if record_file.exists() else {}
    changed = []
    for sol in solutions(code):
        if "### BEGIN SOLUTION" not in sol.read_text():
            continue  # not converted yet: its starter is still kept by hand
        text = make_starter(sol.read_text(), sol.name)
        dest = starter_of(sol)
        if dest.exists() and dest.read_text() == text:
            continue
        if check_only:
            changed.append(dest)
            continue
        key = dest.relative_to(code).as_posix()
        if dest.exists():
            now = dest.read_text()
            stale = record.get(key) == _digest(now)
            committed = None if stale else _committed(sol)
            if committed is not None:  # below the header line, whose format may have changed
                try:
                    stale = _body(now) == _body(make_starter(committed, sol.name))
                except ValueError:  # the committed solution's regions were malformed
                    pass
            if not stale:
                if not force:
                    if skipped is not None:
                        skipped.append(dest)
                    continue
                dest.with_name(dest.name + ".bak").write_text(now)
        dest.write_text(text)
        record[key] = _digest(text)
        changed.append(dest)
    if changed and not check_only:
        record_file.parent.mkdir(parents=True, exist_ok=True)
        record_file.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
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
    env: dict | None = None  # set for every launch (e.g. a shorter process-group timeout)


REGISTRY: dict[str, Exercise] = {}


def exercise(id: str, starter: str, nprocs=(2, 3), timeout: float = 300, env=None):
    """Register the decorated function as exercise `id`'s checks (see EXERCISES convention).
    `env`: variables set for each of its launches and references, e.g. COURSE_TIMEOUT_S, so a
    mismatched collective fails in seconds rather than at the default 60 s."""
    def register(fn):
        REGISTRY[id] = Exercise(id, starter, tuple(nprocs), fn, timeout, dict(env or {}))
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


def not_compiling(path: Path) -> str | None:
    """One line saying why the file cannot be read or compiled ('syntax error at FILE:LINE:
    ...'), or None: what a learner mid-edit hits most, said before anything is launched."""
    try:
        compile(Path(path).read_text(), str(path), "exec")
    except SyntaxError as e:  # IndentationError and TabError too
        return f"syntax error at {_shown(e.filename or path)}:{e.lineno}: {e.msg}"
    except (OSError, UnicodeDecodeError, ValueError) as e:
        return f"cannot read {_shown(path)}: {getattr(e, 'strerror', None) or e}"
    return None


def _shown(path: Path) -> str:
    path = Path(path).resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


# What a rank reports when another rank left first (crashed, or timed out and exited): the
# consequence, not the cause, whichever rank's output comes first.
PEER_GONE = re.compile(r"Connection (closed|reset) by peer")


def _launch_error(out: str, script: Path | None = None) -> str:
    """The line that says why a launch failed: a rank's exception or todo() line (a rank's own
    error before another's report that it left), else the launcher's own report, else the last
    line. An exception raised in `script` (the file being checked) gets its line:
    '... (at FILE:LINE)'."""
    raw = [ln for ln in out.splitlines() if ln.strip()]
    # each line's rank ("[rank1]: ", once the process group names it), so that a traceback is
    # read from its own rank's lines: two ranks' tracebacks can interleave
    ranks = [re.match(r"(\[rank\d+\]: )?", ln).group(0) for ln in raw]
    lines = [ln[len(rank):] for ln, rank in zip(raw, ranks)]
    for pattern in (r"^TODO\(you\) at ", r"^[\w.]*(Error|Exception)\b.*", r"^run_w_torchrun\.sh: "):
        hits = [(i, ln) for i, ln in enumerate(lines) if re.match(pattern, ln)]
        hits = [h for h in hits if not PEER_GONE.search(h[1])] or hits
        if hits:
            i, line = hits[0]
            where = None
            if script is not None and not line.startswith("TODO"):
                own = [ln for ln, rank in zip(lines[:i], ranks[:i]) if rank == ranks[i]]
                for frame in reversed(own):  # its traceback's last frame in that file
                    if frame.startswith("Traceback "):
                        break
                    m = re.match(r'\s*File "(.+)", line (\d+)', frame)
                    if m and Path(m.group(1)).resolve() == Path(script).resolve():
                        where = f"{_shown(Path(script))}:{m.group(2)}"
                        break
            return f"{line} (at {where})" if where else line
    return lines[-1] if lines else "(no output)"


class Runner:
    """run(*args): launch the file being checked on `nproc` ranks with --json FILE; returns the
    dict it wrote. A failed launch raises Fail with the ranks' error line."""

    def __init__(self, ex: Exercise, script: Path, nproc: int, tmp: Path, runs=None, env=None):
        self.ex, self.script, self.nproc, self.tmp = ex, script, nproc, tmp
        self.runs = runs if runs is not None else []
        # set for every launch and reference: the exercise's own, then e.g. COURSE_DEVICE
        self.env = {**(ex.env or {}), **(env or {})}
        self.count = 0
        self.stdout, self.returncode = "", None  # the last launch's output and exit status

    def __call__(self, *args) -> dict:
        self.count += 1
        out = self.tmp / f"run{self.nproc}-{self.count}.json"
        cmd = [str(LAUNCHER), str(self.nproc), str(self.script), *map(str, args), "--json",
               str(out)]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env=_env(self.env))
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
            raise Fail(f"the launch failed: {_launch_error(stdout, self.script)}")
        raise Fail("the launch wrote no --json results")

    def single(self, script: str, *args) -> dict:
        """Run a one-process reference (a script in code/) with plain Python, in a process
        group of one where it makes one, and --json; returns the dict it wrote."""
        self.count += 1
        out = self.tmp / f"single-{self.count}.json"
        proc = subprocess.run([sys.executable, str(CODE / script), *map(str, args), "--json",
                               str(out)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, timeout=self.ex.timeout,
                              env={**_env(self.env), **ONE_PROCESS})
        if proc.returncode:
            raise Fail(f"the one-process reference {script} failed: {_launch_error(proc.stdout)}")
        return json.loads(out.read_text())


def _env(extra: dict | None = None) -> dict:
    return {**os.environ, "PYTHON": os.environ.get("PYTHON", sys.executable),
            "PYTHONPATH": str(CODE), **(extra or {})}


@functools.cache
def gpus_visible() -> int:
    """How many GPUs torch sees here (0 without CUDA). Imports torch: asked only when
    COURSE_DEVICE leaves the choice to the scripts."""
    import torch
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def device_for(nproc: int) -> tuple[dict, str | None]:
    """(environment for a check at nproc ranks, a NOTE line or None). The scripts take one GPU
    per rank when CUDA is visible and refuse more ranks than GPUs; a check at more ranks than
    this machine's GPUs runs on the CPU instead (gloo), and says so."""
    want = os.environ.get("COURSE_DEVICE", "").strip().lower()
    if want == "cpu":
        return {}, None
    gpus = gpus_visible()
    if want == "cuda" and gpus < nproc:
        raise Fail(f"COURSE_DEVICE=cuda, but this machine has {gpus} GPU(s) for {nproc} ranks: "
                   "unset it, and the checker runs these ranks on the CPU")
    if want == "" and 0 < gpus < nproc:
        return {"COURSE_DEVICE": "cpu"}, (
            f"this machine has {gpus} GPU(s), fewer than {nproc} ranks (one GPU each): "
            f"checking at {nproc} ranks on the CPU (gloo) instead")
    return {}, None


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

    todo = not_compiling(path) or first_todo(path)
    if todo:
        say(f"FAIL {todo}")
        return False, lines
    say(f"PASS no todo() left in {_shown(path)}")
    with tempfile.TemporaryDirectory(prefix=f"ex{ex_id}-") as tmp:
        for nproc in nprocs or ex.nprocs:
            tag = f"[{nproc} rank{'s' * (nproc != 1)}]"
            try:
                env, note = device_for(nproc)
                if note:
                    say(f"NOTE {tag} {note}")
                run = Runner(ex, path.resolve(), nproc, Path(tmp), runs, env)
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
    must catch: the one line holding `old` (or, of several, the one that is `old`) replaced by
    `new` (None: the line removed; lines of `new` take that line's indent); `old` of several
    lines (with newlines) replaces those consecutive lines, each compared stripped; a list of
    such pairs makes several changes. Returns the starter's path in the copy."""
    ex = load_registry()[ex_id]
    chapter = (CODE / ex.starter).parent.parent
    copy = Path(tmp) / chapter.name
    shutil.copytree(chapter, copy, ignore=shutil.ignore_patterns("__pycache__"))
    starter = copy / Path(ex.starter).relative_to(chapter.name)
    lines = (CODE / ex.starter.replace("/exercises/", "/solutions/")).read_text().splitlines(
        keepends=True)
    for old, new in ([change] if change and isinstance(change[0], str) else change or []):
        olds = old.split("\n")  # several lines: those lines, one after the other
        if len(olds) > 1:
            hits = [i for i in range(len(lines) - len(olds) + 1)
                    if all(lines[i + j].strip() == o.strip() for j, o in enumerate(olds))]
        else:
            hits = [i for i, ln in enumerate(lines) if old in ln]
            if len(hits) > 1:  # one of them may be the whole line
                hits = [i for i in hits if lines[i].strip() == old.strip()]
        if len(hits) != 1:
            raise ValueError(f"{old!r} is on {len(hits)} lines of the solution, not one")
        i = hits[0]
        indent = re.match(r"\s*", lines[i]).group(0)
        lines[i:i + len(olds)] = ["" if new is None else
                                  "".join(indent + ln + "\n" for ln in new.split("\n"))]
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
                        help="write the starters from their solutions, skipping edited ones "
                        "(make starters)")
    parser.add_argument("--force", action="store_true",
                        help="with --write: overwrite edited starters too, keeping FILE.bak "
                        "(make starters FORCE=1)")
    parser.add_argument("--diff", action="store_true",
                        help="exit 1 if a committed starter differs from its generated form")
    args = parser.parse_args(argv)
    if args.force and not args.write:
        parser.error("--force goes with --write")
    if args.write or args.diff:
        skipped = []
        changed = write_starters(check_only=args.diff, force=args.force, skipped=skipped)
        for path in changed:
            bak = path.with_name(path.name + ".bak")
            print(("differs from its solution's generated form: " if args.diff else "wrote ")
                  + _shown(path) + (f" (the edited text kept in {bak.name})"
                                    if args.force and bak.exists() else ""))
        for path in skipped:
            print(f"skipped {_shown(path)}: edited since it was generated (your work is "
                  "left as it is; FORCE=1 overwrites it, keeping a .bak)")
        if args.write and not changed and not skipped:
            print("every starter is up to date")
        sys.exit(1 if args.diff and changed else 0)
    if args.list or not args.id:
        for ex in sorted(load_registry().values(), key=lambda e: e.id):
            sizes = ", ".join(map(str, ex.nprocs))
            print(f"{ex.id}  code/{ex.starter}  (checked at {sizes} "
                  f"rank{'s' * (ex.nprocs != (1,))})")
        sys.exit(0 if args.list else 2)
    if args.nproc and min(args.nproc) < 1:
        parser.error("--nproc must be >= 1")
    ok, _ = check(args.id, args.file, args.nproc)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":  # run as distkit.course.exercise, whose REGISTRY the entries fill
    importlib.import_module("distkit.course.exercise").main()

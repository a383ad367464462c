"""Shared test plumbing: paths, and running the course launcher the way a learner would."""
import ast
import json
import os
import re
import runpy
import socket
import subprocess
import sys
import threading
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parent.parent
CODE = ROOT / "code"
LAUNCHER = CODE / "run_w_torchrun.sh"
sys.path.insert(0, str(CODE))
from distkit.course.notebook import stop_launch  # noqa: E402  (needs code/ on the path)

os.environ.setdefault("HF_HUB_OFFLINE", "1")

# The suite runs what a learner runs: this CPU's own kernels (AVX2, AVX-512, AMX/AVX512-FP16 or
# ARM), no emulation of a lesser CPU. An emulation (ATEN_CPU_CAPABILITY=default with MKL and
# oneDNN capped) broke twice on newer CPUs, each time in a configuration no learner has: torch
# sends bf16 flash attention and float8 GEMMs to ISA-specific kernels that the cap forbids.
# Portability is kept by the compared outputs themselves: every float a compared cell prints is
# rounded far above its noise, and tests/test_portability.py checks each stored output against
# that rule (CONTRIBUTING.md, "Adding a compared cell").
# The stored outputs are a CPU/gloo recording: check them on the CPU even where a GPU exists.
os.environ["COURSE_DEVICE"] = "cpu"


def pytest_report_header(config):
    from distkit.course.portable import cpu_features
    return f"this CPU's own kernels ({cpu_features()}); COURSE_DEVICE=cpu"


def pytest_terminal_summary(terminalreporter):
    """Seconds per test file (setup + call + teardown), so the time budget stays visible: each
    chapter gets about 2 min of nbval and 30 s of script tests on an idle 2-core machine."""
    per_file = {}
    for reports in terminalreporter.stats.values():
        for rep in reports:
            if hasattr(rep, "duration") and hasattr(rep, "nodeid") and rep.nodeid:
                name = rep.nodeid.split("::")[0]
                per_file[name] = per_file.get(name, 0.0) + rep.duration
    if per_file:
        terminalreporter.section("seconds per file")
        for name, secs in sorted(per_file.items(), key=lambda kv: -kv[1]):
            terminalreporter.write_line(f"{secs:8.1f}  {name}")
        terminalreporter.write_line(f"{sum(per_file.values()):8.1f}  in all")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """`make test` runs the script tests two files at a time (pytest-xdist), then the notebooks
    and the tests that measure the machine's load (marked alone) one at a time: a notebook's
    nbval time is then what a learner waits, and a load measurement sees no other test. So an
    xdist worker leaves those to the second run; every notebook cell is marked `notebook`."""
    for item in items:
        if item.path.suffix == ".ipynb":
            item.add_marker(pytest.mark.notebook)
    if hasattr(config, "workerinput"):  # an xdist worker (the controller collects nothing)
        later = [item for item in items if item.get_closest_marker("notebook")
                 or item.get_closest_marker("alone")]
        if later:
            config.hook.pytest_deselected(items=later)
            items[:] = [item for item in items if item not in later]


def launcher_env(env=None) -> dict:
    """This environment, with this test run's Python for the launcher; None values unset."""
    full = {**os.environ, "PYTHON": sys.executable, **(env or {})}
    return {k: v for k, v in full.items() if v is not None}


def run_launcher(*args, env=None, timeout=180) -> subprocess.CompletedProcess:
    """code/run_w_torchrun.sh ARGS...; the timeout keeps a hung launch from hanging the suite.
    On a timeout the whole launch is stopped as a notebook's cell stops it
    (distkit.course.notebook's
    stop_launch: the ranks run in sessions of their own, so killing the launcher would leave
    them running)."""
    proc = subprocess.Popen([str(LAUNCHER), *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=launcher_env(env))
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        stopper = threading.Thread(target=stop_launch, args=(proc, 10, False))
        stopper.start()
        proc.communicate()  # read on meanwhile: torchrun must never block writing its output
        stopper.join()
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def run_ok(*args, **kwargs) -> subprocess.CompletedProcess:
    proc = run_launcher(*args, **kwargs)
    assert proc.returncode == 0, f"launch failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return proc


def run_json(tmp_path, nproc, script, *args):
    """Launch a script with --json and return (parsed results, stdout)."""
    out = tmp_path / f"{Path(script).stem}-{nproc}.json"
    proc = run_ok(nproc, script, *args, "--json", out)
    return json.loads(out.read_text()), proc.stdout


def run_scripts_at_once(runs: dict) -> dict:
    """Start scripts in code/ with plain Python, all at once, without torchrun: for --help, bad
    input and one-process runs (each costs a torch import, not a launch). `runs` maps a name to
    (script relative to code/, args, extra env); returns name -> (exit status, stdout, stderr)."""
    procs = {}
    for name, (script, args, env) in runs.items():
        # A one-process group binds its store to port 0: the OS picks a free port at bind time.
        # (A port chosen beforehand, as free_port() does, can be taken by a concurrent launch
        # before the script binds it: measured once as EADDRINUSE in make test.)
        env = {**env, "MASTER_PORT": "0"} if "RANK" in env else env
        procs[name] = subprocess.Popen(
            [sys.executable, str(CODE / script), *map(str, args)], text=True,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            env=launcher_env({"PYTHONPATH": str(CODE), **env}))
    done = {name: p.communicate(timeout=300) for name, p in procs.items()}
    return {name: (procs[name].returncode, out, err) for name, (out, err) in done.items()}


def run_in_process(monkeypatch, capsys, script, *args, env=None):
    """Run a script in code/ here, up to its argument checks (--help and bad input stop it before
    setup(), with SystemExit): no new process, so no torch import to pay for. `env` sets
    environment variables first (e.g. WORLD_SIZE, as torchrun would). Returns (exit status,
    stdout, stderr)."""
    for key, value in (env or {}).items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(sys, "argv", [str(CODE / script), *map(str, args)])
    with pytest.raises(SystemExit) as exit_:
        runpy.run_path(str(CODE / script), run_name="__main__")
    out = capsys.readouterr()
    return exit_.value.code, out.out, out.err


def check_starter(folder: str, name: str, stops: int) -> None:
    """An exercise starter (code/FOLDER/exercises/NAME) against its solution: exactly `stops`
    todo() calls, each right after a comment, with a `# TODO(you)` saying how a few lines above;
    the solution has neither, and both define the same functions and classes (they diff
    cleanly)."""
    starter, solution = ((CODE / folder / kind / name).read_text()
                         for kind in ("exercises", "solutions"))
    lines = starter.splitlines()
    found = [i for i, ln in enumerate(lines) if ln.strip().startswith("todo(")]
    assert len(found) == stops
    for i in found:
        assert lines[i - 1].strip().startswith("#"), lines[i]
        assert any("# TODO(you)" in ln for ln in lines[max(0, i - 5):i]), lines[i]
    if "### BEGIN SOLUTION" in solution:  # one source: the starter is generated from it, the
        # docstring shared (it names TODOs); no todo() call left in the code
        # (distkit/course/exercise.py)
        from distkit.course.exercise import first_todo
        assert first_todo(CODE / folder / "solutions" / name) is None
    else:
        assert "todo(" not in solution and "TODO" not in solution

    def names(src):
        return {node.name for node in ast.walk(ast.parse(src))
                if isinstance(node, (ast.FunctionDef, ast.ClassDef))}
    assert names(starter) == names(solution)


def check_stopped_at_todo(proc: subprocess.CompletedProcess, nproc: int, where: str,
                          what: str) -> None:
    """A starter launched on `nproc` ranks stopped at its first todo(): every rank says `where`
    (code/...py:LINE) and `what` on one line, no rank raised (no traceback, no exception line),
    and the launcher's report names a rank that stopped there. Which rank torchrun sees exit
    first is a race, so the report may name any of them; todo()'s barrier makes every rank
    print its line before any exits. A warning logged by a rank's teardown (a glog "W..." line)
    is not the starter's doing and is not checked."""
    err = proc.stderr
    assert proc.returncode != 0
    todo = [ln for ln in err.splitlines() if ln.startswith("TODO(you) at ")]
    assert len(todo) == nproc and all(ln.startswith(f"TODO(you) at {where}:") and what in ln
                                      for ln in todo), err
    assert "Traceback" not in proc.stdout + err
    assert not re.search(r"^(\[rank\d+\]: )?[\w.]*(Error|Exception)\b", err, re.M), err
    assert re.search(r"^run_w_torchrun\.sh: rank \d+ failed first \(exit code 1\): TODO\(you\) at "
                     + re.escape(where) + ":", err, re.M), err


def check_same_options(monkeypatch, capsys, template: str) -> None:
    """An exercise's starter and solution (template: "chNN/{}/NAME.py", {} = exercises or
    solutions) have the same --help after the description, take --json, and each opens with
    a one-line description ending with "." that --help shows."""
    helps = []
    for folder in ("exercises", "solutions"):
        path = template.format(folder)
        first = (CODE / path).read_text().split('"""')[1].split("\n\n")[0]  # the description
        assert "\n" not in first and first.endswith("."), first
        code, out, _ = run_in_process(monkeypatch, capsys, path, "--help")
        assert code == 0 and "--json" in out and first in " ".join(out.split())
        helps.append(out[out.index("options:"):])  # after the usage and the description
    assert helps[0] == helps[1]


def run_papermill(tmp_path, notebook: str, *args) -> str:
    """Run notebooks/NOTEBOOK headless with papermill and papermill's ARGS (e.g. "-p", "NPROC",
    "3"), from the repo root; assert it passed, and return its cells (sources and outputs) as
    text for the caller's checks."""
    out = tmp_path / "out.ipynb"
    proc = subprocess.run([sys.executable, "-m", "papermill", f"notebooks/{notebook}", str(out),
                           *map(str, args), "--no-progress-bar"],
                          cwd=ROOT, capture_output=True, text=True, timeout=900,
                          env=launcher_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.dumps(nbformat.read(out, as_version=4).cells)


def run_parameter_check(notebook: str, values: dict, tmp_path, monkeypatch) -> dict:
    """A notebook's parameters cell, `values` injected as papermill would, then its check cell
    (the first code cell after the parameters), in a scratch root: the check cells find the repo
    as the first folder upwards with code/distkit and create (some empty) build/chNN under it.
    Returns the parameters' defaults for the names in `values`; raises what the check raises."""
    cells = nbformat.read(ROOT / "notebooks" / notebook, as_version=4).cells
    first = next(i for i, c in enumerate(cells) if "parameters" in c.metadata.get("tags", []))
    check = next(c for c in cells[first + 1:] if c.cell_type == "code")
    ns = {"__name__": "__main__"}
    exec(compile(cells[first].source, f"{notebook}: parameters", "exec"), ns)
    unknown = set(values) - {k for k in ns if not k.startswith("__")}
    assert not unknown, f"{notebook}: {sorted(unknown)} not in the parameters cell"
    defaults = {k: ns[k] for k in values}
    ns.update(values)  # papermill's injected-parameters cell
    (tmp_path / "code").symlink_to(ROOT / "code", target_is_directory=True)
    (tmp_path / "notebooks").mkdir()
    monkeypatch.chdir(tmp_path / "notebooks")
    try:
        exec(compile(check.source, f"{notebook}: check cell", "exec"), ns)
    finally:
        import matplotlib.pyplot as plt
        plt.close("all")
    return defaults


def write_notebook(path, *sources) -> Path:
    """A notebook with one code cell per source, for testing the harness itself."""
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(src) for src in sources]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                 "language": "python"}
    nbformat.write(nb, path)
    return Path(path)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def rank_script(tmp_path):
    """A tiny script outside code/ that prints what each rank sees."""
    script = tmp_path / "show_env.py"
    script.write_text("import os\n"
                      "print(f\"rank={os.environ['RANK']} omp={os.environ['OMP_NUM_THREADS']}\", "
                      "flush=True)\n")
    return script

"""The test harness itself: pins in step, offline, nbval really fails on a failed launch, and
`make record` tells other programs' load from its own."""
import re
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import pytest

from conftest import ROOT, write_notebook

NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))


def pins(lines):
    return {line.strip().lstrip("- ").strip() for line in lines
            if re.match(r"^\s*-?\s*[A-Za-z0-9_.\-\[\]]+==", line)}


def test_environment_yml_has_the_same_pins_as_requirements():
    req = pins((ROOT / "requirements.txt").read_text().splitlines())
    env = pins((ROOT / "environment.yml").read_text().splitlines())
    assert "torch==2.13.0" in req
    assert env == req, (f"only in requirements.txt: {req - env}; "
                        f"only in environment.yml: {env - req}")


def test_every_requirement_is_pinned_exactly():
    for line in (ROOT / "requirements.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        assert not line or "==" in line, f"not pinned: {line}"


def test_makefile_runs_offline_and_ci_calls_make_test():
    assert "export HF_HUB_OFFLINE := 1" in (ROOT / "Makefile").read_text()
    assert "make test" in (ROOT / ".ci" / "run").read_text()


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_has_parameters_and_stored_outputs(nb):
    cells = nbformat.read(nb, as_version=4).cells
    code = [c for c in cells if c.cell_type == "code"]
    assert any("parameters" in c.metadata.get("tags", []) for c in code), "no parameters cell"
    assert all(c.execution_count for c in code), "cells stored without being run"
    for c in code:
        assert not re.search(r"^\s*!", c.source, re.M), "`!cmd` never fails the cell"


def _nbval(tmp_path, source):
    path = write_notebook(tmp_path / "check.ipynb", "# NBVAL_IGNORE_OUTPUT\n" + source)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")  # not the course's config
    return subprocess.run([sys.executable, "-m", "pytest", "--nbval", "--nbval-current-env",
                           "-p", "no:cacheprovider", "-q", str(path)],
                          capture_output=True, text=True, cwd=tmp_path, timeout=300)


SETUP = (f"import sys; sys.path.insert(0, {str(ROOT / 'code')!r})\n"
         "from distkit.course.notebook import launch\n")


def test_nbval_passes_a_cell_whose_launch_succeeds(tmp_path):
    proc = _nbval(tmp_path, SETUP + "launch(2, 'ch00_collectives/hello_torchrun.py')")
    assert proc.returncode == 0, proc.stdout


@pytest.mark.parametrize("call,why", [
    ("launch(2, 'ch00_collectives/collectives.py', '--op', 'nope')",
     "error: unknown --op nope"),
    ("run_python('ch00_collectives/hello_torchrun.py')", "not started by torchrun"),
], ids=["launch", "run_python"])
def test_nbval_fails_a_cell_whose_launch_fails(tmp_path, call, why):
    """...and its report says why: the script's own last lines are in the exception nbval prints
    (nbval does not print the cell's streamed output), for a launch and a one-process run."""
    proc = _nbval(tmp_path, SETUP.replace("import launch", "import launch, run_python") + call)
    assert proc.returncode == 1, proc.stdout
    assert "LaunchFailed" in proc.stdout and "1 failed" in proc.stdout, proc.stdout
    report = proc.stdout.split("LaunchFailed", 1)[1]
    tail = [line for line in report.splitlines() if line.startswith("  | ")]
    assert any(why in line for line in tail), proc.stdout  # the script's line, not the command


def test_run_here_runs_a_script_in_this_python_as_run_python_would(capsys, tmp_path):
    """run_here (a one-process script in the kernel, no second Python): the command line, the
    script's output with the repo's paths relative, argparse's --help as a success, a script's
    exit with a message as LaunchFailed carrying it, and sys.argv and sys.path as they were."""
    from distkit.course.notebook import ROOT as NB_ROOT, LaunchFailed, run_here
    argv, path = list(sys.argv), list(sys.path)
    run_here("ch06_capstone/corpus.py", "--help", "--data-dir", NB_ROOT / "build" / "x")
    out = capsys.readouterr().out
    assert out.startswith("$ PYTHONPATH=code python code/ch06_capstone/corpus.py --help "
                          "--data-dir build/x\n"), out
    assert "usage: corpus.py" in out  # argparse's prog: the script's name, as from a shell
    with pytest.raises(LaunchFailed) as e:  # sys.exit("...") before any process group
        run_here("ch00_collectives/hello_torchrun.py")
    assert e.value.returncode == 1 and "not started by torchrun" in str(e.value)
    assert "not started by torchrun" in capsys.readouterr().out  # shown, as Python would
    script = tmp_path / "prints_a_path.py"
    script.write_text(f"import sys\nprint('wrote {NB_ROOT}/build/ch06/a/hf')\n"
                      "print('a terminal:', sys.stderr.isatty())\n")  # tqdm(disable=None) asks
    run_here(script)  # outside code/: CODE / an absolute path is that path
    assert capsys.readouterr().out.endswith("wrote build/ch06/a/hf\na terminal: False\n")
    assert sys.argv == argv and sys.path == path


def test_launch_output_names_paths_relative_to_the_repo():
    """Scripts print absolute paths ("exported to /home/me/course/build/ch06/a/hf"): the notebook
    shows them from the repo root, so a stored output reads the same in every checkout."""
    from distkit.course.notebook import ROOT as NB_ROOT, _relative
    assert _relative(f"exported to {NB_ROOT}/build/ch06/a/hf\n") == "exported to build/ch06/a/hf\n"
    assert _relative("/elsewhere/build/x") == "/elsewhere/build/x"


SPIN = "import time\nt = time.process_time() + {}\nwhile time.process_time() < t: pass\n"


@pytest.mark.skipif(not Path("/proc/stat").exists(), reason="record reads /proc/stat (Linux)")
@pytest.mark.alone
def test_record_tells_other_programs_load_from_its_own():
    """distkit.course.record refuses a recording made beside other programs' load: per cell, the
    machine's busy CPU-seconds less its own (the recorder, its kernel and whatever they start).
    A child's second of CPU is its own; a program started apart (not a descendant: the shell
    that started it is gone) that spins is another's, and its cell is named."""
    from distkit.course.record import LoadWatch
    watch = LoadWatch()
    watch.start(0)
    subprocess.run([sys.executable, "-c", SPIN.format(1.0)], check=True)
    watch.stop()
    watch.start(1)
    subprocess.run(["sh", "-c", '"$0" -c "$1" &', sys.executable, SPIN.format(1.2)], check=True)
    time.sleep(1.5)
    watch.stop()
    watch.start(2)  # a cell of a few ms: too short to judge on its own (ticks of 10 ms)
    watch.stop()
    (_, _, own0, _), (_, _, own1, foreign1), _ = watch.rows
    assert own0 > 0.8, watch.rows  # the waited-for child's CPU counts as the recording's own
    assert own1 < 0.3 and [r[0] for r in watch.busy_cells()] == [1], watch.rows
    assert watch.foreign_cores() > 0.2, watch.rows  # the spin, over all three cells


def test_record_does_not_judge_a_cell_too_short_to_measure():
    """A cell of a few milliseconds with one tick of another process's CPU would read as
    "2 cores busy" (the whole course was refused so on an idle machine): it is not named."""
    from distkit.course.record import LoadWatch
    watch = LoadWatch()
    watch.rows = [(0, 0.005, 0.0, 2.0), (1, 30.0, 25.0, 0.01)]
    assert watch.busy_cells() == [] and watch.foreign_cores() < 0.5


def test_short_tracebacks_follow_each_rank(tmp_path, capsys):
    """launch(short_tracebacks=True) keeps each rank's error line and drops its frames, also when
    another rank's line lands inside a traceback (notebook 05 cell 27 showed the rest of one)."""
    from distkit.course.notebook import launch
    script = tmp_path / "interleaved.py"
    script.write_text("print('[rank0]: Traceback (most recent call last):')\n"
                      "print('[rank0]:   File \"x.py\", line 1, in <module>')\n"
                      "print('[rank1]: rank 1 says something')\n"
                      "print('[rank0]:   File \"y.py\", line 2, in f')\n"
                      "print('[rank0]: RuntimeError: the error')\n"
                      "print('Traceback (most recent call last):')\n"
                      "print('  File \"z.py\", line 3')\n"
                      "print('ValueError: another')\n")
    launch(1, str(script), short_tracebacks=True)
    out = capsys.readouterr().out.splitlines()[1:]  # after the command line
    assert out == ["[rank1]: rank 1 says something", "[rank0]: RuntimeError: the error",
                   "ValueError: another"], out

"""`make stress`: the tests whose outcome could depend on which rank fails, prints or finishes
first, repeated N times (STRESS_N, default 20) while every core is kept busy, as on a shared CI
runner. Prints passes and failures per test and in all; exit status 1 on any failure.

    STRESS_N=3 make stress          # or: .venv/bin/python tests/stress.py [PYTEST ARGS...]

The busy processes are started here and stopped here (and each stops by itself if this script
dies: it spins only while its parent lives). Not part of `make test`.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# The failure demos, the launcher's failure reports, the exercise starters stopping on every
# rank, a restart (MAX_RESTARTS) after a killed rank, and the capstone's chaos run.
TESTS = [
    "tests/test_ch07_scripts.py",
    "tests/test_ch07_smoke.py::test_disagreeing_rank_stops_every_rank_at_once",
    "tests/test_ch01_exercises.py::test_starter_stops_at_its_first_todo",
    "tests/test_launcher.py",
    "tests/test_distkit.py::test_launch_raises_when_the_launch_fails",
    "tests/test_distkit.py::test_launch_expect_failure_shows_rank_errors",
    "tests/test_ch05_scripts.py::test_a_killed_rank_restarts_the_group_from_the_last_checkpoint",
    # the capstone: SIGKILLs at save steps, resumed to the end, bit-identical (issue 47)
    "tests/test_ch06_scripts.py::test_chaos_kills_at_save_steps_resume_bit_identical",
]
# a busy loop that ends when its parent (this script) is gone
SPIN = "import os\np = os.getppid()\nwhile os.getppid() == p:\n    for _ in range(10**6): pass\n"


def outcomes(junit: Path) -> dict[str, str]:
    """test id -> passed / failed / skipped, from pytest's JUnit XML."""
    if not junit.exists():
        return {}
    found = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        kinds = {child.tag for child in case}
        found[name] = ("failed" if kinds & {"failure", "error"} else
                       "skipped" if "skipped" in kinds else "passed")
    return found


def main() -> int:
    n = int(os.environ.get("STRESS_N", "20"))
    cores = os.cpu_count() or 1
    busy = [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(cores)]
    tally: dict[str, Counter] = {}
    started, rounds_failed = time.monotonic(), 0
    print(f"make stress: {len(TESTS)} test selections x {n} rounds, {cores} busy process(es) "
          f"loading all {cores} core(s)", flush=True)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for i in range(1, n + 1):
                junit = Path(tmp) / f"round{i}.xml"
                t0 = time.monotonic()
                proc = subprocess.run(
                    [sys.executable, "-m", "pytest", *TESTS, *sys.argv[1:], "-q", "-p",
                     "no:cacheprovider", "-m", "not second_nproc", f"--junitxml={junit}"],
                    cwd=ROOT, capture_output=True, text=True)
                got = outcomes(junit)
                for name, outcome in got.items():
                    tally.setdefault(name, Counter())[outcome] += 1
                failed = [name for name, outcome in got.items() if outcome == "failed"]
                if proc.returncode not in (0, 1) or (proc.returncode == 1 and not failed):
                    failed.append(f"pytest exit status {proc.returncode}")  # e.g. a crash
                    tally.setdefault("(the pytest run itself)", Counter())["failed"] += 1
                rounds_failed += bool(failed)
                print(f"round {i}/{n}: {len(got) - len(failed)} passed, {len(failed)} failed"
                      f" ({time.monotonic() - t0:.0f} s)", flush=True)
                if failed:  # the whole output kept: a timeout and a wrong assert read alike here
                    log = ROOT / "build" / "stress" / f"round{i}.log"
                    log.parent.mkdir(parents=True, exist_ok=True)
                    log.write_text(proc.stdout + proc.stderr)
                    print("  failed: " + ", ".join(failed) + f"\n  pytest's output: {log}\n"
                          + "\n".join(ln for ln in proc.stdout.splitlines()
                                      if ln.startswith(("FAILED", "ERROR"))), flush=True)
    finally:
        for p in busy:
            p.kill()
            p.wait()
    width = max(map(len, tally), default=10)
    print(f"\n{'test':{width}s}  passed  failed  skipped")
    for name, c in sorted(tally.items()):
        print(f"{name:{width}s}  {c['passed']:6d}  {c['failed']:6d}  {c['skipped']:7d}")
    total = sum(tally.values(), Counter())
    print(f"{'in all':{width}s}  {total['passed']:6d}  {total['failed']:6d}  {total['skipped']:7d}"
          f"   ({n - rounds_failed}/{n} rounds green, {time.monotonic() - started:.0f} s)")
    return 1 if total["failed"] or not tally else 0


if __name__ == "__main__":
    sys.exit(main())

"""Where a notebook's CPU goes: the launch-cost table (docs/timings.md).

    make course                                # writes build/launches/*.jsonl and course_times.json
    python -m distkit.course.launch_cost       # measures the floors, prints the table (markdown)

Each launch pays a floor before its lesson starts: torchrun's agent (a Python that imports torch)
and, on every rank, a Python that imports torch and what the script imports (transformers costs
about 3 CPU-s a rank). The floor of a launch of SCRIPT on N ranks is measured here as

    agent + N x imports(SCRIPT)

with `agent` the CPU-seconds of `run_w_torchrun.sh 1` on an empty script less one bare Python,
and `imports(SCRIPT)` those of `python SCRIPT --help` (every script parses its arguments after
its imports and before it joins a process group). What a launch costs beyond its floor is the
lesson's own work (process-group set-up included: a few tenths of a CPU-second). The rest of a
notebook's CPU-seconds is its kernel: start-up, cells that compute or plot without launching.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
CODE = ROOT / "code"


def cpu_of(cmd: list[str], env: dict | None = None) -> float:
    """CPU-seconds (user + system) of a command and everything it waited for."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False,
                   env={**os.environ, "PYTHONPATH": str(CODE), **(env or {})})
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def floors(scripts: set[str], repeats: int = 2) -> tuple[float, dict[str, float]]:
    """(agent CPU-s, {script: CPU-s of its imports on one rank}), each the least of `repeats`."""
    with tempfile.TemporaryDirectory() as tmp:
        empty = Path(tmp) / "empty.py"
        empty.write_text("")
        bare = min(cpu_of([sys.executable, str(empty)]) for _ in range(repeats))
        launch = min(cpu_of([str(CODE / "run_w_torchrun.sh"), "1", str(empty)],
                            {"PYTHON": sys.executable}) for _ in range(repeats))
    imports = {s: min(cpu_of([sys.executable, str(CODE / s), "--help"]) for _ in range(repeats))
               for s in sorted(scripts)}
    return launch - bare, imports


def table(build: Path, repeats: int = 2) -> str:
    logs = sorted((build / "launches").glob("*.jsonl"))
    if not logs:
        sys.exit(f"launch_cost: no {build}/launches/*.jsonl: run `make course` first")
    totals = json.loads((build / "course_times.json").read_text())
    runs = {log.stem: [json.loads(line) for line in log.read_text().splitlines() if line]
            for log in logs}
    agent, imports = floors({r["script"] for rs in runs.values() for r in rs}, repeats)
    rows = ["| notebook | launches | ranks | launch CPU-s | floor CPU-s | lesson work CPU-s "
            "| kernel and cells CPU-s | total CPU-s |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    sums = defaultdict(float)
    for name, rs in runs.items():
        launch = sum(r["cpu_seconds"] for r in rs)
        floor = sum(agent + r["nproc"] * imports[r["script"]] for r in rs)
        total = totals.get(f"{name}.ipynb", {}).get("cpu_seconds", float("nan"))
        cols = dict(launches=len(rs), ranks=sum(r["nproc"] for r in rs), launch=launch,
                    floor=floor, work=launch - floor, kernel=total - launch, total=total)
        for k, v in cols.items():
            sums[k] += v
        rows.append(f"| {name[:2]} | {len(rs)} | {cols['ranks']} | {launch:.0f} | {floor:.0f} "
                    f"({floor / max(total, 1e-9):.0%}) | {launch - floor:.0f} | "
                    f"{total - launch:.0f} | {total:.0f} |")
    rows.append(f"| all | {sums['launches']:.0f} | {sums['ranks']:.0f} | {sums['launch']:.0f} | "
                f"{sums['floor']:.0f} ({sums['floor'] / sums['total']:.0%}) | {sums['work']:.0f}"
                f" | {sums['kernel']:.0f} | {sums['total']:.0f} |")
    heavy = sorted(imports.items(), key=lambda kv: -kv[1])[:5]
    notes = [f"Floors measured here: torchrun's agent {agent:.1f} CPU-s a launch; a rank's "
             f"imports {min(imports.values()):.1f}-{max(imports.values()):.1f} CPU-s (heaviest: "
             + ", ".join(f"{Path(s).name} {c:.1f}" for s, c in heavy) + ")."]
    return "\n".join(rows + [""] + notes)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--build", type=Path, default=ROOT / "build",
                        help="where make course wrote launches/ and course_times.json")
    print(table(parser.parse_args(argv).build))
    return 0


if __name__ == "__main__":
    sys.exit(main())

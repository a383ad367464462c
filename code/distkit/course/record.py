"""Record a notebook's stored outputs: execute it in place, and refuse a recording made on a busy
machine.

    make record NB=04                      # notebooks/04_*.ipynb
    python -m distkit.course.record notebooks/04_fsdp2.ipynb [--allow-load]

Stored timings teach only when nothing else ran beside them: a notebook recorded while other
programs kept the cores busy shows a machine's load, not the lesson ("overlap hid 114 %"). So the
recorder measures, for every cell, how much CPU *other* processes used while it ran (the
machine's busy CPU-seconds from /proc/stat, less those of this recorder, the kernel and every
process they started) and how much the cell itself used. A cell during which others kept more
than FOREIGN_LIMIT cores busy is named, and the recording is refused: the notebook is left as
it was, unless --allow-load (a draft, to be re-recorded on an idle machine). Before it starts,
others may not keep more than FOREIGN_LIMIT cores busy for a second.

Linux only (/proc/stat); elsewhere it records without the check and says so.

Every recording also stores the notebook-level metadata JupyterLab writes when it opens the
notebook (the kernelspec's name, display name and language; the kernel's language_info), so that
opening a notebook in `make lab` leaves it unmodified (tests/test_lab.py checks it). Only that
metadata, without executing anything (e.g. after a notebook was recorded elsewhere):

    python -m distkit.course.record --metadata notebooks/*.ipynb
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
FOREIGN_LIMIT = 0.5  # cores that other processes may keep busy, on average over a cell
# Cells shorter than this are not judged one by one: /proc/stat and the processes' times count in
# ticks of 10 ms, so a 20 ms cell's share of "other" CPU is noise (0.02 s in 0.01 s: "2 cores").
# They still count in the whole notebook's average.
MIN_CELL_S = 1.0


def busy_seconds() -> float | None:
    """CPU-seconds the whole machine has spent busy (all cores, /proc/stat), or None."""
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    except OSError:
        return None
    user, nice, system, idle, iowait, irq, softirq, steal = map(int, fields[:8])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def tree_seconds(pids: list[int]) -> float:
    """CPU-seconds of these processes, their waited-for children, and every live descendant."""
    import psutil
    total = 0.0
    for pid in pids:
        try:
            root = psutil.Process(pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            continue
        for p in procs:
            try:
                t = p.cpu_times()
            except psutil.NoSuchProcess:
                continue
            total += t.user + t.system + (t.children_user + t.children_system if p is root else 0)
    return total


class LoadWatch:
    """Per cell: wall seconds, this recording's CPU-seconds and other processes' CPU-seconds."""

    def __init__(self):
        self.pids = [os.getpid()]
        self.rows = []  # (cell index, wall s, own CPU-s, foreign cores)
        self._start = None

    def start(self, cell_index: int):
        self._start = (cell_index, time.monotonic(), busy_seconds(), tree_seconds(self.pids))

    def stop(self):
        if self._start is None:
            return
        index, t0, busy0, own0 = self._start
        wall, busy1, own1 = time.monotonic() - t0, busy_seconds(), tree_seconds(self.pids)
        if busy0 is not None and busy1 is not None and wall > 0:
            own = own1 - own0
            foreign = max(0.0, (busy1 - busy0) - own) / wall
            self.rows.append((index, wall, own, foreign))
        self._start = None

    def busy_cells(self) -> list[tuple]:
        """The cells long enough to judge during which others kept > FOREIGN_LIMIT cores busy."""
        return [r for r in self.rows if r[1] >= MIN_CELL_S and r[3] > FOREIGN_LIMIT]

    def foreign_cores(self) -> float:
        """Other processes' busy cores, averaged over every cell's wall time."""
        wall = sum(r[1] for r in self.rows)
        return sum(r[1] * r[3] for r in self.rows) / wall if wall else 0.0


def kernelspec_metadata(kernel_name: str = "python3") -> dict:
    """The `kernelspec` JupyterLab stores on open: exactly these three keys, from the spec."""
    from jupyter_client.kernelspec import KernelSpecManager
    spec = KernelSpecManager().get_kernel_spec(kernel_name)
    return {"display_name": spec.display_name, "language": spec.language, "name": kernel_name}


def kernel_metadata(kernel_name: str = "python3") -> dict:
    """The notebook-level metadata JupyterLab writes when it opens a notebook on this kernel:
    the kernelspec, and the language_info of the kernel's kernel_info reply (its Python's
    version among them). Starts the kernel once (about a second)."""
    import subprocess

    from jupyter_client.manager import start_new_kernel
    # Its stderr is the kernel's start-up chatter ("running over TCP without encryption").
    km, kc = start_new_kernel(kernel_name=kernel_name, stderr=subprocess.DEVNULL)
    try:
        kc.kernel_info()
        info = kc.get_shell_msg(timeout=60)["content"]["language_info"]
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
    return {"kernelspec": kernelspec_metadata(kernel_name), "language_info": info}


def normalise_metadata(paths: list[Path], metadata: dict | None = None) -> list[Path]:
    """Store `metadata` (default: this machine's kernel_metadata()) in each notebook, in the
    layout Jupyter's server writes (nbformat's; a notebook another tool wrote is rewritten by
    the first save in JupyterLab), changing nothing else; returns the notebooks it changed."""
    import nbformat
    metadata = metadata or kernel_metadata()
    changed = []
    for path in paths:
        text = path.read_text(encoding="utf-8")
        nb = nbformat.reads(text, as_version=4)
        nb.metadata.update(metadata)
        new = nbformat.writes(nb)
        new += "" if new.endswith("\n") else "\n"  # as nbformat.write ends a file
        if new != text:
            path.write_text(new, encoding="utf-8")
            changed.append(path)
    return changed


def record(path: Path, allow_load: bool = False, timeout: int = 900) -> int:
    import nbformat
    from nbclient import NotebookClient

    # Before it starts, one second of the machine with this recorder idle: all that is busy is
    # others'. (Not the load average: it still holds the previous notebook's own launches.)
    probe = LoadWatch()
    probe.start(-1)
    time.sleep(1.0)
    probe.stop()
    if probe.foreign_cores() > FOREIGN_LIMIT and not allow_load:
        print(f"record: other processes keep {probe.foreign_cores():.1f} cores busy: wait for an "
              "idle machine (or --allow-load for a draft)", file=sys.stderr)
        return 1
    nb = nbformat.read(path, as_version=4)
    watch = LoadWatch()
    client = NotebookClient(nb, timeout=timeout, kernel_name="python3",
                            resources={"metadata": {"path": str(path.parent)}})

    async def on_start(cell, cell_index, **_):
        if not watch.pids[1:] and client.km is not None:
            process = getattr(getattr(client.km, "provisioner", None), "process", None)
            if process is not None:
                watch.pids.append(process.pid)
        watch.start(cell_index)

    async def on_done(cell, cell_index, **_):
        watch.stop()

    client.on_cell_execute = on_start
    client.on_cell_executed = on_done
    t0 = time.monotonic()
    client.execute()
    wall = time.monotonic() - t0
    own = sum(r[2] for r in watch.rows)
    print(f"record: {path.name} executed in {wall:.0f} s, {own:.0f} CPU-s of its own")
    if not watch.rows:
        print("record: no /proc/stat here: the machine's load was not checked")
    busy = watch.busy_cells()
    for index, secs, _, foreign in busy:
        print(f"record: cell {index} ran {secs:.1f} s while other processes kept {foreign:.1f} "
              f"cores busy (limit {FOREIGN_LIMIT})", file=sys.stderr)
    overall = watch.foreign_cores()
    if overall > FOREIGN_LIMIT:
        busy.append(None)
        print(f"record: other processes kept {overall:.1f} cores busy on average over the "
              f"notebook (limit {FOREIGN_LIMIT})", file=sys.stderr)
    if busy and not allow_load:
        print(f"record: refused, {path.name} left as it was: record it on an idle machine "
              "(or --allow-load for a draft)", file=sys.stderr)
        return 1
    # nbclient stored the kernel's language_info; the kernelspec as JupyterLab writes it too.
    nb.metadata["kernelspec"] = kernelspec_metadata(client.kernel_name)
    nbformat.write(nb, path)
    print(f"record: wrote {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}"
          + (" (a draft: recorded under load)" if busy else ""))
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m distkit.course.record",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("notebooks", nargs="+", type=Path)
    parser.add_argument("--allow-load", action="store_true",
                        help="write the outputs even if the machine was busy (a draft)")
    parser.add_argument("--metadata", action="store_true",
                        help="execute nothing: only store the metadata JupyterLab writes on open")
    args = parser.parse_args(argv)
    for path in args.notebooks:
        if not path.exists():
            parser.error(f"no such notebook: {path}")
    if args.metadata:
        changed = normalise_metadata([p.resolve() for p in args.notebooks])
        for path in changed:
            print(f"record: wrote the metadata of {path.relative_to(ROOT)}")
        print(f"record: {len(args.notebooks) - len(changed)} notebook(s) already had it")
        return 0
    status = 0
    for path in args.notebooks:
        status |= record(path.resolve(), args.allow_load)
    return status


if __name__ == "__main__":
    sys.exit(main())

"""The launch-cost table (docs/timings.md): make course logs each launch's CPU-seconds, and
distkit.course.launch_cost splits them into the floor (torchrun's agent, each rank's imports)
and the lesson's work."""
import json

from distkit.course import launch_cost
from distkit.course.notebook import launch


def test_a_launch_is_logged_and_split_into_floor_and_work(tmp_path, monkeypatch, capsys):
    log = tmp_path / "launches" / "00_x.jsonl"
    log.parent.mkdir()
    monkeypatch.setenv("COURSE_LAUNCH_LOG", str(log))
    launch(2, "ch00_collectives/hello.py")
    (row,) = [json.loads(line) for line in log.read_text().splitlines()]
    assert row["script"] == "ch00_collectives/hello.py" and row["nproc"] == 2
    # two ranks and an agent, each importing torch: at least a CPU-second, and the floor is
    # most of it (hello.py does almost nothing)
    assert row["cpu_seconds"] > 1 and row["seconds"] > 0
    (tmp_path / "course_times.json").write_text(
        json.dumps({"00_x.ipynb": {"seconds": 10, "cpu_seconds": row["cpu_seconds"] + 2}}))
    text = launch_cost.table(tmp_path, repeats=1)
    cells = next(ln for ln in text.splitlines() if ln.startswith("| 00 |")).split("|")
    launches, ranks, cpu, floor, work, kernel = (c.strip() for c in cells[2:8])
    assert (launches, ranks, kernel) == ("1", "2", "2")
    assert 0.5 * float(cpu) < float(floor.split()[0]) < 1.5 * float(cpu), text
    assert "torchrun's agent" in text

"""Chapter 04's 2D meshes (code/ch04_fsdp2/fsdp2_2d.py): bad input and --help. The notebook runs
it on 4 processes and asserts parity and which mesh dimension each collective crosses."""
import pytest

from conftest import CODE, run_in_process

SCRIPT = "ch04_fsdp2/fsdp2_2d.py"


@pytest.mark.parametrize("args, world, message", [
    ([], "2", "hsdp needs processes = replicate x shard with both >= 2; got 2 processes"),
    (["--layouts", "fsdp,fsdp+tp", "--tp", "4"], "6", "fsdp+tp needs processes = dp x tp"),
    (["--layouts", "hsdp", "--shard", "4"], "4", "got 4 processes and --shard 4"),
    (["--layouts", "fsdp,ddp"], "4", "--layouts: unknown ddp"),
    (["--tp", "4", "--heads", "2"], "8", "--heads 2 is not a multiple of --tp 4"),
    (["--hidden", "30"], "4", "--hidden 30 is not a multiple of --heads 4"),
    (["--batch-size", "6"], "4", "--batch-size 6 does not split over 4 processes"),
    (["--steps", "0"], "4", "must be >= 1"),
])
def test_bad_input(monkeypatch, capsys, args, world, message):
    status, _, err = run_in_process(monkeypatch, capsys, SCRIPT, *args,
                                    env={"WORLD_SIZE": world})  # as torchrun would set it
    lines = err.strip().splitlines()
    assert status == 2 and lines[0].startswith("usage:")
    assert lines[-1].startswith("fsdp2_2d.py: error:") and message in lines[-1], lines[-1]


def test_help_is_whole_sentences(monkeypatch, capsys):
    first = (CODE / SCRIPT).read_text().split('"""')[1].split("\n\n")[0]
    assert first.rstrip().endswith("."), first
    status, out, _ = run_in_process(monkeypatch, capsys, SCRIPT, "--help")
    assert status == 0 and "--layouts" in out and "--json" in out
    assert " ".join(first.split()) in " ".join(out.split())

"""Chapter 07, "Ranks that silently diverge" (code/ch07_debugging/diverge.py): bad input.

The run itself is the notebook's: its compared table shows every variant's checksums and parity,
and a cell asserts them from the JSON (the bugs differ at step 0 and at the end, the fixes match
one process within 1e-5), so nbval fails when they change; no second launch here."""
from conftest import run_in_process

SCRIPT = "ch07_debugging/diverge.py"


def test_unknown_variant_is_one_line(monkeypatch, capsys):
    code, _, err = run_in_process(monkeypatch, capsys, SCRIPT, "--variants", "ddp,bogus")
    assert code == 2
    assert "unknown --variants bogus" in err.strip().splitlines()[-1]

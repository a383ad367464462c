"""Chapter 07's DDP communication hooks (code/ch07_debugging/comm_hooks.py): bad input.

The run is the notebook's: its compared table shows each hook's measured bytes per step beside
the formula, and a cell asserts them equal from the JSON; no second launch here."""
from conftest import run_in_process

SCRIPT = "ch07_debugging/comm_hooks.py"


def test_unknown_hook_is_one_line(monkeypatch, capsys):
    status, _, err = run_in_process(monkeypatch, capsys, SCRIPT, "--hooks", "none,int8")
    assert status == 2
    assert "unknown --hooks int8; choose from none, fp16, bf16, powersgd" in \
        err.strip().splitlines()[-1]


def test_bad_sum_ranks_is_one_line(monkeypatch, capsys):
    status, _, err = run_in_process(monkeypatch, capsys, SCRIPT, "--sum-ranks", "1,8")
    assert status == 2
    assert ("--sum-ranks must list ranks between 2 and 1024, got '1,8'"
            in err.strip().splitlines()[-1])

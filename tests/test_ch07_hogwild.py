"""Chapter 07's Hogwild! script (code/ch07_debugging/hogwild.py): bad input.

The run is the notebook's: its compared cell shows what every run must show (synchronous SGD's
mean gradient is the big batch's, every run learns, tau = 0 is plain SGD bit for bit, which
(lr, tau) diverge, the quadratic's stability bound), and the next cell asserts from the JSON what
the table does not show (every update counted once with its staleness, a delay changes the run,
the stalest large-rate run blew up and stopped early); no second run here.
"""
import pytest

from conftest import run_in_process

SCRIPT = "ch07_debugging/hogwild.py"


@pytest.mark.parametrize("args, message", [
    (["--workers", "0"], "--workers must be at least 1"),
    (["--taus", "1,4"], "including 0"),
    (["--taus", "0,-1"], "non-negative"),
    (["--taus", "0,x"], "comma-separated integers"),
    (["--lrs", "0"], "must be positive"),
])
def test_bad_input_one_line_error(monkeypatch, capsys, args, message):
    status, _, err = run_in_process(monkeypatch, capsys, SCRIPT, *args)
    assert status == 2 and message in err.strip().splitlines()[-1]

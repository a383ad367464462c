"""Chapter 05's dcp_tour.py: bad input stops it with one line (exit status 2) before setup().
The notebook (nbval) runs it on 2 processes and asserts its results."""
import pytest

from conftest import run_in_process

SCRIPT = "ch05_checkpoint/dcp_tour.py"


@pytest.mark.parametrize("args, message", [
    (["--repeats", "0"], "--repeats must be at least 1"),
    (["--hidden", "12"], "--hidden must be a multiple of 8"),
    (["--hidden", "0"], "--hidden must be a multiple of 8"),
    (["--out", "FILE"], "is a file, not a folder"),
])
def test_bad_input_one_line_error(monkeypatch, capsys, tmp_path, args, message):
    afile = tmp_path / "not_a_folder"
    afile.write_text("")
    args = [str(afile) if a == "FILE" else a for a in args]
    status, out, err = run_in_process(monkeypatch, capsys, SCRIPT, *args)
    assert status == 2 and out == ""
    assert message in err.strip().splitlines()[-1]

"""Chapter 04's LoRA with FSDP2 (code/ch04_fsdp2/lora_fsdp2.py): bad input. The notebook runs it
at N = 2 and asserts parity, the falling loss and the frozen base; nbval pins the bytes."""
import pytest

from conftest import run_in_process

SCRIPT = "ch04_fsdp2/lora_fsdp2.py"


@pytest.mark.parametrize("args, message", [
    (["--rank", "0"], "need 1 <= --rank <= 64"),
    (["--rank", "65"], "need 1 <= --rank <= 64"),
    (["--steps", "1"], "need 2 <= --steps <= 100"),
    (["--rank", "four"], "invalid int value"),
])
def test_bad_input_one_line_error(monkeypatch, capsys, args, message):
    status, _, err = run_in_process(monkeypatch, capsys, SCRIPT, *args)
    assert status == 2 and message in err.strip().splitlines()[-1]


def test_too_many_processes_for_the_data(monkeypatch, capsys):
    status, _, err = run_in_process(monkeypatch, capsys, SCRIPT, env={"WORLD_SIZE": "65"})
    assert status == 2 and "need at most 64 processes" in err.strip().splitlines()[-1]

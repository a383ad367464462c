"""Chapter 04's FSDP1 side by side (code/ch04_fsdp2/fsdp1.py): bad input. The notebook runs it
at N = 2 and asserts its parity and padding; nbval pins every printed byte count."""
import pytest

from conftest import run_in_process

SCRIPT = "ch04_fsdp2/fsdp1.py"
N = 2


@pytest.mark.parametrize("args, env, message", [
    (["--strategies", "FULL_SHARD,ZERO3"], {}, "unknown strategy ZERO3"),
    (["--strategies", "HYBRID_SHARD"], {}, "HYBRID_SHARD needs a mesh RxS with R x S = 2"),
    (["--strategies", "HYBRID_SHARD:2x2"], {}, "R x S = 2 processes"),
    (["--strategies", "NO_SHARD:1x2"], {}, "only HYBRID_SHARD takes a mesh"),
    (["--steps", "0"], {}, "--steps must be >= 1"),
    ([], {"WORLD_SIZE": "1"}, "needs at least 2 processes, got 1"),
])
def test_bad_input_one_line_error(monkeypatch, capsys, args, env, message):
    status, _, err = run_in_process(monkeypatch, capsys, SCRIPT, *args,
                                    env={"WORLD_SIZE": str(N), **env})
    assert status == 2 and message in err.strip().splitlines()[-1]

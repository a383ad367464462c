"""Chapter 05's formats.py: one process (no torchrun) loads a checkpoint that train_ckpt.py saved
with FSDP2 on 2 ranks, continues training it, and converts it (torch.save file, back to DCP,
Hugging Face safetensors). One launch of train_ckpt.py makes the checkpoints for the module."""
import json
import shutil

import pytest

from conftest import run_in_process, run_ok, run_scripts_at_once

SCRIPT = "ch05_checkpoint/formats.py"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """train_ckpt.py on 2 ranks, global batch 24 (formats.py's default): checkpoints at steps
    5, 10, 15, 20 and the uninterrupted run's losses and digest."""
    tmp = tmp_path_factory.mktemp("ch05_formats")
    run_ok(2, "ch05_checkpoint/train_ckpt.py", "--batch-size", 12, "--keep", 4,
           "--ckpt-dir", tmp / "ckpt", "--json", tmp / "a.json")
    return tmp


def test_missing_checkpoint_is_one_line_exit_2(monkeypatch, capsys, tmp_path):
    status, _, err = run_in_process(monkeypatch, capsys, SCRIPT, "--checkpoint", tmp_path / "nope")
    assert status == 2 and err.strip().splitlines()[-1].endswith(f"no folder {tmp_path / 'nope'}")


@pytest.mark.parametrize("damage, message", [
    ("metadata", "not a DCP checkpoint (no .metadata file)"),
    ("manifest", "not a committed checkpoint (no readable manifest.json)"),
    ("shard", "not a committed checkpoint (__0_0.distcp does not match its sha256"),
])
def test_uncommitted_or_damaged_checkpoint_is_one_line_exit_2(monkeypatch, capsys, tmp_path, run,
                                                             damage, message):
    bad = tmp_path / "step_000010"
    shutil.copytree(run / "ckpt" / "step_000010", bad)
    if damage == "shard":  # same size, one byte flipped: only the checksum sees it
        data = bytearray((bad / "__0_0.distcp").read_bytes())
        data[-1] ^= 1
        (bad / "__0_0.distcp").write_bytes(bytes(data))
    else:
        (bad / {"metadata": ".metadata", "manifest": "manifest.json"}[damage]).unlink()
    status, _, err = run_in_process(monkeypatch, capsys, SCRIPT, "--checkpoint", bad)
    assert status == 2 and message in err.strip().splitlines()[-1]


def test_plain_model_continues_and_every_format_round_trips(run, tmp_path):
    """At the defaults, from step 10 of the 2-rank run: loaded == saved to the bit, the losses
    of the continued run match the uninterrupted one, and every conversion gives back the same
    tensors."""
    out = tmp_path / "formats.json"
    (status, stdout, err), = run_scripts_at_once({"formats": (SCRIPT, [
        "--checkpoint", run / "ckpt" / "step_000010", "--reference", run / "a.json",
        "--out", tmp_path / "out", "--json", out], {})}).values()
    assert status == 0, err[-2000:]
    res = json.loads(out.read_text())
    reference = json.loads((run / "a.json").read_text())
    assert res["step"] == 10 and res["saved_world_size"] == 2 and res["final_step"] == 20
    assert res["loaded_equal"]
    assert res["losses"][:10] == reference["losses"][:10]  # read from the checkpoint
    assert res["parity"] and res["reference_max_diff"] < 1e-5 and len(res["losses"]) == 20
    ts = res["torch_save"]
    assert ts["keys"] == ["app", "progress", "rng"] and ts["tensors"] == 86
    assert ts["dcp_files"] == 2 and ts["dcp_pieces"] == 149 and ts["round_trip_data_files"] == 1
    assert ts["model_equal"] and ts["round_trip_same_keys"] and ts["round_trip_equal"]
    hf = res["hf"]
    assert set(hf["files"]) >= {"config.json", "model.safetensors"}
    assert hf["logits_equal"] and hf["logits_max_abs_diff"] == 0 and hf["dtype"] == "torch.float32"
    assert "max |diff| < 1e-5: True" in stdout and "loaded == saved (sha256): True" in stdout
    assert not err.strip(), err[-2000:]  # no warnings or progress bars in the notebook

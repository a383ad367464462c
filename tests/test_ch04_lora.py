"""Chapter 04's LoRA with FSDP2 (lora_fsdp2.py): one 2-process launch and its bad input.

Budget: one launch (measured 17-19 s wall on a shared 2-core machine, of which ~4 s compute; the
rest is torchrun and two processes importing torch, transformers and peft) and the bad-input
checks in this process (they pay one peft import: 6-10 s measured under load)."""
import pytest

from conftest import run_in_process, run_json

SCRIPT = "ch04_fsdp2/lora_fsdp2.py"
# distkit.toy.tiny_llama's defaults: 2 layers, width 64, MLP width 128
LAYERS, HIDDEN, MLP = 2, 64, 128
PROJECTIONS = [(HIDDEN, HIDDEN)] * 4 + [(HIDDEN, MLP)] * 2 + [(MLP, HIDDEN)]  # q k v o gate up down
BASE_TENSORS = 3 + LAYERS * (7 + 2)  # embeddings, final norm, LM head; 7 Linear + 2 norms a layer


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


@pytest.fixture(scope="module")
def lora(tmp_path_factory):
    return run_json(tmp_path_factory.mktemp("lora"), 2, SCRIPT)


def test_trainable_count_is_r_times_in_plus_out_per_adapted_linear(lora):
    res, out = lora
    r = res["lora_rank"]
    assert r == 4 and res["world_size"] == 2
    assert sorted((i, o) for _, i, o in res["adapted"]) == sorted(PROJECTIONS * LAYERS)
    assert res["trainable"] == LAYERS * sum(r * (i + o) for i, o in PROJECTIONS) == 8704
    assert res["total"] == res["base_params"] + res["trainable"]
    assert "trainable parameters: 8,704 of 107,328 (8.11%)" in out


def test_gradients_and_adamw_state_only_for_the_adapters(lora):
    res, _ = lora
    n, trainable, base = res["world_size"], res["trainable"], res["base_params"]
    assert res["dims_divide"]  # no padding: the ZeRO-3 formulas hold to the byte
    for rank in res["ranks"]:
        lo, full = rank["lora"], rank["full"]
        # parameters: every one sharded, frozen or not (LoRA adds its adapters to the base)
        assert lo["params"] == 4 * (base + trainable) // n and full["params"] == 4 * base // n
        # gradients: fp32 shards of the trainable parameters only
        assert lo["grads"] == 4 * trainable // n and full["grads"] == 4 * base // n
        assert lo["grads"] * base == full["grads"] * trainable
        # AdamW: exp_avg + exp_avg_sq shards, and a 4-byte step per trainable tensor
        assert lo["optimizer"] == 8 * trainable // n + 4 * 2 * len(res["adapted"])
        assert full["optimizer"] == 8 * base // n + 4 * BASE_TENSORS
        assert lo["optimizer"] < 0.1 * full["optimizer"]
        for run in ("lora", "full"):
            for c in ("grads", "optimizer"):
                assert rank[run][c] == rank[run + "_expected"][c]


def test_losses_match_one_process_and_fall(lora):
    res, out = lora
    assert len(res["losses"]) == len(res["single_losses"]) == res["steps"] == 8
    assert max(abs(a - b) for a, b in zip(res["losses"], res["single_losses"])) < 1e-5
    assert res["losses"][-1] < res["losses"][0] - 0.1
    assert "max |loss - reference| < 1e-5: True" in out


def test_frozen_base_bit_exact_and_every_adapter_trained_on_every_rank(lora):
    res, out = lora
    assert all(r["frozen_unchanged"] and r["adapters_changed"] for r in res["ranks"])
    assert out.count(": True") == 6 and "False" not in out

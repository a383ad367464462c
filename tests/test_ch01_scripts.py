"""Chapter 01: DDP against a single process, bucketing, no_sync, checkpoints, memory, pitfalls."""
import json

import pytest
import torch
from torch.utils.data.distributed import DistributedSampler

from conftest import run_json, run_launcher, run_ok

LOSS_TOL = 1e-5    # per-step loss, DDP vs single process (float32, different summation order)
WEIGHT_TOL = 1e-4  # final weights after 32 AdamW steps (Adam amplifies the last-bit noise)


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """The reference: one process, global batch 16, two epochs."""
    tmp = tmp_path_factory.mktemp("single")
    run_ok(1, "ch01_ddp/train_single.py", "--batch-size", 16, "--json", tmp / "s.json",
           "--save", tmp / "s.pt")
    return json.loads((tmp / "s.json").read_text())["losses"], torch.load(tmp / "s.pt")


def max_weight_diff(a, b):
    return max((a[k] - b[k]).abs().max().item() for k in a)


def test_single_process_loss_falls(single):
    losses, _ = single
    assert len(losses) == 32 and losses[-1] < losses[0] - 2


@pytest.mark.parametrize("n, extra", [(2, []), (4, []), (2, ["--accum", "2"])],
                         ids=["N=2", "N=4", "N=2,accum=2"])
def test_ddp_matches_single_process(tmp_path, single, n, extra):
    per_rank = 16 // n // (2 if extra else 1)
    ckpt = tmp_path / "d.pt"
    res, _ = run_json(tmp_path, n, "ch01_ddp/train_ddp.py", "--batch-size", per_rank, *extra,
                      "--save", ckpt)
    ref_losses, ref_weights = single
    assert len(res["losses"]) == len(ref_losses)
    assert max(abs(a - b) for a, b in zip(res["losses"], ref_losses)) < LOSS_TOL
    assert max_weight_diff(torch.load(ckpt, weights_only=True)["model"], ref_weights) < WEIGHT_TOL


def test_buckets_carry_exactly_the_gradient_bytes(tmp_path):
    res, _ = run_json(tmp_path, 2, "ch01_ddp/train_ddp.py", "--epochs", 1, "--log-comm",
                      "--bucket-cap-mb", 0.05)
    comm = res["comm"]
    per_backward = {}
    for call in comm["calls"]:
        per_backward.setdefault(call["backward"], []).append(call)
    assert len(per_backward) == len(comm["backwards"]) == 16
    for calls in per_backward.values():
        assert sum(c["bytes"] for c in calls) == comm["grad_bytes"] == 4 * comm["num_params"]
    assert len(per_backward[0]) == 1   # first step: one bucket, before DDP rebuilds them
    assert len(per_backward[1]) > 3    # then buckets of about --bucket-cap-mb
    big, _ = run_json(tmp_path, 2, "ch01_ddp/train_ddp.py", "--epochs", 1, "--log-comm")
    assert {c["backward"] for c in big["comm"]["calls"]} == set(range(16))
    assert len(big["comm"]["calls"]) == 16  # default 25 MB: one bucket per step


def test_no_sync_skips_all_reduces(tmp_path):
    counts = {}
    for flag in ([], ["--sync-micro-batches"]):
        res, _ = run_json(tmp_path, 2, "ch01_ddp/train_ddp.py", "--epochs", 1, "--batch-size", 2,
                          "--accum", 4, "--log-comm", *flag)
        counts[bool(flag)] = (len(res["comm"]["calls"]), res["losses"])
    (calls, losses), (calls_sync, losses_sync) = counts[False], counts[True]
    assert len(losses) == 16 and calls == 16 and calls_sync == 4 * 16
    assert max(abs(a - b) for a, b in zip(losses, losses_sync)) < LOSS_TOL


def test_resume_is_bit_exact(tmp_path):
    full, _ = run_json(tmp_path, 2, "ch01_ddp/train_ddp.py", "--epochs", 2)
    ckpt = tmp_path / "epoch1.pt"
    run_ok(2, "ch01_ddp/train_ddp.py", "--epochs", 1, "--save", ckpt)
    resumed, _ = run_json(tmp_path, 2, "ch01_ddp/train_ddp.py", "--epochs", 2, "--resume", ckpt)
    assert resumed["losses"] == full["losses"]


def test_set_epoch_changes_the_order():
    data = list(range(16))
    orders = {}
    for set_epoch in (False, True):
        s = DistributedSampler(data, num_replicas=2, rank=0, shuffle=True, seed=0)
        epochs = []
        for e in range(3):
            if set_epoch:
                s.set_epoch(e)
            epochs.append(list(s))
        orders[set_epoch] = epochs
    assert orders[False][0] == orders[False][1] == orders[False][2]
    assert len({tuple(o) for o in orders[True]}) == 3


def test_ddp_memory_matches_16_bytes_per_param(tmp_path):
    res, _ = run_json(tmp_path, 2, "ch01_ddp/ddp_memory.py")
    n = res["num_params"]
    for rank in range(2):  # every rank holds everything
        assert res["params"][rank] == 4 * n and res["grads"][rank] == 4 * n
        assert res["optimizer"][rank] == 8 * n + 4 * res["num_tensors"]  # + AdamW step counters


def test_batchnorm_uses_local_statistics(tmp_path):
    res, out = run_json(tmp_path, 2, "ch01_ddp/batchnorm_ddp.py")
    assert min(res["local_gap"]) > 0.1 and min(res["running_gap"]) > 0.01
    assert max(res["synced_gap"]) < 1e-5
    if not torch.cuda.is_available():
        assert "needs CUDA" in out


def test_join_handles_uneven_inputs():
    out = run_ok(2, "ch01_ddp/uneven_join.py").stdout
    assert "[rank 0] ran 3 steps" in out and "[rank 1] ran 5 steps" in out


def test_without_join_uneven_inputs_fail_not_hang():
    proc = run_launcher(2, "ch01_ddp/uneven_join.py", "--no-join", env={"COURSE_TIMEOUT_S": "5"},
                        timeout=120)
    assert proc.returncode != 0 and "all ranks finished" not in proc.stdout
    assert "[rank1]: RuntimeError" in proc.stdout + proc.stderr  # rank 1's extra step timed out


@pytest.mark.parametrize("script, args, message", [
    ("ch01_ddp/train_single.py", ["--batch-size", "0"], "--batch-size"),
    ("ch01_ddp/train_ddp.py", ["--accum", "0"], "--accum >= 1"),
    ("ch01_ddp/ddp_memory.py", ["--hidden", "6"], "multiple of 4"),
    ("ch01_ddp/batchnorm_ddp.py", ["--batch-size", "1"], "at least 2"),
    ("ch01_ddp/solutions/ex01_manual_ddp.py", ["--batch-size", "0"], "must be positive"),
])
def test_bad_input(script, args, message):
    proc = run_launcher(1 if script == "ch01_ddp/train_single.py" else 2, script, *args, timeout=60)
    assert proc.returncode != 0 and message in proc.stderr


@pytest.mark.parametrize("flat", [False, True], ids=["per-tensor", "flat"])
def test_solution_manual_ddp(tmp_path, single, flat):
    res, _ = run_json(tmp_path, 2, "ch01_ddp/solutions/ex01_manual_ddp.py", *(["--flat"] if flat else []))
    assert max(abs(a - b) for a, b in zip(res["losses"], single[0])) < LOSS_TOL
    assert res["calls_per_step"] == (1 if flat else 21)

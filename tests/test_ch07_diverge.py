"""Chapter 07, "Ranks that silently diverge" (code/ch07_debugging/diverge.py): one launch sweeps
every variant. The two bugs start the ranks from different weights, which the checksum sees at
step 0 and which training never repairs (while every rank's loss falls: nothing looks wrong); the
two fixes agree at step 0, stay bit-identical, and match one process on the whole batch."""
import re

import pytest

from conftest import run_in_process, run_json

SCRIPT = "ch07_debugging/diverge.py"
BUGS, FIXES = ("seed-per-rank", "rng-drift"), ("broadcast", "ddp")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return run_json(tmp_path_factory.mktemp("diverge"), 2, SCRIPT)


def table(stdout: str) -> dict[str, list[str]]:
    """variant -> its row's cells (columns are separated by 2+ spaces)."""
    rows = [re.split(r"\s{2,}", line) for line in stdout.splitlines()]
    return {row[0]: row[1:] for row in rows if row[0] in BUGS + FIXES}


@pytest.mark.parametrize("variant", BUGS)
def test_bugs_diverge_silently(run, variant):
    results, stdout = run
    r = results["variants"][variant]
    assert not r["checksums_equal_step0"] and r["ranks_disagreeing_step0"] == [1]
    assert r["ranks_disagreeing_end"] == [1] and not r["weights_equal_end"]
    gap = r["weight_gap"]  # max |w_rank0 - w_rank1|: the same update on both, the gap is frozen
    assert len(gap) == results["steps"] + 1 and gap[0] > 0.1
    assert all(abs(g / gap[0] - 1) < 1e-3 for g in gap)
    for losses in r["eval_loss"]:  # the run "works": every rank's model improves
        assert losses[-1] < losses[0] - 0.2
    rank0, rank1 = (losses[-1] for losses in r["eval_loss"])
    assert abs(rank0 - rank1) > 1e-3  # ...but the ranks' models differ on the same batch
    assert r["parity"] is None
    assert table(stdout)[variant] == ["False (rank 1 differs from rank 0)", "False", "n/a"]
    assert f"{variant}: largest weight gap between ranks after 20 steps / at step 0 = 1.00" \
        in stdout


@pytest.mark.parametrize("variant", FIXES)
def test_fixes_agree_and_match_one_process(run, variant):
    results, stdout = run
    r = results["variants"][variant]
    assert r["checksums_equal_step0"] and r["weights_equal_end"]
    assert r["ranks_disagreeing_step0"] == r["ranks_disagreeing_end"] == []
    assert set(r["weight_gap"]) == {0.0}
    assert r["eval_loss"][0] == r["eval_loss"][1]  # bit-identical models, identical losses
    assert r["train_loss"][0] != r["train_loss"][1]  # ...though each rank trains on its own shard
    p = r["parity"]
    assert p["ok"] and p["max_loss_diff"] < 1e-5 and p["max_weight_diff"] < 1e-5
    assert table(stdout)[variant] == ["True", "True", "True"]


def test_unknown_variant_is_one_line(monkeypatch, capsys):
    code, _, err = run_in_process(monkeypatch, capsys, SCRIPT, "--variants", "ddp,bogus")
    assert code == 2
    assert "unknown --variants bogus" in err.strip().splitlines()[-1]

"""Chapter 05's scripts and checkpoint folder beyond what the notebook runs: bad input (of
train_ckpt.py and formats.py), and distkit.ckpt.CheckpointDir's rules (atomic commit, checks,
keep-last-K, steps past 999,999) on fake folders, in this process, and on 2 forked gloo ranks
that see the folder differently (they must agree, and not hang). The notebook (nbval) runs the
scripts for real: train_ckpt.py uninterrupted, killed mid-run (restarted by torchrun), killed
inside an async save (no restart), resumed past that unfinished save and a corrupted checkpoint
(--async), and resharded 2 -> 3; formats.py on a good checkpoint (2 -> 1 process). It asserts
every result (bit-identical resumes, loaded == saved, equal round trips and logits, the async
host copy). One small kill + resume runs here too, against a run that never stopped, so that a
broken resume fails in tests/ as well."""
import json
import multiprocessing
import os
import queue
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

import distkit.ckpt as ckpt_module
from conftest import run_in_process, run_json, run_launcher, run_papermill
from distkit.ckpt import MANIFEST, CheckpointDir, ReadLog, read_manifest


@pytest.mark.parametrize("args, env, message", [
    (["--batch-size", "0"], {}, "need 1 <= --batch-size"),
    (["--samples", "8"], {"WORLD_SIZE": "2"}, "--samples >= 2"),
    (["--save-every", "0"], {}, "--save-every must be at least 1"),
    (["--keep", "1"], {}, "--keep must be at least 2"),
    (["--resume"], {}, "--resume without a folder needs --ckpt-dir"),
    (["--resume", "/no/such/checkpoint"], {}, "no checkpoint folder /no/such/checkpoint"),
])
def test_bad_input_one_line_error(monkeypatch, capsys, args, env, message):
    status, _, err = run_in_process(monkeypatch, capsys, "ch05_checkpoint/train_ckpt.py",
                                    *args, env=env)
    assert status == 2 and message in err.strip().splitlines()[-1]


def test_launcher_rejects_bad_max_restarts():
    proc = run_launcher(2, "ch05_checkpoint/train_ckpt.py", env={"MAX_RESTARTS": "two"},
                        timeout=10)
    assert proc.returncode == 2 and "MAX_RESTARTS must be a non-negative integer" in proc.stderr


SMALL = ["--samples", 128, "--batch-size", 4, "--epochs", 1, "--save-every", 5]


def test_a_killed_run_resumes_bit_identical_to_one_that_never_stopped(tmp_path):
    """One small launch pair: a run that never stops (and never saves), and one whose last rank
    is killed by SIGKILL after step 12 (MAX_RESTARTS=1), restarted by torchrun and resumed from
    step 10. Every loss, the sha256 of the whole final state (parameters and AdamW moments) and
    the random numbers drawn at every step must be equal, bit for bit: a resume that forgets
    the LR schedule, AdamW's state, the data position or the generators fails here, not only
    in the notebook."""
    ref, _ = run_json(tmp_path, 2, "ch05_checkpoint/train_ckpt.py", *SMALL)
    proc = run_launcher(2, "ch05_checkpoint/train_ckpt.py", *SMALL, "--ckpt-dir",
                        tmp_path / "ckpt", "--resume", "--json", tmp_path / "killed.json",
                        env={"MAX_RESTARTS": "1", "CRASH_AT": "step:12"}, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "rank 1: killed by SIGKILL at step 12" in proc.stdout
    killed = json.loads((tmp_path / "killed.json").read_text())
    assert killed["attempt"] == 1 and killed["resumed_from"] == 10
    assert len(ref["losses"]) == len(ref["draws"]) == 16
    assert killed["losses"] == ref["losses"], "losses differ after the resume"
    assert killed["draws"] == ref["draws"], "random draws differ: generators not restored?"
    assert killed["digest"] == ref["digest"], "final weights or AdamW state differ"


@pytest.mark.stress
@pytest.mark.parametrize("mode", [[], ["--async"]], ids=["sync", "async"])
def test_a_killed_rank_restarts_the_group_from_the_last_checkpoint(tmp_path, mode):
    """MAX_RESTARTS=1 CRASH_AT=step:12: the last rank dies by SIGKILL after step 12, its peer
    fails on the lost connection, torchrun restarts the group and attempt 1 resumes from step 10
    (with --async from step 5: step 10's upload is committed only at the next save). The
    notebook (nbval) runs the sync kill and an --async kill and resume once in `make test` with
    their bit-identity checks; `make stress` repeats these small ones under load."""
    proc = run_launcher(2, "ch05_checkpoint/train_ckpt.py", "--samples", 128, "--batch-size", 4,
                        "--epochs", 1, "--save-every", 5, "--ckpt-dir", tmp_path / "ckpt",
                        "--resume", "--json", tmp_path / "run.json", *mode,
                        env={"MAX_RESTARTS": "1", "CRASH_AT": "step:12"}, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "rank 1: killed by SIGKILL at step 12" in proc.stdout
    res = json.loads((tmp_path / "run.json").read_text())
    assert res["attempt"] == 1 and res["resumed_from"] == (5 if mode else 10)
    assert len(res["losses"]) == 16 and [s["step"] for s in res["saves"]][-1] == 15


def fake_save(ckpt: CheckpointDir, step: int) -> None:
    """What dcp.save leaves in the .tmp folder, then the commit."""
    tmp = ckpt.begin(step)
    tmp.mkdir()
    for name in (".metadata", "__0_0.distcp", "__1_0.distcp"):
        (tmp / name).write_bytes(bytes([step % 256]) * (100 + step % 256))
    ckpt.commit(step, world_size=2)


def test_commit_is_a_rename_with_a_manifest_and_keeps_the_last_k(tmp_path):
    ckpt = CheckpointDir(tmp_path, keep=2)
    for step in (5, 10, 15):
        fake_save(ckpt, step)
    assert [p.name for p in ckpt.committed()] == ["step_000010", "step_000015"]
    assert not list(tmp_path.glob("*.tmp"))
    manifest = read_manifest(ckpt.path(15))
    assert manifest["step"] == 15 and manifest["world_size"] == 2
    assert sorted(manifest["files"]) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert manifest["files"]["__1_0.distcp"]["bytes"] == 115
    assert ckpt.latest() == ckpt.path(15) and ckpt.log == []


def test_a_resume_from_an_older_step_sets_the_newer_ones_aside_at_once(tmp_path):
    """train_llama.py --resume-from 6 with checkpoints 6, 9, 12 (review R47, high): a job killed
    before its first commit was requeued onto step 12, the future it meant to leave. Now the
    newer ones are set aside as .old before anything is trained: the requeue's newest is 6,
    and the first commit removes them."""
    ckpt = CheckpointDir(tmp_path, keep=3)
    for step in (6, 9, 12):
        fake_save(ckpt, step)
    assert ckpt.set_aside_after(6) == ["step_000009", "step_000012"]
    assert ckpt.latest() == ckpt.path(6)  # what the killed job's requeue resumes from
    assert sorted(p.name for p in tmp_path.glob("*.old")) == ["step_000009.old",
                                                              "step_000012.old"]
    fake_save(ckpt, 9)  # the resumed run's first commit
    assert [p.name for p in ckpt.committed()] == ["step_000006", "step_000009"]
    assert not list(tmp_path.glob("*.old"))


@pytest.mark.parametrize("damage, reason", [
    (lambda p: (p / "__1_0.distcp").write_bytes(b"x" * 115), "does not match its sha256"),
    (lambda p: (p / "__1_0.distcp").write_bytes(b"x" * 7), "has 7 bytes, the manifest says 115"),
    (lambda p: (p / "__0_0.distcp").unlink(), "__0_0.distcp is missing"),
    (lambda p: (p / "stray.bin").write_bytes(b""), "stray.bin is not in the manifest"),
    (lambda p: (p / MANIFEST).unlink(), f"no readable {MANIFEST}"),
])
def test_latest_skips_a_damaged_checkpoint_and_removes_an_uncommitted_one(tmp_path, damage,
                                                                          reason):
    ckpt = CheckpointDir(tmp_path, keep=3)
    for step in (5, 10, 15):
        fake_save(ckpt, step)
    damage(ckpt.path(15))
    ckpt.begin(20).mkdir()  # a save that never committed
    (tmp_path / "step_000020.tmp" / "__0_0.distcp").write_bytes(b"partial")
    assert ckpt.latest() == ckpt.path(10)
    assert ckpt.log[0] == ("step_000020.tmp: never committed (no .metadata: dcp.save never "
                           "finished); removed")
    assert ckpt.log[1].startswith("step_000015: ") and reason in ckpt.log[1]
    assert not (tmp_path / "step_000020.tmp").exists()


def test_a_commit_removes_newer_checkpoints_of_an_abandoned_future(tmp_path):
    """A run resumed from step 5 (or started afresh) in a folder that holds steps 15 and 20:
    keep-last-K must not keep those and delete the step it has just committed."""
    ckpt = CheckpointDir(tmp_path, keep=2)
    for step in (15, 20):
        fake_save(ckpt, step)
    fake_save(ckpt, 5)
    assert [p.name for p in ckpt.committed()] == ["step_000005"]
    assert ckpt.log == ["step_000015: newer than this run's step 5; removed",
                        "step_000020: newer than this run's step 5; removed"]
    assert not list(tmp_path.glob("*.old")) and ckpt.latest() == ckpt.path(5)


def test_a_whole_tmp_folder_is_committed_not_removed(tmp_path):
    """A crash between the manifest and the rename leaves a checked .tmp: it is committed."""
    ckpt = CheckpointDir(tmp_path, keep=2)
    fake_save(ckpt, 5)
    fake_save(ckpt, 10)
    ckpt.path(10).rename(ckpt.path(10).with_suffix(".tmp"))
    assert ckpt.latest() == ckpt.path(10)
    assert ckpt.log == ["step_000010.tmp: written whole but not renamed; committed now"]


def test_steps_are_compared_as_numbers_past_999999(tmp_path):
    """As strings "step_1000000" < "step_999999": keep-last-K would delete the newest."""
    ckpt = CheckpointDir(tmp_path, keep=2)
    for step in (999_998, 999_999, 1_000_000):
        fake_save(ckpt, step)
    assert [p.name for p in ckpt.committed()] == ["step_999999", "step_1000000"]
    assert ckpt.log == [] and ckpt.latest() == ckpt.path(1_000_000)


def on_two_ranks(tmp_path, scenario, timeout=150) -> list:
    """scenario(rank) in 2 forked processes joined by a gloo group (60 s collective timeout);
    each rank's return value, or the test fails when a rank errs or does not finish."""
    ctx = multiprocessing.get_context("fork")
    results = ctx.Queue()

    def rank_main(rank):
        try:
            dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}",
                                    rank=rank, world_size=2, timeout=timedelta(seconds=60))
            results.put((rank, scenario(rank)))
            dist.barrier()
        except BaseException as e:  # noqa: BLE001 (reported to the parent)
            results.put((rank, f"rank {rank} failed: {e!r}"))
        finally:
            # put() hands the value to a feeder thread: wait until it is in the pipe, or
            # os._exit may drop it (seen once under load: the parent then waited 150 s)
            results.close()
            results.join_thread()
            os._exit(0)

    procs = [ctx.Process(target=rank_main, args=(r,)) for r in range(2)]
    for p in procs:
        p.start()
    got = {}
    try:
        for _ in procs:
            rank, value = results.get(timeout=timeout)
            got[rank] = value
    except queue.Empty:
        pytest.fail(f"a rank did not finish in {timeout} s (hung in a collective?): {got}")
    finally:
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
    assert not any(isinstance(v, str) and " failed: " in v for v in got.values()), got
    return [got[0], got[1]]


def stale_on_rank1(monkeypatch, rank, listing):
    """Rank 1 sees the folders as `listing(folder, names)` says (a stale cache), rank 0 as they
    are."""
    if rank == 1:
        real = ckpt_module._listing
        monkeypatch.setattr(ckpt_module, "_listing", lambda folder: listing(folder, real(folder)))


def test_ranks_that_see_different_listings_agree(tmp_path, monkeypatch):
    """Rank 1 sees neither step_000015 nor the uncommitted .tmp, and a stray file in every
    checkpoint: only rank 0's listing counts, both ranks choose step_000015 and nobody hangs
    (with every rank listing for itself, rank 1 skipped a collective that rank 0 waited in)."""
    ckpt = CheckpointDir(tmp_path / "ckpt", keep=3)
    for step in (5, 10, 15):
        fake_save(ckpt, step)
    ckpt.begin(20).mkdir()

    def scenario(rank):
        stale_on_rank1(monkeypatch, rank, lambda folder, names: (
            [n for n in names if n not in ("step_000015", "step_000020.tmp")]
            if folder == ckpt.root else [*names, "stray.bin"]))
        here = CheckpointDir(ckpt.root, keep=3)
        return here.latest().name, here.log

    assert on_two_ranks(tmp_path, scenario) == [("step_000015", [
        "step_000020.tmp: never committed (no .metadata: dcp.save never finished); removed"]),
        ("step_000015", [])]


def test_a_file_one_rank_cannot_read_fails_on_every_rank(tmp_path, monkeypatch):
    """Rank 1 cannot read the file it wrote in step_000015 (a transient error): both ranks skip
    that checkpoint with the same reason and choose step_000010. Each rank reads back only the
    files it wrote: its hash of __1_0.distcp is rank 1's."""
    ckpt = CheckpointDir(tmp_path / "ckpt", keep=3)
    for step in (5, 10, 15):
        fake_save(ckpt, step)
    real_sha = ckpt_module._sha256

    def scenario(rank):
        def sha(path):
            assert ckpt_module._writer_of(path.name, 2) == rank  # only files it wrote
            if rank == 1 and path.parent.name == "step_000015":
                raise OSError(5, "Input/output error")
            return real_sha(path)
        monkeypatch.setattr(ckpt_module, "_sha256", sha)
        here = CheckpointDir(ckpt.root, keep=3)
        return here.latest().name, here.log

    reason = ("step_000015: __1_0.distcp is unreadable on rank 1 (Input/output error); "
              "skipped")
    assert on_two_ranks(tmp_path, scenario) == [("step_000010", [reason])] * 2


def test_a_commit_uses_rank0s_listing(tmp_path, monkeypatch):
    """Rank 1's stale listing misses a shard: the manifest still holds every file."""
    root = tmp_path / "ckpt"

    def scenario(rank):
        stale_on_rank1(monkeypatch, rank, lambda folder, names: [n for n in names
                                                                  if n != "__0_0.distcp"])
        here = CheckpointDir(root, keep=2)
        tmp = here.begin(5)
        if rank == 0:
            tmp.mkdir()
        dist.barrier()
        (tmp / f"__{rank}_0.distcp").write_bytes(b"x" * (10 + rank))  # each rank its shard
        dist.barrier()
        if rank == 0:
            (tmp / ".metadata").write_bytes(b"m")
        dist.barrier()
        return sorted(read_manifest(here.commit(5, world_size=2))["files"])

    assert on_two_ranks(tmp_path, scenario) == [[".metadata", "__0_0.distcp",
                                                 "__1_0.distcp"]] * 2


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # one process, on purpose
def test_read_log_names_the_rows_and_the_file_each_piece_is_read_from(tmp_path):
    """What a load reads is the planner's choice (.metadata says only what was saved): a
    128-row tensor saved as two row shards by 2 ranks, loaded whole by one process, is read as
    rows 0-63 from rank 0's file and rows 64-127 from rank 1's; a key no tensor ends in reads
    nothing, and says so."""
    rows = torch.arange(128 * 4, dtype=torch.float32).view(128, 4)

    def scenario(rank):
        mesh = init_device_mesh("cpu", (2,))
        dcp.save({"model": {"embed.weight": distribute_tensor(rows, mesh, [Shard(0)])}},
                 checkpoint_id=tmp_path / "ckpt")
        return rank

    on_two_ranks(tmp_path, scenario)
    whole = {"model": {"embed.weight": torch.zeros(128, 4)}}
    log = ReadLog("embed.weight")
    dcp.load(whole, checkpoint_id=tmp_path / "ckpt", planner=log, no_dist=True)
    assert torch.equal(whole["model"]["embed.weight"], rows)
    assert log.report() == ["rank 0: rows 0-63 from __0_0.distcp, rows 64-127 from __1_0.distcp"]
    typo = ReadLog("embed.weights")
    dcp.load({"model": {"embed.weight": torch.zeros(128, 4)}}, checkpoint_id=tmp_path / "ckpt",
             planner=typo, no_dist=True)
    assert typo.report() == []


def test_latest_of_an_empty_or_missing_folder_is_none(tmp_path):
    assert CheckpointDir(tmp_path / "nothing").latest() is None
    assert CheckpointDir(tmp_path / "nothing").resume_point("x.py") is None  # a fresh start


def test_a_resume_with_no_usable_checkpoint_refuses_and_changes_nothing(tmp_path):
    """faults.md 5b (HIGH): a shard truncated in every checkpoint. latest() skips them all and
    says None, which a --resume read as "start from step 0" (the metrics deleted, the
    checkpoints overwritten at the next commits). resume_point() stops instead, in one line
    naming each checkpoint and why, and leaves every file as it was."""
    ckpt = CheckpointDir(tmp_path, keep=2)
    for step in (5, 10):
        fake_save(ckpt, step)
        (ckpt.path(step) / "__1_0.distcp").write_bytes(b"x" * 7)
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    with pytest.raises(SystemExit) as stop:
        ckpt.resume_point("train_ckpt.py")
    assert str(stop.value) == (
        f"train_ckpt.py: --resume: 2 checkpoint(s) in {tmp_path}, none usable (step_000010: "
        "__1_0.distcp has 7 bytes, the manifest says 110; step_000005: __1_0.distcp has 7 "
        "bytes, the manifest says 105); nothing changed: restore a checkpoint's files, or "
        "start over in another folder")
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before


def test_latest_prunes_what_a_kill_before_the_pruning_left(tmp_path, monkeypatch):
    """faults.md item 1 (LOW): rank 0 killed in commit() after the rename, before keep-last-K
    pruned, left keep + 1 checkpoints, and a resumed run at its last step commits nothing more.
    Planted: the pruning's rmtree 'kills' the process; then latest() prunes."""
    ckpt = CheckpointDir(tmp_path, keep=2)
    fake_save(ckpt, 5)
    fake_save(ckpt, 10)

    rmtree = ckpt_module.shutil.rmtree

    def killed(path, *args, **kwargs):  # begin()'s clean-up of a .tmp passes, the pruning dies
        if not kwargs.get("ignore_errors"):
            raise KeyboardInterrupt("killed between the rename and the pruning")
        rmtree(path, *args, **kwargs)
    monkeypatch.setattr(ckpt_module.shutil, "rmtree", killed)
    with pytest.raises(KeyboardInterrupt):
        fake_save(ckpt, 15)
    monkeypatch.undo()
    assert [p.name for p in ckpt.committed()] == ["step_000005", "step_000010", "step_000015"]
    assert ckpt.latest() == ckpt.path(15)
    assert [p.name for p in ckpt.committed()] == ["step_000010", "step_000015"]
    assert ckpt.log == ["step_000005: more than keep=2; removed"]


def test_resume_of_a_damaged_folder_given_by_path_is_one_line(monkeypatch, capsys, tmp_path):
    """faults.md 5f: train_ckpt.py --resume PATH checks that checkpoint's files first (as
    latest() does), instead of failing inside dcp.load with six tracebacks."""
    ckpt = CheckpointDir(tmp_path, keep=2)
    fake_save(ckpt, 5)
    (ckpt.path(5) / "__1_0.distcp").write_bytes(b"x" * 7)
    status, _, err = run_in_process(monkeypatch, capsys, "ch05_checkpoint/train_ckpt.py",
                                    "--resume", ckpt.path(5))
    assert status == 2 and err.strip().splitlines()[-1].endswith(
        f"--resume {ckpt.path(5)}: __1_0.distcp has 7 bytes, the manifest says 105")


@pytest.mark.parametrize("damage, message", [
    ("missing", "--checkpoint: no folder"),
    ("metadata", "not a DCP checkpoint (no .metadata file)"),
    ("manifest", "not a committed checkpoint (no readable manifest.json)"),
    ("shard", "not a committed checkpoint (__0_0.distcp does not match its sha256"),
])
def test_formats_refuses_a_checkpoint_it_cannot_trust(monkeypatch, capsys, tmp_path, damage,
                                                      message):
    """formats.py checks its --checkpoint before loading anything (the notebook runs it on a
    good one and asserts every result)."""
    ckpt = CheckpointDir(tmp_path, keep=2)
    fake_save(ckpt, 10)
    bad = ckpt.path(10)
    if damage == "missing":
        bad = tmp_path / "nope"
    elif damage == "shard":  # same size, one byte flipped: only the checksum sees it
        data = bytearray((bad / "__0_0.distcp").read_bytes())
        data[-1] ^= 1
        (bad / "__0_0.distcp").write_bytes(bytes(data))
    else:
        (bad / {"metadata": ".metadata", "manifest": MANIFEST}[damage]).unlink()
    status, _, err = run_in_process(monkeypatch, capsys, "ch05_checkpoint/formats.py",
                                    "--checkpoint", bad)
    assert status == 2 and message in err.strip().splitlines()[-1]


@pytest.mark.second_nproc
def test_notebook_at_three_processes(tmp_path):
    """The chapter at N = 3 (a global batch of 36 = 3 x 12): the same bit-identical resumes."""
    text = run_papermill(tmp_path, "05_distributed_checkpoint.ipynb", "-p", "NPROC", "3")
    assert "final loss, weights and random streams bit-identical to the uninterrupted run: True" \
        in text

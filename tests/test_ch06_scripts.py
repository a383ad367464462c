"""Chapter 06's recipe beyond what the notebook runs: bad input of train_llama.py and corpus.py
(in this process, before any process group), the data cache and its formats (corpus.py), a
compiled run resumed from a checkpoint at its last step, a fine-tune of its export with the
cluster options that a NaN stops, and the faults a cluster brings, injected from outside the
script (a wrapper runs it unchanged, as the 2026-11 review did): a SIGTERM during start-up, a
rank SIGKILLed between saves, a bad update at a save step, the corpus staged elsewhere. The
notebook (nbval) runs the recipe for real on 2 processes, on 1 process preempted by SIGTERM,
and resumed on two rehearsal "nodes". Every option in --help is passed by some run here, in the
notebook or in tests/test_ch06_recipe.py (test_every_option_runs): each launch costs ~10 CPU-s
of imports, so the few launches pass many options at once, and each asserts what its options
did (run.json: the FSDP settings in effect, one step's collectives and norms)."""
import ast
import json
import math
import re
import shutil
import sys
from pathlib import Path

import nbformat
import numpy as np
import pytest
import torch

from conftest import CODE, ROOT, run_in_process, run_launcher, run_ok, run_papermill
from distkit.ckpt import CheckpointDir

sys.path.insert(0, str(CODE / "ch06_capstone"))
import corpus  # noqa: E402

SCRIPT = "ch06_capstone/train_llama.py"
NOTEBOOK = "06_capstone_llama_fsdp2.ipynb"


BAD_INPUT = [
    (["--batch-size", "0"], {}, "--batch-size, --micro-batch, --eval-every, --log-every and"),
    (["--replicate", "2"], {"WORLD_SIZE": "3"}, "--replicate 2 must divide the 3 ranks"),
    (["--compile", "--ac", "full"], {}, "--compile with --ac: not combined"),
    (["--batch-size", "24"], {"WORLD_SIZE": "2"},
     "must be a multiple of 2 ranks x --micro-batch 8"),
    (["--vocab-size", "100"], {}, "--vocab-size must be >= 257"),
    (["--min-lr", "0.1"], {}, "need 0 <= --min-lr <= --lr"),
    (["--keep", "1"], {}, "--keep >= 2"),
    (["--data", "/no/such.txt"], {}, "--data: no such file /no/such.txt"),
    (["--text", "/no/such.txt"], {}, "--data: no such file /no/such.txt"),  # the older name
    (["--model-path", "/no/such/model"], {}, "--model-path: no config.json in /no/such/model"),
    (["--eval-sequences", "0"], {}, "--eval-sequences must be >= 1"),
    (["--max-steps", "10"], {}, "--warmup must be less than --max-steps 10"),
    (["--cpu-offload"], {"COURSE_DEVICE": "cpu"}, "--cpu-offload needs a GPU"),
    (["--preset", "llama-70b"], {}, "invalid choice: 'llama-70b'"),
    (["--profile-step", "0"], {}, "--profile-step must be >= 1"),
    (["--resume", "--overwrite"], {}, "--resume continues OUT's run, --overwrite deletes it"),
    (["--change-schedule"], {}, "--change-schedule changes a resumed run's schedule: it needs"),
    (["--spike-factor", "0.5"], {}, "--spike-factor must be 0 (off) or more than 1"),
]


@pytest.mark.parametrize("args, env, message", BAD_INPUT)
def test_bad_input_one_line_error(monkeypatch, capsys, tmp_path, args, env, message):
    status, _, err = run_in_process(monkeypatch, capsys, SCRIPT, "--out", tmp_path / "o", *args,
                                    env=env)
    assert status == 2 and message in err.strip().splitlines()[-1]


def test_options_avoid_argparse_traps():
    """Every option of train_llama.py with a float default has type=float (a float default is
    never converted: type=int would fail the day someone passes --lr 3e-4), and none has
    type=bool (bool("False") is True): on/off options are store_true flags."""
    options = {}
    for call in ast.walk(ast.parse((CODE / SCRIPT).read_text())):
        if isinstance(call, ast.Call) and getattr(call.func, "attr", "") == "add_argument":
            kw = {k.arg: k.value for k in call.keywords}
            default = ast.literal_eval(kw["default"]) if "default" in kw else None
            options[call.args[0].value] = (getattr(kw.get("type"), "id", None), default,
                                           getattr(kw.get("action"), "value", None))
    floats = [name for name, (_, default, _) in options.items()  # --betas: a tuple of floats
              if any(isinstance(v, float) for v in (default if isinstance(default, tuple)
                                                    else [default]))]
    assert len(options) > 35 and {"--lr", "--min-lr", "--clip", "--betas"} <= set(floats)
    assert [n for n in floats if options[n][0] != "float"] == []
    assert [n for n, (t, _, _) in options.items() if t == "bool"] == []
    assert {n for n, (_, _, a) in options.items() if a == "store_true"} >= {
        "--resume", "--overwrite", "--async-save", "--sync-every-microbatch"}


def test_tensorboard_is_optional(monkeypatch, capsys, tmp_path):
    """--tensorboard without the package: one line that says what to install."""
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # as if not installed
    status, _, err = run_in_process(monkeypatch, capsys, SCRIPT, "--tensorboard", "--out",
                                    tmp_path)
    assert status == 2 and "pip install tensorboard" in err.strip().splitlines()[-1]


def test_refuses_to_start_over_a_previous_run(monkeypatch, capsys, tmp_path):
    """F10: without --resume, a run into an --out that holds a previous run's metrics or
    checkpoints would delete them (the metrics at once, the checkpoints at its first save):
    it refuses, in one line; --resume or --overwrite (said out loud) pass."""
    (tmp_path / "checkpoints" / "step_000004").mkdir(parents=True)
    (tmp_path / "checkpoints" / "step_000006.tmp").mkdir()  # not committed: not counted
    (tmp_path / "metrics.jsonl").write_text("{}\n")
    status, _, err = run_in_process(monkeypatch, capsys, SCRIPT, "--out", tmp_path)
    assert status == 2 and err.strip().splitlines()[-1].endswith(
        f"--out {tmp_path} holds a previous run (metrics.jsonl, 1 checkpoint(s), the newest of "
        "step 4): --resume continues it, --overwrite starts over and deletes it, or choose "
        "another --out")
    for flag in ("--resume", "--overwrite"):  # past the checks: setup() wants torchrun
        status, _, _ = run_in_process(monkeypatch, capsys, SCRIPT, "--out", tmp_path, flag)
        assert "not started by torchrun" in str(status)
    assert (tmp_path / "metrics.jsonl").exists()  # nothing deleted by the checks


@pytest.mark.parametrize("files, message", [
    ({"notes.txt": "mine"}, "holds files no run of train_llama.py writes (notes.txt)"),
    ({"run.json": '{"model": "mine"}', "hf": None},
     "holds files no run of train_llama.py writes (run.json (not one this script wrote))"),
])
def test_a_folder_that_is_not_a_run_is_refused(monkeypatch, capsys, tmp_path, files, message):
    """faults.md 4b: a non-empty --out that holds what no run of this script writes (or a
    run.json that is not one of ours) is refused, with --overwrite too (which deleted an
    hf/ and a profile/ it had not written); an empty one is accepted."""
    for name, text in files.items():
        (tmp_path / name).write_text(text) if text else (tmp_path / name).mkdir()
    for extra in ([], ["--overwrite"]):
        status, _, err = run_in_process(monkeypatch, capsys, SCRIPT, "--out", tmp_path, *extra)
        assert status == 2 and message in err.strip().splitlines()[-1]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(files)  # nothing touched
    (tmp_path / "empty").mkdir()
    status, _, _ = run_in_process(monkeypatch, capsys, SCRIPT, "--out", tmp_path / "empty")
    assert "not started by torchrun" in str(status)  # past the checks
    ours = tmp_path / "ours"  # what a run and train_llama.sbatch leave: a run of ours
    for name in ("checkpoints", "hf", "profile", "tensorboard"):
        (ours / name).mkdir(parents=True)
    for name in ("metrics.jsonl", "stopped.json", "failed.json", "requeue_failures", ".lock"):
        (ours / name).write_text("1\n")
    (ours / "run.json").write_text('{"world_size": 2, "fsdp": {}}')
    status, _, _ = run_in_process(monkeypatch, capsys, SCRIPT, "--out", ours, "--resume")
    assert "not started by torchrun" in str(status)


def test_a_read_only_out_is_one_line(monkeypatch, capsys, tmp_path):
    """faults.md 4c: a read-only --out fails in parse_args (one line), not in 2 tracebacks.
    (Tests run as root, whom no permission stops: the file system's answer is planted.)"""
    import os
    monkeypatch.setattr(os, "access", lambda path, mode: mode != os.W_OK)
    status, _, err = run_in_process(monkeypatch, capsys, SCRIPT, "--out", tmp_path / "o")
    assert status == 2 and err.strip().splitlines()[-1].endswith(
        f"--out {tmp_path / 'o'}: {tmp_path} is not writable (a read-only file system, or its "
        "permissions)")


def test_one_run_per_folder(monkeypatch, capsys, tmp_path):
    """faults.md 4e: two launches into one --out at the same moment both ran. Global rank 0 now
    locks OUT/.lock (flock) before anything is written: while a run holds it, a second one is
    refused in one line naming the holder; the lock of a run that died (a .lock file left, its
    flock gone with the process) is no lock."""
    import fcntl
    held = open(tmp_path / ".lock", "w")  # a first run, holding it, as guard.lock() leaves it
    fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
    held.write("host node7, pid 4242, since 2026-11-29 05:00:00\n")
    held.flush()
    status, _, err = run_in_process(monkeypatch, capsys, SCRIPT, "--out", tmp_path)
    assert status == 2 and re.fullmatch(
        rf"train_llama.py: --out {tmp_path} is in use by another run \(host node7, pid 4242, "
        r"since 2026-11-29 05:00:00\): wait for it to end, or choose another --out",
        err.strip().splitlines()[-1]), err
    held.close()  # the first run ends (or dies: the kernel drops its flock alike)
    assert (tmp_path / ".lock").exists()  # a stale file, no lock
    status, _, _ = run_in_process(monkeypatch, capsys, SCRIPT, "--out", tmp_path)
    assert "not started by torchrun" in str(status)  # past the lock


def test_a_full_disk_is_one_line(tmp_path, monkeypatch):
    """faults.md 4d: a full disk during a synchronous dcp.save surfaced as "unexpected pos 704
    vs 598" (a zip writer's error, 6 tracebacks); async saves as an ENOSPC OSError. Both are
    now one line naming the folder and the free space; another failure is not taken for it."""
    import errno
    import shutil as shutil_module
    sys.path.insert(0, str(CODE / "ch06_capstone"))
    import guard
    from torch.distributed.checkpoint.api import CheckpointException
    folder = tmp_path / "checkpoints" / "step_000009.tmp"
    folder.mkdir(parents=True)
    zip_error = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 "
                             "vs 598")
    enospc = CheckpointException("save failed", {1: (OSError(errno.ENOSPC, "No space left on "
                                                               "device"), None)})
    usage = shutil_module.disk_usage(tmp_path)
    monkeypatch.setattr(guard.shutil, "disk_usage", lambda p: usage._replace(free=3 << 20))
    for error in (zip_error, enospc):
        assert guard.save_failure(folder, error) == (
            f"No space left on device: writing step_000009.tmp in {folder.parent} failed (3 MiB "
            "free there); nothing was committed")
    monkeypatch.setattr(guard.shutil, "disk_usage", lambda p: usage._replace(free=50 << 30))
    assert guard.save_failure(folder, zip_error) is None  # space enough: another failure
    assert guard.save_failure(folder, enospc) is not None  # ENOSPC said: believed
    # a read-only or forbidden folder says so, whatever the free space (review R47: a read-only
    # mount with 1 MiB free was called full; with space, 6 tracebacks and a requeue)
    erofs = CheckpointException("save failed", {0: (OSError(errno.EROFS, "Read-only file "
                                                               "system"), None)})
    for free in (1 << 20, 50 << 30):
        monkeypatch.setattr(guard.shutil, "disk_usage", lambda p: usage._replace(free=free))
        assert guard.save_failure(folder, erofs) == (
            f"Cannot write checkpoints: writing step_000009.tmp in {folder.parent} failed "
            "(Read-only file system); nothing was committed")


@pytest.mark.parametrize("line, message", [
    ('{"text": "unterminated\n', "corpus.jsonl:31: not a JSON record (Invalid control "
     "character, column 23)"),
    ('{"body": "no text field"}\n', "corpus.jsonl:31: no text field 'text' in this record "
     "(--text-field)"),
])
def test_a_bad_jsonl_record_is_file_and_line(tmp_path, line, message):
    """faults.md 5e: a bad record past the first (record 31: the check of --data reads only the
    first) is one line, FILE:LINE: what, from rank 0's tokenization; its temporary folder is
    removed."""
    lines = [json.dumps({"text": f"record {i} " * 20}) + "\n" for i in range(40)]
    lines[30] = line
    (tmp_path / "corpus.jsonl").write_text("".join(lines))
    with pytest.raises(SystemExit) as stop:
        corpus.prepare(tmp_path / "data", 300, paths=[tmp_path / "corpus.jsonl"])
    assert str(stop.value) == f"{tmp_path}/{message}"
    assert list((tmp_path / "data").iterdir()) == []  # no .tmp-HOST-PID folder left


def test_a_jsonl_with_a_byte_order_mark_reads_as_without(tmp_path):
    """Review R47 #8: a JSON Lines file saved with a UTF-8 byte-order mark (as Windows tools
    write it) was refused ("Unexpected UTF-8 BOM"), twice, with argparse's usage: it reads as
    the same records."""
    text = "".join(json.dumps({"text": f"record {i}"}) + "\n" for i in range(3))
    (tmp_path / "bom.jsonl").write_bytes(b"\xef\xbb\xbf" + text.encode())
    assert corpus.check([tmp_path / "bom.jsonl"]) is None
    assert list(corpus.records(tmp_path / "bom.jsonl", "text")) == [
        "record 0", "record 1", "record 2"]


def test_a_rank_waiting_for_data_leaves_on_a_signal(tmp_path):
    """faults.md 5e: while rank 0 tokenizes, the others poll for its index.json; when rank 0
    fails, torchrun's SIGTERM (the handler raises a flag) makes them leave at once, not after
    the grace period (30 s; 240 s under the sbatch)."""
    import time
    t0 = time.monotonic()
    with pytest.raises(SystemExit, match="rank 1: stopped by a signal while waiting for rank "
                                         "0's token cache"):
        corpus.prepare_on_ranks(1, tmp_path, 300, stopped=lambda: True)
    assert time.monotonic() - t0 < 1


@pytest.mark.parametrize("name, content, message", [
    ("e.jsonl", "\n", "e.jsonl: no records (an empty file)"),
    ("e.txt", "", "e.txt: an empty file"),
    ("a.jsonl", '{"body": "x"}\n', "a.jsonl: its first record has no field 'text' (--text-field)"),
    ("b.parquet", "PAR1", "b.parquet: reading parquet needs the pyarrow package"),
    ("c", None, "c: a folder, but not one that datasets' save_to_disk wrote"),
    ("d", "dataset_info.json", "d: reading dataset needs the datasets package"),
])
def test_data_formats_refused_in_one_line(monkeypatch, capsys, tmp_path, name, content,
                                          message):
    """--data: a record without the field, or a format whose optional library is missing
    (pyarrow, datasets: not course dependencies), is one line that says what to do."""
    for module in ("pyarrow", "pyarrow.parquet", "datasets"):
        monkeypatch.setitem(sys.modules, module, None)  # as if not installed
    path = tmp_path / name
    if content is None or content.endswith(".json"):
        path.mkdir()
        if content:
            (path / content).write_text("{}")
    else:
        path.write_text(content)
    status, _, err = run_in_process(monkeypatch, capsys, SCRIPT, "--data", path, "--out",
                                    tmp_path / "o")
    assert status == 2 and f"--data: {tmp_path}/{message}" in err.strip().splitlines()[-1]


def test_corpus_cache(tmp_path, monkeypatch, capsys):
    """The token files: flat uint16 ids that load() maps as (sequences, seq_len) views, a cheap
    cache key, the unigram baseline, and a held-out split made before the BPE was trained."""
    folder = corpus.prepare(tmp_path, vocab_size=300)
    facts = corpus.facts(folder)
    train, heldout = corpus.load(folder, 64)
    assert facts["vocab_size"] == 300 and facts["dtype"] == "uint16" == str(train.dtype)[6:]
    assert train.shape == (facts["train_tokens"] // 64, 64)
    assert (folder / "train.bin").stat().st_size == 2 * facts["train_tokens"]  # 2 bytes a token
    assert corpus.load(folder, 32)[0].shape == (facts["train_tokens"] // 32, 32)  # same file
    assert corpus.prepare(tmp_path, vocab_size=300) == folder  # cached: same key
    assert corpus.cache_key(None, 301, None) != corpus.cache_key(None, 300, None)
    held = sum(len(piece) for _, piece in corpus.split_pieces(held=True))
    assert 0.03 < held / facts["characters"] < 0.07  # every 20th piece: about 5% of the text
    # the unigram baseline is the held-out cross-entropy of add-one-smoothed training frequencies
    ids = np.fromfile(folder / "train.bin", dtype=np.uint16)
    counts = torch.bincount(torch.from_numpy(ids.astype(np.int64)), minlength=300).double() + 1
    expected = -(counts / counts.sum()).log()[heldout[:, 1:].flatten().long()].mean()
    assert corpus.unigram_loss(folder, heldout) == pytest.approx(expected.item())
    # --data, a text file: one piece per 1 KB line here; piece 19 (held out) has a word no other
    # piece has, and the BPE, trained before on the other pieces only, has no token for it
    lines = ["the cat sat on the mat. " * 43 + "\n"] * 40
    lines[19] = "zyzzyva " * 130 + "\n"
    (tmp_path / "a.txt").write_text("".join(lines))
    mine = corpus.prepare(tmp_path, vocab_size=300, paths=[tmp_path / "a.txt"])
    tok, (train, heldout) = corpus.tokenizer(mine), corpus.load(mine, 32)
    assert mine.name.startswith("text-")
    assert "cat sat on the mat" in tok.decode(train[0].tolist())
    assert "zyzzyva" in tok.decode(heldout[0].tolist())
    assert not [t for t in tok.get_vocab() if "zz" in t or "yv" in t]
    # F11: the same file staged elsewhere (another folder, a new mtime) has the same key ...
    (tmp_path / "scratch").mkdir()
    shutil.copy(tmp_path / "a.txt", tmp_path / "scratch" / "a.txt")
    assert corpus.cache_key([tmp_path / "scratch" / "a.txt"], 300, None) == mine.name[5:]
    # ... a changed one, another
    (tmp_path / "a.txt").write_text("".join(lines[:30]))
    assert corpus.cache_key([tmp_path / "a.txt"], 300, None) != mine.name[5:]
    status, _, err = run_in_process(monkeypatch, capsys, "ch06_capstone/corpus.py",
                                    "--vocab-size", "10")
    assert status == 2 and "--vocab-size >= 257" in err


def write_jsonl(path, field="text", records=400):
    """Python's reference docs as JSON Lines, a paragraph per record (~0.4 MB): a corpus of many
    short documents, as a team's data usually is."""
    from pydoc_data.topics import topics
    paragraphs = [p for name in sorted(topics) for p in topics[name].split("\n\n") if p.strip()]
    path.write_text("".join(json.dumps({field: p, "id": i}) + "\n"
                            for i, p in enumerate(paragraphs[:records])))
    return paragraphs[:records]


def test_jsonl_records_held_out_whole(tmp_path):
    """F9 for record formats: every 20th record is held out whole (its pieces too), so the
    held-out loss is measured on documents the model never saw a part of. Text files: by piece."""
    paragraphs = write_jsonl(tmp_path / "d.jsonl", field="body")
    (tmp_path / "e.txt").write_text("a\n" * 15000)  # a text file: 29 pieces of ~1 KB
    paths = [tmp_path / "d.jsonl", tmp_path / "e.txt"]
    held = list(corpus.split_pieces(paths, held=True, field="body"))
    train = list(corpus.split_pieces(paths, field="body"))
    docs = {d for d, _ in held}
    whole = [paragraphs[d] for d in sorted(docs) if d < len(paragraphs)]
    assert whole == paragraphs[19::20]  # records 19, 39, ...: each held out whole
    assert not docs & {d for d, _ in train if d < len(paragraphs)}
    text_doc = len(paragraphs)  # the text file is a document of both sides, piece by piece
    assert text_doc in docs and text_doc in {d for d, _ in train}
    folder = corpus.prepare(tmp_path / "cache", 300, paths=paths, field="body")
    facts = corpus.facts(folder)
    assert facts["documents"] == len(paragraphs) + 1
    assert corpus.load(folder, 32)[1].shape[0] > 0


def test_parquet_and_saved_datasets_when_installed(tmp_path):
    """With pyarrow and datasets installed (optional, not course dependencies: skipped where
    absent; `make test-torch`'s venv can have them), a Parquet file, a folder saved by datasets
    and one saved as a DatasetDict give the documents of the JSON Lines they were written from,
    and the same tokens."""
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    paragraphs = write_jsonl(tmp_path / "d.jsonl")

    def docs(path):
        return [doc for _, doc, _ in corpus.documents([path])]
    pq.write_table(pa.table({"text": paragraphs, "n": list(range(len(paragraphs)))}),
                   tmp_path / "d.parquet")
    assert docs(tmp_path / "d.parquet") == docs(tmp_path / "d.jsonl") == paragraphs
    assert corpus.check([tmp_path / "d.parquet"], "body") == \
        f"{tmp_path}/d.parquet: no column 'body' (--text-field)"
    same = [corpus.prepare(tmp_path / "cache", 300, paths=[tmp_path / name])
            for name in ("d.jsonl", "d.parquet")]
    assert len(set(same)) == 2  # two caches, of the same tokens
    assert (same[0] / "train.bin").read_bytes() == (same[1] / "train.bin").read_bytes()
    datasets = pytest.importorskip("datasets")
    data = datasets.Dataset.from_dict({"text": paragraphs})
    data.save_to_disk(str(tmp_path / "saved"))
    datasets.DatasetDict({"train": data}).save_to_disk(str(tmp_path / "dict"))
    for name in ("saved", "dict"):
        assert corpus.check([tmp_path / name]) is None
        assert docs(tmp_path / name) == paragraphs


def test_token_cache_built_once_per_job(tmp_path, monkeypatch):
    """F6: only global rank 0 builds the cache, not the first rank of every node (N nodes would
    tokenize the corpus N times over, on the shared file system); the others wait for its
    index.json, without a collective that a long tokenization could time out."""
    import torch.distributed as dist
    folder = corpus.prepare(tmp_path, 300)  # (what rank 0 left, here built beforehand)
    built = []
    monkeypatch.setattr(corpus, "prepare", lambda *a, **k: built.append(a) or folder)
    monkeypatch.setattr(dist, "barrier", lambda: None)
    # global rank 8: LOCAL_RANK 0 of the second node of 8 GPUs
    assert corpus.prepare_on_ranks(8, tmp_path, 300) == folder and built == []
    assert corpus.prepare_on_ranks(0, tmp_path, 300) == folder and len(built) == 1


def test_a_cache_built_with_the_models_tokenizer_is_the_jobs(tmp_path, monkeypatch, capsys):
    """Issue 43 item 5: corpus.py --model-path DIR tokenizes with the model's own tokenizer, and
    the job (train_llama.py --model-path, spelled another way, any --vocab-size) finds that
    cache: its rank 0 does not tokenize again (planted: a key on the path's spelling or on
    --vocab-size fails)."""
    import runpy
    from transformers import AutoTokenizer
    corpus.hf_tokenizer(corpus.train_tokenizer(None, 300)).save_pretrained(tmp_path / "model")
    (tmp_path / "mine.txt").write_text(("the cat sat on the mat. " * 43 + "\n") * 20)
    monkeypatch.setattr(sys, "argv", ["corpus.py", *map(str, [
        "--data-dir", tmp_path / "data", "--data", tmp_path / "mine.txt", "--model-path",
        tmp_path / "model", "--vocab-size", "1000"])])
    runpy.run_path(str(CODE / "ch06_capstone" / "corpus.py"), run_name="__main__")
    built = Path(capsys.readouterr().out.splitlines()[0])
    assert (built / "index.json").exists() and corpus.facts(built)["vocab_size"] == 300
    monkeypatch.setattr(corpus, "_build", lambda *a: pytest.fail("rank 0 tokenized again"))
    job = AutoTokenizer.from_pretrained(f"{tmp_path}/./model/")  # as train_llama.py loads it
    assert corpus.prepare(tmp_path / "data", 2048, tokenizer=job,
                          paths=[str(tmp_path / "mine.txt")]) == built


def rows_of(folder):
    return [json.loads(r) for r in (folder / "metrics.jsonl").read_text().splitlines()]


def run_info(folder):
    return json.loads((folder / "run.json").read_text())


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A 2-step run with each decoder layer compiled, saved at its last step and exported
    (a copy of the export in base/ for the fine-tune). Backend aot_eager: dynamo and
    AOTAutograd trace the layer with FSDP2's hooks, no C++ compiler needed (inductor on CPU
    takes minutes)."""
    tmp = tmp_path_factory.mktemp("ch06")
    args = ["--data-dir", tmp / "data", "--out", tmp / "run", "--vocab-size", "300",
            "--seq-len", "32", "--batch-size", "4", "--micro-batch", "4", "--max-steps", "2",
            "--warmup", "1", "--eval-every", "2", "--save-every", "2", "--no-progress",
            "--compile", "aot_eager", "--preset", "cpu-tiny", "--eval-sequences", "8"]
    run_ok(1, SCRIPT, *args, timeout=600)
    shutil.copytree(tmp / "run" / "hf", tmp / "base")  # a folder no other test rewrites
    return tmp, args


def test_resume_from_the_last_step(exported):
    """A job requeued after its last checkpoint (at the last step) resumes, trains nothing,
    and exports; no other run reaches that branch. The last save was checked by one more
    forward and backward (no step) before its commit: the compiled run reached its end."""
    tmp, args = exported
    rows = rows_of(tmp / "run")
    assert [r["step"] for r in rows] == [0, 1, 2] and rows[-1]["eval_loss"] < rows[0]["eval_loss"]
    assert run_info(tmp / "run")["compile"] == "aot_eager"
    assert "first_step" not in run_info(tmp / "run")  # not counted: the graphs would break
    proc = run_ok(1, SCRIPT, *args, "--resume", timeout=600)
    assert "resumed from step_000002: step 2 of 2" in proc.stdout
    assert "exported to" in proc.stdout
    assert rows_of(tmp / "run") == rows  # nothing trained, nothing logged twice


# Faults from outside: this wrapper runs train_llama.py (or SCRIPT, another file of
# ch06_capstone/) unchanged (runpy), with a fault placed by environment variables "RANK:N" (the
# review's injection methods). Hooks, not script changes: the
# script has no test hook, so what it does here is what it does on a cluster.
INJECT = r"""
import os, runpy, signal, sys, threading
import torch
from torch.optim.optimizer import (register_optimizer_step_post_hook,
                                   register_optimizer_step_pre_hook)
from transformers import LlamaForCausalLM
sys.path.insert(0, os.path.join(os.environ["CODE"], "ch06_capstone"))
import corpus
import distkit.ckpt

RANK = int(os.environ["RANK"])
def at(name):  # "RANK:N" -> N on that rank, else None
    value = os.environ.get(name, "")
    return int(value.split(":")[1]) if value and int(value.split(":")[0]) == RANK else None

nan_loss, bad_update, kill = at("NAN_LOSS_AT"), at("BAD_UPDATE_AT"), at("KILL_AT")
nan_state, lr_spike = at("NAN_STATE_AT"), at("LR_SPIKE_AT")
count = {"forward": 0, "step": 0}
forward = LlamaForCausalLM.forward
def poisoned(self, *args, **kwargs):  # training forward number N returns a NaN loss
    out = forward(self, *args, **kwargs)
    if self.training:
        count["forward"] += 1
        if count["forward"] == nan_loss:
            out.loss = out.loss * float("nan")
    return out
LlamaForCausalLM.forward = poisoned

def after_step(optimizer, args, kwargs):  # after this process's AdamW step N
    if all(group["lr"] == 0 for group in optimizer.param_groups):
        return  # not training: DCP's load initialises AdamW's state with a step at LR 0
    count["step"] += 1
    if count["step"] == bad_update:  # one element of this rank's first shard becomes NaN
        with torch.no_grad():
            p = optimizer.param_groups[0]["params"][0]
            (p.to_local() if hasattr(p, "to_local") else p).view(-1)[0] = float("nan")
    if count["step"] == nan_state:  # one element of AdamW's exp_avg_sq shard becomes NaN
        with torch.no_grad():
            v = optimizer.state[optimizer.param_groups[0]["params"][0]]["exp_avg_sq"]
            (v.to_local() if hasattr(v, "to_local") else v).view(-1)[0] = float("nan")
    if count["step"] == kill:
        os.kill(os.getpid(), signal.SIGKILL)
register_optimizer_step_post_hook(after_step)

def before_step(optimizer, args, kwargs):  # this process's AdamW step N at 10,000 x the LR
    if lr_spike is not None and count["step"] + 1 == lr_spike and any(
            group["lr"] for group in optimizer.param_groups):
        for group in optimizer.param_groups:
            group["lr"] *= 1e4  # (the loop sets every step's LR afresh)
register_optimizer_step_pre_hook(before_step)

if at("TERM_AT_START") is not None:  # a preemption while the token cache is prepared
    prepare = corpus.prepare_on_ranks
    def preempted(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        return prepare(*args, **kwargs)
    corpus.prepare_on_ranks = preempted

if os.environ.get("RANDPERM_LOG"):  # how often the data order is drawn
    randperm = torch.randperm
    def counted(*args, **kwargs):
        with open(f"{os.environ['RANDPERM_LOG']}.{RANK}", "a") as f:
            f.write(f"{args[0]}\n")
        return randperm(*args, **kwargs)
    torch.randperm = counted

if os.environ.get("HASH_LOG"):  # which thread reads back and hashes each checkpoint file
    sha256 = distkit.ckpt._sha256
    def logged(path):
        with open(f"{os.environ['HASH_LOG']}.{RANK}", "a") as f:
            f.write(f"{threading.current_thread().name} {path.name}\n")
        return sha256(path)
    distkit.ckpt._sha256 = logged

script = os.path.join(os.environ["CODE"], "ch06_capstone",
                      os.environ.get("SCRIPT", "train_llama.py"))
sys.argv[0] = script
runpy.run_path(script, run_name="__main__")
"""


@pytest.fixture(scope="module")
def inject(tmp_path_factory):
    path = tmp_path_factory.mktemp("inject") / "inject_train_llama.py"
    path.write_text(INJECT)
    return path


def faulty(inject, nproc, *args, **faults):
    """Launch train_llama.py through the fault-injecting wrapper."""
    return run_launcher(nproc, inject, *args, env={"CODE": str(CODE), **faults}, timeout=600)


def test_fine_tune_with_cluster_options_until_a_nan(exported, inject):
    """One 2-process launch: a fine-tune of the export (--model-path: its weights, config and
    tokenizer) on --data for a fifth of an epoch, with selective AC, asynchronous saves at every
    step, bf16, no reshard after forward, a reduce-scatter per micro-batch and rows every 2
    steps. What those options did is asserted from run.json: all-gathers A(L+1), reduce-scatters
    A(L+1) for A = 2 micro-batches and L + 1 = 5 FSDP units (C4/M6); the clipped norm within
    --clip; AdamW's betas and weight decay. Then rank 1's loss turns NaN at step 4 (its forward
    7): every rank stops before the optimizer step, step 3's save (which may hold the update
    that led here) is discarded, OUT/failed.json says why, each rank exits 3 and torchrun 1
    (F1); the held-out loss had fallen (it learns the text)."""
    tmp, _ = exported
    (tmp / "mine.txt").write_text(("the cat sat on the mat. " * 43 + "\n") * 20)  # 20 pieces
    out = tmp / "tuned"
    proc = faulty(
        inject, 2, "--model-path", tmp / "base", "--data", tmp / "mine.txt", "--data-dir",
        tmp / "data", "--out", out, "--seq-len", "32", "--batch-size", "8", "--micro-batch", "2",
        "--epochs", "0.2", "--warmup", "1", "--eval-every", "2", "--eval-sequences", "4",
        "--save-every", "1", "--keep", "2", "--no-progress", "--no-export",
        "--ac", "selective", "--async-save", "--reshard-after-forward", "0", "--precision",
        "bf16", "--sync-every-microbatch", "--lr", "1e-3", "--min-lr", "1e-4",
        "--weight-decay", "0.05", "--betas", "0.9", "0.99", "--clip", "0.5", "--seed", "1",
        "--peak-tflops", "100", "--timeout", "120", "--log-every", "2", NAN_LOSS_AT="1:7")
    assert proc.returncode == 1, proc.stdout + proc.stderr  # torchrun's, whatever the ranks'
    assert "failed first (exit code 3)" in proc.stdout + proc.stderr  # the ranks' own (F1)
    assert ("non-finite loss nan or gradient norm nan at step 4: stopped before the optimizer "
            "step; step 3's save discarded (it may hold the update that led here); newest "
            "checkpoint: step_000002; each rank exits with status 3") in proc.stderr, proc.stderr
    assert json.loads((out / "failed.json").read_text()) == {
        "reason": "non-finite", "step": 4, "retry": False, "newest_checkpoint": "step_000002"}
    assert "bf16" in proc.stdout
    n = int(re.search(r"(\d+) training sequences", proc.stdout)[1])
    steps = round(0.2 * (n // 8))  # --epochs 0.2 of n // 8 steps
    assert steps > 4 and (f"this run: {steps} optimizer steps x 8 sequences = "
                          f"{steps * 8 / n:.3g} epoch(s)") in proc.stdout
    ckpt = CheckpointDir(out / "checkpoints")
    assert [p.name for p in ckpt.committed()] == ["step_000001", "step_000002"]
    assert ckpt.problem(ckpt.committed()[-1]) is None
    assert not list(ckpt.root.glob("*.tmp"))
    rows = rows_of(out)
    assert [r["step"] for r in rows] == [0, 2]  # --log-every 2: step 4 never logged
    assert math.isfinite(rows[1]["loss"]) and math.isfinite(rows[1]["grad_norm"])
    assert rows[1]["eval_loss"] < rows[0]["eval_loss"]  # it learns the cat
    assert not (out / "hf").exists()
    info = run_info(out)
    units, micro = info["fsdp"]["units"], info["micro_batches"]
    assert (units, micro, info["fsdp"]["reshard_after_forward"], info["sync_every_microbatch"],
            info["fsdp"]["param_dtype"], info["ac"]) == (5, 2, False, True, "bfloat16",
                                                          "selective")
    counted = info["first_step"]["collectives"]
    assert (counted["all_gather"], counted["reduce_scatter"]) == (micro * units, micro * units)
    assert info["first_step"]["grad_norm"] > 0.5  # clipping was needed ...
    assert info["first_step"]["grad_norm_clipped"] == pytest.approx(0.5, rel=1e-3)  # ... and done
    assert [(g["betas"], g["weight_decay"]) for g in info["adamw"]] == [
        ([0.9, 0.99], 0.05), ([0.9, 0.99], 0.0)]


def test_preempted_during_start_up(tmp_path, inject):
    """F7: the handler is installed before the slow start-up (data, model, weights, resume). A
    SIGTERM while the token cache is prepared stops the run at its first step, with a
    checkpoint and stopped.json, instead of killing it. --overwrite: a previous run's files in
    --out are deleted, as asked."""
    out = tmp_path / "run"
    (out / "checkpoints" / "step_000009").mkdir(parents=True)
    (out / "metrics.jsonl").write_text('{"step": 9}\n')
    proc = faulty(inject, 1, "--data-dir", tmp_path / "data", "--out", out, "--vocab-size", "300",
                  "--seq-len", "32", "--batch-size", "4", "--micro-batch", "4", "--max-steps",
                  "4", "--warmup", "1", "--eval-sequences", "4", "--no-progress",
                  "--overwrite", TERM_AT_START="0:0")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "stopped by SIGTERM after step 1; checkpoint saved" in proc.stdout
    assert json.loads((out / "stopped.json").read_text()) == {"signal": "SIGTERM", "step": 1}
    assert [p.name for p in CheckpointDir(out / "checkpoints").committed()] == ["step_000001"]
    assert [r["step"] for r in rows_of(out)] == [0, 1]  # the old run's row 9 is gone


@pytest.fixture(scope="module")
def chaos(tmp_path_factory, inject):
    """Three 2-rank launches into one --out, HSDP (2 replicas, as the Slurm template runs it),
    asynchronous saves every 5 steps, on a JSONL corpus (field "body"):
    1. rank 1 is SIGKILLed after step 9, four steps after step 5's save began;
    2. --resume, and rank 1's update of step 10 (a save step) writes a NaN into a weight:
       step 11's loss is NaN;
    3. --resume with the corpus staged in another folder (a copy: new path, new mtime), to the
       end (step 15)."""
    tmp = tmp_path_factory.mktemp("chaos")
    write_jsonl(tmp / "corpus.jsonl", field="body")
    out, hashes = tmp / "run", tmp / "hashes"
    common = ["--data-dir", tmp / "data", "--out", out, "--text-field", "body", "--vocab-size",
              "300", "--seq-len", "32", "--batch-size", "4", "--micro-batch", "2",
              "--max-steps", "15", "--warmup", "2", "--eval-every", "6", "--eval-sequences", "4",
              "--save-every", "5", "--keep", "3", "--async-save", "--replicate", "2",
              "--no-progress", "--no-export"]
    first = faulty(inject, 2, "--data", tmp / "corpus.jsonl", *common, KILL_AT="1:9",
                   HASH_LOG=str(hashes))
    after_kill = [p.name for p in CheckpointDir(out / "checkpoints").committed()]
    second = faulty(inject, 2, "--data", tmp / "corpus.jsonl", *common, "--resume",
                    BAD_UPDATE_AT="1:5")
    after_nan = [p.name for p in CheckpointDir(out / "checkpoints").committed()]
    rows_second, failed = rows_of(out), json.loads((out / "failed.json").read_text())
    (tmp / "scratch").mkdir()
    shutil.copy(tmp / "corpus.jsonl", tmp / "scratch" / "corpus.jsonl")
    third = run_launcher(2, SCRIPT, "--data", tmp / "scratch" / "corpus.jsonl", *common,
                         "--resume", timeout=600)
    return {"tmp": tmp, "out": out, "common": common, "hashes": hashes,
            "runs": (first, second, third),
            "after_kill": after_kill, "after_nan": after_nan, "rows_second": rows_second,
            "failed": failed}


def test_a_save_is_committed_once_written_not_at_the_next_save(chaos):
    """F12: step 5's checkpoint is committed at the first step whose all-reduce says every
    rank's upload is done, so a crash at step 9 (before step 10's save) keeps it; committed
    only at the next save, as before, it was lost with the crash."""
    first = chaos["runs"][0]
    assert first.returncode == 1 and "rank 1 failed first (killed by SIGKILL)" in first.stderr
    assert chaos["after_kill"] == ["step_000005"]


def test_checkpoint_hashing_is_off_the_training_thread(chaos):
    """F5: each rank reads back and hashes its checkpoint files in a thread of its own (the
    commit then only gathers the results); nothing is hashed in the training thread."""
    lines = [ln.split() for r in (0, 1) for ln in
             Path(f"{chaos['hashes']}.{r}").read_text().splitlines()]
    assert lines and {thread for thread, _ in lines} != {"MainThread"}
    assert not [name for thread, name in lines if thread == "MainThread"]
    assert {name for _, name in lines} >= {".metadata", "__0_0.distcp", "__1_0.distcp"}


def test_a_bad_update_at_a_save_step_never_becomes_the_newest_checkpoint(chaos):
    """F13: the update of step 10 (a save step) is bad: the finite-state check of step 10's
    save sees it at step 11's all-reduce (as step 11's NaN would). The save of
    step 10 was not committed yet (that waits for a finite later step): it is discarded, the
    newest checkpoint stays step 5's, and --resume continues from there to the end."""
    _, second, third = chaos["runs"]
    assert "resumed from step_000005: step 5 of 15" in second.stdout
    assert second.returncode == 1 and "failed first (exit code 3)" in second.stdout + second.stderr
    # (the NaN weight is in step 10's save: the finite-state check, before its commit, sees it)
    assert ("a non-finite value in step 10's weights or optimizer state (checked before its "
            "commit) at step 11: stopped before the optimizer step; step 10's save discarded (it "
            "may hold the update that led here); newest checkpoint: step_000005"
            ) in second.stderr, second.stderr
    assert chaos["after_nan"] == ["step_000005"]
    assert chaos["failed"] == {"reason": "non-finite", "step": 11, "retry": False,
                               "newest_checkpoint": "step_000005"}
    # F11: the corpus staged elsewhere (another path, another mtime): same cache, same run
    assert third.returncode == 0, third.stdout + third.stderr
    assert "resumed from step_000005: step 5 of 15" in third.stdout
    assert len(list((chaos["tmp"] / "data").glob("text-*"))) == 1  # tokenized once
    assert not (chaos["out"] / "failed.json").exists()
    rows = rows_of(chaos["out"])
    train = {r["step"]: r["loss"] for r in rows if "loss" in r}
    assert sorted(train) == list(range(1, 16))
    # steps 6-10 of the failed attempt (before the bad update showed) = the resumed run's
    before = {r["step"]: r["loss"] for r in chaos["rows_second"] if "loss" in r}
    assert [before[s] for s in range(6, 11)] == [train[s] for s in range(6, 11)]
    assert [p.name for p in CheckpointDir(chaos["out"] / "checkpoints").committed()] == [
        "step_000005", "step_000010", "step_000015"]


def test_async_saves_reuse_one_pinned_host_copy(chaos):
    """F4: the capstone's async saves go through distkit's Stager, made once: the second save
    refills the host copy the first one allocated (on a GPU: pinned memory, copied without
    blocking the step), instead of a fresh pageable copy per save."""
    if "staged_host_bytes" not in run_info(chaos["out"]) and torch.__version__ < "2.13":
        pytest.skip("torch < 2.13: DCP's default staging (a reused stager fails: "
                    "pytorch/pytorch#183413)")
    staged = run_info(chaos["out"])["staged_host_bytes"]
    assert len(staged) == 2  # the resumed run's saves, of steps 10 and 15
    assert staged[0]["bytes"] > 0 and all(s["reused"] == s["bytes"] for s in staged[1:])


def test_a_resume_with_no_usable_checkpoint_changes_nothing(chaos, tmp_path):
    """faults.md 5b (HIGH): a shard truncated in every checkpoint of a finished run. --resume
    skipped them all and trained from step 0 with exit 0, its old metrics deleted and the
    damaged checkpoints overwritten (the sbatch always passes --resume). Now: refused, every
    checkpoint named with its reason, no file changed. (One rank: 1 launch.)"""
    out = tmp_path / "run"
    shutil.copytree(chaos["out"], out)
    for folder in CheckpointDir(out / "checkpoints").committed():  # steps 5, 10, 15
        shard = folder / "__1_0.distcp"
        shard.write_bytes(shard.read_bytes()[:1000])
    (out / "stopped.json").write_text('{"signal": "SIGTERM", "step": 15}')  # an earlier stop
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file() and p.name != ".lock"}
    args = [a if a != chaos["out"] else out for a in chaos["common"]]
    i = args.index("--replicate")
    args[i:i + 2] = []  # (HSDP needs 2 ranks; the check is the same on one)
    proc = run_launcher(1, SCRIPT, "--data", chaos["tmp"] / "corpus.jsonl", *args, "--resume",
                        timeout=600)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    line = [ln for ln in proc.stderr.splitlines() if ln.startswith("train_llama.py: --resume")]
    assert line and line[0].startswith(
        f"train_llama.py: --resume: 3 checkpoint(s) in {out / 'checkpoints'}, none usable "
        "(step_000015: __1_0.distcp has 1000 bytes, the manifest says ")
    assert "; step_000010: __1_0.distcp has 1000 bytes" in line[0]
    assert line[0].endswith("); nothing changed: restore a checkpoint's files, or start over "
                            "in another folder")
    after = {p: p.read_bytes() for p in out.rglob("*") if p.is_file() and p.name != ".lock"}
    assert after == before


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """A pydoc token cache (built here, in-process) and the 1-rank settings of the bad-update
    runs: 12 steps, a save every 3, held-out loss only at the end."""
    tmp = tmp_path_factory.mktemp("bad_updates")
    corpus.prepare(tmp / "data", 300)
    return tmp, ["--data-dir", tmp / "data", "--vocab-size", "300", "--seq-len", "32",
                 "--batch-size", "4", "--micro-batch", "2", "--max-steps", "12", "--warmup",
                 "2", "--eval-every", "100", "--eval-sequences", "4", "--save-every", "3",
                 "--keep", "2", "--no-progress", "--no-export"]


def test_nan_in_optimizer_state_is_never_committed(small, inject):
    """faults.md 3d: after rank 1's update of save step 6, one element of its AdamW exp_avg_sq
    shard is NaN. Step 7's loss is finite (the state is used only by step 7's update), so the
    loss check passed and step 6 was committed with the NaN: every --resume then failed at
    step 8. Now every rank checks its shards (weights and optimizer state) at the save, and
    the next step's all-reduce carries the flag: step 6's save is discarded, exit 3."""
    tmp, args = small
    out = tmp / "nan_state"
    proc = faulty(inject, 2, *args, "--out", out, NAN_STATE_AT="1:6")
    assert proc.returncode == 1 and "failed first (exit code 3)" in proc.stdout + proc.stderr
    assert ("train_llama.py: a non-finite value in step 6's weights or optimizer state (checked "
            "before its commit) at step 7: stopped before the optimizer step; step 6's save "
            "discarded (it may hold the update that led here); newest checkpoint: step_000003"
            ) in proc.stderr, proc.stderr
    assert json.loads((out / "failed.json").read_text()) == {
        "reason": "non-finite", "step": 7, "retry": False, "newest_checkpoint": "step_000003"}
    assert [p.name for p in CheckpointDir(out / "checkpoints").committed()] == ["step_000003"]


@pytest.fixture(scope="module")
def spiked(small, inject):
    """faults.md 3e: the update of save step 6 at 10,000 x the LR (finite, but the loss goes
    from ~4.7 to ~10^4)."""
    tmp, args = small
    out = tmp / "spike"
    return out, faulty(inject, 1, *args, "--out", out, LR_SPIKE_AT="0:6")


def test_a_loss_spike_at_a_save_step_is_never_committed(spiked):
    """faults.md 3e: the bad update stayed finite, so steps 6 and 9 were committed with it and
    the run crashed later (OverflowError in exp(eval loss), exit 1, requeued from the poisoned
    step). The loss-spike guard (--spike-factor 3, the default) stops at step 7, before its
    update: step 6's save is discarded, failed.json says why, exit 3."""
    out, proc = spiked
    assert proc.returncode == 1 and "failed first (exit code 3)" in proc.stdout + proc.stderr
    assert re.search(r"train_llama.py: loss \S+ is more than --spike-factor 3 x the mean \S+ of "
                     r"the last 6 steps at step 7: stopped before the optimizer step; step 6's "
                     r"save discarded", proc.stderr), proc.stderr
    assert json.loads((out / "failed.json").read_text()) == {
        "reason": "loss-spike", "step": 7, "retry": False, "newest_checkpoint": "step_000003"}
    assert [p.name for p in CheckpointDir(out / "checkpoints").committed()] == ["step_000003"]


@pytest.mark.second_nproc
def test_past_a_bad_region_with_a_lower_lr(spiked, small):
    """docs/cluster.md's remedy for exit 3, which a resume refused ("the checkpoint's run had
    --lr ..."): --resume-from an older step with --change-schedule and a lower --lr runs to the
    end, and run.json records the change (from which step, what it was, what it is)."""
    out, _ = spiked
    tmp, args = small
    proc = run_ok(1, SCRIPT, *args, "--out", out, "--resume-from", "3", "--change-schedule",
                  "--lr", "1e-3", "--min-lr", "1e-4", timeout=600)
    assert "resumed from step_000003: step 3 of 12" in proc.stdout
    assert "--change-schedule at step 3: --lr 0.003 -> 0.001, --min-lr 0.0003 -> 0.0001" \
        in proc.stdout
    changes = [{"step": 3, "was": {"--lr": 0.003, "--min-lr": 0.0003},
                "now": {"--lr": 0.001, "--min-lr": 0.0001}, "resumed_from": 3}]
    assert run_info(out)["schedule_changes"] == changes
    assert not (out / "failed.json").exists()
    rows = rows_of(out)
    assert [r["step"] for r in rows if "loss" in r] == list(range(1, 13))
    assert rows[-1]["lr"] == pytest.approx(1e-4)
    # the sbatch requeues a job with the same options: that --resume-from is not done twice
    again = run_ok(1, SCRIPT, *args, "--out", out, "--resume-from", "3", "--change-schedule",
                   "--lr", "1e-3", "--min-lr", "1e-4", timeout=600)
    assert "--resume-from 3: done by an earlier attempt (run.json)" in again.stdout
    assert "resumed from step_000012: step 12 of 12" in again.stdout
    assert run_info(out)["schedule_changes"] == changes


@pytest.mark.second_nproc
def test_a_requeued_resume_from_never_resumes_past_its_step(small):
    """Review R47 (high): --resume-from 6 with checkpoints 6, 9, 12, killed before its first
    commit, then requeued with the same options (as the sbatch does): the requeue said "done by
    an earlier attempt", resumed from step 12, the future it was meant to leave, and exited 0.
    Now the newer checkpoints are set aside (.old) before the first step: the requeue resumes
    from 6 and trains 7..12 again."""
    import subprocess
    import time

    from conftest import LAUNCHER, launcher_env
    tmp, args = small
    out = tmp / "requeued"
    args = [*args[:args.index("--keep")], "--keep", "3", *args[args.index("--keep") + 2:]]
    run_ok(1, SCRIPT, *args, "--out", out, timeout=600)
    assert [p.name for p in CheckpointDir(out / "checkpoints").committed()] == [
        "step_000006", "step_000009", "step_000012"]
    again = [str(LAUNCHER), "1", SCRIPT, *map(str, args), "--out", str(out), "--resume-from", "6"]
    first = subprocess.Popen(again, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             env=launcher_env())
    deadline = time.monotonic() + 300
    while '"resumed_from": 6' not in ((out / "run.json").read_text()
                                      if (out / "run.json").exists() else ""):
        assert first.poll() is None and time.monotonic() < deadline, first.stdout.read()
        time.sleep(0.05)
    # SIGKILL, every process of the launch (a SIGTERM would save and commit): before step 9's
    # commit, as a node lost then would
    import psutil
    for proc in [*psutil.Process(first.pid).children(recursive=True), psutil.Process(first.pid)]:
        proc.kill()
    first.communicate()
    assert sorted(p.name for p in (out / "checkpoints").glob("*.old")) == [
        "step_000009.old", "step_000012.old"]
    requeue = run_ok(1, SCRIPT, *args, "--out", out, "--resume-from", "6", timeout=600)
    assert "--resume-from 6: done by an earlier attempt (run.json)" in requeue.stdout
    assert "resumed from step_000006: step 6 of 12" in requeue.stdout, requeue.stdout
    assert [r["step"] for r in rows_of(out) if "loss" in r] == list(range(1, 13))
    # a step with no checkpoint is named as such (R47 #9: "no readable manifest.json")
    missing = run_launcher(1, SCRIPT, *args, "--out", out, "--resume-from", "7")
    assert missing.returncode != 0
    assert (f"train_llama.py: --resume-from 7: no checkpoint of that step in {out}/checkpoints "
            "(committed: 6, 9, 12)") in missing.stderr, missing.stderr


@pytest.mark.second_nproc
def test_a_checkpoint_of_another_model_shape_is_one_line(small):
    """faults.md 5c: a --resume with a model of another width (the same tokenizer and data)
    failed inside DCP ("Size mismatch", 6 tracebacks). Progress.run now holds the model's
    shape and is loaded first: one line naming both."""
    from transformers import AutoModelForCausalLM, LlamaConfig
    tmp, args = small
    out, narrow = tmp / "shape", tmp / "narrow"
    args = [*args[:args.index("--max-steps") + 1], "3", *args[args.index("--max-steps") + 2:]]
    run_ok(1, SCRIPT, *args, "--out", out, timeout=600)  # cpu-tiny: hidden 128
    folder = corpus.cache_folder(tmp / "data", 300)
    eos = corpus.facts(folder)["eos_id"]
    config = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=192,
                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=32, bos_token_id=eos, eos_token_id=eos,
                         pad_token_id=eos, tie_word_embeddings=True)
    AutoModelForCausalLM.from_config(config).save_pretrained(narrow)
    corpus.tokenizer(folder).save_pretrained(narrow)
    proc = run_launcher(1, SCRIPT, *args, "--out", out, "--resume", "--model-path", narrow,
                        timeout=600)
    assert proc.returncode == 1
    line = [ln for ln in proc.stderr.splitlines()
            if ln.startswith("train_llama.py: the checkpoint's run had")]
    assert line and ("model hidden_size 128, intermediate_size 384, num_hidden_layers 4, "
                     "num_attention_heads 4, num_key_value_heads 2, vocab_size 300 (now "
                     "hidden_size 64, intermediate_size 192") in line[0], proc.stderr
    assert "Size mismatch" not in proc.stderr


@pytest.mark.second_nproc
def test_two_launches_at_once_into_one_folder(small):
    """faults.md 4e: two launches into one new --out at the same moment both ran and both
    exited 0, sharing checkpoints and metrics. Now one runs; the other is refused in one line
    (the lock; or, if it came late enough, the previous run's files)."""
    from concurrent.futures import ThreadPoolExecutor
    tmp, args = small
    out = tmp / "twice"
    args = [*args[:args.index("--max-steps") + 1], "4", *args[args.index("--max-steps") + 2:]]
    with ThreadPoolExecutor(2) as pool:
        procs = list(pool.map(lambda _: run_launcher(1, SCRIPT, *args, "--out", out,
                                                     timeout=600), range(2)))
    assert sorted(p.returncode for p in procs) == [0, 1], [p.stderr for p in procs]
    refused = next(p for p in procs if p.returncode)
    assert (f"--out {out} is in use by another run (host " in refused.stderr
            or f"--out {out} holds a previous run" in refused.stderr), refused.stderr
    assert [r["step"] for r in rows_of(out)] == [0, 1, 2, 3, 4]  # one run's rows, once each


@pytest.mark.second_nproc
def test_an_evaluation_that_overflows_is_a_non_finite_stop(small, inject):
    """faults.md 3e: with the spike guard off, the bad update of step 6 meets the held-out
    evaluation of step 6: math.exp(eval loss) overflowed (exit 1, no failed.json, so the
    sbatch requeued it). Now a non-finite stop: exit 3, failed.json; step 3's checkpoint (a
    finite step followed it) is the newest."""
    tmp, args = small
    out = tmp / "eval_overflow"
    args = [a if a != "100" else "6" for a in args]  # --eval-every 6
    proc = faulty(inject, 1, *args, "--out", out, "--spike-factor", "0", LR_SPIKE_AT="0:6")
    assert proc.returncode == 1 and "failed first (exit code 3)" in proc.stdout + proc.stderr
    assert "train_llama.py: held-out loss " in proc.stderr and " after step 6 at step 7" \
        in proc.stderr, proc.stderr
    assert json.loads((out / "failed.json").read_text())["reason"] == "non-finite"
    assert [p.name for p in CheckpointDir(out / "checkpoints").committed()] == ["step_000003"]


def checkpoint_tensors(folder) -> dict:
    """Every value of a DCP checkpoint, unsharded (dcp_to_torch_save: no process group)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    dcp_to_torch_save(folder, folder.parent / f"{folder.name}.pt")
    state = torch.load(folder.parent / f"{folder.name}.pt", weights_only=False)
    (folder.parent / f"{folder.name}.pt").unlink()
    return state


@pytest.mark.stress
def test_chaos_kills_at_save_steps_resume_bit_identical(tmp_path, inject):
    """make stress (issue 47): the capstone on 2 ranks, 18 steps, a save every 3 (sync or
    --async-save, drawn), SIGKILLed twice on a random rank right after a save step's update
    or the step after it (the save of that step in flight), resumed each time. The metrics
    rows (loss, gradient norm, LR, tokens) and the final checkpoint (every weight, AdamW
    moment and counter) equal the uninterrupted run's, bit for bit."""
    import random
    rng = random.Random()
    seed = rng.randrange(10**6)
    rng.seed(seed)
    mode = rng.choice([[], ["--async-save"]])
    corpus.prepare(tmp_path / "data", 300)
    args = ["--data-dir", tmp_path / "data", "--vocab-size", "300", "--seq-len", "32",
            "--batch-size", "4", "--micro-batch", "2", "--max-steps", "18", "--warmup", "2",
            "--eval-every", "9", "--eval-sequences", "4", "--save-every", "3", "--keep", "2",
            "--no-progress", "--no-export", *mode]
    run_ok(2, SCRIPT, *args, "--out", tmp_path / "ref", timeout=600)
    first, second = sorted(rng.sample([3, 4, 6, 7, 9, 10, 12, 13], 2))
    kills = [f"{rng.randrange(2)}:{first}", f"{rng.randrange(2)}:{second - first}"]
    note = f"seed {seed}, {mode or 'sync'}, kills (rank:step of that attempt) {kills}"
    for i, kill in enumerate(kills):
        proc = faulty(inject, 2, *args, "--out", tmp_path / "run",
                      *(["--resume"] if i else []), KILL_AT=kill)
        assert proc.returncode != 0 and "killed by SIGKILL" in proc.stderr, note
    run_ok(2, SCRIPT, *args, "--out", tmp_path / "run", "--resume", timeout=600)
    keys = ("step", "loss", "grad_norm", "lr", "tokens", "eval_loss")
    rows = [[{k: r.get(k) for k in keys} for r in rows_of(tmp_path / name)]
            for name in ("ref", "run")]
    assert rows[0] == rows[1], note
    want, got = (checkpoint_tensors(tmp_path / name / "checkpoints" / "step_000018")
                 for name in ("ref", "run"))
    flat = [dict(ckpt_items(x)) for x in (want, got)]
    assert sorted(flat[0]) == sorted(flat[1]), note
    assert [k for k, v in flat[0].items()
            if not (torch.equal(v, flat[1][k]) if isinstance(v, torch.Tensor)
                    else v == flat[1][k])] == [], note


def ckpt_items(obj, prefix=""):
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from ckpt_items(v, f"{prefix}{k}.")
    else:
        yield prefix.rstrip("."), obj


@pytest.mark.second_nproc
def test_hsdp_2x2_equals_flat_fsdp_and_reshards_onto_2_ranks(tmp_path):
    """The first configuration in which HSDP shards (4 ranks, 2 replicas x 2 shards): the same
    losses as flat FSDP (over 2 ranks, 2 micro-batches each: the same global batch; a flat run
    on 4 cost two more ranks' imports and showed the same), FSDP2's collectives within a
    replica (2L + 1 all-gathers, L + 1 reduce-scatters, and the gradient shards all-reduced
    across replicas), and its checkpoint of step 3 resumed on 2 flat ranks continues as the
    HSDP run did."""
    common = ["--data-dir", tmp_path / "data", "--vocab-size", "300", "--seq-len", "32",
              "--batch-size", "8", "--micro-batch", "2", "--max-steps", "6", "--warmup", "2",
              "--eval-every", "6", "--eval-sequences", "4", "--no-progress", "--no-export"]
    hsdp, flat, resumed = tmp_path / "hsdp", tmp_path / "flat", tmp_path / "resumed"
    proc = run_ok(4, SCRIPT, *common, "--replicate", "2", "--save-every", "3", "--out", hsdp,
                  timeout=900)
    assert "HSDP: 2 replicas x 2 shards" in proc.stdout
    run_ok(2, SCRIPT, *common, "--out", flat, timeout=900)
    info = run_info(hsdp)
    counted, layers = info["first_step"]["collectives"], info["fsdp"]["units"] - 1
    assert info["fsdp"]["mesh"] == [2, 2] and info["micro_batches"] == 1
    assert (counted["all_gather"], counted["reduce_scatter"]) == (2 * layers + 1, layers + 1)
    assert counted["all_reduce"] >= layers + 1  # the reduced shards, across the replicas
    loss = {run: {r["step"]: r["loss"] for r in rows_of(run) if "loss" in r}
            for run in (hsdp, flat)}
    assert sorted(loss[hsdp]) == list(range(1, 7))
    assert max(abs(loss[hsdp][s] - loss[flat][s]) for s in range(1, 7)) < 1e-5
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copytree(hsdp / "checkpoints" / "step_000003", resumed / "checkpoints" / "step_000003")
    proc = run_ok(2, SCRIPT, *common, "--out", resumed, "--resume", timeout=900)
    assert "resumed from step_000003: step 3 of 6" in proc.stdout
    after = {r["step"]: r["loss"] for r in rows_of(resumed) if "loss" in r}
    assert sorted(after) == [4, 5, 6]
    assert max(abs(after[s] - loss[hsdp][s]) for s in after) < 1e-5


# Options no run here can pass, and why (each still has its bad-input or message test)
NOT_RUN_HERE = {"--tensorboard": "needs the tensorboard package, not a course dependency"}


def test_every_option_runs(monkeypatch, capsys):
    """Every option in --help is passed by a run: a function of this file or of
    test_ch06_recipe.py that launches the script (bad input does not count), a code cell of the
    notebook, or an entry of
    distkit/course/gpu_smoke.py's registry (GPU-only options, run by `make gpu-smoke`)."""
    _, usage, _ = run_in_process(monkeypatch, capsys, SCRIPT, "--help")
    usage = usage.split("\n\n")[0]  # the usage lines: each option once, by its first name
    options = set(re.findall(r"(--[a-z][-a-z0-9]*)", usage)) - {"--help"}
    runs = []
    for path in (Path(__file__), Path(__file__).with_name("test_ch06_recipe.py")):
        here = path.read_text()
        runs += [ast.get_source_segment(here, f) for f in ast.parse(here).body
                 if isinstance(f, ast.FunctionDef)]
    runs = [src for src in runs if "run_ok(" in src or "run_launcher(" in src or "faulty(" in src]
    nb = nbformat.read(ROOT / "notebooks" / NOTEBOOK, as_version=4)
    runs += [c.source for c in nb.cells if c.cell_type == "code"]
    runs += [(CODE / "distkit" / "course" / "gpu_smoke.py").read_text()]
    assert {"--replicate", "--ac", "--compile", "--async-save"} <= options
    never = sorted(o for o in options if not any(f'"{o}"' in src for src in runs))
    assert never == sorted(NOT_RUN_HERE)


@pytest.mark.second_nproc
def test_notebook_at_three_processes(tmp_path):
    """The chapter at N = 3 with the batch its parameters derive (18 sequences, micro-batches of 3:
    1, 2 and 3 ranks divide it; the 24 given here before cost a third more work per step)."""
    run_papermill(tmp_path, NOTEBOOK, "-p", "NPROC", "3")
    check_results(ROOT / "build" / "ch06")


def check_results(out) -> None:
    """What the notebook's runs logged (metrics.jsonl in `out`/a: NPROC processes; `out`/b: one
    process stopped by SIGTERM, then resumed on two "nodes" and stopped past the next
    evaluation), at the notebook's default STEPS and PREEMPT_AT: the held-out loss falls more
    than 0.1 nats below the unigram baseline, the runs agree to float noise (1e-5 per step) over
    the first steps and within 5e-3 over every step and evaluation b has."""
    params = {}
    exec(nbformat.read(ROOT / "notebooks" / NOTEBOOK, as_version=4).cells[1].source, params)
    rows = {run: [json.loads(line) for line in (out / run / "metrics.jsonl").read_text()
                  .splitlines()] for run in ("a", "b")}
    train = {run: {r["step"]: r["loss"] for r in rs if "loss" in r} for run, rs in rows.items()}
    evals = {run: {r["step"]: r["eval_loss"] for r in rs if "eval_loss" in r}
             for run, rs in rows.items()}
    assert sorted(train["a"]) == list(range(1, params["STEPS"] + 1))
    steps = [r["step"] for r in rows["b"] if "loss" in r]  # each once, past the resume's eval
    next_eval = (params["PREEMPT_AT"] // params["EVAL_EVERY"] + 1) * params["EVAL_EVERY"]
    assert steps == list(range(1, len(steps) + 1))
    assert len(steps) >= min(next_eval, params["STEPS"])
    assert evals["a"][params["STEPS"]] < rows["a"][0]["unigram_loss"] - 0.1
    # float noise grows step after step (the notebook's section 6): 1e-5 for the first
    # SAVE_EVERY steps (at N=3 the gap reached 2.8e-5 by step 25; 5e-3 holds for the whole run)
    first = range(1, params["SAVE_EVERY"] + 1)
    assert max(abs(train["a"][s] - train["b"][s]) for s in first) < 1e-5
    assert max(abs(train["a"][s] - train["b"][s]) for s in steps) < 5e-3
    assert sorted(evals["b"]) == [s for s in sorted(evals["a"]) if s <= steps[-1]]
    assert max(abs(evals["a"][s] - evals["b"][s]) for s in evals["b"]) < 5e-3


@pytest.mark.parametrize("head_dim", [None, 32])
def test_flops_per_token_reads_head_dim(head_dim):
    """MFU's FLOPs under --model-path: a config whose head_dim is not hidden / heads (Qwen3,
    Mistral-Nemo) has q/k/v/o matrices of heads x head_dim columns; the matmul weights of a
    meta-device model equal the formula's, and so does attention's 12 L H Q T term."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from distkit.memory import flops_per_token, matmul_params
    config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=96,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=head_dim)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    matmul = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    q = head_dim or 64 // 4
    assert model.model.layers[0].self_attn.q_proj.weight.shape == (4 * q, 64)
    assert matmul_params(config) == matmul
    assert flops_per_token(config, 32) == 6 * matmul + 12 * 2 * 4 * q * 32

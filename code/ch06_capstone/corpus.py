"""The capstone's data: real English text that every Python has (or yours), a BPE tokenizer
trained on it, tokenized once into a flat file of token ids that every rank maps. Nothing is
downloaded.

The course's text is the Python reference documentation that ships inside Python itself
(`pydoc_data.topics`: what `help("with")` shows, 79 topics, about 0.46 MB in Python 3.11; a
little different in other Python versions, so token counts differ between machines). Your data
(--data) can be, mixed freely:
- plain text files (any other name): one document each, read as a stream;
- JSON Lines (.jsonl, .json): one document per line, the text in its FIELD ("text");
- Parquet (.parquet): one document per row, column FIELD (needs pyarrow);
- a folder written by `datasets`' save_to_disk: one document per row (needs datasets; of a
  DatasetDict, its "train" split).
pyarrow and datasets are optional: the course does not install them, and a path that needs one
that is missing is refused with a line that says what to install. The tokenizer is a byte-level
BPE (GPT-2's scheme) trained with Hugging Face `tokenizers`.

At scale, as nanoGPT's prepare.py does: the text is read and tokenized once, streaming, in
pieces of about PIECE characters cut at line ends, so memory stays flat whatever the size of
the corpus; the ids go straight to disk, train.bin and heldout.bin (uint16 when the vocabulary
fits in 65,536 ids, else uint32: 2 or 4 bytes a token), with a small index, index.json. The
held-out split is made *before* the BPE is trained, so the tokenizer never sees held-out text:
every 20th record (a JSONL line, a row) is held out whole, and text files (few, long documents)
give every 20th piece instead. The ranks only map the files (np.memmap): the pages are shared,
nothing is copied, and a sequence is a view of --seq-len consecutive ids, whatever --seq-len is.

The cache key is cheap and survives a copy: the files' names relative to their common folder,
their sizes and a sha256 of their first and last 4 KiB (not their whole contents, not their
paths or modification times), the vocabulary, the field and the tokenizer. So a restart on
10 GB of text finds its cache at once, and the same corpus staged on another disk finds it too;
an edit that keeps a file's size and both ends is not seen (change the --data-dir then).

    python code/ch06_capstone/corpus.py --data-dir build/ch06/data   # build the cache, print facts
"""
from __future__ import annotations

import argparse
import hashlib
import json
import contextlib
import os
import shutil
import socket
import sys
import time
from pathlib import Path

import numpy as np
import torch

EOS = "<|endoftext|>"  # between documents, so a packed sequence sees where one topic ends
FORMAT = 4             # bump when the way the cache is built changes
PIECE = 1024           # characters per piece (cut at a line end): the unit of the held-out split
HOLD_OUT = 20          # every 20th piece (of text files) or record (of the other formats)
BPE_SAMPLE = 64 << 20  # the BPE learns its merges from at most this many training characters
BATCH = 256            # pieces tokenized at once (the fast tokenizer's batch, in parallel)
SAMPLE = 4096          # bytes at each end of a file that the cache key hashes
RECORDS = {".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet"}


def kind(path) -> str:
    """How a --data path is read: "text", "jsonl", "parquet" or "dataset" (a folder)."""
    path = Path(path)
    return "dataset" if path.is_dir() else RECORDS.get(path.suffix.lower(), "text")


def check(paths, field: str = "text") -> str | None:
    """Why these --data paths cannot be read (one line), or None. Cheap: it opens each record
    file's first record only."""
    for path in map(Path, paths):
        if not path.exists():
            return f"no such file {path}"
        how = kind(path)
        try:
            if how == "parquet":
                import pyarrow.parquet as pq
                if field not in pq.ParquetFile(path).schema_arrow.names:
                    return f"{path}: no column {field!r} (--text-field)"
            elif how == "dataset":
                if not (path / "dataset_info.json").exists() and not (
                        path / "dataset_dict.json").exists():
                    return f"{path}: a folder, but not one that datasets' save_to_disk wrote"
                import datasets  # noqa: F401
                if field not in next(iter(records(path, field, check_only=True)), {}):
                    return f"{path}: no column {field!r} (--text-field)"
            elif how == "jsonl":  # utf-8-sig: a byte-order mark (Windows tools write one)
                with open(path, encoding="utf-8-sig") as f:
                    first = next((ln for ln in f if ln.strip()), None)
                if first is None:
                    return f"{path}: no records (an empty file)"
                if field not in json.loads(first):
                    return f"{path}: its first record has no field {field!r} (--text-field)"
            elif path.stat().st_size == 0:
                return f"{path}: an empty file"
        except ImportError as e:
            need = "pyarrow" if how == "parquet" else "datasets"
            return (f"{path}: reading {how} needs the {need} package ({e.name} is not installed; "
                    f"pip install {need}), or convert it to JSON Lines")
        except (ValueError, OSError) as e:
            return f"{path}: cannot be read as {how} ({e})"
    return None


def records(path: Path, field: str, check_only: bool = False):
    """The documents of a record file or saved dataset, one string at a time."""
    how = kind(path)
    if how == "jsonl":  # a bad record anywhere is one line, FILE:LINE: what is wrong
        with open(path, encoding="utf-8-sig") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    raise SystemExit(f"{path}:{n}: not a JSON record ("
                                     f"{e.msg.removesuffix(' at')}, column {e.colno})") from None
                if not isinstance(record, dict) or not isinstance(record.get(field), str):
                    raise SystemExit(f"{path}:{n}: no text field {field!r} in this record "
                                     "(--text-field)")
                yield record[field]
    elif how == "parquet":
        import pyarrow.parquet as pq
        for batch in pq.ParquetFile(path).iter_batches(columns=[field], batch_size=1024):
            yield from batch.column(0).to_pylist()
    else:
        import datasets
        data = datasets.load_from_disk(str(path))
        if isinstance(data, datasets.DatasetDict):
            data = data["train"]
        if check_only:
            yield dict(data.features)
            return
        for row in data.select_columns([field]).iter(batch_size=1024):
            yield from row[field]


def documents(paths=None, field: str = "text"):
    """(source name, document, whole) for every document: a document is a string or, for a text
    file, its Path (read as it goes); `whole` says the held-out split takes it whole (a record)
    rather than piece by piece. Without paths: Python's reference docs, topic by topic."""
    if not paths:
        try:
            from pydoc_data.topics import topics
        except ImportError:  # some Linux distributions split it into a separate package
            raise SystemExit("corpus.py: this Python has no pydoc_data (the reference docs that "
                             "help() shows); install your distribution's full Python standard "
                             "library (e.g. Debian's libpython3-stdlib) or use conda/python.org "
                             "Python")
        for name in sorted(topics):
            yield name, topics[name], False
        return
    for path in sorted(map(Path, paths), key=str):
        if kind(path) == "text":
            yield str(path), path, False
        else:
            for text in records(path, field):
                yield str(path), text or "", True


def pieces(source):
    """A document's text in pieces of about PIECE characters, cut after a line end; a file is
    read as it goes (a 10 GB file never sits in memory)."""
    if isinstance(source, str):
        lines = source.splitlines(keepends=True)
    else:
        lines = open(source, encoding="utf-8", errors="replace")
    buf, size = [], 0
    for line in lines:
        buf.append(line)
        size += len(line)
        if size >= PIECE:
            yield "".join(buf)
            buf, size = [], 0
    if buf:
        yield "".join(buf)
    if not isinstance(source, str):
        lines.close()


def split_pieces(paths=None, held: bool = False, field: str = "text"):
    """(document index, piece) of the training pieces (held=False) or the held-out ones. A
    record (JSONL line, Parquet or dataset row) is held out whole when its number r (over the
    records of the corpus) has r % HOLD_OUT == HOLD_OUT-1; a text document, piece by piece, by
    the same rule on the piece number k (over the pieces of text documents)."""
    k = r = 0
    for d, (_, doc, whole) in enumerate(documents(paths, field)):
        if whole:
            if (r % HOLD_OUT == HOLD_OUT - 1) == held:
                for piece in pieces(doc):
                    yield d, piece
            r += 1
            continue
        for piece in pieces(doc):
            if (k % HOLD_OUT == HOLD_OUT - 1) == held:
                yield d, piece
            k += 1


def train_tokenizer(paths, vocab_size: int, field: str = "text"):
    """A byte-level BPE learned from the training pieces only (at most BPE_SAMPLE characters)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    def sample():
        seen = 0
        for _, piece in split_pieces(paths, field=field):
            if seen >= BPE_SAMPLE:
                return
            seen += len(piece)
            yield piece
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(sample(), trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOS], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))  # any byte can be encoded
    return tok


def hf_tokenizer(tok):
    """The `tokenizers` object as a transformers tokenizer (for save_pretrained and generate)."""
    from transformers import PreTrainedTokenizerFast
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, bos_token=EOS,
                                   pad_token=EOS)


def _fingerprint(path: Path) -> tuple[int, str]:
    """A file's size and the sha256 of its first and last SAMPLE bytes."""
    size = path.stat().st_size
    h = hashlib.sha256()
    with open(path, "rb") as f:
        h.update(f.read(SAMPLE))
        f.seek(max(0, size - SAMPLE))
        h.update(f.read(SAMPLE))
    return size, h.hexdigest()[:16]


def cache_key(paths, vocab_size: int, tokenizer, field: str = "text") -> str:
    """What decides the tokens, cheaply, wherever the corpus lies: the files' names relative to
    their common folder, sizes and end samples (the Python version for its docs), the
    vocabulary, the field, the tokenizer's name, the format."""
    if paths:
        paths = sorted((Path(p).resolve() for p in paths), key=str)
        root = Path(os.path.commonpath(paths)) if len(paths) > 1 else paths[0].parent
        files = [f for p in paths for f in (sorted(q for q in p.rglob("*") if q.is_file())
                                             if p.is_dir() else [p])]
        text = [(str(f.relative_to(root)), *_fingerprint(f)) for f in files]
    else:
        text = sys.version
    vocab = len(tokenizer) if tokenizer is not None else vocab_size  # (a given one has its own)
    return hashlib.sha256(json.dumps([FORMAT, vocab, text, field, tokenizer_id(tokenizer)])
                          .encode()).hexdigest()[:12]


def tokenizer_id(tokenizer) -> str | None:
    """A given tokenizer by what it is, not where it lies: a hash of its rules (vocabulary,
    merges, normalisation), so corpus.py --model-path DIR and train_llama.py --model-path DIR/
    (another spelling, another copy of the model) find the same cache."""
    if tokenizer is None:
        return None
    backend = getattr(tokenizer, "backend_tokenizer", None)  # a fast tokenizer's rules
    if backend is None:
        return tokenizer.name_or_path
    return hashlib.sha256(backend.to_str().encode()).hexdigest()[:16]


def cache_folder(data_dir, vocab_size: int, tokenizer=None, paths=None,
                 field: str = "text") -> Path:
    """Where prepare() keeps (or will keep) the tokens of this corpus."""
    name = f"{'text' if paths else 'pydoc'}-{cache_key(paths, vocab_size, tokenizer, field)}"
    return Path(data_dir) / name


def write_tokens(path: Path, stream, eos: int, dtype, tokenizer, progress=None) -> dict:
    """Tokenize (document, piece) pairs in batches and append the ids to `path`, an EOS after
    each document; returns counts. Memory: one batch of pieces and its ids."""
    counts = {"tokens": 0, "characters": 0, "last_document": -1}
    last_doc = None
    with open(path, "wb") as f:
        def flush(batch):
            ids = tokenizer([p for _, p in batch], add_special_tokens=False)["input_ids"]
            out = []
            for (d, piece), piece_ids in zip(batch, ids):
                nonlocal last_doc
                if last_doc is not None and d != last_doc:
                    out.append(eos)  # the document before this piece has ended
                counts["last_document"] = last_doc = d
                out.extend(piece_ids)
                counts["characters"] += len(piece)
                if progress is not None:
                    progress.update(len(piece))
            arr = np.asarray(out, dtype=dtype)
            f.write(arr.tobytes())
            counts["tokens"] += len(arr)
        batch = []
        for item in stream:
            batch.append(item)
            if len(batch) == BATCH:
                flush(batch)
                batch = []
        if batch:
            flush(batch)
        if last_doc is not None:
            f.write(np.asarray([eos], dtype=dtype).tobytes())
            counts["tokens"] += 1
    return counts


def prepare(data_dir: str | os.PathLike, vocab_size: int, seq_len: int | None = None,
            tokenizer=None, paths=None, field: str = "text") -> Path:
    """Build (once) and return the cache folder: tokenizer/, train.bin, heldout.bin, counts.npy
    (each id's count in train.bin, for the unigram baseline) and index.json. (`seq_len` is
    not part of it: a sequence is a view of the flat ids.)

    With `tokenizer` (a transformers tokenizer, e.g. from --model-path) it is used instead of
    training one; with `paths` (--data), their documents replace the course's. Writes go to a
    temporary folder that is renamed, so a reader never sees half a file."""
    folder = cache_folder(data_dir, vocab_size, tokenizer, paths, field)
    if (folder / "index.json").exists():
        return folder
    tmp = folder.with_name(f"{folder.name}.tmp-{socket.gethostname()}-{os.getpid()}")
    tmp.mkdir(parents=True)
    try:
        return _build(folder, tmp, vocab_size, tokenizer, paths, field)
    finally:  # a failure (bad data, a full disk, a signal) leaves no half-built folder
        shutil.rmtree(tmp, ignore_errors=True)


def _build(folder: Path, tmp: Path, vocab_size: int, tokenizer, paths, field: str) -> Path:
    if tokenizer is None:
        tokenizer = hf_tokenizer(train_tokenizer(paths, vocab_size, field))
    tokenizer.save_pretrained(tmp / "tokenizer")
    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
    dtype = np.uint16 if len(tokenizer) <= 1 << 16 else np.uint32
    from tqdm import tqdm  # a bar on a terminal only (disable=None), in characters
    with tqdm(unit="B", unit_scale=True, desc="tokenizing", disable=None, file=sys.stderr) as bar:
        train = write_tokens(tmp / "train.bin", split_pieces(paths, field=field), eos, dtype,
                             tokenizer, bar)
        held = write_tokens(tmp / "heldout.bin", split_pieces(paths, held=True, field=field),
                            eos, dtype, tokenizer, bar)
    counts = np.zeros(len(tokenizer), dtype=np.int64)
    with open(tmp / "train.bin", "rb") as f:  # read in blocks of 1 Mi ids: bounded memory
        while (block := np.fromfile(f, dtype=dtype, count=1 << 20)).size:
            counts += np.bincount(block, minlength=len(tokenizer))
    np.save(tmp / "counts.npy", counts)
    tok_hash = hashlib.sha256((tmp / "tokenizer" / "tokenizer.json").read_bytes()).hexdigest()
    index = {"format": FORMAT, "dtype": np.dtype(dtype).name, "vocab_size": len(tokenizer),
             "eos_id": eos, "tokenizer_sha256": tok_hash, "hold_out": f"every {HOLD_OUT}th "
             f"record whole, or piece of ~{PIECE} characters of a text file, before the BPE "
             "was trained", "documents": max(train["last_document"], held["last_document"]) + 1,
             "characters": train["characters"] + held["characters"],
             "train_tokens": train["tokens"], "heldout_tokens": held["tokens"],
             "text": sorted(map(str, paths))[:20] if paths else "pydoc_data.topics"}
    (tmp / "index.json").write_text(json.dumps(index, indent=1))
    with contextlib.suppress(OSError):  # atomic; if another process won the race, its copy
        os.replace(tmp, folder)
    return folder


def prepare_on_ranks(rank: int, data_dir, vocab_size: int, stopped=None, **kwargs) -> Path:
    """prepare() in a process group: global rank 0 builds (or finds) the cache, once per job;
    every other rank, on any node, waits for its index.json to appear (the data dir must be on
    a file system every node sees, as the checkpoints'), then all meet at a barrier. The others
    poll the file system instead of waiting in a collective, so tokenizing a large corpus takes
    as long as it takes: no collective timeout ends it. If rank 0 fails, its torchrun stops the
    ranks of its node (SIGTERM: a waiting rank whose `stopped()` then says so leaves at once),
    and under train_llama.sbatch `srun --kill-on-bad-exit` the other nodes'.
    A collective: every rank calls it."""
    import torch.distributed as dist
    folder = cache_folder(data_dir, vocab_size, kwargs.get("tokenizer"), kwargs.get("paths"),
                          kwargs.get("field", "text"))
    if rank == 0:
        folder = prepare(data_dir, vocab_size, **kwargs)
    else:
        while not (folder / "index.json").exists():
            if stopped is not None and stopped():
                raise SystemExit(f"rank {rank}: stopped by a signal while waiting for rank 0's "
                                 f"token cache in {folder.parent}")
            time.sleep(0.2)
    dist.barrier()
    return folder


def load(folder: Path, seq_len: int = 128):
    """(train, heldout): the token files mapped into memory (copy-on-write: read-only in
    practice, every rank shares the pages), as (sequences, seq_len) integer tensors of the file's
    dtype, views cut every seq_len ids (the tail shorter than a sequence is left out)."""
    index = facts(folder)
    out = []
    for name in ("train.bin", "heldout.bin"):
        ids = np.memmap(Path(folder) / name, dtype=index["dtype"], mode="c")
        n = len(ids) // seq_len
        out.append(torch.from_numpy(ids[:n * seq_len].reshape(n, seq_len)))
    return tuple(out)


def unigram_loss(folder: Path, heldout: torch.Tensor) -> float:
    """The baseline a language model must beat: the cross-entropy (nats per token) on the
    held-out tokens of a model that ignores context and predicts each token with its frequency
    in the training tokens (add-one smoothing, so unseen tokens cost a finite amount).
    Scored on the same targets as the model's loss: every token of a sequence but the first."""
    counts = torch.from_numpy(np.load(Path(folder) / "counts.npy")).double() + 1
    logp = (counts / counts.sum()).log()
    return -logp[heldout[:, 1:].reshape(-1).long()].mean().item()


def tokenizer(folder: Path):
    """The cached tokenizer, as a transformers tokenizer."""
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(Path(folder) / "tokenizer")


def facts(folder: Path) -> dict:
    return json.loads((Path(folder) / "index.json").read_text())


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Build the capstone's tokenizer and token files.")
    parser.add_argument("--data-dir", default="build/ch06/data")
    parser.add_argument("--vocab-size", type=int, default=2048)
    parser.add_argument("--seq-len", type=int, default=128, help="for the sequence counts shown")
    parser.add_argument("--data", "--text", nargs="+", metavar="PATH",
                        help="your text, JSONL, Parquet files or saved datasets (default: pydoc)")
    parser.add_argument("--text-field", default="text", help="the records' text field")
    parser.add_argument("--model-path", metavar="DIR", help="tokenize with this Hugging Face "
                        "folder's tokenizer (the one train_llama.py --model-path DIR uses: its "
                        "job then finds this cache) instead of training a BPE")
    args = parser.parse_args()
    if args.vocab_size < 257 or args.seq_len < 2:
        parser.error("need --vocab-size >= 257 (the 256 bytes and EOS) and --seq-len >= 2")
    if args.data and (problem := check(args.data, args.text_field)):
        parser.error(f"--data: {problem}")
    tokenizer = None
    if args.model_path:
        if not os.path.isfile(os.path.join(args.model_path, "tokenizer_config.json")):
            parser.error(f"--model-path: no tokenizer_config.json in {args.model_path}")
        from transformers import AutoTokenizer
        tokenizer = AutoTokenizer.from_pretrained(args.model_path)
    folder = prepare(args.data_dir, args.vocab_size, tokenizer=tokenizer, paths=args.data,
                     field=args.text_field)
    print(folder)
    train, heldout = load(folder, args.seq_len)
    index = facts(folder)
    index.pop("text")
    index.update(train_sequences=len(train), heldout_sequences=len(heldout),
                 unigram_loss=round(unigram_loss(folder, heldout), 3))
    for k, v in index.items():
        print(f"{k:18s} {v}")

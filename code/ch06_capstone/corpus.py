"""The capstone's data: real English text that every Python has, a BPE tokenizer trained on it,
tokenized once into a flat file of token ids that every rank maps. Nothing is downloaded.

The text is the Python reference documentation that ships inside Python itself
(`pydoc_data.topics`: what `help("with")` shows, 79 topics, about 0.46 MB in Python 3.11; a
little different in other Python versions, so token counts differ between machines), or your
--text files (one document each). The tokenizer is a byte-level BPE (GPT-2's scheme) trained
with Hugging Face `tokenizers`.

At scale, as nanoGPT's prepare.py does: the text is read and tokenized once, streaming, in
pieces of about PIECE characters cut at line ends, so memory stays flat whatever the size of
the corpus; the ids go straight to disk, train.bin and heldout.bin (uint16 when the vocabulary
fits in 65,536 ids, else uint32: 2 or 4 bytes a token), with a small index, index.json. Every
20th piece is held out *before* the BPE is trained, so the tokenizer never sees held-out text.
The ranks only map the files (np.memmap): the pages are shared, nothing is copied, and a
sequence is a view of --seq-len consecutive ids, whatever --seq-len is. The cache key is cheap:
the files' names, sizes and modification times (not their contents), the vocabulary size and
the tokenizer, so a restart on a 10 GB corpus finds its cache at once.

    python code/ch06_capstone/corpus.py --data-dir build/ch06/data   # build the cache, print facts
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import socket
import sys
from pathlib import Path

import numpy as np
import torch

EOS = "<|endoftext|>"  # between documents, so a packed sequence sees where one topic ends
FORMAT = 3             # bump when the way the cache is built changes
PIECE = 1024           # characters per piece (cut at a line end): the unit of the held-out split
HOLD_OUT = 20          # every 20th piece is held out
BPE_SAMPLE = 64 << 20  # the BPE learns its merges from at most this many training characters
BATCH = 256            # pieces tokenized at once (the fast tokenizer's batch, in parallel)


def sources(files=None) -> list[tuple[str, object]]:
    """(name, how to read it) of each document: your files, or Python's reference docs."""
    if files:
        return [(str(f), Path(f)) for f in sorted(map(str, files))]
    try:
        from pydoc_data.topics import topics
    except ImportError:  # some Linux distributions split it into a separate package
        raise SystemExit("corpus.py: this Python has no pydoc_data (the reference docs that "
                         "help() shows); install your distribution's full Python standard "
                         "library (e.g. Debian's libpython3-stdlib) or use conda/python.org Python")
    return [(name, topics[name]) for name in sorted(topics)]


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


def split_pieces(files=None, held: bool = False):
    """(document index, piece) of the training pieces (held=False) or the held-out ones:
    piece number k (counted over the whole corpus) is held out when k % HOLD_OUT == HOLD_OUT-1."""
    k = 0
    for d, (_, source) in enumerate(sources(files)):
        for piece in pieces(source):
            if (k % HOLD_OUT == HOLD_OUT - 1) == held:
                yield d, piece
            k += 1


def train_tokenizer(files, vocab_size: int):
    """A byte-level BPE learned from the training pieces only (at most BPE_SAMPLE characters)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    def sample():
        seen = 0
        for _, piece in split_pieces(files):
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


def cache_key(files, vocab_size: int, tokenizer) -> str:
    """What decides the tokens, cheaply: names, sizes and mtimes of the files (the Python
    version for its docs), the vocabulary, the tokenizer's name, the format."""
    if files:
        text = [(str(Path(f).resolve()), os.stat(f).st_size, os.stat(f).st_mtime_ns)
                for f in sorted(map(str, files))]
    else:
        text = sys.version
    return hashlib.sha256(json.dumps([FORMAT, vocab_size, text, tokenizer.name_or_path
                                      if tokenizer else None]).encode()).hexdigest()[:12]


def write_tokens(path: Path, stream, eos: int, dtype, tokenizer, progress=None) -> dict:
    """Tokenize (document, piece) pairs in batches and append the ids to `path`, an EOS after
    each document; returns counts. Memory: one batch of pieces and its ids."""
    counts = {"tokens": 0, "characters": 0}
    last_doc = None
    with open(path, "wb") as f:
        def flush(batch):
            ids = tokenizer([p for _, p in batch], add_special_tokens=False)["input_ids"]
            out = []
            for (d, piece), piece_ids in zip(batch, ids):
                nonlocal last_doc
                if last_doc is not None and d != last_doc:
                    out.append(eos)  # the document before this piece has ended
                last_doc = d
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
            tokenizer=None, files=None) -> Path:
    """Build (once) and return the cache folder: tokenizer/, train.bin, heldout.bin, counts.npy
    (each id's count in train.bin, for the unigram baseline) and index.json. (`seq_len` is
    not part of it: a sequence is a view of the flat ids.)

    With `tokenizer` (a transformers tokenizer, e.g. from --model-path) it is used instead of
    training one; with `files`, their text replaces the course's. Writes go to a temporary
    folder that is renamed, so ranks or nodes that build the same cache at once never read half
    a file."""
    folder = Path(data_dir) / f"{'text' if files else 'pydoc'}-{cache_key(files, vocab_size, tokenizer)}"
    if (folder / "index.json").exists():
        return folder
    tmp = folder.with_name(f"{folder.name}.tmp-{socket.gethostname()}-{os.getpid()}")
    tmp.mkdir(parents=True)
    if tokenizer is None:
        tokenizer = hf_tokenizer(train_tokenizer(files, vocab_size))
    tokenizer.save_pretrained(tmp / "tokenizer")
    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
    dtype = np.uint16 if len(tokenizer) <= 1 << 16 else np.uint32
    from tqdm import tqdm  # a bar on a terminal only (disable=None), in characters
    total = sum(os.stat(f).st_size for f in files) if files else None
    with tqdm(total=total, unit="B", unit_scale=True, desc="tokenizing", disable=None,
              file=sys.stderr) as bar:
        train = write_tokens(tmp / "train.bin", split_pieces(files), eos, dtype, tokenizer, bar)
        held = write_tokens(tmp / "heldout.bin", split_pieces(files, held=True), eos, dtype,
                            tokenizer, bar)
    counts = np.zeros(len(tokenizer), dtype=np.int64)
    with open(tmp / "train.bin", "rb") as f:  # read in blocks of 1 Mi ids: bounded memory
        while (block := np.fromfile(f, dtype=dtype, count=1 << 20)).size:
            counts += np.bincount(block, minlength=len(tokenizer))
    np.save(tmp / "counts.npy", counts)
    tok_hash = hashlib.sha256((tmp / "tokenizer" / "tokenizer.json").read_bytes()).hexdigest()
    index = {"format": FORMAT, "dtype": np.dtype(dtype).name, "vocab_size": len(tokenizer),
             "eos_id": eos, "tokenizer_sha256": tok_hash, "hold_out": f"every {HOLD_OUT}th "
             f"piece of ~{PIECE} characters, before the BPE was trained",
             "documents": len(sources(files)), "characters": train["characters"]
             + held["characters"], "train_tokens": train["tokens"],
             "heldout_tokens": held["tokens"],
             "text": [name for name, _ in sources(files)][:20]}  # the first names, for a reader
    (tmp / "index.json").write_text(json.dumps(index, indent=1))
    try:
        os.replace(tmp, folder)  # atomic; if another process won the race, keep its copy
    except OSError:
        import shutil
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def prepare_on_ranks(local_rank: int, *args, **kwargs) -> Path:
    """prepare() in a process group: the first rank of each node builds (or finds) the cache
    while the others wait, then every rank takes global rank 0's folder. A collective: every
    rank calls it."""
    import torch.distributed as dist
    folder = [prepare(*args, **kwargs) if local_rank == 0 else None]
    dist.barrier()
    dist.broadcast_object_list(folder, src=0)
    return Path(folder[0])


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
    p = argparse.ArgumentParser(description="Build the capstone's tokenizer and token files.")
    p.add_argument("--data-dir", default="build/ch06/data")
    p.add_argument("--vocab-size", type=int, default=2048)
    p.add_argument("--seq-len", type=int, default=128, help="for the sequence counts shown")
    p.add_argument("--text", nargs="+", metavar="FILE", help="your text files (default: pydoc)")
    a = p.parse_args()
    if a.vocab_size < 257 or a.seq_len < 2:
        p.error("need --vocab-size >= 257 (the 256 bytes and EOS) and --seq-len >= 2")
    folder = prepare(a.data_dir, a.vocab_size, files=a.text)
    print(folder)
    train, heldout = load(folder, a.seq_len)
    index = facts(folder)
    index.pop("text")
    index.update(train_sequences=len(train), heldout_sequences=len(heldout),
                 unigram_loss=round(unigram_loss(folder, heldout), 3))
    for k, v in index.items():
        print(f"{k:18s} {v}")

"""The capstone's data: real English text that every Python has, a BPE tokenizer trained on it,
and the tokens packed into fixed-length sequences. Nothing is downloaded.

The text is the Python reference documentation that ships inside Python itself
(`pydoc_data.topics`: what `help("with")` shows, 79 topics, about 0.46 MB in Python 3.11; a
little different in other Python versions, so token counts differ between machines). The
tokenizer is a byte-level BPE (GPT-2's scheme) trained with Hugging Face `tokenizers` in a
fraction of a second, and cached with the packed tokens in one folder, keyed by a hash of
everything that decides them: a second run (or every other rank) just loads them.

    python code/ch06_capstone/corpus.py --data-dir build/ch06/data   # build the cache, print facts
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import socket
from pathlib import Path

import torch

EOS = "<|endoftext|>"  # between documents, so a packed sequence sees where one topic ends
FORMAT = 2  # bump when the way the cache is built changes


def documents(files=None) -> list[str]:
    """The course's text: Python's reference documentation, one document per topic. Or, with
    `files`, your own: one document per file (UTF-8 text)."""
    if files:
        return [Path(f).read_text(encoding="utf-8", errors="replace") for f in sorted(files)]
    try:
        from pydoc_data.topics import topics
    except ImportError:  # some Linux distributions split it into a separate package
        raise SystemExit("corpus.py: this Python has no pydoc_data (the reference docs that "
                         "help() shows); install your distribution's full Python standard "
                         "library (e.g. Debian's libpython3-stdlib) or use conda/python.org Python")
    return [topics[name] for name in sorted(topics)]


def train_tokenizer(docs: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(docs, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOS], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))  # any byte can be encoded
    return tok


def hf_tokenizer(tok):
    """The `tokenizers` object as a transformers tokenizer (for save_pretrained and generate)."""
    from transformers import PreTrainedTokenizerFast
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, bos_token=EOS,
                                   pad_token=EOS)


def prepare(data_dir: str | os.PathLike, vocab_size: int, seq_len: int, eval_every: int = 20,
            tokenizer=None, files=None) -> Path:
    """Build (once) and return the cache folder: tokenizer/, train.pt, heldout.pt, facts.json.

    The token stream (documents joined by EOS) is cut into sequences of seq_len tokens; every
    `eval_every`-th sequence is held out, so the held-out text comes from every topic. With
    `tokenizer` (a transformers tokenizer, e.g. from --model-path) it is used instead of
    training one; with `files`, their text replaces the course's. Writes go to a temporary name
    and are renamed, so ranks or nodes that build the same cache at once never read half a file.
    """
    docs = documents(files)
    key = hashlib.sha256(json.dumps([FORMAT, vocab_size, seq_len, eval_every,
                                     tokenizer.name_or_path if tokenizer else None,
                                     hashlib.sha256("".join(docs).encode()).hexdigest()])
                         .encode()).hexdigest()[:12]
    folder = Path(data_dir) / f"{'text' if files else 'pydoc'}-{key}"
    if (folder / "facts.json").exists():
        return folder
    tmp = folder.with_name(f"{folder.name}.tmp-{socket.gethostname()}-{os.getpid()}")
    tmp.mkdir(parents=True)
    if tokenizer is None:
        tokenizer = hf_tokenizer(train_tokenizer(docs, vocab_size))
    tokenizer.save_pretrained(tmp / "tokenizer")
    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
    stream = [i for ids in tokenizer(docs)["input_ids"] for i in ids + [eos]]
    n = len(stream) // seq_len
    seqs = torch.tensor(stream[:n * seq_len], dtype=torch.int32).view(n, seq_len)
    held = torch.arange(n) % eval_every == eval_every - 1
    torch.save(seqs[~held].clone(), tmp / "train.pt")
    torch.save(seqs[held].clone(), tmp / "heldout.pt")
    train, heldout = seqs[~held], seqs[held]
    facts = {"documents": len(docs), "characters": sum(map(len, docs)), "tokens": len(stream),
             "vocab_size": len(tokenizer), "eos_id": eos, "seq_len": seq_len,
             "train_sequences": len(train), "heldout_sequences": len(heldout),
             "unigram_loss": unigram_loss(train, heldout, len(tokenizer))}
    (tmp / "facts.json").write_text(json.dumps(facts, indent=1))
    try:
        os.replace(tmp, folder)  # atomic; if another process won the race, keep its copy
    except OSError:
        import shutil
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def prepare_on_ranks(local_rank: int, *args, **kwargs) -> Path:
    """prepare() in a process group: the first rank of each node builds (or finds) the cache
    while the others wait, then every rank takes global rank 0's folder. The text is read and
    hashed once per node, not once per rank. A collective: every rank calls it."""
    import torch.distributed as dist
    folder = [prepare(*args, **kwargs) if local_rank == 0 else None]
    dist.barrier()
    dist.broadcast_object_list(folder, src=0)
    return Path(folder[0])


def unigram_loss(train: torch.Tensor, heldout: torch.Tensor, vocab_size: int) -> float:
    """The baseline a language model must beat: the cross-entropy (nats per token) on the
    held-out tokens of a model that ignores context and predicts each token with its frequency
    in the training tokens (add-one smoothing, so unseen tokens cost a finite amount).
    Scored on the same targets as the model's loss: every token of a sequence but the first."""
    counts = torch.bincount(train.reshape(-1).long(), minlength=vocab_size).double() + 1
    logp = (counts / counts.sum()).log()
    return -logp[heldout[:, 1:].reshape(-1).long()].mean().item()


def load(folder: Path):
    """The cached (train, heldout) int tensors, memory-mapped: every rank shares the pages."""
    return (torch.load(folder / "train.pt", mmap=True), torch.load(folder / "heldout.pt", mmap=True))


def tokenizer(folder: Path):
    """The cached tokenizer, as a transformers tokenizer."""
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(Path(folder) / "tokenizer")


def facts(folder: Path) -> dict:
    return json.loads((Path(folder) / "facts.json").read_text())


if __name__ == "__main__":
    p = argparse.ArgumentParser(description="Build the capstone's tokenizer and data cache.")
    p.add_argument("--data-dir", default="build/ch06/data")
    p.add_argument("--vocab-size", type=int, default=2048)
    p.add_argument("--seq-len", type=int, default=128)
    a = p.parse_args()
    if a.vocab_size < 257 or a.seq_len < 2:
        p.error("need --vocab-size >= 257 (the 256 bytes and EOS) and --seq-len >= 2")
    folder = prepare(a.data_dir, a.vocab_size, a.seq_len)
    print(folder)
    for k, v in facts(folder).items():
        print(f"{k:18s} {v:.3f}" if isinstance(v, float) else f"{k:18s} {v}")

"""How much memory tokenizing a large corpus takes with corpus.py: a benchmark, not a test.

    PYTHONPATH=code python code/ch06_capstone/bench_corpus.py --sizes-mb 16 64 256 1024

For each size it generates that much English-like text (lines of Python's reference
documentation, shuffled with a seed, in files of at most 128 MB), then builds the token cache
with corpus.prepare (BPE training on at most corpus.BPE_SAMPLE characters, the streaming
tokenization, the unigram counts) in a fresh child process, and prints the child's peak resident
memory (ru_maxrss) and the time. A Python list of ids (the old corpus.py) grows by ~36 bytes a
token; the streaming path should stay flat: the slope, MB of peak RSS per GB of text, says so.
"""
import argparse
import random
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
p.add_argument("--sizes-mb", type=int, nargs="+", default=[16, 64, 256])
p.add_argument("--vocab-size", type=int, default=8192)
p.add_argument("--dir", help="where to write the text and the cache (default: a temp folder)")
args = p.parse_args()
if min(args.sizes_mb) < 1:
    p.error("--sizes-mb must be >= 1")

from pydoc_data.topics import topics  # noqa: E402

LINES = [ln + "\n" for text in topics.values() for ln in text.splitlines() if ln.strip()]
FILE_MB = 128


def generate(folder: Path, mb: int) -> list[Path]:
    """mb MB of text in files of at most FILE_MB, written 1 MB at a time."""
    rng, files, left = random.Random(mb), [], mb << 20
    while left > 0:
        path = folder / f"part{len(files):04d}.txt"
        size = 0
        with open(path, "w") as f:
            while size < min(left, FILE_MB << 20):
                block = "".join(rng.choices(LINES, k=20000))[:1 << 20]
                f.write(block)
                size += len(block)
        files.append(path)
        left -= size
    return files


CHILD = """
import resource, sys, time
sys.path.insert(0, {code!r})
import corpus
t0 = time.perf_counter()
folder = corpus.prepare({data!r}, {vocab}, paths={files!r})
facts = corpus.facts(folder)
print(time.perf_counter() - t0, facts["train_tokens"] + facts["heldout_tokens"],
      resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
"""

root = Path(args.dir or tempfile.mkdtemp(prefix="bench_corpus-"))
print(f"{'text MB':>8s} {'tokens':>12s} {'peak RSS MB':>11s} {'seconds':>8s} {'MB/s':>6s}")
points = []
for mb in args.sizes_mb:
    folder = root / f"text{mb}"
    folder.mkdir(parents=True, exist_ok=True)
    files = generate(folder, mb)
    code = CHILD.format(code=str(Path(__file__).parent), data=str(root / f"cache{mb}"),
                        vocab=args.vocab_size, files=[str(f) for f in files])
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    seconds, tokens, rss_kib = out.stdout.split()
    rss = int(rss_kib) / 1024
    points.append((mb, rss))
    print(f"{mb:8d} {int(tokens):12,d} {rss:11.0f} {float(seconds):8.1f} "
          f"{mb / float(seconds):6.2f}", flush=True)
    for f in files:
        f.unlink()
if len(points) > 1:
    (a, ra), (b, rb) = points[0], points[-1]
    print(f"slope: {(rb - ra) / (b - a) * 1024:.0f} MB of peak RSS per GB of text "
          f"(from {a} to {b} MB)")
print(f"this process: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MB")

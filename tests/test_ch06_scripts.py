"""Chapter 06's recipe beyond what the notebook runs: bad input of train_llama.py and corpus.py
(in this process, before any process group), the data cache (corpus.py), and a resume from a
checkpoint at the last step. The notebook (nbval) runs the recipe for real on 2 processes, on 1
process preempted by SIGTERM, and resumed on two rehearsal "nodes", and asserts the held-out
loss against the unigram baseline, the parity across world sizes and the export's loss."""
import json
import sys

import nbformat
import pytest
import torch

from conftest import CODE, ROOT, run_in_process, run_ok, run_papermill

sys.path.insert(0, str(CODE / "ch06_capstone"))
import corpus  # noqa: E402

SCRIPT = "ch06_capstone/train_llama.py"
NOTEBOOK = "06_capstone_llama_fsdp2.ipynb"


@pytest.mark.parametrize("args, env, message", [
    (["--batch-size", "0"], {}, "--batch-size, --micro-batch and --eval-every must be >= 1"),
    (["--batch-size", "24"], {"WORLD_SIZE": "2"}, "must be a multiple of 2 ranks x --micro-batch 8"),
    (["--vocab-size", "100"], {}, "--vocab-size must be >= 257"),
    (["--min-lr", "0.1"], {}, "need 0 <= --min-lr <= --lr"),
    (["--keep", "1"], {}, "--keep >= 2"),
    (["--text", "/no/such.txt"], {}, "--text: no such file /no/such.txt"),
    (["--model-path", "/no/such/model"], {}, "--model-path: no config.json in /no/such/model"),
    (["--eval-sequences", "0"], {}, "--eval-sequences must be >= 1"),
    (["--max-steps", "10"], {}, "--warmup must be less than --max-steps 10"),
    (["--cpu-offload"], {"COURSE_DEVICE": "cpu"}, "--cpu-offload needs a GPU"),
    (["--preset", "llama-70b"], {}, "invalid choice: 'llama-70b'"),
])
def test_bad_input_one_line_error(monkeypatch, capsys, args, env, message):
    status, _, err = run_in_process(monkeypatch, capsys, SCRIPT, *args, env=env)
    assert status == 2 and message in err.strip().splitlines()[-1]


def test_tensorboard_is_optional(monkeypatch, capsys):
    """--tensorboard without the package: one line that says what to install."""
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # as if not installed
    status, _, err = run_in_process(monkeypatch, capsys, SCRIPT, "--tensorboard")
    assert status == 2 and "pip install tensorboard" in err.strip().splitlines()[-1]


def test_corpus_cache(tmp_path, monkeypatch, capsys):
    folder = corpus.prepare(tmp_path, vocab_size=300, seq_len=64)
    facts = corpus.facts(folder)
    train, heldout = corpus.load(folder)
    assert facts["vocab_size"] == 300 and train.shape[1] == heldout.shape[1] == 64
    assert len(heldout) == (len(train) + len(heldout)) // 20  # every 20th sequence
    assert corpus.prepare(tmp_path, vocab_size=300, seq_len=64) == folder  # cached: same key
    assert corpus.prepare(tmp_path, vocab_size=300, seq_len=32) != folder  # another key
    # the unigram baseline is the held-out cross-entropy of add-one-smoothed training frequencies
    counts = torch.bincount(train.flatten().long(), minlength=300).double() + 1
    expected = -(counts / counts.sum()).log()[heldout[:, 1:].flatten().long()].mean()
    assert facts["unigram_loss"] == pytest.approx(expected.item())
    # --text: your files instead; a decoded sequence is text from them
    (tmp_path / "a.txt").write_text("the cat sat on the mat. " * 400)
    mine = corpus.prepare(tmp_path, vocab_size=300, seq_len=64, files=[tmp_path / "a.txt"])
    assert mine.name.startswith("text-")
    assert "cat sat on the mat" in corpus.tokenizer(mine).decode(corpus.load(mine)[0][0].tolist())
    status, _, err = run_in_process(monkeypatch, capsys, "ch06_capstone/corpus.py",
                                    "--vocab-size", "10")
    assert status == 2 and "--vocab-size >= 257" in err


def test_resume_from_the_last_step(tmp_path):
    """A job requeued after its last checkpoint (at the last step) resumes, trains nothing,
    and exports; no other run reaches that branch."""
    args = ["--data-dir", tmp_path / "data", "--out", tmp_path / "run", "--vocab-size", "300",
            "--seq-len", "32", "--batch-size", "4", "--micro-batch", "4", "--max-steps", "2", "--warmup", "1",
            "--eval-every", "2", "--save-every", "2", "--no-progress"]
    run_ok(1, SCRIPT, *args, timeout=120)
    rows = [json.loads(r) for r in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    proc = run_ok(1, SCRIPT, *args, "--resume", timeout=120)
    assert "resumed from step_000002: step 2 of 2" in proc.stdout
    assert "exported to" in proc.stdout
    again = [json.loads(r) for r in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert again == rows  # nothing trained, nothing logged twice


@pytest.mark.second_nproc
def test_notebook_at_three_processes(tmp_path):
    """The chapter at N = 3 (global batch 24, micro-batches of 4: 1, 2 and 3 ranks divide it)."""
    run_papermill(tmp_path, NOTEBOOK, "-p", "NPROC", "3", "-p", "BATCH", "24", "-p", "MICRO", "4")
    check_results(ROOT / "build" / "ch06")


def check_results(out) -> None:
    """What the notebook's runs logged (metrics.jsonl in `out`/a: NPROC processes; `out`/b: one
    process stopped by SIGTERM, then resumed on two "nodes"), at the notebook's default STEPS
    and PREEMPT_AT: the held-out loss falls more than 0.1 nats below the unigram baseline, the
    runs agree to float noise (1e-5 per step) before the preemption and within 5e-3 after it."""
    params = {}
    exec(nbformat.read(ROOT / "notebooks" / NOTEBOOK, as_version=4).cells[1].source, params)
    rows = {run: [json.loads(line) for line in (out / run / "metrics.jsonl").read_text()
                  .splitlines()] for run in ("a", "b")}
    train = {run: {r["step"]: r["loss"] for r in rs if "loss" in r} for run, rs in rows.items()}
    evals = {run: {r["step"]: r["eval_loss"] for r in rs if "eval_loss" in r}
             for run, rs in rows.items()}
    steps = list(range(1, params["STEPS"] + 1))
    assert [r["step"] for r in rows["b"] if "loss" in r] == steps == sorted(train["a"])
    assert evals["a"][params["STEPS"]] < rows["a"][0]["unigram_loss"] - 0.1
    before = range(1, params["PREEMPT_AT"] + 1)
    assert max(abs(train["a"][s] - train["b"][s]) for s in before) < 1e-5
    assert max(abs(train["a"][s] - train["b"][s]) for s in steps) < 5e-3
    assert sorted(evals["b"]) == sorted(evals["a"])
    assert max(abs(evals["a"][s] - evals["b"][s]) for s in evals["a"]) < 5e-3

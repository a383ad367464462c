"""Chapter 06's recipe beyond what the notebook runs: bad input of train_llama.py and corpus.py
(in this process, before any process group), the data cache (corpus.py), a compiled run resumed
from a checkpoint at its last step, and a fine-tune of its export with the cluster options, in
one 2-process launch that a NaN stops. The notebook (nbval) runs the recipe for real on 2 processes,
on 1 process preempted by SIGTERM, and resumed on two rehearsal "nodes", and asserts the
held-out loss against the unigram baseline, the parity across world sizes and the export's loss.
Every option in --help is passed by some run here or in the notebook (test_every_option_runs):
each launch costs ~15 CPU-s of imports, so the few launches pass many options at once."""
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
]


@pytest.mark.parametrize("args, env, message", BAD_INPUT)
def test_bad_input_one_line_error(monkeypatch, capsys, args, env, message):
    status, _, err = run_in_process(monkeypatch, capsys, SCRIPT, *args, env=env)
    assert status == 2 and message in err.strip().splitlines()[-1]


def test_tensorboard_is_optional(monkeypatch, capsys):
    """--tensorboard without the package: one line that says what to install."""
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # as if not installed
    status, _, err = run_in_process(monkeypatch, capsys, SCRIPT, "--tensorboard")
    assert status == 2 and "pip install tensorboard" in err.strip().splitlines()[-1]


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
    # --text: one piece per 1 KB line here; piece 19 (held out) has a word no other piece has,
    # and the BPE, trained before on the other pieces only, has no token for any part of it
    lines = ["the cat sat on the mat. " * 43 + "\n"] * 40
    lines[19] = "zyzzyva " * 130 + "\n"
    (tmp_path / "a.txt").write_text("".join(lines))
    mine = corpus.prepare(tmp_path, vocab_size=300, files=[tmp_path / "a.txt"])
    tok, (train, heldout) = corpus.tokenizer(mine), corpus.load(mine, 32)
    assert mine.name.startswith("text-")
    assert "cat sat on the mat" in tok.decode(train[0].tolist())
    assert "zyzzyva" in tok.decode(heldout[0].tolist())
    assert not [t for t in tok.get_vocab() if "zz" in t or "yv" in t]
    (tmp_path / "a.txt").write_text("".join(lines[:30]))  # changed: another size, another key
    assert corpus.cache_key([tmp_path / "a.txt"], 300, None) != mine.name.split("-")[1]
    status, _, err = run_in_process(monkeypatch, capsys, "ch06_capstone/corpus.py",
                                    "--vocab-size", "10")
    assert status == 2 and "--vocab-size >= 257" in err


def rows_of(folder):
    return [json.loads(r) for r in (folder / "metrics.jsonl").read_text().splitlines()]


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
    and exports; no other run reaches that branch."""
    tmp, args = exported
    rows = rows_of(tmp / "run")
    assert [r["step"] for r in rows] == [0, 1, 2] and rows[-1]["eval_loss"] < rows[0]["eval_loss"]
    proc = run_ok(1, SCRIPT, *args, "--resume", timeout=600)
    assert "resumed from step_000002: step 2 of 2" in proc.stdout
    assert "exported to" in proc.stdout
    assert rows_of(tmp / "run") == rows  # nothing trained, nothing logged twice


def test_fine_tune_with_cluster_options_until_a_nan(exported):
    """One 2-process launch: a fine-tune of the export (--model-path: its weights, config and
    tokenizer) on --text for a fifth of an epoch, with HSDP (2 replicas), selective AC,
    asynchronous saves at every step, bf16, no reshard after forward, a reduce-scatter per
    micro-batch and rows every 2 steps. A NaN injected into step 4's loss stops it before the
    optimizer step: exit status 3, named on stderr, no checkpoint of step 4, the step-3 one
    whole (its manifest), and the held-out loss had fallen (it learns the text)."""
    tmp, _ = exported
    (tmp / "mine.txt").write_text(("the cat sat on the mat. " * 43 + "\n") * 20)  # 20 pieces
    out = tmp / "tuned"
    proc = run_launcher(
        2, SCRIPT, "--model-path", tmp / "base", "--text", tmp / "mine.txt", "--data-dir",
        tmp / "data", "--out", out, "--seq-len", "32", "--batch-size", "8", "--micro-batch", "2",
        "--epochs", "0.2", "--warmup", "1", "--eval-every", "2", "--eval-sequences", "4",
        "--save-every", "1", "--keep", "2", "--no-progress", "--no-export", "--replicate", "2",
        "--ac", "selective", "--async-save", "--reshard-after-forward", "0", "--precision",
        "bf16", "--sync-every-microbatch", "--lr", "1e-3", "--min-lr", "1e-4",
        "--weight-decay", "0.05", "--betas", "0.9", "0.99", "--clip", "0.5", "--seed", "1",
        "--peak-tflops", "100", "--timeout", "120", "--log-every", "2",
        env={"TRAIN_LLAMA_NAN_AT_STEP": "4"}, timeout=600)
    assert proc.returncode != 0, proc.stdout
    assert ("non-finite loss nan or gradient norm nan at step 4: stopped without saving; newest "
            "good checkpoint: step_000003") in proc.stderr, proc.stderr
    assert "bf16" in proc.stdout and "HSDP: 2 replicas x 1 shards" in proc.stdout
    n = int(re.search(r"(\d+) training sequences", proc.stdout)[1])
    steps = round(0.2 * (n // 8))  # --epochs 0.2 of n // 8 steps
    assert steps > 4 and (f"this run: {steps} optimizer steps x 8 sequences = "
                          f"{steps * 8 / n:.3g} epoch(s)") in proc.stdout
    ckpt = CheckpointDir(out / "checkpoints")
    assert [p.name for p in ckpt.committed()] == ["step_000002", "step_000003"]
    assert ckpt.problem(ckpt.committed()[-1]) is None
    assert not list(ckpt.root.glob("*.tmp"))
    rows = rows_of(out)
    assert [r["step"] for r in rows] == [0, 2]  # --log-every 2: step 4 never logged
    assert math.isfinite(rows[1]["loss"]) and math.isfinite(rows[1]["grad_norm"])
    assert rows[1]["eval_loss"] < rows[0]["eval_loss"]  # it learns the cat
    assert not (out / "hf").exists()


# Options no run here can pass, and why (each still has its bad-input or message test)
NOT_RUN_HERE = {"--tensorboard": "needs the tensorboard package, not a course dependency"}


def test_every_option_runs(monkeypatch, capsys):
    """Every option in --help is passed by a run: a function of this file that launches the
    script (bad input does not count), a code cell of the notebook, or an entry of
    distkit/course/gpu_smoke.py's registry (GPU-only options, run by `make gpu-smoke`)."""
    _, usage, _ = run_in_process(monkeypatch, capsys, SCRIPT, "--help")
    options = set(re.findall(r"(--[a-z][-a-z0-9]*)", usage)) - {"--help"}
    here = Path(__file__).read_text()
    runs = [ast.get_source_segment(here, f) for f in ast.parse(here).body
            if isinstance(f, ast.FunctionDef)]
    runs = [src for src in runs if "run_ok(" in src or "run_launcher(" in src]
    nb = nbformat.read(ROOT / "notebooks" / NOTEBOOK, as_version=4)
    runs += [c.source for c in nb.cells if c.cell_type == "code"]
    runs += [(CODE / "distkit" / "course" / "gpu_smoke.py").read_text()]
    assert {"--replicate", "--ac", "--compile", "--async-save"} <= options
    never = sorted(o for o in options if not any(f'"{o}"' in src for src in runs))
    assert never == sorted(NOT_RUN_HERE)


@pytest.mark.second_nproc
def test_notebook_at_three_processes(tmp_path):
    """The chapter at N = 3 (global batch 24, micro-batches of 4: 1, 2 and 3 ranks divide it)."""
    run_papermill(tmp_path, NOTEBOOK, "-p", "NPROC", "3", "-p", "BATCH", "24", "-p", "MICRO", "4")
    check_results(ROOT / "build" / "ch06")


def check_results(out) -> None:
    """What the notebook's runs logged (metrics.jsonl in `out`/a: NPROC processes; `out`/b: one
    process stopped by SIGTERM, then resumed on two "nodes"), at the notebook's default STEPS
    and PREEMPT_AT: the held-out loss falls more than 0.1 nats below the unigram baseline, the
    runs agree to float noise (1e-5 per step) over the first steps and within 5e-3 over the run."""
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
    # float noise grows step after step (the notebook's section 6): 1e-5 for the first
    # SAVE_EVERY steps (at N=3 the gap reached 2.8e-5 by step 25; 5e-3 holds for the whole run)
    first = range(1, params["SAVE_EVERY"] + 1)
    assert max(abs(train["a"][s] - train["b"][s]) for s in first) < 1e-5
    assert max(abs(train["a"][s] - train["b"][s]) for s in steps) < 5e-3
    assert sorted(evals["b"]) == sorted(evals["a"])
    assert max(abs(evals["a"][s] - evals["b"][s]) for s in evals["a"]) < 5e-3


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

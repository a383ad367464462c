"""Chapter 06's standalone recipe (code/ch06_capstone/fsdp2_recipe.py: no distkit, one file) gives
the same losses as train_llama.py for the same settings, and resumes from its own checkpoint on
another world size; and what train_llama.py's defaults do, observed in its run.json (FSDP2's
reshard after forward: 2L + 1 all-gathers per micro-batch; one reduce-scatter per unit and step;
the clipped norm; AdamW's groups) and in its profiler traces (--profile-step: one per rank).

Budget: one 2-rank launch of each script at once (~10 CPU-s each, mostly imports), then a
1-rank resume of the recipe; the token cache is built in this process (pydoc, vocabulary 300)."""
import ast
import json
import shutil
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from conftest import CODE, run_in_process, run_launcher, run_ok
from test_ch06_scripts import INJECT

sys.path.insert(0, str(CODE / "ch06_capstone"))
import corpus  # noqa: E402
import guard  # noqa: E402

SETTINGS = ["--seq-len", "32", "--batch-size", "8", "--micro-batch", "2", "--max-steps", "6",
            "--warmup", "2", "--seed", "3"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("recipe")
    tokens = corpus.prepare(tmp / "data", 300)
    llama = ["ch06_capstone/train_llama.py", *SETTINGS, "--data-dir", tmp / "data",
             "--vocab-size", "300", "--out", tmp / "llama", "--eval-every", "6",
             "--eval-sequences", "4", "--no-progress", "--no-export", "--profile-step", "2"]
    recipe = ["ch06_capstone/fsdp2_recipe.py", *SETTINGS, "--tokens", tokens, "--out",
              tmp / "recipe", "--save-every", "3"]
    with ThreadPoolExecutor(2) as pool:  # both at once: 4 processes on 2 cores, mostly imports
        done = [pool.submit(run_ok, 2, *args, timeout=600) for args in (llama, recipe)]
        procs = [d.result() for d in done]
    return tmp, tokens, procs


def losses(path):
    return {r["step"]: (r["loss"], r["grad_norm"]) for r in map(json.loads, path.read_text()
                                                                .splitlines()) if "loss" in r}


def test_standalone_recipe_equals_train_llama(runs):
    """Same data order, weights, sharding, micro-batches, clipping, AdamW and schedule: the same
    losses and gradient norms at every step, to the last bit."""
    tmp, _, _ = runs
    ours, theirs = losses(tmp / "llama" / "metrics.jsonl"), losses(tmp / "recipe" / "losses.jsonl")
    assert sorted(ours) == sorted(theirs) == list(range(1, 7))
    assert ours == theirs


def test_standalone_recipe_resumes_on_another_world_size(runs):
    """Its DCP checkpoint of step 3 (2 ranks) loads on 1 rank, which trains steps 4-6 as the
    2-rank run did (float noise: another reduction order). The newest checkpoint, step 6's, has
    a truncated shard: it is reported and skipped, not the end of every resume."""
    tmp, tokens, _ = runs
    shutil.copytree(tmp / "recipe", tmp / "resumed")
    newest = tmp / "resumed" / "checkpoints" / "step_000006" / "__1_0.distcp"
    newest.write_bytes(newest.read_bytes()[:1000])  # truncated: the newest does not load
    (tmp / "resumed" / "losses.jsonl").unlink()
    proc = run_ok(1, "ch06_capstone/fsdp2_recipe.py", *SETTINGS, "--tokens", tokens, "--out",
                  tmp / "resumed", "--resume", timeout=600)
    assert "checkpoint step_000006: " in proc.stdout and "; skipped" in proc.stdout  # faults 6
    assert "resumed from step 3" in proc.stdout
    before = losses(tmp / "recipe" / "losses.jsonl")
    after = losses(tmp / "resumed" / "losses.jsonl")
    assert sorted(after) == [4, 5, 6]
    assert max(abs(before[s][0] - after[s][0]) for s in after) < 1e-5


@pytest.mark.second_nproc
def test_standalone_recipe_refuses_when_no_checkpoint_loads(runs):
    """faults.md 5b in the recipe: every checkpoint damaged (a truncated shard in step 6's, no
    .metadata in step 3's): --resume stops, naming each and why, and changes nothing."""
    tmp, tokens, _ = runs
    out = tmp / "damaged"
    shutil.copytree(tmp / "recipe", out)
    shard = out / "checkpoints" / "step_000006" / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[:1000])
    (out / "checkpoints" / "step_000003" / ".metadata").unlink()
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    proc = run_launcher(1, "ch06_capstone/fsdp2_recipe.py", *SETTINGS, "--tokens", tokens,
                        "--out", out, "--resume", timeout=600)
    assert proc.returncode == 1
    line = [ln for ln in proc.stderr.splitlines() if ln.startswith("fsdp2_recipe.py: --resume")]
    assert line and line[0].startswith("fsdp2_recipe.py: --resume: 2 checkpoint(s), none loads "
                                       "(step_000006: ") and line[0].endswith(
        "; step_000003: no .metadata (the save never finished)); nothing changed"), proc.stderr
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before


def test_defaults_observed(runs):
    """M6/C4: the defaults do what --help says. reshard_after_forward: each of the L = 4 layers
    is gathered again in backward, 2L + 1 = 9 all-gathers per micro-batch (the root stays
    gathered), 18 for A = 2; gradients reduce-scattered once per step, one per FSDP unit; the
    gradient norm clipped to --clip 1.0; AdamW's betas (0.9, 0.95), decay 0.1 on matrices only."""
    tmp, _, _ = runs
    info = json.loads((tmp / "llama" / "run.json").read_text())
    fsdp, micro = info["fsdp"], info["micro_batches"]
    assert (fsdp["reshard_after_forward"], fsdp["units"], fsdp["mesh"], micro,
            info["sync_every_microbatch"], fsdp["param_dtype"]) == (True, 5, [2], 2, False,
                                                                   "float32")
    layers = fsdp["units"] - 1
    counted = info["first_step"]["collectives"]
    assert counted["all_gather"] == micro * (2 * layers + 1) == 18
    assert counted["reduce_scatter"] == layers + 1
    assert info["first_step"]["grad_norm"] > 1.0
    assert info["first_step"]["grad_norm_clipped"] == pytest.approx(1.0, rel=1e-4)
    assert [(g["betas"], g["weight_decay"]) for g in info["adamw"]] == [([0.9, 0.95], 0.1),
                                                                         ([0.9, 0.95], 0.0)]


def test_profile_step_writes_a_trace_per_rank(runs):
    """--profile-step 2: a Chrome/Perfetto trace per rank, with FSDP's all-gathers in it (one
    per unit and micro-batch, as counted above) beside the matmuls."""
    tmp, _, _ = runs
    for rank in (0, 1):
        trace = json.loads((tmp / "llama" / "profile" / f"rank{rank}.pt.trace.json").read_text())
        names = [e["name"] for e in trace["traceEvents"] if e.get("ph") == "X"]
        layers = [n for n in names if n.startswith("FSDP::all_gather (model.layers.")]
        assert len(layers) == 2 * 2 * 4  # 2 micro-batches x (forward + backward) x 4 layers
        assert names.count("FSDP::all_gather") == 2  # the root's, once per micro-batch
        assert "aten::mm" in names


def test_standalone_recipe_never_saves_a_bad_update(runs, tmp_path):
    """The recipe a learner copies, with a fault from outside (the wrapper of
    test_ch06_scripts.py): rank 0's update of step 6, the last and a save step, writes a NaN into
    a weight. Only the next forward shows it, so the recipe saves step K in iteration K + 1,
    before that step's update, and checks the last step with one more forward and backward:
    step 6 is never saved, the newest checkpoint is step 3's, and --resume from it ends as the
    run without the fault did, to the last bit. The data order is drawn once per epoch, not at
    every step (a randperm of every sequence: gigabytes at pretraining scale)."""
    tmp, tokens, _ = runs
    (tmp_path / "inject.py").write_text(INJECT)
    args = [*SETTINGS, "--tokens", tokens, "--out", tmp_path / "run", "--save-every", "3"]
    env = {"CODE": str(CODE), "SCRIPT": "fsdp2_recipe.py"}
    bad = run_launcher(2, tmp_path / "inject.py", *args, timeout=600,
                       env={**env, "BAD_UPDATE_AT": "0:6", "RANDPERM_LOG": str(tmp_path / "perm")})
    assert bad.returncode == 1 and "non-finite loss or gradient norm at step 7" in bad.stderr
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["step_000003"]
    assert [(tmp_path / f"perm.{r}").read_text().count("\n") for r in (0, 1)] == [1, 1]
    proc = run_ok(2, "ch06_capstone/fsdp2_recipe.py", *args, "--resume", timeout=600)
    assert "resumed from step 3" in proc.stdout and "step 6: loss" in proc.stdout
    assert losses(tmp_path / "run" / "losses.jsonl") == losses(tmp / "recipe" / "losses.jsonl")
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == [
        "step_000003", "step_000006"]


@pytest.mark.parametrize("script", ["fsdp2_recipe.py", "train_llama.py"])
def test_an_older_torch_is_refused_in_one_line(monkeypatch, capsys, script):
    """A cluster's torch module is often older: on torch 2.4 (no torch.distributed.fsdp's
    fully_shard, no public DTensor yet) the scripts' first line must be their version check,
    not an ImportError traceback from an import above it."""
    import torch
    import torch.distributed.fsdp
    import torch.distributed.tensor
    monkeypatch.setattr(torch, "__version__", "2.4.1+cu121")
    monkeypatch.delattr(torch.distributed.fsdp, "fully_shard")
    monkeypatch.delattr(torch.distributed.tensor, "DTensor")
    for name in [m for m in sys.modules if m == "distkit" or m.startswith("distkit.")]:
        monkeypatch.delitem(sys.modules, name)  # imported again, from the old torch
    status, _, _ = run_in_process(monkeypatch, capsys, f"ch06_capstone/{script}", "--help")
    assert f"{script}: needs torch >= 2.11" in str(status)
    assert "this is" in str(status) and "2.4.1" in str(status)


def test_standalone_recipe_imports_only_torch_transformers_numpy():
    """The file a learner copies imports nothing of the course (no distkit, no corpus.py):
    every import is of the standard library, torch, transformers or numpy."""
    tree = ast.parse((CODE / "ch06_capstone" / "fsdp2_recipe.py").read_text())
    names = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import)
             for alias in node.names}
    names |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    tops = {name.split(".")[0] for name in names}
    assert tops - sys.stdlib_module_names == {"torch", "transformers", "numpy"}


@pytest.mark.parametrize("args, message", [
    (["--tokens", "/no/such"], "--tokens: no train.bin in /no/such"),
    (["--tokens", ".", "--batch-size", "6"], "--batch-size must be a multiple of 2 ranks"),
    (["--out", "{old}"], "--out {old} holds checkpoints: --resume continues that run"),
])
def test_recipe_bad_input(monkeypatch, capsys, tmp_path, args, message):
    """Bad input, and a run without --resume into an --out with checkpoints: a fresh run would
    write over them (and a crash mid-save would pair old metadata with new shards)."""
    (tmp_path / "checkpoints" / "step_000002").mkdir(parents=True)
    (tmp_path / "checkpoints" / "step_000002" / ".metadata").write_text("")
    (tmp_path / "train.bin").write_bytes(b"")
    args = [str(a).format(old=tmp_path) for a in ["--tokens", tmp_path, *args]]
    message = message.format(old=tmp_path)
    status, _, err = run_in_process(monkeypatch, capsys, "ch06_capstone/fsdp2_recipe.py", *args,
                                    env={"WORLD_SIZE": "2"})
    assert status == 2 and message in err.strip().splitlines()[-1]


def test_lr_schedule_itself():
    """M6 (mutations.md): train_llama.py's schedule, tested on its own (not only against
    fsdp2_recipe.py's copy, which a shared refactor would change alike): step 0 is at
    lr / warmup (not 0: an off-by-one warm-up), step warmup - 1 at the peak, the last step
    (max_steps - 1) at min_lr, the middle of the decay halfway, and no step outside
    [min_lr, lr]."""
    lr, low, warm, steps = 3e-3, 3e-4, 4, 20
    at = [guard.lr_at(s, lr, low, warm, steps) for s in range(steps)]
    assert at[:warm] == pytest.approx([lr / 4, lr / 2, 3 * lr / 4, lr], rel=1e-12)
    assert at[-1] == pytest.approx(low, rel=1e-12)
    mid = warm + (steps - 1 - warm) / 2  # 11.5: halfway through the decay, between 11 and 12
    assert guard.lr_at(mid, lr, low, warm, steps) == pytest.approx((lr + low) / 2, rel=1e-12)
    assert all(a >= b for a, b in zip(at[warm - 1:], at[warm:]))  # decays, never rises
    assert min(at[warm:]) >= low and max(at) == pytest.approx(lr, rel=1e-12)
    assert guard.lr_at(0, lr, low, 0, steps) == pytest.approx(lr)  # --warmup 0: peak at once

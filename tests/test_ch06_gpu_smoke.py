"""`make gpu-smoke` (code/distkit/course/gpu_smoke.py) without a GPU: it says so and exits 0; its
registry only names scripts and options that exist (a typo would surface first on a cluster)."""
import re
import subprocess
import sys

import pytest
import torch

from conftest import CODE, ROOT, launcher_env
from distkit.course import gpu_smoke
from distkit.course.notebook import _gpus_per_node


def test_no_gpu_skips_with_status_0():
    proc = subprocess.run([sys.executable, "-m", "distkit.course.gpu_smoke"], capture_output=True,
                          text=True, cwd=ROOT, env=launcher_env({"CUDA_VISIBLE_DEVICES": ""}),
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines() == ["gpu-smoke: no CUDA GPU: skipped"]
    dry = subprocess.run(["make", "-n", "gpu-smoke"], capture_output=True, text=True, cwd=ROOT)
    assert "-m distkit.course.gpu_smoke" in dry.stdout


def test_registry_names_real_scripts_and_options():
    names = [r.name for r in gpu_smoke.RUNS]
    assert len(set(names)) == len(names)
    chapters = {n.split()[0] for n in names}
    notebooks = {f"ch{p.name[:2]}" for p in (ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb")}
    assert chapters == notebooks  # every chapter's GPU path (08: one real step vs its plan)
    for run in gpu_smoke.RUNS:
        source = (CODE / run.script).read_text()
        ours = set(re.findall(r'add_argument\(\s*"(--[\w-]+)"', source))
        assert [a for a in run.args if a.startswith("--") and a not in ours] == [], run.name
    assert any(r.gpus >= 4 for r in gpu_smoke.RUNS)  # the 2-D meshes


def test_commands_are_launches(tmp_path):
    run = next(r for r in gpu_smoke.RUNS if r.name == "ch06 Llama bf16 + offload")
    cmd = gpu_smoke.command(run, 2, tmp_path)
    assert cmd[:3] == [str(CODE / "run_w_torchrun.sh"), "2", "ch06_capstone/train_llama.py"]
    assert "--cpu-offload" in cmd and f"{tmp_path}/run" in cmd


def test_rehearsal_nodes_get_their_own_gpus(monkeypatch):
    """launch_nodes: on a GPU machine each "node" sees its own block of GPUs (both would else
    take cuda:0 as LOCAL_RANK 0, and NCCL refuses); on CPU nothing is split."""
    monkeypatch.delenv("COURSE_DEVICE", raising=False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert _gpus_per_node(2, 1) == ["0", "1"] and _gpus_per_node(2, 2) == ["0,1", "2,3"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6")
    assert _gpus_per_node(3, 1) == ["4", "5", "6"]
    with pytest.raises(RuntimeError, match="needs 4 GPUs, this machine has 3"):
        _gpus_per_node(2, 2)
    monkeypatch.setenv("COURSE_DEVICE", "cpu")
    assert _gpus_per_node(2, 2) == []


def test_fit_runs_on_the_gpus_there_are(monkeypatch):
    """--fit on a 1-GPU machine: a 2-GPU run that allows it launches on 1 rank and says so; one
    that needs its ranks (a pipeline) is skipped; without --fit both are skipped."""
    launched = []

    def fake_run(cmd, **kw):
        launched.append(cmd)
        return subprocess.CompletedProcess(cmd, 0, stdout="", stderr="")
    monkeypatch.setattr(gpu_smoke.subprocess, "run", fake_run)
    ddp = next(r for r in gpu_smoke.RUNS if r.name == "ch01 DDP")
    pipe = next(r for r in gpu_smoke.RUNS if r.name == "ch02 pipeline")
    assert gpu_smoke.smoke(ddp, 1, 10)[0] == "SKIP" and launched == []
    assert gpu_smoke.smoke(pipe, 1, 10, fit=True)[0] == "SKIP" and launched == []
    verdict, why = gpu_smoke.smoke(ddp, 1, 10, fit=True)
    assert verdict == "PASS" and why.startswith("1 GPU(s) of 2 (--fit)")
    assert launched[0][1] == "1"
    assert gpu_smoke.smoke(ddp, 2, 10, fit=True)[1].startswith("2 GPU(s), ")

"""`make gpu-smoke` (code/distkit/gpu_smoke.py) without a GPU: it says so and exits 0; its
registry only names scripts and options that exist (a typo would surface first on a cluster)."""
import re
import subprocess
import sys

from conftest import CODE, ROOT, launcher_env
from distkit import gpu_smoke


def test_no_gpu_skips_with_status_0():
    proc = subprocess.run([sys.executable, "-m", "distkit.gpu_smoke"], capture_output=True,
                          text=True, cwd=ROOT, env=launcher_env({"CUDA_VISIBLE_DEVICES": ""}),
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines() == ["gpu-smoke: no CUDA GPU: skipped"]
    dry = subprocess.run(["make", "-n", "gpu-smoke"], capture_output=True, text=True, cwd=ROOT)
    assert "-m distkit.gpu_smoke" in dry.stdout


def test_registry_names_real_scripts_and_options():
    names = [r.name for r in gpu_smoke.RUNS]
    assert len(set(names)) == len(names)
    chapters = {n.split()[0] for n in names}
    assert chapters == {f"ch0{i}" for i in range(8)}  # ch08 plans on CPU: no GPU path
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

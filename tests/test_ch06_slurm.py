"""Chapter 06's Slurm template (code/ch06_capstone/train_llama.sbatch), without Slurm: the dry run
prints one torchrun command per node (node count, GPUs, rendezvous, job id, script), whose options
exist in the installed torchrun and in train_llama.py; options after the template's name reach
train_llama.py; the real path, with srun and scontrol stood in by scripts, runs that same command
and requeues a run that a signal stopped (OUT/stopped.json) however often, or that failed, up to a
cap of failures in a row without a new checkpoint, but not one the script marked as deterministic
(OUT/failed.json), and no stale marker of an earlier attempt decides. Bash only: no torch import,
no launch."""
import importlib.util
import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest

from conftest import CODE, ROOT

SBATCH = CODE / "ch06_capstone" / "train_llama.sbatch"
TRAIN = "code/ch06_capstone/train_llama.py"


def env_without_slurm(**extra) -> dict:
    """This environment without what would change the output (a Slurm allocation, thread
    settings, paths), plus `extra`."""
    drop = {"OMP_NUM_THREADS", "PYTHONPATH", "DRY_RUN", "OUT", "VIRTUAL_ENV"}
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") and k not in drop}
    return {**env, **extra}


def run(*args, cwd=ROOT, **env) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SBATCH), *args], capture_output=True, text=True,
                          cwd=cwd, env=env_without_slurm(**env), timeout=30)


def node_commands(stdout: str) -> dict[str, list[str]]:
    """node name -> the command it runs, from the dry run's 'node001: torchrun ...' lines."""
    return {m[1]: shlex.split(m[2]) for m in re.finditer(r"^(node\d+): (.*)$", stdout, re.M)}


def split(cmd: list[str]) -> tuple[dict[str, str], list[str]]:
    """torchrun's options (all '--name value') and the script's part (script path first)."""
    assert cmd[0] == "torchrun", cmd
    i = cmd.index(TRAIN)
    opts = cmd[1:i]
    return dict(zip(opts[::2], opts[1::2])), cmd[i:]


def test_syntax():
    proc = subprocess.run(["bash", "-n", str(SBATCH)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("env, nodes, job", [
    ({}, 2, "12345"), ({"SLURM_NNODES": "3", "SLURM_JOB_ID": "777"}, 3, "777")])
def test_dry_run_one_command_per_node(tmp_path, env, nodes, job):
    proc = run(cwd=tmp_path, DRY_RUN="1", **env)  # from any folder: paths stay repo-relative
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    cmds = node_commands(proc.stdout)
    assert list(cmds) == [f"node{i:03d}" for i in range(1, nodes + 1)]
    assert all(c == cmds["node001"] for c in cmds.values())  # every node runs the same command
    opts, script = split(cmds["node001"])
    grace = re.search(r"^grace=\(--shutdown-timeout (\d+)\)", SBATCH.read_text(), re.M)[1]
    assert opts == {"--nnodes": str(nodes), "--nproc-per-node": "8", "--rdzv-backend": "c10d",
                    "--rdzv-endpoint": "node001:29500", "--rdzv-id": job,
                    "--shutdown-timeout": grace}  # the template's value, checked below
    assert {"--preset", "--resume", "--save-every", "--out"} <= set(script)
    assert script[script.index("--replicate") + 1] == str(nodes)  # HSDP: a replica per node
    assert {"OMP_NUM_THREADS=8", "PYTHONPATH=code",
            "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"} <= set(
        proc.stdout.splitlines()[0].split())
    assert str(ROOT) not in proc.stdout and str(tmp_path) not in proc.stdout


def test_options_exist_where_they_are_used():
    """Every torchrun option is in the installed torch's torchrun, every option for the script
    is in train_llama.py's argparse; the agents' grace period ends before Slurm's time limit."""
    cmd = node_commands(run(DRY_RUN="1").stdout)["node001"]
    opts, script = split(cmd)
    torchrun = (Path(importlib.util.find_spec("torch").submodule_search_locations[0])
                / "distributed" / "run.py").read_text()  # found, not imported: no 2 s torch import
    missing = [o for o in opts if f'"{o}"' not in torchrun]
    # torch < 2.13 (make test-torch): its torchrun has no --shutdown-timeout; the template
    # then leaves it out at run time (the dry run shows 2.13's command)
    assert missing in ([], ["--shutdown-timeout"]) and (
        not missing or 'sys.exit("--shutdown-timeout" not in run.read_text())' in
        SBATCH.read_text())
    ours = set(re.findall(r'add_argument\("(--[\w-]+)"', (ROOT / TRAIN).read_text()))
    assert [o for o in script[1:] if o.startswith("--") and o not in ours] == []
    lead = int(re.search(r"^#SBATCH --signal=TERM@(\d+)$", SBATCH.read_text(), re.M)[1])
    assert int(opts["--shutdown-timeout"]) < lead


def test_extra_options_go_to_the_script():
    proc = run("--max-steps", "10", "--out", "/scratch/a b", DRY_RUN="1")
    for cmd in node_commands(proc.stdout).values():
        assert cmd[-4:] == ["--max-steps", "10", "--out", "/scratch/a b"]  # last: they win


@pytest.fixture
def fake_slurm(tmp_path):
    """srun and scontrol as scripts on PATH that record what they were asked to do; srun leaves
    the marker file $MARKER in OUT, as train_llama.py would, and commits the checkpoint folder
    $SAVED if set."""
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    (bin_ / "srun").write_text(
        '#!/bin/bash\nprintf "%s\\n" "$@" > "$LOG/srun"\n'
        '[[ -z "$MARKER" ]] || { mkdir -p "$OUT"; echo {} > "$OUT/$MARKER"; }\n'
        '[[ -z "$SAVED" ]] || mkdir -p "$OUT/checkpoints/$SAVED"\n'
        'exit "${SRUN_STATUS:-0}"\n')
    (bin_ / "scontrol").write_text('#!/bin/bash\ncase $1 in\n  show) printf "gpu%02d\\n" 1 2;;\n'
                                   '  requeue) echo "$2" >> "$LOG/requeue";;\nesac\n')
    for f in bin_.iterdir():
        f.chmod(0o755)
    slurm = {"PATH": f"{bin_}:{os.environ['PATH']}", "LOG": str(tmp_path),
             "SLURM_SUBMIT_DIR": str(ROOT), "SLURM_JOB_ID": "4242", "SLURM_NNODES": "2",
             "SLURM_JOB_NODELIST": "gpu[01-02]", "SLURM_CPUS_PER_TASK": "32",
             "SLURM_GPUS_ON_NODE": "4", "OUT": str(tmp_path / "out")}
    return tmp_path, slurm


# (marker left by an earlier attempt, marker this attempt leaves, failures in a row before it,
#  checkpoint it commits, its status, requeued?, failures in a row after it)
REQUEUE = [
    ("", "stopped.json", 0, "", 143, True, 0),   # stopped by the signal (and saved): queue it again
    ("", "stopped.json", 2, "step_000010", 1, True, 0),  # ... (torchrun says 1 after a stop)
    ("", "", 0, "", 0, False, 0),                # finished
    ("", "", 0, "", 1, True, 1),                 # failed: a GPU, a node, NCCL? retried (F3)
    ("", "", 2, "", 1, True, 3),                 # the third failure in a row: still retried
    ("", "", 3, "", 1, False, 3),                # the fourth without progress: give up
    ("", "", 3, "step_000010", 1, True, 1),      # ... but a failure after a new checkpoint
    ("", "failed.json", 0, "", 1, False, 0),     # non-finite: marked deterministic, not retried
    ("stopped.json", "", 0, "", 0, False, 0),    # an earlier attempt's marker does not decide (F2)
    ("failed.json", "", 0, "", 1, True, 1),      # ... either way
]


@pytest.mark.parametrize("stale, marker, before, saved, srun_status, requeued, after", REQUEUE)
def test_real_path_runs_srun_and_requeues(fake_slurm, stale, marker, before, saved, srun_status,
                                          requeued, after):
    """A chain of jobs that each stop at the time limit is requeued however long it is
    (SLURM_RESTART_COUNT 9 here); failures are retried up to MAX_FAILURES (3) in a row without a
    new checkpoint, and giving up says so."""
    tmp_path, slurm = fake_slurm
    out = tmp_path / "out"
    (out / "checkpoints" / "step_000005").mkdir(parents=True)  # where this attempt starts
    (out / "checkpoints" / "step_000008.tmp").mkdir()  # not committed: no progress
    (out / "requeue_failures").write_text(f"{before}\n")
    if stale:  # left by an earlier attempt that the job's script must not trust
        (out / stale).write_text('{"signal": "SIGTERM", "step": 7}')
    proc = run("--max-steps", "10", SLURM_RESTART_COUNT="9", SRUN_STATUS=str(srun_status),
               MARKER=marker, SAVED=saved, **slurm)
    assert proc.returncode == srun_status, proc.stderr
    args = (tmp_path / "srun").read_text().splitlines()
    assert args[:2] == ["--kill-on-bad-exit=1", "--cpus-per-task=32"]
    opts, script = split(args[2:])
    assert (opts["--nnodes"], opts["--nproc-per-node"], opts["--rdzv-endpoint"],
            opts["--rdzv-id"]) == ("2", "4", "gpu01:29500", "4242")
    assert script[-2:] == ["--max-steps", "10"] and str(out) in script
    assert (tmp_path / "requeue").exists() == requeued, proc.stderr
    assert int((out / "requeue_failures").read_text()) == after
    if requeued:
        assert (tmp_path / "requeue").read_text() == "4242\n"
        assert "requeued (restart 10)" in proc.stderr
    elif srun_status:  # a job that ends without a requeue says why
        assert "not requeued: " + ("OUT/failed.json" if marker else
                                   "3 failures in a row without a new checkpoint") in proc.stderr


def test_submitted_from_elsewhere_one_line_and_status_2(fake_slurm):
    tmp_path, slurm = fake_slurm
    proc = run(**{**slurm, "SLURM_SUBMIT_DIR": str(tmp_path)})
    assert proc.returncode == 2 and not (tmp_path / "srun").exists()
    assert proc.stderr.strip().splitlines() == [
        "train_llama.sbatch: submit it from the repository's root"]


def test_cluster_install_line_pins_the_courses_versions():
    """docs/cluster.md's install line for a cluster whose admins provide torch pins what the
    capstone imports (besides torch) at requirements.txt's versions: a bump of requirements.txt
    that the page misses fails here."""
    import re
    from conftest import ROOT
    pins = dict(re.findall(r"^([A-Za-z0-9_.-]+)==(\S+)$",
                           (ROOT / "requirements.txt").read_text(), re.M))
    line = next(ln for ln in (ROOT / "docs" / "cluster.md").read_text().splitlines()
                if ln.strip().startswith("pip install numpy=="))
    given = dict(re.findall(r"([A-Za-z0-9_.-]+)==(\S+)", line))
    assert set(given) == {"numpy", "psutil", "safetensors", "tokenizers", "tqdm", "transformers"}
    assert given == {name: pins[name] for name in given}

"""code/run_w_torchrun.sh: bad input fails fast with one line; good input runs every rank;
a failed run ends with a short summary; logs go to build/logs/, not to the temp dir; a stopped
launch (SIGTERM, an interrupted notebook cell) leaves no process behind."""
import os
import shutil
import signal
import subprocess
import time

import psutil
import pytest

from conftest import CODE, LAUNCHER, ROOT, free_port, launcher_env, run_launcher, run_ok


@pytest.mark.parametrize("args, reason", [
    ([], "expected NPROC and SCRIPT"),
    (["2"], "expected NPROC and SCRIPT"),
    (["0", "ch00_collectives/hello_torchrun.py"], "NPROC must be a positive integer, got '0'"),
    (["abc", "ch00_collectives/hello_torchrun.py"], "NPROC must be a positive integer, got 'abc'"),
    (["-1", "ch00_collectives/hello_torchrun.py"], "NPROC must be a positive integer"),
    (["2", "no_such_script.py"], "no such script"),
])
def test_bad_input_one_line_and_nonzero(args, reason):
    proc = run_launcher(*args, timeout=10)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert reason in lines[0] and "usage: run_w_torchrun.sh NPROC SCRIPT" in lines[0]
    assert proc.stdout == ""


def test_bad_multinode_env():
    proc = run_launcher(2, "ch00_collectives/hello_torchrun.py", env={"NNODES": "2"}, timeout=10)
    assert proc.returncode == 2 and "RDZV_ENDPOINT" in proc.stderr


@pytest.mark.parametrize("env, reason", [
    ({"RANKS": "all"}, "RANKS must list local ranks below NPROC=2, e.g. RANKS=0 or RANKS=0,1; "
                       "got 'all'"),
    ({"RANKS": "2"}, "got '2'"),  # torchrun would show nothing: local ranks are 0 and 1
    ({"RANKS": "0,"}, "got '0,'"),
    ({"RANKS": "-1"}, "got '-1'"),
    ({"SHUTDOWN_TIMEOUT": "soon"}, "SHUTDOWN_TIMEOUT must be a whole number of seconds"),
    ({"NNODES": "2", "RDZV_ENDPOINT": "127.0.0.1:1", "RDZV_TIMEOUT": "0"},
     "RDZV_TIMEOUT must be a positive number of seconds, got '0'"),
])
def test_bad_environment_one_line_and_exit_2(env, reason):
    """Knobs are checked before torchrun starts (it would answer RANKS=all with a traceback)."""
    start = time.monotonic()
    proc = run_launcher(2, "ch00_collectives/hello_torchrun.py", env=env, timeout=10)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and reason in proc.stderr, proc.stderr
    assert time.monotonic() - start < 5  # at once: no torch import


def test_ranks_accepts_what_torchrun_accepts(rank_script, tmp_path):
    proc = run_ok(2, rank_script, env={"RANKS": " 1", "LOG_DIR": str(tmp_path / "logs")})
    assert "rank=1" in proc.stdout and "rank=0" not in proc.stdout


def test_script_path_from_the_current_directory(rank_script, tmp_path):
    """A path relative to code/ first (as the course writes it), else to the current directory:
    `code/run_w_torchrun.sh 2 code/ch00_collectives/x.py` from the repo root is the same case."""
    proc = subprocess.run([str(LAUNCHER), "2", f"{tmp_path.name}/{rank_script.name}"],
                          cwd=tmp_path.parent, capture_output=True, text=True, timeout=180,
                          env=launcher_env({"LOG_DIR": str(tmp_path / "logs")}))
    assert proc.returncode == 0, proc.stderr
    assert sorted(proc.stdout.split())[2:] == ["rank=0", "rank=1"]
    missing = run_launcher(2, "code/no_such_script.py", timeout=10)
    assert missing.returncode == 2
    assert "no such script: code/no_such_script.py (looked in" in missing.stderr


def test_a_missing_node_is_reported_while_waiting_and_when_the_wait_ends(tmp_path):
    """One "node" of two: within seconds a line says what it waits for (torchrun alone is silent
    for its 600 s join timeout), and the timeout (RDZV_TIMEOUT) ends it in one line, exit 1."""
    port = free_port()
    proc = run_launcher(1, "ch00_collectives/hello_torchrun.py", timeout=120, env={
        "NNODES": "2", "RDZV_ENDPOINT": f"127.0.0.1:{port}", "RDZV_TIMEOUT": "6",
        "LOG_DIR": str(tmp_path)})
    assert proc.returncode == 1
    waiting, failed = proc.stderr.splitlines()
    assert waiting == (f"run_w_torchrun.sh: waiting for 2 nodes at 127.0.0.1:{port} (rendezvous "
                       f"id 'course', up to 6 s): start the same command on the other nodes")
    assert failed.startswith(f"run_w_torchrun.sh: the rendezvous at 127.0.0.1:{port} failed: "
                             "not all 2 nodes joined within 6 s; torchrun's report is in ")
    assert "RendezvousTimeoutError" in next(tmp_path.rglob("torchrun.log")).read_text()


@pytest.fixture
def hung_rank_1(tmp_path):
    """Every rank says it is up, then sleeps; rank 1 ignores SIGTERM, as a rank stuck in a
    collective or saving too long would: only torchrun's SIGKILL stops it."""
    script = tmp_path / "hung_rank_1.py"
    script.write_text("import os, signal, time\n"
                      "if os.environ['LOCAL_RANK'] == '1':\n"
                      "    signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
                      "print(f\"rank {os.environ['RANK']} up\", flush=True)\n"
                      "time.sleep(300)\n")
    return script


def wait_for_lines(stream, *wanted, timeout=120) -> str:
    """Read a process's output until every wanted line has been seen (the ranks are up)."""
    seen, deadline = "", time.monotonic() + timeout
    while not all(w in seen for w in wanted):
        assert time.monotonic() < deadline, f"never saw {wanted} in:\n{seen}"
        seen += stream.readline()
    return seen


def test_sigterm_stops_every_rank_within_the_shutdown_timeout(hung_rank_1, tmp_path):
    """torchrun passes SIGTERM on, waits SHUTDOWN_TIMEOUT for the ranks, SIGKILLs the hung one,
    says so in one line and exits 143; the message names the real timeout (it said "None").
    That torchrun got the timeout is read from its command line, not from a clock: a bound on
    the whole shutdown (once "< 30 s", the default timeout) failed 1 round in 3 of `make stress`
    with a make test beside it (31.6 s): under load torchrun's own exit takes that long."""
    proc = subprocess.Popen([str(LAUNCHER), "2", str(hung_rank_1)], text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env=launcher_env({"SHUTDOWN_TIMEOUT": "2", "LOG_DIR": str(tmp_path)}))
    try:
        wait_for_lines(proc.stdout, "rank 0 up", "rank 1 up")
        torchrun = psutil.Process(proc.pid)
        args, ranks = torchrun.cmdline(), torchrun.children()
        assert len(ranks) == 2
        proc.send_signal(signal.SIGTERM)
        start = time.monotonic()
        rest = proc.communicate(timeout=120)[0]
    finally:
        proc.kill()
    assert args[args.index("--shutdown-timeout") + 1] == "2", args
    assert proc.returncode == 128 + signal.SIGTERM
    assert rest == ("run_w_torchrun.sh: torchrun received SIGTERM, sent it to the ranks and "
                    "waited for them to exit (up to 2 s, then SIGKILL)\n")
    assert time.monotonic() - start >= 2  # rank 1 ignores SIGTERM: it waited, then killed it
    assert not psutil.wait_procs(ranks, timeout=5)[1]  # rank 1 too: only SIGKILL stops it


@pytest.mark.parametrize("who", ["process group", "kernel only"])
def test_an_interrupted_cell_stops_every_rank_and_says_so_in_one_line(hung_rank_1, tmp_path, who):
    """Interrupting a kernel during launch() (JupyterLab signals the kernel's process group, the
    launch included; `kill -INT` reaches the kernel alone) stops every rank, the hung one too,
    and the cell's error is one line, no traceback; the kernel lives on."""
    from jupyter_client.manager import KernelManager
    km = KernelManager(kernel_name="python3")
    km.start_kernel(env=launcher_env({"PYTHONPATH": str(CODE), "SHUTDOWN_TIMEOUT": "2",
                                      "LOG_DIR": str(tmp_path / "logs")}))
    kc = km.client()
    kc.start_channels()
    try:
        kc.wait_for_ready(timeout=60)
        msg_id = kc.execute("from distkit.course.notebook import launch\n"
                            f"launch(2, {str(hung_rank_1)!r})")
        out = ""
        while not ("rank 0 up" in out and "rank 1 up" in out):
            msg = kc.get_iopub_msg(timeout=120)
            out += msg["content"].get("text", "") if msg["msg_type"] == "stream" else ""
        kernel = psutil.Process(km.provisioner.process.pid)
        (torchrun,) = kernel.children()
        launch = [torchrun, *torchrun.children(recursive=True)]
        assert len(launch) == 3  # torchrun and its two ranks
        if who == "process group":
            km.interrupt_kernel()
        else:
            os.kill(kernel.pid, signal.SIGINT)
        after = []
        while True:
            msg = kc.get_iopub_msg(timeout=60)
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
                break
            if msg["msg_type"] in ("stream", "error", "execute_result", "display_data"):
                after.append(msg)
        reply = kc.get_shell_msg(timeout=10)
        while reply["parent_header"].get("msg_id") != msg_id:  # e.g. wait_for_ready's
            reply = kc.get_shell_msg(timeout=10)
        reply = reply["content"]
        assert reply["status"] == "error" and reply["ename"] == "Interrupted"
        assert [m["msg_type"] for m in after] == ["error"], [  # nothing else printed
            (m["msg_type"], m["content"].get("name"), m["content"].get("text")) for m in after]
        assert after[0]["content"]["traceback"] == ["interrupted: stopped 2 ranks"]
        assert not psutil.wait_procs(launch, timeout=5)[1]  # nothing of the launch is left
        assert km.is_alive()
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


def test_runs_every_rank_and_sets_threads(rank_script):
    proc = run_ok(2, rank_script, env={"OMP_NUM_THREADS": None})  # absolute path works too
    assert sorted(proc.stdout.split()) == ["omp=1", "omp=1", "rank=0", "rank=1"]


def test_keeps_omp_num_threads_when_set(rank_script):
    proc = run_ok(2, rank_script, env={"OMP_NUM_THREADS": "3"})
    assert proc.stdout.count("omp=3") == 2


def test_failure_ends_with_a_short_summary(tmp_path):
    proc = run_launcher(2, "ch00_collectives/collectives.py", "--op", "nope",
                        env={"LOG_DIR": str(tmp_path)})
    assert proc.returncode == 1  # torchrun's status
    lines = proc.stderr.splitlines()
    # each rank's own error (usage + error line), then the two-line summary; before the summary
    # existed, torchrun's ChildFailedError traceback made this ~45 lines
    assert len(lines) <= 8, proc.stderr
    # 1 or 2 ranks: torchrun stops the others as soon as one fails, so on a busy machine the
    # slower rank can be stopped before its argparse has printed anything
    assert sum("collectives.py: error: unknown --op nope" in ln for ln in lines[:-2]) in (1, 2)
    assert lines[-2].startswith("run_w_torchrun.sh: rank ")
    assert "failed first (exit code 2): collectives.py: error: unknown --op nope" in lines[-2]
    assert "exit status 1" in lines[-1] and str(tmp_path) in lines[-1]
    assert "ChildFailedError" not in proc.stderr and "Traceback" not in proc.stderr
    assert "elastic" not in proc.stderr and "[default" not in proc.stderr
    # torchrun's full report is kept in the run's log folder, next to every rank's stderr
    (run_dir,) = tmp_path.iterdir()
    assert "ChildFailedError" in (run_dir / "torchrun.log").read_text()
    assert [p.parent.name for p in sorted(run_dir.rglob("stderr.log"))] == ["0", "1"]


@pytest.fixture
def fail_on_rank_1(tmp_path):
    """Rank 1 raises once the process group is up; rank 0 waits (torchrun will stop it)."""
    script = tmp_path / "fail_on_rank_1.py"
    script.write_text("import time\n"
                      "import torch.distributed as dist\n"
                      "dist.init_process_group('gloo')\n"
                      "if dist.get_rank() == 1:\n"
                      "    raise ValueError('rank 1 says no')\n"
                      "time.sleep(60)\n")
    return script


def test_failure_summary_names_the_rank_that_raised(fail_on_rank_1, tmp_path):
    proc = run_launcher(2, fail_on_rank_1, env={"LOG_DIR": str(tmp_path / "logs")}, timeout=60)
    assert proc.returncode == 1
    # the learner's traceback stays; rank 0, stopped by torchrun, is not blamed
    assert 'fail_on_rank_1.py", line 5' in proc.stderr
    assert "rank 1 failed first (exit code 1): ValueError: rank 1 says no" in proc.stderr
    assert "rank 0 failed" not in proc.stderr and "SIGTERM" not in proc.stderr
    assert "ChildFailedError" not in proc.stderr
    assert len(proc.stderr.splitlines()) <= 8, proc.stderr


def test_failure_summary_when_only_rank_0_is_shown(fail_on_rank_1, tmp_path):
    """RANKS=0 hides rank 1's traceback; the summary still says what rank 1 raised."""
    proc = run_launcher(2, fail_on_rank_1, env={"RANKS": "0", "LOG_DIR": str(tmp_path / "logs")},
                        timeout=60)
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    assert "rank 1 failed first (exit code 1): ValueError: rank 1 says no" in proc.stderr


def test_ranks_filter_shows_rank_0_only(rank_script):
    proc = run_ok(2, rank_script, env={"RANKS": "0"})
    assert "rank=0" in proc.stdout and "rank=1" not in proc.stdout


def test_logs_go_to_build_not_to_the_temp_dir(rank_script, tmp_path):
    """torchrun alone leaves an empty torchelastic_* folder in the temp dir at every launch."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    logs = ROOT / "build" / "logs"
    before = set(logs.glob("*-show_env-*"))
    proc = run_ok(2, rank_script, env={"TMPDIR": str(tmp), "LOG_DIR": None})
    assert "[default" not in proc.stdout + proc.stderr  # --tee's tags stay off the console
    assert not list(tmp.glob("torchelastic_*"))
    (run_dir,) = set(logs.glob("*-show_env-*")) - before
    try:
        assert "rank=1" in next(run_dir.rglob("1/stdout.log")).read_text()
    finally:
        shutil.rmtree(run_dir)


def test_log_dir_keeps_per_rank_logs(rank_script, tmp_path):
    logs = tmp_path / "logs"
    run_ok(2, rank_script, env={"LOG_DIR": str(logs)})
    outs = sorted(logs.rglob("stdout.log"))
    assert [p.parent.name for p in outs] == ["0", "1"]
    assert "rank=1" in outs[1].read_text()


def test_two_nodes_through_c10d_rendezvous():
    """Two launcher invocations on one machine act as two nodes of one 4-rank process group."""
    env = {"NNODES": "2", "RDZV_ENDPOINT": f"127.0.0.1:{free_port()}", "RDZV_ID": "test"}
    node_a = subprocess.Popen([str(LAUNCHER), "2", "ch00_collectives/hello_torchrun.py"], text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              env=launcher_env(env))
    node_b = run_launcher(2, "ch00_collectives/hello_torchrun.py", env=env)
    out_a, err_a = node_a.communicate(timeout=120)
    assert node_a.returncode == 0 and node_b.returncode == 0, err_a + node_b.stderr
    out = out_a + node_b.stdout  # rank 0, on either node, prints every rank's line
    for r in range(4):
        assert f"[rank {r}] RANK={r}" in out
    assert out.count("WORLD_SIZE=4  LOCAL_WORLD_SIZE=2") == 4


def test_the_failure_summary_reads_the_last_attempt(tmp_path):
    """After restarts, the error comes from the newest attempt: attempt_10, not attempt_9 (which
    sorts last as text)."""
    from types import SimpleNamespace

    from distkit.course.torchrun import error_of
    for attempt in (9, 10):
        log = tmp_path / "run" / f"attempt_{attempt}" / "0" / "stderr.log"
        log.parent.mkdir(parents=True)
        log.write_text(f"ValueError: attempt {attempt}\n")
    assert error_of(tmp_path, 0, SimpleNamespace(message="")) == "ValueError: attempt 10"


def test_the_console_copy_keeps_a_line_written_at_the_last_moment(tmp_path):
    """torch's tail_logfile (what --tee copies the ranks' logs to the console with) loses a line
    the rank writes after its last read met the end of the file but before it sees `finished`
    (make stress: 'rank=1' missing once in ~400 launches under load). The interleaving, made
    deterministic: `finished` is set, and the line written, at the moment it is first asked."""
    import io

    from torch.distributed.elastic.multiprocessing import tail_log as torch_tail

    from distkit.course import torchrun

    class LastMoment:
        def __init__(self, log):
            self.log, self.asked = log, False

        def is_set(self):
            if not self.asked:
                self.asked = True
                self.log.write_text("rank=1\n")
            return True

    def shown(tail):
        log = tmp_path / f"{tail.__module__}.log"
        log.write_text("")
        out = io.StringIO()
        tail("[default1]:", str(log), out, LastMoment(log), 0.01, lambda line: True)
        return out.getvalue()

    assert torch_tail.tail_logfile is torchrun.tail_logfile  # the launch uses ours
    import importlib.util
    spec = importlib.util.find_spec("torch.distributed.elastic.multiprocessing.tail_log")
    original = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(original)  # torch's own, unpatched
    assert shown(original.tail_logfile) == ""  # the race, in torch's (fixed there: drop ours)
    assert shown(torchrun.tail_logfile) == "[default1]:rank=1\n"


# torch 2.13.0's tail_logfile, as ast.unparse prints it (comments and layout aside): the function
# distkit.course.torchrun replaces (see the test above for the race it has).
TORCH_TAIL_LOGFILE_SHA256 = "bac8dcef549c637f"


def test_torch_tail_logfile_is_the_one_we_replace():
    """distkit.course.torchrun swaps torch's tail_logfile for a copy without its race, by name
    (TailLog.start submits the module-level `tail_logfile`). If torch changes either, the copy may
    silently be wrong or unused: this test fails and says what to do."""
    import ast
    import hashlib
    import importlib.util

    spec = importlib.util.find_spec("torch.distributed.elastic.multiprocessing.tail_log")
    tree = ast.parse(open(spec.origin).read())
    fn = next((n for n in tree.body if isinstance(n, ast.FunctionDef)
               and n.name == "tail_logfile"), None)
    todo = ("re-read torch/distributed/elastic/multiprocessing/tail_log.py: if torch fixed the "
            "race "
            "(a line written between the last end-of-file read and the look at `finished` is "
            "lost), delete distkit.course.torchrun.tail_logfile and the line that installs it; "
            "else port the change into our copy and update TORCH_TAIL_LOGFILE_SHA256")
    assert fn is not None, f"torch's tail_log.py has no tail_logfile any more: {todo}"
    digest = hashlib.sha256(ast.unparse(fn).encode()).hexdigest()[:16]
    assert digest == TORCH_TAIL_LOGFILE_SHA256, f"torch's tail_logfile changed: {todo}"
    tail_log = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "TailLog")
    start = next(n for n in tail_log.body if isinstance(n, ast.FunctionDef) and n.name == "start")
    names = {n.id for n in ast.walk(start) if isinstance(n, ast.Name)}
    assert "tail_logfile" in names, f"TailLog.start no longer calls tail_logfile by name: {todo}"

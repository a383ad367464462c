"""torchrun as `code/run_w_torchrun.sh` runs it: the same launch, with a short failure report.

    python -m distkit.course.torchrun --log-dir RUN_DIR --tee 3 [TORCHRUN OPTIONS] SCRIPT [ARGS...]

takes torchrun's own arguments and differs from `torchrun` in five ways:
- the console shows each rank's output as the rank printed it: `--tee 3` keeps a copy of every
  rank's stdout/stderr under RUN_DIR, but torchrun would also tag each console line "[default0]:";
- torchrun's own log lines (closing signals, "failed (exitcode: 1)") go to RUN_DIR/torchrun.log;
- when a rank fails, two lines (which rank failed first, its error, where the logs are) replace
  torchrun's ~40-line ChildFailedError traceback, which goes to torchrun.log as well;
- when torchrun itself is stopped by a signal (SIGTERM: a preemption), one line says so
  instead of its SignalException traceback, and so does a rendezvous that fails (a node that
  never came) instead of its RendezvousError traceback;
- a multi-node launch still waiting for its nodes after a few seconds says so in one line
  (torchrun waits up to its join timeout, 600 s by default, in silence).
It is also about 0.6 s quicker a launch (1.7 -> 1.1 s for an empty 2-rank launch, measured): no
inspect.stack() in each rendezvous event, no random first-join delay on one node, and no
interpreter teardown once the ranks have exited.
As torchrun does (its main is decorated with @record), it copies the first failure's error file
to TORCHELASTIC_ERROR_FILE when that is set. The ranks' own error output (the traceback a
learner needs) stays on the console. Exit status is
torchrun's: 0, 1 when a rank failed, 128 + the signal's number when stopped by a signal.
"""
from __future__ import annotations

import logging
import os
import re
import signal
import sys
import threading
import time
import traceback
from pathlib import Path

from torch.distributed.elastic.multiprocessing import tail_log
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, get_error_handler
from torch.distributed.elastic.rendezvous import RendezvousError, RendezvousTimeoutError
from torch.distributed.elastic.rendezvous import dynamic_rendezvous
from torch.distributed.run import get_args_parser, run

TEE_TAG = re.compile(r"\[default\d+\]:")  # what --tee puts in front of every line it copies
# the line that says what went wrong: "ValueError: ...", "[rank1]: ValueError: ...", argparse's
# "script.py: error: ..."
ERROR_LINE = re.compile(r"(\[rank\d+\]: )?(\S*(Error|Exception|Interrupt)\b|\S+: error: )")


class Untagged:
    """A console stream without the tee's tags, flushed at every write so output stays live."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, text: str) -> int:
        tag = TEE_TAG.match(text)
        self.stream.write(text[tag.end():] if tag else text)
        self.stream.flush()
        return len(text)

    def __getattr__(self, name):
        return getattr(self.stream, name)



def tail_logfile(header, file, dst, finished, interval_sec, log_line_filter=None) -> None:
    """torch's tail_logfile (elastic/multiprocessing/tail_log.py: --tee copies each rank's log
    file to the console with it), less a race. torch's stops at the first end of file it meets
    after `finished` is set, so a line the rank wrote between that read and the check is never
    shown: seen under load (make stress), a rank's only line missing from the console. Here
    `finished` is read before each read: at an end of file met after it, the rank (it has
    exited) has nothing more to write."""
    while True:
        done = finished.is_set()
        if os.path.exists(file):
            break
        if done:
            return
        time.sleep(interval_sec)
    with open(file, errors="replace") as fp:
        while True:
            done = finished.is_set()
            line = fp.readline()
            if line:
                if log_line_filter and log_line_filter(line):
                    dst.write(f"{header}{line}")
            elif done:
                return
            else:
                time.sleep(interval_sec)


tail_log.tail_logfile = tail_logfile  # what TailLog.start() submits, for this launch


def method_name(depth=2):
    """torch's get_method_name (elastic/rendezvous/dynamic_rendezvous.py), which names the caller
    in each rendezvous event it records, less its cost: it calls inspect.stack() twice, which
    reads the source of every frame (measured: 0.3-0.5 CPU-s of a launch's agent)."""
    try:
        return sys._getframe(depth).f_code.co_name
    except ValueError:
        return "no_method_name"


dynamic_rendezvous.get_method_name = method_name


def error_of(run_dir: Path, local_rank: int, failure) -> str:
    """The failed rank's error: from its error file (scripts decorated with torch's @record),
    else the last error-looking line of its stderr log, else its last line (if any)."""
    if isinstance(failure.message, dict):
        return failure.message.get("message", "").strip()
    # the last attempt's (by number: attempt_10 sorts before attempt_9 as text)
    logs = sorted(run_dir.glob(f"*/attempt_*/{local_rank}/stderr.log"),
                  key=lambda log: int(log.parent.parent.name.removeprefix("attempt_")))
    lines = [ln for ln in logs[-1].read_text(errors="replace").splitlines() if ln.strip()] \
        if logs else []
    # an abort in C++ (SIGABRT) says why on a "what():" line; Python's faulthandler then adds
    # its dump of the stack and an "Extension modules: ..." line, which say nothing
    errors = [ln for ln in lines if ln.strip().startswith("what():")] or \
        [ln for ln in lines if ERROR_LINE.match(ln)]
    lines = lines[:next((i for i, ln in enumerate(lines) if ln.startswith("Extension modules")),
                        len(lines))]
    line = (errors or lines or ["nothing on its stderr"])[-1]
    return re.sub(r"^\[rank\d+\]: |^\s*what\(\):\s*", "", line).strip()


CALLER_STOPS = "DISTKIT_CALLER_STOPS"  # set by distkit.course.notebook.launch(): see main()
NOTICE_AFTER_S = 3  # a multi-node launch still waiting for its nodes then says so


def join_timeout(args) -> str:
    """Seconds a node waits for the others: --rdzv-conf join_timeout=S, else the c10d
    rendezvous's default (torch/distributed/elastic/rendezvous/dynamic_rendezvous.py)."""
    conf = dict(kv.split("=", 1) for kv in args.rdzv_conf.split(",") if "=" in kv)
    return conf.get("join_timeout", "600")


def notice_waiting(args, run_dir: Path, console, done: threading.Event) -> None:
    """Print one line if the ranks have not started NOTICE_AFTER_S seconds in: the nodes are
    still meeting (torchrun makes each attempt's log folder once the rendezvous is complete)."""
    if done.wait(NOTICE_AFTER_S) or any(run_dir.glob("*/attempt_*")):
        return
    print(f"run_w_torchrun.sh: waiting for {args.nnodes} nodes at {args.rdzv_endpoint} "
          f"(rendezvous id '{args.rdzv_id}', up to {join_timeout(args)} s): start the same "
          f"command on the other nodes", file=console, flush=True)


def shown(path: Path) -> str:
    """A path relative to the current directory when it is under it (shorter to read)."""
    return os.path.relpath(path) if path.resolve().is_relative_to(Path.cwd()) else str(path)


def older_torch(parser, argv: list[str]) -> list[str]:
    """argv without --shutdown-timeout S where torchrun's parser has no such option (torch
    2.11's, seen on a GPU machine)."""
    known = {o for action in parser._actions for o in action.option_strings}
    if "--shutdown-timeout" in known or "--shutdown-timeout" not in argv:
        return argv
    i = argv.index("--shutdown-timeout")
    return argv[:i] + argv[i + 2:]


def main(argv: list[str] | None = None) -> int:
    parser = get_args_parser()  # torchrun's own (torch.distributed.run.parse_args builds it)
    args = parser.parse_args(older_torch(parser, sys.argv[1:] if argv is None else argv))
    if not args.log_dir:
        sys.exit("distkit.course.torchrun: needs --log-dir DIR (torchrun's log and the ranks' "
                 "logs)")
    if getattr(args, "shutdown_timeout", None) is None:  # torchrun's default (launcher/api.py)
        args.shutdown_timeout = int(os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "30"))
    if os.environ.pop(CALLER_STOPS, None):
        # Launched by distkit.course.notebook.launch(): interrupting the kernel signals its whole
        # process
        # group, this process included, and the kernel then stops the launch itself (SIGTERM,
        # once) to count the ranks it stopped. A no-op handler, not SIG_IGN: the ranks, started
        # by exec, get the default back (an ignored signal would stay ignored in them).
        signal.signal(signal.SIGINT, lambda signum, frame: None)
        args.signals_to_handle = ",".join(s for s in args.signals_to_handle.split(",")
                                          if s.strip() != "SIGINT")
    run_dir = Path(args.log_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    torchrun_log = run_dir / "torchrun.log"
    handler = logging.FileHandler(torchrun_log)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    for name in ("torch.distributed.run", "torch.distributed.launcher",
                 "torch.distributed.elastic"):
        logger = logging.getLogger(name)
        logger.addHandler(handler)
        logger.propagate = False

    if args.standalone or args.nnodes == "1":
        # One node: nothing to skew. torch delays a node's first join by a random 0-0.3 s so
        # that many nodes don't reach the rendezvous's store at once.
        delay = dynamic_rendezvous._delay
        dynamic_rendezvous._delay = lambda seconds: None if isinstance(seconds, tuple) \
            else delay(seconds)
    console_err = sys.stderr
    started = threading.Event()
    if not args.standalone and args.nnodes != "1":
        threading.Thread(target=notice_waiting, args=(args, run_dir, console_err, started),
                         daemon=True).start()
    sys.stdout, sys.stderr = Untagged(sys.stdout), Untagged(sys.stderr)
    try:
        run(args)
    except ChildFailedError as e:
        with torchrun_log.open("a") as f:
            f.write(traceback.format_exc())  # what torchrun would have printed
        rank, failure = e.get_first_failure()
        if os.environ.get("TORCHELASTIC_ERROR_FILE") and failure.error_file != "<N/A>":
            # as torchrun's own main (decorated with @record) does: the root cause's error file
            # copied to the path the caller named (its error code: the rank's exit status)
            get_error_handler().dump_error_file(failure.error_file, failure.exitcode)
        how = (f"killed by {failure.signal_name()}" if failure.exitcode < 0
               else f"exit code {failure.exitcode}")
        print(f"run_w_torchrun.sh: rank {rank} failed first ({how}): "
              f"{error_of(run_dir, failure.local_rank, failure)}\n"
              f"run_w_torchrun.sh: exit status 1; every rank's logs and torchrun's report "
              f"(torchrun.log) are in {shown(run_dir)}/", file=console_err, flush=True)
        return 1
    except SignalException as e:  # SIGTERM & co. (a preemption): torchrun passed it on
        print(f"run_w_torchrun.sh: torchrun received {e.sigval.name}, sent it to the ranks and "
              f"waited for them to exit (up to {args.shutdown_timeout} s, then SIGKILL)",
              file=console_err, flush=True)
        return 128 + e.sigval  # the shell's convention for "ended by a signal"
    except RendezvousError as e:  # e.g. a node that never came: after the join timeout
        with torchrun_log.open("a") as f:
            f.write(traceback.format_exc())
        why = (f"not all {args.nnodes} nodes joined within {join_timeout(args)} s"
               if isinstance(e, RendezvousTimeoutError) else
               (str(e).strip().splitlines() or [type(e).__name__])[0])
        print(f"run_w_torchrun.sh: the rendezvous at {args.rdzv_endpoint} failed: {why}; "
              f"torchrun's report is in {shown(torchrun_log)}", file=console_err, flush=True)
        return 1
    finally:
        started.set()
        sys.stdout, sys.stderr = sys.stdout.stream, sys.stderr.stream
    return 0


if __name__ == "__main__":
    status = main()
    # Out without the interpreter's teardown of torch's modules (0.2-0.3 s a launch, measured),
    # on the path of everything that waits for a launch; the ranks have exited and the logs are
    # written, so nothing is left for it to do.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)

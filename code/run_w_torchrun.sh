#!/usr/bin/env bash
# run_w_torchrun.sh NPROC SCRIPT [ARGS...]
#
# Launch SCRIPT (a path relative to this code/ folder, to the current directory, or an absolute
# one) on NPROC processes with torchrun, and exit with torchrun's status (non-zero when any rank
# fails).
#
# Every run keeps each rank's stdout/stderr and torchrun's own log in build/logs/<run>/ (run =
# time-script-pid). When a rank fails, the ranks' errors show as usual and torchrun's 40-line
# ChildFailedError traceback is replaced by two lines: which rank failed first, its error, and
# where the logs are (distkit/course/torchrun.py does that; it takes torchrun's arguments).
#
# Single node (default): torchrun --standalone, which picks a free port, so two runs at
# the same time never clash.
#
# Environment knobs:
#   RANKS=0            show only these local ranks' output on the console (e.g. RANKS=0,1; each
#                      below NPROC)
#   MAX_RESTARTS=N     when a rank fails, stop the others and restart the whole group, up to N
#                      times (torchrun --max-restarts; each attempt sees TORCHELASTIC_RESTART_COUNT)
#   LOG_DIR=DIR        keep the logs in DIR/<run>/ instead of build/logs/<run>/ (each rank's in
#                      DIR/<run>/<torchrun's run id>/attempt_0/<local rank>/{stdout,stderr}.log)
#   OMP_NUM_THREADS    left alone if set; else cores / NPROC (at least 1), so ranks don't
#                      fight over the CPU
#   SHUTDOWN_TIMEOUT=S when torchrun is stopped (Ctrl-C, SIGTERM), it passes the signal on and
#                      waits S seconds for the ranks before it SIGKILLs them (default 30,
#                      torchrun's own; a notebook's launch() waits 10 s more, then kills the rest)
#   PYTHON             the Python whose torch to use (default: python3 on PATH)
#
# Multi-node (run the same command on every node; torchrun's c10d rendezvous assigns ranks):
#   NNODES=2           number of nodes
#   RDZV_ENDPOINT=H:P  host:port of the rendezvous, reachable from all nodes (e.g. node 0:29500)
#   RDZV_ID=job42      a job id shared by all nodes (default: course)
#   RDZV_TIMEOUT=S     seconds to wait for all nodes to join (default 600, torchrun's); a node
#                      still waiting after a few seconds says so in one line
# e.g. on each of two nodes:  NNODES=2 RDZV_ENDPOINT=node0:29500 ./run_w_torchrun.sh 8 train.py
set -euo pipefail

# Bad input: one line saying what is wrong and how to call, exit status 2.
die() { echo "run_w_torchrun.sh: $* (usage: run_w_torchrun.sh NPROC SCRIPT [ARGS...])" >&2; exit 2; }

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(dirname "$here")"
[[ $# -ge 2 ]] || die "expected NPROC and SCRIPT, got $# argument(s)"
nproc="$1"; script="$2"; shift 2
[[ "$nproc" =~ ^[1-9][0-9]*$ ]] || die "NPROC must be a positive integer, got '$nproc'"
# relative to code/ (as the course writes it), else to the current directory (a path completed
# by the shell from the repo root: code/ch00_collectives/x.py)
if [[ "$script" != /* ]]; then
  if [[ -f "$here/$script" ]]; then script="$here/$script"
  elif [[ -f "$script" ]]; then script="$PWD/$script"
  else die "no such script: $script (looked in $here/ and in $PWD/)"
  fi
fi
[[ -f "$script" ]] || die "no such script: $script"

if [[ -z "${OMP_NUM_THREADS:-}" ]]; then
  threads=$(( $(nproc 2>/dev/null || echo 1) / nproc ))
  export OMP_NUM_THREADS=$(( threads > 0 ? threads : 1 ))
fi
# Let scripts import the course's helper package wherever they live (code/, code/solutions/).
export PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}"


args=(--nproc-per-node "$nproc")
if [[ -n "${NNODES:-}" ]]; then
  [[ "$NNODES" =~ ^[1-9][0-9]*$ ]] || die "NNODES must be a positive integer, got '$NNODES'"
  [[ -n "${RDZV_ENDPOINT:-}" ]] || die "multi-node needs RDZV_ENDPOINT=host:port"
  args+=(--nnodes "$NNODES" --rdzv-backend c10d --rdzv-endpoint "$RDZV_ENDPOINT" --rdzv-id "${RDZV_ID:-course}")
  if [[ -n "${RDZV_TIMEOUT:-}" ]]; then
    [[ "$RDZV_TIMEOUT" =~ ^[1-9][0-9]*$ ]] || die "RDZV_TIMEOUT must be a positive number of seconds, got '$RDZV_TIMEOUT'"
    args+=(--rdzv-conf "join_timeout=$RDZV_TIMEOUT")
  fi
else
  # --local-addr: MASTER_ADDR reads localhost on every machine (torchrun would use the host's
  # fully qualified name, which differs from machine to machine)
  args+=(--standalone --local-addr localhost)
fi
if [[ -n "${RANKS:-}" ]]; then
  # what torchrun takes (comma-separated integers, spaces allowed), each a local rank that exists:
  # torchrun shows nothing for RANKS=5 and answers RANKS=all with a 20-line ValueError
  ranks_re='^ *[0-9]+ *(, *[0-9]+ *)*$'
  bad_ranks() { die "RANKS must list local ranks below NPROC=$nproc, e.g. RANKS=0 or RANKS=0,1; got '$RANKS'"; }
  [[ "$RANKS" =~ $ranks_re ]] || bad_ranks
  for r in ${RANKS//,/ }; do (( 10#$r < nproc )) || bad_ranks; done
  args+=(--local-ranks-filter "$RANKS")
fi
if [[ -n "${MAX_RESTARTS:-}" ]]; then
  [[ "$MAX_RESTARTS" =~ ^[0-9]+$ ]] || die "MAX_RESTARTS must be a non-negative integer, got '$MAX_RESTARTS'"
  args+=(--max-restarts "$MAX_RESTARTS")
  # A restarted group would meet in the failed group's key-value store (torchrun's, kept across
  # attempts), where the dead ranks' gloo/NCCL addresses are still written: a restarted rank can
  # read one and fail with "Connection refused" (measured here: 1 restart in 2; pytorch#135712).
  # With the store not shared, rank 0 hosts a new one on a new port at every attempt.
  export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
fi
# Stated, not left to torchrun's default: a caller that stops torchrun (a notebook's launch())
# must wait longer than this before it kills torchrun, or a rank that ignores the signal outlives
# it (the ranks run in sessions of their own).
shutdown="${SHUTDOWN_TIMEOUT:-30}"
[[ "$shutdown" =~ ^[0-9]+$ ]] || die "SHUTDOWN_TIMEOUT must be a whole number of seconds, got '$shutdown'"
args+=(--shutdown-timeout "$shutdown")
# Logs in the repo's build/ rather than an empty torchelastic_* folder in the temp dir per run;
# --tee 3: to the log files and to the console.
run_dir="${LOG_DIR:-$root/build/logs}/$(date +%Y%m%d-%H%M%S)-$(basename "$script" .py)-$$"
args+=(--log-dir "$run_dir" --tee 3)

# distkit.course.torchrun is torchrun (python -m torch.distributed.run) with the short failure report;
# going through $PYTHON runs the torch of the environment that called us (e.g. a notebook's
# kernel) even when its bin/ is not on PATH.
exec "${PYTHON:-python3}" -m distkit.course.torchrun "${args[@]}" "$script" "$@"

#!/usr/bin/env bash
# The torch engine (torch.distributed DDP): torchrun on one node, or on every node of a multi-node job with a
# c10d rendezvous. No Horovod is needed.
# shellcheck source-path=SCRIPTDIR
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=common.sh
source "$HERE/common.sh"

usage() {
  cat <<USAGE
usage: launch/torchrun.sh [--nproc-per-node N] [--nnodes N --rdzv-endpoint HOST:PORT [--rdzv-id ID]]
                          [--max-restarts N] --config FILE [--dry-run] [-- TRAINER_ARGS...]

  --nproc-per-node N       ranks on this node (default: the number of GPUs nvidia-smi lists, else of CPUs)
  --nnodes N               nodes in the job (default 1: a standalone job on this node); run the same command on
                           every node. A fixed N: elastic membership (MIN:MAX) is Horovod's (docs/elastic.md)
  --rdzv-endpoint HOST:PORT  the c10d rendezvous (one of the nodes, e.g. node1:29500); needed with --nnodes
  --rdzv-id ID             the job's id at the rendezvous (default \$SLURM_JOB_ID, else hybridtrain)
  --max-restarts N         torchrun --max-restarts (default 0): after a failure torchrun restarts every rank; add
                           '-- --resume auto' so that each restart continues from the last checkpoint
  --config FILE            hybridtrain recipe (YAML)
  --dry-run                print the command, do not run it
  -- ARGS                  passed to 'hybridtrain train'

Runs: torchrun [--standalone | --nnodes N --rdzv-backend=c10d --rdzv-endpoint E --rdzv-id ID]
      --nproc-per-node N --max-restarts R --no-python hybridtrain train --config FILE --engine torch ARGS
USAGE
}

nproc_per_node="" nnodes="1" endpoint="" rdzv_id="${SLURM_JOB_ID:-hybridtrain}" restarts="0" config=""
trainer_args=()
while [ $# -gt 0 ]; do
  case "$1" in
    -h | --help) usage; exit 0 ;;
    --nproc-per-node) need_value "$1" $#; nproc_per_node="$2"; shift 2 ;;
    --nnodes) need_value "$1" $#; nnodes="$2"; shift 2 ;;
    --rdzv-endpoint) need_value "$1" $#; endpoint="$2"; shift 2 ;;
    --rdzv-id) need_value "$1" $#; rdzv_id="$2"; shift 2 ;;
    --max-restarts) need_value "$1" $#; restarts="$2"; shift 2 ;;
    --config) need_value "$1" $#; config="$2"; shift 2 ;;
    --dry-run) DRY_RUN=1; shift ;;
    --) shift; trainer_args=("$@"); break ;;
    *) die "unknown argument '$1' (see --help)" ;;
  esac
done
[ -n "$config" ] || die "--config FILE is required (see --help)"
check_config "$config"
if [ -z "$nproc_per_node" ]; then local_rank_count --nproc-per-node; nproc_per_node="$LOCAL_RANKS"; fi
check_posint "--nproc-per-node" "$nproc_per_node"
[[ "$restarts" =~ ^[0-9]+$ ]] || die "--max-restarts must be a whole number, got '$restarts'"
if [[ "$nnodes" == *:* ]]; then
  die "--nnodes $nnodes: the torch engine trains on a fixed number of nodes (a mid-epoch checkpoint resumes on as many ranks): give --nnodes N, or use Horovod's elastic training (docs/elastic.md)"
fi
is_posint "$nnodes" || die "--nnodes must be a positive integer, got '$nnodes'"
if [ "$nnodes" = 1 ]; then
  [ -z "$endpoint" ] || die "--rdzv-endpoint is for a multi-node job: add --nnodes N, or drop it"
  where=(--standalone)
else
  [ -n "$endpoint" ] || die "--nnodes $nnodes needs --rdzv-endpoint HOST:PORT (one of the nodes, e.g. node1:29500)"
  [[ "$endpoint" =~ ^[^:[:space:]]+:[0-9]+$ ]] || die "--rdzv-endpoint must be HOST:PORT, got '$endpoint'"
  where=(--nnodes "$nnodes" --rdzv-backend=c10d --rdzv-endpoint "$endpoint" --rdzv-id "$rdzv_id")
fi
# torchrun's own end, made short. torchrun ends a failed job with its Python traceback and a ChildFailedError box
# (25-60 lines), and a SIGTERM to torchrun itself (a preemption) with a SignalException traceback and status 1.
# Here torchrun runs in a session of its own with TORCHELASTIC_ERROR_FILE set, so it copies the first failed rank's
# error file (hybridtrain's one line and that rank's status) there; its log lines, traceback and box are left out
# of stderr (the ranks' own lines pass), and one line ends the job with the rank's status: 2 bad input (no restart
# can fix it), 3 a rank died or hung (--resume auto continues), 1 a bug. A SIGTERM to this script goes to the
# ranks, which stop after the same step with a resumable checkpoint: status 0, as a preemption ends.
TORCHRUN_LOG='^[IWE][0-9][0-9][0-9][0-9] [0-9:.]+ +[0-9]+ .*(torch/distributed/|torchelastic)'

without_torchruns_block() {
  # drops torchrun's log lines, and its traceback when it ends in ChildFailedError (then the box to its last
  # '=' rule) or SignalException; any other traceback (a rank's) passes whole
  awk -v log_line="$TORCHRUN_LOG" '
    skip_box { if ($0 ~ /^=+$/ && ++rules == 2) skip_box = 0; next }
    held != "" {
      if ($0 ~ /^[ \t]/ || $0 ~ /^Traceback/) { held = held "\n" $0; next }
      if ($0 ~ /^torch\.distributed\.elastic\..*(ChildFailedError|SignalException)/) {
        held = ""; if ($0 ~ /ChildFailedError/) { skip_box = 1; rules = 0 }; next
      }
      print held; held = ""
    }
    $0 == "Traceback (most recent call last):" { held = $0; next }
    $0 ~ log_line { next }
    { print; fflush() }
    END { if (held != "") print held }'
}

# end_line STATUS ERROR_FILE STOPPED: the one line after torchrun, and the status to exit with
end_line() {
  local status="$1" file="$2" stopped="$3" code=""
  if [ "$status" = 0 ] && [ "$stopped" = 0 ]; then return 0; fi
  if [ -s "$file" ]; then
    code="$(grep -o '"errorCode": *-\{0,1\}[0-9]*' "$file" | grep -o -- '-\{0,1\}[0-9]*$' || true)"
    if grep -q 'SignalException' "$file"; then code="signal"; elif [ -z "$code" ]; then code="torchrun"; fi
  fi
  if [ "$status" != 0 ] && [ "$stopped" = 1 ] && [ "$code" != signal ]; then stopped=0; fi  # a failure after all
  case "$stopped:$code" in
    1:*) echo "launch: torchrun stopped on SIGTERM; the ranks checkpointed their place: rerun the same command with --resume auto" >&2; EXIT=0 ;;
    0:) echo "launch: error: torchrun: a rank ended without a line (killed by a signal, or out of memory?; torchrun status $status): see the lines above; --resume auto continues from the last checkpoint" >&2; EXIT="$status" ;;
    *:2) echo "launch: error: torchrun: the job refused its input (the line above says why; status 2): fix it and run again, a restart cannot" >&2; EXIT=2 ;;
    *:3) echo "launch: error: torchrun: a rank died or hung (the line above names it; status 3): rerun the same command with --resume auto" >&2; EXIT=3 ;;
    *:1) echo "launch: error: torchrun: a rank stopped on an unexpected error (the line above says where its traceback is; status 1)" >&2; EXIT=1 ;;
    *:signal) echo "launch: error: torchrun was stopped by a signal; the ranks' lines above say where they stopped: rerun the same command with --resume auto" >&2; EXIT=1 ;;
    *:torchrun) echo "launch: error: torchrun itself failed (its traceback above says why; status $status)" >&2; EXIT="$status" ;;
    *) echo "launch: error: torchrun: a rank ended with status $code (torchrun status $status): see the lines above" >&2; EXIT="$status" ;;
  esac
}

run_torchrun() {
  print_cmd "$@"
  [ "$DRY_RUN" != 1 ] || exit 0
  local dir pid filter status=0 stopped=0
  dir="$(mktemp -d "${TMPDIR:-/tmp}/hybridtrain-torchrun.XXXXXX")"
  mkfifo "$dir/stderr"
  without_torchruns_block <"$dir/stderr" >&2 &
  filter=$!
  TORCHELASTIC_ERROR_FILE="$dir/error.json" setsid "$@" 2>"$dir/stderr" &
  pid=$!
  # shellcheck disable=SC2064  # the pid is known now
  trap "stopped=1; pkill -TERM -P $pid || true" TERM
  # shellcheck disable=SC2064
  trap "kill -INT $pid 2>/dev/null || true" INT
  while true; do  # wait returns early for a trapped signal, with torchrun still running
    if wait "$pid"; then status=0; else status=$?; fi
    kill -0 "$pid" 2>/dev/null || break
  done
  trap - TERM INT
  wait "$filter" || true  # the ranks' last lines before the end line
  EXIT="$status"
  end_line "$status" "$dir/error.json" "$stopped"
  rm -rf "$dir"
  exit "$EXIT"
}

command -v torchrun >/dev/null || [ "$DRY_RUN" = 1 ] ||
  die "torchrun is not on PATH: activate the environment install.sh made (source .venv/bin/activate)"
run_torchrun torchrun "${where[@]}" --nproc-per-node "$nproc_per_node" --max-restarts "$restarts" --no-python \
  hybridtrain train --config "$config" --engine torch "${trainer_args[@]}"

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

default_nproc() {
  local gpus=0
  if command -v nvidia-smi >/dev/null; then gpus="$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)"; fi
  if [ "$gpus" -gt 0 ]; then echo "$gpus"; else nproc; fi
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
[ -n "$nproc_per_node" ] || nproc_per_node="$(default_nproc)"
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
command -v torchrun >/dev/null || [ "$DRY_RUN" = 1 ] ||
  die "torchrun is not on PATH: activate the environment install.sh made (source .venv/bin/activate)"

run_cmd torchrun "${where[@]}" --nproc-per-node "$nproc_per_node" --max-restarts "$restarts" --no-python \
  hybridtrain train --config "$config" --engine torch "${trainer_args[@]}"

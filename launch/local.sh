#!/usr/bin/env bash
# One node, N ranks: horovodrun -np N -H localhost:N (through launch/horovodrun.sh, same checks and output).
# shellcheck source-path=SCRIPTDIR
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=common.sh
source "$HERE/common.sh"

usage() {
  cat <<USAGE
usage: launch/local.sh [-np N] --config FILE [--start-timeout SEC] [--dry-run] [-- TRAINER_ARGS...]

  -np N                ranks on this machine (default: the number of GPUs nvidia-smi lists, else of CPUs)
  --config FILE        hybridtrain recipe (YAML)
  --start-timeout SEC  horovodrun --start-timeout (default 120)
  --dry-run            print the command, do not run it
  -- ARGS              passed to 'hybridtrain train'

Runs: horovodrun -np N -H localhost:N --start-timeout SEC hybridtrain train --config FILE ARGS
USAGE
}

np="" forward=()
while [ $# -gt 0 ]; do
  case "$1" in
    -h | --help) usage; exit 0 ;;
    -np | --np) need_value "$1" $#; np="$2"; shift 2 ;;
    --config | --start-timeout) need_value "$1" $#; forward+=("$1" "$2"); shift 2 ;;
    --dry-run) forward+=("$1"); shift ;;
    --) forward+=("$@"); break ;;
    *) die "unknown argument '$1' (see --help)" ;;
  esac
done
if [ -z "$np" ]; then local_rank_count -np; np="$LOCAL_RANKS"; fi
check_posint "-np" "$np"

# localhost needs no ssh: drop a port a container may set for its multi-node role.
HYBRIDTRAIN_SSH_PORT="" exec "$HERE/horovodrun.sh" --hosts "localhost:$np" -np "$np" "${forward[@]}"

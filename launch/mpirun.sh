#!/usr/bin/env bash
# Multi-node training with Open MPI's mpirun (Horovod's MPI controller): validates the hosts, -np and the
# config, prints the exact command ("+ mpirun ..."), then execs it.
# shellcheck source-path=SCRIPTDIR
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=common.sh
source "$HERE/common.sh"

# Environment forwarded to every rank: these names when set, plus every variable with these prefixes.
FORWARD_VARS=(PATH LD_LIBRARY_PATH PYTHONPATH)
FORWARD_PREFIXES=(NCCL_ HOROVOD_ UCX_)

usage() {
  cat <<USAGE
usage: launch/mpirun.sh (--hostfile FILE | --hosts h1:N,h2:N) -np N --config FILE [--ssh-port PORT]
                        [--bind-to WHAT] [--map-by WHAT] [--export VAR]... [--mpi-arg ARG]... [--allow-root]
                        [--dry-run] [-- TRAINER_ARGS...]

$(host_options_help)
  --bind-to WHAT       mpirun --bind-to (default socket; 'none' lets the OS place threads)
  --map-by WHAT        mpirun --map-by (default socket)
  --export VAR         forward VAR too (repeatable); always forwarded when set: ${FORWARD_VARS[*]} ${FORWARD_PREFIXES[*]/%/*}
  --mpi-arg ARG        one more mpirun argument, e.g. --mpi-arg=--mca --mpi-arg=btl_tcp_if_include --mpi-arg=eth0
  --allow-root         add --allow-run-as-root (containers running as root)
  --dry-run            print the command, do not run it
  -- ARGS              passed to 'hybridtrain train'

Runs: mpirun -np N -H HOSTS --bind-to WHAT --map-by WHAT [-x VAR]... hybridtrain train --config FILE ARGS
USAGE
}

hostfile="" hosts="" np="" config="" ssh_port="${HYBRIDTRAIN_SSH_PORT:-}" bind_to=socket map_by=socket
allow_root=0 exports=() mpi_args=() trainer_args=()
while [ $# -gt 0 ]; do
  take_host_option "$@"
  if [ "$TAKEN" -gt 0 ]; then shift "$TAKEN"; continue; fi
  case "$1" in
    -h | --help) usage; exit 0 ;;
    --bind-to) need_value "$1" $#; bind_to="$2"; shift 2 ;;
    --map-by) need_value "$1" $#; map_by="$2"; shift 2 ;;
    --export) need_value "$1" $#; exports+=("$2"); shift 2 ;;
    --mpi-arg) need_value "$1" $#; mpi_args+=("$2"); shift 2 ;;
    --mpi-arg=*) mpi_args+=("${1#--mpi-arg=}"); shift ;;
    --allow-root) allow_root=1; shift ;;
    --) shift; trainer_args=("$@"); break ;;
    *) die "unknown argument '$1' (see --help)" ;;
  esac
done

check_host_options
[ -n "$bind_to" ] || die "--bind-to needs a value such as socket, core or none"
[ -n "$map_by" ] || die "--map-by needs a value such as socket, slot or node"

cmd=(mpirun -np "$np" -H "$(hosts_csv)" --bind-to "$bind_to" --map-by "$map_by")
if [ "$allow_root" = 1 ]; then cmd+=(--allow-run-as-root); fi
if [ -n "$ssh_port" ]; then check_port "$ssh_port"; cmd+=(--mca plm_rsh_args "-p $ssh_port"); fi

# -x only for variables that are set: Open MPI warns about each missing one.
forward=()
for var in "${FORWARD_VARS[@]}"; do if [ -n "${!var+x}" ]; then forward+=("$var"); fi; done
for prefix in "${FORWARD_PREFIXES[@]}"; do
  while IFS= read -r var; do forward+=("$var"); done < <(compgen -e | grep "^$prefix" | LC_ALL=C sort || true)
done
for var in "${exports[@]}"; do
  [[ "$var" =~ ^[A-Za-z_][A-Za-z0-9_]*(=.*)?$ ]] || die "--export takes a variable name (or NAME=VALUE), got '$var'"
  forward+=("$var")
done
declare -A seen=()
for var in "${forward[@]}"; do
  if [ -z "${seen[$var]+x}" ]; then seen[$var]=1; cmd+=(-x "$var"); fi
done

cmd+=("${mpi_args[@]}" hybridtrain train --config "$config" "${trainer_args[@]}")
run_cmd "${cmd[@]}"

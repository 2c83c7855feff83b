#!/usr/bin/env bash
# Multi-node training with horovodrun (Gloo, or MPI when Horovod has it): validates the hosts, -np and the
# config, prints the exact command ("+ horovodrun ..."), then execs it.
# shellcheck source-path=SCRIPTDIR
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=common.sh
source "$HERE/common.sh"

usage() {
  cat <<USAGE
usage: launch/horovodrun.sh (--hostfile FILE | --hosts h1:N,h2:N) -np N --config FILE [--ssh-port PORT]
                            [--start-timeout SEC] [--network-interfaces NICS] [--dry-run] [-- TRAINER_ARGS...]

  --hostfile FILE      one host per line: "host slots=N" or "host:N"; '#' comments and blank lines allowed
  --hosts LIST         the same inline: h1:4,h2:4
  -np N                total ranks (at most the total slots)
  --config FILE        hybridtrain recipe (YAML)
  --ssh-port PORT      sshd port on every host (default \$HYBRIDTRAIN_SSH_PORT if set, else ssh's own)
  --start-timeout SEC  horovodrun --start-timeout (default 120)
  --network-interfaces NICS
                       interfaces for Gloo, e.g. ib0 (default \$HOROVOD_GLOO_IFACE if set, else horovodrun probes)
  --dry-run            print the command, do not run it
  -- ARGS              passed to 'hybridtrain train', e.g. -- --set train.epochs=5 --resume

Runs: horovodrun -np N -H HOSTS [-p PORT] --start-timeout SEC [--network-interfaces NICS]
                 hybridtrain train --config FILE ARGS
USAGE
}

hostfile="" hosts="" np="" config="" ssh_port="${HYBRIDTRAIN_SSH_PORT:-}" start_timeout=120
nics="${HOROVOD_GLOO_IFACE:-}"
trainer_args=()
while [ $# -gt 0 ]; do
  take_host_option "$@"
  if [ "$TAKEN" -gt 0 ]; then shift "$TAKEN"; continue; fi
  case "$1" in
    -h | --help) usage; exit 0 ;;
    --start-timeout) need_value "$1" $#; start_timeout="$2"; shift 2 ;;
    --network-interfaces) need_value "$1" $#; nics="$2"; shift 2 ;;
    --) shift; trainer_args=("$@"); break ;;
    *) die "unknown argument '$1' (see --help)" ;;
  esac
done

check_host_options
check_posint "--start-timeout" "$start_timeout"

cmd=(horovodrun -np "$np" -H "$(hosts_csv)")
if [ -n "$ssh_port" ]; then check_port "$ssh_port"; cmd+=(-p "$ssh_port"); fi
cmd+=(--start-timeout "$start_timeout")
if [ -n "$nics" ]; then cmd+=(--network-interfaces "$nics"); fi
cmd+=(hybridtrain train --config "$config" "${trainer_args[@]}")
run_cmd "${cmd[@]}"

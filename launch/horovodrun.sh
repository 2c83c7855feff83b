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
                            [--ssh-identity-file KEY] [--start-timeout SEC] [--network-interfaces NICS]
                            [--dry-run] [-- TRAINER_ARGS...]

$(host_options_help)
  --ssh-identity-file KEY
                       private key for ssh to the hosts (checked to exist)
  --start-timeout SEC  bound on ssh checks and the rendezvous: horovodrun --start-timeout (default 120)
  --network-interfaces NICS
                       interfaces for Gloo, e.g. ib0 (default \$HOROVOD_GLOO_IFACE if set, else horovodrun probes)
  --dry-run            print the command, do not run it
  -- ARGS              passed to 'hybridtrain train', e.g. -- --set train.epochs=5 --resume

Before running, every host other than this one must answer 'ssh HOST true' within 10 s (skipped with
--dry-run), so an unreachable host or a refused key is one line, not a hang.

Runs: horovodrun -np N -H HOSTS [-p PORT] [--ssh-identity-file KEY] --start-timeout SEC
                 [--network-interfaces NICS] hybridtrain train --config FILE ARGS
USAGE
}

hostfile="" hosts="" np="" config="" ssh_port="${HYBRIDTRAIN_SSH_PORT:-}" start_timeout=120 identity=""
nics="${HOROVOD_GLOO_IFACE:-}"
trainer_args=()
while [ $# -gt 0 ]; do
  take_host_option "$@"
  if [ "$TAKEN" -gt 0 ]; then shift "$TAKEN"; continue; fi
  case "$1" in
    -h | --help) usage; exit 0 ;;
    --start-timeout) need_value "$1" $#; start_timeout="$2"; shift 2 ;;
    --ssh-identity-file) need_value "$1" $#; identity="$2"; shift 2 ;;
    --network-interfaces) need_value "$1" $#; nics="$2"; shift 2 ;;
    --) shift; trainer_args=("$@"); break ;;
    *) die "unknown argument '$1' (see --help)" ;;
  esac
done

check_host_options
check_posint "--start-timeout" "$start_timeout"
if [ -n "$identity" ] && [ ! -f "$identity" ]; then die "ssh key not found: $identity (give an existing private key)"; fi

# check_ssh_reachable: one line naming the first host that ssh cannot reach non-interactively within 10 s.
check_ssh_reachable() {
  local entry host
  local -a ssh_cmd=(ssh -o BatchMode=yes -o ConnectTimeout=10 -o StrictHostKeyChecking=no)
  if [ -n "$ssh_port" ]; then ssh_cmd+=(-p "$ssh_port"); fi
  if [ -n "$identity" ]; then ssh_cmd+=(-i "$identity"); fi
  for entry in "${LAUNCH_HOSTS[@]}"; do
    host="${entry%:*}"
    case "$host" in localhost | 127.0.0.1 | "$(hostname)") continue ;; esac
    timeout 15 "${ssh_cmd[@]}" "$host" true </dev/null >/dev/null 2>&1 \
      || die "cannot reach $host over ssh${ssh_port:+ (port $ssh_port)}: check the host name, sshd and the key ('ssh${ssh_port:+ -p $ssh_port}${identity:+ -i $identity} $host true' must work without a password)"
  done
}

cmd=(horovodrun -np "$np" -H "$(hosts_csv)")
if [ -n "$ssh_port" ]; then check_port "$ssh_port"; cmd+=(-p "$ssh_port"); fi
if [ -n "$identity" ]; then cmd+=(--ssh-identity-file "$identity"); fi
cmd+=(--start-timeout "$start_timeout")
if [ -n "$nics" ]; then cmd+=(--network-interfaces "$nics"); fi
cmd+=(hybridtrain train --config "$config" "${trainer_args[@]}")
BEFORE_EXEC=check_ssh_reachable
run_cmd "${cmd[@]}"

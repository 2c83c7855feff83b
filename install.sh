#!/usr/bin/env bash
# One idempotent install step for hybridtrain: a virtual environment in .venv with torch, torchvision,
# Horovod 0.28.1 (built from source with the C++17 fix, cached), DALI, mpi4py and hybridtrain itself.
#
#   ./install.sh                   # CPU / Gloo (+ MPI when an MPI is installed)
#   HOROVOD_GPU_OPERATIONS=NCCL ./install.sh   # GPU clusters: NCCL all-reduce
#
# Environment knobs: HYBRIDTRAIN_VENV (default .venv), HYBRIDTRAIN_CACHE (default ~/.cache/hybridtrain),
# HYBRIDTRAIN_SKIP_DALI=1, PYTHON (default python3), HOROVOD_GPU_OPERATIONS, CUDA_HOME.
# The full log is in $VENV/install.log; the console shows one line per step.
set -euo pipefail

TORCH_VERSION="2.13.0"
TORCHVISION_VERSION="0.28.0"
HOROVOD_VERSION="0.28.1"
DALI_CUDA_MAJOR="${DALI_CUDA_MAJOR:-130}"

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
VENV="${HYBRIDTRAIN_VENV:-$ROOT/.venv}"
CACHE="${HYBRIDTRAIN_CACHE:-$HOME/.cache/hybridtrain}"
PYTHON="${PYTHON:-python3}"
mkdir -p "$CACHE"
LOG="$CACHE/install-$(date +%Y%m%d-%H%M%S)-$$.log"
STEP=0

step() { STEP=$((STEP + 1)); printf '[install %d] %s\n' "$STEP" "$*"; echo "=== $*" >>"$LOG"; }
fail() { printf 'install: error: %s\n' "$*" >&2; printf '  (full log: %s)\n' "$LOG" >&2; exit 1; }
run() { "$@" >>"$LOG" 2>&1; }

# pip from a clean configuration: a machine-wide find-links folder may offer a CPU-only torch wheel that
# the registry's torchvision cannot load its compiled ops with ("operator torchvision::nms does not exist").
registry_pip() { env -u PIP_FIND_LINKS PIP_CONFIG_FILE=/dev/null "$VENV/bin/python" -m pip "$@"; }

# Optional (HYBRIDTRAIN_SYSTEM_PACKAGES=1, root on Debian/Ubuntu): the compiler, cmake 3, OpenMPI, shellcheck,
# and iproute2 + openssh for the two-host test (horovodrun over ssh between network namespaces).
install_system_packages() {
  [ "${HYBRIDTRAIN_SYSTEM_PACKAGES:-0}" = 1 ] || return 0
  if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
    step "skipping system packages (needs root and apt-get)"; return 0
  fi
  local -a wanted=(g++ cmake libopenmpi-dev openmpi-bin shellcheck python3-venv iproute2 openssh-server openssh-client)
  local -a missing=()
  local p
  for p in "${wanted[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
  if [ ${#missing[@]} -eq 0 ]; then step "system packages present"; return 0; fi
  step "installing system packages: ${missing[*]}"
  run apt-get update -qq || fail "apt-get update failed"
  DEBIAN_FRONTEND=noninteractive run apt-get install -y -qq "${missing[@]}" || fail "apt-get install ${missing[*]} failed"
}

check_tools() {
  step "checking tools (python, compiler, cmake)"
  command -v "$PYTHON" >/dev/null || fail "python3 not found: install Python >= 3.9 (Debian: apt-get install python3 python3-venv python3-dev)"
  "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 9))' || fail "Python >= 3.9 is required, found $("$PYTHON" --version 2>&1)"
  "$PYTHON" -c 'import venv, ensurepip' 2>/dev/null || fail "Python's venv module is missing: apt-get install python3-venv"
  command -v g++ >/dev/null || fail "no C++ compiler for the Horovod build: apt-get install g++ (or build-essential)"
  command -v cmake >/dev/null || fail "cmake not found for the Horovod build: apt-get install cmake (3.13 to 3.x; cmake 4 rejects Gloo)"
  local cmake_major
  cmake_major="$(cmake --version | head -n1 | sed -E 's/[^0-9]*([0-9]+)\..*/\1/')"
  [ "$cmake_major" -lt 4 ] || fail "cmake $(cmake --version | head -n1 | awk '{print $3}') is too new for Gloo's cmake_minimum_required: use cmake 3.x (Debian: apt-get install cmake; pip: 'cmake<4')"
}

make_venv() {
  if [ -x "$VENV/bin/python" ]; then step "virtual environment $VENV exists"; return; fi
  step "creating virtual environment $VENV"
  run "$PYTHON" -m venv "$VENV" || fail "could not create $VENV: see the log"
  run registry_pip install --upgrade pip || fail "could not upgrade pip in $VENV"
}

torch_ok() {
  "$VENV/bin/python" - <<EOF >>"$LOG" 2>&1
import torch, torchvision, torchvision.ops
assert torch.__version__.split("+")[0] == "$TORCH_VERSION", torch.__version__
assert torchvision.__version__.split("+")[0] == "$TORCHVISION_VERSION", torchvision.__version__
torchvision.ops.nms(torch.zeros(1, 4), torch.zeros(1), 0.5)
EOF
}

install_torch() {
  if torch_ok; then step "torch $TORCH_VERSION and torchvision $TORCHVISION_VERSION already load their ops"; return; fi
  step "installing torch $TORCH_VERSION and torchvision $TORCHVISION_VERSION from the registry (about 1 min)"
  run registry_pip install "torch==$TORCH_VERSION" "torchvision==$TORCHVISION_VERSION" || fail "torch install failed: see the log"
  torch_ok || fail "torchvision's compiled ops do not load with this torch: run 'pip uninstall -y torch torchvision' in $VENV and re-run"
}

detect_mpi() { command -v mpicxx >/dev/null && command -v mpirun >/dev/null; }
detect_cuda() {
  local home="${CUDA_HOME:-/usr/local/cuda}"
  [ -x "$home/bin/nvcc" ] && echo "$home"
}

horovod_cache_key() {
  local torch_v py_v mpi gpu
  torch_v="$("$VENV/bin/python" -c 'import torch; print(torch.__version__)')"
  py_v="$("$VENV/bin/python" -c 'import sys; print("cp%d%d" % sys.version_info[:2])')"
  mpi=$(detect_mpi && echo mpi || echo nompi)
  gpu="${HOROVOD_GPU_OPERATIONS:-cpuops}"
  echo "horovod-${HOROVOD_VERSION}_torch-${torch_v}_${py_v}_${mpi}_${gpu}"
}

# The smallest fix for Horovod 0.28.1 with PyTorch >= 2.1 (upstream horovod#3996, #3941): build as C++17.
patch_cxx17() {
  local src="$1" f
  for f in "$src/CMakeLists.txt" "$src/horovod/torch/CMakeLists.txt"; do
    grep -q 'set(CMAKE_CXX_STANDARD 14)' "$f" || fail "unexpected Horovod source: no CMAKE_CXX_STANDARD 14 in $f"
    sed -i 's/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD 17)/' "$f"
    echo "  C++17 fix: $(grep -n 'CMAKE_CXX_STANDARD 17' "$f" | head -n1) in ${f#"$src"/}"
  done
}

build_horovod() {
  local wheel_dir="$1" src_dir cuda_home
  src_dir="$(mktemp -d)"
  step "building Horovod $HOROVOD_VERSION from source (several minutes, cached in $wheel_dir)"
  run registry_pip install psutil cloudpickle packaging pyyaml wheel setuptools \
    || fail "could not install Horovod's build requirements"
  run registry_pip download --no-deps --no-binary :all: "horovod==$HOROVOD_VERSION" -d "$src_dir" \
    || fail "could not download the horovod==$HOROVOD_VERSION source distribution"
  tar -xzf "$src_dir"/horovod-*.tar.gz -C "$src_dir"
  patch_cxx17 "$src_dir/horovod-$HOROVOD_VERSION" | tee -a "$LOG"
  local -a flags=(HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1
                  MAKEFLAGS="-j$(nproc)")
  if detect_mpi; then flags+=(HOROVOD_WITH_MPI=1); else flags+=(HOROVOD_WITHOUT_MPI=1); fi
  if cuda_home="$(detect_cuda)"; then flags+=(CUDA_HOME="$cuda_home" HOROVOD_CUDA_HOME="$cuda_home"); fi
  if [ -n "${HOROVOD_GPU_OPERATIONS:-}" ]; then
    [ -n "$cuda_home" ] || fail "HOROVOD_GPU_OPERATIONS=$HOROVOD_GPU_OPERATIONS needs the CUDA toolkit: set CUDA_HOME"
    flags+=(HOROVOD_GPU_OPERATIONS="$HOROVOD_GPU_OPERATIONS")
  fi
  echo "  build flags: ${flags[*]}" | tee -a "$LOG"
  mkdir -p "$wheel_dir"
  (cd "$src_dir/horovod-$HOROVOD_VERSION" && env "${flags[@]}" "$VENV/bin/python" -m pip wheel --no-build-isolation \
      --no-deps -w "$wheel_dir" .) >>"$LOG" 2>&1 || fail "Horovod build failed: $(grep -m1 -iE 'error:|fatal' "$LOG" | cut -c1-160)"
  rm -rf "$src_dir"
}

install_horovod() {
  local key wheel_dir
  key="$(horovod_cache_key)"
  wheel_dir="$CACHE/wheels/$key"
  if ! ls "$wheel_dir"/horovod-*.whl >/dev/null 2>&1; then build_horovod "$wheel_dir"; fi
  if "$VENV/bin/python" -c "import horovod.torch" >/dev/null 2>&1 && [ "$(cat "$VENV/.horovod-key" 2>/dev/null)" = "$key" ]; then
    step "Horovod $HOROVOD_VERSION ($key) already installed"; return
  fi
  step "installing Horovod $HOROVOD_VERSION from the cached wheel ($key)"
  run registry_pip install psutil cloudpickle packaging pyyaml || fail "could not install Horovod's requirements"
  run registry_pip install --no-deps --force-reinstall "$wheel_dir"/horovod-*.whl || fail "could not install the Horovod wheel"
  echo "$key" >"$VENV/.horovod-key"
}

install_rest() {
  step "installing numpy, DALI, mpi4py and hybridtrain (editable)"
  local -a extras=(dev)
  if [ "${HYBRIDTRAIN_SKIP_DALI:-0}" != 1 ]; then extras+=(dali); fi
  if detect_mpi; then extras+=(mpi); fi
  local spec
  spec="${ROOT}[$(IFS=,; echo "${extras[*]}")]"
  run registry_pip install -e "$spec" || fail "could not install $spec: see the log"
  torch_ok || fail "a dependency replaced torch or torchvision: see the log"
}

check_build() {
  step "horovodrun --check-build"
  "$VENV/bin/horovodrun" --check-build >>"$LOG" 2>&1 || fail "horovodrun --check-build failed"
  grep -A2 'Available Controllers' "$LOG" | tail -n 2 | tr -s ' \n' ' ' | sed 's/^/  controllers:/'; echo
  cp "$LOG" "$VENV/install.log"
  echo "install: ok ($VENV; log $VENV/install.log)"
}

install_system_packages
check_tools
make_venv
install_torch
install_horovod
install_rest
check_build

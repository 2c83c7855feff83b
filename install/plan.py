"""The torch build ``install.sh`` installs on this node: :func:`choose` (compute capabilities, driver version, torch
version or torch's CUDA) -> :class:`Plan`. docs/hardware.md is the table it encodes, with its sources.

``install.sh`` runs ``python -m install.plan plan`` (and ``probe-torch``, ``check-torch``) with
the system Python (no venv and no torch yet), so this module imports the standard library only; the GPU and driver
facts it shares with the rank's checks (hybridtrain.hardware.checks) are in hybridtrain.hardware.gpus. A tool of
the install, above the trainer (nothing of the package imports it).

May import: hybridtrain.hardware.gpus (standard library only, like this module).
"""
from __future__ import annotations

import os
import re
import shlex
import sys
from collections import Counter
from dataclasses import asdict, dataclass, field
from urllib.parse import urlsplit

from hybridtrain.hardware.gpus import (
    MIN_DRIVER,
    driver_api_version,
    driver_init_result,
    driver_name,
    driver_shortfall,
    generation,
    kernels_for,
    parse_capability,
    sm,
    version_tuple,
)

PINNED_TORCH = "2.13.0"         # install.sh's TORCH_VERSION (tests check they agree)
PINNED_TORCHVISION = "0.28.0"
OLDEST_TORCH = (2, 3)           # the oldest torch the code supports (docs/hardware.md says why)
# torch minor -> torchvision minor (0.x) of the same release; the patch releases pair too (torch 2.x.p with
# torchvision 0.(x+15).p: torchvision's README compatibility table, 2.1 to 2.10, and the pin 2.13.0/0.28.0)
TORCHVISION_MINOR = {(2, m): m + 15 for m in range(3, 16)}
PYTORCH_INDEX = "https://download.pytorch.org/whl"   # PyTorch's own wheel index: <index>/<variant>

# cuInit's answers when a forward-compatibility libcuda (cuda-compat) cannot run on this GPU or kernel driver
CUINIT_COMPAT_ERRORS = {803: "CUDA_ERROR_SYSTEM_DRIVER_MISMATCH", 804: "CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE"}
SM_50_TO_90 = ("sm_50", "sm_60", "sm_70", "sm_75", "sm_80", "sm_86", "sm_90")
SM_75_TO_120 = ("sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120")


@dataclass(frozen=True)
class Build:
    """One torch build: its CUDA, where it comes from ('' = the registry's default wheel), its kernels."""
    variant: str                 # cu130, cu126, cu121
    cuda: str                    # 13.0, 12.6, 12.1
    index: str                   # '' (the registry) or an index URL
    archs: tuple

    @property
    def min_driver(self) -> tuple:
        return MIN_DRIVER[int(self.cuda.split(".")[0])]


# The CUDA builds of a torch release that hybridtrain chooses from, preferred first (PyTorch's RELEASE.md and its
# CUDA-matrix RFCs, pytorch/pytorch#172352, #190355, #190385): (variant, CUDA, first and last torch minor, kernels)
BUILDS = (("cu130", "13.0", (2, 9), (2, 99), SM_75_TO_120), ("cu126", "12.6", (2, 6), (2, 14), SM_50_TO_90),
          ("cu121", "12.1", (2, 0), (2, 5), SM_50_TO_90))


def builds_for(torch_version: str) -> list[Build]:
    """The builds of :data:`BUILDS` for ``torch_version``, each from PyTorch's own index: the CUDA 13.0 build (the
    registry's default for the pin) for Turing and newer on r580+; the CUDA 12.6 build (2.6 to 2.14; Maxwell to
    Hopper, r525+); the CUDA 12.1 build for 2.3 to 2.5."""
    minor = version_tuple(torch_version)[:2]
    return [Build(variant, cuda, "" if variant == "cu130" and torch_version == PINNED_TORCH else
                  f"{PYTORCH_INDEX}/{variant}", archs) for variant, cuda, first, last, archs in BUILDS
            if first <= minor <= last]


# ----------------------------------------------------------------------------- small parsers


def parse_smi(text: str) -> tuple[list, str]:
    """``nvidia-smi --query-gpu=compute_cap,driver_version --format=csv,noheader`` -> ([capability per GPU],
    driver version). A line that is not 'X.Y, N.N' (an old driver that cannot report compute_cap says
    '[N/A]' or 'Field ... is not a valid field') is skipped; the driver is taken from any line that has one."""
    caps, driver = [], ""
    for line in text.splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) >= 2 and re.fullmatch(r"\d+(\.\d+)+", fields[1]):
            driver = fields[1]
        if fields and re.fullmatch(r"\d+\.\d+", fields[0]):
            caps.append(parse_capability(fields[0]))
    return caps, driver


SMI_TIMED_OUT = 124   # install.sh's exit status for an nvidia-smi that did not answer within its time limit


def smi_failure(text: str, status: int, timeout_s: str = "20", gpus: str = "") -> str:
    """The one line for an ``nvidia-smi`` that cannot say what this node has, else ''. ``text``: what the
    compute_cap/driver query printed (stdout and stderr); ``status``: its exit status (SMI_TIMED_OUT: killed after
    ``timeout_s`` seconds); ``gpus``: HYBRIDTRAIN_GPUS (nvidia-smi -i). Every fix named here works with
    nvidia-smi: CUDA_VISIBLE_DEVICES does not change what it lists, HYBRIDTRAIN_GPUS does."""
    first = next((line.strip() for line in text.splitlines() if line.strip()), "")
    others = "or install on another GPU node of this kind (the venv works on all of them)"
    if status == SMI_TIMED_OUT:
        return (f"nvidia-smi did not answer within {timeout_s} s: the NVIDIA driver on this node hangs (a GPU in an "
                f"error state: dmesg shows its Xid; or a driver still loading): have the node drained or rebooted, "
                f"{others}; where nvidia-smi is only slow (many GPUs, no persistence mode), raise "
                f"HYBRIDTRAIN_SMI_TIMEOUT (now {timeout_s})")
    caps, driver = parse_smi(text)
    if "Driver/library version mismatch" in text:
        return (f"nvidia-smi: '{first}': the NVIDIA driver was updated and this node still runs the old kernel "
                f"module: reboot the node (or have the admins reload the nvidia modules), {others}")
    if "No devices were found" in text:
        if gpus:
            return (f"nvidia-smi -i {gpus}: 'No devices were found': HYBRIDTRAIN_GPUS={gpus} names GPUs that "
                    f"nvidia-smi does not list: use indices from 'nvidia-smi -L', or unset it")
        return ("nvidia-smi finds no GPU ('No devices were found'): this job or container was given none: in a "
                "Slurm job ask for them (srun --gpus=N, or --gres=gpu:N), in a container pass them (docker run "
                "--gpus all, apptainer --nv); for an install without GPUs here, HYBRIDTRAIN_GPUS=none")
    if not caps and not driver and (status != 0 or first):
        return (f"nvidia-smi failed (exit {status}): '{first or 'no output'}': the NVIDIA driver does not answer on "
                f"this node: have it fixed (ask the admins), {others}; for an install without GPUs here, "
                f"HYBRIDTRAIN_GPUS=none")
    if driver and not driver_ok(driver, "12.0"):
        return ""   # too old to report compute_cap: choose() names the driver upgrade
    broken, healthy = broken_gpus(text, gpus)
    if broken:
        index, line = broken[0]
        state = ("ERR!: the GPU is in an error state" if "ERR!" in line else "the driver cannot read its compute "
                 "capability" if "N/A" in line or "Unknown Error" in line else "not a GPU's values")
        more = f"; {len(broken) - 1} more GPU(s) too" if broken[1:] else ""
        return (f"nvidia-smi reports GPU {index} as '{line}' ({state}{more}): the GPU has failed (dmesg shows its "
                f"Xid): have it reset (nvidia-smi -r -i {index}, as root) or "
                f"the node rebooted" + (f", or plan for the healthy GPUs only: HYBRIDTRAIN_GPUS={','.join(healthy)}"
                                        if healthy else f", {others}"))
    return ""


def broken_gpus(text: str, gpus: str = "") -> tuple[list[tuple[str, str]], list[str]]:
    """((nvidia-smi index, its line) of each GPU whose compute capability or driver field is not a value: 'ERR!'
    (the GPU is in an error state) or '[N/A]'/'[Unknown Error]' on a driver new enough to report it, the indices of
    the other GPUs). nvidia-smi's index of each GPU line of the query: lines in index order; with -i, the listed
    ones."""
    rows = [line.strip() for line in text.splitlines() if line.count(",") >= 1]
    listed = [g.strip() for g in gpus.split(",") if g.strip()] if gpus else []
    broken, healthy = [], []
    for index, line in zip(listed if len(listed) == len(rows) else [str(i) for i in range(len(rows))], rows):
        fields = [f.strip() for f in line.split(",")]
        if fields[0] == "-" or (re.fullmatch(r"\d+\.\d+", fields[0]) and re.fullmatch(r"\d+(\.\d+)+", fields[1])):
            healthy.append(index)  # a GPU's values, or install.sh's driver-only fallback line
        else:
            broken.append((index, line))
    return broken, healthy


def driver_ok(driver: str, cuda: str) -> bool:
    return version_tuple(driver) >= MIN_DRIVER.get(version_tuple(cuda)[0], (0,))


# ----------------------------------------------------------------------------- the install's choice

@dataclass
class Plan:
    """What install.sh installs on this node, and why (lines), or the one line saying why nothing fits."""
    torch: str = ""              # version to install ('' with HYBRIDTRAIN_TORCH=system)
    torchvision: str = ""
    variant: str = ""            # cu130, cu126, ... ('' = the registry's default, no GPU to fit)
    cuda: str = ""               # the CUDA of the chosen build ('' = whatever the registry's default has)
    index: str = ""              # '' = the registry; a URL or a wheel folder
    dali: str = ""               # 120 or 130 ('' = from torch's CUDA, as without a GPU)
    gpu_operations: str = ""     # Horovod: NCCL on a GPU node
    cc_list: str = ""            # HOROVOD_BUILD_CUDA_CC_LIST: this node's capabilities
    error: str = ""
    lines: list = field(default_factory=list)


def torchvision_for(torch_version: str) -> str:
    """The torchvision to install with ``torch_version``: the pin's, else its pairing's minor ('2.3.1' -> '0.18')."""
    return PINNED_TORCHVISION if torch_version == PINNED_TORCH else torchvision_pairing(torch_version).rsplit(".", 1)[0]


def torchvision_pairing(torch_version: str) -> str:
    """The torchvision release built against ``torch_version`` ('2.11.0+cu130' -> '0.26.0'; an NGC pre-release
    '2.3.0a0+6ddf5cf85e.nv24.04' -> '0.18.0'), or '' for a torch hybridtrain knows no torchvision for. What
    install.sh adds with --no-deps when HYBRIDTRAIN_TORCH=system finds a torch without torchvision."""
    v = version_tuple(torch_version)
    tv = TORCHVISION_MINOR.get(v[:2])
    if tv is None:
        return ""
    return f"0.{tv}.{v[2] if len(v) > 2 else 0}"


def check_torch_version(text: str) -> str:
    """'' when HYBRIDTRAIN_TORCH=<version> names a release hybridtrain supports, else the one line."""
    v = version_tuple(text)
    if len(v) < 2 or not re.fullmatch(r"\d+\.\d+(\.\d+)?", text):
        return (f"HYBRIDTRAIN_TORCH={text}: use pinned, system, or a torch version such as 2.14.1 "
                f"(2.{OLDEST_TORCH[1]} or newer)")
    if v[:2] < OLDEST_TORCH:
        return (f"HYBRIDTRAIN_TORCH={text}: torch {text} is older than 2.{OLDEST_TORCH[1]}, the oldest release "
                f"hybridtrain supports (docs/hardware.md): use 2.{OLDEST_TORCH[1]} or newer, or leave it unset "
                f"for torch {PINNED_TORCH}")
    if v[:2] not in TORCHVISION_MINOR:
        return (f"HYBRIDTRAIN_TORCH={text}: torch {text} is newer than any release hybridtrain knows "
                f"(2.{OLDEST_TORCH[1]} to 2.15): leave it unset for torch {PINNED_TORCH}")
    return ""


def check_system_torch(version: str) -> str:
    """'' when an installed torch (HYBRIDTRAIN_TORCH=system) is new enough, else the one line."""
    if version_tuple(version)[:2] >= OLDEST_TORCH:
        return ""
    return (f"HYBRIDTRAIN_TORCH=system: this Python's torch {version} is older than 2.{OLDEST_TORCH[1]}, the "
            f"oldest release hybridtrain supports (docs/hardware.md): upgrade it, or leave HYBRIDTRAIN_TORCH "
            f"unset for torch {PINNED_TORCH}")


def refusal_for(caps: list, driver: str, torch_version: str, builds: list[Build]) -> str:
    """Why no build of ``torch_version`` runs on this node, and what to install instead, in one line."""
    node = f"{', '.join(sorted({generation(c) for c in caps}))} with driver {driver or 'unknown'}"
    unserved = [c for c in caps if not any(kernels_for(c, b.archs) for b in builds)]
    if unserved:
        old = min(unserved)
        if old < (5, 0):
            return (f"no torch {torch_version} build has kernels for {generation(old)}: hybridtrain needs a GPU "
                    f"of compute capability 5.0 or newer (docs/hardware.md)")
        if old < (7, 5):
            return (f"torch {torch_version} has no build with kernels for {generation(old)} (its CUDA 13 builds "
                    f"start at sm_75, and PyTorch stopped the CUDA 12.6 build after 2.14): install with "
                    f"HYBRIDTRAIN_TORCH=2.14.1 (its CUDA 12.6 build), see docs/hardware.md")
        pinned_fits = torch_version != PINNED_TORCH and any(kernels_for(old, b.archs)
                                                            for b in builds_for(PINNED_TORCH))
        return (f"torch {torch_version} has no build with kernels for {generation(old)}: "
                + (f"leave HYBRIDTRAIN_TORCH unset for torch {PINNED_TORCH}, which has, or " if pinned_fits else "")
                + "install with HYBRIDTRAIN_TORCH=system from a Python whose torch has kernels for it (e.g. a "
                  "vendor image's), or HYBRIDTRAIN_TORCH_INDEX with such a build")
    fitting_kernels = [b for b in builds if all(kernels_for(c, b.archs) for c in caps)]
    if not fitting_kernels:
        return (f"no single torch {torch_version} build has kernels for every GPU of this node ({node}): the "
                f"CUDA 13 build starts at sm_75 and the CUDA 12 build stops at sm_90; install for the GPUs of one "
                f"kind, HYBRIDTRAIN_GPUS=<their indices in nvidia-smi -L>, and train on those "
                f"(CUDA_DEVICE_ORDER=PCI_BUS_ID CUDA_VISIBLE_DEVICES=<the same indices>)")
    need = min(b.min_driver for b in fitting_kernels)
    return (f"the NVIDIA driver {driver or '(unknown)'} is older than r{need[0]} ({driver_name(need)}), which "
            f"the torch {torch_version} build for {node.split(' with ')[0]} needs (CUDA "
            f"{min(fitting_kernels, key=lambda b: b.min_driver).cuda}): upgrade the driver to {driver_name(need)} "
            f"or newer")


def system_driver_check(torch_version: str, torch_cuda: str, driver: str, driver_api: int,
                        cuda_init: int = 0) -> tuple[str, str]:
    """HYBRIDTRAIN_TORCH=system: does the installed torch's CUDA run here? Decided as the trainer's
    :func:`check_node` decides, by ``driver_api``, the CUDA version of the driver library that torch's own
    process loads (cuDriverGetVersion: 13000 = 13.0). Under NVIDIA's forward compatibility (a CUDA 13 image on
    an r535-r570 data-centre driver, with cuda-compat's libcuda) that is newer than what nvidia-smi's kernel
    driver ``driver`` implies, and torch runs: then an older kernel driver is only a warning. ``cuda_init``:
    cuInit's result in that process (0: it initialised, or was not asked); 803/804 is forward compatibility
    refused on this GPU or driver. ``driver_api`` 0 (no libcuda answered, e.g. on a login node): nvidia-smi's
    driver decides. Returns (error, warning), each one line or ''."""
    need = MIN_DRIVER.get(version_tuple(torch_cuda)[0], (0,))
    fix = (f"upgrade the driver to r{need[0]} ({driver_name(need)}) or newer, or install torch's CUDA 12.6 build "
           f"(leave HYBRIDTRAIN_TORCH unset)")
    if driver_api <= 0:
        if driver and not driver_ok(driver, torch_cuda):
            return (f"HYBRIDTRAIN_TORCH=system: the installed torch {torch_version} is built for CUDA {torch_cuda}, "
                    f"which needs driver r{need[0]} ({driver_name(need)}) or newer, and this node has {driver}: "
                    f"upgrade the driver, or install torch's CUDA 12.6 build (leave HYBRIDTRAIN_TORCH unset)"), ""
        return "", ""
    short = driver_shortfall(driver_api, torch_cuda)
    if short:
        return (f"HYBRIDTRAIN_TORCH=system: {short} (nvidia-smi: driver {driver or 'unknown'}): "
                f"upgrade the driver to r{need[0]} ({driver_name(need)}) or newer (on a data-centre GPU, NVIDIA's "
                f"forward-compatibility package cuda-compat for CUDA {torch_cuda} also does), or install torch's "
                f"CUDA 12.6 build (leave HYBRIDTRAIN_TORCH unset)"), ""
    if not driver or driver_ok(driver, torch_cuda):
        return "", ""
    api = f"{driver_api // 1000}.{driver_api % 1000 // 10}"
    if cuda_init in CUINIT_COMPAT_ERRORS:
        return (f"HYBRIDTRAIN_TORCH=system: the installed torch {torch_version} is built for CUDA {torch_cuda}; the "
                f"driver library it loads reports CUDA {api} over the kernel driver {driver} (forward "
                f"compatibility), but cuInit refuses it here ({CUINIT_COMPAT_ERRORS[cuda_init]}: forward "
                f"compatibility runs only on data-centre GPUs, with a cuda-compat that matches the kernel driver): "
                f"{fix}"), ""
    return "", (f"warning: nvidia-smi's kernel driver {driver} is older than r{need[0]} ({driver_name(need)}), which "
                f"CUDA {torch_cuda} needs, but the driver library the installed torch loads supports CUDA {api} "
                f"(NVIDIA's forward compatibility, cuda-compat): torch runs on it, and the trainer checks it again "
                f"before it trains")


def choose(caps: list, driver: str, torch_version: str = PINNED_TORCH, torch_cuda: str = "",
           index: str = "", dali: str = "", gpu_operations: str | None = None, driver_api: int = 0,
           cuda_init: int = 0) -> Plan:
    """The torch build, DALI build and Horovod GPU operations for a node with GPUs of capabilities ``caps`` and
    driver ``driver`` (both from nvidia-smi; no GPU: ``caps == []``).

    ``torch_version``: the release to install; ``torch_cuda``: the CUDA of a torch that is already there
    (HYBRIDTRAIN_TORCH=system: nothing is chosen, its fit is checked, by ``driver_api`` and ``cuda_init`` when
    given: see :func:`system_driver_check`); ``index``: HYBRIDTRAIN_TORCH_INDEX; ``dali``: DALI_CUDA_MAJOR;
    ``gpu_operations``: HOROVOD_GPU_OPERATIONS as set (None: unset)."""
    plan = Plan(torch=torch_version, torchvision=torchvision_for(torch_version), gpu_operations=gpu_operations or "")
    # HYBRIDTRAIN_TORCH=system with a driver API version: the driver library torch loads decides, not nvidia-smi
    by_api = torch_cuda not in ("", "none") and driver_api > 0
    node = ", ".join(f"{n} x {generation(c)}" for c, n in sorted(Counter(caps).items()))
    plan.lines += [f"node: {node}, driver {driver or 'unknown'}"] if caps else []
    if driver and not driver_ok(driver, "12.0") and not by_api:  # without a GPU: too old to report compute_cap
        plan.error = (f"the NVIDIA driver {driver} is older than r525 (525.60.13), the oldest that any torch build "
                      f"hybridtrain installs runs on (CUDA 12): upgrade the driver (r580+ for CUDA 13)")
        return plan
    if not caps:
        what = "no NVIDIA GPU" + (f" (driver {driver} but no GPU compute capability reported)" if driver else "")
        plan.lines.append(f"node: {what}: the install is the one for CPUs")
    elif torch_cuda == "none":  # HYBRIDTRAIN_TORCH=system with a CPU build of torch
        plan.lines.append(f"torch: the installed torch {torch_version} is a CPU build (HYBRIDTRAIN_TORCH=system): "
                          f"this node's GPUs will not be used")
        plan.dali, plan.gpu_operations = dali, gpu_operations or ""
        return plan
    if torch_cuda:  # HYBRIDTRAIN_TORCH=system: check the installed torch against the node (without a GPU: by API)
        error, warning = (system_driver_check(torch_version, torch_cuda, driver, driver_api, cuda_init)
                          if caps or by_api else ("", ""))
        if error:
            plan.error = error
            return plan
        plan.cuda = torch_cuda if caps else ""
        plan.lines.append(f"torch: the installed torch {torch_version} (CUDA {torch_cuda}), HYBRIDTRAIN_TORCH=system")
        plan.lines += [warning] if warning else []
    elif not caps:
        plan.index = index
        plan.lines.append(f"torch {plan.torch} and torchvision {plan.torchvision} from "
                          f"{index or 'the registry'} (its default build)")
    else:
        builds = builds_for(torch_version)
        fits = [b for b in builds if all(kernels_for(c, b.archs) for c in caps) and
                (not driver or driver_ok(driver, b.cuda))]
        if not fits:
            plan.error = refusal_for(caps, driver, torch_version, builds)
            return plan
        build = fits[0]
        plan.variant, plan.cuda, plan.index = build.variant, build.cuda, index or build.index
        why = ""
        if build is not builds[0]:
            first = builds[0]
            lacks = [c for c in caps if not kernels_for(c, first.archs)]
            why = (f": the CUDA {first.cuda} build has no kernels for {sm(lacks[0])}" if lacks else
                   f": the CUDA {first.cuda} build needs driver r{first.min_driver[0]}+")
        source = ("your HYBRIDTRAIN_TORCH_INDEX " + index) if index else (
            "PyTorch's own wheel index " + build.index if build.index else "the registry (its default build)")
        plan.lines.append(f"torch {plan.torch} and torchvision {plan.torchvision}, the CUDA {build.cuda} build "
                          f"({build.variant}), from {source}{why}")
        host = "" if index else urlsplit(build.index).netloc  # PyTorch's index, or '' (the registry)
        if host:  # not the registry: a node that reaches only the registry (or nothing) cannot fetch it
            plan.lines.append(f"download: torch and torchvision come from {host}, not the registry: where this node "
                              f"cannot reach {host} (offline, or a registry mirror only), install with "
                              f"HYBRIDTRAIN_TORCH=system (a Python that has torch already, e.g. an image's) or "
                              f"HYBRIDTRAIN_TORCH_INDEX=DIR (a folder holding the {build.variant} wheels of torch "
                              f"{plan.torch} and torchvision {plan.torchvision})")
    if not caps:
        plan.dali = dali
        plan.lines.append(f"DALI: nvidia-dali-cuda{dali or '<torch CUDA major>0'} (its CPU operators)")
        plan.lines.append(f"Horovod: GPU operations {gpu_operations or 'none (Gloo, MPI on the CPU)'}")
        return plan
    cuda_major = version_tuple(plan.cuda)[0]  # the installed torch's, or the chosen build's
    plan.dali = dali or f"{cuda_major}0"
    dali_major = int(plan.dali) // 10
    cuda13_driver = driver_api >= 13000 if by_api else (not driver or driver_ok(driver, "13.0"))
    if dali_major >= 13 and (min(caps) < (7, 5) or not cuda13_driver):
        plan.error = (f"DALI_CUDA_MAJOR={plan.dali}: DALI's cuda130 build needs sm_75+ and driver r580+, and this "
                      f"node has {node}, driver {driver}: use DALI_CUDA_MAJOR=120, or leave it unset")
        return plan
    plan.lines.append(f"DALI: nvidia-dali-cuda{plan.dali}" + ("" if dali else f", to match torch's CUDA {cuda_major}"))
    plan.gpu_operations = gpu_operations if gpu_operations is not None else "NCCL"
    plan.cc_list = ",".join(sorted({f"{c[0]}{c[1]}" for c in caps}))
    nccl = f"a system NCCL, else torch's CUDA {cuda_major} NCCL wheel"
    plan.lines.append(f"Horovod: GPU operations {plan.gpu_operations or 'none'}"
                      + (" (a GPU node; set HOROVOD_GPU_OPERATIONS to change it)" if gpu_operations is None else "")
                      + (f", NCCL: {nccl}, kernels for HOROVOD_BUILD_CUDA_CC_LIST={plan.cc_list}"
                         if plan.gpu_operations == "NCCL" else ""))
    return plan


def shell_assignments(plan: Plan) -> str:
    """The plan as shell assignments, one per field (PLAN_TORCH, ..., PLAN_LINES: a line each), for install.sh's
    eval."""
    values = {**asdict(plan), "lines": "\n".join(plan.lines)}
    return "".join(f"PLAN_{key.upper()}={shlex.quote(value)}\n" for key, value in values.items())


def probe_torch() -> str:
    """What install.sh's plan needs from the torch of this Python (HYBRIDTRAIN_TORCH=system), as
    'version cuda driver_api cuinit torchvision': torch.__version__, torch.version.cuda ('none' for a CPU build),
    the driver API version and cuInit's result that this process gets from libcuda (what the trainer's check and
    torch itself see: forward compatibility's cuda-compat included; 0 0 without libcuda), and 'none' when
    torchvision is not installed ('present' otherwise; whether its ops load is install.sh's check). '' when no
    torch imports."""
    import importlib.util
    try:
        import torch
    except Exception:  # noqa: BLE001 - any failure to import is "no torch that imports"
        return ""
    cuda = torch.version.cuda or ""
    api = driver_api_version() if cuda else 0
    init = driver_init_result() if api > 0 else 0
    vision = "present" if importlib.util.find_spec("torchvision") is not None else "none"
    return f"{torch.__version__} {cuda or 'none'} {api} {init} {vision}"


# ----------------------------------------------------------------------------- install.sh's entry point

def int_or_zero(text: str) -> int:
    return int(text) if re.fullmatch(r"-?\d+", text) else 0


def main(argv: list[str]) -> int:
    """``plan``: read nvidia-smi's CSV from stdin (its exit status in PLAN_SMI_STATUS: see :func:`smi_failure`),
    the settings from the environment (HYBRIDTRAIN_TORCH, HYBRIDTRAIN_GPUS, HYBRIDTRAIN_SMI_TIMEOUT,
    HYBRIDTRAIN_TORCH_INDEX, DALI_CUDA_MAJOR, HOROVOD_GPU_OPERATIONS, and for HYBRIDTRAIN_TORCH=system
    PLAN_SYSTEM_TORCH, what ``probe-torch`` printed: 'version cuda [driver_api cuinit torchvision]'); print PLAN_*
    shell assignments. ``probe-torch``: see :func:`probe_torch`. ``check-torch VERSION``: the refusal line, if
    any."""
    if argv[:1] == ["check-torch"] and len(argv) == 2:
        line = check_torch_version(argv[1])
        print(line)
        return 1 if line else 0
    if argv == ["probe-torch"]:
        print(probe_torch())
        return 0
    if argv[:1] != ["plan"]:
        print("usage: python -m install.plan plan < nvidia-smi.csv | probe-torch | "
              "check-torch VERSION", file=sys.stderr)
        return 2
    smi = sys.stdin.read()
    gpus = os.environ.get("HYBRIDTRAIN_GPUS", "")
    failure = "" if gpus == "none" else smi_failure(smi, int_or_zero(os.environ.get("PLAN_SMI_STATUS", "0")),
                                                    os.environ.get("HYBRIDTRAIN_SMI_TIMEOUT") or "20", gpus)
    if failure:
        sys.stdout.write(shell_assignments(Plan(error=failure)))
        return 0
    caps, driver = parse_smi(smi)
    mode = os.environ.get("HYBRIDTRAIN_TORCH", "pinned") or "pinned"
    kwargs = {"index": os.environ.get("HYBRIDTRAIN_TORCH_INDEX", ""), "dali": os.environ.get("DALI_CUDA_MAJOR", ""),
              "gpu_operations": os.environ.get("HOROVOD_GPU_OPERATIONS")}
    if mode == "system":
        python = os.environ.get("PYTHON") or "python3"
        version, cuda, api, init, vision = (os.environ.get("PLAN_SYSTEM_TORCH", "").split() + [""] * 5)[:5]
        plan = choose(caps, driver, version, torch_cuda=cuda or "none", driver_api=int_or_zero(api),
                      cuda_init=int_or_zero(init), **kwargs)
        plan.torch = plan.torchvision = ""
        plan.error = (check_system_torch(version) if version else
                      f"HYBRIDTRAIN_TORCH=system: {python} has no torch that imports: "
                      f"install torch (2.{OLDEST_TORCH[1]} or newer) for it, or leave HYBRIDTRAIN_TORCH unset for "
                      f"torch {PINNED_TORCH}") or plan.error
        if version and vision == "none" and not plan.error:
            # install.sh adds the torchvision release paired with that torch (torchvision_pairing) with --no-deps, so
            # that the torch stays the installed one, and then checks that its ops load
            plan.torchvision = torchvision_pairing(version)
            if not plan.torchvision:
                plan.error = (f"HYBRIDTRAIN_TORCH=system: {python} has torch {version} and no torchvision, and "
                              f"hybridtrain knows no torchvision release for that torch: install torchvision for "
                              f"{python}, or leave HYBRIDTRAIN_TORCH unset for torch {PINNED_TORCH}")
            else:
                at = next((i + 1 for i, text in enumerate(plan.lines) if text.startswith("torch: ")), len(plan.lines))
                plan.lines.insert(at, f"torchvision: {python} has none: torchvision {plan.torchvision}, the release "
                                      f"paired with torch {version}, is installed into the venv with --no-deps (the "
                                      f"torch stays the installed one) from the wheelhouse or the registry, and must "
                                      f"load its ops with that torch")
    else:
        plan = choose(caps, driver, PINNED_TORCH if mode == "pinned" else mode, **kwargs)
    if gpus and plan.lines and plan.lines[0].startswith("node: "):
        plan.lines[0] += (" (HYBRIDTRAIN_GPUS=none: nvidia-smi not asked)" if gpus == "none" else
                          f" (HYBRIDTRAIN_GPUS={gpus}: nvidia-smi -i {gpus})")
    wheelhouse = os.environ.get("HYBRIDTRAIN_WHEELHOUSE", "")
    if wheelhouse:  # offline: every wheel comes from there, no index is asked
        plan.lines = [f"download: none: torch and torchvision come from HYBRIDTRAIN_WHEELHOUSE={wheelhouse}, which "
                      f"must hold the {plan.variant} wheels of torch {plan.torch} and torchvision {plan.torchvision}"
                      if line.startswith("download: ") else line for line in plan.lines]
    sys.stdout.write(shell_assignments(plan))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

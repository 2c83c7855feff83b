"""What a GPU and its driver are, as the install's choice (install.plan) and the rank's checks
(hybridtrain.hardware.checks) both read them: generations and capability names, which of torch's kernels run on a
capability, the driver each CUDA major needs, and what the installed driver says (read from libcuda, no torch).
docs/hardware.md is the table, with its sources.

May import: the standard library only (install.sh runs the plan with the system Python).
"""
from __future__ import annotations

import re

# The driver each CUDA major needs (CUDA's release notes, "minimum required driver for minor version
# compatibility", Linux x86_64): CUDA 12.x >= 525.60.13, CUDA 13.x >= 580.65.06.
MIN_DRIVER = {12: (525, 60, 13), 13: (580, 65, 6)}
# Names for messages: (first capability of the generation, its name, the data-centre GPUs people have).
GENERATIONS = (((3, 0), "Kepler", "K80"), ((5, 0), "Maxwell", "M40"), ((6, 0), "Pascal", "P100/P40"),
               ((7, 0), "Volta", "V100"), ((7, 5), "Turing", "T4"), ((8, 0), "Ampere", "A100"),
               ((8, 9), "Ada", "L40/L4"), ((9, 0), "Hopper", "H100/H200"), ((10, 0), "Blackwell", "B200"),
               ((12, 0), "Blackwell", "RTX PRO 6000"))


def version_tuple(text: str) -> tuple:
    """'2.13.0+cu130' -> (2, 13, 0); '535.104.05' -> (535, 104, 5)."""
    found = re.match(r"\d+(?:\.\d+)*", text)
    return tuple(int(part) for part in found.group().split(".")) if found else ()


def parse_capability(text: str) -> tuple:
    """'8.0' (nvidia-smi's compute_cap) or '80' (the number of torch's sm_80) -> (8, 0)."""
    if "." in text:
        major, minor = text.split(".", 1)
        return int(major), int(minor)
    return int(text[:-1]), int(text[-1])


def sm(cap: tuple) -> str:
    return f"sm_{cap[0]}{cap[1]}"


def generation(cap: tuple) -> str:
    """'sm_70 (Volta, V100)'."""
    name = [g for g in GENERATIONS if g[0] <= cap]
    return f"{sm(cap)} ({name[-1][1]}, e.g. {name[-1][2]})" if name else sm(cap)


def kernels_for(cap: tuple, archs) -> str:
    """The entry of ``archs`` (torch.cuda.get_arch_list()) that runs on a GPU of capability ``cap``, or ''.
    A cubin for sm_XY runs on the same major X with minor >= Y; PTX (compute_XY) is compiled by the driver for
    any capability >= XY (CUDA's binary and PTX compatibility rules)."""
    best = ""
    for arch in archs:
        kind, _, number = arch.partition("_")
        if not number.isdigit():
            continue
        a = parse_capability(number)
        if kind == "sm" and a[0] == cap[0] and a[1] <= cap[1]:
            return arch
        if kind == "compute" and a <= cap and not best:
            best = f"{arch} (PTX, compiled by the driver at first use)"
    return best


def driver_name(version: tuple) -> str:
    return ".".join(str(v) if i == 0 else f"{v:02d}" for i, v in enumerate(version))


def driver_shortfall(driver_api: int, torch_cuda: str) -> str:
    """'' when the driver runs torch's CUDA, else why not (no fix). ``driver_api``: the CUDA version the driver
    supports (cuDriverGetVersion: 12020 = 12.2). CUDA 12.x runs on any 12.x driver (r525+) through minor
    version compatibility; CUDA 13.x needs a 13.x driver (r580+, or forward compatibility's cuda-compat)."""
    if not torch_cuda or torch_cuda == "none" or driver_api <= 0:
        return ""
    need = version_tuple(torch_cuda)[0]
    have = (driver_api // 1000, driver_api % 1000 // 10)
    if have[0] >= need:
        return ""
    minimum = MIN_DRIVER.get(need, (0,))
    return (f"the NVIDIA driver supports CUDA {have[0]}.{have[1]} and this torch is built for CUDA {torch_cuda}, "
            f"which needs driver r{minimum[0]} ({driver_name(minimum)}) or newer")


def driver_api_version() -> int:
    """The CUDA version the installed driver supports (cuDriverGetVersion: 12020 = 12.2), read from libcuda
    without creating a context; 0 when there is no driver. torch has no public getter for it."""
    import ctypes
    version = ctypes.c_int(0)
    try:
        failed = ctypes.CDLL("libcuda.so.1").cuDriverGetVersion(ctypes.byref(version))
    except (OSError, AttributeError):
        return 0
    return 0 if failed else version.value


def driver_init_result() -> int:
    """cuInit(0)'s result (CUresult) from libcuda in this process: 0 when the driver initialises (or there is no
    libcuda to ask); 803/804 when the forward-compatibility libcuda cannot run on this GPU or kernel driver."""
    import ctypes
    try:
        return int(ctypes.CDLL("libcuda.so.1").cuInit(0))
    except (OSError, AttributeError):
        return 0


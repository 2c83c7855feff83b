"""The checks a rank makes before it trains on this node, all in one place: the node (:func:`check_node`: torch has
kernels for the GPU (:func:`kernel_refusal`), the driver runs torch's CUDA (:func:`driver_refusal`), BF16 has
hardware (:func:`bf16_refusal`), and a warning where FP16 computes slower than FP32 (:func:`fp16_rate_warning`)),
and what the config asks of it (:func:`check_machine`: native bf16, CUDA graphs, a compiler for compile and the
fused optimizers, a GPU Triton compiles for). torch is
imported inside :func:`check_node`; a refusal is a :class:`~hybridtrain.errors.UserError` (one line).

May import: hardware.gpus, errors.
"""
from __future__ import annotations

import importlib.util
import os
import shutil

from hybridtrain.errors import UserError
from hybridtrain.hardware.gpus import (
    driver_api_version,
    driver_shortfall,
    generation,
    kernels_for,
    sm,
)

# GPUs whose FP16 arithmetic runs at a small fraction of FP32 (GP102/GP104: 1/64), so FP16 compute is slower
# than FP32; the P40 recipe trains in FP32 with the FP16 wire.
SLOW_FP16 = {(6, 1): "1/64"}
P40_RECIPE = "configs/resnet50_cluster2_p40.yaml"


def kernel_refusal(cap: tuple, name: str, archs, torch_version: str, torch_cuda: str) -> str:
    """'' when torch has kernels for this GPU (``archs``: torch.cuda.get_arch_list()), else the one line."""
    if kernels_for(cap, archs):
        return ""
    fix = ("reinstall with ./install.sh, which picks the CUDA 12.6 build for it" if (5, 0) <= cap < (7, 5) else
           "reinstall with ./install.sh, which picks the build for it")
    return (f"{name} is {generation(cap)}, and this torch {torch_version} (CUDA {torch_cuda}) has kernels only for "
            f"{', '.join(archs) or 'no GPU'}: {fix} (docs/hardware.md)")


def driver_refusal(driver_api: int, torch_cuda: str) -> str:
    """'' when the driver runs torch's CUDA, else the one line (:func:`driver_shortfall` and the fix)."""
    short = driver_shortfall(driver_api, torch_cuda)
    if not short:
        return ""
    return (f"{short}: upgrade the driver, or reinstall with ./install.sh, which picks torch's CUDA "
            f"{driver_api // 1000} build for this driver (docs/hardware.md)")


def bf16_refusal(cap: tuple, name: str, dtypes) -> str:
    if "bf16" not in dtypes or cap >= (8, 0):
        return ""
    return (f"precision bf16 needs a GPU with native BF16 (compute capability 8.0 or newer) and {name} is "
            f"{generation(cap)}: use precision.compute_dtype=fp16")


def fp16_rate_warning(cap: tuple, name: str, dtypes) -> str:
    rate = SLOW_FP16.get(cap)
    if "fp16" not in dtypes or rate is None:
        return ""
    return (f"warning: {name} ({sm(cap)}) computes FP16 at {rate} of its FP32 rate, so FP16 compute is slower "
            f"than FP32 here: train in FP32 with the FP16 wire, as {P40_RECIPE} does (precision.mode=fp32, "
            f"distributed.compression=fp16)")


def compute_dtypes(precision) -> set:
    """The reduced dtypes ('fp16', 'bf16') a precision setting computes in: a ``precision`` config section, or a
    string such as 'fp32', 'mixed' (fp16), 'mixed-bf16', 'fp16_pure'."""
    if isinstance(precision, str):
        mode, _, dtype = precision.partition("-")
        return {dtype or "fp16"} if mode == "mixed" else ({"fp16"} if mode == "fp16_pure" else set())
    if precision.mode == "mixed":
        return {precision.compute_dtype}
    if precision.mode == "layered":
        return {d for d in precision.layers.values() if d in ("fp16", "bf16")}
    return {"fp16"} if precision.mode == "fp16_pure" else set()


def check_node(device, precision) -> list[str]:
    """The checks before a rank trains on ``device`` (a torch.device) in ``precision`` (see compute_dtypes):
    raises UserError with the first refusal (no kernels for this GPU, a driver too old for torch's CUDA, bf16
    below sm_80); returns the warnings (FP16 compute on a P40)."""
    import torch
    dtypes = compute_dtypes(precision)
    torch_cuda = torch.version.cuda or ""
    driver_api = driver_api_version() if torch_cuda else 0
    if getattr(device, "type", str(device)) != "cuda":
        line = driver_refusal(driver_api, torch_cuda)
        return [f"warning: the GPUs are not used: {line}"] if line and driver_api > 0 else []
    cap = tuple(torch.cuda.get_device_capability(device))
    name = torch.cuda.get_device_name(device)
    for line in (driver_refusal(driver_api, torch_cuda),
                 kernel_refusal(cap, name, torch.cuda.get_arch_list(), torch.__version__, torch_cuda),
                 bf16_refusal(cap, name, dtypes)):
        if line:
            raise UserError(line)
    warning = fp16_rate_warning(cap, name, dtypes)
    return [warning] if warning else []


# ----------------------------------------------------------------------------- what the config asks of this machine

def missing_compiler(device) -> str | None:
    """What torch.compile lacks for ``device``, and its fix, in words; None when nothing is. Inductor's CPU kernels
    need a C++ compiler ($CXX, else g++) and setuptools (it builds them through torch.utils.cpp_extension, which
    imports it; a Python 3.12+ venv has none); Triton's GPU launchers a C compiler ($CC, else gcc or clang)."""
    if device.type == "cuda":
        names = [os.environ["CC"]] if os.environ.get("CC") else ["gcc", "clang"]
        wanted = f"a C compiler for Triton ({' or '.join(names)})"
    else:
        names = [os.environ.get("CXX") or "g++"]
        wanted = f"a C++ compiler for inductor's CPU kernels ({names[0]})"
    if not any(shutil.which(name) for name in names):
        return f"{wanted} and none is on PATH: install one (e.g. the g++ or gcc package)"
    if device.type != "cuda" and importlib.util.find_spec("setuptools") is None:
        return "setuptools for inductor's CPU kernels and this Python has none: pip install setuptools"
    return None


TRITON_MIN_CAPABILITY = (7, 0)  # Triton's GPU kernels; older GPUs get inductor's GPUTooOldForTriton traceback


def too_old_for_triton(capability: tuple[int, int]) -> bool:
    """True for a GPU of compute capability ``capability`` (major, minor) that Triton cannot compile for: the
    P40 (6.1), not the V100 (7.0) or the H100 (9.0)."""
    return tuple(capability) < TRITON_MIN_CAPABILITY


def check_machine(cfg, policy, device) -> None:
    """One error line, before anything is built, when this machine cannot do what the config asks for: bf16 where
    the GPU computes it natively (compute capability 8.0+: emulation on a V100 or P40 is slow; the capability
    itself, not ``is_bf16_supported(including_emulation=False)``, which torch < 2.4 lacks), CUDA graphs on a CUDA
    GPU, and train.compile / optim.fused with a compiler (and, on a GPU, one Triton can compile for)."""
    import torch
    wants_bf16 = torch.bfloat16 in {policy.autocast_dtype, *policy.stage_dtypes.values()}
    if wants_bf16 and device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 0):
        raise UserError(f"precision.compute_dtype bf16 needs a GPU with native BF16 (compute capability 8.0 or "
                        f"newer) and {torch.cuda.get_device_name(device)} has none: use compute_dtype fp16")
    if cfg.train.cuda_graphs and device.type != "cuda":
        raise UserError("train.cuda_graphs=true needs a CUDA GPU and this machine has none (torch.cuda.is_available() "
                        "is False): set train.cuda_graphs=false")
    for key, on in (("train.compile", cfg.train.compile), ("optim.fused", cfg.optim.fused)):
        lacking = missing_compiler(device) if on else None
        if lacking:
            raise UserError(f"{key}=true needs {lacking}, or set {key}=false")
        if on and device.type == "cuda":
            check_triton_gpu(key, torch.cuda.get_device_capability(device))


def check_triton_gpu(key: str, capability: tuple[int, int]) -> None:
    """``key`` (train.compile or optim.fused: inductor's Triton kernels) refused, in one line, on a GPU too old
    for Triton; inductor would raise GPUTooOldForTriton as a traceback at the first step."""
    if too_old_for_triton(capability):
        major, minor = TRITON_MIN_CAPABILITY
        raise UserError(f"{key}=true compiles Triton kernels, which need a GPU of compute capability {major}.{minor} "
                        f"or newer, and this GPU is {capability[0]}.{capability[1]} (e.g. a P40): set {key}=false")

"""Peak memory per epoch: allocated, reserved and whole-device on a GPU, peak RSS on the CPU."""
from __future__ import annotations

import contextlib

import torch


def reset_peak_memory(device: torch.device) -> None:
    """Start a new peak: the CUDA allocator's, or the process's peak RSS (Linux clear_refs)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    with contextlib.suppress(OSError):
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")


def peak_memory_mb(device: torch.device) -> float:
    """Max allocated on the GPU, or peak RSS (VmHWM) on the CPU, in MiB since the last reset."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2 ** 20
    with contextlib.suppress(OSError):
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def memory_figures(device: torch.device) -> dict[str, float | None]:
    """Peak memory since the last reset, in MiB: allocated by tensors (a CUDA graph's private pool is not
    counted there), reserved by torch's caching allocator (graph pools and fragmentation included), and in use
    on the whole device now (CUDA context, NCCL buffers, DALI's decoder pools and other processes included).
    On the CPU: the peak RSS, and no reserved or device figure."""
    figures = {"peak_memory_mb": peak_memory_mb(device), "peak_memory_reserved_mb": None,
               "device_memory_used_mb": None}
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        figures["peak_memory_reserved_mb"] = torch.cuda.max_memory_reserved(device) / 2 ** 20
        figures["device_memory_used_mb"] = (total - free) / 2 ** 20
    return figures

"""``python -m benchmarks max-batch``: the largest per-GPU batch (Lu et al. 2020, §2.2.3 item 4).

The paper grows the per-GPU batch until GPU memory is nearly full (its Fig 3.4 and Table 3.3). Each trial
is a real training step (the recipe's model, optimizer, precision and loss scaling, as ``bench``) at one
batch size; a batch fits when it runs out of memory in none of its forms (torch's OOM error, a cuBLAS or
cuDNN allocation failure, a failed graph capture) and the memory torch reserved (CUDA-graph pools and
fragmentation included) leaves free both ``margin`` of the device and ``TRAINING_HEADROOM_MB`` for what a
one-process trial does not hold but training does: NCCL's buffers, Horovod's fusion buffer and DALI's GPU
decoder. The search doubles the batch until one does not fit, then bisects between the last that fitted and
the first that did not, down to ``granularity`` images.
"""
from __future__ import annotations

import gc
from dataclasses import dataclass
from typing import Callable

import torch

from hybridtrain.errors import UserError
from hybridtrain.reports import markdown_table


@dataclass
class Trial:
    batch: int
    fits: bool
    images_per_sec: float | None = None
    peak_memory_mb: float | None = None
    reason: str = ""


def search_max_batch(fits: Callable[[int], bool], start: int, granularity: int, limit: int = 1 << 16) -> int:
    """The largest batch (a multiple of ``granularity``, or ``start``) with ``fits(batch)``; 0 if none."""
    good, bad, batch = 0, None, start
    while batch <= limit:
        if not fits(batch):
            bad = batch
            break
        good, batch = batch, batch * 2
    if bad is None:
        return good
    while bad - good > (granularity if good >= granularity else 1):
        middle = (good + bad) // 2 // granularity * granularity or (good + bad) // 2
        if middle in (good, bad):
            break
        good, bad = (middle, bad) if fits(middle) else (good, middle)
    return good


# NCCL's buffers (~0.5 GiB at 8 ranks), Horovod's 128 MiB fusion buffer and DALI's nvJPEG pools (~1-2 GiB at
# batch 256), which a one-process bench trial does not allocate.
TRAINING_HEADROOM_MB = 3072

OOM_MARKERS = ("out of memory", "CUBLAS_STATUS_ALLOC_FAILED", "CUDNN_STATUS_ALLOC_FAILED",
               "CUDNN_STATUS_NOT_INITIALIZED", "CUDNN_STATUS_INTERNAL_ERROR", "operation not permitted when stream is "
               "capturing", "cudaErrorStreamCaptureInvalidated")


def is_out_of_memory(exc: BaseException) -> bool:
    """torch's OOM error, or one of the forms an allocation failure takes in cuBLAS, cuDNN or a graph capture."""
    return isinstance(exc, torch.cuda.OutOfMemoryError) or any(m in str(exc) for m in OOM_MARKERS)


def memory_budget_mb(total_mb: float, margin: float, headroom_mb: float = TRAINING_HEADROOM_MB) -> float:
    """What a trial may reserve: the device less ``margin`` of it and less the training headroom."""
    return total_mb * (1 - margin) - headroom_mb


def run_trial(cfg_for, batch: int, margin: float, steps: int, warmup: int) -> Trial:
    """One batch size: a timed ``bench`` trainer row, or the reason it does not fit."""
    from benchmarks.step_bench import bench_device, trainer_row
    device = bench_device()
    budget_mb = memory_budget_mb(torch.cuda.get_device_properties(device).total_memory / 2 ** 20, margin)
    try:
        row = trainer_row(cfg_for(batch), steps, warmup, None)
    except RuntimeError as exc:  # torch.cuda.OutOfMemoryError is one
        if not is_out_of_memory(exc):
            raise
        return Trial(batch, False, reason=f"out of memory ({str(exc).splitlines()[0][:80]})")
    finally:
        gc.collect()
        torch.cuda.empty_cache()
    used = row["peak_memory_reserved_mb"]
    fits = used <= budget_mb
    return Trial(batch, fits, row["images_per_sec"], used,
                 "" if fits else f"reserved {used:.0f} MiB, above the {budget_mb:.0f} MiB budget ({100 * margin:.0f}% "
                                 f"of the device and {TRAINING_HEADROOM_MB} MiB for NCCL, Horovod and DALI kept free)")


def find_max_batch(cfg_for, start: int, margin: float, granularity: int, steps: int, warmup: int) -> list[Trial]:
    """Every trial of the search, in batch order; the last fitting one is the answer."""
    trials: dict[int, Trial] = {}

    def fits(batch: int) -> bool:
        trials[batch] = run_trial(cfg_for, batch, margin, steps, warmup)
        print(f"hybridtrain: batch {batch}: {'fits' if trials[batch].fits else trials[batch].reason}", flush=True)
        return trials[batch].fits
    from benchmarks.step_bench import job_of_one
    with job_of_one():
        search_max_batch(fits, start, granularity)
    return [trials[b] for b in sorted(trials)]


def format_trials(trials: list[Trial], device_name: str) -> str:
    best = max((t.batch for t in trials if t.fits), default=0)
    rows = [[f"{t.batch}{' (largest)' if t.batch == best else ''}",
             f"{t.images_per_sec:.1f}" if t.images_per_sec else "-",
             f"{t.peak_memory_mb:.0f}" if t.peak_memory_mb else "-", "yes" if t.fits else "no: " + t.reason]
            for t in trials]
    return (f"largest per-GPU batch on {device_name}: {best or 'none fits'}\n\n"
            + markdown_table(["batch", "images/s", "reserved MiB", "fits"], rows))


NEEDS_GPU = ("max-batch measures GPU memory and needs a CUDA GPU, and none is visible here (nothing "
             "was measured): run it on a GPU node (the CPU's batch is bounded by time, not memory)")


def explain_cpu() -> int:
    """Nothing can be measured here: one error line and exit 2, so a script sees no result."""
    raise UserError(NEEDS_GPU)

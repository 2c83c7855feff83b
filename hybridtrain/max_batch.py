"""``hybridtrain bench --find-max-batch``: the largest per-GPU batch (seed 001, 2.2.3 item 4).

The paper grows the per-GPU batch until GPU memory is nearly full (its Fig 3.4 and Table 3.3). Each trial
is a real training step (the recipe's model, optimizer, precision and loss scaling, as ``bench``) at one
batch size; a batch fits when it neither runs out of memory nor peaks above (1 - margin) of the device's
memory. The search doubles the batch until one does not fit, then bisects between the last that fitted and
the first that did not, down to ``granularity`` images.
"""
from __future__ import annotations

import gc
import sys
from dataclasses import dataclass
from typing import Callable

import torch

from .errors import UserError


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


def run_trial(cfg_for, batch: int, margin: float, steps: int, warmup: int) -> Trial:
    """One batch size: a timed ``bench`` trainer row, or the reason it does not fit."""
    from .bench import bench_device, trainer_row
    device = bench_device()
    budget_mb = (1 - margin) * torch.cuda.get_device_properties(device).total_memory / 2 ** 20
    try:
        row = trainer_row(cfg_for(batch), steps, warmup, None)
    except torch.cuda.OutOfMemoryError:
        return Trial(batch, False, reason="out of memory")
    finally:
        gc.collect()
        torch.cuda.empty_cache()
    fits = row["peak_memory_mb"] <= budget_mb
    return Trial(batch, fits, row["images_per_sec"], row["peak_memory_mb"],
                 "" if fits else f"peak above {budget_mb:.0f} MiB ({100 * (1 - margin):.0f}% of the device)")


def find_max_batch(cfg_for, start: int, margin: float, granularity: int, steps: int, warmup: int) -> list[Trial]:
    """Every trial of the search, in batch order; the last fitting one is the answer."""
    if not torch.cuda.is_available():
        return []
    if not 0 <= margin < 1 or start < 1 or granularity < 1:
        raise UserError("--memory-margin must be in [0, 1), --start-batch and --batch-granularity >= 1")
    trials: dict[int, Trial] = {}

    def fits(batch: int) -> bool:
        trials[batch] = run_trial(cfg_for, batch, margin, steps, warmup)
        print(f"hybridtrain: batch {batch}: {'fits' if trials[batch].fits else trials[batch].reason}", flush=True)
        return trials[batch].fits
    search_max_batch(fits, start, granularity)
    return [trials[b] for b in sorted(trials)]


def format_trials(trials: list[Trial], device_name: str) -> str:
    best = max((t.batch for t in trials if t.fits), default=0)
    lines = [f"largest per-GPU batch on {device_name}: {best or 'none fits'}", "",
             "| batch | images/s | peak MiB | fits |", "| --- | --- | --- | --- |"]
    for t in trials:
        rate = f"{t.images_per_sec:.1f}" if t.images_per_sec else "-"
        peak = f"{t.peak_memory_mb:.0f}" if t.peak_memory_mb else "-"
        lines.append(f"| {t.batch}{' (largest)' if t.batch == best else ''} | {rate} | {peak} | "
                     f"{'yes' if t.fits else 'no: ' + t.reason} |")
    return "\n".join(lines)


NEEDS_GPU = ("hybridtrain: bench --find-max-batch measures GPU memory and needs a CUDA GPU, and none is visible "
             "here: run it on a GPU node (the CPU's batch is bounded by time, not memory)")


def explain_cpu() -> int:
    print(NEEDS_GPU, file=sys.stderr)
    return 0

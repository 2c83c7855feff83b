"""The paper's evaluation quantities as pure functions (Lu, Lu & Liang 2020, sections 1 and 3.2).

Units: speeds in images/second, times in seconds unless a name says otherwise, accuracies as
fractions in [0, 1], epochs 1-based. Every function raises ``ValueError`` on input that has no
meaning (non-positive speed, world size < 1, accuracy target outside (0, 1], ...).

The paper defines two forms of its criterion:

* measured form (Tables 3.8/3.9): actual average single-GPU training time = actual training time x N
  (:func:`actual_average_single_gpu_time`);
* model form (section 1): actual average single-GPU training time
  = 1 / (convergence rate x single-GPU speed x scaling efficiency), which in time units is
  epochs x images per epoch / (single-GPU speed x efficiency) (:func:`model_single_gpu_time`).

:func:`model_gap` compares the two.
"""
from __future__ import annotations

import math
import numbers
from typing import NamedTuple, Optional, Sequence

EPOCH = "a 1-based epoch number (integer >= 1)"  # what an epoch argument must be


def require_positive(name: str, value: float) -> None:
    if not (isinstance(value, numbers.Real) and math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a positive finite number, got {value!r}")


def require_non_negative(name: str, value: float) -> None:
    if not (isinstance(value, numbers.Real) and math.isfinite(value) and value >= 0):
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")


def require_count(name: str, value: int, what: str = "an integer >= 1") -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name} must be {what}, got {value!r}")


def ideal_speed(single_gpu_speed: float, world_size: int) -> float:
    """Speed of N GPUs under perfect linear scaling, images/s."""
    require_positive("single_gpu_speed", single_gpu_speed)
    require_count("world_size", world_size)
    return world_size * single_gpu_speed  # ideal speed = N * S1


def scaling_efficiency(actual_speed: float, single_gpu_speed: float, world_size: int) -> float:
    """GPU scaling efficiency from measured speeds (section 3.2.2), a fraction (may exceed 1 for superlinear runs)."""
    require_positive("actual_speed", actual_speed)
    return actual_speed / ideal_speed(single_gpu_speed, world_size)  # efficiency = actual speed / (N * S1)


def scaling_efficiency_from_times(comm_time: float, compute_time: float) -> float:
    """GPU scaling efficiency from per-GPU times (section 3.2.2); ``comm_time`` is the communication not hidden by
    compute."""
    require_non_negative("comm_time", comm_time)
    require_positive("compute_time", compute_time)
    return 1.0 / (1.0 + comm_time / compute_time)  # efficiency = 1 / (1 + comm time / compute time)


def convergence_epoch(values_per_epoch: Sequence[float], target: float) -> Optional[int]:
    """First 1-based epoch whose value (e.g. top-1 validation accuracy) is >= ``target``; None if never reached."""
    if not (isinstance(target, numbers.Real) and 0 < target <= 1):
        raise ValueError(f"target must lie in (0, 1], got {target!r}")
    for epoch, value in enumerate(values_per_epoch, start=1):
        if value >= target:
            return epoch  # convergence epoch = min{e : value_e >= target}
    return None


def convergence_rate(epoch: int) -> float:
    """Convergence rate (section 1): reciprocal of the number of epochs completed at convergence."""
    require_count("epoch", epoch, EPOCH)
    return 1.0 / epoch  # convergence rate = 1 / convergence epoch


class TrainingTime(NamedTuple):
    """Actual training time, seconds: wall time from the start of training to the end of the convergence epoch."""

    with_eval: float  # including the evaluation passes run up to and including the convergence epoch
    without_eval: float  # the same wall time minus those evaluation passes


def actual_training_time(
    epoch_end_times: Sequence[float],
    convergence_epoch: int,
    eval_times: Optional[Sequence[float]] = None,
) -> TrainingTime:
    """Actual training time (Tables 3.8/3.9), returned both with and without evaluation time.

    ``epoch_end_times[i]`` is the wall time in seconds from the start of training to the end of epoch
    i + 1, including any evaluation run in that epoch (non-decreasing). ``eval_times[i]`` is the seconds
    spent evaluating in epoch i + 1; when it is None no evaluation time was recorded and both fields are
    equal.
    """
    require_count("convergence_epoch", convergence_epoch, EPOCH)
    if convergence_epoch > len(epoch_end_times):
        raise ValueError(
            f"convergence_epoch {convergence_epoch} is past the last recorded epoch ({len(epoch_end_times)})"
        )
    times = list(epoch_end_times)
    if any(not math.isfinite(t) or t < 0 for t in times):
        raise ValueError("epoch_end_times must be finite and >= 0")
    if any(later < earlier for earlier, later in zip(times, times[1:])):
        raise ValueError("epoch_end_times must be non-decreasing (cumulative wall time at the end of each epoch)")
    with_eval = times[convergence_epoch - 1]  # T = wall time at the end of the convergence epoch
    if eval_times is None:
        return TrainingTime(with_eval, with_eval)
    if len(eval_times) != len(times):
        raise ValueError(f"eval_times has {len(eval_times)} entries but epoch_end_times has {len(times)}")
    if any(not math.isfinite(t) or t < 0 for t in eval_times):
        raise ValueError("eval_times must be finite and >= 0")
    eval_total = sum(eval_times[:convergence_epoch])
    if eval_total > with_eval:
        raise ValueError(f"evaluation time {eval_total} s exceeds the wall time {with_eval} s it is part of")
    return TrainingTime(with_eval, with_eval - eval_total)  # T_train = T - sum of eval times up to the epoch


def actual_average_single_gpu_time(actual_training_time: float, world_size: int) -> float:
    """The paper's criterion, measured form (Tables 3.8/3.9): GPU-time spent to converge, same unit as the input."""
    require_positive("actual_training_time", actual_training_time)
    require_count("world_size", world_size)
    return actual_training_time * world_size  # single-GPU time = actual training time * N


def varying_ranks_single_gpu_time(epoch_ends: list[float], world_sizes: list[int]) -> float:
    """The same criterion when elastic training changed N between epochs: sum_e (t_e - t_(e-1)) * N_e, with
    t_0 = 0 and N_e the ranks at the end of epoch e (a mid-epoch resize counts at the epoch's end)."""
    for n in world_sizes:
        require_count("world_size", n)
    starts = [0.0] + list(epoch_ends[:-1])
    return sum((end - start) * n for start, end, n in zip(starts, epoch_ends, world_sizes, strict=True))


def model_single_gpu_time(
    convergence_epoch: int, images_per_epoch: int, single_gpu_speed: float, efficiency: float
) -> float:
    """The paper's criterion, model form (section 1), seconds.

    1 / (convergence rate x single-GPU speed x efficiency) expressed in time: the convergence rate
    counts epochs, so one epoch's images convert it to seconds.
    """
    require_count("convergence_epoch", convergence_epoch, EPOCH)
    require_positive("images_per_epoch", images_per_epoch)
    require_positive("single_gpu_speed", single_gpu_speed)
    require_positive("efficiency", efficiency)
    return convergence_epoch * images_per_epoch / (single_gpu_speed * efficiency)  # = E * I / (S1 * eff)


def model_gap(measured: float, modelled: float) -> float:
    """Relative gap of a measured value to its modelled value: 0 when they agree, -0.05 when measured is 5% lower."""
    require_positive("measured", measured)
    require_positive("modelled", modelled)
    return measured / modelled - 1.0  # gap = measured / modelled - 1


def speedup(speed: float, baseline_speed: float) -> float:
    """How many times faster ``speed`` is than ``baseline_speed`` (e.g. Table 3.2: 1542/758 = 2.03)."""
    require_positive("speed", speed)
    require_positive("baseline_speed", baseline_speed)
    return speed / baseline_speed  # speedup = S_a / S_b

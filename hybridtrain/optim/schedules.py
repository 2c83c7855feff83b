"""Learning-rate schedules as pure functions of (step, epoch).

``step`` is the 0-based global optimizer step, ``iters_per_epoch`` converts it to fractional epochs.
lr is the single-GPU learning rate and N the number of ranks (linear scaling, Goyal et al. 2017).
"""
from __future__ import annotations

import bisect

HYBRID_PHASES = ("adabound", "sgd")  # the hybrid optimizer's: AdaBound for T epochs, then SGD + LARS


def hybrid_phase_start(phase: str, adabound_epochs: int, iters_per_epoch: int) -> int:
    """The first global step of a hybrid phase: 0 for AdaBound, T * iters_per_epoch for SGD + LARS."""
    if phase not in HYBRID_PHASES:
        raise ValueError(f"phase must be one of {HYBRID_PHASES}, got {phase!r}")
    return 0 if phase == "adabound" else adabound_epochs * iters_per_epoch  # SGD from epoch T


def linear_scaled_lr(base_lr: float, world_size: int) -> float:
    return base_lr * world_size  # lr x N (linear scaling rule)


def step_decay_factor(epoch: int, total_epochs: int, milestones, decay_factor: float) -> float:
    """decay^(number of milestones passed); milestones are fractions of the run (30/60/80 of 90)."""
    boundaries = [round(m * total_epochs) for m in milestones]
    return decay_factor ** bisect.bisect_right(boundaries, epoch)


def goyal_lr(step: int, iters_per_epoch: int, base_lr: float, world_size: int, warmup_epochs: float,
             total_epochs: int, milestones, decay_factor: float) -> float:
    """Gradual warmup from lr to lr*N over ``warmup_epochs`` (per iteration), then step decay."""
    progress = step / iters_per_epoch
    target = linear_scaled_lr(base_lr, world_size)
    if progress < warmup_epochs:
        return base_lr + (target - base_lr) * progress / warmup_epochs  # lr + (lr*N - lr) * t / W
    return target * step_decay_factor(step // iters_per_epoch, total_epochs, milestones, decay_factor)


def sgd_lr(step: int, iters_per_epoch: int, base_lr: float, world_size: int, total_epochs: int, milestones,
           decay_factor: float) -> float:
    """Plain linear-scaling SGD: lr*N from the first step, the same step decay, no warmup."""
    epoch = step // iters_per_epoch
    return linear_scaled_lr(base_lr, world_size) * step_decay_factor(epoch, total_epochs, milestones, decay_factor)

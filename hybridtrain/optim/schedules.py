"""Learning-rate schedules and bounds as pure functions of (step, epoch) (Lu et al. 2020, §2.2.1).

Pure Python (no torch): the trainer evaluates them before every optimizer step and writes the results into the
optimizer's param groups as plain floats. ``step`` is the 0-based global optimizer step unless a function says
1-based (k); ``iters_per_epoch`` converts it to fractional epochs. lr is the single-GPU learning rate and N the
number of ranks: `linear_scaled_lr` is the one place lr*N is computed (linear scaling, Goyal et al. 2017).

Each optimizer's schedule, ``*_schedule(step, o, world_size, iters_per_epoch, total_epochs)`` with ``o`` the
config's ``optim`` section, returns ``{param-group key: value}`` for that step (`optim.factory.OPTIMIZERS` names
the one of each optimizer).
"""
from __future__ import annotations

import bisect
import math

HYBRID_PHASES = ("adabound", "sgd")  # the hybrid optimizer's: AdaBound for T epochs, then SGD + LARS
GRANULARITIES = ("iteration", "epoch")
DECAY_ORIGINS = ("switch", "zero")


# ---------------------------------------------------------------- argument checks, once per schedule

def _require(ok: bool, name: str, rule: str, value) -> None:
    if not ok:
        raise ValueError(f"{name} must be {rule}, got {value!r}")


def _is_int(value, minimum: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def check_common(o, world_size, iters_per_epoch) -> None:
    """What every schedule's formulas assume, checked once when the schedule is made (``create_schedule``), not
    at every step: one ValueError line for the first bad value."""
    _require(_is_int(world_size, 1), "world_size", "an integer >= 1", world_size)
    _require(_is_int(iters_per_epoch, 1), "iters_per_epoch", "an integer >= 1", iters_per_epoch)
    _require(o.lr > 0, "base_lr", "> 0", o.lr)


def check_hybrid(o, world_size, iters_per_epoch) -> None:
    """`check_common`, and what the bounds and the SGD decay assume."""
    check_common(o, world_size, iters_per_epoch)
    _require(_is_int(o.adabound_epochs, 0), "T", "an integer >= 0 (AdaBound warmup epochs)", o.adabound_epochs)
    _require(0.0 <= o.betas[1] < 1.0, "beta2", "in [0, 1)", o.betas[1])
    _require(o.bound_granularity in GRANULARITIES, "granularity", f"one of {GRANULARITIES}", o.bound_granularity)
    _require(0.0 < o.kappa <= 1.0, "kappa", "in (0, 1]", o.kappa)
    _require(o.kappa_origin in DECAY_ORIGINS, "origin", f"one of {DECAY_ORIGINS}", o.kappa_origin)


def check_adabound(o, world_size, iters_per_epoch) -> None:
    """`check_common`, and the reference bounds' gamma (their final_lr is lr*N > 0)."""
    check_common(o, world_size, iters_per_epoch)
    _require(o.adabound_gamma > 0, "gamma", "> 0", o.adabound_gamma)


# ---------------------------------------------------------------- learning rates and bounds

def linear_scaled_lr(base_lr: float, world_size: int) -> float:
    return base_lr * world_size  # lr x N (linear scaling rule)


def hybrid_phase_start(phase: str, adabound_epochs: int, iters_per_epoch: int) -> int:
    """The first global step of a hybrid phase: 0 for AdaBound, T * iters_per_epoch for SGD + LARS."""
    if phase not in HYBRID_PHASES:
        raise ValueError(f"phase must be one of {HYBRID_PHASES}, got {phase!r}")
    return 0 if phase == "adabound" else adabound_epochs * iters_per_epoch  # SGD from epoch T


def adabound_bounds(t, T, base_lr, world_size, beta2):
    """(B_l, B_u) of linear-scaling AdaBound at progress t (in epochs, t > 0) of a T-epoch warmup.

    B_u falls from +inf (t -> 0+) to lr*N at t = T; B_l rises from 0 to lr*N. For t >= T both
    are lr*N (t is clamped to T). The arguments are checked once (`check_hybrid`), not at every step.
    """
    t = min(t, T)
    scaled_lr = linear_scaled_lr(base_lr, world_size)
    # B_u = lr*N + 1/((1-b2) t) - 1/((1-b2) T), written as (T - t)/((1-b2) t T) so B_u = lr*N exactly at t = T
    upper = scaled_lr + (T - t) / ((1.0 - beta2) * t * T)
    lower = (t / T) * scaled_lr  # B_l = (t/T) * lr * N
    return lower, upper


def bound_progress(step, iters_per_epoch, granularity):
    """Progress t (in epochs) fed to `adabound_bounds` for the 1-based global step k.

    "iteration": t = k / iters_per_epoch (bounds move every step);
    "epoch": t = floor((k - 1) / iters_per_epoch) + 1 (constant within an epoch, first epoch is 1).
    """
    if granularity == "iteration":
        return step / iters_per_epoch  # t = k / I
    if granularity == "epoch":
        return (step - 1) // iters_per_epoch + 1  # t = floor((k-1)/I) + 1
    raise ValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")


def reference_adabound_bounds(step, final_lr, gamma):
    """(lower, upper) bounds of the reference AdaBound (Luo et al. 2019) at 1-based step k (``check_adabound``)."""
    lower = final_lr * (1.0 - 1.0 / (gamma * step + 1.0))  # final_lr * (1 - 1/(gamma*k + 1))
    upper = final_lr * (1.0 + 1.0 / (gamma * step))  # final_lr * (1 + 1/(gamma*k))
    return lower, upper


def sgd_decay_lr(epoch, T, base_lr, world_size, kappa, origin="switch"):
    """SGD-phase learning rate for the 0-based epoch e (paper: alpha_t = lr * N * kappa^epoch).

    origin "switch": lr*N*kappa^(e - T), so the first SGD epoch (e = T) starts at lr*N;
    only defined for e >= T. origin "zero": lr*N*kappa^e (the paper's formula read literally). The arguments
    are checked once (`check_hybrid`), not at every step.
    """
    scaled_lr = linear_scaled_lr(base_lr, world_size)
    if origin == "switch":
        _require(epoch >= T, "epoch", f"past the AdaBound warmup (epochs 0..{T - 1}) for origin 'switch'", epoch)
        return scaled_lr * kappa ** (epoch - T)  # lr * N * kappa^(e - T)
    if origin == "zero":
        return scaled_lr * kappa**epoch  # lr * N * kappa^e
    raise ValueError(f"origin must be one of {DECAY_ORIGINS}, got {origin!r}")


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


def budgeted_factor(progress: float, start: float, total_epochs: int, shape: str) -> float:
    """The decay factor at ``progress`` (fractional epochs) of a decay from 1 at epoch ``start`` to 0 at the end of
    the last epoch, ``total_epochs``: ``linear`` (FFCV's budgeted schedule) or ``cosine`` (Loshchilov & Hutter)."""
    fraction = min(max((progress - start) / (total_epochs - start), 0.0), 1.0)
    if shape == "linear":
        return 1.0 - fraction  # (E - t) / (E - W)
    return 0.5 * (1.0 + math.cos(math.pi * fraction))  # (1 + cos(pi (t - W) / (E - W))) / 2


def poly_warmup_lr(step: int, peak: float, end: float, warmup_steps: float, total_steps: int,
                   power: float) -> float:
    """MLPerf's PolynomialDecayWithWarmup (image_classification/tensorflow2/lars_util.py) at the 0-based step s:
    peak * s / W for s <= W, then Keras' PolynomialDecay of s - W over D = total - W + 1 steps."""
    if step <= warmup_steps:
        return peak * step / warmup_steps if warmup_steps > 0 else peak  # peak * s / W
    decay_steps = total_steps - warmup_steps + 1  # D = total - W + 1
    done = min(step - warmup_steps, decay_steps)
    return (peak - end) * (1.0 - done / decay_steps) ** power + end  # (peak - end)(1 - (s-W)/D)^p + end


# ---------------------------------------------------------------- each optimizer's schedule

def hybrid_schedule(step: int, o, world_size: int, iters_per_epoch: int, total_epochs: int | None = None) -> dict:
    """AdaBound with the paper's bounds for epochs [0, T), then LARS-SGD at lr*N*kappa^(epoch-T)."""
    epoch, k = step // iters_per_epoch, step + 1
    if epoch < o.adabound_epochs:
        t = bound_progress(k, iters_per_epoch, o.bound_granularity)
        lower, upper = adabound_bounds(t, o.adabound_epochs, o.lr, world_size, o.betas[1])
        # lr is the SGD phase's starting rate lr*N (logged; the AdaBound step uses alpha and the bounds)
        return {"phase": "adabound", "lower_bound": lower, "upper_bound": upper,
                "lr": linear_scaled_lr(o.lr, world_size)}
    return {"phase": "sgd", "lr": sgd_decay_lr(epoch, o.adabound_epochs, o.lr, world_size, o.kappa, o.kappa_origin)}


def adabound_schedule(step: int, o, world_size: int, iters_per_epoch: int | None = None,
                      total_epochs: int | None = None) -> dict:
    """The reference AdaBound bounds around final_lr = lr*N (linear scaling)."""
    lower, upper = reference_adabound_bounds(step + 1, linear_scaled_lr(o.lr, world_size), o.adabound_gamma)
    return {"lower_bound": lower, "upper_bound": upper}


def goyal_schedule(step: int, o, world_size: int, iters_per_epoch: int, total_epochs: int,
                   warmup_epochs: float | None = None) -> dict:
    """`goyal_lr`: warmup to lr*N over ``warmup_epochs`` (default ``o.warmup_epochs``), then ``o.schedule``'s decay
    (step; linear or cosine per step from the warmup's end, `budgeted_factor`)."""
    warmup = o.warmup_epochs if warmup_epochs is None else warmup_epochs
    if o.schedule == "step" or step / iters_per_epoch < warmup:
        return {"lr": goyal_lr(step, iters_per_epoch, o.lr, world_size, warmup, total_epochs, o.milestones,
                               o.decay_factor)}
    return {"lr": linear_scaled_lr(o.lr, world_size) * budgeted_factor(step / iters_per_epoch, warmup, total_epochs,
                                                                       o.schedule)}


def sgd_schedule(step: int, o, world_size: int, iters_per_epoch: int, total_epochs: int) -> dict:
    """lr*N from the first step, then ``o.schedule``'s decay (step: `goyal_lr` with W = 0; linear or cosine from
    epoch 0):
    `goyal_schedule` without its warmup."""
    return goyal_schedule(step, o, world_size, iters_per_epoch, total_epochs, warmup_epochs=0)


def mlperf_schedule(step: int, o, world_size: int, iters_per_epoch: int, total_epochs: int) -> dict:
    """MLPerf's recipe: linear warmup from 0 to lr*N over ``o.warmup_epochs``, then polynomial decay (power
    ``o.poly_power``) to ``o.end_lr`` at the last step (`poly_warmup_lr`)."""
    return {"lr": poly_warmup_lr(step, linear_scaled_lr(o.lr, world_size), o.end_lr, o.warmup_epochs * iters_per_epoch,
                                 total_epochs * iters_per_epoch, o.poly_power)}

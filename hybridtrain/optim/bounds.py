"""Learning-rate bounds and schedules of the hybrid gradient descent (seed 001, section 2.2.1).

Pure Python (no torch): the trainer evaluates these once per step or epoch and writes the
results into the optimizer's param groups as plain floats.
"""

GRANULARITIES = ("iteration", "epoch")
DECAY_ORIGINS = ("switch", "zero")


def _require_positive(name, value):
    if not value > 0:
        raise ValueError(f"{name} must be > 0, got {value!r}")


def _require_world_size(world_size):
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an integer >= 1, got {world_size!r}")


def _require_beta2(beta2):
    if not 0.0 <= beta2 < 1.0:
        raise ValueError(f"beta2 must be in [0, 1), got {beta2!r}")


def adabound_bounds(t, T, base_lr, world_size, beta2):
    """(B_l, B_u) of linear-scaling AdaBound at progress t (in epochs, t > 0) of a T-epoch warmup.

    B_u falls from +inf (t -> 0+) to lr*N at t = T; B_l rises from 0 to lr*N. For t >= T both
    are lr*N (t is clamped to T).
    """
    _require_positive("T", T)
    _require_positive("t", t)
    _require_positive("base_lr", base_lr)
    _require_world_size(world_size)
    _require_beta2(beta2)
    t = min(t, T)
    scaled_lr = base_lr * world_size  # lr * N (linear scaling)
    # B_u = lr*N + 1/((1-b2) t) - 1/((1-b2) T), written as (T - t)/((1-b2) t T) so B_u = lr*N exactly at t = T
    upper = scaled_lr + (T - t) / ((1.0 - beta2) * t * T)
    lower = (t / T) * scaled_lr  # B_l = (t/T) * lr * N
    return lower, upper


def bound_progress(step, iters_per_epoch, granularity):
    """Progress t (in epochs) fed to `adabound_bounds` for the 1-based global step k.

    "iteration": t = k / iters_per_epoch (bounds move every step);
    "epoch": t = floor((k - 1) / iters_per_epoch) + 1 (constant within an epoch, first epoch is 1).
    """
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise ValueError(f"step must be an integer >= 1 (1-based global step), got {step!r}")
    if isinstance(iters_per_epoch, bool) or not isinstance(iters_per_epoch, int) or iters_per_epoch < 1:
        raise ValueError(f"iters_per_epoch must be an integer >= 1, got {iters_per_epoch!r}")
    if granularity == "iteration":
        return step / iters_per_epoch  # t = k / I
    if granularity == "epoch":
        return (step - 1) // iters_per_epoch + 1  # t = floor((k-1)/I) + 1
    raise ValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")


def reference_adabound_bounds(step, final_lr, gamma):
    """(lower, upper) bounds of the reference AdaBound (Luo et al. 2019) at 1-based step k."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise ValueError(f"step must be an integer >= 1, got {step!r}")
    _require_positive("final_lr", final_lr)
    _require_positive("gamma", gamma)
    lower = final_lr * (1.0 - 1.0 / (gamma * step + 1.0))  # final_lr * (1 - 1/(gamma*k + 1))
    upper = final_lr * (1.0 + 1.0 / (gamma * step))  # final_lr * (1 + 1/(gamma*k))
    return lower, upper


def sgd_decay_lr(epoch, T, base_lr, world_size, kappa, origin="switch"):
    """SGD-phase learning rate for the 0-based epoch e (paper: alpha_t = lr * N * kappa^epoch).

    origin "switch": lr*N*kappa^(e - T), so the first SGD epoch (e = T) starts at lr*N;
    only defined for e >= T. origin "zero": lr*N*kappa^e (the paper's formula read literally).
    """
    if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
        raise ValueError(f"epoch must be an integer >= 0 (0-based), got {epoch!r}")
    if isinstance(T, bool) or not isinstance(T, int) or T < 0:
        raise ValueError(f"T must be an integer >= 0 (number of AdaBound warmup epochs), got {T!r}")
    _require_positive("base_lr", base_lr)
    _require_world_size(world_size)
    if not 0.0 < kappa <= 1.0:
        raise ValueError(f"kappa must be in (0, 1], got {kappa!r}")
    scaled_lr = base_lr * world_size  # lr * N
    if origin == "switch":
        if epoch < T:
            raise ValueError(
                f"epoch {epoch} is inside the AdaBound warmup (epochs 0..{T - 1}); "
                "origin 'switch' is defined only for epoch >= T"
            )
        return scaled_lr * kappa ** (epoch - T)  # lr * N * kappa^(e - T)
    if origin == "zero":
        return scaled_lr * kappa**epoch  # lr * N * kappa^e
    raise ValueError(f"origin must be one of {DECAY_ORIGINS}, got {origin!r}")

"""Multi-tensor update kernels (``torch._foreach_*``) for AdaBound and LARS-SGD, and their compiled variants.

Every function updates LISTS of tensors in place; all tensors of one call live on one device, and nothing reads
a value back to the host (no ``.item()``). ``adabound_step_`` and ``lars_sgd_step_`` issue a fixed number of
foreach ops per call, whatever the number of tensors, with the hyperparameters as Python floats. The
``*_tensor_step_`` variants take the values the schedule changes every step as 0-dim device tensors and are
meant for ``compiled(...)`` (``optim.fused``): inductor fuses each tensor's update into one loop.
"""

import functools
import math

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

LARS_MODES = ("scale", "clip")


def _check_same_length(**lists):
    lengths = {name: len(values) for name, values in lists.items()}
    if len(set(lengths.values())) > 1:
        raise ValueError(f"tensor lists must have equal lengths, got {lengths}")


def adabound_step_size(step, alpha, beta1, beta2):
    """Bias-corrected scalar step alpha * sqrt(1 - beta2^k) / (1 - beta1^k) for 1-based step k."""
    return alpha * math.sqrt(1.0 - beta2**step) / (1.0 - beta1**step)  # alpha*sqrt(1-b2^k)/(1-b1^k)


def adabound_step_(params, grads, exp_avgs, exp_avg_sqs, scratch, step, alpha, beta1, beta2, eps,
                   weight_decay, lower, upper):
    """One AdaBound update (Luo et al. 2019 reference algorithm) of every tensor in ``params``.

    ``step`` is the 1-based step k after this update; ``lower``/``upper`` are the clip bounds
    (floats, ``upper`` may be inf). ``grads`` are not modified. ``scratch`` holds one buffer shaped like each
    param, overwritten here (first g + wd*p, then the denominator), so the update allocates nothing: on the CPU
    a fresh model-sized result costs its page faults on every step.
    """
    _check_same_length(params=params, grads=grads, exp_avgs=exp_avgs, exp_avg_sqs=exp_avg_sqs, scratch=scratch)
    if not params:
        return
    if weight_decay != 0:
        torch._foreach_copy_(scratch, grads)
        torch._foreach_add_(scratch, params, alpha=weight_decay)  # g <- g + wd * p (coupled L2)
        grads = scratch
    torch._foreach_lerp_(exp_avgs, grads, 1.0 - beta1)  # m = b1*m + (1-b1)*g, as m + (1-b1)*(g - m): one pass
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1.0 - beta2)  # v = b2*v + (1-b2)*g^2
    size = adabound_step_size(step, alpha, beta1, beta2)
    if size == 0:  # alpha = 0: eta = clip(0, lower, upper) = lower
        torch._foreach_add_(params, exp_avgs, alpha=-lower)
        return
    denominators = scratch
    torch._foreach_copy_(denominators, exp_avg_sqs)
    torch._foreach_sqrt_(denominators)
    torch._foreach_add_(denominators, eps)  # d = sqrt(v) + eps
    # eta = clip(size / d, lower, upper) = size / clip(d, size/upper, size/lower): the bounds move onto d
    if math.isfinite(upper):
        torch._foreach_clamp_min_(denominators, size / upper if upper > 0 else math.inf)  # eta <= upper
    if lower > 0:
        torch._foreach_clamp_max_(denominators, size / lower)  # eta >= lower
    torch._foreach_addcdiv_(params, exp_avgs, denominators, value=-size)  # p <- p - eta * m, in one pass


def lars_trust_factors(params, grads, lr, weight_decay, trust_coefficient, eps, mode):
    """Per-tensor factor multiplying (g + wd*w), as a list of 0-dim device tensors.

    local_lr = eta * ||w|| / (||g|| + wd * ||w|| + eps) (You et al. 2017).
    mode "scale": factor = local_lr.
    mode "clip" (LARC): factor = min(local_lr / lr, 1), so the effective lr is min(local_lr, lr).
    In both modes the factor is 1 when ||w|| == 0 or ||g|| == 0 (no adaptation).
    """
    if mode not in LARS_MODES:
        raise ValueError(f"mode must be one of {LARS_MODES}, got {mode!r}")
    w_norms = torch.stack(torch._foreach_norm(params))
    g_norms = torch.stack(torch._foreach_norm(grads))
    local_lr = trust_coefficient * w_norms / (g_norms + weight_decay * w_norms + eps)  # eta*||w||/(||g||+wd*||w||+eps)
    if mode == "clip":
        local_lr = torch.clamp(local_lr / lr, max=1.0)  # LARC: min(local_lr / lr, 1)
    adapt = (w_norms > 0) & (g_norms > 0)
    factors = torch.where(adapt, local_lr, torch.ones_like(local_lr))  # factor = 1 if a norm is 0
    return list(factors.unbind(0))


def _momentum_sgd_(params, directions, momentum_bufs, lr, momentum):
    """buf = momentum * buf + d; p <- p - lr * buf (no dampening, no Nesterov)."""
    torch._foreach_mul_(momentum_bufs, momentum)
    torch._foreach_add_(momentum_bufs, directions)  # buf = mu*buf + d
    torch._foreach_add_(params, momentum_bufs, alpha=-lr)  # p <- p - lr*buf


def _split_by_flag(flags, *lists):
    """Split each list into (flagged, unflagged) sublists by the boolean ``flags``."""
    on = [i for i, flag in enumerate(flags) if flag]
    off = [i for i, flag in enumerate(flags) if not flag]
    return [([values[i] for i in on], [values[i] for i in off]) for values in lists]


def lars_sgd_step_(params, grads, momentum_bufs, scratch, lr, momentum, weight_decay, trust_coefficient,
                   eps, mode, apply_lars):
    """One LARS-SGD update with momentum of every tensor in ``params``.

    Tensors with ``apply_lars[i]`` True: d = (g + wd*w) * factor with factor from
    `lars_trust_factors` ("scale": local_lr; "clip"/LARC: min(local_lr/lr, 1)).
    Tensors with ``apply_lars[i]`` False (BN, biases): d = g, no weight decay.
    ``apply_lars`` is a list of bools aligned with ``params``, or one bool for all.
    Then for all: buf = momentum*buf + d; p <- p - lr*buf. Buffers must start at zero. ``grads`` are not
    modified; ``scratch`` (one buffer like each param) is overwritten with the directions d.
    """
    if isinstance(apply_lars, bool):
        apply_lars = [apply_lars] * len(params)
    _check_same_length(params=params, grads=grads, momentum_bufs=momentum_bufs, scratch=scratch,
                       apply_lars=apply_lars)
    if mode not in LARS_MODES:
        raise ValueError(f"mode must be one of {LARS_MODES}, got {mode!r}")
    (lars_p, plain_p), (lars_g, plain_g), (lars_b, plain_b), (directions, _) = _split_by_flag(
        apply_lars, params, grads, momentum_bufs, scratch)
    if lars_p:
        factors = lars_trust_factors(lars_p, lars_g, lr, weight_decay, trust_coefficient, eps, mode)
        torch._foreach_copy_(directions, lars_g)
        if weight_decay != 0:
            torch._foreach_add_(directions, lars_p, alpha=weight_decay)  # g + wd*w
        torch._foreach_mul_(directions, factors)  # d = (g + wd*w) * factor
        _momentum_sgd_(lars_p, directions, lars_b, lr, momentum)
    if plain_p:
        _momentum_sgd_(plain_p, plain_g, plain_b, lr, momentum)  # excluded: d = g


# ---------------------------------------------------------------- compiled (fused) updates

def adabound_tensor_step_(params, grads, exp_avgs, exp_avg_sqs, step_size, lower, upper, beta1, beta2, eps,
                          weight_decay):
    """`adabound_step_` for ``torch.compile``: the values the schedule changes every step (the bias-corrected
    step size, the bounds) are 0-dim tensors on the parameters' device, so a compiled update is built once
    and fused into one loop per tensor, and never recompiles as they change."""
    if weight_decay != 0:
        grads = torch._foreach_add(grads, params, alpha=weight_decay)  # g <- g + wd * p
    torch._foreach_lerp_(exp_avgs, grads, 1.0 - beta1)  # m = b1*m + (1-b1)*g
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1.0 - beta2)  # v = b2*v + (1-b2)*g^2
    denominators = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_add_(denominators, eps)  # sqrt(v) + eps
    for p, m, denominator in zip(params, exp_avgs, denominators):
        p.addcmul_(torch.clamp(step_size / denominator, lower, upper), m, value=-1.0)  # p -= clip(eta, B_l, B_u) m


def lars_tensor_step_(params, grads, momentum_bufs, lr, momentum, weight_decay, trust_coefficient, eps, mode,
                      apply_lars):
    """`lars_sgd_step_` for ``torch.compile``, with ``lr`` a 0-dim tensor (see `adabound_tensor_step_`) and the
    trust ratio of each tensor computed next to its update (no per-tensor scalars leave the fused loop)."""
    for p, g, buf, lars in zip(params, grads, momentum_bufs, apply_lars):
        direction = g
        if lars:
            w_norm, g_norm = torch.linalg.vector_norm(p), torch.linalg.vector_norm(g)
            local_lr = trust_coefficient * w_norm / (g_norm + weight_decay * w_norm + eps)  # eta||w||/(||g||+wd||w||+e)
            if mode == "clip":
                local_lr = torch.clamp(local_lr / lr, max=1.0)  # LARC: min(local_lr / lr, 1)
            factor = torch.where((w_norm > 0) & (g_norm > 0), local_lr, torch.ones_like(local_lr))
            direction = (g + weight_decay * p if weight_decay != 0 else g) * factor  # d = (g + wd*w) * factor
        buf.mul_(momentum).add_(direction)  # buf = mu*buf + d
        p.sub_(lr * buf)  # p <- p - lr*buf


@functools.lru_cache(maxsize=None)
def compiled(kernel):
    """``kernel`` compiled once per process (one graph per list structure; the values are inputs). Under a
    Python dispatch mode (``perf.host_syncs`` counts with one) dynamo does not trace, so there it runs eagerly:
    the same operations, one tensor at a time."""
    fast = torch.compile(kernel, fullgraph=True)

    def run(*args):
        return kernel(*args) if _get_current_dispatch_mode() is not None else fast(*args)
    return run

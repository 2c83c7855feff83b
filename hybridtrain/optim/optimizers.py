"""``torch.optim.Optimizer`` subclasses for the hybrid gradient descent and the multi-tensor kernels that run their
updates, side by side as ``torch.optim``'s own modules hold each optimizer with its ``_foreach`` kernel. The checks
of the values written into their param groups are ``optim.rules``.

**The optimizers.** Horovod's ``DistributedOptimizer`` rebuilds an optimizer as ``cls(optimizer.param_groups)``, so
every constructor argument besides ``params`` has a default and every hyperparameter lives in
the param groups (which also makes ``state_dict()`` carry all of it). Group hyperparameters are
plain Python values; the trainer may change them between steps (lr, bounds, phase). Each optimizer checks
them when they are written (``add_param_group``, ``load_state_dict``, and ``validate``, which
``OptimizerBundle.check_schedule`` calls once for the whole schedule), so neither ``step()`` nor
``apply_schedule``, which writes a schedule's values before every step, does.

Per-group keys shared by LARS and HybridOptimizer: ``lars`` (bool, default True). Pass BN and
bias parameters in a second group with ``lars=False`` (and ``weight_decay=0``): in the SGD/LARS
update those get plain momentum SGD with no weight decay.

Note: string-valued group keys (``mode``, ``lars_mode``, ``phase``) cannot go through
``hvd.broadcast_optimizer_state`` (it wraps every group value in a tensor); broadcast with
``hvd.broadcast_object(optimizer.state_dict())`` + ``load_state_dict`` instead.

**The kernels** (AdaBound, LARS-SGD, and their compiled variants). Every function updates LISTS of tensors in
place; all tensors of one call live on one device, and nothing reads a value back to the host (no ``.item()``).
``adabound_step_`` and ``lars_sgd_step_`` issue a fixed number of foreach ops per call, whatever the number of
tensors, with the hyperparameters as Python floats. The ``*_tensor_step_`` variants take the values the schedule
changes every step as 0-dim device tensors and are meant for ``compiled(...)`` (``optim.fused``): inductor fuses
each tensor's update into one loop.
"""
from __future__ import annotations

import functools
import math

import torch
from torch.optim import Optimizer
from torch.utils._python_dispatch import _get_current_dispatch_mode

from hybridtrain.optim.rules import LARS_MODES, adabound_rules, lars_rules, require_bool, require_choice
from hybridtrain.optim.schedules import HYBRID_PHASES as PHASES

RUN_CHOICE_KEYS = ("fused",)  # group keys that say how this run updates, kept from the run, not the checkpoint
_ADABOUND_STATE_KEYS = ("exp_avg", "exp_avg_sq", "adabound_step")
_STALE_KEYS = {"adabound": ("momentum_buffer",), "sgd": _ADABOUND_STATE_KEYS}  # a phase -> the other one's buffers


def apply_schedule(optimizer: Optimizer, schedule, step: int) -> dict | None:
    """Write ``schedule(step)`` (a ``{param-group key: value}`` function of the step, `optim.schedules`) into every
    param group of ``optimizer``, unchecked: ``OptimizerBundle.check_schedule`` checked the schedule once. Returns
    the values when ``step`` (past the first) begins a new phase, the hybrid optimizer's switch to SGD, for the
    caller to say so; else None."""
    settings = schedule(step)
    groups = optimizer.param_groups
    previous = groups[0].get("phase")
    for group in groups:
        group.update(settings)
    return settings if "phase" in settings and previous != settings["phase"] and step > 0 else None


# ---------------------------------------------------------------- multi-tensor update kernels (torch._foreach_*)

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


def lars_trust_factors(w_norms, g_norms, lr, weight_decay, trust_coefficient, eps, mode):
    """The factor multiplying (g + wd*w) of tensors with norms ``w_norms`` and ``g_norms`` (device tensors, one
    tensor's 0-dim norms or many stacked).

    local_lr = eta * ||w|| / (||g|| + wd * ||w|| + eps) (You et al. 2017).
    mode "scale": factor = local_lr.
    mode "clip" (LARC): factor = min(local_lr / lr, 1), so the effective lr is min(local_lr, lr).
    In both modes the factor is 1 when ||w|| == 0 or ||g|| == 0 (no adaptation). ``mode`` was checked by the
    caller.
    """
    local_lr = trust_coefficient * w_norms / (g_norms + weight_decay * w_norms + eps)  # eta*||w||/(||g||+wd*||w||+eps)
    if mode == "clip":
        local_lr = torch.clamp(local_lr / lr, max=1.0)  # LARC: min(local_lr / lr, 1)
    adapt = (w_norms > 0) & (g_norms > 0)
    return torch.where(adapt, local_lr, torch.ones_like(local_lr))  # factor = 1 if a norm is 0


def _momentum_sgd_(params, directions, momentum_bufs, lr, momentum):
    """buf = momentum * buf + d; p <- p - lr * buf (no dampening, no Nesterov)."""
    torch._foreach_mul_(momentum_bufs, momentum)
    torch._foreach_add_(momentum_bufs, directions)  # buf = mu*buf + d
    torch._foreach_add_(params, momentum_bufs, alpha=-lr)  # p <- p - lr*buf


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
    require_choice({"mode": mode}, "mode", LARS_MODES)
    on = [i for i, lars in enumerate(apply_lars) if lars]
    off = [i for i, lars in enumerate(apply_lars) if not lars]
    lars_p, lars_g, lars_b, directions = ([values[i] for i in on] for values in (params, grads, momentum_bufs, scratch))
    plain_p, plain_g, plain_b = ([values[i] for i in off] for values in (params, grads, momentum_bufs))
    if lars_p:
        factors = lars_trust_factors(torch.stack(torch._foreach_norm(lars_p)), torch.stack(torch._foreach_norm(lars_g)),
                                     lr, weight_decay, trust_coefficient, eps, mode).unbind(0)
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
            factor = lars_trust_factors(torch.linalg.vector_norm(p), torch.linalg.vector_norm(g), lr, weight_decay,
                                        trust_coefficient, eps, mode)
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


# ---------------------------------------------------------------- shared step helpers

def _bucket(params, key_of):
    """Split params into lists sharing ``key_of(p)`` (one kernel call per device/dtype/step)."""
    buckets = {}
    for p in params:
        buckets.setdefault(key_of(p), []).append(p)
    return list(buckets.values())


def _zeros_state(state, keys, p):
    for key in keys:
        if key not in state:
            state[key] = torch.zeros_like(p, memory_format=torch.preserve_format)


def _scratch(buffers: dict, params: list) -> list[torch.Tensor]:
    """One reusable buffer like each param, kept in ``buffers`` (the optimizer's, outside its state: never
    checkpointed; cleared by ``load_state_dict``, which is where a moved model's optimizer is reloaded)."""
    for p in params:
        if p not in buffers:
            buffers[p] = torch.empty_like(p, memory_format=torch.preserve_format)
    return [buffers[p] for p in params]


def device_scalars(device: torch.device, **values: float) -> list[torch.Tensor]:
    """0-dim FP64 tensors on ``device`` holding ``values``, one per name, reused from step to step (written with
    ``fill_``, which on a GPU is a kernel launch with the value as its argument: no host sync)."""
    slots = _DEVICE_SCALARS.setdefault(device, {})
    tensors = []
    for name, value in values.items():
        if name not in slots:
            slots[name] = torch.zeros((), dtype=torch.float64, device=device)
        tensors.append(slots[name].fill_(value))
    return tensors


_DEVICE_SCALARS: dict = {}


def _adabound_update(opt_state, buffers, params, group, alpha, step_key):
    """AdaBound-update ``params``; ``state[step_key]`` is the bias-correction step k. ``group["fused"]``: the
    compiled kernel, with the step size and the bounds in device tensors; else the foreach kernel, with its
    scratch from ``buffers``."""
    for p in params:
        state = opt_state[p]
        _zeros_state(state, ("exp_avg", "exp_avg_sq"), p)
        state.setdefault(step_key, 0)
    beta1, beta2 = group["betas"]
    for bucket in _bucket(params, lambda p: (p.device, p.dtype, opt_state[p][step_key])):
        step = opt_state[bucket[0]][step_key] + 1
        tensors = (bucket, [p.grad for p in bucket], [opt_state[p]["exp_avg"] for p in bucket],
                   [opt_state[p]["exp_avg_sq"] for p in bucket])
        if group.get("fused"):
            scheduled = device_scalars(bucket[0].device, step_size=adabound_step_size(step, alpha, beta1, beta2),
                                       lower=group["lower_bound"], upper=group["upper_bound"])
            compiled(adabound_tensor_step_)(*tensors, *scheduled, beta1, beta2, group["eps"], group["weight_decay"])
        else:
            adabound_step_(*tensors, _scratch(buffers, bucket), step, alpha, beta1, beta2, group["eps"],
                           group["weight_decay"],
                           group["lower_bound"], group["upper_bound"])
        for p in bucket:
            opt_state[p][step_key] = step


def _lars_update(opt_state, buffers, params, group, mode):
    """LARS-SGD-update ``params`` with zero-initialised momentum buffers (``group["fused"]``: compiled, the lr in a
    device tensor; else foreach, with its scratch from ``buffers``)."""
    for p in params:
        _zeros_state(opt_state[p], ("momentum_buffer",), p)
    for bucket in _bucket(params, lambda p: (p.device, p.dtype)):
        tensors = (bucket, [p.grad for p in bucket], [opt_state[p]["momentum_buffer"] for p in bucket])
        if group.get("fused"):
            (lr,) = device_scalars(bucket[0].device, lr=group["lr"])
            compiled(lars_tensor_step_)(*tensors, lr, group["momentum"], group["weight_decay"],
                                        group["trust_coefficient"], group["eps"], mode, [group["lars"]] * len(bucket))
        else:
            lars_sgd_step_(*tensors, _scratch(buffers, bucket), group["lr"], group["momentum"],
                           group["weight_decay"],
                           group["trust_coefficient"], group["eps"], mode, group["lars"])


class _GroupValidatingOptimizer(Optimizer):
    """Validates each param group (defaults merged in) when it is added or loaded, and the values that
    ``apply_schedule`` writes (``validate``, through ``OptimizerBundle.check_schedule``); ``step()`` trusts them."""

    RULES: dict = {}  # group key -> (check, its arguments), in the order they are checked

    @property
    def scratch(self) -> dict:
        """Reusable per-param buffers for the foreach kernels (not state: never saved or loaded)."""
        return self.__dict__.setdefault("_scratch", {})

    def validate(self, group: dict, keys=None) -> None:
        """One ValueError line for the first bad value of ``keys`` in ``group`` (default: every key in RULES)."""
        for key in self.RULES if keys is None else keys:
            rule = self.RULES.get(key)
            if rule:
                rule[0](group, key, *rule[1:])

    def add_param_group(self, param_group):
        self.validate({**self.defaults, **param_group})
        super().add_param_group(param_group)

    def load_state_dict(self, state_dict):
        """As torch's, but this run's RUN_CHOICE_KEYS stay (``fused`` says how the update runs, not what it
        computes), so a checkpoint from a run with the other choice, or from before the key existed, resumes."""
        kept = [{key: group[key] for key in RUN_CHOICE_KEYS if key in group} for group in self.param_groups]
        self.scratch.clear()  # remade like the params as they are now
        super().load_state_dict(state_dict)
        for group, choices in zip(self.param_groups, kept):
            group.update(choices)
            self.validate({**self.defaults, **group})

    @torch.no_grad()
    def step(self, closure=None):
        """Each group's ``_update`` (defined by each optimizer below) of its parameters that have a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if any(p.grad.is_sparse for p in params):
                raise RuntimeError("sparse gradients are not supported")
            if params:
                self._update(params, group)
        return loss


# ---------------------------------------------------------------- optimizers

class LARS(_GroupValidatingOptimizer):
    """SGD with momentum and layer-wise adaptive rate scaling (You et al. 2017).

    mode "scale": d = (g + wd*w) * local_lr; mode "clip" (LARC): d = (g + wd*w) * min(local_lr/lr, 1).
    buf = momentum*buf + d; p <- p - lr*buf. Groups with ``lars=False``: d = g, no weight decay.
    """

    RULES = lars_rules("mode")

    def __init__(self, params, lr=0.1, momentum=0.9, weight_decay=1e-4, trust_coefficient=0.02,
                 eps=1e-8, mode="scale"):
        defaults = dict(lr=lr, momentum=momentum, weight_decay=weight_decay,
                        trust_coefficient=trust_coefficient, eps=eps, mode=mode, lars=True)
        super().__init__(params, defaults)

    def _update(self, params: list, group: dict) -> None:
        _lars_update(self.state, self.scratch, params, group, group["mode"])


class LinearScalingAdaBound(_GroupValidatingOptimizer):
    """AdaBound (Luo et al. 2019) with externally scheduled bounds.

    ``lr`` is AdaBound's alpha. ``lower_bound``/``upper_bound`` are group keys the trainer sets
    before each step: from `schedules.adabound_bounds` (linear-scaling AdaBound, Lu et al. 2020) or from
    `schedules.reference_adabound_bounds` (reference AdaBound baseline).
    """

    RULES = {**adabound_rules("lr"), "fused": (require_bool,)}

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-4,
                 lower_bound=0.0, upper_bound=math.inf, fused=False):
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                        lower_bound=lower_bound, upper_bound=upper_bound, fused=fused)
        super().__init__(params, defaults)

    def _update(self, params: list, group: dict) -> None:
        _adabound_update(self.state, self.scratch, params, group, group["lr"], "step")


class HybridOptimizer(_GroupValidatingOptimizer):
    """Linear-scaling AdaBound warmup, then LARS-SGD, in one optimizer (Lu et al. 2020, §2.2.1).

    ``group["phase"]`` selects the update: "adabound" uses ``alpha``, ``betas``, ``eps``,
    ``weight_decay`` and the bounds; "sgd" uses ``lr``, ``momentum``, ``weight_decay``,
    ``trust_coefficient``, ``eps``, ``lars_mode`` and ``lars``. ``fused``: both run as compiled kernels
    (``compiled``) with the scheduled values in device tensors, so the phase switch and the schedule
    never recompile them.

    Switching phase: the first step of a phase starts that phase's buffers from zero and drops
    the other phase's buffers from the state (momentum_buffer, or exp_avg/exp_avg_sq with the
    bias-correction count ``adabound_step``). ``state["step"]`` counts all updates of a param.
    """

    RULES = {"phase": (require_choice, PHASES), "fused": (require_bool,), **adabound_rules("alpha"),
             **lars_rules("lars_mode")}

    def __init__(self, params, lr=0.1, alpha=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-4,
                 momentum=0.9, trust_coefficient=0.02, lars_mode="scale", lower_bound=0.0,
                 upper_bound=math.inf, phase="adabound", fused=False):
        defaults = dict(lr=lr, alpha=alpha, betas=betas, eps=eps, weight_decay=weight_decay,
                        momentum=momentum, trust_coefficient=trust_coefficient,
                        lars_mode=lars_mode, lower_bound=lower_bound, upper_bound=upper_bound,
                        phase=phase, lars=True, fused=fused)
        super().__init__(params, defaults)

    def _update(self, params: list, group: dict) -> None:
        stale = _STALE_KEYS.get(group["phase"])
        if stale is None:  # a phase written into the group past `validate`: the same one line
            require_choice(group, "phase", PHASES)
        # the other phase's buffers (``stale``) go, so the new phase starts from zero. A group's params change phase
        # together, so one look at the first param tells whether this step is a switch; the sweep runs only then
        if any(key in self.state[params[0]] for key in stale):
            for p in params:
                for key in stale:
                    self.state[p].pop(key, None)
        if group["phase"] == "adabound":
            _adabound_update(self.state, self.scratch, params, group, group["alpha"], "adabound_step")
        else:
            _lars_update(self.state, self.scratch, params, group, group["lars_mode"])
        for p in params:
            self.state[p]["step"] = self.state[p].get("step", 0) + 1

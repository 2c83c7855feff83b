"""``torch.optim.Optimizer`` subclasses for the hybrid gradient descent, built on `kernels`.

Horovod's ``DistributedOptimizer`` rebuilds an optimizer as ``cls(optimizer.param_groups)``, so
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
"""
from __future__ import annotations

import math

import torch
from torch.optim import Optimizer

from hybridtrain.optim.kernels import (
    LARS_MODES,
    adabound_step_,
    adabound_step_size,
    adabound_tensor_step_,
    compiled,
    lars_sgd_step_,
    lars_tensor_step_,
)
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


# ---------------------------------------------------------------- group validation: each check is (group, key, ...)

def _require_at_least(group, key, minimum):
    value = group[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= minimum:
        raise ValueError(f"{key} must be a number >= {minimum}, got {value!r}")


def _require_in_unit_interval(group, key):
    value = group[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
        raise ValueError(f"{key} must be in [0, 1), got {value!r}")


def _require_positive(group, key):
    value = group[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{key} must be a number > 0, got {value!r}")


def _require_choice(group, key, choices):
    if group[key] not in choices:
        raise ValueError(f"{key} must be one of {choices}, got {group[key]!r}")


def _require_bool(group, key):
    if not isinstance(group[key], bool):
        raise ValueError(f"{key} must be True or False, got {group[key]!r}")


def _require_betas(group, key):
    betas = group[key]
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"betas must be a pair (beta1, beta2) with each in [0, 1), got {betas!r}")
    for name, beta in zip(("betas[0]", "betas[1]"), betas):
        if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not 0.0 <= beta < 1.0:
            raise ValueError(f"{name} must be in [0, 1), got {beta!r}")


def _require_upper_bound(group, key):
    upper = group[key]
    if isinstance(upper, bool) or not isinstance(upper, (int, float)) or math.isnan(upper):
        raise ValueError(f"{key} must be a number (inf allowed), got {upper!r}")
    if upper < group["lower_bound"]:
        raise ValueError(f"{key} ({upper!r}) must be >= lower_bound ({group['lower_bound']!r})")


def _adabound_rules(alpha_key):
    """The AdaBound update's keys -> (check, its arguments), in the order they are checked."""
    return {alpha_key: (_require_at_least, 0.0), "betas": (_require_betas,), "eps": (_require_at_least, 0.0),
            "weight_decay": (_require_at_least, 0.0), "lower_bound": (_require_at_least, 0.0),
            "upper_bound": (_require_upper_bound,)}


def _lars_rules(mode_key):
    """The LARS-SGD update's keys -> (check, its arguments)."""
    return {"lr": (_require_at_least, 0.0), "momentum": (_require_in_unit_interval,),
            "weight_decay": (_require_at_least, 0.0), "trust_coefficient": (_require_positive,),
            "eps": (_require_at_least, 0.0), mode_key: (_require_choice, LARS_MODES), "lars": (_require_bool,)}


# ---------------------------------------------------------------- shared step helpers

def _params_with_grad(group):
    params = [p for p in group["params"] if p.grad is not None]
    for p in params:
        if p.grad.is_sparse:
            raise RuntimeError("sparse gradients are not supported")
    return params


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

    def _run_closure(self, closure):
        if closure is None:
            return None
        with torch.enable_grad():
            return closure()

    @torch.no_grad()
    def step(self, closure=None):
        """Each group's ``_update`` (defined by each optimizer below) of its parameters that have a gradient."""
        loss = self._run_closure(closure)
        for group in self.param_groups:
            params = _params_with_grad(group)
            if params:
                self._update(params, group)
        return loss


# ---------------------------------------------------------------- optimizers

class LARS(_GroupValidatingOptimizer):
    """SGD with momentum and layer-wise adaptive rate scaling (You et al. 2017).

    mode "scale": d = (g + wd*w) * local_lr; mode "clip" (LARC): d = (g + wd*w) * min(local_lr/lr, 1).
    buf = momentum*buf + d; p <- p - lr*buf. Groups with ``lars=False``: d = g, no weight decay.
    """

    RULES = _lars_rules("mode")

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
    before each step: from `schedules.adabound_bounds` (linear-scaling AdaBound, seed 001) or from
    `schedules.reference_adabound_bounds` (reference AdaBound baseline).
    """

    RULES = {**_adabound_rules("lr"), "fused": (_require_bool,)}

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-4,
                 lower_bound=0.0, upper_bound=math.inf, fused=False):
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                        lower_bound=lower_bound, upper_bound=upper_bound, fused=fused)
        super().__init__(params, defaults)

    def _update(self, params: list, group: dict) -> None:
        _adabound_update(self.state, self.scratch, params, group, group["lr"], "step")


class HybridOptimizer(_GroupValidatingOptimizer):
    """Linear-scaling AdaBound warmup, then LARS-SGD, in one optimizer (seed 001, 2.2.1).

    ``group["phase"]`` selects the update: "adabound" uses ``alpha``, ``betas``, ``eps``,
    ``weight_decay`` and the bounds; "sgd" uses ``lr``, ``momentum``, ``weight_decay``,
    ``trust_coefficient``, ``eps``, ``lars_mode`` and ``lars``. ``fused``: both run as compiled kernels
    (``kernels.compiled``) with the scheduled values in device tensors, so the phase switch and the schedule
    never recompile them.

    Switching phase: the first step of a phase starts that phase's buffers from zero and drops
    the other phase's buffers from the state (momentum_buffer, or exp_avg/exp_avg_sq with the
    bias-correction count ``adabound_step``). ``state["step"]`` counts all updates of a param.
    """

    RULES = {"phase": (_require_choice, PHASES), "fused": (_require_bool,), **_adabound_rules("alpha"),
             **_lars_rules("lars_mode")}

    def __init__(self, params, lr=0.1, alpha=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-4,
                 momentum=0.9, trust_coefficient=0.02, lars_mode="scale", lower_bound=0.0,
                 upper_bound=math.inf, phase="adabound", fused=False):
        defaults = dict(lr=lr, alpha=alpha, betas=betas, eps=eps, weight_decay=weight_decay,
                        momentum=momentum, trust_coefficient=trust_coefficient,
                        lars_mode=lars_mode, lower_bound=lower_bound, upper_bound=upper_bound,
                        phase=phase, lars=True, fused=fused)
        super().__init__(params, defaults)

    def _enter_phase(self, params, stale):
        """Drop the buffers of the other phase (``stale``), so the new phase starts from zero.

        A group's params change phase together, so one look at the first param tells whether this
        step is a switch; the per-param sweep runs only then, not on every step.
        """
        if not any(key in self.state[params[0]] for key in stale):
            return
        for p in params:
            state = self.state[p]
            for key in stale:
                state.pop(key, None)

    def _update(self, params: list, group: dict) -> None:
        stale = _STALE_KEYS.get(group["phase"])
        if stale is None:  # a phase written into the group past `validate`: the same one line
            _require_choice(group, "phase", PHASES)
        self._enter_phase(params, stale)
        if group["phase"] == "adabound":
            _adabound_update(self.state, self.scratch, params, group, group["alpha"], "adabound_step")
        else:
            _lars_update(self.state, self.scratch, params, group, group["lars_mode"])
        for p in params:
            self.state[p]["step"] = self.state[p].get("step", 0) + 1

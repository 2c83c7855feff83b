"""``create_optimizer``: the optimizer and its per-step schedule, built from the config.

The schedule is a pure function ``schedule(step) -> {param-group key: value}`` that the trainer applies
before every optimizer step, so any recipe plugs in without touching the training loop.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch

from hybridtrain.errors import UserError
from hybridtrain.optim import bounds, schedules
from hybridtrain.optim.optimizers import HybridOptimizer, LinearScalingAdaBound


def is_bn_or_bias(name: str, param: torch.nn.Parameter) -> bool:
    """BatchNorm gammas/betas and biases are 1-D; they get no weight decay (and no LARS)."""
    return param.ndim <= 1


def parameter_groups(model: torch.nn.Module, weight_decay: float, decay_bn_and_bias: bool) -> list[dict]:
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (no_decay if is_bn_or_bias(name, p) and not decay_bn_and_bias else decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay, "lars": True}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0, "lars": False})
    return groups


@dataclass
class OptimizerBundle:
    optimizer: torch.optim.Optimizer
    schedule: Callable[[int], dict]
    on_phase_change: Callable[[int, dict], None] | None = None

    def apply_schedule(self, step: int) -> dict:
        settings = self.schedule(step)
        previous = self.optimizer.param_groups[0].get("phase")
        for group in self.optimizer.param_groups:
            group.update(settings)
        if self.on_phase_change and "phase" in settings and previous != settings["phase"] and step > 0:
            self.on_phase_change(step, settings)
        return settings


def hybrid_schedule(step: int, o, world_size: int, iters_per_epoch: int) -> dict:
    """AdaBound with the paper's bounds for epochs [0, T), then LARS-SGD at lr*N*kappa^(epoch-T)."""
    epoch, k = step // iters_per_epoch, step + 1
    if epoch < o.adabound_epochs:
        t = bounds.bound_progress(k, iters_per_epoch, o.bound_granularity)
        lower, upper = bounds.adabound_bounds(t, o.adabound_epochs, o.lr, world_size, o.betas[1])
        # lr is the SGD phase's starting rate lr*N (logged; the AdaBound step uses alpha and the bounds)
        return {"phase": "adabound", "lower_bound": lower, "upper_bound": upper,
                "lr": schedules.linear_scaled_lr(o.lr, world_size)}
    return {"phase": "sgd", "lr": bounds.sgd_decay_lr(epoch, o.adabound_epochs, o.lr, world_size, o.kappa,
                                                      o.kappa_origin)}


def adabound_schedule(step: int, o, world_size: int) -> dict:
    """The reference AdaBound bounds around final_lr = lr*N (linear scaling)."""
    lower, upper = bounds.reference_adabound_bounds(step + 1, schedules.linear_scaled_lr(o.lr, world_size),
                                                    o.adabound_gamma)
    return {"lower_bound": lower, "upper_bound": upper}


def create_schedule(cfg, world_size: int, iters_per_epoch: int) -> Callable[[int], dict]:
    """The per-step settings for N = ``world_size`` and ``iters_per_epoch`` steps per epoch. Elastic training
    builds it anew when the number of ranks changes."""
    o = cfg.optim
    if o.name == "hybrid":
        return partial(hybrid_schedule, o=o, world_size=world_size, iters_per_epoch=iters_per_epoch)
    if o.name == "adabound":
        return partial(adabound_schedule, o=o, world_size=world_size)
    common = dict(iters_per_epoch=iters_per_epoch, base_lr=o.lr, world_size=world_size,
                  total_epochs=cfg.train.epochs, milestones=o.milestones, decay_factor=o.decay_factor)
    if o.name == "goyal":
        lr_at = partial(schedules.goyal_lr, warmup_epochs=o.warmup_epochs, **common)
    elif o.name == "sgd":
        lr_at = partial(schedules.sgd_lr, **common)
    else:
        raise UserError(f"unknown optim.name '{o.name}': choose hybrid, adabound, goyal or sgd")
    return lambda step: {"lr": lr_at(step)}


def create_optimizer(model: torch.nn.Module, cfg, world_size: int, iters_per_epoch: int) -> OptimizerBundle:
    o = cfg.optim
    schedule = create_schedule(cfg, world_size, iters_per_epoch)
    groups = parameter_groups(model, o.weight_decay, o.decay_bn_and_bias)
    if o.name == "hybrid":
        lars = o.lars != "none"
        for group in groups:
            group["lars"] = group["lars"] and lars
        optimizer = HybridOptimizer(groups, lr=o.lr * world_size, alpha=o.alpha, betas=tuple(o.betas), eps=o.eps,
                                    momentum=o.momentum, trust_coefficient=o.trust_coefficient,
                                    lars_mode=o.lars if lars else "scale", fused=o.fused)
    elif o.name == "adabound":
        optimizer = LinearScalingAdaBound(groups, lr=o.alpha, betas=tuple(o.betas), eps=o.eps, fused=o.fused)
    else:
        optimizer = torch.optim.SGD(groups, lr=schedule(0)["lr"], momentum=o.momentum)
    return OptimizerBundle(optimizer, schedule)

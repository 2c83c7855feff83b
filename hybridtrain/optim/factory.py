"""``create_optimizer``: the optimizer and its per-step schedule, built from the config.

The schedule is a pure function ``schedule(step) -> {param-group key: value}`` that the trainer applies
before every optimizer step, so any recipe plugs in without touching the training loop.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch

from ..errors import UserError
from . import schedules


def is_bn_or_bias(name: str, param: torch.nn.Parameter) -> bool:
    """BatchNorm gammas/betas and biases are 1-D; they get no weight decay (and no LARS)."""
    return param.ndim <= 1


def parameter_groups(model: torch.nn.Module, weight_decay: float, decay_bn_and_bias: bool) -> list[dict]:
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (no_decay if is_bn_or_bias(name, p) and not decay_bn_and_bias else decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


@dataclass
class OptimizerBundle:
    optimizer: torch.optim.Optimizer
    schedule: Callable[[int], dict]

    def apply_schedule(self, step: int) -> dict:
        settings = self.schedule(step)
        for group in self.optimizer.param_groups:
            group.update(settings)
        return settings


def create_optimizer(model: torch.nn.Module, cfg, world_size: int, iters_per_epoch: int) -> OptimizerBundle:
    o = cfg.optim
    groups = parameter_groups(model, o.weight_decay, o.decay_bn_and_bias)
    common = dict(iters_per_epoch=iters_per_epoch, base_lr=o.lr, world_size=world_size,
                  total_epochs=cfg.train.epochs, milestones=o.milestones, decay_factor=o.decay_factor)
    if o.name == "goyal":
        lr_at = partial(schedules.goyal_lr, warmup_epochs=o.warmup_epochs, **common)
    elif o.name == "sgd":
        lr_at = partial(schedules.sgd_lr, **common)
    else:
        raise UserError(f"unknown optim.name '{o.name}'")
    optimizer = torch.optim.SGD(groups, lr=lr_at(0), momentum=o.momentum)
    return OptimizerBundle(optimizer, lambda step: {"lr": lr_at(step)})

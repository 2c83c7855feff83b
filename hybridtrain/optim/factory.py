"""The optimizer registry: ``OPTIMIZERS`` holds one `Spec` per ``optim.name``, and ``create_optimizer`` builds the
optimizer and its per-step schedule from the config.

The schedule is a pure function ``schedule(step) -> {param-group key: value}`` (`optim.schedules`) that the
epoch applies before every optimizer step (``optimizers.apply_schedule``), so any recipe plugs in without touching
the training loop. The engine, config and the bench ask a name's `Spec` what they need to know of it, instead of
comparing names.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from operator import attrgetter
from typing import Callable

import torch

from hybridtrain.errors import UserError
from hybridtrain.optim import schedules
from hybridtrain.optim.optimizers import LARS, HybridOptimizer, LinearScalingAdaBound


def parameter_groups(model: torch.nn.Module, weight_decay: float, decay_bn_and_bias: bool) -> list[dict]:
    decay, no_decay = [], []
    for p in model.parameters():  # BatchNorm gammas/betas and biases are 1-D: no weight decay (and no LARS)
        (no_decay if p.ndim <= 1 and not decay_bn_and_bias else decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay, "lars": True}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0, "lars": False})
    return groups


def _build_hybrid(groups: list[dict], o, first: dict) -> torch.optim.Optimizer:
    lars = o.lars != "none"
    for group in groups:
        group["lars"] = group["lars"] and lars
    return HybridOptimizer(groups, lr=first["lr"], alpha=o.alpha, betas=tuple(o.betas), eps=o.eps,
                           momentum=o.momentum, trust_coefficient=o.trust_coefficient,
                           lars_mode=o.lars if lars else "scale", fused=o.fused)


def _build_adabound(groups: list[dict], o, first: dict) -> torch.optim.Optimizer:
    return LinearScalingAdaBound(groups, lr=o.alpha, betas=tuple(o.betas), eps=o.eps, fused=o.fused)


def _build_sgd(groups: list[dict], o, first: dict) -> torch.optim.Optimizer:
    return torch.optim.SGD(groups, lr=first["lr"], momentum=o.momentum)


def _build_mlperf(groups: list[dict], o, first: dict) -> torch.optim.Optimizer:
    """MLPerf's LARS (lars_optimizer.py): trust ratio eta*||w||/(||g|| + wd*||w|| + eps) on the decayed group; BN
    parameters and biases (optim.decay_bn_and_bias false) get neither LARS nor weight decay, as its skip_list."""
    return LARS(groups, lr=first["lr"], momentum=o.momentum, weight_decay=o.weight_decay,
                trust_coefficient=o.mlperf_trust_coefficient, eps=o.mlperf_eps, mode="scale")


@dataclass(frozen=True)
class Spec:
    """What an ``optim.name`` is: how it is built and scheduled, and what config, engine and bench ask of it."""
    build: Callable[[list, object, dict], torch.optim.Optimizer]  # (param groups, cfg.optim, schedule(0))
    schedule: Callable[..., dict]  # schedules.*_schedule(step, o, world_size, iters_per_epoch, total_epochs)
    check: Callable[..., None] = schedules.check_common  # (cfg.optim, world_size, iters_per_epoch), once
    phases: dict = field(default_factory=dict)  # the group "phase" values it goes through -> what each runs
    phase_switch_epoch: Callable[[object], int | None] = lambda o: None  # cfg.optim -> the 0-based epoch of phase 2
    fusable: bool = False  # optim.fused: compiled kernels exist for its updates
    needs_fp32_state: bool = False  # its state cannot be FP16 (precision.mode=fp16_pure refuses it)

    def fused_switch_epoch(self, o) -> int | None:
        """The 0-based epoch whose first steps compile the fused kernel of the next phase; None without one."""
        return self.phase_switch_epoch(o) if o.fused else None


OPTIMIZERS = {
    "hybrid": Spec(_build_hybrid, schedules.hybrid_schedule, schedules.check_hybrid,
                   phases=dict(zip(schedules.HYBRID_PHASES, ("adabound", "sgd+lars"))),
                   phase_switch_epoch=attrgetter("adabound_epochs"), fusable=True, needs_fp32_state=True),
    "adabound": Spec(_build_adabound, schedules.adabound_schedule, schedules.check_adabound, fusable=True,
                     needs_fp32_state=True),
    "goyal": Spec(_build_sgd, schedules.goyal_schedule),
    "sgd": Spec(_build_sgd, schedules.sgd_schedule),
    "mlperf": Spec(_build_mlperf, schedules.mlperf_schedule),
}


def optimizer_spec(o) -> Spec:
    """The registry's entry for ``o.name`` (``o``: the config's optim section)."""
    if o.name not in OPTIMIZERS:
        raise UserError(f"unknown optim.name '{o.name}': choose {', '.join(OPTIMIZERS)}")
    return OPTIMIZERS[o.name]


@dataclass
class OptimizerBundle:
    optimizer: torch.optim.Optimizer
    schedule: Callable[[int], dict]

    def check_schedule(self, steps) -> None:
        """The schedule's values at ``steps`` by the optimizer's rules (one ValueError line for a bad one). The
        values move monotonically within a phase, so its first and last steps are the extremes to check."""
        validate = getattr(self.optimizer, "validate", None)
        for step in steps if validate else ():
            settings = self.schedule(step)
            validate({**self.optimizer.param_groups[0], **settings}, settings)


def create_schedule(cfg, world_size: int, iters_per_epoch: int) -> Callable[[int], dict]:
    """The per-step settings for N = ``world_size`` and ``iters_per_epoch`` steps per epoch, its arguments checked
    here once. Elastic training builds it anew when the number of ranks changes."""
    spec = optimizer_spec(cfg.optim)
    spec.check(cfg.optim, world_size, iters_per_epoch)
    return partial(spec.schedule, o=cfg.optim, world_size=world_size, iters_per_epoch=iters_per_epoch,
                   total_epochs=cfg.train.epochs)


def phase_edges(cfg, iters_per_epoch: int) -> list[int]:
    """The first and last step of each phase: where a schedule's values are at their extremes."""
    last = max(cfg.train.epochs * iters_per_epoch - 1, 0)
    switch = optimizer_spec(cfg.optim).phase_switch_epoch(cfg.optim)
    inner = [] if switch is None else [switch * iters_per_epoch - 1, switch * iters_per_epoch]
    return sorted({0, last, *(s for s in inner if 0 <= s <= last)})


def create_optimizer(model: torch.nn.Module, cfg, world_size: int, iters_per_epoch: int) -> OptimizerBundle:
    schedule = create_schedule(cfg, world_size, iters_per_epoch)
    groups = parameter_groups(model, cfg.optim.weight_decay, cfg.optim.decay_bn_and_bias)
    optimizer = optimizer_spec(cfg.optim).build(groups, cfg.optim, schedule(0))
    bundle = OptimizerBundle(optimizer, schedule)
    bundle.check_schedule(phase_edges(cfg, iters_per_epoch))
    return bundle

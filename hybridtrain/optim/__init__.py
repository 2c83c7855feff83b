"""Optimizers, schedules and bounds (``create_optimizer`` builds them from the config; ``OPTIMIZERS`` is the registry).

May import: config, errors.
"""
from hybridtrain.optim.factory import OPTIMIZERS, OptimizerBundle, create_optimizer, create_schedule, optimizer_spec
from hybridtrain.optim.optimizers import apply_schedule
from hybridtrain.optim.schedules import goyal_lr, step_decay_factor

__all__ = ["OPTIMIZERS", "OptimizerBundle", "apply_schedule", "create_optimizer", "create_schedule", "optimizer_spec",
           "goyal_lr", "step_decay_factor"]

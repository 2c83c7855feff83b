"""Optimizers, schedules and bounds (``create_optimizer`` builds them from the config)."""
from .factory import OptimizerBundle, create_optimizer, parameter_groups
from .schedules import goyal_lr, linear_scaled_lr, sgd_lr, step_decay_factor

__all__ = ["OptimizerBundle", "create_optimizer", "parameter_groups", "goyal_lr", "linear_scaled_lr", "sgd_lr",
           "step_decay_factor"]

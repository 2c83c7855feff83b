"""Optimizers, schedules and bounds (``create_optimizer`` builds them from the config; ``OPTIMIZERS`` is the registry).

May import: config, errors.
"""
from hybridtrain.optim.factory import (
    OPTIMIZERS,
    OptimizerBundle,
    Spec,
    create_optimizer,
    create_schedule,
    optimizer_spec,
    parameter_groups,
)
from hybridtrain.optim.optimizers import LARS, HybridOptimizer, LinearScalingAdaBound, apply_schedule
from hybridtrain.optim.schedules import (
    adabound_bounds,
    bound_progress,
    goyal_lr,
    linear_scaled_lr,
    reference_adabound_bounds,
    sgd_decay_lr,
    sgd_lr,
    step_decay_factor,
)

__all__ = ["OPTIMIZERS", "OptimizerBundle", "Spec", "apply_schedule", "create_optimizer", "create_schedule",
           "optimizer_spec", "parameter_groups", "goyal_lr", "linear_scaled_lr", "sgd_lr", "step_decay_factor",
           "adabound_bounds", "bound_progress", "reference_adabound_bounds", "sgd_decay_lr", "LARS",
           "HybridOptimizer", "LinearScalingAdaBound"]

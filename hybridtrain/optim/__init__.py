"""Optimizers, schedules and bounds (``create_optimizer`` builds them from the config).

May import: config, errors.
"""
from hybridtrain.optim.bounds import adabound_bounds, bound_progress, reference_adabound_bounds, sgd_decay_lr
from hybridtrain.optim.factory import OptimizerBundle, create_optimizer, create_schedule, parameter_groups
from hybridtrain.optim.optimizers import LARS, HybridOptimizer, LinearScalingAdaBound
from hybridtrain.optim.schedules import goyal_lr, linear_scaled_lr, sgd_lr, step_decay_factor

__all__ = ["OptimizerBundle", "create_optimizer", "create_schedule", "parameter_groups", "goyal_lr", "linear_scaled_lr",
           "sgd_lr",
           "step_decay_factor", "adabound_bounds", "bound_progress", "reference_adabound_bounds", "sgd_decay_lr",
           "LARS", "HybridOptimizer", "LinearScalingAdaBound"]

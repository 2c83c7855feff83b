"""The rules a param group's hyperparameters must meet, checked where the values are written: when a group is
added or loaded, and once for a whole schedule (``OptimizerBundle.check_schedule``), never at every step. Each
check is ``(group, key, *arguments)`` and raises one ValueError line naming the key, the rule and the value."""
from __future__ import annotations

import math

LARS_MODES = ("scale", "clip")


def require_at_least(group, key, minimum):
    value = group[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= minimum:
        raise ValueError(f"{key} must be a number >= {minimum}, got {value!r}")


def require_in_unit_interval(group, key):
    value = group[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
        raise ValueError(f"{key} must be in [0, 1), got {value!r}")


def require_positive(group, key):
    value = group[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{key} must be a number > 0, got {value!r}")


def require_choice(group, key, choices):
    if group[key] not in choices:
        raise ValueError(f"{key} must be one of {choices}, got {group[key]!r}")


def require_bool(group, key):
    if not isinstance(group[key], bool):
        raise ValueError(f"{key} must be True or False, got {group[key]!r}")


def require_betas(group, key):
    betas = group[key]
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"betas must be a pair (beta1, beta2) with each in [0, 1), got {betas!r}")
    for name, beta in zip(("betas[0]", "betas[1]"), betas):
        if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not 0.0 <= beta < 1.0:
            raise ValueError(f"{name} must be in [0, 1), got {beta!r}")


def require_upper_bound(group, key):
    upper = group[key]
    if isinstance(upper, bool) or not isinstance(upper, (int, float)) or math.isnan(upper):
        raise ValueError(f"{key} must be a number (inf allowed), got {upper!r}")
    if upper < group["lower_bound"]:
        raise ValueError(f"{key} ({upper!r}) must be >= lower_bound ({group['lower_bound']!r})")


def adabound_rules(alpha_key):
    """The AdaBound update's keys -> (check, its arguments), in the order they are checked."""
    return {alpha_key: (require_at_least, 0.0), "betas": (require_betas,), "eps": (require_at_least, 0.0),
            "weight_decay": (require_at_least, 0.0), "lower_bound": (require_at_least, 0.0),
            "upper_bound": (require_upper_bound,)}


def lars_rules(mode_key):
    """The LARS-SGD update's keys -> (check, its arguments)."""
    return {"lr": (require_at_least, 0.0), "momentum": (require_in_unit_interval,),
            "weight_decay": (require_at_least, 0.0), "trust_coefficient": (require_positive,),
            "eps": (require_at_least, 0.0), mode_key: (require_choice, LARS_MODES), "lars": (require_bool,)}

"""The rules a param group's hyperparameters must meet, checked where the values are written: when a group is
added or loaded, and once for a whole schedule (``OptimizerBundle.check_schedule``), never at every step. Each
check is ``(group, key, *arguments)`` and raises one ValueError line naming the key, the rule and the value."""
from __future__ import annotations

import math

LARS_MODES = ("scale", "clip")


def require_number(group, key, rule, ok):
    """A number (not a bool) for which ``ok`` holds (NaN never does), else '{key} must be {rule}'."""
    value = group[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not ok(value):
        raise ValueError(f"{key} must be {rule}, got {value!r}")


AT_LEAST_0 = (require_number, "a number >= 0.0", lambda value: value >= 0.0)
IN_UNIT_INTERVAL = (require_number, "in [0, 1)", lambda value: 0.0 <= value < 1.0)
POSITIVE = (require_number, "a number > 0", lambda value: value > 0)


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
        require_number({name: beta}, name, *IN_UNIT_INTERVAL[1:])


def require_upper_bound(group, key):
    require_number(group, key, "a number (inf allowed)", lambda value: not math.isnan(value))
    if group[key] < group["lower_bound"]:
        raise ValueError(f"{key} ({group[key]!r}) must be >= lower_bound ({group['lower_bound']!r})")


def adabound_rules(alpha_key):
    """The AdaBound update's keys -> (check, its arguments), in the order they are checked."""
    return {alpha_key: AT_LEAST_0, "betas": (require_betas,), "eps": AT_LEAST_0, "weight_decay": AT_LEAST_0,
            "lower_bound": AT_LEAST_0, "upper_bound": (require_upper_bound,)}


def lars_rules(mode_key):
    """The LARS-SGD update's keys -> (check, its arguments)."""
    return {"lr": AT_LEAST_0, "momentum": IN_UNIT_INTERVAL, "weight_decay": AT_LEAST_0, "trust_coefficient": POSITIVE,
            "eps": AT_LEAST_0, mode_key: (require_choice, LARS_MODES), "lars": (require_bool,)}

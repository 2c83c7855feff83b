"""Precision at step time: the forward's autocast context and loss scaling around the engine's step
(Lu et al. 2020; Micikevicius et al.): scale, all-reduce, unscale, skip a non-finite step, grow or shrink S. What
the policy decides before the run (dtypes, the model's casts, per-stage precision) is ``policy``'s."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from hybridtrain.errors import UserError
from hybridtrain.precision.policy import Policy, resolve_policy

# the precision modes with more range that a run diverging in each mode can move to (none from fp32 or fp64)
WIDER_MODES = {"mixed": "fp32", "layered": "mixed or fp32", "fp16_pure": "mixed or fp32"}
COUNTERS = ("clean_steps", "consecutive_overflows", "skipped_steps")  # a LossScaler's state besides its scale


class LossScaler:
    """Static or dynamic loss scaling around the optimizer an engine's wrap_optimizer returns. ``wider``: the
    precision.mode values the stop line suggests (WIDER_MODES), '' for none."""

    def __init__(self, mode: str, scale: float, growth_interval: int, max_consecutive_overflows: int,
                 wider: str = ""):
        self.mode, self.growth_interval, self.max_overflows = mode, growth_interval, max_consecutive_overflows
        self.wider = wider
        self.scale = float(scale) if mode != "none" else 1.0
        self.clean_steps = 0
        self.consecutive_overflows = 0
        self.skipped_steps = 0  # over the whole run
        self.device_scale: torch.Tensor | None = None  # S on the loss's device, kept equal to self.scale

    def backward(self, loss: torch.Tensor) -> None:
        (loss * self.scale_on(loss.device) if self.mode != "none" else loss).backward()

    def scale_on(self, device: torch.device) -> torch.Tensor:
        """S as a device tensor updated in place, so a CUDA graph that captured ``loss * S`` replays the current S."""
        if self.device_scale is None or self.device_scale.device != device:
            self.device_scale = torch.full((), self.scale, dtype=torch.float32, device=device)
        return self.device_scale

    def set_scale(self, scale: float) -> None:
        self.scale = scale
        if self.device_scale is not None:
            self.device_scale.fill_(scale)

    def step(self, optimizer) -> bool:
        """Unscale, step unless a gradient is not finite, update S; True if stepped. ``optimizer``: what the engine's
        wrap_optimizer returns (distributed.engines.SteppingOptimizer), already synchronized by the caller
        (step.train_step times that wait), so the update runs under its ``skip_synchronize()``.

        The check runs in every mode: the gradients are averaged over the ranks, so a NaN or inf loss on any
        rank makes every rank skip the same step, and no rank goes on alone."""
        finite = self.unscale(optimizer)
        if finite:
            with optimizer.skip_synchronize():
                optimizer.step()
        self.update(finite)
        return finite

    def unscale(self, optimizer) -> bool:
        """g <- g / S for every gradient; True when all are finite. Unscaled (S = 1), only the optimizer's last
        gradient is checked, the classifier's bias: a NaN or inf loss on any rank reaches it, and the check
        then costs nothing next to the step."""
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        if not grads:
            return True
        if self.mode == "none":
            grads = grads[-1:]
        found_inf = torch.zeros(1, device=grads[0].device)
        inv_scale = torch.full((1,), 1.0 / self.scale, device=grads[0].device)
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)  # one multi-tensor pass
        return not bool(found_inf)  # the step's one host sync: every rank must know whether to skip

    def update(self, finite: bool) -> None:
        """Dynamic: S <- S/2 on overflow, S <- 2S after ``growth_interval`` clean steps in a row."""
        if finite:
            self.consecutive_overflows = 0
            self.clean_steps += 1
            if self.mode == "dynamic" and self.clean_steps >= self.growth_interval:
                self.set_scale(self.scale * 2.0)
                self.clean_steps = 0
            return
        self.skipped_steps += 1
        self.consecutive_overflows += 1
        self.clean_steps = 0
        if self.mode == "dynamic":
            self.set_scale(max(self.scale * 0.5, 2.0 ** -24))
        if self.consecutive_overflows >= self.max_overflows:
            scale = f" (loss scale now {self.scale:g})" if self.mode != "none" else ""
            wider = f", use precision.mode={self.wider}," if self.wider else ""
            raise UserError(f"{self.consecutive_overflows} steps in a row had a NaN or inf loss or gradient on some "
                            f"rank{scale}: the run is diverging (or the data holds NaN); lower optim.lr{wider} or "
                            f"raise precision.max_consecutive_overflows; the last checkpoint is intact")

    def state_dict(self) -> dict:
        return {key: getattr(self, key) for key in ("scale", *COUNTERS)}

    def load_state_dict(self, state: dict) -> None:
        self.set_scale(float(state["scale"]))
        for key in COUNTERS:
            setattr(self, key, int(state[key]))


def create_scaler(p, policy: Policy) -> LossScaler:
    return LossScaler(policy.loss_scaling, p.loss_scale, p.growth_interval, p.max_consecutive_overflows,
                      WIDER_MODES.get(p.mode, ""))


@dataclass
class Precision:
    """The resolved precision policy and the loss scaler, as the training step needs them."""
    policy: Policy
    scaler: LossScaler

    def forward_context(self, device: torch.device):
        """Autocast around the whole forward pass in mixed mode; nothing otherwise."""
        dtype = self.policy.autocast_dtype
        return contextlib.nullcontext() if dtype is None else torch.autocast(device.type, dtype=dtype)


def create_precision(p) -> Precision:
    """A ``precision`` config section's policy and a fresh loss scaler for it."""
    policy = resolve_policy(p)
    return Precision(policy, create_scaler(p, policy))

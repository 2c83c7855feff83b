"""The exponential moving average of the weights (``train.ema_decay``), as NVIDIA's ConvNets and timm
keep it: every entry of the model's state dict, parameters and BN running statistics alike, averaged after each
optimizer step that was applied (a skipped step leaves it alone), with a decay warmup so that the early average
is not dominated by the random initial weights:

    d_n = min(decay, (1 + n) / (10 + n))      n = the updates made before this one (0 for the first)
    ema <- d_n * ema + (1 - d_n) * w

Integer buffers (BN's batch counters) are copied. The average lives in FP32 (FP64 for FP64 weights), also for FP16
weights (precision.mode=fp16_pure), whose 10-bit mantissa would swallow a (1 - d) = 0.001 step. The update is a
few ``torch._foreach_*`` calls with ``d_n`` a Python number from the host's own counter: no host sync.

Each rank keeps BN statistics of its own (paper 2.2.3), so each rank's average of them is its own too: they are
averaged over the ranks where the model's are (before every validation and checkpoint, ``average_bn``), and a
preempted epoch's checkpoint keeps each rank's (``bn_buffers``), as it does the model's.
"""
from __future__ import annotations

import contextlib

import torch

from hybridtrain.distributed import collectives as distributed
from hybridtrain.models.batchnorm import running_buffers


def ema_decay_at(decay: float, updates: int) -> float:
    """The decay of the EMA's update after ``updates`` earlier ones: min(decay, (1 + n) / (10 + n))."""
    return min(decay, (1.0 + updates) / (10.0 + updates))


class WeightEMA:
    """The EMA of ``model``'s state dict (see the module doc); ``update()`` after each applied step."""

    def __init__(self, model: torch.nn.Module, decay: float):
        self.model, self.decay, self.updates = model, decay, 0
        live = model.state_dict(keep_vars=True)
        self.names = list(live)
        self.sources = {name: tensor.detach() for name, tensor in live.items()}
        self.shadow = {name: src.clone().to(torch.promote_types(src.dtype, torch.float32))
                       if src.is_floating_point() else src.clone() for name, src in self.sources.items()}
        by_id = {id(tensor): name for name, tensor in live.items()}  # the buffers themselves, not detached views
        self.bn_names = [by_id[id(buf)] for buf in running_buffers(model) if id(buf) in by_id]
        averaged = [n for n in self.names if self.sources[n].is_floating_point()]
        same = [n for n in averaged if self.sources[n].dtype == self.shadow[n].dtype]
        self.same = ([self.shadow[n] for n in same], [self.sources[n] for n in same])
        self.cast = [n for n in averaged if n not in same]  # FP16/BF16 weights: averaged in FP32
        copied = [n for n in self.names if not self.sources[n].is_floating_point()]
        self.copied = ([self.shadow[n] for n in copied], [self.sources[n] for n in copied])

    @torch.no_grad()
    def update(self) -> None:
        """ema <- d_n ema + (1 - d_n) w for every floating entry (one foreach lerp), integers copied."""
        weight = 1.0 - ema_decay_at(self.decay, self.updates)
        if self.same[0]:
            torch._foreach_lerp_(self.same[0], self.same[1], weight)  # ema + (1-d)(w - ema) = d ema + (1-d) w
        if self.cast:
            torch._foreach_lerp_([self.shadow[n] for n in self.cast], [self.sources[n].float() for n in self.cast],
                                 weight)
        if self.copied[0]:
            torch._foreach_copy_(self.copied[0], self.copied[1])
        self.updates += 1

    def reset(self) -> None:
        """Start the average again from the model's current weights (a fresh run, after the broadcast)."""
        self.load_state_dict({"shadow": self.sources, "updates": 0})

    def state_dict(self) -> dict:
        return {"decay": self.decay, "updates": self.updates, "shadow": dict(self.shadow)}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        """Restore exactly what ``state_dict`` saved (the decay is the config's: it may change on resume)."""
        for name in self.names:
            self.shadow[name].copy_(state["shadow"][name])
        self.updates = int(state["updates"])

    def weights(self) -> dict[str, torch.Tensor]:
        """The average as the model's state dict (each entry in the model's dtype): final_weights=ema."""
        return {name: self.shadow[name].to(self.sources[name].dtype) for name in self.names}

    @torch.no_grad()
    def average_bn(self) -> None:
        """The averaged BN statistics' mean over the ranks, in FP32 (equal on every rank afterwards)."""
        if self.bn_names:
            averaged = distributed.allreduce_mean_fp32([self.shadow[n] for n in self.bn_names], "ema_bn_statistics")
            for name, value in zip(self.bn_names, averaged):
                self.shadow[name].copy_(value.view_as(self.shadow[name]))

    def bn_buffers(self) -> list[torch.Tensor]:
        """This rank's averaged BN statistics, for a preempted epoch's checkpoint."""
        return [self.shadow[n].detach().cpu().clone() for n in self.bn_names]

    @torch.no_grad()
    def load_bn_buffers(self, buffers: list[torch.Tensor]) -> None:
        for name, saved in zip(self.bn_names, buffers, strict=True):
            self.shadow[name].copy_(saved)

    @contextlib.contextmanager
    def swapped_in(self):
        """The model holds the average inside the block (to validate it) and its own weights again after."""
        with torch.no_grad():
            kept = {name: src.clone() for name, src in self.sources.items()}
            for name, src in self.sources.items():
                src.copy_(self.shadow[name])
        try:
            yield self.model
        finally:
            with torch.no_grad():
                for name, src in self.sources.items():
                    src.copy_(kept[name])


def create_ema(model: torch.nn.Module, train_cfg) -> WeightEMA | None:
    """The EMA train.ema_decay asks for, or None (0: off)."""
    return WeightEMA(model, train_cfg.ema_decay) if train_cfg.ema_decay > 0 else None

"""Compute precision (``precision.mode``) and loss scaling.

Modes:
- ``fp32``: the baseline. ``fp64``: everything in double (scheme 1 of the thesis "Low precision training of deep
  learning models").
- ``mixed`` (the paper's FP-mix; Micikevicius et al.): FP32 master weights and FP32 update; forward and backward
  under autocast in ``compute_dtype`` (fp16, or bf16 on modern GPUs). Autocast keeps exp/log/softmax and the
  reductions in FP32, and the loss is always taken in FP32 (``engine.step.classification_loss``).
- ``layered`` (Li et al. 2023): each named stage (stem, layer1..layer4, fc) runs in its own dtype: its input is
  cast to that dtype; a reduced stage runs under autocast, an FP32 stage with autocast off.
- ``fp16_pure`` (Cheng et al.): weights, activations, gradients and optimizer state all FP16, no master copy,
  with that paper's two stabilisers as options (see ``models.resnet`` for the BN swap and the 0.25 scale).

Loss scaling (Lu et al. 2020; Micikevicius et al., "Mixed precision training"): the loss is multiplied by S before
backward; after Horovod's all-reduce (``optimizer.synchronize()``) the gradients are divided by S and checked; a step
whose gradients hold an inf or NaN is skipped. As the all-reduced gradients are identical on every rank, every rank
takes the same decision without another collective. Dynamic scaling halves S on overflow and doubles it after
``growth_interval`` clean steps; too many overflows in a row stop the run with one clear line.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from hybridtrain.config import STAGES, loss_scaling
from hybridtrain.errors import UserError

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32, "fp64": torch.float64}
STAGE_MODULES = {"stem": ("conv1", "bn1"), "fc": ("fc",)}  # the others are the module of the same name


@dataclass
class Policy:
    """What a precision mode means for parameters, inputs, the forward pass and loss scaling."""
    mode: str
    param_dtype: torch.dtype
    input_dtype: torch.dtype
    autocast_dtype: torch.dtype | None = None  # mixed: the forward runs under autocast in this dtype
    stage_dtypes: dict = field(default_factory=dict)  # layered: stage -> dtype
    loss_scaling: str = "none"


def resolve_policy(p) -> Policy:
    """The Policy for a ``precision`` config section (already validated key by key)."""
    compute = DTYPES[p.compute_dtype]
    dtype = {"fp64": torch.float64, "fp16_pure": torch.float16}.get(p.mode, torch.float32)  # fp32, mixed, layered
    inputs = compute if p.mode == "mixed" and compute == torch.float16 else dtype
    return Policy(p.mode, dtype, inputs, autocast_dtype=compute if p.mode == "mixed" else None,
                  stage_dtypes={s: DTYPES[d] for s, d in p.layers.items()} if p.mode == "layered" else {},
                  loss_scaling=loss_scaling(p))


def set_fp32_math(tf32: bool) -> str:
    """FP32 convolutions and matmuls in IEEE FP32, or TF32 (10-bit mantissa) on Ampere and newer when
    ``precision.tf32``; torch's default runs cuDNN convolutions in TF32. Returns the setting, for the metrics."""
    setting = "tf32" if tf32 else "ieee"
    # The legacy settings first: every torch has them (the per-op ones came in 2.9), and on a torch that has both,
    # writing only the per-op ones leaves the legacy getters raising (inductor reads them).
    torch.backends.cudnn.allow_tf32 = tf32
    torch.set_float32_matmul_precision("high" if tf32 else "highest")
    conv = getattr(torch.backends.cudnn, "conv", None)
    if conv is not None and hasattr(conv, "fp32_precision"):
        conv.fp32_precision = setting
        torch.backends.cuda.matmul.fp32_precision = setting
    return setting


# ----------------------------------------------------------------------------- the model

def stage_modules(model: nn.Module, stage: str) -> list[nn.Module]:
    names = STAGE_MODULES.get(stage, (stage,))
    missing = [n for n in names if not hasattr(model, n)]
    if missing:
        raise UserError(f"config error: precision.layers names stage '{stage}' but the model has no "
                        f"{missing[0]}: use stages from {', '.join(STAGES)}")
    return [getattr(model, n) for n in names]


def run_stage_in(module: nn.Module, dtype: torch.dtype) -> None:
    """Make ``module`` compute in ``dtype``: its input cast to ``dtype``, then autocast in FP16/BF16 (autocast
    off in FP32), so the shortcut additions run in the stage's dtype too."""
    inner = module.forward

    def forward(x, *args, **kwargs):
        device_type = x.device.type
        if dtype == torch.float32:
            with torch.autocast(device_type, enabled=False):
                return inner(x.float(), *args, **kwargs)
        with torch.autocast(device_type, dtype=dtype):
            return inner(x.to(dtype), *args, **kwargs)

    module.forward = forward


def prepare_model(model: nn.Module, policy: Policy) -> nn.Module:
    """Cast the parameters and install the per-stage dtypes; returns the model."""
    model = model.to(policy.param_dtype)
    for stage, dtype in policy.stage_dtypes.items():
        for module in stage_modules(model, stage):
            run_stage_in(module, dtype)
    return model


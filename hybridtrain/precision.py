"""Compute precision (``precision.mode``) and loss scaling.

Modes:
- ``fp32``: the baseline. ``fp64``: everything in double (seed 003's scheme 1).
- ``mixed`` (the paper's FP-mix, seeds 001/004): FP32 master weights and FP32 update; forward and backward
  under autocast in ``compute_dtype`` (fp16, or bf16 on modern GPUs). Autocast keeps exp/log/softmax and the
  reductions in FP32, and the loss is always taken in FP32 (``training.classification_loss``).
- ``layered`` (seed 000): each named stage (stem, layer1..layer4, fc) runs in its own dtype: its input is
  cast to that dtype; a reduced stage runs under autocast, an FP32 stage with autocast off.
- ``fp16_pure`` (seed 002): weights, activations, gradients and optimizer state all FP16, no master copy,
  with the seed's two stabilisers as options (see ``models.resnet`` for the BN swap and the 0.25 scale).

Loss scaling (seeds 001 and 004): the loss is multiplied by S before backward; after Horovod's all-reduce
(``optimizer.synchronize()``) the gradients are divided by S and checked; a step whose gradients hold an inf
or NaN is skipped. As the all-reduced gradients are identical on every rank, every rank takes the same
decision without another collective. Dynamic scaling halves S on overflow and doubles it after
``growth_interval`` clean steps; too many overflows in a row stop the run with one clear line.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
from torch import nn

from .errors import UserError
from .models.resnet import STAGES

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

    @property
    def reduced(self) -> bool:
        """True when any computation runs in FP16 or BF16."""
        lower = {self.autocast_dtype, self.param_dtype, *self.stage_dtypes.values()}
        return bool(lower & {torch.float16, torch.bfloat16})


def resolve_policy(p) -> Policy:
    """The Policy for a ``precision`` config section (already validated key by key)."""
    compute = DTYPES[p.compute_dtype]
    if p.mode == "fp64":
        policy = Policy("fp64", torch.float64, torch.float64)
    elif p.mode == "fp32":
        policy = Policy("fp32", torch.float32, torch.float32)
    elif p.mode == "mixed":
        policy = Policy("mixed", torch.float32, compute if compute == torch.float16 else torch.float32, compute)
    elif p.mode == "layered":
        policy = Policy("layered", torch.float32, torch.float32, stage_dtypes={s: DTYPES[d] for s, d in p.layers.items()})
    else:
        policy = Policy("fp16_pure", torch.float16, torch.float16)
    uses_fp16 = torch.float16 in {policy.param_dtype, policy.autocast_dtype, *policy.stage_dtypes.values()}
    policy.loss_scaling = p.loss_scaling if p.loss_scaling != "auto" else ("dynamic" if uses_fp16 else "none")
    return policy


def gradient_compression(name: str, policy: Policy) -> str:
    """horovod.compression for a policy: ``auto`` is fp16 (the paper) when the loss is scaled, so that small
    gradients stay above FP16's subnormals (6.1e-5), else none. fp16 is refused for unscaled gradients (15% of
    ResNet's fall below 6.1e-5 at step 0) and for fp64 ones (they would silently travel as fp16)."""
    if name == "auto":
        return "fp16" if policy.loss_scaling != "none" and policy.param_dtype != torch.float64 else "none"
    if name == "fp16" and policy.param_dtype == torch.float64:
        raise UserError("config error: horovod.compression=fp16 would send fp64 gradients as fp16: use auto or none")
    if name == "fp16" and policy.loss_scaling == "none":
        raise UserError(f"config error: horovod.compression=fp16 needs loss scaling, and precision.mode="
                        f"{policy.mode} has none here (unscaled gradients below 6.1e-5 lose bits in fp16, many "
                        f"flush to 0): set precision.loss_scaling=dynamic, or horovod.compression=auto or none")
    return name


def check_hardware(policy: Policy, device: torch.device) -> None:
    """bf16 only where the GPU computes it natively (compute capability 8.0+: emulation on a V100 or P40 is slow)."""
    wants_bf16 = torch.bfloat16 in {policy.autocast_dtype, *policy.stage_dtypes.values()}
    if wants_bf16 and device.type == "cuda" and not torch.cuda.is_bf16_supported(including_emulation=False):
        raise UserError(f"precision.compute_dtype bf16 needs a GPU with native BF16 (compute capability 8.0 or "
                        f"newer) and {torch.cuda.get_device_name(device)} has none: use compute_dtype fp16")


def set_fp32_math(tf32: bool) -> str:
    """FP32 convolutions and matmuls in IEEE FP32, or TF32 (10-bit mantissa) on Ampere and newer when
    ``precision.tf32``; torch's default runs cuDNN convolutions in TF32. Returns the setting, for the metrics."""
    setting = "tf32" if tf32 else "ieee"
    torch.backends.cudnn.conv.fp32_precision = setting
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


def forward_context(policy: Policy, device: torch.device):
    """Autocast around the whole forward pass in mixed mode; nothing otherwise."""
    if policy.autocast_dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=policy.autocast_dtype)


# ----------------------------------------------------------------------------- loss scaling

class LossScaler:
    """Static or dynamic loss scaling around a Horovod DistributedOptimizer (or a plain optimizer)."""

    def __init__(self, mode: str, scale: float, growth_interval: int, max_consecutive_overflows: int):
        self.mode, self.growth_interval, self.max_overflows = mode, growth_interval, max_consecutive_overflows
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
        """Synchronize (Horovod), unscale, step unless a gradient is not finite, update S; True if stepped.

        The check runs in every mode: the gradients are averaged over the ranks, so a NaN or inf loss on any
        rank makes every rank skip the same step, and no rank goes on alone."""
        synchronizing = hasattr(optimizer, "synchronize")
        if synchronizing:
            optimizer.synchronize()  # the all-reduce of the (scaled) gradients
        finite = self.unscale(optimizer)
        if finite:
            with optimizer.skip_synchronize() if synchronizing else contextlib.nullcontext():
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
            raise UserError(f"{self.consecutive_overflows} steps in a row had a NaN or inf loss or gradient on some "
                            f"rank{scale}: the run is diverging (or the data holds NaN); lower optim.lr, use "
                            f"precision.mode=mixed or fp32, or raise precision.max_consecutive_overflows; the last "
                            f"checkpoint is intact")

    def state_dict(self) -> dict:
        return {"scale": self.scale, "clean_steps": self.clean_steps,
                "consecutive_overflows": self.consecutive_overflows, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict) -> None:
        self.set_scale(float(state["scale"]))
        self.clean_steps = int(state["clean_steps"])
        self.consecutive_overflows, self.skipped_steps = int(state["consecutive_overflows"]), int(state["skipped_steps"])


def create_scaler(p, policy: Policy) -> LossScaler:
    return LossScaler(policy.loss_scaling, p.loss_scale, p.growth_interval, p.max_consecutive_overflows)


# ----------------------------------------------------------------------------- memory

def reset_peak_memory(device: torch.device) -> None:
    """Start a new peak: the CUDA allocator's, or the process's peak RSS (Linux clear_refs)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    with contextlib.suppress(OSError):
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")


def peak_memory_mb(device: torch.device) -> float:
    """Max allocated on the GPU, or peak RSS (VmHWM) on the CPU, in MiB since the last reset."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2 ** 20
    with contextlib.suppress(OSError):
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def memory_figures(device: torch.device) -> dict[str, float | None]:
    """Peak memory since the last reset, in MiB: allocated by tensors (a CUDA graph's private pool is not
    counted there), reserved by torch's caching allocator (graph pools and fragmentation included), and in use
    on the whole device now (CUDA context, NCCL buffers, DALI's decoder pools and other processes included).
    On the CPU: the peak RSS, and no reserved or device figure."""
    figures = {"peak_memory_mb": peak_memory_mb(device), "peak_memory_reserved_mb": None,
               "device_memory_used_mb": None}
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        figures["peak_memory_reserved_mb"] = torch.cuda.max_memory_reserved(device) / 2 ** 20
        figures["device_memory_used_mb"] = (total - free) / 2 ** 20
    return figures

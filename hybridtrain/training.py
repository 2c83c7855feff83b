"""One training epoch and one evaluation pass, plus the paper's BatchNorm statistics handling."""
from __future__ import annotations

import time
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from . import distributed
from .data.check import CLEAN_LIST_HINT
from .data.torchvision_loader import UnreadableImage
from .errors import UserError
from .precision import LossScaler, Policy, forward_context


@dataclass
class Precision:
    """The resolved precision policy and the loss scaler, as the step needs them."""
    policy: Policy
    scaler: LossScaler


@dataclass
class EpochResult:
    train_loss: float
    train_top1: float  # on the augmented training batches, as the model was during each step
    samples_seen: int
    train_time_s: float
    skipped_steps: int  # optimizer steps skipped for overflowing gradients (the same on every rank)


@dataclass
class EvalResult:
    loss: float
    top1: float
    top5: float
    count: int


def batch_norms(model: nn.Module) -> list[nn.modules.batchnorm._BatchNorm]:
    return [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]


def use_last_iteration_statistics(model: nn.Module) -> None:
    """momentum = 1: running stats := the current batch's stats, i.e. those of the last iteration (paper 2.2.3)."""
    for bn in batch_norms(model):
        bn.momentum = 1.0


@torch.no_grad()
def average_bn_statistics(model: nn.Module) -> None:
    """Running mean/var averaged over all ranks in FP32 by one all-reduce; afterwards identical on every rank."""
    bns = batch_norms(model)
    buffers = [b for bn in bns for b in (bn.running_mean, bn.running_var)]
    for buf, avg in zip(buffers, distributed.allreduce_mean_fp32(buffers, "bn_statistics")):
        buf.copy_(avg.view_as(buf).to(buf.dtype))  # mean_r over ranks, in FP32 (paper 2.2.3)


def classification_loss(logits: torch.Tensor, labels: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Softmax cross-entropy in FP32 (FP64 in fp64 mode) whatever the compute dtype (paper 2.2.2, item 2)."""
    return F.cross_entropy(logits.to(torch.promote_types(logits.dtype, torch.float32)), labels, reduction=reduction)


def topk_correct(logits: torch.Tensor, labels: torch.Tensor, ks=(1, 5)) -> list[torch.Tensor]:
    k_max = min(max(ks), logits.shape[1])
    top = logits.topk(k_max, dim=1).indices
    hits = top.eq(labels.view(-1, 1))
    return [hits[:, :min(k, k_max)].any(dim=1).sum() for k in ks]


def readable(batch, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(images in the model's input dtype, labels) on its device, or this rank's one-line error naming an
    unreadable file."""
    if isinstance(batch, UnreadableImage):
        raise UserError(f"cannot read image {batch.path} ({batch.error}): {CLEAN_LIST_HINT}", same_on_all_ranks=False)
    images, labels, _ = batch
    return images.to(device, dtype, non_blocking=True), labels.to(device, non_blocking=True)


def train_step(model, optimizer, precision: Precision, images, labels) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward (in the policy's precision), FP32 loss, scaled backward, all-reduce, step unless it overflowed."""
    with forward_context(precision.policy, images.device):
        logits = model(images)
    loss = classification_loss(logits, labels)
    optimizer.zero_grad()
    precision.scaler.backward(loss)
    precision.scaler.step(optimizer)
    return loss.detach(), logits.detach()


def train_one_epoch(model, bundle, precision: Precision, loader, epoch: int, steps_per_epoch: int,
                    progress=None, run_step=None) -> EpochResult:
    """``run_step(optimizer, precision, images, labels)``: the step (``speed.build_train_step``); default the eager
    ``train_step`` of ``model``."""
    run_step = run_step or partial(train_step, model)
    model.train()
    loader.batch_sampler.set_epoch(epoch)
    device = next(model.parameters()).device
    loss_sum, correct, seen = (torch.zeros((), dtype=torch.float64, device=device) for _ in range(3))
    skipped_before = precision.scaler.skipped_steps
    start = time.perf_counter()
    for i, batch in enumerate(loader):
        images, labels = readable(batch, device, precision.policy.input_dtype)
        bundle.apply_schedule(epoch * steps_per_epoch + i)
        loss, logits = run_step(bundle.optimizer, precision, images, labels)
        loss_sum += loss * labels.numel()
        correct += topk_correct(logits, labels, ks=(1,))[0]
        seen += labels.numel()
        if progress is not None:
            progress.update(loss_sum, seen, i + 1)
    elapsed = time.perf_counter() - start
    totals = distributed.allreduce_sum(torch.stack([loss_sum, correct, seen]).cpu(), f"train_totals.{epoch}")
    return EpochResult(float(totals[0] / totals[2]), float(totals[1] / totals[2]), int(totals[2]), elapsed,
                       precision.scaler.skipped_steps - skipped_before)


@torch.no_grad()
def evaluate(model, loader, policy: Policy, tag: str) -> EvalResult:
    """Loss, top-1, top-5 over the whole validation set: per-rank sums, then one all-reduce of the sums."""
    model.eval()
    device = next(model.parameters()).device
    sums = torch.zeros(4, dtype=torch.float64, device=device)  # loss, top1, top5, count
    for batch in loader:
        images, labels = readable(batch, device, policy.input_dtype)
        with forward_context(policy, device):
            logits = model(images)
        loss = classification_loss(logits, labels, reduction="sum")
        top1, top5 = topk_correct(logits, labels)
        count = torch.tensor(labels.numel(), dtype=torch.float64, device=device)
        sums += torch.stack([loss.double(), top1.double(), top5.double(), count])
    sums = distributed.allreduce_sum(sums.cpu(), f"eval_totals.{tag}")
    count = int(sums[3])
    if count == 0:
        raise UserError("the validation set yielded no readable images: check data.path/val")
    return EvalResult(float(sums[0] / count), float(sums[1] / count), float(sums[2] / count), count)

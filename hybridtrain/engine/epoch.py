"""One training epoch (with gradient accumulation and per-rank loss weights) and one evaluation pass."""
from __future__ import annotations

import contextlib
import itertools
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch

from hybridtrain.data.loaders import to_device
from hybridtrain.distributed import collectives as distributed
from hybridtrain.engine.step import classification_loss, train_step
from hybridtrain.engine.watchdog import local_work
from hybridtrain.errors import UserError
from hybridtrain.models.batchnorm import RunningStatsGuard
from hybridtrain.optim import optimizer_spec
from hybridtrain.precision.policy import Policy, forward_context

if TYPE_CHECKING:
    from hybridtrain.engine.trainer import Trainer


@dataclass
class EpochProgress:
    """Where a rank is inside an epoch: what a mid-epoch checkpoint keeps to continue exactly."""
    passes: int = 0  # forward/backward passes done (whole optimizer steps only)
    loss_sum: float = 0.0
    correct: float = 0.0
    seen: float = 0.0
    train_time_s: float = 0.0
    skipped_steps: int = 0


@dataclass
class EpochResult:
    train_loss: float
    train_top1: float  # on the augmented training batches, as the model was during each step
    samples_seen: int
    train_time_s: float
    skipped_steps: int  # optimizer steps skipped for overflowing gradients (the same on every rank)
    stopped: EpochProgress | None = None  # set when a preemption stopped the epoch after a step
    warmup_time_s: float = 0.0  # of train_time_s: the first steps of a process (compile, cuDNN autotuning)
    warmup_samples: int = 0  # of samples_seen: those trained in warmup_time_s (over all ranks)


@dataclass
class EpochPosition:
    """Where an epoch's training begins: at its start, or where a stopped run or an elastic segment left it."""
    epoch: int
    resume: EpochProgress | None = None  # a stopped epoch's progress: its batches are drawn again and skipped
    start: int = 0  # elastic: samples of the epoch's permutation consumed before this segment
    first_step: int = 0  # elastic: the optimizer step of the epoch this segment begins at


@dataclass
class EpochHooks:
    """What the loop around an epoch sees of it."""
    progress: object = None  # .update(loss_sum, seen, passes) after every pass (telemetry.ProgressBar)
    stop_after_step: Callable | None = None  # (snapshot) -> bool, asked after every step on every rank
    warmup: int = 0  # the first steps timed apart (warmup_steps)
    compile_steps: int = 0  # the first steps run as local work for the stall watchdog (compile, autotuning)


@dataclass
class EvalResult:
    loss: float
    top1: float
    top5: float
    count: int


def topk_correct(logits: torch.Tensor, labels: torch.Tensor, ks=(1, 5)) -> list[torch.Tensor]:
    k_max = min(max(ks), logits.shape[1])
    top = logits.topk(k_max, dim=1).indices
    hits = top.eq(labels.view(-1, 1))
    return [hits[:, :min(k, k_max)].any(dim=1).sum() for k in ks]


def micro_batch_weight(samples: int, batch_size: int, accumulation_steps: int) -> float:
    """w = n / (b k): Horovod's average over N ranks of k weighted per-pass mean losses is then the mean loss
    of the global batch, (1/N) sum_r sum_j w_rj L_rj = (1/(k N b)) sum_{r,j} n_rj L_rj. It is 1 for fixed
    batches without accumulation, 1/k with accumulation, and n_r/b for random per-rank batches."""
    return samples / (batch_size * accumulation_steps)


def compiles_in_epoch(epoch: int, first_epoch_of_process: bool, optim_cfg) -> bool:
    """Whether the epoch's first steps compile or capture: a process's first epoch (torch.compile, CUDA graphs,
    cuDNN autotuning), and the optimizer's `Spec.fused_switch_epoch` (optim.fused compiles the next phase)."""
    return first_epoch_of_process or epoch == optimizer_spec(optim_cfg).fused_switch_epoch(optim_cfg)


def warmup_steps(compiles: bool, updates_per_epoch: int, steps: int = 3) -> int:
    """The steps of an epoch timed apart as warmup: its first ``steps`` when it compiles (`compiles_in_epoch`)
    and has at least twice as many; else none."""
    return steps if compiles and updates_per_epoch >= 2 * steps else 0


def compile_steps(compiles: bool, warmup: int) -> int:
    """The first steps of an epoch that may compile, capture or autotune for longer than the stall limit: the
    warmup steps, at least the first, when the epoch compiles (`compiles_in_epoch`); else none."""
    return max(warmup, 1) if compiles else 0


def first_batch_as_local_work(batches):
    """``batches``, the first drawn as local work for the stall watchdog: the loader's start of an epoch (DALI
    builds its pipeline, workers fill their queues) may outlast the stall limit."""
    batches = iter(batches)
    with local_work("the epoch's first batch"):
        first = next(batches, None)
    if first is not None:
        yield first
        yield from batches


def train_one_epoch(t: Trainer, position: EpochPosition, hooks: EpochHooks) -> EpochResult:
    """``t.updates`` optimizer steps of ``t.k`` passes each, from ``position`` (EpochPosition says how a stopped
    epoch or an elastic segment continues exactly); one all-reduce per step. Left-over batches that cannot fill a
    step are not trained on. Each step is ``step.train_step`` run by ``t.step`` (eager, compiled or graphed).
    ``hooks.stop_after_step(snapshot)``: ``snapshot()`` is this rank's EpochProgress (a host sync)."""
    model, precision, k = t.model, t.precision, t.k
    model.train()
    t.data.train.batch_sampler.set_epoch(position.epoch, position.start)
    device = next(model.parameters()).device
    done = position.resume or EpochProgress()
    loss_sum, correct, seen = (torch.tensor(v, dtype=torch.float64, device=device)
                               for v in (done.loss_sum, done.correct, done.seen))
    skipped_before = precision.scaler.skipped_steps - done.skipped_steps
    steps = min(t.updates - position.first_step, len(t.data.train) // k)
    bn_guard = RunningStatsGuard(model)
    began = time.perf_counter() - done.train_time_s
    warmup_end = done.passes // k + hooks.warmup if hooks.warmup else -1  # steps timed apart: compile, autotune
    warmup_time, warmup_seen = 0.0, torch.zeros((), dtype=torch.float64, device=device)
    batches = first_batch_as_local_work(itertools.islice(t.data.train, steps * k))  # none beyond the last pass
    for _ in itertools.islice(batches, done.passes):  # drawn again and skipped: data and augmentation continue
        pass

    def micro_batches():
        for batch in itertools.islice(batches, k):
            if t.audit is not None:
                t.audit.record(batch)
            images, labels = to_device(batch, device, precision.policy.input_dtype)
            yield images, labels, micro_batch_weight(labels.numel(), t.batch_size, k)

    def record(loss, logits, labels) -> None:
        nonlocal loss_sum, correct, seen, passes_done
        loss_sum += loss * labels.numel()
        correct += topk_correct(logits, labels, ks=(1,))[0]
        seen += labels.numel()
        passes_done += 1
        if hooks.progress is not None:
            hooks.progress.update(loss_sum, seen, passes_done)

    passes_done = done.passes
    compiling_end = done.passes // k + hooks.compile_steps
    for i in range(done.passes // k, steps):
        t.bundle.apply_schedule(position.epoch * t.updates + position.first_step + i)
        with local_work("a compiling step") if i < compiling_end else contextlib.nullcontext():
            train_step(t.step, t.bundle.optimizer, precision, micro_batches(), on_pass=record, bn_guard=bn_guard)
        if i + 1 == warmup_end:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            warmup_time, warmup_seen = time.perf_counter() - began - done.train_time_s, seen - done.seen

        def snapshot(passes_at_step=passes_done):
            return EpochProgress(passes_at_step, float(loss_sum), float(correct), float(seen),
                                 time.perf_counter() - began, precision.scaler.skipped_steps - skipped_before)
        if i + 1 < steps and hooks.stop_after_step is not None and hooks.stop_after_step(snapshot):
            stopped = snapshot()
            return EpochResult(float("nan"), float("nan"), 0, stopped.train_time_s, stopped.skipped_steps, stopped)
    elapsed = time.perf_counter() - began
    totals = distributed.allreduce_sum(torch.stack([loss_sum, correct, seen, warmup_seen]).cpu(),
                                       f"train_totals.{position.epoch}")
    return EpochResult(float(totals[0] / totals[2]), float(totals[1] / totals[2]), int(totals[2]), elapsed,
                       precision.scaler.skipped_steps - skipped_before, warmup_time_s=warmup_time,
                       warmup_samples=int(totals[3]))


@torch.no_grad()
def evaluate(model, loader, policy: Policy, tag: str) -> EvalResult:
    """Loss, top-1, top-5 over the whole validation set: per-rank sums, then one all-reduce of the sums.

    A rank that cannot read a validation image stops reading but still joins the all-reduce, with a flag: every
    rank then raises the same line naming that rank and the file (never a "dead peer" on the others)."""
    model.eval()
    device = next(model.parameters()).device
    sums = torch.zeros(5, dtype=torch.float64, device=device)  # loss, top1, top5, count, failed
    with local_work("validation"):  # the pass may outlast the stall limit; the wait for the peers' sums may not
        failure = evaluate_shard(model, loader, policy, sums)
    sums = distributed.allreduce_sum(sums.cpu(), f"eval_totals.{tag}")
    if sums[4] > 0:
        raise UserError(first_failure(failure, tag))
    count = int(sums[3])
    if count == 0:
        raise UserError("the validation set yielded no readable images: check data.path/val")
    return EvalResult(float(sums[0] / count), float(sums[1] / count), float(sums[2] / count), count)


def evaluate_shard(model, loader, policy: Policy, sums: torch.Tensor) -> str:
    """This rank's sums (loss, top1, top5, count, failed) into ``sums``; the unreadable file's line, or ""."""
    device = sums.device
    batches = iter(loader)
    while True:
        try:
            batch = next(batches, None)
            if batch is None:
                return ""
            images, labels = to_device(batch, device, policy.input_dtype)
        except UserError as exc:
            sums[4] = 1
            return str(exc)
        with forward_context(policy, device):
            logits = model(images)
        loss = classification_loss(logits, labels, reduction="sum")
        top1, top5 = topk_correct(logits, labels)
        sums[:3] += torch.stack([loss.double(), top1.double(), top5.double()])
        sums[3] += labels.numel()  # a scalar argument: no host-to-device copy


def first_failure(mine: str, tag: str) -> str:
    """The lowest failing rank's line, on every rank (one allgather, made only when some rank failed)."""
    failures = distributed.allgather_object(mine, f"eval_failure.{tag}")
    rank, line = next((r, f) for r, f in enumerate(failures) if f)
    return f"rank {rank}: {line}"

"""One training epoch (with gradient accumulation and per-rank loss weights) and one evaluation pass."""
from __future__ import annotations

import contextlib
import itertools
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from hybridtrain.data.loaders import to_device
from hybridtrain.distributed import collectives as distributed
from hybridtrain.engine.breakdown import StepClock, first_step_done, reduces_in_backward
from hybridtrain.engine.guards import local_work
from hybridtrain.engine.step import RunningStatsGuard, StepResult, classification_loss, train_step
from hybridtrain.errors import UserError
from hybridtrain.optim import apply_schedule
from hybridtrain.precision.scaler import Precision

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
    breakdown: dict = field(default_factory=dict)  # seconds per step part in train_time_s (StepClock.totals)


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
    breakdown: dict | None = None  # this rank's seconds per step part (breakdown.StepClock.totals)


@dataclass
class EpochPosition:
    """Where an epoch's training begins: at its start, or where a stopped run or an elastic segment left it."""
    epoch: int
    resume: EpochProgress | None = None  # a stopped epoch's progress: its batches are drawn again and skipped
    start: int = 0  # elastic: samples of the epoch's permutation consumed before this segment
    first_step: int = 0  # elastic: the optimizer step of the epoch this segment begins at


@dataclass
class StepSnapshot:
    """Where an epoch stands after one of its steps: what the loop shows and decides on. ``loss_sum`` and
    ``seen`` are the epoch's running device sums: read them before the next step."""
    index: int  # the step's index within the epoch
    global_step: int  # the schedule's step (of the whole run)
    passes: int  # this rank's forward/backward passes of the epoch so far
    loss_sum: torch.Tensor
    seen: torch.Tensor
    last: bool  # the epoch's last step: the epoch-end path follows, nothing is asked after it
    samples: list  # the sample indices of each of its batches (CPU tensors), for the loop's SampleAudit
    phase_change: dict | None = None  # the schedule's settings when this step began a new phase (AdaBound -> SGD)


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


def first_batch_as_local_work(batches):
    """``batches``, the first drawn as local work for the stall watchdog: the loader's start of an epoch (DALI
    builds its pipeline, workers fill their queues) may outlast the stall limit."""
    batches = iter(batches)
    with local_work("the epoch's first batch"):
        first = next(batches, None)
    if first is not None:
        yield first
        yield from batches


class EpochSteps:
    """One epoch's training as an iterator of steps: ``for snap in EpochSteps(t, position, warmup, compiling)``
    runs ``t.updates`` optimizer steps of ``t.k`` passes each from ``position`` (EpochPosition says how a stopped
    epoch or an elastic segment continues exactly), one all-reduce per step, and yields a StepSnapshot after each;
    the loop around it shows the progress and decides whether to stop. Left-over batches that cannot fill a step
    are not trained on. Each step is ``step.train_step`` run by ``t.step`` (eager, compiled or graphed), on the k
    micro-batches this class draws and moves to the device; the sums (loss, top-1, samples) are kept here.
    ``warmup``: the first steps timed apart (warmup_steps); ``compiling``: the first steps run as local work for
    the stall watchdog (loop.train_epoch). After the last step ``result()`` is the epoch's, over all ranks; after
    a stop, ``stopped()``."""

    def __init__(self, t: Trainer, position: EpochPosition, warmup: int = 0, compiling: int = 0):
        self.t, self.position = t, position
        t.model.train()
        t.data.train.batch_sampler.set_epoch(position.epoch, position.start)
        self.device = device = next(t.model.parameters()).device
        self.done = done = position.resume or EpochProgress()
        self.loss_sum, self.correct, self.seen = (torch.tensor(v, dtype=torch.float64, device=device)
                                                  for v in (done.loss_sum, done.correct, done.seen))
        self.passes, self.skipped = done.passes, done.skipped_steps
        self.steps = min(t.updates - position.first_step, len(t.data.train) // t.k)
        self.bn_guard = RunningStatsGuard(t.model)
        self.began = time.perf_counter() - done.train_time_s
        self.warmup_end = done.passes // t.k + warmup if warmup else -1  # steps timed apart: compile, autotune
        self.compiling_end = done.passes // t.k + compiling
        self.warmup_time, self.warmup_seen = 0.0, torch.zeros((), dtype=torch.float64, device=device)
        self.clock = StepClock(device)  # where each step's time goes (breakdown.py), read once at the epoch's end
        for part, seconds in done.breakdown.items():  # a continued epoch's earlier steps: its record covers them
            self.clock.add(part, seconds)

    def __iter__(self):
        t, k, position = self.t, self.t.k, self.position
        restart = time.perf_counter()  # the loader's restart is input: persistent workers wait to be reset
        batches = first_batch_as_local_work(itertools.islice(t.data.train, self.steps * k))  # none past the last
        for _ in itertools.islice(batches, self.done.passes):  # drawn again and skipped: data, augmentation go on
            pass
        self.clock.attach(t.model, reduces_in_backward(t.step))  # detached by the loop's train_epoch
        self.clock.add("input", time.perf_counter() - restart)
        for i in range(self.done.passes // k, self.steps):
            global_step = position.epoch * t.updates + position.first_step + i
            phase_change = apply_schedule(t.bundle.optimizer, t.bundle.schedule, global_step)
            with local_work("a compiling step") if i < self.compiling_end else contextlib.nullcontext():
                self.clock.mark("begin")
                drawn = list(itertools.islice(batches, k))
                result = train_step(t.step, t.bundle.optimizer, t.precision, self.on_device(drawn),
                                    bn_guard=self.bn_guard, ema=t.ema, clock=self.clock)
            self.clock.mark("end")  # the clock's last mark, the process's first step noted, the profiler's window moved
            first_step_done()
            if t.profiler is not None:
                t.profiler.step()
            self.count(result)
            if i + 1 == self.warmup_end:
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                self.warmup_time = time.perf_counter() - self.began - self.done.train_time_s
                self.warmup_seen = self.seen - self.done.seen
            yield StepSnapshot(i, global_step, self.passes, self.loss_sum, self.seen, i + 1 == self.steps,
                               [batch[2] for batch in drawn], phase_change)

    def on_device(self, drawn: list) -> list[tuple[torch.Tensor, torch.Tensor, float]]:
        """A step's batches on the device, each with its loss weight (micro_batch_weight)."""
        t, dtype, ready = self.t, self.t.precision.policy.input_dtype, []
        for batch in drawn:
            images, labels = to_device(batch, self.device, dtype)
            ready.append((images, labels, micro_batch_weight(labels.numel(), t.batch_size, t.k)))
        self.clock.mark("drawn")
        return ready

    def count(self, result: StepResult) -> None:
        """A step's passes into the epoch's sums, pass by pass."""
        for loss, logits, labels in result.passes:
            self.loss_sum += loss * labels.numel()
            self.correct += topk_correct(logits, labels, ks=(1,))[0]
            self.seen += labels.numel()
            self.passes += 1
        self.skipped += not result.stepped

    def progress(self) -> EpochProgress:
        """This rank's progress after the latest step (reads the device): what a mid-epoch checkpoint keeps."""
        return EpochProgress(self.passes, float(self.loss_sum), float(self.correct), float(self.seen),
                             time.perf_counter() - self.began, self.skipped, self.clock.totals())

    def stopped(self) -> EpochResult:
        """The result of the epoch stopped after the latest step (a preemption)."""
        done = self.progress()
        return EpochResult(float("nan"), float("nan"), 0, done.train_time_s, done.skipped_steps, done)

    def result(self) -> EpochResult:
        """The trained epoch's figures over all ranks (one all-reduce of the sums)."""
        elapsed = time.perf_counter() - self.began
        totals = distributed.allreduce_sum(torch.stack([self.loss_sum, self.correct, self.seen, self.warmup_seen])
                                           .cpu(), f"train_totals.{self.position.epoch}")
        return EpochResult(float(totals[0] / totals[2]), float(totals[1] / totals[2]), int(totals[2]), elapsed,
                           self.skipped, warmup_time_s=self.warmup_time, warmup_samples=int(totals[3]),
                           breakdown=self.clock.totals())


@torch.no_grad()
def evaluate(model, loader, precision: Precision, tag: str, flip: bool = False, on_batch=None) -> EvalResult:
    """Loss, top-1, top-5 over the whole validation set: per-rank sums, then one all-reduce of the sums.
    ``flip`` (train.val_flip): each image's logits are the mean of its own and its horizontal mirror's, in FP32.
    ``on_batch(logits, labels)``: sees each batch's final logits (``hybridtrain evaluate``'s confusion matrix).

    A rank that cannot read a validation image stops reading but still joins the all-reduce, with a flag: every
    rank then raises the same line naming that rank and the file (never a "dead peer" on the others)."""
    model.eval()
    device = next(model.parameters()).device
    sums = torch.zeros(5, dtype=torch.float64, device=device)  # loss, top1, top5, count, failed
    with local_work("validation"):  # the pass may outlast the stall limit; the wait for the peers' sums may not
        failure = evaluate_shard(model, loader, precision, sums, flip, on_batch)
    sums = distributed.allreduce_sum(sums.cpu(), f"eval_totals.{tag}")
    if sums[4] > 0:  # the lowest failing rank's line, on every rank (one allgather, made only when some rank failed)
        failures = distributed.allgather_object(failure, f"eval_failure.{tag}")
        rank, line = next((r, f) for r, f in enumerate(failures) if f)
        raise UserError(f"rank {rank}: {line}")
    count = int(sums[3])
    if count == 0:
        raise UserError("the validation set yielded no readable images: check data.path/val")
    return EvalResult(float(sums[0] / count), float(sums[1] / count), float(sums[2] / count), count)


def eval_logits(model, images: torch.Tensor, precision: Precision, flip: bool = False) -> torch.Tensor:
    """The logits validation scores ``images`` by; with ``flip``, the mean of its own and its horizontal mirror's."""
    with precision.forward_context(images.device):
        logits = model(images)
        mirrored = model(images.flip(-1)) if flip else None  # NCHW (or its channels_last view): W is last
    if flip:
        wide = torch.promote_types(logits.dtype, torch.float32)  # FP32, or FP64 in fp64 mode
        logits = (logits.to(wide) + mirrored.to(wide)) / 2  # (z(x) + z(mirror x)) / 2
    return logits


def evaluate_shard(model, loader, precision: Precision, sums: torch.Tensor, flip: bool = False,
                   on_batch=None) -> str:
    """This rank's sums (loss, top1, top5, count, failed) into ``sums``; the unreadable file's line, or ""."""
    device = sums.device
    batches = iter(loader)
    while True:
        try:
            batch = next(batches, None)
            if batch is None:
                return ""
            images, labels = to_device(batch, device, precision.policy.input_dtype)
        except UserError as exc:
            sums[4] = 1
            return str(exc)
        logits = eval_logits(model, images, precision, flip)
        if on_batch is not None:
            on_batch(logits, labels)
        loss = classification_loss(logits, labels, reduction="sum")
        top1, top5 = topk_correct(logits, labels)
        sums[:3] += torch.stack([loss.double(), top1.double(), top5.double()])
        sums[3] += labels.numel()  # a scalar argument: no host-to-device copy

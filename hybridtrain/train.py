"""``hybridtrain train``: set up Horovod, data, model and optimizer; run epochs; checkpoint; report."""
from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from dataclasses import dataclass

import torch

from . import checkpoint, distributed, reporting, rundir, speed
from .config import Config, save_config
from .data.loaders import create_loaders
from .errors import UserError
from .batchnorm import average_running_statistics, configure_batch_norm, running_buffers
from .models import model_from_config
from .optim import create_optimizer
from .precision import (check_hardware, create_scaler, gradient_compression, memory_figures, prepare_model,
                        reset_peak_memory, resolve_policy, set_fp32_math)
from .preemption import PreemptionWatch
from .watchdog import StallWatchdog
from .training import EpochProgress, Precision, evaluate, train_one_epoch, warmup_steps


class ProgressBar:
    """Rank 0's progress through an epoch: tqdm's bar (loss, img/s, ETA) on a terminal; elsewhere (horovodrun
    and batch jobs pipe the output, where each bar update would pile up on one long line) a plain line every
    ``interval_s`` seconds. Reads the device only when it shows something."""

    def __init__(self, total: int, epoch: int, epochs: int, world_size: int, every: int = 5,
                 interval_s: float = 30.0):
        self.total, self.label = total, f"epoch {epoch + 1}/{epochs}"
        self.world_size, self.every, self.interval_s = world_size, every, interval_s
        self.start = self.last_line = time.perf_counter()
        self.bar = None
        if sys.stdout.isatty():
            from tqdm import tqdm
            self.bar = tqdm(total=total, desc=self.label, unit="step", leave=False, file=sys.stdout,
                            dynamic_ncols=True)

    def update(self, loss_sum, seen, steps: int) -> None:
        now = time.perf_counter()
        if self.bar is not None:
            self.bar.update(1)
            if steps % self.every == 0:
                self.bar.set_postfix(loss=f"{float(loss_sum / seen):.4f}", img_s=f"{self.rate(seen, now):.0f}")
        elif now - self.last_line >= self.interval_s and steps < self.total:
            self.last_line = now
            eta = (now - self.start) * (self.total - steps) / steps
            print(f"hybridtrain: {self.label} step {steps}/{self.total} ({100 * steps / self.total:.0f}%)  "
                  f"loss {float(loss_sum / seen):.4f}  {self.rate(seen, now):.0f} img/s  ETA {eta:.0f}s", flush=True)

    def rate(self, seen, now: float) -> float:
        return float(seen) * self.world_size / (now - self.start)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def log(topo, message: str) -> None:
    if topo.is_root:
        print(message, flush=True)


def resume_state(cfg: Config, topo, required: bool = True) -> dict | None:
    """Rank 0 reads the newest valid checkpoint (weights_only) and broadcasts it to every rank; None when
    there is none and it is not ``required`` (``--resume auto``)."""
    state = None
    if topo.is_root:
        try:
            state = checkpoint.load_latest(cfg.run_dir) if required or checkpoint.list_checkpoints(cfg.run_dir) \
                else {"none": True}
        except UserError as exc:
            state = {"error": str(exc)}  # every rank raises it, nobody waits on a dead rank 0
    state = distributed.broadcast_object(state, "resume_state")
    if "none" in state:
        log(topo, f"hybridtrain: --resume auto: no checkpoint in {cfg.run_dir}, starting fresh")
        return None
    if "error" in state:
        raise UserError(state["error"])
    if state.get("config_fingerprint") != cfg.fingerprint():
        log(topo, "hybridtrain: warning: the config differs from the checkpoint's; continuing with the new one")
    return state


def append_metrics(path: str, record: dict) -> None:
    with open(path, "a") as fh:
        fh.write(json.dumps(record) + "\n")


def truncate_metrics(path: str, completed_epochs: int) -> list[dict]:
    """Keep the records of the first ``completed_epochs`` epochs (a resumed run rewrites what came after);
    written to a temp file and renamed, so a kill leaves the old file or the new one."""
    if not os.path.exists(path):
        return []
    kept = [r for r in reporting.read_metrics(path) if r["epoch"] <= completed_epochs]
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in kept)
    os.replace(tmp, path)
    return kept


def tensorboard_writer(cfg: Config):
    """TensorBoard's writer for rank 0, or None when switched off (report.tensorboard)."""
    if not cfg.report.tensorboard:
        return None
    from torch.utils.tensorboard import SummaryWriter
    return SummaryWriter(os.path.join(cfg.run_dir, "tensorboard"))


TENSORBOARD_SCALARS = {"loss/train": "train_loss", "loss/val": "val_loss", "top1/train": "train_top1",
                       "top1/val": "val_top1", "top5/val": "val_top5", "lr": "lr", "images_per_sec": "images_per_sec",
                       "precision/loss_scale": "loss_scale", "precision/skipped_steps": "skipped_steps",
                       "memory/peak_mb": "peak_memory_mb"}


def write_scalars(board, record: dict) -> None:
    for tag, key in TENSORBOARD_SCALARS.items():
        board.add_scalar(tag, record[key], record["epoch"])
    board.flush()


@dataclass
class Trainer:
    """Everything one rank trains with."""
    topo: object
    data: object
    model: torch.nn.Module
    precision: Precision
    bundle: object
    updates: int  # optimizer steps per epoch
    k: int  # accumulation steps
    passes: object  # forward and backward, eager, compiled or graphed (speed.build_passes)
    compression: str = "none"  # the gradient all-reduce's, resolved from horovod.compression
    fp32_math: str = "ieee"  # FP32 convolutions and matmuls: ieee or tf32


def build_trainer(cfg: Config, topo) -> Trainer:
    """Everything a rank trains with, on the device ``topo`` (distributed.init) bound it to."""
    if cfg.train.deterministic:
        use_deterministic_algorithms()
    else:
        torch.backends.cudnn.benchmark = True  # fixed shapes: cuDNN picks the fastest kernels once
    fp32_math = set_fp32_math(cfg.precision.tf32)
    policy = resolve_policy(cfg.precision)
    compression = gradient_compression(cfg.horovod.compression, policy)
    check_hardware(policy, topo.device)
    speed.check_speedups(cfg.train, topo.device)
    data = create_loaders(cfg, topo)
    model = model_from_config(cfg.model, data.num_classes, seed=cfg.seed).to(topo.device)
    model = prepare_model(configure_batch_norm(model, cfg.bn, topo.device), policy)
    if cfg.data.channels_last:
        model = model.to(memory_format=torch.channels_last)
    k = cfg.train.accumulation_steps
    updates = data.steps_per_epoch // k
    if updates == 0:
        raise UserError(f"train.accumulation_steps={k} is more than the {data.steps_per_epoch} batches per epoch: "
                        f"lower it, or train.batch_size")
    # N of lr*N and of the bounds counts per-rank batches per update: ranks x accumulation steps (global batch / b)
    bundle = create_optimizer(model, cfg, topo.size * k, updates)
    precision = Precision(policy, create_scaler(cfg.precision, policy))
    passes = speed.build_passes(model, cfg, precision)  # a CUDA graph is captured before Horovod's hooks exist
    # Wrap first: Horovod rebuilds the optimizer from its param_groups, so state loaded before would be lost.
    bundle.optimizer = distributed.distributed_optimizer(bundle.optimizer, model, cfg.horovod, k, compression)
    t = Trainer(topo, data, model, precision, bundle, updates, k, passes, compression, fp32_math)
    bundle.on_phase_change = lambda step, s: log(t.topo, f"hybridtrain: switching to {s['phase']} at step {step} "
                                                         f"(epoch {step // t.updates + 1}), lr {s['lr']:.4g}")
    return t


def use_deterministic_algorithms() -> None:
    """train.deterministic: bitwise-repeatable runs (and exact resumes) at some cost in speed."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False


def restore(t: Trainer, state: dict) -> EpochProgress | None:
    """Load a checkpoint into the trainer; a mid-epoch one also gives this rank's place in its epoch."""
    checkpoint.restore(state, t.model, t.bundle.optimizer)
    if "scaler" in state:
        t.precision.scaler.load_state_dict(state["scaler"])
    partial = state.get("partial")
    if not partial:
        return None
    if len(partial["ranks"]) != t.topo.size:
        raise UserError(f"the newest checkpoint stopped mid-epoch on {len(partial['ranks'])} ranks: resume it on "
                        f"{len(partial['ranks'])} ranks (this job has {t.topo.size})")
    mine = partial["ranks"][t.topo.rank]
    load_bn_buffers(t.model, mine["bn_buffers"])  # this rank's own, as before the stop (not the average)
    return EpochProgress(**mine["progress"])


@torch.no_grad()
def load_bn_buffers(model, buffers: list[torch.Tensor]) -> None:
    for buf, saved in zip(running_buffers(model), buffers, strict=True):
        buf.copy_(saved)


def checkpoint_state(cfg: Config, t: Trainer, completed_epoch: int, elapsed_s: float,
                     pending_record: dict | None = None) -> dict:
    """``pending_record``: the epoch's record before validation; a resume validates and records it if the run
    stopped before its metrics line was written."""
    return {"model": t.model.state_dict(), "optimizer": t.bundle.optimizer.state_dict(),
            "scaler": t.precision.scaler.state_dict(), "epoch": completed_epoch,
            "config": cfg.to_dict(), "config_fingerprint": cfg.fingerprint(), "elapsed_s": elapsed_s,
            **({"pending_record": pending_record} if pending_record else {})}


def save_stopped_epoch(cfg: Config, t: Trainer, epoch: int, stopped: EpochProgress, elapsed_s: float) -> None:
    """A preempted epoch's checkpoint: the averaged model, plus every rank's own BN buffers and progress."""
    mine = {"bn_buffers": [buf.detach().cpu().clone() for buf in running_buffers(t.model)], "progress": dataclasses.asdict(stopped)}
    ranks = distributed.import_horovod().allgather_object(mine, name="stopped_epoch")
    average_running_statistics(t.model, cfg.bn.combine)  # the checkpoint's model is the averaged one
    if t.topo.is_root:
        state = checkpoint_state(cfg, t, epoch - 1, elapsed_s)
        state["partial"] = {"epoch": epoch, "ranks": ranks}
        path = checkpoint.save_checkpoint(state, cfg.run_dir, epoch + 1, cfg.train.keep_checkpoints,
                                          step=stopped.passes // t.k)
        log(t.topo, f"hybridtrain: stopped on SIGTERM after step {stopped.passes // t.k} of epoch {epoch + 1}; "
                    f"resumable from {path}: rerun the same command with --resume auto")
    distributed.barrier()


def claim_run_dir(cfg: Config, topo, resume: str | None, move_aside: bool) -> rundir.RunDir | None:
    """Rank 0 locks run_dir and names the run (rundir.claim); its refusal reaches every rank as the same line."""
    held, outcome = None, None
    if topo.is_root:
        try:
            held, note = rundir.claim(cfg.run_dir, resume, move_aside)
            outcome = {"note": note}
        except UserError as exc:
            outcome = {"error": str(exc)}
    outcome = distributed.broadcast_object(outcome, "run_dir_claim")
    if "error" in outcome:
        raise UserError(outcome["error"])
    if outcome["note"]:
        log(topo, outcome["note"])
    return held


def run_training(cfg: Config, resume: str | None = None, move_aside: bool = False) -> dict | None:
    """Train; ``resume``: None (fresh), "required" (a checkpoint must exist) or "auto" (if one exists);
    ``move_aside``: a fresh run moves a previous run's files out of run_dir instead of refusing.
    When another rank dies, this one raises PeerFailure naming it."""
    watch = PreemptionWatch()  # first: a SIGTERM during the setup also ends the run cleanly
    topo = distributed.init(cfg.train.threads, cfg.horovod, device=cfg.train.device)
    owner = claim_run_dir(cfg, topo, resume, move_aside)  # before the set-up: a refusal costs nothing
    try:
        t = build_trainer(cfg, topo)
        return train_epochs(cfg, t, watch, resume, owner)
    except RuntimeError as exc:
        if distributed.is_peer_failure(exc):
            raise distributed.peer_failure(topo) from None
        raise
    finally:
        if owner:
            owner.release()


def end_epoch(cfg: Config, t: Trainer, epoch: int, result, epoch_start: float, run_start: float, history: list,
              board, save) -> dict:
    """The one end-of-epoch path of the static and the elastic loop: BN statistics averaged over the ranks ->
    the checkpoint (rank 0, ``save(record)``), so a failing validation loses no training -> validation -> the
    record in metrics.jsonl, TensorBoard and the log."""
    average_running_statistics(t.model, cfg.bn.combine)
    record = training_record(t, epoch, result, epoch_start, run_start)
    if t.topo.is_root:
        save(record)
    try:
        ev = evaluate(t.model, t.data.val, t.precision.policy, tag=str(epoch))
    except UserError as exc:
        raise UserError(f"{exc} (epoch {epoch + 1}'s training is saved: fix the data, then rerun with --resume "
                        f"auto)") from None
    return record_epoch(cfg, t, with_validation(record, ev, epoch_start, run_start), history, board)


def record_epoch(cfg: Config, t: Trainer, record: dict, history: list, board) -> dict:
    if t.topo.is_root:
        append_metrics(os.path.join(cfg.run_dir, "metrics.jsonl"), record)
        history.append(record)
        if board:
            write_scalars(board, record)
        log(t.topo, reporting.epoch_line(record, cfg.train.epochs))
    return record


def complete_pending_record(cfg: Config, t: Trainer, state: dict, history: list, board) -> None:
    """A run that stopped between an epoch's checkpoint and its metrics line: validate now and write the line."""
    pending = state.get("pending_record") if not state.get("partial") else None
    missing = distributed.broadcast_object(bool(pending) and all(r["epoch"] != pending["epoch"] for r in history),
                                           "pending_record")
    if missing:
        now = time.perf_counter()
        ev = evaluate(t.model, t.data.val, t.precision.policy, tag=f"pending{pending['epoch']}")
        record_epoch(cfg, t, with_validation(pending, ev, now - pending["epoch_time_s"], now - pending["wall_time_s"]),
                     history, board)


def train_epochs(cfg: Config, t: Trainer, watch: PreemptionWatch, resume: str | None,
                 owner: rundir.RunDir | None = None) -> dict | None:
    topo = t.topo
    metrics_path = os.path.join(cfg.run_dir, "metrics.jsonl")
    start_epoch, history, elapsed_before, progress = 0, [], 0.0, None
    state = resume_state(cfg, topo, required=resume == "required") if resume else None
    if state:
        progress = restore(t, state)
        start_epoch, elapsed_before = state["epoch"] + 1, state.get("elapsed_s", 0.0)
        where = f"step {progress.passes // t.k} of epoch {start_epoch + 1}" if progress else f"epoch {start_epoch}"
        log(topo, f"hybridtrain: resumed from {where} in {cfg.run_dir}")
    else:
        distributed.broadcast_model(t.model)
        t.bundle.optimizer.load_state_dict(distributed.broadcast_object(t.bundle.optimizer.state_dict(), "optim_init"))
    if topo.is_root:
        os.makedirs(cfg.run_dir, exist_ok=True)
        save_config(cfg, os.path.join(cfg.run_dir, "config.yaml"))
        history = truncate_metrics(metrics_path, start_epoch)
    log_setup(cfg, t)
    run_start = time.perf_counter() - elapsed_before
    board = tensorboard_writer(cfg) if topo.is_root else None
    if state:
        complete_pending_record(cfg, t, state, history, board)
    watchdog = StallWatchdog(cfg.horovod.stall_warning_s, cfg.horovod.stall_shutdown_s, topo.rank)
    try:
        return train_epoch_range(cfg, t, watch, watchdog, start_epoch, progress, run_start, history, board, owner)
    finally:
        watchdog.close()


def train_epoch_range(cfg: Config, t: Trainer, watch: PreemptionWatch, watchdog: StallWatchdog, start_epoch: int,
                      progress: EpochProgress | None, run_start: float, history: list, board,
                      owner: rundir.RunDir | None) -> dict | None:
    """Epochs ``start_epoch`` to the end, each followed by the end-of-epoch path; a SIGTERM stops after a step."""
    topo, data = t.topo, t.data

    def after_step(snapshot):
        watchdog.beat()
        return watch.after_step(snapshot)
    for epoch in range(start_epoch, cfg.train.epochs):
        epoch_start = time.perf_counter()
        bar = ProgressBar(t.updates * t.k, epoch, cfg.train.epochs, topo.size) \
            if topo.is_root and cfg.train.progress else None
        reset_peak_memory(topo.device)
        result = train_one_epoch(t.model, t.bundle, t.precision, data.train, epoch, t.updates, cfg.train.batch_size,
                                 t.k, bar, resume=progress if epoch == start_epoch else None,
                                 stop_after_step=after_step, passes=t.passes,
                                 warmup=warmup_steps(epoch == start_epoch, t.updates))
        if bar:
            bar.close()
        if result.stopped:
            watch.close()
            save_stopped_epoch(cfg, t, epoch, result.stopped, time.perf_counter() - run_start)
            return None
        def save(record, epoch=epoch):
            checkpoint.save_checkpoint(checkpoint_state(cfg, t, epoch, time.perf_counter() - run_start, record),
                                       cfg.run_dir, epoch + 1, cfg.train.keep_checkpoints, owner=owner)
        watchdog.beat()
        end_epoch(cfg, t, epoch, result, epoch_start, run_start, history, board, save)
        watchdog.beat()
        if epoch + 1 < cfg.train.epochs and watch.agreed_now():
            watch.close()
            log(topo, f"hybridtrain: stopped on SIGTERM after epoch {epoch + 1}; resumable from its checkpoint: "
                      f"rerun the same command with --resume auto")
            return None
    watch.close()
    watchdog.pause()
    return finish(cfg, t, board)


def log_setup(cfg: Config, t: Trainer) -> None:
    data, topo, k = t.data, t.topo, t.k
    if data.skipped_files:
        log(topo, f"hybridtrain: skipping {len(data.skipped_files)} non-image file(s), e.g. {data.skipped_files[0]}")
    dropped = data.dropped_per_epoch + (data.steps_per_epoch - t.updates * k) * topo.size * cfg.train.batch_size
    log(topo, f"hybridtrain: {topo.size} rank(s) on {device_name(topo.device)}, {cfg.data.backend} input, "
              f"{'channels_last' if cfg.data.channels_last else 'NCHW'}, {t.precision.policy.mode} precision "
              f"(fp32 math {t.fp32_math}), all-reduce compression {t.compression}")
    log(topo, f"hybridtrain: {data.train_images} train / "
              f"{data.val_images} val images, {data.num_classes} classes, {t.updates} steps/epoch, global batch "
              f"{topo.size * cfg.train.batch_size * k}" + (f" ({k} accumulated passes per step)" if k > 1 else "")
              + (f", {dropped} image(s) dropped per epoch" if dropped else ""))


def device_name(device: torch.device) -> str:
    """'cuda:0 (NVIDIA H100 80GB HBM3)' or 'cpu'."""
    return f"{device} ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else str(device)


def with_validation(record: dict, ev, epoch_start: float, run_start: float) -> dict:
    """The epoch's record with its validation figures, and the times that include validation."""
    return {**record, "val_loss": ev.loss, "val_top1": ev.top1, "val_top5": ev.top5, "val_count": ev.count,
            "epoch_time_s": time.perf_counter() - epoch_start, "wall_time_s": time.perf_counter() - run_start}


def training_record(t: Trainer, epoch: int, result, epoch_start: float, run_start: float) -> dict:
    """The epoch's record up to validation (the validation keys come from with_validation)."""
    memory = memory_figures(t.topo.device)
    per_rank = distributed.allgather_floats([-1.0 if v is None else v for v in memory.values()], f"memory.{epoch}")
    columns = {key: [v for v in per_rank[i::len(memory)] if v >= 0] for i, key in enumerate(memory)}
    peak_mb = columns["peak_memory_mb"]
    return {"epoch": epoch + 1, "train_loss": result.train_loss, "train_top1": result.train_top1,
            "lr": t.bundle.optimizer.param_groups[0]["lr"], "epoch_time_s": time.perf_counter() - epoch_start,
            "train_time_s": result.train_time_s, "images_per_sec": result.samples_seen / result.train_time_s,
            "samples_seen": result.samples_seen, "wall_time_s": time.perf_counter() - run_start,
            "loss_scale": t.precision.scaler.scale, "skipped_steps": result.skipped_steps,
            "peak_memory_mb": max(peak_mb), "peak_memory_mb_per_rank": peak_mb,
            "peak_memory_reserved_mb": max(columns["peak_memory_reserved_mb"], default=None),
            "device_memory_used_mb": max(columns["device_memory_used_mb"], default=None),
            "warmup_time_s": result.warmup_time_s, "warmup_samples": result.warmup_samples,
            "fp32_math": t.fp32_math, "compression": t.compression, "world_size": t.topo.size}


def finish(cfg: Config, t: Trainer, board) -> dict | None:
    """Check that the ranks agree, write the final model and the report (rank 0)."""
    digests = distributed.gather_digests(t.model.state_dict(), t.bundle.optimizer.state_dict())
    if not t.topo.is_root:
        return None
    if len(set(digests)) != 1:
        print("hybridtrain: warning: ranks ended with different parameters or optimizer state (see report.json "
              "rank_digests)", file=sys.stderr)
    # contiguous CPU tensors: loads anywhere without map_location, strictly into torchvision's ResNet
    final = {name: tensor.detach().cpu().contiguous() for name, tensor in t.model.state_dict().items()}
    torch.save(final, os.path.join(cfg.run_dir, "final_model.pt"))
    if board:
        board.close()
    report = reporting.report_run(cfg.run_dir, extra={"world_size": t.topo.size, "rank_digests": digests})
    print(reporting.summary_table(report), flush=True)
    return report

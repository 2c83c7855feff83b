"""The run's record, kept by the loop (``RunRecord``): the run folder, metrics.jsonl and its records, the board, the
clock; an epoch's record (what metrics.jsonl, TensorBoard and the log get) and the setup lines."""
from __future__ import annotations

import json
import os
import socket
import time
from typing import TYPE_CHECKING

from hybridtrain.config import Config, save_config
from hybridtrain.distributed import collectives as distributed
from hybridtrain.engine.memory import memory_figures
from hybridtrain.engine.metrics_file import append_metrics, truncate_metrics
from hybridtrain.engine.rundir import RunDir, save_checkpoint
from hybridtrain.engine.telemetry import device_name, epoch_line, log, tensorboard_writer, write_scalars
from hybridtrain.optim import optimizer_spec

if TYPE_CHECKING:  # annotations only
    from hybridtrain.engine.trainer import Trainer


class RunRecord:
    """What a run keeps from its start to its end, in one place that the loop owns and that writes every file of the
    run folder the training writes: the folder's hold (``owner``, rundir.RunDir: rank 0's, None under --elastic),
    the resolved config.yaml, metrics.jsonl (cut to the ``completed_epochs`` a resumed run keeps) and the records in
    it, the board (TensorBoard and the sinks), and the run's clock (``start``, which counts the ``elapsed_s`` of the
    run's earlier processes). Rank 0 writes; on the other ranks the writes are no-ops."""

    def __init__(self, cfg: Config, topo, owner: RunDir | None = None, completed_epochs: int = 0,
                 elapsed_s: float = 0.0, resumed: bool = False):
        self.cfg, self.topo, self.owner = cfg, topo, owner
        self.metrics_path = os.path.join(cfg.run_dir, "metrics.jsonl")
        self.history, self.board = [], None
        if topo.is_root:
            os.makedirs(cfg.run_dir, exist_ok=True)
            save_config(cfg, os.path.join(cfg.run_dir, "config.yaml"))
            self.history = truncate_metrics(self.metrics_path, completed_epochs)
            self.board = tensorboard_writer(cfg, resumed)
        self.start = time.perf_counter() - elapsed_s

    def elapsed(self) -> float:
        """The run's training time so far, its earlier processes' included."""
        return time.perf_counter() - self.start

    def save_checkpoint(self, state: dict, epoch: int, step: int | None = None) -> str:
        """Epoch ``epoch``'s checkpoint (a stopped one after ``step`` steps), listed in run.json; the oldest beyond
        train.keep_checkpoints pruned (rundir.save_checkpoint)."""
        return save_checkpoint(state, self.cfg.run_dir, epoch, self.cfg.train.keep_checkpoints, step,
                                          self.owner)

    def write(self, record: dict) -> dict:
        """An epoch's record into metrics.jsonl, the board and the log."""
        if self.topo.is_root:
            append_metrics(self.metrics_path, record)
            self.history.append(record)
            if self.board:
                write_scalars(self.board, record)
            log(self.topo, epoch_line(record, self.cfg.train.epochs))
        return record

    def close(self) -> None:
        if self.board:
            self.board.close()


def log_setup(cfg: Config, t: Trainer) -> None:
    data, topo, k = t.data, t.topo, t.k
    if data.skipped_files:
        log(topo, f"hybridtrain: skipping {len(data.skipped_files)} non-image file(s), e.g. {data.skipped_files[0]}")
    dropped = data.dropped_per_epoch + (data.steps_per_epoch - t.updates * k) * topo.size * cfg.train.batch_size
    log(topo, f"hybridtrain: {topo.size} rank(s) of the {topo.engine} engine on {device_name(topo.device)}, "
              f"{cfg.data.backend} input, "
              f"{'channels_last' if cfg.data.channels_last else 'NCHW'}, {t.precision.policy.mode} precision "
              f"(fp32 math {t.fp32_math}), all-reduce compression {t.compression}")
    log(topo, f"hybridtrain: {data.train_images} train / "
              f"{data.val_images} val images, {data.num_classes} classes, {t.updates} steps/epoch, global batch "
              f"{topo.size * cfg.train.batch_size * k}" + (f" ({k} accumulated passes per step)" if k > 1 else "")
              + (f", {dropped} image(s) dropped per epoch" if dropped else ""))
    compiled = [name for name, on in ((f"torch.compile ({cfg.train.compile_scope})", cfg.train.compile),
                                      ("CUDA graphs", cfg.train.cuda_graphs),
                                      ("fused optimizer kernels", cfg.optim.fused)) if on]
    if compiled:
        switch_epoch = optimizer_spec(cfg.optim).fused_switch_epoch(cfg.optim)
        switch = f" and of epoch {switch_epoch + 1}" if switch_epoch is not None else ""
        log(topo, f"hybridtrain: {', '.join(compiled)}: the first steps of this process{switch} compile or capture "
                  f"(slow, and timed apart as warmup)")


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


class SampleAudit:
    """The sample indices of every batch this rank trained on (``elastic.audit_samples``), written when they are
    safe: at an epoch's end, at a SIGTERM's stop (its checkpoint holds them), and under --elastic at every commit
    (a rolled-back step never appears). One JSON line per write: epoch, ranks, rank, samples."""

    def __init__(self, path: str | None):
        self.path, self.pending = path, []

    def record(self, samples: list) -> None:
        """A step's sample indices, one tensor per batch (StepSnapshot.samples)."""
        if self.path:
            for indices in samples:
                self.pending.extend(indices.tolist())

    def write(self, epoch: int, topo) -> None:
        if not self.path:
            return
        with open(self.path, "a") as fh:
            fh.write(json.dumps({"epoch": epoch + 1, "ranks": topo.size, "rank": topo.rank,
                                 "samples": self.pending}) + "\n")
        self.pending = []


def audit_path(cfg: Config) -> str | None:
    if not cfg.elastic.audit_samples:
        return None
    folder = os.path.join(cfg.run_dir, "samples")
    os.makedirs(folder, exist_ok=True)
    return os.path.join(folder, f"{socket.gethostname()}-{os.getpid()}.jsonl")

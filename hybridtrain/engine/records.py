"""An epoch's record: what metrics.jsonl, TensorBoard and the log get, and the setup lines."""
from __future__ import annotations

import json
import os
import socket
import time
from typing import TYPE_CHECKING

from hybridtrain.config import Config
from hybridtrain.distributed import collectives as distributed
from hybridtrain.engine.memory import memory_figures
from hybridtrain.engine.metrics_file import append_metrics
from hybridtrain.engine.telemetry import device_name, epoch_line, log, write_scalars
from hybridtrain.optim import optimizer_spec

if TYPE_CHECKING:  # annotations only
    from hybridtrain.engine.trainer import Trainer


def record_epoch(cfg: Config, t: Trainer, record: dict, history: list, board) -> dict:
    if t.topo.is_root:
        append_metrics(os.path.join(cfg.run_dir, "metrics.jsonl"), record)
        history.append(record)
        if board:
            write_scalars(board, record)
        log(t.topo, epoch_line(record, cfg.train.epochs))
    return record


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

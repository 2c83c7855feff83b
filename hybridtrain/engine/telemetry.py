"""What a run says and writes as it goes: the progress line or bar, rank 0's log lines and TensorBoard
(metrics.jsonl: ``metrics_file``)."""
from __future__ import annotations

import os
import sys
import time

import torch

from hybridtrain.config import Config


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
        """After a step: ``steps`` of the epoch's ``total`` passes are done; ``loss_sum`` and ``seen`` are its sums
        so far (device tensors, read only for a line or the bar's loss every ``every`` passes)."""
        now = time.perf_counter()
        if self.bar is not None:
            before = self.bar.n
            self.bar.update(steps - before)
            if steps // self.every != before // self.every:
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


def tensorboard_writer(cfg: Config, resumed: bool = False):
    """TensorBoard's writer for rank 0, or None when switched off (report.tensorboard); when the config names
    sinks (sinks.mlflow, sinks.wandb), a ``sinks.Board`` that gives them the same scalars, each continuing its
    tracked run when ``resumed``."""
    writer = None
    if cfg.report.tensorboard:
        from torch.utils.tensorboard import SummaryWriter
        writer = SummaryWriter(os.path.join(cfg.run_dir, "tensorboard"))
    from hybridtrain.engine.sinks import Board, open_sinks
    sinks = open_sinks(cfg, resumed)
    return Board(writer, sinks) if sinks else writer


TENSORBOARD_SCALARS = {"loss/train": "train_loss", "loss/val": "val_loss", "top1/train": "train_top1",
                       "top1/val": "val_top1", "top5/val": "val_top5", "lr": "lr", "images_per_sec": "images_per_sec",
                       "precision/loss_scale": "loss_scale", "precision/skipped_steps": "skipped_steps",
                       "memory/peak_mb": "peak_memory_mb"}


def write_scalars(board, record: dict) -> None:
    for tag, key in TENSORBOARD_SCALARS.items():
        board.add_scalar(tag, record[key], record["epoch"])
    for part, seconds in (record.get("breakdown_s") or {}).items():  # where the epoch's time went (breakdown.py)
        board.add_scalar(f"time/{part}_s", seconds, record["epoch"])
    board.flush()


def device_name(device: torch.device) -> str:
    """'cuda:0 (NVIDIA H100 80GB HBM3)' or 'cpu'."""
    return f"{device} ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else str(device)


def epoch_line(r: dict, epochs: int) -> str:
    scale = f"  scale {r['loss_scale']:g}" if r.get("loss_scale", 1.0) != 1.0 else ""
    skipped = f"  skipped {r['skipped_steps']}" if r.get("skipped_steps") else ""
    return (f"epoch {r['epoch']:>3}/{epochs}  train_loss {r['train_loss']:.4f}  val_loss {r['val_loss']:.4f}  "
            f"train_top1 {r['train_top1']:.4f}  top1 {r['val_top1']:.4f}  top5 {r['val_top5']:.4f}  lr {r['lr']:.4g}  "
            f"{r['images_per_sec']:.0f} img/s  {r['epoch_time_s']:.1f}s{scale}{skipped}")

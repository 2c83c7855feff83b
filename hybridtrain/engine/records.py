"""What a run writes as it goes: the run's record that the loop keeps (``RunRecord``: the run folder, config.yaml,
metrics.jsonl and its records, the board, the clock), an epoch's record (what metrics.jsonl, TensorBoard and the log
get, with its peak memory), and the elastic sample audit. metrics.jsonl's format is ``metrics_file``'s, torch-free
for ``report``; what rank 0 prints (log lines, the progress bar, the epoch line) is ``sinks``'."""
from __future__ import annotations

import contextlib
import os
import re
import socket
import time

import torch

from hybridtrain.config import Config, save_config
from hybridtrain.engine.metrics_file import truncate_metrics
from hybridtrain.engine.rundir import RunDir
from hybridtrain.engine.sinks import Board, epoch_line, log, open_sinks
from hybridtrain.files import append_json_line

TENSORBOARD_SCALARS = {"loss/train": "train_loss", "loss/val": "val_loss", "top1/train": "train_top1",
                       "top1/val": "val_top1", "top5/val": "val_top5", "lr": "lr", "images_per_sec": "images_per_sec",
                       "precision/loss_scale": "loss_scale", "precision/skipped_steps": "skipped_steps",
                       "memory/peak_mb": "peak_memory_mb", "loss/val_ema": "val_loss_ema",
                       "top1/val_ema": "val_top1_ema", "top5/val_ema": "val_top5_ema"}  # the EMA's, when recorded


# ----------------------------------------------------------------------------- peak memory

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


# ----------------------------------------------------------------------------- the run's record

class RunRecord:
    """What a run keeps from its start to its end, in one place that the loop owns and that writes every file of the
    run folder the training writes: the folder's hold (``owner``, rundir.RunDir: rank 0's; None on the others and on
    an elastic rank 0 that joined later), the resolved config.yaml, metrics.jsonl (cut to the ``completed_epochs`` a
    resumed run keeps) and the records in it, the board (TensorBoard and the sinks), and the run's clock (``start``,
    which counts the ``elapsed_s`` of the run's earlier processes). Rank 0 writes; on the other ranks the writes are
    no-ops."""

    def __init__(self, cfg: Config, topo, owner: RunDir | None = None, completed_epochs: int = 0,
                 elapsed_s: float = 0.0, resumed: bool = False):
        self.cfg, self.topo, self.owner = cfg, topo, owner
        self.metrics_path = os.path.join(cfg.run_dir, "metrics.jsonl")
        self.history, self.board = [], None
        if topo.is_root:
            os.makedirs(cfg.run_dir, exist_ok=True)
            save_config(cfg, os.path.join(cfg.run_dir, "config.yaml"))
            self.history = truncate_metrics(self.metrics_path, completed_epochs)
            # one sinks.Board gives TensorBoard (unless report.tensorboard is off) and the sinks the config names
            # (sinks.mlflow, sinks.wandb, each continuing its tracked run when ``resumed``) the same scalars
            writer = None
            if cfg.report.tensorboard:
                from torch.utils.tensorboard import SummaryWriter
                writer = SummaryWriter(os.path.join(cfg.run_dir, "tensorboard"))
            sinks = open_sinks(cfg, resumed)
            self.board = Board(writer, sinks) if sinks or writer is not None else None
        self.start = time.perf_counter() - elapsed_s

    def elapsed(self) -> float:
        """The run's training time so far, its earlier processes' included."""
        return time.perf_counter() - self.start

    def write(self, record: dict) -> dict:
        """An epoch's record into metrics.jsonl, the board and the log."""
        if self.topo.is_root:
            append_json_line(self.metrics_path, record)
            self.history.append(record)
            if self.board:
                for tag, key in TENSORBOARD_SCALARS.items():
                    if key in record:
                        self.board.add_scalar(tag, record[key], record["epoch"])
                for part, seconds in (record.get("breakdown_s") or {}).items():  # where the time went (breakdown.py)
                    self.board.add_scalar(f"time/{part}_s", seconds, record["epoch"])
                self.board.flush()
            log(self.topo, epoch_line(record, self.cfg.train.epochs))
        return record

    def close(self, how: str = "finished") -> None:
        """End the board once: the sinks' tracked runs end as the training did (``how``: finished, stopped by a
        SIGTERM and resumable, or failed); a sink that cannot end its run does not hide a failed run's error."""
        board, self.board = self.board, None
        if board is not None:
            with contextlib.nullcontext() if how == "finished" else contextlib.suppress(Exception):
                board.close(how)

    def __enter__(self) -> RunRecord:
        return self

    def __exit__(self, kind, exc, tb) -> None:
        """After finish() closed the board as finished, nothing; else the run stopped (a SIGTERM's stop returns
        without finishing, Ctrl-C raises KeyboardInterrupt) or failed (an error)."""
        self.close("failed" if kind is not None and issubclass(kind, Exception) else "stopped")


def with_validation(record: dict, ev, epoch_start: float, run_start: float) -> dict:
    """The epoch's record with its validation figures, and the times that include validation."""
    return {**record, "val_loss": ev.loss, "val_top1": ev.top1, "val_top5": ev.top5, "val_count": ev.count,
            "epoch_time_s": time.perf_counter() - epoch_start, "wall_time_s": time.perf_counter() - run_start}


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
        os.makedirs(os.path.dirname(self.path), exist_ok=True)  # here, not before the run claimed its run_dir
        append_json_line(self.path, {"epoch": epoch + 1, "ranks": topo.size, "rank": topo.rank,
                                     "samples": self.pending})
        self.pending = []


def audit_path(cfg: Config) -> str | None:
    """This rank's audit file, ``run_dir/samples/HOST-PID.jsonl``. The host's name comes from the machine and is
    untrusted (Linux takes any bytes for it, '/' and '..' included): every character but letters, digits, '.', '_'
    and '-' becomes '_', so the file stays in ``samples/``."""
    if not cfg.elastic.audit_samples:
        return None
    folder = os.path.join(cfg.run_dir, "samples")
    host = re.sub(r"[^A-Za-z0-9._-]", "_", socket.gethostname()).lstrip(".") or "host"
    return os.path.join(folder, f"{host}-{os.getpid()}.jsonl")

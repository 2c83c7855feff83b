"""``hybridtrain train``: set up Horovod, data, model and optimizer; run epochs; checkpoint; report."""
from __future__ import annotations

import json
import os
import sys
import time

import torch

from . import checkpoint, distributed, reporting, speed
from .config import Config, save_config
from .data.loaders import create_loaders
from .errors import UserError
from .models import create_model
from .optim import create_optimizer
from .precision import check_hardware, create_scaler, peak_memory_mb, prepare_model, reset_peak_memory, resolve_policy
from .training import Precision, average_bn_statistics, evaluate, train_one_epoch, use_last_iteration_statistics


class ProgressBar:
    """tqdm on rank 0 (loss, img/s, ETA); nothing elsewhere. Reads the device every ``every`` steps."""

    def __init__(self, total: int, epoch: int, epochs: int, world_size: int, every: int = 5):
        from tqdm import tqdm
        self.bar = tqdm(total=total, desc=f"epoch {epoch + 1}/{epochs}", unit="step", leave=False,
                        file=sys.stdout, dynamic_ncols=True)
        self.world_size, self.every, self.start = world_size, every, time.perf_counter()

    def update(self, loss_sum, seen, steps: int) -> None:
        self.bar.update(1)
        if steps % self.every == 0:
            rate = float(seen) * self.world_size / (time.perf_counter() - self.start)
            self.bar.set_postfix(loss=f"{float(loss_sum / seen):.4f}", img_s=f"{rate:.0f}")

    def close(self) -> None:
        self.bar.close()


def log(topo, message: str) -> None:
    if topo.is_root:
        print(message, flush=True)


def resume_state(cfg: Config, topo) -> dict | None:
    """Rank 0 reads the newest valid checkpoint (weights_only) and broadcasts it to every rank."""
    state = None
    if topo.is_root:
        try:
            state = checkpoint.load_latest(cfg.run_dir)
        except UserError as exc:
            state = {"error": str(exc)}  # every rank raises it, nobody waits on a dead rank 0
    state = distributed.broadcast_object(state, "resume_state")
    if "error" in state:
        raise UserError(state["error"])
    if state.get("config_fingerprint") != cfg.fingerprint():
        log(topo, "hybridtrain: warning: the config differs from the checkpoint's; continuing with the new one")
    return state


def append_metrics(path: str, record: dict) -> None:
    with open(path, "a") as fh:
        fh.write(json.dumps(record) + "\n")


def truncate_metrics(path: str, completed_epochs: int) -> list[dict]:
    """Keep the records of the first ``completed_epochs`` epochs (a resumed run rewrites what came after)."""
    if not os.path.exists(path):
        return []
    with open(path) as fh:
        records = [json.loads(line) for line in fh if line.strip()]
    kept = [r for r in records if r["epoch"] <= completed_epochs]
    with open(path, "w") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in kept)
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


def run_training(cfg: Config, resume: bool = False) -> dict | None:
    topo = distributed.init(cfg.train.threads, cfg.horovod)
    policy = resolve_policy(cfg.precision)
    check_hardware(policy, topo.device)
    speed.check_speedups(cfg.train, topo.device)
    data = create_loaders(cfg, topo)
    m = cfg.model
    model = create_model(m.arch, data.num_classes, m.variant, m.small_input_stem, m.zero_init_last_bn, seed=cfg.seed,
                         residual_bn_scale=m.residual_bn_scale, bn_swap=m.bn_swap).to(topo.device)
    model = prepare_model(model, policy)
    precision = Precision(policy, create_scaler(cfg.precision, policy))
    if cfg.data.channels_last:
        model = model.to(memory_format=torch.channels_last)
    use_last_iteration_statistics(model)
    steps = data.steps_per_epoch
    bundle = create_optimizer(model, cfg, topo.size, steps)
    bundle.on_phase_change = lambda step, s: log(topo, f"hybridtrain: switching to {s['phase']} at step {step} "
                                                       f"(epoch {step // steps + 1}), lr {s['lr']:.4g}")
    metrics_path = os.path.join(cfg.run_dir, "metrics.jsonl")
    start_epoch, history, elapsed_before = 0, [], 0.0
    run_step = speed.build_train_step(model, cfg, precision)  # a CUDA graph is captured before Horovod's hooks exist
    # Wrap first: Horovod rebuilds the optimizer from its param_groups, so state loaded before would be lost.
    bundle.optimizer = distributed.distributed_optimizer(bundle.optimizer, model, cfg.horovod)
    if resume:
        state = resume_state(cfg, topo)
        model.load_state_dict(state["model"])  # copies into the parameters wherever they live
        bundle.optimizer.load_state_dict(state["optimizer"])
        if "scaler" in state:
            precision.scaler.load_state_dict(state["scaler"])
        start_epoch, elapsed_before = state["epoch"] + 1, state.get("elapsed_s", 0.0)
        log(topo, f"hybridtrain: resumed from epoch {state['epoch'] + 1} in {cfg.run_dir}")
    else:
        distributed.broadcast_model(model)
        bundle.optimizer.load_state_dict(distributed.broadcast_object(bundle.optimizer.state_dict(), "optim_init"))
    if topo.is_root:
        os.makedirs(cfg.run_dir, exist_ok=True)
        save_config(cfg, os.path.join(cfg.run_dir, "config.yaml"))
        history = truncate_metrics(metrics_path, start_epoch)
    if data.skipped_files:
        log(topo, f"hybridtrain: skipping {len(data.skipped_files)} non-image file(s), e.g. {data.skipped_files[0]}")
    log(topo, f"hybridtrain: {topo.size} rank(s), {cfg.data.backend} input, {data.train_images} train / "
              f"{data.val_images} val images, {data.num_classes} classes, {steps} steps/epoch, global batch "
              f"{topo.size * cfg.train.batch_size}"
              + (f", {data.dropped_per_epoch} image(s) dropped per epoch" if data.dropped_per_epoch else ""))
    run_start = time.perf_counter() - elapsed_before
    board = tensorboard_writer(cfg) if topo.is_root else None
    for epoch in range(start_epoch, cfg.train.epochs):
        epoch_start = time.perf_counter()
        bar = ProgressBar(steps, epoch, cfg.train.epochs, topo.size) if topo.is_root and cfg.train.progress else None
        reset_peak_memory(topo.device)
        result = train_one_epoch(model, bundle, precision, data.train, epoch, steps, bar, run_step)
        if bar:
            bar.close()
        average_bn_statistics(model)
        ev = evaluate(model, data.val, policy, tag=str(epoch))
        peak_mb = distributed.allgather_floats([peak_memory_mb(topo.device)], f"peak_memory.{epoch}")
        record = {"epoch": epoch + 1, "train_loss": result.train_loss, "train_top1": result.train_top1,
                  "val_loss": ev.loss, "val_top1": ev.top1,
                  "val_top5": ev.top5, "lr": bundle.optimizer.param_groups[0]["lr"],
                  "epoch_time_s": time.perf_counter() - epoch_start,
                  "train_time_s": result.train_time_s,
                  "images_per_sec": result.samples_seen / result.train_time_s, "samples_seen": result.samples_seen,
                  "val_count": ev.count, "wall_time_s": time.perf_counter() - run_start,
                  "loss_scale": precision.scaler.scale, "skipped_steps": result.skipped_steps,
                  "peak_memory_mb": max(peak_mb), "peak_memory_mb_per_rank": peak_mb, "world_size": topo.size}
        if topo.is_root:
            append_metrics(metrics_path, record)
            history.append(record)
            if board:
                write_scalars(board, record)
            state = {"model": model.state_dict(), "optimizer": bundle.optimizer.state_dict(),
                     "scaler": precision.scaler.state_dict(), "epoch": epoch,
                     "config": cfg.to_dict(), "config_fingerprint": cfg.fingerprint(),
                     "elapsed_s": time.perf_counter() - run_start}
            checkpoint.save_checkpoint(state, cfg.run_dir, epoch + 1, cfg.train.keep_checkpoints)
            log(topo, reporting.epoch_line(record, cfg.train.epochs))
    digests = distributed.gather_digests(model.state_dict(), bundle.optimizer.state_dict())
    if not topo.is_root:
        return None
    if len(set(digests)) != 1:
        print("hybridtrain: warning: ranks ended with different parameters or optimizer state (see report.json rank_digests)",
              file=sys.stderr)
    torch.save(model.state_dict(), os.path.join(cfg.run_dir, "final_model.pt"))
    if board:
        board.close()
    report = reporting.report_run(cfg.run_dir, extra={"world_size": topo.size, "rank_digests": digests})
    print(reporting.summary_table(report), flush=True)
    return report

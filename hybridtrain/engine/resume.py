"""Continuing a run: the checkpoint's state, restoring it, and a preempted epoch's checkpoint."""
from __future__ import annotations

import dataclasses

import torch

from hybridtrain.config import Config
from hybridtrain.distributed import collectives as distributed
from hybridtrain.engine import checkpoint
from hybridtrain.engine.epoch import EpochProgress
from hybridtrain.engine.telemetry import log
from hybridtrain.engine.trainer import Trainer
from hybridtrain.errors import UserError
from hybridtrain.models.batchnorm import average_running_statistics, running_buffers


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
    mine = {"bn_buffers": [buf.detach().cpu().clone() for buf in running_buffers(t.model)],
            "progress": dataclasses.asdict(stopped)}
    ranks = distributed.allgather_object(mine, "stopped_epoch")
    average_running_statistics(t.model, cfg.bn.combine)  # the checkpoint's model is the averaged one
    if t.topo.is_root:
        state = checkpoint_state(cfg, t, epoch - 1, elapsed_s)
        state["partial"] = {"epoch": epoch, "ranks": ranks}
        path = checkpoint.save_checkpoint(state, cfg.run_dir, epoch + 1, cfg.train.keep_checkpoints,
                                          step=stopped.passes // t.k)
        log(t.topo, f"hybridtrain: stopped on SIGTERM after step {stopped.passes // t.k} of epoch {epoch + 1}; "
                    f"resumable from {path}: rerun the same command with --resume auto")
    distributed.barrier()

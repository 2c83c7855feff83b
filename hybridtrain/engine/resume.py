"""Continuing a run: the checkpoint's state, restoring it, and a preempted epoch's checkpoint."""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from hybridtrain.config import Config
from hybridtrain.config.sections import NOT_RECIPE
from hybridtrain.distributed import collectives as distributed
from hybridtrain.engine import rundir
from hybridtrain.engine.epoch import EpochPosition, EpochProgress
from hybridtrain.engine.guards import root_writes
from hybridtrain.engine.sinks import log
from hybridtrain.errors import UserError
from hybridtrain.models.batchnorm import average_running_statistics, running_buffers

if TYPE_CHECKING:  # annotations only
    from hybridtrain.engine.records import RunRecord
    from hybridtrain.engine.trainer import Trainer


def resume_state(cfg: Config, topo, required: bool = True) -> dict | None:
    """Rank 0 reads the newest valid checkpoint (weights_only) and broadcasts it to every rank; None when
    there is none and it is not ``required`` (``--resume auto``)."""
    state = None
    if topo.is_root:
        try:
            state = rundir.load_latest(cfg.run_dir) if required or rundir.list_checkpoints(cfg.run_dir) \
                else {"none": True}
        except UserError as exc:
            state = {"error": str(exc)}  # every rank raises it, nobody waits on a dead rank 0
    state = distributed.broadcast_object(state, "resume_state")
    if "none" in state:
        log(topo, f"hybridtrain: --resume auto: no checkpoint in {cfg.run_dir}, starting fresh")
        return None
    if "error" in state:
        raise UserError(state["error"])
    if state.get("config_fingerprint") != cfg.fingerprint() and (line := config_change_line(state.get("config") or {},
                                                                                          cfg)):
        log(topo, line)
    return state


# the keys that only shape the initial weights: a resumed run loads the checkpoint's weights instead
INITIAL_WEIGHTS_KEYS = ("model.zero_init_last_bn", "model.conv_init", "model.gaussian_std")


def config_change_line(saved: dict, cfg: Config) -> str:
    """The warning of a resume under a changed recipe: each changed key, from what to what, and whether it applies
    from here on (a key of the initial weights does not: the checkpoint's weights are loaded); "" when only the
    run_dir moved."""
    new = cfg.to_dict()
    changes = {"apply": [], "not": []}
    for section in sorted(set(saved) | set(new)):
        if section in NOT_RECIPE or section == "run_dir":  # run_dir: where the checkpoint was found, moved or not
            continue
        before, after = saved.get(section), new.get(section)
        pairs = {section: (before, after)} if not isinstance(after, dict) or not isinstance(before, dict) else {
            f"{section}.{key}": (before.get(key, "(unset)"), after.get(key, "(unset)"))
            for key in sorted(set(before) | set(after))}
        for key, (old, now) in pairs.items():
            if old != now:
                changes["not" if key in INITIAL_WEIGHTS_KEYS else "apply"].append(f"{key} {old} -> {now}")
    if not changes["apply"] and not changes["not"]:
        return ""
    line = "hybridtrain: warning: the config differs from the checkpoint's"
    if changes["apply"]:
        line += f": {', '.join(changes['apply'])} (applies from here on)"
    if changes["not"]:
        line += (f"; {', '.join(changes['not'])} (does not apply: it shapes the initial weights, and the "
                 f"checkpoint's are loaded)")
    return line


def restore(t: Trainer, state: dict, backend: str) -> EpochPosition | None:
    """Load a checkpoint into the trainer; a mid-epoch one also gives where its epoch continues. On the layout it
    stopped on (ranks, train.batch_size) every rank continues its own batches with its own BN buffers (bitwise);
    on another layout the epoch continues by samples, as an elastic resize does: the rest of the epoch's permutation
    is cut into this job's global batches (``sharding.train_batches(start=...)``), so no sample is trained twice or
    skipped; only the final remainder (less than one global batch) is left out, as always."""
    t.load_state_dict(state)
    partial = state.get("partial")
    if not partial:
        return None
    ranks, batch_size = stopped_layout(state)
    if (ranks, batch_size) == (t.topo.size, t.batch_size):
        mine = partial["ranks"][t.topo.rank]
        with torch.no_grad():
            for buf, saved in zip(running_buffers(t.model), mine["bn_buffers"], strict=True):
                buf.copy_(saved)  # its own, not the average
        if t.ema is not None and "ema_bn_buffers" in mine:
            t.ema.load_bn_buffers(mine["ema_bn_buffers"])  # the EMA's of them too
        return EpochPosition(partial["epoch"], EpochProgress(**mine["progress"]), partial.get("start", 0),
                             partial.get("first_step", 0))
    consumed, totals, train_time_s, skipped_steps, breakdown = stopped_by_samples(state)
    check_continuable_by_samples(backend, partial["epoch"], consumed, (ranks, batch_size), (t.topo.size, t.batch_size))
    return EpochPosition(partial["epoch"], carried_progress(totals, train_time_s, skipped_steps, t.topo.is_root,
                                                            breakdown),
                         consumed, step_in_epoch(consumed, t.topo.size, t.batch_size, t.k))


def check_continuable_by_samples(backend: str, epoch: int, consumed: int, stopped: tuple[int, int],
                                 now: tuple[int, int]) -> None:
    """A stopped epoch continues on another (ranks, train.batch_size) layout only where the loader can start an
    epoch at a sample (``set_epoch(epoch, start)``): DALI's readers cannot, so that is one line with the fix."""
    if backend.startswith("dali"):
        raise UserError(f"the newest checkpoint stopped mid-epoch after {consumed} samples of epoch {epoch + 1} with "
                        f"train.batch_size={stopped[1]} on {stopped[0]} rank(s), this job has train.batch_size="
                        f"{now[1]} on {now[0]} rank(s), and data.backend={backend} starts an epoch only at its "
                        f"beginning: resume with train.batch_size={stopped[1]} on {stopped[0]} rank(s), or with "
                        f"data.backend=torchvision")


def stopped_layout(state: dict) -> tuple[int, int]:
    """(ranks, train.batch_size) of the run that wrote a mid-epoch checkpoint (older ones: its saved config's)."""
    partial = state["partial"]
    return len(partial["ranks"]), partial.get("batch_size", state["config"]["train"]["batch_size"])


def stopped_by_samples(state: dict) -> tuple[int, list[float], float, int, dict]:
    """A mid-epoch checkpoint's epoch as it continues by samples, on any layout (a static resume on another one, an
    elastic start): the samples its permutation consumed, the epoch's (loss sum, correct, seen) over all ranks, its
    training time so far (the longest rank's), its skipped steps and that rank's breakdown of the time."""
    partial = state["partial"]
    progress = [r["progress"] for r in partial["ranks"]]
    consumed = partial.get("samples", consumed_samples(partial.get("start", 0), progress[0]["passes"],
                                                       *stopped_layout(state)))
    totals = [sum(p[key] for p in progress) for key in ("loss_sum", "correct", "seen")]
    longest = max(progress, key=lambda p: p["train_time_s"])
    return consumed, totals, longest["train_time_s"], progress[0]["skipped_steps"], longest.get("breakdown", {})


def consumed_samples(start: int, passes: int, world_size: int, batch_size: int) -> int:
    """Samples of an epoch's permutation consumed after ``passes`` passes from sample ``start``: every pass takes
    the next global batch, ``world_size * batch_size`` samples, however it is split between the ranks."""
    return start + passes * world_size * batch_size


def step_in_epoch(consumed: int, world_size: int, batch_size: int, accumulation_steps: int) -> int:
    """The optimizer step of the epoch where a segment starts: consumed samples / the current global batch
    (rounded down), so the schedule keeps its place in epochs when N changes."""
    return consumed // (world_size * batch_size * accumulation_steps)


def carried_progress(totals: list[float], train_time_s: float, skipped_steps: int, is_root: bool,
                     breakdown: dict) -> EpochProgress:
    """An epoch's totals so far as this rank's starting point: rank 0 carries the sums (the epoch's sums are
    all-reduced), every rank the time, its breakdown and the skipped steps."""
    sums = totals if is_root else [0.0, 0.0, 0.0]
    return EpochProgress(0, *sums, train_time_s, skipped_steps, dict(breakdown))


def checkpoint_state(cfg: Config, t: Trainer, completed_epoch: int, elapsed_s: float,
                     pending_record: dict | None = None) -> dict:
    """``pending_record``: the epoch's record before validation; a resume validates and records it if the run
    stopped before its metrics line was written."""
    return {**t.state_dict(), "epoch": completed_epoch, "config": cfg.to_dict(),
            "config_fingerprint": cfg.fingerprint(), "elapsed_s": elapsed_s,
            **({"pending_record": pending_record} if pending_record else {})}


def save_stopped_epoch(cfg: Config, t: Trainer, position: EpochPosition, stopped: EpochProgress,
                       run: RunRecord) -> None:
    """A preempted epoch's checkpoint: the averaged model, every rank's own BN buffers and progress, and the
    layout and samples consumed, so that a resume on another layout continues by samples."""
    mine = {"bn_buffers": [buf.detach().cpu().clone() for buf in running_buffers(t.model)],
            "progress": dataclasses.asdict(stopped)}
    if t.ema is not None:
        mine["ema_bn_buffers"] = t.ema.bn_buffers()
    ranks = distributed.allgather_object(mine, "stopped_epoch")
    average_running_statistics(t.model, cfg.bn.combine)  # the checkpoint's model is the averaged one
    if t.ema is not None:
        t.ema.average_bn()

    epoch, step = position.epoch, position.first_step + stopped.passes // t.k

    elapsed = run.elapsed()
    with root_writes(t.topo) as writing:
        if writing:
            state = checkpoint_state(cfg, t, epoch - 1, elapsed)
            state["partial"] = {"epoch": epoch, "ranks": ranks, "batch_size": t.batch_size, "start": position.start,
                                "first_step": position.first_step,
                                "samples": consumed_samples(position.start, stopped.passes, t.topo.size,
                                                            t.batch_size)}
            path = run.owner.save_checkpoint(state, epoch + 1, cfg.train.keep_checkpoints, step)
            log(t.topo, f"hybridtrain: stopped on SIGTERM after step {step} of epoch {epoch + 1}; "
                        f"resumable from {path}: rerun the same command with --resume auto")

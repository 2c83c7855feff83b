"""The epoch loop of ``hybridtrain train``: claim the run_dir, build the trainer, resume, run the epochs, each
ended by the one end-of-epoch path, and finish."""
from __future__ import annotations

import contextlib
import os
import sys
import time
import traceback

from hybridtrain.config import Config
from hybridtrain.data.resolution import train_resolution
from hybridtrain.distributed import collectives as distributed
from hybridtrain.distributed import failures
from hybridtrain.engine import checkpoint, rundir
from hybridtrain.engine.breakdown import epoch_fields, startup_fields, startup_line, startup_mark
from hybridtrain.engine.epoch import (
    EpochPosition,
    EpochResult,
    EpochSteps,
    evaluate,
)
from hybridtrain.engine.guards import PreemptionWatch, StallWatchdog, root_writes, steps_between_checks
from hybridtrain.engine.profiling import step_profiler
from hybridtrain.engine.records import RunRecord, memory_figures, reset_peak_memory, with_validation
from hybridtrain.engine.resume import checkpoint_state, restore, resume_state, save_stopped_epoch
from hybridtrain.engine.sinks import ProgressBar, device_name, log
from hybridtrain.engine.step import compiles_in_epoch, recompiles_in_epoch, warmup_steps
from hybridtrain.engine.trainer import Trainer, build_trainer
from hybridtrain.errors import PeerFailure, UserError, environment_fault, is_peer_failure
from hybridtrain.models.batchnorm import average_running_statistics
from hybridtrain.optim import optimizer_spec


def claim_run_dir(cfg: Config, topo, resume: str | None, move_aside: bool) -> rundir.RunDir | None:
    """Rank 0 locks run_dir and names the run (rundir.claim); its refusal, or a fault of the machine (read-only
    folder, full disk, dangling link) as the one line that names its path and the fix, reaches every rank."""
    held, outcome = None, None
    if topo.is_root:
        try:
            held, note = rundir.claim(cfg.run_dir, resume, move_aside)
            outcome = {"note": note}
        except UserError as exc:
            outcome = {"error": str(exc)}
        except OSError as exc:
            if environment_fault(exc) is None:
                raise
            outcome = {"error": environment_fault(exc)}
    outcome = distributed.broadcast_object(outcome, "run_dir_claim")
    if "error" in outcome:
        raise UserError(outcome["error"])
    if outcome["note"]:
        log(topo, outcome["note"])
    return held


def run_training(cfg: Config, resume: str | None = None, move_aside: bool = False) -> dict | None:
    """Train; ``resume``: None (fresh), "required" (a checkpoint must exist) or "auto" (if one exists);
    ``move_aside``: a fresh run moves a previous run's files out of run_dir instead of refusing.
    When another rank dies, this one raises PeerFailure naming it.

    The process group is destroyed on the way out, after a finished or preempted run (every rank is past its last
    collective) and after this rank's own error (left to the interpreter's teardown, a Gloo group
    aborts the process, "terminate called without an active exception", and exit 2 became 134). Destroying is
    local in torch (no collective: Gloo's group ends its own threads; NCCL's flushes what this rank issued), so a
    rank that failed alone does not wait for its peers. Not after a peer's failure: a peer may have died inside a
    collective, and the launcher ends this rank anyway."""
    startup_mark("imports")  # the interpreter, the config, torch: the time to the first step (breakdown.py)
    watch = PreemptionWatch()  # first: a SIGTERM during the setup also ends the run cleanly
    topo = distributed.init(cfg.train.threads, cfg, device=cfg.train.device, engine=cfg.distributed.engine)
    watch.join(topo)
    owner, outcome, t = None, "failed", None
    try:
        owner = claim_run_dir(cfg, topo, resume, move_aside)  # before the set-up: a refusal costs nothing
        startup_mark("engine_start")
        t = build_trainer(cfg, topo)
        watch.every = steps_between_checks(t.updates)
        finished = train_epochs(cfg, t, watch, resume, owner)
        outcome = "done"
        return finished
    except PeerFailure:
        outcome = "peer failed"
        raise
    except RuntimeError as exc:
        if is_peer_failure(exc):
            outcome = "peer failed"
            raise failures.peer_failure(topo) from None
        raise
    finally:
        if outcome == "failed":
            release_failed_run(t, sys.exc_info()[1])
        t = None  # noqa: F841 - the trainer's DDP wrapper holds the process group: shutdown destroys it only when free
        if outcome == "done":
            distributed.shutdown()
        elif outcome == "failed":
            with contextlib.suppress(Exception):  # this rank's own error line matters more than the teardown
                distributed.shutdown()
        if owner:
            owner.release()


def release_failed_run(t: Trainer | None, exc: BaseException | None) -> None:
    """Let go of what still holds a failed run's DDP wrapper, and with it the process group, before ``shutdown()``.
    The error's traceback keeps the frames it passed through (train_epochs, the epoch, the step) and
    with them their locals (the trainer, the step, the DDP wrapper itself in its forward's frames) and, through the
    frames of closures (the epoch's ``walk``), their function objects and cells, which clearing a frame does not
    reach: without this the wrapper outlived ``shutdown()`` until the exception died in the CLI's ``except`` clause,
    or, in a reference cycle, until a later collection, perhaps the interpreter's teardown, where a Gloo group's
    destructor can abort the process. So the trainer drops its step (which holds the wrapper) and the frames of
    ``exc`` and of the exceptions it chained drop their locals; the traceback keeps its files and lines for the crash
    log, and the frames still running (this one's callers) are left as they are."""
    if t is not None:
        t.step = None
    pending, seen = [exc], set()
    while pending:
        exc = pending.pop()
        if exc is None or id(exc) in seen:
            continue
        seen.add(id(exc))
        traceback.clear_frames(exc.__traceback__)
        pending += [exc.__cause__, exc.__context__]


def end_epoch(cfg: Config, t: Trainer, epoch: int, result, epoch_start: float, run: RunRecord) -> dict:
    """The one end-of-epoch path of the static and the elastic loop: BN statistics averaged over the ranks ->
    the checkpoint (rank 0; local work for the watchdog on every rank), so a failing validation loses no training ->
    validation -> the record in metrics.jsonl, TensorBoard and the log (``run``)."""
    average_running_statistics(t.model, cfg.bn.combine)
    if t.ema is not None:
        t.ema.average_bn()
    record = {**training_record(t, epoch, result, epoch_start, run.start),
              "train_resolution": train_resolution(cfg, epoch)}  # progressive resizing's px (data.res_*)
    saving, elapsed = time.perf_counter(), run.elapsed()
    with root_writes(t.topo) as writing:
        if writing:
            state = checkpoint_state(cfg, t, epoch, elapsed, record)
            run.owner.save_checkpoint(state, epoch + 1, cfg.train.keep_checkpoints)
    validating = time.perf_counter()
    try:
        ev, extra = validate(cfg, t, str(epoch))
    except UserError as exc:
        raise UserError(f"{exc} (epoch {epoch + 1}'s training is saved: fix the data, then rerun with --resume "
                        f"auto)") from None
    record.update(epoch_breakdown(t, epoch, result, validating - saving, time.perf_counter() - validating,
                                  epoch_start))
    return run.write({**with_validation(record, ev, epoch_start, run.start), **extra})


def validate(cfg: Config, t: Trainer, tag: str) -> tuple:
    """The raw weights' validation, and beside it the EMA's (train.ema_decay) as ``{"val_top1_ema": ...}``; both
    with train.val_flip's mirrored logits when it is set."""
    ev = evaluate(t.model, t.data.val, t.precision, tag=tag, flip=cfg.train.val_flip)
    if t.ema is None:
        return ev, {}
    with t.ema.swapped_in():
        averaged = evaluate(t.model, t.data.val, t.precision, tag=f"{tag}.ema", flip=cfg.train.val_flip)
    return ev, {"val_loss_ema": averaged.loss, "val_top1_ema": averaged.top1, "val_top5_ema": averaged.top5}


def epoch_breakdown(t: Trainer, epoch: int, result, checkpoint_s: float, validation_s: float,
                    epoch_start: float) -> dict:
    """The record's breakdown of the epoch's time (breakdown.epoch_fields: every rank's parts in one allgather)
    and, in a process's first record, its time to the first step (rank 0's, also as a log line)."""
    fields = epoch_fields(distributed.allgather_floats, result.breakdown or {}, validation_s, checkpoint_s,
                          epoch_start, t.topo.size, str(epoch))
    fields.update(startup_fields())
    if "startup_s" in fields:
        log(t.topo, startup_line(fields["startup_s"]))
    return fields


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


def complete_pending_record(cfg: Config, t: Trainer, state: dict, run: RunRecord) -> None:
    """A run that stopped between an epoch's checkpoint and its metrics line: validate now and write the line."""
    pending = state.get("pending_record") if not state.get("partial") else None
    missing = distributed.broadcast_object(bool(pending) and all(r["epoch"] != pending["epoch"] for r in run.history),
                                           "pending_record")
    if missing:
        now = time.perf_counter()
        ev, extra = validate(cfg, t, f"pending{pending['epoch']}")
        run.write({**with_validation(pending, ev, now - pending["epoch_time_s"], now - pending["wall_time_s"]),
                   **extra})


def train_epochs(cfg: Config, t: Trainer, watch: PreemptionWatch, resume: str | None,
                 owner: rundir.RunDir | None = None) -> dict | None:
    topo = t.topo
    start_epoch, elapsed_before, resumed = 0, 0.0, None
    state = resume_state(cfg, topo, required=resume == "required") if resume else None
    if state:
        resumed = restore(t, state, cfg.data.backend)
        start_epoch, elapsed_before = state["epoch"] + 1, state.get("elapsed_s", 0.0)
        log(topo, f"hybridtrain: resumed from {resumed_at(resumed, t, start_epoch)} in {cfg.run_dir}")
    else:
        distributed.broadcast_model(t.model)
        t.bundle.optimizer.load_state_dict(distributed.broadcast_object(t.bundle.optimizer.state_dict(), "optim_init"))
        if t.ema is not None:
            t.ema.reset()  # from the broadcast weights
    startup_mark("model_build")  # built, wrapped and broadcast (or restored)
    log_setup(cfg, t)
    if cfg.profile.enabled:
        check_profile(cfg, t, start_epoch, resumed)
    run = RunRecord(cfg, topo, owner, start_epoch, elapsed_before, resumed=state is not None)
    with run:  # the tracked runs end as failed on an error, as stopped on a SIGTERM's stop or Ctrl-C
        if state:
            complete_pending_record(cfg, t, state, run)
        t.profiler = step_profiler(cfg, topo)  # train --profile; None when off
        watchdog = stall_watchdog(cfg, topo)
        startup_mark("run_setup")  # the config written, metrics.jsonl, TensorBoard's writer, the watchdog
        try:
            return train_epoch_range(cfg, t, watch, watchdog, start_epoch, resumed, run)
        finally:
            watchdog.close()
            if t.profiler is not None:
                t.profiler.close()


def check_profile(cfg: Config, t: Trainer, start_epoch: int, resumed: EpochPosition | None) -> None:
    """--profile's window within the steps this process trains (one line when it ends after them: the trace would
    be cut short or empty), and a line when profile.memory's CUDA snapshot cannot be taken on this device."""
    p = cfg.profile
    window = p.wait + p.warmup + p.active
    done = resumed.first_step + resumed.resume.passes // t.k if resumed and resumed.resume else 0
    left = (cfg.train.epochs - start_epoch) * t.updates - done
    if window > left:
        raise UserError(f"--profile's window, profile.wait + warmup + active = {p.wait} + {p.warmup} + {p.active} = "
                        f"{window} steps, ends after the {left} step(s) this run trains ({t.updates} per epoch): "
                        f"lower profile.wait (or warmup, active), or train more epochs")
    if p.memory and t.topo.device.type != "cuda":
        log(t.topo, f"hybridtrain: warning: profile.memory is a CUDA memory snapshot and this run is on "
                    f"{t.topo.device}: no snapshot is written (the trace is)")


def resumed_at(position: EpochPosition | None, t: Trainer, start_epoch: int) -> str:
    """Where a resumed run continues, for its log line."""
    if position is None:
        return f"epoch {start_epoch}"
    if position.resume.passes:  # the layout it stopped on: every rank continues its own batches
        return f"step {position.first_step + position.resume.passes // t.k} of epoch {position.epoch + 1}"
    return (f"sample {position.start} of epoch {position.epoch + 1}'s permutation (another layout: the rest in global "
            f"batches of {t.topo.size} x {t.batch_size})")


def train_epoch(cfg: Config, t: Trainer, position: EpochPosition, first_of_process: bool, watchdog: StallWatchdog,
                after_step) -> EpochResult:
    """One epoch of the static or the elastic loop: the ``EpochSteps`` (after the peak-memory reset, the compiling
    epoch's first steps timed apart as warmup), each step noted (its samples into the audit, rank 0's progress bar,
    a phase change's line: the switch to SGD), and after every step but the last the stall watchdog's beat and
    ``after_step(steps)``: the static loop's preemption check, True on every rank after the same step, stops the
    epoch there; the elastic loop's commit count (a commit every elastic.commit_steps) never does."""
    bar = ProgressBar(t.updates * t.k, position.epoch, cfg.train.epochs, t.topo.size) \
        if t.topo.is_root and cfg.train.progress else None
    reset_peak_memory(t.topo.device)
    compiles = (compiles_in_epoch(position.epoch, first_of_process, cfg.optim)
                or recompiles_in_epoch(cfg, position.epoch))  # progressive resizing's next resolution, compiled
    warmup = warmup_steps(compiles, t.updates)
    # the first steps that may compile, capture or autotune for longer than the stall limit: the warmup steps, at
    # least the first, when the epoch compiles; else none
    steps = EpochSteps(t, position, warmup, max(warmup, 1) if compiles else 0)
    try:
        for snap in steps:
            t.audit.record(snap.samples)  # none without an audit file (records.SampleAudit)
            if bar:
                bar.update(snap.loss_sum, snap.seen, snap.passes)
            if snap.phase_change:
                s, step = snap.phase_change, snap.global_step
                log(t.topo, f"hybridtrain: switching to {s['phase']} at step {step} (epoch {step // t.updates + 1}), "
                            f"lr {s['lr']:.4g}")
            if not snap.last:
                watchdog.beat()
                if after_step(steps):
                    return steps.stopped()
        return steps.result()
    finally:
        steps.clock.detach()  # the gradient hook of the breakdown's clock (DDP), whatever ended the epoch
        if bar:
            bar.close()


def stall_watchdog(cfg: Config, topo) -> StallWatchdog:
    """This rank's stall watchdog (guards.py), for the static and the elastic loop."""
    return StallWatchdog(cfg.distributed.stall_warning_s, cfg.distributed.stall_shutdown_s, topo.rank)


def start_epoch_clock(position: EpochPosition) -> float:
    """The epoch's start (a ``perf_counter``), the same moment on every rank: after a barrier, so rank 0's own
    set-up (the sinks' tracked runs, TensorBoard's writer, config.yaml) is not its peers' first step. A continued
    epoch starts its earlier training time before: its epoch_time_s, train_time_s and breakdown span the same."""
    distributed.barrier()
    return time.perf_counter() - (position.resume.train_time_s if position.resume else 0.0)


def train_epoch_range(cfg: Config, t: Trainer, watch: PreemptionWatch, watchdog: StallWatchdog, start_epoch: int,
                      resumed: EpochPosition | None, run: RunRecord) -> dict | None:
    """Epochs ``start_epoch`` to the end, each followed by the end-of-epoch path; a SIGTERM stops after a step."""
    topo = t.topo
    for epoch in range(start_epoch, cfg.train.epochs):
        position = resumed if resumed and epoch == start_epoch else EpochPosition(epoch)
        epoch_start = start_epoch_clock(position)
        result = train_epoch(cfg, t, position, epoch == start_epoch, watchdog, lambda steps: watch.after_step())
        if result.stopped:
            watch.close()
            t.audit.write(epoch, topo)
            save_stopped_epoch(cfg, t, position, result.stopped, run)
            return None
        watchdog.beat()
        t.audit.write(epoch, topo)
        end_epoch(cfg, t, epoch, result, epoch_start, run)
        watchdog.beat()
        if epoch + 1 < cfg.train.epochs and watch.agreed_now():
            watch.close()
            log(topo, f"hybridtrain: stopped on SIGTERM after epoch {epoch + 1}; resumable from its checkpoint: "
                      f"rerun the same command with --resume auto")
            return None
    watch.close()
    watchdog.pause()
    return finish(cfg, t, run)


def finish(cfg: Config, t: Trainer, run: RunRecord) -> dict | None:
    """Check that the ranks agree and write the final model; rank 0 returns what the report adds (cli writes
    it), the other ranks None."""
    digests = distributed.gather_digests(t.model.state_dict(), t.bundle.optimizer.state_dict())
    if not t.topo.is_root:
        return None
    if len(set(digests)) != 1:
        print("hybridtrain: warning: ranks ended with different parameters or optimizer state (see report.json "
              "rank_digests)", file=sys.stderr)
    # contiguous CPU tensors: loads anywhere without map_location, strictly into torchvision's ResNet; the raw
    # weights or their EMA (train.final_weights)
    weights = t.ema.weights() if cfg.train.final_weights == "ema" else t.model.state_dict()
    final = {name: tensor.detach().cpu().contiguous() for name, tensor in weights.items()}
    checkpoint.atomic_save(final, os.path.join(cfg.run_dir, "final_model.pt"))  # durable, with its .sha256
    run.close()
    return {"world_size": t.topo.size, "rank_digests": digests}

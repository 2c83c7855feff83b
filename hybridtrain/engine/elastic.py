"""``hybridtrain train --elastic``: Horovod elastic training, where ranks may leave and join while training runs.

Launch it under ``horovodrun -np N --min-np A --max-np B --host-discovery-script SCRIPT``. Every
``elastic.commit_steps`` optimizer steps the ranks commit their state in memory: model (with BN buffers),
optimizer (phase, moments, momentum), loss scaler, and the :class:`Position` (epoch, samples consumed, the
epoch's running totals). When the discovery script adds or removes slots, every rank stops at the next
commit, Horovod re-forms the job, the ranks rebuild what depends on their number, rank 0's state is
broadcast, and training goes on. When a rank dies, the others roll back to the last commit instead.

The policy on a resize (docs/elastic.md):
- data: the epoch's permutation is kept; the samples already consumed stay consumed, and the rest is cut
  into global batches of the new size (``sharding.train_batches(start=...)``). No sample is repeated or
  skipped within an epoch.
- schedule: N = current ranks x accumulation steps, so lr*N, the AdaBound bounds B_l, B_u and the
  warmup follow the current rank count. The position in training is kept in epochs: the new steps per
  epoch are those of the new N, and the step within the epoch is consumed samples / new global batch.
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import os
import time
from dataclasses import dataclass, field

import torch

from hybridtrain.config import Config
from hybridtrain.data.loaders import create_loaders
from hybridtrain.distributed import collectives as distributed
from hybridtrain.distributed import horovod
from hybridtrain.engine.breakdown import startup_mark
from hybridtrain.engine.epoch import EpochPosition, EpochProgress
from hybridtrain.engine.loop import (
    claim_run_dir,
    end_epoch,
    finish,
    log_setup,
    stall_watchdog,
    start_epoch_clock,
    train_epoch,
)
from hybridtrain.engine.profiling import step_profiler
from hybridtrain.engine.records import RunRecord, SampleAudit, audit_path
from hybridtrain.engine.resume import (
    carried_progress,
    consumed_samples,
    resume_state,
    step_in_epoch,
    stopped_by_samples,
)
from hybridtrain.engine.sinks import log
from hybridtrain.engine.trainer import Trainer, build_trainer
from hybridtrain.errors import UserError
from hybridtrain.optim import create_schedule

LAUNCH_HINT = ("horovodrun -np N --min-np A --max-np B --host-discovery-script SCRIPT hybridtrain train --elastic "
               "--config FILE")


def check_elastic(cfg: Config) -> None:
    """What elastic training cannot do, each as one line, before any rank starts Horovod."""
    if os.environ.get("HOROVOD_ELASTIC") != "1":
        raise UserError(f"--elastic needs Horovod's elastic launcher, which this process was not started by: "
                        f"run {LAUNCH_HINT}, or drop --elastic")
    if cfg.data.backend != "torchvision":
        raise UserError(f"--elastic re-shards the data when ranks change, which data.backend={cfg.data.backend} "
                        f"cannot do yet: use data.backend=torchvision, or drop --elastic")
    knobs = horovod.horovod_environment(cfg)
    defaults = horovod.HOROVOD_DEFAULTS.items()
    if not any(horovod.same_setting(knobs[name], default) for name, default in defaults):
        raise UserError("--elastic with both horovod.fusion_threshold_mb and horovod.cycle_time_ms changed crashes "
                        "Horovod 0.28.1 when ranks change: keep one of them at its default (128, 1.0)")
    if cfg.bn.per_rank_batch != "fixed":
        raise UserError("--elastic keeps a fixed per-rank batch: set bn.per_rank_batch=fixed, or drop --elastic")
    if cfg.profile.enabled:  # the profiler steps in the static loop only (engine/profiling.py)
        raise UserError("--profile (profile.enabled) profiles the static loop, and --elastic runs its own: drop "
                        "--profile, or profile a run without --elastic")
    if cfg.train.cuda_graphs:  # the graph's static tensors stay on the old GPU after a reset
        raise UserError("--elastic with train.cuda_graphs: a captured step cannot follow the model to another GPU "
                        "when ranks change: set train.cuda_graphs=false (train.compile works), or drop --elastic")


@dataclass
class Position:
    """Where training is: the part of the elastic state that is not tensors (every rank has rank 0's)."""
    epoch: int = 0
    consumed: int = 0  # samples of this epoch's permutation used by committed steps, over all ranks
    totals: list = field(default_factory=lambda: [0.0, 0.0, 0.0])  # this epoch's loss sum, correct, seen (global)
    train_time_s: float = 0.0  # this epoch's training time so far
    breakdown: dict = field(default_factory=dict)  # its seconds per step part (EpochProgress.breakdown)
    skipped_steps: int = 0  # this epoch's skipped (overflowing) steps so far
    elapsed_s: float = 0.0  # run time so far
    started: bool = False  # the run's start (fresh or resumed) is done


@functools.cache
def horovod_elastic_state() -> type:
    """:class:`ElasticState` on Horovod's elastic ``State`` (its commit, host updates and reset callbacks), built on
    first use: importing this module imports no Horovod."""
    horovod.import_horovod()
    from horovod.common.elastic import State
    return type("HorovodElasticState", (ElasticState, State), {})


class ElasticState:
    """The elastic state of one trainer: ``save`` (commit), ``restore`` (roll back), ``sync`` (rank 0's). Usable only
    with Horovod's ``State`` behind it (:func:`horovod_elastic_state`)."""

    def __init__(self, trainer: Trainer, position: Position):
        hvd = horovod.import_horovod()
        super().__init__(bcast_object=hvd.broadcast_object, get_rank=hvd.rank)
        self.trainer, self.position = trainer, position
        self.owner = None  # rank 0's hold on run_dir (rundir.RunDir): the job's, taken again after every reset
        self.resume, self.move_aside = None, False  # how the run starts: train's --resume and --move-aside
        self.save()

    def check_host_updates(self) -> None:
        """Horovod's check at a commit. When the hosts changed it raises on every rank, and rank 0 first lets go of
        run_dir: its process may be the one that leaves, and the re-formed job's rank 0 takes the folder over
        (train_elastic) once the job has re-formed."""
        try:
            super().check_host_updates()
        except BaseException:
            self.hand_over()
            raise

    def hand_over(self) -> None:
        if self.owner is not None:
            self.owner.hand_over()
            self.owner = None

    def run_state(self) -> dict:
        """The trainer's run state (Trainer.state_dict, as a checkpoint holds it) with the position on top."""
        return {**self.trainer.state_dict(), "position": dataclasses.asdict(self.position)}

    def _load(self, saved: dict) -> None:
        self.trainer.load_state_dict(saved)
        self.position = Position(**saved["position"])

    def save(self) -> None:
        self.saved = copy.deepcopy(self.run_state())

    def restore(self) -> None:
        self._load(copy.deepcopy(self.saved))

    def sync(self) -> None:
        """Rank 0's model (any layout) and the rest of its state, through the CPU: each rank loads it onto its own
        device, never onto rank 0's GPU."""
        distributed.broadcast_model(self.trainer.model)
        rest = self.run_state()
        model = rest.pop("model")  # rank 0's now: the broadcast above carried it
        self._load({**distributed.broadcast_object(rest, "elastic_state"), "model": model})
        self.save()


def fit_to_ranks(cfg: Config, t: Trainer) -> None:
    """What depends on the number of ranks, for the job Horovod formed last: loaders (shards), steps per epoch
    and the schedule's N."""
    t.topo = horovod.current_topology(cfg.train.threads, device=cfg.train.device)
    if next(t.model.parameters()).device != t.topo.device:  # a new local rank: its own GPU (the state follows at
        t.model.to(t.topo.device)                           # the sync, which loads onto the parameters' device)
    t.data.close()
    t.data = create_loaders(cfg, t.topo, t.precision.policy.input_dtype)
    t.updates = t.data.steps_per_epoch // t.k
    if t.updates == 0:
        raise UserError(f"train.accumulation_steps={t.k} is more than the {t.data.steps_per_epoch} batches per "
                        f"epoch on {t.topo.size} ranks: lower it, or train.batch_size")
    t.bundle.schedule = create_schedule(cfg, t.topo.size * t.k, t.updates)  # N = ranks x k, as at the start
    t.audit = SampleAudit(audit_path(cfg))  # a rolled-back segment's samples were never committed: dropped


def on_reset(cfg: Config, state: ElasticState) -> None:
    t, before = state.trainer, state.trainer.topo.size
    state.hand_over()  # after a peer's failure: the re-formed job's rank 0 takes run_dir over (train_elastic)
    fit_to_ranks(cfg, t)
    pos = state.position
    log(t.topo, f"hybridtrain: elastic: {before} -> {t.topo.size} ranks in epoch {pos.epoch + 1} after "
                f"{pos.consumed} of its samples; global batch {t.topo.size * cfg.train.batch_size * t.k}, "
                f"{t.updates} steps/epoch, lr*N and the bounds with N={t.topo.size * t.k}")


def start_run(cfg: Config, state: ElasticState) -> bool:
    """Once per run, inside the elastic loop (its collectives must not meet a joining worker's state sync): load the
    checkpoint (the run's record then writes the resolved config and cuts the metrics to the resumed epochs).
    Whether it resumed one."""
    t, pos = state.trainer, state.position
    state.owner = claim_run_dir(cfg, t.topo, state.resume, state.move_aside)  # refuses a fresh run over another's
    loaded = resume_state(cfg, t.topo, required=state.resume == "required") if state.resume else None
    if loaded:
        restore_position(cfg, t, loaded, pos)
        log(t.topo, f"hybridtrain: resumed from epoch {pos.epoch + 1}, sample {pos.consumed} of its permutation, "
                    f"in {cfg.run_dir}")
    pos.started = True
    return loaded is not None


def restore_position(cfg: Config, t: Trainer, loaded: dict, pos: Position) -> None:
    """A checkpoint into the trainer and the position. A preempted static run's mid-epoch checkpoint resumes
    on any number of ranks and any batch: its samples consumed (resume.consumed_samples, with the layout it
    stopped on) are the position (resume.stopped_by_samples)."""
    t.load_state_dict(loaded)
    pos.epoch, pos.elapsed_s = loaded["epoch"] + 1, loaded.get("elapsed_s", 0.0)
    if loaded.get("partial"):
        pos.consumed, pos.totals, pos.train_time_s, pos.skipped_steps, pos.breakdown = stopped_by_samples(loaded)


class Committer:
    """Counts the elastic loop's steps: every ``every`` steps, folds this rank's progress into the position and
    commits."""

    def __init__(self, state: ElasticState, every: int, batch_size: int, run_start: float):
        self.state, self.every, self.batch_size, self.run_start = state, every, batch_size, run_start
        self.segment_start, self.steps = state.position.consumed, 0

    def after_step(self, progress) -> None:
        """``progress()``: this rank's EpochProgress (EpochSteps.progress, a host sync), read only to commit."""
        self.steps += 1
        if self.steps % self.every == 0:
            self.commit(progress())

    def commit(self, done: EpochProgress) -> None:
        """Global totals (rank 0 carries the earlier segments' share), the data position, then Horovod's
        commit, which raises HostsUpdatedInterrupt on every rank when the discovery script changed the hosts."""
        state = self.state
        t, pos = state.trainer, state.position
        totals = distributed.allreduce_sum(torch.tensor([done.loss_sum, done.correct, done.seen],
                                                        dtype=torch.float64), "elastic_totals")
        pos.totals = totals.tolist()
        pos.consumed = consumed_samples(self.segment_start, done.passes, t.topo.size, self.batch_size)
        pos.train_time_s, pos.skipped_steps, pos.breakdown = done.train_time_s, done.skipped_steps, done.breakdown
        pos.elapsed_s = time.perf_counter() - self.run_start
        t.audit.write(pos.epoch, t.topo)
        state.commit()


def train_elastic(state: ElasticState, cfg: Config) -> dict | None:
    """The body that Horovod's elastic loop runs (again after every reset) until training is done. Its stall
    watchdog lives as long as one run of it: not through a reset, where the ranks re-form the job."""
    t = state.trainer
    watchdog = stall_watchdog(cfg, t.topo)
    try:
        continued = state.position.started  # re-formed after a reset: the run's records exist
        if continued:  # the run's folder, held by this job's rank 0: the lock, run.json's checkpoints
            state.owner = claim_run_dir(cfg, t.topo, "required", False)
        else:
            continued = start_run(cfg, state)
            state.commit()
        startup_mark("model_build")  # built, state synced from rank 0, restored (none after the first step)
        log_setup(cfg, t)
        if t.profiler is None:  # once per process, its window counted from the process's first step, as static
            t.profiler = step_profiler(cfg, t.topo)
        # after a reset too: metrics.jsonl is cut to the committed epochs (a rolled-back epoch's end may have
        # written), and the sinks continue their tracked runs; a reset's exception ends them (the next body
        # continues them)
        run = RunRecord(cfg, t.topo, state.owner, state.position.epoch, state.position.elapsed_s, resumed=continued)
        startup_mark("run_setup")
        with run:
            return train_recorded_epochs(state, cfg, run, watchdog)
    finally:
        watchdog.close()


def train_recorded_epochs(state: ElasticState, cfg: Config, run: RunRecord, watchdog) -> dict | None:
    t, first_epoch_of_process = state.trainer, True
    while state.position.epoch < cfg.train.epochs:
        pos, b = state.position, cfg.train.batch_size
        committer = Committer(state, cfg.elastic.commit_steps, b, run.start)
        base = carried_progress(pos.totals, pos.train_time_s, pos.skipped_steps, t.topo.is_root,
                                pos.breakdown)  # the epoch so far
        segment = EpochPosition(pos.epoch, resume=base, start=pos.consumed,
                                first_step=step_in_epoch(pos.consumed, t.topo.size, b, t.k))
        epoch_start = start_epoch_clock(segment)
        result = train_epoch(cfg, t, segment, first_epoch_of_process, watchdog,
                             lambda steps: committer.after_step(steps.progress))
        first_epoch_of_process = False
        watchdog.beat()
        end_epoch(cfg, t, pos.epoch, result, epoch_start, run)
        watchdog.beat()
        t.audit.write(pos.epoch, t.topo)
        state.position = Position(epoch=pos.epoch + 1, elapsed_s=run.elapsed(), started=True)
        state.commit()
    watchdog.pause()
    return finish(cfg, t, run)


def run_elastic(cfg: Config, resume: str | None = None, move_aside: bool = False) -> dict | None:
    """Train under Horovod elastic; ``resume`` and ``move_aside`` as for ``run_training``."""
    check_elastic(cfg)
    startup_mark("imports")  # the start-up's parts as run_training marks them (breakdown.py)
    hvd = horovod.import_horovod()
    topo = distributed.init(cfg.train.threads, cfg, elastic=True, device=cfg.train.device, engine="horovod")
    startup_mark("engine_start")
    t = build_trainer(cfg, topo)
    state = horovod_elastic_state()(t, Position())
    state.resume, state.move_aside = resume, move_aside
    state.register_reset_callbacks([lambda: on_reset(cfg, state)])
    try:
        return hvd.elastic.run(train_elastic)(state, cfg)
    finally:
        if t.profiler is not None:
            t.profiler.close()

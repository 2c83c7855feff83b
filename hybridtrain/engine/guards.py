"""The run's guards: a rank that must stop does so cleanly, and never leaves its peers hanging. Three cases: a
SIGTERM (``PreemptionWatch``), a dead peer (the same watch's signal thread), a stall (``StallWatchdog``).

**Preemption.** SIGTERM (what SLURM sends before a time limit) stops the run after a step, resumably.
The signal handler only sets a flag. After every ``every``-th optimizer step, each rank starts an
asynchronous sum of its flag, and collects it after the next step. The collection does not wait: that
all-reduce finished while the gradients were being reduced. So every rank learns of a SIGTERM on any rank at
the same step, at most ``every`` + 1 steps after it arrived, and all ranks stop after the same step. A rank
that stopped alone would leave the others hanging in the next all-reduce. At epoch boundaries the check is a
blocking sum. The sum is a CPU tensor, which Horovod reduces on its one background thread between the
gradients' all-reduces, hence not every step: ``steps_between_checks``.

**Dead peers.** A SIGTERM can also be a launcher ending the job because a rank died: mpirun (and horovodrun on MPI) and
torchrun terminate the survivors at once, before any collective could fail and name the dead rank. So a
thread wakes on every signal (Python's wakeup fd, which the interpreter writes even while the main thread is
blocked in a collective) and, when a rank of this host is gone, prints the one line naming it and ends the
rank (exit 3), as a failed collective would have.

**Stalls.** A rank whose training stops making progress ends itself with one line.
Horovod's own stall check (``distributed.stall_warning_s``/``stall_shutdown_s``) did not fire under Gloo in our
2-rank tests, and Gloo's timeout ends a stuck collective only after ``distributed.gloo_timeout_s``, with no word of
why. So every rank also watches itself: the training loop beats after every step; with no beat for
``stall_warning_s`` the rank warns once, and for ``stall_shutdown_s`` it prints one line and exits (code 3), and
the launcher then ends the job. The watch starts at the first beat, so start-up does not count. Ranks wait
``rank`` extra seconds (at most 30), so the lowest one still alive speaks first.

Long work of the rank's own is not a stall: the one mechanism is ``local_work(what)``, a context
around a phase that may take longer than ``stall_shutdown_s`` (a validation pass, the first steps of a compiling
epoch, the first batch of an epoch: loader start, DALI pipeline build). Inside it the clock stands still; at its
end it starts again from zero, so only the wait on peers after it counts. Rank 0's checkpoint write is such work
for every rank (``root_writes``): rank 0 writes, the others wait for it inside the same context, and rank 0 waits
for them outside it, so a peer that hung is still named within the limit.

The torch engine's collectives time out later than the latest rank's exit here (``torch_distributed.
collective_timeout_s``), so NCCL's and Gloo's own watchdogs never end a stuck rank before this line.
"""
from __future__ import annotations

import contextlib
import os
import select
import signal
import sys
import threading
import time

import torch

from hybridtrain.distributed import collectives as distributed
from hybridtrain.distributed import failures
from hybridtrain.launched_by import launcher_rank

# ----------------------------------------------------------------------------- SIGTERM and dead peers

MAX_STEPS_BETWEEN_CHECKS = 8


def steps_between_checks(steps_per_epoch: int) -> int:
    """Every 8th step (about 0.4 s on an H100, 4 s on a P40), or 4 times an epoch when epochs are shorter."""
    return max(1, min(MAX_STEPS_BETWEEN_CHECKS, steps_per_epoch // 4))


class PreemptionWatch:
    def __init__(self):
        self.requested = False
        self.handle = None
        self.every = 1  # steps between two checks: set from the epoch's length once the trainer is built
        self.steps = 0
        self.topo = None  # the job's (join): a SIGTERM first looks for a dead peer in it
        self.engine = None  # the engine that formed the job (join), whose all-reduces carry the flag
        self.previous = signal.signal(signal.SIGTERM, self._on_sigterm)
        self._wake_read, self._wake_write = os.pipe()
        for fd in (self._wake_read, self._wake_write):
            os.set_blocking(fd, False)
        self._previous_fd = signal.set_wakeup_fd(self._wake_write, warn_on_full_buffer=False)
        threading.Thread(target=self._watch_signals, name="hybridtrain-sigterm", daemon=True).start()

    def join(self, topo) -> None:
        """The job has formed: its topology and its engine (distributed.active_engine)."""
        self.topo, self.engine = topo, distributed.active_engine()

    def _on_sigterm(self, signum, frame) -> None:
        self.requested = True

    def _watch_signals(self) -> None:
        while True:
            select.select([self._wake_read], [], [])
            try:
                received = os.read(self._wake_read, 64)
            except BlockingIOError:
                continue
            except OSError:
                return
            if not received:  # closed
                return
            if signal.SIGTERM in received:
                self._end_if_a_peer_died()

    def _end_if_a_peer_died(self) -> None:
        topo = self.topo
        if topo is None:
            self._end_before_the_job_formed()
        if not topo.peers or not failures.departed(topo)[0]:
            return  # a real preemption: the flag stops the run after a step
        failures.peer_failure(topo)  # its line, when this process is the host's first to report
        os._exit(3)

    @staticmethod
    def _end_before_the_job_formed() -> None:
        """SIGTERM while the ranks are still meeting: nothing of this process is trained yet, and no step will come
        to agree on a stop. The flag alone kept a rank waiting for a peer that had died in the same set-up (a
        restart of torchrun --max-restarts) until the launcher's SIGKILL 30 s later."""
        if launcher_rank() == 0:
            print("hybridtrain: stopped on SIGTERM while the ranks were meeting (nothing trained in this run yet): "
                  "rerun the same command with --resume auto", file=sys.stderr, flush=True)
        os._exit(0)

    def after_step(self) -> bool:
        """True on every rank at the same step once any rank got SIGTERM (no wait on the critical path)."""
        stop = self._collect()
        self.steps += 1
        if self.steps % self.every == 0:
            # one name for every check (the previous one has completed): Horovod's response cache then skips
            # the negotiation of this tensor after the first one
            self.handle = self.engine.allreduce_async(torch.tensor([int(self.requested)]), "preemption")
        return stop

    def agreed_now(self) -> bool:
        """A blocking check: True on every rank when any rank has got SIGTERM by now."""
        earlier = self._collect()
        return earlier or bool(self.engine.allreduce(torch.tensor([int(self.requested)]), "preemption.now").item())

    def _collect(self) -> bool:
        if self.handle is None:
            return False
        total = self.engine.wait(self.handle)
        self.handle = None
        return bool(total.item())

    def close(self) -> None:
        self._collect()
        signal.signal(signal.SIGTERM, self.previous)
        signal.set_wakeup_fd(self._previous_fd)
        os.close(self._wake_write)  # the watching thread reads the end of the pipe and returns


# ----------------------------------------------------------------------------- stalls

RANK_STAGGER_MAX_S = 30  # rank r waits min(r, 30) s more than stall_shutdown_s


def exit_after_s(shutdown_s: float, rank: int) -> float:
    """How long after the last beat rank ``rank`` ends itself (give or take one poll); 0: never."""
    return shutdown_s + min(rank, RANK_STAGGER_MAX_S) if shutdown_s else 0


_ACTIVE: list = []  # the process's running StallWatchdog (at most one), for local_work


@contextlib.contextmanager
def local_work(what: str):
    """Work of this rank's own that may outlast ``stall_shutdown_s``: not a stall (see the module's docstring).
    Without a running watchdog (tools, benchmarks) it does nothing."""
    if not _ACTIVE:
        yield
        return
    watchdog = _ACTIVE[0]
    before, watchdog.busy = watchdog.busy, what
    try:
        yield
    finally:  # the clock starts again (not armed if it was not: no step yet), then the work ends: the watching
        watchdog.last = time.monotonic()  # thread reads busy first, so it never sees the old clock without it
        watchdog.busy = before


@contextlib.contextmanager
def root_writes(topo):
    """Rank 0 writes (a checkpoint) inside this context, which yields whether this rank is the one that writes, while
    the other ranks wait for it: local work on every rank. Rank 0 then waits for them outside it, so a rank that hung
    meanwhile is still named by rank 0's watchdog."""
    with local_work("a checkpoint write" if topo.is_root else "rank 0's checkpoint write"):
        yield topo.is_root
        if not topo.is_root:
            distributed.barrier()
    if topo.is_root:
        distributed.barrier()


class StallWatchdog:
    def __init__(self, warning_s: float, shutdown_s: float, rank: int, poll_s: float = 0.5):
        self.warning_s, self.shutdown_s, self.rank, self.poll_s = warning_s, shutdown_s, rank, poll_s
        self.last, self.armed, self.stopped = time.monotonic(), False, threading.Event()
        self.busy = ""  # the local work under way (local_work), if any: the clock stands still
        self.thread = threading.Thread(target=self._watch, name="hybridtrain-stall-watchdog", daemon=True)
        self.thread.start()
        _ACTIVE[:] = [self]

    def beat(self) -> None:
        """Progress: a step or a validation ended (two attribute stores: nothing on the device)."""
        self.last = time.monotonic()
        self.armed = True

    def pause(self) -> None:
        """Stop watching until the next beat (work that is not steps, e.g. the final report)."""
        self.armed = False

    def close(self) -> None:
        self.stopped.set()
        if _ACTIVE and _ACTIVE[0] is self:
            _ACTIVE.clear()

    def _watch(self) -> None:
        warned = False
        while not self.stopped.wait(self.poll_s):
            if self.busy:
                continue
            idle = time.monotonic() - self.last
            if not self.armed or idle < self.warning_s:
                warned = False
                continue
            if not warned:
                warned = True
                print(f"hybridtrain: warning: rank {self.rank}: no training step finished for {idle:.0f} s "
                      f"(distributed.stall_warning_s={self.warning_s:g}): a rank may have hung", file=sys.stderr,
                      flush=True)
            if self.shutdown_s and idle >= exit_after_s(self.shutdown_s, self.rank):
                print(f"hybridtrain: error: rank {self.rank}: no training step finished for {idle:.0f} s "
                      f"(distributed.stall_shutdown_s={self.shutdown_s:g}): a rank hung or a collective is stuck, so "
                      f"this rank ends the job; checkpoints are intact: rerun the same command with --resume auto",
                      file=sys.stderr, flush=True)
                os._exit(3)  # the main thread is blocked in the stuck collective; nothing else can end it

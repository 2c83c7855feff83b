"""Preemption: SIGTERM (what SLURM sends before a time limit) stops the run after a step, resumably.

The signal handler only sets a flag. After every ``every``-th optimizer step, each rank starts an
asynchronous sum of its flag, and collects it after the next step. The collection does not wait: that
all-reduce finished while the gradients were being reduced. So every rank learns of a SIGTERM on any rank at
the same step, at most ``every`` + 1 steps after it arrived, and all ranks stop after the same step. A rank
that stopped alone would leave the others hanging in the next all-reduce. At epoch boundaries the check is a
blocking sum. The sum is a CPU tensor, which Horovod reduces on its one background thread between the
gradients' all-reduces, hence not every step (gpu-path-2 #13): ``steps_between_checks``.

A SIGTERM can also be a launcher ending the job because a rank died: mpirun (and horovodrun on MPI) and
torchrun terminate the survivors at once, before any collective could fail and name the dead rank. So a
thread wakes on every signal (Python's wakeup fd, which the interpreter writes even while the main thread is
blocked in a collective) and, when a rank of this host is gone, prints the one line naming it and ends the
rank (exit 3), as a failed collective would have.
"""
from __future__ import annotations

import os
import select
import signal
import sys
import threading

import torch

from hybridtrain.distributed import collectives as distributed
from hybridtrain.distributed import failures
from hybridtrain.errors import launcher_rank

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
        self._wake_read, wake_write = os.pipe()
        for fd in (self._wake_read, wake_write):
            os.set_blocking(fd, False)
        self._wake_write = wake_write
        self._previous_fd = signal.set_wakeup_fd(wake_write, warn_on_full_buffer=False)
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
        failure = failures.peer_failure(topo)
        if failure.announce:
            print(f"hybridtrain: {failure}", file=sys.stderr, flush=True)
        os._exit(3)

    @staticmethod
    def _end_before_the_job_formed() -> None:
        """SIGTERM while the ranks are still meeting: nothing of this process is trained yet, and no step will come
        to agree on a stop. The flag alone kept a rank waiting for a peer that had died in the same set-up (a
        restart of torchrun --max-restarts) until the launcher's SIGKILL 30 s later (issue 34, class 3)."""
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

"""The stall watchdog: a rank whose training stops making progress ends itself with one line.

Horovod's own stall check (``distributed.stall_warning_s``/``stall_shutdown_s``) did not fire under Gloo in our
2-rank tests, and Gloo's timeout ends a stuck collective only after ``distributed.gloo_timeout_s``, with no word of
why. So every rank also watches itself: the training loop beats after every step; with no beat for
``stall_warning_s`` the rank warns once, and for ``stall_shutdown_s`` it prints one line and exits (code 3), and
the launcher then ends the job. The watch starts at the first beat, so start-up does not count. Ranks wait
``rank`` extra seconds (at most 30), so the lowest one still alive speaks first.

Long work of the rank's own is not a stall (issue 34): the one mechanism is ``local_work(what)``, a context
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
import sys
import threading
import time

from hybridtrain.distributed import collectives as distributed

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


def root_writes(topo, write) -> None:
    """Rank 0 runs ``write()`` (a checkpoint) while the other ranks wait for it: local work on every rank. Rank 0
    then waits for them outside it, so a rank that hung meanwhile is still named by rank 0's watchdog."""
    if topo.is_root:
        with local_work("a checkpoint write"):
            write()
        distributed.barrier()
    else:
        with local_work("rank 0's checkpoint write"):
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

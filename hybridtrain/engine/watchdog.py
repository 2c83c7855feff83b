"""The stall watchdog: a rank whose training stops making progress ends itself with one line.

Horovod's own stall check (``horovod.stall_warning_s``/``stall_shutdown_s``) did not fire under Gloo in our
2-rank tests, and Gloo's timeout ends a stuck collective only after ``horovod.gloo_timeout_s``, with no word of
why. So every rank also watches itself: the training loop beats after every step and around validation; with no
beat for ``stall_warning_s`` the rank warns once, and for ``stall_shutdown_s`` it prints one line and exits (code
3), and the launcher then ends the job. The watch starts at the first beat, so start-up and compilation do not
count. Ranks wait ``rank`` extra seconds (at most 30), so the lowest one still alive speaks first.

The torch engine's collectives time out later than the latest rank's exit here (``torch_distributed.
collective_timeout_s``), so NCCL's and Gloo's own watchdogs never end a stuck rank before this line.
"""
from __future__ import annotations

import os
import sys
import threading
import time

RANK_STAGGER_MAX_S = 30  # rank r waits min(r, 30) s more than stall_shutdown_s


def exit_after_s(shutdown_s: float, rank: int) -> float:
    """How long after the last beat rank ``rank`` ends itself (give or take one poll); 0: never."""
    return shutdown_s + min(rank, RANK_STAGGER_MAX_S) if shutdown_s else 0


class StallWatchdog:
    def __init__(self, warning_s: float, shutdown_s: float, rank: int, poll_s: float = 0.5):
        self.warning_s, self.shutdown_s, self.rank, self.poll_s = warning_s, shutdown_s, rank, poll_s
        self.last, self.armed, self.stopped = time.monotonic(), False, threading.Event()
        self.thread = threading.Thread(target=self._watch, name="hybridtrain-stall-watchdog", daemon=True)
        self.thread.start()

    def beat(self) -> None:
        """Progress: a step or a validation ended (two attribute stores: nothing on the device)."""
        self.last = time.monotonic()
        self.armed = True

    def pause(self) -> None:
        """Stop watching until the next beat (work that is not steps, e.g. the final report)."""
        self.armed = False

    def close(self) -> None:
        self.stopped.set()

    def _watch(self) -> None:
        warned = False
        while not self.stopped.wait(self.poll_s):
            idle = time.monotonic() - self.last
            if not self.armed or idle < self.warning_s:
                warned = False
                continue
            if not warned:
                warned = True
                print(f"hybridtrain: warning: rank {self.rank}: no training step finished for {idle:.0f} s "
                      f"(horovod.stall_warning_s={self.warning_s:g}): a rank may have hung", file=sys.stderr,
                      flush=True)
            if self.shutdown_s and idle >= exit_after_s(self.shutdown_s, self.rank):
                print(f"hybridtrain: error: rank {self.rank}: no training step finished for {idle:.0f} s "
                      f"(horovod.stall_shutdown_s={self.shutdown_s:g}): a rank hung or a collective is stuck, so "
                      f"this rank ends the job; checkpoints are intact: rerun the same command with --resume auto",
                      file=sys.stderr, flush=True)
                os._exit(3)  # the main thread is blocked in the stuck collective; nothing else can end it

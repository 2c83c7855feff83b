"""Preemption: SIGTERM (what SLURM sends before a time limit) stops the run after a step, resumably.

The signal handler only sets a flag. After every optimizer step, each rank starts an asynchronous
sum of its flag and collects the previous step's sum. The collection does not wait: that all-reduce
finished while the gradients were being reduced. So every rank learns of a SIGTERM on any rank at the
same step, one step after it arrived, and all ranks stop after the same step. A rank that stopped alone
would leave the others hanging in the next all-reduce. At epoch boundaries the check is a blocking sum.
"""
from __future__ import annotations

import signal

import torch

from hybridtrain.distributed import collectives as distributed


class PreemptionWatch:
    def __init__(self):
        self.requested = False
        self.handle = None
        self.previous = signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum, frame) -> None:
        self.requested = True

    def after_step(self, snapshot=None) -> bool:
        """True on every rank at the same step once any rank got SIGTERM (no wait on the critical path).
        ``snapshot``, the epoch's progress, is not needed here."""
        stop = self._collect()
        # one name for every step (the previous one has completed): Horovod's response cache then skips the
        # negotiation of this tensor after the first step
        self.handle = distributed.allreduce_async(torch.tensor([int(self.requested)]), "preemption")
        return stop

    def agreed_now(self) -> bool:
        """A blocking check: True on every rank when any rank has got SIGTERM by now."""
        earlier = self._collect()
        return earlier or bool(distributed.allreduce_sum(torch.tensor([int(self.requested)]), "preemption.now").item())

    def _collect(self) -> bool:
        if self.handle is None:
            return False
        total = distributed.wait(self.handle)
        self.handle = None
        return bool(total.item())

    def close(self) -> None:
        self._collect()
        signal.signal(signal.SIGTERM, self.previous)

"""Counting host syncs: the points where the CPU waits to read a value the device computed.

On a GPU, ``torch.cuda.set_sync_debug_mode("warn")`` makes every synchronizing CUDA call warn, and the warnings
are counted. On the CPU nothing waits, so the count is of the operators that would synchronize on a GPU: a
``TorchDispatchMode`` sees every aten call of the code it wraps and counts those in ``SYNCING_OPS``.
"""
from __future__ import annotations

import warnings

import torch
from torch.utils._python_dispatch import TorchDispatchMode

SYNCING_OPS = frozenset({
    "aten::_local_scalar_dense",  # .item(), float(t), int(t), bool(t), `if t:`
    "aten::nonzero", "aten::masked_select", "aten::_unique2",  # output sizes that depend on the values
})
CUDA_SYNC_WARNING = "called a synchronizing CUDA operation"


class SyncingOpCounter(TorchDispatchMode):
    """Counts the calls to ``SYNCING_OPS`` made while it is active."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._schema.name in SYNCING_OPS:
            self.count += 1
        return func(*args, **(kwargs or {}))


def count_host_syncs(fn, device: torch.device) -> int:
    """Host syncs in ``fn()`` on ``device``: measured on a GPU (the synchronizing CUDA calls, by CUDA's sync debug
    mode), the would-be syncs on the CPU."""
    if device.type != "cuda":
        with SyncingOpCounter() as counter:
            fn()
        return counter.count
    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    return sum(CUDA_SYNC_WARNING in str(w.message) for w in caught)

"""Even, deterministic splitting of a dataset across Horovod ranks.

Training: every epoch all ranks draw the same seeded permutation. Global step j takes the next
``world_size * batch_size`` entries of it, and rank r takes its slice, so all ranks run the same number
of steps (Horovod stalls otherwise), each sample is used at most once per epoch, and every step has the
fixed per-GPU batch the paper's BatchNorm relies on (its running statistics are the last step's). The
remainder that does not fill a global batch (fewer than one global batch) is left out that epoch and
reported; the permutation changes every epoch, so no sample is left out for good. The DALI backend
follows the same policy.

Validation: contiguous shards whose sizes differ by at most one. Validation runs no collective per step,
so ranks may run different step counts; every image is counted exactly once and no padding is needed.
"""
from __future__ import annotations

import numpy as np


def epoch_permutation(num_samples: int, seed: int, epoch: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch]).permutation(num_samples)


def split_sizes(total: int, parts: int) -> list[int]:
    base, extra = divmod(total, parts)
    return [base + (1 if r < extra else 0) for r in range(parts)]


def train_batches(num_samples: int, rank: int, world_size: int, batch_size: int, seed: int,
                  epoch: int, shuffle: bool = True) -> list[list[int]]:
    """This rank's batches (lists of sample indices) for one epoch."""
    order = epoch_permutation(num_samples, seed, epoch) if shuffle else np.arange(num_samples)
    global_batch = world_size * batch_size
    full_steps = num_samples // global_batch
    starts = (step * global_batch + rank * batch_size for step in range(full_steps))
    return [order[start:start + batch_size].tolist() for start in starts]


def dropped_per_epoch(num_samples: int, world_size: int, batch_size: int) -> int:
    return num_samples % (world_size * batch_size)


def steps_per_epoch(num_samples: int, world_size: int, batch_size: int) -> int:
    return num_samples // (world_size * batch_size)


def val_shard(num_samples: int, rank: int, world_size: int) -> range:
    sizes = split_sizes(num_samples, world_size)
    start = sum(sizes[:rank])
    return range(start, start + sizes[rank])

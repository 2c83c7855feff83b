"""Even, deterministic splitting of a dataset across Horovod ranks.

Training: every epoch all ranks draw the same seeded permutation. Global step j takes the next
``world_size * batch_size`` entries of it, and rank r takes its slice, so all ranks run the same number
of steps (Horovod stalls otherwise) and each sample is used exactly once per epoch. The remainder that
does not fill a global batch becomes one final, smaller step split as evenly as possible (shares differ
by at most one); only when some rank's share would be below two samples (BatchNorm cannot train on one)
are those few leftovers dropped, and the count is reported.

Validation: contiguous shards whose sizes differ by at most one. Validation runs no collective per step,
so ranks may run different step counts; every image is counted exactly once and no padding is needed.
"""
from __future__ import annotations

import numpy as np

MIN_SHARE = 2  # BatchNorm in training mode needs more than one sample per channel


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
    batches = []
    for step in range(full_steps):
        start = step * global_batch + rank * batch_size
        batches.append(order[start:start + batch_size].tolist())
    remainder = num_samples - full_steps * global_batch
    if remainder >= MIN_SHARE * world_size:
        sizes = split_sizes(remainder, world_size)
        start = full_steps * global_batch + sum(sizes[:rank])
        batches.append(order[start:start + sizes[rank]].tolist())
    return batches


def dropped_per_epoch(num_samples: int, world_size: int, batch_size: int) -> int:
    remainder = num_samples % (world_size * batch_size)
    return remainder if remainder < MIN_SHARE * world_size else 0


def steps_per_epoch(num_samples: int, world_size: int, batch_size: int) -> int:
    full_steps, remainder = divmod(num_samples, world_size * batch_size)
    return full_steps + (1 if remainder >= MIN_SHARE * world_size else 0)


def val_shard(num_samples: int, rank: int, world_size: int) -> range:
    sizes = split_sizes(num_samples, world_size)
    start = sum(sizes[:rank])
    return range(start, start + sizes[rank])

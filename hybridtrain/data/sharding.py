"""Even, deterministic splitting of a dataset across Horovod ranks.

Training: every epoch all ranks draw the same seeded permutation. Global step j takes the next
``world_size * batch_size`` entries of it, and rank r takes its slice, so all ranks run the same number
of steps (Horovod stalls otherwise), each sample is used at most once per epoch, and every step has the
fixed per-GPU batch the paper's BatchNorm relies on (its running statistics are the last step's). The
remainder that does not fill a global batch (fewer than one global batch) is left out that epoch and
reported; the permutation changes every epoch, so no sample is left out for good. The DALI backend
follows the same policy.

Random per-rank batches (``bn.per_rank_batch: random``, Table 3.4's ablation): each global batch is the same
``world_size * batch_size`` entries, but split at random (the same on every rank, seeded by (seed, epoch,
step)) into parts of at least two samples (a BN layer needs more than one value per channel) and at most
twice the fixed batch (random_split_sizes); the trainer weights each rank's loss by n_r / b so the update
equals the global-batch update.

Elastic training (``train --elastic``) changes the number of ranks inside an epoch. The data position is then
the number of samples of the epoch's permutation already consumed (``start``); the rest of the permutation is
cut into global batches of the new ``world_size * batch_size``. So no sample is used twice or left out
because of a resize; only the final remainder (fewer than one global batch) is left out, as always.

Validation: contiguous shards whose sizes differ by at most one. Validation runs no collective per step,
so ranks may run different step counts; every image is counted exactly once and no padding is needed.
"""
from __future__ import annotations

import numpy as np

from hybridtrain.errors import UserError

MIN_RANDOM_SHARE = 2  # samples per rank and step when the split is random


def epoch_permutation(num_samples: int, seed: int, epoch: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch]).permutation(num_samples)


def split_sizes(total: int, parts: int) -> list[int]:
    base, extra = divmod(total, parts)
    return [base + (1 if r < extra else 0) for r in range(parts)]


def random_split_sizes(global_batch: int, world_size: int, seed: int, epoch: int, step: int) -> list[int]:
    """A random split of the global batch, the same on every rank (a pure function of (seed, epoch, step)): the
    even split's shares, paired at random, and each pair's total cut at a uniform point, so every share lies
    between MIN_RANDOM_SHARE and twice the even share less MIN_RANDOM_SHARE. A rank thus never holds more than
    twice the fixed batch (its memory and its kernels' shapes stay near the fixed run's); with
    an odd number of ranks one rank, a random one, keeps the even share that step."""
    if global_batch < MIN_RANDOM_SHARE * world_size:
        raise UserError(f"bn.per_rank_batch=random needs a global batch of at least {MIN_RANDOM_SHARE} per rank "
                        f"({MIN_RANDOM_SHARE * world_size} on {world_size} ranks), got {global_batch}: raise "
                        f"train.batch_size to {MIN_RANDOM_SHARE} or more")
    rng = np.random.default_rng([seed, epoch, step, 1])
    sizes = split_sizes(global_batch, world_size)
    order = rng.permutation(world_size)
    for i, j in zip(order[0::2], order[1::2]):
        pair = sizes[i] + sizes[j]
        sizes[i] = int(rng.integers(MIN_RANDOM_SHARE, pair - MIN_RANDOM_SHARE + 1))
        sizes[j] = pair - sizes[i]
    return sizes


def train_batches(num_samples: int, rank: int, world_size: int, batch_size: int, seed: int,
                  epoch: int, random_split: bool = False, start: int = 0) -> list[list[int]]:
    """This rank's batches (lists of sample indices) for one epoch, from entry ``start`` of its permutation on."""
    order = epoch_permutation(num_samples, seed, epoch)[start:]
    global_batch = world_size * batch_size
    batches = []
    for step in range(len(order) // global_batch):
        sizes = (random_split_sizes(global_batch, world_size, seed, epoch, step) if random_split
                 else [batch_size] * world_size)
        first = step * global_batch + sum(sizes[:rank])
        batches.append(order[first:first + sizes[rank]].tolist())
    return batches


def dropped_per_epoch(num_samples: int, world_size: int, batch_size: int) -> int:
    return num_samples % (world_size * batch_size)


def steps_per_epoch(num_samples: int, world_size: int, batch_size: int) -> int:
    return num_samples // (world_size * batch_size)


def val_shard(num_samples: int, rank: int, world_size: int) -> range:
    sizes = split_sizes(num_samples, world_size)
    start = sum(sizes[:rank])
    return range(start, start + sizes[rank])

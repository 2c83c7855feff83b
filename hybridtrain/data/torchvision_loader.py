"""The torchvision backend: PIL decoding and torchvision transforms in DataLoader workers.

Augmentation is reproducible: each sample's random crop and flip are seeded from (seed, epoch, index),
so results do not depend on how samples are spread over workers, and a resumed run sees the same
augmented images as an uninterrupted one. An unreadable image turns its batch into an
:class:`UnreadableImage`, which the trainer reports as one error line naming the file.
"""
from __future__ import annotations

import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset

from hybridtrain.data import sharding
from hybridtrain.data.folder import ImageList, UnreadableImage
from hybridtrain.data.images import to_rgb
from hybridtrain.data.presets import train_transform, val_transform
from hybridtrain.data.resolution import Resolutions, resolutions
from hybridtrain.data.workers import die_with_the_rank, shared_memory_errors, spawn_context


class ImageListDataset(Dataset):
    """Items are (image, label, index); keys are (index, epoch) so augmentation can be seeded."""

    def __init__(self, images: ImageList, transform, seed: int):
        self.images, self.samples = images, images.samples
        self.transform = transform
        self.seed = seed

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, key):
        index, epoch = key
        path, label = self.samples[index]
        # in a worker the seed is the worker's own; in the rank's process (data.in_process) the training's
        # random state is put back afterwards
        in_process = torch.utils.data.get_worker_info() is None
        transform = self.transform.for_epoch(epoch) if isinstance(self.transform, EpochTransform) else self.transform
        with torch.random.fork_rng(devices=[], enabled=in_process):
            torch.manual_seed((self.seed * 1_000_003 + epoch) * 10_000_019 + index)  # the sample's own seed
            try:
                with Image.open(self.images.open(index)) as img:
                    return transform(to_rgb(img)), label, index
            except Exception as exc:  # every decoder failure: OSError, SyntaxError, DecompressionBombError, ...
                return UnreadableImage(path, f"{type(exc).__name__}: {str(exc)[:200]}")


class EpochTransform:
    """The training transform at each epoch's resolution (``data.res_*``, data/resolution.py): the same random
    draws at every resolution (the crop's box and the flip), only the box's resize differs; made once per size."""

    def __init__(self, resolution: Resolutions, min_crop_area: float, hflip: bool):
        self.resolution, self.min_crop_area, self.hflip = resolution, min_crop_area, hflip
        self.made = {}

    def for_epoch(self, epoch: int):
        size = self.resolution(epoch)
        if size not in self.made:
            self.made[size] = train_transform(size, self.min_crop_area, self.hflip, as_uint8=True)
        return self.made[size]


class Collate:
    """Stack (image, label, index) items into one batch, NCHW or channels_last; an unreadable one wins.

    In a worker the batch is moved to shared memory here, where a full /dev/shm raises in the worker's fetch and
    reaches the rank as its error (``shared_memory_errors``): left to the queue's feeder thread, the move fails
    there, prints a traceback and loses the batch, and the rank waits for it forever."""

    def __init__(self, channels_last: bool):
        self.memory_format = torch.channels_last if channels_last else torch.contiguous_format

    def __call__(self, items):
        bad = [it for it in items if isinstance(it, UnreadableImage)]
        if bad:
            return bad[0]
        images, labels, indices = zip(*items)
        batch = (torch.stack(images).contiguous(memory_format=self.memory_format), torch.tensor(labels),
                 torch.tensor(indices))
        if torch.utils.data.get_worker_info() is not None:
            for tensor in batch:
                tensor.share_memory_()
        return batch


class EpochBatches:
    """A batch sampler whose batches are a pure function of the epoch (see ``sharding``)."""

    def __init__(self, batches_for_epoch):
        self.batches_for_epoch = batches_for_epoch  # (epoch, start) -> batches
        self.epoch, self.start = 0, 0

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        """Draw ``epoch``'s batches from entry ``start`` of its permutation on (elastic training's resizes)."""
        self.epoch, self.start = epoch, start

    def state(self) -> tuple[int, int]:
        return self.epoch, self.start

    def __iter__(self):
        for batch in self.batches_for_epoch(self.epoch, self.start):
            yield [(i, self.epoch) for i in batch]

    def __len__(self) -> int:
        return len(self.batches_for_epoch(self.epoch, self.start))


class WorkerLoader(DataLoader):
    """A DataLoader with worker processes whose iterators say in one line when /dev/shm runs out
    (``shared_memory_errors``). ``start()`` (``Loaders.start``) spawns the workers now; the next ``iter()``, when the
    sampler still draws the batches it drew then (the run's first epoch), takes the iterator they have been filling
    instead of resetting it: a reset waits for every worker to answer and throws away the batches they prefetched
    (the time to the first step)."""

    def start(self) -> None:
        iter(self)
        self._started_with = self.batch_sampler.state()

    def __iter__(self):
        started_with, self._started_with = getattr(self, "_started_with", None), None
        if started_with is not None and self._iterator is not None and started_with == self.batch_sampler.state():
            return shared_memory_errors(self._iterator)
        return shared_memory_errors(super().__iter__())


def _loader(dataset, batch_sampler, cfg, workers: int, pin: bool) -> DataLoader:
    # spawn, not fork (unsafe after Horovod's threads start) nor forkserver (its server outlives a killed rank):
    # spawned workers are the rank's own children, so die_with_the_rank applies. pin: page-locked batches for a
    # GPU, so that the copy to it overlaps (from pageable memory it would be synchronous).
    batches = dict(batch_sampler=batch_sampler, collate_fn=Collate(cfg.data.channels_last), pin_memory=pin)
    if cfg.data.in_process:
        return DataLoader(dataset, **batches)
    return WorkerLoader(dataset, num_workers=workers, multiprocessing_context=spawn_context(), persistent_workers=True,
                        prefetch_factor=cfg.data.prefetch, worker_init_fn=die_with_the_rank, **batches)


def create_train_loader(images: ImageList, cfg, rank: int, world_size: int, workers: int,
                        pin: bool = False) -> DataLoader:
    """This rank's training batches of uint8 pixels (``device_images`` normalises them) at the epoch's resolution
    (``EpochTransform``): every sample at most once per epoch, see ``sharding.train_batches``."""
    d = cfg.data
    dataset = ImageListDataset(images, EpochTransform(resolutions(d), d.min_crop_area, d.hflip), cfg.seed)
    n, b = len(images), cfg.train.batch_size
    random_split = cfg.bn.per_rank_batch == "random"
    sampler = EpochBatches(lambda epoch, start: sharding.train_batches(n, rank, world_size, b, cfg.seed, epoch,
                                                                       random_split=random_split, start=start))
    return _loader(dataset, sampler, cfg, workers, pin)


def create_val_loader(images: ImageList, cfg, rank: int, world_size: int, workers: int,
                      pin: bool = False) -> DataLoader:
    """This rank's contiguous slice of the validation set as uint8 pixels, every image exactly once over the
    ranks."""
    d = cfg.data
    dataset = ImageListDataset(images, val_transform(d.crop_size, d.val_resize, as_uint8=True), cfg.seed)
    shard = list(sharding.val_shard(len(images), rank, world_size))
    b = d.val_batch_size or cfg.train.batch_size
    sampler = EpochBatches(lambda epoch, start: [shard[i:i + b] for i in range(0, len(shard), b)])
    return _loader(dataset, sampler, cfg, workers, pin)

"""The torchvision backend: PIL decoding and torchvision transforms in DataLoader workers.

Augmentation is reproducible: each sample's random crop and flip are seeded from (seed, epoch, index),
so results do not depend on how samples are spread over workers, and a resumed run sees the same
augmented images as an uninterrupted one. An unreadable image is skipped with one logged line.
"""
from __future__ import annotations

import sys

import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset
from torchvision import transforms

from . import sharding
from .folder import ImageList

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def train_transform(crop_size: int, min_crop_area: float, hflip: bool):
    steps = [transforms.RandomResizedCrop(crop_size, scale=(min_crop_area, 1.0))]
    if hflip:
        steps.append(transforms.RandomHorizontalFlip())
    return transforms.Compose(steps + [transforms.ToTensor(), transforms.Normalize(IMAGENET_MEAN, IMAGENET_STD)])


def val_transform(crop_size: int, resize: int):
    return transforms.Compose([transforms.Resize(resize), transforms.CenterCrop(crop_size),
                               transforms.ToTensor(), transforms.Normalize(IMAGENET_MEAN, IMAGENET_STD)])


def sample_seed(seed: int, epoch: int, index: int) -> int:
    return (seed * 1_000_003 + epoch) * 10_000_019 + index


class ImageListDataset(Dataset):
    """Items are (image, label, index); keys are (index, epoch) so augmentation can be seeded."""

    def __init__(self, images: ImageList, transform, seed: int):
        self.samples = images.samples
        self.transform = transform
        self.seed = seed

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, key):
        index, epoch = key
        path, label = self.samples[index]
        try:
            with Image.open(path) as img:
                img = img.convert("RGB")
        except (OSError, ValueError) as exc:
            print(f"hybridtrain: warning: skipping unreadable image {path} ({exc}); "
                  f"run 'hybridtrain check-data' to list every bad file", file=sys.stderr, flush=True)
            return None
        torch.manual_seed(sample_seed(self.seed, epoch, index))
        return self.transform(img), label, index


def collate_readable(items):
    items = [it for it in items if it is not None]
    if not items:
        return None
    images, labels, indices = zip(*items)
    return torch.stack(images), torch.tensor(labels), torch.tensor(indices)


class EpochBatches:
    """A batch sampler whose batches are a pure function of the epoch (see ``sharding``)."""

    def __init__(self, batches_for_epoch):
        self.batches_for_epoch = batches_for_epoch
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        for batch in self.batches_for_epoch(self.epoch):
            yield [(i, self.epoch) for i in batch]

    def __len__(self) -> int:
        return len(self.batches_for_epoch(self.epoch))


def _loader(dataset, batch_sampler, workers: int) -> DataLoader:
    extra = {"multiprocessing_context": "forkserver", "persistent_workers": True} if workers > 0 else {}
    return DataLoader(dataset, batch_sampler=batch_sampler, num_workers=workers, collate_fn=collate_readable,
                      **extra)


def create_train_loader(images: ImageList, cfg, rank: int, world_size: int) -> DataLoader:
    d = cfg.data
    dataset = ImageListDataset(images, train_transform(d.crop_size, d.min_crop_area, d.hflip), cfg.seed)
    n, b = len(images), cfg.train.batch_size
    sampler = EpochBatches(lambda epoch: sharding.train_batches(n, rank, world_size, b, cfg.seed, epoch))
    return _loader(dataset, sampler, d.workers)


def create_val_loader(images: ImageList, cfg, rank: int, world_size: int) -> DataLoader:
    d = cfg.data
    dataset = ImageListDataset(images, val_transform(d.crop_size, d.val_resize), cfg.seed)
    shard = list(sharding.val_shard(len(images), rank, world_size))
    b = d.val_batch_size or cfg.train.batch_size
    sampler = EpochBatches(lambda epoch: [shard[i:i + b] for i in range(0, len(shard), b)])
    return _loader(dataset, sampler, d.workers)

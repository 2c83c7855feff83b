"""``create_loaders``: the one place where ``data.backend`` becomes this rank's training and validation loaders,
and ``to_device``: the one place where a batch reaches the model's device (uint8 pixels normalised there).

Every backend meets :class:`Loader`: it yields ``(images, labels, indices)`` batches (or an ``UnreadableImage``),
has ``len()`` = batches per epoch (equal on every rank) and ``batch_sampler.set_epoch(epoch, start)``. The
torchvision and DALI backends cover the same images: the class folders, or the clean file lists written by
``hybridtrain check-data --write-filelist``.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Iterator, Protocol

import torch

from hybridtrain.data import dali, sharding
from hybridtrain.data.folder import CLEAN_LIST_HINT, ImageList, UnreadableImage, read_filelist, scan_dataset
from hybridtrain.data.presets import IMAGENET_MEAN, IMAGENET_STD
from hybridtrain.data.shards import ShardImages, is_shard_dir, scan_shards
from hybridtrain.data.synthetic import SyntheticLoader
from hybridtrain.data.workers import WorkerBatches, check_shared_memory
from hybridtrain.distributed.topology import cores_per_rank
from hybridtrain.errors import UserError

SYNTHETIC_CLASSES = 1000


class EpochSampler(Protocol):
    def set_epoch(self, epoch: int, start: int = 0) -> None: ...


class Loader(Protocol):
    """What the engine asks of every backend's loader."""
    batch_sampler: EpochSampler

    def __iter__(self) -> Iterator: ...

    def __len__(self) -> int: ...


@dataclass
class Loaders:
    train: object
    val: object
    num_classes: int
    train_images: int
    val_images: int
    dropped_per_epoch: int  # training images left out each epoch, fewer than one global batch
    skipped_files: list[str]

    @property
    def steps_per_epoch(self) -> int:
        return len(self.train)

    def start(self) -> None:
        """Spawn both loaders' persistent workers now: each imports torch for seconds, which then overlaps the
        model's build and broadcast instead of delaying the first steps and the first validation. Their first
        batches are the sampler's as it stands: the first epoch's own ``iter()`` takes them (WorkerLoader.start),
        a later one resets the workers to its batches."""
        for loader in (self.train, self.val):
            if getattr(loader, "persistent_workers", False):  # a WorkerLoader: the only loader with them
                loader.start()

    def close(self) -> None:
        """Stop the loaders' persistent workers now rather than when the garbage collector finds them (elastic
        training replaces the loaders at every resize)."""
        for loader in (self.train, self.val):
            iterator = getattr(loader, "_iterator", None)
            if iterator is not None and hasattr(iterator, "_shutdown_workers"):
                iterator._shutdown_workers()
                loader._iterator = None


def device_images(images: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A batch on ``device`` in the model's input dtype, its layout kept. uint8 batches (this backend's) cross
    to the device as pixels, a quarter of the float bytes, in the layout they have (the dtype does not change on
    the copy, so nothing is transposed on the host), and are normalised there with the same operations, in the
    same order, as ToTensor and Normalize: x / 255, then (x - mean) / std, in FP32."""
    images = images.to(device, non_blocking=True)
    if images.dtype == torch.uint8:
        mean, std = normalisation(device)
        images = images.float().div_(255).sub_(mean).div_(std)
    return images.to(dtype)


@functools.lru_cache(maxsize=None)
def normalisation(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """ImageNet's mean and std as (3, 1, 1) FP32 tensors on ``device``, made once (not one copy per batch)."""
    return tuple(torch.tensor(v, dtype=torch.float32, device=device).view(3, 1, 1) for v in (IMAGENET_MEAN,
                                                                                              IMAGENET_STD))


def to_device(batch, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(images in the model's input dtype, labels) on its device, or this rank's one-line error naming an
    unreadable file."""
    if isinstance(batch, UnreadableImage):
        raise UserError(f"cannot read image {batch.path} ({batch.error}): {CLEAN_LIST_HINT}", same_on_all_ranks=False)
    images, labels, _ = batch
    return device_images(images, device, dtype), labels.to(device, non_blocking=True)


def delivered_dtype(model_dtype: torch.dtype) -> torch.dtype:
    """The dtype the pipelines deliver: FP16 when the model takes FP16 input (fp16_pure, and mixed with fp16, whose
    autocast would cast the input to FP16 anyway), else FP32 (FP64 is cast later). Mixed with bf16 gets FP32: DALI
    (2.4) has no BF16 type for crop_mirror_normalize, and FP16 then BF16 would round twice."""
    return torch.float16 if model_dtype == torch.float16 else torch.float32


def read_splits(cfg) -> tuple[ImageList, ImageList]:
    """Both splits from the class folders, or from the clean file lists of ``check-data``."""
    if is_shard_dir(cfg.data.path):
        if cfg.data.file_lists:
            raise UserError(f"data.path={cfg.data.path} holds tar shards, which data.file_lists cannot filter: unset "
                            f"data.file_lists, or point data.path at the folder tree")
        return scan_shards(cfg.data.path)
    if not cfg.data.file_lists:
        return scan_dataset(cfg.data.path)
    splits = []
    for split in ("train", "val"):
        path = os.path.join(cfg.data.file_lists, f"{split}.txt")
        if not os.path.isfile(path):
            raise UserError(f"data.file_lists={cfg.data.file_lists} has no {split}.txt: run "
                            f"'hybridtrain check-data {cfg.data.path} --write-filelist {cfg.data.file_lists}'")
        splits.append(read_filelist(os.path.join(cfg.data.path, split), path))
    return splits[0], splits[1]


def create_loaders(cfg, topo, model_dtype: torch.dtype = torch.float32) -> Loaders:
    """This rank's loaders; ``model_dtype``, the model's input dtype (precision.policy), picks what the DALI and
    synthetic pipelines deliver."""
    backend = cfg.data.backend
    if backend == "synthetic":
        return synthetic_loaders(cfg, topo, model_dtype)
    if backend.startswith("dali"):
        dali.require_dali("gpu" if backend == "dali_gpu" else "cpu")
    train_set, val_set = read_splits(cfg)
    if len(train_set) < topo.size * cfg.train.batch_size:
        raise UserError(f"the training set ({len(train_set)} images) cannot give each of {topo.size} rank(s) a full "
                        f"batch of {cfg.train.batch_size}: lower train.batch_size or use fewer ranks")
    num_classes = len(train_set.classes)
    if cfg.model.num_classes and cfg.model.num_classes != num_classes:
        raise UserError(f"model.num_classes={cfg.model.num_classes} but {cfg.data.path} has "
                        f"{num_classes} class folders: set model.num_classes: 0 to infer it")
    skipped = train_set.skipped_non_images + val_set.skipped_non_images
    if backend == "torchvision":
        from hybridtrain.data.torchvision_loader import create_train_loader, create_val_loader
        workers = cfg.data.workers or cores_per_rank(topo.local_size)
        if not cfg.data.in_process:
            d = cfg.data
            check_shared_memory(WorkerBatches(cfg.train.batch_size, d.val_batch_size or cfg.train.batch_size,
                                              max(d.crop_size, d.res_end), workers, d.prefetch), topo.local_size,
                                bool(d.workers))  # res_end: the largest training resolution (progressive resizing)
        pin = topo.device.type == "cuda"
        train = create_train_loader(train_set, cfg, topo.rank, topo.size, workers, pin)
        val = create_val_loader(val_set, cfg, topo.rank, topo.size, workers, pin)
        dropped = sharding.dropped_per_epoch(len(train_set), topo.size, cfg.train.batch_size)
    else:
        device = "gpu" if backend == "dali_gpu" else "cpu"
        args = (topo.rank, topo.size, topo.local_size, device, delivered_dtype(model_dtype), cfg.data.channels_last)
        pin = device == "cpu" and topo.device.type == "cuda"  # dali_cpu on a GPU node: asynchronous copies
        loader_class = dali.DaliLoader
        if isinstance(train_set, ShardImages):  # tar shards: fn.external_source, the folder order
            from hybridtrain.data.dali_shards import DaliShardLoader as loader_class
        train = dali.create_dali_train_loader(train_set, cfg, *args, pin=pin, loader_class=loader_class)
        val = dali.create_dali_val_loader(val_set, cfg, *args, pin=pin, loader_class=loader_class)
        dropped = train.dropped_per_epoch
    return Loaders(train, val, num_classes, len(train_set), len(val_set), dropped, skipped)


def synthetic_loaders(cfg, topo, model_dtype: torch.dtype = torch.float32) -> Loaders:
    num_classes = cfg.model.num_classes or SYNTHETIC_CLASSES
    b, d = cfg.train.batch_size, cfg.data
    steps = d.synthetic_images // (topo.size * b)
    if steps == 0:
        raise UserError(f"data.synthetic_images={d.synthetic_images} is less than one global batch "
                        f"({topo.size} x {b}): raise it")
    val_batch = d.val_batch_size or b
    shape = (d.crop_size, num_classes, delivered_dtype(model_dtype), d.channels_last, topo.device)
    train = SyntheticLoader(steps, b, *shape, seed=cfg.seed * 7919 + topo.rank)
    val = SyntheticLoader(1, val_batch, *shape, seed=cfg.seed * 7919 + topo.rank + 104729)
    dropped = d.synthetic_images - steps * topo.size * b
    return Loaders(train, val, num_classes, d.synthetic_images, topo.size * val_batch, dropped, [])

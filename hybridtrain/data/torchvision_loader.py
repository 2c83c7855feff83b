"""The torchvision backend: PIL decoding and torchvision transforms in DataLoader workers.

Augmentation is reproducible: each sample's random crop and flip are seeded from (seed, epoch, index),
so results do not depend on how samples are spread over workers, and a resumed run sees the same
augmented images as an uninterrupted one. An unreadable image turns its batch into an
:class:`UnreadableImage`, which the trainer reports as one error line naming the file.
"""
from __future__ import annotations

import atexit
import functools
import hashlib
import multiprocessing
import os
import shlex
import signal
import stat
import sys
import tempfile
from dataclasses import dataclass

import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset
from torchvision import transforms

from hybridtrain.data import sharding
from hybridtrain.data.folder import ImageList
from hybridtrain.data.images import to_rgb

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def train_transform(crop_size: int, min_crop_area: float, hflip: bool, as_uint8: bool = False):
    """The training augmentation: a normalised float CHW image, or with ``as_uint8`` its uint8 pixels, which
    ``device_images`` normalises on the device to the same numbers."""
    steps = [transforms.RandomResizedCrop(crop_size, scale=(min_crop_area, 1.0))]
    if hflip:
        steps.append(transforms.RandomHorizontalFlip())
    return transforms.Compose(steps + to_tensor(as_uint8))


def val_transform(crop_size: int, resize: int, as_uint8: bool = False):
    return transforms.Compose([transforms.Resize(resize), transforms.CenterCrop(crop_size)] + to_tensor(as_uint8))


def to_tensor(as_uint8: bool) -> list:
    if as_uint8:
        return [transforms.PILToTensor()]
    return [transforms.ToTensor(), transforms.Normalize(IMAGENET_MEAN, IMAGENET_STD)]


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
        # in a worker the seed is the worker's own; in the rank's process (data.in_process) the training's
        # random state is put back afterwards
        in_process = torch.utils.data.get_worker_info() is None
        with torch.random.fork_rng(devices=[], enabled=in_process):
            torch.manual_seed(sample_seed(self.seed, epoch, index))
            try:
                with Image.open(path) as img:
                    return self.transform(to_rgb(img)), label, index
            except Exception as exc:  # every decoder failure: OSError, SyntaxError, DecompressionBombError, ...
                return UnreadableImage(path, f"{type(exc).__name__}: {str(exc)[:200]}")


@dataclass
class UnreadableImage:
    """Stands in for a batch that holds an image the decoder rejected."""
    path: str
    error: str


class Collate:
    """Stack (image, label, index) items into one batch, NCHW or channels_last; an unreadable one wins."""

    def __init__(self, channels_last: bool):
        self.memory_format = torch.channels_last if channels_last else torch.contiguous_format

    def __call__(self, items):
        bad = [it for it in items if isinstance(it, UnreadableImage)]
        if bad:
            return bad[0]
        images, labels, indices = zip(*items)
        return (torch.stack(images).contiguous(memory_format=self.memory_format), torch.tensor(labels),
                torch.tensor(indices))


class EpochBatches:
    """A batch sampler whose batches are a pure function of the epoch (see ``sharding``)."""

    def __init__(self, batches_for_epoch):
        self.batches_for_epoch = batches_for_epoch  # (epoch, start) -> batches
        self.epoch, self.start = 0, 0

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        """Draw ``epoch``'s batches from entry ``start`` of its permutation on (elastic training's resizes)."""
        self.epoch, self.start = epoch, start

    def __iter__(self):
        for batch in self.batches_for_epoch(self.epoch, self.start):
            yield [(i, self.epoch) for i in batch]

    def __len__(self) -> int:
        return len(self.batches_for_epoch(self.epoch, self.start))


def die_with_the_rank(worker_id: int) -> None:
    """Worker init: the kernel kills this worker when the rank that spawned it dies (Linux PR_SET_PDEATHSIG).

    A rank killed with SIGKILL cannot stop its workers; left alive they would keep horovodrun's output pipe
    open, and horovodrun would wait on them forever instead of ending the job. SIGTERM and SIGINT are the
    rank's to handle (preemption: finish the step, checkpoint): a scheduler that signals the whole process
    group must not kill the workers under it. Until this runs, the wrapper of :func:`spawn_context` keeps
    them ignored.
    """
    import ctypes
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: no such guard
        pass


def kill_workers_at_exit() -> None:
    """Workers ignore SIGTERM (above), so multiprocessing's own exit handler, which terminates its children
    with SIGTERM and then joins them, would wait forever: kill them first. atexit runs the handlers in
    reverse order, and this one is registered after multiprocessing's. torch's SIGCHLD handler would raise
    "worker killed" from inside this loop and leave the rest alive, so it is switched off first."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for child in multiprocessing.active_children():
        child.kill()
        child.join(timeout=5)


def close_loader(loader) -> None:
    """Stop a loader's persistent workers now rather than when the garbage collector finds it (elastic
    training replaces the loaders at every resize)."""
    iterator = getattr(loader, "_iterator", None)
    if iterator is not None and hasattr(iterator, "_shutdown_workers"):
        iterator._shutdown_workers()
        loader._iterator = None


@functools.cache
def kill_workers_at_exit_once() -> None:
    """Register kill_workers_at_exit when the first loader with workers is made, not at import (no side effect
    for a process that only imports the package); still after multiprocessing's own handler, so it runs first."""
    atexit.register(kill_workers_at_exit)


def spawn_context():
    """The spawn context, with each child started by a tiny /bin/sh wrapper that ignores SIGTERM and SIGINT and
    then execs this Python: an ignored signal stays ignored across exec.

    A spawned worker imports torch for seconds before ``die_with_the_rank`` runs; a scheduler's SIGTERM to the
    process group in that window would kill it and fail the rank. (A blocked signal mask would not do: Python
    clears it in the child.) The rank's only spawned children are its loader workers."""
    kill_workers_at_exit_once()
    context = multiprocessing.get_context("spawn")
    context.set_executable(signal_proof_python())
    return context


def signal_proof_python() -> str:
    """The wrapper, in the first folder where it can be kept safely and run: ~/.cache/hybridtrain, else the
    temp folder (skipped when mounted noexec, as it often is on clusters). Without one, plain Python. It ignores
    SIGTERM/SIGINT and, where setpriv exists, dies with the rank from its first instruction."""
    python = shlex.quote(sys.executable)
    # setpriv (util-linux) sets the parent-death signal before Python starts, so a rank killed while its workers
    # still import torch (seconds) takes them along; die_with_the_rank sets it again once they run
    script = (f"#!/bin/sh\ntrap '' TERM INT\n"
              f"if setpriv --pdeathsig KILL true 2>/dev/null; then exec setpriv --pdeathsig KILL {python} \"$@\"; fi\n"
              f"exec {python} \"$@\"\n")
    name = f"worker-python-{os.getuid()}-{hashlib.sha256(script.encode()).hexdigest()[:16]}"
    for folder in (os.path.join(os.path.expanduser("~"), ".cache", "hybridtrain"), tempfile.gettempdir()):
        path = os.path.join(folder, name)
        try:
            os.makedirs(folder, mode=0o700, exist_ok=True)
            if os.statvfs(folder).f_flag & os.ST_NOEXEC:
                continue
            if not is_ours(path, script):
                staging = f"{path}.{os.getpid()}"
                with open(os.open(staging, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o755), "w") as fh:
                    fh.write(script)
                os.replace(staging, path)  # atomic: ranks on one host may race here
            if is_ours(path, script):
                return path
        except OSError:
            continue
    return sys.executable


def is_ours(path: str, script: str) -> bool:
    """A file this user owns, that nobody else may write, holding exactly ``script``: anything else in a
    shared folder such as /tmp could be someone's planted program, and is never run."""
    try:
        st = os.lstat(path)
        with open(path) as fh:
            content = fh.read()
    except OSError:
        return False
    return stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & 0o022 and content == script


def _loader(dataset, batch_sampler, cfg, workers: int, pin: bool) -> DataLoader:
    # spawn, not fork (unsafe after Horovod's threads start) nor forkserver (its server outlives a killed rank):
    # spawned workers are the rank's own children, so die_with_the_rank applies. pin: page-locked batches for a
    # GPU, so that the copy to it overlaps (from pageable memory it would be synchronous).
    if cfg.data.in_process:
        return DataLoader(dataset, batch_sampler=batch_sampler, collate_fn=Collate(cfg.data.channels_last),
                          pin_memory=pin)
    return DataLoader(dataset, batch_sampler=batch_sampler, num_workers=workers,
                      collate_fn=Collate(cfg.data.channels_last), multiprocessing_context=spawn_context(),
                      persistent_workers=True, prefetch_factor=cfg.data.prefetch, worker_init_fn=die_with_the_rank,
                      pin_memory=pin)


def create_train_loader(images: ImageList, cfg, rank: int, world_size: int, workers: int,
                        pin: bool = False) -> DataLoader:
    """This rank's training batches of uint8 pixels (``device_images`` normalises them): every sample at most
    once per epoch, see ``sharding.train_batches``."""
    d = cfg.data
    dataset = ImageListDataset(images, train_transform(d.crop_size, d.min_crop_area, d.hflip, as_uint8=True),
                               cfg.seed)
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

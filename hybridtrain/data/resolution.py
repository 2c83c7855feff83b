"""Progressive resizing (FFCV's): the training resolution as a pure function of the 0-based epoch.

Low resolution first, from ``data.res_start`` px up to epoch ``data.res_start_epoch``, linearly up to
``data.res_end`` px at epoch ``data.res_end_epoch`` and after, each epoch in between rounded to a multiple of
``data.res_multiple`` (FFCV's 32: 160 -> 192 px). Validation keeps its own resolution (``data.val_resize`` and
``data.crop_size``, FFCV's 224). Config validation keeps ``res_end_epoch`` below ``train.epochs``, so the last
epoch, whose last iteration gives BN its statistics (``bn.stats: last_iteration``), trains at ``res_end``.

A pure function of the epoch, so both backends draw it where they need it (the torchvision workers from the
sample's key, DALI when it builds the epoch's pipeline), and a run resumed mid-epoch continues at its resolution.
``data.res_start: 0`` is off: every epoch trains at ``data.crop_size``.
"""
from __future__ import annotations

from dataclasses import dataclass


def progressive_resolution(epoch: int, start: int, end: int, start_epoch: int, end_epoch: int,
                           multiple: int) -> int:
    """FFCV's get_resolution: ``start`` up to ``start_epoch``, ``end`` from ``end_epoch``, linear in between, rounded
    (half to even, as NumPy's) to a multiple of ``multiple``."""
    if epoch <= start_epoch:
        return start
    if epoch >= end_epoch:
        return end
    # r(e) = multiple * round((start + (end - start) * (e - e0) / (e1 - e0)) / multiple)
    return multiple * round((start + (end - start) * (epoch - start_epoch) / (end_epoch - start_epoch)) / multiple)


@dataclass(frozen=True)
class Resolutions:
    """The run's training resolution per epoch (picklable: the torchvision workers hold one)."""
    crop_size: int  # data.crop_size: every epoch's resolution when progressive resizing is off
    start: int = 0  # data.res_start; 0 = off
    end: int = 0
    start_epoch: int = 0
    end_epoch: int = 0
    multiple: int = 32

    @property
    def progressive(self) -> bool:
        return self.start > 0

    def __call__(self, epoch: int) -> int:
        if not self.progressive:
            return self.crop_size
        return progressive_resolution(epoch, self.start, self.end, self.start_epoch, self.end_epoch, self.multiple)

    def distinct(self, epochs: int) -> list[int]:
        """The resolutions a run of ``epochs`` epochs trains at, in the order it meets them."""
        return list(dict.fromkeys(self(e) for e in range(epochs)))


def resolutions(data_cfg) -> Resolutions:
    """The config's ``data`` section's schedule."""
    d = data_cfg
    return Resolutions(d.crop_size, d.res_start, d.res_end, d.res_start_epoch, d.res_end_epoch, d.res_multiple)


def train_resolution(cfg, epoch: int) -> int:
    """The training resolution (px) of the 0-based ``epoch``."""
    return resolutions(cfg.data)(epoch)

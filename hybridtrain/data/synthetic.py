"""The ``synthetic`` backend: one batch of random tensors made once on the device, handed out every step.

It measures pure compute and communication: no decoding, no host-to-device copies. Labels are uniform
over the classes, so top-1 stays near chance. An epoch is ``data.synthetic_images`` images over all ranks
(rounded down to whole global batches); validation is one batch per rank.
"""
from __future__ import annotations

import torch


class SyntheticLoader:
    """``steps`` identical batches ``(images, labels, indices)`` per epoch, with the other loaders' interface."""

    def __init__(self, steps: int, batch_size: int, crop_size: int, num_classes: int, dtype: torch.dtype,
                 channels_last: bool, device: torch.device, seed: int):
        generator = torch.Generator().manual_seed(seed)
        images = torch.randn(batch_size, 3, crop_size, crop_size, generator=generator).to(device, dtype)
        self.images = images.contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)
        self.labels = torch.randint(num_classes, (batch_size,), generator=generator).to(device)
        self.indices = torch.arange(batch_size)
        self.steps, self.epoch = steps, 0

    @property
    def batch_sampler(self):
        return self

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        """``start``: no sample order to resume within (every batch is the same random one)."""
        self.epoch = epoch

    def __len__(self) -> int:
        return self.steps

    def __iter__(self):
        for _ in range(self.steps):
            yield self.images, self.labels, self.indices

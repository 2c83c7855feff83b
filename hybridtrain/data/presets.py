"""The images' presets: ImageNet's mean and std, the torchvision augmentation and validation transforms, and
normalising a batch of uint8 pixels on its device. The DALI pipelines use the same constants."""
from __future__ import annotations

import functools

import torch
from torchvision import transforms

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

"""The images' presets: ImageNet's mean and std, and the augmentation and validation transforms of the torchvision
backend. The DALI pipelines and the normalisation on the device (``loaders.device_images``) use the same constants.

The transforms are torchvision's (RandomResizedCrop, RandomHorizontalFlip, Resize, CenterCrop, PILToTensor or
ToTensor + Normalize; torchvision 0.2x's code, same random draws from torch's generator, same PIL calls, so the same
pixels, tests/test_time_breakdown.py compares them), written here on PIL and torch alone: ``import torchvision``
imports its models and ops, and with them ``torch._dynamo``, about 2 s of CPU in every rank and every loader worker
before its first batch: time to the first step."""
from __future__ import annotations

import math

import numpy as np
import torch
from PIL import Image

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
BILINEAR = Image.Resampling.BILINEAR


class Compose:
    def __init__(self, steps: list):
        self.steps = steps

    def __call__(self, img):
        for step in self.steps:
            img = step(img)
        return img


def resize_to(img: Image.Image, height: int, width: int) -> Image.Image:
    """torchvision's F.resize of a PIL image to (height, width): unchanged when it has that size already."""
    return img if (img.height, img.width) == (height, width) else img.resize((width, height), BILINEAR)


class RandomResizedCrop:
    """torchvision.transforms.RandomResizedCrop(size, scale, ratio=(3/4, 4/3)), bilinear, on PIL images."""

    def __init__(self, size: int, scale: tuple[float, float], ratio: tuple[float, float] = (3.0 / 4.0, 4.0 / 3.0)):
        self.size, self.scale, self.ratio = size, scale, ratio

    def params(self, height: int, width: int) -> tuple[int, int, int, int]:
        scale, ratio = self.scale, self.ratio
        area = height * width
        log_ratio = torch.log(torch.tensor(ratio))
        for _ in range(10):
            target_area = area * torch.empty(1).uniform_(scale[0], scale[1]).item()
            aspect_ratio = torch.exp(torch.empty(1).uniform_(log_ratio[0], log_ratio[1])).item()
            w = int(round(math.sqrt(target_area * aspect_ratio)))
            h = int(round(math.sqrt(target_area / aspect_ratio)))
            if 0 < w <= width and 0 < h <= height:
                i = torch.randint(0, height - h + 1, size=(1,)).item()
                j = torch.randint(0, width - w + 1, size=(1,)).item()
                return i, j, h, w
        in_ratio = float(width) / float(height)  # the fallback: a central crop
        if in_ratio < min(ratio):
            w, h = width, int(round(width / min(ratio)))
        elif in_ratio > max(ratio):
            h, w = height, int(round(height * max(ratio)))
        else:
            w, h = width, height
        return (height - h) // 2, (width - w) // 2, h, w

    def __call__(self, img: Image.Image) -> Image.Image:
        i, j, h, w = self.params(img.height, img.width)
        return resize_to(img.crop((j, i, j + w, i + h)), self.size, self.size)


class RandomHorizontalFlip:
    def __call__(self, img: Image.Image) -> Image.Image:
        return img.transpose(Image.Transpose.FLIP_LEFT_RIGHT) if torch.rand(1) < 0.5 else img


class Resize:
    """torchvision.transforms.Resize(size): the shorter side to ``size``, the longer in proportion (rounded down)."""

    def __init__(self, size: int):
        self.size = size

    def __call__(self, img: Image.Image) -> Image.Image:
        w, h = img.size
        short, long = (w, h) if w <= h else (h, w)
        new_short, new_long = self.size, int(self.size * long / short)
        new_w, new_h = (new_short, new_long) if w <= h else (new_long, new_short)
        return resize_to(img, new_h, new_w)


class CenterCrop:
    """torchvision.transforms.CenterCrop(size): padded with zeros first where the image is smaller."""

    def __init__(self, size: int):
        self.size = size

    def __call__(self, img: Image.Image) -> Image.Image:
        size, (width, height) = self.size, img.size
        if size > width or size > height:
            left, top = max(0, (size - width) // 2), max(0, (size - height) // 2)
            padded = Image.new(img.mode, (width + max(0, size - width), height + max(0, size - height)), 0)
            padded.paste(img, (left, top))
            img, (width, height) = padded, padded.size
            if (width, height) == (size, size):
                return img
        top, left = int(round((height - size) / 2.0)), int(round((width - size) / 2.0))
        return img.crop((left, top, left + size, top + size))


class PILToTensor:
    """uint8 CHW pixels (a permuted view, as torchvision's)."""

    def __call__(self, img: Image.Image) -> torch.Tensor:
        pixels = torch.as_tensor(np.array(img, copy=True))
        return pixels.view(img.size[1], img.size[0], len(img.getbands())).permute((2, 0, 1))


class ToNormalisedTensor:
    """torchvision's ToTensor then Normalize(IMAGENET_MEAN, IMAGENET_STD): float CHW."""

    def __call__(self, img: Image.Image) -> torch.Tensor:
        x = PILToTensor()(img).contiguous().to(dtype=torch.get_default_dtype()).div(255)
        mean = torch.as_tensor(IMAGENET_MEAN, dtype=x.dtype).view(-1, 1, 1)
        std = torch.as_tensor(IMAGENET_STD, dtype=x.dtype).view(-1, 1, 1)
        return x.sub_(mean).div_(std)


def train_transform(crop_size: int, min_crop_area: float, hflip: bool, as_uint8: bool = False):
    """The training augmentation: a normalised float CHW image, or with ``as_uint8`` its uint8 pixels, which
    ``device_images`` normalises on the device to the same numbers."""
    steps = [RandomResizedCrop(crop_size, scale=(min_crop_area, 1.0))]
    if hflip:
        steps.append(RandomHorizontalFlip())
    return Compose(steps + to_tensor(as_uint8))


def val_transform(crop_size: int, resize: int, as_uint8: bool = False):
    return Compose([Resize(resize), CenterCrop(crop_size)] + to_tensor(as_uint8))


def to_tensor(as_uint8: bool) -> list:
    return [PILToTensor()] if as_uint8 else [ToNormalisedTensor()]

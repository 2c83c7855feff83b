"""The images' presets: ImageNet's mean and std, and the torchvision augmentation and validation transforms. The
DALI pipelines and the normalisation on the device (``loaders.device_images``) use the same constants."""
from __future__ import annotations

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

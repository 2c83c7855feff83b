"""Scanning an ImageNet-layout dataset (``ROOT/{train,val}/<class>/<image>``) with clear errors."""
from __future__ import annotations

import os
import unicodedata
from dataclasses import dataclass

from hybridtrain.errors import UserError

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".tif", ".tiff", ".ppm")


@dataclass
class ImageList:
    """A split: class names (sorted) and (path, label) samples in a stable order."""
    root: str
    classes: list[str]
    samples: list[tuple[str, int]]
    skipped_non_images: list[str]

    def __len__(self) -> int:
        return len(self.samples)

    def open(self, index: int):
        """What ``PIL.Image.open`` reads for sample ``index``: its path here (a stream for tar shards)."""
        return self.samples[index][0]


def is_image_file(name: str) -> bool:
    return name.lower().endswith(IMAGE_EXTENSIONS)


def require_two_classes(images: ImageList) -> ImageList:
    """A classifier of one class reaches 100% without learning anything: refuse it at the scan."""
    if len(images.classes) < 2:
        raise UserError(f"{images.root} has only one class folder ({images.classes[0] if images.classes else '-'}): "
                        f"a classification dataset needs at least 2 classes: add the other classes' folders, "
                        f"or point data.path at the dataset root")
    return images


NFC_FIX = "rename them all in one form (e.g. convmv -r -f utf8 -t utf8 --nfc --notest DIR)"


def refuse_lookalike_names(names: list[str], where: str) -> list[str]:
    """``names``, or one line when two of them differ only in Unicode normalisation (e.g. 'café' typed on Linux
    and copied from macOS): they look the same but would be two classes."""
    seen: dict[str, str] = {}
    for name in names:
        first = seen.setdefault(unicodedata.normalize("NFC", name), name)
        if first != name:
            raise UserError(f"{where} has two class folders, {first!r} and {name!r}, whose names differ only in "
                            f"Unicode normalisation, so they would be two classes: merge them into one folder, or "
                            f"{NFC_FIX}")
    return names


def scan_split(root: str, split: str) -> ImageList:
    split_dir = os.path.join(root, split)
    if root.startswith("~") and not os.path.exists(root):
        raise UserError(f"data.path={root} starts with '~', which only a shell expands: write the path without ~ "
                        f"(e.g. {os.path.expanduser(root)})")
    if os.path.exists(root) and not os.path.isdir(root):
        raise UserError(f"data.path={root} is a file, not a folder: set data.path to the dataset folder holding "
                        f"train/<class>/*.jpg and val/<class>/*.jpg")
    if not os.path.isdir(root):
        raise UserError(f"data directory not found: {root} (set data.path, or create it with "
                        f"'hybridtrain prepare-data digits --out {root}')")
    if not os.path.isdir(split_dir):
        raise UserError(f"data directory {root} has no '{split}' folder: expected {root}/{split}/<class>/*.jpg")
    classes = sorted(d for d in os.listdir(split_dir) if os.path.isdir(os.path.join(split_dir, d)))
    refuse_lookalike_names(classes, split_dir)
    if not classes:
        raise UserError(f"{split_dir} has no class folders: expected {split_dir}/<class>/*.jpg")
    samples, skipped = [], []
    for label, name in enumerate(classes):
        class_dir = os.path.join(split_dir, name)
        files = sorted(os.listdir(class_dir))
        images = [f for f in files if is_image_file(f) and os.path.isfile(os.path.join(class_dir, f))]
        skipped += [os.path.join(class_dir, f) for f in files if f not in images]
        if not images:
            raise UserError(f"class folder {class_dir} has no images: add images or remove the folder")
        samples += [(os.path.join(class_dir, f), label) for f in images]
    return require_two_classes(ImageList(split_dir, classes, samples, skipped))


def scan_dataset(root: str) -> tuple[ImageList, ImageList]:
    """Both splits, checked to share the same classes."""
    train, val = scan_split(root, "train"), scan_split(root, "val")
    if train.classes != val.classes:
        if sorted(unicodedata.normalize("NFC", c) for c in train.classes) == \
                sorted(unicodedata.normalize("NFC", c) for c in val.classes):
            differ = next(c for c in train.classes if c not in val.classes)
            raise UserError(f"the class folders of train and val in {root} differ only in Unicode normalisation "
                            f"(e.g. {differ!r} in train is spelled another way in val): {NFC_FIX}")
        only_train = sorted(set(train.classes) - set(val.classes))[:3]
        only_val = sorted(set(val.classes) - set(train.classes))[:3]
        raise UserError(f"train and val class folders differ in {root} (only in train: {only_train}, "
                        f"only in val: {only_val}): both splits need the same class folders")
    return train, val


@dataclass
class UnreadableImage:
    """Stands in for a batch that holds an image the decoder rejected."""
    path: str
    error: str

"""Scanning an ImageNet-layout dataset (``ROOT/{train,val}/<class>/<image>``) with clear errors."""
from __future__ import annotations

import os
import re
import unicodedata
from dataclasses import dataclass

from hybridtrain.errors import UserError
from hybridtrain.files import not_expanded

CLEAN_LIST_HINT = ("run 'hybridtrain check-data DATA --write-filelist DIR' and train with data.file_lists=DIR "
                   "(or move the file out of the dataset)")
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


def read_text_lines(path: str) -> list[str]:
    """The lines of a label file or file list: UTF-8 (a spreadsheet's BOM and CRLF too), or one line naming the first
    byte that is not, never a class name with a replacement character in it."""
    with open(path, "rb") as fh:
        data = fh.read()
    try:
        return re.split(r"\r\n|\r|\n", data.decode("utf-8-sig"))  # the newlines of open(), not splitlines()'s
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise UserError(f"{path} line {line} is not UTF-8 text (byte 0x{data[exc.start]:02x}; saved as Windows-1252 "
                        f"or Latin-1?), so its names would be misread: convert it, e.g. iconv -f WINDOWS-1252 -t "
                        f"UTF-8 {path} > {os.path.splitext(path)[0]}.utf8{os.path.splitext(path)[1]}, and give "
                        f"that file") from None


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
    not_expanded(root, "data.path")
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
        flat = len(images_in(split_dir))
        hint = (f"; it holds {flat} images directly (a flat folder: sort them into class folders with 'hybridtrain "
                f"reorganise-val {split_dir} --labels FILE --out NEW', which keeps these)" if flat else "")
        raise UserError(f"{split_dir} has no class folders: expected {split_dir}/<class>/*.jpg{hint}")
    loose = sorted(images_in(split_dir))
    if loose:
        raise UserError(f"{len(loose)} image(s) lie directly in {split_dir}, beside its {len(classes)} class folders "
                        f"(first: {loose[0]}; a sorting script stopped half-way?): only {split}/<class>/<image> is "
                        f"read, so they would be left out: move each into its class folder (or all of them back "
                        f"flat, mv {split_dir}/*/* {split_dir}/, and sort them with their label file: hybridtrain "
                        f"reorganise-val, or prepare-data imagenet --val-labels), keeping every image")
    samples, skipped = [], []
    for label, name in enumerate(classes):
        class_dir = os.path.join(split_dir, name)
        files = sorted(os.listdir(class_dir))
        images = [f for f in files if is_image_file(f) and os.path.isfile(os.path.join(class_dir, f))]
        skipped += [os.path.join(class_dir, f) for f in files if f not in images]
        if not images or nested_images(class_dir, files):
            raise UserError(f"class folder {class_dir} has {len(images) or 'no'} images"
                            f"{what_is_there(root, split, name, files)}")
        samples += [(os.path.join(class_dir, f), label) for f in images]
    return require_two_classes(ImageList(split_dir, classes, samples, skipped))


def nested_images(class_dir: str, files: list[str]) -> dict[str, int]:
    """The subfolders of a class folder that hold images, with how many (the loaders read none of them)."""
    nested = {f: len(images_in(os.path.join(class_dir, f))) for f in files if os.path.isdir(os.path.join(class_dir, f))}
    return {f: n for f, n in nested.items() if n}


def images_in(folder: str) -> list[str]:
    """The image files directly in ``folder`` (none when it is not a folder)."""
    if not os.path.isdir(folder):
        return []
    return [f for f in os.listdir(folder) if is_image_file(f) and os.path.isfile(os.path.join(folder, f))]


def what_is_there(root: str, split: str, name: str, files: list[str]) -> str:
    """For a class folder without images directly in it, or with images in a subfolder: what it does hold and how
    to go on without losing any of it (never 'remove the folder': it may hold the user's images one level down, or
    the class's images in the other split)."""
    class_dir = os.path.join(root, split, name)
    nested = nested_images(class_dir, files)
    if nested:
        sub, count = next(iter(nested.items()))
        first = min(images_in(os.path.join(class_dir, sub)))
        return (f" directly in it, but {sum(nested.values())} in its subfolder(s) ({sub}/ holds {count}), e.g. "
                f"{sub}/{first}: the loader "
                f"reads only {split}/<class>/<image>, so move them up (mv {os.path.join(class_dir, sub)}/* "
                f"{class_dir}/), keeping every image")
    other = "val" if split == "train" else "train"
    elsewhere = len(images_in(os.path.join(root, other, name)))
    held = f"; it holds {len(files)} other file(s), e.g. {files[0]}" if files else ""
    if elsewhere:
        return (f"{held}, while {os.path.join(root, other, name)} holds {elsewhere} of the class: add its {split} "
                f"images to {class_dir}; to train without the class, move both {name} folders (train and val) out of "
                f"{root}, keeping its {elsewhere} {other} images")
    return (f"{held}: add its images, or, to train without the class, move the folder out of {root} (in train and "
            f"val)")


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


def read_filelist(split_dir: str, path: str) -> ImageList:
    """An ImageList from a file list that check-data wrote (``check.write_filelist``) for ``split_dir``; checks that
    it still fits the class folders."""
    classes = sorted(d for d in os.listdir(split_dir) if os.path.isdir(os.path.join(split_dir, d)))
    label_of = {name: label for label, name in enumerate(classes)}
    samples = []
    for n, line in enumerate(read_text_lines(path), 1):  # a spreadsheet's BOM and CRLF too
        if not line.strip():
            continue
        rel, _, label = line.rpartition(" ")
        folder = rel.split("/", 1)[0]
        if not label.isdigit() or label_of.get(folder) != int(label):
            data_root = os.path.dirname(os.path.normpath(split_dir))
            raise UserError(f"file list {path} line {n} does not match the class folders of {split_dir}: "
                            f"run 'hybridtrain check-data {data_root} --write-filelist "
                            f"{os.path.dirname(path) or '.'}' again")
        samples.append((os.path.join(split_dir, rel), int(label)))
    return require_two_classes(ImageList(split_dir, classes, samples, []))

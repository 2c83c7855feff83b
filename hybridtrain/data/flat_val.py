"""ImageNet validation as a flat folder plus a label file, reorganised into class subfolders.

Two label formats are read: ``<filename> <class>`` per line, and Kaggle's ``LOC_val_solution.csv``
(header ``ImageId,PredictionString``; the class is the first word of the prediction string). Images are
matched by file name without extension, so ``ILSVRC2012_val_00000001`` finds ``ILSVRC2012_val_00000001.JPEG``.
"""
from __future__ import annotations

import os
import shutil

from ..errors import UserError
from .folder import is_image_file

CSV_HEADER = "ImageId,PredictionString"


def read_val_labels(labels_file: str) -> dict[str, str]:
    """Image name without extension -> class name, from either label format."""
    if not os.path.isfile(labels_file):
        raise UserError(f"label file not found: {labels_file}")
    with open(labels_file) as fh:
        lines = [(n, line.strip()) for n, line in enumerate(fh, 1) if line.strip()]
    is_csv = bool(lines) and lines[0][1].replace(" ", "") == CSV_HEADER
    labels = {}
    for n, line in lines[1:] if is_csv else lines:
        name, cls = parse_label_line(line, is_csv)
        if not name or not cls:
            expected = "ImageId,<class> ..." if is_csv else "<filename> <class>"
            raise UserError(f"{labels_file} line {n} is not '{expected}': {line[:80]!r}")
        labels[os.path.splitext(name)[0]] = cls
    if not labels:
        raise UserError(f"{labels_file} holds no labels")
    return labels


def parse_label_line(line: str, is_csv: bool) -> tuple[str, str]:
    """(image name, class) or empty strings when the line does not fit the format."""
    if is_csv:
        name, _, prediction = line.partition(",")
        words = prediction.split()
        return name.strip(), words[0] if words else ""
    words = line.split()
    return (words[0], words[1]) if len(words) == 2 else ("", "")


def match_images(flat_dir: str, labels: dict[str, str], labels_file: str) -> dict[str, str]:
    """Image name without extension -> file name in ``flat_dir``; every label and every image must match."""
    if not os.path.isdir(flat_dir):
        raise UserError(f"flat validation folder not found: {flat_dir}")
    files = {os.path.splitext(f)[0]: f for f in sorted(os.listdir(flat_dir)) if is_image_file(f)}
    missing = sorted(set(labels) - set(files))
    unlabelled = sorted(set(files) - set(labels))
    if missing:
        raise UserError(f"{len(missing)} image(s) named in {labels_file} are not in {flat_dir} "
                        f"(first: {missing[0]}): is it the label file of this folder?")
    if unlabelled:
        raise UserError(f"{len(unlabelled)} image(s) in {flat_dir} have no label in {labels_file} "
                        f"(first: {files[unlabelled[0]]})")
    return files


def reorganise_flat_val(flat_dir: str, labels_file: str, out_dir: str, link: bool = True) -> dict:
    """Write ``out_dir/<class>/<image>`` as symlinks to the flat images (or copies); returns counts."""
    labels = read_val_labels(labels_file)
    files = match_images(flat_dir, labels, labels_file)
    if os.path.exists(out_dir) and (not os.path.isdir(out_dir) or os.listdir(out_dir)):
        raise UserError(f"{out_dir} already exists and is not an empty folder: remove it or choose another --out")
    tmp = out_dir.rstrip("/") + ".partial"
    shutil.rmtree(tmp, ignore_errors=True)  # a previous run that died half-way
    for stem, cls in labels.items():
        os.makedirs(os.path.join(tmp, cls), exist_ok=True)
        src, dst = os.path.abspath(os.path.join(flat_dir, files[stem])), os.path.join(tmp, cls, files[stem])
        if link:
            os.symlink(src, dst)
        else:
            shutil.copy2(src, dst)
    if os.path.isdir(out_dir):
        os.rmdir(out_dir)  # empty, checked above
    os.replace(tmp, out_dir)
    return {"images": len(labels), "classes": len(set(labels.values()))}

"""ImageNet validation as a flat folder plus a label file, reorganised into class subfolders.

Two label formats are read: ``<filename> <class>`` per line, and Kaggle's ``LOC_val_solution.csv``
(header ``ImageId,PredictionString``; the class is the first word of the prediction string). Images are
matched by file name without extension, so ``ILSVRC2012_val_00000001`` finds ``ILSVRC2012_val_00000001.JPEG``.
"""
from __future__ import annotations

import os
import shutil
import unicodedata

from hybridtrain.data.folder import is_image_file, read_text_lines
from hybridtrain.data.prepare.names import unsafe_name
from hybridtrain.errors import UserError
from hybridtrain.files import check_input_dir, check_input_file, finish_partial, start_partial

CSV_HEADER = "ImageId,PredictionString"


def read_val_labels(labels_file: str, trained: tuple[set[str], str] | None = None) -> dict[str, str]:
    """Image name without extension -> class name, from either label format. ``trained``: (the classes with training
    images, their folder): a label naming another class is refused at its line."""
    check_input_file(labels_file, "--labels", "give the label file ('IMAGE CLASS' lines, or LOC_val_solution.csv)")
    lines = [(n, line.strip()) for n, line in enumerate(read_text_lines(labels_file), 1) if line.strip()]
    is_csv = bool(lines) and lines[0][1].replace(" ", "") == CSV_HEADER
    labels, line_of, spelling = {}, {}, {}
    for n, line in lines[1:] if is_csv else lines:
        if is_csv:  # the class is the first word of the prediction string
            name, _, prediction = line.partition(",")
            name, cls = name.strip(), (prediction.split() or [""])[0]
        else:
            words = line.split()
            name, cls = words if len(words) == 2 else ("", "")
        if not name or not cls:
            expected = "ImageId,<class> ..." if is_csv else "<filename> <class>"
            raise UserError(f"{labels_file} line {n} is not '{expected}': {line[:80]!r}")
        problem = unsafe_name(cls)
        if problem:
            raise UserError(f"{labels_file} line {n}: the class {cls[:80]!r} {problem}, so its folder would not be "
                            f"a class folder under --out: fix that line (a class is one folder name, e.g. n01440764)")
        if trained is not None and cls not in trained[0]:
            raise UserError(f"{labels_file} line {n}: the class {cls!r} has no training images (no folder {cls} with "
                            f"images in {trained[1]}): is it the label file of this training set? Give the right "
                            f"one, or add the class's training images")
        stem = os.path.splitext(name)[0]
        if stem in labels and labels[stem] != cls:
            raise UserError(f"{labels_file} gives the image {stem} two classes: {labels[stem]!r} at line "
                            f"{line_of[stem]} and {cls!r} at line {n}: keep the right line and delete the other")
        same = spelling.setdefault(unicodedata.normalize("NFC", cls), (cls, n))
        if same[0] != cls:
            raise UserError(f"{labels_file} lines {same[1]} and {n} name the classes {same[0]!r} and {cls!r}, which "
                            f"differ only in Unicode normalisation and would become two folders: write both the "
                            f"same way")
        labels[stem], line_of[stem] = cls, line_of.get(stem, n)
    if not labels:
        raise UserError(f"{labels_file} holds no labels")
    return labels


def match_images(flat_dir: str, labels: dict[str, str], labels_file: str) -> dict[str, str]:
    """Image name without extension -> file name in ``flat_dir``; every label and every image must match."""
    check_input_dir(flat_dir, "the flat validation folder", "give the folder of ILSVRC2012_val_*.JPEG")
    files: dict[str, str] = {}
    for f in sorted(os.listdir(flat_dir)):
        if is_image_file(f):
            twin = files.setdefault(os.path.splitext(f)[0], f)
            if twin != f:
                raise UserError(f"{flat_dir} holds both {twin} and {f}, and {labels_file} matches images by name "
                                f"without extension: move one of them out")
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
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise UserError(f"--out {out_dir} is a file: choose a new or empty folder as --out")
    held = sorted(os.listdir(out_dir)) if os.path.isdir(out_dir) else []
    if held:
        raise UserError(f"--out {out_dir} is not empty: it holds {len(held)} entries (e.g. {held[0]}), which are left "
                        f"as they are: choose a new or empty folder as --out (e.g. {os.path.normpath(out_dir)}-sorted)")
    tmp = start_partial(out_dir)  # removes only an OUT.partial a previous run of ours left
    for stem, cls in labels.items():
        os.makedirs(os.path.join(tmp, cls), exist_ok=True)
        src, dst = os.path.abspath(os.path.join(flat_dir, files[stem])), os.path.join(tmp, cls, files[stem])
        if link:
            os.symlink(src, dst)
        else:
            shutil.copy2(src, dst)
    finish_partial(tmp, out_dir)  # out_dir: absent or empty, checked above
    return {"images": len(labels), "classes": len(set(labels.values()))}

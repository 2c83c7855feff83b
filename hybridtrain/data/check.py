"""check-data: fully decode every image of an ImageNet-layout dataset in parallel and report the problems.

The report (a JSON-ready dict) holds, per split: the class folders with their count of readable images,
the readable samples as (path relative to the split folder, label), the corrupt or unreadable images with
the decoder's message, and the files that are not images. ``write_filelist`` turns it into a clean file
list (``class/file label`` per line, the format of DALI's ``file_list``), which ``folder.read_filelist`` reads
back as an :class:`ImageList` for either backend. Labels are the class folder's position in sorted order,
as in ``folder.scan_split``.
"""
from __future__ import annotations

import multiprocessing
import os

from tqdm import tqdm

from hybridtrain.data.folder import is_image_file, refuse_lookalike_names
from hybridtrain.data.images import decode_error
from hybridtrain.errors import UserError
from hybridtrain.files import check_input_dir, write_text_atomically

SPLITS = ("train", "val")
FULL_TABLE_MAX_CLASSES = 20


def list_split(split_dir: str) -> tuple[list[str], list[tuple[str, int]], list[str]]:
    """Class names, image candidates (relative path, label) and non-image files of one split."""
    entries = sorted(os.listdir(split_dir))
    classes = refuse_lookalike_names([d for d in entries if os.path.isdir(os.path.join(split_dir, d))], split_dir)
    candidates, non_images = [], [e for e in entries if e not in classes]
    for label, name in enumerate(classes):
        for f in sorted(os.listdir(os.path.join(split_dir, name))):
            rel = os.path.join(name, f)
            if is_image_file(f) and os.path.isfile(os.path.join(split_dir, rel)):
                candidates.append((rel, label))
            else:
                non_images.append(rel)
    return classes, candidates, non_images


def check_split(root: str, split: str, workers: int) -> dict:
    """One split's part of the report."""
    split_dir = os.path.join(root, split)
    classes, candidates, non_images = list_split(split_dir)
    paths = [os.path.join(split_dir, rel) for rel, _ in candidates]  # decoded in order, over ``workers`` processes
    bar = dict(total=len(paths), desc=f"check {split}", unit="img", dynamic_ncols=True)
    if workers <= 1 or len(paths) < 2:
        errors = [decode_error(p) for p in tqdm(paths, **bar)]
    else:
        with multiprocessing.get_context("forkserver").Pool(workers) as pool:
            errors = list(tqdm(pool.imap(decode_error, paths, chunksize=32), **bar))
    samples = [[rel, label] for (rel, label), err in zip(candidates, errors) if err is None]
    counts = dict.fromkeys(classes, 0)
    for rel, label in samples:
        counts[classes[label]] += 1
    corrupt = [{"path": rel, "error": err} for (rel, _), err in zip(candidates, errors) if err is not None]
    return {"classes": counts, "samples": samples, "corrupt": corrupt, "non_images": non_images}


def check_data(root: str, workers: int = 0) -> dict:
    """Decode every image under ROOT/{train,val} with ``workers`` processes (0 = all cores)."""
    check_input_dir(root, "the data folder", "give the dataset folder holding train/<class>/*.jpg and "
                                             "val/<class>/*.jpg")
    splits = [s for s in SPLITS if os.path.isdir(os.path.join(root, s))]
    if not splits:
        raise UserError(f"{root} has neither a train nor a val folder: expected {root}/train/<class>/*.jpg")
    workers = workers or os.cpu_count() or 1
    return {"root": root, "splits": {s: check_split(root, s, workers) for s in splits}}


def problem_count(report: dict) -> int:
    """Corrupt images over all splits (non-image files are skipped by both backends, not counted)."""
    return sum(len(s["corrupt"]) for s in report["splits"].values())


def format_report(report: dict) -> str:
    """A readable table: per split totals, per-class counts (or their range), then every problem file."""
    lines = [f"{'split':<6} {'classes':>7} {'images':>8} {'corrupt':>7} {'non-images':>10}"]
    for split, s in report["splits"].items():
        lines.append(f"{split:<6} {len(s['classes']):>7} {len(s['samples']):>8} {len(s['corrupt']):>7} "
                     f"{len(s['non_images']):>10}")
    for split, s in report["splits"].items():
        lines += class_lines(split, s["classes"])
        lines += [f"corrupt   {split}/{shown_name(c['path'])}  ({shown_name(c['error'])})" for c in s["corrupt"]]
        lines += [f"non-image {split}/{shown_name(p)}" for p in s["non_images"]]
    return "\n".join(lines)


def class_lines(split: str, counts: dict) -> list[str]:
    """Readable images per class: every class for small datasets, else the range and the empty ones."""
    if not counts:
        return [f"{split}: no class folders"]
    if len(counts) <= FULL_TABLE_MAX_CLASSES:
        return [f"{split}/{shown_name(name):<24} {n:>8}" for name, n in counts.items()]
    low, high = min(counts, key=counts.get), max(counts, key=counts.get)
    empty = [name for name, n in counts.items() if n == 0]
    return [f"{split}: images per class from {counts[low]} ({shown_name(low)}) to {counts[high]} ({shown_name(high)})"
            + (f"; {len(empty)} class(es) with no readable image, e.g. {shown_name(empty[0])}" if empty else "")]


def shown_name(name: str) -> str:
    """A file name for a line of text: a name that is not UTF-8 (os.listdir's surrogate escapes) with its odd bytes
    written as \\xNN, so that printing it never fails."""
    return name.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


def refuse_names_a_list_cannot_hold(report: dict) -> None:
    """One line naming the first readable image whose name is not UTF-8: a file list is UTF-8 text and the loaders
    read it as such, so the list could name it only wrongly. Checked before any list is written."""
    for split, s in report["splits"].items():
        for rel, _ in s["samples"]:
            if shown_name(rel) != rel:
                raise UserError(f"{split}/{shown_name(rel)}: the file name is not UTF-8 (written on a system with "
                                f"another encoding?), and a file list is UTF-8 text: rename it in UTF-8, e.g. convmv "
                                f"-r -f latin1 -t utf8 --notest {os.path.join(report['root'], split)}, then run "
                                f"check-data again (no file list was written)")


def write_filelist(report: dict, split: str, path: str) -> int:
    """Write ``class/file label`` lines for the split's readable images; returns how many."""
    samples = report["splits"][split]["samples"]
    write_text_atomically(path, "".join(f"{rel} {label}\n" for rel, label in samples))
    return len(samples)

"""ILSVRC2012 as users have it, recognised and listed as jobs: the official archives, the Kaggle tree, and an
extracted tree (val flat with a label file, or already in class folders).

Nothing is extracted here: each source becomes a list of :class:`Job` (one training class, or a chunk of
validation images), each readable on its own by a worker process (``ilsvrc_jobs``). The archives are read where
they are (a member at its offset in the uncompressed tar), never copied.

Class indices are the sorted WNID order (torchvision's ImageFolder and every published checkpoint); the devkit's
``ILSVRC2012_ID`` order is another one and is used only to read its validation ground truth.
"""
from __future__ import annotations

import io
import os
import tarfile
from dataclasses import dataclass, field

from hybridtrain.data.folder import is_image_file
from hybridtrain.data.prepare.flat_val import match_images, read_val_labels
from hybridtrain.errors import UserError

# the published md5 sums of the official archives (torchvision.datasets.imagenet.ARCHIVE_META)
TRAIN_TAR, VAL_TAR, DEVKIT = "ILSVRC2012_img_train.tar", "ILSVRC2012_img_val.tar", "ILSVRC2012_devkit_t12.tar.gz"
ARCHIVE_MD5 = {TRAIN_TAR: "1d675b47d978889d74fa0da5fadfb00e", VAL_TAR: "29b22e2961454d5413ddabcf34fc5622",
               DEVKIT: "fa75699e90414af021442c21a62c3abf"}
FULL_COUNTS = {"train": 1_281_167, "val": 50_000, "classes": 1_000}
KAGGLE_ROOT = os.path.join("ILSVRC", "Data", "CLS-LOC")
VAL_CHUNK = 500  # validation images per job
LAYOUT_HELP = (f"expected one of: the official archives ({TRAIN_TAR}, {VAL_TAR}, {DEVKIT}); the Kaggle tree "
               f"({KAGGLE_ROOT}/train, {KAGGLE_ROOT}/val, LOC_val_solution.csv); or an extracted tree train/<wnid>/ "
               f"with val/ flat (plus its label file, --val-labels) or in class folders")


@dataclass(frozen=True)
class Job:
    """One unit of work: ``kind`` "class-tar" (an inner ``<wnid>.tar`` of the training archive at ``offset``),
    "members" (validation images of an archive: ``items`` = (offset, size, name, wnid)), or "files" (``items`` =
    (path, name, wnid)). ``name`` identifies it for resuming."""
    name: str
    split: str
    kind: str
    archive: str = ""
    offset: int = 0
    size: int = 0
    wnid: str = ""
    items: tuple = ()


@dataclass
class Source:
    """A recognised source: its layout, the jobs, the archives to verify and the bytes it holds."""
    layout: str
    root: str
    jobs: list[Job]
    archives: list[str] = field(default_factory=list)
    wnids: list[str] = field(default_factory=list)  # every class the source knows of (meta / mapping), may be []
    nbytes: int = 0


# ----------------------------------------------------------------------------- detection

def detect_source(root: str, val_labels: str | None = None) -> Source:
    """The source in ``root``, or one line naming what was found and what is expected."""
    if all(os.path.isfile(os.path.join(root, name)) for name in (TRAIN_TAR, VAL_TAR, DEVKIT)):
        return archive_source(root)
    present = [n for n in (TRAIN_TAR, VAL_TAR, DEVKIT) if os.path.isfile(os.path.join(root, n))]
    if present:
        missing = [n for n in (TRAIN_TAR, VAL_TAR, DEVKIT) if n not in present]
        raise UserError(f"--source {root} holds {', '.join(present)} but not {', '.join(missing)}: put all three "
                        f"official archives in that folder (the devkit gives the validation labels)")
    if os.path.isdir(os.path.join(root, KAGGLE_ROOT, "train")):
        return kaggle_source(root)
    if os.path.isdir(os.path.join(root, "train")) and os.path.isdir(os.path.join(root, "val")):
        return tree_source(root, val_labels)
    raise UserError(f"--source {root}: no ImageNet found there: {LAYOUT_HELP}")


# ----------------------------------------------------------------------------- the official archives

def archive_source(root: str) -> Source:
    devkit = os.path.join(root, DEVKIT)
    id_to_wnid, gt_ids = read_devkit(devkit)
    train, val = os.path.join(root, TRAIN_TAR), os.path.join(root, VAL_TAR)
    jobs = [Job(f"train-{m.name[:-4]}", "train", "class-tar", train, m.offset_data, m.size, m.name[:-4])
            for m in tar_members(train) if m.name.endswith(".tar")]
    if not jobs:
        raise UserError(f"{train} holds no <wnid>.tar members: is it the ILSVRC2012 training archive? "
                        f"(re-download it, or check it with its md5)")
    members = sorted((m for m in tar_members(val) if is_image_file(m.name)), key=lambda m: m.name)
    if len(members) != len(gt_ids):
        raise UserError(f"{val} holds {len(members)} images but the devkit's ground truth lists {len(gt_ids)}: both "
                        f"must be the full ILSVRC2012 files (re-download the one that is short)")
    items = [(m.offset_data, m.size, os.path.basename(m.name), label_of(id_to_wnid, i, devkit))
             for m, i in zip(members, gt_ids)]
    jobs += val_jobs(items, "members", val)
    sizes = sum(os.path.getsize(p) for p in (train, val))
    return Source("official archives", root, jobs, [train, val, devkit], sorted(id_to_wnid.values()), sizes)


def label_of(id_to_wnid: dict[int, str], ilsvrc_id: int, devkit: str) -> str:
    if ilsvrc_id not in id_to_wnid:
        raise UserError(f"{devkit}: the validation ground truth names ILSVRC2012_ID {ilsvrc_id}, which is not a leaf "
                        f"synset of its meta.mat: the devkit is damaged (re-download it)")
    return id_to_wnid[ilsvrc_id]


def val_jobs(items: list, kind: str, archive: str = "") -> list[Job]:
    return [Job(f"val-{i // VAL_CHUNK:05d}", "val", kind, archive, items=tuple(items[i:i + VAL_CHUNK]))
            for i in range(0, len(items), VAL_CHUNK)]


def tar_members(path: str) -> list[tarfile.TarInfo]:
    """The members of an uncompressed tar, read header by header (the data is skipped with seeks)."""
    try:
        with tarfile.open(path, "r:") as tar:
            return [m for m in tar if m.isfile()]
    except (tarfile.TarError, OSError) as exc:
        raise UserError(f"cannot read {path} as a tar archive ({exc}): re-download it") from None


def read_devkit(path: str) -> tuple[dict[int, str], list[int]]:
    """(ILSVRC2012_ID -> WNID of the 1,000 leaf synsets, the validation ground truth in file order)."""
    try:
        with tarfile.open(path, "r:gz") as tar:
            files = {os.path.basename(m.name): m for m in tar if m.isfile()}
            if "meta.mat" not in files or "ILSVRC2012_validation_ground_truth.txt" not in files:
                raise UserError(f"{path} has no data/meta.mat or data/ILSVRC2012_validation_ground_truth.txt: is it "
                                f"the ILSVRC2012 devkit (t12)? Re-download it")
            meta = tar.extractfile(files["meta.mat"]).read()
            truth = tar.extractfile(files["ILSVRC2012_validation_ground_truth.txt"]).read().decode()
    except (tarfile.TarError, OSError, EOFError) as exc:
        raise UserError(f"cannot read {path} as a .tar.gz archive ({exc}): re-download it") from None
    return leaf_synsets(meta, path), [int(line) for line in truth.split()]


def leaf_synsets(meta_mat: bytes, where: str) -> dict[int, str]:
    """ILSVRC2012_ID -> WNID of the synsets with no children (the classes) in a devkit's meta.mat."""
    import scipy.io

    try:
        synsets = scipy.io.loadmat(io.BytesIO(meta_mat), squeeze_me=True)["synsets"]
        leaves = {int(s["ILSVRC2012_ID"]): str(s["WNID"]) for s in synsets if int(s["num_children"]) == 0}
    except (ValueError, KeyError, TypeError, IndexError) as exc:
        raise UserError(f"{where}: its meta.mat has no readable synsets ({exc}): re-download the devkit") from None
    if not leaves:
        raise UserError(f"{where}: its meta.mat lists no leaf synsets: re-download the devkit")
    return leaves


# ----------------------------------------------------------------------------- trees of files

def class_file_jobs(train_dir: str) -> tuple[list[Job], int]:
    """One job per training class folder, and the bytes of all their images."""
    jobs, nbytes = [], 0
    for wnid in sorted(d for d in os.listdir(train_dir) if os.path.isdir(os.path.join(train_dir, d))):
        items, size = folder_images(os.path.join(train_dir, wnid), wnid)
        if items:
            jobs.append(Job(f"train-{wnid}", "train", "files", wnid=wnid, items=tuple(items)))
            nbytes += size
    if not jobs:
        raise UserError(f"{train_dir} has no class folders with images: {LAYOUT_HELP}")
    return jobs, nbytes


def folder_images(folder: str, wnid: str) -> tuple[list[tuple], int]:
    items, size = [], 0
    with os.scandir(folder) as entries:
        for entry in sorted(entries, key=lambda e: e.name):
            if is_image_file(entry.name) and entry.is_file():
                items.append((entry.path, entry.name, wnid))
                size += entry.stat().st_size
    return items, size


def flat_val_items(val_dir: str, labels: dict[str, str], labels_file: str) -> tuple[list[tuple], int]:
    files = match_images(val_dir, labels, labels_file)
    items = [(os.path.join(val_dir, files[stem]), files[stem], labels[stem]) for stem in sorted(files)]
    return items, sum(os.path.getsize(path) for path, _, _ in items)


def kaggle_source(root: str) -> Source:
    data = os.path.join(root, KAGGLE_ROOT)
    solution = os.path.join(root, "LOC_val_solution.csv")
    if not os.path.isfile(solution):
        raise UserError(f"--source {root} is a Kaggle tree without LOC_val_solution.csv next to ILSVRC/: put the "
                        f"competition's LOC_val_solution.csv there (it holds the validation labels)")
    jobs, nbytes = class_file_jobs(os.path.join(data, "train"))
    items, val_bytes = flat_val_items(os.path.join(data, "val"), read_val_labels(solution), solution)
    mapping = os.path.join(root, "LOC_synset_mapping.txt")
    wnids = sorted(line.split()[0] for line in open(mapping) if line.strip()) if os.path.isfile(mapping) else []
    return Source("Kaggle tree", root, jobs + val_jobs(items, "files"), [], wnids, nbytes + val_bytes)


def tree_source(root: str, val_labels: str | None) -> Source:
    jobs, nbytes = class_file_jobs(os.path.join(root, "train"))
    val_dir = os.path.join(root, "val")
    if any(os.path.isdir(os.path.join(val_dir, d)) for d in os.listdir(val_dir)):
        val, val_bytes = class_file_jobs(val_dir)
        val = [Job(j.name.replace("train-", "val-", 1), "val", "files", wnid=j.wnid, items=j.items) for j in val]
        return Source("extracted tree, val in class folders", root, jobs + val, [], [], nbytes + val_bytes)
    labels_file = val_labels or find_label_file(root)
    items, val_bytes = flat_val_items(val_dir, read_val_labels(labels_file), labels_file)
    return Source("extracted tree, flat val", root, jobs + val_jobs(items, "files"), [], [], nbytes + val_bytes)


def find_label_file(root: str) -> str:
    for candidate in ("LOC_val_solution.csv", os.path.join("val", "LOC_val_solution.csv"), "val_labels.txt"):
        if os.path.isfile(os.path.join(root, candidate)):
            return os.path.join(root, candidate)
    raise UserError(f"--source {root} has a flat val/ folder and no label file (LOC_val_solution.csv or "
                    f"val_labels.txt next to it): give it with --val-labels FILE ('IMAGE WNID' lines, or Kaggle's "
                    f"LOC_val_solution.csv)")

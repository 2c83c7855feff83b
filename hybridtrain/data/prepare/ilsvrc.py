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
import posixpath
import re
import tarfile
from dataclasses import dataclass, field

from hybridtrain.data.folder import is_image_file, read_text_lines, scan_split
from hybridtrain.data.prepare.flat_val import match_images, read_val_labels
from hybridtrain.data.prepare.names import refuse_member
from hybridtrain.errors import UserError

# the published md5 sums of the official archives (torchvision.datasets.imagenet.ARCHIVE_META)
TRAIN_TAR, VAL_TAR, DEVKIT = "ILSVRC2012_img_train.tar", "ILSVRC2012_img_val.tar", "ILSVRC2012_devkit_t12.tar.gz"
ARCHIVE_MD5 = {TRAIN_TAR: "1d675b47d978889d74fa0da5fadfb00e", VAL_TAR: "29b22e2961454d5413ddabcf34fc5622",
               DEVKIT: "fa75699e90414af021442c21a62c3abf"}
FULL_COUNTS = {"train": 1_281_167, "val": 50_000, "classes": 1_000}
KAGGLE_ROOT = os.path.join("ILSVRC", "Data", "CLS-LOC")
VAL_CHUNK = 500  # validation images per job
WNID = re.compile(r"n\d{8}")  # a WordNet ID: the name of each class folder made from the official archives
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
    nbytes: int = 0
    words: dict[str, str] = field(default_factory=dict)  # WNID -> its words, where the source names them


# ----------------------------------------------------------------------------- detection

def detect_source(root: str, val_labels: str | None = None) -> Source:
    """The source in ``root``, or one line naming what was found and what is expected."""
    present = [n for n in (TRAIN_TAR, VAL_TAR, DEVKIT) if os.path.isfile(os.path.join(root, n))]
    if len(present) == 3:
        if val_labels:
            raise UserError(f"--val-labels {val_labels} does not apply to the official archives in {root}: their "
                            f"validation labels are the devkit's ({DEVKIT}): leave --val-labels out")
        return archive_source(root)
    if present:
        missing = [n for n in (TRAIN_TAR, VAL_TAR, DEVKIT) if n not in present]
        raise UserError(f"--source {root} holds {', '.join(present)} but not {', '.join(missing)}: put all three "
                        f"official archives in that folder (the devkit gives the validation labels)")
    if os.path.isdir(os.path.join(root, KAGGLE_ROOT, "train")):
        return kaggle_source(root, val_labels)
    if os.path.isdir(os.path.join(root, "train")) and os.path.isdir(os.path.join(root, "val")):
        return tree_source(root, val_labels)
    raise UserError(f"--source {root}: no ImageNet found there: {LAYOUT_HELP}")


# ----------------------------------------------------------------------------- the official archives

def archive_source(root: str) -> Source:
    devkit = os.path.join(root, DEVKIT)
    id_to_wnid, gt_ids, words = read_devkit(devkit)
    train, val = os.path.join(root, TRAIN_TAR), os.path.join(root, VAL_TAR)
    classes = set(id_to_wnid.values())
    jobs = []
    for m in tar_members(train):
        wnid = posixpath.basename(m.name).removesuffix(".tar")
        if not m.name.endswith(".tar") or wnid not in classes:
            raise UserError(f"{train}: its member {m.name[:120]!r} is not <wnid>.tar of one of the {len(classes)} "
                            f"classes of the devkit's meta.mat: refused before anything was written (a damaged or "
                            f"re-packed archive? download the original)")
        jobs.append(Job(f"train-{wnid}", "train", "class-tar", train, m.offset_data, m.size, wnid))
    if not jobs:
        raise UserError(f"{train} holds no <wnid>.tar members: is it the ILSVRC2012 training archive? "
                        f"(re-download it, or check it with its md5)")
    members = sorted((m for m in tar_members(val) if is_image_file(m.name)), key=lambda m: m.name)
    if len(members) != len(gt_ids):
        raise UserError(f"{val} holds {len(members)} images but the devkit's ground truth lists {len(gt_ids)}: both "
                        f"must be the full ILSVRC2012 files (re-download the one that is short)")
    items = [(m.offset_data, m.size, posixpath.basename(m.name), label_of(id_to_wnid, i, devkit))
             for m, i in zip(members, gt_ids)]
    trained = {job.wnid for job in jobs}
    for line, (_, _, name, wnid) in enumerate(items, 1):
        if wnid not in trained:
            raise UserError(f"{devkit}: line {line} of its ILSVRC2012_validation_ground_truth.txt gives {name} the "
                            f"class {wnid}, which has no {wnid}.tar in {train}: the archives are not one set (a "
                            f"partial training archive? download it whole)")
    jobs += val_jobs(items, "members", val)
    sizes = sum(os.path.getsize(p) for p in (train, val))
    return Source("official archives", root, jobs, [train, val, devkit], sizes, words)


def label_of(id_to_wnid: dict[int, str], ilsvrc_id: int, devkit: str) -> str:
    if ilsvrc_id not in id_to_wnid:
        raise UserError(f"{devkit}: the validation ground truth names ILSVRC2012_ID {ilsvrc_id}, which is not a leaf "
                        f"synset of its meta.mat: the devkit is damaged (re-download it)")
    return id_to_wnid[ilsvrc_id]


def val_jobs(items: list, kind: str, archive: str = "") -> list[Job]:
    return [Job(f"val-{i // VAL_CHUNK:05d}", "val", kind, archive, items=tuple(items[i:i + VAL_CHUNK]))
            for i in range(0, len(items), VAL_CHUNK)]


def tar_members(path: str) -> list[tarfile.TarInfo]:
    """The file members of an uncompressed tar, read header by header (the data is skipped with seeks); one line
    for a link member or a name that would leave --out (``names.refuse_member``)."""
    try:
        with tarfile.open(path, "r:") as tar:
            members = [m for m in tar if not m.isdir()]
    except (tarfile.TarError, OSError) as exc:
        raise UserError(f"cannot read {path} as a tar archive ({exc}): re-download it") from None
    for m in members:
        refuse_member(path, m)
    return members


def read_devkit(path: str) -> tuple[dict[int, str], list[int], dict[str, str]]:
    """(ILSVRC2012_ID -> WNID of the 1,000 leaf synsets, the validation ground truth in file order, WNID -> the
    synset's words)."""
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
    leaves, words = leaf_synsets(meta, path)
    return leaves, [int(line) for line in truth.split()], words


def leaf_synsets(meta_mat: bytes, where: str) -> tuple[dict[int, str], dict[str, str]]:
    """ILSVRC2012_ID -> WNID of the synsets with no children (the classes) in a devkit's meta.mat, and WNID -> their
    words."""
    import scipy.io

    try:
        synsets = scipy.io.loadmat(io.BytesIO(meta_mat), squeeze_me=True)["synsets"]
        leaves = {int(s["ILSVRC2012_ID"]): str(s["WNID"]) for s in synsets if int(s["num_children"]) == 0}
        words = {str(s["WNID"]): plain_words(str(s["words"])) for s in synsets
                 if int(s["num_children"]) == 0 and "words" in synsets.dtype.names}
    except (ValueError, KeyError, TypeError, IndexError) as exc:
        raise UserError(f"{where}: its meta.mat has no readable synsets ({exc}): re-download the devkit") from None
    if not leaves:
        raise UserError(f"{where}: its meta.mat lists no leaf synsets: re-download the devkit")
    for ilsvrc_id, wnid in leaves.items():
        if not WNID.fullmatch(wnid):
            raise UserError(f"{where}: its meta.mat names the class {wnid[:80]!r} (ILSVRC2012_ID {ilsvrc_id}), which "
                            f"is not a WordNet ID (n and 8 digits, e.g. n01440764) and would name a folder under "
                            f"--out: refused before anything was written (a damaged or crafted devkit: download the "
                            f"original)")
    return leaves, words


def plain_words(text: str) -> str:
    """A synset's words as one line of printable text (they are data: no tab, newline or control character)."""
    return " ".join("".join(c for c in text if c.isprintable() or c.isspace()).split())[:300]


def synset_mapping(root: str) -> dict[str, str]:
    """WNID -> words from Kaggle's LOC_synset_mapping.txt ('n01440764 tench, Tinca tinca' lines) beside the
    source, or {} when it has none."""
    path = os.path.join(root, "LOC_synset_mapping.txt")
    if not os.path.isfile(path):
        return {}
    words = {}
    for line in read_text_lines(path):
        wnid, _, text = line.strip().partition(" ")
        if WNID.fullmatch(wnid) and text.strip():
            words[wnid] = plain_words(text)
    return words


# ----------------------------------------------------------------------------- trees of files

def class_file_jobs(root: str, split: str) -> tuple[list[Job], int]:
    """One job per class folder of ``root/split``, read by the trainer's own scan (``folder.scan_split``: a layout
    it would not read whole is refused here too), and the bytes of all their images."""
    images = scan_split(root, split)
    by_class: dict[int, list[tuple]] = {}
    for path, label in images.samples:
        by_class.setdefault(label, []).append((path, os.path.basename(path), images.classes[label]))
    jobs = [Job(f"{split}-{images.classes[label]}", split, "files", wnid=images.classes[label], items=tuple(items))
            for label, items in sorted(by_class.items())]
    return jobs, sum(os.path.getsize(path) for path, _ in images.samples)


def labelled_val(data: str, labels_file: str, jobs: list[Job]) -> tuple[list[Job], int]:
    """The jobs of the flat ``data/val`` labelled by ``labels_file``; a label naming a class without training images
    (``jobs``) is refused at its line, before any work."""
    labels = read_val_labels(labels_file, ({job.wnid for job in jobs}, os.path.join(data, "train")))
    val_dir = os.path.join(data, "val")
    files = match_images(val_dir, labels, labels_file)
    items = [(os.path.join(val_dir, files[stem]), files[stem], labels[stem]) for stem in sorted(files)]
    return val_jobs(items, "files"), sum(os.path.getsize(path) for path, _, _ in items)


def kaggle_source(root: str, val_labels: str | None) -> Source:
    data = os.path.join(root, KAGGLE_ROOT)
    solution = val_labels or os.path.join(root, "LOC_val_solution.csv")
    if not os.path.isfile(solution):
        raise UserError(f"--source {root} is a Kaggle tree without LOC_val_solution.csv next to ILSVRC/: put the "
                        f"competition's LOC_val_solution.csv there (it holds the validation labels), or give it "
                        f"with --val-labels")
    jobs, nbytes = class_file_jobs(data, "train")
    val, val_bytes = labelled_val(data, solution, jobs)
    return Source("Kaggle tree", root, jobs + val, [], nbytes + val_bytes, synset_mapping(root))


def tree_source(root: str, val_labels: str | None) -> Source:
    jobs, nbytes = class_file_jobs(root, "train")
    val_dir = os.path.join(root, "val")
    if any(os.path.isdir(os.path.join(val_dir, d)) for d in os.listdir(val_dir)):
        if val_labels:
            raise UserError(f"--val-labels {val_labels} does not apply: {val_dir} is already in class folders, "
                            f"which are its labels: leave --val-labels out (or, to relabel it, give val/ flat)")
        val, val_bytes = class_file_jobs(root, "val")
        extra = sorted({job.wnid for job in val} - {job.wnid for job in jobs})
        if extra:
            raise UserError(f"{len(extra)} class folder(s) of {val_dir} have no training images in "
                            f"{os.path.join(root, 'train')} (first: {extra[0]}): is it the validation set of this "
                            f"training set? Add the class's training images, or move {os.path.join(val_dir, extra[0])} "
                            f"out of {val_dir}")
        return Source("extracted tree, val in class folders", root, jobs + val, [], nbytes + val_bytes,
                      synset_mapping(root))
    labels_file = val_labels or find_label_file(root)
    val, val_bytes = labelled_val(root, labels_file, jobs)
    return Source("extracted tree, flat val", root, jobs + val, [], nbytes + val_bytes, synset_mapping(root))


def find_label_file(root: str) -> str:
    for candidate in ("LOC_val_solution.csv", os.path.join("val", "LOC_val_solution.csv"), "val_labels.txt"):
        if os.path.isfile(os.path.join(root, candidate)):
            return os.path.join(root, candidate)
    raise UserError(f"--source {root} has a flat val/ folder and no label file (LOC_val_solution.csv or "
                    f"val_labels.txt next to it): give it with --val-labels FILE ('IMAGE WNID' lines, or Kaggle's "
                    f"LOC_val_solution.csv)")

"""Crafted and damaged data: ``hybridtrain prepare-data imagenet`` given crafted archives,
devkits and label files writes nothing outside ``--out`` and refuses in one line naming the member; no image is
dropped without a word (the trainer's scan and prepare-data read a layout alike); a damaged inner tar, a full or
read-only disk and a link to nowhere are named as what they are; an option that does not apply is refused or used.
Real ``hybridtrain`` processes on tar and ``.mat`` files made here; a small tmpfs and a read-only bind mount in a
private mount namespace (root and ``unshare``; skipped elsewhere)."""
from __future__ import annotations

import io
import os
import shutil
import subprocess
import tarfile

import numpy as np
import pytest
from conftest import HYBRIDTRAIN, assert_one_error_line, env_with_venv, run
from PIL import Image

from hybridtrain.data.folder import scan_split
from hybridtrain.data.prepare.ilsvrc import detect_source
from hybridtrain.data.prepare.imagenet import check_free_space, output_bytes, prepare_imagenet
from hybridtrain.errors import UserError

CLASSES = ["n01440764", "n01443537"]
VAL = ["ILSVRC2012_val_00000001.JPEG", "ILSVRC2012_val_00000002.JPEG"]  # one per class, in CLASSES order


def jpeg(seed: int, size=(40, 30), quality: int = 90) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(buf, "JPEG", quality=quality)
    return buf.getvalue()


def link(name: str, target: str, hard: bool = False) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = (tarfile.LNKTYPE if hard else tarfile.SYMTYPE), target
    return info


def tar_bytes(entries: list, path=None) -> bytes:
    """A tar of ``entries``: (name, bytes) files and TarInfo links, names written as given (none is cleaned)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as tar:
        for entry in entries:
            if isinstance(entry, tarfile.TarInfo):
                tar.addfile(entry)
            else:
                info = tarfile.TarInfo(entry[0])
                info.size = len(entry[1])
                tar.addfile(info, io.BytesIO(entry[1]))
    if path is not None:
        open(path, "wb").write(buf.getvalue())
    return buf.getvalue()


def meta_mat(wnids: list[str]) -> bytes:
    import scipy.io
    names = ["ILSVRC2012_ID", "WNID", "words", "gloss", "num_children", "children", "wordnet_height",
             "num_train_images"]
    synsets = np.zeros((len(wnids), 1), dtype=[(n, "O") for n in names])
    for k, wnid in enumerate(wnids):
        synsets[k, 0] = (k + 1, wnid, "words", "gloss", 0, np.zeros((1, 0)), 0, 2)
    buf = io.BytesIO()
    scipy.io.savemat(buf, {"synsets": synsets})
    return buf.getvalue()


def archives(src, train_extra=(), inner_extra=(), val_extra=(), wnids=CLASSES, inner=None) -> str:
    """The three official archives of a 2-class ILSVRC2012 in ``src``, with crafted members added: ``train_extra``
    to the training archive, ``inner_extra`` to the first class tar (or ``inner``: its bytes), ``val_extra`` to the
    validation archive; ``wnids``: the devkit's classes."""
    os.makedirs(src)
    classes = []
    for c, wnid in enumerate(CLASSES):
        members = [(f"{wnid}_{i}.JPEG", jpeg(10 * c + i)) for i in range(2)] + list(inner_extra if c == 0 else ())
        classes.append((f"{wnid}.tar", inner if (c == 0 and inner is not None) else tar_bytes(members)))
    tar_bytes(classes + list(train_extra), os.path.join(src, "ILSVRC2012_img_train.tar"))
    tar_bytes([(name, jpeg(100 + n)) for n, name in enumerate(VAL)] + list(val_extra),
              os.path.join(src, "ILSVRC2012_img_val.tar"))
    with tarfile.open(os.path.join(src, "ILSVRC2012_devkit_t12.tar.gz"), "w:gz") as tar:
        for name, data in (("data/meta.mat", meta_mat(list(wnids))),
                           ("data/ILSVRC2012_validation_ground_truth.txt", b"1\n2\n")):
            info = tarfile.TarInfo(f"ILSVRC2012_devkit_t12/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return str(src)


def tree(src, labels: str | None = "val_labels.txt", label_lines: str | None = None) -> str:
    """An extracted tree: train/<wnid>/ and a flat val/ with its label file (``label_lines`` replaces it)."""
    for c, wnid in enumerate(CLASSES):
        os.makedirs(os.path.join(src, "train", wnid))
        for i in range(2):
            open(os.path.join(src, "train", wnid, f"{wnid}_{i}.JPEG"), "wb").write(jpeg(10 * c + i))
    os.makedirs(os.path.join(src, "val"))
    for n, name in enumerate(VAL):
        open(os.path.join(src, "val", name), "wb").write(jpeg(100 + n))
    if labels:
        text = "".join(f"{name} {wnid}\n" for name, wnid in zip(VAL, CLASSES)) if label_lines is None else label_lines
        open(os.path.join(src, labels), "w").write(text)
    return str(src)


def everything(root) -> set[str]:
    """Every path under ``root`` (links not followed)."""
    return {os.path.relpath(os.path.join(folder, name), root) for folder, dirs, files in os.walk(root)
            for name in dirs + files}


def prepare(source, out, *options: str) -> subprocess.CompletedProcess:
    return run([HYBRIDTRAIN, "prepare-data", "imagenet", "--source", str(source), "--out", str(out), "--workers", "1",
                *options], timeout=120)


# ----------------------------------------------------------------------------- 1. nothing is written outside --out

def crafted(case: str, absolute: str) -> tuple[dict, list[str]]:
    """The archives' arguments of each crafted case, and the words its one line holds (``absolute``: where an
    absolute member name points)."""
    one = tar_bytes([("x.JPEG", jpeg(1))])
    return {
        "class tar ../x.tar": (dict(train_extra=[("../x.tar", one)]),
                               ["ILSVRC2012_img_train.tar", "'../x.tar'", "climbs out", "--out"]),
        "class tar absolute": (dict(train_extra=[(f"{absolute}/n01440764.tar", one)]),
                               ["ILSVRC2012_img_train.tar", f"{absolute}/n01440764.tar", "absolute path"]),
        "class tar not a class": (dict(train_extra=[("n99999999.tar", one)]),
                                  ["'n99999999.tar' is not <wnid>.tar of one of the 2 classes"]),
        "symlink in the training archive": (dict(train_extra=[link("n01443537.tar", "/etc/passwd")]),
                                            ["'n01443537.tar' is a symbolic link (to /etc/passwd)", "never followed"]),
        "hard link in the val archive": (dict(val_extra=[link("ILSVRC2012_val_00000003.JPEG", VAL[0], hard=True)]),
                                         ["ILSVRC2012_img_val.tar", "a hard link", "never followed"]),
        "val image ../evil.JPEG": (dict(val_extra=[("../evil.JPEG", jpeg(3))]),
                                   ["ILSVRC2012_img_val.tar", "'../evil.JPEG' climbs out"]),
        "image ../../evil.JPEG in a class tar": (dict(inner_extra=[("../../evil.JPEG", jpeg(4))]),
                                                 ["n01440764.tar", "'../../evil.JPEG' climbs out"]),
        "symlink in a class tar": (dict(inner_extra=[link("n01440764_9.JPEG", "../../../../evil.JPEG")]),
                                   ["n01440764.tar", "'n01440764_9.JPEG' is a symbolic link", "never followed"]),
        "WNID ../../x in meta.mat": (dict(wnids=["../../x", CLASSES[1]]),
                                     ["meta.mat names the class '../../x'", "not a WordNet ID", "devkit"]),
    }[case]


CRAFTED = ["class tar ../x.tar", "class tar absolute", "class tar not a class", "symlink in the training archive",
           "hard link in the val archive", "val image ../evil.JPEG", "image ../../evil.JPEG in a class tar",
           "symlink in a class tar", "WNID ../../x in meta.mat"]


@pytest.mark.parametrize("case", CRAFTED)
def test_a_crafted_archive_is_refused_naming_the_member_and_nothing_lands_outside_out(case, tmp_path):
    absolute = str(tmp_path / "abs")
    kwargs, words = crafted(case, absolute)
    src = archives(tmp_path / "src", **kwargs)
    out = tmp_path / "deep" / "er" / "out"  # '../../x' from a class folder would land in tmp_path/deep
    before = everything(tmp_path)
    for options in (["--no-md5"], []):  # md5 or not: the names are checked first, whatever md5 says
        line = assert_one_error_line(prepare(src, out, *options), *words)
        assert "a bug" not in line
        outside = {p for p in everything(tmp_path) - before if not p.startswith(os.path.join("deep", "er", "out"))}
        assert outside <= {"deep", os.path.join("deep", "er")}, outside  # out's own parents (mkdir -p)
        assert not os.path.lexists(absolute) and not (tmp_path / "evil.JPEG").exists()
        assert not out.exists() or not [p for p in everything(out) if p.endswith(".partial")]
        if "class tar" in case and "in a class tar" not in case:
            continue
        break  # once is enough for the rest


def test_labels_naming_a_class_that_leaves_out_or_has_no_training_images_are_refused_at_their_line(tmp_path):
    bad = f"{VAL[0]} {CLASSES[0]}\n{VAL[1]} ../../x\n"
    src = tree(tmp_path / "flat", label_lines=bad)
    before = everything(tmp_path)
    assert_one_error_line(prepare(src, tmp_path / "a" / "out"), "val_labels.txt line 2", "'../../x'",
                          "holds a path separator")
    kaggle = tmp_path / "kaggle" / "ILSVRC" / "Data" / "CLS-LOC"
    tree(kaggle, labels=None)
    csv = "ImageId,PredictionString\n" + "".join(f"{n[:-5]},{w} 1 2 3 4\n" for n, w in zip(VAL, ["/abs", "n0"]))
    (tmp_path / "kaggle" / "LOC_val_solution.csv").write_text(csv)
    assert_one_error_line(prepare(tmp_path / "kaggle", tmp_path / "a" / "out"), "LOC_val_solution.csv line 2",
                          "'/abs'", "absolute path")
    assert everything(tmp_path) - before <= {"a", *everything(tmp_path / "kaggle")} | {"kaggle"} | {
        os.path.join("kaggle", p) for p in everything(tmp_path / "kaggle")}
    # a class with no training images: refused at its line before the long work, not after it
    (tmp_path / "flat" / "val_labels.txt").write_text(f"{VAL[0]} {CLASSES[0]}\n{VAL[1]} n09999999\n")
    line = assert_one_error_line(prepare(src, tmp_path / "b"), "val_labels.txt line 2", "'n09999999' has no training "
                                 "images", os.path.join(src, "train"))
    assert "--val-labels" not in line and not (tmp_path / "b").exists()


def test_a_link_inside_out_that_leads_outside_is_not_followed(tmp_path):
    src = tree(tmp_path / "src")
    out, elsewhere = tmp_path / "out", tmp_path / "elsewhere"
    first = prepare(src, out)
    assert first.returncode == 0, first.stderr
    shutil.rmtree(out / "train")
    os.remove(out / ".hybridtrain-prepare" / "complete.json")
    for name in os.listdir(out / ".hybridtrain-prepare" / "done"):
        os.remove(out / ".hybridtrain-prepare" / "done" / name)
    elsewhere.mkdir()
    os.symlink(elsewhere, out / "train")  # planted: a resumed run would write the training classes there
    assert_one_error_line(prepare(src, out), str(out / "train" / CLASSES[0]), f"leads to {elsewhere}",
                          "outside --out")
    assert os.listdir(elsewhere) == []


# ----------------------------------------------------------------------------- 2. no image dropped without a word

@pytest.mark.parametrize("layout", ["loose images beside val class folders", "a class's images one folder down"])
def test_a_layout_not_read_whole_is_refused_alike_by_prepare_data_and_the_trainers_scan(layout, tmp_path):
    src = tmp_path / "src"
    tree(src, labels=None)
    if layout.startswith("loose"):  # a sorting script stopped after the first image
        os.makedirs(src / "val" / CLASSES[0])
        os.rename(src / "val" / VAL[0], src / "val" / CLASSES[0] / VAL[0])
        split, words = "val", ["1 image(s) lie directly in", f"first: {VAL[1]}", "mv ", "keeping every image"]
    else:
        os.makedirs(src / "train" / CLASSES[1] / "extra")
        for i in range(3):
            open(src / "train" / CLASSES[1] / "extra" / f"{i}.JPEG", "wb").write(jpeg(50 + i))
        split, words = "train", ["has 2 images directly in it, but 3 in its subfolder(s)", "e.g. extra/0.JPEG",
                                 "mv "]
    line = assert_one_error_line(prepare(src, tmp_path / "out"), *words)
    with pytest.raises(UserError) as trainer:
        scan_split(str(src), split)
    assert line == f"hybridtrain: error: {trainer.value}"  # one function: the same line
    assert not (tmp_path / "out").exists()


# ----------------------------------------------------------------------------- 4. a damaged inner tar

@pytest.mark.parametrize("damage", ["cut short", "not a tar"])
def test_a_damaged_class_tar_names_it_and_the_archive(damage, tmp_path):
    whole = tar_bytes([(f"{CLASSES[0]}_{i}.JPEG", jpeg(i, size=(200, 150))) for i in range(3)])
    inner = whole[:len(whole) // 2] if damage == "cut short" else b"this is not a tar " * 100
    src = archives(tmp_path / "src", inner=inner)
    out = tmp_path / "out"
    line = assert_one_error_line(prepare(src, out, "--no-md5", "--workers", "2"),  # raised in a pool's worker
                                 f"its member {CLASSES[0]}.tar is not a whole tar",
                                 os.path.join(src, "ILSVRC2012_img_train.tar"), "download it again")
    assert "bug" not in line
    assert not [p for p in everything(out) if p.endswith(".partial")]


# ----------------------------------------------------------------------------- 5. true numbers and causes

def in_namespace(mount: str, script: str, *cmd: str) -> subprocess.CompletedProcess:
    """``cmd`` in a private mount namespace after ``mount`` (a shell line using $D), then ``script`` (also $D)."""
    if shutil.which("unshare") is None or os.geteuid() != 0:
        pytest.skip("needs root and unshare to mount a tmpfs or a read-only bind mount")
    probe = subprocess.run(["unshare", "-m", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"mount namespaces are not allowed here: {probe.stderr.decode()[:200]}")
    shell = f'{mount} || exit 97; "$0" "$@"; rc=$?; {script}; exit $rc'
    proc = subprocess.run(["unshare", "-m", "sh", "-c", shell, *cmd], capture_output=True, text=True, timeout=120,
                          env=env_with_venv(1), stdin=subprocess.DEVNULL)
    if proc.returncode == 97:
        pytest.skip(f"mount is not permitted here: {proc.stderr[:200]}")
    return proc


def test_free_space_is_shown_in_the_unit_that_shows_the_numbers():
    for free, needed, words in ((1.5e6, 3.2e6, "1.5 MB free and the output needs about 3.2 MB"),
                                (0.4e9, 2e9, "400.0 MB free and the output needs about 2.0 GB"),
                                (2e3, 9e5, "2.0 kB free and the output needs about 900.0 kB")):
        with pytest.raises(UserError, match=words):
            check_free_space("/tmp", needed, free=free)


FULL_LATER = """
import os, shutil
if os.environ.get("HT_FREE_SPACE_LIE") and not os.environ.get("HT_LIED"):
    os.environ["HT_LIED"] = "1"  # the command's own process only, not its workers
    _usage = shutil.disk_usage
    shutil.disk_usage = lambda path: _usage(path)._replace(free=10**12)
"""


def test_a_disk_that_fills_mid_run_is_named_with_its_path_and_leaves_no_partial_file(tmp_path):
    """A 256 kB tmpfs and a source of ~1.3 MB: the command's free-space check is told there is room (as when
    another writer fills the disk after it), so the disk fills while images are written."""
    src = tmp_path / "src"
    tree(src)
    for c, wnid in enumerate(CLASSES):
        for i in range(16):
            open(src / "train" / wnid / f"big_{i}.JPEG", "wb").write(jpeg(1000 + 16 * c + i, size=(200, 150)))
    probe = tmp_path / "probe"
    probe.mkdir()
    (probe / "sitecustomize.py").write_text(FULL_LATER)
    disk = tmp_path / "disk"
    disk.mkdir()
    listing = tmp_path / "left.txt"
    proc = in_namespace(f"mount -t tmpfs -o size=256k tmpfs {disk}", f"find {disk} -name '*.partial' > {listing}",
                        "env", f"PYTHONPATH={probe}", "HT_FREE_SPACE_LIE=1", HYBRIDTRAIN, "prepare-data", "imagenet",
                        "--source", str(src), "--out", str(disk / "out"), "--workers", "2")
    assert_one_error_line(proc, f"{disk}/out/", "No space left on device", "the disk is full")
    assert listing.read_text() == ""


def test_a_read_only_file_system_is_called_that_and_a_link_to_nowhere_a_link(tmp_path):
    src = tree(tmp_path / "src")
    target = tmp_path / "ro"
    target.mkdir()
    proc = in_namespace(f"mount --bind {target} {target} && mount -o remount,bind,ro {target}", "true",
                        HYBRIDTRAIN, "prepare-data", "imagenet", "--source", src, "--out", str(target / "imagenet"))
    line = assert_one_error_line(proc, "is on a read-only file system", "remount it read-write")
    assert "permission" not in line
    os.symlink(tmp_path / "gone", tmp_path / "dangling")
    for option, path in (("--out", tmp_path / "dangling"), ("--out", tmp_path / "dangling" / "sub"),
                         ("--source", tmp_path / "dangling")):
        args = {"source": src, "out": tmp_path / "o", option[2:]: path}
        line = assert_one_error_line(prepare(args["source"], args["out"]), f"{option} {path}",
                                     f"symbolic link to {tmp_path / 'gone'}, which does not exist")
        assert "is a file" not in line
    assert not (tmp_path / "gone").exists()


def test_a_resize_estimate_allows_for_reencoded_files_growing(tmp_path):
    """Small, coarse JPEGs (quality 20) are re-encoded at quality 90 by --resize 256, which keeps their size:
    the copies are larger than the source, and the estimate says so before the work."""
    src = tmp_path / "src"
    tree(src)
    for folder, _, names in os.walk(src):
        for name in names:
            if name.endswith(".JPEG"):
                open(os.path.join(folder, name), "wb").write(jpeg(hash(name) % 1000, size=(120, 90), quality=20))
    source = detect_source(str(src))
    estimate = output_bytes(source, 256)
    out = tmp_path / "out"
    prepare_imagenet(str(src), str(out), resize=256, workers=1)
    written = sum(os.path.getsize(os.path.join(f, n)) for split in ("train", "val")
                  for f, _, names in os.walk(out / split) for n in names)
    assert written > source.nbytes * 1.5 and estimate >= written, (source.nbytes, written, estimate)


# ----------------------------------------------------------------------------- 6. options are used or refused

def test_an_option_that_does_not_apply_to_the_source_is_refused_or_used(tmp_path):
    labels = tmp_path / "labels.txt"
    labels.write_text("".join(f"{n} {w}\n" for n, w in zip(VAL, CLASSES)))
    src = archives(tmp_path / "archives")
    assert_one_error_line(prepare(src, tmp_path / "a", "--no-md5", "--val-labels", str(labels)),
                          "--val-labels", "does not apply to the official archives", "devkit")
    sorted_val = tmp_path / "sorted"
    tree(sorted_val, labels=None)
    for n, wnid in zip(VAL, CLASSES):
        os.makedirs(sorted_val / "val" / wnid)
        os.rename(sorted_val / "val" / n, sorted_val / "val" / wnid / n)
    assert_one_error_line(prepare(sorted_val, tmp_path / "b", "--val-labels", str(labels)),
                          "--val-labels", "already in class folders", "leave --val-labels out")
    kaggle = tmp_path / "kaggle"
    tree(kaggle / "ILSVRC" / "Data" / "CLS-LOC", labels=None)  # no LOC_val_solution.csv: the given file is used
    swapped = tmp_path / "swapped.txt"
    swapped.write_text("".join(f"{n} {w}\n" for n, w in zip(VAL, CLASSES[::-1])))
    used = prepare(kaggle, tmp_path / "c", "--val-labels", str(swapped), "--no-md5")
    assert used.returncode == 0, used.stderr
    assert os.listdir(tmp_path / "c" / "val" / CLASSES[1]) == [VAL[0]]  # the given labels, not another file's
    assert "--no-md5 had nothing to skip" in used.stdout


def test_the_sample_audit_keeps_an_untrusted_host_name_inside_run_dir(tmp_path, monkeypatch):
    """The audit file is named after the host, and a host's name is any bytes Linux takes ('/' and '..' included):
    the file stays in run_dir/samples, and a write lands there."""
    import socket

    from hybridtrain.config import load_config
    from hybridtrain.engine.records import SampleAudit, audit_path
    cfg = load_config(None, [f"run_dir={tmp_path / 'run'}", "elastic.audit_samples=true"])
    monkeypatch.setattr(socket, "gethostname", lambda: "../../outside/x")
    path = audit_path(cfg)
    samples = os.path.join(cfg.run_dir, "samples")
    assert os.path.dirname(path) == samples and os.path.basename(path) == f"_.._outside_x-{os.getpid()}.jsonl"
    SampleAudit(path).write(0, type("Topo", (), {"size": 1, "rank": 0})())
    assert os.listdir(samples) == [os.path.basename(path)] and not (tmp_path / "outside").exists()

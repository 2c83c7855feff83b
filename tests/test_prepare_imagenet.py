"""``prepare-data imagenet`` on a miniature ILSVRC2012 made here in its three forms (the official archives with a
real devkit meta.mat, the Kaggle tree, an extracted tree with a flat val folder): the folder layout, verified and
resumable, the resized copy, and the tar shards read by both backends (in-process partitions, then real 2-rank
trainings). Real ``hybridtrain`` processes for the command line; DALI's CPU pipelines for real."""
from __future__ import annotations

import io
import json
import os
import shutil
import signal
import subprocess
import tarfile
import time

import numpy as np
import pytest
from conftest import (
    HYBRIDTRAIN,
    assert_one_error_line,
    env_with_venv,
    horovodrun,
    read_metrics,
    run,
    tiny_config,
    torchrun,
)
from PIL import Image
from torchvision.datasets.imagenet import ARCHIVE_META

from hybridtrain.data.prepare.imagenet import check_free_space, file_md5, prepare_imagenet, verify_md5
from hybridtrain.errors import UserError

# 12 leaf classes; their ILSVRC2012_IDs follow this (unsorted) order, so the devkit's order is not the WNID order
LEAVES = ["n04592741", "n01440764", "n09999999", "n02105855", "n03000134", "n01530575",
          "n07714571", "n02085620", "n04044716", "n01443537", "n06359193", "n03888257"]
NON_LEAVES = ["n00001740", "n00021939", "n02084071"]  # synsets with children: not classes
TRAIN_PER_CLASS, VAL_PER_CLASS = 6, 2
PNG_AS_JPEG = ("n02105855", 2)  # ImageNet's n02105855_2933.JPEG is a PNG
CMYK = ("n03000134", 1)  # and ~22 training images are CMYK JPEGs


def picture(wnid: str, i: int) -> Image.Image:
    c = LEAVES.index(wnid)
    size = (48, 64) if i % 3 == 0 else (64, 48)
    rng = np.random.default_rng([c, i])
    pixels = np.clip(rng.normal(20 * c, 40, (size[1], size[0], 3)), 0, 255).astype(np.uint8)
    return Image.fromarray(pixels, "RGB")


def encoded(wnid: str, i: int) -> bytes:
    buf = io.BytesIO()
    img = picture(wnid, i)
    if (wnid, i) == PNG_AS_JPEG:
        img.save(buf, "PNG")
    elif (wnid, i) == CMYK:
        img.convert("CMYK").save(buf, "JPEG", quality=90)
    else:
        img.save(buf, "JPEG", quality=90)
    return buf.getvalue()


def val_truth() -> list[str]:
    """The class of ILSVRC2012_val_00000001, _02, ...: classes interleaved in a seeded order."""
    labels = [w for w in LEAVES for _ in range(VAL_PER_CLASS)]
    return [labels[i] for i in np.random.default_rng(7).permutation(len(labels))]


def val_name(n: int) -> str:
    return f"ILSVRC2012_val_{n + 1:08d}.JPEG"


def add_bytes(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def meta_mat() -> bytes:
    import scipy.io
    names = ["ILSVRC2012_ID", "WNID", "words", "gloss", "num_children", "children", "wordnet_height",
             "num_train_images"]
    synsets = np.zeros((len(LEAVES) + len(NON_LEAVES), 1), dtype=[(n, "O") for n in names])
    for k, wnid in enumerate(LEAVES + NON_LEAVES):
        leaf = k < len(LEAVES)
        synsets[k, 0] = (k + 1, wnid, f"words {wnid}", "gloss", 0 if leaf else 3,
                         np.zeros((1, 0)) if leaf else np.array([[1, 2, 3]]), 0 if leaf else 2,
                         TRAIN_PER_CLASS if leaf else 0)
    buf = io.BytesIO()
    scipy.io.savemat(buf, {"synsets": synsets})
    return buf.getvalue()


def make_archives(src) -> str:
    os.makedirs(src)
    with tarfile.open(os.path.join(src, "ILSVRC2012_img_train.tar"), "w") as outer:
        for wnid in LEAVES:
            inner = io.BytesIO()
            with tarfile.open(fileobj=inner, mode="w") as tar:
                for i in range(TRAIN_PER_CLASS):
                    add_bytes(tar, f"{wnid}_{i}.JPEG", encoded(wnid, i))
            add_bytes(outer, f"{wnid}.tar", inner.getvalue())
    counters = {w: 0 for w in LEAVES}
    with tarfile.open(os.path.join(src, "ILSVRC2012_img_val.tar"), "w") as tar:
        for n, wnid in enumerate(val_truth()):
            add_bytes(tar, val_name(n), encoded(wnid, 100 + counters[wnid]))
            counters[wnid] += 1
    truth = "".join(f"{LEAVES.index(w) + 1}\n" for w in val_truth())  # ILSVRC2012_IDs
    with tarfile.open(os.path.join(src, "ILSVRC2012_devkit_t12.tar.gz"), "w:gz") as tar:
        add_bytes(tar, "ILSVRC2012_devkit_t12/data/meta.mat", meta_mat())
        add_bytes(tar, "ILSVRC2012_devkit_t12/data/ILSVRC2012_validation_ground_truth.txt", truth.encode())
    return str(src)


def write_tree(train_dir, val_dir) -> None:
    for wnid in LEAVES:
        os.makedirs(os.path.join(train_dir, wnid))
        for i in range(TRAIN_PER_CLASS):
            open(os.path.join(train_dir, wnid, f"{wnid}_{i}.JPEG"), "wb").write(encoded(wnid, i))
    os.makedirs(val_dir)
    counters = {w: 0 for w in LEAVES}
    for n, wnid in enumerate(val_truth()):
        open(os.path.join(val_dir, val_name(n)), "wb").write(encoded(wnid, 100 + counters[wnid]))
        counters[wnid] += 1


def make_kaggle(src) -> str:
    data = os.path.join(src, "ILSVRC", "Data", "CLS-LOC")
    write_tree(os.path.join(data, "train"), os.path.join(data, "val"))
    rows = [f"{val_name(n)[:-5]},{w} 10 10 40 40 {w} 5 5 20 20" for n, w in enumerate(val_truth())]
    open(os.path.join(src, "LOC_val_solution.csv"), "w").write("ImageId,PredictionString\n" + "\n".join(rows) + "\n")
    open(os.path.join(src, "LOC_synset_mapping.txt"), "w").write("".join(f"{w} words\n" for w in LEAVES))
    return str(src)


def make_flat_tree(src) -> str:
    write_tree(os.path.join(src, "train"), os.path.join(src, "val"))
    lines = "".join(f"{val_name(n)} {w}\n" for n, w in enumerate(val_truth()))
    open(os.path.join(src, "labels.txt"), "w").write(lines)
    return str(src)


def tree_files(root) -> dict[str, bytes]:
    """Every file of the layout the trainer reads (train/, val/, classes.txt), by relative path."""
    files = {"classes.txt": open(os.path.join(root, "classes.txt"), "rb").read()}
    for split in ("train", "val"):
        for folder, _, names in os.walk(os.path.join(root, split)):
            for name in names:
                path = os.path.join(folder, name)
                files[os.path.relpath(path, root)] = open(path, "rb").read()
    return files


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, str]:
    base = tmp_path_factory.mktemp("ilsvrc")
    return {"archives": make_archives(base / "archives"), "kaggle": make_kaggle(base / "kaggle"),
            "flat": make_flat_tree(base / "flat")}


@pytest.fixture(scope="module")
def prepared(sources, tmp_path_factory) -> str:
    """The archives prepared by the real command (md5 off: these are not the published archives)."""
    out = str(tmp_path_factory.mktemp("prepared") / "imagenet")
    proc = run([HYBRIDTRAIN, "prepare-data", "imagenet", "--source", sources["archives"], "--out", out, "--no-md5",
                "--workers", "2", "--shards", "4"], timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "72 train / 24 val images, 12 classes: a subset: ILSVRC2012 has 1,281,167 / 50,000 / 1,000" in proc.stdout
    assert f"train/{PNG_AS_JPEG[0]}/{PNG_AS_JPEG[0]}_{PNG_AS_JPEG[1]}.JPEG PNG-RGB" in proc.stdout
    assert f"train/{CMYK[0]}/{CMYK[0]}_{CMYK[1]}.JPEG JPEG-CMYK" in proc.stdout
    assert "4 train / 4 val tar files" in proc.stdout
    return out


def test_the_archives_give_sorted_classes_true_val_labels_and_only_rgb_jpegs(prepared):
    assert open(os.path.join(prepared, "classes.txt")).read().split() == sorted(LEAVES)  # not the ILSVRC2012_ID order
    # the devkit's words of each class, kept for hybridtrain classify
    assert open(os.path.join(prepared, "synset_words.txt")).read() == "".join(f"{w} words {w}\n" for w in sorted(LEAVES))
    for n, wnid in enumerate(val_truth()):
        assert os.path.isfile(os.path.join(prepared, "val", wnid, val_name(n))), (n, wnid)
    files = tree_files(prepared)
    assert len([f for f in files if f.startswith("train/")]) == 72 and len([f for f in files if f.startswith("val/")]) == 24
    for rel, data in files.items():
        if rel != "classes.txt":
            with Image.open(io.BytesIO(data)) as img:
                assert (img.format, img.mode) == ("JPEG", "RGB"), rel
    kept = os.path.join("train", LEAVES[0], f"{LEAVES[0]}_1.JPEG")  # an RGB JPEG is copied byte for byte
    assert files[kept] == encoded(LEAVES[0], 1)
    assert sorted(open(os.path.join(prepared, "rewritten.txt")).read().split()[::2]) == sorted(
        f"train/{w}/{w}_{i}.JPEG" for w, i in (PNG_AS_JPEG, CMYK))


@pytest.mark.parametrize("form, labels", [("kaggle", None), ("flat", "labels.txt"), ("class-folder val", None)])
def test_the_kaggle_tree_and_extracted_trees_give_the_same_tree(form, labels, sources, prepared, tmp_path):
    source = prepared if form == "class-folder val" else sources[form]  # a prepared tree is an extracted one
    out = str(tmp_path / "out")
    summary = prepare_imagenet(source, out, workers=1, val_labels=labels and os.path.join(source, labels))
    assert (summary["train"], summary["val"], summary["classes"], summary["full"]) == (72, 24, 12, False)
    assert tree_files(out) == tree_files(prepared)
    if form == "kaggle":  # its LOC_synset_mapping.txt's words
        assert open(os.path.join(out, "synset_words.txt")).read() == "".join(f"{w} words\n" for w in sorted(LEAVES))


def test_an_md5_mismatch_is_one_line_naming_the_file_both_sums_and_no_md5(sources, tmp_path):
    out = tmp_path / "out"
    proc = run([HYBRIDTRAIN, "prepare-data", "imagenet", "--source", sources["archives"], "--out", str(out)])
    devkit = os.path.join(sources["archives"], "ILSVRC2012_devkit_t12.tar.gz")
    line = assert_one_error_line(proc, "--no-md5")
    named = [p for p in os.listdir(sources["archives"]) if p in line]
    assert len(named) == 1 and file_md5(os.path.join(sources["archives"], named[0])) in line
    assert ARCHIVE_META[{"ILSVRC2012_img_train.tar": "train", "ILSVRC2012_img_val.tar": "val"}.get(
        named[0], "devkit")][1] in line  # the published sum, as torchvision has it
    assert not out.exists()
    # the published sum of the right file passes (the sum from md5sum, not from our own code)
    mine = subprocess.run(["md5sum", devkit], capture_output=True, text=True, check=True).stdout.split()[0]
    verify_md5([devkit], 1, {os.path.basename(devkit): mine})


def test_a_killed_prepare_resumes_to_the_same_tree_and_never_shows_half_an_image(sources, prepared, tmp_path):
    """The source's 10th val image is a named pipe: the val job blocks there, deterministically, after the training
    jobs finished and 9 val images were written; the whole process group is killed, the pipe replaced by the
    image, and the same command continues."""
    source = tmp_path / "source"
    shutil.copytree(sources["flat"], source)
    blocker = source / "val" / val_name(9)
    image = blocker.read_bytes()
    blocker.unlink()
    os.mkfifo(blocker)
    out = str(tmp_path / "out")
    cmd = [HYBRIDTRAIN, "prepare-data", "imagenet", "--source", str(source), "--out", out, "--workers", "2",
           "--val-labels", str(source / "labels.txt")]
    proc = subprocess.Popen(cmd, env=env_with_venv(1), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True)
    done = os.path.join(out, ".hybridtrain-prepare", "done")
    deadline = time.monotonic() + 120
    while (val_written(out) < 9 or records(done) < 12) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)  # the command, its forkserver and its workers
    assert proc.wait() == -signal.SIGKILL, proc.stderr.read().decode()
    assert val_written(out) == 9 and records(done) == 12 and not os.path.exists(os.path.join(out, "classes.txt"))
    for folder, _, names in os.walk(out):
        for name in names:
            if name.endswith(".JPEG"):  # what the trainer would read: whole images only
                with Image.open(os.path.join(folder, name)) as img:
                    img.load()
    blocker.unlink()
    blocker.write_bytes(image)
    again = run(cmd, timeout=300)
    assert again.returncode == 0, again.stderr
    assert "continued a stopped run: 12 of 13 jobs were done" in again.stdout
    assert tree_files(out) == tree_files(prepared)


def test_a_killed_pack_keeps_its_finished_shards_and_resumes_to_the_same_shards(sources, prepared, tmp_path):
    """``--shards 4 --workers 1`` packs the training shards in order; a probe (sitecustomize) makes opening the 5th
    image of shard 2 hang, so the pack stops there, deterministically, after shards 0 and 1 are whole (a named
    pipe cannot do it: the scan skips what is not a regular file); the process group is killed and the same
    command, without the probe, continues: shards 0 and 1 are kept (the same files), and the result is byte for
    byte the uninterrupted pack."""
    from hybridtrain.data.folder import scan_dataset
    from hybridtrain.data.prepare.pack_shards import shard_plan
    out = tmp_path / "imagenet"
    shutil.copytree(prepared, out, ignore=lambda folder, names: ["shards"] if folder == prepared else [])
    train, _ = scan_dataset(str(out))
    probe, hanging = tmp_path / "probe", tmp_path / "hanging"
    probe.mkdir()
    (probe / "sitecustomize.py").write_text(HANG_ON_OPEN)
    env = dict(env_with_venv(1), PYTHONPATH=str(probe), HANG_ON_OPEN=train.samples[shard_plan(72, 4, True)[2][4]][0],
               HANG_MARK=str(hanging))
    cmd = [HYBRIDTRAIN, "prepare-data", "imagenet", "--source", sources["archives"], "--out", str(out), "--no-md5",
           "--workers", "1", "--shards", "4"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    deadline = time.monotonic() + 120
    while not hanging.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL, proc.stderr.read().decode()
    partial = out / "shards.partial" / "train"
    assert sorted(p.name for p in partial.glob("*.tar")) == ["000000.tar", "000001.tar"]
    assert (partial / "000002.tar.tmp").exists() and not (out / "shards").exists()  # half a tar, out of the way
    kept = ("000000.tar", "000001.tar", "000000.idx")
    for name in kept:  # a second link to each finished file: the same file afterwards means it was kept
        os.link(partial / name, tmp_path / name)
    again = run(cmd, timeout=300)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "4 train / 4 val tar files" in again.stdout
    assert "continuing a stopped pack: 2 of 8 shards were finished and are kept" in again.stdout
    assert all(os.path.samefile(tmp_path / name, out / "shards" / "train" / name) for name in kept)
    assert not (out / "shards.partial").exists()
    assert tree_bytes(out / "shards") == tree_bytes(os.path.join(prepared, "shards"))


HANG_ON_OPEN = """
import builtins, os, time
_open, _path, _mark = builtins.open, os.environ["HANG_ON_OPEN"], os.environ["HANG_MARK"]
def _hanging_open(file, *args, **kwargs):
    if isinstance(file, str) and file == _path:
        _open(_mark, "w").close()
        time.sleep(3600)
    return _open(file, *args, **kwargs)
builtins.open = _hanging_open
"""


def tree_bytes(root) -> dict[str, bytes]:
    return {os.path.relpath(os.path.join(folder, name), root): open(os.path.join(folder, name), "rb").read()
            for folder, _, names in os.walk(root) for name in names}


def records(done: str) -> int:
    return len([n for n in os.listdir(done) if n.endswith(".json")]) if os.path.isdir(done) else 0


def val_written(out: str) -> int:
    return sum(len([n for n in names if not n.startswith(".")]) for _, _, names in os.walk(os.path.join(out, "val")))


def test_resize_writes_copies_with_the_given_shorter_side(sources, tmp_path):
    out = str(tmp_path / "out")
    summary = prepare_imagenet(sources["kaggle"], out, resize=40, workers=1)
    assert summary["rewritten"] and (summary["train"], summary["val"]) == (72, 24)
    for rel, data in tree_files(out).items():
        if rel != "classes.txt":
            with Image.open(io.BytesIO(data)) as img:
                assert min(img.size) == 40 and max(img.size) == 53 and (img.format, img.mode) == ("JPEG", "RGB"), rel


def test_bad_sources_and_outputs_are_one_line(sources, tmp_path):
    def refused(source, out, *needles):
        proc = run([HYBRIDTRAIN, "prepare-data", "imagenet", "--source", str(source), "--out", str(out), "--no-md5"])
        return assert_one_error_line(proc, *needles)

    partial = tmp_path / "partial"
    partial.mkdir()
    os.symlink(os.path.join(sources["archives"], "ILSVRC2012_img_train.tar"), partial / "ILSVRC2012_img_train.tar")
    refused(partial, tmp_path / "a", "ILSVRC2012_img_val.tar", "ILSVRC2012_devkit_t12.tar.gz")
    refused(tmp_path, tmp_path / "b", "no ImageNet found", "Kaggle", "official archives")
    users = tmp_path / "users"
    users.mkdir()
    (users / "holiday.jpg").write_bytes(b"the user's photo")
    line = refused(sources["kaggle"], users, "not empty", "new or empty folder")
    assert "rm " not in line and "delete" not in line and "remove" not in line
    assert (users / "holiday.jpg").read_bytes() == b"the user's photo"
    with pytest.raises(UserError, match=r"1\.0 GB free .* about 2\.0 GB.*--resize 160"):
        check_free_space(str(tmp_path), 2e9, free=1e9)


def test_an_out_of_other_settings_is_refused_and_a_finished_one_is_kept(sources, prepared):
    before = tree_files(prepared)
    with pytest.raises(UserError, match=r"other settings \(resize: resize=None\).*same options to continue"):
        prepare_imagenet(sources["archives"], prepared, md5=False, resize=40)
    assert prepare_imagenet(sources["archives"], prepared, md5=False)["resumed"] == "complete"
    assert tree_files(prepared) == before


# ----------------------------------------------------------------------------- tar shards, both backends

def shard_loaders(data: str, backend: str, rank: int, world_size: int = 2, batch: int = 8):
    from hybridtrain.config import config_from_dict
    from hybridtrain.data.loaders import create_loaders
    from hybridtrain.distributed.topology import Topology
    loading = {"in_process": True} if backend == "torchvision" else {"workers": 1}
    cfg = config_from_dict({"seed": 3, "data": {"path": data, "backend": backend, "crop_size": 32, "val_resize": 32,
                                                "hflip": False, **loading}, "train": {"batch_size": batch}})
    return create_loaders(cfg, Topology(rank, world_size, rank, world_size))


def epoch_batches(loader, epoch: int) -> list[tuple]:
    loader.batch_sampler.set_epoch(epoch)
    return [(images, labels, indices) for images, labels, indices in loader]


def test_shards_hold_every_image_under_its_folder_index(prepared):
    from hybridtrain.data.folder import scan_dataset
    from hybridtrain.data.shards import scan_shards
    folders, shards = scan_dataset(prepared), scan_shards(os.path.join(prepared, "shards"))
    for tree, packed in zip(folders, shards):
        assert packed.classes == tree.classes and len(packed) == len(tree)
        for i, (path, label) in enumerate(tree.samples):
            assert packed.open(i).read() == open(path, "rb").read() and packed.samples[i][1] == label
    names = [m for m in tarfile.open(shards[0].shard_paths[0]).getnames()]
    assert names[:2] == [names[0][:-4] + ".jpg", names[0][:-4] + ".cls"] and len(names) == 2 * 18


def expected_keys(backend: str, rank: int, epoch: int, n: int = 72, ranks: int = 2, batch: int = 8) -> list[list]:
    """Each batch's sample keys, in plain NumPy: the epoch's permutation of all n samples by (seed 3, epoch), and the
    rank's part of it: DALI's (folder form) the rank's contiguous range [r*n/k, (r+1)*n/k), torchvision's
    the rank's slice of each global batch; both run n // (k*b) full steps."""
    order = np.random.default_rng([3, epoch]).permutation(n)
    steps = n // (ranks * batch)
    if backend == "dali_cpu":
        mine = order[rank * n // ranks:(rank + 1) * n // ranks]
        return [mine[s * batch:(s + 1) * batch].tolist() for s in range(steps)]
    return [order[(s * ranks + rank) * batch:(s * ranks + rank + 1) * batch].tolist() for s in range(steps)]


@pytest.mark.parametrize("backend", ["torchvision", "dali_cpu"])
def test_both_backends_read_the_shards_in_their_folder_forms_exact_order(backend, prepared):
    """Sample by sample, each backend reads the shards in the order it reads the folders: the same (seed, epoch)
    permutation, rank slice, steps and drops; DALI's folder form cuts the epoch's order into contiguous rank
    ranges, torchvision's into the ranks' slices of each global batch."""
    shards = os.path.join(prepared, "shards")
    ranks = [shard_loaders(shards, backend, r) for r in range(2)]
    folders = [shard_loaders(prepared, backend, r) for r in range(2)]
    labels = {i: label for i, (_, label) in enumerate(scan_shards_train(shards))}
    orders = []
    for epoch in range(2):
        per_rank = [epoch_batches(r.train, epoch) for r in ranks]
        assert len(per_rank[0]) == len(per_rank[1]) == ranks[0].steps_per_epoch == 4  # equal steps, full batches
        seen = [int(i) for batches in per_rank for _, _, idx in batches for i in idx]
        assert len(seen) == len(set(seen)) == 64 == 72 - ranks[0].dropped_per_epoch
        assert all(int(lab) == labels[int(i)] for b in per_rank for _, ls, idx in b for lab, i in zip(ls, idx))
        for rank, (batches, folder) in enumerate(zip(per_rank, folders)):
            assert [idx.tolist() for _, _, idx in batches] == expected_keys(backend, rank, epoch)
            from_folders = epoch_batches(folder.train, epoch)
            assert [(ls.tolist(), idx.tolist()) for _, ls, idx in batches] == [
                (ls.tolist(), idx.tolist()) for _, ls, idx in from_folders]
            if backend == "torchvision" and epoch == 0:  # the same pixels too (DALI's crops draw other seeds)
                assert all((a == b).all() for (a, _, _), (b, _, _) in zip(batches, from_folders))
        orders.append(seen)
    assert orders[0] != orders[1] and set(orders[0][:32]) != set(orders[1][:32]), "the same order in both epochs"
    for _ in range(2):  # DALI's validation pipeline serves every pass: it starts its list again
        val = [epoch_batches(r.val, 0) for r in ranks]
        assert [int(i) for batches in val for _, _, idx in batches for i in idx] == list(range(24))
    images = {int(i): img for batches in val for imgs, _, idx in batches for img, i in zip(imgs, idx)}
    for imgs, _, idx in epoch_batches(folders[0].val, 0):  # validation decodes the same pixels from both forms
        assert all((images[int(i)] == img).all() for img, i in zip(imgs, idx))


def test_a_cls_member_that_disagrees_with_the_manifest_is_one_line(prepared, tmp_path):
    shards = str(tmp_path / "shards")
    shutil.copytree(os.path.join(prepared, "shards"), shards)
    with open(os.path.join(shards, "shards.json")) as fh:
        meta = json.load(fh)
    meta["train"]["labels"] = [(label + 1) % 12 for label in meta["train"]["labels"]]
    with open(os.path.join(shards, "shards.json"), "w") as fh:
        json.dump(meta, fh)
    with pytest.raises(UserError, match=r"\.cls says class \d+ and shards\.json \d+: the shards are damaged"):
        epoch_batches(shard_loaders(shards, "dali_cpu", 0).train, 0)


def scan_shards_train(shards: str):
    from hybridtrain.data.shards import scan_shards
    return scan_shards(shards)[0].samples


def test_two_ranks_train_from_the_shards_on_both_backends(prepared, tmp_path, write_config):
    """DALI's external_source reader under horovodrun, the torchvision reader under torchrun (the torch engine), in a
    spawned loader worker per loader (the shards' open files are per process)."""
    shards = os.path.join(prepared, "shards")
    sections = dict(train={"epochs": 1, "batch_size": 8}, optim={"warmup_epochs": 0.5})
    for backend, launch in (("dali_cpu", horovodrun), ("torchvision", torchrun)):
        run_dir = str(tmp_path / backend)
        data = {"backend": backend, "workers": 1}  # DALI: 1 thread; torchvision: 1 worker process
        cfg = write_config(tiny_config(shards, run_dir, data=data, **sections), f"{backend}.yaml")
        proc = launch(2, ["train", "--config", cfg], timeout=300)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        (record,) = read_metrics(run_dir)
        assert record["samples_seen"] == 4 * 2 * 8 and record["val_count"] == 24, (backend, record)

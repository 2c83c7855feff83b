"""``prepare-data imagenet --shards N``: the prepared folder tree packed into WebDataset-style tar shards.

``OUT/shards/{train,val}/NNNNNN.tar``, each sample two members ``KEY.jpg`` (the image's bytes) and ``KEY.cls``
(its class index, ASCII), where KEY is the sample's index in the split's folder order (sorted classes, sorted
names: the order ``data.folder.scan_split`` gives), so a sample keeps one identity in both forms. Beside each tar
its index ``NNNNNN.idx`` (DALI's wds2idx format v1.2: every member's data offset and size), which the readers of
both backends use instead of scanning the tars; ``OUT/shards/shards.json`` holds the shards' sample counts and
the labels; ``OUT/shards/classes.txt`` the classes.

Training samples are spread over the shards by a seeded permutation, so every shard mixes all classes (the
readers of both backends read samples in a per-epoch global order, not shard by shard; a mixed shard still
suits readers that do); validation stays in order.

Resumable: the shards are written under ``OUT/shards.partial/`` by worker processes, each tar under a temporary
name and renamed once it and its index are whole, and the folder moves into place when all are done. A killed
pack, run again with the same tree and N, keeps ``OUT/shards.partial/`` (its ``plan.json`` says which tree and N
it holds) and skips every shard whose tar has the size its samples give and whose index lists them; a different
plan starts again.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import tarfile

import numpy as np

from hybridtrain.data.folder import scan_dataset
from hybridtrain.data.prepare.ilsvrc_jobs import write_atomically
from hybridtrain.data.prepare.imagenet import check_free_space, run_all
from hybridtrain.data.prepare.names import inside
from hybridtrain.data.sharding import split_sizes
from hybridtrain.data.shards import parse_index
from hybridtrain.errors import UserError
from hybridtrain.files import PARTIAL_MARKER, finish_partial, start_partial

PACK_SEED = 0
INDEX_VERSION = "v1.2"
PLAN = "plan.json"  # in OUT/shards.partial/: the plan its finished shards belong to
BLOCK = 512  # tar's block size; Python's tarfile ends an archive with two zero blocks and pads it to RECORD bytes
RECORD = 20 * BLOCK


def shard_plan(n: int, shards: int, shuffle: bool) -> list[np.ndarray]:
    """The sample indices of each shard: a seeded permutation (training) or the order (validation), cut evenly."""
    order = np.random.default_rng(PACK_SEED).permutation(n) if shuffle else np.arange(n)
    bounds = np.cumsum([0] + split_sizes(n, shards))
    return [order[a:b] for a, b in zip(bounds[:-1], bounds[1:])]


def write_shard(job: tuple) -> int:
    """One tar and its index (in a worker); the members carry fixed metadata, so shards are reproducible."""
    path, samples, width = job
    tmp = path + ".tmp"
    with tarfile.open(tmp, "w", format=tarfile.USTAR_FORMAT) as tar:
        for index, image, label in samples:
            key = f"{index:0{width}d}"
            for name, data in ((f"{key}.jpg", open(image, "rb").read()), (f"{key}.cls", str(label).encode())):
                info = tarfile.TarInfo(name)
                info.size, info.mode, info.mtime = len(data), 0o444, 0
                tar.addfile(info, io.BytesIO(data))
    write_index(tmp, path[:-4] + ".idx")
    os.replace(tmp, path)
    return len(samples)


def member_bytes(size: int) -> int:
    """A USTAR member's bytes in a tar: its header block and its data padded to whole blocks."""
    return BLOCK + -(-size // BLOCK) * BLOCK


def shard_is_whole(job: tuple, size_of: dict[str, int]) -> bool:
    """True when the job's tar and index are in place and hold its samples: the tar has the size they give and the
    index lists their keys with their image sizes, in order."""
    path, samples, _ = job
    idx = path[:-4] + ".idx"
    if not (os.path.isfile(path) and os.path.isfile(idx)):
        return False
    sizes = [size_of[image] for _, image, _ in samples]
    body = sum(member_bytes(size) + member_bytes(len(str(label))) for size, (_, _, label) in zip(sizes, samples))
    if os.path.getsize(path) != -(-(body + 2 * BLOCK) // RECORD) * RECORD:
        return False
    try:
        listed = [(key, size) for key, _, size, _, _ in parse_index(idx)]
    except (UserError, ValueError, IndexError):
        return False
    return listed == [(index, size) for (index, _, _), size in zip(samples, sizes)]


def write_index(tar_path: str, idx_path: str) -> None:
    """DALI's index of a WebDataset tar: per sample, per member 'ext data-offset size name'."""
    samples: dict[str, list[str]] = {}
    with tarfile.open(tar_path, "r:") as tar:
        for m in tar:
            key, _, ext = m.name.partition(".")
            samples.setdefault(key, []).append(f"{ext} {m.offset_data} {m.size} {m.name}")
    lines = [f"{INDEX_VERSION} {len(samples)}"] + [" ".join(parts) for parts in samples.values()]
    write_atomically(idx_path, ("\n".join(lines) + "\n").encode())


def pack_shards(tree: str, shards: int, workers: int = 0) -> dict:
    """``tree/shards/`` from ``tree`` (the prepared folder layout); returns where and how many."""
    train, val = scan_dataset(tree)
    if shards > len(train):
        raise UserError(f"--shards {shards} is more than the {len(train)} training images: give at most "
                        f"{len(train)} (a shard of a few thousand images, ~0.1-1 GB, suits parallel file systems)")
    out = os.path.join(tree, "shards")
    done = os.path.join(out, "shards.json")
    if os.path.isfile(done):
        with open(done) as fh:
            meta = json.load(fh)
        if len(meta["train"]["shards"]) != shards:
            raise UserError(f"{out} already holds {len(meta['train']['shards'])} train shards, not {shards}: use "
                            f"them (data.path={out}), or move that folder away to pack anew")
        return {"root": out, "train_shards": shards, "val_shards": len(meta["val"]["shards"])}
    size_of = {path: os.path.getsize(path) for split in (train, val) for path, _ in split.samples}
    jobs, meta = [], {"classes": train.classes}
    for split, images, count, shuffle in (("train", train, shards, True), ("val", val, min(shards, len(val)), False)):
        width = max(6, len(str(max(0, len(images) - 1))))  # the digits of a key
        plan = shard_plan(len(images), count, shuffle)
        meta[split] = {"shards": [[f"{s:06d}.tar", len(p)] for s, p in enumerate(plan)],
                       "labels": [label for _, label in images.samples]}
        jobs += [(os.path.join(split, f"{s:06d}.tar"), [(int(i), *images.samples[i]) for i in p], width)
                 for s, p in enumerate(plan)]
    tmp, kept = resume_partial(out, plan_digest(tree, jobs), sum(size_of.values()))
    jobs = [(os.path.join(tmp, rel), samples, width) for rel, samples, width in jobs]
    todo = [job for job in jobs if not (kept and shard_is_whole(job, size_of))]
    if kept:
        print(f"continuing a stopped pack: {len(jobs) - len(todo)} of {len(jobs)} shards were finished and are kept",
              flush=True)
    todo.sort(key=lambda job: -len(job[1]))
    run_all(write_shard, todo, workers or os.cpu_count() or 1, "shards", "tar")
    shutil.copyfile(os.path.join(tree, "classes.txt"), os.path.join(tmp, "classes.txt"))
    write_atomically(os.path.join(tmp, "shards.json"), json.dumps(meta).encode())
    os.unlink(os.path.join(tmp, PLAN))
    finish_partial(tmp, out)
    return {"root": out, "train_shards": len(meta["train"]["shards"]), "val_shards": len(meta["val"]["shards"])}


def plan_digest(tree: str, jobs: list) -> str:
    """Which samples each shard holds (key, image path in the tree, label); their sizes are each finished shard's
    check (``shard_is_whole``)."""
    h = hashlib.sha256()
    for rel, samples, width in jobs:
        rows = [(index, os.path.relpath(image, tree), label) for index, image, label in samples]
        h.update(json.dumps([rel, width, rows]).encode())
    return h.hexdigest()


def resume_partial(out: str, digest: str, images_bytes: int) -> tuple[str, bool]:
    """``OUT/shards.partial/`` and whether it is a stopped pack of this plan (its finished shards are kept);
    otherwise it starts empty (``start_partial``), after a free-space check."""
    tmp = inside(os.path.dirname(out), os.path.normpath(out) + ".partial")
    plan = os.path.join(tmp, PLAN)
    if os.path.isfile(os.path.join(tmp, PARTIAL_MARKER)) and os.path.isfile(plan):
        with open(plan) as fh:
            if json.load(fh).get("digest") == digest:
                return tmp, True
    check_free_space(out, images_bytes * 1.02)  # + tar headers and the indices
    tmp = start_partial(out, "--out")
    for split in ("train", "val"):
        os.makedirs(os.path.join(tmp, split))
    write_atomically(plan, json.dumps({"digest": digest}).encode())
    return tmp, False

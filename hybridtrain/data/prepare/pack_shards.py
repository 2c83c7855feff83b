"""``prepare-data imagenet --shards N``: the prepared folder tree packed into WebDataset-style tar shards.

``OUT/shards/{train,val}/NNNNNN.tar``, each sample two members ``KEY.jpg`` (the image's bytes) and ``KEY.cls``
(its class index, ASCII), where KEY is the sample's index in the split's folder order (sorted classes, sorted
names: the order ``data.folder.scan_split`` gives), so a sample keeps one identity in both forms. Beside each tar
its index ``NNNNNN.idx`` (DALI's wds2idx format v1.2: every member's data offset and size), which the readers of
both backends use instead of scanning the tars; ``OUT/shards/shards.json`` holds the shards' sample counts and
the labels; ``OUT/shards/classes.txt`` the classes.

Training samples are spread over the shards by a seeded permutation, so every shard mixes all classes (the
DALI reader shuffles whole shards and then within a buffer); validation stays in order. The shards are written
under ``OUT/shards.partial/`` by worker processes and moved into place when all are done.
"""
from __future__ import annotations

import json
import os
import shutil
import tarfile

import numpy as np
from tqdm import tqdm

from hybridtrain.data.folder import scan_dataset
from hybridtrain.data.prepare.ilsvrc_jobs import write_atomically
from hybridtrain.data.prepare.imagenet import check_free_space, pool
from hybridtrain.data.sharding import split_sizes
from hybridtrain.errors import UserError
from hybridtrain.outputs import finish_partial, start_partial

PACK_SEED = 0
INDEX_VERSION = "v1.2"


def key_width(n: int) -> int:
    return max(6, len(str(max(0, n - 1))))


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
                tar.addfile(info, _Bytes(data))
    write_index(tmp, path[:-4] + ".idx")
    os.replace(tmp, path)
    return len(samples)


class _Bytes:
    def __init__(self, data: bytes):
        self.data, self.pos = data, 0

    def read(self, n: int = -1) -> bytes:
        end = len(self.data) if n < 0 else self.pos + n
        chunk, self.pos = self.data[self.pos:end], min(end, len(self.data))
        return chunk


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
    images_bytes = sum(os.path.getsize(path) for split in (train, val) for path, _ in split.samples)
    check_free_space(out, images_bytes * 1.02)  # + tar headers and the indices
    tmp = start_partial(out, "--out")
    jobs, meta = [], {"classes": train.classes}
    for split, images, count, shuffle in (("train", train, shards, True), ("val", val, min(shards, len(val)), False)):
        os.makedirs(os.path.join(tmp, split))
        width = key_width(len(images))
        plan = shard_plan(len(images), count, shuffle)
        meta[split] = {"shards": [[f"{s:06d}.tar", len(p)] for s, p in enumerate(plan)],
                       "labels": [label for _, label in images.samples]}
        jobs += [(os.path.join(tmp, split, f"{s:06d}.tar"), [(int(i), *images.samples[i]) for i in p], width)
                 for s, p in enumerate(plan)]
    jobs.sort(key=lambda job: -len(job[1]))
    run_packing(jobs, workers or os.cpu_count() or 1)
    shutil.copyfile(os.path.join(tree, "classes.txt"), os.path.join(tmp, "classes.txt"))
    write_atomically(os.path.join(tmp, "shards.json"), json.dumps(meta).encode())
    finish_partial(tmp, out)
    return {"root": out, "train_shards": len(meta["train"]["shards"]), "val_shards": len(meta["val"]["shards"])}


def run_packing(jobs: list, workers: int) -> None:
    bar = tqdm(total=len(jobs), desc="shards", unit="tar", disable=None)
    if workers == 1:
        for job in jobs:
            write_shard(job)
            bar.update()
    else:
        with pool(min(workers, len(jobs))) as p:
            for _ in p.imap_unordered(write_shard, jobs, chunksize=1):
                bar.update()
    bar.close()

"""WebDataset-style tar shards (``prepare-data imagenet --shards``) as a dataset: ``data.path`` = the shards folder.

The folder holds ``{train,val}/NNNNNN.tar`` with their DALI indices ``NNNNNN.idx``, ``shards.json`` (sample counts
and labels) and ``classes.txt``; a sample's key is its index in the folder order it was packed from.

:class:`ShardImages` is an :class:`ImageList` whose samples are tar members: each is read with one ``pread`` at
its offset from the index (no tar scanning, no file per image, which is what parallel file systems want). So the
torchvision backend reads shards through its own map-style dataset and sampler, with exactly the folder form's
sharding by global rank and per-epoch global shuffle (``sharding.train_batches``). We chose this over the
``webdataset`` package's IterableDataset: that one shuffles shards and then within a buffer, splits by node and
worker itself (so equal steps per rank and each sample once per epoch are no longer given), cannot start an epoch
at an offset (elastic resizes) and would be a new dependency. The DALI backend reads the same files with
``fn.readers.webdataset`` (``dali_shards``).
"""
from __future__ import annotations

import io
import json
import os
from dataclasses import dataclass, field

import numpy as np

from hybridtrain.data.folder import ImageList
from hybridtrain.errors import UserError

MANIFEST = "shards.json"
_OPEN: dict[str, int] = {}  # tar path -> file descriptor, per process (each loader worker opens its own)


def is_shard_dir(root: str) -> bool:
    return os.path.isfile(os.path.join(root, MANIFEST))


def read_member(path: str, offset: int, size: int) -> bytes:
    fd = _OPEN.get(path)
    if fd is None:
        fd = _OPEN[path] = os.open(path, os.O_RDONLY)
    return os.pread(fd, size, offset)


@dataclass
class ShardImages(ImageList):
    """A split of tar shards: ``samples[i]`` = ("TAR:KEY.jpg", label) and ``members[i]`` = (shard, offset, size) of
    sample i's image; ``shard_paths``/``index_paths``/``shard_counts`` per shard, in their file order."""
    shard_paths: list[str] = field(default_factory=list)
    index_paths: list[str] = field(default_factory=list)
    shard_counts: list[int] = field(default_factory=list)
    members: np.ndarray = None

    def open(self, index: int):
        shard, offset, size = self.members[index]
        return io.BytesIO(read_member(self.shard_paths[shard], int(offset), int(size)))


def parse_index(path: str) -> list[tuple[int, int, int]]:
    """(key, data offset, size) of each sample's .jpg in a wds2idx index (v1.2)."""
    with open(path) as fh:
        header, *lines = fh.read().splitlines()
    if not header.startswith("v1.2 "):
        raise UserError(f"{path} is not a WebDataset index (v1.2): pack the shards again with prepare-data "
                        f"imagenet --shards")
    found = []
    for line in lines:
        parts = line.split()
        for ext, offset, size, name in zip(parts[0::4], parts[1::4], parts[2::4], parts[3::4]):
            if ext == "jpg":
                found.append((int(name.split(".")[0]), int(offset), int(size)))
    return found


def scan_shard_split(root: str, split: str, meta: dict) -> ShardImages:
    folder = os.path.join(root, split)
    labels = meta[split]["labels"]
    members = np.full((len(labels), 3), -1, dtype=np.int64)
    paths, indices, counts = [], [], []
    for shard, (name, count) in enumerate(meta[split]["shards"]):
        tar, idx = os.path.join(folder, name), os.path.join(folder, name[:-4] + ".idx")
        if not (os.path.isfile(tar) and os.path.isfile(idx)):
            raise UserError(f"{root} lists {split}/{name} in {MANIFEST} but it or its .idx is missing: copy the whole "
                            f"shards folder again")
        for key, offset, size in parse_index(idx):
            members[key] = (shard, offset, size)
        paths.append(tar)
        indices.append(idx)
        counts.append(count)
    if (members[:, 0] < 0).any():
        raise UserError(f"{root}/{split}: sample {int(np.argmax(members[:, 0] < 0))} is in no shard's index: pack the "
                        f"shards again")
    samples = [(f"{paths[s]}:{i}.jpg", label) for i, (s, label) in enumerate(zip(members[:, 0].tolist(), labels))]
    return ShardImages(folder, list(meta["classes"]), samples, [], paths, indices, counts, members)


def scan_shards(root: str) -> tuple[ShardImages, ShardImages]:
    with open(os.path.join(root, MANIFEST)) as fh:
        meta = json.load(fh)
    return scan_shard_split(root, "train", meta), scan_shard_split(root, "val", meta)

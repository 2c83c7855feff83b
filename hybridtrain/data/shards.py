"""WebDataset-style tar shards (``prepare-data imagenet --shards``) as a dataset: ``data.path`` = the shards folder.

The folder holds ``{train,val}/NNNNNN.tar`` with their DALI indices ``NNNNNN.idx``, ``shards.json`` (sample counts
and labels) and ``classes.txt``; a sample's key is its index in the folder order it was packed from.

:class:`ShardImages` is an :class:`ImageList` whose samples are tar members: each is read with one ``pread`` at
its offset from the index (no tar scanning, no file per image, which is what parallel file systems want). So both
backends read shards as a map-style dataset, in exactly the folder form's order (sharding by global rank, a
per-epoch global shuffle): the torchvision backend through its own sampler (``sharding.train_batches``), DALI
through ``fn.external_source`` fed in its folder form's order (``dali_shards``). We chose this over the
``webdataset`` package's IterableDataset and DALI's ``fn.readers.webdataset``: both shuffle shards and then within
a buffer, so the per-sample global permutation, equal steps per rank with each sample once per epoch, and an
order that is a pure function of (seed, epoch) are no longer given (and the package would be a new dependency).
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
    """A split of tar shards: ``samples[i]`` = ("TAR:KEY.jpg", label) and ``members[i]`` = (shard, offset, size of
    the .jpg, offset, size of the .cls) of sample i; ``shard_paths``: the shards' tars, in their file order."""
    shard_paths: list[str] = field(default_factory=list)
    members: np.ndarray = None

    def open(self, index: int):
        return io.BytesIO(self.read_image(index))

    def read_image(self, index: int) -> bytes:
        """Sample ``index``'s encoded image (its .jpg member)."""
        shard, offset, size = self.members[index, :3].tolist()
        return read_member(self.shard_paths[shard], offset, size)

    def read_class(self, index: int) -> int:
        """Sample ``index``'s class as its .cls member says (the manifest's is ``samples[index][1]``)."""
        shard, _, _, offset, size = self.members[index].tolist()
        text = read_member(self.shard_paths[shard], offset, size)
        if not text.strip().isdigit():
            raise UserError(f"{self.samples[index][0]}: its .cls member holds {text[:20]!r}, not a class index: the "
                            f"shards are damaged: pack them again", same_on_all_ranks=False)
        return int(text)


def parse_index(path: str) -> list[tuple[int, int, int, int, int]]:
    """(key, data offset, size of its .jpg, data offset, size of its .cls) of each sample in a wds2idx index (v1.2);
    -1 for a member the sample lacks."""
    with open(path) as fh:
        header, *lines = fh.read().splitlines()
    if not header.startswith("v1.2 "):
        raise UserError(f"{path} is not a WebDataset index (v1.2): pack the shards again with prepare-data "
                        f"imagenet --shards")
    found = []
    for line in lines:
        parts = line.split()
        at = {ext: (int(offset), int(size)) for ext, offset, size in zip(parts[0::4], parts[1::4], parts[2::4])}
        key = int(parts[3].split(".")[0])
        found.append((key, *at.get("jpg", (-1, -1)), *at.get("cls", (-1, -1))))
    return found


def scan_shard_split(root: str, split: str, meta: dict) -> ShardImages:
    folder = os.path.join(root, split)
    labels = meta[split]["labels"]
    members = np.full((len(labels), 5), -1, dtype=np.int64)
    paths = []
    for shard, (name, _) in enumerate(meta[split]["shards"]):
        tar, idx = os.path.join(folder, name), os.path.join(folder, name[:-4] + ".idx")
        if not (os.path.isfile(tar) and os.path.isfile(idx)):
            raise UserError(f"{root} lists {split}/{name} in {MANIFEST} but it or its .idx is missing: copy the whole "
                            f"shards folder again")
        for key, *at in parse_index(idx):
            members[key] = (shard, *at)
        paths.append(tar)
    if (members < 0).any():
        raise UserError(f"{root}/{split}: sample {int(np.argmax((members < 0).any(axis=1)))} is in no shard's index "
                        f"or lacks its .jpg or .cls: pack the shards again")
    samples = [(f"{paths[s]}:{i}.jpg", label) for i, (s, label) in enumerate(zip(members[:, 0].tolist(), labels))]
    return ShardImages(folder, list(meta["classes"]), samples, [], paths, members)


def scan_shards(root: str) -> tuple[ShardImages, ShardImages]:
    with open(os.path.join(root, MANIFEST)) as fh:
        meta = json.load(fh)
    return scan_shard_split(root, "train", meta), scan_shard_split(root, "val", meta)

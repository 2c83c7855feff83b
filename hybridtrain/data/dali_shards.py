"""The DALI backends on tar shards (``prepare-data imagenet --shards``): ``fn.readers.webdataset`` feeding the same
decode-and-augment graph as the folder form (``dali.decode_and_augment``).

Sharding by global rank, and a global reshuffle every epoch identical on all ranks, as the folder form's, one level
up: the epoch's order is the shards permuted by (``seed``, epoch), and rank r reads the shards
[floor(r·S/k), floor((r+1)·S/k)) of it (``dali.shard_range`` over shards), so the ranks' subsets change every
epoch and still partition the data. Within its shards a rank's reader shuffles through a buffer
(``random_shuffle``, ``initial_fill``) seeded per (seed, rank, epoch). A sample-level global permutation (the
folder form's) is not possible with this reader: it reads each tar's samples in its index's order, so it would
need an index per sample. The torchvision backend reads the same shards with the folder form's exact order
(``data.shards``).

Equal steps: shards differ by at most one sample and each rank holds floor(S/k) or ceil(S/k) of them, so every
rank can fill ``steps`` = (the floor(S/k) smallest shards' samples) // batch full batches, whatever the epoch's
order; the rest, reported as dropped, is at most one shard per rank plus one batch. Give S a multiple of the
number of ranks to drop little. Validation: shards in order, each rank yields every real sample of its shards
once (padding cut off).

Each batch's sample indices come from the reader's source info (``TAR:OFFSET:KEY.cls``; the key is the sample's
index) and each label from the ``.cls`` member, checked against the manifest's.
"""
from __future__ import annotations

import contextlib
import math
import re

import numpy as np
import torch

from hybridtrain.data.dali import (
    READER_NAME,
    DaliLoader,
    GraphSpec,
    _create,
    decode_and_augment,
    shard_range,
)
from hybridtrain.data.shards import ShardImages
from hybridtrain.errors import UserError

SHUFFLE_BUFFER = 1024  # samples a training reader shuffles among (DALI's initial_fill default)


def shard_graph(paths: list[str], index_paths: list[str], spec: GraphSpec, fill: int):
    from nvidia.dali import fn

    jpegs, cls = fn.readers.webdataset(paths=paths, index_paths=index_paths, ext=["jpg", "cls"],
                                       missing_component_behavior="error", random_shuffle=spec.training,
                                       initial_fill=fill, pad_last_batch=True, name=READER_NAME)
    return decode_and_augment(jpegs, spec), cls


def sample_key(source_info: str) -> int:
    """The sample index in a reader's source info 'TAR:OFFSET:KEY.ext'."""
    return int(source_info.rsplit(":", 1)[-1].split(".", 1)[0])


def shard_steps(counts: list[int], world_size: int, batch_size: int) -> int:
    """Full batches every rank can fill in every epoch (see the module notes)."""
    fewest = len(counts) // world_size
    return sum(sorted(counts)[:fewest]) // batch_size


class DaliShardLoader(DaliLoader):
    """:class:`DaliLoader` reading tar shards; the epoch's order is an order of shards."""

    def __init__(self, images: ShardImages, spec: GraphSpec, rank: int, world_size: int, batch_size: int, *args,
                 **kwargs):
        super().__init__(images, spec, rank, world_size, batch_size, *args, **kwargs)
        self.counts = np.asarray(images.shard_counts)
        self.mine = shard_range(len(self.counts), rank, world_size)  # positions in the epoch's shard order
        self.shard = range(int(self.counts[self.mine.start:self.mine.stop].sum()))  # validation: real samples

    def list_lines(self, images) -> None:
        return None

    @property
    def dropped_per_epoch(self) -> int:
        if not self.spec.training:
            return 0
        return len(self.images) - self.world_size * self.batch_size * len(self)

    def __len__(self) -> int:
        if self.spec.training:
            return shard_steps(self.counts.tolist(), self.world_size, self.batch_size)
        return math.ceil(len(self.shard) / self.batch_size)

    def epoch_order(self, epoch: int) -> np.ndarray:
        """The shards in the epoch's order: permuted by (seed, epoch) for training, identically on every rank."""
        s = len(self.counts)
        return np.random.default_rng([self.seed, epoch]).permutation(s) if self.spec.training else np.arange(s)

    def _build(self, order: np.ndarray, epoch: int):
        shards = order[self.mine.start:self.mine.stop].tolist()
        paths = [self.images.shard_paths[s] for s in shards]
        index_paths = [self.images.index_paths[s] for s in shards]
        fill = max(1, min(SHUFFLE_BUFFER, int(self.counts[shards].sum())))
        return self._built(shard_graph, order, epoch, paths, index_paths, self.spec, fill)

    def _run(self, pipe, order: np.ndarray, run: int) -> tuple[torch.Tensor, torch.Tensor]:
        with self._errors(order, run):
            images, cls = pipe.run(*self._output_stream(pipe))
        images = self._to_torch(pipe, images)
        ids = [sample_key(cls[i].source_info()) for i in range(len(cls))]
        labels = [int(np.asarray(cls[i]).tobytes()) for i in range(len(cls))]
        for key, label in zip(ids, labels):
            if label != int(self.class_of[key]):
                raise UserError(f"{self.images.samples[key][0]}: its .cls says class {label} and shards.json "
                                f"{int(self.class_of[key])}: the shards are damaged: pack them again",
                                same_on_all_ranks=False)
        return images, torch.tensor(ids, dtype=torch.int64)

    @contextlib.contextmanager
    def _errors(self, order: np.ndarray, run: int):
        """A DALI failure becomes this rank's one line: the shards cannot be filtered by check-data's lists, so
        the fix is the source's."""
        try:
            yield
        except RuntimeError as exc:
            cause = re.search(r"encountered:\s*\n\s*(\S.*)", str(exc))
            raise UserError(f"DALI failed reading the shards of {self.images.root} "
                            f"({(cause.group(1) if cause else str(exc)).strip()[:300]}): run check-data on the folder "
                            f"tree they were packed from, fix or remove the bad image there, and pack the shards "
                            f"again", same_on_all_ranks=False) from None


def create_shard_loader(images: ShardImages, cfg, rank: int, world_size: int, local_size: int, device: str,
                        training: bool, dtype: torch.dtype = torch.float32, channels_last: bool = False,
                        pin: bool = False) -> DaliShardLoader:
    """This rank's training or validation loader over tar shards."""
    split = "train" if training else "val"
    if len(images.shard_counts) < world_size:
        raise UserError(f"{images.root} has {len(images.shard_counts)} {split} shard(s) for {world_size} ranks: "
                        f"every rank needs one: pack more shards (prepare-data imagenet --shards N, N a multiple "
                        f"of the ranks) or use fewer ranks")
    b = cfg.train.batch_size if training else (cfg.data.val_batch_size or cfg.train.batch_size)
    if training and shard_steps(images.shard_counts, world_size, b) == 0:
        raise UserError(f"the training shards of {images.root} cannot give every one of {world_size} rank(s) a full "
                        f"batch of {b}: lower train.batch_size or use fewer ranks")
    return _create(images, cfg, rank, world_size, local_size, device, training, b, dtype, channels_last, pin,
                   loader_class=DaliShardLoader)

"""The DALI backends on tar shards (``prepare-data imagenet --shards``): ``fn.external_source`` fed the members read
by ``pread`` at their offsets from the ``.idx`` indices (``shards.ShardImages``), into the same decode-and-augment
graph as the folder form (``dali.decode_and_augment``).

The order is exactly the DALI folder form's, sample by sample: a sample's key is its index in the folder tree it
was packed from, the epoch's order is those keys permuted by (``seed``, epoch) identically on every rank, rank r
reads the positions ``dali.shard_range`` of it, training yields the same floor(floor(n/k)/b) full batches and
drops the same samples (``sharding.dropped_per_epoch``); validation reads the keys in order, each rank its range, every
real sample once. Only the source of the bytes differs: the tars instead of files. (DALI's
``fn.readers.webdataset`` cannot give this order: it reads each tar's samples in the index's order and shuffles
only shards and a buffer of samples, so ranks would read other samples in another order than on folders.)

The source is a batch callable (:class:`EpochFeed`): DALI calls it with the run's number, from the thread that
runs the pipeline and up to ``prefetch_queue_depth`` runs ahead; it returns the run's encoded images, their
``.cls`` labels and their keys, which come out beside the images, so every batch's indices are those its images
were read for, and each label is checked against the manifest's. Not ``parallel=True``: that forks Python worker
processes (or spawns them, once CUDA is up) per pipeline, hence per epoch, and pickles the source, for work that
is one ``pread`` per member; the decoding, the real cost, runs on DALI's threads either way. Not ``no_copy``: DALI
would need every batch's buffers kept alive for the prefetched runs, to save one copy of encoded bytes, a small
fraction of the decoded pixels' size.
"""
from __future__ import annotations

import math
import re

import numpy as np
import torch

from hybridtrain.data.dali import DaliLoader, GraphSpec, decode_and_augment
from hybridtrain.data.shards import ShardImages
from hybridtrain.errors import UserError


class EpochFeed:
    """``external_source``'s batches: run i gives (encoded images, .cls labels, keys) of ``keys[i*b:(i+1)*b]``.

    Past the last batch a training feed ends the epoch (StopIteration, so nothing is read ahead that will not be
    used); a validation feed starts its list again, as its pipeline serves every pass."""

    def __init__(self, images: ShardImages, keys: np.ndarray, batch_size: int, again: bool):
        self.images, self.keys, self.batch_size, self.again = images, keys, batch_size, again
        self.runs = math.ceil(len(keys) / batch_size)

    def __call__(self, run: int) -> tuple[list, list, list]:
        if run >= self.runs and not self.again:
            raise StopIteration
        start = run % self.runs * self.batch_size
        keys = self.keys[start:start + self.batch_size].tolist()
        return ([np.frombuffer(self.images.read_image(k), dtype=np.uint8) for k in keys],
                [np.array([self.images.read_class(k)], dtype=np.int64) for k in keys],
                [np.array([k], dtype=np.int64) for k in keys])


def shard_graph(feed: EpochFeed, spec: GraphSpec):
    from nvidia.dali import fn, types

    jpegs, labels, keys = fn.external_source(source=feed, num_outputs=3, batch=True,
                                             dtype=[types.UINT8, types.INT64, types.INT64], ndim=[1, 1, 1])
    return decode_and_augment(jpegs, spec), labels, keys


class DaliShardLoader(DaliLoader):
    """:class:`DaliLoader` reading tar shards: the folder form's order, steps and drops (see the module notes)."""

    def list_lines(self, images) -> None:
        return None

    def _build(self, order: np.ndarray, epoch: int):
        keys = order[self.shard.start:self.shard.stop]
        if self.spec.training:
            keys = keys[:len(self) * self.batch_size]  # the full batches it yields
        feed = EpochFeed(self.images, keys, self.batch_size, again=not self.spec.training)
        return self._built(shard_graph, order, epoch, feed, self.epoch_spec(epoch))

    def _run(self, pipe, order: np.ndarray, run: int) -> tuple[torch.Tensor, torch.Tensor]:
        with self._errors(order, run):
            images, labels, keys = pipe.run(*self._output_stream(pipe))
        keys = torch.from_numpy(np.asarray(keys.as_array()).reshape(-1).astype(np.int64))
        labels = np.asarray(labels.as_array()).reshape(-1)
        for key, label in zip(keys.tolist(), labels.tolist()):
            if label != int(self.class_of[key]):
                raise UserError(f"{self.images.samples[key][0]}: its .cls says class {label} and shards.json "
                                f"{int(self.class_of[key])}: the shards are damaged: pack them again",
                                same_on_all_ranks=False)
        return self._to_torch(pipe, images), keys

    def _failure(self, message: str, order: np.ndarray, run: int) -> str:
        """A DALI failure's line: the shards cannot be filtered by check-data's lists, so the fix is the source's."""
        cause = re.search(r"encountered:\s*\n\s*(\S.*)", message)
        return (f"DALI failed reading the shards of {self.images.root} "
                f"({(cause.group(1) if cause else message).strip()[:300]}): run check-data on the folder "
                f"tree they were packed from, fix or remove the bad image there, and pack the shards again")


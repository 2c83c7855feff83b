"""The DALI backends: one ImageNet pipeline definition, run on the CPU (``dali_cpu``) or the GPU (``dali_gpu``).

The graph is the same for both devices but for its ends: the decoder's device ("cpu", or "mixed" = nvJPEG on
the GPU, after which resize and normalisation run on the GPU too), and what it delivers (a CPU pipeline gives
uint8 pixels, normalised on the model's device like the torchvision backend's; a GPU pipeline normalised
FP16/FP32). Batches reach torch without a copy (DLPack) unless they must be page-locked for a GPU. A CPU
pipeline runs without any GPU (``device_id=None``), which is how the tests exercise the GPU path's graph.

Sharding: the rank's shard of an epoch is the samples [floor(r*n/k), floor((r+1)*n/k)) of that epoch's order
(``shard_range``, DALI's own formula for ``shard_id=r, num_shards=k``), and each rank's reader gets only its
shard as its file list (``num_shards=1``): k times less to write and parse than the whole list.

Shuffling: a global reshuffle every epoch with the same seed on all ranks. The loader builds a training pipeline
per epoch whose reader gets the rank's shard of the whole list permuted by (``seed``, epoch), identical on
every rank, with ``shuffle_after_epoch`` off, so shards change every epoch and still partition the data. (DALI's
``random_shuffle`` only shuffles inside a rank's own shard through a buffer, so shards would never change; and
``shuffle_after_epoch`` reshuffles with a seed fixed inside DALI and shuffles the first epoch too, so the order
could not follow the configured seed, a resumed run could not see the order an uninterrupted one sees, and a
failing file could not be named.) The order is a pure function of (seed, epoch): resumed runs read exactly
what uninterrupted runs read. The cost is a build per epoch: for ImageNet's 1.28M files on one rank about
1.2 s on the CPU, from the epoch's first request to its first batch (``docs/benchmarks.md``), and 1/k of the
listing part of it on k ranks. The validation pipeline reads the same list every pass, so it is built once
per run and reused while each pass runs to its end.

Equal steps: every shard is padded (``pad_last_batch=True``) to ceil(n/k) samples and then to whole
batches. Training yields only the first floor(floor(n/k)/b) = floor(n/(kb)) batches, which are full of real
samples on every rank (each sample at most once per epoch; fewer than one global batch dropped, as the torchvision
backend's: ``sharding.steps_per_epoch`` and ``sharding.dropped_per_epoch``). Validation yields every real sample
of the shard exactly once and cuts off the padded duplicates, so the metrics count each image once across ranks.

Reading: the reader gets the ImageList (so a clean list from ``check-data --write-filelist`` is honoured)
as a temporary ``file_list`` whose "label" is the sample index; the loader maps it to the class label and
also returns it, so every batch is ``(images, labels, indices)`` as with the torchvision backend. (Passing
``files=``/``labels=`` instead costs about 8 s and 2 GB per rank for ImageNet's 1.28M files, against 3 s
and 0.4 GB through a file.)
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import inspect
import math
import os
import re
import tempfile
from dataclasses import dataclass

import numpy as np
import torch

from hybridtrain.data import sharding
from hybridtrain.data.folder import CLEAN_LIST_HINT, ImageList
from hybridtrain.data.images import decode_error
from hybridtrain.data.presets import IMAGENET_MEAN, IMAGENET_STD
from hybridtrain.data.resolution import resolutions
from hybridtrain.distributed.topology import cores_per_rank
from hybridtrain.errors import UserError

INSTALL_HINT = "pip install nvidia-dali-cuda130 in the venv (or run ./install.sh)"
READER_NAME = "reader"


def require_dali(device: str = "cpu") -> None:
    """Raise a one-line UserError telling how to install DALI when it is missing, or a "gpu" pipeline's no GPU."""
    try:
        import nvidia.dali  # noqa: F401
    except ImportError:
        raise UserError(f"data.backend dali_cpu/dali_gpu needs NVIDIA DALI, which is not installed: {INSTALL_HINT}, "
                        f"or use data.backend=torchvision") from None
    if device == "gpu":
        require_gpu_for_dali_gpu()


def require_gpu_for_dali_gpu() -> None:
    """Raise a one-line UserError when dali_gpu is asked for without a CUDA device."""
    if not torch.cuda.is_available():
        raise UserError("data.backend=dali_gpu needs a CUDA GPU and none is visible: use data.backend=dali_cpu")


# ----------------------------------------------------------------------------- shard arithmetic

def shard_range(num_samples: int, shard: int, num_shards: int) -> range:
    """The positions of DALI's shard ``shard`` in the reader's list."""
    return range(num_samples * shard // num_shards, num_samples * (shard + 1) // num_shards)


# ----------------------------------------------------------------------------- the pipeline

@dataclass(frozen=True)
class GraphSpec:
    """Everything that shapes the graph; ``device`` is "cpu" or "gpu"."""
    training: bool
    device: str
    crop_size: int
    val_resize: int
    min_crop_area: float
    hflip: bool
    output: str  # "uint8": pixels, normalised on the model's device (data.loaders.device_images); "fp16", "fp32"
    channels_last: bool


def imagenet_graph(file_list: str, file_root: str, spec: GraphSpec):
    """Read (the rank's shard, in list order), decode, augment or center-crop, normalise; returns (images, sample
    ids)."""
    from nvidia.dali import fn

    jpegs, ids = fn.readers.file(file_list=file_list, file_root=file_root, shuffle_after_epoch=False,
                                 pad_last_batch=True, name=READER_NAME)
    return decode_and_augment(jpegs, spec), ids


def decode_and_augment(jpegs, spec: GraphSpec):
    """The graph after the reader (shared with the tar shards' reader, ``dali_shards``): decode, augment or
    center-crop, normalise."""
    from nvidia.dali import fn, types

    decoder = "mixed" if spec.device == "gpu" else "cpu"
    mirror = 0
    if spec.training:
        images = fn.decoders.image_random_crop(jpegs, device=decoder, output_type=types.RGB,
                                               random_area=[spec.min_crop_area, 1.0],
                                               random_aspect_ratio=[3 / 4, 4 / 3])
        images = fn.resize(images, resize_x=spec.crop_size, resize_y=spec.crop_size)
        if spec.hflip:
            mirror = fn.random.coin_flip(probability=0.5)
    else:
        images = fn.decoders.image(jpegs, device=decoder, output_type=types.RGB)
        images = fn.resize(images, resize_shorter=spec.val_resize)
    layout = "HWC" if spec.channels_last else "CHW"
    crop = (spec.crop_size, spec.crop_size)
    if spec.output == "uint8":
        images = fn.crop_mirror_normalize(images, crop=crop, mirror=mirror, dtype=types.UINT8, output_layout=layout)
    else:
        images = fn.crop_mirror_normalize(images, crop=crop, mirror=mirror, mean=[255 * m for m in IMAGENET_MEAN],
                                          std=[255 * s for s in IMAGENET_STD], output_layout=layout,
                                          dtype=types.FLOAT16 if spec.output == "fp16" else types.FLOAT)
    return images


def pipeline_seed(seed: int, rank: int, start_epoch: int) -> int:
    """Augmentation seed: differs per rank and per epoch the pipeline is built for; fits DALI's int range."""
    return int(np.random.SeedSequence([seed, rank, start_epoch]).generate_state(1)[0] >> 1)


@contextlib.contextmanager
def reader_file_list(lines: list[str], samples: np.ndarray):
    """A temporary DALI file list of ``samples`` (sample indices, in reading order)."""
    with tempfile.NamedTemporaryFile("w", prefix="hybridtrain-dali-", suffix=".txt", delete=False) as fh:
        fh.write("".join([lines[i] for i in samples.tolist()]))
    try:
        yield fh.name
    finally:
        os.remove(fh.name)


# ----------------------------------------------------------------------------- the loader

class InFlight:
    """GPU batches that torch's stream may still read, each kept alive until a CUDA event recorded after the
    consumer's work on it has completed.

    A batch shared without a copy is DALI's memory: the torch tensor holds it, and once torch lets go DALI frees it
    in DALI's order, not after torch's stream, so DALI's pool could hand it to the next decode while a queued
    forward still reads it (validation has no host sync per batch). Holding each batch here until torch's stream
    has passed its consumer's work keeps the memory out of the pool until then.

    Contract: the consumer enqueues its work on a batch before it asks for the batch after next (it reads at most
    one batch ahead), or holds the batch itself until its stream has read it: the training epoch draws a step's k
    batches at once and drops them after ``train_step``, whose overflow check waits for the passes on the host.
    ``fence()``: an event recorded now on torch's stream, with ``query()`` and ``synchronize()``.

    The k >= 3 coupling. With k <= 2 each batch's fence is recorded after its consumer's work. With
    k >= 3 (train.accumulation_steps; EpochSteps draws the step's k batches before any pass is enqueued) the
    request for batch j + 2 fences batch j, j = 0 .. k - 3, with an event recorded *before* that batch's forward:
    the event completes at once and this class lets those batches go early. They stay safe only because (1) the
    epoch's ``drawn`` list (and ``on_device``'s, the same tensors) holds them until ``train_step`` returns, past its
    host sync, the loss scaler's ``bool(found_inf)``, which waits for every pass's backward on torch's stream; and
    (2) ``run()`` is bound to torch's stream (``_output_stream``), so DALI's next writes into memory it gets back
    are ordered after what torch's stream had queued. A step without that host sync, a consumer that drops the
    batches before it, or a DALI without ``run(cuda_stream=...)`` breaks (1) or (2): then fence per pass instead
    (``next_requested`` after each pass's work is enqueued) or ``drain()`` before letting a step's batches go.
    """

    def __init__(self, fence):
        self.fence = fence
        self.latest = None  # the last batch handed out: the consumer may still enqueue work on it
        self.fenced = collections.deque()  # (event, batch), oldest first

    def next_requested(self, handed_out) -> None:
        """The consumer asks for the batch after ``handed_out``: its work on the one before is enqueued."""
        event = self.fence()
        if self.latest is not None:
            self.fenced.append((event, self.latest))
        self.latest = handed_out
        while self.fenced and self.fenced[0][0].query():
            self.fenced.popleft()

    def drain(self) -> None:
        """The pass ended or was left: all work is enqueued, so wait for it once and let every batch go."""
        if self.latest is None and not self.fenced:
            return
        self.fence().synchronize()
        self.latest = None
        self.fenced.clear()

    def held(self) -> list:
        return ([self.latest] if self.latest is not None else []) + [batch for _, batch in self.fenced]


class DaliLoader:
    """One rank's batches ``(images, labels, indices)``, with the torchvision loader's interface.

    Images are NCHW (channels_last memory format when asked for) on the pipeline's device: uint8 pixels from a
    CPU pipeline (``data.loaders.device_images`` normalises them on the model's device), normalised FP16/FP32
    from a GPU one; labels and indices are int64 on the CPU. ``len()`` is the number of batches this rank
    yields per epoch. Each training pass builds the pipeline for its epoch; validation builds one and reuses it
    while passes run to their end (see the module notes). A GPU pipeline's batches are DALI's memory, held by
    ``in_flight`` (InFlight) until torch's stream is done with them; its consumer reads at most one batch ahead.
    """

    def __init__(self, images: ImageList, spec: GraphSpec, rank: int, world_size: int, batch_size: int, seed: int,
                 num_threads: int, prefetch_queue_depth: int, device_id=None, pin: bool = False):
        self.images, self.spec = images, spec
        self.rank, self.world_size, self.batch_size, self.seed = rank, world_size, batch_size, seed
        self.num_threads, self.prefetch_queue_depth, self.device_id = num_threads, prefetch_queue_depth, device_id
        self.pin = pin  # a CPU pipeline feeding a GPU: page-locked batches, so the copy to the GPU is asynchronous
        self.class_of = torch.tensor([label for _, label in images.samples], dtype=torch.int64)
        self.lines = self.list_lines(images)
        self.shard = shard_range(len(images), rank, world_size)
        self.epoch = 0
        self.reusable = None  # validation: the pipeline whose reader is back at its list's start
        self.builds = 0
        self.resolution = None  # training: the epoch's resolution (data.res_*, data/resolution.py), set by _create
        on_gpu = spec.device == "gpu" and not pin
        self.in_flight = (InFlight(lambda: torch.cuda.current_stream(torch.device("cuda", device_id)).record_event())
                          if on_gpu else None)  # its fence: an event recorded on torch's current stream

    def list_lines(self, images: ImageList) -> list[str] | None:
        """Each sample's line of the reader's file list, made once per run: its path relative to the split folder
        (the reader's ``file_root``), labelled with its sample index."""
        prefix = images.root.rstrip(os.sep) + os.sep
        paths = (p[len(prefix):] if p.startswith(prefix) else os.path.relpath(p, images.root)
                 for p, _ in images.samples)
        return [f"{path} {index}\n" for index, path in enumerate(paths)]

    @property
    def batch_sampler(self):
        """The trainer calls ``loader.batch_sampler.set_epoch(e)``; the loader itself keeps the epoch."""
        return self

    @property
    def dropped_per_epoch(self) -> int:
        """Training samples left out each epoch (the same on every rank); 0 for validation."""
        if not self.spec.training:
            return 0
        return sharding.dropped_per_epoch(len(self.images), self.world_size, self.batch_size)

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        """``start`` > 0 (samples of the epoch already consumed, elastic training only) is refused before any
        rank starts (engine.elastic.check_elastic), so DALI's readers always begin an epoch at its start."""
        self.epoch = epoch

    def __len__(self) -> int:
        if self.spec.training:  # full batches every rank can fill from its own shard (the smallest holds floor(n/k))
            return sharding.steps_per_epoch(len(self.images), self.world_size, self.batch_size)
        return math.ceil(len(self.shard) / self.batch_size)

    def epoch_spec(self, epoch: int) -> GraphSpec:
        """The graph of ``epoch``'s pipeline: training resizes to the epoch's resolution (progressive resizing)."""
        if self.resolution is None or not self.spec.training:
            return self.spec
        return dataclasses.replace(self.spec, crop_size=self.resolution(epoch))

    def epoch_order(self, epoch: int) -> np.ndarray:
        """The reader's file list for ``epoch``: sample indices, permuted by (seed, epoch) for training."""
        n = len(self.images)
        return sharding.epoch_permutation(n, self.seed, epoch) if self.spec.training else np.arange(n)

    def __iter__(self):
        order = self.epoch_order(self.epoch)
        pipe, self.reusable = self.reusable or self._build(order, self.epoch), None
        try:
            for run in range(len(self)):
                images, ids = self._run(pipe, order, run)
                keep = min(self.batch_size, len(self.shard) - run * self.batch_size)  # validation: cut the padding
                yield images[:keep], self.class_of[ids[:keep]], ids[:keep]
                if self.in_flight is not None:
                    self.in_flight.next_requested(images)
        finally:  # the pass ended, or its consumer left it (a stopped epoch, an error)
            if self.in_flight is not None:
                self.in_flight.drain()
        if not self.spec.training:  # every padded batch of the list was read: the next run starts it again
            self.reusable = pipe

    def _build(self, order: np.ndarray, epoch: int):
        with reader_file_list(self.lines, order[self.shard.start:self.shard.stop]) as file_list:  # read by build()
            return self._built(imagenet_graph, order, epoch, file_list, self.images.root, self.epoch_spec(epoch))

    def _built(self, graph, order: np.ndarray, epoch: int, *graph_args):
        """``graph(*graph_args)`` as this loader's pipeline for ``epoch``, built (a failure names its file)."""
        from nvidia.dali import pipeline_def

        pipe = pipeline_def(graph)(*graph_args, batch_size=self.batch_size, num_threads=self.num_threads,
                                   device_id=self.device_id, seed=pipeline_seed(self.seed, self.rank, epoch),
                                   prefetch_queue_depth=self.prefetch_queue_depth)
        with self._errors(order, 0):
            pipe.build()
        self.builds += 1
        return pipe

    def _run(self, pipe, order: np.ndarray, run: int) -> tuple[torch.Tensor, torch.Tensor]:
        with self._errors(order, run):
            images, ids = pipe.run(*self._output_stream(pipe))
        return self._to_torch(pipe, images), torch.from_numpy(np.asarray(ids.as_array()).reshape(-1).astype(np.int64))

    def _to_torch(self, pipe, images) -> torch.Tensor:
        """A batch of DALI images as torch's: shared where DALI allows, NCHW-shaped (NHWC strides kept)."""
        images = self._shared(images) if getattr(pipe, "exec_dynamic", False) and not self.pin else self._copied(images)
        return images.permute(0, 3, 1, 2) if self.spec.channels_last else images

    @contextlib.contextmanager
    def _errors(self, order: np.ndarray, run: int):
        """A DALI failure becomes this rank's one-line UserError (``_failure``)."""
        try:
            yield
        except RuntimeError as exc:
            raise UserError(self._failure(str(exc), order, run), same_on_all_ranks=False) from None

    def _failure(self, message: str, order: np.ndarray, run: int) -> str:
        """The file DALI could not decode (found by ``_find_culprit``), or the cause it reports, and what to do."""
        culprit = self._find_culprit(order, run)
        decode = re.search(r"Failed to decode sample #\d+ : (\S.*)", message)
        cause = re.search(r"encountered:\s*\n\s*(\S.*)", message)
        if culprit or decode:
            what = f"cannot decode {culprit or decode.group(1).strip()}"
        else:
            what = f"DALI failed ({(cause.group(1) if cause else message).strip()})"
        return f"{what}: {CLEAN_LIST_HINT}"

    def _find_culprit(self, order: np.ndarray, run: int) -> str | None:
        """The first file PIL cannot decode among those DALI may have read by ``run``, in reading order.

        DALI reads up to ``prefetch_queue_depth`` batches ahead and may report a failure a few runs late,
        so the search starts at the shard's first sample; DALI stops at the first bad file it meets.
        """
        last = min(self.shard.stop, self.shard.start + (run + self.prefetch_queue_depth + 1) * self.batch_size)
        for position in range(self.shard.start, last):
            path = self.images.samples[order[position]][0]
            if decode_error(path) is not None:
                return path
        return None

    def _output_stream(self, pipe) -> tuple:
        """``run()``'s stream argument: torch's current stream for a GPU pipeline under the dynamic executor whose
        ``run`` takes one (DALI 2.x), so the outputs are bound to torch's stream and the host does not wait for the
        batch; a run without a stream returns host-synchronous outputs (DALI's Pipeline.run)."""
        if self.spec.device != "gpu" or not getattr(pipe, "exec_dynamic", False):
            return ()
        if "cuda_stream" not in inspect.signature(pipe.run).parameters:
            return ()
        return (torch.cuda.current_stream(torch.device("cuda", self.device_id)),)

    def _shared(self, images) -> torch.Tensor:
        """DALI's batch as a torch tensor without a copy, as DALI's own PyTorch iterator does under its dynamic
        executor (the default since DALI 1.40 or so): DALI keeps the buffer while torch holds it. On the GPU,
        DLPack makes torch's stream wait for DALI's work on the batch (a copy through
        ``feed_ndarray`` synchronised torch's whole stream for every batch), and ``run()`` bound to torch's stream
        (``_output_stream``) returns without waiting on the host; the other direction, DALI's reuse of the memory
        after torch's reads, is ``in_flight``'s (InFlight)."""
        return torch.from_dlpack(images.as_tensor())

    def _copied(self, images) -> torch.Tensor:
        """A copy of DALI's batch (valid only until the next run under the legacy executor), page-locked when a
        CPU pipeline feeds a GPU (``pin``: the copy to the GPU is then asynchronous)."""
        from nvidia.dali.plugin.pytorch import feed_ndarray

        dense = images.as_tensor()
        dtype = {"uint8": torch.uint8, "fp16": torch.float16, "fp32": torch.float32}[self.spec.output]
        on_gpu = self.spec.device == "gpu"
        device = torch.device("cuda", self.device_id) if on_gpu else torch.device("cpu")
        out = torch.empty(dense.shape(), dtype=dtype, device=device, pin_memory=self.pin and not on_gpu)
        feed_ndarray(dense, out, cuda_stream=torch.cuda.current_stream(device) if on_gpu else None)
        return out


# ----------------------------------------------------------------------------- factories

def graph_spec(cfg, training: bool, device: str, dtype: torch.dtype, channels_last: bool) -> GraphSpec:
    """``device`` "cpu" or "gpu"; ``dtype`` torch.float16 or torch.float32 (``loaders.delivered_dtype``)."""
    d = cfg.data
    # a CPU pipeline delivers pixels (a quarter of the bytes to copy and to send to a GPU),
    # normalised on the model's device as the torchvision backend's are; a GPU pipeline normalises itself
    output = "uint8" if device == "cpu" else "fp16" if dtype == torch.float16 else "fp32"
    return GraphSpec(training, device, d.crop_size, d.val_resize, d.min_crop_area, d.hflip, output, channels_last)


def create_dali_loader(training: bool, images: ImageList, cfg, rank: int, world_size: int, local_size: int,
                       device: str, dtype: torch.dtype = torch.float32, channels_last: bool = False, pin: bool = False,
                       loader_class=DaliLoader) -> DaliLoader:
    """The training loader, or the validation one (each real image exactly once across ranks, padded duplicates cut
    off); ``device`` "gpu" decodes on the current CUDA device (set it to the local rank); ``pin``: a "cpu" pipeline's
    batches page-locked (for a GPU run; it needs CUDA); ``loader_class``: DaliLoader or the tar shards'
    (``dali_shards``)."""
    batch_size = cfg.train.batch_size if training else cfg.data.val_batch_size or cfg.train.batch_size
    if not training and len(images) < world_size:
        raise UserError(f"the validation set ({len(images)} images) is smaller than the number of ranks "
                        f"({world_size}): add images or use fewer ranks")
    require_dali(device)
    spec = graph_spec(cfg, training, device, dtype, channels_last)
    threads = cfg.data.workers or cores_per_rank(local_size)
    device_id = torch.cuda.current_device() if device == "gpu" else None
    loader = loader_class(images, spec, rank, world_size, batch_size, cfg.seed, threads, cfg.data.prefetch, device_id,
                          pin)
    if training:  # the pipeline built for each epoch resizes to that epoch's resolution
        loader.resolution = resolutions(cfg.data)
    return loader


create_dali_train_loader = functools.partial(create_dali_loader, True)
create_dali_val_loader = functools.partial(create_dali_loader, False)

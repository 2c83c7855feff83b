"""``python -m benchmarks bench-data``: the input pipeline alone, in images/s after warmup, on one process.

``--data`` may be a folder tree (``prepare-data``, optionally ``--resize``d) or tar shards (``prepare-data
imagenet --shards``): the ``form`` column says which. Each row builds the backend's training loader with the
given number of threads (DALI threads, or DataLoader worker processes for torchvision), pulls ``warmup`` batches
(pipeline build, worker start-up, file cache), then times ``steps`` batches. Nothing else runs: no model, no
Horovod.
"""
from __future__ import annotations

import itertools
import os
import time

from tqdm import tqdm

from hybridtrain.config import config_from_dict
from hybridtrain.data.loaders import create_loaders
from hybridtrain.data.shards import is_shard_dir
from hybridtrain.distributed.topology import Topology, cores_per_rank
from hybridtrain.errors import UserError
from hybridtrain.reports import markdown_table


def batches_forever(loader):
    """The loader's batches, epoch after epoch."""
    for epoch in itertools.count():
        loader.batch_sampler.set_epoch(epoch)
        yield from loader


def measure(backend: str, data: str, threads: int, batch_size: int, crop: int, steps: int, warmup: int) -> dict:
    cfg = config_from_dict({"data": {"path": data, "backend": backend, "crop_size": crop, "workers": threads},
                            "train": {"batch_size": batch_size}})
    loader = create_loaders(cfg, Topology(0, 1, 0, 1)).train
    stream = batches_forever(loader)
    for _ in tqdm(range(warmup), desc=f"{backend} x{threads} warmup", unit="batch", leave=False, disable=None):
        next(stream)
    start = time.perf_counter()
    for _ in tqdm(range(steps), desc=f"{backend} x{threads}", unit="batch", leave=False, disable=None):
        next(stream)
    elapsed = time.perf_counter() - start
    return {"backend": backend, "threads": threads, "batch_size": batch_size, "crop": crop, "steps": steps,
            "images_per_sec": steps * batch_size / elapsed, "ms_per_batch": 1000 * elapsed / steps,
            "form": "tar shards" if is_shard_dir(data) else "folders"}


def bench_data(backends: list[str], data: str, threads: list[int], batch_size: int, crop: int, steps: int,
               warmup: int) -> list[dict]:
    if not os.path.isdir(data):
        raise UserError(f"--data {data} is not a folder: make one with 'hybridtrain prepare-data synthetic-imagenet "
                        f"--out {data}'")
    threads = threads or sorted({1, cores_per_rank(1)})  # none asked: 1 and all of this process's cores
    return [measure(b, data, t, batch_size, crop, steps, warmup) for b in backends for t in threads]


def format_table(rows: list[dict]) -> str:
    header = ["backend", "threads", "batch", "crop", "images/s", "ms/batch", "images/s per thread", "form"]
    return markdown_table(header,
                          [[r["backend"], r["threads"], r["batch_size"], r["crop"], f"{r['images_per_sec']:.1f}",
                            f"{r['ms_per_batch']:.1f}", f"{r['images_per_sec'] / r['threads']:.1f}", r["form"]]
                           for r in rows])

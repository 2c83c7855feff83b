"""What an epoch boundary costs the DALI training loader: from the epoch's first request to its first batch
(the epoch's file list written, its pipeline built, the first batch decoded), then the steady time per batch.

``python -m benchmarks.probes.dali_epoch_boundary --data data/digits --samples 1280000 --ranks 1,8``
lists the split's images over and over up to ``--samples`` (an ImageNet-sized list without ImageNet), and
times rank 0's loader of each world size over a few epochs, on DALI's CPU pipeline.
"""
from __future__ import annotations

import argparse
import time
from itertools import cycle, islice

from hybridtrain.data.dali import DaliLoader, GraphSpec, require_dali
from hybridtrain.data.folder import ImageList, scan_split
from hybridtrain.reports import markdown_table

BATCH = 32


def epoch_boundaries(images: ImageList, world_size: int, epochs: int, batches: int = 20) -> list[dict]:
    """Rank 0's first-batch time and then ms per batch over up to ``batches`` more, per epoch."""
    spec = GraphSpec(True, "cpu", 32, 32, 0.5, False, "uint8", False)
    loader = DaliLoader(images, spec, 0, world_size, BATCH, 0, 1, 2)
    batches = min(batches, len(loader) - 1)
    rows = []
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        start = time.perf_counter()
        batches_of_epoch = iter(loader)
        next(batches_of_epoch)
        first = time.perf_counter() - start
        start = time.perf_counter()
        for _ in range(batches):
            next(batches_of_epoch)
        rows.append({"ranks": world_size, "epoch": epoch, "first_batch_s": first,
                     "ms_per_batch": 1000 * (time.perf_counter() - start) / batches})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True, help="a dataset root with a train/ of class folders (data/digits)")
    parser.add_argument("--samples", type=int, default=1_281_167, help="list length (default: ImageNet's train)")
    parser.add_argument("--ranks", default="1,8", help="world sizes, comma-separated (rank 0 is timed)")
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args()
    world_sizes = [int(r) for r in args.ranks.split(",")]
    if args.samples < 2 * BATCH * max(world_sizes) or args.epochs < 1:
        parser.error(f"--samples must give every rank 2 batches of {BATCH} (>= {2 * BATCH * max(world_sizes)} "
                     f"here) and --epochs must be >= 1")
    require_dali()
    images = scan_split(args.data, "train")  # its samples cycled up to --samples entries
    images = ImageList(images.root, images.classes, list(islice(cycle(images.samples), args.samples)), 0)
    rows = [row for k in world_sizes for row in epoch_boundaries(images, k, args.epochs)]
    print(markdown_table(["ranks", "epoch", "first batch s", "then ms/batch"],
                         [[r["ranks"], r["epoch"], f"{r['first_batch_s']:.2f}", f"{r['ms_per_batch']:.1f}"]
                          for r in rows]))


if __name__ == "__main__":
    main()

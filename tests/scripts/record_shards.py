"""Run under horovodrun: build this rank's loaders exactly as ``hybridtrain train`` does and record, per epoch,
the sample indices the rank was handed, plus its validation indices. Writes OUT/rank<R>.json.

    horovodrun -np 2 python tests/scripts/record_shards.py CONFIG OUT EPOCHS
"""
import json
import os
import sys

from hybridtrain.config import load_config
from hybridtrain.data.loaders import create_loaders
from hybridtrain.distributed import collectives as distributed


def indices_of(loader, epoch: int) -> list[list[int]]:
    loader.batch_sampler.set_epoch(epoch)
    return [batch[2].tolist() for batch in loader]


def main(config: str, out: str, epochs: int) -> None:
    cfg = load_config(config)
    topo = distributed.init(cfg.train.threads)
    data = create_loaders(cfg, topo)
    record = {"rank": topo.rank, "steps_per_epoch": data.steps_per_epoch, "dropped": data.dropped_per_epoch,
              "train_images": data.train_images, "val_images": data.val_images,
              "train": [indices_of(data.train, e) for e in range(epochs)], "val": indices_of(data.val, 0)}
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"rank{topo.rank}.json"), "w") as fh:
        json.dump(record, fh)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))

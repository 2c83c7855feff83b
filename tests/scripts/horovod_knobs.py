"""Run under horovodrun: init Horovod with the config's knobs (--set horovod.*), then time rounds of small
all-reduces. Each round submits TENSORS tensors at once and waits for them all. Rank 0 writes OUT (JSON):
the seconds per round and the HOROVOD_* variables the rank saw.

    horovodrun -np 2 --timeline-filename T.json python tests/scripts/horovod_knobs.py OUT --set horovod.cycle_time_ms=100
"""
import json
import os
import sys
import time

import torch

from hybridtrain.config import load_config
from hybridtrain.distributed import collectives as distributed
from hybridtrain.distributed.horovod import import_horovod

ROUNDS, TENSORS = 20, 6  # under load a round's tensors can reach separate cycles: more rounds, more chances to fuse


def main(out: str, sets: list[str]) -> None:
    cfg = load_config(None, sets)
    topo = distributed.init(1, cfg)
    hvd = import_horovod()
    seconds = []
    for r in range(ROUNDS):
        start = time.perf_counter()
        handles = [hvd.allreduce_async(torch.full((1000,), float(i)), name=f"round{r}.tensor{i}") for i in range(TENSORS)]
        for handle in handles:
            hvd.synchronize(handle)
        seconds.append(time.perf_counter() - start)
    hvd.shutdown()  # its background thread ends the timeline, every event written (at exit a loaded machine lost them)
    if topo.is_root:
        with open(out, "w") as fh:
            json.dump({"round_s": seconds, "env": {k: v for k, v in os.environ.items() if k.startswith("HOROVOD_")}},
                      fh)


if __name__ == "__main__":
    main(sys.argv[1], [a for a in sys.argv[2:] if a != "--set"])

"""Run under horovodrun: updates that must equal a global-batch update, on a model without BN.

usage: gradient_equivalence.py random OUT.json
       gradient_equivalence.py accumulate PRECISION_MODE OUT.json   (fp32 | mixed-bf16 | mixed-fp16)

random: three steps whose global batch of 8 is split at random over the ranks (sharding.random_split_sizes),
each rank's loss weighted by training.micro_batch_weight; compared with plain SGD on the whole batch.
accumulate: the hybrid optimizer (two AdaBound steps, then two LARS-SGD steps) with k = 2 passes of batch b
per step against k = 1 with batch 2b, both through Horovod's DistributedOptimizer.
"""
import json
import sys

import horovod.torch as hvd
import torch

from hybridtrain.config import load_config
from hybridtrain.data.sharding import random_split_sizes
from hybridtrain.distributed.collectives import init, wrap_optimizer
from hybridtrain.engine.epoch import micro_batch_weight
from hybridtrain.engine.step import backward_pass, classification_loss
from hybridtrain.optim import apply_schedule, create_optimizer
from hybridtrain.precision.scaler import create_precision

FEATURES, CLASSES = 6, 4


def data(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, FEATURES, generator=gen), torch.randint(0, CLASSES, (n,), generator=gen)


def linear() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(FEATURES, CLASSES)


def flat(model) -> list[float]:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).tolist()


def random_split_run() -> dict:
    cfg = load_config(None, ["distributed.compression=none"])
    b, n = 4, hvd.size()
    model, reference = linear(), linear()
    optimizer = wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9), model, cfg)
    plain = torch.optim.SGD(reference.parameters(), lr=0.5, momentum=0.9)
    precision = create_precision(cfg.precision)
    splits = []
    for step in range(3):
        x, y = data(b * n, step)
        sizes = random_split_sizes(b * n, n, seed=0, epoch=0, step=step)
        start = sum(sizes[:hvd.rank()])
        part = slice(start, start + sizes[hvd.rank()])
        optimizer.zero_grad()
        backward_pass(model, precision, x[part], y[part], micro_batch_weight(sizes[hvd.rank()], b, 1))
        optimizer.synchronize()
        precision.scaler.step(optimizer)
        plain.zero_grad()
        classification_loss(reference(x), y).backward()  # the global batch in one process
        plain.step()
        splits.append(sizes)
    return {"splits": splits, "distributed": flat(model), "global_batch": flat(reference)}


def hybrid_run(cfg, k: int, b: int) -> list[float]:
    model = linear()
    bundle = create_optimizer(model, cfg, 4, 2)  # the same lr*N and bounds for both runs
    optimizer = wrap_optimizer(bundle.optimizer, model, cfg, k)
    precision = create_precision(cfg.precision)
    for update in range(4):  # epochs 0 (AdaBound) and 1 (LARS-SGD), 2 updates each
        x, y = data(2 * b, 1000 * update + hvd.rank())  # this rank's 2b samples of the update, in k passes
        apply_schedule(bundle.optimizer, bundle.schedule, update)
        optimizer.zero_grad()
        for j in range(k):
            part = slice(j * 2 * b // k, (j + 1) * 2 * b // k)
            backward_pass(model, precision, x[part], y[part], micro_batch_weight(2 * b // k, 2 * b // k, k))
        optimizer.synchronize()
        precision.scaler.step(optimizer)
    return flat(model)


def accumulation_run(mode: str) -> dict:
    precision = {"fp32": ["precision.mode=fp32"], "mixed-bf16": ["precision.mode=mixed", "precision.compute_dtype=bf16"],
                 "mixed-fp16": ["precision.mode=mixed", "precision.compute_dtype=fp16"]}[mode]
    cfg = load_config(None, ["optim.name=hybrid", "train.epochs=2", "optim.adabound_epochs=1",
                             "distributed.compression=none", *precision])
    phases = [s["phase"] for s in (create_optimizer(linear(), cfg, 4, 2).schedule(u) for u in range(4))]
    b = 4
    return {"phases": phases, "k2": hybrid_run(cfg, 2, b), "k1": hybrid_run(cfg, 1, b)}


def main() -> None:
    init(1, device="cpu", engine="horovod")  # the job the collectives run in (one thread per rank)
    result = random_split_run() if sys.argv[1] == "random" else accumulation_run(sys.argv[2])
    if hvd.rank() == 0:
        with open(sys.argv[-1], "w") as fh:
            json.dump(result, fh)


if __name__ == "__main__":
    main()

"""Run under horovodrun: dynamic loss scaling around Horovod's DistributedOptimizer with a real inf.

Rank 1 turns one gradient into inf at step INF_STEP through a gradient hook; every rank records, per step,
the loss scale, whether it stepped, and a digest of its parameters. Writes OUT/rank<R>.json.

    horovodrun -np 2 python tests/scripts/scaler_overflow.py OUT
"""
import hashlib
import json
import os
import sys

import torch

from hybridtrain.config import config_from_dict
from hybridtrain.distributed import collectives as distributed
from hybridtrain.engine.step import EagerStep, train_step
from hybridtrain.models import create_model
from hybridtrain.precision.policy import resolve_policy
from hybridtrain.precision.scaler import LossScaler, Precision

INF_STEP, STEPS, GROWTH = 2, 7, 3


def digest(model) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def main(out: str) -> None:
    topo = distributed.init(1)
    cfg = config_from_dict({"precision": {"mode": "mixed", "compute_dtype": "bf16", "loss_scaling": "dynamic"}})
    model = create_model("resnet18", 10, seed=0)
    distributed.broadcast_model(model)
    optimizer = distributed.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), model, cfg,
                                           compression="fp16")
    precision = Precision(resolve_policy(cfg.precision), LossScaler("dynamic", 1024.0, GROWTH, 5))
    step = {"now": 0}

    def poison(grad):
        return grad * float("inf") if topo.rank == 1 and step["now"] == INF_STEP else grad

    model.fc.weight.register_hook(poison)
    generator = torch.Generator().manual_seed(100 + topo.rank)
    records = []
    for step["now"] in range(STEPS):
        images = torch.randn(4, 3, 32, 32, generator=generator)  # >= 32 px: see docs/precision.md
        labels = torch.randint(10, (4,), generator=generator)
        before = precision.scaler.skipped_steps
        train_step(EagerStep(model), optimizer, precision, [(images, labels, 1.0)])
        records.append({"scale": precision.scaler.scale, "stepped": precision.scaler.skipped_steps == before,
                        "digest": digest(model)})
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"rank{topo.rank}.json"), "w") as fh:
        json.dump(records, fh)


if __name__ == "__main__":
    main(sys.argv[1])

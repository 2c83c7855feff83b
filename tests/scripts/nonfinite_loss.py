"""Run under horovodrun: a NaN loss on one rank (NaN in its data) in FP32, through the trainer's step.

Rank 1's batch holds a NaN pixel at the steps in NAN_STEPS. Every rank records, per step, whether it
stepped and a digest of its parameters; with three NaN steps in a row (precision.max_consecutive_overflows
= 3) every rank must stop at the same step with the same error. Writes OUT/rank<R>.json.
"""
import hashlib
import json
import os
import sys

import torch

from hybridtrain.config import config_from_dict
from hybridtrain.distributed import collectives as distributed
from hybridtrain.engine.step import EagerStep, train_step
from hybridtrain.errors import UserError
from hybridtrain.models import create_model
from hybridtrain.precision.scaler import create_precision

NAN_STEPS, STEPS = {2, 5, 6, 7}, 10


def digest(model) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().numpy().tobytes())
    return h.hexdigest()[:16]


def main(out: str) -> None:
    topo = distributed.init(1)
    cfg = config_from_dict({"precision": {"mode": "fp32", "max_consecutive_overflows": 3}})
    model = create_model("resnet18", 10, seed=0, small_input_stem=True)
    distributed.broadcast_model(model)
    optimizer = distributed.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), model, cfg)
    precision = create_precision(cfg.precision)
    generator = torch.Generator().manual_seed(100 + topo.rank)
    records, stopped = [], None
    for step in range(STEPS):
        images = torch.randn(4, 3, 8, 8, generator=generator)
        if topo.rank == 1 and step in NAN_STEPS:
            images[0, 0, 0, 0] = float("nan")
        labels = torch.randint(10, (4,), generator=generator)
        before = precision.scaler.skipped_steps
        try:
            loss = train_step(EagerStep(model), optimizer, precision, [(images, labels, 1.0)]).loss
        except UserError as exc:
            stopped = {"step": step, "error": str(exc)}
            break
        records.append({"loss_finite": bool(torch.isfinite(loss)), "stepped": precision.scaler.skipped_steps == before,
                        "digest": digest(model)})
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"rank{topo.rank}.json"), "w") as fh:
        json.dump({"records": records, "stopped": stopped}, fh)


if __name__ == "__main__":
    main(sys.argv[1])

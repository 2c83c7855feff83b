"""Run under horovodrun: the BN averaging step against an independent NumPy computation.

usage: bn_average.py COMBINE OUT.json     (COMBINE: mean | pooled | fp16)

mean / pooled: a ResNet-18 trains two forward passes per rank on different data (rank r: batch 4 + 2r, so
the pooled counts differ); hooks keep every BN layer's input of the last pass. After
``average_running_statistics`` rank 0 compares every layer's buffers with NumPy on the gathered inputs.
fp16: buffers of an FP16 model set to values whose FP16 sum overflows (60000 + 60000 > 65504).
"""
import json
import sys

import horovod.torch as hvd
import numpy as np
import torch

from hybridtrain.config import load_config
from hybridtrain.distributed import collectives as distributed
from hybridtrain.distributed.collectives import state_digest
from hybridtrain.models import create_model
from hybridtrain.models.batchnorm import average_running_statistics, batch_norms, configure_batch_norm


def last_inputs(model):
    captured = {}

    def keep(name):
        def hook(module, inputs):
            captured[name] = inputs[0].detach().double().numpy()
        return hook
    for i, bn in enumerate(batch_norms(model)):
        bn.register_forward_pre_hook(keep(i))
    return captured


def numpy_expectation(per_rank: list[dict], layer: int, combine: str) -> tuple[np.ndarray, np.ndarray]:
    """Per channel, from the raw inputs: the mean over ranks of each rank's mean and unbiased variance, or the
    mean and unbiased variance of all ranks' values together (pooled)."""
    flat = [np.moveaxis(inputs[layer], 1, 0).reshape(inputs[layer].shape[1], -1) for inputs in per_rank]
    if combine == "mean":
        return (np.mean([f.mean(axis=1) for f in flat], axis=0),
                np.mean([f.var(axis=1, ddof=1) for f in flat], axis=0))
    union = np.concatenate(flat, axis=1)
    return union.mean(axis=1), union.var(axis=1, ddof=1)


def check_statistics(combine: str) -> dict:
    cfg = load_config(None, [f"bn.combine={combine}"])
    model = configure_batch_norm(create_model("resnet18", 10, small_input_stem=True, seed=0), cfg.bn,
                                 torch.device("cpu"))
    captured = last_inputs(model)
    model.train()
    gen = torch.Generator().manual_seed(100 + hvd.rank())
    batch = 4 + 2 * hvd.rank()
    for shift in (5.0, 0.5 * hvd.rank()):  # the first pass must not leak into the last-iteration statistics
        model(torch.randn(batch, 3, 8, 8, generator=gen) + shift)
    average_running_statistics(model, combine)
    per_rank = hvd.allgather_object(captured)
    errors = []
    for i, bn in enumerate(batch_norms(model)):
        mean, var = numpy_expectation(per_rank, i, combine)
        errors.append(max(np.abs(bn.running_mean.double().numpy() - mean).max() / (np.abs(mean).max() + 1e-12),
                          np.abs(bn.running_var.double().numpy() - var).max() / (np.abs(var).max() + 1e-12)))
    digest = state_digest({f"{i}": t for i, bn in enumerate(batch_norms(model))
                           for t in (bn.running_mean, bn.running_var)})
    return {"max_rel_error": max(errors), "layers": len(errors), "digests": hvd.allgather_object(digest)}


def check_fp16_overflow() -> dict:
    cfg = load_config(None, [])
    model = configure_batch_norm(create_model("resnet18", 10, seed=0), cfg.bn, torch.device("cpu")).half()
    for bn in batch_norms(model):
        bn.running_var.fill_(60000.0 if hvd.rank() == 0 else 50000.0)
        bn.running_mean.fill_(-60000.0)
    average_running_statistics(model, "mean")
    bns = batch_norms(model)
    return {"dtypes": sorted({str(bn.running_var.dtype) for bn in bns}),
            "vars": sorted({float(v) for bn in bns for v in bn.running_var.float()}),
            "means": sorted({float(v) for bn in bns for v in bn.running_mean.float()})}


def main() -> None:
    distributed.init(1, device="cpu", engine="horovod")  # the job the collectives run in (one thread per rank)
    combine, out = sys.argv[1], sys.argv[2]
    result = check_fp16_overflow() if combine == "fp16" else check_statistics(combine)
    if hvd.rank() == 0:
        with open(out, "w") as fh:
            json.dump(result, fh)


if __name__ == "__main__":
    main()

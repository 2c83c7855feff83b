"""Under horovodrun -np 2: an NHWC model through broadcast_model, then one backward through Horovod's
DistributedOptimizer with each compressor. Writes OUT/rankR.json: the broadcast parameters' digest, and per
compression the 7x7 conv's local gradient, its averaged gradient and their strides."""
from __future__ import annotations

import copy
import json
import os
import sys

import torch
from torch import nn

from hybridtrain.config import load_config
from hybridtrain.distributed import collectives as distributed


def nhwc_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 4, 7, padding=3), nn.Flatten(),
                          nn.Linear(4 * 8 * 8, 3))
    return model.to(memory_format=torch.channels_last)


def main(out: str) -> None:
    topo = distributed.init(1, device="cpu")
    cfg = load_config(None, [])
    model = nhwc_model(seed=topo.rank)  # different on each rank until the broadcast
    distributed.broadcast_model(model)
    record = {"broadcast": distributed.state_digest(model.state_dict())}
    generator = torch.Generator().manual_seed(10 + topo.rank)
    images = torch.randn(4, 3, 8, 8, generator=generator).contiguous(memory_format=torch.channels_last)
    labels = torch.randint(3, (4,), generator=generator)
    for name in ("none", "fp16"):
        replica = copy.deepcopy(model)
        conv = replica[2].weight
        loss = nn.functional.cross_entropy(replica(images), labels)
        (local,) = torch.autograd.grad(loss, [conv], retain_graph=True)
        optimizer = distributed.wrap_optimizer(torch.optim.SGD(replica.parameters(), lr=0.0), replica, cfg,
                                               compression=name)
        optimizer.zero_grad()
        loss.backward()
        optimizer.synchronize()
        with optimizer.skip_synchronize():
            optimizer.step()
        record[name] = {"local_grad": local.flatten().tolist(), "grad": conv.grad.flatten().tolist(),
                        "grad_strides": list(conv.grad.stride()), "param_strides": list(conv.stride())}
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"rank{topo.rank}.json"), "w") as fh:
        json.dump(record, fh)


if __name__ == "__main__":
    main(sys.argv[1])

"""Run under torchrun --nproc-per-node=2: the torch engine's data-parallel step, checked against plain NumPy.

usage: torch_engine_checks.py OUT.json

- fp16 wire: DDP with the paper's FP16 compression (fp16_compress_hook) gives, for every gradient, what NumPy
  computes from the ranks' own gradients cast to FP16: fp16(fp16(g0)/2 + fp16(g1)/2), exactly.
- accumulation: with k = 2 passes the first pass (no_sync) leaves each rank's gradient its own; after the second
  the gradient is the mean over ranks of the local sums, in FP32.
- channels_last: NHWC gradients come back NHWC (a bucket view, no layout copy) and equal the NCHW ones; an NHWC
  model's broadcast (c10d takes it as it is) gives rank 0's values with the NHWC strides kept.
- loss scaling: a non-finite loss on rank 1 only makes both ranks skip the step and halve S; the next step runs on
  both and leaves bitwise-equal parameters.
- bucket views: once DDP has rebuilt its buckets (at step 2), the backward accumulates into each gradient in place,
  and that gradient is still the view of its DDP bucket the step before left (the wrapped optimizer's zero_grad zeroes it in place; set to None,
  every backward allocates new gradients that the reducer copies into the buckets).
- shutdown: the engine destroys its process group, so no Gloo thread is left for the interpreter's teardown.
"""
import json
import sys

import numpy as np
import torch
from torch import nn

from hybridtrain.config import load_config
from hybridtrain.distributed import collectives as distributed
from hybridtrain.engine.step import EagerStep, train_step
from hybridtrain.precision.policy import resolve_policy
from hybridtrain.precision.scaler import LossScaler, Precision

CLASSES = 4


def small_net(memory_format=torch.contiguous_format) -> nn.Module:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(),
                        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, CLASSES))
    return net.to(memory_format=memory_format)


def batch(rank: int, part: int = 0, n: int = 6):
    gen = torch.Generator().manual_seed(100 * rank + part)
    return torch.randn(n, 3, 8, 8, generator=gen), torch.randint(0, CLASSES, (n,), generator=gen)


def local_grads(images, labels, scale: float = 1.0, memory_format=torch.contiguous_format) -> list[torch.Tensor]:
    net = small_net(memory_format)
    (nn.functional.cross_entropy(net(images.contiguous(memory_format=memory_format)), labels) * scale).backward()
    return [p.grad.detach().clone() for p in net.parameters()]


def gathered(tensors: list[torch.Tensor]) -> list[list[np.ndarray]]:
    """[rank][tensor] as NumPy arrays (float64 for FP32 inputs)."""
    return [[np.asarray(t) for t in per_rank] for per_rank in distributed.allgather_object(
        [t.contiguous().numpy() for t in tensors], "grads")]


def fp16_wire(cfg, rank: int) -> dict:
    images, labels = batch(rank)
    mine = local_grads(images, labels)
    expected = [(np.float16(g0.astype(np.float16) / np.float16(2)) + np.float16(g1.astype(np.float16) /
                 np.float16(2))).astype(np.float32) for g0, g1 in zip(*gathered(mine))]
    ddp = distributed.wrap_model(small_net(), cfg, compression="fp16")
    nn.functional.cross_entropy(ddp(images), labels).backward()
    got = [p.grad.detach().numpy() for p in ddp.module.parameters()]
    return {"fp16_wire_exact": all(np.array_equal(g, e) for g, e in zip(got, expected)),
            "fp16_wire_max_error": max(float(np.abs(g - e).max()) for g, e in zip(got, expected))}


def accumulation(cfg, rank: int) -> dict:
    parts = [batch(rank, part) for part in (1, 2)]
    mine = [a + b for a, b in zip(*(local_grads(x, y, 0.5) for x, y in parts))]  # weight 1/k per pass
    expected = [(a.astype(np.float64) + b) / 2 for a, b in zip(*gathered(mine))]
    ddp = distributed.wrap_model(small_net(), cfg)
    passes, precision = EagerStep(ddp), Precision(resolve_policy(cfg.precision), LossScaler("none", 1.0, 1, 5))
    passes.backward_pass(precision, *parts[0], weight=0.5, sync=False)
    after_first = [p.grad.detach().clone() for p in ddp.module.parameters()]
    first_own = local_grads(*parts[0], 0.5)
    passes.backward_pass(precision, *parts[1], weight=0.5, sync=True)
    got = [p.grad.detach().double().numpy() for p in ddp.module.parameters()]
    return {"no_sync_kept_local": all(torch.allclose(a, b, atol=1e-7) for a, b in zip(after_first, first_own)),
            "accumulated_max_error": max(float(np.abs(g - e).max()) for g, e in zip(got, expected))}


def channels_last(cfg, rank: int) -> dict:
    images, labels = batch(rank, 3)
    nchw = [(a.astype(np.float64) + b) / 2 for a, b in zip(*gathered(local_grads(images, labels)))]
    ddp = distributed.wrap_model(small_net(torch.channels_last), cfg)
    nn.functional.cross_entropy(ddp(images.contiguous(memory_format=torch.channels_last)), labels).backward()
    params = list(ddp.module.parameters())
    broadcast = small_net(torch.channels_last)
    with torch.no_grad():
        for p in broadcast.parameters():
            p.add_(rank)  # different on each rank until the broadcast
    strides = [p.stride() for p in broadcast.parameters()]
    distributed.broadcast_model(broadcast)
    return {"nhwc_broadcast_is_rank0s": all(torch.equal(p, q) for p, q in zip(broadcast.parameters(),
                                                                             small_net().parameters())),
            "nhwc_broadcast_keeps_strides": [p.stride() for p in broadcast.parameters()] == strides,
            "nhwc_grads_keep_strides": all(p.grad.stride() == p.stride() for p in params),
            "nhwc_conv_grad_is_channels_last": params[0].grad.is_contiguous(memory_format=torch.channels_last),
            "nhwc_max_error": max(float(np.abs(p.grad.double().numpy() - e).max()) for p, e in zip(params, nchw))}


def skipped_step(cfg, rank: int) -> dict:
    ddp = distributed.wrap_model(small_net(), cfg, compression="fp16")
    optimizer = distributed.wrap_optimizer(torch.optim.SGD(ddp.module.parameters(), lr=0.1), ddp.module, cfg)
    precision = Precision(resolve_policy(cfg.precision), LossScaler("dynamic", 1024.0, 1000, 5))
    before = distributed.state_digest(ddp.module.state_dict())
    images, labels = batch(rank, 4)
    poisoned = images.clone()
    if rank == 1:
        poisoned[0, 0, 0, 0] = float("inf")
    train_step(EagerStep(ddp), optimizer, precision, [(poisoned, labels, 1.0)])
    skipped = distributed.state_digest(ddp.module.state_dict()) == before
    train_step(EagerStep(ddp), optimizer, precision, [(images, labels, 1.0)])
    after = distributed.gather_digests(ddp.module.state_dict())
    return {"skipped_on_this_rank": skipped, "scale_after": precision.scaler.scale,
            "skipped_steps": precision.scaler.skipped_steps, "stepped_after": after[rank] != before,
            "ranks_equal_after": len(set(after)) == 1}


def bucket_views_kept(cfg, rank: int) -> dict:
    ddp = distributed.wrap_model(small_net(), cfg)
    params = list(ddp.module.parameters())
    optimizer = distributed.wrap_optimizer(torch.optim.SGD(params, lr=0.1), ddp.module, cfg)
    precision = Precision(resolve_policy(cfg.precision), LossScaler("none", 1.0, 1, 5))
    images, labels = batch(rank, 5)
    for _ in range(2):  # DDP rebuilds its buckets in the order of step 1's gradients at step 2's forward
        train_step(EagerStep(ddp), optimizer, precision, [(images, labels, 1.0)])
    views = [p.grad.data_ptr() for p in params]  # the reducer pointed each gradient at its bucket
    written = {}  # where AccumulateGrad put each gradient, before the reducer's hook could re-point it

    def where(i):
        def hook(p):
            written[i] = p.grad.data_ptr()
        return hook
    hooks = [p.register_post_accumulate_grad_hook(where(i)) for i, p in enumerate(params)]
    train_step(EagerStep(ddp), optimizer, precision, [(images, labels, 1.0)])
    for hook in hooks:
        hook.remove()
    return {"grads_accumulated_in_bucket_views": [written.get(i) for i in range(len(params))] == views,
            "grads_still_bucket_views": [p.grad.data_ptr() for p in params] == views}


def main() -> int:
    cfg = load_config(None, ["precision.mode=fp32", "distributed.engine=torch"])
    topo = distributed.init(1, cfg, device="cpu", engine="torch")
    record = {"size": topo.size, "engine": distributed.engine_name()}
    for check in (fp16_wire, accumulation, channels_last, skipped_step, bucket_views_kept):
        record.update({f"rank{topo.rank}.{k}": v for k, v in check(cfg, topo.rank).items()})
    records = distributed.allgather_object(record, "records")
    distributed.shutdown()  # a Gloo group left to the interpreter's teardown could abort the process
    if topo.rank == 0:
        merged = {k: v for r in records for k, v in r.items()}
        merged["group_destroyed"] = not torch.distributed.is_initialized()
        with open(sys.argv[1], "w") as fh:
            json.dump(merged, fh)
    return 0


if __name__ == "__main__":
    sys.exit(main())

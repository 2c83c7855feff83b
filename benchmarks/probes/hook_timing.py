"""When Horovod's gradient hooks fire inside the backward, eager and under train.compile.

Horovod's ``DistributedOptimizer`` starts each gradient's all-reduce from a hook on that parameter's gradient
accumulator. The all-reduce overlaps the backward only as far as those hooks fire while the backward still runs.
This probe registers hooks the same way, runs forward, FP32 loss and backward a few times, and reports for the
last backward its time, and when its first, median and last hooks fired as fractions of it (0 = at the start,
1 = at the end). Run it as ``python -m benchmarks.probes.hook_timing [--arch resnet18 --image-size 64 --batch-size 8]``;
it prints one row per mode: eager, compiled blocks (``train.compile_scope: blocks``), compiled model.
"""
from __future__ import annotations

import argparse
import time

import torch

from hybridtrain.engine.step import classification_loss, compiled_forward
from hybridtrain.models import create_model
from hybridtrain.reports import markdown_table


class GradientHooks:
    """``callback(name)`` from a hook on each parameter's gradient accumulator, as Horovod registers its own (and,
    as Horovod does, holding the accumulators: one no longer referenced is rebuilt without the hook)."""

    def __init__(self, model: torch.nn.Module, callback):
        self.accumulators, self.handles = [], []
        for name, p in model.named_parameters():
            accumulator = p.expand_as(p).grad_fn.next_functions[0][0]
            self.accumulators.append(accumulator)
            self.handles.append(accumulator.register_hook(lambda *_, name=name: callback(name)))

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.accumulators.clear()


def hook_fractions(forward, model: torch.nn.Module, images, labels, repeats: int = 3) -> dict:
    """Backward time and the first and last hook's position in it, from the last of ``repeats`` backwards (the
    first ones compile)."""
    for _ in range(repeats):
        fired: list[float] = []
        hooks = GradientHooks(model, lambda name: fired.append(time.perf_counter()))
        loss = classification_loss(forward(images), labels)
        began = time.perf_counter()
        loss.backward()
        ended = time.perf_counter()
        hooks.remove()
        model.zero_grad(set_to_none=True)
    span = ended - began
    at = sorted((t - began) / span for t in fired)
    return {"backward_ms": 1000 * span, "hooks": len(fired), "first_hook": at[0], "median_hook": at[len(at) // 2],
            "last_hook": at[-1]}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.probes.hook_timing", description=__doc__.split("\n")[0])
    parser.add_argument("--arch", default="resnet18", choices=["resnet18", "resnet34", "resnet50"])
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = create_model(args.arch, 10, seed=0)
    images = torch.randn(args.batch_size, 3, args.image_size, args.image_size)
    labels = torch.arange(args.batch_size) % 10
    rows = []
    for mode, forward in (("eager", model), ("compiled blocks", compiled_forward(model, "blocks")),
                          ("compiled model", compiled_forward(model, "model"))):
        began = time.perf_counter()
        r = hook_fractions(forward, model, images, labels)
        rows.append([mode, f"{r['backward_ms']:.0f}", r["hooks"], f"{r['first_hook']:.2f}", f"{r['median_hook']:.2f}",
                     f"{r['last_hook']:.2f}", f"{time.perf_counter() - began:.0f}"])
    print(f"{args.arch}, {args.image_size} px, batch {args.batch_size}, {args.threads} thread(s), torch "
          f"{torch.__version__}")
    print(markdown_table(["mode", "backward ms", "hooks", "first hook at", "median hook at", "last hook at",
                                "s incl. compile"], rows))


if __name__ == "__main__":
    main()

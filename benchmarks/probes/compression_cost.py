"""What sending NHWC gradients through Horovod costs per step: python -m benchmarks.probes.compression_cost.

Times compress + decompress of ResNet-50's gradients, per step, for Horovod's own FP16 compressor on NCHW
gradients (the reference: one cast each way), for hybridtrain's LayoutCompressor on NHWC gradients, and for the
obvious fix it replaces (a contiguous copy before sending and a layout copy back). Prints a Markdown table.
"""
from __future__ import annotations

import argparse
import timeit

import torch

from hybridtrain.reports import markdown_table


def best_ms(fn, repeats: int) -> float:
    return 1000 * min(timeit.repeat(fn, number=1, repeat=repeats))


def resnet50_gradients(channels_last: bool) -> list[torch.Tensor]:
    import torchvision
    generator = torch.Generator().manual_seed(0)
    grads = [torch.randn(p.shape, generator=generator) for p in torchvision.models.resnet50().parameters()]
    if channels_last:
        grads = [g.contiguous(memory_format=torch.channels_last) if g.dim() == 4 else g for g in grads]
    return grads


def round_trip(compressor, grads) -> None:
    for grad in grads:
        sent, ctx = compressor.compress(grad)
        compressor.decompress(sent, ctx)


def copy_then_cast(grads, wire) -> None:
    for grad in grads:
        sent = grad.to(wire, memory_format=torch.contiguous_format)
        layout = torch.channels_last if grad.dim() == 4 else torch.contiguous_format
        sent.to(grad.dtype).contiguous(memory_format=layout)


def measure(repeats: int = 5) -> list[tuple[str, float]]:
    from hybridtrain.distributed.horovod import FP16Compression, NoCompression
    nchw, nhwc = resnet50_gradients(False), resnet50_gradients(True)
    return [("Horovod's FP16 cast, NCHW gradients (reference)", best_ms(lambda: copy_then_cast(nchw, torch.float16),
                                                                        repeats)),
            ("LayoutCompressor fp16, NHWC gradients", best_ms(lambda: round_trip(FP16Compression, nhwc), repeats)),
            ("contiguous copy + cast, NHWC gradients", best_ms(lambda: copy_then_cast(nhwc, torch.float16), repeats)),
            ("LayoutCompressor none, NHWC gradients", best_ms(lambda: round_trip(NoCompression, nhwc), repeats)),
            ("contiguous copy + copy back, NHWC gradients", best_ms(lambda: copy_then_cast(nhwc, torch.float32),
                                                                    repeats))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--repeats", type=int, default=5, help="best of this many (default 5)")
    args = parser.parse_args()
    torch.set_num_threads(max(1, args.threads))
    rows = [[name, f"{ms:.2f}"] for name, ms in measure(max(1, args.repeats))]
    print(markdown_table([f"ResNet-50 gradients, {args.threads} thread(s), best of {args.repeats}", "ms per step"],
                         rows))


if __name__ == "__main__":
    main()

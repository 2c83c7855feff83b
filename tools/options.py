"""What the parsers of the tools beside the package share (``python -m benchmarks``, ``python -m tools``): the bounds
of their numeric options, comma-separated counts and a benchmark's --steps/--warmup. The package's own
(hybridtrain.cli.options) give the rest."""
from __future__ import annotations

import argparse

from hybridtrain.cli.options import bounded_int

# a reason for each bound that is not the config key's own (config/sections.py)
STEPS, WARMUP = bounded_int(1, 100_000), bounded_int(0, 100_000)  # a benchmark of 100k steps is hours already


def count_list(lo: int, hi: int, example: str = "1,2"):
    """argparse ``type=``: comma-separated counts such as ``example``, each in [lo, hi]; returns them sorted,
    distinct."""
    def counts(text: str) -> list[int]:
        parts = [x.strip() for x in text.split(",") if x.strip()]
        if not parts or not all(x.isdigit() and len(x) < 10 and lo <= int(x) <= hi for x in parts):
            raise argparse.ArgumentTypeError(f"must be comma-separated counts in [{lo}, {hi}] such as {example}; "
                                             f"got {text[:40]!r}")
        return sorted({int(x) for x in parts})
    counts.bounds = (lo, hi, False, False)
    return counts


def add_timing_options(parser: argparse.ArgumentParser, steps: int, warmup: int, unit: str = "steps",
                       per: str = "") -> None:
    """A benchmark's --steps (timed, ``per`` row or so) and --warmup (untimed, first), in ``unit``s."""
    parser.add_argument("--steps", type=STEPS, default=steps, help=f"timed {unit}{per} (default {steps})")
    parser.add_argument("--warmup", type=WARMUP, default=warmup, help=f"untimed {unit} first (default {warmup})")

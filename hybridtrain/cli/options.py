"""What more than one command's parser shares: the argparse ``type=`` functions with their bounds (one error line
naming the option and the range), the bounds of the numeric options, --config/--set and --engine. The tools beside
the package (benchmarks/, tools/) build their parsers from these too."""
from __future__ import annotations

import argparse
import math


def _number_text(x) -> str:
    return str(int(x)) if float(x).is_integer() and abs(x) < 1e15 else repr(float(x))


def _span(lo, hi, lo_open=False, hi_open=False) -> str:
    return f"{'(' if lo_open else '['}{_number_text(lo)}, {_number_text(hi)}{')' if hi_open else ']'}"


def bounded_int(lo: int, hi: int):
    """argparse ``type=``: an integer in [lo, hi], or argparse's one error line naming the option and the range."""
    def integer(text: str) -> int:
        try:
            value = int(text, 10)
        except ValueError:  # not an integer, or more digits than Python converts
            raise argparse.ArgumentTypeError(f"must be an integer in {_span(lo, hi)}, got {text[:40]!r}") from None
        if not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"must be in {_span(lo, hi)}, got {value}")
        return value
    integer.bounds = (lo, hi, False, False)
    return integer


def bounded_float(lo: float, hi: float, lo_open=False, hi_open=False, name="", rule=""):
    """argparse ``type=``: a finite number in the range (NaN and inf refused); ``name`` starts the message,
    ``rule`` replaces 'in <range>' in it."""
    what = f"{name} must be" if name else "must be"
    allowed = rule or f"in {_span(lo, hi, lo_open, hi_open)}"

    def number(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{what} a number {allowed}, got {text[:40]!r}") from None
        low = value <= lo if lo_open else value < lo
        high = value >= hi if hi_open else value > hi
        if not math.isfinite(value) or low or high:
            raise argparse.ArgumentTypeError(f"{what} {allowed}, got {text[:40]!r}")
        return value
    number.bounds = (lo, hi, lo_open, hi_open)
    return number


def recipe_path(text: str) -> str:
    """argparse ``type=`` of --config: a given path must not be empty (that would silently mean the defaults)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("must name a recipe YAML, e.g. configs/demo.yaml; got ''")
    return text


# Bounds of the numeric options the package's commands share; a reason for each bound
SEED = bounded_int(0, 2**32 - 1)          # numpy's legacy seed range; the generators here take any of them
WORKERS = bounded_int(0, 256)             # processes; no host has more cores
RANKS = bounded_int(1, 4096)              # more ranks than any job of the paper (24 GPUs) by far
BATCH = bounded_int(1, 65536)             # train.batch_size's bound
CROP = bounded_int(8, 1024)               # data.crop_size's bound


def add_recipe_options(parser: argparse.ArgumentParser, config_help: str, set_help: str = "config override",
                       **config) -> None:
    """--config (a recipe YAML, checked by recipe_path) and the repeatable --set KEY=VALUE, as every command that
    reads a recipe takes them."""
    parser.add_argument("--config", type=recipe_path, help=config_help, **config)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help=set_help)


def engine_name(auto: bool = True):
    """argparse ``type=``: the name of a registered engine (the package's and HYBRIDTRAIN_ENGINE_PLUGINS'), or
    ``auto`` where ``auto``; else one error line naming them. The registry is the only list of engines, read only
    when the option is given (building the parser imports no engine module)."""
    def name(text: str) -> str:
        from hybridtrain.distributed.engines import registered
        names = (["auto"] if auto else []) + list(registered())
        if text not in names:
            raise argparse.ArgumentTypeError(f"{text[:40]!r} is not a registered engine: choose {', '.join(names)}")
        return text
    return name


def add_engine_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--engine", type=engine_name(),
                        help="the data-parallel engine (distributed.engine), a registered one (plugins included): "
                             "horovod under horovodrun/mpirun, torch (DDP) under torchrun or srun; default the "
                             "config's (auto: the launcher's)")


def with_engine(args) -> list[str]:
    """The --set overrides, with --engine as distributed.engine."""
    return args.set + ([f"distributed.engine={args.engine}"] if getattr(args, "engine", None) else [])

"""The ``hybridtrain`` command: subcommands, and one clear error line for bad input.

One module per family of commands, each holding its parsers (``add_commands``) beside its ``cmd_`` handlers:
``train``, ``data`` (prepare-data, reorganise-val, check-data), ``bench`` (bench, bench-optim, bench-data),
``reports`` (experiment, report), ``scale`` (scale, cluster), ``predict`` and ``schedule`` (plot-schedule);
``options`` holds the argparse types and the options several share. Building the parser imports no
torch: every heavy import sits inside a handler.
"""
from __future__ import annotations

import argparse
import re
import sys

from hybridtrain.cli import bench, data, predict, reports, scale, schedule, train
from hybridtrain.cli.train import out_of_memory_device
from hybridtrain.errors import run_guarded

__all__ = ["build_parser", "main", "out_of_memory_device", "run_guarded"]

# in the order --help lists the commands
FAMILIES = (train, data, bench, reports, scale, predict, schedule)


class Parser(argparse.ArgumentParser):
    """argparse with bad input as one line, ``hybridtrain: error: <what is wrong>: see <command> --help``, exit 2
    (instead of the usage block and a second line)."""

    def error(self, message):
        text = " ".join(str(message).split())  # one line whatever the input held (newlines, tabs, U+2028)
        text = re.sub(r"^argument (\S+): (?:\1 )?(must .*)$", r"\1 \2", text)  # "--steps must be in [1, ..."
        if len(text) > 300:
            text = text[:297] + "..."
        sys.stderr.write(f"hybridtrain: error: {text}: see {self.prog} --help\n")
        sys.exit(2)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="hybridtrain", description=__doc__.splitlines()[0].replace("The ", "", 1))
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for family in FAMILIES:
        family.add_commands(sub)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return run_guarded(lambda: args.func(args), lambda: getattr(args, "crash_log_dir", None))

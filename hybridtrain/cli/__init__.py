"""The hybridtrain command: train, and the commands on one run's input and output; bad input is one clear error line.

One module per family of commands, each holding its parsers (``add_commands``) beside its ``cmd_`` handlers:
``train``, ``data`` (prepare-data, reorganise-val, check-data), ``reports`` (report, plot-schedule; evaluate,
classify, export of a trained model); ``options`` holds the argparse types and the options several share. A
command loads its own family's module alone (a train rank parses no dataset command), ``--help`` all of them;
building the parser imports no torch and no module a handler alone needs. The benchmarks, the research tools and
the GPU check run from the checkout beside the package (``python -m benchmarks``, ``python -m tools``,
``make gpu-check``): MOVED names their new form to a user who types an old one.
"""
from __future__ import annotations

import argparse
import importlib
import re
import sys

from hybridtrain.cli.train import out_of_memory_device
from hybridtrain.launched_by import parse_and_run, run_guarded

__all__ = ["build_parser", "main", "out_of_memory_device", "run_guarded"]

# command -> the module of its family (hybridtrain.cli.<family>), in the order --help lists them
FAMILY_OF = {"train": "train", "prepare-data": "data", "reorganise-val": "data", "check-data": "data",
             "report": "reports", "plot-schedule": "reports", "evaluate": "reports", "classify": "reports",
             "export": "reports"}
# commands that left the package for the checkout's tools: their form now
MOVED = {"bench": "python -m benchmarks bench", "bench-optim": "python -m benchmarks bench-optim",
         "bench-data": "python -m benchmarks bench-data", "scale": "python -m benchmarks scale",
         "predict": "python -m tools predict", "cluster": "python -m tools cluster",
         "experiment": "python -m tools experiment",
         "gpu-check": "make gpu-check"}  # the GPU check: pytest rows, tests/gpu


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


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser of ``command``'s family alone, or of every command (None, or a name that is none of them: argparse
    then lists them all)."""
    parser = Parser(prog="hybridtrain", description=__doc__.splitlines()[0].replace("The ", "", 1))
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    families = [FAMILY_OF[command]] if command in FAMILY_OF else dict.fromkeys(FAMILY_OF.values())
    for family in families:
        importlib.import_module(f"hybridtrain.cli.{family}").add_commands(sub)
    return parser


def moved_command(argv: list[str]) -> str | None:
    """The one error line for a command that runs from the checkout now (``bench --find-max-batch``: max-batch)."""
    if not argv or argv[0] not in MOVED:
        return None
    new = "python -m benchmarks max-batch" if argv[0] == "bench" and "--find-max-batch" in argv else MOVED[argv[0]]
    if new.startswith("make"):
        return (f"hybridtrain: error: `{argv[0]}` runs from the checkout now, beside the package: {new} (in the "
                f"repository's root; docs/benchmarks.md, \"Checking a GPU machine\", has its calls)")
    return (f"hybridtrain: error: `{argv[0]}` runs from the checkout now, beside the package: {new} ... (in the "
            f"repository's root; {new} --help lists its options)")


def main(argv=None) -> int:
    """Parse and run under run_guarded: parsing reads the engine plugins (--engine's choices), whose refusal is one
    line too."""
    argv = sys.argv[1:] if argv is None else list(argv)
    line = moved_command(argv)
    if line:
        sys.stderr.write(line + "\n")
        return 2
    return parse_and_run(build_parser(argv[0] if argv else None).parse_args, argv)

"""``hybridtrain ARGS`` with a bug on purpose: the function MODULE:NAME (argv[1]) of the package raises
ZeroDivisionError when the command calls it. Nothing else changes: the real CLI, its guard and its crash log."""
from __future__ import annotations

import importlib
import sys

from hybridtrain.cli import main


def broken(*args, **kwargs):
    return 1 // 0


if __name__ == "__main__":
    module, name = sys.argv[1].split(":")
    setattr(importlib.import_module(module), name, broken)
    sys.exit(main(sys.argv[2:]))

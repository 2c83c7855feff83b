"""``hybridtrain ARGS`` with a bug on purpose: the function MODULE:NAME (argv[1]) raises ZeroDivisionError when the
command calls it. Nothing else changes: the real CLI (``python -m tools`` or ``python -m benchmarks`` for a MODULE of
theirs), its guard and its crash log."""
from __future__ import annotations

import importlib
import sys


def broken(*args, **kwargs):
    return 1 // 0


if __name__ == "__main__":
    module, name = sys.argv[1].split(":")
    setattr(importlib.import_module(module), name, broken)
    program = module.split(".")[0]
    cli = importlib.import_module(f"{program}.cli" if program in ("tools", "benchmarks") else "hybridtrain.cli")
    sys.exit(cli.main(sys.argv[2:]))

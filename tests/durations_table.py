"""docs/testing.md's per-file table, from a pytest log made with ``--durations=0``:

    python -m pytest tests -q -n 2 --dist loadfile --durations=0 ... > suite.log
    python tests/durations_table.py suite.log

Per test file: its tests, the seconds its tests took (setup + call + teardown, summed: worker time, not wall
time), the share of the suite's worker time, its real-process launches counted in its source (horovodrun,
torchrun, mpirun, and one-process ``hybridtrain`` commands), and its slowest test.
"""
from __future__ import annotations

import os
import re
import sys
from collections import defaultdict

TESTS = os.path.dirname(os.path.abspath(__file__))
LINE = re.compile(r"^\s*([\d.]+)s (setup|call|teardown)\s+(tests/[^:]+\.py)::(\S+)")
LAUNCH = {"multi-rank": re.compile(r"horovodrun\(|torchrun\(|launch_train\(|HOROVODRUN|TORCHRUN|\"mpirun\""),
          "one-process": re.compile(r"\[HYBRIDTRAIN,|run\(\[sys\.executable|run\(\[python")}


def read(log: str) -> dict:
    files = defaultdict(lambda: {"seconds": 0.0, "tests": set(), "slowest": ("", 0.0)})
    per_test = defaultdict(float)
    with open(log, errors="replace") as fh:
        for line in fh:
            m = LINE.match(line)
            if m:
                seconds, _, path, test = float(m[1]), m[2], m[3], m[4]
                files[path]["seconds"] += seconds
                files[path]["tests"].add(test)
                per_test[(path, test)] += seconds
    for (path, test), seconds in per_test.items():
        if seconds > files[path]["slowest"][1]:
            files[path]["slowest"] = (test, seconds)
    return files


def launches(path: str) -> dict:
    try:
        text = open(os.path.join(os.path.dirname(TESTS), path)).read()
    except OSError:
        return {k: 0 for k in LAUNCH}
    return {k: len(p.findall(text)) for k, p in LAUNCH.items()}


def table(files: dict) -> str:
    total = sum(f["seconds"] for f in files.values()) or 1.0
    lines = ["| file | tests | worker s | share | launch sites (multi-rank / one-process) | slowest test (s) |",
             "| --- | --- | --- | --- | --- | --- |"]
    for path, f in sorted(files.items(), key=lambda kv: -kv[1]["seconds"]):
        sites = launches(path)
        name, seconds = f["slowest"]
        lines.append(f"| `{os.path.basename(path)}` | {len(f['tests'])} | {f['seconds']:.0f} | "
                     f"{100 * f['seconds'] / total:.1f}% | {sites['multi-rank']} / {sites['one-process']} | "
                     f"`{name[:70]}` ({seconds:.0f}) |")
    lines.append(f"| **all** | {sum(len(f['tests']) for f in files.values())} | {total:.0f} | 100% | | |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(table(read(sys.argv[1])))

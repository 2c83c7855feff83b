"""docs/testing.md's per-file table, from a pytest log made with ``--durations=0``:

    python -m pytest tests -q -n 2 --dist loadfile --durations=0 ... > suite.log
    python tests/durations_table.py suite.log

or from a log of ``make test`` (or ``.ci/run``) itself, each line stamped with the time it was printed:

    PYTHONUNBUFFERED=1 PYTEST_ADDOPTS="-v -v" make test 2>&1 | while IFS= read -r l; do
        printf '%s %s\n' "$(date +%H:%M:%S)" "$l"; done > suite.log

where a test's seconds are the gap since the previous result of its xdist worker (setup included; to the second).

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
STAMPED = re.compile(r"^(\d\d):(\d\d):(\d\d) (?:\[(gw\d+)\] \[\s*\d+%\] (?:PASSED|FAILED|SKIPPED|ERROR) "
                     r"(tests/[^:]+\.py)::(\S.*?)\s*$|(?:.* )?\d+ workers \[)")
LAUNCH = {"multi-rank": re.compile(r"horovodrun\(|torchrun\(|launch_train\(|HOROVODRUN|TORCHRUN|\"mpirun\""),
          "one-process": re.compile(r"\[HYBRIDTRAIN,|run\(\[sys\.executable|run\(\[python")}


def read(log: str) -> dict:
    files = defaultdict(lambda: {"seconds": 0.0, "tests": set(), "slowest": ("", 0.0)})
    per_test = defaultdict(float)
    for seconds, path, test in durations(log):
        files[path]["seconds"] += seconds
        files[path]["tests"].add(test)
        per_test[(path, test)] += seconds
    for (path, test), seconds in per_test.items():
        if seconds > files[path]["slowest"][1]:
            files[path]["slowest"] = (test, seconds)
    return files


def durations(log: str):
    """(seconds, file, test) per line of ``--durations=0``, else per result of a time-stamped ``-v`` log."""
    with open(log, errors="replace") as fh:
        lines = fh.read().splitlines()
    found = [(float(m[1]), m[3], m[4]) for m in map(LINE.match, lines) if m]
    if found:
        return found
    last, start = {}, None
    for m in filter(None, map(STAMPED.match, lines)):
        now = int(m[1]) * 3600 + int(m[2]) * 60 + int(m[3])
        if m[4] is None:  # "created: N workers [K items]": the workers start
            start = now if start is None else start
            continue
        found.append((float(now - last.get(m[4], start if start is not None else now)), m[5], m[6]))
        last[m[4]] = now
    return found


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

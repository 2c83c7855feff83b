"""How far a step, an epoch's end and a checkpoint save reach: the package's files, functions and lines that run.

Run as each rank's program, with ``hybridtrain``'s own arguments after ``--``:

    horovodrun -np 2 -H localhost:2 python tests/scripts/trace_paths.py --out trace.json -- train --config ...

A ``sys.setprofile`` hook on the main thread notes every call of a function of the package (loader workers and
other threads are not traced); rank 0 cuts the calls into parts and writes, for each, its files, functions and
lines (each function's AST span, counted once however often it ran) into ``--out``, and prints the table:

- a plain step: from one call of the loop's ``after_step`` to the next, the second step of the last epoch (no
  warmup, no switch of phase, no progress line: ``train.progress=false``);
- the epoch's end: from ``EpochSteps.result`` to the return of ``RunRecord.write`` (the metrics line), the first
  epoch's;
- the same without the save and the validation: those two parts' calls taken out;
- one checkpoint save: from the call of ``guards.root_writes`` to the call of ``loop.validate`` after it.

Each part's ``entries`` count the calls into each file from another file of the package (not torch's calls back
into it: a hook, a writer).
"""
from __future__ import annotations

import ast
import json
import os
import sys

PACKAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "hybridtrain")
COMPREHENSIONS = {"<listcomp>", "<dictcomp>", "<setcomp>", "<genexpr>", "<module>"}
events: list[tuple[str, str, int, str, str]] = []  # (event, file, first line, qualified name, the caller's file)


def profile(frame, event, arg):
    if event not in ("call", "return"):
        return
    code = frame.f_code
    if code.co_filename.startswith(PACKAGE) and code.co_name not in COMPREHENSIONS:
        caller = frame.f_back.f_code.co_filename if frame.f_back else ""
        events.append((event, code.co_filename, code.co_firstlineno, code.co_qualname, caller))


def spans(path: str, cache: dict = {}) -> dict[int, int]:  # noqa: B006 - a cache across calls
    """First line (the first decorator's, as co_firstlineno) -> lines of each function or lambda in ``path``."""
    if path not in cache:
        found = {}
        for node in ast.walk(ast.parse(open(path).read())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
                found.setdefault(first, node.end_lineno - first + 1)
        cache[path] = found
    return cache[path]


def summary(calls) -> dict:
    functions = {(f, line, name) for _, f, line, name, _ in calls}
    entries: dict[str, int] = {}  # calls into a file from another file of the package
    for _, f, _, _, caller in calls:
        if caller != f and caller.startswith(PACKAGE):
            name = os.path.relpath(f, os.path.dirname(PACKAGE))
            entries[name] = entries.get(name, 0) + 1
    return {"files": len({f for f, _, _ in functions}), "functions": len(functions), "entries": entries,
            "lines": sum(spans(f).get(line, 1) for f, line, _ in functions),
            "file_list": sorted({os.path.relpath(f, os.path.dirname(PACKAGE)) for f, _, _ in functions}),
            "function_list": sorted(f"{os.path.relpath(f, os.path.dirname(PACKAGE))}:{line} {name}"
                                    for f, line, name in functions)}


def index(name: str, start: int = 0, event: str = "call", file_end: str = "") -> int:
    """The first ``event`` of the function ``name`` (a qualified name) of ``file_end`` at or after ``start``."""
    for i in range(start, len(events)):
        e, f, _, n, _ = events[i]
        if e == event and n == name and f.endswith(file_end):
            return i
    raise SystemExit(f"trace_paths: no {event} of {file_end}:{name} after event {start}")


def parts() -> dict:
    calls = [i for i, e in enumerate(events) if e[0] == "call"]
    steps = [i for i in calls if events[i][3].endswith("<lambda>") and events[i][1].endswith("engine/loop.py")]
    last_epoch = [i for i in steps if i > max(j for j in calls if events[j][3] == "EpochSteps.result")]
    if len(last_epoch) < 3:
        last_epoch = steps
    step = [events[i] for i in calls if last_epoch[1] <= i < last_epoch[2]]
    tail_start = index("EpochSteps.result", file_end="engine/epoch.py")
    write = index("RunRecord.write", tail_start, file_end="engine/records.py")
    tail_end = index("RunRecord.write", write, "return", "engine/records.py")
    save_start = index("root_writes", tail_start, file_end="engine/guards.py")
    validation = index("validate", save_start, file_end="engine/loop.py")
    validation_end = index("validate", validation, "return", "engine/loop.py")
    tail = [events[i] for i in calls if tail_start <= i <= tail_end]
    save = [events[i] for i in calls if save_start <= i < validation]
    bare = [events[i] for i in calls if tail_start <= i <= tail_end
            and not save_start <= i < validation and not validation <= i <= validation_end]
    return {"a plain step": summary(step), "the epoch's end": summary(tail),
            "the epoch's end without the save and validation": summary(bare), "one checkpoint save": summary(save)}


def main() -> int:
    cut = sys.argv.index("--")
    out = sys.argv[sys.argv.index("--out") + 1]
    sys.argv = ["hybridtrain"] + sys.argv[cut + 1:]
    from hybridtrain.cli import main as hybridtrain_main
    sys.setprofile(profile)
    try:
        code = hybridtrain_main(sys.argv[1:])
    finally:
        sys.setprofile(None)
    from hybridtrain.launched_by import launcher_rank
    if code == 0 and launcher_rank() == 0:
        table = parts()
        with open(out, "w") as fh:
            json.dump(table, fh, indent=1)
        rows = [f"| {part} | {f['files']} | {f['functions']} | {f['lines']} |" for part, f in table.items()]
        sys.stdout.write("\n".join(["| part | files | functions | lines |", "| --- | --- | --- | --- |", *rows, ""]))
    return code


if __name__ == "__main__":
    sys.exit(main())

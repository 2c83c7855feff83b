"""A venv that sees this Python's packages but some: what a machine lacking them runs (the bare-image tests, the
GPU check's rehearsal of the lent machine's Python)."""
from __future__ import annotations

import fnmatch
import os
import site
import venv
from pathlib import Path


def linked_venv(root: str, excluded: list[str]) -> str:
    """A real venv whose site-packages links every entry of this Python's except ``excluded`` (paths relative
    to site-packages, globs allowed, e.g. 'nvidia/dali'): importing those genuinely fails there. Its python."""
    venv.EnvBuilder(with_pip=False, symlinks=True).create(root)
    ours = next(p for p in site.getsitepackages() if p.endswith("site-packages"))
    target = next(Path(root).glob("lib/python*/site-packages"))

    def link(rel: str) -> None:
        for entry in os.listdir(os.path.join(ours, rel)):
            path = os.path.join(rel, entry) if rel else entry
            if any(fnmatch.fnmatch(path, pattern) for pattern in excluded):
                continue
            if any(pattern.startswith(path + "/") for pattern in excluded):
                (target / path).mkdir()
                link(path)
            else:
                os.symlink(os.path.join(ours, path), target / path)
    link("")
    return str(Path(root) / "bin" / "python")

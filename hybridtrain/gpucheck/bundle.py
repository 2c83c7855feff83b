"""``make gpu-bundle``: what a lent, offline GPU machine lacks for gpu-check's Horovod build, in one folder that
travels with the working tree (at most 64 MiB with it).

    python -m hybridtrain.gpucheck.bundle [DIR]     # default .gpu-bundle

The machine's ``python3`` is a Python 3.12 venv holding torch, setuptools and most of hybridtrain's requirements,
but no Horovod, cffi or pycparser (KINDS.md). The bundle holds Horovod's source distribution and the wheels of
its build and run requirements for CPython 3.12 on manylinux x86_64, and the same wheels for the Python running
this (so that ``gpu-check --rehearse`` can build from it here). Standard library only.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

from hybridtrain.errors import UserError
from hybridtrain.launched_by import run_guarded

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HOROVOD = "horovod==0.28.1"
SDIST = "horovod-0.28.1.tar.gz"
# install.sh's HOROVOD_BUILD_REQS and HOROVOD_RUNTIME_REQS, with cffi's own requirement; pytest-timeout: the one
# package of the test extra (setup.py) that the image lacks, which the build's offline install of hybridtrain asks for
WHEELS = ["cffi", "pycparser", "setuptools", "wheel", "packaging", "psutil", "pyyaml", "cloudpickle", "pytest-timeout"]
TARGET_PYTHON = "3.12"
PLATFORMS = ["manylinux2014_x86_64", "manylinux_2_28_x86_64"]
LIMIT_MIB = 64


def pythons() -> list[str]:
    here = f"{sys.version_info[0]}.{sys.version_info[1]}"
    return list(dict.fromkeys([TARGET_PYTHON, here]))


def download_wheels(dest: str, version: str) -> None:
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--only-binary", ":all:", "--no-deps",
           "--python-version", version, *[a for p in PLATFORMS for a in ("--platform", p)], "-d", dest, *WHEELS]
    if subprocess.run(cmd, stdin=subprocess.DEVNULL).returncode != 0:
        raise UserError(f"pip could not download {', '.join(WHEELS)} for Python {version}: make gpu-bundle needs a "
                        f"package registry (run it where pip install works)")


def fetch_sdist(dest: str) -> str:
    """Horovod's source: install.sh's cache when it has it, else the registry."""
    target = os.path.join(dest, SDIST)
    cache = os.environ.get("HYBRIDTRAIN_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "hybridtrain")
    cached = os.path.join(cache, "sdist", SDIST)
    if os.path.isfile(target):
        return "kept"
    if os.path.isfile(cached):
        shutil.copy(cached, target)
        return f"from {cached}"
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
           "--no-build-isolation", HOROVOD, "-d", dest]
    if subprocess.run(cmd, stdin=subprocess.DEVNULL).returncode != 0 or not os.path.isfile(target):
        raise UserError(f"pip could not download the {HOROVOD} source: run make gpu-bundle where pip install works")
    return "downloaded"


def folder_mib(path: str) -> float:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs) / 2**20


def tree_mib(repo: str = REPO) -> float:
    """The working tree that travels: tracked files and untracked ones git does not ignore."""
    out = subprocess.run(["git", "-C", repo, "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                         capture_output=True, text=True).stdout
    files = [os.path.join(repo, f) for f in out.split("\0") if f and os.path.isfile(os.path.join(repo, f))]
    return sum(os.path.getsize(f) for f in files) / 2**20


def main(argv: list[str]) -> int:
    dest = os.path.abspath(argv[0] if argv else os.path.join(REPO, ".gpu-bundle"))
    os.makedirs(dest, exist_ok=True)
    for version in pythons():
        download_wheels(dest, version)
    source = fetch_sdist(dest)
    bundle_mib, tree = folder_mib(dest), tree_mib()
    total = bundle_mib + tree
    print(f"gpu-bundle: {dest}: {len(os.listdir(dest))} files, {bundle_mib:.1f} MiB (Horovod's source "
          f"{source}; wheels for Python {', '.join(pythons())}); with the working tree "
          f"({tree:.1f} MiB) {total:.1f} MiB of the {LIMIT_MIB} MiB that travel")
    if total > LIMIT_MIB:
        raise UserError(f"the bundle and the tree are {total:.1f} MiB, over {LIMIT_MIB} MiB: remove "
                        f"large untracked files from the checkout")
    return 0


if __name__ == "__main__":
    sys.exit(run_guarded(lambda: main(sys.argv[1:]), lambda: None))

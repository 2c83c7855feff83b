"""``make gpu-bundle``: what a lent, offline GPU machine lacks for the GPU check's Horovod build, in one folder that
travels with the working tree (at most 64 MiB with it).

    python3 tools/gpu_bundle.py [DIR]     # default .gpu-bundle

The machine's ``python3`` is a Python 3.12 venv holding torch, setuptools, pytest and pytest-timeout but no Horovod,
cffi or pycparser (KINDS.md): the bundle holds Horovod's source and the wheels of its build and run requirements
for CPython 3.12 on manylinux x86_64, and the same for the Python running this (the rehearsal builds from it here).
"""
import os
import shutil
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HOROVOD, SDIST = "horovod==0.28.1", "horovod-0.28.1.tar.gz"
WHEELS = ["cffi", "pycparser", "setuptools", "wheel", "packaging", "psutil", "pyyaml", "cloudpickle"]
PLATFORMS = ["manylinux2014_x86_64", "manylinux_2_28_x86_64"]
LIMIT_MIB = 64


def pip(*args: str) -> bool:
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", *args]
    return subprocess.run(cmd, stdin=subprocess.DEVNULL).returncode == 0


def main(argv: list) -> int:
    if argv and argv[0].startswith("-"):  # never a folder named --help
        print(__doc__.strip())
        return 0 if argv[0] in ("-h", "--help") else 2
    dest = os.path.abspath(argv[0] if argv else os.path.join(REPO, ".gpu-bundle"))
    os.makedirs(dest, exist_ok=True)
    for version in dict.fromkeys(["3.12", f"{sys.version_info[0]}.{sys.version_info[1]}"]):
        if not pip("--only-binary", ":all:", "--no-deps", "--python-version", version,
                   *[a for p in PLATFORMS for a in ("--platform", p)], "-d", dest, *WHEELS):
            print(f"gpu-bundle: error: pip could not download {', '.join(WHEELS)} for Python {version}: run it where "
                  f"pip install works", file=sys.stderr)
            return 2
    cached = os.path.join(os.environ.get("HYBRIDTRAIN_CACHE") or os.path.expanduser("~/.cache/hybridtrain"), "sdist",
                          SDIST)
    if not os.path.isfile(os.path.join(dest, SDIST)):
        if os.path.isfile(cached):
            shutil.copy(cached, dest)
        elif not pip("--no-deps", "--no-binary", ":all:", "--no-build-isolation", HOROVOD, "-d", dest):
            print(f"gpu-bundle: error: pip could not download the {HOROVOD} source", file=sys.stderr)
            return 2
    files = subprocess.run(["git", "-C", REPO, "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                           capture_output=True, text=True).stdout.split("\0")
    tree = sum(os.path.getsize(os.path.join(REPO, f)) for f in files if os.path.isfile(os.path.join(REPO, f))) / 2**20
    bundle = sum(os.path.getsize(os.path.join(dest, f)) for f in os.listdir(dest)) / 2**20
    print(f"gpu-bundle: {dest}: {len(os.listdir(dest))} files, {bundle:.1f} MiB; with the working tree "
          f"({tree:.1f} MiB) {bundle + tree:.1f} MiB of the {LIMIT_MIB} MiB that travel")
    return 0 if bundle + tree <= LIMIT_MIB else 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

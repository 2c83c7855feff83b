"""The GPU check's fixtures: the Python the rows run with, what the node checks say, and Horovod's build with NCCL
(a session fixture: niced, started beside the rows that time nothing, waited for by the Horovod rows). The runner
itself is harness.py's hooks. Without a GPU (and without --rehearse) every row is skipped."""
from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

import pytest

from gpu.harness import *  # noqa: F401,F403  (the runner's hooks)
from gpu.harness import REPO, budget_left, option, read_tail, stop_group

# what the lent machine's Python lacks (KINDS.md lists its packages): --rehearse links everything else
IMAGE_LACKS = ["horovod", "horovod-*", "cffi", "cffi-*", "_cffi_backend*", "pycparser", "pycparser-*", "nvidia/dali",
               "nvidia/dali_*", "nvidia_dali*", "hybridtrain*", "__editable__*"]
LEFT = "left for the next call (the Horovod build had not finished)"
PROBE = ("import json, torch\nfrom hybridtrain.errors import UserError\nfrom hybridtrain.hardware.checks import "
         "check_node\nd = torch.device('cuda', 0)\nchecks = {}\nfor p in ('fp32', 'mixed-fp16', 'mixed-bf16'):\n"
         "    try:\n        checks[p] = ['', check_node(d, p)]\n    except UserError as exc:\n"
         "        checks[p] = [str(exc), []]\nprint(json.dumps({'name': torch.cuda.get_device_name(0), 'torch': "
         "torch.__version__, 'cc': '%d%d' % torch.cuda.get_device_capability(0), 'checks': checks, 'total_mb': "
         "torch.cuda.get_device_properties(0).total_memory / 2**20}))")


def cuda_seen() -> bool:
    import torch
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if option(config, "rehearse") or cuda_seen():
        return
    for item in items:
        if item.get_closest_marker("row"):
            item.add_marker(pytest.mark.skip(reason="no CUDA GPU here: run the GPU check on a GPU node"))


@pytest.fixture(scope="session")
def python(pytestconfig) -> str:
    """The image's Python (the one running the check), or under --rehearse a venv made like it."""
    if not option(pytestconfig, "rehearse"):
        return sys.executable
    from venvs import linked_venv
    root = os.path.join(option(pytestconfig, "gpu_out"), "image-venv")
    return os.path.join(root, "bin", "python") if os.path.isdir(root) else linked_venv(root, IMAGE_LACKS)


@pytest.fixture(scope="session")
def node(pytestconfig, python) -> dict:
    """The GPU's name, compute capability and what the node checks say per precision (asked in a child: this
    process never holds a CUDA context, which would count in every row's memory). --rehearse: an H200's."""
    if option(pytestconfig, "rehearse"):
        return {"name": "rehearsal", "cc": "90", "checks": {}}
    proc = subprocess.run([python, "-c", PROBE], capture_output=True, text=True, timeout=180, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": REPO})
    assert proc.returncode == 0, (proc.stderr.strip().splitlines() or ["the probe failed"])[-1]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def horovod_ready(bin_dir: str, nccl: bool) -> bool:
    code = f"import sys, horovod.torch as h; sys.exit(0 if h.nccl_built() or not {nccl} else 1)"
    if not os.path.exists(os.path.join(bin_dir, "horovodrun")):
        return False
    return subprocess.run([os.path.join(bin_dir, "python"), "-c", code], capture_output=True, timeout=180,
                          env={**os.environ, "PYTHONPATH": REPO}).returncode == 0


def nccl_possible(python: str) -> bool:
    """nvcc and torch's NCCL wheel: the lent machine's combination (a CPU rehearsal builds the same where it can)."""
    code = "import importlib.util, sys; sys.exit(0 if importlib.util.find_spec('nvidia.nccl') else 1)"
    nvcc = os.path.exists("/usr/local/cuda/bin/nvcc") or any(
        os.path.exists(os.path.join(d, "nvcc")) for d in os.environ.get("PATH", "").split(os.pathsep))
    return nvcc and subprocess.run([python, "-c", code], capture_output=True, timeout=120).returncode == 0


class Build:
    """install.sh into its own venv from the image's Python and torch (HYBRIDTRAIN_TORCH=system), offline from the
    bundle, at nice 10: started by the first row that times nothing, waited for by the first Horovod row."""

    def __init__(self, config, python: str, cc: str):
        rehearse = option(config, "rehearse")
        self.config, self.nccl = config, nccl_possible(python)
        self.venv = os.path.join(option(config, "gpu_out") if rehearse else os.path.join(REPO, ".gpu-check"), "venv")
        self.cache = os.environ.get("HYBRIDTRAIN_CACHE") or os.path.join(REPO, ".gpu-check", "cache")
        self.log = os.path.join(option(config, "gpu_out"), "build.log")
        here = os.path.dirname(python)
        self.bin = here if not rehearse and horovod_ready(here, True) else os.path.join(self.venv, "bin")
        self.proc, self.error = None, ""
        self.done = horovod_ready(self.bin, self.nccl)
        self.env = {"HYBRIDTRAIN_TORCH": "system", "HYBRIDTRAIN_SKIP_DALI": "1", "HYBRIDTRAIN_VENV": self.venv,
                    "PYTHON": python, "HYBRIDTRAIN_CACHE": self.cache,
                    "HYBRIDTRAIN_BUILD_JOBS": str(max(1, (os.cpu_count() or 1) - (0 if rehearse else 4))),
                    "HYBRIDTRAIN_WHEELHOUSE": os.path.join(REPO, ".gpu-bundle"),
                    **({"HOROVOD_GPU_OPERATIONS": "NCCL", "HOROVOD_BUILD_CUDA_CC_LIST": cc} if self.nccl else {})}

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> None:
        if self.done or self.proc is not None:
            return
        with open(self.log, "w") as log:
            log.write("$ " + " ".join(f"{k}={v}" for k, v in self.env.items()) + " nice -n 10 ./install.sh\n")
            log.flush()
            self.proc = subprocess.Popen(["nice", "-n", "10", os.path.join(REPO, "install.sh")], cwd=REPO,
                                         stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env={**os.environ, **self.env}, start_new_session=True)

    def wait(self) -> str:
        """The venv's bin folder once built; pytest.fail with install.sh's own line when it failed (the last
        2,000 lines of its full log kept as OUT/build-install.log)."""
        self.start()
        if not self.done and not self.error:
            try:
                rc = self.proc.wait(timeout=max(budget_left(self.config), 1))
            except subprocess.TimeoutExpired:
                stop_group(self.proc)
                rc = None
            self.done = rc == 0 and horovod_ready(self.bin, self.nccl)
            self.error = "" if self.done else LEFT if rc is None else self.failure(rc)
        if self.error:
            (pytest.skip if self.error == LEFT else pytest.fail)(self.error)
        return self.bin

    def failure(self, rc: int) -> str:
        logs = sorted(glob.glob(os.path.join(self.cache, "install-*.log")), key=os.path.getmtime)
        if logs:
            lines = read_tail(logs[-1], 4 * 2**20).decode("utf-8", "replace").splitlines()[-2000:]
            with open(os.path.join(option(self.config, "gpu_out"), "build-install.log"), "w") as fh:
                fh.write("\n".join(lines) + "\n")
        errors = [s for s in read_tail(self.log, 65536).decode("utf-8", "replace").splitlines()
                  if s.startswith("install: error:")]
        return f"Horovod build: {errors[-1][:300] if errors else f'exit {rc} (build.log, build-install.log)'}"


@pytest.fixture(scope="session")
def build(pytestconfig, python, node):
    job = Build(pytestconfig, python, node["cc"])
    yield job
    if job.running():  # the call's end: the next call builds again
        stop_group(job.proc)


@pytest.fixture
def beside_build(build):
    """For rows that time nothing: the build goes on meanwhile."""
    build.start()


@pytest.fixture
def horovod(build) -> str:
    return build.wait()

"""Shared fixtures: the real digits data (full and a small subset), config files, real process launchers."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import yaml

BIN = os.path.dirname(sys.executable)
HYBRIDTRAIN = os.path.join(BIN, "hybridtrain")
HOROVODRUN = os.path.join(BIN, "horovodrun")
TORCHRUN = os.path.join(BIN, "torchrun")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# install.sh's cache (Horovod wheels, the oldest-torch venv, the test wheelhouses), as install.sh finds it
CACHE = os.environ.get("HYBRIDTRAIN_CACHE") or os.path.expanduser("~/.cache/hybridtrain")
# The tools beside the package run from the checkout as their docs say (python -m benchmarks ..., python -m tools
# ...); with the checkout on PYTHONPATH every process a test starts finds them, whatever its folder
BENCHMARKS = [sys.executable, "-m", "benchmarks"]
TOOLS = [sys.executable, "-m", "tools"]
TOOL_OF = {**dict.fromkeys(("bench", "max-batch", "bench-optim", "bench-data", "scale"), BENCHMARKS),
           **dict.fromkeys(("predict", "cluster", "experiment"), TOOLS)}


def command(argv) -> list[str]:
    """``argv`` (a command and its options) as its program runs it: hybridtrain, or the checkout's tools."""
    return [*TOOL_OF.get(argv[0], [HYBRIDTRAIN]), *argv]


if REPO not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p)


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: several real training runs (minutes); make test and .ci/run include "
                                       "it, -m 'not slow' leaves it out")
    config.addinivalue_line("markers", "row(estimate_s): a GPU check row (tests/gpu) and its estimated seconds")
    if getattr(config.option, "loadscopereorder", False) and "--loadscope-reorder" not in config.invocation_params.args:
        config.option.loadscopereorder = False  # pytest-xdist keeps FILE_WEIGHTS' order (see there)


# The slowest first: the heaviest test files in worker-seconds, the one list of them. `make test`
# runs whole files on 2 workers (-n 2 --dist loadfile). pytest-xdist (3.8, xdist/scheduler/loadscope.py schedule())
# queues the files by their number of tests, most first (--loadscope-reorder, its default), and each worker takes the
# next file from the front of the queue when it has at most 2 tests left (_reschedule): the files of 100 quick tests
# started first and the few long multi-rank files ran alone at the end. pytest_collection_modifyitems puts these
# files first, heaviest first, the others after them as collected; pytest_configure turns xdist's reordering off
# (--no-loadscope-reorder) so that its queue keeps this order (an explicit --loadscope-reorder still wins).
# Figures: worker-seconds per file measured under `make test`'s command on this 2-core machine (the junit report of a
# whole run, 2026-11-28); refresh them from `make test`'s --durations.
FILE_WEIGHTS = {
    "test_preemption.py": 805,  # 14 two-rank launches (6 precisions, 3 stopped + resumed, --resume auto)
    "test_precision.py": 412,  # 9 two-rank launches (6 modes), 2 one-rank runs, a 12-row bench
    "test_torch_engine.py": 731,  # 11 launches under torchrun and horovodrun, a run in a Horovod-free venv
    "test_elastic.py": 502,  # 237-461 s: a 3->2->3 elastic run of 4 epochs, a SIGTERM'd run, a 3-rank resume
    "test_data_backends.py": 298,  # ~10 launches of 2-3 ranks (both DALI backends, corrupt JPEG, synthetic)
    "test_horovod_training.py": 267,  # ~8 launches: the reference run, mpirun, interrupted + resumed, killed ranks
    "test_batchnorm.py": 293,  # ~10 two-rank launches: BN scripts, sync BN, accumulation, resume
    "test_step_speed.py": 356,  # 3 horovodrun, torch.compile on the CPU, a fused-optimizer run (timeout 900 s)
    "test_checkpoint_integrity.py": 442,  # ~10 one-rank trainings and resumes
    "test_run_ownership.py": 177,  # 3 two-rank launches, 4 one-rank runs
    "test_install.py": 874,  # install.sh for real: an offline install from a wheelhouse, header compiles
    "test_hybrid_training.py": 176,  # 3 two-rank launches: the phase switch, 2 resumes
    "test_oldest_torch.py": 92,  # 3 two-rank torchrun launches in the oldest-torch venv
    "test_run_files_and_faults.py": 131,  # ~25 one-rank processes, 2 trainings
    "test_launch.py": 37,  # 107 tests: launch scripts' dry runs (bash), 2 one-rank launches
    "test_prepare_imagenet.py": 74,  # 2 two-rank launches (shards: DALI, torchvision), ~6 prepare-data processes
    "test_multihost.py": 333,  # a 3-host netns cluster: up/down, horovodrun over ssh with a cut link, torchrun per
    # host, a 3-rank run beside a 10x slower link and its probe, then scale --cluster 2 on a cluster of its own
    "test_launch_environment.py": 105,  # ~6 torchrun launches (a restart, pmix sbatch, preemption), 9 refusals
    "test_resume_and_stall.py": 71,  # one 2-rank run stopped and resumed on 1 rank, the real watchdog
    "test_broken_nodes.py": 25,  # install.sh --plan with stand-in nvidia-smi, train in a small /dev/shm
    "test_time_breakdown.py": 218,  # 3 one-rank runs, 2 two-rank horovodrun and 3 two-rank torchrun launches (a stop
    # and its resume with both sinks)
    "test_sinks.py": 172,  # a one-rank run logging to MLflow and W&B offline, and its resume
    "test_progressive.py": 212,  # a 2-rank torchrun and a 2-rank horovodrun (DALI) run, each stopped and resumed
    "test_gpu_harness.py": 147,  # stand-in GPU check sessions, the resume driver, the forced-hooks row's command
    "test_recipes.py": 312,  # a 2-rank torchrun and a 2-rank horovodrun run, each stopped and resumed
    "test_stopped_commands.py": 238,  # netns clusters killed at 4 points, bench/experiment killed, plugins
    "test_after_training.py": 300,  # a 2-rank torchrun and a 2-rank horovodrun run, ~20 evaluate/classify/export
    # processes, 2 of them 2-rank
    "test_atomic_writes.py": 65,  # 8 writers SIGKILLed mid-write (a torch import each)
    "test_crafted_archives.py": 21,  # crafted archives, a tmpfs filled mid-run, a read-only bind mount
    "test_experiments.py": 203,  # the optimizers and recipes experiments, each a few one-rank runs
    "test_scale_predict.py": 102,  # scale rows on 1-2 ranks and the bench sweep predict reads
    "test_bad_input.py": 78,  # ~20 refused commands, 2 launches
    "test_outputs_and_tools.py": 73,  # a hung rank, the tools' refusals
    "test_report.py": 70,  # one-rank trainings writing their report and TensorBoard scalars
}


@pytest.hookimpl(trylast=True)  # after pytest's own reordering (fixtures): the files' order is the last word
def pytest_collection_modifyitems(config, items):
    """The heaviest files first (FILE_WEIGHTS); each file's tests stay together and in their order (a stable sort)."""
    items.sort(key=lambda item: -FILE_WEIGHTS.get(os.path.basename(item.nodeid.split("::", 1)[0]), 0))


def needs_cluster(test):
    """A test of the cluster in a box (tools/cluster/netns.py): it needs root, iproute2 and openssh-server, and
    it takes turns with the other files' cluster tests (cluster_box)."""
    from tools.cluster import netns as cluster
    missing = os.geteuid() != 0 or not all(shutil.which(t) for t in cluster.TOOLS) or not os.path.exists(cluster.SSHD)
    return pytest.mark.usefixtures("cluster_box")(pytest.mark.skipif(
        missing, reason="needs root, iproute2 and openssh-server (HYBRIDTRAIN_SYSTEM_PACKAGES=1 ./install.sh installs "
                        "them)")(test))


@pytest.fixture(scope="module")
def cluster_box():
    """The cluster's namespaces (htc-h0, htc-h1, ...) are one per machine, and `make test` runs two files at a time:
    a file's cluster tests hold this lock from the first of them to the file's end, so that one file's `cluster down`
    never removes the hosts under the other's run (CI's failure: test_multihost's scale row lost its hosts to
    test_stopped_commands' SIGTERM tests)."""
    import fcntl
    with open(os.path.join("/tmp", "hybridtrain-tests-cluster.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def venv_without(root, excluded: list[str]) -> str:
    """A real venv whose site-packages links every entry of this one except ``excluded`` (paths relative to
    site-packages, globs allowed, e.g. 'nvidia/dali'): importing those genuinely fails there. Returns its python."""
    from venvs import linked_venv
    return linked_venv(str(root), excluded)


def gpus_for_every_rank(ranks: int = 2) -> bool:
    """True when this host has a GPU for each of the test launches' ranks (at most 2)."""
    import torch
    return torch.cuda.device_count() >= ranks


# the options by which a command line starts several ranks: the launchers' (horovodrun, mpirun, torchrun, launch/*)
# and hybridtrain's own multi-rank commands (scale --np 1,2; the perf probes' --ranks 1,2)
RANK_OPTIONS = ("-np", "--np", "--ranks", "--max-np", "--nproc-per-node", "--nproc_per_node")


def launch_ranks(cmd) -> int:
    """How many ranks ``cmd`` runs at most: the largest count given to one of RANK_OPTIONS ('-np 2',
    '--nproc-per-node=2', '--np 1,2'), else 1. Counting too many only pins a job to the CPU as before."""
    args, most = [str(arg) for arg in cmd], 1
    for i, arg in enumerate(args):
        option, eq, value = arg.partition("=")
        if option not in RANK_OPTIONS:
            continue
        value = value if eq else (args[i + 1] if i + 1 < len(args) else "")
        most = max([most] + [int(part) for part in value.split(",") if part.strip().isdigit()])
    return most


def env_with_venv(ranks: int = 2) -> dict:
    """The venv first on PATH. A launch of ``ranks`` >= 2 ranks on a host with fewer GPUs than that is pinned to
    the CPU (CUDA_VISIBLE_DEVICES=''): the multi-rank tests are sized for the CPU, and two ranks on one GPU are
    refused (train.device, NCCL). A single process (``ranks=1``) keeps the GPUs, so what gpu-check runs on a
    1-GPU node really runs there. The default is the tests' multi-rank size: a caller that does not say keeps the
    pinning."""
    env = dict(os.environ)
    env["PATH"] = BIN + os.pathsep + env.get("PATH", "")
    env["PYTHONUNBUFFERED"] = "1"
    if ranks >= 2 and not gpus_for_every_rank(ranks):
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def run(cmd, timeout=600, cwd=None, ranks: int | None = None) -> subprocess.CompletedProcess:
    """``cmd`` with the venv's environment; ``ranks``: how many ranks it launches (default: ``launch_ranks``)."""
    ranks = launch_ranks(cmd) if ranks is None else ranks
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env_with_venv(ranks),
                          cwd=cwd or REPO, stdin=subprocess.DEVNULL)


def horovodrun(np_: int, args: list[str], timeout=600, program=(HYBRIDTRAIN,)) -> subprocess.CompletedProcess:
    """``hybridtrain ARGS`` (or ``program`` ARGS) on ``np_`` local ranks of the Horovod engine (horovodrun, Gloo)."""
    hosts = f"localhost:{np_}"
    return run([HOROVODRUN, "--gloo", "-np", str(np_), "-H", hosts, *program, *args], timeout=timeout, ranks=np_)


def torchrun(np_: int, args: list[str], timeout=600, program=(HYBRIDTRAIN,)) -> subprocess.CompletedProcess:
    """``hybridtrain ARGS`` (or ``program`` ARGS) on ``np_`` local ranks of the torch engine (torchrun, Gloo on the
    CPU)."""
    return run([TORCHRUN, "--standalone", f"--nproc-per-node={np_}", "--no-python", *program, *args],
               timeout=timeout, ranks=np_)


def import_closure(label: str) -> tuple[str, ...]:
    """The program that runs ``hybridtrain`` in each rank and leaves LABEL-PID.json, the modules it imported from the
    checkout (tests/scripts/import_closure.py)."""
    return sys.executable, os.path.join(REPO, "tests", "scripts", "import_closure.py"), label


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "hybridtrain: error:" in line]


def rank_output(stderr: str) -> str:
    """What the ranks printed; horovodrun prefixes it '[N]<stderr>:' (its own launcher lines are not ours)."""
    prefixed = [line for line in stderr.splitlines() if re.match(r"^\[\d+\]<std(err|out)>:", line)]
    return "\n".join(prefixed) if prefixed else stderr


def assert_one_error_line(proc: subprocess.CompletedProcess, *needles: str) -> str:
    assert proc.returncode != 0, proc.stdout + proc.stderr
    output = proc.stdout + "\n" + proc.stderr  # horovodrun forwards rank stderr to its stdout
    assert "Traceback" not in rank_output(output), output
    lines = error_lines(output)
    assert len(lines) == 1, proc.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def read_metrics(run_dir: str) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
        return [json.loads(line) for line in fh if line.strip()]


@pytest.fixture(scope="session")
def digits_dir(tmp_path_factory) -> str:
    from hybridtrain.data.prepare.digits import prepare_digits
    out = str(tmp_path_factory.mktemp("data") / "digits")
    prepare_digits(out)
    return out


@pytest.fixture(scope="session")
def small_digits(digits_dir, tmp_path_factory) -> str:
    """A quick subset: 24 train and 7 val images per class (240 / 70 images, 70 not divisible by batches)."""
    return digits_subset(digits_dir, str(tmp_path_factory.mktemp("data") / "small"), 24, 7)


def digits_subset(source: str, out: str, train_per_class: int, val_per_class: int) -> str:
    """The first images of each class of ``source``, copied to ``out``."""
    for split, per_class in (("train", train_per_class), ("val", val_per_class)):
        for cls in sorted(os.listdir(os.path.join(source, split))):
            dst = os.path.join(out, split, cls)
            os.makedirs(dst)
            for name in sorted(os.listdir(os.path.join(source, split, cls)))[:per_class]:
                shutil.copy(os.path.join(source, split, cls, name), os.path.join(dst, name))
    return out


def tiny_config(data_path: str, run_dir: str, **sections) -> dict:
    cfg = {
        "run_dir": run_dir, "seed": 3,
        "data": {"path": data_path, "crop_size": 32, "val_resize": 32, "min_crop_area": 0.5, "hflip": False},
        "model": {"arch": "resnet18"},
        "train": {"epochs": 2, "batch_size": 16, "threads": 1, "progress": False},
        "optim": {"name": "goyal", "lr": 0.05, "warmup_epochs": 1},
    }
    for section, values in sections.items():
        if isinstance(values, dict):
            cfg.setdefault(section, {}).update(values)
        else:
            cfg[section] = values
    data = cfg["data"]
    if data.get("backend", "torchvision") != "torchvision":
        data.setdefault("workers", 1)  # DALI's threads
    elif "workers" not in data:
        # no loader processes to start (~3 s each per rank): the same batches. The tests of the workers
        # themselves, and the runs that kill, stop or resize ranks under them, ask for WITH_WORKERS.
        data.setdefault("in_process", True)
    return cfg


@pytest.fixture
def job_of_one():
    """This process alone as a job of the torch engine (no launcher, no port): what the trainer's step and the
    collectives need in-process (a collective before init is an error)."""
    from benchmarks.step_bench import job_of_one as alone
    with alone():
        yield


WITH_WORKERS = {"workers": 1}  # tiny_config(..., data=WITH_WORKERS): one spawned loader worker per loader


@pytest.fixture
def write_config(tmp_path):
    def write(cfg: dict, name: str = "config.yaml") -> str:
        path = tmp_path / name
        path.write_text(yaml.safe_dump(cfg))
        return str(path)
    return write

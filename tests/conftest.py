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


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: several real training runs (minutes); make test and .ci/run include "
                                       "it, -m 'not slow' leaves it out")


def venv_without(root, excluded: list[str]) -> str:
    """A real venv whose site-packages links every entry of this one except ``excluded`` (paths relative to
    site-packages, globs allowed, e.g. 'nvidia/dali'): importing those genuinely fails there. Returns its python."""
    import fnmatch
    import site
    import venv
    from pathlib import Path
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


def gpus_for_every_rank(ranks: int = 2) -> bool:
    """True when this host has a GPU for each of the test launches' ranks (at most 2)."""
    import torch
    return torch.cuda.device_count() >= ranks


def env_with_venv() -> dict:
    """The venv first on PATH. On a host with fewer GPUs than the 2-rank tests need, every launched process is
    pinned to the CPU (CUDA_VISIBLE_DEVICES=''): the tests are sized for the CPU, and two ranks on one GPU are
    refused (train.device, NCCL)."""
    env = dict(os.environ)
    env["PATH"] = BIN + os.pathsep + env.get("PATH", "")
    env["PYTHONUNBUFFERED"] = "1"
    if not gpus_for_every_rank():
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def run(cmd, timeout=600, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env_with_venv(),
                          cwd=cwd or REPO, stdin=subprocess.DEVNULL)


def horovodrun(np_: int, args: list[str], timeout=600) -> subprocess.CompletedProcess:
    hosts = f"localhost:{np_}"
    return run([HOROVODRUN, "--gloo", "-np", str(np_), "-H", hosts, HYBRIDTRAIN, *args], timeout=timeout)


def torchrun(np_: int, args: list[str], timeout=600) -> subprocess.CompletedProcess:
    """``hybridtrain ARGS`` on ``np_`` local ranks of the torch engine (torchrun, Gloo on the CPU)."""
    return run([TORCHRUN, "--standalone", f"--nproc-per-node={np_}", "--no-python", HYBRIDTRAIN, *args],
               timeout=timeout)


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


WITH_WORKERS = {"workers": 1}  # tiny_config(..., data=WITH_WORKERS): one spawned loader worker per loader


@pytest.fixture
def write_config(tmp_path):
    def write(cfg: dict, name: str = "config.yaml") -> str:
        path = tmp_path / name
        path.write_text(yaml.safe_dump(cfg))
        return str(path)
    return write

"""The smoke subset under the oldest torch the code supports (docs/hardware.md: 2.3), in the second virtual
environment that ``make test`` makes with ./install.sh (HYBRIDTRAIN_TORCH=2.3.1, no Horovod, no DALI), on the
torch engine: 2 ranks trained in fp32 and in mixed FP16, channels_last, a resume, and a strict torchvision load.
NGC images and site installs carry torch releases older than our pin; this is where their code paths run."""
from __future__ import annotations

import json
import os
import subprocess

import pytest
import yaml
from conftest import CACHE, REPO, digits_subset, env_with_venv, read_metrics, tiny_config

OLDEST_TORCH = "2.3.1"
VENV = os.environ.get("HYBRIDTRAIN_OLDEST_VENV") or os.path.join(CACHE, "venv-oldest-torch")  # the Makefile's
BIN = os.path.join(VENV, "bin")

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    not os.path.exists(os.path.join(BIN, "torchrun")),
    reason=f"no {VENV}: make test makes it (make install-oldest-torch)")]


def oldest(args: list[str], timeout: int = 600) -> subprocess.CompletedProcess:
    env = env_with_venv()
    env["PATH"] = BIN + os.pathsep + env["PATH"]
    env["PYTHONPATH"] = REPO  # this checkout, whatever the venv's editable install points at
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO,
                          stdin=subprocess.DEVNULL)


def torchrun(config: str, *extra: str) -> subprocess.CompletedProcess:
    proc = oldest([os.path.join(BIN, "torchrun"), "--standalone", "--nproc-per-node=2", "-m", "hybridtrain", "train",
                   "--config", config, "--engine", "torch", *extra])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def test_the_venv_holds_the_oldest_torch():
    proc = oldest([os.path.join(BIN, "python"), "-c", "import torch; print(torch.__version__)"])
    assert proc.stdout.strip().startswith(OLDEST_TORCH), proc.stdout + proc.stderr


def test_two_ranks_fp32_and_mixed_channels_last_a_resume_and_a_strict_load(small_digits, tmp_path):
    few = digits_subset(small_digits, str(tmp_path / "few"), 8, 3)  # 5 steps of 2 x 8 per epoch
    configs = {}
    for name, precision in (("fp32", {"mode": "fp32"}), ("mixed", {"mode": "mixed", "compute_dtype": "fp16"})):
        cfg = tiny_config(few, str(tmp_path / name), train={"epochs": 1, "batch_size": 8},
                          optim={"name": "sgd"}, precision=precision, data={"channels_last": True})
        configs[name] = tmp_path / f"{name}.yaml"
        configs[name].write_text(yaml.safe_dump(cfg))
    fp32 = torchrun(str(configs["fp32"]))
    assert "2 rank(s) of the torch engine" in fp32.stdout and "channels_last" in fp32.stdout
    mixed = torchrun(str(configs["mixed"]))
    assert "mixed precision" in mixed.stdout and "compression fp16" in mixed.stdout  # scaled: the FP16 wire
    assert read_metrics(str(tmp_path / "mixed"))[0]["loss_scale"] > 1

    resumed = torchrun(str(configs["fp32"]), "--set", "train.epochs=2", "--resume", "auto")
    assert "resumed from epoch 1" in resumed.stdout
    assert [r["epoch"] for r in read_metrics(str(tmp_path / "fp32"))] == [1, 2]
    report = json.loads((tmp_path / "fp32" / "report.json").read_text())
    assert len(set(report["rank_digests"])) == 1

    load = oldest([os.path.join(BIN, "python"), "-c",
                   "import sys, torch, torchvision; m = torchvision.models.resnet18(num_classes=10); "
                   "m.load_state_dict(torch.load(sys.argv[1], map_location='cpu', weights_only=True), strict=True)",
                   str(tmp_path / "fp32" / "final_model.pt")])
    assert load.returncode == 0, load.stderr[-2000:]

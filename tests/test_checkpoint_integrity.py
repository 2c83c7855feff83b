"""Checkpoint integrity and safety, with real runs: truncate, flip, edit, plant, fill the disk, then resume.

Every case trains or resumes with the real ``hybridtrain train`` (1 rank) and damages real files on disk.
"""
from __future__ import annotations

import glob
import os
import resource
import shutil
import signal
import subprocess
import sys

import pytest
import torch
import yaml
from conftest import HYBRIDTRAIN, REPO, assert_one_error_line, env_with_venv, read_metrics, tiny_config

from hybridtrain.engine import rundir
from hybridtrain.engine.checkpoint import checksum_path, file_sha256, load_checkpoint, verify_checksum

FILE_SIZE_LIMIT = 32 << 20  # below a resnet18 checkpoint (~90 MB), above what MPI's startup writes


def checkpoint(run_dir, epoch: int) -> str:
    return os.path.join(str(run_dir), f"checkpoint-epoch{epoch:04d}.pt")


def train(config: str, *extra: str, preexec_fn=None) -> subprocess.CompletedProcess:
    return subprocess.run([HYBRIDTRAIN, "train", "--config", config, *extra], capture_output=True, text=True,
                          timeout=600, env=env_with_venv(), cwd=REPO, stdin=subprocess.DEVNULL, preexec_fn=preexec_fn)


def write_yaml(cfg: dict, path) -> str:
    with open(path, "w") as fh:
        yaml.safe_dump(cfg, fh)
    return str(path)


@pytest.fixture(scope="module")
def trained_run(small_digits, tmp_path_factory) -> dict:
    """The config of a finished 2-epoch run: checkpoints of epochs 1 and 2 with their .sha256 files."""
    root = tmp_path_factory.mktemp("trained")
    cfg = tiny_config(small_digits, str(root / "run"), train={"epochs": 2})
    proc = train(write_yaml(cfg, root / "config.yaml"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert all(os.path.exists(checksum_path(checkpoint(cfg["run_dir"], e))) for e in (1, 2))
    return cfg


def copy_run(trained: dict, tmp_path, **train_overrides) -> tuple[str, str]:
    """A copy of the trained run's directory and a config pointing at it: (config path, run_dir)."""
    run_dir = str(tmp_path / "run")
    shutil.copytree(trained["run_dir"], run_dir)
    cfg = dict(trained, run_dir=run_dir, train=dict(trained["train"], **train_overrides))
    return write_yaml(cfg, tmp_path / "config.yaml"), run_dir


def skip_warnings(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("hybridtrain: warning: skipping checkpoint")]


def assert_skipped_and_resumed_from_epoch_1(config: str, run_dir: str, trained: dict, reason: str) -> None:
    """--resume names the bad epoch-2 checkpoint, resumes from epoch 1 and ends where the undamaged run ended."""
    proc = train(config, "--resume")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    warnings = skip_warnings(proc.stderr)
    assert len(warnings) == 1 and checkpoint(run_dir, 2) in warnings[0] and reason in warnings[0], proc.stderr
    assert "resumed from epoch 1" in proc.stdout
    assert [r["epoch"] for r in read_metrics(run_dir)] == [1, 2]
    assert load_checkpoint(checkpoint(run_dir, 2))["epoch"] == 1 and verify_checksum(checkpoint(run_dir, 2))
    ours, theirs = (torch.load(os.path.join(d, "final_model.pt"), weights_only=True)
                    for d in (run_dir, trained["run_dir"]))
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs), "the resumed run differs from the undamaged one"


@pytest.mark.slow
def test_truncated_newest_checkpoint_is_named_and_skipped_for_the_previous(trained_run, tmp_path):
    config, run_dir = copy_run(trained_run, tmp_path)
    newest = checkpoint(run_dir, 2)
    os.truncate(newest, os.path.getsize(newest) // 2)
    assert_skipped_and_resumed_from_epoch_1(config, run_dir, trained_run, "corrupted or truncated")


@pytest.mark.slow
def test_flipped_byte_in_newest_checkpoint_is_named_and_skipped_for_the_previous(trained_run, tmp_path):
    config, run_dir = copy_run(trained_run, tmp_path)
    newest = checkpoint(run_dir, 2)
    with open(newest, "r+b") as fh:
        fh.seek(os.path.getsize(newest) // 2)  # inside a tensor: torch.load alone would not notice
        byte = fh.read(1)
        fh.seek(-1, os.SEEK_CUR)
        fh.write(bytes([byte[0] ^ 0xFF]))
    assert_skipped_and_resumed_from_epoch_1(config, run_dir, trained_run, "does not match")


@pytest.mark.slow
def test_edited_and_resaved_checkpoint_fails_its_checksum(trained_run, tmp_path):
    config, run_dir = copy_run(trained_run, tmp_path)
    newest = checkpoint(run_dir, 2)
    state = torch.load(newest, weights_only=True)
    state["model"]["fc.bias"] += 1.0
    torch.save(state, newest)  # a valid pickle; its .sha256 still describes the original bytes
    assert torch.load(newest, weights_only=True)["epoch"] == 1
    assert_skipped_and_resumed_from_epoch_1(config, run_dir, trained_run, "does not match")


class RunsCodeWhenUnpickled:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def plant_malicious_checkpoint(path: str, marker: str, with_checksum: bool) -> None:
    """A checkpoint whose unpickling runs ``touch marker``; proven by loading a copy unsafely in a child."""
    torch.save({"model": {}, "epoch": 9, "payload": RunsCodeWhenUnpickled(marker)}, path)
    unsafe = subprocess.run([sys.executable, "-c", f"import torch; torch.load({path!r}, weights_only=False)"],
                            capture_output=True, text=True)
    assert os.path.exists(marker), f"the planted file does not run code: {unsafe.stderr[-2000:]}"
    os.remove(marker)
    if with_checksum:  # whoever planted it can write a matching .sha256 too: weights_only must still refuse it
        with open(checksum_path(path), "w") as fh:
            fh.write(f"{file_sha256(path)}  {os.path.basename(path)}\n")


@pytest.mark.slow
def test_planted_malicious_pickle_is_refused_and_skipped_for_the_previous(trained_run, tmp_path):
    config, run_dir = copy_run(trained_run, tmp_path, epochs=3)
    marker, planted = str(tmp_path / "code-ran"), checkpoint(run_dir, 3)
    plant_malicious_checkpoint(planted, marker, with_checksum=True)
    proc = train(config, "--resume")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not os.path.exists(marker), "the planted checkpoint ran code"
    warnings = skip_warnings(proc.stderr)
    assert len(warnings) == 1 and planted in warnings[0] and "refused" in warnings[0] and "system" in warnings[0]
    assert "resumed from epoch 2" in proc.stdout
    assert load_checkpoint(planted)["epoch"] == 2, "epoch 3's real checkpoint replaces the planted one"


@pytest.mark.slow
def test_planted_malicious_pickle_alone_is_one_error_line(small_digits, tmp_path, write_config):
    run_dir, marker = tmp_path / "run", str(tmp_path / "code-ran")
    run_dir.mkdir()
    planted = checkpoint(run_dir, 1)
    plant_malicious_checkpoint(planted, marker, with_checksum=False)
    proc = train(write_config(tiny_config(small_digits, str(run_dir))), "--resume")
    assert_one_error_line(proc, "no usable checkpoint", "checkpoint-epoch0001.pt", "refused", "start fresh")
    assert f"warning: {planted} has no checkpoint-epoch0001.pt.sha256" in proc.stderr
    assert not os.path.exists(marker), "the planted checkpoint ran code"


def limit_file_size() -> None:
    """preexec_fn: writes beyond FILE_SIZE_LIMIT fail with EFBIG, as on a full disk (SIGXFSZ ignored)."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (FILE_SIZE_LIMIT, FILE_SIZE_LIMIT))


@pytest.mark.slow
def test_full_disk_while_saving_keeps_the_previous_checkpoint_and_is_one_error_line(trained_run, tmp_path):
    config, run_dir = copy_run(trained_run, tmp_path, keep_checkpoints=1)
    for path in (checkpoint(run_dir, 2), checksum_path(checkpoint(run_dir, 2))):
        os.remove(path)  # as if the run had stopped after epoch 1
    previous = checkpoint(run_dir, 1)
    assert os.path.getsize(previous) > FILE_SIZE_LIMIT
    digest = file_sha256(previous)

    full = train(config, "--resume", preexec_fn=limit_file_size)
    assert_one_error_line(full, "could not write checkpoint", checkpoint(run_dir, 2), "File too large",
                          "free disk space", "previous checkpoint is intact")
    assert file_sha256(previous) == digest and verify_checksum(previous) and load_checkpoint(previous)["epoch"] == 0
    assert not os.path.exists(checkpoint(run_dir, 2)) and not glob.glob(os.path.join(run_dir, "*.tmp-*"))

    again = train(config, "--resume")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed from epoch 1" in again.stdout and [r["epoch"] for r in read_metrics(run_dir)] == [1, 2]
    assert not os.path.exists(previous), "keep_checkpoints=1 prunes epoch 1 once epoch 2 is durable"


SAVE_UNDER_A_FILE_SIZE_LIMIT = """
import resource, signal, sys, torch
from hybridtrain.engine import rundir
from hybridtrain.cli import run_guarded
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
owner, _ = rundir.claim(sys.argv[1], "required")
sys.exit(run_guarded(lambda: owner.save_checkpoint({"model": {"w": torch.zeros(1 << 20)}, "epoch": 2}, 3, 1)))
"""


def test_old_checkpoints_are_pruned_only_after_the_new_one_is_durable(tmp_path):
    run_dir = str(tmp_path)
    owner, _ = rundir.claim(run_dir, None)
    for epoch in (1, 2):
        owner.save_checkpoint({"model": {"w": torch.full((4,), float(epoch))}, "epoch": epoch - 1}, epoch, keep=3)
    owner.release()
    killed_save = checkpoint(run_dir, 3) + ".tmp-999999"
    open(killed_save, "wb").close()
    before = sorted(os.listdir(run_dir))

    proc = subprocess.run([sys.executable, "-c", SAVE_UNDER_A_FILE_SIZE_LIMIT, run_dir], capture_output=True,
                          text=True, env=env_with_venv(), cwd=REPO)
    assert_one_error_line(proc, "could not write checkpoint", "File too large")
    # the claim removed the killed save's temp file; the failed save removed nothing and left nothing
    assert sorted(os.listdir(run_dir)) == [n for n in before if n != os.path.basename(killed_save)]

    owner, _ = rundir.claim(run_dir, "required")
    owner.save_checkpoint({"model": {"w": torch.zeros(1 << 20)}, "epoch": 2}, 3, keep=1)
    owner.release()
    assert sorted(os.listdir(run_dir)) == [".lock", "checkpoint-epoch0003.pt", "checkpoint-epoch0003.pt.sha256",
                                           "run.json"]
    assert verify_checksum(checkpoint(run_dir, 3))


@pytest.fixture
def nine_class_digits(small_digits, tmp_path) -> str:
    data = tmp_path / "nine"
    shutil.copytree(small_digits, data)
    for split in ("train", "val"):
        shutil.rmtree(data / split / "9")
    return str(data)


@pytest.mark.slow
def test_resume_into_a_model_with_another_class_count_is_one_error_line(trained_run, nine_class_digits, tmp_path):
    config, _ = copy_run(trained_run, tmp_path)
    proc = train(config, "--resume", "--set", f"data.path={nine_class_digits}")
    assert_one_error_line(proc, "does not fit this model", "fc.weight is [10, 512] in the checkpoint but [9, 512]")


@pytest.mark.slow
def test_a_config_changed_at_resume_names_each_key_from_what_to_what_and_whether_it_applies(trained_run, tmp_path):
    """The finished 2-epoch run resumed for a third epoch with a new learning rate and convolution init: one line
    names each changed key with its old and new value; the init's does not apply (the checkpoint's weights load)."""
    config, run_dir = copy_run(trained_run, tmp_path)
    proc = train(config, "--resume", "--set", "train.epochs=3", "--set", "optim.lr=0.06", "--set",
                 "model.conv_init=xavier")
    assert proc.returncode == 0, proc.stderr[-3000:]
    (line,) = [x for x in proc.stdout.splitlines() if "the config differs from the checkpoint's" in x]
    assert line == ("hybridtrain: warning: the config differs from the checkpoint's: optim.lr 0.05 -> 0.06, "
                    "train.epochs 2 -> 3 (applies from here on); model.conv_init kaiming -> xavier (does not apply: "
                    "it shapes the initial weights, and the checkpoint's are loaded)"), line
    assert [r["epoch"] for r in read_metrics(run_dir)] == [1, 2, 3]


def test_resume_with_another_optimizer_is_one_error_line(trained_run, tmp_path):
    config, _ = copy_run(trained_run, tmp_path, epochs=3)
    proc = train(config, "--resume", "--set", "optim.name=hybrid", "--set", "optim.adabound_epochs=1")
    assert_one_error_line(proc, "optimizer state does not fit", "optim.name=goyal")


def test_the_run_state_is_the_trainers_and_a_checkpoint_keeps_its_keys():
    """Trainer.state_dict is what a checkpoint holds (its keys and order as before) and what a resume or an elastic
    roll-back restores: after more steps and a new loss scale, loading a snapshot gives it back bit for bit."""
    import copy
    from types import SimpleNamespace

    from hybridtrain.config import load_config
    from hybridtrain.engine.resume import checkpoint_state
    from hybridtrain.engine.trainer import Trainer
    from hybridtrain.optim import create_optimizer
    from hybridtrain.precision.policy import resolve_policy
    from hybridtrain.precision.scaler import create_scaler

    cfg = load_config(os.path.join(REPO, "configs", "demo.yaml"))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.Flatten(),
                                torch.nn.Linear(4 * 6 * 6, 3))
    bundle = create_optimizer(model, cfg, 1, 4)
    scaler = create_scaler(cfg.precision, resolve_policy(cfg.precision))
    t = Trainer(None, None, model, SimpleNamespace(scaler=scaler), bundle, 4, 1, 2, None)

    def steps(n):
        for _ in range(n):
            bundle.optimizer.zero_grad()
            model(torch.randn(2, 3, 8, 8)).square().mean().backward()
            bundle.optimizer.step()
    steps(2)
    saved = copy.deepcopy(t.state_dict())
    steps(3)
    scaler.set_scale(7.0)
    moved = t.state_dict()
    assert not all(torch.equal(moved["model"][key], tensor) for key, tensor in saved["model"].items())
    t.load_state_dict({**copy.deepcopy(saved), "config": cfg.to_dict(), "epoch": 0})
    again = t.state_dict()
    assert list(saved) == ["model", "optimizer", "scaler"] and again["scaler"] == saved["scaler"]
    for key, tensor in saved["model"].items():
        assert torch.equal(again["model"][key], tensor), key
    compared = 0
    for param, buffers in saved["optimizer"]["state"].items():
        for key, value in buffers.items():
            assert torch.equal(torch.as_tensor(again["optimizer"]["state"][param][key]), torch.as_tensor(value))
            compared += 1
    assert compared and again["optimizer"]["param_groups"] == saved["optimizer"]["param_groups"]
    state = checkpoint_state(cfg, t, 2, 5.0, {"epoch": 3})
    assert list(state) == ["model", "optimizer", "scaler", "epoch", "config", "config_fingerprint", "elapsed_s",
                           "pending_record"]

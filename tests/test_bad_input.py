"""Bad input gives one clear error line (or a logged skip), never a traceback or a hang. Real processes."""
from __future__ import annotations

import os
import shutil
import sys

import pytest
import yaml
from conftest import HYBRIDTRAIN, assert_one_error_line, command, horovodrun, run, tiny_config


def train(cfg_path, *extra, timeout=300):
    return run([HYBRIDTRAIN, "train", "--config", cfg_path, *extra], timeout=timeout)


def copy_dataset(src: str, dst) -> str:
    shutil.copytree(src, dst)
    return str(dst)


def test_missing_data_directory(tmp_path, write_config):
    proc = train(write_config(tiny_config(str(tmp_path / "nowhere"), str(tmp_path / "run"))))
    assert_one_error_line(proc, "data directory not found", "prepare-data")


def test_empty_data_directory(tmp_path, write_config):
    (tmp_path / "empty").mkdir()
    proc = train(write_config(tiny_config(str(tmp_path / "empty"), str(tmp_path / "run"))))
    assert_one_error_line(proc, "has no 'train' folder")


def test_class_folder_without_images(small_digits, tmp_path, write_config):
    data = copy_dataset(small_digits, tmp_path / "d")
    os.makedirs(os.path.join(data, "train", "zz"))
    os.makedirs(os.path.join(data, "val", "zz"))
    proc = train(write_config(tiny_config(data, str(tmp_path / "run"))))
    assert_one_error_line(proc, "class folder", "has no images")


def test_train_and_val_classes_differ(small_digits, tmp_path, write_config):
    data = copy_dataset(small_digits, tmp_path / "d")
    shutil.rmtree(os.path.join(data, "val", "9"))
    proc = train(write_config(tiny_config(data, str(tmp_path / "run"))))
    assert_one_error_line(proc, "class folders differ")


def test_config_typo_and_batch_size_zero(small_digits, tmp_path, write_config):
    cfg = write_config(tiny_config(small_digits, str(tmp_path / "run")))
    assert_one_error_line(train(cfg, "--set", "train.epoch=3"), "unknown key 'train.epoch'", "train.epochs")
    assert_one_error_line(train(cfg, "--set", "train.batch_size=0"), "train.batch_size")


def test_config_typo_under_horovodrun_is_one_line(small_digits, tmp_path, write_config):
    cfg = write_config(tiny_config(small_digits, str(tmp_path / "run")))
    proc = horovodrun(2, ["train", "--config", cfg, "--set", "optim.nmae=sgd"], timeout=120)
    assert_one_error_line(proc, "unknown key 'optim.nmae'", "optim.name")


def test_resume_without_checkpoint(small_digits, tmp_path, write_config):
    proc = train(write_config(tiny_config(small_digits, str(tmp_path / "run"))), "--resume")
    assert_one_error_line(proc, "no checkpoint", "without --resume")


def test_resume_without_checkpoint_two_ranks_does_not_hang(small_digits, tmp_path, write_config):
    proc = horovodrun(2, ["train", "--config", write_config(tiny_config(small_digits, str(tmp_path / "run"))),
                          "--resume"], timeout=120)
    assert_one_error_line(proc, "no checkpoint")


def test_missing_config_file(tmp_path):
    assert_one_error_line(train(str(tmp_path / "nope.yaml")), "config file not found")


def test_non_image_file_is_skipped_with_a_log_line(small_digits, tmp_path, write_config):
    data = copy_dataset(small_digits, tmp_path / "d")
    (tmp_path / "d" / "train" / "3" / "README.txt").write_text("not an image")
    run_dir = str(tmp_path / "run")
    proc = train(write_config(tiny_config(data, run_dir, train={"epochs": 1}, optim={"warmup_epochs": 0.5})))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert "skipping 1 non-image file" in proc.stdout


def test_num_classes_mismatch(small_digits, tmp_path, write_config):
    cfg = write_config(tiny_config(small_digits, str(tmp_path / "run"), model={"arch": "resnet18", "num_classes": 7}))
    assert_one_error_line(train(cfg), "model.num_classes=7", "10 class folders")


@pytest.mark.parametrize("argv, needle", [(["train"], "--config"), (["prepare-data"], "DATASET")])
def test_command_line_usage_errors(argv, needle):
    proc = run([HYBRIDTRAIN, *argv])
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and needle in proc.stderr


def imported_modules(stderr: str) -> set[str]:
    """The modules a process run with ``python -X importtime`` imported (its stderr lists one per line)."""
    return {line.rsplit("|", 1)[1].strip() for line in stderr.splitlines() if line.startswith("import time:")}


def refused_without_torch(argv: list[str], *needles: str) -> str:
    """``hybridtrain ARGV`` (or the checkout's tool that runs ARGV) run by the venv's python with -X importtime:
    refused in one line, exit 2, and neither torch nor Horovod imported (the refusal does not wait ~5 s for them)."""
    program = command(argv)
    proc = run([sys.executable, "-X", "importtime", *program[program[0] == sys.executable:]], timeout=120)
    line = assert_one_error_line(proc, *needles)
    assert proc.returncode == 2, proc.stderr[-2000:]
    modules = imported_modules(proc.stderr)
    assert {"yaml", "hybridtrain.config"} <= modules, "the import listing was read"
    heavy = sorted(m for m in modules if m.split(".")[0] in ("torch", "horovod", "torchvision"))
    assert not heavy, f"imported before the refusal: {heavy[:5]}"
    return line


def test_train_refuses_a_config_typo_before_importing_torch(tmp_path, write_config):
    """The recipe, its --set overrides, its paths and the command line are checked before torch or
    Horovod is imported, with the same line and exit status as before."""
    cfg = tiny_config(str(tmp_path / "data"), str(tmp_path / "run"))
    (tmp_path / "data").mkdir()
    good = write_config(cfg)
    cfg["train"]["epochz"] = 3  # a typo'd key in the YAML file
    typo = write_config(cfg, "typo.yaml")
    refused_without_torch(["train", "--config", typo], "unknown key 'train.epochz'", "train.epochs")
    refused_without_torch(["train", "--config", good, "--set", "optim.lrr=1"], "unknown key 'optim.lrr'", "optim.lr")
    refused_without_torch(["train", "--config", good, "--set", "data.path=" + str(tmp_path / "nowhere")],
                          "data directory not found")
    refused_without_torch(["train", "--config", good, "--resume", "sometimes"], "--resume takes no value or 'auto'")
    refused_without_torch(["train", "--config", str(tmp_path / "nope.yaml")], "config file not found")


@pytest.mark.parametrize("argv", [["bench"], ["bench", "--precision", "fp16_pure", "--batch-size", "4"],
                                  ["bench-optim"], ["plot-schedule", "--out", "SCHEDULE"],
                                  ["experiment", "lars", "--out", "EXPERIMENT"], ["scale", "--out", "SCALE"]])
def test_the_other_commands_refuse_a_config_typo_before_importing_torch(argv, tmp_path):
    config = tmp_path / "recipe.yaml"
    config.write_text(yaml.safe_dump({"train": {"epochs": 2}}))
    argv = [str(tmp_path / a) if a.isupper() else a for a in argv]
    refused_without_torch([*argv, "--config", str(config), "--set", "optim.lrr=1"], "unknown key 'optim.lrr'")
    assert os.listdir(tmp_path) == ["recipe.yaml"]  # nothing written

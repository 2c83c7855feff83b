"""Bad input gives one clear error line (or a logged skip), never a traceback or a hang. Real processes."""
from __future__ import annotations

import os
import shutil

import pytest
from conftest import HYBRIDTRAIN, assert_one_error_line, horovodrun, run, tiny_config


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

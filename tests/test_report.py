"""`hybridtrain report` on run directories with known metrics, and TensorBoard scalars from a real run."""
from __future__ import annotations

import json
import os

import pytest
import yaml
from conftest import HYBRIDTRAIN, assert_one_error_line, run


def write_run(run_dir, top1, top5, world_size=4, samples=1000, train_s=10.0, epoch_s=12.0):
    """A run directory whose figures are known: each epoch trains 10 s and takes 12 s in all."""
    os.makedirs(run_dir)
    with open(os.path.join(run_dir, "metrics.jsonl"), "w") as fh:
        for e, (a, b) in enumerate(zip(top1, top5), start=1):
            fh.write(json.dumps({"epoch": e, "train_loss": 1.0, "train_top1": a, "val_loss": 1.0, "val_top1": a,
                                 "val_top5": b, "lr": 0.1 * e, "epoch_time_s": epoch_s, "train_time_s": train_s,
                                 "images_per_sec": samples / train_s, "samples_seen": samples,
                                 "wall_time_s": epoch_s * e, "world_size": world_size}) + "\n")
    with open(os.path.join(run_dir, "config.yaml"), "w") as fh:
        yaml.safe_dump({"report": {"top1_target": 0.75, "top5_target": 0.93}}, fh)
    return str(run_dir)


BREAKDOWN = {"input": 1.0, "compute": 6.0, "communication": 1.0, "optimizer": 1.0, "validation": 1.5,
             "checkpoint": 0.5, "other": 1.0}
DAMAGED_FIELDS = [  # (what the record holds, the field the line names)
    ({"breakdown_s": {**BREAKDOWN, "compute": "6.0"}}, "breakdown_s.compute is \"6.0\", not a number of seconds"),
    ({"breakdown_s": "compute 50%"}, "breakdown_s is \"compute 50%\", not a mapping"),
    ({"startup_s": {"imports": 1.0, "first_step": 2.0}}, "startup_s is {\"imports\": 1.0, \"first_step\": 2.0}"),
    ({"startup_s": {"imports": None, "total": 3.0}}, "startup_s.imports is null, not a number of seconds"),
    ({"slowest_rank": "1"}, "slowest_rank is \"1\", not a rank"),
    ({"dominant": "gpu"}, "dominant is \"gpu\", not one of input"),
    ({"val_top1_ema": "0.5"}, "val_top1_ema is \"0.5\", not a number"),
    ({"train_resolution": 1.5}, "train_resolution is 1.5, not a size in pixels"),
]


@pytest.mark.parametrize("fields, needle", DAMAGED_FIELDS, ids=[n.split(" ")[0] for _, n in DAMAGED_FIELDS])
def test_a_damaged_newer_field_is_one_line_naming_file_epoch_and_field(tmp_path, fields, needle):
    """A record's newer fields (the breakdown, the start-up, the EMA's and progressive resizing's figures) damaged by
    hand or by another tool: one line naming metrics.jsonl, the record and its epoch, and the field; never a bug."""
    run_dir = write_run(tmp_path / "run", [0.5, 0.7], [0.8, 0.9])
    path = os.path.join(run_dir, "metrics.jsonl")
    records = [json.loads(line) for line in open(path)]
    records[0].update(breakdown_s=BREAKDOWN, startup_s={"imports": 1.0, "total": 1.0})  # sound: read as before
    records[1].update(fields)
    with open(path, "w") as fh:
        fh.write("".join(json.dumps(r) + "\n" for r in records))
    line = assert_one_error_line(run([HYBRIDTRAIN, "report", run_dir]), f"{path} record 2 (epoch 2): {needle}",
                                 "restore the file, or remove that line")
    assert "bug" not in line


def test_report_figures_match_hand_computation(tmp_path):
    run_dir = write_run(tmp_path / "run", [0.5, 0.7, 0.76, 0.8], [0.8, 0.9, 0.94, 0.95])
    proc = run([HYBRIDTRAIN, "report", run_dir, "--single-gpu-speed", "26"])
    assert proc.returncode == 0, proc.stderr
    r = json.load(open(os.path.join(run_dir, "report.json")))
    assert r["convergence_epoch"] == 3 and r["convergence_epoch_top5"] == 3
    assert r["actual_training_time_s"] == 36.0  # end of epoch 3: 3 x 12 s
    assert r["actual_training_time_without_eval_s"] == 30.0  # minus 3 x (12 - 10) s of evaluation
    assert r["actual_avg_single_gpu_time_s"] == 36.0 * 4  # x N
    assert r["images_per_sec"] == 100.0  # 1000 images / 10 s
    assert r["scaling_efficiency"] == pytest.approx(100.0 / (4 * 26))
    assert r["model_single_gpu_time_s"] == pytest.approx(3 * 1000 / (26 * (100 / 104)))  # E*I/(S1*eff)
    assert r["single_gpu_speed_source"].startswith("given")
    for png in ("accuracy.png", "throughput.png", "lr.png"):
        assert open(os.path.join(run_dir, png), "rb").read(4) == b"\x89PNG"
    md = open(os.path.join(run_dir, "report.md")).read()
    assert "| actual average single-GPU training time | 2.40 min (144.0 s) |" in md
    assert md.count("\n| 4 |") == 1  # the per-epoch table ends with epoch 4


def test_a_run_that_never_converges_says_so_and_runs_compare_side_by_side(tmp_path):
    slow = write_run(tmp_path / "slow", [0.2, 0.4], [0.5, 0.6], world_size=2)
    fast = write_run(tmp_path / "fast", [0.7, 0.9], [0.9, 0.99], world_size=2)
    out = tmp_path / "compare.md"
    proc = run([HYBRIDTRAIN, "report", slow, fast, "--out", str(out)])
    assert proc.returncode == 0, proc.stderr
    r = json.load(open(os.path.join(slow, "report.json")))
    assert r["convergence_epoch"] is None and r["actual_avg_single_gpu_time_s"] is None
    assert r["scaling_efficiency"] is None and "unknown" in r["single_gpu_speed_source"]
    table = out.read_text()
    assert table.startswith("| quantity | slow | fast |")
    assert "| actual average single-GPU training time | not reached | 0.80 min (48.0 s) |" in table


@pytest.mark.parametrize("args, needle", [(["--top1-target", "1.5"], "top-1 target must be in (0, 1]"),
                                          (["--single-gpu-speed", "0"], "--single-gpu-speed must be > 0")])
def test_bad_report_arguments_are_one_line(args, needle, tmp_path):
    run_dir = write_run(tmp_path / "run", [0.5], [0.9])
    assert_one_error_line(run([HYBRIDTRAIN, "report", run_dir, *args]), needle)


def test_a_directory_without_metrics_is_one_line(tmp_path):
    assert_one_error_line(run([HYBRIDTRAIN, "report", str(tmp_path)]), "has no metrics.jsonl")


def test_training_writes_its_report_and_tensorboard_scalars(small_digits, tmp_path, write_config):
    from conftest import tiny_config
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    run_dir = str(tmp_path / "run")
    cfg = tiny_config(small_digits, run_dir, train={"epochs": 2}, report={"top1_target": 0.01})
    proc = run([HYBRIDTRAIN, "train", "--config", write_config(cfg)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.load(open(os.path.join(run_dir, "report.json")))
    assert report["convergence_epoch"] == 1 and report["world_size"] == 1
    assert report["single_gpu_speed_source"] == "this run (one rank)" and report["scaling_efficiency"] == 1.0
    events = EventAccumulator(os.path.join(run_dir, "tensorboard"))
    events.Reload()
    assert {"loss/train", "top1/val", "top5/val", "lr", "images_per_sec", "precision/loss_scale",
            "precision/skipped_steps"} <= set(events.Tags()["scalars"])
    assert [e.step for e in events.Scalars("top1/val")] == [1, 2]
    off = str(tmp_path / "off")
    cfg = tiny_config(small_digits, off, train={"epochs": 1}, optim={"warmup_epochs": 0.5}, report={"tensorboard": False})
    assert run([HYBRIDTRAIN, "train", "--config", write_config(cfg, "off.yaml")]).returncode == 0
    assert not os.path.exists(os.path.join(off, "tensorboard"))

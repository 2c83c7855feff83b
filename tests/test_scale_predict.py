"""`python -m benchmarks scale` on real 1- and 2-rank Horovod jobs with Horovod's timeline, and `python -m tools predict`."""
from __future__ import annotations

import json
import os

import pytest
from conftest import BENCHMARKS, HYBRIDTRAIN, TOOLS, assert_one_error_line, run

from benchmarks.scaling import allreduce_intervals, busy_time_us, read_timeline
from hybridtrain.errors import UserError
from hybridtrain.models import create_model
from tools.predict.cluster_model import RESNET50_PARAMETERS, ring_allreduce_time

SETS = ["--set", "model.arch=resnet18", "--set", "train.batch_size=4", "--set", "data.crop_size=32",
        "--set", "optim.name=hybrid", "--set", "data.channels_last=true", "--set", "train.accumulation_steps=2"]


@pytest.fixture(scope="module")
def scale_result(tmp_path_factory):
    out = tmp_path_factory.mktemp("scale")
    proc = run([*BENCHMARKS, "scale", "--config", "configs/demo.yaml", *SETS, "--np", "1,2", "--steps", "4",
                "--warmup", "1", "--out", str(out)], timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out, proc


def test_scale_rows_are_consistent_and_fp16_halves_the_bytes(scale_result):
    out, proc = scale_result
    rows = {(r["world_size"], r["compression"]): r for r in json.loads((out / "scale.json").read_text())["rows"]}
    assert set(rows) == {(1, "fp16"), (2, "fp16"), (1, "none"), (2, "none")}
    assert all(r["optimizer"] == "hybrid" and r["channels_last"] for r in rows.values())  # the trainer's own step
    assert all(r["accumulation_steps"] == 2 and r["batch_per_rank"] == 8 for r in rows.values())  # 2 passes of 4
    params = sum(p.numel() for p in create_model("resnet18", 1000).parameters())  # synthetic: 1000 classes
    assert rows[(2, "none")]["allreduce_bytes_per_step"] == 4 * params  # every gradient, FP32, once per step of 2 passes
    assert rows[(2, "fp16")]["allreduce_bytes_per_step"] == 2 * params  # FP16 compression halves it
    for (n, compression), r in rows.items():
        single = rows[(1, compression)]["images_per_sec"]
        assert r["efficiency"] == pytest.approx(r["images_per_sec"] / (n * single))
        assert 0 < r["efficiency"] <= 1.25  # at most 1 + noise (4 timed steps)
        assert 0 <= r["allreduce_time_per_step_s"] < r["step_time_s"] or n == 1
    assert (out / "scale.png").read_bytes()[:4] == b"\x89PNG"
    assert "| 2 | fp16 |" in proc.stdout


def test_report_takes_the_single_gpu_speed_from_scale_json(scale_result, tmp_path):
    out, _ = scale_result
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "scale.json").write_text((out / "scale.json").read_text())
    record = {"epoch": 1, "train_loss": 1.0, "train_top1": 0.5, "val_loss": 1.0, "val_top1": 0.8, "val_top5": 0.95,
              "lr": 0.1, "epoch_time_s": 2.0, "train_time_s": 1.0, "images_per_sec": 100.0, "samples_seen": 100,
              "wall_time_s": 2.0, "world_size": 2}
    (run_dir / "metrics.jsonl").write_text(json.dumps(record) + "\n")
    proc = run([HYBRIDTRAIN, "report", str(run_dir)])
    assert proc.returncode == 0, proc.stderr
    report = json.loads((run_dir / "report.json").read_text())
    s1 = json.loads((out / "scale.json").read_text())["rows"][0]["images_per_sec"]
    assert report["single_gpu_speed"] == s1 and "scale.json" in report["single_gpu_speed_source"]
    assert report["scaling_efficiency"] == pytest.approx(100.0 / (2 * s1))


def test_timeline_parsing_takes_the_union_of_fused_allreduces(tmp_path):
    path = tmp_path / "timeline.json"
    events = [{"ph": "B", "name": "NEGOTIATE_ALLREDUCE", "ts": 0, "pid": 1}, {"ph": "E", "ts": 5, "pid": 1},
              {"ph": "B", "name": "ALLREDUCE", "ts": 10, "pid": 1}, {"ph": "B", "name": "ALLREDUCE", "ts": 12, "pid": 2},
              {"ph": "B", "name": "MEMCPY_IN_FUSION_BUFFER", "ts": 13, "pid": 1}, {"ph": "E", "ts": 14, "pid": 1},
              {"ph": "E", "ts": 20, "pid": 1, "args": {"dtype": "float16", "shape": "[10, 3]"}},
              {"ph": "E", "ts": 25, "pid": 2, "args": {"dtype": "float32", "shape": "[7]"}},
              {"ph": "B", "name": "ALLREDUCE", "ts": 40, "pid": 1}]  # cut off mid-write, as Horovod leaves it
    path.write_text("[\n" + ",\n".join(json.dumps(e) for e in events) + ",")
    intervals = allreduce_intervals(read_timeline(str(path)))
    assert intervals == [(10, 20, 60), (12, 25, 28)]
    assert busy_time_us(intervals) == 15  # [10, 25]
    with pytest.raises(UserError, match="wrote no timeline"):
        read_timeline(str(tmp_path / "missing.json"))


def test_scale_refuses_more_ranks_than_slots():
    assert_one_error_line(run([*BENCHMARKS, "scale", "--np", str(os.cpu_count() + 1)]), "slots", "one core per rank")


def test_ranks_on_gpus_count_gpus_not_cores():
    """On a 1-GPU node, --np 2 would start and then fail with the shared-GPU line."""
    from benchmarks.scaling import available_slots
    cores = available_slots("cpu", 8)
    assert cores[1] == "core" and cores[0] >= 1
    assert available_slots("cuda", 1) == (1, "GPU") and available_slots("auto", 4) == (4, "GPU")
    assert available_slots("auto", 0) == cores and available_slots("cpu", 4) == cores


def test_predict_prints_the_table_checks_the_paper_and_plots(tmp_path):
    png = tmp_path / "p.png"
    proc = run([*TOOLS, "predict", "--nodes", "1,3", "--overlap", "0", "--inter-latency", "0", "--intra-latency", "0",
                "--out", str(png)])
    assert proc.returncode == 0, proc.stderr
    ring = ring_allreduce_time(24, RESNET50_PARAMETERS * 2, 5e9, 0.0)  # 2(N-1)/N * bytes / B
    assert abs(ring - 2 * 23 / 24 * RESNET50_PARAMETERS * 2 / 5e9) < 1e-12
    row = next(line for line in proc.stdout.splitlines() if line.startswith("| 3 | 24 |"))
    assert row.split("|")[4].strip() == f"{1000 * ring:.1f}"
    assert "cluster 1, 24 V100, mixed precision" in proc.stdout and png.read_bytes()[:4] == b"\x89PNG"


def test_predict_calibrates_on_scale_points_and_reports_the_error(tmp_path):
    params = 1_000_000
    points = [(n, 0.1 + 2 * (n - 1) * 1e-4 + 2 * (n - 1) / n * params * 2 / 1e9) for n in (1, 2, 4)]
    scale = tmp_path / "scale.json"
    scale.write_text(json.dumps({"rows": [{"world_size": n, "compression": "fp16", "step_time_s": t} for n, t in points]}))
    proc = run([*TOOLS, "predict", "--params", str(params), "--calibrate", str(scale), "--out",
                str(tmp_path / "p.png")])
    assert proc.returncode == 0, proc.stderr
    assert "compute 100.0 ms/step, effective latency 100.0 us, effective bandwidth 1.000 GB/s" in proc.stdout
    two = tmp_path / "two.json"
    two.write_text(json.dumps({"rows": [{"world_size": n, "compression": "fp16", "step_time_s": t}
                                        for n, t in points[:2]]}))
    assert_one_error_line(run([*TOOLS, "predict", "--calibrate", str(two)]), "three or more distinct")


def test_scale_measures_a_recipe_that_loads_in_process(tmp_path):
    """scale's synthetic step has no loader: a recipe's data.in_process must not make it refuse the recipe."""
    from benchmarks.scaling import measured_config
    cfg = measured_config("configs/demo.yaml", ["data.in_process=true", "data.workers=0"], "fp16")
    assert cfg.data.backend == "synthetic" and not cfg.data.in_process


def test_scale_refuses_what_its_synthetic_trainer_step_cannot_honour(tmp_path):
    proc = run([*BENCHMARKS, "scale", "--config", "configs/demo.yaml", *SETS, "--set", "bn.per_rank_batch=random",
                "--np", "1", "--out", str(tmp_path / "out")], timeout=300)
    assert_one_error_line(proc, "bn.per_rank_batch=random needs data.backend=torchvision")
    assert not (tmp_path / "out" / "scale.json").exists()

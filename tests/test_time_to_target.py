"""`python -m tools predict --gpus`: the time-to-target model's pieces against hand-worked numbers and plain NumPy,
its checks against MLPerf v4.0 and the paper, and the command line (real processes, no mocks)."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
from conftest import BENCHMARKS, TOOLS, assert_one_error_line, run

from tools.predict import cluster_model as cm
from tools.predict import time_to_target as ttt

IMAGES = cm.IMAGENET_TRAIN_IMAGES
P = cm.RESNET50_PARAMETERS


# ---------------------------------------------------------------------------------------------- all-reduce


def test_tree_allreduce_by_hand():
    assert cm.tree_allreduce_time(8, 1e6, 1e9, 1e-5) == pytest.approx(2 * 3 * 1e-5 + 2 * 1e6 / 1e9)  # 2.06 ms
    assert cm.tree_allreduce_time(448, 1e6, 1e9, 1e-5) == pytest.approx(2 * 9 * 1e-5 + 2e-3)  # ceil(log2 448) = 9
    assert cm.tree_allreduce_time(1, 1e6, 1e9, 1e-5) == 0.0
    # DGX H100 template at 64 GPUs (8 nodes): NVLink reduce-scatter + tree over 8 NICs + NVLink allgather
    spec = ttt.sized(ttt.h100_cluster(), 64, 50, 0.01)
    intra = 7 * 5e-6 + 7 / 8 * 2 * P / 450e9
    inter = 2 * 3 * 10e-6 + 2 * (2 * P / 8) / 50e9
    assert cm.allreduce_time(spec) == pytest.approx(2 * intra + inter, rel=1e-12)
    assert (spec.gpus_per_node, spec.nodes) == (8, 8)
    assert (ttt.sized(ttt.h100_cluster(), 4, 1, 1.0).gpus_per_node, ttt.sized(ttt.h100_cluster(), 4, 1, 1.0).nodes) \
        == (4, 1)
    with pytest.raises(ValueError, match="whole number of 8-GPU nodes"):
        ttt.sized(ttt.h100_cluster(), 12, 1, 1.0)


# ---------------------------------------------------------------------------------------------- throughput


def test_throughput_line_recovers_a_known_line_and_matches_numpy_polyfit():
    batches = np.array([16, 32, 64, 128, 256])
    speeds = batches / (0.003 + batches * 1e-4)  # t(b) = 3 ms + b x 0.1 ms
    curve = ttt.fit_throughput_curve(list(zip(batches, speeds)), "test")
    assert curve.fixed == pytest.approx(0.003) and curve.per_image == pytest.approx(1e-4)
    assert curve.max_batch == 256 and curve.images_per_second(100) == pytest.approx(100 / 0.013)
    noisy = speeds * np.array([1.02, 0.97, 1.01, 0.99, 1.0])
    slope, intercept = np.polyfit(batches, batches / noisy, 1)
    fit = ttt.fit_throughput_curve(list(zip(batches, noisy)), "noisy")
    assert (fit.fixed, fit.per_image) == (pytest.approx(intercept), pytest.approx(slope))


def test_throughput_line_through_the_papers_table_3_2():
    v100 = ttt.fit_throughput_curve(ttt.V100_TABLE_3_2, "Table 3.2")
    per_image = (256 / 1542 - 128 / 1377) / 128  # the slope through the two points
    assert v100.per_image == pytest.approx(per_image) and v100.fixed == pytest.approx(128 / 1377 - 128 * per_image)
    assert v100.fixed == pytest.approx(0.019893, abs=1e-6)
    assert v100.images_per_second(256) == pytest.approx(1542) and v100.images_per_second(128) == pytest.approx(1377)


def test_throughput_line_never_has_a_negative_fixed_cost_and_needs_two_batches():
    speeds = [(10, 100.0), (20, 80.0)]  # step time more than doubles: the line needs a negative fixed cost
    curve = ttt.fit_throughput_curve(speeds, "slower per image at the larger batch")
    t = np.array([0.1, 0.25])
    b = np.array([10, 20])
    assert curve.fixed == 0.0 and curve.per_image == pytest.approx(b @ t / (b @ b))
    with pytest.raises(ValueError, match="two or more distinct"):
        ttt.fit_throughput_curve([(64, 100.0), (64, 110.0)], "one batch")
    with pytest.raises(ValueError, match="does not grow with the batch"):
        ttt.fit_throughput_curve([(10, 100.0), (20, 250.0)], "step time falls as the batch grows")
    with pytest.raises(ValueError, match="img/s > 0"):
        ttt.fit_throughput_curve([(64, 0.0), (128, 1.0)], "zero")


def test_the_mlperf_steps_less_the_modelled_allreduce_give_the_compute_points():
    template = ttt.h100_cluster()
    points = ttt.implied_compute_points(ttt.MLPERF_V40_RUNS, template)
    exposed_8 = 2 * (7 * 5e-6 + 7 / 8 * 2 * P / 450e9)  # one node: NVLink reduce-scatter + allgather, overlap 0
    assert points[0] == (400, pytest.approx(400 / (400 / 7161 - exposed_8)))
    exposed_64 = exposed_8 + 2 * 3 * 10e-6 + 2 * (2 * P / 8) / 50e9
    assert points[1] == (50, pytest.approx(50 / (50 / 4908 - exposed_64)))
    curve = ttt.default_throughput_curve()
    design = np.column_stack([np.ones(3), [b for b, _ in points]])
    expected, *_ = np.linalg.lstsq(design, np.array([b / s for b, s in points]), rcond=None)
    assert (curve.fixed, curve.per_image) == (pytest.approx(expected[0]), pytest.approx(expected[1]))
    assert curve.max_batch == 400
    left_out = ttt.default_throughput_curve(exclude=3584)  # a line through the 8- and 64-GPU points exactly
    assert left_out.step_time(400) == pytest.approx(400 / points[0][1])
    assert left_out.step_time(50) == pytest.approx(50 / points[1][1])


# ---------------------------------------------------------------------------------------------- epochs


def test_epochs_by_hand_from_the_reference_convergence_points():
    lars = ttt.epoch_curve("lars", 0.759)
    assert lars.batches == (1632, 3264, 4096, 8192, 13056, 32768, 49152, 58880, 65536, 67840)
    assert lars.epochs[0] == pytest.approx(595 / 17)  # 35.0 over 17 repeats
    assert lars.epochs[1] == pytest.approx(528 / 15)  # 35.2
    assert lars.at(3264) == pytest.approx(35.2)
    # 3,200 lies between 1,632 and 3,264, which are exactly one doubling apart
    assert lars.at(3200) == pytest.approx(35.0 + math.log2(3200 / 1632) * 0.2)
    frac = math.log2(57344 / 49152) / math.log2(58880 / 49152)
    assert lars.at(57344) == pytest.approx(68.0 + frac * (79.9 - 68.0))
    assert lars.at(1000) == pytest.approx(35.0) and lars.status(1000) == "below"
    assert lars.status(67840) == "within" and lars.status(67841) == "beyond"
    slope = (lars.epochs[-1] - 84.5) / math.log2(67840 / 65536)  # the last segment, continued
    assert lars.at(4 * 67840) == pytest.approx(lars.epochs[-1] + 2 * slope)


def test_a_lower_target_may_use_runs_that_reached_a_higher_one_and_a_higher_target_refuses():
    sgd = ttt.epoch_curve("sgd", 0.76)  # Goyal et al.: 76.40% at 256 and 76.26% at 8k, both after 90 epochs
    assert sgd.batches == (256, 8192) and sgd.epochs == (90.0, 90.0)
    assert ttt.epoch_curve("sgd", 0.763).batches == (256,)
    hybrid = ttt.epoch_curve("hybrid", 0.75)  # 32 epochs (Table 3.8) beats the 90-epoch run at the same batch
    assert hybrid.batches == (6144,) and hybrid.epochs == (32.0,)
    assert hybrid.at(100_000) == 32.0 and hybrid.status(100_000) == "beyond"  # one batch: held flat, flagged
    with pytest.raises(ValueError, match="no published hybrid run reached top-1 0.759"):
        ttt.epoch_curve("hybrid", 0.759)


# ---------------------------------------------------------------------------------------------- the plan


def test_a_row_by_hand():
    curve = ttt.ThroughputCurve(fixed=0.002, per_image=1e-4, max_batch=256, source="test")
    epochs = ttt.EpochCurve("x", 0.7, (1000, 100_000), (30.0, 60.0), ("a", "b"))
    template = ttt.h100_cluster()
    row = ttt.evaluate(64, 100, curve, epochs, template)
    compute = 0.002 + 100 * 1e-4
    exposed = cm.allreduce_time(ttt.sized(template, 64, 100, compute))
    assert row.images_per_second_per_gpu == pytest.approx(100 / (compute + exposed))
    assert row.efficiency == pytest.approx(compute / (compute + exposed))
    e = 30 + 30 * math.log2(6400 / 1000) / math.log2(100)
    assert row.epochs == pytest.approx(e)
    assert row.minutes == pytest.approx(e * IMAGES / (64 * 100 / (compute + exposed)) / 60)
    # the paper's two forms of the actual average single-GPU time agree: N x minutes = E x I / (S1 x efficiency)
    assert row.single_gpu_minutes == pytest.approx(64 * row.minutes)
    assert row.single_gpu_minutes == pytest.approx(e * IMAGES / (100 / compute * row.efficiency) / 60)


def test_the_plan_is_the_fastest_batch_within_the_published_range():
    curve = ttt.default_throughput_curve()
    epochs = ttt.epoch_curve("lars", 0.759)
    template = ttt.h100_cluster()
    for gpus in (8, 64, 4096):
        best = min((ttt.evaluate(gpus, b, curve, epochs, template) for b in range(1, 401) if gpus * b <= 67840),
                   key=lambda r: r.minutes)
        chosen = ttt.plan(gpus, curve, epochs, template)
        assert chosen.batch_per_gpu == best.batch_per_gpu and chosen.global_batch <= 67840
    assert ttt.plan(8, curve, epochs, template).batch_per_gpu == 400  # the curve's largest batch at one node
    assert ttt.plan(64, curve, epochs, template, batch=50).batch_per_gpu == 50
    far = ttt.plan(131072, curve, epochs, template)  # even one image per GPU is beyond every published batch
    assert far.batch_per_gpu == 1 and far.epochs_status == "beyond"


# ---------------------------------------------------------------------------------------------- the checks


def test_the_model_meets_its_error_limits_against_the_three_mlperf_runs():
    checks = ttt.mlperf_check()
    assert [c.run.gpus for c in checks] == [8, 64, 3584]
    for c in checks:
        assert abs(c.throughput_error) <= 0.15, (c.run, c.model)
        assert abs(c.minutes_error) <= 0.25, (c.run, c.model)
        assert c.model.batch_per_gpu == c.run.batch_per_gpu
        assert c.model.minutes == pytest.approx(c.model.epochs * IMAGES / (c.run.gpus * c.model.images_per_second_per_gpu)
                                                / 60)


def test_tables_3_7_to_3_9_from_the_time_model():
    check = cm.paper_cluster_check()
    rows = ttt.paper_time_check(check)
    eff = check.rows[0].predicted_efficiency
    c1_90 = next(r for r in rows if r.label == "cluster 1" and r.epochs == 90)
    assert c1_90.model_minutes == pytest.approx(90 * IMAGES / (24 * 1542 * eff) / 60)
    assert round(c1_90.model_minutes) in (53, 54)  # Table 3.7: 53 min
    c1_39 = next(r for r in rows if r.label == "cluster 1" and r.epochs == 39)
    assert abs(c1_39.model_single_gpu_minutes / 552 - 1) < 0.02  # Table 3.9: 552 min
    assert all(abs(r.error) < 0.07 for r in rows if r.label == "cluster 1")


# ---------------------------------------------------------------------------------------------- command line


def test_predict_gpus_prints_the_rows_the_checks_the_plot_and_the_json(tmp_path):
    png, out = tmp_path / "t.png", tmp_path / "t.json"
    proc = run([*TOOLS, "predict", "--target-top1", "0.759", "--gpus", "8,64,512,4096,131072", "--out", str(png),
                "--json", str(out)])
    assert proc.returncode == 0, proc.stderr
    data = json.loads(out.read_text())
    assert [r["gpus"] for r in data["rows"]] == [8, 64, 512, 4096, 131072]
    for r in data["rows"]:
        line = next(x for x in proc.stdout.splitlines() if x.startswith(f"| {r['gpus']:,} | "))
        cells = [c.strip() for c in line.split("|")[1:-1]]
        assert int(cells[1]) == r["batch_per_gpu"] and cells[4] == f"{100 * r['efficiency']:.1f}%"
        assert float(cells[6].replace(",", "")) == pytest.approx(r["minutes"], rel=5e-3) and cells[7] == f"{r['single_gpu_minutes']:,.0f}"
    assert data["rows"][-1]["epochs_status"] == "beyond"
    assert "131,072 GPUs: global batch 131,072 is beyond any published lars run" in proc.stdout
    assert len(data["mlperf_check"]) == 3 and "limit 15%" in proc.stdout and "limit 25%" in proc.stdout
    assert "cluster 1, 24 V100, mixed precision" in proc.stdout and "| 3.8 | cluster 1 | 32 | 18 |" in proc.stdout
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_predict_gpus_takes_the_curve_from_a_bench_sweep(tmp_path):
    rows = [{"loop": loop, "arch": "resnet50", "precision": "mixed-float16", "image_size": 224, "batch_size": b,
             "images_per_sec": b / (0.01 + b * 0.001) * (1.0 if loop == "trainer" else 2.0)}
            for b in (16, 64, 128) for loop in ("trainer", "baseline")]
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps(rows))
    out = tmp_path / "t.json"
    proc = run([*TOOLS, "predict", "--gpus", "1,8", "--throughput", str(bench), "--batch-per-gpu", "64",
                "--out", str(tmp_path / "t.png"), "--json", str(out)])
    assert proc.returncode == 0, proc.stderr
    assert "t(b) = 10 ms + b x 1 ms, b <= 128" in proc.stdout  # the baseline rows are left out
    one = json.loads(out.read_text())["rows"][0]
    assert one["batch_per_gpu"] == 64 and one["images_per_second_per_gpu"] == pytest.approx(64 / 0.074)
    assert one["efficiency"] == 1.0


def test_predict_gpus_reads_a_real_bench_sweep(tmp_path):
    bench = tmp_path / "bench.json"
    # batches 32x apart, 5 steps each: a loaded machine (CI beside other tests) once timed 3 steps of batch 2 slower
    # than batch 32's, and predict rightly refused a step time that does not grow with the batch
    proc = run([*BENCHMARKS, "bench", "--arch", "resnet18", "--image-size", "32", "--batch-size", "2", "--batch-size",
                "64", "--steps", "5", "--warmup", "2", "--threads", "1", "--json", str(bench)], timeout=600)
    assert proc.returncode == 0, proc.stderr
    measured = {r["batch_size"]: r["images_per_sec"] for r in json.loads(bench.read_text())}
    out = tmp_path / "t.json"
    proc = run([*TOOLS, "predict", "--gpus", "1", "--throughput", str(bench), "--out", str(tmp_path / "t.png"),
                "--json", str(out)])
    assert proc.returncode == 0, proc.stderr
    data = json.loads(out.read_text())
    fixed, per_image = data["throughput"]["fixed_s"], data["throughput"]["per_image_s"]
    for b, speed in measured.items():  # two points: the line passes through both
        assert b / (fixed + b * per_image) == pytest.approx(speed, rel=1e-6)
    assert data["rows"][0]["batch_per_gpu"] == 64  # the larger measured batch is the faster one
    assert "note: the throughput is resnet18's" in proc.stdout


@pytest.mark.parametrize("argv, needles", [
    (["--gpus", "0"], ["--gpus", "such as 8,64,512"]),
    (["--gpus", "12"], ["--gpus 12", "multiple of 8"]),
    (["--target-top1", "0.7"], ["--target-top1 needs --gpus"]),
    (["--gpus", "8", "--nodes", "1,2"], ["--nodes does not apply with --gpus"]),
    (["--gpus", "8", "--optimizer", "hybrid"], ["no published hybrid run reached top-1 0.759", "--target-top1"]),
    (["--gpus", "8", "--target-top1", "1.5"], ["--target-top1", "(0, 1)"]),
    (["--gpus", "8", "--batch-per-gpu", "1000"], ["largest batch (400)"]),
])
def test_predict_gpus_bad_input_is_one_line(argv, needles, tmp_path):
    assert_one_error_line(run([*TOOLS, "predict", *argv, "--out", str(tmp_path / "p.png")]), *needles)


@pytest.mark.parametrize("text, needle", [("not json", "is not the JSON of 'python -m benchmarks bench --json'"),
                                          ('{"rows": 3}', "is not the JSON"),
                                          ("[]", "no rows of the trainer's step"),
                                          ('[{"loop": "trainer", "batch_size": 64, "images_per_sec": 100}]',
                                           "two or more distinct")])
def test_predict_gpus_refuses_a_bad_bench_file(text, needle, tmp_path):
    bad = tmp_path / "bench.json"
    bad.write_text(text)
    line = assert_one_error_line(run([*TOOLS, "predict", "--gpus", "8", "--throughput", str(bad), "--out",
                                      str(tmp_path / "p.png")]), needle)
    assert "python -m benchmarks bench" in line and not (tmp_path / "p.png").exists()

"""`hybridtrain experiment` and `plot-schedule`: real Horovod rows, tables, JSON and PNGs."""
from __future__ import annotations

import json
import os

from conftest import HYBRIDTRAIN, assert_one_error_line, digits_subset, run, tiny_config

from hybridtrain.config import load_config
from hybridtrain.optim.plot import schedule_series
from hybridtrain.reports.experiments import lars_rows, warmup_epoch_rows


def test_optimizers_experiment_writes_table_json_and_png(small_digits, tmp_path, write_config):
    few = digits_subset(small_digits, str(tmp_path / "few"), 8, 3)  # 80 / 30 images: four runs of 2 epochs
    cfg = write_config(tiny_config(few, str(tmp_path / "unused"), optim={"adabound_epochs": 1}))
    out = tmp_path / "exp"
    proc = run([HYBRIDTRAIN, "experiment", "optimizers", "--config", cfg, "--out", str(out), "--target", "0.3"],
               timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads((out / "optimizers.json").read_text())
    assert [r["row"] for r in rows] == ["hybrid", "adabound", "goyal", "sgd"]
    for r in rows:
        metrics = [json.loads(line) for line in (out / "runs" / r["row"] / "metrics.jsonl").read_text().splitlines()]
        top1 = [m["val_top1"] for m in metrics]
        assert r["final_top1"] == top1[-1] and r["best_top1"] == max(top1)
        hit = next((i + 1 for i, v in enumerate(top1) if v >= 0.3), None)
        assert r["epochs_to_target"] == hit
    table = (out / "optimizers.md").read_text()
    assert table.count("\n") == 6 and "| hybrid |" in table
    assert (out / "optimizers.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_warmup_epoch_rows_scale_T_to_the_run():
    cfg = load_config(None, ["train.epochs=90"])
    assert [name for name, _ in warmup_epoch_rows(cfg)] == ["T=1", "T=2", "T=5", "T=10"]
    assert [name for name, _ in warmup_epoch_rows(load_config(None, ["train.epochs=180"]))] == [
        "T=2", "T=4", "T=10", "T=20"]
    short = load_config(None, ["train.epochs=12"])  # 12/90 of {1,2,5,10} collapses to T=1
    assert [name for name, _ in warmup_epoch_rows(short)] == ["T=1", "T=2", "T=3", "T=4"]
    tiny = load_config(None, ["train.epochs=5", "optim.adabound_epochs=1"])
    assert [name for name, _ in warmup_epoch_rows(tiny)] == ["T=1", "T=2"]


def test_lars_rows_cover_none_scale_and_clip():
    rows = dict(lars_rows(load_config(None, ["train.epochs=12", "optim.adabound_epochs=3"])))
    assert list(rows) == ["none", "scale eta=0.001", "scale eta=0.02", "clip eta=0.001", "clip eta=0.02"]
    assert rows["clip eta=0.02"] == ["optim.name=hybrid", "optim.lars=clip", "optim.trust_coefficient=0.02"]


def test_unknown_experiment_is_one_line(tmp_path):
    assert_one_error_line(run([HYBRIDTRAIN, "experiment", "nosuch", "--out", str(tmp_path)]), "unknown experiment")


def test_plot_schedule_png_and_series(tmp_path):
    out = tmp_path / "s.png"
    proc = run([HYBRIDTRAIN, "plot-schedule", "--config", "configs/demo.yaml", "--ranks", "4",
                "--iters-per-epoch", "5", "--out", str(out)])
    assert proc.returncode == 0, proc.stderr
    assert out.read_bytes()[:4] == b"\x89PNG"
    cfg = load_config(os.path.join("configs", "demo.yaml"))
    s = schedule_series(cfg, 4, 5)
    T = cfg.optim.adabound_epochs
    warm = T * 5
    assert all(u >= lo for u, lo in zip(s["upper"][:warm], s["lower"][:warm]))
    assert s["upper"][warm - 1] == s["lower"][warm - 1] == 0.1 * 4 and s["lr"][warm] == 0.1 * 4
    assert s["lr"][:warm] == [None] * warm and s["upper"][warm:] == [None] * (len(s["lr"]) - warm)

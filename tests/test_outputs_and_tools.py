"""Outputs checked before the work and written atomically; data tools that write only under --out and delete only
what they created; a single-class dataset and a zero batch refused. Real ``hybridtrain`` processes."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import pytest
import yaml
from conftest import HYBRIDTRAIN, REPO, TOOLS, assert_one_error_line, command, run, tiny_config
from PIL import Image

DEMO = os.path.join(REPO, "configs", "demo.yaml")
QUICK_S = 60  # far below what any of these commands' work takes; the start alone is seconds on a loaded host


def snapshot(folder) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, f), folder) for d, _, files in os.walk(folder) for f in files)


def refused_before_work(cmd: list[str], cwd, *needles: str) -> str:
    """One line, exit 2, quickly, and nothing new in ``cwd``."""
    before = snapshot(cwd)
    start = time.monotonic()
    proc = run(command(cmd), timeout=300, cwd=str(cwd))
    elapsed = time.monotonic() - start
    line = assert_one_error_line(proc, *needles)
    assert proc.returncode == 2, proc.stderr
    assert elapsed < QUICK_S, f"{elapsed:.0f} s: the check came after the work"
    assert snapshot(cwd) == before, "something was written"
    assert "check train" not in proc.stderr  # check-data's decoding never started
    return line


# the output FILE options: a missing folder is named, with the mkdir that fixes it
FILE_OPTIONS = {
    "bench --json": ["bench", "--arch", "resnet18", "--json", "{missing}/bench.json"],
    "predict --out": ["predict", "--out", "{missing}/predict.png"],
    "check-data --report": ["check-data", "{data}", "--report", "{missing}/report.json"],
    "report --out": ["report", "{run}", "{run}", "--out", "{missing}/comparison.md"],
    "plot-schedule --out": ["plot-schedule", "--config", DEMO, "--out", "{missing}/schedule.png"],
}
# the output FOLDER options: an existing file where the folder should be
DIR_OPTIONS = {
    "check-data --write-filelist": ["check-data", "{data}", "--write-filelist", "{file}"],
    "scale --out": ["scale", "--config", DEMO, "--np", "1", "--out", "{file}"],
    "experiment --out": ["experiment", "optimizers", "--config", DEMO, "--out", "{file}"],
    "bench --profile": ["bench", "--arch", "resnet18", "--profile", "{file}"],
}


def _fill(cmd: list[str], tmp_path, small_digits) -> list[str]:
    run_dir = tmp_path / "run"
    run_dir.mkdir(exist_ok=True)
    (tmp_path / "results.txt").write_text("the user's file\n")
    names = {"missing": "no-such-folder", "file": "results.txt", "data": small_digits, "run": str(run_dir)}
    return [part.format(**names) for part in cmd]


@pytest.mark.parametrize("name", sorted(FILE_OPTIONS))
def test_an_output_file_in_a_missing_folder_is_one_line_before_any_work(name, tmp_path, small_digits):
    line = refused_before_work(_fill(FILE_OPTIONS[name], tmp_path, small_digits), tmp_path, name.split()[-1],
                               "no-such-folder does not exist", "mkdir -p no-such-folder")
    assert not (tmp_path / "no-such-folder").exists(), line


@pytest.mark.parametrize("name", sorted(DIR_OPTIONS))
def test_an_output_folder_that_is_a_file_is_one_line_before_any_work(name, tmp_path, small_digits):
    refused_before_work(_fill(DIR_OPTIONS[name], tmp_path, small_digits), tmp_path, name.split()[-1],
                        "results.txt is a file, not a folder")
    assert (tmp_path / "results.txt").read_text() == "the user's file\n"


def test_an_output_file_that_is_a_folder_or_an_unexpanded_tilde_is_one_line(tmp_path):
    refused_before_work(["predict", "--out", "."], tmp_path, "--out . is a folder", "e.g. --out ./predict.png")
    line = refused_before_work(["predict", "--out=~/predict.png"], tmp_path, "starts with '~'")
    assert os.path.expanduser("~/predict.png") in line
    assert not (tmp_path / "~").exists()


def test_outputs_are_replaced_atomically_and_a_failed_write_keeps_the_previous_file(tmp_path):
    from hybridtrain.files import atomic_path, write_json_atomically
    target = tmp_path / "rows.json"
    target.write_text("previous\n")
    with pytest.raises(RuntimeError):
        with atomic_path(str(target)) as tmp:
            with open(tmp, "w") as fh:
                fh.write("half")
            raise RuntimeError("killed half-way")
    assert target.read_text() == "previous\n" and os.listdir(tmp_path) == ["rows.json"]
    write_json_atomically(str(target), [{"a": 1}])
    assert yaml.safe_load(target.read_text()) == [{"a": 1}] and os.listdir(tmp_path) == ["rows.json"]


def test_predict_writes_its_plot_where_asked_and_leaves_no_temp_file(tmp_path):
    proc = run([*TOOLS, "predict", "--nodes", "1,2", "--out", "plots.png"], cwd=str(tmp_path), timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert sorted(os.listdir(tmp_path)) == ["plots.png"]
    assert (tmp_path / "plots.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ----------------------------------------------------------------------------- reorganise-val: never outside --out

def _flat_val(tmp_path, classes: list[str]):
    flat = tmp_path / "flat"
    flat.mkdir()
    lines = []
    for i, cls in enumerate(classes, 1):
        Image.new("RGB", (8, 8), (i * 40, 0, 0)).save(flat / f"ILSVRC2012_val_{i:08d}.JPEG")
        lines.append(f"ILSVRC2012_val_{i:08d}.JPEG {cls}")
    labels = tmp_path / "labels.txt"
    labels.write_text("\n".join(lines) + "\n")
    return flat, labels


@pytest.mark.parametrize("bad", ["../escaped", "ABSOLUTE", "n01/../../escaped", ".."])
def test_reorganise_val_refuses_a_class_that_leaves_out(bad, tmp_path):
    absolute = str(tmp_path / "escaped-absolute")  # an absolute class folder, this test's own (no shared /tmp name)
    bad = absolute if bad == "ABSOLUTE" else bad
    flat, labels = _flat_val(tmp_path, ["n01440764", bad])
    out = tmp_path / "work" / "val"
    line = refused_before_work(["reorganise-val", str(flat), "--labels", str(labels), "--out", str(out)], tmp_path,
                               "labels.txt line 2", "fix that line")
    assert not (tmp_path / "work").exists() and not (tmp_path / "escaped").exists(), line
    assert not os.path.exists(absolute)


def test_reorganise_val_with_good_labels_writes_only_under_out(tmp_path):
    flat, labels = _flat_val(tmp_path, ["n01440764", "n01443537", "n01440764"])
    out = tmp_path / "val"
    proc = run([HYBRIDTRAIN, "reorganise-val", str(flat), "--labels", str(labels), "--out", str(out)], timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert sorted(os.listdir(tmp_path)) == ["flat", "labels.txt", "val"]
    assert snapshot(out) == ["n01440764/ILSVRC2012_val_00000001.JPEG", "n01440764/ILSVRC2012_val_00000003.JPEG",
                             "n01443537/ILSVRC2012_val_00000002.JPEG"]


# ----------------------------------------------------------------------------- prepare-data: deletes only its own

def test_prepare_data_keeps_a_users_partial_folder_and_replaces_only_its_own(tmp_path):
    out = tmp_path / "digits"
    partial = tmp_path / "digits.partial"
    partial.mkdir()
    (partial / "notes.txt").write_text("mine\n")
    refused_before_work(["prepare-data", "digits", "--out", str(out)], tmp_path, f"{partial} exists",
                        "not left by hybridtrain", "move or remove it yourself")
    assert (partial / "notes.txt").read_text() == "mine\n" and not out.exists()

    shutil.rmtree(partial)  # one a killed run of the tool left: marked, so it is replaced
    partial.mkdir()
    (partial / ".hybridtrain-partial").write_text("")
    (partial / "train").mkdir()
    proc = run([HYBRIDTRAIN, "prepare-data", "digits", "--out", str(out)], timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert not partial.exists() and sorted(os.listdir(out)) == [".hybridtrain-digits.json", "train", "val"]


# ----------------------------------------------------------------------------- a dataset of one class

def test_a_single_class_dataset_is_refused_at_the_scan(tmp_path, small_digits, write_config):
    data = tmp_path / "one-class"
    for split in ("train", "val"):
        shutil.copytree(os.path.join(small_digits, split, "3"), data / split / "3")
    cfg = write_config(tiny_config(str(data), str(tmp_path / "run")))
    proc = run([HYBRIDTRAIN, "train", "--config", cfg], timeout=300)
    assert_one_error_line(proc, "only one class folder (3)", "at least 2 classes")
    assert proc.returncode == 2
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_prepare_synthetic_imagenet_of_one_class_is_refused(tmp_path):
    refused_before_work(["prepare-data", "synthetic-imagenet", "--out", "synth", "--classes", "1"], tmp_path,
                        "--classes", "2")


# ----------------------------------------------------------------------------- bench: 0 is never "the default"

def test_bench_batch_size_zero_is_refused_not_benchmarked_at_the_recipes(tmp_path):
    refused_before_work(["bench", "--arch", "resnet18", "--batch-size", "0", "--json", "rows.json"], tmp_path,
                        "--batch-size")
    from benchmarks.step_bench import bench
    from hybridtrain.errors import UserError
    with pytest.raises(UserError, match="--batch-size must be >= 1, got 0"):
        bench(None, [], [], [0], 1, 0, False, None, 1)  # the bench code itself, whatever the parser let through


# ----------------------------------------------------------------------------- a hung rank

@pytest.mark.slow
def test_a_hung_rank_ends_the_job_with_a_line_that_says_hung_not_died():
    """Rank 1 frozen for good (SIGSTOP). Horovod 0.28.1 under Gloo did not fire its stall warning or shutdown
    here (stall_warning_s=2, stall_shutdown_s=6); Gloo's timeout ended the wait after gloo_timeout_s. The
    survivor's line must name a hang, since every rank's process is still there."""
    script = os.path.join(REPO, "tests", "scripts", "hung_rank.py")
    start = time.monotonic()
    proc = run([os.path.join(os.path.dirname(HYBRIDTRAIN), "horovodrun"), "--gloo", "-np", "2", "-H", "localhost:2",
                os.path.join(os.path.dirname(HYBRIDTRAIN), "python"), script, "distributed.stall_warning_s=2",
                "distributed.stall_shutdown_s=6", "distributed.gloo_timeout_s=10"], timeout=240)
    elapsed = time.monotonic() - start
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0
    lines = [x for x in output.splitlines() if "hybridtrain: the job stopped because" in x]
    assert len(lines) == 1 and "a rank hung" in lines[0] and "died" not in lines[0], output[-3000:]
    assert "unexpected" not in output and elapsed < 120, output[-3000:]


def from_the_checkout(*argv: str, cwd: str = REPO) -> subprocess.CompletedProcess:
    """``python ARGV`` in the repository's root as the docs give it: no PYTHONPATH, the venv's python."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=300, cwd=cwd, env=env,
                          stdin=subprocess.DEVNULL)


def test_each_tool_beside_the_package_runs_from_the_checkout_with_its_documented_command(tmp_path):
    """benchmarks/, tools/, install/ and the probes run as the README and docs/ give them, from a checkout's root
    with nothing on PYTHONPATH: one real, cheap invocation of each family."""
    for program, commands in (("benchmarks", ["bench", "max-batch", "bench-optim", "bench-data", "scale"]),
                              ("tools", ["predict", "cluster", "experiment"])):
        proc = from_the_checkout("-m", program, "--help")
        assert proc.returncode == 0 and f"usage: python -m {program}" in proc.stdout, proc.stderr
        assert all(c in proc.stdout for c in commands), proc.stdout
    optim = from_the_checkout("-m", "benchmarks", "bench-optim", "--set", "model.arch=resnet18", "--steps", "1",
                              "--warmup", "0", "--threads", "1", "--json", str(tmp_path / "optim.json"))
    assert optim.returncode == 0, optim.stderr
    assert json.load(open(tmp_path / "optim.json"))[0]["optimizer"] == "sgd-foreach"
    predict = from_the_checkout("-m", "tools", "predict", "--nodes", "1,2", "--out", str(tmp_path / "p.png"))
    assert predict.returncode == 0 and (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG", predict.stderr
    probe = from_the_checkout("-m", "benchmarks.probes.hook_timing", "--help")
    assert probe.returncode == 0 and "usage: python -m benchmarks.probes.hook_timing" in probe.stdout, probe.stderr
    plan = from_the_checkout("-m", "install.plan", "check-torch", "2.13.0")
    assert plan.returncode == 0 and plan.stdout.strip() == "", plan.stderr


@pytest.mark.parametrize("argv, new", [(["bench", "--steps", "3"], "python -m benchmarks bench"),
                                       (["bench", "--find-max-batch"], "python -m benchmarks max-batch"),
                                       (["bench-optim"], "python -m benchmarks bench-optim"),
                                       (["bench-data"], "python -m benchmarks bench-data"),
                                       (["scale", "--np", "1,2"], "python -m benchmarks scale"),
                                       (["predict", "--gpus", "8"], "python -m tools predict"),
                                       (["cluster", "up"], "python -m tools cluster"),
                                       (["experiment", "lars"], "python -m tools experiment")])
def test_a_command_that_moved_beside_the_package_names_its_new_form_in_one_line(argv, new):
    from hybridtrain.cli import moved_command
    line = moved_command(argv)
    assert line.startswith(f"hybridtrain: error: `{argv[0]}` runs from the checkout now") and f": {new} ..." in line
    assert moved_command(["train", "--config", "bench"]) is None


def test_the_old_form_of_a_moved_command_is_one_line_from_the_console_script():
    proc = run([HYBRIDTRAIN, "predict", "--nodes", "1,2"])
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.splitlines() == ["hybridtrain: error: `predict` runs from the checkout now, beside the package: "
                                        "python -m tools predict ... (in the repository's root; python -m tools "
                                        "predict --help lists its options)"]

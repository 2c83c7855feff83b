"""No run is lost: a run owns its run_dir (lock, refusal, --move-aside, pruning of its own checkpoints only), an
epoch's training is kept when validation fails, the project's own files are read tolerantly, every decoder
failure is "cannot read image", and progress under a pipe is plain lines. Real processes where it counts."""
from __future__ import annotations

import fcntl
import hashlib
import io
import json
import shutil
import struct
import zlib

import pytest
import torch
from conftest import HYBRIDTRAIN, assert_one_error_line, horovodrun, rank_output, read_metrics, run, tiny_config

from hybridtrain.engine import rundir
from hybridtrain.errors import UserError


def train_alone(config: str, *extra: str):
    """One rank without a launcher (the trainer's own one-process mode)."""
    return run([HYBRIDTRAIN, "train", "--config", config, *extra], timeout=600)


def digest(path) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


@pytest.mark.slow
def test_a_finished_run_is_never_overwritten_and_move_aside_keeps_it(small_digits, tmp_path, write_config):
    run_dir = tmp_path / "run"
    config = write_config(tiny_config(small_digits, str(run_dir), train={"epochs": 2, "batch_size": 16}))
    first = train_alone(config)
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
    (run_dir / "notes.txt").write_text("the user's own file")
    before = digest(run_dir / "metrics.jsonl")

    again = train_alone(config)  # `make demo` twice, or a copied command line
    line = assert_one_error_line(again, "holds another run's files", "--resume", "--move-aside")
    assert "metrics.jsonl" in line
    assert digest(run_dir / "metrics.jsonl") == before and len(read_metrics(str(run_dir))) == 2

    moved = train_alone(config, "--move-aside")
    assert moved.returncode == 0, moved.stdout[-2000:] + moved.stderr[-2000:]
    (previous,) = [p for p in run_dir.iterdir() if p.name.startswith("previous-")]
    assert digest(previous / "metrics.jsonl") == before and (previous / "checkpoint-epoch0002.pt").exists()
    assert len(read_metrics(str(run_dir))) == 2 and (run_dir / "notes.txt").read_text() == "the user's own file"
    marker = json.loads((run_dir / "run.json").read_text())
    assert marker["checkpoints"] == ["checkpoint-epoch0001.pt", "checkpoint-epoch0002.pt"]


def test_a_run_dir_in_use_is_refused_in_one_line_and_a_dead_runs_lock_is_not(small_digits, tmp_path, write_config):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    config = write_config(tiny_config(small_digits, str(run_dir), train={"epochs": 2, "batch_size": 16}))
    with open(run_dir / ".lock", "w") as held:  # a live run holds it
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        held.write("hybridtrain pid 4242 on node7\n")
        held.flush()
        busy = train_alone(config)
    assert_one_error_line(busy, "is in use by another run", "pid 4242 on node7", "another run_dir")
    assert not (run_dir / "metrics.jsonl").exists()
    # the lock file of a killed run stays behind, but nobody holds it: the next run goes ahead
    claimed, _ = rundir.claim(str(run_dir), None)
    claimed.release()


def test_pruning_removes_only_the_runs_own_checkpoints(tmp_path):
    run_dir = str(tmp_path)
    owner, _ = rundir.claim(run_dir, None)
    foreign = tmp_path / "checkpoint-epoch0009.pt"  # dropped in by hand, e.g. from another run
    foreign.write_bytes(b"someone else's")
    state = {"model": {"w": torch.ones(2)}, "epoch": 0}
    for epoch in (1, 2, 3):
        owner.save_checkpoint(state, epoch, keep=2)
    names = sorted(p.name for p in tmp_path.glob("checkpoint-epoch*.pt"))
    assert names == ["checkpoint-epoch0002.pt", "checkpoint-epoch0003.pt", "checkpoint-epoch0009.pt"]
    assert owner.checkpoints() == ["checkpoint-epoch0002.pt", "checkpoint-epoch0003.pt"]
    owner.release()


@pytest.mark.parametrize("setup,needle", [
    (lambda p: p.write_text("a file"), "is a file, not a folder"),
    (lambda p: None, "holds another run's files"),
])
def test_run_dirs_that_cannot_hold_a_fresh_run_are_one_line(tmp_path, setup, needle):
    target = tmp_path / "run"
    if needle == "holds another run's files":
        target.mkdir()
        (target / "metrics.jsonl").write_text("{}\n")
    else:
        setup(target)
    with pytest.raises(UserError, match=needle) as caught:
        rundir.claim(str(target), None)
    assert "\n" not in str(caught.value)


@pytest.mark.slow
def test_a_bad_validation_image_keeps_the_epoch_names_its_rank_and_resume_records_it(small_digits, tmp_path,
                                                                                      write_config):
    data = tmp_path / "data"
    shutil.copytree(small_digits, data)
    bad = data / "val" / "3" / "zz-not-an-image.jpg"  # the last file of rank 1's shard
    bad.write_bytes(b"this is not a JPEG")
    run_dir = tmp_path / "run"
    config = write_config(tiny_config(str(data), str(run_dir), train={"epochs": 2, "batch_size": 8}))
    failed = horovodrun(2, ["train", "--config", config])
    output = failed.stdout + "\n" + failed.stderr
    assert failed.returncode != 0
    errors = [x for x in output.splitlines() if "hybridtrain: error:" in x]
    assert len(errors) == 1, output[-3000:]
    assert "cannot read image" in errors[0] and "zz-not-an-image.jpg" in errors[0], errors[0]
    assert "epoch 1's training is saved" in errors[0] and "--resume auto" in errors[0]
    assert "died" not in output, "a rank's own bad input is not a dead peer"
    assert "Traceback" not in rank_output(output)
    assert (run_dir / "checkpoint-epoch0001.pt").exists()

    bad.unlink()
    with open(run_dir / "metrics.jsonl", "a") as fh:  # a record cut short by a kill must not stop the resume
        fh.write('{"epoch": 1, "train_lo')
    resumed = horovodrun(2, ["train", "--config", config, "--resume", "auto"])
    assert resumed.returncode == 0, resumed.stdout[-3000:]
    assert "dropping its last line" in resumed.stdout + resumed.stderr
    records = read_metrics(str(run_dir))
    assert [r["epoch"] for r in records] == [1, 2]  # epoch 1 validated at the resume
    assert records[0]["val_count"] == records[1]["val_count"] > 0


def png_claiming(width: int, height: int) -> bytes:
    """A real 1x1 PNG whose header claims width x height (valid CRC): PIL refuses it as a decompression bomb."""
    from PIL import Image
    buffer = io.BytesIO()
    Image.new("RGB", (1, 1)).save(buffer, "PNG")
    data = bytearray(buffer.getvalue())
    ihdr = data.index(b"IHDR")
    data[ihdr + 4:ihdr + 12] = struct.pack(">II", width, height)
    data[ihdr + 17:ihdr + 21] = struct.pack(">I", zlib.crc32(bytes(data[ihdr:ihdr + 17])))
    return bytes(data)


@pytest.mark.parametrize("content", [b"not an image", png_claiming(60000, 60000)], ids=["garbage", "pixel-bomb"])
def test_every_decoder_failure_is_an_unreadable_image(tmp_path, content):
    from hybridtrain.data.folder import UnreadableImage
    from hybridtrain.data.presets import val_transform
    from hybridtrain.data.torchvision_loader import ImageListDataset
    path = tmp_path / "x.jpg"
    path.write_bytes(content)

    class Listing:
        samples = [(str(path), 0)]
    item = ImageListDataset(Listing(), val_transform(32, 32), seed=0)[(0, 0)]
    assert isinstance(item, UnreadableImage) and item.path == str(path)


def test_without_a_terminal_progress_is_a_plain_line_at_an_interval(capsys):
    from hybridtrain.engine.sinks import ProgressBar
    bar = ProgressBar(total=10, epoch=0, epochs=3, world_size=2, interval_s=0.0)
    for step in range(1, 11):
        bar.update(torch.tensor(2.0 * step), torch.tensor(4.0 * step), step)
    bar.close()
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 9 and "\r" not in "".join(lines)  # none at the last step: the epoch line follows
    assert lines[0].startswith("hybridtrain: epoch 1/3 step 1/10 (10%)") and "loss 0.5000" in lines[0]
    assert "img/s" in lines[0] and "ETA" in lines[0]


def test_a_damaged_run_config_is_one_line_for_report(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"epoch": 1, "val_top1": 0.5}) + "\n")
    (tmp_path / "config.yaml").write_text("report: [1, 2\n")
    proc = run([HYBRIDTRAIN, "report", str(tmp_path)])
    assert_one_error_line(proc, "config.yaml is damaged", "restore it")


def test_report_on_an_older_versions_records_reports_what_they_have(tmp_path):
    old = [{"epoch": 1, "train_loss": 1.0, "val_top1": 0.5, "val_top5": 0.9, "lr": 0.1, "epoch_time_s": 2.0},
           {"epoch": 2, "train_loss": 0.5, "val_top1": 0.97, "val_top5": 0.99, "lr": 0.1, "epoch_time_s": 2.0}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in old) + '{"epoch": 3, "va')
    proc = run([HYBRIDTRAIN, "report", str(tmp_path)])
    assert proc.returncode == 0, proc.stderr
    assert "dropping its last line" in proc.stderr and "Traceback" not in proc.stderr
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["convergence_epoch"] == 2 and report["final_top1"] == 0.97 and report["epochs"] == 2


@pytest.mark.slow
def test_a_rank_frozen_mid_training_is_ended_by_the_stall_limits_with_a_warning_first(small_digits, tmp_path,
                                                                                       write_config):
    """SIGSTOP rank 1 in epoch 2 of a 2-rank run: rank 0 warns after distributed.stall_warning_s and ends the job
    after stall_shutdown_s with one line (Gloo's own timeout is set far later, so the watchdog is what acts)."""
    import signal

    from test_horovod_training import signal_a_rank_after_epoch_one
    run_dir = str(tmp_path / "run")
    config = write_config(tiny_config(small_digits, run_dir, train={"epochs": 20, "batch_size": 8},
                                      distributed={"stall_warning_s": 3, "stall_shutdown_s": 8,
                                                   "gloo_timeout_s": 300}))
    proc, output, ended_after = signal_a_rank_after_epoch_one(config, run_dir, 2, 1, signal.SIGSTOP)
    assert proc.returncode != 0 and ended_after < 60, f"the job took {ended_after:.0f} s to end"
    assert "warning: rank 0: no training step finished" in output, output[-3000:]
    errors = [x for x in output.splitlines() if "hybridtrain: error:" in x]
    assert len(errors) == 1 and "distributed.stall_shutdown_s=8" in errors[0] and "--resume auto" in errors[0], errors
    assert "Traceback" not in rank_output(output)

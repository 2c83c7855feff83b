"""Where the time goes (engine/breakdown.py), in real runs where one part dominates on purpose: a slow loader (input),
a large model at a small batch (compute), Horovod's all-reduce held back by a long cycle time on every rank
(communication), and a straggler under DDP (its peer waits in communication; the straggler is named). Each run's
record, its report (report.md, breakdown.png) and, for one, TensorBoard name the dominant part."""
from __future__ import annotations

import glob
import importlib.util
import json
import os
import subprocess
import time

import pytest
import torch
from conftest import (
    BIN,
    HOROVODRUN,
    REPO,
    TORCHRUN,
    assert_one_error_line,
    digits_subset,
    env_with_venv,
    read_metrics,
    tiny_config,
)

from hybridtrain.config import load_config
from hybridtrain.distributed.engines import with_step_contract
from hybridtrain.engine.breakdown import PARTS, STARTUP_PARTS, StepClock
from hybridtrain.engine.step import EagerStep, train_step
from hybridtrain.precision.scaler import create_precision

SLOWED = os.path.join(REPO, "tests", "scripts", "slowed_train.py")
PYTHON = os.path.join(BIN, "python")


def launch(prefix: list[str], config: str, ranks: int, args: tuple = (), **env) -> subprocess.CompletedProcess:
    """``slowed_train.py train --config CONFIG ARGS`` under ``prefix`` (a launcher, or nothing: one rank alone)."""
    proc = subprocess.run([*prefix, PYTHON, SLOWED, "train", "--config", config, *args], capture_output=True, text=True,
                          timeout=300, cwd=REPO, stdin=subprocess.DEVNULL,
                          env={**env_with_venv(ranks), **{k: str(v) for k, v in env.items()}})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc


def one_epoch(data_path: str, run_dir: str, **sections) -> dict:
    sections.setdefault("optim", {}).update(warmup_epochs=0)
    return tiny_config(data_path, run_dir, train={"epochs": 1, **sections.pop("train", {})}, **sections)


def checked_record(run_dir: str, dominant: str) -> dict:
    """The epoch's record: every part present, the parts' sum the epoch's time, ``dominant`` first; the report
    (written by train's rank 0) says so too and draws breakdown.png."""
    record = read_metrics(run_dir)[-1]
    parts = record["breakdown_s"]
    assert list(parts) == list(PARTS) and all(v >= 0 for v in parts.values()), parts
    assert abs(sum(parts.values()) - record["epoch_time_s"]) < 0.05 * record["epoch_time_s"] + 0.05, record
    assert record["dominant"] == dominant, parts
    assert f"Dominant: **{dominant}**" in open(os.path.join(run_dir, "report.md")).read()
    assert open(os.path.join(run_dir, "breakdown.png"), "rb").read(4) == b"\x89PNG"
    return record


def test_the_step_marks_the_engines_synchronize_as_communication():
    """train_step marks the engine's synchronize(), the wait for the all-reduce that the backward left, for the
    epoch's clock: a synchronize() that takes 0.2 s (here the whole of a job of one's wait, standing for Horovod's)
    adds 0.2 s per step to communication, and nothing to compute or the optimizer's step."""
    model = torch.nn.Linear(4, 3)
    optimizer = with_step_contract(torch.optim.SGD(model.parameters(), lr=0.1))
    waits = []

    def synchronize():
        time.sleep(0.2)
        waits.append(time.perf_counter())
    optimizer.synchronize = synchronize
    precision = create_precision(load_config(None, ["precision.mode=fp32"]).precision)
    clock, step = StepClock(torch.device("cpu")), EagerStep(model)
    batch = [(torch.randn(8, 4), torch.randint(0, 3, (8,)), 1.0)]
    train_step(step, optimizer, precision, batch)  # autograd's first pass, untimed
    waits.clear()
    for _ in range(3):
        clock.mark("begin")
        batch = [(torch.randn(8, 4), torch.randint(0, 3, (8,)), 1.0)]
        clock.mark("drawn")
        assert train_step(step, optimizer, precision, batch, clock=clock).stepped
        clock.mark("end")
    parts = clock.totals()
    assert len(waits) == 3
    assert 0.6 <= parts["communication"] < 0.6 + 0.5, parts  # the three waits, and little else
    assert parts["compute"] < 0.6 and parts["optimizer"] < 0.6, parts  # neither holds the waits


def test_a_slow_loader_is_named_input_and_the_first_step_is_split(small_digits, tmp_path, write_config):
    """Each training batch collates 1 s longer (7 steps): waiting for input dominates. The first record holds the
    time from the process's start to its first step, split into the set-up's parts, which add up to it. Under
    --profile, the window's steps (1 waited, 1 warmed up, 2 recorded) are a Chrome trace in the run folder, and the
    CUDA memory snapshot asked for on the CPU is said not to be taken; a window past the run's 7 steps is refused."""
    run_dir = str(tmp_path / "input")
    cfg = one_epoch(small_digits, run_dir, train={"batch_size": 32}, report={"tensorboard": False},
                    profile={"wait": 1, "warmup": 1, "active": 2, "memory": True})
    proc = launch([], write_config(cfg), 1, args=("--profile",), SLOW_BATCH_S=1.0)
    assert "warning: profile.memory is a CUDA memory snapshot and this run is on cpu" in proc.stdout
    assert not glob.glob(os.path.join(run_dir, "profile", "memory-*"))
    beyond = str(tmp_path / "beyond")
    refused = subprocess.run([PYTHON, SLOWED, "train", "--profile", "--config", write_config(
        one_epoch(small_digits, beyond, train={"batch_size": 32}, profile={"wait": 5, "warmup": 1, "active": 2}),
        "beyond.yaml")], capture_output=True, text=True, timeout=300, cwd=REPO, env=env_with_venv(1))
    assert_one_error_line(refused, "profile.wait + warmup + active = 5 + 1 + 2 = 8 steps, ends after the 7 step(s)")
    trace = json.load(open(os.path.join(run_dir, "profile", "trace-rank0.json")))
    assert any(event.get("name") == "ProfilerStep#3" for event in trace["traceEvents"])  # the recorded steps
    record = checked_record(run_dir, "input")
    assert record["breakdown_s"]["input"] > 6.0  # 7 batches x 1 s
    startup = record["startup_s"]
    assert set(STARTUP_PARTS) <= set(startup) and startup["imports"] > 0 and startup["first_step"] >= 1.0
    assert abs(sum(startup[p] for p in STARTUP_PARTS) - startup["total"]) < 1e-6
    assert "hybridtrain: first step" in proc.stdout and "breakdown_per_rank_s" not in record  # one rank


def test_a_large_model_at_a_small_batch_is_named_compute(digits_dir, tmp_path, write_config):
    """ResNet-50 at 4 images of 64 px per step: forward and backward dominate."""
    data = digits_subset(digits_dir, str(tmp_path / "data"), 4, 1)
    run_dir = str(tmp_path / "compute")
    cfg = one_epoch(data, run_dir, model={"arch": "resnet50"}, data={"crop_size": 64, "val_resize": 64},
                    train={"batch_size": 4}, report={"tensorboard": False})
    launch([], write_config(cfg), 1)
    checked_record(run_dir, "compute")
    assert not os.path.exists(os.path.join(run_dir, "profile"))  # off by default


def test_an_all_reduce_held_back_on_every_rank_is_named_communication(digits_dir, tmp_path, write_config):
    """Horovod's background cycle at its longest, 1 s (horovod.cycle_time_ms): each step's all-reduce waits for the
    next cycle in synchronize() on both ranks, so a step lasts a cycle; at 4 images per rank a step's own work is a
    fraction of it even on 2 loaded cores, and exposed communication dominates on each; the parts reach TensorBoard."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    run_dir = str(tmp_path / "communication")
    data = digits_subset(digits_dir, str(tmp_path / "data"), 8, 2)  # 10 steps of 2 x 4 images
    cfg = one_epoch(data, run_dir, horovod={"cycle_time_ms": 1000}, train={"batch_size": 4})
    launch([HOROVODRUN, "--gloo", "-np", "2", "-H", "localhost:2"], write_config(cfg), 2)
    record = checked_record(run_dir, "communication")
    assert record["dominant_per_rank"] == ["communication", "communication"]
    assert len(record["breakdown_per_rank_s"]["communication"]) == 2
    events = EventAccumulator(os.path.join(run_dir, "tensorboard"))
    events.Reload()
    assert {f"time/{part}_s" for part in PARTS} <= set(events.Tags()["scalars"])


def test_a_straggler_under_ddp_is_named_and_its_peer_waits_in_communication(digits_dir, tmp_path, write_config):
    """Rank 1's loader is 1 s slower per batch (at 4 images per rank a step's passes take a fraction of that, even
    on 2 loaded cores): on DDP rank 0 waits at the end of its backward for rank 1's gradients (communication), rank
    1's own time goes to input, and rank 1 is the slowest rank."""
    run_dir = str(tmp_path / "straggler")
    data = digits_subset(digits_dir, str(tmp_path / "data"), 8, 2)  # 10 steps of 2 x 4 images
    cfg = one_epoch(data, run_dir, report={"tensorboard": False}, train={"batch_size": 4})
    launch([TORCHRUN, "--standalone", "--nproc-per-node=2", "--no-python"], write_config(cfg), 2,
           SLOW_BATCH_S=1.0, SLOW_RANK=1)
    record = read_metrics(run_dir)[-1]
    assert record["slowest_rank"] == 1 and record["dominant_per_rank"] == ["communication", "input"], record
    report = json.load(open(os.path.join(run_dir, "report.json")))
    assert report["slowest_rank"] == 1
    assert "Slowest rank: 1" in open(os.path.join(run_dir, "report.md")).read()


def assert_parts_add_up(record: dict) -> None:
    """Every rank's parts sum to the record's epoch time within 2%, and the epoch's training time lies inside it:
    the ranks' clocks start together (no rank counts rank 0's own set-up as its first step's wait), and a continued
    epoch's times and breakdown span the same (its earlier process's steps included)."""
    epoch_s, parts = record["epoch_time_s"], record.get("breakdown_per_rank_s") or {
        part: [seconds] for part, seconds in record["breakdown_s"].items()}
    for rank in range(len(parts["other"])):
        total = sum(parts[part][rank] for part in PARTS)
        assert abs(total - epoch_s) <= 0.02 * epoch_s, (rank, total, record)
        steps = sum(parts[part][rank] for part in PARTS[:4])
        assert steps <= record["train_time_s"] * 1.02 + 0.01, (rank, steps, record)
    assert record["train_time_s"] <= epoch_s, record
    assert abs(record["images_per_sec"] - record["samples_seen"] / record["train_time_s"]) < 1e-6 * record[
        "images_per_sec"]


def test_the_parts_add_up_on_every_rank_fresh_with_tensorboard_under_horovod(small_digits, tmp_path, write_config):
    """A fresh 2-rank Horovod run where rank 0 alone starts TensorBoard's writer before the first step: each rank's
    parts still sum to the epoch, its first record's start-up parts to their total."""
    run_dir = str(tmp_path / "fresh")
    launch([HOROVODRUN, "--gloo", "-np", "2", "-H", "localhost:2"], write_config(one_epoch(small_digits, run_dir)), 2)
    (record,) = read_metrics(run_dir)
    assert_parts_add_up(record)
    startup = record["startup_s"]
    assert abs(sum(startup[p] for p in STARTUP_PARTS) - startup["total"]) < 1e-6 and startup["first_step"] > 0


def test_the_parts_add_up_on_every_rank_with_sinks_stopped_and_resumed_under_ddp(small_digits, tmp_path,
                                                                                  write_config):
    """A 2-rank DDP run logging to MLflow and W&B (rank 0 starts their tracked runs, seconds of set-up its peer
    does not have), SIGTERM'd mid-epoch 1 and resumed: the continued epoch's record covers both processes' steps
    (its epoch and training times and its parts), the next one its own, and each rank's parts sum to the epoch."""
    from test_preemption import train_until_sigterm
    sinks = {name: mode for name, mode in (("mlflow", "local"), ("wandb", "offline"))
             if importlib.util.find_spec(name) is not None}
    if not sinks:
        pytest.skip("the sinks extra (pip install 'hybridtrain[sinks]') is not installed")
    run_dir = str(tmp_path / "sinks")
    config = write_config(one_epoch(small_digits, run_dir, train={"epochs": 2, "batch_size": 8},
                                    report={"tensorboard": False}, sinks={**sinks, "project": "breakdown"}))
    stopped = train_until_sigterm(config, (0, 1), resume=False, engine="torch")
    assert stopped.returncode == 0 and "stopped on SIGTERM after step" in stopped.stdout, stopped.stdout[-3000:]
    launch([TORCHRUN, "--standalone", "--nproc-per-node=2", "--no-python"], config, 2, args=("--resume", "auto"))
    records = read_metrics(run_dir)
    assert [r["epoch"] for r in records] == [1, 2]
    for record in records:
        assert_parts_add_up(record)
    assert records[0]["samples_seen"] == records[1]["samples_seen"]  # the whole epoch, both processes' share


def test_the_transforms_are_torchvisions_pixel_for_pixel_and_the_loader_imports_no_torchvision():
    """data/presets.py writes torchvision's transforms on PIL and torch (importing torchvision costs every rank and
    worker ~2 s of torch._dynamo): the same random draws and pixels, crops larger than the image padded alike."""
    import itertools

    import numpy as np
    import torch
    from PIL import Image
    from torchvision import transforms as T

    from hybridtrain.data import presets as P

    def reference(steps, u8):
        tail = [T.PILToTensor()] if u8 else [T.ToTensor(), T.Normalize(P.IMAGENET_MEAN, P.IMAGENET_STD)]
        return T.Compose(steps + tail)
    rng = np.random.default_rng(0)
    for w, h in ((32, 32), (40, 25), (17, 90)):
        img = Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
        for crop, area, flip, u8 in itertools.product((8, 64), (0.08, 1.0), (False, True), (False, True)):
            steps = [T.RandomResizedCrop(crop, scale=(area, 1.0))] + ([T.RandomHorizontalFlip()] if flip else [])
            for seed in range(3):
                torch.manual_seed(seed)
                want = reference(steps, u8)(img)
                torch.manual_seed(seed)
                assert torch.equal(P.train_transform(crop, area, flip, u8)(img), want)
            for resize in (8, 36):
                got = P.val_transform(crop, resize, u8)(img)
                assert torch.equal(got, reference([T.Resize(resize), T.CenterCrop(crop)], u8)(img))
    code = "import sys, hybridtrain.data.torchvision_loader; print('torchvision' in sys.modules)"
    out = subprocess.run([PYTHON, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "False", out.stderr

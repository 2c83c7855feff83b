"""The stall watchdog and a resume on another layout, on real runs.

1. The stall watchdog never kills a healthy run: a validation pass longer than ``distributed.stall_shutdown_s`` is
   the rank's own work (``watchdog.local_work``), not a hang. A truly stuck rank is still named within the limit:
   tests/test_run_ownership.py::test_a_rank_frozen_mid_training_is_ended_by_the_stall_limits_with_a_warning_first
   (Horovod) and tests/test_torch_engine.py::test_a_frozen_torch_rank_is_ended_by_the_stall_limits_with_a_warning_first
   (torch) SIGSTOP rank 1 mid-training and still get the one 'a rank hung' line after stall_shutdown_s.
2. Resume never trains an image twice or skips one: a mid-epoch checkpoint resumed on another layout (rank count,
   train.batch_size) continues at the samples of the epoch's permutation already consumed.
"""
from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys
import time
from collections import Counter

import numpy as np
import pytest
import yaml
from conftest import HYBRIDTRAIN, REPO, read_metrics, run, tiny_config

from hybridtrain.data import sharding
from hybridtrain.engine.guards import exit_after_s
from hybridtrain.engine.resume import consumed_samples, step_in_epoch

STALL_SHUTDOWN_S = 2  # shorter than the validation pass below (~1,800 images), longer than any training step


# ----------------------------------------------------------------------------- the sample arithmetic (pure)

def test_consumed_samples_and_the_resumed_step_by_hand():
    """3 steps of 1 rank x 8 (k=1) consumed 24 samples; on 2 ranks x 12 that is step 1 (24 // 24); a second stop
    2 passes into that segment has consumed 24 + 2 x 24 = 72. With k=2 on 2 x 12 a step takes 48: step 0."""
    assert consumed_samples(0, 3, 1, 8) == 24
    assert step_in_epoch(24, 2, 12, 1) == 1
    assert consumed_samples(24, 2, 2, 12) == 72
    assert step_in_epoch(24, 2, 12, 2) == 0 and step_in_epoch(72, 2, 12, 2) == 1
    assert consumed_samples(40, 5, 3, 4) == 100  # 40 + 5 x 12


@pytest.mark.parametrize("before,after,stop_steps", [((1, 8), (2, 12), 3), ((2, 8), (2, 5), 2), ((2, 8), (3, 8), 4),
                                                    ((4, 4), (1, 16), 1)])
def test_a_changed_layout_continues_the_permutation_each_sample_at_most_once(before, after, stop_steps):
    """80 samples, stopped after ``stop_steps`` steps of (ranks, batch) ``before``, continued on ``after`` from the
    consumed samples: every sample trained at most once, and exactly the permutation's first ``consumed + the
    new layout's full global batches`` are trained (hand check: 1 x 8 for 3 steps = 24, then 2 x 12: 56 left,
    2 steps of 24 = 48, so 72 trained and 8 left out, fewer than one global batch)."""
    n, seed, epoch = 80, 3, 0
    order = np.random.default_rng([seed, epoch]).permutation(n)  # the epoch's permutation, computed here
    (r0, b0), (r1, b1) = before, after
    first = [i for rank in range(r0) for batch in sharding.train_batches(n, rank, r0, b0, seed, epoch)[:stop_steps]
             for i in batch]
    consumed = consumed_samples(0, stop_steps, r0, b0)
    rest = [i for rank in range(r1) for batch in sharding.train_batches(n, rank, r1, b1, seed, epoch, start=consumed)
            for i in batch]
    trained = Counter(first + rest)
    assert max(trained.values()) == 1
    full = (n - consumed) // (r1 * b1) * (r1 * b1)
    assert sorted(trained) == sorted(order[:consumed + full].tolist())
    assert n - len(trained) < r1 * b1
    if (before, after, stop_steps) == ((1, 8), (2, 12), 3):
        assert (consumed, len(rest), len(trained)) == (24, 48, 72)


def test_dali_on_another_layout_is_one_line_naming_both_layouts_and_the_fix():
    """DALI's readers start an epoch only at its beginning: continuing by samples cannot be exact there."""
    from hybridtrain.engine.resume import check_continuable_by_samples
    from hybridtrain.errors import UserError
    check_continuable_by_samples("torchvision", 0, 24, (1, 8), (2, 12))  # torchvision (and synthetic) continue
    check_continuable_by_samples("synthetic", 0, 24, (1, 8), (2, 12))
    with pytest.raises(UserError) as refused:
        check_continuable_by_samples("dali_cpu", 0, 24, (1, 8), (2, 12))
    line = str(refused.value)
    assert "\n" not in line and "after 24 samples of epoch 1" in line, line
    assert "train.batch_size=8 on 1 rank(s)" in line and "train.batch_size=12 on 2 rank(s)" in line, line
    assert "resume with train.batch_size=8 on 1 rank(s), or with data.backend=torchvision" in line, line


# ----------------------------------------------------------------------------- one stop and one resume (real)

@pytest.fixture(scope="module")
def digits_with_a_long_validation(digits_dir, tmp_path_factory) -> str:
    """8 train images per class (80: 5 steps of 2 x 8), and ~800 validation images (the digits' val split and 45
    train images per class): with data.val_batch_size 1 a pass of about 5 s on the CPU, longer than the stall
    limit."""
    out = tmp_path_factory.mktemp("data") / "long-val"
    for cls in sorted(os.listdir(os.path.join(digits_dir, "train"))):
        os.makedirs(out / "train" / cls)
        os.makedirs(out / "val" / cls)
        train = sorted(os.listdir(os.path.join(digits_dir, "train", cls)))
        for name in train[:8]:
            shutil.copy(os.path.join(digits_dir, "train", cls, name), out / "train" / cls / name)
        for name in train[:45]:
            shutil.copy(os.path.join(digits_dir, "train", cls, name), out / "val" / cls / f"train-{name}")
        for name in os.listdir(os.path.join(digits_dir, "val", cls)):
            shutil.copy(os.path.join(digits_dir, "val", cls, name), out / "val" / cls / name)
    return str(out)


def recipe(data: str, run_dir: str, batch_size: int) -> dict:
    # data.val_batch_size 1: the validation pass costs ~5 ms an image on the CPU (~1 ms in batches of 12)
    return tiny_config(data, run_dir, train={"epochs": 1, "batch_size": batch_size, "threads": 1, "progress": False},
                       data={"val_batch_size": 1},
                       optim={"name": "goyal", "lr": 0.05, "warmup_epochs": 0}, elastic={"audit_samples": True},
                       distributed={"stall_warning_s": 1, "stall_shutdown_s": STALL_SHUTDOWN_S})


@pytest.fixture(scope="module")
def stopped_then_resumed(digits_with_a_long_validation, tmp_path_factory):
    """Epoch 1 SIGTERM'd mid-way on 2 ranks x 8, then resumed with --resume auto as one process x 12 (both the
    rank count and the per-rank batch changed), with the stall limit shorter than its validation pass. One rank
    there: the watchdog's question is the rank's own work, not two ranks' validation speeds on shared cores."""
    from test_preemption import train_until_sigterm
    run_dir = tmp_path_factory.mktemp("resume-layout") / "run"
    config = run_dir.parent / "config.yaml"
    config.write_text(yaml.safe_dump(recipe(digits_with_a_long_validation, str(run_dir), 8)))
    stopped = train_until_sigterm(str(config), (0, 1), resume=False)
    assert stopped.returncode == 0 and "stopped on SIGTERM after step" in stopped.stdout, stopped.stdout[-3000:]
    config.write_text(yaml.safe_dump(recipe(digits_with_a_long_validation, str(run_dir), 12)))
    resumed = run([HYBRIDTRAIN, "train", "--config", str(config), "--resume", "auto"])
    return resumed, run_dir


def audited(run_dir) -> list[dict]:
    return [json.loads(line) for path in glob.glob(os.path.join(run_dir, "samples", "*.jsonl"))
            for line in open(path) if line.strip()]


def test_a_resume_on_other_ranks_and_batch_trains_every_sample_once(stopped_then_resumed):
    resumed, run_dir = stopped_then_resumed
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    lines = audited(run_dir)
    before = [i for r in lines if r["ranks"] == 2 for i in r["samples"]]
    after = [i for r in lines if r["ranks"] == 1 for i in r["samples"]]
    consumed = len(before)
    assert consumed % 16 == 0 and 0 < consumed < 80, lines  # whole steps of 2 x 8, stopped mid-epoch
    assert f"resumed from sample {consumed} of epoch 1" in resumed.stdout, resumed.stdout[-3000:]
    trained = Counter(before + after)
    assert max(trained.values()) == 1, [i for i, c in trained.items() if c > 1]
    full = (80 - consumed) // 12 * 12  # the rest in global batches of 1 x 12; the remainder is left out
    order = np.random.default_rng([3, 0]).permutation(80)  # seed 3 (tiny_config), epoch 0
    assert sorted(trained) == sorted(order[:consumed + full].tolist())
    [record] = read_metrics(str(run_dir))
    assert record["samples_seen"] == consumed + full <= 80, record


def test_a_validation_longer_than_the_stall_limit_is_work_not_a_hang(stopped_then_resumed):
    """The resumed run's validation pass outlasts stall_shutdown_s: no warning, no 'a rank hung', a finished run."""
    resumed, run_dir = stopped_then_resumed
    output = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0 and "no training step finished" not in output, output[-3000:]
    [record] = read_metrics(str(run_dir))
    # the test means something: the time after training (checkpoint, validation) is past the limit, which the
    # watchdog without local_work counted as a stall (it ended this run with 'a rank hung')
    assert record["epoch_time_s"] - record["train_time_s"] > exit_after_s(STALL_SHUTDOWN_S, 0) + 1, record


def test_local_work_stops_the_clock_and_a_stall_after_it_is_still_named():
    """The mechanism on the real watchdog (stall_shutdown_s=1, rank 0): 3 s of local work, twice the limit, pass
    without a word; the clock starts again at its end, so the stall right after it ends the rank (3) with the
    'a rank hung' line about 1 s later, not sooner and not never."""
    script = ("import sys, time\nfrom hybridtrain.engine.guards import StallWatchdog, local_work\n"
              "w = StallWatchdog(1, 1, rank=0, poll_s=0.05); w.beat()\n"
              "with local_work('validation'):\n    time.sleep(3)\n"
              "print(time.monotonic(), flush=True); sys.stderr.flush(); time.sleep(30)\n")
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=REPO)
    try:
        # the local work is over, at this CLOCK_MONOTONIC time (one clock for every process of this machine: a
        # loaded machine's delay in reading the line is no part of the limit)
        after = proc.stdout.readline()
        proc.wait(timeout=60)
        took = time.monotonic() - float(after)
        stderr = proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 3 and after.strip(), after + stderr
    assert "warning: rank 0: no training step finished for 1 s" in stderr, stderr  # from the end of the work
    assert "a rank hung" in stderr and "error: rank 0: no training step finished for 1 s" in stderr, stderr
    assert 0.5 <= took < 25, took  # the upper bound: the watchdog, not the end of the 30 s sleep, ended it

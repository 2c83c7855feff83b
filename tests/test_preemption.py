"""Preemption and exact resume: SIGTERM mid-epoch in each optimizer phase and precision mode, then
``--resume auto``, ends bitwise-identical to an uninterrupted run (train.deterministic, CPU)."""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys

import pytest
import yaml
from conftest import (
    HYBRIDTRAIN,
    WITH_WORKERS,
    digits_subset,
    env_with_venv,
    horovodrun,
    rank_output,
    tiny_config,
)
from test_horovod_training import launch_train, rank_pids

PRECISIONS = {
    "fp32": {"mode": "fp32"},
    "fp64": {"mode": "fp64"},
    "mixed-fp16": {"mode": "mixed", "compute_dtype": "fp16"},
    "mixed-bf16": {"mode": "mixed", "compute_dtype": "bf16"},
    "layered": {"mode": "layered"},
    "fp16_pure": {"mode": "fp16_pure"},
}


def recipe(data: str, run_dir: str, precision: str, channels_last: bool = False, workers: bool = True) -> dict:
    optim = {"name": "hybrid", "adabound_epochs": 1}  # epoch 1: AdaBound, epoch 2: LARS-SGD
    if precision == "fp16_pure":  # FP16 optimizer state: no AdaBound (docs/precision.md)
        optim = {"name": "goyal", "lr": 0.05, "warmup_epochs": 1}
    # channels_last, as on GPUs: Horovod's broadcast and gradient hooks see NHWC tensors
    return tiny_config(data, run_dir, train={"epochs": 2, "batch_size": 8, "deterministic": True},
                       optim=optim, precision=PRECISIONS[precision],
                       data={"channels_last": channels_last, **(WITH_WORKERS if workers else {})})


def file_digest(path) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def train_until_sigterm(config: str, ranks_to_signal: tuple[int, ...], resume: bool,
                        engine: str = "horovod") -> subprocess.CompletedProcess:
    """Start a 2-rank run of ``engine``, SIGTERM the given ranks once training has begun (as SLURM does before a
    time limit), and wait for the job to end."""
    cmd = [*launch_train(2, engine), "--config", config]
    proc = subprocess.Popen(cmd + (["--resume", "auto"] if resume else []), env=env_with_venv(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if "steps/epoch" in line:  # the setup line: the signal handlers are in place
                for rank in ranks_to_signal:
                    for pid in rank_pids(config, rank, engine):
                        os.kill(pid, signal.SIGTERM)
                break
        lines += proc.stdout.readlines()
        proc.wait(timeout=600)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return subprocess.CompletedProcess(cmd, proc.returncode, "".join(lines), "")


def straight_then_stopped_and_resumed(straight: str, broken: str, engine: str, launch) -> int:
    """``straight`` trained on 2 ranks of ``engine`` (``launch``: conftest's torchrun or horovodrun), and ``broken``
    SIGTERM'd mid-epoch 1 then resumed with --resume auto from the step it stopped after; returns that step."""
    done = launch(2, ["train", "--config", straight])
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    stopped = train_until_sigterm(broken, (1,), resume=False, engine=engine)
    assert stopped.returncode == 0, stopped.stdout[-3000:]
    step = int(re.search(r"after step (\d+) of epoch 1;", stopped.stdout).group(1))
    assert 0 < step < 5
    resumed = launch(2, ["train", "--config", broken, "--resume", "auto"])
    assert resumed.returncode == 0 and f"resumed from step {step} of epoch 1" in resumed.stdout, resumed.stdout[-3000:]
    return step


@pytest.fixture(scope="module")
def few_digits(small_digits, tmp_path_factory) -> str:
    """8 train and 3 val images per class: 5 steps of 2 x 8 per epoch, enough for a stop in the middle of one (FP16
    convolutions are slow on the CPU, so every step counts here)."""
    return digits_subset(small_digits, str(tmp_path_factory.mktemp("data") / "few"), 8, 3)


@pytest.fixture(scope="module")
def straight_runs(few_digits, tmp_path_factory):
    """One uninterrupted run per precision mode, made on first use."""
    runs = {}

    def get(precision: str, channels_last: bool = False):
        if (precision, channels_last) not in runs:
            run_dir = tmp_path_factory.mktemp(f"straight-{precision}{'-nhwc' if channels_last else ''}")
            config = run_dir / "config-straight.yaml"
            # loaded in process: the interrupted runs load in workers (SLURM signals them too), so their bitwise
            # equality with these also checks that both loaders give the same batches
            config.write_text(yaml.safe_dump(recipe(few_digits, str(run_dir), precision, channels_last,
                                                    workers=False)))
            done = horovodrun(2, ["train", "--config", str(config)])
            assert done.returncode == 0, done.stdout[-3000:]
            runs[(precision, channels_last)] = run_dir
        return runs[(precision, channels_last)]
    return get


@pytest.mark.slow
@pytest.mark.parametrize("precision", list(PRECISIONS))
def test_channels_last_trains_on_two_ranks_and_its_model_loads_strictly_into_torchvision(straight_runs, precision):
    """NHWC under Horovod in every precision mode and both optimizer phases: equal digests on both ranks, and
    final_model.pt holds contiguous CPU tensors that torchvision's ResNet-18 loads strictly."""
    import torch
    import torchvision
    run_dir = straight_runs(precision, channels_last=True)
    report = json.loads((run_dir / "report.json").read_text())
    assert len(report["rank_digests"]) == 2 and len(set(report["rank_digests"])) == 1
    state = torch.load(run_dir / "final_model.pt", weights_only=True)
    assert all(t.device.type == "cpu" and t.is_contiguous() for t in state.values())
    model = torchvision.models.resnet18(num_classes=10)
    model.load_state_dict(state, strict=True)
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["compression"] for r in records] == [EXPECTED_COMPRESSION[precision]] * 2
    # every mode trains on two ranks (these runs are the suite's only 2-rank run of each mode): no NaN anywhere,
    # a peak memory per rank, and FP16 computes with dynamic loss scaling whose 10 steps only halve its 2^16
    assert all(v == v for r in records for v in r.values() if isinstance(v, float)), records
    assert all(r["peak_memory_mb"] > 0 and len(r["peak_memory_mb_per_rank"]) == 2 for r in records)
    skipped = sum(r["skipped_steps"] for r in records)
    if precision in ("fp16_pure", "mixed-fp16", "layered"):
        assert records[-1]["loss_scale"] * 2 ** skipped == 65536.0, records
    else:
        assert records[-1]["loss_scale"] == 1.0 and skipped == 0, records


# distributed.compression auto: fp16 where the loss is scaled (FP16 computes), none elsewhere
EXPECTED_COMPRESSION = {"fp32": "none", "fp64": "none", "mixed-fp16": "fp16", "mixed-bf16": "none", "layered": "fp16",
                        "fp16_pure": "fp16"}

# Every kind of state a resume must carry, once: fp32 (no scaler, AdaBound's state; fp64 and mixed-bf16 keep no
# scaler either, and their straight runs are checked above), fp16_pure (FP16 parameters and momentum, a dynamic loss
# scaler, in the first epoch), mixed-fp16 (the scaler and LARS-SGD's momentum in the second epoch; layered keeps the
# same scaler); NCHW in FP32, NHWC in FP16. The FP16 cases run NHWC (and share the straight runs of the test above):
# the CPU's FP16 convolution backward in NCHW is torch's slow reference kernel, about 30 times FP32's (3.4 s a step
# here, against 0.5 s in NHWC).
CASES = [("fp32", "first epoch", False), ("fp16_pure", "first epoch", True), ("mixed-fp16", "second epoch", True)]


@pytest.mark.slow
@pytest.mark.parametrize("precision,stop_in,channels_last", CASES)
def test_sigterm_mid_epoch_then_resume_auto_is_bitwise_exact(few_digits, tmp_path, write_config, straight_runs,
                                                             precision, stop_in, channels_last):
    """First epoch: AdaBound (hybrid) or warmup (fp16_pure's goyal); second epoch: LARS-SGD. The second-epoch
    case starts from the uninterrupted run's epoch-1 checkpoint, so the SIGTERM lands inside epoch 2."""
    straight_dir, broken_dir = straight_runs(precision, channels_last), tmp_path / "broken"
    broken = write_config(recipe(few_digits, str(broken_dir), precision, channels_last), "broken.yaml")
    epoch = 1
    if stop_in == "second epoch":
        broken_dir.mkdir()
        for name in ("checkpoint-epoch0001.pt", "checkpoint-epoch0001.pt.sha256", "metrics.jsonl"):
            shutil.copy(straight_dir / name, broken_dir / name)
        (broken_dir / "metrics.jsonl").write_text((straight_dir / "metrics.jsonl").read_text().splitlines()[0] + "\n")
        epoch = 2
    stopped = train_until_sigterm(broken, (1,) if epoch == 1 else (0, 1), resume=epoch == 2)
    assert stopped.returncode == 0, stopped.stdout[-3000:]
    assert "Traceback" not in rank_output(stopped.stdout)
    line = next(x for x in stopped.stdout.splitlines() if "stopped on SIGTERM" in x)
    assert "resumable" in line and "--resume auto" in line
    assert f"of epoch {epoch};" in line, line  # mid-epoch, in the intended optimizer phase
    assert not (broken_dir / "final_model.pt").exists()

    resumed = horovodrun(2, ["train", "--config", broken, "--resume", "auto"])
    assert resumed.returncode == 0, resumed.stdout[-3000:]
    assert "resumed from step" in resumed.stdout
    assert file_digest(broken_dir / "final_model.pt") == file_digest(straight_dir / "final_model.pt"), line
    report = json.loads((broken_dir / "report.json").read_text())
    assert len(set(report["rank_digests"])) == 1
    straight_metrics = [json.loads(x) for x in (straight_dir / "metrics.jsonl").read_text().splitlines()]
    broken_metrics = [json.loads(x) for x in (broken_dir / "metrics.jsonl").read_text().splitlines()]
    for a, b in zip(straight_metrics, broken_metrics, strict=True):
        keys = ("train_loss", "val_top1", "samples_seen", "loss_scale", "skipped_steps")  # the scaler continues too
        assert [a[k] for k in keys] == [b[k] for k in keys], (a, b)


def test_resume_auto_without_a_checkpoint_starts_fresh(small_digits, tmp_path, write_config):
    cfg = write_config(tiny_config(small_digits, str(tmp_path / "run"),
                                   train={"epochs": 1, "batch_size": 16}, optim={"name": "sgd"}))
    proc = horovodrun(2, ["train", "--config", cfg, "--resume", "auto"])
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "no checkpoint in" in proc.stdout and "starting fresh" in proc.stdout
    assert (tmp_path / "run" / "final_model.pt").exists()


def test_a_bad_resume_value_is_one_line(tmp_path):
    from conftest import assert_one_error_line, run
    assert_one_error_line(run([HYBRIDTRAIN, "train", "--config", "configs/demo.yaml", "--resume", "latest"]),
                          "--resume takes no value or 'auto'")


CHECK_SCRIPT = """
import os, signal
from hybridtrain.distributed import collectives as distributed
from hybridtrain.engine.guards import PreemptionWatch
topo = distributed.init(device="cpu", engine="horovod")
watch = PreemptionWatch()
watch.join(topo)  # the job has formed (a SIGTERM before that ends the rank at once)
watch.every = 8
for step in range(1, 40):
    if step == 11:
        os.kill(os.getpid(), signal.SIGTERM)
    stop = watch.after_step()
    print("check" if watch.handle is not None else "-", step)
    if stop:
        print("stop", step)
        break
watch.close()
"""


def test_the_sigterm_flag_is_summed_every_few_steps_and_still_stops_within_them():
    """The flag's CPU all-reduce runs on Horovod's background thread, between the gradients', so
    a long epoch sums it every 8th step, not every step; a SIGTERM before step 11 is summed at step 16 and stops
    the run after step 17 (the check started at 16 is collected one step later). steps_between_checks: every 8th
    step, or 4 times an epoch, so the 5-step epochs above stop after every step."""
    from hybridtrain.engine.guards import steps_between_checks
    assert [steps_between_checks(n) for n in (1, 5, 8, 31, 32, 1000, 5004)] == [1, 1, 2, 7, 8, 8, 8]
    proc = subprocess.run([sys.executable, "-c", CHECK_SCRIPT], env=env_with_venv(), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.split("\n")
    assert [int(x.split()[1]) for x in lines if x.startswith("check")] == [8, 16]
    assert "stop 17" in lines

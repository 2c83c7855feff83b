"""Elastic training (``train --elastic``): re-sharding on a resize, the schedule's policy, and a real
3 -> 2 -> 3 ranks run under horovodrun's elastic mode, driven by a discovery script this test rewrites."""
from __future__ import annotations

import glob
import importlib.util
import json
import os
import signal
import subprocess

import numpy as np
import pytest
from conftest import (
    HOROVODRUN,
    HYBRIDTRAIN,
    WITH_WORKERS,
    assert_one_error_line,
    env_with_venv,
    read_metrics,
    tiny_config,
)
from test_time_breakdown import assert_parts_add_up

from hybridtrain.config import config_from_dict
from hybridtrain.data import sharding
from hybridtrain.engine.breakdown import STARTUP_PARTS
from hybridtrain.engine.elastic import step_in_epoch
from hybridtrain.optim import create_schedule
from hybridtrain.optim.schedules import adabound_bounds, bound_progress

MLFLOW = importlib.util.find_spec("mlflow") is not None  # the sinks extra: the run logs to MLflow too


def test_a_resize_mid_epoch_neither_repeats_nor_skips_a_sample():
    """3 ranks for 6 steps, then 2 ranks from the consumed offset: the ranks' batches, in step and rank order,
    are the epoch's permutation (NumPy's, drawn here) up to the last full global batch."""
    n, b, seed, epoch = 250, 8, 5, 3
    order = np.random.default_rng([seed, epoch]).permutation(n)
    first = [sharding.train_batches(n, r, 3, b, seed, epoch) for r in range(3)]
    used = [i for step in range(6) for r in range(3) for i in first[r][step]]
    consumed = 6 * 3 * b
    second = [sharding.train_batches(n, r, 2, b, seed, epoch, start=consumed) for r in range(2)]
    assert len(second[0]) == len(second[1]) == (n - consumed) // (2 * b)
    used += [i for step in range(len(second[0])) for r in range(2) for i in second[r][step]]
    assert used == order[:len(used)].tolist() and len(set(used)) == len(used)
    assert n - len(used) < 2 * b  # only the final remainder is left out


def test_the_schedule_follows_the_current_rank_count():
    """lr*N and the AdaBound bounds with the ranks of the moment; the step within the epoch from the samples
    consumed. Hand-worked: 240 samples, b=8: 10 steps/epoch on 3 ranks, 15 on 2."""
    cfg = config_from_dict({"train": {"epochs": 4, "batch_size": 8},
                            "optim": {"name": "hybrid", "adabound_epochs": 2, "lr": 0.1, "kappa": 0.9}})
    assert step_in_epoch(144, 2, 8, 1) == 9  # 144 of 240 samples = 0.6 epoch = step 9 of 15
    assert step_in_epoch(144, 3, 8, 1) == 6 and step_in_epoch(144, 2, 8, 2) == 4
    three, two = create_schedule(cfg, 3, 10), create_schedule(cfg, 2, 15)
    assert three(25)["lr"] == pytest.approx(0.1 * 3) and two(37)["lr"] == pytest.approx(0.1 * 2)  # epoch 3: lr*N
    assert three(35)["lr"] == pytest.approx(0.3 * 0.9) and two(52)["lr"] == pytest.approx(0.2 * 0.9)  # kappa^1
    # AdaBound phase, 0.7 of epoch 1 on either rank count: the paper's bounds with the N of the moment
    for settings, ranks, steps in ((three(6), 3, 10), (two(10), 2, 15)):
        t = bound_progress(7 if ranks == 3 else 11, steps, cfg.optim.bound_granularity)
        assert (settings["lower_bound"], settings["upper_bound"]) == adabound_bounds(
            t, 2, 0.1, ranks, cfg.optim.betas[1])
    assert three(6)["upper_bound"] != two(10)["upper_bound"]


@pytest.mark.parametrize("launcher_env,override,needle", [
    ({}, [], "needs Horovod's elastic launcher"),
    ({"HOROVOD_ELASTIC": "1"}, ["--set", "data.backend=synthetic"], "data.backend=synthetic cannot do yet"),
    ({"HOROVOD_ELASTIC": "1"}, ["--set", "data.backend=dali_cpu"], "data.backend=dali_cpu cannot do yet"),
    ({"HOROVOD_ELASTIC": "1"}, ["--set", "bn.per_rank_batch=random"], "set bn.per_rank_batch=fixed"),
    ({"HOROVOD_ELASTIC": "1"}, ["--set", "horovod.fusion_threshold_mb=64", "--set", "horovod.cycle_time_ms=2"],
     "keep one of them at its default"),
    ({"HOROVOD_ELASTIC": "1"}, ["--set", "train.cuda_graphs=true"], "set train.cuda_graphs=false"),
    ({"HOROVOD_ELASTIC": "1"}, ["--profile"], "--profile (profile.enabled) profiles the static loop"),
])
def test_what_elastic_cannot_do_is_one_line(small_digits, tmp_path, write_config, launcher_env, override, needle):
    cfg = write_config(tiny_config(small_digits, str(tmp_path / "run"), data=WITH_WORKERS))  # other backends too
    proc = subprocess.run([HYBRIDTRAIN, "train", "--elastic", "--config", cfg, *override], capture_output=True,
                          text=True, timeout=300, env={**env_with_venv(), **launcher_env}, stdin=subprocess.DEVNULL)
    assert_one_error_line(proc, needle)


def discovery_script(tmp_path, slots: int) -> tuple[str, str]:
    hosts = tmp_path / "hosts"
    hosts.write_text(f"localhost:{slots}\n")
    script = tmp_path / "discover.sh"
    script.write_text(f"#!/bin/sh\ncat {hosts}\n")
    script.chmod(0o755)
    return str(script), str(hosts)



def test_a_fresh_elastic_run_into_another_runs_folder_is_one_line_and_touches_nothing(small_digits, tmp_path,
                                                                                    write_config):
    """Elastic runs did not claim their run_dir: a fresh one cut the earlier run's metrics.jsonl and pruned its
    checkpoints. Now it is refused as a static run is (rundir.claim, inside Horovod's elastic loop)."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    earlier = {"metrics.jsonl": '{"epoch": 1}\n', "checkpoint-epoch0001.pt": "weights"}
    for name, text in earlier.items():
        (run_dir / name).write_text(text)
    cfg = write_config(tiny_config(small_digits, str(run_dir)))
    script, _ = discovery_script(tmp_path, 2)
    train = [HOROVODRUN, "--network-interface", "lo", "-np", "2", "--min-np", "2", "--max-np", "2",
             "--host-discovery-script", script, HYBRIDTRAIN, "train", "--elastic", "--config", cfg]
    proc = subprocess.run(train, capture_output=True, text=True, timeout=300, env=env_with_venv(),
                          stdin=subprocess.DEVNULL)
    assert_one_error_line(proc, "holds another run's files", "--move-aside")
    assert {name: (run_dir / name).read_text() for name in earlier} == earlier
    proc = subprocess.run([*train, "--move-aside"], capture_output=True, text=True, timeout=300, env=env_with_venv(),
                          stdin=subprocess.DEVNULL)  # the fix the line names
    assert proc.returncode == 0, proc.stdout[-3000:]
    (previous,) = run_dir.glob("previous-*")
    assert {name: (previous / name).read_text() for name in earlier} == earlier
    assert [r["epoch"] for r in read_metrics(str(run_dir))] == [1, 2]

@pytest.mark.slow
def test_elastic_run_survives_3_to_2_to_3_ranks_and_covers_every_sample(small_digits, tmp_path, write_config):
    run_dir = str(tmp_path / "run")
    cfg = write_config(tiny_config(small_digits, run_dir, train={"epochs": 4, "batch_size": 8},
                                   optim={"name": "hybrid", "adabound_epochs": 2}, data=WITH_WORKERS,
                                   elastic={"commit_steps": 2, "audit_samples": True},
                                   sinks={"mlflow": "local", "project": "elastic"} if MLFLOW else {}))
    script, hosts = discovery_script(tmp_path, 3)
    # two names of this machine, so that the process that leaves is rank 0's (the first host's only slot): the
    # re-formed job's rank 0 is another process, which must take the run_dir over (its lock, run.json)
    open(hosts, "w").write("127.0.0.1:1\nlocalhost:2\n")
    cmd = [HOROVODRUN, "--network-interface", "lo", "-np", "3", "--min-np", "2", "--max-np", "3",
           "--host-discovery-script", script, HYBRIDTRAIN, "train", "--elastic", "--config", cfg]
    proc = subprocess.Popen(cmd, env=env_with_venv(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    lines = []
    try:
        shrunk = False
        for line in proc.stdout:
            lines.append(line)
            if "epoch   1/4" in line:
                open(hosts, "w").write("localhost:2\n")  # rank 0 leaves (mid-epoch 2, at a commit) ...
            shrunk = shrunk or "elastic: 3 -> 2 ranks" in line
            if shrunk and "epoch   2/4" in line:
                open(hosts, "w").write("localhost:3\n")  # ... and, once an epoch ended on 2, a rank comes back
        proc.wait(timeout=600)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    output = "".join(lines)
    assert proc.returncode == 0, output[-4000:]
    assert "elastic: 3 -> 2 ranks" in output and "elastic: 2 -> 3 ranks" in output, output[-4000:]
    records = read_metrics(run_dir)
    assert [r["epoch"] for r in records] == list(range(1, 5))
    assert records[1]["world_size"] == 2 and records[-1]["world_size"] == 3
    for record in records:  # a resized epoch's record covers its committed segments, each rank's parts add up
        assert_parts_add_up(record)
    startup = records[0]["startup_s"]  # the elastic start's own parts, as a static run's
    assert set(STARTUP_PARTS) <= set(startup) and all(startup[p] > 0 for p in ("imports", "model_build"))
    assert abs(sum(startup[p] for p in STARTUP_PARTS) - startup["total"]) < 1e-6
    assert records[-1]["val_top1"] > 0.5  # it went on learning
    samples = {}
    for path in glob.glob(os.path.join(run_dir, "samples", "*.jsonl")):
        for line in open(path):
            row = json.loads(line)
            samples.setdefault(row["epoch"], []).extend(row["samples"])
    assert sorted(samples) == list(range(1, 5))
    for epoch, seen in samples.items():
        assert len(seen) == len(set(seen)), f"epoch {epoch} repeated a sample"
        # 240 images fill 10 global batches of 24 and 15 of 16: only a resize mid-epoch leaves a final
        # remainder, fewer than one global batch, out
        assert set(seen) <= set(range(240)) and 240 - len(seen) < 24, f"epoch {epoch} skipped a sample"
    assert len(samples[1]) == 240 and len(samples[4]) == 240
    assert os.path.exists(os.path.join(run_dir, "final_model.pt"))
    # the later rank 0 held the folder: run.json lists its checkpoints, the older ones pruned by that list
    kept = [f"checkpoint-epoch000{epoch}.pt" for epoch in (2, 3, 4)]  # train.keep_checkpoints: 3
    assert json.load(open(os.path.join(run_dir, "run.json")))["checkpoints"] == kept
    assert sorted(os.path.basename(p) for p in glob.glob(os.path.join(run_dir, "checkpoint-epoch*.pt"))) == kept
    if MLFLOW:  # each reset ends the tracked run and the re-formed job continues it: one run, every epoch, FINISHED
        from mlflow.tracking import MlflowClient
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        client = MlflowClient("file:" + os.path.join(run_dir, "mlruns"))
        (experiment,) = [e for e in client.search_experiments() if e.name == "elastic"]
        (tracked,) = client.search_runs([experiment.experiment_id])
        assert tracked.info.status == "FINISHED"
        assert [m.step for m in client.get_metric_history(tracked.info.run_id, "top1/val")] == [1, 2, 3, 4]


@pytest.mark.slow
def test_a_preempted_static_run_resumes_elastically_on_more_ranks_where_it_stopped(small_digits, tmp_path,
                                                                                    write_config):
    """SIGTERM a 2-rank static run mid-epoch, then resume it with --elastic on 3 ranks: the first samples the
    elastic ranks train on are those that follow, in NumPy's permutation, the ones the 2 ranks consumed."""
    from test_preemption import train_until_sigterm
    run_dir = str(tmp_path / "run")
    cfg = write_config(tiny_config(small_digits, run_dir, train={"epochs": 2, "batch_size": 8}, data=WITH_WORKERS,
                                   elastic={"commit_steps": 1, "audit_samples": True}))
    stopped = train_until_sigterm(cfg, (0, 1), resume=False)
    assert stopped.returncode == 0 and "resumable" in stopped.stdout, stopped.stdout[-3000:]
    script, _ = discovery_script(tmp_path, 3)
    proc = subprocess.run([HOROVODRUN, "--network-interface", "lo", "-np", "3", "--min-np", "3", "--max-np", "3",
                           "--host-discovery-script", script, HYBRIDTRAIN, "train", "--elastic", "--config", cfg,
                           "--resume"], capture_output=True, text=True, timeout=600, env=env_with_venv(),
                          stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    consumed = int(proc.stdout.split("resumed from epoch 1, sample ", 1)[1].split()[0])
    assert consumed > 0 and consumed % 16 == 0  # whole 2-rank steps
    first_commit = {}
    for path in glob.glob(os.path.join(run_dir, "samples", "*.jsonl")):
        row = json.loads(open(path).readline())
        if row["ranks"] == 3:  # not the stopped static run's own files (elastic.audit_samples: every train run)
            first_commit[row["rank"]] = row["samples"]
    assert row["epoch"] == 1 and sorted(first_commit) == [0, 1, 2]
    order = np.random.default_rng([3, 0]).permutation(240)  # tiny_config's seed 3, epoch 0
    assert sum((first_commit[r] for r in range(3)), []) == order[consumed:consumed + 24].tolist()
    records = read_metrics(run_dir)
    assert [r["world_size"] for r in records] == [3, 3]
    for record in records:  # the continued epoch covers the static run's steps too
        assert_parts_add_up(record)

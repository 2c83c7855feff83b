"""The experiment trackers (engine/sinks.py), with the real packages and no network: a 1-rank run logging to MLflow
(its local file store) and Weights & Biases (offline) holds the numbers of metrics.jsonl, the resolved config and the
report's files; ``--resume`` continues the same tracked runs; without sinks neither package is imported."""
from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys

import pytest
from conftest import HYBRIDTRAIN, assert_one_error_line, env_with_venv, read_metrics, run, tiny_config
from PIL import Image


def test_a_run_logs_the_same_numbers_to_mlflow_and_wandb_and_resume_continues_them(small_digits, tmp_path,
                                                                                     write_config, monkeypatch):
    pytest.importorskip("mlflow", reason="the sinks extra (pip install 'hybridtrain[sinks]') is not installed")
    pytest.importorskip("wandb", reason="the sinks extra (pip install 'hybridtrain[sinks]') is not installed")
    from mlflow.tracking import MlflowClient
    run_dir = str(tmp_path / "run")
    config = write_config(tiny_config(small_digits, run_dir, report={"tensorboard": False},
                                      train={"ema_decay": 0.9},  # the EMA's figures reach the sinks too
                                      sinks={"mlflow": "local", "wandb": "offline", "project": "digits"}))
    proc = run([HYBRIDTRAIN, "train", "--config", config])
    assert proc.returncode == 0, proc.stderr[-3000:]
    ids = json.load(open(os.path.join(run_dir, "sinks.json")))
    records = read_metrics(run_dir)
    proc = run([HYBRIDTRAIN, "train", "--config", config, "--resume"])  # the finished run: report and artifacts again
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.load(open(os.path.join(run_dir, "sinks.json"))) == ids  # the same tracked runs

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient("file:" + os.path.join(run_dir, "mlruns"))
    (experiment,) = [e for e in client.search_experiments() if e.name == "digits"]
    assert [r.info.run_id for r in client.search_runs([experiment.experiment_id])] == [ids["mlflow"]]
    mlflow_run = client.get_run(ids["mlflow"])
    assert mlflow_run.info.status == "FINISHED" and mlflow_run.data.params["train.batch_size"] == "16"
    for tag, values in (("top1/val", [r["val_top1"] for r in records]),
                        ("top1/val_ema", [r["val_top1_ema"] for r in records]),
                        ("time/compute_s", [r["breakdown_s"]["compute"] for r in records])):
        assert [(m.step, m.value) for m in client.get_metric_history(ids["mlflow"], tag)] == \
            list(enumerate(values, start=1))
    assert {"report.md", "report.json", "breakdown.png"} <= {a.path for a in client.list_artifacts(ids["mlflow"])}

    files = sorted(glob.glob(os.path.join(run_dir, "wandb", "offline-run-*", f"run-{ids['wandb']}.wandb")))
    assert len(files) == 4  # the training and the report's artifacts, of each of the two processes
    logged = b"".join(open(path, "rb").read() for path in files)
    assert all(json.dumps(r["val_top1"]).encode() in logged for r in records)
    assert all(json.dumps(r["breakdown_s"]["compute"]).encode() in logged for r in records)
    assert b"top1/val_ema" in logged
    assert b"train.batch_size" in logged and b"breakdown.png" in logged



def mlflow_status(run_dir: str, monkeypatch, store: str = "") -> str:
    from mlflow.tracking import MlflowClient
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient("file:" + (store or os.path.join(run_dir, "mlruns")))
    return client.get_run(json.load(open(os.path.join(run_dir, "sinks.json")))["mlflow"]).info.status


def test_a_stopped_run_ends_its_tracked_runs_as_killed_and_a_failed_one_as_failed(small_digits, tmp_path,
                                                                                  write_config, monkeypatch):
    """A SIGTERM'd run (resumable) used to leave its tracked runs open, and MLflow's exit hook then called them
    FINISHED, as it did a run that failed: now KILLED (W&B: marked preempting, exit code 143) and FAILED."""
    pytest.importorskip("mlflow", reason="the sinks extra (pip install 'hybridtrain[sinks]') is not installed")
    pytest.importorskip("wandb", reason="the sinks extra (pip install 'hybridtrain[sinks]') is not installed")
    sinks = {"mlflow": "local", "wandb": "offline", "project": "digits"}
    stopped = str(tmp_path / "stopped")
    config = write_config(tiny_config(small_digits, stopped, report={"tensorboard": False}, sinks=sinks,
                                      train={"epochs": 30}))
    proc = subprocess.Popen([HYBRIDTRAIN, "train", "--config", config], env=env_with_venv(1), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if "steps/epoch" in line:  # the setup line: the tracked runs are open
            proc.send_signal(signal.SIGTERM)
            break
    lines += proc.stdout.readlines()
    assert proc.wait(timeout=300) == 0 and "stopped on SIGTERM" in "".join(lines), "".join(lines)[-3000:]
    assert mlflow_status(stopped, monkeypatch) == "KILLED"
    assert "got exitcode: 143" in open(os.path.join(stopped, "wandb", "debug.log")).read()  # W&B's own log
    ids = os.path.join(stopped, "sinks.json")  # a crafted id: one line, not MLflow's error as "a bug"
    for text in ('{"mlflow": "../../../x"}', '{"mlflow": "'):
        with open(ids, "w") as fh:
            fh.write(text)
        assert_one_error_line(run([HYBRIDTRAIN, "train", "--config", config, "--resume"]), "sinks.json is damaged",
                              "remove it")

    data = tmp_path / "data"  # an image that does not decode stops the run in its first epoch
    for split in ("train", "val"):
        for cls in ("a", "b"):
            os.makedirs(data / split / cls)
            for i in range(4):
                Image.new("RGB", (16, 16), (40 * i, 0, 0)).save(data / split / cls / f"{i}.jpg")
    (data / "train" / "a" / "9.jpg").write_bytes(b"not a jpeg")
    failed, store = str(tmp_path / "failed"), str(tmp_path / "store")  # the documented file:/absolute/path form
    config = write_config(tiny_config(str(data), failed, data={"crop_size": 16, "val_resize": 16},
                                      train={"batch_size": 4}, report={"tensorboard": False},
                                      sinks={"mlflow": "file:" + store, "project": "digits"}))
    proc = run([HYBRIDTRAIN, "train", "--config", config])
    assert proc.returncode == 2 and "9.jpg" in proc.stderr, proc.stderr[-3000:]
    assert mlflow_status(failed, monkeypatch, store) == "FAILED"

def test_without_sinks_neither_tracker_is_imported():
    code = ("import sys, hybridtrain.engine.loop, hybridtrain.engine.sinks, hybridtrain.cli.train; "
            "print(sorted(m for m in ('mlflow', 'wandb') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr


def test_a_sink_that_cannot_work_is_one_line_before_the_model_is_built(small_digits, tmp_path, write_config):
    """A bogus sinks value is refused with the config; a database store without the full mlflow package, a tracking
    server that refuses connections (on 2 ranks under horovodrun) and one that accepts but never answers are each one
    line naming the URI within seconds, before any rank builds a model or makes the run folder."""
    import socket
    import time

    from conftest import horovodrun
    pytest.importorskip("mlflow", reason="the sinks extra (pip install 'hybridtrain[sinks]') is not installed")
    run_dir = tmp_path / "run"
    config = write_config(tiny_config(small_digits, str(run_dir)))
    for key, value, needle in (("mlflow", "true", "sinks.mlflow='true' is not a form it takes"),
                               ("mlflow", "file:relative/mlruns", "file:/absolute/path"),
                               ("project", "a/b", "sinks.project='a/b' must be a name")):
        assert_one_error_line(run([HYBRIDTRAIN, "train", "--config", config, "--set", f"sinks.{key}={value}"]),
                              "config error", needle)
    import importlib.util
    if not importlib.util.find_spec("sqlalchemy"):  # mlflow-skinny: no database store
        assert_one_error_line(run([HYBRIDTRAIN, "train", "--config", config, "--set",
                                   f"sinks.mlflow=sqlite:///{tmp_path}/mlflow.db"]),
                              "needs the full mlflow package", "pip install mlflow, or use local")
    with socket.socket() as closed:  # a port nobody listens on
        closed.bind(("127.0.0.1", 0))
        refused = f"http://127.0.0.1:{closed.getsockname()[1]}"
    began = time.monotonic()
    proc = horovodrun(2, ["train", "--config", config, "--set", f"sinks.mlflow={refused}"], timeout=120)
    assert_one_error_line(proc, f"sinks.mlflow={refused}: the tracking server does not answer", "start it")
    assert time.monotonic() - began < 60 and "rank(s) of the" not in proc.stdout
    with socket.socket() as silent:  # accepts connections (the kernel's backlog) and never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        uri = f"http://127.0.0.1:{silent.getsockname()[1]}"
        began = time.monotonic()
        proc = run([HYBRIDTRAIN, "train", "--config", config, "--set", f"sinks.mlflow={uri}"], timeout=120)
        assert_one_error_line(proc, f"sinks.mlflow={uri}: the tracking server does not answer", "5 s allowed")
        assert time.monotonic() - began < 30
    assert not run_dir.exists()

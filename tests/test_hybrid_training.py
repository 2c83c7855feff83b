"""The hybrid optimizer inside the trainer: exact phase switch, resume at three points, 2-rank agreement."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
import yaml
from conftest import HYBRIDTRAIN, assert_one_error_line, horovodrun, read_metrics, run, tiny_config

from hybridtrain.config import load_config
from hybridtrain.errors import UserError
from hybridtrain.models import create_model
from hybridtrain.optim import apply_schedule, create_optimizer
from hybridtrain.optim.schedules import hybrid_schedule

HYBRID = {"name": "hybrid", "lr": 0.05, "adabound_epochs": 2, "kappa": 0.9}


def test_phase_switches_exactly_at_T_times_iterations():
    cfg = load_config(None, ["optim.name=hybrid", "optim.adabound_epochs=3", "train.epochs=6"])
    ipe, T = 7, 3
    phases = [hybrid_schedule(step, cfg.optim, 4, ipe)["phase"] for step in range(6 * ipe)]
    assert phases.index("sgd") == T * ipe  # 0-based step T*ipe is global step k = T*ipe + 1
    assert set(phases[:T * ipe]) == {"adabound"} and set(phases[T * ipe:]) == {"sgd"}
    first_sgd = hybrid_schedule(T * ipe, cfg.optim, 4, ipe)
    assert first_sgd["lr"] == pytest.approx(0.1 * 4)  # lr*N at the switch (kappa_origin switch)
    assert hybrid_schedule(4 * ipe, cfg.optim, 4, ipe)["lr"] == pytest.approx(0.4 * 0.9)
    last_warm = hybrid_schedule(T * ipe - 1, cfg.optim, 4, ipe)
    assert last_warm["lower_bound"] == pytest.approx(0.4) and last_warm["upper_bound"] == pytest.approx(0.4)


def test_the_schedule_returns_the_switch_for_the_loop_to_log():
    # 2 AdaBound epochs of 5 steps: 0-based step 10 is the first SGD step, the one step whose settings come back
    cfg = load_config(None, ["optim.name=hybrid", "optim.adabound_epochs=2", "train.epochs=3"])
    bundle = create_optimizer(torch.nn.Linear(2, 2), cfg, 1, 5)
    changes = {step: apply_schedule(bundle.optimizer, bundle.schedule, step) for step in range(15)}
    assert [step for step, change in changes.items() if change] == [10]
    assert changes[10]["phase"] == "sgd" and bundle.optimizer.param_groups[0]["phase"] == "sgd"


def test_bn_and_bias_excluded_from_lars_and_decay():
    cfg = load_config(None, ["optim.name=hybrid"])
    model = create_model("resnet18", 10)
    bundle = create_optimizer(model, cfg, 2, 10)
    decayed, excluded = bundle.optimizer.param_groups
    assert decayed["lars"] and decayed["weight_decay"] == 1e-4
    assert not excluded["lars"] and excluded["weight_decay"] == 0.0
    assert all(p.ndim <= 1 for p in excluded["params"]) and all(p.ndim == 4 or p.ndim == 2 for p in decayed["params"])
    off = create_optimizer(model, load_config(None, ["optim.name=hybrid", "optim.lars=none"]), 2, 10)
    assert not any(g["lars"] for g in off.optimizer.param_groups)


@pytest.mark.parametrize("override, needle", [
    ("optim.adabound_epochs=0", "optim.adabound_epochs"),
    ("optim.adabound_epochs=90", "must be in [1, train.epochs=90)"),
    ("optim.kappa=1.5", "optim.kappa must be in (0.0, 1.0]"),
    ("optim.kappa=0", "optim.kappa"),
    ("optim.trust_coefficient=-0.1", "optim.trust_coefficient"),
    ("optim.name=lamb", "optim.name must be one of"),
])
def test_bad_hybrid_settings(override, needle):
    with pytest.raises(UserError) as err:
        load_config(None, ["optim.name=hybrid", override])
    assert needle in str(err.value)


def test_bad_optimizer_name_is_one_line_from_the_cli(small_digits, tmp_path, write_config):
    cfg = write_config(tiny_config(small_digits, str(tmp_path / "run")))
    assert_one_error_line(run([HYBRIDTRAIN, "train", "--config", cfg, "--set", "optim.name=adam"]), "optim.name")


@pytest.fixture(scope="module")
def hybrid_run(small_digits, tmp_path_factory):
    """4 epochs with T=2 on 2 ranks, every checkpoint kept: resume points inside, at and after the switch."""
    run_dir = str(tmp_path_factory.mktemp("hybrid") / "straight")
    cfg = tiny_config(small_digits, run_dir, train={"epochs": 4, "keep_checkpoints": 4}, optim=HYBRID)
    path = tmp_path_factory.mktemp("cfg") / "hybrid.yaml"
    path.write_text(yaml.safe_dump(cfg))
    proc = horovodrun(2, ["train", "--config", str(path)])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return cfg, run_dir, proc


def test_two_ranks_share_optimizer_state_after_the_switch(hybrid_run):
    cfg, run_dir, proc = hybrid_run
    with open(os.path.join(run_dir, "report.json")) as fh:
        digests = json.load(fh)["rank_digests"]
    assert len(digests) == 2 and digests[0] == digests[1]
    state = torch.load(os.path.join(run_dir, "checkpoint-epoch0004.pt"), weights_only=True)["optimizer"]
    assert {g["phase"] for g in state["param_groups"]} == {"sgd"}
    assert all("momentum_buffer" in s and "exp_avg" not in s for s in state["state"].values())
    switch_lines = [line for line in proc.stdout.splitlines() if "switching to sgd" in line]
    assert len(switch_lines) == 1 and "epoch 3" in switch_lines[0]
    lrs = [r["lr"] for r in read_metrics(run_dir)]
    assert lrs[2] == pytest.approx(0.05 * 2) and lrs[3] == pytest.approx(0.05 * 2 * 0.9)


# Resuming inside the AdaBound warmup is covered by test_preemption (SIGTERM in epoch 1, bitwise, 2 ranks) and the
# optimizer's state round trip in test_optim_math; these two resume across and after the switch.
@pytest.mark.parametrize("resume_after_epoch", [2, 3], ids=["at-switch", "after-switch"])
def test_resume_continues_exactly(hybrid_run, resume_after_epoch, tmp_path, write_config):
    cfg, straight_dir, _ = hybrid_run
    resumed_dir = tmp_path / "resumed"
    resumed_dir.mkdir()
    name = f"checkpoint-epoch{resume_after_epoch:04d}.pt"
    shutil.copy(os.path.join(straight_dir, name), resumed_dir / name)
    path = write_config(dict(cfg, run_dir=str(resumed_dir)))
    proc = horovodrun(2, ["train", "--config", path, "--resume"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    ours = torch.load(resumed_dir / "checkpoint-epoch0004.pt", weights_only=True)
    theirs = torch.load(os.path.join(straight_dir, "checkpoint-epoch0004.pt"), weights_only=True)
    for key in ("model",):
        for name_, tensor in theirs[key].items():
            assert torch.equal(tensor, ours[key][name_]), name_
    for pid, st in theirs["optimizer"]["state"].items():
        for k, v in st.items():
            assert (torch.equal(v, ours["optimizer"]["state"][pid][k]) if torch.is_tensor(v)
                    else v == ours["optimizer"]["state"][pid][k]), (pid, k)

"""The recipe options, each against an independent computation: label smoothing against NumPy, the weights' EMA
against a hand-worked sequence, the mlperf schedule against numbers worked from MLPerf's reference code, the
budgeted linear and the cosine schedules against hand-worked numbers; and on 2 ranks of each engine, every option
at once, stopped mid-epoch and resumed bit-exactly, with the flip-averaged validation counted exactly."""
from __future__ import annotations

import math
import os
import re
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import yaml
from conftest import WITH_WORKERS, digits_subset, horovodrun, read_metrics, tiny_config, torchrun
from test_preemption import file_digest, straight_then_stopped_and_resumed

from benchmarks.host_syncs import count_host_syncs
from hybridtrain.config import load_config
from hybridtrain.distributed.engines import with_step_contract
from hybridtrain.engine.ema import WeightEMA, ema_decay_at
from hybridtrain.engine.step import EagerStep, classification_loss, train_step
from hybridtrain.errors import UserError
from hybridtrain.optim import create_optimizer
from hybridtrain.optim.optimizers import LARS
from hybridtrain.optim.schedules import goyal_schedule, mlperf_schedule, sgd_schedule
from hybridtrain.precision.policy import resolve_policy
from hybridtrain.precision.scaler import LossScaler, Precision

# ----------------------------------------------------------------------------- label smoothing


def test_the_smoothed_loss_is_numpys_in_fp32_from_fp16_logits():
    generator = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(6, 5, generator=generator)).half()
    labels = torch.tensor([0, 4, 2, 2, 1, 3])
    e = 0.1
    z = logits.double().numpy()
    log_p = z - z.max(1, keepdims=True) - np.log(np.exp(z - z.max(1, keepdims=True)).sum(1, keepdims=True))
    # target (1 - e) one-hot + e / C: loss = (1 - e) (-log p_label) + e mean_c (-log p_c)
    expected = np.mean((1 - e) * -log_p[np.arange(6), labels.numpy()] + e * -log_p.mean(1))
    loss = classification_loss(logits, labels, label_smoothing=e)
    assert loss.dtype == torch.float32
    assert float(loss) == pytest.approx(expected, rel=1e-6)
    assert float(classification_loss(logits, labels)) == pytest.approx(np.mean(-log_p[np.arange(6), labels.numpy()]),
                                                                       rel=1e-6)


def test_label_smoothing_defaults_to_mlperfs_and_bad_values_are_one_line():
    assert load_config(None, ["optim.name=mlperf", "train.epochs=10"]).train.label_smoothing == 0.1
    assert load_config(None, ["optim.name=mlperf", "train.epochs=10", "train.label_smoothing=0"]).train.label_smoothing \
        == 0.0
    assert load_config(None, []).train.label_smoothing == 0.0
    assert load_config(None, ["optim.name=mlperf", "train.epochs=10", "train.label_smoothing=null"]).train \
        .label_smoothing == 0.1  # unset, as in a recipe that writes the key without a value
    for bad, needle in (("train.label_smoothing=-0.5", "[0.0, 1.0)"), ("train.label_smoothing=1", "[0.0, 1.0)"),
                        ("train.label_smoothing=-1", "[0.0, 1.0)"),
                        ("train.final_weights=ema", "train.ema_decay"), ("train.ema_decay=1", "[0.0, 1.0)"),
                        ("optim.schedule=cosine", "goyal or sgd")):
        with pytest.raises(UserError, match=re.escape(needle)) as caught:
            load_config(None, [bad])
        assert "\n" not in str(caught.value)


# ----------------------------------------------------------------------------- the weights' EMA

def tiny_model() -> torch.nn.Module:
    model = torch.nn.Sequential(torch.nn.Linear(1, 1, bias=False), torch.nn.BatchNorm1d(1))
    with torch.no_grad():
        model[0].weight.fill_(1.0)
        model[1].running_mean.fill_(1.0)
    return model


def test_another_optimizers_keys_are_named_in_one_warning_line(tmp_path):
    """optim keys set for another optimizer than optim.name are said in one line (rank 0's) as train reads the
    config, each named once; the keys optim.name reads, and defaults, are not. The run then stops on its missing
    data folder, before torch, so that the test costs a config load."""
    import subprocess

    from conftest import HYBRIDTRAIN, env_with_venv
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({"run_dir": str(tmp_path / "run"), "optim": {
        "name": "goyal", "kappa": 0.5, "adabound_epochs": 3, "end_lr": 0.01, "warmup_epochs": 1.0,
        "alpha": 1e-3}, "data": {"path": str(tmp_path / "nodata")}}))
    proc = subprocess.run([HYBRIDTRAIN, "train", "--config", str(config)], capture_output=True, text=True,
                          timeout=120, env=env_with_venv(1), stdin=subprocess.DEVNULL)
    warnings = [line for line in proc.stderr.splitlines() if "warning: config:" in line]
    assert warnings == ["hybridtrain: warning: config: optim.adabound_epochs, optim.kappa, optim.end_lr are set but "
                        "optim.name=goyal does not read them (ignored): drop them, or choose the optimizer that "
                        "does"], proc.stderr
    assert proc.returncode == 2 and "nodata" in proc.stderr


def test_the_ema_follows_a_hand_worked_sequence_with_its_warmup_and_restores_exactly():
    model = tiny_model()
    ema = WeightEMA(model, decay=0.25)
    assert ema.bn_names == ["1.running_mean", "1.running_var"]  # averaged over ranks, kept per rank when stopped
    # d_n = min(0.25, (1+n)/(10+n)): 1/10, 2/11, then 0.25 (3/12 = 0.25, 4/13 > 0.25)
    assert [ema_decay_at(0.25, n) for n in range(4)] == [0.1, 2 / 11, 0.25, 0.25]
    # w: 1 -> 2, 4, 8, 16; e1 = 0.1*1 + 0.9*2 = 1.9; e2 = (2/11)*1.9 + (9/11)*4 = 39.8/11;
    # e3 = 0.25*39.8/11 + 0.75*8 = 75.95/11; e4 = 0.25*75.95/11 + 0.75*16 = 150.9875/11
    hand = [1.9, 39.8 / 11, 75.95 / 11, 150.9875 / 11]
    for value, expected in zip((2.0, 4.0, 8.0, 16.0), hand):
        with torch.no_grad():
            model[0].weight.fill_(value)
            model[1].running_mean.fill_(value)  # the BN buffers are averaged as the parameters are
            model[1].num_batches_tracked.fill_(int(value))  # integers are copied
        ema.update()
        assert float(ema.shadow["0.weight"]) == pytest.approx(expected, rel=1e-6)
        assert float(ema.shadow["1.running_mean"]) == pytest.approx(expected, rel=1e-6)
        assert int(ema.shadow["1.num_batches_tracked"]) == int(value)
    assert count_host_syncs(ema.update, torch.device("cpu")) == 0  # foreach ops, the decay from the host's count
    twin = tiny_model()
    twin.load_state_dict(model.state_dict())  # a resumed run's model
    restored = WeightEMA(twin, decay=0.25)
    restored.load_state_dict(ema.state_dict())
    ema.update(), restored.update()  # the same next decay (0.25) from the restored count
    assert restored.updates == ema.updates == 6
    assert all(torch.equal(restored.shadow[k], ema.shadow[k]) for k in ema.shadow)
    with ema.swapped_in():  # validation sees the average, training its own weights again after
        assert torch.equal(model[0].weight.detach(), ema.shadow["0.weight"])
    assert float(model[0].weight.detach()) == 16.0


def test_a_skipped_step_leaves_the_ema_alone(job_of_one):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.Flatten(),
                                torch.nn.LazyLinear(3))
    images, labels = torch.randn(4, 3, 6, 6), torch.tensor([0, 1, 2, 0])
    model(images)
    optimizer = with_step_contract(torch.optim.SGD(model.parameters(), lr=0.1))
    precision = Precision(resolve_policy(load_config(None, []).precision), LossScaler("none", 1.0, 100, 5))
    ema = WeightEMA(model, decay=0.5)
    poisoned = images.clone()
    poisoned[0, 0, 0, 0] = float("nan")
    assert not train_step(EagerStep(model), optimizer, precision, [(poisoned, labels, 1.0)], ema=ema).stepped
    assert ema.updates == 0
    assert train_step(EagerStep(model), optimizer, precision, [(images, labels, 1.0)], ema=ema).stepped
    assert ema.updates == 1


# ----------------------------------------------------------------------------- schedules

def test_the_mlperf_schedule_gives_the_numbers_worked_from_mlperfs_reference():
    """mlcommons/training image_classification/tensorflow2/lars_util.py, PolynomialDecayWithWarmup with its defaults
    for a batch < 16384 (initial_learning_rate 10.0, warmup_epochs 5, end_learning_rate 0.0001, power 2.0), here
    with steps_per_epoch 10 and train_steps 350: warmup_steps W = 50, decay_steps D = 350 - 50 + 1 = 301;
    lr(s) = 10 s / 50 for s <= W, else Keras' PolynomialDecay (10 - 1e-4) (1 - min(s - W, D) / D)^2 + 1e-4:
      s = 0: 0; s = 25: 5; s = 50: 10; s = 51: 9.9999 (300/301)^2 + 1e-4 = 9.933665854681514;
      s = 200: 9.9999 (151/301)^2 + 1e-4 = 2.5167137228065917; s = 349: 9.9999 (2/301)^2 + 1e-4 = 0.000541491815763623.
    Our peak is lr x N: 2.5 x 4 ranks = 10."""
    o = SimpleNamespace(lr=2.5, warmup_epochs=5, end_lr=1e-4, poly_power=2.0)
    reference = {0: 0.0, 25: 5.0, 50: 10.0, 51: 9.933665854681514, 200: 2.5167137228065917,
                 349: 0.000541491815763623}
    for step, lr in reference.items():
        assert mlperf_schedule(step, o, world_size=4, iters_per_epoch=10, total_epochs=35)["lr"] == \
            pytest.approx(lr, rel=1e-12, abs=1e-15), step


def test_the_mlperf_optimizer_is_lars_with_no_decay_or_lars_on_bn_and_biases():
    cfg = load_config(None, ["optim.name=mlperf", "train.epochs=10"])
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4))
    optimizer = create_optimizer(model, cfg, 2, 5).optimizer
    assert isinstance(optimizer, LARS)
    decayed, plain = optimizer.param_groups
    assert (decayed["lars"], decayed["weight_decay"], decayed["trust_coefficient"], decayed["eps"]) == \
        (True, 1e-4, 0.001, 1e-7)  # the reference's weight_decay, eeta, and Keras' epsilon for its 0
    assert (plain["lars"], plain["weight_decay"], len(plain["params"])) == (False, 0.0, 3)  # conv bias, BN's two


def test_the_budgeted_linear_and_the_cosine_schedules_give_hand_worked_numbers():
    """goyal: lr 0.1 x N = 4 -> peak 0.4, warmup W = 2 of E = 10 epochs, 10 steps per epoch (t = step / 10).
    linear: 0.4 (E - t) / (E - W); cosine: 0.4 (1 + cos(pi (t - W) / (E - W))) / 2."""
    def lr(fn, step, schedule, warmup=2.0):
        o = SimpleNamespace(lr=0.1, warmup_epochs=warmup, milestones=[0.5], decay_factor=0.1, schedule=schedule)
        return fn(step, o, world_size=4, iters_per_epoch=10, total_epochs=10)["lr"]
    assert lr(goyal_schedule, 10, "linear") == pytest.approx(0.25)  # warmup: 0.1 + 0.3 * 1/2
    assert lr(goyal_schedule, 20, "linear") == pytest.approx(0.4)  # t = W
    assert lr(goyal_schedule, 60, "linear") == pytest.approx(0.2)  # 0.4 * 4/8
    assert lr(goyal_schedule, 99, "linear") == pytest.approx(0.005)  # 0.4 * 0.1/8: to 0 at the end of epoch 10
    assert lr(goyal_schedule, 40, "cosine") == pytest.approx(0.3414213562373095)  # 0.2 (1 + cos(pi/4))
    assert lr(goyal_schedule, 60, "cosine") == pytest.approx(0.2)  # 0.2 (1 + cos(pi/2))
    assert lr(goyal_schedule, 99, "cosine") == pytest.approx(0.00015419275185541982)  # 0.2 (1 + cos(7.9 pi/8))
    assert lr(sgd_schedule, 0, "linear") == pytest.approx(0.4)  # sgd: no warmup, from lr x N
    assert lr(sgd_schedule, 50, "linear") == pytest.approx(0.2)  # 0.4 * 5/10
    assert lr(sgd_schedule, 25, "cosine") == pytest.approx(0.2 * (1 + math.cos(math.pi / 4)))
    assert lr(goyal_schedule, 60, "step") == pytest.approx(0.04)  # step decay unchanged: past the 0.5 milestone


# ----------------------------------------------------------------------------- 2 ranks of each engine

@pytest.fixture(scope="module")
def few_digits(small_digits, tmp_path_factory) -> str:
    """8 train and 3 val images per class: 5 steps of 2 x 8 per epoch, 30 validation images."""
    return digits_subset(small_digits, str(tmp_path_factory.mktemp("data") / "few"), 8, 3)


def recipe(data: str, run_dir: str, optim: dict, train: dict, **data_keys) -> dict:
    return tiny_config(data, run_dir, train={"epochs": 1, "batch_size": 8, "deterministic": True, "ema_decay": 0.9,
                                             "final_weights": "ema", "val_flip": True, **train},
                       optim=optim, data=data_keys)


def stop_and_resume_matches_straight(tmp_path, few, optim: dict, train: dict, engine: str, launch) -> dict:
    """A straight run, and one SIGTERM'd mid-epoch then resumed: bitwise the same model, EMA and final weights."""
    def write(name, cfg):
        (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump(cfg))
        return str(tmp_path / f"{name}.yaml")
    straight_then_stopped_and_resumed(write("straight", recipe(few, str(tmp_path / "straight"), optim, train)),
                                      write("broken", recipe(few, str(tmp_path / "broken"), optim, train,
                                                             **WITH_WORKERS)), engine, launch)
    a, b = (torch.load(tmp_path / run / "checkpoint-epoch0001.pt", weights_only=True) for run in ("straight", "broken"))
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    assert a["ema"]["updates"] == b["ema"]["updates"] == 5
    assert all(torch.equal(a["ema"]["shadow"][k], b["ema"]["shadow"][k]) for k in a["ema"]["shadow"])
    assert file_digest(tmp_path / "straight" / "final_model.pt") == file_digest(tmp_path / "broken" / "final_model.pt")
    (record,) = read_metrics(str(tmp_path / "straight"))
    assert record["val_count"] == 30 and "val_top1_ema" in record
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(tmp_path / "straight" / "tensorboard"))
    events.Reload()  # the EMA's figures beside the raw ones
    for tag, key in (("top1/val_ema", "val_top1_ema"), ("loss/val_ema", "val_loss_ema"), ("top1/val", "val_top1")):
        assert [(e.step, round(e.value, 5)) for e in events.Scalars(tag)] == [(1, round(record[key], 5))], tag
    assert read_metrics(str(tmp_path / "broken"))[0]["val_top1_ema"] == record["val_top1_ema"]
    return record


def flip_averaged_correct(run_dir: str) -> int:
    """By hand: final_model.pt (the EMA) on every validation image, logits (z(x) + z(mirror x)) / 2, argmax."""
    from hybridtrain.data.folder import scan_dataset
    from hybridtrain.data.loaders import to_device
    from hybridtrain.data.torchvision_loader import create_val_loader
    from hybridtrain.models import model_from_config
    cfg = load_config(os.path.join(run_dir, "config.yaml"))
    model = model_from_config(cfg.model, 10, seed=cfg.seed)
    model.load_state_dict(torch.load(os.path.join(run_dir, "final_model.pt"), weights_only=True))
    model.eval()
    correct = 0
    loader = create_val_loader(scan_dataset(cfg.data.path)[1], cfg, 0, 1, 0)
    loader.batch_sampler.set_epoch(0, 0)
    with torch.no_grad():
        for batch in loader:
            images, labels = to_device(batch, torch.device("cpu"), torch.float32)
            for image, label in zip(images, labels):
                z = (model(image[None]).numpy()[0] + model(image[None].flip(-1)).numpy()[0]) / 2
                correct += int(np.argmax(z) == int(label))
    return correct


@pytest.mark.slow
def test_every_option_on_torchrun_resumes_bitwise_and_flip_validation_counts_exactly(few_digits, tmp_path):
    """mlperf (LARS, poly decay, its label smoothing 0.1), EMA, final EMA weights, flip-averaged validation."""
    record = stop_and_resume_matches_straight(tmp_path, few_digits, {"name": "mlperf", "lr": 0.2, "warmup_epochs": 0.4},
                                              {}, "torch", torchrun)
    assert yaml.safe_load(open(tmp_path / "straight" / "config.yaml"))["train"]["label_smoothing"] == 0.1
    assert round(record["val_top1_ema"] * 30) == flip_averaged_correct(str(tmp_path / "straight"))


@pytest.mark.slow
def test_every_option_on_horovodrun_resumes_bitwise(few_digits, tmp_path):
    """goyal with the cosine schedule, label smoothing, EMA, final EMA weights, flip-averaged validation."""
    stop_and_resume_matches_straight(tmp_path, few_digits, {"name": "goyal", "lr": 0.05, "warmup_epochs": 0.2,
                                                            "schedule": "cosine"}, {"label_smoothing": 0.1},
                                     "horovod", horovodrun)

"""The paper's training strategies (Lu et al. 2020, §2.2.3): BN across ranks, the init ablations, gradient accumulation.

Every figure is checked against an independent computation: NumPy on the gathered BN inputs, a one-process
global-batch step, or the closed-form init standard deviations.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import HOROVODRUN, HYBRIDTRAIN, REPO, assert_one_error_line, horovodrun, run, tiny_config

from hybridtrain.config import load_config
from hybridtrain.data.sharding import MIN_RANDOM_SHARE, random_split_sizes, train_batches
from hybridtrain.engine.epoch import micro_batch_weight
from hybridtrain.engine.step import RunningStatsGuard
from hybridtrain.models import create_model
from hybridtrain.models.batchnorm import CrossRankBatchNorm, batch_norms, configure_batch_norm


def run_script(name: str, *args: str, ranks: int = 2) -> subprocess.CompletedProcess:
    script = os.path.join(REPO, "tests", "scripts", name)
    return run([HOROVODRUN, "--gloo", "-np", str(ranks), "-H", f"localhost:{ranks}", sys.executable, script, *args])


def script_result(tmp_path, name: str, *args: str) -> dict:
    out = tmp_path / "result.json"
    proc = run_script(name, *args, str(out))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


# ----------------------------------------------------------------------------- averaging over ranks

@pytest.mark.parametrize("combine", ["mean", "pooled"])
def test_averaged_statistics_equal_numpy_on_the_gathered_last_batches(tmp_path, combine):
    result = script_result(tmp_path, "bn_average.py", combine)
    assert result["layers"] == 20  # resnet18: stem + 8 blocks x 2 + 3 shortcut BNs
    assert result["max_rel_error"] < 1e-5, result
    assert len(set(result["digests"])) == 1, "ranks hold different BN buffers after the averaging step"


def test_averaging_runs_in_fp32_for_an_fp16_model(tmp_path):
    result = script_result(tmp_path, "bn_average.py", "fp16")
    assert result["dtypes"] == ["torch.float16"]
    as_fp16 = [np.float32(np.float16(v)) for v in (60000.0, 50000.0)]
    assert result["vars"] == [float(np.float16((as_fp16[0] + as_fp16[1]) / 2))]  # an FP16 sum would be inf
    assert np.isinf(np.float16(60000.0) + np.float16(50000.0))
    assert result["means"] == [-60000.0]


# ----------------------------------------------------------------------------- running statistics

def test_moving_average_uses_the_configured_momentum():
    bn_cfg = load_config(None, ["bn.stats=moving_average", "bn.momentum=0.3"]).bn
    model = configure_batch_norm(torch.nn.Sequential(torch.nn.BatchNorm2d(3)), bn_cfg, torch.device("cpu")).train()
    x1, x2 = torch.randn(4, 3, 5, 5) + 2.0, torch.randn(6, 3, 5, 5) - 1.0
    model(x1)
    model(x2)
    mean, var = np.zeros(3), np.ones(3)
    for x in (x1, x2):
        values = x.double().numpy().transpose(1, 0, 2, 3).reshape(3, -1)
        mean = 0.7 * mean + 0.3 * values.mean(axis=1)
        var = 0.7 * var + 0.3 * values.var(axis=1, ddof=1)
    np.testing.assert_allclose(model[0].running_mean.numpy(), mean, rtol=1e-5)
    np.testing.assert_allclose(model[0].running_var.numpy(), var, rtol=1e-5)


def test_last_iteration_keeps_only_the_last_batch_statistics():
    bn_cfg = load_config(None, []).bn
    model = configure_batch_norm(create_model("resnet18", 10, small_input_stem=True), bn_cfg, torch.device("cpu"))
    model.train()
    model(torch.randn(4, 3, 8, 8) * 5 + 3)
    last = torch.randn(4, 3, 8, 8)
    model(last)
    stem_input = model.conv1(last).detach().double().numpy().transpose(1, 0, 2, 3).reshape(64, -1)
    np.testing.assert_allclose(model.bn1.running_mean.numpy(), stem_input.mean(axis=1), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(model.bn1.running_var.numpy(), stem_input.var(axis=1, ddof=1), rtol=1e-4)
    assert all(bn.momentum == 1.0 for bn in batch_norms(model))


# ----------------------------------------------------------------------------- cross-rank BN (bn.sync)

def test_cpu_cross_rank_bn_on_one_rank_is_plain_batch_norm(job_of_one):
    """Its formula against PyTorch's BN; the 2-rank path runs in the experiment and the bn.sync training test."""
    plain = torch.nn.BatchNorm2d(4)
    ours = CrossRankBatchNorm(4)
    x = torch.randn(3, 4, 5, 5)
    torch.testing.assert_close(ours.train()(x), plain.train()(x))


def test_sync_bn_trains_on_two_ranks_with_identical_buffers(small_digits, tmp_path, write_config):
    cfg = write_config(tiny_config(small_digits, str(tmp_path / "run"), train={"epochs": 1},
                                   optim={"name": "sgd"},
                                   bn={"sync": True, "stats": "moving_average", "per_rank_batch": "random"}))
    proc = horovodrun(2, ["train", "--config", cfg])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "cuDNN autotuning off" in proc.stdout + proc.stderr  # a new shape every step
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert len(set(report["rank_digests"])) == 1


# ----------------------------------------------------------------------------- random per-rank batches

def test_random_splits_cover_the_global_batch_and_differ_between_steps():
    splits = [random_split_sizes(64, 4, seed=1, epoch=0, step=s) for s in range(50)]
    assert all(sum(s) == 64 and min(s) >= MIN_RANDOM_SHARE for s in splits)
    assert len({tuple(s) for s in splits}) > 40
    # at most twice the fixed batch (memory and kernel shapes near the fixed run's), and the whole range is used: 8 ranks of 16, odd counts too
    for ranks in (8, 7, 2):
        shares = np.array([random_split_sizes(16 * ranks, ranks, seed=3, epoch=1, step=s) for s in range(400)])
        assert (shares.sum(axis=1) == 16 * ranks).all()
        assert shares.min() == MIN_RANDOM_SHARE and shares.max() == 2 * 16 - MIN_RANDOM_SHARE
        assert abs(shares.mean() - 16) < 1e-9 and shares.std() > 5  # uniform on [2, 30]: std 8.4
    assert splits[0] == random_split_sizes(64, 4, seed=1, epoch=0, step=0)
    batches = [train_batches(100, r, 4, 16, seed=1, epoch=0, random_split=True) for r in range(4)]
    for step in range(100 // 64):
        union = sorted(i for r in range(4) for i in batches[r][step])
        fixed = sorted(i for r in range(4) for i in train_batches(100, r, 4, 16, seed=1, epoch=0)[step])
        assert union == fixed  # the same global batch, only split differently


def test_loss_weight_makes_the_rank_average_the_global_mean():
    assert micro_batch_weight(32, 32, 1) == 1.0
    assert micro_batch_weight(32, 32, 4) == 0.25
    assert micro_batch_weight(48, 32, 1) == 1.5  # n_r / b
    rng = np.random.default_rng(0)
    sizes, losses = [3, 9, 6], rng.random(3)  # N = 3 ranks splitting a global batch of N b = 18
    b = 6
    rank_average = np.mean([micro_batch_weight(n, b, 1) * L for n, L in zip(sizes, losses)])
    assert math.isclose(rank_average, np.dot(sizes, losses) / sum(sizes))


def test_random_per_rank_batches_give_the_global_batch_update(tmp_path):
    result = script_result(tmp_path, "gradient_equivalence.py", "random")
    assert any(s[0] != s[1] for s in result["splits"]), result["splits"]
    np.testing.assert_allclose(result["distributed"], result["global_batch"], rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- gradient accumulation

@pytest.mark.parametrize("mode,tolerance", [("fp32", 1e-6), ("mixed-bf16", 2e-2), ("mixed-fp16", 2e-3)])
def test_two_accumulated_passes_equal_one_pass_on_twice_the_batch(tmp_path, mode, tolerance):
    result = script_result(tmp_path, "gradient_equivalence.py", "accumulate", mode)
    assert result["phases"] == ["adabound", "adabound", "sgd", "sgd"]
    np.testing.assert_allclose(result["k2"], result["k1"], rtol=tolerance, atol=tolerance)


def test_accumulation_trains_with_the_global_batch_in_the_log(small_digits, tmp_path, write_config):
    cfg = write_config(tiny_config(small_digits, str(tmp_path / "run"), train={"epochs": 1, "accumulation_steps": 2},
                                   optim={"name": "sgd"}))
    proc = horovodrun(2, ["train", "--config", cfg])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # 240 images, global batch 2 x 16 x 2 = 64: 3 steps of 2 passes, 48 images dropped
    assert "3 steps/epoch, global batch 64 (2 accumulated passes per step), 48 image(s) dropped" in proc.stdout


# ----------------------------------------------------------------------------- initialisation

def conv_stds(model) -> list[tuple[torch.nn.Conv2d, float]]:
    return [(m, float(m.weight.detach().std())) for m in model.modules() if isinstance(m, torch.nn.Conv2d)]


@pytest.mark.parametrize("conv_init,expected_std", [
    ("kaiming", lambda fan_in, fan_out: math.sqrt(2 / fan_in)),
    ("xavier", lambda fan_in, fan_out: math.sqrt(2 / (fan_in + fan_out))),
    ("gaussian", lambda fan_in, fan_out: 1.0)])
def test_each_conv_init_gives_its_standard_deviation(conv_init, expected_std):
    model = create_model("resnet50", 10, seed=0, conv_init=conv_init)
    for conv, std in conv_stds(model):
        k = conv.kernel_size[0] * conv.kernel_size[1]
        want = expected_std(conv.in_channels * k, conv.out_channels * k)
        assert abs(std / want - 1) < 0.05 if conv.weight.numel() > 4000 else abs(std / want - 1) < 0.3, \
            (conv, std, want)
        assert abs(float(conv.weight.mean())) < 0.1 * want


def test_gaussian_std_is_configurable_and_gamma_init_switches():
    model = create_model("resnet18", 10, seed=0, conv_init="gaussian", gaussian_std=0.05, zero_init_last_bn=False)
    assert all(abs(std / 0.05 - 1) < 0.1 for _, std in conv_stds(model))
    assert all(float(block.last_bn.weight.min()) == 1.0 for block in model.residual_blocks())
    zero = create_model("resnet18", 10, seed=0)
    assert all(float(block.last_bn.weight.abs().max()) == 0.0 for block in zero.residual_blocks())


# ----------------------------------------------------------------------------- resume

def test_resume_keeps_the_averaged_bn_buffers_exactly(small_digits, tmp_path, write_config):
    cfg = write_config(tiny_config(small_digits, str(tmp_path / "run"), train={"epochs": 1}, optim={"name": "sgd"},
                                   bn={"combine": "pooled"}))
    first = horovodrun(2, ["train", "--config", cfg])
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    saved = torch.load(tmp_path / "run" / "checkpoint-epoch0001.pt", weights_only=True)["model"]
    os.remove(tmp_path / "run" / "final_model.pt")
    resumed = horovodrun(2, ["train", "--config", cfg, "--resume"])  # nothing left to train: load, then save
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    final = torch.load(tmp_path / "run" / "final_model.pt", weights_only=True)
    buffers = [k for k in saved if k.endswith(("running_mean", "running_var"))]
    assert len(buffers) == 40
    assert all(torch.equal(saved[k], final[k]) for k in buffers)
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert len(set(report["rank_digests"])) == 1


# ----------------------------------------------------------------------------- bad input

def test_random_split_with_a_global_batch_below_two_per_rank_is_one_line(small_digits, tmp_path, write_config):
    cfg = write_config(tiny_config(small_digits, str(tmp_path / "run"), train={"batch_size": 1},
                                   bn={"per_rank_batch": "random"}))
    assert_one_error_line(horovodrun(2, ["train", "--config", cfg]), "bn.per_rank_batch=random", "train.batch_size")


@pytest.mark.parametrize("override,needle", [
    ("train.accumulation_steps=0", "train.accumulation_steps must be in [1, 1024]"),
    ("model.conv_init=orthogonal", "model.conv_init must be one of: kaiming, xavier, gaussian"),
    ("bn.combine=median", "bn.combine must be one of"),
    ("data.backend=dali_cpu", "bn.per_rank_batch=random needs data.backend=torchvision")])
def test_bad_strategy_settings_are_one_line(override, needle, tmp_path):
    args = ["train", "--config", "configs/demo.yaml", "--set", f"run_dir={tmp_path}", "--set", override]
    if override.startswith("data.backend"):
        args += ["--set", "bn.per_rank_batch=random"]
    assert_one_error_line(run([HYBRIDTRAIN, *args]), needle)


def test_more_accumulation_steps_than_batches_is_one_line(small_digits, tmp_path, write_config):
    cfg = write_config(tiny_config(small_digits, str(tmp_path / "run"), train={"accumulation_steps": 20}))
    assert_one_error_line(run([HYBRIDTRAIN, "train", "--config", cfg]), "train.accumulation_steps=20")


def test_a_skipped_step_puts_back_the_running_statistics_and_the_batch_counters():
    """RunningStatsGuard: the passes of a skipped step (or a CUDA graph's warm-up passes) leave
    every BN's running mean, variance and num_batches_tracked as they were."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.ReLU(),
                                torch.nn.Conv2d(4, 4, 1), torch.nn.BatchNorm2d(4)).train()
    model(torch.randn(2, 3, 8, 8))
    before = {k: v.clone() for k, v in model.state_dict().items() if "running" in k or "num_batches" in k}
    guard = RunningStatsGuard(model)
    guard.save()
    for _ in range(3):
        model(torch.randn(2, 3, 8, 8) * 5)
    assert model[1].num_batches_tracked.item() == 4 and not torch.equal(model[1].running_mean, before["1.running_mean"])
    guard.restore()
    after = {k: v for k, v in model.state_dict().items() if k in before}
    assert all(torch.equal(after[k], before[k]) for k in before) and after["4.num_batches_tracked"].item() == 1

"""Precision modes (fp64, fp32, mixed, layered, fp16_pure) and loss scaling: dtypes checked by hooks, the
scaler against hand-worked numbers, a real inf on one Horovod rank, every mode on 2 ranks, exact resume."""
from __future__ import annotations

import json
import os
import shutil
import sys

import pytest
import torch
from conftest import (
    BENCHMARKS,
    HOROVODRUN,
    HYBRIDTRAIN,
    REPO,
    assert_one_error_line,
    digits_subset,
    horovodrun,
    read_metrics,
    run,
    tiny_config,
)

from hybridtrain.config import config_from_dict
from hybridtrain.distributed.engines import with_step_contract
from hybridtrain.engine.step import EagerStep, classification_loss, train_step
from hybridtrain.models import create_model
from hybridtrain.precision.policy import prepare_model, resolve_policy
from hybridtrain.precision.scaler import LossScaler, Precision


def policy_for(**precision):
    optim = "goyal" if precision["mode"] == "fp16_pure" else "hybrid"
    return resolve_policy(config_from_dict({"precision": precision, "optim": {"name": optim}}).precision)


def output_dtypes(model, policy, names):
    """The dtype of each named module's output in one forward pass."""
    seen = {}

    def record(name):
        def hook(module, inputs, output):
            seen[name] = output.dtype
        return hook

    hooks = [dict(model.named_modules())[n].register_forward_hook(record(n)) for n in names]
    with Precision(policy, LossScaler("none", 1.0, 1, 5)).forward_context(torch.device("cpu")):
        logits = model(torch.randn(2, 3, 16, 16, dtype=policy.input_dtype))
    for h in hooks:
        h.remove()
    return seen, logits


def test_mixed_keeps_fp32_master_weights_fp16_convolutions_and_an_fp32_loss():
    policy = policy_for(mode="mixed")
    model = prepare_model(create_model("resnet18", 10, seed=0), policy)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    seen, logits = output_dtypes(model, policy, ["conv1", "layer1.0.conv1", "layer4.1.conv2", "fc"])
    assert set(seen.values()) == {torch.float16} and logits.dtype == torch.float16
    loss = classification_loss(logits, torch.tensor([1, 2]))
    assert loss.dtype == torch.float32
    log_probs = torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), 1)
    assert log_probs.dtype == torch.float32 and torch.allclose(loss, -log_probs[[0, 1], [1, 2]].mean())
    loss.backward()
    assert all(p.grad.dtype == torch.float32 for p in model.parameters())  # FP32 update on the master copy


def test_layered_runs_each_stage_in_its_configured_dtype():
    policy = policy_for(mode="layered", layers={"layer2": "bf16", "layer4": "fp32"})
    model = prepare_model(create_model("resnet18", 10, seed=0), policy)
    seen, logits = output_dtypes(model, policy, ["conv1", "layer1", "layer2", "layer3", "layer4", "fc"])
    assert seen == {"conv1": torch.float32, "layer1": torch.float16, "layer2": torch.bfloat16,
                    "layer3": torch.float16, "layer4": torch.float32, "fc": torch.float32}
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_fp16_pure_has_no_fp32_parameter_or_optimizer_state_anywhere(job_of_one):
    policy = policy_for(mode="fp16_pure")
    model = prepare_model(create_model("resnet18", 10, seed=0, residual_bn_scale=0.25), policy)
    assert {p.dtype for p in model.parameters()} == {torch.float16}
    optimizer = with_step_contract(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9))
    scaler = LossScaler(policy.loss_scaling, 1024.0, 100, 5)
    precision = Precision(policy, scaler)
    result = train_step(EagerStep(model), optimizer, precision, [(torch.randn(4, 3, 16, 16).half(), torch.arange(4), 1.0)])
    loss, logits = result.loss, result.logits
    assert logits.dtype == torch.float16 and loss.dtype == torch.float32 and torch.isfinite(loss)
    assert {s["momentum_buffer"].dtype for s in optimizer.state.values()} == {torch.float16}
    assert {b.dtype for b in model.buffers() if b.is_floating_point()} == {torch.float16}


def test_residual_bn_scale_and_bn_swap_follow_their_equations():
    torch.manual_seed(0)
    plain = create_model("resnet18", 10, seed=0, zero_init_last_bn=False).eval()
    swapped = create_model("resnet18", 10, seed=0, zero_init_last_bn=False, residual_bn_scale=0.25, bn_swap=True).eval()
    block, other = plain.layer1[0], swapped.layer1[0]
    with torch.no_grad():
        for bn in (block.bn2, other.bn2):
            bn.weight.uniform_(0.5, 1.5), bn.bias.uniform_(-0.5, 0.5)
            bn.running_mean.uniform_(-1, 1), bn.running_var.uniform_(0.5, 2)
        other.load_state_dict(block.state_dict())
        x = torch.randn(2, 64, 8, 8)
        bn = block.bn2
        h = torch.relu(block.bn1(block.conv1(x)))
        c = block.conv2(h)
        x_hat = (c - bn.running_mean.view(1, -1, 1, 1)) / torch.sqrt(bn.running_var.view(1, -1, 1, 1) + bn.eps)
        assert torch.allclose(block(x), torch.relu(bn.weight.view(1, -1, 1, 1) * x_hat + bn.bias.view(1, -1, 1, 1) + x),
                              atol=1e-5)
        h_scaled = torch.relu(0.25 * other.bn1(other.conv1(x)))  # y = 0.25 * BN(x) inside the block (Cheng et al.)
        c_scaled = other.conv2(h_scaled)
        x_hat_s = (c_scaled - bn.running_mean.view(1, -1, 1, 1)) / torch.sqrt(bn.running_var.view(1, -1, 1, 1) + bn.eps)
        swap = 0.25 * (bn.weight.view(1, -1, 1, 1) * (x_hat_s + x) + bn.bias.view(1, -1, 1, 1))  # gamma*(x_hat+r)+beta
        assert torch.allclose(other(x), torch.relu(swap), atol=1e-5)


def test_dynamic_scaler_against_hand_worked_numbers():
    w = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    optimizer = with_step_contract(torch.optim.SGD([w], lr=0.5))
    scaler = LossScaler("dynamic", 8.0, 2, 3)
    history = []
    for g in ([0.5, 1.0], [float("inf"), 0.0], [0.25, 0.25], [1.0, 1.0], [0.0, 2.0]):
        optimizer.zero_grad()
        scaler.backward((w * torch.tensor(g)).sum())  # dL/dw = g, scaled by S
        scaler.step(optimizer)
        history.append((scaler.scale, w.detach().tolist()))
    assert history == [(8.0, [0.75, 1.5]),            # clean: w -= 0.5 * g, S stays (1 clean step of 2)
                       (4.0, [0.75, 1.5]),            # inf: skipped, S halves
                       (4.0, [0.625, 1.375]),         # clean 1
                       (8.0, [0.125, 0.875]),         # clean 2: S doubles
                       (8.0, [0.125, -0.125])]
    assert scaler.skipped_steps == 1
    static = LossScaler("static", 128.0, 2, 3)
    static.update(False)
    assert static.scale == 128.0 and static.skipped_steps == 1


@pytest.mark.parametrize("mode, advice", [("fp32", "lower optim.lr or raise"),
                                          ("mixed", "lower optim.lr, use precision.mode=fp32, or raise"),
                                          ("fp16_pure", "lower optim.lr, use precision.mode=mixed or fp32, or raise")])
def test_consecutive_overflows_stop_the_run_with_one_line_whose_fix_fits_the_precision(mode, advice):
    from hybridtrain.config import load_config
    from hybridtrain.errors import UserError
    from hybridtrain.precision.scaler import create_precision
    sets = [f"precision.mode={mode}", "precision.max_consecutive_overflows=3"]
    sets += ["precision.loss_scaling=dynamic"] if mode != "fp32" else []
    sets += ["optim.name=goyal"] if mode == "fp16_pure" else []  # FP16 optimizer state: no AdaBound
    scaler = create_precision(load_config(None, sets).precision).scaler
    scaler.update(False), scaler.update(False)
    with pytest.raises(UserError, match="3 steps in a row had a NaN or inf loss or gradient") as stop:
        scaler.update(False)
    assert advice in str(stop.value) and str(stop.value).count("precision.mode") == (mode != "fp32")


def test_an_inf_on_one_rank_is_skipped_on_every_rank_and_the_scale_recovers(tmp_path):
    script = os.path.join(REPO, "tests", "scripts", "scaler_overflow.py")
    proc = run([HOROVODRUN, "--gloo", "-np", "2", "-H", "localhost:2", sys.executable, script, str(tmp_path)])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ranks = [json.load(open(tmp_path / f"rank{r}.json")) for r in range(2)]
    assert ranks[0] == ranks[1], "the ranks disagree on scale, skip or parameters"
    records = ranks[0]
    assert [r["stepped"] for r in records] == [True, True, False, True, True, True, True]
    assert [r["scale"] for r in records] == [1024, 1024, 512, 512, 512, 1024, 1024]  # growth after 3 clean steps
    assert records[2]["digest"] == records[1]["digest"], "the overflowing step changed the parameters"
    assert records[3]["digest"] != records[2]["digest"]


@pytest.fixture(scope="module")
def tiny_digits(small_digits, tmp_path_factory):
    """4 train and 2 val images per class: 40 / 20, two steps of 2 x 8 per epoch."""
    return digits_subset(small_digits, str(tmp_path_factory.mktemp("data") / "tiny"), 4, 2)


def precision_config(data, run_dir, mode, epochs=1, **precision):
    optim = {"name": "goyal", "lr": 0.05, "warmup_epochs": 0.5}
    return tiny_config(data, run_dir, precision={"mode": mode, **precision}, optim=optim,
                       data={"crop_size": 32, "val_resize": 32}, train={"epochs": epochs, "batch_size": 8},
                       model={"arch": "resnet18", "residual_bn_scale": 0.25 if mode == "fp16_pure" else 1.0})


# Every mode on two Horovod ranks (no NaN, equal parameters, the loss scale's halvings) is checked on the 2-epoch NHWC
# runs of tests/test_preemption.py::test_channels_last_trains_on_two_ranks_and_its_model_loads_strictly_into_torchvision
# (one run per mode for the whole suite, to keep CI short).


def test_checkpoint_carries_the_scaler_and_resume_is_exact(tiny_digits, tmp_path, write_config):
    def train(run_dir, epochs, *extra):
        cfg = precision_config(tiny_digits, run_dir, "mixed", epochs, compute_dtype="bf16", loss_scaling="dynamic",
                               loss_scale=256.0, growth_interval=1)
        cfg["data"]["channels_last"] = True  # the CPU's half-precision convolution backward is fast only in NHWC
        proc = run([HYBRIDTRAIN, "train", "--config", write_config(cfg, f"{os.path.basename(run_dir)}.yaml"), *extra])
        assert proc.returncode == 0, proc.stderr[-3000:]

    whole, resumed = str(tmp_path / "whole"), str(tmp_path / "resumed")
    train(whole, 2)
    os.makedirs(resumed)
    shutil.copy(os.path.join(whole, "checkpoint-epoch0001.pt"), resumed)
    ckpt = torch.load(os.path.join(resumed, "checkpoint-epoch0001.pt"), weights_only=True)
    assert ckpt["scaler"]["scale"] == 256.0 * 2 ** 5  # one rank: 40 / 8 = 5 clean steps, each doubling it
    train(resumed, 2, "--resume")
    final = [torch.load(os.path.join(d, "final_model.pt"), weights_only=True) for d in (whole, resumed)]
    assert all(torch.equal(final[0][k], final[1][k]) for k in final[0])
    assert read_metrics(whole)[-1]["loss_scale"] == read_metrics(resumed)[-1]["loss_scale"] == 256.0 * 2 ** 10


@pytest.mark.parametrize("sets, needle", [
    (["precision.mode=fp8"], "precision.mode must be one of"),
    (["precision.mode=fp16_pure", "optim.name=hybrid", "optim.adabound_epochs=1"], "needs FP32 state"),
    (["precision.mode=layered", "precision.layers.layer5=fp16"], "names stage 'layer5'"),
    (["precision.layers.fc=int8"], "must be fp32, fp16 or bf16"),
    (["model.bn_swap=true"], "zero_init_last_bn: false"),
])
def test_bad_precision_settings_are_one_line(sets, needle, tiny_digits, tmp_path, write_config):
    cfg = write_config(tiny_config(tiny_digits, str(tmp_path / "run")))
    args = [a for s in sets for a in ("--set", s)]
    assert_one_error_line(run([HYBRIDTRAIN, "train", "--config", cfg, *args]), needle)


def test_bench_runs_every_precision_and_the_baseline_prints_a_ratio(tmp_path):
    out = tmp_path / "bench.json"
    args = [*BENCHMARKS, "bench", "--config", "configs/demo.yaml", "--batch-size", "4", "--image-size", "32",
            "--steps", "2", "--warmup", "1", "--json", str(out), "--baseline", "--profile", str(tmp_path / "prof"),
            "--set", "data.channels_last=true"]  # NHWC: the CPU's half-precision convolution backward is slow in NCHW
    for mode in ("fp64", "fp32", "mixed-fp16", "mixed-bf16", "layered", "fp16_pure"):
        args += ["--precision", mode]
    proc = run(args, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())
    trainer = [r for r in rows if r["loop"] == "trainer"]
    assert [r["precision"] for r in trainer] == ["fp64", "fp32", "mixed-fp16", "mixed-bf16", "layered", "fp16_pure"]
    assert [r["optimizer"] for r in trainer] == ["hybrid/adabound"] * 5 + ["goyal"]  # the phase they ran in
    for t, b in zip(rows[::2], rows[1::2]):
        assert (t["loop"], b["loop"]) == ("trainer", "baseline")
        assert b["trainer_over_baseline"] == pytest.approx(t["images_per_sec"] / b["images_per_sec"])
        assert t["median_ms"] <= t["p90_ms"] and t["peak_memory_mb"] > 0
    assert "| trainer | resnet18 | hybrid/adabound | mixed-bf16 | 4 | 32 |" in proc.stdout
    assert (tmp_path / "prof" / "trace.json").stat().st_size > 0


def test_precision_and_layered_experiment_rows():
    from hybridtrain.config import load_config
    from tools.experiments import layered_rows, precision_rows
    cfg = load_config("configs/demo.yaml")
    names = [name for name, _ in precision_rows(cfg)]
    assert names == ["fp64", "fp32", "mixed-fp16", "mixed-bf16", "layered", "fp16_pure (goyal)"]
    for _, sets in precision_rows(cfg):  # every row is a valid recipe
        load_config("configs/demo.yaml", sets)
    rows = dict(layered_rows(cfg))
    assert list(rows) == [f"{k} stage(s) fp16" for k in range(5)]
    assert rows["2 stage(s) fp16"][1:5] == ["precision.layers.layer1=fp16", "precision.layers.layer2=fp16",
                                            "precision.layers.layer3=fp32", "precision.layers.layer4=fp32"]


def test_fp16_communication_with_a_predivide_factor_trains_on_two_ranks(tiny_digits, tmp_path, write_config):
    run_dir = str(tmp_path / "run")
    cfg = precision_config(tiny_digits, run_dir, "fp32", loss_scaling="static", loss_scale=128.0)  # the paper's
    cfg["horovod"], cfg["distributed"] = {"gradient_predivide_factor": 2.0}, {"compression": "fp16"}  # P40: FP32, FP16 wire
    proc = horovodrun(2, ["train", "--config", write_config(cfg)])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (record,) = read_metrics(run_dir)
    assert record["train_loss"] == record["train_loss"] and record["skipped_steps"] == 0
    assert len(set(json.load(open(os.path.join(run_dir, "report.json")))["rank_digests"])) == 1


def test_a_nan_loss_on_one_rank_skips_the_step_on_every_rank_and_three_in_a_row_stop_all(tmp_path):
    """FP32, no loss scaling: NaN in rank 1's data at steps 2, 5, 6, 7 (max_consecutive_overflows = 3)."""
    script = os.path.join(REPO, "tests", "scripts", "nonfinite_loss.py")
    proc = run([HOROVODRUN, "--gloo", "-np", "2", "-H", "localhost:2", sys.executable, script, str(tmp_path)])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ranks = [json.load(open(tmp_path / f"rank{r}.json")) for r in range(2)]
    assert [r["loss_finite"] for r in ranks[1]["records"]] == [True, True, False, True, True, False, False]
    assert all(r["loss_finite"] for r in ranks[0]["records"])  # rank 0's own loss stayed finite
    for rank in ranks:  # both ranks skip the same steps and hold the same parameters
        assert [r["stepped"] for r in rank["records"]] == [True, True, False, True, True, False, False]
        assert rank["records"][2]["digest"] == rank["records"][1]["digest"]
    assert [r["digest"] for r in ranks[0]["records"]] == [r["digest"] for r in ranks[1]["records"]]
    assert ranks[0]["stopped"]["step"] == ranks[1]["stopped"]["step"] == 7
    assert "3 steps in a row had a NaN or inf loss" in ranks[0]["stopped"]["error"]

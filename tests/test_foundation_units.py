"""Units of the foundation: config validation, model compatibility and init, data preparation, sharding."""
from __future__ import annotations

import math
import os

import numpy as np
import pytest
import torch
import torchvision

from hybridtrain.config import Config, load_config
from hybridtrain.data import sharding
from hybridtrain.data.prepare.digits import prepare_digits, stratified_split
from hybridtrain.errors import UserError
from hybridtrain.models import create_model
from hybridtrain.optim import goyal_lr, step_decay_factor
from hybridtrain.optim.schedules import sgd_schedule

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ----------------------------------------------------------------------------------------------- config

def test_demo_config_loads_with_public_keys():
    cfg = load_config(os.path.join(REPO, "configs", "demo.yaml"))
    d = cfg.to_dict()
    for dotted in ("run_dir", "data.path", "data.backend", "model.arch", "train.epochs", "train.batch_size",
                   "optim.name", "precision.mode", "seed"):
        node = d
        for part in dotted.split("."):
            node = node[part]


@pytest.mark.parametrize("override, needles", [
    ("train.epoch=5", ["unknown key 'train.epoch'", "did you mean 'train.epochs'"]),
    ("train.batch_size=0", ["train.batch_size", "[1, 65536]"]),
    ("train.batch_size=abc", ["train.batch_size must be an integer"]),
    ("model.arch=resnet9", ["model.arch must be one of", "resnet50"]),
    ("optim.lr=-1", ["optim.lr must be in (0"]),
    ("data.hflip=maybe", ["data.hflip must be true or false"]),
    ("bogus.key=1", ["unknown key 'bogus'"]),
    ("noequals", ["write it as key.sub=value"]),
])
def test_bad_config_values_name_key_and_allowed(override, needles):
    with pytest.raises(UserError) as err:
        load_config(None, [override])
    message = str(err.value)
    assert "\n" not in message
    for needle in needles:
        assert needle in message


def test_overrides_are_typed_and_fingerprint_changes():
    base = load_config(None, [])
    cfg = load_config(None, ["train.epochs=17", "optim.lr=0.2", "data.hflip=false"])
    assert (cfg.train.epochs, cfg.optim.lr, cfg.data.hflip) == (17, 0.2, False)
    assert cfg.fingerprint() != base.fingerprint() and isinstance(base, Config)


def test_bad_yaml_file_is_one_line(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("train: {epochs: [\n")
    with pytest.raises(UserError, match="not valid YAML"):
        load_config(str(path))
    with pytest.raises(UserError, match="config file not found"):
        load_config(str(tmp_path / "missing.yaml"))


# ------------------------------------------------------------------------------------------------ model

@pytest.mark.parametrize("arch", ["resnet18", "resnet50"])
@pytest.mark.parametrize("variant", ["v1", "v1.5"])
def test_state_dict_loads_into_torchvision_strictly(arch, variant):
    ours = create_model(arch, 10, variant=variant)
    theirs = getattr(torchvision.models, arch)(weights=None, num_classes=10)
    theirs.load_state_dict(ours.state_dict(), strict=True)
    if variant == "v1.5":  # same downsampling placement: same function
        ours.eval(), theirs.eval()
        x = torch.randn(2, 3, 64, 64)
        torch.testing.assert_close(ours(x), theirs(x))


def test_v1_strides_in_first_1x1_and_v15_in_3x3():
    v1, v15 = create_model("resnet50", 10, "v1"), create_model("resnet50", 10, "v1.5")
    assert v1.layer2[0].conv1.stride == (2, 2) and v1.layer2[0].conv2.stride == (1, 1)
    assert v15.layer2[0].conv1.stride == (1, 1) and v15.layer2[0].conv2.stride == (2, 2)


def test_small_input_stem():
    m = create_model("resnet18", 10, small_input_stem=True)
    assert m.conv1.kernel_size == (3, 3) and m.conv1.stride == (1, 1)
    assert isinstance(m.maxpool, torch.nn.Identity)
    assert m(torch.randn(2, 3, 32, 32)).shape == (2, 10)


def test_conv_init_is_kaiming_fan_in_and_last_bn_gamma_zero():
    model = create_model("resnet50", 1000, seed=0)
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Conv2d) and m.weight.numel() >= 4096:
            k = m.kernel_size[0] * m.kernel_size[1]
            expected = math.sqrt(2.0 / (k * m.in_channels))  # fan_in = k*k*C_in, computed here by hand
            assert float(m.weight.std()) == pytest.approx(expected, rel=0.05), name
            assert float(m.weight.mean()) == pytest.approx(0.0, abs=expected * 0.05), name
    for block in model.residual_blocks():
        assert torch.count_nonzero(block.last_bn.weight) == 0
        assert torch.all(block.bn1.weight == 1)
    assert torch.all(model.bn1.weight == 1) and torch.all(model.bn1.bias == 0)
    assert float(model.fc.weight.std()) == pytest.approx(0.01, rel=0.05) and torch.all(model.fc.bias == 0)


def test_gamma_one_when_zero_init_disabled():
    model = create_model("resnet18", 10, zero_init_last_bn=False)
    assert all(torch.all(b.last_bn.weight == 1) for b in model.residual_blocks())


# ------------------------------------------------------------------------------------------------- data

def test_prepare_digits_layout_split_and_idempotence(digits_dir, tmp_path):
    counts = {s: sum(len(f) for _, _, f in os.walk(os.path.join(digits_dir, s))) for s in ("train", "val")}
    assert counts["train"] + counts["val"] == 1797
    assert 0.18 < counts["val"] / 1797 < 0.22
    assert sorted(os.listdir(os.path.join(digits_dir, "train"))) == [str(i) for i in range(10)]
    from PIL import Image
    first = os.path.join(digits_dir, "train", "0", sorted(os.listdir(os.path.join(digits_dir, "train", "0")))[0])
    with Image.open(first) as img:
        assert img.size == (32, 32) and img.mode == "RGB" and img.format == "JPEG"
    again = prepare_digits(digits_dir)
    assert again == counts
    with pytest.raises(UserError, match="holds digits prepared with other settings"):
        prepare_digits(digits_dir, seed=1)  # refused before anything is written
    other = tmp_path / "occupied"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    with pytest.raises(UserError, match="not empty"):
        prepare_digits(str(other))
    assert (other / "notes.txt").read_text() == "mine"


def test_stratified_split_per_class_shares():
    labels = np.repeat(np.arange(3), [10, 20, 30])
    train, val = stratified_split(labels, 0.2, seed=1)
    assert len(set(train) & set(val)) == 0 and len(train) + len(val) == 60
    assert [int((labels[val] == c).sum()) for c in range(3)] == [2, 4, 6]
    assert np.array_equal(stratified_split(labels, 0.2, seed=1)[1], val)


@pytest.mark.parametrize("n, world, batch", [(240, 2, 16), (1438, 2, 32), (101, 3, 8), (70, 3, 16), (9, 2, 4)])
def test_train_sharding_at_most_once_full_batches_equal_steps(n, world, batch):
    for epoch in (0, 1):
        per_rank = [sharding.train_batches(n, r, world, batch, seed=5, epoch=epoch) for r in range(world)]
        steps = {len(b) for b in per_rank}
        assert steps == {sharding.steps_per_epoch(n, world, batch)}
        seen = [i for batches in per_rank for b in batches for i in b]
        assert len(seen) == len(set(seen)) == n - sharding.dropped_per_epoch(n, world, batch)
        assert all(len(b) == batch for batches in per_rank for b in batches), "the per-GPU batch is fixed"
        assert sharding.dropped_per_epoch(n, world, batch) == n % (world * batch) < world * batch
    e0 = sharding.train_batches(n, 0, world, batch, 5, 0)
    e1 = sharding.train_batches(n, 0, world, batch, 5, 1)
    assert e0 != e1 and e0 == sharding.train_batches(n, 0, world, batch, 5, 0)


@pytest.mark.parametrize("n, world", [(70, 2), (70, 3), (359, 2), (5, 4)])
def test_val_shards_cover_once(n, world):
    covered = [i for r in range(world) for i in sharding.val_shard(n, r, world)]
    assert covered == list(range(n))


# ------------------------------------------------------------------------------------------- schedules

def test_goyal_warmup_and_step_decay_by_hand():
    kw = dict(iters_per_epoch=10, base_lr=0.1, world_size=4, warmup_epochs=5, total_epochs=90,
              milestones=[1 / 3, 2 / 3, 8 / 9], decay_factor=0.1)
    assert goyal_lr(0, **kw) == pytest.approx(0.1)
    assert goyal_lr(25, **kw) == pytest.approx(0.1 + 0.3 * 2.5 / 5)  # halfway through warmup: 0.25
    assert goyal_lr(50, **kw) == pytest.approx(0.4)
    assert goyal_lr(299, **kw) == pytest.approx(0.4)
    assert goyal_lr(300, **kw) == pytest.approx(0.04)  # epoch 30
    assert goyal_lr(600, **kw) == pytest.approx(0.004)
    assert goyal_lr(800, **kw) == pytest.approx(0.0004)
    assert step_decay_factor(89, 90, [1 / 3, 2 / 3, 8 / 9], 0.1) == pytest.approx(1e-3)
    # optim.name=sgd: Goyal's step decay without the warmup (optim.warmup_epochs is 5 here and not used): lr*N at once
    o = load_config(None, ["optim.name=sgd", "optim.lr=0.1", "train.epochs=90"]).optim
    assert [sgd_schedule(step, o, 4, 10, 90)["lr"] for step in (0, 299, 300, 600, 800)] == \
        pytest.approx([0.4, 0.4, 0.04, 0.004, 0.0004])


def test_every_config_key_is_documented_in_the_readme():
    import dataclasses

    from hybridtrain.config import Config
    readme = open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")).read()
    missing = []
    for section in dataclasses.fields(Config):
        default = section.default_factory() if section.default is dataclasses.MISSING else section.default
        keys = [f"{section.name}.{f.name}" for f in dataclasses.fields(default)] if dataclasses.is_dataclass(default) \
            else [section.name]
        missing += [k for k in keys if f"| `{k}` |" not in readme]
    assert not missing, f"config keys missing from the README's config table: {missing}"

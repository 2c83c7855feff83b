"""Progressive resizing (data.res_*, data/resolution.py): the schedule against a hand-worked table,
its one-line refusals, both backends' batches at the epoch's resolution, one compile per resolution (dynamo's
counters), one CUDA-graph capture per batch shape (its dispatch), and a 2-rank run of each engine stopped mid-epoch
and resumed bit-exactly at the epoch's resolution, its report listing the resolution per epoch."""
from __future__ import annotations

import pytest
import torch
import yaml
from conftest import WITH_WORKERS, digits_subset, horovodrun, read_metrics, tiny_config, torchrun
from test_preemption import straight_then_stopped_and_resumed

from hybridtrain.config import config_from_dict
from hybridtrain.data.resolution import Resolutions, progressive_resolution
from hybridtrain.errors import UserError

TINY_RAMP = {"res_start": 16, "res_end": 32, "res_multiple": 8, "res_start_epoch": 0, "res_end_epoch": 2}


def test_the_resolution_schedule_gives_the_hand_worked_table():
    """r(e) = start for e <= e0, end for e >= e1, else m * round((start + (end - start)(e - e0)/(e1 - e0)) / m),
    rounded half to even as FFCV's np.round."""
    # 128 -> 224 over epochs 1..5, m = 32: e=2: 128 + 96/4 = 152, /32 = 4.75 -> 5 -> 160; e=3: 176, 5.5 -> 6 -> 192
    # (half to even); e=4: 200, 6.25 -> 6 -> 192
    assert [progressive_resolution(e, 128, 224, 1, 5, 32) for e in range(7)] == [128, 128, 160, 192, 192, 224, 224]
    # FFCV's 160 -> 192 over epochs 0..4: e=1: 168, 5.25 -> 160; e=2: 176, 5.5 -> 6 -> 192; e=3: 184, 5.75 -> 192
    assert [progressive_resolution(e, 160, 192, 0, 4, 32) for e in range(6)] == [160, 160, 192, 192, 192, 192]
    # 128 -> 160 over epochs 0..2: e=1: 144, 4.5 -> 4 (half to even, not up) -> 128
    assert [progressive_resolution(e, 128, 160, 0, 2, 32) for e in range(3)] == [128, 128, 160]
    # the tests' ramp: 16 -> 32 over epochs 0..2 in multiples of 8: e=1: 24, 3 -> 24
    ramp = Resolutions(32, **{k[4:]: v for k, v in TINY_RAMP.items()})
    assert [ramp(e) for e in range(4)] == [16, 24, 32, 32] and ramp.distinct(4) == [16, 24, 32]
    assert [Resolutions(32)(e) for e in range(3)] == [32, 32, 32] and not Resolutions(32).progressive


@pytest.mark.parametrize("keys, needle", [
    ({"res_end": 192}, "data.res_end applies to progressive resizing"),
    ({"res_start": 192, "res_end": 160, "res_end_epoch": 2}, "8 <= data.res_start <= data.res_end"),
    ({"res_start": 160, "res_end": 200, "res_end_epoch": 2}, "multiples of data.res_multiple (32)"),
    ({"res_start": 160, "res_end": 192, "res_end_epoch": 3}, "data.res_start_epoch < data.res_end_epoch < train.epochs"),
    ({"res_start": 160, "res_end": 192, "backend": "synthetic"}, "data.backend=synthetic has none"),
])
def test_bad_progressive_values_are_one_line(keys, needle):
    with pytest.raises(UserError) as err:
        config_from_dict({"train": {"epochs": 3}, "optim": {"name": "sgd"}, "data": keys})
    assert needle in str(err.value) and "\n" not in str(err.value)


def tiny_cfg(data: str, **data_keys):
    return config_from_dict(tiny_config(data, "unused", data={**TINY_RAMP, **data_keys}, train={"epochs": 3}))


@pytest.mark.parametrize("backend", ["torchvision", "dali_cpu"])
def test_both_backends_train_at_the_epochs_resolution_and_validate_at_the_crop(small_digits, backend):
    from hybridtrain.data.folder import scan_dataset
    from hybridtrain.data.loaders import create_loaders
    from hybridtrain.distributed.topology import Topology
    cfg = tiny_cfg(small_digits, backend=backend)
    topo = Topology(rank=0, size=1, local_rank=0, local_size=1)
    loaders = create_loaders(cfg, topo)
    assert len(scan_dataset(small_digits)[0]) == loaders.train_images
    for epoch, size in enumerate((16, 24, 32)):
        loaders.train.batch_sampler.set_epoch(epoch)
        images, _, _ = next(iter(loaders.train))
        assert tuple(images.shape) == (16, 3, size, size), (epoch, images.shape)
    images, _, _ = next(iter(loaders.val))
    assert tuple(images.shape[1:]) == (3, 32, 32)
    loaders.close()


def test_compiled_blocks_compile_once_per_resolution_and_never_again():
    """train.compile under progressive resizing: static-shape graphs (dynamic=False), one compile per block and input
    shape (ResNet-18's layer4, 2 blocks, at 4 then 8 px: 2 graphs each), none for a resolution met again, and no block
    left to eager at the recompile limit (dynamo's own counters; the eager backend for time: dynamo makes the same
    graphs for inductor, whose compile times at 16, 24, 32 px are in docs/experiments.md)."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from hybridtrain.engine.step import compile_blocks
    from hybridtrain.models import model_from_config
    model = model_from_config(config_from_dict({"model": {"arch": "resnet18"}, "optim": {"name": "sgd"}}).model, 10,
                              seed=0)
    forward = compile_blocks(model.layer4, backend="eager", dynamic=False, resolutions=2)
    torch._dynamo.reset()
    counters.clear()
    new = []
    for size in (4, 8, 4, 8):
        before = counters["stats"]["unique_graphs"]
        forward(torch.randn(2, 256, size, size)).sum().backward()
        new.append(counters["stats"]["unique_graphs"] - before)
    assert new == [2, 2, 0, 0]
    assert counters["frames"]["ok"] == counters["frames"]["total"] == 4
    assert not any("cache_size_limit" in key or "recompile_limit" in key for key in counters["unimplemented"])


class Capture:
    """A stand-in for one GraphedStep (a CUDA graph needs a GPU): its static batch's shape, and what it replays."""

    def __init__(self, size: int):
        self.static_images = torch.zeros(4, 3, size, size)

    def backward_pass(self, precision, images, labels, weight, sync):
        return self.static_images.shape[-1]


def test_graphed_steps_replay_each_batch_shapes_own_capture():
    from hybridtrain.engine.step import GraphedSteps
    steps = GraphedSteps([Capture(16), Capture(24)])
    labels = torch.zeros(4, dtype=torch.long)
    assert [steps.backward_pass(None, torch.zeros(4, 3, s, s), labels) for s in (16, 24, 16)] == [16, 24, 16]
    with pytest.raises(UserError, match=r"captured the batch shapes \(4, 3, 16, 16\), \(4, 3, 24, 24\) but got "
                                        r"\(4, 3, 32, 32\)"):
        steps.backward_pass(None, torch.zeros(4, 3, 32, 32), labels)


# ----------------------------------------------------------------------------- 2 ranks of each engine

@pytest.fixture(scope="module")
def few_digits(small_digits, tmp_path_factory) -> str:
    """8 train and 3 val images per class: 5 steps of 2 x 8 per epoch, 30 validation images."""
    return digits_subset(small_digits, str(tmp_path_factory.mktemp("data") / "few"), 8, 3)


def stopped_and_resumed_matches_straight(tmp_path, few: str, engine: str, launch, **data_keys) -> None:
    """2 epochs at 16 then 32 px (validated at 32): a straight run, and one SIGTERM'd in epoch 1 then resumed, which
    must finish epoch 1 at 16 px: bitwise the same model after each epoch; the report lists the resolutions."""
    from hybridtrain.reports.report import report_run

    def write(name: str, extra: dict) -> str:
        cfg = tiny_config(few, str(tmp_path / name), train={"epochs": 2, "batch_size": 8, "deterministic": True},
                          optim={"name": "sgd", "lr": 0.05},
                          data={**TINY_RAMP, "res_end_epoch": 1, **data_keys, **extra})
        (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump(cfg))
        return str(tmp_path / f"{name}.yaml")
    straight_then_stopped_and_resumed(write("straight", {}), write(
        "broken", WITH_WORKERS if data_keys.get("backend", "torchvision") == "torchvision" else {}), engine, launch)
    for epoch in (1, 2):
        a, b = (torch.load(tmp_path / run / f"checkpoint-epoch000{epoch}.pt", weights_only=True)
                for run in ("straight", "broken"))
        assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"]), epoch
    for run in ("straight", "broken"):
        assert [r["train_resolution"] for r in read_metrics(str(tmp_path / run))] == [16, 32]
    report_run(str(tmp_path / "straight"))
    markdown = (tmp_path / "straight" / "report.md").read_text()
    assert "| train px |" in markdown.replace("| epoch | train px |", "| train px |")
    assert "16 px to epoch 1, 32 px from epoch 2, multiples of 8: 16 32" in markdown


@pytest.mark.slow
def test_progressive_resizing_on_torchrun_resumes_bitwise(few_digits, tmp_path):
    stopped_and_resumed_matches_straight(tmp_path, few_digits, "torch", torchrun)


@pytest.mark.slow
def test_progressive_resizing_on_horovodrun_with_dali_resumes_bitwise(few_digits, tmp_path):
    stopped_and_resumed_matches_straight(tmp_path, few_digits, "horovod", horovodrun, backend="dali_cpu")

"""The DALI pipeline on the CPU (the same graph as dali_gpu), with several ranks simulated in one process.

Each simulated rank is its own loader for that rank, exactly as under Horovod. Also the data
tools: synthetic-imagenet, check-data with a planted corrupt JPEG, and the flat validation layout.
"""
import os
import shutil

import pytest
import torch

pytest.importorskip("nvidia.dali", reason="NVIDIA DALI is not installed: pip install nvidia-dali-cuda130 "
                                          "(or ./install.sh)")

from PIL import Image  # noqa: E402

from hybridtrain.config import config_from_dict  # noqa: E402
from hybridtrain.data import dali  # noqa: E402
from hybridtrain.data.check import check_data, format_report, problem_count, write_filelist  # noqa: E402
from hybridtrain.data.folder import (  # noqa: E402
    read_filelist,  # noqa: E402
    scan_dataset,
    scan_split,
)
from hybridtrain.data.loaders import to_device  # noqa: E402
from hybridtrain.data.prepare.flat_val import reorganise_flat_val
from hybridtrain.data.prepare.synthetic_imagenet import prepare_synthetic_imagenet
from hybridtrain.data.presets import val_transform  # noqa: E402
from hybridtrain.errors import UserError  # noqa: E402

BATCH = 4
CROP, RESIZE = 32, 36


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    """10 classes x (7 train, 3 val) small procedural JPEGs: 70 train, 30 val images."""
    root = str(tmp_path_factory.mktemp("data") / "synthetic")
    prepare_synthetic_imagenet(root, num_classes=10, train_per_class=7, val_per_class=3, typical_size=(64, 48),
                               workers=1)
    return scan_dataset(root)


def make_cfg(seed=3):
    return config_from_dict({"seed": seed, "train": {"batch_size": BATCH},
                             "data": {"crop_size": CROP, "val_resize": RESIZE, "workers": 1}})


def train_loaders(images, world_size, seed=3, **kw):
    return [dali.create_dali_train_loader(images, make_cfg(seed), r, world_size, world_size, "cpu", **kw)
            for r in range(world_size)]


def run_epoch(loader, epoch):
    """The index batches of one epoch, checking labels against the dataset on the way."""
    loader.batch_sampler.set_epoch(epoch)
    batches = []
    for images, labels, indices in loader:
        assert labels.dtype == indices.dtype == torch.int64
        assert labels.tolist() == [loader.images.samples[i][1] for i in indices.tolist()]
        batches.append(indices.tolist())
    return batches


@pytest.mark.parametrize("world_size", [2, 3])
def test_training_shards_partition_the_data_and_change_every_epoch(dataset, world_size):
    train, _ = dataset
    loaders = train_loaders(train, world_size)
    dropped = loaders[0].dropped_per_epoch
    assert 0 < dropped < world_size * BATCH  # 70 is not a multiple of the global batch
    subsets = []
    for epoch in range(6):
        per_rank = [run_epoch(loader, epoch) for loader in loaders]
        assert len({len(batches) for batches in per_rank}) == 1, "ranks ran different step counts"
        assert all(len(batches) == len(loaders[0]) for batches in per_rank)
        assert all(len(b) == BATCH for batches in per_rank for b in batches), "training yields full batches only"
        seen = [i for batches in per_rank for b in batches for i in b]
        assert len(seen) == len(set(seen)), f"a sample was used twice in epoch {epoch}"
        assert len(seen) == len(train) - dropped
        subsets.append([{i for b in batches for i in b} for batches in per_rank])
    largest_shard = -(-len(train) // world_size)
    assert all(len(a | b) > largest_shard for a, b in zip(*subsets[:2])), "a rank stayed inside one shard"


def test_an_interrupted_epoch_does_not_shift_the_next(dataset):
    train, _ = dataset
    loaders = train_loaders(train, 2)
    for loader in loaders:
        it = iter(loader)
        next(it), next(it)  # leave epoch 0 after two steps
    seen = [i for loader in loaders for b in run_epoch(loader, 1) for i in b]
    assert len(seen) == len(set(seen)) == len(train) - loaders[0].dropped_per_epoch


@pytest.mark.parametrize("world_size", [2, 3])
def test_validation_counts_every_image_exactly_once(dataset, world_size):
    _, val = dataset
    assert len(val) % (world_size * BATCH) != 0
    loaders = [dali.create_dali_val_loader(val, make_cfg(), r, world_size, world_size, "cpu")
               for r in range(world_size)]
    next(iter(loaders[0]))  # a pass left after one batch must not shift the next one
    passes = []
    for _ in range(2):
        per_rank = [run_epoch(loader, 0) for loader in loaders]
        assert [len(batches) for batches in per_rank] == [len(loader) for loader in loaders]
        seen = sorted(i for batches in per_rank for b in batches for i in b)
        assert seen == list(range(len(val)))
        passes.append(per_rank)
    assert passes[0] == passes[1]
    # one pipeline per run, reused by the second pass; the interrupted pass's pipeline was not reused
    assert [loader.builds for loader in loaders] == [2] + [1] * (world_size - 1)


def test_validation_images_match_torchvision_preprocessing(dataset):
    """Each image, normalised on its way to the model (to_device), is its own index's resize + center crop +
    ImageNet normalisation (RGB order). The batches are compared after the whole pass: DALI's buffers, shared
    with torch without a copy, must not be reused while torch holds them."""
    _, val = dataset
    loader = dali.create_dali_val_loader(val, make_cfg(), 0, 1, 1, "cpu")
    reference = torch.stack([val_transform(CROP, RESIZE)(Image.open(p).convert("RGB")) for p, _ in val.samples])
    batches = list(loader)
    assert len(batches) > 2
    for batch in batches:
        images, _ = to_device(batch, torch.device("cpu"), torch.float32)
        for image, index in zip(images, batch[2].tolist()):
            distance = (reference - image).abs().mean(dim=(1, 2, 3))
            assert int(distance.argmin()) == index
            assert float(distance[index]) < 0.2


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("channels_last", [False, True])
def test_output_dtype_and_layout_follow_the_arguments(dataset, dtype, channels_last):
    """A CPU pipeline delivers uint8 pixels in the asked layout (a quarter of the bytes to copy); to_device gives the model's dtype,
    the layout kept, normalised."""
    train, val = dataset
    cfg = make_cfg()
    for loader in (dali.create_dali_train_loader(train, cfg, 0, 2, 2, "cpu", dtype=dtype, channels_last=channels_last),
                   dali.create_dali_val_loader(val, cfg, 1, 2, 2, "cpu", dtype=dtype, channels_last=channels_last)):
        batch = next(iter(loader))
        memory_format = torch.channels_last if channels_last else torch.contiguous_format
        assert batch[0].shape == (BATCH, 3, CROP, CROP) and batch[0].dtype == torch.uint8
        assert batch[0].is_contiguous(memory_format=memory_format)
        images, _ = to_device(batch, torch.device("cpu"), dtype)
        assert images.dtype == dtype and images.is_contiguous(memory_format=memory_format)
        assert -3 < float(images.float().mean()) < 3 and float(images.float().std()) > 0.1


def test_epoch_order_and_augmentation_are_deterministic_for_a_seed(dataset):
    train, _ = dataset
    first, second, other_seed = (train_loaders(train, 2, seed)[1] for seed in (3, 3, 4))
    assert [run_epoch(first, e) for e in (0, 1)] == [run_epoch(second, e) for e in (0, 1)]
    assert run_epoch(other_seed, 0) != run_epoch(train_loaders(train, 2, 3)[1], 0)
    images_a, images_b = (next(iter(train_loaders(train, 2)[0]))[0] for _ in range(2))
    assert torch.equal(images_a, images_b)
    uninterrupted = train_loaders(train, 2)[0]
    for epoch in range(5):
        run_epoch(uninterrupted, epoch)
    resumed = train_loaders(train, 2)[0]  # starting at epoch 5, as a resumed run does
    assert run_epoch(resumed, 5) == run_epoch(uninterrupted, 5)


def test_check_data_finds_a_planted_corrupt_jpeg_and_the_file_list_excludes_it(tmp_path):
    root = str(tmp_path / "data")
    prepare_synthetic_imagenet(root, num_classes=2, train_per_class=4, val_per_class=2, typical_size=(64, 48),
                               workers=1)
    class_dir = os.path.join(root, "train", "n00000001")
    good = os.path.join(class_dir, sorted(os.listdir(class_dir))[0])
    with open(good, "rb") as fh:
        data = fh.read()
    broken = os.path.join(class_dir, "broken.JPEG")
    with open(broken, "wb") as fh:
        fh.write(data[: len(data) // 2])
    with open(os.path.join(class_dir, "notes.txt"), "w") as fh:
        fh.write("not an image\n")

    report = check_data(root, workers=2)
    train = report["splits"]["train"]
    assert [c["path"] for c in train["corrupt"]] == ["n00000001/broken.JPEG"]
    assert train["non_images"] == ["n00000001/notes.txt"]
    assert train["classes"] == {"n00000000": 4, "n00000001": 4}
    assert report["splits"]["val"]["corrupt"] == [] and problem_count(report) == 1
    assert "broken.JPEG" in format_report(report)

    with pytest.raises(UserError, match="broken.JPEG.*check-data") as caught:
        list(dali.create_dali_val_loader(scan_split(root, "train"), make_cfg(), 0, 1, 1, "cpu"))
    assert not caught.value.same_on_all_ranks

    filelist = str(tmp_path / "train.txt")
    assert write_filelist(report, "train", filelist) == 8
    clean = read_filelist(os.path.join(root, "train"), filelist)
    assert len(clean) == 8 and broken not in [p for p, _ in clean.samples]
    assert sorted(i for b in run_epoch(dali.create_dali_val_loader(clean, make_cfg(), 0, 1, 1, "cpu"), 0)
                  for i in b) == list(range(8))


@pytest.mark.parametrize("label_format,link", [("txt", True), ("csv", False)])
def test_flat_validation_folder_is_reorganised_into_classes(dataset, tmp_path, label_format, link):
    _, val = dataset
    flat = tmp_path / "flat"
    flat.mkdir()
    truth = {}
    for i, (path, label) in enumerate(val.samples[:6]):
        name = f"ILSVRC2012_val_{i + 1:08d}.JPEG"
        shutil.copy(path, flat / name)
        truth[name] = val.classes[label]
    labels_file = tmp_path / f"labels.{label_format}"
    if label_format == "csv":
        rows = [f"{os.path.splitext(n)[0]},{c} 1 2 30 40 {c} 5 6 20 20" for n, c in truth.items()]
        labels_file.write_text("ImageId,PredictionString\n" + "\n".join(rows) + "\n")
    else:
        labels_file.write_text("".join(f"{n} {c}\n" for n, c in truth.items()))

    out = tmp_path / "val"
    counts = reorganise_flat_val(str(flat), str(labels_file), str(out), link=link)
    assert counts == {"images": 6, "classes": len(set(truth.values()))}
    for name, cls in truth.items():
        placed = out / cls / name
        assert placed.is_symlink() == link
        assert placed.read_bytes() == (flat / name).read_bytes()
    with pytest.raises(UserError, match="is not empty: it holds"):
        reorganise_flat_val(str(flat), str(labels_file), str(out))


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_dali_gpu_without_a_gpu_is_one_clear_error(dataset):
    train, _ = dataset
    with pytest.raises(UserError, match="needs a CUDA GPU.*dali_cpu"):
        dali.create_dali_train_loader(train, make_cfg(), 0, 1, 1, "gpu")


def test_dali_gpu_for_a_rank_that_trains_on_the_cpu_is_one_line():
    """train.device=cpu with dali_gpu would decode on a GPU to copy each batch back; refused in the
    config, on any node. On a GPU node auto and cuda train on the GPU; on a CPU node the loader says no GPU."""
    from hybridtrain.config import load_config
    with pytest.raises(UserError, match=r"decodes on the GPU but train.device=cpu .*train.device=cuda.*dali_cpu"):
        load_config(None, ["data.backend=dali_gpu", "train.device=cpu"])
    for device in ("auto", "cuda"):
        assert load_config(None, ["data.backend=dali_gpu", f"train.device={device}"]).train.device == device
    if not torch.cuda.is_available():
        with pytest.raises(UserError, match="needs a CUDA GPU and none is visible"):
            dali.require_gpu_for_dali_gpu()


def test_the_epoch_boundary_probe_prints_a_row_per_world_size_and_epoch(dataset):
    import subprocess
    import sys
    train, _ = dataset
    proc = subprocess.run([sys.executable, "-m", "benchmarks.probes.dali_epoch_boundary", "--data",
                           os.path.dirname(train.root), "--samples", "400", "--ranks", "1,2", "--epochs", "2"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [line.split("|")[1:-1] for line in proc.stdout.splitlines() if line.startswith("| ") and "---" not in line]
    assert [(r[0].strip(), r[1].strip()) for r in rows[1:]] == [("1", "0"), ("1", "1"), ("2", "0"), ("2", "1")]
    assert all(float(r[2]) > 0 and float(r[3]) > 0 for r in rows[1:])


class StreamEvent:
    """Stands for a CUDA event recorded on torch's stream (this machine has no GPU): passed when the test says so."""

    def __init__(self):
        self.done = self.waited = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.done = self.waited = True


def test_a_shared_batch_is_held_until_torch_is_done_with_it(dataset):
    """A batch shared without a copy is DALI's memory, freed in DALI's order once torch lets go.
    The loader holds it until an event recorded after its consumer's work (when the batch after next is asked
    for: the step reads one ahead) has passed, and a pass's end waits once and lets everything go."""
    train, _ = dataset
    loader = train_loaders(train, 1)[0]
    events = []
    loader.in_flight = dali.InFlight(lambda: events.append(StreamEvent()) or events[-1])
    held = lambda: [t.data_ptr() for t in loader.in_flight.held()]  # noqa: E731
    batches = iter(loader)
    first = next(batches)[0]
    ptr0, pixels0 = first.data_ptr(), first.clone()
    del first  # the consumer let go; its (GPU) work on the batch may still be queued
    ptr1 = next(batches)[0].data_ptr()
    assert held() == [ptr0]  # the consumer asked for batch 1 and may still enqueue work on batch 0
    next(batches)  # batch 2 asked for: batch 0's work is enqueued, behind an event not yet passed
    assert held() == [ptr1, ptr0] and not events[-1].done
    assert torch.equal(loader.in_flight.held()[1], pixels0)
    events[-1].done = True  # the stream passed it
    next(batches)
    assert ptr0 not in held() and ptr1 in held()
    assert len(list(batches)) == len(loader) - 4
    assert held() == [] and events[-1].waited


def test_only_a_gpu_pipeline_holds_its_batches(dataset):
    train, _ = dataset
    spec = dali.graph_spec(make_cfg(), True, "gpu", torch.float16, False)
    assert isinstance(dali.DaliLoader(train, spec, 0, 1, BATCH, 3, 1, 2, device_id=0).in_flight, dali.InFlight)
    assert train_loaders(train, 1)[0].in_flight is None  # a CPU pipeline's consumer copies or reads on the host


@pytest.mark.parametrize("output,dtype", [("fp16", torch.float16), ("fp32", torch.float32)])
def test_crop_mirror_normalize_delivers_the_dtype_chosen(dataset, output, dtype):
    """dali_gpu's end of the graph (crop_mirror_normalize normalising to FP16 or FP32), run on a
    CPU pipeline, delivers the dtype chosen through the zero-copy path, normalised."""
    train, _ = dataset
    spec = dali.GraphSpec(True, "cpu", CROP, RESIZE, 0.35, True, output, False)
    images = next(iter(dali.DaliLoader(train, spec, 0, 1, BATCH, 3, 1, 2)))[0]
    assert images.dtype == dtype and images.shape == (BATCH, 3, CROP, CROP)
    assert -3 < float(images.float().mean()) < 3 and float(images.float().std()) > 0.1


@pytest.mark.parametrize("compute,delivered", [("fp16", torch.float16), ("bf16", torch.float32)])
def test_dali_delivers_the_autocast_dtype_where_it_has_that_type(compute, delivered):
    """Mixed precision with fp16 gets FP16 batches from DALI (the V100 recipe); with bf16 FP32,
    as DALI has no BF16 type (if it gains one, deliver BF16 and change this test)."""
    from nvidia.dali import types

    from hybridtrain.config import load_config
    from hybridtrain.data.loaders import delivered_dtype
    from hybridtrain.precision.policy import resolve_policy
    cfg = load_config(None, ["precision.mode=mixed", f"precision.compute_dtype={compute}"])
    assert delivered_dtype(resolve_policy(cfg.precision).input_dtype) == delivered
    assert not hasattr(types.DALIDataType, "BFLOAT16")

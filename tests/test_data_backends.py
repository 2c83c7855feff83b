"""The data backends under real Horovod ranks, the data tools on the command line, and bad data.

Sharding is recorded by tests/scripts/record_shards.py, which builds each rank's loaders through the same
factory as ``hybridtrain train`` and runs under horovodrun.
"""
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
    command,
    horovodrun,
    read_metrics,
    run,
    tiny_config,
    venv_without,
)

from hybridtrain.config import config_from_dict
from hybridtrain.data.loaders import create_loaders
from hybridtrain.distributed.topology import Topology

dali = pytest.importorskip("nvidia.dali", reason="NVIDIA DALI is not installed: ./install.sh")
BACKENDS = ["torchvision", "dali_cpu"]
BATCH = 14  # 240 train and 70 val images are multiples of neither 2 x 14 nor 3 x 14


def record_shards(config: str, out: str, world_size: int, epochs: int = 2) -> list[dict]:
    script = os.path.join(REPO, "tests", "scripts", "record_shards.py")
    proc = run([HOROVODRUN, "--gloo", "-np", str(world_size), "-H", f"localhost:{world_size}", sys.executable,
                script, config, out, str(epochs)])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(world_size)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("world_size", [2, 3])
def test_ranks_partition_each_epoch_reshuffle_and_count_val_once(backend, world_size, small_digits, tmp_path,
                                                                  write_config):
    cfg = write_config(tiny_config(small_digits, str(tmp_path / "run"), data={"backend": backend},
                                   train={"batch_size": BATCH}))
    ranks = record_shards(cfg, str(tmp_path / "shards"), world_size)
    n, dropped = ranks[0]["train_images"], ranks[0]["dropped"]
    assert 0 < dropped < world_size * BATCH
    subsets = []
    for epoch in range(2):
        steps = [len(r["train"][epoch]) for r in ranks]
        assert steps == [r["steps_per_epoch"] for r in ranks] and len(set(steps)) == 1, "unequal steps"
        seen = [i for r in ranks for batch in r["train"][epoch] for i in batch]
        assert len(seen) == len(set(seen)), f"a sample was used twice in epoch {epoch}"
        assert len(seen) == n - dropped and set(seen) <= set(range(n))
        subsets.append([{i for batch in r["train"][epoch] for i in batch} for r in ranks])
    assert all(a != b for a, b in zip(*subsets)), "a rank saw the same subset in both epochs"
    val = sorted(i for r in ranks for batch in r["val"] for i in batch)
    assert ranks[0]["val_images"] % (world_size * BATCH) != 0
    assert val == list(range(ranks[0]["val_images"])), "validation must count every image exactly once"


@pytest.mark.parametrize("backend", BACKENDS + ["synthetic"])
@pytest.mark.parametrize("channels_last", [False, True])
def test_batches_follow_the_configured_layout_and_dtype(backend, channels_last, small_digits):
    loading = {"in_process": True} if backend == "torchvision" else {"workers": 1}  # workers: the test below
    cfg = config_from_dict({"data": {"path": small_digits, "backend": backend, "crop_size": 32, "val_resize": 32,
                                     "channels_last": channels_last, "synthetic_images": 64, **loading},
                            "train": {"batch_size": 8}})
    data = create_loaders(cfg, Topology(0, 1, 0, 1))
    memory_format = torch.channels_last if channels_last else torch.contiguous_format
    for loader in (data.train, data.val):
        images, labels, indices = next(iter(loader))
        # torchvision and dali_cpu hand over uint8 pixels, normalised on the device (device_images); synthetic FP32
        assert images.shape == (8, 3, 32, 32)
        assert images.dtype == (torch.float32 if backend == "synthetic" else torch.uint8)
        assert images.is_contiguous(memory_format=memory_format)
        assert labels.dtype == torch.int64 and labels.max() < data.num_classes
    assert data.num_classes == (1000 if backend == "synthetic" else 10)


@pytest.mark.parametrize("channels_last", [False, True])
def test_uint8_batches_normalised_on_the_device_equal_the_float_transform(channels_last, small_digits):
    """#10: the torchvision backend's uint8 batch, normalised by device_images, is bitwise the batch that
    ToTensor + Normalize give, in the configured layout, in FP32 or cast to FP16."""
    from PIL import Image

    from hybridtrain.data.loaders import device_images
    from hybridtrain.data.presets import val_transform
    cfg = config_from_dict({"data": {"path": small_digits, "crop_size": 32, "val_resize": 32,
                                     "channels_last": channels_last, "in_process": True}, "train": {"batch_size": 8}})
    data = create_loaders(cfg, Topology(0, 1, 0, 1))
    pixels, _, indices = next(iter(data.val))
    float_transform = val_transform(32, 32)
    paths = [data.val.dataset.samples[i][0] for i in indices.tolist()]
    expected = torch.stack([float_transform(Image.open(p).convert("RGB")) for p in paths])
    memory_format = torch.channels_last if channels_last else torch.contiguous_format
    for dtype in (torch.float32, torch.float16):
        images = device_images(pixels, torch.device("cpu"), dtype)
        assert images.dtype == dtype and images.is_contiguous(memory_format=memory_format)
        assert torch.equal(images, expected.to(dtype))
    mean = torch.tensor([0.485, 0.456, 0.406]).view(3, 1, 1)
    std = torch.tensor([0.229, 0.224, 0.225]).view(3, 1, 1)
    assert torch.allclose(device_images(pixels, torch.device("cpu"), torch.float64),
                          ((pixels.double() / 255 - mean.double()) / std.double()), atol=1e-6)  # by hand


def test_in_process_loading_gives_the_workers_batches_and_leaves_the_training_rng_alone(small_digits):
    """data.in_process: every batch of an epoch equals the one a spawned worker makes, and the per-sample seeding
    of the augmentation does not touch the rank's own random state. The workers are started early, as the
    trainer starts them while it builds the model (Loaders.start): the epoch set afterwards
    still gets its own batches."""
    import multiprocessing

    def epoch_batches(**data):
        cfg = config_from_dict({"data": {"path": small_digits, "crop_size": 32, "val_resize": 32, **data},
                                "train": {"batch_size": 8}})
        loaders = create_loaders(cfg, Topology(0, 1, 0, 1))
        before = len(multiprocessing.active_children())
        torch.manual_seed(123)
        loaders.start()  # with workers, each loader's one base-seed draw happens here, else at every iter()
        assert len(multiprocessing.active_children()) - before == (0 if data.get("in_process") else 2)
        loader = loaders.train
        loader.batch_sampler.set_epoch(1)
        batches = list(loader)
        return batches, torch.rand(3)

    def after_draws(n: int) -> torch.Tensor:  # the state after n of the DataLoader's base-seed draws
        torch.manual_seed(123)
        for _ in range(n):
            torch.empty((), dtype=torch.int64).random_()
        return torch.rand(3)

    (in_process, rng_in_process), (workers, rng_workers) = epoch_batches(in_process=True), epoch_batches(workers=1)
    assert len(in_process) == len(workers) == 30
    for (a, la, ia), (b, lb, ib) in zip(in_process, workers):
        assert torch.equal(a, b) and torch.equal(la, lb) and torch.equal(ia, ib)
    # the rank's random state moves only by the DataLoaders' own base-seed draws: one per iter() in process, one
    # per started loader (train and val) with workers (240 unisolated augmentations would have moved it far more)
    assert torch.equal(rng_in_process, after_draws(1)) and torch.equal(rng_workers, after_draws(2))


def test_a_sigterm_to_a_starting_worker_does_not_kill_it(small_digits):
    """SLURM signals the whole process group. A worker still importing torch (before its init can ignore
    SIGTERM) must survive it: the rank handles preemption, and a dead worker would fail the rank."""
    import multiprocessing
    import signal
    cfg = config_from_dict({"data": {"path": small_digits, "backend": "torchvision", "crop_size": 32,
                                     "val_resize": 32, "workers": 2}, "train": {"batch_size": 8}})
    loader = create_loaders(cfg, Topology(0, 1, 0, 1)).train
    before = {p.pid for p in multiprocessing.active_children()}
    batches = iter(loader)
    workers = [p for p in multiprocessing.active_children() if p.pid not in before]
    assert len(workers) == 2
    for worker in workers:
        os.kill(worker.pid, signal.SIGTERM)  # long before the spawned worker has imported torch
    assert sum(len(indices) for _, _, indices in batches) == len(loader) * 8
    assert all(worker.is_alive() for worker in workers)


def test_the_worker_wrapper_replaces_a_planted_file_and_is_never_group_writable(tmp_path, monkeypatch):
    """The /bin/sh wrapper that starts loader workers lives at a predictable name: a file planted there, or one
    others may write, is replaced by the real wrapper before anything runs it."""
    from hybridtrain.data.workers import signal_proof_python
    monkeypatch.setenv("HOME", str(tmp_path))
    path = signal_proof_python()
    assert path.startswith(str(tmp_path)) and "trap '' TERM INT" in open(path).read()
    genuine = open(path).read()
    with open(path, "w") as fh:
        fh.write(f"#!/bin/sh\ntouch {tmp_path}/planted-code-ran\n")
    assert signal_proof_python() == path and open(path).read() == genuine
    os.chmod(path, 0o777)
    assert signal_proof_python() == path and os.stat(path).st_mode & 0o022 == 0
    assert not os.path.exists(tmp_path / "planted-code-ran")


SIGNALS_AFTER_A_LOADER = """
import multiprocessing, os, signal, sys
from hybridtrain.data.workers import spawn_context

def ignores_sigterm(_=None):
    mask = open(f"/proc/{os.getpid()}/status").read().split("SigIgn:")[1].split()[0]
    return bool(int(mask, 16) & 1 << (signal.SIGTERM - 1))

def report(queue):
    queue.put(ignores_sigterm())

if __name__ == "__main__":
    queue = spawn_context().SimpleQueue()
    worker = spawn_context().Process(target=report, args=(queue,))
    worker.start()
    print("loader worker ignores SIGTERM:", queue.get())
    worker.join()
    with multiprocessing.get_context("forkserver").Pool(2) as pool:   # its with-exit terminates the children
        print("pool child ignores SIGTERM:", any(pool.map(ignores_sigterm, range(4))))
    print("pool ended")
"""


def test_a_loader_worker_ignores_sigterm_but_a_later_process_pool_still_ends(tmp_path):
    """The wrapper that keeps a starting loader worker alive through a SIGTERM must not outlive that start:
    multiprocessing keeps one executable per process, and a forkserver pool started after a loader (check-data,
    prepare-data in the same process) would have children that ignore SIGTERM, so the pool's exit, which
    terminates them, would wait forever (the CI hang of test_check_data_finds_a_planted_corrupt_jpeg...)."""
    script = tmp_path / "signals.py"
    script.write_text(SIGNALS_AFTER_A_LOADER)
    proc = run([sys.executable, str(script)], timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "loader worker ignores SIGTERM: True" in proc.stdout
    assert "pool child ignores SIGTERM: False" in proc.stdout and "pool ended" in proc.stdout


def plant_truncated_jpeg(data: str) -> str:
    victim_dir = os.path.join(data, "train", "4")
    victim = os.path.join(victim_dir, sorted(os.listdir(victim_dir))[0])
    with open(victim, "rb") as fh:
        head = fh.read()[:200]
    with open(victim, "wb") as fh:
        fh.write(head)
    return victim


@pytest.mark.parametrize("backend", BACKENDS)
def test_corrupt_jpeg_is_refused_by_name_then_found_by_check_data_and_the_clean_list_trains(
        backend, small_digits, tmp_path, write_config):
    data = str(tmp_path / "data")
    shutil.copytree(small_digits, data)
    victim = plant_truncated_jpeg(data)
    run_dir = str(tmp_path / "run")
    sections = dict(data={"backend": backend}, train={"epochs": 1}, optim={"warmup_epochs": 0.5})
    refused = horovodrun(2, ["train", "--config", write_config(tiny_config(data, run_dir, **sections))], timeout=300)
    assert_one_error_line(refused, os.path.basename(victim), "check-data", "--write-filelist")

    lists, report = str(tmp_path / "lists"), str(tmp_path / "report.json")
    checked = run([HYBRIDTRAIN, "check-data", data, "--workers", "2", "--write-filelist", lists, "--report", report])
    assert checked.returncode == 1, checked.stderr  # problems found: non-zero for scripts
    assert f"corrupt   train/4/{os.path.basename(victim)}" in checked.stdout
    assert json.load(open(report))["splits"]["train"]["corrupt"][0]["path"] == f"4/{os.path.basename(victim)}"
    assert len(open(os.path.join(lists, "train.txt")).readlines()) == 240 - 1

    sections["data"]["file_lists"] = lists
    clean = horovodrun(2, ["train", "--config", write_config(tiny_config(data, run_dir, **sections), "clean.yaml")])
    assert clean.returncode == 0, clean.stdout[-3000:] + clean.stderr[-3000:]
    (record,) = read_metrics(run_dir)
    assert record["samples_seen"] == 239 - 239 % (2 * 16) and record["val_count"] == 70


def test_synthetic_backend_trains_on_two_ranks(tmp_path, write_config):
    run_dir = str(tmp_path / "run")
    cfg = tiny_config("unused", run_dir, data={"backend": "synthetic", "synthetic_images": 100},
                      model={"arch": "resnet18", "num_classes": 10}, train={"epochs": 1, "batch_size": 8},
                      optim={"warmup_epochs": 0.5})
    proc = horovodrun(2, ["train", "--config", write_config(cfg)], timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (record,) = read_metrics(run_dir)
    assert record["samples_seen"] == 6 * 2 * 8 and record["val_count"] == 2 * 8  # 100 // 16 = 6 global batches


def test_prepare_synthetic_imagenet_and_bench_data_print_a_table(tmp_path):
    data = str(tmp_path / "synthetic")
    made = run([HYBRIDTRAIN, "prepare-data", "synthetic-imagenet", "--out", data, "--classes", "3",
                "--train-per-class", "8", "--val-per-class", "2", "--size", "160x120", "--workers", "1"])
    assert made.returncode == 0 and "24 train / 6 val images" in made.stdout, made.stderr
    bench = run([*BENCHMARKS, "bench-data", "--backend", "torchvision", "--backend", "dali_cpu", "--data", data,
                 "--threads", "1", "--batch-size", "4", "--crop", "64", "--steps", "4", "--warmup", "1"])
    assert bench.returncode == 0, bench.stderr[-3000:]
    rows = [line.split("|")[1:-1] for line in bench.stdout.splitlines() if line.startswith("| ") and "backend" not in line]
    assert [r[0].strip() for r in rows if "---" not in r[0]] == ["torchvision", "dali_cpu"]
    assert all(float(r[4]) > 0 for r in rows if "---" not in r[0])


@pytest.mark.parametrize("argv, needle", [
    (["bench-data", "--backend", "dali_cpu", "--data", "/nonexistent"], "prepare-data synthetic-imagenet"),
    (["prepare-data", "synthetic-imagenet", "--out", "OUT", "--size", "big"], "WIDTHxHEIGHT"),
])
def test_data_tool_bad_input_is_one_line(argv, needle, tmp_path):
    argv = [str(tmp_path / "out") if a == "OUT" else a for a in argv]  # not a shared /tmp/x another run may hold
    assert_one_error_line(run(command(argv)), needle)
    assert not (tmp_path / "out").exists()


def test_file_lists_folder_without_lists_is_one_line(small_digits, tmp_path, write_config):
    cfg = write_config(tiny_config(small_digits, str(tmp_path / "run"), data={"file_lists": str(tmp_path)}))
    assert_one_error_line(run([HYBRIDTRAIN, "train", "--config", cfg]), "has no train.txt", "check-data")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_dali_gpu_without_a_gpu_is_one_line_under_horovodrun(small_digits, tmp_path, write_config):
    cfg = write_config(tiny_config(small_digits, str(tmp_path / "run"), data={"backend": "dali_gpu"}))
    assert_one_error_line(horovodrun(2, ["train", "--config", cfg], timeout=300), "needs a CUDA GPU", "dali_cpu")


@pytest.fixture(scope="module")
def venv_without_dali(tmp_path_factory):
    """A real environment without DALI (nothing is faked: ``import nvidia.dali`` genuinely fails there)."""
    import subprocess
    python = venv_without(tmp_path_factory.mktemp("nodali"), ["nvidia_dali*", "nvidia/dali"])
    assert subprocess.run([python, "-c", "import nvidia.dali"], capture_output=True).returncode != 0
    assert subprocess.run([python, "-c", "import torch, horovod.torch, hybridtrain"], capture_output=True).returncode == 0
    return python


@pytest.mark.parametrize("backend", ["dali_cpu", "dali_gpu"])
def test_dali_selected_but_not_installed_is_one_line(backend, venv_without_dali, small_digits, tmp_path, write_config):
    cfg = write_config(tiny_config(small_digits, str(tmp_path / "run"), data={"backend": backend}))
    proc = run([venv_without_dali, "-m", "hybridtrain.cli", "train", "--config", cfg])
    assert_one_error_line(proc, "needs NVIDIA DALI, which is not installed", "pip install nvidia-dali", "torchvision")

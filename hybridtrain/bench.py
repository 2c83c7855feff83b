"""``hybridtrain bench``: training-step throughput and peak memory of one model on synthetic data.

One process, no Horovod and no input pipeline: a fixed random batch already on the device, then the
trainer's own step (``training.train_step``: forward in the precision policy, FP32 loss, loss scaling,
SGD update). ``warmup`` steps are untimed (cudnn autotuning, allocator growth); the next ``steps`` are
timed, with the device synchronised before the clock stops.
"""
from __future__ import annotations

import time

import torch
from tqdm import tqdm

from .config import config_from_dict
from .distributed import cores_per_rank
from .errors import UserError
from .models import create_model
from .precision import check_hardware, create_scaler, peak_memory_mb, prepare_model, reset_peak_memory, resolve_policy
from .training import Precision, train_step


def bench_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_precision(arch: str, batch_size: int, image_size: int, mode: str, compute_dtype: str, steps: int,
                      warmup: int, channels_last: bool) -> dict:
    optim = "goyal" if mode == "fp16_pure" else "hybrid"
    cfg = config_from_dict({"precision": {"mode": mode, "compute_dtype": compute_dtype}, "optim": {"name": optim}})
    device = bench_device()
    policy = resolve_policy(cfg.precision)
    check_hardware(policy, device)
    model = prepare_model(create_model(arch, 1000, seed=0).to(device), policy)
    memory_format = torch.channels_last if channels_last else torch.contiguous_format
    model = model.to(memory_format=memory_format)
    images = torch.randn(batch_size, 3, image_size, image_size, device=device).to(policy.input_dtype)
    images = images.contiguous(memory_format=memory_format)
    labels = torch.randint(1000, (batch_size,), device=device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    precision = Precision(policy, create_scaler(cfg.precision, policy))
    label = mode if mode not in ("mixed",) else f"mixed-{compute_dtype}"
    for _ in tqdm(range(warmup), desc=f"{label} warmup", unit="step", leave=False):
        train_step(model, optimizer, precision, images, labels)
    synchronize(device)
    reset_peak_memory(device)
    start = time.perf_counter()
    for _ in tqdm(range(steps), desc=label, unit="step", leave=False):
        train_step(model, optimizer, precision, images, labels)
    synchronize(device)
    elapsed = time.perf_counter() - start
    return {"arch": arch, "precision": label, "batch_size": batch_size, "image_size": image_size,
            "channels_last": channels_last, "device": str(device), "images_per_sec": steps * batch_size / elapsed,
            "ms_per_step": 1000 * elapsed / steps, "peak_memory_mb": peak_memory_mb(device),
            "skipped_steps": precision.scaler.skipped_steps}


def bench(arch: str, batch_sizes: list[int], image_size: int, precisions: list[str], steps: int, warmup: int,
          channels_last: bool, threads: int) -> list[dict]:
    if min(batch_sizes + [image_size, steps]) < 1 or warmup < 0:
        raise UserError("--batch-size, --image-size and --steps must be >= 1 and --warmup >= 0")
    torch.set_num_threads(threads or cores_per_rank(1))
    if torch.cuda.is_available():
        torch.backends.cudnn.benchmark = True
    rows = []
    for batch in batch_sizes:
        for spec in precisions:
            mode, _, dtype = spec.partition("-")
            rows.append(measure_precision(arch, batch, image_size, mode, dtype or "fp16", steps, warmup, channels_last))
    return rows


def format_table(rows: list[dict]) -> str:
    lines = ["| arch | precision | batch | image | channels_last | device | images/s | ms/step | peak MiB | "
             "skipped |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {r['arch']} | {r['precision']} | {r['batch_size']} | {r['image_size']} | {r['channels_last']} | "
              f"{r['device']} | {r['images_per_sec']:.1f} | {r['ms_per_step']:.1f} | {r['peak_memory_mb']:.0f} | "
              f"{r['skipped_steps']} |" for r in rows]
    return "\n".join(lines)

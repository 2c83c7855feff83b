"""``python -m benchmarks bench``: the trainer's own training step on synthetic data, in one process (engines:
``--engine``).

Each row builds the recipe's model, optimizer (with its schedule applied every step, as in training),
precision policy and loss scaler, puts one random batch on the device (the ``synthetic`` backend), runs
``warmup`` untimed steps (cudnn autotuning, allocator growth), then times ``steps`` steps one by one with the
device synchronised, and reports img/s, median and p90 step time and peak memory. The step is the trainer's
(``step.build_train_step``): ``train.compile`` and ``train.cuda_graphs`` apply, and the row lists the
optimizations in effect. One more step runs under ``host_syncs.count_host_syncs``: the host syncs per step (1: the
skip decision on a non-finite gradient, which every rank must take together).

``--baseline`` also runs, in the same process and with the same batch, precision and layout, the plain loop
a PyTorch user would write: torchvision's ResNet, ``torch.optim.SGD`` (momentum, weight decay), autocast with
a ``GradScaler`` for FP16. The ratio trainer ÷ baseline is the trainer's overhead (or gain). The two loops'
timed steps alternate (trainer, baseline, trainer, ...), so a drift in the machine's speed (a shared CPU, a GPU's
clocks) falls on both alike; each loop's peak memory is taken over its own warmup, the baseline's above what the
trainer holds. ``--engine horovod`` (or ``--horovod``) adds
the row ``train/horovod``: the whole step as ``train`` runs it, on one rank under horovodrun (Horovod's
DistributedOptimizer, the compression, the scaler and the schedule), whose ratio to the baseline is the honest
one; ``--engine torch`` the same on one rank of DDP under torchrun. ``--profile DIR`` writes a torch profiler
trace of a few trainer steps. ``--phase sgd`` times the hybrid
optimizer's second phase (SGD + LARS; the schedule starts at epoch T's first step) instead of its AdaBound warmup.
"""
from __future__ import annotations

import contextlib
import gc
import os
import statistics
import sys
import tempfile
import time

import torch
from tqdm import tqdm

from benchmarks.bench_sets import row_sets
from benchmarks.host_syncs import count_host_syncs
from benchmarks.scaling import launch, measured
from hybridtrain.config import load_config
from hybridtrain.data.loaders import SYNTHETIC_CLASSES
from hybridtrain.distributed import collectives as distributed
from hybridtrain.distributed.topology import cores_per_rank
from hybridtrain.engine.ema import create_ema
from hybridtrain.engine.records import memory_figures, reset_peak_memory
from hybridtrain.engine.step import build_train_step
from hybridtrain.errors import UserError
from hybridtrain.hardware.checks import check_machine
from hybridtrain.models import model_from_config
from hybridtrain.optim import apply_schedule, create_optimizer, optimizer_spec
from hybridtrain.optim.schedules import HYBRID_PHASES, hybrid_phase_start
from hybridtrain.precision.policy import prepare_model, resolve_policy, set_fp32_math
from hybridtrain.precision.scaler import create_precision
from hybridtrain.reports import markdown_table

STEPS_PER_EPOCH = 100  # what the optimizer's schedule assumes; the bench runs inside the first epoch(s)


def check_phase(cfg, phase: str) -> None:
    """--phase sgd needs the hybrid optimizer (the others have one phase)."""
    if phase != HYBRID_PHASES[0] and phase not in optimizer_spec(cfg.optim).phases:
        raise UserError(f"--phase sgd times the hybrid optimizer's second phase, and optim.name={cfg.optim.name} has "
                        f"one phase: drop --phase, or --set optim.name=hybrid")


def optimizer_label(cfg, phase: str | None) -> str:
    """The optimizer's name, with what the phase its param groups were in after the timed steps runs (an optimizer
    with phases: hybrid/sgd+lars)."""
    phases = optimizer_spec(cfg.optim).phases
    return f"{cfg.optim.name}/{phases[phase]}" if phase in phases else cfg.optim.name


def bench_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


@contextlib.contextmanager
def job_of_one():
    """A job of this process alone on the torch engine (no launcher, no port), for the trainer's step: its optimizer
    gets the engine's step contract, and a collective needs an engine. The row's model is not in DDP, so that
    optimizer's zero_grad sets the gradients to None, as the plain loop's does (zeroed in place, as DDP's bucket
    views need, they cost the row a pass over the gradients and an add instead of a steal in every backward).
    Its group is Gloo's on the CPU (the step calls no collective, and a GPU keeps the memory an NCCL
    communicator would take), and costs nothing per step; the threads are left as they are."""
    distributed.init(torch.get_num_threads(), device="cpu", engine="torch")
    try:
        yield
    finally:
        distributed.shutdown()


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def warm_up(step, warmup: int, device: torch.device, label: str, held: dict | None = None) -> dict:
    """``warmup`` untimed steps (at least one); the peak memory over them, less ``held`` (`memory_figures` taken
    before this loop was built: what other loops hold)."""
    reset_peak_memory(device)
    for _ in tqdm(range(max(1, warmup)), desc=f"{label} warmup", unit="step", leave=False, disable=None):
        step()
    synchronize(device)
    figures = memory_figures(device)
    for key in ("peak_memory_mb", "peak_memory_reserved_mb"):
        if held and figures[key] is not None and held[key] is not None:
            figures[key] -= held[key]
    return figures


def alternated_steps(loops: dict, steps: int, device: torch.device) -> dict[str, list[float]]:
    """Seconds per step of each loop in ``loops`` (label -> step), their steps taken in turn."""
    times = {label: [] for label in loops}
    for _ in tqdm(range(steps), desc=" + ".join(loops), unit="step", leave=False, disable=None):
        for label, step in loops.items():
            start = time.perf_counter()
            step()
            synchronize(device)
            times[label].append(time.perf_counter() - start)
    return times


def timed_steps(step, steps: int, warmup: int, device: torch.device, label: str) -> list[float]:
    """Seconds per step after ``warmup`` untimed ones."""
    for _ in tqdm(range(warmup), desc=f"{label} warmup", unit="step", leave=False, disable=None):
        step()
    synchronize(device)
    reset_peak_memory(device)
    return alternated_steps({label: step}, steps, device)[label]


def optimizations(cfg, label: str) -> list[str]:
    """The speed-ups in effect: the layout for both loops, compile and CUDA graphs for the trainer's."""
    names = ["channels_last"] if cfg.data.channels_last else []
    if label != "baseline":
        names += [name for name, on in (("compile", cfg.train.compile), ("cuda_graphs", cfg.train.cuda_graphs),
                                        ("fused_optimizer", cfg.optim.fused), ("ema", cfg.train.ema_decay > 0)) if on]
    return names


def summarise(label: str, cfg, times: list[float], device: torch.device, skipped: int = 0,
              host_syncs: int | None = None, memory: dict | None = None, phase: str | None = None) -> dict:
    b = cfg.train.batch_size
    ordered = sorted(times)
    return {"loop": label, "arch": cfg.model.arch, "precision": cfg.precision.mode + (
                f"-{cfg.precision.compute_dtype}" if cfg.precision.mode == "mixed" else ""),
            "optimizer": optimizer_label(cfg, phase) if label != "baseline" else "sgd", "batch_size": b,
            "image_size": cfg.data.crop_size, "channels_last": cfg.data.channels_last,
            "optimizations": optimizations(cfg, label), "device": str(device),
            "images_per_sec": b * len(times) / sum(times), "median_ms": 1000 * statistics.median(times),
            "p90_ms": 1000 * ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))],
            **(memory or memory_figures(device)), "skipped_steps": skipped, "host_syncs_per_step": host_syncs}


def synthetic_batch(cfg, device: torch.device, dtype: torch.dtype, classes: int):
    # drawn where it is used: max-batch's batches of thousands took a CPU thread tens of seconds each
    generator = torch.Generator(device).manual_seed(cfg.seed)
    size, b = cfg.data.crop_size, cfg.train.batch_size
    memory_format = torch.channels_last if cfg.data.channels_last else torch.contiguous_format
    images = torch.randn(b, 3, size, size, generator=generator, device=device).to(dtype)
    labels = torch.randint(classes, (b,), generator=generator, device=device)
    return images.contiguous(memory_format=memory_format), labels


def synthetic_classes(cfg) -> int:
    """The classes of the bench's synthetic batch: model.num_classes, or the synthetic backend's 1000 (0 means
    "as many as the dataset has", and a bench has no dataset)."""
    return cfg.model.num_classes or SYNTHETIC_CLASSES


def trainer_loop(cfg, phase: str = "adabound"):
    """The trainer's step on one synthetic batch, the schedule applied each step from ``phase``'s first one:
    (step, device, precision, the optimizer bundle)."""
    device = bench_device()
    precision = create_precision(cfg.precision)
    policy = precision.policy
    check_machine(cfg, policy, device)
    classes = synthetic_classes(cfg)
    model = model_from_config(cfg.model, classes, seed=cfg.seed).to(device)
    model = prepare_model(model, policy)
    if cfg.data.channels_last:
        model = model.to(memory_format=torch.channels_last)
    bundle = create_optimizer(model, cfg, 1, STEPS_PER_EPOCH)
    bundle.optimizer = distributed.wrap_optimizer(bundle.optimizer, model, cfg)  # the step contract (job_of_one's)
    images, labels = synthetic_batch(cfg, device, policy.input_dtype, classes)
    # train.ema_decay > 0: the weights' EMA updated after every applied step, as the trainer does (its cost is timed)
    run_step = build_train_step(model, cfg, precision, (images, labels), ema=create_ema(model, cfg.train))
    counter = {"step": hybrid_phase_start(phase, cfg.optim.adabound_epochs, STEPS_PER_EPOCH)}

    def step(clock=None):  # clock: the time breakdown's (breakdown.StepClock), as the epoch passes it
        apply_schedule(bundle.optimizer, bundle.schedule, counter["step"])
        run_step(bundle.optimizer, precision, [(images, labels, 1.0)], clock=clock)
        counter["step"] += 1
    return step, device, precision, bundle


def trainer_summary(cfg, loop, times: list[float], profile_dir: str | None, memory: dict | None = None) -> dict:
    step, device, precision, bundle = loop
    phase = bundle.optimizer.param_groups[0].get("phase")  # the timed steps': the watched one may go into the next
    host_syncs = count_host_syncs(step, device)  # one more step, watched
    if profile_dir:
        write_profile(step, device, profile_dir)
    return summarise("trainer", cfg, times, device, precision.scaler.skipped_steps, host_syncs, memory, phase)


def trainer_row(cfg, steps: int, warmup: int, profile_dir: str | None, phase: str = "adabound") -> dict:
    loop = trainer_loop(cfg, phase)
    step, device, _, _ = loop
    times = timed_steps(step, steps, warmup, device, "trainer")
    return trainer_summary(cfg, loop, times, profile_dir)


def trainer_and_baseline_rows(cfg, steps: int, warmup: int, profile_dir: str | None, phase: str) -> tuple[dict, dict]:
    """The trainer's row and the plain loop's, their timed steps alternated (see the module notes)."""
    loop = trainer_loop(cfg, phase)
    trainer_step, device, _, _ = loop
    trainer_memory = warm_up(trainer_step, warmup, device, "trainer")
    held = memory_figures(device)
    baseline_step = baseline_loop(cfg)
    baseline_memory = warm_up(baseline_step, warmup, device, "baseline", held)
    times = alternated_steps({"trainer": trainer_step, "baseline": baseline_step}, steps, device)
    return (trainer_summary(cfg, loop, times["trainer"], profile_dir, trainer_memory),
            summarise("baseline", cfg, times["baseline"], device, memory=baseline_memory))


def release_device_memory() -> None:
    """Give the GPU memory the rows before cached back to the driver, so the engine row's child process (another
    ResNet-50 of the same batch) has it: about 25 GB stay reserved in torch's allocator after a row at b=256, and a
    40 GB GPU cannot hold both. Reference cycles first (the rows' models, optimizers and graphs),
    then compiled code that may hold parameters, then the allocator's free blocks."""
    gc.collect()
    if "torch._dynamo" in sys.modules:  # imported only where something was compiled
        torch._dynamo.reset()
    if torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def engine_row(config: str | None, sets: list[str], cfg, steps: int, warmup: int, threads: int,
               phase: str, engine: str) -> dict:
    """The whole step as ``train`` runs it, on one rank of ``engine`` (under horovodrun or torchrun): the trainer
    built by ``build_trainer`` with the engine's step contract (Horovod's DistributedOptimizer, or DDP), the
    all-reduce compression, the loss scaler and the schedule (``scale``'s worker). Its steps run back to back, so
    it gives the mean step time, not the median. The row's loop is ``train/ENGINE``."""
    with tempfile.TemporaryDirectory(prefix="hybridtrain-bench-") as out:
        record = launch(config, [*sets, f"train.threads={threads}"], 1, cfg.distributed.compression, steps, warmup, out,
                        phase, timeline=False, engine=engine)  # Horovod's timeline would cost the step time
    row = summarise(f"train/{engine}", cfg, [record["step_time_s"]] * steps, torch.device(record["device"]),
                    phase=record.get("phase"))
    row.update(median_ms=None, p90_ms=None, mean_ms=1000 * record["step_time_s"], peak_memory_mb=None,
               peak_memory_reserved_mb=None, images_per_sec=record["images_per_sec"], skipped_steps=None)
    return row


def baseline_loop(cfg):
    """The plain loop's step: torchvision ResNet, SGD, autocast + GradScaler, the same batch and precision."""
    import torchvision
    device = bench_device()
    policy = resolve_policy(cfg.precision)
    classes = synthetic_classes(cfg)
    model = getattr(torchvision.models, cfg.model.arch)(num_classes=classes).to(device, policy.param_dtype)
    if cfg.data.channels_last:
        model = model.to(memory_format=torch.channels_last)
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.optim.lr, momentum=cfg.optim.momentum,
                                weight_decay=cfg.optim.weight_decay)
    autocast = policy.autocast_dtype or next(iter(policy.stage_dtypes.values()), None)
    # GradScaler cannot unscale FP16 parameters' gradients: the fp16_pure baseline runs unscaled
    scaler = torch.amp.GradScaler(device.type, enabled=policy.loss_scaling != "none" and
                                  policy.param_dtype == torch.float32)
    images, labels = synthetic_batch(cfg, device, policy.input_dtype, classes)

    def step():
        with torch.autocast(device.type, dtype=autocast or torch.float32, enabled=autocast is not None):
            loss = torch.nn.functional.cross_entropy(model(images).float(), labels)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
    return step


def write_profile(step, device: torch.device, out_dir: str, steps: int = 3) -> None:
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    os.makedirs(out_dir, exist_ok=True)
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        synchronize(device)
    prof.export_chrome_trace(os.path.join(out_dir, "trace.json"))


def bench(config: str | None, overrides: list[str], precisions: list[str], batch_sizes: list[int], steps: int,
          warmup: int, baseline: bool, profile_dir: str | None, threads: int, engines: list[str] = (),
          phase: str = "adabound") -> list[dict]:
    bad = [b for b in batch_sizes if b is None or b < 1]
    if bad:  # never the recipe's batch in its place: an empty list, not a 0, means "the recipe's"
        raise UserError(f"--batch-size must be >= 1, got {bad[0]}: e.g. --batch-size 64")
    threads = threads or cores_per_rank(1)
    torch.set_num_threads(threads)
    if torch.cuda.is_available():
        torch.backends.cudnn.benchmark = True
    rows = []
    with job_of_one():
        for batch in batch_sizes if batch_sizes else [None]:  # None: the recipe's train.batch_size
            for spec in precisions or [None]:
                sets = row_sets(overrides, spec, batch)
                cfg = load_config(config, sets)
                set_fp32_math(cfg.precision.tf32)  # both loops alike
                check_phase(cfg, phase)  # a phase the recipe lacks: one line before any work
                if baseline:
                    trainer, plain = trainer_and_baseline_rows(cfg, steps, warmup, profile_dir, phase)
                else:
                    trainer = trainer_row(cfg, steps, warmup, profile_dir, phase)
                timed = [trainer]
                if engines:
                    release_device_memory()  # the child process needs the GPU memory these rows cached
                failed = []
                for engine in engines:  # a failed launch keeps the rows measured: its line goes with them
                    try:
                        timed.append(engine_row(config, sets, cfg, steps, warmup, threads, phase, engine))
                    except UserError as exc:
                        failed.append({"loop": f"train/{engine}", "error": str(exc)})
                rows += timed
                if baseline:
                    rows.append(plain)
                    for row in timed:
                        row["over_baseline"] = row["images_per_sec"] / rows[-1]["images_per_sec"]
                    rows[-1]["trainer_over_baseline"] = timed[0]["over_baseline"]
                rows += failed
    return rows


def format_table(rows: list[dict]) -> str:
    header = ["loop", "arch", "optimizer", "precision", "batch", "image", "optimizations", "device", "images/s",
              "median ms", "p90 ms", "mean ms", "peak MiB", "reserved MiB", "skipped", "host syncs/step",
              "÷ baseline"]
    return markdown_table(header, [[r["loop"], r["arch"], r["optimizer"], r["precision"], r["batch_size"],
                                     r["image_size"], ", ".join(r["optimizations"]) or "none", r["device"],
                                     f"{r['images_per_sec']:.1f}", measured(r["median_ms"], 1),
                                     measured(r["p90_ms"], 1), measured(r.get("mean_ms"), 1),
                                     measured(r["peak_memory_mb"], 0), measured(r["peak_memory_reserved_mb"], 0),
                                     "-" if r["skipped_steps"] is None else r["skipped_steps"],
                                     "" if r["host_syncs_per_step"] is None else r["host_syncs_per_step"],
                                     f"{r['over_baseline']:.3f}" if "over_baseline" in r else ""]
                                    for r in rows])

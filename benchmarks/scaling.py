"""``python -m benchmarks scale``: the synthetic-data training benchmark at several rank counts, on either engine.

Each (engine, ranks, compression) row launches ``horovodrun --gloo -np N`` with Horovod's timeline on (or
``torchrun --nproc-per-node=N`` for the torch engine, which has no timeline), and every
rank runs ``warmup`` then ``steps`` of the trainer's own training steps (``engine.trainer.build_trainer``: the
config's model, layout, optimizer and schedule, precision, compile and CUDA graphs) on the synthetic backend's
fixed batch, one torch thread per rank (so 1 and 2 ranks on a 2-core machine compare fairly). From
each row: global img/s, efficiency against the 1-rank row of the same compression (the paper's
actual / (N x S1)), and from the timeline the bytes all-reduced per step (each ALLREDUCE's dtype x shape)
and the time per step during which an all-reduce was running (the union of the ALLREDUCE intervals, so
fused tensors are not counted twice). Output: a table, ``scale.json`` (``report`` reads S1 from it) and
``scale.png``.
"""
from __future__ import annotations

import json
import os
import sys
import time

import numpy as np

from hybridtrain.distributed.launcher import launch_command
from hybridtrain.errors import UserError
from hybridtrain.files import write_json_atomically
from hybridtrain.reports import markdown_table
from tools.jobs import run_job

DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}


# ----------------------------------------------------------------------------- one rank (under horovodrun)

def measured_config(config: str, overrides: list[str], compression: str | None = None):
    """The recipe as scale measures it: the trainer's own step (optimizer, schedule, layout, precision, compile,
    graphs, accumulation) on the synthetic backend's fixed batch, one torch thread per rank unless ``overrides`` set
    train.threads; a key the synthetic
    step cannot honour (e.g. bn.per_rank_batch=random) is refused here in one line."""
    from hybridtrain.config import load_config
    sets = ["train.threads=1"] + list(overrides) + ["data.backend=synthetic", "data.file_lists=",
                                                    "data.in_process=false"]
    return load_config(config, sets + ([f"distributed.compression={compression}"] if compression else []),
                       for_command="scale")


def worker(config: str, overrides: list[str], compression: str, steps: int, warmup: int, out: str,
           phase: str) -> None:
    from hybridtrain.distributed import collectives as distributed
    from hybridtrain.engine.step import train_step
    from hybridtrain.engine.trainer import build_trainer
    from hybridtrain.optim import apply_schedule
    from hybridtrain.optim.schedules import hybrid_phase_start

    cfg = measured_config(config, overrides, compression)
    topo = distributed.init(1, cfg, device=cfg.train.device, engine=cfg.distributed.engine)
    t = build_trainer(cfg, topo)
    distributed.broadcast_model(t.model)
    images, labels, _ = next(iter(t.data.train))
    k = cfg.train.accumulation_steps
    micro_batches = [(images, labels, 1.0 / k)] * k  # k passes per step, as train runs them (w = n / (b k))
    start_step = hybrid_phase_start(phase, cfg.optim.adabound_epochs, t.updates)  # SGD + LARS: from epoch T

    def scheduled_step(step: int) -> None:
        apply_schedule(t.bundle.optimizer, t.bundle.schedule, start_step + step)
        train_step(t.step, t.bundle.optimizer, t.precision, micro_batches)
    for step in range(warmup):
        scheduled_step(step)
    distributed.barrier()  # start the clock together
    start = time.perf_counter()
    for step in range(warmup, warmup + steps):
        scheduled_step(step)
    distributed.barrier()
    elapsed = time.perf_counter() - start
    if topo.is_root:
        b = cfg.train.batch_size * k
        record = {"world_size": topo.size, "engine": topo.engine, "compression": compression, "steps": steps,
                  "warmup": warmup,
                  "batch_per_rank": b, "accumulation_steps": k, "step_time_s": elapsed / steps,
                  "images_per_sec": topo.size * b * steps / elapsed,
                  "parameters": sum(p.numel() for p in t.model.parameters()), "optimizer": cfg.optim.name,
                  "phase": t.bundle.optimizer.param_groups[0].get("phase"),
                  "channels_last": cfg.data.channels_last, "precision": cfg.precision.mode,
                  "fusion_threshold_mb": cfg.horovod.fusion_threshold_mb, "cycle_time_ms": cfg.horovod.cycle_time_ms,
                  "autotune": cfg.horovod.autotune, "device": str(topo.device)}
        write_json_atomically(out, record)
    distributed.shutdown()


# ----------------------------------------------------------------------------- the timeline

def read_timeline(path: str) -> list[dict]:
    """Horovod's Chrome-trace events; a timeline cut off before its closing bracket is accepted."""
    if not os.path.isfile(path) or os.path.getsize(path) == 0:
        raise UserError(f"Horovod wrote no timeline at {path}: check that horovodrun accepts --timeline-filename "
                        f"and that the directory is writable")
    text = open(path).read().strip().rstrip(",")
    if not text.endswith("]"):
        text += "]"
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise UserError(f"Horovod's timeline {path} is not valid JSON ({exc.msg} at line {exc.lineno}): "
                        f"rerun python -m benchmarks scale") from None


def allreduce_intervals(events: list[dict]) -> list[tuple[float, float, int]]:
    """(start us, end us, bytes) of every top-level ALLREDUCE activity, from its B/E pair per tensor."""
    depth, start, found = {}, {}, []
    for e in events:
        pid, phase = e.get("pid"), e.get("ph")
        if phase == "B":
            if depth.get(pid, 0) == 0 and e.get("name") == "ALLREDUCE":
                start[pid] = e["ts"]
            depth[pid] = depth.get(pid, 0) + 1
        elif phase == "E" and depth.get(pid, 0) > 0:
            depth[pid] -= 1
            if depth[pid] == 0 and pid in start:
                args = e.get("args", {})
                shape = json.loads(args.get("shape", "[]")) if args.get("shape") else []
                found.append((start.pop(pid), e["ts"], int(np.prod(shape)) * DTYPE_BYTES.get(args.get("dtype"), 0)))
    return found


def busy_time_us(intervals: list[tuple[float, float, int]]) -> float:
    """Length of the union of the intervals."""
    total, end = 0.0, float("-inf")
    for s, e, _ in sorted(intervals):
        if e > end:
            total += e - max(s, end)
            end = e
    return total


# ----------------------------------------------------------------------------- the driver

def parse_compressions(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    if not names or any(n not in ("fp16", "none") for n in names):
        raise UserError(f"--compression must list fp16 and/or none, got '{text}'")
    return names


def available_slots(device: str = "cpu", gpus: int = 0) -> tuple[int, str]:
    """(ranks this node holds, what each needs): one GPU per rank when the ranks train on GPUs (train.device cuda,
    or auto where a GPU is visible: ranks cannot share a GPU), else one core per rank."""
    if device == "cuda" or (device == "auto" and gpus > 0):
        return gpus, "GPU"
    return (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1), "core"


def visible_gpus() -> int:
    import torch
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def launch(config: str | None, overrides: list[str], n: int, compression: str, steps: int, warmup: int, out: str,
           phase: str = "adabound", timeline: bool = True, engine: str = "horovod") -> dict:
    """One ``scale`` row: ``n`` ranks under ``engine``'s launcher, their record, and from Horovod's timeline
    (``timeline``; it costs each step time: about 14 ms of a 130 ms CPU step at one rank) the all-reduce bytes
    and time. The torch engine has no timeline: its rows leave those two figures out. ``config`` None (bench
    without --config): the worker gets "" and loads the built-in defaults, as load_config does for None."""
    timeline = timeline and engine == "horovod"
    overrides = [*overrides, f"distributed.engine={engine}"]
    tag = f"{engine}-np{n}-{compression}"
    record_path, timeline_path = os.path.join(out, f"{tag}.json"), os.path.join(out, f"{tag}.timeline.json")
    for stale in (record_path, timeline_path):
        if os.path.exists(stale):
            os.remove(stale)
    cmd = launch_command(engine, n, [sys.executable, "-m", "benchmarks.scaling", config or "", compression,
                                     str(steps), str(warmup), record_path, phase, *overrides],
                         launcher_args=("--timeline-filename", timeline_path) if timeline else ())
    failure = f"scale row {engine} np={n} compression={compression} failed"
    run_job(cmd, failure)
    if not os.path.isfile(record_path):
        raise UserError(f"{failure}: it wrote no {record_path}", same_on_all_ranks=False)
    with open(record_path) as fh:
        record = json.load(fh)
    if n > 1 and not timeline:  # not measured
        record["allreduce_bytes_per_step"] = record["allreduce_time_per_step_s"] = None
        return record
    intervals = allreduce_intervals(read_timeline(timeline_path)) if n > 1 else []
    total_steps = steps + warmup
    record["allreduce_bytes_per_step"] = sum(b for *_, b in intervals) / total_steps if n > 1 else 0.0
    record["allreduce_time_per_step_s"] = busy_time_us(intervals) / 1e6 / total_steps if n > 1 else 0.0
    return record


def run_scale(config: str, overrides: list[str], counts: list[int], compressions: list[str], steps: int,
              warmup: int, out: str, oversubscribe: bool, engines: tuple[str, ...]) -> list[dict]:
    for compression in compressions:  # a bad recipe, or one the synthetic step cannot honour, fails before any launch
        measured_config(config, overrides, compression)
    device = measured_config(config, overrides).train.device
    slots, unit = available_slots(device, visible_gpus() if device != "cpu" else 0)
    if counts[-1] > slots and not (oversubscribe and unit == "core"):
        share = (" (or --oversubscribe, which shares cores and so measures contention, not scaling)"
                 if unit == "core" else " (two ranks cannot share a GPU)")
        raise UserError(f"--np {counts[-1]} needs {counts[-1]} slots (one {unit} per rank) but this machine has "
                        f"{slots}: use --np up to {slots}{share}")
    if 1 not in counts:
        counts = [1] + counts  # efficiency is measured against the 1-rank row
    os.makedirs(out, exist_ok=True)
    rows = []
    for engine, compression in ((e, c) for e in engines for c in compressions):
        single = None
        for n in counts:
            record = launch(config, overrides, n, compression, steps, warmup, out, engine=engine)
            single = single or record["images_per_sec"]
            record["ideal_images_per_sec"] = n * single
            record["efficiency"] = record["images_per_sec"] / (n * single)  # actual / (N * S1)
            record["oversubscribed"] = n > slots
            rows.append(record)
    write_json_atomically(os.path.join(out, "scale.json"), {"config": config, "overrides": overrides, "rows": rows})
    plot_scale(rows, os.path.join(out, "scale.png"))
    return rows


def measured(value: float | None, digits: int, scale: float = 1.0) -> str:
    """``scale`` x a figure, with ``digits`` decimals; '-' where the row has none (scale's torch-engine rows have no
    timeline; bench's engine rows no median, its trainer rows no mean)."""
    return "-" if value is None else f"{scale * value:.{digits}f}"


def format_table(rows: list[dict]) -> str:
    header = ["engine", "N", "compression", "img/s", "ideal img/s", "efficiency", "step ms", "all-reduce ms/step",
              "MB all-reduced/step"]
    return markdown_table(header, [[r.get("engine", "horovod"), r["world_size"], r["compression"],
                                    f"{r['images_per_sec']:.1f}", f"{r['ideal_images_per_sec']:.1f}",
                                    f"{100 * r['efficiency']:.1f}%", f"{1000 * r['step_time_s']:.1f}",
                                    measured(r["allreduce_time_per_step_s"], 1, 1000),
                                    measured(r["allreduce_bytes_per_step"], 2, 1e-6)] for r in rows])


def plot_scale(rows: list[dict], path: str) -> str:
    from hybridtrain.files import figure, save_figure
    fig = figure(10, 4)
    speed_ax, eff_ax = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    for engine, compression in sorted({(r.get("engine", "horovod"), r["compression"]) for r in rows}):
        mine = [r for r in rows if (r.get("engine", "horovod"), r["compression"]) == (engine, compression)]
        label = compression if len({r.get("engine", "horovod") for r in rows}) == 1 else f"{engine} {compression}"
        n = [r["world_size"] for r in mine]
        speed_ax.plot(n, [r["images_per_sec"] for r in mine], marker="o", label=label)
        speed_ax.plot(n, [r["ideal_images_per_sec"] for r in mine], linestyle=":", label=f"{label} ideal")
        eff_ax.plot(n, [100 * r["efficiency"] for r in mine], marker="o", label=label)
    speed_ax.set(xlabel="ranks", ylabel="images/s", title="throughput")
    eff_ax.set(xlabel="ranks", ylabel="scaling efficiency (%)", title="actual / (N x S1)")
    speed_ax.legend(), eff_ax.legend()
    return save_figure(fig, path)


# one rank of a row: python -m benchmarks.scaling CONFIG COMPRESSION STEPS WARMUP OUT [SETS]
if __name__ == "__main__":
    from hybridtrain.launched_by import run_guarded
    sys.exit(run_guarded(lambda: worker(sys.argv[1], sys.argv[7:], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]),
                                        sys.argv[5], sys.argv[6])))

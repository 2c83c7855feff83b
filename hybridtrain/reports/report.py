"""The paper's report for a run directory: per-epoch log lines, ``report.md``/``report.json``, PNGs, the
end-of-run summary table, and the side-by-side comparison of several runs (Tables 3.8-3.10).

Headline (Lu et al. 2020, §1 and §3.2.2): the convergence epoch (first epoch at the top-1 target), the actual
training time to the end of that epoch (with and without evaluation), and the actual average single-GPU
training time = actual training time x N. S1, the single-GPU speed, comes from ``--single-gpu-speed``, from
a ``scale.json`` that ``python -m benchmarks scale`` left in the run directory, or from the run itself when it had one
rank; the report says which, and leaves the efficiency blank when it has none.
"""
from __future__ import annotations

import json
import math
import os

import yaml

from hybridtrain.engine.breakdown import PARTS
from hybridtrain.engine.metrics_file import RECORD_FIGURES, read_metrics
from hybridtrain.errors import UserError
from hybridtrain.files import atomic_path, figure, save_figure
from hybridtrain.reports import markdown_table
from hybridtrain.reports import paper_metrics as metrics
from hybridtrain.reports.links import links_markdown, read_probe
from hybridtrain.reports.time_breakdown import breakdown_figures, breakdown_markdown, plot_breakdown, summary_rows

# ----------------------------------------------------------------------------- reading a run

def load_run(run_dir: str) -> tuple[dict, list[dict]]:
    """The resolved config and the per-epoch records of a run directory."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        raise UserError(f"{run_dir} has no metrics.jsonl: give the run_dir of a 'hybridtrain train' run")
    history = checked_records(path, read_metrics(path))
    if not history:
        raise UserError(f"{path} has no complete record: the run finished no epoch yet")
    return read_run_config(run_dir), history


# the figures of a record beyond RECORD_FIGURES that the report reads
COUNTED_FIGURES = ("world_size", "warmup_samples", "warmup_time_s")


def checked_records(path: str, records: list[dict]) -> list[dict]:
    """The records with each figure a number: one the record lacks (older versions) or holds as null (a record
    edited by hand or by another tool) is NaN, reported as unknown ('-'). One line for an epoch that is not a count,
    a val_top1 or figure that is not a number (world_size and the warmup figures not null either), and an epoch that
    does not follow the one before: the same epoch twice is two runs' records in one file (a report would count its
    images twice)."""
    checked, line_of = [], {}
    for n, record in enumerate(records, 1):
        epoch = record["epoch"]
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 1:
            raise UserError(f"{path} record {n}: epoch is {json.dumps(epoch)[:40]}, not an epoch count: restore the "
                            f"file, or remove that line")
        if checked and epoch <= checked[-1]["epoch"]:
            again = f"repeats epoch {epoch} (record {line_of[epoch]})" if epoch in line_of else \
                f"goes back to epoch {epoch} after epoch {checked[-1]['epoch']}"
            raise UserError(f"{path} record {n} {again}: the file holds the records of two runs (concatenated, or "
                            f"copied over each other), and a report would count their images twice: keep one run's "
                            f"records (each run's own metrics.jsonl)")
        for key in ("val_top1", *RECORD_FIGURES, *COUNTED_FIGURES):
            value = record.get(key)
            wrong = value is None and key in COUNTED_FIGURES and key in record  # a null rank count: no guess
            if wrong or value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
                raise UserError(f"{path} record {n} (epoch {epoch}): {key} is {json.dumps(value)[:40]}, not a number: "
                                f"restore the file, or remove that line")
        damaged = newer_field_problem(record)
        if damaged:
            field, value, what = damaged
            raise UserError(f"{path} record {n} (epoch {epoch}): {field} is {json.dumps(value)[:40]}, not {what}: "
                            f"restore the file, or remove that line")
        unknown = {key: float("nan") for key in ("val_top1", *RECORD_FIGURES)}  # lacked, or null: not recorded
        checked.append({**unknown, **{key: value for key, value in record.items() if value is not None}})
        line_of[epoch] = n
    return checked


def is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def newer_field_problem(record: dict) -> tuple[str, object, str] | None:
    """The first of the fields newer versions write (the EMA's figures, progressive resizing's resolution, the time
    breakdown and the start-up) that the report reads and that is there but not what it should be: (the field, its
    value, what it should be); None when all are sound or absent (an older version's record)."""
    for key in ("val_loss_ema", "val_top1_ema", "val_top5_ema"):
        if key in record and not is_number(record[key]):
            return key, record[key], "a number"
    if "train_resolution" in record and (isinstance(record["train_resolution"], bool)
                                         or not isinstance(record["train_resolution"], int)):
        return "train_resolution", record["train_resolution"], "a size in pixels"
    parts = record.get("breakdown_s")
    if parts is not None:
        if not isinstance(parts, dict):
            return "breakdown_s", parts, "a mapping of parts to seconds"
        for part, seconds in parts.items():
            if part in PARTS and seconds is not None and not is_number(seconds):
                return f"breakdown_s.{part}", seconds, "a number of seconds"
    for key, names in (("dominant", PARTS), ("slowest_rank", None)):
        value = record.get(key)
        if value is not None and (value not in names if names else isinstance(value, bool) or not isinstance(
                value, int) or value < 0):
            return key, value, f"one of {', '.join(names)}" if names else "a rank"
    per_rank = record.get("dominant_per_rank")
    if per_rank is not None and (not isinstance(per_rank, list) or any(p not in PARTS for p in per_rank)):
        return "dominant_per_rank", per_rank, "a list of parts"
    startup = record.get("startup_s")
    if startup is not None:
        if not isinstance(startup, dict):
            return "startup_s", startup, "a mapping of set-up parts to seconds"
        if "total" not in startup:
            return "startup_s", startup, "a mapping of set-up parts to seconds with their total"
        for part, seconds in startup.items():
            if not is_number(seconds):
                return f"startup_s.{part}", seconds, "a number of seconds"
    return None


def read_run_config(run_dir: str) -> dict:
    """The run's resolved config.yaml as a mapping ({} when absent); one line when it is damaged."""
    path = os.path.join(run_dir, "config.yaml")
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, errors="replace") as fh:
            config = yaml.safe_load(fh) or {}
    except yaml.YAMLError:
        config = None
    if not isinstance(config, dict) or not isinstance(config.get("report", {}), dict):
        raise UserError(f"{path} is damaged (not a YAML mapping of config sections): restore it, or delete it to "
                        f"report with the default targets (or pass --top1-target/--top5-target)")
    return config


def single_gpu_speed_of(run_dir: str, history: list[dict], world_size: int, given: float | None) -> tuple:
    """(S1 in img/s or None, where it came from)."""
    if given:
        return given, "given (--single-gpu-speed)"
    scale_path = os.path.join(run_dir, "scale.json")
    if os.path.isfile(scale_path):
        speed = single_rank_speed(scale_path)
        if speed is not None:
            return speed, "measured by python -m benchmarks scale (scale.json)"
    if world_size == 1 and math.isfinite(run_speed(history)):
        return run_speed(history), "this run (one rank)"
    return None, "unknown: pass --single-gpu-speed or run python -m benchmarks scale"


def single_rank_speed(path: str) -> float | None:
    """The images/s of the 1-rank row of a ``python -m benchmarks scale`` result (None when it has none); one line
    naming the file when it is cut short or damaged."""
    fix = ("run 'python -m benchmarks scale --out DIR' again, or move scale.json out of the run_dir and pass "
           "--single-gpu-speed")
    try:
        with open(path, encoding="utf-8") as fh:
            rows = json.load(fh)["rows"]
        speeds = [r["images_per_sec"] for r in rows if r["world_size"] == 1]
    except (UnicodeDecodeError, ValueError, KeyError, TypeError) as exc:
        cut = isinstance(exc, json.JSONDecodeError) and exc.pos >= len(exc.doc.rstrip()) - 1
        what = "is cut short (its write was stopped?)" if cut else f"is not a scale.json ({type(exc).__name__}: " \
                                                                     f"{str(exc)[:60]})"
        raise UserError(f"{path} {what}: {fix}") from None
    for speed in speeds[:1]:
        if isinstance(speed, bool) or not isinstance(speed, (int, float)) or not 0 < speed < math.inf:
            raise UserError(f"{path}: the 1-rank row's images_per_sec is {str(speed)[:40]}, not a speed: {fix}")
    return speeds[0] if speeds else None


def run_speed(history: list[dict]) -> float:
    """Global training images/s over the whole run, leaving out each process's warmup steps (compilation,
    cuDNN autotuning; records of older versions have none)."""
    samples = sum(r["samples_seen"] - r.get("warmup_samples", 0) for r in history)
    return samples / sum(r["train_time_s"] - r.get("warmup_time_s", 0.0) for r in history)


# ----------------------------------------------------------------------------- the figures

def run_figures(history: list[dict], world_size: int, top1_target: float, top5_target: float,
                single_gpu_speed: float | None, speed_source: str) -> dict:
    """Every figure of the report under stable keys (None where a figure does not exist)."""
    top1 = [r["val_top1"] for r in history]
    top5 = [r["val_top5"] for r in history]
    epoch = metrics.convergence_epoch(top1, top1_target)
    epoch5 = metrics.convergence_epoch(top5, top5_target)
    speed = run_speed(history)
    ends = [r["wall_time_s"] for r in history]
    evals = [max(0.0, r["epoch_time_s"] - r["train_time_s"]) for r in history]  # evaluation + BN averaging
    efficiency = metrics.scaling_efficiency(speed, single_gpu_speed, world_size) \
        if single_gpu_speed and math.isfinite(speed) else None  # records of older versions may lack the times
    figures = {"world_size": world_size, "epochs": len(history), "top1_target": top1_target,
               "top5_target": top5_target, "convergence_epoch": epoch, "convergence_epoch_top5": epoch5,
               "convergence_rate": metrics.convergence_rate(epoch) if epoch else None,
               "actual_training_time_s": None, "actual_training_time_without_eval_s": None,
               "actual_avg_single_gpu_time_s": None, "model_single_gpu_time_s": None, "model_gap": None,
               "single_gpu_speed": single_gpu_speed, "single_gpu_speed_source": speed_source,
               "scaling_efficiency": efficiency, "final_top1": top1[-1], "final_top5": top5[-1],
               "best_top1": max((x for x in top1 if math.isfinite(x)), default=None), "images_per_sec": speed,
               "total_time_s": ends[-1],
               "images_per_epoch": history[-1]["samples_seen"]}
    if epoch and all(math.isfinite(x) for x in ends[:epoch] + evals[:epoch]):  # older records may lack times
        time = metrics.actual_training_time(ends, epoch, evals)
        figures["actual_training_time_s"] = time.with_eval
        figures["actual_training_time_without_eval_s"] = time.without_eval
        figures["actual_avg_single_gpu_time_s"] = metrics.actual_average_single_gpu_time(time.with_eval, world_size)
        sizes = [r.get("world_size", world_size) for r in history[:epoch]]
        if len(set(sizes)) > 1:  # elastic: N changed on the way
            figures["actual_avg_single_gpu_time_s"] = metrics.varying_ranks_single_gpu_time(ends[:epoch], sizes)
        if efficiency:
            modelled = metrics.model_single_gpu_time(epoch, figures["images_per_epoch"], single_gpu_speed, efficiency)
            figures["model_single_gpu_time_s"] = modelled
            figures["model_gap"] = metrics.model_gap(figures["actual_avg_single_gpu_time_s"], modelled)
    figures.update(breakdown_figures(history))  # where the time went (engine/breakdown.py), when recorded
    return figures


def report_run(run_dir: str, top1_target: float | None = None, top5_target: float | None = None,
               single_gpu_speed: float | None = None, extra: dict | None = None) -> dict:
    """Write report.md, report.json and the PNGs into ``run_dir``; return the figures."""
    config, history = load_run(run_dir)
    targets = config.get("report", {})
    top1_target = top1_target if top1_target is not None else targets.get("top1_target", 0.75)
    top5_target = top5_target if top5_target is not None else targets.get("top5_target", 0.93)
    for name, value in (("top-1 target", top1_target), ("top-5 target", top5_target)):
        if not 0 < value <= 1:
            raise UserError(f"the {name} must be in (0, 1], got {value}")
    world_size = (extra or {}).get("world_size") or history[-1].get("world_size", 1)
    speed, source = single_gpu_speed_of(run_dir, history, world_size, single_gpu_speed)
    figures = run_figures(history, world_size, top1_target, top5_target, speed, source)
    report = {**figures, "config": config, **(extra or {})}
    links = read_probe(run_dir)  # link_probe.json: which host's link is slow (python -m tools.cluster.link_probe)
    if links:
        report["links"] = links
    sections = [report_markdown(os.path.basename(os.path.abspath(run_dir)), figures, history),
                breakdown_markdown(history, figures),  # "" for records without a breakdown
                "## Settings\n\n" + markdown_table(["setting", "value"], settings_rows(config, history)) + "\n",
                links_markdown(links) if links else ""]
    markdown = "\n".join(section for section in sections if section)
    try:  # each through a temp file renamed over it: never written through a link, never left half-written
        for name, text in (("report.json", json.dumps(report, indent=2)), ("report.md", markdown)):
            with atomic_path(os.path.join(run_dir, name)) as tmp, open(tmp, "w") as fh:
                fh.write(text)
        plot_run(history, run_dir)
    except OSError as exc:  # a read-only run_dir, a full disk: the report is still computed and shown
        where = exc.filename if exc.filename and not os.path.basename(str(exc.filename)).startswith(".") else run_dir
        report["not_saved"] = f"{where}: {exc.strerror or exc}"
    return report


# ----------------------------------------------------------------------------- text

def minutes(seconds: float | None) -> str:
    if seconds is None:
        return "not reached"
    return f"{seconds / 60:.2f} min ({seconds:.1f} s)" if math.isfinite(seconds) else "-"


def pct(x: float | None) -> str:
    return "-" if x is None or not math.isfinite(x) else f"{100 * x:.2f}%"


def headline_rows(f: dict) -> list[tuple[str, str]]:
    epoch = f["convergence_epoch"]
    return [
        ("ranks (N)", str(f["world_size"])),
        (f"convergence epoch (top-1 >= {f['top1_target']})", str(epoch) if epoch else "not reached"),
        (f"convergence epoch (top-5 >= {f['top5_target']})",
         str(f["convergence_epoch_top5"]) if f["convergence_epoch_top5"] else "not reached"),
        ("actual training time", minutes(f["actual_training_time_s"])),
        ("  without evaluation", minutes(f["actual_training_time_without_eval_s"])),
        ("actual average single-GPU training time", minutes(f["actual_avg_single_gpu_time_s"])),
        ("  model form E*I/(S1*eff)", minutes(f["model_single_gpu_time_s"])
         + ("" if f["model_gap"] is None else f", gap {100 * f['model_gap']:+.1f}%")),
        ("single-GPU speed S1", "-" if f["single_gpu_speed"] is None else
         f"{f['single_gpu_speed']:.1f} img/s ({f['single_gpu_speed_source']})"),
        ("scaling efficiency", pct(f["scaling_efficiency"])),
        ("images/s (global, training)", f"{f['images_per_sec']:.1f}"),
        ("val top-1 (final / best)", f"{pct(f['final_top1'])} / {pct(f['best_top1'])}"),
        ("val top-5 (final)", pct(f["final_top5"])),
        (f"whole run ({f['epochs']} epochs)", minutes(f["total_time_s"])),
    ]


def report_markdown(name: str, f: dict, history: list[dict]) -> str:
    epochs = markdown_table(["epoch", "train px", "train loss", "train top-1", "val top-1", "val top-5", "lr", "img/s",
                             "epoch s", "wall s"],
                            [[r["epoch"], r.get("train_resolution", "-"), f"{r['train_loss']:.4f}",
                              f"{r.get('train_top1', float('nan')):.4f}",
                              f"{r['val_top1']:.4f}", f"{r['val_top5']:.4f}", f"{r['lr']:.4g}",
                              f"{r['images_per_sec']:.1f}", f"{r['epoch_time_s']:.1f}", f"{r['wall_time_s']:.1f}"]
                             for r in history])
    return "\n".join([f"# Report: {name}", "", markdown_table(["quantity", "value"], headline_rows(f)), "",
                      "## Per epoch", "", epochs, "",
                      "Plots: `accuracy.png` (top-1/top-5 against epoch and wall time), `throughput.png`, `lr.png`."]
                     ) + "\n"


def settings_rows(config: dict, history: list[dict]) -> list[tuple[str, str]]:
    """The run's recipe settings (its saved config.yaml, label smoothing resolved): the optimizer and its schedule,
    label smoothing, the weights' EMA, validation with mirrored images; with the EMA's top-1 (final / best)."""
    train, optim = config.get("train", {}), config.get("optim", {})
    name = optim.get("name", "hybrid")
    schedule = optim.get("schedule", "step") if name in ("goyal", "sgd") else "its own"
    rows = [("optimizer (schedule)", f"{name} ({schedule})"),
            ("label smoothing", str(train.get("label_smoothing", 0.0))),
            ("EMA decay (0 = off)", str(train.get("ema_decay", 0.0))),
            ("final weights", str(train.get("final_weights", "raw"))),
            ("validation with mirrored images", str(train.get("val_flip", False)).lower()),
            ("progressive resizing (train px per epoch)", progressive_row(config.get("data", {}), history))]
    ema = [r["val_top1_ema"] for r in history if "val_top1_ema" in r]
    if ema:
        rows.append(("EMA val top-1 (final / best)", f"{pct(ema[-1])} / {pct(max(ema))}"))
    return rows


def progressive_row(data: dict, history: list[dict]) -> str:
    """data.res_*'s ramp and the resolutions the epochs trained at (metrics.jsonl's train_resolution), or off."""
    if not data.get("res_start"):
        return "off"
    trained = " ".join(str(r["train_resolution"]) for r in history if "train_resolution" in r)
    return (f"{data['res_start']} px to epoch {data.get('res_start_epoch', 0) + 1}, {data.get('res_end')} px from "
            f"epoch {data.get('res_end_epoch', 0) + 1}, multiples of {data.get('res_multiple', 32)}: {trained}")


def summary_table(figures: dict) -> str:
    rows = headline_rows(figures) + summary_rows(figures)
    width = max(len(k) for k, _ in rows)
    value_width = max(len(v) for _, v in rows)
    line = "+" + "-" * (width + 2) + "+" + "-" * (value_width + 2) + "+"
    body = [f"| {k:<{width}} | {v:>{value_width}} |" for k, v in rows]
    links = figures.get("links", {}).get("lines", [])  # a slow host's link, when the run_dir holds a link probe
    return "\n".join([line, f"| {'summary':<{width}} | {'':>{value_width}} |", line, *body, line, *links])


def comparison_markdown(names: list[str], reports: list[dict]) -> str:
    """Several runs side by side, one column each, in the layout of Tables 3.8-3.10."""
    rows = [headline_rows(r) for r in reports]
    return markdown_table(["quantity", *names], [[label, *(r[i][1] for r in rows)]
                                                 for i, (label, _) in enumerate(rows[0])]) + "\n"


# ----------------------------------------------------------------------------- plots

def plot_run(history: list[dict], out_dir: str) -> None:
    epochs = [r["epoch"] for r in history]
    wall = [r["wall_time_s"] / 60 for r in history]
    fig = figure(10, 4)
    panels = ((fig.add_subplot(1, 2, 1), epochs, "epoch"), (fig.add_subplot(1, 2, 2), wall, "wall time (min)"))
    for ax, x, label in panels:
        ax.plot(x, [r["val_top1"] for r in history], marker="o", label="val top-1")
        ax.plot(x, [r["val_top5"] for r in history], marker="s", label="val top-5")
        ax.set(xlabel=label, ylabel="accuracy")
        ax.legend()
    save_figure(fig, os.path.join(out_dir, "accuracy.png"))
    plots = (("throughput.png", "images_per_sec", "images/s (global)"), ("lr.png", "lr", "learning rate"))
    for name, key, ylabel in plots:
        fig = figure(5, 3.5)
        ax = fig.add_subplot(1, 1, 1)
        ax.plot(epochs, [r[key] for r in history], marker="o")
        ax.set(xlabel="epoch", ylabel=ylabel)
        save_figure(fig, os.path.join(out_dir, name))
    plot_breakdown(history, out_dir)

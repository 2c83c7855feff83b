"""The report's part on where a run's time went (the records' ``breakdown_s``, engine/breakdown.py): the figures over
the run, a markdown section, the summary's rows and ``breakdown.png``, a stacked bar per epoch. Torch-free."""
from __future__ import annotations

import math
import os

from hybridtrain.engine.breakdown import LABELS, PARTS, STARTUP_PARTS, dominant_part, shares_line
from hybridtrain.files import figure, save_figure
from hybridtrain.reports import markdown_table

COLOURS = {"input": "#d62728", "compute": "#1f77b4", "communication": "#ff7f0e", "optimizer": "#9467bd",
           "validation": "#2ca02c", "checkpoint": "#8c564b", "other": "#7f7f7f"}


def with_breakdown(history: list[dict]) -> list[dict]:
    """The records that hold a breakdown (older versions' do not)."""
    return [r for r in history if isinstance(r.get("breakdown_s"), dict)]


def breakdown_figures(history: list[dict]) -> dict:
    """The run's time by part (seconds over its epochs, the mean over ranks), the dominant part, the slowest rank of
    the most epochs and the time to the first step; {} for records without a breakdown."""
    records = with_breakdown(history)
    if not records:
        return {}
    totals = {part: sum(float(r["breakdown_s"].get(part, 0.0) or 0.0) for r in records) for part in PARTS}
    figures = {"time_by_part_s": totals, "dominant_part": dominant_part(totals)}
    slowest = [r["slowest_rank"] for r in records if isinstance(r.get("slowest_rank"), int)]
    if slowest:
        figures["slowest_rank"] = max(set(slowest), key=slowest.count)
        per_rank = records[-1].get("dominant_per_rank")
        if per_rank:
            figures["dominant_per_rank"] = per_rank
    startup = next((r["startup_s"] for r in history if isinstance(r.get("startup_s"), dict)), None)
    if startup:
        figures["startup_s"] = startup
    return figures


def summary_rows(f: dict) -> list[tuple[str, str]]:
    """The summary's rows: where the time went, the slowest rank, the time to the first step."""
    if not f.get("time_by_part_s"):
        return []
    rows = [("time by part (all epochs)", shares_line(f["time_by_part_s"]))]
    if "slowest_rank" in f:
        rows.append(("slowest rank (its peers wait for it)", str(f["slowest_rank"])))
    if "startup_s" in f:
        rows.append(("first step after process start", f"{f['startup_s']['total']:.1f} s"))
    return rows


def breakdown_markdown(history: list[dict], f: dict) -> str:
    """The report's section: the dominant part, a table per epoch (seconds), each rank's dominant part, the set-up."""
    records = with_breakdown(history)
    if not records:
        return ""
    totals = f["time_by_part_s"]
    lines = ["## Where the time went", "",
             f"Dominant: **{f['dominant_part']}** ({LABELS[f['dominant_part']]}); over the run: "
             f"{shares_line(totals)}. Seconds per epoch, the mean over the ranks (docs/observability.md):", "",
             markdown_table(["epoch", *PARTS, "dominant"],
                            [[r["epoch"], *(f"{float(r['breakdown_s'].get(p, 0.0) or 0.0):.2f}" for p in PARTS),
                              r.get("dominant", dominant_part(r["breakdown_s"]))] for r in records]), ""]
    if "slowest_rank" in f:
        per_rank = f.get("dominant_per_rank") or []
        lines += [f"Slowest rank: {f['slowest_rank']} (the most time in its own input, compute and optimizer step; "
                  f"its peers wait for it in communication). Dominant part per rank in the last epoch: "
                  + ", ".join(f"rank {r}: {p}" for r, p in enumerate(per_rank)) + ".", ""]
    if "startup_s" in f:
        s = f["startup_s"]
        parts = [name for name in STARTUP_PARTS if name in s]
        lines += [f"First step {s['total']:.1f} s after the process started:", "",
                  markdown_table(["part", "s"], [[name.replace("_", " "), f"{s[name]:.2f}"] for name in parts]), ""]
    lines += ["Plot: `breakdown.png` (stacked seconds per epoch).", ""]
    return "\n".join(lines)


def plot_breakdown(history: list[dict], out_dir: str) -> str | None:
    """breakdown.png: a stacked bar of each epoch's seconds by part; None for records without a breakdown."""
    records = with_breakdown(history)
    if not records:
        return None
    fig = figure(max(5.0, 0.5 * len(records) + 3), 4)
    ax = fig.add_subplot(1, 1, 1)
    epochs = [r["epoch"] for r in records]
    bottom = [0.0] * len(records)
    for part in PARTS:
        values = [float(r["breakdown_s"].get(part, 0.0) or 0.0) for r in records]
        values = [v if math.isfinite(v) else 0.0 for v in values]
        ax.bar(epochs, values, bottom=bottom, label=LABELS[part], color=COLOURS[part])
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set(xlabel="epoch", ylabel="seconds (mean over ranks)", title="where the time went", xticks=epochs)
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return save_figure(fig, os.path.join(out_dir, "breakdown.png"))

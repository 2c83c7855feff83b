"""Per-epoch log lines, the end-of-run summary table and ``report.json``."""
from __future__ import annotations

import json
import os


def epoch_line(r: dict, epochs: int) -> str:
    return (f"epoch {r['epoch']:>3}/{epochs}  train_loss {r['train_loss']:.4f}  val_loss {r['val_loss']:.4f}  "
            f"train_top1 {r['train_top1']:.4f}  top1 {r['val_top1']:.4f}  top5 {r['val_top5']:.4f}  lr {r['lr']:.4g}  "
            f"{r['images_per_sec']:.0f} img/s  {r['epoch_time_s']:.1f}s")


def write_report(cfg, history: list[dict], world_size: int, total_time_s: float, extra: dict | None = None) -> dict:
    last = history[-1] if history else {}
    seen = sum(r["samples_seen"] for r in history)
    train_time = sum(r["train_time_s"] for r in history)
    report = {
        "world_size": world_size,
        "epochs": len(history),
        "final_top1": last.get("val_top1"),
        "final_top5": last.get("val_top5"),
        "best_top1": max((r["val_top1"] for r in history), default=None),
        "total_time_s": total_time_s,
        "images_per_sec": seen / train_time if train_time else None,
        "config": cfg.to_dict(),
        **(extra or {}),
    }
    with open(os.path.join(cfg.run_dir, "report.json"), "w") as fh:
        json.dump(report, fh, indent=2)
    return report


def summary_table(report: dict) -> str:
    rows = [("ranks", f"{report['world_size']}"),
            ("epochs", f"{report['epochs']}"),
            ("val top-1 (final)", _pct(report["final_top1"])),
            ("val top-5 (final)", _pct(report["final_top5"])),
            ("val top-1 (best)", _pct(report["best_top1"])),
            ("images/s (global, training)", f"{report['images_per_sec']:.1f}" if report["images_per_sec"] else "-"),
            ("total time", f"{report['total_time_s']:.1f} s")]
    width = max(len(k) for k, _ in rows)
    line = "+" + "-" * (width + 2) + "+" + "-" * 14 + "+"
    body = [f"| {k:<{width}} | {v:>12} |" for k, v in rows]
    return "\n".join([line, f"| {'summary':<{width}} | {'':>12} |", line, *body, line])


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.2f}%"

"""``hybridtrain plot-schedule``: B_l, B_u and the learning rate over a run, as a PNG to check before launching."""
from __future__ import annotations

from hybridtrain.optim.schedules import hybrid_schedule


def schedule_series(cfg, world_size: int, iters_per_epoch: int) -> dict:
    """Per-step phase, bounds and lr of the hybrid recipe (bounds are None in the SGD phase)."""
    steps = range(cfg.train.epochs * iters_per_epoch)
    points = [hybrid_schedule(s, cfg.optim, world_size, iters_per_epoch) for s in steps]
    return {"epoch": [(s + 1) / iters_per_epoch for s in steps],
            "lower": [p.get("lower_bound") if p["phase"] == "adabound" else None for p in points],
            "upper": [p.get("upper_bound") if p["phase"] == "adabound" else None for p in points],
            "lr": [p["lr"] if p["phase"] == "sgd" else None for p in points]}


def plot_schedule(cfg, world_size: int, iters_per_epoch: int, path: str) -> str:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    series = schedule_series(cfg, world_size, iters_per_epoch)
    fig = Figure(figsize=(8, 4.5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    ax.plot(series["epoch"], series["upper"], label="B_u (AdaBound upper bound)")
    ax.plot(series["epoch"], series["lower"], label="B_l (AdaBound lower bound)")
    ax.plot(series["epoch"], series["lr"], label="SGD lr = lr*N*kappa^(e-T)")
    ax.axvline(cfg.optim.adabound_epochs, color="grey", linestyle=":", label=f"switch at T={cfg.optim.adabound_epochs}")
    ax.set_yscale("log")
    ax.set(xlabel="epoch", ylabel="step size", title=f"hybrid schedule: N={world_size}, lr={cfg.optim.lr}, "
                                                       f"{iters_per_epoch} iterations/epoch")
    ax.legend()
    fig.savefig(path, dpi=100, bbox_inches="tight")
    return path

"""``hybridtrain plot-schedule``: B_l, B_u and the learning rate over a run, as a PNG to check before launching."""
from __future__ import annotations

from hybridtrain.errors import UserError
from hybridtrain.optim.schedules import hybrid_schedule

# The figure is 800 pixels wide, so a line shows at most a few thousand points; each point costs a schedule
# evaluation and a few hundred bytes, so train.epochs x --iters-per-epoch (both accepted up to 10^4) could
# otherwise take 10^8 points, minutes and tens of GB before the first pixel.
MAX_POINTS = 200_000


def check_points(epochs: int, iters_per_epoch: int) -> None:
    """One line, before any work, when the plot would take more than MAX_POINTS points."""
    if epochs * iters_per_epoch > MAX_POINTS:
        raise UserError(f"plot-schedule draws train.epochs x --iters-per-epoch = {epochs} x {iters_per_epoch} = "
                        f"{epochs * iters_per_epoch} points, more than {MAX_POINTS} (the figure cannot show them, and "
                        f"they would exhaust memory): pass --iters-per-epoch {max(1, MAX_POINTS // epochs)} or fewer")


def schedule_series(cfg, world_size: int, iters_per_epoch: int) -> dict:
    """Per-step phase, bounds and lr of the hybrid recipe (bounds are None in the SGD phase)."""
    check_points(cfg.train.epochs, iters_per_epoch)
    steps = range(cfg.train.epochs * iters_per_epoch)
    points = [hybrid_schedule(s, cfg.optim, world_size, iters_per_epoch) for s in steps]
    return {"epoch": [(s + 1) / iters_per_epoch for s in steps],
            "lower": [p.get("lower_bound") if p["phase"] == "adabound" else None for p in points],
            "upper": [p.get("upper_bound") if p["phase"] == "adabound" else None for p in points],
            "lr": [p["lr"] if p["phase"] == "sgd" else None for p in points]}


def plot_schedule(cfg, world_size: int, iters_per_epoch: int, path: str) -> str:
    from hybridtrain.files import figure, save_figure
    series = schedule_series(cfg, world_size, iters_per_epoch)
    fig = figure(8, 4.5)
    ax = fig.add_subplot(1, 1, 1)
    ax.plot(series["epoch"], series["upper"], label="B_u (AdaBound upper bound)")
    ax.plot(series["epoch"], series["lower"], label="B_l (AdaBound lower bound)")
    ax.plot(series["epoch"], series["lr"], label="SGD lr = lr*N*kappa^(e-T)")
    ax.axvline(cfg.optim.adabound_epochs, color="grey", linestyle=":", label=f"switch at T={cfg.optim.adabound_epochs}")
    ax.set_yscale("log")
    ax.set(xlabel="epoch", ylabel="step size", title=f"hybrid schedule: N={world_size}, lr={cfg.optim.lr}, "
                                                       f"{iters_per_epoch} iterations/epoch")
    ax.legend()
    return save_figure(fig, path)

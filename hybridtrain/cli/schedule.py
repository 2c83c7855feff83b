"""`hybridtrain plot-schedule`: B_l, B_u and the SGD lr of the hybrid recipe, drawn."""
from __future__ import annotations

from hybridtrain.cli.options import RANKS, add_recipe_options, bounded_int
from hybridtrain.files import atomic_path, check_image_format, check_output_file


def cmd_plot_schedule(args) -> int:
    from hybridtrain.config import load_config
    check_output_file(args.out, "--out", "schedule.png")
    check_image_format(args.out, "--out")
    cfg = load_config(args.config, args.set + ["optim.name=hybrid"], for_command="plot-schedule")
    from hybridtrain.optim.plot import plot_schedule  # torch (the optimizers' package) after the recipe's checks
    with atomic_path(args.out) as tmp:
        plot_schedule(cfg, args.ranks, args.iters_per_epoch, tmp)
    print(f"wrote {args.out}")
    return 0


def add_commands(sub) -> None:
    """plot-schedule's parser."""
    plot = sub.add_parser("plot-schedule", help="draw B_l, B_u and the SGD lr of the hybrid recipe (PNG)")
    add_recipe_options(plot, "recipe YAML", required=True)
    plot.add_argument("--ranks", type=RANKS, default=8, help="N, the number of ranks (default 8)")
    plot.add_argument("--iters-per-epoch", type=bounded_int(1, 10_000), default=100,  # x train.epochs points drawn
                      help="iterations per epoch (default 100)")
    plot.add_argument("--out", default="schedule.png", help="PNG path")
    plot.set_defaults(func=cmd_plot_schedule)

"""The commands on one run's output and recipe: `report` (run directories: report.md/.json, PNGs, a comparison) and
`plot-schedule` (B_l, B_u and the SGD lr of the hybrid recipe, drawn)."""
from __future__ import annotations

import os
import sys

from hybridtrain.cli.options import RANKS, add_recipe_options, bounded_float, bounded_int
from hybridtrain.files import atomic_path, check_image_format, check_output_file, write_text_atomically


def cmd_report(args) -> int:
    from hybridtrain.reports.report import comparison_markdown, report_run, summary_table
    args.crash_log_dir = args.run_dirs[0]  # the run reported on: a bug's traceback goes to its logs/
    if args.out is not None:
        check_output_file(args.out, "--out", "comparison.md")
    reports = [report_run(d, args.top1_target, args.top5_target, args.single_gpu_speed) for d in args.run_dirs]
    names = [os.path.basename(os.path.abspath(d)) for d in args.run_dirs]
    for name, directory, report in zip(names, args.run_dirs, reports):
        if "not_saved" in report:  # a read-only run_dir, a full disk: shown here all the same
            print(f"hybridtrain: warning: {name}: could not save report.md, report.json and PNGs in {directory} "
                  f"({report['not_saved']}): the report is below; make the folder writable, or free space, to save "
                  f"it", file=sys.stderr, flush=True)
        else:
            print(f"{name}: report.md, report.json and PNGs written to {directory}")
        print(summary_table(report))
    if len(reports) > 1 or args.out is not None:
        table = comparison_markdown(names, reports)
        if len(reports) > 1:
            print(table)
        if args.out is not None:  # one run: its column alone, rather than dropping what --out asked for
            write_text_atomically(args.out, table)
            print(f"comparison table written to {args.out}")
    return 0


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
    """report and plot-schedule's parsers."""
    rep = sub.add_parser("report", help="the paper's report of run directories: report.md/.json and PNGs")
    rep.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories (several: side by side)")
    rep.add_argument("--top1-target", type=bounded_float(0, 1, lo_open=True, name="top-1 target"),
                     help="val top-1 target (default: the run's report.top1_target)")
    rep.add_argument("--top5-target", type=bounded_float(0, 1, lo_open=True, name="top-5 target"),
                     help="val top-5 target (default: the run's report.top5_target)")
    rep.add_argument("--single-gpu-speed", type=bounded_float(0, 1e6, lo_open=True, name="--single-gpu-speed",
                                                              rule="> 0 img/s and at most 1000000"),
                     help="S1 in img/s, if not measured by python -m benchmarks scale")
    rep.add_argument("--out", help="with several runs: also write the comparison table here (Markdown)")
    rep.set_defaults(func=cmd_report)

    plot = sub.add_parser("plot-schedule", help="draw B_l, B_u and the SGD lr of the hybrid recipe (PNG)")
    add_recipe_options(plot, "recipe YAML", required=True)
    plot.add_argument("--ranks", type=RANKS, default=8, help="N, the number of ranks (default 8)")
    plot.add_argument("--iters-per-epoch", type=bounded_int(1, 10_000), default=100,  # x train.epochs points drawn
                      help="iterations per epoch (default 100)")
    plot.add_argument("--out", default="schedule.png", help="PNG path")
    plot.set_defaults(func=cmd_plot_schedule)

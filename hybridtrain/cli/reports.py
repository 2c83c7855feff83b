"""The paper's comparisons and reports: `experiment` (a named comparison on 2+ ranks), `report` (run directories)."""
from __future__ import annotations

import os
import sys

from hybridtrain.cli.options import RANKS, add_engine_option, add_recipe_options, bounded_float, with_engine
from hybridtrain.errors import UserError
from hybridtrain.outputs import check_output_dir, check_output_file, write_text_atomically


def cmd_experiment(args) -> int:
    from hybridtrain.reports.experiments import run_experiment
    args.crash_log_dir = args.out  # its runs' folder: a bug's traceback goes to its logs/
    rows = None if args.rows is None else [row.strip() for row in args.rows.split(",") if row.strip()]
    if rows == []:  # not every row: an empty list asked for none
        raise UserError(f"--rows names no row (got {args.rows!r}): name rows as the experiment's table shows them, "
                        f"e.g. --rows hybrid,goyal, or drop --rows to run them all")
    check_output_dir(args.out, "--out")
    from hybridtrain.cluster.netns import stopped_cleanly
    with stopped_cleanly("its runs' ranks ended"):
        run_experiment(args.name, args.config, with_engine(args), args.out, args.ranks, args.target, rows)
    return 0


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


def add_commands(sub) -> None:
    """experiment and report's parsers."""
    exp = sub.add_parser("experiment", help="run a named comparison on 2+ ranks (optimizers, warmup-epochs, "
                                            "lars, precision, layered, bn, init, gamma, recipes)")
    exp.add_argument("name", help="optimizers (paper Fig 3.1), warmup-epochs (Fig 3.2), lars (LARS defaults), "
                                  "precision (seed 003, Fig 3.3), layered (seed 000), bn (Table 3.4), init "
                                  "(Table 3.5), gamma (Table 3.6) or recipes (issue 45: hybrid, mlperf, goyal, each "
                                  "alone and with label smoothing, EMA, progressive resizing)")
    add_recipe_options(exp, "base recipe (default configs/demo.yaml)", "override for every row",
                       default="configs/demo.yaml")
    exp.add_argument("--out", default="runs/experiments", help="where tables, JSON and PNGs go")
    exp.add_argument("--ranks", type=RANKS, default=2, help="ranks per row (default 2)")
    add_engine_option(exp)
    exp.add_argument("--rows", metavar="NAME,...", help="run only these rows of the experiment (comma-separated "
                                                        "names, as its table shows them)")
    exp.add_argument("--target", type=bounded_float(0, 1, lo_open=True),
                     help="val top-1 target for epochs-to-target (default: the recipe's report.top1_target)")
    exp.set_defaults(func=cmd_experiment)

    rep = sub.add_parser("report", help="the paper's report of run directories: report.md/.json and PNGs")
    rep.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories (several: side by side)")
    rep.add_argument("--top1-target", type=bounded_float(0, 1, lo_open=True, name="top-1 target"),
                     help="val top-1 target (default: the run's report.top1_target)")
    rep.add_argument("--top5-target", type=bounded_float(0, 1, lo_open=True, name="top-5 target"),
                     help="val top-5 target (default: the run's report.top5_target)")
    rep.add_argument("--single-gpu-speed", type=bounded_float(0, 1e6, lo_open=True, name="--single-gpu-speed",
                                                              rule="> 0 img/s and at most 1000000"),
                     help="S1 in img/s, if not measured by hybridtrain scale")
    rep.add_argument("--out", help="with several runs: also write the comparison table here (Markdown)")
    rep.set_defaults(func=cmd_report)

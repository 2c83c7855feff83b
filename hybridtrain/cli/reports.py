"""The commands on one run's output and recipe: `report` (run directories: report.md/.json, PNGs, a comparison),
`plot-schedule` (B_l, B_u and the SGD lr of the hybrid recipe, drawn); and after training, one run's model:
`evaluate` (on a data set), `classify` (pictures), `export` (ONNX, TorchScript)."""
from __future__ import annotations

import argparse
import os
import sys

from hybridtrain.cli.options import BATCH, CROP, RANKS, add_recipe_options, bounded_float, bounded_int
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

    add_after_training_commands(sub)


# ----------------------------------------------------------------------------- after training: one run's model

def cmd_evaluate(args) -> int:
    from hybridtrain.inference.evaluate import evaluate_command
    return evaluate_command(args)


def cmd_classify(args) -> int:
    from hybridtrain.inference.classify import classify_command
    return classify_command(args)


def cmd_export(args) -> int:
    from hybridtrain.inference.export import export_command
    return export_command(args)


MODEL_HELP = ("a run folder (its newest checkpoint), a checkpoint-epoch*.pt, or a final_model.pt beside its "
              "config.yaml; checked against its .sha256")


def add_after_training_commands(sub) -> None:
    """evaluate, classify and export's parsers."""
    ev = sub.add_parser("evaluate", help="a trained model's top-1/top-5, loss, per-class accuracy and confusion "
                                         "matrix on a folder of class folders (alone, or under horovodrun/torchrun)")
    ev.add_argument("model", metavar="RUN_DIR|CHECKPOINT", help=MODEL_HELP)
    ev.add_argument("--data", required=True, metavar="FOLDER",
                    help="a folder of class folders with the run's classes, e.g. data/digits/val")
    ev.add_argument("--weights", choices=("raw", "ema"),
                    help="the raw weights or their EMA (default: the run's train.final_weights)")
    ev.add_argument("--flip", action=argparse.BooleanOptionalAction,
                    help="average each image's logits with its mirror's (default: the run's train.val_flip)")
    ev.add_argument("--batch-size", type=BATCH, help="images per rank and batch (default: the run's validation "
                                                     "batch)")
    ev.add_argument("--val-resize", type=bounded_int(8, 4096),
                    help="shorter side resized to this many px before the crop (default: the run's data.val_resize)")
    ev.add_argument("--crop-size", type=CROP, help="center crop in px (default: the run's data.crop_size)")
    ev.add_argument("--out", metavar="FOLDER", help="where the results go (default: beside the model, in its run "
                                                    "folder): evaluation-<data>.json, .md and .png")
    ev.set_defaults(func=cmd_evaluate)

    cl = sub.add_parser("classify", help="each picture's most likely classes under a trained model")
    cl.add_argument("model", metavar="RUN_DIR|CHECKPOINT", help=MODEL_HELP + "; the run's train.final_weights")
    cl.add_argument("images", nargs="+", metavar="IMAGE|FOLDER", help="pictures, or folders of them (not recursive)")
    cl.add_argument("--top", type=bounded_int(1, 1000), default=5, help="classes shown per picture (default 5)")
    cl.add_argument("--json", action="store_true", help="print JSON lines instead of a table")
    cl.set_defaults(func=cmd_classify)

    ex = sub.add_parser("export", help="a trained model for inference (ONNX or TorchScript), checked against "
                                       "PyTorch on the run's images before it is written")
    ex.add_argument("model", metavar="RUN_DIR|CHECKPOINT", help=MODEL_HELP + "; the run's train.final_weights")
    ex.add_argument("--format", required=True, choices=("onnx", "torchscript"),
                    help="onnx (checked by ONNX Runtime; needs pip install 'hybridtrain[export]') or torchscript")
    ex.add_argument("--out", required=True, metavar="FILE", help="the new file (never replaces one)")
    ex.add_argument("--fp16", action="store_true", help="FP16 weights and input (default FP32)")
    ex.set_defaults(func=cmd_export)

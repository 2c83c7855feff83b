"""The paper's comparisons and reports: `experiment` (a named comparison on 2+ ranks), `report` (run directories);
and after training, one run's model: `evaluate` (on a data set), `classify` (pictures), `export` (ONNX, TorchScript)."""
from __future__ import annotations

import argparse
import os
import sys

from hybridtrain.cli.options import (
    BATCH,
    CROP,
    RANKS,
    add_engine_option,
    add_recipe_options,
    bounded_float,
    bounded_int,
    with_engine,
)
from hybridtrain.outputs import check_output_dir, check_output_file, write_text_atomically


def cmd_experiment(args) -> int:
    from hybridtrain.reports.experiments import run_experiment
    check_output_dir(args.out, "--out")
    from hybridtrain.cluster.netns import stopped_cleanly
    with stopped_cleanly("its runs' ranks ended"):
        run_experiment(args.name, args.config, with_engine(args), args.out, args.ranks, args.target,
                       [row.strip() for row in args.rows.split(",")] if args.rows else None)
    return 0


def cmd_report(args) -> int:
    from hybridtrain.reports.report import comparison_markdown, report_run, summary_table
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

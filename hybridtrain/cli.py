"""The ``hybridtrain`` command: subcommands, and one clear error line for bad input."""
from __future__ import annotations

import argparse
import os
import sys

from .errors import UserError


def cmd_train(args) -> int:
    from .config import load_config
    from .train import run_training
    cfg = load_config(args.config, args.set)
    run_training(cfg, resume=args.resume)
    return 0


def cmd_prepare_data(args) -> int:
    from .data.digits import prepare_digits
    counts = prepare_digits(args.out, val_fraction=args.val_fraction, seed=args.seed)
    print(f"digits ready in {args.out}: {counts['train']} train / {counts['val']} val images, 10 classes")
    return 0


def cmd_experiment(args) -> int:
    from .experiments import run_experiment
    run_experiment(args.name, args.config, args.set, args.out, args.ranks, args.target)
    return 0


def cmd_plot_schedule(args) -> int:
    from .config import load_config
    from .optim.plot import plot_schedule
    if args.ranks < 1 or args.iters_per_epoch < 1:
        raise UserError("--ranks and --iters-per-epoch must be >= 1")
    cfg = load_config(args.config, args.set + ["optim.name=hybrid"])
    print(f"wrote {plot_schedule(cfg, args.ranks, args.iters_per_epoch, args.out)}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hybridtrain", description=__doc__.splitlines()[0].replace("The ", "", 1))
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    train = sub.add_parser("train", help="train a ResNet under horovodrun/mpirun (or alone as one rank)")
    train.add_argument("--config", required=True, help="recipe YAML, e.g. configs/demo.yaml")
    train.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                       help="override a config key, e.g. --set train.epochs=5 (repeatable)")
    train.add_argument("--resume", action="store_true", help="continue from the newest valid checkpoint in run_dir")
    train.set_defaults(func=cmd_train)

    prep = sub.add_parser("prepare-data", help="write a dataset in the ImageNet folder layout")
    prep_sub = prep.add_subparsers(dest="dataset", metavar="DATASET")
    prep_sub.required = True
    digits = prep_sub.add_parser("digits", help="the handwritten digits embedded in scikit-learn (no network)")
    digits.add_argument("--out", required=True, help="target directory (created; refused if it holds other files)")
    digits.add_argument("--val-fraction", type=float, default=0.2, help="stratified validation share (default 0.2)")
    digits.add_argument("--seed", type=int, default=0, help="split seed (default 0)")
    digits.set_defaults(func=cmd_prepare_data)

    exp = sub.add_parser("experiment", help="run a named comparison on Horovod ranks: optimizers, warmup-epochs")
    exp.add_argument("name", help="optimizers (paper Fig 3.1) or warmup-epochs (Fig 3.2)")
    exp.add_argument("--config", default="configs/demo.yaml", help="base recipe (default configs/demo.yaml)")
    exp.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override for every row")
    exp.add_argument("--out", default="runs/experiments", help="where tables, JSON and PNGs go")
    exp.add_argument("--ranks", type=int, default=2, help="Horovod ranks per row (default 2)")
    exp.add_argument("--target", type=float, default=0.95, help="val top-1 target for epochs-to-target")
    exp.set_defaults(func=cmd_experiment)

    plot = sub.add_parser("plot-schedule", help="draw B_l, B_u and the SGD lr of the hybrid recipe (PNG)")
    plot.add_argument("--config", required=True, help="recipe YAML")
    plot.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    plot.add_argument("--ranks", type=int, default=8, help="N, the number of ranks (default 8)")
    plot.add_argument("--iters-per-epoch", type=int, default=100, help="iterations per epoch (default 100)")
    plot.add_argument("--out", default="schedule.png", help="PNG path")
    plot.set_defaults(func=cmd_plot_schedule)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except UserError as exc:
        from .distributed import launcher_rank
        rank = launcher_rank()
        if rank == 0 or not exc.same_on_all_ranks:
            prefix = "" if rank == 0 else f"rank {rank}: "
            print(f"hybridtrain: error: {prefix}{exc}", file=sys.stderr, flush=True)
        return 2
    except KeyboardInterrupt:
        print("hybridtrain: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())

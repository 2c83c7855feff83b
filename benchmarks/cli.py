"""``python -m benchmarks``: the trainer's benchmarks, run from the checkout: `bench` (the training step), `max-batch`
(the largest batch a GPU holds), `bench-optim`, `bench-data` and `scale` (img/s at several rank counts, or across a
--cluster). Each handler imports its benchmark; bad input is one ``hybridtrain: error:`` line."""
from __future__ import annotations

import sys

from benchmarks.bench_sets import precision_sets, row_sets
from hybridtrain.cli import Parser
from hybridtrain.cli.options import BATCH, CROP, add_recipe_options, bounded_float, bounded_int, engine_name
from hybridtrain.errors import UserError
from hybridtrain.files import check_output_dir, check_output_file, write_json_atomically
from hybridtrain.launched_by import parse_and_run
from tools.jobs import stopped_cleanly
from tools.options import add_timing_options, count_list

BENCH_PRECISIONS = ("fp64", "fp32", "mixed-fp16", "mixed-bf16", "layered", "fp16_pure")


def bench_sets(args) -> list[str]:
    """--set, then what --arch, --image-size and --channels-last stand for."""
    return list(args.set) + ([f"model.arch={args.arch}"] if args.arch else []) + (
        [f"data.crop_size={args.image_size}"] if args.image_size is not None else []) + (
        ["data.channels_last=true"] if args.channels_last else [])


def show_rows(table: str, rows: list[dict], json_path: str | None) -> int:
    """A benchmark's table, and its rows in ``json_path`` when --json asks for them."""
    print(table)
    if json_path is not None:
        write_json_atomically(json_path, rows)
        print(f"rows written to {json_path}")
    return 0


def cmd_bench(args) -> int:
    if args.json is not None:
        check_output_file(args.json, "--json", "bench.json")
    if args.profile is not None:
        check_output_dir(args.profile, "--profile")
    sets = bench_sets(args)
    from hybridtrain.config import load_config
    # the first row's config, as bench loads it, before torch is imported: a typo is refused at once
    load_config(args.config, row_sets(sets, (args.precision or [None])[0], (args.batch_size or [None])[0]),
                for_command="bench")
    from benchmarks.step_bench import bench, format_table
    engines = list(dict.fromkeys((["horovod"] if args.horovod else []) + (args.engine or [])))  # --horovod: horovod
    with stopped_cleanly("its ranks ended"):  # --engine launches the whole step's ranks
        rows = bench(args.config, sets, args.precision or [], args.batch_size or [], args.steps, args.warmup,
                     args.baseline, args.profile, args.threads, engines, args.phase)
    show_rows(format_table([r for r in rows if "error" not in r]), rows, args.json)
    failed = [r["error"] for r in rows if "error" in r]
    if failed:  # after the rows measured are out
        raise UserError(failed[0])
    return 0


def cmd_max_batch(args) -> int:
    import torch

    from benchmarks.max_batch import explain_cpu, find_max_batch, format_trials
    from hybridtrain.config import load_config
    if not torch.cuda.is_available():
        return explain_cpu()
    sets = bench_sets(args)
    torch.backends.cudnn.benchmark = True  # the kernels training will use
    for spec in args.precision or [None]:
        precision = precision_sets(spec) if spec else []
        start = args.start_batch or load_config(args.config, sets + precision).train.batch_size
        trials = find_max_batch(lambda b: load_config(args.config, sets + precision + [f"train.batch_size={b}"]),
                                start, args.memory_margin, args.batch_granularity, args.steps, args.warmup)
        print(f"\nprecision {spec or 'of the recipe'}: " + format_trials(trials, torch.cuda.get_device_name()))
    return 0


def cmd_bench_optim(args) -> int:
    if args.json is not None:
        check_output_file(args.json, "--json", "bench-optim.json")
    from hybridtrain.config import load_config
    load_config(args.config, args.set + ["optim.name=hybrid"])  # bench_optimizer's config, checked before torch
    from benchmarks.optim_bench import bench_optimizer, format_table
    rows = bench_optimizer(args.config, args.set, args.steps, args.warmup, args.threads, args.fused)
    return show_rows(format_table(rows), rows, args.json)


def cmd_bench_data(args) -> int:
    from benchmarks.data_bench import bench_data, format_table
    print(format_table(bench_data(args.backend, args.data, args.threads, args.batch_size, args.crop, args.steps,
                                  args.warmup)))
    return 0


def cmd_scale(args) -> int:
    args.crash_log_dir = args.out  # its runs' folder: a bug's traceback goes to its logs/
    check_output_dir(args.out, "--out")
    if args.json:
        check_output_file(args.json, "--json")
    if args.cluster and args.np is not None:
        raise UserError("--np counts ranks on this machine; --cluster N runs one rank on each of N hosts: drop one")
    if not args.cluster and args.link != "none":  # the default
        raise UserError(f"--link {args.link} limits the links of a --cluster: add --cluster N, or drop --link")
    from benchmarks.scaling import format_table, parse_compressions, run_scale
    if args.cluster:  # the cluster in a box, a tool beside the benchmarks (tools/cluster)
        from tools.cluster import netns as cluster
        from tools.cluster.scale import format_cluster_table, parse_links, run_cluster_scale
        with cluster.in_use("scale --cluster", alone=True), stopped_cleanly(
                "the rows' ranks ended and the cluster is removed (its namespaces, sshds and ranks)", cluster.down):
            rows = run_cluster_scale(args.config, args.set, args.cluster, parse_links(args.link),
                                     parse_compressions(args.compression), parse_engines(args.engine), args.steps,
                                     args.warmup, args.out, args.oversubscribe)
        table, written = format_cluster_table(rows), "scale_cluster.json and scale_cluster.png"
    else:
        with stopped_cleanly("its ranks ended"):
            rows = run_scale(args.config, args.set, args.np or [1, 2], parse_compressions(args.compression),
                             args.steps, args.warmup, args.out, args.oversubscribe, parse_engines(args.engine))
        table, written = format_table(rows), "scale.json and scale.png"
    print(table)
    print(f"{written} written to {args.out}")
    if args.json:
        write_json_atomically(args.json, {"config": args.config, "overrides": args.set, "rows": rows})
        print(f"rows written to {args.json}")
    return 0


def parse_engines(text: str) -> tuple[str, ...]:
    from hybridtrain.distributed.engines import registered
    names, engines = tuple(x.strip() for x in text.split(",") if x.strip()), registered()
    if not names or any(n not in engines for n in names) or len(set(names)) != len(names):
        raise UserError(f"--engine must list registered engines ({', '.join(engines)}), each once, got '{text}': "
                        f"e.g. --engine horovod,torch")
    return names


def add_model_options(parser) -> None:
    """The step's model and input as bench and max-batch take them: a recipe, --arch, --precision, --image-size,
    --channels-last."""
    add_recipe_options(parser, "recipe (default: the built-in defaults, ResNet-50 at batch 256, 224 px)")
    # config.sections.ARCHS, written out: the parser imports no config
    parser.add_argument("--arch", choices=["resnet18", "resnet34", "resnet50", "resnet101", "resnet152"],
                        help="model.arch")
    parser.add_argument("--precision", action="append", metavar="MODE", choices=list(BENCH_PRECISIONS),
                        help=f"{', '.join(BENCH_PRECISIONS)} (repeatable; default: the recipe's)")
    parser.add_argument("--image-size", type=CROP, help="data.crop_size, the square input")
    parser.add_argument("--channels-last", action="store_true", help="NHWC memory layout for model and input")


def build_parser() -> Parser:
    parser = Parser(prog="python -m benchmarks", description="The trainer's benchmarks, run from the checkout: the "
                                                             "step, the optimizer, the input pipeline, the largest "
                                                             "batch, scaling over ranks.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    step = sub.add_parser("bench", help="the trainer's training step on synthetic data: img/s, step time, memory; "
                                         "--baseline compares a plain PyTorch loop")
    add_model_options(step)
    step.add_argument("--batch-size", type=BATCH, action="append", help="per-device batch (repeatable)")
    add_timing_options(step, 20, 5)
    step.add_argument("--baseline", action="store_true", help="also time a plain torchvision + SGD + AMP loop")
    step.add_argument("--horovod", action="store_true",
                      help="also time the whole step as train runs it: one rank under horovodrun, with Horovod's "
                           "DistributedOptimizer, the all-reduce compression, the loss scaler and the schedule "
                           "(the same as --engine horovod)")
    step.add_argument("--engine", action="append", type=engine_name(auto=False),
                      help="also time the whole step as train runs it on this engine: one rank under horovodrun "
                           "or torchrun (DDP); repeatable, e.g. --engine horovod --engine torch")
    step.add_argument("--phase", choices=["adabound", "sgd"], default="adabound",
                      help="the hybrid optimizer's phase to time: its AdaBound warmup (default) or SGD + LARS")
    step.add_argument("--profile", metavar="DIR", help="write a torch profiler trace of 3 trainer steps here")
    step.add_argument("--threads", type=bounded_int(0, 1024), default=0, help="CPU threads (default 0 = all cores)")
    step.add_argument("--json", help="also write the rows to this JSON file")
    step.set_defaults(func=cmd_bench)

    most = sub.add_parser("max-batch", help="GPU only: the largest per-GPU batch that fits (doubling, then "
                                            "bisection), with its images/s and peak memory per trial")
    add_model_options(most)
    add_timing_options(most, 20, 5)
    most.add_argument("--memory-margin", type=bounded_float(0, 1, hi_open=True), default=0.05,
                      help="leave this fraction of GPU memory free (default 0.05)")
    most.add_argument("--start-batch", type=bounded_int(0, 65536), default=0,
                      help="first batch tried (default: the recipe's train.batch_size)")
    most.add_argument("--batch-granularity", type=bounded_int(1, 1024), default=8,
                      help="bisect down to multiples of this (default 8)")
    most.set_defaults(func=cmd_max_batch)

    optim = sub.add_parser("bench-optim", help="the optimizer step alone in both phases of the hybrid optimizer "
                                               "(AdaBound, SGD+LARS) against torch.optim.SGD(foreach=True)")
    add_recipe_options(optim, "recipe (default: the built-in defaults, ResNet-50's parameters)")
    add_timing_options(optim, 20, 3, per=" per row")
    optim.add_argument("--threads", type=bounded_int(0, 1024), default=0,
                       help="CPU threads (default 0 = torch's default)")
    optim.add_argument("--fused", action="store_true",
                       help="also time both phases with optim.fused (compiled kernels; the warmup compiles)")
    optim.add_argument("--json", help="also write the rows to this JSON file")
    optim.set_defaults(func=cmd_bench_optim)

    bench = sub.add_parser("bench-data", help="input pipeline alone: images/s per backend and thread count")
    bench.add_argument("--backend", action="append", required=True,
                       choices=["torchvision", "dali_cpu", "dali_gpu"], help="backend (repeatable)")
    bench.add_argument("--data", required=True, help="dataset root, e.g. from prepare-data synthetic-imagenet")
    bench.add_argument("--threads", type=bounded_int(1, 256), action="append", default=[],
                       help="threads/workers to try (repeatable; default 1 and all cores)")
    bench.add_argument("--batch-size", type=BATCH, default=64, help="batch size (default 64)")
    bench.add_argument("--crop", type=CROP, default=224, help="training crop in px (default 224)")
    add_timing_options(bench, 50, 5, unit="batches")
    bench.set_defaults(func=cmd_bench_data)

    scale = sub.add_parser("scale", help="synthetic-data benchmark at several rank counts: img/s, efficiency, "
                                         "all-reduce bytes and time")
    add_recipe_options(scale, "model, per-rank batch, crop and precision", default="configs/demo.yaml")
    scale.add_argument("--np", type=count_list(1, 4096), help="rank counts, e.g. 1,2 (default 1,2)")
    scale.add_argument("--compression", default="fp16,none", help="fp16 and/or none (default fp16,none)")
    add_timing_options(scale, 20, 5)
    scale.add_argument("--out", default="runs/scale", help="where scale.json, scale.png and timelines go")
    scale.add_argument("--engine", default="horovod",
                       help="the engines to measure, e.g. horovod,torch: rows under horovodrun and under torchrun "
                            "(default horovod)")
    scale.add_argument("--oversubscribe", action="store_true",
                       help="allow more ranks than cores (for calibrating predict on a small machine)")
    scale.add_argument("--cluster", type=bounded_int(2, 200), metavar="N",
                       help="run the rows across N hosts of a cluster in a box, one rank each (root; python -m "
                            "tools cluster; docs/cluster.md), next to predict's all-reduce model")
    scale.add_argument("--link", default="none", help="with --cluster: each host's link rate as tc writes it (100mbit, "
                                                      "1gbit, 10gbit) or none, or several: 100mbit,1gbit,none "
                                                      "(default none)")
    scale.add_argument("--json", help="also write the rows to this JSON file")
    scale.set_defaults(func=cmd_scale)
    return parser


def main(argv=None) -> int:
    return parse_and_run(build_parser().parse_args, sys.argv[1:] if argv is None else list(argv))

"""The benchmarks of one machine: `bench` (the training step; --find-max-batch), `bench-optim`, `bench-data`."""
from __future__ import annotations

from hybridtrain.cli.options import (
    BATCH,
    CROP,
    add_recipe_options,
    add_timing_options,
    bounded_float,
    bounded_int,
    engine_name,
)
from hybridtrain.errors import UserError
from hybridtrain.outputs import check_output_dir, check_output_file, write_json_atomically

BENCH_PRECISIONS = ("fp64", "fp32", "mixed-fp16", "mixed-bf16", "layered", "fp16_pure")


def cmd_bench(args) -> int:
    if args.json is not None:
        check_output_file(args.json, "--json", "bench.json")
    if args.profile is not None:
        check_output_dir(args.profile, "--profile")
    sets = list(args.set)
    sets += [f"model.arch={args.arch}"] if args.arch else []
    sets += [f"data.crop_size={args.image_size}"] if args.image_size is not None else []
    sets += ["data.channels_last=true"] if args.channels_last else []
    from hybridtrain.config import load_config
    from hybridtrain.perf.bench_sets import precision_sets, row_sets
    if args.find_max_batch:
        import torch

        from hybridtrain.perf.max_batch import explain_cpu, find_max_batch, format_trials
        if not torch.cuda.is_available():
            return explain_cpu()
        torch.backends.cudnn.benchmark = True  # the kernels training will use
        for spec in args.precision or [None]:
            precision = precision_sets(spec) if spec else []
            start = args.start_batch or load_config(args.config, sets + precision).train.batch_size
            trials = find_max_batch(lambda b: load_config(args.config, sets + precision + [f"train.batch_size={b}"]),
                                    start, args.memory_margin, args.batch_granularity, args.steps, args.warmup)
            print(f"\nprecision {spec or 'of the recipe'}: " + format_trials(trials, torch.cuda.get_device_name()))
        return 0
    # the first row's config, as bench loads it, before torch is imported: a typo is refused at once
    load_config(args.config, row_sets(sets, (args.precision or [None])[0], (args.batch_size or [None])[0]),
                for_command="bench")
    from hybridtrain.cluster.netns import stopped_cleanly
    from hybridtrain.perf.step_bench import bench, format_table
    engines = list(dict.fromkeys((["horovod"] if args.horovod else []) + (args.engine or [])))  # --horovod: horovod
    with stopped_cleanly("its ranks ended"):  # --engine launches the whole step's ranks
        rows = bench(args.config, sets, args.precision or [], args.batch_size or [], args.steps, args.warmup,
                     args.baseline, args.profile, args.threads, engines, args.phase)
    print(format_table([r for r in rows if "error" not in r]))
    if args.json is not None:
        write_json_atomically(args.json, rows)
        print(f"rows written to {args.json}")
    failed = [r["error"] for r in rows if "error" in r]
    if failed:  # after the rows measured are out
        raise UserError(failed[0])
    return 0


def cmd_bench_optim(args) -> int:
    if args.json is not None:
        check_output_file(args.json, "--json", "bench-optim.json")
    from hybridtrain.config import load_config
    load_config(args.config, args.set + ["optim.name=hybrid"])  # bench_optimizer's config, checked before torch
    from hybridtrain.perf.optim_bench import bench_optimizer, format_table
    rows = bench_optimizer(args.config, args.set, args.steps, args.warmup, args.threads, args.fused)
    print(format_table(rows))
    if args.json is not None:
        write_json_atomically(args.json, rows)
        print(f"rows written to {args.json}")
    return 0


def cmd_bench_data(args) -> int:
    from hybridtrain.perf.data_bench import bench_data, format_table
    print(format_table(bench_data(args.backend, args.data, args.threads, args.batch_size, args.crop, args.steps,
                                  args.warmup)))
    return 0


def add_commands(sub) -> None:
    """bench, bench-optim and bench-data's parsers."""
    step = sub.add_parser("bench", help="the trainer's training step on synthetic data: img/s, step time, memory; "
                                         "--baseline compares a plain PyTorch loop")
    add_recipe_options(step, "recipe (default: the built-in defaults, ResNet-50 at batch 256, 224 px)")
    # config.sections.ARCHS, written out: the parser imports no config (PyYAML may be missing on a bare machine)
    step.add_argument("--arch", choices=["resnet18", "resnet34", "resnet50", "resnet101", "resnet152"],
                      help="model.arch")
    step.add_argument("--precision", action="append", metavar="MODE", choices=list(BENCH_PRECISIONS),
                      help=f"{', '.join(BENCH_PRECISIONS)} (repeatable; default: the recipe's)")
    step.add_argument("--batch-size", type=BATCH, action="append", help="per-device batch (repeatable)")
    step.add_argument("--image-size", type=CROP, help="data.crop_size, the square input")
    step.add_argument("--channels-last", action="store_true", help="NHWC memory layout for model and input")
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
    step.add_argument("--find-max-batch", action="store_true",
                      help="GPU only: the largest per-GPU batch that fits (doubling, then bisection), with its "
                           "images/s and peak memory per trial")
    step.add_argument("--memory-margin", type=bounded_float(0, 1, hi_open=True), default=0.05,
                      help="--find-max-batch: leave this fraction of GPU memory free (default 0.05)")
    step.add_argument("--start-batch", type=bounded_int(0, 65536), default=0,
                      help="--find-max-batch: first batch tried (default: the recipe's train.batch_size)")
    step.add_argument("--batch-granularity", type=bounded_int(1, 1024), default=8,
                      help="--find-max-batch: bisect down to multiples of this (default 8)")
    step.set_defaults(func=cmd_bench)

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

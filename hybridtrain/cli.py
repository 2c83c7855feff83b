"""The ``hybridtrain`` command: subcommands, and one clear error line for bad input."""
from __future__ import annotations

import argparse
import math
import os
import re
import subprocess
import sys

from hybridtrain.distributed.engines import ENGINES
from hybridtrain.errors import UserError, run_guarded
from hybridtrain.outputs import (
    atomic_path,
    check_image_format,
    check_output_dir,
    check_output_file,
    write_json_atomically,
    write_text_atomically,
)

BENCH_PRECISIONS = ("fp64", "fp32", "mixed-fp16", "mixed-bf16", "layered", "fp16_pure")


def cmd_train(args) -> int:
    # The command line, the recipe, its --set overrides and its paths are checked first, without torch or Horovod
    # (config and launcher import neither): a typo is refused in a fraction of a second, not after ~5 s of imports.
    # What needs torch (the device, the data, the run_dir's lock) is checked by the engine afterwards.
    from hybridtrain.config import load_config
    if args.resume not in (None, "required", "auto"):
        raise UserError(f"--resume takes no value or 'auto', got '{args.resume}': e.g. --resume auto")
    cfg = load_config(args.config, with_engine(args), for_command="train")
    args.crash_log_dir = cfg.run_dir  # where run_guarded writes a rank's traceback if a bug stops it
    from hybridtrain.distributed.engines import refuse_elastic
    from hybridtrain.distributed.launcher import check_launch  # the launcher's variables: one line, never a wait
    engine = check_launch(cfg.distributed.engine)
    if args.elastic:
        refuse_elastic(engine)
        if args.move_aside:
            raise UserError("--move-aside is for static runs; with --elastic, give a new run_dir or --resume")
        from hybridtrain.engine.elastic import run_elastic  # torch and Horovod from here on
        finished = explaining_memory(cfg, lambda: run_elastic(cfg, resume=args.resume))
    else:
        from hybridtrain.engine.loop import run_training  # torch from here on
        finished = explaining_memory(cfg, lambda: run_training(cfg, resume=args.resume, move_aside=args.move_aside))
    if finished:  # rank 0 of a run that trained its last epoch: the paper's report
        from hybridtrain.reports.report import report_run, summary_table
        print(summary_table(report_run(cfg.run_dir, extra=finished)), flush=True)
    return 0


def out_of_memory_device(exc: BaseException) -> str | None:
    """'GPU' or 'CPU' when ``exc`` is torch running out of memory, else None: torch.OutOfMemoryError (CUDA's caching
    allocator, c10::OutOfMemoryError; torch.cuda.OutOfMemoryError is the same class), or the RuntimeError of the CPU
    allocator (c10/core/impl/alloc_cpu.cpp: "DefaultCPUAllocator: can't allocate memory")."""
    import torch  # loaded already: the engine ran
    if isinstance(exc, torch.OutOfMemoryError):
        return "CPU" if "DefaultCPUAllocator" in str(exc) else "GPU"
    if isinstance(exc, RuntimeError) and "DefaultCPUAllocator" in str(exc) and \
            ("can't allocate memory" in str(exc) or "not enough memory" in str(exc)):
        return "CPU"
    return None


def explaining_memory(cfg, train):
    """``train()``; running out of memory at a batch the config allows is one line naming the batch and the fix."""
    try:
        return train()
    except RuntimeError as exc:
        device = out_of_memory_device(exc)
        if device is None:
            raise
        t, val_batch = cfg.train, cfg.data.val_batch_size or cfg.train.batch_size
        half = max(1, t.batch_size // 2)
        raise UserError(f"out of {device} memory at train.batch_size={t.batch_size} per rank (data.val_batch_size="
                        f"{val_batch}, data.crop_size={cfg.data.crop_size}, precision.mode={cfg.precision.mode}): "
                        f"lower train.batch_size (e.g. --set train.batch_size={half} --set train.accumulation_steps="
                        f"{t.accumulation_steps * 2} keeps the global batch), or data.val_batch_size if validation "
                        f"ran out; 'hybridtrain bench --find-max-batch' finds the largest batch that fits a GPU",
                        same_on_all_ranks=False) from None


def with_engine(args) -> list[str]:
    """The --set overrides, with --engine as distributed.engine."""
    return args.set + ([f"distributed.engine={args.engine}"] if getattr(args, "engine", None) else [])


def cmd_prepare_digits(args) -> int:
    from hybridtrain.data.prepare.digits import prepare_digits
    check_output_dir(args.out, "--out")
    if not 0 < args.val_fraction < 1:
        raise UserError(f"--val-fraction must be between 0 and 1 (both splits need images), got {args.val_fraction:g}: "
                        f"e.g. --val-fraction 0.2")
    counts = prepare_digits(args.out, val_fraction=args.val_fraction, seed=args.seed)
    print(f"digits ready in {args.out}: {counts['train']} train / {counts['val']} val images, 10 classes")
    return 0


def cmd_prepare_synthetic(args) -> int:
    from hybridtrain.data.prepare.synthetic_imagenet import prepare_synthetic_imagenet
    check_output_dir(args.out, "--out")
    if args.workers < 0:
        raise UserError(f"--workers must be >= 0 (0 = all cores), got {args.workers}")
    counts = prepare_synthetic_imagenet(args.out, args.classes, args.train_per_class, args.val_per_class, args.seed,
                                        parse_size(args.size), args.workers)
    print(f"synthetic-imagenet ready in {args.out}: {counts['train']} train / {counts['val']} val images, "
          f"{args.classes} classes")
    return 0


def parse_size(text: str) -> tuple[int, int]:
    width, _, height = text.partition("x")
    if not (width.isdigit() and height.isdigit()):
        raise UserError(f"--size must be WIDTHxHEIGHT, e.g. 500x375; got '{text}'")
    return int(width), int(height)


def cmd_prepare_imagenet(args) -> int:
    from hybridtrain.data.prepare.imagenet import prepare_imagenet, summary_lines
    check_output_dir(args.out, "--out")
    summary = prepare_imagenet(args.source, args.out, md5=not args.no_md5, resize=args.resize,
                               workers=args.workers, val_labels=args.val_labels)
    print("\n".join(summary_lines(summary, args.out)))
    if args.shards:
        from hybridtrain.data.prepare.pack_shards import pack_shards
        shards = pack_shards(args.out, args.shards, args.workers)
        print(f"shards ready in {shards['root']}: {shards['train_shards']} train / {shards['val_shards']} val tar "
              f"files (set data.path={shards['root']})")
    return 0


def cmd_reorganise_val(args) -> int:
    from hybridtrain.data.prepare.flat_val import reorganise_flat_val
    check_output_dir(args.out, "--out")
    counts = reorganise_flat_val(args.flat_dir, args.labels, args.out, link=not args.copy)
    print(f"{counts['images']} validation images in {counts['classes']} class folders under {args.out}")
    return 0


def cmd_check_data(args) -> int:
    from hybridtrain.data.check import (
        check_data,
        format_report,
        problem_count,
        refuse_names_a_list_cannot_hold,
        write_filelist,
    )
    check_output_file(args.report, "--report", "check-data.json")
    if args.write_filelist is not None:
        check_output_dir(args.write_filelist, "--write-filelist")
    if args.workers < 0:
        raise UserError(f"--workers must be >= 0 (0 = all cores), got {args.workers}")
    report = check_data(args.dir, workers=args.workers)
    print(format_report(report))
    write_json_atomically(args.report, report)
    print(f"report written to {args.report}")
    if args.write_filelist:
        refuse_names_a_list_cannot_hold(report)
        os.makedirs(args.write_filelist, exist_ok=True)
        for split in report["splits"]:
            path = os.path.join(args.write_filelist, f"{split}.txt")
            print(f"{write_filelist(report, split, path)} readable {split} images listed in {path}")
        print(f"train from them with --set data.file_lists={args.write_filelist}")
    bad = problem_count(report)
    if bad and not args.write_filelist:
        print(f"hybridtrain: {bad} corrupt image(s): rerun with --write-filelist DIR and train with "
              f"data.file_lists=DIR, or move them out of the dataset", file=sys.stderr)
    return 1 if bad else 0


def cmd_bench(args) -> int:
    if args.json is not None:
        check_output_file(args.json, "--json", "bench.json")
    if args.profile is not None:
        check_output_dir(args.profile, "--profile")
    for option, values in (("--batch-size", args.batch_size or []), ("--image-size", [args.image_size])):
        bad = [v for v in values if v is not None and v < 1]
        if bad:
            raise UserError(f"{option} must be >= 1, got {bad[0]}: e.g. {option} 64")
    if args.threads < 0:
        raise UserError(f"--threads must be >= 0 (0 = all cores), got {args.threads}")
    sets = list(args.set)
    sets += [f"model.arch={args.arch}"] if args.arch else []
    sets += [f"data.crop_size={args.image_size}"] if args.image_size is not None else []
    sets += ["data.channels_last=true"] if args.channels_last else []
    if args.find_max_batch:
        return cmd_find_max_batch(args, sets)
    from hybridtrain.config import load_config
    from hybridtrain.perf.bench_sets import row_sets
    # the first row's config, as bench loads it, before torch is imported: a typo is refused at once
    load_config(args.config, row_sets(sets, (args.precision or [None])[0], (args.batch_size or [None])[0]))
    from hybridtrain.perf.step_bench import bench, format_table
    rows = bench(args.config, sets, args.precision or [], args.batch_size or [], args.steps, args.warmup,
                 args.baseline, args.profile, args.threads, launched_engines(args), args.phase)
    print(format_table(rows))
    if args.json is not None:
        write_json_atomically(args.json, rows)
        print(f"rows written to {args.json}")
    return 0


def launched_engines(args) -> list[str]:
    """bench's rows of the whole step as train runs it: --engine, and --horovod as --engine horovod."""
    return list(dict.fromkeys((["horovod"] if args.horovod else []) + (args.engine or [])))


def cmd_find_max_batch(args, sets: list[str]) -> int:
    import torch

    from hybridtrain.config import load_config
    from hybridtrain.perf.bench_sets import precision_sets
    from hybridtrain.perf.max_batch import explain_cpu, find_max_batch, format_trials
    if args.start_batch < 0 or args.batch_granularity < 1 or not 0 <= args.memory_margin < 1:
        raise UserError("--start-batch must be >= 0 (0 = the recipe's train.batch_size), --batch-granularity >= 1 "
                        "and --memory-margin in [0, 1)")
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


def cmd_experiment(args) -> int:
    from hybridtrain.reports.experiments import run_experiment
    check_output_dir(args.out, "--out")
    if args.ranks < 1:
        raise UserError(f"--ranks must be >= 1, got {args.ranks}")
    run_experiment(args.name, args.config, with_engine(args), args.out, args.ranks, args.target)
    return 0


def cmd_report(args) -> int:
    from hybridtrain.reports.report import comparison_markdown, report_run, summary_table
    if args.single_gpu_speed is not None and args.single_gpu_speed <= 0:
        raise UserError(f"--single-gpu-speed must be > 0 img/s, got {args.single_gpu_speed}")
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


def cmd_scale(args) -> int:
    from hybridtrain.perf.scaling import format_table, parse_compressions, run_scale
    check_output_dir(args.out, "--out")
    if args.json:
        check_output_file(args.json, "--json")
    if args.cluster:
        if args.np is not None:
            raise UserError("--np counts ranks on this machine; --cluster N runs one rank on each of N hosts: drop one")
        from hybridtrain.cluster.scale import format_cluster_table, parse_links, run_cluster_scale
        rows = run_cluster_scale(args.config, args.set, args.cluster, parse_links(args.link),
                                 parse_compressions(args.compression), parse_engines(args.engine), args.steps,
                                 args.warmup, args.out, args.oversubscribe)
        print(format_cluster_table(rows))
        print(f"scale_cluster.json and scale_cluster.png written to {args.out}")
    else:
        if args.link != "none":  # the default
            raise UserError(f"--link {args.link} limits the links of a --cluster: add --cluster N, or drop --link")
        rows = run_scale(args.config, args.set, args.np or [1, 2], parse_compressions(args.compression), args.steps,
                         args.warmup, args.out, args.oversubscribe, parse_engines(args.engine))
        print(format_table(rows))
        print(f"scale.json and scale.png written to {args.out}")
    if args.json:
        write_json_atomically(args.json, {"config": args.config, "overrides": args.set, "rows": rows})
        print(f"rows written to {args.json}")
    return 0


def parse_engines(text: str) -> tuple[str, ...]:
    names = tuple(x.strip() for x in text.split(",") if x.strip())
    if not names or any(n not in ENGINES for n in names) or len(set(names)) != len(names):
        raise UserError(f"--engine must list {' and/or '.join(ENGINES)}, each once, got '{text}': e.g. --engine "
                        f"horovod,torch")
    return names


def cmd_cluster(args) -> int:
    from hybridtrain.cluster import netns as cluster
    if args.action == "exec":
        if not args.command or args.command[0] not in cluster.hosts_now():
            raise UserError(f"cluster exec needs a host of the cluster and a command, e.g. hybridtrain cluster exec h1 "
                            f"-- hostname (hosts now: {', '.join(cluster.hosts_now()) or 'none'})")
        cluster.require_root()
        return subprocess.run(cluster.host_command(args.command[0], args.command[1:])).returncode
    if args.command:
        raise UserError(f"cluster {args.action} takes no command, got '{' '.join(args.command)}'")
    if args.action == "up":
        cluster.up(args.hosts, args.link)
    elif args.action == "down":
        removed = cluster.down()
        print(f"removed {len(removed)} namespaces" if removed else "no cluster to remove")
        return 0
    cluster.require_root()
    print(cluster.format_status(cluster.status()))
    return 0


def cmd_predict(args) -> int:
    from hybridtrain.predict.cluster_model_cli import run_predict
    run_predict(args)
    return 0


def cmd_plot_schedule(args) -> int:
    from hybridtrain.config import load_config
    if args.ranks < 1 or args.iters_per_epoch < 1:
        raise UserError("--ranks and --iters-per-epoch must be >= 1")
    check_output_file(args.out, "--out", "schedule.png")
    check_image_format(args.out, "--out")
    cfg = load_config(args.config, args.set + ["optim.name=hybrid"])
    from hybridtrain.optim.plot import plot_schedule  # torch (the optimizers' package) after the recipe's checks
    with atomic_path(args.out) as tmp:
        plot_schedule(cfg, args.ranks, args.iters_per_epoch, tmp)
    print(f"wrote {args.out}")
    return 0


def cmd_gpu_check(args) -> int:
    if args.gpus is not None and not args.plan:
        raise UserError("--gpus is for --plan (a real check counts the GPUs it finds): drop --gpus")
    if args.resume and args.fresh:
        raise UserError("--resume keeps the rows that passed and --fresh runs them again: give one of them")
    if args.plan:
        from hybridtrain.gpucheck.rows import Pythons, build_rows, format_plan, plan_calls
        print(format_plan(plan_calls(build_rows(args.gpus or 1, args.out or "OUT", Pythons(horovod_bin="VENV/bin")))))
        return 0
    if args.out is None:
        raise UserError("gpu-check needs --out DIR (the folder for the table and each row's log), or --plan")
    if args.rehearse:
        from hybridtrain.gpucheck.rehearsal import rehearse
        return rehearse(args.out, args.bundle, args.venv)
    from hybridtrain.gpucheck.check import run_gpu_check
    return run_gpu_check(args.out, args.bundle, args.venv, args.budget_s, args.resume, args.fresh)


class Parser(argparse.ArgumentParser):
    """argparse with bad input as one line, ``hybridtrain: error: <what is wrong>: see <command> --help``, exit 2
    (instead of the usage block and a second line)."""

    def error(self, message):
        text = " ".join(str(message).split())  # one line whatever the input held (newlines, tabs, U+2028)
        text = re.sub(r"^argument (\S+): (?:\1 )?(must .*)$", r"\1 \2", text)  # "--steps must be in [1, ..."
        if len(text) > 300:
            text = text[:297] + "..."
        sys.stderr.write(f"hybridtrain: error: {text}: see {self.prog} --help\n")
        sys.exit(2)


def _number_text(x) -> str:
    return str(int(x)) if float(x).is_integer() and abs(x) < 1e15 else repr(float(x))


def _span(lo, hi, lo_open=False, hi_open=False) -> str:
    return f"{'(' if lo_open else '['}{_number_text(lo)}, {_number_text(hi)}{')' if hi_open else ']'}"


def bounded_int(lo: int, hi: int):
    """argparse ``type=``: an integer in [lo, hi], or argparse's one error line naming the option and the range."""
    def integer(text: str) -> int:
        try:
            value = int(text, 10)
        except ValueError:  # not an integer, or more digits than Python converts
            raise argparse.ArgumentTypeError(f"must be an integer in {_span(lo, hi)}, got {text[:40]!r}") from None
        if not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"must be in {_span(lo, hi)}, got {value}")
        return value
    integer.bounds = (lo, hi, False, False)
    return integer


def bounded_float(lo: float, hi: float, lo_open=False, hi_open=False, name="", rule=""):
    """argparse ``type=``: a finite number in the range (NaN and inf refused); ``name`` starts the message,
    ``rule`` replaces 'in <range>' in it."""
    what = f"{name} must be" if name else "must be"
    allowed = rule or f"in {_span(lo, hi, lo_open, hi_open)}"

    def number(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{what} a number {allowed}, got {text[:40]!r}") from None
        low = value <= lo if lo_open else value < lo
        high = value >= hi if hi_open else value > hi
        if not math.isfinite(value) or low or high:
            raise argparse.ArgumentTypeError(f"{what} {allowed}, got {text[:40]!r}")
        return value
    number.bounds = (lo, hi, lo_open, hi_open)
    return number


def count_list(lo: int, hi: int):
    """argparse ``type=``: comma-separated counts such as 1,2,4, each in [lo, hi]; returns them sorted, distinct."""
    def counts(text: str) -> list[int]:
        parts = [x.strip() for x in text.split(",") if x.strip()]
        if not parts or not all(x.isdigit() and len(x) < 10 and lo <= int(x) <= hi for x in parts):
            raise argparse.ArgumentTypeError(f"must be comma-separated counts in {_span(lo, hi)} such as 1,2; "
                                             f"got {text[:40]!r}")
        return sorted({int(x) for x in parts})
    counts.bounds = (lo, hi, False, False)
    counts.is_list = True
    return counts


def recipe_path(text: str) -> str:
    """argparse ``type=`` of --config: a given path must not be empty (that would silently mean the defaults)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("must name a recipe YAML, e.g. configs/demo.yaml; got ''")
    return text


# Bounds of every numeric option; a reason for each bound that is not the config key's own (config/sections.py)
SEED = bounded_int(0, 2**32 - 1)          # numpy's legacy seed range; the generators here take any of them
WORKERS = bounded_int(0, 256)             # processes; no host has more cores
STEPS, WARMUP = bounded_int(1, 100_000), bounded_int(0, 100_000)  # a benchmark of 100k steps is hours already
BATCH = bounded_int(1, 65536)             # train.batch_size's bound
CROP = bounded_int(8, 1024)               # data.crop_size's bound
RANKS = bounded_int(1, 4096)              # more ranks than any job of the paper (24 GPUs) by far
FRACTION_TARGET = bounded_float(0, 1, lo_open=True)
GBPS = bounded_float(0, 10_000, lo_open=True)   # GB/s of a link; NVLink 5 is 1800
MICROSECONDS = bounded_float(0, 1e6)           # a link's latency; a second is no network


def add_predict_options(p: argparse.ArgumentParser) -> None:
    """predict's options, each with its bounds (its defaults and the run: predict.cluster_model_cli)."""
    from hybridtrain.predict import cluster_model, time_to_target
    from hybridtrain.predict.cluster_model_cli import TABLE_DEFAULTS as d
    from hybridtrain.predict.cluster_model_cli import gpu_counts, top1_fraction
    p.add_argument("--single-gpu-speed", type=bounded_float(0, 1e6, lo_open=True),  # an H100: ~3000 img/s
                   help=f"S1, img/s of one GPU (default {d['single_gpu_speed']:g}, the paper's V100 mixed precision)")
    p.add_argument("--batch-per-gpu", type=BATCH, help=f"per-GPU batch (default {d['batch_per_gpu']}; with --gpus: "
                                                        "fixed at this instead of chosen per size)")
    p.add_argument("--params", type=bounded_int(1, 10**12), default=cluster_model.RESNET50_PARAMETERS,
                   help="parameters (default ResNet-50)")
    p.add_argument("--bytes", type=int, choices=[2, 4], help="gradient bytes per element: 2 FP16 (default), 4 FP32")
    p.add_argument("--gpus-per-node", type=bounded_int(1, 64), help="GPUs per node (default 8)")
    p.add_argument("--nodes", type=count_list(1, 100_000),
                   help="node counts to predict (comma-separated; default 1,2,3,4,8,16,32,64,128)")
    p.add_argument("--intra-bandwidth", type=GBPS,
                   help="GB/s inside a node (default 100, V100 NVLink; with --gpus 450, H100 NVLink 4)")
    p.add_argument("--intra-latency", type=MICROSECONDS, help="microseconds per message inside a node (default 5)")
    p.add_argument("--inter-bandwidth", type=GBPS, help="GB/s between nodes, per node (default 5 = 40 GbE; with "
                                                        "--gpus 400 = 8 x 400 Gb/s)")
    p.add_argument("--inter-latency", type=MICROSECONDS, help="microseconds per message between nodes (default 10)")
    p.add_argument("--algorithm", choices=list(cluster_model.ALGORITHMS),
                   help="flat ring (default), hierarchical, or hierarchical-tree (a tree between nodes; the "
                        "default with --gpus)")
    p.add_argument("--overlap", type=bounded_float(0, 1),
                   help="fraction of the all-reduce hidden by backward (default: the one fitted to the paper's "
                        "clusters; with --gpus 0, as MLPerf runs)")
    p.add_argument("--convergence-epoch", type=bounded_int(1, 10_000), help="for the single-GPU time (default 32)")
    p.add_argument("--images-per-epoch", type=bounded_int(1, 10**10), default=cluster_model.IMAGENET_TRAIN_IMAGES,
                   help="default ImageNet")
    p.add_argument("--calibrate", metavar="SCALE_JSON", help="fit the ring model to a hybridtrain scale result")
    p.add_argument("--gpus", type=gpu_counts, metavar="N,N,...",
                   help="time to --target-top1 at these GPU counts (docs/predict.md): the per-GPU batch, img/s, "
                        "efficiency, epochs, minutes and actual average single-GPU time of each")
    p.add_argument("--target-top1", type=top1_fraction,
                   help="with --gpus: the top-1 to reach (default 0.759, MLPerf's)")
    p.add_argument("--optimizer", choices=list(time_to_target.OPTIMIZERS),
                   help="with --gpus: whose published epochs-to-target to use (default lars)")
    p.add_argument("--throughput", metavar="BENCH_JSON",
                   help="with --gpus: per-GPU img/s against batch from 'hybridtrain bench --batch-size B "
                        "--batch-size B2 ... --json FILE' on your GPU (default: the H100 curve of docs/predict.md)")
    p.add_argument("--json", metavar="FILE", help="with --gpus: also write the rows and the checks to this JSON file")
    p.add_argument("--out", default="predict.png",
                   help="efficiency against GPU count (PNG); with --gpus, minutes to target against GPUs")


def add_recipe_options(parser: argparse.ArgumentParser, config_help: str, set_help: str = "config override",
                       **config) -> None:
    """--config (a recipe YAML, checked by recipe_path) and the repeatable --set KEY=VALUE, as every command that
    reads a recipe takes them."""
    parser.add_argument("--config", type=recipe_path, help=config_help, **config)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help=set_help)


def add_engine_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--engine", choices=("auto", *ENGINES),
                        help="the data-parallel engine (distributed.engine): horovod under horovodrun/mpirun, torch "
                             "(DDP) under torchrun or srun; default the config's (auto: the launcher's)")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="hybridtrain", description=__doc__.splitlines()[0].replace("The ", "", 1))
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    train = sub.add_parser("train", help="train a ResNet under horovodrun/mpirun or torchrun (or alone as one rank)")
    add_recipe_options(train, "recipe YAML, e.g. configs/demo.yaml", required=True,
                       set_help="override a config key, e.g. --set train.epochs=5 (repeatable)")
    add_engine_option(train)
    train.add_argument("--resume", nargs="?", const="required", metavar="auto",
                       help="continue from the newest valid checkpoint in run_dir; '--resume auto' starts fresh "
                            "when there is none (for job scripts that requeue themselves)")
    train.add_argument("--move-aside", action="store_true",
                       help="a fresh run into a run_dir that holds a previous run's files moves them into "
                            "run_dir/previous-<time>/ (without it the run is refused)")
    train.add_argument("--elastic", action="store_true",
                       help="Horovod elastic training: ranks may leave and join (horovodrun --min-np/--max-np "
                            "--host-discovery-script; docs/elastic.md)")
    train.set_defaults(func=cmd_train)

    prep = sub.add_parser("prepare-data", help="write a dataset in the ImageNet folder layout")
    prep_sub = prep.add_subparsers(dest="dataset", metavar="DATASET")
    prep_sub.required = True
    digits = prep_sub.add_parser("digits", help="the handwritten digits embedded in scikit-learn (no network)")
    digits.add_argument("--out", required=True, help="target directory (created; refused if it holds other files)")
    digits.add_argument("--val-fraction", type=bounded_float(0.01, 0.99), default=0.2,  # >= 2 of ~180 per class
                        help="stratified validation share (default 0.2)")
    digits.add_argument("--seed", type=SEED, default=0, help="split seed (default 0)")
    digits.set_defaults(func=cmd_prepare_digits)
    synth = prep_sub.add_parser("synthetic-imagenet", help="procedural JPEGs of ImageNet size, for pipeline benchmarks")
    synth.add_argument("--out", required=True, help="target directory")
    synth.add_argument("--classes", type=bounded_int(1, 100_000), default=100, help="number of classes (default 100)")
    synth.add_argument("--train-per-class", type=bounded_int(1, 10_000), default=100,  # ImageNet: at most 1300
                       help="training images per class (default 100)")
    synth.add_argument("--val-per-class", type=bounded_int(1, 10_000), default=20,
                       help="validation images per class (default 20)")
    synth.add_argument("--size", default="500x375", help="typical WIDTHxHEIGHT; each image varies around it")
    synth.add_argument("--seed", type=SEED, default=0, help="generator seed (default 0)")
    synth.add_argument("--workers", type=WORKERS, default=0, help="processes (default 0 = all cores)")
    synth.set_defaults(func=cmd_prepare_synthetic)

    imagenet = prep_sub.add_parser("imagenet", help="ILSVRC2012 from the official archives, the Kaggle tree or an "
                                                    "extracted tree (flat val): verified, in parallel, resumable")
    imagenet.add_argument("--source", required=True,
                          help="folder holding ILSVRC2012_img_train.tar, ILSVRC2012_img_val.tar and "
                               "ILSVRC2012_devkit_t12.tar.gz; or the Kaggle tree (ILSVRC/Data/CLS-LOC, "
                               "LOC_val_solution.csv); or train/<wnid>/ with val/ flat or in class folders")
    imagenet.add_argument("--out", required=True,
                          help="new or empty folder (a stopped run with the same options continues there)")
    imagenet.add_argument("--val-labels", metavar="FILE",
                          help="labels of a flat val/ ('IMAGE WNID' lines or LOC_val_solution.csv; default: found "
                               "next to val/)")
    imagenet.add_argument("--no-md5", action="store_true",
                          help="skip the md5 check of the official archives (a partial or re-packed copy)")
    imagenet.add_argument("--resize", type=bounded_int(8, 100_000), metavar="SHORT",
                          help="write copies whose shorter side is SHORT px (e.g. 256 or 160; smaller ones kept)")
    imagenet.add_argument("--shards", type=bounded_int(1, 1_000_000), metavar="N",
                          help="also pack OUT/shards/: N WebDataset tar shards of train (NNNNNN.jpg + NNNNNN.cls), "
                               "as many of val (fewer if val is smaller)")
    imagenet.add_argument("--workers", type=WORKERS, default=0, help="processes (default 0 = all cores)")
    imagenet.set_defaults(func=cmd_prepare_imagenet)

    reorg = sub.add_parser("reorganise-val", help="sort a flat ImageNet val folder into class folders (symlinks); "
                                                  "prepare-data imagenet does the whole set")
    reorg.add_argument("flat_dir", help="folder of ILSVRC2012_val_*.JPEG")
    reorg.add_argument("--labels", required=True,
                       help="label file: 'IMAGE CLASS' lines, or Kaggle's LOC_val_solution.csv")
    reorg.add_argument("--out", required=True, help="new folder, e.g. imagenet/val")
    reorg.add_argument("--copy", action="store_true", help="copy the images instead of symlinking them")
    reorg.set_defaults(func=cmd_reorganise_val)

    check = sub.add_parser("check-data", help="decode every image in parallel; report corrupt and non-image files")
    check.add_argument("dir", help="dataset root holding train/ and val/")
    check.add_argument("--workers", type=WORKERS, default=0, help="processes (default 0 = all cores)")
    check.add_argument("--report", default="check-data.json", help="JSON report path (default check-data.json)")
    check.add_argument("--write-filelist", metavar="DIR",
                       help="write DIR/train.txt and DIR/val.txt listing the readable images (for data.file_lists)")
    check.set_defaults(func=cmd_check_data)

    step = sub.add_parser("bench", help="the trainer's training step on synthetic data: img/s, step time, memory; "
                                         "--baseline compares a plain PyTorch loop")
    add_recipe_options(step, "recipe (default: the built-in defaults, ResNet-50 at batch 256, 224 px)")
    step.add_argument("--arch", choices=["resnet18", "resnet34", "resnet50", "resnet101", "resnet152"],
                      help="model.arch")
    step.add_argument("--precision", action="append", metavar="MODE", choices=list(BENCH_PRECISIONS),
                      help=f"{', '.join(BENCH_PRECISIONS)} (repeatable; default: the recipe's)")
    step.add_argument("--batch-size", type=BATCH, action="append", help="per-device batch (repeatable)")
    step.add_argument("--image-size", type=CROP, help="data.crop_size, the square input")
    step.add_argument("--channels-last", action="store_true", help="NHWC memory layout for model and input")
    step.add_argument("--steps", type=STEPS, default=20, help="timed steps (default 20)")
    step.add_argument("--warmup", type=WARMUP, default=5, help="untimed steps first (default 5)")
    step.add_argument("--baseline", action="store_true", help="also time a plain torchvision + SGD + AMP loop")
    step.add_argument("--horovod", action="store_true",
                      help="also time the whole step as train runs it: one rank under horovodrun, with Horovod's "
                           "DistributedOptimizer, the all-reduce compression, the loss scaler and the schedule "
                           "(the same as --engine horovod)")
    step.add_argument("--engine", action="append", choices=tuple(ENGINES),
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
    optim.add_argument("--steps", type=STEPS, default=20, help="timed steps per row (default 20)")
    optim.add_argument("--warmup", type=WARMUP, default=3, help="untimed steps first (default 3)")
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
    bench.add_argument("--steps", type=STEPS, default=50, help="timed batches (default 50)")
    bench.add_argument("--warmup", type=WARMUP, default=5, help="untimed batches first (default 5)")
    bench.set_defaults(func=cmd_bench_data)

    exp = sub.add_parser("experiment", help="run a named comparison on 2+ ranks (optimizers, warmup-epochs, "
                                            "lars, precision, layered, bn, init, gamma)")
    exp.add_argument("name", help="optimizers (paper Fig 3.1), warmup-epochs (Fig 3.2), lars (LARS defaults), "
                                  "precision (seed 003, Fig 3.3), layered (seed 000), bn (Table 3.4), init "
                                  "(Table 3.5) or gamma (Table 3.6)")
    add_recipe_options(exp, "base recipe (default configs/demo.yaml)", "override for every row",
                       default="configs/demo.yaml")
    exp.add_argument("--out", default="runs/experiments", help="where tables, JSON and PNGs go")
    exp.add_argument("--ranks", type=RANKS, default=2, help="ranks per row (default 2)")
    add_engine_option(exp)
    exp.add_argument("--target", type=FRACTION_TARGET, help="val top-1 target for epochs-to-target (default: the "
                                                            "recipe's report.top1_target)")
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

    scale = sub.add_parser("scale", help="synthetic-data benchmark at several rank counts: img/s, efficiency, "
                                         "all-reduce bytes and time")
    add_recipe_options(scale, "model, per-rank batch, crop and precision", default="configs/demo.yaml")
    scale.add_argument("--np", type=count_list(1, 4096), help="rank counts, e.g. 1,2 (default 1,2)")
    scale.add_argument("--compression", default="fp16,none", help="fp16 and/or none (default fp16,none)")
    scale.add_argument("--steps", type=STEPS, default=20, help="timed steps (default 20)")
    scale.add_argument("--warmup", type=WARMUP, default=5, help="untimed steps first (default 5)")
    scale.add_argument("--out", default="runs/scale", help="where scale.json, scale.png and timelines go")
    scale.add_argument("--engine", default="horovod",
                       help="the engines to measure, e.g. horovod,torch: rows under horovodrun and under torchrun "
                            "(default horovod)")
    scale.add_argument("--oversubscribe", action="store_true",
                       help="allow more ranks than cores (for calibrating predict on a small machine)")
    scale.add_argument("--cluster", type=bounded_int(2, 200), metavar="N",
                       help="run the rows across N hosts of a cluster in a box, one rank each (root; hybridtrain "
                            "cluster; docs/cluster.md), next to predict's all-reduce model")
    scale.add_argument("--link", default="none", help="with --cluster: each host's link rate as tc writes it (100mbit, "
                                                      "1gbit, 10gbit) or none, or several: 100mbit,1gbit,none "
                                                      "(default none)")
    scale.add_argument("--json", help="also write the rows to this JSON file")
    scale.set_defaults(func=cmd_scale)

    clu = sub.add_parser("cluster", help="N hosts on this machine (network namespaces with an sshd each, joined by "
                                         "a bridge, links limited with tc tbf): up, down, status, exec HOST -- CMD")
    clu.add_argument("action", choices=("up", "down", "status", "exec"))
    clu.add_argument("command", nargs="*", help="exec: the host and its command, e.g. h1 -- hostname")
    clu.add_argument("--hosts", type=bounded_int(2, 200), default=2, help="up: the number of hosts (default 2)")
    clu.add_argument("--link", default="none", help="up: each host's link rate as tc writes it (100mbit, 1gbit, "
                                                    "10gbit) or none (default none)")
    clu.set_defaults(func=cmd_cluster)

    add_predict_options(sub.add_parser("predict", help="model step time, img/s and efficiency of large clusters"))
    sub.choices["predict"].set_defaults(func=cmd_predict)

    plot = sub.add_parser("plot-schedule", help="draw B_l, B_u and the SGD lr of the hybrid recipe (PNG)")
    add_recipe_options(plot, "recipe YAML", required=True)
    plot.add_argument("--ranks", type=RANKS, default=8, help="N, the number of ranks (default 8)")
    plot.add_argument("--iters-per-epoch", type=bounded_int(1, 10_000), default=100,  # x train.epochs points drawn
                      help="iterations per epoch (default 100)")
    plot.add_argument("--out", default="schedule.png", help="PNG path")
    plot.set_defaults(func=cmd_plot_schedule)

    gpu = sub.add_parser("gpu-check", help="the GPU path on a (lent, offline) GPU machine in calls of a few minutes: "
                                           "the step against a plain AMP loop on both engines, resume, graphs, "
                                           "compile, the largest batch; one table, written after every row")
    gpu.add_argument("--out", help="folder for gpu_check.md/.json and one <row>.log per row; a second call with "
                                   "the same folder skips the rows that passed")
    gpu.add_argument("--bundle", help="what the machine lacks for the Horovod build (make gpu-bundle; default "
                                      ".gpu-bundle/ of the checkout when it exists)")
    gpu.add_argument("--venv", help="venv for the Horovod build (default .gpu-check/venv of the checkout)")
    gpu.add_argument("--budget-s", type=bounded_float(0, 86400, lo_open=True), default=540,  # a day
                     help="time for this call, the node checks included; a row that would not fit is left for "
                          "the next call (default 540)")
    gpu.add_argument("--resume", action="store_true",
                     help="insist on an earlier call's table in --out (a second call resumes without it too)")
    gpu.add_argument("--fresh", action="store_true", help="run every row again, ignoring an earlier call's table")
    gpu.add_argument("--plan", action="store_true", help="print the rows, their estimated seconds on an H100 and "
                                                         "the call each falls in; needs no GPU")
    gpu.add_argument("--gpus", type=bounded_int(1, 64), help="--plan: the GPUs to plan for (default 1)")
    gpu.add_argument("--rehearse", action="store_true",
                     help="on a CPU machine: every step a call takes before its first GPU step (an image-like venv, "
                          "the Horovod build from --bundle, each row's imports and launch); exit 0 when all work")
    gpu.set_defaults(func=cmd_gpu_check)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return run_guarded(lambda: args.func(args), lambda: getattr(args, "crash_log_dir", None))


if __name__ == "__main__":
    sys.exit(main())

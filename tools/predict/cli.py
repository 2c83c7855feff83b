"""`python -m tools predict`: the cluster model of ``predict/cluster_model.py`` on the command line, its options with
their bounds, its run, tables and figures.

Prints predicted step time, img/s, efficiency and actual average single-GPU training time for growing
clusters, the model's check against the paper's 24-GPU efficiencies, and, given ``--calibrate scale.json``
with three or more rank counts, the ring model fitted to what ``python -m benchmarks scale`` measured and its error.
With ``--gpus``: the time to a target top-1 at each GPU count (``time_to_target``), its check against the
MLPerf v4.0 runs, and the paper's Tables 3.7-3.9 from the same time model.
"""
from __future__ import annotations

import json
import os
from dataclasses import replace

from hybridtrain.cli.options import BATCH, bounded_float, bounded_int
from hybridtrain.errors import UserError
from hybridtrain.files import (
    atomic_path,
    check_image_format,
    check_input_file,
    check_output_file,
    write_json_atomically,
)
from hybridtrain.reports import markdown_table
from tools.options import count_list
from tools.predict import cluster_model as predict
from tools.predict import time_to_target as ttt

GB = 1e9


# Defaults of the options the two modes share, for the efficiency table (no --gpus); --gpus has its own (the
# DGX H100 template of time_to_target). They are None in the parser so that a value given on the command line
# can be told from a default.
TABLE_DEFAULTS = dict(single_gpu_speed=1542.0, batch_per_gpu=256, bytes=2, gpus_per_node=8,
                      nodes=[1, 2, 3, 4, 8, 16, 32, 64, 128], intra_bandwidth=100.0, intra_latency=5.0,
                      inter_bandwidth=5.0, inter_latency=10.0, algorithm="ring", convergence_epoch=32)
TABLE_ONLY = {  # option: why it has no meaning with --gpus
    "single_gpu_speed": ("--single-gpu-speed", "the per-GPU speed comes from the throughput curve (--throughput)"),
    "nodes": ("--nodes", "--gpus gives the sizes"),
    "convergence_epoch": ("--convergence-epoch", "the epochs come from published runs (--optimizer, --target-top1)"),
    "calibrate": ("--calibrate", "the time model takes its links from the link options, not from a scale fit"),
}
GPUS_ONLY = {"target_top1": "--target-top1", "optimizer": "--optimizer", "throughput": "--throughput",
             "json": "--json"}


LINK_UNITS = {"intra_bandwidth": GB, "inter_bandwidth": GB, "intra_latency": 1e-6, "inter_latency": 1e-6}


def cluster_spec(args, template: predict.ClusterSpec, **fixed) -> predict.ClusterSpec:
    """``template`` with every link option the command line gives (GB/s and microseconds as the model's bytes/s and
    seconds), then ``fixed``."""
    given = dict(gpus_per_node=args.gpus_per_node, bytes_per_element=args.bytes, algorithm=args.algorithm,
                 overlap=args.overlap, parameter_count=args.params,
                 **{name: getattr(args, name) * unit for name, unit in LINK_UNITS.items()
                    if getattr(args, name) is not None})
    try:
        return replace(template, **{**{k: v for k, v in given.items() if v is not None}, **fixed})
    except ValueError as exc:
        raise UserError(f"predict: {exc}") from None


def prediction_table(spec: predict.ClusterSpec, nodes: list[int], epoch: int, images: int) -> tuple[str, list]:
    rows, curve = [], []
    for m in nodes:
        sized = replace(spec, nodes=m)
        p = predict.predict(sized)
        hours = predict.predicted_single_gpu_time(sized, epoch, images) / 3600
        curve.append((sized.world_size, p.efficiency))
        rows.append([m, sized.world_size, f"{1000 * p.step_time:.1f}", f"{1000 * p.allreduce_time:.1f}",
                     f"{p.images_per_second:.0f}", f"{100 * p.efficiency:.1f}%", f"{hours:.1f}"])
    header = ["nodes", "GPUs", "step ms", "all-reduce ms", "img/s", "efficiency", "single-GPU time (h)"]
    return markdown_table(header, rows), curve


def paper_table(check: predict.PaperCheck) -> str:
    table = markdown_table(["configuration", "paper", "model", "error (points)"],
                           [[r.label, f"{100 * r.paper_efficiency:.1f}%", f"{100 * r.predicted_efficiency:.1f}%",
                             f"{100 * r.error:+.1f}"] for r in check.rows])
    return (f"Check against the paper (one overlap fraction fitted to all rows: {check.overlap:.2f})\n\n{table}\n"
            f"\nmax error {100 * check.max_abs_error:.1f} points, RMS {100 * check.rms_error:.1f} points")


def read_scale_rows(path: str) -> list[tuple]:
    """The (world_size, step_time_s, compression) rows of a ``python -m benchmarks scale`` result, or one line saying
    what to pass instead."""
    if os.path.isdir(path) and os.path.isfile(os.path.join(path, "scale.json")):
        raise UserError(f"--calibrate {path} is a folder: pass the file in it, --calibrate "
                        f"{os.path.join(path, 'scale.json')}")
    check_input_file(path, "--calibrate", "run 'python -m benchmarks scale --out DIR' and pass DIR/scale.json")
    try:
        with open(path) as fh:
            rows = json.load(fh)["rows"]
        points = [(r["world_size"], r["step_time_s"], r["compression"]) for r in rows]
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as exc:
        raise UserError(f"--calibrate {path} is not the scale.json of 'python -m benchmarks scale' "
                        f"({type(exc).__name__}: {str(exc)[:80]}): run 'python -m benchmarks scale --out DIR' and pass "
                        f"DIR/scale.json") from None
    return points


def calibration_text(path: str, gradient_bytes: float) -> str:
    rows = read_scale_rows(path)
    points = [(n, t) for n, t, c in rows if c == "fp16"] or [(n, t) for n, t, _ in rows]
    try:
        fit = predict.calibrate(points, gradient_bytes)
    except ValueError as exc:
        raise UserError(f"cannot calibrate on {path}: {exc}") from None
    fixed = " (fixed at 0: the free fit left no positive per-byte cost)" if fit.latency_fixed else ""
    return (f"Calibrated on {path}: compute {1000 * fit.compute_time:.1f} ms/step, effective latency "
            f"{1e6 * fit.latency:.1f} us{fixed}, effective bandwidth {fit.bandwidth / GB:.3f} GB/s; step-time error "
            f"RMS {100 * fit.rms_relative_error:.1f}%, max {100 * fit.max_relative_error:.1f}%")


def cmd_predict(args) -> int:
    check_output_file(args.out, "--out", "predict.png")
    check_image_format(args.out, "--out")
    if args.gpus is not None:
        run_time_to_target(args)
        return 0
    given = [option for name, option in GPUS_ONLY.items() if getattr(args, name) is not None]
    if given:
        raise UserError(f"{given[0]} needs --gpus: e.g. predict --gpus 8,64,512 {given[0]} ...")
    vars(args).update({k: d for k, d in TABLE_DEFAULTS.items() if getattr(args, k) is None})
    if args.calibrate is not None:
        read_scale_rows(args.calibrate)  # a bad --calibrate costs one line before the tables
    check = predict.paper_cluster_check()
    overlap = check.overlap if args.overlap is None else args.overlap
    spec = cluster_spec(args, ttt.h100_cluster(), overlap=overlap, batch_per_gpu=args.batch_per_gpu,
                        compute_time=predict.compute_time_from_speed(args.batch_per_gpu, args.single_gpu_speed))
    nodes = args.nodes  # sorted, distinct counts (cli.options.count_list)
    table, curve = prediction_table(spec, nodes, args.convergence_epoch, args.images_per_epoch)
    print(f"{args.algorithm} all-reduce, {args.gpus_per_node} GPUs/node, S1 {args.single_gpu_speed:g} img/s, "
          f"batch {args.batch_per_gpu}, {args.bytes}-byte gradients, overlap {overlap:.2f}\n")
    print(table + "\n")
    print(paper_table(check))
    if args.calibrate:
        print("\n" + calibration_text(args.calibrate, args.params * args.bytes))
    with atomic_path(args.out) as tmp:
        predict.plot_efficiency({f"{args.algorithm}, {args.gpus_per_node}/node": curve}, tmp)
    print(f"\nwrote {args.out}")
    return 0


# ---------------------------------------------------------------------------------------------- --gpus


BENCH_FIX = ("run 'python -m benchmarks bench --arch resnet50 --batch-size 32 --batch-size 128 --batch-size 256 --json "
             "bench.json' on your GPU and pass --throughput bench.json")


def read_bench_curve(path: str) -> tuple[ttt.ThroughputCurve, str]:
    """The throughput line fitted to a ``python -m benchmarks bench --json`` sweep, or one line saying what to pass
    instead.

    Uses the rows of the trainer's own step: those of ``--horovod`` ('train') when there are any, else 'trainer';
    the plain-PyTorch 'baseline' rows are not the trainer's and are left out. Returns the curve and the model
    the sweep ran."""
    check_input_file(path, "--throughput", BENCH_FIX)
    try:
        with open(path) as fh:
            rows = json.load(fh)
        rows = rows["rows"] if isinstance(rows, dict) else rows
        loop = "train" if any(r["loop"] == "train" for r in rows) else "trainer"
        rows = [r for r in rows if r["loop"] == loop]
        points = [(int(r["batch_size"]), float(r["images_per_sec"])) for r in rows]
        kinds = sorted({f"{r.get('arch')} {r.get('precision')} {r.get('image_size')} px" for r in rows})
        arch = str(rows[0].get("arch")) if rows else ""
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as exc:
        raise UserError(f"--throughput {path} is not the JSON of 'python -m benchmarks bench --json' "
                        f"({type(exc).__name__}: {str(exc)[:80]}): {BENCH_FIX}") from None
    if not points:
        raise UserError(f"--throughput {path} holds no rows of the trainer's step: {BENCH_FIX}")
    if len(kinds) > 1:
        raise UserError(f"--throughput {path} mixes {len(kinds)} models/precisions ({'; '.join(kinds)[:120]}): sweep "
                        f"one, e.g. bench --precision mixed --batch-size 32 --batch-size 256 --json FILE")
    try:
        return ttt.fit_throughput_curve(points, f"{path} ({kinds[0]})"), arch
    except ValueError as exc:
        raise UserError(f"--throughput {path}: {exc}: {BENCH_FIX}") from None


def minutes_text(value: float) -> str:
    return f"{value:,.0f}" if value >= 100 else f"{value:.3g}"  # 3 significant digits, no exponent


def plan_table(rows: list[ttt.PlanRow]) -> str:
    header = ["GPUs", "per-GPU batch", "global batch", "img/s per GPU", "efficiency", "epochs", "minutes to target",
              "actual average single-GPU time (min)"]
    return markdown_table(header, [[f"{r.gpus:,}", r.batch_per_gpu,
                                    f"{r.global_batch:,}" + (" *" if r.epochs_status == "beyond" else ""),
                                    f"{r.images_per_second_per_gpu:,.0f}", f"{100 * r.efficiency:.1f}%",
                                    f"{r.epochs:.1f}", minutes_text(r.minutes), f"{r.single_gpu_minutes:,.0f}"]
                                   for r in rows])


def batch_notes(rows: list[ttt.PlanRow], epochs: ttt.EpochCurve) -> list[str]:
    notes = []
    for r in rows:
        if r.epochs_status == "beyond":
            notes.append(f"* {r.gpus:,} GPUs: global batch {r.global_batch:,} is beyond any published "
                         f"{epochs.optimizer} run to top-1 {epochs.target:g} (largest: {epochs.largest_batch:,}); "
                         f"its {r.epochs:.1f} epochs are extrapolated, not measured")
        elif r.epochs_status == "below":
            notes.append(f"{r.gpus:,} GPUs: global batch {r.global_batch:,} is below the smallest published batch "
                         f"({epochs.batches[0]:,}); epochs held at its {epochs.epochs[0]:.1f}")
    return notes


def mlperf_table(checks: list[ttt.RunCheck]) -> str:
    lines = ["Check against MLPerf Training v4.0 (NVIDIA, H100, LARS to 75.9%; the img/s curve of each row is fitted "
             "to the other two rows only, epochs from the reference convergence points, DGX H100 all-reduce)", ""]
    header = ["GPUs", "per-GPU batch", "img/s per GPU: model", "published", "error", "epochs: model", "published",
              "minutes: model", "published", "error"]
    lines.append(markdown_table(header, [[f"{c.run.gpus:,}", c.run.batch_per_gpu,
                                          f"{c.model.images_per_second_per_gpu:,.0f}",
                                          f"{c.run.images_per_second_per_gpu:,.0f}",
                                          f"{100 * c.throughput_error:+.1f}%",
                                          f"{c.model.epochs:.1f}", c.run.epochs, f"{c.model.minutes:.3g}",
                                          f"{c.run.minutes:g}", f"{100 * c.minutes_error:+.1f}%"] for c in checks]))
    worst_speed = max(abs(c.throughput_error) for c in checks)
    worst_time = max(abs(c.minutes_error) for c in checks)
    lines.append(f"\nmax error: img/s per GPU {100 * worst_speed:.1f}% (limit 15%), minutes {100 * worst_time:.1f}% "
                 f"(limit 25%)")
    return "\n".join(lines)


def paper_time_table(rows: list[ttt.PaperTimeRow]) -> str:
    lines = ["Paper Tables 3.7-3.9 from the time model (24 GPUs; per-GPU speed of Table 3.2 / section 3.2.2, "
             "efficiency of the check above)", ""]
    tables = {90: "3.7", 32: "3.8", 33: "3.8", 39: "3.9", 42: "3.9"}
    header = ["table", "cluster", "epochs", "minutes: paper", "model", "error", "single-GPU min: paper", "model"]
    lines.append(markdown_table(header, [[tables[r.epochs], r.label, r.epochs, f"{r.paper_minutes:g}",
                                          f"{r.model_minutes:.1f}", f"{100 * r.error:+.1f}%",
                                          "-" if r.paper_single_gpu_minutes is None
                                          else f"{r.paper_single_gpu_minutes:g}",
                                          f"{r.model_single_gpu_minutes:.0f}"] for r in rows]))
    lines.append("\ncluster 2's times are about 2.5x shorter than its own measured 24 x 295 img/s allows "
                 "(docs/paper_arithmetic.md), so no throughput model reproduces them")
    return "\n".join(lines)


def run_time_to_target(args) -> None:
    for name, (option, why) in TABLE_ONLY.items():
        if getattr(args, name) is not None:  # the first one given, in TABLE_ONLY's order
            raise UserError(f"{option} does not apply with --gpus ({why}): drop it, or drop --gpus for the "
                            f"efficiency table")
    if args.json is not None:
        check_output_file(args.json, "--json", "predict.json")
    target = 0.759 if args.target_top1 is None else args.target_top1
    optimizer = args.optimizer or "lars"
    try:
        epochs = ttt.epoch_curve(optimizer, target)
    except ValueError as exc:
        raise UserError(f"predict: {exc}: lower --target-top1 or pick another --optimizer (docs/predict.md lists "
                        f"the published runs)") from None
    curve, arch = (ttt.default_throughput_curve(), "resnet50") if args.throughput is None else \
        read_bench_curve(args.throughput)
    template = cluster_spec(args, ttt.h100_cluster())  # the DGX H100 template
    g = template.gpus_per_node
    bad = [n for n in args.gpus if n > g and n % g]
    if bad:
        raise UserError(f"--gpus {bad[0]} is neither at most one node ({g}) nor a whole number of {g}-GPU nodes: "
                        f"use a multiple of {g}, or set --gpus-per-node")
    if args.batch_per_gpu is not None and args.batch_per_gpu > curve.max_batch:
        raise UserError(f"--batch-per-gpu {args.batch_per_gpu} is above the throughput curve's largest batch "
                        f"({curve.max_batch}): pick at most {curve.max_batch}, or measure larger batches with bench")
    rows = [ttt.plan(n, curve, epochs, template, args.images_per_epoch, args.batch_per_gpu) for n in args.gpus]
    check = predict.paper_cluster_check()
    checks = ttt.mlperf_check()
    paper_times = ttt.paper_time_check(check)
    link = (f"{template.algorithm} all-reduce, {g} GPUs/node, {template.intra_bandwidth / GB:g} GB/s inside a node, "
            f"{template.inter_bandwidth / GB:g} GB/s per node between nodes, {template.bytes_per_element}-byte "
            f"gradients, overlap {template.overlap:.2f}")
    print(f"Time to top-1 {target:g} with {optimizer} (ResNet-50, {args.images_per_epoch:,} images per epoch)")
    print(f"throughput: {curve.source}: t(b) = {1e3 * curve.fixed:.3g} ms + b x {1e3 * curve.per_image:.4g} ms, "
          f"b <= {curve.max_batch}")
    print(link)
    if arch != "resnet50":
        print(f"note: the throughput is {arch}'s, while the epochs are ResNet-50's on ImageNet and the gradients "
              f"{args.params:,} parameters (--params)")
    span = (f"{len(epochs.batches)} published global batches, {epochs.batches[0]:,}-{epochs.largest_batch:,}"
            if len(epochs.batches) > 1 else f"one published global batch, {epochs.largest_batch:,}")
    print(f"epochs: {optimizer} to {target:g} at {span} (docs/predict.md)")
    chosen = "fixed by --batch-per-gpu" if args.batch_per_gpu is not None else "chosen for the shortest time"
    print(f"per-GPU batch: {chosen}\n")
    print(plan_table(rows))
    notes = batch_notes(rows, epochs)
    if notes:
        print("\n" + "\n".join(notes))
    print("\n" + mlperf_table(checks))
    print("\n" + paper_table(check))
    print("\n" + paper_time_table(paper_times))
    with atomic_path(args.out) as tmp:
        ttt.plot_time_to_target(rows, tmp, f"ResNet-50 to top-1 {target:g}, {optimizer}; {curve.source}"[:90],
                                ttt.MLPERF_V40_RUNS if optimizer == "lars" and target == 0.759 else ())
    print(f"\nwrote {args.out}")
    if args.json is not None:
        write_json_atomically(args.json, {
            "target_top1": target, "optimizer": optimizer, "images_per_epoch": args.images_per_epoch,
            "throughput": {"source": curve.source, "fixed_s": curve.fixed, "per_image_s": curve.per_image,
                           "max_batch": curve.max_batch},
            "cluster": {"algorithm": template.algorithm, "gpus_per_node": g,
                        "bytes_per_element": template.bytes_per_element, "overlap": template.overlap,
                        "intra_bandwidth_Bps": template.intra_bandwidth,
                        "inter_bandwidth_Bps": template.inter_bandwidth,
                        "intra_latency_s": template.intra_latency, "inter_latency_s": template.inter_latency},
            "epochs_sources": list(epochs.sources),
            "rows": [r.as_dict() for r in rows],
            "mlperf_check": [{"gpus": c.run.gpus, "batch_per_gpu": c.run.batch_per_gpu,
                              "published_images_per_second_per_gpu": c.run.images_per_second_per_gpu,
                              "published_minutes": c.run.minutes, "published_epochs": c.run.epochs,
                              "model": c.model.as_dict(), "images_per_second_error": c.throughput_error,
                              "minutes_error": c.minutes_error} for c in checks]})
        print(f"rows written to {args.json}")


# ----------------------------------------------------------------------------- the command line

GBPS = bounded_float(0, 10_000, lo_open=True)   # GB/s of a link; NVLink 5 is 1800
MICROSECONDS = bounded_float(0, 1e6)           # a link's latency; a second is no network


def add_commands(sub) -> None:
    """predict's parser: its options, each with its bounds (their defaults: TABLE_DEFAULTS and the model's)."""
    p = sub.add_parser("predict", help="model step time, img/s and efficiency of large clusters")
    d = TABLE_DEFAULTS
    p.add_argument("--single-gpu-speed", type=bounded_float(0, 1e6, lo_open=True),  # an H100: ~3000 img/s
                   help=f"S1, img/s of one GPU (default {d['single_gpu_speed']:g}, the paper's V100 mixed precision)")
    p.add_argument("--batch-per-gpu", type=BATCH, help=f"per-GPU batch (default {d['batch_per_gpu']}; with --gpus: "
                                                        "fixed at this instead of chosen per size)")
    p.add_argument("--params", type=bounded_int(1, 10**12), default=predict.RESNET50_PARAMETERS,
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
    p.add_argument("--algorithm", choices=list(predict.ALGORITHMS),
                   help="flat ring (default), hierarchical, or hierarchical-tree (a tree between nodes; the "
                        "default with --gpus)")
    p.add_argument("--overlap", type=bounded_float(0, 1),
                   help="fraction of the all-reduce hidden by backward (default: the one fitted to the paper's "
                        "clusters; with --gpus 0, as MLPerf runs)")
    p.add_argument("--convergence-epoch", type=bounded_int(1, 10_000), help="for the single-GPU time (default 32)")
    p.add_argument("--images-per-epoch", type=bounded_int(1, 10**10), default=predict.IMAGENET_TRAIN_IMAGES,
                   help="default ImageNet")
    p.add_argument("--calibrate", metavar="SCALE_JSON",
                   help="fit the ring model to a python -m benchmarks scale result")
    p.add_argument("--gpus", type=count_list(1, 10**7, example="8,64,512"), metavar="N,N,...",
                   help="time to --target-top1 at these GPU counts (docs/predict.md): the per-GPU batch, img/s, "
                        "efficiency, epochs, minutes and actual average single-GPU time of each")
    p.add_argument("--target-top1", type=bounded_float(0, 1, lo_open=True, hi_open=True),
                   help="with --gpus: the top-1 to reach (default 0.759, MLPerf's)")
    p.add_argument("--optimizer", choices=list(ttt.OPTIMIZERS),
                   help="with --gpus: whose published epochs-to-target to use (default lars)")
    p.add_argument("--throughput", metavar="BENCH_JSON",
                   help="with --gpus: per-GPU img/s against batch from 'python -m benchmarks bench --batch-size B "
                        "--batch-size B2 ... --json FILE' on your GPU (default: the H100 curve of docs/predict.md)")
    p.add_argument("--json", metavar="FILE", help="with --gpus: also write the rows and the checks to this JSON file")
    p.add_argument("--out", default="predict.png",
                   help="efficiency against GPU count (PNG); with --gpus, minutes to target against GPUs")
    p.set_defaults(func=cmd_predict)

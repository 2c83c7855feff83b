"""``hybridtrain predict``: the cluster model of ``predict.py`` on the command line.

Prints predicted step time, img/s, efficiency and actual average single-GPU training time for growing
clusters, the model's check against the paper's 24-GPU efficiencies, and, given ``--calibrate scale.json``
with three or more rank counts, the ring model fitted to what ``hybridtrain scale`` measured and its error.
"""
from __future__ import annotations

import json
import os
from dataclasses import replace

from hybridtrain.data.files import atomic_path, check_image_format, check_input_file, check_output_file
from hybridtrain.errors import UserError
from hybridtrain.perf import cluster_model as predict

GB = 1e9


def add_predict_arguments(p) -> None:
    p.add_argument("--single-gpu-speed", type=float, default=1542.0,
                   help="S1, img/s of one GPU (default 1542, the paper's V100 mixed precision)")
    p.add_argument("--batch-per-gpu", type=int, default=256, help="per-GPU batch (default 256)")
    p.add_argument("--params", type=int, default=predict.RESNET50_PARAMETERS, help="parameters (default ResNet-50)")
    p.add_argument("--bytes", type=int, default=2, choices=[2, 4], help="gradient bytes per element: 2 FP16, 4 FP32")
    p.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node (default 8)")
    p.add_argument("--nodes", default="1,2,3,4,8,16,32,64,128", help="node counts to predict (comma-separated)")
    p.add_argument("--intra-bandwidth", type=float, default=100.0, help="GB/s inside a node (default 100, NVLink)")
    p.add_argument("--intra-latency", type=float, default=5.0, help="microseconds per message inside a node")
    p.add_argument("--inter-bandwidth", type=float, default=5.0, help="GB/s between nodes (default 5 = 40 GbE)")
    p.add_argument("--inter-latency", type=float, default=10.0, help="microseconds per message between nodes")
    p.add_argument("--algorithm", default="ring", choices=list(predict.ALGORITHMS), help="flat ring or hierarchical")
    p.add_argument("--overlap", type=float, help="fraction of the all-reduce hidden by backward (default: the one "
                                                  "fitted to the paper's clusters)")
    p.add_argument("--convergence-epoch", type=int, default=32, help="for the single-GPU time (default 32)")
    p.add_argument("--images-per-epoch", type=int, default=predict.IMAGENET_TRAIN_IMAGES, help="default ImageNet")
    p.add_argument("--calibrate", metavar="SCALE_JSON", help="fit the ring model to a hybridtrain scale result")
    p.add_argument("--out", default="predict.png", help="efficiency against GPU count (PNG)")


def spec_from(args, overlap: float) -> predict.ClusterSpec:
    try:
        return predict.ClusterSpec(
            compute_time=predict.compute_time_from_speed(args.batch_per_gpu, args.single_gpu_speed),
            batch_per_gpu=args.batch_per_gpu, parameter_count=args.params, bytes_per_element=args.bytes,
            gpus_per_node=args.gpus_per_node, nodes=1, intra_bandwidth=args.intra_bandwidth * GB,
            intra_latency=args.intra_latency * 1e-6, inter_bandwidth=args.inter_bandwidth * GB,
            inter_latency=args.inter_latency * 1e-6, algorithm=args.algorithm, overlap=overlap)
    except ValueError as exc:
        raise UserError(f"predict: {exc}") from None


def prediction_table(spec: predict.ClusterSpec, nodes: list[int], epoch: int, images: int) -> tuple[str, list]:
    lines = ["| nodes | GPUs | step ms | all-reduce ms | img/s | efficiency | single-GPU time (h) |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    curve = []
    for m in nodes:
        sized = replace(spec, nodes=m)
        p = predict.predict(sized)
        hours = predict.predicted_single_gpu_time(sized, epoch, images) / 3600
        curve.append((sized.world_size, p.efficiency))
        lines.append(f"| {m} | {sized.world_size} | {1000 * p.step_time:.1f} | {1000 * p.allreduce_time:.1f} | "
                     f"{p.images_per_second:.0f} | {100 * p.efficiency:.1f}% | {hours:.1f} |")
    return "\n".join(lines), curve


def paper_table(check: predict.PaperCheck) -> str:
    lines = [f"Check against the paper (one overlap fraction fitted to all rows: {check.overlap:.2f})", "",
             "| configuration | paper | model | error (points) |", "| --- | --- | --- | --- |"]
    lines += [f"| {r.label} | {100 * r.paper_efficiency:.1f}% | {100 * r.predicted_efficiency:.1f}% | "
              f"{100 * r.error:+.1f} |" for r in check.rows]
    lines.append(f"\nmax error {100 * check.max_abs_error:.1f} points, RMS {100 * check.rms_error:.1f} points")
    return "\n".join(lines)


def read_scale_rows(path: str) -> list[dict]:
    """The rows of a ``hybridtrain scale`` result, or one line saying what to pass instead."""
    if os.path.isdir(path) and os.path.isfile(os.path.join(path, "scale.json")):
        raise UserError(f"--calibrate {path} is a folder: pass the file in it, --calibrate "
                        f"{os.path.join(path, 'scale.json')}")
    check_input_file(path, "--calibrate", "run 'hybridtrain scale --out DIR' and pass DIR/scale.json")
    try:
        with open(path) as fh:
            rows = json.load(fh)["rows"]
        points = [(r["world_size"], r["step_time_s"], r["compression"]) for r in rows]
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as exc:
        raise UserError(f"--calibrate {path} is not the scale.json of 'hybridtrain scale' ({type(exc).__name__}: "
                        f"{str(exc)[:80]}): run 'hybridtrain scale --out DIR' and pass DIR/scale.json") from None
    return [{"world_size": n, "step_time_s": t, "compression": c} for n, t, c in points]


def calibration_text(path: str, gradient_bytes: float) -> str:
    rows = read_scale_rows(path)
    points = [(r["world_size"], r["step_time_s"]) for r in rows if r["compression"] == "fp16"] or \
             [(r["world_size"], r["step_time_s"]) for r in rows]
    try:
        fit = predict.calibrate(points, gradient_bytes)
    except ValueError as exc:
        raise UserError(f"cannot calibrate on {path}: {exc}") from None
    fixed = " (fixed at 0: the free fit left no positive per-byte cost)" if fit.latency_fixed else ""
    return (f"Calibrated on {path}: compute {1000 * fit.compute_time:.1f} ms/step, effective latency "
            f"{1e6 * fit.latency:.1f} us{fixed}, effective bandwidth {fit.bandwidth / GB:.3f} GB/s; step-time error "
            f"RMS {100 * fit.rms_relative_error:.1f}%, max {100 * fit.max_relative_error:.1f}%")


def run_predict(args) -> None:
    check_output_file(args.out, "--out", "predict.png")
    check_image_format(args.out, "--out")
    if args.calibrate is not None:
        read_scale_rows(args.calibrate)  # a bad --calibrate costs one line before the tables
    check = predict.paper_cluster_check()
    overlap = check.overlap if args.overlap is None else args.overlap
    spec = spec_from(args, overlap)
    nodes = args.nodes  # sorted, distinct counts (cli.count_list)
    if args.convergence_epoch < 1 or args.images_per_epoch < 1:
        raise UserError("--convergence-epoch and --images-per-epoch must be >= 1")
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

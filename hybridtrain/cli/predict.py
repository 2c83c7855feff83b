"""`hybridtrain predict`: step time, img/s and efficiency of large clusters from the all-reduce model (its defaults,
tables and run: predict.cluster_model_cli)."""
from __future__ import annotations

import argparse

from hybridtrain.cli.options import BATCH, bounded_float, bounded_int, count_list

GBPS = bounded_float(0, 10_000, lo_open=True)   # GB/s of a link; NVLink 5 is 1800
MICROSECONDS = bounded_float(0, 1e6)           # a link's latency; a second is no network


def cmd_predict(args) -> int:
    from hybridtrain.predict.cluster_model_cli import run_predict
    run_predict(args)
    return 0


def add_predict_options(p: argparse.ArgumentParser) -> None:
    """predict's options, each with its bounds (its defaults and the run: predict.cluster_model_cli)."""
    from hybridtrain.predict import cluster_model, time_to_target
    from hybridtrain.predict.cluster_model_cli import TABLE_DEFAULTS as d
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
    p.add_argument("--gpus", type=count_list(1, 10**7, example="8,64,512"), metavar="N,N,...",
                   help="time to --target-top1 at these GPU counts (docs/predict.md): the per-GPU batch, img/s, "
                        "efficiency, epochs, minutes and actual average single-GPU time of each")
    p.add_argument("--target-top1", type=bounded_float(0, 1, lo_open=True, hi_open=True),
                   help="with --gpus: the top-1 to reach (default 0.759, MLPerf's)")
    p.add_argument("--optimizer", choices=list(time_to_target.OPTIMIZERS),
                   help="with --gpus: whose published epochs-to-target to use (default lars)")
    p.add_argument("--throughput", metavar="BENCH_JSON",
                   help="with --gpus: per-GPU img/s against batch from 'hybridtrain bench --batch-size B "
                        "--batch-size B2 ... --json FILE' on your GPU (default: the H100 curve of docs/predict.md)")
    p.add_argument("--json", metavar="FILE", help="with --gpus: also write the rows and the checks to this JSON file")
    p.add_argument("--out", default="predict.png",
                   help="efficiency against GPU count (PNG); with --gpus, minutes to target against GPUs")


def add_commands(sub) -> None:
    """predict's parser."""
    add_predict_options(sub.add_parser("predict", help="model step time, img/s and efficiency of large clusters"))
    sub.choices["predict"].set_defaults(func=cmd_predict)

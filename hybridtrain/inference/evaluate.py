"""``hybridtrain evaluate``: a trained model on a folder of class folders, alone or on the ranks of a launcher.

It runs the trainer's own validation (``engine.epoch.evaluate``) on the trainer's own validation loader
(``create_val_loader``: each rank a contiguous shard, every image counted once) with the model built and loaded as
the trainer built it, so on the run's validation folder it gives the figures the run reported for that epoch. Beside
the sums it counts each image's top-1 class into a confusion matrix (one more all-reduce).
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import time

import torch

from hybridtrain.config import Config
from hybridtrain.config.loading import config_from_dict
from hybridtrain.data.folder import ImageList, scan_split
from hybridtrain.data.torchvision_loader import create_val_loader
from hybridtrain.distributed import collectives as distributed
from hybridtrain.distributed.topology import cores_per_rank
from hybridtrain.engine.epoch import evaluate
from hybridtrain.errors import UserError
from hybridtrain.files import (
    check_input_dir,
    check_output_dir,
    figure,
    is_plain_file,
    save_figure,
    write_json_atomically,
    write_text_atomically,
)
from hybridtrain.inference.trained import Trained, build_model, load_trained, run_data_path
from hybridtrain.precision.policy import set_fp32_math
from hybridtrain.precision.scaler import create_precision
from hybridtrain.reports import markdown_table

MOST_CONFUSED = 10


def read_split(path: str) -> ImageList:
    """The images of ``path``, a folder of class folders (a data set's val/ or train/, or any such folder)."""
    check_input_dir(path, "--data", "give a folder of class folders, e.g. data/digits/val")
    path = os.path.normpath(os.path.abspath(path))
    if all(os.path.isdir(os.path.join(path, split)) for split in ("train", "val")):
        raise UserError(f"--data {path} is a data set's root: give one of its splits, e.g. --data "
                        f"{os.path.join(path, 'val')}")
    return scan_split(os.path.dirname(path), os.path.basename(path))


def check_classes(images: ImageList, trained: Trained, option: str = "--data") -> None:
    """One line when the data's class folders are not the model's classes (their count, or their names)."""
    if len(images.classes) != trained.num_classes:
        raise UserError(f"{option} {images.root} has {len(images.classes)} class folders but {trained.path} "
                        f"classifies {trained.num_classes} classes (model.arch={trained.cfg.model.arch}): give data "
                        f"of the run's classes, or the model trained on these")
    if trained.classes is not None and images.classes != trained.classes:
        only_data = sorted(set(images.classes) - set(trained.classes))[:3]
        only_run = sorted(set(trained.classes) - set(images.classes))[:3]
        raise UserError(f"the class folders of {option} {images.root} differ from the run's (only in the data: "
                        f"{only_data}, only in the run: {only_run}): the labels would be read as other classes: "
                        f"give data with the run's class folders")


def result_name(data: str) -> str:
    """The results' name, after the data folder: 'evaluation-digits-val' for data/digits/val."""
    path = os.path.normpath(os.path.abspath(data))
    base = os.path.basename(path)
    if base in ("train", "val", "test") and os.path.basename(os.path.dirname(path)):
        base = f"{os.path.basename(os.path.dirname(path))}-{base}"
    return "evaluation-" + re.sub(r"[^A-Za-z0-9._-]", "_", base)


def result_paths(out_dir: str, name: str) -> dict[str, str]:
    """The JSON, Markdown and PNG results' paths, each free or a plain file that is replaced (never a link)."""
    paths = {ext: os.path.join(out_dir, f"{name}.{ext}") for ext in ("json", "md", "png")}
    for path in paths.values():
        if os.path.lexists(path) and not is_plain_file(path):
            raise UserError(f"{path} exists and is not a plain file (a link or a folder), so it is not written "
                            f"through: move it, or pass --out FOLDER")
    return paths


def evaluation_config(cfg: Config, args) -> Config:
    """The run's config with the command line's validation settings (checked by the config's own rules)."""
    tree = cfg.to_dict()
    changes = {"val_batch_size": args.batch_size, "val_resize": args.val_resize, "crop_size": args.crop_size}
    tree["data"].update({key: value for key, value in changes.items() if value is not None})
    if args.flip is not None:
        tree["train"]["val_flip"] = args.flip
    tree["data"]["file_lists"] = ""  # the folder given is read whole
    return config_from_dict(tree, "by the command line")


def run_reported(trained: Trained, data: str) -> dict | None:
    """What the run's metrics.jsonl reported for the checkpoint's epoch when ``data`` is the run's own validation
    folder (its last epoch for final_model.pt): {'epoch', 'val_top1', 'val_top5'} of the weights evaluated."""
    own = run_data_path(trained.cfg, trained.run_dir)
    metrics = os.path.join(trained.run_dir, "metrics.jsonl")
    if own is None or os.path.realpath(data) != os.path.realpath(os.path.join(own, "val")) or \
            not os.path.isfile(metrics):
        return None
    with open(metrics) as fh:
        records = [json.loads(line) for line in fh if line.strip()]
    records = [r for r in records if trained.epoch is None or r.get("epoch") == trained.epoch]
    if not records:
        return None
    suffix = "_ema" if trained.which == "ema" else ""
    last = records[-1]
    if f"val_top1{suffix}" not in last:
        return None
    return {"epoch": last["epoch"], "val_top1": last[f"val_top1{suffix}"], "val_top5": last[f"val_top5{suffix}"],
            "val_flip": trained.cfg.train.val_flip}


def evaluate_command(args) -> int:
    trained = load_trained(args.model, args.weights)
    images = read_split(args.data)
    check_classes(images, trained)
    out_dir = check_output_dir(args.out, "--out") if args.out else trained.run_dir
    paths = result_paths(out_dir, result_name(args.data))
    cfg = evaluation_config(trained.cfg, args)
    topo = distributed.init(cfg.train.threads, cfg, device=cfg.train.device)
    try:
        result = evaluate_on_ranks(trained, cfg, images, topo)
    except BaseException:
        with contextlib.suppress(Exception):  # this rank's own error line matters more than the teardown
            distributed.shutdown()
        raise
    distributed.shutdown()  # after the last collective: rank 0 writes alone
    if topo.is_root:
        result["run_reported"] = run_reported(trained, args.data)
        if args.out:
            os.makedirs(out_dir, exist_ok=True)
        write_results(result, paths)
    return 0


def evaluate_on_ranks(trained: Trained, cfg: Config, images: ImageList, topo) -> dict:
    """The trainer's validation of the chosen weights over ``images``, shared by the ranks, with the confusion
    matrix (rows: true class, columns: top-1 class); the same dict on every rank."""
    set_fp32_math(cfg.precision.tf32)
    precision = create_precision(cfg.precision)
    model = build_model(trained, topo.device, precision.policy)
    workers = cfg.data.workers or cores_per_rank(topo.local_size)
    loader = create_val_loader(images, cfg, topo.rank, topo.size, workers, pin=topo.device.type == "cuda")
    n = trained.num_classes
    confusion = torch.zeros(n * n, dtype=torch.float64, device=topo.device)

    def tally(logits, labels):
        top1 = logits.topk(1, dim=1).indices.view(-1)  # the class topk_correct counts as the top-1
        confusion.add_(torch.bincount(labels * n + top1, minlength=n * n).to(confusion.dtype))

    began = time.perf_counter()
    ev = evaluate(model, loader, precision, tag="evaluate", flip=cfg.train.val_flip, on_batch=tally)
    seconds = time.perf_counter() - began
    counts = distributed.allreduce_sum(confusion.cpu(), "evaluate_confusion").view(n, n).round().long()
    return {"model": trained.path, "epoch": trained.epoch, "weights": trained.which, "data": images.root,
            "images": ev.count, "classes": n, "ranks": topo.size, "engine": topo.engine, "seconds": seconds,
            "loss": ev.loss, "top1": ev.top1, "top5": ev.top5, "val_flip": cfg.train.val_flip,
            "val_resize": cfg.data.val_resize, "crop_size": cfg.data.crop_size,
            "batch_size": cfg.data.val_batch_size or cfg.train.batch_size,
            "class_names": [trained.label(i) for i in range(n)], "confusion": counts.tolist()}


def per_class(result: dict) -> list[dict]:
    """Each class's images and top-1 accuracy (its row of the confusion matrix)."""
    rows = []
    for i, (name, row) in enumerate(zip(result["class_names"], result["confusion"])):
        total = sum(row)
        rows.append({"class": name, "images": total, "top1": row[i] / total if total else None})
    return rows


def most_confused(result: dict, top: int = MOST_CONFUSED) -> list[dict]:
    """The ``top`` largest off-diagonal counts: (true class, predicted class, images, share of the true class)."""
    names, matrix = result["class_names"], result["confusion"]
    pairs = [(count, i, j) for i, row in enumerate(matrix) for j, count in enumerate(row) if i != j and count]
    pairs.sort(key=lambda p: (-p[0], p[1], p[2]))
    return [{"true": names[i], "predicted": names[j], "images": count, "share": count / sum(matrix[i])}
            for count, i, j in pairs[:top]]


def summary_lines(result: dict) -> list[str]:
    epoch = f"epoch {result['epoch']}, " if result["epoch"] else ""
    flip = "on" if result["val_flip"] else "off"
    lines = [f"evaluated {result['model']} ({epoch}{result['weights']} weights, flip {flip}"
             f", resize {result['val_resize']} crop {result['crop_size']}) on {result['data']}: {result['images']} "
             f"images, {result['classes']} classes, {result['ranks']} rank(s) of the {result['engine']} engine, "
             f"{result['seconds']:.1f} s",
             f"top-1 {result['top1']:.4f}  top-5 {result['top5']:.4f}  loss {result['loss']:.4f}"]
    reported = result.get("run_reported")
    if reported:
        same = reported["val_top1"] == result["top1"] and reported["val_top5"] == result["top5"]
        lines.append(f"the run reported val_top1 {reported['val_top1']:.4f}, val_top5 {reported['val_top5']:.4f} at "
                     f"epoch {reported['epoch']} (flip {'on' if reported['val_flip'] else 'off'}): "
                     f"{'the same' if same else 'different (another flip, resize, crop or weights?)'}")
    return lines


def confused_table(result: dict) -> str:
    rows = [[p["true"], p["predicted"], p["images"], f"{p['share']:.1%}"] for p in most_confused(result)]
    return markdown_table(["true class", "predicted as", "images", "of the class"], rows) if rows else \
        "(no image was confused)"


def write_results(result: dict, paths: dict[str, str]) -> None:
    """The JSON, the Markdown and the confusion matrix's PNG (atomically), and the summary on stdout."""
    classes = per_class(result)
    write_json_atomically(paths["json"], {**result, "per_class": classes, "most_confused": most_confused(result)})
    confusion_png(result, paths["png"])
    lines = summary_lines(result)
    per_class_rows = [[c["class"], c["images"], "-" if c["top1"] is None else f"{c['top1']:.4f}"] for c in classes]
    markdown = "\n\n".join([f"# {os.path.basename(paths['md'])[:-3]}", "\n".join(f"- {line}" for line in lines),
                            "## The 10 most confused pairs", confused_table(result),
                            "## Per-class top-1", markdown_table(["class", "images", "top-1"], per_class_rows),
                            f"![confusion matrix]({os.path.basename(paths['png'])})"]) + "\n"
    write_text_atomically(paths["md"], markdown)
    print("\n".join(lines))
    print(confused_table(result))
    print(f"written: {paths['json']}, {os.path.basename(paths['md'])} and {os.path.basename(paths['png'])}",
          flush=True)


def confusion_png(result: dict, path: str) -> None:
    """The confusion matrix, each row as shares of its true class (so small classes show as well as large ones)."""
    matrix = torch.tensor(result["confusion"], dtype=torch.float64)
    shares = (matrix / matrix.sum(dim=1, keepdim=True).clamp(min=1)).numpy()
    n = len(shares)
    size = min(12.0, 3.0 + 0.35 * n)
    fig = figure(size + 1.5, size)
    ax = fig.add_subplot(1, 1, 1)
    shown = ax.imshow(shares, cmap="Blues", vmin=0, vmax=1, interpolation="nearest")
    fig.colorbar(shown, ax=ax, label="share of the true class")
    if n <= 40:
        names = [name[:20] for name in result["class_names"]]
        ax.set_xticks(range(n), names, rotation=90)
        ax.set_yticks(range(n), names)
    ax.set_xlabel("predicted class (top-1)")
    ax.set_ylabel("true class")
    ax.set_title(f"top-1 {result['top1']:.4f} on {result['images']} images")
    save_figure(fig, path)

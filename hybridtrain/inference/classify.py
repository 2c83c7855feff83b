"""``hybridtrain classify``: each picture's most likely classes under a trained model, prepared and scored as the run
validated (its resize, crop and normalisation; its train.val_flip), named by the run's classes."""
from __future__ import annotations

import json
import os
import sys

import torch
from PIL import Image

from hybridtrain.data.folder import is_image_file
from hybridtrain.data.images import to_rgb
from hybridtrain.data.loaders import device_images
from hybridtrain.data.presets import val_transform
from hybridtrain.engine.epoch import eval_logits
from hybridtrain.errors import UserError
from hybridtrain.inference.trained import Trained, build_model, load_trained
from hybridtrain.precision.scaler import create_precision
from hybridtrain.reports import markdown_table

BATCH = 64  # pictures per forward pass


def picture_paths(given: list[str]) -> list[str]:
    """The pictures named, a folder's image files (sorted, not recursive) in its place; one line for a path that
    does not exist or a folder without pictures."""
    paths = []
    for path in given:
        if os.path.isdir(path):
            found = sorted(os.path.join(path, f) for f in os.listdir(path)
                           if is_image_file(f) and os.path.isfile(os.path.join(path, f)))
            if not found:
                raise UserError(f"{path} holds no pictures (*.jpg, *.png, ...) directly in it: name the pictures, or "
                                f"the folder that holds them")
            paths += found
        elif os.path.isfile(path):
            paths.append(path)
        else:
            raise UserError(f"{path} does not exist: check the path")
    return paths


def decoded(paths: list[str], transform) -> tuple[list[tuple[str, torch.Tensor]], list[str]]:
    """(path, uint8 CHW tensor) of each picture that decodes, and one line for each that does not."""
    pictures, failures = [], []
    for path in paths:
        try:
            with Image.open(path) as img:
                pictures.append((path, transform(to_rgb(img))))
        except Exception as exc:  # every decoder failure: OSError, SyntaxError, DecompressionBombError, ...
            failures.append(f"hybridtrain: error: {path} is not a picture that can be decoded "
                            f"({type(exc).__name__}: {str(exc)[:120]}): not classified")
    return pictures, failures


def top_classes(trained: Trained, pictures: list[tuple[str, torch.Tensor]], top: int) -> list[dict]:
    """Each picture's ``top`` classes with their softmax probabilities (of the logits validation scores)."""
    cfg = trained.cfg
    device = torch.device("cuda" if cfg.train.device != "cpu" and torch.cuda.is_available() else "cpu")
    precision = create_precision(cfg.precision)
    model = build_model(trained, device, precision.policy)
    top = min(top, trained.num_classes)
    results = []
    with torch.no_grad():
        for start in range(0, len(pictures), BATCH):
            chunk = pictures[start:start + BATCH]
            images = torch.stack([tensor for _, tensor in chunk])
            if cfg.data.channels_last:
                images = images.contiguous(memory_format=torch.channels_last)
            images = device_images(images, device, precision.policy.input_dtype)
            probabilities = eval_logits(model, images, precision, cfg.train.val_flip).float().softmax(dim=1)
            values, indices = probabilities.topk(top, dim=1)
            for (path, _), p, i in zip(chunk, values.tolist(), indices.tolist()):
                results.append({"image": path, "top": [{"class": trained.label(c), "index": c, "probability": v}
                                                      for c, v in zip(i, p)]})
    return results


def classify_command(args) -> int:
    trained = load_trained(args.model)
    paths = picture_paths(args.images)
    d = trained.cfg.data
    pictures, failures = decoded(paths, val_transform(d.crop_size, d.val_resize, as_uint8=True))
    results = top_classes(trained, pictures, args.top) if pictures else []
    if args.json:
        for result in results:
            print(json.dumps(result))
    elif results:
        rows = [[result["image"] if k == 0 else "", k + 1, entry["class"], f"{entry['probability']:.4f}"]
                for result in results for k, entry in enumerate(result["top"])]
        print(markdown_table(["picture", "rank", "class", "probability"], rows))
    sys.stdout.flush()
    for line in failures:
        print(line, file=sys.stderr)
    return 1 if failures else 0

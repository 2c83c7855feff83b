"""The embedded dataset: scikit-learn's handwritten digits (1,797 real 8x8 images, 10 classes).

Written as 32x32 RGB JPEGs in the ImageNet folder layout with a fixed, seeded, stratified ~80/20 split,
so every backend reads it exactly as it would read ImageNet. No network is needed.
"""
from __future__ import annotations

import json
import os
import re

import numpy as np
from PIL import Image

from hybridtrain.data.prepare.ilsvrc_jobs import read_json
from hybridtrain.errors import UserError
from hybridtrain.files import finish_partial, start_partial

MARKER = ".hybridtrain-{dataset}.json"  # a prepared set's marker, named by its set: digits, mnist5k, synthetic-...
MARKER_RE = re.compile(r"\.hybridtrain-[a-z0-9-]+\.json")  # any set's (older versions marked every set -digits)
SIZE = 32


def stratified_split(labels: np.ndarray, val_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Indices of train and val: within each class a seeded shuffle, the first round(n*f) go to val."""
    rng = np.random.default_rng(seed)
    train, val = [], []
    for c in np.unique(labels):
        idx = np.flatnonzero(labels == c)
        rng.shuffle(idx)
        n_val = int(round(len(idx) * val_fraction))
        val.append(idx[:n_val])
        train.append(idx[n_val:])
    return np.sort(np.concatenate(train)), np.sort(np.concatenate(val))


def digit_to_image(pixels: np.ndarray) -> Image.Image:
    """8x8 values in [0, 16] -> 32x32 RGB (white digit on black), bicubic upscaling."""
    gray = Image.fromarray(np.clip(pixels * (255.0 / 16.0), 0, 255).astype(np.uint8), mode="L")
    return gray.resize((SIZE, SIZE), Image.BICUBIC).convert("RGB")


def prepared_counts(out: str, params: dict) -> dict | None:
    """The counts per split when ``out`` already holds this exact dataset (prepare-data is idempotent), None when it
    is free; raise if it holds something else. The prepare-data datasets' shared check (digits, mnist5k,
    synthetic ImageNet)."""
    if not os.path.exists(out):
        return None
    if not os.path.isdir(out):
        raise UserError(f"{out} exists and is not a directory: choose another --out")
    name = next((n for n in sorted(os.listdir(out)) if MARKER_RE.fullmatch(n)
                 and os.path.isfile(os.path.join(out, n))), None)
    if name is not None:
        found = read_json(os.path.join(out, name))
        if found == params:
            return _counts(out)
        what = found.get("dataset", "a dataset") if isinstance(found, dict) else "a dataset (damaged marker)"
        raise UserError(f"{out} holds {str(what)[:40]} prepared with other settings ({name}), left as it is: choose "
                        f"another --out (or give the settings it was prepared with)")
    if os.listdir(out):
        raise UserError(f"{out} is not empty and was not made by prepare-data: choose another --out")
    return None


def prepare_digits(out: str, val_fraction: float = 0.2, seed: int = 0) -> dict:
    """Write the dataset; idempotent. Returns counts per split."""
    from sklearn.datasets import load_digits

    params = {"dataset": "digits", "size": SIZE, "val_fraction": val_fraction, "seed": seed}
    if (done := prepared_counts(out, params)) is not None:
        return done
    digits = load_digits()
    return write_split_set(out, params, digits.target, lambda i: digit_to_image(digits.images[i]))


def write_split_set(out: str, params: dict, labels: np.ndarray, image_of) -> dict:
    """The seeded stratified split of ``labels`` as ``OUT/{train,val}/<label>/<index>.jpg`` (``image_of(i)``: sample
    i's PIL image), published in one rename (``publish``); digits' and mnist5k's writer. Returns counts per split."""
    train_idx, val_idx = stratified_split(labels, params["val_fraction"], params["seed"])
    tmp = start_partial(out)  # removes only an OUT.partial a previous run of ours left
    for split, indices in (("train", train_idx), ("val", val_idx)):
        for i in indices:
            class_dir = os.path.join(tmp, split, str(labels[i]))
            os.makedirs(class_dir, exist_ok=True)
            image_of(i).save(os.path.join(class_dir, f"{i:04d}.jpg"), quality=95)
    return publish(tmp, out, params)


def publish(tmp: str, out: str, params: dict) -> dict:
    """Mark the finished temporary tree and move it into place in one rename; returns counts per split."""
    with open(os.path.join(tmp, MARKER.format(dataset=params["dataset"])), "w") as fh:
        json.dump(params, fh)
    finish_partial(tmp, out)  # out: absent or empty, checked by prepared_counts
    return _counts(out)


def _counts(out: str) -> dict:
    return {split: sum(len(files) for _, _, files in os.walk(os.path.join(out, split))) for split in ("train", "val")}

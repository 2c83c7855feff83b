"""Procedural ImageNet-like JPEGs (``OUT/{train,val}/<class>/<image>.JPEG``) for pipeline benchmarks and tests.

Not noise: each image is a colour gradient with stripes and a few filled shapes. Every class has its own
hue, stripe direction and shape kind, so classes are learnable; positions, scales and colours jitter per
image. Sizes vary around ImageNet's typical 500x375, one image in four in portrait, so decoding and
resizing cost what they cost on ImageNet. Each image is drawn from its own seed (seed, split, class,
index), so the result does not depend on how work is spread over processes.
"""
from __future__ import annotations

import math
import os

import numpy as np
from PIL import Image, ImageDraw

from hybridtrain.data.prepare.digits import prepared_counts, publish
from hybridtrain.data.prepare.imagenet import run_all
from hybridtrain.errors import UserError
from hybridtrain.files import start_partial

SHAPES = ("ellipse", "rectangle", "triangle", "diamond")
SPLITS = ("train", "val")


def image_size(rng: np.random.Generator, typical: tuple[int, int]) -> tuple[int, int]:
    """(width, height): the typical landscape size scaled by 0.7-1.3, transposed one time in four."""
    scale = rng.uniform(0.7, 1.3)
    w, h = max(8, round(typical[0] * scale)), max(8, round(typical[1] * scale))
    return (h, w) if rng.random() < 0.25 else (w, h)


def hue_colour(hue: float, rng: np.random.Generator, brightness: float) -> np.ndarray:
    """An RGB colour (0-255) near ``hue`` in [0, 1) at the given brightness in (0, 1], slightly jittered."""
    angle = 2 * np.pi * (hue + rng.normal(0, 0.03))
    rgb = 0.5 + 0.5 * np.cos(angle - np.array([0.0, 2 * np.pi / 3, 4 * np.pi / 3]))
    return np.clip(255 * brightness * (0.3 + 0.7 * rgb) + rng.normal(0, 8, 3), 0, 255)


def background(c: int, num_classes: int, rng: np.random.Generator, w: int, h: int) -> np.ndarray:
    """Gradient between two class-hued colours, overlaid with stripes whose direction depends on the class."""
    hue = c / num_classes
    x, y = np.arange(w, dtype=np.float32)[None, :], np.arange(h, dtype=np.float32)[:, None]
    phi = float(rng.uniform(0, np.pi / 2))  # python floats keep the arrays float32
    t = (x * math.cos(phi) + y * math.sin(phi)) / (w * math.cos(phi) + h * math.sin(phi))
    start, end = hue_colour(hue, rng, 0.35), hue_colour(hue + 0.5, rng, 0.6)
    theta = math.pi * (c % 8) / 8 + float(rng.normal(0, 0.05))
    freq = 2 * math.pi * float(rng.uniform(6, 14)) / max(w, h)
    stripes = 30 * np.sin(freq * (x * math.cos(theta) + y * math.sin(theta)))
    shade = stripes + rng.integers(-6, 7, (h, w), dtype=np.int8)
    planes = [shade + float(a) + float(b - a) * t for a, b in zip(start, end)]  # per plane: 3-wide broadcasts are slow
    return np.stack(planes, axis=-1)


def draw_shapes(img: Image.Image, c: int, num_classes: int, rng: np.random.Generator) -> None:
    """A few filled shapes of the class's kind and hue at random places and scales."""
    draw = ImageDraw.Draw(img)
    w, h = img.size
    kind = SHAPES[(c // 8 + c) % len(SHAPES)]
    for _ in range(rng.integers(1, 4)):
        r = rng.uniform(0.1, 0.3) * min(w, h)
        cx, cy = rng.uniform(r, w - r), rng.uniform(r, h - r)
        fill = tuple(int(v) for v in hue_colour(c / num_classes + 0.25, rng, 0.8))
        if kind == "ellipse":
            draw.ellipse([cx - r, cy - 0.7 * r, cx + r, cy + 0.7 * r], fill=fill)
        elif kind == "rectangle":
            draw.rectangle([cx - r, cy - 0.6 * r, cx + r, cy + 0.6 * r], fill=fill)
        elif kind == "triangle":
            draw.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=fill)
        else:
            draw.polygon([(cx, cy - r), (cx + r, cy), (cx, cy + r), (cx - r, cy)], fill=fill)


def render(c: int, num_classes: int, rng: np.random.Generator, typical: tuple[int, int]) -> Image.Image:
    """One image of class ``c``."""
    w, h = image_size(rng, typical)
    pixels = background(c, num_classes, rng, w, h)
    img = Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8), mode="RGB")
    draw_shapes(img, c, num_classes, rng)
    return img


def write_class(job: tuple) -> int:
    """Render and save one (split, class) folder; returns the number of images written."""
    tmp, split, c, count, num_classes, seed, typical = job
    class_dir = os.path.join(tmp, split, f"n{c:08d}")  # a WordNet-id-like folder name
    os.makedirs(class_dir, exist_ok=True)
    for i in range(count):
        rng = np.random.default_rng([seed, SPLITS.index(split), c, i])
        path = os.path.join(class_dir, f"{split}_{c:05d}_{i:06d}.JPEG")
        render(c, num_classes, rng, typical).save(path, quality=int(rng.integers(80, 96)))
    return count


def prepare_synthetic_imagenet(out: str, num_classes: int = 100, train_per_class: int = 100,
                               val_per_class: int = 20, seed: int = 0, typical_size: tuple[int, int] = (500, 375),
                               workers: int = 0) -> dict:
    """Write the dataset with ``workers`` processes (0 = all cores); idempotent. Returns counts per split."""
    if num_classes < 2:
        raise UserError(f"--classes must be >= 2 (a classification dataset needs at least 2 classes), got "
                        f"{num_classes}")
    if min(typical_size) < 1:
        raise UserError(f"--size must be positive, got {typical_size[0]}x{typical_size[1]}: e.g. 500x375")
    params = {"dataset": "synthetic-imagenet", "num_classes": num_classes, "train_per_class": train_per_class,
              "val_per_class": val_per_class, "seed": seed, "typical_size": list(typical_size)}
    if (done := prepared_counts(out, params)) is not None:
        return done
    tmp = start_partial(out)  # removes only an OUT.partial a previous run of ours left
    per_split = {"train": train_per_class, "val": val_per_class}
    jobs = [(tmp, split, c, per_split[split], num_classes, seed, tuple(typical_size))
            for split in SPLITS for c in range(num_classes)]
    run_all(write_class, jobs, workers or os.cpu_count() or 1)
    return publish(tmp, out, params)

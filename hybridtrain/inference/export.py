"""``hybridtrain export``: a trained model as one file for inference, ONNX or TorchScript, with the run's
normalisation inside it, and checked before it is written: the file's outputs (ONNX Runtime on the CPU, or
TorchScript) against PyTorch's on real images of the run's validation data.

ONNX goes through torch.onnx's TorchScript-based exporter (``dynamo=False``): a ResNet needs nothing of the newer
torch.export-based one, which would add onnxscript to the extra, and ``dynamic_axes`` gives the batch axis.
"""
from __future__ import annotations

import contextlib
import os
import warnings

import torch

from hybridtrain.data.folder import scan_split
from hybridtrain.data.loaders import device_images
from hybridtrain.data.presets import IMAGENET_MEAN, IMAGENET_STD, val_transform
from hybridtrain.errors import UserError
from hybridtrain.files import check_output_file
from hybridtrain.inference.trained import Trained, build_model, load_trained, run_data_path
from hybridtrain.precision.scaler import create_precision

CHECK_IMAGES = 16  # real images the export is checked on
EXAMPLE_BATCH = 2  # the batch it is traced with: other than CHECK_IMAGES, so the check runs the dynamic batch axis
LIMIT = {torch.float32: 1e-4, torch.float16: 5e-2}  # max |logit difference| the check allows
OPSET = 17


class Normalised(torch.nn.Module):
    """The model with the ImageNet normalisation in front, as training applied it: (x - mean) / std on RGB in [0, 1]
    (``loaders.device_images``, after its x / 255)."""

    def __init__(self, model: torch.nn.Module, dtype: torch.dtype):
        super().__init__()
        self.model = model
        self.register_buffer("mean", torch.tensor(IMAGENET_MEAN, dtype=dtype).view(1, 3, 1, 1))
        self.register_buffer("std", torch.tensor(IMAGENET_STD, dtype=dtype).view(1, 3, 1, 1))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.model((images - self.mean) / self.std)


def check_images(trained: Trained) -> tuple[torch.Tensor, str]:
    """Up to CHECK_IMAGES uint8 images of the run's validation data (one class after another), prepared as the
    run validated them, and where they came from."""
    data = run_data_path(trained.cfg, trained.run_dir)
    if data is None or not os.path.isdir(os.path.join(data, "val")):
        raise UserError(f"the export is checked on the run's validation images, and its data.path="
                        f"{trained.cfg.data.path} has no val/ folder from here: run export in the folder the run was "
                        f"trained in, or where its data is")
    images = scan_split(data, "val")
    by_class: dict[int, list[str]] = {}
    for path, label in images.samples:
        by_class.setdefault(label, []).append(path)
    chosen = [paths[i] for i in range(max(map(len, by_class.values()))) for paths in by_class.values()
              if i < len(paths)][:CHECK_IMAGES]
    d = trained.cfg.data
    transform = val_transform(d.crop_size, d.val_resize, as_uint8=True)
    from PIL import Image

    from hybridtrain.data.images import to_rgb
    tensors = []
    for path in chosen:
        with Image.open(path) as img:
            tensors.append(transform(to_rgb(img)))
    return torch.stack(tensors), os.path.join(data, "val")


def exported_outputs(fmt: str, path: str, inputs: torch.Tensor) -> torch.Tensor:
    """The logits the exported file gives for ``inputs``: ONNX Runtime's (CPU) or the loaded TorchScript's."""
    if fmt == "onnx":
        import onnxruntime
        session = onnxruntime.InferenceSession(path, providers=["CPUExecutionProvider"])
        return torch.from_numpy(session.run(None, {"images": inputs.numpy()})[0])
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # torch 2.13 points TorchScript users to torch.export
        return torch.jit.load(path, map_location="cpu")(inputs)


def compare(reference: torch.Tensor, exported: torch.Tensor) -> dict:
    """max |difference| of the logits, and on how many images the top-1 class agrees."""
    difference = (reference.double() - exported.double()).abs()
    same = reference.argmax(dim=1) == exported.argmax(dim=1)
    first = int((~same).nonzero()[0]) if not bool(same.all()) else None
    return {"max_abs_diff": float(difference.max()), "same_top1": int(same.sum()), "images": len(same),
            "first_disagreement": first}


def check_export(fmt: str, path: str, reference: torch.Tensor, inputs: torch.Tensor, dtype: torch.dtype) -> dict:
    """The exported file against PyTorch's ``reference`` logits on ``inputs``; one line naming the difference when
    it exceeds LIMIT or a top-1 class differs."""
    found = compare(reference, exported_outputs(fmt, path, inputs))
    limit = LIMIT[dtype]
    if found["max_abs_diff"] > limit or found["first_disagreement"] is not None:
        runtime = "ONNX Runtime" if fmt == "onnx" else "TorchScript"
        what = (f"the top-1 class differs on {found['images'] - found['same_top1']} of {found['images']} images "
                f"(first: image {found['first_disagreement']})" if found["first_disagreement"] is not None else
                f"the same top-1 on all {found['images']} images")
        raise UserError(f"the exported model disagrees with PyTorch: {runtime} gives logits up to "
                        f"{found['max_abs_diff']:.3g} away (limit {limit:g}), {what}: nothing was written; report "
                        f"this with the torch and {runtime} versions")
    return found


def write_export(fmt: str, wrapped: torch.nn.Module, example: torch.Tensor, path: str) -> None:
    """``wrapped`` traced on ``example`` into ``path`` as ONNX (batch axis dynamic) or TorchScript."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the exporters' deprecation and tracer notes: the check below says enough
        if fmt == "onnx":
            torch.onnx.export(wrapped, (example,), path, dynamo=False, input_names=["images"],
                              output_names=["logits"], opset_version=OPSET,
                              dynamic_axes={"images": {0: "batch"}, "logits": {0: "batch"}})
        else:
            with torch.no_grad():
                traced = torch.jit.trace(wrapped, example)  # a convolutional net: no shape-dependent branch
            torch.jit.save(traced, path)


def require_onnx() -> tuple[str, str]:
    """The versions of onnx and ONNX Runtime, or one line naming the extra that installs them."""
    try:
        import onnx
        import onnxruntime
    except ImportError as exc:
        raise UserError(f"--format onnx needs onnx and onnxruntime ({exc.name} is not installed): pip install "
                        f"'hybridtrain[export]' (or pip install onnx onnxruntime)") from None
    return onnx.__version__, onnxruntime.__version__


def new_output(path: str) -> str:
    """--out: a new file in an existing folder; an existing file or a link there is never replaced."""
    if os.path.lexists(path):
        kind = "a symbolic link" if os.path.islink(path) else "a folder" if os.path.isdir(path) else "a file"
        raise UserError(f"--out {path} exists ({kind}): export never replaces it: choose a new file name, or move it "
                        f"away first")
    return check_output_file(path, "--out", "model.onnx")


def export_command(args) -> int:
    path = new_output(args.out)
    versions = require_onnx() if args.format == "onnx" else None
    trained = load_trained(args.model)
    dtype = torch.float16 if args.fp16 else torch.float32
    images, where = check_images(trained)
    precision = create_precision(trained.cfg.precision)
    model = build_model(trained, torch.device("cpu"), precision.policy)
    model = model.to(dtype=torch.float32, memory_format=torch.contiguous_format)
    with torch.no_grad():  # the reference: the run's own preparation of the same images (x / 255, normalised)
        reference = model(device_images(images, torch.device("cpu"), torch.float32))
    wrapped = Normalised(model.to(dtype), dtype).eval()
    inputs = images.to(dtype) / 255
    with torch.no_grad():
        if dtype != torch.float32:  # the FP16 file is held to the FP16 model's logits
            reference = wrapped(inputs).float()
    tmp = os.path.join(os.path.dirname(os.path.abspath(path)), f".{os.path.basename(path)}.tmp-{os.getpid()}")
    try:
        write_export(args.format, wrapped, inputs[:EXAMPLE_BATCH], tmp)
        found = check_export(args.format, tmp, reference, inputs, dtype)
        os.link(tmp, path)  # never over a file that appeared meanwhile
    except FileExistsError:
        raise UserError(f"--out {path} appeared while exporting: nothing replaced it; choose a new file name") from None
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
    describe(args, trained, path, found, where, versions, dtype)
    return 0


def describe(args, trained: Trained, path: str, found: dict, where: str, versions, dtype: torch.dtype) -> None:
    """What was written and how it was checked."""
    d, kind = trained.cfg.data, "float16" if dtype == torch.float16 else "float32"
    fmt = f"ONNX (opset {OPSET})" if args.format == "onnx" else "TorchScript"
    print(f"exported {trained.path} ({trained.which} weights) to {path}: {fmt}, "
          f"{'FP16' if dtype == torch.float16 else 'FP32'}, eval mode")
    print(f"input 'images': {kind} N x 3 x {d.crop_size} x {d.crop_size}, RGB in [0, 1] (resize the shorter side to "
          f"{d.val_resize} px, center crop {d.crop_size}, divide by 255); the ImageNet mean/std normalisation is "
          f"inside the model; N (the batch) is free")
    print(f"output 'logits': {kind} N x {trained.num_classes} (softmax for probabilities), classes in the order of "
          f"the run's class folders")
    runtime = f"ONNX Runtime {versions[1]} (CPU)" if versions else f"TorchScript (torch {torch.__version__})"
    print(f"checked with {runtime} against PyTorch on {found['images']} images of {where}: max |logit difference| "
          f"{found['max_abs_diff']:.3g} (limit {LIMIT[dtype]:g}), the same top-1 on {found['same_top1']} of "
          f"{found['images']}", flush=True)

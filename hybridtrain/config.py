"""Declarative, validated configuration: defaults in code, one YAML per recipe, ``--set`` overrides.

Every key is public interface. ``load_config`` returns a validated :class:`Config`; any unknown key,
wrong type or out-of-range value raises :class:`UserError` with one line naming the key and what is allowed.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import re
import reprlib
from dataclasses import dataclass, field
from typing import Any

import yaml

from hybridtrain.errors import UserError, dangling_link

MAX_STEP_SIZE = 1e4  # lr, alpha, weight decay, trust coefficient, gamma: see OptimConfig


def choice(default, choices, doc=""):
    return field(default=default, metadata={"choices": tuple(choices), "doc": doc})


def number(default, lo=None, hi=None, lo_open=False, hi_open=False, doc=""):
    """An int or float key in [lo, hi] (open ends with lo_open/hi_open). Floats are finite: NaN and +-inf are refused
    for every key (no key gives infinity a meaning), so a bound left out means any finite value."""
    return field(default=default, metadata={"lo": lo, "hi": hi, "lo_open": lo_open, "hi_open": hi_open, "doc": doc})


def numbers(default, lo=None, hi=None, lo_open=False, hi_open=False, length=None, increasing=False, doc=""):
    """A list of finite numbers, each in [lo, hi] like ``number``; ``length``: exactly that many; ``increasing``:
    strictly increasing."""
    return field(default_factory=lambda: list(default),
                 metadata={"items": {"lo": lo, "hi": hi, "lo_open": lo_open, "hi_open": hi_open},
                           "length": length, "increasing": increasing, "doc": doc})


def plain(default, doc=""):
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata={"doc": doc})
    return field(default=default, metadata={"doc": doc})


ARCHS = ("resnet18", "resnet34", "resnet50", "resnet101", "resnet152")

# Every size, count and seed has an upper bound that the hardware makes sensible; past it a run ends in a traceback
# or the OOM killer, not in a result. The error line states the range. One reason each:
#   data.crop_size <= 1024            ResNet at 1024 px already needs 21x the activation memory of 224 px
#   data.val_resize <= 2048           twice the largest crop; a larger resize only costs decode time
#   data.workers <= 256               loader processes per rank; no host has that many cores per rank
#   data.prefetch <= 32               batches held per worker: 32 x 154 MB (256 x 224 px FP32) is 4.9 GB already
#   data.synthetic_images <= 1e8      78 ImageNet-1k epochs in one epoch
#   train.batch_size, data.val_batch_size <= 65536   a 224-px FP32 batch of 65536 is 39 GB of input alone
#   train.accumulation_steps <= 1024  at batch 64 that is 65536 images per rank per step, past every large-batch recipe
#   train.epochs, optim.adabound_epochs, optim.warmup_epochs <= 10000   the paper trains 90; LR tables grow with them
#   train.threads <= 1024             torch threads per rank; more than any host's cores only thrash
#   train.keep_checkpoints <= 1000    ~300 MB per ResNet-50 checkpoint with optimizer state: 300 GB
#   model.num_classes <= 100000       ImageNet-21k has 21841; a 2048 x 100000 FC layer is 819 MB of FP32 weights
#   seed <= 1000000                   each image's augmentation seed packs (seed, epoch, index) into torch's 64 bits
#   precision.loss_scale <= 2**24     FP16's largest value is 65504: a bigger scale overflows every gradient > 0.004
#   precision.growth_interval <= 1e6, max_consecutive_overflows <= 1e5   longer than a 90-epoch ImageNet run's steps
#   horovod.gradient_predivide_factor <= 1024   more than the ranks of any job underflows FP16 gradients
#   horovod.fusion_threshold_mb <= 1024   allocated on every GPU; 1 GiB holds ResNet-152's 230 MB of gradients 4x
#   horovod.cycle_time_ms <= 1000     each step waits up to one cycle per fused all-reduce
#   horovod.stall_warning_s, stall_shutdown_s, gloo_timeout_s <= 86400   a day: longer is a hung job
#   elastic.commit_steps <= 100000    a failed rank costs up to N steps: more than a 90-epoch run at global batch 2048


@dataclass
class DataConfig:
    path: str = plain("data/digits", "dataset root holding train/<class>/*.jpg and val/<class>/*.jpg")
    backend: str = choice("torchvision", ["torchvision", "dali_cpu", "dali_gpu", "synthetic"],
                          "input pipeline: torchvision (PIL workers), dali_cpu, dali_gpu (nvJPEG), synthetic")
    file_lists: str = plain("", "folder with the clean train.txt/val.txt of 'hybridtrain check-data --write-filelist'; "
                                "'' = scan the class folders")
    crop_size: int = number(224, lo=8, hi=1024, doc="training crop (RandomResizedCrop) and validation center crop, px")
    val_resize: int = number(256, lo=8, hi=2048, doc="validation: resize the shorter side to this, then center-crop")
    min_crop_area: float = number(0.08, lo=0.0, hi=1.0, lo_open=True, doc="RandomResizedCrop area lower bound")
    hflip: bool = plain(True, "random horizontal flip with p=0.5 in training")
    workers: int = number(0, lo=0, hi=256, doc="per rank: DataLoader worker processes (torchvision) or DALI "
                                                 "threads; 0 = cores / local ranks")
    in_process: bool = plain(False, "torchvision: decode and augment in the rank's own process, with no worker "
                                    "processes (to debug a transform, or for data so small that starting workers "
                                    "costs more than it saves); the same batches, one at a time")
    prefetch: int = number(2, lo=1, hi=32,
                           doc="batches prefetched per worker (torchvision) or DALI prefetch queue depth")
    channels_last: bool = plain(False, "NHWC (channels_last) memory layout for input batches and the model")
    synthetic_images: int = number(12800, lo=1, hi=100_000_000,
                                   doc="synthetic: training images per epoch over all ranks")
    val_batch_size: int = number(0, lo=0, hi=65536, doc="validation batch per rank; 0 = train.batch_size")


@dataclass
class ModelConfig:
    arch: str = choice("resnet50", ARCHS, "network")
    variant: str = choice("v1.5", ["v1", "v1.5"],
                          "where bottleneck blocks downsample: 1x1 conv (v1) or 3x3 conv (v1.5)")
    small_input_stem: bool = plain(False, "3x3 stride-1 stem without max-pool, for 32-64 px inputs")
    num_classes: int = number(0, lo=0, hi=100_000, doc="0 = number of class folders in the dataset")
    zero_init_last_bn: bool = plain(True, "gamma = 0 in the last BN of every residual block (paper 2.2.3)")
    residual_bn_scale: float = number(1.0, lo=0.0, hi=1.0, lo_open=True,
                                      doc="multiply every BN output inside residual blocks by this (seed 002: 0.25)")
    bn_swap: bool = plain(False, "seed 002's BN swap in the last BN of each block: y = gamma*(x_hat + shortcut) + beta")
    conv_init: str = choice("kaiming", ["kaiming", "xavier", "gaussian"],
                            "convolution init: kaiming N(0, 2/fan_in) (the paper), xavier N(0, 2/(fan_in+fan_out)), "
                            "or gaussian N(0, gaussian_std^2) (Table 3.5)")
    gaussian_std: float = number(1.0, lo=0.0, lo_open=True, doc="conv_init=gaussian: the standard deviation "
                                                                "(the paper's Table 3.5: 1)")


@dataclass
class TrainConfig:
    epochs: int = number(90, lo=1, hi=10_000, doc="training epochs")
    batch_size: int = number(256, lo=1, hi=65536, doc="per-rank (per-GPU) batch size; global = batch_size x "
                                                       "ranks x accumulation_steps")
    accumulation_steps: int = number(1, lo=1, hi=1024,
                                     doc="forward/backward passes per optimizer step, one all-reduce per "
                                         "step (the paper's future work, 4)")
    threads: int = number(0, lo=0, hi=1024, doc="torch threads per rank; 0 = cores / local ranks")
    keep_checkpoints: int = number(3, lo=1, hi=1000, doc="how many epoch checkpoints to keep")
    progress: bool = plain(True, "progress bar on rank 0")
    deterministic: bool = plain(False, "deterministic algorithms only: bitwise-repeatable runs and exact resumes")
    compile: bool = plain(False, "torch.compile the model for the training step (the first steps compile; needs "
                                 "g++ on the CPU, a C compiler for Triton on the GPU)")
    compile_scope: str = choice("blocks", ["blocks", "model"],
                                "with train.compile: blocks compiles each residual block apart, so Horovod's "
                                "gradient hooks fire block by block and the all-reduce overlaps the backward; "
                                "model compiles the whole network as one graph (its hooks all fire at the end)")
    cuda_graphs: bool = plain(False, "replay forward, loss and backward from one CUDA graph captured on a static batch "
                                     "(needs a GPU); the all-reduce and the optimizer step stay eager")
    device: str = choice("auto", ["auto", "cuda", "cpu"],
                         "auto: each rank's own GPU when CUDA works, else the CPU; cuda: a GPU or one error line "
                         "saying why not; cpu: the CPU even on a GPU host")


# optim.name -> the flags config checks: the keys of optim.factory.OPTIMIZERS and their Spec flags, written here so
# that config imports no torch (tests/test_optim_math.py checks that they agree)
OPTIMIZER_FLAGS = {"hybrid": ("fusable", "needs_fp32_state"), "adabound": ("fusable", "needs_fp32_state"),
                   "goyal": (), "sgd": ()}


@dataclass
class OptimConfig:
    name: str = choice("hybrid", list(OPTIMIZER_FLAGS),
                       "hybrid (AdaBound warmup -> LARS-SGD, the paper), adabound, goyal or sgd (baselines)")
    # The step sizes are bounded far above any that trains (the paper's largest is lr x N = 0.1 x 24) and far below
    # the float range, which lr x ranks x warmup and the bounds' arithmetic would otherwise leave (inf, then NaN).
    lr: float = number(0.1, lo=0.0, hi=MAX_STEP_SIZE, lo_open=True,
                       doc="single-GPU SGD learning rate; scaled by the number of ranks")
    momentum: float = number(0.9, lo=0.0, hi=1.0, hi_open=True, doc="SGD momentum")
    weight_decay: float = number(1e-4, lo=0.0, hi=MAX_STEP_SIZE, doc="L2 weight decay")
    decay_bn_and_bias: bool = plain(False, "apply weight decay and LARS to BN parameters and biases too")
    # hybrid / adabound
    adabound_epochs: int = number(10, lo=0, hi=10_000, lo_open=True, doc="hybrid: T, the AdaBound warmup epochs")
    alpha: float = number(1e-3, lo=0.0, hi=MAX_STEP_SIZE, lo_open=True,
                          doc="hybrid/adabound: Adam-phase learning rate alpha")
    betas: list = numbers([0.9, 0.999], lo=0.0, hi=1.0, hi_open=True, length=2, doc="hybrid/adabound: (beta1, beta2)")
    eps: float = number(1e-8, lo=0.0, hi=1.0, lo_open=True, doc="hybrid/adabound: epsilon")
    bound_granularity: str = choice("iteration", ["iteration", "epoch"],
                                    "hybrid: t in B_l(t), B_u(t) advances per iteration or per epoch")
    kappa: float = number(0.9, lo=0.0, hi=1.0, lo_open=True, doc="hybrid: SGD-phase decay lr*N*kappa^epoch")
    kappa_origin: str = choice("switch", ["switch", "zero"], "hybrid: kappa exponent counts from T or from 0")
    lars: str = choice("scale", ["scale", "clip", "none"], "hybrid: LARS trust-ratio scaling, LARC clipping, or none")
    fused: bool = plain(False, "hybrid and adabound: the updates as compiled kernels (torch.compile, one fused loop "
                               "per tensor) with the schedule's values in device tensors; the first steps compile")
    trust_coefficient: float = number(0.02, lo=0.0, hi=MAX_STEP_SIZE, lo_open=True,
                                      doc="hybrid: LARS trust coefficient eta (chosen by experiment lars)")
    adabound_gamma: float = number(1e-3, lo=0.0, hi=MAX_STEP_SIZE, lo_open=True,
                                   doc="adabound: convergence speed gamma of the bounds")
    # goyal / sgd
    warmup_epochs: float = number(5.0, lo=0.0, hi=10_000.0,
                                  doc="goyal: gradual warmup from lr to lr x N over this many epochs")
    milestones: list = numbers([1 / 3, 2 / 3, 8 / 9], lo=0.0, hi=1.0, lo_open=True, hi_open=True, increasing=True,
                               doc="goyal/sgd: step decay points as fractions of the run")
    decay_factor: float = number(0.1, lo=0.0, hi=1.0, lo_open=True, doc="goyal/sgd: step decay multiplier")


@dataclass
class PrecisionConfig:
    mode: str = choice("fp32", ["fp32", "fp64", "mixed", "layered", "fp16_pure"],
                       "fp32; fp64; mixed (FP16/BF16 compute, FP32 master weights, the paper); layered (per stage, "
                       "seed 000); fp16_pure (no FP32 copy, seed 002)")
    compute_dtype: str = choice("fp16", ["fp16", "bf16"], "mixed: the reduced dtype of forward and backward")
    layers: dict = plain({"stem": "fp32", "layer1": "fp16", "layer2": "fp16", "layer3": "fp16", "layer4": "fp16",
                          "fc": "fp32"}, "layered: dtype (fp32, fp16 or bf16) per stage; seed 000's default")
    loss_scaling: str = choice("auto", ["auto", "dynamic", "static", "none"],
                               "auto = dynamic whenever FP16 computes, else none")
    loss_scale: float = number(65536.0, lo=0.0, hi=2.0 ** 24, lo_open=True,
                               doc="static: the scale; dynamic: the initial scale")
    growth_interval: int = number(2000, lo=1, hi=1_000_000, doc="dynamic: double the scale after this many clean steps")
    tf32: bool = plain(False, "let FP32 convolutions and matmuls use TF32 on Ampere and newer GPUs (faster, 10-bit "
                              "mantissa); false keeps fp32 IEEE, so fp32 rows of a precision study are fp32")
    max_consecutive_overflows: int = number(20, lo=1, hi=100_000,
                                            doc="skip a step whose averaged gradients hold NaN or inf (FP16 "
                                                "overflow, or a NaN/inf loss on any rank); stop the run "
                                                "after this many skipped steps in a row")


@dataclass
class HorovodConfig:
    compression: str = choice("auto", ["auto", "fp16", "none"],
                              "gradient all-reduce compression: fp16 (the paper; needs loss scaling), none, or auto "
                              "= fp16 when the loss is scaled, else none")
    gradient_predivide_factor: float = number(1.0, lo=1.0, hi=1024.0,
                                              doc="divide gradients by f before the sum and by N/f after: keeps "
                                                  "FP16 sums over many ranks finite")
    # fusion_threshold_mb and cycle_time_ms: defaults chosen with hybridtrain scale (docs/benchmarks.md)
    fusion_threshold_mb: int = number(128, lo=0, hi=1024,
                                      doc="HOROVOD_FUSION_THRESHOLD in MiB: gradients ready together are "
                                          "all-reduced in one buffer up to this size; 0 = no fusion")
    cycle_time_ms: float = number(1.0, lo=0.0, hi=1000.0, lo_open=True,
                                  doc="HOROVOD_CYCLE_TIME: ms between the background "
                                      "thread's rounds of collecting ready tensors")
    autotune: bool = plain(False, "HOROVOD_AUTOTUNE: Horovod tunes fusion threshold and cycle time while training "
                                  "(Bayesian optimisation over the first steps)")
    autotune_log: str = plain("", "HOROVOD_AUTOTUNE_LOG: CSV of every setting autotune tried, written by rank 0; "
                                  "'' = none; needs autotune: true")
    stall_warning_s: int = number(60, lo=1, hi=86400,
                                  doc="HOROVOD_STALL_CHECK_TIME_SECONDS: warn, naming the missing ranks, "
                                      "when some ranks wait this long for a tensor the others submitted")
    stall_shutdown_s: int = number(600, lo=0, hi=86400,
                                   doc="HOROVOD_STALL_SHUTDOWN_TIME_SECONDS: end the job after such a "
                                       "stall (a hung rank); a rank's own long work (validation, a checkpoint "
                                       "write, a first compile) is no stall; 0 = never (Horovod's default)")
    gloo_timeout_s: int = number(60, lo=1, hi=86400,
                                 doc="HOROVOD_GLOO_TIMEOUT_SECONDS: how long Gloo waits for every rank "
                                     "to connect at start")


@dataclass
class DistributedConfig:
    engine: str = choice("auto", ["auto", "horovod", "torch"],
                         "the data-parallel engine: horovod (horovodrun, mpirun), torch (torch.distributed DDP under "
                         "torchrun or srun), or auto = the launcher's, else horovod where it is installed")


@dataclass
class BNConfig:
    stats: str = choice("last_iteration", ["last_iteration", "moving_average"],
                        "running statistics: those of the last training iteration (paper 2.2.3), or a moving average")
    momentum: float = number(0.1, lo=0.0, hi=1.0, lo_open=True,
                             doc="moving_average: running = (1 - momentum) * running + momentum * batch")
    combine: str = choice("mean", ["mean", "pooled"],
                          "how ranks' running statistics are averaged before validation and checkpoints: mean of "
                          "means and of variances (the paper), or the exact pooled variance")
    sync: bool = plain(False, "cross-rank BN statistics every iteration (hvd.SyncBatchNorm on GPUs)")
    per_rank_batch: str = choice("fixed", ["fixed", "random"],
                                 "fixed per-rank batch (the paper), or a random split of each global batch over "
                                 "the ranks, with the gradient weighted to equal the global-batch gradient")


@dataclass
class ElasticConfig:
    commit_steps: int = number(20, lo=1, hi=100_000,
                               doc="train --elastic: commit the training state in memory every N optimizer "
                                   "steps; a failed rank costs at most N steps, a resize waits up to N")
    audit_samples: bool = plain(False, "each rank writes the sample indices of the steps it trained (under --elastic: "
                                       "committed) to run_dir/samples/, to check that no sample is repeated or "
                                       "skipped")


@dataclass
class ReportConfig:
    top1_target: float = number(0.75, lo=0.0, hi=1.0, lo_open=True, doc="convergence: val top-1 target (paper: 0.75)")
    top5_target: float = number(0.93, lo=0.0, hi=1.0, lo_open=True, doc="val top-5 target (paper: 0.93)")
    tensorboard: bool = plain(True, "rank 0 writes TensorBoard scalars to run_dir/tensorboard")


@dataclass
class Config:
    run_dir: str = plain("runs/default", "where checkpoints, metrics and reports go")
    seed: int = number(0, lo=0, hi=1_000_000, doc="global seed")
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    horovod: HorovodConfig = field(default_factory=HorovodConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    bn: BNConfig = field(default_factory=BNConfig)
    elastic: ElasticConfig = field(default_factory=ElasticConfig)
    report: ReportConfig = field(default_factory=ReportConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def fingerprint(self) -> str:
        """The recipe's identity: the engine is left out (a run resumes under either with the same math)."""
        recipe = {key: value for key, value in self.to_dict().items() if key != "distributed"}
        return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:16]


# ----------------------------------------------------------------------------- building from dicts

_REPR = reprlib.Repr()
_REPR.maxstring, _REPR.maxother, _REPR.maxlong, _REPR.maxlevel = 80, 80, 40, 3
_REPR.maxlist = _REPR.maxdict = _REPR.maxtuple = _REPR.maxset = 6


def show(value) -> str:
    """A value for an error line: one line, at most ~100 characters, and cheap even for a YAML alias bomb."""
    return _REPR.repr(value)


def printable(text: str) -> str:
    """A path as written when it prints on one line, else its escaped repr (a newline in a name stays one line)."""
    return text if text.isprintable() else show(text)


def edit_distance(a: str, b: str) -> int:
    """Optimal-string-alignment distance: insertions, deletions, substitutions and swaps of neighbours, each 1."""
    rows = [list(range(len(b) + 1))]
    for i, ca in enumerate(a, 1):
        row = [i]
        for j, cb in enumerate(b, 1):
            row.append(min(rows[-1][j] + 1, row[j - 1] + 1, rows[-1][j - 1] + (ca != cb)))
            if i > 1 and j > 1 and ca == b[j - 2] and a[i - 2] == cb:
                row[j] = min(row[j], rows[-2][j - 2] + 1)
        rows.append(row)
    return rows[-1][-1]


def typo_limit(key: str) -> int:
    """The edit distance within which ``key`` is a typo of another key: 1 below 5 letters, 2 below 10, else 3."""
    return 1 if len(key) < 5 else 2 if len(key) < 10 else 3


def all_keys(cls=None, prefix: str = "") -> list[str]:
    """Every dotted key of the config, sections included (``train``, ``train.epochs``, ...)."""
    keys = []
    for f in dataclasses.fields(cls or Config):
        keys.append(prefix + f.name)
        default = _default(f)
        if dataclasses.is_dataclass(default):
            keys += all_keys(type(default), f"{prefix}{f.name}.")
    return keys


def _unique_nearest(key: str, names: list[str]) -> str | None:
    """The one name within ``typo_limit`` of ``key`` and nearer than every other, else None."""
    ranked = sorted((edit_distance(key, n), n) for n in names)
    if not ranked or ranked[0][0] > typo_limit(key) or (len(ranked) > 1 and ranked[1][0] == ranked[0][0]):
        return None
    return ranked[0][1]


def _shortened(key: str, names: list[str]) -> str | None:
    """The one name whose words start with the words of ``key`` in order (``crop`` -> ``crop_size``, ``accum_steps``
    -> ``accumulation_steps``, ``classes`` -> ``num_classes``), else None."""
    def fits(name):
        words = iter(name.split("_"))
        return all(any(w.startswith(part) for w in words) for part in key.split("_"))
    found = [n for n in names if n != key and fits(n)]
    if len(found) > 1:  # crop: crop_size rather than min_crop_area
        found = [n for n in found if n.startswith(key.split("_")[0])]
    return found[0] if len(found) == 1 else None


def suggest_key(dotted: str) -> str | None:
    """The key that an unknown dotted key was meant to be: a near spelling in its section; else the same or a near
    name in another section (``data.batch_size`` -> ``train.batch_size``, not ``data.val_batch_size``); else the one
    key of its section that it shortens; else a name one letter off in another section. None when no key is clearly
    meant: a wrong guess would set another key."""
    section, _, key = dotted.rpartition(".")
    keys = all_keys()
    here = [k.rpartition(".")[2] for k in keys if k.rpartition(".")[0] == section]
    near = _unique_nearest(key, here)
    if near is not None:
        return f"{section}.{near}" if section else near
    sections = {k.rpartition(".")[0] for k in keys}
    elsewhere = [k for k in keys if k.rpartition(".")[0] != section and k not in sections]  # keys, not sections
    same = [k for k in elsewhere if k.rpartition(".")[2] == key]
    if len(same) == 1:
        return same[0]
    short = _shortened(key, here)
    if short is not None:
        return f"{section}.{short}" if section else short
    near = _unique_nearest(key, [k.rpartition(".")[2] for k in elsewhere]) if len(key) >= 5 else None
    found = [k for k in elsewhere if k.rpartition(".")[2] == near]
    return found[0] if not same and len(found) == 1 and edit_distance(key, near) == 1 else None


def _suggest(dotted: str) -> str:
    near = suggest_key(dotted)
    return f" (did you mean '{near}'?)" if near else ""


def _default(f: dataclasses.Field):
    return f.default if f.default is not dataclasses.MISSING else f.default_factory()


def _coerce(value: Any, f: dataclasses.Field, dotted: str):
    """Check a value against a field's declared type and constraints; return it typed."""
    default = _default(f)
    meta = f.metadata
    expected = type(default)
    if expected is bool:
        if not isinstance(value, bool):
            raise UserError(f"config error: {dotted} must be true or false, got {show(value)}")
    elif expected is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise UserError(f"config error: {dotted} must be an integer, got {show(value)}")
    elif expected is float:
        value = _as_float(value, meta, dotted)
    elif expected is str:
        if not isinstance(value, str):
            hint = (f" (YAML reads that unquoted value as a {type(value).__name__}: to mean the text, quote it, e.g. "
                    f"{dotted.rpartition('.')[2]}: \"...\")" if value is None or isinstance(value, (bool, int, float))
                    else "")
            raise UserError(f"config error: {dotted} must be a string, got {show(value)}{hint}")
        if "\0" in value:
            raise UserError(f"config error: {dotted} holds a NUL character (\\0), which no path or name may hold: "
                            f"remove it")
    elif expected is list:
        if not isinstance(value, list):
            raise UserError(f"config error: {dotted} must be a list, got {show(value)}")
        if "items" in meta:
            value = _check_numbers(value, meta, dotted)
    elif expected is dict:
        if not isinstance(value, dict):
            raise UserError(f"config error: {dotted} must be a mapping, got {show(value)}")
        value = {**default, **value}  # a partial mapping overrides only the keys it names
    if "choices" in meta and value not in meta["choices"]:
        allowed = ", ".join(str(c) for c in meta["choices"])
        raise UserError(f"config error: {dotted} must be one of: {allowed}; got {show(value)}")
    _check_range(value, meta, dotted)
    return value


def _span(meta) -> str:
    """The allowed range as the error line writes it, e.g. [1, 65536] or (0.0, inf)."""
    lo, hi = meta.get("lo"), meta.get("hi")
    left = "(" if meta.get("lo_open") or lo is None else "["
    right = ")" if meta.get("hi_open") or hi is None else "]"
    return f"{left}{'-inf' if lo is None else lo}, {'inf' if hi is None else hi}{right}"


def _as_float(value, meta, dotted) -> float:
    """A real, finite number as float: NaN and +-inf are refused for every key (none gives infinity a meaning)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        hint = ""
        if isinstance(value, str):
            try:
                if math.isfinite(float(value)):
                    hint = f" (quoted, {value} is text: write it without quotes)"
            except ValueError:
                pass
        raise UserError(f"config error: {dotted} must be a number, got {show(value)}{hint}")
    try:
        number_ = float(value)
    except OverflowError:  # an int beyond the float range, e.g. 10**400
        number_ = math.inf if value > 0 else -math.inf
    if not math.isfinite(number_):
        raise UserError(f"config error: {dotted} must be a finite number in {_span(meta)}, got {show(value)} "
                        f"(NaN and infinity are never allowed)")
    return number_


def _check_numbers(values: list, meta, dotted) -> list:
    """A list of finite numbers, each in the declared range, of the declared length, increasing if declared."""
    items = meta["items"]
    length = meta.get("length")
    increasing = "strictly increasing " if meta.get("increasing") else ""
    what = (f"{'two' if length == 2 else length} {increasing}numbers" if length else
            f"a {increasing}list of numbers") + f" in {_span(items)}"
    wrong = f"config error: {dotted} must be {what}, got {show(values)}"
    if length is not None and len(values) != length:
        raise UserError(wrong)
    out = []
    for i, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise UserError(wrong)
        out.append(_as_float(v, items, f"{dotted}[{i}]"))
        _check_range(out[-1], items, f"{dotted}[{i}]")
    if meta.get("increasing") and any(b <= a for a, b in zip(out, out[1:])):
        raise UserError(wrong)
    return out


def _check_range(value, meta, dotted):
    lo, hi = meta.get("lo"), meta.get("hi")
    if lo is None and hi is None:
        return
    too_low = lo is not None and (value <= lo if meta.get("lo_open") else value < lo)
    too_high = hi is not None and (value >= hi if meta.get("hi_open") else value > hi)
    if too_low or too_high:
        raise UserError(f"config error: {dotted} must be in {_span(meta)}, got {show(value)}")


def _build(cls, values: dict, prefix: str = ""):
    if not isinstance(values, dict):
        raise UserError(f"config error: section '{prefix.rstrip('.') or 'top level'}' must be a mapping, got "
                        f"{show(values)}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in values.items():
        dotted = f"{prefix}{key}"
        if key not in fields:
            allowed = ", ".join(fields)
            raise UserError(f"config error: unknown key '{show(dotted)[1:-1]}'{_suggest(str(dotted))}; "
                            f"allowed here: {allowed}")
        f = fields[key]
        default = _default(f)
        if dataclasses.is_dataclass(default):
            kwargs[key] = _build(type(default), {} if value is None else value, f"{dotted}.")
        else:
            kwargs[key] = _coerce(value, f, dotted)
    return cls(**kwargs)


class DuplicateKey(yaml.YAMLError):
    def __init__(self, key, line: int, first_line: int):
        super().__init__(f"key {key!r} at line {line} repeats line {first_line}")
        self.key, self.line, self.first_line = key, line, first_line


class StrictLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a key written twice in one mapping (at any depth), where PyYAML keeps the
    last silently: a second ``train:`` section would replace the whole first one. Merge keys (``<<``) still
    override as YAML says."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            merge_sections_deeply(node)
            seen: dict = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                line = key_node.start_mark.line + 1
                try:
                    if key in seen:
                        raise DuplicateKey(key, line, seen[key])
                    seen[key] = line
                except TypeError:  # an unhashable key: the SafeLoader itself refuses it next
                    continue
        return super().construct_mapping(node, deep)


MERGE_TAG = "tag:yaml.org,2002:merge"


def merge_sections_deeply(node: yaml.MappingNode) -> None:
    """A section given both by a merge (``<<: *base``) and here merges key by key, as nested keys do: YAML's own merge
    would let ``train: {batch_size: 32}`` replace the base's whole train section, dropping its other keys."""
    merged: dict = {}  # key -> its value node from the merges; the first merge that gives a key wins, as in YAML
    for key_node, value_node in node.value:
        if key_node.tag == MERGE_TAG:
            sources = value_node.value if isinstance(value_node, yaml.SequenceNode) else [value_node]
            for source in (s for s in sources if isinstance(s, yaml.MappingNode)):
                for k, v in source.value:
                    if isinstance(k, yaml.ScalarNode) and k.tag != MERGE_TAG:
                        merged.setdefault(k.value, v)
    for i, (key_node, value_node) in enumerate(node.value):
        base = merged.get(key_node.value) if isinstance(key_node, yaml.ScalarNode) else None
        if key_node.tag != MERGE_TAG and isinstance(value_node, yaml.MappingNode) and \
                isinstance(base, yaml.MappingNode) and base is not value_node:
            merge = yaml.ScalarNode(MERGE_TAG, "<<", value_node.start_mark, value_node.start_mark)
            node.value[i] = (key_node, yaml.MappingNode(value_node.tag, [(merge, base), *value_node.value],
                                                        value_node.start_mark, value_node.end_mark,
                                                        value_node.flow_style))


# Numbers as people write them, as YAML 1.2 and every reader but PyYAML's YAML 1.1 take them:
#   6.5e4, 1e-3, 1.0e300   floats (YAML 1.1 wants a dot and a signed exponent, else text)
#   010, 0123              decimal 10 and 123 (YAML 1.1: octal 8 and 83); 0o10 is octal 8, 0x10 hex 16
#   1:30, 2024-01-02       text, as written (YAML 1.1: sexagesimal 90, a date)
YAML12_FLOAT = (r"^(?:[-+]?[0-9][0-9_]*\.[0-9_]*(?:[eE][-+]?[0-9]+)?|[-+]?\.[0-9][0-9_]*(?:[eE][-+]?[0-9]+)?"
                r"|[-+]?[0-9][0-9_]*[eE][-+]?[0-9]+|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$")
YAML12_INT = r"^(?:[-+]?[0-9][0-9_]*|0o[0-7_]+|0x[0-9a-fA-F_]+|0b[01_]+)$"
YAML11_ONLY = ("tag:yaml.org,2002:int", "tag:yaml.org,2002:float", "tag:yaml.org,2002:timestamp")


def yaml12_int(loader, node) -> int:
    """An int as YAML 1.2 writes it: leading zeros are decimal; 0o, 0x and 0b name the base."""
    text = loader.construct_scalar(node).replace("_", "")
    base = {"0o": 8, "0x": 16, "0b": 2}.get(text[:2].lower(), 10)
    return int(text[2:] if base != 10 else text, base)


def _read_numbers_as_yaml12() -> None:
    """Once, at the first load (nothing runs at import): StrictLoader's int, float and timestamp resolvers replaced
    by YAML 1.2's int and float."""
    if "yaml12_numbers" in StrictLoader.__dict__:
        return
    StrictLoader.yaml_implicit_resolvers = {
        first: [(tag, regexp) for tag, regexp in resolvers if tag not in YAML11_ONLY]
        for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
    StrictLoader.add_implicit_resolver("tag:yaml.org,2002:float", re.compile(YAML12_FLOAT), list("-+0123456789."))
    StrictLoader.add_implicit_resolver("tag:yaml.org,2002:int", re.compile(YAML12_INT), list("-+0123456789"))
    StrictLoader.add_constructor("tag:yaml.org,2002:int", yaml12_int)
    StrictLoader.yaml12_numbers = True


class UnsafeTag(yaml.YAMLError):
    """A ``!!python/...`` tag: it asks the reader to build (or run) Python objects."""

    def __init__(self, tag: str, line: int):
        super().__init__(f"tag {tag} at line {line}")
        self.tag, self.line = tag, line


def yaml_load(text_or_stream):
    """YAML with duplicate keys refused (:class:`StrictLoader`); :class:`UnsafeTag` for a ``!!python/...`` tag."""
    _read_numbers_as_yaml12()
    try:
        return yaml.load(text_or_stream, Loader=StrictLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.constructor.ConstructorError as exc:
        tag = re.search(r"'tag:yaml\.org,2002:(python/[^']*)'", str(exc.problem or ""))
        if tag:
            mark = exc.problem_mark
            raise UnsafeTag(f"!!{tag.group(1)}", mark.line + 1 if mark else 0) from None
        raise


UNSAFE_FIX = ("asks to build or run Python objects, which a recipe never needs, so hybridtrain refuses it as "
              "unsafe: write plain values (numbers, text, lists)")


def parse_override(text: str) -> tuple[list[str], Any]:
    """``train.epochs=5`` -> (['train', 'epochs'], 5); the value is parsed as YAML (numbers as YAML 1.2 writes them).
    A ``#`` that YAML would read as the start of a comment is refused: a shell passes it only quoted, so it is part
    of the value the user means."""
    if "=" not in text:
        raise UserError(f"bad --set {show(text)}: write it as key.sub=value, e.g. --set train.epochs=5")
    key, raw = text.split("=", 1)
    try:
        value = yaml_load(raw) if raw != "" else ""
    except DuplicateKey as exc:
        raise UserError(f"bad --set {show(text)}: key {show(exc.key)} appears twice in the value: keep one") from None
    except UnsafeTag as exc:
        raise UserError(f"bad --set {show(key)}=...: the tag {show(exc.tag)} {UNSAFE_FIX}") from None
    except RecursionError:
        raise UserError(f"bad --set {show(key)}=...: the value nests too deeply: give a plain value") from None
    except (yaml.YAMLError, ValueError):  # not YAML: the text itself
        value = raw
    if raw.count("#") > _hashes(value):
        raise UserError(f"bad --set {show(text)}: YAML reads ' #' as the start of a comment, so the value would be "
                        f"{show(value)}: to keep the #, put the value in YAML quotes (--set '{key}=\"{raw}\"'), "
                        f"or leave the comment out")
    return key.strip().split("."), value


def _hashes(value) -> int:
    """How many '#' the strings of a parsed value hold (keys and nested values included)."""
    if isinstance(value, str):
        return value.count("#")
    if isinstance(value, dict):
        return sum(_hashes(k) + _hashes(v) for k, v in value.items())
    if isinstance(value, list):
        return sum(_hashes(v) for v in value)
    return 0


def _field_at(path: list[str]) -> dataclasses.Field | None:
    """The dataclass field a dotted key names, or None (a section, a key inside a mapping, an unknown key)."""
    cls, found = Config, None
    for part in path:
        fields = {f.name: f for f in dataclasses.fields(cls)} if cls else {}
        found = fields.get(part)
        if found is None:
            return None
        default = _default(found)
        cls = type(default) if dataclasses.is_dataclass(default) else None
    return None if cls else found


def _as_written(path: list[str], value: Any, text: str) -> Any:
    """A --set value for a text key as the user typed it: ``run_dir=2024-01-02``, ``run_dir=010`` or ``run_dir=yes``
    name a folder, not a date, 8 or true."""
    f = _field_at(path)
    raw = text.split("=", 1)[1].strip()
    plain_scalar = raw and raw[0] not in "\"'[{&*!|>"
    if f is not None and isinstance(_default(f), str) and not isinstance(value, (str, list, dict)) and plain_scalar:
        return raw
    return value


def _apply_override(tree: dict, path: list[str], value: Any) -> None:
    """Set the key; a mapping given for a section or a mapping key merges into what the recipe has there, as
    nested keys would (``--set train={batch_size: 32}`` changes train.batch_size alone)."""
    node = tree
    for part in path[:-1]:
        if node.get(part) is None:  # absent, or an empty section in the file (``train:``)
            node[part] = {}
        node = node[part]
        if not isinstance(node, dict):
            raise UserError(f"bad --set: {show('.'.join(path))} goes through a value that is not a section")
    if isinstance(value, dict) and isinstance(node.get(path[-1]), dict):
        for key, item in value.items():
            _apply_override(node, [path[-1], key], item)
    else:
        node[path[-1]] = value


def read_yaml(path: str) -> dict:
    shown = printable(path)
    if "\0" not in path and os.path.isdir(path):
        raise UserError(f"config file {shown} is a folder, not a file: name the recipe YAML in it, e.g. --config "
                        f"configs/demo.yaml")
    if "\0" not in path:
        _not_dangling("--config", path)
    if "\0" in path or not os.path.isfile(path):
        raise UserError(f"config file not found: {shown} (pass an existing YAML, e.g. --config configs/demo.yaml)")
    try:
        with open(path, encoding="utf-8") as fh:
            data = yaml_load(fh)
    except DuplicateKey as exc:
        raise UserError(f"config file {shown} line {exc.line}: key {show(exc.key)} appears twice in one section "
                        f"(first at line {exc.first_line}), and YAML would keep only the second: merge them into "
                        f"one") from None
    except UnsafeTag as exc:
        raise UserError(f"config file {shown} line {exc.line}: the tag {show(exc.tag)} {UNSAFE_FIX}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise UserError(f"config file {shown} is not valid YAML{where}: fix its syntax") from None
    except UnicodeDecodeError:
        raise UserError(f"config file {shown} is not UTF-8 text: give the recipe YAML, e.g. "
                        f"configs/demo.yaml") from None
    except RecursionError:
        raise UserError(f"config file {shown} nests too deeply to be a recipe: fix it") from None
    except ValueError as exc:  # a value PyYAML matches but cannot build, e.g. the date 2020-13-45
        raise UserError(f"config file {shown} holds a value YAML cannot read ({str(exc)[:80]}): quote it or fix "
                        f"it") from None
    except OSError as exc:
        raise UserError(f"config file {shown} cannot be read ({exc.strerror}): fix its permissions") from None
    if data is None:
        raise UserError(f"config file {shown} is empty (or holds only comments), so every key would keep its default: "
                        f"write the recipe's sections in it (see configs/demo.yaml)")
    if not isinstance(data, dict):
        raise UserError(f"config file {shown} must hold a mapping of sections, got {type(data).__name__}")
    return data


def load_config(path: str | None = None, overrides: list[str] | None = None, for_command: str | None = None) -> Config:
    """The validated config of a recipe file (None: the defaults) and ``--set`` overrides. ``for_command``: also
    check the path keys that command uses on this machine (:func:`check_paths`)."""
    tree = read_yaml(path) if path else {}
    for text in overrides or []:
        key_path, value = parse_override(text)
        _apply_override(tree, key_path, _as_written(key_path, value, text))
    cfg = validate(_build(Config, tree))
    if for_command:
        check_paths(cfg, for_command)
    return cfg


def config_from_dict(tree: dict) -> Config:
    return validate(_build(Config, tree))


def validate(cfg: Config) -> Config:
    """Cross-field checks that a single key cannot express."""
    if cfg.optim.name == "hybrid" and cfg.optim.adabound_epochs >= cfg.train.epochs:
        raise UserError(f"config error: optim.adabound_epochs (T={cfg.optim.adabound_epochs}) must be in "
                        f"[1, train.epochs={cfg.train.epochs}): the SGD phase needs at least one epoch")
    if cfg.optim.name == "goyal" and cfg.optim.warmup_epochs >= cfg.train.epochs:
        raise UserError(f"config error: optim.warmup_epochs ({cfg.optim.warmup_epochs}) must be smaller "
                        f"than train.epochs ({cfg.train.epochs})")
    if cfg.optim.fused and "fusable" not in OPTIMIZER_FLAGS[cfg.optim.name]:
        fusable = " and ".join(name for name, flags in OPTIMIZER_FLAGS.items() if "fusable" in flags)
        raise UserError(f"config error: optim.fused applies to the {fusable} optimizers, and optim.name="
                        f"{cfg.optim.name} runs torch.optim.SGD (already multi-tensor): drop optim.fused")
    validate_precision(cfg)
    validate_data(cfg)
    validate_bn(cfg)
    validate_compile(cfg)
    validate_cuda_graphs(cfg)
    h = cfg.horovod
    if 0 < h.stall_shutdown_s < h.stall_warning_s:
        raise UserError(f"config error: horovod.stall_shutdown_s ({h.stall_shutdown_s}) is shorter than "
                        f"horovod.stall_warning_s ({h.stall_warning_s}), and Horovod would then never shut down: "
                        f"raise it, or set 0")
    if cfg.horovod.autotune_log and not cfg.horovod.autotune:
        raise UserError("config error: horovod.autotune_log is set but horovod.autotune is false: set "
                        "horovod.autotune: true, or unset autotune_log")
    if cfg.data.backend == "synthetic" and cfg.data.file_lists:
        raise UserError("config error: data.file_lists names real images but data.backend is synthetic: "
                        "unset one of them")
    return cfg


STAGES = ("stem", "layer1", "layer2", "layer3", "layer4", "fc")  # a ResNet's stages (models.resnet.STAGES; tested)


def computes_fp16(p) -> bool:
    """Whether a ``precision`` section computes anything in FP16 (mixed fp16, a layered fp16 stage, fp16_pure)."""
    return (p.mode == "fp16_pure" or (p.mode == "mixed" and p.compute_dtype == "fp16")
            or (p.mode == "layered" and "fp16" in p.layers.values()))


def loss_scaling(p) -> str:
    """precision.loss_scaling resolved: ``auto`` is dynamic whenever FP16 computes (seed 004), else none."""
    return p.loss_scaling if p.loss_scaling != "auto" else ("dynamic" if computes_fp16(p) else "none")


def gradient_compression(name: str, p) -> str:
    """horovod.compression resolved for a ``precision`` section: ``auto`` is fp16 (the paper) when the loss is
    scaled, so that small gradients stay above FP16's subnormals (6.1e-5), else none. fp16 is refused for
    unscaled gradients (15% of ResNet's fall below 6.1e-5 at step 0) and for fp64 ones (they would silently
    travel as fp16)."""
    scaled = loss_scaling(p) != "none"
    if name == "auto":
        return "fp16" if scaled and p.mode != "fp64" else "none"
    if name == "fp16" and p.mode == "fp64":
        raise UserError("config error: horovod.compression=fp16 would send fp64 gradients as fp16: use auto or none")
    if name == "fp16" and not scaled:
        raise UserError(f"config error: horovod.compression=fp16 needs loss scaling, and precision.mode="
                        f"{p.mode} has none here (unscaled gradients below 6.1e-5 lose bits in fp16, many "
                        f"flush to 0): set precision.loss_scaling=dynamic, or horovod.compression=auto or none")
    return name


def validate_precision(cfg: Config) -> None:
    p = cfg.precision
    for stage, dtype in p.layers.items():
        if stage not in STAGES:
            raise UserError(f"config error: precision.layers names stage {show(stage)}, which a ResNet lacks: "
                            f"use {', '.join(STAGES)}")
        if dtype not in ("fp32", "fp16", "bf16"):
            raise UserError(f"config error: precision.layers.{stage} must be fp32, fp16 or bf16; got {show(dtype)}")
    if p.mode == "fp16_pure" and "needs_fp32_state" in OPTIMIZER_FLAGS[cfg.optim.name]:
        raise UserError(f"config error: precision.mode=fp16_pure keeps optimizer state in FP16, but optim.name="
                        f"{cfg.optim.name} needs FP32 state (AdaBound's squared gradients): use optim.name=goyal "
                        f"or sgd, or precision.mode=mixed")
    gradient_compression(cfg.horovod.compression, p)


def validate_compile(cfg: Config) -> None:
    if cfg.train.compile_scope != "blocks" and not cfg.train.compile:
        raise UserError(f"config error: train.compile_scope={cfg.train.compile_scope} only applies with "
                        f"train.compile=true: set train.compile=true or drop train.compile_scope")


def validate_cuda_graphs(cfg: Config) -> None:
    """A graph replays one batch shape with no collective inside the forward pass and one pass per step."""
    if not cfg.train.cuda_graphs:
        return
    clash = ("train.accumulation_steps > 1" if cfg.train.accumulation_steps > 1 else
             "bn.per_rank_batch=random" if cfg.bn.per_rank_batch == "random" else
             "bn.sync=true" if cfg.bn.sync else None)
    if clash:
        raise UserError(f"config error: train.cuda_graphs cannot replay a step with {clash} (one static batch, no "
                        f"all-reduce in the forward pass): switch one of them off")


def validate_data(cfg: Config) -> None:
    if cfg.data.in_process and cfg.data.backend != "torchvision":
        raise UserError(f"config error: data.in_process applies to data.backend=torchvision (data.backend="
                        f"{cfg.data.backend} has no worker processes to leave out): drop data.in_process")
    if cfg.data.in_process and cfg.data.workers:
        raise UserError(f"config error: data.in_process=true starts no loader workers, so data.workers="
                        f"{cfg.data.workers} would be ignored: drop one of them")
    if cfg.data.backend == "dali_gpu" and cfg.train.device == "cpu":  # gpu-path-2 #17: decode, then copy back
        raise UserError("config error: data.backend=dali_gpu decodes on the GPU but train.device=cpu trains on the "
                        "CPU: set train.device=cuda or auto, or use data.backend=dali_cpu")


def validate_bn(cfg: Config) -> None:
    if cfg.bn.sync and cfg.model.bn_swap:
        raise UserError("config error: bn.sync cannot be combined with model.bn_swap (the swapped BN computes its "
                        "statistics itself): switch one of them off")
    if cfg.bn.per_rank_batch == "random" and cfg.data.backend != "torchvision":
        raise UserError(f"config error: bn.per_rank_batch=random needs data.backend=torchvision (data.backend="
                        f"{cfg.data.backend} delivers fixed batches): switch the backend or use per_rank_batch=fixed")


# ----------------------------------------------------------------------------- path keys on this machine

# Which path keys each command uses: "data" (data.path, data.file_lists: read), "run_dir" (written),
# "horovod" (horovod.autotune_log: written by Horovod's rank 0).
PATH_USES = {"train": ("data", "run_dir", "horovod"), "experiment": ("data", "horovod"), "bench": ("horovod",),
             "scale": ("horovod",), "plot-schedule": ()}


def check_paths(cfg: Config, for_command: str) -> None:
    """Check, in one place, that each path key ``for_command`` uses is the kind of thing it must be on this machine:
    one line naming the key and a fix that works. data.path only where data is read (not for the synthetic backend)."""
    uses = PATH_USES[for_command]
    for key, value in (("data.path", cfg.data.path), ("data.file_lists", cfg.data.file_lists),
                       ("run_dir", cfg.run_dir), ("horovod.autotune_log", cfg.horovod.autotune_log)):
        if not value.isprintable():
            raise UserError(f"{key}={show(value)} holds a control character (a newline, tab or the like): write the "
                            f"path without it")
    if "data" in uses and cfg.data.backend != "synthetic":
        _check_data_path(cfg.data.path)
        if cfg.data.file_lists:
            _check_file_lists(cfg.data.file_lists, cfg.data.path)
    if "run_dir" in uses:
        check_run_dir(cfg.run_dir)
    if "horovod" in uses and cfg.horovod.autotune_log:
        _check_autotune_log(cfg.horovod.autotune_log)


SHELL_VARIABLE = re.compile(r"\$(?:\{[A-Za-z_][A-Za-z0-9_]*[^}]*\}|[A-Za-z_][A-Za-z0-9_]*)")


def _not_expanded(key: str, path: str) -> None:
    """A leading '~' and a $VAR or ${VAR} are the shell's: hybridtrain takes a path as written, so '~/x' would be a
    folder named '~' and '${SCRATCH}/run' one named '${SCRATCH}'."""
    if path.startswith("~") and not os.path.exists(path):
        raise UserError(f"{key}={path} starts with '~', which only a shell expands: write the path without ~ (e.g. "
                        f"{os.path.expanduser(path)}) or use $HOME in a --set on the command line")
    variable = SHELL_VARIABLE.search(path)
    if variable and not os.path.exists(path):
        name = variable.group(0).strip("${}").split(":")[0].split("-")[0]
        now = os.environ.get(name)
        value = f"; ${name} is {now} here" if now is not None else f"; ${name} is not set here"
        raise UserError(f"{key}={path} holds {variable.group(0)}, which only a shell expands (a recipe and a quoted "
                        f"--set are read as written{value}): write the path itself, or pass --set {key}=... "
                        f"unquoted or in double quotes so that the shell expands it")


def _check_data_path(path: str) -> None:
    if not path.strip():
        raise UserError("data.path is empty: set it to the dataset folder holding train/<class>/*.jpg and "
                        "val/<class>/*.jpg, e.g. --set data.path=data/digits")
    _not_expanded("data.path", path)
    _not_dangling("data.path", path)
    if not os.path.exists(path):
        raise UserError(f"data directory not found: {path} (set data.path, or create it with "
                        f"'hybridtrain prepare-data digits --out {path}')")
    if not os.path.isdir(path):
        raise UserError(f"data.path={path} is a file, not a folder: set data.path to the dataset folder holding "
                        f"train/<class>/*.jpg and val/<class>/*.jpg")
    if not os.access(path, os.R_OK | os.X_OK):
        raise UserError(f"data.path={path} cannot be read by this user: fix its permissions (chmod -R a+rX)")


def _check_file_lists(folder: str, data_path: str) -> None:
    _not_expanded("data.file_lists", folder)
    fix = f"run 'hybridtrain check-data {data_path} --write-filelist {folder}'"
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise UserError(f"data.file_lists={folder} is a file, not a folder: give the folder holding train.txt and "
                        f"val.txt, or {fix}")
    for split in ("train", "val"):
        if not os.path.isfile(os.path.join(folder, f"{split}.txt")):
            raise UserError(f"data.file_lists={folder} has no {split}.txt: {fix}")


def _not_dangling(key: str, path: str) -> None:
    """One line when ``path``, or a folder on its way, is a symbolic link to nothing (an unmounted disk, a moved
    dataset): the link is what to fix, not the path."""
    link = dangling_link(path)
    if link is not None:
        raise UserError(f"{key}={path}: {link} is a symbolic link to {os.readlink(link)}, which does not exist (an "
                        f"unmounted disk or a moved folder?): fix or remove the link")


def check_run_dir(run_dir: str) -> None:
    """One line when ``run_dir`` cannot hold a run: empty, '~', a file, or under a folder this user cannot write."""
    if not run_dir.strip():
        raise UserError("run_dir is empty: set it to a folder for checkpoints and metrics, e.g. --set run_dir=runs/x")
    _not_expanded("run_dir", run_dir)
    _not_dangling("run_dir", run_dir)
    if os.path.exists(run_dir) and not os.path.isdir(run_dir):
        raise UserError(f"run_dir {run_dir} is a file, not a folder: choose another run_dir")
    parent = os.path.abspath(run_dir)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK | os.X_OK):
        raise UserError(f"run_dir {run_dir} cannot be written ({parent} is not a writable folder): choose a run_dir "
                        f"you can write, or fix its permissions")


def _check_autotune_log(log: str) -> None:
    _not_expanded("horovod.autotune_log", log)
    if os.path.isdir(log):
        raise UserError(f"horovod.autotune_log={log} is a folder: name a CSV file in it, e.g. "
                        f"{os.path.join(log, 'autotune.csv')}")
    folder = os.path.dirname(os.path.abspath(log))
    if not os.path.isdir(folder):
        raise UserError(f"horovod.autotune_log={log}: its folder {folder} does not exist: create it "
                        f"(mkdir -p {folder}) or choose another path")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise UserError(f"horovod.autotune_log={log}: its folder {folder} is not writable: choose another path")


def save_config(cfg: Config, path: str) -> None:
    with open(path, "w") as fh:
        yaml.safe_dump(cfg.to_dict(), fh, sort_keys=False)

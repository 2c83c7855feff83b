"""The config's sections: one dataclass per YAML section, each key with its default, its documented bounds or
choices, and its doc string (``hybridtrain config`` and the README read them). Every key is public interface."""
from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field

MAX_STEP_SIZE = 1e4  # lr, alpha, weight decay, trust coefficient, gamma: see OptimConfig


def choice(default, choices, doc=""):
    return field(default=default, metadata={"choices": tuple(choices), "doc": doc})


def number(default, lo=None, hi=None, lo_open=False, hi_open=False, doc="", kind=None):
    """An int or float key in [lo, hi] (open ends with lo_open/hi_open). Floats are finite: NaN and +-inf are refused
    for every key (no key gives infinity a meaning), so a bound left out means any finite value. ``kind``: the type
    of a key whose default is None (resolved from other keys as the Config is made: ``Config.__post_init__``)."""
    return field(default=default, metadata={"lo": lo, "hi": hi, "lo_open": lo_open, "hi_open": hi_open, "doc": doc,
                                            "kind": kind})


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
#   distributed.stall_warning_s, stall_shutdown_s, gloo_timeout_s <= 86400   a day: longer is a hung job
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
    # progressive resizing (FFCV's), data/resolution.py
    res_start: int = number(0, lo=0, hi=1024, doc="progressive resizing: the training resolution (px) up to epoch "
                                                  "data.res_start_epoch, rising linearly to data.res_end; validation "
                                                  "keeps data.val_resize and data.crop_size; 0 = off (training at "
                                                  "data.crop_size)")
    res_end: int = number(0, lo=0, hi=1024, doc="progressive resizing: the training resolution (px) from epoch "
                                                "data.res_end_epoch to the end (BN's last-iteration statistics are "
                                                "taken there)")
    res_start_epoch: int = number(0, lo=0, hi=10_000, doc="progressive resizing: the last epoch (0-based, FFCV's "
                                                          "start_ramp) at data.res_start")
    res_end_epoch: int = number(0, lo=0, hi=10_000, doc="progressive resizing: the first epoch (0-based, FFCV's "
                                                        "end_ramp) at data.res_end; below train.epochs")
    res_multiple: int = number(32, lo=1, hi=256, doc="progressive resizing: the epochs in between train at the "
                                                     "linear ramp rounded to a multiple of this (FFCV's 32)")


@dataclass
class ModelConfig:
    arch: str = choice("resnet50", ARCHS, "network")
    variant: str = choice("v1.5", ["v1", "v1.5"],
                          "where bottleneck blocks downsample: 1x1 conv (v1) or 3x3 conv (v1.5)")
    small_input_stem: bool = plain(False, "3x3 stride-1 stem without max-pool, for 32-64 px inputs")
    num_classes: int = number(0, lo=0, hi=100_000, doc="0 = number of class folders in the dataset")
    zero_init_last_bn: bool = plain(True, "gamma = 0 in the last BN of every residual block (paper 2.2.3)")
    residual_bn_scale: float = number(1.0, lo=0.0, hi=1.0, lo_open=True,
                                      doc="multiply every BN output inside residual blocks by this (fp16_pure: 0.25)")
    bn_swap: bool = plain(False, "fp16_pure's stabiliser, in each block's last BN: y = gamma*(x_hat + shortcut) + beta")
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
    # the recipes' options (docs/experiments.md)
    label_smoothing: float | None = number(None, lo=0.0, hi=1.0, hi_open=True, kind=float,
                                           doc="label smoothing e of the FP32 softmax cross-entropy (target (1-e) on "
                                               "the label + e/classes on every class), in [0, 1); unset (null) = the "
                                               "optimizer's default: 0.1 for optim.name=mlperf, else 0 (the resolved "
                                               "value is saved)")
    ema_decay: float = number(0.0, lo=0.0, hi=1.0, hi_open=True,
                              doc="exponential moving average of the weights and BN buffers after every applied "
                                  "step, decay min(d, (1+n)/(10+n)) at its n-th update; validated beside the raw "
                                  "weights (val_top1_ema) and checkpointed; 0 = off")
    final_weights: str = choice("raw", ["raw", "ema"], "final_model.pt holds the raw weights or their EMA "
                                                       "(needs train.ema_decay > 0)")
    val_flip: bool = plain(False, "validation averages the logits of each image and of its horizontal mirror")


# optim.name -> the flags config checks: the keys of optim.factory.OPTIMIZERS and their Spec flags, written here so
# that config imports no torch (tests/test_optim_math.py checks that they agree)
OPTIMIZER_FLAGS = {"hybrid": ("fusable", "needs_fp32_state"), "adabound": ("fusable", "needs_fp32_state"),
                   "goyal": (), "sgd": (), "mlperf": ()}
SCHEDULED = ("goyal", "sgd")  # the SGD-family optimizers whose decay optim.schedule picks
# optim.<key> -> the optimizers (optim.name) whose build or schedule reads it (optim/factory.py, optim/schedules.py);
# the keys every optimizer reads (lr, weight_decay, ...) are not listed
OPTIMIZER_KEYS = {"adabound_epochs": ("hybrid",), "alpha": ("hybrid", "adabound"), "betas": ("hybrid", "adabound"),
                  "eps": ("hybrid", "adabound"), "bound_granularity": ("hybrid",), "kappa": ("hybrid",),
                  "kappa_origin": ("hybrid",), "lars": ("hybrid",), "trust_coefficient": ("hybrid",),
                  "adabound_gamma": ("adabound",), "warmup_epochs": ("goyal", "mlperf"), "milestones": SCHEDULED,
                  "decay_factor": SCHEDULED, "end_lr": ("mlperf",), "poly_power": ("mlperf",),
                  "mlperf_trust_coefficient": ("mlperf",), "mlperf_eps": ("mlperf",)}
DEFAULT_LABEL_SMOOTHING = {"mlperf": 0.1}  # optim.name -> train.label_smoothing's default (else 0): MLPerf's 0.1


@dataclass
class OptimConfig:
    name: str = choice("hybrid", list(OPTIMIZER_FLAGS),
                       "hybrid (AdaBound warmup -> LARS-SGD, the paper), adabound, goyal or sgd (baselines), "
                       "mlperf (LARS, linear warmup, polynomial decay: MLPerf's ResNet-50 recipe)")
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
                                  doc="goyal: gradual warmup from lr to lr x N over this many epochs; mlperf: "
                                      "linear warmup from 0 to lr x N")
    milestones: list = numbers([1 / 3, 2 / 3, 8 / 9], lo=0.0, hi=1.0, lo_open=True, hi_open=True, increasing=True,
                               doc="goyal/sgd: step decay points as fractions of the run")
    decay_factor: float = number(0.1, lo=0.0, hi=1.0, lo_open=True, doc="goyal/sgd: step decay multiplier")
    schedule: str = choice("step", ["step", "linear", "cosine"],
                           "goyal/sgd: the decay after the warmup: step (milestones), linear (FFCV's budgeted "
                           "schedule: to 0 at the end of the last epoch) or cosine (to 0 at the end)")
    # mlperf (MLPerf's reference, image_classification/tensorflow2/lars_util.py and lars_optimizer.py)
    end_lr: float = number(1e-4, lo=0.0, hi=MAX_STEP_SIZE,
                           doc="mlperf: the polynomial decay's end learning rate (the reference's 0.0001)")
    poly_power: float = number(2.0, lo=0.0, hi=16.0, lo_open=True, doc="mlperf: the polynomial decay's power")
    mlperf_trust_coefficient: float = number(0.001, lo=0.0, hi=MAX_STEP_SIZE, lo_open=True,
                                             doc="mlperf: LARS trust coefficient eta (the reference's eeta)")
    mlperf_eps: float = number(1e-7, lo=0.0, hi=1.0,
                               doc="mlperf: LARS epsilon (the reference's 0, which Keras replaces by 1e-7)")


STAGES = ("stem", "layer1", "layer2", "layer3", "layer4", "fc")  # a ResNet's stages (models.resnet.STAGES; tested)


@dataclass
class PrecisionConfig:
    mode: str = choice("fp32", ["fp32", "fp64", "mixed", "layered", "fp16_pure"],
                       "fp32; fp64; mixed (FP16/BF16 compute, FP32 master weights, the paper); layered (per stage, "
                       "Li et al. 2023); fp16_pure (no FP32 copy, Cheng et al.)")
    compute_dtype: str = choice("fp16", ["fp16", "bf16"], "mixed: the reduced dtype of forward and backward")
    layers: dict = plain({"stem": "fp32", "layer1": "fp16", "layer2": "fp16", "layer3": "fp16", "layer4": "fp16",
                          "fc": "fp32"}, "layered: dtype (fp32, fp16 or bf16) per stage; Li et al. 2023's default")
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
    gradient_predivide_factor: float = number(1.0, lo=1.0, hi=1024.0,
                                              doc="divide gradients by f before the sum and by N/f after: keeps "
                                                  "FP16 sums over many ranks finite")
    # fusion_threshold_mb and cycle_time_ms: defaults chosen with python -m benchmarks scale (docs/benchmarks.md)
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


@dataclass
class DistributedConfig:
    engine: str = plain("auto", "the data-parallel engine, a name in the registry (distributed/engines.py, plugins "
                                "included; checked when the job starts): horovod (horovodrun, mpirun), torch "
                                "(torch.distributed DDP under torchrun or srun), or auto = the launcher's, else the "
                                "first installed")
    # What both engines honour: the all-reduce's wire and the limits (once under horovod:, still read there:
    # loading.MOVED_KEYS)
    compression: str = choice("auto", ["auto", "fp16", "none"],
                              "gradient all-reduce compression: fp16 (the paper; needs loss scaling), none, or auto "
                              "= fp16 when the loss is scaled, else none")
    stall_warning_s: int = number(60, lo=1, hi=86400,
                                  doc="every rank's stall watchdog warns when no training step finished for this "
                                      "long (Horovod also gets it as HOROVOD_STALL_CHECK_TIME_SECONDS: it warns, "
                                      "naming the missing ranks, when some ranks wait this long for a tensor)")
    stall_shutdown_s: int = number(600, lo=0, hi=86400,
                                   doc="end the job after such a stall (a hung rank) with one line; a rank's own "
                                       "long work (validation, a checkpoint write, a first compile) is no stall; "
                                       "0 = never; Horovod also gets HOROVOD_STALL_SHUTDOWN_TIME_SECONDS, and the "
                                       "torch engine's collectives time out a minute after the last rank's limit")
    gloo_timeout_s: int = number(60, lo=1, hi=86400,
                                 doc="how long Gloo waits for every rank to connect at start "
                                     "(HOROVOD_GLOO_TIMEOUT_SECONDS; the torch engine's least collective timeout)")


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
class ProfileConfig:
    enabled: bool = plain(False, "train --profile: torch.profiler over a window of steps on every rank, a "
                                 "Chrome/Perfetto trace per rank in run_dir/profile/trace-rank<r>.json; off: no cost")
    wait: int = number(5, lo=0, hi=1_000_000, doc="steps of the process before the window (the first steps' start-up "
                                                    "left out)")
    warmup: int = number(2, lo=0, hi=1000, doc="steps profiled and thrown away before the recorded ones")
    active: int = number(3, lo=1, hi=1000, doc="steps recorded in the trace")
    memory: bool = plain(False, "on a GPU: a CUDA memory snapshot with Python stacks over the recorded steps, "
                                "run_dir/profile/memory-rank<r>.pickle (open it in pytorch.org/memory_viz)")


@dataclass
class SinksConfig:
    mlflow: str = plain("", "rank 0 logs the run to MLflow: '' = off, 'local' = a file store in run_dir/mlruns, else "
                            "a tracking URI (file:/absolute/path, http://host:5000, or sqlite:///path/mlflow.db with "
                            "the full mlflow package); needs mlflow or mlflow-skinny (pip install "
                            "'hybridtrain[sinks]')")
    wandb: str = choice("", ["", "offline", "online"],
                        "rank 0 logs the run to Weights & Biases: '' = off, offline (run_dir/wandb, 'wandb sync' "
                        "later) or online; needs wandb (pip install 'hybridtrain[sinks]')")
    project: str = plain("hybridtrain", "the MLflow experiment and the W&B project the run is logged to")


NOT_RECIPE = ("distributed", "profile", "sinks")  # sections that change no math: left out of the fingerprint


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
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    sinks: SinksConfig = field(default_factory=SinksConfig)

    def __post_init__(self):
        """train.label_smoothing left unset resolved to the optimizer's default (DEFAULT_LABEL_SMOOTHING, else 0) as
        the config is made, so its saved config.yaml, its fingerprint, the report and the step hold the value used."""
        if self.train.label_smoothing is None:
            self.train.label_smoothing = DEFAULT_LABEL_SMOOTHING.get(self.optim.name, 0.0)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def fingerprint(self) -> str:
        """The recipe's identity: the engine, its limits and the profiler are left out (a run resumes under either, with
        other limits, with the same math). The all-reduce's compression changes the math, so it counts, hashed where
        it first stood (horovod.compression): a checkpoint written before the move keeps its fingerprint."""
        recipe = {key: value for key, value in self.to_dict().items() if key not in NOT_RECIPE}
        recipe["horovod"]["compression"] = self.distributed.compression
        return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:16]

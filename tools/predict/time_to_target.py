"""Time to a target accuracy on N GPUs: the per-GPU batch, its throughput, the all-reduce and the epochs it needs.

Model (docs/predict.md has the sources of every number below):

* Per-GPU compute time of one step at per-GPU batch b is a line, ``t(b) = fixed + b * per_image`` (a fixed
  per-step cost: kernel launches, the optimizer, the loader hand-off; plus a cost per image). Its single-GPU
  throughput is ``S1(b) = b / t(b)``, which rises with b towards ``1 / per_image``. The line is fitted by
  least squares to (batch, img/s) points: a ``python -m benchmarks bench`` sweep on one's own GPU, or the default
  H100 curve (:func:`default_throughput_curve`).
* The all-reduce of every gradient once per step is :mod:`tools.predict.cluster_model`'s (ring,
  hierarchical or hierarchical-tree; FP16 or FP32 gradients; a fraction ``overlap`` hidden behind backward).
  step = t(b) + exposed all-reduce; img/s per GPU = b / step; efficiency = t(b) / step (section 3.2.2).
* Epochs to the target top-1 are a function of the global batch N * b, one per optimizer, read from published
  runs (:data:`CONVERGENCE_POINTS`): the mean epochs of each published batch, joined by straight lines in
  log2(global batch). Below the smallest published batch the epochs are held at its value; above the largest
  the global batch is *beyond any published run* and the row says so.
* minutes = epochs * images per epoch / (N * img/s per GPU); actual average single-GPU time = N * minutes
  (the paper's measured form), which equals its model form epochs * images / (S1(b) * efficiency).
* For each N the model picks the per-GPU batch b (1 .. the curve's largest batch) with the shortest time,
  among those whose global batch some published run has reached when there are any.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from tools.predict import cluster_model as cm

# ---------------------------------------------------------------------------------------------- throughput


@dataclass(frozen=True)
class ThroughputCurve:
    """Per-GPU compute time of one step: fixed + batch * per_image seconds; defined up to ``max_batch``."""

    fixed: float  # seconds per step whatever the batch
    per_image: float  # seconds per image
    max_batch: int  # the largest per-GPU batch the curve's points reached (not extrapolated above it)
    source: str

    def step_time(self, batch: float) -> float:
        return self.fixed + batch * self.per_image  # t(b) = fixed + b * per_image

    def images_per_second(self, batch: float) -> float:
        return batch / self.step_time(batch)  # S1(b) = b / t(b)


def fit_throughput_curve(points: Sequence[tuple[float, float]], source: str) -> ThroughputCurve:
    """Least squares of step time b / S on b over (batch, img/s) points; needs two distinct batches.

    A negative fitted fixed cost (points that speed up faster than a line allows) is set to 0 and the per-image
    cost refitted alone, so the curve never has a throughput above b / (b * per_image).
    """
    batches, speeds = np.array(points, dtype=float).reshape(-1, 2).T  # the (batch, img/s) columns
    if batches.size == 0 or np.any(~np.isfinite(batches)) or np.any(batches < 1):
        raise ValueError("throughput points need per-GPU batches >= 1")
    if np.any(~np.isfinite(speeds)) or np.any(speeds <= 0):
        raise ValueError("throughput points need img/s > 0")
    if np.unique(batches).size < 2:
        raise ValueError("a throughput curve needs points at two or more distinct per-GPU batches")
    times = batches / speeds  # t_i = b_i / S_i
    (fixed, per_image), *_ = np.linalg.lstsq(np.column_stack([np.ones_like(batches), batches]), times, rcond=None)
    if fixed < 0:
        fixed, per_image = 0.0, float(batches @ times / (batches @ batches))  # t = b * per_image through 0
    if per_image <= 0:
        raise ValueError("the points' step time does not grow with the batch: no per-image cost can be read")
    return ThroughputCurve(float(fixed), float(per_image), int(batches.max()), source)


# ---------------------------------------------------------------------------------------------- H100 cluster

H100_GPUS_PER_NODE = 8  # DGX H100 / HGX H100
NVLINK4 = 450e9  # bytes/s per direction per H100 SXM (NVLink 4: 900 GB/s both directions)
NDR_NODE = 8 * 400e9 / 8  # bytes/s per node: 8 ConnectX-7 NICs at 400 Gb/s each (one per GPU)
H100_OVERLAP = 0.0  # MLPerf v4.0 NVIDIA ResNet configs: "Default is no NCCL and BWD overlap"


def h100_cluster() -> cm.ClusterSpec:
    """A DGX H100 node (8 GPUs, NVLink 4, 8 x 400 Gb/s) as a template; compute time and size are set per row."""
    return cm.ClusterSpec(
        compute_time=1.0, batch_per_gpu=1, parameter_count=cm.RESNET50_PARAMETERS,
        bytes_per_element=2, gpus_per_node=H100_GPUS_PER_NODE, nodes=1,
        intra_bandwidth=NVLINK4, intra_latency=cm.INTRA_LATENCY, inter_bandwidth=NDR_NODE,
        inter_latency=cm.NIC_LATENCY, algorithm="hierarchical-tree", overlap=H100_OVERLAP)


sized = cm.sized  # the template at a row's GPUs, batch and compute time


# ---------------------------------------------------------------------------------------------- MLPerf rows


@dataclass(frozen=True)
class PublishedRun:
    """One published time-to-target run (MLPerf Training v4.0 closed, NVIDIA, H100)."""

    gpus: int
    global_batch: int
    images_per_second_per_gpu: float
    epochs: int
    minutes: float

    @property
    def batch_per_gpu(self) -> int:
        return self.global_batch // self.gpus


MLPERF_V40_RUNS = (
    PublishedRun(8, 3200, 7161.0, 35, 13.27),
    PublishedRun(64, 3200, 4908.0, 35, 2.51),
    PublishedRun(3584, 57344, 2819.0, 77, 0.18),
)


def implied_compute_points(runs: Sequence[PublishedRun], template: cm.ClusterSpec) -> list[tuple[int, float]]:
    """(per-GPU batch, single-GPU img/s) of each run: its step time b / (img/s per GPU) less the modelled exposed
    all-reduce at its size (the compute part of the step)."""
    points = []
    for run in runs:
        step = run.batch_per_gpu / run.images_per_second_per_gpu
        spec = sized(template, run.gpus, run.batch_per_gpu, step)
        exposed = (1.0 - spec.overlap) * cm.allreduce_time(spec)
        if exposed >= step:
            raise ValueError(f"the modelled all-reduce at {run.gpus} GPUs ({1e3 * exposed:.2f} ms) exceeds the "
                             f"published step time ({1e3 * step:.2f} ms)")
        points.append((run.batch_per_gpu, run.batch_per_gpu / (step - exposed)))
    return points


def default_throughput_curve(exclude: Optional[int] = None) -> ThroughputCurve:
    """H100 SXM, ResNet-50, MXNet + DALI (the MLPerf v4.0 code): the line fitted to the compute part of the
    MLPerf runs' steps (the DGX H100 template's all-reduce taken off). ``exclude`` leaves out the run with that
    many GPUs (the check's leave-one-out)."""
    runs = [r for r in MLPERF_V40_RUNS if r.gpus != exclude]
    points = implied_compute_points(runs, h100_cluster())
    left = "" if exclude is None else f" less the {exclude}-GPU run"
    return fit_throughput_curve(points, f"default H100 curve (MLPerf v4.0 NVIDIA runs{left})")


# ---------------------------------------------------------------------------------------------- epochs


@dataclass(frozen=True)
class ConvergencePoint:
    """A published run (or set of repeats) that reached ``top1`` after ``epochs`` (the mean over repeats)."""

    optimizer: str
    global_batch: int
    top1: float
    epochs_per_run: tuple[int, ...]
    source: str

    @property
    def epochs(self) -> float:
        return float(np.mean(self.epochs_per_run))


RCP = "MLPerf Training v4.0 reference convergence point resnet_ref_{}"
CONVERGENCE_POINTS = (
    # LARS to 75.9% top-1: MLPerf Training v4.0 reference convergence points (epochs to converge per repeat)
    ConvergencePoint("lars", 1632, 0.759, (34, 34, 34, 35, 35, 37, 35, 35, 33, 35, 35, 37, 37, 35, 35, 34, 35),
                     RCP.format(1632)),
    ConvergencePoint("lars", 3264, 0.759, (36, 35, 34, 34, 36, 35, 35, 35, 35, 37, 35, 35, 35, 36, 35),
                     RCP.format(3264)),
    ConvergencePoint("lars", 4096, 0.759, (39, 42, 40, 41, 39, 40, 41, 39, 40, 39), RCP.format(4096)),
    ConvergencePoint("lars", 8192, 0.759, (42, 44, 43, 41, 41, 41, 42, 42, 43, 41), RCP.format(8192)),
    ConvergencePoint("lars", 13056, 0.759, (46, 46, 44, 46, 45, 46, 45, 45, 45, 46), RCP.format(13056)),
    ConvergencePoint("lars", 32768, 0.759, (56, 56, 55, 56, 56, 56, 56, 56, 57, 56), RCP.format(32768)),
    ConvergencePoint("lars", 49152, 0.759, (68, 68, 68, 68, 69, 68, 68, 67, 69, 67), RCP.format(49152)),
    ConvergencePoint("lars", 58880, 0.759, (80, 81, 80, 78, 80, 80, 81, 79, 80, 80), RCP.format(58880)),
    ConvergencePoint("lars", 65536, 0.759, (83, 85, 84, 86, 85, 85, 83, 84, 85, 85), RCP.format(65536)),
    ConvergencePoint("lars", 67840, 0.759, (86, 87, 86, 87, 86, 85, 86, 86, 86, 85, 86, 86, 86, 86, 86, 85, 86,
                                            86, 87, 85, 85, 86, 85, 87, 86, 85, 85, 86), RCP.format(67840)),
    # SGD with linear scaling and gradual warmup, 90 epochs (Goyal et al. 2017, top-1 error 23.60 and 23.74)
    ConvergencePoint("sgd", 256, 0.764, (90,), "Goyal et al. 2017, kn=256, 90 epochs"),
    ConvergencePoint("sgd", 8192, 0.7626, (90,), "Goyal et al. 2017, kn=8k, 90 epochs"),
    # the paper's hybrid optimizer on cluster 1 (24 x 256)
    ConvergencePoint("hybrid", 6144, 0.75, (32,), "Lu, Lu & Liang 2020, Tables 3.5 and 3.8 (75.0% at epoch 32)"),
    ConvergencePoint("hybrid", 6144, 0.756, (90,), "Lu, Lu & Liang 2020, Table 3.7 (75.6% after 90 epochs)"),
)
OPTIMIZERS = ("lars", "sgd", "hybrid")


@dataclass(frozen=True)
class EpochCurve:
    """Epochs to ``target`` against the global batch: the published batches and their (mean) epochs."""

    optimizer: str
    target: float
    batches: tuple[int, ...]
    epochs: tuple[float, ...]
    sources: tuple[str, ...]

    @property
    def largest_batch(self) -> int:
        return self.batches[-1]

    def status(self, global_batch: int) -> str:
        """'within' the published batches, 'below' the smallest or 'beyond' the largest."""
        if global_batch > self.batches[-1]:
            return "beyond"
        return "below" if global_batch < self.batches[0] else "within"

    def at(self, global_batch: float) -> float:
        """Epochs at ``global_batch``: straight lines in log2(batch) between published batches, held at the
        smallest batch's below it, and continued along the last segment beyond the largest (flagged by
        :meth:`status`; held flat when only one batch is published)."""
        x, y = np.log2(np.array(self.batches, dtype=float)), np.array(self.epochs)
        b = math.log2(global_batch)
        if b > x[-1] and x.size > 1:
            return float(y[-1] + (b - x[-1]) * (y[-1] - y[-2]) / (x[-1] - x[-2]))
        return float(np.interp(b, x, y))


def epoch_curve(optimizer: str, target: float, points: Sequence[ConvergencePoint] = CONVERGENCE_POINTS) -> EpochCurve:
    """The published points of ``optimizer`` that reached at least ``target``; per batch, the smallest mean
    epochs among them (a run that reached a higher top-1 reached ``target`` no later, so its epochs are an upper
    bound). ValueError when none reached the target."""
    usable = [p for p in points if p.optimizer == optimizer and p.top1 >= target - 1e-9]
    if not usable:
        best = max((p.top1 for p in points if p.optimizer == optimizer), default=None)
        known = "no published runs" if best is None else f"the best published top-1 is {best:.4f}"
        raise ValueError(f"no published {optimizer} run reached top-1 {target:g} ({known})")
    batches = sorted({p.global_batch for p in usable})
    ordered = [min((p for p in usable if p.global_batch == b), key=lambda p: p.epochs) for b in batches]
    return EpochCurve(optimizer, target, tuple(p.global_batch for p in ordered), tuple(p.epochs for p in ordered),
                      tuple(p.source for p in ordered))


# ---------------------------------------------------------------------------------------------- the plan


@dataclass(frozen=True)
class PlanRow:
    gpus: int
    batch_per_gpu: int
    global_batch: int
    images_per_second_per_gpu: float
    single_gpu_images_per_second: float  # S1 at this per-GPU batch
    allreduce_ms: float
    efficiency: float
    epochs: float
    epochs_status: str  # within / below / beyond the published global batches
    minutes: float
    single_gpu_minutes: float  # the paper's actual average single-GPU training time

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def evaluate(gpus: int, batch: int, curve: ThroughputCurve, epochs: EpochCurve, template: cm.ClusterSpec,
             images_per_epoch: int = cm.IMAGENET_TRAIN_IMAGES) -> PlanRow:
    """The time-to-target row of ``gpus`` GPUs at per-GPU batch ``batch``."""
    spec = sized(template, gpus, batch, curve.step_time(batch))
    p = cm.predict(spec)
    per_gpu = batch / p.step_time  # img/s per GPU = b / (t(b) + exposed)
    e = epochs.at(gpus * batch)
    minutes = e * images_per_epoch / (gpus * per_gpu) / 60  # E * I / (N * per-GPU img/s)
    s1 = curve.images_per_second(batch)
    single = e * images_per_epoch / (s1 * p.efficiency) / 60  # the paper's model form: E * I / (S1 * eff)
    return PlanRow(gpus, batch, gpus * batch, per_gpu, s1, 1e3 * p.allreduce_time, p.efficiency, e,
                   epochs.status(gpus * batch), minutes, single)


def plan(gpus: int, curve: ThroughputCurve, epochs: EpochCurve, template: cm.ClusterSpec,
         images_per_epoch: int = cm.IMAGENET_TRAIN_IMAGES, batch: Optional[int] = None) -> PlanRow:
    """The fastest row over per-GPU batches 1 .. curve.max_batch (or the given ``batch``), among those whose global
    batch a published run has reached when any has; ties go to the smaller batch."""
    if batch is not None:
        return evaluate(gpus, batch, curve, epochs, template, images_per_epoch)
    candidates = [b for b in range(1, curve.max_batch + 1) if gpus * b <= epochs.largest_batch] or [1]
    rows = [evaluate(gpus, b, curve, epochs, template, images_per_epoch) for b in candidates]
    return min(rows, key=lambda r: (r.minutes, r.batch_per_gpu))


# ---------------------------------------------------------------------------------------------- the checks


@dataclass(frozen=True)
class RunCheck:
    run: PublishedRun
    model: PlanRow  # at the run's GPUs and per-GPU batch, throughput curve fitted without this run

    @property
    def throughput_error(self) -> float:
        return self.model.images_per_second_per_gpu / self.run.images_per_second_per_gpu - 1.0

    @property
    def minutes_error(self) -> float:
        return self.model.minutes / self.run.minutes - 1.0


def mlperf_check() -> list[RunCheck]:
    """The model against each MLPerf v4.0 run at the run's own size and batch; the throughput curve of each row is
    fitted to the other two runs only (leave-one-out), the epochs come from the reference convergence points."""
    epochs = epoch_curve("lars", 0.759)  # MLPerf's target
    return [RunCheck(run, evaluate(run.gpus, run.batch_per_gpu, default_throughput_curve(exclude=run.gpus), epochs,
                                   h100_cluster())) for run in MLPERF_V40_RUNS]


@dataclass(frozen=True)
class PaperTimeRow:
    label: str
    epochs: int
    paper_minutes: float
    model_minutes: float
    paper_single_gpu_minutes: Optional[float]
    model_single_gpu_minutes: float

    @property
    def error(self) -> float:
        return self.model_minutes / self.paper_minutes - 1.0


V100_TABLE_3_2 = ((128, 1377.0), (256, 1542.0))  # the paper's Table 3.2, mixed precision


def paper_time_check(check: cm.PaperCheck) -> list[PaperTimeRow]:
    """Tables 3.7-3.9 from the time model: 24 GPUs, the paper's per-GPU speed and the efficiency the all-reduce
    model gives each cluster (cluster 1: the V100 line through Table 3.2 at batch 256; cluster 2: 295 img/s at
    128, FP16 communication)."""
    v100 = fit_throughput_curve(V100_TABLE_3_2, "Table 3.2")
    c1, c2 = check.rows[0], check.rows[2]
    rows = []
    for label, row, speed, table in (
            ("cluster 1", c1, v100.images_per_second(256), ((90, 53, None), (32, 18, 432), (39, 23, 552))),
            ("cluster 2", c2, 128 / c2.spec.compute_time, ((90, 108, None), (33, 39, 936), (42, 50, 1200)))):
        n = row.spec.world_size
        for epochs, minutes, single in table:
            model = epochs * cm.IMAGENET_TRAIN_IMAGES / (n * speed * row.predicted_efficiency) / 60
            rows.append(PaperTimeRow(label, epochs, minutes, model, single, n * model))
    return rows


# ---------------------------------------------------------------------------------------------- the plot


def plot_time_to_target(rows: Sequence[PlanRow], path: str, title: str,
                        published: Sequence[PublishedRun] = ()) -> str:
    """Minutes to the target against GPUs (log-log), each point labelled with its per-GPU batch; points beyond
    any published global batch hollow; published runs as crosses."""
    from hybridtrain.files import figure as new_figure
    from hybridtrain.files import save_figure

    if not rows:
        raise ValueError("nothing to plot: no rows")
    figure = new_figure(6.5, 4.2)
    axes = figure.add_subplot()
    axes.plot([r.gpus for r in rows], [r.minutes for r in rows], color="C0", label="model")
    for r in rows:
        axes.plot([r.gpus], [r.minutes], marker="o", color="C0",
                  markerfacecolor="white" if r.epochs_status == "beyond" else "C0")
        axes.annotate(f"b={r.batch_per_gpu}", (r.gpus, r.minutes), textcoords="offset points", xytext=(5, 5),
                      fontsize=8)
    if published:
        axes.plot([p.gpus for p in published], [p.minutes for p in published], "x", color="C3",
                  label="MLPerf v4.0 (published)")
    axes.set_xscale("log", base=2)
    axes.set(yscale="log", xlabel="GPUs", ylabel="minutes to target")
    axes.set_title(title, fontsize=9)
    axes.grid(True, which="both", alpha=0.3)
    axes.legend()
    figure.tight_layout()
    return save_figure(figure, path)


"""Cluster performance model for synchronous data-parallel training: step time, img/s, scaling efficiency.

Model (every assumption is stated here and nowhere else):

* One step on one GPU = ``compute_time`` (forward + backward + update at the per-GPU batch), then one
  all-reduce of every gradient (Horovod tensor fusion packs all gradients into one all-reduce, so the
  per-message latency is paid once per step).
* A fraction ``overlap`` of the all-reduce runs while backward is still computing and costs nothing;
  the rest is exposed:  step time = compute + (1 - overlap) * all-reduce time.
* Gradients travel as ``bytes_per_element`` (2 = FP16, 4 = FP32) x ``parameter_count`` bytes.
* A link moves one byte in 1/bandwidth seconds after a fixed per-message ``latency`` (alpha-beta model).
* ``ring``: a flat ring over all N GPUs (NCCL's default, the paper's section 2.2.3 3)); every ring step
  runs at the slowest link, which is the inter-node link when nodes > 1:
      T = 2(N-1) * latency + 2(N-1)/N * bytes / bandwidth.
* ``hierarchical`` (Horovod's hierarchical all-reduce): with g GPUs per node and M nodes,
      T = RS_intra + AR_inter + AG_intra
      RS_intra = AG_intra = (g-1) * intra_latency + (g-1)/g * bytes / intra_bandwidth
      AR_inter = 2(M-1) * inter_latency + 2(M-1)/M * (bytes/g) / (inter_bandwidth/g)
  After the intra-node reduce-scatter each local rank owns bytes/g and runs a ring all-reduce of it
  with its peers on the other nodes; the g rings of a node run at once and share the node's one NIC,
  so each gets inter_bandwidth/g.
* ``hierarchical-tree``: as ``hierarchical``, with the inter-node stage a binary-tree all-reduce (NCCL's tree, or an
  in-network reduction such as SHARP), whose latency grows with log2 of the node count, not with it:
      AR_inter = 2 ceil(log2 M) * inter_latency + 2 * (bytes/g) / (inter_bandwidth/g)
* Efficiency = compute / step time (section 3.2.2: 1 / (1 + exposed comm / compute)); a single GPU
  has no all-reduce.

Step times alone cannot separate ``overlap`` from bandwidth/latency (only (1 - overlap)/bandwidth and
(1 - overlap) * latency enter), so :func:`calibrate` returns effective (exposed) values.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Mapping, Sequence

import numpy as np

from hybridtrain.reports import paper_metrics as metrics

RESNET50_PARAMETERS = 25_557_032  # torchvision ResNet-50 (1000 classes), the paper's Table 3.1 model
IMAGENET_TRAIN_IMAGES = 1_281_167  # ILSVRC-2012 training set ("1.28 million" in section 3.1)
ALGORITHMS = ("ring", "hierarchical", "hierarchical-tree")


@dataclass(frozen=True)
class ClusterSpec:
    """Inputs of the model. Bandwidths in bytes/s per link and direction, latencies in seconds per message."""

    compute_time: float  # per-GPU seconds per step without communication
    batch_per_gpu: int
    parameter_count: int
    bytes_per_element: int  # gradient wire format: 2 (FP16) or 4 (FP32)
    gpus_per_node: int
    nodes: int
    intra_bandwidth: float
    intra_latency: float
    inter_bandwidth: float
    inter_latency: float
    algorithm: str = "ring"  # one of ALGORITHMS
    overlap: float = 0.0  # fraction of the all-reduce hidden behind backward, in [0, 1]

    def __post_init__(self) -> None:
        for name in ("compute_time", "intra_bandwidth", "inter_bandwidth"):
            metrics.require_positive(name, getattr(self, name))
        for name in ("intra_latency", "inter_latency"):
            metrics.require_non_negative(name, getattr(self, name))
        for name in ("batch_per_gpu", "parameter_count", "gpus_per_node", "nodes"):
            metrics.require_count(name, getattr(self, name))
        if self.bytes_per_element not in (2, 4):
            raise ValueError(f"bytes_per_element must be 2 (FP16) or 4 (FP32), got {self.bytes_per_element!r}")
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {self.algorithm!r}")
        if not 0.0 <= self.overlap <= 1.0:
            raise ValueError(f"overlap must lie in [0, 1], got {self.overlap!r}")

    @property
    def world_size(self) -> int:
        return self.gpus_per_node * self.nodes  # N = g * M

    @property
    def gradient_bytes(self) -> int:
        return self.parameter_count * self.bytes_per_element  # bytes = P * bytes per element


@dataclass(frozen=True)
class Prediction:
    allreduce_time: float  # seconds for one all-reduce of all gradients
    exposed_comm_time: float  # the part not hidden behind backward
    step_time: float
    images_per_second: float  # all GPUs together
    efficiency: float


def compute_time_from_speed(batch_per_gpu: int, single_gpu_speed: float) -> float:
    """Per-step compute time of one GPU from its measured single-GPU speed."""
    metrics.require_count("batch_per_gpu", batch_per_gpu)
    metrics.require_positive("single_gpu_speed", single_gpu_speed)
    return batch_per_gpu / single_gpu_speed  # t_compute = B / S1


def ring_allreduce_time(world_size: int, message_bytes: float, bandwidth: float, latency: float) -> float:
    """Ring all-reduce of ``message_bytes`` over ``world_size`` ranks (reduce-scatter + allgather)."""
    return 2 * ring_reduce_scatter_time(world_size, message_bytes, bandwidth, latency)  # 2(N-1)a + 2(N-1)/N * b/B


def ring_reduce_scatter_time(world_size: int, message_bytes: float, bandwidth: float, latency: float) -> float:
    """Ring reduce-scatter (and, by the same formula, ring allgather) of ``message_bytes``."""
    metrics.require_count("world_size", world_size)
    n = world_size
    return (n - 1) * latency + (n - 1) / n * message_bytes / bandwidth  # (N-1)a + (N-1)/N * b/B


def tree_allreduce_time(world_size: int, message_bytes: float, bandwidth: float, latency: float) -> float:
    """Binary-tree all-reduce (reduce up, broadcast down) of ``message_bytes``, pipelined in chunks."""
    metrics.require_count("world_size", world_size)
    if world_size == 1:
        return 0.0
    depth = math.ceil(math.log2(world_size))
    return 2 * depth * latency + 2 * message_bytes / bandwidth  # 2 ceil(log2 N) a + 2 b/B


def hierarchical_allreduce_time(spec: ClusterSpec, inter_allreduce=ring_allreduce_time) -> float:
    """Intra-node reduce-scatter, inter-node all-reduce of 1/g of the data (a ring, or ``tree_allreduce_time``),
    intra-node allgather."""
    g, m, size = spec.gpus_per_node, spec.nodes, spec.gradient_bytes
    intra = ring_reduce_scatter_time(g, size, spec.intra_bandwidth, spec.intra_latency)
    inter = inter_allreduce(m, size / g, spec.inter_bandwidth / g, spec.inter_latency)  # g flows share the NIC
    return intra + inter + intra  # RS_intra + AR_inter + AG_intra


def allreduce_time(spec: ClusterSpec) -> float:
    if spec.world_size == 1:
        return 0.0
    if spec.algorithm != "ring":
        return hierarchical_allreduce_time(spec, tree_allreduce_time if spec.algorithm == "hierarchical-tree"
                                           else ring_allreduce_time)
    # a flat ring over all GPUs, every step at the slowest link (inter-node when nodes > 1)
    if spec.nodes == 1:
        bandwidth, latency = spec.intra_bandwidth, spec.intra_latency
    else:
        bandwidth = min(spec.intra_bandwidth, spec.inter_bandwidth)
        latency = max(spec.intra_latency, spec.inter_latency)
    return ring_allreduce_time(spec.world_size, spec.gradient_bytes, bandwidth, latency)


def predict(spec: ClusterSpec) -> Prediction:
    comm = allreduce_time(spec)
    exposed = (1.0 - spec.overlap) * comm  # exposed = (1 - overlap) * T_allreduce
    step = spec.compute_time + exposed  # step = compute + exposed
    return Prediction(
        allreduce_time=comm,
        exposed_comm_time=exposed,
        step_time=step,
        images_per_second=spec.world_size * spec.batch_per_gpu / step,  # speed = N * B / step
        efficiency=metrics.scaling_efficiency_from_times(exposed, spec.compute_time),
    )


def predicted_single_gpu_time(spec: ClusterSpec, convergence_epoch: int, images_per_epoch: int) -> float:
    """Predicted actual average single-GPU training time, seconds (training only, no evaluation)."""
    single_gpu_speed = spec.batch_per_gpu / spec.compute_time
    return metrics.model_single_gpu_time(
        convergence_epoch, images_per_epoch, single_gpu_speed, predict(spec).efficiency
    )  # = E * I / (S1 * eff) = N * E * I / (predicted cluster speed)


def sized(template: ClusterSpec, gpus: int, batch: int, compute_time: float) -> ClusterSpec:
    """``template`` at ``gpus`` GPUs: one node when gpus <= g, else whole g-GPU nodes (ValueError otherwise)."""
    g = template.gpus_per_node
    if gpus < 1 or (gpus > g and gpus % g):
        raise ValueError(f"{gpus} GPUs is neither at most one node ({g}) nor a whole number of {g}-GPU nodes")
    return replace(template, gpus_per_node=min(gpus, g), nodes=max(1, gpus // g), batch_per_gpu=batch,
                   compute_time=compute_time)


def efficiency_curve(spec: ClusterSpec, gpu_counts: Sequence[int]) -> list[tuple[int, float]]:
    """(N, predicted efficiency) as the cluster grows: N <= g fills one node, larger N must be whole nodes of g."""
    return [(int(n), float(predict(sized(spec, n, spec.batch_per_gpu, spec.compute_time)).efficiency))
            for n in gpu_counts]


@dataclass(frozen=True)
class Calibration:
    """Ring model fitted to measured (N, step time) points; bandwidth and latency are effective (exposed) values."""

    compute_time: float
    latency: float  # (1 - overlap) * latency
    bandwidth: float  # bandwidth / (1 - overlap)
    rms_relative_error: float  # of the fitted step times against the measured ones
    max_relative_error: float
    latency_fixed: bool = False  # True when the latency had to be fixed at 0 (see calibrate)


def calibrate(measured_points: Sequence[tuple[int, float]], gradient_bytes: float) -> Calibration:
    """Least-squares fit of step(N) = c + 2(N-1) * a + 2(N-1)/N * bytes / B to measured (N, step time) points.

    The ring model has one effective link, so points taken partly inside one node and partly across
    nodes see two different links; that mismatch shows up as calibration error, not as a hidden fix.
    Needs at least three distinct GPU counts. When the three-parameter fit puts all growth into the
    latency and leaves a per-byte cost <= 0 (a small machine whose compute itself slows down as ranks share
    cores grows faster than any ring term), the latency is fixed at 0 and the bandwidth fitted alone
    (``latency_fixed``). Raises ValueError when even that per-byte cost is not positive (the points show
    no growth of step time with N, so no bandwidth can be read from them).
    """
    if not (math.isfinite(gradient_bytes) and gradient_bytes > 0):
        raise ValueError(f"gradient_bytes must be positive, got {gradient_bytes!r}")
    counts, steps = np.array(measured_points, dtype=float).reshape(-1, 2).T  # the (N, step time) columns
    if counts.size == 0 or np.any(counts < 1) or np.any(counts != np.round(counts)):
        raise ValueError("measured_points must be (GPU count >= 1, step time) pairs")
    if np.any(~np.isfinite(steps)) or np.any(steps <= 0):
        raise ValueError("measured step times must be positive")
    if np.unique(counts).size < 3:
        raise ValueError("calibration needs points at three or more distinct GPU counts")
    design = np.column_stack(
        [np.ones_like(counts), 2 * (counts - 1), 2 * (counts - 1) / counts * gradient_bytes]
    )  # columns: c, a, 1/B
    (compute, latency, seconds_per_byte), *_ = np.linalg.lstsq(design, steps, rcond=None)
    latency_fixed = seconds_per_byte <= 0
    if latency_fixed:  # step(N) = c + 2(N-1)/N * bytes / B
        (compute, seconds_per_byte), *_ = np.linalg.lstsq(design[:, [0, 2]], steps, rcond=None)
        latency = 0.0
    if seconds_per_byte <= 0:
        raise ValueError("fitted per-byte cost is not positive: the points show no communication growth with N")
    relative = design @ np.array([compute, latency, seconds_per_byte]) / steps - 1.0
    return Calibration(
        compute_time=float(compute),
        latency=float(latency),
        bandwidth=float(1.0 / seconds_per_byte),
        rms_relative_error=float(np.sqrt(np.mean(relative**2))),
        max_relative_error=float(np.max(np.abs(relative))),
        latency_fixed=bool(latency_fixed),
    )


def fit_overlap(specs: Sequence[ClusterSpec], target_efficiencies: Sequence[float]) -> float:
    """One overlap fraction for all ``specs`` (their own ``overlap`` is ignored), least squares, clipped to [0, 1].

    Fits the linear form of the efficiency: 1/eff - 1 = (1 - overlap) * T_allreduce / compute.
    """
    if len(specs) != len(target_efficiencies) or not specs:
        raise ValueError("need one target efficiency per spec, and at least one spec")
    if any(not 0 < e <= 1 for e in target_efficiencies):
        raise ValueError("target efficiencies must lie in (0, 1]")
    x = np.array([allreduce_time(s) / s.compute_time for s in specs])  # T_allreduce / compute
    r = np.array([1.0 / e - 1.0 for e in target_efficiencies])  # exposed / compute
    if not np.any(x > 0):
        raise ValueError("no spec communicates (all single-GPU), so no overlap can be fitted")
    exposed_fraction = float(x @ r / (x @ x))  # least squares of r = (1 - overlap) * x
    return min(1.0, max(0.0, 1.0 - exposed_fraction))


@dataclass(frozen=True)
class PaperRow:
    label: str
    spec: ClusterSpec  # with the fitted overlap
    paper_efficiency: float
    predicted_efficiency: float

    @property
    def error(self) -> float:
        return self.predicted_efficiency - self.paper_efficiency  # in efficiency units (0.01 = 1 point)


@dataclass(frozen=True)
class PaperCheck:
    overlap: float
    rows: tuple[PaperRow, ...]

    @property
    def max_abs_error(self) -> float:
        return max(abs(row.error) for row in self.rows)

    @property
    def rms_error(self) -> float:
        return math.sqrt(sum(row.error**2 for row in self.rows) / len(self.rows))


NIC_40GBE = 40e9 / 8  # ConnectX-4 Lx 40 GbE RoCE, nominal payload rate, bytes/s
NIC_LATENCY = 10e-6  # per message across the network (RoCE + NCCL protocol), s
NVLINK_V100 = 100e9  # NCCL ring over NVLink inside a V100 node, bytes/s (not on the flat-ring critical path)
PCIE3_X16 = 12e9  # PCIe 3.0 x16, practical, bytes/s
INTRA_LATENCY = 5e-6  # per message inside a node, s
NIC_VIA_HOST = 1 / (1 / NIC_40GBE + 1 / PCIE3_X16)  # no GPUDirect RDMA: GPU->host copy in series with the NIC


def paper_cluster_specs() -> list[tuple[str, ClusterSpec, float]]:
    """The paper's four 24-GPU configurations as (label, spec with overlap 0, paper efficiency).

    Assumptions (section 3.1 hardware; the same for every row except where the hardware differs):
    compute time = per-GPU batch / the paper's single-GPU speed; ResNet-50 gradients as FP16 when the
    paper communicates in FP16 (cluster 1 mixed, cluster 2 "FP16 communication") else FP32; flat NCCL
    ring (section 2.2.3 3)); 40 GbE NIC at its nominal 5e9 B/s; cluster 2 has no GPUDirect RDMA, so its
    inter-node traffic is staged through host memory over PCIe, taken as not pipelined with the NIC
    (effective 1/(1/5e9 + 1/12e9) = 3.53e9 B/s). Paper efficiencies are the percentages it states
    (cluster 2 FP16 = 94% although its own 6903/7080 is 97.5%; see docs/paper_arithmetic.md).
    """
    cluster1 = dict(
        parameter_count=RESNET50_PARAMETERS, gpus_per_node=8, nodes=3,
        intra_bandwidth=NVLINK_V100, intra_latency=INTRA_LATENCY,
        inter_bandwidth=NIC_40GBE, inter_latency=NIC_LATENCY,
    )
    cluster2 = dict(
        parameter_count=RESNET50_PARAMETERS, gpus_per_node=4, nodes=6,
        intra_bandwidth=PCIE3_X16, intra_latency=INTRA_LATENCY,
        inter_bandwidth=NIC_VIA_HOST, inter_latency=NIC_LATENCY,
    )
    return [
        ("cluster 1, 24 V100, mixed precision, batch 256",
         ClusterSpec(compute_time_from_speed(256, 1542), 256, bytes_per_element=2, **cluster1), 0.975),
        ("cluster 1, 24 V100, FP32, batch 128",
         ClusterSpec(compute_time_from_speed(128, 758), 128, bytes_per_element=4, **cluster1), 0.977),
        ("cluster 2, 24 P40, FP32 compute, FP16 communication",
         ClusterSpec(compute_time_from_speed(128, 295), 128, bytes_per_element=2, **cluster2), 0.94),
        ("cluster 2, 24 P40, FP32 compute, FP32 communication",
         ClusterSpec(compute_time_from_speed(128, 295), 128, bytes_per_element=4, **cluster2), 0.912),
    ]


def paper_cluster_check() -> PaperCheck:
    """Predicted vs. paper 24-GPU efficiencies with one overlap fraction fitted to all four rows."""
    configs = paper_cluster_specs()
    overlap = fit_overlap([spec for _, spec, _ in configs], [paper for *_, paper in configs])
    rows = []
    for label, spec, paper in configs:
        fitted = replace(spec, overlap=overlap)
        rows.append(PaperRow(label, fitted, paper, predict(fitted).efficiency))
    return PaperCheck(overlap, tuple(rows))


def plot_efficiency(results: Mapping[str, Sequence[tuple[int, float]]], path: str) -> str:
    """Line plot of efficiency (%) vs. GPU count, one line per label; ``results[label]`` = [(N, efficiency)]."""
    from hybridtrain.files import figure as new_figure
    from hybridtrain.files import save_figure

    if not results:
        raise ValueError("nothing to plot: results is empty")
    figure = new_figure(6, 4)
    axes = figure.add_subplot()
    for label, points in results.items():
        counts = [n for n, _ in points]
        axes.plot(counts, [100 * e for _, e in points], marker="o", label=label)
    axes.set(xlabel="GPUs", ylabel="scaling efficiency (%)")
    axes.grid(True, alpha=0.3)
    axes.legend()
    figure.tight_layout()
    return save_figure(figure, path)

"""A rank's place in the job and its device: the topology every engine reports, the rank -> GPU binding and
its checks, and the rank's share of the CPU cores. Engine-neutral: no collective is called here."""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from hybridtrain.errors import UserError


@dataclass
class Topology:
    rank: int
    size: int
    local_rank: int
    local_size: int
    peers: tuple = ()  # (host, pid, GPU id) of every rank, to name the one that died and find shared GPUs
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))  # this rank's (select_device)
    engine: str = ""  # the engine that formed the job (its NAME); "" for a topology made by hand (one process)

    @property
    def is_root(self) -> bool:
        return self.rank == 0


def cuda_unusable_reason() -> str:
    """Why torch cannot use CUDA here, in words (for the one error line of train.device=cuda)."""
    if torch.version.cuda is None:
        return f"this torch ({torch.__version__}) is a CPU-only build: install a CUDA build of torch"
    try:
        torch.cuda.init()
    except Exception as exc:  # the driver's own words: too old, not loaded, no device
        return f"CUDA does not initialise ({str(exc).splitlines()[0]})"
    if torch.cuda.device_count() == 0:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        return "no GPU is visible" + (f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else "")
    return "torch.cuda.is_available() is False"


def device_index(local_rank: int, visible: int) -> int:
    """The GPU of a local rank among the ``visible`` ones: its own when each rank sees them all, the one it
    sees when a launcher gave each rank one GPU (SLURM --gpus-per-task=1, per-rank CUDA_VISIBLE_DEVICES)."""
    return local_rank % visible


def select_device(wanted: str, local_rank: int) -> torch.device:
    """``train.device``: auto (this rank's GPU when CUDA works, else the CPU), cuda (a GPU or one error line
    saying why not) or cpu."""
    if wanted == "cpu" or (wanted == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise UserError(f"train.device=cuda but CUDA is unusable: {cuda_unusable_reason()}; or set train.device=cpu")
    return torch.device("cuda", device_index(local_rank, torch.cuda.device_count()))


def gpu_id(device: torch.device) -> str:
    """A GPU's identity across processes that see different CUDA_VISIBLE_DEVICES; '' for the CPU."""
    if device.type != "cuda":
        return ""
    return str(getattr(torch.cuda.get_device_properties(device), "uuid", "")) or f"cuda:{device.index}"


def shared_gpus(peers: tuple) -> list[list[int]]:
    """The groups of ranks bound to one GPU of one host (peers: (host, pid, GPU id) per rank)."""
    by_gpu: dict[tuple, list[int]] = {}
    for rank, (host, _, gpu) in enumerate(peers):
        if gpu:
            by_gpu.setdefault((host, gpu), []).append(rank)
    return [ranks for ranks in by_gpu.values() if len(ranks) > 1]


def check_gpu_binding(peers: tuple) -> None:
    """One GPU per rank: NCCL refuses two ranks on one GPU, and they would fight for its memory anyway."""
    groups = shared_gpus(peers)
    if groups:
        ranks = groups[0]
        raise UserError(f"ranks {', '.join(map(str, ranks))} on host {peers[ranks[0]][0]} share one GPU "
                        f"({torch.cuda.device_count()} visible to each): start at most one rank per GPU on each "
                        f"host, give each rank its own GPU (CUDA_VISIBLE_DEVICES or --gpus-per-task=1), or set "
                        f"train.device=cpu")


def bind(topo: Topology, threads: int) -> Topology:
    """Set torch's threads (``threads``, or this rank's share of the cores) and current GPU for ``topo``."""
    torch.set_num_threads(threads or cores_per_rank(topo.local_size))
    if topo.device.type == "cuda":
        torch.cuda.set_device(topo.device)
    return topo


def cores_per_rank(local_size: int) -> int:
    """This rank's share of the cores (see rank_cores)."""
    node = os.cpu_count() or 1
    mine = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else node
    return rank_cores(mine, node, local_size)


def rank_cores(affinity: int, node_cores: int, local_size: int) -> int:
    """A rank's threads: its affinity as it is when a launcher already bound it to fewer than the node's cores
    (srun --cpus-per-task=8: 8, not 8 / 8 ranks), else the node's cores over the local ranks (at least 1)."""
    return affinity if affinity < node_cores else max(1, affinity // max(1, local_size))

"""Horovod, the engine: init, thread pinning, broadcast from rank 0, FP32 all-reduces of statistics."""
from __future__ import annotations

import hashlib
import os
import socket
import sys
from dataclasses import dataclass, field

import torch

from hybridtrain.errors import UserError, is_peer_failure, launcher_rank  # noqa: F401  (the last two re-exported)

SIZE_ENV_VARS = ("HOROVOD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")  # horovodrun, Open MPI, MPICH/Intel MPI


def venv_tool(name: str) -> str:
    """The path of a console tool (horovodrun, hybridtrain) of this Python's environment, else from PATH."""
    import shutil
    bin_dir = os.path.dirname(sys.executable)
    found = shutil.which(name, path=bin_dir + os.pathsep + os.environ.get("PATH", ""))
    if not found:
        raise UserError(f"{name} is not on PATH: run ./install.sh and use .venv/bin")
    return found


def import_horovod():
    try:
        import horovod.torch as hvd
    except ImportError as exc:
        raise UserError(f"Horovod is not usable in this environment ({exc}): run ./install.sh, "
                        f"which builds Horovod 0.28.1 for this torch") from None
    return hvd


@dataclass
class Topology:
    rank: int
    size: int
    local_rank: int
    local_size: int
    peers: tuple = ()  # (host, pid, GPU id) of every rank, to name the one that died and find shared GPUs
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))  # this rank's (select_device)

    @property
    def is_root(self) -> bool:
        return self.rank == 0


# ----------------------------------------------------------------------------- rank -> device

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


def check_gpu_binding(peers: tuple, device: torch.device) -> None:
    """One GPU per rank: NCCL refuses two ranks on one GPU, and they would fight for its memory anyway."""
    groups = shared_gpus(peers)
    if groups:
        ranks = groups[0]
        raise UserError(f"ranks {', '.join(map(str, ranks))} on host {peers[ranks[0]][0]} share one GPU "
                        f"({torch.cuda.device_count()} visible to each): start at most one rank per GPU on each "
                        f"host, give each rank its own GPU (CUDA_VISIBLE_DEVICES or --gpus-per-task=1), or set "
                        f"train.device=cpu")
    if device.type == "cuda":
        hvd = import_horovod()
        if not hvd.nccl_built():
            raise UserError("this Horovod was built without NCCL, so GPU all-reduces would be staged through host "
                            "memory (or refused): rebuild with HOROVOD_GPU_OPERATIONS=NCCL ./install.sh, or set "
                            "train.device=cpu")


def launcher_size() -> int:
    """The number of processes the launcher started (0 when none says so)."""
    for var in SIZE_ENV_VARS:
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return 0


def check_controller(hvd) -> None:
    """Refuse a HOROVOD_CONTROLLER that hvd.init() would abort the process on, without a message."""
    wanted = os.environ.get("HOROVOD_CONTROLLER", "")
    if not wanted:
        return
    name = wanted.lower()
    if name not in ("mpi", "gloo"):
        raise UserError(f"HOROVOD_CONTROLLER={wanted} is not a Horovod controller: set it to mpi or gloo, or unset it")
    if name == "mpi" and not hvd.mpi_built():
        raise UserError("HOROVOD_CONTROLLER=mpi but this Horovod was built without MPI: launch with horovodrun --gloo, "
                        "or install Open MPI (mpicxx, mpirun) and rerun ./install.sh")
    if name == "gloo" and not os.environ.get("HOROVOD_GLOO_RENDEZVOUS_ADDR"):
        raise UserError("HOROVOD_CONTROLLER=gloo needs the rendezvous that horovodrun --gloo provides, and this "
                        "process was not started by it: launch with horovodrun --gloo, or unset HOROVOD_CONTROLLER")


def check_world_size(size: int) -> None:
    """Each process alone in a 1-rank job although the launcher started N: the classic MPI mismatch."""
    expected = launcher_size()
    if expected and expected != size:
        raise UserError(f"the launcher started {expected} processes but Horovod formed a {size}-rank job: the "
                        f"mpirun on PATH is not the MPI Horovod was built with; use that MPI's mpirun, or launch "
                        f"with horovodrun --gloo")


def horovod_environment(horovod_cfg) -> dict[str, str]:
    """The HOROVOD_* variables that set the config's tuning knobs; hvd.init() reads them."""
    env = {"HOROVOD_FUSION_THRESHOLD": str(horovod_cfg.fusion_threshold_mb * 2 ** 20),
           "HOROVOD_CYCLE_TIME": f"{horovod_cfg.cycle_time_ms:g}",
           "HOROVOD_AUTOTUNE": "1" if horovod_cfg.autotune else "0",
           "HOROVOD_STALL_CHECK_TIME_SECONDS": str(horovod_cfg.stall_warning_s),
           "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": str(horovod_cfg.stall_shutdown_s),
           "HOROVOD_GLOO_TIMEOUT_SECONDS": str(horovod_cfg.gloo_timeout_s)}
    if horovod_cfg.autotune_log:
        env["HOROVOD_AUTOTUNE_LOG"] = os.path.abspath(horovod_cfg.autotune_log)
    return env


def same_setting(a: str, b: str) -> bool:
    """'2.0' and '2' are the same cycle time."""
    try:
        return float(a) == float(b)
    except ValueError:
        return a == b


# Horovod's own defaults (since 0.21). Under elastic training, hvd.init() after a resize crashes (SIGSEGV,
# Horovod 0.28.1) when both of these variables are set, so they are exported there only when they differ.
HOROVOD_DEFAULTS = {"HOROVOD_FUSION_THRESHOLD": str(128 * 2 ** 20), "HOROVOD_CYCLE_TIME": "1"}


def set_horovod_knobs(horovod_cfg, elastic: bool = False) -> None:
    """Export the config's knobs for hvd.init(). The config wins over a value the launcher set (e.g. horovodrun
    --fusion-threshold-mb); rank 0 says so in one warning line per replaced variable."""
    for name, value in horovod_environment(horovod_cfg).items():
        if elastic and HOROVOD_DEFAULTS.get(name) is not None and same_setting(HOROVOD_DEFAULTS[name], value):
            os.environ.pop(name, None)
            continue
        previous = os.environ.get(name)
        if previous is not None and not same_setting(previous, value) and launcher_rank() == 0:
            print(f"hybridtrain: warning: {name}={previous} from the launcher is replaced by the config's {value}; "
                  f"set the horovod.* key instead", file=sys.stderr, flush=True)
        os.environ[name] = value


def init(threads: int = 0, horovod_cfg=None, elastic: bool = False, device: str = "auto") -> Topology:
    """hvd.init() with the config's Horovod knobs (``horovod_cfg``; None leaves Horovod's own settings), pin
    torch threads (``threads``, or this rank's share of the cores) and bind the rank to its device
    (``device``: train.device). ``elastic``: no collective here (a worker joining a running elastic job must
    reach the state sync first), and the launcher's size is only the initial one."""
    hvd = import_horovod()
    if horovod_cfg is not None:
        set_horovod_knobs(horovod_cfg, elastic)
    check_controller(hvd)
    hvd.init()
    if elastic:
        return current_topology(threads, device=device)
    check_world_size(hvd.size())
    chosen = select_device(device, hvd.local_rank())
    peers = tuple(hvd.allgather_object((socket.gethostname(), os.getpid(), gpu_id(chosen)), name="peers"))
    check_gpu_binding(peers, chosen)
    return current_topology(threads, peers, device)


def current_topology(threads: int = 0, peers: tuple = (), device: str = "auto") -> Topology:
    """This rank's place in the job Horovod formed last, with torch's threads and device set for it."""
    hvd = import_horovod()
    chosen = select_device(device, hvd.local_rank())
    topo = Topology(hvd.rank(), hvd.size(), hvd.local_rank(), hvd.local_size(), peers, chosen)
    torch.set_num_threads(threads or cores_per_rank(topo.local_size))
    if chosen.type == "cuda":
        torch.cuda.set_device(chosen)
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


def broadcast_model(model: torch.nn.Module) -> None:
    """Rank 0's parameters and buffers to every rank, in place, whatever their memory layout (channels_last
    included: each tensor goes through its dense view, so no copy is made)."""
    hvd = import_horovod()
    views = {name: (t, *dense_view(t)) for name, t in model.state_dict().items()}
    hvd.broadcast_parameters({name: view for name, (_, view, _) in views.items()}, root_rank=0)
    with torch.no_grad():
        for t, view, order in views.values():
            if order == ():  # no dense view existed: the broadcast went to a copy
                t.copy_(view)


def on_cpu(obj):
    """``obj`` with every tensor moved to the CPU (lists, tuples and dicts followed)."""
    if torch.is_tensor(obj):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {key: on_cpu(value) for key, value in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(on_cpu(item) for item in obj)
    return obj


def broadcast_object(obj, name: str):
    """Rank 0's ``obj`` on every rank, its tensors on the CPU: a CUDA tensor would be unpickled onto rank 0's GPU
    on every rank (Horovod's broadcast_object loads without map_location)."""
    return import_horovod().broadcast_object(on_cpu(obj), root_rank=0, name=name)


def _tensors_in(obj):
    if torch.is_tensor(obj):
        yield obj
    elif isinstance(obj, dict):
        for key in sorted(obj, key=str):
            yield from _tensors_in(obj[key])
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _tensors_in(item)


def state_digest(*states: dict) -> str:
    """sha256 over every tensor of the given state dicts: equal digests = bitwise-equal states."""
    h = hashlib.sha256()
    for tensor in (t for state in states for t in _tensors_in(state)):
        h.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def gather_digests(*states: dict) -> list[str]:
    return import_horovod().allgather_object(state_digest(*states), name="state_digests")


def allreduce_sum(tensor: torch.Tensor, name: str) -> torch.Tensor:
    hvd = import_horovod()
    return hvd.allreduce(tensor, op=hvd.Sum, name=name)


def allreduce_mean_fp32(tensors: list[torch.Tensor], name: str) -> list[torch.Tensor]:
    """Average tensors over ranks in FP32 (one fused call), whatever their own dtype."""
    hvd = import_horovod()
    flat = torch.cat([t.detach().float().reshape(-1) for t in tensors])
    flat = hvd.allreduce(flat, op=hvd.Average, name=name)
    return list(torch.split(flat, [t.numel() for t in tensors]))


# ----------------------------------------------------------------------------- gradient compression

def dense_view(t: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...] | None]:
    """(a view of ``t`` that is contiguous in the default sense, the permutation that made it), or (``t``,
    None) when ``t`` is contiguous already. A channels_last (NHWC) tensor is dense in memory but not contiguous
    as NCHW, which Horovod refuses; permuted to N,H,W,C it is contiguous and shares ``t``'s memory, and an
    element-wise collective (all-reduce, broadcast) does not care about the order of the elements."""
    if t.is_contiguous():
        return t, None
    order = tuple(sorted(range(t.dim()), key=lambda d: (-t.stride(d), -t.shape[d])))
    view = t.permute(order)
    if not view.is_contiguous():  # overlapping or gapped storage: no dense view exists
        return t.contiguous(), ()
    return view, order


def undo_dense_view(t: torch.Tensor, order: tuple[int, ...] | None) -> torch.Tensor:
    """The inverse of dense_view: the original shape with the original strides (``order`` () = a copy was made)."""
    if not order:
        return t
    inverse = [0] * len(order)
    for position, dim in enumerate(order):
        inverse[dim] = position
    return t.permute(inverse)


class LayoutCompressor:
    """Horovod's Compressor interface for any memory layout: the gradient is sent as its dense view, cast to
    ``wire`` (None: its own dtype), and given back in its own dtype and strides, so the optimizer's multi-tensor
    kernels keep matching strides. No layout copy: NHWC gradients stay NHWC (a cast is the only copy, as in
    Horovod's own FP16 compressor)."""

    wire: torch.dtype | None = None

    @classmethod
    def compress(cls, tensor: torch.Tensor):
        view, order = dense_view(tensor)
        if cls.wire is not None and tensor.is_floating_point() and tensor.dtype != cls.wire:
            return view.to(cls.wire), (tensor.dtype, order)
        return view, (None, order)

    @classmethod
    def decompress(cls, tensor: torch.Tensor, ctx):
        dtype, order = ctx
        return undo_dense_view(tensor.to(dtype) if dtype is not None else tensor, order)


class NoCompression(LayoutCompressor):
    wire = None


class FP16Compression(LayoutCompressor):
    wire = torch.float16


COMPRESSORS = {"none": NoCompression, "fp16": FP16Compression}  # Horovod 0.28.1's torch ops have no bfloat16


def distributed_optimizer(optimizer: torch.optim.Optimizer, model: torch.nn.Module, horovod_cfg,
                          backward_passes_per_step: int = 1, compression: str = "none"):
    """Horovod's averaging all-reduce with ``compression`` (resolved: precision.gradient_compression) and the configured
    pre-divide factor; gradients of ``backward_passes_per_step`` passes accumulate locally before one all-reduce."""
    hvd = import_horovod()
    return hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                    compression=COMPRESSORS[compression], op=hvd.Average,
                                    gradient_predivide_factor=horovod_cfg.gradient_predivide_factor,
                                    backward_passes_per_step=backward_passes_per_step)


def barrier() -> None:
    """Wait for every rank (no tensor is all-reduced, so Horovod's timeline stays clean)."""
    import_horovod().barrier()


def allgather_floats(values: list[float], name: str) -> list[float]:
    """Every rank's ``values``, concatenated in rank order."""
    hvd = import_horovod()
    return hvd.allgather(torch.tensor(values, dtype=torch.float64), name=name).tolist()

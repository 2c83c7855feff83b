"""Horovod, the engine: init, thread pinning, broadcast from rank 0, FP32 all-reduces of statistics."""
from __future__ import annotations

import hashlib
import os
import socket
import sys
from dataclasses import dataclass

import torch

from .errors import PeerFailure, UserError

RANK_ENV_VARS = ("HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "SLURM_PROCID")
SIZE_ENV_VARS = ("HOROVOD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")  # horovodrun, Open MPI, MPICH/Intel MPI


def launcher_rank() -> int:
    """The rank the launcher assigned, readable before hvd.init() (0 when run alone)."""
    for var in RANK_ENV_VARS:
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return 0


def venv_tool(name: str) -> str:
    """The path of a console tool (horovodrun, hybridtrain) of this Python's environment, else from PATH."""
    import shutil
    bin_dir = os.path.dirname(sys.executable)
    found = shutil.which(name, path=bin_dir + os.pathsep + os.environ.get("PATH", ""))
    if not found:
        raise UserError(f"{name} is not on PATH: run ./install.sh and use .venv/bin")
    return found


def process_alive(pid: int) -> bool:
    """A running process (a zombie that its launcher has not reaped yet counts as dead)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def departed(topo) -> tuple[list[int], list[int]]:
    """(ranks on this host whose process is gone, ranks on this host still alive), from ``topo.peers``."""
    host = socket.gethostname()
    local = [(rank, pid) for rank, (h, pid) in enumerate(topo.peers) if h == host]
    return ([rank for rank, pid in local if not process_alive(pid)],
            [rank for rank, pid in local if process_alive(pid)])


def peer_failure(topo) -> PeerFailure:
    """The one line a surviving rank prints: which rank died (when it ran on this host) and how to resume."""
    gone, alive = departed(topo) if topo.peers else ([], [topo.rank])
    who = (f"rank {', '.join(map(str, gone))} ({'its process is' if len(gone) == 1 else 'their processes are'} "
           f"gone)" if gone else "a rank on another host")
    return PeerFailure(f"the job stopped because {who} died or failed (its error line, if any, says why); "
                       f"checkpoints are intact: rerun the same command with --resume auto",
                       announce=topo.rank == min(alive, default=topo.rank))


def is_peer_failure(exc: BaseException) -> bool:
    """True for the error Horovod raises on the surviving ranks after another rank failed or exited."""
    return type(exc).__name__ == "HorovodInternalError" or "Horovod has been shut down" in str(exc)


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
    peers: tuple = ()  # (host, pid) of every rank, to name the one that died

    @property
    def is_root(self) -> bool:
        return self.rank == 0

    @property
    def device(self) -> torch.device:
        """This rank's GPU (the local rank's) when CUDA is available, else the CPU."""
        return torch.device("cuda", self.local_rank) if torch.cuda.is_available() else torch.device("cpu")


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


def init(threads: int = 0, horovod_cfg=None, elastic: bool = False) -> Topology:
    """hvd.init() with the config's Horovod knobs (``horovod_cfg``; None leaves Horovod's own settings), and pin
    torch threads: ``threads`` or cores / local ranks. ``elastic``: no collective here (a worker joining a
    running elastic job must reach the state sync first), and the launcher's size is only the initial one."""
    hvd = import_horovod()
    if horovod_cfg is not None:
        set_horovod_knobs(horovod_cfg, elastic)
    check_controller(hvd)
    hvd.init()
    if elastic:
        return current_topology(threads)
    check_world_size(hvd.size())
    peers = tuple(hvd.allgather_object((socket.gethostname(), os.getpid()), name="peers"))
    return current_topology(threads, peers)


def current_topology(threads: int = 0, peers: tuple = ()) -> Topology:
    """This rank's place in the job Horovod formed last, with torch's threads and device set for it."""
    hvd = import_horovod()
    topo = Topology(hvd.rank(), hvd.size(), hvd.local_rank(), hvd.local_size(), peers)
    torch.set_num_threads(threads or cores_per_rank(topo.local_size))
    if torch.cuda.is_available():
        torch.cuda.set_device(topo.local_rank)
    return topo


def cores_per_rank(local_size: int) -> int:
    """This process's cores shared among the ranks on the node (at least 1)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cores // max(1, local_size))


def broadcast_model(model: torch.nn.Module) -> None:
    """Rank 0's parameters and buffers to every rank."""
    hvd = import_horovod()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)


def broadcast_object(obj, name: str):
    return import_horovod().broadcast_object(obj, root_rank=0, name=name)


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


def compression(name: str):
    hvd = import_horovod()
    return {"fp16": hvd.Compression.fp16, "none": hvd.Compression.none}[name]


def distributed_optimizer(optimizer: torch.optim.Optimizer, model: torch.nn.Module, horovod_cfg,
                          backward_passes_per_step: int = 1):
    """Horovod's averaging all-reduce, FP16-compressed by default, with the configured pre-divide factor;
    gradients of ``backward_passes_per_step`` passes accumulate locally before one all-reduce."""
    hvd = import_horovod()
    return hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                    compression=compression(horovod_cfg.compression), op=hvd.Average,
                                    gradient_predivide_factor=horovod_cfg.gradient_predivide_factor,
                                    backward_passes_per_step=backward_passes_per_step)


def barrier() -> None:
    """Wait for every rank (no tensor is all-reduced, so Horovod's timeline stays clean)."""
    import_horovod().barrier()


def allgather_floats(values: list[float], name: str) -> list[float]:
    """Every rank's ``values``, concatenated in rank order."""
    hvd = import_horovod()
    return hvd.allgather(torch.tensor(values, dtype=torch.float64), name=name).tolist()

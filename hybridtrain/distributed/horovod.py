"""The Horovod engine: ``hvd.init()`` with the config's knobs, its collectives, and the data-parallel step
(``hvd.DistributedOptimizer``: an all-reduce hook per gradient, fused in the background, ``synchronize()``
before the update). ``distributed.collectives`` calls it; nothing above ``distributed/`` imports it, except
Horovod's own elastic loop (``engine/elastic.py``)."""
from __future__ import annotations

import os
import socket
import sys

import torch

from hybridtrain.distributed.engines import launcher_size
from hybridtrain.distributed.topology import Topology, bind, check_gpu_binding, gpu_id, select_device
from hybridtrain.errors import UserError
from hybridtrain.launched_by import launcher_rank

NAME = "horovod"


def import_horovod():
    try:
        import horovod.torch as hvd
    except ImportError as exc:
        raise UserError(f"the Horovod engine is not usable in this environment ({exc}): run ./install.sh, which "
                        f"builds Horovod 0.28.1 for this torch (unless HYBRIDTRAIN_SKIP_HOROVOD=1), or train on "
                        f"torch.distributed: torchrun --nproc-per-node=N -m hybridtrain train ... --engine torch"
                        ) from None
    return hvd


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


def horovod_environment(cfg) -> dict[str, str]:
    """The HOROVOD_* variables that set the config's tuning knobs; hvd.init() reads them."""
    knobs, limits = cfg.horovod, cfg.distributed
    env = {"HOROVOD_FUSION_THRESHOLD": str(knobs.fusion_threshold_mb * 2 ** 20),
           "HOROVOD_CYCLE_TIME": f"{knobs.cycle_time_ms:g}",
           "HOROVOD_AUTOTUNE": "1" if knobs.autotune else "0",
           "HOROVOD_STALL_CHECK_TIME_SECONDS": str(limits.stall_warning_s),
           "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": str(limits.stall_shutdown_s),
           "HOROVOD_GLOO_TIMEOUT_SECONDS": str(limits.gloo_timeout_s)}
    if knobs.autotune_log:
        env["HOROVOD_AUTOTUNE_LOG"] = os.path.abspath(knobs.autotune_log)
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


def set_horovod_knobs(cfg, elastic: bool = False) -> None:
    """Export the config's knobs for hvd.init(). The config wins over a value the launcher set (e.g. horovodrun
    --fusion-threshold-mb); rank 0 says so in one warning line per replaced variable."""
    for name, value in horovod_environment(cfg).items():
        if elastic and HOROVOD_DEFAULTS.get(name) is not None and same_setting(HOROVOD_DEFAULTS[name], value):
            os.environ.pop(name, None)
            continue
        previous = os.environ.get(name)
        if previous is not None and not same_setting(previous, value) and launcher_rank() == 0:
            print(f"hybridtrain: warning: {name}={previous} from the launcher is replaced by the config's {value}; "
                  f"set the horovod.* or distributed.* key instead", file=sys.stderr, flush=True)
        os.environ[name] = value


def init(threads: int = 0, cfg=None, elastic: bool = False, device: str = "auto") -> Topology:
    """hvd.init() with the config's Horovod knobs and limits (``cfg``; None leaves Horovod's own settings), pin
    torch threads (``threads``, or this rank's share of the cores) and bind the rank to its device
    (``device``: train.device). ``elastic``: no collective here (a worker joining a running elastic job must
    reach the state sync first), and the launcher's size is only the initial one."""
    hvd = import_horovod()
    if cfg is not None:
        set_horovod_knobs(cfg, elastic)
    check_controller(hvd)
    # Open MPI busy-polls while Horovod's background thread waits on its peers: a core per rank, taken from the
    # compute and the loader workers wherever they share cores; yielding gives it back (a fifth off the
    # demo's epochs, docs/benchmarks.md). MPI_Init (in hvd.init) reads it; the user's own setting wins.
    os.environ.setdefault("OMPI_MCA_mpi_yield_when_idle", "1")
    hvd.init()
    if elastic:
        return current_topology(threads, device=device)
    check_world_size(hvd.size())
    chosen = select_device(device, hvd.local_rank())
    peers = tuple(hvd.allgather_object((socket.gethostname(), os.getpid(), gpu_id(chosen)), name="peers"))
    check_gpu_binding(peers)
    if chosen.type == "cuda" and not hvd.nccl_built():
        raise UserError("this Horovod was built without NCCL, so GPU all-reduces would be staged through host "
                        "memory (or refused): rebuild with HOROVOD_GPU_OPERATIONS=NCCL ./install.sh, use "
                        "--engine torch under torchrun, or set train.device=cpu")
    return current_topology(threads, peers, device)


def current_topology(threads: int = 0, peers: tuple = (), device: str = "auto") -> Topology:
    """This rank's place in the job Horovod formed last, with torch's threads and device set for it."""
    hvd = import_horovod()
    chosen = select_device(device, hvd.local_rank())
    return bind(Topology(hvd.rank(), hvd.size(), hvd.local_rank(), hvd.local_size(), peers, chosen, NAME), threads)


# ----------------------------------------------------------------------------- collectives

def size() -> int:
    return import_horovod().size()


# ----------------------------------------------------------------------------- tensors of any memory layout
# Horovod's collectives take only tensors contiguous as NCHW; a channels_last (NHWC) tensor goes as its dense view,
# without a copy: the broadcast of the model, and every gradient through the compressor.

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
    return t.permute(sorted(range(len(order)), key=order.__getitem__)) if order else t


def broadcast_tensors(tensors: dict[str, torch.Tensor]) -> None:
    """Rank 0's tensors on every rank, in place, whatever their memory layout: each goes as its dense view (no
    copy), or as a dense copy written back where no view exists."""
    views = {name: (t, *dense_view(t)) for name, t in tensors.items()}
    import_horovod().broadcast_parameters({name: view for name, (_, view, _) in views.items()}, root_rank=0)
    with torch.no_grad():
        for t, view, order in views.values():
            if order == ():  # no dense view existed: the broadcast went to a copy
                t.copy_(view)


def broadcast_object(obj, name: str):
    return import_horovod().broadcast_object(obj, root_rank=0, name=name)


def allgather_object(obj, name: str) -> list:
    return import_horovod().allgather_object(obj, name=name)


def allreduce(tensor: torch.Tensor, name: str, average: bool = False) -> torch.Tensor:
    hvd = import_horovod()
    return hvd.allreduce(tensor, op=hvd.Average if average else hvd.Sum, name=name)


def allreduce_differentiable(tensor: torch.Tensor) -> torch.Tensor:
    """The sum over ranks, with its gradient (Horovod's allreduce is an autograd function)."""
    return allreduce(tensor, None)


def allreduce_async(tensor: torch.Tensor, name: str):
    hvd = import_horovod()
    return hvd.allreduce_async(tensor, op=hvd.Sum, name=name)


def wait(handle) -> torch.Tensor:
    return import_horovod().synchronize(handle)


def allgather(tensor: torch.Tensor, name: str) -> torch.Tensor:
    return import_horovod().allgather(tensor, name=name)


def barrier() -> None:
    """Wait for every rank (no tensor is all-reduced, so Horovod's timeline stays clean)."""
    import_horovod().barrier()


def shutdown() -> None:
    """Nothing: Horovod shuts its background thread down itself at exit (its own atexit handler)."""


def sync_batch_norm_class() -> type:
    return import_horovod().SyncBatchNorm


# ----------------------------------------------------------------------------- the data-parallel step

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


NoCompression = LayoutCompressor  # wire None: each gradient in its own dtype


class FP16Compression(LayoutCompressor):
    wire = torch.float16


COMPRESSORS = {"none": NoCompression, "fp16": FP16Compression}  # Horovod 0.28.1's torch ops have no bfloat16


def wrap_model(model: torch.nn.Module, cfg, compression: str = "none") -> torch.nn.Module:
    """Horovod leaves the forward as it is: its hooks go on the gradients (wrap_optimizer)."""
    return model


def check_graphs_and_compression(cuda_graphs: bool, compression: str, size: int) -> None:
    """On 2+ ranks Horovod's hooks decompress each FP16 gradient into a new tensor and set it as
    p.grad, so a CUDA graph, which writes the gradients it captured, would train on stale ones from step 2 on."""
    if cuda_graphs and compression != "none" and size > 1:
        raise UserError(f"train.cuda_graphs with {compression} gradient compression on {size} Horovod ranks would "
                        f"train on stale gradients (Horovod replaces the gradient tensors the graph writes): set "
                        f"distributed.compression=none, or train.cuda_graphs=false (train.compile works with both)")


def wrap_optimizer(optimizer: torch.optim.Optimizer, model: torch.nn.Module, cfg, backward_passes_per_step: int = 1,
                   compression: str = "none"):
    """Horovod's averaging all-reduce with ``compression`` (resolved: precision.gradient_compression) and the
    configured pre-divide factor; gradients of ``backward_passes_per_step`` passes accumulate locally before one
    all-reduce. The scaler calls its ``synchronize()`` before the unscale and steps under ``skip_synchronize()``; its
    ``zero_grad()`` sets the gradients to None (torch's default): Horovod all-reduces into tensors of its own, so
    there is no bucket memory to keep."""
    hvd = import_horovod()
    check_graphs_and_compression(cfg.train.cuda_graphs, compression, hvd.size())
    return hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                    compression=COMPRESSORS[compression], op=hvd.Average,
                                    gradient_predivide_factor=cfg.horovod.gradient_predivide_factor,
                                    backward_passes_per_step=backward_passes_per_step)

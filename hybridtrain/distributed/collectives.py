"""The one face of the engines: what ``engine/``, ``models/`` and ``perf/`` call, whichever engine formed the job.

``init`` picks the engine (``distributed.engine``, or auto from the launcher) and every call after it goes to that
engine's module (``engines.ENGINES``), which provides ``engines.Engine``: the collectives (broadcast from rank 0,
FP32 all-reduces of statistics, gathers, a barrier) and the step contract (``wrap_model`` around the forward,
``wrap_optimizer`` around the update). A call before ``init`` is an error naming the call.
"""
from __future__ import annotations

import hashlib

import torch
from torch.utils._pytree import tree_map

from hybridtrain.distributed.engines import Engine, engine_module, engine_spec
from hybridtrain.distributed.launcher import resolve_engine
from hybridtrain.distributed.topology import Topology
from hybridtrain.errors import PEER_FAILURE_SIGNS

_active: dict[str, Engine | None] = {"engine": None}


def backend(call: str) -> Engine:
    """The engine module that formed this process's job; before any ``init``, an error naming ``call``: there is no
    job to run it in, and no engine to guess."""
    if _active["engine"] is None:
        raise RuntimeError(f"distributed.{call}() was called before distributed.init(): no engine has formed a job "
                           f"yet; call init first (a tool or a test alone: init(device='cpu', engine='torch') forms "
                           f"a job of one)")
    return _active["engine"]


def init(threads: int = 0, cfg=None, elastic: bool = False, device: str = "auto",
         engine: str = "auto") -> Topology:
    """Form (or join) the job on ``engine`` (distributed.engine), pin the threads, bind the rank to its device.
    ``cfg``: the config, whose horovod.* and distributed.* limits the engine applies (None: the engine's own)."""
    name = resolve_engine(engine)
    module = engine_module(name)
    _active["engine"] = module
    spec = engine_spec(name)  # the signs of a lost peer in its errors on a surviving rank
    PEER_FAILURE_SIGNS["types"], PEER_FAILURE_SIGNS["words"] = spec.peer_failure_types, spec.peer_failure_words
    topo = module.init(threads, cfg, elastic=elastic, device=device)
    topo.engine = module.NAME
    return topo


def engine_name() -> str:
    return backend("engine_name").NAME


def active_engine() -> Engine:
    """The engine module that formed the job, for a caller that reduces at every few steps (the preemption check):
    it calls the engine itself, without this face's lookup each time."""
    return backend("active_engine")


def size() -> int:
    return backend("size").size()


# ----------------------------------------------------------------------------- broadcast from rank 0

def broadcast_model(model: torch.nn.Module) -> None:
    """Rank 0's parameters and buffers to every rank, in place, whatever their memory layout (channels_last
    included: each engine sends it without a layout copy)."""
    backend("broadcast_model").broadcast_tensors(model.state_dict())


def on_cpu(obj):
    """``obj`` with every tensor moved to the CPU (lists, tuples and dicts followed: torch's own tree walk)."""
    return tree_map(lambda leaf: leaf.detach().cpu() if torch.is_tensor(leaf) else leaf, obj)


def broadcast_object(obj, name: str):
    """Rank 0's ``obj`` on every rank, its tensors on the CPU: a CUDA tensor would be unpickled onto rank 0's GPU
    on every rank."""
    return backend("broadcast_object").broadcast_object(on_cpu(obj), name)


def allgather_object(obj, name: str) -> list:
    """Every rank's ``obj`` (picklable, on the CPU), in rank order."""
    return backend("allgather_object").allgather_object(on_cpu(obj), name)


# ----------------------------------------------------------------------------- reductions

def allreduce_sum(tensor: torch.Tensor, name: str) -> torch.Tensor:
    return backend("allreduce_sum").allreduce(tensor, name)


def allreduce_mean_fp32(tensors: list[torch.Tensor], name: str) -> list[torch.Tensor]:
    """Average tensors over ranks in FP32 (one fused call), whatever their own dtype."""
    flat = torch.cat([t.detach().float().reshape(-1) for t in tensors])
    flat = backend("allreduce_mean_fp32").allreduce(flat, name, average=True)
    return list(torch.split(flat, [t.numel() for t in tensors]))


def allreduce_differentiable(tensor: torch.Tensor) -> torch.Tensor:
    """The sum over ranks inside the autograd graph (cross-rank BatchNorm on CPUs)."""
    return backend("allreduce_differentiable").allreduce_differentiable(tensor)


def allreduce_async(tensor: torch.Tensor, name: str):
    """Start a sum over ranks; ``wait(handle)`` gives it."""
    return backend("allreduce_async").allreduce_async(tensor, name)


def wait(handle) -> torch.Tensor:
    return backend("wait").wait(handle)


def allgather_floats(values: list[float], name: str) -> list[float]:
    """Every rank's ``values`` (as many on every rank), concatenated in rank order."""
    return backend("allgather_floats").allgather(torch.tensor(values, dtype=torch.float64), name).tolist()


def barrier() -> None:
    backend("barrier").barrier()


def shutdown() -> None:
    """Leave the job after its last collective, on success only (a failed rank must not wait for its peers)."""
    backend("shutdown").shutdown()


# ----------------------------------------------------------------------------- digests

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
    return allgather_object(state_digest(*states), "state_digests")


# ----------------------------------------------------------------------------- the data-parallel step

def sync_batch_norm_class() -> type:
    """The engine's cross-rank BatchNorm for GPUs (bn.sync)."""
    return backend("sync_batch_norm_class").sync_batch_norm_class()


def wrap_model(model: torch.nn.Module, cfg, compression: str = "none") -> torch.nn.Module:
    """The module the training step's forward runs: ``model`` itself (Horovod), or DDP around it (torch)."""
    return backend("wrap_model").wrap_model(model, cfg, compression)


def wrap_optimizer(optimizer, model: torch.nn.Module, cfg, backward_passes_per_step: int = 1,
                   compression: str = "none"):
    """The optimizer the step updates with: Horovod's DistributedOptimizer (all-reduce hooks, ``synchronize()``
    before the update), or the optimizer itself (DDP reduced in the backward)."""
    return backend("wrap_optimizer").wrap_optimizer(optimizer, model, cfg, backward_passes_per_step, compression)

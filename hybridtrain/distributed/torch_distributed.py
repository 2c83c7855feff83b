"""The torch.distributed engine: a process group from ``torchrun``'s (or ``srun``'s) environment, its collectives,
and the data-parallel step on DDP (gradient buckets all-reduced during the backward, FP16 on the wire through
``fp16_compress_hook``, ``no_sync()`` for the passes of gradient accumulation).

On GPUs the group has two backends, ``cpu:gloo,cuda:nccl``: the gradients and everything on the GPU go over NCCL,
the small CPU collectives of statistics, flags and objects over Gloo, as Horovod sends them over its controller.
``distributed.collectives`` calls this module; nothing above ``distributed/`` imports it.
"""
from __future__ import annotations

import functools
import gc
import os
import socket
from datetime import timedelta

import torch
import torch.distributed as dist

from hybridtrain.distributed.engines import refuse_elastic, with_step_contract
from hybridtrain.distributed.launch_env import process_env
from hybridtrain.distributed.topology import Topology, bind, check_gpu_binding, gpu_id, select_device
from hybridtrain.errors import UserError

NAME = "torch"


# HYBRIDTRAIN_TORCH_BACKEND=gloo: every collective over Gloo, CUDA tensors too, and ranks may share a GPU, which
# NCCL refuses: two ranks sharing one GPU (DDP's buckets and FP16 hook on CUDA tensors)
BACKEND_VAR = "HYBRIDTRAIN_TORCH_BACKEND"


def gloo_forced(env=None) -> bool:
    value = (os.environ if env is None else env).get(BACKEND_VAR, "")
    if value not in ("", "gloo"):
        raise UserError(f"{BACKEND_VAR}={value!r}: its one value is gloo (every collective over Gloo, so that ranks "
                        f"can share a GPU); unset it for NCCL on GPUs")
    return value == "gloo"


def backend_for(device: torch.device, env=None) -> str:
    """Gloo on CPUs; on GPUs NCCL for GPU tensors and Gloo for the CPU ones (objects, flags, statistics); Gloo
    for all of them when BACKEND_VAR says so."""
    if device.type != "cuda" or gloo_forced(env):
        return "gloo"
    if not dist.is_nccl_available():
        raise UserError("this torch was built without NCCL, so the torch engine cannot all-reduce on GPUs: install "
                        "a CUDA build of torch (./install.sh), or set train.device=cpu")
    return "cpu:gloo,cuda:nccl"


# engine/guards.py ends rank r min(r, 30) s after stall_shutdown_s (RANK_STAGGER_MAX_S there: distributed/ does
# not import engine/); the group's timeout leaves the last of them a minute more to print its line and exit
WATCHDOG_STAGGER_MAX_S = 30
WATCHDOG_MARGIN_S = 60


def collective_timeout_s(limits) -> int:
    """How long one collective may wait for a peer before the group fails (Gloo raises; NCCL's watchdog aborts
    the process with C++ dumps). With the stall limit on, past the stall watchdog's latest exit
    (``distributed.stall_shutdown_s`` + 30 s of rank stagger) by a minute, so a stuck rank ends with the watchdog's
    one line and never by the group's timeout first; at least the connect timeout
    (``distributed.gloo_timeout_s``). 30 minutes (torch's default) when the stall limit is off (0)."""
    if limits is None:
        return 1800
    if not limits.stall_shutdown_s:
        return max(limits.gloo_timeout_s, 1800)
    return max(limits.gloo_timeout_s, limits.stall_shutdown_s + WATCHDOG_STAGGER_MAX_S + WATCHDOG_MARGIN_S)


def attempt_store(where: dict, timeout: timedelta):
    """The store the ranks meet in (MASTER_ADDR:MASTER_PORT, as torch's env:// finds it), under a prefix of its own
    for each of torchrun's attempts. torchrun --max-restarts keeps one store (its agent's) for every attempt of a
    job, and torch's own prefix ("default_pg") is the same in each: a restarted rank found the addresses that the
    ranks of the attempt before had published there, connected to a rank that was gone and died in Gloo's
    connectFullMesh ("Connection refused"), so the restart failed too."""
    store, _, _ = next(dist.rendezvous("env://", rank=where["rank"], world_size=where["size"], timeout=timeout))
    store.set_timeout(timeout)
    return dist.PrefixStore(f"hybridtrain/attempt-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/default_pg",
                            store)


def init(threads: int = 0, cfg=None, elastic: bool = False, device: str = "auto") -> Topology:
    """Join (or form) the process group, bind the rank to its device and share (host, pid, GPU) of every rank."""
    if elastic:
        refuse_elastic(NAME)
    where = process_env()
    chosen = select_device(device, where["local_rank"])
    if chosen.type == "cuda":
        torch.cuda.set_device(chosen)
    if not dist.is_initialized():
        timeout = timedelta(seconds=collective_timeout_s(cfg.distributed if cfg is not None else None))
        # alone: no port to open (a MASTER_PORT left in the shell may be another job's)
        store = dist.HashStore() if where["size"] == 1 else attempt_store(where, timeout)
        dist.init_process_group(backend_for(chosen), store=store, rank=where["rank"], world_size=where["size"],
                                timeout=timeout)
    peers = tuple(allgather_object((socket.gethostname(), os.getpid(), gpu_id(chosen)), "peers"))
    if not gloo_forced():  # Gloo carries two ranks on one GPU; NCCL does not
        check_gpu_binding(peers)
    topo = Topology(dist.get_rank(), dist.get_world_size(), where["local_rank"], where["local_size"], peers, chosen,
                    NAME)
    return bind(topo, threads)


# ----------------------------------------------------------------------------- collectives

def size() -> int:
    return dist.get_world_size()


MEMORY_FORMATS = (torch.contiguous_format, torch.channels_last, torch.channels_last_3d)


def broadcast_tensors(tensors: dict[str, torch.Tensor]) -> None:
    """Rank 0's tensors on every rank, in place, whatever their memory layout: c10d takes a tensor contiguous in a
    memory format (channels_last included: its check is ``is_contiguous(suggest_memory_format())``) as it is; any
    other goes as a contiguous copy, written back."""
    for tensor in tensors.values():
        if any(tensor.is_contiguous(memory_format=f) for f in MEMORY_FORMATS):
            dist.broadcast(tensor, src=0)
        else:
            dense = tensor.contiguous()
            dist.broadcast(dense, src=0)
            with torch.no_grad():
                tensor.copy_(dense)


def broadcast_object(obj, name: str):
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def allgather_object(obj, name: str) -> list:
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


def allreduce(tensor: torch.Tensor, name: str, average: bool = False) -> torch.Tensor:
    """The sum (or mean) over ranks, in a new tensor as Horovod returns it (Gloo has no AVG: the mean divides)."""
    out = tensor.clone()
    dist.all_reduce(out)
    return out / dist.get_world_size() if average else out


def allreduce_differentiable(tensor: torch.Tensor) -> torch.Tensor:
    """The sum over ranks, with its gradient (the sum of the ranks' gradients)."""
    from torch.distributed.nn.functional import all_reduce
    return all_reduce(tensor)


def allreduce_async(tensor: torch.Tensor, name: str):
    out = tensor.clone()
    return dist.all_reduce(out, async_op=True), out


def wait(handle) -> torch.Tensor:
    work, out = handle
    work.wait()
    return out


def allgather(tensor: torch.Tensor, name: str) -> torch.Tensor:
    """Every rank's ``tensor`` (the same shape on every rank), concatenated in rank order."""
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, tensor.contiguous())
    return torch.cat(parts)


def barrier() -> None:
    dist.barrier()


def shutdown() -> None:
    """Destroy the process group while Python is whole, and with it Gloo's worker threads. Left running into the
    interpreter's teardown, a worker that releases its last finished work (an all-gather's tensors) takes the GIL
    there and aborts the process (SIGABRT, "terminate called without an active exception"; seen under gdb in
    ProcessGroupGloo::runLoop -> ~AsyncAllgatherWork -> decref_pyobject -> take_gil -> pthread_exit).
    destroy_process_group only unregisters the group: the group's destructor, which waits for its workers with the
    GIL released (pytorch/pytorch#154976), runs when the last reference goes, so the DDP wrappers that hold it (in
    reference cycles, hence gc.collect) go first. The caller drops its own references before calling this."""
    if dist.is_initialized():
        gc.collect()
        dist.destroy_process_group()
        gc.collect()


def sync_batch_norm_class() -> type:
    return torch.nn.SyncBatchNorm


# ----------------------------------------------------------------------------- the data-parallel step

HOROVOD_ONLY = ("gradient_predivide_factor", "fusion_threshold_mb", "cycle_time_ms", "autotune", "autotune_log")


def check_config(cfg) -> None:
    """What this engine cannot honour, as one line: Horovod's own knobs set away from their defaults (DDP's buckets
    are its own), and CUDA graphs (captured before Horovod's hooks; DDP's reducer cannot be replayed)."""
    defaults = type(cfg.horovod)()
    changed = [key for key in HOROVOD_ONLY if getattr(cfg.horovod, key) != getattr(defaults, key)]
    if changed:
        raise UserError(f"horovod.{changed[0]} tunes the Horovod engine and this job runs the torch engine (DDP): "
                        f"remove it from the config, or launch with horovodrun and --engine horovod")
    if cfg.train.cuda_graphs:
        raise UserError("train.cuda_graphs runs on the Horovod engine only (DDP's gradient hooks cannot be captured "
                        "in the graph): set train.cuda_graphs=false (train.compile works on both), or use --engine "
                        "horovod")


def wrap_model(model: torch.nn.Module, cfg, compression: str = "none") -> torch.nn.Module:
    """DDP around the forward: gradient buckets all-reduced (averaged) as the backward produces them, each
    gradient a view of its bucket (no copy, channels_last strides kept), the ranks' BN buffers left alone (the
    per-GPU statistics of the paper; collectives.average_running_statistics averages them per epoch), and
    FP16 on the wire when ``compression`` is fp16."""
    from torch.nn.parallel import DistributedDataParallel
    check_config(cfg)
    device = next(model.parameters()).device
    ddp = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None,
                                  gradient_as_bucket_view=True, **no_buffer_sync(DistributedDataParallel))
    for p in model.parameters():  # their gradients will be bucket views: wrap_optimizer's zero_grad keeps them
        setattr(p, IN_BUCKET, True)
    if compression == "fp16":
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook
        ddp.register_comm_hook(None, fp16_compress_hook)
    return ddp


def no_buffer_sync(ddp_class) -> dict:
    """The keyword that keeps DDP from overwriting the ranks' BN buffers with rank 0's before every forward:
    forward_sync_buffers=False where torch has it (2.13 on), else broadcast_buffers=False. Both still leave the
    buffers as they are at construction, which is before a checkpoint's per-rank buffers are loaded."""
    import inspect
    if "forward_sync_buffers" in inspect.signature(ddp_class.__init__).parameters:
        return {"forward_sync_buffers": False}
    return {"broadcast_buffers": False}


def wrap_optimizer(optimizer: torch.optim.Optimizer, model: torch.nn.Module, cfg, backward_passes_per_step: int = 1,
                   compression: str = "none"):
    """DDP reduces in the backward: the optimizer itself, its synchronize() and skip_synchronize() no-ops, and its
    zero_grad() as the gradient memory needs (``zero_grad``)."""
    optimizer = with_step_contract(optimizer)
    optimizer.zero_grad = functools.partial(zero_grad, optimizer)
    return optimizer


# set by wrap_model on the parameters of a model it put in DDP: their gradients are views of DDP's buckets
IN_BUCKET = "_hybridtrain_grad_in_ddp_bucket"


def zero_grad(optimizer: torch.optim.Optimizer, set_to_none: bool | None = None) -> None:
    """Clear ``optimizer``'s gradients as their memory needs. A gradient DDP made a view of its bucket
    (wrap_model, gradient_as_bucket_view) is zeroed in place, so the backward accumulates into the bucket itself;
    set to None, every step would allocate fresh gradients and the reducer copy them into the buckets (torch's DDP
    docstring on gradient_as_bucket_view). Those are zeroed with one ``torch._foreach_zero_`` per
    device and dtype: a loop of ``zero_()`` was 161 kernel launches per ResNet-50 step on a GPU;
    torch's own zero_grad batches them only for an optimizer built with foreach=True or fused=True (torch.optim.SGD's
    default foreach=None, and the project's own optimizers, take its loop). Any other gradient (a model outside DDP:
    bench's trainer row) is set to None, torch's default, as the Horovod engine and a plain PyTorch loop do, so that
    row and the plain loop it is compared with clear their gradients alike. ``set_to_none`` True or False forces one
    way for every gradient."""
    in_place: dict[tuple, list[torch.Tensor]] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            grad = p.grad
            if grad is None:
                continue
            if set_to_none or (set_to_none is None and not getattr(p, IN_BUCKET, False)):
                p.grad = None
            else:
                in_place.setdefault((grad.device, grad.dtype), []).append(grad)
    for grads in in_place.values():
        torch._foreach_zero_(grads)

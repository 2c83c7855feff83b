"""The engine contract and the one registry of engines.

``Engine`` states what an engine module provides (``horovod.py``, ``torch_distributed.py``): ``NAME``, ``init``, its
collectives and the data-parallel step. ``ENGINES`` holds, per engine, what the rest of the package needs before
(or without) importing it: its module, its launcher, the command that starts N ranks under it, the variables that
say its launcher started this process, and the words its runtime uses when a peer is lost. ``launcher``,
``collectives``, ``topology``, ``errors.is_peer_failure`` (through ``collectives.init``) and the CLI read it.

A new engine is one module providing ``Engine`` plus one ``EngineSpec``: in ``ENGINES`` for an engine of the package,
or, from outside it, in a module named by ``HYBRIDTRAIN_ENGINE_PLUGINS`` (comma-separated module names, each
defining ``ENGINE_SPEC``). The config's ``distributed.engine`` choices list the package's engines (config/ imports
no engine module; tests/test_engines.py holds the two lists equal).

Torch-free: the CLI and the launcher checks read it before torch is imported.
"""
from __future__ import annotations

import importlib
import os
import sys
import traceback
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Mapping, Protocol, runtime_checkable

from hybridtrain.distributed.launch_env import (
    process_env,
    venv_tool,
)
from hybridtrain.errors import UserError
from hybridtrain.launched_by import started_by_mpi, under_torchrun

if TYPE_CHECKING:
    import torch

    from hybridtrain.distributed.topology import Topology

PLUGINS_VAR = "HYBRIDTRAIN_ENGINE_PLUGINS"


@runtime_checkable
class SteppingOptimizer(Protocol):
    """What ``wrap_optimizer`` returns, whatever the engine: the optimizer's own API plus ``synchronize()`` (finish
    the gradient all-reduce before the update) and ``skip_synchronize()`` (a context: the update does not reduce
    again). An engine that reduces in the backward (DDP) makes both no-ops. ``zero_grad()`` clears the gradients as
    the engine's gradient memory needs: set to None under Horovod, in place under DDP."""

    param_groups: list

    def step(self, closure=None): ...

    def zero_grad(self, set_to_none: bool = True) -> None: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state_dict: dict) -> None: ...

    def synchronize(self) -> None: ...

    def skip_synchronize(self): ...


def with_step_contract(optimizer):
    """``optimizer`` given ``synchronize()`` and ``skip_synchronize()`` as no-ops: the step contract where nothing
    is left to reduce at the update (DDP reduced in the backward; a process alone, as bench's trainer row)."""
    import contextlib
    optimizer.synchronize = lambda: None
    optimizer.skip_synchronize = contextlib.nullcontext
    return optimizer


@runtime_checkable
class Engine(Protocol):
    """An engine module: the job (``init``, ``size``, ``barrier``, ``shutdown``), its collectives (broadcast from rank
    0, all-reduces, gathers) and the data-parallel step (``wrap_model`` around the forward, ``wrap_optimizer`` around
    the update, whose ``zero_grad()`` clears as its gradient memory needs, its GPU ``SyncBatchNorm``)."""

    NAME: str

    def init(self, threads: int = 0, cfg=None, elastic: bool = False, device: str = "auto") -> Topology: ...

    def size(self) -> int: ...

    def broadcast_tensors(self, tensors: dict[str, torch.Tensor]) -> None: ...

    def broadcast_object(self, obj, name: str): ...

    def allgather_object(self, obj, name: str) -> list: ...

    def allreduce(self, tensor: torch.Tensor, name: str, average: bool = False) -> torch.Tensor: ...

    def allreduce_differentiable(self, tensor: torch.Tensor) -> torch.Tensor: ...

    def allreduce_async(self, tensor: torch.Tensor, name: str): ...

    def wait(self, handle) -> torch.Tensor: ...

    def allgather(self, tensor: torch.Tensor, name: str) -> torch.Tensor: ...

    def barrier(self) -> None: ...

    def shutdown(self) -> None: ...

    def sync_batch_norm_class(self) -> type: ...

    def wrap_model(self, model: torch.nn.Module, cfg, compression: str = "none") -> torch.nn.Module: ...

    def wrap_optimizer(self, optimizer, model: torch.nn.Module, cfg, backward_passes_per_step: int = 1,
                       compression: str = "none") -> SteppingOptimizer: ...


@dataclass(frozen=True)
class EngineSpec:
    name: str  # distributed.engine, --engine
    module: str  # the module that provides Engine
    library: str  # the import it needs: auto picks an engine whose library is installed
    launcher: str  # how a user starts N ranks under it, for messages
    launch_command: Callable[..., list]  # (ranks, program, launcher options, python=None) -> the command
    started_by: Callable[[Mapping], bool]  # its launcher started this process
    size_vars: tuple = ()  # where its launchers put the job's size, read before init
    check_env: Callable[[Mapping], object] | None = None  # the launcher variables checked before torch is imported
    srun_needs_mpi: bool = False  # under srun, only with --mpi (PMI): without it each task forms a job of one
    elastic: bool = False  # runs --elastic
    peer_failure_types: tuple = ()  # the class names of its errors on a surviving rank after a peer was lost
    peer_failure_words: tuple = ()  # the words of such errors


def horovodrun_command(ranks: int, program: list, options: tuple = (), python: str | None = None) -> list:
    """``program`` as ``ranks`` local ranks under horovodrun (Gloo); ``options``: horovodrun's own (a timeline);
    ``python``: the environment whose horovodrun starts them (default: this one's, else PATH's)."""
    horovodrun = os.path.join(os.path.dirname(python), "horovodrun") if python else venv_tool("horovodrun")
    return [horovodrun, "--gloo", "-np", str(ranks), "-H", f"localhost:{ranks}", *options, *program]


def torchrun_command(ranks: int, program: list, options: tuple = (), python: str | None = None) -> list:
    """``program`` as ``ranks`` local ranks under torchrun, run as a module of ``python`` (default: this one): a
    venv that sees an image's torch through a .pth has no torchrun script."""
    return [python or sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
            *options, "--no-python", *program]


# what torch.distributed's Gloo and NCCL say on a surviving rank when a peer died or its connection broke
TORCH_PEER_LOSS_WORDS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
                         "NCCL communicator was aborted", "failed to recv", "Socket Timeout", "Timed out waiting")

ENGINES = {
    "horovod": EngineSpec(
        name="horovod", module="hybridtrain.distributed.horovod", library="horovod",
        launcher="horovodrun -np N (or mpirun)", launch_command=horovodrun_command, started_by=started_by_mpi,
        size_vars=("HOROVOD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE"),  # horovodrun, Open MPI, MPICH/Intel MPI
        srun_needs_mpi=True, elastic=True,
        peer_failure_types=("HorovodInternalError",), peer_failure_words=("Horovod has been shut down",)),
    "torch": EngineSpec(
        name="torch", module="hybridtrain.distributed.torch_distributed", library="torch",
        launcher="torchrun --nproc-per-node=N", launch_command=torchrun_command, started_by=under_torchrun,
        check_env=process_env,
        peer_failure_types=("DistBackendError", "DistNetworkError"), peer_failure_words=TORCH_PEER_LOSS_WORDS),
}


def plugin_specs(env: Mapping | None = None) -> dict[str, EngineSpec]:
    """The engines of the modules named in HYBRIDTRAIN_ENGINE_PLUGINS (each defines ENGINE_SPEC, an EngineSpec),
    each judged before use: a module that is not found, fails on import or registers no engine is one line naming
    it and what is wrong."""
    env = os.environ if env is None else env
    found = {}
    for name in (n.strip() for n in env.get(PLUGINS_VAR, "").split(",") if n.strip()):
        spec = getattr(plugin_module(name), "ENGINE_SPEC", None)
        if not isinstance(spec, EngineSpec) or not isinstance(spec.name, str) or not spec.name.isidentifier():
            what = ("it defines no ENGINE_SPEC" if spec is None else f"its ENGINE_SPEC is a {type(spec).__name__}, "
                    f"not an EngineSpec" if not isinstance(spec, EngineSpec) else
                    f"its ENGINE_SPEC names the engine {str(spec.name)[:40]!r}, not a word")
            raise not_an_engine(name, what, "define ENGINE_SPEC = EngineSpec(...) in it (docs/engines.md)")
        if spec.name in ENGINES or spec.name in found or spec.name == "auto":
            raise UserError(f"{PLUGINS_VAR}: {name} registers engine '{spec.name}', a name already taken: rename it "
                            f"in its ENGINE_SPEC, or unset {PLUGINS_VAR}")
        found[spec.name] = spec
    return found


def plugin_module(name: str, named_by: str = PLUGINS_VAR):
    """The module ``name`` of HYBRIDTRAIN_ENGINE_PLUGINS (or of a plugin's ENGINE_SPEC, ``named_by``), or one line:
    not found, or what its import raised (a plugin's own code runs at its import, so anything it raises is the
    plugin's fault, named with its line)."""
    try:
        return importlib.import_module(name)
    except Exception as exc:  # noqa: BLE001
        if isinstance(exc, ModuleNotFoundError) and exc.name and (name + ".").startswith(exc.name + "."):
            raise not_an_engine(name, "it is not found on this python's path", "put its folder on PYTHONPATH",
                                named_by)
        frames = [] if isinstance(exc, SyntaxError) else traceback.extract_tb(exc.__traceback__)[-1:]
        where = "".join(f" at {frame.filename}:{frame.lineno}" for frame in frames)
        message = (str(exc).strip().splitlines() or [""])[0][:200]
        raise not_an_engine(name, f"its import raised {type(exc).__name__}{': ' + message if message else ''}{where}",
                            "fix the module", named_by) from None


def not_an_engine(name: str, what: str, fix: str, named_by: str = PLUGINS_VAR) -> UserError:
    return UserError(f"{named_by} names {name}, which is not an engine module: {what}: {fix}, or unset "
                     f"{PLUGINS_VAR}")


# what an engine module must define (the Engine protocol's functions), checked before the first is called
ENGINE_FUNCTIONS = tuple(name for name, value in vars(Engine).items() if callable(value) and not name.startswith("_"))


def registered(env: Mapping | None = None) -> dict[str, EngineSpec]:
    """Every engine: the package's, then the plugins'."""
    return {**ENGINES, **plugin_specs(env)}


def engine_spec(name: str, env: Mapping | None = None) -> EngineSpec:
    engines = registered(env)
    if name not in engines:
        raise UserError(f"distributed.engine={name} is not an engine: choose {', '.join(['auto', *engines])}")
    return engines[name]


def engine_module(name: str) -> Engine:
    """The module of engine ``name`` (imported now: torch, and the engine's library, with it). A plugin's module that
    fails to import or lacks the engine's functions is one line naming it, before any of them is called."""
    spec = engine_spec(name)
    if name in ENGINES:
        return importlib.import_module(spec.module)
    named_by = f"the ENGINE_SPEC of engine '{name}'"
    module = plugin_module(spec.module, named_by)
    missing = [what for what in ("NAME", *ENGINE_FUNCTIONS) if not hasattr(module, what)]
    if missing:
        raise not_an_engine(spec.module, f"it lacks {', '.join(missing)}", "define them (docs/engines.md lists the "
                            "Engine functions), or point ENGINE_SPEC's module at the module that does", named_by)
    return module


def launcher_size(env: Mapping | None = None) -> int:
    """The number of processes the launcher started, from the first size variable of an engine's launchers that is
    set (0 when none says so)."""
    env = os.environ if env is None else env
    return next((int(env[var]) for spec in registered(env).values() for var in spec.size_vars
                 if env.get(var, "").isdigit()), 0)


def refuse_elastic(name: str) -> None:
    """--elastic on an engine without elastic training: one line."""
    if not engine_spec(name).elastic:
        elastic = [spec for spec in ENGINES.values() if spec.elastic][0]
        raise UserError(f"--elastic is {elastic.name.capitalize()}'s elastic training and this job runs the {name} "
                        f"engine: launch with {elastic.launcher.split(' ')[0]} --min-np/--max-np and --engine "
                        f"{elastic.name}, or drop --elastic and let torchrun --max-restarts rerun the job with "
                        f"--resume auto (docs/elastic.md)")


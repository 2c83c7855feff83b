"""Which engine a process runs under, and how a command starts the sub-jobs it measures. Torch-free: the CLI
reads it before anything heavy is imported."""
from __future__ import annotations

import os
import shutil
import sys

from hybridtrain.errors import UserError

ENGINES = ("horovod", "torch")
HOROVOD_LAUNCH_VARS = ("HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK")  # horovodrun, mpirun
TORCHRUN_LAUNCH_VARS = ("TORCHELASTIC_RUN_ID", "LOCAL_WORLD_SIZE")  # torchrun sets both, mpirun neither
LAUNCHERS = {"horovod": "horovodrun -np N (or mpirun)", "torch": "torchrun --nproc-per-node=N"}


def venv_tool(name: str) -> str:
    """The path of a console tool (horovodrun, torchrun, hybridtrain) of this Python's environment, else from
    PATH."""
    bin_dir = os.path.dirname(sys.executable)
    found = shutil.which(name, path=bin_dir + os.pathsep + os.environ.get("PATH", ""))
    if not found:
        raise UserError(f"{name} is not on PATH: run ./install.sh and use .venv/bin")
    return found


def launcher_engine(env=None) -> str | None:
    """The engine whose launcher started this process: horovod (horovodrun, mpirun), torch (torchrun), or None
    (started alone, or by srun without either)."""
    env = os.environ if env is None else env
    if any(var in env for var in HOROVOD_LAUNCH_VARS):
        return "horovod"
    if any(var in env for var in TORCHRUN_LAUNCH_VARS):
        return "torch"
    return None


def horovod_importable() -> bool:
    import importlib.util
    return importlib.util.find_spec("horovod") is not None


def resolve_engine(wanted: str, env=None) -> str:
    """distributed.engine: ``auto`` takes the launcher's engine, else Horovod where it is installed, else torch.
    A named engine under the other's launcher is refused: the ranks would each form a job of one."""
    found = launcher_engine(env)
    if wanted == "auto":
        return found or ("horovod" if horovod_importable() else "torch")
    if found and found != wanted:
        raise UserError(f"distributed.engine={wanted} but this process was started by {found}'s launcher: launch "
                        f"with {LAUNCHERS[wanted]} hybridtrain ..., or set distributed.engine={found} (or auto)")
    return wanted


def launch_command(engine: str, np_: int, program: list[str], horovod_args: tuple = ()) -> list[str]:
    """The command that runs ``program`` (e.g. [hybridtrain, train, ...]) as ``np_`` local ranks under
    ``engine``'s launcher: the sub-jobs of scale, bench and experiment. ``horovod_args``: horovodrun's own
    options (a timeline)."""
    if engine == "torch":  # torchrun as a module: a venv that sees an image's torch through a .pth has no script
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={np_}",
                "--no-python", *program]
    return [venv_tool("horovodrun"), "--gloo", "-np", str(np_), "-H", f"localhost:{np_}", *horovod_args, *program]

"""Which engine a process runs under, and how a command starts the sub-jobs it measures. Torch-free: the CLI
reads it before anything heavy is imported."""
from __future__ import annotations

import os
import shutil
import sys

from hybridtrain.distributed.launch_env import process_env, under_srun, under_torchrun
from hybridtrain.errors import UserError

ENGINES = ("horovod", "torch")
HOROVOD_LAUNCH_VARS = ("HOROVOD_RANK", "OMPI_COMM_WORLD_RANK")  # horovodrun, Open MPI's mpirun
PMI_RANK_VARS = ("PMI_RANK", "PMIX_RANK")  # MPICH's or Intel MPI's mpirun, Open MPI 5; and srun --mpi=pmi2/pmix
LAUNCHERS = {"horovod": "horovodrun -np N (or mpirun)", "torch": "torchrun --nproc-per-node=N"}


def venv_tool(name: str) -> str:
    """The path of a console tool (horovodrun, torchrun, hybridtrain) of this Python's environment, else from
    PATH."""
    bin_dir = os.path.dirname(sys.executable)
    found = shutil.which(name, path=bin_dir + os.pathsep + os.environ.get("PATH", ""))
    if not found:
        raise UserError(f"{name} is not on PATH: run ./install.sh and use .venv/bin")
    return found


def srun_pmi(env) -> bool:
    """PMI_RANK/PMIX_RANK set by srun itself (MpiDefault=pmix or pmi2, srun --mpi=...): the task's own rank, equal
    to SLURM_PROCID. They say that srun wired up MPI, not that an MPI launcher started this process: srun can start
    either engine."""
    return under_srun(env) and all(env[var] == env["SLURM_PROCID"] for var in PMI_RANK_VARS if var in env)


def launcher_engine(env=None) -> str | None:
    """The engine whose launcher started this process: torch (torchrun, even when srun started torchrun: srun's
    variables pass through it), horovod (horovodrun, mpirun), or None (alone, or srun, which starts either)."""
    env = os.environ if env is None else env
    if under_torchrun(env):
        return "torch"
    if any(var in env for var in HOROVOD_LAUNCH_VARS):
        return "horovod"
    if any(var in env for var in PMI_RANK_VARS) and not srun_pmi(env):
        return "horovod"
    return None


def horovod_importable() -> bool:
    import importlib.util
    return importlib.util.find_spec("horovod") is not None


def srun_without_mpi(env) -> int:
    """The task count of an srun step of several tasks that wired up no MPI (no PMI variable): Horovod cannot form
    that job (each task would be a job of one); 0 otherwise."""
    if not under_srun(env) or any(var in env for var in PMI_RANK_VARS):
        return 0
    tasks = env.get("SLURM_NTASKS", "1").strip()
    return int(tasks) if tasks.isdigit() and int(tasks) > 1 else 0


def resolve_engine(wanted: str, env=None) -> str:
    """distributed.engine: ``auto`` takes the launcher's engine; without one (alone, srun), Horovod where it is
    installed, else torch, and torch under an srun that wired up no MPI. A named engine under the other's launcher
    is refused, and Horovod under such an srun: the ranks would each form a job of one."""
    env = os.environ if env is None else env
    found = launcher_engine(env)
    tasks = srun_without_mpi(env)
    if wanted == "auto":
        return found or ("horovod" if horovod_importable() and not tasks else "torch")
    if found and found != wanted:
        raise UserError(f"distributed.engine={wanted} but this process was started by {found}'s launcher: launch "
                        f"with {LAUNCHERS[wanted]} hybridtrain ..., or set distributed.engine={found} (or auto)")
    if wanted == "horovod" and tasks:
        raise UserError(f"distributed.engine=horovod under an srun of {tasks} tasks that set up no MPI (no PMI_RANK or "
                        f"PMIX_RANK): each task would train alone; use srun --mpi=pmix (launch/slurm.sbatch), or "
                        f"--engine torch (launch/slurm-torch.sbatch)")
    return wanted


def check_launch(wanted: str, env=None) -> str:
    """The engine this process will run, with the launch environment it reads checked, before torch is imported:
    a stale, garbage or contradictory variable is one line naming it within a fraction of a second, not a
    rendezvous that waits or a C++ error after the imports. ``auto`` checks the torch engine's variables too: a
    RANK/WORLD_SIZE that no launcher set may mean a launcher whose ranks would each train alone."""
    env = os.environ if env is None else env
    engine = resolve_engine(wanted, env)
    if engine == "torch" or (wanted == "auto" and launcher_engine(env) is None and not under_srun(env)):
        process_env(env)
    return engine


def launch_command(engine: str, np_: int, program: list[str], horovod_args: tuple = ()) -> list[str]:
    """The command that runs ``program`` (e.g. [hybridtrain, train, ...]) as ``np_`` local ranks under
    ``engine``'s launcher: the sub-jobs of scale, bench and experiment. ``horovod_args``: horovodrun's own
    options (a timeline)."""
    if engine == "torch":  # torchrun as a module: a venv that sees an image's torch through a .pth has no script
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={np_}",
                "--no-python", *program]
    return [venv_tool("horovodrun"), "--gloo", "-np", str(np_), "-H", f"localhost:{np_}", *horovod_args, *program]

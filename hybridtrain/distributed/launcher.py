"""Which engine a process runs under, and how a command starts the sub-jobs it measures, from the registry of
engines (``engines.registered()``: the package's and the plugins'). Torch-free: the CLI reads it before anything
heavy is imported."""
from __future__ import annotations

import importlib.util
import os

from hybridtrain.distributed.engines import engine_spec, registered
from hybridtrain.distributed.launch_env import process_env
from hybridtrain.distributed.launch_env import venv_tool as venv_tool  # scale's and experiment's launches
from hybridtrain.errors import UserError
from hybridtrain.launched_by import PMI_RANK_VARS, under_srun


def launcher_engine(env=None) -> str | None:
    """The engine whose launcher started this process (the first registered: torchrun's variables under srun pass
    through it, srun's own PMI ones are not an MPI launcher's), or None (alone, or srun, which starts either)."""
    env = os.environ if env is None else env
    return next((name for name, spec in registered(env).items() if spec.started_by(env)), None)


def srun_without_mpi(env) -> int:
    """The task count of an srun step of several tasks that wired up no MPI (no PMI variable): an engine that needs
    MPI under srun cannot form that job (each task would be a job of one); 0 otherwise."""
    if not under_srun(env) or any(var in env for var in PMI_RANK_VARS):
        return 0
    tasks = env.get("SLURM_NTASKS", "1").strip()
    return int(tasks) if tasks.isdigit() and int(tasks) > 1 else 0


def resolve_engine(wanted: str, env=None) -> str:
    """distributed.engine: ``auto`` takes the launcher's engine; without one (alone, srun), the first of the
    package's engines that is installed and can form the job (under an srun that wired up no MPI, one that does
    not need MPI). A named engine under another's launcher is refused, and one that needs MPI under such an srun:
    the ranks would each form a job of one."""
    env = os.environ if env is None else env
    found = launcher_engine(env)
    tasks = srun_without_mpi(env)
    if wanted == "auto":
        return found or next(name for name, spec in registered(env).items() if importlib.util.find_spec(spec.library)
                             and not (tasks and spec.srun_needs_mpi))
    spec = engine_spec(wanted, env)
    if found and not spec.started_by(env):
        raise UserError(f"distributed.engine={wanted} but this process was started by {found}'s launcher: launch "
                        f"with {spec.launcher} hybridtrain ..., or set distributed.engine={found} (or auto)")
    if spec.srun_needs_mpi and tasks:
        raise UserError(f"distributed.engine={wanted} under an srun of {tasks} tasks that set up no MPI (no PMI_RANK "
                        f"or PMIX_RANK): each task would train alone; use srun --mpi=pmix (launch/slurm.sbatch), or "
                        f"--engine torch (launch/slurm-torch.sbatch)")
    return wanted


def check_launch(wanted: str, env=None) -> str:
    """The engine this process will run, with the launch environment it reads checked, before torch is imported:
    a stale, garbage or contradictory variable is one line naming it within a fraction of a second, not a
    rendezvous that waits or a C++ error after the imports. ``auto`` checks the rank variables too: a
    RANK/WORLD_SIZE that no launcher set may mean a launcher whose ranks would each train alone."""
    env = os.environ if env is None else env
    engine = resolve_engine(wanted, env)
    check_env = engine_spec(engine, env).check_env
    if check_env is not None:
        check_env(env)
    elif wanted == "auto" and launcher_engine(env) is None and not under_srun(env):
        process_env(env)
    return engine


def launch_command(engine: str, np_: int, program: list[str], launcher_args: tuple = (),
                   python: str | None = None) -> list[str]:
    """The command that runs ``program`` (e.g. [hybridtrain, train, ...]) as ``np_`` local ranks under
    ``engine``'s launcher: the sub-jobs of scale, bench and experiment. ``launcher_args``: the
    launcher's own options (horovodrun's timeline); ``python``: the environment whose launcher starts them
    (the GPU check's build venv for Horovod, the image's Python for torch; default: this one)."""
    return engine_spec(engine).launch_command(np_, program, launcher_args, python=python)

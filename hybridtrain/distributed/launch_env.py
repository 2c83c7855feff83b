"""What the launcher told this process: its rank, the job's size, its place on the node and where the ranks meet,
read from the environment and checked before torch is imported, so that a variable left by another launcher or an
old shell is one line naming it, never a rendezvous that waits for ranks that will not come.

Whose variables count: torchrun's (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR/PORT) when torchrun
started this process (it sets TORCHELASTIC_RUN_ID), srun's (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID) when srun
did (it sets SLURM_STEP_ID; a batch script's own shell has SLURM_PROCID=0 and SLURM_NTASKS too, but is one
process), else none: a process alone. Torch-free.
"""
from __future__ import annotations

import os
import shutil
import sys

from hybridtrain.errors import UserError
from hybridtrain.launched_by import SRUN_MARK, TORCHRUN_MARK, under_srun, under_torchrun

STALE_FIX = "unset RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE MASTER_ADDR MASTER_PORT"
SRUN_HINT = ("export MASTER_ADDR=$(scontrol show hostnames \"$SLURM_JOB_NODELIST\" | head -n 1) MASTER_PORT=29500 "
             "before srun (launch/slurm-torch.sbatch does)")
ALONE = {"rank": 0, "size": 1, "local_rank": 0, "local_size": 1}


def venv_tool(name: str) -> str:
    """The path of a console tool (horovodrun, torchrun, hybridtrain) of this Python's environment, else from
    PATH."""
    bin_dir = os.path.dirname(sys.executable)
    found = shutil.which(name, path=bin_dir + os.pathsep + os.environ.get("PATH", ""))
    if not found:
        raise UserError(f"{name} is not on PATH: run ./install.sh and use .venv/bin")
    return found


def slurm_tasks_per_node(env) -> int:
    """This node's task count under srun: SLURM_NTASKS_PER_NODE, else the first count of SLURM_STEP_TASKS_PER_NODE
    or SLURM_TASKS_PER_NODE ('4(x2),3' -> 4)."""
    for var in ("SLURM_NTASKS_PER_NODE", "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):
        value = env.get(var, "").split("(")[0].split(",")[0]
        if value.isdigit():
            return int(value)
    return 1


def whole_number(env, var: str, fix: str, default: int | None = None) -> int:
    """``env[var]`` as a whole number >= 0, else one line naming the variable, its value and ``fix``."""
    value = env.get(var)
    if value is None and default is not None:
        return default
    if value is None or not value.strip().isdigit():
        raise UserError(f"{var}={value!r} is not a whole number: {fix}", same_on_all_ranks=False)
    return int(value)


def process_env(env=None) -> dict:
    """(rank, size, local_rank, local_size) as the launcher set them, checked: torchrun's variables under torchrun,
    srun's under srun (and RANK/WORLD_SIZE there only when they agree with srun's), else a job of one process. A
    RANK or WORLD_SIZE that no launcher set is refused: an old shell's, or a launcher this trainer does not know,
    whose ranks would each wait at MASTER_ADDR:MASTER_PORT or train alone."""
    env = os.environ if env is None else env
    if under_torchrun(env):
        fix = "torchrun sets it for every rank: do not set it by hand in the command torchrun starts"
        names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
        where = {key: whole_number(env, var, fix) for key, var in zip(ALONE, names)}
    elif under_srun(env):
        fix = "srun sets it for every task: do not export it in the job script"
        where = {"rank": whole_number(env, "SLURM_PROCID", fix), "size": whole_number(env, "SLURM_NTASKS", fix, 1),
                 "local_rank": whole_number(env, "SLURM_LOCALID", fix, 0), "local_size": slurm_tasks_per_node(env)}
        names = ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "the tasks per node")
        check_agrees_with_srun(env, where)
    elif "RANK" in env or "WORLD_SIZE" in env:
        return stale_rank_variables(env)
    else:
        return dict(ALONE)
    check_ranges(where, names)
    if where["size"] > 1:
        check_rendezvous(env, where["size"])
    return where


def check_agrees_with_srun(env, where: dict) -> None:
    """RANK and WORLD_SIZE under srun: a script may set them from srun's own (RANK=$SLURM_PROCID); exported before
    srun, every task has the same RANK and they would all be rank 0."""
    for var, key in (("RANK", "rank"), ("WORLD_SIZE", "size")):
        if var in env and env[var] != str(where[key]):
            slurm = "SLURM_PROCID" if key == "rank" else "SLURM_NTASKS"
            raise UserError(f"{var}={env[var]} but srun made this task {key} {where[key]} ({slurm}={where[key]}): "
                            f"{var} was set before srun (every task has the same one); unset it in the job script, "
                            f"srun's own variables are enough", same_on_all_ranks=False)


def stale_rank_variables(env) -> dict:
    """RANK/WORLD_SIZE without torchrun or srun: alone when they say a job of one, else refused."""
    rank, size = env.get("RANK", "0"), env.get("WORLD_SIZE", "1")
    if rank.strip() == "0" and size.strip() == "1":
        return dict(ALONE)
    shown = " and ".join(f"{var}={env[var]}" for var in ("RANK", "WORLD_SIZE") if var in env)
    raise UserError(f"{shown} {'is' if ' and ' not in shown else 'are'} set, but neither torchrun nor srun started "
                    f"this process (no {TORCHRUN_MARK}, no {SRUN_MARK}): left by an earlier job or shell, they would "
                    f"make this run wait for ranks that never come; {STALE_FIX} (to train on N ranks, launch with "
                    f"torchrun --nproc-per-node=N)")


def check_ranges(where: dict, names: tuple) -> None:
    rank, size, local_rank, local_size = (where[k] for k in ("rank", "size", "local_rank", "local_size"))
    if size < 1:
        raise UserError(f"{names[1]}={size}: a job has at least one rank; fix or unset it")
    if rank >= size:
        raise UserError(f"{names[0]}={rank} is outside the job's {size} rank(s) ({names[1]}={size}; ranks are 0 to "
                        f"{size - 1}): one of them was left by another job or set by hand; {STALE_FIX}, and let the "
                        f"launcher set them", same_on_all_ranks=False)
    if local_size < 1 or local_size > size or local_rank >= local_size:
        raise UserError(f"{names[2]}={local_rank} with {names[3]}={local_size} on a {size}-rank job: a rank's place on "
                        f"its node must be below the node's rank count, itself at most the job's; {STALE_FIX}, and "
                        f"let the launcher set them", same_on_all_ranks=False)


def check_rendezvous(env, size: int) -> None:
    """MASTER_ADDR and MASTER_PORT, where the ranks of a multi-rank job meet."""
    addr, port = env.get("MASTER_ADDR", "").strip(), env.get("MASTER_PORT", "").strip()
    if not addr or not port:
        missing = "MASTER_ADDR" if not addr else "MASTER_PORT"
        raise UserError(f"the torch engine's ranks meet at MASTER_ADDR:MASTER_PORT and this {size}-rank job sets no "
                        f"{missing}: launch with torchrun, or under srun {SRUN_HINT}")
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        raise UserError(f"MASTER_PORT={env['MASTER_PORT']!r} is not a port number (1 to 65535): set it to a free "
                        f"port, e.g. MASTER_PORT=29500")

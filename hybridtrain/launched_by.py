"""Who started this process, read from the environment alone (no import of the package, torch-free): torchrun (it
sets TORCHELASTIC_RUN_ID for its workers), srun (SLURM_STEP_ID: a batch script's own shell has no step), horovodrun
or an MPI's mpirun (their rank variables), or nobody; and the rank that launcher gave. The one place that tells
launchers apart: errors.py (which rank speaks), distributed/launch_env.py (the job's size and place, checked) and
the registry of engines (distributed/engines.py: which engine's launcher this is) all ask it."""
from __future__ import annotations

import os
from typing import Mapping

TORCHRUN_MARK = "TORCHELASTIC_RUN_ID"  # torchrun sets it for its workers; nothing else does
SRUN_MARK = "SLURM_STEP_ID"  # srun sets it for its tasks; the batch script's shell has no step
# the rank each launcher gives, in the order they are trusted: torchrun's RANK first under torchrun (srun's PMI and
# SLURM variables pass through torchrun unchanged, the same for all of its ranks), then horovodrun, Open MPI,
# MPICH/Intel MPI, PMIx, and srun's own. A RANK that no torchrun set, or a SLURM_PROCID outside an srun step (a batch
# script's shell has SLURM_PROCID=0), is not a rank: an old shell's variable must not keep rank 0 quiet.
RANK_ENV_VARS = ("HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK")
PMI_RANK_VARS = ("PMI_RANK", "PMIX_RANK")  # MPICH's or Intel MPI's mpirun, Open MPI 5; and srun --mpi=pmi2/pmix


def launcher_rank() -> int:
    """The rank the launcher assigned, readable before hvd.init() (0 when run alone)."""
    env = os.environ
    trusted = (("RANK",) if TORCHRUN_MARK in env else ()) + RANK_ENV_VARS + \
        (("SLURM_PROCID",) if SRUN_MARK in env else ())
    for var in trusted:
        if env.get(var, "").isdigit():
            return int(env[var])
    return 0


def under_torchrun(env: Mapping) -> bool:
    return TORCHRUN_MARK in env


def under_srun(env: Mapping) -> bool:
    return SRUN_MARK in env and "SLURM_PROCID" in env


def srun_pmi(env) -> bool:
    """PMI_RANK/PMIX_RANK set by srun itself (MpiDefault=pmix or pmi2, srun --mpi=...): the task's own rank, equal
    to SLURM_PROCID. They say that srun wired up MPI, not that an MPI launcher started this process: srun can start
    either engine."""
    return under_srun(env) and all(env[var] == env["SLURM_PROCID"] for var in PMI_RANK_VARS if var in env)


def started_by_mpi(env: Mapping) -> bool:
    """horovodrun or an MPI's mpirun (its rank variables; PMI's only when srun did not set them for itself), and
    not torchrun (whose workers keep the variables of whatever started torchrun)."""
    if under_torchrun(env):
        return False
    mpi_only = tuple(var for var in RANK_ENV_VARS if var not in PMI_RANK_VARS)
    return any(var in env for var in mpi_only) or (any(var in env for var in PMI_RANK_VARS) and not srun_pmi(env))

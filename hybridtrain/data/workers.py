"""The loader workers' lives: spawned through a wrapper that ignores SIGTERM until they can die with their
rank (a scheduler's SIGTERM to the process group is the rank's to handle), killed at exit, never left behind;
and the shared memory (/dev/shm) their batches pass through, checked before they start
(:func:`check_shared_memory`) and named in one line when it runs out anyway (:func:`shared_memory_failure`)."""
from __future__ import annotations

import atexit
import functools
import hashlib
import multiprocessing
import os
import shlex
import signal
import stat
import sys
import tempfile
from dataclasses import dataclass, replace

from hybridtrain.errors import UserError

SHM_DIR = "/dev/shm"
PAGE = 4096   # tmpfs gives a file whole pages
MB = 1 << 20


def die_with_the_rank(worker_id: int) -> None:
    """Worker init: the kernel kills this worker when the rank that spawned it dies (Linux PR_SET_PDEATHSIG).

    A rank killed with SIGKILL cannot stop its workers; left alive they would keep horovodrun's output pipe
    open, and horovodrun would wait on them forever instead of ending the job. SIGTERM and SIGINT are the
    rank's to handle (preemption: finish the step, checkpoint): a scheduler that signals the whole process
    group must not kill the workers under it. Until this runs, the wrapper of :func:`spawn_context` keeps
    them ignored.
    """
    import ctypes
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: no such guard
        pass


def kill_workers_at_exit() -> None:
    """Workers ignore SIGTERM (above), so multiprocessing's own exit handler, which terminates its children
    with SIGTERM and then joins them, would wait forever: kill them first. atexit runs the handlers in
    reverse order, and this one is registered after multiprocessing's. torch's SIGCHLD handler would raise
    "worker killed" from inside this loop and leave the rest alive, so it is switched off first."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for child in multiprocessing.active_children():
        child.kill()
        child.join(timeout=5)


@functools.cache
def spawn_context() -> "SignalProofSpawn":
    """The spawn context, with each child started by a tiny /bin/sh wrapper that ignores SIGTERM and SIGINT and
    then execs this Python: an ignored signal stays ignored across exec.

    A spawned worker imports torch for seconds before ``die_with_the_rank`` runs; a scheduler's SIGTERM to the
    process group in that window would kill it and fail the rank. (A blocked signal mask would not do: Python
    clears it in the child.) The rank's only spawned children are its loader workers.

    Made once per process, when the first loader with workers is made, not at import (no side effect for a process
    that only imports the package), which registers kill_workers_at_exit: still after multiprocessing's own
    handler, so it runs first."""
    atexit.register(kill_workers_at_exit)
    return SignalProofSpawn()


class SignalProofProcess(multiprocessing.context.SpawnProcess):
    """A spawned process started through the wrapper. multiprocessing keeps one executable for the whole process
    (``set_executable``), and a forkserver or spawn pool started later with the wrapper would have children
    that ignore SIGTERM, so ``Pool.terminate`` (its ``with`` exit) would wait on them forever: the wrapper is
    swapped in only while one of these processes starts."""

    @staticmethod
    def _Popen(process_obj):
        from multiprocessing import spawn
        plain = spawn.get_executable()
        spawn.set_executable(signal_proof_python())
        try:
            return multiprocessing.context.SpawnProcess._Popen(process_obj)
        finally:
            spawn.set_executable(plain)


class SignalProofSpawn(multiprocessing.context.SpawnContext):
    Process = SignalProofProcess


def signal_proof_python() -> str:
    """The wrapper, in the first folder where it can be kept safely and run: ~/.cache/hybridtrain, else the
    temp folder (skipped when mounted noexec, as it often is on clusters). Without one, plain Python. It ignores
    SIGTERM/SIGINT and, where setpriv exists, dies with the rank from its first instruction."""
    python = shlex.quote(sys.executable)
    # setpriv (util-linux) sets the parent-death signal before Python starts, so a rank killed while its workers
    # still import torch (seconds) takes them along; die_with_the_rank sets it again once they run
    script = (f"#!/bin/sh\ntrap '' TERM INT\n"
              f"if setpriv --pdeathsig KILL true 2>/dev/null; then exec setpriv --pdeathsig KILL {python} \"$@\"; fi\n"
              f"exec {python} \"$@\"\n")
    name = f"worker-python-{os.getuid()}-{hashlib.sha256(script.encode()).hexdigest()[:16]}"
    for folder in (os.path.join(os.path.expanduser("~"), ".cache", "hybridtrain"), tempfile.gettempdir()):
        path = os.path.join(folder, name)
        try:
            os.makedirs(folder, mode=0o700, exist_ok=True)
            if os.statvfs(folder).f_flag & os.ST_NOEXEC:
                continue
            if not is_ours(path, script):
                staging = f"{path}.{os.getpid()}"
                with open(os.open(staging, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o755), "w") as fh:
                    fh.write(script)
                os.replace(staging, path)  # atomic: ranks on one host may race here
            if is_ours(path, script):
                return path
        except OSError:
            continue
    return sys.executable


def is_ours(path: str, script: str) -> bool:
    """A file this user owns, that nobody else may write, holding exactly ``script``: anything else in a
    shared folder such as /tmp could be someone's planted program, and is never run."""
    try:
        st = os.lstat(path)
        with open(path) as fh:
            content = fh.read()
    except OSError:
        return False
    return stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & 0o022 and content == script


# ----------------------------------------------------------------------------- shared memory (/dev/shm)

@dataclass(frozen=True)
class WorkerBatches:
    """What one rank's two loaders (training and validation, both with persistent workers) put in /dev/shm: each
    batch a worker makes travels to the rank as a shared-memory file (torch's file_descriptor strategy)."""
    batch: int          # train.batch_size
    val_batch: int      # data.val_batch_size or train.batch_size
    crop: int           # data.crop_size: both loaders deliver crop x crop uint8 pixels
    workers: int        # per loader
    prefetch: int       # data.prefetch: batches in flight per worker

    def bytes_per_rank(self) -> int:
        return loader_shm_bytes(self.batch, self.crop, self.workers, self.prefetch) + \
            loader_shm_bytes(self.val_batch, self.crop, self.workers, self.prefetch)


def pages(nbytes: int) -> int:
    return -(-nbytes // PAGE) * PAGE


def batch_shm_bytes(batch: int, crop: int) -> int:
    """One batch in shared memory: its uint8 images (batch x 3 x crop x crop), labels and indices (int64), each a
    file of whole pages."""
    return pages(batch * 3 * crop * crop) + 2 * pages(8 * batch)


def loader_shm_bytes(batch: int, crop: int, workers: int, prefetch: int) -> int:
    """The most one loader holds at once: workers x prefetch batches in flight (torch keeps that many asked
    for), the batch the rank is receiving and the one it still trains on; and its semaphores, a page each (a
    queue per worker and one for results, 3 each; two events, 5 each in all; counted in a real /dev/shm)."""
    return (workers * prefetch + 2) * batch_shm_bytes(batch, crop) + (3 * workers + 8) * PAGE


def shm_space(path: str = SHM_DIR) -> tuple[int, int] | None:
    """(total, free) bytes of the shared-memory file system, or None where there is none to ask."""
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize


def shm_fixes(batches: WorkerBatches, local_size: int, limit: int, workers_set: bool) -> str:
    """The fixes for a /dev/shm too small for the loaders: a larger one (containers), fewer batches in flight
    when some data.prefetch fits in ``limit`` bytes per rank, or no worker processes (data.in_process)."""
    size_gb = max(1, -(-batches.bytes_per_rank() * local_size * 5 // 4 // (1 << 30)))   # 25 % to spare
    prefetch = next((p for p in range(batches.prefetch - 1, 0, -1)  # the largest that fits, or 0
                     if replace(batches, prefetch=p).bytes_per_rank() <= limit), 0)
    return (f"start the container with --shm-size={size_gb}g or more (docker run; or --ipc=host; Kubernetes: a "
            f"memory emptyDir at /dev/shm)"
            + (f", or lower data.prefetch to {prefetch}" if prefetch else "")
            + ", or decode in the rank's own process with data.in_process=true (slower: no loader workers"
            + ("; drop data.workers)" if workers_set else ")"))


def shm_refusal(batches: WorkerBatches, local_size: int, space: tuple[int, int] | None, workers_set: bool) -> str:
    """'' when this node's ranks' loader batches fit in /dev/shm, else the one line. ``space``: (total, free)
    bytes. Refused when the node's ``local_size`` ranks need more than /dev/shm holds, or this rank alone more
    than is free now (the node's other ranks may be starting their workers at this moment, so free space is
    not divided among them)."""
    if space is None:
        return ""
    total, free = space
    rank_need = batches.bytes_per_rank()
    node_need = rank_need * local_size
    if node_need <= total and rank_need <= free:
        return ""
    ranks = f"this node's {local_size} ranks need" if local_size > 1 else "this rank needs"
    return (f"{SHM_DIR} is too small for the loader workers: {total / MB:.0f} MB ({free / MB:.0f} MB free), and "
            f"{ranks} about {node_need / MB:.0f} MB for their batches in flight (data.workers={batches.workers} "
            f"x data.prefetch={batches.prefetch} + 2 batches of {batches.batch} x {batches.crop}x{batches.crop} "
            f"pixels, per loader): {shm_fixes(batches, local_size, min(free, total // local_size), workers_set)}")


def check_shared_memory(batches: WorkerBatches, local_size: int, workers_set: bool) -> None:
    """Refuse, in one line, loader workers whose batches cannot fit in /dev/shm (a container started without
    --shm-size has 64 MB), before any worker starts: otherwise every worker prints a traceback and the job
    stops or hangs. A refusal, not a silent fall-back to in-process loading, which would train at a fraction
    of the speed asked for."""
    line = shm_refusal(batches, local_size, shm_space(), workers_set)
    if line:
        raise UserError(line, same_on_all_ranks=False)


# what torch says when a worker's batch finds /dev/shm full: "unable to allocate shared memory(shm) for file
# </torch_...>: No space left on device" (2.13; "unable to write to file </torch_..." in 2.3), or, where the
# kernel signals the write, "DataLoader worker (pid N) is killed by signal: Bus error ... out of shared memory"
SHM_FULL_WORDS = ("shared memory(shm)", "</torch_", "out of shared memory", "Bus error")


def shared_memory_failure(error: BaseException) -> str:
    """The one line for a loader worker that failed because /dev/shm is full, else ''."""
    text = str(error)
    if not any(word in text for word in SHM_FULL_WORDS):
        return ""
    if "No space left" not in text and "Bus error" not in text:
        return ""
    space = shm_space()
    size = f" ({space[0] / MB:.0f} MB, {space[1] / MB:.0f} MB free now)" if space else ""
    return (f"{SHM_DIR}{size} ran out of space while a loader worker passed a batch to this rank: start the "
            f"container with a larger --shm-size (docker run; or --ipc=host), lower data.prefetch or data.workers, "
            f"or decode in the rank's own process with data.in_process=true (slower: no loader workers)")


def shared_memory_errors(iterator):
    """A loader's iterator whose /dev/shm failures (:func:`shared_memory_failure`) are this rank's one line."""
    try:
        yield from iterator
    except RuntimeError as exc:
        line = shared_memory_failure(exc)
        if line:
            raise UserError(line, same_on_all_ranks=False) from None
        raise

"""The loader workers' lives: spawned through a wrapper that ignores SIGTERM until they can die with their
rank (a scheduler's SIGTERM to the process group is the rank's to handle), killed at exit, never left behind."""
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
def kill_workers_at_exit_once() -> None:
    """Register kill_workers_at_exit when the first loader with workers is made, not at import (no side effect
    for a process that only imports the package); still after multiprocessing's own handler, so it runs first."""
    atexit.register(kill_workers_at_exit)


def spawn_context():
    """The spawn context, with each child started by a tiny /bin/sh wrapper that ignores SIGTERM and SIGINT and
    then execs this Python: an ignored signal stays ignored across exec.

    A spawned worker imports torch for seconds before ``die_with_the_rank`` runs; a scheduler's SIGTERM to the
    process group in that window would kill it and fail the rank. (A blocked signal mask would not do: Python
    clears it in the child.) The rank's only spawned children are its loader workers."""
    kill_workers_at_exit_once()
    context = multiprocessing.get_context("spawn")
    context.set_executable(signal_proof_python())
    return context


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

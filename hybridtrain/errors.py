"""The package's errors: bad input (``UserError``, printed as one line that names the problem and the fix), a lost
peer (``PeerFailure``), and the one line for a fault of the machine (``environment_fault``). The guard that turns
them into exit statuses and lines is launched_by.run_guarded."""
from __future__ import annotations

import errno
import os


class UserError(Exception):
    """Bad input (config, data, checkpoint, command line). The message is printed as one line.

    ``same_on_all_ranks`` marks errors every rank detects identically (config, dataset scan);
    only rank 0 prints those, so a 2-rank job shows the line once.
    """

    def __init__(self, message: str, same_on_all_ranks: bool = True):
        super().__init__(message)
        self.same_on_all_ranks = same_on_all_ranks


class PeerFailure(Exception):
    """Another rank died or failed; the message names it when this rank can tell (see distributed.departed). Its
    line is printed where it is made (distributed.failures.peer_failure), by one surviving rank of each host."""


# The signs of a lost peer in the errors of the engine that formed this process's job: (class names, words), from
# its entry in the registry of engines (distributed.engines), set by distributed.collectives.init (this module
# imports nothing of the package). Empty before any init: no job, no peer to lose.
PEER_FAILURE_SIGNS = {"types": (), "words": ()}


def is_peer_failure(exc: BaseException) -> bool:
    """True for the error the job's engine raises on the surviving ranks after another rank failed or exited (e.g.
    Horovod's HorovodInternalError, torch.distributed's backend error naming a lost connection)."""
    text = str(exc)
    return type(exc).__name__ in PEER_FAILURE_SIGNS["types"] or any(w in text for w in PEER_FAILURE_SIGNS["words"])


# What the machine (not hybridtrain, not the input) did wrong, and the fix, by errno.
ENVIRONMENT_FIXES = {
    errno.EROFS: "the file system is read-only: choose a folder on a writable file system (or remount it read-write)",
    errno.ENOSPC: "the disk is full: free space there, or choose a folder on another disk",
    errno.EDQUOT: "the disk quota is used up: free space there, or choose a folder on another disk",
    errno.EFBIG: "the file would pass the file-size limit: raise it (ulimit -f unlimited) or choose another folder",
    errno.EACCES: "permission denied: fix its permissions, or choose another path",
    errno.EPERM: "the operation is not permitted there: fix its permissions, or choose another path",
    errno.EISDIR: "is a folder where a file should be: move the folder away, or choose another path",
    errno.ENOTDIR: "a part of the path is a file where a folder should be: fix the path",
    errno.ELOOP: "is a loop of symbolic links: fix or remove the link",
    errno.ENAMETOOLONG: "the name is too long for the file system: choose a shorter path",
    errno.EMFILE: "this process may open no more files: raise the limit (ulimit -n)",
    errno.EIO: "the device reported an input/output error: check the disk",
}


def environment_fault(exc: OSError) -> str | None:
    """The one line (without the prefix) for an OSError the environment caused: a read-only folder, a full disk, a
    dangling symbolic link, a folder where a file should be, ...: the path, what is wrong, and the fix. None for an
    OSError that is not about the machine (then it is a bug, reported as one)."""
    path = exc.filename
    shown = f"{path}" if path is not None else "a write or read of an open file"
    if exc.errno == errno.ENOENT and path is not None:
        target = dangling_link(os.fsdecode(path))
        if target is not None:
            return f"{shown}: {target} is a symbolic link to {os.readlink(target)}, which does not exist: fix or " \
                   f"remove the link"
        return f"{shown} does not exist (No such file or directory): check the path, or create it"
    fix = ENVIRONMENT_FIXES.get(exc.errno)
    if fix is None:
        return None
    strerror = exc.strerror or os.strerror(exc.errno)
    return f"{shown}: {strerror}: {fix}" if not fix.startswith("is ") else f"{shown} {fix} ({strerror})"


def dangling_link(path: str) -> str | None:
    """``path`` or its nearest ancestor that is a symbolic link pointing nowhere, or None."""
    current = os.path.abspath(path)
    while True:
        if os.path.islink(current) and not os.path.exists(current):
            return current
        parent = os.path.dirname(current)
        if parent == current:
            return None
        current = parent

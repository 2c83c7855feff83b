"""User-facing errors: one clear line that names the problem and the fix, never a traceback."""
from __future__ import annotations

import contextlib
import errno
import json
import os
import signal
import sys
import tempfile
import time
import traceback

from hybridtrain.launched_by import launcher_rank


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


def write_crash_log(exc: BaseException, rank: int, folder: str | None) -> str:
    """The full traceback of an unexpected error (a bug, not bad input) in ``folder``/logs/rank-R-error.log, or
    in the temp folder when ``folder`` is None or not writable; returns the path."""
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    for base in ([os.path.join(folder, "logs")] if folder else []) + [tempfile.gettempdir()]:
        path = os.path.join(base, f"rank-{rank}-error.log" if base != tempfile.gettempdir() else
                            f"hybridtrain-rank-{rank}-{os.getpid()}-error.log")
        try:
            os.makedirs(base, exist_ok=True)
            return replace_file(path, text)
        except OSError:
            continue
    return "(no writable folder for the log)"


@contextlib.contextmanager
def atomic_path(path: str):
    """A temp path in ``path``'s folder, with ``path``'s extension (for writers that pick a format from it), that
    becomes ``path`` in one rename when the block ends without an error, with the mode a plain new file gets under
    this process's umask (a temp file starts at 0600); removed when it does not."""
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.normpath(path)) or ".",
                               prefix=f".{os.path.basename(path)}.", suffix=os.path.splitext(path)[1])
    os.close(fd)
    try:
        yield tmp
        umask = os.umask(0o022)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def replace_file(path: str, text: str) -> str:
    """``text`` at ``path`` through a new temp file in its folder (:func:`atomic_path`), fsynced, and one rename, so a
    reader (torchrun, a restarted attempt, a user) finds the old file or the whole new one, even when this process is
    killed mid-write. Every text file the package writes goes through it (outputs.write_text_atomically adds the
    one-line error); it lives here because this module's own files (the crash log, torchrun's error file) need it
    too."""
    with atomic_path(path) as tmp, open(tmp, "w") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    return path


class WholeLines:
    """A text stream that hands its stream only whole lines, each batch in one write, flushed at once.

    ``print(text)`` writes ``text`` and ``"\\n"`` apart, and an unbuffered stream (``python -u``,
    ``PYTHONUNBUFFERED``) or a full buffer passes each on by itself. ``mpirun --tag-output`` tags every write, so the
    newline then arrives as a line of its own and the text's line ends with a stray ``[1,0]<stdout>:``. Here a line
    leaves only with its newline; ``flush()`` still passes on a partial line (a prompt, a progress bar)."""

    def __init__(self, stream):
        self.stream, self.pending = stream, ""

    def write(self, text: str) -> int:
        self.pending += text
        cut = self.pending.rfind("\n") + 1
        if cut:
            whole, self.pending = self.pending[:cut], self.pending[cut:]
            self.stream.write(whole)
            self.stream.flush()
        return len(text)

    def flush(self) -> None:
        if self.pending:
            self.stream.write(self.pending)
            self.pending = ""
        self.stream.flush()

    def __getattr__(self, name):  # encoding, errors, isatty, fileno, buffer, reconfigure, ...
        return getattr(self.stream, name)


def run_guarded(action, crash_log_dir=lambda: None) -> int:
    """Run ``action()``; bad input becomes one error line (rank 0 only when every rank has it), exit 2; a bug
    becomes one line naming the rank and the error, its traceback in a log under ``crash_log_dir()``, exit 1.
    Every line leaves whole: sys.stdout and sys.stderr are :class:`WholeLines` for the run (once: a nested run keeps
    the outer one's)."""
    if isinstance(sys.stdout, WholeLines) or sys.stdout is None or sys.stderr is None:
        return _run_guarded(action, crash_log_dir)
    streams = WholeLines(sys.stdout), WholeLines(sys.stderr)
    try:
        with contextlib.redirect_stdout(streams[0]), contextlib.redirect_stderr(streams[1]):
            return _run_guarded(action, crash_log_dir)
    finally:
        for stream in streams:
            with contextlib.suppress(OSError, ValueError):  # a closed pipe: nothing more can reach the reader
                stream.flush()


# A refusal every rank makes (UserError.same_on_all_ranks) is printed by rank 0 alone; the other ranks wait this long
# before they exit. horovodrun, torchrun and mpirun end the whole job when its first rank exits non-zero, so a rank 1
# that exits first has rank 0 killed before its line is out: a refusal made before torch is imported takes ~0.1 s, and
# the ranks' start-up skew is larger than that. Rank 0's exit ends the wait (its launcher stops the other ranks), so
# the wait costs nothing when rank 0 refuses too; it bounds a job whose rank 0 went on.
PEER_REFUSAL_WAIT_S = 10.0


# ----------------------------------------------------------------------------- what torchrun is told

TORCHRUN_ERROR_FILE = "TORCHELASTIC_ERROR_FILE"  # torchrun gives each rank its own: <run>/attempt_<n>/<rank>/error.json
REFUSED_MARK = "hybridtrain-refused"


def tell_torchrun(line: str) -> None:
    """``line`` in the error file torchrun gave this rank, in the JSON of torch's ``@record``
    (torch.distributed.elastic.multiprocessing.errors): torchrun's ChildFailedError box then shows our line where it
    showed a link to torch's docs, and torchrun copies it, with the rank's exit status, into its own
    TORCHELASTIC_ERROR_FILE when one is set (launch/torchrun.sh reads it there)."""
    path = os.environ.get(TORCHRUN_ERROR_FILE)
    if not path:
        return
    line = line.removeprefix("hybridtrain: error: ")  # the box repeats the line: not a second error line
    data = {"message": {"message": line, "extraInfo": {"py_callstack": line, "timestamp": str(int(time.time()))}}}
    with contextlib.suppress(OSError):
        replace_file(path, json.dumps(data))


def refusal_mark() -> str | None:
    """Under torchrun --max-restarts: the file, in torchrun's folder of this run (shared by its attempts), that
    keeps the first attempt's refusal of bad input. torchrun restarts every failed attempt, and no restart can fix
    bad input: a restarted rank that finds the file ends at once with status 2, silently, instead of importing
    torch to refuse the same input again with the same line (issue 34, class 2)."""
    path, restarts = os.environ.get(TORCHRUN_ERROR_FILE), os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")
    if not path or restarts in ("", "0"):
        return None
    return os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(path))), REFUSED_MARK)


def refused_in_an_earlier_attempt() -> str | None:
    """The line an earlier attempt of this torchrun run refused its input with, or None."""
    mark = refusal_mark()
    if mark is None or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
        return None
    with contextlib.suppress(OSError), open(mark) as fh:
        return fh.read().strip() or None
    return None


def _run_guarded(action, crash_log_dir) -> int:
    earlier = refused_in_an_earlier_attempt()
    if earlier:
        tell_torchrun(earlier)
        return 2
    try:
        return action() or 0
    except UserError as exc:
        rank = launcher_rank()
        line = f"hybridtrain: error: {'' if rank == 0 else f'rank {rank}: '}{exc}"
        if rank == 0 or not exc.same_on_all_ranks:
            mark = refusal_mark()  # kept for a restarted attempt (refused_in_an_earlier_attempt)
            if mark:
                with contextlib.suppress(OSError):
                    replace_file(mark, line)
            tell_torchrun(line)
            print(line, file=sys.stderr, flush=True)
        else:
            with contextlib.suppress(ValueError):  # not the main thread: leave the handler as it is
                # SIGTERM ends this process at once and silently: the launcher's stop after rank 0's line is not a
                # preemption to report (a preemption handler may still be installed)
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
            time.sleep(PEER_REFUSAL_WAIT_S)  # rank 0 prints the line, then its exit ends this job
        return 2
    except PeerFailure:  # its line is out already (failures.peer_failure)
        return 3
    except RuntimeError as exc:
        if not is_peer_failure(exc):
            return report_bug(exc, crash_log_dir())
        print(f"hybridtrain: rank {launcher_rank()} stopped because another rank failed or was killed (its error "
              f"line, if any, says why); checkpoints are intact: rerun the same command with --resume",
              file=sys.stderr, flush=True)
        return 3
    except KeyboardInterrupt:
        print("hybridtrain: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader went away (| head): stop quietly, as a shell tool does
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except OSError as exc:
        line = environment_fault(exc)
        if line is None:
            return report_bug(exc, crash_log_dir())
        rank = launcher_rank()
        line = f"hybridtrain: error: {'' if rank == 0 else f'rank {rank}: '}{line}"
        tell_torchrun(line)
        print(line, file=sys.stderr, flush=True)
        return 2
    except Exception as exc:
        return report_bug(exc, crash_log_dir())


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


def report_bug(exc: Exception, log_dir: str | None) -> int:
    """A bug, not bad input: one line naming the rank, the error and where its traceback is (a log file)."""
    rank = launcher_rank()
    log_path = write_crash_log(exc, rank, log_dir)
    message = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    line = (f"hybridtrain: error: rank {rank}: unexpected {type(exc).__name__}" + (f": {message[:300]}" if message
            else "") + f" (a bug in hybridtrain or a library: the full traceback is in {log_path}; please report it)")
    tell_torchrun(line)
    print(line, file=sys.stderr, flush=True)
    return 1

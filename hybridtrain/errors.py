"""User-facing errors: one clear line that names the problem and the fix, never a traceback."""
from __future__ import annotations

import os
import sys
import tempfile
import traceback

# horovodrun, Open MPI, MPICH/Intel MPI, PMIx, torchrun, srun (SLURM_PROCID last: under srun + torchrun it counts nodes)
RANK_ENV_VARS = ("HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "RANK", "SLURM_PROCID")


def launcher_rank() -> int:
    """The rank the launcher assigned, readable before hvd.init() (0 when run alone)."""
    for var in RANK_ENV_VARS:
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return 0


class UserError(Exception):
    """Bad input (config, data, checkpoint, command line). The message is printed as one line.

    ``same_on_all_ranks`` marks errors every rank detects identically (config, dataset scan);
    only rank 0 prints those, so a 2-rank job shows the line once.
    """

    def __init__(self, message: str, same_on_all_ranks: bool = True):
        super().__init__(message)
        self.same_on_all_ranks = same_on_all_ranks


class PeerFailure(Exception):
    """Another rank died or failed; the message names it when this rank can tell (see distributed.departed).
    ``announce``: this rank prints the line (the lowest surviving rank on its host)."""

    def __init__(self, message: str, announce: bool = True):
        super().__init__(message)
        self.announce = announce


# what torch.distributed's Gloo and NCCL say on a surviving rank when a peer died or its connection broke
PEER_LOSS_WORDS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "NCCL communicator was "
                   "aborted", "failed to recv", "Socket Timeout", "Timed out waiting")


def is_peer_failure(exc: BaseException) -> bool:
    """True for the error an engine raises on the surviving ranks after another rank failed or exited: Horovod's
    HorovodInternalError, or torch.distributed's backend error naming a lost connection."""
    text = str(exc)
    if type(exc).__name__ == "HorovodInternalError" or "Horovod has been shut down" in text:
        return True
    return type(exc).__name__ in ("DistBackendError", "DistNetworkError") or any(w in text for w in PEER_LOSS_WORDS)


def write_crash_log(exc: BaseException, rank: int, folder: str | None) -> str:
    """The full traceback of an unexpected error (a bug, not bad input) in ``folder``/logs/rank-R-error.log, or
    in the temp folder when ``folder`` is None or not writable; returns the path."""
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    for base in ([os.path.join(folder, "logs")] if folder else []) + [tempfile.gettempdir()]:
        path = os.path.join(base, f"rank-{rank}-error.log" if base != tempfile.gettempdir() else
                            f"hybridtrain-rank-{rank}-{os.getpid()}-error.log")
        try:
            os.makedirs(base, exist_ok=True)
            with open(path, "w") as fh:
                fh.write(text)
            return path
        except OSError:
            continue
    return "(no writable folder for the log)"


def unexpected_error_line(exc: BaseException, rank: int, log_path: str) -> str:
    """The one line for a bug: the rank, the error, and where its traceback is."""
    message = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return (f"hybridtrain: error: rank {rank}: unexpected {type(exc).__name__}" + (f": {message[:300]}" if message
            else "") + f" (a bug in hybridtrain or a library: the full traceback is in {log_path}; please report it)")


def run_guarded(action, crash_log_dir=lambda: None) -> int:
    """Run ``action()``; bad input becomes one error line (rank 0 only when every rank has it), exit 2; a bug
    becomes one line naming the rank and the error, its traceback in a log under ``crash_log_dir()``, exit 1."""
    try:
        return action() or 0
    except UserError as exc:
        rank = launcher_rank()
        if rank == 0 or not exc.same_on_all_ranks:
            prefix = "" if rank == 0 else f"rank {rank}: "
            print(f"hybridtrain: error: {prefix}{exc}", file=sys.stderr, flush=True)
        return 2
    except PeerFailure as exc:
        if exc.announce:
            print(f"hybridtrain: {exc}", file=sys.stderr, flush=True)
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
    except Exception as exc:
        return report_bug(exc, crash_log_dir())


def report_bug(exc: Exception, log_dir: str | None) -> int:
    """A bug, not bad input: one line naming the rank and the error; the traceback goes to a log file."""
    rank = launcher_rank()
    print(unexpected_error_line(exc, rank, write_crash_log(exc, rank, log_dir)), file=sys.stderr, flush=True)
    return 1

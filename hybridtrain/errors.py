"""User-facing errors: one clear line that names the problem and the fix, never a traceback."""
from __future__ import annotations

import os
import tempfile
import traceback


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

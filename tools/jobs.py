"""A launcher job, as every tool beside the trainer runs one: start it with the checkout importable by its ranks
(:func:`run_job`, which reports the job's last error line), and stop it cleanly on SIGTERM or Ctrl-C
(:func:`stopped_cleanly`, which ends the launcher with its ranks).

May import: the standard library, psutil and hybridtrain. The bottom of the tools: benchmarks and the other tools
import it, it imports neither.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager, suppress

import psutil

from hybridtrain.errors import UserError

CHECKOUT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # holds benchmarks/ and tools/
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def checkout_env() -> dict:
    """This process's environment with the checkout first on PYTHONPATH: a rank started by a launcher runs
    ``python -m benchmarks.X`` from whatever folder the launcher gives it."""
    path = os.environ.get("PYTHONPATH", "")
    return {**os.environ, "PYTHONPATH": CHECKOUT + (os.pathsep + path if path else "")}


def run_job(cmd: list[str], failure: str, fix: str = "see its output") -> str:
    """Run ``cmd`` (a launcher with its ranks), echoing it; its output, or one line ``failure: <the job's last
    'hybridtrain: error' line, else fix>`` when it ends with an error."""
    print("+ " + " ".join(cmd), flush=True)
    proc = subprocess.run(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          env=checkout_env())
    if proc.returncode != 0:
        raise UserError(f"{failure}: {last_error_line(proc.stdout, fix)}", same_on_all_ranks=False)
    return proc.stdout


def last_error_line(output: str, fix: str = "see its output") -> str:
    """The last ``hybridtrain: error`` line a job printed (its ranks' one line), else ``fix``."""
    return ([line for line in output.splitlines() if "hybridtrain: error" in line][-1:] or [fix])[0]


def end_all(pids, grace_s: float = 3.0) -> None:
    """SIGTERM, then SIGKILL after ``grace_s``, every process ``pids()`` lists (asked again as they go)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids():
            with suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + grace_s
        while pids() and time.monotonic() < deadline:
            time.sleep(0.05)


def descendants() -> list[int]:
    """The live processes this one started, and theirs (a launcher's ranks); zombies left out."""
    found = []
    for child in psutil.Process().children(recursive=True):
        with suppress(psutil.NoSuchProcess):  # one that just ended
            if child.status() != psutil.STATUS_ZOMBIE:
                found.append(child.pid)
    return found


class Stopped(BaseException):
    """SIGTERM or SIGINT arrived (its number: the one argument): unwinds the command (its ``finally`` blocks run) to
    :func:`stopped_cleanly`."""


@contextmanager
def stopped_cleanly(what: str, cleanup=None):
    """SIGTERM (a scheduler, ``timeout``) or SIGINT (Ctrl-C) in the block leaves nothing behind: every process the
    command started ends at once (a launcher with its ranks), then ``cleanup()`` runs (the cluster's ``down``:
    the namespaces with their sshds and ranks); one line says so, naming ``what`` was stopped, and the command exits
    with 128 + the signal (143, 130), as a shell reports a process the signal ended."""
    def stop(signum, frame):
        for sig in STOP_SIGNALS:  # a second signal does not cut the cleanup short
            signal.signal(sig, signal.SIG_IGN)
        end_all(descendants)  # before the stack unwinds: a killed launcher would leave its ranks to init
        raise Stopped(signum)
    previous = {sig: signal.signal(sig, stop) for sig in STOP_SIGNALS}
    try:
        yield
    except Stopped as exc:
        signum, = exc.args
        if cleanup is not None:
            cleanup()
        print(f"hybridtrain: stopped by {signal.Signals(signum).name}: {what}", file=sys.stderr, flush=True)
        raise SystemExit(128 + signum) from None
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)

"""Who started this process, read from the environment alone (torch-free): torchrun (it sets TORCHELASTIC_RUN_ID for
its workers), srun (SLURM_STEP_ID: a batch script's own shell has no step), horovodrun or an MPI's mpirun (their rank
variables), or nobody; the rank that launcher gave; and what the launcher is told when a command ends: the guard
(``run_guarded``: which rank prints the error line, the exit status, torchrun's error file and refusal mark). The one
place that tells launchers apart: distributed/launch_env.py (the job's size and place, checked) and the registry of
engines (distributed/engines.py: which engine's launcher this is) ask it too."""
from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import tempfile
import time
import traceback
from typing import Mapping

from hybridtrain.errors import PeerFailure, UserError, environment_fault, is_peer_failure
from hybridtrain.files import replace_file

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


# ----------------------------------------------------------------------------- the guard

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


def parse_and_run(parse, argv: list) -> int:
    """``parse(argv)`` (argparse's namespace, its command in ``func``), then the command, both under run_guarded:
    parsing reads the engine plugins (--engine's choices), whose refusal is one line like any other."""
    parsed = {}

    def action():
        args = parsed["args"] = parse(argv)
        return args.func(args)
    return run_guarded(action, lambda: getattr(parsed.get("args"), "crash_log_dir", None))


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
    torch to refuse the same input again with the same line."""
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

"""What a run's folder holds, in one module: which names are the run's (``RUN_FILES``, the checkpoint names), which
are checkpoints (``list_checkpoints``), the newest one that loads (``load_latest``), which temp files are stale, and
the run's hold on the folder (``RunDir``), through which every checkpoint is saved and the older ones pruned. A run
owns its ``run_dir``: an exclusive lock while it trains, a marker naming the run, and a refusal to start fresh over
another run's files. (checkpoint.py is what a checkpoint file holds: its bytes, checksum and loading.)

- ``run.json`` names the run (``run_id``) and lists the checkpoints it wrote; pruning removes only those.
- ``.lock`` is held with ``flock`` by rank 0 for the whole run. The kernel drops it when the process dies, so
  the lock of a killed run never needs cleaning up; the file's text names the holder for the error line.
- A fresh run (no ``--resume``) into a folder holding a run's files (``RUN_FILES``) is refused in one line,
  unless ``--move-aside`` moves those files into ``previous-<time>/`` inside the folder. Files of the user's
  own are never touched.
"""
from __future__ import annotations

import fcntl
import glob
import json
import os
import re
import shutil
import socket
import sys
import time
import uuid

from hybridtrain.config import check_run_dir
from hybridtrain.engine import checkpoint
from hybridtrain.engine.checkpoint import CHECKSUM_SUFFIX, checksum_path
from hybridtrain.errors import UserError
from hybridtrain.files import is_plain_file, refuse_unless_plain, write_json_atomically

MARKER = "run.json"
LOCK = ".lock"
PATTERN = "checkpoint-epoch{epoch:04d}.pt"
STOPPED_PATTERN = "checkpoint-epoch{epoch:04d}-step{step:06d}.pt"  # a preempted epoch, after ``step`` steps
NAME_RE = re.compile(r"checkpoint-epoch(\d+)(?:-step(\d+))?\.pt")  # the whole name of a checkpoint this code writes
# a save's temp file: a checkpoint's, the final model's or their sidecars' (atomic_save), and those of the run's
# other files (files.atomic_path: .NAME.XXXXXXXX.EXT; older versions wrote run.json's, metrics.jsonl's NAME.tmp-PID)
TEMP_RE = re.compile(r"(?:(?:checkpoint-epoch\d+(?:-step\d+)?|final_model)\.pt(?:\.sha256)?|run\.json|metrics\.jsonl)"
                     r"\.tmp-\d+|\.(?:run\.json|metrics\.jsonl|config\.yaml|sinks\.json|report\.json|report\.md|"
                     r"(?:accuracy|throughput|lr|breakdown)\.png)\.\w{8}\.(?:json|jsonl|yaml|md|png)")
WHOLE_EPOCH = 1 << 30  # sorts a finished epoch after every stopped checkpoint of the same epoch


def checkpoint_name(epoch: int, step: int | None = None) -> str:
    """The name of epoch ``epoch``'s checkpoint, or of a stopped one after ``step`` steps of it."""
    return PATTERN.format(epoch=epoch) if step is None else STOPPED_PATTERN.format(epoch=epoch, step=step)


def is_own_name(name: str) -> bool:
    """True for a bare checkpoint file name this code writes (never a path: run.json's names are data)."""
    return isinstance(name, str) and NAME_RE.fullmatch(name) is not None


def is_run_file_name(name: str) -> bool:
    """A checkpoint's name, its sidecar's, or a save's temp file's: the checkpoint-epoch* files a run writes."""
    base = name[:-len(CHECKSUM_SUFFIX)] if name.endswith(CHECKSUM_SUFFIX) else name
    return is_own_name(base) or TEMP_RE.fullmatch(name) is not None


def _order(name: str) -> tuple[int, int]:
    """(epoch, step) of a checkpoint name this code writes; a finished epoch's step is WHOLE_EPOCH."""
    m = NAME_RE.fullmatch(name)
    return int(m.group(1)), int(m.group(2)) if m.group(2) else WHOLE_EPOCH


def list_checkpoints(directory: str) -> list[tuple[tuple[int, int], str]]:
    """((epoch, step), path), oldest first."""
    names = (os.path.basename(path) for path in glob.glob(os.path.join(glob.escape(directory), "checkpoint-epoch*.pt")))
    return sorted((_order(name), os.path.join(directory, name)) for name in names if is_own_name(name))


def remove_stale_temp_files(directory: str) -> None:
    """Remove the temp files of saves that were killed mid-write (plain files named as a save names them); only
    the holder of the run_dir's lock calls this, so no save of this run is under way."""
    for name in os.listdir(directory):
        path = os.path.join(directory, name)
        if TEMP_RE.fullmatch(name) and is_plain_file(path):
            os.remove(path)


RUN_FILES = ("run.json", "metrics.jsonl", "config.yaml", "final_model.pt*", "report.json", "report.md",
             "checkpoint-epoch*", "tensorboard", "logs", "samples", "accuracy.png", "throughput.png", "lr.png",
             "breakdown.png", "profile", "sinks.json", "mlruns", "wandb")
# What a run that trained something leaves; a run that stopped before its first checkpoint (bad data, a wrong
# flag) leaves only run.json, config.yaml and logs, and the next fresh run takes its folder over.
RESULT_FILES = ("metrics.jsonl", "final_model.pt*", "report.json", "report.md", "checkpoint-epoch*", "samples")


def run_files(run_dir: str, patterns: tuple[str, ...] = RUN_FILES) -> list[str]:
    """The names in ``run_dir`` that a run writes, in the order of ``patterns`` (the telling ones first)."""
    found: list[str] = []
    for pattern in patterns:
        for name in sorted(os.path.basename(p) for p in glob.glob(os.path.join(glob.escape(run_dir), pattern))):
            if pattern.startswith("checkpoint-epoch") and not is_run_file_name(name):
                continue  # the user's checkpoint-epoch3-notes.txt is not the run's
            if name not in found:
                found.append(name)
    return found


class RunDir:
    """rank 0's hold on a run folder; ``release()`` (or the process's end) lets the next run in. ``created``: the
    folders the claim made (run_dir and its missing parents, deepest first)."""

    def __init__(self, path: str, fd: int, marker: dict, created: list[str] | None = None):
        self.path, self.fd, self.marker, self.created = path, fd, marker, created or []

    def save_checkpoint(self, state: dict, epoch: int, keep: int, step: int | None = None) -> str:
        """Write the epoch's checkpoint (a stopped one when ``step`` is given), then, only after it is durable, list it
        in run.json and remove all but the newest ``keep`` of those the run wrote, with their sidecars; files of
        other runs or of the user are never considered. The names come from run.json, so they are data: only a bare
        checkpoint name (no folder) is ever joined to run_dir, and only a plain file (no link, no folder) removed."""
        name = checkpoint_name(epoch, step)
        path = os.path.join(self.path, name)
        checkpoint.atomic_save(state, path)
        if name not in self.marker["checkpoints"]:
            self.marker["checkpoints"].append(name)
        self._write_marker()
        for strange in [n for n in self.checkpoints() if not is_own_name(n)]:
            print(f"hybridtrain: warning: {os.path.join(self.path, MARKER)} lists {strange!r}, which is not a "
                  f"checkpoint name of this run: ignored (nothing outside the run's own files is removed)",
                  file=sys.stderr)
            self.forget_checkpoint(strange)
        for old in sorted(self.checkpoints(), key=_order)[:-keep]:
            for own in (os.path.join(self.path, old), checksum_path(os.path.join(self.path, old))):
                if is_plain_file(own):
                    os.remove(own)
            self.forget_checkpoint(old)
        return path

    def forget_checkpoint(self, name: str) -> None:
        self.marker["checkpoints"] = [n for n in self.marker["checkpoints"] if n != name]
        self._write_marker()

    def checkpoints(self) -> list[str]:
        return list(self.marker["checkpoints"])

    def _write_marker(self) -> None:
        path = os.path.join(self.path, MARKER)
        refuse_unless_plain(path)
        write_json_atomically(path, self.marker)

    def hand_over(self) -> None:
        """Let go of the lock for the same run's next holder (an elastic job's re-formed rank 0); the folder stays
        whatever it holds."""
        self.created = []
        self.release()

    def release(self) -> None:
        """Let the next run in. A run that never started (refused after the claim, before its first epoch ended: bad
        data, a wrong flag) leaves no trace: when the claim made the folder and it holds only what the set-up wrote
        (:data:`SETUP_NAMES`), the folder goes, with the parents the claim made."""
        if self.fd < 0:
            return
        try:
            never_started = bool(self.created) and set(os.listdir(self.path)) <= SETUP_NAMES
            if never_started:
                shutil.rmtree(self.path)
        except OSError:  # the folder went away or changed meanwhile: left as it is
            never_started = False
        os.close(self.fd)
        self.fd = -1
        for folder in self.created[1:] if never_started else ():
            try:
                os.rmdir(folder)
            except OSError:  # not empty: something else was put there meanwhile
                break


# What a run writes before its first epoch ends (the claim's lock and marker, the config, TensorBoard's empty log)
SETUP_NAMES = {LOCK, MARKER, "config.yaml", "tensorboard"}


def lock(run_dir: str) -> int:
    """Hold ``run_dir/.lock`` (an fd, kept until release or exit), or one line naming the run that holds it."""
    path = os.path.join(run_dir, LOCK)
    refuse_unless_plain(path)  # a link would have the lock line written into the file it points to
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 200).decode(errors="replace").strip() or "another process"
        os.close(fd)
        raise UserError(f"run_dir {run_dir} is in use by another run ({holder}): wait for it to end, or choose "
                        f"another run_dir") from None
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"hybridtrain pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
    except OSError as exc:  # a full disk: named by its path
        os.close(fd)
        raise OSError(exc.errno, exc.strerror, path) from None
    return fd


def read_marker(run_dir: str) -> dict | None:
    """``run.json``, or None when there is none; one line when it is damaged."""
    path = os.path.join(run_dir, MARKER)
    if not os.path.lexists(path):
        return None
    refuse_unless_plain(path)
    try:
        with open(path) as fh:
            marker = json.load(fh)
        if not isinstance(marker.get("run_id"), str) or not isinstance(marker.get("checkpoints"), list):
            raise ValueError("run_id or checkpoints missing")
        strange = [name for name in marker["checkpoints"] if not is_own_name(name)]
        if strange:  # names are data: pruning would join them to run_dir and remove what they name
            raise ValueError(f"its checkpoints list {str(strange[0])[:80]!r}, which is not a checkpoint file name "
                             f"such as checkpoint-epoch0003.pt")
        return marker
    except (OSError, ValueError) as exc:
        raise UserError(f"{path} is damaged ({exc}): move the run_dir aside and start a new run, or restore "
                        f"run.json from a backup") from None


OWN_FILES = (MARKER, "config.yaml", "metrics.jsonl", "final_model.pt", "final_model.pt.sha256", "report.json",
             "report.md")


def check_own_files(run_dir: str) -> None:
    """One line when a file the run writes (run.json, config.yaml, metrics.jsonl, a checkpoint or its .sha256) is a
    symbolic link or a folder: the run would write through the link or fail half-way."""
    for name in OWN_FILES:
        refuse_unless_plain(os.path.join(run_dir, name))
    for path in glob.glob(os.path.join(glob.escape(run_dir), "checkpoint-epoch*")):
        if is_run_file_name(os.path.basename(path)):
            refuse_unless_plain(path)


def move_aside(run_dir: str, names: list[str]) -> str:
    """Move a previous run's files into ``run_dir/previous-<time>/``; returns that folder."""
    target = os.path.join(run_dir, time.strftime("previous-%Y%m%d-%H%M%S"))
    while os.path.exists(target):
        target += "x"
    os.makedirs(target)
    for name in names:
        os.replace(os.path.join(run_dir, name), os.path.join(target, name))
    return target


def made_folders(path: str) -> list[str]:
    """``os.makedirs(path)``; the folders it made, deepest first."""
    missing, current = [], os.path.abspath(path)
    while not os.path.lexists(current):
        missing.append(current)
        current = os.path.dirname(current)
    os.makedirs(path, exist_ok=True)
    return missing


def claim(run_dir: str, resume: str | None, move: bool = False) -> tuple[RunDir, str]:
    """Lock ``run_dir`` for this run and name the run; (the hold, a line for the log or '').

    Fresh (``resume`` None, or "auto" with no checkpoint): refused when the folder holds a run's files, unless
    ``move``. Resumed: the run of ``run.json`` goes on; a folder of an older version without one is adopted
    with the checkpoints it holds."""
    check_run_dir(run_dir)
    created = made_folders(run_dir)
    fd = lock(run_dir)
    try:
        check_own_files(run_dir)
        remove_stale_temp_files(run_dir)  # saves killed mid-write; we hold the lock, so none is under way
        marker, note = read_marker(run_dir), ""
        existing = run_files(run_dir)
        worth_keeping = run_files(run_dir, RESULT_FILES) or (marker is None and "config.yaml" in existing)
        resuming = resume == "required" or (resume == "auto" and bool(list_checkpoints(run_dir)))
        if not resuming and worth_keeping:
            if not move:
                raise UserError(f"run_dir {run_dir} holds another run's files ({', '.join(existing[:4])}"
                                f"{', ...' if len(existing) > 4 else ''}): continue that run with --resume, choose "
                                f"a new run_dir, or pass --move-aside to move its files into {run_dir}/previous-*/")
            note = f"hybridtrain: moved the previous run's files to {move_aside(run_dir, existing)}"
            marker = None
        if marker is None or not resuming:
            adopted = sorted(os.path.basename(path) for _, path in list_checkpoints(run_dir))
            marker = {"run_id": uuid.uuid4().hex, "created": time.time(), "checkpoints": adopted if resuming else []}
        held = RunDir(run_dir, fd, marker, created)
        held._write_marker()
        return held, note
    except BaseException:
        RunDir(run_dir, fd, {}, created).release()
        raise


def load_latest(directory: str) -> dict:
    """The newest checkpoint that verifies and loads; the others are named and skipped."""
    candidates = list_checkpoints(directory)
    if not candidates:
        raise UserError(f"--resume: no checkpoint in {directory}: run without --resume to start fresh")
    reasons = []
    for _, path in reversed(candidates):
        try:
            return checkpoint.load_checkpoint(path)
        except ValueError as exc:
            reasons.append(f"{os.path.basename(path)} {exc}")
            print(f"hybridtrain: warning: skipping checkpoint {path}: {exc}", file=sys.stderr)
    raise UserError(f"--resume: no usable checkpoint in {directory} ({len(reasons)} skipped; newest: {reasons[0]}): "
                    f"remove the bad ones and start fresh without --resume")

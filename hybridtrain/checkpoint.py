"""Atomic, verified checkpoints: temp file + fsync + rename, keep the last K, safe loading.

Loading uses ``torch.load(weights_only=True)``: a checkpoint can hold tensors and plain data only, so
a planted pickle cannot run code. A file that fails to load is named and skipped for the previous one.
"""
from __future__ import annotations

import glob
import os
import re
import sys

import torch

from .errors import UserError

PATTERN = "checkpoint-epoch{epoch:04d}.pt"
EPOCH_RE = re.compile(r"checkpoint-epoch(\d+)\.pt$")


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_save(obj, path: str) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as fh:
            torch.save(obj, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
        _fsync_dir(os.path.dirname(os.path.abspath(path)))
    except OSError as exc:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise UserError(f"could not write checkpoint {path} ({exc.strerror or exc}): free disk space or "
                        f"choose another run_dir; the previous checkpoint is intact", same_on_all_ranks=False) from None


def list_checkpoints(directory: str) -> list[tuple[int, str]]:
    found = []
    for path in glob.glob(os.path.join(directory, "checkpoint-epoch*.pt")):
        m = EPOCH_RE.search(path)
        if m:
            found.append((int(m.group(1)), path))
    return sorted(found)


def save_checkpoint(state: dict, directory: str, epoch: int, keep: int) -> str:
    """Write the epoch's checkpoint, then prune old ones (only after the new one is durable)."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, PATTERN.format(epoch=epoch))
    atomic_save(state, path)
    for _, old in list_checkpoints(directory)[:-keep]:
        os.remove(old)
    return path


def load_checkpoint(path: str) -> dict:
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # corrupt, truncated, or holding code: never executed
        raise ValueError(f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}") from None
    if not isinstance(state, dict) or "model" not in state or "epoch" not in state:
        raise ValueError("not a hybridtrain checkpoint (missing 'model' or 'epoch')")
    return state


def load_latest(directory: str) -> dict:
    """The newest checkpoint that loads; unreadable ones are named and skipped."""
    candidates = list_checkpoints(directory)
    if not candidates:
        raise UserError(f"--resume: no checkpoint in {directory}: run without --resume to start fresh")
    for epoch, path in reversed(candidates):
        try:
            return load_checkpoint(path)
        except ValueError as exc:
            print(f"hybridtrain: warning: skipping unreadable checkpoint {path} ({exc})", file=sys.stderr)
    raise UserError(f"--resume: every checkpoint in {directory} is unreadable: start fresh without --resume")

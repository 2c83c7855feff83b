"""What a checkpoint file holds: its bytes (written atomically), its SHA-256 sidecar, its safe loading and its restore.

On disk, ``checkpoint-epochNNNN.pt`` is a plain ``torch.save`` file whose state holds the config fingerprint,
and ``checkpoint-epochNNNN.pt.sha256`` holds its SHA-256 as a ``sha256sum`` line (``sha256sum -c`` checks it).
A save hashes the bytes as they are written to a temp file and fsyncs it, then writes and fsyncs the sidecar's
temp file; only then are both renamed into place (``atomic_save``). Which names are checkpoints, the save of one
into the run folder, the pruning of older ones after the new one is durable and the choice of the newest to load
are rundir.py's.
Loading checks the SHA-256 before anything is unpickled, then uses ``torch.load(weights_only=True)``:
tensors and plain data only, so a planted pickle cannot run code. A checkpoint that fails either check is
named and skipped for the previous one.
"""
from __future__ import annotations

import hashlib
import os
import pickle
import re
import sys
import warnings

import torch

from hybridtrain.errors import UserError
from hybridtrain.files import is_plain_file, refuse_unless_plain
from hybridtrain.optim.optimizers import RUN_CHOICE_KEYS

SHA256SUM_LINE = re.compile(r"^([0-9a-f]{64}) [ *](.+)$")
CHECKSUM_SUFFIX = ".sha256"


def checksum_path(path: str) -> str:
    return path + CHECKSUM_SUFFIX


def _create_new(path: str, mode: str):
    """A new file at ``path``: never follows a symbolic link, never opens an existing file."""
    return open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644), mode)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _HashingWriter:
    """A file for ``torch.save`` that hashes what it writes and keeps the OSError of a failed write
    (torch reports that only as an opaque RuntimeError)."""

    def __init__(self, fh):
        self.fh, self.sha256, self.error = fh, hashlib.sha256(), None

    def write(self, data) -> int:
        try:
            written = self.fh.write(data)
        except OSError as exc:
            self.error = exc
            raise
        self.sha256.update(data)
        return written

    def flush(self) -> None:
        self.fh.flush()


def _fsync(fh) -> None:
    fh.flush()
    os.fsync(fh.fileno())


def _save_hashed(obj, path: str) -> str:
    """torch.save ``obj`` to ``path`` and fsync it; returns the SHA-256 of the bytes written."""
    with _create_new(path, "wb") as fh:
        writer = _HashingWriter(fh)
        try:
            torch.save(obj, writer)
        except RuntimeError:
            if writer.error is not None:
                raise writer.error from None
            raise
        _fsync(fh)
    return writer.sha256.hexdigest()


def atomic_save(obj, path: str) -> None:
    """Write ``obj`` to ``path`` and its SHA-256 to ``path.sha256``, both durable in temp files before either is
    renamed. Over an older pair, its ``.sha256`` goes first, then the new ``path``, then the new sum: a kill between
    two of these leaves a whole file without its sum (loaded with a warning), never one beside another's sum.

    A failed write (full disk, file-size limit) removes the temp files and leaves an older checkpoint intact.
    """
    directory = os.path.dirname(os.path.abspath(path))
    tmp, tmp_sum = f"{path}.tmp-{os.getpid()}", f"{checksum_path(path)}.tmp-{os.getpid()}"
    for own in (path, checksum_path(path), tmp, tmp_sum):
        refuse_unless_plain(own)
    for leftover in (tmp, tmp_sum):  # a save of an earlier process with this pid, killed mid-write
        if os.path.lexists(leftover):
            os.remove(leftover)
    try:
        digest = _save_hashed(obj, tmp)
        with _create_new(tmp_sum, "w") as fh:  # path's sha256sum line, fsynced
            fh.write(f"{digest}  {os.path.basename(path)}\n")
            _fsync(fh)
        if os.path.lexists(checksum_path(path)):
            os.remove(checksum_path(path))
        os.replace(tmp, path)
        os.replace(tmp_sum, checksum_path(path))
        _fsync_dir(directory)
    except OSError as exc:
        for leftover in (tmp, tmp_sum):
            if is_plain_file(leftover):
                os.remove(leftover)
        raise UserError(f"could not write checkpoint {path} ({exc.strerror or exc}): free disk space or "
                        f"choose another run_dir; the previous checkpoint is intact", same_on_all_ranks=False) from None


def file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def verify_checksum(path: str) -> bool:
    """True when ``path`` matches its sidecar, False when it has none; ValueError when it does not match."""
    sidecar = checksum_path(path)
    if not os.path.exists(sidecar):
        return False
    with open(sidecar, "rb") as fh:
        m = SHA256SUM_LINE.match(fh.read(4096).decode(errors="replace").strip())
    if not m:
        raise ValueError(f"its checksum file {os.path.basename(sidecar)} is not a sha256sum line")
    if file_sha256(path) != m.group(1):
        raise ValueError(f"corrupted or truncated: its SHA-256 does not match {os.path.basename(sidecar)}")
    return True


def _refusal(exc: pickle.UnpicklingError) -> str:
    """What weights_only refused, e.g. 'unsupported GLOBAL posix.system whose module posix is blocked'."""
    detail = next((line.strip() for line in str(exc).splitlines()
                   if line.strip().startswith(("Trying to load", "Unsupported"))), "")
    detail = detail.removeprefix("Trying to load ").rstrip(".")
    return (f"refused: it holds more than tensors and plain data ({detail[:160] or 'not a weights-only pickle'}); "
            f"nothing in it was run")


def load_verified(path: str):
    """What ``path`` holds (a checkpoint, or final_model.pt's bare weights), its SHA-256 checked first and then
    loaded weights-only; ValueError saying why when it is unusable."""
    if not verify_checksum(path):
        print(f"hybridtrain: warning: {path} has no {os.path.basename(checksum_path(path))}: its integrity "
              f"cannot be verified (copy the .sha256 file along with a checkpoint)", file=sys.stderr)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # e.g. "Detected pickle protocol 4": the refusal below says enough
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # corrupt or truncated without a sidecar: never executed
        if isinstance(exc, pickle.UnpicklingError) and "weights only" in str(exc).lower():
            raise ValueError(_refusal(exc)) from None
        raise ValueError(f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}") from None
    return state


def load_checkpoint(path: str) -> dict:
    """The verified, weights-only state of ``path``; ValueError saying why when it is unusable."""
    state = load_verified(path)
    if not isinstance(state, dict) or "model" not in state or "epoch" not in state:
        raise ValueError("not a hybridtrain checkpoint (missing 'model' or 'epoch')")
    return state


def _model_mismatch(model: torch.nn.Module, saved: dict) -> str:
    own = model.state_dict()
    for key, tensor in saved.items():
        if key in own and tuple(own[key].shape) != tuple(tensor.shape):
            return f"{key} is {list(tensor.shape)} in the checkpoint but {list(own[key].shape)} in this model"
    missing, extra = sorted(own.keys() - saved.keys()), sorted(saved.keys() - own.keys())
    if missing:
        return f"the checkpoint lacks {len(missing)} of this model's tensors, e.g. {missing[0]}"
    if extra:
        return f"the checkpoint has {len(extra)} tensors this model lacks, e.g. {extra[0]}"
    return "the tensors differ"


def _optimizer_mismatch(optimizer: torch.optim.Optimizer, saved: dict) -> str:
    """Why the saved optimizer state cannot drive ``optimizer`` ('' when it can): load_state_dict would take
    the saved hyperparameters as they are, and a missing one fails only at the first step."""
    groups = saved.get("param_groups", [])
    if len(groups) != len(optimizer.param_groups):
        return f"{len(groups)} parameter groups in the checkpoint, {len(optimizer.param_groups)} here"
    for own, theirs in zip(optimizer.param_groups, groups):
        missing = sorted(set(own) - set(theirs) - set(RUN_CHOICE_KEYS))  # those the optimizer keeps from this run
        if missing:
            more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
            return f"its parameter groups lack {', '.join(missing[:3])}{more}"
    return ""


def restore(state: dict, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Load a checkpoint's model and optimizer state; one error line when it was made for another model,
    class count or optimizer."""
    saved = state.get("config", {})
    trained = (f"it was trained with model.arch={saved.get('model', {}).get('arch', '?')} and "
               f"optim.name={saved.get('optim', {}).get('name', '?')}")
    hint = "resume with the recipe and data it was trained with, or start fresh in another run_dir"
    try:
        model.load_state_dict(state["model"])  # copies into the parameters wherever they live
    except RuntimeError:
        raise UserError(f"--resume: the checkpoint of epoch {state['epoch'] + 1} does not fit this model: "
                        f"{_model_mismatch(model, state['model'])}; {trained}: {hint}") from None
    mismatch = _optimizer_mismatch(optimizer, state["optimizer"])
    if not mismatch:
        try:
            optimizer.load_state_dict(state["optimizer"])
        except (KeyError, ValueError, RuntimeError, IndexError, TypeError) as exc:
            mismatch = f"{type(exc).__name__}: {str(exc)[:80]}"
    if mismatch:
        raise UserError(f"--resume: the checkpoint's optimizer state does not fit this optimizer ({mismatch}); "
                        f"{trained}: {hint}")

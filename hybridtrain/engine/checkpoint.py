"""Verified checkpoints: SHA-256 sidecar, temp file + fsync + rename, keep the last K, safe loading.

On disk, ``checkpoint-epochNNNN.pt`` is a plain ``torch.save`` file whose state holds the config fingerprint,
and ``checkpoint-epochNNNN.pt.sha256`` holds its SHA-256 as a ``sha256sum`` line (``sha256sum -c`` checks it).
A save hashes the bytes as they are written to a temp file and fsyncs it, then writes and fsyncs the sidecar.
Only then is the temp file renamed into place. Older checkpoints are pruned after the new one is durable.
Loading checks the SHA-256 before anything is unpickled, then uses ``torch.load(weights_only=True)``:
tensors and plain data only, so a planted pickle cannot run code. A checkpoint that fails either check is
named and skipped for the previous one.
"""
from __future__ import annotations

import glob
import hashlib
import os
import pickle
import re
import sys
import warnings

import torch

from hybridtrain.errors import UserError
from hybridtrain.optim.optimizers import RUN_CHOICE_KEYS

PATTERN = "checkpoint-epoch{epoch:04d}.pt"
STOPPED_PATTERN = "checkpoint-epoch{epoch:04d}-step{step:06d}.pt"  # a preempted epoch, after ``step`` steps
EPOCH_RE = re.compile(r"checkpoint-epoch(\d+)(?:-step(\d+))?\.pt$")
NAME_RE = re.compile(r"checkpoint-epoch\d+(?:-step\d+)?\.pt")  # the whole name of a checkpoint this code writes
TEMP_RE = re.compile(r"(?:checkpoint-epoch\d+(?:-step\d+)?\.pt(?:\.sha256)?|run\.json)\.tmp-\d+")  # a save's temp
WHOLE_EPOCH = 1 << 30  # sorts a finished epoch after every stopped checkpoint of the same epoch
CHECKSUM_SUFFIX = ".sha256"
MARKER_NAME = "run.json"
SHA256SUM_LINE = re.compile(r"^([0-9a-f]{64}) [ *](.+)$")


def checksum_path(path: str) -> str:
    return path + CHECKSUM_SUFFIX


def is_own_name(name: str) -> bool:
    """True for a bare checkpoint file name this code writes (never a path: run.json's names are data)."""
    return isinstance(name, str) and NAME_RE.fullmatch(name) is not None


def is_run_file_name(name: str) -> bool:
    """A checkpoint's name, its sidecar's, or a save's temp file's: the checkpoint-epoch* files a run writes."""
    base = name[:-len(CHECKSUM_SUFFIX)] if name.endswith(CHECKSUM_SUFFIX) else name
    return is_own_name(base) or TEMP_RE.fullmatch(name) is not None


def is_plain_file(path: str) -> bool:
    """A regular file that is not a symbolic link: the only kind of file a run replaces or removes."""
    return os.path.isfile(path) and not os.path.islink(path)


def refuse_unless_plain(path: str) -> None:
    """One line when ``path`` exists as a symbolic link, a folder or another non-file: a run never writes through
    or removes what is not its own plain file."""
    if os.path.lexists(path) and not is_plain_file(path):
        kind = ("a symbolic link" + ("" if os.path.exists(path) else " that points nowhere")
                if os.path.islink(path) else "a folder" if os.path.isdir(path) else "not a regular file")
        raise UserError(f"{path} is {kind}, where the run keeps its own file: hybridtrain never writes through or "
                        f"removes it: move it out of the run_dir, or choose another run_dir", same_on_all_ranks=False)


def _create_new(path: str, mode: str):
    """A new file at ``path``: never follows a symbolic link, never opens an existing file."""
    return open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644), mode)


def remove_stale_temp_files(directory: str) -> list[str]:
    """Remove the temp files of saves that were killed mid-write (plain files named as a save names them); only
    the holder of the run_dir's lock calls this, so no save of this run is under way. Returns their names."""
    removed = []
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        if TEMP_RE.fullmatch(name) and is_plain_file(path):
            os.remove(path)
            removed.append(name)
    return removed


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


def _write_checksum(path: str, digest: str, tmp: str) -> None:
    """``path.sha256`` as a sha256sum line, through ``tmp`` + fsync + rename."""
    with _create_new(tmp, "w") as fh:
        fh.write(f"{digest}  {os.path.basename(path)}\n")
        _fsync(fh)
    os.replace(tmp, checksum_path(path))


def atomic_save(obj, path: str) -> None:
    """Write ``obj`` to ``path`` and its SHA-256 to ``path.sha256``; ``path`` appears only once both are durable.

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
        _write_checksum(path, digest, tmp_sum)
        _fsync_dir(directory)
        os.replace(tmp, path)
        _fsync_dir(directory)
    except OSError as exc:
        for leftover in (tmp, tmp_sum):
            if is_plain_file(leftover):
                os.remove(leftover)
        raise UserError(f"could not write checkpoint {path} ({exc.strerror or exc}): free disk space or "
                        f"choose another run_dir; the previous checkpoint is intact", same_on_all_ranks=False) from None


def list_checkpoints(directory: str) -> list[tuple[tuple[int, int], str]]:
    """((epoch, step), path), oldest first; a finished epoch's step is WHOLE_EPOCH."""
    found = []
    for path in glob.glob(os.path.join(glob.escape(directory), "checkpoint-epoch*.pt")):
        m = EPOCH_RE.search(path)
        if m and is_own_name(os.path.basename(path)):
            found.append(((int(m.group(1)), int(m.group(2)) if m.group(2) else WHOLE_EPOCH), path))
    return sorted(found)


def _prune(directory: str, keep: int) -> None:
    """Remove all but the newest ``keep`` checkpoints, their sidecars, orphaned sidecars and the temp files
    a killed save left behind."""
    for _, old in list_checkpoints(directory)[:-keep]:
        for path in (old, checksum_path(old)):
            if is_plain_file(path):
                os.remove(path)
    remove_stale_temp_files(directory)
    for sidecar in glob.glob(os.path.join(glob.escape(directory), f"checkpoint-epoch*.pt{CHECKSUM_SUFFIX}")):
        if (is_own_name(os.path.basename(sidecar)[:-len(CHECKSUM_SUFFIX)]) and is_plain_file(sidecar)
                and not os.path.lexists(sidecar[:-len(CHECKSUM_SUFFIX)])):
            os.remove(sidecar)


def _prune_owned(owner, keep: int) -> None:
    """Remove all but the newest ``keep`` of the checkpoints this run wrote (``owner``: rundir.RunDir); files
    of other runs or of the user are never considered. The names come from run.json, so they are data: only a bare
    checkpoint name (no folder) is ever joined to run_dir, and only a plain file (no link, no folder) removed."""
    ordered = sorted((n for n in owner.checkpoints() if is_own_name(n)), key=lambda n: _order(EPOCH_RE.search(n)))
    for name in [n for n in owner.checkpoints() if not is_own_name(n)]:
        print(f"hybridtrain: warning: {os.path.join(owner.path, MARKER_NAME)} lists {name!r}, which is not a "
              f"checkpoint name of this run: ignored (nothing outside the run's own files is removed)",
              file=sys.stderr)
        owner.forget_checkpoint(name)
    for name in ordered[:-keep]:
        for path in (os.path.join(owner.path, name), checksum_path(os.path.join(owner.path, name))):
            if is_plain_file(path):
                os.remove(path)
        owner.forget_checkpoint(name)


def _order(match) -> tuple[int, int]:
    return (int(match.group(1)), int(match.group(2)) if match.group(2) else WHOLE_EPOCH) if match else (0, 0)


def save_checkpoint(state: dict, directory: str, epoch: int, keep: int, step: int | None = None,
                    owner=None) -> str:
    """Write the epoch's checkpoint (a stopped one when ``step`` is given), then prune old ones (only after
    the new one is durable): those ``owner`` (the run's rundir.RunDir) wrote, or without one every checkpoint
    in ``directory``."""
    os.makedirs(directory, exist_ok=True)
    name = PATTERN.format(epoch=epoch) if step is None else STOPPED_PATTERN.format(epoch=epoch, step=step)
    path = os.path.join(directory, name)
    atomic_save(state, path)
    if owner is None:
        _prune(directory, keep)
    else:
        owner.add_checkpoint(name)
        _prune_owned(owner, keep)
    return path


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


def load_checkpoint(path: str) -> dict:
    """The verified, weights-only state of ``path``; ValueError saying why when it is unusable."""
    if not verify_checksum(path):
        print(f"hybridtrain: warning: {path} has no {os.path.basename(checksum_path(path))}: its integrity "
              f"cannot be verified (copy the .sha256 file along with a checkpoint)", file=sys.stderr)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # e.g. "Detected pickle protocol 4": the refusal below says enough
            state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        if "weights only" in str(exc).lower():
            raise ValueError(_refusal(exc)) from None
        raise ValueError(f"UnpicklingError: {str(exc).splitlines()[0][:160]}") from None
    except Exception as exc:  # corrupt or truncated without a sidecar: never executed
        raise ValueError(f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}") from None
    if not isinstance(state, dict) or "model" not in state or "epoch" not in state:
        raise ValueError("not a hybridtrain checkpoint (missing 'model' or 'epoch')")
    return state


def load_latest(directory: str) -> dict:
    """The newest checkpoint that verifies and loads; the others are named and skipped."""
    candidates = list_checkpoints(directory)
    if not candidates:
        raise UserError(f"--resume: no checkpoint in {directory}: run without --resume to start fresh")
    reasons = []
    for _, path in reversed(candidates):
        try:
            return load_checkpoint(path)
        except ValueError as exc:
            reasons.append(f"{os.path.basename(path)} {exc}")
            print(f"hybridtrain: warning: skipping checkpoint {path}: {exc}", file=sys.stderr)
    raise UserError(f"--resume: no usable checkpoint in {directory} ({len(reasons)} skipped; newest: {reasons[0]}): "
                    f"remove the bad ones and start fresh without --resume")


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

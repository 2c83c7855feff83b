"""Every file the package writes, and the paths the commands take: checked before any work starts, written
atomically (:func:`atomic_path`, :func:`replace_file` and the writers on them; a run's metrics lines by
:func:`append_json_line`), never through a link (:func:`refuse_unless_plain`).

Each command checks its output options at its top, so a bad path costs one line (``hybridtrain: error:``, exit 2)
before minutes of benchmarking or data checking, never a traceback after them. The rules, the same everywhere:

- An output **file** (``bench --json``, ``predict --out``, ``check-data --report``, ``report --out``,
  ``plot-schedule --out``) goes into a folder that exists. A missing folder is an error naming it, with the
  ``mkdir -p`` that fixes it, not created silently: a typo in a folder name is caught at once, as a shell's ``>``
  does. A path that is a folder, or a read-only file, is refused too. The file is written to a temp file in the
  same folder and renamed over the target (``os.replace``), so an interrupted write leaves the previous file or
  nothing, never half a file.
- An output **folder** (``check-data --write-filelist``, ``scale --out``, ``experiment --out``, ``bench --profile``,
  ``prepare-data --out``, ``reorganise-val --out``) is created with its missing parents, as ``mkdir -p`` would (the
  defaults ``runs/scale`` and ``runs/experiments`` need that). A path that is a file, lies under a file, or under a
  folder this user cannot write is refused.
- A path that starts with ``~`` or holds a ``$VAR`` and does not exist was not expanded by a shell (quoted, or
  ``--out=~/x``): refused with the path the shell would have meant, rather than creating a folder named ``~``. The
  config's path keys follow the same rule (:func:`not_expanded`).
- Tools delete only what they created: a half-written dataset lives in ``OUT.partial/``, marked by
  :data:`PARTIAL_MARKER` before anything else is written, and only a marked folder is ever removed.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import tempfile

from hybridtrain.errors import UserError, dangling_link

PARTIAL_MARKER = ".hybridtrain-partial"


def _given(path: str | None, option: str, kind: str) -> str:
    if path is None or not str(path).strip():
        raise UserError(f"{option} is empty: give a {kind} path")
    return str(path)


SHELL_VARIABLE = re.compile(r"\$(?:\{[A-Za-z_][A-Za-z0-9_]*[^}]*\}|[A-Za-z_][A-Za-z0-9_]*)")


def not_expanded(path: str, option: str) -> None:
    """A leading '~' or a $VAR or ${VAR} that no shell expanded (a quoted argument, ``--out=~/x``, a recipe's value):
    hybridtrain takes paths as written, so '~/x' would be a folder named '~' and '${SCRATCH}/run' one named
    '${SCRATCH}'. ``option``: a command-line option (``--out``) or a config key (``data.path``)."""
    if os.path.exists(path):
        return
    key = not option.startswith("-")
    given = f"{option}={path}" if key else f"{option} {path}"
    if path.startswith("~"):
        expanded = os.path.expanduser(path)
        fix = (f"write the path without ~ (e.g. {expanded}) or use $HOME in a --set on the command line" if key else
               f"write {option} {expanded} (or ~ unquoted, after a space)")
        raise UserError(f"{given} starts with '~', which only a shell expands: {fix}")
    variable = SHELL_VARIABLE.search(path)
    if variable:
        name = variable.group(0).strip("${}").split(":")[0].split("-")[0]
        now = os.environ.get(name)
        value = f"; ${name} is {now} here" if now is not None else f"; ${name} is not set here"
        where, fix = (("a recipe and a quoted --set are", f"--set {option}=...") if key else
                      ("a quoted argument is", f"{option} ..."))
        raise UserError(f"{given} holds {variable.group(0)}, which only a shell expands ({where} read as written"
                        f"{value}): write the path itself, or pass {fix} unquoted or in double quotes so that the "
                        f"shell expands it")


def nearest_existing(path: str) -> str:
    """``path`` itself when it exists, else its closest existing ancestor (absolute)."""
    current = os.path.abspath(path)
    while not os.path.lexists(current):
        current = os.path.dirname(current)
    return current


def check_output_file(path: str | None, option: str, example: str = "out.json") -> str:
    """The path of an output file, checked before any work: its folder exists and is writable, the path is not a
    folder, and an existing file there may be replaced. ``example``: a file name for the fix. Returns ``path``."""
    path = _given(path, option, "file")
    not_expanded(path, option)
    if os.path.isdir(path):
        raise UserError(f"{option} {path} is a folder, not a file: name a file in it, e.g. {option} "
                        f"{os.path.join(path, example)}")
    refuse_dangling(path, option)
    folder = os.path.dirname(os.path.normpath(path)) or "."  # as the user would name it ('.' for a bare file name)
    if not os.path.exists(folder):
        ancestor = nearest_existing(folder)
        if not os.path.isdir(ancestor):
            raise UserError(f"{option} {path}: {ancestor} is a file, so no folder can be made under it: choose "
                            f"another path")
        raise UserError(f"{option} {path}: the folder {folder} does not exist: create it (mkdir -p {folder}) or "
                        f"choose another path")
    if not os.path.isdir(folder):
        raise UserError(f"{option} {path}: {folder} is a file, not a folder: choose another path")
    if not_writable(folder):
        raise UserError(f"{option} {path}: the folder {not_writable(folder)}")
    if os.path.lexists(path) and not os.path.isfile(path):
        raise UserError(f"{option} {path} exists and is not a regular file: choose another path")
    if os.path.isfile(path) and not os.access(path, os.W_OK):
        raise UserError(f"{option} {path} is read-only, so it is not replaced: choose another path, or make it "
                        f"writable (chmod u+w {path})")
    return path


def check_output_dir(path: str | None, option: str) -> str:
    """The path of an output folder, checked before any work: not a file, not under a file, and writable where it
    exists or where it will be created (with its missing parents). Nothing is created here. Returns ``path``."""
    path = _given(path, option, "folder")
    not_expanded(path, option)
    refuse_dangling(path, option)
    if os.path.lexists(path) and not os.path.isdir(path):
        raise UserError(f"{option} {path} is a file, not a folder: choose a folder (it is created when missing)")
    ancestor = nearest_existing(path)
    if not os.path.isdir(ancestor):
        raise UserError(f"{option} {path}: {ancestor} is a file, so the folder cannot be created under it: choose "
                        f"another path")
    if not_writable(ancestor):
        where = "" if os.path.exists(path) else f" (the folder would be created in {ancestor})"
        raise UserError(f"{option} {path} cannot be written{where}: {not_writable(ancestor)}")
    return path


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


def refuse_dangling(path: str, option: str) -> None:
    """One line when ``path``, or a folder on its way, is a symbolic link to nothing (an unmounted disk, a moved
    folder): the link is what to fix, not the path."""
    link = dangling_link(path)
    if link is not None:
        raise UserError(f"{option} {path}: {link} is a symbolic link to {os.readlink(link)}, which does not exist "
                        f"(a link to a missing folder: an unmounted disk or a moved folder?): fix or remove the link, "
                        f"or choose another path")


def not_writable(folder: str) -> str:
    """'' when this process may create files in ``folder``, else why not and the fix, starting with the folder: a
    read-only file system (which refuses root too, so it is not a matter of permissions), or its permissions."""
    if os.access(folder, os.W_OK | os.X_OK):
        return ""
    try:
        read_only = bool(os.statvfs(folder).f_flag & os.ST_RDONLY)
    except OSError:
        read_only = False
    if read_only:
        return (f"{folder} is on a read-only file system: choose a folder on a writable one, or remount it "
                f"read-write")
    return f"{folder} is not writable by this user: choose another folder, or fix its permissions"


def check_input_dir(path: str | None, option: str, fix: str = "") -> str:
    """A folder the command reads: one line when it is missing, a file, or a '~' no shell expanded."""
    return check_input_file(path, option, fix, folder=True)


def check_input_file(path: str | None, option: str, fix: str = "", folder: bool = False) -> str:
    """A file (``folder``: a folder) the command reads: one line when it is missing, a folder (a file), or a '~' no
    shell expanded."""
    kind, other = ("folder", "file") if folder else ("file", "folder")
    path = _given(path, option, kind)
    not_expanded(path, option)
    if not os.path.exists(path):
        raise UserError(f"{option} {path} does not exist" + (f": {fix}" if fix else ": check the path"))
    if os.path.isdir(path) != folder:
        raise UserError(f"{option} {path} is a {other}, not a {kind}" + (f": {fix}" if fix else f": give the {kind}"))
    return path


# ----------------------------------------------------------------------------- written atomically

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
    killed mid-write. Every text file the package writes goes through it (:func:`write_text_atomically` adds the
    one-line error; the guard's crash log and torchrun's error file, launched_by, take the OSError themselves)."""
    with atomic_path(path) as tmp, open(tmp, "w") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    return path


def write_text_atomically(path: str, text: str) -> str:
    """``text`` into ``path`` through a temp file in the same folder, fsynced, then renamed over it."""
    try:
        replace_file(path, text)
    except OSError as exc:
        raise UserError(f"could not write {path} ({exc.strerror or exc}): free space or choose another path") from None
    return path


def write_json_atomically(path: str, obj, indent: int = 1) -> str:
    return write_text_atomically(path, json.dumps(obj, indent=indent) + "\n")


def append_json_line(path: str, obj) -> None:
    """``obj`` as one JSON line at the end of ``path`` (metrics.jsonl, the sample audit), in one write() of a file
    opened O_APPEND and never through a link: a kill leaves the line whole or absent, whatever Python's buffering
    would have done with it."""
    data = (json.dumps(obj) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o666)
    try:
        while data:  # one call in practice: Linux writes a regular file's bytes whole below 2 GiB
            data = data[os.write(fd, data):]
    finally:
        os.close(fd)


# ----------------------------------------------------------------------------- OUT.partial of the data tools

def start_partial(out: str, option: str = "--out") -> str:
    """``OUT.partial/``, fresh and marked as this tool's. One left by a run that died half-way (it holds the
    marker) is removed first; anything else at that path is the user's and is refused, never deleted."""
    tmp = os.path.normpath(out) + ".partial"
    if os.path.lexists(tmp):
        if os.path.isdir(tmp) and not os.path.islink(tmp) and os.path.isfile(os.path.join(tmp, PARTIAL_MARKER)):
            shutil.rmtree(tmp)  # ours: a previous run that died half-way
        else:
            raise UserError(f"{tmp} exists and was not left by hybridtrain (no {PARTIAL_MARKER} in it), so it is not "
                            f"deleted: move or remove it yourself, or choose another {option}")
    os.makedirs(tmp)
    with open(os.path.join(tmp, PARTIAL_MARKER), "w") as fh:
        fh.write("written by hybridtrain while it prepares the folder next to this one; safe to delete\n")
    return tmp


def finish_partial(tmp: str, out: str) -> None:
    """Unmark the finished ``OUT.partial/`` and move it into place in one rename (``out``: absent or empty)."""
    os.unlink(os.path.join(tmp, PARTIAL_MARKER))
    if os.path.isdir(out):
        os.rmdir(out)  # empty: checked by the caller
    os.replace(tmp, out)


def check_image_format(path: str, option: str) -> None:
    """A plot's file extension must be one matplotlib writes (none: PNG)."""
    ext = os.path.splitext(path)[1].lower().lstrip(".")
    if not ext:
        return
    from matplotlib.backend_bases import FigureCanvasBase
    formats = FigureCanvasBase.get_supported_filetypes()
    if ext not in formats:
        raise UserError(f"{option} {path}: matplotlib cannot write .{ext} files: end the name in .png (or one of "
                        f".{', .'.join(sorted(formats))})")


# ----------------------------------------------------------------------------- figures

def figure(width: float, height: float):
    """A matplotlib Figure drawn off screen (Agg; no display, no pyplot state), for ``save_figure``."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    fig = Figure(figsize=(width, height))
    FigureCanvasAgg(fig)
    return fig


def save_figure(fig, path: str, dpi: int = 100) -> str:
    """The PNG, written atomically (the previous file or the new one, never half of one)."""
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=dpi, bbox_inches="tight", format="png")
    return path

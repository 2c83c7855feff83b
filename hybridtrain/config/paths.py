"""The path keys on this machine: each key a command uses is checked, in one place, to be the kind of thing it
must be (a readable dataset folder, a writable run folder, ...) before any work starts."""
from __future__ import annotations

import os

from hybridtrain.config.coercion import show
from hybridtrain.config.sections import Config
from hybridtrain.errors import UserError, dangling_link
from hybridtrain.files import nearest_existing, not_expanded, not_writable

# Which path keys each command uses: "data" (data.path, data.file_lists: read), "run_dir" (written),
# "horovod" (horovod.autotune_log: written by Horovod's rank 0).
PATH_USES = {"train": ("data", "run_dir", "horovod"), "experiment": ("data", "horovod"), "bench": ("horovod",),
             "scale": ("horovod",), "plot-schedule": ()}


def check_paths(cfg: Config, for_command: str) -> None:
    """Check, in one place, that each path key ``for_command`` uses is the kind of thing it must be on this machine:
    one line naming the key and a fix that works. data.path only where data is read (not for the synthetic backend)."""
    uses = PATH_USES[for_command]
    for key, value in (("data.path", cfg.data.path), ("data.file_lists", cfg.data.file_lists),
                       ("run_dir", cfg.run_dir), ("horovod.autotune_log", cfg.horovod.autotune_log)):
        if not value.isprintable():
            raise UserError(f"{key}={show(value)} holds a control character (a newline, tab or the like): write the "
                            f"path without it")
    if "data" in uses and cfg.data.backend != "synthetic":
        _check_data_path(cfg.data.path)
        if cfg.data.file_lists:
            _check_file_lists(cfg.data.file_lists, cfg.data.path)
    if "run_dir" in uses:
        check_run_dir(cfg.run_dir)
    if "horovod" in uses and cfg.horovod.autotune_log:
        _check_autotune_log(cfg.horovod.autotune_log)


def _check_data_path(path: str) -> None:
    if not path.strip():
        raise UserError("data.path is empty: set it to the dataset folder holding train/<class>/*.jpg and "
                        "val/<class>/*.jpg, e.g. --set data.path=data/digits")
    not_expanded(path, "data.path")
    not_dangling("data.path", path)
    if not os.path.exists(path):
        raise UserError(f"data directory not found: {path} (set data.path, or create it with "
                        f"'hybridtrain prepare-data digits --out {path}')")
    if not os.path.isdir(path):
        raise UserError(f"data.path={path} is a file, not a folder: set data.path to the dataset folder holding "
                        f"train/<class>/*.jpg and val/<class>/*.jpg")
    if not os.access(path, os.R_OK | os.X_OK):
        raise UserError(f"data.path={path} cannot be read by this user: fix its permissions (chmod -R a+rX)")


def _check_file_lists(folder: str, data_path: str) -> None:
    not_expanded(folder, "data.file_lists")
    fix = f"run 'hybridtrain check-data {data_path} --write-filelist {folder}'"
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise UserError(f"data.file_lists={folder} is a file, not a folder: give the folder holding train.txt and "
                        f"val.txt, or {fix}")
    for split in ("train", "val"):
        if not os.path.isfile(os.path.join(folder, f"{split}.txt")):
            raise UserError(f"data.file_lists={folder} has no {split}.txt: {fix}")


def not_dangling(key: str, path: str) -> None:
    """One line when ``path``, or a folder on its way, is a symbolic link to nothing (an unmounted disk, a moved
    dataset): the link is what to fix, not the path."""
    link = dangling_link(path)
    if link is not None:
        raise UserError(f"{key}={path}: {link} is a symbolic link to {os.readlink(link)}, which does not exist (an "
                        f"unmounted disk or a moved folder?): fix or remove the link")


def check_run_dir(run_dir: str) -> None:
    """One line when ``run_dir`` cannot hold a run: empty, '~', a file, or under a folder this user cannot write."""
    if not run_dir.strip():
        raise UserError("run_dir is empty: set it to a folder for checkpoints and metrics, e.g. --set run_dir=runs/x")
    not_expanded(run_dir, "run_dir")
    not_dangling("run_dir", run_dir)
    if os.path.exists(run_dir) and not os.path.isdir(run_dir):
        raise UserError(f"run_dir {run_dir} is a file, not a folder: choose another run_dir")
    parent = nearest_existing(run_dir)  # no link on the way is dangling (not_dangling), so exists and lexists agree
    if not os.path.isdir(parent):
        raise UserError(f"run_dir {run_dir} cannot be written ({parent} is a file): choose another run_dir")
    if not_writable(parent):
        raise UserError(f"run_dir {run_dir} cannot be written: {not_writable(parent)}")


def _check_autotune_log(log: str) -> None:
    not_expanded(log, "horovod.autotune_log")
    if os.path.isdir(log):
        raise UserError(f"horovod.autotune_log={log} is a folder: name a CSV file in it, e.g. "
                        f"{os.path.join(log, 'autotune.csv')}")
    folder = os.path.dirname(os.path.abspath(log))
    if not os.path.isdir(folder):
        raise UserError(f"horovod.autotune_log={log}: its folder {folder} does not exist: create it "
                        f"(mkdir -p {folder}) or choose another path")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise UserError(f"horovod.autotune_log={log}: its folder {folder} is not writable: choose another path")

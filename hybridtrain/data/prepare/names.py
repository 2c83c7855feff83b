"""Names and paths from a source are untrusted: an archive's member names, a devkit's WNIDs, a label file's classes.

Every such name becomes a folder or file name under ``--out`` only after :func:`unsafe_name` (one path component)
or :func:`unsafe_member` (a member path that stays in its archive) found nothing wrong with it, checked before any
work, whether or not md5 is checked; and every folder is made through :func:`makedirs_inside`, which checks by its
real path that it lands under ``--out`` (a symbolic link already inside ``--out`` cannot lead a write outside it).
Files are written through a new temporary name (``O_EXCL``: never through a link) and renamed (a rename replaces a
link, never follows it).
"""
from __future__ import annotations

import os
import posixpath

from hybridtrain.errors import UserError


def unsafe_name(name: str) -> str:
    """Why ``name`` cannot be one folder or file name directly under a folder ('' when it can)."""
    if not name:
        return "is empty"
    if os.path.isabs(name) or name.startswith(("/", "\\")):
        return "is an absolute path"
    if name in (".", ".."):
        return f"is '{name}'"
    if "/" in name or "\\" in name:
        return "holds a path separator"
    if any(ord(c) < 32 for c in name):
        return "holds a control character"
    return ""


def unsafe_member(path: str) -> str:
    """Why the member path ``path`` of an archive leaves its archive's folder or names no file ('' when it is a
    relative path without '..' whose last part is a file name)."""
    if path.startswith(("/", "\\")):
        return "is an absolute path"
    if ".." in path.replace("\\", "/").split("/"):
        return "climbs out of its folder with '..'"
    return unsafe_name(posixpath.basename(path))


def refuse_member(archive: str, member, kinds: str = "files") -> None:
    """One line naming ``member`` of ``archive`` when it is a link or device, or its name would leave --out."""
    what = ("a symbolic link" if member.issym() else "a hard link" if member.islnk() else
            "not a regular file" if not (member.isfile() or member.isdir()) else "")
    if what:
        target = f" (to {member.linkname})" if member.issym() or member.islnk() else ""
        raise UserError(f"{archive}: its member {member.name!r} is {what}{target}; an ImageNet archive holds only "
                        f"{kinds}, and a link is never followed: refused, nothing written from it (a crafted or "
                        f"re-packed archive? download the original)")
    problem = unsafe_member(member.name)
    if problem:
        raise UserError(f"{archive}: its member {member.name[:120]!r} {problem}, so it could be written outside "
                        f"--out: refused, nothing written from it (a crafted or damaged archive? download the "
                        f"original)")


def inside(out: str, path: str) -> str:
    """``path``, or one line when its real path (symbolic links followed) is not under ``out``'s."""
    real, top = os.path.realpath(path), os.path.realpath(out)
    if os.path.commonpath([real, top]) != top:
        raise UserError(f"{path} leads to {real}, outside --out {out} (a symbolic link inside --out): nothing is "
                        f"written outside --out: remove the link, or give a new folder as --out")
    return path


def makedirs_inside(out: str, path: str) -> str:
    os.makedirs(inside(out, path), exist_ok=True)
    return path

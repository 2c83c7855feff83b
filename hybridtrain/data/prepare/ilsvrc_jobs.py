"""One job of ``prepare-data imagenet`` in a worker process: read its images (from an archive at an offset, or from
files), make each an 8-bit RGB JPEG (optionally resized), and write it under ``OUT/<split>/<wnid>/``.

Every image is written under a hidden temporary name in its class folder and renamed into place, so the trainer
never sees a half-written image. A job that finishes records itself in ``OUT/.hybridtrain-prepare/done/`` with
its count and the files it rewrote; a run that was killed redoes only the jobs without that record.
"""
from __future__ import annotations

import io
import json
import os
import tarfile

from PIL import Image

from hybridtrain.data.images import UnsupportedImage, to_rgb
from hybridtrain.data.prepare.ilsvrc import Job
from hybridtrain.data.prepare.names import makedirs_inside, refuse_member
from hybridtrain.errors import UserError

STATE = ".hybridtrain-prepare"
REWRITE_QUALITY = 95  # a PNG or CMYK file rewritten at its own size
RESIZE_QUALITY = 90  # the resized copies (what the fast ImageNet recipes use)


def done_path(out: str, job: Job) -> str:
    return os.path.join(out, STATE, "done", f"{job.name}.json")


def read_json(path: str):
    """The JSON in ``path``, or None when it cannot be read (absent, cut short by a kill)."""
    try:
        with open(path) as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return None


def output_name(name: str) -> str:
    """The output file name: the source's, with a JPEG extension."""
    stem, ext = os.path.splitext(os.path.basename(name))
    return name if ext.lower() in (".jpeg", ".jpg") else stem + ".JPEG"


def as_rgb_jpeg(data: bytes, resize: int | None) -> tuple[bytes, str]:
    """(the image as an 8-bit RGB JPEG, why it was rewritten: '' when the bytes are kept as they are)."""
    with Image.open(io.BytesIO(data)) as img:
        why = "" if img.format == "JPEG" and img.mode == "RGB" else f"{img.format} {img.mode}"
        if not why and resize is None:
            return data, ""
        rgb = to_rgb(img)
        quality = REWRITE_QUALITY
        if resize is not None:
            rgb, quality = shorter_side(rgb, resize), RESIZE_QUALITY
        buf = io.BytesIO()
        rgb.save(buf, "JPEG", quality=quality)
        return buf.getvalue(), why


def shorter_side(img: Image.Image, short: int) -> Image.Image:
    """``img`` with its shorter side ``short`` (aspect kept); an image already that small is kept."""
    w, h = img.size
    if min(w, h) <= short:
        return img
    scale = short / min(w, h)
    return img.resize((max(1, round(w * scale)), max(1, round(h * scale))), Image.BICUBIC, reducing_gap=3.0)


def write_atomically(path: str, data: bytes) -> None:
    """``data`` at ``path`` through a hidden temporary name in the same folder, made new (never written through a
    link), then one rename. A failed write (a full disk) removes the temporary file and names ``path``."""
    tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.partial")
    try:
        if os.path.lexists(tmp):
            os.unlink(tmp)  # a killed run's (or a link planted there: removed, never followed)
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), "wb") as fh:
            fh.write(data)
        os.replace(tmp, path)
    except OSError as exc:
        if os.path.lexists(tmp):
            os.unlink(tmp)
        raise OSError(exc.errno, exc.strerror, exc.filename if exc.filename and exc.filename != tmp else path) \
            from None


def remove_partials(folder: str) -> None:
    """The hidden temporary files of writes a stopped run left in the class folders under ``folder``."""
    for parent, _, names in os.walk(folder):
        for name in names:
            if name.startswith(".") and name.endswith(".partial"):
                os.unlink(os.path.join(parent, name))


def job_images(job: Job):
    """(file name, wnid, bytes) of each image of ``job``, read in order."""
    if job.kind == "class-tar":
        yield from class_tar_images(job)
    elif job.kind == "members":
        with open(job.archive, "rb") as fh:
            for offset, size, name, wnid in job.items:
                fh.seek(offset)
                yield name, wnid, fh.read(size)
    else:
        for path, name, wnid in job.items:
            with open(path, "rb") as fh:
                yield name, wnid, fh.read()


def class_tar_images(job: Job):
    """The images of one inner ``<wnid>.tar``, read in place: its headers first (every member checked, before any
    image is written), then the images. A damaged inner tar is one line naming it and the archive."""
    where = f"{job.archive}: its member {job.wnid}.tar"
    with open(job.archive, "rb") as fh:
        try:
            with tarfile.open(fileobj=io.BufferedReader(Window(fh, job.offset, job.size)), mode="r:") as inner:
                members = [m for m in inner.getmembers() if not m.isdir()]
                for member in members:
                    refuse_member(where, member)
                    if member.offset_data + member.size > job.size:
                        raise tarfile.ReadError(f"{member.name} is cut short")
                for member in members:
                    yield os.path.basename(member.name), job.wnid, inner.extractfile(member).read()
        except (tarfile.TarError, EOFError) as exc:
            raise UserError(f"{where} is not a whole tar ({exc}): the archive is damaged (a cut-short download or "
                            f"copy?): download it again and check it with its md5 (leave --no-md5 out)") from None


class Window(io.RawIOBase):
    """``size`` bytes of an open file from ``offset``, as a seekable stream (an inner tar read in place)."""

    def __init__(self, fh, offset: int, size: int):
        self.fh, self.offset, self.size, self.pos = fh, offset, size, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        self.pos = max(0, min(self.size, pos + (0, self.pos, self.size)[whence]))
        return self.pos

    def tell(self) -> int:
        return self.pos

    def readinto(self, buffer) -> int:
        want = min(len(buffer), self.size - self.pos)
        if want <= 0:
            return 0
        self.fh.seek(self.offset + self.pos)
        n = self.fh.readinto(memoryview(buffer)[:want])
        self.pos += n
        return n


def run_job(args: tuple) -> dict:
    """Write every image of the job (in a worker) and then its record (count, classes, rewritten and unreadable
    files), which marks it done; returns the record."""
    job, out, resize = args
    classes, rewritten, unreadable, count = set(), [], [], 0
    for name, wnid, data in job_images(job):
        if wnid not in classes:
            makedirs_inside(out, os.path.join(out, job.split, wnid))
            classes.add(wnid)
        rel = f"{job.split}/{wnid}/{output_name(name)}"
        try:
            jpeg, why = as_rgb_jpeg(data, resize)
        except (OSError, SyntaxError, ValueError, UnsupportedImage, Image.DecompressionBombError) as exc:
            unreadable.append(f"{rel} ({type(exc).__name__}: {str(exc)[:120]})")
            continue
        write_atomically(os.path.join(out, rel), jpeg)
        count += 1
        if why:
            rewritten.append(f"{rel} {why.replace(' ', '-')}")
    record = {"job": job.name, "split": job.split, "count": count, "classes": sorted(classes),
              "rewritten": rewritten, "unreadable": unreadable}
    path = done_path(out, job)
    write_atomically(path, json.dumps(record).encode())
    return record

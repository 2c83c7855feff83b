"""``hybridtrain prepare-data imagenet``: ILSVRC2012 from the files users have, into the folder layout the trainer
reads (``OUT/train/<wnid>/``, ``OUT/val/<wnid>/``, ``OUT/classes.txt`` in sorted WNID order), verified, in
parallel processes, resumable; optionally resized (``--resize``) and packed into tar shards (``--shards``).

The steps, all checked before the long work: the source's layout (``ilsvrc.detect_source``), ``--out`` (new,
empty, or a run of this command with the same settings, which continues), the free disk space, the md5 of the
official archives. Then the jobs (``ilsvrc_jobs``) run in worker processes; at the end the tree is counted again,
``classes.txt`` and ``rewritten.txt`` are written and the counts are compared with ILSVRC2012's.
"""
from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from itertools import islice

from tqdm import tqdm

from hybridtrain.data.prepare.ilsvrc import ARCHIVE_MD5, FULL_COUNTS, Source, detect_source
from hybridtrain.data.prepare.ilsvrc_jobs import (
    STATE,
    as_rgb_jpeg,
    done_path,
    job_images,
    read_json,
    remove_partials,
    run_job,
    write_atomically,
)
from hybridtrain.data.prepare.names import makedirs_inside
from hybridtrain.errors import UserError
from hybridtrain.files import check_input_dir, nearest_existing

PARAMS, COMPLETE = "params.json", "complete.json"
SYNSET_WORDS = "synset_words.txt"  # WNID -> words, where the source gave them (classify names classes by them)
RESIZE_SAMPLE = 32  # validation images re-encoded to estimate the size of a --resize copy
RESIZE_MARGIN = 1.15  # on top of the sample's ratio: the training images vary more than 32 images show
MD5_CHUNK = 8 << 20


def state_file(out: str, name: str) -> str:
    return os.path.join(out, STATE, name)


def check_out(out: str, params: dict) -> str:
    """'new', 'resume' (a run with these settings stopped) or 'complete'; one line for anything else."""
    if not os.path.isdir(out) or not os.listdir(out):
        return "new"
    found = read_json(state_file(out, PARAMS))
    if found is None:
        raise UserError(f"--out {out} is not empty and was not made by prepare-data imagenet: give a new or empty "
                        f"folder as --out")
    if found != params:
        differ = sorted(k for k in set(found) | set(params) if found.get(k) != params.get(k))
        raise UserError(f"--out {out} holds a prepare-data imagenet run with other settings ({', '.join(differ)}: "
                        f"{', '.join(f'{k}={found.get(k)}' for k in differ)}): give the same options to continue it, "
                        f"or give a new folder as --out")
    return "complete" if os.path.isfile(state_file(out, COMPLETE)) else "resume"


# ----------------------------------------------------------------------------- checks before the work

def size_text(n: float) -> str:
    """A size in the unit that shows its digits: GB from 1 GB, MB below, kB below 1 MB."""
    unit, scale = next((u, s) for u, s in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3), ("bytes", 1)) if n >= s or s == 1)
    return f"{n / scale:.1f} {unit}" if scale > 1 else f"{n:.0f} bytes"


def output_bytes(source: Source, resize: int | None) -> float:
    """The tree's estimated size: the source's bytes, or, for --resize, those times the ratio that re-encoding the
    first validation images measures (a copy at quality 90 can be larger than its area suggests, and an image
    already smaller than SHORT is re-encoded too), with a margin."""
    if resize is None:
        return source.nbytes
    sample = next((job for job in source.jobs if job.split == "val"), source.jobs[0])
    sizes = []
    for _, _, data in islice(job_images(sample), RESIZE_SAMPLE):
        try:
            sizes.append((len(data), len(as_rgb_jpeg(data, resize)[0])))
        except Exception:  # an image the run itself will name as unreadable
            continue
    ratio = sum(b for _, b in sizes) / max(1, sum(a for a, _ in sizes)) if sizes else 1.0
    return source.nbytes * ratio * RESIZE_MARGIN


def check_free_space(out: str, needed: float, free: float | None = None) -> None:
    """One line when the disk of ``out`` has less than ``needed`` bytes free."""
    free = shutil.disk_usage(nearest_existing(out)).free if free is None else free
    if free < needed:
        raise UserError(f"--out {out}: its disk has {size_text(free)} free and the output needs about "
                        f"{size_text(needed)}: free space on that disk, give an --out on a larger one, or make a "
                        f"smaller copy with --resize 160")


def file_md5(path: str, progress=None) -> str:
    digest = hashlib.md5()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(MD5_CHUNK), b""):
            digest.update(chunk)  # hashlib lets go of the GIL here: the archives are hashed in parallel threads
            if progress is not None:
                progress.update(len(chunk))
    return digest.hexdigest()


def verify_md5(archives: list[str], workers: int, expected: dict[str, str] = ARCHIVE_MD5) -> None:
    """Each archive's md5 against the published one, all at once in threads behind one progress bar (in bytes);
    one line naming the first that differs."""
    total = sum(os.path.getsize(p) for p in archives)
    with tqdm(total=total, desc="md5", unit="B", unit_scale=True, disable=None) as bar, \
            ThreadPoolExecutor(max(1, min(workers, len(archives)))) as threads:
        sums = list(threads.map(lambda path: file_md5(path, bar), archives))
    for path, got in zip(archives, sums):
        want = expected[os.path.basename(path)]
        if got != want:
            raise UserError(f"{path} has md5 {got}, not the published {want}: the file is damaged or incomplete "
                            f"(download it again), or, for a partial or re-packed copy on purpose, add --no-md5")


def run_all(fn, jobs: list, workers: int, desc: str | None = None, unit: str = "job") -> list:
    """``fn(job)`` of every job, in the order they finish, over up to ``workers`` processes (in this one when one
    does), behind a progress bar (none without ``desc``)."""
    processes, results = min(workers, len(jobs)), []
    with tqdm(total=len(jobs), desc=desc, unit=unit, disable=None if desc else True) as bar, \
            (multiprocessing.get_context("forkserver").Pool(processes) if processes > 1 else nullcontext()) as pool:
        for result in pool.imap_unordered(fn, jobs, chunksize=1) if pool else map(fn, jobs):
            results.append(result)
            bar.update()
    return results


# ----------------------------------------------------------------------------- the work

def run_jobs(source: Source, out: str, resize: int | None, workers: int) -> list[dict]:
    """Every job's record: those done by an earlier run are read, the others run now with a progress bar."""
    makedirs_inside(out, os.path.dirname(done_path(out, source.jobs[0])))
    records = {job.name: read_json(done_path(out, job)) for job in source.jobs}
    pending = [job for job in source.jobs if records[job.name] is None]
    try:
        for record in run_all(run_job, [(job, out, resize) for job in pending], workers, "imagenet") if pending else []:
            records[record["job"]] = record
    except BaseException:  # a full disk, a damaged archive, Ctrl-C: no hidden half-written file is left
        for folder in ("train", "val", STATE):
            remove_partials(os.path.join(out, folder))
        raise
    return [records[job.name] for job in source.jobs]


def count_tree(out: str, split: str) -> dict[str, int]:
    """Images per class folder of ``OUT/split`` as they are on disk (hidden temporary files left out)."""
    root = os.path.join(out, split)
    counts = {}
    for wnid in sorted(os.listdir(root)) if os.path.isdir(root) else []:
        with os.scandir(os.path.join(root, wnid)) as entries:
            counts[wnid] = sum(1 for e in entries if not e.name.startswith("."))
    return counts


def finish(source: Source, out: str, records: list[dict]) -> dict:
    """Check the records against the tree, write classes.txt and rewritten.txt; returns the summary."""
    unreadable = [u for r in records for u in r["unreadable"]]
    if unreadable:
        raise UserError(f"{len(unreadable)} image(s) of {source.root} could not be decoded (first: {unreadable[0]}): "
                        f"the source is damaged: download or copy it again")
    tree = {split: count_tree(out, split) for split in ("train", "val")}
    totals = {split: sum(counts.values()) for split, counts in tree.items()}
    for split in ("train", "val"):
        recorded = sum(r["count"] for r in records if r["split"] == split)
        if recorded != totals[split]:
            raise UserError(f"{out}/{split} holds {totals[split]} images but this run wrote {recorded}: "
                            f"something else writes there: give a new folder as --out")
    classes = sorted(tree["train"])  # every validation class has training images: checked by ilsvrc at the start
    write_atomically(os.path.join(out, "classes.txt"), "".join(f"{c}\n" for c in classes).encode())
    if source.words:  # the words of each class, as Caffe's synset_words.txt: 'n01440764 tench, Tinca tinca'
        write_atomically(os.path.join(out, SYNSET_WORDS), "".join(f"{c} {source.words[c]}\n" for c in classes
                                                                 if c in source.words).encode())
    rewritten = sorted(line for r in records for line in r["rewritten"])
    write_atomically(os.path.join(out, "rewritten.txt"), "".join(f"{line}\n" for line in rewritten).encode())
    summary = {"layout": source.layout, **totals, "classes": len(classes), "rewritten": rewritten,
               "full": totals | {"classes": len(classes)} == FULL_COUNTS}
    write_atomically(state_file(out, COMPLETE), json.dumps(summary).encode())
    return summary


def prepare_imagenet(source_dir: str, out: str, md5: bool = True, resize: int | None = None, workers: int = 0,
                     val_labels: str | None = None) -> dict:
    """The folder layout in ``out`` from ``source_dir``; continues a stopped run; returns the summary."""
    check_input_dir(source_dir, "--source", "give the folder holding the ImageNet archives or tree")
    workers = workers or os.cpu_count() or 1
    source = detect_source(source_dir, val_labels)
    params = {"dataset": "imagenet", "source": os.path.abspath(source_dir), "layout": source.layout,
              "resize": resize}
    state = check_out(out, params)
    if state == "complete":
        return read_json(state_file(out, COMPLETE)) | {"resumed": "complete"}
    done = sum(read_json(done_path(out, job)) is not None for job in source.jobs) if state == "resume" else 0
    check_free_space(out, output_bytes(source, resize) * (1 - done / len(source.jobs)))
    start_state(out, params, source.archives if md5 else [], workers)
    summary = finish(source, out, run_jobs(source, out, resize, workers))
    summary["md5"] = "verified" if md5 and source.archives else "skipped (--no-md5)" if source.archives else "none"
    summary["no_md5"] = not md5
    return summary | {"resumed": state == "resume", "done_before": done, "jobs": len(source.jobs)}


def start_state(out: str, params: dict, archives: list[str], workers: int) -> None:
    """Verify ``archives`` (unless an earlier run verified these very files), then record the run's settings."""
    stamps = [[os.path.basename(p), os.stat(p).st_size, int(os.stat(p).st_mtime)] for p in archives]
    if archives and (read_json(state_file(out, "md5.json")) or {}).get("stamps") != stamps:
        verify_md5(archives, workers)  # before anything is written: a refused archive leaves no --out
    makedirs_inside(out, os.path.join(out, STATE))
    write_atomically(state_file(out, PARAMS), json.dumps(params).encode())
    if archives:
        write_atomically(state_file(out, "md5.json"), json.dumps({"stamps": stamps}).encode())


def summary_lines(summary: dict, out: str) -> list[str]:
    """What the command prints: the counts against ILSVRC2012's, and the rewritten files."""
    full = FULL_COUNTS
    counts = f"{summary['train']:,} train / {summary['val']:,} val images, {summary['classes']:,} classes"
    ilsvrc = f"{full['train']:,} / {full['val']:,} / {full['classes']:,}"
    if summary["full"]:
        verdict = f"the full ILSVRC2012 ({ilsvrc})"
    elif all(summary[k] <= full[k] for k in ("train", "val", "classes")):
        verdict = f"a subset: ILSVRC2012 has {ilsvrc}"
    else:
        verdict = f"more than ILSVRC2012 ({ilsvrc}): is the source another data set?"
    lines = [f"imagenet ready in {out} (from the {summary['layout']}): {counts}: {verdict}"]
    if summary.get("resumed") is True:
        lines.append(f"continued a stopped run: {summary['done_before']} of {summary['jobs']} jobs were done")
    rewritten = summary["rewritten"]
    if rewritten:
        lines.append(f"{len(rewritten)} image(s) rewritten as 8-bit RGB JPEG (listed in {out}/rewritten.txt):")
        lines += [f"  {line}" for line in rewritten[:50]]
    if summary.get("md5") == "verified":
        lines.append("md5 of the archives: the published sums")
    elif summary.get("md5", "").startswith("skipped"):
        lines.append("md5 of the archives: not checked (--no-md5)")
    elif summary.get("no_md5"):
        lines.append(f"md5: --no-md5 had nothing to skip (the {summary['layout']} has no archives)")
    lines.append(f"classes.txt: {summary['classes']} WNIDs in sorted order (line number = class index)")
    return lines

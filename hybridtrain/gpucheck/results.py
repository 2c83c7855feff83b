"""What gpu-check's rows leave and what comes back: each row's figures read from its own outputs (metrics.jsonl,
the bench and bench-optim JSON, pytest's JUnit report, the resume check, the max-batch table), the ratios to the
plain loop, the table (``OUT/gpu_check.md`` and ``.json``, replaced atomically), the rows an earlier call passed,
and the one archive a lent machine's ``$OUT`` brings back. check.py runs the rows; this module only reads and
writes files. Standard library only."""
from __future__ import annotations

import dataclasses
import json
import math
import os
import time

from hybridtrain.engine.metrics_file import read_metrics
from hybridtrain.errors import UserError
from hybridtrain.files import atomic_path, write_json_atomically, write_text_atomically
from hybridtrain.gpucheck.rows import EPOCHS, FAIL, NEXT_CALL, NOT_COVERED, OWN_BASELINE, PASS, Row
from hybridtrain.reports import markdown_table

ARCHIVE = "gpu-check.tgz"  # --archive DIR: DIR/gpu-check.tgz
ARCHIVE_LIMIT = 16 * 2**20
MEMORY = {"peak_allocated_mb": "peak_memory_mb", "peak_reserved_mb": "peak_memory_reserved_mb",
          "device_used_mb": "device_memory_used_mb"}  # a row's memory figure -> its key in metrics.jsonl and bench's


# ----------------------------------------------------------------------------- each row's figures

def read_text(path: str) -> str:
    try:
        with open(path, errors="replace") as fh:
            return fh.read()
    except OSError:
        return ""


def train_figures(records: list[dict]) -> dict:
    """Steady img/s over the epochs after the first (the first compiles, captures, autotunes), peak memory over
    all epochs: allocated, reserved and device-wide (None when metrics.jsonl lacks the key)."""
    steady = records[1:] or records
    seconds = sum(r["train_time_s"] for r in steady)
    images = sum(r["images_per_sec"] * r["train_time_s"] for r in steady)
    return {"images_per_sec": images / seconds if seconds else None,
            **{figure: max((r[key] for r in records if isinstance(r.get(key), (int, float))), default=None)
               for figure, key in MEMORY.items()}}


def read_train(row: Row) -> str:
    path = os.path.join(row.output, "metrics.jsonl")
    if not os.path.isfile(path):
        return "no metrics.jsonl"
    try:
        records = read_metrics(path)
    except (OSError, UserError) as exc:  # the reason, not the path again: a long path would hide it
        return f"unreadable metrics.jsonl ({str(exc).replace(path, '').strip()[:120]})"
    vars(row).update(train_figures(records))
    if len(records) < EPOCHS:
        return f"{len(records)} of {EPOCHS} epochs in metrics.jsonl"
    if not all(math.isfinite(r.get("train_loss", math.nan)) for r in records):
        return "non-finite training loss"
    if any(r.get("world_size", row.ranks) != row.ranks for r in records):
        return f"metrics.jsonl says world_size {records[-1].get('world_size')}, expected {row.ranks}"
    if not row.images_per_sec:
        return "no steady img/s"
    return ""


def drop_weights(run_dir: str) -> None:
    """Remove a checked run's checkpoints and final model (ResNet-50 with its optimizer state: hundreds of MiB per
    row); metrics.jsonl, config.yaml and the report stay in OUT/runs/<row>."""
    for name in os.listdir(run_dir) if os.path.isdir(run_dir) else []:
        if name.endswith((".pt", ".pt.sha256")):
            os.remove(os.path.join(run_dir, name))


def read_bench(row: Row) -> str:
    """The trainer's step against the plain loop (in process) and the whole step under the engine's launcher. A
    Horovod bench row has no plain loop of its own: its figure is the whole step, its ratio from fill_ratios."""
    try:
        with open(row.output) as fh:
            results = json.load(fh)
    except (OSError, ValueError) as exc:
        return f"no bench JSON ({exc.__class__.__name__})"
    loops = {r.get("loop"): r for r in results}
    whole = loops.get("train/horovod") or loops.get("train/torch")
    trainer, baseline = loops.get("trainer"), loops.get("baseline")
    main = whole if row.mode == "horovod" else trainer
    if main is None or (row.mode in OWN_BASELINE and baseline is None):
        return "bench JSON lacks the trainer, the plain loop or the whole step's row"
    row.images_per_sec = main["images_per_sec"]
    vars(row).update({figure: main.get(key) for figure, key in MEMORY.items()})
    notes = [f"host syncs/step {trainer.get('host_syncs_per_step')}"] if trainer else []
    if baseline is not None:
        row.baseline_images_per_sec, row.ratio = baseline["images_per_sec"], baseline.get("trainer_over_baseline")
        notes.insert(0, f"plain loop {row.baseline_images_per_sec:.0f} img/s")
    if whole is not None and row.mode != "horovod":
        launcher = "horovodrun" if whole["loop"] == "train/horovod" else "torchrun"
        notes.append(f"whole step under {launcher} {whole['images_per_sec']:.0f} img/s"
                     + (f" ({whole['over_baseline']:.3f}x)" if "over_baseline" in whole else ""))
    row.detail = "; ".join(notes)
    return "" if row.images_per_sec > 0 and (baseline is None or row.baseline_images_per_sec > 0) else "zero img/s"


def read_junit(row: Row) -> str:
    """pytest's own JUnit report: its counts in the note, the failed tests' names as the problem."""
    import xml.etree.ElementTree as ET
    try:
        suites = ET.parse(row.output).getroot()
    except (OSError, ET.ParseError) as exc:
        return f"no JUnit report ({exc.__class__.__name__})"
    suite = suites if suites.tag == "testsuite" else suites.find("testsuite")
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    row.detail = (f"{counts['tests'] - counts['failures'] - counts['errors'] - counts['skipped']} passed, "
                  f"{counts['failures'] + counts['errors']} failed, {counts['skipped']} skipped")
    failed = [case.get("name") for case in suite.iter("testcase")
              if case.find("failure") is not None or case.find("error") is not None]
    return f"failed: {', '.join(failed)}"[:300] if failed else ""


def read_resume(row: Row) -> str:
    try:
        with open(os.path.join(row.output, "resume_check.json")) as fh:
            result = json.load(fh)
    except (OSError, ValueError) as exc:
        return f"no resume_check.json ({exc.__class__.__name__})"
    straight = os.path.join(row.output, "straight")
    try:
        vars(row).update(train_figures(read_metrics(os.path.join(straight, "metrics.jsonl"))))
    except (OSError, UserError, KeyError, ZeroDivisionError):
        pass  # the figures are a bonus here: the check is the comparison
    if not result.get("equal"):
        return "resumed run differs from the straight one: " + ", ".join(result.get("differences", []))[:200]
    row.detail = "resumed from epoch 1: final checkpoint bitwise equal to the straight run's"
    return ""


def read_max_batch(row: Row, log_path: str) -> str:
    largest = [line for line in read_text(log_path).splitlines() if "(largest)" in line]
    if not largest:
        return "no (largest) row in the output"
    cells = [c.strip() for c in largest[-1].strip("|").split("|")]
    row.detail = f"largest batch {cells[0].split()[0]}: {cells[1]} img/s, peak {cells[2]} MiB"
    try:
        row.images_per_sec, row.peak_allocated_mb = float(cells[1]), float(cells[2])
    except (ValueError, IndexError):
        pass
    return ""


def read_bench_optim(row: Row) -> str:
    """The optimizer rows as 'name ratio×' (median step ÷ torch.optim.SGD's) in the row's note."""
    try:
        with open(row.output) as fh:
            results = json.load(fh)
        ratios = {r["optimizer"]: r["ratio_to_sgd"] for r in results}
        sgd_ms = next(r["median_ms"] for r in results if r["optimizer"] == "sgd-foreach")
    except (OSError, ValueError, KeyError, StopIteration) as exc:
        return f"no bench-optim JSON with its rows ({exc.__class__.__name__})"
    row.detail = f"SGD {sgd_ms:.2f} ms; ÷ SGD: " + ", ".join(f"{name} {ratio:.2f}x" for name, ratio in ratios.items()
                                                                if name != "sgd-foreach")
    return ""


def fill_ratios(rows: list[Row], gpus: int) -> list[Row]:
    """Each training row's (and each bench row's without a plain loop of its own) img/s per GPU ÷ the plain loop's
    img/s of the same precision, from the torch engine's bench row; none for a row with more ranks than GPUs (its
    ranks share a GPU: a per-GPU figure would mean nothing)."""
    baselines = {r.precision: r.baseline_images_per_sec for r in rows
                 if r.kind == "bench" and r.mode == "eager" and r.baseline_images_per_sec}
    for r in rows:
        measured = r.kind == "train" or (r.kind == "bench" and r.mode not in OWN_BASELINE)
        if measured and r.images_per_sec and r.precision in baselines and r.ranks <= gpus:
            r.ratio = r.images_per_sec / r.ranks / baselines[r.precision]
    return rows


# ----------------------------------------------------------------------------- the table

def fmt(value: float | None, digits: int = 0) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def format_table(rows: list[Row]) -> str:
    header = ["row", "call", "steady img/s", "÷ plain loop", "peak allocated MiB", "peak reserved MiB",
              "device used MiB", "result", "time s", "note"]
    return markdown_table(header, [[r.name, r.call or "-", fmt(r.images_per_sec, 1), fmt(r.ratio, 3),
                                     fmt(r.peak_allocated_mb), fmt(r.peak_reserved_mb), fmt(r.device_used_mb),
                                     "**FAIL**" if r.status == FAIL else r.status, fmt(r.seconds),
                                     r.detail.replace("|", "/")] for r in rows])


def verdict(rows: list[Row]) -> str:
    failed = [r.name for r in rows if r.status == FAIL]
    left = [r for r in rows if r.status == "pending" or r.detail.startswith(NEXT_CALL)]
    more = f"; {len(left)} rows left for the next call (call again with the same --out)" if left else ""
    return (f"FAILED ({', '.join(failed)})" if failed else "every row that ran passed") + more


def write_results(rows: list[Row], out: str, meta: dict) -> str:
    """OUT/gpu_check.md (the table under its context and what one GPU cannot check) and OUT/gpu_check.json,
    each replaced atomically (a kill never leaves half a table); returns the markdown."""
    head = [f"# hybridtrain gpu-check: {verdict(rows)}", ""] + [f"- {key}: {value}" for key, value in meta.items()]
    tail = ["", "Not covered here:"] + [f"- {line}" for line in NOT_COVERED]
    text = "\n".join(head + ["", format_table(rows)] + tail + [""])
    failed = [r.name for r in rows if r.status == FAIL]
    record = {**meta, "passed": not failed, "failed": failed,
              "rows": [dataclasses.asdict(r) for r in rows]}
    write_text_atomically(os.path.join(out, "gpu_check.md"), text)
    write_json_atomically(os.path.join(out, "gpu_check.json"), record)
    return text


# ----------------------------------------------------------------------------- a second call

def earlier_rows(out: str) -> dict:
    """{name: row} of the rows that passed in an earlier call with this --out (its gpu_check.json)."""
    try:
        with open(os.path.join(out, "gpu_check.json")) as fh:
            saved = json.load(fh)
        fields = {f.name for f in dataclasses.fields(Row)}
        return {r["name"]: Row(**{k: v for k, v in r.items() if k in fields}) for r in saved["rows"]
                if r.get("status") == PASS}
    except (OSError, ValueError, KeyError, TypeError):
        return {}


def take_earlier(rows: list[Row], earlier: dict) -> int:
    """Rows that passed before keep their figures and are not run again; returns how many."""
    taken = 0
    for i, row in enumerate(rows):
        before = earlier.get(row.name)
        if before is not None and row.kind != "note":
            before.call, before.detail = row.call, (before.detail + " (an earlier call)").strip()
            rows[i], taken = before, taken + 1
    return taken


# ----------------------------------------------------------------------------- what comes back: one archive

KEPT = (".md", ".json", ".jsonl", ".log", ".yaml", ".txt", ".csv", ".png")  # no weights, venvs or data
LOG_TAIL = 256 * 1024  # a log cut to its last 256 KiB when the whole archive would pass the limit


def archived_files(out: str) -> list[str]:
    """The files of --out worth bringing back, relative to it: tables, logs, figures, run records."""
    if not os.path.isdir(out):
        return []
    found = []
    for root, dirs, files in os.walk(out):
        dirs[:] = sorted(d for d in dirs if not d.endswith("venv") and d not in ("data", "cache"))
        found += [os.path.relpath(os.path.join(root, f), out) for f in sorted(files) if f.endswith(KEPT)
                  and not os.path.islink(os.path.join(root, f))]
    return found


def write_archive(out: str, folder: str, error: str = "") -> str:
    """folder/gpu-check.tgz of archived_files(out) (and ``error``, the line that ended the call, as error.txt),
    written atomically; logs are cut to their last LOG_TAIL bytes when the whole would pass ARCHIVE_LIMIT."""
    import io
    import tarfile
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, ARCHIVE)
    with atomic_path(path) as tmp:
        for tail in (None, LOG_TAIL, LOG_TAIL // 16):
            with tarfile.open(tmp, mode="w:gz") as tar:
                members = [(name, read_tail(os.path.join(out, name), tail if name.endswith(".log") else None))
                           for name in archived_files(out)] + ([("error.txt", error.encode())] if error else [])
                for name, data in members:
                    info = tarfile.TarInfo(os.path.join("gpu-check", name))
                    info.size, info.mtime = len(data), int(time.time())
                    tar.addfile(info, io.BytesIO(data))
            if os.path.getsize(tmp) <= ARCHIVE_LIMIT:
                break
    return path


def read_tail(path: str, limit: int | None) -> bytes:
    with open(path, "rb") as fh:
        if limit is not None and os.path.getsize(path) > limit:
            fh.seek(-limit, os.SEEK_END)
        return fh.read()

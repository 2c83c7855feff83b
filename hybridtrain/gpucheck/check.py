"""``hybridtrain gpu-check``: the GPU path of the project on one GPU machine, in calls of a few minutes.

Built for a lent, offline GPU machine whose ``python3`` is a venv holding torch (any torch from 2.3) and no
Horovod, no DALI: it uses that Python and its torch as they are, and builds Horovod with NCCL from the bundle
(``make gpu-bundle``: ``.gpu-bundle/``) in the background while the rows that need no Horovod run. Every row is
one real process whose whole output goes to ``OUT/<row>.log``; the table (``OUT/gpu_check.md`` and ``.json``) is
written again after every row, so a crash or a kill never loses what ran. A second call with the same ``--out``
skips the rows that passed and reuses the build; ``--fresh`` runs everything again.

``--plan`` prints the rows in the order they run with their estimated seconds and the call they fall in
(hybridtrain.gpucheck.rows), without a GPU; ``--rehearse`` runs on a CPU machine every step a call takes before
its first GPU step (hybridtrain.gpucheck.rehearsal).

Exit status: 0 every row that ran passed (rows left for the next call say so in the table), 1 a row failed; 2 bad
input or no usable GPU (one line). ``--archive DIR`` ends every call, a refused one too, by writing DIR/gpu-check.tgz
(the table, each row's log and figures; under 16 MiB): the one file a lent machine's ``$OUT`` brings back. Only
the standard library is imported here: torch is asked in a child process.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from typing import Callable

from hybridtrain.engine.metrics_file import read_metrics
from hybridtrain.errors import UserError
from hybridtrain.gpucheck.rows import (
    CALL_BUDGETS_S,
    EPOCHS,
    NOT_COVERED,
    OWN_BASELINE,
    RECIPE,
    REPO,
    TIMEOUT_S,
    Pythons,
    Row,
    build_rows,
    next_row,
    plan_calls,
)
from hybridtrain.outputs import (
    atomic_path,
    check_output_dir,
    markdown_table,
    write_json_atomically,
    write_text_atomically,
)

HOROVOD_SDIST = "horovod-0.28.1.tar.gz"
BUNDLE = os.path.join(REPO, ".gpu-bundle")      # make gpu-bundle
WORK = os.path.join(REPO, ".gpu-check")         # the build's venv and cache: kept between calls on a warm machine
OUT = os.path.join(WORK, "out")                 # --out's default: git-ignored, so a warm machine keeps it too
ARCHIVE = "gpu-check.tgz"                       # --archive DIR: DIR/gpu-check.tgz
ARCHIVE_LIMIT = 16 * 2**20
BUDGET_S = CALL_BUDGETS_S[0]                    # the whole call, the node checks included
MIN_ROW_S = 20                                  # no row is started with less than this left
PROGRESS_EVERY_S = 30

PASS, FAIL, NOT_RUN = "pass", "fail", "not run"
NEXT_CALL = "left for the next call"


# ----------------------------------------------------------------------------- before any work

def check_bundle(path: str | None) -> str | None:
    """The bundle folder (given, else .gpu-bundle/ when it exists), or None (the build then needs a registry)."""
    if path is None:
        return BUNDLE if os.path.isdir(BUNDLE) else None
    folder = os.path.abspath(path)
    if not os.path.isdir(folder):
        raise UserError(f"--bundle {path} is not a folder: make it with make gpu-bundle (docs/benchmarks.md)")
    if not os.path.isfile(os.path.join(folder, HOROVOD_SDIST)):
        raise UserError(f"--bundle {path} has no {HOROVOD_SDIST}: make it with make gpu-bundle (docs/benchmarks.md)")
    return folder


def check_checkout(repo: str = REPO) -> None:
    needed = ("install.sh", RECIPE, "tests/test_step_speed.py")
    missing = [p for p in needed if not os.path.exists(os.path.join(repo, p))]
    if missing:
        raise UserError(f"gpu-check runs from a checkout of hybridtrain; {repo} has no {', '.join(missing)}: "
                        f"run it from the checkout (python -m hybridtrain gpu-check ...)")


def checkout_env(env: dict, repo: str = REPO) -> dict:
    """The environment of every row: the checkout first on PYTHONPATH (the image's Python has no hybridtrain)."""
    return {**env, "PYTHONPATH": repo + os.pathsep + env.get("PYTHONPATH", ""), "PYTHONUNBUFFERED": "1"}


def probe(python: str = sys.executable) -> dict:
    """hybridtrain.gpucheck.probe in a child process (this one never holds a CUDA context, which would count in
    every row's device memory): the GPUs, torch, DALI and the node checks. No usable GPU is a UserError."""
    try:
        proc = subprocess.run([python, "-m", "hybridtrain.gpucheck.probe"], capture_output=True, text=True,
                              timeout=180, stdin=subprocess.DEVNULL, env=checkout_env(dict(os.environ)), cwd=REPO)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise UserError(f"gpu-check could not ask torch for the GPUs with {python}: {exc}") from None
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"])[-1]
        raise UserError(f"gpu-check needs torch in this Python ({python}): {last}")
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    if not found["gpus"]:
        raise UserError(no_gpu_line(found["reason"]))
    return found


def no_gpu_line(reason: str) -> str:
    return f"gpu-check needs a CUDA GPU and torch cannot use one here ({reason}): run it on a GPU node"


def node_row(checks: dict) -> Row:
    """The table's first row: what the node checks said. A refusal in fp32 (no kernels for this GPU, a driver too
    old for torch's CUDA) is a UserError before any work: nothing else could run."""
    if checks.get("fp32", ("", []))[0]:
        raise UserError(checks["fp32"][0])
    refused = {p: line for p, (line, _) in checks.items() if line}
    warnings = sorted({w for _, ws in checks.values() for w in ws})
    detail = "; ".join([f"{p}: {line}" for p, line in refused.items()] + warnings) or "kernels, driver, bf16: ok"
    return Row("node-check", "note", status=PASS, detail=detail)


def skip_refused(rows: list[Row], checks: dict) -> list[Row]:
    """Rows in a precision the node refuses (bf16 below sm_80) become 'not run' rows that say why."""
    for row in rows:
        line = checks.get(row.precision, ("", []))[0]
        if line and row.kind != "note":
            row.kind, row.status, row.detail = "note", NOT_RUN, f"not run: {line}"
    return rows


# ----------------------------------------------------------------------------- Horovod with NCCL, in the background

def nccl_ready(bin_dir: str, nccl: bool = True) -> bool:
    """True when bin_dir's python imports horovod.torch (built with NCCL when ``nccl``) and horovodrun is there."""
    python = os.path.join(bin_dir, "python")
    if not all(os.path.exists(os.path.join(bin_dir, n)) for n in ("python", "horovodrun")):
        return False
    code = "import sys, horovod.torch as hvd; sys.exit(0 if hvd.nccl_built() or not %r else 1)" % nccl
    try:
        return subprocess.run([python, "-c", code], capture_output=True, timeout=180, stdin=subprocess.DEVNULL,
                              env=checkout_env(dict(os.environ))).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def build_jobs(cores: int | None = None) -> int:
    """The build's compile jobs: all cores but 4, so that a timed row beside it keeps cores of its own."""
    return max(1, (cores or os.cpu_count() or 1) - 4)


def build_row(venv: str, bundle: str | None, python: str = sys.executable, nccl: bool = True,
              cache: str = os.path.join(WORK, "cache"), cc_list: str = "", jobs: int | None = None) -> Row:
    """install.sh into ``venv`` with the image's torch (HYBRIDTRAIN_TORCH=system), from the bundle offline, at
    nice 10 on ``jobs`` cores (default build_jobs(): it runs beside timed rows); ``cc_list``: the GPUs' compute
    capabilities."""
    env = {"HYBRIDTRAIN_TORCH": "system", "HYBRIDTRAIN_SKIP_DALI": "1", "HYBRIDTRAIN_VENV": venv, "PYTHON": python,
           "HYBRIDTRAIN_CACHE": cache, "HYBRIDTRAIN_BUILD_JOBS": str(jobs or build_jobs())}
    if nccl:
        env["HOROVOD_GPU_OPERATIONS"] = "NCCL"
    if cc_list:
        env["HOROVOD_BUILD_CUDA_CC_LIST"] = cc_list
    if bundle:
        env["HYBRIDTRAIN_WHEELHOUSE"] = bundle
    return Row("build", "build", ["nice", "-n", "10", os.path.join(REPO, "install.sh")], TIMEOUT_S["build"],
               env=env)


class Background:
    """One row's process started now and judged when it ends (the Horovod build, while other rows run)."""

    def __init__(self, row: Row, out: str, base_env: dict, say: Callable[[str], None]):
        self.row, self.out, self.say = row, out, say
        self.proc, self.start = start_row(row, out, base_env, say), time.monotonic()

    def poll(self) -> bool:
        """True once the row has ended (and is judged)."""
        if self.proc is None or self.row.status != "pending":
            return True
        rc = self.proc.poll()
        if rc is not None:
            finish_row(self.row, rc, self.out, time.monotonic() - self.start, self.say)
        elif time.monotonic() - self.start > self.row.timeout_s:
            self.stop(f"timed out after {self.row.timeout_s:.0f} s")
        return self.row.status != "pending"

    def stop(self, why: str, status: str = FAIL) -> None:
        if self.proc is not None and self.row.status == "pending":
            stop_group(self.proc)
            self.row.status, self.row.detail = status, why
            self.row.seconds = time.monotonic() - self.start


# ----------------------------------------------------------------------------- running one row

def last_line(path: str, width: int = 120) -> str:
    try:
        with open(path, "rb") as fh:
            fh.seek(max(0, os.path.getsize(path) - 4096))
            tail = fh.read().decode("utf-8", "replace")
    except OSError:
        return ""
    lines = [s.strip() for s in tail.replace("\r", "\n").splitlines() if s.strip()]
    return lines[-1][:width] if lines else ""


def stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM to the row's process group (the launcher and its ranks), SIGKILL after 15 s."""
    for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def start_row(row: Row, out: str, base_env: dict, say: Callable[[str], None], repo: str = REPO):
    """Run the row's ``before`` commands, then start its command in its own session (output to OUT/<name>.log).
    None, with the row failed, when a command cannot start or a ``before`` command fails."""
    log_path = os.path.join(out, f"{row.name}.log")
    if row.kind in ("train", "resume") and os.path.isdir(row.output):
        shutil.rmtree(row.output)  # this row's runs from an earlier call: the trainer starts fresh
    elif row.output and os.path.isfile(row.output):
        os.remove(row.output)  # an earlier call's JSON or report: never judged as this call's
    env = {**base_env, **row.env}
    say(f"gpu-check: {row.name}: running (timeout {row.timeout_s:.0f} s, log {log_path})")
    with open(log_path, "w") as log:
        try:
            for cmd in row.before:
                log.write(f"$ {shlex.join(cmd)}\n")
                log.flush()
                rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=repo,
                                    env=env, timeout=row.timeout_s).returncode
                if rc != 0:
                    row.status, row.detail = FAIL, f"{shlex.join(cmd[:4])} ... exited {rc}"
                    return None
            log.write("$ " + shlex.join([f"{k}={v}" for k, v in row.env.items()] + row.argv) + "\n")
            log.flush()
            return subprocess.Popen(row.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    cwd=repo, env=env, start_new_session=True)
        except (OSError, subprocess.TimeoutExpired) as exc:  # a missing launcher fails its row, not the check
            row.status, row.detail = FAIL, f"could not start: {exc}"
            log.write(row.detail + "\n")
            return None


def finish_row(row: Row, rc: int | None, out: str, seconds: float, say: Callable[[str], None]) -> Row:
    row.seconds = seconds
    if rc is None:
        row.status, row.detail = FAIL, row.detail or "timed out"
    else:
        problem = judge(row, rc, os.path.join(out, f"{row.name}.log"))
        row.status, row.detail = (FAIL, problem) if problem else (PASS, row.detail)
    if row.kind in ("train", "resume"):
        drop_weights(row.output)
    say(f"gpu-check: {row.name}: {row.status} in {seconds:.0f} s" + (f": {row.detail}" if row.detail else ""))
    return row


def run_row(row: Row, out: str, deadline: float, base_env: dict, say: Callable[[str], None] = print,
            on_tick: Callable[[], None] = lambda: None) -> Row:
    """Run ``row`` within its timeout and what is left of the budget, then judge it; ``on_tick`` runs every
    second meanwhile (the background build is polled there)."""
    if row.kind == "note":
        return row
    left = deadline - time.monotonic()
    if left < max(MIN_ROW_S, row.estimate_s):
        row.status, row.detail = NOT_RUN, f"{NEXT_CALL} (estimated {row.estimate_s:.0f} s, {max(left, 0):.0f} s left)"
        return row
    timeout = min(row.timeout_s, left)
    start = time.monotonic()
    proc = start_row(row, out, base_env, say)
    if proc is None:
        return finish_row(row, 1, out, time.monotonic() - start, say) if row.status == "pending" else row
    rc, next_note = None, start + PROGRESS_EVERY_S
    try:
        while rc is None:
            try:
                rc = proc.wait(timeout=1.0)
            except subprocess.TimeoutExpired:
                on_tick()
                now = time.monotonic()
                if now - start > timeout:
                    stop_group(proc)
                    if timeout < row.timeout_s:  # the budget's end, not the row's fault
                        return left_for_next_call(row, f"stopped at the end of the budget after {timeout:.0f} s",
                                                  time.monotonic() - start)
                    row.detail = f"timed out after {timeout:.0f} s"
                    break
                if now >= next_note:
                    say(f"  {row.name}: {now - start:.0f} s: {last_line(os.path.join(out, f'{row.name}.log'))}")
                    next_note += PROGRESS_EVERY_S
    except BaseException:  # the check itself is stopped (SIGTERM): no rank outlives it
        stop_group(proc)
        left_for_next_call(row, "stopped by SIGTERM", time.monotonic() - start)
        raise
    return finish_row(row, rc, out, time.monotonic() - start, say)


def left_for_next_call(row: Row, why: str, seconds: float) -> Row:
    row.status, row.detail, row.seconds = NOT_RUN, f"{NEXT_CALL} ({why})", seconds
    return row


def judge(row: Row, rc: int, log_path: str) -> str:
    """'' when the row passed (its figures filled in), else what went wrong, in a few words."""
    readers = {"train": read_train, "resume": read_resume, "bench": read_bench, "bench-optim": read_bench_optim,
               "max-batch": lambda r: read_max_batch(r, log_path), "tests": read_junit}
    if row.kind in readers:
        problem = readers[row.kind](row)
    elif row.kind == "step":  # a rehearsal step: its exit status says it all
        problem = ""
    else:  # build: install.sh's own one-line error says what is missing
        problem = read_build(row, rc, log_path)
    if rc != 0:
        return problem or f"exit status {rc} (see {os.path.basename(log_path)})"
    return problem


def read_build(row: Row, rc: int, log_path: str) -> str:
    errors = [line for line in read_text(log_path).splitlines() if line.startswith("install: error:")]
    if rc != 0:
        return errors[-1][:300] if errors else ""
    bin_dir, nccl = os.path.join(row.env["HYBRIDTRAIN_VENV"], "bin"), "HOROVOD_GPU_OPERATIONS" in row.env
    if not nccl_ready(bin_dir, nccl):
        return f"install.sh ended but {bin_dir} has no horovod.torch" + (" with NCCL" if nccl else "")
    return ""


def read_text(path: str) -> str:
    try:
        with open(path, errors="replace") as fh:
            return fh.read()
    except OSError:
        return ""


def max_of(records: list[dict], key: str) -> float | None:
    values = [r[key] for r in records if isinstance(r.get(key), (int, float))]
    return max(values) if values else None


def train_figures(records: list[dict]) -> dict:
    """Steady img/s over the epochs after the first (the first compiles, captures, autotunes), peak memory over
    all epochs: allocated, reserved and device-wide (None when metrics.jsonl lacks the key)."""
    steady = records[1:] or records
    seconds = sum(r["train_time_s"] for r in steady)
    images = sum(r["images_per_sec"] * r["train_time_s"] for r in steady)
    return {"images_per_sec": images / seconds if seconds else None,
            "peak_allocated_mb": max_of(records, "peak_memory_mb"),
            "peak_reserved_mb": max_of(records, "peak_memory_reserved_mb"),
            "device_used_mb": max_of(records, "device_memory_used_mb")}


def read_train(row: Row) -> str:
    path = os.path.join(row.output, "metrics.jsonl")
    if not os.path.isfile(path):
        return "no metrics.jsonl"
    try:
        records = read_metrics(path)
    except (OSError, UserError) as exc:  # the reason, not the path again: a long path would hide it
        return f"unreadable metrics.jsonl ({str(exc).replace(path, '').strip()[:120]})"
    for key, value in train_figures(records).items():
        setattr(row, key, value)
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
    for key, name in (("peak_allocated_mb", "peak_memory_mb"), ("peak_reserved_mb", "peak_memory_reserved_mb"),
                      ("device_used_mb", "device_memory_used_mb")):
        setattr(row, key, main.get(name))
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
        for key, value in train_figures(read_metrics(os.path.join(straight, "metrics.jsonl"))).items():
            setattr(row, key, value)
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


# ----------------------------------------------------------------------------- the command

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


class Stopped(Exception):
    """SIGTERM (the device call's time limit, a scheduler): the table is written and the rows stopped."""


def raise_stopped(signum, frame):
    raise Stopped()


@contextlib.contextmanager
def stopped_by_sigterm(say: Callable[[str], None]):
    """SIGTERM ends the rows (run_row stops the running row's process group) instead of the process: what follows
    the block (the last table) still runs."""
    previous = signal.signal(signal.SIGTERM, raise_stopped)
    try:
        yield
    except Stopped:
        say("gpu-check: stopped by SIGTERM; the table holds every row that ended")
    finally:
        signal.signal(signal.SIGTERM, previous)


def run_rows(rows: list[Row], out: str, deadline: float, base_env: dict, build: Background | None,
             write: Callable[[], None], say: Callable[[str], None]) -> None:
    """Every pending row in plan order (Horovod rows once the build has passed), the table written after each."""
    pending = [r for r in rows if r.status == "pending" and r.kind != "note"]

    def tick() -> None:  # while a row runs: the build's end goes into the table once
        if build is not None and build.row.status == "pending" and build.poll():
            write()
    while pending:
        done = build is None or build.poll()
        ready = build is None or build.row.status == PASS
        row = next_row(pending, ready)
        if row is None and not done and deadline - time.monotonic() > MIN_ROW_S:
            time.sleep(1.0)  # only Horovod rows left: wait for the build
            continue
        if row is None:
            for r in pending:
                r.status, r.detail = NOT_RUN, (f"not run: no Horovod build ({build.row.detail})" if done else
                                               f"{NEXT_CALL} (the Horovod build had not finished)")
            break
        pending.remove(row)
        run_row(row, out, deadline, base_env, say, on_tick=tick)
        write()


def execute(rows: list[Row], out: str, deadline: float, base_env: dict, build: Background | None,
            write: Callable[[], str], say: Callable[[str], None], gpus: int = 1) -> str:
    """Run the rows (the table written after each), stop the build if it outlives them, write the last table."""
    with stopped_by_sigterm(say):
        write()
        run_rows(rows, out, deadline, base_env, build, write, say)
    if build is not None:
        build.poll()
        build.stop(f"{NEXT_CALL} (stopped at the end of the call: the next call builds again)", NOT_RUN)
    fill_ratios(rows, gpus)
    return write()


def run_gpu_check(out: str | None = None, bundle: str | None = None, venv: str | None = None,
                  budget_s: float = BUDGET_S, fresh: bool = False, archive: str | None = None,
                  say: Callable[[str], None] = print) -> int:
    """The call; with ``archive``, DIR/gpu-check.tgz written at its end whatever the end (a refusal's line in it)."""
    out = os.path.abspath(out or OUT)
    if archive is not None:
        archive = os.path.abspath(check_output_dir(archive, "--archive"))
    try:
        code = check_gpu(out, bundle, venv, budget_s, fresh, say)
    except (UserError, KeyboardInterrupt) as exc:
        if archive is not None:
            write_archive(out, archive, f"hybridtrain: error: {exc}\n" if isinstance(exc, UserError) else
                          "gpu-check: interrupted\n")
        raise
    if archive is not None:
        say(f"gpu-check: archive {write_archive(out, archive)}")
    return code


def check_gpu(out: str, bundle: str | None, venv: str | None, budget_s: float, fresh: bool,
              say: Callable[[str], None]) -> int:
    """0 when every row that ran passed (rows may be left for the next call), 1 when one failed; bad input or no
    GPU: UserError before any work."""
    deadline = time.monotonic() + budget_s  # the node checks count
    check_output_dir(out, "--out")  # checked, not created
    bundle = check_bundle(bundle)
    check_checkout()
    earlier = {} if fresh else earlier_rows(out)
    found = probe()
    first = node_row(found["checks"])
    os.makedirs(out, exist_ok=True)
    venv = os.path.abspath(venv or os.path.join(WORK, "venv"))
    hvd_bin = os.path.join(venv, "bin")
    here = os.path.dirname(sys.executable)
    if nccl_ready(here):
        hvd_bin = here
    rows = plan_calls(skip_refused(build_rows(found["gpus"], out, Pythons(sys.executable, hvd_bin), found["dali"]),
                                   found["checks"]))
    taken = take_earlier(rows, earlier)
    meta = {"device": found["name"], "gpus": found["gpus"], "torch": found["torch"], "python": sys.executable,
            "budget_s": budget_s, "horovod": hvd_bin, "rows passed in earlier calls": taken}
    base_env = checkout_env(dict(os.environ))
    base_env["PATH"] = hvd_bin + os.pathsep + base_env.get("PATH", "")
    say(f"gpu-check: {found['name']} x {found['gpus']}, torch {found['torch']}; output in {out}"
        + (f"; {taken} rows passed in an earlier call" if taken else ""))
    build = None
    needs_horovod = any(r.horovod and r.status == "pending" for r in rows)
    if not needs_horovod or nccl_ready(hvd_bin):
        build_line = Row("build", "build", status=PASS, detail=f"reused: {hvd_bin} has horovod.torch with NCCL"
                         if needs_horovod else "not needed: every Horovod row passed before")
    else:
        build = Background(build_row(venv, bundle, cc_list=found.get("cc_list", "")), out, base_env, say)
        build_line = build.row
    table = [first, build_line, *rows]
    write = lambda: write_results(table, out, meta)
    text = execute(rows, out, deadline, base_env, build, write, say, found["gpus"])
    say(text)
    say(f"gpu-check: table in {os.path.join(out, 'gpu_check.md')} and gpu_check.json; each row's output in "
        f"{out}/<row>.log")
    return 1 if any(r.status == FAIL for r in table) else 0


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

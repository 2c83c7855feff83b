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

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from typing import Callable

from hybridtrain.errors import UserError
from hybridtrain.files import check_output_dir
from hybridtrain.gpucheck.results import (
    drop_weights,
    earlier_rows,
    fill_ratios,
    read_bench,
    read_bench_optim,
    read_junit,
    read_max_batch,
    read_resume,
    read_tail,
    read_text,
    read_train,
    take_earlier,
    write_archive,
    write_results,
)
from hybridtrain.gpucheck.rows import (
    CALL_BUDGETS_S,
    FAIL,
    NEXT_CALL,
    NOT_RUN,
    PASS,
    RECIPE,
    REPO,
    TIMEOUT_S,
    Pythons,
    Row,
    build_rows,
    next_row,
    plan_calls,
)

HOROVOD_SDIST = "horovod-0.28.1.tar.gz"
BUNDLE = os.path.join(REPO, ".gpu-bundle")      # make gpu-bundle
WORK = os.path.join(REPO, ".gpu-check")         # the build's venv and cache: kept between calls on a warm machine
OUT = os.path.join(WORK, "out")                 # --out's default: git-ignored, so a warm machine keeps it too
BUDGET_S = CALL_BUDGETS_S[0]                    # the whole call, the node checks included
MIN_ROW_S = 20                                  # no row is started with less than this left
PROGRESS_EVERY_S = 30


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
        raise UserError(f"gpu-check needs a CUDA GPU and torch cannot use one here ({found['reason']}): run it on a "
                        f"GPU node")
    return found


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


def build_row(venv: str, bundle: str | None, python: str = sys.executable, nccl: bool = True,
              cache: str = os.path.join(WORK, "cache"), cc_list: str = "", jobs: int | None = None) -> Row:
    """install.sh into ``venv`` with the image's torch (HYBRIDTRAIN_TORCH=system), from the bundle offline, at
    nice 10 on ``jobs`` cores (default: all cores but 4, so that a timed row beside it keeps cores of its own);
    ``cc_list``: the GPUs' compute capabilities."""
    env = {"HYBRIDTRAIN_TORCH": "system", "HYBRIDTRAIN_SKIP_DALI": "1", "HYBRIDTRAIN_VENV": venv, "PYTHON": python,
           "HYBRIDTRAIN_CACHE": cache, "HYBRIDTRAIN_BUILD_JOBS": str(jobs or max(1, (os.cpu_count() or 1) - 4))}
    if nccl:
        env["HOROVOD_GPU_OPERATIONS"] = "NCCL"
    if cc_list:
        env["HOROVOD_BUILD_CUDA_CC_LIST"] = cc_list
    if bundle:
        env["HYBRIDTRAIN_WHEELHOUSE"] = bundle
    return Row("build", "build", ["nice", "-n", "10", os.path.join(REPO, "install.sh")], TIMEOUT_S["build"],
               env=env)


# ----------------------------------------------------------------------------- running one row

class Job:
    """One row's process, started now and judged when it ends, within ``timeout`` (default the row's): run_row
    waits on it, and the Horovod build runs as one in the background while the other rows run."""

    def __init__(self, row: Row, out: str, base_env: dict, say: Callable[[str], None], timeout: float | None = None):
        self.row, self.out, self.say = row, out, say
        self.timeout = row.timeout_s if timeout is None else timeout
        self.proc, self.start = start_row(row, out, base_env, say), time.monotonic()

    def poll(self, wait: float = 0.0) -> bool:
        """True once the row has ended (and is judged), waiting up to ``wait`` seconds for its end. Past a timeout
        shorter than the row's (the budget's end, not the row's fault) it is left for the next call."""
        if self.proc is None or self.row.status != "pending":
            return True
        try:
            rc = self.proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            if time.monotonic() - self.start <= self.timeout:
                return False
            if self.timeout < self.row.timeout_s:
                self.stop(f"stopped at the end of the budget after {self.timeout:.0f} s")
                return True
            stop_group(self.proc)
            rc, self.row.detail = None, f"timed out after {self.timeout:.0f} s"
        row = self.row
        row.seconds = time.monotonic() - self.start
        if rc is None:
            row.status = FAIL
        else:
            problem = judge(row, rc, os.path.join(self.out, f"{row.name}.log"))
            row.status, row.detail = (FAIL, problem) if problem else (PASS, row.detail)
        if row.kind in ("train", "resume"):
            drop_weights(row.output)
        note = f": {row.detail}" if row.detail else ""
        self.say(f"gpu-check: {row.name}: {row.status} in {row.seconds:.0f} s{note}")
        return True

    def stop(self, why: str) -> None:
        """Stop the row if it still runs: it is left for the next call, ``why`` says why."""
        if self.proc is not None and self.row.status == "pending":
            stop_group(self.proc)
            self.row.status, self.row.detail = NOT_RUN, f"{NEXT_CALL} ({why})"
            self.row.seconds = time.monotonic() - self.start


def last_line(path: str, width: int = 120) -> str:
    try:
        tail = read_tail(path, 4096).decode("utf-8", "replace")
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
    job = Job(row, out, base_env, say, min(row.timeout_s, left))
    next_note = job.start + PROGRESS_EVERY_S
    try:
        while not job.poll(wait=1.0):
            on_tick()
            now = time.monotonic()
            if now >= next_note:
                say(f"  {row.name}: {now - job.start:.0f} s: {last_line(os.path.join(out, f'{row.name}.log'))}")
                next_note += PROGRESS_EVERY_S
    except BaseException:  # the check itself is stopped (SIGTERM): no rank outlives it
        job.stop("stopped by SIGTERM")
        raise
    return row


def judge(row: Row, rc: int, log_path: str) -> str:
    """'' when the row passed (its figures filled in), else what went wrong, in a few words."""
    readers = {"train": read_train, "resume": read_resume, "bench": read_bench, "bench-optim": read_bench_optim,
               "max-batch": lambda r: read_max_batch(r, log_path), "tests": read_junit,
               "step": lambda r: "",  # a rehearsal step: its exit status says it all
               "build": lambda r: read_build(r, rc, log_path)}  # install.sh's own one-line error says what is missing
    problem = readers[row.kind](row)
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


# ----------------------------------------------------------------------------- the command

class Stopped(Exception):
    """SIGTERM (the device call's time limit, a scheduler): the table is written and the rows stopped."""


def raise_stopped(signum, frame):
    raise Stopped()


def execute(rows: list[Row], out: str, deadline: float, base_env: dict, build: Job | None,
            write: Callable[[], str], say: Callable[[str], None], gpus: int = 1) -> str:
    """Every pending row in plan order (Horovod rows once the build has passed), the table written after each; the
    build stopped if it outlives them, then the last table. SIGTERM ends the rows (run_row stops the running row's
    process group) instead of the process: the last table is still written."""
    pending = [r for r in rows if r.status == "pending" and r.kind != "note"]

    def tick() -> None:  # while a row runs: the build's end goes into the table once
        if build is not None and build.row.status == "pending" and build.poll():
            write()
    previous = signal.signal(signal.SIGTERM, raise_stopped)
    try:
        write()
        while pending:
            done = build is None or build.poll()
            row = next_row(pending, build is None or build.row.status == PASS)
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
    except Stopped:
        say("gpu-check: stopped by SIGTERM; the table holds every row that ended")
    finally:
        signal.signal(signal.SIGTERM, previous)
    if build is not None:
        build.poll()
        build.stop("stopped at the end of the call: the next call builds again")
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
    here = os.path.dirname(sys.executable)
    hvd_bin = here if nccl_ready(here) else os.path.join(venv, "bin")
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
        build = Job(build_row(venv, bundle, cc_list=found.get("cc_list", "")), out, base_env, say)
        build_line = build.row
    table = [first, build_line, *rows]
    write = lambda: write_results(table, out, meta)
    text = execute(rows, out, deadline, base_env, build, write, say, found["gpus"])
    say(text)
    say(f"gpu-check: table in {os.path.join(out, 'gpu_check.md')} and gpu_check.json; each row's output in "
        f"{out}/<row>.log")
    return 1 if any(r.status == FAIL for r in table) else 0

"""The GPU check's runner, as pytest hooks: a row is a test whose ``row`` marker gives its estimate, pytest-timeout's
``timeout`` marker its limit and ``--session-timeout`` the call's budget. A row that would not fit what is left is
skipped as left for the next call; a row that passed in an earlier call (pytest's cache on a warm machine, the
archive ``--earlier`` names on a fresh one) is skipped with its figures kept. Whatever happens, the call ends by
writing the table (OUT/gpu_check.md, .json) and, with ``--archive DIR``, DIR/gpu-check.tgz, then printing it."""
from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import tarfile
import time

import pytest

from hybridtrain.files import atomic_path, write_json_atomically, write_text_atomically
from hybridtrain.reports import markdown_table

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PASSED_KEY = "gpu-check/passed"
ARCHIVE, ARCHIVE_LIMIT, LOG_TAIL = "gpu-check.tgz", 16 * 2**20, 256 * 1024
KEPT = (".md", ".json", ".jsonl", ".log", ".yaml", ".txt", ".xml")  # what comes back: no weights, venvs or data
MARK = "HYBRIDTRAIN_GPU_CHECK"  # in every row's environment: the next call finds a killed call's leftovers by it
START_S = 15  # --rehearse: a row still running after this has started
ROWS: dict = {}  # nodeid -> the row's line in the table, in the order the rows ran


def row(estimate_s: float, timeout_s: float):
    """A row: its estimate on one H200 (start-up included) and its limit (the function only: fixtures such as the
    Horovod build are not the row's time)."""
    def mark(test):
        return pytest.mark.row(estimate_s)(pytest.mark.timeout(timeout_s, func_only=True)(test))
    return mark


def pytest_addoption(parser):
    group = parser.getgroup("gpu-check")
    group.addoption("--archive", metavar="DIR", help="end by writing DIR/gpu-check.tgz (give the device's $OUT)")
    group.addoption("--earlier", metavar="TGZ", help="an earlier call's gpu-check.tgz: skip the rows it passed")
    group.addoption("--gpu-out", metavar="DIR", default=os.path.join(REPO, ".gpu-check", "out"), help="rows' logs")
    group.addoption("--rehearse", action="store_true", help="on a CPU: start every row's command, no GPU step")


def option(config, name: str, default=None):
    return config.getoption(name, default) if config is not None else default


def gpu_call(config) -> bool:
    return bool(option(config, "archive") or option(config, "rehearse"))


def pytest_configure(config):
    config.addinivalue_line("markers", "row(estimate_s): a GPU check row and its estimated seconds")  # stand-ins
    config.started = time.monotonic()
    config.earlier = {}
    if gpu_call(config):
        config.earlier = earlier_rows(config)  # a bad --earlier: one usage error before any row
        config.option.gpu_out = os.path.abspath(option(config, "gpu_out"))  # install.sh changes its folder
        os.makedirs(option(config, "gpu_out"), exist_ok=True)
        stop_leftovers()
        os.environ[MARK] = str(os.getpid())
        signal.signal(signal.SIGTERM, interrupted)  # the device call's limit: the table and archive still written


def interrupted(signum, frame):
    raise KeyboardInterrupt


def stop_leftovers(proc: str = "/proc") -> None:
    """Kill what an earlier call left running (a call killed at its limit leaves its rows' own sessions behind,
    holding GPU memory): every process whose environment carries the MARK of a call that has ended."""
    for pid in filter(str.isdigit, os.listdir(proc)):
        try:
            with open(os.path.join(proc, pid, "environ"), "rb") as fh:
                env = dict(e.split(b"=", 1) for e in fh.read().split(b"\0") if b"=" in e)
            mark = env.get(MARK.encode(), b"")
            if mark.isdigit() and not os.path.exists(os.path.join(proc, mark.decode())):
                os.kill(int(pid), signal.SIGKILL)
        except OSError:
            continue


def budget_left(config) -> float:
    total = option(config, "session_timeout") or 0
    return total - (time.monotonic() - config.started) if total else float("inf")


def earlier_rows(config) -> dict:
    """{nodeid: figures} of the rows that passed before: pytest's cache, and the archive of --earlier (read, never
    extracted: only its gpu_check.json, as JSON)."""
    rows = dict(config.cache.get(PASSED_KEY, {})) if config.cache is not None else {}
    path = option(config, "earlier")
    if path:
        try:
            with tarfile.open(path) as tar:
                saved = json.load(tar.extractfile("gpu-check/gpu_check.json"))
            rows.update({r["id"]: r["figures"] for r in saved["rows"] if r["result"] == "pass"})
        except (OSError, KeyError, ValueError, TypeError, tarfile.TarError, AttributeError) as exc:
            raise pytest.UsageError(f"--earlier {path}: not a gpu-check archive ({exc.__class__.__name__}): give "
                                    f"the gpu-check.tgz a call brought back") from None
    return rows


def pytest_runtest_setup(item):
    marker = item.get_closest_marker("row")
    if marker is None or not gpu_call(item.config):
        return
    item.config.running = item.nodeid
    if item.nodeid in item.config.earlier:
        item.user_properties += [*item.config.earlier[item.nodeid].items(), ("earlier call", True)]
        pytest.skip("passed in an earlier call")
    left = budget_left(item.config)
    if marker.args[0] > left:
        pytest.skip(f"left for the next call (estimated {marker.args[0]:.0f} s, {max(left, 0):.0f} s left)")


def pytest_runtest_logreport(report):
    """Each row's line: its result, time, figures (record_property) and, failed or skipped, why in one line."""
    if "row" not in report.keywords or (report.when != "call" and report.outcome == "passed"):
        return
    line = ROWS.setdefault(report.nodeid, {"id": report.nodeid, "result": "", "seconds": 0.0, "figures": {},
                                           "note": ""})
    line["seconds"] += report.duration
    line["figures"].update(dict(report.user_properties))
    earlier = line["figures"].pop("earlier call", False)
    if report.failed:
        line["result"] = "fail"
        crash = getattr(getattr(report.longrepr, "reprcrash", None), "message", "")
        line["note"] = (crash or last_line(report.longreprtext)).splitlines()[0][:300] if report.longrepr else ""
    elif report.skipped:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        line["result"] = "pass" if earlier else "skip"
        line["note"] = reason.removeprefix("Skipped: ")
    elif not line["result"]:
        line["result"] = "pass"


def format_table(rows: list[dict]) -> str:
    return markdown_table(["row", "result", "s", "figures", "note"], [[
        r["id"].split("::")[-1], "**FAIL**" if r["result"] == "fail" else r["result"], f"{r['seconds']:.0f}",
        ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in r["figures"].items()),
        r["note"]] for r in rows])


@pytest.hookimpl(trylast=True)  # after junitxml has written its report: it goes into the archive too
def pytest_sessionfinish(session, exitstatus):
    config = session.config
    if not gpu_call(config):
        return
    running = getattr(config, "running", None)
    if exitstatus == pytest.ExitCode.INTERRUPTED and running and not ROWS.get(running, {}).get("result"):
        ROWS[running] = {"id": running, "result": "skip", "seconds": 0.0, "figures": {},
                         "note": "left for the next call (the call was stopped)"}
    out, rows = option(config, "gpu_out"), list(ROWS.values())
    failed = [r["id"] for r in rows if r["result"] == "fail"]
    head = f"# hybridtrain GPU check: {'FAILED: ' + ', '.join(failed) if failed else 'every row that ran passed'}"
    config.table = f"{head}\n\n{format_table(rows)}\n"
    write_text_atomically(os.path.join(out, "gpu_check.md"), config.table)
    write_json_atomically(os.path.join(out, "gpu_check.json"), {"passed": not failed, "rows": rows})
    if config.cache is not None and not option(config, "rehearse"):
        passed = dict(config.cache.get(PASSED_KEY, {}))
        passed.update({r["id"]: r["figures"] for r in rows if r["result"] == "pass"})
        config.cache.set(PASSED_KEY, passed)
    if option(config, "archive"):
        config.table += f"\narchive: {write_archive(out, option(config, 'archive'))}\n"


def pytest_terminal_summary(terminalreporter, config):
    if getattr(config, "table", None):
        terminalreporter.write("\n" + config.table)


def read_tail(path: str, limit: int | None) -> bytes:
    with open(path, "rb") as fh:
        if limit is not None and os.path.getsize(path) > limit:
            fh.seek(-limit, os.SEEK_END)
        return fh.read()


def write_archive(out: str, folder: str) -> str:
    """folder/gpu-check.tgz of out's tables, logs and figures (links, venvs and data left out); logs cut to their
    last LOG_TAIL bytes, then less, when the whole would pass ARCHIVE_LIMIT."""
    os.makedirs(folder, exist_ok=True)
    names = []
    for root, dirs, files in os.walk(out):
        dirs[:] = sorted(d for d in dirs if not d.endswith("venv") and d not in ("data", "cache"))
        names += [os.path.relpath(os.path.join(root, f), out) for f in sorted(files)
                  if f.endswith(KEPT) and not os.path.islink(os.path.join(root, f))]
    for tail in (None, LOG_TAIL, LOG_TAIL // 16):
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
            for name in names:
                data = read_tail(os.path.join(out, name), tail if name.endswith(".log") else None)
                info = tarfile.TarInfo(os.path.join("gpu-check", name))
                info.size, info.mtime = len(data), int(time.time())
                tar.addfile(info, io.BytesIO(data))
        if buffer.tell() <= ARCHIVE_LIMIT:
            break
    path = os.path.join(folder, ARCHIVE)
    with atomic_path(path) as tmp, open(tmp, "wb") as fh:
        fh.write(buffer.getvalue())
    return path


# ----------------------------------------------------------------------------- running a row's command

def stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM to the row's process group (the launcher and its ranks), SIGKILL after 15 s."""
    for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
            proc.wait(timeout=wait)
            return
        except ProcessLookupError:
            return
        except subprocess.TimeoutExpired:
            continue


def wants_the_gpu(text: str) -> bool:
    """A row's own one-line refusal for want of the CUDA GPU a CPU machine lacks: it got as far as its GPU step."""
    return any("hybridtrain: error:" in line and ("CUDA" in line or "GPU" in line) for line in text.splitlines())


def run_command(config, name: str, argv: list, env: dict | None = None, cwd: str = REPO) -> int:
    """The row's command in its own session, its output in OUT/<name>.log; its exit status. Stopped (with its
    ranks) at the budget's end (the row is then skipped, left for the next call) or at the row's timeout.
    --rehearse: skipped once started (still running after START_S, ended well, or ended on its refusal for want
    of a GPU); a command that breaks otherwise fails its row."""
    log_path = os.path.join(option(config, "gpu_out"), f"{name}.log")
    rehearse = option(config, "rehearse")
    wait = min(budget_left(config), START_S if rehearse else float("inf"))
    with open(log_path, "w") as log:
        log.write("$ " + " ".join(map(str, argv)) + "\n")
        log.flush()
        proc = subprocess.Popen(list(map(str, argv)), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                cwd=cwd, env={**os.environ, "PYTHONPATH": REPO, "PYTHONUNBUFFERED": "1", **(env or {})},
                                start_new_session=True)
    try:
        rc = proc.wait(timeout=None if wait == float("inf") else max(wait, 1))
    except subprocess.TimeoutExpired:
        stop_group(proc)
        pytest.skip("rehearsed: started" if rehearse else "left for the next call (stopped at the budget's end)")
    finally:
        stop_group(proc)  # pytest-timeout's failure, a KeyboardInterrupt: no rank outlives its row
    if rehearse:
        text = read_tail(log_path, 8192).decode("utf-8", "replace")
        if rc == 0 or wants_the_gpu(text):
            pytest.skip("rehearsed: ended well or on its refusal for want of a GPU")
        pytest.fail(f"{name}: exit {rc}: {last_line(text)}")
    return rc


def refused(node: dict, precision: str) -> None:
    """Skip a row in a precision the node checks refuse (bf16 below sm_80), saying why."""
    line = node["checks"].get(precision, ["", []])[0]
    if line:
        pytest.skip(f"not run: {line}")


def last_line(text: str) -> str:
    lines = [s.strip() for s in text.splitlines() if s.strip()]
    return lines[-1][:300] if lines else ""

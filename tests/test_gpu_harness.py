"""The GPU check (tests/gpu) on the CPU: its runner on stand-in rows as real pytest sessions; the real rows without
a GPU; the plan and the device time; the rows' configs, probe and build on a stand-in H200; the forced-hooks row's
command; the resume driver; the bundle; and the rehearsal with the network cut."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time

import pytest
import yaml
from conftest import CACHE, REPO, run, tiny_config

TESTS = os.path.join(REPO, "tests")
sys.path.insert(0, TESTS)
from gpu import harness, test_rows  # noqa: E402

STAND_IN_ROWS = '''
import sys
from gpu.harness import row, run_command
py = [sys.executable, "-c"]

@row(5, 60)
def test_passes(pytestconfig, record_property):
    assert run_command(pytestconfig, "passes", py + ["print('ok')"]) == 0
    record_property("img/s", 123.5)

@row(5, 60)
def test_raises(record_property):
    record_property("img/s", 7.0)  # measured before the later step fails: kept
    {}["missing"]

@row(5, 3)
def test_hangs(pytestconfig):
    run_command(pytestconfig, "hangs", py + ["import os, time; open(os.environ['PID_FILE'], 'w').write(str(os.getpid()))"
                                             "; time.sleep(120)"])

@row(5000, 60)
def test_too_long():
    pass

@row(5, 60)
def test_wants_the_gpu(pytestconfig):
    run_command(pytestconfig, "wants", py + ["print('hybridtrain: error: train.device=cuda but no CUDA'); exit(2)"])

@row(5, 60)
def test_breaks(pytestconfig):
    run_command(pytestconfig, "breaks", py + ["print('hybridtrain: error: no such option --fast'); exit(2)"])
'''


def session(folder, *args, wait: bool = True):
    """A pytest session over the stand-in rows, with the GPU check's runner as their conftest (its Popen when not
    ``wait``)."""
    rows = folder / "rows"
    if not rows.exists():
        rows.mkdir()
        (rows / "conftest.py").write_text(f"import sys\nsys.path.insert(0, {TESTS!r})\nfrom gpu.harness import *\n")
        (rows / "test_stand_in.py").write_text(STAND_IN_ROWS)
    argv = [sys.executable, "-m", "pytest", str(rows), "-q", "-p", "no:randomly", "--rootdir", str(rows), "--gpu-out",
            str(folder / "out"), "-o", f"cache_dir={folder / 'cache'}", *args]
    how = dict(cwd=str(folder), stdin=subprocess.DEVNULL, env={**os.environ, "PID_FILE": str(folder / "pid")})
    if not wait:
        return subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, **how)
    return subprocess.run(argv, capture_output=True, text=True, timeout=300, **how)


def archived(path) -> dict:
    with tarfile.open(path) as tar:
        return {name: tar.extractfile(name).read() for name in tar.getnames()}


def results(archive) -> dict:
    return {r["id"].split("::")[-1]: r for r in json.loads(archived(archive)["gpu-check/gpu_check.json"])["rows"]}


def test_each_row_fails_alone_and_the_call_ends_with_its_table_and_archive(tmp_path):
    proc = session(tmp_path, "--archive", str(tmp_path / "back"), "--session-timeout", "200",
                   "--junitxml", str(tmp_path / "out" / "junit.xml"), "-k", "not wants and not breaks")
    assert proc.returncode == 1, proc.stdout[-3000:]
    rows = results(tmp_path / "back" / "gpu-check.tgz")
    assert rows["test_passes"]["result"] == "pass" and rows["test_passes"]["figures"] == {"img/s": 123.5}
    assert rows["test_raises"]["result"] == "fail" and rows["test_raises"]["figures"] == {"img/s": 7.0}
    assert "KeyError" in rows["test_raises"]["note"]
    assert rows["test_hangs"]["result"] == "fail" and "Timeout" in rows["test_hangs"]["note"]
    assert rows["test_too_long"]["result"] == "skip" and "left for the next call" in rows["test_too_long"]["note"]
    with pytest.raises(ProcessLookupError):  # the hung row's process went with its row
        os.kill(int((tmp_path / "pid").read_text()), 0)
    names = archived(tmp_path / "back" / "gpu-check.tgz")
    assert {"gpu-check/gpu_check.md", "gpu-check/junit.xml", "gpu-check/passes.log"} <= set(names)
    assert "| test_raises | **FAIL** |" in proc.stdout and "archive: " in proc.stdout  # the table, printed


def test_a_call_stopped_by_sigterm_ends_with_its_table_and_archive_and_no_row_left_running(tmp_path):
    proc = session(tmp_path, "--archive", str(tmp_path / "back"), "-k", "hangs", "-p", "no:timeout", wait=False)
    for _ in range(600):
        if (tmp_path / "pid").exists():
            break
        time.sleep(0.1)
    proc.terminate()  # the device tool's limit
    stdout, _ = proc.communicate(timeout=120)
    assert "| test_hangs | skip | 0 |  | left for the next call (the call was stopped) |" in stdout
    assert results(tmp_path / "back" / "gpu-check.tgz")["test_hangs"]["result"] == "skip"
    with pytest.raises(ProcessLookupError):
        os.kill(int((tmp_path / "pid").read_text()), 0)


def test_what_passed_is_skipped_on_a_warm_machine_and_a_fresh_one_and_a_calls_leftovers_are_stopped(tmp_path):
    first, fresh = tmp_path / "first", tmp_path / "fresh"  # fresh: no cache, no out folder, only call 1's archive
    first.mkdir(), fresh.mkdir()
    ended = subprocess.Popen(["true"])  # an earlier call, killed: its row goes on
    ended.wait()
    leftover = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True,
                                env={**os.environ, harness.MARK: str(ended.pid)})
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        session(first, "--archive", str(first / "back"), "-k", "passes or raises")
        assert leftover.wait(timeout=30) == -9 and bystander.poll() is None
    finally:
        for proc in (leftover, bystander):
            proc.kill()
            proc.wait()
    (first / "out" / "passes.log").unlink()
    session(first, "--archive", str(first / "back2"), "-k", "passes or raises")
    session(fresh, "--archive", str(fresh / "back"), "--earlier", str(first / "back" / "gpu-check.tgz"), "-k",
            "passes or raises")
    for rows in (results(first / "back2" / "gpu-check.tgz"), results(fresh / "back" / "gpu-check.tgz")):
        assert rows["test_passes"] == {**rows["test_passes"], "result": "pass", "note": "passed in an earlier call",
                                       "figures": {"img/s": 123.5}}
        assert rows["test_raises"]["result"] == "fail"
    assert not (first / "out" / "passes.log").exists() and not (fresh / "out" / "passes.log").exists()
    bad = session(fresh, "--archive", str(fresh / "back"), "--earlier", str(first / "out" / "gpu_check.md"))
    assert bad.returncode == 4 and "not a gpu-check archive" in bad.stderr


def test_the_rehearsal_passes_a_row_that_reaches_its_gpu_step_and_fails_one_that_breaks(tmp_path):
    proc = session(tmp_path, "--rehearse", "-k", "wants or breaks or passes")
    rows = {r["id"].split("::")[-1]: r for r in json.loads((tmp_path / "out" / "gpu_check.json").read_text())["rows"]}
    assert rows["test_wants_the_gpu"]["result"] == "skip" and rows["test_passes"]["result"] == "skip"
    assert rows["test_breaks"]["result"] == "fail" and "no such option --fast" in rows["test_breaks"]["note"]
    assert proc.returncode == 1


def test_without_a_gpu_every_row_is_skipped_and_the_documented_call_brings_back_its_archive(tmp_path):
    """The device line, exactly as docs/benchmarks.md gives it, under the tool's 2,000 characters; run here with
    $OUT set, it ends with the table and one archive in $OUT."""
    text = open(os.path.join(REPO, "docs", "benchmarks.md")).read()
    calls = dict(re.findall(r"<!-- GPU check (call \d) -->\n```bash\n(.*?)\n```", text, re.S))
    assert set(calls) == {"call 1", "call 2"} and all(len(line) < 2000 for line in calls.values())
    out = tmp_path / "OUT"
    out.mkdir()
    proc = subprocess.run(["bash", "-c", calls["call 1"]], cwd=REPO, capture_output=True, text=True, timeout=300,
                          stdin=subprocess.DEVNULL, env={**os.environ, "OUT": str(out),
                                                         "PATH": os.path.dirname(sys.executable) + ":" +
                                                         os.environ["PATH"]})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert os.listdir(out) == ["gpu-check.tgz"] and "| test_node | skip |" in proc.stdout
    rows = results(out / "gpu-check.tgz")
    assert len(rows) >= 8 and all(r["note"].startswith("no CUDA GPU here") for r in rows.values())


def test_call_one_holds_the_headline_rows_and_the_largest_batch_and_the_device_time_holds():
    """Call 1's rows in their order fit its 520 s budget: the node, both precisions' step against the plain loop,
    graphs, compile, resume and the largest batch (Horovod's rows wait for the build). Its timeout_s 580 covers the
    budget, a row stopped at its end (15 + 5 s) and pytest's start and the archive (40 s); the machine's start
    (at most 120 s), call 1 and the 30 s warm tail leave call 2 at least 140 s of the 900 s of device time."""
    used, call_1 = 0, []
    for name, test in vars(test_rows).items():
        marks = {m.name: m for m in getattr(test, "pytestmark", [])}
        needs = "horovod" in test.__code__.co_varnames[:test.__code__.co_argcount] if callable(test) else True
        for _ in (marks["parametrize"].args[1] if "parametrize" in marks else [0]) if "row" in marks else []:
            if not needs and used + marks["row"].args[0] <= 520:
                used, call_1 = used + marks["row"].args[0], call_1 + [name]
    assert call_1 == ["test_node", "test_step_against_plain_loop", "test_step_against_plain_loop",
                      "test_graphed_step", "test_compiled_step", "test_resume_is_bitwise", "test_largest_batch"]
    assert 520 + 20 + 40 <= 580 and 900 - 120 - 580 - 30 >= 140
    text = open(os.path.join(REPO, "docs", "benchmarks.md")).read()
    assert "timeout_s 580" in text and "--session-timeout 520" in text and "$((BUDGET_LEFT - 90))" in text


def test_the_largest_batch_starts_from_a_prediction_that_holds_on_141_gb():
    """The H100's line (reserved 431 MiB + 42.1 MiB an image, mixed-bf16 NHWC) predicts 3072 on an H200 (143,771
    MiB): the search then tries 3072, 6144, 4608, 3840, 3456 (five trials, not six from 1536), and on the H100
    (81,079 MiB) 1536, below the 1746 that fit there with today's 5% and 3 GiB left free."""
    from benchmarks.max_batch import search_max_batch
    for total, predicted, largest in ((143771, 3072, 3072), (81079, 1536, 1536)):
        start = test_rows.predicted_max_batch(total)
        tried = []
        limit = 0.95 * total - 3072

        def fits(b):
            tried.append(b)
            return 431 + 42.1 * b <= limit
        assert start == predicted and search_max_batch(fits, start, 256) == largest
        assert len(tried) <= 5 and fits(start)
    assert (0.95 * 81079 - 3072 - 431) / 42.1 == pytest.approx(1746, abs=1)


def test_every_rows_config_passes_the_checks_it_meets_on_an_h200(tmp_path, monkeypatch):
    """Each bench row's config as bench loads it, through check_machine on a stand-in CUDA device of the lent kind
    (sm_90), and the Horovod rows' graphs and wire through Horovod's wrap-time check at their one rank."""
    import torch

    from benchmarks.bench_sets import row_sets
    from hybridtrain.config import load_config
    from hybridtrain.distributed.horovod import check_graphs_and_compression
    from hybridtrain.hardware.checks import check_machine
    from hybridtrain.precision.policy import resolve_policy
    for name, value in {"is_available": lambda: True, "get_device_capability": lambda *a: (9, 0),
                        "get_device_name": lambda *a: "NVIDIA H200", "device_count": lambda: 1}.items():
        monkeypatch.setattr(torch.cuda, name, value)
    rows = [("mixed-fp16", ()), ("mixed-bf16", ()), ("mixed-fp16", test_rows.GRAPHED), ("mixed-bf16", test_rows.COMPILED)]
    for precision, extra in rows:  # each bench row's config as bench loads it (--channels-last, --batch-size 256)
        sets = [*extra[1::2], "data.channels_last=true"]
        cfg = load_config(None, row_sets(sets, precision, test_rows.BATCH), for_command="bench")
        check_machine(cfg, resolve_policy(cfg.precision), torch.device("cuda", 0))
    hooks = test_rows.train_sets(str(tmp_path), "mixed-fp16") + ["--set", "distributed.compression=fp16"]
    cfg = load_config(test_rows.RECIPE, [hooks[i + 1] for i in range(0, len(hooks), 2)])
    assert cfg.distributed.compression == "fp16" and cfg.data.channels_last and not cfg.train.cuda_graphs
    check_graphs_and_compression(cfg.train.cuda_graphs, cfg.distributed.compression, 1)


SHIM = ("import torch, hybridtrain.hardware.checks as c\ntorch.cuda.is_available = lambda: True\n"
        "torch.cuda.get_device_name = lambda *a: 'NVIDIA H200'\ntorch.cuda.get_device_capability = lambda *a: (9, 0)\n"
        "torch.cuda.get_device_properties = lambda *a: type('P', (), {'total_memory': 143771 * 2**20})\n"
        "c.driver_api_version = lambda: %d\n")


@pytest.mark.parametrize("driver, refusal", [(13000, ""), (12040, "driver supports CUDA 12.4")])
def test_the_node_probe_on_a_stand_in_h200(driver, refusal):
    """The probe's GPU branch, its torch's real arch list and node checks, on a stand-in H200 (sm_90) with driver
    API 13000 (r580), and one too old for torch's CUDA 13, which test_node fails on."""
    from gpu.conftest import PROBE
    proc = subprocess.run([sys.executable, "-c", SHIM % driver + PROBE], capture_output=True, text=True, timeout=120,
                          cwd=REPO)
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    assert found["name"] == "NVIDIA H200" and found["cc"] == "90" and found["total_mb"] == 143771
    assert set(found["checks"]) == {"fp32", "mixed-fp16", "mixed-bf16"}
    if refusal:
        assert all(refusal in line for line, _ in found["checks"].values())
    else:
        assert all(check == ["", []] for check in found["checks"].values()), found["checks"]


def test_a_failed_build_keeps_install_shs_line_and_the_last_2000_lines_of_its_log(tmp_path):
    from gpu.conftest import Build
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "install-1.log").write_text("".join(f"line {i}\n" for i in range(3000)))
    (tmp_path / "build.log").write_text("Traceback: ModuleNotFoundError\ninstall: error: no nvcc: set CUDA_HOME\n")
    job = Build.__new__(Build)
    job.cache, job.log = str(tmp_path / "cache"), str(tmp_path / "build.log")
    job.config = type("Config", (), {"getoption": lambda self, name, default=None: str(tmp_path)})()
    assert job.failure(1) == "Horovod build: install: error: no nvcc: set CUDA_HOME"
    kept = (tmp_path / "build-install.log").read_text().splitlines()
    assert len(kept) == 2000 and kept[0] == "line 1000" and kept[-1] == "line 2999"


def test_horovods_hooks_run_on_one_rank_as_the_gpu_row_forces_them(tmp_path):
    """The GPU row's way to Horovod's hooks on one rank (HOROVOD_ELASTIC=1 under a static horovodrun), on the CPU
    with the demo's recipe: training ends well and the timeline names the gradients' all-reduces, which a plain
    1-rank job never does (Horovod registers no hooks at size 1)."""
    sets = ["data.backend=synthetic", "train.epochs=2", "optim.adabound_epochs=1", "data.synthetic_images=32",
            "train.batch_size=16", f"run_dir={tmp_path / 'run'}", "report.tensorboard=false", "train.progress=false"]
    argv, env, timeline = test_rows.hooks_forced(os.path.dirname(sys.executable), str(tmp_path),
                                                 os.path.join(REPO, "configs", "demo.yaml"),
                                                 [a for s in sets for a in ("--set", s)])
    proc = subprocess.run(list(map(str, argv)), capture_output=True, text=True, timeout=600, cwd=REPO,
                          env={**os.environ, **env}, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    text = open(timeline).read()
    assert "allreduce.conv1.weight" in text and "allreduce.fc.weight" in text


def test_the_resume_driver_finds_a_resumed_torch_engine_run_bitwise_equal(tmp_path, small_digits):
    cfg = tiny_config(small_digits, str(tmp_path / "unused"), train={"epochs": 2, "batch_size": 16, "threads": 1,
                                                                     "progress": False, "device": "cpu"})
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(cfg))
    driver = os.path.join(TESTS, "gpu", "resume_check.py")
    proc = run([sys.executable, driver, str(tmp_path / "check"), str(tmp_path / "cfg.yaml"), "--set",
                "train.deterministic=true"], timeout=900)
    assert proc.returncode == 0 and "bitwise equal" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert not [f for f in os.listdir(tmp_path / "check" / "straight") if f.endswith(".pt")]  # weights dropped


def test_make_gpu_bundle_holds_the_build_for_python_3_12_and_help_makes_no_folder(tmp_path):
    proc = subprocess.run([sys.executable, os.path.join(REPO, "tools", "gpu_bundle.py"), "--help"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "make gpu-bundle" in proc.stdout and os.listdir(tmp_path) == []
    proc = subprocess.run(["make", "-s", "gpu-bundle"], cwd=REPO, capture_output=True, text=True, timeout=300,
                          stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    files = os.listdir(os.path.join(REPO, ".gpu-bundle"))
    for prefix in ("horovod-0.28.1.tar.gz", "cffi-", "pycparser-", "setuptools-", "wheel-"):
        assert any(f.startswith(prefix) for f in files), (prefix, files)
    assert any(f.startswith("cffi-") and "-cp312-" in f for f in files)
    assert float(proc.stdout.split(") ")[-1].split(" MiB")[0]) < 64, proc.stdout


@pytest.mark.timeout(2400)  # a first NCCL build on 2 cores: about 10 min; seconds once its wheel is cached
@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"), reason="cutting the network needs root")
@pytest.mark.skipif(not os.environ.get("HYBRIDTRAIN_REHEARSAL"), reason="5-6 minutes of 2 cores with the NCCL wheel "
                    "cached: HYBRIDTRAIN_REHEARSAL=1 runs it (before a GPU call, and after a change to tests/gpu)")
def test_the_rehearsal_passes_offline_with_an_nccl_build(tmp_path):
    """make gpu-rehearsal: the network cut, an image-like venv (torch, no Horovod, cffi or torchrun), Horovod built
    with NCCL for sm_90 from the bundle (this machine has nvcc and torch's NCCL wheel, as the lent one), and every
    row's command started: each gets as far as its GPU step. The NCCL wheel is reused from install.sh's cache."""
    if not os.path.isfile(os.path.join(REPO, ".gpu-bundle", "horovod-0.28.1.tar.gz")):
        subprocess.run(["make", "-s", "gpu-bundle"], cwd=REPO, check=True, timeout=300, stdin=subprocess.DEVNULL)
    shutil.rmtree(os.path.join(REPO, ".gpu-check", "rehearsal"), ignore_errors=True)
    began = time.monotonic()
    proc = subprocess.run(["make", "-s", "gpu-rehearsal", f"VENV={os.path.dirname(os.path.dirname(sys.executable))}"],
                          cwd=REPO, capture_output=True, text=True, timeout=2300, stdin=subprocess.DEVNULL,
                          env={**os.environ, "HYBRIDTRAIN_CACHE": CACHE})
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    rows = results(os.path.join(REPO, ".gpu-check", "rehearsal", "gpu-check.tgz"))
    assert len(rows) >= 9 and all(r["result"] in ("pass", "skip") for r in rows.values())
    assert all(r["note"].startswith("rehearsed") for n, r in rows.items() if n != "test_node")
    venv = os.path.join(REPO, ".gpu-check", "rehearsal", "venv", "bin")
    # horovodrun imports torch and Horovod's NCCL build: about a minute on 2 loaded cores
    assert "[X] NCCL" in subprocess.run([os.path.join(venv, "horovodrun"), "--check-build"], capture_output=True,
                                        text=True, timeout=600).stdout
    print(f"make gpu-rehearsal: {time.monotonic() - began:.0f} s")

"""``hybridtrain gpu-check``: the whole GPU path of the project on one machine, in one command.

It starts from a bare GPU machine (Python, torch and torchvision installed system-wide, no network, no
Horovod) and a wheelhouse folder (docs/benchmarks.md lists its files). Every step is a row of one table and
one real process whose whole output goes to ``OUT/<row>.log``:

0. ``node-check``: the trainer's own node checks (``hybridtrain.distributed.node.check_node``: torch's kernels for
   this GPU, the driver against torch's CUDA, bf16 below sm_80, FP16 on a P40) per precision, first; a refusal
   in fp32 ends the check in one line, and the rows of a refused precision say ``not run`` and why;
1. ``build``: Horovod with NCCL, by the project's ``install.sh`` into a venv that sees the system torch
   (skipped when ``horovod.torch`` with NCCL already imports, here or in that venv);
2. ``gpu-tests``: the tests that run on the GPU when it has one (host syncs, compiled and graphed steps);
3. ``train-1rank-<precision>-<mode>``: ``horovodrun -np 1 hybridtrain train`` with the H100 recipe on
   synthetic input, fp32 / mixed-fp16 / mixed-bf16, each eager, compiled and graphed: steady img/s (the
   epochs after the first), peak memory from ``metrics.jsonl``;
4. ``train-2ranks-...``: two ranks over NCCL when there are 2+ GPUs (a ``not run`` row otherwise);
5. ``bench-<precision>``: ``hybridtrain bench --baseline --horovod``: the trainer's step, and the whole step as
   ``train`` runs it under horovodrun, against a plain PyTorch loop; ``bench-mixed-fp16-fused`` the same with
   ``optim.fused`` (the optimizer's compiled kernels), and ``bench-optim`` the optimizer step alone in both
   phases, foreach and fused, against ``torch.optim.SGD``.

The table goes to the console, ``OUT/gpu_check.md`` and ``OUT/gpu_check.json``; the exit status is 1 when a
row failed. Rows run under one time budget (``--budget-s``, default 510 s, the build included) so the check
ends within 9 minutes; a row that cannot start inside it fails with ``not run: time budget spent`` and a
second run (the build is reused) finishes it.

Only the standard library is imported here (the bare machine's Python has no PyYAML), and this process never
imports torch: :func:`cuda_devices` asks a child process.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Callable

from hybridtrain.engine.metrics_file import read_metrics
from hybridtrain.errors import UserError
from hybridtrain.outputs import markdown_table

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RECIPE = os.path.join("configs", "resnet50_h100.yaml")
HOROVOD_SDIST = "horovod-0.28.1.tar.gz"

PRECISIONS = ("fp32", "mixed-fp16", "mixed-bf16")
BENCH_PRECISIONS = ("mixed-fp16", "mixed-bf16")
FUSED_BENCH_PRECISION = "mixed-fp16"  # bench with optim.fused: the precision MLPerf's H100 submissions train in
MODES = {"eager": [], "compiled": ["train.compile=true"], "graphed": ["train.cuda_graphs=true"]}
QUICK_MODE_PRECISION = "mixed-bf16"  # --quick: compiled and graphed for this precision only (the recipe's)
BATCH = 256                 # the recipe's per-GPU batch
STEPS_PER_EPOCH = 30        # per epoch, so epoch 2 times 30 steps after epoch 1 warmed up
EPOCHS = 2                  # epoch 1: cudnn autotuning, compilation, graph capture; epoch 2: the steady one
BENCH_STEPS, BENCH_WARMUP = 20, 5

# pytest -k over tests/test_step_speed.py: the tests that use the GPU when there is one (their device() is
# cuda) or run only there (test_graphed_steps_give_the_eager_losses skips without CUDA)
# (test_fused_updates_... runs its compiled optimizer kernels on the GPU when there is one)
GPU_TESTS = ["tests/test_step_speed.py", "tests/test_optim_math.py", "-k",
             "guard_counts or reads_only or one_host_sync or compiled_steps or graphed_steps or hooks_firing "
             "or hooks_forced or fused_updates"]

BUDGET_S = 510              # the whole check, the build included: under 9 minutes with the report
MIN_ROW_S = 30              # a row is not started with less than this left of the budget
TIMEOUT_S = {"build": 900, "tests": 240, "eager": 120, "graphed": 150, "compiled": 300, "bench": 240,
             "bench-optim": 240, "2ranks": 180}
PROGRESS_EVERY_S = 30

NO_GPU = ("gpu-check needs a CUDA GPU and this machine has none (torch.cuda.is_available() is False): "
          "run it on a GPU node")
ONE_GPU_NOTE = ("not run: one GPU, and NCCL refuses two ranks on one device; the CPU tests cover the gradient "
                "hook path (2-rank Gloo jobs in tests/)")

PASS, FAIL, NOT_RUN = "pass", "fail", "not run"


@dataclass
class Row:
    """One line of the table: what to run and, once run, what it gave (None: not measured, shown n/a)."""
    name: str                   # also the log's name: OUT/<name>.log
    kind: str                   # build, tests, train, bench, bench-optim or note (a row that says why nothing ran)
    argv: list = field(default_factory=list)
    timeout_s: float = 0.0
    precision: str = ""
    mode: str = ""              # eager, compiled or graphed; a bench row: eager, or fused (optim.fused)
    ranks: int = 1
    output: str = ""            # train: the run directory; bench: the JSON file
    env: dict = field(default_factory=dict)  # added to the environment
    status: str = "pending"     # pass, fail or not run
    seconds: float | None = None
    images_per_sec: float | None = None           # steady, all ranks together
    baseline_images_per_sec: float | None = None  # bench: the plain loop's
    ratio: float | None = None                    # per GPU, ÷ the plain loop of the same precision
    peak_allocated_mb: float | None = None
    peak_reserved_mb: float | None = None
    device_used_mb: float | None = None
    detail: str = ""


# ----------------------------------------------------------------------------- before any work

def check_out_dir(path: str) -> str:
    """The absolute output folder, after checking that it is (or can be made) a writable folder; nothing is
    created. A bad one is a UserError (one line)."""
    out = os.path.abspath(path)
    if os.path.exists(out):
        if not os.path.isdir(out):
            raise UserError(f"--out {path} is a file, not a folder: give a folder for the logs and the table")
        probe_writable(out, path)
        return out
    parent = os.path.dirname(out)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise UserError(f"--out {path} cannot be created: {parent} is a file, not a folder")
    probe_writable(parent, path)
    return out


def probe_writable(folder: str, given: str) -> None:
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as exc:
        raise UserError(f"--out {given}: cannot write in {folder} ({exc.strerror}): give a writable folder") from None


def check_wheelhouse(path: str | None) -> str | None:
    if path is None:
        return None
    folder = os.path.abspath(path)
    if not os.path.isdir(folder):
        raise UserError(f"--wheelhouse {path} is not a folder: prepare it as docs/benchmarks.md says")
    if not os.path.isfile(os.path.join(folder, HOROVOD_SDIST)):
        raise UserError(f"--wheelhouse {path} has no {HOROVOD_SDIST}: prepare it as docs/benchmarks.md says")
    return folder


def check_checkout(repo: str = REPO) -> None:
    needed = ("install.sh", RECIPE, "tests/test_step_speed.py")
    missing = [p for p in needed if not os.path.exists(os.path.join(repo, p))]
    if missing:
        raise UserError(f"gpu-check runs from a checkout of hybridtrain; {repo} has no {', '.join(missing)}: "
                        f"run it from the checkout (python -m hybridtrain gpu-check ...)")


CUDA_PROBE = ("import json, torch; ok = torch.cuda.is_available(); print(json.dumps("
              "[torch.cuda.device_count() if ok else 0, torch.cuda.get_device_name(0) if ok else '']))")


def cuda_devices(python: str = sys.executable) -> tuple[int, str]:
    """(number of CUDA GPUs, the first one's name), asked in a child process: this one never holds a CUDA
    context, which would count in every row's device memory. A machine without a GPU is a UserError."""
    try:
        proc = subprocess.run([python, "-c", CUDA_PROBE], capture_output=True, text=True, timeout=180,
                              stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise UserError(f"gpu-check could not ask torch for the GPUs with {python}: {exc}") from None
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"])[-1]
        raise UserError(f"gpu-check needs torch in this Python ({python}): {last}")
    count, name = json.loads(proc.stdout.strip().splitlines()[-1])
    if not count:
        raise UserError(NO_GPU)
    return count, name


NODE_PROBE = ("import json, torch\nfrom hybridtrain.distributed.node import check_node\n"
              "from hybridtrain.errors import UserError\nout = {}\nfor p in %r:\n    try:\n"
              "        out[p] = ['', check_node(torch.device('cuda', 0), p)]\n"
              "    except UserError as e:\n        out[p] = [str(e), []]\nprint(json.dumps(out))")


def node_checks(python: str = sys.executable, repo: str = REPO) -> dict:
    """The trainer's node checks (hybridtrain.distributed.node.check_node) on GPU 0 for every precision the check
    trains in, asked in a child process: {precision: (refusal line or '', [warnings])}."""
    env = {**os.environ, "PYTHONPATH": repo + os.pathsep + os.environ.get("PYTHONPATH", "")}
    try:
        proc = subprocess.run([python, "-c", NODE_PROBE % (PRECISIONS,)], capture_output=True, text=True,
                              timeout=180, stdin=subprocess.DEVNULL, env=env, cwd=repo)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise UserError(f"gpu-check could not run the node checks with {python}: {exc}") from None
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"])[-1]
        raise UserError(f"gpu-check's node checks failed in {python}: {last}")
    return {p: (line, warnings) for p, (line, warnings) in json.loads(proc.stdout.strip().splitlines()[-1]).items()}


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


# ----------------------------------------------------------------------------- Horovod with NCCL

def default_venv() -> str:
    cache = os.environ.get("HYBRIDTRAIN_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "hybridtrain")
    return os.path.join(cache, "gpu-venv")


def nccl_ready(bin_dir: str) -> bool:
    """True when bin_dir's python imports horovod.torch built with NCCL, and hybridtrain, horovodrun are there."""
    python = os.path.join(bin_dir, "python")
    if not all(os.path.exists(os.path.join(bin_dir, n)) for n in ("python", "hybridtrain", "horovodrun")):
        return False
    code = "import sys, hybridtrain, horovod.torch as hvd; sys.exit(0 if hvd.nccl_built() else 1)"
    try:
        return subprocess.run([python, "-c", code], capture_output=True, timeout=180,
                              stdin=subprocess.DEVNULL).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def build_row(venv: str, wheelhouse: str | None, repo: str = REPO) -> Row:
    env = {"HYBRIDTRAIN_TORCH": "system", "HYBRIDTRAIN_SKIP_DALI": "1", "HOROVOD_GPU_OPERATIONS": "NCCL",
           "HYBRIDTRAIN_VENV": venv}
    if wheelhouse:
        env["HYBRIDTRAIN_WHEELHOUSE"] = wheelhouse
    env["PYTHON"] = sys.executable  # the venv is made from it and sees its torch (install.sh: see_python_site)
    return Row("build", "build", [os.path.join(repo, "install.sh")], TIMEOUT_S["build"], env=env)


# ----------------------------------------------------------------------------- the rows

def precision_sets(spec: str) -> list[str]:
    """``mixed-bf16`` -> the config overrides it stands for."""
    mode, _, dtype = spec.partition("-")
    return [f"precision.mode={mode}"] + ([f"precision.compute_dtype={dtype}"] if dtype else [])


def train_sets(run_dir: str, precision: str, mode: str, ranks: int) -> list[str]:
    """Overrides of the H100 recipe: its own GPU or one error line (never the CPU), synthetic input, NHWC, two
    short epochs (T=1 AdaBound epoch, so the steady epoch is LARS-SGD), no TensorBoard."""
    return [f"run_dir={run_dir}", "train.device=cuda", "data.backend=synthetic", "data.channels_last=true",
            f"train.batch_size={BATCH}", f"data.synthetic_images={BATCH * STEPS_PER_EPOCH * ranks}",
            f"train.epochs={EPOCHS}", "optim.adabound_epochs=1", "train.progress=false", "train.keep_checkpoints=1",
            "report.tensorboard=false", *precision_sets(precision), *MODES[mode]]


def train_row(bin_dir: str, out: str, precision: str, mode: str, ranks: int, repo: str = REPO,
              engine: str = "horovod") -> Row:
    """A short training run of the H100 recipe under horovodrun, or (``engine`` torch) under torchrun: DDP with
    NCCL from the torch wheel and Gloo for the CPU collectives."""
    name = f"train-{ranks}rank{'s' if ranks > 1 else ''}-{precision}-{mode}" + ("-torch" if engine == "torch" else "")
    run_dir = os.path.join(out, "runs", name)
    launcher = ([os.path.join(bin_dir, "torchrun"), "--standalone", f"--nproc-per-node={ranks}", "--no-python"]
                if engine == "torch" else
                [os.path.join(bin_dir, "horovodrun"), "--gloo", "-np", str(ranks), "-H", f"localhost:{ranks}"])
    argv = [*launcher, os.path.join(bin_dir, "hybridtrain"), "train", "--config", os.path.join(repo, RECIPE),
            "--engine", engine]
    argv += [a for s in train_sets(run_dir, precision, mode, ranks) for a in ("--set", s)]
    timeout = TIMEOUT_S["2ranks"] if ranks > 1 else TIMEOUT_S[mode]
    return Row(name, "train", argv, timeout, precision, mode, ranks, output=run_dir)


def bench_row(bin_dir: str, out: str, precision: str, fused: bool = False) -> Row:
    """``bench --baseline`` at the recipe's batch, NHWC: with ``--horovod``, or (``fused``) with optim.fused."""
    name = f"bench-{precision}" + ("-fused" if fused else "")
    path = os.path.join(out, f"{name}.json")
    argv = [os.path.join(bin_dir, "hybridtrain"), "bench", "--precision", precision, "--channels-last", "--baseline",
            "--batch-size", str(BATCH), "--steps", str(BENCH_STEPS), "--warmup", str(BENCH_WARMUP), "--json", path]
    argv += ["--set", "optim.fused=true"] if fused else ["--horovod"]
    return Row(name, "bench", argv, TIMEOUT_S["bench"], precision, "fused" if fused else "eager", output=path)


def bench_optim_row(bin_dir: str, out: str) -> Row:
    """``bench-optim --fused``: ResNet-50's optimizer step alone, both phases, foreach and compiled."""
    path = os.path.join(out, "bench-optim.json")
    argv = [os.path.join(bin_dir, "hybridtrain"), "bench-optim", "--fused", "--steps", str(BENCH_STEPS), "--warmup",
            str(BENCH_WARMUP), "--json", path]
    return Row("bench-optim", "bench-optim", argv, TIMEOUT_S["bench-optim"], output=path)


def build_rows(gpus: int, quick: bool, out: str, bin_dir: str, repo: str = REPO) -> list[Row]:
    """The check's rows in the order they run: the GPU tests, eager training per precision, the bench against
    the plain loop (eager, then with the fused optimizer), the optimizer alone, CUDA graphs, two ranks (or the row
    saying why not), the torch engine (DDP, NCCL; two ranks when there are two GPUs), torch.compile (slowest:
    compiling)."""
    python = os.path.join(bin_dir, "python")
    rows = [Row("gpu-tests", "tests", [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", *GPU_TESTS],
                TIMEOUT_S["tests"])]
    rows += [train_row(bin_dir, out, p, "eager", 1, repo) for p in PRECISIONS]
    rows += [bench_row(bin_dir, out, p) for p in BENCH_PRECISIONS]
    rows += [bench_row(bin_dir, out, FUSED_BENCH_PRECISION, fused=True), bench_optim_row(bin_dir, out)]
    heavy = [QUICK_MODE_PRECISION] if quick else list(PRECISIONS)
    rows += [train_row(bin_dir, out, p, "graphed", 1, repo) for p in heavy]
    if gpus >= 2:
        rows.append(train_row(bin_dir, out, QUICK_MODE_PRECISION, "eager", 2, repo))
    else:
        rows.append(Row(f"train-2ranks-{QUICK_MODE_PRECISION}-eager", "note", precision=QUICK_MODE_PRECISION,
                        mode="eager", ranks=2, status=NOT_RUN, detail=ONE_GPU_NOTE))
    rows.append(train_row(bin_dir, out, QUICK_MODE_PRECISION, "eager", min(gpus, 2), repo, engine="torch"))
    rows += [train_row(bin_dir, out, p, "compiled", 1, repo) for p in heavy]
    return rows


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
    """SIGTERM to the row's process group (horovodrun and its ranks), SIGKILL after 15 s."""
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


def run_row(row: Row, out: str, deadline: float, base_env: dict, say: Callable[[str], None] = print,
            repo: str = REPO) -> Row:
    """Run ``row``'s command (output to OUT/<name>.log) within its timeout and the budget, then judge it."""
    if row.kind == "note":
        return row
    log_path = os.path.join(out, f"{row.name}.log")
    left = deadline - time.monotonic()
    if left < MIN_ROW_S:
        row.status, row.detail = FAIL, "not run: time budget spent (run again: the build is reused)"
        with open(log_path, "w") as log:
            log.write(f"$ {shlex.join(row.argv)}\n{row.detail}\n")
        return row
    timeout = min(row.timeout_s, left)
    if row.kind == "train" and os.path.isdir(row.output):
        shutil.rmtree(row.output)  # this row's run directory from an earlier check: the trainer starts fresh
    env = {**base_env, "PYTHONUNBUFFERED": "1", **row.env}
    say(f"gpu-check: {row.name}: running (timeout {timeout:.0f} s, log {log_path})")
    start = time.monotonic()
    with open(log_path, "w") as log:
        log.write("$ " + shlex.join([f"{k}={v}" for k, v in row.env.items()] + row.argv) + "\n")
        log.flush()
        proc = subprocess.Popen(row.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=repo,
                                env=env, start_new_session=True)
        rc, next_note = None, start + PROGRESS_EVERY_S
        while rc is None:
            try:
                rc = proc.wait(timeout=1.0)
            except subprocess.TimeoutExpired:
                now = time.monotonic()
                if now - start > timeout:
                    stop_group(proc)
                    break
                if now >= next_note:
                    say(f"  {row.name}: {now - start:.0f} s: {last_line(log_path)}")
                    next_note += PROGRESS_EVERY_S
    row.seconds = time.monotonic() - start
    if rc is None:
        row.status, row.detail = FAIL, f"timed out after {timeout:.0f} s"
    else:
        problem = judge(row, rc, log_path)
        row.status, row.detail = (FAIL, problem) if problem else (PASS, row.detail)
    if row.kind == "train":
        drop_weights(row.output)
    say(f"gpu-check: {row.name}: {row.status} in {row.seconds:.0f} s" + (f": {row.detail}" if row.detail else ""))
    return row


def judge(row: Row, rc: int, log_path: str) -> str:
    """'' when the row passed (its figures filled in), else what went wrong, in a few words."""
    if row.kind == "train":
        problem = read_train(row)
    elif row.kind == "bench":
        problem = read_bench(row)
    elif row.kind == "bench-optim":
        problem = read_bench_optim(row)
    elif row.kind == "tests":
        summary = last_line(log_path)
        row.detail = summary if "passed" in summary or "failed" in summary else ""
        problem = "" if rc == 0 else (row.detail or f"pytest exited {rc}")
    else:  # build: install.sh's own one-line error says what is missing
        errors = [line for line in read_text(log_path).splitlines() if line.startswith("install: error:")]
        problem = errors[-1][:300] if rc != 0 and errors else ""
    if rc != 0:
        return problem or f"exit status {rc} (see {os.path.basename(log_path)})"
    return problem


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
    try:
        with open(row.output) as fh:
            results = json.load(fh)
    except (OSError, ValueError) as exc:
        return f"no bench JSON ({exc.__class__.__name__})"
    trainer = next((r for r in results if r.get("loop") == "trainer"), None)
    baseline = next((r for r in results if r.get("loop") == "baseline"), None)
    if trainer is None or baseline is None:
        return "bench JSON lacks the trainer or the baseline row"
    row.images_per_sec, row.baseline_images_per_sec = trainer["images_per_sec"], baseline["images_per_sec"]
    row.ratio = baseline.get("trainer_over_baseline")
    row.peak_allocated_mb = trainer.get("peak_memory_mb")
    row.peak_reserved_mb = trainer.get("peak_memory_reserved_mb")
    row.device_used_mb = trainer.get("device_memory_used_mb")
    train = next((r for r in results if r.get("loop") == "train/horovod"), None)
    whole = f"; whole step under horovodrun {train['over_baseline']:.3f}x" if train and "over_baseline" in train else ""
    row.detail = (f"plain loop {row.baseline_images_per_sec:.0f} img/s; host syncs/step "
                  f"{trainer.get('host_syncs_per_step')}{whole}")
    return "" if row.images_per_sec > 0 and row.baseline_images_per_sec > 0 else "zero img/s"


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


def fill_ratios(rows: list[Row]) -> list[Row]:
    """Each training row's img/s per GPU ÷ the plain loop's img/s of the same precision (from its bench row)."""
    baselines = {r.precision: r.baseline_images_per_sec for r in rows
                 if r.kind == "bench" and r.mode == "eager" and r.baseline_images_per_sec}
    for r in rows:
        if r.kind == "train" and r.images_per_sec and r.precision in baselines:
            r.ratio = r.images_per_sec / r.ranks / baselines[r.precision]
    return rows


# ----------------------------------------------------------------------------- the table

def fmt(value: float | None, digits: int = 0) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def format_table(rows: list[Row]) -> str:
    header = ["row", "steady img/s", "÷ plain loop", "peak allocated MiB", "peak reserved MiB", "device used MiB",
              "result", "time s", "note"]
    return markdown_table(header, [[r.name, fmt(r.images_per_sec, 1), fmt(r.ratio, 3), fmt(r.peak_allocated_mb),
                                     fmt(r.peak_reserved_mb), fmt(r.device_used_mb),
                                     "**FAIL**" if r.status == FAIL else r.status, fmt(r.seconds),
                                     r.detail.replace("|", "/")] for r in rows])


def write_results(rows: list[Row], out: str, meta: dict) -> str:
    """OUT/gpu_check.md (the table under a few lines of context) and OUT/gpu_check.json; returns the markdown."""
    failed = [r.name for r in rows if r.status == FAIL]
    head = [f"# hybridtrain gpu-check: {'FAILED (' + ', '.join(failed) + ')' if failed else 'passed'}", ""]
    head += [f"- {key}: {value}" for key, value in meta.items()]
    text = "\n".join(head + ["", format_table(rows), ""])
    with open(os.path.join(out, "gpu_check.md"), "w") as fh:
        fh.write(text)
    with open(os.path.join(out, "gpu_check.json"), "w") as fh:
        json.dump({**meta, "passed": not failed, "failed": failed, "rows": [dataclasses.asdict(r) for r in rows]},
                  fh, indent=1)
    return text


# ----------------------------------------------------------------------------- the command

def run_gpu_check(out: str, wheelhouse: str | None = None, quick: bool = False, venv: str | None = None,
                  budget_s: float = BUDGET_S, say: Callable[[str], None] = print) -> int:
    """0 when every row passed, 1 otherwise; bad input or no GPU: UserError before any work."""
    if budget_s <= 0:
        raise UserError(f"--budget-s must be > 0, got {budget_s}")
    out = check_out_dir(out)
    wheelhouse = check_wheelhouse(wheelhouse)
    check_checkout()
    gpus, device = cuda_devices()
    checks = node_checks()
    first = node_row(checks)
    os.makedirs(out, exist_ok=True)
    deadline = time.monotonic() + budget_s
    meta = {"device": device, "gpus": gpus, "quick": quick, "budget_s": budget_s, "python": sys.executable}
    base_env = dict(os.environ)
    here = os.path.dirname(sys.executable)
    venv = os.path.abspath(venv or default_venv())
    say(f"gpu-check: {device} x {gpus}; output in {out}")
    if nccl_ready(here):
        bin_dir, build = here, Row("build", "build", status=PASS,
                                   detail=f"skipped: horovod.torch with NCCL imports in {sys.executable}")
    elif nccl_ready(os.path.join(venv, "bin")):
        bin_dir, build = os.path.join(venv, "bin"), Row("build", "build", status=PASS,
                                                        detail=f"skipped: {venv} has horovod.torch with NCCL")
    else:
        bin_dir, build = os.path.join(venv, "bin"), build_row(venv, wheelhouse)
        run_row(build, out, deadline, base_env, say)
        if build.status == PASS and not nccl_ready(bin_dir):
            build.status, build.detail = FAIL, f"install.sh ended but {bin_dir}/python has no horovod.torch with NCCL"
    meta["bin"] = bin_dir
    rows = [first, build]
    say(f"gpu-check: node checks: {first.detail}")
    if build.status == PASS:
        say(f"gpu-check: Horovod with NCCL from {bin_dir}")
        base_env["PATH"] = bin_dir + os.pathsep + base_env.get("PATH", "")
        for row in skip_refused(build_rows(gpus, quick, out, bin_dir), checks):
            rows.append(run_row(row, out, deadline, base_env, say))
    else:
        say("gpu-check: no Horovod with NCCL, so no other row can run")
    fill_ratios(rows)
    text = write_results(rows, out, meta)
    say(text)
    say(f"gpu-check: table in {os.path.join(out, 'gpu_check.md')} and gpu_check.json; each row's output in "
        f"{out}/<row>.log")
    return 1 if any(r.status == FAIL for r in rows) else 0

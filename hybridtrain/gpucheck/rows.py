"""gpu-check's rows: what each one runs, in which order, its estimated seconds on an H100 and the call it falls in.

The order is what users ask first, so that call 1 alone answers it: the whole training step per GPU against a
plain PyTorch AMP loop (ResNet-50, batch 256, NHWC, fp16 and bf16) on the torch engine and on Horovod, a real
training run with a checkpoint and an exact resume, the ResNet-50 step with CUDA graphs and with compile, the
largest batch. A second call goes on with training runs: Horovod's captured step, two ranks, compile across epochs,
the GPU tests. Horovod rows wait for Horovod's build (it runs in the background, niced, meanwhile).

CUDA graphs run where the step has them: the trainer's step in one process (``bench``), and training on the
Horovod engine. The torch engine refuses ``train.cuda_graphs`` (DDP's reducer hooks cannot be replayed; torch's
documented DDP capture needs NCCL's graph-safe mode and 11 eager warm-up iterations on a side stream, which no
CPU test can rehearse), so no row asks it for them: ``rehearsal.engine_refusals`` runs every row's config through
its engine's own checks.

Rows without Horovod run with the Python that runs the check (an image's venv: its torch as it is, no install)
and the checkout on PYTHONPATH; the torch engine starts as ``python -m torch.distributed.run`` (a venv seen
through a ``.pth`` has no ``torchrun`` script). Horovod rows run from the build's venv.

Estimates (seconds, one H100): from the one H100 run (``shared/evidence/h100-run1``: an eager ResNet-50 epoch of
200 steps at b=256 took 20-25 s, the first compiled epoch 45 s longer, bench's first step 20 s of cuDNN
autotuning; max batch 1816 in mixed-bf16) and review 3's estimates for start-up (imports, CUDA init: 10-15 s a
process). Standard library only: ``--plan`` runs where torch is not installed.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field

from hybridtrain.distributed.launcher import launch_command
from hybridtrain.perf.bench_sets import precision_sets

PASS, FAIL, NOT_RUN = "pass", "fail", "not run"  # a row's status once run ("pending" before)
NEXT_CALL = "left for the next call"
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RECIPE = os.path.join("configs", "resnet50_h100.yaml")

PRECISIONS = ("fp32", "mixed-fp16", "mixed-bf16")
MODES = {"eager": [], "compiled": ["train.compile=true"], "graphed": ["train.cuda_graphs=true"]}
BATCH = 256                 # the recipe's per-GPU batch
STEPS_PER_EPOCH = 30        # per epoch, so epoch 2 times 30 steps after epoch 1 warmed up
EPOCHS = 2                  # epoch 1: cudnn autotuning, compilation, graph capture; epoch 2: the steady one
BENCH_STEPS, BENCH_WARMUP = 20, 5

CALL_BUDGETS_S = (480, 240)  # call 1 at most 8 minutes (the machine's start and the archive beside it in the 15);
                             # a second, on the same warm machine, with what is left
PREAMBLE_S = 20              # each call: one child that imports torch, initialises CUDA and runs the node checks
BUILD_S = 240                # Horovod with NCCL from the bundle, sm_90 only, niced on 12 of 16 cores (review 3 §3:
                             # 90-200 s + pip on 16)

# pytest -k over the tests that use the GPU when there is one, or run only there
GPU_TESTS = ["tests/test_step_speed.py", "tests/test_optim_math.py", "-k",
             "guard_counts or reads_only or one_host_sync or compiled_steps or graphed_steps or hooks_firing "
             "or hooks_forced or fused_updates"]

TIMEOUT_S = {"build": 900, "tests": 240, "eager": 120, "graphed": 150, "compiled": 300, "bench": 240,
             "bench-optim": 240, "resume": 240, "max-batch": 240, "2ranks": 180, "dali": 240}

ONE_GPU_NOTE = ("not run: one GPU, and NCCL refuses two ranks on one device; the CPU tests cover the gradient "
                "hook path (2-rank Gloo jobs in tests/), and train-2ranks-mixed-fp16-gloo-torch runs DDP's buckets "
                "and FP16 hook on this GPU over Gloo")
NO_DALI_NOTE = ("not run: DALI is not installed in this Python (hundreds of MB: it cannot travel in the 64 MiB "
                "bundle); run gpu-check where nvidia-dali-cuda130 is installed to check data.backend=dali_gpu")
NOT_COVERED = [
    "NCCL across ranks (Horovod's and DDP's) and Horovod's serial wait/decompress (gpu-path-2 #6): need 2+ GPUs; "
    "on the CPU, 2-rank Gloo jobs cover the same hooks (tests/test_horovod_training.py, tests/test_torch_engine.py)",
    "NCCL and the stall watchdog with a hung peer (review 3 #11): tests/test_run_ownership.py on Gloo",
    "data.backend=dali_gpu unless DALI is installed here (tests/test_dali_pipeline.py runs DALI's CPU pipelines)",
]


@dataclass
class Row:
    """One line of the table: what to run and, once run, what it gave (None: not measured, shown n/a)."""
    name: str                   # also the log's name: OUT/<name>.log
    kind: str                   # build, tests, train, resume, bench, bench-optim, max-batch or note
    argv: list = field(default_factory=list)
    timeout_s: float = 0.0
    precision: str = ""
    mode: str = ""              # eager, compiled or graphed; a bench row: eager, horovod or fused
    ranks: int = 1
    output: str = ""            # train/resume: the run directory; bench: the JSON file
    env: dict = field(default_factory=dict)  # added to the environment
    before: list = field(default_factory=list)  # commands run first, in the same log (each must exit 0)
    horovod: bool = False       # needs the Horovod build
    estimate_s: float = 0.0     # on one H100, start-up included
    call: str = ""              # the call it falls in by the plan: "1", "2" or "later"
    status: str = "pending"     # pass, fail or not run
    seconds: float | None = None
    images_per_sec: float | None = None           # steady, all ranks together
    baseline_images_per_sec: float | None = None  # bench: the plain loop's
    ratio: float | None = None                    # per GPU, ÷ the plain loop of the same precision
    peak_allocated_mb: float | None = None
    peak_reserved_mb: float | None = None
    device_used_mb: float | None = None
    detail: str = ""


@dataclass(frozen=True)
class Pythons:
    """image: the Python running the check (its torch, the checkout on PYTHONPATH); horovod: the build venv's bin."""
    image: str = sys.executable
    horovod_bin: str = ""

    def hvd(self, tool: str) -> str:
        return os.path.join(self.horovod_bin, tool)


def train_sets(run_dir: str, precision: str, mode: str, ranks: int) -> list[str]:
    """Overrides of the H100 recipe: its own GPU or one error line (never the CPU), synthetic input, NHWC, two
    short epochs (T=1 AdaBound epoch, so the steady epoch is LARS-SGD), no TensorBoard."""
    return [f"run_dir={run_dir}", "train.device=cuda", "data.backend=synthetic", "data.channels_last=true",
            f"train.batch_size={BATCH}", f"data.synthetic_images={BATCH * STEPS_PER_EPOCH * ranks}",
            f"train.epochs={EPOCHS}", "optim.adabound_epochs=1", "train.progress=false", "train.keep_checkpoints=1",
            "report.tensorboard=false", *precision_sets(precision), *MODES[mode]]


def as_sets(sets: list[str]) -> list[str]:
    return [a for s in sets for a in ("--set", s)]


def train_row(py: Pythons, out: str, precision: str, mode: str, ranks: int, engine: str = "horovod",
              estimate_s: float = 45, label: str = "", env: dict | None = None, extra_sets: tuple = ()) -> Row:
    """A short training run of the H100 recipe under horovodrun or (``engine`` torch) torchrun; ``label`` names a
    variant in place of the mode (its ``env`` and ``extra_sets`` added)."""
    name = f"train-{ranks}rank{'s' if ranks > 1 else ''}-{precision}-{label or mode}" + (
        "-torch" if engine == "torch" else "")
    run_dir = os.path.join(out, "runs", name)
    python = py.image if engine == "torch" else py.hvd("python")  # Horovod: the build venv's
    argv = [*launch_command(engine, ranks, [python, "-m", "hybridtrain"], python=python), "train",
            "--config", os.path.join(REPO, RECIPE), "--engine", engine,
            *as_sets([*train_sets(run_dir, precision, mode, ranks), *extra_sets])]
    timeout = TIMEOUT_S["2ranks"] if ranks > 1 else TIMEOUT_S[mode]
    return Row(name, "train", argv, timeout, precision, mode, ranks, output=run_dir, horovod=engine == "horovod",
               estimate_s=estimate_s, env=dict(env or {}))


def resume_row(py: Pythons, out: str, precision: str = "mixed-fp16") -> Row:
    """A real run of 2 epochs and the same run resumed from its epoch-1 checkpoint, deterministic, on the torch
    engine: the final checkpoints must be bitwise equal (hybridtrain.gpucheck.resume_check)."""
    name = f"resume-{precision}-torch"
    folder = os.path.join(out, "runs", name)
    sets = [s for s in train_sets(os.path.join(folder, "straight"), precision, "eager", 1)
            if not s.startswith(("run_dir=", "train.keep_checkpoints="))]
    argv = [py.image, "-m", "hybridtrain.gpucheck.resume_check", "--out", folder, "--engine", "torch",
            "--config", os.path.join(REPO, RECIPE), *as_sets([*sets, "train.deterministic=true"])]
    return Row(name, "resume", argv, TIMEOUT_S["resume"], precision, "eager", output=folder, estimate_s=80)


BENCH_MODES = {  # what each bench row adds to the step's command line
    "eager": ["--engine", "torch", "--baseline"],   # trainer + plain loop in process, the whole step under torchrun
    "horovod": ["--engine", "horovod"],             # the whole step under horovodrun
    "graphed": ["--set", "train.cuda_graphs=true"],  # the trainer's step captured in a CUDA graph, in process
    "compiled": ["--set", "train.compile=true"],     # the trainer's step compiled, in process
    "fused": ["--baseline", "--set", "optim.fused=true"]}
OWN_BASELINE = ("eager", "fused")  # bench rows that time the plain loop themselves; the others take the eager row's


def bench_row(py: Pythons, out: str, precision: str, mode: str = "eager", estimate_s: float = 65) -> Row:
    """``bench`` at the recipe's batch, NHWC, in one of BENCH_MODES. A row without its own plain loop gets its
    ratio from the eager row's of the same precision (fill_ratios)."""
    name = f"bench-{precision}" + ("" if mode == "eager" else f"-{mode}")
    path = os.path.join(out, f"{name}.json")
    python = py.hvd("python") if mode == "horovod" else py.image
    argv = [python, "-m", "hybridtrain", "bench", "--precision", precision, "--channels-last", "--batch-size",
            str(BATCH), "--steps", str(BENCH_STEPS), "--warmup", str(BENCH_WARMUP), "--json", path,
            *BENCH_MODES[mode]]
    return Row(name, "bench", argv, TIMEOUT_S["compiled" if mode == "compiled" else "bench"], precision, mode,
               output=path, horovod=mode == "horovod", estimate_s=estimate_s)


def bench_optim_row(py: Pythons, out: str) -> Row:
    """``bench-optim --fused``: ResNet-50's optimizer step alone, both phases, foreach and compiled."""
    path = os.path.join(out, "bench-optim.json")
    argv = [py.image, "-m", "hybridtrain", "bench-optim", "--fused", "--steps", str(BENCH_STEPS), "--warmup",
            str(BENCH_WARMUP), "--json", path]
    return Row("bench-optim", "bench-optim", argv, TIMEOUT_S["bench-optim"], output=path, estimate_s=120)


def max_batch_row(py: Pythons, precision: str = "mixed-bf16") -> Row:
    """The largest per-GPU batch of ResNet-50 that fits: doubling from 1536, then bisection to multiples of 256 (the
    H100 run found 1816 in mixed-bf16 and its img/s flat from 1024 on; 3 timed steps a trial)."""
    argv = [py.image, "-m", "hybridtrain", "bench", "--find-max-batch", "--precision", precision, "--channels-last",
            "--start-batch", "1536", "--batch-granularity", "256", "--steps", "3", "--warmup", "1"]
    return Row(f"max-batch-{precision}", "max-batch", argv, TIMEOUT_S["max-batch"], precision, estimate_s=55)


def tests_row(py: Pythons, out: str) -> Row:
    """The GPU tests under pytest, its per-test limit (pytest-timeout) and its JUnit report (OUT/gpu-tests.xml),
    which the row is judged by."""
    path = os.path.join(out, "gpu-tests.xml")
    argv = [py.hvd("python"), "-m", "pytest", "-q", "-p", "no:cacheprovider", "--timeout=120", f"--junitxml={path}",
            *GPU_TESTS]
    return Row("gpu-tests", "tests", argv, TIMEOUT_S["tests"], output=path, horovod=True, estimate_s=180)


def dali_row(py: Pythons, out: str, dali: bool) -> Row:
    """The recipe on data.backend=dali_gpu from generated JPEGs, where DALI is installed; a note elsewhere."""
    if not dali:
        return note_row("train-1rank-mixed-bf16-dali-torch", NO_DALI_NOTE, "mixed-bf16")
    data = os.path.join(out, "data", "synthetic_imagenet")
    row = train_row(py, out, "mixed-bf16", "eager", 1, engine="torch", estimate_s=60, label="dali",
                    extra_sets=("data.backend=dali_gpu", f"data.path={data}"))
    row.before = [[py.image, "-m", "hybridtrain", "prepare-data", "synthetic-imagenet", "--out", data]]
    row.timeout_s = TIMEOUT_S["dali"]
    return row


def note_row(name: str, detail: str, precision: str = "", ranks: int = 1) -> Row:
    return Row(name, "note", precision=precision, ranks=ranks, status="not run", detail=detail)


def build_rows(gpus: int, out: str, py: Pythons, dali: bool = False) -> list[Row]:
    """Every row in the order it runs: call 1's (plan_calls) answer the issue's questions in its order; Horovod rows
    wait for the build, and the rows after them go first meanwhile."""
    two = min(gpus, 2)
    # one GPU: the torch engine's two ranks over Gloo (NCCL refuses a shared GPU): DDP's buckets, the FP16
    # communication hook, no_sync and the ranks' skip agreement on CUDA tensors
    two_torch = (train_row(py, out, "mixed-fp16", "eager", 2, engine="torch", estimate_s=60) if gpus >= 2 else
                 train_row(py, out, "mixed-fp16", "eager", 2, engine="torch", estimate_s=70, label="gloo",
                           env={"HYBRIDTRAIN_TORCH_BACKEND": "gloo"}))
    two_horovod = (train_row(py, out, "mixed-bf16", "eager", 2, estimate_s=50) if gpus >= 2 else
                   note_row("train-2ranks-mixed-bf16-eager", ONE_GPU_NOTE, "mixed-bf16", 2))
    return [bench_row(py, out, "mixed-fp16"), bench_row(py, out, "mixed-bf16"), resume_row(py, out),
            bench_row(py, out, "mixed-fp16", "horovod", estimate_s=55),
            bench_row(py, out, "mixed-fp16", "graphed", estimate_s=45),
            bench_row(py, out, "mixed-bf16", "compiled", estimate_s=90), max_batch_row(py),
            # call 2 and later: training with each speed-up, two ranks, the GPU tests
            train_row(py, out, "mixed-fp16", "graphed", 1, estimate_s=55), two_torch,
            bench_row(py, out, "mixed-bf16", "horovod", estimate_s=55),
            train_row(py, out, "mixed-bf16", "compiled", 1, engine="torch", estimate_s=130), two_horovod,
            tests_row(py, out), dali_row(py, out, dali),
            train_row(py, out, "fp32", "eager", two, estimate_s=50),
            train_row(py, out, "mixed-bf16", "eager", 1, estimate_s=40),
            bench_row(py, out, "mixed-fp16", "fused", estimate_s=120), bench_optim_row(py, out),
            train_row(py, out, "mixed-fp16", "compiled", 1, estimate_s=130)]


def next_row(pending: list[Row], build_done: bool) -> Row | None:
    """The first pending row that can start now: rows that need Horovod wait for its build."""
    return next((r for r in pending if build_done or not r.horovod), None)


def plan_calls(rows: list[Row], build_s: float = BUILD_S, budgets: tuple = CALL_BUDGETS_S,
               preamble_s: float = PREAMBLE_S) -> list[Row]:
    """Set each row's ``call`` by simulating the runner with the estimates: call 1 starts the build in the
    background and runs the rows that need no Horovod meanwhile; call 2 (the machine still warm: the build is
    reused) and later ones go on with what did not fit. A row that would pass its call's budget waits for the next
    call; rows after it may still fit."""
    pending = [r for r in rows if r.kind != "note"]
    build_end = preamble_s + build_s
    for number, budget in enumerate(budgets, start=1):
        now = preamble_s
        waiting = list(pending)
        while waiting:
            row = next_row(waiting, now >= build_end)
            if row is None:          # only Horovod rows left: wait for the build
                now = build_end
                continue
            waiting.remove(row)
            if now + row.estimate_s <= budget:
                row.call, now = str(number), now + row.estimate_s
                pending.remove(row)
        build_end = 0.0  # the next call reuses the build
    for row in pending:
        row.call = "later"
    return rows


def format_plan(rows: list[Row], budgets: tuple = CALL_BUDGETS_S) -> str:
    from hybridtrain.reports import markdown_table
    lines = [f"gpu-check --plan: the rows in the order they run, estimated seconds on one H100 (start-up included), "
             f"and the call each falls in (call 1 at most {budgets[0]} s with the build of Horovod running in the "
             f"background from {PREAMBLE_S} s for about {BUILD_S} s; call 2 at most {budgets[1]} s on the same warm "
             f"machine, the build reused; each call {PREAMBLE_S} s of node checks first)", ""]
    table = [[str(i), r.name, "yes" if r.horovod else "", f"{r.estimate_s:.0f}" if r.kind != "note" else "-",
              r.call or "-", r.detail if r.kind == "note" else ""] for i, r in enumerate(rows, start=1)]
    lines.append(markdown_table(["#", "row", "needs Horovod", "estimate s", "call", "note"], table))
    for number, budget in enumerate(budgets, start=1):
        total = PREAMBLE_S + sum(r.estimate_s for r in rows if r.call == str(number))
        lines.append(f"call {number}: {total:.0f} s of rows estimated (budget {budget} s)")
    lines += ["", "not covered by one GPU:"] + [f"- {line}" for line in NOT_COVERED]
    return "\n".join(lines)

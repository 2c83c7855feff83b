"""The GPU check's rows, in the order users ask: the trainer's whole step per GPU against a plain PyTorch AMP loop
(ResNet-50, batch 256, NHWC, SGD+LARS phase: 89% of the recipe's epochs) in fp16 and bf16, with CUDA graphs and
with compile; a run resumed bitwise; the largest batch; then Horovod (its build beside the rows that time nothing):
its whole step, and one rank with its gradient hooks forced, so the FP16 wire, the NHWC compressor and NCCL's
all-reduce run once on one GPU. Each row is one real process (OUT/<row>.log); its figures go to the table."""
from __future__ import annotations

import json
import os

import pytest

from benchmarks.bench_sets import precision_sets
from gpu.harness import REPO, option, refused, row, run_command

RECIPE = os.path.join(REPO, "configs", "resnet50_h100.yaml")
BATCH, STEPS, WARMUP = 256, 20, 5
SLOPE_MB, BASE_MB = 42.1, 431  # reserved MiB per image and at none: the H100 run's max-batch table, mixed-bf16 NHWC
HEADROOM_MB, MARGIN = 3072, 0.05  # perf.max_batch's TRAINING_HEADROOM_MB and bench's default --memory-margin
GRAPHED, COMPILED = ("--set", "train.cuda_graphs=true"), ("--set", "train.compile=true")
PLAIN_LOOP: dict = {}  # precision -> the plain loop's img/s (rows without a plain loop of their own)


def bench(config, record, python: str, name: str, precision: str, *extra, loop: str = "trainer", env=None) -> dict:
    """``bench`` at the recipe's batch, NHWC, SGD+LARS phase; its figures recorded from its JSON whatever its exit
    (a whole-step launch that failed leaves the in-process rows), then the row fails on a bad exit."""
    out = option(config, "gpu_out")
    rc = run_command(config, name, [python, "-m", "benchmarks", "bench", "--precision", precision, "--channels-last",
                                    "--batch-size", BATCH, "--steps", STEPS, "--warmup", WARMUP, "--phase", "sgd",
                                    "--json", os.path.join(out, f"{name}.json"), *extra], env=env)
    try:
        with open(os.path.join(out, f"{name}.json")) as fh:
            loops = {r["loop"]: r for r in json.load(fh)}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        pytest.fail(f"no bench JSON ({exc.__class__.__name__}): see {name}.log")
    main = loops.get(loop) or pytest.fail(f"the bench JSON has no {loop} row")
    record("img/s", main["images_per_sec"])
    record("phase", main.get("optimizer", ""))
    record("peak reserved MiB", main.get("peak_memory_reserved_mb"))
    if "baseline" in loops:
        PLAIN_LOOP[precision] = loops["baseline"]["images_per_sec"]
        record("plain loop img/s", PLAIN_LOOP[precision])
    if precision in PLAIN_LOOP:
        record("÷ plain loop", main["images_per_sec"] / PLAIN_LOOP[precision])
    whole = loops.get("train/torch", {})
    if "images_per_sec" in whole:
        record("torchrun img/s", whole["images_per_sec"])
    assert rc == 0 and "error" not in whole, whole.get("error") or f"exit {rc}: see {name}.log"
    return loops


@row(20, 180)
def test_node(node, record_property):
    """The node checks per precision; a refusal in fp32 (no kernels for this GPU, a driver too old) fails here."""
    record_property("device", node["name"])
    record_property("sm", node["cc"])
    assert not node["checks"].get("fp32", [""])[0], node["checks"]["fp32"][0]


@row(85, 300)
@pytest.mark.parametrize("precision", ["mixed-fp16", "mixed-bf16"])
def test_step_against_plain_loop(precision, node, python, pytestconfig, record_property):
    """The trainer's step and the plain loop alternated in one process; then the whole step under torchrun (DDP,
    NCCL, the FP16 hook)."""
    refused(node, precision)
    bench(pytestconfig, record_property, python, f"bench-{precision}", precision, "--baseline", "--engine", "torch")


@row(45, 200)
def test_graphed_step(node, python, pytestconfig, record_property):
    """The trainer's step captured in a CUDA graph, in process (its ratio across processes: the eager row's loop)."""
    refused(node, "mixed-fp16")
    bench(pytestconfig, record_property, python, "bench-graphed", "mixed-fp16", *GRAPHED)


@row(95, 400)
def test_compiled_step(node, python, pytestconfig, record_property):
    refused(node, "mixed-bf16")
    bench(pytestconfig, record_property, python, "bench-compiled", "mixed-bf16", *COMPILED)


def train_sets(run_dir: str, precision: str, ranks: int = 1, epochs: int = 2) -> list[str]:
    """The recipe on its GPU (never the CPU), synthetic input, NHWC, 2 epochs of 30 steps (T=1: the steady epoch is
    SGD+LARS), no TensorBoard."""
    sets = [f"run_dir={run_dir}", "train.device=cuda", "data.backend=synthetic", "data.channels_last=true",
            f"train.batch_size={BATCH}", f"data.synthetic_images={BATCH * 30 * ranks}", f"train.epochs={epochs}",
            "optim.adabound_epochs=1", "train.progress=false", "report.tensorboard=false", *precision_sets(precision)]
    return [a for s in sets[0 if run_dir else 1:] for a in ("--set", s)]


@row(65, 240)
def test_resume_is_bitwise(node, python, pytestconfig, record_property, beside_build):
    """2 epochs, and the same run resumed from its epoch-1 checkpoint, deterministic, on the torch engine: the final
    model and optimizer state bitwise equal. Not a speed row: Horovod's build runs beside it."""
    refused(node, "mixed-fp16")
    folder = os.path.join(option(pytestconfig, "gpu_out"), "runs", "resume")
    sets = train_sets("", "mixed-fp16")  # each run's run_dir is the driver's
    rc = run_command(pytestconfig, "resume", [python, os.path.join(os.path.dirname(__file__), "resume_check.py"),
                                              folder, RECIPE, *sets, "--set", "train.deterministic=true"])
    assert rc == 0, "the resumed run differs or a run failed: see resume.log"
    record_property("result", "bitwise equal")


def predicted_max_batch(total_mb: float, granularity: int = 256) -> int:
    """The largest batch the H100's line of reserved memory per image allows on a device of ``total_mb``, rounded
    down to ``granularity``: the search's first trial, so that a 141 GB device needs no doubling from 1536."""
    return max(granularity, int(((1 - MARGIN) * total_mb - HEADROOM_MB - BASE_MB) / SLOPE_MB) // granularity
               * granularity)


@row(120, 300)
def test_largest_batch(node, python, pytestconfig, record_property, beside_build):
    """The largest batch whose reserved memory leaves 5% of the device and 3 GiB free; a memory figure, so it runs
    beside Horovod's build."""
    refused(node, "mixed-bf16")
    start = predicted_max_batch(node.get("total_mb", 81079))
    rc = run_command(pytestconfig, "max-batch", [python, "-m", "benchmarks", "max-batch",
                                                 "--precision", "mixed-bf16", "--channels-last", "--start-batch",
                                                 start, "--batch-granularity", 256, "--steps", 3, "--warmup", 1])
    with open(os.path.join(option(pytestconfig, "gpu_out"), "max-batch.log")) as fh:
        largest = [line for line in fh if "(largest)" in line]
    assert rc == 0 and largest, "no (largest) row: see max-batch.log"
    cells = [c.strip() for c in largest[-1].strip().strip("|").split("|")]
    record_property("predicted start", start)
    record_property("largest batch", int(cells[0].split()[0]))
    record_property("img/s", float(cells[1]))


@row(70, 240)
def test_horovod_whole_step(node, horovod, pytestconfig, record_property):
    """The whole step under horovodrun on one rank. Horovod registers no gradient hooks at size 1: no all-reduce
    here (the next row forces them)."""
    refused(node, "mixed-fp16")
    record_property("all-reduce", "none at 1 rank")
    bench(pytestconfig, record_property, os.path.join(horovod, "python"), "bench-horovod", "mixed-fp16", "--engine",
          "horovod", loop="train/horovod", env={"PATH": horovod + os.pathsep + os.environ.get("PATH", "")})


def hooks_forced(horovod: str, out: str, config: str, sets: list) -> tuple[list, dict, str]:
    """One Horovod rank training with its hooks on: HOROVOD_ELASTIC=1 makes Horovod's DistributedOptimizer register
    them at any size (horovod/torch/optimizer.py), while horovodrun and the trainer stay static. (argv, env,
    timeline): the timeline names each gradient's all-reduce (allreduce.conv1.weight)."""
    timeline = os.path.join(out, "horovod-hooks.timeline.json")
    argv = [os.path.join(horovod, "horovodrun"), "-np", 1, "-H", "localhost:1", os.path.join(horovod, "python"), "-m",
            "hybridtrain", "train", "--config", config, "--engine", "horovod", *sets,
            "--set", "distributed.compression=fp16", "--set", "data.channels_last=true"]
    return argv, {"HOROVOD_ELASTIC": "1", "HOROVOD_TIMELINE": timeline}, timeline


@row(60, 200)
def test_horovod_hooks_forced_on_one_rank(node, horovod, pytestconfig, record_property):
    """Training on one rank with Horovod's hooks on, the FP16 wire and NHWC: the path 2+ ranks take (the hooks, the
    layout-free compressor, grad.set_), through NCCL. Its timeline must hold the gradients' all-reduces."""
    refused(node, "mixed-fp16")
    out = option(pytestconfig, "gpu_out")
    argv, env, timeline = hooks_forced(horovod, out, RECIPE, train_sets(os.path.join(out, "runs", "hooks"),
                                                                        "mixed-fp16"))
    assert run_command(pytestconfig, "horovod-hooks", argv, env=env) == 0, "see horovod-hooks.log"
    with open(timeline) as fh:
        assert "allreduce.conv1.weight" in fh.read(), "no gradient all-reduce in Horovod's timeline: no hooks ran"
    record_property("gradient all-reduce", "in the timeline")


GPU_TESTS = ["tests/test_step_speed.py", "tests/test_optim_math.py", "-k", "guard_counts or reads_only or one_host_sync "
             "or compiled_steps or graphed_steps or hooks_firing or hooks_forced or fused_updates"]


@row(180, 300)
def test_suite_gpu_tests(horovod, pytestconfig, record_property):
    """The CPU suite's tests that use the GPU where they see one (the hook order under compile, graphed and compiled
    steps, Horovod's hooks forced, fused updates), from Horovod's venv."""
    xml = os.path.join(option(pytestconfig, "gpu_out"), "gpu-tests.xml")
    rc = run_command(pytestconfig, "gpu-tests", [os.path.join(horovod, "python"), "-m", "pytest", "-q", "-p",
                                                 "no:cacheprovider", "--timeout=120", f"--junitxml={xml}", *GPU_TESTS],
                     env={"PATH": horovod + os.pathsep + os.environ.get("PATH", "")})
    assert rc == 0, "see gpu-tests.log"

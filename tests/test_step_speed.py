"""Speed: Horovod's tuning knobs taking effect on real 2-rank jobs, torch.compile on the CPU, the CUDA
graphs switch, and no host sync inside the training step."""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys

import pytest
from conftest import BENCHMARKS, HOROVODRUN, HYBRIDTRAIN, REPO, assert_one_error_line, command, env_with_venv, run

KNOBS_SCRIPT = os.path.join(REPO, "tests", "scripts", "horovod_knobs.py")


def torch_cuda_available() -> bool:
    import torch
    return torch.cuda.is_available()


# ----------------------------------------------------------------------------- Horovod knobs

def knobs_job(tmp_path, sets: list[str], launcher_flags: list[str] = ()) -> tuple[dict, list[str], str]:
    """(rank 0's record, the timeline's event names, the job's output) of horovod_knobs.py on 2 ranks."""
    out, timeline = tmp_path / "out.json", tmp_path / "timeline.json"
    args = [a for s in sets for a in ("--set", s)]
    proc = run([HOROVODRUN, "--gloo", "-np", "2", "-H", "localhost:2", "--timeline-filename", str(timeline),
                *launcher_flags, sys.executable, KNOBS_SCRIPT, str(out), *args], timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    text = timeline.read_text().strip().rstrip(",")
    events = json.loads(text if text.endswith("]") else text + "]")
    return json.loads(out.read_text()), [e.get("name") for e in events], proc.stdout + proc.stderr


def test_no_fusion_and_a_long_cycle_take_effect_over_the_launchers_flag(tmp_path):
    record, names, output = knobs_job(tmp_path, ["horovod.fusion_threshold_mb=0", "horovod.cycle_time_ms=100"],
                                      ["--cycle-time-ms", "2"])
    assert "MEMCPY_IN_FUSION_BUFFER" not in names and names.count("ALLREDUCE") > 0  # every tensor on its own
    assert statistics.median(record["round_s"]) >= 0.05  # each round waits for 100 ms cycles
    assert record["env"]["HOROVOD_CYCLE_TIME"] == "100"
    assert "HOROVOD_CYCLE_TIME=2.0 from the launcher is replaced by the config's 100" in output


def test_default_knobs_fuse_and_cycle_fast(tmp_path):
    record, names, _ = knobs_job(tmp_path, [])
    assert "MEMCPY_IN_FUSION_BUFFER" in names  # the round's tensors share the fusion buffer
    assert statistics.median(record["round_s"]) < 0.05


@pytest.mark.parametrize("users", [None, "0"])
def test_over_mpi_the_rank_yields_the_core_its_horovod_thread_waits_on_unless_the_user_says_no(tmp_path, users):
    """Open MPI busy-polls while Horovod's background thread waits on the other ranks: a core per rank. The
    engine's init sets mpi_yield_when_idle before MPI_Init; Open MPI's own list of the parameters it took from
    the environment (mpi_show_mca_params=enviro) names it, and a value the user gave the launcher wins."""
    env = {**env_with_venv(2), "OMPI_MCA_mpi_show_mca_params": "enviro"}
    if users is not None:
        env["OMPI_MCA_mpi_yield_when_idle"] = users
    proc = subprocess.run([HOROVODRUN, "-np", "2", "-H", "localhost:2", sys.executable, KNOBS_SCRIPT,
                           str(tmp_path / "out.json")], capture_output=True, text=True, timeout=300, env=env,
                          cwd=REPO, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    want = "true" if users is None else "false"
    assert f"mpi_yield_when_idle={want} (environment)" in proc.stdout + proc.stderr, proc.stderr[-3000:]


def test_autotune_writes_its_log(tmp_path):
    log = tmp_path / "autotune.csv"
    knobs_job(tmp_path, ["horovod.autotune=true", f"horovod.autotune_log={log}"])
    assert log.read_text().startswith("hierarchical_allreduce,")  # Horovod's tuner opened it: autotune is on


def test_autotune_log_without_autotune_is_one_line(tmp_path):
    from hybridtrain.config import load_config
    from hybridtrain.errors import UserError
    with pytest.raises(UserError, match="horovod.autotune_log is set but horovod.autotune is false"):
        load_config(None, [f"horovod.autotune_log={tmp_path / 'a.csv'}"])


# ----------------------------------------------------------------------------- the step, built as the trainer does

SMALL = ["model.arch=resnet18", "model.num_classes=10", "train.batch_size=4", "data.crop_size=32"]


def device():
    import torch
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def built_step(sets: list[str], seed_step: int = 0):
    """(step() running one scheduled training step, its model) for the config ``SMALL + sets``."""
    import torch

    from benchmarks.step_bench import synthetic_batch
    from hybridtrain.config import load_config
    from hybridtrain.distributed.engines import with_step_contract
    from hybridtrain.engine.step import build_train_step
    from hybridtrain.models import create_model
    from hybridtrain.optim import apply_schedule, create_optimizer
    from hybridtrain.precision.policy import prepare_model, set_fp32_math
    from hybridtrain.precision.scaler import create_precision
    cfg = load_config(None, SMALL + sets)
    set_fp32_math(cfg.precision.tf32)  # as the trainer: IEEE FP32, not TF32
    precision = create_precision(cfg.precision)
    policy = precision.policy
    model = prepare_model(create_model("resnet18", 10, seed=0).to(device()), policy)
    bundle = create_optimizer(model, cfg, 1, 10)
    bundle.optimizer = with_step_contract(bundle.optimizer)
    images, labels = synthetic_batch(cfg, device(), policy.input_dtype, 10)
    run_step = build_train_step(model, cfg, precision, (images, labels))
    counter = {"step": seed_step}

    def step():
        apply_schedule(bundle.optimizer, bundle.schedule, counter["step"])
        counter["step"] += 1
        loss = run_step(bundle.optimizer, precision, [(images, labels, 1.0)]).loss
        return loss.detach().clone()

    torch.manual_seed(0)
    return step, model


# ----------------------------------------------------------------------------- host syncs

def test_the_guard_counts_host_reads():
    import torch

    from benchmarks.host_syncs import count_host_syncs
    t = torch.ones(3, device=device())
    assert count_host_syncs(lambda: (t.sum().item(), bool(t.any()), float(t[0])), device()) == 3
    assert count_host_syncs(lambda: torch.nonzero(t), device()) == 1
    assert count_host_syncs(lambda: t * 2 + t.norm(), device()) == 0


@pytest.mark.parametrize("sets", [
    [],                                                        # hybrid, AdaBound phase
    ["optim.adabound_epochs=1", "train.epochs=2"],             # hybrid, LARS-SGD phase from step 10
    ["precision.mode=mixed", "precision.compute_dtype=bf16"],  # no loss scaling
    ["optim.name=goyal"],                                      # torch.optim.SGD
], ids=["adabound", "lars", "mixed-bf16", "goyal"])
def test_the_step_reads_only_the_non_finite_flag(sets, job_of_one):
    """One host read per step, the skip decision (a NaN/inf loss on any rank must skip the step on every rank);
    the optimizers, LARS's trust ratios and the schedule read nothing."""
    from benchmarks.host_syncs import count_host_syncs
    step, _ = built_step(sets, seed_step=10 if "optim.adabound_epochs=1" in sets else 0)
    step()  # first step: the optimizer's state is created
    assert count_host_syncs(step, device()) == 1


def test_loss_scaling_is_the_one_host_sync_in_the_step(job_of_one):
    from benchmarks.host_syncs import count_host_syncs
    step, _ = built_step(["precision.mode=mixed", "precision.compute_dtype=fp16"])
    step()
    assert count_host_syncs(step, device()) == 1  # every rank must know whether to skip the step


# ----------------------------------------------------------------------------- torch.compile

@pytest.mark.parametrize("optimizer, scope", [("hybrid", "blocks"), ("goyal", "model")])
def test_compiled_steps_give_the_eager_losses(optimizer, scope, job_of_one):
    import torch
    eager_step, eager_model = built_step([f"optim.name={optimizer}"])
    compiled_step, compiled_model = built_step([f"optim.name={optimizer}", "train.compile=true",
                                                f"train.compile_scope={scope}"])
    eager = torch.stack([eager_step() for _ in range(3)])
    compiled = torch.stack([compiled_step() for _ in range(3)])
    # What "the same" means: the same FP32 sums in another order. On the CPU inductor's kernels keep the
    # losses within 1e-4; on a GPU, Triton's fused kernels and cuDNN's algorithms sum in other orders, and the
    # H100 gave 1.8e-4 after 3 steps, so 1e-3 there (a wrong gradient or a frozen schedule is off by far more).
    rtol, atol = (1e-3, 1e-4) if device().type == "cuda" else (1e-4, 1e-5)
    torch.testing.assert_close(compiled[0], eager[0], rtol=rtol / 10, atol=atol)  # same weights: one forward
    torch.testing.assert_close(compiled, eager, rtol=rtol, atol=atol)
    if optimizer == "goyal":  # AdaBound's early steps are about alpha * sign(g): a rounding flips near-zero ones
        for a, b in zip(compiled_model.parameters(), eager_model.parameters()):
            torch.testing.assert_close(a, b, rtol=rtol, atol=atol)
    assert list(compiled_model.state_dict()) == list(eager_model.state_dict())  # checkpoints keep their keys


def compiled_regions(loss) -> list[set[str]]:
    """For each compiled region in ``loss``'s backward graph (one autograd node each), the names of the parameters
    whose gradients it produces (via their AccumulateGrad nodes, where Horovod's hooks sit)."""
    regions, seen, todo = [], set(), [loss.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        children = [child for child, _ in node.next_functions]
        if "CompiledFunction" in node.name():
            regions.append({getattr(c, "variable", None) for c in children if c is not None} - {None})
        todo += children
    return regions


def test_every_resnet50_block_is_compiled_in_training_and_in_evaluation():
    """The 16 blocks share their class's forward, and ResNet-50 has 8 block shapes, so with
    dynamo's default limit of 8 graphs per code object the evaluation pass would run most blocks eagerly. Traced
    with dynamo's eager backend (no code generation: the limit is dynamo's, not the compiler's)."""
    import torch
    import torch._dynamo
    from torch._dynamo.utils import counters

    from hybridtrain.engine.step import compile_blocks
    from hybridtrain.models import create_model

    torch._dynamo.reset()
    counters.clear()
    model = create_model("resnet50", 10, small_input_stem=True)
    compiled = compile_blocks(model, backend="eager")
    x = torch.randn(2, 3, 16, 16)
    compiled(x).sum().backward()
    with torch.no_grad():
        compiled.eval()(x)
    assert counters["stats"]["unique_graphs"] == 16, dict(counters["stats"])  # 8 shapes x {train, eval}


def test_horovods_hooks_forced_on_one_rank_give_the_plain_step_with_the_wire_rounding(tmp_path):
    """The multi-rank step's Horovod path (gradient hooks, LayoutCompressor, synchronize, unscale),
    forced on one process (Horovod registers no hooks at size 1), on the GPU where this test sees one (gpu-check;
    one process keeps the GPU, even on a 1-GPU node), else on the CPU: bitwise the plain optimizer's
    steps with each gradient rounded as the wire rounds it, NCHW and NHWC, the gradients' layouts kept; the FP16
    wire's losses differ from the uncompressed ones (it really rounds)."""
    out = tmp_path / "hooks.json"
    proc = run([sys.executable, os.path.join(REPO, "tests", "scripts", "horovod_hooks_one_rank.py"), str(out)],
               timeout=600, ranks=1)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["device"] == ("cuda" if torch_cuda_available() else "cpu"), report["device"]
    results = report["results"]
    assert sorted(results) == ["fp16/nchw", "fp16/nhwc", "none/nchw", "none/nhwc"]
    for case, r in results.items():
        assert r["same_losses"] and r["same_params"] and r["layouts_kept"], (case, r)
        assert r["losses"][-1] < r["losses"][0], (case, r)
    assert results["fp16/nchw"]["losses"] != results["none/nchw"]["losses"]


def test_only_launches_of_two_or_more_ranks_are_pinned_to_the_cpu(monkeypatch):
    """The tests pin a launch to the CPU only when it starts more ranks than the host has GPUs; a
    single process keeps the GPUs (so the test above runs on a 1-GPU node's GPU). run() counts the ranks from
    the command line as the suite writes them."""
    import torch
    from conftest import TORCHRUN, launch_ranks
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert "CUDA_VISIBLE_DEVICES" not in env_with_venv(ranks=1)
    two = env_with_venv(ranks=2)
    assert two.get("CUDA_VISIBLE_DEVICES") == ("" if torch.cuda.device_count() < 2 else None)
    counts = {
        (HOROVODRUN, "--gloo", "-np", "2", "-H", "localhost:2", HYBRIDTRAIN, "train"): 2,
        (HOROVODRUN, "--gloo", "-np", "1", "-H", "localhost:1", sys.executable, "script.py"): 1,
        (TORCHRUN, "--standalone", "--nproc-per-node=2", "--no-python", HYBRIDTRAIN, "train"): 2,
        (TORCHRUN, "--nproc_per_node", "4", "train.py"): 4,
        ("mpirun", "--oversubscribe", "-np", "2", "-x", "PATH", HYBRIDTRAIN, "train"): 2,
        (*BENCHMARKS, "scale", "--config", "configs/demo.yaml", "--np", "1,2", "--steps", "4"): 2,
        (sys.executable, "-m", "benchmarks.probes.dali_epoch_boundary", "--ranks", "1,2"): 2,
        (sys.executable, "tests/scripts/horovod_hooks_one_rank.py", "out.json"): 1,
        (HYBRIDTRAIN, "train", "--config", "c.yaml", "--set", "train.batch_size=2"): 1,
    }
    assert {cmd: launch_ranks(cmd) for cmd in counts} == counts
    shown = "import os; print(repr(os.environ.get('CUDA_VISIBLE_DEVICES')))"
    assert run([sys.executable, "-c", shown], timeout=60).stdout.strip() == "None"  # one process: the GPUs kept
    pinned = run([sys.executable, "-c", shown, "-np", "2"], timeout=60).stdout.strip()  # counted as 2 ranks
    assert pinned == ("''" if torch.cuda.device_count() < 2 else "None")


def test_compiled_blocks_keep_horovods_hooks_firing_inside_the_backward():
    """#9: with train.compile_scope=blocks each block is its own node of the backward (compiling the whole model
    makes one), so a block's gradient hooks, registered as Horovod's DistributedOptimizer registers them, fire
    before the backward reaches the block below it, and its all-reduce overlaps the rest of the backward. The
    gradients equal the eager ones."""
    import torch

    from benchmarks.probes.hook_timing import GradientHooks
    from hybridtrain.engine.step import classification_loss, compiled_forward
    from hybridtrain.models.resnet import BasicBlock
    events = []

    class Marker(torch.nn.Module):  # eager, between the blocks: its hook fires when the backward gets there
        def forward(self, x):
            x.register_hook(lambda grad: events.append("between the blocks"))
            return x

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), BasicBlock(8, 8), Marker(), BasicBlock(8, 8),
                                torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(8, 10))
    names = {p: n for n, p in model.named_parameters()}
    lower, upper = ({n for n in names.values() if n.startswith(block)} for block in ("1.", "3."))
    images, labels = torch.randn(4, 3, 16, 16), torch.arange(4)
    gradients = {}
    for mode, forward in (("eager", model), ("blocks", compiled_forward(model, "blocks"))):
        for _ in range(2):  # the first pass compiles
            events.clear()
            model.zero_grad(set_to_none=True)
            hooks = GradientHooks(model, events.append)
            loss = classification_loss(forward(images), labels)
            regions = [{names[p] for p in region} for region in compiled_regions(loss)]
            loss.backward()
            hooks.remove()
        gradients[mode] = [p.grad.clone() for p in model.parameters()]
        marker = events.index("between the blocks")
        assert all(events.index(n) < marker for n in upper) and all(events.index(n) > marker for n in lower), events
        assert sorted(regions, key=sorted) == ([] if mode == "eager" else [lower, upper])
    torch.testing.assert_close(gradients["blocks"], gradients["eager"], rtol=1e-4, atol=1e-5)
    model.pop(2)  # no marker: compiling the whole model makes one region holding both blocks' gradients
    (region,) = compiled_regions(classification_loss(compiled_forward(model, "model")(images), labels))
    assert lower | upper <= {names[p] for p in region}


def test_bench_with_compile_runs_and_says_so(tmp_path):
    out = tmp_path / "bench.json"
    proc = run([*BENCHMARKS, "bench", "--config", "configs/demo.yaml", "--batch-size", "4", "--image-size", "32",
                "--set", "model.num_classes=10", "--set", "train.compile=true", "--steps", "2", "--warmup", "1",
                "--json", str(out)], timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (row,) = json.loads(out.read_text())
    assert row["optimizations"] == ["compile"] and row["host_syncs_per_step"] == 1 and row["images_per_sec"] > 0
    assert row["optimizer"] == "hybrid/adabound"  # the phase the optimizer's groups were in: the warmup's
    assert "| 4 | 32 | compile |" in proc.stdout


def test_bench_times_the_whole_step_as_train_runs_it_under_horovodrun(tmp_path):
    """In the hybrid optimizer's second phase (--phase sgd): both trainer rows report the phase their optimizer's
    groups were in after the timed steps, in process and in the horovodrun worker. Without --config, as gpu-check
    runs it: the worker gets the built-in defaults as a file (a None in its argv once crashed it)."""
    out = tmp_path / "bench.json"
    proc = run([*BENCHMARKS, "bench", "--set", "model.arch=resnet18", "--batch-size", "4", "--image-size", "32",
                "--set", "model.num_classes=10", "--steps", "2", "--warmup", "1", "--baseline", "--horovod",
                "--threads", "1", "--phase", "sgd", "--json", str(out)], timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    trainer, train, baseline = json.loads(out.read_text())
    assert (trainer["loop"], train["loop"], baseline["loop"]) == ("trainer", "train/horovod", "baseline")
    assert trainer["optimizer"] == train["optimizer"] == "hybrid/sgd+lars" and baseline["optimizer"] == "sgd"
    assert train["batch_size"] == 4 and train["images_per_sec"] > 0
    assert train["mean_ms"] == pytest.approx(4000 / train["images_per_sec"])  # one rank: b / step time
    for row in (trainer, train):
        assert row["over_baseline"] == pytest.approx(row["images_per_sec"] / baseline["images_per_sec"])
    assert "horovodrun --gloo -np 1" in proc.stdout
    assert "| train/horovod | resnet18 | hybrid/sgd+lars | fp32 | 4 | 32 |" in proc.stdout


def test_bench_phase_sgd_of_a_one_phase_optimizer_is_one_line():
    proc = run([*BENCHMARKS, "bench", "--config", "configs/demo.yaml", "--set", "optim.name=goyal", "--phase", "sgd"])
    assert_one_error_line(proc, "--phase sgd times the hybrid optimizer's second phase", "optim.name=goyal")


def test_bench_optim_times_both_phases_against_sgd(tmp_path):
    out = tmp_path / "optim.json"
    proc = run([*BENCHMARKS, "bench-optim", "--set", "model.arch=resnet18", "--steps", "3", "--warmup", "1",
                "--threads", "1", "--json", str(out)], timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert [r["optimizer"] for r in rows] == ["sgd-foreach", "hybrid/adabound", "hybrid/sgd+lars"]
    assert all(r["parameters"] == 11_689_512 and r["median_ms"] > 0 for r in rows)  # torchvision's resnet18
    for r in rows:
        assert r["ratio_to_sgd"] == pytest.approx(r["median_ms"] / rows[0]["median_ms"])
    assert "| hybrid/sgd+lars | resnet18 | 11,689,512 |" in proc.stdout


def test_compile_without_a_compiler_is_one_line():
    env = env_with_venv()
    env["CXX"] = env["CC"] = "/nonexistent/cc"
    proc = subprocess.run([*BENCHMARKS, "bench", "--config", "configs/demo.yaml", "--set", "train.compile=true"],
                          capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
    assert_one_error_line(proc, "train.compile=true needs", "/nonexistent/cc", "set train.compile=false")


# ----------------------------------------------------------------------------- CUDA graphs

@pytest.mark.skipif(torch_cuda_available(), reason="the CPU refusal; the GPU runs the graph below")
@pytest.mark.parametrize("name", ["bench", "train"])
def test_cuda_graphs_without_a_gpu_is_one_line(name, tmp_path):
    # synthetic input: the refusal must not depend on the demo's data being prepared
    proc = run([*command([name]), "--config", "configs/demo.yaml", "--set", "train.cuda_graphs=true",
                "--set", "data.backend=synthetic", "--set", f"run_dir={tmp_path / 'run'}"], timeout=300)
    assert_one_error_line(proc, "train.cuda_graphs=true needs a CUDA GPU", "set train.cuda_graphs=false")


@pytest.mark.skipif(not torch_cuda_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("precision", [["precision.mode=fp32"], ["precision.mode=mixed", "precision.compute_dtype=fp16"]],
                         ids=["fp32", "mixed-fp16"])
def test_graphed_steps_give_the_eager_losses(precision, job_of_one):
    import torch
    eager_step, eager_model = built_step(precision)
    graphed_step, graphed_model = built_step(precision + ["train.cuda_graphs=true"])
    eager = torch.stack([eager_step() for _ in range(4)])
    graphed = torch.stack([graphed_step() for _ in range(4)])
    torch.testing.assert_close(graphed, eager, rtol=1e-3, atol=1e-4)
    for a, b in zip(graphed_model.parameters(), eager_model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4)
    from hybridtrain.models.batchnorm import running_buffers
    # the capture's warm-up passes (on the static batch) left the BN statistics alone: with momentum 0.1 they
    # would still show after 4 steps
    for a, b in zip(running_buffers(graphed_model), running_buffers(eager_model)):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4)


# ----------------------------------------------------------------------------- optim.fused in training

@pytest.mark.slow
def test_train_with_the_fused_optimizer_crosses_the_phase_switch_and_times_its_compile_apart(small_digits, tmp_path,
                                                                                            write_config):
    """optim.fused end to end: the hybrid optimizer's compiled kernels train through the switch to SGD + LARS
    (epoch 2 here), the setup says the first steps compile, and epoch 2's first steps (the LARS kernel's compile)
    are timed apart as warmup, as the process's first steps are."""
    from conftest import tiny_config
    run_dir = tmp_path / "run"
    cfg = write_config(tiny_config(small_digits, str(run_dir), optim={"name": "hybrid", "adabound_epochs": 1,
                                                                      "fused": True}))
    proc = run([HYBRIDTRAIN, "train", "--config", cfg], timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "fused optimizer kernels: the first steps of this process and of epoch 2 compile" in proc.stdout
    assert "hybridtrain: switching to sgd at step 15" in proc.stdout  # 240 images / batch 16 per epoch
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in records] == [1, 2]
    assert all(r["warmup_samples"] == 3 * 16 and 0 < r["warmup_time_s"] < r["train_time_s"] for r in records)
    assert all(r["train_loss"] == r["train_loss"] and r["train_loss"] < 10 for r in records)  # finite


def test_bench_keeps_the_rows_it_measured_when_the_whole_step_launch_fails(tmp_path):
    """The whole step under torchrun is bench's last row: a launch that fails (here torchrun refuses its own
    PET_MAX_RESTARTS) leaves the in-process trainer and plain-loop rows in the JSON, then one error line, exit 2."""
    path = tmp_path / "bench.json"
    proc = subprocess.run([*BENCHMARKS, "bench", "--config", os.path.join(REPO, "configs", "demo.yaml"), "--engine",
                           "torch", "--baseline", "--steps", "1", "--warmup", "1", "--batch-size", "2", "--json",
                           str(path)], capture_output=True, text=True, timeout=600, cwd=str(tmp_path),
                          env={**os.environ, "PET_MAX_RESTARTS": "x"}, stdin=subprocess.DEVNULL)
    assert proc.returncode == 2
    assert_one_error_line(proc, "scale row torch np=1", "failed")
    rows = {r["loop"]: r for r in json.loads(path.read_text())}
    assert rows["trainer"]["images_per_sec"] > 0 and rows["baseline"]["trainer_over_baseline"] > 0
    assert rows["train/torch"] == {"loop": "train/torch", "error": proc.stderr.strip().removeprefix(
        "hybridtrain: error: ")}
    assert "| trainer |" in proc.stdout and "| baseline |" in proc.stdout

"""The second engine: torch.distributed (DDP) under real ``torchrun`` processes, Gloo on the CPU. Only what differs
from the Horovod engine is tested here; the shared loop, checkpoints and reports are covered by the Horovod tests.
"""
from __future__ import annotations

import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
import yaml
from conftest import (
    HYBRIDTRAIN,
    REPO,
    TORCHRUN,
    WITH_WORKERS,
    digits_subset,
    env_with_venv,
    error_lines,
    horovodrun,
    import_closure,
    read_metrics,
    run,
    tiny_config,
    torchrun,
    venv_without,
)
from test_horovod_training import rank_pids, signal_a_rank_after_epoch_one
from test_preemption import file_digest, train_until_sigterm

from hybridtrain.distributed.collectives import state_digest
from hybridtrain.distributed.launch_env import process_env, slurm_tasks_per_node
from hybridtrain.distributed.launcher import launcher_engine, resolve_engine
from hybridtrain.errors import UserError


def our_frames(output: str) -> list[str]:
    """Traceback frames in hybridtrain's own files (torchrun prints its own traceback when a rank fails)."""
    return re.findall(r'File ".*hybridtrain/(?:hybridtrain|\.venv/bin)/[^"]*"', output)


# ----------------------------------------------------------------------------- choosing the engine (pure)

@pytest.mark.parametrize("env,wanted,expected", [
    ({"TORCHELASTIC_RUN_ID": "x", "RANK": "0", "LOCAL_WORLD_SIZE": "2"}, "auto", "torch"),
    ({"HOROVOD_RANK": "1"}, "auto", "horovod"),
    ({"OMPI_COMM_WORLD_RANK": "0"}, "auto", "horovod"),  # mpirun
    ({"OMPI_COMM_WORLD_RANK": "0"}, "horovod", "horovod"),
    ({}, "torch", "torch"),  # alone, or under srun: whichever is named
    ({"SLURM_PROCID": "3"}, "horovod", "horovod"),
])
def test_the_engine_follows_the_launcher(env, wanted, expected):
    assert resolve_engine(wanted, env) == expected


@pytest.mark.parametrize("env,wanted,launcher", [({"TORCHELASTIC_RUN_ID": "x"}, "horovod", "horovodrun"),
                                                  ({"HOROVOD_RANK": "0"}, "torch", "torchrun")])
def test_an_engine_under_the_other_launcher_is_one_line_naming_the_right_launcher(env, wanted, launcher):
    with pytest.raises(UserError, match=f"launch with {launcher}"):
        resolve_engine(wanted, env)
    assert launcher_engine({}) is None


def test_the_rendezvous_comes_from_torchrun_or_from_srun():
    torchrun_env = {"TORCHELASTIC_RUN_ID": "j", "RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1",
                    "LOCAL_WORLD_SIZE": "4", "MASTER_ADDR": "n1", "MASTER_PORT": "29500", "SLURM_PROCID": "1"}
    assert process_env(torchrun_env) == {"rank": 5, "size": 8, "local_rank": 1, "local_size": 4}
    srun_env = {"SLURM_STEP_ID": "0", "SLURM_PROCID": "6", "SLURM_NTASKS": "8", "SLURM_LOCALID": "2",
                "SLURM_TASKS_PER_NODE": "4(x2)", "MASTER_ADDR": "n1", "MASTER_PORT": "29500"}
    assert process_env(srun_env) == {"rank": 6, "size": 8, "local_rank": 2, "local_size": 4}
    assert slurm_tasks_per_node({"SLURM_STEP_TASKS_PER_NODE": "3,2"}) == 3
    assert process_env({}) == {"rank": 0, "size": 1, "local_rank": 0, "local_size": 1}
    with pytest.raises(UserError, match="MASTER_ADDR"):
        process_env({k: v for k, v in srun_env.items() if k != "MASTER_ADDR"})


def test_gloo_can_be_forced_for_two_ranks_on_one_gpu_and_only_gloo():
    """gpu-check's 2-rank row on one GPU runs DDP over Gloo (NCCL refuses a shared GPU)."""
    import torch

    from hybridtrain.distributed.torch_distributed import BACKEND_VAR, backend_for
    cuda = torch.device("cuda", 0)  # a device object: nothing is allocated
    assert backend_for(cuda, {BACKEND_VAR: "gloo"}) == "gloo" and backend_for(torch.device("cpu"), {}) == "gloo"
    if torch.distributed.is_nccl_available():
        assert backend_for(cuda, {}) == "cpu:gloo,cuda:nccl"
    with pytest.raises(UserError, match=f"{BACKEND_VAR}='nccl': its one value is gloo"):
        backend_for(cuda, {BACKEND_VAR: "nccl"})


# ----------------------------------------------------------------------------- the collective timeout (pure)

@pytest.mark.parametrize("stall,gloo", [(600, 60), (8, 300), (1, 60), (60, 3600), (86400, 60)])
def test_the_collective_timeout_outlasts_the_stall_watchdog_of_every_rank(stall, gloo):
    """NCCL's watchdog (SIGABRT, C++ dumps) or Gloo's timeout must never end a stuck rank before
    the project's stall watchdog prints its one line, which rank r does stall_shutdown_s + min(r, 30) s after
    its last step (polling every 0.5 s); the group's timeout is a minute past the last rank's exit."""
    from hybridtrain.config import load_config
    from hybridtrain.distributed.torch_distributed import collective_timeout_s
    from hybridtrain.engine.guards import exit_after_s
    sets = ["distributed.stall_warning_s=1", f"distributed.stall_shutdown_s={stall}",
            f"distributed.gloo_timeout_s={gloo}"]
    timeout = collective_timeout_s(load_config(None, sets).distributed)
    assert timeout == max(gloo, stall + 30 + 60)
    for rank in (0, 1, 7, 29, 30, 31, 511):
        assert exit_after_s(stall, rank) == stall + min(rank, 30)
        assert timeout - (stall + min(rank, 30) + 0.5) > 59  # a minute to print and exit, less one poll
    off = load_config(None, ["distributed.stall_shutdown_s=0", f"distributed.gloo_timeout_s={gloo}"]).distributed
    assert collective_timeout_s(off) == max(gloo, 1800) and exit_after_s(0, 3) == 0  # off: torch's 30 minutes
    assert collective_timeout_s(None) == 1800


def test_the_stall_watchdog_ends_a_rank_when_exit_after_s_says():
    """The timing the timeout above relies on, on the real watchdog: rank 2 with stall_shutdown_s=1 exits (3)
    with its line 1 + 2 s after its last beat, not sooner. The clock starts at the beat as the script reports it
    (CLOCK_MONOTONIC: one clock for all processes), not at the process start, which a loaded machine stretches;
    the upper bound only says the watchdog, not the end of the 30 s sleep, ended it."""
    script = ("import time; from hybridtrain.engine.guards import StallWatchdog\n"
              "w = StallWatchdog(1, 1, rank=2, poll_s=0.05); w.beat(); print(time.monotonic(), flush=True)\n"
              "time.sleep(30)\n")
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=REPO)
    start = float(proc.stdout.readline())  # CLOCK_MONOTONIC: one clock for every process of this machine
    _, stderr = proc.communicate(timeout=60)
    took = time.monotonic() - start
    assert proc.returncode == 3 and "rank 2: no training step finished" in stderr, stderr
    assert 3 <= took < 25, took


# ----------------------------------------------------------------------------- the step on DDP (one torchrun job)

def test_the_ddp_step_matches_numpy_fp16_wire_accumulation_channels_last_and_a_skipped_step(tmp_path):
    out = tmp_path / "checks.json"
    proc = run([TORCHRUN, "--standalone", "--nproc-per-node=2", os.path.join(REPO, "tests", "scripts",
                                                                            "torch_engine_checks.py"), str(out)])
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    r = json.loads(out.read_text())
    for rank in (0, 1):
        mine = {k.split(".", 1)[1]: v for k, v in r.items() if k.startswith(f"rank{rank}.")}
        assert mine["fp16_wire_exact"], mine["fp16_wire_max_error"]  # fp16(fp16(g0)/2 + fp16(g1)/2), bit for bit
        assert mine["no_sync_kept_local"]
        assert mine["accumulated_max_error"] < 1e-6
        assert mine["nhwc_grads_keep_strides"] and mine["nhwc_conv_grad_is_channels_last"]
        assert mine["nhwc_broadcast_is_rank0s"] and mine["nhwc_broadcast_keeps_strides"]
        assert mine["nhwc_max_error"] < 1e-6
        # the inf was on rank 1 only: both ranks skipped, halved S, then stepped together
        assert mine["skipped_on_this_rank"] and mine["skipped_steps"] == 1 and mine["scale_after"] == 512.0
        assert mine["stepped_after"] and mine["ranks_equal_after"]
        # the second backward accumulates into the bucket views in place (no allocation, no copy)
        assert mine["grads_accumulated_in_bucket_views"] and mine["grads_still_bucket_views"]
    assert r["group_destroyed"]  # torch's Gloo group left to the interpreter's teardown aborts (SIGABRT) at times



def top_level_ops(action) -> list[str]:
    """The operators ``action()`` calls itself (a CPU foreach op's per-tensor fallback is its children)."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        action()
    return [e.name for e in prof.events() if e.name.startswith("aten::") and
            (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::"))]


def test_zero_grad_zeroes_ddp_bucket_views_in_one_foreach_op_and_sets_other_gradients_to_none(job_of_one):
    """The torch engine's zero_grad zeroes the gradients DDP made views of its buckets with one
    _foreach_zero_ (a zero_() each was 161 launches per ResNet-50 step on a GPU), in place (the views stay); the
    gradients of a model outside DDP (bench's trainer row) it sets to None, as torch's default and the plain loop
    bench compares with do."""
    from hybridtrain.config import load_config
    from hybridtrain.distributed import torch_distributed as engine
    cfg = load_config(None, ["distributed.engine=torch"])
    images = torch.randn(4, 3, 8, 8)

    def net():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.Flatten(),
                                   torch.nn.Linear(144, 3))
    ddp = engine.wrap_model(net(), cfg)
    params = list(ddp.module.parameters())
    optimizer = engine.wrap_optimizer(torch.optim.SGD(params, lr=0.1), ddp.module, cfg)
    for _ in range(2):  # DDP rebuilds its buckets at the second forward
        optimizer.zero_grad()
        ddp(images).sum().backward()
    views = [p.grad.data_ptr() for p in params]
    assert top_level_ops(optimizer.zero_grad) == ["aten::_foreach_zero_"]
    assert [p.grad.data_ptr() for p in params] == views and all(not p.grad.any() for p in params)

    plain = net()
    optimizer = engine.wrap_optimizer(torch.optim.SGD(plain.parameters(), lr=0.1), plain, cfg)
    plain(images).sum().backward()
    optimizer.zero_grad()
    assert all(p.grad is None for p in plain.parameters())
    plain(images).sum().backward()
    optimizer.zero_grad(set_to_none=False)  # asked for: in place
    assert all(p.grad is not None and not p.grad.any() for p in plain.parameters())

# ----------------------------------------------------------------------------- parity with the Horovod engine

def parity_recipe(data: str, run_dir: str) -> dict:
    return tiny_config(data, run_dir, train={"epochs": 2, "batch_size": 16, "deterministic": True},
                       optim={"name": "goyal", "lr": 0.05, "warmup_epochs": 1})


@pytest.fixture(scope="module")
def parity_runs(small_digits, tmp_path_factory):
    """The same recipe (fp32, SGD) trained on 2 ranks by each engine; each rank leaves the modules it imported from
    the checkout in closure-<engine>-PID.json beside the run (tests/scripts/import_closure.py)."""
    runs = {}
    for engine, launch in (("torch", torchrun), ("horovod", horovodrun)):
        run_dir = tmp_path_factory.mktemp(f"parity-{engine}")
        config = run_dir / "config.yaml"
        config.write_text(yaml.safe_dump(parity_recipe(small_digits, str(run_dir / "run"))))
        args = ["train", "--config", str(config)] + (["--engine", "torch"] if engine == "torch" else [])
        proc = launch(2, args, program=import_closure(str(run_dir / f"closure-{engine}")))
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        runs[engine] = (str(run_dir / "run"), proc.stdout)
    return runs


# What a train rank imports, both engines and both ranks taken together: the trainer, and nothing of the checkout's
# beside it. A change that grows it says why (the README's "Read the code" keeps the figure).
CLOSURE_LINES, CLOSURE_FILES = 10_700, 72


@pytest.mark.slow
def test_a_train_ranks_imports_are_the_package_alone_and_within_its_size(parity_runs):
    dumps = [path for engine, (run_dir, _) in parity_runs.items()
             for path in glob.glob(os.path.join(os.path.dirname(run_dir), f"closure-{engine}-*.json"))]
    assert len(dumps) == 4, dumps  # 2 ranks x 2 engines
    modules = {}
    for path in dumps:
        with open(path) as fh:
            modules.update(json.load(fh))
    package = os.path.join(REPO, "hybridtrain") + os.sep
    assert sorted(name for name, file in modules.items() if not file.startswith(package)) == []
    files = set(modules.values())
    lines = sum(len(open(f, "rb").read().splitlines()) for f in files)
    assert {"hybridtrain.distributed.horovod", "hybridtrain.distributed.torch_distributed",
            "hybridtrain.engine.loop"} <= set(modules), sorted(modules)
    assert len(files) <= CLOSURE_FILES and lines <= CLOSURE_LINES, (len(files), lines, sorted(modules))


@pytest.mark.slow
def test_both_engines_train_the_same_recipe_to_the_same_losses(parity_runs):
    torch_dir, torch_out = parity_runs["torch"]
    horovod_dir, _ = parity_runs["horovod"]
    ours, theirs = read_metrics(torch_dir), read_metrics(horovod_dir)
    assert [r["epoch"] for r in ours] == [1, 2]
    for a, b in zip(ours, theirs, strict=True):
        assert a["train_loss"] == pytest.approx(b["train_loss"], rel=1e-4)  # another summation order at most
        assert a["samples_seen"] == b["samples_seen"]
        assert abs(a["val_top1"] - b["val_top1"]) <= 0.01
    assert "actual average single-GPU training time" in torch_out  # the same summary table
    assert "2 rank(s) of the torch engine" in torch_out
    report = json.loads(open(os.path.join(torch_dir, "report.json")).read())
    assert len(set(report["rank_digests"])) == 1


@pytest.mark.slow
def test_a_checkpoint_of_either_engine_loads_bitwise_under_the_other(parity_runs, small_digits, tmp_path):
    """The torch run's last checkpoint, resumed by the Horovod engine (nothing left to train): the state each rank
    holds is the saved one, bit for bit (finish() digests it)."""
    moved = str(tmp_path / "moved")
    shutil.copytree(parity_runs["torch"][0], moved)
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(parity_recipe(small_digits, moved)))
    proc = horovodrun(2, ["train", "--config", str(config), "--resume"])
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "resumed from epoch 2" in proc.stdout and "of the horovod engine" in proc.stdout
    saved = torch.load(os.path.join(moved, "checkpoint-epoch0002.pt"), weights_only=True)
    digests = json.loads(open(os.path.join(moved, "report.json")).read())["rank_digests"]
    assert digests == [state_digest(saved["model"], saved["optimizer"])] * 2


# ----------------------------------------------------------------------------- preemption, resume, failures

@pytest.mark.slow
def test_sigterm_then_resume_is_bitwise_on_torch_and_continues_at_the_same_step_on_horovod(small_digits, tmp_path):
    few = digits_subset(small_digits, str(tmp_path / "few"), 8, 3)  # 5 steps of 2 x 8 per epoch
    def recipe(run_dir, **data):
        return tiny_config(few, str(tmp_path / run_dir), train={"epochs": 1, "batch_size": 8, "deterministic": True},
                           optim={"name": "goyal", "lr": 0.05, "warmup_epochs": 0}, data=data)
    def write(name, cfg):
        (tmp_path / name).write_text(yaml.safe_dump(cfg))
        return str(tmp_path / name)
    straight = torchrun(2, ["train", "--config", write("straight.yaml", recipe("straight")), "--engine", "torch"])
    assert straight.returncode == 0, straight.stdout[-3000:] + straight.stderr[-3000:]
    broken = write("broken.yaml", recipe("broken", **WITH_WORKERS))
    stopped = train_until_sigterm(broken, (1,), resume=False, engine="torch")
    assert stopped.returncode == 0, stopped.stdout[-3000:]
    line = next(x for x in stopped.stdout.splitlines() if "stopped on SIGTERM" in x)
    step = int(re.search(r"after step (\d+) of epoch 1;", line).group(1))
    assert 0 < step < 5 and not our_frames(stopped.stdout)
    shutil.copytree(tmp_path / "broken", tmp_path / "crossed")

    resumed = torchrun(2, ["train", "--config", broken, "--resume", "auto"])
    assert resumed.returncode == 0 and f"resumed from step {step} of epoch 1" in resumed.stdout
    assert file_digest(tmp_path / "broken" / "final_model.pt") == file_digest(tmp_path / "straight" / "final_model.pt")

    crossed = horovodrun(2, ["train", "--config", write("crossed.yaml", recipe("crossed", **WITH_WORKERS)),
                             "--resume", "auto"])
    assert crossed.returncode == 0, crossed.stdout[-3000:]
    assert f"resumed from step {step} of epoch 1" in crossed.stdout  # the same step, so the same next sample
    a, b = read_metrics(str(tmp_path / "straight"))[0], read_metrics(str(tmp_path / "crossed"))[0]
    assert a["samples_seen"] == b["samples_seen"]
    assert a["train_loss"] == pytest.approx(b["train_loss"], rel=1e-4)


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="needs /proc to find the ranks")
def test_a_killed_torch_rank_ends_the_job_quickly_naming_it(small_digits, tmp_path, write_config):
    run_dir = str(tmp_path / "run")
    cfg = write_config(tiny_config(small_digits, run_dir, train={"epochs": 20, "batch_size": 8}, data=WITH_WORKERS,
                                   distributed={"engine": "torch"}))
    proc, output, ended_after = signal_a_rank_after_epoch_one(cfg, run_dir, 2, 1, signal.SIGKILL, 0.3, "torch")
    assert proc.returncode != 0 and ended_after < 60, f"the job took {ended_after:.0f} s to end"
    lines = [x for x in output.splitlines() if "the job stopped because" in x]
    assert len(lines) == 1, output[-3000:]
    assert "rank 1 (its process is gone) died" in lines[0] and "--resume auto" in lines[0]
    assert not our_frames(output), output[-3000:]
    time.sleep(1)
    assert all(rank_pids(cfg, r, "torch") == [] for r in range(2)), "a rank was left behind"


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir("/proc"), reason="needs /proc to find the ranks")
def test_a_frozen_torch_rank_is_ended_by_the_stall_limits_with_a_warning_first(small_digits, tmp_path, write_config):
    """SIGSTOP rank 1 after epoch 1: rank 0's watchdog warns after stall_warning_s and ends the job after
    stall_shutdown_s in one line; torchrun then takes down the frozen rank (no rank is left behind)."""
    run_dir = str(tmp_path / "run")
    cfg = write_config(tiny_config(small_digits, run_dir, train={"epochs": 20, "batch_size": 8},
                                   distributed={"engine": "torch", "stall_warning_s": 3, "stall_shutdown_s": 8,
                                                "gloo_timeout_s": 300}))
    proc, output, ended_after = signal_a_rank_after_epoch_one(cfg, run_dir, 2, 1, signal.SIGSTOP, 0.3, "torch")
    assert proc.returncode != 0 and ended_after < 60, f"the job took {ended_after:.0f} s to end"
    assert "warning: rank 0: no training step finished" in output, output[-3000:]
    errors = [x for x in output.splitlines() if "hybridtrain: error:" in x]
    assert len(errors) == 1 and "distributed.stall_shutdown_s=8" in errors[0] and "--resume auto" in errors[0], errors
    assert not our_frames(output), output[-3000:]
    time.sleep(1)
    assert all(rank_pids(cfg, r, "torch") == [] for r in range(2)), "a rank was left behind"


# ----------------------------------------------------------------------------- refusals, one line each

def test_horovod_under_torchrun_is_refused_in_one_line(small_digits, tmp_path, write_config):
    cfg = write_config(tiny_config(small_digits, str(tmp_path / "run"), train={"epochs": 1}, optim={"name": "sgd"}))
    proc = torchrun(2, ["train", "--config", cfg, "--engine", "horovod"])
    lines = error_lines(proc.stdout + proc.stderr)
    assert proc.returncode != 0 and len(lines) == 1, proc.stderr[-3000:]
    assert "launch with horovodrun" in lines[0] and not our_frames(proc.stdout + proc.stderr)


# imported by every Python process of a launch (PYTHONPATH): a rank says at exit, before the interpreter's
# teardown, whether its process group is still alive
GROUP_AT_EXIT_PROBE = """
import atexit, os, sys
def _say():
    if "LOCAL_RANK" in os.environ and "torch.distributed" in sys.modules:
        alive = sys.modules["torch.distributed"].is_initialized()
        print(f"probe: rank {os.environ['RANK']}: group alive at exit: {alive}", file=sys.stderr, flush=True)
atexit.register(_say)
"""


def test_a_refusal_after_the_group_formed_ends_both_ranks_with_status_2_and_no_abort(small_digits, tmp_path,
                                                                                     write_config, monkeypatch):
    """Both ranks refuse a Horovod knob in wrap_model, after the process group formed. Each rank
    destroys its group on the way out (the probe sees it gone at exit), so each ends with the project's status 2
    and the one line, never with SIGABRT ("terminate called without an active exception", 134) from a group
    left to the interpreter's teardown, as it did at times."""
    probe = tmp_path / "probe"
    probe.mkdir()
    (probe / "sitecustomize.py").write_text(GROUP_AT_EXIT_PROBE)
    monkeypatch.setenv("PYTHONPATH", str(probe))
    cfg = write_config(tiny_config(small_digits, str(tmp_path / "run"), train={"epochs": 1}, optim={"name": "sgd"}))
    proc = torchrun(2, ["train", "--config", cfg, "--engine", "torch", "--set", "horovod.fusion_threshold_mb=64"])
    output = proc.stdout + proc.stderr
    lines = error_lines(output)
    assert proc.returncode != 0 and len(lines) == 1 and "horovod.fusion_threshold_mb" in lines[0], output[-3000:]
    assert "terminate called" not in output and "SIGABRT" not in output and not our_frames(output), output[-3000:]
    assert "the job stopped because" not in output, output[-3000:]  # rank 1's wait ends quietly, not as preempted
    # torchrun's report: the first failure it saw is a rank that ended by itself with 2 and had destroyed its
    # group (a slower rank may still be stopped by torchrun's SIGTERM); no rank aborted (-6)
    alive = dict(re.findall(r"probe: rank (\d): group alive at exit: (\w+)", output))
    root = re.search(r"Root Cause.*?rank\s*:\s*(\d+).*?exitcode\s*:\s*(-?\d+)", output, re.S)
    assert root and root.group(2) == "2" and alive.get(root.group(1)) == "False", output[-3000:]
    assert set(alive.values()) == {"False"}, output[-3000:]
    statuses = [int(x) for x in re.findall(r"exitcode\s*:\s*(-?\d+)", output)]
    assert -6 not in statuses and 134 not in statuses, output[-3000:]



# imported by every Python process of a launch (PYTHONPATH): when a rank prints its error line (after run_training
# called shutdown), it says first how many DDP wrappers are still alive, each holding the process group
DDP_AT_ERROR_PROBE = """
import gc, os, sys
class _Watch:
    def __init__(self, stream):
        self.stream = stream
    def write(self, text):
        if "hybridtrain: error:" in text and "torch.distributed" in sys.modules:
            ddp = sum(type(o).__name__ == "DistributedDataParallel" for o in gc.get_objects())
            self.stream.write(f"probe: rank {os.environ['RANK']}: DDP wrappers alive at the error line: {ddp}\\n")
        return self.stream.write(text)
    def __getattr__(self, name):
        return getattr(self.stream, name)
if "LOCAL_RANK" in os.environ:
    sys.stderr = _Watch(sys.stderr)
"""


def test_a_failure_mid_epoch_frees_the_group_at_shutdown_and_ends_the_job_at_once(small_digits, tmp_path,
                                                                                  write_config, monkeypatch):
    """An error after some steps of DDP (a static loss scale of 2^24 overflows the FP16 wire at every
    step; the third skipped step in a row stops the run, in epoch 1 of 7 steps) still frees the DDP wrapper, and
    with it the process group, when the rank shuts the engine down: the error's traceback held the trainer in
    its frames (and in the epoch's closures), so the wrapper outlived shutdown(). The job ends with rank 0's status
    2 and one line, no abort, no traceback of ours, and at once after the line."""
    probe = tmp_path / "probe"
    probe.mkdir()
    (probe / "sitecustomize.py").write_text(DDP_AT_ERROR_PROBE)
    monkeypatch.setenv("PYTHONPATH", str(probe))
    run_dir = tmp_path / "run"
    cfg = write_config(tiny_config(small_digits, str(run_dir), train={"epochs": 1}, optim={"name": "sgd"},
                                   precision={"mode": "fp32", "loss_scaling": "static", "loss_scale": 2.0 ** 24,
                                              "max_consecutive_overflows": 3},
                                   distributed={"engine": "torch", "compression": "fp16"}))
    proc = subprocess.Popen([TORCHRUN, "--standalone", "--nproc-per-node=2", "--no-python", HYBRIDTRAIN, "train",
                             "--config", cfg], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env_with_venv(), cwd=REPO, stdin=subprocess.DEVNULL, start_new_session=True)
    lines, error_at = [], None
    stop = threading.Timer(300, lambda: os.killpg(proc.pid, signal.SIGKILL))  # a hang fails, never blocks
    stop.start()
    try:
        for line in proc.stdout:  # the ranks' lines as they come (PYTHONUNBUFFERED)
            lines.append(line)
            if error_at is None and "hybridtrain: error:" in line:
                error_at = time.monotonic()
        proc.wait()
        ended_after = time.monotonic() - (error_at or 0)
    finally:
        stop.cancel()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    output = "".join(lines)
    errors = error_lines(output)
    assert proc.returncode != 0 and len(errors) == 1 and "3 steps in a row" in errors[0], output[-3000:]
    assert not (run_dir / "checkpoint-epoch0001.pt").exists()  # it failed inside epoch 1
    assert "probe: rank 0: DDP wrappers alive at the error line: 0" in output, output[-3000:]
    assert ended_after < 10, f"the job ended {ended_after:.1f} s after the error line"
    assert "terminate called" not in output and "SIGABRT" not in output and not our_frames(output), output[-3000:]
    root = re.search(r"Root Cause.*?rank\s*:\s*(\d+).*?exitcode\s*:\s*(-?\d+)", output, re.S)
    assert root and root.groups() == ("0", "2"), output[-3000:]
    # rank 1 waits quietly for rank 0's line (a refusal every rank makes), then torchrun stops it: 2 or SIGTERM
    statuses = [int(x) for x in re.findall(r"exitcode\s*:\s*(-?\d+)", output)]
    assert set(statuses) <= {2, -15}, output[-3000:]

@pytest.mark.parametrize("sets,needle", [(["--elastic"], "--elastic is Horovod's"),
                                         (["--set", "horovod.autotune=true"], "horovod.autotune tunes the Horovod"),
                                         (["--set", "horovod.fusion_threshold_mb=64"], "horovod.fusion_threshold_mb")])
def test_what_the_torch_engine_cannot_do_is_one_line(small_digits, tmp_path, write_config, sets, needle):
    cfg = write_config(tiny_config(small_digits, str(tmp_path / "run"), train={"epochs": 1}, optim={"name": "sgd"}))
    proc = run([HYBRIDTRAIN, "train", "--config", cfg, "--engine", "torch", *sets])
    lines = error_lines(proc.stderr)
    assert proc.returncode == 2 and len(lines) == 1 and needle in lines[0], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
def test_without_horovod_the_horovod_engine_names_the_install_option_and_auto_trains_on_torch(small_digits, tmp_path,
                                                                                             write_config):
    python = venv_without(str(tmp_path / "venv"), ["horovod", "horovod-*"])
    cfg = write_config(tiny_config(small_digits, str(tmp_path / "run"), train={"epochs": 1}, optim={"name": "sgd"}))
    env = env_with_venv()
    env["PATH"] = os.path.dirname(python) + os.pathsep + env["PATH"]
    named = subprocess.run([python, "-m", "hybridtrain", "train", "--config", cfg, "--engine", "horovod"],
                           capture_output=True, text=True, env=env, cwd=str(tmp_path), timeout=300)
    lines = error_lines(named.stderr)
    assert named.returncode == 2 and len(lines) == 1, named.stderr[-2000:]
    assert all(needle in lines[0] for needle in ("Horovod engine is not usable", "No module named 'horovod'",
                                                 "./install.sh", "HYBRIDTRAIN_SKIP_HOROVOD", "--engine torch"))
    auto = subprocess.run([python, "-m", "hybridtrain", "train", "--config", cfg], capture_output=True, text=True,
                          env=env, cwd=str(tmp_path), timeout=300)
    assert auto.returncode == 0, auto.stderr[-2000:]
    assert "1 rank(s) of the torch engine" in auto.stdout
    assert read_metrics(str(tmp_path / "run"))[0]["world_size"] == 1

"""Broken GPU nodes at install, and containers with a small
/dev/shm. Real processes: ``./install.sh --plan`` (and the install's first steps) with a stand-in ``nvidia-smi`` on
PATH printing each broken form, or hanging; ``hybridtrain train`` and a real DataLoader worker in a mount namespace
whose /dev/shm is a small tmpfs (root and ``unshare`` needed: skipped elsewhere)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from conftest import HYBRIDTRAIN, assert_one_error_line, env_with_venv, tiny_config

from hybridtrain.data import workers as shm
from install import plan as install_plan

REPO = Path(__file__).resolve().parent.parent
INSTALL = REPO / "install.sh"


# ----------------------------------------------------------------------------- 7. broken GPU nodes at install

def stand_in_smi(tmp_path: Path, rows: str = "", status: int = 0, sleep: float = 0, old: bool = False) -> dict:
    """An environment whose PATH has a stand-in nvidia-smi: it prints ``rows`` (one per GPU, in index order) and
    exits with ``status``; with -i LIST only those rows ('No devices were found', exit 6, for an index it lacks);
    the driver-only query prints each row's second field; ``sleep`` seconds first (a hung driver: it sleeps
    with exec, so that killing it ends it); ``old``: a driver older than the compute_cap field (exit 2 for that
    query, as r470 does). It writes its pid to smi.pid."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "rows").write_text(rows)
    script = bin_dir / "nvidia-smi"
    refuse_cap = 'echo "Field \\"compute_cap\\" is not a valid field to query."; exit 2' if old else ":"
    script.write_text(f"""#!/bin/bash
echo $$ > "{bin_dir}/smi.pid"
{f'sleep {sleep}' if sleep else ':'}
out="$(cat "{bin_dir}/rows")"
if [ "$1" = -i ]; then
  out="$(awk -v ids=",$2," 'index(ids, "," NR - 1 ",")' "{bin_dir}/rows")"
  [ -n "$out" ] || {{ echo "No devices were found"; exit 6; }}
fi
case "$*" in
  *compute_cap*) {refuse_cap} ;;
  *) out="$(sed 's/^[^,]*, //' <<<"$out")" ;;
esac
printf '%s\\n' "$out"
exit {status}
""")
    script.chmod(0o755)
    path = [p for p in os.environ["PATH"].split(os.pathsep) if not (Path(p) / "nvidia-smi").exists()]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HOROVOD_", "HYBRIDTRAIN_", "DALI_"))}
    env.update(PATH=os.pathsep.join([str(bin_dir)] + path), PYTHON=sys.executable,
               HYBRIDTRAIN_VENV=str(tmp_path / "never-made"), HYBRIDTRAIN_CACHE=str(tmp_path / "cache"))
    return env


def install(env: dict, *args: str, **extra) -> subprocess.CompletedProcess:
    return subprocess.run([str(INSTALL), *args], cwd=REPO, env=dict(env, **extra), capture_output=True, text=True,
                          timeout=60, stdin=subprocess.DEVNULL)


def one_install_error(result: subprocess.CompletedProcess, *needles: str) -> str:
    assert result.returncode == 1, result.stdout + result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip() and not line.startswith("  (full log")]
    assert len(lines) == 1 and lines[0].startswith("install: error: "), result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    # CUDA_VISIBLE_DEVICES does not change what nvidia-smi lists: never the install's fix, only the trainer's
    # beside HYBRIDTRAIN_GPUS, in nvidia-smi's (PCI bus) order
    assert "CUDA_VISIBLE_DEVICES" not in lines[0] or ("HYBRIDTRAIN_GPUS=" in lines[0] and
                                                     "CUDA_DEVICE_ORDER=PCI_BUS_ID CUDA_VISIBLE_DEVICES" in lines[0])
    return lines[0]


H100 = "9.0, 580.95.05\n"
BROKEN = [  # (stand-in rows, exit status, the cause the line must name, the fix it must offer)
    ("No devices were found", 6, "finds no GPU ('No devices were found')", "HYBRIDTRAIN_GPUS=none"),
    ("Failed to initialize NVML: Driver/library version mismatch\nNVML library version: 580.95", 18,
     "Driver/library version mismatch", "reboot the node"),
    ("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. Make sure that the latest "
     "NVIDIA driver is installed and running.", 9, "failed (exit 9): 'NVIDIA-SMI has failed", "HYBRIDTRAIN_GPUS=none"),
    (H100 + "ERR!, 580.95.05\n" + H100, 0, "GPU 1 as 'ERR!, 580.95.05' (ERR!", "HYBRIDTRAIN_GPUS=0,2"),
    ("[N/A], 580.95.05\n" * 2, 0, "GPU 0 as '[N/A], 580.95.05'", "nvidia-smi -r -i 0"),
    (H100 + "[Unknown Error], [Unknown Error]\n", 0, "GPU 1 as '[Unknown Error], [Unknown Error]'",
     "HYBRIDTRAIN_GPUS=0"),
]


@pytest.mark.parametrize("rows, status, cause, fix", BROKEN,
                         ids=["no-devices", "nvml-mismatch", "no-driver", "ERR", "N/A", "unknown-error"])
def test_a_broken_nvidia_smi_is_one_line_naming_the_cause(tmp_path, rows, status, cause, fix):
    """Before: 'No devices were found' and the NVML mismatch ended --plan silently (set -e on the driver-only
    fallback); ERR!/[N/A] rows planned for the GPUs left, or for no GPU (a CPU install on a GPU node)."""
    line = one_install_error(install(stand_in_smi(tmp_path, rows, status), "--plan"), cause, fix)
    assert line.count("HYBRIDTRAIN_TORCH=") == 0, line


def test_the_fixes_offered_for_broken_gpus_work(tmp_path):
    env = stand_in_smi(tmp_path, H100 + "ERR!, 580.95.05\n" + H100)
    line = one_install_error(install(env, "--plan"))
    gpus = line.split("HYBRIDTRAIN_GPUS=")[1].split()[0].rstrip(",;)")
    healthy = install(env, "--plan", HYBRIDTRAIN_GPUS=gpus)
    assert healthy.returncode == 0, healthy.stderr
    assert "plan: node: 2 x sm_90 (Hopper, e.g. H100/H200), driver 580.95.05 (HYBRIDTRAIN_GPUS=0,2" in healthy.stdout
    assert "HOROVOD_BUILD_CUDA_CC_LIST=90" in healthy.stdout
    none = install(stand_in_smi(tmp_path, "No devices were found", 6), "--plan", HYBRIDTRAIN_GPUS="none")
    assert none.returncode == 0 and "plan: node: no NVIDIA GPU: the install is the one for CPUs (HYBRIDTRAIN_GPUS=none" \
        in none.stdout, none.stdout + none.stderr
    (tmp_path / "bin" / "smi.pid").unlink(missing_ok=True)
    install(env, "--plan", HYBRIDTRAIN_GPUS="none")
    assert not (tmp_path / "bin" / "smi.pid").exists(), "HYBRIDTRAIN_GPUS=none must not ask nvidia-smi"
    wrong = install(env, "--plan", HYBRIDTRAIN_GPUS="7")
    one_install_error(wrong, "HYBRIDTRAIN_GPUS=7 names GPUs that nvidia-smi does not list")


def test_a_driver_too_old_for_compute_cap_is_still_named(tmp_path):
    """r470 refuses the compute_cap field (exit 2, a failure that is not the node's): the driver-only query that
    follows, now under the same time limit, still names the driver and its upgrade."""
    one_install_error(install(stand_in_smi(tmp_path, "-, 470.82.01\n", old=True), "--plan"),
                      "the NVIDIA driver 470.82.01 is older than r525", "upgrade the driver")


def test_a_node_with_two_kinds_of_gpu_is_planned_for_the_kind_named(tmp_path):
    """P40 + B200: no torch build serves both. The line used to offer CUDA_VISIBLE_DEVICES, which nvidia-smi (and
    so the plan) ignores; HYBRIDTRAIN_GPUS selects what nvidia-smi lists."""
    env = stand_in_smi(tmp_path, "6.1, 580.95.05\n10.0, 580.95.05\n")
    line = one_install_error(install(env, "--plan"), "no single torch", "HYBRIDTRAIN_GPUS=",
                             "CUDA_DEVICE_ORDER=PCI_BUS_ID")
    assert "CUDA_VISIBLE_DEVICES=<the same indices>" in line
    for gpus, variant in (("1", "(cu130)"), ("0", "(cu126)")):
        plan = install(env, "--plan", HYBRIDTRAIN_GPUS=gpus)
        assert plan.returncode == 0 and variant in plan.stdout, plan.stdout + plan.stderr


def test_a_hung_nvidia_smi_is_cut_off_in_plan_and_install(tmp_path):
    """nvidia-smi that never answers (a hung driver): --plan and the install itself stop after
    HYBRIDTRAIN_SMI_TIMEOUT seconds with one line, and the stand-in is killed, not waited for."""
    env = stand_in_smi(tmp_path, H100, sleep=30)
    for args, extra in ((["--plan"], {}), ([], {"HYBRIDTRAIN_SKIP_HOROVOD": "1"})):
        began = time.monotonic()
        result = install(env, *args, HYBRIDTRAIN_SMI_TIMEOUT="1", **extra)
        took = time.monotonic() - began
        one_install_error(result, "nvidia-smi did not answer within 1 s", "HYBRIDTRAIN_SMI_TIMEOUT")
        assert took < 15, took
        pid = int((tmp_path / "bin" / "smi.pid").read_text())
        for _ in range(50):
            if not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]:
                break
            time.sleep(0.1)
        else:
            pytest.fail(f"the hung nvidia-smi (pid {pid}) was left running")
    assert "[install 1] checking tools" in result.stdout and not (tmp_path / "never-made").exists()


def test_a_slow_nvidia_smi_gets_the_time_the_fix_names(tmp_path):
    env = stand_in_smi(tmp_path, H100, sleep=1.5)
    one_install_error(install(env, "--plan", HYBRIDTRAIN_SMI_TIMEOUT="1"), "raise HYBRIDTRAIN_SMI_TIMEOUT (now 1)")
    slow = install(env, "--plan", HYBRIDTRAIN_SMI_TIMEOUT="5")
    assert slow.returncode == 0 and "plan: node: 1 x sm_90" in slow.stdout, slow.stderr


@pytest.mark.parametrize("setting, value", [("HYBRIDTRAIN_GPUS", "all"), ("HYBRIDTRAIN_GPUS", "0;1"),
                                            ("HYBRIDTRAIN_SMI_TIMEOUT", "0"), ("HYBRIDTRAIN_SMI_TIMEOUT", "5s")])
def test_the_new_settings_are_checked_first(tmp_path, setting, value):
    one_install_error(install(stand_in_smi(tmp_path, H100), "--plan", **{setting: value}), f"{setting}={value}: use")


def test_no_refusal_offers_the_release_it_refuses():
    """The pinned torch for a GPU no build of it serves used to answer 'use HYBRIDTRAIN_TORCH=<the pin>'."""
    future = install_plan.refusal_for([(13, 0)], "590.10.01", install_plan.PINNED_TORCH, install_plan.builds_for(install_plan.PINNED_TORCH))
    assert f"HYBRIDTRAIN_TORCH={install_plan.PINNED_TORCH}" not in future and "unset" not in future, future
    assert "HYBRIDTRAIN_TORCH=system" in future
    old = install_plan.refusal_for([(10, 0)], "580.95.05", "2.5.1", install_plan.builds_for("2.5.1"))  # cu121 stops at sm_90
    assert f"leave HYBRIDTRAIN_TORCH unset for torch {install_plan.PINNED_TORCH}" in old, old
    assert install_plan.choose([(10, 0)], "580.95.05").error == "", "the fix offered: the pin serves a B200"
    pascal = install_plan.refusal_for([(6, 1)], "580.95.05", "2.15.0", install_plan.builds_for("2.15.0"))
    assert "HYBRIDTRAIN_TORCH=2.14.1" in pascal and install_plan.choose([(6, 1)], "580.95.05", "2.14.1").error == ""


# ----------------------------------------------------------------------------- 8. a small /dev/shm

def test_the_shared_memory_estimate_by_hand():
    """Batch 256 at 224 px: 256 x 3 x 224 x 224 = 38,535,168 B of pixels (9408 pages exactly) and two int64
    vectors of 2048 B (a page each); 8 workers x prefetch 2 + 2 = 18 batches per loader, and the validation
    loader at batch 128 (4704 + 2 pages) the same; 3 x 8 + 8 = 32 semaphore pages per loader; 8 ranks."""
    b = shm.WorkerBatches(batch=256, val_batch=128, crop=224, workers=8, prefetch=2)
    per_batch = 38_535_168 + 2 * 4096
    assert shm.batch_shm_bytes(256, 224) == per_batch
    assert b.bytes_per_rank() == 18 * per_batch + 18 * (19_267_584 + 2 * 4096) + 2 * 32 * 4096
    docker_default = (64 << 20, 64 << 20)
    line = shm.shm_refusal(b, 8, docker_default, workers_set=False)
    node_mb = 8 * b.bytes_per_rank() / (1 << 20)
    assert f"about {node_mb:.0f} MB" in line and "64 MB (64 MB free)" in line and "this node's 8 ranks" in line
    # 18 x (38,543,360 + 19,275,776) + 262,144 = 1,041,006,592 B per rank; x 8 ranks x 1.25 = 9.70 GiB
    assert b.bytes_per_rank() == 1_041_006_592 and "--shm-size=10g" in line, line
    assert "lower data.prefetch" not in line, "no prefetch fits in 8 MB per rank"
    assert "data.in_process=true (slower: no loader workers)" in line
    # a /dev/shm that holds the node's batches: no line; one rank alone and 90 % of it free: the largest prefetch
    assert shm.shm_refusal(b, 8, (8 * b.bytes_per_rank(), b.bytes_per_rank()), False) == ""
    one = shm.WorkerBatches(batch=16, val_batch=16, crop=32, workers=1, prefetch=8)
    assert one.bytes_per_rank() == 2 * (10 * (12 + 2) + 11) * 4096
    line = shm.shm_refusal(one, 1, (1 << 20, 1 << 20), workers_set=True)
    assert "lower data.prefetch to 6" in line and "drop data.workers" in line  # 2 x (8 x 14 + 11) pages <= 256
    assert shm.shm_refusal(one, 1, None, True) == ""


def namespace_with_small_shm(size: str) -> list[str]:
    """A command prefix: a private mount namespace whose /dev/shm is a ``size`` tmpfs (the host's is untouched)."""
    return ["unshare", "-m", "sh", "-c", f'mount -t tmpfs -o size={size} tmpfs /dev/shm && exec "$0" "$@"']


@pytest.fixture(scope="module")
def small_shm_allowed():
    if os.geteuid() != 0 or not shutil.which("unshare"):
        pytest.skip("a private /dev/shm needs root and unshare")
    probe = subprocess.run(namespace_with_small_shm("64k") + ["true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"mount namespaces are not allowed here: {probe.stderr.decode()[:200]}")


def test_a_small_shm_is_refused_before_the_workers_start(small_shm_allowed, small_digits, tmp_path):
    """A container's 1 MB /dev/shm (Docker's default is 64 MB) and loader workers that need more: a real
    ``hybridtrain train`` says so in one line with the fixes, before any worker starts."""
    cfg = tiny_config(small_digits, str(tmp_path / "run"), data={"workers": 1, "prefetch": 8})
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(cfg))
    cmd = namespace_with_small_shm("1m") + [HYBRIDTRAIN, "train", "--config", str(config)]
    refused = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env_with_venv(1),
                             stdin=subprocess.DEVNULL)
    assert_one_error_line(refused, "/dev/shm is too small for the loader workers: 1 MB (1 MB free)",
                          "--shm-size=1g", "lower data.prefetch to 6", "data.in_process=true", "drop data.workers")
    assert "DataLoader worker" not in refused.stderr, refused.stderr


WORKER_SCRIPT = """
import subprocess, sys, time
from hybridtrain.config import config_from_dict
from hybridtrain.data.folder import scan_dataset
from hybridtrain.data.torchvision_loader import create_train_loader, create_val_loader
from hybridtrain.data.workers import WorkerBatches, check_shared_memory, shm_space
from hybridtrain.errors import UserError

def shm_size(nbytes):
    subprocess.run(["mount", "-o", f"remount,size={nbytes}", "/dev/shm"], check=True)

cfg = config_from_dict({"data": {"path": sys.argv[1], "crop_size": 32, "workers": 1, "prefetch": 2},
                        "train": {"batch_size": 16}})
train_set, val_set = scan_dataset(sys.argv[1])
batches = WorkerBatches(16, 16, 32, 1, 2)
shm_size(batches.bytes_per_rank())   # exactly the estimate: the check passes, and the real batches must fit
check_shared_memory(batches, 1, True)
train, val = (make(images, cfg, 0, 1, 1) for make, images in ((create_train_loader, train_set),
                                                            (create_val_loader, val_set)))
iter(val)                            # both loaders' workers fill their prefetch at once (Loaders.start)
held = []
for batch in train:                  # the rank holds the batch it trains on and the one before
    held = (held + [batch])[-2:]
print("fits", len(train), "batches")
del held, batch
for batch in val:
    pass
del batch
for _ in range(50):                  # room for less than one batch (14 pages): another process filled it
    total, free = shm_space()        # (again while the workers still let go of what they sent)
    shm_size(total - free + 32 * 1024)
    time.sleep(0.1)
    if shm_space()[1] <= 32 * 1024:
        break
try:
    for batch in train:
        pass
    print("no failure")
except UserError as exc:
    print("LINE", exc)
"""


def test_the_estimate_holds_real_workers_and_a_full_shm_is_one_line(small_shm_allowed, small_digits):
    """Real spawned workers of both loaders in a /dev/shm of exactly the estimated size: every batch fits. Then
    /dev/shm shrunk below one batch (as when another process filled it, which no check foresees): torch's 'No
    space left on device' in the worker becomes the rank's one line, where it used to print a traceback from the
    queue's feeder thread and leave the rank waiting forever for the lost batch."""
    cmd = namespace_with_small_shm("64m") + [sys.executable, "-c", WORKER_SCRIPT, small_digits]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env_with_venv(1), cwd=REPO,
                            stdin=subprocess.DEVNULL)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert lines[0] == "fits 15 batches", result.stdout + result.stderr[-3000:]
    assert lines[1].startswith("LINE /dev/shm (0 MB, 0 MB free now) ran out of space while a loader worker "
                               "passed a batch"), result.stdout + result.stderr[-3000:]
    assert "--shm-size" in lines[1] and "data.in_process=true" in lines[1] and len(lines) == 2
    assert "Traceback" not in result.stderr, result.stderr[-3000:]


def test_the_failure_words_of_torch():
    """What torch 2.13 and 2.3 say (read from their DataLoader and storage sources), and what is not ours."""
    assert shm.shared_memory_failure(RuntimeError(
        "unable to write to file </torch_123_456_0>: No space left on device (28)"))
    assert shm.shared_memory_failure(RuntimeError(
        "DataLoader worker (pid 77) is killed by signal: Bus error. It is possible that dataloader's workers are "
        "out of shared memory. Please try to raise your shared memory limit."))
    assert not shm.shared_memory_failure(RuntimeError("[Errno 28] No space left on device: 'runs/x/ckpt.pt'"))

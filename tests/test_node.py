"""What a node can run (hybridtrain/distributed/node.py): the install's choice on a table of real nodes, through
``./install.sh --plan`` with a stand-in ``nvidia-smi`` on PATH (the only thing stood in: torch, Horovod and DALI are
never mocked), and the trainer's refusals on tables of real arch lists and driver versions."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hybridtrain.distributed import node
from hybridtrain.errors import UserError

REPO = Path(__file__).resolve().parent.parent
INSTALL = REPO / "install.sh"

# torch.cuda.get_arch_list() of real builds: 2.13.0+cu130 (read on this machine), the CUDA 12.6 builds (PyTorch's
# RELEASE.md CUDA matrix: 5.0;6.0;7.0;7.5;8.0;8.6;9.0), and a build with PTX (CUDA 13.0 "12.0+PTX" on Linux).
CU130 = ["sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120"]
CU126 = ["sm_50", "sm_60", "sm_70", "sm_75", "sm_80", "sm_86", "sm_90"]
CU130_PTX = CU130 + ["compute_120"]

# (node, nvidia-smi CSV, torch variant, DALI build, the words the torch line must hold)
NODES = [
    ("P40 + r535", "6.1, 535.183.01\n" * 4, "cu126", "120", "no kernels for sm_61"),
    ("V100 + r535", "7.0, 535.183.01\n" * 8, "cu126", "120", "no kernels for sm_70"),
    ("V100 + r580", "7.0, 580.95.05\n" * 8, "cu126", "120", "no kernels for sm_70"),
    ("T4 + r580", "7.5, 580.95.05\n", "cu130", "130", "from the registry"),
    ("A100 + r550", "8.0, 550.127.05\n" * 8, "cu126", "120", "needs driver r580+"),
    ("H100 + r580", "9.0, 580.65.06\n" * 8, "cu130", "130", "from the registry"),
    ("B200 + r580", "10.0, 580.95.05\n" * 8, "cu130", "130", "from the registry"),
]


@pytest.mark.parametrize("name, smi, variant, dali, why", NODES, ids=[n[0] for n in NODES])
def test_the_choice_for_real_nodes(name, smi, variant, dali, why):
    caps, driver = node.parse_smi(smi)
    plan = node.choose(caps, driver)
    assert plan.error == ""
    assert (plan.variant, plan.dali, plan.gpu_operations) == (variant, dali, "NCCL")
    assert plan.index == ("" if variant == "cu130" else f"{node.PYTORCH_INDEX}/{variant}")
    assert why in plan.lines[1], plan.lines
    assert plan.cc_list == f"{caps[0][0]}{caps[0][1]}"


def fake_smi(tmp_path: Path, text: str | None) -> dict:
    """An environment whose PATH has a stand-in nvidia-smi printing ``text`` (None: no nvidia-smi at all)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    path = [p for p in os.environ["PATH"].split(os.pathsep) if not (Path(p) / "nvidia-smi").exists()]
    if text is not None:
        (bin_dir / "smi.csv").write_text(text)
        script = bin_dir / "nvidia-smi"
        script.write_text(f'#!/bin/sh\ncase "$*" in *compute_cap*) cat "{bin_dir}/smi.csv" ;; '
                          f'*) sed "s/^[^,]*, //" "{bin_dir}/smi.csv" ;; esac\n')
        script.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HOROVOD_", "HYBRIDTRAIN_", "DALI_"))}
    env.update(PATH=os.pathsep.join([str(bin_dir)] + path), PYTHON=sys.executable,
               HYBRIDTRAIN_VENV=str(tmp_path / "never-made"))
    return env


def plan_of(tmp_path: Path, text: str | None, **extra) -> subprocess.CompletedProcess:
    env = fake_smi(tmp_path, text)
    env.update(extra)
    return subprocess.run([str(INSTALL), "--plan"], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("name, smi, variant, dali, why", NODES, ids=[n[0] for n in NODES])
def test_install_plan_on_real_nodes(tmp_path, name, smi, variant, dali, why):
    result = plan_of(tmp_path, smi)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert all(line.startswith("plan: ") for line in lines) and len(lines) <= 6, result.stdout
    torch_line = next(line for line in lines if line.startswith("plan: torch "))
    assert f"torch {node.PINNED_TORCH} and torchvision {node.PINNED_TORCHVISION}" in torch_line
    assert f"({variant})" in torch_line and why in torch_line
    assert f"plan: DALI: nvidia-dali-cuda{dali}" in result.stdout
    assert "HOROVOD_BUILD_CUDA_CC_LIST=" in result.stdout and "GPU operations NCCL" in result.stdout
    assert not (tmp_path / "never-made").exists(), "--plan installs nothing"


def test_install_plan_without_a_gpu_is_the_cpu_install(tmp_path):
    result = plan_of(tmp_path, None)
    assert result.returncode == 0, result.stderr
    assert "plan: node: no NVIDIA GPU" in result.stdout
    assert "from the registry (its default build)" in result.stdout
    assert "GPU operations none" in result.stdout


@pytest.mark.parametrize("smi, needle", [
    ("10.0, 570.86.10\n", "older than r580 (580.65.06)"),
    ("7.0, 470.82.01\n", "older than r525 (525.60.13)"),
    ("Field \"compute_cap\" is not a valid field to query.\n-, 470.82.01\n", "older than r525 (525.60.13)"),
    ("3.7, 535.183.01\n", "compute capability 5.0 or newer"),
    ("6.1, 580.95.05\n10.0, 580.95.05\n", "no single torch 2.13.0 build has kernels for every GPU"),
], ids=["B200-r570", "V100-r470", "r470-without-compute_cap", "K80", "P40+B200"])
def test_install_refuses_a_node_no_build_fits_in_one_line(tmp_path, smi, needle):
    result = plan_of(tmp_path, smi)
    assert result.returncode == 1
    errors = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(errors) == 1 and errors[0].startswith("install: error: ") and needle in errors[0], result.stderr


def test_a_torch_without_a_build_for_the_gpu_names_what_to_install():
    plan = node.choose([(7, 0)], "535.183.01", "2.15.0")
    assert "no build with kernels for sm_70" in plan.error and "HYBRIDTRAIN_TORCH=2.14.1" in plan.error
    old = node.choose([(7, 0)], "535.183.01", "2.3.1")
    assert (old.variant, old.torchvision, old.index) == ("cu121", "0.18", f"{node.PYTORCH_INDEX}/cu121")


@pytest.mark.parametrize("version, ok", [("2.2.2+cu121", False), ("2.1.0a0+32f93b1", False), ("2.3.0", True),
                                         ("2.3.0a0+6ddf5cf85e.nv24.04", True), ("2.13.0+cu130", True)])
def test_a_system_torch_older_than_the_oldest_is_refused(version, ok):
    """The versions NGC images and site installs report (the plan reads torch.__version__ with the system Python)."""
    line = node.check_system_torch(version)
    assert (line == "") == ok, line
    if not ok:
        assert line.startswith("HYBRIDTRAIN_TORCH=system: this Python's torch") and "older than 2.3" in line


def test_system_torch_is_checked_against_the_driver():
    plan = node.choose([(8, 0)], "550.127.05", "2.9.0", torch_cuda="13.0")
    assert "built for CUDA 13.0, which needs driver r580" in plan.error
    fine = node.choose([(8, 0)], "550.127.05", "2.4.0", torch_cuda="12.4")
    assert fine.error == "" and fine.dali == "120"


@pytest.mark.parametrize("setting, value, needle", [
    ("HYBRIDTRAIN_TORCH", "2.1.2", "older than 2.3, the oldest release hybridtrain supports"),
    ("HYBRIDTRAIN_TORCH", "latest", "use pinned (default), system, or a torch version"),
    ("HOROVOD_GPU_OPERATIONS", "nccl", "use NCCL (or MPI, or leave it unset)"),
    ("DALI_CUDA_MAJOR", "12", "use 120 or 130"),
    ("HYBRIDTRAIN_SKIP_HOROVOD", "yes", "use 1 (yes) or 0 (no)"),
    ("HYBRIDTRAIN_SKIP_DALI", "true", "use 1 (yes) or 0 (no)"),
    ("HYBRIDTRAIN_PIP_CONFIG", "mirror", "use auto, site or clean"),
    ("HYBRIDTRAIN_TORCH_INDEX", "no/such/folder", "neither an index URL"),
    ("HYBRIDTRAIN_WHEELHOUSE", "no/such/folder", "is not a folder"),
    ("HOROVOD_BUILD_CUDA_CC_LIST", "9.0", "without dots"),
])
def test_every_setting_is_checked_before_the_first_step(tmp_path, setting, value, needle):
    """The real install (not --plan), refused before its first step: no '[install 1]' line, no log, no venv."""
    env = fake_smi(tmp_path, None)
    env.update({setting: value, "HYBRIDTRAIN_CACHE": str(tmp_path / "cache")})
    result = subprocess.run([str(INSTALL)], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 1 and result.stdout == "", result.stdout
    assert result.stderr.strip() == result.stderr.strip().splitlines()[0], result.stderr
    assert result.stderr.startswith(f"install: error: {setting}=") and needle in result.stderr, result.stderr
    assert not (tmp_path / "cache").exists()


def test_a_dali_build_the_node_cannot_run_is_refused(tmp_path):
    result = plan_of(tmp_path, "7.0, 535.183.01\n", DALI_CUDA_MAJOR="130")
    assert result.returncode == 1 and "DALI's cuda130 build needs sm_75+ and driver r580+" in result.stderr


def test_the_pins_agree_with_install_sh():
    text = INSTALL.read_text()
    assert f'TORCH_VERSION="{node.PINNED_TORCH}"' in text
    assert f'TORCHVISION_VERSION="{node.PINNED_TORCHVISION}"' in text
    assert f'OLDEST_TORCH="{node.OLDEST_TORCH[0]}.{node.OLDEST_TORCH[1]}"' in text
    setup = (REPO / "setup.py").read_text()
    assert re.search(rf'TORCH = "torch=={re.escape(node.PINNED_TORCH.rsplit(".", 1)[0])}\.\*"', setup)


# ----------------------------------------------------------------------------- the trainer's checks

@pytest.mark.parametrize("cap, archs, ok", [
    ((6, 1), CU126, True),      # sm_60 cubins run on sm_61 (same major, higher minor)
    ((6, 1), CU130, False),     # P40 on the CUDA 13 build
    ((7, 0), CU130, False),     # V100 on the CUDA 13 build
    ((7, 0), CU126, True),
    ((8, 9), CU126, True),      # L40 runs sm_80/sm_86 cubins
    ((10, 0), CU126, False),    # B200 on the CUDA 12.6 build: no sm_100, no PTX
    ((10, 3), CU130, True),     # B300 runs sm_100 cubins
    ((12, 1), CU130_PTX, True),
    ((13, 0), CU130_PTX, True),  # a future GPU through PTX
    ((13, 0), CU130, False),
])
def test_kernel_refusal_on_real_arch_lists(cap, archs, ok):
    line = node.kernel_refusal(cap, "GPU", archs, "2.13.0+cu130", "13.0")
    assert (line == "") == ok, line
    if not ok:
        assert node.sm(cap) in line and "./install.sh" in line and "docs/hardware.md" in line


@pytest.mark.parametrize("driver_api, torch_cuda, ok", [
    (12020, "12.6", True),      # r535 (CUDA 12.2) runs the CUDA 12.6 build: minor version compatibility
    (12020, "13.0", False),     # r535 and the CUDA 13 build
    (12080, "13.0", False),     # r570
    (13000, "13.0", True),      # r580
    (13020, "12.6", True),
    (11040, "12.6", False),     # r470
    (0, "13.0", True),          # torch could not tell: nothing to say
])
def test_driver_refusal_on_real_driver_versions(driver_api, torch_cuda, ok):
    line = node.driver_refusal(driver_api, torch_cuda)
    assert (line == "") == ok, line
    if not ok:
        assert f"built for CUDA {torch_cuda}" in line and "upgrade the driver" in line


def test_bf16_and_fp16_rate():
    assert "compute capability 8.0" in node.bf16_refusal((7, 0), "Tesla V100", {"bf16"})
    assert node.bf16_refusal((8, 0), "A100", {"bf16"}) == ""
    assert node.bf16_refusal((6, 1), "Tesla P40", {"fp16"}) == ""
    warning = node.fp16_rate_warning((6, 1), "Tesla P40", {"fp16"})
    assert warning.startswith("warning:") and node.P40_RECIPE in warning and "1/64" in warning
    assert node.fp16_rate_warning((6, 0), "Tesla P100", {"fp16"}) == ""
    assert node.fp16_rate_warning((6, 1), "Tesla P40", set()) == ""


def test_compute_dtypes_of_precision_settings():
    from hybridtrain.config import PrecisionConfig
    assert node.compute_dtypes("mixed-bf16") == {"bf16"}
    assert node.compute_dtypes("mixed") == {"fp16"} and node.compute_dtypes("fp32") == set()
    assert node.compute_dtypes(PrecisionConfig()) == set()
    layered = PrecisionConfig(mode="layered")
    assert node.compute_dtypes(layered) == {"fp16"}


def test_check_node_on_this_machine():
    """The real torch: the CPU device passes (a warning only when a GPU driver is there but too old)."""
    import torch
    assert isinstance(node.check_node(torch.device("cpu"), "mixed-fp16"), list)
    assert node.driver_api_version() >= 0  # 0 here without a driver; 12020-style on a GPU node
    if torch.cuda.is_available():
        with pytest.raises(UserError) if not torch.cuda.is_bf16_supported() else _nothing():
            node.check_node(torch.device("cuda", 0), "mixed-bf16")


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_node_module_imports_no_torch():
    code = ("import sys; import hybridtrain.distributed.node; "
            "print([m for m in sys.modules if m == 'torch' or m.startswith('torch.')][:3])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr


def test_skip_horovod_needs_no_compiler_or_cmake(tmp_path):
    """HYBRIDTRAIN_SKIP_HOROVOD=1: check_tools asks for Python and venv only (a cluster without a compiler), and
    the plan says Horovod is not installed; without it the same PATH is refused for the missing compiler."""
    env = fake_smi(tmp_path, None)
    bare = tmp_path / "bare"
    bare.mkdir()
    for tool in ("bash", "dirname", "sed", "cat", "head", "date", "awk", "grep", "tr", "cut", "cksum", "mkdir"):
        found = subprocess.run(["bash", "-c", f"command -v {tool}"], capture_output=True, text=True).stdout.strip()
        if found:
            (bare / tool).symlink_to(found)
    env["PATH"] = f"{bare}{os.pathsep}{Path(sys.executable).parent}"
    env["CXX"] = "no-such-compiler"
    script = f". '{INSTALL}'; check_tools"
    skipped = subprocess.run(["bash", "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60,
                             env=dict(env, HYBRIDTRAIN_SKIP_HOROVOD="1"))
    assert skipped.returncode == 0, skipped.stderr
    built = subprocess.run(["bash", "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60, env=env)
    assert built.returncode == 1 and "no C++ compiler (no-such-compiler)" in built.stderr, built.stderr
    plan = plan_of(tmp_path, None, HYBRIDTRAIN_SKIP_HOROVOD="1")
    assert "plan: Horovod: not installed (HYBRIDTRAIN_SKIP_HOROVOD=1)" in plan.stdout


def test_system_torch_without_torch_is_one_line(tmp_path):
    """HYBRIDTRAIN_TORCH=system with a real Python that has no torch (the base interpreter, -I: no user site)."""
    bare = tmp_path / "python"
    bare.write_text(f'#!/bin/sh\nexec {getattr(sys, "_base_executable", sys.executable)} -s "$@"\n')
    bare.chmod(0o755)
    probe = subprocess.run([str(bare), "-c", "import torch"], capture_output=True)
    if probe.returncode == 0:
        pytest.skip("the base interpreter has torch")
    result = plan_of(tmp_path, None, HYBRIDTRAIN_TORCH="system", PYTHON=str(bare))
    assert result.returncode == 1
    assert result.stderr.startswith(f"install: error: HYBRIDTRAIN_TORCH=system: {bare} has no torch that imports")

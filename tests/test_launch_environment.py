"""The torch engine's launch environment, the launchers' own blocks,
restarts that work. Real processes: lone ``hybridtrain train`` runs in environments doctored as an old shell, srun
(MpiDefault=pmix) or torchrun leaves them; real ``torchrun`` launches, bare and through ``launch/torchrun.sh``; a
rank SIGKILLed under ``torchrun --max-restarts``."""
from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest
import yaml
from conftest import HYBRIDTRAIN, REPO, TORCHRUN, digits_subset, env_with_venv, error_lines, read_metrics, tiny_config
from test_horovod_training import rank_pids

from hybridtrain.distributed import failures
from hybridtrain.distributed.launcher import launcher_engine, resolve_engine

TORCHRUN_SH = os.path.join(REPO, "launch", "torchrun.sh")
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK",
               "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS",
               "TORCHELASTIC_ERROR_FILE", "HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK")
# what srun sets for task 0 of a 1-task-per-node step on a cluster with MpiDefault=pmix
SRUN_PMIX = {"SLURM_JOB_ID": "77", "SLURM_STEP_ID": "0", "SLURM_PROCID": "0", "SLURM_NTASKS": "1",
             "SLURM_LOCALID": "0", "SLURM_TASKS_PER_NODE": "1", "PMIX_RANK": "0", "PMI_RANK": "0"}


def doctored_env(ranks: int = 1, **variables: str) -> dict:
    """The tests' environment without any launcher's variables, then ``variables``."""
    env = {k: v for k, v in env_with_venv(ranks).items() if k not in LAUNCH_VARS and not k.startswith("SLURM_")}
    env.update(variables)
    return env


def popen(cmd: list[str], env: dict) -> subprocess.Popen:
    return subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, stdin=subprocess.DEVNULL)


def finish(proc: subprocess.Popen, timeout: float, config: str) -> str:
    """The job's output once it ended; if it outlives ``timeout``, its session and its ranks (torchrun starts each
    in a session of its own) are killed first."""
    try:
        return proc.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        for pid in rank_pids(config, 0, "torch") + rank_pids(config, 1, "torch"):
            os.kill(pid, signal.SIGKILL)
        return proc.communicate()[0]


@pytest.fixture(scope="module")
def few(small_digits, tmp_path_factory) -> str:
    """8 train and 3 val images per class: 5 steps of 2 x 8 per epoch."""
    return digits_subset(small_digits, str(tmp_path_factory.mktemp("data") / "few"), 8, 3)


def recipe(tmp_path, data: str, name: str = "config.yaml", **train) -> tuple[str, str]:
    run_dir = str(tmp_path / name.replace(".yaml", ""))
    cfg = tiny_config(data, run_dir, train={"epochs": 2, "batch_size": 8, **train},
                      optim={"name": "goyal", "lr": 0.05, "warmup_epochs": 0})
    path = tmp_path / name
    path.write_text(yaml.safe_dump(cfg))
    return str(path), run_dir


# ----------------------------------------------------------------------------- 1. the launch environment

TORCHRUN_RANK_1 = {"TORCHELASTIC_RUN_ID": "x", "RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1",
                   "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "localhost", "MASTER_PORT": "29500"}
SRUN_TASK_0 = {**SRUN_PMIX, "SLURM_NTASKS": "2", "SLURM_TASKS_PER_NODE": "2"}
SRUN_TASK_1 = {**SRUN_TASK_0, "SLURM_PROCID": "1", "SLURM_LOCALID": "1", "PMIX_RANK": "1", "PMI_RANK": "1"}


@pytest.mark.parametrize("engine,variables,needles", [
    # an old shell's torchrun variables, and a lone train: no rendezvous that waits for ranks that never come;
    # auto too (a launcher it does not know would split the job into 1-rank jobs)
    ("torch", {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "localhost", "MASTER_PORT": "29500"},
     ["RANK=1 and WORLD_SIZE=2 are set", "neither torchrun nor srun", "unset RANK WORLD_SIZE"]),
    ("auto", {"RANK": "0", "WORLD_SIZE": "4"}, ["RANK=0 and WORLD_SIZE=4 are set", "unset RANK"]),
    ("torch", {**TORCHRUN_RANK_1, "RANK": "2"}, ["RANK=2 is outside the job's 2 rank(s)", "WORLD_SIZE=2"]),
    ("torch", {**TORCHRUN_RANK_1, "LOCAL_RANK": "one"}, ["rank 1: LOCAL_RANK='one' is not a whole number"]),
    ("torch", {**TORCHRUN_RANK_1, "LOCAL_RANK": "3"}, ["LOCAL_RANK=3 with LOCAL_WORLD_SIZE=2"]),
    ("torch", {**TORCHRUN_RANK_1, "RANK": "0", "MASTER_PORT": "70000"}, ["MASTER_PORT='70000' is not a port"]),
    # srun with MpiDefault=pmix: PMIX_RANK is srun's, not Horovod's launcher (this line came from the torch
    # engine's own check, not "started by horovod's launcher")
    ("torch", SRUN_TASK_0, ["this 2-rank job sets no MASTER_ADDR", "scontrol show hostnames"]),
    ("torch", {**SRUN_TASK_1, "RANK": "0", "MASTER_ADDR": "n1", "MASTER_PORT": "29500"},
     ["RANK=0 but srun made this task rank 1 (SLURM_PROCID=1)", "unset it in the job script"]),
    # srun without MPI: Horovod would form two 1-rank jobs
    ("horovod", {k: v for k, v in SRUN_TASK_0.items() if "PMI" not in k},
     ["srun of 2 tasks that set up no MPI", "each task would train alone", "--mpi=pmix"]),
])
def test_a_launch_variable_left_or_wrong_is_one_line_within_seconds(engine, variables, needles, few, tmp_path):
    """Refused before torch is imported (a fraction of a second of work), never a wait at MASTER_ADDR:MASTER_PORT,
    C++ frames or 'unexpected ... (a bug)'."""
    config, run_dir = recipe(tmp_path, few)
    start = time.monotonic()
    proc = subprocess.run([HYBRIDTRAIN, "train", "--config", config, "--engine", engine], env=doctored_env(**variables),
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    took = time.monotonic() - start
    lines = error_lines(proc.stderr)
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-2000:]
    assert all(needle in lines[0] for needle in needles), lines[0]
    assert "unexpected" not in lines[0] and "Traceback" not in proc.stderr and "[E" not in proc.stderr
    assert took < 10, f"{took:.1f} s"  # ~1 s here: no torch import, no rendezvous
    assert not os.path.exists(run_dir)


@pytest.mark.parametrize("variables,wanted,engine", [
    ({**SRUN_PMIX}, "torch", "torch"),  # launch/slurm-torch.sbatch on a pmix cluster
    ({**SRUN_PMIX, "SLURM_NTASKS": "8"}, "auto", "horovod"),  # srun wired up MPI (pmix): Horovod can form it
    ({k: v for k, v in SRUN_TASK_0.items() if "PMI" not in k}, "auto", "torch"),  # no MPI: Horovod could not
    ({**SRUN_PMIX, "TORCHELASTIC_RUN_ID": "j", "RANK": "3"}, "auto", "torch"),  # torchrun started by srun
    ({**SRUN_PMIX, "TORCHELASTIC_RUN_ID": "j"}, "torch", "torch"),
    ({"PMI_RANK": "3"}, "auto", "horovod"),  # MPICH's mpirun (no srun step)
    ({**SRUN_PMIX, "PMIX_RANK": "5"}, "auto", "horovod"),  # an MPI launcher inside the step: its own rank
])
def test_srun_and_its_pmi_variables_choose_no_engine_and_torchrun_under_srun_is_torchs(variables, wanted, engine):
    assert resolve_engine(wanted, variables) == engine
    assert launcher_engine(variables) == ("torch" if "TORCHELASTIC_RUN_ID" in variables else
                                          None if variables.get("PMIX_RANK", "0") == "0" and "SLURM_STEP_ID" in
                                          variables else "horovod")


def test_torchrun_started_by_srun_on_a_pmix_cluster_prints_one_line(few, tmp_path):
    """srun's PMIX_RANK=0 reaches both of torchrun's ranks: each took it for its rank, and rank 1 printed rank 0's
    refusal too (and auto took Horovod's launcher for theirs)."""
    config, _ = recipe(tmp_path, few)
    proc = subprocess.run([TORCHRUN, "--standalone", "--nproc-per-node=2", "--no-python", HYBRIDTRAIN, "train",
                           "--config", config, "--set", "train.epoch=3"], env=doctored_env(2, **SRUN_PMIX), cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    lines = error_lines(proc.stdout + proc.stderr)
    assert proc.returncode != 0 and len(lines) == 1 and "did you mean 'train.epochs'" in lines[0], proc.stderr[-3000:]
    assert "rank 1:" not in lines[0]


def test_slurm_torch_sbatch_trains_on_a_pmix_cluster(few, tmp_path):
    """launch/slurm-torch.sbatch with an srun stand-in that starts 2 tasks as srun does with MpiDefault=pmix
    (SLURM_* and PMIX_RANK/PMI_RANK per task): both ranks meet at the script's MASTER_ADDR:MASTER_PORT and train on
    the torch engine; before, each refused PMIX_RANK as Horovod's launcher."""
    config, run_dir = recipe(tmp_path, few, epochs=1)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text("#!/bin/sh\necho localhost\n")
    (bin_dir / "srun").write_text(
        "#!/bin/bash\nshift  # --kill-on-bad-exit=1\n"
        "for t in 0 1; do SLURM_STEP_ID=0 SLURM_PROCID=$t PMIX_RANK=$t PMI_RANK=$t SLURM_NTASKS=2 SLURM_LOCALID=$t "
        "SLURM_TASKS_PER_NODE=2 \"$@\" & done\nstatus=0; for t in 0 1; do wait -n || status=$?; done; exit $status\n")
    for tool in ("scontrol", "srun"):
        (bin_dir / tool).chmod(0o755)
    env = doctored_env(2, SLURM_JOB_ID="77", SLURM_JOB_NODELIST="localhost", MASTER_PORT=str(29500 + os.getpid() % 900))
    env["PATH"] = f"{bin_dir}{os.pathsep}{env['PATH']}"
    proc = subprocess.run(["bash", os.path.join(REPO, "launch", "slurm-torch.sbatch"), "--config", config], env=env,
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "2 rank(s) of the torch engine" in proc.stdout, proc.stdout[-2000:]
    assert [r["world_size"] for r in read_metrics(run_dir)] == [2]


# ----------------------------------------------------------------------------- 2. the launchers' own blocks

def test_a_refusal_under_torchrun_restarts_is_made_once_and_the_wrapper_ends_in_one_line(few, tmp_path):
    """torchrun --max-restarts 2 and a config typo: the line once (a restarted attempt ends at once with the first
    attempt's status, silently), torchrun's box names our line (its error file), and launch/torchrun.sh leaves out
    torchrun's log lines, traceback and box and ends with its own line and the rank's status 2."""
    config, _ = recipe(tmp_path, few)
    bare = subprocess.run([TORCHRUN, "--standalone", "--nproc-per-node=2", "--max-restarts=2", "--no-python",
                           HYBRIDTRAIN, "train", "--config", config, "--set", "train.epoch=3"], env=doctored_env(2),
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    output = bare.stdout + bare.stderr
    assert len(error_lines(output)) == 1, output[-4000:]
    assert output.count("failed (exitcode: 2)") == 3  # three attempts, each ended with status 2
    assert "traceback : config error: unknown key 'train.epoch'" in output, output[-3000:]  # the box names it
    assert "To enable traceback" not in output

    wrapped = subprocess.run([TORCHRUN_SH, "--nproc-per-node", "2", "--max-restarts", "2", "--config", config, "--",
                              "--set", "train.epoch=3"], env=doctored_env(2), cwd=REPO, capture_output=True,
                             text=True, timeout=120)
    assert wrapped.returncode == 2, wrapped.stderr[-3000:]
    lines = wrapped.stderr.strip().splitlines()
    assert len(lines) == 2 and "did you mean 'train.epochs'" in lines[0], wrapped.stderr[-3000:]
    assert lines[1].startswith("launch: error: torchrun: the job refused its input") and "status 2" in lines[1]


def test_a_preemption_under_launch_torchrun_exits_0_with_a_resumable_checkpoint(few, tmp_path):
    """SIGTERM to launch/torchrun.sh (as Slurm signals the batch step): the ranks stop after the same step and
    checkpoint, and the job ends with status 0, as the docs promise, not torchrun's SignalException status 1."""
    config, run_dir = recipe(tmp_path, few)
    proc = popen([TORCHRUN_SH, "--nproc-per-node", "2", "--config", config], doctored_env(2))
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if "steps/epoch" in line:  # the ranks' handlers are in place
            os.kill(proc.pid, signal.SIGTERM)
            break
    output = "".join(lines) + finish(proc, 180, config)
    assert proc.returncode == 0, output[-3000:]
    assert "stopped on SIGTERM after step" in output and "launch: torchrun stopped on SIGTERM" in output, output
    assert "SignalException" not in output and "Traceback" not in output
    assert any(name.startswith("checkpoint-epoch0001-step") for name in os.listdir(run_dir))


# ----------------------------------------------------------------------------- 3. restarts that work

# imported by every Python process of the launch (PYTHONPATH): the first rank of torchrun's second attempt starts
# RESTART_DELAY_S late, so the other rank reaches the rendezvous first and finds the previous attempt's keys in the
# agent's store (before the fix: Gloo's connectFullMesh "Connection refused" to a dead rank's address)
LATE_RANK_0 = """
import os, sys, time
if os.environ.get("TORCHELASTIC_RESTART_COUNT") == "1" and os.environ.get("RANK") == "0" and "train" in sys.argv:
    time.sleep(float(os.environ["RESTART_DELAY_S"]))
"""


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="needs /proc to find the ranks")
def test_a_rank_killed_mid_epoch_under_max_restarts_resumes_and_finishes(few, tmp_path):
    """The documented path: launch/torchrun.sh --max-restarts 1 -- --resume auto. Rank 1 is SIGKILLed in epoch 2;
    the survivor names it and ends at once; torchrun restarts both ranks, which meet again (each attempt's group
    under its own store prefix), resume from epoch 1's checkpoint and finish, status 0."""
    probe = tmp_path / "probe"
    probe.mkdir()
    (probe / "sitecustomize.py").write_text(LATE_RANK_0)
    config, run_dir = recipe(tmp_path, few, epochs=3)
    env = doctored_env(2, PYTHONPATH=str(probe), RESTART_DELAY_S="3")
    start = time.monotonic()
    proc = popen([TORCHRUN_SH, "--nproc-per-node", "2", "--max-restarts", "1", "--config", config, "--",
                  "--resume", "auto"], env)
    try:
        while not os.path.exists(os.path.join(run_dir, "checkpoint-epoch0001.pt")) and proc.poll() is None:
            time.sleep(0.05)
        victims = rank_pids(config, 1, "torch")
        assert victims, "rank 1 not found"
        for pid in victims:
            os.kill(pid, signal.SIGKILL)
    finally:
        output = finish(proc, 300, config)
    took = time.monotonic() - start
    assert proc.returncode == 0, output[-4000:]
    assert output.count("rank 1 (its process is gone) died") == 1, output[-4000:]
    assert "resumed from epoch 1" in output and "unexpected" not in output, output[-4000:]
    assert [r["epoch"] for r in read_metrics(run_dir)] == [1, 2, 3]
    assert os.path.exists(os.path.join(run_dir, "final_model.pt"))
    assert took < 150, f"{took:.0f} s: a rank ignored torchrun's SIGTERM until its SIGKILL 30 s later?"


# rank 1 never reaches the rendezvous (asleep before its imports); rank 0 says when it has reached it
GROUP_FORMS_LATE = """
import os, signal, sys, threading, time
if os.environ.get("RANK") == "1" and "train" in sys.argv:
    time.sleep(60)
if os.environ.get("RANK") == "0" and "train" in sys.argv:
    def _say_when_meeting():
        while signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):  # run_training's first line
            time.sleep(0.05)
        time.sleep(1)  # then the rendezvous
        print("probe: rank 0 is meeting", flush=True)
    threading.Thread(target=_say_when_meeting, daemon=True).start()
"""


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="needs /proc to find the ranks")
def test_sigterm_while_the_ranks_meet_ends_the_rank_at_once(few, tmp_path):
    """Rank 0 waits in the rendezvous for a rank 1 that does not come (here: asleep). torchrun's SIGTERM (after
    another rank's death, or a preemption) used to set the preemption flag alone, which no step would ever read:
    the rank waited for torchrun's SIGKILL 30 s later. Now it ends at once, status 0, with one line."""
    probe = tmp_path / "probe"
    probe.mkdir()
    (probe / "sitecustomize.py").write_text(GROUP_FORMS_LATE)
    config, _ = recipe(tmp_path, few)
    proc = popen([TORCHRUN, "--standalone", "--nproc-per-node=2", "--no-python", HYBRIDTRAIN, "train", "--config",
                  config, "--engine", "torch"], doctored_env(2, PYTHONPATH=str(probe)))
    lines, ended_after = [], None
    try:
        for line in proc.stdout:
            lines.append(line)
            if "probe: rank 0 is meeting" in line:
                rank_0 = rank_pids(config, 0, "torch")
                os.kill(rank_0[0], signal.SIGTERM)
                signalled = time.monotonic()
                while failures.process_alive(rank_0[0]) and time.monotonic() - signalled < 20:
                    time.sleep(0.05)
                ended_after = time.monotonic() - signalled
                break
    finally:
        output = "".join(lines) + finish(proc, 0.1, config)
    assert ended_after is not None and ended_after < 5, f"rank 0 took {ended_after} s to end on SIGTERM: {output}"
    assert "stopped on SIGTERM while the ranks were meeting" in output, output[-3000:]

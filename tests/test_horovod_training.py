"""Integration: real horovodrun (Gloo) and mpirun processes training on the real digits images."""
from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from conftest import (
    HOROVODRUN,
    HYBRIDTRAIN,
    TORCHRUN,
    WITH_WORKERS,
    env_with_venv,
    horovodrun,
    rank_output,
    read_metrics,
    run,
    tiny_config,
)

from hybridtrain.data.folder import scan_split
from hybridtrain.data.presets import val_transform
from hybridtrain.models import create_model


def digest_of_file(path: str) -> str:
    """sha256 of the saved parameters and buffers, computed here from the file."""
    state = torch.load(path, map_location="cpu", weights_only=True)
    h = hashlib.sha256()
    for name, tensor in state.items():
        h.update(name.encode())
        h.update(tensor.contiguous().numpy().tobytes())
    return h.hexdigest()


def single_process_eval(run_dir: str, data_path: str, crop: int, resize: int) -> tuple[float, float, float]:
    val = scan_split(data_path, "val")
    model = create_model("resnet18", len(val.classes))
    model.load_state_dict(torch.load(os.path.join(run_dir, "final_model.pt"), weights_only=True))
    model.eval()
    tf = val_transform(crop, resize)
    from PIL import Image
    loss, top1, top5 = 0.0, 0, 0
    with torch.no_grad():
        for path, label in val.samples:
            logits = model(tf(Image.open(path).convert("RGB")).unsqueeze(0))[0]
            loss += float(torch.nn.functional.cross_entropy(logits.unsqueeze(0), torch.tensor([label])))
            ranked = logits.argsort(descending=True).tolist()
            top1 += int(ranked[0] == label)
            top5 += int(label in ranked[:5])
    n = len(val.samples)
    return loss / n, top1 / n, top5 / n


@pytest.fixture(scope="module")
def gloo_run(small_digits, tmp_path_factory):
    run_dir = str(tmp_path_factory.mktemp("runs") / "gloo")
    cfg_path = tmp_path_factory.mktemp("cfg") / "c.yaml"
    import yaml
    cfg_path.write_text(yaml.safe_dump(tiny_config(small_digits, run_dir)))
    proc = horovodrun(2, ["train", "--config", str(cfg_path)])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return run_dir, proc


def test_two_ranks_end_bitwise_identical(gloo_run):
    run_dir, _ = gloo_run
    with open(os.path.join(run_dir, "report.json")) as fh:
        report = json.load(fh)
    assert report["world_size"] == 2
    digests = report["rank_digests"]  # model + optimizer state of each rank
    assert len(digests) == 2 and digests[0] == digests[1]
    final = torch.load(os.path.join(run_dir, "final_model.pt"), weights_only=True)
    ckpt = torch.load(os.path.join(run_dir, "checkpoint-epoch0002.pt"), weights_only=True)
    for name, tensor in final.items():
        assert torch.equal(tensor, ckpt["model"][name]), name


def test_every_training_sample_seen_once_per_epoch(gloo_run, small_digits):
    run_dir, _ = gloo_run
    n_train = len(scan_split(small_digits, "train"))
    records = read_metrics(run_dir)
    assert [r["epoch"] for r in records] == [1, 2]
    assert all(r["samples_seen"] == n_train // 32 * 32 for r in records)  # full global batches of 2 x 16


def test_validation_equals_single_process_evaluation(gloo_run, small_digits):
    run_dir, _ = gloo_run
    last = read_metrics(run_dir)[-1]
    loss, top1, top5 = single_process_eval(run_dir, small_digits, 32, 32)
    assert last["val_count"] == len(scan_split(small_digits, "val"))
    assert last["val_top1"] == pytest.approx(top1, abs=1e-12)
    assert last["val_top5"] == pytest.approx(top5, abs=1e-12)
    assert last["val_loss"] == pytest.approx(loss, rel=1e-4)


def test_run_dir_holds_config_report_and_summary(gloo_run):
    run_dir, proc = gloo_run
    for name in ("config.yaml", "metrics.jsonl", "report.json", "checkpoint-epoch0002.pt"):
        assert os.path.exists(os.path.join(run_dir, name)), name
    with open(os.path.join(run_dir, "report.json")) as fh:
        report = json.load(fh)
    for key in ("world_size", "epochs", "final_top1", "final_top5", "best_top1", "total_time_s", "images_per_sec",
                "config"):
        assert key in report
    assert "| val top-1 (final / best)" in proc.stdout and "| actual average single-GPU training time" in proc.stdout
    rank1_lines = [line for line in proc.stdout.splitlines() if line.startswith("[1]<stdout>")]
    assert rank1_lines == [], "rank 1 must stay quiet"


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="no MPI installed (apt-get install openmpi-bin)")
def test_mpirun_two_ranks(small_digits, tmp_path, write_config):
    run_dir = str(tmp_path / "mpi")
    cfg = write_config(tiny_config(small_digits, run_dir, train={"epochs": 1}, optim={"warmup_epochs": 0.5}))
    root = ["--allow-run-as-root"] if os.geteuid() == 0 else []
    proc = run(["mpirun", *root, "--oversubscribe", "-np", "2", "-x", "PATH", "-x", "PYTHONUNBUFFERED",
                HYBRIDTRAIN, "train", "--config", cfg])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(os.path.join(run_dir, "report.json")) as fh:
        report = json.load(fh)
    assert report["world_size"] == 2 and len(set(report["rank_digests"])) == 1
    assert read_metrics(run_dir)[-1]["samples_seen"] == len(scan_split(small_digits, "train")) // 32 * 32


def test_interrupted_and_resumed_run_matches_uninterrupted(gloo_run, small_digits, tmp_path, write_config):
    """The uninterrupted reference is the module's 2-rank run (the same recipe in another run_dir)."""
    straight_dir, broken_dir = gloo_run[0], str(tmp_path / "broken")
    broken = write_config(tiny_config(small_digits, broken_dir), "broken.yaml")

    # Kill horovodrun as soon as epoch 1's checkpoint is durable. Its helper processes then send the ranks
    # SIGTERM, which they may still answer with a stopped-epoch checkpoint: either way the resume is exact.
    proc = subprocess.Popen([HOROVODRUN, "--gloo", "-np", "2", "-H", "localhost:2", HYBRIDTRAIN, "train", "--config",
                             broken], env=env_with_venv(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    first = os.path.join(broken_dir, "checkpoint-epoch0001.pt")
    deadline = time.time() + 300
    while not os.path.exists(first) and time.time() < deadline and proc.poll() is None:
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert os.path.exists(first)
    assert not os.path.exists(os.path.join(broken_dir, "final_model.pt")), "killed too late to test resume"

    resumed = horovodrun(2, ["train", "--config", broken, "--resume"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from " in resumed.stdout
    assert digest_of_file(os.path.join(broken_dir, "final_model.pt")) == \
        digest_of_file(os.path.join(straight_dir, "final_model.pt"))
    assert [r["epoch"] for r in read_metrics(broken_dir)] == [1, 2]


def launch_train(ranks: int, engine: str = "horovod") -> list[str]:
    """The command that starts ``hybridtrain train`` on ``ranks`` local ranks of ``engine`` (``horovod-mpi``: the
    README's ``horovodrun -np N -H localhost:N``, which runs on MPI where it is installed)."""
    if engine == "torch":
        return [TORCHRUN, "--standalone", f"--nproc-per-node={ranks}", "--no-python", HYBRIDTRAIN, "train"]
    if engine == "horovod-mpi":
        return [HOROVODRUN, "-np", str(ranks), "-H", f"localhost:{ranks}", HYBRIDTRAIN, "train"]
    return [HOROVODRUN, "--gloo", "-np", str(ranks), "-H", f"localhost:{ranks}", HYBRIDTRAIN, "train"]


def signal_a_rank_after_epoch_one(config: str, run_dir: str, ranks: int, victim: int, signum: int,
                                   delay_s: float = 0.0, engine: str = "horovod") -> tuple[subprocess.Popen, str, float]:
    """Start a ``ranks``-rank train job, send ``signum`` to rank ``victim`` ``delay_s`` after its first epoch's
    checkpoint appears, and wait (at most 120 s) for the job to end: (the job, its output, seconds it took).
    The victim is SIGKILLed and the job's process group killed on the way out, whatever happened."""
    proc = subprocess.Popen([*launch_train(ranks, engine), "--config", config], env=env_with_venv(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    victims = []
    try:
        deadline = time.time() + 300
        while not os.path.exists(os.path.join(run_dir, "checkpoint-epoch0001.pt")) and time.time() < deadline:
            time.sleep(0.1)
        time.sleep(delay_s)
        victims = rank_pids(config, victim, engine)
        assert victims, f"rank {victim} not found"
        signalled_at = time.time()
        for pid in victims:
            os.kill(pid, signum)
        output, _ = proc.communicate(timeout=120)
        return proc, output, time.time() - signalled_at
    finally:
        for pid in victims:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


RANK_VARIABLES = {"torch": "RANK", "horovod-mpi": "OMPI_COMM_WORLD_RANK"}


def rank_pids(config_path: str, rank: int, engine: str = "horovod") -> list[int]:
    """PIDs of the trainer processes of ``rank`` running ``config_path`` (from /proc): the launcher's rank variable
    (HOROVOD_RANK, or torchrun's RANK)."""
    variable = f"{RANK_VARIABLES.get(engine, 'HOROVOD_RANK')}={rank}"
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmdline = open(f"/proc/{entry}/cmdline", "rb").read().decode(errors="replace")
            environ = open(f"/proc/{entry}/environ", "rb").read().decode(errors="replace").split("\0")
        except OSError:
            continue
        if config_path in cmdline and "train" in cmdline and variable in environ:
            pids.append(int(entry))
    return pids


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="needs /proc to find the ranks")
@pytest.mark.parametrize("ranks", [3])  # 3: a survivor that is not rank 0 too; 2 ranks: the MPI case below
def test_a_killed_rank_ends_the_whole_job_quickly_naming_it(small_digits, tmp_path, write_config, ranks):
    """SIGKILL one rank at a random moment of epoch 2: within 60 s every process is gone, and one line names
    the dead rank and says how to resume."""
    run_dir = str(tmp_path / "run")
    cfg = write_config(tiny_config(small_digits, run_dir, train={"epochs": 20, "batch_size": 8}, data=WITH_WORKERS))
    victim = random.Random(ranks).randrange(1, ranks)
    proc, output, ended_after = signal_a_rank_after_epoch_one(cfg, run_dir, ranks, victim, signal.SIGKILL,
                                                              random.Random(ranks).uniform(0.0, 1.0))  # a random step
    assert proc.returncode != 0 and ended_after < 60, f"the job took {ended_after:.0f} s to end"
    lines = [x for x in output.splitlines() if "the job stopped because" in x]
    assert len(lines) == 1, output[-3000:]
    assert f"rank {victim} (its process is gone) died" in lines[0] and "--resume auto" in lines[0]
    assert "Traceback" not in rank_output(output)
    time.sleep(1)
    assert all(rank_pids(cfg, r) == [] for r in range(ranks)), "a rank was left behind"


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="needs /proc to see a process's state")
def test_a_rank_that_dies_just_after_the_failure_is_still_named_not_called_hung():
    """A killed rank's sockets close (failing its peers' collectives) before it turns into a zombie, so the
    survivors look again for a short while before saying "hung" (seen in a full run: the 3-rank case above said
    "a rank hung" about a rank it had just killed)."""
    import socket
    from types import SimpleNamespace

    from hybridtrain.distributed.failures import settled_departures
    host = socket.gethostname()
    dying = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.4)"])
    stuck = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        topo = SimpleNamespace(peers=((host, os.getpid(), None), (host, dying.pid, None)))
        assert settled_departures(topo, grace_s=10.0) == ([1], [0])  # alive at first, a zombie 0.4 s later
        topo = SimpleNamespace(peers=((host, os.getpid(), None), (host, stuck.pid, None)))
        started = time.monotonic()
        assert settled_departures(topo, grace_s=0.5) == ([], [0, 1]) and time.monotonic() - started >= 0.5
    finally:
        stuck.kill()
        for proc in (dying, stuck):
            proc.wait()


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="Open MPI's mpirun is not installed")
def test_a_killed_rank_is_named_under_the_readmes_horovodrun_on_mpi(small_digits, tmp_path, write_config):
    """The README's `horovodrun -np 2 -H localhost:2` runs on MPI here, and mpirun ends the survivors with SIGTERM at
    once, before a collective could fail: the SIGTERM watcher sees that a rank of this host is gone and names it."""
    run_dir = str(tmp_path / "run")
    cfg = write_config(tiny_config(small_digits, run_dir, train={"epochs": 20, "batch_size": 8}, data=WITH_WORKERS))
    proc, output, ended_after = signal_a_rank_after_epoch_one(cfg, run_dir, 2, 1, signal.SIGKILL, 0.3, "horovod-mpi")
    assert proc.returncode != 0 and ended_after < 60, f"the job took {ended_after:.0f} s to end"
    lines = [x for x in output.splitlines() if "the job stopped because" in x]
    assert len(lines) == 1 and "rank 1 (its process is gone) died" in lines[0], output[-3000:]
    assert "Traceback" not in rank_output(output)
    time.sleep(1)
    assert all(rank_pids(cfg, r, "horovod-mpi") == [] for r in range(2)), "a rank was left behind"

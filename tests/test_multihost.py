"""Real runs across hosts on one machine: ``hybridtrain cluster`` (hybridtrain/perf/netns_cluster.py) makes two
network namespaces with an sshd each, joined by a bridge; ``horovodrun -H h0:1,h1:1`` launches over ssh, and the
torch engine runs one ``torchrun`` per host with a c10d rendezvous on h0 (launch/README.md, "Try multi-node on one
machine"). Needs root, iproute2 and openssh-server; the cluster comes up once for the module and goes down after.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest
from conftest import HOROVODRUN, HYBRIDTRAIN, REPO, TORCHRUN, env_with_venv, tiny_config

from hybridtrain.perf import netns_cluster as cluster

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not all(shutil.which(t) for t in cluster.TOOLS) or not os.path.exists(cluster.SSHD),
    reason="needs root, iproute2 and openssh-server (HYBRIDTRAIN_SYSTEM_PACKAGES=1 ./install.sh installs them)")


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([HYBRIDTRAIN, "cluster", *args], capture_output=True, text=True, timeout=60,
                          stdin=subprocess.DEVNULL)


@pytest.fixture(scope="module")
def hosts():
    proc = cli("up", "--hosts", "2", "--link", "none")
    assert proc.returncode == 0, proc.stderr
    yield ["h0", "h1"]
    cli("down")


def on_host(host: str, argv: list[str], **kwargs) -> subprocess.Popen:
    return subprocess.Popen(cluster.host_command(host, argv), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=env_with_venv(2), cwd=REPO, stdin=subprocess.DEVNULL, **kwargs)


def test_cluster_names_its_hosts_and_goes_down_cleanly_after_a_killed_run(hosts):
    """Each host has its own hostname and resolves the other; ``down`` after a run left processes behind (and a
    second ``down``) leaves nothing, and ``up`` then makes the cluster again."""
    seen = subprocess.run(cluster.host_command("h1", ["sh", "-c", "hostname; getent hosts h0"]),
                          capture_output=True, text=True, timeout=30)
    assert seen.stdout.split()[:2] == ["h1", cluster.address(0)], seen.stdout + seen.stderr
    left = on_host("h1", ["sleep", "600"])  # a run killed mid-way leaves its processes on the host
    os.kill(int(open(os.path.join(cluster.STATE_DIR, "h0.pid")).read()), 9)  # and a dead sshd
    first, second = cli("down"), cli("down")
    assert first.returncode == 0 and "removed 3 namespaces" in first.stdout, first.stdout + first.stderr
    assert second.returncode == 0 and "no cluster" in second.stdout, second.stdout + second.stderr
    assert left.wait(timeout=10) != 0
    assert cluster.namespaces() == [] and not os.path.exists(cluster.STATE_DIR)
    assert not [n for n in os.listdir("/etc/netns") if n.startswith(cluster.PREFIX)] if os.path.isdir("/etc/netns") else True
    again = cli("up", "--hosts", "2", "--link", "none")
    assert again.returncode == 0 and again.stdout.count("sshd running") == 2, again.stdout + again.stderr


def test_horovodrun_over_ssh_between_two_hosts_ends_with_identical_ranks(hosts, small_digits, tmp_path,
                                                                          write_config):
    run_dir = str(tmp_path / "run")
    cfg = write_config(tiny_config(small_digits, run_dir, train={"epochs": 1}, optim={"warmup_epochs": 0.5}))
    proc = on_host("h0", [HOROVODRUN, "--gloo", "-np", "2", "-H", "h0:1,h1:1", "-p", str(cluster.SSH_PORT),
                          "--ssh-identity-file", cluster.identity_file(), "--network-interfaces", "eth0",
                          "--start-timeout", "60", HYBRIDTRAIN, "train", "--config", cfg])
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-3000:]
    report = json.load(open(os.path.join(run_dir, "report.json")))
    assert report["world_size"] == 2 and len(set(report["rank_digests"])) == 1


def test_one_torchrun_per_host_with_a_c10d_rendezvous_on_h0_ends_with_identical_ranks(hosts, small_digits, tmp_path,
                                                                                       write_config):
    run_dir = str(tmp_path / "run")
    cfg = write_config(tiny_config(small_digits, run_dir, train={"epochs": 1}, optim={"warmup_epochs": 0.5},
                                   distributed={"engine": "torch"}))
    procs = [on_host(host, [TORCHRUN, "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                            "--rdzv-endpoint", "h0:29400", "--rdzv-id", "multihost", "--rdzv-conf",
                            f"is_host={int(host == 'h0')}", "--no-python", HYBRIDTRAIN, "train", "--config", cfg])
             for host in hosts]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-2000:] for o in outs)
    report = json.load(open(os.path.join(run_dir, "report.json")))
    assert report["world_size"] == 2 and len(set(report["rank_digests"])) == 1

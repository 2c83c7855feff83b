"""A real two-host run on one machine: two network namespaces joined by a veth pair, an sshd in each, and
``horovodrun -np 2 -H hostA:1,hostB:1`` launching over ssh with Gloo over the veth (launch/README.md,
"Try multi-node on one machine"). Needs root, iproute2 and openssh-server; everything is torn down after.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time

import pytest
from conftest import HOROVODRUN, HYBRIDTRAIN, REPO, env_with_venv, tiny_config

SSHD = "/usr/sbin/sshd"
PORT = "2222"
pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("ip") or not os.path.exists(SSHD) or not shutil.which("ssh"),
    reason="needs root, iproute2 and openssh-server (HYBRIDTRAIN_SYSTEM_PACKAGES=1 ./install.sh installs them)")


def sh(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True, text=True, timeout=30)


@pytest.fixture
def two_hosts(tmp_path):
    """Namespaces hostA (10.77.0.1) and hostB (10.77.0.2), each with an sshd on port 2222; torn down after."""
    tag = str(os.getpid() % 100000)
    ns = {"hostA": f"hta{tag}", "hostB": f"htb{tag}"}
    addr = {"hostA": "10.77.0.1", "hostB": "10.77.0.2"}
    keys = tmp_path / "keys"
    keys.mkdir()
    sshds = []
    try:
        sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(keys / "host_key"))
        sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(keys / "id"))
        for name in ns.values():
            sh("ip", "netns", "add", name)
        sh("ip", "link", "add", f"va{tag}", "type", "veth", "peer", "name", f"vb{tag}")
        own_name = socket.gethostname()  # Gloo resolves the machine's hostname: map it to each host's own address
        for host, veth in (("hostA", f"va{tag}"), ("hostB", f"vb{tag}")):
            sh("ip", "link", "set", veth, "netns", ns[host])
            sh("ip", "-n", ns[host], "link", "set", veth, "name", "ht0")  # the same name on both hosts
            sh("ip", "-n", ns[host], "addr", "add", f"{addr[host]}/24", "dev", "ht0")
            sh("ip", "-n", ns[host], "link", "set", "lo", "up")
            sh("ip", "-n", ns[host], "link", "set", "ht0", "up")
            os.makedirs(f"/etc/netns/{ns[host]}", exist_ok=True)
            with open(f"/etc/netns/{ns[host]}/hosts", "w") as fh:
                fh.write("127.0.0.1 localhost\n" + "".join(
                    f"{addr[h]} {h}{' ' + own_name if h == host else ''}\n" for h in ns))
        os.makedirs("/run/sshd", exist_ok=True)
        for host in ns:
            pid_file = keys / f"{host}.pid"
            sh("ip", "netns", "exec", ns[host], SSHD, "-p", PORT, "-o", f"ListenAddress={addr[host]}",
               "-o", f"HostKey={keys / 'host_key'}", "-o", f"PidFile={pid_file}", "-o",
               f"AuthorizedKeysFile={keys / 'id.pub'}", "-o", "StrictModes=no", "-o", "UsePAM=no",
               "-o", "PermitRootLogin=yes")
            sshds.append(pid_file)
        yield ns, str(keys / "id")
    finally:
        for pid_file in sshds:
            for _ in range(20):
                if pid_file.exists():
                    break
                time.sleep(0.1)
            if pid_file.exists():
                subprocess.run(["kill", pid_file.read_text().strip()], capture_output=True)
        for name in ns.values():
            subprocess.run(["ip", "netns", "del", name], capture_output=True)  # takes its veth end along
            shutil.rmtree(f"/etc/netns/{name}", ignore_errors=True)


def test_horovodrun_over_ssh_between_two_hosts_ends_with_identical_ranks(two_hosts, small_digits, tmp_path,
                                                                          write_config):
    ns, identity = two_hosts
    run_dir = str(tmp_path / "run")
    cfg = write_config(tiny_config(small_digits, run_dir, train={"epochs": 1}, optim={"warmup_epochs": 0.5}))
    proc = subprocess.run(
        ["ip", "netns", "exec", ns["hostA"], HOROVODRUN, "--gloo", "-np", "2", "-H", "hostA:1,hostB:1",
         "-p", PORT, "--ssh-identity-file", identity, "--network-interfaces", "ht0", "--start-timeout", "60",
         HYBRIDTRAIN, "train", "--config", cfg],
        capture_output=True, text=True, timeout=600, env=env_with_venv(), cwd=REPO, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.load(open(os.path.join(run_dir, "report.json")))
    assert report["world_size"] == 2 and len(set(report["rank_digests"])) == 1

"""``python -m tools cluster``: N hosts on this machine, joined by rate-limited links (a cluster in a box).

Each host ``h<i>`` is a network namespace ``htc-h<i>`` with one interface ``eth0`` at 10.77.0.<i+1>/24, its own
hostname (every command run on it, and the sshd, get a UTS namespace named ``h<i>``) and an ``/etc/hosts``
(``/etc/netns/htc-h<i>/hosts``, which ``ip netns exec`` binds over /etc/hosts) naming all hosts. An sshd listens on
port 2222 of every host and takes the cluster's own key (``/run/hybridtrain-cluster/id``), and each host's
/etc/ssh (``/etc/netns/htc-h<i>/ssh``, bound over /etc/ssh like the hosts file) holds an ssh_config with that port
and key and no known-hosts file, so ``ssh h1`` and ``horovodrun -H h0:1,h1:1`` work on the hosts as they are. The
hosts' veth pairs meet on a bridge in a namespace of its own (``htc-switch``), so nothing of the machine's own
network changes.

A link rate (``tc`` syntax: 100mbit, 1gbit, 10gbit; ``none`` for no limit) puts the token-bucket filter (``tbf``) on
both ends of every host's link, so the host sends and receives at that rate. These kernels have no ``netem``, so no
latency can be added: a link here is as fast to answer as the machine's own stack (tens of microseconds).

``down`` removes every namespace, process and file the cluster made, whatever state a failed run left; running it
twice is harmless. ``up`` begins with it.
"""
from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path

from hybridtrain.errors import UserError
from hybridtrain.files import write_json_atomically
from tools.jobs import end_all

PREFIX = "htc-"
SWITCH = PREFIX + "switch"
BRIDGE = "br0"
SUBNET = "10.77.0"
SSH_PORT = 2222
STATE_DIR = "/run/hybridtrain-cluster"
IDENTITY = os.path.join(STATE_DIR, "id")  # the cluster's own ssh key
LOCK_PATH = "/run/hybridtrain-cluster.lock"  # beside STATE_DIR, which down() removes
RATE = re.compile(r"^(\d+(?:\.\d+)?)(kbit|mbit|gbit)$")
RATE_UNITS = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
TBF_BURST_S = 0.002  # tokens for 2 ms at the link rate (never less than 64 KiB: one GSO segment)
TBF_QUEUE_S = 0.02  # a packet waits at most 20 ms in the filter's queue, then is dropped
# The rates tbf keeps as asked with that burst and queue: its burst time (at least 64 KiB at the rate) is a 32-bit
# count of 1/64 us ticks (at most 274 s, so 1.91 kbit/s at least) and its queue (the burst and 20 ms of the rate) a
# 32-bit count of bytes (1.56 Tbit/s at most); below 8 bit/s tc only prints its usage.
RATE_RANGE = (2e3, 1e12)
TOOLS = ("ip", "tc", "unshare", "ssh", "ssh-keygen")
SSHD = "/usr/sbin/sshd"
SSH_CONFIG = """# python -m tools cluster: ssh between its hosts (the machine's own /etc/ssh is not used on them)
Host *
  Port {port}
  IdentityFile {identity}
  StrictHostKeyChecking no
  UserKnownHostsFile /dev/null
  LogLevel ERROR
"""


# ----------------------------------------------------------------------------- names and rates

def host_name(i: int) -> str:
    return f"h{i}"


def namespace(host: str) -> str:
    return PREFIX + host


def address(i: int) -> str:
    return f"{SUBNET}.{i + 1}"


def link_bits_per_s(rate: str) -> float | None:
    """A link rate as ``tc`` writes it (100mbit, 1gbit, 10gbit) in bit/s; ``none``: no limit (None)."""
    if rate == "none":
        return None
    found = RATE.match(rate)
    if not found:
        raise UserError(f"--link must be a rate as tc writes it (100mbit, 1gbit, 10gbit) or none, got '{rate}'")
    bits = float(found.group(1)) * RATE_UNITS[found.group(2)]
    if not RATE_RANGE[0] <= bits <= RATE_RANGE[1]:
        raise UserError(f"--link {rate}: tc's token-bucket filter keeps rates from 2kbit to 1000gbit (its burst time "
                        f"and queue are 32-bit counts), so it cannot do {rate}: choose a rate in that range, or none")
    return bits


def tbf_args(rate: str) -> list[str]:
    """tc's tbf options for ``rate``: a burst of 2 ms of the rate (at least 64 KiB) and a 20 ms queue."""
    bits = link_bits_per_s(rate)
    burst = max(64 * 1024, int(bits / 8 * TBF_BURST_S))
    return ["tbf", "rate", rate, "burst", str(burst), "latency", f"{int(TBF_QUEUE_S * 1000)}ms"]


# ----------------------------------------------------------------------------- running things

def sh(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(args, capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL)
    if check and proc.returncode != 0:
        raise UserError(f"cluster: '{' '.join(args)}' failed: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc


def host_command(host: str, argv: list[str]) -> list[str]:
    """``argv`` run on ``host``: in its network namespace (with its /etc/hosts) and a UTS namespace of its name."""
    return ["ip", "netns", "exec", namespace(host), "unshare", "--uts", "--", "sh", "-c",
            'hostname "$0" && exec "$@"', host, *argv]


def require_root() -> None:
    if os.geteuid() != 0:
        raise UserError("python -m tools cluster needs root (network namespaces, tc, sshd): run it as root")
    missing = [tool for tool in TOOLS if not shutil.which(tool)] + ([] if os.path.exists(SSHD) else [SSHD])
    if missing:
        raise UserError(f"python -m tools cluster needs {', '.join(missing)}: install iproute2, util-linux and "
                        f"openssh-server (HYBRIDTRAIN_SYSTEM_PACKAGES=1 ./install.sh)")


def hosts_now() -> list[str]:
    """The hosts of the cluster that exists now."""
    return [ns[len(PREFIX):] for ns in namespaces() if ns != SWITCH]


def namespaces() -> list[str]:
    """The cluster's namespaces that exist now (also those a failed run left)."""
    out = sh("ip", "netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(PREFIX)]


# ----------------------------------------------------------------------------- up, down, status

def set_link(host: str, rate: str) -> None:
    """Limit ``host``'s link to ``rate`` both ways (tbf on its eth0 and on its port of the switch); none: no limit."""
    for ns, dev in ((namespace(host), "eth0"), (SWITCH, host)):
        sh("ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", dev, "root", check=False)
        if rate != "none":
            sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", *tbf_args(rate))


def set_link_up(host: str, up: bool) -> None:
    """Cut ``host``'s link (its port of the switch goes down) or restore it."""
    sh("ip", "-n", SWITCH, "link", "set", host, "up" if up else "down")


def up(hosts: int, rate: str) -> dict:
    """Make the cluster (after ``down``, so whatever a failed run left goes first); on failure, remove it again."""
    require_root()
    link_bits_per_s(rate)
    down()
    try:
        return build(hosts, rate)
    except BaseException:
        down()
        raise


def build(hosts: int, rate: str) -> dict:
    names = [host_name(i) for i in range(hosts)]
    os.makedirs(STATE_DIR, mode=0o700, exist_ok=True)
    for key in ("host_key", "id"):
        sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "hybridtrain-cluster", "-f",
           os.path.join(STATE_DIR, key))
    sh("ip", "netns", "add", SWITCH)
    sh("ip", "-n", SWITCH, "link", "add", BRIDGE, "type", "bridge")
    sh("ip", "-n", SWITCH, "link", "set", BRIDGE, "up")
    hosts_file = "127.0.0.1 localhost\n" + "".join(f"{address(i)} {h}\n" for i, h in enumerate(names))
    for i, host in enumerate(names):
        ns = namespace(host)
        sh("ip", "netns", "add", ns)
        sh("ip", "-n", SWITCH, "link", "add", host, "type", "veth", "peer", "name", "eth0", "netns", ns)
        sh("ip", "-n", SWITCH, "link", "set", host, "master", BRIDGE, "up")
        sh("ip", "-n", ns, "addr", "add", f"{address(i)}/24", "dev", "eth0")
        sh("ip", "-n", ns, "link", "set", "lo", "up")
        sh("ip", "-n", ns, "link", "set", "eth0", "up")
        os.makedirs(f"/etc/netns/{ns}/ssh", exist_ok=True)  # the hosts' own /etc/ssh: plain `ssh h1` works
        Path(f"/etc/netns/{ns}/hosts").write_text(hosts_file)
        Path(f"/etc/netns/{ns}/ssh/ssh_config").write_text(SSH_CONFIG.format(port=SSH_PORT, identity=IDENTITY))
        set_link(host, rate)
    os.makedirs("/run/sshd", exist_ok=True)
    for i, host in enumerate(names):
        sh(*host_command(host, [SSHD, "-f", "/dev/null", "-p", str(SSH_PORT), "-o", f"ListenAddress={address(i)}",
                                "-o", f"HostKey={STATE_DIR}/host_key", "-o", f"PidFile={STATE_DIR}/{host}.pid",
                                "-o", f"AuthorizedKeysFile={STATE_DIR}/id.pub", "-o", "StrictModes=no",
                                "-o", "UsePAM=no", "-o", "PermitRootLogin=yes", "-o", "MaxStartups=100"]))
    state = {"hosts": names, "addresses": [address(i) for i in range(hosts)], "link": rate, "ssh_port": SSH_PORT,
             "identity": IDENTITY}
    write_json_atomically(os.path.join(STATE_DIR, "state.json"), state)
    deadline = time.monotonic() + 10.0  # each sshd writes its pid file once it listens
    for host in names:
        while not os.path.exists(os.path.join(STATE_DIR, f"{host}.pid")):
            if time.monotonic() > deadline:
                raise UserError(f"cluster: the sshd of {host} did not start: run python -m tools cluster down and "
                                f"retry")
            time.sleep(0.05)
    return state


def down() -> list[str]:
    """Remove everything the cluster made: every process in its namespaces, the namespaces (their veths go along),
    their /etc/netns folders and the state folder. Idempotent. Returns the namespaces it removed."""
    require_root()
    found = namespaces()
    for ns in found:  # every process in it (sshds, training ranks)
        end_all(lambda ns=ns: [int(p) for p in sh("ip", "netns", "pids", ns, check=False).stdout.split()])
    for ns in found:
        sh("ip", "netns", "del", ns, check=False)
    for folder in Path("/etc/netns").glob(PREFIX + "*"):
        shutil.rmtree(folder, ignore_errors=True)
    shutil.rmtree(STATE_DIR, ignore_errors=True)
    return found


@contextmanager
def in_use(what: str, alone: bool):
    """This command's hold on the cluster, one per machine (its hosts are this machine's namespaces): ``alone`` (up,
    down, scale --cluster, which make or remove hosts) excludes every other holder; the others (exec, the link
    probe) share it, so one torchrun per host runs beside the next. A command that cannot have it is one line naming
    the holder. The kernel drops the hold when the process ends, however it ends. Root's, as the cluster is."""
    require_root()
    fd = os.open(LOCK_PATH, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        try:
            fcntl.flock(fd, (fcntl.LOCK_EX if alone else fcntl.LOCK_SH) | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another command"
            raise UserError(f"the cluster in a box is in use by {holder}: {what} waits for nothing, so rerun it "
                            f"when that has ended (the cluster is one per machine: its hosts are this machine's "
                            f"network namespaces)") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{what} (pid {os.getpid()})".encode(), 0)
        yield
    finally:
        os.close(fd)


def status() -> dict | None:
    """The cluster as it is now: hosts, their link rate and state, sshd alive; None when there is none."""
    found = namespaces()
    if not found:
        return None
    try:
        state = json.loads(Path(STATE_DIR, "state.json").read_text())
    except (OSError, ValueError):
        return {"broken": True, "namespaces": found}
    rows = []
    for host, addr in zip(state["hosts"], state["addresses"]):
        link = sh("ip", "-n", SWITCH, "-o", "link", "show", host, check=False).stdout
        qdisc = sh("ip", "netns", "exec", namespace(host), "tc", "qdisc", "show", "dev", "eth0", check=False).stdout
        rate = re.search(r"rate (\S+)", qdisc)
        rows.append({"host": host, "address": addr, "link": rate.group(1) if rate else "none",
                     "up": "state UP" in link or ",UP" in link.split(">")[0],
                     "sshd": sshd_alive(host)})
    return {**state, "broken": False, "rows": rows}


def sshd_alive(host: str) -> bool:
    try:
        os.kill(int(Path(STATE_DIR, f"{host}.pid").read_text()), 0)
        return True
    except (OSError, ValueError):
        return False


def link_counters(hosts: list[str]) -> dict:
    """Totals over ``hosts`` so far: TCP segments retransmitted (each host's /proc/net/snmp), packets dropped
    (by the tbf queues and the veth devices, both ends of every host's link), and the machine's backlog drops (a
    veth hands a packet to its peer's CPU backlog, netdev_max_backlog long, which drops it when full)."""
    retransmits = dropped = 0
    for host in hosts:
        snmp = sh("ip", "netns", "exec", namespace(host), "cat", "/proc/net/snmp").stdout.splitlines()
        tcp = [line.split()[1:] for line in snmp if line.startswith("Tcp:")]
        retransmits += int(dict(zip(tcp[0], tcp[1]))["RetransSegs"])
        for ns, dev in ((namespace(host), "eth0"), (SWITCH, host)):
            qdisc = sh("ip", "netns", "exec", ns, "tc", "-s", "qdisc", "show", "dev", dev).stdout
            dropped += sum(int(n) for n in re.findall(r"dropped (\d+)", qdisc))
            stats = json.loads(sh("ip", "-n", ns, "-j", "-s", "link", "show", dev).stdout)[0]["stats64"]
            dropped += stats["rx"]["dropped"] + stats["tx"]["dropped"]
    with open("/proc/net/softnet_stat") as fh:  # per CPU, the whole machine: column 2 counts packets dropped
        backlog = sum(int(line.split()[1], 16) for line in fh)  # because the input backlog was full
    return {"tcp_retransmits": retransmits, "dropped_packets": dropped, "backlog_drops": backlog}


def format_status(state: dict | None) -> str:
    if state is None:
        return "no cluster (python -m tools cluster up --hosts N --link RATE makes one)"
    if state["broken"]:
        return (f"a broken cluster: namespaces {', '.join(state['namespaces'])} without their state file: "
                f"python -m tools cluster down removes them")
    lines = [f"{len(state['hosts'])} hosts, ssh port {state['ssh_port']}, key {state['identity']}"]
    lines += [f"{r['host']:>4} {r['address']:<12} link {r['link']:<8} {'up' if r['up'] else 'CUT'}  "
              f"sshd {'running' if r['sshd'] else 'GONE'}" for r in state["rows"]]
    return "\n".join(lines)

"""Time a transfer between every pair of hosts over ssh and name a slow host's link (``link_probe.json``).

    python -m tools.cluster.link_probe --hosts h0,h1,h2 --out RUN_DIR [--megabytes 8]

For each pair (a, b), one after the other: a receiver on b (``ssh b python -c ...``) listens on a free port and
prints it, a sender on a connects and sends the bytes, and the receiver times them from its first byte to its last
(ssh's and python's start-up and the connection are not counted). A synchronous all-reduce makes every rank's step
time the same, so step times cannot say whose link is slow; these transfers can (hybridtrain/reports/links.py:
a host's rate is its fastest transfer). Needs what horovodrun needs: ``ssh HOST`` without a password from where it
runs, and this python at the same path on every host. The run's report (``hybridtrain report RUN_DIR``, and the
one at the end of training) shows the result when RUN_DIR holds the file.
"""
from __future__ import annotations

import argparse
import itertools
import os
import shlex
import subprocess
import sys
import time

from hybridtrain.errors import UserError
from hybridtrain.files import check_output_dir, write_json_atomically
from hybridtrain.launched_by import run_guarded
from hybridtrain.reports.links import PROBE_FILE, host_rates, links_lines, probe_problem
from tools.cluster.netns import in_use
from tools.jobs import stopped_cleanly

TIMEOUT_S = 60
RECEIVER = """import socket, sys, time
server = socket.socket()
server.bind(("", 0))
server.listen(1)
server.settimeout(float(sys.argv[1]))
print(server.getsockname()[1], flush=True)
conn, _ = server.accept()
conn.settimeout(float(sys.argv[1]))
buf = bytearray(1 << 20)
first = conn.recv_into(buf)
start, counted = time.perf_counter(), 0
while True:
    n = conn.recv_into(buf)
    if not n:
        break
    counted += n
print(counted, time.perf_counter() - start, flush=True)
"""
SENDER = """import socket, sys
conn = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[4]))
chunk = bytes(1 << 20)
for _ in range(int(sys.argv[3])):
    conn.sendall(chunk)
conn.close()
"""


def on_host(host: str, code: str, *args: str) -> subprocess.Popen:
    """``python -c code args`` on ``host`` over ssh."""
    remote = shlex.join([sys.executable, "-c", code, *args])
    return subprocess.Popen(["ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=10", host, remote],
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def failed(host: str, proc: subprocess.Popen, what: str, stderr: str | None = None) -> UserError:
    """One line for a probe process that failed (killed first; ``stderr``: what communicate() read of it)."""
    proc.kill()
    err = (proc.stderr.read() if stderr is None else stderr).strip().splitlines()
    return UserError(f"link probe: {what} on {host} failed ({err[-1] if err else 'no output'}): check that "
                     f"'ssh {host}' works without a password and that {sys.executable} exists there")


def transfer(sender: str, receiver: str, megabytes: int) -> dict:
    """One timed transfer of ``megabytes`` MiB from ``sender`` to ``receiver``: bytes, seconds, bit/s."""
    recv = on_host(receiver, RECEIVER, str(TIMEOUT_S))
    port = recv.stdout.readline().strip()
    if not port.isdigit():
        raise failed(receiver, recv, "the receiver")
    send = on_host(sender, SENDER, receiver, port, str(megabytes), str(TIMEOUT_S))
    try:
        send.wait(timeout=TIMEOUT_S)
        if send.returncode:  # no connection: the receiver would wait for one until its timeout
            recv.kill()
            raise failed(sender, send, f"the sender to {receiver}")
        out, err = recv.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        recv.kill()
        raise failed(sender, send, f"a transfer to {receiver} (over {TIMEOUT_S} s)") from None
    if recv.returncode or len(out.split()) != 2:
        raise failed(receiver, recv, f"the receiver of {sender}'s transfer", err)
    counted, seconds = int(out.split()[0]), float(out.split()[1])
    return {"from": sender, "to": receiver, "bytes": counted, "seconds": seconds,
            "bits_per_s": 8 * counted / max(seconds, 1e-9)}


def probe(hosts: list[str], megabytes: int) -> dict:
    """A transfer for every pair of ``hosts``, one at a time, each host's rate and the lines naming a slow one."""
    pairs = [transfer(a, b, megabytes) for a, b in itertools.combinations(hosts, 2)]
    problem = probe_problem(pairs)
    if problem:  # judged before anything is computed from it or written
        raise UserError(f"link probe: {problem}: {megabytes} MiB per transfer is too little to time; give more with "
                        f"--megabytes (up to {MEGABYTES[1]})")
    rates = host_rates(pairs)
    return {"hosts": hosts, "megabytes": megabytes, "measured_at": time.strftime("%Y-%m-%d %H:%M:%S UTC",
                                                                                 time.gmtime()),
            "pairs": pairs, "host_bits_per_s": rates, "lines": links_lines(rates)}


MEGABYTES = (1, 1024)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m tools.cluster.link_probe",
                                     description="time a transfer between every pair of hosts; name a slow link")
    parser.add_argument("--hosts", required=True, help="the hosts, e.g. h0,h1,h2 (three or more can name a slow one)")
    parser.add_argument("--out", required=True, help="the run_dir that gets link_probe.json (its report shows it)")
    parser.add_argument("--megabytes", type=int, default=8, metavar="1..1024", help="MiB per transfer (default 8)")
    return parser


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if not MEGABYTES[0] <= args.megabytes <= MEGABYTES[1]:
        raise UserError(f"--megabytes must be in [{MEGABYTES[0]}, {MEGABYTES[1]}] (MiB per transfer), got "
                        f"{args.megabytes}")
    hosts = [h.strip() for h in args.hosts.split(",") if h.strip()]
    if len(hosts) < 2 or len(set(hosts)) != len(hosts):
        raise UserError(f"--hosts must list two or more hosts, each once (e.g. h0,h1,h2), got '{args.hosts}'")
    out = check_output_dir(args.out, "--out")
    with in_use("link probe", alone=False), stopped_cleanly("its transfers ended"):
        result = probe(hosts, args.megabytes)
    for pair in result["pairs"]:
        print(f"{pair['from']} -> {pair['to']}: {pair['bits_per_s'] / 1e6:.0f} Mbit/s ({pair['seconds']:.3f} s)")
    print("\n".join(result["lines"]))
    os.makedirs(out, exist_ok=True)
    print(f"written to {write_json_atomically(os.path.join(out, PROBE_FILE), result)}")
    return 0


if __name__ == "__main__":
    sys.exit(run_guarded(lambda: main(sys.argv[1:])))

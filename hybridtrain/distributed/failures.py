"""Naming a rank that died or hung, from the (host, pid, GPU) table gathered at init."""
from __future__ import annotations

import hashlib
import os
import socket
import sys
import tempfile
import threading
import time

from hybridtrain.errors import PeerFailure


def process_alive(pid: int) -> bool:
    """A running process (a zombie that its launcher has not reaped yet counts as dead)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def departed(topo) -> tuple[list[int], list[int]]:
    """(ranks on this host whose process is gone, ranks on this host still alive), from ``topo.peers``."""
    host = socket.gethostname()
    local = [(rank, pid) for rank, (h, pid, *_) in enumerate(topo.peers) if h == host]  # (host, pid, GPU id)
    return ([rank for rank, pid in local if not process_alive(pid)],
            [rank for rank, pid in local if process_alive(pid)])


EXIT_GRACE_S = 2.0  # a killed process closes its sockets before it becomes a zombie: its peers can learn first


def settled_departures(topo, grace_s: float = EXIT_GRACE_S) -> tuple[list[int], list[int]]:
    """departed(), looked at again for up to ``grace_s`` while every local rank still looks alive: the kernel
    closes a killed process's sockets (which fails its peers' collectives) before the process turns into a
    zombie, so right after the failure a dead rank can still look alive."""
    deadline = time.monotonic() + grace_s
    gone, alive = departed(topo)
    while not gone and time.monotonic() < deadline:
        time.sleep(0.05)
        gone, alive = departed(topo)
    return gone, alive


REPORT_LOCK = threading.Lock()


def peer_failure(topo) -> PeerFailure:
    """The one line a surviving rank prints, printed here by the first of its host to report (``first_to_report``):
    which rank died (when it ran on this host) and how to resume."""
    gone, alive = settled_departures(topo) if topo.peers else ([], [topo.rank])
    host = socket.gethostname()
    if gone:
        cause = (f"rank {', '.join(map(str, gone))} ({'its process is' if len(gone) == 1 else 'their processes are'} "
                 f"gone) died or failed (its error line, if any, says why)")
    elif topo.peers and all(h == host for h, *_ in topo.peers):
        # every rank's process is still there: one of them stopped taking part (stopped, stuck in I/O, deadlocked)
        cause = ("a rank hung: every rank's process is alive, but one stopped taking part in the collectives (its "
                 "error line, if any, says which); Horovod's stall limit (distributed.stall_shutdown_s) or Gloo's "
                 "timeout (distributed.gloo_timeout_s) ended the wait")
    else:
        lost = unreachable_hosts(topo.peers, host)
        cause = (f"this rank lost host {', '.join(lost)}: it does not answer on the network (its link is down or it is "
                 f"off)" if lost else "a rank on another host died, hung or failed (its error line, if any, says why)")
    failure = PeerFailure(f"the job stopped because {cause}; checkpoints are intact: rerun the same command with "
                          f"--resume auto")
    # the line goes out here, under a lock, before either thread that learns of the failure (a failed collective
    # on the main thread, the launcher's SIGTERM on the signal thread, which then ends the process) can go on:
    # printed later by the main thread, it was lost when the signal thread ended the process first
    with REPORT_LOCK:
        if first_to_report(topo):
            print(f"hybridtrain: {failure}", file=sys.stderr, flush=True)
    return failure


PROBE_PORT = 22  # a host that is up answers here: sshd accepts, or the kernel refuses; a cut link answers nothing
PROBE_TIMEOUT_S = 2.0


def answers(host: str, port: int = PROBE_PORT, timeout_s: float = PROBE_TIMEOUT_S) -> bool:
    """True when ``host`` answers a TCP connect on ``port`` within ``timeout_s`` (accepted or refused)."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except (ConnectionRefusedError, socket.gaierror):  # refused: up; a name this host cannot resolve: unknown
        return True
    except OSError:  # timed out, no route
        return False


def unreachable_hosts(peers, own_host: str) -> list[str]:
    """The other hosts of ``peers`` ((host, pid, GPU) per rank) that do not answer on the network, each as
    'NAME (rank R, ...)'."""
    ranks: dict[str, list[int]] = {}
    for rank, (h, *_) in enumerate(peers):
        if h != own_host:
            ranks.setdefault(h, []).append(rank)
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(max_workers=min(32, len(ranks) or 1)) as pool:  # all at once: one timeout in all
        answered = dict(zip(ranks, pool.map(answers, ranks)))
    return [f"{h} (rank {', '.join(map(str, r))})" for h, r in ranks.items() if not answered[h]]


def first_to_report(topo) -> bool:
    """True for the first surviving rank of this host to report the failure: the survivors learn of it at
    different moments and by different ways (a failed collective, the launcher's SIGTERM), and one line is
    enough. A file created exclusively, named after the job's processes, decides."""
    if not topo.peers:
        return True
    # the host in the name too: hosts that share a temp folder (python -m tools cluster's) each still report
    job = hashlib.sha256(repr((topo.peers, socket.gethostname())).encode()).hexdigest()[:16]
    try:
        os.close(os.open(os.path.join(tempfile.gettempdir(), f"hybridtrain-failure-{job}"),
                         os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
        return True
    except FileExistsError:
        return False
    except OSError:  # no writable temp folder: the lowest rank still alive speaks
        return topo.rank == min(departed(topo)[1], default=topo.rank)

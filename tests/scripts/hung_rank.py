"""Under horovodrun -np 2: rank 1 freezes (SIGSTOP: its process stays, its Horovod thread stops) while rank 0 waits
in an all-reduce; both run through the CLI's guard. argv: --set style config overrides (horovod.*)."""
from __future__ import annotations

import os
import signal
import sys

import torch

from hybridtrain.cli import run_guarded
from hybridtrain.config import load_config
from hybridtrain.distributed import collectives as distributed
from hybridtrain.distributed import failures
from hybridtrain.errors import is_peer_failure


def work() -> int:
    cfg = load_config(None, sys.argv[1:])
    topo = distributed.init(1, cfg, device="cpu")
    if topo.rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)  # hung for good; horovodrun kills it when the job ends
    try:
        distributed.allreduce_sum(torch.ones(3), "hung")
    except RuntimeError as exc:
        if is_peer_failure(exc):
            raise failures.peer_failure(topo) from None
        raise
    return 0


if __name__ == "__main__":
    sys.exit(run_guarded(work))

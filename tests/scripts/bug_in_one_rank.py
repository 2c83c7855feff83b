"""Under horovodrun -np 2: rank 1 hits a bug (ZeroDivisionError) while rank 0 waits in a collective; both run
through the CLI's guard, with RUN_DIR (argv[1]) as the folder for the crash log."""
from __future__ import annotations

import sys

from hybridtrain.cli import run_guarded
from hybridtrain.distributed import collectives as distributed


def work() -> int:
    topo = distributed.init(1, device="cpu")
    if topo.rank == 1:
        return 1 // 0
    distributed.barrier()  # rank 1 never arrives: Horovod shuts rank 0 down
    return 0


if __name__ == "__main__":
    sys.exit(run_guarded(work, lambda: sys.argv[1]))

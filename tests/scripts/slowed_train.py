"""``hybridtrain train ARGS`` with a slow loader on purpose: each training batch takes SLOW_BATCH_S more seconds to
collate (the torchvision backend in the rank's own process, data.in_process), on every rank or on rank SLOW_RANK
only (a straggler). Nothing else changes: the real trainer, engine and launcher."""
from __future__ import annotations

import os
import sys
import time

from hybridtrain.cli import main
from hybridtrain.data import torchvision_loader
from hybridtrain.launched_by import launcher_rank


def slow_train_loader(create):
    delay, rank = float(os.environ.get("SLOW_BATCH_S", "0")), os.environ.get("SLOW_RANK", "")

    def created(*args, **kwargs):
        loader = create(*args, **kwargs)
        if not rank or int(rank) == launcher_rank():
            collate = loader.collate_fn

            def slow_collate(items):
                time.sleep(delay)
                return collate(items)
            loader.collate_fn = slow_collate
        return loader
    return created


if __name__ == "__main__":
    torchvision_loader.create_train_loader = slow_train_loader(torchvision_loader.create_train_loader)
    sys.exit(main(sys.argv[1:]))

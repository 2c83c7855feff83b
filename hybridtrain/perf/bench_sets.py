"""The config overrides of one ``hybridtrain bench`` row, torch-free: the command checks its recipe with them
before it imports torch (a typo is refused at once), and ``step_bench`` loads each row's config with them. A precision
mode's are the ``precision`` experiment's (``precision_sets``)."""
from __future__ import annotations

from hybridtrain.reports.experiments import precision_sets


def row_sets(overrides: list[str], spec: str | None, batch: int | None) -> list[str]:
    """A row's overrides: the command's, then the precision mode's (None: the recipe's), then the batch (None: the
    recipe's train.batch_size)."""
    return list(overrides) + (precision_sets(spec) if spec else []) + (
        [f"train.batch_size={batch}"] if batch is not None else [])

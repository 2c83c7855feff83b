"""The config overrides of one ``python -m benchmarks bench`` row, torch-free: the command checks its recipe with them
before it imports torch (a typo is refused at once), and ``step_bench`` loads each row's config with them."""
from __future__ import annotations


def precision_sets(spec: str) -> list[str]:
    """``mixed-bf16`` -> the config overrides it stands for."""
    mode, _, dtype = spec.partition("-")
    # each mode with its own loss scaling and all-reduce compression (auto), whatever the recipe's mode had
    sets = [f"precision.mode={mode}", "precision.loss_scaling=auto", "distributed.compression=auto"]
    sets += [f"precision.compute_dtype={dtype}"] if dtype else []
    if mode == "fp16_pure":
        sets += ["optim.name=goyal", "model.residual_bn_scale=0.25"]  # FP16 state: no AdaBound (docs/precision.md)
    return sets


def row_sets(overrides: list[str], spec: str | None, batch: int | None) -> list[str]:
    """A row's overrides: the command's, then the precision mode's (None: the recipe's), then the batch (None: the
    recipe's train.batch_size)."""
    return list(overrides) + (precision_sets(spec) if spec else []) + (
        [f"train.batch_size={batch}"] if batch is not None else [])

"""metrics.jsonl, a run's record of its epochs: written one line per epoch, read back tolerantly. Torch-free, so
that ``hybridtrain report`` reads a run without loading torch."""
from __future__ import annotations

import json
import os
import sys

from hybridtrain.errors import UserError
from hybridtrain.files import write_text_atomically


def truncate_metrics(path: str, completed_epochs: int) -> list[dict]:
    """Keep the records of the first ``completed_epochs`` epochs (a resumed run rewrites what came after);
    written to a temp file and renamed (files.write_text_atomically), so a kill leaves the old file or the new
    one, and a temp file that the next start removes (rundir.TEMP_RE)."""
    if not os.path.exists(path):
        return []
    kept = [r for r in read_metrics(path) if r["epoch"] <= completed_epochs]
    write_text_atomically(path, "".join(json.dumps(r) + "\n" for r in kept))
    return kept


# What a record needs to be reported at all, and what older versions' records may lack (reported as NaN)
RECORD_REQUIRED = ("epoch", "val_top1")
RECORD_FIGURES = ("train_loss", "train_top1", "val_loss", "val_top5", "lr", "epoch_time_s", "train_time_s",
                  "images_per_sec", "samples_seen", "wall_time_s")


def read_metrics(path: str) -> list[dict]:
    """The records of a metrics.jsonl. A record cut short by a kill (the last line) is dropped with a warning;
    a damaged line elsewhere is one error line."""
    if not os.path.exists(path):
        return []
    with open(path, errors="replace") as fh:
        lines = [line for line in fh.read().splitlines() if line.strip()]
    records = []
    for number, line in enumerate(lines, 1):
        try:
            record = json.loads(line)
            if not isinstance(record, dict) or any(key not in record for key in RECORD_REQUIRED):
                raise ValueError(f"a record needs {', '.join(RECORD_REQUIRED)}")
        except ValueError as exc:
            if number == len(lines):
                print(f"hybridtrain: warning: {path}: dropping its last line, which is cut short or damaged "
                      f"({str(exc)[:80]}); a resumed run writes that epoch again", file=sys.stderr)
                break
            raise UserError(f"{path} line {number} is not a metrics record ({str(exc)[:80]}): remove that line "
                            f"or restore the file") from None
        records.append(record)
    return records

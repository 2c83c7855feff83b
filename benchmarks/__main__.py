"""``python -m benchmarks``: the trainer's benchmarks (bench, max-batch, bench-optim, bench-data, scale)."""
import sys

from benchmarks.cli import main

sys.exit(main())

"""``python -m tools``: the research tools beside the trainer (predict, cluster, experiment)."""
import sys

from tools.cli import main

sys.exit(main())

"""``python -m hybridtrain.cli``: the ``hybridtrain`` command."""
import sys

from hybridtrain.cli import main

sys.exit(main())

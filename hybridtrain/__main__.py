import os
import sys

# `torchrun ... hybridtrain train` in the repository's root runs this file as a script, with the package's own
# folder first on sys.path, where its subfolders (data, engine, optim, ...) would shadow other libraries' modules
if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    sys.path.pop(0)

from hybridtrain.cli import main  # noqa: E402

sys.exit(main())

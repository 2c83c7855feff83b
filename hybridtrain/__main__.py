import sys

from hybridtrain.cli import main

sys.exit(main())

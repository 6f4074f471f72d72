"""`python -m cosystream`: the `cosystream` command without its console script."""

import sys

from cosystream.cli import main

sys.exit(main())

"""`python -m moejax.train` is `moejax-train`."""

import sys

from moejax.cli.train import main

sys.exit(main())

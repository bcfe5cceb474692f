"""Exit 2 for bad input found while a checkpoint was being read (moejax-train, moejax-eval, moejax-generate)."""

from __future__ import annotations

import os
import sys


def exit_bad_input_now(prog: str, error: Exception):
    """One line on the process's own stderr, then exit 2 at once. A failed orbax restore can leave tensorstore
    reads in flight whose callbacks would print tracebacks into a closed event loop at interpreter exit: leaving
    with os._exit runs none of them."""
    sys.__stderr__.write(f"{prog}: error: {error}\n")
    sys.stdout.flush()
    sys.__stderr__.flush()
    os._exit(2)
